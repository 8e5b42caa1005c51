//! Command-line arguments: one shared geometry struct, one struct per command.

use crate::layout::discover::GeometryFlags;
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(name = "fdpblk", version, about = "Key-aware FDP placement for LMCache raw_block, as a ublk server")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Create /dev/ublkbN over an NVMe FDP namespace (or a file) and serve LMCache on it.
    Add(AddArgs),
    /// Stop and delete devices.
    Del(DelArgs),
    /// List fdpblk devices with their backing, engine, policy, geometry and state.
    List(ListArgs),
    /// Re-attach a new daemon to a device whose daemon died (in-flight I/O is re-issued).
    Recover(IdArgs),
    /// Requests and bytes per class and per placement handle of a running device.
    Stats(StatsArgs),
    /// Start device NAME from /etc/fdpblk/NAME.toml in the foreground (systemd's
    /// fdpblk@NAME.service), or recover it if it exists and its daemon died.
    Up(crate::cmd::up::UpArgs),
    /// Stop device NAME (ExecStop of fdpblk@NAME.service); a device whose daemon died is kept
    /// for `fdpblk up` to recover.
    Down(crate::cmd::up::UpArgs),
    /// Every device's stats in Prometheus text format, once to stdout or as a textfile for
    /// node_exporter, rewritten every --interval seconds.
    Metrics(crate::cmd::metrics::MetricsArgs),
    /// The ublk driver's feature bits, those fdpblk uses, and block write-stream support.
    Features(FeaturesArgs),
    /// Print the --name of device ID (for the udev rule in deploy/); exit 1 if it has none.
    #[command(hide = true)]
    Name(NameArgs),
    /// Print the drive's FDP counters since `add` of device ID as JSON (`stats` runs it as a
    /// child, so that a hung drive does not hold it).
    #[command(hide = true)]
    DriveDeltas(NameArgs),
    /// Show the raw_block layout, both checkpoint copies and the live entries of a device or image.
    Inspect(InspectArgs),
    /// Run a trace of block requests through the classifier, a policy and the simulated drive.
    Replay(ReplayArgs),
    /// What an NVMe FDP drive reports: `fdp status` (placement IDs, RUH status, configuration)
    /// and `fdp stats` (host/media bytes written, media bytes erased, events).
    Fdp(crate::cmd::fdp::FdpArgs),
    /// Simulate LMCache workloads on a model FDP SSD: steady-state WAF per placement policy and
    /// device utilisation.
    Simulate(crate::cmd::simulate::SimulateArgs),
    /// Draw a grouped bar chart (PNG) from a small JSON table (used by tools/waf-compare).
    Plot(crate::cmd::plot::PlotArgs),
}

/// LMCache's raw_block geometry, named like its config keys. Sizes take K/M/G/T suffixes
/// (powers of 1024) or plain bytes.
#[derive(Args, Debug, Clone, Default)]
pub struct GeometryArgs {
    /// LMCache `block_align` (default 4096).
    #[arg(long, value_parser = parse_size)]
    pub block_align: Option<u64>,
    /// LMCache `header_bytes` (default 4096).
    #[arg(long, value_parser = parse_size)]
    pub header_bytes: Option<u64>,
    /// LMCache `slot_bytes`.
    #[arg(long, value_parser = parse_size)]
    pub slot_bytes: Option<u64>,
    /// LMCache `meta_total_bytes` (128M non-MP, 256M MP by default in LMCache).
    #[arg(long, value_parser = parse_size)]
    pub meta_total_bytes: Option<u64>,
    /// LMCache `capacity_bytes` (0 or absent: the whole device).
    #[arg(long, value_parser = parse_size)]
    pub capacity_bytes: Option<u64>,
}

impl GeometryArgs {
    pub fn flags(&self) -> GeometryFlags {
        GeometryFlags {
            block_align: self.block_align,
            header_bytes: self.header_bytes,
            slot_bytes: self.slot_bytes,
            meta_total_bytes: self.meta_total_bytes,
            capacity_bytes: self.capacity_bytes.filter(|&c| c > 0),
        }
    }
}

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// Block device or image file LMCache raw_block wrote.
    pub path: PathBuf,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub geometry: GeometryArgs,
}

#[derive(Args, Debug)]
pub struct ReplayArgs {
    /// Trace file: JSON lines, one request per line, or blkparse's default text output (see
    /// the README); `-` reads standard input.
    pub trace: PathBuf,
    /// Trace format: auto (JSON lines when the first non-blank character is `{`, else
    /// blkparse), json or blkparse.
    #[arg(long, value_enum, default_value = "auto")]
    pub format: crate::cmd::replay::TraceFormat,
    /// blkparse traces: the event taken for each I/O: Q (queued, per bio), D (issued to the
    /// driver, what a ublk server receives) or C (completed without error).
    #[arg(long, default_value = "D", value_parser = parse_blk_event)]
    pub blk_event: crate::blkparse::BlkAction,
    /// blkparse traces: only the events of this device (MAJ,MIN), for a trace of several.
    #[arg(long, value_parser = parse_maj_min)]
    pub blk_device: Option<(u32, u32)>,
    /// blkparse traces of a partition: its start in 512-byte sectors
    /// (/sys/class/block/NAME/start), subtracted from every request, since blktrace reports a
    /// partition's I/O in whole-disk sectors. tools/trace/capture-blktrace.sh prints it.
    #[arg(long, default_value_t = 0)]
    pub sector_offset: u64,
    /// The report as one JSON object (fields in the README).
    #[arg(long)]
    pub json: bool,
    /// Placement policy.
    #[arg(long, default_value = "region")]
    pub policy: String,
    /// Learn the geometry from this device or image's checkpoint (flags still apply).
    #[arg(long)]
    pub device: Option<PathBuf>,
    /// Size of the replayed device; default: the device's size, else --capacity-bytes, else the
    /// end of the slot holding the trace's furthest byte.
    #[arg(long, value_parser = parse_size)]
    pub device_size: Option<u64>,
    /// Also run the placed writes into the FDP SSD model (garbage collection, WAF).
    #[arg(long)]
    pub ssd: bool,
    /// Over-provisioning of the modelled SSD, as a fraction of physical space.
    #[arg(long, default_value_t = 0.07)]
    pub ssd_op: f64,
    /// Reclaim unit size of the modelled SSD (default: 6 GB per 1.88 TB, scaled to the device).
    #[arg(long, value_parser = parse_size)]
    pub ssd_ru_size: Option<u64>,
    /// Host bytes of the trace the modelled SSD takes before its WAF window starts (the fill;
    /// 0: the whole trace). The whole-trace WAF is reported too.
    #[arg(long, value_parser = parse_size, default_value = "0")]
    pub ssd_warmup: u64,
    #[command(flatten)]
    pub geometry: GeometryArgs,
}

#[derive(Args, Debug)]
pub struct AddArgs {
    /// Backing NVMe namespace: /dev/ngXnY (passthrough) or /dev/nvmeXnY (write streams), or a file.
    #[arg(long, required_unless_present = "config", default_value = "", hide_default_value = true, value_parser = parse_path)]
    pub backing: PathBuf,
    /// Refuse the backing unless it is this NVMe namespace, named by its identity or a part
    /// that names one namespace: `serial "S" nsid N`, `nguid HEX` or `eui64 HEX`, as `fdpblk
    /// fdp status DEV` prints it (without FDP: `nvme id-ctrl DEV`'s sn). Kernel names
    /// (/dev/ng0n1) can name another drive after a reboot; `fdpblk up` and `add --config`
    /// warn when their file gives one and pins none, printing the line to add.
    #[arg(long, value_name = "ID")]
    pub backing_id: Option<String>,
    /// Read the flags from a TOML file (keys: the long flags with _ for -; see
    /// deploy/fdpblk.example.toml); flags given here override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// auto: passthrough for /dev/ng*, streams for a block device with write streams, else plain when the policy needs one handle (--policy none); other policies need --engine plain to run without placement.
    #[arg(long, default_value = "auto")]
    pub engine: String,
    /// Placement policy: key-aware (3 handles), region (4), none (1), lmcache-fdp (8).
    #[arg(long, default_value = "key-aware")]
    pub policy: String,
    /// auto: the geometry of the LMCache checkpoint on the device (flags must agree); on a
    /// device without one, the flags' where --slot-bytes and --meta-total-bytes are given
    /// (placed from the first write), with neither learned from LMCache's first checkpoint
    /// (one without the other is refused); lmcache:
    /// from the flags, never learned.
    #[arg(long, default_value = "auto")]
    pub layout: String,
    #[command(flatten)]
    pub geometry: GeometryArgs,
    /// Device id (/dev/ublkbN); -1 lets the driver choose.
    #[arg(short = 'n', long, default_value_t = -1, allow_hyphen_values = true)]
    pub number: i32,
    /// Hardware queues (one thread each; the driver gives at most one per CPU).
    #[arg(short = 'q', long, default_value_t = 1)]
    pub queues: u16,
    /// Queue depth.
    #[arg(short = 'd', long, default_value_t = 128)]
    pub depth: u16,
    /// Largest request (bytes, power of two).
    #[arg(short = 'b', long, default_value = "512K", value_parser = parse_size)]
    pub io_buf_size: u64,
    /// Stable name: /dev/fdpblk/NAME links to the device; point LMCache's device_path at it.
    #[arg(long)]
    pub name: Option<String>,
    /// Stay in the foreground instead of daemonizing.
    #[arg(long)]
    pub foreground: bool,
    /// How long (µs, at most 1000000) a payload write waits for its slot header before it is placed anyway.
    #[arg(long, default_value_t = 5000)]
    pub header_wait_us: u64,
    /// Do not deallocate: neither the slots LMCache evicted (by default fdpblk trims a slot
    /// once LMCache's committed checkpoints no longer list it), nor the stale tails behind
    /// shorter payloads, nor, on a device no fdpblk used before, the slots LMCache's first
    /// checkpoint does not list (data left from before).
    /// `--no-trim=false` turns it off again over `no_trim = true` in a --config file.
    #[arg(long, num_args = 0..=1, require_equals = true, default_value_t = false, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub no_trim: bool,
    /// Add a backing that `add` would refuse as someone else's data: one that holds a file
    /// system, partition table, RAID or LVM signature (as blkid finds them) and no LMCache
    /// checkpoint at its start (fdpblk's own state, or copy 1 of a checkpoint left behind
    /// the signature, does not count; the signatures are erased with wipefs -a, and the data
    /// is overwritten and deallocated); one blkid cannot run on (a namespace with no block
    /// device at all is added with a warning: nothing for blkid to read); or, with --name, one whose
    /// LMCache checkpoint was written through another name (that cache is given up: LMCache
    /// loads it only through its own device_path). The first two apply only where no
    /// checkpoint is found or only its copy 1 is left, the last only where one is. Command
    /// line only.
    #[arg(long)]
    pub force: bool,
    /// Deallocate a stale tail (bytes past a shorter new payload) only once a checkpoint
    /// confirmed the slot, not once the new header is durable and a checkpoint written after
    /// the put was read back. Early tails rely on
    /// LMCache's header check at load (`meta_verify_on_load`, on by default), and on LMCache
    /// reading its checkpoint when it starts (`load_checkpoint_on_init`, on by default): use
    /// this flag where either is turned off.
    /// `--no-early-tails=false` turns it off again over `no_early_tails = true` in a --config file.
    #[arg(long, num_args = 0..=1, require_equals = true, default_value_t = false, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub no_early_tails: bool,
    /// Deallocate an evicted slot only once both checkpoint containers no longer list it (one
    /// to two checkpoint intervals after the eviction) and never touch LMCache's older
    /// checkpoint copy. By default, once LMCache's newest checkpoint lacks slots the older copy
    /// still lists, fdpblk zeroes the older copy's header (LMCache overwrites it at its next
    /// checkpoint anyway) and deallocates those slots.
    /// `--no-early-evictions=false` turns it off again over `no_early_evictions = true` in a --config file.
    #[arg(long, num_args = 0..=1, require_equals = true, default_value_t = false, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub no_early_evictions: bool,
    /// How often (ms) fdpblk writes its own state (what changed) to the reserved tail of the
    /// backing: 0 (only when the device starts and stops) or at least 50.
    #[arg(long, default_value_t = 5000)]
    pub persist_interval_ms: u64,
    /// The keys the --config file set that apply (not overridden on the command line): an
    /// error about one of their flags also names the key and the file.
    #[arg(skip)]
    pub from_config: Vec<&'static str>,
}

#[derive(Args, Debug)]
pub struct DelArgs {
    /// The device's id (N of /dev/ublkbN).
    #[arg(short = 'n', long)]
    pub number: Option<i32>,
    /// The device added with --name NAME (or `fdpblk up NAME`), whatever its id: what a
    /// systemd unit knows (`fdpblk del --name %i`).
    #[arg(long, conflicts_with_all = ["number", "all"])]
    pub name: Option<String>,
    /// Delete every fdpblk device that has a state file (`fdpblk list` shows any other, with
    /// its `fdpblk del -n ID`).
    #[arg(short = 'a', long)]
    pub all: bool,
    /// Only a device whose daemon died (held by the driver for `recover`); one whose daemon
    /// runs is kept. What fdpblk-release@NAME runs once fdpblk@NAME gave up restarting: a
    /// device added by hand under that name, which made the unit's starts fail, stays.
    #[arg(long)]
    pub if_orphaned: bool,
}

#[derive(Args, Debug)]
pub struct IdArgs {
    /// The device's id (N of /dev/ublkbN).
    #[arg(short = 'n', long)]
    pub number: i32,
    /// Stay in the foreground.
    #[arg(long)]
    pub foreground: bool,
}

#[derive(Args, Debug)]
pub struct ListArgs {
    /// One JSON array, an object per device.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct StatsArgs {
    /// The device's id (N of /dev/ublkbN).
    #[arg(short = 'n', long, required_unless_present = "name")]
    pub number: Option<i32>,
    /// The device added with --name NAME (or `fdpblk up NAME`), whatever its id.
    #[arg(long, conflicts_with = "number")]
    pub name: Option<String>,
    /// The daemon's stats as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Prometheus text exposition format (the metrics of `fdpblk metrics`, this device only).
    #[arg(long, conflicts_with = "json")]
    pub prometheus: bool,
}

#[derive(Args, Debug)]
pub struct NameArgs {
    /// The N of /dev/ublkbN.
    pub id: i32,
}

#[derive(Args, Debug)]
pub struct FeaturesArgs {
    /// As one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// A path as given; an empty one is caught after `--config` is read.
fn parse_path(s: &str) -> Result<PathBuf, String> {
    Ok(PathBuf::from(s))
}

/// Parses `4096`, `64K`, `128M`, `1G`, `2T` (also `KiB`/`MiB`/...) into bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("'{s}' is not a size (examples: 4096, 64K, 128M, 1G)"))?;
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ if unit.starts_with(['.', ',']) => {
            return Err(format!("'{s}': sizes are whole numbers; give the next smaller unit (e.g. 1536K for 1.5M)"))
        }
        _ => return Err(format!("'{s}': unknown size unit '{unit}' (use K, M, G or T)")),
    };
    n.checked_mul(1u64 << shift).ok_or_else(|| format!("'{s}' does not fit in 64 bits"))
}

/// `--blk-event`: Q, D or C.
pub fn parse_blk_event(s: &str) -> Result<crate::blkparse::BlkAction, String> {
    crate::blkparse::BlkAction::parse(s.trim())
        .ok_or_else(|| format!("'{s}' is not a blkparse event to take: use Q (queued), D (issued) or C (completed)"))
}

/// `--blk-device`: a device as blkparse prints it, MAJ,MIN.
pub fn parse_maj_min(s: &str) -> Result<(u32, u32), String> {
    let bad = || format!("'{s}' is not a device number MAJ,MIN as blkparse prints it (example: 259,0)");
    let (a, b) = s.trim().split_once(',').ok_or_else(bad)?;
    Ok((a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?))
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("128MiB"), Ok(128 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert!(parse_size("x").is_err());
        assert!(parse_size("1Q").is_err());
        assert!(parse_size("1.5M").unwrap_err().contains("1536K"));
        assert!(parse_size("99999999999T").is_err());
    }
}
