//! The `duplex` command line.
//!
//! `duplex check FILE` reads a schedule file (`docs/schedule-format.md`),
//! explores every interleaving of its host threads on the simulator, and
//! prints whether the program can hang, with the wait-for cycle and the
//! interleaving that leads there. Exit status: 0 no hang and no error, 1 a
//! hang or a program error, 2 the file cannot be read or is not valid, 3 the
//! search hit its state bound. `duplex run FILE --backend nccl|sim` executes
//! a schedule file (on GPUs, or one random schedule of the simulator);
//! `duplex calibrate DIR` measures this machine's NCCL and compares every
//! file of DIR run on the GPUs with the checker's verdict. This crate only
//! parses arguments and prints; the work is in `duplex` (the format),
//! `duplex-sim` (the rules) and `duplex-nccl` (the GPUs).

mod calibrate;
mod run;

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use duplex::compile;
use duplex::{Policy, Size};
use duplex_sim::{check, report::Report};

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
    /// Executes a schedule file on GPUs (`--backend nccl`) or on one random
    /// schedule of the simulator (`--backend sim`), and reports what happened.
    Run(RunArgs),
    /// Measures this machine's NCCL (eager capacity) and runs every schedule
    /// file of DIR on the GPUs, comparing each outcome with `duplex check`.
    Calibrate(CalibrateArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Backend {
    Nccl,
    Sim,
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// The schedule file.
    file: String,
    /// Where to run it.
    #[arg(long, value_enum, default_value_t = Backend::Sim)]
    backend: Backend,
    /// Place ops without comm=/stream= by this policy (overrides the file).
    #[arg(long, value_parser = parse_policy)]
    policy: Option<Policy>,
    /// Deadline of every wait on GPUs, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
    /// The simulator's random schedule.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Any model setting, KEY=VALUE, for the run's own checks and hang
    /// analysis (e.g. one-sided-groups=accept); may be repeated; overrides
    /// the file.
    #[arg(long = "model", value_name = "KEY=VALUE")]
    model: Vec<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
}

#[derive(clap::Args, Debug)]
struct CalibrateArgs {
    /// The folder of schedule files.
    dir: String,
    /// Deadline of every wait, in milliseconds.
    #[arg(long, default_value_t = 3000)]
    timeout_ms: u64,
    /// Output format: markdown or json.
    #[arg(long, value_enum, default_value_t = TableFormat::Markdown)]
    format: TableFormat,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum TableFormat {
    Markdown,
    Json,
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
    /// Exit with status 1 when the program is ok only because of its
    /// model's eager capacity or warm channels (a latent hang).
    #[arg(long)]
    deny_latent: bool,
    /// Follow this schedule (`v1:…`, printed with a counterexample) instead
    /// of exploring, and report where it leads.
    #[arg(long, value_name = "SCHEDULE")]
    replay: Option<String>,
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
        Command::Run(args) => run_run(&args),
        Command::Calibrate(args) => run_calibrate(&args),
    }
}

fn fail(message: &str) -> ExitCode {
    eprintln!("duplex: {message}");
    ExitCode::from(2)
}

/// Reads and parses a schedule file; the error is the message to print.
fn load(file: &str) -> Result<duplex::schedule::Program, String> {
    let text = match std::fs::read(file) {
        Ok(bytes) => match String::from_utf8(bytes) {
            Ok(t) => t,
            Err(e) => {
                let line = 1 + e.as_bytes()[..e.utf8_error().valid_up_to()]
                    .iter()
                    .filter(|b| **b == b'\n')
                    .count();
                return Err(format!("{file}:{line}: the file is not UTF-8 text"));
            }
        },
        Err(e) => return Err(format!("cannot read {file}: {e}")),
    };
    duplex::schedule::parse(&text).map_err(|e| format!("{file}:{}: {}", e.line, e.message))
}

fn print(text: &str) {
    let mut out = std::io::stdout().lock();
    // A closed pipe (`duplex ... | head`) is not an error of the command.
    let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
}

fn run_run(args: &RunArgs) -> ExitCode {
    let mut program = match load(&args.file) {
        Ok(p) => p,
        Err(m) => return fail(&m),
    };
    if let Some(p) = args.policy {
        program.policy = p;
    }
    for setting in &args.model {
        if let Err(e) = program.model.set(setting) {
            return fail(&format!("--model {setting}: {e}"));
        }
    }
    let ran = match args.backend {
        Backend::Sim => run::on_sim(&program, args.seed),
        Backend::Nccl => {
            match run::on_nccl(&program, std::time::Duration::from_millis(args.timeout_ms)) {
                Ok(r) => r,
                Err(e) => return fail(&e.to_string()),
            }
        }
    };
    match args.format {
        Format::Json => match serde_json::to_string_pretty(&ran) {
            Ok(j) => print(&format!("{j}\n")),
            Err(e) => return fail(&format!("cannot encode the report as JSON: {e}")),
        },
        Format::Text => {
            let head = match ran.outcome.as_str() {
                "ok" => "completed",
                "deadlock" if matches!(args.backend, Backend::Sim) => {
                    "HANGS (the simulator reached a state where no host thread can move)"
                }
                "deadlock" => {
                    "HUNG (the deadline expired; the backend aborted the communicators involved)"
                }
                _ => "FAILED",
            };
            print(&format!(
                "{}: {head} in {:.3} s\n{}",
                args.file, ran.seconds, ran.detail
            ));
        }
    }
    ExitCode::from(if ran.outcome == "ok" { 0 } else { 1 })
}

fn run_calibrate(args: &CalibrateArgs) -> ExitCode {
    let timeout = std::time::Duration::from_millis(args.timeout_ms);
    let (cap, rows) = match calibrate::calibrate(std::path::Path::new(&args.dir), timeout) {
        Ok(r) => r,
        Err(e) => return fail(&e.to_string()),
    };
    let model = duplex::Model {
        eager: Size(cap.fits),
        one_sided_groups: true,
        ..duplex::Model::default()
    };
    match args.format {
        TableFormat::Markdown => print(&calibrate::markdown(&cap, &rows, &model)),
        TableFormat::Json => {
            match serde_json::to_string_pretty(&serde_json::json!({"capacity": cap, "rows": rows}))
            {
                Ok(j) => print(&format!("{j}\n")),
                Err(e) => return fail(&format!("cannot encode the report as JSON: {e}")),
            }
        }
    }
    let disagree = rows
        .iter()
        .any(|r| r.agrees == "NO" || r.agrees.starts_with("no"));
    ExitCode::from(if disagree { 1 } else { 0 })
}

fn run_check(args: &CheckArgs) -> ExitCode {
    let mut program = match load(&args.file) {
        Ok(p) => p,
        Err(m) => return fail(&m),
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
    let outcome = match &args.replay {
        None => check::check(&compiled, &options),
        Some(text) => {
            let start = std::time::Instant::now();
            let verdict = text
                .parse::<duplex_sim::explore::Schedule>()
                .and_then(|s| check::judge_schedule(&compiled, &s));
            match verdict {
                Ok(verdict) => check::Outcome {
                    verdict,
                    stats: check::Stats {
                        states: 0,
                        transitions: 0,
                        executions: 1,
                        elapsed: start.elapsed(),
                    },
                },
                Err(e) => return fail(&format!("--replay: {e}")),
            }
        }
    };
    let mut report = Report::new(&args.file, program.policy, program.model, &outcome);
    if args.replay.is_some() {
        report = report.replayed();
    } else {
        let source = std::fs::read_to_string(&args.file).ok();
        report = report.advise(&program, source.as_deref());
    }
    match args.format {
        Format::Text => print(&report.to_string()),
        Format::Json => match serde_json::to_string_pretty(&report) {
            Ok(json) => print(&format!("{json}\n")),
            Err(e) => return fail(&format!("cannot encode the report as JSON: {e}")),
        },
    }
    if args.deny_latent && !report.latent.is_empty() {
        return ExitCode::from(1);
    }
    ExitCode::from(report.exit_code() as u8)
}
