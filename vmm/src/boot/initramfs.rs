//! Initramfs placement: at the top of RAM below the 32-bit hole (and below
//! the kernel's own limit), 4 KiB aligned, above the kernel.

use std::fs::File;
use std::path::Path;

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::layout;
use super::BootError;

/// Alignment of the initramfs start.
pub const INITRAMFS_ALIGN: u64 = 0x1000;

/// Where an initramfs went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitramfsPlacement {
    /// Guest-physical start.
    pub addr: u64,
    /// Size in bytes.
    pub size: u64,
}

/// The highest 4 KiB-aligned address for `size` bytes that ends at or below
/// both the end of RAM below the hole and `max_end` (the kernel's limit:
/// `initrd_addr_max + 1`), and starts at or above `low` (the kernel's end).
pub fn place(
    path: &Path,
    size: u64,
    ram_size: u64,
    low: u64,
    max_end: u64,
) -> Result<InitramfsPlacement, BootError> {
    let high = layout::ram_ranges(ram_size)[0].end().min(max_end);
    let too_large = || BootError::InitramfsTooLarge {
        path: path.to_owned(),
        size,
        low,
        high,
    };
    let addr = high.checked_sub(size).ok_or_else(too_large)? / INITRAMFS_ALIGN * INITRAMFS_ALIGN;
    if addr < low {
        return Err(too_large());
    }
    Ok(InitramfsPlacement { addr, size })
}

/// Places the initramfs file at `path` (see [`place`]) and reads it into
/// guest memory.
pub fn load<M: GuestMemoryBackend>(
    mem: &M,
    path: &Path,
    ram_size: u64,
    low: u64,
    max_end: u64,
) -> Result<InitramfsPlacement, BootError> {
    let io = |source| BootError::Io {
        path: path.to_owned(),
        source,
    };
    let mut file = File::open(path).map_err(io)?;
    let size = file.metadata().map_err(io)?.len();
    let placement = place(path, size, ram_size, low, max_end)?;
    let len = usize::try_from(size).map_err(|_| BootError::InitramfsTooLarge {
        path: path.to_owned(),
        size,
        low,
        high: max_end,
    })?;
    mem.read_exact_volatile_from(GuestAddress(placement.addr), &mut file, len)
        .map_err(|source| BootError::GuestMemory {
            addr: placement.addr,
            source,
        })?;
    Ok(placement)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_of_low_ram_aligned() {
        let p = Path::new("i");
        let pl = place(p, 0x1234, 256 << 20, 0x200_0000, u64::MAX).unwrap();
        assert_eq!(pl.addr, (256 << 20) - 0x2000);
        assert!(pl.addr + pl.size <= 256 << 20);
        // Large RAM: below the hole, and below the kernel's limit.
        let pl = place(p, 0x1000, 8 << 30, 0x200_0000, u64::MAX).unwrap();
        assert_eq!(pl.addr, layout::MEM_32BIT_HOLE_START - 0x1000);
        let pl = place(p, 0x1000, 8 << 30, 0x200_0000, 0x3800_0000).unwrap();
        assert_eq!(pl.addr, 0x3800_0000 - 0x1000);
    }

    #[test]
    fn does_not_fit() {
        let p = Path::new("i");
        assert!(matches!(
            place(p, 64 << 20, 64 << 20, 0x200_0000, u64::MAX),
            Err(BootError::InitramfsTooLarge { .. })
        ));
        assert!(matches!(
            place(p, u64::MAX, 64 << 20, 0, u64::MAX),
            Err(BootError::InitramfsTooLarge { .. })
        ));
    }
}
