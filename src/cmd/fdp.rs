//! `fdpblk fdp status DEV [--json]` and `fdpblk fdp stats DEV [--json]`: what the drive says
//! about Flexible Data Placement, read with the same commands nvme-cli sends, so the numbers
//! agree with `nvme fdp status` / `nvme fdp configs` / `nvme fdp stats`.

use super::CmdResult;
use crate::nvme::fdp::{FdpEventsLog, FdpStats};
use crate::nvme::{FdpInfo, NvmeDevice, NvmeError};
use clap::{Args, Subcommand};
use serde_json::{json, Value};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct FdpArgs {
    #[command(subcommand)]
    pub command: FdpCommand,
}

#[derive(Subcommand, Debug)]
pub enum FdpCommand {
    /// The namespace's placement identifiers and reclaim unit handle status, with the active
    /// FDP configuration, block size and transfer limits.
    Status(FdpStatusArgs),
    /// The endurance group's FDP statistics (HBMW, MBMW, MBE, their ratio) and events.
    Stats(FdpStatsArgs),
}

#[derive(Args, Debug)]
pub struct FdpStatusArgs {
    /// Namespace: /dev/nvme0n1 or /dev/ng0n1.
    pub device: PathBuf,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct FdpStatsArgs {
    /// Controller (/dev/nvme0) or namespace (/dev/nvme0n1, /dev/ng0n1).
    pub device: PathBuf,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
    /// Endurance group; default: the namespace's, or for a controller that of its first
    /// active namespace.
    #[arg(long)]
    pub endgid: Option<u16>,
}

pub fn run(a: &FdpArgs) -> CmdResult {
    match &a.command {
        FdpCommand::Status(s) => status(s),
        FdpCommand::Stats(s) => stats(s),
    }
}

/// A 128-bit counter as a JSON number, or as a decimal string past 2^64 (no JSON reader
/// fdpblk targets keeps such numbers exact).
pub fn big(v: u128) -> Value {
    u64::try_from(v).map(Value::from).unwrap_or_else(|_| Value::String(v.to_string()))
}

/// Bytes in binary units: `4194304 (4.0 MiB)`.
fn bytes(v: u128) -> String {
    const U: [&str; 7] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB"];
    if v < 1024 {
        return format!("{v} B");
    }
    let mut x = v as f64 / 1024.0;
    let mut i = 0;
    while x >= 1024.0 && i + 1 < U.len() {
        x /= 1024.0;
        i += 1;
    }
    format!("{v} ({x:.1} {})", U[i])
}

/// The namespace's block device (`/dev/nvmeXnY`) and generic char device (`/dev/ngXnY`), the
/// given path's own and the other where the kernel made it.
fn namespace_nodes(dev: &std::path::Path) -> (Option<std::path::PathBuf>, Option<std::path::PathBuf>) {
    use crate::nvme::path::{self, DevKind};
    let Ok(p) = path::resolve(dev) else { return (None, None) };
    let own = Some(std::path::Path::new("/dev").join(&p.name));
    match p.kind {
        DevKind::Block => (own, path::namespace_other_node(dev)),
        DevKind::Generic => (path::namespace_other_node(dev), own),
        DevKind::Controller => (None, None),
    }
}

/// `fdp status` as JSON.
pub fn status_json(i: &FdpInfo) -> Value {
    let c = &i.config;
    let mut m = serde_json::Map::new();
    let mut put = |k: &str, v: Value| {
        m.insert(k.to_string(), v);
    };
    put("device", json!(i.device.display().to_string()));
    // The namespace's two nodes, as sysfs links them (scripts need the one not given).
    let (block, generic) = namespace_nodes(&i.device);
    put("block_device", json!(block.map(|p| p.display().to_string())));
    put("generic_device", json!(generic.map(|p| p.display().to_string())));
    put("controller", json!(i.controller.display().to_string()));
    put("nsid", json!(i.nsid));
    put("model", json!(i.ctrl.model));
    put("serial", json!(i.ctrl.serial));
    put("firmware", json!(i.ctrl.firmware));
    put("nguid", json!(i.identity.nguid));
    put("eui64", json!(i.identity.eui64));
    put("identity", json!(i.identity.to_string()));
    put("ctratt", json!(i.ctrl.ctratt));
    put("fdps", json!(i.ctrl.fdp_supported()));
    put("endgid", json!(i.endgid));
    put("fdpe", json!(i.feature.enabled));
    put("fdpcidx", json!(i.feature.config_index));
    put("num_configs", json!(i.num_configs));
    put("fdpa", json!(c.fdpa));
    put("rgif", json!(c.rgif()));
    put("fdpvwc", json!(c.fdpvwc()));
    put("valid", json!(c.valid()));
    put("vss", json!(c.vss));
    put("nrg", json!(c.nrg));
    put("nruh", json!(c.nruh));
    put("maxpids", json!(c.maxpids));
    put("nnss", json!(c.nnss));
    put("runs", json!(c.runs));
    put("erutl", json!(c.erutl));
    put("ruht", json!(c.ruh_types.iter().map(|t| t.as_u8()).collect::<Vec<_>>()));
    put("lba_size", json!(i.lba_size));
    put("lba_metadata", json!(i.lba_metadata));
    put("nsze", json!(i.nsze));
    put("ns_bytes", json!(i.ns_bytes()));
    put("ru_blocks", json!(i.ru_blocks()));
    put("mdts", json!(i.ctrl.mdts));
    put("mdts_bytes", json!(i.mdts_bytes));
    put("max_hw_sectors_kb", json!(i.max_hw_sectors_kb));
    put("max_transfer_bytes", json!(i.max_transfer_bytes));
    put("max_write_streams", json!(i.max_write_streams));
    put("write_stream_granularity", json!(i.write_stream_granularity));
    put("nruhsd", json!(i.ruhs.len()));
    put("placement_ids", json!(i.placement_ids));
    put(
        "ruhs",
        json!(i
            .ruhs
            .iter()
            .map(|d| {
                let (rg, ph) = c.split_pid(d.pid);
                json!({"pid": d.pid, "rg": rg, "ph": ph, "ruhid": d.ruhid, "earutr": d.earutr, "ruamw": d.ruamw})
            })
            .collect::<Vec<_>>()),
    );
    put("hbmw", big(i.stats.hbmw));
    put("mbmw", big(i.stats.mbmw));
    put("mbe", big(i.stats.mbe));
    Value::Object(m)
}

/// `fdp status` as text.
pub fn status_text(i: &FdpInfo) -> String {
    let c = &i.config;
    let mut o = String::new();
    let opt = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
    o += &format!("device:        {} (nsid {})\n", i.device.display(), i.nsid);
    o += &format!(
        "controller:    {} ({}, serial {}, firmware {})\n",
        i.controller.display(),
        i.ctrl.model,
        i.ctrl.serial,
        i.ctrl.firmware
    );
    o += &format!("identity:      {} (fdpblk add --backing-id takes it, or its serial and nsid)\n", i.identity);
    o += &format!(
        "FDP:           supported, enabled; endurance group {}, configuration {} of {}\n",
        i.endgid, i.feature.config_index, i.num_configs
    );
    o += &format!(
        "configuration: FDPA {:#x} ({}valid, RGIF {}, {}volatile write cache), VSS {}\n",
        c.fdpa,
        if c.valid() { "" } else { "not " },
        c.rgif(),
        if c.fdpvwc() { "" } else { "no " },
        c.vss
    );
    o += &format!(
        "               NRG {}, NRUH {}, MAXPIDS {} (0-based), NNSS {}, ERUTL {} s\n",
        c.nrg, c.nruh, c.maxpids, c.nnss, c.erutl
    );
    o += &format!("               RUNS {} = {} blocks\n", bytes(u128::from(c.runs)), i.ru_blocks());
    let mut types: Vec<(&str, usize)> = Vec::new();
    for t in &c.ruh_types {
        match types.iter_mut().find(|(n, _)| *n == t.name()) {
            Some((_, k)) => *k += 1,
            None => types.push((t.name(), 1)),
        }
    }
    let types: Vec<String> = types.iter().map(|(n, k)| format!("{k} {n}")).collect();
    o += &format!("handles:       {}\n", types.join(", "));
    o += &format!("namespace:     {} blocks of {} B = {}\n", i.nsze, i.lba_size, bytes(u128::from(i.ns_bytes())));
    o += &format!(
        "transfers:     max {} (MDTS {} = {}, max_hw_sectors_kb {})\n",
        bytes(u128::from(i.max_transfer_bytes)),
        i.ctrl.mdts,
        opt(i.mdts_bytes),
        opt(i.max_hw_sectors_kb.map(u64::from))
    );
    o += &format!(
        "write streams: max_write_streams {}, write_stream_granularity {}\n",
        opt(i.max_write_streams.map(u64::from)),
        opt(i.write_stream_granularity)
    );
    o += &format!("statistics:    HBMW {}, MBMW {}, MBE {}\n", i.stats.hbmw, i.stats.mbmw, i.stats.mbe);
    o += &format!("placement identifiers ({}), in the drive's order (RG: reclaim group, PH: placement handle):\n", i.ruhs.len());
    o += "   index    PID     RG     PH  RUHID  EARUTR (s)  RUAMW (blocks)\n";
    for (n, d) in i.ruhs.iter().enumerate() {
        let (rg, ph) = c.split_pid(d.pid);
        o += &format!("  {n:>6} {:>6} {rg:>6} {ph:>6} {:>6} {:>11} {:>15}\n", d.pid, d.ruhid, d.earutr, d.ruamw);
    }
    o
}

fn status(a: &FdpStatusArgs) -> CmdResult {
    let info = FdpInfo::discover(&a.device)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&status_json(&info))?);
    } else {
        print!("{}", status_text(&info));
    }
    Ok(())
}

fn events_json(r: &Result<FdpEventsLog, NvmeError>) -> Value {
    match r {
        Err(e) => json!({ "error": e.to_string() }),
        Ok(l) => json!({
            "nevents": l.nevents,
            "truncated": l.truncated(),
            "events": l.events.iter().map(|e| {
                let mut v = json!({
                    "type": e.etype,
                    "name": e.type_name(),
                    "fdpef": e.flags,
                    "pid": e.pid,
                    "nsid": e.nsid,
                    "timestamp_ms": e.timestamp_ms,
                    "rgid": e.rgid,
                    "ruhid": e.ruhid,
                });
                if let Some((nlbam, lba)) = e.media_reallocated() {
                    v["nlbam"] = json!(nlbam);
                    v["lba"] = json!(lba);
                }
                v
            }).collect::<Vec<_>>(),
        }),
    }
}

fn events_text(kind: &str, r: &Result<FdpEventsLog, NvmeError>) -> String {
    match r {
        Err(e) => format!("{kind} events: not read: {e}\n"),
        Ok(l) => {
            let shown = if l.truncated() { format!(" (only the first {} shown)", l.events.len()) } else { String::new() };
            let mut o = format!("{kind} events: {}{shown}\n", l.nevents);
            for e in &l.events {
                o += &format!("  {:#04x} {}", e.etype, e.type_name());
                if e.pid_valid() {
                    o += &format!(", PID {}", e.pid);
                }
                if e.nsid_valid() {
                    o += &format!(", NSID {}", e.nsid);
                }
                if e.location_valid() {
                    o += &format!(", RG {} RUH {}", e.rgid, e.ruhid);
                }
                if let Some((nlbam, lba)) = e.media_reallocated() {
                    o += &format!(", {nlbam} blocks moved");
                    if let Some(l) = lba {
                        o += &format!(" from LBA {l}");
                    }
                }
                o += &format!(", at {} ms\n", e.timestamp_ms);
            }
            o
        }
    }
}

/// `fdp stats` as JSON (events may be absent on drives that fail the events log).
pub fn stats_json(
    dev: &str,
    ctrl: &str,
    endgid: u16,
    fdpe: Option<bool>,
    s: &FdpStats,
    host: &Result<FdpEventsLog, NvmeError>,
    controller: &Result<FdpEventsLog, NvmeError>,
) -> Value {
    json!({
        "device": dev,
        "controller": ctrl,
        "endgid": endgid,
        "fdpe": fdpe,
        "hbmw": big(s.hbmw),
        "mbmw": big(s.mbmw),
        "mbe": big(s.mbe),
        "media_host_ratio": s.media_host_ratio(),
        "events": { "host": events_json(host), "controller": events_json(controller) },
    })
}

fn stats(a: &FdpStatsArgs) -> CmdResult {
    let dev = NvmeDevice::open(&a.device)?;
    let ctrl = dev.identify_ctrl()?;
    if !ctrl.fdp_supported() {
        return Err(NvmeError::NoFdp { ctrl: dev.admin_path().to_path_buf(), model: ctrl.model }.into());
    }
    let endgid = match a.endgid {
        Some(e) => e,
        None => dev.endgid()?,
    };
    let fdpe = dev.fdp_feature(endgid).ok().map(|f| f.enabled);
    let s = dev.fdp_stats(endgid)?;
    let host = dev.fdp_events(endgid, true);
    let controller = dev.fdp_events(endgid, false);
    let (d, c) = (a.device.display().to_string(), dev.admin_path().display().to_string());
    if a.json {
        let v = stats_json(&d, &c, endgid, fdpe, &s, &host, &controller);
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let mut o = format!("device:     {d} (controller {c}), endurance group {endgid}");
    match fdpe {
        Some(true) => o += ", FDP enabled\n",
        Some(false) => o += ", FDP disabled\n",
        None => o += "\n",
    }
    o += &format!("HBMW (host bytes with metadata written):  {}\n", bytes(s.hbmw));
    o += &format!("MBMW (media bytes with metadata written): {}\n", bytes(s.mbmw));
    o += &format!("MBE  (media bytes erased):                {}\n", bytes(s.mbe));
    o += &match s.media_host_ratio() {
        Some(r) => format!("MBMW / HBMW:                              {r:.4}\n"),
        None => "MBMW / HBMW:                              - (no host writes yet)\n".to_string(),
    };
    // The drive keeps them per endurance group: other namespaces' writes count too.
    o += &format!("(the counters above are endurance group {endgid}'s: every namespace in it, not {d} alone)\n");
    o += &events_text("host", &host);
    o += &events_text("controller", &controller);
    print!("{o}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvme::fdp::FdpEventsLog;

    #[test]
    fn big_numbers() {
        assert_eq!(big(5), json!(5));
        assert_eq!(big(u128::from(u64::MAX)), json!(u64::MAX));
        assert_eq!(big(u128::from(u64::MAX) + 1), json!("18446744073709551616"));
        assert_eq!(bytes(4194304), "4194304 (4.0 MiB)");
        assert_eq!(bytes(10), "10 B");
    }

    #[test]
    fn stats_json_fields() {
        let s = FdpStats { hbmw: 100, mbmw: 150, mbe: 0 };
        let mut ev = vec![0u8; 128];
        ev[0] = 1;
        ev[64 + 1] = 1;
        ev[64 + 2] = 5;
        let host = Ok(FdpEventsLog::parse(&ev).unwrap());
        let none = Ok(FdpEventsLog::parse(&[0u8; 64]).unwrap());
        let v = stats_json("/dev/nvme0", "/dev/nvme0", 1, Some(true), &s, &host, &none);
        assert_eq!((v["hbmw"].as_u64(), v["mbmw"].as_u64(), v["mbe"].as_u64()), (Some(100), Some(150), Some(0)));
        assert_eq!(v["media_host_ratio"].as_f64(), Some(1.5));
        assert_eq!(v["events"]["host"]["nevents"], 1);
        assert_eq!(v["events"]["host"]["events"][0]["pid"], 5);
        assert_eq!(v["events"]["controller"]["events"].as_array().unwrap().len(), 0);
        let t = events_text("host", &host);
        assert!(t.contains("PID 5") && t.contains("Reclaim Unit Not Fully Written"), "{t}");
    }
}
