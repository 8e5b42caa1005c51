//! The NVMe parsers (FDP log pages 0x20–0x23, RUH status, identify controller and
//! namespace, the active namespace list) on arbitrary bytes, as a drive could return them.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    fdpblk::nvme::fdp::every_parser(data);
});
