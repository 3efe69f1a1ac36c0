//! The VM-wide KVM state ([`VmState`]): the in-kernel irqchip (the two
//! 8259 PICs and the IOAPIC, `KVM_GET_IRQCHIP`/`KVM_SET_IRQCHIP`) and the
//! KVM clock (`KVM_GET_CLOCK`/`KVM_SET_CLOCK`).
//!
//! No PIT: the VM never creates one (`KVM_CREATE_PIT2`; the guest's timers
//! are the LAPIC's, see [`crate::acpi`]), so there is none to save. The
//! vCPUs' local APICs are in their [`super::cpu_state::VcpuState`].
//!
//! Capture with the vCPUs paused. Restore into a VM whose irqchip exists
//! (`KVM_CREATE_IRQCHIP`) after its vCPUs' states are restored and just
//! before they resume: the irqchip first, the clock last, so the guest's
//! clock does not count the time the restore took twice. The clock is
//! restored with `KVM_CLOCK_REALTIME` (as upstream does): KVM advances it
//! by the host's wall time elapsed since the capture, so a guest restored
//! later sees time that has passed. The other flags `KVM_GET_CLOCK`
//! returns (`KVM_CLOCK_TSC_STABLE`, `KVM_CLOCK_HOST_TSC`) describe the
//! host at the capture and mean nothing to `KVM_SET_CLOCK`: not kept.

use std::time::{SystemTime, UNIX_EPOCH};

use kvm_bindings::{
    kvm_clock_data, kvm_ioapic_state, kvm_irqchip, kvm_pic_state, KVM_CLOCK_REALTIME,
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
};
use serde::{Deserialize, Serialize};

use crate::vm::Vm;

/// IOAPIC redirection table entries (`KVM_IOAPIC_NUM_PINS`).
pub const IOAPIC_PINS: usize = 24;

/// Errors of capturing, validating and restoring the VM state.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum VmStateError {
    #[error("{what}")]
    Ioctl {
        what: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("field {field}: {why}")]
    BadField { field: &'static str, why: String },
}

/// One 8259 PIC (`kvm_pic_state`).
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PicState {
    pub last_irr: u8,
    pub irr: u8,
    pub imr: u8,
    pub isr: u8,
    pub priority_add: u8,
    pub irq_base: u8,
    pub read_reg_select: u8,
    pub poll: u8,
    pub special_mask: u8,
    pub init_state: u8,
    pub auto_eoi: u8,
    pub rotate_on_auto_eoi: u8,
    pub special_fully_nested_mode: u8,
    pub init4: u8,
    pub elcr: u8,
    pub elcr_mask: u8,
}

impl From<&kvm_pic_state> for PicState {
    fn from(p: &kvm_pic_state) -> PicState {
        PicState {
            last_irr: p.last_irr,
            irr: p.irr,
            imr: p.imr,
            isr: p.isr,
            priority_add: p.priority_add,
            irq_base: p.irq_base,
            read_reg_select: p.read_reg_select,
            poll: p.poll,
            special_mask: p.special_mask,
            init_state: p.init_state,
            auto_eoi: p.auto_eoi,
            rotate_on_auto_eoi: p.rotate_on_auto_eoi,
            special_fully_nested_mode: p.special_fully_nested_mode,
            init4: p.init4,
            elcr: p.elcr,
            elcr_mask: p.elcr_mask,
        }
    }
}

impl From<&PicState> for kvm_pic_state {
    fn from(p: &PicState) -> kvm_pic_state {
        kvm_pic_state {
            last_irr: p.last_irr,
            irr: p.irr,
            imr: p.imr,
            isr: p.isr,
            priority_add: p.priority_add,
            irq_base: p.irq_base,
            read_reg_select: p.read_reg_select,
            poll: p.poll,
            special_mask: p.special_mask,
            init_state: p.init_state,
            auto_eoi: p.auto_eoi,
            rotate_on_auto_eoi: p.rotate_on_auto_eoi,
            special_fully_nested_mode: p.special_fully_nested_mode,
            init4: p.init4,
            elcr: p.elcr,
            elcr_mask: p.elcr_mask,
        }
    }
}

/// The IOAPIC (`kvm_ioapic_state`); each redirection entry is the 64-bit
/// register as the guest programs it.
#[allow(missing_docs)]
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IoapicState {
    pub base_address: u64,
    pub ioregsel: u32,
    pub id: u32,
    pub irr: u32,
    /// [`IOAPIC_PINS`] entries.
    pub redirtbl: Vec<u64>,
}

/// The KVM clock: the guest's kvmclock nanoseconds at the capture and the
/// host's wall time then (`KVM_CLOCK_REALTIME`, filled from the host
/// clock when KVM did not give it).
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClockState {
    pub clock_ns: u64,
    pub realtime_ns: u64,
}

/// The VM-wide state of a paused VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmState {
    /// The master PIC (IRQs 0..8).
    pub pic_master: PicState,
    /// The slave PIC (IRQs 8..16).
    pub pic_slave: PicState,
    /// The IOAPIC.
    pub ioapic: IoapicState,
    /// The KVM clock.
    pub clock: ClockState,
}

fn ioctl(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmStateError {
    move |source| VmStateError::Ioctl { what, source }
}

fn get_chip(vm: &Vm, chip_id: u32, what: &'static str) -> Result<kvm_irqchip, VmStateError> {
    let mut chip = kvm_irqchip {
        chip_id,
        ..Default::default()
    };
    vm.fd().get_irqchip(&mut chip).map_err(ioctl(what))?;
    Ok(chip)
}

impl VmState {
    /// Captures the irqchip and the clock of `vm`, whose vCPUs are paused.
    pub fn capture(vm: &Vm) -> Result<VmState, VmStateError> {
        let master = get_chip(vm, KVM_IRQCHIP_PIC_MASTER, "KVM_GET_IRQCHIP (PIC master)")?;
        let slave = get_chip(vm, KVM_IRQCHIP_PIC_SLAVE, "KVM_GET_IRQCHIP (PIC slave)")?;
        let ioapic = get_chip(vm, KVM_IRQCHIP_IOAPIC, "KVM_GET_IRQCHIP (IOAPIC)")?;
        // SAFETY: KVM filled the union member of each chip id it was asked
        // for (`pic` for the PICs, `ioapic` for the IOAPIC); both are plain
        // integers, valid for any bits.
        let (master, slave, io) = unsafe { (master.chip.pic, slave.chip.pic, ioapic.chip.ioapic) };
        let redirtbl = io
            .redirtbl
            .iter()
            // SAFETY: `bits` covers the whole 64-bit entry; any bits are a
            // valid u64.
            .map(|e| unsafe { e.bits })
            .collect();
        let clock = vm.fd().get_clock().map_err(ioctl("KVM_GET_CLOCK"))?;
        let realtime_ns = if clock.flags & KVM_CLOCK_REALTIME != 0 {
            clock.realtime
        } else {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        };
        Ok(VmState {
            pic_master: (&master).into(),
            pic_slave: (&slave).into(),
            ioapic: IoapicState {
                base_address: io.base_address,
                ioregsel: io.ioregsel,
                id: io.id,
                irr: io.irr,
                redirtbl,
            },
            clock: ClockState {
                clock_ns: clock.clock,
                realtime_ns,
            },
        })
    }

    /// Checks the sizes KVM cannot check for us.
    pub fn validate(&self) -> Result<(), VmStateError> {
        if self.ioapic.redirtbl.len() != IOAPIC_PINS {
            return Err(VmStateError::BadField {
                field: "ioapic.redirtbl",
                why: format!(
                    "{} entries, expected {IOAPIC_PINS}",
                    self.ioapic.redirtbl.len()
                ),
            });
        }
        Ok(())
    }

    /// Puts this state into `vm` (its irqchip created, its vCPUs restored
    /// and paused): the PICs, the IOAPIC, then the clock. Validates first.
    pub fn restore(&self, vm: &Vm) -> Result<(), VmStateError> {
        self.validate()?;
        let set = |chip: &kvm_irqchip, what| vm.fd().set_irqchip(chip).map_err(ioctl(what));
        for (chip_id, pic, what) in [
            (
                KVM_IRQCHIP_PIC_MASTER,
                &self.pic_master,
                "KVM_SET_IRQCHIP (PIC master)",
            ),
            (
                KVM_IRQCHIP_PIC_SLAVE,
                &self.pic_slave,
                "KVM_SET_IRQCHIP (PIC slave)",
            ),
        ] {
            let mut chip = kvm_irqchip {
                chip_id,
                ..Default::default()
            };
            chip.chip.pic = pic.into();
            set(&chip, what)?;
        }
        let mut io = kvm_ioapic_state {
            base_address: self.ioapic.base_address,
            ioregsel: self.ioapic.ioregsel,
            id: self.ioapic.id,
            irr: self.ioapic.irr,
            ..Default::default()
        };
        for (e, &bits) in io.redirtbl.iter_mut().zip(&self.ioapic.redirtbl) {
            e.bits = bits;
        }
        let mut chip = kvm_irqchip {
            chip_id: KVM_IRQCHIP_IOAPIC,
            ..Default::default()
        };
        chip.chip.ioapic = io;
        set(&chip, "KVM_SET_IRQCHIP (IOAPIC)")?;
        let clock = kvm_clock_data {
            clock: self.clock.clock_ns,
            flags: KVM_CLOCK_REALTIME,
            realtime: self.clock.realtime_ns,
            ..Default::default()
        };
        vm.fd().set_clock(&clock).map_err(ioctl("KVM_SET_CLOCK"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> VmState {
        VmState {
            pic_master: PicState {
                imr: 0xfb,
                irq_base: 0x20,
                elcr_mask: 0xf8,
                ..Default::default()
            },
            pic_slave: PicState {
                imr: 0xff,
                irq_base: 0x28,
                ..Default::default()
            },
            ioapic: IoapicState {
                base_address: 0xfec0_0000,
                ioregsel: 0x10,
                id: 0,
                irr: 0,
                redirtbl: (0..IOAPIC_PINS as u64)
                    .map(|i| 0x1_0000 | (0x30 + i))
                    .collect(),
            },
            clock: ClockState {
                clock_ns: 123_456_789,
                realtime_ns: 1_700_000_000_000_000_000,
            },
        }
    }

    #[test]
    fn round_trips_through_json_and_refuses_unknown_fields() {
        let s = sample();
        s.validate().unwrap();
        let j = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<VmState>(&j).unwrap(), s);
        let mut v = serde_json::to_value(&s).unwrap();
        v["pit"] = serde_json::json!({});
        assert!(serde_json::from_value::<VmState>(v).is_err());
        let mut v = serde_json::to_value(&s).unwrap();
        v["clock"]["flags"] = 1.into();
        assert!(serde_json::from_value::<VmState>(v).is_err());
    }

    #[test]
    fn validate_names_a_short_or_long_ioapic_table() {
        for n in [0, IOAPIC_PINS - 1, IOAPIC_PINS + 1] {
            let mut s = sample();
            s.ioapic.redirtbl.resize(n, 0);
            let e = s.validate().unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("field ioapic.redirtbl: {n} entries, expected {IOAPIC_PINS}")
            );
        }
    }

    #[test]
    fn pic_state_converts_both_ways() {
        let p = PicState {
            last_irr: 1,
            irr: 2,
            imr: 3,
            isr: 4,
            priority_add: 5,
            irq_base: 6,
            read_reg_select: 7,
            poll: 8,
            special_mask: 9,
            init_state: 10,
            auto_eoi: 11,
            rotate_on_auto_eoi: 12,
            special_fully_nested_mode: 13,
            init4: 14,
            elcr: 15,
            elcr_mask: 16,
        };
        let k: kvm_pic_state = (&p).into();
        assert_eq!(PicState::from(&k), p);
    }
}
