//! `io`: qemu-io's `write`, `read` and `flush` on an image.

use anyhow::{anyhow, bail};
use pcow::{Image, OpenOptions};

use crate::size::{parse_byte, parse_size};
use crate::IoArgs;

/// Default pattern of `write`, as qemu-io's.
const DEFAULT_PATTERN: u8 = 0xcd;
/// Reads and writes go through a buffer of at most this size.
const CHUNK: u64 = 1 << 20;

/// One parsed `-c` command.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Cmd {
    Write {
        pattern: u8,
        off: u64,
        len: u64,
    },
    Read {
        pattern: Option<u8>,
        off: u64,
        len: u64,
    },
    Flush,
}

fn parse_cmd(s: &str) -> anyhow::Result<Cmd> {
    let words: Vec<&str> = s.split_whitespace().collect();
    let Some((&name, mut rest)) = words.split_first() else {
        bail!("empty io command");
    };
    let mut pattern = None;
    if let ["-P", p, tail @ ..] = rest {
        pattern = Some(parse_byte(p).map_err(|e| anyhow!("'{s}': {e}"))?);
        rest = tail;
    }
    let range = |rest: &[&str]| -> anyhow::Result<(u64, u64)> {
        match rest {
            [off, len] => Ok((parse_size(off)?, parse_size(len)?)),
            _ => bail!("'{s}': expected '{name} [-P BYTE] OFFSET LENGTH'"),
        }
    };
    match name {
        "write" => {
            let (off, len) = range(rest)?;
            Ok(Cmd::Write {
                pattern: pattern.unwrap_or(DEFAULT_PATTERN),
                off,
                len,
            })
        }
        "read" => {
            let (off, len) = range(rest)?;
            Ok(Cmd::Read { pattern, off, len })
        }
        "flush" if rest.is_empty() && pattern.is_none() => Ok(Cmd::Flush),
        "flush" => bail!("'{s}': flush takes no arguments"),
        _ => bail!("unknown io command '{name}' (expected write, read or flush)"),
    }
}

fn check_range(img: &Image, off: u64, len: u64) -> anyhow::Result<()> {
    match off.checked_add(len) {
        Some(end) if end <= img.virtual_size() => Ok(()),
        _ => bail!(
            "{}: request [{off}, {off}+{len}) is beyond the virtual size {}",
            img.path().display(),
            img.virtual_size()
        ),
    }
}

/// Runs one command; `Ok(false)` is a pattern mismatch (already reported).
fn run_cmd(img: &mut Image, cmd: &Cmd) -> anyhow::Result<bool> {
    match *cmd {
        Cmd::Write { pattern, off, len } => {
            check_range(img, off, len)?;
            let buf = vec![pattern; CHUNK.min(len) as usize];
            let mut done = 0;
            while done < len {
                let n = CHUNK.min(len - done) as usize;
                img.write_at(&buf[..n], off + done)?;
                done += n as u64;
            }
            println!("wrote {len}/{len} bytes at offset {off}");
        }
        Cmd::Read { pattern, off, len } => {
            check_range(img, off, len)?;
            let mut buf = vec![0u8; CHUNK.min(len) as usize];
            let mut done = 0;
            while done < len {
                let n = CHUNK.min(len - done) as usize;
                img.read_at(&mut buf[..n], off + done)?;
                if let Some(p) = pattern {
                    if let Some(i) = buf[..n].iter().position(|&b| b != p) {
                        let at = off + done + i as u64;
                        eprintln!(
                            "pcow-img: pattern verification failed at offset {at}: expected {p:#04x}, found {:#04x}",
                            buf[i]
                        );
                        return Ok(false);
                    }
                }
                done += n as u64;
            }
            println!("read {len}/{len} bytes at offset {off}");
        }
        Cmd::Flush => {
            img.flush()?;
            println!("flushed");
        }
    }
    Ok(true)
}

pub fn io(a: IoArgs) -> anyhow::Result<u8> {
    if a.force_share && !a.read_only {
        bail!("-U (force share) needs -r: a shared image cannot be written");
    }
    let cmds = a
        .commands
        .iter()
        .map(|c| parse_cmd(c))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // Nothing is written before the first write command: one refused
    // (beyond the size) leaves the image as it was.
    let opts = OpenOptions {
        writable: !a.read_only,
        force_share: a.force_share,
        defer_writing: true,
        ..OpenOptions::default()
    };
    let mut img = Image::open(&a.file, opts)?;
    for c in &cmds {
        if let Cmd::Write { off, len, .. } | Cmd::Read { off, len, .. } = *c {
            check_range(&img, off, len)?;
        }
    }
    let mut ok = true;
    for c in &cmds {
        if !run_cmd(&mut img, c)? {
            ok = false;
            break;
        }
    }
    img.close()?;
    Ok(if ok { 0 } else { 1 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands() {
        assert_eq!(
            parse_cmd("write 0 4k").unwrap(),
            Cmd::Write {
                pattern: 0xcd,
                off: 0,
                len: 4096
            }
        );
        assert_eq!(
            parse_cmd("read -P 0xab 64k 1").unwrap(),
            Cmd::Read {
                pattern: Some(0xab),
                off: 65536,
                len: 1
            }
        );
        assert_eq!(parse_cmd(" flush ").unwrap(), Cmd::Flush);
        assert!(parse_cmd("write 0").is_err());
        assert!(parse_cmd("write 12x 1").is_err());
        assert!(parse_cmd("frob").is_err());
        assert!(parse_cmd("").is_err());
    }
}
