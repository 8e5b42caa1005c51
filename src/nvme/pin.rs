//! `--backing-id`: the NVMe namespace a device must be added on, named by part of its
//! identity ([`NamespaceIdentity`]) rather than by a kernel name. `/dev/ng0n1` is the first
//! namespace the kernel found; after a reboot with a drive added, removed or found late it can
//! be another drive, and `fdpblk up` would hand that drive to LMCache to overwrite. A pin such
//! as `serial "S6X1NG0T123456" nsid 1` or `eui64 0025388b91c3e4f1` refuses it instead.
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

/// The most a pin's text may hold (an identity is under 200 bytes).
const MAX_LEN: usize = 1024;

const EXAMPLE: &str = "e.g. 'serial \"S6X1NG0T123456\" nsid 1', as `fdpblk fdp status DEV` prints it on its identity line";

impl BackingPin {
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad = |why: String| format!("--backing-id {text:?}: {why}; {EXAMPLE}");
        if text.len() > MAX_LEN {
            return Err(format!("--backing-id: {} bytes, at most {MAX_LEN}; {EXAMPLE}", text.len()));
        }
        let mut rest = text.trim();
        rest = rest.strip_prefix("NVMe namespace ").unwrap_or(rest);
        let mut pin = BackingPin::default();
        while !rest.is_empty() {
            let key_end = rest.find(char::is_whitespace).unwrap_or(rest.len());
            let key = &rest[..key_end];
            rest = rest[key_end..].trim_start();
            let value = if let Some(quoted) = rest.strip_prefix('"') {
                let end = quoted.find('"').ok_or_else(|| bad(format!("the value of `{key}` has no closing \"")))?;
                rest = &quoted[end + 1..];
                &quoted[..end]
            } else {
                let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
                let v = &rest[..end];
                rest = &rest[end..];
                v
            };
            if value.is_empty() && !matches!(key, "model" | "serial") {
                return Err(bad(format!("`{key}` has no value")));
            }
            if !rest.is_empty() && !rest.starts_with(char::is_whitespace) {
                return Err(bad(format!("put a space after the value of `{key}`")));
            }
            rest = rest.trim_start();
            let hex = |digits: usize| {
                let v = value.to_ascii_lowercase();
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
                "model" | "serial" | "nsid" | "nguid" | "eui64" => return Err(twice()),
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

    /// The pin as a line of a config file: a TOML literal string (its quotes stay as they
    /// are), or a basic one with escapes where the text holds a `'`.
    pub fn config_line(&self) -> String {
        let text = self.to_string();
        if text.contains('\'') || text.contains(char::is_control) {
            let escaped: String = text.chars().map(|c| match c {
                '"' | '\\' => format!("\\{c}"),
                c if c.is_control() => format!("\\u{:04x}", c as u32),
                c => c.to_string(),
            }).collect();
            format!("backing_id = \"{escaped}\"")
        } else {
            format!("backing_id = '{text}'")
        }
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

/// The pin a config file should carry for `id`: its NGUID or EUI64 where the drive reports
/// one (they stay with the namespace), else its serial and nsid.
pub fn suggested(id: &NamespaceIdentity) -> BackingPin {
    match (&id.nguid, &id.eui64) {
        (Some(g), _) => BackingPin { nguid: Some(g.clone()), ..Default::default() },
        (None, Some(e)) => BackingPin { eui64: Some(e.clone()), ..Default::default() },
        (None, None) => BackingPin { serial: Some(id.serial.clone()), nsid: Some(id.nsid), ..Default::default() },
    }
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
            ("serial \"fdp0\"nsid 1", "put a space after the value of `serial`"),
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
    fn the_suggested_pin_is_the_most_lasting_field_the_drive_reports() {
        assert_eq!(suggested(&qemu()).to_string(), "serial \"fdp0\" nsid 1");
        assert_eq!(suggested(&drive()).to_string(), "nguid 36344830526001230025384500000001");
        let eui_only = NamespaceIdentity { nguid: None, ..drive() };
        assert_eq!(suggested(&eui_only).to_string(), "eui64 0025388b91c3e4f1");
        assert_eq!(suggested(&qemu()).config_line(), r#"backing_id = 'serial "fdp0" nsid 1'"#);
        let odd = NamespaceIdentity { serial: "it's \\ 1".into(), ..qemu() };
        for id in [qemu(), drive(), eui_only, odd] {
            let pin = suggested(&id);
            assert_eq!(pin.mismatch(&id), None);
            // The line a warning suggests reads back, through the config file's parser, as this pin.
            let file: toml::Table = pin.config_line().parse().unwrap();
            assert_eq!(BackingPin::parse(file["backing_id"].as_str().unwrap()).unwrap(), pin, "{}", pin.config_line());
        }
    }
}
