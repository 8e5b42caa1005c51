//! How much memory a model may take: its tables are sized by the device and the workload,
//! which a stray trace line or a large `"universe"` can make larger than the machine, so they
//! are estimated and refused before anything is allocated (an allocation that fails aborts).

use std::fs;

/// Half of this machine's memory, or of the cgroup's limit or the address-space limit
/// (`ulimit -v`) where lower; `None` where none can be read (then nothing is refused).
pub fn budget() -> Option<u64> {
    // SAFETY: sysconf reads a system value.
    let (pages, page) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    let physical = (pages > 0 && page > 0).then(|| (pages as u64).saturating_mul(page as u64));
    [physical, cgroup_limit(), address_space_limit()].into_iter().flatten().min().map(|m| m / 2)
}

/// The soft RLIMIT_AS of this process, when it has one.
fn address_space_limit() -> Option<u64> {
    let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct given.
    (unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut l) } == 0 && l.rlim_cur != libc::RLIM_INFINITY).then_some(l.rlim_cur)
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

/// The drive model's tables: each logical and physical unit mapped in 4 bytes, about 40 bytes
/// per RU.
pub fn drive_fits(size: u64, physical: u64, unit: u64, ru: u64, budget: Option<u64>, fix: &str) -> Result<(), String> {
    let units = size.div_ceil(unit.max(1)).saturating_add(physical.div_ceil(unit.max(1)));
    let need = units.saturating_mul(4).saturating_add(physical.div_ceil(ru.max(1)).saturating_mul(40));
    check(&format!("modelling a {size}-byte drive in {unit}-byte units"), need, budget, fix)
}
