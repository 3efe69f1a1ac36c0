//! `create`.

use std::path::Path;

use anyhow::bail;
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

pub fn create(a: CreateArgs) -> anyhow::Result<u8> {
    let cluster = cluster_size(a.cluster.as_deref())?;
    let cs = cluster.unwrap_or(DEFAULT_CLUSTER_SIZE);
    let size = match &a.size {
        Some(s) => {
            let n = parse_aligned(s, cs)?;
            if n == 0 {
                bail!("invalid size '{s}': must be non-zero");
            }
            Some(n)
        }
        None => None,
    };
    let base = a.base.map(|name| BaseRef {
        format: base_format(&a.file, &name, a.base_format),
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
    let img = Image::create(&a.file, &opts)?;
    let vs = img.virtual_size();
    img.close()?;
    let mut line = format!(
        "Formatting '{}', fmt=pcow cluster_size={cs} size={vs}",
        a.file.display()
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
