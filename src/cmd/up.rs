//! `fdpblk up` and `fdpblk down`: one device by its stable name, for systemd
//! (`deploy/fdpblk@.service`: ExecStart=`fdpblk up %i`, ExecStop=`fdpblk down %i`).
//!
//! `up NAME` reads `/etc/fdpblk/NAME.toml` and runs in the foreground. If a device of that
//! name exists and its daemon died (a crash, `kill -9`), it attaches a new daemon to it
//! (`fdpblk recover`): the driver held the I/O in flight and re-issues it, `/dev/fdpblk/NAME`
//! keeps pointing at the same `/dev/ublkbN`, and LMCache never sees the device go away. Else it
//! creates the device (`fdpblk add --config FILE --foreground`). It tells systemd
//! (`Type=notify`) once the device serves I/O and `/dev/fdpblk/NAME` exists.
//!
//! At boot the backing may not exist yet (a controller still probing, a namespace the
//! driver scans late): a start that creates the device waits up to [`BACKING_WAIT`] for its
//! path to appear, where the unit's restarts (five within a few seconds) would give up.
//!
//! `down NAME` deletes the device if its daemon runs. systemd runs ExecStop also after the
//! daemon crashed, before it restarts the unit: then the device is kept for `up` to recover.

use super::config_file::{ConfigFile, CONFIG_DIR};
use super::{device, CmdResult};
use crate::cli::{Cli, Command, DelArgs, IdArgs};
use crate::frontend::config::DeviceConfig;
use crate::frontend::state;
use clap::{Args, Parser};
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct UpArgs {
    /// The device's stable name (/dev/fdpblk/NAME); its config is /etc/fdpblk/NAME.toml.
    #[arg(required_unless_present = "config")]
    pub name: Option<String>,
    /// Config file to read instead of /etc/fdpblk/NAME.toml; without NAME the device's name
    /// is the file's `name`, else the file's stem.
    #[arg(long)]
    pub config: Option<PathBuf>,
}

/// The config file and the device name of `up`/`down`'s arguments.
fn resolve(u: &UpArgs, config_dir: &Path) -> Result<(PathBuf, String), String> {
    let checked = |n: String| state::check_new_name(&n).map(|_| n).map_err(|e| format!("device name {e} (the NAME of /dev/fdpblk/NAME)"));
    match (&u.name, &u.config) {
        (Some(n), Some(c)) => Ok((c.clone(), checked(n.clone())?)),
        (Some(n), None) => {
            let n = checked(n.clone())?;
            Ok((config_dir.join(format!("{n}.toml")), n))
        }
        (None, Some(c)) => {
            let stem = c.file_stem().and_then(|s| s.to_str()).unwrap_or("").to_string();
            let name = ConfigFile::load(c)?.name.unwrap_or(stem);
            if name.is_empty() {
                return Err(format!("{}: set name = \"...\" in it, or pass the device name: fdpblk up NAME --config FILE", c.display()));
            }
            Ok((c.clone(), checked(name)?))
        }
        (None, None) => Err("pass the device name (fdpblk up NAME reads /etc/fdpblk/NAME.toml) or --config FILE".into()),
    }
}

/// `fdpblk add`'s arguments for device `name` from `file`: add's defaults, then the file's keys.
fn add_args(file: &Path, name: &str) -> Result<crate::cli::AddArgs, String> {
    let argv = ["fdpblk", "add", "--foreground", "--config"];
    let cli = Cli::try_parse_from(argv.iter().map(std::ffi::OsStr::new).chain([file.as_os_str()])).map_err(|e| e.to_string())?;
    let Command::Add(mut a) = cli.command else { unreachable!("parsed as add") };
    // Only --foreground and --config were given: every key of the file applies.
    super::config_file::resolve_add(&mut a, &["foreground".into(), "config".into()])?;
    match &a.name {
        Some(n) if n != name => {
            return Err(format!(
                "{} sets name = \"{n}\" but it is the config of device {name}; remove the name line, or bring it up as {n} (`fdpblk up {n} --config {}`)",
                file.display(),
                file.display()
            ))
        }
        _ => a.name = Some(name.to_string()),
    }
    Ok(a)
}

/// What runs under a name now.
#[derive(Debug)]
pub(crate) enum Found {
    None,
    /// The daemon (`pid`) serves the device.
    Running { id: i32, pid: u32 },
    /// The daemon died; the driver holds the device (quiesced) for recovery.
    Orphaned { id: i32 },
    /// A state file of a device that no longer exists.
    Stale { cfg: Box<DeviceConfig> },
}

pub(crate) fn find(name: &str) -> Found {
    // A state file that a dead daemon left may name it too: a running device first, then
    // one held for recovery, then a stale file.
    let rank = |f: &Found| match f {
        Found::Running { .. } => 0,
        Found::Orphaned { .. } => 1,
        _ => 2,
    };
    let mut best = Found::None;
    for id in state::state_ids() {
        let read = state::read_state(id);
        let Ok((cfg, _)) = &read else { continue };
        if cfg.name.as_deref() != Some(name) {
            continue;
        }
        // The daemon serving it may not be the one its file names: a recovery whose state
        // file write failed serves under the file of the daemon that died.
        let f = if let Some(d) = device::serving_daemon(id, &read) {
            Found::Running { id, pid: d.pid }
        } else if device::still_ours(id, &read) {
            Found::Orphaned { id }
        } else {
            Found::Stale { cfg: Box::new(cfg.clone()) }
        };
        if matches!(best, Found::None) || rank(&f) < rank(&best) {
            best = f;
        }
    }
    best
}

/// Removes the state file and name link of a device that no longer exists ([`Found::Stale`]),
/// under the add lock, where the file still reads as it did and is still stale: between
/// [`find`] and here an add may have been given that id, cleared the old file and written its
/// own (`state::clear_stale`, under the same lock), which must stay.
pub(crate) fn remove_stale(cfg: &DeviceConfig) {
    // Without the lock (/run/fdpblk not writable, or flock refused) it goes on unlocked, as
    // before the lock: the file and link are checked again just before they go.
    let _one = crate::frontend::target::add_lock();
    let read = state::read_state(cfg.id);
    let same = read.as_ref().is_ok_and(|(c, _)| c == cfg);
    if same && device::serving_daemon(cfg.id, &read).is_none() && !device::still_ours(cfg.id, &read) {
        state::remove_state(cfg);
    }
}

/// How long `up` waits for a backing path that does not exist yet.
pub const BACKING_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Waits up to `limit` for `path` to exist, looking every `poll`; true once it does. Says
/// once that it waits.
fn wait_for_backing(path: &Path, limit: std::time::Duration, poll: std::time::Duration) -> bool {
    let deadline = std::time::Instant::now() + limit;
    let mut said = false;
    loop {
        // A link (/dev/disk/by-id/...) counts once what it names exists.
        if path.exists() {
            if said {
                tracing::info!("backing {} appeared", path.display());
            }
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        if !said {
            tracing::info!("backing {} does not exist yet: waiting up to {} s for it to appear", path.display(), limit.as_secs());
            said = true;
        }
        std::thread::sleep(poll);
    }
}

/// [`device::add`] from `up`, once the backing exists (or [`BACKING_WAIT`] passed: then the
/// add names what is missing).
fn add_when_the_backing_exists(a: &crate::cli::AddArgs) -> CmdResult {
    wait_for_backing(&a.backing, BACKING_WAIT, std::time::Duration::from_millis(250));
    device::add(a)
}

/// What [`find`] says once a daemon that is exiting has gone, waiting up to `tries` ×
/// `pause` for it: a daemon killed while the drive held its NVMe commands lingers until they
/// end (the kernel's I/O timeout, 30 s), and its device is then held for recovery, which
/// `down` would fail.
fn find_settled(mut find: impl FnMut() -> Found, exiting: impl Fn(u32) -> bool, tries: u32, pause: std::time::Duration, name: &str) -> Found {
    let mut f = find();
    for i in 0..tries {
        let Found::Running { pid, .. } = &f else { break };
        if !exiting(*pid) {
            break;
        }
        if i == 0 {
            // Not eprintln!: a full log must not end the recovery.
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "fdpblk: device {name}: its daemon (pid {pid}) is exiting (NVMe commands in flight); waiting up to {} s for it to go", (pause * tries).as_secs());
        }
        std::thread::sleep(pause);
        f = find();
    }
    f
}

pub fn up(u: &UpArgs) -> CmdResult {
    let (file, name) = resolve(u, Path::new(CONFIG_DIR))?;
    let a = add_args(&file, &name);
    match find_settled(|| find(&name), device::exiting, 450, std::time::Duration::from_millis(100), &name) {
        Found::Running { id, pid } if device::exiting(pid) => Err(format!(
            "device {name}: its daemon (pid {pid}) is still exiting (NVMe commands in flight); run `fdpblk up {name}` again once it is gone (it recovers {})",
            state::bdev_path(id)
        )
        .into()),
        Found::Running { id, pid } => Err(format!(
            "device {name} already runs as {} (pid {pid}); stop it first: fdpblk down {name} (or fdpblk del -n {id})",
            state::bdev_path(id)
        )
        .into()),
        Found::Orphaned { id } if device::ublk_stopped(id) => {
            // Its daemon died while stopping it: nothing to recover, start it afresh (the data
            // and fdpblk's saved state are on the backing).
            let a = a?;
            tracing::info!("device {name} ({}) was stopped when its daemon died: deleting it and adding it again", state::bdev_path(id));
            device::del(&crate::cli::DelArgs { number: Some(id), name: None, all: false, if_orphaned: false })?;
            add_when_the_backing_exists(&a)
        }
        Found::Orphaned { id } => {
            // The device's saved config is what runs: the file applies at the next clean start,
            // and a broken file must not keep LMCache's device from coming back.
            if let Err(e) = &a {
                tracing::warn!("{e} (recovering with the device's saved config)");
            }
            tracing::info!("device {name} ({}) lost its daemon: recovering it", state::bdev_path(id));
            device::recover(&IdArgs { number: id, foreground: true })
        }
        Found::Stale { cfg } => {
            let a = a?;
            remove_stale(&cfg);
            add_when_the_backing_exists(&a)
        }
        Found::None => add_when_the_backing_exists(&a?),
    }
}

pub fn down(u: &UpArgs) -> CmdResult {
    let name = match &u.name {
        Some(n) => n.clone(),
        None => resolve(u, Path::new(CONFIG_DIR))?.1,
    };
    // A daemon killed with NVMe commands in flight is still exiting: waited for, so that its
    // device is kept for recovery as any dead daemon's, not stopped under LMCache.
    match find_settled(|| find(&name), device::exiting, 450, std::time::Duration::from_millis(100), &name) {
        Found::Running { id, pid } if device::exiting(pid) => {
            return Err(format!(
                "device {name}: its daemon (pid {pid}) is still exiting (NVMe commands in flight), so it died: {} is kept for recovery (`fdpblk up {name}` once the daemon is gone); `fdpblk del -n {id}` deletes it",
                state::bdev_path(id)
            )
            .into())
        }
        // A device whose state file does not read, which /dev/fdpblk/NAME still leads to, is
        // this one: not "nothing to stop".
        Found::None => match linked_unreadable(&name) {
            None => device::say_out(format_args!("no fdpblk device named {name}; nothing to stop")),
            Some(id) => {
                return Err(format!(
                    "{} leads to device {id}, whose state file does not read, so it cannot be stopped by name: see `fdpblk list`; `fdpblk del -n {id}` stops it",
                    state::name_path(&name).display()
                )
                .into());
            }
        },
        Found::Running { id, .. } => {
            device::del(&DelArgs { number: Some(id), name: None, all: false, if_orphaned: false })?;
            device::say_out(format_args!("stopped {} ({name})", state::bdev_path(id)));
        }
        Found::Orphaned { id } => device::say_out(format_args!(
            "the daemon of {} ({name}) died: the device is kept for recovery; under systemd the unit's restart recovers it (`systemctl reset-failed fdpblk@{name}; systemctl start fdpblk@{name}` once it gave up), by hand `fdpblk up {name}`; `fdpblk del -n {id}` deletes it",
            state::bdev_path(id)
        )),
        Found::Stale { cfg } => remove_stale(&cfg),
    }
    Ok(())
}

/// The device `/dev/fdpblk/NAME` leads to, where it exists and its state file does not read.
pub(crate) fn linked_unreadable(name: &str) -> Option<i32> {
    let to = std::fs::read_link(state::name_path(name)).ok()?;
    // fdpblk's own link is absolute, udev's relative.
    let id: i32 = to.file_name()?.to_str()?.strip_prefix("ublkb")?.parse().ok()?;
    (state::state_path(id).exists() && state::read_state(id).is_err() && crate::frontend::target::device_exists(id)).then_some(id)
}

/// Tells systemd (`Type=notify`, `$NOTIFY_SOCKET`) that the device serves I/O. Does nothing
/// outside systemd.
pub fn notify_ready(id: i32) {
    let Some(sock) = std::env::var_os("NOTIFY_SOCKET") else { return };
    let msg = format!("READY=1\nSTATUS=serving {}\n", state::bdev_path(id));
    if let Err(e) = sd_notify(&sock, msg.as_bytes()) {
        tracing::warn!("cannot notify systemd at {}: {e}", Path::new(&sock).display());
    }
}

fn sd_notify(sock: &std::ffi::OsStr, msg: &[u8]) -> std::io::Result<()> {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    let bytes = sock.as_bytes();
    let addr = match bytes.first() {
        Some(b'@') => SocketAddr::from_abstract_name(&bytes[1..])?,
        Some(b'/') => SocketAddr::from_pathname(sock)?,
        _ => return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "NOTIFY_SOCKET is neither a path nor @abstract")),
    };
    UnixDatagram::unbound()?.send_to_addr(msg, &addr)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A killed daemon that is still exiting is waited for, then what runs is found again; a
    /// running one is not waited for.
    #[test]
    fn up_waits_for_a_daemon_that_is_exiting_and_not_for_one_that_runs() {
        use std::time::Duration;
        let pause = Duration::from_millis(1);
        // Exiting for three looks, then gone: the device is left for recovery.
        let mut looks = 0;
        let f = find_settled(
            || {
                looks += 1;
                if looks <= 3 { Found::Running { id: 4, pid: 77 } } else { Found::Orphaned { id: 4 } }
            },
            |pid| pid == 77,
            100,
            pause,
            "kv0",
        );
        assert!(matches!(f, Found::Orphaned { id: 4 }), "{f:?}");
        assert_eq!(looks, 4);
        // Running: no wait.
        let mut looks = 0;
        let f = find_settled(|| { looks += 1; Found::Running { id: 4, pid: 78 } }, |pid| pid == 77, 100, pause, "kv0");
        assert!(matches!(f, Found::Running { pid: 78, .. }) && looks == 1);
        // Exiting for longer than the wait: still running, as found last.
        let mut looks = 0;
        let f = find_settled(|| { looks += 1; Found::Running { id: 4, pid: 77 } }, |_| true, 5, pause, "kv0");
        assert!(matches!(f, Found::Running { pid: 77, .. }) && looks == 6);
    }

    #[test]
    fn up_waits_for_a_backing_that_appears_late_and_not_for_one_that_never_does() {
        use std::time::{Duration, Instant};
        let dir = std::env::temp_dir().join(format!("fdpblk-late-backing-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let late = dir.join("late.img");
        let _ = std::fs::remove_file(&late);
        let t = Instant::now();
        let maker = {
            let late = late.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(150));
                std::fs::write(&late, b"").unwrap();
            })
        };
        assert!(wait_for_backing(&late, Duration::from_secs(10), Duration::from_millis(10)));
        assert!(t.elapsed() >= Duration::from_millis(150), "it returned before the file existed");
        maker.join().unwrap();
        let t = Instant::now();
        assert!(!wait_for_backing(&dir.join("never.img"), Duration::from_millis(100), Duration::from_millis(10)));
        assert!(t.elapsed() >= Duration::from_millis(100));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn args(name: Option<&str>, config: Option<&Path>) -> UpArgs {
        UpArgs { name: name.map(String::from), config: config.map(Path::to_path_buf) }
    }

    fn temp_config(stem: &str, text: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("fdpblk-up-{}-{stem}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join(format!("{stem}.toml"));
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn name_and_file() {
        let dir = Path::new("/etc/fdpblk");
        assert_eq!(resolve(&args(Some("kv0"), None), dir).unwrap(), (PathBuf::from("/etc/fdpblk/kv0.toml"), "kv0".into()));
        assert!(resolve(&args(Some("../x"), None), dir).unwrap_err().contains("must be 1 to 128 of the characters"));
        for bad in ["", ".x", "a b", "kv0\n", "a/b", &"x".repeat(129)] {
            assert!(resolve(&args(Some(bad), None), dir).is_err(), "{bad:?}");
        }
        for good in ["kv0", "llama.8b", "a_b-c"] {
            assert!(resolve(&args(Some(good), None), dir).is_ok(), "{good:?}");
        }
        assert!(resolve(&args(None, None), dir).unwrap_err().contains("--config FILE"));
        let p = temp_config("stem0", "backing = \"/dev/ng0n1\"\n");
        assert_eq!(resolve(&args(None, Some(&p)), dir).unwrap().1, "stem0", "no name key: the file's stem");
        let q = temp_config("stem1", "backing = \"/dev/ng0n1\"\nname = \"kv9\"\n");
        assert_eq!(resolve(&args(None, Some(&q)), dir).unwrap().1, "kv9");
        assert_eq!(resolve(&args(Some("kv0"), Some(&q)), dir).unwrap(), (q.clone(), "kv0".into()));
        // The file's name must be the instance's.
        let e = add_args(&q, "kv0").unwrap_err();
        assert!(e.contains("sets name = \"kv9\" but it is the config of device kv0") && e.contains("`fdpblk up kv9 --config ") && !e.contains("rename"), "{e}");
        let a = add_args(&p, "stem0").unwrap();
        assert_eq!(a.name.as_deref(), Some("stem0"));
        assert!(a.foreground, "up runs in the foreground");
        assert_eq!((a.policy.as_str(), a.queues), ("key-aware", 1), "add's defaults");
        let _ = std::fs::remove_dir_all(p.parent().unwrap());
        let _ = std::fs::remove_dir_all(q.parent().unwrap());
    }

    #[test]
    fn notify_reaches_the_socket() {
        use std::os::unix::net::UnixDatagram;
        let path = std::env::temp_dir().join(format!("fdpblk-notify-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let rx = UnixDatagram::bind(&path).unwrap();
        sd_notify(path.as_os_str(), b"READY=1\n").unwrap();
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\n");
        let _ = std::fs::remove_file(&path);
        let name = format!("fdpblk-notify-test-{}", std::process::id());
        use std::os::linux::net::SocketAddrExt;
        let rx = UnixDatagram::bind_addr(&std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
        sd_notify(std::ffi::OsStr::new(&format!("@{name}")), b"READY=1\n").unwrap();
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\n");
        assert!(sd_notify(std::ffi::OsStr::new("relative"), b"x").is_err());
    }
}
