use clap::{CommandFactory, FromArgMatches};
use fdpblk::cli::{Cli, Command};
use std::process::ExitCode;

fn main() -> ExitCode {
    // Before anything opens a file: what the caller left open (a background daemon closes it).
    fdpblk::cmd::device::note_inherited_fds();
    // What root creates (state files, /run/fdpblk, /dev/fdpblk links) is never writable by
    // others, whatever umask the caller's shell had, nor closed to them by a stricter one
    // (LMCache's user opens /dev/fdpblk/NAME; `list` and `stats` read /run/fdpblk): 022, as
    // systemd gives a unit.
    if fdpblk::device::running_as_root() {
        // SAFETY: umask has no preconditions.
        unsafe { libc::umask(0o022) };
    }
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // Colour codes only on a terminal: a daemon's log file and journald get plain text, and so
    // does a daemon that `add` or `recover` starts from a terminal (it logs to a file).
    let daemonizes = match &cli.command {
        Command::Add(a) => !a.foreground,
        Command::Recover(a) => !a.foreground,
        _ => false,
    };
    let log = fdpblk::cmd::daemon_log::subscriber(
        || {
            // A background daemon's log file is kept small (it lives in /run, in memory).
            fdpblk::cmd::daemon_log::before_line(std::path::Path::new(fdpblk::frontend::state::RUN_DIR));
            std::io::stderr()
        },
        !daemonizes && std::io::IsTerminal::is_terminal(&std::io::stderr()),
    );
    let _ = tracing::subscriber::set_global_default(log);
    // Commands that print for a reader (`stats | head`, `list | grep -q`) end quietly when it
    // goes away, as other tools do, instead of panicking on EPIPE. Not the daemons: they keep
    // Rust's ignored SIGPIPE.
    if !matches!(cli.command, Command::Add(_) | Command::Up(_) | Command::Recover(_) | Command::Down(_) | Command::Del(_)) {
        // SAFETY: resetting a signal's disposition before any thread is started.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let result = match cli.command {
        Command::Inspect(a) => fdpblk::cmd::inspect::run(&a),
        Command::Replay(a) => fdpblk::cmd::replay::run(&a),
        Command::Add(mut a) => {
            // Flags given on the command line override the --config file.
            let explicit = matches.subcommand_matches("add").map(fdpblk::cmd::config_file::explicit_ids).unwrap_or_default();
            fdpblk::cmd::config_file::resolve_add(&mut a, &explicit).map_err(Into::into).and_then(|()| fdpblk::cmd::device::add(&a))
        }
        Command::Del(a) => fdpblk::cmd::device::del(&a),
        Command::List(a) => fdpblk::cmd::device::list(&a),
        Command::Recover(a) => fdpblk::cmd::device::recover(&a),
        Command::Stats(a) => fdpblk::cmd::device::id_of(a.number, a.name.as_deref()).and_then(|number| {
            if a.prometheus {
                fdpblk::cmd::metrics::print_device(number)
            } else {
                fdpblk::cmd::device::stats(&fdpblk::cli::IdArgs { number, foreground: false }, a.json)
            }
        }),
        Command::Up(a) => fdpblk::cmd::up::up(&a),
        Command::Down(a) => fdpblk::cmd::up::down(&a),
        Command::Metrics(a) => fdpblk::cmd::metrics::run(&a),
        Command::Features(a) => fdpblk::cmd::device::features(a.json),
        Command::Name(a) => fdpblk::cmd::device::name(a.id),
        Command::DriveDeltas(a) => fdpblk::cmd::device::drive_deltas(a.id),
        Command::Fdp(a) => fdpblk::cmd::fdp::run(&a),
        Command::Simulate(a) => fdpblk::cmd::simulate::run(&a),
        Command::Plot(a) => fdpblk::cmd::plot::run(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Not eprintln!, which panics where stderr cannot take the line (a daemon's
            // full log): the exit status says it failed all the same.
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "fdpblk: {e}");
            ExitCode::FAILURE
        }
    }
}
