//! The FDP SSD model: a page-mapped FTL whose erase unit is the reclaim unit (RU).
//!
//! Model (reference `fdp-waf.md` §7):
//! - Physical space is split evenly into reclaim groups (RGs); each RG holds whole RUs and a
//!   free pool. Leftover bytes that do not make a whole RU are unused.
//! - Each (RG, stream) has at most one open RU. The streams of an RG are: one per host handle,
//!   one GC stream per persistently isolated (PI) handle, and one GC stream shared by all
//!   initially isolated (II) handles. RUs are opened lazily on the first write that needs one
//!   (with `hold_open_rus`, every stream also holds one from the start) and closed as soon as
//!   they are full, so a full RU is a GC candidate at once.
//! - A host write that needs a fresh RU first runs GC in its RG until more than
//!   `free_ru_low_watermark` RUs are free, then takes one. GC takes its own RUs from that
//!   reserve, which is why the watermark must be at least 1.
//! - GC picks a closed RU (greedy: fewest valid units; cost-benefit: LFS's (1−u)·age/(1+u);
//!   FIFO: the oldest, as in the analytic model), copies its valid units to the victim's GC
//!   stream (II → the shared GC RU, PI → the handle's own GC RU, a GC RU → its own stream),
//!   then erases it.
//! - Open RUs and the reserve are spare space that holds no data: with one handle, a
//!   validation run measured the loss as `free_ru_low_watermark` + ½ RUs (the reserve and half
//!   of the host's open RU on average; see `sim::tests`).
//!
//! Cost: O(1) per mapping unit written or deallocated. The L2P and the reverse map (the
//! logical unit written at each physical unit, checked against the L2P at GC time) are flat
//! `u32` arrays. Greedy keeps closed RUs in intrusive lists bucketed by valid count, so picking
//! a victim is a scan up from a low-water mark (amortised O(1) per unit written); FIFO keeps
//! a queue; cost-benefit scans the RG's RUs once per victim (O(RUs per RG), fine for the few
//! hundred RUs of real drives).

use std::fmt;

const NONE: u32 = u32::MAX;

const FREE: u8 = 0;
const OPEN: u8 = 1;
const CLOSED: u8 = 2;

/// Reclaim unit handle type (FDP `RUHT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HandleType {
    /// `RUHT` 1: the handle's data is kept apart only when first written; GC relocates it into
    /// the one GC RU that all II handles share, mixing lifetimes again.
    InitiallyIsolated,
    /// `RUHT` 2: kept apart through GC as well; the handle has its own GC RU (one more open RU
    /// of spare space per RG).
    PersistentlyIsolated,
}

/// GC victim policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Victim {
    /// The closed RU with the fewest valid units.
    Greedy,
    /// The closed RU with the highest (1 − u)·age / (1 + u) (Rosenblum & Ousterhout's LFS),
    /// u = valid fraction of the RU, age = host bytes written since the RU was closed, plus 1.
    /// A garbage collection RU's age starts when it closes: moved data does not keep its own
    /// age, as LFS's per-block times do.
    CostBenefit,
    /// The oldest closed RU, whatever it holds: the circular log of the analytic model, whose
    /// WAF does not depend on the RU size (greedy's approaches it as RUs grow).
    Fifo,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GcConfig {
    pub victim: Victim,
    /// GC runs in an RG when a host write needs a fresh RU and at most this many RUs are free;
    /// it stops when more are free. At least 1: GC needs a free RU to relocate into.
    pub free_ru_low_watermark: u32,
}

impl Default for GcConfig {
    fn default() -> Self {
        Self { victim: Victim::Greedy, free_ru_low_watermark: 1 }
    }
}

/// Geometry and policy of a simulated FDP drive. All sizes are bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SsdConfig {
    /// Capacity the host sees (the namespace). Need not be a multiple of `unit_bytes`.
    pub logical_bytes: u64,
    /// Raw media: logical plus over-provisioning. Split evenly between reclaim groups.
    pub physical_bytes: u64,
    /// Mapping unit. 4 KiB models a page-mapped FTL exactly; larger units (1 MiB, a whole
    /// slot) trade fidelity on small writes for speed. See `Ssd::write` for rounding.
    pub unit_bytes: u64,
    /// Reclaim unit size (`RUNS`). An RU holds ⌊ru_bytes / unit_bytes⌋ units; a remainder is
    /// never written (pick a unit that divides the RU to avoid it), but is erased with the RU.
    pub ru_bytes: u64,
    /// Number of reclaim groups (`NRG`).
    pub reclaim_groups: u32,
    /// One entry per reclaim unit handle; handle `i` is `handles[i]`.
    pub handles: Vec<HandleType>,
    pub gc: GcConfig,
    /// Every handle and GC stream holds an open RU from the start, as a drive whose reclaim
    /// unit handles always reference one (reference §7.4): a handle never written keeps an
    /// empty RU out of the spare. Off: a stream takes an RU at its first write.
    pub hold_open_rus: bool,
    /// How much of one write the drive takes in before it cleans for it: the units of a write
    /// that needs a fresh RU that are unmapped before GC runs (GC never copies those). 0: all
    /// of the write the RU will hold, however long the write (the simulator merges adjacent
    /// writes on one handle, so that can reach a whole RU); one request (512 KiB) is a drive
    /// that cleans first beyond its buffer.
    pub write_buffer_bytes: u64,
}

impl SsdConfig {
    /// One reclaim group, greedy GC with watermark 1, all handles of type `handle_type`.
    pub fn new(
        logical_bytes: u64,
        physical_bytes: u64,
        unit_bytes: u64,
        ru_bytes: u64,
        handles: u16,
        handle_type: HandleType,
    ) -> Self {
        Self {
            logical_bytes,
            physical_bytes,
            unit_bytes,
            ru_bytes,
            reclaim_groups: 1,
            handles: vec![handle_type; handles as usize],
            gc: GcConfig::default(),
            hold_open_rus: false,
            write_buffer_bytes: 0,
        }
    }

    /// Physical bytes for over-provisioning `op` expressed as a fraction of physical space:
    /// logical / (1 − op), rounded up. NaN or `op` outside [0, 1) gives `logical_bytes`.
    pub fn physical_for_op(logical_bytes: u64, op_fraction_of_physical: f64) -> u64 {
        let op = op_fraction_of_physical;
        if !(0.0..1.0).contains(&op) {
            return logical_bytes;
        }
        (logical_bytes as f64 / (1.0 - op)).ceil() as u64
    }

    /// Open RUs an RG may hold at once: one per host handle, one GC RU per PI handle, and one
    /// shared GC RU if any handle is II. Each is spare space that holds no closed data.
    pub fn max_open_rus_per_rg(&self) -> u64 {
        let pi = self.handles.iter().filter(|t| **t == HandleType::PersistentlyIsolated).count();
        let ii = self.handles.len() - pi;
        (self.handles.len() + pi + usize::from(ii > 0)) as u64
    }

    /// Checks the configuration; every error says what to change.
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |s: String| Err(SimError::InvalidConfig(s));
        if self.unit_bytes == 0 {
            return bad(
                "unit_bytes is 0: use 4096 for a page-mapped FTL, or a larger unit (e.g. 1 MiB) for speed".into()
            );
        }
        if self.ru_bytes < self.unit_bytes {
            return bad(format!(
                "ru_bytes ({}) is smaller than unit_bytes ({}): an RU must hold at least one unit; use a smaller unit",
                self.ru_bytes, self.unit_bytes
            ));
        }
        if self.logical_bytes == 0 {
            return bad("logical_bytes is 0: give the namespace capacity".into());
        }
        if self.reclaim_groups == 0 {
            return bad("reclaim_groups is 0: use at least 1".into());
        }
        if self.handles.is_empty() {
            return bad(
                "handles is empty: give at least one handle type (writes without placement use handle 0)".into()
            );
        }
        if self.handles.len() > MAX_HANDLES {
            return bad(format!("{} handles: at most {MAX_HANDLES} are supported", self.handles.len()));
        }
        if self.gc.free_ru_low_watermark == 0 {
            return bad("free_ru_low_watermark is 0: use at least 1, GC needs a free RU to relocate into".into());
        }
        if self.physical_bytes < self.logical_bytes {
            return bad(format!(
                "physical_bytes ({}) is below logical_bytes ({}): physical space must hold the logical space plus spare",
                self.physical_bytes, self.logical_bytes
            ));
        }
        let per_rg = self.physical_bytes / u64::from(self.reclaim_groups);
        if self.ru_bytes > per_rg {
            return bad(format!(
                "ru_bytes ({}) is larger than a reclaim group's share of physical space ({}): use smaller RUs, fewer reclaim groups or more physical space",
                self.ru_bytes, per_rg
            ));
        }
        let upr = self.ru_bytes / self.unit_bytes;
        let rus_per_rg = per_rg / self.ru_bytes;
        let rus = rus_per_rg * u64::from(self.reclaim_groups);
        let logical_units = self.logical_bytes.div_ceil(self.unit_bytes);
        if logical_units >= u64::from(NONE)
            || rus.checked_mul(upr).is_none_or(|p| p >= u64::from(NONE))
            || upr >= u64::from(NONE)
        {
            return bad(format!(
                "{} physical units of {} bytes do not fit the 32-bit map: use a larger unit_bytes",
                rus.saturating_mul(upr),
                self.unit_bytes
            ));
        }
        // With fewer RUs than this, GC could find every closed RU full of valid data and make no
        // progress (pigeonhole): GC runs with up to `watermark` RUs free and `open` RUs open, so
        // the closed RUs must be more than the RUs' worth of logical data.
        let open = self.max_open_rus_per_rg();
        let wm = u64::from(self.gc.free_ru_low_watermark);
        let need = logical_units.div_ceil(upr) + u64::from(self.reclaim_groups) * (open + wm) + 1;
        if rus < need {
            return bad(format!(
                "over-provisioning too small: physical space holds {rus} RUs but needs at least {need} = {} for the logical data + {} reclaim group(s) × ({open} open RUs for handles and GC + {wm} reserve RUs of free_ru_low_watermark) + 1; raise physical_bytes, or use smaller RUs, fewer handles or a lower watermark",
                logical_units.div_ceil(upr),
                self.reclaim_groups
            ));
        }
        Ok(())
    }
}

/// At most this many handles (two streams per handle plus the shared GC stream fit in a u16).
pub const MAX_HANDLES: usize = 16_384;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SimError {
    /// The configuration cannot work; the message names the fix.
    InvalidConfig(String),
    /// The byte range runs past the logical capacity.
    OutOfRange { offset: u64, len: u64, capacity: u64 },
    /// No such handle (like an NVMe write with an invalid placement identifier).
    InvalidHandle { handle: u16, handles: u16 },
    /// No such reclaim group.
    InvalidReclaimGroup { rg: u32, groups: u32 },
    /// GC in this RG found no closed RU with anything to reclaim: the host put more data into
    /// the RG than its spare allows (only possible with several RGs). The write that hit this
    /// may be partly applied: the counters hold the units placed, the units of the chunk that
    /// did not fit are left deallocated.
    ReclaimGroupFull { rg: u32 },
}

impl SimError {
    /// The errno a block engine should complete the request with.
    pub fn errno(&self) -> i32 {
        match self {
            SimError::ReclaimGroupFull { .. } => libc::ENOSPC,
            _ => libc::EINVAL,
        }
    }
}

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SimError::InvalidConfig(s) => write!(f, "invalid SSD configuration: {s}"),
            SimError::OutOfRange { offset, len, capacity } => {
                write!(f, "range {offset}+{len} runs past the logical capacity {capacity}")
            }
            SimError::InvalidHandle { handle, handles } => {
                write!(f, "handle {handle} does not exist: the drive has handles 0..{handles}")
            }
            SimError::InvalidReclaimGroup { rg, groups } => {
                write!(f, "reclaim group {rg} does not exist: the drive has groups 0..{groups}")
            }
            SimError::ReclaimGroupFull { rg } => write!(
                f,
                "reclaim group {rg} is full of valid data: spread writes over the reclaim groups or add physical space"
            ),
        }
    }
}

impl std::error::Error for SimError {}

/// Cumulative counters, like the FDP statistics log (HBMW, MBMW, MBE) plus GC detail. Bytes
/// are whole mapping units (see `Ssd::write`). Take a clone as a snapshot and `since` it for a
/// window: steady-state WAF is `now.since(&after_warmup).waf()`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SsdCounters {
    /// Host writes, rounded out to whole units (HBMW).
    pub host_bytes: u64,
    /// Bytes the host asked to write, before rounding.
    pub host_request_bytes: u64,
    /// Bytes programmed: host + relocated (MBMW).
    pub media_bytes: u64,
    /// Bytes GC copied out of victims.
    pub relocated_bytes: u64,
    /// Bytes erased (MBE) = `rus_erased` × RU size.
    pub erased_bytes: u64,
    pub rus_erased: u64,
    /// Victims GC reclaimed (every erase is one).
    pub gc_events: u64,
    /// Mapped bytes that deallocation unmapped (already unmapped units do not count).
    pub deallocated_bytes: u64,
    /// RUs closed early by `ruh_update`.
    pub ru_updates: u64,
    /// Unwritten space of RUs closed early: dead until the RU is erased. Not in `media_bytes`
    /// (QEMU adds it to MBMW; a drive need not program it).
    pub padding_bytes: u64,
    /// Host bytes per handle (rounded like `host_bytes`).
    pub host_bytes_by_handle: Vec<u64>,
    /// GC victims by the stream that filled them ([`stream_owner`]: each handle's host
    /// writes, then each PI handle's GC stream, then the GC stream the II handles share).
    pub gc_victims_by_stream: Vec<u64>,
    /// Bytes GC copied out of those victims, by the same streams.
    pub relocated_bytes_by_stream: Vec<u64>,
    /// Host bytes written between each victim's closing and its collection, summed by the
    /// same streams (divided by the victims: how long GC let an RU's data die).
    pub victim_age_bytes_by_stream: Vec<u64>,
    /// Victims by the same streams and by their age when taken, in steps of
    /// [`AGE_HIST_STEP`] drive writes (the last bucket holds everything older).
    pub victim_age_hist_by_stream: Vec<Vec<u64>>,
    /// Victims by the same streams and by their valid share when taken, in whole percent
    /// (floored; bucket 100: a victim still full).
    pub victim_valid_hist_by_stream: Vec<Vec<u64>>,
}

/// Width of a bucket of [`SsdCounters::victim_age_hist_by_stream`], in drive writes (host
/// bytes / logical capacity).
pub const AGE_HIST_STEP: f64 = 0.002;
/// Buckets of [`SsdCounters::victim_age_hist_by_stream`]: ages up to 4 drive writes apart.
pub const AGE_HIST_BUCKETS: usize = 2000;
/// Buckets of [`SsdCounters::victim_valid_hist_by_stream`]: 0 to 100 %.
pub const VALID_HIST_BUCKETS: usize = 101;

/// Who fills the RUs of `stream` on a drive of `handles` handles (the streams of
/// [`SsdCounters::gc_victims_by_stream`]).
pub fn stream_owner(handles: usize, stream: usize) -> RuOwner {
    if stream < handles {
        RuOwner::Host(stream as u16)
    } else if stream < 2 * handles {
        RuOwner::HandleGc((stream - handles) as u16)
    } else {
        RuOwner::SharedGc
    }
}

/// `now - earlier` element by element (a vector `earlier` lacks counts from 0).
fn minus(now: &[u64], earlier: &[u64]) -> Vec<u64> {
    now.iter().enumerate().map(|(i, b)| b - earlier.get(i).copied().unwrap_or(0)).collect()
}

/// [`minus`] for each stream's histogram.
fn minus_hist(now: &[Vec<u64>], earlier: &[Vec<u64>]) -> Vec<Vec<u64>> {
    now.iter().enumerate().map(|(i, h)| minus(h, earlier.get(i).map_or(&[][..], |e| &e[..]))).collect()
}

impl SsdCounters {
    /// media / host; 1.0 when nothing was written.
    pub fn waf(&self) -> f64 {
        if self.host_bytes == 0 {
            1.0
        } else {
            self.media_bytes as f64 / self.host_bytes as f64
        }
    }

    /// What happened between `earlier` (a clone of these counters taken before) and now.
    pub fn since(&self, earlier: &SsdCounters) -> SsdCounters {
        SsdCounters {
            host_bytes: self.host_bytes - earlier.host_bytes,
            host_request_bytes: self.host_request_bytes - earlier.host_request_bytes,
            media_bytes: self.media_bytes - earlier.media_bytes,
            relocated_bytes: self.relocated_bytes - earlier.relocated_bytes,
            erased_bytes: self.erased_bytes - earlier.erased_bytes,
            rus_erased: self.rus_erased - earlier.rus_erased,
            gc_events: self.gc_events - earlier.gc_events,
            deallocated_bytes: self.deallocated_bytes - earlier.deallocated_bytes,
            ru_updates: self.ru_updates - earlier.ru_updates,
            padding_bytes: self.padding_bytes - earlier.padding_bytes,
            host_bytes_by_handle: minus(&self.host_bytes_by_handle, &earlier.host_bytes_by_handle),
            gc_victims_by_stream: minus(&self.gc_victims_by_stream, &earlier.gc_victims_by_stream),
            relocated_bytes_by_stream: minus(&self.relocated_bytes_by_stream, &earlier.relocated_bytes_by_stream),
            victim_age_bytes_by_stream: minus(&self.victim_age_bytes_by_stream, &earlier.victim_age_bytes_by_stream),
            victim_age_hist_by_stream: minus_hist(&self.victim_age_hist_by_stream, &earlier.victim_age_hist_by_stream),
            victim_valid_hist_by_stream: minus_hist(&self.victim_valid_hist_by_stream, &earlier.victim_valid_hist_by_stream),
        }
    }
}

/// Who fills an RU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RuOwner {
    /// Host writes of this handle.
    Host(u16),
    /// GC relocations of this PI handle's data.
    HandleGc(u16),
    /// GC relocations shared by all II handles.
    SharedGc,
}

/// Where a logical unit's data currently lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Location {
    pub rg: u32,
    /// Global RU index (RG `g` holds RUs `g·rus_per_rg ..`).
    pub ru: u32,
    pub owner: RuOwner,
    /// Whether the RU is still open (being filled).
    pub open: bool,
}

/// One handle's view, like the RUH Usage and RUH Status logs plus occupancy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuhUsage {
    pub handle: u16,
    pub kind: HandleType,
    pub host_bytes: u64,
    /// Non-free RUs (open or closed) filled by this handle's host writes.
    pub rus_in_use: u64,
    /// Non-free RUs of this handle's own GC stream (PI only; II relocations are in
    /// `Ssd::shared_gc_rus_in_use`).
    pub gc_rus_in_use: u64,
    /// Valid bytes in the RUs above.
    pub valid_bytes: u64,
    /// Per RG: bytes left in the open RU (RUAMW in bytes); a whole RU when none is open,
    /// since the next write opens a fresh one.
    pub ruamw_bytes: Vec<u64>,
}

/// The simulated drive. Build with `Ssd::new`, drive with `write` / `deallocate` /
/// `ruh_update`, read `counters`. `Clone` forks a drive (e.g. one aged once, then several
/// experiments); `Debug` prints a summary, not the maps.
#[derive(Clone)]
pub struct Ssd {
    cfg: SsdConfig,
    unit: u64,
    /// Units per RU.
    upr: u32,
    logical_units: u64,
    rus_per_rg: u32,
    nstreams: usize,
    /// For each stream, where GC sends its RUs' valid data.
    gc_target: Vec<u16>,
    /// The streams the configuration has (host handles, their GC streams): with
    /// `hold_open_rus`, each one without an open RU keeps a free RU back for it.
    configured: Vec<usize>,
    greedy: bool,
    /// FIFO: closed RUs per RG in closing order.
    fifo: Vec<std::collections::VecDeque<u32>>,
    /// FIFO: victims in a row per RG that freed nothing (a whole cycle of them = RG full).
    no_gain: Vec<u32>,
    /// Logical unit → physical unit (`ru · upr + offset`), NONE when unmapped.
    l2p: Vec<u32>,
    /// Physical unit → the logical unit last written there; valid iff `l2p` points back.
    p2l: Vec<u32>,
    ru_valid: Vec<u32>,
    ru_written: Vec<u32>,
    ru_stream: Vec<u16>,
    ru_state: Vec<u8>,
    /// Host clock (host bytes written, so that the unit size does not matter) when the RU was
    /// closed, for cost-benefit age.
    ru_closed_at: Vec<u64>,
    /// Greedy buckets: intrusive doubly linked lists of closed RUs by valid count.
    ru_prev: Vec<u32>,
    ru_next: Vec<u32>,
    /// `[rg · (upr + 1) + valid]` → first RU of the bucket.
    bucket_head: Vec<u32>,
    /// Per RG: no closed RU has fewer valid units than this.
    bucket_min: Vec<u32>,
    /// `[rg · nstreams + stream]` → open RU or NONE.
    open: Vec<u32>,
    free: Vec<Vec<u32>>,
    clock: u64,
    counters: SsdCounters,
}

impl fmt::Debug for Ssd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ssd")
            .field("config", &self.cfg)
            .field("units_per_ru", &self.upr)
            .field("rus_per_rg", &self.rus_per_rg)
            .field("free_rus", &self.free.iter().map(Vec::len).collect::<Vec<_>>())
            .field("counters", &self.counters)
            .finish_non_exhaustive()
    }
}

impl Ssd {
    pub fn new(cfg: SsdConfig) -> Result<Ssd, SimError> {
        cfg.validate()?;
        let nh = cfg.handles.len();
        let nrg = cfg.reclaim_groups as usize;
        let upr = (cfg.ru_bytes / cfg.unit_bytes) as u32;
        let rus_per_rg = (cfg.physical_bytes / u64::from(cfg.reclaim_groups) / cfg.ru_bytes) as u32;
        let rus = rus_per_rg as usize * nrg;
        let logical_units = cfg.logical_bytes.div_ceil(cfg.unit_bytes);
        // Streams: 0..nh host, nh..2nh PI GC of handle h, 2nh the shared II GC stream.
        let nstreams = 2 * nh + 1;
        let shared = (2 * nh) as u16;
        let mut gc_target = Vec::with_capacity(nstreams);
        for (h, t) in cfg.handles.iter().enumerate() {
            gc_target.push(match t {
                HandleType::InitiallyIsolated => shared,
                HandleType::PersistentlyIsolated => (nh + h) as u16,
            });
        }
        for h in 0..nh {
            gc_target.push((nh + h) as u16);
        }
        gc_target.push(shared);
        let mut configured: Vec<usize> = (0..nh).collect();
        configured.extend((0..nh).filter(|&h| cfg.handles[h] == HandleType::PersistentlyIsolated).map(|h| nh + h));
        if cfg.handles.contains(&HandleType::InitiallyIsolated) {
            configured.push(2 * nh);
        }
        let free = (0..nrg)
            .map(|g| {
                // Popped from the back: hand out low RU numbers first.
                let base = (g as u32) * rus_per_rg;
                (base..base + rus_per_rg).rev().collect()
            })
            .collect();
        Ok(Ssd {
            unit: cfg.unit_bytes,
            upr,
            logical_units,
            rus_per_rg,
            nstreams,
            gc_target,
            configured,
            greedy: cfg.gc.victim == Victim::Greedy,
            fifo: vec![Default::default(); nrg],
            no_gain: vec![0; nrg],
            l2p: vec![NONE; logical_units as usize],
            p2l: vec![NONE; rus * upr as usize],
            ru_valid: vec![0; rus],
            ru_written: vec![0; rus],
            ru_stream: vec![0; rus],
            ru_state: vec![FREE; rus],
            ru_closed_at: vec![0; rus],
            ru_prev: vec![NONE; rus],
            ru_next: vec![NONE; rus],
            bucket_head: vec![NONE; nrg * (upr as usize + 1)],
            bucket_min: vec![upr + 1; nrg],
            open: vec![NONE; nrg * nstreams],
            free,
            clock: 0,
            counters: SsdCounters {
                host_bytes_by_handle: vec![0; nh],
                gc_victims_by_stream: vec![0; nstreams],
                relocated_bytes_by_stream: vec![0; nstreams],
                victim_age_bytes_by_stream: vec![0; nstreams],
                victim_age_hist_by_stream: vec![vec![0; AGE_HIST_BUCKETS]; nstreams],
                victim_valid_hist_by_stream: vec![vec![0; VALID_HIST_BUCKETS]; nstreams],
                ..Default::default()
            },
            cfg,
        })
    }

    pub fn config(&self) -> &SsdConfig {
        &self.cfg
    }

    pub fn counters(&self) -> &SsdCounters {
        &self.counters
    }

    pub fn logical_bytes(&self) -> u64 {
        self.cfg.logical_bytes
    }

    pub fn handles(&self) -> u16 {
        self.cfg.handles.len() as u16
    }

    /// Units per RU.
    pub fn units_per_ru(&self) -> u32 {
        self.upr
    }

    /// RUs in each reclaim group.
    pub fn rus_per_rg(&self) -> u32 {
        self.rus_per_rg
    }

    /// Free RUs in reclaim group `rg` (0 for a group that does not exist).
    pub fn free_rus(&self, rg: u32) -> u32 {
        self.free.get(rg as usize).map_or(0, |f| f.len() as u32)
    }

    /// Writes `len` bytes at `offset` with handle `handle` into reclaim group 0.
    ///
    /// Rounding rule: the write covers every mapping unit it touches, so a partial unit counts
    /// as a whole-unit write in `host_bytes` and `media_bytes` (as if the drive did a
    /// read-modify-write of the unit); `host_request_bytes` keeps the exact sum. Choose
    /// `unit_bytes` dividing the workload's write granularity to make this exact.
    pub fn write(&mut self, offset: u64, len: u64, handle: u16) -> Result<(), SimError> {
        self.write_in(0, offset, len, handle)
    }

    /// `write` into reclaim group `rg` (the RG part of an FDP placement identifier).
    pub fn write_in(&mut self, rg: u32, offset: u64, len: u64, handle: u16) -> Result<(), SimError> {
        self.check_range(offset, len)?;
        if handle as usize >= self.cfg.handles.len() {
            return Err(SimError::InvalidHandle { handle, handles: self.handles() });
        }
        if rg >= self.cfg.reclaim_groups {
            return Err(SimError::InvalidReclaimGroup { rg, groups: self.cfg.reclaim_groups });
        }
        if len == 0 {
            return Ok(());
        }
        let first = offset / self.unit;
        let end = (offset + len).div_ceil(self.unit).min(self.logical_units);
        self.counters.host_request_bytes += len;
        let mut lu = first as u32;
        let end = end as u32;
        let rg = rg as usize;
        let stream = handle as usize;
        while lu < end {
            let slot = rg * self.nstreams + stream;
            let mut ru = self.open[slot];
            if ru == NONE {
                // Invalidate the units this write puts into the fresh RU before GC can run, so
                // GC never copies data that the write itself overwrites (as if the drive
                // buffered the write before cleaning).
                let buffered = match self.cfg.write_buffer_bytes {
                    0 => self.upr,
                    b => b.div_ceil(self.unit).min(u64::from(self.upr)) as u32,
                };
                for l in lu..lu + buffered.min(end - lu) {
                    self.unmap(l);
                }
                ru = self.open_ru(rg, stream, true)?;
            }
            // Fill the open RU with as many units as fit, in one pass.
            let written = self.ru_written[ru as usize];
            let take = (self.upr - written).min(end - lu);
            let base = ru * self.upr + written;
            for i in 0..take {
                let l = lu + i;
                self.unmap(l);
                self.l2p[l as usize] = base + i;
                self.p2l[(base + i) as usize] = l;
            }
            self.ru_valid[ru as usize] += take;
            self.ru_written[ru as usize] = written + take;
            let bytes = u64::from(take) * self.unit;
            self.clock += bytes;
            self.counters.host_bytes += bytes;
            self.counters.media_bytes += bytes;
            self.counters.host_bytes_by_handle[stream] += bytes;
            lu += take;
            if written + take == self.upr {
                self.close(ru, slot);
            }
        }
        Ok(())
    }

    /// Deallocates (TRIMs) the range: units wholly inside it are unmapped; partly covered units
    /// keep their data, like a drive that ignores sub-sector deallocation. The device's last
    /// unit counts as wholly covered when the range reaches the end of the logical space.
    pub fn deallocate(&mut self, offset: u64, len: u64) -> Result<(), SimError> {
        self.check_range(offset, len)?;
        let first = offset.div_ceil(self.unit);
        let end = if offset + len == self.cfg.logical_bytes { self.logical_units } else { (offset + len) / self.unit };
        for lu in first..end.max(first) {
            if self.l2p[lu as usize] != NONE {
                self.unmap(lu as u32);
                self.counters.deallocated_bytes += self.unit;
            }
        }
        Ok(())
    }

    /// RU Update: closes `handle`'s open RU in every reclaim group early; the next write opens
    /// a fresh one. The unwritten rest is dead space (`padding_bytes`).
    pub fn ruh_update(&mut self, handle: u16) -> Result<(), SimError> {
        for rg in 0..self.cfg.reclaim_groups {
            self.ruh_update_in(rg, handle)?;
        }
        Ok(())
    }

    /// RU Update for one (RG, handle) pair, i.e. one placement identifier.
    pub fn ruh_update_in(&mut self, rg: u32, handle: u16) -> Result<(), SimError> {
        if handle as usize >= self.cfg.handles.len() {
            return Err(SimError::InvalidHandle { handle, handles: self.handles() });
        }
        if rg >= self.cfg.reclaim_groups {
            return Err(SimError::InvalidReclaimGroup { rg, groups: self.cfg.reclaim_groups });
        }
        let slot = rg as usize * self.nstreams + handle as usize;
        let ru = self.open[slot];
        if ru != NONE {
            // An open RU always holds at least one unit (RUs open lazily on a write).
            self.counters.ru_updates += 1;
            self.counters.padding_bytes += u64::from(self.upr - self.ru_written[ru as usize]) * self.unit;
            self.close(ru, slot);
        }
        Ok(())
    }

    /// Where the unit holding byte `offset` lives, or None when unmapped or out of range.
    pub fn locate(&self, offset: u64) -> Option<Location> {
        let lu = offset / self.unit;
        let p = *self.l2p.get(lu as usize)?;
        if p == NONE {
            return None;
        }
        let ru = p / self.upr;
        Some(Location {
            rg: ru / self.rus_per_rg,
            ru,
            owner: self.owner(self.ru_stream[ru as usize]),
            open: self.ru_state[ru as usize] == OPEN,
        })
    }

    /// Per-handle usage (O(RUs)).
    pub fn ruh_usage(&self) -> Vec<RuhUsage> {
        let nh = self.cfg.handles.len();
        let mut out: Vec<RuhUsage> = self
            .cfg
            .handles
            .iter()
            .enumerate()
            .map(|(h, t)| RuhUsage {
                handle: h as u16,
                kind: *t,
                host_bytes: self.counters.host_bytes_by_handle[h],
                rus_in_use: 0,
                gc_rus_in_use: 0,
                valid_bytes: 0,
                ruamw_bytes: (0..self.cfg.reclaim_groups as usize)
                    .map(|g| {
                        let ru = self.open[g * self.nstreams + h];
                        let left = if ru == NONE { self.upr } else { self.upr - self.ru_written[ru as usize] };
                        u64::from(left) * self.unit
                    })
                    .collect(),
            })
            .collect();
        for ru in 0..self.ru_state.len() {
            if self.ru_state[ru] == FREE {
                continue;
            }
            let s = self.ru_stream[ru] as usize;
            let valid = u64::from(self.ru_valid[ru]) * self.unit;
            if s < nh {
                out[s].rus_in_use += 1;
                out[s].valid_bytes += valid;
            } else if s < 2 * nh {
                out[s - nh].gc_rus_in_use += 1;
                out[s - nh].valid_bytes += valid;
            }
        }
        out
    }

    /// Non-free RUs of the GC stream shared by II handles.
    pub fn shared_gc_rus_in_use(&self) -> u64 {
        let shared = (2 * self.cfg.handles.len()) as u16;
        (0..self.ru_state.len()).filter(|&r| self.ru_state[r] != FREE && self.ru_stream[r] == shared).count() as u64
    }

    /// Recomputes every derived structure from the maps and compares (O(device)); for tests.
    pub fn audit(&self) -> Result<(), String> {
        let rus = self.ru_state.len();
        let mut valid = vec![0u32; rus];
        for (lu, &p) in self.l2p.iter().enumerate() {
            if p == NONE {
                continue;
            }
            if self.p2l[p as usize] != lu as u32 {
                return Err(format!("unit {lu} maps to {p}, which maps back to {}", self.p2l[p as usize]));
            }
            let ru = (p / self.upr) as usize;
            if self.ru_state[ru] == FREE || p % self.upr >= self.ru_written[ru] {
                return Err(format!("unit {lu} maps into unwritten space of RU {ru}"));
            }
            valid[ru] += 1;
        }
        if valid != self.ru_valid {
            return Err("per-RU valid counts disagree with the L2P".into());
        }
        for (g, f) in self.free.iter().enumerate() {
            for &ru in f {
                if self.ru_state[ru as usize] != FREE || ru / self.rus_per_rg != g as u32 {
                    return Err(format!("free list of RG {g} holds RU {ru}"));
                }
            }
            let nfree = (0..self.rus_per_rg)
                .filter(|r| self.ru_state[(g as u32 * self.rus_per_rg + r) as usize] == FREE)
                .count();
            if nfree != f.len() {
                return Err(format!("RG {g}: {nfree} free RUs, free list has {}", f.len()));
            }
        }
        for (slot, &ru) in self.open.iter().enumerate() {
            if ru != NONE
                && (self.ru_state[ru as usize] != OPEN || self.ru_stream[ru as usize] as usize != slot % self.nstreams)
            {
                return Err(format!("open slot {slot} points at RU {ru} in the wrong state"));
            }
        }
        let opens = self.ru_state.iter().filter(|&&s| s == OPEN).count();
        if opens != self.open.iter().filter(|&&r| r != NONE).count() {
            return Err("an RU is open without being any stream's open RU".into());
        }
        if self.greedy {
            let mut seen = 0;
            for g in 0..self.free.len() {
                for v in 0..=self.upr {
                    let mut ru = self.bucket_head[g * (self.upr as usize + 1) + v as usize];
                    let mut prev = NONE;
                    while ru != NONE {
                        let r = ru as usize;
                        if self.ru_state[r] != CLOSED || self.ru_valid[r] != v || self.ru_prev[r] != prev {
                            return Err(format!("greedy bucket {v} of RG {g} holds RU {ru} wrongly"));
                        }
                        if v < self.bucket_min[g] {
                            return Err(format!("RG {g}: bucket {v} is below the low-water mark"));
                        }
                        seen += 1;
                        prev = ru;
                        ru = self.ru_next[r];
                    }
                }
            }
            if seen != self.ru_state.iter().filter(|&&s| s == CLOSED).count() {
                return Err("closed RUs missing from the greedy buckets".into());
            }
        }
        if self.cfg.gc.victim == Victim::Fifo {
            let queued: usize = self.fifo.iter().map(|q| q.len()).sum();
            if queued != self.ru_state.iter().filter(|&&s| s == CLOSED).count()
                || self.fifo.iter().flatten().any(|&r| self.ru_state[r as usize] != CLOSED)
            {
                return Err("FIFO queue disagrees with the closed RUs".into());
            }
        }
        let c = &self.counters;
        if c.media_bytes != c.host_bytes + c.relocated_bytes {
            return Err("media != host + relocated".into());
        }
        if c.erased_bytes != c.rus_erased * self.cfg.ru_bytes || c.rus_erased != c.gc_events {
            return Err("erased bytes disagree with RUs erased".into());
        }
        if c.host_bytes_by_handle.iter().sum::<u64>() != c.host_bytes {
            return Err("per-handle host bytes do not add up".into());
        }
        if c.gc_victims_by_stream.iter().sum::<u64>() != c.gc_events || c.relocated_bytes_by_stream.iter().sum::<u64>() != c.relocated_bytes {
            return Err("per-stream GC counts do not add up".into());
        }
        for (i, v) in c.gc_victims_by_stream.iter().enumerate() {
            if c.victim_age_hist_by_stream[i].iter().sum::<u64>() != *v || c.victim_valid_hist_by_stream[i].iter().sum::<u64>() != *v {
                return Err(format!("stream {i}: the victims' age or valid-share histogram does not add up to its victims"));
            }
        }
        Ok(())
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), SimError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.cfg.logical_bytes => Ok(()),
            _ => Err(SimError::OutOfRange { offset, len, capacity: self.cfg.logical_bytes }),
        }
    }

    fn owner(&self, stream: u16) -> RuOwner {
        stream_owner(self.cfg.handles.len(), usize::from(stream))
    }

    /// Drops the mapping of logical unit `lu`, if any.
    #[inline]
    fn unmap(&mut self, lu: u32) {
        let p = self.l2p[lu as usize];
        if p == NONE {
            return;
        }
        self.l2p[lu as usize] = NONE;
        let ru = p / self.upr;
        let r = ru as usize;
        let v = self.ru_valid[r];
        self.ru_valid[r] = v - 1;
        if self.greedy && self.ru_state[r] == CLOSED {
            self.bucket_unlink(ru, v);
            self.bucket_link(ru, v - 1);
        }
    }

    /// Takes a free RU of `rg` for `stream`; host allocations first run GC down to the
    /// watermark, GC allocations take from the reserve.
    fn open_ru(&mut self, rg: usize, stream: usize, host: bool) -> Result<u32, SimError> {
        if host {
            while self.free[rg].len() <= self.cfg.gc.free_ru_low_watermark as usize + self.held_back(rg, stream) {
                self.collect_one(rg)?;
            }
        }
        let ru = self.free[rg].pop().ok_or(SimError::ReclaimGroupFull { rg: rg as u32 })?;
        let r = ru as usize;
        self.ru_state[r] = OPEN;
        self.ru_stream[r] = stream as u16;
        self.ru_written[r] = 0;
        self.ru_valid[r] = 0;
        self.open[rg * self.nstreams + stream] = ru;
        Ok(ru)
    }

    /// Free RUs of `rg` that belong to the streams other than `stream` now without an open RU
    /// (with `hold_open_rus`: their handles reference an RU all the time; 0 without).
    fn held_back(&self, rg: usize, stream: usize) -> usize {
        if !self.cfg.hold_open_rus {
            return 0;
        }
        self.configured.iter().filter(|&&s| s != stream && self.open[rg * self.nstreams + s] == NONE).count()
    }

    fn close(&mut self, ru: u32, slot: usize) {
        let r = ru as usize;
        self.ru_state[r] = CLOSED;
        self.ru_closed_at[r] = self.clock;
        self.open[slot] = NONE;
        if self.greedy {
            self.bucket_link(ru, self.ru_valid[r]);
        } else if self.cfg.gc.victim == Victim::Fifo {
            self.fifo[ru as usize / self.rus_per_rg as usize].push_back(ru);
        }
    }

    #[inline]
    fn bucket_link(&mut self, ru: u32, v: u32) {
        let g = (ru / self.rus_per_rg) as usize;
        let h = g * (self.upr as usize + 1) + v as usize;
        let head = self.bucket_head[h];
        self.ru_next[ru as usize] = head;
        self.ru_prev[ru as usize] = NONE;
        if head != NONE {
            self.ru_prev[head as usize] = ru;
        }
        self.bucket_head[h] = ru;
        if v < self.bucket_min[g] {
            self.bucket_min[g] = v;
        }
    }

    #[inline]
    fn bucket_unlink(&mut self, ru: u32, v: u32) {
        let (p, n) = (self.ru_prev[ru as usize], self.ru_next[ru as usize]);
        if p != NONE {
            self.ru_next[p as usize] = n;
        } else {
            let g = (ru / self.rus_per_rg) as usize;
            self.bucket_head[g * (self.upr as usize + 1) + v as usize] = n;
        }
        if n != NONE {
            self.ru_prev[n as usize] = p;
        }
    }

    /// Picks and unlinks a victim in `rg`; None if no closed RU exists.
    fn pick_victim(&mut self, rg: usize) -> Option<u32> {
        if self.greedy {
            let base = rg * (self.upr as usize + 1);
            let mut v = self.bucket_min[rg];
            while v <= self.upr && self.bucket_head[base + v as usize] == NONE {
                v += 1;
            }
            self.bucket_min[rg] = v;
            if v > self.upr {
                return None;
            }
            let ru = self.bucket_head[base + v as usize];
            self.bucket_unlink(ru, v);
            Some(ru)
        } else if self.cfg.gc.victim == Victim::Fifo {
            self.fifo[rg].pop_front()
        } else {
            let lo = rg * self.rus_per_rg as usize;
            let mut best: Option<(f64, u32)> = None;
            for r in lo..lo + self.rus_per_rg as usize {
                if self.ru_state[r] != CLOSED {
                    continue;
                }
                // Nothing to copy: free at once, as LFS counts such a segment clean (its
                // score, age alone, could lose to an older RU that still holds data).
                if self.ru_valid[r] == 0 {
                    return Some(r as u32);
                }
                let u = f64::from(self.ru_valid[r]) / f64::from(self.upr);
                let age = (self.clock - self.ru_closed_at[r] + 1) as f64;
                let score = (1.0 - u) * age / (1.0 + u);
                if best.is_none_or(|(s, _)| score > s) {
                    best = Some((score, r as u32));
                }
            }
            best.map(|(_, r)| r)
        }
    }

    /// Reclaims one victim in `rg`: relocates its valid units, erases it.
    fn collect_one(&mut self, rg: usize) -> Result<(), SimError> {
        let Some(victim) = self.pick_victim(rg) else {
            return Err(SimError::ReclaimGroupFull { rg: rg as u32 });
        };
        let vr = victim as usize;
        if self.ru_valid[vr] >= self.upr {
            if self.cfg.gc.victim == Victim::Fifo {
                // FIFO cleans in order even when the oldest RU is still full (the relocation
                // then frees nothing); only a whole cycle of such victims means the RG is full.
                self.no_gain[rg] += 1;
                if self.no_gain[rg] > self.rus_per_rg {
                    self.fifo[rg].push_front(victim);
                    return Err(SimError::ReclaimGroupFull { rg: rg as u32 });
                }
            } else {
                // The best victim is full of valid data, so all are: reclaiming frees nothing.
                if self.greedy {
                    self.bucket_link(victim, self.ru_valid[vr]);
                }
                return Err(SimError::ReclaimGroupFull { rg: rg as u32 });
            }
        } else {
            self.no_gain[rg] = 0;
        }
        // In flight: out of the buckets and not CLOSED, so nothing treats it as a candidate.
        self.ru_state[vr] = OPEN;
        let target = self.gc_target[self.ru_stream[vr] as usize] as usize;
        let slot = rg * self.nstreams + target;
        let mut left = self.ru_valid[vr];
        let moved = u64::from(left);
        let mut p = victim * self.upr;
        let end = p + self.ru_written[vr];
        // Fill the GC RU a run at a time: find the next `room` valid units and append them.
        while left > 0 {
            let mut ru = self.open[slot];
            if ru == NONE {
                ru = self.open_ru(rg, target, false)?;
            }
            let r = ru as usize;
            let written = self.ru_written[r];
            let room = (self.upr - written).min(left);
            let mut dst = ru * self.upr + written;
            let stop = dst + room;
            while dst < stop && p < end {
                let lu = self.p2l[p as usize];
                if self.l2p[lu as usize] == p {
                    self.l2p[lu as usize] = dst;
                    self.p2l[dst as usize] = lu;
                    dst += 1;
                }
                p += 1;
            }
            debug_assert_eq!(dst, stop, "victim {victim} holds fewer valid units than counted");
            self.ru_valid[r] += room;
            self.ru_written[r] = written + room;
            left -= room;
            if written + room == self.upr {
                self.close(ru, slot);
            }
        }
        let c = &mut self.counters;
        let stream = self.ru_stream[vr] as usize;
        c.gc_victims_by_stream[stream] += 1;
        c.relocated_bytes_by_stream[stream] += moved * self.unit;
        let age = self.clock - self.ru_closed_at[vr];
        c.victim_age_bytes_by_stream[stream] += age;
        let age_bucket = (age as f64 / self.cfg.logical_bytes as f64 / AGE_HIST_STEP) as usize;
        c.victim_age_hist_by_stream[stream][age_bucket.min(AGE_HIST_BUCKETS - 1)] += 1;
        c.victim_valid_hist_by_stream[stream][(moved * 100 / u64::from(self.upr)) as usize] += 1;
        c.relocated_bytes += moved * self.unit;
        c.media_bytes += moved * self.unit;
        c.erased_bytes += self.cfg.ru_bytes;
        c.rus_erased += 1;
        c.gc_events += 1;
        self.ru_state[vr] = FREE;
        self.ru_valid[vr] = 0;
        self.ru_written[vr] = 0;
        self.free[rg].push(victim);
        Ok(())
    }
}
