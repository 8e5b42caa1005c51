//! A device or image that fdpblk reads LMCache's layout from: positional reads and a size.
//! Block devices report their size with `BLKGETSIZE64`; files and images with their length.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::Path;

/// Positional, shared-reference reads (`pread`), so readers need no seek state.
pub trait ReadAt {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    fn size(&self) -> io::Result<u64>;

    /// Reads exactly `buf.len()` bytes or fails with `UnexpectedEof`.
    fn read_exact_at(&self, mut buf: &mut [u8], mut offset: u64) -> io::Result<()> {
        while !buf.is_empty() {
            match self.read_at(buf, offset) {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end of the device")),
                Ok(n) => {
                    buf = &mut buf[n..];
                    offset += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

impl ReadAt for File {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        FileExt::read_at(self, buf, offset)
    }
    fn size(&self) -> io::Result<u64> {
        let meta = self.metadata()?;
        if meta.file_type().is_block_device() {
            block_device_size(self)
        } else {
            Ok(meta.len())
        }
    }
}

impl ReadAt for [u8] {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let start = usize::try_from(offset).unwrap_or(usize::MAX).min(self.len());
        let n = buf.len().min(self.len() - start);
        buf[..n].copy_from_slice(&self[start..start + n]);
        Ok(n)
    }
    fn size(&self) -> io::Result<u64> {
        Ok(self.len() as u64)
    }
}

impl ReadAt for Vec<u8> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.as_slice().read_at(buf, offset)
    }
    fn size(&self) -> io::Result<u64> {
        Ok(self.len() as u64)
    }
}

/// `ioctl(BLKDISCARD)` of `[off, off + len)` on a block device: Dataset Management deallocate
/// on NVMe (a TRIM). On anything but a block device it fails (ENOTTY).
pub fn blkdiscard(fd: std::os::fd::RawFd, off: u64, len: u64) -> std::io::Result<()> {
    const BLKDISCARD: libc::c_ulong = 0x1277;
    let range = [off, len];
    // SAFETY: BLKDISCARD reads two u64 through the pointer, which outlives the call.
    match unsafe { libc::ioctl(fd, BLKDISCARD as _, range.as_ptr()) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// This machine's memory (`MemTotal`), in bytes.
pub fn mem_total_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = info.lines().find_map(|l| l.strip_prefix("MemTotal:"))?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()?;
    kib.checked_mul(1024)
}

/// The logical block size of a block device (BLKSSZGET); 512 when it cannot be read.
pub fn logical_block_bytes(f: &File) -> u64 {
    use std::os::fd::AsRawFd;
    const BLKSSZGET: libc::c_ulong = 0x1268;
    let mut ssz: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int through the pointer.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), BLKSSZGET as _, &mut ssz as *mut libc::c_int) };
    if rc == 0 && ssz >= 512 {
        ssz as u64
    } else {
        512
    }
}

/// The alignment a regular file's O_DIRECT offsets and lengths need (statx `STATX_DIOALIGN`,
/// Linux >= 6.1), at least 512; where the kernel does not say, the larger of the smallest
/// block of 512 to 4096 an O_DIRECT read takes ([`probe_dio_block_bytes`]) and the logical
/// block of the disk the file system is on (a read of a hole skips the alignment check, and
/// a new backing file is mostly holes); 512 where neither is known.
pub fn file_dio_block_bytes(f: &File) -> u64 {
    use std::os::fd::AsRawFd;
    const STATX_DIOALIGN: u32 = 0x2000;
    // SAFETY: statx fills the zeroed struct; an empty path with AT_EMPTY_PATH names the fd.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statx(f.as_raw_fd(), c"".as_ptr(), libc::AT_EMPTY_PATH, STATX_DIOALIGN, &mut st) };
    if rc != 0 || st.stx_mask & STATX_DIOALIGN == 0 {
        let disk = f.metadata().ok().and_then(|m| disk_logical_block_bytes(std::os::unix::fs::MetadataExt::dev(&m)));
        return probe_dio_block_bytes(f).unwrap_or(512).max(disk.unwrap_or(512));
    }
    u64::from(st.stx_dio_offset_align).max(512)
}

/// The logical block size of the disk holding device number `dev` (a file system's `st_dev`;
/// a partition's disk), from sysfs; None for a device without a queue (tmpfs, btrfs's
/// anonymous devices, overlay).
pub fn disk_logical_block_bytes(dev: u64) -> Option<u64> {
    let dir = sysfs_block_dir(dev)?;
    let disk = if dir.join("partition").exists() { dir.parent()?.to_path_buf() } else { dir };
    std::fs::read_to_string(disk.join("queue/logical_block_size")).ok()?.trim().parse().ok().filter(|&b: &u64| b >= 512 && b.is_power_of_two())
}

/// The smallest block of 512 to 4096 bytes at which an O_DIRECT read of `f` (reopened so)
/// is not refused as misaligned (EINVAL); None where it cannot be opened so, or every read
/// fails otherwise. A file on a 4 KiB-sector disk needs 4096 on a kernel too old to say.
pub fn probe_dio_block_bytes(f: &File) -> Option<u64> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let d = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(format!("/proc/self/fd/{}", f.as_raw_fd())).ok()?;
    let mut buf = crate::persist::dev::AlignedBuf::zeroed(4096);
    for b in [512u64, 1024, 2048, 4096] {
        match FileExt::read_at(&d, &mut buf[..b as usize], b) {
            Ok(_) => return Some(b),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => continue,
            Err(_) => return None,
        }
    }
    None
}

/// The whole blocks of `block` bytes inside `[off, off + len)`, as (offset, length): a
/// deallocation must never reach past what it was asked to drop, even by a partial block at
/// either end. None when no whole block fits.
pub fn whole_blocks_within(off: u64, len: u64, block: u64) -> Option<(u64, u64)> {
    let block = block.max(1);
    let start = off.checked_next_multiple_of(block)?;
    let end = off.checked_add(len)? / block * block;
    (end > start).then(|| (start, end - start))
}

pub fn block_device_size(f: &File) -> io::Result<u64> {
    use std::os::fd::AsRawFd;
    // _IOR(0x12, 114, size_t), whose size field is size_t's; not exported by the libc crate.
    const BLKGETSIZE64: libc::c_ulong = 0x8000_1272 | (std::mem::size_of::<usize>() as libc::c_ulong) << 16;
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which outlives the call.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), BLKGETSIZE64 as _, &mut size as *mut u64) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

/// Opens a device or image read-only, with an error that names the path. A block device's
/// cached pages are dropped first where writes may bypass them: a running fdpblk's
/// passthrough writes to a namespace go through its char node, so its block device's cache
/// could show old checkpoints. Not a ublk device's: every write to it goes through it (a
/// direct one invalidates what it covers), and dropping its cache would first write back
/// whatever LMCache's buffered I/O left dirty, all of it, at once.
pub fn open_readonly(path: &Path) -> io::Result<File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let f = File::open(path).map_err(|e| io::Error::new(e.kind(), format!("cannot open {}: {e}", path.display())))?;
    let Ok(m) = f.metadata() else { return Ok(f) };
    let name = sysfs_block_dir(m.rdev()).and_then(|d| Some(d.file_name()?.to_str()?.to_string()));
    if m.file_type().is_block_device() && !is_ublk_name(&name.unwrap_or_default()) {
        // SAFETY: advice on an owned descriptor; a failure only leaves the cache as it was.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
    Ok(f)
}

/// Whether this process runs as root (effective uid 0): what it then creates and reads needs
/// guarding against other accounts.
pub fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    (unsafe { libc::geteuid() }) == 0
}

/// The system's page size.
pub fn page_size() -> u64 {
    // SAFETY: sysconf has no memory effects.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

/// Block device `rdev`'s sysfs directory (its file name is the kernel's name of it:
/// `nvme0n1`, `ublkb0p1`).
pub fn sysfs_block_dir(rdev: u64) -> Option<std::path::PathBuf> {
    std::fs::canonicalize(format!("/sys/dev/block/{}:{}", libc::major(rdev), libc::minor(rdev))).ok()
}

/// Whether a block device's kernel name is a ublk device's (`ublkbN`, or a partition of one).
fn is_ublk_name(name: &str) -> bool {
    name.strip_prefix("ublkb").and_then(|r| r.bytes().next()).is_some_and(|b| b.is_ascii_digit())
}

/// Adapts a region of a `ReadAt` to `std::io::Read`, for the streaming JSON parser.
pub struct RegionReader<'a, D: ReadAt + ?Sized> {
    dev: &'a D,
    pos: u64,
    end: u64,
}

impl<'a, D: ReadAt + ?Sized> RegionReader<'a, D> {
    pub fn new(dev: &'a D, offset: u64, len: u64) -> Self {
        Self { dev, pos: offset, end: offset.saturating_add(len) }
    }
}

impl<D: ReadAt + ?Sized> io::Read for RegionReader<'_, D> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.end - self.pos;
        if left == 0 {
            return Ok(0);
        }
        let n = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let got = self.dev.read_at(&mut buf[..n], self.pos)?;
        if got == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "device ended inside a checkpoint payload"));
        }
        self.pos += got as u64;
        Ok(got)
    }
}

#[cfg(test)]
mod tests {
    use super::{file_dio_block_bytes, whole_blocks_within};

    #[test]
    fn a_file_says_its_direct_io_alignment() {
        let path = std::env::temp_dir().join(format!("fdpblk-dio-{}", std::process::id()));
        std::fs::write(&path, vec![0u8; 1 << 16]).unwrap();
        let f = std::fs::File::open(&path).unwrap();
        let b = file_dio_block_bytes(&f);
        assert!(b >= 512 && b.is_power_of_two(), "{b}");
        // What a kernel before 6.1 finds by trying (where the file system takes O_DIRECT),
        // and the disk's logical block below it: neither above what statx says.
        if let Some(p) = super::probe_dio_block_bytes(&f) {
            assert_eq!(p, b.min(4096), "the probe finds what statx says");
        }
        let dev = std::os::unix::fs::MetadataExt::dev(&f.metadata().unwrap());
        if let Some(d) = super::disk_logical_block_bytes(dev) {
            assert!(d <= b, "the disk's {d}-byte blocks, statx {b}");
        }
        // Where the file system takes O_DIRECT, a read of one such block at that offset works.
        use std::os::unix::fs::{FileExt, OpenOptionsExt};
        if let Ok(d) = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&path) {
            let mut buf = crate::persist::dev::AlignedBuf::zeroed(8192);
            assert_eq!(d.read_at(&mut buf[..b as usize], b).unwrap(), b as usize);
        }
        std::fs::remove_file(path).ok();
    }

    /// Only a ublk device (or a partition of one) keeps its cache when opened read-only.
    #[test]
    fn ublk_devices_are_told_by_their_kernel_name() {
        for (name, ublk) in [("ublkb0", true), ("ublkb12p1", true), ("ublkc0", false), ("ublkb", false), ("nvme0n1", false), ("sda", false), ("", false)] {
            assert_eq!(super::is_ublk_name(name), ublk, "{name}");
        }
    }

    #[test]
    fn deallocations_stay_inside_their_range() {
        // A stale tail starting 512 B into a 4 KiB block: that block still holds payload.
        assert_eq!(whole_blocks_within(4096 + 512, 3 * 4096 - 512, 4096), Some((8192, 8192)));
        assert_eq!(whole_blocks_within(8192, 8192, 4096), Some((8192, 8192)));
        assert_eq!(whole_blocks_within(100, 4000, 4096), None);
        assert_eq!(whole_blocks_within(4096, 4095, 4096), None);
        assert_eq!(whole_blocks_within(7, 10, 1), Some((7, 10)));
        assert_eq!(whole_blocks_within(u64::MAX - 10, 5, 4096), None);
        assert_eq!(whole_blocks_within(u64::MAX - 4096, 4096, 4096), None);
    }
}
