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
    /// (NCCL or CUDA failed).
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
}

fn ran(outcome: &str, start: Instant, detail: String) -> Ran {
    Ran {
        outcome: outcome.to_string(),
        seconds: start.elapsed().as_secs_f64(),
        detail,
        hang: None,
        error: None,
        copy_threshold: None,
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

/// Runs `duplex run FILE --backend nccl` in a child process, so that a
/// crash of NCCL or CUDA (a sticky CUDA error poisons its process) affects
/// that file alone; the child is killed if it outlives every deadline.
/// `model` settings (`KEY=VALUE`) override the file's model in the child.
pub(crate) fn on_nccl_isolated(file: &std::path::Path, timeout: Duration, model: &[String]) -> Ran {
    use std::process::{Command, Stdio};
    let start = Instant::now();
    let exe = std::env::current_exe().unwrap_or_else(|_| "duplex".into());
    let child = Command::new(exe)
        .args([
            "run",
            &file.display().to_string(),
            "--backend",
            "nccl",
            "--format",
            "json",
            "--timeout-ms",
        ])
        .arg(timeout.as_millis().to_string())
        .args(
            model
                .iter()
                .flat_map(|m| ["--model".to_string(), m.clone()]),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let crash = |detail: String| ran("crash", start, detail);
    let mut child = match child {
        Ok(c) => c,
        Err(e) => return crash(format!("cannot start a child process: {e}")),
    };
    let limit = timeout * 6 + Duration::from_secs(60);
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if start.elapsed() > limit => {
                let _ = child.kill();
                let _ = child.wait();
                return crash(format!("the run outlived {limit:?} and was killed"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return crash(format!("waiting for the child: {e}")),
        }
    }
    let out = match child.wait_with_output() {
        Ok(o) => o,
        Err(e) => return crash(format!("reading the child's output: {e}")),
    };
    // NCCL prints its banner ("NCCL version ...") with C's stdio, which a
    // pipe buffers until exit: it may come before or after the report. The
    // report is the first JSON value that starts a line.
    let stdout = String::from_utf8_lossy(&out.stdout);
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
    // A report, or the child's failure to run at all (an invalid file, no
    // GPUs): `{"outcome": ..., "error": {"message": ...}}`.
    let report = parsed
        .clone()
        .and_then(|v| serde_json::from_value::<Ran>(v).ok());
    let refused = parsed.and_then(|v| {
        Some(format!(
            "the run did not start ({}): {}",
            v["outcome"].as_str()?,
            v["error"]["message"].as_str()?
        ))
    });
    match (report, refused) {
        (Some(r), _) => r,
        (None, Some(why)) => crash(why),
        (None, None) => {
            let err = String::from_utf8_lossy(&out.stderr);
            let mut tail: Vec<&str> = err
                .lines()
                .rev()
                .filter(|l| !l.trim().is_empty())
                .take(3)
                .collect();
            tail.reverse();
            crash(format!(
                "the run died ({}): {}",
                out.status,
                tail.join(" / ")
            ))
        }
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
