pub mod blkparse;
pub mod classify;
pub mod cli;
pub mod cmd;
pub mod device;
pub mod engine;
pub mod frontend;
pub mod layout;
pub mod nvme;
pub mod persist;
pub mod pipeline;
pub mod place;
pub mod sim;
pub mod slot_table;
#[cfg(test)]
pub mod test_fixtures;
pub mod watch;
