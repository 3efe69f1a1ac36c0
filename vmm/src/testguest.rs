//! The project's tiny test guest: 64-bit code assembled by hand here (no
//! external assembler), entered directly in long mode set up through
//! `KVM_SET_SREGS`: a GDT in guest memory and identity page tables with
//! 2 MiB pages (1 GiB pages triple-fault on the host's emulating KVM).
//!
//! The guest walks a table of [`Check`]s. For each it optionally writes a
//! pattern of 64-bit words (`seed`, `seed + stride`, `seed + 2*stride`,
//! ...) at a guest-physical address, then reads the words back and
//! compares, and reports the result as a 32-bit `out` to [`TEST_PORT`]
//! (see [`Report`]). After the table it reports [`Report::Done`] and either
//! halts or, with [`TestGuest::idle`], spins (inside `KVM_RUN`) and polls
//! the port with `in` until the host answers non-zero, then halts.
//!
//! Guest memory layout (all in the first 64 KiB of RAM):
//!
//! | address | content |
//! |---|---|
//! | `0x1000` | GDT: null, code64, data, TSS |
//! | `0x2000` | PML4 |
//! | `0x3000` | PDPT |
//! | `0x4000..0xc000` | up to 8 page directories (2 MiB pages, 8 GiB: RAM and pmem regions from 4 GiB) |
//! | `0xc000` | code |
//! | `0xd000..0x10000` | the check table (40 bytes an entry, zero-terminated) |

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use crate::vcpu::{Vcpu, VcpuError};

/// The port the guest reports on.
pub const TEST_PORT: u16 = 0x0510;
/// Bit set in a report for a failed check.
const FAIL_BIT: u32 = 1 << 31;
/// Bit set in the final report.
const DONE_BIT: u32 = 1 << 30;

const GDT_ADDR: u64 = 0x1000;
const PML4_ADDR: u64 = 0x2000;
const PDPT_ADDR: u64 = 0x3000;
const PD_ADDR: u64 = 0x4000;
const MAX_PDS: u64 = 8;
const CODE_ADDR: u64 = 0xc000;
const TABLE_ADDR: u64 = 0xd000;
const TABLE_END: u64 = 0x10000;
const ENTRY_SIZE: u64 = 40;
/// Lowest RAM size the layout needs.
pub const MIN_RAM: u64 = 0x10000;
const GIB: u64 = 1 << 30;
const MIB2: u64 = 2 << 20;

/// Errors of building or loading the test guest.
#[allow(missing_docs)] // the messages document the variants
#[derive(Debug, thiserror::Error)]
pub enum TestGuestError {
    #[error("{0} checks do not fit the table (at most {max})", max = (TABLE_END - TABLE_ADDR) / ENTRY_SIZE - 1)]
    TooManyChecks(usize),
    #[error("check {index}: {why}")]
    BadCheck { index: usize, why: &'static str },
    #[error("guest RAM of {0:#x} bytes is below the layout's {MIN_RAM:#x}")]
    SmallRam(u64),
    #[error("identity map up to {0:#x} needs more than {MAX_PDS} page directories")]
    MapTooLarge(u64),
    #[error("writing the guest into its memory")]
    Memory(#[source] vm_memory::GuestMemoryError),
    #[error("jump at {at:#x} cannot reach {target:#x} with an 8-bit offset")]
    JumpRange { at: usize, target: usize },
    #[error("setting up the vCPU")]
    Vcpu(#[source] VcpuError),
}

/// One check of the guest: `qwords` words at guest address `gpa`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Check {
    /// Guest-physical address (8-byte aligned).
    pub gpa: u64,
    /// Number of 64-bit words (at least 1).
    pub qwords: u64,
    /// First word.
    pub seed: u64,
    /// Added to each next word (0 with seed 0: all zeros).
    pub stride: u64,
    /// Write the pattern before verifying it (otherwise only verify
    /// what is there).
    pub write: bool,
}

impl Check {
    /// The bytes the check writes or expects.
    pub fn bytes(&self) -> Vec<u8> {
        (0..self.qwords)
            .flat_map(|i| {
                self.seed
                    .wrapping_add(i.wrapping_mul(self.stride))
                    .to_le_bytes()
            })
            .collect()
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.qwords * 8
    }

    /// Whether the check covers no bytes (never valid).
    pub fn is_empty(&self) -> bool {
        self.qwords == 0
    }
}

/// What the guest reported on [`TEST_PORT`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Report {
    /// Check `n` (0-based) matched.
    Pass(u32),
    /// Check `n` found a word that differs.
    Fail(u32),
    /// The table is done; `n` checks ran.
    Done(u32),
}

impl Report {
    /// Decodes a 32-bit `out` to [`TEST_PORT`].
    pub fn decode(v: u32) -> Report {
        if v & DONE_BIT != 0 {
            Report::Done(v & !DONE_BIT)
        } else if v & FAIL_BIT != 0 {
            Report::Fail(v & !FAIL_BIT)
        } else {
            Report::Pass(v)
        }
    }
}

/// A test guest: its checks and how it ends.
#[derive(Debug, Clone, Default)]
pub struct TestGuest {
    /// The checks, in order.
    pub checks: Vec<Check>,
    /// After the table, spin this many loop iterations between polls of
    /// the port (`in`), and halt when the host answers non-zero; `None`
    /// halts at once.
    pub idle: Option<u32>,
}

/// A hand assembler: bytes with labels for forward jumps.
struct Asm {
    code: Vec<u8>,
    labels: Vec<Option<usize>>,
    /// (offset of the displacement, label, width 1 or 4)
    fixups: Vec<(usize, usize, u8)>,
}

#[derive(Clone, Copy)]
struct Label(usize);

impl Asm {
    fn new() -> Asm {
        Asm {
            code: Vec::new(),
            labels: Vec::new(),
            fixups: Vec::new(),
        }
    }

    fn label(&mut self) -> Label {
        self.labels.push(None);
        Label(self.labels.len() - 1)
    }

    fn bind(&mut self, l: Label) {
        self.labels[l.0] = Some(self.code.len());
    }

    fn op(&mut self, bytes: &[u8]) {
        self.code.extend_from_slice(bytes);
    }

    /// An instruction ending in an 8-bit relative jump offset to `l`.
    fn jmp8(&mut self, opcode: &[u8], l: Label) {
        self.op(opcode);
        self.fixups.push((self.code.len(), l.0, 1));
        self.code.push(0);
    }

    /// An instruction ending in a 32-bit relative jump offset to `l`.
    fn jmp32(&mut self, opcode: &[u8], l: Label) {
        self.op(opcode);
        self.fixups.push((self.code.len(), l.0, 4));
        self.code.extend_from_slice(&[0; 4]);
    }

    fn finish(mut self) -> Result<Vec<u8>, TestGuestError> {
        for &(at, label, width) in &self.fixups {
            // Every label used is bound by `program` (a bug otherwise).
            let target = self.labels[label].unwrap_or(at);
            let next = at + width as usize;
            let rel = target as i64 - next as i64;
            if width == 1 {
                let r = i8::try_from(rel).map_err(|_| TestGuestError::JumpRange { at, target })?;
                self.code[at] = r as u8;
            } else {
                // The program is a few hundred bytes: always in range.
                self.code[at..at + 4].copy_from_slice(&(rel as i32).to_le_bytes());
            }
        }
        Ok(self.code)
    }
}

/// The guest's code, loaded at `CODE_ADDR`.
fn program(idle: Option<u32>) -> Result<Vec<u8>, TestGuestError> {
    let mut a = Asm::new();
    let (next, write_loop, verify, read_loop, bad, report, done) = (
        a.label(),
        a.label(),
        a.label(),
        a.label(),
        a.label(),
        a.label(),
        a.label(),
    );
    let t = TABLE_ADDR.to_le_bytes();
    let port = TEST_PORT.to_le_bytes();
    // Registers: rbx = current entry, r10 = check index.
    a.op(&[0x48, 0xBB, t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7]]); // mov rbx, TABLE_ADDR
    a.op(&[0x45, 0x31, 0xD2]); // xor r10d, r10d
    a.bind(next);
    a.op(&[0x48, 0x8B, 0x3B]); // mov rdi, [rbx]        ; gpa (0 ends the table)
    a.op(&[0x48, 0x85, 0xFF]); // test rdi, rdi
    a.jmp32(&[0x0F, 0x84], done); // jz done
    a.op(&[0x48, 0x8B, 0x4B, 0x08]); // mov rcx, [rbx+8]   ; qwords
    a.op(&[0x48, 0x8B, 0x43, 0x10]); // mov rax, [rbx+16]  ; seed
    a.op(&[0x4C, 0x8B, 0x4B, 0x18]); // mov r9, [rbx+24]   ; stride
    a.op(&[0x4C, 0x8B, 0x5B, 0x20]); // mov r11, [rbx+32]  ; flags
    a.op(&[0x41, 0xF6, 0xC3, 0x01]); // test r11b, 1       ; write?
    a.jmp8(&[0x74], verify); // jz verify
    a.op(&[0x48, 0x89, 0xFE]); // mov rsi, rdi          ; cursor
    a.op(&[0x48, 0x89, 0xCA]); // mov rdx, rcx          ; words left
    a.op(&[0x49, 0x89, 0xC0]); // mov r8, rax           ; word
    a.bind(write_loop);
    a.op(&[0x4C, 0x89, 0x06]); // mov [rsi], r8
    a.op(&[0x4D, 0x01, 0xC8]); // add r8, r9
    a.op(&[0x48, 0x83, 0xC6, 0x08]); // add rsi, 8
    a.op(&[0x48, 0xFF, 0xCA]); // dec rdx
    a.jmp8(&[0x75], write_loop); // jnz write_loop
    a.bind(verify);
    a.op(&[0x48, 0x89, 0xFE]); // mov rsi, rdi
    a.op(&[0x48, 0x89, 0xCA]); // mov rdx, rcx
    a.op(&[0x49, 0x89, 0xC0]); // mov r8, rax
    a.bind(read_loop);
    a.op(&[0x4C, 0x39, 0x06]); // cmp [rsi], r8
    a.jmp8(&[0x75], bad); // jne bad
    a.op(&[0x4D, 0x01, 0xC8]); // add r8, r9
    a.op(&[0x48, 0x83, 0xC6, 0x08]); // add rsi, 8
    a.op(&[0x48, 0xFF, 0xCA]); // dec rdx
    a.jmp8(&[0x75], read_loop); // jnz read_loop
    a.op(&[0x44, 0x89, 0xD0]); // mov eax, r10d         ; pass: the index
    a.jmp8(&[0xEB], report); // jmp report
    a.bind(bad);
    a.op(&[0x44, 0x89, 0xD0]); // mov eax, r10d
    a.op(&[0x0D, 0x00, 0x00, 0x00, 0x80]); // or eax, FAIL_BIT
    a.bind(report);
    a.op(&[0x66, 0xBA, port[0], port[1]]); // mov dx, TEST_PORT
    a.op(&[0xEF]); // out dx, eax
    a.op(&[0x49, 0xFF, 0xC2]); // inc r10
    a.op(&[0x48, 0x83, 0xC3, ENTRY_SIZE as u8]); // add rbx, ENTRY_SIZE
    a.jmp32(&[0xE9], next); // jmp next
    a.bind(done);
    a.op(&[0x44, 0x89, 0xD0]); // mov eax, r10d         ; checks run
    a.op(&[0x0D, 0x00, 0x00, 0x00, 0x40]); // or eax, DONE_BIT
    a.op(&[0x66, 0xBA, port[0], port[1]]); // mov dx, TEST_PORT
    a.op(&[0xEF]); // out dx, eax
    if let Some(spin) = idle {
        let (idle_top, spin_loop) = (a.label(), a.label());
        let s = spin.max(1).to_le_bytes();
        a.bind(idle_top);
        a.op(&[0xB9, s[0], s[1], s[2], s[3]]); // mov ecx, spin
        a.bind(spin_loop);
        a.op(&[0xFF, 0xC9]); // dec ecx
        a.jmp8(&[0x75], spin_loop); // jnz spin_loop
        a.op(&[0xED]); // in eax, dx             ; dx = TEST_PORT
        a.op(&[0x85, 0xC0]); // test eax, eax
        a.jmp8(&[0x74], idle_top); // jz idle_top
    }
    let halt = a.label();
    a.bind(halt);
    a.op(&[0xF4]); // hlt
    a.jmp8(&[0xEB], halt); // jmp halt (if ever resumed)
    a.finish()
}

/// A GDT entry from flags (access byte and the flags nibble, as
/// `0xF0FF`: granularity, size, long, avl ... present, dpl, s, type),
/// base and limit.
fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    let (flags, base, limit) = (u64::from(flags), u64::from(base), u64::from(limit));
    ((base & 0xff00_0000) << 32)
        | ((base & 0x00ff_ffff) << 16)
        | (limit & 0xffff)
        | ((limit & 0xf_0000) << 32)
        | ((flags & 0xf0ff) << 40)
}

/// The KVM view of the segment `gdt_entry(flags, base, limit)` at
/// `selector`.
fn segment(selector: u16, flags: u16, base: u32, limit: u32) -> kvm_bindings::kvm_segment {
    let g = (flags >> 15) & 1;
    kvm_bindings::kvm_segment {
        base: u64::from(base),
        limit: if g == 1 { (limit << 12) | 0xfff } else { limit },
        selector,
        type_: (flags & 0xf) as u8,
        present: ((flags >> 7) & 1) as u8,
        dpl: ((flags >> 5) & 3) as u8,
        db: ((flags >> 14) & 1) as u8,
        s: ((flags >> 4) & 1) as u8,
        l: ((flags >> 13) & 1) as u8,
        g: g as u8,
        avl: ((flags >> 12) & 1) as u8,
        unusable: 0,
        padding: 0,
    }
}

/// 64-bit code: granular, long, present, ring 0, code execute/read accessed.
const CODE64: u16 = 0xa09b;
/// Data: granular, 32-bit, present, ring 0, read/write accessed.
const DATA: u16 = 0xc093;
/// A busy 64-bit TSS (needed for a valid task register on VMX).
const TSS: u16 = 0x808b;

const CR0_PE: u64 = 1;
const CR0_MP: u64 = 1 << 1;
const CR0_ET: u64 = 1 << 4;
const CR0_NE: u64 = 1 << 5;
const CR0_WP: u64 = 1 << 16;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;
/// Page table entry bits: present, writable, (in a PD) 2 MiB page.
const PTE_P_RW: u64 = 0x3;
const PDE_PS: u64 = 0x80;

/// Where the loaded guest starts.
#[derive(Debug, Clone, Copy)]
pub struct Loaded {
    entry: u64,
    stack: u64,
}

impl TestGuest {
    /// Writes the page tables (identity map of `0..map_end`, rounded up to
    /// 1 GiB), the GDT, the code and the check table into `mem`.
    /// `map_end` must cover RAM and every region the checks touch.
    pub fn load(&self, mem: &GuestMemoryMmap, map_end: u64) -> Result<Loaded, TestGuestError> {
        let ram = mem.last_addr().0 + 1;
        if ram < MIN_RAM {
            return Err(TestGuestError::SmallRam(ram));
        }
        let pds = map_end.div_ceil(GIB).max(1);
        if pds > MAX_PDS {
            return Err(TestGuestError::MapTooLarge(map_end));
        }
        let max = ((TABLE_END - TABLE_ADDR) / ENTRY_SIZE - 1) as usize;
        if self.checks.len() > max {
            return Err(TestGuestError::TooManyChecks(self.checks.len()));
        }
        let mut table = Vec::with_capacity((self.checks.len() + 1) * ENTRY_SIZE as usize);
        for (index, c) in self.checks.iter().enumerate() {
            let bad = |why| TestGuestError::BadCheck { index, why };
            if c.gpa == 0 || !c.gpa.is_multiple_of(8) {
                return Err(bad("the address must be non-zero and 8-byte aligned"));
            }
            if c.qwords == 0 {
                return Err(bad("at least one word"));
            }
            match c.qwords.checked_mul(8).and_then(|n| n.checked_add(c.gpa)) {
                Some(end) if end <= pds * GIB => {}
                _ => return Err(bad("outside the identity map")),
            }
            for w in [c.gpa, c.qwords, c.seed, c.stride, u64::from(c.write)] {
                table.extend_from_slice(&w.to_le_bytes());
            }
        }
        table.extend_from_slice(&[0; ENTRY_SIZE as usize]);
        let w = |data: &[u8], at: u64| {
            mem.write_slice(data, GuestAddress(at))
                .map_err(TestGuestError::Memory)
        };
        let words = |v: &[u64]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        w(&words(&[PDPT_ADDR | PTE_P_RW]), PML4_ADDR)?;
        let pdpt: Vec<u64> = (0..pds)
            .map(|i| (PD_ADDR + i * 0x1000) | PTE_P_RW)
            .collect();
        w(&words(&pdpt), PDPT_ADDR)?;
        let pd: Vec<u64> = (0..pds * 512)
            .map(|i| (i * MIB2) | PTE_P_RW | PDE_PS)
            .collect();
        w(&words(&pd), PD_ADDR)?;
        let gdt = [
            0,
            gdt_entry(CODE64, 0, 0xfffff),
            gdt_entry(DATA, 0, 0xfffff),
            gdt_entry(TSS, 0, 0x67),
        ];
        w(&words(&gdt), GDT_ADDR)?;
        w(&program(self.idle)?, CODE_ADDR)?;
        w(&table, TABLE_ADDR)?;
        Ok(Loaded {
            entry: CODE_ADDR,
            stack: MIN_RAM,
        })
    }
}

impl Loaded {
    /// Guest address of the first instruction.
    pub fn entry(&self) -> u64 {
        self.entry
    }

    /// Puts `vcpu` in 64-bit mode at the guest's entry.
    pub fn configure(&self, vcpu: &Vcpu) -> Result<(), TestGuestError> {
        vcpu.update_sregs(|s| {
            s.cs = segment(0x08, CODE64, 0, 0xfffff);
            let data = segment(0x10, DATA, 0, 0xfffff);
            (s.ds, s.es, s.fs, s.gs, s.ss) = (data, data, data, data, data);
            s.tr = segment(0x18, TSS, 0, 0x67);
            s.gdt.base = GDT_ADDR;
            s.gdt.limit = 4 * 8 - 1;
            s.idt.base = 0;
            s.idt.limit = 0;
            s.cr3 = PML4_ADDR;
            s.cr4 |= CR4_PAE;
            s.cr0 = CR0_PE | CR0_MP | CR0_ET | CR0_NE | CR0_WP | CR0_PG;
            s.efer |= EFER_LME | EFER_LMA;
        })
        .map_err(TestGuestError::Vcpu)?;
        vcpu.set_regs(&kvm_bindings::kvm_regs {
            rip: self.entry,
            rsp: self.stack,
            rflags: 0x2,
            ..Default::default()
        })
        .map_err(TestGuestError::Vcpu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn program_assembles_and_jumps_land_on_instructions() {
        let code = program(Some(1000)).unwrap();
        // mov rbx, imm64 first, hlt + jmp -2 last.
        assert_eq!(&code[..2], &[0x48, 0xBB]);
        assert_eq!(&code[code.len() - 3..], &[0xF4, 0xEB, 0xFD]);
        // "jz verify" skips exactly the 9 bytes of the three movs and the
        // 15-byte write loop.
        let jz = code
            .windows(4)
            .position(|w| w == [0x41, 0xF6, 0xC3, 0x01])
            .unwrap()
            + 4;
        assert_eq!(code[jz], 0x74);
        assert_eq!(code[jz + 1], 9 + 15);
        assert!(program(None).unwrap().len() < 256);
    }

    #[test]
    fn gdt_and_segments_agree() {
        assert_eq!(gdt_entry(CODE64, 0, 0xfffff), 0x00af_9b00_0000_ffff);
        assert_eq!(gdt_entry(DATA, 0, 0xfffff), 0x00cf_9300_0000_ffff);
        let cs = segment(0x08, CODE64, 0, 0xfffff);
        assert_eq!(
            (cs.l, cs.db, cs.g, cs.type_, cs.limit),
            (1, 0, 1, 0xb, 0xffff_ffff)
        );
    }

    #[test]
    fn reports_and_patterns() {
        assert_eq!(Report::decode(3), Report::Pass(3));
        assert_eq!(Report::decode(FAIL_BIT | 3), Report::Fail(3));
        assert_eq!(Report::decode(DONE_BIT | 7), Report::Done(7));
        let c = Check {
            gpa: 8,
            qwords: 2,
            seed: 1,
            stride: 0x100,
            write: true,
        };
        assert_eq!(c.bytes(), [1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn load_rejects_bad_checks() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x20_0000)]).unwrap();
        let g = |gpa, qwords| TestGuest {
            checks: vec![Check {
                gpa,
                qwords,
                seed: 0,
                stride: 0,
                write: false,
            }],
            idle: None,
        };
        assert!(g(0x10_0000, 1).load(&mem, 0x20_0000).is_ok());
        assert!(matches!(
            g(0, 1).load(&mem, 0x20_0000),
            Err(TestGuestError::BadCheck { .. })
        ));
        assert!(matches!(
            g(8, 0).load(&mem, 0x20_0000),
            Err(TestGuestError::BadCheck { .. })
        ));
        assert!(matches!(
            g(GIB - 8, 2).load(&mem, 1),
            Err(TestGuestError::BadCheck { .. })
        ));
        assert!(g(8, 1).load(&mem, 5 * GIB).is_ok(), "pmem from 4 GiB fits");
        assert!(matches!(
            g(8, 1).load(&mem, 9 * GIB),
            Err(TestGuestError::MapTooLarge(_))
        ));
    }
}
