//! Interrupts through KVM's in-kernel irqchip: the GSI routing table
//! (IO-APIC pins for the legacy lines, one MSI route per MSI-X vector) and
//! irqfds, so that a device raises an interrupt by writing an eventfd,
//! from any thread, without a vCPU exit.
//!
//! `KVM_SET_GSI_ROUTING` replaces the whole table, so [`GsiRouter`] keeps
//! it: the default IO-APIC and PIC routes KVM installs with the irqchip,
//! plus every MSI route, rewritten whenever the guest programs an MSI-X
//! entry.

use std::sync::{Arc, Mutex, MutexGuard};

use kvm_bindings::{
    kvm_irq_routing_entry, KvmIrqRouting, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE, KVM_IRQ_ROUTING_IRQCHIP, KVM_IRQ_ROUTING_MSI,
};
use kvm_ioctls::VmFd;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::boot::layout::IOAPIC_PINS;
use crate::pci::{InterruptSink, MsixEntry};

/// First GSI handed to MSI routes (after the IO-APIC pins).
pub const MSI_GSI_START: u32 = IOAPIC_PINS;
/// GSIs KVM routes at most (`KVM_MAX_IRQ_ROUTES` is 4096).
pub const MAX_GSI: u32 = 4096;

/// Errors of interrupt setup.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum IrqError {
    #[error("creating an eventfd for GSI {gsi}")]
    EventFd {
        gsi: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("KVM_IRQFD for GSI {gsi}")]
    Irqfd {
        gsi: u32,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("KVM_SET_GSI_ROUTING ({routes} routes)")]
    SetRouting {
        routes: usize,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("building the GSI routing table")]
    RoutingTable,
    #[error("all {MAX_GSI} GSIs are in use")]
    OutOfGsis,
}

/// What one MSI GSI is routed to (`None`: not programmed yet).
#[derive(Debug, Default)]
struct Routes {
    next_gsi: u32,
    msi: Vec<(u32, Option<MsixEntry>)>,
}

/// The VM's GSI routing table.
#[derive(Debug)]
pub struct GsiRouter {
    vm: Arc<VmFd>,
    routes: Mutex<Routes>,
}

fn irqchip_route(gsi: u32, chip: u32, pin: u32) -> kvm_irq_routing_entry {
    let mut e = kvm_irq_routing_entry {
        gsi,
        type_: KVM_IRQ_ROUTING_IRQCHIP,
        ..Default::default()
    };
    e.u.irqchip.irqchip = chip;
    e.u.irqchip.pin = pin;
    e
}

fn msi_route(gsi: u32, m: &MsixEntry) -> kvm_irq_routing_entry {
    let mut e = kvm_irq_routing_entry {
        gsi,
        type_: KVM_IRQ_ROUTING_MSI,
        ..Default::default()
    };
    e.u.msi.address_lo = m.addr as u32;
    e.u.msi.address_hi = (m.addr >> 32) as u32;
    e.u.msi.data = m.data;
    e
}

impl GsiRouter {
    /// The router of `vm`, whose in-kernel irqchip exists already.
    pub fn new(vm: Arc<VmFd>) -> Arc<GsiRouter> {
        Arc::new(GsiRouter {
            vm,
            routes: Mutex::new(Routes {
                next_gsi: MSI_GSI_START,
                msi: Vec::new(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Routes> {
        self.routes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The VM fd (irqfd registration).
    pub fn vm(&self) -> &VmFd {
        &self.vm
    }

    /// Allocates `n` MSI GSIs (unrouted until programmed).
    pub fn allocate(&self, n: u32) -> Result<Vec<u32>, IrqError> {
        let mut r = self.lock();
        let end = r.next_gsi.checked_add(n).filter(|e| *e <= MAX_GSI);
        let end = end.ok_or(IrqError::OutOfGsis)?;
        let gsis: Vec<u32> = (r.next_gsi..end).collect();
        r.msi.extend(gsis.iter().map(|g| (*g, None)));
        r.next_gsi = end;
        Ok(gsis)
    }

    /// Routes `gsi` to the MSI `entry` (or removes its route) and installs
    /// the table.
    pub fn set_msi(&self, gsi: u32, entry: Option<MsixEntry>) -> Result<(), IrqError> {
        let mut r = self.lock();
        if let Some(slot) = r.msi.iter_mut().find(|(g, _)| *g == gsi) {
            slot.1 = entry;
        }
        self.install(&r)
    }

    /// Installs the default table (legacy lines only).
    pub fn install_defaults(&self) -> Result<(), IrqError> {
        let r = self.lock();
        self.install(&r)
    }

    fn install(&self, r: &Routes) -> Result<(), IrqError> {
        let mut entries = Vec::new();
        for gsi in 0..IOAPIC_PINS {
            entries.push(irqchip_route(gsi, KVM_IRQCHIP_IOAPIC, gsi));
            // The PIC lines, as KVM's default table has them (GSI 2 is the
            // cascade).
            match gsi {
                0 | 1 | 3..=7 => entries.push(irqchip_route(gsi, KVM_IRQCHIP_PIC_MASTER, gsi)),
                8..=15 => entries.push(irqchip_route(gsi, KVM_IRQCHIP_PIC_SLAVE, gsi - 8)),
                _ => {}
            }
        }
        for (gsi, m) in &r.msi {
            if let Some(m) = m {
                entries.push(msi_route(*gsi, m));
            }
        }
        let table = KvmIrqRouting::from_entries(&entries).map_err(|_| IrqError::RoutingTable)?;
        self.vm
            .set_gsi_routing(&table)
            .map_err(|source| IrqError::SetRouting {
                routes: entries.len(),
                source,
            })
    }
}

/// An eventfd registered as an irqfd on `gsi`.
pub fn irqfd(vm: &VmFd, gsi: u32) -> Result<EventFd, IrqError> {
    let fd = EventFd::new(EFD_NONBLOCK).map_err(|source| IrqError::EventFd { gsi, source })?;
    vm.register_irqfd(&fd, gsi)
        .map_err(|source| IrqError::Irqfd { gsi, source })?;
    Ok(fd)
}

/// The MSI-X vectors of one PCI function: an irqfd and a GSI each.
#[derive(Debug)]
pub struct MsixIrqs {
    router: Arc<GsiRouter>,
    vectors: Vec<(u32, EventFd)>,
}

impl MsixIrqs {
    /// `n` vectors with their GSIs and irqfds.
    pub fn new(router: Arc<GsiRouter>, n: u16) -> Result<MsixIrqs, IrqError> {
        let gsis = router.allocate(u32::from(n))?;
        let vectors = gsis
            .into_iter()
            .map(|gsi| Ok((gsi, irqfd(router.vm(), gsi)?)))
            .collect::<Result<Vec<_>, IrqError>>()?;
        Ok(MsixIrqs { router, vectors })
    }
}

impl InterruptSink for MsixIrqs {
    fn trigger(&self, vector: u16) -> std::io::Result<()> {
        match self.vectors.get(usize::from(vector)) {
            Some((_, fd)) => fd.write(1),
            None => Err(std::io::Error::other(format!(
                "MSI-X vector {vector} out of range"
            ))),
        }
    }

    fn program(&self, vector: u16, entry: MsixEntry) {
        let Some((gsi, _)) = self.vectors.get(usize::from(vector)) else {
            return;
        };
        // A masked entry keeps its route: the MSI-X model holds its
        // interrupts back as pending, and the address is what the guest
        // left there.
        let route = (entry.addr != 0).then_some(entry);
        if let Err(e) = self.router.set_msi(*gsi, route) {
            log::error!("MSI-X vector {vector} (GSI {gsi}): {e}");
        }
    }
}
