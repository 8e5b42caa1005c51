//! The commands behind the CLI. Each returns a one-line error that names the fix.

pub mod config_file;
pub mod daemon_log;
pub mod device;
pub mod fdp;
pub mod inspect;
pub mod metrics;
pub mod plot;
pub mod replay;
pub mod simulate;
pub mod up;

pub type CmdResult = Result<(), Box<dyn std::error::Error>>;
