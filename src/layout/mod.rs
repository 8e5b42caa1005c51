//! The LMCache `raw_block` on-disk layout: geometry, the two header formats, the checkpoint
//! JSON, key strings and slot identities, and reading checkpoints back from a device.
//!
//! Everything here is pure parsing of bytes LMCache wrote; nothing is written by these modules.
//! Facts: LMCache 0.5.6 `raw_block/core.py` and `key_codec.py` (see the project docs).

pub mod checkpoint;
pub mod checkpoint_header;
pub mod checkpoint_json;
pub mod discover;
pub mod geometry;
pub mod keys;
pub mod slot_header;

pub use geometry::{Geometry, GeometryConfig, GeometryError};
