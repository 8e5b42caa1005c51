//! Dropping the checkpoint header blocks of `/dev/ublkbN` from the page cache, so that a LMCache
//! opening the device reads them through fdpblk (the early tails' gate, `tails.rs`).

use super::*;

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
    /// Drops both containers' header blocks from the exported device's page cache, in each
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
        let res = (0..2u8).try_for_each(|c| self.drop_cached_range(g.container_offset(c), g.block_align));
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

    /// Drops the clean cached pages of `[off, off + len)` of the exported device (see
    /// [`WatchConfig::page_cache`]). Dirty pages stay: they hold LMCache's newer writes.
    pub(super) fn drop_cached(&mut self, off: u64, len: u64) -> bool {
        match self.drop_cached_range(off, len) {
            Ok(()) => true,
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

    fn drop_cached_range(&self, off: u64, len: u64) -> Result<(), (std::path::PathBuf, std::io::Error)> {
        use std::os::fd::AsRawFd;
        let Some(path) = &self.cfg.page_cache else { return Ok(()) };
        std::fs::File::open(path).and_then(|f| {
            // Whole pages: the kernel drops only pages entirely inside the range.
            let page = crate::device::page_size();
            let (start, end) = (off / page * page, off.saturating_add(len).div_ceil(page).saturating_mul(page));
            let (off, len) = (i64::try_from(start).unwrap_or(i64::MAX), i64::try_from(end - start).unwrap_or(i64::MAX));
            // SAFETY: a plain syscall on an open descriptor; it touches no memory of ours.
            match unsafe { libc::posix_fadvise(f.as_raw_fd(), off, len, libc::POSIX_FADV_DONTNEED) } {
                0 => Ok(()),
                e => Err(std::io::Error::from_raw_os_error(e)),
            }
        })
        .map_err(|e| (path.clone(), e))
    }
}
