//! The simulated transport: user rank code, written against
//! [`duplex::Transport`], runs on real threads on the CPU, driven through the
//! state machine of [`duplex::machine`] by a deterministic scheduler.
//!
//! ```
//! use duplex::{Policy, Transport};
//! use duplex_sim::Sim;
//!
//! // Two ranks each send, then receive: the seed's hang.
//! let seed = |t: &duplex_sim::SimRank| -> duplex::Result<()> {
//!     let peer = 1 - t.rank();
//!     let out = t.alloc::<f32>(1024)?;
//!     let mut inb = t.alloc::<f32>(1024)?;
//!     t.send(&out, peer)?;
//!     t.recv(&mut inb, peer)?;
//!     t.synchronize()
//! };
//! let hang = Sim::new(2).policy(Policy::Shared).check(seed).unwrap_err();
//! assert!(hang.to_string().contains("wait-for cycle"));
//! Sim::new(2).policy(Policy::PerDirection).check(seed).unwrap();
//! ```
//!
//! Three ways to run: [`Sim::run`] follows one seeded random schedule;
//! [`Sim::check`] explores every interleaving that matters (depth-first, by
//! re-execution, with dynamic partial-order reduction, [`crate::dpor`]:
//! it learns from the steps it runs which of them depend on each other, so
//! threads that touch nothing in common are explored in one execution;
//! and with state caching: a state is the machine's, each rank's device
//! order, and the data, so that two executions that gave the code
//! different bytes are never taken for one);
//! [`Sim::replay`] follows a schedule string printed by a failure. A hang of
//! the transport never hangs the test: every blocked call returns
//! [`duplex::Error::Hang`] with the same report as `duplex check`, and the
//! run returns a [`Failure`] that prints the schedule and the call that
//! replays it. Once an execution is over, every call fails at once with its
//! error; a thread that goes on calling regardless (a loop that retries a
//! failed wait, as it may on GPUs) is ended at its 100th such call, by
//! unwinding its code, so that the run returns. Dropping a [`SimBuffer`]
//! frees its bytes once the ops in flight on it are done with them.
//!
//! User code must be deterministic given what its transport calls return
//! (as loom and shuttle require): the explorer re-executes it, and
//! [`Sim::check`] checks, at every decision it replays, that the state is
//! the one it recorded there ([`Failure::Nondeterministic`] if not). Host memory
//! that several host threads share outside the transport is not a scheduling
//! point and is not explored. And a wait outside the transport (a lock, a
//! channel or a `std::sync::Barrier` that rank threads share) is invisible
//! to the simulator, which runs one thread at a time: it can neither see
//! nor end it. Once the waiting thread has gone [`Sim::user_code_limit`]
//! (30 s by default) without a transport call, the execution ends with an
//! error that names it and says so (also on stderr at once), and the
//! threads parked in transport calls return errors; the test then ends if
//! that frees the wait (a channel whose sender is dropped, a lock
//! released), and stays blocked if not (a barrier). Synchronize ranks
//! through the transport (`notify`/`await_notify`, `join`) instead.

mod rank;
mod world;

use std::collections::HashMap;
use std::fmt;
use std::io::Write as _;
use std::sync::{Arc, Condvar, Mutex};

use duplex::trace::Trace;
use duplex::{Dir, Error, Hang, Model, Policy, Rank};

pub use rank::{SimBuffer, SimComm, SimEvent, SimRank, SimStream, SimThread};

use crate::dpor::Dpor;
use crate::explore::{Dfs, Pct, Random, Replay, Schedule, Strategy};
use duplex::machine::{CommId, Machine, Setup, StreamId, ThreadId};
use world::{Ctl, Ending, Shared, World};

/// The default bound on executions of [`Sim::check`], unless
/// `DUPLEX_MAX_EXECUTIONS` says otherwise.
pub const DEFAULT_MAX_EXECUTIONS: usize = 20_000;

/// How often a long [`Sim::check`] says on stderr how far it got.
const PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// A long [`Sim::check`]'s line on stderr, so that a search of minutes is
/// not taken for a hung test (`cargo test -- --nocapture` shows it; cargo
/// shows it for a test that fails).
fn progress(executions: usize, states: usize, elapsed: std::time::Duration) {
    let _ = writeln!(
        std::io::stderr(),
        "duplex-sim: Sim::check still exploring after {:.0} s: {executions} executions, {states} states (bounds: Sim::max_executions, Sim::time_limit)",
        elapsed.as_secs_f64()
    );
}

/// The default of [`Sim::user_code_limit`].
pub const DEFAULT_USER_CODE_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// A simulated world of ranks. Build it, then [`Sim::run`], [`Sim::check`] or
/// [`Sim::replay`] a rank closure.
#[derive(Clone, Debug)]
pub struct Sim {
    ranks: u32,
    policy: Policy,
    copy_from: Option<u64>,
    model: Model,
    /// The bound of [`Sim::check`], or why `DUPLEX_MAX_EXECUTIONS` gives
    /// none (reported by [`Sim::check`] as [`Failure::Setting`]).
    max_executions: Result<usize, String>,
    reduce: bool,
    trace_to: Option<std::path::PathBuf>,
    user_code_limit: std::time::Duration,
    /// [`Sim::time_limit`].
    time_limit: Option<std::time::Duration>,
}

/// The search of [`Sim::check`], between executions.
enum Search {
    Dfs(Dfs),
    Dpor(Box<Dpor>),
}

impl Search {
    fn strategy(self) -> Strategy {
        match self {
            Search::Dfs(d) => Strategy::Dfs(d),
            Search::Dpor(d) => Strategy::Dpor(d),
        }
    }

    fn back(s: Strategy) -> Search {
        match s {
            Strategy::Dfs(d) => Search::Dfs(d),
            Strategy::Dpor(d) => Search::Dpor(d),
            _ => unreachable!("the strategy comes back as it went"),
        }
    }

    fn diverged(&self) -> Option<usize> {
        match self {
            Search::Dfs(d) => d.diverged(),
            Search::Dpor(d) => d.diverged(),
        }
    }

    fn backtrack(&mut self) -> Option<usize> {
        match self {
            Search::Dfs(d) => d.backtrack(),
            Search::Dpor(d) => d.backtrack(),
        }
    }

    fn states(&self) -> usize {
        match self {
            Search::Dfs(d) => d.states(),
            Search::Dpor(d) => d.states(),
        }
    }
}

/// What a successful run explored.
#[derive(Clone, Debug)]
pub struct Run {
    /// Executions run (1 for [`Sim::run`] and [`Sim::replay`]).
    pub executions: usize,
    /// Distinct states seen at decision points ([`Sim::check`]).
    pub states: usize,
    /// The schedule of the last execution.
    pub schedule: String,
    /// What the ranks issued in the last execution, which
    /// [`Trace::analyze`] replays through the machine.
    pub trace: Trace,
}

/// Why a simulated run failed. `Display` prints the whole report, the
/// schedule and the call that replays it.
#[derive(Clone, Debug)]
pub enum Failure {
    /// No host thread could move: the report says what is stuck and why.
    Hang(Box<Hang>),
    /// A program error (size or type mismatch, a send grouped on one side
    /// only, a message never received).
    Program {
        /// The thread whose call found it, if any.
        thread: Option<String>,
        /// The error, naming the ops.
        error: Box<Error>,
        /// The schedule that reaches it.
        schedule: String,
        /// The host steps that lead there.
        steps: Vec<String>,
        /// How to replay it.
        replay: String,
    },
    /// A rank's code returned an error or panicked.
    Thread {
        /// The thread.
        thread: String,
        /// Its error or panic message.
        error: String,
        /// The schedule that reaches it.
        schedule: String,
        /// How to replay it.
        replay: String,
    },
    /// [`Sim::check`] ran out of executions, or of time, before it
    /// explored everything.
    Bound {
        /// Executions run.
        executions: usize,
        /// States seen.
        states: usize,
        /// The time limit it reached ([`Sim::time_limit`]); `None`: the
        /// bound on executions.
        time_limit: Option<std::time::Duration>,
    },
    /// [`Sim::replay`] was given a schedule that does not fit the program.
    Schedule(String),
    /// [`Sim::check`] ran the rank code again along a path it had taken
    /// and it did something else: the code is not deterministic given
    /// what the transport returns, so the search cannot cover it.
    Nondeterministic(String),
    /// A setting from the environment does not parse
    /// (`DUPLEX_MAX_EXECUTIONS`); nothing ran.
    Setting(String),
}

impl Failure {
    /// The hang report, if this is a hang.
    pub fn hang(&self) -> Option<&Hang> {
        match self {
            Failure::Hang(h) => Some(h),
            _ => None,
        }
    }

    /// The schedule that reproduces the failure, where there is one.
    pub fn schedule(&self) -> Option<&str> {
        match self {
            Failure::Hang(h) => h.schedule.as_deref(),
            Failure::Program { schedule, .. } | Failure::Thread { schedule, .. } => Some(schedule),
            Failure::Bound { .. }
            | Failure::Schedule(_)
            | Failure::Nondeterministic(_)
            | Failure::Setting(_) => None,
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Hang(h) => write!(f, "HANG: {h}"),
            Failure::Program {
                thread,
                error,
                schedule,
                steps,
                replay,
            } => {
                writeln!(
                    f,
                    "PROGRAM ERROR{}: {error}",
                    thread
                        .as_ref()
                        .map(|t| format!(" at {t}"))
                        .unwrap_or_default()
                )?;
                if let Error::Program { ops, .. } = &**error {
                    for o in ops {
                        writeln!(f, "  {o}")?;
                    }
                }
                writeln!(
                    f,
                    "interleaving that leads there ({}):",
                    duplex::report::counted(steps.len() as u64, "host step")
                )?;
                for s in steps {
                    writeln!(f, "  {s}")?;
                }
                writeln!(f, "schedule: {schedule}")?;
                writeln!(f, "replay it with: {replay}")
            }
            Failure::Thread {
                thread,
                error,
                schedule,
                replay,
            } => {
                writeln!(f, "{thread} failed: {error}")?;
                writeln!(f, "schedule: {schedule}")?;
                writeln!(f, "replay it with: {replay}")
            }
            Failure::Bound {
                executions,
                states,
                time_limit: None,
            } => write!(
                f,
                "the exploration stopped after {executions} executions ({states} states) without covering every interleaving; \
                 raise the bound with Sim::max_executions(n) or DUPLEX_MAX_EXECUTIONS=n, or make the program smaller"
            ),
            Failure::Bound {
                executions,
                states,
                time_limit: Some(limit),
            } => write!(
                f,
                "the exploration reached its time limit of {limit:?} after {executions} executions ({states} states) without covering every interleaving; \
                 raise it with Sim::time_limit, or make the program smaller (fewer host threads, iterations or ranks)"
            ),
            Failure::Schedule(m) => write!(f, "cannot replay: {m}"),
            Failure::Nondeterministic(m) => write!(f, "the rank code is not deterministic: {m}"),
            Failure::Setting(m) => write!(f, "invalid setting: {m}"),
        }
    }
}

impl std::error::Error for Failure {}

/// The lanes of a policy: (rank, peer, direction) → comm and stream, by
/// arithmetic. Every lane has its ids reserved up front, so that they are
/// the same in every interleaving (the explorer compares states that name
/// them), but a lane's communicator and streams get their names and
/// members only when a rank first uses it ([`Lanes::open`]): a world of N
/// ranks reserves N² communicators and 2N² streams, so that must cost no
/// allocation per lane.
#[derive(Debug)]
pub(crate) struct Lanes {
    ranks: u32,
    policy: Policy,
    /// Ops of at least this many bytes go on copy-engine lanes.
    copy_from: Option<u64>,
    defaults: Vec<StreamId>,
    /// The first lane communicator (`1 + lo·N + hi`, or `1 + src·N + dst`).
    comm_base: u32,
    /// The first copy-engine lane (`src·N + dst` after it), when
    /// `copy_from` is set.
    copy_base: u32,
    /// The first lane stream (`base + rank·2N + k`).
    stream_base: u32,
}

impl Lanes {
    /// Reserves the lanes of `policy` among the ranks of `s`, whose
    /// communicators and streams so far are the world and the defaults.
    fn reserve(
        s: &mut Setup,
        policy: Policy,
        copy_from: Option<u64>,
        warm: bool,
        defaults: Vec<StreamId>,
    ) -> Lanes {
        let n = s.ranks;
        let copy_from = copy_from.filter(|_| policy == Policy::PerDirection);
        let nn = n as usize * n as usize;
        let lanes = Lanes {
            ranks: n,
            policy,
            copy_from,
            defaults,
            comm_base: s.comms.len() as u32,
            copy_base: (s.comms.len() + nn) as u32,
            stream_base: s.streams.len() as u32,
        };
        for _ in 0..nn {
            s.add_comm(String::new(), Vec::new(), warm);
        }
        if copy_from.is_some() {
            for _ in 0..nn {
                s.add_copy_lane(String::new(), Vec::new());
            }
        }
        for r in 0..n {
            for _ in 0..2 * n {
                s.add_stream(r, String::new());
            }
        }
        lanes
    }

    /// The size from which ops go on copy-engine lanes, if any.
    pub(crate) fn copy_from(&self) -> Option<u64> {
        self.copy_from
    }

    /// The communicator and stream of `rank`'s lane toward `peer` in
    /// direction `dir` for a message of `bytes` (`None`: the NCCL lane,
    /// whatever the size); `None` when `peer` does not exist.
    fn get(
        &self,
        rank: Rank,
        peer: Rank,
        dir: Dir,
        bytes: Option<u64>,
    ) -> Option<(CommId, StreamId)> {
        let n = self.ranks;
        if rank >= n || peer >= n {
            return None;
        }
        let copy = bytes.is_some_and(|b| {
            duplex::compile::goes_by_copy(self.policy, self.copy_from, rank, peer, b)
        });
        let (comm, k) = match self.policy {
            Policy::Shared => {
                let (lo, hi) = (rank.min(peer), rank.max(peer));
                (lo * n + hi, peer)
            }
            Policy::PerDirection => match dir {
                Dir::Send => (rank * n + peer, peer),
                // A rank's lane to itself is one stream both ways.
                Dir::Recv if peer == rank => (peer * n + rank, peer),
                Dir::Recv => (peer * n + rank, n + peer),
            },
        };
        let base = if copy { self.copy_base } else { self.comm_base };
        Some((
            CommId(base + comm),
            StreamId(self.stream_base + rank * 2 * n + k),
        ))
    }

    /// [`Lanes::get`], naming the lane's communicator and stream in
    /// `setup` the first time; returns them and the lane's name.
    fn open(
        &self,
        setup: &mut Setup,
        rank: Rank,
        peer: Rank,
        dir: Dir,
        bytes: Option<u64>,
    ) -> Option<(CommId, StreamId, String)> {
        let (comm, stream) = self.get(rank, peer, dir, bytes)?;
        let (name, members, stream_name) = if setup.comms[comm.0 as usize].copy {
            duplex::compile::copy_lane(rank, dir, peer)
        } else {
            duplex::compile::lane(self.policy, rank, dir, peer)
        };
        let c = &mut setup.comms[comm.0 as usize];
        if c.name.is_empty() {
            c.name = name.clone();
            c.members = members;
        }
        let s = &mut setup.streams[stream.0 as usize];
        if s.name.is_empty() {
            s.name = stream_name;
        }
        Some((comm, stream, name))
    }
}

/// The bound of [`Sim::check`] that `DUPLEX_MAX_EXECUTIONS` (`value`)
/// gives: [`DEFAULT_MAX_EXECUTIONS`] when unset, else a whole number of
/// executions, at least 1; anything else is an error naming the value, not
/// a silent default.
fn max_executions_from(value: Option<&str>) -> Result<usize, String> {
    let Some(v) = value else {
        return Ok(DEFAULT_MAX_EXECUTIONS);
    };
    match duplex::positive_count(v).and_then(|n| usize::try_from(n).ok()) {
        Some(n) => Ok(n),
        None => Err(format!(
            "DUPLEX_MAX_EXECUTIONS=`{v}`: give a whole number of executions, at least 1 (the default is {DEFAULT_MAX_EXECUTIONS}), or bound the check with Sim::max_executions(n)"
        )),
    }
}

impl Sim {
    /// A world of `ranks` ranks, policy [`Policy::Shared`], the strict model.
    pub fn new(ranks: u32) -> Sim {
        let max_executions =
            max_executions_from(std::env::var("DUPLEX_MAX_EXECUTIONS").ok().as_deref());
        Sim {
            ranks,
            policy: Policy::Shared,
            copy_from: None,
            model: Model::default(),
            max_executions,
            reduce: true,
            trace_to: None,
            user_code_limit: DEFAULT_USER_CODE_LIMIT,
            time_limit: None,
        }
    }

    /// Places ops without an explicit place by `policy`.
    pub fn policy(mut self, policy: Policy) -> Sim {
        self.policy = policy;
        self
    }

    /// Under [`Policy::PerDirection`], places ops of at least `size` bytes
    /// without an explicit communicator on copy-engine lanes
    /// ([`duplex::compile::goes_by_copy`]); `None` (the default): none.
    pub fn copy_from(mut self, size: Option<duplex::Size>) -> Sim {
        self.copy_from = size.map(duplex::Size::bytes);
        self
    }

    /// Runs under `model` (eager capacity, lazy connection, ...).
    pub fn model(mut self, model: Model) -> Sim {
        self.model = model;
        self
    }

    /// How long one host thread may run its own code between two transport
    /// calls while every other thread waits for it (default
    /// [`DEFAULT_USER_CODE_LIMIT`]). The simulator runs one host thread at
    /// a time, so a thread that waits for another outside the transport (a
    /// lock, a channel or a barrier the rank threads share) waits for ever;
    /// past the limit the execution ends with an error naming that thread,
    /// and the threads parked in transport calls return errors, which ends
    /// such a wait when their code gives up what it holds. Any transport
    /// call counts (`alloc`, `read` and `write` too). Raise it for code
    /// that computes for long between calls, or under a debugger that
    /// stops the process; `Duration::MAX` turns the check off.
    pub fn user_code_limit(mut self, limit: std::time::Duration) -> Sim {
        self.user_code_limit = limit;
        self
    }

    /// Bounds [`Sim::check`] in time: past `limit`, counted from its start,
    /// it stops after the execution under way with [`Failure::Bound`]
    /// (default: no limit; the bound on executions still holds). A search
    /// that runs longer than 30 s says every 30 s on stderr how far it got.
    pub fn time_limit(mut self, limit: std::time::Duration) -> Sim {
        self.time_limit = Some(limit);
        self
    }

    /// Bounds [`Sim::check`] to `n` executions, at least 1 (0 is
    /// reported by [`Sim::check`] as [`Failure::Setting`], as
    /// `DUPLEX_MAX_EXECUTIONS=0` is).
    pub fn max_executions(mut self, n: usize) -> Sim {
        self.max_executions = if n == 0 {
            Err("Sim::max_executions(0): a check runs at least one execution".into())
        } else {
            Ok(n)
        };
        self
    }

    /// Refuses a world without ranks, before anything runs.
    fn valid(&self) -> Result<(), Failure> {
        if self.ranks == 0 {
            return Err(Failure::Setting(
                "Sim::new(0): a world has at least one rank".into(),
            ));
        }
        Ok(())
    }

    /// When a run fails, writes its execution as a Chrome/Perfetto trace
    /// to `path` ([`crate::perfetto`]; open it in ui.perfetto.dev).
    pub fn trace_to(mut self, path: impl Into<std::path::PathBuf>) -> Sim {
        self.trace_to = Some(path.into());
        self
    }

    /// Explores every interleaving, without the reduction (slower; for
    /// cross-checking).
    pub fn without_reduction(mut self) -> Sim {
        self.reduce = false;
        self
    }

    /// Runs `f` on every rank once, following the random schedule of `seed`.
    pub fn run<F>(&self, seed: u64, f: F) -> Result<Run, Failure>
    where
        F: Fn(&SimRank) -> duplex::Result<()> + Sync,
    {
        self.once(Strategy::Random(Random::new(seed)), &f)
    }

    /// One execution under `strategy`.
    fn once<F>(&self, strategy: Strategy, f: &F) -> Result<Run, Failure>
    where
        F: Fn(&SimRank) -> duplex::Result<()> + Sync,
    {
        self.valid()?;
        let (ending, strategy, choices, trace) = self.execute(strategy, f);
        self.conclude(ending, &choices, &trace)
            .inspect_err(|_| self.write_trace(&trace))?;
        // A replayed schedule that names more choices than the execution
        // made is not this program's.
        if let Strategy::Replay(r) = &strategy
            && let Some(left) = r.left_over()
        {
            return Err(Failure::Schedule(format!(
                "{left} left when the execution ended"
            )));
        }
        Ok(Run {
            executions: 1,
            states: 0,
            schedule: Schedule::v1(choices).to_string(),
            trace,
        })
    }

    /// Runs `f` on every rank once under the PCT schedule of `seed`
    /// ([`crate::explore::Pct`]) for bugs of depth `depth`: random thread
    /// priorities with `depth - 1` priority drops, which finds a bug of that
    /// depth with a known probability per run. Run many seeds.
    pub fn pct<F>(&self, seed: u64, depth: u32, f: F) -> Result<Run, Failure>
    where
        F: Fn(&SimRank) -> duplex::Result<()> + Sync,
    {
        const STEPS: u64 = 1024;
        self.once(Strategy::Pct(Pct::new(seed, depth, STEPS)), &f)
    }

    /// Runs `f` on every rank following `schedule`, a string printed by a
    /// [`Failure`].
    pub fn replay<F>(&self, schedule: &str, f: F) -> Result<Run, Failure>
    where
        F: Fn(&SimRank) -> duplex::Result<()> + Sync,
    {
        let choices: Schedule = schedule.parse().map_err(Failure::Schedule)?;
        if choices.reduced {
            return Err(Failure::Schedule(format!(
                "`{schedule}` is a reduced (`v2:` or `v3:`) schedule of `duplex check`, which replays it (`duplex check FILE --replay {schedule}`); Sim::replay takes the `v1:` schedules the simulated transport prints"
            )));
        }
        self.once(Strategy::Replay(Replay::new(choices)), &f)
            .map_err(|e| match e {
                // Name the schedule given, not the part of it that was
                // followed before the program went another way.
                Failure::Schedule(m) => Failure::Schedule(format!(
                    "{m}; the schedule given was `{schedule}`: replay it on the program, policy and model that printed it"
                )),
                other => other,
            })
    }

    /// Runs `f` under every interleaving of the host threads that matters,
    /// until one fails or all have been explored.
    pub fn check<F>(&self, f: F) -> Result<Run, Failure>
    where
        F: Fn(&SimRank) -> duplex::Result<()> + Sync,
    {
        self.valid()?;
        let max_executions = self.max_executions.clone().map_err(Failure::Setting)?;
        // Where steps of different ranks commute (no kernel-slot bound),
        // the search learns which steps of one rank's threads depend on
        // each other as it runs them (`crate::dpor`); else it searches
        // each rank's threads' orders with the checker's reduction.
        let mut search = if self.reduce && self.model.kernels.is_none() {
            Search::Dpor(Box::new(Dpor::new()))
        } else {
            Search::Dfs(Dfs::verifying())
        };
        let mut executions = 0;
        let start = std::time::Instant::now();
        let mut said = start;
        loop {
            executions += 1;
            let (ending, strategy, choices, trace) = self.execute(search.strategy(), &f);
            search = Search::back(strategy);
            if let (Some(Ending::Mismatch), Some(d)) = (&ending, search.diverged()) {
                return Err(Failure::Nondeterministic(format!(
                    "execution {executions} of the rank code, made with the same first {} as an earlier one, reached another state there (its threads were told other data, made other calls, or allocated otherwise): Sim::check runs the code again for every interleaving it explores, and needs it to do the same given what the transport returns (no clock, randomness, iteration order of a HashMap, or state kept across executions in a static; an `alloc` refused for memory in one execution and not in another also counts, since the simulator's cap on memory is shared by the tests that run at once)",
                    duplex::report::counted(d as u64, "choice")
                )));
            }
            self.conclude(ending, &choices, &trace)
                .inspect_err(|_| self.write_trace(&trace))?;
            if search.backtrack().is_none() {
                return Ok(Run {
                    executions,
                    states: search.states(),
                    schedule: Schedule::v1(choices.clone()).to_string(),
                    trace,
                });
            }
            if executions >= max_executions {
                return Err(Failure::Bound {
                    executions,
                    states: search.states(),
                    time_limit: None,
                });
            }
            if let Some(limit) = self.time_limit
                && start.elapsed() >= limit
            {
                return Err(Failure::Bound {
                    executions,
                    states: search.states(),
                    time_limit: Some(limit),
                });
            }
            if said.elapsed() >= PROGRESS_EVERY {
                said = std::time::Instant::now();
                progress(executions, search.states(), start.elapsed());
            }
        }
    }

    /// Writes a failed execution's timeline where [`Sim::trace_to`] says.
    fn write_trace(&self, trace: &Trace) {
        let Some(path) = &self.trace_to else { return };
        let timeline = trace.timeline(self.model);
        if let Err(e) = crate::perfetto::write_chrome_trace_to(&timeline, "duplex-sim", path) {
            tracing::warn!(path = %path.display(), error = %e, "cannot write the trace");
        }
    }

    fn replay_hint(&self) -> String {
        let policy = match self.policy {
            Policy::Shared => "Policy::Shared",
            Policy::PerDirection => "Policy::PerDirection",
        };
        let policy = match self.copy_from {
            Some(c) => format!("{policy}).copy_from(Some(duplex::Size({c})))"),
            None => format!("{policy})"),
        };
        let model = if self.model == Model::default() {
            String::new()
        } else {
            // A literal that compiles where the hint is pasted.
            let m = &self.model;
            format!(
                ".model(duplex::Model {{ eager: duplex::Size({}), lazy_connect: {}, comm_order: {}, kernels: {:?}, one_sided_groups: {}, cold_mismatched_only: {} }})",
                m.eager.0,
                m.lazy_connect,
                m.comm_order,
                m.kernels,
                m.one_sided_groups,
                m.cold_mismatched_only
            )
        };
        format!(
            "duplex_sim::Sim::new({}).policy({policy}{model}",
            self.ranks
        )
    }

    fn conclude(
        &self,
        ending: Option<Ending>,
        choices: &[ThreadId],
        trace: &Trace,
    ) -> Result<(), Failure> {
        let schedule = Schedule::v1(choices.to_vec()).to_string();
        let replay = format!("{}.replay(\"{schedule}\", ...)", self.replay_hint());
        // Threads as hang reports name them: `rank 0 tx`.
        let name = |t: u32| {
            trace.threads.get(t as usize).map_or_else(
                || format!("thread #{t}"),
                |o| format!("rank {} {}", o.rank, o.name),
            )
        };
        match ending {
            None | Some(Ending::Pruned) => Ok(()),
            Some(Ending::Hang(h)) => Err(Failure::Hang(h)),
            Some(Ending::Program { thread, error }) => Err(Failure::Program {
                thread: thread.map(|t| name(t.0)),
                error: Box::new(error),
                schedule,
                // The calls made, in the order made: the host steps.
                steps: trace
                    .calls
                    .iter()
                    .map(|c| format!("{}: {} ({})", name(c.thread), c.text, c.place))
                    .collect(),
                replay,
            }),
            Some(Ending::Thread { thread, error }) => Err(Failure::Thread {
                thread: name(thread.0),
                error,
                schedule,
                replay,
            }),
            Some(Ending::Mismatch) => Err(Failure::Schedule(format!(
                "the program left the schedule after its first {} (`{schedule}`)",
                duplex::report::counted(choices.len() as u64, "choice")
            ))),
        }
    }

    /// The setup every execution starts from: the world communicator, a
    /// `default` stream per rank, the main threads, and the policy's lanes
    /// (reserved up front, so that their ids are the same in every
    /// interleaving; see [`Lanes`]).
    fn setup(&self) -> (Setup, Lanes) {
        let mut s = Setup::new(self.ranks, self.model);
        let cold = self.model.lazy_connect;
        s.add_comm("world", (0..self.ranks).collect(), !cold);
        for r in 0..self.ranks {
            s.add_thread(r, "main");
        }
        let defaults = (0..self.ranks)
            .map(|r| s.add_stream(r, "default"))
            .collect();
        let warm = duplex::compile::lane_connected(self.policy, !cold);
        let lanes = Lanes::reserve(&mut s, self.policy, self.copy_from, warm, defaults);
        (s, lanes)
    }

    /// One execution: returns how it ended, the strategy (for the next
    /// execution), the choices made and the trace of the calls made.
    fn execute<F>(
        &self,
        strategy: Strategy,
        f: &F,
    ) -> (Option<Ending>, Strategy, Vec<ThreadId>, Trace)
    where
        F: Fn(&SimRank) -> duplex::Result<()> + Sync,
    {
        let (setup, lanes) = self.setup();
        let lanes = Arc::new(lanes);
        let setup_base = (
            setup.threads.len(),
            setup.streams.len(),
            setup.comms.len(),
            setup.events.len(),
        );
        let mut machine = Machine::new(Arc::new(setup));
        machine.record_deliveries();
        static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let world = World {
            run: RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            machine,
            ctl: (0..self.ranks).map(|_| Ctl::Starting).collect(),
            turns: (0..self.ranks).map(|_| Arc::new(Condvar::new())).collect(),
            running: None,
            over: false,
            ending: None,
            explorer: strategy,
            reduce: self.reduce,
            buffers: Vec::new(),
            buffer_bytes: 0,
            op_buffers: HashMap::new(),
            unsynced: HashMap::new(),
            unsynced_by_buffer: HashMap::new(),
            sync_covers: HashMap::new(),
            orders: (0..self.ranks)
                .map(|_| duplex::order::Order::new())
                .collect(),
            snapshots: HashMap::new(),
            observed: Vec::new(),
            events_made: Vec::new(),
            made_by: Default::default(),
            origins: HashMap::new(),
            steps: Vec::new(),
            choices: Vec::new(),
            results: (0..self.ranks).map(|_| None).collect(),
            os_threads: Vec::new(),
            user_comms: Vec::new(),
            comm_calls: vec![0; self.ranks as usize],
            calls: Vec::new(),
            describe: format!("policy {}, model {}", self.policy, self.model),
            replay_hint: self.replay_hint(),
            progress: 0,
            late_calls: Vec::new(),
            user_code_limit: self.user_code_limit,
            setup_base,
        };
        let shared = Arc::new(Shared {
            world: Mutex::new(world),
        });
        let run = shared.lock().run;
        std::thread::scope(|scope| {
            for r in 0..self.ranks {
                let handle = SimRank::new(
                    shared.clone(),
                    r,
                    ThreadId(r),
                    run,
                    self.ranks,
                    self.policy,
                    lanes.clone(),
                );
                let started = std::thread::Builder::new()
                    .name(format!("duplex-sim rank {r}"))
                    .spawn_scoped(scope, move || rank::run_thread(handle, |t| f(t)));
                if let Err(e) = started {
                    // The ranks started so far wait for their turn: ending
                    // the execution lets them go, and says why.
                    let mut w = shared.lock();
                    w.end(world::Ending::Thread {
                        thread: ThreadId(r),
                        error: format!(
                            "cannot start the OS thread of rank {r} ({e}): the simulator runs an OS thread per rank and per spawned thread; raise the limit on threads (ulimit -u, a container's pids limit) or on memory (ulimit -v: each thread has its stack), or run fewer ranks"
                        ),
                    });
                    w.wake();
                    return;
                }
            }
            let mut w = shared.lock();
            w.schedule();
            w.wake();
        });
        // Threads started by `spawn` may outlive the rank closures.
        loop {
            let handles = std::mem::take(&mut shared.lock().os_threads);
            if handles.is_empty() {
                break;
            }
            for h in handles {
                let _ = h.join();
            }
        }
        let mut w = shared.lock();
        let strategy = std::mem::replace(&mut w.explorer, Strategy::Random(Random::new(0)));
        let ending = w.ending.take();
        let choices = std::mem::take(&mut w.choices);
        let calls = std::mem::take(&mut w.calls);
        let trace = Trace::from_calls(w.machine.setup(), calls.iter().map(|(t, c)| (*t, c)));
        (ending, strategy, choices, trace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `DUPLEX_MAX_EXECUTIONS` takes a whole number, at least 1; anything
    /// else is an error [`Sim::check`] reports, where it once fell back to
    /// the default without a word.
    #[test]
    fn a_bound_that_is_not_a_whole_number_is_an_error() {
        assert_eq!(max_executions_from(None), Ok(DEFAULT_MAX_EXECUTIONS));
        assert_eq!(max_executions_from(Some("7")), Ok(7));
        assert_eq!(max_executions_from(Some(" 100000 ")), Ok(100_000));
        for bad in ["", "0", "-1", "1e6", "lots"] {
            let e = max_executions_from(Some(bad)).expect_err(bad);
            assert!(e.contains(&format!("`{bad}`")), "{e}");
        }
        let sim = Sim {
            max_executions: max_executions_from(Some("lots")),
            ..Sim::new(1)
        };
        let e = sim.check(|_| Ok(())).expect_err("an invalid setting");
        assert!(matches!(e, Failure::Setting(_)), "{e}");
        assert!(
            e.to_string().contains("DUPLEX_MAX_EXECUTIONS=`lots`"),
            "{e}"
        );
    }
}
