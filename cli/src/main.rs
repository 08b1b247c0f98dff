//! The `duplex` command line.
//!
//! `duplex check FILE...` reads schedule files (`docs/schedule-format.md`;
//! `-` is standard input), explores every interleaving of their host threads
//! on the simulator, and prints for each whether the program can hang, with
//! the wait-for cycle and the interleaving that leads there. `duplex run
//! FILE --backend nccl|sim` executes a schedule file (on GPUs, or one random
//! schedule of the simulator); `duplex calibrate DIR` measures this
//! machine's NCCL and compares every file of DIR run on the GPUs with the
//! checker's verdict. Exit statuses are in [`failure`] and `duplex --help`.
//! This crate only parses arguments and prints; the work is in `duplex` (the
//! format and the rules: its `machine`), `duplex-sim` (the checker and the
//! simulator that drive them) and `duplex-nccl` (the GPUs). Start at
//! `main`, which dispatches each subcommand to its `run_*` function;
//! `run_check` is the one most users meet.

/// `eprintln!` that never panics: where standard error is closed or full,
/// the line is lost and the exit status still says what happened (found
/// by review: `duplex check bad.sched 2>/dev/full` panicked).
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod calibrate;
mod failure;
mod run;

use std::io::{Read, Write};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use duplex::compile;
use duplex::{Policy, Size};
use duplex_sim::{check, report::Report};
use failure::{FOUND, Failure, OK};
use std::collections::HashMap;

/// `duplex --help`'s last words: the exit statuses.
const EXIT_STATUSES: &str = "\
Exit status:
  0  no interleaving hangs and no error was found (check); the run completed (run);
     every example agrees (calibrate)
  1  a hang or a program error was found (check); the run hung or failed (run);
     some example disagrees or could not run with its launch (calibrate)
  2  a file or the command line is invalid: nothing was checked or run; or the report
     could not be written to standard output (stderr says why)
  3  the search reached --max-states or --time-limit before deciding (check)
  4  the backend is unavailable: no NCCL, CUDA driver or enough GPUs (run --backend nccl,
     calibrate)
With several files, `check` exits with the worst status of them: 2, then 1, then 3, then 0.
With --format json, errors too are one JSON object on stdout:
  {\"verdict\": \"invalid\", \"file\": ..., \"error\": {\"kind\": ..., \"message\": ..., \"line\": ...}}
(`outcome` for run and calibrate; \"unavailable\" with status 4).";

#[derive(Parser, Debug)]
#[command(
    name = "duplex",
    version,
    about = "NCCL point-to-point without hangs",
    after_help = EXIT_STATUSES
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Answers "can this program hang?" for schedule files, on the simulator.
    // A negative number is an option's (wrong) value, refused by its
    // parser, not an unknown option with a tip that would make it a file.
    #[command(allow_negative_numbers = true)]
    Check(CheckArgs),
    /// Executes a schedule file on GPUs (`--backend nccl`) or on one random
    /// schedule of the simulator (`--backend sim`), and reports what happened.
    #[command(allow_negative_numbers = true)]
    Run(RunArgs),
    /// Measures this machine's NCCL (eager capacity) and runs every schedule
    /// file of DIR on the GPUs, comparing each outcome with `duplex check`.
    #[command(allow_negative_numbers = true)]
    Calibrate(CalibrateArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Backend {
    Nccl,
    Sim,
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// The schedule file (`-`: standard input).
    file: String,
    /// Where to run it.
    #[arg(long, value_enum, default_value_t = Backend::Sim)]
    backend: Backend,
    /// Place ops without comm=/stream= by this policy (overrides the file).
    #[arg(long, value_parser = parse_policy)]
    policy: Option<Policy>,
    /// Under per-direction, put ops of at least SIZE bytes on copy-engine
    /// lanes (overrides the file's `copy-from=`). `auto` (with `--backend
    /// nccl`): measure on GPUs 0 and 1 from which size copy-engine lanes are
    /// faster than NCCL lanes, print the measurement, and use that.
    #[arg(long, value_name = "SIZE|auto", value_parser = CopyFrom::parse)]
    copy_from: Option<CopyFrom>,
    /// Deadline of every wait on GPUs, in milliseconds (at least 1).
    /// Default: `DUPLEX_TIMEOUT_MS`, else 5000.
    #[arg(long = "timeout-ms", value_name = "TIMEOUT_MS", value_parser = milliseconds)]
    timeout_flag: Option<u64>,
    /// The deadline in force: `--timeout-ms`, `DUPLEX_TIMEOUT_MS` or 5000
    /// ([`deadline_ms`]).
    #[arg(skip)]
    timeout_ms: u64,
    /// With `--backend nccl`: make every lane at start (`eager`), or each
    /// lane when its pair first talks (`lazy`, by the two ranks' lane
    /// services). Default: `DUPLEX_LANES`, else eager.
    #[arg(long, value_name = "eager|lazy")]
    lanes: Option<duplex_nccl::LaneMode>,
    /// With `--backend nccl`: run each rank in a process of its own,
    /// started by this command as torchrun would start them on one host
    /// (rank r on GPU r; duplex's store on 127.0.0.1 with a fresh secret),
    /// instead of a thread per rank. The report is the job's, with each
    /// rank's own under `ranks` (JSON).
    #[arg(long, conflicts_with = "from_env")]
    processes: bool,
    /// With `--processes`: every rank on GPU 0, talking over loopback
    /// sockets instead of NVLink, for a machine with one GPU. It checks a
    /// program's behaviour (hangs, errors, bytes), never its speed.
    #[arg(long, requires = "processes")]
    one_gpu: bool,
    /// With `--backend nccl`: this process is one rank of a job whose
    /// launcher set `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and
    /// `MASTER_PORT` (e.g. `torchrun --nproc-per-node 2 --no-python duplex
    /// run FILE --backend nccl --from-env`; the store's secret in
    /// `DUPLEX_STORE_TOKEN`, else derived from torchrun's run id). Reports
    /// this rank's outcome.
    #[arg(long)]
    from_env: bool,
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

/// `duplex run --copy-from`: a size, or measured on the GPUs.
#[derive(Clone, Copy, Debug)]
enum CopyFrom {
    At(Size),
    Auto,
}

impl CopyFrom {
    fn parse(text: &str) -> Result<CopyFrom, String> {
        if text == "auto" {
            return Ok(CopyFrom::Auto);
        }
        Size::parse(text)
            .map(CopyFrom::At)
            .map_err(|e| format!("{e}, or `auto`"))
    }
}

#[derive(clap::Args, Debug)]
struct CalibrateArgs {
    /// The folder of schedule files.
    dir: String,
    /// Deadline of every wait, in milliseconds (at least 1). Default:
    /// `DUPLEX_TIMEOUT_MS`, else 3000.
    #[arg(long = "timeout-ms", value_name = "TIMEOUT_MS", value_parser = milliseconds)]
    timeout_flag: Option<u64>,
    /// The deadline in force ([`deadline_ms`]).
    #[arg(skip)]
    timeout_ms: u64,
    /// Output format: markdown or json.
    #[arg(long, value_enum, default_value_t = TableFormat::Markdown)]
    format: TableFormat,
    /// Run the capacity probes and every file with a process per rank
    /// (`duplex run --processes`) instead of a thread per rank.
    #[arg(long)]
    processes: bool,
    /// With `--processes`: every rank on GPU 0 over loopback sockets, for
    /// a machine with one GPU (`duplex run --one-gpu`): the outcomes of
    /// that transport, not of NVLink.
    #[arg(long, requires = "processes")]
    one_gpu: bool,
    /// Internal: this process is one rank of the capacity probes, from the
    /// environment `--processes` sets.
    #[arg(long, hide = true)]
    capacity_rank: bool,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum TableFormat {
    Markdown,
    Json,
}

#[derive(clap::Args, Debug)]
struct CheckArgs {
    /// The schedule files, each checked on its own (`-`: standard input).
    #[arg(required = true, value_name = "FILE")]
    files: Vec<String>,
    /// Place ops without comm=/stream= by this policy (overrides the file).
    #[arg(long, value_parser = parse_policy)]
    policy: Option<Policy>,
    /// Under per-direction, put ops of at least SIZE bytes on copy-engine
    /// lanes (overrides the file's `copy-from=`; docs/semantics.md,
    /// "Copy-engine lanes").
    #[arg(long, value_name = "SIZE", value_parser = Size::parse)]
    copy_from: Option<Size>,
    /// Eager capacity of rule R5, e.g. 64MiB (overrides the file's model).
    #[arg(long, value_parser = Size::parse)]
    eager: Option<Size>,
    /// Any model setting, KEY=VALUE (eager, lazy-connect, comm-order,
    /// kernels, one-sided-groups, cold-channels); may be repeated;
    /// overrides the file.
    #[arg(long = "model", value_name = "KEY=VALUE")]
    model: Vec<String>,
    /// Output format: text (one report after another), json (one JSON
    /// object per line, one line per file), or dot (the stuck state as a
    /// Graphviz graph per file: ranks as clusters, streams inside them, the
    /// wait-for cycle in red).
    #[arg(long, value_enum, default_value_t = CheckFormat::Text)]
    format: CheckFormat,
    /// Give up (exit status 3) after this many distinct states (at least 1).
    #[arg(long, default_value_t = check::Options::default().max_states, value_parser = at_least_one)]
    max_states: usize,
    /// Give up (exit status 3, inconclusive) after this many seconds; the
    /// repairs and latent hangs get what is left (without it, 30 s once the
    /// verdict is known).
    #[arg(long, value_name = "SECONDS", value_parser = parse_seconds)]
    time_limit: Option<f64>,
    /// The most memory the search may keep in snapshots of the state at
    /// the decision points of its path, e.g. 2GiB (default: half of the
    /// memory available). Past it, it keeps fewer and re-executes from the
    /// nearest one on a backtrack: the same verdict, found more slowly.
    #[arg(long, value_name = "SIZE", value_parser = Size::parse)]
    snapshot_memory: Option<Size>,
    /// Explore every interleaving without the partial-order reduction
    /// (slower; for cross-checking the reduction).
    #[arg(long)]
    no_reduction: bool,
    /// Write the interleaving that hangs or errs as a Chrome/Perfetto trace
    /// to this file (open it in ui.perfetto.dev): a track per rank's host
    /// thread and stream, host calls and device ops as spans. With several
    /// files, each file's trace goes to FILE.<its path, `/` as `_`>. An ok
    /// program has no such interleaving: nothing is written, and a note on
    /// standard error says so; a trace that cannot be written is said on
    /// standard error, and the report and exit status are the check's.
    #[arg(long, value_name = "FILE")]
    trace: Option<String>,
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

#[derive(Clone, Copy, Debug, ValueEnum)]
enum CheckFormat {
    Text,
    Json,
    Dot,
}

fn parse_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 && x < 1e9 => Ok(x),
        Ok(x) if x >= 1e9 => Err(format!(
            "`{s}` seconds is more than duplex takes (under 1e9 seconds, about 31 years)"
        )),
        _ => Err(format!("`{s}` is not a positive number of seconds")),
    }
}

fn parse_policy(s: &str) -> Result<Policy, String> {
    Policy::parse(s)
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    let status = match cli.command {
        Command::Check(args) => run_check(&args),
        Command::Run(mut args) => match deadline_ms(args.timeout_flag, 5000) {
            Ok(ms) => {
                args.timeout_ms = ms;
                run_run(&args)
            }
            Err(f) => fail(&f, matches!(args.format, Format::Json), "outcome"),
        },
        Command::Calibrate(mut args) => match deadline_ms(args.timeout_flag, 3000) {
            Ok(ms) => {
                args.timeout_ms = ms;
                run_calibrate(&args)
            }
            Err(f) => fail(&f, matches!(args.format, TableFormat::Json), "outcome"),
        },
    };
    if OUTPUT_LOST.load(std::sync::atomic::Ordering::Relaxed) {
        return ExitCode::from(2);
    }
    status
}

/// A command line clap refuses: its own message, or, when the command line
/// asks for JSON (`--format json`), one JSON object on stdout; status 2.
/// Help and the version print as clap prints them.
fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        e.exit()
    }
    // `args_os`: an argument that is not UTF-8 (which clap may be refusing)
    // must not panic here.
    let args: Vec<String> = std::env::args_os()
        .skip(1)
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let json = args
        .windows(2)
        .any(|w| w[0] == "--format" && w[1] == "json")
        || args.iter().any(|a| a == "--format=json");
    if !json {
        e.exit()
    }
    // clap's message without its usage and hints, on one line.
    let text = e.to_string();
    let message = text
        .split("\n\n")
        .next()
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" ")
        .trim_start_matches("error: ")
        .to_string();
    let key = match args.first().map(String::as_str) {
        Some("run" | "calibrate") => "outcome",
        _ => "verdict",
    };
    fail(&Failure::invalid("usage", message), true, key)
}

/// Prints `failure`, as text on stderr or as one JSON object (a line) on
/// stdout, and returns its exit status. `key` names the verdict's field.
fn fail(failure: &Failure, json: bool, key: &str) -> ExitCode {
    report_failure(failure, json, key);
    ExitCode::from(failure.status)
}

fn report_failure(failure: &Failure, json: bool, key: &str) {
    if json {
        print(&format!("{}\n", failure.json(key)));
    } else {
        say!("duplex: {}", failure.text());
    }
}

/// The largest schedule file duplex reads: 256 MiB. The largest program
/// the checker was measured on, a 4,096-rank all-to-all, is 9 MB; the
/// parsed program and the checker's state take about 14 to 19 times the
/// file's size (a 6.5 MB ring of 1,024 ranks: 91 MB resident), so the
/// bound keeps a refused file, or one just under it, within a laptop's
/// memory (about 5 GB at the bound, where 1 GiB allowed some 19 GB).
const MAX_FILE_BYTES: u64 = 256 << 20;

/// Reads and parses a schedule file (`-`: standard input).
fn load(file: &str) -> Result<duplex::schedule::Program, Failure> {
    load_text(file).map(|(p, _)| p)
}

/// [`load`], with the file's text (to place suggested edits by line).
fn load_text(file: &str) -> Result<(duplex::schedule::Program, String), Failure> {
    let mut bytes = Vec::new();
    // One byte past the bound says the file is larger (a device such as
    // /dev/zero never ends).
    let read = if file == "-" {
        std::io::stdin()
            .lock()
            .take(MAX_FILE_BYTES + 1)
            .read_to_end(&mut bytes)
    } else {
        // A regular file larger than the bound, or a device (which may
        // never end: /dev/zero), is refused before it is read; a pipe is
        // read up to the bound.
        use std::os::unix::fs::FileTypeExt;
        if let Ok(m) = std::fs::metadata(file) {
            let t = m.file_type();
            if t.is_char_device() || t.is_block_device() {
                return Err(Failure::invalid(
                    "read",
                    format!("{file} is a device, not a schedule file"),
                )
                .at(file, None));
            }
            if t.is_file() && m.len() > MAX_FILE_BYTES {
                return Err(Failure::invalid(
                    "read",
                    format!(
                        "{file} is larger than {}, more than any schedule duplex reads (a generated file of that size would take the checker far longer than it is worth: cut it into smaller programs)",
                        duplex::Size(MAX_FILE_BYTES)
                    ),
                )
                .at(file, None));
            }
        }
        std::fs::File::open(file).and_then(|f| f.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes))
    };
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(Failure::invalid(
            "read",
            format!(
                "{} is larger than {}, more than any schedule duplex reads (a generated file of that size would take the checker far longer than it is worth: cut it into smaller programs)",
                if file == "-" { "standard input" } else { file },
                duplex::Size(MAX_FILE_BYTES)
            ),
        )
        .at(file, None));
    }
    let bytes = read.map(|_| bytes);
    let text = match bytes {
        Ok(bytes) => match String::from_utf8(bytes) {
            Ok(t) => t,
            Err(e) => {
                let line = 1 + e.as_bytes()[..e.utf8_error().valid_up_to()]
                    .iter()
                    .filter(|b| **b == b'\n')
                    .count();
                let line = u32::try_from(line).unwrap_or(u32::MAX);
                return Err(
                    Failure::invalid("encoding", "the file is not UTF-8 text").at(file, Some(line))
                );
            }
        },
        Err(e) => {
            let what = if file == "-" {
                "standard input".to_string()
            } else {
                file.to_string()
            };
            return Err(Failure::invalid("read", format!("cannot read {what}: {e}")).at(file, None));
        }
    };
    duplex::schedule::parse(&text)
        .map(|p| (p, text))
        .map_err(|e| Failure::invalid("parse", e.message).at(file, Some(e.line)))
}

fn print(text: &str) {
    let mut out = std::io::stdout().lock();
    // A closed pipe (`duplex ... | head`) is not an error of the command;
    // any other failure to write (a full disk) is, or a script would take
    // the missing report for a verdict: said once, and `main` exits 2.
    if let Err(e) = out.write_all(text.as_bytes()).and_then(|()| out.flush())
        && e.kind() != std::io::ErrorKind::BrokenPipe
        && !OUTPUT_LOST.swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        say!("duplex: cannot write the report to standard output: {e}");
    }
}

/// Set once writing to standard output failed ([`print`]).
static OUTPUT_LOST: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A report as JSON: one line.
fn to_json<T: serde::Serialize>(value: &T) -> Result<String, Failure> {
    serde_json::to_string(value)
        .map_err(|e| Failure::failed(format!("cannot encode the report as JSON: {e}")))
}

fn run_run(args: &RunArgs) -> ExitCode {
    let json = matches!(args.format, Format::Json);
    // How the ranks start is checked before the file is read.
    let nccl = matches!(args.backend, Backend::Nccl);
    if (args.processes || args.from_env) && !nccl {
        let f = Failure::invalid(
            "usage",
            "--processes and --from-env start ranks on GPUs: add --backend nccl",
        );
        return fail(&f, json, "outcome");
    }
    if args.processes && args.file == "-" {
        let f = Failure::invalid(
            "usage",
            "--processes starts a process per rank that reads the file again: give the file's path, not standard input",
        );
        return fail(&f, json, "outcome");
    }
    if (args.processes || args.from_env) && matches!(args.copy_from, Some(CopyFrom::Auto)) {
        let f = Failure::invalid(
            "usage",
            "--copy-from auto measures GPUs 0 and 1 from one process: run it without --processes or --from-env, then give the size it printed (--copy-from SIZE)",
        );
        return fail(&f, json, "outcome");
    }
    let mut program = match load(&args.file) {
        Ok(p) => p,
        Err(f) => return fail(&f, json, "outcome"),
    };
    for setting in &args.model {
        if let Err(e) = program.model.set(setting) {
            let f = Failure::invalid("usage", format!("--model {setting}: {e}"));
            return fail(&f, json, "outcome");
        }
    }
    if args.lanes.is_some() && !nccl {
        let f = Failure::invalid(
            "usage",
            "--lanes chooses when the NCCL backend makes its lanes; the simulator has no lanes to make: add --backend nccl, or leave --lanes out",
        );
        return fail(&f, json, "outcome");
    }
    let mut measured = None;
    let copy_from = match args.copy_from {
        None => None,
        Some(CopyFrom::At(size)) => Some(size),
        Some(CopyFrom::Auto) => match measured_copy_from(args, &program) {
            Ok(m) => {
                let c = m.copy_from;
                measured = Some(m);
                c
            }
            Err(f) => return fail(&f, json, "outcome"),
        },
    };
    let auto_off = matches!(args.copy_from, Some(CopyFrom::Auto)) && copy_from.is_none();
    if let Err(f) = place(&mut program, args.policy, copy_from) {
        return fail(&about(&args.file, f), json, "outcome");
    }
    if auto_off {
        // Measured: copy-engine lanes are not faster at the largest size
        // measured; off, whatever the file says.
        program.copy_from = None;
    }
    let mut ran = match args.backend {
        Backend::Sim => {
            // The same command with its seed follows the same schedule.
            let word = duplex_sim::report::shell_word;
            let mut again = format!("duplex run {} --seed {}", word(&args.file), args.seed);
            if let Some(p) = args.policy {
                again.push_str(&format!(" --policy {p}"));
            }
            for m in &args.model {
                again.push_str(&format!(" --model {}", word(m)));
            }
            if let Some(CopyFrom::At(size)) = args.copy_from {
                again.push_str(&format!(" --copy-from {size}"));
            }
            run::on_sim(&program, args.seed, &again)
        }
        Backend::Nccl if args.processes => {
            let timeout = std::time::Duration::from_millis(args.timeout_ms);
            match run::on_nccl_processes(
                &args.file,
                &program,
                timeout,
                &rank_args(args),
                args.one_gpu,
            ) {
                Ok(r) => r,
                Err((outcome, message)) => {
                    let f = if outcome == "invalid" {
                        Failure::invalid("environment", message)
                    } else {
                        Failure::unavailable(message)
                    };
                    return fail(&f.at(&args.file, None), json, "outcome");
                }
            }
        }
        Backend::Nccl => {
            let timeout = std::time::Duration::from_millis(args.timeout_ms);
            let ran = if args.from_env {
                run::on_nccl_rank(&program, timeout, args.lanes)
            } else {
                run::on_nccl(&program, timeout, args.lanes)
            };
            match ran {
                Ok(r) => r,
                Err(e @ duplex::Error::Invalid { .. }) => {
                    // The environment does not describe a rank of this
                    // program (from a launcher): said as the variable's
                    // problem, not as an invalid call.
                    let text = match &e {
                        duplex::Error::Invalid { at, message }
                            if message.starts_with(at.as_str()) =>
                        {
                            message.clone()
                        }
                        duplex::Error::Invalid { at, message } => format!("{at}: {message}"),
                        e => e.to_string(),
                    };
                    let f = Failure::invalid(
                        "environment",
                        format!("the launcher's environment: {text}"),
                    )
                    .at(&args.file, None);
                    return fail(&f, json, "outcome");
                }
                Err(e) => {
                    // Nothing ran: NCCL, the CUDA driver or the GPUs could
                    // not be set up.
                    let f = Failure::unavailable(e.to_string()).at(&args.file, None);
                    return fail(&f, json, "outcome");
                }
            }
        }
    };
    ran.copy_threshold = measured.and_then(|m| serde_json::to_value(m).ok());
    match args.format {
        Format::Json => match to_json(&ran) {
            Ok(j) => print(&format!("{j}\n")),
            Err(f) => return fail(&f, json, "outcome"),
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
    ExitCode::from(if ran.outcome == "ok" { OK } else { FOUND })
}

/// What each rank of `duplex run --processes` is told beside the file: the
/// settings of this command line that the ranks apply themselves.
fn rank_args(args: &RunArgs) -> Vec<String> {
    let mut out = vec!["--timeout-ms".to_string(), args.timeout_ms.to_string()];
    if let Some(p) = args.policy {
        out.extend(["--policy".to_string(), p.to_string()]);
    }
    if let Some(CopyFrom::At(size)) = args.copy_from {
        out.extend(["--copy-from".to_string(), size.to_string()]);
    }
    if let Some(mode) = args.lanes {
        out.extend(["--lanes".to_string(), mode.to_string()]);
    }
    for m in &args.model {
        out.extend(["--model".to_string(), m.clone()]);
    }
    out
}

/// `--copy-from auto`: measures the threshold on GPUs 0 and 1 under the
/// program's model and prints the measurement on standard error (and puts
/// it in the JSON report, `copy_threshold`).
fn measured_copy_from(
    args: &RunArgs,
    program: &duplex::schedule::Program,
) -> Result<duplex_nccl::threshold::Measurement, Failure> {
    if !matches!(args.backend, Backend::Nccl) {
        return Err(Failure::invalid(
            "usage",
            "--copy-from auto measures copy-engine lanes against NCCL lanes on GPUs: add --backend nccl, or give the simulator a size (--copy-from 4MiB)",
        ));
    }
    if args.policy.unwrap_or(program.policy) != Policy::PerDirection {
        return Err(Failure::invalid(
            "usage",
            "--copy-from puts ops on copy-engine lanes, which are per direction: add --policy per-direction",
        ));
    }
    let unavailable = |e: duplex::Error| Failure::unavailable(e.to_string()).at(&args.file, None);
    let local = duplex_nccl::Local::new(program.ranks.max(2))
        .map_err(unavailable)?
        .model(program.model)
        .timeout(std::time::Duration::from_millis(args.timeout_ms));
    let m = local
        .measure_copy_from(&duplex_nccl::threshold::Plan::default())
        .map_err(|e| match e {
            duplex::Error::Unavailable { .. } => unavailable(e),
            e => Failure::failed(format!("--copy-from auto: the measurement failed: {e}"))
                .at(&args.file, None),
        })?;
    say!("{m}");
    Ok(m)
}

fn run_calibrate(args: &CalibrateArgs) -> ExitCode {
    let json = matches!(args.format, TableFormat::Json);
    let timeout = std::time::Duration::from_millis(args.timeout_ms);
    if args.capacity_rank {
        return match calibrate::capacity_rank(timeout) {
            Ok(report) => {
                print(&format!("{report}\n"));
                ExitCode::from(OK)
            }
            Err(f) => fail(&f, true, "outcome"),
        };
    }
    let launch = if args.processes {
        run::Launch::Processes {
            one_gpu: args.one_gpu,
        }
    } else {
        run::Launch::Threads
    };
    let cal = match calibrate::calibrate(std::path::Path::new(&args.dir), timeout, launch) {
        Ok(r) => r,
        Err(f) => return fail(&f, json, "outcome"),
    };
    let (cap, rows) = (&cal.cap, &cal.rows);
    let model = calibrate::fitted_model(duplex::Model::default(), cap);
    match args.format {
        TableFormat::Markdown => print(&calibrate::markdown(&cal, &model)),
        TableFormat::Json => {
            let table = serde_json::json!({
                "launch": cal.launch.describe(),
                "capacity": cap,
                "rows": rows
            });
            match serde_json::to_string_pretty(&table) {
                Ok(j) => print(&format!("{j}\n")),
                Err(e) => {
                    let f = Failure::failed(format!("cannot encode the report as JSON: {e}"));
                    return fail(&f, json, "outcome");
                }
            }
        }
    }
    let disagree = rows.iter().any(calibrate::counts_against);
    ExitCode::from(if disagree { FOUND } else { OK })
}

/// Whether the paths `a` and `b` name one file: the same text, or an
/// existing file reached both ways (`./s.sched` and `s.sched`, a link).
fn same_file(a: &str, b: &str) -> bool {
    use std::os::unix::fs::MetadataExt;
    a == b
        || match (std::fs::metadata(a), std::fs::metadata(b)) {
            (Ok(x), Ok(y)) => (x.dev(), x.ino()) == (y.dev(), y.ino()),
            _ => false,
        }
}

/// Where `--trace OUT` writes the trace of `file`: `OUT` itself, or with
/// several files `OUT.<the file's path, / as _>`.
fn trace_path(out: &str, file: &str, several: bool) -> String {
    if several {
        format!("{out}.{}", file.replace(['/', '\\'], "_"))
    } else {
        out.to_string()
    }
}

fn run_check(args: &CheckArgs) -> ExitCode {
    let json = matches!(args.format, CheckFormat::Json);
    // What applies to every file is checked once, before any file is read.
    for setting in &args.model {
        if let Err(e) = duplex::Model::default().set(setting) {
            let f = Failure::invalid("usage", format!("--model {setting}: {e}"));
            return fail(&f, json, "verdict");
        }
    }
    if args.files.iter().filter(|f| *f == "-").count() > 1 {
        let f = Failure::invalid(
            "usage",
            "`-` (standard input) is given more than once: it can be read only once",
        );
        return fail(&f, json, "verdict");
    }
    if let Some(out) = &args.trace {
        // Two files whose traces would go to one file, or a trace that
        // would overwrite a file given: refused before anything is checked
        // (the same file given twice writes the same trace twice).
        let mut seen: HashMap<String, &str> = HashMap::new();
        for file in &args.files {
            let path = trace_path(out, file, args.files.len() > 1);
            let clash = match seen.insert(path.clone(), file) {
                Some(other) if other != file => Some(format!(
                    "the traces of {other} and {file} would both go to {path}"
                )),
                _ => args
                    .files
                    .iter()
                    .find(|f| same_file(f, &path))
                    .map(|f| format!("the trace of {file} would overwrite {f}, a file given")),
            };
            if let Some(clash) = clash {
                let f = Failure::invalid(
                    "usage",
                    format!(
                        "--trace: {clash}; {}",
                        if args.files.len() > 1 {
                            "check them with separate commands"
                        } else {
                            "give the trace another name"
                        }
                    ),
                );
                return fail(&f, json, "verdict");
            }
        }
    }
    let schedule = match &args.replay {
        None => None,
        Some(_) if args.files.len() > 1 => {
            let f = Failure::invalid(
                "usage",
                "--replay follows one interleaving of one program: give one file",
            );
            return fail(&f, json, "verdict");
        }
        Some(text) => match text.parse::<duplex_sim::explore::Schedule>() {
            Ok(s) => Some(s),
            Err(e) => {
                let f = Failure::invalid("replay", format!("--replay: {e}"));
                return fail(&f, json, "verdict");
            }
        },
    };
    let mut status = OK;
    for (i, file) in args.files.iter().enumerate() {
        let code = match check_file(args, file, schedule.as_ref()) {
            Ok(mut report) => {
                report.latent_denied = args.deny_latent && !report.latent.is_empty();
                let out = match args.format {
                    CheckFormat::Text if i > 0 => Ok(format!("\n{report}")),
                    CheckFormat::Text => Ok(report.to_string()),
                    CheckFormat::Json => to_json(&report).map(|j| format!("{j}\n")),
                    CheckFormat::Dot => Ok(report.dot()),
                };
                match out {
                    Ok(out) => {
                        print(&out);
                        if report.latent_denied {
                            1
                        } else {
                            report.exit_code() as u8
                        }
                    }
                    Err(f) => {
                        let f = f.at(file, None);
                        report_failure(&f, json, "verdict");
                        f.status
                    }
                }
            }
            Err(f) => {
                report_failure(&f, json, "verdict");
                f.status
            }
        };
        status = failure::worst(status, code);
    }
    ExitCode::from(status)
}

/// [`check::check`], with a progress bar on stderr once it has run for a
/// second; where stderr is not a terminal (CI logs), where indicatif draws
/// nothing, a plain line every 30 s instead, so that a long search is not
/// silent.
fn check_with_bar(
    file: &str,
    compiled: &duplex::compile::Compiled,
    options: &check::Options,
) -> check::Outcome {
    use std::io::IsTerminal;
    let terminal = std::io::stderr().is_terminal();
    let mut bar: Option<indicatif::ProgressBar> = None;
    let mut said = std::time::Duration::ZERO;
    let outcome = check::check_with(compiled, options, &mut |s| {
        if s.elapsed < std::time::Duration::from_secs(1) {
            return;
        }
        if !terminal {
            if s.elapsed >= said + std::time::Duration::from_secs(30) {
                said = s.elapsed;
                say!(
                    "duplex: {file}: still checking after {:.0} s: {}, {}, {} (bounds: --max-states, --time-limit)",
                    s.elapsed.as_secs_f64(),
                    duplex::report::counted(s.executions as u64, "execution"),
                    duplex::report::counted(s.transitions as u64, "host step"),
                    duplex::report::counted(s.states as u64, "branching state"),
                );
            }
            return;
        }
        let b = bar.get_or_insert_with(|| {
            let b = indicatif::ProgressBar::new_spinner();
            b.set_style(
                indicatif::ProgressStyle::with_template("{spinner} {prefix}: {msg}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
            );
            b.set_prefix(file.to_string());
            b
        });
        let secs = s.elapsed.as_secs_f64().max(1e-9);
        b.set_message(format!(
            "{}, {} ({:.0}/s), {}, depth {}, {:.0} s",
            duplex::report::counted(s.executions as u64, "execution"),
            duplex::report::counted(s.transitions as u64, "host step"),
            s.transitions as f64 / secs,
            duplex::report::counted(s.states as u64, "branching state"),
            s.depth,
            secs
        ));
        b.tick();
    });
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    outcome
}

/// `f`, an error that this file's own settings cause (its policy, its
/// model): named by the file, in the text and in the JSON's `file`.
fn about(file: &str, f: Failure) -> Failure {
    Failure {
        message: format!("{file}: {}", f.message),
        ..f
    }
    .at(file, None)
}

/// The deadline of a command's waits on GPUs: `--timeout-ms` (`flag`),
/// else `DUPLEX_TIMEOUT_MS`, else `default`. A variable that is set must
/// hold a deadline, and is then used (it was checked and ignored: found by
/// review).
fn deadline_ms(flag: Option<u64>, default: u64) -> Result<u64, Failure> {
    if let Some(ms) = flag {
        return Ok(ms);
    }
    match std::env::var("DUPLEX_TIMEOUT_MS") {
        Ok(v) if !v.is_empty() => milliseconds(&v).map_err(|e| {
            Failure::invalid(
                "environment",
                format!("DUPLEX_TIMEOUT_MS: {e} (unset, this command's default is {default}; --timeout-ms overrides it)"),
            )
        }),
        _ => Ok(default),
    }
}

/// `--timeout-ms`: a whole number of milliseconds, at least 1, as
/// `DUPLEX_TIMEOUT_MS` takes it ([`duplex::positive_count`]).
fn milliseconds(v: &str) -> Result<u64, String> {
    duplex::positive_count(v).ok_or_else(|| {
        format!("`{v}` is not a deadline: give a whole number of milliseconds, at least 1")
    })
}

/// `--max-states`: a whole number, at least 1 (0 would give up before the
/// first state).
fn at_least_one(v: &str) -> Result<usize, String> {
    match duplex::positive_count(v).and_then(|n| usize::try_from(n).ok()) {
        Some(n) => Ok(n),
        None if !v.is_empty()
            && v.bytes().all(|b| b.is_ascii_digit())
            && v.bytes().any(|b| b != b'0') =>
        {
            Err(format!(
                "`{v}` is more states than this machine can count (at most {})",
                usize::MAX
            ))
        }
        None => Err(format!("`{v}` is not a number of states: give 1 or more")),
    }
}

/// Applies the command line's `--policy` and `--copy-from` to a program:
/// copy-engine lanes are per direction, so `--copy-from` needs that policy,
/// and a policy other than per-direction drops the file's `copy-from=`.
fn place(
    program: &mut duplex::schedule::Program,
    policy: Option<Policy>,
    copy_from: Option<Size>,
) -> Result<(), Failure> {
    if let Some(p) = policy {
        program.policy = p;
    }
    if copy_from.is_some() {
        if program.policy != Policy::PerDirection {
            return Err(Failure::invalid(
                "usage",
                "--copy-from puts ops on copy-engine lanes, which are per direction: add --policy per-direction",
            ));
        }
        program.copy_from = copy_from;
    }
    if program.policy != Policy::PerDirection {
        program.copy_from = None;
    }
    Ok(())
}

/// The command line's overrides of a file's policy and model, as flags
/// (for the replay command a report prints).
fn override_flags(args: &CheckArgs) -> Vec<String> {
    let mut flags = Vec::new();
    if let Some(p) = args.policy {
        flags.extend(["--policy".to_string(), p.to_string()]);
    }
    if let Some(c) = args.copy_from {
        flags.extend(["--copy-from".to_string(), c.to_string()]);
    }
    for setting in &args.model {
        flags.extend(["--model".to_string(), setting.clone()]);
    }
    if let Some(e) = args.eager {
        flags.extend(["--eager".to_string(), e.to_string()]);
    }
    flags
}

/// Checks one file under the command line's settings.
fn check_file(
    args: &CheckArgs,
    file: &str,
    schedule: Option<&duplex_sim::explore::Schedule>,
) -> Result<Report, Failure> {
    let (mut program, source) = load_text(file)?;
    // What `--policy per-direction` in place of the command line's policy
    // would check with (the policy repair, `advice::PolicyFlag`).
    let flag = args.policy.map(|_| duplex_sim::advice::PolicyFlag {
        copy_from: args.copy_from.or(program.copy_from),
    });
    // These depend on the file (its policy, its model): the error names
    // it, as each file of several is checked on its own.
    place(&mut program, args.policy, args.copy_from).map_err(|f| about(file, f))?;
    for setting in &args.model {
        program.model.set(setting).map_err(|e| {
            about(
                file,
                Failure::invalid("usage", format!("--model {setting}: {e}")),
            )
        })?;
    }
    if let Some(e) = args.eager {
        program.model.eager = e;
    }
    let compiled = compile::compile(&program);
    let options = check::Options {
        max_states: args.max_states,
        reduce: !args.no_reduction,
        time_limit: args.time_limit.map(std::time::Duration::from_secs_f64),
        snapshot_memory: args
            .snapshot_memory
            .map(|s| usize::try_from(s.0).unwrap_or(usize::MAX)),
    };
    // The advice after the search (repairs, latent hangs) keeps to the
    // same time limit, counted from here, and the same snapshot memory;
    // without one, to `advice::DEFAULT_SECONDS` once the search is done.
    let deadline = options
        .time_limit
        .and_then(|t| std::time::Instant::now().checked_add(t));
    let outcome = match schedule {
        None => check_with_bar(file, &compiled, &options),
        Some(s) => {
            let start = std::time::Instant::now();
            let (verdict, steps) = check::judge_schedule(&compiled, s)
                .map_err(|e| Failure::invalid("replay", format!("--replay: {e}")).at(file, None))?;
            check::Outcome {
                verdict,
                stats: check::Stats {
                    states: 0,
                    transitions: steps,
                    executions: 1,
                    depth: 0,
                    snapshots: None,
                    stopped: None,
                    elapsed: start.elapsed(),
                },
            }
        }
    };
    if let Some(out) = &args.trace {
        let found = match &outcome.verdict {
            check::Verdict::Deadlock { schedule, .. } | check::Verdict::Error { schedule, .. } => {
                Some(schedule.clone())
            }
            _ => schedule.cloned(),
        };
        let path = trace_path(out, file, args.files.len() > 1);
        match found {
            Some(s) => {
                let trace = check::trace_of(&compiled, &s)
                    .map_err(|e| Failure::invalid("replay", e).at(file, None))?;
                let timeline = trace.timeline(program.model);
                drop(trace);
                // The check is done: its report still comes; the trace
                // that could not be written is said on standard error.
                let written = duplex_sim::perfetto::write_chrome_trace_to(
                    &timeline,
                    file,
                    std::path::Path::new(&path),
                );
                if let Err(e) = written {
                    say!("duplex: {file}: cannot write the trace to {path}: {e}");
                }
            }
            None => say!(
                "duplex: {file}: no trace written to {path}: {}",
                if matches!(outcome.verdict, check::Verdict::Inconclusive) {
                    "no interleaving that hangs or errs was found within the search's bounds"
                } else {
                    "no interleaving hangs or errs"
                }
            ),
        }
    }
    // The advice below checks the program again under other settings: the
    // compiled program is not needed any more (on a large file it is
    // hundreds of MiB).
    drop(compiled);
    let report = Report::new(file, program.policy, program.model, &outcome)
        .copy_from(program.copy_from)
        .overridden(&override_flags(args));
    Ok(if schedule.is_some() {
        report.replayed()
    } else {
        let deadline = deadline.or_else(|| {
            std::time::Instant::now().checked_add(std::time::Duration::from_secs(
                duplex_sim::advice::DEFAULT_SECONDS,
            ))
        });
        let budget = duplex_sim::advice::Budget::new(deadline, options.snapshot_memory);
        report.advise(&program, Some(&source), &budget, flag.as_ref())
    })
}
