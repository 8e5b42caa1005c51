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
        assert_eq!(v["checkpoints"].as_array().unwrap().len(), 2, "{scen}: both copies shown");
        for c in v["checkpoints"].as_array().unwrap() {
            let copy = c["copy"].as_u64().unwrap().to_string();
            assert_eq!(c["crc_ok"] == true, on_dev.contains_key(&copy), "{scen} copy {copy}");
        }
    }
}

/// The object-evict image with each checkpoint copy's JSON edited by `edit` (its length and
/// CRC in the header written again).
fn object_evict_with_json(edit: impl Fn(&str) -> String) -> Vec<u8> {
    let mut img = std::fs::read(fixtures().join("object-evict/device.img")).unwrap();
    for at in [0usize, 524288] {
        let len = u64::from_le_bytes(img[at + 20..at + 28].try_into().unwrap()) as usize;
        if &img[at..at + 8] != b"LMCIDX01" || len == 0 {
            continue;
        }
        let json = edit(std::str::from_utf8(&img[at + 4096..at + 4096 + len]).unwrap());
        assert!(4096 + json.len() <= 524288, "the edited JSON fits its container");
        img[at + 4096..at + 4096 + len].fill(0);
        img[at + 4096..at + 4096 + json.len()].copy_from_slice(json.as_bytes());
        img[at + 20..at + 28].copy_from_slice(&(json.len() as u64).to_le_bytes());
        img[at + 28..at + 32].copy_from_slice(&crc32fast::hash(json.as_bytes()).to_le_bytes());
    }
    img
}

/// A checkpoint LMCache's json.loads takes but strict JSON does not (a NaN): `inspect --json`
/// refuses it before it prints anything (it printed entries up to the NaN), naming the NaN,
/// with the layout's flags too (they no longer pass it as a checkpoint LMCache starts empty
/// over).
#[test]
fn inspect_json_refuses_a_nan_checkpoint_before_printing() {
    let img = object_evict_with_json(|j| {
        let nan = j.replacen("\"capacity_bytes\":4194304", "\"capacity_bytes\":NaN    ", 1);
        assert_eq!(nan.len(), j.len());
        nan
    });
    let path = std::env::temp_dir().join(format!("fdpblk-cli-nan-{}.img", std::process::id()));
    std::fs::write(&path, &img).unwrap();
    let (code, out, err) = fdpblk(&["inspect", "--json", "--slot-bytes", "65536", "--meta-total-bytes", "1048576", path.to_str().unwrap()]);
    let _ = std::fs::remove_file(&path);
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("beyond what fdpblk parses") && err.contains("NaN or Infinity literal"), "{err}");
    assert!(out.is_empty(), "no partial document: {out}");
}

/// A checkpoint past what fdpblk parses (a key longer than 64 KiB, which LMCache's
/// json.loads takes): inspect and replay say what they cannot do, not `add`'s `--layout`.
#[test]
fn a_checkpoint_past_the_parsers_bounds_gets_each_commands_own_advice() {
    let img = object_evict_with_json(|j| {
        let long = j.replacen("\"entries\":{\"", &format!("\"entries\":{{\"{}", "a".repeat(70_000)), 1);
        assert_eq!(long.len(), j.len() + 70_000);
        long
    });
    let path = std::env::temp_dir().join(format!("fdpblk-cli-long-key-{}.img", std::process::id()));
    std::fs::write(&path, &img).unwrap();
    let (code, _, err) = fdpblk(&["inspect", path.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("beyond what fdpblk parses") && err.contains("inspect cannot list its entries") && !err.contains("--layout"), "{err}");
    let trace = std::env::temp_dir().join(format!("fdpblk-cli-long-key-{}.jsonl", std::process::id()));
    std::fs::write(&trace, "{\"op\":\"write\",\"offset\":1048576,\"len\":4096}\n").unwrap();
    let (code, _, err) = fdpblk(&["replay", "--device", path.to_str().unwrap(), trace.to_str().unwrap()]);
    let _ = (std::fs::remove_file(&path), std::fs::remove_file(&trace));
    assert_ne!(code, 0);
    assert!(err.contains("leave out --device") && !err.contains("--layout"), "{err}");
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
    // The same trace on standard input: spooled to a file in TMPDIR, replayed alike, removed.
    let spool_dir = dir.join("tmp");
    std::fs::create_dir_all(&spool_dir).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_fdpblk"))
        .args(["replay", "--json", "--policy", "none", "--slot-bytes", "64K", "--meta-total-bytes", "1M", "-"])
        .env("TMPDIR", &spool_dir)
        .stdin(std::fs::File::open(&trace).unwrap())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let from_stdin: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(from_stdin, v);
    assert_eq!(std::fs::read_dir(&spool_dir).unwrap().count(), 0, "the spool is removed");
    // The same trace through a FIFO path (as `<(blkparse ...)` gives): spooled too. Read
    // twice as a path, the second open would wait for a writer that has gone.
    let fifo = dir.join("t.fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let (src, dst) = (trace.clone(), fifo.clone());
    let writer = std::thread::spawn(move || std::fs::write(&dst, std::fs::read(&src).unwrap()).unwrap());
    let mut child = Command::new(env!("CARGO_BIN_EXE_fdpblk"))
        .args(["replay", "--json", "--policy", "none", "--slot-bytes", "64K", "--meta-total-bytes", "1M"])
        .arg(&fifo)
        .env("TMPDIR", &spool_dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().ok();
            panic!("replay of a FIFO path did not end within 60 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    // Checked before the writer is joined: had fdpblk never opened the FIFO, the writer
    // would still wait in its open.
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(serde_json::from_slice::<Value>(&out.stdout).unwrap(), v);
    writer.join().unwrap();
    assert_eq!(std::fs::read_dir(&spool_dir).unwrap().count(), 0, "the spool is removed");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn bad_input_is_one_clear_line() {
    let cases: &[(&[&str], &str)] = &[
        (&["inspect", "/nonexistent/device"], "cannot open"),
        (&["replay", "/nonexistent/trace"], "cannot open trace"),
        // Not a trace: refused, not copied into $TMPDIR until it fills.
        (&["replay", "/"], "trace / is a directory, not a trace"),
        (&["replay", "--sector-offset", "2048", "--slot-bytes", "64K", "--meta-total-bytes", "1M", "/dev/null"], "the trace is empty"),
        (&["stats", "--name", "fdpblk-cli-test-no-such-device"], "no fdpblk device named fdpblk-cli-test-no-such-device; see `fdpblk list`"),
        (&["stats", "--name", "fdpblk-cli-test-no-such-device", "--prometheus"], "no fdpblk device named fdpblk-cli-test-no-such-device"),
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
    // metrics' textfile: a directory where the file goes, or no directory for it.
    let prom_dir = dir.join("d.prom");
    std::fs::create_dir_all(&prom_dir).unwrap();
    for (path, want) in [(prom_dir.clone(), "is a directory: give a file in it"), (dir.join("none/x.prom"), "no directory")] {
        let (code, _, err) = fdpblk(&["metrics", "--once", "--textfile", path.to_str().unwrap()]);
        assert_ne!(code, 0);
        assert!(err.contains(want), "{path:?}: {err}");
    }
    // A capacity past an image's end is said, not cut to the image in silence.
    let (code, _, err) = fdpblk(&["inspect", "--slot-bytes", "64K", "--meta-total-bytes", "1M", "--capacity-bytes", "4M", img.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("--capacity-bytes 4194304 is past the end of") && err.contains("without the flag"), "{err}");
    let trace = dir.join("bad.jsonl");
    std::fs::write(&trace, "{\"op\":\"write\",\"offset\":0}\n").unwrap();
    let (code, _, err) = fdpblk(&["replay", "--slot-bytes", "64K", "--meta-total-bytes", "1M", trace.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("trace line 1: missing \"len\""), "{err}");
    std::fs::write(&trace, "{\"op\":\"write\",\"offset\":0,\"len\":4096}\n").unwrap();
    let (code, _, err) = fdpblk(&["replay", "--sector-offset", "2048", "--slot-bytes", "64K", "--meta-total-bytes", "1M", trace.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("--sector-offset applies to blkparse traces"), "{err}");
    // One damaged line must not size the device or a buffer: each is refused, naming the fix.
    let geo = ["--slot-bytes", "64K", "--meta-total-bytes", "1M"];
    for (line, extra, want) in [
        (r#"{"op":"write","offset":4611686018427387904,"len":4096}"#, None, "give --device-size"),
        (r#"{"op":"write","offset":0,"len":2199023255552}"#, Some("4T"), "the trace is damaged"),
        (r#"{"op":"write","offset":8388608,"len":4096}"#, Some("4M"), "past the 4194304-byte device"),
        (r#"{"op":"write","offset":0,"len":4096}"#, Some("1024T"), "more than the 268435456 fdpblk tracks"),
    ] {
        std::fs::write(&trace, format!("{line}\n")).unwrap();
        let mut args = vec!["replay"];
        args.extend(geo);
        if let Some(size) = extra {
            args.extend(["--device-size", size]);
        }
        args.push(trace.to_str().unwrap());
        let (code, _, err) = fdpblk(&args);
        assert_ne!(code, 0, "{line}");
        assert!(err.contains(want), "{line}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    // A read of 1 GiB is replayed in pieces.
    std::fs::write(&trace, "{\"op\":\"read\",\"offset\":0,\"len\":1073741824}\n".repeat(4)).unwrap();
    let mut args = vec!["replay", "--device-size", "2G"];
    args.extend(geo);
    args.push(trace.to_str().unwrap());
    let (code, out, err) = fdpblk(&args);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("4 requests, 0 engine errors"), "{out}");
    std::fs::remove_dir_all(dir).ok();
}

/// An image that holds only the start of the traced device (its checkpoint and first slots):
/// with `--device-size` the slots past the image's end are slots, as LMCache laid them out on
/// the whole device, and not bytes outside the layout.
#[test]
fn replay_of_an_image_prefix_takes_the_slot_count_from_the_device_size() {
    let dir = std::env::temp_dir().join(format!("fdpblk-cli-prefix-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let whole = std::fs::read(fixtures().join("object-evict/device.img")).unwrap();
    let img = dir.join("prefix.img");
    std::fs::write(&img, &whole[..2 << 20]).unwrap();
    // A slot header write to slot 30 of the 48 on the 4 MiB device (the prefix holds 16).
    let trace = dir.join("t.jsonl");
    std::fs::write(&trace, format!("{{\"op\":\"write\",\"offset\":{},\"len\":4096,\"data_hex\":\"4c4d43424c4b3031\"}}\n", (1 << 20) + 30 * 65536)).unwrap();
    let (code, out, err) = fdpblk(&["replay", "--json", "--device", img.to_str().unwrap(), "--device-size", "4M", trace.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["geometry"]["max_slots"], 48, "{out}");
    assert_eq!(v["classes"]["slot_header"]["bytes"], 4096, "{out}");
    assert_eq!(v["classes"]["outside"]["bytes"], 0, "{out}");
    std::fs::remove_dir_all(dir).ok();
}

/// Writes LMCache's captured I/O of `scen` as blkparse would print a blktrace of the ublk
/// device: each request queued, got, inserted, issued and completed, every third write as two
/// bios that merge, plug/unplug lines, a flush after each checkpoint header, the summaries at
/// the end. Returns the file and the bytes per class the capture's own region labels give
/// (writes and reads).
fn blkparse_from_fixture(scen: &str, out: &std::path::Path) -> (PathBuf, std::collections::BTreeMap<&'static str, u64>, u64) {
    use std::fmt::Write;
    let dir = fixtures().join(scen);
    let mut text = String::new();
    let mut want = std::collections::BTreeMap::new();
    let mut written = 0;
    let mut seq = 0;
    let mut line = |text: &mut String, cpu: u32, act: &str, rwbs: &str, rest: &str| {
        seq += 1;
        let t = seq as f64 * 1e-5;
        writeln!(text, "259,0 {cpu:4} {seq:8} {t:14.9} {:5} {act:>2} {rwbs:>3} {rest}", if act == "C" { 0 } else { 4711 }).unwrap();
    };
    for (i, l) in std::fs::read_to_string(dir.join("iotrace.jsonl")).unwrap().lines().enumerate() {
        let v: Value = serde_json::from_str(l).unwrap();
        let rwbs = match v["op"].as_str().unwrap() {
            "write" => "WS",
            "read" => "R",
            _ => continue,
        };
        let (off, len) = (v["offset"].as_u64().unwrap(), v["total_len"].as_u64().unwrap());
        assert!(off % 512 == 0 && len % 512 == 0, "{scen}: the block layer sees whole sectors");
        let class = match v["region"].as_str().unwrap() {
            "meta_header" | "checkpoint_header" => "checkpoint_header",
            "meta_payload" | "checkpoint_payload" => "checkpoint_payload",
            r => if r == "slot_header" { "slot_header" } else { "slot_payload" },
        };
        *want.entry(class).or_insert(0) += len;
        if rwbs == "WS" {
            written += len;
        }
        let (s, n) = (off / 512, len / 512);
        let proc_ = "[python3]";
        if rwbs == "WS" && i % 3 == 0 && n >= 16 {
            line(&mut text, 1, "Q", rwbs, &format!("{s} + {} {proc_}", n / 2));
            line(&mut text, 1, "G", rwbs, &format!("{s} + {} {proc_}", n / 2));
            line(&mut text, 1, "P", "N", proc_);
            line(&mut text, 1, "Q", rwbs, &format!("{} + {} {proc_}", s + n / 2, n - n / 2));
            line(&mut text, 1, "M", rwbs, &format!("{} + {} {proc_}", s + n / 2, n - n / 2));
            line(&mut text, 1, "U", "N", &format!("{proc_} 1"));
        } else {
            line(&mut text, 1, "Q", rwbs, &format!("{s} + {n} {proc_}"));
            line(&mut text, 1, "G", rwbs, &format!("{s} + {n} {proc_}"));
        }
        line(&mut text, 1, "I", rwbs, &format!("{s} + {n} {proc_}"));
        line(&mut text, 1, "D", rwbs, &format!("{s} + {n} {proc_}"));
        line(&mut text, 0, "C", rwbs, &format!("{s} + {n} [0]"));
        if class == "checkpoint_header" && rwbs == "WS" {
            line(&mut text, 1, "Q", "FN", "[python3]");
            line(&mut text, 1, "D", "FN", "[kworker/1:1H]");
            line(&mut text, 0, "C", "FN", "[0]");
        }
    }
    text.push_str("CPU0 (259,0):\n Reads Queued:           0,        0KiB\t Writes Queued:           0,        0KiB\n");
    text.push_str("Total (259,0):\n Reads Queued:           2,        8KiB\t Writes Queued:          44,     1088KiB\n\n");
    text.push_str("Throughput (R/W): 8KiB/s / 1088KiB/s\nEvents (259,0): 300 entries\nSkips: 0 forward (0 -   0.0%)\n");
    let path = out.join(format!("{scen}.blkparse"));
    std::fs::write(&path, text).unwrap();
    (path, want, written)
}

#[test]
fn replay_blkparse_of_a_fixture() {
    let dir = std::env::temp_dir().join(format!("fdpblk-cli-blk-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let scen = "object-evict.odirect";
    let img = fixtures().join(scen).join("device.img");
    let (trace, want, written) = blkparse_from_fixture(scen, &dir);
    let (t, img) = (trace.to_str().unwrap(), img.to_str().unwrap());
    let classes = |v: &Value| -> std::collections::BTreeMap<&'static str, u64> {
        ["checkpoint_header", "checkpoint_payload", "slot_header", "slot_payload", "slot_padding", "outside"]
            .into_iter()
            .map(|c| (c, v["classes"][c]["bytes"].as_u64().unwrap()))
            .filter(|&(_, b)| b > 0)
            .collect()
    };
    // The geometry comes from the image's checkpoint; every event kind gives the same bytes.
    for ev in ["D", "Q", "C"] {
        let (code, out, err) = fdpblk(&["replay", "--json", "--blk-event", ev, "--device", img, t]);
        assert_eq!(code, 0, "{err}");
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(classes(&v), want, "--blk-event {ev}");
        assert_eq!(v["ops"]["write"]["bytes"], written);
        assert_eq!(v["ops"]["flush"]["requests"], 2, "one flush after each checkpoint header write");
        assert_eq!(v["trace"]["format"], "blkparse");
        assert_eq!(v["trace"]["event"], ev);
        assert_eq!(v["trace"]["identities_known"], false);
        assert_eq!(v["identities"], serde_json::json!([]));
        // Region placement: checkpoint writes on handle 1, slot writes on handle 2.
        assert_eq!(v["handles"]["1"].as_u64().unwrap() + v["handles"]["2"].as_u64().unwrap(), written);
        assert_eq!(v["handles"]["1"].as_u64().unwrap(), 8192 + 8192);
    }
    // key-aware knows no identity here: every slot on handle 0, and the report says so.
    let (code, out, err) = fdpblk(&["replay", "--json", "--policy", "key-aware", "--ssd", "--device", img, t]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["handles"], serde_json::json!({"0": written}));
    assert!(v["trace"]["note"].as_str().unwrap().contains("no slot identity is known"), "{v}");
    assert_eq!(v["ssd"]["host_bytes"], written);
    assert_eq!(v["payload_fallbacks"], 20, "every slot payload write");
    let (code, out, err) = fdpblk(&["replay", "--policy", "key-aware", "--ssd", "--slot-bytes", "64K", "--meta-total-bytes", "1M", t]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("trace: blkparse, "), "{out}");
    assert!(out.contains("D (issued to the driver) events of device 259,0 taken"), "{out}");
    assert!(out.contains("note: the trace carries no data"), "{out}");
    assert!(out.contains("handle 0 (young)"), "{out}");
    assert!(out.contains("simulated SSD: WAF"), "{out}");
    // A short trace never fills the modelled drive: its WAF is no full drive's, and it says so.
    assert!(out.contains("garbage collection never ran in the window"), "{out}");
    // A reclaim unit below 4 KiB is refused, not made one unit in silence.
    for ru in ["0", "1", "4095"] {
        let (code, _, err) = fdpblk(&["replay", "--ssd", "--ssd-ru-size", ru, "--slot-bytes", "64K", "--meta-total-bytes", "1M", t]);
        assert_ne!(code, 0);
        assert!(err.contains(&format!("--ssd-ru-size {ru}: give at least 4K")), "{err}");
    }
    // Explicit formats, and a file with no events: one line that names the line.
    let (code, _, err) = fdpblk(&["replay", "--format", "json", "--slot-bytes", "64K", "--meta-total-bytes", "1M", t]);
    assert_ne!(code, 0);
    assert!(err.contains("trace line 1: not JSON"), "{err}");
    let junk = dir.join("junk.txt");
    std::fs::write(&junk, "\nTotal (259,0):\n Reads Queued: 0\n").unwrap();
    let (code, _, err) = fdpblk(&["replay", "--slot-bytes", "64K", "--meta-total-bytes", "1M", junk.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("no blkparse events in 3 lines of the trace: line 2: first field is not a device maj,min"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let (code, _, err) = fdpblk(&["replay", "--blk-event", "X", t]);
    assert_ne!(code, 0);
    assert!(err.contains("use Q (queued), D (issued) or C (completed)"), "{err}");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn replay_names_an_unknown_policy_before_reading_the_trace() {
    // The trace does not exist: the policy is checked first.
    let (code, _, err) = fdpblk(&["replay", "/nonexistent/trace.jsonl", "--device-size", "16M", "--policy", "bogus"]);
    assert_ne!(code, 0);
    assert!(err.contains("unknown --policy bogus; choose one of"), "{err}");
}

#[test]
fn a_reader_that_goes_away_ends_the_output_quietly() {
    // The reader is gone before fdpblk writes: it ends on SIGPIPE (status 141), as other tools
    // do, instead of panicking on EPIPE.
    let exe = env!("CARGO_BIN_EXE_fdpblk");
    let out = std::process::Command::new("bash")
        .args(["-c", &format!("(sleep 0.3; '{exe}' list) | true; echo \"${{PIPESTATUS[0]}}\"")])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "141", "{stderr}");
}
