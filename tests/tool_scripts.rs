//! The shell tools' usage errors, and the VM suite's plan: a bad command line gets the
//! documented exit status and one line naming what is wrong, before anything is traced or
//! written (both need root and a drive, which these checks never reach).

use std::path::PathBuf;
use std::process::Command;

fn run(script: &str, args: &[&str]) -> (i32, String) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(script);
    let out = Command::new("bash").arg(&path).args(args).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// capture-blktrace.sh: "2 bad usage", one line that names the option.
#[test]
fn capture_blktrace_refuses_a_bad_command_line_with_status_2() {
    assert_eq!(run("tools/trace/capture-blktrace.sh", &["--help"]).0, 0);
    for opt in ["-o", "--output", "-w", "--duration", "-e", "--iolog", "--keep", "-b", "-n"] {
        let (rc, err) = run("tools/trace/capture-blktrace.sh", &["/dev/null", opt]);
        assert_eq!((rc, err.trim_end()), (2, format!("capture-blktrace.sh: {opt} needs a value; see --help").as_str()));
    }
    let (rc, err) = run("tools/trace/capture-blktrace.sh", &["--bogus"]);
    assert_eq!(rc, 2, "{err}");
    assert!(err.contains("unknown option '--bogus'"), "{err}");
    let (rc, err) = run("tools/trace/capture-blktrace.sh", &[]);
    assert_eq!(rc, 2, "{err}");
    assert!(err.contains("no device given"), "{err}");
}

/// waf-compare: an option without its value is named before any configuration runs.
#[test]
fn waf_compare_names_an_option_without_its_value() {
    for opt in ["--drive", "--workload", "--configs", "--ssd-op"] {
        let (rc, err) = run("tools/waf-compare", &[opt]);
        assert_eq!((rc, err.trim_end()), (1, format!("waf-compare: {opt} needs a value (see --help)").as_str()));
    }
    let (rc, err) = run("tools/waf-compare", &["--bogus"]);
    assert_eq!(rc, 1, "{err}");
    assert!(err.contains("unknown option '--bogus'"), "{err}");
}

/// tests/vm/suite.sh's plan (`--list` starts no guest): a check's `vm-boot: NAME` header gives
/// it a boot of its own among the checks of its kernel, FDP setting and arguments, and its
/// label carries the name; a job count that is not one is refused.
#[test]
fn vm_suite_plans_named_boots_apart_and_refuses_a_bad_job_count() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("bash").arg(root.join("tests/vm/suite.sh")).arg("--list").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let plan = String::from_utf8_lossy(&out.stdout);
    // Each entry with the boot line it is under.
    let mut boot = String::new();
    let mut entries: Vec<(String, String)> = Vec::new();
    for line in plan.lines() {
        match line.strip_prefix("  ") {
            Some(entry) => entries.push((boot.clone(), entry.to_string())),
            None => boot = line.to_string(),
        }
    }
    let mut named = 0;
    for f in std::fs::read_dir(root.join("tests/vm/checks")).unwrap() {
        let path = f.unwrap().path();
        let check = path.file_stem().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&path).unwrap();
        let header = |key: &str| text.lines().take(30).find_map(|l| l.strip_prefix(&format!("# {key}: ")).map(|v| v.trim().to_string()));
        let mine: Vec<&(String, String)> = entries.iter().filter(|(_, e)| e.split('@').next() == Some(check.as_str())).collect();
        match header("vm-boot") {
            Some(name) => {
                named += 1;
                assert!(!mine.is_empty(), "{check} is not in the plan:\n{plan}");
                for (b, e) in mine {
                    assert!(b.ends_with(&format!(" (boot {name})")), "{check} (vm-boot {name}) is under '{b}'");
                    assert!(e.ends_with(&format!(",{name}")), "{check}'s label '{e}' lacks its boot's name");
                }
            }
            None if header("vm-host").is_none() => {
                for (b, _) in mine {
                    assert!(!b.contains("(boot "), "{check} has no vm-boot header but is under '{b}'");
                }
            }
            None => {}
        }
    }
    assert!(named > 0, "no check names a boot of its own: nothing here was tested");
    for bad in ["0", "x", "100"] {
        let (rc, err) = run("tests/vm/suite.sh", &["--list", "-j", bad]);
        assert_eq!(rc, 1, "-j {bad}: {err}");
        assert!(err.contains(&format!("-j takes a number of boots at a time from 1 to 99, not '{bad}'")), "{err}");
    }
}
