//! `duplex run FILE`: executes a schedule file on the simulator (one random
//! schedule) or on GPUs through NCCL, and reports what happened.

use std::sync::Arc;
use std::time::{Duration, Instant};

use duplex::schedule::Program;
use duplex::{Error, Hang};
use duplex_nccl::Local;
use duplex_sim::{Failure, Sim};

/// What a run of a program did.
#[derive(Clone, Debug, serde::Serialize)]
pub(crate) struct Ran {
    /// `ok`, `deadlock` or `error`.
    pub(crate) outcome: &'static str,
    /// Wall-clock seconds.
    pub(crate) seconds: f64,
    /// The hang report or the error, as text.
    pub(crate) detail: String,
    /// The hang report, structured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) hang: Option<Box<Hang>>,
}

fn classify(start: Instant, r: Result<(), Error>) -> Ran {
    let seconds = start.elapsed().as_secs_f64();
    match r {
        Ok(()) => Ran {
            outcome: "ok",
            seconds,
            detail: String::new(),
            hang: None,
        },
        Err(Error::Hang(h)) => Ran {
            outcome: "deadlock",
            seconds,
            detail: h.to_string(),
            hang: Some(h),
        },
        Err(e) => Ran {
            outcome: "error",
            seconds,
            detail: e.to_string(),
            hang: None,
        },
    }
}

/// Runs `program` on GPUs: a thread per rank, GPUs `0..ranks`. The
/// program's `lazy-connect` decides whether communicators are connected
/// before it starts; its policy places the ops.
pub(crate) fn on_nccl(program: &Program, timeout: Duration) -> Result<Ran, Error> {
    let local = Local::new(program.ranks)?
        .policy(program.policy)
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

/// Runs `program` on the simulator, following the random schedule of `seed`.
pub(crate) fn on_sim(program: &Program, seed: u64) -> Ran {
    let p = Arc::new(program.clone());
    let start = Instant::now();
    let r = Sim::new(program.ranks)
        .policy(program.policy)
        .model(program.model)
        .run(seed, |t| duplex::schedule::execute(&p, t));
    let seconds = start.elapsed().as_secs_f64();
    match r {
        Ok(_) => Ran {
            outcome: "ok",
            seconds,
            detail: String::new(),
            hang: None,
        },
        Err(Failure::Hang(h)) => Ran {
            outcome: "deadlock",
            seconds,
            detail: h.to_string(),
            hang: Some(h),
        },
        Err(f) => Ran {
            outcome: "error",
            seconds,
            detail: f.to_string(),
            hang: None,
        },
    }
}
