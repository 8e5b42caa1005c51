//! Opening an NVMe device and asking it about FDP: [`NvmeDevice`] for single queries (the
//! engines can poll RUH status and statistics through it), and [`FdpInfo::discover`], which
//! gathers everything an engine needs before it places its first write.

use super::cmd::{self, cns, fid, lid, CmdError, NvmeStatus, PassthruCmd};
use super::fdp::{
    FdpConfig, FdpConfigLog, FdpEventsLog, FdpFeature, FdpStats, ParseError, RuhStatus, RuhStatusDesc, RuhUsageLog,
};
use super::identify::{parse_nsid_list, IdCtrl, IdNs, IDENTIFY_LEN};
use super::ioctl::{self, Data, PassthruError};
use super::path::{resolve, DevKind, DevicePaths, PathError};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};

/// Largest log or status structure fdpblk reads (lengths come from the drive).
pub const MAX_READ: u32 = 4 << 20;
/// The most bytes of a log page read with one command: within every controller's MDTS.
pub const LOG_PIECE: u32 = 4096;

/// The pieces a log page of `len` bytes is read in: (log page offset, range of the buffer).
fn log_pieces(len: u32) -> impl Iterator<Item = (u64, std::ops::Range<usize>)> {
    let (len, piece) = (u64::from(len), u64::from(LOG_PIECE));
    (0..len.div_ceil(piece)).map(move |i| {
        let start = i * piece;
        (start, start as usize..(start + piece).min(len) as usize)
    })
}

/// Everything that can go wrong talking to the drive; each message names the fix.
#[derive(Debug)]
pub enum NvmeError {
    Path(PathError),
    /// Opening a device node failed.
    Open {
        path: PathBuf,
        source: io::Error,
    },
    /// A command failed in the kernel (errno) or on the drive (status).
    Command {
        what: String,
        path: PathBuf,
        source: PassthruError,
    },
    /// The drive's data does not parse.
    Parse {
        what: String,
        path: PathBuf,
        source: ParseError,
    },
    /// A command could not be encoded (a length from the drive out of range).
    Encode(CmdError),
    /// The controller has no FDP capability (CTRATT bit 19 clear).
    NoFdp {
        ctrl: PathBuf,
        model: String,
    },
    /// FDP is supported but not enabled on the endurance group.
    FdpDisabled {
        ctrl: PathBuf,
        endgid: u16,
    },
    /// A namespace is needed (RUH status is per namespace).
    NeedNamespace {
        path: PathBuf,
    },
    /// The active configuration index is not in the configurations log.
    NoConfig {
        index: u8,
        count: usize,
    },
    /// A length the drive reported is larger than fdpblk reads.
    TooLarge {
        what: &'static str,
        len: u64,
    },
}

impl fmt::Display for NvmeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NvmeError::Path(e) => write!(f, "{e}"),
            NvmeError::Open { path, source } if source.kind() == io::ErrorKind::PermissionDenied => {
                write!(f, "permission denied opening {}: run as root (NVMe passthrough needs CAP_SYS_ADMIN)", path.display())
            }
            NvmeError::Open { path, source } => write!(f, "cannot open {}: {source}", path.display()),
            NvmeError::Command { what, path, source } if source.is_permission() => write!(
                f,
                "{what} on {}: permission denied: run as root (NVMe admin passthrough needs CAP_SYS_ADMIN)",
                path.display()
            ),
            NvmeError::Command { what, path, source } if source.is_not_nvme() => write!(
                f,
                "{what} on {}: not an NVMe device (the NVMe ioctl is not supported); give /dev/nvme0n1, /dev/ng0n1 or /dev/nvme0",
                path.display()
            ),
            NvmeError::Command { what, path, source: PassthruError::Status(s) } if s.code() == 0x29 => write!(
                f,
                "{what} on {}: {s}: FDP is disabled on this drive's endurance group; `fdpblk fdp status` on one of its \
                 namespaces (/dev/ngXnY) names the command that enables it, or run `fdpblk add` without placement (--policy none)",
                path.display()
            ),
            NvmeError::Command { what, path, source } => write!(f, "{what} on {}: {source}", path.display()),
            NvmeError::Parse { what, path, source } => {
                let source = source.to_string();
                // Some say the fix themselves; else the drive's answer is at fault.
                let fix = if source.contains("--policy none") {
                    ""
                } else {
                    ": the drive's answer does not parse (compare `nvme id-ctrl`, `nvme id-ns` and `nvme fdp configs`; a firmware update may mend it); `fdpblk add --policy none` on the block device does not ask for it"
                };
                write!(f, "{what} from {}: {source}{fix}", path.display())
            }
            NvmeError::Encode(e) => write!(f, "{e}"),
            NvmeError::NoFdp { ctrl, model } => write!(
                f,
                "{} ({model}) does not support FDP (Identify Controller CTRATT bit 19 is clear): this drive does not support FDP; use --policy none or --engine plain (on the block device /dev/nvmeXnY) with `fdpblk add`",
                ctrl.display()
            ),
            NvmeError::FdpDisabled { ctrl, endgid } => write!(
                f,
                "FDP is supported but disabled on endurance group {endgid} of {c}; enable FDP: \
                 nvme set-feature {c} -f 0x1D --value={endgid} --cdw12=1 -s \
                 (or `nvme fdp feature {c} -e {endgid} -c 0` with nvme-cli 2.13+; drives usually want all namespaces \
                 deleted first, then re-created with placement handles, e.g. nvme create-ns {c} ... -p 0,1,2,3 -n 4), \
                 or run `fdpblk add` without placement (--policy none, or --engine plain on the block device /dev/nvmeXnY)",
                c = ctrl.display()
            ),
            NvmeError::NeedNamespace { path } => write!(
                f,
                "{} is a controller; the reclaim unit handle status is per namespace: give /dev/nvmeXnY or /dev/ngXnY",
                path.display()
            ),
            NvmeError::NoConfig { index, count } => write!(
                f,
                "the active FDP configuration index {index} is not among the {count} configurations the drive lists \
                 (the drive's FDP state is inconsistent): list them with `nvme fdp configs`, enable FDP again with a \
                 listed index, or run `fdpblk add` without placement (--policy none)"
            ),
            NvmeError::TooLarge { what, len } => {
                write!(
                    f,
                    "{what}: the drive reports {len} bytes, more than the {MAX_READ} fdpblk reads (a firmware fault \
                     or far more configurations than any drive has); check it with `nvme fdp configs`, or run \
                     `fdpblk add` without placement (--policy none)"
                )
            }
        }
    }
}

impl std::error::Error for NvmeError {}

impl From<PathError> for NvmeError {
    fn from(e: PathError) -> Self {
        NvmeError::Path(e)
    }
}

impl From<CmdError> for NvmeError {
    fn from(e: CmdError) -> Self {
        NvmeError::Encode(e)
    }
}

/// An open NVMe device: the controller for admin commands and, for a namespace path, the
/// namespace for I/O commands.
pub struct NvmeDevice {
    pub paths: DevicePaths,
    /// Where admin commands go: `/dev/nvmeX`, or the namespace device when the controller
    /// node is missing (admin passthrough works on namespace nodes too).
    admin: File,
    admin_path: PathBuf,
    ns: Option<File>,
    nsid: Option<u32>,
}

fn open_ro(path: &Path) -> Result<File, NvmeError> {
    OpenOptions::new().read(true).open(path).map_err(|source| NvmeError::Open { path: path.to_path_buf(), source })
}

impl NvmeDevice {
    /// Opens a controller (`/dev/nvme0`) or namespace (`/dev/nvme0n1`, `/dev/ng0n1`) path.
    /// Everything is opened read-only; admin commands still need root.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, NvmeError> {
        let path = path.as_ref();
        let paths = resolve(path)?;
        let (admin, admin_path, ns, nsid) = if paths.kind == DevKind::Controller {
            (open_ro(path)?, path.to_path_buf(), None, None)
        } else {
            let ns = open_ro(path)?;
            let nsid = ioctl::namespace_id(&ns).map_err(|source| NvmeError::Command {
                what: "NVME_IOCTL_ID (namespace id)".into(),
                path: path.to_path_buf(),
                source: PassthruError::Os(source),
            })?;
            match open_ro(&paths.ctrl_dev) {
                Ok(c) => (c, paths.ctrl_dev.clone(), Some(ns), Some(nsid)),
                Err(NvmeError::Open { source, .. }) if source.kind() == io::ErrorKind::NotFound => (
                    ns.try_clone().map_err(|source| NvmeError::Open { path: path.to_path_buf(), source })?,
                    path.to_path_buf(),
                    Some(ns),
                    Some(nsid),
                ),
                Err(e) => return Err(e),
            }
        };
        Ok(NvmeDevice { paths, admin, admin_path, ns, nsid })
    }

    /// The namespace id (None for a controller path).
    pub fn nsid(&self) -> Option<u32> {
        self.nsid
    }

    /// The open namespace device, for I/O passthrough.
    pub fn namespace(&self) -> Option<&File> {
        self.ns.as_ref()
    }

    /// Where admin commands are sent.
    pub fn admin_path(&self) -> &Path {
        &self.admin_path
    }

    fn admin_cmd(&self, what: &str, c: PassthruCmd, data: Data<'_>) -> Result<u32, NvmeError> {
        ioctl::admin(&self.admin, c, data).map_err(|source| NvmeError::Command {
            what: what.to_string(),
            path: self.admin_path.clone(),
            source,
        })
    }

    fn parse<T>(&self, what: &str, r: Result<T, ParseError>) -> Result<T, NvmeError> {
        r.map_err(|source| NvmeError::Parse { what: what.to_string(), path: self.admin_path.clone(), source })
    }

    /// Identify Controller.
    pub fn identify_ctrl(&self) -> Result<IdCtrl, NvmeError> {
        let mut b = vec![0u8; IDENTIFY_LEN];
        self.admin_cmd("identify controller", cmd::identify(cns::CONTROLLER, 0), Data::FromDevice(&mut b))?;
        self.parse("identify controller", IdCtrl::parse(&b))
    }

    /// Identify Namespace `nsid`.
    pub fn identify_ns(&self, nsid: u32) -> Result<IdNs, NvmeError> {
        let mut b = vec![0u8; IDENTIFY_LEN];
        self.admin_cmd(
            &format!("identify namespace {nsid}"),
            cmd::identify(cns::NAMESPACE, nsid),
            Data::FromDevice(&mut b),
        )?;
        self.parse("identify namespace", IdNs::parse(&b))
    }

    /// What names this namespace whatever node the kernel gave it (NVMe names can change when
    /// a controller is removed and another added): see [`namespace_identity`]. None for a
    /// controller path.
    pub fn identity(&self) -> Result<Option<NamespaceIdentity>, NvmeError> {
        let Some(nsid) = self.nsid else { return Ok(None) };
        Ok(Some(namespace_identity(&self.identify_ctrl()?, nsid, &self.identify_ns(nsid)?)))
    }

    /// The active namespace ids (the first 1024).
    pub fn active_nsids(&self) -> Result<Vec<u32>, NvmeError> {
        let mut b = vec![0u8; IDENTIFY_LEN];
        self.admin_cmd(
            "identify active namespace list",
            cmd::identify(cns::ACTIVE_NSID_LIST, 0),
            Data::FromDevice(&mut b),
        )?;
        Ok(parse_nsid_list(&b))
    }

    /// The endurance group of this namespace, or for a controller path that of its first
    /// active namespace. A namespace outside any endurance group (ENDGID 0) counts as group 1,
    /// the only group of a drive without endurance-group support.
    pub fn endgid(&self) -> Result<u16, NvmeError> {
        let nsid = match self.nsid {
            Some(n) => n,
            None => match self.active_nsids()?.first() {
                Some(&n) => n,
                None => return Ok(1),
            },
        };
        Ok(self.identify_ns(nsid)?.endgid.max(1))
    }

    /// Get Features 0x1D (FDP) of an endurance group.
    pub fn fdp_feature(&self, endgid: u16) -> Result<FdpFeature, NvmeError> {
        let dw0 =
            self.admin_cmd("get features 0x1D (FDP)", cmd::get_features(fid::FDP, 0, u32::from(endgid)), Data::None)?;
        Ok(FdpFeature::from_dw0(dw0))
    }

    /// Reads `len` bytes of a log page (LSI = `lsi`, NSID 0), in pieces of at most
    /// [`LOG_PIECE`] bytes at increasing log page offsets: one command past the controller's
    /// transfer limit (MDTS, never below 4 KiB) is refused, so a large configurations log of
    /// a drive with many reclaim groups would not read whole. Offsets need LPA bit 2, which
    /// every controller of NVMe 1.3 or later sets (and so every FDP drive).
    pub fn get_log(&self, what: &str, lid: u8, lsp: u8, lsi: u16, len: u32) -> Result<Vec<u8>, NvmeError> {
        // A controller without offsets would answer every piece with the log's first bytes.
        if len > LOG_PIECE && !self.identify_ctrl()?.log_offsets_supported() {
            return Err(NvmeError::Parse {
                what: what.to_string(),
                path: self.admin_path.clone(),
                source: ParseError::Invalid {
                    what: "identify controller",
                    why: format!(
                        "the log is {len} bytes, more than one {LOG_PIECE}-byte read, and the controller takes no log page \
                         offset (LPA bit 2 clear, so it predates NVMe 1.3): update its firmware, or run `fdpblk add` \
                         without placement (--policy none)"
                    ),
                },
            });
        }
        let mut b = vec![0u8; len as usize];
        for (offset, range) in log_pieces(len) {
            let piece = &mut b[range];
            let w = if offset == 0 && piece.len() == len as usize {
                what.to_string()
            } else {
                format!("{what}, bytes {offset}..{} of {len}", offset + piece.len() as u64)
            };
            let c = cmd::get_log_page(0, lid, lsp, lsi, offset, piece.len() as u32)?;
            match self.admin_cmd(&w, c, Data::FromDevice(piece)) {
                // Every log read here is an FDP log of endurance group `lsi`: the error can
                // name the command that enables FDP there.
                Err(NvmeError::Command { source: PassthruError::Status(s), .. }) if is_fdp_disabled_status(s) => {
                    return Err(NvmeError::FdpDisabled { ctrl: self.admin_path.clone(), endgid: lsi });
                }
                r => r?,
            };
        }
        Ok(b)
    }

    /// Log 0x20: the header first, then the whole log (SZE bytes).
    pub fn fdp_configs(&self, endgid: u16) -> Result<FdpConfigLog, NvmeError> {
        const W: &str = "get log page 0x20 (FDP configurations)";
        let h = self.get_log(W, lid::FDP_CONFIGS, 0, endgid, 16)?;
        let (_, mut size) = self.parse(W, FdpConfigLog::header(&h))?;
        // The log changes only when the drive's namespaces or FDP setup do; one that changed
        // between the header and the whole read (its size differs) is read once more.
        let mut again = true;
        loop {
            if size > MAX_READ {
                return Err(NvmeError::TooLarge { what: "FDP configurations log", len: u64::from(size) });
            }
            let len = size.max(16).next_multiple_of(4);
            let b = self.get_log(W, lid::FDP_CONFIGS, 0, endgid, len)?;
            let (_, now) = self.parse(W, FdpConfigLog::header(&b))?;
            if now == size || !again {
                return self.parse(W, FdpConfigLog::parse(&b));
            }
            (size, again) = (now, false);
        }
    }

    /// Log 0x21: the header first, then 8 + 8 × NRUH bytes.
    pub fn ruh_usage(&self, endgid: u16) -> Result<RuhUsageLog, NvmeError> {
        const W: &str = "get log page 0x21 (RUH usage)";
        let h = self.get_log(W, lid::RUH_USAGE, 0, endgid, 8)?;
        let n = self.parse(W, RuhUsageLog::header(&h))?;
        let len = (RuhUsageLog::HEADER + RuhUsageLog::DESC * usize::from(n)) as u32;
        let b = self.get_log(W, lid::RUH_USAGE, 0, endgid, len)?;
        self.parse(W, RuhUsageLog::parse(&b))
    }

    /// Log 0x22 (64 bytes).
    pub fn fdp_stats(&self, endgid: u16) -> Result<FdpStats, NvmeError> {
        const W: &str = "get log page 0x22 (FDP statistics)";
        let b = self.get_log(W, lid::FDP_STATS, 0, endgid, FdpStats::LEN as u32)?;
        self.parse(W, FdpStats::parse(&b))
    }

    /// Log 0x23: host events (`host`) or controller events, as much as 4 KiB holds (63).
    pub fn fdp_events(&self, endgid: u16, host: bool) -> Result<FdpEventsLog, NvmeError> {
        const W: &str = "get log page 0x23 (FDP events)";
        let b = self.get_log(W, lid::FDP_EVENTS, u8::from(host), endgid, FdpEventsLog::READ_LEN as u32)?;
        self.parse(W, FdpEventsLog::parse(&b))
    }

    /// Reclaim Unit Handle Status of the namespace: the header first, then all descriptors.
    pub fn ruh_status(&self) -> Result<RuhStatus, NvmeError> {
        const W: &str = "I/O management receive (RUH status)";
        let (Some(ns), Some(nsid)) = (&self.ns, self.nsid) else {
            return Err(NvmeError::NeedNamespace { path: self.paths.given.clone() });
        };
        // The command has no offset: a status past the controller's transfer limit (MDTS)
        // cannot be read at all, so a failure names its size.
        let io = |len: u32| -> Result<Vec<u8>, NvmeError> {
            let mut b = vec![0u8; len as usize];
            let what = if len > LOG_PIECE {
                format!("{W}, {len} bytes in one command, which a drive with this many placement handles may refuse past its transfer limit (MDTS): use a configuration of fewer handles, or `fdpblk add --policy none`")
            } else {
                W.into()
            };
            ioctl::io(ns, cmd::ruh_status(nsid, len)?, Data::FromDevice(&mut b))
                .map_err(|source| NvmeError::Command { what, path: self.paths.given.clone(), source })?;
            Ok(b)
        };
        let h = io(RuhStatus::HEADER as u32)?;
        let n = self.parse(W, RuhStatus::header(&h))?;
        let b = io(RuhStatus::len_for(n) as u32)?;
        self.parse(W, RuhStatus::parse(&b))
    }
}

/// What a placement engine needs to know about an FDP namespace.
#[derive(Clone, Debug, PartialEq)]
pub struct FdpInfo {
    /// The namespace path as given.
    pub device: PathBuf,
    /// Where the admin commands went (normally `/dev/nvmeX`).
    pub controller: PathBuf,
    /// The block device name (`nvme0n1`), if there is one.
    pub block_name: Option<String>,
    pub nsid: u32,
    pub ctrl: IdCtrl,
    /// What names the namespace whatever its node ([`NamespaceIdentity`]).
    pub identity: NamespaceIdentity,
    pub endgid: u16,
    /// FDPE and FDPCIDX.
    pub feature: FdpFeature,
    /// How many configurations the drive lists.
    pub num_configs: usize,
    /// The active configuration (index `feature.config_index`).
    pub config: FdpConfig,
    /// RUH status of the namespace, in placement-handle order.
    pub ruhs: Vec<RuhStatusDesc>,
    /// The placement identifiers to put in a write's DSPEC, in placement-handle order
    /// (`placement_ids[i]` = placement handle i = Linux write stream i + 1).
    pub placement_ids: Vec<u16>,
    pub stats: FdpStats,
    /// Logical block size in bytes.
    pub lba_size: u32,
    /// Metadata bytes per logical block of the format in use (0: data only).
    pub lba_metadata: u16,
    /// Namespace size in logical blocks.
    pub nsze: u64,
    /// MDTS in bytes (4 KiB minimum page assumed); None = no limit reported.
    pub mdts_bytes: Option<u64>,
    /// `/sys/block/<ns>/queue/max_hw_sectors_kb`.
    pub max_hw_sectors_kb: Option<u32>,
    /// Largest transfer of one passthrough command: the smaller of MDTS, the kernel's
    /// `max_hw_sectors_kb` and 65536 blocks.
    pub max_transfer_bytes: u32,
    /// `/sys/block/<ns>/queue/max_write_streams` (Linux ≥ 6.16).
    pub max_write_streams: Option<u32>,
    /// `/sys/block/<ns>/queue/write_stream_granularity` in bytes (Linux ≥ 6.16).
    pub write_stream_granularity: Option<u64>,
}

/// A number in block device `block`'s `/sys/block/<block>/queue/<attr>`.
pub(crate) fn sysfs_num(block: &str, attr: &str) -> Option<u64> {
    std::fs::read_to_string(Path::new("/sys/block").join(block).join("queue").join(attr)).ok()?.trim().parse().ok()
}

/// A namespace's identity: its NVM subsystem's model and serial number (the same through
/// every controller of the subsystem), the namespace id, and the namespace's NGUID and EUI64
/// where the drive reports them (a namespace deleted and made again gets new ones). Its text
/// (`model "M" serial "S" nsid N[ nguid HEX][ eui64 HEX]`) is what `add` saves and a
/// restarting daemon compares, and what `--backing-id` pins a part of ([`super::pin`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamespaceIdentity {
    pub model: String,
    pub serial: String,
    pub nsid: u32,
    /// Lowercase hex; None where the drive reports zeroes.
    pub nguid: Option<String>,
    pub eui64: Option<String>,
}

impl fmt::Display for NamespaceIdentity {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "model \"{}\" serial \"{}\" nsid {}", self.model, self.serial, self.nsid)?;
        if let Some(h) = &self.nguid {
            write!(f, " nguid {h}")?;
        }
        if let Some(h) = &self.eui64 {
            write!(f, " eui64 {h}")?;
        }
        Ok(())
    }
}

/// The identity of namespace `nsid`, from the drive's Identify data.
pub fn namespace_identity(ctrl: &IdCtrl, nsid: u32, ns: &IdNs) -> NamespaceIdentity {
    let hex = |b: &[u8]| b.iter().any(|&x| x != 0).then(|| b.iter().map(|x| format!("{x:02x}")).collect::<String>());
    NamespaceIdentity { model: ctrl.model.clone(), serial: ctrl.serial.clone(), nsid, nguid: hex(&ns.nguid), eui64: hex(&ns.eui64) }
}

/// The identity of the NVMe namespace `path` names; None where it names none (a file, a
/// block device of another kind, a partition, a controller).
pub fn identity_of(path: &Path) -> Result<Option<NamespaceIdentity>, NvmeError> {
    match resolve(path) {
        Ok(p) if p.kind != DevKind::Controller => NvmeDevice::open(path)?.identity(),
        Ok(_) | Err(PathError::NotNvme(..) | PathError::Partition(..)) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The device node of `kind` (`/dev/ngXnY` or `/dev/nvmeXnY`) whose namespace has `identity`
/// (its text) now, if one has: where a renamed namespace went.
pub fn find_namespace(identity: &str, kind: DevKind) -> Option<PathBuf> {
    find_namespace_where(|id| id.to_string() == identity, kind)
}

/// The first device node of `kind`, in name order, whose namespace `is` accepts.
pub fn find_namespace_where(is: impl Fn(&NamespaceIdentity) -> bool, kind: DevKind) -> Option<PathBuf> {
    let mut nodes: Vec<PathBuf> = std::fs::read_dir("/dev")
        .ok()?
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(|n| super::path::kind_of_name(n) == Some(kind)))
        .map(|e| e.path())
        .collect();
    nodes.sort();
    nodes.into_iter().find(|n| identity_of(n).ok().flatten().is_some_and(|id| is(&id)))
}

/// The largest transfer on a namespace the kernel made no block device for (128 KiB: 32
/// pages, within the segment and size limits of any NVMe queue).
pub const NO_BLOCK_DEVICE_MAX_TRANSFER: u64 = 128 << 10;

/// The kernel's limits on one passthrough command of a namespace, as its block device's
/// queue reports them (`None`: no block device, so not known).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueLimits {
    pub max_hw_sectors_kb: Option<u32>,
    pub max_segments: Option<u64>,
}

impl QueueLimits {
    pub fn of(block: Option<&str>) -> Option<Self> {
        let b = block?;
        Some(QueueLimits {
            max_hw_sectors_kb: sysfs_num(b, "max_hw_sectors_kb").map(|v| v.min(u64::from(u32::MAX)) as u32),
            max_segments: sysfs_num(b, "max_segments").filter(|&s| s > 0),
        })
    }
}

/// The largest transfer one command takes, in whole blocks (and pages, from a page up): the smaller of the drive's MDTS,
/// the queue's `max_hw_sectors_kb`, its `max_segments` pages (every page of a user buffer
/// may be its own segment) and 65536 blocks; 128 KiB without a block device (`limits`
/// `None`), whose limits cannot be read. At least one block.
pub fn max_transfer(lba_size: u32, mdts_bytes: Option<u64>, limits: Option<QueueLimits>, page: u64) -> u32 {
    let lba = u64::from(lba_size.max(1));
    let mut m = u64::from(cmd::MAX_NLB) * lba;
    if let Some(v) = mdts_bytes {
        m = m.min(v);
    }
    match limits {
        Some(l) => {
            if let Some(kb) = l.max_hw_sectors_kb {
                m = m.min(u64::from(kb) * 1024);
            }
            if let Some(s) = l.max_segments {
                m = m.min(s.saturating_mul(page));
            }
        }
        None => m = m.min(NO_BLOCK_DEVICE_MAX_TRANSFER),
    }
    // Whole pages where it is at least one: each command after the first of a split starts
    // where the one before ended, and a piece starting inside a page spans a page more.
    if page > 0 && m >= page {
        m = m / page * page;
    }
    (m / lba * lba).max(lba).min(u64::from(u32::MAX) / lba * lba) as u32
}


impl FdpInfo {
    /// Queries a namespace (`/dev/nvme0n1` or `/dev/ng0n1`): controller capability, endurance
    /// group, FDP feature, active configuration, RUH status, statistics, block size and limits.
    /// Fails with an error naming the fix when the drive has no FDP or FDP is disabled.
    pub fn discover(ns_path: impl AsRef<Path>) -> Result<Self, NvmeError> {
        let dev = NvmeDevice::open(ns_path)?;
        let Some(nsid) = dev.nsid() else {
            return Err(NvmeError::NeedNamespace { path: dev.paths.given.clone() });
        };
        let ctrl = dev.identify_ctrl()?;
        if !ctrl.fdp_supported() {
            return Err(NvmeError::NoFdp { ctrl: dev.admin_path().to_path_buf(), model: ctrl.model.clone() });
        }
        let ns = dev.identify_ns(nsid)?;
        let lba_size = dev.parse("identify namespace", ns.lba_size())?;
        // Checked here so that `ns_bytes` never saturates.
        dev.parse("identify namespace", ns.size_bytes())?;
        let endgid = ns.endgid.max(1);
        let feature = match dev.fdp_feature(endgid) {
            Ok(f) => f,
            // Some drives fail the query rather than report FDPE = 0.
            Err(NvmeError::Command { source: PassthruError::Status(s), .. }) if is_fdp_disabled_status(s) => {
                FdpFeature { enabled: false, config_index: 0 }
            }
            Err(e) => return Err(e),
        };
        if !feature.enabled {
            return Err(NvmeError::FdpDisabled { ctrl: dev.admin_path().to_path_buf(), endgid });
        }
        let configs = dev.fdp_configs(endgid)?;
        let num_configs = configs.configs.len();
        let config = configs
            .configs
            .into_iter()
            .nth(usize::from(feature.config_index))
            .ok_or(NvmeError::NoConfig { index: feature.config_index, count: num_configs })?;
        let status = match dev.ruh_status() {
            Err(NvmeError::Command { source: PassthruError::Status(s), .. }) if is_fdp_disabled_status(s) => {
                return Err(NvmeError::FdpDisabled { ctrl: dev.admin_path().to_path_buf(), endgid })
            }
            r => r?,
        };
        let stats = dev.fdp_stats(endgid)?;
        let block = dev.paths.block_name.clone();
        let limits = QueueLimits::of(block.as_deref());
        let mdts_bytes = ctrl.mdts_bytes();
        Ok(FdpInfo {
            device: dev.paths.given.clone(),
            controller: dev.admin_path().to_path_buf(),
            block_name: block.clone(),
            nsid,
            identity: namespace_identity(&ctrl, nsid, &ns),
            endgid,
            feature,
            num_configs,
            config,
            placement_ids: status.placement_ids(),
            ruhs: status.descs,
            stats,
            lba_size,
            lba_metadata: ns.format().map_or(0, |f| f.ms),
            nsze: ns.nsze,
            mdts_bytes,
            max_hw_sectors_kb: limits.and_then(|l| l.max_hw_sectors_kb),
            max_transfer_bytes: max_transfer(lba_size, mdts_bytes, limits, crate::device::page_size()),
            max_write_streams: block.as_deref().and_then(|b| sysfs_num(b, "max_write_streams")).map(|v| v as u32),
            write_stream_granularity: block.as_deref().and_then(|b| sysfs_num(b, "write_stream_granularity")),
            ctrl,
        })
    }

    /// The namespace's endurance group and that group's FDP statistics now: the two commands
    /// the drive counters of `fdpblk stats` and the metrics need, not the whole discovery.
    pub fn stats_now(ns_path: impl AsRef<Path>) -> Result<(u16, FdpStats), NvmeError> {
        let dev = NvmeDevice::open(ns_path)?;
        let Some(nsid) = dev.nsid() else {
            return Err(NvmeError::NeedNamespace { path: dev.paths.given.clone() });
        };
        let endgid = dev.identify_ns(nsid)?.endgid.max(1);
        Ok((endgid, dev.fdp_stats(endgid)?))
    }

    /// Namespace size in bytes (checked against overflow by `discover`).
    pub fn ns_bytes(&self) -> u64 {
        self.nsze.saturating_mul(u64::from(self.lba_size))
    }

    /// Reclaim unit size in logical blocks (RUNS / LBA size).
    pub fn ru_blocks(&self) -> u64 {
        self.config.runs / u64::from(self.lba_size.max(1))
    }
}

/// The status with which a drive says FDP is off: FDP Disabled (generic 0x29).
fn is_fdp_disabled_status(s: NvmeStatus) -> bool {
    s.code() == 0x29
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_limit() {
        let q = |kb: Option<u32>, segs: Option<u64>| Some(QueueLimits { max_hw_sectors_kb: kb, max_segments: segs });
        assert_eq!(max_transfer(512, Some(512 << 10), q(Some(512), None), 4096), 512 << 10);
        assert_eq!(max_transfer(512, None, q(Some(128), None), 4096), 128 << 10);
        assert_eq!(max_transfer(512, Some(1 << 20), q(None, None), 4096), 1 << 20);
        assert_eq!(max_transfer(512, None, q(None, None), 4096), 32 << 20);
        assert_eq!(max_transfer(4096, Some(u64::MAX), q(None, None), 4096), 256 << 20); // 65536 blocks
        assert_eq!(max_transfer(4096, Some(0), q(Some(0), None), 4096), 4096);
        // Every page may be a segment: 33 segments of 4 KiB pages.
        assert_eq!(max_transfer(512, Some(1 << 20), q(Some(1024), Some(33)), 4096), 33 << 12);
        // In whole blocks: an MDTS that is not one, or a block larger than every limit.
        assert_eq!(max_transfer(4096, Some(6000), q(None, None), 4096), 4096);
        assert_eq!(max_transfer(65536, Some(4096), q(None, None), 4096), 65536);
        // Whole pages from a page up: 127 KiB of 512-byte blocks is 124 KiB; below a page, blocks.
        assert_eq!(max_transfer(512, None, q(Some(127), None), 4096), 124 << 10);
        assert_eq!(max_transfer(512, Some(2048), q(None, None), 4096), 2048);
        // No block device: 128 KiB, what every NVMe queue takes.
        assert_eq!(max_transfer(512, Some(1 << 20), None, 4096), 128 << 10);
        assert_eq!(max_transfer(1 << 20, None, None, 4096), 1 << 20);
    }

    #[test]
    fn error_messages_name_the_fix() {
        let no = NvmeError::NoFdp { ctrl: "/dev/nvme0".into(), model: "QEMU NVMe Ctrl".into() };
        assert!(no.to_string().contains("does not support FDP; use --policy none or --engine plain"), "{no}");
        let off = NvmeError::FdpDisabled { ctrl: "/dev/nvme0".into(), endgid: 1 };
        assert!(off.to_string().contains("nvme set-feature /dev/nvme0 -f 0x1D --value=1 --cdw12=1 -s"), "{off}");
        let perm = NvmeError::Command {
            what: "identify controller".into(),
            path: "/dev/nvme0".into(),
            source: PassthruError::Os(io::Error::from_raw_os_error(libc::EACCES)),
        };
        assert!(perm.to_string().contains("run as root"), "{perm}");
        let perm = NvmeError::Open { path: "/dev/nvme0".into(), source: io::Error::from_raw_os_error(libc::EPERM) };
        assert!(perm.to_string().contains("run as root"), "{perm}");
        let tty = NvmeError::Command {
            what: "x".into(),
            path: "/dev/sda".into(),
            source: PassthruError::Os(io::Error::from_raw_os_error(libc::ENOTTY)),
        };
        assert!(tty.to_string().contains("not an NVMe device"), "{tty}");
        let off = NvmeError::Command {
            what: "x".into(),
            path: "/dev/nvme0".into(),
            source: PassthruError::Status(NvmeStatus(0x29)),
        };
        assert!(off.to_string().contains("`fdpblk fdp status`") && !off.to_string().contains("ENDGID"), "{off}");
    }

    #[test]
    fn log_pages_are_read_in_pieces_within_every_transfer_limit() {
        let p = |len| log_pieces(len).collect::<Vec<_>>();
        assert_eq!(p(16), vec![(0, 0..16)]);
        assert_eq!(p(4096), vec![(0, 0..4096)]);
        assert_eq!(p(4100), vec![(0, 0..4096), (4096, 4096..4100)]);
        let big = p(MAX_READ);
        assert_eq!(big.len(), (MAX_READ / LOG_PIECE) as usize);
        assert!(big.iter().all(|(o, r)| *o == r.start as u64 && r.len() == LOG_PIECE as usize && o % 4 == 0));
        assert_eq!(big.last().unwrap().1.end, MAX_READ as usize);
        assert!(p(0).is_empty());
    }

    #[test]
    fn discover_rejects_non_nvme() {
        let e = FdpInfo::discover("/dev/null").unwrap_err();
        assert!(e.to_string().contains("not an NVMe device"), "{e}");
        let e = NvmeDevice::open("/nonexistent").err().unwrap();
        assert!(e.to_string().contains("cannot open"), "{e}");
    }
}
