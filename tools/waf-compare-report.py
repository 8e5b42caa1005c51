#!/usr/bin/env python3
"""The report of tools/waf-compare: reads what each configuration left in OUT/NAME/ (blkparse
text of each traced device, `fdpblk fdp status --json` before and after, the writer's or fio's
JSON, `fdpblk stats --json`), runs `fdpblk replay` on the workload device's trace (classes, and
`--ssd` for the simulated device WAF) and writes OUT/report.json, OUT/report.md and
OUT/chart.png (`fdpblk plot`). Run by tools/waf-compare; not meant to be run alone."""

import argparse
import bisect
import collections
import json
import os
import subprocess
import sys
import time

T0 = time.time()


def step(what):
    print(f"waf-compare: report {time.time() - T0:5.1f} s {what}", file=sys.stderr)

# The handle each policy gives fdpblk's own state (src/place/region.rs: region's OWN_STATE is 3; the
# others put it on their first handle). fdpblk handle h is placement-ID index h.
OWN_STATE_HANDLE = {"none": 0, "region": 3, "lmcache-fdp": 0, "key-aware": 0}
# The policy `fdpblk replay` re-runs a configuration's trace with: raw is the drive without
# placement; fio's static placement is region's (metadata and slots apart) without fdpblk.
SIM_POLICY = {"raw": "none", "fio-static": "region"}
CLASSES = ["checkpoint_header", "checkpoint_payload", "slot_header", "slot_payload", "slot_padding", "outside"]


def blk_events(trace_dir, text=None):
    """Completed, error-free data events of the device in DIR/device, from DIR/trace.txt
    (blkparse's default text) or from `text`: (time, op, offset, len), op write/read/discard."""
    majmin = open(os.path.join(trace_dir, "device")).read().split()[1]
    out = []
    with open(text or os.path.join(trace_dir, "trace.txt"), errors="replace") as f:
        for line in f:
            p = line.split()
            # maj,min cpu seq sec.nsec pid action RWBS sector + blocks [error]
            if len(p) < 11 or p[0] != majmin or p[5] != "C" or p[8] != "+":
                continue
            if p[10] != "[0]":
                continue
            rwbs = p[6].lstrip("F")
            op = {"W": "write", "R": "read", "D": "discard"}.get(rwbs[:1])
            if op is None:
                continue
            try:
                t, sector, blocks = float(p[3]), int(p[7]), int(p[9])
            except ValueError:
                continue
            out.append((t, op, sector * 512, blocks * 512))
    return out


def shared_clock(d):
    """The workload device's and the drive's events of configuration dir `d` on one clock.
    Each capture's text counts time from its own first event, and the drive's capture starts
    earlier (before `fdpblk add`), so merging the two texts would put every drive event late:
    a deallocation after the write that followed it. One blkparse over both captures' binary
    files (kept where trace-*/bin-dir says) counts from the first event of either."""
    wl, dr = os.path.join(d, "trace-workload"), os.path.join(d, "trace-drive")
    bins = [open(os.path.join(t, "bin-dir")).read().strip() for t in (wl, dr)]
    merged = os.path.join(os.path.dirname(bins[0]), "shared-clock")
    os.makedirs(merged, exist_ok=True)
    names = []
    for t, b in zip((wl, dr), bins):
        name = open(os.path.join(t, "device")).read().split()[0]
        names.append(name)
        for f in os.listdir(b):
            if f.startswith(name + ".blktrace."):
                dst = os.path.join(merged, f)
                if not os.path.lexists(dst):
                    os.symlink(os.path.join(b, f), dst)
    text = os.path.join(merged, "trace.txt")
    cmd = ["blkparse", "-D", merged, "-o", text] + [x for n in names for x in ("-i", n)]
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.exit(f"waf-compare: {' '.join(cmd)} failed: {r.stderr.strip()}")
    return blk_events(wl, text), blk_events(dr, text)


def sim_events(workload, drive, own_lo):
    """The simulated drive's events: the workload's writes and reads and, with fdpblk
    (`own_lo`: where its own state begins), the drive's deallocations inside the exported
    range (its trims), in time order; at one time stamp a deallocation goes after the writes."""
    sim = [(t, o, off, n) for t, o, off, n in workload if o in ("write", "read")]
    if own_lo is not None:
        sim += [(t, o, off, n) for t, o, off, n in drive if o == "discard" and off + n <= own_lo]
    sim.sort(key=lambda e: (e[0], e[1] == "discard"))
    return sim


class Runs:
    """Disjoint, sorted runs [start, end) of blocks: a drive's worth of deallocated blocks in
    memory by the run, not by the block (a set of a 1.88 TB drive's blocks takes tens of GB)."""

    def __init__(self):
        self.starts, self.ends = [], []

    def _span(self, lo, hi):
        """Indexes [i, j) of the runs that overlap or touch [lo, hi)."""
        return bisect.bisect_left(self.ends, lo), bisect.bisect_right(self.starts, hi)

    def add(self, lo, hi):
        if lo >= hi:
            return
        i, j = self._span(lo, hi)
        if i < j:
            lo, hi = min(lo, self.starts[i]), max(hi, self.ends[j - 1])
        self.starts[i:j], self.ends[i:j] = [lo], [hi]

    def remove(self, lo, hi):
        if lo >= hi:
            return
        i, j = self._span(lo, hi)
        keep_s, keep_e = [], []
        for s, e in zip(self.starts[i:j], self.ends[i:j]):
            if s < lo:
                keep_s.append(s), keep_e.append(lo)
            if e > hi:
                keep_s.append(hi), keep_e.append(e)
        self.starts[i:j], self.ends[i:j] = keep_s, keep_e

    def overlap(self, lo, hi):
        i, j = self._span(lo, hi)
        return sum(max(0, min(e, hi) - max(s, lo)) for s, e in zip(self.starts[i:j], self.ends[i:j]))


def reads_of_deallocated(events, block=4096):
    """Bytes the workload read from blocks the drive had deallocated and nobody wrote since:
    never any, as fdpblk deallocates only what LMCache no longer references; in the merged
    event order a count above 0 means the two clocks were not one."""
    gone, bad = Runs(), 0
    for _, o, off, n in events:
        lo, hi = off // block, (off + n + block - 1) // block
        if o == "discard":
            gone.add(-(-off // block), (off + n) // block)
        elif o == "write":
            gone.remove(lo, hi)
        elif o == "read":
            bad += block * gone.overlap(lo, hi)
    return bad


def total(events, op, lo=0, hi=None):
    return sum(n for _, o, off, n in events if o == op and off >= lo and (hi is None or off < hi))


def fdp_delta(before, after):
    """Per placement ID bytes from RUAMW (modulo the RU), and the HBMW/MBMW deltas."""
    lba, rub = before["lba_size"], before["ru_blocks"]
    b = {r["pid"]: r["ruamw"] for r in before["ruhs"]}
    a = {r["pid"]: r["ruamw"] for r in after["ruhs"]}
    # Why the per-PID bytes cannot be known (the rest of the report still can).
    unknown = None if rub else "the drive reports no reclaim unit size (RUNS below one block)"
    missing = [r["pid"] for r in before["ruhs"] if r["pid"] not in a]
    if unknown is None and missing:
        unknown = f"placement ID {missing[0]} is not in the drive's status after the run (FDP reconfigured?)"
    pids = {}
    if unknown is None:
        for i, r in enumerate(before["ruhs"]):
            pids[str(i)] = ((b[r["pid"]] - a[r["pid"]]) % rub) * lba
    host = int(after["hbmw"]) - int(before["hbmw"])
    media = int(after["mbmw"]) - int(before["mbmw"])
    return {
        "bytes_by_pid_index": pids,
        "pid_by_index": {str(i): r["pid"] for i, r in enumerate(before["ruhs"])},
        "host_bytes": host,
        "media_bytes": media,
        "media_host_ratio": media / host if host else None,
        # Media bytes erased (MBE): what garbage collection and reclaim unit resets cost the
        # flash; on a drive without GC (QEMU's) only its RU resets.
        "erased_bytes": int(after["mbe"]) - int(before["mbe"]) if "mbe" in before and "mbe" in after else None,
        "ru_bytes": rub * lba,
        # RUAMW counts modulo the RU size: exact only while the per-PID sum is the host bytes.
        "pid_bytes_exact": unknown is None and sum(pids.values()) == host,
        "pid_bytes_unknown": unknown,
        # Below one RU in all, no placement ID can have written a whole one: the per-PID
        # bytes are exact. Above, they are known modulo the RU only (a PM9D3a's are about 6 GB).
        "pid_bytes_below_one_ru": host < rub * lba,
        # HBMW counts metadata bytes too ("host bytes with metadata written").
        "lba_metadata": before.get("lba_metadata", 0),
        "lba_size": lba,
    }


# FDP event types after which a handle's reclaim unit changed without host writes filling it
# (NVMe FDP: RU Not Fully Written, RU Time Limit Exceeded, Controller Level Reset Modified
# RUHs, Implicitly Modified RUH).
RU_CHANGING_EVENTS = {0x00, 0x01, 0x02, 0x81}


def ru_events(d):
    """The FDP events in configuration dir `d`'s window (`fdp stats` before and after; an event
    in the after log and not in the before one) that change a reclaim unit without host
    writes, as "NAME (placement ID P)", or "NAME" where the event names no placement ID (its
    PIV flag clear: every one may have changed). Where either log could not be read, none (the
    drive may not log them at all: its FDP events are off unless enabled)."""
    try:
        logs = [json.load(open(os.path.join(d, f"fdp-stats-{w}.json")))["events"] for w in ("before", "after")]
    except (OSError, ValueError, KeyError):
        return []
    new = []
    for kind in ("host", "controller"):
        before, after = (l.get(kind, {}).get("events") for l in logs)
        if before is None or after is None:
            continue
        # Counted, not a set: an event identical to an earlier one (a drive with a coarse
        # timestamp) is new all the same.
        key = lambda e: json.dumps(e, sort_keys=True)
        fresh = collections.Counter(map(key, after)) - collections.Counter(map(key, before))
        for e in after:
            if e.get("type") in RU_CHANGING_EVENTS and fresh[key(e)] > 0:
                name = e.get("name", str(e.get("type")))
                new.append(f"{name} (placement ID {e['pid']})" if e.get("fdpef", 0) & 1 and "pid" in e else name)
    return sorted(set(new))


def events_on(events, pid):
    """Those of `events` (ru_events) that may have changed placement ID `pid`'s reclaim unit:
    the ones that name it, or name none. `pid` None: any."""
    return [e for e in events if pid is None or not e.endswith(")") or e.endswith(f"(placement ID {pid})")]


def fdpblk_counters(c, d):
    """fdpblk's own counters of configuration `c` (dir `d`), if fdpblk ran it."""
    sp = os.path.join(d, "fdpblk-stats.json")
    if not os.path.exists(sp):
        return None
    s = json.load(open(sp))
    pl = s["pipeline"]
    return {
        "policy": s.get("policy"),
        "engine": s.get("engine"),
        "handles": {k: v for k, v in pl.get("handles", {}).items()},
        "write_bytes": pl["ops"]["write"]["bytes"],
        "own_state_bytes": s.get("own_state", {}).get("bytes_written"),
        # Early evictions: older checkpoint containers' header blocks zeroed, on the
        # own-state handle, inside the exported range.
        "zeroed_container_bytes": s.get("trim", {}).get("containers_invalidated_bytes", 0),
        "trim_bytes": s.get("trim", {}).get("trim_bytes"),
        # Everything fdpblk deallocated on the drive in this run: evicted slots (the drive
        # was erased before it, so the device's whole-life count is this run's), stale tails
        # and never-written slots, whose fill `--precondition` wrote (`reclaimed`).
        "reclaimed_bytes": s.get("trim", {}).get("reclaimed_bytes", 0),
        "deallocated_bytes": sum(s.get("trim", {}).get(k) or 0 for k in ("trim_bytes", "tail_trim_bytes", "reclaimed_bytes")),
        "own_state_handle": OWN_STATE_HANDLE[c],
    }


def untraced_row(c, d, row):
    """A configuration run with --no-trace: the bytes on the workload's device are the
    writer's own counts, the drive's are its counters (HBMW, RUAMW); fdpblk's own state is
    what the drive wrote beyond them. No classes from a trace and no simulated drive."""
    w = json.load(open(os.path.join(d, "writer.json")))["run"]["device_bytes"]
    row["writer_bytes"] = w
    # The writer counts a payload's padding to its block as payload.
    row["classes"] = {k: w.get(k, 0) for k in CLASSES}
    row["classified_bytes"] = sum(row["classes"].values())
    row["workload_write_bytes"] = row["classified_bytes"]
    row["workload_source"] = "the writer's counts"
    fdp = row["fdp"]
    row["drive_write_bytes"] = fdp["host_bytes"]
    row["drive_write_bytes_blktrace"] = None
    f = fdpblk_counters(c, d)
    # No trace of the drive: fdpblk's own count of what it deallocated; the writer issues none.
    row["drive_discard_bytes"] = f["deallocated_bytes"] if f else None
    row["fdpblk_overhead"] = data_overhead(fdp, row["workload_write_bytes"])
    row["sim"] = {}
    if f:
        row["fdpblk"] = f
        row["own_state_bytes"] = round(drive_data_bytes(fdp)) - row["workload_write_bytes"] - f["zeroed_container_bytes"]
    else:
        row["own_state_bytes"] = 0
    return row


def drive_data_bytes(fdp):
    """The data bytes the drive was written: HBMW counts each block's metadata too, and
    lba / (lba + metadata) of it is data."""
    return fdp["host_bytes"] * fdp["lba_size"] / (fdp["lba_size"] + fdp["lba_metadata"])


def data_overhead(fdp, workload_bytes):
    """Data bytes on the drive over the bytes written on the workload's device."""
    if not workload_bytes:
        return None
    return drive_data_bytes(fdp) / workload_bytes


def replay(fdpblk, trace_lines, path, policy, geom, ssd=None, extra=()):
    """`fdpblk replay --json` of trace_lines (written to path as JSON lines), or of the
    file at path as it is when trace_lines is None."""
    if trace_lines is not None:
        with open(path, "w") as f:
            for t in trace_lines:
                f.write(json.dumps(t) + "\n")
    cmd = [fdpblk, "replay", path, "--json", "--policy", policy] + list(extra) + geom
    if ssd:
        cmd += ["--ssd"] + ssd
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"waf-compare: {' '.join(cmd)}: {r.stderr.strip()}")
    with open(path + ".cmd", "w") as f:
        f.write(" ".join(cmd) + "\n")
    return json.loads(r.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--fdpblk", required=True)
    ap.add_argument("--drive", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--configs", required=True)
    ap.add_argument("--ssd-op", default="0.07")
    ap.add_argument("--ssd-ru-size")
    ap.add_argument("--command", default="")
    ap.add_argument("--fdpblk-version", default="")
    ap.add_argument("--kernel", default="")
    ap.add_argument("--precondition", action="store_true")
    ap.add_argument("--no-trace", action="store_true")
    ap.add_argument("geom", nargs="*")
    a = ap.parse_args()
    rows = []
    raw_trace = None
    for c in a.configs.split():
        d = os.path.join(a.out, c)
        wdev = open(os.path.join(d, "workload-device")).read().strip()
        fdp = fdp_delta(json.load(open(os.path.join(d, "fdp-before.json"))), json.load(open(os.path.join(d, "fdp-after.json"))))
        row = {"config": c, "workload_device": wdev, "fdp": fdp, "ru_events": ru_events(d)}
        # --precondition: what the fill wrote (HBMW before it to before the workload).
        bf = os.path.join(d, "fdp-before-fill.json")
        if os.path.exists(bf):
            row["fill_bytes"] = int(json.load(open(os.path.join(d, "fdp-before.json")))["hbmw"]) - int(json.load(open(bf))["hbmw"])
        policy = SIM_POLICY.get(c, c)
        row["sim_policy"] = policy
        if a.no_trace:
            rows.append(untraced_row(c, d, row))
            step(c)
            continue
        nvme_ev = blk_events(os.path.join(d, "trace-drive"))
        if c in ("raw", "fio-static"):
            own_lo = None
            wl_ev = nvme_ev if c == "raw" else raw_trace
        else:
            own_lo = int(open(os.path.join(d, "exported-bytes")).read())
            wl_ev = blk_events(os.path.join(d, "trace-workload"))
        if c == "raw":
            raw_trace = nvme_ev
        if wl_ev is None:
            sys.exit("waf-compare: fio-static needs the raw configuration's trace")
        # Bytes on the workload's device.
        if c == "fio-static":
            fj = json.load(open(os.path.join(d, "fio.json")))
            row["workload_write_bytes"] = sum(j["write"]["io_bytes"] for j in fj["jobs"])
            row["workload_source"] = "fio (replay of raw's trace)"
        else:
            row["workload_write_bytes"] = total(wl_ev, "write")
            row["workload_source"] = "blktrace"
            w = json.load(open(os.path.join(d, "writer.json")))
            row["writer_bytes"] = w["run"]["device_bytes"]
        # Bytes on the drive: blktrace of the namespace (passthrough I/O, fio's, shows no
        # sectors there: HBMW is the count then).
        row["drive_write_bytes_blktrace"] = total(nvme_ev, "write")
        row["drive_discard_bytes"] = total(nvme_ev, "discard")
        row["drive_write_bytes"] = fdp["host_bytes"]
        row["own_state_bytes"] = total(nvme_ev, "write", own_lo) if own_lo is not None else 0
        row["fdpblk_overhead"] = data_overhead(fdp, row["workload_write_bytes"])
        # Classes: the workload device's trace (its completed requests) through fdpblk's
        # blkparse reader and classifier; writes only (replay's classes count every op).
        wl_dir = os.path.join(a.out, "raw", "trace-drive") if c == "fio-static" else os.path.join(d, "trace-workload" if own_lo is not None else "trace-drive")
        wl_txt = os.path.join(d, "classes.blkparse.txt")
        with open(os.path.join(wl_dir, "trace.txt"), errors="replace") as src, open(wl_txt, "w") as dst:
            for line in src:
                p = line.split()
                # The completions blk_events counts as written: error-free, with a sector range.
                if len(p) >= 11 and p[5] == "C" and p[6].lstrip("F")[:1] == "W" and p[8] == "+" and p[10] == "[0]":
                    dst.write(line)
        rep = replay(a.fdpblk, None, wl_txt, policy, a.geom, extra=["--format", "blkparse", "--blk-event", "C"])
        row["classes"] = {k: rep["classes"].get(k, {}).get("bytes", 0) for k in CLASSES}
        row["classified_bytes"] = sum(row["classes"].values())
        # The simulated drive: the workload's writes and reads, and the drive's deallocations
        # inside the exported range (fdpblk's trims of evicted slots), in time order.
        sim_wl, sim_dr = shared_clock(d) if own_lo is not None else (wl_ev, nvme_ev)
        sim = sim_events(sim_wl, sim_dr, own_lo)
        row["sim_reads_of_deallocated_bytes"] = reads_of_deallocated(sim)
        if own_lo is not None:
            # How far the workload capture's own clock is behind the shared one: the time
            # between the two captures' first events.
            row["sim_clock_offset_s"] = round(sim_wl[0][0] - wl_ev[0][0], 6) if sim_wl and wl_ev else None
            # The same merge on each capture's own clock, as this report once did: evidence
            # of what the shared clock changes.
            row["sim_reads_of_deallocated_bytes_clocks_apart"] = reads_of_deallocated(sim_events(wl_ev, nvme_ev, own_lo))
        # The WAF window starts after one pass of writes over the modelled drive (the trace's
        # furthest byte): a fill costs no garbage collection and would pull the figure toward 1.
        fill = max((off + n for _, o, off, n in sim if o == "write"), default=0)
        ssd = ["--ssd-op", a.ssd_op, "--ssd-warmup", str(fill)] + (["--ssd-ru-size", a.ssd_ru_size] if a.ssd_ru_size else [])
        srep = replay(a.fdpblk, [{"op": o, "offset": off, "len": n} for _, o, off, n in sim], os.path.join(d, "sim.jsonl"), policy, a.geom, ssd)
        row["sim"] = srep["ssd"]
        fdpblk = fdpblk_counters(c, d)
        if fdpblk:
            row["fdpblk"] = fdpblk
        rows.append(row)
        step(c)

    checks = consistency(rows)
    report = {"drive": a.drive, "workload": a.workload, "geometry": a.geom, "ssd_op": float(a.ssd_op),
              "command": a.command, "fdpblk_version": a.fdpblk_version, "kernel": a.kernel, "preconditioned": a.precondition, "traced": not a.no_trace, "configs": rows, "checks": checks}
    json.dump(report, open(os.path.join(a.out, "report.json"), "w"), indent=1)
    open(os.path.join(a.out, "report.md"), "w").write(markdown(report))
    chart = {
        "title": "waf-compare: " + os.path.basename(a.workload),
        "y_label": "ratio",
        "y_min": 0.9,
        "series": ["fdpblk overhead (drive/ublk bytes)", "drive media/host"] + ([] if a.no_trace else ["simulated device waf"]),
        "groups": [{"name": r["config"], "values": [r["fdpblk_overhead"], r["fdp"]["media_host_ratio"]] + ([] if a.no_trace else [r["sim"].get("waf")])} for r in rows],
    }
    json.dump(chart, open(os.path.join(a.out, "chart.json"), "w"))
    r = subprocess.run([a.fdpblk, "plot", os.path.join(a.out, "chart.json"), "--out", os.path.join(a.out, "chart.png")], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"waf-compare: fdpblk plot: {r.stderr.strip()}")
    sys.stdout.write(markdown(report))
    bad = [k for k in checks if not k["ok"]]
    if bad:
        sys.exit("waf-compare: inconsistent counts: " + "; ".join(k["what"] for k in bad))


def consistency(rows):
    """Cross-checks between independent counts; each {what, got, want, ok}."""
    out = []

    def eq(what, got, want):
        out.append({"what": what, "got": got, "want": want, "ok": got == want})

    def skip(what, why):
        out.append({"what": what, "got": None, "want": None, "ok": True, "skipped": why})

    for r in rows:
        c = r["config"]
        fd = r["fdp"]
        ru = fd["ru_bytes"]

        def hbmw_eq(what, got, want):
            # A format with metadata: HBMW holds more than the data bytes the others count.
            if fd["lba_metadata"]:
                skip(what, f"the LBA format has {fd['lba_metadata']} metadata bytes per block, which HBMW counts")
            else:
                eq(what, got, want)

        def pid_eq(what, got, want, index=None):
            # A reclaim unit the drive changed itself (its time limit, a reset) restarts the
            # handle's RUAMW without host writes: that placement ID's bytes (and the sum of
            # all) no longer add up; the other placement IDs' still do.
            pid = None if index is None else fd.get("pid_by_index", {}).get(index)
            ev = events_on(r.get("ru_events") or [], pid)
            if fd.get("pid_bytes_unknown"):
                skip(what, fd["pid_bytes_unknown"])
            elif ev:
                skip(what, "the drive changed reclaim units itself during the run (FDP events: " + ", ".join(ev) + ")")
            elif got is None or want is None or fd["pid_bytes_below_one_ru"]:
                eq(what, got, want)
            else:
                # Each placement ID's RUAMW delta is known modulo the RU only.
                out.append({"what": what + " (modulo the RU: the run wrote a whole RU or more)", "got": got % ru,
                            "want": want % ru, "ok": (got - want) % ru == 0})

        traced = r["workload_source"] != "the writer's counts"
        if traced:
            eq(f"{c}: bytes on the workload device = classified bytes", r["classified_bytes"], r["workload_write_bytes"])
        if "writer_bytes" in r and traced:
            wb = r["writer_bytes"]
            eq(f"{c}: checkpoint bytes, blktrace vs the writer", r["classes"]["checkpoint_header"] + r["classes"]["checkpoint_payload"],
               wb["checkpoint_header"] + wb["checkpoint_payload"])
            eq(f"{c}: slot bytes, blktrace vs the writer", r["classes"]["slot_header"] + r["classes"]["slot_payload"] + r["classes"]["slot_padding"],
               wb["slot_header"] + wb["slot_payload"])
        if r["drive_write_bytes_blktrace"] is not None and (r["workload_source"] == "blktrace" and c == "raw" or "fdpblk" in r):
            hbmw_eq(f"{c}: drive bytes, blktrace vs HBMW", r["drive_write_bytes_blktrace"], r["drive_write_bytes"])
        if c == "raw":
            hbmw_eq("raw: drive bytes (HBMW) = the workload's bytes", r["drive_write_bytes"], r["workload_write_bytes"])
        pid_checks = [(f"{c}: per-PID bytes (RUAMW) add up to HBMW", sum(fd["bytes_by_pid_index"].values()), None)]
        if c == "raw":
            pid_checks.append(("raw: all bytes on placement ID 0", fd["bytes_by_pid_index"].get("0"), "0"))
        for what, got, index in pid_checks:
            if fd["lba_metadata"]:
                skip(what, f"the LBA format has {fd['lba_metadata']} metadata bytes per block, which HBMW counts")
            else:
                pid_eq(what, got, r["drive_write_bytes"], index)
        if c == "fio-static":
            raw = next((x for x in rows if x["config"] == "raw"), None)
            if raw:
                eq("fio-static: fio replayed raw's bytes", r["workload_write_bytes"], raw["workload_write_bytes"])
                ck = raw["classes"]["checkpoint_header"] + raw["classes"]["checkpoint_payload"]
                pid_eq("fio-static: metadata bytes on placement ID 1", fd["bytes_by_pid_index"].get("1"), ck, "1")
                pid_eq("fio-static: slot bytes on placement ID 2", fd["bytes_by_pid_index"].get("2"), raw["workload_write_bytes"] - ck, "2")
        if "sim_reads_of_deallocated_bytes" in r:
            # LMCache never reads a slot fdpblk deallocated: on the merged traces, a read of
            # deallocated bytes means the two captures were merged out of order.
            eq(f"{c}: reads of deallocated bytes on the simulated drive", r["sim_reads_of_deallocated_bytes"], 0)
        f = r.get("fdpblk")
        if f:
            eq(f"{c}: fdpblk's write bytes = " + ("blktrace on the ublk device" if traced else "the writer's"), f["write_bytes"], r["workload_write_bytes"])
            # fdpblk's counter is read before del, so the drive saw its final state write too.
            out.append({"what": f"{c}: fdpblk's own-state bytes before del <= drive writes past the exported capacity",
                        "got": f["own_state_bytes"], "want": r["own_state_bytes"], "ok": 0 < f["own_state_bytes"] <= r["own_state_bytes"]})
            own = r["own_state_bytes"] + f["zeroed_container_bytes"]
            if traced:
                hbmw_eq(f"{c}: drive bytes = ublk bytes + own-state bytes + zeroed checkpoint headers", r["drive_write_bytes"], r["workload_write_bytes"] + own)
            if fd.get("pid_bytes_unknown"):
                skip(f"{c}: placement ID bytes (RUAMW) = fdpblk's handle bytes", fd["pid_bytes_unknown"])
            for i, got in sorted(fd["bytes_by_pid_index"].items(), key=lambda kv: int(kv[0])):
                want = f["handles"].get(i, 0) + (own if int(i) == f["own_state_handle"] else 0)
                pid_eq(f"{c}: placement ID index {i}: drive bytes (RUAMW) = fdpblk's handle {i} bytes + own state there", got, want, i)
    return out


def human(n):
    if n is None:
        return "-"
    for unit, s in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << s:
            return f"{n / (1 << s):.2f} {unit}"
    return f"{n} B"


def ratio(x):
    return "-" if x is None else f"{x:.3f}"


def markdown(rep):
    rows = rep["configs"]
    m = [f"# waf-compare: `{os.path.basename(rep['workload'])}` on `{rep['drive']}`", "",
         f"Command: `{rep['command']}`; {rep['fdpblk_version']}; kernel {rep['kernel']}.", ""]
    if rep.get("preconditioned"):
        fills = ", ".join(f"{r['config']} {human(r.get('fill_bytes'))}" for r in rows)
        m += ["Each configuration ran on a full drive: after the deallocation, one sequential write of the whole "
              f"namespace (the drive's HBMW over it: {fills}); the drive's counters and traces start after it."]
        reclaimed = [f"{r['config']} {human(r['fdpblk']['reclaimed_bytes'])}" for r in rows if r.get("fdpblk", {}).get("reclaimed_bytes")]
        if reclaimed:
            m += ["fdpblk with trim deallocates the fill in the slots LMCache never wrote and no checkpoint lists "
                  f"(README, \"Unwritten slots\"): {', '.join(reclaimed)}; that space is spare to the drive from then "
                  "on, part of what fdpblk gains over the configurations without it (the `deallocated` column holds "
                  "it with the evicted slots and stale tails)."]
        m.append("")
    else:
        m += ["Each configuration ran on a deallocated drive: what the workload leaves unwritten is spare space "
              "to the drive, so drive media/host reads low (`--precondition` fills the drive first).", ""]
    m.append("| configuration | workload device | written there | checkpoint | slot header | slot payload | fdpblk state | on the drive (HBMW) | deallocated | fdpblk overhead | drive media/host | erased on the drive (MBE) | simulated device WAF |")
    m.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cl = r["classes"]
        m.append("| " + " | ".join([
            r["config"], f"`{r['workload_device']}`", human(r["workload_write_bytes"]),
            human(cl["checkpoint_header"] + cl["checkpoint_payload"]), human(cl["slot_header"]),
            human(cl["slot_payload"] + cl["slot_padding"]), human(r["own_state_bytes"]),
            human(r["drive_write_bytes"]), human(r["drive_discard_bytes"]), ratio(r["fdpblk_overhead"]),
            ratio(r["fdp"]["media_host_ratio"]), human(r["fdp"].get("erased_bytes")), ratio(r["sim"].get("waf")),
        ]) + " |")
    npid = max((len(r["fdp"]["bytes_by_pid_index"]) for r in rows), default=0)
    m += ["", "Bytes per placement ID on the drive (RUAMW deltas), and fdpblk's own per-handle counters:", ""]
    m.append("| configuration | " + " | ".join(f"PID {i}" for i in range(npid)) + " | fdpblk handles |")
    m.append("|---|" + "---|" * npid + "---|")
    for r in rows:
        p = r["fdp"]["bytes_by_pid_index"]
        f = r.get("fdpblk")
        fh = ", ".join(f"{k}: {human(v)}" for k, v in sorted(f["handles"].items(), key=lambda kv: int(kv[0]))) if f else "-"
        if f:
            fh += f"; own state {human(f['own_state_bytes'])} on {f['own_state_handle']}"
        m.append(f"| {r['config']} | " + " | ".join(human(p.get(str(i), 0)) for i in range(npid)) + f" | {fh} |")
    if not rep.get("traced", True):
        m += ["", "Run with --no-trace: bytes on the workload device are the writer's own counts, fdpblk state is "
              "what the drive wrote beyond them; no classes from a trace and no simulated drive."]
    else:
        m += ["", "Simulated device: the workload device's trace (fdpblk's deallocations included) through "
              f"`fdpblk replay --ssd` with the configuration's policy, {rep['ssd_op'] * 100:g} % over-provisioning; "
              "WAF over the writes after the first pass over the modelled drive (the fill, which costs no garbage "
              "collection, is left out; the whole trace's WAF follows it); "
              "blktrace carries no data, so policies that read slot headers or tenants (key-aware, lmcache-fdp) see "
              "none there and put every slot on handle 0, as `none` does: their rows are not those policies' WAF. "
              "Commands: `*/sim.jsonl.cmd`.", ""]
        for r in rows:
            s = r["sim"]
            m.append(f"- {r['config']} (`{r['sim_policy']}`): WAF {ratio(s.get('waf'))} after {human(s['warmup_bytes'])} "
                     f"(whole trace {ratio(s.get('waf_whole_trace'))}), host {human(s['host_bytes'])}, "
                     f"relocated {human(s['relocated_bytes'])}, {s['gc_events']} GC events, RU {human(s['ru_bytes'])}, "
                     f"logical {human(s['logical_bytes'])}")
    bad = [k for k in rep["checks"] if not k["ok"]]
    skipped = [k for k in rep["checks"] if k.get("skipped")]
    ran = len(rep["checks"]) - len(skipped)
    m += ["", f"Consistency checks: {ran - len(bad)} of {ran} hold" + (f"; {len(skipped)} not applicable" if skipped else "") + "."]
    for k in bad:
        m.append(f"- FAILED: {k['what']}: {k['got']} != {k['want']}")
    for k in skipped:
        m.append(f"- not applicable: {k['what']}: {k['skipped']}")
    return "\n".join(m) + "\n"


if __name__ == "__main__":
    main()
