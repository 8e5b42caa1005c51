//! The ublk frontend: exports `/dev/ublkbN` and serves each request through the pipeline
//! (classify → place) into a backing engine, with LBA identity (exported byte X = backing
//! byte X), so the backing device stays readable without fdpblk.

pub mod config;
pub mod learn;
pub mod queue;
pub mod state;
pub mod target;
pub mod ublk_run_dir;
