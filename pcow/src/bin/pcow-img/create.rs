//! `create`.

use std::path::Path;

use anyhow::{bail, Context};
use clap::ValueEnum;
use pcow::{BaseFormat, BaseRef, CreateOptions, Image, Preallocation, DEFAULT_CLUSTER_SIZE};

use crate::size::{parse_aligned, parse_size};
use crate::CreateArgs;

/// Parses `-c`: a power of two from 4K to 2M.
pub fn cluster_size(arg: Option<&str>) -> anyhow::Result<Option<u64>> {
    let Some(s) = arg else {
        return Ok(None);
    };
    let c = parse_size(s)?;
    if pcow::Geometry::from_cluster_size(c).is_none() {
        bail!("invalid cluster size '{s}': must be a power of two from 4K to 2M");
    }
    Ok(Some(c))
}

/// The format to record for base `name` of the image at `image`: the given
/// one, or what the file looks like now (probe if it cannot be read, which
/// the library then reports).
pub fn base_format(image: &Path, name: &str, given: Option<crate::Fmt>) -> BaseFormat {
    if let Some(f) = given {
        return f.into();
    }
    let resolved = pcow::resolve_base(image, name);
    match std::fs::File::open(resolved).map(|f| pcow::is_pcow(&f)) {
        Ok(Ok(true)) => BaseFormat::Pcow,
        Ok(Ok(false)) => BaseFormat::Raw,
        _ => BaseFormat::Probe,
    }
}

/// What `-o` may set, as qemu-img names it, with the flag each one
/// stands for.
const OPTIONS: [(&str, &str, &str); 5] = [
    (
        "backing_file",
        "FILE",
        "base image (the same as -b; convert: -B)",
    ),
    (
        "backing_fmt",
        "FMT",
        "format of the base image: raw or pcow (the same as -F)",
    ),
    (
        "cluster_size",
        "SIZE",
        "cluster size, a power of two from 4K to 2M (the same as -c)",
    ),
    (
        "preallocation",
        "MODE",
        "off (default), falloc or full: allocate every cluster up front",
    ),
    (
        "size",
        "SIZE",
        "virtual size (the same as the SIZE argument)",
    ),
];

/// `-o help` for a command that takes the options named in `known`.
pub fn option_help(known: &[&str]) -> String {
    let mut s = String::from("Supported options:");
    for (key, value, what) in OPTIONS.iter().filter(|o| known.contains(&o.0)) {
        s += &format!("\n  {:<19} {what}", format!("{key}={value}"));
    }
    s
}

/// `-o` options after parsing: each one set at most once.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct CreateOpts {
    pub backing_file: Option<String>,
    pub backing_fmt: Option<String>,
    pub cluster_size: Option<String>,
    pub size: Option<String>,
    pub preallocation: Option<String>,
}

/// Splits one `-o` value at commas (`,,` is a comma inside a value) into
/// `KEY=VALUE` pairs.
fn split_options(arg: &str) -> anyhow::Result<Vec<(String, String)>> {
    let mut items = Vec::new();
    let mut cur = String::new();
    let mut chars = arg.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            ',' if chars.peek() == Some(&',') => {
                chars.next();
                cur.push(',');
            }
            ',' => items.push(std::mem::take(&mut cur)),
            c => cur.push(c),
        }
    }
    items.push(cur);
    items
        .into_iter()
        .map(|item| match item.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
            _ => bail!("invalid option '{item}' in -o '{arg}': expected KEY=VALUE"),
        })
        .collect()
}

/// Parses every `-o` given, each key one of `known`; `Ok(None)` when one
/// of them asks for help.
pub fn parse_options(args: &[String], known: &[&str]) -> anyhow::Result<Option<CreateOpts>> {
    let mut o = CreateOpts::default();
    for arg in args {
        if arg == "help" || arg == "?" {
            return Ok(None);
        }
        for (k, v) in split_options(arg)? {
            let slot = match k.as_str() {
                "backing_file" => Some(&mut o.backing_file),
                "backing_fmt" => Some(&mut o.backing_fmt),
                "cluster_size" => Some(&mut o.cluster_size),
                "size" => Some(&mut o.size),
                "preallocation" => Some(&mut o.preallocation),
                _ => None,
            }
            .filter(|_| known.contains(&k.as_str()));
            let Some(slot) = slot else {
                bail!(
                    "unknown option '{k}' (known: {}; -o help lists them)",
                    known.join(", ")
                );
            };
            if slot.replace(v).is_some() {
                bail!("option '{k}' given twice");
            }
        }
    }
    Ok(Some(o))
}

/// The `-o` keys `create` takes.
const CREATE_KEYS: [&str; 5] = [
    "backing_file",
    "backing_fmt",
    "cluster_size",
    "preallocation",
    "size",
];

/// `-o preallocation=MODE`, off when absent.
pub fn preallocation(o: &CreateOpts) -> anyhow::Result<Preallocation> {
    Ok(match &o.preallocation {
        Some(m) => m.parse()?,
        None => Preallocation::Off,
    })
}

/// How the "Formatting" line names a mode other than off.
fn prealloc_note(p: Preallocation) -> &'static str {
    match p {
        Preallocation::Off => "",
        Preallocation::Falloc => " preallocation=falloc",
        Preallocation::Full => " preallocation=full",
    }
}

/// The base image and its format, from `base_flag` (`-b` or `-B`) and
/// `-F`, or from `-o backing_file=` and `backing_fmt=`.
pub fn base_choice(
    base_flag: Option<String>,
    base_flag_name: &str,
    format_flag: Option<crate::Fmt>,
    o: &mut CreateOpts,
) -> anyhow::Result<(Option<String>, Option<crate::Fmt>)> {
    let name = one_of(
        base_flag,
        base_flag_name,
        o.backing_file.take(),
        "backing_file",
    )?;
    let format = match (format_flag, o.backing_fmt.take()) {
        (Some(_), Some(_)) => bail!("-F and -o backing_fmt both given: use one"),
        (Some(f), None) => Some(f),
        (None, Some(s)) => Some(
            crate::Fmt::from_str(&s, false)
                .map_err(|_| anyhow::anyhow!("invalid backing_fmt '{s}' (expected raw or pcow)"))?,
        ),
        (None, None) => None,
    };
    if format.is_some() && name.is_none() {
        bail!(
            "a base format (-F or -o backing_fmt) needs a base image ({base_flag_name} or -o backing_file)"
        );
    }
    Ok((name, format))
}

/// `flag` or option `key`, not both.
pub fn one_of(
    flag: Option<String>,
    flag_name: &str,
    opt: Option<String>,
    key: &str,
) -> anyhow::Result<Option<String>> {
    match (flag, opt) {
        (Some(_), Some(_)) => bail!("{flag_name} and -o {key} both given: use one"),
        (f, o) => Ok(f.or(o)),
    }
}

pub fn create(a: CreateArgs) -> anyhow::Result<u8> {
    let Some(mut o) = parse_options(&a.options, &CREATE_KEYS)? else {
        println!("{}", option_help(&CREATE_KEYS));
        return Ok(0);
    };
    let Some(file) = a.file else {
        bail!("the image to create is missing (pcow-img create [OPTIONS] FILE [SIZE])");
    };
    let cluster = one_of(a.cluster, "-c", o.cluster_size.take(), "cluster_size")?;
    let (base_name, base_fmt) = base_choice(a.base, "-b", a.base_format, &mut o)?;
    let size = one_of(a.size, "SIZE", o.size.take(), "size")?;
    let prealloc = preallocation(&o)?;
    if a.format == Some(crate::Fmt::Raw) {
        if base_name.is_some() {
            bail!("a raw image has no base image (-b or -o backing_file is for pcow)");
        }
        if cluster.is_some() {
            bail!("a raw image has no cluster size (-c or -o cluster_size is for pcow)");
        }
        return create_raw(&file, size.as_deref(), prealloc, a.quiet);
    }
    let cluster = cluster_size(cluster.as_deref())?;
    let cs = cluster.unwrap_or(DEFAULT_CLUSTER_SIZE);
    let size = match &size {
        Some(s) => {
            let n = parse_aligned(s, cs)?;
            if n == 0 {
                bail!("invalid size '{s}': must be non-zero");
            }
            Some(n)
        }
        None => None,
    };
    let base = base_name.map(|name| BaseRef {
        format: base_format(&file, &name, base_fmt),
        name,
    });
    if base.is_none() && size.is_none() {
        bail!("a size is needed when there is no base image (-b)");
    }
    let opts = CreateOptions {
        cluster_size: cluster,
        virtual_size: size,
        base: base.clone(),
    };
    let mut img = Image::create(&file, &opts)?;
    img.preallocate(prealloc)?;
    let vs = img.virtual_size();
    img.close()?;
    let mut line = format!(
        "Formatting '{}', fmt=pcow cluster_size={cs}{} size={vs}",
        file.display(),
        prealloc_note(prealloc)
    );
    if let Some(b) = base {
        line.push_str(&format!(
            " backing_file={} backing_fmt={}",
            b.name,
            b.format.name()
        ));
    }
    if !a.quiet {
        println!("{line}");
    }
    Ok(0)
}

/// `create -f raw`: a sparse file of `size` bytes (replacing `path`).
fn create_raw(
    path: &Path,
    size: Option<&str>,
    prealloc: Preallocation,
    quiet: bool,
) -> anyhow::Result<u8> {
    let Some(s) = size else {
        bail!("a size is needed for a raw image");
    };
    let n = parse_size(s)?;
    // An existing file is locked before it is truncated: one that another
    // process holds is refused unchanged.
    let (f, created) = pcow::output_file::open_output_noting(path)?;
    if let Err(e) = pcow::output_file::reset_len(&f, path, n) {
        // A size the file system cannot hold leaves no new file behind.
        if created {
            let _ = std::fs::remove_file(path);
        }
        return Err(e.into());
    }
    if prealloc != Preallocation::Off {
        pcow::io::preallocate_file(&f, n, prealloc == Preallocation::Full)
            .with_context(|| format!("{}: preallocating {n} bytes", path.display()))?;
    }
    f.sync_all()
        .with_context(|| format!("{}: syncing", path.display()))?;
    if !quiet {
        println!(
            "Formatting '{}', fmt=raw size={n}{}",
            path.display(),
            prealloc_note(prealloc)
        );
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_split_at_commas_with_doubled_commas_kept() {
        let v = split_options("backing_file=a,,b.pcow,size=1M").unwrap();
        assert_eq!(
            v,
            [
                ("backing_file".to_owned(), "a,b.pcow".to_owned()),
                ("size".to_owned(), "1M".to_owned())
            ]
        );
        assert!(split_options("size").is_err());
        assert!(split_options("=1M").is_err());
        assert!(split_options("size=1M,").is_err());
    }

    #[test]
    fn options_are_known_and_set_once() {
        let o = parse_options(&["cluster_size=4k".into(), "size=1M".into()], &CREATE_KEYS)
            .unwrap()
            .unwrap();
        assert_eq!(o.cluster_size.as_deref(), Some("4k"));
        assert_eq!(o.size.as_deref(), Some("1M"));
        assert!(parse_options(&["help".into()], &CREATE_KEYS)
            .unwrap()
            .is_none());
        let e = parse_options(&["size=1M,size=2M".into()], &CREATE_KEYS).unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");
        let e = parse_options(&["compat=1.1".into()], &CREATE_KEYS).unwrap_err();
        assert!(e.to_string().contains("unknown option 'compat'"), "{e}");
    }
}
