//! Dropping the checkpoint header blocks of `/dev/ublkbN` from the page cache, so that a LMCache
//! opening the device reads them through fdpblk (the early tails' gate, `tails.rs`), and
//! looking at what the page cache holds (`cachestat`).

use super::*;

/// What `cachestat` (Linux 6.5) reports of a range of a file's page cache, in pages.
#[repr(C)]
#[derive(Debug, Default)]
pub(super) struct CacheStat {
    pub(super) nr_cache: u64,
    pub(super) nr_dirty: u64,
    pub(super) nr_writeback: u64,
    pub(super) nr_evicted: u64,
    pub(super) nr_recently_evicted: u64,
}

/// The page cache of `[off, off + len)` of `f` (`len` 0: to the end). ENOSYS before
/// Linux 6.5.
pub(super) fn cachestat(f: &std::fs::File, off: u64, len: u64) -> std::io::Result<CacheStat> {
    use std::os::fd::AsRawFd;
    // Not in every libc build of these architectures, where it is 451 (not on alpha or mips).
    const SYS_CACHESTAT: libc::c_long = 451;
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    if !cfg!(any(
        target_arch = "x86_64",
        target_arch = "x86",
        target_arch = "aarch64",
        target_arch = "arm",
        target_arch = "riscv64",
        target_arch = "powerpc64",
        target_arch = "s390x",
        target_arch = "loongarch64"
    )) {
        return Err(std::io::Error::from_raw_os_error(libc::ENOSYS));
    }
    let range = Range { off, len };
    let mut st = CacheStat::default();
    // SAFETY: both pointers are to live, properly laid out structs for the duration of the call.
    let r = unsafe { libc::syscall(SYS_CACHESTAT, f.as_raw_fd(), &range as *const Range, &mut st as *mut CacheStat, 0u32) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st)
}

/// The exported device `path` is gone: a stop under way (the kernel removes the disk before
/// the stop reaches the state thread). It serves no reader, so a failed page-cache drop there
/// is not worth a warning; nothing that needs the drop goes ahead either way. A node missing
/// while the kernel still has the disk (a mount namespace without it) is a setup problem,
/// and warns.
fn node_gone(path: &std::path::Path, e: &std::io::Error) -> bool {
    let disk_gone = || path.file_name().is_none_or(|n| !std::path::Path::new("/sys/class/block").join(n).exists());
    matches!(e.raw_os_error(), Some(libc::ENXIO | libc::ENODEV)) || (e.kind() == std::io::ErrorKind::NotFound && disk_gone())
}

impl Watcher {
    /// Drops both containers' header blocks (with the metadata region around them:
    /// [`drop_window`]) from the exported device's page cache, in each
    /// early-tail round (once a second) while early tails or the pass for unwritten slots are
    /// on. A LMCache that opens the device reads them first; with buffered I/O its own
    /// earlier checkpoint writes leave them cached, and a read served from the cache never
    /// reaches fdpblk, which would miss the restart that holds early tails and the pass for
    /// unwritten slots back (`geometry_seen_at`). Pages written back within the last second,
    /// and dirty ones, stay cached until the next drop: a LMCache process starts in seconds.
    /// If the drop fails, those wait for LMCache's next checkpoint, as after a read.
    pub(super) fn drop_header_pages(&mut self) {
        if self.stopped || self.cfg.page_cache.is_none() || !self.cfg.trim || !(self.cfg.early_tails || self.cfg.reclaim) {
            return;
        }
        let g = self.geom;
        // The second finds nothing left where the first took the whole metadata region.
        let res = (0..2u8).try_for_each(|c| self.drop_cached_range(g.container_offset(c), g.block_align, false).map(|_| ()));
        if let Err((path, e)) = res {
            if self.geometry_seen_at.take().is_none() {
                return; // the gate is closed already
            }
            if node_gone(&path, &e) {
                tracing::debug!("device {}: {} is gone ({e}); early tails and the pass for unwritten slots wait for LMCache's next checkpoint", self.cfg.device, path.display());
            } else {
                tracing::warn!("device {}: dropping the checkpoint header blocks of {} from the page cache: {e}; a LMCache opening the device could go unseen, so early tails and the pass for unwritten slots wait for its next checkpoint", self.cfg.device, path.display());
            }
        }
    }

    /// Drops the cached pages of `[off, off + len)` of the exported device (see
    /// [`WatchConfig::page_cache`]); false unless none is left. The kernel leaves dirty pages
    /// and pages a process has mapped, silently: `cachestat` tells (where the kernel has
    /// none, before Linux 6.5, the drop is trusted).
    pub(super) fn drop_cached(&mut self, off: u64, len: u64) -> bool {
        match self.drop_cached_range(off, len, true) {
            Ok(Left { clean: 0, dirty: 0 }) => true,
            // LMCache's next checkpoint into that container, not yet written back: its header
            // write is on its way to fdpblk, which then learns the container anew.
            Ok(Left { clean: 0, dirty }) => {
                tracing::debug!("device {}: {dirty} pages of a zeroed checkpoint header block are dirty in the page cache (LMCache's next checkpoint on its way); no early deallocation rests on it", self.cfg.device);
                false
            }
            Ok(Left { clean, .. }) => {
                tracing::warn!("device {}: {clean} pages of a zeroed checkpoint header block stayed cached after the drop (mapped by a process?); a buffered reader may see its old bytes, so no early deallocation rests on it", self.cfg.device);
                false
            }
            Err((path, e)) if node_gone(&path, &e) => {
                tracing::debug!("device {}: {} is gone ({e}); no early deallocation rests on its page cache", self.cfg.device, path.display());
                false
            }
            Err((path, e)) => {
                tracing::warn!("device {}: dropping {} from the page cache: {e}; a buffered reader may see the zeroed checkpoint header's old bytes, so no early deallocation rests on it", self.cfg.device, path.display());
                false
            }
        }
    }

    /// Drops a checkpoint header block at `off` (`len` bytes) of the exported device from its
    /// page cache, with the pages that may share a folio with it ([`drop_window`]); with
    /// `verify`, what is left of the block's pages.
    fn drop_cached_range(&self, off: u64, len: u64, verify: bool) -> Result<Left, (std::path::PathBuf, std::io::Error)> {
        let Some(path) = &self.cfg.page_cache else { return Ok(Left::default()) };
        let window = drop_window(crate::device::page_size(), self.geom.data_base_offset(), off, len);
        let check = verify.then(|| off..off.saturating_add(len));
        std::fs::File::open(path).and_then(|f| drop_pages(&f, window, check)).map_err(|e| (path.clone(), e))
    }
}

/// Pages of a range left in the page cache after a drop.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Left {
    /// Clean ones: mapped by a process (the kernel skips those silently), or in a folio that
    /// reaches past what was dropped.
    clean: u64,
    /// Dirty or under writeback: written since, not yet on the drive.
    dirty: u64,
}

/// What to drop for `[off, off + len)`: the kernel drops only folios entirely inside the
/// range, and a block device's page cache holds large folios where readahead brought them in
/// (a LMCache reading a checkpoint, a probe of the device's first MiBs), up to
/// [`max_folio`]. Within the metadata region (which ends at `meta_end`): all of it, which
/// holds only LMCache's checkpoints, read only at its start, and on to the next whole folio
/// where the region's end is not one (a non-default `meta_total_bytes`), so that a folio
/// reaching past it goes too (that takes the start of slot 0's clean pages with it, a
/// re-read for a buffered reader). Elsewhere: the range's own pages (the check finds what
/// stays). The kernel first starts writeback of the window's dirty pages (and keeps them):
/// a buffered LMCache's checkpoint then reaches the drive within a second, ahead of the
/// dirty pages of the puts it lists (docs/waf.md, Limits).
fn drop_window(page: u64, meta_end: u64, off: u64, len: u64) -> std::ops::Range<u64> {
    let end = off.saturating_add(len);
    let own = off / page * page..end.div_ceil(page).saturating_mul(page);
    if end <= meta_end {
        let folio = max_folio(page);
        0..own.end.max(meta_end.div_ceil(folio).saturating_mul(folio))
    } else {
        own
    }
}

/// The largest folio the kernel's page cache makes with `page`-byte pages: a PMD (as many
/// pages as a page holds 8-byte entries, as on x86-64, arm64, riscv64 and loongarch64), at
/// most 2^11 pages (`MAX_PAGECACHE_ORDER`): 2 MiB with 4 KiB pages, 32 MiB with 16 KiB,
/// 128 MiB with 64 KiB. Where the kernel's is smaller (ppc64, s390x, no THP), more is dropped.
fn max_folio(page: u64) -> u64 {
    let pmd_order = (page / 8).max(1).ilog2().min(11);
    page << pmd_order
}

/// Drops `window` of `f` from the page cache (whole pages); with `check`, what is left of the
/// pages of that range. Clean pages left are dropped once more first: a dirty page whose
/// writeback the drop started may be clean by the check, and is no page a process maps.
fn drop_pages(f: &std::fs::File, window: std::ops::Range<u64>, check: Option<std::ops::Range<u64>>) -> std::io::Result<Left> {
    use std::os::fd::AsRawFd;
    let page = crate::device::page_size();
    let (o, l) = (i64::try_from(window.start).unwrap_or(i64::MAX), i64::try_from(window.end - window.start).unwrap_or(i64::MAX));
    let drop = || {
        // SAFETY: a plain syscall on an open descriptor; it touches no memory of ours.
        match unsafe { libc::posix_fadvise(f.as_raw_fd(), o, l, libc::POSIX_FADV_DONTNEED) } {
            0 => Ok(()),
            e => Err(std::io::Error::from_raw_os_error(e)),
        }
    };
    drop()?;
    let Some(v) = check else { return Ok(Left::default()) };
    let (start, end) = (v.start / page * page, v.end.div_ceil(page).saturating_mul(page));
    let left = || match cachestat(f, start, end - start) {
        Ok(st) => {
            let dirty = st.nr_dirty.saturating_add(st.nr_writeback).min(st.nr_cache);
            Ok(Left { clean: st.nr_cache - dirty, dirty })
        }
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => Ok(Left::default()),
        Err(e) => Err(std::io::Error::other(format!("cachestat after the drop: {e}"))),
    };
    match left()? {
        Left { clean: 1.., .. } => {
            drop()?;
            left()
        }
        l => Ok(l),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of four pages, read (cached), removed when dropped.
    struct CachedFile {
        path: std::path::PathBuf,
        f: std::fs::File,
    }

    impl Drop for CachedFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    /// On the filesystem beside the test binary, the build's disk (a tmpfs page is never
    /// dropped: it is the file).
    fn cached_file(tag: &str) -> CachedFile {
        use std::io::{Read, Write};
        let dir = std::env::current_exe().unwrap().parent().unwrap().to_path_buf();
        let path = dir.join(format!("fdpblk-page-cache-{tag}-{}", std::process::id()));
        let mut f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        let c = CachedFile { path, f: f.try_clone().unwrap() };
        f.write_all(&vec![7u8; 4 * crate::device::page_size() as usize]).unwrap();
        f.sync_all().unwrap();
        let mut b = Vec::new();
        std::fs::File::open(&c.path).unwrap().read_to_end(&mut b).unwrap();
        c
    }

    #[test]
    fn a_drop_is_verified_and_a_page_left_mapped_fails_it() {
        let page = crate::device::page_size();
        let file = cached_file("verify");
        let f = &file.f;
        match cachestat(f, 0, 0) {
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                // Before Linux 6.5: the drop is trusted.
                assert!(std::env::var_os("CI").is_none(), "CI's kernel has no cachestat (Linux 6.5): this test checked nothing");
                return;
            }
            Ok(st) if st.nr_cache == 0 => {
                // A filesystem without a page cache of its own (9p, virtiofs).
                assert!(std::env::var_os("CI").is_none(), "the build's filesystem keeps nothing in the page cache: this test checked nothing");
                return;
            }
            r => assert!(r.unwrap().nr_cache > 0),
        }
        // The file stands for a metadata region of four pages.
        let meta_end = 4 * page;
        assert_eq!(drop_pages(f, drop_window(page, meta_end, page, 512), Some(page..page + 512)).unwrap(), Left::default(), "a clean page is dropped");
        assert_eq!(cachestat(f, 0, 0).unwrap().nr_cache, 0, "with the folio it may share");
        // A page a process maps stays (posix_fadvise skips it silently): the check says so.
        use std::os::fd::AsRawFd;
        // SAFETY: a shared read-only mapping of one page of an open file, unmapped below.
        let m = unsafe { libc::mmap(std::ptr::null_mut(), page as usize, libc::PROT_READ, libc::MAP_SHARED, f.as_raw_fd(), 2 * page as libc::off_t) };
        assert_ne!(m, libc::MAP_FAILED);
        // SAFETY: reads the first byte of the live mapping (faults the page in).
        assert_eq!(unsafe { std::ptr::read_volatile(m as *const u8) }, 7);
        let at = 2 * page..2 * page + 512;
        assert_eq!(drop_pages(f, drop_window(page, meta_end, at.start, 512), Some(at.clone())).unwrap(), Left { clean: 1, dirty: 0 }, "a mapped page stays cached");
        // SAFETY: the mapping made above, not used after.
        unsafe { libc::munmap(m, page as usize) };
        assert_eq!(drop_pages(f, drop_window(page, meta_end, at.start, 512), Some(at.clone())).unwrap(), Left::default(), "dropped once unmapped");
        // A page written since and not yet written back stays, as dirty.
        use std::os::unix::fs::FileExt;
        f.write_all_at(&[1u8; 512], at.start).unwrap();
        let left = drop_pages(f, drop_window(page, meta_end, at.start, 512), Some(at)).unwrap();
        // (The drop starts its writeback; one done before the check is dropped again.)
        assert!(left.clean == 0 && left.dirty == 1 || left == Left::default(), "a dirty page stays as dirty, unless written back already: {left:?}");
    }

    #[test]
    fn the_drop_takes_the_metadata_region_around_a_header() {
        let (page, folio) = (4096, 2 << 20);
        assert_eq!(max_folio(page), folio);
        assert_eq!((max_folio(16 << 10), max_folio(64 << 10)), (32 << 20, 128 << 20));
        let meta = 1 << 30;
        assert_eq!(drop_window(page, meta, 0, 4096), 0..meta);
        assert_eq!(drop_window(page, meta, meta / 2, 4096), 0..meta);
        // A region's end that is not a whole folio: on to the next, where a folio reaching
        // past the end ends.
        assert_eq!(drop_window(page, meta + 512 * 1024, 4096, 4096), 0..meta + folio);
        assert_eq!(drop_window(page, 8 * page + 512, 4 * page, 512), 0..folio);
        assert_eq!(drop_window(64 << 10, meta + (64 << 10), 0, 4096), 0..meta + (128 << 20));
        // Outside it: the range's own pages.
        assert_eq!(drop_window(page, meta, meta + 100, 4096), meta..meta + 8192);
        assert_eq!(drop_window(page, meta, meta, 4096), meta..meta + page);
    }
}
