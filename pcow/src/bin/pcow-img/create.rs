//! `create`.

use std::path::Path;

use anyhow::{bail, Context};
use clap::ValueEnum;
use pcow::{BaseFormat, BaseRef, CreateOptions, Image, DEFAULT_CLUSTER_SIZE};

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

/// What `-o` may set, as qemu-img names it.
const OPTION_HELP: &str = "Supported options:
  backing_file=FILE   base image (the same as -b)
  backing_fmt=FMT     format of the base image: raw or pcow (the same as -F)
  cluster_size=SIZE   cluster size, a power of two from 4K to 2M (the same as -c)
  size=SIZE           virtual size (the same as the SIZE argument)";

/// `-o` options after parsing: each one set at most once.
#[derive(Debug, Default, PartialEq, Eq)]
struct CreateOpts {
    backing_file: Option<String>,
    backing_fmt: Option<String>,
    cluster_size: Option<String>,
    size: Option<String>,
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

/// Parses every `-o` given; `Ok(None)` when one of them asks for help.
fn parse_options(args: &[String]) -> anyhow::Result<Option<CreateOpts>> {
    let mut o = CreateOpts::default();
    for arg in args {
        if arg == "help" || arg == "?" {
            return Ok(None);
        }
        for (k, v) in split_options(arg)? {
            let slot = match k.as_str() {
                "backing_file" => &mut o.backing_file,
                "backing_fmt" => &mut o.backing_fmt,
                "cluster_size" => &mut o.cluster_size,
                "size" => &mut o.size,
                _ => bail!(
                    "unknown option '{k}' (known: backing_file, backing_fmt, cluster_size, size; \
                     -o help lists them)"
                ),
            };
            if slot.replace(v).is_some() {
                bail!("option '{k}' given twice");
            }
        }
    }
    Ok(Some(o))
}

/// `flag` or option `key`, not both.
fn one_of(
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
    let Some(o) = parse_options(&a.options)? else {
        println!("{OPTION_HELP}");
        return Ok(0);
    };
    let Some(file) = a.file else {
        bail!("the image to create is missing (pcow-img create [OPTIONS] FILE [SIZE])");
    };
    let cluster = one_of(a.cluster, "-c", o.cluster_size, "cluster_size")?;
    let base_name = one_of(a.base, "-b", o.backing_file, "backing_file")?;
    let base_fmt = match (a.base_format, o.backing_fmt) {
        (Some(_), Some(_)) => bail!("-F and -o backing_fmt both given: use one"),
        (Some(f), None) => Some(f),
        (None, Some(s)) => Some(
            crate::Fmt::from_str(&s, false)
                .map_err(|_| anyhow::anyhow!("invalid backing_fmt '{s}' (expected raw or pcow)"))?,
        ),
        (None, None) => None,
    };
    let size = one_of(a.size, "SIZE", o.size, "size")?;
    if base_fmt.is_some() && base_name.is_none() {
        bail!("a base format (-F or -o backing_fmt) needs a base image (-b or -o backing_file)");
    }
    if a.format == Some(crate::Fmt::Raw) {
        if base_name.is_some() {
            bail!("a raw image has no base image (-b or -o backing_file is for pcow)");
        }
        if cluster.is_some() {
            bail!("a raw image has no cluster size (-c or -o cluster_size is for pcow)");
        }
        return create_raw(&file, size.as_deref());
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
    let img = Image::create(&file, &opts)?;
    let vs = img.virtual_size();
    img.close()?;
    let mut line = format!(
        "Formatting '{}', fmt=pcow cluster_size={cs} size={vs}",
        file.display()
    );
    if let Some(b) = base {
        line.push_str(&format!(
            " backing_file={} backing_fmt={}",
            b.name,
            b.format.name()
        ));
    }
    println!("{line}");
    Ok(0)
}

/// `create -f raw`: a sparse file of `size` bytes (replacing `path`).
fn create_raw(path: &Path, size: Option<&str>) -> anyhow::Result<u8> {
    let Some(s) = size else {
        bail!("a size is needed for a raw image");
    };
    let n = parse_size(s)?;
    let f = std::fs::File::create(path)
        .with_context(|| format!("{}: creating the file", path.display()))?;
    f.set_len(n)
        .with_context(|| format!("{}: setting its length to {n}", path.display()))?;
    f.sync_all()
        .with_context(|| format!("{}: syncing", path.display()))?;
    println!("Formatting '{}', fmt=raw size={n}", path.display());
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
        let o = parse_options(&["cluster_size=4k".into(), "size=1M".into()])
            .unwrap()
            .unwrap();
        assert_eq!(o.cluster_size.as_deref(), Some("4k"));
        assert_eq!(o.size.as_deref(), Some("1M"));
        assert!(parse_options(&["help".into()]).unwrap().is_none());
        let e = parse_options(&["size=1M,size=2M".into()]).unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");
        let e = parse_options(&["compat=1.1".into()]).unwrap_err();
        assert!(e.to_string().contains("unknown option 'compat'"), "{e}");
    }
}
