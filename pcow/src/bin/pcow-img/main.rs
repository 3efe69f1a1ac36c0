//! `pcow-img`: the offline tool for pcow images, in qemu-img's conventions.
//!
//! Errors are one line on stderr (`pcow-img: ` and the error's cause chain)
//! with exit code 1; `check` exits 0 (clean), 2 (corrupt) or 3 (leaks only).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

mod check;
mod convert;
mod create;
mod info;
mod io;
mod maint;
mod output;
mod size;
mod snapshot;

/// An image format on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Fmt {
    /// Plain bytes.
    Raw,
    /// A pcow image.
    Pcow,
}

impl From<Fmt> for pcow::ops::convert::ImageFormat {
    fn from(f: Fmt) -> Self {
        match f {
            Fmt::Raw => pcow::ops::convert::ImageFormat::Raw,
            Fmt::Pcow => pcow::ops::convert::ImageFormat::Pcow,
        }
    }
}

impl From<Fmt> for pcow::BaseFormat {
    fn from(f: Fmt) -> Self {
        match f {
            Fmt::Raw => pcow::BaseFormat::Raw,
            Fmt::Pcow => pcow::BaseFormat::Pcow,
        }
    }
}

/// Output format of the inspecting commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum OutputFormat {
    /// Text in qemu-img's layout.
    #[default]
    Human,
    /// JSON.
    Json,
}

/// `pcow-img`: create, inspect, check and convert pcow images.
#[derive(Debug, Parser)]
#[command(name = "pcow-img", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create a new image (replacing FILE).
    Create(CreateArgs),
    /// Show an image's header, snapshots and base.
    Info(InfoArgs),
    /// Check an image's consistency (exit 0 clean, 2 corrupt, 3 leaks only).
    Check(CheckArgs),
    /// Create, list, apply or delete internal snapshots.
    Snapshot(SnapshotArgs),
    /// Revert the image to a snapshot (same as `snapshot -a`).
    Rollback(RollbackArgs),
    /// Copy an overlay's data into its base image.
    Commit(CommitArgs),
    /// Change an image's base image.
    Rebase(RebaseArgs),
    /// Show where the image's data lives.
    Map(MapArgs),
    /// Copy an image (or a snapshot of it) into a raw or pcow file, writing
    /// only what differs from what the output shows.
    Convert(ConvertArgs),
    /// Check whether two images show the same content (exit 0 identical,
    /// 1 different, 2 opening, 3 allocation or 4 read errors).
    Compare(CompareArgs),
    /// Compute the file size a pcow image needs.
    Measure(MeasureArgs),
    /// Grow an image's virtual size.
    Resize(ResizeArgs),
    /// Rewrite an image without unreachable layers and clusters.
    Compact(CompactArgs),
    /// Read, write and flush an image, as qemu-io does.
    Io(IoArgs),
}

#[derive(Debug, Args)]
struct CreateArgs {
    /// Quiet: print nothing on success.
    #[arg(short = 'q')]
    quiet: bool,
    /// Format of the new image: pcow (default), or raw (a sparse file of
    /// SIZE bytes).
    #[arg(short = 'f', value_name = "FMT")]
    format: Option<Fmt>,
    /// qemu-img style options, KEY=VALUE[,...]: cluster_size, backing_file,
    /// backing_fmt, size (',,' is a comma in a value; 'help' lists them).
    #[arg(short = 'o', value_name = "OPTIONS")]
    options: Vec<String>,
    /// Cluster size (4K to 2M, a power of two; default 64K).
    #[arg(short = 'c', long = "cluster-size", value_name = "CLUSTER")]
    cluster: Option<String>,
    /// Base image, stored as given (relative to FILE's directory).
    #[arg(short = 'b', long = "backing", value_name = "BASE")]
    base: Option<String>,
    /// Format of the base image (probed and recorded when absent).
    #[arg(short = 'F', long = "backing-format", value_name = "BASE_FMT")]
    base_format: Option<Fmt>,
    /// The image to create (required unless -o help).
    file: Option<PathBuf>,
    /// Virtual size (K/M/G/T suffixes); defaults to the base's size.
    size: Option<String>,
}

#[derive(Debug, Args)]
struct InfoArgs {
    /// Format of the image (probed when absent), as qemu-img's -f.
    #[arg(short = 'f', value_name = "FMT")]
    format: Option<Fmt>,
    /// Output format.
    #[arg(long, value_enum, default_value_t)]
    output: OutputFormat,
    /// Show every image of the base chain.
    #[arg(long = "backing-chain")]
    backing_chain: bool,
    /// Open without locks (the image may be in use).
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// The image.
    file: PathBuf,
}

/// What `check -r` may repair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RepairArg {
    /// Uncommitted clusters, stale slots, the DIRTY flag.
    Leaks,
    /// Leaks and counters.
    All,
}

#[derive(Debug, Args)]
struct CheckArgs {
    /// Quiet: print nothing on success.
    #[arg(short = 'q')]
    quiet: bool,
    /// Format of the image (probed when absent), as qemu-img's -f.
    #[arg(short = 'f', value_name = "FMT")]
    format: Option<Fmt>,
    /// Repair leaks, or everything repairable.
    #[arg(short = 'r', long = "repair", value_enum)]
    repair: Option<RepairArg>,
    /// Output format.
    #[arg(long, value_enum, default_value_t)]
    output: OutputFormat,
    /// Open without locks (the image may be in use).
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// The image.
    file: PathBuf,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("op").required(true).args(["create", "list", "apply", "delete"])))]
struct SnapshotArgs {
    /// Quiet: print nothing on success.
    #[arg(short = 'q')]
    quiet: bool,
    /// Format of the image: pcow (as qemu-img's -f; raw has no snapshots
    /// or base).
    #[arg(short = 'f', value_name = "FMT")]
    format: Option<Fmt>,
    /// Create a snapshot tagged TAG.
    #[arg(short = 'c', value_name = "TAG")]
    create: Option<String>,
    /// List the snapshots.
    #[arg(short = 'l')]
    list: bool,
    /// Apply (revert to) snapshot SNAP (id or tag).
    #[arg(short = 'a', value_name = "SNAP")]
    apply: Option<String>,
    /// Delete snapshot SNAP (id or tag).
    #[arg(short = 'd', value_name = "SNAP")]
    delete: Option<String>,
    /// Open without locks (only with -l).
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// The image.
    file: PathBuf,
}

#[derive(Debug, Args)]
struct RollbackArgs {
    /// Quiet: print nothing on success.
    #[arg(short = 'q')]
    quiet: bool,
    /// The image.
    file: PathBuf,
    /// Snapshot id or tag.
    snap: String,
}

#[derive(Debug, Args)]
struct CommitArgs {
    /// Quiet: print nothing on success.
    #[arg(short = 'q')]
    quiet: bool,
    /// Format of the image: pcow (as qemu-img's -f; raw has no snapshots
    /// or base).
    #[arg(short = 'f', value_name = "FMT")]
    format: Option<Fmt>,
    /// Keep the overlay's content (do not empty it).
    #[arg(short = 'd')]
    keep: bool,
    /// Commit into BASE, any image of the chain (the overlay is kept; the
    /// images between read BASE's new content where they hold nothing).
    #[arg(short = 'b', value_name = "BASE")]
    base: Option<PathBuf>,
    /// The overlay.
    file: PathBuf,
}

#[derive(Debug, Args)]
struct RebaseArgs {
    /// Quiet: print nothing on success.
    #[arg(short = 'q')]
    quiet: bool,
    /// Format of the image: pcow (as qemu-img's -f; raw has no snapshots
    /// or base).
    #[arg(short = 'f', value_name = "FMT")]
    image_format: Option<Fmt>,
    /// Unsafe: only change the base name, copy nothing.
    #[arg(short = 'u')]
    unsafe_: bool,
    /// Format of the new base (probed and recorded when absent).
    #[arg(short = 'F', long = "backing-format", value_name = "FMT")]
    format: Option<Fmt>,
    /// New base image ("" removes the base, copying its data in).
    #[arg(short = 'b', long = "backing", value_name = "NEW_BASE")]
    base: String,
    /// The image.
    file: PathBuf,
}

#[derive(Debug, Args)]
struct MapArgs {
    /// Format of the image (probed when absent), as qemu-img's -f.
    #[arg(short = 'f', value_name = "FMT")]
    format: Option<Fmt>,
    /// Map from this virtual offset (K/M/G/T suffixes).
    #[arg(long = "start-offset", value_name = "OFFSET")]
    start_offset: Option<String>,
    /// Map at most this many bytes (K/M/G/T suffixes).
    #[arg(long = "max-length", value_name = "LENGTH")]
    max_length: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t)]
    output: OutputFormat,
    /// Open without locks (the image may be in use).
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// The image.
    file: PathBuf,
}

#[derive(Debug, Args)]
struct ConvertArgs {
    /// Input format (probed when absent).
    #[arg(short = 'f', value_name = "FMT")]
    input_format: Option<Fmt>,
    /// Output format.
    #[arg(short = 'O', value_name = "FMT")]
    output_format: Fmt,
    /// qemu-img style options for a new pcow output, KEY=VALUE[,...]:
    /// cluster_size, backing_file, backing_fmt ('help' lists them).
    #[arg(short = 'o', value_name = "OPTIONS")]
    options: Vec<String>,
    /// Cluster size of a new pcow output.
    #[arg(short = 'c', value_name = "CLUSTER")]
    cluster: Option<String>,
    /// Make the new pcow output an overlay of BASE (stored as given,
    /// relative to OUTPUT's directory); only what differs from BASE is
    /// written.
    #[arg(short = 'B', value_name = "BASE")]
    base: Option<String>,
    /// Format of BASE (probed and recorded when absent).
    #[arg(short = 'F', value_name = "BASE_FMT")]
    base_format: Option<Fmt>,
    /// Convert a snapshot of the input: snapshot.id=ID, snapshot.name=NAME
    /// (or both, comma-separated), or an id or name.
    #[arg(short = 'l', value_name = "SNAPSHOT_PARAM")]
    load_snapshot: Option<String>,
    /// Convert the snapshot with this id or name (the same as -l ID_OR_NAME).
    #[arg(short = 's', value_name = "SNAPSHOT")]
    snapshot: Option<String>,
    /// Write into the existing OUTPUT (in the -O format, at least the
    /// input's size) instead of creating it.
    #[arg(short = 'n')]
    existing_target: bool,
    /// With -n: the target reads as zeros, so it is not read.
    #[arg(long = "target-is-zero")]
    target_is_zero: bool,
    /// Zero runs shorter than this are allocated (a multiple of 4K up to
    /// 16M; 0 allocates the whole output; default 4K).
    #[arg(short = 'S', value_name = "SPARSE_SIZE")]
    sparse_size: Option<String>,
    /// Show a progress bar.
    #[arg(short = 'p')]
    progress: bool,
    /// Quiet: no notes.
    #[arg(short = 'q')]
    quiet: bool,
    /// Open the input without locks.
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// Input image (required unless -o help).
    input: Option<PathBuf>,
    /// Output file: replaced, or written into with -n.
    output: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct CompareArgs {
    /// Format of the first image (probed when absent).
    #[arg(short = 'f', value_name = "FMT")]
    first_format: Option<Fmt>,
    /// Format of the second image (probed when absent).
    #[arg(short = 'F', value_name = "FMT")]
    second_format: Option<Fmt>,
    /// Strict: different sizes, or data allocated in one image where the
    /// other has none, count as different.
    #[arg(short = 's')]
    strict: bool,
    /// Show a progress bar.
    #[arg(short = 'p')]
    progress: bool,
    /// Print nothing but errors (the exit status answers).
    #[arg(short = 'q')]
    quiet: bool,
    /// Open the images without locks (they may be in use).
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// The first image.
    first: PathBuf,
    /// The second image.
    second: PathBuf,
}

#[derive(Debug, Args)]
struct MeasureArgs {
    /// Output format of the image to measure (only pcow).
    #[arg(short = 'O', value_name = "FMT")]
    output_format: Fmt,
    /// Cluster size.
    #[arg(short = 'c', value_name = "CLUSTER")]
    cluster: Option<String>,
    /// Input format (probed when absent).
    #[arg(short = 'f', value_name = "FMT", requires = "input")]
    input_format: Option<Fmt>,
    /// Measure a new image of this virtual size.
    #[arg(
        long,
        value_name = "SIZE",
        conflicts_with = "input",
        required_unless_present = "input"
    )]
    size: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t)]
    output: OutputFormat,
    /// Open the input without locks.
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// Measure the conversion of this image.
    input: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct ResizeArgs {
    /// Quiet: print nothing on success.
    #[arg(short = 'q')]
    quiet: bool,
    /// Format of the image (probed when absent): pcow, or raw (the file
    /// grows).
    #[arg(short = 'f', value_name = "FMT")]
    format: Option<Fmt>,
    /// The image.
    file: PathBuf,
    /// New size, or +SIZE to grow by SIZE.
    #[arg(allow_hyphen_values = true)]
    size: String,
}

#[derive(Debug, Args)]
struct CompactArgs {
    /// Quiet: print nothing on success.
    #[arg(short = 'q')]
    quiet: bool,
    /// Format of the image: pcow (as qemu-img's -f; raw has no snapshots
    /// or base).
    #[arg(short = 'f', value_name = "FMT")]
    format: Option<Fmt>,
    /// The image.
    file: PathBuf,
}

#[derive(Debug, Args)]
struct IoArgs {
    /// Open read-only.
    #[arg(short = 'r')]
    read_only: bool,
    /// Open without locks (only with -r).
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    /// Command: 'write [-P BYTE] OFF LEN', 'read [-P BYTE] OFF LEN', 'flush'.
    #[arg(short = 'c', value_name = "CMD", required = true)]
    commands: Vec<String>,
    /// The image.
    file: PathBuf,
}

/// Runs the command; `Ok` carries the exit code.
fn run(cli: Cli) -> anyhow::Result<u8> {
    match cli.command {
        Command::Create(a) => create::create(a),
        Command::Info(a) => info::info(a),
        Command::Check(a) => check::check(a),
        Command::Snapshot(a) => snapshot::snapshot(a),
        Command::Rollback(a) => snapshot::rollback(a),
        Command::Commit(a) => maint::commit(a),
        Command::Rebase(a) => maint::rebase(a),
        Command::Map(a) => info::map(a),
        Command::Convert(a) => convert::convert(a),
        Command::Compare(a) => convert::compare(a),
        Command::Measure(a) => convert::measure(a),
        Command::Resize(a) => maint::resize(a),
        Command::Compact(a) => maint::compact(a),
        Command::Io(a) => io::io(a),
    }
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_target(false)
        .init();
    // A closed stdout (`pcow-img map | head`) ends the process as it ends
    // `cat`, instead of a panic in `println!`. Writes to images are
    // positioned writes to files, which never raise SIGPIPE.
    // SAFETY: setting a signal's disposition to the default before any
    // thread is started; no handler is installed.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                // Help and version go to stdout with success.
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                let _ = e.print();
                return ExitCode::from(1);
            }
            let msg = e.to_string();
            let line = msg.lines().next().unwrap_or("bad arguments");
            let line = line.strip_prefix("error: ").unwrap_or(line);
            eprintln!("pcow-img: {line} (see 'pcow-img --help')");
            return ExitCode::from(1);
        }
    };
    match run(cli) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("pcow-img: {}", output::error_line(&e));
            ExitCode::from(1)
        }
    }
}
