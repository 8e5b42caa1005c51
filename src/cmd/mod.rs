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

/// Reads `r` as UTF-8 text of at most `max` bytes: a file given by mistake (a device, a
/// pipe that never ends) is refused at the bound instead of filling memory. `what` names
/// the input in errors.
pub fn read_text_at_most(r: impl std::io::Read, max: u64, what: &str) -> Result<String, String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    r.take(max + 1).read_to_end(&mut bytes).map_err(|e| format!("cannot read {what}: {e}"))?;
    if bytes.len() as u64 > max {
        return Err(format!("{what} is over {} KiB, more than any such file holds", max >> 10));
    }
    String::from_utf8(bytes).map_err(|e| format!("{what} is not UTF-8 text (byte {})", e.utf8_error().valid_up_to()))
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    #[test]
    fn text_past_the_bound_is_refused() {
        assert_eq!(super::read_text_at_most(&b"{}"[..], 2, "t").unwrap(), "{}");
        let e = super::read_text_at_most(std::io::repeat(b' ').take(1 << 20), 2048, "workload w").unwrap_err();
        assert!(e.starts_with("workload w is over 2 KiB"), "{e}");
        assert!(super::read_text_at_most(&[0xffu8][..], 8, "t").unwrap_err().contains("not UTF-8"));
    }
}
