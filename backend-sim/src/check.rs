//! The checker: decides whether any interleaving of a program's host threads
//! can hang or hit a program error.
//!
//! The search is breadth-first over host steps, with a set of visited state
//! fingerprints (128-bit xxh3 of [`State`](duplex::machine::State)): it is
//! exhaustive, and the interleaving it reports is a shortest one. It knows
//! nothing of the rules; it only asks the [`Machine`] which threads can step.
//!
//! **Reduction.** Host steps of different ranks commute (they touch
//! different streams, different sides of a channel, counters and sets) and
//! never disable each other (what a thread waits for, once true, stays true
//! until its own rank consumes it). So when some rank has no thread that is
//! blocked but will step again, the steps of that rank's runnable threads form
//! a persistent set: exploring only them reaches every stuck state and every
//! error that the full search reaches (Godefroid's persistent sets; the state
//! graph is acyclic, so state caching loses nothing). [`Options::reduce`]
//! turns this off, and the tests check that both searches agree.

use std::collections::{HashSet, VecDeque};
use std::hash::Hash;
use std::time::{Duration, Instant};

use xxhash_rust::xxh3::Xxh3Default;

use duplex::compile::{Compiled, Remaining};
use duplex::machine::{HostCall, Machine, Next, ProgramError, Status, Stuck, ThreadId, Threads};

/// Bounds of a check.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Stop after this many distinct states and report the check as
    /// inconclusive.
    pub max_states: usize,
    /// Explore one rank's steps at a time where that is sound (see the
    /// module docs). On by default.
    pub reduce: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            max_states: 5_000_000,
            reduce: true,
        }
    }
}

/// One host step of an interleaving, as a report shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Step {
    /// 1-based step number.
    pub step: usize,
    /// The rank.
    pub rank: u32,
    /// The host thread.
    pub thread: String,
    /// What it did.
    pub action: String,
}

/// What a check found.
#[derive(Clone, Debug)]
pub enum Verdict {
    /// No interleaving hangs or errs.
    Ok,
    /// This interleaving hangs.
    Deadlock {
        /// Why it is stuck.
        stuck: Box<Stuck>,
        /// The host steps that lead there.
        trace: Vec<Step>,
    },
    /// This interleaving hits a program error.
    Error {
        /// The error.
        error: ProgramError,
        /// The host steps that lead there.
        trace: Vec<Step>,
    },
    /// The state bound was reached before the search finished.
    Inconclusive,
}

/// Search statistics.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Stats {
    /// Distinct states visited.
    pub states: usize,
    /// Host steps taken (edges of the state graph explored).
    pub transitions: usize,
    /// Wall-clock time of the search.
    #[serde(serialize_with = "seconds")]
    pub elapsed: Duration,
}

fn seconds<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// A verdict and how much searching it took.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The verdict.
    pub verdict: Verdict,
    /// The statistics.
    pub stats: Stats,
}

/// The 128-bit fingerprint of a machine state.
pub fn fingerprint(m: &Machine) -> u128 {
    let mut h = Xxh3Default::new();
    m.state().hash(&mut h);
    h.digest128()
}

/// Takes thread `t`'s next host step, which must be possible.
pub fn step(c: &Compiled, m: &mut Machine, t: ThreadId) -> Result<(), ProgramError> {
    match m.next(t) {
        Next::Resume => m.resume(t),
        Next::Call => {
            let call = c.call(t, m.calls(t)).cloned().unwrap_or(HostCall::End);
            m.apply(t, call)
        }
        Next::Blocked | Next::Finished => Ok(()),
    }
}

/// The threads that can step in `m`, in id order.
pub fn runnable(c: &Compiled, m: &Machine) -> Vec<ThreadId> {
    m.runnable(&Remaining(c))
}

/// The threads to explore from `m`: all runnable ones, or, with `reduce`,
/// [`reduce`]'s subset.
pub fn expand(c: &Compiled, m: &Machine, reduce_steps: bool) -> Vec<ThreadId> {
    let all = runnable(c, m);
    if reduce_steps {
        reduce(m, &all, &Remaining(c))
    } else {
        all
    }
}

/// A persistent set of the enabled threads (module docs):
///
/// * a thread whose next call is a `notify` or a `join` alone: those calls
///   change nothing another step reads, commute with every step and disable
///   none;
/// * else the enabled threads of the rank with fewest of them among the
///   ranks whose every other thread cannot step before one of these does:
///   it has ended, or it waits in a `join` for such a thread;
/// * else all of `enabled`.
pub fn reduce(m: &Machine, enabled: &[ThreadId], threads: &dyn Threads) -> Vec<ThreadId> {
    if enabled.len() <= 1 {
        return enabled.to_vec();
    }
    let next = |t: ThreadId| match m.next(t) {
        Next::Call => threads.next_call(m, t),
        _ => None,
    };
    if let Some(t) = enabled.iter().copied().find(|t| {
        matches!(
            next(*t),
            Some(HostCall::Notify { .. } | HostCall::Join { .. })
        )
    }) {
        return vec![t];
    }
    let setup = m.setup();
    let mut best: Option<Vec<ThreadId>> = None;
    for rank in 0..setup.ranks {
        let mine: Vec<ThreadId> = enabled
            .iter()
            .copied()
            .filter(|t| setup.threads[t.0 as usize].rank == rank)
            .collect();
        if mine.is_empty() {
            continue;
        }
        // Waits in a chain of joins that ends at a thread of `mine`, so it
        // cannot step before that thread does.
        let held = |start: ThreadId| {
            let mut t = start;
            for _ in 0..setup.threads.len() {
                match next(t) {
                    Some(HostCall::Join { thread, .. }) if !m.ended(thread) => {
                        if mine.contains(&thread) {
                            return true;
                        }
                        t = thread;
                    }
                    _ => return false,
                }
            }
            false
        };
        let closed = setup
            .threads_of(rank)
            .all(|t| mine.contains(&t) || m.ended(t) || held(t));
        if closed && best.as_ref().is_none_or(|b| mine.len() < b.len()) {
            best = Some(mine);
        }
    }
    best.unwrap_or_else(|| enabled.to_vec())
}

/// Describes the step thread `t` is about to take in `m`.
pub fn describe_step(c: &Compiled, m: &Machine, t: ThreadId) -> String {
    let setup = m.setup();
    let origin_text = |o: duplex::machine::Origin| {
        setup
            .origins
            .get(o.0 as usize)
            .map(|o| format!("`{}` ({})", o.text, o.place))
            .unwrap_or_default()
    };
    match m.next(t) {
        Next::Resume => {
            "returns: its connection handshake has completed, the op is enqueued".into()
        }
        Next::Call => match c.call(t, m.calls(t)) {
            Some(HostCall::Launch(spec)) => {
                let mut streams: Vec<String> = spec
                    .ops
                    .iter()
                    .map(|o| {
                        format!(
                            "stream {}, comm {}",
                            setup.streams[o.stream.0 as usize].name,
                            setup.comms[o.comm.0 as usize].name
                        )
                    })
                    .collect();
                streams.dedup();
                let mut after = m.clone();
                let handshake =
                    after.apply(t, HostCall::Launch(spec.clone())).is_ok() && after.in_handshake(t);
                if handshake {
                    format!(
                        "{} is the first use of a cold communicator toward this peer: the host blocks in the connection handshake (R7)",
                        origin_text(spec.origin)
                    )
                } else {
                    format!(
                        "{} enqueued on {}",
                        origin_text(spec.origin),
                        streams.join("; ")
                    )
                }
            }
            Some(HostCall::Sync { origin, .. }) => {
                format!("{} blocks until its streams drain", origin_text(*origin))
            }
            Some(HostCall::Await { origin, .. }) => {
                format!("{} waits for the message", origin_text(*origin))
            }
            Some(HostCall::Join { origin, .. }) => {
                format!("{} waits for the thread", origin_text(*origin))
            }
            Some(HostCall::Record { origin, .. })
            | Some(HostCall::Wait { origin, .. })
            | Some(HostCall::Notify { origin, .. }) => origin_text(*origin),
            Some(HostCall::End) | None => {
                "reaches its end and waits for all of its rank's streams to drain".into()
            }
        },
        Next::Blocked | Next::Finished => "cannot step".into(),
    }
}

/// Replays a schedule (the thread that steps at each host step) from the
/// program's start; returns the machine, the described steps and the first
/// error. Steps naming a thread that cannot step are skipped.
pub fn replay(
    c: &Compiled,
    schedule: &[ThreadId],
) -> (Machine, Vec<Step>, Result<(), ProgramError>) {
    let mut m = c.machine();
    let mut steps = Vec::new();
    for &t in schedule {
        if !runnable(c, &m).contains(&t) {
            continue;
        }
        let info = &m.setup().threads[t.0 as usize];
        steps.push(Step {
            step: steps.len() + 1,
            rank: info.rank,
            thread: info.name.clone(),
            action: describe_step(c, &m, t),
        });
        if let Err(e) = step(c, &mut m, t) {
            return (m, steps, Err(e));
        }
    }
    (m, steps, Ok(()))
}

/// Explores every interleaving of the program's host threads.
pub fn check(c: &Compiled, options: &Options) -> Outcome {
    let start = Instant::now();
    let root = c.machine();
    let mut visited: HashSet<u128> = HashSet::new();
    // Node i was reached from node parents[i].0 by a step of thread parents[i].1.
    let mut parents: Vec<(u32, ThreadId)> = vec![(u32::MAX, ThreadId(0))];
    visited.insert(fingerprint(&root));
    let mut transitions = 0usize;
    let stats = |visited: &HashSet<u128>, transitions| Stats {
        states: visited.len(),
        transitions,
        elapsed: start.elapsed(),
    };
    let schedule_to = |parents: &Vec<(u32, ThreadId)>, mut node: u32| {
        let mut path = Vec::new();
        while node != 0 {
            let (p, t) = parents[node as usize];
            path.push(t);
            node = p;
        }
        path.reverse();
        path
    };
    let finish = |verdict, visited: &HashSet<u128>, transitions| Outcome {
        verdict,
        stats: stats(visited, transitions),
    };
    if let Some(v) = judge(c, &root, &[]) {
        return finish(v, &visited, 0);
    }
    let mut queue: VecDeque<(Machine, u32)> = VecDeque::from([(root, 0)]);
    while let Some((m, node)) = queue.pop_front() {
        let threads = expand(c, &m, options.reduce);
        for t in threads {
            let mut child = m.clone();
            transitions += 1;
            if step(c, &mut child, t).is_err() {
                let mut path = schedule_to(&parents, node);
                path.push(t);
                let (_, trace, result) = replay(c, &path);
                let error = result.err().unwrap_or_else(|| ProgramError::Invalid {
                    place: "replay".into(),
                    message: "an error found by the search did not replay (a bug in duplex)".into(),
                });
                return finish(Verdict::Error { error, trace }, &visited, transitions);
            }
            if !visited.insert(fingerprint(&child)) {
                continue;
            }
            parents.push((node, t));
            let id = (parents.len() - 1) as u32;
            let path = || schedule_to(&parents, id);
            if let Some(v) = judge(c, &child, &path()) {
                return finish(v, &visited, transitions);
            }
            if visited.len() >= options.max_states {
                return finish(Verdict::Inconclusive, &visited, transitions);
            }
            queue.push_back((child, id));
        }
    }
    finish(Verdict::Ok, &visited, transitions)
}

/// The verdict a state forces: a hang, or a finished program's leftover
/// error. `None` while it can still move, or when it finished cleanly.
fn judge(c: &Compiled, m: &Machine, path: &[ThreadId]) -> Option<Verdict> {
    match m.status(&Remaining(c)) {
        Status::Running => None,
        Status::Stuck => {
            let (_, trace, _) = replay(c, path);
            Some(Verdict::Deadlock {
                stuck: Box::new(m.stuck(&Remaining(c))),
                trace,
            })
        }
        Status::Finished => m.leftover().map(|error| {
            let (_, trace, _) = replay(c, path);
            Verdict::Error { error, trace }
        }),
    }
}
