//! How much memory a model may take: its tables are sized by the device and the workload,
//! which a stray trace line or a large `"universe"` can make larger than the machine, so they
//! are estimated and refused before anything is allocated (an allocation that fails aborts).

use std::fs;

/// Half of this machine's memory, or of the cgroup's limit where that is lower; `None` where
/// neither can be read (then nothing is refused).
pub fn budget() -> Option<u64> {
    // SAFETY: sysconf reads a system value.
    let (pages, page) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    let physical = (pages > 0 && page > 0).then(|| (pages as u64).saturating_mul(page as u64));
    let limit = cgroup_limit();
    match (physical, limit) {
        (Some(p), Some(l)) => Some(p.min(l) / 2),
        (p, l) => p.or(l).map(|m| m / 2),
    }
}

/// The cgroup v2 `memory.max` of this process, when it is a number.
fn cgroup_limit() -> Option<u64> {
    let line = fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = line.lines().find_map(|l| l.strip_prefix("0::"))?;
    fs::read_to_string(format!("/sys/fs/cgroup{}/memory.max", path.trim_end_matches('/'))).ok()?.trim().parse().ok()
}

/// The error for a model of `need` bytes over `budget`, naming what makes it smaller.
pub fn check(what: &str, need: u64, budget: Option<u64>, fix: &str) -> Result<(), String> {
    match budget {
        Some(b) if need > b => Err(format!(
            "{what} takes about {} MiB, more than half of the memory this process may use ({} MiB): {fix}",
            need >> 20,
            (b * 2) >> 20
        )),
        _ => Ok(()),
    }
}
