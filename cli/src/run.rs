//! `duplex run FILE`: executes a schedule file on the simulator (one random
//! schedule) or on GPUs through NCCL, and reports what happened.

use std::sync::Arc;
use std::time::{Duration, Instant};

use duplex::Error;
use duplex::schedule::Program;
use duplex_nccl::Local;
use duplex_sim::{Failure, Sim};

/// What a run of a program did.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Ran {
    /// `ok`, `deadlock`, `error` (a program error duplex found) or `crash`
    /// (NCCL or CUDA failed); in `duplex calibrate`'s table also
    /// `unavailable` (the run could not start with its launch).
    pub(crate) outcome: String,
    /// Wall-clock seconds.
    pub(crate) seconds: f64,
    /// The hang report or the error, as text.
    pub(crate) detail: String,
    /// For a hang: the report as data (`context`, `stuck` with `cycle`,
    /// `missing`, `blocked` and `ops`, `steps`, `schedule`, `replay`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) hang: Option<serde_json::Value>,
    /// For an error or a crash: `{"kind", "message", ...}` ([`error_json`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) error: Option<serde_json::Value>,
    /// A call of a run that completed which duplex's live model refused:
    /// the model and NCCL disagree there (a bug of duplex's, to report).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) model_refused: Option<String>,
    /// With `--copy-from auto`: what was measured and the threshold chosen
    /// (`duplex_nccl::threshold::Measurement`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) copy_threshold: Option<serde_json::Value>,
    /// With a process per rank (`--processes`): each rank's own report, in
    /// rank order; the fields above are the job's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) ranks: Vec<Ran>,
}

fn ran(outcome: &str, start: Instant, detail: String) -> Ran {
    Ran {
        outcome: outcome.to_string(),
        seconds: start.elapsed().as_secs_f64(),
        detail,
        hang: None,
        error: None,
        model_refused: None,
        copy_threshold: None,
        ranks: Vec::new(),
    }
}

fn hung(start: Instant, h: &duplex::Hang) -> Ran {
    Ran {
        hang: serde_json::to_value(h).ok(),
        ..ran("deadlock", start, h.to_string())
    }
}

fn failed(outcome: &str, start: Instant, e: &Error) -> Ran {
    Ran {
        error: Some(error_json(e)),
        ..ran(outcome, start, e.to_string())
    }
}

/// An error as data: `kind` (`size-mismatch`, `type-mismatch`,
/// `group-mismatch`, `never-received`, `invalid`, `race`, `unavailable`,
/// `aborted`, `user`, `library`, `hang`), `message`, and the fields of its
/// kind (`ops` for a program error, `at` for an invalid call or a race,
/// `library`, `call` and `code` for NCCL or CUDA).
pub(crate) fn error_json(e: &Error) -> serde_json::Value {
    use serde_json::json;
    match e {
        Error::Program { kind, message, ops } => {
            json!({"kind": kind, "message": message, "ops": ops})
        }
        Error::Invalid { at, message } => json!({"kind": "invalid", "message": message, "at": at}),
        Error::Race { at, message } => json!({"kind": "race", "message": message, "at": at}),
        Error::Unavailable { what, how } => {
            json!({"kind": "unavailable", "message": e.to_string(), "what": what, "how": how})
        }
        Error::Aborted(m) => json!({"kind": "aborted", "message": m}),
        Error::User(m) => json!({"kind": "user", "message": m}),
        Error::Library {
            library,
            call,
            code,
            text,
        } => {
            json!({"kind": "library", "message": text, "library": library, "call": call, "code": code})
        }
        Error::Hang(_) => json!({"kind": "hang", "message": e.to_string()}),
    }
}

/// A run's outcome. `r` is `Ok` with what the live model refused of a run
/// that ended well, if anything: the run completed, its bytes checked, but
/// the model and NCCL disagree there, which the report says.
fn classify(start: Instant, r: Result<Option<String>, Error>) -> Ran {
    match r {
        Ok(None) => ran("ok", start, String::new()),
        Ok(Some(refused)) => Ran {
            model_refused: Some(refused.clone()),
            ..ran(
                "ok",
                start,
                format!(
                    "the run completed, but duplex's model disagrees with it (a bug of duplex's; please report it): {refused}\n"
                ),
            )
        },
        Err(Error::Hang(h)) => hung(start, &h),
        Err(e @ Error::Library { .. }) => failed("crash", start, &e),
        Err(e) => failed("error", start, &e),
    }
}

/// `runner` (a [`Local`] or a [`duplex_nccl::Process`], which share their
/// builder) set up for `program`: its policy and copy lanes, its
/// `lazy-connect` (communicators connected before it starts, or not), its
/// model for hang analysis, the deadline and the lane mode.
macro_rules! set_up_for {
    ($runner:expr, $program:expr, $timeout:expr, $lanes:expr) => {{
        let mut runner = $runner;
        if let Some(mode) = $lanes {
            runner = runner.lanes(mode);
        }
        runner
            .policy($program.policy)
            .copy_from($program.copy_from)
            .warm(!$program.model.lazy_connect)
            .model($program.model)
            .timeout($timeout)
    }};
}

/// Runs `program` on GPUs: a thread per rank, GPUs `0..ranks`. The
/// program's `lazy-connect` decides whether communicators are connected
/// before it starts; its policy places the ops.
pub(crate) fn on_nccl(
    program: &Program,
    timeout: Duration,
    lanes: Option<duplex_nccl::LaneMode>,
) -> Result<Ran, Error> {
    let local = set_up_for!(Local::new(program.ranks)?, program, timeout, lanes);
    let p = Arc::new(program.clone());
    let start = Instant::now();
    Ok(classify(
        start,
        local
            .run(|t| duplex::schedule::execute(&p, t))
            .map(|reports| reports.into_iter().find_map(|r| r.model_refused)),
    ))
}

/// Runs `program` as this process's rank of a job whose launcher (torchrun,
/// or [`on_nccl_processes`]) set `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
/// `MASTER_ADDR` and `MASTER_PORT` ([`duplex_nccl::Process::from_env`]).
/// Its report is this rank's: a hang names the wait-for cycle across the
/// processes, from what every rank published. `Err`: the environment does
/// not describe a rank of this program, or this rank could not start
/// (no NCCL, CUDA driver or GPU: [`Error::Unavailable`]).
pub(crate) fn on_nccl_rank(
    program: &Program,
    timeout: Duration,
    lanes: Option<duplex_nccl::LaneMode>,
) -> Result<Ran, Error> {
    // A world size other than the file's: the refusal, if `world` is one.
    let other_world = |world: u32| {
        (world != program.ranks).then(|| Error::Invalid {
            at: "WORLD_SIZE".into(),
            message: format!(
                "WORLD_SIZE={world} but the file's program has {} ranks: start one process per rank of the file",
                program.ranks
            ),
        })
    };
    // Said first, from the variable itself: it is the likelier mistake,
    // and it hid behind the store's secret (found by review).
    if let Some(e) = std::env::var("WORLD_SIZE")
        .ok()
        .and_then(|w| w.trim().parse::<u32>().ok())
        .and_then(other_world)
    {
        return Err(e);
    }
    let process = duplex_nccl::Process::from_env()?;
    if let Some(e) = other_world(process.world()) {
        return Err(e);
    }
    let process = set_up_for!(process, program, timeout, lanes);
    let p = Arc::new(program.clone());
    let start = Instant::now();
    let began = std::sync::atomic::AtomicBool::new(false);
    let r = process.run(|t| {
        began.store(true, std::sync::atomic::Ordering::Relaxed);
        duplex::schedule::execute(&p, t)
    });
    match r {
        // Nothing ran: this rank could not start (its partners' waits end
        // naming it). Unavailable later (a copy-lane arena exhausted, say)
        // is an error of a run that started.
        Err(e @ Error::Unavailable { .. }) if !began.load(std::sync::atomic::Ordering::Relaxed) => {
            Err(e)
        }
        r => Ok(classify(start, r.map(|report| report.model_refused))),
    }
}

/// How `duplex run --backend nccl` starts a program's ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Launch {
    /// A thread per rank of this process, rank r on GPU r ([`on_nccl`]).
    Threads,
    /// A process per rank, started as torchrun would ([`on_nccl_processes`]):
    /// rank r on GPU r, or with `one_gpu` every rank on GPU 0 over loopback
    /// sockets ([`duplex_nccl::shared_gpu_env`]: behaviour, never speed).
    Processes { one_gpu: bool },
}

impl Launch {
    /// The command-line flags that ask for this launch.
    pub(crate) fn flags(self) -> &'static [&'static str] {
        match self {
            Launch::Threads => &[],
            Launch::Processes { one_gpu: false } => &["--processes"],
            Launch::Processes { one_gpu: true } => &["--processes", "--one-gpu"],
        }
    }

    /// In words, for reports.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Launch::Threads => "a thread per rank of one process, rank r on GPU r",
            Launch::Processes { one_gpu: false } => {
                "a process per rank through duplex's store, rank r on GPU r"
            }
            Launch::Processes { one_gpu: true } => {
                "a process per rank through duplex's store, every rank on GPU 0 over loopback sockets (behaviour, not speed)"
            }
        }
    }
}

/// What one child process left: its report (the first JSON object that
/// starts a line of its standard output), or why there is none.
pub(crate) type Child = Result<serde_json::Value, String>;

/// How long a child may live: past every deadline of its run, with room
/// for NCCL's setup and teardown.
pub(crate) fn child_limit(timeout: Duration) -> Duration {
    timeout * 6 + Duration::from_secs(60)
}

/// Starts this executable once per entry of `envs` with `args` and that
/// entry's extra environment (without the variables of `remove`), reads
/// each child's output while it runs (a report larger than a pipe's buffer
/// cannot stall it), kills every child still running after `limit`, and
/// returns what each left, in order. On Linux a child is killed when this
/// process dies (`PR_SET_PDEATHSIG`), so that a killed parent leaves no
/// rank running.
pub(crate) fn spawn_children(
    args: &[String],
    envs: &[Vec<(String, String)>],
    remove: &[&str],
    limit: Duration,
) -> Vec<Child> {
    use std::io::Read;
    use std::process::{Command, Stdio};
    type Drain = std::thread::JoinHandle<Vec<u8>>;
    let start = Instant::now();
    let exe = std::env::current_exe().unwrap_or_else(|_| "duplex".into());
    let drain = |pipe: Option<Box<dyn Read + Send>>| -> Drain {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let mut running: Vec<Result<(std::process::Child, Drain, Drain), String>> = Vec::new();
    for env in envs {
        let mut cmd = Command::new(&exe);
        cmd.args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for name in remove {
            cmd.env_remove(name);
        }
        die_with_parent(&mut cmd);
        running.push(
            cmd.spawn()
                .map(|mut child| {
                    let out = drain(child.stdout.take().map(|p| Box::new(p) as _));
                    let err = drain(child.stderr.take().map(|p| Box::new(p) as _));
                    (child, out, err)
                })
                .map_err(|e| format!("cannot start a child process: {e}")),
        );
    }
    // Every child is watched at once: at the limit, all that still run are
    // killed before any is waited for.
    let mut statuses: Vec<Option<Result<std::process::ExitStatus, String>>> =
        running.iter().map(|_| None).collect();
    loop {
        let mut left = false;
        for (r, status) in running.iter_mut().zip(statuses.iter_mut()) {
            let (Ok((child, _, _)), None) = (r, &status) else {
                continue;
            };
            match child.try_wait() {
                Ok(Some(s)) => *status = Some(Ok(s)),
                Ok(None) => left = true,
                Err(e) => *status = Some(Err(format!("waiting for it failed: {e}"))),
            }
        }
        if !left {
            break;
        }
        if start.elapsed() > limit {
            for (r, status) in running.iter_mut().zip(statuses.iter()) {
                if let (Ok((child, _, _)), None) = (r, status) {
                    let _ = child.kill();
                }
            }
            for (r, status) in running.iter_mut().zip(statuses.iter_mut()) {
                if let (Ok((child, _, _)), None) = (r, &status) {
                    let _ = child.wait();
                    *status = Some(Err(format!("it outlived {limit:?} and was killed")));
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    running
        .into_iter()
        .zip(statuses)
        .map(|(r, status)| match r {
            Err(why) => Err(why),
            Ok((_, out, err)) => {
                let stdout = out.join().unwrap_or_default();
                let stderr = err.join().unwrap_or_default();
                let status = status.unwrap_or_else(|| Err("it was never waited for".into()));
                report_of(&stdout, &stderr, status)
            }
        })
        .collect()
}

/// Has the child of `cmd` killed when this process dies (Linux).
#[cfg(target_os = "linux")]
fn die_with_parent(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the child between fork and exec and makes
    // one async-signal-safe system call; it allocates nothing and touches
    // no state of the parent's other threads.
    let parent = std::process::id();
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent died before the request: nothing would kill us.
            if libc::getppid() as u32 != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// Elsewhere a child outlives its parent until its own deadlines end it.
#[cfg(not(target_os = "linux"))]
fn die_with_parent(_: &mut std::process::Command) {}

/// A child's report from its output, or why there is none.
fn report_of(
    stdout: &[u8],
    stderr: &[u8],
    status: Result<std::process::ExitStatus, String>,
) -> Result<serde_json::Value, String> {
    // NCCL prints its banner ("NCCL version ...") with C's stdio, which a
    // pipe buffers until exit: it may come before or after the report. The
    // report is the first JSON value that starts a line.
    let stdout = String::from_utf8_lossy(stdout);
    let start = if stdout.starts_with('{') {
        Some(0)
    } else {
        stdout.find("\n{").map(|i| i + 1)
    };
    let parsed = start.and_then(|i| {
        serde_json::Deserializer::from_str(&stdout[i..])
            .into_iter::<serde_json::Value>()
            .next()
            .and_then(Result::ok)
    });
    if let Some(v) = parsed {
        return Ok(v);
    }
    let err = String::from_utf8_lossy(stderr);
    let mut tail: Vec<&str> = err
        .lines()
        .rev()
        .filter(|l| !l.trim().is_empty())
        .take(3)
        .collect();
    tail.reverse();
    Err(match status {
        Ok(status) => format!("it died ({status}): {}", tail.join(" / ")),
        Err(why) => format!("{why}: {}", tail.join(" / ")),
    })
}

/// A child's report as a run's, or as the reason the run did not start
/// (`{"outcome": "invalid"|"unavailable", "error": {"message": ...}}`).
fn ran_of(report: serde_json::Value) -> Result<Ran, (String, String)> {
    if let Ok(r) = serde_json::from_value::<Ran>(report.clone()) {
        return Ok(r);
    }
    let outcome = report["outcome"].as_str().unwrap_or("crash").to_string();
    let message = report["error"]["message"]
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| report.to_string());
    Err((outcome, message))
}

/// Runs `duplex run FILE --backend nccl` in a child process, so that a
/// crash of NCCL or CUDA (a sticky CUDA error poisons its process) affects
/// that file alone; the child is killed if it outlives every deadline.
/// `model` settings (`KEY=VALUE`) override the file's model in the child;
/// `launch` is how the child starts the ranks.
pub(crate) fn on_nccl_isolated(
    file: &std::path::Path,
    timeout: Duration,
    model: &[String],
    launch: Launch,
) -> Ran {
    let start = Instant::now();
    let mut args: Vec<String> = [
        "run",
        &file.display().to_string(),
        "--backend",
        "nccl",
        "--format",
        "json",
        "--timeout-ms",
        &timeout.as_millis().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(launch.flags().iter().map(|s| s.to_string()));
    args.extend(
        model
            .iter()
            .flat_map(|m| ["--model".to_string(), m.clone()]),
    );
    // A job of processes kills its own ranks at `child_limit`: this one
    // waits longer, so that it never leaves them running.
    let limit = match launch {
        Launch::Threads => child_limit(timeout),
        Launch::Processes { .. } => child_limit(timeout) + Duration::from_secs(30),
    };
    let mut children = spawn_children(&args, &[Vec::new()], &[], limit);
    let crash = |detail: String| ran("crash", start, detail);
    match children.pop() {
        Some(Ok(report)) => match ran_of(report) {
            Ok(r) => r,
            // Unavailable with this launch (a feature the processes are
            // not given, say): not NCCL's failure.
            Err((outcome, message)) if outcome == "unavailable" => ran(
                "unavailable",
                start,
                format!("the run did not start: {message}"),
            ),
            Err((outcome, message)) => {
                crash(format!("the run did not start ({outcome}): {message}"))
            }
        },
        Some(Err(why)) => crash(format!("the run failed: {why}")),
        None => crash("no child process was started".into()),
    }
}

/// Starts a job of `ranks` processes of this executable with `args` on this
/// host, as torchrun would start them: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`
/// (rank r on GPU r, or GPU 0 for every rank with `one_gpu`:
/// [`duplex_nccl::shared_gpu_env`]), `MASTER_ADDR=127.0.0.1`, a free port
/// for duplex's store, and a fresh `DUPLEX_STORE_TOKEN`. Returns each
/// rank's report (or why it left none), in rank order; `Err` when no port
/// could be found.
pub(crate) fn spawn_job(
    args: &[String],
    ranks: u32,
    timeout: Duration,
    one_gpu: bool,
) -> Result<Vec<Child>, (String, String)> {
    use std::hash::{BuildHasher, Hasher};
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| {
            (
                "unavailable".to_string(),
                format!("no free port on 127.0.0.1 for the job's store: {e}"),
            )
        })?;
    // The job's secret: the store listens on loopback only, but any local
    // user could connect; two hashes seeded by the process are not
    // guessable from outside it.
    let noise = |n: u64| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(n);
        h.finish()
    };
    let token = format!(
        "duplex-run-{}-{port}-{:016x}{:016x}",
        std::process::id(),
        noise(1),
        noise(2)
    );
    let envs: Vec<Vec<(String, String)>> = (0..ranks)
        .map(|rank| {
            let mut env: Vec<(String, String)> = [
                ("RANK", rank.to_string()),
                ("WORLD_SIZE", ranks.to_string()),
                ("LOCAL_RANK", rank.to_string()),
                ("MASTER_ADDR", "127.0.0.1".to_string()),
                ("MASTER_PORT", port.to_string()),
                ("DUPLEX_PORT", port.to_string()),
                ("DUPLEX_STORE_TOKEN", token.clone()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
            if one_gpu {
                // After LOCAL_RANK above: GPU 0 for every rank.
                env.extend(
                    duplex_nccl::shared_gpu_env(rank, &port.to_string())
                        .into_iter()
                        .map(|(k, v)| (k.to_string(), v)),
                );
            }
            env
        })
        .collect();
    // The store is on 127.0.0.1, where the ranks look for it: an address
    // from the caller's environment would put it elsewhere.
    Ok(spawn_children(
        args,
        &envs,
        &["DUPLEX_STORE_BIND"],
        child_limit(timeout),
    ))
}

/// Runs `file`'s program (`program`, already read) as a process per rank
/// on this host ([`spawn_job`]), each running `duplex run FILE --backend
/// nccl --from-env` with `rank_args`. The job's report takes the worst
/// outcome of its ranks (a hang, then NCCL's failure, then an error) with
/// that rank's hang or error, and keeps every rank's own report in
/// `ranks`. `Err`: the job did not start (a rank without NCCL, CUDA or its
/// GPU: `unavailable`; an environment that does not fit: `invalid`), with
/// why.
pub(crate) fn on_nccl_processes(
    file: &str,
    program: &Program,
    timeout: Duration,
    rank_args: &[String],
    one_gpu: bool,
) -> Result<Ran, (String, String)> {
    let start = Instant::now();
    let mut args: Vec<String> = [
        "run",
        file,
        "--backend",
        "nccl",
        "--from-env",
        "--format",
        "json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(rank_args.iter().cloned());
    let mut ranks = Vec::new();
    // Ranks that refused to run (`invalid`, `unavailable`), with why.
    let mut refused = Vec::new();
    for (rank, report) in spawn_job(&args, program.ranks, timeout, one_gpu)?
        .into_iter()
        .enumerate()
    {
        let r = match report {
            Ok(report) => match ran_of(report) {
                Ok(r) => r,
                Err((outcome, message)) => {
                    let message = format!("rank {rank} did not start: {message}");
                    refused.push((outcome.clone(), message.clone()));
                    Ran {
                        error: Some(serde_json::json!({"kind": outcome, "message": message})),
                        ..ran("error", start, message)
                    }
                }
            },
            Err(why) => ran(
                "crash",
                start,
                format!("rank {rank}'s process failed: {why}"),
            ),
        };
        ranks.push(r);
    }
    refusal(&ranks, refused).map_or_else(|| Ok(job_of(ranks, start)), Err)
}

/// Whether a job whose ranks ended as `ranks` did not run: some rank
/// refused (`refused`: `invalid` or `unavailable`, with why) and every
/// other rank only finished or ended for it. Then the refusal is the
/// answer, `invalid` before `unavailable`. A rank that refused while others
/// hung or failed on their own is one rank's error of a job that ran.
fn refusal(ranks: &[Ran], mut refused: Vec<(String, String)>) -> Option<(String, String)> {
    let only_echoes = ranks.iter().all(|r| {
        r.outcome == "ok"
            || error_kind(r).is_some_and(|k| matches!(k, "aborted" | "invalid" | "unavailable"))
    });
    if refused.is_empty() || !only_echoes {
        return None;
    }
    refused.sort_by_key(|(outcome, _)| outcome != "invalid");
    Some(refused.swap_remove(0))
}

/// The kind of a run's error (`error.kind` of its report), if it has one.
fn error_kind(r: &Ran) -> Option<&str> {
    r.error.as_ref()?.get("kind")?.as_str()
}

/// The job's report from its ranks' (see [`on_nccl_processes`]).
fn job_of(ranks: Vec<Ran>, start: Instant) -> Ran {
    // The root cause first: a program error (it names the ops), a hang (its
    // cycle), NCCL's or CUDA's failure, an error of the rank's code, and
    // last the error of a rank that only ended because another failed.
    use duplex::ProgramErrorKind as K;
    let program_error = |kind: &str| {
        [
            K::SizeMismatch,
            K::TypeMismatch,
            K::GroupMismatch,
            K::NeverReceived,
        ]
        .iter()
        .any(|k| k.name() == kind)
    };
    let rank_of = |r: &Ran| match (r.outcome.as_str(), error_kind(r)) {
        ("error", Some(k)) if program_error(k) => 0,
        ("deadlock", _) => 1,
        ("error", Some("aborted")) => 4,
        ("error", _) => 3,
        ("ok", _) => 5,
        _ => 2,
    };
    let worst = ranks.iter().min_by_key(|r| rank_of(r));
    let outcome = worst.map_or("crash", |r| r.outcome.as_str()).to_string();
    let (hang, error) = worst.map_or((None, None), |r| (r.hang.clone(), r.error.clone()));
    let mut detail = String::new();
    for (i, r) in ranks.iter().enumerate() {
        if r.outcome != "ok" || !r.detail.is_empty() {
            detail.push_str(&format!(
                "rank {i}: {}\n{}\n",
                r.outcome,
                r.detail.trim_end()
            ));
        }
    }
    Ran {
        hang,
        error,
        ranks,
        ..ran(&outcome, start, detail)
    }
}

/// Runs `program` on the simulator, following the random schedule of `seed`.
/// A failure says how to replay it with this command (`again`: `duplex run
/// FILE --seed N` and the options given), which follows the same schedule,
/// rather than with the simulator's Rust API.
pub(crate) fn on_sim(program: &Program, seed: u64, again: &str) -> Ran {
    let p = Arc::new(program.clone());
    let start = Instant::now();
    // The rank code is duplex's own schedule executor, which waits for
    // nothing outside the transport: its time between transport calls is
    // spent filling and checking payloads (seconds for a message of GiBs),
    // never a wait the simulator cannot see, so the check for such waits
    // is off (it blamed the executor for a 8 GiB message).
    let r = Sim::new(program.ranks)
        .policy(program.policy)
        .copy_from(program.copy_from)
        .model(program.model)
        .user_code_limit(std::time::Duration::MAX)
        .run(seed, |t| duplex::schedule::execute(&p, t));
    let r = r.map_err(|mut f| {
        match &mut f {
            Failure::Hang(h) => h.replay = Some(again.to_string()),
            Failure::Program { replay, .. } | Failure::Thread { replay, .. } => {
                *replay = again.to_string();
            }
            _ => {}
        }
        f
    });
    match r {
        Ok(_) => ran("ok", start, String::new()),
        Err(Failure::Hang(h)) => hung(start, &h),
        Err(f) => {
            let error = match &f {
                Failure::Program { error, .. } => error_json(error),
                Failure::Thread { thread, error, .. } => {
                    serde_json::json!({"kind": "thread", "message": error, "thread": thread})
                }
                _ => serde_json::json!({"kind": "failed", "message": f.to_string()}),
            };
            Ran {
                error: Some(error),
                ..ran("error", start, f.to_string())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(outcome: &str, detail: &str) -> Ran {
        ran(outcome, Instant::now(), detail.to_string())
    }

    #[test]
    fn a_job_takes_its_worst_rank() {
        let start = Instant::now();
        let all_ok = job_of(vec![of("ok", ""), of("ok", "")], start);
        assert_eq!(all_ok.outcome, "ok");
        assert!(all_ok.detail.is_empty(), "{}", all_ok.detail);
        assert_eq!(all_ok.ranks.len(), 2);
        // The rank that hung is the job's story, though the other rank's
        // error (naming it) came first in rank order.
        let mut hung = of("deadlock", "wait-for cycle (2 links)");
        hung.hang = Some(serde_json::json!({"stuck": "cycle"}));
        let mut told = of("error", "rank 1 failed: hang");
        told.error = Some(serde_json::json!({"kind": "aborted"}));
        let job = job_of(vec![told, hung], start);
        assert_eq!(job.outcome, "deadlock");
        assert_eq!(job.hang, Some(serde_json::json!({"stuck": "cycle"})));
        assert_eq!(job.error, None);
        assert!(
            job.detail.contains("rank 0: error\nrank 1 failed: hang"),
            "{}",
            job.detail
        );
        assert!(
            job.detail.contains("rank 1: deadlock\nwait-for cycle"),
            "{}",
            job.detail
        );
        assert_eq!(
            job_of(vec![of("error", "x"), of("crash", "y")], start).outcome,
            "crash"
        );
        assert_eq!(
            job_of(vec![of("ok", ""), of("error", "y")], start).outcome,
            "error"
        );
    }

    fn failed(outcome: &str, kind: &str, detail: &str) -> Ran {
        let mut r = of(outcome, detail);
        r.error = Some(serde_json::json!({"kind": kind, "message": detail}));
        r
    }

    #[test]
    fn a_job_names_the_root_cause_before_the_echoes_of_it() {
        let start = Instant::now();
        let echo = || failed("error", "aborted", "rank 1 failed: size mismatch");
        let mismatch = || failed("error", "size-mismatch", "size mismatch (R3): both ops");
        // Both `error`: the program error, not the echo that came first.
        let job = job_of(vec![echo(), mismatch()], start);
        assert_eq!(job.outcome, "error");
        assert_eq!(
            job.error.as_ref().map(|e| e["kind"].clone()),
            Some("size-mismatch".into())
        );
        // NCCL's unexplained error on one rank does not hide the program
        // error the other named.
        let nccl = failed("crash", "library", "NCCL error 5: message truncated");
        let job = job_of(vec![nccl, mismatch()], start);
        assert_eq!(job.outcome, "error");
        assert_eq!(
            job.error.as_ref().map(|e| e["kind"].clone()),
            Some("size-mismatch".into())
        );
        // A rank's own error before another's echo of it.
        let user = failed("error", "user", "rank code returned an error");
        let job = job_of(vec![echo(), user], start);
        assert_eq!(
            job.error.as_ref().map(|e| e["kind"].clone()),
            Some("user".into())
        );
    }

    #[test]
    fn a_refusal_is_the_job_s_answer_only_when_nothing_else_happened() {
        let refused = |kind: &str, rank: u32| {
            (
                kind.to_string(),
                format!("rank {rank} did not start: no NCCL"),
            )
        };
        let no_nccl = failed("error", "unavailable", "rank 0 did not start: no NCCL");
        let echo = failed("error", "aborted", "rank 0 failed: no NCCL");
        assert_eq!(
            refusal(
                &[no_nccl.clone(), echo.clone()],
                vec![refused("unavailable", 0)]
            ),
            Some(refused("unavailable", 0))
        );
        // Invalid first, whichever rank said it.
        let bad = failed("error", "invalid", "rank 1 did not start: WORLD_SIZE");
        assert_eq!(
            refusal(
                &[no_nccl.clone(), bad],
                vec![refused("unavailable", 0), refused("invalid", 1)]
            ),
            Some(refused("invalid", 1))
        );
        // A rank that hung on its own: the job ran.
        let hung = of("deadlock", "wait-for cycle");
        assert_eq!(
            refusal(&[no_nccl, hung], vec![refused("unavailable", 0)]),
            None
        );
        assert_eq!(refusal(&[of("ok", ""), echo], Vec::new()), None);
    }

    /// Not a test of its own: the child that `a_child_past_its_limit_is_killed`
    /// starts, which would outlive any limit.
    #[test]
    #[ignore = "started by a_child_past_its_limit_is_killed"]
    fn sleeper() {
        std::thread::sleep(Duration::from_secs(60));
    }

    #[test]
    fn a_child_past_its_limit_is_killed_and_says_so() {
        let start = Instant::now();
        let args: Vec<String> = ["--ignored", "--exact", "run::tests::sleeper", "--nocapture"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let children = spawn_children(
            &args,
            &[Vec::new(), Vec::new()],
            &[],
            Duration::from_millis(500),
        );
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(children.len(), 2);
        for c in children {
            let why = c.expect_err("no report from a killed child");
            assert!(why.starts_with("it outlived 500ms and was killed"), "{why}");
        }
    }

    #[test]
    fn a_report_is_the_first_json_line_whatever_came_before() {
        let out = b"NCCL version 2.28.3\n{\"outcome\": \"ok\", \"seconds\": 0.5, \"detail\": \"\"}\ntrailing";
        let v = report_of(out, b"", Err("killed".into())).expect("a report");
        assert_eq!(ran_of(v).expect("a run").outcome, "ok");
        let refused =
            serde_json::json!({"outcome": "unavailable", "error": {"message": "no NCCL"}});
        assert_eq!(
            ran_of(refused).err(),
            Some(("unavailable".to_string(), "no NCCL".to_string()))
        );
        let none = report_of(
            b"NCCL version\n",
            b"a\nb\n\nlast words\n",
            Err("it outlived 1s and was killed".into()),
        );
        let why = none.expect_err("no report");
        assert!(why.starts_with("it outlived 1s and was killed: "), "{why}");
        assert!(why.ends_with("a / b / last words"), "{why}");
    }
}
