//! `--backing-id`: the NVMe namespace a device must be added on, named by part of its
//! identity ([`NamespaceIdentity`]) rather than by a kernel name. `/dev/ng0n1` is the first
//! namespace the kernel found; after a reboot with a drive added, removed or found late it can
//! be another drive, and `fdpblk up` would hand that drive to LMCache to overwrite. A pin such
//! as `serial "S6X1NG0T123456" nsid 1` refuses it instead (what `up` suggests: an NGUID or
//! EUI64 can be the same on every unit of a model).
//!
//! The text is the identity's own (`fdpblk fdp status` prints it): `model "M"`, `serial "S"`,
//! `nsid N`, `nguid HEX`, `eui64 HEX`, in any order, any subset that names one namespace
//! (an NGUID, an EUI64, or a serial with its nsid). A leading `NVMe namespace ` (the saved
//! form in `fdpblk list --json`) is taken too.

use super::discover::NamespaceIdentity;
use std::fmt;

/// The fields a pin gives; each one given must equal the namespace's.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackingPin {
    pub model: Option<String>,
    pub serial: Option<String>,
    pub nsid: Option<u32>,
    pub nguid: Option<String>,
    pub eui64: Option<String>,
}

/// The fields of an identity, in the order its text gives them.
const FIELDS: [&str; 5] = ["model", "serial", "nsid", "nguid", "eui64"];

/// Whether a quoted value may end where `after` follows: at the end, or before a field.
fn closes(after: &str) -> bool {
    let next = after.trim_start();
    if next.is_empty() {
        return true;
    }
    after.starts_with(char::is_whitespace)
        && FIELDS.iter().any(|f| next.strip_prefix(f).is_some_and(|r| r.is_empty() || r.starts_with(char::is_whitespace)))
}

/// The most a pin's text may hold (an identity is under 200 bytes).
const MAX_LEN: usize = 1024;

const EXAMPLE: &str = "e.g. 'serial \"S6X1NG0T123456\" nsid 1', as `fdpblk fdp status DEV` prints it on its identity line (without FDP: `nvme id-ctrl DEV` `sn`, and the namespace's id)";

impl BackingPin {
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad = |why: String| format!("--backing-id {text:?}: {why}; {EXAMPLE}");
        if text.len() > MAX_LEN {
            return Err(format!("--backing-id: {} bytes, at most {MAX_LEN}; {EXAMPLE}", text.len()));
        }
        let mut rest = text.trim();
        rest = rest.strip_prefix("NVMe namespace ").unwrap_or(rest).trim_start();
        let mut pin = BackingPin::default();
        while !rest.is_empty() {
            let key_end = rest.find(char::is_whitespace).unwrap_or(rest.len());
            let key = &rest[..key_end];
            rest = rest[key_end..].trim_start();
            let (value, quoted) = if let Some(quoted) = rest.strip_prefix('"') {
                // A drive's model or serial may hold `"` and spaces (the identity's text does
                // not escape them): the closing quote is the first one the end, or a space and
                // a field's name, follows.
                let end = quoted
                    .match_indices('"')
                    .map(|(i, _)| i)
                    .find(|&i| closes(&quoted[i + 1..]))
                    .ok_or_else(|| bad(format!("the value of `{key}` has no closing \"")))?;
                rest = &quoted[end + 1..];
                (&quoted[..end], true)
            } else {
                let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
                let v = &rest[..end];
                rest = &rest[end..];
                (v, false)
            };
            // An empty model or serial is written `""`; a key left without a value is a typo.
            if value.is_empty() && !(quoted && matches!(key, "model" | "serial")) {
                return Err(bad(format!("`{key}` has no value")));
            }
            rest = rest.trim_start();
            // Also as udev's /dev/disk/by-id names show them (`eui.HEX`), and an NGUID in
            // UUID form.
            let hex = |digits: usize| {
                let v = value.strip_prefix("eui.").unwrap_or(value).replace('-', "").to_ascii_lowercase();
                if v.len() == digits && v.bytes().all(|b| b.is_ascii_hexdigit()) {
                    Ok(v)
                } else {
                    Err(bad(format!("`{key}` is {digits} hex digits, not {value:?}")))
                }
            };
            let twice = || bad(format!("`{key}` is given twice"));
            match key {
                "model" if pin.model.is_none() => pin.model = Some(value.to_string()),
                "serial" if pin.serial.is_none() => pin.serial = Some(value.to_string()),
                "nsid" if pin.nsid.is_none() => {
                    pin.nsid = Some(value.parse().ok().filter(|&n| n > 0).ok_or_else(|| bad(format!("`nsid` is a namespace id from 1, not {value:?}")))?)
                }
                "nguid" if pin.nguid.is_none() => pin.nguid = Some(hex(32)?),
                "eui64" if pin.eui64.is_none() => pin.eui64 = Some(hex(16)?),
                k if FIELDS.contains(&k) => return Err(twice()),
                k => return Err(bad(format!("unknown field `{k}`: use model, serial, nsid, nguid or eui64"))),
            }
        }
        // A model, or an nsid alone, fits every drive of a kind; a serial alone every
        // namespace of that drive.
        if pin.nguid.is_none() && pin.eui64.is_none() && (pin.serial.is_none() || pin.nsid.is_none()) {
            return Err(bad("names no single namespace: give its serial and nsid, or its nguid, or its eui64".into()));
        }
        Ok(pin)
    }

    /// None where `id` has every field the pin gives; else the first that differs, as
    /// `serial "A", not "B"` (the namespace's, then the pin's).
    pub fn mismatch(&self, id: &NamespaceIdentity) -> Option<String> {
        let text = |name: &str, want: &Option<String>, have: Option<&String>, quote: bool| -> Option<String> {
            let want = want.as_ref()?;
            let q = |v: &str| if quote { format!("\"{v}\"") } else { v.to_string() };
            match have {
                Some(h) if h == want => None,
                Some(h) => Some(format!("{name} {}, not {}", q(h), q(want))),
                None => Some(format!("no {name} (the drive reports none), not {}", q(want))),
            }
        };
        text("model", &self.model, Some(&id.model), true)
            .or_else(|| text("serial", &self.serial, Some(&id.serial), true))
            .or_else(|| self.nsid.filter(|&n| n != id.nsid).map(|n| format!("nsid {}, not {n}", id.nsid)))
            .or_else(|| text("nguid", &self.nguid, id.nguid.as_ref(), false))
            .or_else(|| text("eui64", &self.eui64, id.eui64.as_ref(), false))
    }
}

impl fmt::Display for BackingPin {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(v) = &self.model {
            parts.push(format!("model \"{v}\""));
        }
        if let Some(v) = &self.serial {
            parts.push(format!("serial \"{v}\""));
        }
        if let Some(v) = self.nsid {
            parts.push(format!("nsid {v}"));
        }
        if let Some(v) = &self.nguid {
            parts.push(format!("nguid {v}"));
        }
        if let Some(v) = &self.eui64 {
            parts.push(format!("eui64 {v}"));
        }
        f.write_str(&parts.join(" "))
    }
}

/// The pin a config file should carry for `id`: its serial and nsid. Every drive reports
/// them, and a serial is one drive's; some drives report the same NGUID or EUI64 on every
/// unit (Linux's `NVME_QUIRK_BOGUS_NID`), so those alone could name another drive.
pub fn suggested(id: &NamespaceIdentity) -> BackingPin {
    BackingPin { serial: Some(id.serial.clone()), nsid: Some(id.nsid), ..Default::default() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qemu() -> NamespaceIdentity {
        NamespaceIdentity { model: "QEMU NVMe Ctrl".into(), serial: "fdp0".into(), nsid: 1, nguid: None, eui64: None }
    }

    fn drive() -> NamespaceIdentity {
        NamespaceIdentity {
            model: "SAMSUNG MZWLO1T9HCJR-00A07".into(),
            serial: "S6X1NG0T123456".into(),
            nsid: 1,
            nguid: Some("36344830526001230025384500000001".into()),
            eui64: Some("0025388b91c3e4f1".into()),
        }
    }

    #[test]
    fn the_identitys_own_text_pins_it() {
        for id in [qemu(), drive()] {
            let pin = BackingPin::parse(&id.to_string()).unwrap();
            assert_eq!(pin.mismatch(&id), None, "{id}");
            assert_eq!(pin.to_string(), id.to_string());
            // The saved form, as `fdpblk list --json` shows it.
            assert_eq!(BackingPin::parse(&format!("NVMe namespace {id}")).unwrap(), pin);
        }
    }

    #[test]
    fn a_part_that_names_one_namespace_pins_it() {
        for text in ["serial \"S6X1NG0T123456\" nsid 1", "nsid 1 serial \"S6X1NG0T123456\"", "eui64 0025388B91C3E4F1", "  nguid 36344830526001230025384500000001 "] {
            assert_eq!(BackingPin::parse(text).unwrap().mismatch(&drive()), None, "{text}");
        }
        assert_eq!(BackingPin::parse("serial fdp0 nsid 1").unwrap().mismatch(&qemu()), None, "a serial without spaces needs no quotes");
        // As udev names them under /dev/disk/by-id, and an NGUID in UUID form.
        for text in ["eui64 eui.0025388b91c3e4f1", "nguid eui.36344830526001230025384500000001", "nguid 36344830-5260-0123-0025-384500000001"] {
            assert_eq!(BackingPin::parse(text).unwrap().mismatch(&drive()), None, "{text}");
        }
        // The saved form with more than one space after its prefix.
        assert_eq!(BackingPin::parse("NVMe namespace   serial fdp0 nsid 1").unwrap().mismatch(&qemu()), None);
    }

    /// A drive's model or serial is printable ASCII, `"` and spaces included, and the
    /// identity's text does not escape them: its own text still pins it.
    #[test]
    fn quotes_and_spaces_inside_a_serial_are_part_of_it() {
        for serial in ["a\"b", "a \"b\" c", "\"", ""] {
            let id = NamespaceIdentity { serial: serial.into(), ..qemu() };
            let pin = BackingPin::parse(&id.to_string()).unwrap();
            assert_eq!(pin.serial.as_deref(), Some(serial));
            assert_eq!(pin.mismatch(&id), None, "{id}");
            assert_eq!(BackingPin::parse(&suggested(&id).to_string()).unwrap(), suggested(&id));
        }
    }

    #[test]
    fn another_namespace_is_named_by_its_first_field_that_differs() {
        let pin = |t: &str| BackingPin::parse(t).unwrap();
        assert_eq!(pin("serial \"S6X1NG0T123456\" nsid 2").mismatch(&drive()).unwrap(), "nsid 1, not 2");
        assert_eq!(pin("serial \"other\" nsid 1").mismatch(&qemu()).unwrap(), "serial \"fdp0\", not \"other\"");
        assert_eq!(pin("eui64 0025388b91c3e4f2").mismatch(&drive()).unwrap(), "eui64 0025388b91c3e4f1, not 0025388b91c3e4f2");
        assert_eq!(
            pin("eui64 0025388b91c3e4f1").mismatch(&qemu()).unwrap(),
            "no eui64 (the drive reports none), not 0025388b91c3e4f1",
            "a drive that reports no EUI64 is not one pinned by it"
        );
        assert_eq!(pin("model \"QEMU NVMe Ctrl\" serial \"fdp0\" nsid 1").mismatch(&drive()).unwrap(), "model \"SAMSUNG MZWLO1T9HCJR-00A07\", not \"QEMU NVMe Ctrl\"");
    }

    #[test]
    fn a_pin_that_names_no_single_namespace_is_refused_with_an_example() {
        for (text, why) in [
            ("", "names no single namespace"),
            ("nsid 1", "names no single namespace"),
            ("serial \"fdp0\"", "names no single namespace"),
            ("model \"QEMU NVMe Ctrl\" nsid 1", "names no single namespace"),
            ("serial \"fdp0 nsid 1", "has no closing \""),
            ("serial \"fdp0\"nsid 1", "has no closing \""),
            ("nsid 1 serial", "`serial` has no value"),
            ("serial fdp0 nsid 0", "`nsid` is a namespace id from 1"),
            ("serial fdp0 nsid x", "`nsid` is a namespace id from 1"),
            ("serial fdp0 nsid", "`nsid` has no value"),
            ("eui64 0025388b91c3e4", "`eui64` is 16 hex digits"),
            ("nguid xyz", "`nguid` is 32 hex digits"),
            ("eui64 0025388b91c3e4f1 eui64 0025388b91c3e4f1", "`eui64` is given twice"),
            ("uuid 1234", "unknown field `uuid`"),
        ] {
            let e = BackingPin::parse(text).unwrap_err();
            assert!(e.starts_with("--backing-id ") && e.contains(why) && e.contains("fdpblk fdp status"), "{text}: {e}");
        }
        assert!(BackingPin::parse(&"a".repeat(MAX_LEN + 1)).unwrap_err().contains("at most 1024"));
    }

    #[test]
    fn the_suggested_pin_is_the_serial_and_nsid() {
        assert_eq!(suggested(&qemu()).to_string(), "serial \"fdp0\" nsid 1");
        // Not the NGUID or EUI64 alone: some drives report the same on every unit.
        assert_eq!(suggested(&drive()).to_string(), "serial \"S6X1NG0T123456\" nsid 1");
        let twin = NamespaceIdentity { serial: "S6X1NG0T999999".into(), ..drive() };
        assert!(suggested(&drive()).mismatch(&twin).is_some(), "a unit with the same bogus NGUID is not pinned");
    }
}
