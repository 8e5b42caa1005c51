//! The Linux NVMe passthrough ioctls (uapi `linux/nvme_ioctl.h`), with safe wrappers that
//! tie the command's data pointer to a Rust buffer.
//!
//! `NVME_IOCTL_ADMIN_CMD` works on the controller (`/dev/nvmeX`) and on namespace devices;
//! `NVME_IOCTL_IO_CMD` on `/dev/nvmeXnY` and `/dev/ngXnY`. Both return 0 on success, a
//! positive NVMe status when the drive failed the command, or −1 with errno.

use super::cmd::{NvmeStatus, PassthruCmd};
use std::fmt;
use std::io;
use std::os::fd::AsRawFd;

/// `_IO('N', 0x40)`: returns the namespace id of the open namespace device.
pub const NVME_IOCTL_ID: u32 = 0x4E40;
/// `_IOWR('N', 0x41, struct nvme_passthru_cmd)`.
pub const NVME_IOCTL_ADMIN_CMD: u32 = 0xC048_4E41;
/// `_IOWR('N', 0x43, struct nvme_passthru_cmd)`.
pub const NVME_IOCTL_IO_CMD: u32 = 0xC048_4E43;
/// `_IOWR('N', 0x80, struct nvme_uring_cmd)`: the `cmd_op` of an io_uring passthrough I/O.
pub const NVME_URING_CMD_IO: u32 = 0xC048_4E80;
/// `_IOWR('N', 0x81, struct nvme_uring_cmd)`: `addr` points to an iovec array, `data_len` is
/// its length.
pub const NVME_URING_CMD_IO_VEC: u32 = 0xC048_4E81;
/// `_IOWR('N', 0x82, struct nvme_uring_cmd)`.
pub const NVME_URING_CMD_ADMIN: u32 = 0xC048_4E82;

const _: () = assert!(NVME_IOCTL_ADMIN_CMD == ioc_rw(0x41, 72));
const _: () = assert!(NVME_IOCTL_IO_CMD == ioc_rw(0x43, 72));
const _: () = assert!(NVME_URING_CMD_IO == ioc_rw(0x80, 72));

/// `_IOWR('N', nr, size)` on the generic ioctl encoding (x86, arm64, riscv).
const fn ioc_rw(nr: u32, size: u32) -> u32 {
    (3 << 30) | (size << 16) | ((b'N' as u32) << 8) | nr
}

/// The data a command moves.
pub enum Data<'a> {
    None,
    /// The drive writes into the buffer (read, identify, log pages).
    FromDevice(&'a mut [u8]),
    /// The drive reads the buffer (write, DSM ranges).
    ToDevice(&'a [u8]),
}

/// A passthrough command that did not succeed.
#[derive(Debug)]
pub enum PassthruError {
    /// The ioctl failed (errno): permissions, not an NVMe device, bad arguments.
    Os(io::Error),
    /// The drive completed the command with an error status.
    Status(NvmeStatus),
}

impl PassthruError {
    /// errno EACCES/EPERM.
    pub fn is_permission(&self) -> bool {
        matches!(self, PassthruError::Os(e) if e.kind() == io::ErrorKind::PermissionDenied)
    }
    /// errno ENOTTY on the ioctl itself: the file is not an NVMe device (EINVAL is not taken
    /// for it: an NVMe device returns it for a command it refuses).
    pub fn is_not_nvme(&self) -> bool {
        matches!(self, PassthruError::Os(e) if e.raw_os_error() == Some(libc::ENOTTY))
    }
}

impl fmt::Display for PassthruError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PassthruError::Os(e) => write!(f, "{e}"),
            PassthruError::Status(s) => write!(f, "{s}"),
        }
    }
}

impl std::error::Error for PassthruError {}

fn submit(fd: &impl AsRawFd, request: u32, mut cmd: PassthruCmd, data: Data<'_>) -> Result<u32, PassthruError> {
    cmd.metadata = 0;
    cmd.metadata_len = 0;
    cmd.result = 0;
    match data {
        Data::None => {
            cmd.addr = 0;
            cmd.data_len = 0;
        }
        Data::FromDevice(b) => bind(&mut cmd, b.as_mut_ptr() as u64, b.len())?,
        Data::ToDevice(b) => bind(&mut cmd, b.as_ptr() as u64, b.len())?,
    }
    // SAFETY: `cmd` is a valid `struct nvme_passthru_cmd`; its data pointer refers to a live
    // buffer of at least `data_len` bytes (checked in `bind`), borrowed for this call, and it
    // has no metadata pointer. The kernel writes only into `cmd` and that buffer.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, &mut cmd as *mut PassthruCmd) };
    match rc {
        r if r < 0 => Err(PassthruError::Os(io::Error::last_os_error())),
        r => completed(r as u16, cmd.result),
    }
}

/// A completion's status and result, success as [`NvmeStatus::succeeded`] says (as on the
/// io_uring path).
fn completed(status: u16, result: u32) -> Result<u32, PassthruError> {
    let s = NvmeStatus(status);
    if s.succeeded() {
        Ok(result)
    } else {
        Err(PassthruError::Status(s))
    }
}

fn bind(cmd: &mut PassthruCmd, addr: u64, len: usize) -> Result<(), PassthruError> {
    let len32 = u32::try_from(len).unwrap_or(u32::MAX);
    if cmd.data_len == 0 {
        cmd.data_len = len32;
    } else if cmd.data_len > len32 {
        return Err(PassthruError::Os(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("command moves {} bytes, buffer has {len}", cmd.data_len),
        )));
    }
    cmd.addr = addr;
    Ok(())
}

/// Sends an admin command (synchronously); returns the result (DW0).
pub fn admin(fd: &impl AsRawFd, cmd: PassthruCmd, data: Data<'_>) -> Result<u32, PassthruError> {
    submit(fd, NVME_IOCTL_ADMIN_CMD, cmd, data)
}

/// Sends an I/O command to a namespace device (synchronously); returns the result (DW0).
pub fn io(fd: &impl AsRawFd, cmd: PassthruCmd, data: Data<'_>) -> Result<u32, PassthruError> {
    submit(fd, NVME_IOCTL_IO_CMD, cmd, data)
}

/// The namespace id of an open `/dev/nvmeXnY` or `/dev/ngXnY`.
pub fn namespace_id(fd: &impl AsRawFd) -> io::Result<u32> {
    // SAFETY: NVME_IOCTL_ID takes no argument.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), NVME_IOCTL_ID as _) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_numbers() {
        assert_eq!(NVME_IOCTL_ADMIN_CMD, 0xC0484E41);
        assert_eq!(NVME_IOCTL_IO_CMD, 0xC0484E43);
        assert_eq!(NVME_URING_CMD_IO, 0xC0484E80);
        assert_eq!(NVME_URING_CMD_IO_VEC, 0xC0484E81);
        assert_eq!(NVME_URING_CMD_ADMIN, 0xC0484E82);
        assert_eq!(NVME_IOCTL_ID, 0x4E40);
    }

    #[test]
    fn not_an_nvme_device() {
        let f = std::fs::File::open("/dev/null").unwrap();
        let e = admin(&f, super::super::cmd::identify(1, 0), Data::FromDevice(&mut [0u8; 4096])).unwrap_err();
        assert!(e.is_not_nvme(), "{e:?}");
        assert!(namespace_id(&f).is_err());
        let mut short = [0u8; 16];
        let e = admin(&f, super::super::cmd::identify(1, 0), Data::FromDevice(&mut short)).unwrap_err();
        assert!(matches!(e, PassthruError::Os(ref x) if x.kind() == io::ErrorKind::InvalidInput), "{e:?}");
    }

    /// A Successful Completion with its More or Do Not Retry bit set is a success, as on the
    /// io_uring path; any other status code fails.
    #[test]
    fn a_successful_completion_with_flag_bits_is_a_success() {
        assert_eq!(completed(0, 7).unwrap(), 7);
        assert_eq!(completed(0x2000, 7).unwrap(), 7, "More");
        assert_eq!(completed(0x4000, 7).unwrap(), 7, "Do Not Retry");
        assert!(matches!(completed(0x281, 7), Err(PassthruError::Status(s)) if s.code() == 0x281));
        assert!(matches!(completed(0x4002, 7), Err(PassthruError::Status(s)) if s.code() == 0x002));
    }
}
