//! Host KVM tier for the vCPU and VM state of a snapshot (issue 17
//! groundwork, `vmm::snapshot::{cpu_state, vm_state}`): the test guest
//! counts in a register and a RAM word; its vCPU and VM state are captured
//! on the vCPU's thread while paused, restored into a fresh VM with the RAM
//! copied, and the count goes on from where it was.
//!
//! Without a usable `/dev/kvm` a test prints `SKIPPED <test>: no /dev/kvm`
//! and passes, except under CI (`CI` set) when `/dev/kvm` exists: then it
//! must work.

use std::sync::Arc;
use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress};
use vmm::cpu;
use vmm::seccomp_filters;
use vmm::snapshot::cpu_state::{CpuStateContext, CpuStateError, Msr, VcpuState};
use vmm::snapshot::hex_bytes::HexBytes;
use vmm::snapshot::vm_state::{VmState, VmStateError};
use vmm::testguest::{Step, TestGuest};
use vmm::vcpu::{self, VcpuControl, VcpuStop, VcpuThread};
use vmm::{Vm, VmConfig};

mod common;
use common::{chain, vm_or_skip};

const M2: u64 = 2 << 20;
/// The guest's counter word.
const COUNTER: u64 = 0x10_0000;
/// Where the count starts: far from zero, so a guest that lost its
/// registers (and counts again from 0 in `rax`) never catches up with it
/// within the deadline.
const START: u64 = 1 << 40;
/// How long the guest gets to count past a mark.
const DEADLINE: Duration = Duration::from_secs(20);
const MSR_IA32_TSC: u32 = 0x10;
const MSR_KVM_SYSTEM_TIME_NEW: u32 = 0x4b56_4d01;
const MSR_KVM_WALL_CLOCK_NEW: u32 = 0x4b56_4d00;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;

/// Set in the child of [`the_round_trips_run_under_the_seccomp_filters`]:
/// the VMM's filters are on, as in the binary.
const SECCOMP_CHILD: &str = "PCOW_SNAPSHOT_KVM_SECCOMP";

/// In that child: `--seccomp true` for the process (once) and the VMM
/// thread's list on the calling thread before it makes a VM, as `main`
/// does; the vCPU threads it spawns then install theirs ([`vcpu::spawn`]).
fn confine_if_asked() {
    static INIT: std::sync::Once = std::sync::Once::new();
    if std::env::var_os(SECCOMP_CHILD).is_none() {
        return;
    }
    INIT.call_once(|| {
        seccomp_filters::init(vmm::config::options::Seccomp::True).expect("seccomp init")
    });
    seccomp_filters::apply(seccomp_filters::ThreadKind::Vmm).expect("seccomp vmm");
}

/// A VM with its in-kernel irqchip, or `None` (SKIPPED) without KVM.
fn vm_with_irqchip(test: &str) -> Option<Vm> {
    confine_if_asked();
    let vm = vm_or_skip(test, M2)?;
    vm.fd().create_irq_chip().expect("KVM_CREATE_IRQCHIP");
    Some(vm)
}

/// A running machine: its vCPU threads under their control.
struct Running {
    ctl: Arc<VcpuControl>,
    threads: Vec<VcpuThread>,
}

impl Running {
    /// Stops the vCPUs; each must end because of the stop (not a guest
    /// fault or an error).
    fn stop(mut self) {
        self.ctl.stop();
        for t in std::mem::take(&mut self.threads) {
            let (stop, _) = t.join().unwrap_or_else(|e| panic!("vCPU: {}", chain(&e)));
            assert_eq!(stop, VcpuStop::Stopped);
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.ctl.stop();
        for t in std::mem::take(&mut self.threads) {
            let _ = t.join();
        }
    }
}

/// Starts a thread for each of `vcpus` under `ctl`.
fn spawn(ctl: &Arc<VcpuControl>, vcpus: Vec<vmm::Vcpu>) -> Running {
    let threads = vcpus
        .into_iter()
        .map(|v| vcpu::spawn(v, ctl.clone(), Box::new(|_: u16, _: &[u8]| {})).expect("spawn"))
        .collect();
    Running {
        ctl: ctl.clone(),
        threads,
    }
}

/// VM 1: the counting guest on vCPU 0 of `nvcpus`, each set up as the
/// machine sets up a vCPU (CPUID, boot MSRs, LAPIC), running; the other
/// vCPUs wait in their LAPIC for an INIT/SIPI that never comes.
fn start_counter(vm: &Vm, nvcpus: u8) -> Running {
    let guest = TestGuest {
        checks: vec![Step::Count { gpa: COUNTER }],
        idle: None,
    };
    let loaded = guest.load(vm.memory(), vm.ram_end()).expect("load guest");
    let base = cpu::supported_cpuid(vm.kvm()).expect("cpuid");
    let vcpus: Vec<_> = (0..nvcpus)
        .map(|id| {
            let vcpu = vm.create_vcpu(id).expect("vcpu");
            let cpuid = cpu::patch_cpuid(&base, id, nvcpus, cpu::tsc_deadline(vm.kvm()));
            cpu::configure(&vcpu, &cpuid).expect("configure");
            vcpu
        })
        .collect();
    loaded.configure(&vcpus[0]).expect("configure guest");
    spawn(&VcpuControl::new().expect("control"), vcpus)
}

/// Fresh vCPUs in `vm`, their threads started under a paused control
/// (they wait before their first `KVM_RUN`), as a restored machine starts.
fn start_paused(vm: &Vm, nvcpus: u8) -> Running {
    let ctl = VcpuControl::new().expect("control");
    ctl.pause().expect("pause");
    let vcpus = (0..nvcpus)
        .map(|id| vm.create_vcpu(id).expect("vcpu"))
        .collect();
    spawn(&ctl, vcpus)
}

fn counter(vm: &Vm) -> u64 {
    vm.memory()
        .read_obj::<u64>(GuestAddress(COUNTER))
        .expect("read counter")
}

/// Waits until the counter is above `mark`; returns it. Fails if it is
/// ever seen below `floor`.
fn wait_counter_above(vm: &Vm, floor: u64, mark: u64, what: &str) -> u64 {
    let start = Instant::now();
    loop {
        let c = counter(vm);
        assert!(c >= floor, "{what}: counter {c} fell below {floor}");
        if c > mark {
            return c;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "{what}: counter stuck at {c} (waiting for more than {mark})"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Runs the counter in a VM, pauses it past `mark` and captures its state
/// and RAM; the VM is dropped.
fn counted_snapshot(
    test: &str,
    nvcpus: u8,
    mark: u64,
) -> Option<(Vec<VcpuState>, VmState, Vec<u8>, u64)> {
    let vm = vm_with_irqchip(test)?;
    vm.memory()
        .write_obj(START, GuestAddress(COUNTER))
        .expect("counter start");
    let run = start_counter(&vm, nvcpus);
    wait_counter_above(&vm, START, START + mark, "VM 1");
    run.ctl.pause().expect("pause");
    let ctx = CpuStateContext::new(&vm).expect("context");
    let states = run
        .ctl
        .save_states(&ctx)
        .unwrap_or_else(|e| panic!("save: {}", chain(&e)));
    let vm_state = VmState::capture(&vm).unwrap_or_else(|e| panic!("vm state: {}", chain(&e)));
    let at = counter(&vm);
    let mut ram = vec![0u8; M2 as usize];
    vm.memory()
        .read_slice(&mut ram, GuestAddress(0))
        .expect("copy RAM");
    run.stop();
    drop(vm);
    Some((states, vm_state, ram, at))
}

/// A fresh VM 2 with `ram` copied in and a paused vCPU thread.
fn fresh_vm_with(test: &str, ram: &[u8], nvcpus: u8) -> Option<(Vm, Running)> {
    let vm = vm_with_irqchip(test)?;
    vm.memory()
        .write_slice(ram, GuestAddress(0))
        .expect("RAM in");
    let run = start_paused(&vm, nvcpus);
    Some((vm, run))
}

#[test]
fn vcpu_and_vm_state_restored_into_a_fresh_vm_capture_the_same() {
    let test = "vcpu_and_vm_state_restored_into_a_fresh_vm_capture_the_same";
    // Two vCPUs: 0 counts, 1 waits for a SIPI (another mp_state).
    let Some((states, vm_state, ram, _)) = counted_snapshot(test, 2, 1000) else {
        return;
    };
    assert_eq!(states.len(), 2);
    assert_eq!(states[1].id, 1);
    assert_eq!(
        states[1].mp_state,
        kvm_bindings::KVM_MP_STATE_UNINITIALIZED,
        "vCPU 1 waits for INIT/SIPI"
    );
    let s = &states[0];
    assert_eq!(s.id, 0);
    assert_eq!(s.regs.rdi, COUNTER, "the count step holds its address");
    assert!(
        s.regs.rax > START + 1000,
        "rax holds the count: {}",
        s.regs.rax
    );
    assert_ne!(s.sregs.efer & (1 << 10), 0, "long mode active");
    assert!(!s.cpuid.is_empty(), "the CPUID the VMM set");
    let has = |i: u32| s.msrs.iter().any(|m| m.index == i);
    assert!(has(MSR_IA32_TSC), "TSC saved");
    assert!(has(MSR_KVM_SYSTEM_TIME_NEW), "kvmclock system time saved");
    assert!(has(MSR_KVM_WALL_CLOCK_NEW), "kvmclock wall clock saved");
    assert!(has(MSR_MTRR_DEF_TYPE), "MTRR default type saved");
    // The state survives its JSON form.
    let json = serde_json::to_string(&states).expect("to json");
    let back: Vec<VcpuState> = serde_json::from_str(&json).expect("from json");
    assert_eq!(back, states);
    let json = serde_json::to_string(&vm_state).expect("to json");
    assert_eq!(
        serde_json::from_str::<VmState>(&json).expect("from json"),
        vm_state
    );

    let Some((vm2, run)) = fresh_vm_with(test, &ram, 2) else {
        return;
    };
    let ctx = CpuStateContext::new(&vm2).expect("context");
    eprintln!(
        "{test}: {} of {} MSRs readable and saved, {} CPUID entries, json {} bytes",
        s.msrs.len(),
        ctx.msr_indices.len(),
        s.cpuid.len(),
        serde_json::to_string(&states).map(|j| j.len()).unwrap_or(0)
    );
    // In reverse order: each vCPU takes the state with its id.
    let reversed: Vec<VcpuState> = back.iter().rev().cloned().collect();
    run.ctl
        .restore_states(&reversed, &ctx)
        .unwrap_or_else(|e| panic!("restore: {}", chain(&e)));
    vm_state
        .restore(&vm2)
        .unwrap_or_else(|e| panic!("vm restore: {}", chain(&e)));
    // Captured again before any KVM_RUN: the same, register set by register
    // set, but for the clocks, which ran meanwhile.
    let again = run.ctl.save_states(&ctx).expect("save again");
    assert_eq!(again.len(), 2);
    for (a, s) in again.iter().zip(&states) {
        same_vcpu_state(a, s);
    }
    let vm_again = VmState::capture(&vm2).expect("vm state again");
    assert_eq!(vm_again.pic_master, vm_state.pic_master, "PIC master");
    assert_eq!(vm_again.pic_slave, vm_state.pic_slave, "PIC slave");
    assert_eq!(vm_again.ioapic, vm_state.ioapic, "IOAPIC");
    assert!(
        vm_again.clock.clock_ns >= vm_state.clock.clock_ns,
        "the KVM clock went on: {:?} then {:?}",
        vm_state.clock,
        vm_again.clock
    );
    run.stop();
}

/// `a`, captured from a vCPU restored from `s` before it ran, is `s`,
/// register set by register set, but for the TSC, which ran meanwhile.
fn same_vcpu_state(a: &VcpuState, s: &VcpuState) {
    assert_eq!(a.id, s.id);
    assert_eq!(a.cpuid, s.cpuid, "cpuid");
    assert_eq!(a.tsc_khz, s.tsc_khz, "tsc_khz");
    assert_eq!(a.mp_state, s.mp_state, "mp_state");
    assert_eq!(a.regs, s.regs, "regs");
    assert_eq!(a.sregs, s.sregs, "sregs");
    assert_eq!(a.fpu, s.fpu, "fpu");
    assert_eq!(a.xsave, s.xsave, "xsave");
    assert_eq!(a.xcrs, s.xcrs, "xcrs");
    assert_eq!(a.lapic, s.lapic, "lapic");
    assert_eq!(a.debugregs, s.debugregs, "debugregs");
    assert_eq!(a.events, s.events, "events");
    let indices = |v: &[Msr]| v.iter().map(|m| m.index).collect::<Vec<_>>();
    assert_eq!(indices(&a.msrs), indices(&s.msrs), "the same MSRs");
    for (m2, m1) in a.msrs.iter().zip(&s.msrs) {
        if m1.index == MSR_IA32_TSC {
            // The guest TSC ticks with the host's, paused or not: later,
            // but not by more than the test's own run time (in cycles at
            // under 10 GHz).
            assert!(m2.data >= m1.data, "TSC went back");
            assert!(m2.data - m1.data < 10_000_000_000 * 60, "TSC jumped");
        } else {
            assert_eq!(m2, m1, "vCPU {}: MSR {:#x}", s.id, m1.index);
        }
    }
}

#[test]
fn the_guest_counts_on_from_where_it_was_in_a_fresh_vm() {
    let test = "the_guest_counts_on_from_where_it_was_in_a_fresh_vm";
    // VM 1 counts, is paused and captured, and is dropped.
    let Some((states, vm_state, ram, at)) = counted_snapshot(test, 1, 5000) else {
        return;
    };
    assert!(at > START + 5000);
    // VM 2: fresh, RAM copied in, vCPU restored before its first run.
    let Some((vm2, run)) = fresh_vm_with(test, &ram, 1) else {
        return;
    };
    assert_eq!(counter(&vm2), at, "RAM copied");
    let ctx = CpuStateContext::new(&vm2).expect("context");
    run.ctl
        .restore_states(&states, &ctx)
        .unwrap_or_else(|e| panic!("restore: {}", chain(&e)));
    vm_state
        .restore(&vm2)
        .unwrap_or_else(|e| panic!("vm restore: {}", chain(&e)));
    run.ctl.resume();
    // It goes on from `at` (the guest counts from `rax`: a vCPU that had
    // lost its registers would count from 0 again), and keeps going.
    let first = wait_counter_above(&vm2, at, at, "VM 2");
    let later = wait_counter_above(&vm2, first, first + 1000, "VM 2");
    assert!(later > first);
    // Pause and check: the vCPU is where the count step loops.
    run.ctl.pause().expect("pause");
    let now = run.ctl.save_states(&ctx).expect("save");
    assert_eq!(now[0].regs.rdi, COUNTER);
    assert!(now[0].regs.rax >= later);
    eprintln!("{test}: counter {at} at the snapshot, {later} after the restore");
    run.stop();
}

/// The two round trips above again, in a child process with the VMM's
/// seccomp filters on (`--seccomp true`): every vCPU state ioctl runs on a
/// vCPU thread under the vCPU list, the VM state and the set-up under the
/// VMM's. A request missing from a table kills the child with the SIGSYS
/// report.
#[test]
fn the_round_trips_run_under_the_seccomp_filters() {
    let test = "the_round_trips_run_under_the_seccomp_filters";
    for name in [
        "vcpu_and_vm_state_restored_into_a_fresh_vm_capture_the_same",
        "the_guest_counts_on_from_where_it_was_in_a_fresh_vm",
    ] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([name, "--exact", "--nocapture", "--test-threads=1"])
            .env(SECCOMP_CHILD, "1")
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(
            out.status.success() && !stderr.contains("seccomp:"),
            "{name} under the filters: {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
            out.status
        );
        if stdout.contains("SKIPPED") {
            println!("SKIPPED {test}: no /dev/kvm");
            return;
        }
        assert!(stdout.contains("1 passed"), "{name}: {stdout}");
    }
}

#[test]
fn a_state_that_does_not_fit_fails_naming_what() {
    let test = "a_state_that_does_not_fit_fails_naming_what";
    let Some((states, vm_state, ram, _)) = counted_snapshot(test, 1, 10) else {
        return;
    };
    let Some((vm2, run)) = fresh_vm_with(test, &ram, 1) else {
        return;
    };
    let ctx = CpuStateContext::new(&vm2).expect("context");
    let err = |r: Result<(), vmm::VcpuError>| chain(&r.expect_err("must fail"));

    // Two states for one vCPU.
    let mut two = states.clone();
    let mut other = states[0].clone();
    other.id = 1;
    two.push(other);
    let e = err(run.ctl.restore_states(&two, &ctx));
    assert!(e.contains("2 vCPU states for 1 vCPUs"), "{e}");
    // No state has this vCPU's id.
    let mut wrong = states.clone();
    wrong[0].id = 3;
    let e = err(run.ctl.restore_states(&wrong, &ctx));
    assert!(
        e.contains("vCPU 0: field id: no state for this vCPU"),
        "{e}"
    );
    // A LAPIC page of the wrong size.
    let mut short = states.clone();
    short[0].lapic = HexBytes(vec![0; 100]);
    let e = err(run.ctl.restore_states(&short, &ctx));
    assert!(e.contains("field lapic: 100 bytes, expected 1024"), "{e}");
    // An MSR value KVM refuses: reserved bits of the MTRR default type.
    let mut bad = states.clone();
    let m = bad[0]
        .msrs
        .iter_mut()
        .find(|m| m.index == MSR_MTRR_DEF_TYPE)
        .expect("MTRR default type saved");
    m.data = u64::MAX;
    let e = run.ctl.restore_states(&bad, &ctx).expect_err("must fail");
    assert!(
        matches!(
            &e,
            vmm::VcpuError::State(CpuStateError::MsrRejected { id: 0, index, data })
                if *index == MSR_MTRR_DEF_TYPE && *data == u64::MAX
        ),
        "{e:?}"
    );
    assert!(
        chain(&e).contains("KVM refused MSR 0x2ff = 0xffffffffffffffff"),
        "{}",
        chain(&e)
    );
    // Special registers KVM refuses: paging without protected mode.
    let mut sregs = states.clone();
    sregs[0].sregs.cr0 &= !1;
    let e = err(run.ctl.restore_states(&sregs, &ctx));
    assert!(e.contains("vCPU 0: KVM_SET_SREGS"), "{e}");
    // An unknown mp_state.
    let mut mp = states.clone();
    mp[0].mp_state = 99;
    let e = err(run.ctl.restore_states(&mp, &ctx));
    assert!(e.contains("field mp_state: 99"), "{e}");
    // A VM state with a short IOAPIC table.
    let mut vs = vm_state.clone();
    vs.ioapic.redirtbl.truncate(3);
    let e = vs.restore(&vm2).expect_err("must fail");
    assert!(matches!(
        e,
        VmStateError::BadField {
            field: "ioapic.redirtbl",
            ..
        }
    ));
    // A VM without an in-kernel irqchip has no irqchip state to take.
    let bare = Vm::new(&VmConfig { ram_size: M2 }).expect("VM");
    let e = chain(&vm_state.restore(&bare).expect_err("must fail"));
    assert!(e.starts_with("KVM_SET_IRQCHIP (PIC master)"), "{e}");
    let e = chain(&VmState::capture(&bare).expect_err("must fail"));
    assert!(e.starts_with("KVM_GET_IRQCHIP (PIC master)"), "{e}");
    drop(bare);
    // Not paused: refused.
    let idle = VcpuControl::new().expect("control");
    let e = err(idle.restore_states(&[], &ctx));
    assert!(e.contains("must be paused"), "{e}");
    // After all that, the right state still restores and the guest counts
    // on.
    let at = counter(&vm2);
    run.ctl
        .restore_states(&states, &ctx)
        .unwrap_or_else(|e| panic!("restore: {}", chain(&e)));
    vm_state.restore(&vm2).expect("vm restore");
    run.ctl.resume();
    wait_counter_above(&vm2, at, at + 100, "VM 2");
    run.stop();
}

#[test]
fn msrs_kvm_cannot_read_are_left_out_and_the_rest_saved() {
    let test = "msrs_kvm_cannot_read_are_left_out_and_the_rest_saved";
    let Some(vm) = vm_with_irqchip(test) else {
        return;
    };
    let run = start_paused(&vm, 1);
    let real = CpuStateContext::new(&vm).expect("context");
    // Two MSRs no x86 CPU has, first, in the middle and last: KVM stops a
    // read at each; the capture goes on past it.
    let bogus = [0xdead_0000, 0xdead_0001];
    let mut indices = vec![bogus[0]];
    let half = real.msr_indices.len() / 2;
    indices.extend(&real.msr_indices[..half]);
    indices.push(bogus[1]);
    indices.extend(&real.msr_indices[half..]);
    indices.push(bogus[0] + 2);
    let ctx = Arc::new(CpuStateContext {
        msr_indices: indices,
        ..(*real).clone()
    });
    let states = run.ctl.save_states(&ctx).expect("save");
    let saved: Vec<u32> = states[0].msrs.iter().map(|m| m.index).collect();
    assert_eq!(saved, real.msr_indices, "every real MSR, none of the bogus");
    run.stop();
}
