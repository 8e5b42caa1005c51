//! `fdpblk add | recover | del | list | stats | features`: the device lifecycle, one file per
//! command (`add` with the facts about its backing beside it) and the daemon, the servers and
//! the printing they share.

mod add;
mod backing;
mod daemon;
mod del;
mod recover;
mod server;
mod status;

pub use add::{add, validate};
pub use daemon::note_inherited_fds;
pub use del::del;
pub use recover::recover;
pub(crate) use server::{exiting, serving_daemon, still_ours, ublk_stopped};
pub use status::{drive_deltas, features, id_of, list, name, stats};

/// Prints a line for the operator; `del` and `down` run under systemd's ExecStop with SIGPIPE
/// ignored, where a stream journald dropped must not turn a done stop into a panic.
pub(crate) fn say_out(line: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stdout(), "{line}");
}
/// [`say_out`] on standard error.
pub(crate) fn say_err(line: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{line}");
}
