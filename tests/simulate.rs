//! `fdpblk simulate` end to end: a small seeded run, its JSON, its plot, its errors.

use std::process::Command;

fn fdpblk() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fdpblk"))
}

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("fdpblk-simulate-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

const WORKLOAD: &str = r#"{
  "name": "tiny", "description": "test", "slot_bytes": "1M", "write_rate_mb_s": 1,
  "eviction": {"policy": "LRU", "trigger_watermark": 0.95, "eviction_ratio": 0.05},
  "tenants": [{"name": "a", "salt": "a:1", "zipf": 0.9, "universe": 4, "doc_chunks": [1, 16], "unique_tail_chunks": 1}]
}"#;

const SMALL: &[&str] = &["--device-size", "1G", "--ru-size", "4M", "--unit", "64K", "--warmup", "1", "--measure", "1"];

#[test]
fn json_table_and_plot() {
    let d = tmpdir("run");
    let w = d.join("tiny.json");
    std::fs::write(&w, WORKLOAD).unwrap();
    let png = d.join("waf.png");
    let out = fdpblk()
        .args(["simulate", "--workload", w.to_str().unwrap(), "--policy", "none,key-aware", "--utilization", "50,100"])
        .args(["--trim", "both", "--json", "--jobs", "2", "--plot", png.to_str().unwrap()])
        .args(SMALL)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let runs = v["runs"].as_array().unwrap();
    // 2 policies x 2 trim settings x 2 utilisations, in table order.
    assert_eq!(runs.len(), 8);
    let key = |r: &serde_json::Value| {
        (r["policy"].as_str().unwrap().to_string(), r["trim"].as_bool().unwrap(), r["utilization"].as_f64().unwrap())
    };
    assert_eq!(key(&runs[0]), ("none".into(), false, 0.5));
    assert_eq!(key(&runs[7]), ("key-aware".into(), true, 1.0));
    for r in runs {
        let waf = r["waf"].as_f64().unwrap();
        assert!((1.0..3.0).contains(&waf), "{r}");
        assert!(r["host_bytes"].as_u64().unwrap() >= 1 << 30);
        assert!(r["speed"]["events_per_s"].as_f64().unwrap() > 0.0);
    }
    assert!(runs[7]["trimmed_slots"].as_u64().unwrap() > 0 && runs[7]["own_state_bytes"].as_u64().unwrap() > 0);
    let png = std::fs::read(&png).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    // The text table.
    let out = fdpblk()
        .args([
            "simulate",
            "--workload",
            w.to_str().unwrap(),
            "--policy",
            "lmcache-fdp",
            "--utilization",
            "100",
            "--trim",
            "both",
        ])
        .args(SMALL)
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("steady-state WAF") && !text.contains("lmcache-fdp + trim"), "{text}");
    std::fs::remove_dir_all(&d).ok();
}

/// `--writeback-puts N` plays what `"writeback_puts": N` in the workload does, and the
/// window moves the figures (the page cache absorbs more puts into a dirty slot).
#[test]
fn writeback_puts_flag_overrides_the_workload() {
    let d = tmpdir("writeback");
    let waf = |workload: &str, extra: &[&str]| -> f64 {
        let w = d.join("w.json");
        std::fs::write(&w, workload).unwrap();
        let out = fdpblk()
            .args(["simulate", "--workload", w.to_str().unwrap(), "--policy", "none", "--utilization", "100", "--trim", "off", "--json", "--io", "buffered"])
            .args(extra)
            .args(SMALL)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["runs"][0]["waf"].as_f64().unwrap()
    };
    let in_file = WORKLOAD.replacen('{', r#"{"writeback_puts": 256, "#, 1);
    let by_flag = waf(WORKLOAD, &["--writeback-puts", "256"]);
    assert_eq!(by_flag, waf(&in_file, &[]));
    assert_ne!(by_flag, waf(WORKLOAD, &[]), "the default window (64) gives another WAF");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn errors_name_the_fix() {
    let d = tmpdir("err");
    let w = d.join("tiny.json");
    std::fs::write(&w, WORKLOAD).unwrap();
    for (args, needle) in [
        (vec!["--policy", "fastest"], "choose from"),
        (vec!["--utilization", "150"], "--utilization"),
        (vec!["--utilization", "0.5"], "percent of the device"),
        (vec!["--utilization", "50.5"], "a whole number from 1 to 100"),
        (vec!["--trim", "maybe"], "on, off or both"),
        (vec!["--handle-type", "xx"], "ii or pi"),
        (vec!["--policy", "lmcache-fdp", "--trim", "on"], "no trim"),
        (vec!["--policy", "clairvoyant", "--clairvoyant-handles", "9"], "use 2 to --handles"),
        (vec!["--policy", "popularity", "--clairvoyant-handles", "1"], "use 2 to --handles"),
        (vec!["--policy", " , "], "--policy: none given"),
        (vec!["--utilization", ""], "--utilization: none given"),
        (vec!["--trim-rules", "slots,bogus"], "choose from slots, tails"),
        (vec!["--writeback-puts", "8"], "--writeback-puts needs buffered I/O"),
        (vec!["--io", "buffered", "--writeback-puts", "0"], "1 to 1048576 puts"),
        // 1 % of a 1 GiB drive holds no slot after the metadata region: said before the
        // 100 % run has run, naming simulate's flags (not `add`'s --capacity-bytes).
        (vec!["--utilization", "100,1"], "at --utilization 1: LMCache's share of the simulated device"),
        (vec!["--utilization", "1"], "give a larger --device-size or a higher --utilization"),
        (vec!["--plot", "/nonexistent-fdpblk-dir/waf.png"], "--plot: cannot write /nonexistent-fdpblk-dir/waf.png"),
        (vec!["--plot", d.to_str().unwrap()], "--plot: cannot write"),
    ] {
        let out =
            fdpblk().args(["simulate", "--workload", w.to_str().unwrap()]).args(&args).args(SMALL).output().unwrap();
        assert!(!out.status.success());
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(e.contains(needle), "{args:?}: {e}");
        assert!(!e.contains("WAF") && !e.contains("--capacity-bytes"), "{args:?}: refused only after a run, or naming add's flag: {e}");
    }
    // Out-of-range values are refused before the model sizes its tables by them.
    for (workload, needle) in [
        (r#"{"tenants": [{"zipf": -1}]}"#, "zipf"),
        (r#"{"tenants": [{"universe": 1e12}]}"#, "universe"),
        (r#"{"tenants": [{"doc_chunks": [1, 4000000000]}]}"#, "doc_chunks"),
        (r#"{"write_rate_mb_s": 1e-300, "tenants": [{}]}"#, "write_rate_mb_s"),
        (r#"{"checkpoint_interval_s": 1e-300, "tenants": [{}]}"#, "checkpoint_interval_s"),
        (r#"{"checkpoint_interval_s": 0.5, "tenants": [{}]}"#, "at most once a second"),
        (r#"{"eviction": {"interval_s": 1e-12}, "tenants": [{}]}"#, "interval_s must be 0.01 to 86400"),
        (r#"{"chunk_hash_bytes": 4000000000, "tenants": [{}]}"#, "chunk_hash_bytes"),
        (r#"{"slot_bytes": 1000, "tenants": [{}]}"#, "larger than \"header_bytes\""),
        (r#"{"writeback_puts": 8, "tenants": [{}]}"#, "\"writeback_puts\" is read only with buffered I/O"),
        (r#"{"io": "buffered", "ublk_queue_depth": 8, "tenants": [{}]}"#, "\"ublk_queue_depth\" is read only with io_uring I/O"),
        (r#"{"uring_reorder_window": 8, "tenants": [{}]}"#, "\"uring_reorder_window\" is read only with io_uring I/O"),
        (r#"{"lru_insert": "forward", "tenants": [{}]}"#, "\"lru_insert\" orders the eviction controller's LRU and the L1's"),
    ] {
        std::fs::write(&w, workload).unwrap();
        let out = fdpblk().args(["simulate", "--workload", w.to_str().unwrap()]).output().unwrap();
        assert!(!out.status.success());
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(e.contains(needle), "{workload}: {e}");
    }
    // A device given as the workload is refused at 1 MiB, not read until memory runs out.
    let out = fdpblk().args(["simulate", "--workload", "/dev/zero"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("workload /dev/zero is over 1024 KiB"), "{out:?}");
    std::fs::write(&w, WORKLOAD).unwrap();
    for (flag, value, needle) in [("--measure", "inf", "0.1 to 100"), ("--warmup", "NaN", "0 to 100"), ("--unit", "1000", "power of two")] {
        let out = fdpblk().args(["simulate", "--workload", w.to_str().unwrap(), flag, value]).output().unwrap();
        assert!(!out.status.success());
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(e.contains(needle), "{flag} {value}: {e}");
    }
    std::fs::remove_dir_all(&d).ok();
}

/// A drive whose maps would not fit the memory the process may use is refused before it is
/// allocated (here under an 8 GiB address-space limit; the maps of a 12 TiB drive in 4 KiB
/// units take about 25 GiB).
#[test]
fn a_drive_too_large_for_memory_is_refused_naming_the_fix() {
    use std::os::unix::process::CommandExt;
    let d = tmpdir("memory");
    let w = d.join("tiny.json");
    std::fs::write(&w, WORKLOAD).unwrap();
    let mut cmd = fdpblk();
    cmd.args(["simulate", "--workload", w.to_str().unwrap(), "--policy", "none", "--utilization", "100", "--device-size", "12T", "--unit", "4K"]);
    // SAFETY: setrlimit only, between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            libc::getrlimit(libc::RLIMIT_AS, &mut l);
            l.rlim_cur = l.rlim_max.min(8 << 30);
            if libc::setrlimit(libc::RLIMIT_AS, &l) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("more than half of the memory") && e.contains("--unit"), "{e}");
    std::fs::remove_dir_all(&d).ok();
}
