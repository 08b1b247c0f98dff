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

fn classify(start: Instant, r: Result<(), Error>) -> Ran {
    match r {
        Ok(()) => ran("ok", start, String::new()),
        Err(Error::Hang(h)) => hung(start, &h),
        Err(e @ Error::Library { .. }) => failed("crash", start, &e),
        Err(e) => failed("error", start, &e),
    }
}

/// Runs `program` on GPUs: a thread per rank, GPUs `0..ranks`. The
/// program's `lazy-connect` decides whether communicators are connected
/// before it starts; its policy places the ops.
pub(crate) fn on_nccl(
    program: &Program,
    timeout: Duration,
    lanes: Option<duplex_nccl::LaneMode>,
) -> Result<Ran, Error> {
    let mut local = Local::new(program.ranks)?;
    if let Some(mode) = lanes {
        local = local.lanes(mode);
    }
    let local = local
        .policy(program.policy)
        .copy_from(program.copy_from)
        .warm(!program.model.lazy_connect)
        .model(program.model)
        .timeout(timeout);
    let p = Arc::new(program.clone());
    let start = Instant::now();
    Ok(classify(
        start,
        local.run(|t| duplex::schedule::execute(&p, t)).map(drop),
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
    let mut process = duplex_nccl::Process::from_env()?;
    if process.world() != program.ranks {
        return Err(Error::Invalid {
            at: "WORLD_SIZE".into(),
            message: format!(
                "WORLD_SIZE={} but the file's program has {} ranks: start one process per rank of the file",
                process.world(),
                program.ranks
            ),
        });
    }
    if let Some(mode) = lanes {
        process = process.lanes(mode);
    }
    let process = process
        .policy(program.policy)
        .copy_from(program.copy_from)
        .warm(!program.model.lazy_connect)
        .model(program.model)
        .timeout(timeout);
    let p = Arc::new(program.clone());
    let start = Instant::now();
    match process.run(|t| duplex::schedule::execute(&p, t)) {
        // Nothing ran: this rank could not start (its partners' waits end
        // naming it).
        Err(e @ Error::Unavailable { .. }) => Err(e),
        r => Ok(classify(start, r.map(drop))),
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
pub(crate) struct Child {
    pub(crate) report: Result<serde_json::Value, String>,
}

/// How long a child may live: past every deadline of its run, with room
/// for NCCL's setup and teardown.
pub(crate) fn child_limit(timeout: Duration) -> Duration {
    timeout * 6 + Duration::from_secs(60)
}

/// Starts this executable once per entry of `envs` with `args` and that
/// entry's extra environment, reads each child's output while it runs (a
/// report larger than a pipe's buffer cannot stall it), kills any child
/// still running after `limit`, and returns what each left, in order.
pub(crate) fn spawn_children(
    args: &[String],
    envs: &[Vec<(String, String)>],
    limit: Duration,
) -> Vec<Child> {
    use std::io::Read;
    use std::process::{Command, Stdio};
    let start = Instant::now();
    let exe = std::env::current_exe().unwrap_or_else(|_| "duplex".into());
    let mut running = Vec::new();
    for env in envs {
        let spawned = Command::new(&exe)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        running.push(spawned.map(|mut child| {
            let drain = |pipe: Option<Box<dyn Read + Send>>| {
                std::thread::spawn(move || {
                    let mut bytes = Vec::new();
                    if let Some(mut p) = pipe {
                        let _ = p.read_to_end(&mut bytes);
                    }
                    bytes
                })
            };
            let out = drain(child.stdout.take().map(|p| Box::new(p) as _));
            let err = drain(child.stderr.take().map(|p| Box::new(p) as _));
            (child, out, err)
        }));
    }
    running
        .into_iter()
        .map(|spawned| {
            let (mut child, out, err) = match spawned {
                Ok(c) => c,
                Err(e) => {
                    return Child {
                        report: Err(format!("cannot start a child process: {e}")),
                    };
                }
            };
            let status = loop {
                match child.try_wait() {
                    Ok(Some(status)) => break Ok(status),
                    Ok(None) if start.elapsed() > limit => {
                        let _ = child.kill();
                        let _ = child.wait();
                        break Err(format!("it outlived {limit:?} and was killed"));
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                    Err(e) => break Err(format!("waiting for it failed: {e}")),
                }
            };
            let stdout = out.join().unwrap_or_default();
            let stderr = err.join().unwrap_or_default();
            Child {
                report: report_of(&stdout, &stderr, status),
            }
        })
        .collect()
}

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
    let mut children = spawn_children(&args, &[Vec::new()], limit);
    let crash = |detail: String| ran("crash", start, detail);
    match children.pop().map(|c| c.report) {
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
) -> Result<Vec<Result<serde_json::Value, String>>, (String, String)> {
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
    Ok(spawn_children(args, &envs, child_limit(timeout))
        .into_iter()
        .map(|c| c.report)
        .collect())
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
    for (rank, report) in spawn_job(&args, program.ranks, timeout, one_gpu)?
        .into_iter()
        .enumerate()
    {
        let r = match report {
            Ok(report) => match ran_of(report) {
                Ok(r) => r,
                Err((outcome, message)) => {
                    return Err((outcome, format!("rank {rank} did not start: {message}")));
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
    Ok(job_of(ranks, start))
}

/// The job's report from its ranks' (see [`on_nccl_processes`]).
fn job_of(ranks: Vec<Ran>, start: Instant) -> Ran {
    const WORST_FIRST: [&str; 4] = ["deadlock", "crash", "error", "ok"];
    let rank_of = |r: &Ran| {
        WORST_FIRST
            .iter()
            .position(|o| *o == r.outcome)
            .unwrap_or(0)
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
    let r = Sim::new(program.ranks)
        .policy(program.policy)
        .copy_from(program.copy_from)
        .model(program.model)
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
