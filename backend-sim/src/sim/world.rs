//! One execution of user code on the simulator: the state machine, the host
//! threads' control states, the buffers, and the scheduler that lets exactly
//! one host thread run at a time.
//!
//! Every transport call that the rules care about is a *scheduling point*:
//! the calling thread parks its call and the scheduler (run by whichever
//! thread just parked) decides who moves next. User code between two calls
//! touches only its own thread's state and runs eagerly; the only choices are
//! which parked call is applied next, exactly as in the checker.

use std::collections::HashMap;
use std::io::Write as _;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use duplex::report::Stuck;
use duplex::{Error, Hang, Rank};

use crate::check::fingerprint;
use crate::dpor::Obj;
use crate::explore::{Choice, Schedule, Scheduler, Strategy};
use duplex::machine::Mode;
use duplex::machine::{
    Delivery, HostCall, Machine, Next, OpRef, Origin, OriginInfo, Status, ThreadId, Unknown,
};
use smallvec::SmallVec;

/// What a host thread is doing.
#[derive(Debug)]
pub(crate) enum Ctl {
    /// Created; runs user code up to its first call when the scheduler lets it.
    Starting,
    /// Running user code (only the thread named by `World::running`).
    Running,
    /// Waiting to make this call; the buffers its ops use.
    Parked(HostCall, Vec<Use>),
    /// The call was made; waits for the machine (a sync, a handshake).
    InCall,
    /// The call has returned this result; the thread runs when scheduled.
    Returned(Result<(), Error>),
    /// Past its end.
    Done,
}

/// A buffer an op uses, and how (for the device order, D1).
#[derive(Clone, Debug)]
pub(crate) struct Use {
    pub(crate) buf: usize,
    pub(crate) dir: duplex::Dir,
    pub(crate) peer: Rank,
    pub(crate) count: usize,
    pub(crate) dtype: duplex::DType,
    pub(crate) stream: u32,
    /// Its communicator (or copy-engine lane): its part of the launch.
    pub(crate) part: u32,
    pub(crate) at: &'static std::panic::Location<'static>,
    pub(crate) site: Option<Arc<str>>,
}

impl Use {
    /// Its access, its stream named from `setup`.
    fn access<'a>(&'a self, setup: &'a duplex::machine::Setup) -> (u64, duplex::order::Access<'a>) {
        (
            self.buf as u64,
            duplex::order::Access {
                dir: self.dir,
                peer: self.peer,
                count: self.count,
                dtype: self.dtype,
                stream: self.stream,
                stream_name: &setup.streams[self.stream as usize].name,
                part: self.part,
                at: self.at,
                site: self.site.as_ref(),
            },
        )
    }
}

/// Bytes of a buffer.
#[derive(Debug)]
pub(crate) struct BufData {
    pub(crate) rank: Rank,
    pub(crate) bytes: Vec<u8>,
    /// The thread that allocated it and how many buffers that thread had
    /// allocated before: its name in the explorer's fingerprint, the same
    /// whichever order threads allocate in.
    pub(crate) key: (ThreadId, u32),
    /// The hash of `bytes`, `None` after they change (computed when the
    /// explorer next takes a fingerprint).
    pub(crate) digest: Option<u128>,
    /// Ops still to deliver that read or write it (entries of
    /// [`World::op_buffers`]).
    pub(crate) in_flight: u32,
    /// Its [`crate::SimBuffer`] was dropped: its bytes are freed once no op
    /// in flight uses them (at once if none does), as the GPU backend
    /// frees a dropped buffer's memory once its ops have completed.
    pub(crate) dropped: bool,
}

impl BufData {
    /// Sets its bytes.
    pub(crate) fn set(&mut self, bytes: Vec<u8>) {
        *self.bytes_mut() = bytes;
    }

    /// Its bytes, to change (their hash is taken again when next asked).
    pub(crate) fn bytes_mut(&mut self) -> &mut Vec<u8> {
        self.digest = None;
        &mut self.bytes
    }

    /// The hash of its bytes, taken once per change.
    pub(crate) fn digest(&mut self) -> u128 {
        *self
            .digest
            .get_or_insert_with(|| xxhash_rust::xxh3::xxh3_128(&self.bytes))
    }

    /// A buffer made by `alloc`.
    pub(crate) fn new(rank: Rank, bytes: Vec<u8>, key: (ThreadId, u32)) -> BufData {
        BufData {
            rank,
            bytes,
            key,
            digest: None,
            in_flight: 0,
            dropped: false,
        }
    }
}

/// How an execution ended, if it failed.
#[derive(Clone, Debug)]
pub(crate) enum Ending {
    /// No thread could move.
    Hang(Box<Hang>),
    /// A program error at a thread's call (`None`: found at the end).
    Program {
        thread: Option<ThreadId>,
        error: Error,
    },
    /// A thread returned an error or panicked.
    Thread { thread: ThreadId, error: String },
    /// The explorer pruned this execution.
    Pruned,
    /// A replayed schedule does not fit the program.
    Mismatch,
}

/// How many calls a thread may make once its execution is over before
/// the simulator ends it ([`Shared::ended`]).
pub(crate) const LATE_CALLS: u32 = 100;

pub(crate) struct World {
    /// This execution's number, unique in the process: a buffer made by
    /// another execution (kept in a static, say) is refused, not taken for
    /// one of this execution's with the same index.
    pub(crate) run: u64,
    pub(crate) machine: Machine,
    pub(crate) ctl: Vec<Ctl>,
    /// Per thread: the condition variable it waits for its turn on (one
    /// each, so that passing the turn wakes one OS thread, not all).
    pub(crate) turns: Vec<Arc<Condvar>>,
    pub(crate) running: Option<ThreadId>,
    /// Set once the execution is over: every further call fails at once.
    pub(crate) over: bool,
    pub(crate) ending: Option<Ending>,
    pub(crate) explorer: Strategy,
    pub(crate) reduce: bool,
    pub(crate) buffers: Vec<BufData>,
    /// The bytes of every buffer in `buffers` (kept as they are made, so
    /// that an `alloc` does not add them all up).
    pub(crate) buffer_bytes: u64,
    /// Ops still to deliver, and the buffer each reads or writes.
    pub(crate) op_buffers: HashMap<OpRef, usize>,
    /// Ops whose completion no host synchronize has observed yet: their
    /// buffer, rank and stream. The host may not touch such a buffer,
    /// unless the rank's device order says that a sync covered them all
    /// through events ([`duplex::order::Order::idle`]).
    pub(crate) unsynced: HashMap<OpRef, (usize, Rank, duplex::machine::StreamId, String)>,
    /// The ops of `unsynced` by buffer, in issue order: what a host read
    /// or write looks up, without a walk over every op in flight.
    pub(crate) unsynced_by_buffer: HashMap<usize, std::collections::BTreeSet<OpRef>>,
    /// For a thread in a `sync`: the ops that call covers, and what it
    /// orders on the device once it returns (D1).
    pub(crate) sync_covers: HashMap<ThreadId, (Vec<OpRef>, duplex::order::Covered)>,
    /// Per rank: the device order of its buffer accesses (D1).
    pub(crate) orders: Vec<duplex::order::Order>,
    /// Bytes of sends that completed into a channel's buffer (R5).
    pub(crate) snapshots: HashMap<OpRef, Vec<u8>>,
    /// Per thread: a hash of everything the transport told its code that
    /// depends on the interleaving (the data it read, a race it was
    /// refused for), and the buffers it allocated. The rank code is a
    /// function of what it was told, so two executions that told a thread
    /// the same things and reached the same machine state continue alike;
    /// where the data differ, the explorer must not take them for one.
    pub(crate) observed: Vec<(u128, u32)>,
    /// Per thread: the events it made. An event is named by its thread and
    /// this count, as a buffer is keyed: a name by the order of creation
    /// across threads (`event{n}`) let two executions in which two
    /// threads of a rank made their events in the other order have one
    /// fingerprint while each thread held the other's id, and the search's
    /// record of what followed a state ([`crate::dpor`]) names events by
    /// id.
    pub(crate) events_made: Vec<u32>,
    /// The thread that made each stream, event, thread and communicator
    /// that rank code made at run time, in the order made (one list per
    /// kind, in the order of their ids): names alone do not tell which
    /// thread holds which id where two threads of a rank made objects of
    /// one name in either order, and the fingerprint must.
    pub(crate) made_by: [Vec<ThreadId>; 4],
    /// Interned origins.
    pub(crate) origins: HashMap<(String, String), Origin>,
    /// The host steps taken, described.
    pub(crate) steps: Vec<String>,
    /// The thread chosen at each decision point with more than one option.
    pub(crate) choices: Vec<ThreadId>,
    /// Each thread's result, once it has ended (for `join`).
    pub(crate) results: Vec<Option<Result<(), Error>>>,
    /// OS threads started by `spawn`, joined when the execution ends.
    pub(crate) os_threads: Vec<std::thread::JoinHandle<()>>,
    /// User communicators by creation index: name, members, id.
    pub(crate) user_comms: Vec<(String, Vec<Rank>, duplex::machine::CommId)>,
    /// Per rank: communicators created so far.
    pub(crate) comm_calls: Vec<usize>,
    /// Every call applied, in order: the execution's trace.
    pub(crate) calls: Vec<(ThreadId, HostCall)>,
    /// Header of hang reports and the replay hint.
    pub(crate) describe: String,
    pub(crate) replay_hint: String,
    /// Bumped whenever a thread takes the world's lock ([`Shared::lock`]):
    /// at every transport call and every thread's start and end, the
    /// waiting threads' sign of progress.
    pub(crate) progress: u64,
    /// Per thread: the calls it made once the execution was over
    /// ([`Shared::ended`]).
    pub(crate) late_calls: Vec<u32>,
    /// How long the running thread may go without `progress`
    /// ([`crate::Sim::user_code_limit`]).
    pub(crate) user_code_limit: std::time::Duration,
    /// How many threads, streams, communicators and events the setup had
    /// before the rank code ran (the same in every execution): those made
    /// after are the fingerprint's too.
    pub(crate) setup_base: (usize, usize, usize, usize),
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("World")
            .field("running", &self.running)
            .field("over", &self.over)
            .field("ctl", &self.ctl)
            .finish_non_exhaustive()
    }
}

/// The world, behind the lock every simulated thread takes.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) world: Mutex<World>,
}

impl Drop for World {
    fn drop(&mut self) {
        crate::memory::release(self.buffer_bytes);
    }
}

/// The machine's view of the parked calls.
struct Parked<'a>(&'a [Ctl]);

impl Parked<'_> {
    fn call(&self, t: ThreadId) -> Option<HostCall> {
        match self.0.get(t.0 as usize) {
            Some(Ctl::Parked(call, _)) => Some(call.clone()),
            _ => None,
        }
    }
}

impl Shared {
    /// The world, for a transport call (of any kind: `alloc`, `read` and
    /// `write` too) or a thread's start or end, each of which counts as
    /// progress for [`World::user_code_limit`].
    pub(crate) fn lock(&self) -> MutexGuard<'_, World> {
        // A panic while holding the lock is a bug in duplex; keep going with
        // the data as it is rather than poisoning every thread.
        let mut w = self.world.lock().unwrap_or_else(|e| e.into_inner());
        w.progress += 1;
        w
    }

    /// Parks thread `t` at `call` and waits until its call returns.
    pub(crate) fn call(
        self: &Arc<Self>,
        t: ThreadId,
        call: HostCall,
        bufs: Vec<Use>,
    ) -> Result<(), Error> {
        let w = self.lock();
        if w.over {
            return Err(self.ended(w, t));
        }
        let mut w = w;
        if let Err(e) = w.machine.check_call(t, &call) {
            return Err(e.into());
        }
        w.ctl[t.0 as usize] = Ctl::Parked(call, bufs);
        w.running = None;
        w.schedule();
        w.wake();
        self.wait_turn(w, t)
    }

    /// The error of a call thread `t` made once the execution was over:
    /// the execution's own error. A thread that goes on calling after it
    /// (rank code that retries a failed wait, as it may on GPUs, where
    /// [`Error::Hang`] means that a deadline passed) would spin for ever
    /// and keep the run from returning, since every call now fails at once
    /// and each counts as progress. Its [`LATE_CALLS`]th call after the end
    /// therefore ends the thread instead, by unwinding its code (as a
    /// panic does, which [`super::rank::run_thread`] catches); the
    /// execution's outcome, decided before, stays as it was.
    #[allow(clippy::print_stderr)]
    pub(crate) fn ended(&self, mut w: MutexGuard<'_, World>, t: ThreadId) -> Error {
        let error = w.abort_error();
        let i = t.0 as usize;
        if w.late_calls.len() <= i {
            w.late_calls.resize(i + 1, 0);
        }
        w.late_calls[i] += 1;
        // A call made while the thread already unwinds (from a `Drop`) must
        // not unwind again, which would abort the process.
        if w.late_calls[i] < LATE_CALLS || std::thread::panicking() {
            return error;
        }
        let message = format!(
            "{} made {LATE_CALLS} transport calls after the execution had ended, each of which failed at once with its error ({error}); the simulator ends the thread here. Rank code that retries a failed call must stop on an error that says the run is over (Error::Hang, Error::Aborted)",
            w.thread_name(t)
        );
        // Said at once where the execution failed (a pruned execution's
        // threads end this way as a matter of course).
        let failed = !matches!(w.ending, None | Some(Ending::Pruned));
        drop(w);
        if failed {
            let _ = writeln!(std::io::stderr(), "duplex-sim: {message}");
        }
        std::panic::resume_unwind(Box::new(message))
    }

    /// Waits until `t` may run again; returns the result of its call.
    pub(crate) fn wait_turn(&self, mut w: MutexGuard<'_, World>, t: ThreadId) -> Result<(), Error> {
        let mut seen = (w.progress, std::time::Instant::now());
        loop {
            if w.running == Some(t) {
                let ctl = std::mem::replace(&mut w.ctl[t.0 as usize], Ctl::Running);
                return match ctl {
                    Ctl::Returned(r) => r,
                    _ => Ok(()),
                };
            }
            if w.over {
                let ctl = std::mem::replace(&mut w.ctl[t.0 as usize], Ctl::Running);
                return match ctl {
                    Ctl::Returned(r) => r,
                    _ => Err(w.abort_error()),
                };
            }
            let turn = w.turns[t.0 as usize].clone();
            let slice = w.user_code_limit.clamp(
                std::time::Duration::from_millis(1),
                std::time::Duration::from_millis(500),
            );
            w = match turn.wait_timeout(w, slice) {
                Ok((w, _)) => w,
                Err(e) => e.into_inner().0,
            };
            if w.progress != seen.0 {
                seen = (w.progress, std::time::Instant::now());
            } else if seen.1.elapsed() >= w.user_code_limit {
                w.user_code_stuck();
            }
        }
    }

    /// Thread `t`'s user code has returned `result`: record it, make its
    /// end call, and pass the turn on.
    pub(crate) fn finish(&self, t: ThreadId, result: Result<(), String>) {
        let mut w = self.lock();
        let failed = result.is_err();
        w.results[t.0 as usize] = Some(
            result
                .clone()
                .map_err(|m| Error::Aborted(format!("the thread failed: {m}"))),
        );
        if let Err(error) = result
            && !w.over
        {
            w.end(Ending::Thread { thread: t, error });
        }
        if w.over || failed {
            w.ctl[t.0 as usize] = Ctl::Done;
        } else {
            w.ctl[t.0 as usize] = Ctl::Parked(HostCall::End, Vec::new());
            w.running = None;
            w.schedule();
        }
        w.wake();
    }
}

impl World {
    /// Wakes the thread whose turn it is, or every thread once the
    /// execution is over.
    pub(crate) fn wake(&self) {
        if self.over {
            for turn in &self.turns {
                turn.notify_all();
            }
        } else if let Some(t) = self.running {
            self.turns[t.0 as usize].notify_all();
        }
    }

    pub(crate) fn abort_error(&self) -> Error {
        match &self.ending {
            Some(Ending::Hang(h)) => Error::Hang(h.clone()),
            Some(Ending::Program { error, .. }) => error.clone(),
            Some(Ending::Thread { thread, error }) => {
                Error::Aborted(format!("{} failed: {error}", self.thread_name(*thread)))
            }
            Some(Ending::Pruned) => {
                Error::Aborted("the explorer has seen the rest of this execution before".into())
            }
            Some(Ending::Mismatch) => {
                Error::Aborted("the replayed schedule does not fit this program".into())
            }
            None => Error::Aborted("the execution is over".into()),
        }
    }

    /// The running thread has gone [`World::user_code_limit`] without a
    /// transport call while every other thread waited for it: most likely
    /// it waits for another thread outside the transport, which the
    /// simulator cannot see or end. The execution ends with that error, so
    /// that parked threads return and the test does not hang silently.
    #[allow(clippy::print_stderr)]
    fn user_code_stuck(&mut self) {
        if self.over {
            return;
        }
        let Some(r) = self.running else { return };
        let error = format!(
            "ran its own code for {:?} without a transport call while every other thread of the simulation waited for it: a wait outside the transport (a lock, a channel or a barrier that rank threads share) never ends on the simulator, which runs one host thread at a time and cannot see it; wait with notify/await_notify, or join, instead, or raise Sim::user_code_limit if the code is only slow",
            self.user_code_limit
        );
        // Said at once as well: if that thread's wait does not end when
        // the others return, the test itself cannot finish, and this is
        // the only way its user learns why.
        let _ = writeln!(
            std::io::stderr(),
            "duplex-sim: {} {error}",
            self.thread_name(r)
        );
        self.end(Ending::Thread { thread: r, error });
        self.wake();
    }

    pub(crate) fn thread_name(&self, t: ThreadId) -> String {
        let info = &self.machine.setup().threads[t.0 as usize];
        format!("rank {} thread {}", info.rank, info.name)
    }

    pub(crate) fn end(&mut self, ending: Ending) {
        if self.ending.is_none() {
            self.ending = Some(ending);
        }
        self.over = true;
        self.running = None;
    }

    /// Interns an origin for a call made at `place`.
    pub(crate) fn origin(&mut self, place: String, text: String) -> Origin {
        if let Some(o) = self.origins.get(&(place.clone(), text.clone())) {
            return *o;
        }
        let o = self
            .machine
            .setup_mut()
            .add_origin(OriginInfo::at(text.as_str(), place.as_str()));
        self.origins.insert((place, text), o);
        o
    }

    /// Decides who runs next, applying parked calls until some thread must
    /// run user code, the execution is over, or nobody can move.
    pub(crate) fn schedule(&mut self) {
        // The thread whose step was taken last in this call.
        let mut just: Option<ThreadId> = None;
        loop {
            if self.over {
                return;
            }
            // A thread that has not started runs its code up to its first
            // call before any decision: right after the code that started
            // it, as part of its spawner's step (or, for the threads a
            // rank starts with, of the execution's start). So does the
            // thread whose step this was, where its call returned at
            // once: that is the rest of its step. A thread whose blocked
            // call another step let return is not run here: its return,
            // and its code up to its next call, is a step of its own,
            // which the search takes like any other. Run eagerly, inside
            // the step that woke it and in thread order, woken code took
            // orders no real execution forces and missed others (two
            // threads woken by one step ran in thread order only), and
            // gave the search of rank code eleven ways to miss an order
            // (see `crate::dpor`).
            if let Some(i) = self.ctl.iter().position(|c| matches!(c, Ctl::Starting)) {
                self.start_thread(ThreadId(i as u32));
                return;
            }
            if let Some(t) = just.take()
                && self.can_return(t)
            {
                self.return_call(t);
                return;
            }
            if self
                .ctl
                .iter()
                .any(|c| matches!(c, Ctl::Running | Ctl::Returned(_)))
            {
                return; // someone is about to run (a spawner, say)
            }
            let returnable = self.returnable();
            let next_call = |t: ThreadId| Parked(&self.ctl).call(t);
            let threads = Unknown(&next_call, &[]);
            let mut enabled = self.machine.runnable(&threads);
            if !returnable.is_empty() {
                enabled.extend(returnable);
                enabled.sort_unstable();
            }
            if enabled.is_empty() {
                // (The explorer by its field: `threads` holds `ctl`.)
                if matches!(self.explorer, Strategy::Dpor(_)) {
                    let all: Vec<ThreadId> = (0..self.ctl.len() as u32).map(ThreadId).collect();
                    let parked = self.pending_uses(&all);
                    if let Strategy::Dpor(d) = &mut self.explorer {
                        d.end(&parked);
                    }
                }
                match self.machine.status(&threads) {
                    Status::Stuck => {
                        let stuck = self.machine.stuck(&threads);
                        let hang = self.hang(stuck);
                        self.end(Ending::Hang(Box::new(hang)));
                    }
                    Status::Finished | Status::Running => {
                        if let Some(e) = self.machine.leftover() {
                            self.end(Ending::Program {
                                thread: None,
                                error: e.into(),
                            });
                        }
                        self.over = true;
                        self.running = None;
                    }
                }
                return;
            }
            let choice = if matches!(self.explorer, Strategy::Dpor(_)) {
                // A rank whose one runnable thread no other thread of it
                // can precede moves without a decision; elsewhere the
                // search decides, and learns which orders matter.
                let forced = if enabled.len() == 1 {
                    Some(enabled[0])
                } else {
                    crate::check::closed_rank(&self.machine, &enabled, &threads)
                        .filter(|b| b.len() == 1)
                        .map(|b| b[0])
                };
                self.dpor_decide(&enabled, forced)
            } else {
                let options = if self.reduce {
                    crate::check::reduce(&self.machine, &enabled, &threads)
                } else {
                    enabled.clone()
                };
                // The search decides only where the reduction leaves a
                // choice (as the checker does): no fingerprint, no stored
                // state, in between.
                let decided = options.len() == 1 && matches!(self.explorer, Strategy::Dfs(_));
                if decided {
                    Choice::Take(options[0])
                } else {
                    // Only the search stores states; a random, PCT or
                    // replayed schedule needs no fingerprint, whose cost
                    // grows with the state (every stream of every rank) at
                    // every step.
                    let fp = match self.explorer {
                        Strategy::Dfs(_) => self.fingerprint(),
                        _ => 0,
                    };
                    self.explorer.choose(&enabled, &options, fp)
                }
            };
            let t = match choice {
                Choice::Take(t) => t,
                Choice::Prune => return self.end(Ending::Pruned),
                Choice::Mismatch => return self.end(Ending::Mismatch),
            };
            if enabled.len() > 1 {
                self.choices.push(t);
            }
            if self.can_return(t) {
                return self.return_call(t);
            }
            self.step(t);
            just = Some(t);
        }
    }

    /// The threads whose blocked call can return now: each can take a
    /// step (its return and its code up to its next call).
    fn returnable(&self) -> Vec<ThreadId> {
        (0..self.ctl.len())
            .map(|i| ThreadId(i as u32))
            .filter(|t| self.can_return(*t))
            .collect()
    }

    /// Whether thread `t` is in a call that can return now.
    fn can_return(&self, t: ThreadId) -> bool {
        matches!(self.ctl[t.0 as usize], Ctl::InCall) && self.machine.next(t) == Next::Call
    }

    /// Thread `t`, created, runs its code up to its first call.
    fn start_thread(&mut self, t: ThreadId) {
        if let Some(d) = self.dpor() {
            d.ran(t);
        }
        self.running = Some(t);
    }

    /// Thread `t`'s call returns (it can: the machine says so); its code
    /// runs up to its next call.
    fn return_call(&mut self, t: ThreadId) {
        let i = t.0 as usize;
        if let Some(d) = self.dpor() {
            d.ran(t);
        }
        self.ctl[i] = Ctl::Returned(Ok(()));
        if let Some((ops, covered)) = self.sync_covers.remove(&t) {
            let rank = self.machine.setup().threads[i].rank;
            // What the sync completes, for the search only: the buffers
            // of the ops it covers.
            let searching = matches!(self.explorer, Strategy::Dpor(_));
            let mut bufs: Vec<usize> = Vec::new();
            if searching {
                bufs.extend(
                    ops.iter()
                        .filter_map(|op| self.unsynced.get(op).map(|u| u.0)),
                );
            }
            for op in ops {
                self.forget_unsynced(op);
            }
            let done = self.orders[rank as usize].synced(covered);
            if searching {
                bufs.extend(done.into_iter().map(|b| b as usize));
            }
            // Drain: two syncs' returns commute (what they cover only
            // grows), and conflict with every access of a buffer they
            // cover.
            for b in bufs {
                self.note_buffer(t, b, Mode::Drain);
            }
        }
        self.running = Some(t);
    }

    /// Applies thread `t`'s parked call, or finishes its handshake.
    fn step(&mut self, t: ThreadId) {
        let i = t.0 as usize;
        if self.dpor().is_some() {
            let uses = self.uses_of(t);
            let rank = self.machine.setup().threads[i].rank;
            if let Some(d) = self.dpor() {
                d.ran(t);
                for (obj, mode) in uses {
                    d.uses(t, rank, obj, mode);
                }
            }
        }
        let name = self.thread_name(t);
        let result = if self.machine.next(t) == Next::Resume {
            self.steps.push(format!(
                "{}. {name}: returns from its connection handshake (R7)",
                self.steps.len() + 1
            ));
            self.machine.resume(t)
        } else {
            let Ctl::Parked(call, bufs) = std::mem::replace(&mut self.ctl[i], Ctl::InCall) else {
                return;
            };
            let text = match &call {
                HostCall::End => "ends: waits for its rank's streams to drain".to_string(),
                c => call_text(&self.machine, c),
            };
            self.steps
                .push(format!("{}. {name}: {text}", self.steps.len() + 1));
            let seq = self.machine.calls(t);
            let rank = self.machine.setup().threads[i].rank;
            let order = &mut self.orders[rank as usize];
            match &call {
                HostCall::Launch(spec) => {
                    // D1 before the machine: a launch that races is refused
                    // to its thread, which goes on (as on a GPU, where the
                    // backend refuses it before NCCL sees it).
                    let setup = self.machine.setup();
                    let uses: Vec<_> = bufs.iter().map(|u| u.access(setup)).collect();
                    if let Err(race) = order.launch(&uses) {
                        let e = race.error();
                        self.steps.push(format!(
                            "{}. {name}: {text} is refused: {e}",
                            self.steps.len() + 1
                        ));
                        self.ctl[i] = Ctl::Returned(Err(e));
                        self.running = Some(t);
                        return;
                    }
                    let refs = Machine::op_refs(t, seq, spec);
                    for ((u, o), op) in bufs.iter().zip(&spec.ops).zip(refs) {
                        self.op_buffers.insert(op, u.buf);
                        self.buffers[u.buf].in_flight += 1;
                        self.unsynced
                            .insert(op, (u.buf, rank, o.stream, text.clone()));
                        self.unsynced_by_buffer.entry(u.buf).or_default().insert(op);
                    }
                }
                HostCall::Sync { stream, .. } => {
                    let covers = self
                        .unsynced
                        .iter()
                        .filter(|(_, (_, r, s, _))| *r == rank && stream.is_none_or(|x| x == *s))
                        .map(|(op, _)| *op)
                        .collect();
                    let covered = order.covers(stream.map(|s| s.0));
                    self.sync_covers.insert(t, (covers, covered));
                }
                HostCall::Record { event, stream, .. } => order.record(event.0, stream.0),
                HostCall::Wait { event, stream, .. } => order.wait(event.0, stream.0),
                _ => {}
            }
            let end = matches!(call, HostCall::End);
            let r = self.machine.apply(t, &call);
            if r.is_ok() {
                self.calls.push((t, call));
            }
            if end {
                self.ctl[i] = Ctl::Done;
            }
            r
        };
        self.move_bytes();
        if let Err(e) = result {
            self.ctl[i] = Ctl::Returned(Err(e.clone().into()));
            self.end(Ending::Program {
                thread: Some(t),
                error: e.into(),
            });
            self.running = Some(t);
            return;
        }
        if matches!(self.ctl[i], Ctl::Done) {
            return;
        }
        self.ctl[i] = Ctl::InCall;
    }

    /// Copies the bytes of every message the machine moved.
    fn move_bytes(&mut self) {
        let deliveries = self.machine.take_deliveries();
        for d in deliveries {
            match d {
                Delivery::Buffered { send } => {
                    if let Some(b) = self.op_buffers.remove(&send) {
                        self.snapshots.insert(send, self.buffers[b].bytes.clone());
                        self.landed(b);
                    }
                }
                Delivery::Delivered { send, recv } => {
                    let data = match self.snapshots.remove(&send) {
                        Some(d) => Some(d),
                        None => self.op_buffers.remove(&send).map(|b| {
                            let data = self.buffers[b].bytes.clone();
                            self.landed(b);
                            data
                        }),
                    };
                    let recv = self.op_buffers.remove(&recv);
                    if let (Some(data), Some(b)) = (data, recv) {
                        let dst = self.buffers[b].bytes_mut();
                        let n = dst.len().min(data.len());
                        dst[..n].copy_from_slice(&data[..n]);
                    }
                    if let Some(b) = recv {
                        self.landed(b);
                    }
                }
            }
        }
    }

    /// An op in flight on buffer `b` is done with it: a dropped buffer
    /// that no op uses any more is freed.
    fn landed(&mut self, b: usize) {
        let buf = &mut self.buffers[b];
        buf.in_flight -= 1;
        if buf.dropped && buf.in_flight == 0 {
            self.free(b);
        }
    }

    /// The search of rank code ([`crate::dpor`]), where it is the strategy.
    pub(crate) fn dpor(&mut self) -> Option<&mut crate::dpor::Dpor> {
        match &mut self.explorer {
            Strategy::Dpor(d) => Some(d),
            _ => None,
        }
    }

    /// The search's decision between the `enabled` threads: it ends the
    /// step under way, given the calls parked now of the threads that ran
    /// in it and of the ranks whose objects it used ([`Dpor::touched`]).
    ///
    /// [`Dpor::touched`]: crate::dpor::Dpor::touched
    fn dpor_decide(&mut self, enabled: &[ThreadId], forced: Option<ThreadId>) -> Choice {
        let fp = (forced.is_none() && enabled.len() > 1).then(|| self.fingerprint());
        let Some(d) = self.dpor() else {
            unreachable!("called where the search is the strategy")
        };
        let (ranks, ran) = d.touched();
        let setup = self.machine.setup();
        let mut who: Vec<ThreadId> = ran.to_vec();
        for r in ranks {
            who.extend(setup.threads_of(r));
        }
        who.sort_unstable();
        who.dedup();
        let pending = self.pending_uses(&who);
        match self.dpor() {
            Some(d) => d.decide(enabled, &pending, forced, fp),
            None => unreachable!("called where the search is the strategy"),
        }
    }

    /// For the search of rank code ([`crate::dpor`]): thread `t` used
    /// buffer `b` in `mode`.
    pub(crate) fn note_buffer(&mut self, t: ThreadId, b: usize, mode: Mode) {
        if let Some(buf) = self.buffers.get(b) {
            let key = buf.key;
            self.note(t, Obj::Buffer(key.0, key.1), mode);
        }
    }

    /// For the search: thread `t` used an object of its rank in `mode`.
    pub(crate) fn note(&mut self, t: ThreadId, obj: Obj, mode: Mode) {
        let rank = self.machine.setup().threads[t.0 as usize].rank;
        if let Some(d) = self.dpor() {
            d.uses(t, rank, obj, mode);
        }
    }

    /// What thread `t`'s next step uses: its parked call's objects
    /// ([`Machine::footprint`]) and buffers, or those of the launch whose
    /// handshake it finishes.
    fn uses_of(&self, t: ThreadId) -> SmallVec<[(Obj, Mode); 6]> {
        let mut out: SmallVec<[(Obj, Mode); 6]> = SmallVec::new();
        let (call, bufs) = match &self.ctl[t.0 as usize] {
            Ctl::Parked(call, bufs) => (Some(call.clone()), bufs.as_slice()),
            _ => (self.machine.call_in_progress(t), &[][..]),
        };
        let Some(call) = call else { return out };
        for (o, m) in self.machine.footprint(&call) {
            out.push((Obj::Machine(o), m));
        }
        for u in bufs {
            if let Some(b) = self.buffers.get(u.buf) {
                let mode = match u.dir {
                    duplex::Dir::Send => Mode::DeviceRead,
                    duplex::Dir::Recv => Mode::Write,
                };
                out.push((Obj::Buffer(b.key.0, b.key.1), mode));
            }
        }
        out
    }

    /// The calls of threads `who` that are parked (or wait to finish a
    /// handshake), with their threads' ranks and uses.
    fn pending_uses(&self, who: &[ThreadId]) -> Vec<crate::dpor::Pending> {
        who.iter()
            .copied()
            .filter(|t| {
                matches!(self.ctl.get(t.0 as usize), Some(Ctl::Parked(..)))
                    || (t.0 as usize) < self.ctl.len() && self.machine.next(*t) == Next::Resume
            })
            .map(|t| {
                let rank = self.machine.setup().threads[t.0 as usize].rank;
                (t, rank, self.uses_of(t))
            })
            .collect()
    }

    /// The [`crate::SimBuffer`] of buffer `b` was dropped: its bytes go
    /// now, or once the last op in flight on it is done with them.
    pub(crate) fn drop_buffer(&mut self, b: usize) {
        // By the thread that runs (a buffer dropped off its turn, from a
        // thread-local past its thread's end, is a change the search
        // cannot place).
        // Drain, as a sync's return: a drop and a sync that covers the
        // buffer's ops commute (its bytes go once its ops are done either
        // way); no access can follow a drop.
        if let Some(t) = self.running {
            self.note_buffer(t, b, Mode::Drain);
        }
        let Some(buf) = self.buffers.get_mut(b) else {
            return;
        };
        buf.dropped = true;
        if buf.in_flight == 0 {
            self.free(b);
        }
    }

    /// Frees buffer `b`'s bytes (it stays in `buffers`, empty, so that the
    /// indices of the others hold, and in the fingerprint as freed).
    fn free(&mut self, b: usize) {
        let n = std::mem::take(self.buffers[b].bytes_mut()).len() as u64;
        self.buffer_bytes -= n;
        crate::memory::release(n);
    }

    /// The first op (by issue) that may still use buffer `b` as far as the
    /// host knows (no synchronize has returned since it was issued), with
    /// its description.
    pub(crate) fn user_of(&self, b: usize) -> Option<(OpRef, String)> {
        let op = *self.unsynced_by_buffer.get(&b)?.first()?;
        let (.., text) = self.unsynced.get(&op)?;
        Some((op, text.clone()))
    }

    /// The host knows every op on buffer `b` complete (a sync covered them
    /// through events, [`duplex::order::Order::idle`]): they are forgotten.
    pub(crate) fn host_knows_done(&mut self, b: usize) {
        for op in self.unsynced_by_buffer.remove(&b).unwrap_or_default() {
            self.unsynced.remove(&op);
        }
    }

    /// Takes `op` out of the ops the host has not synchronized with.
    fn forget_unsynced(&mut self, op: OpRef) {
        if let Some((b, ..)) = self.unsynced.remove(&op)
            && let Some(ops) = self.unsynced_by_buffer.get_mut(&b)
        {
            ops.remove(&op);
            if ops.is_empty() {
                self.unsynced_by_buffer.remove(&b);
            }
        }
    }

    /// Records, for thread `t`'s code, something the transport told it
    /// that depends on the interleaving ([`World::observed`]).
    pub(crate) fn observe(&mut self, t: ThreadId, what: &[u8]) {
        let slot = self.observed_mut(t);
        let mut h = xxhash_rust::xxh3::Xxh3Default::new();
        h.update(&slot.0.to_le_bytes());
        h.update(&(what.len() as u64).to_le_bytes());
        h.update(what);
        slot.0 = h.digest128();
    }

    /// Thread `t`'s next buffer's key ([`BufData::key`]).
    pub(crate) fn next_buffer_key(&mut self, t: ThreadId) -> (ThreadId, u32) {
        let slot = self.observed_mut(t);
        slot.1 += 1;
        (t, slot.1 - 1)
    }

    /// The name of the next event thread `t` makes.
    pub(crate) fn next_event_name(&mut self, t: ThreadId) -> String {
        let made = crate::dpor::slot(&mut self.events_made, t);
        let k = *made;
        *made += 1;
        let thread = &self.machine.setup().threads[t.0 as usize].name;
        format!("{thread}.event{k}")
    }

    fn observed_mut(&mut self, t: ThreadId) -> &mut (u128, u32) {
        let i = t.0 as usize;
        if self.observed.len() <= i {
            self.observed.resize(i + 1, (0, 0));
        }
        &mut self.observed[i]
    }

    /// The explorer's fingerprint of the state: the machine's; each
    /// rank's device order, which decides which later launches race; and
    /// the data: every buffer's bytes, which buffer each op in flight
    /// reads or writes, the bytes of buffered sends, the ops the host has
    /// not synchronized with (a later access of their buffers is a race),
    /// and what each thread's code was told ([`World::observed`]). Without
    /// the data, two executions that delivered different bytes looked like
    /// one, and the search pruned the second: a program that fails only
    /// when one thread's message arrives before another's passed.
    fn fingerprint(&mut self) -> u128 {
        use std::hash::{Hash, Hasher};
        let mut h = xxhash_rust::xxh3::Xxh3Default::new();
        h.write_u128(fingerprint(&self.machine));
        // A thread whose call can return but has not (its code has not
        // run) is not one that returned and parked its next call, though
        // the machine cannot tell them apart.
        for c in &self.ctl {
            h.write_u8(matches!(c, Ctl::InCall).into());
        }
        for o in &self.orders {
            o.digest(&mut h);
        }
        // Buffers by their keys, not by the order they were made in.
        let mut keyed: Vec<((u32, u32), Rank, bool, u128)> = self
            .buffers
            .iter_mut()
            .map(|b| ((b.key.0.0, b.key.1), b.rank, b.dropped, b.digest()))
            .collect();
        keyed.sort_unstable();
        h.write_usize(keyed.len());
        for (key, rank, dropped, digest) in keyed {
            h.write_u32(key.0);
            h.write_u32(key.1);
            h.write_u32(rank);
            h.write_u8(dropped.into());
            h.write_u128(digest);
        }
        let key = |b: usize| {
            self.buffers
                .get(b)
                .map_or((u32::MAX, 0), |b| (b.key.0.0, b.key.1))
        };
        let mut ops: Vec<(OpRef, (u32, u32))> = self
            .op_buffers
            .iter()
            .map(|(op, b)| (*op, key(*b)))
            .collect();
        ops.sort_unstable();
        h.write_usize(ops.len());
        for (op, b) in ops {
            op.hash(&mut h);
            h.write_u32(b.0);
            h.write_u32(b.1);
        }
        let mut unsynced: Vec<OpRef> = self.unsynced.keys().copied().collect();
        unsynced.sort_unstable();
        h.write_usize(unsynced.len());
        for op in unsynced {
            op.hash(&mut h);
        }
        let mut buffered: Vec<(OpRef, u128)> = self
            .snapshots
            .iter()
            .map(|(op, bytes)| (*op, xxhash_rust::xxh3::xxh3_128(bytes)))
            .collect();
        buffered.sort_unstable();
        h.write_usize(buffered.len());
        for (op, digest) in buffered {
            op.hash(&mut h);
            h.write_u128(digest);
        }
        let mut syncs: Vec<_> = self.sync_covers.iter().collect();
        syncs.sort_unstable_by_key(|(t, _)| **t);
        h.write_usize(syncs.len());
        for (t, (ops, covered)) in syncs {
            h.write_u32(t.0);
            let mut ops = ops.clone();
            ops.sort_unstable();
            for op in ops {
                op.hash(&mut h);
            }
            covered.digest(&mut h);
        }
        for (i, (seen, allocs)) in self.observed.iter().enumerate() {
            if (*seen, *allocs) != (0, 0) {
                h.write_usize(i);
                h.write_u128(*seen);
                h.write_u32(*allocs);
            }
        }
        // What the machine's numbers stand for, where rank code made them:
        // tags are numbered on first use, and streams, events, threads and
        // communicators as made, in the order the interleaving ran the
        // code in. Two executions that numbered them otherwise are told
        // apart: the search's record of what followed a state
        // ([`crate::dpor`]) names objects by number.
        let setup = self.machine.setup();
        let (threads, streams, comms, events) = self.setup_base;
        h.write_usize(setup.tags.len());
        for tag in &setup.tags {
            tag.hash(&mut h);
        }
        for t in setup.threads.iter().skip(threads) {
            h.write_u32(t.rank);
            t.name.hash(&mut h);
        }
        for s in setup.streams.iter().skip(streams) {
            h.write_u32(s.rank);
            s.name.hash(&mut h);
        }
        for c in setup.comms.iter().skip(comms) {
            c.name.hash(&mut h);
            c.members.hash(&mut h);
        }
        for e in setup.events.iter().skip(events) {
            h.write_u32(e.rank);
            e.name.hash(&mut h);
        }
        for kind in &self.made_by {
            h.write_usize(kind.len());
            for t in kind {
                h.write_u32(t.0);
            }
        }
        h.digest128()
    }

    fn hang(&self, stuck: Stuck) -> Hang {
        let schedule = Schedule::v1(self.choices.clone()).to_string();
        Hang {
            context: format!(
                "the simulator found that no host thread can move ({})",
                self.describe
            ),
            stuck,
            steps: self.steps.clone(),
            replay: Some(format!("{}.replay(\"{schedule}\", ...)", self.replay_hint)),
            schedule: Some(schedule),
            disagreements: Vec::new(),
        }
    }
}

/// A short description of a call, from its origin.
fn call_text(m: &Machine, call: &HostCall) -> String {
    let origin = match call {
        HostCall::Launch(spec) => Some(spec.origin),
        HostCall::Record { origin, .. }
        | HostCall::Wait { origin, .. }
        | HostCall::Sync { origin, .. }
        | HostCall::Notify { origin, .. }
        | HostCall::Await { origin, .. }
        | HostCall::Join { origin, .. } => Some(*origin),
        HostCall::End => None,
    };
    origin
        .and_then(|o| m.setup().origins.get(o.0 as usize))
        .map(|o| format!("{} ({})", o.text, o.place()))
        .unwrap_or_default()
}
