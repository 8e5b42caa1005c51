//! `/etc/fdpblk/NAME.toml`: what `fdpblk add` takes, as a file (`fdpblk add --config FILE`,
//! `fdpblk up NAME`, the systemd unit `fdpblk@NAME.service`).
//!
//! Every key is a long flag of `fdpblk add` with `_` for `-` (`slot_bytes` is
//! `--slot-bytes`, `no_trim` is `--no-trim`, `number` is `-n`/`--number`); `--foreground`,
//! `--force` (a one-time decision about a device's old data, not a setting) and `--config`
//! are not keys. Sizes are a number of bytes or a string with a K/M/G/T suffix, like
//! the flags. A flag given on the command line overrides the file. An unknown key, a value of
//! the wrong type or a TOML syntax error is a one-line error that names the key (or line) and
//! the fix; so is a value `fdpblk add` refuses ([`name_config_keys`]). Example:
//! `deploy/fdpblk.example.toml`.

use crate::cli::{parse_size, AddArgs, GeometryArgs};
use crate::frontend::config::{MAX_DEPTH, MAX_QUEUES};
use clap::parser::ValueSource;
use clap::ArgMatches;
use std::path::{Path, PathBuf};

/// Where `fdpblk up NAME` and the systemd unit look for `NAME.toml`.
pub const CONFIG_DIR: &str = "/etc/fdpblk";

/// The keys of a config file, in the order `fdpblk add --help` lists the flags.
pub const KEYS: [&str; 20] = [
    "backing",
    "backing_id",
    "engine",
    "policy",
    "layout",
    "block_align",
    "header_bytes",
    "slot_bytes",
    "meta_total_bytes",
    "capacity_bytes",
    "number",
    "queues",
    "depth",
    "io_buf_size",
    "name",
    "header_wait_us",
    "no_trim",
    "no_early_tails",
    "no_early_evictions",
    "persist_interval_ms",
];

/// The settings of one config file; `None` for a key the file does not set.
#[derive(Clone, Debug, Default)]
pub struct ConfigFile {
    pub path: PathBuf,
    pub backing: Option<PathBuf>,
    pub backing_id: Option<String>,
    pub engine: Option<String>,
    pub policy: Option<String>,
    pub layout: Option<String>,
    pub geometry: GeometryArgs,
    pub number: Option<i32>,
    pub queues: Option<u16>,
    pub depth: Option<u16>,
    pub io_buf_size: Option<u64>,
    pub name: Option<String>,
    pub header_wait_us: Option<u64>,
    pub no_trim: Option<bool>,
    pub no_early_tails: Option<bool>,
    pub no_early_evictions: Option<bool>,
    pub persist_interval_ms: Option<u64>,
}

/// The largest config file read: every key with a long comment is a few KiB.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Line (1-based) of byte `at` in `text`.
fn line_of(text: &str, at: usize) -> usize {
    text.as_bytes()[..at.min(text.len())].iter().filter(|&&b| b == b'\n').count() + 1
}

/// Whose files root takes settings from: root's, and those of the user who ran sudo or
/// pkexec to get root, with their group (their own file says nothing they could not pass as
/// flags; under a user private group their files are group-writable by that group).
struct Trusted {
    uids: Vec<u32>,
    gids: Vec<u32>,
}

impl Trusted {
    fn of_this_process() -> Trusted {
        let id = |var: &str| std::env::var(var).ok().and_then(|u| u.parse::<u32>().ok());
        Trusted {
            uids: std::iter::once(0).chain(id("SUDO_UID")).chain(id("PKEXEC_UID")).collect(),
            gids: std::iter::once(0).chain(id("SUDO_GID")).collect(),
        }
    }

    /// Why an account not trusted could change `m`: its owner, or a write bit for others
    /// or a group. In a sticky directory (/tmp) others cannot replace a file they do not
    /// own, so its write bits do not count (its owner still could).
    fn why_loose(&self, m: &std::fs::Metadata) -> Option<String> {
        use std::os::unix::fs::MetadataExt;
        let sticky = m.is_dir() && m.mode() & 0o1000 != 0;
        if !self.uids.contains(&m.uid()) {
            Some(format!("owned by uid {}", m.uid()))
        } else if m.mode() & 0o002 != 0 && !sticky {
            Some("writable by every user".to_string())
        } else if m.mode() & 0o020 != 0 && !self.gids.contains(&m.gid()) && !sticky {
            Some(format!("writable by group {}", m.gid()))
        } else {
            None
        }
    }
}

/// The directories above `path` as given (where a link to the file lies) and above `real`,
/// its resolved path, each once, nearest first, with their metadata (following links).
fn dirs_above(path: &Path, real: &Path) -> Vec<(PathBuf, std::fs::Metadata)> {
    let given = std::env::current_dir().map(|d| d.join(path)).unwrap_or_else(|_| path.to_path_buf());
    let mut out: Vec<(PathBuf, std::fs::Metadata)> = Vec::new();
    for d in given.ancestors().skip(1).chain(real.ancestors().skip(1)) {
        if d.as_os_str().is_empty() || out.iter().any(|(o, _)| o == d) {
            continue;
        }
        if let Ok(m) = std::fs::metadata(d) {
            out.push((d.to_path_buf(), m));
        }
    }
    out
}

/// Why config `path` (its metadata `file`; `dirs`, the directories it or a link to it lies
/// in) could say what an account other than `trusted` chose, when root is about to act on
/// it (a backing to write, a daemon to run). None where nothing could.
fn others_can_change(path: &Path, file: &std::fs::Metadata, dirs: &[(PathBuf, std::fs::Metadata)], trusted: &Trusted) -> Option<String> {
    let p = path.display();
    let fix = "whatever it says runs as root (the backing written, the daemon's settings)";
    if let Some(why) = trusted.why_loose(file) {
        return Some(if file.is_file() {
            format!("config {p} is {why}: {fix}; make it root's and writable by root only (`chown root:root {p} && chmod 644 {p}`)")
        } else {
            format!("config {p} is a pipe {why}: {fix}; write the settings to a file of root's (/etc/fdpblk/NAME.toml) and pass that")
        });
    }
    let (d, why) = dirs.iter().find_map(|(d, m)| Some((d, trusted.why_loose(m)?)))?;
    let d = d.display();
    Some(format!(
        "config {p} lies in {d}, which is {why}, so another account could replace it: {fix}; keep it in a directory of root's (/etc/fdpblk) or make {d} root's and writable by root only (`chown root:root {d} && chmod 755 {d}`)"
    ))
}

impl ConfigFile {
    /// Reads and parses `path`: at most [`MAX_CONFIG_BYTES`] of UTF-8 text, not a directory
    /// nor a block device (`--config /dev/nvme0n1`, a slip, must not read the namespace).
    pub fn load(path: &Path) -> Result<Self, String> {
        let p = path.display();
        let cannot = |e: std::io::Error| format!("cannot read config {p}: {e}; create it (deploy/fdpblk.example.toml shows every key) or pass another --config");
        // A pipe (`--config <(...)`) is read as a file is, up to the same bound.
        let kind = std::fs::metadata(path).map_err(cannot)?.file_type();
        if kind.is_dir() || std::os::unix::fs::FileTypeExt::is_block_device(&kind) {
            return Err(format!(
                "config {p} is a {}, not a config file; pass the device's .toml file (deploy/fdpblk.example.toml shows every key)",
                if kind.is_dir() { "directory" } else { "block device" }
            ));
        }
        let f = std::fs::File::open(path).map_err(cannot)?;
        let meta = f.metadata().map_err(cannot)?;
        // A file or a pipe carries what someone wrote (a character device such as /dev/null
        // is the system's, and read as any text is).
        let fifo = std::os::unix::fs::FileTypeExt::is_fifo(&meta.file_type());
        if (meta.is_file() || fifo) && crate::device::running_as_root() {
            // Every directory a link or the file itself lies in; none for an anonymous pipe
            // (`--config <(...)`), which has no path to resolve.
            let dirs = match std::fs::canonicalize(path) {
                Ok(real) => dirs_above(path, &real),
                Err(_) if fifo => Vec::new(),
                Err(e) => return Err(format!("cannot resolve config {p}: {e}; pass the file's own path")),
            };
            if let Some(why) = others_can_change(path, &meta, &dirs, &Trusted::of_this_process()) {
                return Err(why);
            }
        }
        let text = super::read_text_at_most(f, MAX_CONFIG_BYTES, &format!("config {p}")).map_err(|e| format!("{e}; pass the device's .toml file"))?;
        Self::parse(path, &text)
    }

    /// Parses the text of a config file; `path` only names the file in errors.
    pub fn parse(path: &Path, text: &str) -> Result<Self, String> {
        let file = path.display();
        let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
            let line = e.span().map_or(String::new(), |s| format!(" line {}", line_of(text, s.start)));
            format!("{file}{line}: {}; write one `key = value` per line, strings in double quotes", e.message().trim_end())
        })?;
        let mut c = ConfigFile { path: path.to_path_buf(), ..Default::default() };
        for (key, value) in &table {
            let string = || {
                value.as_str().map(str::to_string).ok_or_else(|| format!("{file}: `{key}` must be a string in double quotes, e.g. {key} = \"{}\"", example(key)))
            };
            let size = || match value {
                toml::Value::Integer(n) if *n >= 0 => Ok(*n as u64),
                toml::Value::String(s) => parse_size(s).map_err(|e| format!("{file}: `{key}`: {e}")),
                _ => Err(format!("{file}: `{key}` must be a size in bytes, e.g. {key} = {} or {key} = \"{}\"", example(key), size_example(key))),
            };
            let int = |lo: i64, hi: i64| match value {
                toml::Value::Integer(n) if (lo..=hi).contains(n) => Ok(*n),
                _ => Err(format!("{file}: `{key}` must be a whole number from {lo} to {hi}, e.g. {key} = {}", example(key))),
            };
            match key.as_str() {
                // Not taken relative to anything: a service runs in `/`, not where its file is.
                "backing" => match PathBuf::from(string()?) {
                    b if b.is_relative() => {
                        return Err(format!("{file}: `backing` must be an absolute path (a relative one would be taken from the directory fdpblk runs in), e.g. backing = \"{}\"", example(key)))
                    }
                    b => c.backing = Some(b),
                },
                "backing_id" => c.backing_id = Some(string()?),
                "engine" => c.engine = Some(string()?),
                "policy" => c.policy = Some(string()?),
                "layout" => c.layout = Some(string()?),
                "name" => c.name = Some(string()?),
                "block_align" => c.geometry.block_align = Some(size()?),
                "header_bytes" => c.geometry.header_bytes = Some(size()?),
                "slot_bytes" => c.geometry.slot_bytes = Some(size()?),
                "meta_total_bytes" => c.geometry.meta_total_bytes = Some(size()?),
                "capacity_bytes" => c.geometry.capacity_bytes = Some(size()?),
                "io_buf_size" => c.io_buf_size = Some(size()?),
                "number" => c.number = Some(int(-1, i64::from(i32::MAX))? as i32),
                "queues" => c.queues = Some(int(1, i64::from(MAX_QUEUES))? as u16),
                "depth" => c.depth = Some(int(1, i64::from(MAX_DEPTH))? as u16),
                "header_wait_us" => c.header_wait_us = Some(int(0, 1_000_000)? as u64),
                "persist_interval_ms" => c.persist_interval_ms = Some(int(0, i64::MAX)? as u64),
                "no_trim" => {
                    c.no_trim = Some(value.as_bool().ok_or_else(|| format!("{file}: `no_trim` must be true or false (no quotes)"))?)
                }
                "no_early_tails" => {
                    c.no_early_tails =
                        Some(value.as_bool().ok_or_else(|| format!("{file}: `no_early_tails` must be true or false (no quotes)"))?)
                }
                "no_early_evictions" => {
                    c.no_early_evictions =
                        Some(value.as_bool().ok_or_else(|| format!("{file}: `no_early_evictions` must be true or false (no quotes)"))?)
                }
                k => {
                    let underscored = k.replace('-', "_");
                    return Err(if KEYS.contains(&underscored.as_str()) {
                        format!("{file}: unknown key `{k}`; write it `{underscored}` (config keys use _ where flags use -)")
                    } else if k == "foreground" || k == "config" || k == "force" {
                        format!("{file}: unknown key `{k}`: --{k} is a command-line flag only; remove the line")
                    } else {
                        format!("{file}: unknown key `{k}`; remove it or use one of: {}", KEYS.join(", "))
                    });
                }
            }
        }
        Ok(c)
    }

    /// Sets on `a` every key the file has, except those `explicit` says were given on the
    /// command line (clap argument ids, which are the key names).
    pub fn apply(&self, a: &mut AddArgs, explicit: impl Fn(&str) -> bool) {
        macro_rules! set {
            ($($field:ident),*) => {$(
                if let Some(v) = &self.$field {
                    if !explicit(stringify!($field)) {
                        a.$field = v.clone();
                        a.from_config.push(stringify!($field));
                    }
                }
            )*};
        }
        macro_rules! set_geometry {
            ($($field:ident),*) => {$(
                if self.geometry.$field.is_some() && !explicit(stringify!($field)) {
                    a.geometry.$field = self.geometry.$field;
                    a.from_config.push(stringify!($field));
                }
            )*};
        }
        set!(backing, engine, policy, layout, number, queues, depth, io_buf_size, header_wait_us, no_trim, no_early_tails, no_early_evictions, persist_interval_ms);
        set_geometry!(block_align, header_bytes, slot_bytes, meta_total_bytes, capacity_bytes);
        macro_rules! set_option {
            ($($field:ident),*) => {$(
                if self.$field.is_some() && !explicit(stringify!($field)) {
                    a.$field = self.$field.clone();
                    a.from_config.push(stringify!($field));
                }
            )*};
        }
        set_option!(name, backing_id);
    }
}

/// `e`, an error about `fdpblk add`'s arguments, with the config file's keys behind the flags
/// it names: a flag the user never typed is found by its key in the file.
pub fn name_config_keys(e: String, a: &AddArgs) -> String {
    let Some(file) = &a.config else { return e };
    let names_flag = |flag: &str| {
        e.match_indices(flag).any(|(i, _)| !e[i + flag.len()..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_'))
    };
    let keys: Vec<String> = a
        .from_config
        .iter()
        .filter(|k| {
            names_flag(&format!("--{}", k.replace('_', "-")))
                || (**k == "number" && (e.starts_with("-n ") || e.contains("pick another -n")))
                || (**k == "backing" && !a.backing.as_os_str().is_empty() && names_flag(&a.backing.display().to_string()))
        })
        .map(|k| format!("`{k}`"))
        .collect();
    if keys.is_empty() {
        return e;
    }
    format!("{e} (from {} in {})", keys.join(", "), file.display())
}

/// `key = value` as a line of a config file, for a message that suggests one: a TOML
/// literal string, which keeps the value's `"` as they are, or, where the value holds a `'`
/// or a control character, a basic string with escapes.
pub fn toml_line(key: &str, value: &str) -> String {
    if value.contains('\'') || value.contains(char::is_control) {
        let escaped: String = value
            .chars()
            .map(|c| match c {
                '"' | '\\' => format!("\\{c}"),
                c if c.is_control() => format!("\\u{:04x}", c as u32),
                c => c.to_string(),
            })
            .collect();
        format!("{key} = \"{escaped}\"")
    } else {
        format!("{key} = '{value}'")
    }
}

fn example(key: &str) -> &'static str {
    match key {
        "backing" => "/dev/ng0n1",
        "backing_id" => "serial \\\"S6X1NG0T123456\\\" nsid 1",
        "engine" => "auto",
        "policy" => "key-aware",
        "layout" => "auto",
        "name" => "kv0",
        "block_align" | "header_bytes" => "4096",
        "slot_bytes" => "33558528",
        "meta_total_bytes" => "268435456",
        "capacity_bytes" => "0",
        "io_buf_size" => "524288",
        "number" => "-1",
        "queues" => "1",
        "depth" => "128",
        "header_wait_us" => "5000",
        "persist_interval_ms" => "5000",
        _ => "",
    }
}

fn size_example(key: &str) -> &'static str {
    match key {
        "meta_total_bytes" => "256M",
        "io_buf_size" => "512K",
        "capacity_bytes" => "1T",
        "slot_bytes" => "32M",
        _ => "4K",
    }
}

/// The ids of the arguments given on the command line (not defaults).
pub fn explicit_ids(m: &ArgMatches) -> Vec<String> {
    m.ids().filter(|id| m.value_source(id.as_str()) == Some(ValueSource::CommandLine)).map(|id| id.to_string()).collect()
}

/// Completes `fdpblk add`'s arguments: with `--config FILE` the file's keys fill in every
/// flag not given on the command line (`explicit`: see [`explicit_ids`]). Then the backing
/// must be known.
pub fn resolve_add(a: &mut AddArgs, explicit: &[String]) -> Result<(), String> {
    if let Some(path) = a.config.clone() {
        ConfigFile::load(&path)?.apply(a, |id| explicit.iter().any(|e| e == id));
        if a.backing.as_os_str().is_empty() {
            return Err(format!("no backing device: set backing = \"/dev/ngXnY\" in {} or pass --backing DEV", path.display()));
        }
    } else if a.backing.as_os_str().is_empty() {
        return Err("no backing device: pass --backing DEV (an NVMe namespace or a file), or --config FILE".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::{CommandFactory, FromArgMatches};

    fn add_args(argv: &[&str]) -> (AddArgs, Vec<String>) {
        let m = Cli::command().try_get_matches_from(argv).unwrap();
        let explicit = explicit_ids(m.subcommand_matches("add").unwrap());
        match Cli::from_arg_matches(&m).unwrap().command {
            Command::Add(a) => (a, explicit),
            _ => unreachable!(),
        }
    }

    fn write(text: &str) -> (tempdir::Dir, PathBuf) {
        let d = tempdir::Dir::new();
        let p = d.0.join("kv0.toml");
        std::fs::write(&p, text).unwrap();
        (d, p)
    }

    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Self {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let p = std::env::temp_dir().join(format!("fdpblk-cfg-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    const FULL: &str = r#"
backing = "/dev/ng0n1"
backing_id = 'serial "fdp0" nsid 1'
engine = "passthrough"
policy = "region"
layout = "lmcache"
name = "kv0"
number = 3
queues = 2
depth = 64
io_buf_size = "256K"
header_wait_us = 2000
no_trim = true
no_early_tails = true
no_early_evictions = true
persist_interval_ms = 0
block_align = 4096
header_bytes = "8K"
slot_bytes = 33558528
meta_total_bytes = "256M"
capacity_bytes = "1T"
"#;

    #[test]
    fn a_directory_a_huge_file_or_binary_is_refused_as_a_config_without_reading_it_whole() {
        let e = ConfigFile::load(Path::new("/dev/zero")).unwrap_err();
        assert!(e.contains("/dev/zero is over 1024 KiB"), "{e}");
        let d = tempdir::Dir::new();
        let e = ConfigFile::load(&d.0).unwrap_err();
        assert!(e.contains("is a directory, not a config file") && e.contains(".toml"), "{e}");
        let big = d.0.join("big.toml");
        std::fs::write(&big, vec![b'#'; MAX_CONFIG_BYTES as usize + 1]).unwrap();
        let e = ConfigFile::load(&big).unwrap_err();
        assert!(e.contains("is over 1024 KiB"), "{e}");
        let bin = d.0.join("bin.toml");
        std::fs::write(&bin, b"queues = 1\n\xff\xfe").unwrap();
        let e = ConfigFile::load(&bin).unwrap_err();
        assert!(e.contains("is not UTF-8 text (byte 11)"), "{e}");
        let e = ConfigFile::load(&d.0.join("missing.toml")).unwrap_err();
        assert!(e.contains("cannot read config") && e.contains("create it"), "{e}");
        std::fs::write(&big, b"queues = 2\n").unwrap();
        assert_eq!(ConfigFile::load(&big).unwrap().queues, Some(2));
    }

    /// Root takes no settings another account could have written: the file or its directory
    /// owned by another user, or writable by others or a group other than root's.
    #[test]
    fn a_config_another_account_could_change_is_refused_for_root() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let d = tempdir::Dir::new();
        let sub = d.0.join("etc");
        std::fs::create_dir(&sub).unwrap();
        let f = sub.join("kv0.toml");
        std::fs::write(&f, "queues = 1\n").unwrap();
        let mode = |p: &Path, m: u32| std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
        let me = std::fs::metadata(&f).unwrap().uid();
        let group = std::fs::metadata(&f).unwrap().gid();
        let only = |uid: u32, gid: u32| Trusted { uids: vec![uid], gids: vec![gid] };
        // The test's own directories only (those above the temp dir are the system's).
        let check = |path: &Path, t: &Trusted| {
            let real = std::fs::canonicalize(path).unwrap();
            let dirs: Vec<_> = dirs_above(path, &real).into_iter().filter(|(p, _)| p.starts_with(&d.0)).collect();
            others_can_change(path, &std::fs::metadata(path).unwrap(), &dirs, t)
        };
        let me_t = only(me, u32::MAX);
        for dir in [&d.0, &sub] {
            mode(dir, 0o755);
        }
        mode(&f, 0o644);
        assert_eq!(check(&f, &me_t), None);
        let e = check(&f, &only(me + 1, 0)).unwrap();
        assert!(e.contains(&format!("is owned by uid {me}")) && e.contains("chown root:root") && e.contains("runs as root"), "{e}");
        mode(&f, 0o646);
        let e = check(&f, &me_t).unwrap();
        assert!(e.contains("is writable by every user") && e.contains("chmod 644"), "{e}");
        // Group-writable: refused unless the group is trusted (root's, or sudo's caller's own).
        mode(&f, 0o664);
        assert!(check(&f, &me_t).unwrap().contains(&format!("writable by group {group}")));
        assert_eq!(check(&f, &only(me, group)), None);
        mode(&f, 0o644);
        // Any directory above it, not only its own, and a sticky one only for others' writes.
        mode(&d.0, 0o757);
        let e = check(&f, &me_t).unwrap();
        assert!(e.contains(&format!("lies in {}, which is writable by every user, so another account could replace it", d.0.display())) && e.contains("chmod 755"), "{e}");
        mode(&d.0, 0o1777);
        assert_eq!(check(&f, &me_t), None);
        assert!(check(&f, &only(me + 1, 0)).unwrap().contains("is owned by uid"));
        mode(&d.0, 0o755);
        // A link in a directory others write: they could point it elsewhere.
        let links = d.0.join("links");
        std::fs::create_dir(&links).unwrap();
        let link = links.join("kv0.toml");
        std::os::unix::fs::symlink(&f, &link).unwrap();
        mode(&links, 0o777);
        let e = check(&link, &me_t).unwrap();
        assert!(e.contains(&format!("lies in {}, which is writable by every user", links.display())), "{e}");
        mode(&links, 0o755);
        assert_eq!(check(&link, &me_t), None);
        // A pipe of another account: no chown to suggest.
        let fifo = d.0.join("kv1.toml");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path, live for the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        let e = others_can_change(&fifo, &std::fs::metadata(&fifo).unwrap(), &[], &only(me + 1, 0)).unwrap();
        assert!(e.contains("is a pipe owned by uid") && e.contains("write the settings to a file of root's") && !e.contains("chown"), "{e}");
        if crate::device::running_as_root() && std::env::var_os("SUDO_UID").is_none() {
            // As root, load itself refuses; a file handed over to another user is refused too.
            mode(&f, 0o666);
            assert!(ConfigFile::load(&f).unwrap_err().contains("writable by every user"));
            mode(&f, 0o644);
            std::os::unix::fs::chown(&f, Some(4242), None).unwrap();
            assert!(ConfigFile::load(&f).unwrap_err().contains("owned by uid 4242"));
            std::os::unix::fs::chown(&f, Some(0), None).unwrap();
            assert_eq!(ConfigFile::load(&f).unwrap().queues, Some(1));
        }
    }

    #[test]
    fn every_key_sets_its_flag() {
        let (_d, p) = write(FULL);
        let (mut a, explicit) = add_args(&["fdpblk", "add", "--config", p.to_str().unwrap()]);
        resolve_add(&mut a, &explicit).unwrap();
        assert_eq!(a.backing, PathBuf::from("/dev/ng0n1"));
        assert_eq!(a.backing_id.as_deref(), Some(r#"serial "fdp0" nsid 1"#));
        assert_eq!((a.engine.as_str(), a.policy.as_str(), a.layout.as_str()), ("passthrough", "region", "lmcache"));
        assert_eq!(a.name.as_deref(), Some("kv0"));
        assert_eq!((a.number, a.queues, a.depth, a.io_buf_size), (3, 2, 64, 256 << 10));
        assert_eq!((a.header_wait_us, a.no_trim, a.no_early_tails, a.no_early_evictions, a.persist_interval_ms), (2000, true, true, true, 0));
        let g = &a.geometry;
        assert_eq!(
            (g.block_align, g.header_bytes, g.slot_bytes, g.meta_total_bytes, g.capacity_bytes),
            (Some(4096), Some(8192), Some(33558528), Some(256 << 20), Some(1 << 40))
        );
    }

    #[test]
    fn command_line_overrides_the_file() {
        let (_d, p) = write(FULL);
        let (mut a, explicit) = add_args(&[
            "fdpblk", "add", "--config", p.to_str().unwrap(), "--backing", "/dev/nvme1n1", "--policy", "none", "-n", "7", "--slot-bytes", "64K", "-q", "1",
        ]);
        resolve_add(&mut a, &explicit).unwrap();
        assert_eq!(a.backing, PathBuf::from("/dev/nvme1n1"));
        assert_eq!(a.policy, "none");
        assert_eq!(a.number, 7);
        assert_eq!(a.queues, 1, "a flag equal to its default still overrides the file");
        assert_eq!(a.geometry.slot_bytes, Some(65536));
        // Keys not overridden come from the file, flags not in the file keep add's defaults.
        assert_eq!(a.engine, "passthrough");
        assert_eq!(a.geometry.meta_total_bytes, Some(256 << 20));
        let (_d2, p2) = write("backing = \"/dev/ng0n1\"\n");
        let (mut b, explicit) = add_args(&["fdpblk", "add", "--config", p2.to_str().unwrap()]);
        resolve_add(&mut b, &explicit).unwrap();
        assert_eq!((b.engine.as_str(), b.policy.as_str(), b.queues, b.depth), ("auto", "key-aware", 1, 128));
        assert!(!b.no_trim);
        // A switch the file turns on is turned off again by `--switch=false`; a bare switch
        // still turns it on.
        let (mut c, explicit) =
            add_args(&["fdpblk", "add", "--config", p.to_str().unwrap(), "--no-trim=false", "--no-early-tails=false", "--no-early-evictions"]);
        resolve_add(&mut c, &explicit).unwrap();
        assert_eq!((c.no_trim, c.no_early_tails, c.no_early_evictions), (false, false, true));
        let (d, _) = add_args(&["fdpblk", "add", "--backing", "/dev/ng0n1", "--no-trim", "--slot-bytes", "64K"]);
        assert!(d.no_trim && d.geometry.slot_bytes == Some(65536), "a bare switch takes no value");
    }

    /// The line a warning suggests reads back, through the config file's parser, as the value.
    #[test]
    fn a_suggested_line_reads_back_as_its_value() {
        assert_eq!(toml_line("backing_id", r#"serial "fdp0" nsid 1"#), r#"backing_id = 'serial "fdp0" nsid 1'"#);
        for v in [r#"serial "fdp0" nsid 1"#, r#"serial "it's \ 1" nsid 1"#, "serial \"a\tb\" nsid 2", "", "'"] {
            let line = toml_line("backing_id", v);
            let read = ConfigFile::parse(Path::new("kv0.toml"), &line).unwrap_or_else(|e| panic!("{line}: {e}"));
            assert_eq!(read.backing_id.as_deref(), Some(v), "{line}");
        }
    }

    #[test]
    fn keys_are_the_flags_of_add() {
        let cmd = Cli::command();
        let add = cmd.find_subcommand("add").unwrap();
        let mut flags: Vec<String> = add
            .get_arguments()
            .map(|a| a.get_id().to_string())
            .filter(|id| !matches!(id.as_str(), "config" | "foreground" | "force" | "help"))
            .collect();
        let mut keys: Vec<String> = KEYS.iter().map(|k| k.to_string()).collect();
        flags.sort();
        keys.sort();
        assert_eq!(flags, keys, "a flag of `fdpblk add` without a config key (or the reverse): update KEYS, ConfigFile and its docs");
        for a in add.get_arguments() {
            if let Some(long) = a.get_long() {
                if !matches!(long, "config" | "foreground" | "force") {
                    assert_eq!(long.replace('-', "_"), a.get_id().as_str(), "the key of --{long} is its flag with _ for -");
                }
            }
        }
    }

    #[test]
    fn errors_name_the_key_and_the_fix() {
        let p = Path::new("/etc/fdpblk/kv0.toml");
        let err = |t: &str| ConfigFile::parse(p, t).unwrap_err();
        let e = err("backing = \"/dev/ng0n1\"\nslot-bytes = 4096\n");
        assert!(e.contains("unknown key `slot-bytes`") && e.contains("`slot_bytes`"), "{e}");
        let e = err("bakcing = \"/dev/ng0n1\"\n");
        assert!(e.contains("unknown key `bakcing`") && e.contains("backing, backing_id, engine"), "{e}");
        let e = err("backing_id = 1\n");
        let example = r#"backing_id = "serial \"S6X1NG0T123456\" nsid 1""#;
        assert!(e.contains(example), "{e}");
        let read = ConfigFile::parse(p, example).unwrap();
        assert_eq!(read.backing_id.as_deref(), Some(r#"serial "S6X1NG0T123456" nsid 1"#), "the example is valid TOML");
        let e = err("[geometry]\nslot_bytes = 4096\n");
        assert!(e.contains("unknown key `geometry`"), "{e}");
        let e = err("foreground = true\n");
        assert!(e.contains("command-line flag only"), "{e}");
        let e = err("force = true\n");
        assert!(e.contains("--force is a command-line flag only"), "{e}");
        let e = err("queues = \"2\"\n");
        assert!(e.contains("`queues` must be a whole number from 1 to 32"), "{e}");
        // The bounds `add` takes, not u16's (70000 and 40 were told 0 to 65535 and 1..=32).
        for q in ["0", "40", "70000"] {
            assert!(err(&format!("queues = {q}\n")).contains("`queues` must be a whole number from 1 to 32"), "{q}");
        }
        assert!(err("depth = 5000\n").contains("`depth` must be a whole number from 1 to 4096"));
        let e = err("slot_bytes = -1\n");
        assert!(e.contains("`slot_bytes` must be a size in bytes, e.g. slot_bytes = 33558528 or slot_bytes = \"32M\""), "{e}");
        let e = err("slot_bytes = \"32Q\"\n");
        assert!(e.contains("`slot_bytes`") && e.contains("use K, M, G or T"), "{e}");
        let e = err("backing = /dev/ng0n1\n");
        assert!(e.starts_with("/etc/fdpblk/kv0.toml line 1:") && e.contains("double quotes"), "{e}");
        let e = err("backing = \"kv0.img\"\n");
        assert!(e.contains("`backing` must be an absolute path") && e.contains("backing = \"/dev/ng0n1\""), "{e}");
        let e = err("\n\nname = \"kv0\"\nname = \"kv1\"\n");
        assert!(e.contains("line 4"), "{e}");
        let e = err("no_trim = \"yes\"\n");
        assert!(e.contains("`no_trim` must be true or false"), "{e}");
        let e = err("engine = 1\n");
        assert!(e.contains("`engine` must be a string in double quotes, e.g. engine = \"auto\""), "{e}");
        for e in [err("x = 1\n"), err("backing = /dev/x\n"), err("queues = true\n")] {
            assert!(!e.contains('\n'), "one line: {e:?}");
        }
        let e = ConfigFile::load(Path::new("/nonexistent/fdpblk/kv0.toml")).unwrap_err();
        assert!(e.contains("cannot read config /nonexistent/fdpblk/kv0.toml") && e.contains("deploy/fdpblk.example.toml"), "{e}");
    }

    #[test]
    fn errors_about_a_flag_name_the_key_in_the_file_behind_it() {
        let (_d, p) = write("backing = \"/nonexistent/ng9n1\"\npolicy = \"nope\"\npersist_interval_ms = 10\nqueues = 2\nnumber = 3\n");
        let (mut a, explicit) = add_args(&["fdpblk", "add", "--config", p.to_str().unwrap(), "--depth", "0"]);
        resolve_add(&mut a, &explicit).unwrap();
        let from = |key: &str| format!(" (from `{key}` in {})", p.display());
        let e = name_config_keys(crate::cmd::device::validate(&a).unwrap_err(), &a);
        assert!(e.starts_with("unknown --policy nope; choose one of") && e.ends_with(&from("policy")), "{e}");
        a.policy = "none".into();
        let e = name_config_keys(crate::cmd::device::validate(&a).unwrap_err(), &a);
        assert!(e.starts_with("--persist-interval-ms 10: ") && e.ends_with(&from("persist_interval_ms")), "{e}");
        a.persist_interval_ms = 5000;
        let e = name_config_keys(crate::cmd::device::validate(&a).unwrap_err(), &a);
        assert_eq!(e, "--depth must be 1..=4096", "typed on the command line");
        a.depth = 1;
        let e = name_config_keys(crate::cmd::device::validate(&a).unwrap_err(), &a);
        assert!(e.starts_with("backing /nonexistent/ng9n1: ") && e.ends_with(&from("backing")), "{e}");
        assert_eq!(name_config_keys("--queues must be 1..=32".into(), &a), format!("--queues must be 1..=32{}", from("queues")));
        assert_eq!(name_config_keys("-n 3: in use".into(), &a), format!("-n 3: in use{}", from("number")));
        // Typed on the command line, not the file's: the error stays as it is.
        assert_eq!(name_config_keys("--depth must be 1..=4096".into(), &a), "--depth must be 1..=4096");
        // A longer flag that starts like a key's is not that key's; an error naming none is kept.
        assert_eq!(name_config_keys("--queues-x is wrong".into(), &a), "--queues-x is wrong");
        assert_eq!(name_config_keys("the drive is gone".into(), &a), "the drive is gone");
        let e = name_config_keys("--queues and --policy disagree".into(), &a);
        assert!(e.ends_with(&format!(" (from `policy`, `queues` in {})", p.display())), "{e}");
        // Without a config file nothing is added.
        let (b, _) = add_args(&["fdpblk", "add", "--backing", "/dev/ng0n1", "--queues", "0"]);
        assert_eq!(name_config_keys("--queues must be 1..=32".into(), &b), "--queues must be 1..=32");
    }

    #[test]
    fn backing_is_required_from_one_place() {
        let (_d, p) = write("name = \"kv0\"\n");
        let (mut a, explicit) = add_args(&["fdpblk", "add", "--config", p.to_str().unwrap()]);
        let e = resolve_add(&mut a, &explicit).unwrap_err();
        assert!(e.contains("set backing = ") && e.contains("--backing DEV"), "{e}");
        assert!(Cli::command().try_get_matches_from(["fdpblk", "add"]).is_err(), "without --config, --backing is required");
        let (mut a, explicit) = add_args(&["fdpblk", "add", "--backing", ""]);
        assert!(resolve_add(&mut a, &explicit).unwrap_err().contains("--backing DEV"));
    }

    #[test]
    fn sizes_take_numbers_and_suffixes() {
        let c = ConfigFile::parse(Path::new("x.toml"), "slot_bytes = \"32M\"\nmeta_total_bytes = 134217728\nio_buf_size = \"1MiB\"\n").unwrap();
        assert_eq!(c.geometry.slot_bytes, Some(32 << 20));
        assert_eq!(c.geometry.meta_total_bytes, Some(128 << 20));
        assert_eq!(c.io_buf_size, Some(1 << 20));
        assert_eq!(ConfigFile::parse(Path::new("x.toml"), "# nothing\n").unwrap().backing, None);
    }
}
