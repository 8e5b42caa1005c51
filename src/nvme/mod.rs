//! NVMe Flexible Data Placement: command encodings for the passthrough engines, the Linux
//! passthrough ioctls, parsers for the FDP log pages and the RUH status, and discovery of a
//! namespace's FDP setup.
//!
//! - [`cmd`]: the 72-byte passthrough command (ioctl and io_uring) and its builders: read,
//!   write with placement, flush, DSM deallocate, write zeroes, RUH status/update, Get Log
//!   Page, Identify, Get Features.
//! - [`ioctl`]: `NVME_IOCTL_ADMIN_CMD`, `NVME_IOCTL_IO_CMD`, `NVME_IOCTL_ID` and the io_uring
//!   `cmd_op` values.
//! - [`fdp`]: parsers for logs 0x20–0x23, the RUH status and the FDP feature, panic-free on
//!   any input.
//! - [`identify`]: the Identify Controller / Namespace fields fdpblk uses.
//! - [`path`]: from `/dev/nvme0n1`, `/dev/ng0n1` or `/dev/nvme0` to the controller and names.
//! - [`discover`]: [`NvmeDevice`] (single queries), [`FdpInfo::discover`] and a namespace's
//!   identity.
//! - [`pin`]: `--backing-id`, the namespace a device must be added on, by its identity.
//! - [`reset`]: waiting out controller resets on the passthrough paths.

pub mod cmd;
pub mod discover;
pub mod fdp;
pub mod identify;
pub mod ioctl;
pub mod path;
pub mod pin;
pub mod reset;

#[cfg(test)]
mod fixtures;

pub use discover::{FdpInfo, NvmeDevice, NvmeError};
