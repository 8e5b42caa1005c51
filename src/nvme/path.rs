//! From a device path to the NVMe controller, namespace and block device names, through
//! sysfs, with a fallback to the kernel's naming (`nvmeX`, `nvmeXnY`, `ngXnY`).
//!
//! - `/dev/nvmeX`: the controller's character device (admin commands).
//! - `/dev/nvmeXnY`: the namespace's block device; with native multipath X is the subsystem
//!   instance, and the controllers are found under `/sys/block/nvmeXnY/multipath/`.
//! - `/dev/ngXnY`: the namespace's generic character device (passthrough I/O, Linux ≥ 5.13).

use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// What kind of NVMe device a path names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DevKind {
    /// `/dev/nvmeX`.
    Controller,
    /// `/dev/nvmeXnY`.
    Block,
    /// `/dev/ngXnY`.
    Generic,
}

/// The names behind a device path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DevicePaths {
    /// The path as given.
    pub given: PathBuf,
    pub kind: DevKind,
    /// The kernel name of the given device (`nvme0`, `nvme0n1`, `ng0n1`).
    pub name: String,
    /// The controller's kernel name (`nvme0`).
    pub ctrl_name: String,
    /// The controller's character device (`/dev/nvme0`).
    pub ctrl_dev: PathBuf,
    /// The namespace's block device name (`nvme0n1`), for its sysfs queue limits.
    pub block_name: Option<String>,
}

/// Why a path does not lead to an NVMe device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PathError {
    Missing(PathBuf, String),
    NotNvme(PathBuf, String),
    Partition(PathBuf, String),
}

impl std::fmt::Display for PathError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PathError::Missing(p, e) => write!(f, "cannot open {}: {e}", p.display()),
            PathError::NotNvme(p, why) => write!(
                f,
                "{} is not an NVMe device ({why}); give a namespace (/dev/nvme0n1 or /dev/ng0n1) or a controller (/dev/nvme0)",
                p.display()
            ),
            PathError::Partition(p, parent) => write!(
                f,
                "{} is a partition; give the whole namespace /dev/{parent}, since NVMe commands address the namespace's LBAs",
                p.display()
            ),
        }
    }
}

impl std::error::Error for PathError {}

/// Splits `nvme<X>n<Y>` / `ng<X>n<Y>` / `nvme<X>` into (prefix, X, Y).
fn split_name(name: &str) -> Option<(&str, u32, Option<u32>)> {
    let (prefix, rest) =
        if let Some(r) = name.strip_prefix("nvme") { ("nvme", r) } else { ("ng", name.strip_prefix("ng")?) };
    let digits = |s: &str| -> Option<u32> {
        if s.is_empty() || !s.bytes().all(|c| c.is_ascii_digit()) {
            None
        } else {
            s.parse().ok()
        }
    };
    match rest.split_once('n') {
        None if prefix == "nvme" => Some((prefix, digits(rest)?, None)),
        None => None,
        Some((x, y)) => Some((prefix, digits(x)?, Some(digits(y)?))),
    }
}

/// The kind of an NVMe kernel device name, if it is one.
pub fn kind_of_name(name: &str) -> Option<DevKind> {
    match split_name(name)? {
        ("nvme", _, None) => Some(DevKind::Controller),
        ("nvme", _, Some(_)) => Some(DevKind::Block),
        ("ng", _, Some(_)) => Some(DevKind::Generic),
        _ => None,
    }
}

fn link_name(p: &Path) -> Option<String> {
    fs::canonicalize(p).ok()?.file_name()?.to_str().map(str::to_string)
}

/// The controller of a namespace device, from sysfs: its `device` link when that is a
/// controller, else the first path under `multipath/` (`nvme<S>c<C>n<N>` → `nvme<C>`).
fn ctrl_from_sysfs(sys: &Path, class_dir: &Path) -> Option<String> {
    if let Some(n) = link_name(&class_dir.join("device")) {
        if kind_of_name(&n) == Some(DevKind::Controller) && sys.join("class/nvme").join(&n).exists() {
            return Some(n);
        }
    }
    let mut paths: Vec<String> = fs::read_dir(class_dir.join("multipath"))
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    paths.sort();
    paths.iter().find_map(|p| {
        let c = p.strip_prefix("nvme")?.split_once('c')?.1.split_once('n')?.0;
        c.parse::<u32>().ok().map(|c| format!("nvme{c}"))
    })
}

/// The namespace's node of the other class: the block device of generic device `name`
/// (`from` "class/nvme-generic", `to` "class/block", `prefix` "nvme") or the other way round:
/// the one whose `device` link leads to the same parent (the controller, or a multipath
/// head's subsystem) and whose name ends in the same `n<H>`. The numbers before the `n` may
/// differ: a private namespace's block device is named after its subsystem, its generic
/// device after its controller. `None` when sysfs cannot tell (no `device` link, no class
/// directory); `Some(None)` when it tells that there is none.
fn sibling_in_sysfs(sys: &Path, from: &str, name: &str, to: &str, prefix: &str) -> Option<Option<String>> {
    let (_, _, h) = split_name(name)?;
    let h = h?;
    let parent = fs::canonicalize(sys.join(from).join(name).join("device")).ok()?;
    let mut found = fs::read_dir(sys.join(to))
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| matches!(split_name(n), Some((p, _, Some(y))) if p == prefix && y == h))
        .filter(|n| fs::canonicalize(sys.join(to).join(n).join("device")).is_ok_and(|d| d == parent));
    let first = found.next();
    // Two would be a layout this does not know: the naming rule decides then.
    if found.next().is_some() {
        return None;
    }
    Some(first)
}

/// The block device name of generic device `name` (`ng<C>n<H>`): from sysfs, else by the
/// kernel's usual naming (`nvme<C>n<H>`, where it exists).
fn block_of_generic(sys: &Path, name: &str) -> Option<String> {
    sibling_in_sysfs(sys, "class/nvme-generic", name, "class/block", "nvme").unwrap_or_else(|| {
        let b = format!("nvme{}", name.strip_prefix("ng")?);
        sys.join("class/block").join(&b).exists().then_some(b)
    })
}

/// The generic device name of block device `name` (`nvme<S>n<H>`): from sysfs, else by the
/// kernel's usual naming, where that generic device names this block device back.
fn generic_of_block(sys: &Path, name: &str) -> Option<String> {
    sibling_in_sysfs(sys, "class/block", name, "class/nvme-generic", "ng").unwrap_or_else(|| {
        let ng = format!("ng{}", name.strip_prefix("nvme")?);
        (block_of_generic(sys, &ng).as_deref() == Some(name)).then_some(ng)
    })
}

/// Resolves the names of a device already known by kind and kernel name, reading sysfs
/// under `sys` (normally `/sys`) and falling back to the naming scheme.
pub fn resolve_names(sys: &Path, given: &Path, kind: DevKind, name: &str) -> Result<DevicePaths, PathError> {
    let (_, x, _) =
        split_name(name).ok_or_else(|| PathError::NotNvme(given.to_path_buf(), format!("kernel name '{name}'")))?;
    let (ctrl_name, block_name) = match kind {
        DevKind::Controller => (name.to_string(), None),
        DevKind::Block => {
            let c = ctrl_from_sysfs(sys, &sys.join("class/block").join(name)).unwrap_or(format!("nvme{x}"));
            (c, Some(name.to_string()))
        }
        DevKind::Generic => {
            let b = block_of_generic(sys, name);
            // A multipath head's generic device links to the subsystem and has no `multipath/`
            // of its own: its block device's names the paths.
            let c = ctrl_from_sysfs(sys, &sys.join("class/nvme-generic").join(name))
                .or_else(|| ctrl_from_sysfs(sys, &sys.join("class/block").join(b.as_ref()?)))
                .unwrap_or(format!("nvme{x}"));
            (c, b)
        }
    };
    Ok(DevicePaths {
        given: given.to_path_buf(),
        kind,
        name: name.to_string(),
        ctrl_dev: PathBuf::from("/dev").join(&ctrl_name),
        ctrl_name,
        block_name,
    })
}

/// The block device (`/dev/nvmeXnY`) of the namespace `path` names, if the kernel made one
/// (a namespace in an LBA format it cannot use has only its generic char device).
pub fn namespace_block_device(path: &Path) -> Option<PathBuf> {
    resolve(path).ok()?.block_name.map(|b| Path::new("/dev").join(b))
}

/// The namespace's other node: its block device for its generic char device, and the other
/// way round (none for a file, or where the kernel made only one).
pub fn namespace_other_node(path: &Path) -> Option<PathBuf> {
    let p = resolve(path).ok()?;
    match p.kind {
        DevKind::Generic => p.block_name.map(|b| Path::new("/dev").join(b)),
        DevKind::Block => generic_of_block(Path::new("/sys"), &p.name).map(|ng| Path::new("/dev").join(ng)),
        DevKind::Controller => None,
    }
}

/// glibc's `gnu_dev_major` / `gnu_dev_minor`.
fn major_minor(dev: u64) -> (u64, u64) {
    (((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff), (dev & 0xff) | ((dev >> 12) & !0xff))
}

/// Resolves a device path (symlinks such as `/dev/disk/by-id/...` are followed).
pub fn resolve(path: &Path) -> Result<DevicePaths, PathError> {
    resolve_in(Path::new("/sys"), path)
}

/// [`resolve`] with another sysfs root.
pub fn resolve_in(sys: &Path, path: &Path) -> Result<DevicePaths, PathError> {
    let meta = fs::metadata(path).map_err(|e| PathError::Missing(path.to_path_buf(), e.to_string()))?;
    let ft = meta.file_type();
    let (sub, is_block) = if ft.is_block_device() {
        ("block", true)
    } else if ft.is_char_device() {
        ("char", false)
    } else {
        return Err(PathError::NotNvme(path.to_path_buf(), "not a device node".into()));
    };
    let (maj, min) = major_minor(meta.rdev());
    let devdir = sys.join("dev").join(sub).join(format!("{maj}:{min}"));
    // The kernel name from sysfs; without sysfs, the file name after following links.
    let name = link_name(&devdir)
        .or_else(|| fs::canonicalize(path).ok()?.file_name()?.to_str().map(str::to_string))
        .unwrap_or_default();
    if is_block && devdir.join("partition").exists() {
        let parent = fs::canonicalize(&devdir)
            .ok()
            .and_then(|p| p.parent()?.file_name()?.to_str().map(str::to_string))
            .unwrap_or_else(|| "nvme0n1".into());
        return Err(PathError::Partition(path.to_path_buf(), parent));
    }
    if let Some((base, part)) = name.rsplit_once('p') {
        if kind_of_name(base) == Some(DevKind::Block) && !part.is_empty() && part.bytes().all(|c| c.is_ascii_digit()) {
            return Err(PathError::Partition(path.to_path_buf(), base.to_string()));
        }
    }
    match kind_of_name(&name) {
        Some(k @ DevKind::Block) if is_block => resolve_names(sys, path, k, &name),
        Some(k @ (DevKind::Controller | DevKind::Generic)) if !is_block => resolve_names(sys, path, k, &name),
        _ => Err(PathError::NotNvme(
            path.to_path_buf(),
            format!("a {} device named '{name}'", if is_block { "block" } else { "character" }),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn names() {
        assert_eq!(kind_of_name("nvme0"), Some(DevKind::Controller));
        assert_eq!(kind_of_name("nvme12n3"), Some(DevKind::Block));
        assert_eq!(kind_of_name("ng0n1"), Some(DevKind::Generic));
        for bad in ["nvme", "ng0", "nvme0n", "nvme0n1p1", "sda", "nvmex", "ngn1", "nvme0c0n1", ""] {
            assert_eq!(kind_of_name(bad), None, "{bad}");
        }
        assert_eq!(major_minor(0x10301), (259, 1));
        // glibc makedev(259, 0x12345): the minor's high bits sit above bit 20.
        let dev = (259u64 << 8) | 0x45 | (0x12300u64 << 12);
        assert_eq!(major_minor(dev), (259, 0x12345));
    }

    /// A fake sysfs tree: one controller nvme1 with namespace nvme0n1 (multipath head named
    /// after subsystem 0), and its generic device ng0n1.
    fn fake_sys() -> tempfile_dir::Dir {
        let d = tempfile_dir::Dir::new();
        let s = d.path();
        let ctrl = s.join("devices/pci0000:00/0000:00:04.0/nvme/nvme1");
        fs::create_dir_all(&ctrl).unwrap();
        fs::create_dir_all(s.join("class/nvme")).unwrap();
        symlink(&ctrl, s.join("class/nvme/nvme1")).unwrap();
        // Non-multipath namespace under the controller.
        let ns = ctrl.join("nvme1n1");
        fs::create_dir_all(&ns).unwrap();
        symlink(&ctrl, ns.join("device")).unwrap();
        fs::create_dir_all(s.join("class/block")).unwrap();
        symlink(&ns, s.join("class/block/nvme1n1")).unwrap();
        // Multipath head nvme0n1 under the subsystem; path nvme0c1n1 via controller 1.
        let subsys = s.join("devices/virtual/nvme-subsystem/nvme-subsys0");
        let head = subsys.join("nvme0n1");
        fs::create_dir_all(head.join("multipath")).unwrap();
        symlink(&subsys, head.join("device")).unwrap();
        fs::create_dir_all(head.join("multipath/nvme0c1n1")).unwrap();
        symlink(&head, s.join("class/block/nvme0n1")).unwrap();
        // Generic device of the head.
        let ng = s.join("devices/virtual/nvme-generic/ng0n1");
        fs::create_dir_all(&ng).unwrap();
        symlink(&subsys, ng.join("device")).unwrap();
        fs::create_dir_all(s.join("class/nvme-generic")).unwrap();
        symlink(&ng, s.join("class/nvme-generic/ng0n1")).unwrap();
        d
    }

    #[test]
    fn sysfs_lookup() {
        let d = fake_sys();
        let s = d.path();
        let g = Path::new("/dev/x");
        let p = resolve_names(s, g, DevKind::Block, "nvme1n1").unwrap();
        assert_eq!((p.ctrl_name.as_str(), p.block_name.as_deref()), ("nvme1", Some("nvme1n1")));
        assert_eq!(p.ctrl_dev, PathBuf::from("/dev/nvme1"));
        // Multipath: the head's name says subsystem 0, the controller is nvme1.
        let p = resolve_names(s, g, DevKind::Block, "nvme0n1").unwrap();
        assert_eq!(p.ctrl_name, "nvme1");
        // ng0n1 → no controller link, no multipath dir of its own: its head's paths (nvme1).
        let p = resolve_names(s, g, DevKind::Generic, "ng0n1").unwrap();
        assert_eq!((p.ctrl_name.as_str(), p.block_name.as_deref()), ("nvme1", Some("nvme0n1")));
        // Without sysfs: names only.
        let p = resolve_names(Path::new("/nonexistent"), g, DevKind::Generic, "ng3n2").unwrap();
        assert_eq!((p.ctrl_name.as_str(), p.block_name), ("nvme3", None));
        let p = resolve_names(s, g, DevKind::Controller, "nvme4").unwrap();
        assert_eq!((p.ctrl_name.as_str(), p.block_name), ("nvme4", None));
    }

    /// A private namespace (no multipath head) of controller nvme2 in subsystem 5: its block
    /// device is named after the subsystem (nvme5n1), its generic device after the controller
    /// (ng2n1). Block device nvme2n1 is another drive's. Each node finds the other by sysfs.
    #[test]
    fn a_private_namespace_whose_subsystem_and_controller_numbers_differ() {
        let d = fake_sys();
        let s = d.path();
        let ctrl = |n: &str| {
            let c = s.join("devices/pci0000:00/0000:00:05.0/nvme").join(n);
            fs::create_dir_all(&c).unwrap();
            symlink(&c, s.join("class/nvme").join(n)).unwrap();
            c
        };
        let node = |parent: &Path, class: &str, n: &str| {
            let dir = parent.join(n);
            fs::create_dir_all(&dir).unwrap();
            symlink(parent, dir.join("device")).unwrap();
            symlink(&dir, s.join(class).join(n)).unwrap();
        };
        let (c2, c3) = (ctrl("nvme2"), ctrl("nvme3"));
        node(&c2, "class/block", "nvme5n1");
        node(&c2, "class/nvme-generic", "ng2n1");
        node(&c3, "class/block", "nvme2n1");
        node(&c3, "class/nvme-generic", "ng3n1");
        let p = resolve_names(s, Path::new("/dev/x"), DevKind::Generic, "ng2n1").unwrap();
        assert_eq!((p.ctrl_name.as_str(), p.block_name.as_deref()), ("nvme2", Some("nvme5n1")));
        assert_eq!(generic_of_block(s, "nvme5n1").as_deref(), Some("ng2n1"));
        assert_eq!(generic_of_block(s, "nvme2n1").as_deref(), Some("ng3n1"));
        // The fake's multipath head and its generic device, both under the subsystem.
        assert_eq!(generic_of_block(s, "nvme0n1").as_deref(), Some("ng0n1"));
        // sysfs says there is none: no guess by number.
        node(&c3, "class/nvme-generic", "ng5n2");
        assert_eq!(block_of_generic(s, "ng5n2"), None);
        // Without sysfs: the naming rule, where the other node exists.
        assert_eq!(block_of_generic(Path::new("/nonexistent"), "ng2n1"), None);
    }

    #[test]
    fn not_devices() {
        let e = resolve(Path::new("/nonexistent/nvme0n1")).unwrap_err();
        assert!(matches!(e, PathError::Missing(..)));
        let e = resolve(Path::new("/etc/hostname")).unwrap_err();
        assert!(e.to_string().contains("is not an NVMe device"), "{e}");
        let e = resolve(Path::new("/dev/null")).unwrap_err();
        assert!(matches!(e, PathError::NotNvme(..)), "{e}");
        assert!(e.to_string().contains("/dev/nvme0n1"), "{e}");
    }

    /// A minimal self-cleaning temporary directory (no extra dependency).
    mod tempfile_dir {
        pub struct Dir(std::path::PathBuf);
        impl Dir {
            pub fn new() -> Self {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let p = std::env::temp_dir().join(format!(
                    "fdpblk-nvme-path-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::Relaxed)
                ));
                let _ = std::fs::remove_dir_all(&p);
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
            pub fn path(&self) -> &std::path::Path {
                &self.0
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }
}
