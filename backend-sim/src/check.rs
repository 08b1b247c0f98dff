//! The checker: decides whether any interleaving of a program's host threads
//! can hang or hit a program error.
//!
//! It drives the machine with the one explorer ([`crate::explore`]): a
//! depth-first search ([`Dfs`]) over the persistent sets of [`reduce`],
//! pruning decision points whose state (128-bit xxh3 fingerprint of
//! [`State`](duplex::machine::State)) it has explored before. Where the
//! reduction leaves one choice, the machine steps in place: no clone, no
//! hash. It keeps a snapshot of the machine at each decision point on the
//! current path, so a backtrack resumes there instead of re-executing, and
//! its memory grows with the depth of the search and the number of
//! branching states, not with every state. The snapshots stay within a
//! budget ([`Options::snapshot_memory`]): past it the search keeps one at
//! every second decision point, then every fourth, and a backtrack
//! re-executes from the nearest one kept (`Snapshots`). It knows nothing
//! of the rules; it only asks the [`Machine`] which threads can step.
//!
//! **Reduction.** Host steps of different ranks commute (they touch
//! different streams, different sides of a channel, counters and sets) and
//! never disable each other (what a thread waits for, once true, stays true
//! until its own rank consumes it). So when some rank has no thread that is
//! blocked but will step again, the steps of that rank's runnable threads form
//! a persistent set: exploring only them reaches every stuck state and every
//! error that the full search reaches (Godefroid's persistent sets; the state
//! graph is acyclic, so state caching loses nothing). [`Options::reduce`]
//! turns this off, and the tests check that both searches agree. Under a
//! kernel-slot bound (R10, `kernels=N`) this holds only on ranks whose
//! launches take slots in issue order whatever the timing
//! ([`Machine::slots_in_issue_order`]: one slot, no copy-engine lane) or
//! that cannot reach the bound. Elsewhere a step of one rank can make a
//! launch of another rank ready (a message delivered, a copy completed)
//! while that rank's own next step issues a launch for the same slot, and
//! the order decides which gets it; such programs are searched without the
//! reduction across ranks (an independent exhaustive search,
//! `tests/oracle.rs`, found the miss).
//!
//! **Across host threads of one rank.** A thread whose next step commutes
//! with every call the other threads of its rank may still make
//! ([`duplex::machine::Machine::commute`]) is a persistent set alone, so
//! threads with independent traffic are explored in one execution: their
//! one Mazurkiewicz trace. Where threads' steps depend (launches of one rank
//! on one communicator: their order decides which send meets which recv),
//! the search enumerates their orders, but state caching merges the orders
//! that lead to equal states, so it runs fewer executions than there are
//! traces: on 2 ranks × T threads that each launch one group on one
//! communicator, at least (T!)² traces, it runs 360 executions for T = 4
//! (≥ 576 traces), 3,800 for T = 5 (≥ 14,400) and 43,050 for T = 6
//! (≥ 518,400) (`examples/scale.rs`, `docs/checker-stats.md`). This is why
//! the checker uses persistent sets with state caching rather than a
//! stateless dynamic POR: on these programs the cache does what source
//! sets would, and more.
//!
//! **Cost per step.** The runnable threads are kept up to date from the
//! ranks each step touched ([`Runnable`]); device progress is
//! event-driven (`duplex::machine`, module `device`); a runnable thread that
//! is its rank's only thread is a persistent set alone and is taken without
//! looking at the others. So a host step costs what it changes, and a run of
//! a million host steps is linear (`docs/checker-stats.md`).
//!
//! A counterexample comes with its [`Schedule`] (`v1:…`), which
//! [`replay_schedule`] and `duplex check --replay` follow back to it.

use std::collections::{BTreeSet, VecDeque};
use std::hash::Hash;
use std::time::{Duration, Instant};

use xxhash_rust::xxh3::Xxh3Default;

use crate::explore::{Choice, Dfs, Replay, Schedule, Scheduler};
use duplex::compile::{Compiled, Remaining};
use duplex::machine::{HostCall, Machine, Next, ProgramError, Status, Stuck, ThreadId, Threads};

/// Bounds of a check.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Stop after this many distinct branching states (decision points
    /// with more than one choice) and report the check as inconclusive.
    pub max_states: usize,
    /// Explore one rank's steps at a time where that is sound (see the
    /// module docs). On by default.
    pub reduce: bool,
    /// Stop after this long and report the check as inconclusive.
    pub time_limit: Option<Duration>,
    /// The most bytes the search's snapshots of the machine may hold (an
    /// estimate, [`estimated_snapshot_bytes`]); `None`: [`default_snapshot_memory`].
    /// Past it the search keeps a snapshot at every second decision point,
    /// then every fourth, and so on, and a backtrack re-executes from the
    /// nearest one it kept: the verdict is the same, found more slowly
    /// ([`Stats::snapshots`]).
    pub snapshot_memory: Option<usize>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            max_states: 5_000_000,
            reduce: true,
            time_limit: None,
            snapshot_memory: None,
        }
    }
}

/// The snapshot budget of a check that sets none: half the memory
/// available when first asked (Linux's `MemAvailable`, under a cgroup's
/// limit), or 4 GiB where that is unknown; at least 64 MiB.
pub fn default_snapshot_memory() -> usize {
    let half = crate::memory::available().map_or(4 << 30, |a| a / 2);
    usize::try_from(half).unwrap_or(usize::MAX).max(64 << 20)
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
        /// The schedule that replays it ([`replay_schedule`]).
        schedule: Schedule,
    },
    /// This interleaving hits a program error.
    Error {
        /// The error.
        error: ProgramError,
        /// The host steps that lead there.
        trace: Vec<Step>,
        /// The schedule that replays it ([`replay_schedule`]).
        schedule: Schedule,
    },
    /// The state bound was reached before the search finished.
    Inconclusive,
}

impl Verdict {
    /// Its kind, as the JSON report and the examples' `# expect:` lines
    /// spell it: `ok`, `deadlock`, `error` or `inconclusive`.
    pub fn kind(&self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Deadlock { .. } => "deadlock",
            Verdict::Error { .. } => "error",
            Verdict::Inconclusive => "inconclusive",
        }
    }
}

/// Search statistics.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Stats {
    /// Distinct branching states explored (decision points with more than
    /// one choice; the states in between are stepped through, not stored).
    pub states: usize,
    /// Host steps taken (edges of the state graph explored).
    pub transitions: usize,
    /// Executions: paths from the start to an end, a hang or a pruned
    /// state.
    pub executions: usize,
    /// The most decision points on one path.
    pub depth: usize,
    /// How the search kept within [`Options::snapshot_memory`], when the
    /// budget made it keep fewer snapshots than decision points.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshots: Option<Thinned>,
    /// Which bound stopped an inconclusive search.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped: Option<Bound>,
    /// Wall-clock time of the search.
    #[serde(serialize_with = "seconds")]
    pub elapsed: Duration,
}

/// A bound that stops a search before it decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Bound {
    /// [`Options::max_states`].
    States,
    /// [`Options::time_limit`].
    Time,
}

/// How a search kept within its snapshot budget ([`Stats::snapshots`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Thinned {
    /// The widest spacing of the snapshots it kept: one decision point in
    /// this many at most.
    pub every: usize,
    /// Whether it kept none at all (one snapshot was larger than the
    /// budget): every backtrack re-executed from the start.
    pub kept_none: bool,
    /// Host steps taken again, from a kept snapshot or the start, because
    /// the snapshot of the decision point a backtrack returned to was not
    /// kept (not counted in [`Stats::transitions`]).
    pub replayed: usize,
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
    fingerprint_sized(m).0
}

/// The fingerprint of a machine state and how many bytes of it were
/// hashed (what [`estimated_snapshot_bytes`] scales).
fn fingerprint_sized(m: &Machine) -> (u128, usize) {
    /// Counts the bytes it hashes.
    struct Counting(Xxh3Default, usize);
    impl std::hash::Hasher for Counting {
        fn write(&mut self, bytes: &[u8]) {
            self.1 += bytes.len();
            self.0.update(bytes);
        }
        fn finish(&self) -> u64 {
            self.0.digest()
        }
    }
    let mut h = Counting(Xxh3Default::new(), 0);
    m.state().hash(&mut h);
    (h.0.digest128(), h.1)
}

/// Heap bytes a machine's clone holds per byte its state hashes: vectors'
/// spare capacity, tree nodes and the caches that are not part of the
/// state. Measured with a counting allocator (`tests/snapshot_memory.rs`):
/// the estimate is within 3% of a clone on a ring of 256 ranks of 4
/// threads (145 KB), and between 0.9 and 2.5 times it on the small
/// examples, whose launches hash more than they hold; the test keeps it
/// between half and three times.
const HEAP_PER_HASHED_BYTE: usize = 4;

/// The estimated heap bytes of a snapshot of `m` (whose state hashed
/// `hashed` bytes) and `run`.
fn snapshot_bytes(hashed: usize, run: &Runnable) -> usize {
    hashed * HEAP_PER_HASHED_BYTE + run.heap_bytes()
}

/// The estimated heap bytes of a snapshot of `m` and `run`, as the search
/// counts them against [`Options::snapshot_memory`].
pub fn estimated_snapshot_bytes(m: &Machine, run: &Runnable) -> usize {
    snapshot_bytes(fingerprint_sized(m).1, run)
}

/// Takes thread `t`'s next host step, which must be possible.
pub fn step(c: &Compiled, m: &mut Machine, t: ThreadId) -> Result<(), ProgramError> {
    match m.next(t) {
        Next::Resume => m.resume(t),
        Next::Call => {
            let call = c.call(t, m.calls(t)).unwrap_or(&HostCall::End);
            m.apply(t, call)
        }
        Next::Blocked | Next::Finished => Ok(()),
    }
}

/// The threads that can step in `m`, in id order.
pub fn runnable(c: &Compiled, m: &Machine) -> Vec<ThreadId> {
    m.runnable(&Remaining(c))
}

/// Whether thread `t` can step in `m`: it can resume a call, or make its
/// next call, which nothing holds back.
fn can_step(c: &Compiled, m: &Machine, t: ThreadId) -> bool {
    match m.next(t) {
        Next::Resume => true,
        Next::Call => c.call(t, m.calls(t)).is_some_and(|call| m.enabled(t, call)),
        Next::Blocked | Next::Finished => false,
    }
}

/// The runnable threads of a machine, kept up to date from the ranks each
/// step touches ([`Machine::take_touched`]), so that a step costs the
/// threads of the ranks it changed, not every thread.
///
/// The runnable threads that are their rank's only thread wait in a queue:
/// each is a persistent set alone ([`reduce`]), so the search may take any
/// of them; taking them in turn (a thread takes up to [`BURST`] steps at
/// the front, then goes to the back) keeps what is in flight small, where
/// taking the lowest first would run each rank to its end before the next
/// one starts, and a burst keeps a thread's next calls, which lie together
/// in memory, in the cache.
#[derive(Clone, Debug)]
pub struct Runnable {
    on: Vec<bool>,
    /// Per thread: whether it is its rank's only thread.
    alone: Vec<bool>,
    /// Per thread: whether it is in `queue`.
    queued: Vec<bool>,
    /// Runnable threads that are alone on their rank, in turn; may hold
    /// threads no longer runnable, skipped when they reach the front.
    queue: VecDeque<ThreadId>,
    /// How many threads that are alone on their rank can step.
    solo: usize,
    /// The other runnable threads.
    rest: BTreeSet<ThreadId>,
    /// Scratch: the ranks a step touched.
    touched: Vec<u32>,
    /// The thread at the front of `queue` and how many steps it took there.
    streak: (ThreadId, u32),
    /// Steps a thread alone on its rank takes in a row.
    burst: u32,
}

/// Steps a thread alone on its rank takes in a row ([`Runnable::take_alone`]).
/// Part of what a `v3:` schedule means: a change needs a new schedule tag
/// (`v2:` schedules were recorded with bursts of 1).
pub const BURST: u32 = 64;

impl Runnable {
    /// The runnable threads of `m`, which starts keeping track of what
    /// its steps touch.
    pub fn new(c: &Compiled, m: &mut Machine) -> Runnable {
        Runnable::with_burst(c, m, BURST)
    }

    /// [`Runnable::new`] where a thread alone on its rank takes `burst`
    /// steps in a row ([`Runnable::take_alone`]; 1 replays a `v2:` schedule).
    pub fn with_burst(c: &Compiled, m: &mut Machine, burst: u32) -> Runnable {
        let mut touched = Vec::new();
        m.take_touched(&mut touched);
        let setup = m.setup();
        let n = setup.threads.len();
        let alone = (0..n)
            .map(|i| setup.threads_of(setup.threads[i].rank).nth(1).is_none())
            .collect();
        let mut r = Runnable {
            on: vec![false; n],
            alone,
            queued: vec![false; n],
            queue: VecDeque::new(),
            solo: 0,
            rest: BTreeSet::new(),
            touched,
            streak: (ThreadId(u32::MAX), 0),
            burst: burst.max(1),
        };
        for i in 0..n {
            r.set(ThreadId(i as u32), can_step(c, m, ThreadId(i as u32)));
        }
        r
    }

    fn set(&mut self, t: ThreadId, on: bool) {
        let i = t.0 as usize;
        let was = std::mem::replace(&mut self.on[i], on);
        if self.alone[i] {
            match (was, on) {
                (false, true) => self.solo += 1,
                (true, false) => self.solo -= 1,
                _ => {}
            }
            if on && !self.queued[i] {
                self.queued[i] = true;
                self.queue.push_back(t);
            }
        } else if on && !was {
            self.rest.insert(t);
        } else if was && !on {
            self.rest.remove(&t);
        }
    }

    /// The heap bytes it holds, about.
    pub fn heap_bytes(&self) -> usize {
        3 * self.on.len()
            + size_of::<ThreadId>() * self.queue.capacity()
            // A B-tree's node holds up to 11 keys and two words.
            + (size_of::<ThreadId>() + 2) * self.rest.len()
            + size_of::<u32>() * self.touched.capacity()
    }

    /// Brings the set up to date after steps of `m`.
    pub fn update(&mut self, c: &Compiled, m: &mut Machine) {
        let mut touched = std::mem::take(&mut self.touched);
        m.take_touched(&mut touched);
        for r in &touched {
            for t in m.setup().threads_of(*r) {
                self.set(t, can_step(c, m, t));
            }
        }
        self.touched = touched;
        #[cfg(debug_assertions)]
        if self.on.len() <= 64 {
            debug_assert_eq!(self.all(), runnable(c, m), "the runnable set is stale");
        }
    }

    /// How many threads can step.
    pub fn len(&self) -> usize {
        self.solo + self.rest.len()
    }

    /// True when no thread can step.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether thread `t` can step.
    pub fn contains(&self, t: ThreadId) -> bool {
        self.on.get(t.0 as usize).copied().unwrap_or(false)
    }

    /// The threads that can step, in id order.
    pub fn all(&self) -> Vec<ThreadId> {
        (0..self.on.len())
            .filter(|i| self.on[*i])
            .map(|i| ThreadId(i as u32))
            .collect()
    }

    /// Drops threads that cannot step from the front of the queue.
    fn clean(&mut self) -> Option<ThreadId> {
        while let Some(t) = self.queue.front().copied() {
            if self.on[t.0 as usize] {
                return Some(t);
            }
            self.queue.pop_front();
            self.queued[t.0 as usize] = false;
        }
        None
    }

    /// A thread that can step: the next of the queue, else the lowest.
    pub fn first(&mut self) -> Option<ThreadId> {
        self.clean().or_else(|| self.rest.first().copied())
    }

    /// The next runnable thread that is its rank's only thread: the one at
    /// the queue's front, which stays there for a burst of steps and then
    /// goes to the back (once it has stepped, if it still can step): its
    /// step is a persistent set alone (steps of other ranks commute with it
    /// and none disables it; see [`reduce`]).
    pub fn take_alone(&mut self) -> Option<ThreadId> {
        let t = self.clean()?;
        // A thread keeps the front for a burst of steps: its next calls
        // lie next to each other in memory, and the threads in between
        // would each bring their own into the cache.
        if self.streak.0 != t {
            self.streak = (t, 0);
        }
        self.streak.1 += 1;
        if self.streak.1 >= self.burst {
            self.streak.1 = 0;
            self.queue.pop_front();
            self.queued[t.0 as usize] = false;
        }
        Some(t)
    }

    /// Takes thread `t` off the queue, if it is at its front (it goes to
    /// the back once it has stepped).
    fn took(&mut self, t: ThreadId) {
        if self.queue.front() == Some(&t) {
            self.queue.pop_front();
            self.queued[t.0 as usize] = false;
        }
    }
}

/// What the search does next from a state.
#[derive(Debug)]
enum Decision {
    /// Nothing to choose: this thread steps.
    Forced(ThreadId),
    /// A decision point: the runnable threads and those worth exploring.
    Choose {
        enabled: Vec<ThreadId>,
        options: Vec<ThreadId>,
    },
}

/// The next step of the search from `m`, one rule for the checker and its
/// replays: the only runnable thread; else, with `reduce`, the next thread
/// alone on its rank ([`Runnable::take_alone`]) or the one thread of
/// [`reduce`]'s set; else a decision point. `None` when no thread can
/// step. A `v3:` schedule ([`Schedule`]) records the choices at the
/// decision points of `decide(.., true)`; a `v1:` one those of
/// `decide(.., false)`, every point where more than one thread can step.
fn decide(c: &Compiled, m: &Machine, run: &mut Runnable, reduce_steps: bool) -> Option<Decision> {
    let first = run.first()?;
    if run.len() == 1 {
        run.took(first);
        return Some(Decision::Forced(first));
    }
    if reduce_steps
        && ranks_commute(m, &Remaining(c))
        && let Some(t) = run.take_alone()
    {
        return Some(Decision::Forced(t));
    }
    let enabled = run.all();
    let options = if reduce_steps {
        reduce(m, &enabled, &Remaining(c))
    } else {
        enabled.clone()
    };
    if options.len() == 1 {
        return Some(Decision::Forced(options[0]));
    }
    Some(Decision::Choose { enabled, options })
}

/// Whether host steps of different ranks commute in `m`, as the reduction
/// assumes: not under a kernel-slot bound (R10) in general, where a step
/// of one rank can make a launch of another rank ready (a message
/// delivered, a copy completed) while a step of that other rank issues a
/// launch that would take the same slot, and which one gets it depends on
/// their order. Those programs are searched without the reduction (a
/// `notify` or a `join`, which touches no device state, still goes alone).
///
/// Two kinds of rank have no such race, and when every rank is one of
/// them the steps commute as without a bound:
/// * a rank whose launches take slots in issue order whatever the timing
///   ([`Machine::slots_in_issue_order`]: `kernels=1` and no copy-engine
///   lane): a launch starts exactly when the launches its rank issued
///   before it have completed, which no order of other ranks' steps
///   changes;
/// * where the remaining calls are known, a rank that cannot reach the
///   bound: its launches in flight and those still to come take at most
///   the bound's slots, so none ever waits for one (R10 never blocks).
fn ranks_commute(m: &Machine, threads: &dyn Threads) -> bool {
    let Some(k) = m.setup().model.kernels else {
        return true;
    };
    let setup = m.setup();
    (0..setup.ranks).all(|r| {
        if m.slots_in_issue_order(r) {
            return true;
        }
        let to_come = setup
            .threads_of(r)
            .map(|t| threads.slots_to_come(m, t))
            .try_fold(0usize, |sum, n| n.map(|n| sum + n));
        to_come.is_some_and(|n| m.slots_wanted(r) + n <= k as usize)
    })
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

/// The enabled threads of the rank with fewest of them among the ranks
/// whose every other thread cannot step before one of these does (it has
/// ended, or it waits in a chain of `join`s that ends at one of these): a
/// persistent set where steps of different ranks commute
/// ([`ranks_commute`]). The search of rank code takes it when it is one
/// thread ([`crate::dpor`]): that thread's user code cannot meet another
/// thread of its rank either, since none can run before it.
pub(crate) fn closed_rank(
    m: &Machine,
    enabled: &[ThreadId],
    threads: &dyn Threads,
) -> Option<Vec<ThreadId>> {
    let setup = m.setup();
    let next = |t: ThreadId| match m.next(t) {
        Next::Call => threads.next_call(m, t),
        _ => None,
    };
    let mut best: Option<Vec<ThreadId>> = None;
    let mut by_rank: std::collections::BTreeMap<u32, Vec<ThreadId>> = Default::default();
    for t in enabled {
        by_rank
            .entry(setup.threads[t.0 as usize].rank)
            .or_default()
            .push(*t);
    }
    for (rank, mut mine) in by_rank {
        // Sorted, for the lookups below (a rank of thousands of threads
        // made them quadratic per step).
        mine.sort_unstable();
        let has = |t: &ThreadId| mine.binary_search(t).is_ok();
        // Waits in a chain of joins that ends at a thread of `mine`, so it
        // cannot step before that thread does.
        let held = |start: ThreadId| {
            let mut t = start;
            for _ in 0..setup.threads.len() {
                match next(t) {
                    Some(HostCall::Join { thread, .. }) if !m.ended(thread) => {
                        if has(&thread) {
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
            .all(|t| has(&t) || m.ended(t) || held(t));
        if closed && best.as_ref().is_none_or(|b| mine.len() < b.len()) {
            best = Some(mine);
            if best.as_ref().is_some_and(|b| b.len() == 1) {
                break; // none is smaller
            }
        }
    }
    best
}

/// A persistent set of the enabled threads (module docs):
///
/// * a thread whose next call is a `notify` or a `join` alone: those calls
///   change nothing another step reads, commute with every step and disable
///   none;
/// * else the enabled threads of the rank with fewest of them among the
///   ranks whose every other thread cannot step before one of these does:
///   it has ended, or it waits in a `join` for such a thread; when that is
///   one thread, it alone;
/// * else one enabled thread whose step commutes with every call the other
///   threads of its rank may still make ([`Machine::commute`], through
///   [`Threads::may_conflict`]; the checker knows each thread's remaining
///   calls): with steps of other ranks commuting too, that step alone is a
///   persistent set;
/// * else that rank's enabled threads, or all of `enabled`.
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
    if !ranks_commute(m, threads) {
        return enabled.to_vec();
    }
    let best = closed_rank(m, enabled, threads);
    if let Some(b) = &best
        && b.len() == 1
    {
        return best.unwrap_or_default();
    }
    // A thread whose step commutes with everything the other threads of its
    // rank may still do is a persistent set alone: steps of other ranks
    // commute with it too, and none of them disables it.
    let step_of = |t: ThreadId| match m.next(t) {
        Next::Resume => m.call_in_progress(t),
        Next::Call => threads.next_call(m, t),
        Next::Blocked | Next::Finished => None,
    };
    let candidates = best.as_deref().unwrap_or(enabled);
    for &u in candidates {
        let Some(call) = step_of(u) else { continue };
        let rank = setup.threads[u.0 as usize].rank;
        let alone = setup
            .threads_of(rank)
            .filter(|v| *v != u)
            .all(|v| !threads.may_conflict(m, v, u, &call));
        if alone {
            return vec![u];
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
            .map(|o| format!("`{}` ({})", o.text, o.place()))
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
                let accepted = m.check_issue(t, &HostCall::Launch(spec.clone())).is_ok();
                if !accepted {
                    // The last step of an error path: nothing is enqueued.
                    return format!(
                        "{} is refused, and nothing is enqueued (the error above)",
                        origin_text(spec.origin)
                    );
                }
                if m.would_handshake(t, spec) {
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

/// Replays a path (the thread that steps at each host step) from the
/// program's start; returns the machine, the described steps, the first
/// error and the schedule of the path: its choices wherever more than one
/// thread could step (`v1:`, see [`Schedule`]), which replay under any
/// policy and model; or, when that would name more than
/// [`V1_CHOICES`] threads and the path is one the reduced search takes
/// (`reduce`), its choices at that search's decision points only (`v3:`),
/// which replay under the same policy and model. Steps naming a thread
/// that cannot step are skipped.
pub fn replay_path(
    c: &Compiled,
    path: &[ThreadId],
    reduce_steps: bool,
) -> (Machine, Vec<Step>, Result<(), ProgramError>, Schedule) {
    let mut m = c.machine();
    let mut run = Runnable::new(c, &mut m);
    let mut steps = Vec::new();
    let (mut v1, mut v2) = (Vec::new(), Vec::new());
    let mut reduced = reduce_steps;
    let schedule = |reduced, v1: Vec<ThreadId>, v2| {
        if reduced && v1.len() > V1_CHOICES {
            Schedule::v3(v2)
        } else {
            Schedule::v1(v1)
        }
    };
    for &t in path {
        if !run.contains(t) {
            continue;
        }
        if run.len() > 1 {
            v1.push(t);
        }
        if reduced {
            match decide(c, &m, &mut run, true) {
                Some(Decision::Forced(f)) if f == t => {}
                Some(Decision::Choose { options, .. }) if options.contains(&t) => v2.push(t),
                // Not a path of the reduced search: its schedule is `v1:`.
                _ => reduced = false,
            }
        }
        let info = &m.setup().threads[t.0 as usize];
        steps.push(Step {
            step: steps.len() + 1,
            rank: info.rank,
            thread: info.name.clone(),
            action: describe_step(c, &m, t),
        });
        if let Err(e) = step(c, &mut m, t) {
            return (m, steps, Err(e), schedule(reduced, v1, v2));
        }
        run.update(c, &mut m);
    }
    (m, steps, Ok(()), schedule(reduced, v1, v2))
}

/// The most choices a counterexample's `v1:` schedule may have; a longer
/// interleaving gets a `v3:` schedule (a program whose ranks have one
/// thread each runs a million steps with an empty `v3:` schedule, where its
/// `v1:` schedule would name a thread at nearly every step).
pub const V1_CHOICES: usize = 64;

/// Where a replay ends: the machine, the described steps, and the first
/// error.
pub type Replayed = (Machine, Vec<Step>, Result<(), ProgramError>);

/// Replays a path; see [`replay_path`].
pub fn replay(c: &Compiled, path: &[ThreadId]) -> Replayed {
    let (m, steps, result, _) = replay_path(c, path, true);
    (m, steps, result)
}

/// Follows a [`Schedule`] (printed with a counterexample) from the
/// program's start until no thread can step or an error; returns the
/// machine, the described steps and the first error. Fails when the
/// schedule does not fit the program.
pub fn replay_schedule(c: &Compiled, schedule: &Schedule) -> Result<Replayed, String> {
    let mut replayer = Replay::new(schedule.clone());
    let path = follow(c, &mut replayer, |_, _| {}).map_err(|(steps, named, enabled)| {
        if named.is_none() {
            format!(
                "the schedule `{schedule}` ends after {steps} host steps, where {} threads can step: it is not a complete schedule of this program",
                enabled.len()
            )
        } else {
            format!(
                "the schedule `{schedule}` does not fit this program: after {steps} host steps it names a thread that cannot step (threads that can: {})",
                enabled
                    .iter()
                    .map(|t| t.0.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    })?;
    if let Some(left) = replayer.left_over() {
        return Err(format!(
            "the schedule `{schedule}` does not fit this program: {left} left when no thread can step"
        ));
    }
    let (m, steps, result) = replay(c, &path);
    Ok((m, steps, result))
}

/// Steps the program from its start as `replayer` says until no thread can
/// step or a step fails, calling `each` before every step; returns the
/// path. At a point where more than one thread can step and the replayer
/// has no fitting choice, fails with the number of steps taken, the thread
/// it named (if any) and the threads that could step.
fn follow(
    c: &Compiled,
    replayer: &mut Replay,
    mut each: impl FnMut(&Machine, ThreadId),
) -> Result<Vec<ThreadId>, (usize, Option<ThreadId>, Vec<ThreadId>)> {
    let mut path = Vec::new();
    let mut m = c.machine();
    let mut run = Runnable::with_burst(c, &mut m, replayer.burst());
    let reduced = replayer.reduced();
    while let Some(decision) = decide(c, &m, &mut run, reduced) {
        let t = match decision {
            Decision::Forced(t) => t,
            Decision::Choose { enabled, options } => match replayer.take_next() {
                Some(t) if options.contains(&t) => t,
                named => return Err((path.len(), named, enabled)),
            },
        };
        each(&m, t);
        path.push(t);
        if step(c, &mut m, t).is_err() {
            break;
        }
        run.update(c, &mut m);
    }
    Ok(path)
}

/// The calls an execution that follows `schedule` makes, as a
/// [`duplex::trace::Trace`] (for its timeline, [`crate::perfetto`]).
pub fn trace_of(c: &Compiled, schedule: &Schedule) -> Result<duplex::trace::Trace, String> {
    let mut replayer = Replay::new(schedule.clone());
    let mut calls: Vec<(ThreadId, HostCall)> = Vec::new();
    follow(c, &mut replayer, |m, t| {
        if m.next(t) == Next::Call {
            calls.push((t, c.call(t, m.calls(t)).cloned().unwrap_or(HostCall::End)));
        }
    })
    .map_err(|_| format!("the schedule `{schedule}` does not fit this program"))?;
    Ok(duplex::trace::Trace::from_calls(
        &c.setup,
        calls.iter().map(|(t, call)| (*t, call)),
    ))
}

/// The verdict of the state a schedule leads to, and the host steps it
/// took: what `duplex check --replay` reports.
pub fn judge_schedule(c: &Compiled, schedule: &Schedule) -> Result<(Verdict, usize), String> {
    let (m, trace, result) = replay_schedule(c, schedule)?;
    let steps = trace.len();
    let verdict = match result {
        Err(error) => Verdict::Error {
            error,
            trace,
            schedule: schedule.clone(),
        },
        Ok(()) => match m.status(&Remaining(c)) {
            Status::Stuck => Verdict::Deadlock {
                stuck: Box::new(m.stuck(&Remaining(c))),
                trace,
                schedule: schedule.clone(),
            },
            _ => match m.leftover() {
                Some(error) => Verdict::Error {
                    error,
                    trace,
                    schedule: schedule.clone(),
                },
                None => Verdict::Ok,
            },
        },
    };
    Ok((verdict, steps))
}

/// A snapshot at a decision point: the machine before it, its runnable
/// threads, how long the path was, and its estimated size.
struct Snapshot {
    machine: Machine,
    run: Runnable,
    path: usize,
    bytes: usize,
}

/// The snapshots of the decision points on the current path, within a
/// budget of bytes. Decision point `d` keeps its snapshot when `d` is a
/// multiple of `every`; when the next one would not fit, `every` doubles
/// and the snapshots in between are dropped, so a path of any depth fits,
/// and a backtrack re-executes from the nearest kept snapshot before the
/// decision point it returns to. When backtracks have shortened the path
/// so that the kept snapshots take less than a quarter of the budget,
/// `every` halves (down to 1) for the snapshots taken from then on.
struct Snapshots {
    /// Per decision point of the current path, its snapshot if kept
    /// (boxed: a point without one costs a word).
    at: Vec<Option<Box<Snapshot>>>,
    /// The estimated bytes of the kept snapshots.
    bytes: usize,
    budget: usize,
    every: usize,
    /// What the budget did so far, when it made a difference.
    thinned: Option<Thinned>,
}

impl Snapshots {
    fn new(budget: usize) -> Snapshots {
        Snapshots {
            at: Vec::new(),
            bytes: 0,
            budget,
            every: 1,
            thinned: None,
        }
    }

    /// Whether decision point `depth` (at most one past the last) would
    /// take a snapshot now: it has none, and it is a multiple of `every`.
    fn wants(&self, depth: usize) -> bool {
        depth.is_multiple_of(self.every) && self.at.get(depth).is_none_or(|s| s.is_none())
    }

    /// Notes that the budget made a difference.
    fn thinned(&mut self) -> &mut Thinned {
        let kept_none = self.bytes == 0;
        self.thinned.get_or_insert(Thinned {
            every: 1,
            kept_none,
            replayed: 0,
        })
    }

    /// Offers decision point `depth`'s snapshot (at most one past the
    /// last), of `bytes`, made by `make` if it is kept.
    fn offer(&mut self, depth: usize, bytes: usize, make: impl FnOnce() -> Snapshot) {
        debug_assert!(depth <= self.at.len());
        if depth == self.at.len() {
            self.at.push(None);
        }
        if !self.wants(depth) {
            return;
        }
        // One larger than the whole budget is refused without dropping
        // the others for it.
        if bytes > self.budget {
            self.thinned();
            return;
        }
        while self.bytes + bytes > self.budget {
            self.every *= 2;
            let every = self.every;
            let thinned = self.thinned();
            thinned.every = thinned.every.max(every);
            for (d, slot) in self.at.iter_mut().enumerate() {
                if !d.is_multiple_of(every)
                    && let Some(s) = slot.take()
                {
                    self.bytes -= s.bytes;
                }
            }
            if !depth.is_multiple_of(every) {
                return;
            }
        }
        let snapshot = make();
        self.bytes += snapshot.bytes;
        self.at[depth] = Some(Box::new(snapshot));
        if let Some(t) = &mut self.thinned {
            t.kept_none = false;
        }
    }

    /// Forgets the decision points past `depth`; returns the nearest kept
    /// snapshot at or before it and its decision point, if any.
    fn back_to(&mut self, depth: usize) -> Option<(usize, &Snapshot)> {
        for s in self.at.drain(depth + 1..).flatten() {
            self.bytes -= s.bytes;
        }
        while self.every > 1 && self.bytes < self.budget / 4 {
            self.every /= 2;
        }
        self.at
            .iter()
            .enumerate()
            .rev()
            .find_map(|(d, s)| s.as_deref().map(|s| (d, s)))
    }
}

/// What a search has counted so far ([`Stats`]).
#[derive(Default)]
struct Counts {
    transitions: usize,
    executions: usize,
    depth: usize,
    replayed: usize,
}

/// Explores every interleaving of the program's host threads that matters.
pub fn check(c: &Compiled, options: &Options) -> Outcome {
    check_with(c, options, &mut |_| {})
}

/// [`check`], calling `progress` with the statistics so far about ten
/// times a second while it runs (for a progress bar).
pub fn check_with(c: &Compiled, options: &Options, progress: &mut dyn FnMut(&Stats)) -> Outcome {
    let start = Instant::now();
    let mut last_report = start;
    let mut dfs = Dfs::default();
    let mut snapshots = Snapshots::new(
        options
            .snapshot_memory
            .unwrap_or_else(default_snapshot_memory),
    );
    let mut m = c.machine();
    let mut run = Runnable::new(c, &mut m);
    let mut path: Vec<ThreadId> = Vec::new();
    let mut n = Counts::default();
    let mut stopped: Option<Bound> = None;
    // After a backtrack that restored a snapshot before the decision
    // point it changed: that point, which the steps up to it only
    // re-execute.
    let mut redo: Option<usize> = None;
    let stats = |dfs: &Dfs, n: &Counts, stopped, snapshots: &Snapshots| Stats {
        states: dfs.states(),
        transitions: n.transitions,
        executions: n.executions,
        depth: n.depth,
        snapshots: snapshots.thinned.map(|t| Thinned {
            replayed: n.replayed,
            ..t
        }),
        stopped,
        elapsed: start.elapsed(),
    };
    loop {
        n.executions += 1;
        // One execution, from the current machine and path.
        let verdict = loop {
            let t = match decide(c, &m, &mut run, options.reduce) {
                None => break judge(c, &m, &path, options.reduce),
                Some(Decision::Forced(t)) => t,
                Some(Decision::Choose {
                    enabled,
                    options: choices,
                }) => {
                    let depth = dfs.cursor();
                    // A decision point the search has a frame for needs
                    // no fingerprint, unless it is to keep a snapshot.
                    let (fp, hashed) = if depth < dfs.depth() && !snapshots.wants(depth) {
                        (0, 0)
                    } else {
                        fingerprint_sized(&m)
                    };
                    match dfs.choose(&enabled, &choices, fp) {
                        Choice::Take(t) => {
                            let bytes = snapshot_bytes(hashed, &run);
                            snapshots.offer(depth, bytes, || Snapshot {
                                machine: m.clone(),
                                run: run.clone(),
                                path: path.len(),
                                bytes,
                            });
                            t
                        }
                        Choice::Prune | Choice::Mismatch => break None,
                    }
                }
            };
            if redo.is_some_and(|d| dfs.cursor() <= d) {
                n.replayed += 1;
            } else {
                redo = None;
                n.transitions += 1;
            }
            path.push(t);
            if step(c, &mut m, t).is_err() {
                let (_, trace, result, schedule) = replay_path(c, &path, options.reduce);
                let error = result.err().unwrap_or_else(|| ProgramError::Invalid {
                    place: "replay".into(),
                    message: "an error found by the search did not replay (a bug in duplex)".into(),
                });
                break Some(Verdict::Error {
                    error,
                    trace,
                    schedule,
                });
            }
            run.update(c, &mut m);
            n.depth = n.depth.max(dfs.depth());
            if dfs.states() >= options.max_states {
                stopped = Some(Bound::States);
                break Some(Verdict::Inconclusive);
            }
            // Every 16 steps, re-executed ones included: a step of a
            // program with thousands of host threads can take milliseconds
            // (its reduction compares them pairwise), and the time limit
            // must still hold.
            if (n.transitions + n.replayed).is_multiple_of(16) {
                let now = Instant::now();
                if options
                    .time_limit
                    .is_some_and(|limit| now.duration_since(start) >= limit)
                {
                    stopped = Some(Bound::Time);
                    break Some(Verdict::Inconclusive);
                }
                if now.duration_since(last_report) >= Duration::from_millis(100) {
                    last_report = now;
                    progress(&stats(&dfs, &n, None, &snapshots));
                }
            }
        };
        if let Some(v) = verdict {
            return Outcome {
                verdict: v,
                stats: stats(&dfs, &n, stopped, &snapshots),
            };
        }
        let Some(d) = dfs.backtrack() else {
            return Outcome {
                verdict: Verdict::Ok,
                stats: stats(&dfs, &n, None, &snapshots),
            };
        };
        redo = match snapshots.back_to(d) {
            Some((at, snap)) => {
                m = snap.machine.clone();
                run = snap.run.clone();
                path.truncate(snap.path);
                dfs.rewind(at);
                (at < d).then_some(d)
            }
            // From the start, whose steps up to the first decision point
            // are taken again too.
            None => {
                m = c.machine();
                run = Runnable::new(c, &mut m);
                path.clear();
                dfs.rewind(0);
                Some(d)
            }
        };
    }
}

/// The verdict a state where no thread can step forces: a hang, or a
/// finished program's leftover error. `None` when it finished cleanly.
fn judge(c: &Compiled, m: &Machine, path: &[ThreadId], reduce_steps: bool) -> Option<Verdict> {
    match m.status(&Remaining(c)) {
        Status::Running => None,
        Status::Stuck => {
            let (_, trace, _, schedule) = replay_path(c, path, reduce_steps);
            Some(Verdict::Deadlock {
                stuck: Box::new(m.stuck(&Remaining(c))),
                trace,
                schedule,
            })
        }
        Status::Finished => m.leftover().map(|error| {
            let (_, trace, _, schedule) = replay_path(c, path, reduce_steps);
            Verdict::Error {
                error,
                trace,
                schedule,
            }
        }),
    }
}
