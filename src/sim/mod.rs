//! WAF simulation: a model of an NVMe FDP SSD with garbage collection, because QEMU's FDP
//! drive has none (it never relocates or erases, so its DLWA is 1 by construction).
//!
//! - `ssd`: the drive model (reclaim units, reclaim groups, II/PI handles, greedy or
//!   cost-benefit GC, FDP-style counters). Byte offsets in, whole mapping units inside.
//! - `analytic`: the closed-form WAF of uniform random overwrites that the model is validated
//!   against.
//! - `workload`: the LMCache workload model (requests, index, allocator, eviction controller,
//!   checkpoints) and the block requests it makes (`tools/workloads/*.json`).
//! - `run`: one simulation (`fdpblk simulate`): workload → fdpblk's pipeline and state thread
//!   → SSD model, steady-state WAF; `dev`: the simulated backing device; `plot`: the
//!   WAF-vs-utilisation PNG.
//!
//! ```
//! use fdpblk::sim::{HandleType, Ssd, SsdConfig};
//! let mib = 1u64 << 20;
//! let logical = 256 * mib;
//! let physical = SsdConfig::physical_for_op(logical, 0.20);
//! let mut ssd = Ssd::new(SsdConfig::new(logical, physical, mib, 4 * mib, 1, HandleType::InitiallyIsolated)).unwrap();
//! ssd.write(0, logical, 0).unwrap();
//! let warm = ssd.counters().clone();
//! ssd.write(0, logical, 0).unwrap(); // sequential overwrite: whole RUs die together
//! assert_eq!(ssd.counters().since(&warm).waf(), 1.0);
//! ```

pub mod analytic;
pub mod dev;
mod memory;
pub mod plot;
pub mod run;
pub mod ssd;
pub mod workload;

pub use analytic::{analytic_waf_alpha, analytic_waf_uniform, valid_fraction};
pub use ssd::{
    GcConfig, HandleType, Location, RuOwner, stream_owner, AGE_HIST_STEP, AGE_HIST_BUCKETS, VALID_HIST_BUCKETS, RuhUsage, SimError, Ssd, SsdConfig, SsdCounters, Victim, MAX_HANDLES,
};

/// A small, fast, seedable generator (SplitMix64) for reproducible workloads.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (Lemire's multiply-shift; the bias is below 2⁻³² for n < 2³²).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

#[cfg(test)]
mod tests;
