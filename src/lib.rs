pub mod classify;
pub mod device;
pub mod engine;
pub mod layout;
pub mod pipeline;
pub mod place;
pub mod slot_table;
