//! The `duplex` command line.
//!
//! `duplex check FILE` reads a schedule file (`shared/design/schedule-format.md`),
//! explores every interleaving of its host threads on the simulator, and
//! prints whether the program can hang, with the wait-for cycle and the
//! interleaving that leads there. Exit status: 0 no hang and no error, 1 a
//! hang or a program error, 2 the file cannot be read or is not valid, 3 the
//! search hit its state bound. This crate only parses arguments and prints;
//! the work is in `duplex` (the format) and `duplex-sim` (the rules).

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use duplex::{Policy, Size};
use duplex_sim::{check, compile, report::Report};

#[derive(Parser, Debug)]
#[command(name = "duplex", version, about = "NCCL point-to-point without hangs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Answers "can this program hang?" for a schedule file, on the simulator.
    Check(CheckArgs),
}

#[derive(clap::Args, Debug)]
struct CheckArgs {
    /// The schedule file.
    file: String,
    /// Place ops without comm=/stream= by this policy (overrides the file).
    #[arg(long, value_parser = parse_policy)]
    policy: Option<Policy>,
    /// Eager capacity of rule R5, e.g. 64MiB (overrides the file's model).
    #[arg(long, value_parser = Size::parse)]
    eager: Option<Size>,
    /// Any model setting, KEY=VALUE (eager, lazy-connect, comm-order,
    /// kernels); may be repeated; overrides the file.
    #[arg(long = "model", value_name = "KEY=VALUE")]
    model: Vec<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// Give up (exit status 3) after this many distinct states.
    #[arg(long, default_value_t = check::Options::default().max_states)]
    max_states: usize,
    /// Explore every interleaving without the partial-order reduction
    /// (slower; for cross-checking the reduction).
    #[arg(long)]
    no_reduction: bool,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Format {
    Text,
    Json,
}

fn parse_policy(s: &str) -> Result<Policy, String> {
    Policy::parse(s)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check(args) => run_check(&args),
    }
}

fn fail(message: &str) -> ExitCode {
    eprintln!("duplex: {message}");
    ExitCode::from(2)
}

fn run_check(args: &CheckArgs) -> ExitCode {
    let text = match std::fs::read(&args.file) {
        Ok(bytes) => match String::from_utf8(bytes) {
            Ok(t) => t,
            Err(e) => {
                let line = 1 + e.as_bytes()[..e.utf8_error().valid_up_to()]
                    .iter()
                    .filter(|b| **b == b'\n')
                    .count();
                return fail(&format!("{}:{line}: the file is not UTF-8 text", args.file));
            }
        },
        Err(e) => return fail(&format!("cannot read {}: {e}", args.file)),
    };
    let mut program = match duplex::schedule::parse(&text) {
        Ok(p) => p,
        Err(e) => return fail(&format!("{}:{}: {}", args.file, e.line, e.message)),
    };
    if let Some(p) = args.policy {
        program.policy = p;
    }
    for setting in &args.model {
        if let Err(e) = program.model.set(setting) {
            return fail(&format!("--model {setting}: {e}"));
        }
    }
    if let Some(e) = args.eager {
        program.model.eager = e;
    }
    let compiled = compile::compile(&program);
    let options = check::Options {
        max_states: args.max_states,
        reduce: !args.no_reduction,
    };
    let outcome = check::check(&compiled, &options);
    let report = Report::new(&args.file, program.policy, program.model, &outcome);
    let mut out = std::io::stdout().lock();
    let written = match args.format {
        Format::Text => write!(out, "{report}"),
        Format::Json => match serde_json::to_string_pretty(&report) {
            Ok(json) => writeln!(out, "{json}"),
            Err(e) => return fail(&format!("cannot encode the report as JSON: {e}")),
        },
    };
    // A closed pipe (`duplex check f | head`) is not an error of the check.
    let _ = written.and_then(|()| out.flush());
    ExitCode::from(report.exit_code() as u8)
}
