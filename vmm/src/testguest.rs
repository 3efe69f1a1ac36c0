//! The project's tiny test guest: 64-bit code assembled by hand here (no
//! external assembler), entered directly in long mode set up through
//! `KVM_SET_SREGS`: a GDT in guest memory and identity page tables with
//! 2 MiB pages (1 GiB pages triple-fault on the host's emulating KVM).
//!
//! The guest walks a table of [`Step`]s and reports each one's result as a
//! 32-bit `out` to [`TEST_PORT`] (see [`Report`]). A step is one of:
//!
//! - [`Step::Mem`] (a [`Check`]): optionally writes a pattern of 64-bit
//!   words (`seed`, `seed + stride`, `seed + 2*stride`, ...) at a
//!   guest-physical address, then reads the words back and compares;
//! - [`Step::Write`]: one write of 1, 2, 4 or 8 bytes at an address (an
//!   MMIO register, or RAM such as a virtqueue index); always passes;
//! - [`Step::Read`]: reads 1, 2, 4 or 8 bytes at an address until the
//!   value under a mask equals the expected one, at most `tries` times
//!   (one try: a read-and-compare; more: a bounded poll); fails after the
//!   last try.
//! - [`Step::Count`]: counts forever in a register and stores each new
//!   count into a 64-bit RAM word, starting from the word's value; never
//!   reports and never ends (a guest whose progress a host test watches
//!   across a pause, or a snapshot and a restore: the count lives in
//!   `rax` and RAM, so it goes on from where it was only if both were
//!   restored).
//!
//! With `Write` and `Read` steps the guest can act as a driver: register
//! accesses are real guest instructions, each an MMIO exit the VMM
//! handles. After the table the guest reports [`Report::Done`] and either
//! halts or, with [`TestGuest::idle`], spins (inside `KVM_RUN`) and polls
//! the port with `in` until the host answers non-zero, then halts.
//!
//! An NMI (vector 2, the only gate of its IDT) reports [`Report::Nmi`] on
//! the port and returns to where the guest was, so a test sees each NMI
//! the VMM injects.
//!
//! Guest memory layout (all in the first 64 KiB of RAM):
//!
//! | address | content |
//! |---|---|
//! | `0x0..0x1000` | stack (grows down from `0x1000`) |
//! | `0x1000` | GDT: null, code64, data, TSS |
//! | `0x1800` | IDT: vectors 0..=2, only 2 (NMI) present |
//! | `0x2000` | PML4 |
//! | `0x3000` | PDPT |
//! | `0x4000..0xc000` | up to 8 page directories (2 MiB pages, 8 GiB: RAM and pmem regions from 4 GiB) |
//! | `0xc000` | code |
//! | `0xd000..0x10000` | the step table (40 bytes an entry, zero-terminated) |
//!
//! A table entry is five little-endian words: the address (0 ends the
//! table), three operands, and flags: bit 0 a `Mem` step writes, bit 1 a
//! `Write` step, bit 2 a `Read` step, bit 3 a `Count` step, bits 8..16 the
//! access width. `Mem`: words, seed, stride. `Write`: value. `Read`: mask,
//! expected value, tries. `Count`: none.

use crate::x86::{
    gdt_entry, segment, CR0_ET, CR0_MP, CR0_NE, CR0_PE, CR0_PG, CR0_WP, CR4_PAE, EFER_LMA, EFER_LME,
};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use crate::vcpu::{Vcpu, VcpuError};

/// The port the guest reports on.
pub const TEST_PORT: u16 = 0x0510;
/// Bit set in a report for a failed check.
const FAIL_BIT: u32 = 1 << 31;
/// Bit set in the final report.
const DONE_BIT: u32 = 1 << 30;
/// The report of the NMI handler.
const NMI_REPORT: u32 = 1 << 29;

const STACK_TOP: u64 = 0x1000;
const GDT_ADDR: u64 = 0x1000;
const IDT_ADDR: u64 = 0x1800;
/// IDT gates: vectors 0, 1 (absent) and 2, the NMI.
const IDT_GATES: u64 = 3;
const NMI_VECTOR: u64 = 2;
// The GDT, the IDT and the page tables do not overlap.
const _: () = assert!(GDT_ADDR + 4 * 8 <= IDT_ADDR && IDT_ADDR + IDT_GATES * 16 <= PML4_ADDR);
const PML4_ADDR: u64 = 0x2000;
const PDPT_ADDR: u64 = 0x3000;
const PD_ADDR: u64 = 0x4000;
const MAX_PDS: u64 = 8;
const CODE_ADDR: u64 = 0xc000;
const TABLE_ADDR: u64 = 0xd000;
const TABLE_END: u64 = 0x10000;
const ENTRY_SIZE: u64 = 40;
/// Entry flags: a `Mem` step writes its pattern first.
const FLAG_MEM_WRITE: u64 = 1;
/// Entry flags: a `Write` step.
const FLAG_WRITE: u64 = 2;
/// Entry flags: a `Read` step.
const FLAG_READ: u64 = 4;
/// Entry flags: a `Count` step.
const FLAG_COUNT: u64 = 8;
/// Entry flags: the access width in bytes, from this bit.
const WIDTH_SHIFT: u32 = 8;
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

/// One step of the guest's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Write (optionally) and verify a pattern of words.
    Mem(Check),
    /// One write of `width` bytes (1, 2, 4 or 8; `gpa` aligned to it) of
    /// the low bytes of `value`. Reports a pass.
    Write {
        /// Guest-physical address (MMIO or RAM).
        gpa: u64,
        /// Access width in bytes.
        width: u8,
        /// The value (little-endian, truncated to the width).
        value: u64,
    },
    /// Reads of `width` bytes at `gpa` (zero-extended) until `value & mask
    /// == expect`, at most `tries` reads (at least 1). Passes on a match,
    /// fails after the last try.
    Read {
        /// Guest-physical address (MMIO or RAM).
        gpa: u64,
        /// Access width in bytes.
        width: u8,
        /// Bits compared.
        mask: u64,
        /// Expected value of those bits.
        expect: u64,
        /// Reads at most (a poll bound).
        tries: u64,
    },
    /// Counts forever: `rax` = the word at `gpa`, then `rax += 1` and
    /// stores it at `gpa`, again and again. Never reports; the steps after
    /// it never run.
    Count {
        /// Guest-physical address of the word (RAM, 8-byte aligned).
        gpa: u64,
    },
}

impl From<Check> for Step {
    fn from(c: Check) -> Step {
        Step::Mem(c)
    }
}

/// All ones in the low `width` bytes.
fn width_mask(width: u8) -> u64 {
    match width {
        8 => u64::MAX,
        w => (1u64 << (8 * u32::from(w.min(7)))) - 1,
    }
}

impl Step {
    /// A write of `width` bytes.
    pub fn write(gpa: u64, width: u8, value: u64) -> Step {
        Step::Write { gpa, width, value }
    }

    /// One read of `width` bytes that must equal `expect`.
    pub fn read(gpa: u64, width: u8, expect: u64) -> Step {
        Step::read_masked(gpa, width, width_mask(width), expect)
    }

    /// One read of `width` bytes whose `mask` bits must equal `expect`.
    pub fn read_masked(gpa: u64, width: u8, mask: u64, expect: u64) -> Step {
        Step::Read {
            gpa,
            width,
            mask,
            expect,
            tries: 1,
        }
    }

    /// Reads `width` bytes until they equal `expect`, at most `tries`
    /// times.
    pub fn poll(gpa: u64, width: u8, expect: u64, tries: u64) -> Step {
        Step::Read {
            gpa,
            width,
            mask: width_mask(width),
            expect,
            tries,
        }
    }

    /// The table entry, or why the step is invalid; `map_end` bounds the
    /// addresses.
    fn entry(&self, map_end: u64) -> Result<[u64; 5], &'static str> {
        let inside = |gpa: u64, len: u64| {
            gpa.checked_add(len)
                .is_some_and(|end| end <= map_end)
                .then_some(())
                .ok_or("outside the identity map")
        };
        let access = |gpa: u64, width: u8| {
            if !matches!(width, 1 | 2 | 4 | 8) {
                return Err("the width must be 1, 2, 4 or 8 bytes");
            }
            if gpa == 0 || !gpa.is_multiple_of(u64::from(width)) {
                return Err("the address must be non-zero and aligned to the width");
            }
            inside(gpa, u64::from(width))?;
            Ok(u64::from(width) << WIDTH_SHIFT)
        };
        match *self {
            Step::Mem(c) => {
                if c.gpa == 0 || !c.gpa.is_multiple_of(8) {
                    return Err("the address must be non-zero and 8-byte aligned");
                }
                if c.qwords == 0 {
                    return Err("at least one word");
                }
                inside(c.gpa, c.qwords.checked_mul(8).ok_or("too many words")?)?;
                let flags = if c.write { FLAG_MEM_WRITE } else { 0 };
                Ok([c.gpa, c.qwords, c.seed, c.stride, flags])
            }
            Step::Write { gpa, width, value } => {
                let w = access(gpa, width)?;
                Ok([gpa, value, 0, 0, FLAG_WRITE | w])
            }
            Step::Read {
                gpa,
                width,
                mask,
                expect,
                tries,
            } => {
                let w = access(gpa, width)?;
                if tries == 0 {
                    return Err("at least one try");
                }
                if expect & !(mask & width_mask(width)) != 0 {
                    return Err("the expected value has bits outside the mask and width");
                }
                Ok([gpa, mask, expect, tries, FLAG_READ | w])
            }
            Step::Count { gpa } => {
                access(gpa, 8)?;
                Ok([gpa, 0, 0, 0, FLAG_COUNT])
            }
        }
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
    /// The guest took an NMI.
    Nmi,
}

impl Report {
    /// Decodes a 32-bit `out` to [`TEST_PORT`].
    pub fn decode(v: u32) -> Report {
        if v == NMI_REPORT {
            Report::Nmi
        } else if v & DONE_BIT != 0 {
            Report::Done(v & !DONE_BIT)
        } else if v & FAIL_BIT != 0 {
            Report::Fail(v & !FAIL_BIT)
        } else {
            Report::Pass(v)
        }
    }
}

/// A test guest: its steps and how it ends.
#[derive(Debug, Clone, Default)]
pub struct TestGuest {
    /// The steps, in order (each reports once).
    pub checks: Vec<Step>,
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

/// The guest's code, loaded at `CODE_ADDR`, and the offset of its NMI
/// handler in it.
fn program(idle: Option<u32>) -> Result<(Vec<u8>, usize), TestGuestError> {
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
    let (pass, access_write, access_read) = (a.label(), a.label(), a.label());
    let count = a.label();
    let t = TABLE_ADDR.to_le_bytes();
    let port = TEST_PORT.to_le_bytes();
    // Registers: rbx = current entry, r10 = check index.
    a.op(&[0x48, 0xBB, t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7]]); // mov rbx, TABLE_ADDR
    a.op(&[0x45, 0x31, 0xD2]); // xor r10d, r10d
    a.bind(next);
    a.op(&[0x48, 0x8B, 0x3B]); // mov rdi, [rbx]        ; gpa (0 ends the table)
    a.op(&[0x48, 0x85, 0xFF]); // test rdi, rdi
    a.jmp32(&[0x0F, 0x84], done); // jz done
    a.op(&[0x4C, 0x8B, 0x5B, 0x20]); // mov r11, [rbx+32]  ; flags
    a.op(&[0x41, 0xF6, 0xC3, FLAG_WRITE as u8]); // test r11b, FLAG_WRITE
    a.jmp32(&[0x0F, 0x85], access_write); // jnz access_write
    a.op(&[0x41, 0xF6, 0xC3, FLAG_READ as u8]); // test r11b, FLAG_READ
    a.jmp32(&[0x0F, 0x85], access_read); // jnz access_read
    a.op(&[0x41, 0xF6, 0xC3, FLAG_COUNT as u8]); // test r11b, FLAG_COUNT
    a.jmp32(&[0x0F, 0x85], count); // jnz count
    a.op(&[0x48, 0x8B, 0x4B, 0x08]); // mov rcx, [rbx+8]   ; qwords
    a.op(&[0x48, 0x8B, 0x43, 0x10]); // mov rax, [rbx+16]  ; seed
    a.op(&[0x4C, 0x8B, 0x4B, 0x18]); // mov r9, [rbx+24]   ; stride
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
    a.bind(pass);
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
    access_steps(&mut a, access_write, access_read, pass, bad);
    let count_loop = a.label();
    a.bind(count);
    a.op(&[0x48, 0x8B, 0x07]); // mov rax, [rdi]        ; from the word's value
    a.bind(count_loop);
    a.op(&[0x48, 0xFF, 0xC0]); // inc rax
    a.op(&[0x48, 0x89, 0x07]); // mov [rdi], rax
    a.jmp8(&[0xEB], count_loop); // jmp count_loop
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
                           // The NMI handler: reports, then returns to the interrupted code with
                           // its registers intact.
    let nmi = a.code.len();
    let r = NMI_REPORT.to_le_bytes();
    a.op(&[0x50]); // push rax
    a.op(&[0x52]); // push rdx
    a.op(&[0xB8, r[0], r[1], r[2], r[3]]); // mov eax, NMI_REPORT
    a.op(&[0x66, 0xBA, port[0], port[1]]); // mov dx, TEST_PORT
    a.op(&[0xEF]); // out dx, eax
    a.op(&[0x5A]); // pop rdx
    a.op(&[0x58]); // pop rax
    a.op(&[0x48, 0xCF]); // iretq
    Ok((a.finish()?, nmi))
}

/// A 64-bit interrupt gate to `handler` in the code segment.
fn interrupt_gate(handler: u64) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[0..2].copy_from_slice(&(handler as u16).to_le_bytes());
    g[2..4].copy_from_slice(&0x08u16.to_le_bytes()); // selector: code64
    g[4] = 0; // no IST: the current stack
    g[5] = 0x8E; // present, ring 0, 64-bit interrupt gate
    g[6..8].copy_from_slice(&((handler >> 16) as u16).to_le_bytes());
    g[8..12].copy_from_slice(&((handler >> 32) as u32).to_le_bytes());
    g
}

/// The `Write` and `Read` steps: entered with rbx = the entry, rdi = the
/// address, r11 = the flags; they end in a jump to `pass` or `bad`.
fn access_steps(a: &mut Asm, access_write: Label, access_read: Label, pass: Label, bad: Label) {
    // Write: the value's low `width` bytes.
    let (w2, w4, w8) = (a.label(), a.label(), a.label());
    a.bind(access_write);
    a.op(&[0x48, 0x8B, 0x43, 0x08]); // mov rax, [rbx+8]   ; value
    a.op(&[0x44, 0x89, 0xD9]); // mov ecx, r11d
    a.op(&[0xC1, 0xE9, WIDTH_SHIFT as u8]); // shr ecx, WIDTH_SHIFT ; width
    a.op(&[0x83, 0xF9, 0x01]); // cmp ecx, 1
    a.jmp8(&[0x75], w2); // jne w2
    a.op(&[0x88, 0x07]); // mov [rdi], al
    a.jmp32(&[0xE9], pass); // jmp pass
    a.bind(w2);
    a.op(&[0x83, 0xF9, 0x02]); // cmp ecx, 2
    a.jmp8(&[0x75], w4); // jne w4
    a.op(&[0x66, 0x89, 0x07]); // mov [rdi], ax
    a.jmp32(&[0xE9], pass); // jmp pass
    a.bind(w4);
    a.op(&[0x83, 0xF9, 0x04]); // cmp ecx, 4
    a.jmp8(&[0x75], w8); // jne w8
    a.op(&[0x89, 0x07]); // mov [rdi], eax
    a.jmp32(&[0xE9], pass); // jmp pass
    a.bind(w8);
    a.op(&[0x48, 0x89, 0x07]); // mov [rdi], rax
    a.jmp32(&[0xE9], pass); // jmp pass

    // Read: until (value & mask) == expected, at most `tries` reads.
    let (again, r2, r4, r8, got) = (a.label(), a.label(), a.label(), a.label(), a.label());
    a.bind(access_read);
    a.op(&[0x4C, 0x8B, 0x43, 0x08]); // mov r8, [rbx+8]    ; mask
    a.op(&[0x4C, 0x8B, 0x4B, 0x10]); // mov r9, [rbx+16]   ; expected
    a.op(&[0x48, 0x8B, 0x73, 0x18]); // mov rsi, [rbx+24]  ; tries left
    a.op(&[0x44, 0x89, 0xD9]); // mov ecx, r11d
    a.op(&[0xC1, 0xE9, WIDTH_SHIFT as u8]); // shr ecx, WIDTH_SHIFT ; width
    a.bind(again);
    a.op(&[0x83, 0xF9, 0x01]); // cmp ecx, 1
    a.jmp8(&[0x75], r2); // jne r2
    a.op(&[0x0F, 0xB6, 0x17]); // movzx edx, byte [rdi]
    a.jmp8(&[0xEB], got); // jmp got
    a.bind(r2);
    a.op(&[0x83, 0xF9, 0x02]); // cmp ecx, 2
    a.jmp8(&[0x75], r4); // jne r4
    a.op(&[0x0F, 0xB7, 0x17]); // movzx edx, word [rdi]
    a.jmp8(&[0xEB], got); // jmp got
    a.bind(r4);
    a.op(&[0x83, 0xF9, 0x04]); // cmp ecx, 4
    a.jmp8(&[0x75], r8); // jne r8
    a.op(&[0x8B, 0x17]); // mov edx, [rdi]         ; zero-extends
    a.jmp8(&[0xEB], got); // jmp got
    a.bind(r8);
    a.op(&[0x48, 0x8B, 0x17]); // mov rdx, [rdi]
    a.bind(got);
    a.op(&[0x4C, 0x21, 0xC2]); // and rdx, r8
    a.op(&[0x4C, 0x39, 0xCA]); // cmp rdx, r9
    a.jmp32(&[0x0F, 0x84], pass); // je pass
    a.op(&[0xF3, 0x90]); // pause                 ; a polite poll
    a.op(&[0x48, 0xFF, 0xCE]); // dec rsi
    a.jmp8(&[0x75], again); // jnz again
    a.jmp32(&[0xE9], bad); // jmp bad
}

/// 64-bit code: granular, long, present, ring 0, code execute/read accessed.
const CODE64: u16 = 0xa09b;
/// Data: granular, 32-bit, present, ring 0, read/write accessed.
const DATA: u16 = 0xc093;
/// A busy 64-bit TSS (needed for a valid task register on VMX).
const TSS: u16 = 0x808b;

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
        for (index, step) in self.checks.iter().enumerate() {
            let entry = step
                .entry(pds * GIB)
                .map_err(|why| TestGuestError::BadCheck { index, why })?;
            for w in entry {
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
        let (code, nmi) = program(self.idle)?;
        w(&code, CODE_ADDR)?;
        w(
            &interrupt_gate(CODE_ADDR + nmi as u64),
            IDT_ADDR + NMI_VECTOR * 16,
        )?;
        w(&table, TABLE_ADDR)?;
        Ok(Loaded {
            entry: CODE_ADDR,
            stack: STACK_TOP,
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
            s.idt.base = IDT_ADDR;
            s.idt.limit = (IDT_GATES * 16 - 1) as u16;
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

/// Where [`write_halting_pvh_kernel`]'s code is loaded and entered.
pub const HALTING_KERNEL_ENTRY: u64 = 0x10_0000;

/// Writes to `path` a minimal ELF "kernel" with a PVH entry note
/// (`XEN_ELFNOTE_PHYS32_ENTRY`) whose code halts forever (`hlt; jmp -2`,
/// at [`HALTING_KERNEL_ENTRY`]): enough for the VMM to build and run a
/// whole machine through its ordinary boot path, on the host's emulating
/// KVM too. The host tests and the snapshot benchmark boot it.
pub fn write_halting_pvh_kernel(path: &std::path::Path) -> std::io::Result<()> {
    const LOAD: u64 = HALTING_KERNEL_ENTRY;
    let code = [0xf4u8, 0xeb, 0xfd];
    // ELF64 header: little endian, version 1, executable, x86-64.
    let mut e = vec![0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    e.extend_from_slice(&2u16.to_le_bytes());
    e.extend_from_slice(&0x3eu16.to_le_bytes());
    e.extend_from_slice(&1u32.to_le_bytes());
    // Entry, program headers at 64, no section headers.
    for v in [LOAD, 64, 0] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    e.extend_from_slice(&0u32.to_le_bytes());
    // Header size, program header size and count, no sections.
    for v in [64u16, 56, 2, 64, 0, 0] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    let ph = |e: &mut Vec<u8>, ty: u32, fl: u32, off: u64, addr: u64, len: u64, al: u64| {
        e.extend_from_slice(&ty.to_le_bytes());
        e.extend_from_slice(&fl.to_le_bytes());
        for v in [off, addr, addr, len, len, al] {
            e.extend_from_slice(&v.to_le_bytes());
        }
    };
    // PT_LOAD of the code (read, execute), PT_NOTE of the PVH note at 176.
    ph(&mut e, 1, 5, 0x1000, LOAD, code.len() as u64, 0x1000);
    ph(&mut e, 4, 4, 176, 0, 20, 4);
    // The note: name "Xen", type 18 (PHYS32_ENTRY), the 32-bit entry.
    for v in [4u32, 4, 18] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    e.extend_from_slice(b"Xen\0");
    e.extend_from_slice(&(LOAD as u32).to_le_bytes());
    e.resize(0x1000, 0);
    e.extend_from_slice(&code);
    std::fs::write(path, e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halting_kernel_loads_as_pvh_with_its_code_at_the_entry() {
        use crate::boot::linux::{load, BootProtocol, BootSource};
        let dir = tempfile::tempdir().unwrap();
        let kernel = dir.path().join("halt.elf");
        write_halting_pvh_kernel(&kernel).unwrap();
        let ram_size = 64 << 20;
        let mem =
            GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), ram_size as usize)]).unwrap();
        let info = load(
            &mem,
            &BootSource {
                kernel: &kernel,
                initramfs: None,
                cmdline: "",
                ram_size,
            },
        )
        .unwrap();
        assert_eq!(info.protocol, BootProtocol::Pvh);
        assert_eq!(info.vcpu.rip, HALTING_KERNEL_ENTRY);
        let mut code = [0u8; 3];
        mem.read_slice(&mut code, GuestAddress(HALTING_KERNEL_ENTRY))
            .unwrap();
        assert_eq!(code, [0xf4, 0xeb, 0xfd]);
    }

    #[test]
    fn program_assembles_and_jumps_land_on_instructions() {
        let (code, nmi) = program(Some(1000)).unwrap();
        // mov rbx, imm64 first, hlt + jmp -2 before the NMI handler, which
        // ends in iretq.
        assert_eq!(&code[..2], &[0x48, 0xBB]);
        assert_eq!(&code[nmi - 3..nmi], &[0xF4, 0xEB, 0xFD]);
        assert_eq!(&code[code.len() - 2..], &[0x48, 0xCF]);
        // "jz verify" skips exactly the 9 bytes of the three movs and the
        // 15-byte write loop.
        let jz = code
            .windows(4)
            .position(|w| w == [0x41, 0xF6, 0xC3, 0x01])
            .unwrap()
            + 4;
        assert_eq!(code[jz], 0x74);
        assert_eq!(code[jz + 1], 9 + 15);
        assert!(program(None).unwrap().0.len() as u64 <= TABLE_ADDR - CODE_ADDR);
    }

    #[test]
    fn the_nmi_gate_points_at_the_handler() {
        let g = interrupt_gate(0x1234_5678_9abc_def0);
        assert_eq!(
            g,
            [0xf0, 0xde, 0x08, 0, 0, 0x8e, 0xbc, 0x9a, 0x78, 0x56, 0x34, 0x12, 0, 0, 0, 0]
        );
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x20_0000)]).unwrap();
        TestGuest::default().load(&mem, 0x20_0000).unwrap();
        let mut gate = [0u8; 16];
        mem.read_slice(&mut gate, GuestAddress(IDT_ADDR + NMI_VECTOR * 16))
            .unwrap();
        let handler = u64::from(u16::from_le_bytes([gate[0], gate[1]]))
            | u64::from(u16::from_le_bytes([gate[6], gate[7]])) << 16;
        let mut first = [0u8; 2];
        mem.read_slice(&mut first, GuestAddress(handler)).unwrap();
        assert_eq!(first, [0x50, 0x52], "push rax; push rdx");
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
        assert_eq!(Report::decode(NMI_REPORT), Report::Nmi);
        assert_eq!(Report::decode(NMI_REPORT | 1), Report::Pass(NMI_REPORT | 1));
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
            checks: vec![Step::Mem(Check {
                gpa,
                qwords,
                seed: 0,
                stride: 0,
                write: false,
            })],
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

    #[test]
    fn access_steps_encode_and_reject_bad_ones() {
        assert_eq!(
            Step::write(0x1000, 2, 7).entry(GIB),
            Ok([0x1000, 7, 0, 0, FLAG_WRITE | (2 << WIDTH_SHIFT)])
        );
        assert_eq!(
            Step::poll(0x1000, 4, 9, 100).entry(GIB),
            Ok([0x1000, 0xffff_ffff, 9, 100, FLAG_READ | (4 << WIDTH_SHIFT)])
        );
        assert_eq!(
            Step::read(0x1000, 8, 1).entry(GIB).map(|e| e[1]),
            Ok(u64::MAX)
        );
        assert_eq!(
            Step::Count { gpa: 0x2_0000 }.entry(GIB),
            Ok([0x2_0000, 0, 0, 0, FLAG_COUNT])
        );
        let bad = [
            Step::write(0, 1, 0),
            Step::write(0x1001, 2, 0),
            Step::write(0x1000, 3, 0),
            Step::write(GIB - 4, 8, 0),
            Step::read(0x1000, 1, 0x100),
            Step::read_masked(0x1000, 4, 0xf0, 0x0f),
            Step::poll(0x1000, 2, 0, 0),
            Step::Count { gpa: 0 },
            Step::Count { gpa: 0x1004 },
            Step::Count { gpa: GIB },
        ];
        for s in bad {
            assert!(s.entry(GIB).is_err(), "{s:?}");
        }
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x20_0000)]).unwrap();
        let g = TestGuest {
            checks: vec![Step::write(0x10_0000, 4, 1), Step::write(0x10_0002, 4, 1)],
            idle: None,
        };
        assert!(matches!(
            g.load(&mem, 0x20_0000),
            Err(TestGuestError::BadCheck { index: 1, .. })
        ));
    }
}
