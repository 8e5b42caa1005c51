//! The deployment kit in `deploy/` cannot drift: the LMCache configs (non-MP YAML, MP L2
//! adapter JSON) must name the device of `deploy/fdpblk.example.toml` by its stable path, use
//! its geometry, and satisfy LMCache 0.5.6's own rules (the same rules fdpblk checks with
//! `GeometryConfig::validate`); the systemd units must start, stop and order what the docs say.

use fdpblk::cmd::config_file::{ConfigFile, CONFIG_DIR};
use fdpblk::layout::GeometryConfig;
use fdpblk::nvme::pin::BackingPin;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

fn deploy_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

/// The YAML that LMCache's example uses, and nothing more: `key: value` at indent 0, one
/// level of mappings at indent 2, `#` comments, scalars (quoted or bare strings, integers,
/// true/false), flow lists of quoted strings and flow mappings of plain keys to such scalars
/// (`{0: "a", 1: "b"}`). Anything else is an error, so an edit the checks cannot read fails
/// instead of passing unread.
fn parse_yaml_subset(text: &str) -> Result<Map<String, Value>, String> {
    fn scalar(raw: &str, line: usize) -> Result<Value, String> {
        let v = raw.trim();
        if let Some(s) = v.strip_prefix('"') {
            let s = s.strip_suffix('"').ok_or(format!("line {line}: unterminated string"))?;
            if s.contains(['"', '\\']) {
                return Err(format!("line {line}: escapes are not supported"));
            }
            return Ok(Value::String(s.into()));
        }
        if let Some(items) = v.strip_prefix('{') {
            let items = items.strip_suffix('}').ok_or(format!("line {line}: unterminated mapping"))?;
            let mut m = Map::new();
            for item in items.split(',') {
                // YAML reads `a:b` as one plain scalar, so the colon needs its space.
                let (k, val) = item.split_once(": ").ok_or(format!("line {line}: mapping item {item:?} is not `key: value`"))?;
                let k = k.trim();
                if k.is_empty() || !k.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b)) {
                    return Err(format!("line {line}: mapping key {k:?} is not plain"));
                }
                if val.trim_start().starts_with(['{', '[']) {
                    return Err(format!("line {line}: nested collections are not supported"));
                }
                if m.insert(k.into(), scalar(val, line)?).is_some() {
                    return Err(format!("line {line}: mapping key {k} twice"));
                }
            }
            return Ok(Value::Object(m));
        }
        if let Some(items) = v.strip_prefix('[') {
            let items = items.strip_suffix(']').ok_or(format!("line {line}: unterminated list"))?;
            return items.split(',').map(|i| scalar(i, line)).collect::<Result<Vec<_>, _>>().map(Value::Array);
        }
        match v {
            "true" => return Ok(Value::Bool(true)),
            "false" => return Ok(Value::Bool(false)),
            _ => {}
        }
        if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
            return v.parse::<u64>().map(Value::from).map_err(|e| format!("line {line}: {e}"));
        }
        if !v.is_empty() && v.bytes().all(|b| b.is_ascii_alphanumeric() || b"_./-".contains(&b)) {
            return Ok(Value::String(v.into()));
        }
        Err(format!("line {line}: value {v:?} is not a plain scalar"))
    }
    let mut top = Map::new();
    let mut open: Option<String> = None; // the mapping that indent-2 lines belong to
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let content = raw.trim_start();
        if content.is_empty() || content.starts_with('#') {
            continue;
        }
        let indent = raw.len() - content.len();
        // An inline comment after a value.
        let content = match content.find(" #") {
            Some(at) if !content[..at].contains('"') || content[..at].matches('"').count() % 2 == 0 => &content[..at],
            _ => content,
        };
        let (key, value) = content.split_once(':').ok_or(format!("line {line}: not `key: value`"))?;
        if key.contains([' ', '"', '\'']) || key.is_empty() {
            return Err(format!("line {line}: key {key:?} is not plain"));
        }
        let target = match indent {
            0 => {
                open = None;
                &mut top
            }
            2 => {
                let m = open.as_ref().ok_or(format!("line {line}: indented line outside a mapping"))?;
                top.get_mut(m).and_then(Value::as_object_mut).expect("opened mapping")
            }
            n => return Err(format!("line {line}: indent {n} (only 0 and 2)")),
        };
        if target.contains_key(key) {
            return Err(format!("line {line}: key {key} twice"));
        }
        if value.trim().is_empty() {
            if indent != 0 {
                return Err(format!("line {line}: nested mappings are not supported"));
            }
            target.insert(key.into(), Value::Object(Map::new()));
            open = Some(key.into());
        } else {
            target.insert(key.into(), scalar(value, line)?);
        }
    }
    Ok(top)
}

/// `rust_raw_block.*` keys of LMCache 0.5.6's non-MP plugin.
const NON_MP_KEYS: [&str; 20] = [
    "device_path",
    "per_tp_device_paths",
    "block_align",
    "header_bytes",
    "use_odirect",
    "enable_zero_copy",
    "capacity_bytes",
    "io_engine",
    "iouring_queue_depth",
    "use_uring_cmd",
    "max_data_transfer_size",
    "meta_total_bytes",
    "meta_magic",
    "meta_version",
    "slot_bytes",
    "meta_checkpoint_interval_sec",
    "meta_idle_quiet_ms",
    "meta_enable_periodic",
    "load_checkpoint_on_init",
    "meta_verify_on_load",
];

/// Keys of LMCache 0.5.6's MP `raw_block` L2 adapter JSON.
const MP_KEYS: [&str; 30] = [
    "type",
    "device_path",
    "slot_bytes",
    "capacity_bytes",
    "use_odirect",
    "block_align",
    "header_bytes",
    "meta_total_bytes",
    "meta_magic",
    "meta_version",
    "meta_checkpoint_interval_sec",
    "meta_idle_quiet_ms",
    "meta_enable_periodic",
    "load_checkpoint_on_init",
    "meta_verify_on_load",
    "enable_zero_copy",
    "io_engine",
    "iouring_queue_depth",
    "use_uring_cmd",
    "max_data_transfer_size",
    "fdp_enabled",
    "fdp_placement_ids",
    "fdp_data_placement_policy",
    "fdp_slot_reuse_policy",
    "meta_checkpoint_placement_id",
    "num_store_workers",
    "num_lookup_workers",
    "num_load_workers",
    "persist_enabled",
    "eviction",
];

/// What an LMCache config says: device path and geometry (LMCache's defaults filled in).
#[derive(Debug, PartialEq)]
struct LmcacheSide {
    device_path: String,
    geometry: GeometryConfig,
}

fn u(v: &Value, key: &str, default: u64) -> Result<u64, String> {
    match v.get(key) {
        None => Ok(default),
        Some(x) => x.as_u64().ok_or(format!("{key} must be a non-negative integer, is {x}")),
    }
}

/// The rules LMCache applies to its config, beyond the geometry.
fn lmcache_common(v: &Value, what: &str) -> Result<(), String> {
    if v.get("use_uring_cmd") == Some(&Value::Bool(true)) {
        return Err(format!("{what}: use_uring_cmd needs an NVMe /dev/ngXnY; a ublk device is not one"));
    }
    if let Some(e) = v.get("io_engine") {
        if e != "posix" && e != "io_uring" {
            return Err(format!("{what}: io_engine {e} (LMCache 0.5.6 takes posix or io_uring)"));
        }
    }
    let g = GeometryConfig {
        block_align: u(v, "block_align", 4096)?,
        header_bytes: u(v, "header_bytes", 4096)?,
        slot_bytes: u(v, "slot_bytes", 0)?,
        meta_total_bytes: u(v, "meta_total_bytes", 0)?,
        capacity_bytes: u(v, "capacity_bytes", 0)?,
    };
    if g.capacity_bytes > 0 && g.capacity_bytes <= g.meta_total_bytes {
        return Err(format!("{what}: capacity_bytes must exceed meta_total_bytes"));
    }
    Ok(())
}

/// The non-MP config's devices, by rank: `device_path` alone, or `per_tp_device_paths` (ranks
/// 0..N, distinct paths), with the one geometry every rank uses.
fn non_mp(path: &Path) -> Result<Vec<LmcacheSide>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let y = parse_yaml_subset(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let plugins = y.get("storage_plugins").and_then(Value::as_array).ok_or("non-MP: no storage_plugins list")?;
    if !plugins.iter().any(|p| p == "raw_block") {
        return Err("non-MP: storage_plugins lacks raw_block".into());
    }
    let extra = y.get("extra_config").and_then(Value::as_object).ok_or("non-MP: no extra_config")?;
    if extra.get("storage_plugin.raw_block.module_path") != Some(&Value::from("lmcache.v1.storage_backend.plugins.rust_raw_block_backend"))
        || extra.get("storage_plugin.raw_block.class_name") != Some(&Value::from("RustRawBlockBackend"))
    {
        return Err("non-MP: storage_plugin.raw_block.module_path/class_name are not LMCache's raw_block plugin".into());
    }
    let mut rb = Map::new();
    for (k, v) in extra {
        if let Some(key) = k.strip_prefix("rust_raw_block.") {
            if !NON_MP_KEYS.contains(&key) {
                return Err(format!("non-MP: unknown key {k} (LMCache would ignore it)"));
            }
            rb.insert(key.into(), v.clone());
        } else if !k.starts_with("storage_plugin.raw_block.") {
            return Err(format!("non-MP: unexpected extra_config key {k}"));
        }
    }
    let rb = Value::Object(rb);
    let paths: Vec<String> = match (rb.get("device_path"), rb.get("per_tp_device_paths")) {
        (Some(p), None) => vec![p.as_str().ok_or("non-MP: rust_raw_block.device_path is not a string")?.to_string()],
        (None, Some(m)) => {
            let m = m.as_object().ok_or("non-MP: rust_raw_block.per_tp_device_paths is not a mapping of rank to path")?;
            let mut v = Vec::new();
            for r in 0..m.len() {
                let p = m.get(&r.to_string()).and_then(Value::as_str).ok_or(format!(
                    "non-MP: per_tp_device_paths has no path for rank {r} (ranks 0..{} each need one)",
                    m.len() - 1
                ))?;
                if v.iter().any(|q| q == p) {
                    return Err(format!("non-MP: per_tp_device_paths names {p} twice (LMCache refuses shared paths)"));
                }
                v.push(p.to_string());
            }
            v
        }
        (Some(_), Some(_)) => return Err("non-MP: set device_path (one GPU) or per_tp_device_paths (tensor parallel), not both".into()),
        (None, None) => return Err("non-MP: no rust_raw_block.device_path".into()),
    };
    if rb.get("slot_bytes").is_none() {
        return Err("non-MP: set rust_raw_block.slot_bytes (fdpblk needs the same value)".into());
    }
    lmcache_common(&rb, "non-MP")?;
    let geometry = GeometryConfig {
        block_align: u(&rb, "block_align", 4096)?,
        header_bytes: u(&rb, "header_bytes", 4096)?,
        slot_bytes: u(&rb, "slot_bytes", 0)?,
        meta_total_bytes: u(&rb, "meta_total_bytes", 128 << 20)?,
        capacity_bytes: u(&rb, "capacity_bytes", 0)?,
    };
    Ok(paths.into_iter().map(|device_path| LmcacheSide { device_path, geometry }).collect())
}

fn mp(path: &Path) -> Result<LmcacheSide, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let o = v.as_object().ok_or("MP: the adapter config is not a JSON object")?;
    for k in o.keys() {
        if !MP_KEYS.contains(&k.as_str()) {
            return Err(format!("MP: unknown key {k}"));
        }
    }
    if v["type"] != "raw_block" {
        return Err("MP: type must be raw_block".into());
    }
    let device_path = v["device_path"].as_str().filter(|s| !s.is_empty()).ok_or("MP: device_path is required")?.to_string();
    if v["slot_bytes"].as_u64().is_none_or(|s| s == 0) {
        return Err("MP: slot_bytes is required and positive".into());
    }
    if v.get("fdp_enabled") == Some(&Value::Bool(true)) || v.get("meta_checkpoint_placement_id").is_some() {
        return Err("MP: LMCache's FDP mode needs uring_cmd on /dev/ngXnY; under fdpblk, fdpblk places the writes".into());
    }
    if v.get("per_tp_device_paths").is_some() || v.get("persist_enabled") == Some(&Value::Bool(false)) {
        return Err("MP: per_tp_device_paths is rejected and persist_enabled must be true".into());
    }
    lmcache_common(&v, "MP")?;
    let geometry = GeometryConfig {
        block_align: u(&v, "block_align", 4096)?,
        header_bytes: u(&v, "header_bytes", 4096)?,
        slot_bytes: u(&v, "slot_bytes", 0)?,
        meta_total_bytes: u(&v, "meta_total_bytes", 256 << 20)?,
        capacity_bytes: u(&v, "capacity_bytes", 0)?,
    };
    Ok(LmcacheSide { device_path, geometry })
}

/// Lines `Key=value` of a unit file (comments and sections skipped).
fn unit_keys(text: &str) -> Vec<(String, String)> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with(';') && !l.starts_with('['))
        .filter_map(|l| l.split_once('=').map(|(k, v)| (k.trim().to_string(), v.trim().to_string())))
        .collect()
}

fn get<'a>(keys: &'a [(String, String)], k: &str) -> Vec<&'a str> {
    keys.iter().filter(|(key, _)| key == k).map(|(_, v)| v.as_str()).collect()
}

/// Every check of the kit in `dir` (a copy of `deploy/`).
fn check_kit(dir: &Path) -> Result<(), String> {
    let toml_path = dir.join("fdpblk.example.toml");
    let c = ConfigFile::load(&toml_path)?;
    let name = c.name.clone().ok_or("fdpblk.example.toml: set name (LMCache's device_path is /dev/fdpblk/NAME)")?;
    if c.backing.is_none() {
        return Err("fdpblk.example.toml: set backing".into());
    }
    let (Some(slot_bytes), Some(meta_total_bytes)) = (c.geometry.slot_bytes, c.geometry.meta_total_bytes) else {
        return Err("fdpblk.example.toml: set slot_bytes and meta_total_bytes (a new device has no checkpoint to learn them from)".into());
    };
    let ours = GeometryConfig {
        block_align: c.geometry.block_align.unwrap_or(4096),
        header_bytes: c.geometry.header_bytes.unwrap_or(4096),
        slot_bytes,
        meta_total_bytes,
        capacity_bytes: c.geometry.capacity_bytes.unwrap_or(0),
    };
    // LMCache's rules hold on any device that fits the metadata region and one slot.
    ours.validate(meta_total_bytes + slot_bytes).map_err(|e| format!("fdpblk.example.toml: {e}"))?;
    // The commented-out pin is one to copy: uncommented, the file takes it and so does `add`.
    let text = std::fs::read_to_string(&toml_path).map_err(|e| e.to_string())?;
    let pin = text.lines().find_map(|l| l.strip_prefix("# backing_id = ")).ok_or("fdpblk.example.toml: show a `# backing_id = ` line")?;
    let pinned = ConfigFile::parse(&toml_path, &format!("backing_id = {pin}"))?;
    BackingPin::parse(pinned.backing_id.as_deref().unwrap_or_default()).map_err(|e| format!("fdpblk.example.toml: {e}"))?;
    let path = format!("/dev/fdpblk/{name}");
    let mut non_mp_sides = non_mp(&dir.join("lmcache/lmcache-nonmp.yaml"))?;
    if non_mp_sides.len() != 1 {
        return Err("lmcache-nonmp.yaml: the example is for one GPU (device_path); tp2/ has the tensor-parallel one".into());
    }
    for (what, side) in [("lmcache-nonmp.yaml", non_mp_sides.remove(0)), ("mp-l2-adapter.json", mp(&dir.join("lmcache/mp-l2-adapter.json"))?)] {
        if side.device_path != path {
            return Err(format!("{what}: device_path {} is not fdpblk's stable name {path}", side.device_path));
        }
        if side.geometry != ours {
            return Err(format!("{what}: geometry {:?} differs from fdpblk.example.toml's {ours:?}", side.geometry));
        }
        side.geometry.validate(meta_total_bytes + slot_bytes).map_err(|e| format!("{what}: {e}"))?;
    }

    // The template unit: up/down by instance name, the config directory fdpblk reads.
    let unit_text = std::fs::read_to_string(dir.join("fdpblk@.service")).map_err(|e| e.to_string())?;
    let unit = unit_keys(&unit_text);
    let bin = "/usr/local/bin/fdpblk";
    let want = [("Type", "notify"), ("ExecStart", "/usr/local/bin/fdpblk up %i"), ("ExecStop", "/usr/local/bin/fdpblk down %i"), ("Restart", "on-failure")];
    for (k, v) in want {
        if get(&unit, k) != [v] {
            return Err(format!("fdpblk@.service: {k}= is {:?}, want {v}", get(&unit, k)));
        }
    }
    if !unit_text.contains(&format!("{CONFIG_DIR}/NAME.toml")) {
        return Err(format!("fdpblk@.service: its comment must name {CONFIG_DIR}/NAME.toml, where `fdpblk up` reads"));
    }
    // The optional OnFailure= drop-in: releases the device only once the unit gave up, so it
    // needs RestartMode=direct (systemd 254+ would run it at every crash), and its release
    // unit deletes the device by instance name.
    let on_failure = unit_keys(&std::fs::read_to_string(dir.join("fdpblk@.service.d/on-failure.conf")).map_err(|e| e.to_string())?);
    if get(&on_failure, "OnFailure") != ["fdpblk-release@%i.service"] || get(&on_failure, "RestartMode") != ["direct"] {
        return Err("fdpblk@.service.d/on-failure.conf: needs OnFailure=fdpblk-release@%i.service and RestartMode=direct (without it systemd 254+ releases the device at every crash)".into());
    }
    let release = unit_keys(&std::fs::read_to_string(dir.join("fdpblk-release@.service")).map_err(|e| e.to_string())?);
    if get(&release, "Type") != ["oneshot"] || get(&release, "ExecStart") != [format!("{bin} del --name %i --if-orphaned").as_str()] {
        return Err(format!("fdpblk-release@.service: needs Type=oneshot and ExecStart={bin} del --name %i --if-orphaned (a device added by hand under the name stays)"));
    }
    let rules = std::fs::read_to_string(dir.join("99-fdpblk.rules")).map_err(|e| e.to_string())?;
    if !rules.contains(&format!("PROGRAM=\"{bin} name %n\"")) {
        return Err(format!("99-fdpblk.rules: PROGRAM must run {bin}, like the units"));
    }
    let metrics = unit_keys(&std::fs::read_to_string(dir.join("fdpblk-metrics.service")).map_err(|e| e.to_string())?);
    let exec = get(&metrics, "ExecStart");
    if exec.len() != 1 || !exec[0].starts_with(&format!("{bin} metrics --textfile ")) || !exec[0].contains(".prom ") {
        return Err(format!("fdpblk-metrics.service: ExecStart {exec:?} must be `{bin} metrics --textfile DIR/NAME.prom ...`"));
    }

    // LMCache's drop-in: ordered after the device, never restarted with it.
    let drop_in = unit_keys(&std::fs::read_to_string(dir.join(format!("lmcache/fdpblk-{name}.conf"))).map_err(|e| e.to_string())?);
    let svc = format!("fdpblk@{name}.service");
    for k in ["Wants", "After"] {
        if get(&drop_in, k) != [svc.as_str()] {
            return Err(format!("fdpblk-{name}.conf: {k}= must be {svc}"));
        }
    }
    for k in ["Requires", "BindsTo", "PartOf", "Requisite"] {
        if !get(&drop_in, k).is_empty() {
            return Err(format!("fdpblk-{name}.conf: {k}= would restart LMCache whenever {svc} restarts after a daemon crash; use Wants= + After="));
        }
    }
    if get(&drop_in, "ExecStartPre") != [format!("/usr/bin/test -b {path}").as_str()] {
        return Err(format!("fdpblk-{name}.conf: ExecStartPre must refuse to start LMCache without {path}"));
    }
    Ok(())
}

/// The tensor-parallel example in `dir/tp2`: each rank's path is the stable name of a device
/// configured there (NAME.toml), with LMCache's geometry, and each on its own backing.
fn check_tp(dir: &Path) -> Result<(), String> {
    let sides = non_mp(&dir.join("lmcache-nonmp-tp2.yaml"))?;
    if sides.len() < 2 {
        return Err("lmcache-nonmp-tp2.yaml: per_tp_device_paths should name a device per rank".into());
    }
    let mut backings = Vec::new();
    for (rank, side) in sides.iter().enumerate() {
        let name = side.device_path.strip_prefix("/dev/fdpblk/").ok_or(format!(
            "lmcache-nonmp-tp2.yaml: rank {rank}'s path {} is not a stable name /dev/fdpblk/NAME",
            side.device_path
        ))?;
        let file = format!("{name}.toml");
        let c = ConfigFile::load(&dir.join(&file))?;
        if c.name.as_deref() != Some(name) {
            return Err(format!("{file}: name is {:?}, but rank {rank}'s path is {}", c.name, side.device_path));
        }
        let ours = GeometryConfig {
            block_align: c.geometry.block_align.unwrap_or(4096),
            header_bytes: c.geometry.header_bytes.unwrap_or(4096),
            slot_bytes: c.geometry.slot_bytes.ok_or(format!("{file}: set slot_bytes"))?,
            meta_total_bytes: c.geometry.meta_total_bytes.ok_or(format!("{file}: set meta_total_bytes"))?,
            capacity_bytes: c.geometry.capacity_bytes.unwrap_or(0),
        };
        if side.geometry != ours {
            return Err(format!("{file}: geometry {ours:?} differs from lmcache-nonmp-tp2.yaml's {:?}", side.geometry));
        }
        ours.validate(ours.meta_total_bytes + ours.slot_bytes).map_err(|e| format!("{file}: {e}"))?;
        // /dev/ngXnY and /dev/nvmeXnY are the same namespace.
        let b = c.backing.ok_or(format!("{file}: set backing"))?.to_string_lossy().replacen("/dev/ng", "/dev/nvme", 1);
        if backings.contains(&b) {
            return Err(format!("{file}: backing {b} is another rank's too; each rank needs its own namespace"));
        }
        backings.push(b);
    }
    Ok(())
}

#[test]
fn deploy_kit_agrees_with_itself_and_with_lmcache() {
    check_kit(&deploy_dir()).unwrap();
    check_tp(&deploy_dir().join("tp2")).unwrap();
}

#[test]
fn tensor_parallel_drift_is_caught() {
    let cases: [(&str, &str, &str, &str); 6] = [
        ("kv1.toml", "backing = \"/dev/ng0n2\"", "backing = \"/dev/nvme0n1\"", "each rank needs its own namespace"),
        ("kv1.toml", "slot_bytes = 16781312", "slot_bytes = 33558528", "kv1.toml: geometry"),
        ("kv1.toml", "name = \"kv1\"", "name = \"kv2\"", "kv1.toml: name"),
        ("lmcache-nonmp-tp2.yaml", "1: \"/dev/fdpblk/kv1\"", "1: \"/dev/fdpblk/kv0\"", "names /dev/fdpblk/kv0 twice"),
        ("lmcache-nonmp-tp2.yaml", "1: \"/dev/fdpblk/kv1\"", "2: \"/dev/fdpblk/kv1\"", "no path for rank 1"),
        ("lmcache-nonmp-tp2.yaml", "\"/dev/fdpblk/kv1\"", "\"/dev/ublkb1\"", "not a stable name"),
    ];
    for (file, from, to, want) in cases {
        let tmp = std::env::temp_dir().join(format!("fdpblk-deploy-tp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).unwrap();
        for f in ["kv0.toml", "kv1.toml", "lmcache-nonmp-tp2.yaml"] {
            std::fs::copy(deploy_dir().join("tp2").join(f), tmp.join(f)).unwrap();
        }
        let p = tmp.join(file);
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(text.contains(from), "{file} no longer contains {from:?}: update this test");
        std::fs::write(&p, text.replacen(from, to, 1)).unwrap();
        let e = check_tp(&tmp).expect_err(&format!("{file}: {from:?} -> {to:?} passed"));
        assert!(e.contains(want), "{file}: {from:?} -> {to:?}: {e}");
        let _ = std::fs::remove_dir_all(&tmp);
    }
}

/// Each kind of drift makes the check fail, with a message that says which file.
#[test]
fn drift_is_caught() {
    let cases: [(&str, &str, &str, &str); 13] = [
        ("lmcache/lmcache-nonmp.yaml", "rust_raw_block.slot_bytes: 33558528", "rust_raw_block.slot_bytes: 33562624", "lmcache-nonmp.yaml: geometry"),
        ("lmcache/lmcache-nonmp.yaml", "\"/dev/fdpblk/kv0\"", "\"/dev/ublkb0\"", "is not fdpblk's stable name"),
        ("lmcache/lmcache-nonmp.yaml", "  rust_raw_block.meta_total_bytes: 268435456\n", "", "lmcache-nonmp.yaml: geometry"),
        ("lmcache/lmcache-nonmp.yaml", "rust_raw_block.block_align", "rust_raw_block.blockalign", "unknown key rust_raw_block.blockalign"),
        ("lmcache/mp-l2-adapter.json", "\"slot_bytes\": 33558528", "\"slot_bytes\": 16781312", "mp-l2-adapter.json: geometry"),
        ("lmcache/mp-l2-adapter.json", "\"io_engine\": \"io_uring\"", "\"use_uring_cmd\": true", "use_uring_cmd"),
        ("fdpblk.example.toml", "slot_bytes = 33558528", "slot_bytes = 33558529", "slot_bytes 33558529 must be"),
        ("fdpblk.example.toml", "name = \"kv0\"", "name = \"kv1\"", "is not fdpblk's stable name /dev/fdpblk/kv1"),
        ("fdpblk.example.toml", "# backing_id = 'serial \"S6X1NG0T123456\" nsid 1'", "# backing_id = 'serial \"S6X1NG0T123456\"'", "names no single namespace"),
        ("lmcache/fdpblk-kv0.conf", "Wants=fdpblk@kv0.service", "Requires=fdpblk@kv0.service", "Wants= must be"),
        ("fdpblk@.service", "ExecStop=/usr/local/bin/fdpblk down %i", "ExecStop=/usr/local/bin/fdpblk del --all", "ExecStop="),
        ("fdpblk@.service.d/on-failure.conf", "RestartMode=direct", "RestartMode=normal", "on-failure.conf: needs"),
        ("fdpblk-release@.service", "del --name %i --if-orphaned", "del --name %i", "fdpblk-release@.service: needs"),
    ];
    for (file, from, to, want) in cases {
        let tmp = std::env::temp_dir().join(format!("fdpblk-deploy-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(tmp.join("lmcache")).unwrap();
        std::fs::create_dir_all(tmp.join("fdpblk@.service.d")).unwrap();
        for f in [
            "fdpblk.example.toml",
            "fdpblk@.service",
            "fdpblk@.service.d/on-failure.conf",
            "fdpblk-release@.service",
            "fdpblk-metrics.service",
            "99-fdpblk.rules",
            "lmcache/lmcache-nonmp.yaml",
            "lmcache/mp-l2-adapter.json",
            "lmcache/fdpblk-kv0.conf",
        ] {
            std::fs::copy(deploy_dir().join(f), tmp.join(f)).unwrap();
        }
        let p = tmp.join(file);
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(text.contains(from), "{file} no longer contains {from:?}: update this test");
        std::fs::write(&p, text.replacen(from, to, 1)).unwrap();
        let e = check_kit(&tmp).expect_err(&format!("{file}: {from:?} -> {to:?} passed"));
        assert!(e.contains(want), "{file}: {from:?} -> {to:?}: {e}");
        let _ = std::fs::remove_dir_all(&tmp);
    }
}

#[test]
fn yaml_subset_is_strict() {
    assert_eq!(parse_yaml_subset("a: 1\nb:\n  c.d: \"x\" # note\n  e: true\n").unwrap()["b"]["c.d"], "x");
    let m = parse_yaml_subset("a: {0: \"x\", 1: y}\n").unwrap();
    assert_eq!((m["a"]["0"].as_str(), m["a"]["1"].as_str()), (Some("x"), Some("y")));
    for bad in ["a:\n  b:\n    c: 1\n", "a: {x: {y: 1}}\n", "a: {x 1}\n", "a: {0:\"x\"}\n", "a: {x: 1, x: 2}\n", "a: {x: 1\n", "  a: 1\n", "a: 1\na: 2\n", "a: 'x'\n", "- a\n", "a: \"x\\\"\"\n"] {
        assert!(parse_yaml_subset(bad).is_err(), "accepted {bad:?}");
    }
}
