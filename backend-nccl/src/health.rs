//! Failure reaches every rank: a rank that fails says so, every other rank's
//! waits end with an error naming it, and on a hang every rank contributes
//! what it issued to the analysis.
//!
//! A rank fails when a wait passes its deadline (a hang), NCCL or CUDA
//! reports an error, its code panics or returns an error, or its process is
//! killed or frozen. The first four are posted by the rank itself
//! ([`Health::fail`]); the last is noticed by its silence.
//!
//! * [`LocalHealth`] (one process, a thread per rank): a list under a mutex
//!   shared by the ranks; a rank's death is its process's death, so there
//!   is no silence to detect.
//! * [`StoreHealth`] (a process per rank): failures go to the rank-0 store
//!   (`FAIL`); a thread per process sends a heartbeat (`BEAT`) every
//!   [`BEAT_EVERY`], and a monitor thread asks (`HEALTH`) as often whether
//!   another rank failed or has been silent longer than [`SILENCE`]
//!   (killed, crashed, or stopped). A rank that the others took for dead
//!   (frozen past the silence, then resumed) is told so, and ends too.
//!   When the store itself has answered nothing for [`SILENCE`] (it
//!   cannot be reached, or it is frozen), rank 0 (its host) is taken as
//!   dead; a store that answers `ERROR busy` is alive. What it learns is cached, so a wait polls a
//!   mutex, not the network.
//!
//! A rank that sees another's failure ends its waits with
//! [`duplex::Error::Aborted`] naming the failed rank and why, and its
//! watchdog aborts its communicators, so that no thread stays inside NCCL:
//! every surviving rank ends within its deadline plus about
//! [`SILENCE`] + [`BEAT_EVERY`].
//!
//! On a hang in a process-per-rank run, each rank publishes its
//! [`Trace`] to the store ([`Health::publish`]) before it returns, and the
//! rank whose deadline expired gathers the others' ([`Health::gather`]), so
//! that the analysis replays what every rank issued, as in a local run. A
//! rank that finishes cleanly publishes its trace too (up to 100,000
//! calls), so that a partner it returned without matching is named.
//!
//! A rank that finishes cleanly also posts what it issued on each channel
//! ([`Health::post_counts`]), for the end check that no send went
//! unreceived (`run::end_check`): a sender waits for the counts of the
//! ranks it sent to, and leaves its own for a rank still running
//! ([`Health::post_owed`]), which judges them as it finishes
//! ([`Health::owed_to`], one `KEYS` request).
//!
//! NCCL may see a death first: its network transport reports a peer's
//! closed socket as an error of this rank's communicator. Such an error
//! (and an abort) waits, a bounded time, for the monitor to name the rank
//! that caused it ([`culprit`]), or names a rank that finished cleanly
//! with work of this rank pending; a store client whose store stops
//! accepting connections fails each request at once, so the monitor
//! learns rank 0's death in [`SILENCE`], not in a request timeout more.
//!
//! A rank that finished cleanly is no failure, but an op of another rank
//! that waits for its match then never completes: a wait that lasts looks
//! for one among its rank's pending ops ([`unmatched_by`]; across
//! processes from the counts the finished rank posted, in one process from
//! the registry's issue check, which counts every op of every rank) and
//! ends with the hang report then, not at its deadline.
//!
//! A waiting rank names the first failure it learned of. Lingering ranks
//! (the store's host, and ranks whose lane service serves the others) ask
//! the store instead for every rank that has ended (`ENDED`: finished,
//! posted a failure, or silent past [`SILENCE`]), so that two ranks killed
//! at once cost one silence, not the linger's bound.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use duplex::Rank;
use duplex::trace::{ChannelCount, Trace};

use crate::store::{Store, deadline_after};

/// How often a process's monitor sends a heartbeat and checks the others.
pub const BEAT_EVERY: Duration = Duration::from_millis(200);

/// How long a rank (or the store) may be silent before it counts as dead.
pub const SILENCE: Duration = Duration::from_secs(3);

/// The other ranks' traces, for a hang's analysis ([`Health::gather`]).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Gathered {
    /// The traces that came, in rank order.
    pub traces: Vec<Trace>,
    /// The ranks whose trace did not come in time (or did not decode): the
    /// analysis does not know what they issued.
    pub missing: Vec<Rank>,
    /// The ranks whose own trace did not come, replaced by the snapshot
    /// each published when it learned of the failure ([`Health::publish_early`]):
    /// what they did since (a thread that was computing, say) is not
    /// known, so an analysis must say so (found by review: it was
    /// reported as replayed from what every rank issued).
    pub early: Vec<Rank>,
}

/// What a rank knows of the others' failures, and how it reports its own.
pub trait Health: Send + Sync + std::fmt::Debug {
    /// Records that `rank` failed, and why. Only a rank's first failure
    /// counts; never blocks for long.
    fn fail(&self, rank: Rank, why: &str);
    /// The first known failure of a rank other than `me`: `(rank, why)`;
    /// or `me` itself, when the job took `me` for dead (across processes:
    /// its heartbeats stopped past [`SILENCE`], frozen or starved, and it
    /// runs again) and no other failure is known: the others have ended
    /// their waits on it, so its own must end too.
    fn failed(&self, me: Rank) -> Option<(Rank, String)>;
    /// Whether the other ranks' traces must be gathered for an analysis
    /// (they live in other processes).
    fn remote(&self) -> bool;
    /// Publishes this rank's trace for the others' analyses.
    fn publish(&self, rank: Rank, trace: &Trace);
    /// Publishes a snapshot of this rank's trace taken when it learned of
    /// another rank's failure, before any [`Health::publish`] of its own
    /// (a thread of the rank may be issuing, or computing, and publish
    /// nothing else). It never takes the place of one: an analysis reads
    /// it only for a rank whose own did not come.
    fn publish_early(&self, rank: Rank, trace: &Trace);
    /// The traces the other ranks published, waiting up to `wait` for all
    /// of them to arrive, and the ranks whose trace did not come.
    fn gather(&self, ranks: u32, me: Rank, wait: Duration) -> Gathered;
    /// Says that `rank` finished cleanly: its silence from now on is no
    /// failure.
    fn finished(&self, rank: Rank);
    /// The first of `ranks` known to have finished cleanly
    /// ([`Health::finished`]), if any. Never waits and makes no request:
    /// across processes it reads what the monitor learned (asking starts
    /// the monitor's watch for the ranks asked about: a caller that polls
    /// about a few sees them within a heartbeat or two, about more than 8
    /// within five or six; `StoreHealth::look_for_finished`).
    fn finished_among(&self, ranks: &[Rank]) -> Option<Rank>;
    /// The counts `rank` posted as it finished ([`Health::post_counts`]),
    /// once the monitor has read them: like [`Health::finished_among`], it
    /// never waits and makes no request (across processes the monitor
    /// reads them within a heartbeat of seeing `rank` finished). `None`
    /// in one process, whose registry counts every rank.
    fn finished_counts(&self, rank: Rank) -> Option<Arc<Vec<ChannelCount>>> {
        let _ = rank;
        None
    }
    /// Whether `me` posted a failure of its own ([`Health::fail`]) before
    /// any other rank's failure was known: its later errors are its own,
    /// not another rank's.
    fn failed_itself(&self, me: Rank) -> bool;
    /// Waits (up to `wait`) until every other rank has finished or failed:
    /// for the rank that hosts the store, so that the store outlives them;
    /// and for a rank with lanes made on first use, whose lane service
    /// serves the others meanwhile. Once any other rank is known to have
    /// failed (the job is ending), it waits at most `after_failure` more:
    /// zero for the lane service, and for the store's host the time the
    /// others' waits take to end on that failure (a rank busy outside
    /// duplex does not keep a failed job's host up).
    fn linger(&self, ranks: u32, me: Rank, wait: Duration, after_failure: Duration);
    /// Posts what `rank` issued on each channel as it finishes cleanly,
    /// for the end checks of the ranks that sent to it
    /// (`Registry::unreceived_with`). Nothing to do in one process, whose
    /// registry sees every rank.
    fn post_counts(&self, rank: Rank, counts: &[ChannelCount]) {
        let _ = (rank, counts);
    }
    /// The counts each of `peers` posted as it finished
    /// ([`Health::post_counts`]), waiting up to `wait` for them: `None`
    /// once any rank is known to have failed (the job is failing, and says
    /// why elsewhere) or when a peer ended without finishing cleanly;
    /// otherwise those that came, and the peers still running when the
    /// wait ran out ([`Heard::missing`]). `Err` when the store cannot be
    /// read or a peer's counts do not decode.
    fn counts_of(&self, me: Rank, peers: &[Rank], wait: Duration) -> Result<Option<Heard>, String> {
        let _ = (me, peers, wait);
        Ok(None)
    }
    /// Leaves what `rank` sent to `to` (its channel counts toward `to`) for
    /// `to` to judge as it finishes ([`Health::owed_to`]): posted by a
    /// sender whose wait for `to` to finish ran out. `Err` says why it
    /// could not.
    fn post_owed(&self, rank: Rank, to: Rank, counts: &[ChannelCount]) -> Result<(), String> {
        let _ = (rank, to, counts);
        Ok(())
    }
    /// The sends that ranks which finished before `me` left for it to judge
    /// ([`Health::post_owed`]), by sender, each with the sender's published
    /// trace when there is one (to name its calls).
    fn owed_to(&self, me: Rank) -> Result<BTreeMap<Rank, Owed>, String> {
        let _ = me;
        Ok(BTreeMap::new())
    }
    /// Says that `rank` is done with the store (its end check is over):
    /// the rank that hosts the store waits for it ([`Health::wait_left`]).
    fn left(&self, rank: Rank) {
        let _ = rank;
    }
    /// For the rank that hosts the store, after [`Health::linger`]: waits
    /// (up to `wait`) until every other rank that finished cleanly is done
    /// with the store ([`Health::left`]), so that their end checks can
    /// still read it.
    fn wait_left(&self, ranks: u32, me: Rank, wait: Duration) {
        let _ = (ranks, me, wait);
    }
}

/// What [`Health::counts_of`] heard from the peers a rank sent to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Heard {
    /// Each peer's counts, posted as it finished.
    pub counts: BTreeMap<Rank, Vec<ChannelCount>>,
    /// The peers that had not finished when the wait ran out.
    pub missing: Vec<Rank>,
}

/// Sends a rank left for another to judge ([`Health::post_owed`]).
#[derive(Debug, Clone)]
pub struct Owed {
    /// The sender's counts on its channels to the judge.
    pub counts: Vec<ChannelCount>,
    /// The sender's trace, as it published it at its end, if it did.
    pub trace: Option<Trace>,
}

/// How another rank caused an error of this rank ([`culprit`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerCause {
    /// It failed, for this reason.
    Failed(String),
    /// It finished cleanly while work of this rank with it was pending.
    Finished,
}

/// The rank that caused an error of `me`: one known to have failed (any
/// rank of the job: a failure anywhere explains an abort), waited for up to
/// `patience` since a death is noticed by its silence; else a rank of
/// `members` other than `me` that finished cleanly (the work of `me` with
/// it can never complete): at once when it is the only other member, else
/// at the end of the wait. None when `me` failed itself first:
/// its errors are then its own, and another rank's failure may be only its
/// echo.
pub fn culprit(
    health: &dyn Health,
    me: Rank,
    members: &[Rank],
    patience: Duration,
) -> Option<(Rank, PeerCause)> {
    let others: Vec<Rank> = members.iter().copied().filter(|r| *r != me).collect();
    if others.is_empty() {
        return None;
    }
    // Asked at once, so that across processes the monitor has looked by
    // the end.
    let _ = health.finished_among(&others);
    let now = Instant::now();
    let deadline = now.checked_add(patience).unwrap_or(now);
    loop {
        if health.failed_itself(me) {
            return None;
        }
        if let Some((r, why)) = health.failed(me) {
            return Some((r, PeerCause::Failed(why)));
        }
        // The one other member finished cleanly: this rank's work with it
        // can never complete, and no failure elsewhere would change that
        // (a rank that failed has posted its failure, named above, even if
        // its code went on to finish), so it is named at once.
        if let [other] = others[..]
            && health.finished_among(&others) == Some(other)
        {
            return Some((other, PeerCause::Finished));
        }
        if Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    health
        .finished_among(&others)
        .map(|r| (r, PeerCause::Finished))
}

/// Whether an op of `me` can never be matched by `peer`, which finished
/// cleanly having issued what `theirs` counts (the counts it posted as it
/// finished, [`Health::post_counts`]; in one process, the registry's
/// counts of every rank): the op is `dir` toward `peer` on communicator
/// `comm` (its number in the registry), message `fifo` (from 0) of its
/// channel. A finished rank issues nothing more, and a channel matches in
/// order, so a recv past the sends `peer` issued on the channel, or a send
/// past its recvs, is never matched: the number of those `peer` issued,
/// when so.
pub fn unmatched_by(
    me: Rank,
    peer: Rank,
    dir: duplex::Dir,
    comm: u32,
    fifo: u64,
    theirs: &[ChannelCount],
) -> Option<u64> {
    if peer == me {
        return None;
    }
    let (from, to) = match dir {
        duplex::Dir::Send => (me, peer),
        duplex::Dir::Recv => (peer, me),
    };
    let issued = theirs
        .iter()
        .find(|c| (c.comm, c.from, c.to) == (comm, from, to))
        .map_or(0, |c| match dir {
            duplex::Dir::Send => c.received,
            duplex::Dir::Recv => c.sent,
        });
    (fifo >= issued).then_some(issued)
}

/// The health of a local run: one list for all its ranks.
#[derive(Debug, Default)]
pub struct LocalHealth {
    failures: Mutex<Vec<(Rank, String)>>,
    finished: Mutex<Vec<Rank>>,
}

impl Health for LocalHealth {
    fn fail(&self, rank: Rank, why: &str) {
        let mut f = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        if !f.iter().any(|(r, _)| *r == rank) {
            f.push((rank, why.to_string()));
        }
    }

    fn failed(&self, me: Rank) -> Option<(Rank, String)> {
        let f = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        f.iter().find(|(r, _)| *r != me).cloned()
    }

    fn remote(&self) -> bool {
        false
    }

    fn publish(&self, _: Rank, _: &Trace) {}

    fn publish_early(&self, _: Rank, _: &Trace) {}

    fn gather(&self, _: u32, _: Rank, _: Duration) -> Gathered {
        Gathered::default()
    }

    fn finished(&self, rank: Rank) {
        self.finished
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(rank);
    }

    fn finished_among(&self, ranks: &[Rank]) -> Option<Rank> {
        let finished = self.finished.lock().unwrap_or_else(|e| e.into_inner());
        ranks.iter().copied().find(|r| finished.contains(r))
    }

    fn failed_itself(&self, me: Rank) -> bool {
        // Only a failure of its own that came before any other rank's.
        let f = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        f.first().is_some_and(|(r, _)| *r == me)
    }

    fn linger(&self, ranks: u32, me: Rank, wait: Duration, after_failure: Duration) {
        let mut deadline = deadline_after(wait);
        let mut failure_seen = false;
        while Instant::now() < deadline {
            if !failure_seen && self.failed(me).is_some() {
                failure_seen = true;
                deadline = deadline.min(deadline_after(after_failure));
                continue;
            }
            let done = {
                let finished = self.finished.lock().unwrap_or_else(|e| e.into_inner());
                let failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
                (0..ranks)
                    .filter(|r| *r != me)
                    .all(|r| finished.contains(&r) || failures.iter().any(|(f, _)| *f == r))
            };
            if done {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// The health of a process-per-rank run, through the store, with a monitor
/// thread (see the module docs).
#[derive(Debug)]
pub struct StoreHealth {
    store: Store,
    me: Rank,
    known: Mutex<Option<(Rank, String)>>,
    stop: AtomicBool,
    /// Whether this rank posted a failure of its own.
    failed_itself: AtomicBool,
    /// Whether someone asked which ranks finished: the monitor then looks
    /// each heartbeat ([`Health::finished_among`]).
    watch_finished: AtomicBool,
    /// The ranks the monitor saw finished cleanly, each with the counts
    /// it posted as it finished once the monitor has read them
    /// ([`Health::finished_counts`]).
    finished: Mutex<BTreeMap<Rank, Option<Arc<Vec<ChannelCount>>>>>,
    /// The ranks the monitor saw end without finishing (failed, silent):
    /// not asked about again.
    unfinished: Mutex<Vec<Rank>>,
    /// The ranks whose finish someone asked about: the only ones the
    /// monitor looks up.
    asked: Mutex<std::collections::BTreeSet<Rank>>,
    /// The heartbeat's thread could not start: the monitor beats.
    beats_in_monitor: AtomicBool,
    /// The longest gap between two heartbeats this process sent, in ms,
    /// when one passed [`SILENCE`] (0: none): it was frozen or starved.
    stalled_ms: std::sync::atomic::AtomicU64,
    /// How many times the monitor looked for finished ranks.
    looks: std::sync::atomic::AtomicU32,
    /// The ranks whose counts a wait asked for, each with when to read
    /// them next and the interval after that ([`COUNTS_RETRY_MAX`]).
    wanted: Mutex<BTreeMap<Rank, (Instant, Duration)>>,
}

/// At most this many ranks asked about and not yet known to have ended
/// are looked up one by one ([`StoreHealth::look_for_finished`]); more
/// through one `ENDED` every [`ENDED_EVERY`] beats.
const FEW_ASKED: usize = 8;

/// How many beats apart the monitor asks `ENDED` when it watches many
/// ranks.
const ENDED_EVERY: u32 = 5;

/// `ranks` from the `n`-th on, then the first ones: each look of the
/// watch for finished ranks starts at another, so that one its budget cut
/// off comes first in a later look.
fn in_turn(mut ranks: Vec<Rank>, n: u32) -> Vec<Rank> {
    if !ranks.is_empty() {
        let at = n as usize % ranks.len();
        ranks.rotate_left(at);
    }
    ranks
}

/// How long the monitor may spend a beat on looking for finished ranks
/// before its next check ([`StoreHealth::look_for_finished`]).
const LOOK_BUDGET: Duration = Duration::from_millis(100);

/// The longest interval between two reads of the counts of a finished rank
/// that are missing from the store.
const COUNTS_RETRY_MAX: Duration = Duration::from_secs(5);

/// How often a lingering rank says which ranks it still waits for.
const LINGER_SAY: Duration = Duration::from_secs(60);

/// How long one store request of the monitor may take.
const REQUEST: Duration = Duration::from_secs(1);

impl StoreHealth {
    /// Starts the monitor of rank `me` on `store`; it stops when the
    /// returned handle is dropped.
    pub fn start(store: Store, me: Rank) -> Arc<StoreHealth> {
        // One heartbeat before anything else: a rank that goes on to join
        // the job has been seen alive, so that its death is noticed by its
        // silence (the store counts as silent only a rank it has heard).
        if let Err(e) = store.beat(me, REQUEST) {
            tracing::debug!(rank = me, error = %e, "the first heartbeat did not reach the store");
        }
        let health = Arc::new(StoreHealth {
            store,
            me,
            known: Mutex::new(None),
            stop: AtomicBool::new(false),
            failed_itself: AtomicBool::new(false),
            watch_finished: AtomicBool::new(false),
            finished: Mutex::new(BTreeMap::new()),
            unfinished: Mutex::new(Vec::new()),
            asked: Mutex::new(Default::default()),
            stalled_ms: Default::default(),
            beats_in_monitor: AtomicBool::new(false),
            looks: Default::default(),
            wanted: Mutex::new(BTreeMap::new()),
        });
        // The heartbeat has a thread of its own: the checks (a `HEALTH`,
        // the watch for finished ranks) each wait up to [`REQUEST`] on a
        // slow store, and a cycle of them took ~3.2 s, past [`SILENCE`]
        // (found by review): behind them, a live rank's beats fell late
        // enough for the others to take it for dead.
        let mut last = Instant::now();
        if let Err(e) = every_beat(&health, format!("duplex beat {me}"), move |h| {
            h.beat(&mut last)
        }) {
            // Without its thread, the monitor beats before each check (a
            // slow store can then make it late, but never silent).
            tracing::warn!(rank = me, error = %e, "cannot start the heartbeat's thread: the health monitor beats instead");
            health.beats_in_monitor.store(true, Ordering::Release);
        }
        let mut unreachable_since: Option<Instant> = None;
        let _ = every_beat(&health, format!("duplex health {me}"), move |h| {
            h.check(&mut unreachable_since)
        });
        health
    }

    /// One heartbeat, `last` the time of the one before: a gap past the
    /// silence between two beats means this process was frozen (SIGSTOP)
    /// or starved, and the job may have taken it for dead meanwhile.
    fn beat(&self, last: &mut Instant) {
        let gap = last.elapsed();
        *last = Instant::now();
        if gap > SILENCE {
            let ms = u64::try_from(gap.as_millis()).unwrap_or(u64::MAX);
            self.stalled_ms.fetch_max(ms, Ordering::AcqRel);
        }
        if let Err(e) = self.store.beat(self.me, REQUEST) {
            tracing::debug!(rank = self.me, error = %e, "a heartbeat did not reach the store");
        }
    }

    /// One check of the monitor: learns another rank's failure, looks for
    /// finished ranks when asked to, and takes rank 0 for dead once its
    /// store has answered nothing for [`SILENCE`] (`unreachable_since`:
    /// when the first request that failed since the last answer was made).
    fn check(&self, unreachable_since: &mut Option<Instant>) {
        match self.poll_once() {
            Ok(found) => {
                *unreachable_since = None;
                if let Some(f) = found {
                    self.learn(f);
                }
                if self.watch_finished.load(Ordering::Acquire) {
                    self.look_for_finished(Instant::now() + LOOK_BUDGET);
                }
            }
            Err((asked, e)) if self.me != 0 => {
                // Unreachable since the first request that failed was
                // made, not since it gave up; a store that answers at all
                // (busy: its connections at their limit, for a moment or
                // for long) is alive, and so is its host (found by review:
                // three seconds of `ERROR busy` took rank 0 for dead).
                let first = *unreachable_since.get_or_insert(asked);
                let since = self.store.last_heard().map_or(first, |t| first.max(t));
                if since.elapsed() < SILENCE {
                    return;
                }
                // A process that was itself frozen finds the store gone
                // because the job took it for dead and ended: said, so that
                // its operator looks at the right process.
                let stalled = self.stalled_ms.load(Ordering::Acquire);
                let own = if stalled == 0 {
                    String::new()
                } else {
                    format!(
                        " (this process itself sent no heartbeat for {stalled} ms before: it was frozen or starved, so the job may have taken rank {} for dead and ended)",
                        self.me
                    )
                };
                self.learn((
                    0,
                    format!(
                        "the duplex store on rank 0 has been unreachable for {} ms, so rank 0 (its host) is taken as dead{own}: {e}",
                        since.elapsed().as_millis()
                    ),
                ));
            }
            Err(_) => {}
        }
    }

    /// Rank `r`'s published trace: its own ([`Health::publish`]), waited
    /// for until `deadline`, but only [`EARLY_GRACE`] more once its early
    /// snapshot is there (a rank that is computing publishes nothing
    /// else); else that snapshot.
    fn trace_of(
        &self,
        r: Rank,
        deadline: Instant,
    ) -> Result<Option<(Vec<u8>, bool)>, duplex::Error> {
        let mut early_since: Option<Instant> = None;
        loop {
            let now = Instant::now();
            let mut until = deadline;
            if let Some(t) = early_since {
                until = until.min(t + EARLY_GRACE);
            }
            let left = until.saturating_duration_since(now);
            // At the end, one more look (no wait) for its own.
            if let Some(own) = self.store.get(&trace_key(r), left.min(EARLY_LOOK))? {
                tracing::debug!(rank = r, bytes = own.len(), "gathered its trace");
                return Ok(Some((own, false)));
            }
            if left.is_zero() {
                let early = self.store.get(&early_trace_key(r), Duration::ZERO)?;
                tracing::debug!(
                    rank = r,
                    early = early.is_some(),
                    "its own trace did not come: its early snapshot instead"
                );
                return Ok(early.map(|e| (e, true)));
            }
            if early_since.is_none()
                && self
                    .store
                    .get(&early_trace_key(r), Duration::ZERO)?
                    .is_some()
            {
                early_since = Some(Instant::now());
            }
        }
    }

    /// The counts rank `r` posted as it finished, if it has
    /// ([`Health::post_counts`]); the request fails past `timeout`.
    fn counts_now(&self, r: Rank, timeout: Duration) -> Result<Option<Vec<ChannelCount>>, String> {
        match self.store.peek(&counts_key(r), timeout) {
            Ok(Some(bytes)) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| format!("rank {r}'s counts do not decode: {e}")),
            Ok(None) => Ok(None),
            Err(e) => Err(format!("cannot read rank {r}'s counts: {e}")),
        }
    }

    /// Puts `trace`, rank `rank`'s, under `key`.
    fn put_trace(&self, key: &str, rank: Rank, trace: &Trace) {
        // What an analysis of another rank will replay for this one: the
        // log says which publish it was (a later one replaces an earlier).
        tracing::debug!(
            rank,
            key,
            calls = trace.calls.len(),
            ended = trace.calls.iter().filter(|c| matches!(c.call, duplex::trace::Call::End)).count(),
            blocked = ?trace.blocked.iter().map(|c| c.text.to_string()).collect::<Vec<_>>(),
            "publishing this rank's trace"
        );
        self.put_json(key, rank, "trace", trace, REQUEST * 5);
    }

    /// Stores `value` as JSON under `key` for `rank`; a failure is logged
    /// (the others then miss `what`, and say so when they look).
    fn put_json<T: serde::Serialize + ?Sized>(
        &self,
        key: &str,
        rank: Rank,
        what: &str,
        value: &T,
        timeout: Duration,
    ) {
        if let Err(e) = self.store_json(key, what, value, timeout) {
            tracing::warn!(rank, error = %e, "could not store this rank's {what}");
        }
    }

    /// Stores `value` (a rank's `what`) as JSON under `key`.
    fn store_json<T: serde::Serialize + ?Sized>(
        &self,
        key: &str,
        what: &str,
        value: &T,
        timeout: Duration,
    ) -> Result<(), duplex::Error> {
        let bytes = serde_json::to_vec(value)
            .map_err(|e| duplex::Error::Aborted(format!("encoding the {what}: {e}")))?;
        self.store.put(key, &bytes, timeout)
    }

    /// One check (`HEALTH`); a failure comes with when the request was
    /// made.
    fn poll_once(&self) -> Result<Option<(Rank, String)>, (Instant, duplex::Error)> {
        if self.beats_in_monitor.load(Ordering::Acquire) {
            let asked = Instant::now();
            self.store.beat(self.me, REQUEST).map_err(|e| (asked, e))?;
        }
        let asked = Instant::now();
        self.store
            .health(self.me, SILENCE, REQUEST)
            .map_err(|e| (asked, e))
    }

    /// Learns which of the ranks asked about ([`Health::finished_among`])
    /// finished cleanly (they stored `done/RANK`): a few such ranks not
    /// yet known to have ended are looked up one by one, every beat; many,
    /// through one `ENDED` every [`ENDED_EVERY`] beats, then one lookup
    /// per rank newly ended (a rank that ended without finishing is not
    /// asked about again). Then reads the counts of each finished rank
    /// whose counts a wait asked for ([`Health::finished_counts`]), one
    /// request per rank until they are read (a rank posts them before it
    /// says it finished, so normally at once; a rank whose counts are
    /// missing is asked again at growing intervals, up to
    /// [`COUNTS_RETRY_MAX`]), so that a wait reads them from memory and
    /// never waits on the store. Stops making requests at `until` and goes
    /// on at the next check, so that the checks (`HEALTH`, which learns
    /// of failures) come every beat or so (the heartbeat has a thread of
    /// its own, and never waits behind them).
    fn look_for_finished(&self, until: Instant) {
        let lock_finished = || self.finished.lock().unwrap_or_else(|e| e.into_inner());
        let lock_unfinished = || self.unfinished.lock().unwrap_or_else(|e| e.into_inner());
        let unknown: Vec<Rank> = {
            let asked = self.asked.lock().unwrap_or_else(|e| e.into_inner());
            let (finished, unfinished) = (lock_finished(), lock_unfinished());
            asked
                .iter()
                .copied()
                .filter(|r| *r != self.me && !finished.contains_key(r) && !unfinished.contains(r))
                .collect()
        };
        // A few ranks asked about (a wait's peers): one small request for
        // each, every beat. Many (an analysis asks about every member):
        // one `ENDED`, whose answer lists every rank that ended, every
        // [`ENDED_EVERY`] beats (each costs the store a walk over those
        // ranks: at 1,024 ranks, 1,024 monitors asking it every beat took
        // 4x the store's CPU, `examples/store.rs --watching`).
        let n = self.looks.fetch_add(1, Ordering::Relaxed);
        let few = unknown.len() <= FEW_ASKED;
        let candidates = if few {
            in_turn(unknown, n)
        } else if !n.is_multiple_of(ENDED_EVERY) {
            Vec::new()
        } else {
            let Ok(ended) = self.store.ended(SILENCE, REQUEST) else {
                return;
            };
            // Each ended rank is looked up once (it is then known either
            // way): a look cut off by its budget goes on at the next.
            ended.into_iter().filter(|r| unknown.contains(r)).collect()
        };
        for r in candidates {
            if Instant::now() >= until {
                return;
            }
            match self.store.peek(&done_key(r), REQUEST) {
                Ok(Some(_)) => {
                    lock_finished().insert(r, None);
                }
                // Still running, or (from `ENDED`) ended without finishing.
                Ok(None) if few => {}
                Ok(None) => lock_unfinished().push(r),
                Err(_) => return,
            }
        }
        let now = Instant::now();
        let due: Vec<Rank> = {
            let finished = lock_finished();
            let wanted = self.wanted.lock().unwrap_or_else(|e| e.into_inner());
            wanted
                .iter()
                .filter(|(r, (next, _))| *next <= now && matches!(finished.get(r), Some(None)))
                .map(|(r, _)| *r)
                .collect()
        };
        for r in due {
            if Instant::now() >= until {
                return;
            }
            let read = self.counts_now(r, REQUEST);
            if let Ok(Some(c)) = read {
                lock_finished().insert(r, Some(Arc::new(c)));
                continue;
            }
            if let Err(why) = read {
                tracing::debug!(
                    rank = self.me,
                    peer = r,
                    "cannot read the counts of a rank that finished: {why}"
                );
            }
            // Not there (the store refused them), or not readable: asked
            // again later, less and less often.
            let mut wanted = self.wanted.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((next, wait)) = wanted.get_mut(&r) {
                *wait = (*wait * 2).min(COUNTS_RETRY_MAX);
                *next = Instant::now() + *wait;
            }
        }
    }

    fn learn(&self, failure: (Rank, String)) {
        let mut k = self.known.lock().unwrap_or_else(|e| e.into_inner());
        if k.is_none() {
            tracing::debug!(rank = self.me, failed = failure.0, why = %failure.1, "a rank of the job failed");
            *k = Some(failure);
        }
    }
}

impl Drop for StoreHealth {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// Runs `step` on a thread named `name` every [`BEAT_EVERY`], until
/// `health` is dropped or stopped.
fn every_beat(
    health: &Arc<StoreHealth>,
    name: String,
    mut step: impl FnMut(&StoreHealth) + Send + 'static,
) -> std::io::Result<()> {
    let weak = Arc::downgrade(health);
    std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            loop {
                let Some(h) = weak.upgrade() else { return };
                if h.stop.load(Ordering::Acquire) {
                    return;
                }
                step(&h);
                drop(h);
                std::thread::sleep(BEAT_EVERY);
            }
        })
        .map(drop)
}

/// The key a rank stores as it finishes cleanly ([`Health::finished`]).
fn done_key(rank: Rank) -> String {
    format!("done/{rank}")
}

/// The key a rank's channel counts are posted under as it finishes
/// ([`Health::post_counts`]).
fn counts_key(rank: Rank) -> String {
    format!("counts/{rank}")
}

/// Rank `from`'s counts toward `to`, left for `to` to judge
/// ([`Health::post_owed`]).
fn owed_key(to: Rank, from: Rank) -> String {
    format!("{}{from}", owed_prefix(to))
}

/// The prefix of the keys of the sends left for `to` to judge.
fn owed_prefix(to: Rank) -> String {
    format!("owed/{to}/")
}

/// The key a rank stores once its end check is over ([`Health::left`]).
fn left_key(rank: Rank) -> String {
    format!("left/{rank}")
}

/// The key a rank's trace is published under.
fn trace_key(rank: Rank) -> String {
    format!("trace/{rank}")
}

/// How long a gather still waits for a rank's own trace once its early
/// snapshot is there ([`Health::publish_early`]): a rank whose thread was
/// waiting publishes its own within a tick of learning of the failure.
const EARLY_GRACE: Duration = Duration::from_millis(500);

/// How often a gather looks for an early snapshot while it waits.
const EARLY_LOOK: Duration = Duration::from_millis(100);

/// Where a rank's early snapshot goes ([`Health::publish_early`]).
fn early_trace_key(rank: Rank) -> String {
    format!("trace/{rank}/early")
}

impl Health for StoreHealth {
    fn fail(&self, rank: Rank, why: &str) {
        // Its own failure first, before it knew of any other rank's.
        if rank == self.me
            && self
                .known
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_none()
        {
            self.failed_itself.store(true, Ordering::Release);
        }
        if let Err(e) = self.store.fail(rank, why, REQUEST) {
            tracing::warn!(rank, error = %e, "could not post this rank's failure to the store");
        }
    }

    fn failed(&self, me: Rank) -> Option<(Rank, String)> {
        let k = self.known.lock().unwrap_or_else(|e| e.into_inner());
        // The store names `me` only when the job took this rank for dead
        // (`Shared::check`); its own posted failures it never returns.
        k.clone().filter(|(r, _)| {
            *r != me || (me == self.me && !self.failed_itself.load(Ordering::Acquire))
        })
    }

    fn remote(&self) -> bool {
        true
    }

    fn publish(&self, rank: Rank, trace: &Trace) {
        self.put_trace(&trace_key(rank), rank, trace);
    }

    fn publish_early(&self, rank: Rank, trace: &Trace) {
        self.put_trace(&early_trace_key(rank), rank, trace);
    }

    fn finished(&self, rank: Rank) {
        if let Err(e) = self.store.put(&done_key(rank), b"ok", REQUEST) {
            // The others will take this rank for failed once it falls
            // silent: said where its operator looks.
            tracing::warn!(
                rank,
                error = %e,
                "could not tell the store this rank finished: the other ranks will take it for failed"
            );
        }
    }

    fn finished_among(&self, ranks: &[Rank]) -> Option<Rank> {
        self.watch_finished.store(true, Ordering::Release);
        self.asked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(ranks.iter().copied());
        let finished = self.finished.lock().unwrap_or_else(|e| e.into_inner());
        ranks.iter().copied().find(|r| finished.contains_key(r))
    }

    fn finished_counts(&self, rank: Rank) -> Option<Arc<Vec<ChannelCount>>> {
        self.watch_finished.store(true, Ordering::Release);
        self.asked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(rank);
        let counts = self
            .finished
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&rank)
            .cloned()
            .flatten();
        if counts.is_none() {
            self.wanted
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(rank)
                .or_insert((Instant::now(), BEAT_EVERY));
        }
        counts
    }

    fn failed_itself(&self, me: Rank) -> bool {
        me == self.me && self.failed_itself.load(Ordering::Acquire)
    }

    fn linger(&self, ranks: u32, me: Rank, wait: Duration, after_failure: Duration) {
        let start = Instant::now();
        let mut deadline = deadline_after(wait);
        let mut left: Vec<Rank> = (0..ranks).filter(|r| *r != me).collect();
        let mut failing_since: Option<Instant> = None;
        let mut failure_seen = false;
        let mut said = start;
        while !left.is_empty() && Instant::now() < deadline {
            let failed = self.failed(me).map(|(r, _)| r);
            if failed.is_some() && !failure_seen {
                failure_seen = true;
                deadline = deadline.min(deadline_after(after_failure));
                if after_failure.is_zero() {
                    return;
                }
            }
            // One request for every rank that finished, failed or fell
            // silent (all of them, where `failed` knows the first), not
            // one per rank.
            match self.store.ended(SILENCE, REQUEST) {
                Ok(done) => {
                    failing_since = None;
                    left.retain(|r| !done.contains(r) && failed != Some(*r));
                }
                Err(e) => {
                    tracing::debug!(error = %e, "cannot ask the store which ranks ended");
                    // A store that stays unreadable (the host's own, gone)
                    // ends the wait, however long it was to be.
                    let since = *failing_since.get_or_insert_with(Instant::now);
                    if after_failure.is_zero() || since.elapsed() >= SILENCE {
                        return;
                    }
                }
            }
            if left.is_empty() {
                break;
            }
            if said.elapsed() >= LINGER_SAY {
                said = Instant::now();
                tracing::info!(
                    rank = me,
                    waited_s = start.elapsed().as_secs(),
                    "waiting for rank(s) {} to end (finish, fail or fall silent)",
                    left.iter()
                        .map(|r| r.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn post_counts(&self, rank: Rank, counts: &[ChannelCount]) {
        self.put_json(&counts_key(rank), rank, "counts", counts, REQUEST);
    }

    fn counts_of(&self, me: Rank, peers: &[Rank], wait: Duration) -> Result<Option<Heard>, String> {
        let deadline = deadline_after(wait);
        let mut out = BTreeMap::new();
        let mut left: Vec<Rank> = peers.iter().copied().filter(|r| *r != me).collect();
        loop {
            if self.failed(me).is_some() {
                return Ok(None);
            }
            let mut still = Vec::new();
            for r in left {
                match self.counts_now(r, REQUEST * 5)? {
                    Some(c) => {
                        out.insert(r, c);
                    }
                    None => still.push(r),
                }
            }
            left = still;
            if left.is_empty() || Instant::now() >= deadline {
                return Ok(Some(Heard {
                    counts: out,
                    missing: left,
                }));
            }
            // A peer that ended without its counts (failed, or fell silent)
            // never posts them; one that finished meanwhile posted them
            // before it said so, and the next look finds them.
            if let Ok(ended) = self.store.ended(SILENCE, REQUEST) {
                for r in left.iter().filter(|r| ended.contains(r)) {
                    if self.counts_now(*r, REQUEST * 5)?.is_some() {
                        continue;
                    }
                    // It finished cleanly, yet its counts are not there
                    // (the store refused them): no judgement, and a
                    // warning. Otherwise it failed: the job is failing.
                    return match self.store.get(&done_key(*r), Duration::ZERO) {
                        Ok(Some(_)) => Err(format!(
                            "rank {r} finished, but its counts are not in the store"
                        )),
                        _ => Ok(None),
                    };
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn post_owed(&self, rank: Rank, to: Rank, counts: &[ChannelCount]) -> Result<(), String> {
        self.store_json(&owed_key(to, rank), "counts", counts, REQUEST)
            .map_err(|e| e.to_string())
    }

    fn owed_to(&self, me: Rank) -> Result<BTreeMap<Rank, Owed>, String> {
        let prefix = owed_prefix(me);
        let keys = self
            .store
            .keys(&prefix, REQUEST)
            .map_err(|e| format!("cannot list the sends left for this rank: {e}"))?;
        let mut out = BTreeMap::new();
        for key in keys {
            let Some(from) = key
                .strip_prefix(&prefix)
                .and_then(|r| r.parse::<Rank>().ok())
            else {
                return Err(format!("the store holds `{key}`, which names no rank"));
            };
            let bytes = self
                .store
                .get(&key, Duration::ZERO)
                .map_err(|e| format!("cannot read `{key}`: {e}"))?
                .ok_or_else(|| format!("`{key}` was listed but is gone"))?;
            let counts: Vec<ChannelCount> = serde_json::from_slice(&bytes)
                .map_err(|e| format!("rank {from}'s counts do not decode: {e}"))?;
            // Its trace names its calls; without it they are named from
            // the counts.
            let trace = match self.store.get(&trace_key(from), Duration::ZERO) {
                Ok(Some(t)) => serde_json::from_slice::<Trace>(&t).ok(),
                _ => None,
            };
            out.insert(from, Owed { counts, trace });
        }
        Ok(out)
    }

    fn left(&self, rank: Rank) {
        if let Err(e) = self.store.put(&left_key(rank), b"ok", REQUEST) {
            tracing::debug!(rank, error = %e, "could not tell the store this rank left");
        }
    }

    fn wait_left(&self, ranks: u32, me: Rank, wait: Duration) {
        let deadline = Instant::now() + wait;
        for r in (0..ranks).filter(|r| *r != me) {
            // Only a rank that finished cleanly does an end check.
            if !matches!(self.store.get(&done_key(r), Duration::ZERO), Ok(Some(_))) {
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if !matches!(self.store.get(&left_key(r), left), Ok(Some(_))) {
                tracing::debug!(rank = r, "did not say it left the store in time");
            }
        }
    }

    fn gather(&self, ranks: u32, me: Rank, wait: Duration) -> Gathered {
        let deadline = Instant::now() + wait;
        let mut out = Gathered::default();
        for r in (0..ranks).filter(|r| *r != me) {
            match self.trace_of(r, deadline) {
                Ok(Some((bytes, early))) => match serde_json::from_slice::<Trace>(&bytes) {
                    Ok(t) => {
                        out.traces.push(t);
                        if early {
                            out.early.push(r);
                        }
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(rank = r, error = %e, "a published trace does not decode")
                    }
                },
                Ok(None) => tracing::debug!(rank = r, "no trace published in time"),
                Err(e) => tracing::debug!(rank = r, error = %e, "cannot read a published trace"),
            }
            out.missing.push(r);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Secret;

    #[test]
    fn a_local_failure_is_seen_by_the_others_not_by_itself() {
        let h = LocalHealth::default();
        assert_eq!(h.failed(0), None);
        h.fail(1, "panicked");
        h.fail(1, "later");
        assert_eq!(h.failed(0), Some((1, "panicked".into())));
        assert_eq!(h.failed(1), None);
    }

    #[test]
    fn a_local_rank_lingers_until_every_other_finished_or_failed() {
        let h = std::sync::Arc::new(LocalHealth::default());
        let t0 = Instant::now();
        h.linger(3, 0, Duration::from_millis(50), Duration::from_millis(50));
        assert!(
            t0.elapsed() >= Duration::from_millis(50),
            "nobody finished yet"
        );
        let h2 = h.clone();
        let others = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            h2.finished(1);
            std::thread::sleep(Duration::from_millis(50));
            h2.fail(2, "hang");
        });
        let t0 = Instant::now();
        h.linger(3, 0, Duration::from_secs(30), Duration::from_secs(30));
        let waited = t0.elapsed();
        assert!(
            waited >= Duration::from_millis(90) && waited < Duration::from_secs(10),
            "{waited:?}"
        );
        others.join().unwrap();
        // Waiting for the lanes' sake ends at the first failure known.
        let h = LocalHealth::default();
        h.fail(2, "hang");
        let t0 = Instant::now();
        h.linger(3, 0, Duration::from_secs(30), Duration::ZERO);
        assert!(t0.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn an_op_past_what_a_finished_peer_issued_on_its_channel_is_never_matched() {
        use duplex::Dir::{Recv, Send};
        let count = |comm, from, to, sent, received| ChannelCount {
            comm,
            from,
            to,
            sent,
            received,
        };
        // Rank 1 finished after 2 sends to rank 0 and 1 recv from it on
        // communicator 3, nothing on communicator 4.
        let theirs = [count(3, 1, 0, 2, 0), count(3, 0, 1, 0, 1)];
        // Rank 0's recvs 0 and 1 from rank 1 are matched, its third not.
        assert_eq!(unmatched_by(0, 1, Recv, 3, 0, &theirs), None);
        assert_eq!(unmatched_by(0, 1, Recv, 3, 1, &theirs), None);
        assert_eq!(unmatched_by(0, 1, Recv, 3, 2, &theirs), Some(2));
        // Its first send is received, its second not.
        assert_eq!(unmatched_by(0, 1, Send, 3, 0, &theirs), None);
        assert_eq!(unmatched_by(0, 1, Send, 3, 1, &theirs), Some(1));
        // A channel the peer never used matches nothing.
        assert_eq!(unmatched_by(0, 1, Recv, 4, 0, &theirs), Some(0));
        assert_eq!(unmatched_by(0, 1, Send, 4, 0, &theirs), Some(0));
        // A third rank's counts on the channel are not the peer's.
        assert_eq!(
            unmatched_by(0, 2, Recv, 3, 0, &theirs),
            Some(0),
            "rank 2 sent nothing"
        );
        // In one process the counts hold both sides of each channel: the
        // peer's side is read, never this rank's.
        let both = [count(3, 1, 0, 1, 5), count(3, 0, 1, 5, 1)];
        assert_eq!(unmatched_by(0, 1, Recv, 3, 0, &both), None);
        assert_eq!(unmatched_by(0, 1, Recv, 3, 1, &both), Some(1));
        assert_eq!(unmatched_by(0, 1, Send, 3, 1, &both), Some(1));
        // An op to itself is never judged this way.
        assert_eq!(unmatched_by(0, 0, Recv, 3, 9, &both), None);
    }

    #[test]
    fn the_culprit_is_a_failed_rank_or_a_finished_member_waited_for() {
        let h = LocalHealth::default();
        let quick = Duration::from_millis(50);
        // Nobody: none, after the patience.
        let t0 = Instant::now();
        assert_eq!(culprit(&h, 0, &[0, 1], quick), None);
        assert!(t0.elapsed() >= quick);
        // Alone in the communicator: none at once.
        assert_eq!(culprit(&h, 0, &[0], Duration::from_secs(30)), None);
        // The one other member finished: named at once.
        h.finished(1);
        let t0 = Instant::now();
        assert_eq!(
            culprit(&h, 0, &[0, 1], Duration::from_secs(30)),
            Some((1, PeerCause::Finished))
        );
        assert!(t0.elapsed() < Duration::from_secs(5), "waited the patience");
        // One of several members finished: named after the wait for a
        // failure elsewhere.
        let t0 = Instant::now();
        assert_eq!(
            culprit(&h, 0, &[0, 1, 2], quick),
            Some((1, PeerCause::Finished))
        );
        assert!(t0.elapsed() >= quick);
        // Not a member: no.
        assert_eq!(culprit(&h, 0, &[0, 2], quick), None);
        // A failure, noticed while waiting, wins, whoever failed.
        let h = std::sync::Arc::new(LocalHealth::default());
        let later = h.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            later.fail(2, "killed");
        });
        let t0 = Instant::now();
        assert_eq!(
            culprit(&*h, 0, &[0, 1], Duration::from_secs(30)),
            Some((2, PeerCause::Failed("killed".into())))
        );
        assert!(t0.elapsed() < Duration::from_secs(5));
        t.join().unwrap();
        // Failing after another rank did is an echo: the cause stays named.
        h.fail(0, "its echo");
        assert_eq!(
            culprit(&*h, 0, &[0, 1], quick),
            Some((2, PeerCause::Failed("killed".into())))
        );
        // A rank that failed itself first: its errors are its own, even
        // when another rank fails after it (its echo, say).
        let h = LocalHealth::default();
        h.fail(0, "hang");
        h.fail(1, "its echo");
        assert_eq!(culprit(&h, 0, &[0, 1], quick), None);
    }

    fn store() -> (u16, Secret) {
        let secret = Secret::new("0123456789abcdef-health");
        let addr = Store::serve("127.0.0.1", 0, vec![7; 8], secret.clone()).expect("serves");
        (addr.port(), secret)
    }

    #[test]
    fn a_failure_posted_by_one_process_reaches_the_others_monitor() {
        let (port, secret) = store();
        let a = StoreHealth::start(Store::client("127.0.0.1", port, secret.clone()), 0);
        let b = StoreHealth::start(Store::client("127.0.0.1", port, secret), 1);
        b.fail(1, "rank 1 panicked: boom");
        let start = Instant::now();
        while a.failed(0).is_none() && start.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(a.failed(0), Some((1, "rank 1 panicked: boom".into())));
        // Its own failure is not news to the rank that posted it.
        assert_eq!(b.failed(1), None);
        // Within a few heartbeats (a generous bound: this checks that the
        // failure travels, not how fast).
        assert!(start.elapsed() < SILENCE, "{:?}", start.elapsed());
    }

    #[test]
    fn a_silent_rank_is_taken_as_dead() {
        let (port, secret) = store();
        let a = StoreHealth::start(Store::client("127.0.0.1", port, secret.clone()), 0);
        // Rank 1 beats once, then goes silent (killed or frozen).
        Store::client("127.0.0.1", port, secret)
            .beat(1, REQUEST)
            .expect("beats");
        let start = Instant::now();
        while a.failed(0).is_none() && start.elapsed() < SILENCE * 3 {
            std::thread::sleep(Duration::from_millis(50));
        }
        let (rank, why) = a.failed(0).expect("rank 1 is reported");
        assert_eq!(rank, 1);
        assert!(why.contains("no heartbeat"), "{why}");
        assert!(start.elapsed() >= SILENCE, "{:?}", start.elapsed());
        assert!(start.elapsed() < SILENCE * 3, "{:?}", start.elapsed());
    }

    /// A monitor whose checks are held up (a slow store: each request may
    /// take [`REQUEST`], and a cycle of them took longer than [`SILENCE`])
    /// still beats: its rank is not taken for dead.
    #[test]
    fn a_rank_whose_checks_are_held_up_still_beats() {
        let (port, secret) = store();
        let a = StoreHealth::start(Store::client("127.0.0.1", port, secret.clone()), 0);
        let b = StoreHealth::start(Store::client("127.0.0.1", port, secret), 1);
        // Rank 1's monitor will look for finished ranks, and finds the
        // lock it needs held past the silence.
        let held = b.asked.lock().expect("not poisoned");
        b.watch_finished.store(true, Ordering::Release);
        std::thread::sleep(SILENCE + BEAT_EVERY * 5);
        drop(held);
        assert_eq!(a.failed(0), None, "rank 1 beat all along");
    }

    /// A frozen rank (SIGSTOP past [`SILENCE`]) that runs again is told
    /// that the job took it for dead, within a few beats, so that its
    /// waits end instead of going on with partners that have aborted.
    #[test]
    fn a_frozen_rank_that_runs_again_is_told_the_job_took_it_for_dead() {
        let (port, secret) = store();
        let a = StoreHealth::start(Store::client("127.0.0.1", port, secret.clone()), 0);
        let client = Store::client("127.0.0.1", port, secret);
        client.beat(1, REQUEST).expect("beats");
        let start = Instant::now();
        while a.failed(0).is_none() && start.elapsed() < SILENCE * 3 {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(a.failed(0).map(|(r, _)| r), Some(1));
        // Rank 1 runs again: its monitor beats and asks.
        let b = StoreHealth::start(client, 1);
        let resumed = Instant::now();
        while b.failed(1).is_none() && resumed.elapsed() < SILENCE {
            std::thread::sleep(Duration::from_millis(20));
        }
        let (rank, why) = b.failed(1).expect("rank 1 learns the job took it for dead");
        assert_eq!(rank, 1);
        assert!(why.contains("took rank 1 for dead"), "{why}");
        assert!(why.contains("no heartbeat"), "{why}");
        // Rank 0 still names rank 1, not an echo.
        assert_eq!(a.failed(0).map(|(r, _)| r), Some(1));
    }

    #[test]
    fn an_unreachable_store_means_rank_0_is_dead() {
        // A port nobody listens on: the store's host is gone.
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
            l.local_addr().expect("addr").port()
        };
        let h = StoreHealth::start(
            Store::client("127.0.0.1", port, Secret::new("0123456789abcdef-x")),
            1,
        );
        let start = Instant::now();
        while h.failed(1).is_none() && start.elapsed() < SILENCE * 4 {
            std::thread::sleep(Duration::from_millis(50));
        }
        let (rank, why) = h.failed(1).expect("rank 0 is reported");
        assert_eq!(rank, 0);
        assert!(why.contains("unreachable"), "{why}");
    }

    #[test]
    fn a_rank_that_finished_is_not_taken_as_dead_when_it_goes_silent() {
        let (port, secret) = store();
        let a = StoreHealth::start(Store::client("127.0.0.1", port, secret.clone()), 0);
        let b = Store::client("127.0.0.1", port, secret.clone());
        b.beat(1, REQUEST).expect("beats");
        let b_health = StoreHealth::start(Store::client("127.0.0.1", port, secret), 1);
        b_health.finished(1);
        drop(b_health);
        // Rank 1 is silent from now on, but it finished.
        std::thread::sleep(SILENCE + BEAT_EVERY * 3);
        assert_eq!(a.failed(0), None);
        // And rank 0, hosting the store, does not wait for it.
        let start = Instant::now();
        a.linger(2, 0, Duration::from_secs(5), Duration::from_secs(5));
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
    }

    #[test]
    fn the_store_host_lingers_no_longer_than_every_other_rank_has_ended() {
        // Rank 1 finished, ranks 2 and 3 failed (the monitor knows only
        // the first failure): rank 0 stops waiting at once, not at its
        // bound.
        let (port, secret) = store();
        let c = Store::client("127.0.0.1", port, secret.clone());
        c.put("done/1", b"ok", REQUEST).expect("stores");
        c.fail(3, "hang", REQUEST).expect("posts");
        c.fail(2, "its echo", REQUEST).expect("posts");
        let a = StoreHealth::start(Store::client("127.0.0.1", port, secret), 0);
        let t0 = Instant::now();
        a.linger(4, 0, Duration::from_secs(30), Duration::from_secs(30));
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    }

    /// The store's host waits, without a bound, for a rank that is alive
    /// (it beats) however long it runs, past the silence and past any
    /// deadline; it stops once that rank ends.
    #[test]
    fn the_store_host_waits_for_a_rank_that_runs_long_after_it() {
        let (port, secret) = store();
        let host = StoreHealth::start(Store::client("127.0.0.1", port, secret.clone()), 0);
        let other = StoreHealth::start(Store::client("127.0.0.1", port, secret.clone()), 1);
        let t0 = Instant::now();
        let lingering = std::thread::spawn(move || {
            host.linger(2, 0, Duration::MAX, Duration::from_secs(1));
            Instant::now()
        });
        std::thread::sleep(SILENCE + Duration::from_secs(1));
        assert!(!lingering.is_finished(), "the host left a live rank");
        other.finished(1);
        let left = lingering.join().expect("joins");
        let waited = left - t0;
        assert!(
            waited >= SILENCE + Duration::from_secs(1) && waited < SILENCE + Duration::from_secs(6),
            "{waited:?}"
        );
        // Once another rank failed, the wait ends `after_failure` later,
        // whoever still runs (rank 1 here beats on).
        let (port, secret) = store();
        let host = StoreHealth::start(Store::client("127.0.0.1", port, secret.clone()), 0);
        let _alive = StoreHealth::start(Store::client("127.0.0.1", port, secret.clone()), 1);
        Store::client("127.0.0.1", port, secret.clone())
            .fail(2, "hang", REQUEST)
            .expect("posts");
        let t0 = Instant::now();
        host.linger(3, 0, Duration::MAX, Duration::from_secs(1));
        let waited = t0.elapsed();
        assert!(
            waited >= Duration::from_secs(1) && waited < Duration::from_secs(5),
            "{waited:?}"
        );
        // A store that cannot be read ends the wait within the silence.
        let (port, secret) = store();
        let host = StoreHealth::start(
            Store::client("127.0.0.1", port, Secret::new("wrong token, wrong")),
            0,
        );
        let t0 = Instant::now();
        host.linger(2, 0, Duration::MAX, Duration::from_secs(1));
        assert!(
            t0.elapsed() < SILENCE + Duration::from_secs(5),
            "{:?}",
            t0.elapsed()
        );
        drop(secret);
    }

    /// A rank is heard by the store before `StoreHealth::start` returns,
    /// so one that dies at once (its monitor gone before its first tick)
    /// still falls silent, and a lingering host does not wait for it for
    /// ever.
    #[test]
    fn a_rank_is_heard_before_its_monitor_starts_so_its_death_is_seen() {
        let (port, secret) = store();
        drop(StoreHealth::start(
            Store::client("127.0.0.1", port, secret.clone()),
            1,
        ));
        let host = StoreHealth::start(Store::client("127.0.0.1", port, secret), 0);
        let t0 = Instant::now();
        host.linger(2, 0, Duration::from_secs(60), Duration::from_secs(60));
        let waited = t0.elapsed();
        assert!(waited < SILENCE + Duration::from_secs(5), "{waited:?}");
    }

    #[test]
    fn the_store_host_stops_lingering_once_two_killed_ranks_fall_silent() {
        // Ranks 1 and 2 beat once, then are killed: the monitor names only
        // the first, but the store counts both silent ranks as ended, so
        // rank 0 waits about one silence, not its whole bound.
        let (port, secret) = store();
        let c = Store::client("127.0.0.1", port, secret.clone());
        let t0 = Instant::now();
        c.beat(1, REQUEST).expect("beats");
        c.beat(2, REQUEST).expect("beats");
        let a = StoreHealth::start(Store::client("127.0.0.1", port, secret), 0);
        a.linger(3, 0, Duration::from_secs(60), Duration::from_secs(60));
        let took = t0.elapsed();
        assert!(took >= SILENCE, "{took:?}");
        assert!(took < SILENCE * 4, "{took:?}");
    }

    #[test]
    fn through_the_store_only_ranks_that_finished_count_as_finished() {
        let (port, secret) = store();
        let a = StoreHealth::start(Store::client("127.0.0.1", port, secret.clone()), 0);
        let c = Store::client("127.0.0.1", port, secret);
        assert_eq!(a.finished_among(&[1, 2, 3]), None);
        c.fail(2, "hang", REQUEST).expect("posts");
        c.put("done/3", b"ok", REQUEST).expect("stores");
        // The monitor looks once asked; the answer never waits.
        let start = Instant::now();
        while a.finished_among(&[1, 2, 3]).is_none() {
            assert!(start.elapsed() < Duration::from_secs(5), "never seen");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(a.finished_among(&[1, 2, 3]), Some(3));
        assert_eq!(a.finished_among(&[1, 2]), None);
    }

    #[test]
    fn the_monitor_reads_a_finished_ranks_counts_so_a_wait_never_asks_the_store() {
        let (port, secret) = store();
        let a = StoreHealth::start(Store::client("127.0.0.1", port, secret.clone()), 0);
        let b = StoreHealth::start(Store::client("127.0.0.1", port, secret.clone()), 1);
        let c = Store::client("127.0.0.1", port, secret);
        let counts = vec![ChannelCount {
            comm: 1,
            from: 1,
            to: 0,
            sent: 3,
            received: 2,
        }];
        b.post_counts(1, &counts);
        b.finished(1);
        // Rank 2 finished without its counts (the store refused them):
        // finished, counts unknown, until they come.
        c.put("done/2", b"ok", REQUEST).expect("stores");
        // Asking starts the watch; the answer never waits.
        assert_eq!(a.finished_counts(1), None);
        assert_eq!(a.finished_counts(2), None);
        let start = Instant::now();
        while a.finished_counts(1).is_none() || a.finished_among(&[2]).is_none() {
            assert!(start.elapsed() < Duration::from_secs(5), "never read");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(a.finished_counts(1).as_deref(), Some(&counts));
        assert_eq!(a.finished_among(&[2]), Some(2));
        assert_eq!(a.finished_counts(2), None);
        assert_eq!(a.finished_counts(3), None);
        // Posted late, read on a later beat.
        let late = vec![ChannelCount {
            comm: 0,
            from: 2,
            to: 0,
            sent: 0,
            received: 7,
        }];
        c.put("counts/2", &serde_json::to_vec(&late).unwrap(), REQUEST)
            .expect("stores");
        let start = Instant::now();
        while a.finished_counts(2).is_none() {
            assert!(start.elapsed() < Duration::from_secs(5), "never read");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(a.finished_counts(2).as_deref(), Some(&late));
        // One process: the registry counts every rank, none here.
        let local = LocalHealth::default();
        local.finished(1);
        assert_eq!(local.finished_counts(1), None);
    }

    /// The watch for finished ranks looks up only the ranks asked about,
    /// stops at its time budget (the heartbeat goes out from the same
    /// thread), and asks for missing counts less and less often.
    #[test]
    fn the_watch_for_finished_ranks_keeps_to_its_budget_and_backs_off() {
        let (port, secret) = store();
        let c = Store::client("127.0.0.1", port, secret.clone());
        for r in 1..=50 {
            c.put(&format!("done/{r}"), b"ok", REQUEST).expect("stores");
        }
        let h = StoreHealth::start(Store::client("127.0.0.1", port, secret), 0);
        // Stop the monitor's own looks: this test makes them.
        h.stop.store(true, Ordering::Release);
        std::thread::sleep(BEAT_EVERY * 2);
        let finished = |h: &StoreHealth| h.finished.lock().unwrap().len();
        let later = || Instant::now() + Duration::from_secs(10);
        // Nobody asked: nothing is looked up.
        h.look_for_finished(later());
        assert_eq!(finished(&h), 0);
        // A few ranks asked about: looked up at once.
        assert_eq!(h.finished_among(&[3, 4]), None);
        h.look_for_finished(later());
        assert_eq!(finished(&h), 2);
        // Many: through `ENDED`, every few beats.
        let ranks: Vec<Rank> = (1..=50).collect();
        assert_eq!(h.finished_among(&ranks), Some(3), "known already");
        h.looks.store(1, Ordering::Relaxed);
        for _ in 1..ENDED_EVERY {
            h.look_for_finished(later());
            assert_eq!(finished(&h), 2, "no ENDED on this beat");
        }
        // Out of time before the first lookup: none made (the fifth beat's
        // ENDED came, and was cut off).
        assert!(h.looks.load(Ordering::Relaxed).is_multiple_of(ENDED_EVERY));
        h.look_for_finished(Instant::now());
        assert_eq!(finished(&h), 2);
        for _ in 1..ENDED_EVERY {
            h.look_for_finished(later());
            assert_eq!(finished(&h), 2, "no ENDED on this beat");
        }
        // With time, every rank asked about and finished is learned.
        h.look_for_finished(later());
        assert_eq!(finished(&h), 50);
        assert_eq!(h.finished_among(&[7]), Some(7));
        // Counts missing from the store: asked for, tried, and put off.
        assert_eq!(h.finished_counts(7), None);
        h.look_for_finished(Instant::now() + Duration::from_secs(10));
        let (next, wait) = h.wanted.lock().unwrap()[&7];
        assert_eq!(wait, BEAT_EVERY * 2);
        assert!(next > Instant::now(), "the next read is later");
        for _ in 0..10 {
            h.wanted.lock().unwrap().get_mut(&7).unwrap().0 = Instant::now();
            h.look_for_finished(Instant::now() + Duration::from_secs(10));
        }
        assert_eq!(h.wanted.lock().unwrap()[&7].1, COUNTS_RETRY_MAX);
        // Once there, they are read at the next due look.
        c.put("counts/7", b"[]", REQUEST).expect("stores");
        h.wanted.lock().unwrap().get_mut(&7).unwrap().0 = Instant::now();
        h.look_for_finished(Instant::now() + Duration::from_secs(10));
        assert_eq!(h.finished_counts(7).as_deref(), Some(&Vec::new()));
    }

    /// Each look of a few ranks starts at another, so none is starved by
    /// a budget that cuts looks short.
    #[test]
    fn the_watch_takes_a_few_ranks_in_turn() {
        assert_eq!(in_turn(vec![1, 2, 3], 0), vec![1, 2, 3]);
        assert_eq!(in_turn(vec![1, 2, 3], 1), vec![2, 3, 1]);
        assert_eq!(in_turn(vec![1, 2, 3], 5), vec![3, 1, 2]);
        assert_eq!(in_turn(vec![], 7), Vec::<Rank>::new());
        // Over any three looks each rank comes first once.
        let firsts: Vec<Rank> = (10..13).map(|n| in_turn(vec![4, 5, 6], n)[0]).collect();
        let mut sorted = firsts.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, vec![4, 5, 6], "{firsts:?}");
    }

    #[test]
    fn traces_published_by_each_rank_are_gathered() {
        let (port, secret) = store();
        let a = StoreHealth::start(Store::client("127.0.0.1", port, secret.clone()), 0);
        let b = StoreHealth::start(Store::client("127.0.0.1", port, secret.clone()), 1);
        let c = StoreHealth::start(Store::client("127.0.0.1", port, secret.clone()), 2);
        let secret2 = secret;
        let mut t1 = Trace::new(3);
        t1.add_thread(1, "main");
        b.publish(1, &t1);
        let mut t2 = Trace::new(3);
        t2.add_thread(2, "main");
        c.publish(2, &t2);
        let got = a.gather(3, 0, Duration::from_secs(2));
        assert_eq!(got.traces, vec![t1.clone(), t2.clone()]);
        assert!(got.missing.is_empty());
        // A rank that never publishes costs the wait, no more, and is
        // named (ranks 0 and 3 published nothing).
        let start = Instant::now();
        let got = b.gather(4, 1, Duration::from_millis(300));
        assert_eq!(got.traces, vec![t2]);
        assert_eq!(got.missing, vec![0, 3]);
        assert!(start.elapsed() < Duration::from_secs(2));
        // A trace published while the gather waits arrives in it: ranks 0
        // and 1 have published, rank 3's comes 300 ms into the wait.
        let mut t0 = Trace::new(4);
        t0.add_thread(0, "main");
        a.publish(0, &t0);
        let late = StoreHealth::start(Store::client("127.0.0.1", port, secret2.clone()), 3);
        let mut t3 = Trace::new(4);
        t3.add_thread(3, "main");
        let t3c = t3.clone();
        let publisher = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            late.publish(3, &t3c);
        });
        let got = c.gather(4, 2, Duration::from_secs(2));
        publisher.join().expect("published");
        assert_eq!(got.traces, vec![t0, t1.clone(), t3]);
        assert!(got.missing.is_empty());
    }

    #[test]
    fn an_early_snapshot_stands_in_only_for_a_rank_whose_own_trace_did_not_come() {
        let (port, secret) = store();
        let a = StoreHealth::start(Store::client("127.0.0.1", port, secret.clone()), 0);
        let b = StoreHealth::start(Store::client("127.0.0.1", port, secret), 1);
        let mut early = Trace::new(2);
        early.add_thread(1, "early");
        b.publish_early(1, &early);
        // Not the whole wait: the rank's own publish is waited for only a
        // grace once its snapshot is there.
        let t0 = Instant::now();
        let got = a.gather(2, 0, Duration::from_secs(30));
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "waited the whole wait"
        );
        assert_eq!(got.traces, vec![early.clone()]);
        // Said to be a snapshot, not the rank's own trace.
        assert_eq!(
            (got.early.as_slice(), got.missing.as_slice()),
            (&[1][..], &[][..])
        );
        // Its own publish wins, whatever came first.
        let mut own = Trace::new(2);
        own.add_thread(1, "main");
        b.publish(1, &own);
        b.publish_early(1, &early);
        let got = a.gather(2, 0, Duration::from_millis(200));
        assert_eq!(got.traces, vec![own]);
        assert!(got.early.is_empty());
    }
}
