//! The shell tools' usage errors: a bad command line gets the documented exit status and one
//! line naming what is wrong, before anything is traced or written (both need root and a
//! drive, which these checks never reach).

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
