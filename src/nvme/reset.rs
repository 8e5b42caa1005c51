//! Controller resets, as the passthrough paths see them. The kernel retries no passthrough
//! command: a reset (error recovery, firmware activation, `nvme reset`) cancels the commands
//! in flight and, while it rebuilds the namespace, refuses new ones (EINVAL, EFAULT), also
//! for a moment after the controller is `live` again. The block path holds such I/O back;
//! fdpblk's passthrough users do the same with these rules: wait while the controller is not
//! live, then send the command again, and resend a kernel refusal for a short while.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// One wait between looks at the controller.
pub const TICK: Duration = Duration::from_millis(10);
/// How long a failed command waits for its controller to be live again: 30 s, the kernel's
/// default I/O timeout.
pub const WAIT_TICKS: u32 = 3000;
/// How long a command the kernel refused is sent again while the controller is live: 1 s.
/// A command that is really invalid fails this much later.
pub const LIVE_REFUSAL_TICKS: u32 = 100;

/// `/sys/class/nvme/nvmeX/state` of a namespace's controller.
#[derive(Clone, Debug)]
pub struct ControllerState(PathBuf);

impl ControllerState {
    /// The controller behind `dev` (`/dev/ngXnY` or `/dev/nvmeXnY`), if sysfs shows it.
    pub fn of(dev: &Path) -> Option<Self> {
        let p = Path::new("/sys/class/nvme").join(super::path::resolve(dev).ok()?.ctrl_name).join("state");
        p.exists().then_some(Self(p))
    }

    /// Serving I/O, or never again (`dead`, `deleting`): nothing to wait for. False only while
    /// the kernel brings the controller back (`resetting`, `connecting`, `new`); true when the
    /// state cannot be read.
    pub fn live(&self) -> bool {
        std::fs::read_to_string(&self.0).map_or(true, |s| !matches!(s.trim(), "resetting" | "connecting" | "new"))
    }
}

/// A failure (0 or a negative errno) the kernel made before the drive saw the command, of
/// the kinds a reset causes, or a cancellation. The drive's own statuses are not refusals.
pub fn kernel_refusal(res: i32) -> bool {
    res < 0 && matches!(-res, libc::EINVAL | libc::EFAULT | libc::EINTR | libc::EAGAIN | libc::EBUSY)
}

/// What to do after a failure, given the controller's state now and the ticks spent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hold {
    waited: u32,
    live_refused: u32,
}

impl Hold {
    /// Whether to wait a tick and send the command again after a failure `refusal`
    /// ([`kernel_refusal`]) with the controller `live` or not.
    pub fn again(&mut self, live: bool, refusal: bool) -> bool {
        if self.waited >= WAIT_TICKS {
            return false;
        }
        if live {
            if !refusal || self.live_refused >= LIVE_REFUSAL_TICKS {
                return false;
            }
            self.live_refused += 1;
        }
        self.waited += 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A controller that is gone (dead, being deleted) is not waited for as a reset is.
    #[test]
    fn only_a_controller_coming_back_is_waited_for() {
        let dir = std::env::temp_dir().join(format!("fdpblk-ctrl-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let c = ControllerState(dir.join("state"));
        for (state, live) in [("live", true), ("resetting", false), ("connecting", false), ("new", false), ("dead", true), ("deleting", true), ("deleting (no IO)", true)] {
            std::fs::write(&c.0, format!("{state}\n")).unwrap();
            assert_eq!(c.live(), live, "{state}");
        }
        std::fs::remove_file(&c.0).unwrap();
        assert!(c.live(), "unreadable: nothing to wait for");
        std::fs::remove_dir(&dir).unwrap();
    }

    #[test]
    fn refusals_are_told_from_drive_errors() {
        for e in [libc::EINVAL, libc::EFAULT, libc::EINTR, libc::EAGAIN, libc::EBUSY] {
            assert!(kernel_refusal(-e), "{e}");
        }
        assert!(!kernel_refusal(0) && !kernel_refusal(-libc::EIO) && !kernel_refusal(-libc::EACCES));
        assert!(!kernel_refusal(0x06 | 1 << 14));
    }

    #[test]
    fn a_failure_waits_for_the_controller_and_a_refusal_a_while_longer() {
        // Not live: any failure waits, up to the I/O timeout.
        let mut h = Hold::default();
        assert_eq!((0..WAIT_TICKS + 5).filter(|_| h.again(false, false)).count() as u32, WAIT_TICKS);
        // The wait is spent: nothing more, not even a refusal.
        assert!(!h.again(false, true) && !h.again(true, true));
        // Live: a drive error is final at once; a refusal is sent again for 1 s.
        let mut h = Hold::default();
        assert!(!h.again(true, false));
        assert_eq!((0..500).filter(|_| h.again(true, true)).count() as u32, LIVE_REFUSAL_TICKS);
        // ... while a controller that goes down again is still waited for.
        assert!(h.again(false, true));
    }
}
