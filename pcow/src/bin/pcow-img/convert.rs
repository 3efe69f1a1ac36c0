//! `convert`, `compare` and `measure`: thin wrappers over `pcow::ops`.

use anyhow::bail;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use pcow::ops::compare::{CompareOptions, Verdict};
use pcow::ops::convert::{ConvertOptions, ImageFormat, SnapshotSel, DEFAULT_SPARSE_SIZE};
use pcow::ops::measure::{measure_image, measure_size};
use pcow::BaseRef;
use serde_json::json;

use crate::create::{
    base_choice, base_format, cluster_size, one_of, option_help, parse_options, preallocation,
};
use crate::output::print_json;
use crate::size::parse_size;
use crate::{CompareArgs, ConvertArgs, Fmt, MeasureArgs, OutputFormat};

fn progress_bar() -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template(
        "    ({percent:>3}%) [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    )
    .map(|s| s.progress_chars("=> "))
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar
}

/// Runs `op` with a progress callback that draws a bar on stderr when
/// `show`, finished when `op` returns.
fn with_progress<T>(show: bool, op: impl FnOnce(&mut dyn FnMut(u64, u64)) -> T) -> T {
    let bar = show.then(progress_bar);
    let mut progress = |done: u64, total: u64| {
        if let Some(b) = &bar {
            b.set_length(total);
            b.set_position(done);
        }
    };
    let r = op(&mut progress);
    if let Some(b) = &bar {
        b.finish();
    }
    r
}

/// The `-o` keys `convert` takes.
const CONVERT_KEYS: [&str; 4] = [
    "backing_file",
    "backing_fmt",
    "cluster_size",
    "preallocation",
];

pub fn convert(a: ConvertArgs) -> anyhow::Result<u8> {
    let Some(mut o) = parse_options(&a.options, &CONVERT_KEYS)? else {
        println!("{}", option_help(&CONVERT_KEYS));
        return Ok(0);
    };
    let (Some(input), Some(output)) = (&a.input, &a.output) else {
        bail!(
            "the input and the output are needed (pcow-img convert [OPTIONS] -O FMT INPUT OUTPUT)"
        );
    };
    let cluster = one_of(a.cluster, "-c", o.cluster_size.take(), "cluster_size")?;
    let cluster = cluster_size(cluster.as_deref())?;
    if cluster.is_some() && a.output_format == Fmt::Raw {
        bail!("-c (cluster size) only applies to -O pcow");
    }
    let (base, base_fmt) = base_choice(a.base, "-B", a.base_format, &mut o)?;
    let snapshot = match (a.load_snapshot, a.snapshot) {
        (Some(_), Some(_)) => bail!("-l and -s both name a snapshot: use one"),
        (Some(l), None) => Some(SnapshotSel::parse_load(&l)?),
        (None, Some(s)) if s.is_empty() => bail!("-s needs a snapshot id or name"),
        (None, Some(s)) => Some(SnapshotSel::IdOrTag(s)),
        (None, None) => None,
    };
    let sparse_size = match &a.sparse_size {
        Some(s) => parse_size(s)?,
        None => DEFAULT_SPARSE_SIZE,
    };
    let opts = ConvertOptions {
        input_format: a.input_format.map(Into::into),
        cluster_size: cluster,
        force_share: a.force_share,
        snapshot,
        base: base.map(|name| BaseRef {
            format: base_format(output, &name, base_fmt),
            name,
        }),
        existing_target: a.existing_target,
        target_is_zero: a.target_is_zero,
        sparse_size,
        preallocation: preallocation(&o)?,
        ..ConvertOptions::new(a.output_format.into())
    };
    let report = with_progress(a.progress, |progress| {
        pcow::ops::convert::convert(input, output, &opts, progress)
    })?;
    if report.rounded() && !a.existing_target && !a.quiet {
        eprintln!(
            "pcow-img: note: virtual size rounded up from {} to {} bytes (a multiple of the cluster size)",
            report.input_size, report.output_size
        );
    }
    Ok(0)
}

/// Prints qemu-img compare's lines (unless `-q`); the exit status is 0
/// identical, 1 different, 2-4 for an error (printed even with `-q`).
pub fn compare(a: CompareArgs) -> anyhow::Result<u8> {
    let opts = CompareOptions {
        formats: [
            a.first_format.map(Into::into),
            a.second_format.map(Into::into),
        ],
        strict: a.strict,
        force_share: a.force_share,
    };
    let verdict = with_progress(a.progress && !a.quiet, |progress| {
        pcow::ops::compare::compare(&a.first, &a.second, &opts, progress)
    });
    let verdict = match verdict {
        Ok(v) => v,
        Err(e) => {
            let code = e.exit_code();
            eprintln!("pcow-img: {}", crate::output::error_line(&e.into()));
            return Ok(code);
        }
    };
    let say = |line: String| {
        if !a.quiet {
            println!("{line}");
        }
    };
    Ok(match verdict {
        Verdict::Identical { size_mismatch } => {
            if size_mismatch {
                say("Warning: Image size mismatch!".into());
            }
            say("Images are identical.".into());
            0
        }
        Verdict::ContentMismatch {
            offset,
            size_mismatch,
        } => {
            if size_mismatch {
                say("Warning: Image size mismatch!".into());
            }
            say(format!("Content mismatch at offset {offset}!"));
            1
        }
        Verdict::SizeMismatch => {
            say("Strict mode: Image size mismatch!".into());
            1
        }
        Verdict::AllocationMismatch { offset } => {
            say(format!(
                "Strict mode: Offset {offset} block status mismatch!"
            ));
            1
        }
    })
}

pub fn measure(a: MeasureArgs) -> anyhow::Result<u8> {
    if a.output_format != Fmt::Pcow {
        bail!("measure only supports -O pcow");
    }
    let cluster = cluster_size(a.cluster.as_deref())?;
    let m = match (&a.size, &a.input) {
        (Some(s), None) => {
            let n = parse_size(s)?;
            if n == 0 {
                bail!("invalid size '{s}': must be non-zero");
            }
            measure_size(n, cluster)?
        }
        (None, Some(input)) => measure_image(
            input,
            a.input_format.map(ImageFormat::from),
            cluster,
            a.force_share,
        )?,
        _ => bail!("give either --size SIZE or an input image"),
    };
    match a.output {
        OutputFormat::Json => print_json(&json!({
            "required": m.required,
            "fully-allocated": m.fully_allocated,
        }))?,
        OutputFormat::Human => {
            println!("required size: {}", m.required);
            println!("fully allocated size: {}", m.fully_allocated);
        }
    }
    Ok(0)
}
