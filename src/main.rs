use clap::Parser;
use fdpblk::cli::{Cli, Command};
use std::process::ExitCode;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FDPBLK_LOG").unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect(a) => fdpblk::cmd::inspect::run(&a),
        Command::Replay(a) => fdpblk::cmd::replay::run(&a),
        Command::Add(a) => fdpblk::cmd::device::add(&a),
        Command::Del(a) => fdpblk::cmd::device::del(&a),
        Command::List(a) => fdpblk::cmd::device::list(&a),
        Command::Recover(a) => fdpblk::cmd::device::recover(&a),
        Command::Stats(a) => fdpblk::cmd::device::stats(&fdpblk::cli::IdArgs { number: a.number, foreground: false }, a.json),
        Command::Features(a) => fdpblk::cmd::device::features(a.json),
        Command::Name(a) => fdpblk::cmd::device::name(a.id),
        Command::Fdp(a) => fdpblk::cmd::fdp::run(&a),
        Command::Simulate(a) => fdpblk::cmd::simulate::run(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fdpblk: {e}");
            ExitCode::FAILURE
        }
    }
}
