//! The `fdpblk` binary as a user runs it: inspect and replay on real LMCache images, and clear
//! one-line errors on bad input.

use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/lmcache-0.5.6")
}

fn fdpblk(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fdpblk")).args(args).output().expect("run fdpblk");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn inspect_json_matches_manifest() {
    for scen in ["legacy-basic", "object-evict.odirect", "object-multitenant.io_uring", "reopen"] {
        let dir = fixtures().join(scen);
        let img = dir.join("device.img");
        let (code, out, err) = fdpblk(&["inspect", "--json", img.to_str().unwrap()]);
        assert_eq!(code, 0, "{err}");
        let v: Value = serde_json::from_str(&out).unwrap();
        let m: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
        for f in ["block_align", "header_bytes", "slot_bytes", "meta_total_bytes", "data_base_offset", "max_slots"] {
            assert_eq!(v["geometry"][f], m["geometry"][f], "{scen} {f}");
        }
        assert_eq!(v["geometry"]["capacity_bytes"], m["geometry"]["capacity_bytes_effective"]);
        let live = m["keys"].as_array().unwrap().iter().filter(|k| k["live_at_end"] == true).count();
        assert_eq!(v["summary"]["live"].as_u64().unwrap() as usize, live, "{scen}");
        assert_eq!(v["summary"]["header_mismatch"], 0);
        assert_eq!(v["entries"].as_array().unwrap().len(), live);
        let on_dev = m["checkpoints_on_device"].as_object().unwrap();
        for c in v["checkpoints"].as_array().unwrap() {
            let copy = c["copy"].as_u64().unwrap().to_string();
            assert_eq!(c["crc_ok"] == true, on_dev.contains_key(&copy), "{scen} copy {copy}");
        }
    }
}

#[test]
fn inspect_text_names_each_entry() {
    let img = fixtures().join("object-multitenant/device.img");
    let (code, out, _) = fdpblk(&["inspect", img.to_str().unwrap()]);
    assert_eq!(code, 0);
    assert!(out.contains("summary: 13 live entries"), "{out}");
    assert!(out.contains("tenantB:bob-7f3a"));
}

#[test]
fn replay_json_fields() {
    let dir = std::env::temp_dir().join(format!("fdpblk-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("t.jsonl");
    let hdr = format!("4c4d43424c4b3031{}{}", "0700000000000000", "00f0000000000000");
    std::fs::write(
        &trace,
        format!(
            "{}\n{}\n{}\n{}\n",
            r#"{"op":"write","offset":0,"len":4096,"data_hex":"4c4d434944583031"}"#,
            format_args!(r#"{{"op":"write","offset":1048576,"len":4096,"data_hex":"{hdr}"}}"#),
            r#"{"op":"write","offset":1052672,"len":61440}"#,
            r#"{"op":"flush"}"#
        ),
    )
    .unwrap();
    let t = trace.to_str().unwrap();
    let (code, out, err) = fdpblk(&["replay", "--json", "--slot-bytes", "64K", "--meta-total-bytes", "1M", t]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["classes"]["checkpoint_header"]["bytes"], 4096);
    assert_eq!(v["classes"]["slot_header"]["requests"], 1);
    assert_eq!(v["classes"]["slot_payload"]["bytes"], 61440);
    assert_eq!(v["identities"], serde_json::json!([7]));
    assert_eq!(v["handles"]["1"], 4096);
    assert_eq!(v["handles"]["2"], 4096 + 61440);
    let (code, out, _) = fdpblk(&["replay", "--json", "--policy", "none", "--slot-bytes", "64K", "--meta-total-bytes", "1M", t]);
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["handles"]["0"], 4096 * 2 + 61440);
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn bad_input_is_one_clear_line() {
    let cases: &[(&[&str], &str)] = &[
        (&["inspect", "/nonexistent/device"], "cannot open"),
        (&["replay", "/nonexistent/trace"], "cannot open trace"),
    ];
    for (args, want) in cases {
        let (code, _, err) = fdpblk(args);
        assert_ne!(code, 0);
        assert!(err.contains(want), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    // A blank image has no checkpoint: the error names the flags to pass.
    let dir = std::env::temp_dir().join(format!("fdpblk-cli-blank-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let img = dir.join("blank.img");
    std::fs::write(&img, vec![0u8; 2 << 20]).unwrap();
    let (code, _, err) = fdpblk(&["inspect", img.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("--slot-bytes and --meta-total-bytes"), "{err}");
    let (code, _, err) = fdpblk(&["inspect", "--slot-bytes", "64K", "--meta-total-bytes", "4M", img.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("use a larger device"), "{err}");
    let trace = dir.join("bad.jsonl");
    std::fs::write(&trace, "{\"op\":\"write\",\"offset\":0}\n").unwrap();
    let (code, _, err) = fdpblk(&["replay", "--slot-bytes", "64K", "--meta-total-bytes", "1M", trace.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("trace line 1: missing \"len\""), "{err}");
    std::fs::remove_dir_all(dir).ok();
}
