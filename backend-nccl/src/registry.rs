//! What the ranks of one process have issued: every rank in a local run,
//! shared between them; this process's rank in a process-per-rank run,
//! whose hang analysis joins the other processes' traces
//! ([`Registry::analyze_with`]). The registry holds no rule of its own: it records each call in a
//! [`Trace`]; the issue check ([`IssueMatch`], the model's R3 and R8 alone)
//! refuses a launch whose size, type or grouping disagrees with the partner
//! issued at its position before NCCL sees it, and the live [`Machine`],
//! brought up to date, names both ops. The live machine applies the
//! recorded calls later, off the issue path ([`Registry::settle`], each
//! watchdog tick: on one H200 this took a quarter off duplex's host time
//! per op over raw NCCL, BENCHMARKS.md). When a
//! deadline expires, [`Registry::analyze`] replays the trace through the
//! machine ([`Trace::analyze`]) and explains the hang with the model's
//! wait-for cycle. Calls the model refuses are kept as disagreements
//! between the model and the GPU, and reported with the hang.

use std::sync::{Arc, Mutex};

use duplex::machine::issue::IssueMatch;
use duplex::machine::{Machine, OpSpec, Setup, ThreadId};
use duplex::report::{OpInfo, Stuck};
use duplex::trace::{Analysis, Call, ChannelCount, Disagreement, Trace, TraceCall};
use duplex::{Error, Model, Rank};

use crate::ctx::OpMeta;

pub use duplex::trace::TraceOp as OpRec;

/// What a host thread is blocked in; the last field is the call's text
/// and place.
#[derive(Clone, Debug)]
pub enum Blocked {
    /// `sync_stream` (one stream) or `synchronize` (`None`).
    Sync(Option<u32>, (String, String)),
    /// `await_notify(from, tag)`.
    Await(Rank, String, (String, String)),
    /// `join` of a thread.
    Join(usize, (String, String)),
    /// A launch (its ops, and whether grouped) not yet made: held back by
    /// another thread's launch in its connection handshake (R11).
    Launch(Arc<[OpRec]>, bool, (String, String)),
}

impl Blocked {
    /// The blocked call's text and place.
    pub fn call(&self) -> (&str, &str) {
        let (Blocked::Sync(_, (text, place))
        | Blocked::Await(_, _, (text, place))
        | Blocked::Join(_, (text, place))
        | Blocked::Launch(_, _, (text, place))) = self;
        (text, place)
    }

    fn trace_call(&self, thread: usize) -> TraceCall {
        let (call, (text, place)) = match self {
            Blocked::Sync(s, w) => (Call::Sync { stream: *s }, w),
            Blocked::Await(from, tag, w) => (
                Call::Await {
                    from: *from,
                    tag: tag.clone(),
                },
                w,
            ),
            Blocked::Join(u, w) => (Call::Join { thread: *u as u32 }, w),
            Blocked::Launch(ops, grouped, w) => (
                Call::Launch {
                    ops: ops.clone(),
                    grouped: *grouped,
                },
                w,
            ),
        };
        TraceCall {
            thread: thread as u32,
            call,
            text: text.as_str().into(),
            place: place.as_str().into(),
        }
    }
}

/// A kind of launch's text, place and ops, shared by every launch of
/// that kind.
type LaunchText = (Arc<str>, Arc<str>, Arc<[OpRec]>);

/// What a rank's issue path touches (the registry's first lock): the
/// trace, the issue check, and the texts of the kinds of launch seen.
#[derive(Debug)]
struct Reg {
    trace: Trace,
    /// R3 and R8 at issue, kept up to date with every launch recorded
    /// (the model's own rule, without the rest of the machine: see
    /// [`IssueMatch`]).
    matcher: IssueMatch,
    /// The text, place and ops of each kind of launch (thread, call site,
    /// ops), so that a launch like an earlier one formats and allocates
    /// nothing: keyed by
    /// [`launch_key`]'s words; cleared when it grows large.
    launches: rustc_hash::FxHashMap<Vec<u64>, LaunchText>,
    /// The key of the launch being recorded (reused).
    key: Vec<u64>,
    /// The user communicators by number (`None`: a number whose call
    /// has not reached here yet, on any rank).
    user_comms: Vec<Option<(String, Vec<Rank>)>>,
    /// The live machine as it was when the trace was last compacted: it
    /// stands for every call made before the trace's (see
    /// [`Registry::local`]).
    base: Option<Machine>,
    /// Calls folded into `base` so far: `trace.calls[0]` is call number
    /// `folded`.
    folded: usize,
    /// Calls the live machine has applied (the others wait in the trace).
    applied: usize,
}

impl Reg {
    /// Notes that the live machine has applied the calls up to number
    /// `applied`, and folds them into `base` when it is given.
    fn advance(&mut self, applied: usize, base: Option<Machine>) {
        self.applied = applied;
        if let Some(base) = base {
            self.trace.calls.drain(..applied - self.folded);
            self.folded = applied;
            self.base = Some(base);
        }
    }
}

/// The live machine (the registry's second lock): it applies the calls
/// the trace records, later and in order ([`Registry::settle`]).
#[derive(Debug)]
struct Live {
    /// `None` once the model refused a call (the trace keeps everything;
    /// its replay reports the refusal).
    machine: Option<Machine>,
    /// What the model refused when it was dropped, in words, for a run
    /// that ends well and so has no hang report to say it
    /// ([`Registry::refused`]).
    refused: Option<String>,
    /// The live machine's origins, one per distinct call text and place, so
    /// that a long run does not grow them.
    origins: std::collections::HashMap<(Arc<str>, Arc<str>), duplex::machine::Origin>,
}

impl Live {
    /// `call` as the live machine's call, at its interned origin.
    fn host_call(&mut self, call: &TraceCall) -> Option<duplex::machine::HostCall> {
        let m = self.machine.as_mut()?;
        let key = (call.text.clone(), call.place.clone());
        let origin = match self.origins.get(&key) {
            Some(o) => *o,
            None => {
                let o = m.setup_mut().add_origin(duplex::machine::OriginInfo::at(
                    call.text.clone(),
                    call.place.to_string(),
                ));
                self.origins.insert(key, o);
                o
            }
        };
        Some(call.to_host_at(m.setup_mut(), origin))
    }

    /// The program error the live machine finds in launch `call` if it
    /// were made now (after the calling thread finishes any handshake the
    /// model lets it finish): `None` when it finds none, has no machine,
    /// or the thread cannot make the call now.
    fn judge(&mut self, call: &TraceCall) -> Option<duplex::machine::ProgramError> {
        let hc = self.host_call(call)?;
        let m = self.machine.as_mut()?;
        let t = ThreadId(call.thread);
        if !ready(m, t, &hc) {
            return None;
        }
        m.check_issue(t, &hc).err()
    }

    /// Applies `calls` in order. A panic of the model (a bug in it) drops
    /// the live machine rather than the thread that settles it (a
    /// watchdog), and the calls count as applied: none is applied twice.
    fn apply_all(&mut self, calls: &[TraceCall]) {
        let applied = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for call in calls {
                self.apply(call);
            }
        }));
        if applied.is_err() {
            tracing::error!("the live model panicked while applying calls: it is dropped");
            self.machine = None;
            self.refused
                .get_or_insert_with(|| "the model panicked while applying the run's calls".into());
        }
    }

    /// Applies `call`, made by the trace's thread `call.thread`: the
    /// calling thread first finishes any handshake the model lets it
    /// finish. A call the model refuses (the thread cannot make it now, or
    /// it fails its check) drops the live machine, and the trace's replay
    /// reports the disagreement.
    fn apply(&mut self, call: &TraceCall) {
        let Some(hc) = self.host_call(call) else {
            return;
        };
        let Some(m) = self.machine.as_mut() else {
            return;
        };
        let t = ThreadId(call.thread);
        let refused = if ready(m, t, &hc) {
            m.apply(t, &hc)
                .err()
                .map(|e| format!("it finds a program error: {e}"))
        } else {
            Some("the thread cannot make it there".to_string())
        };
        if let Some(why) = refused {
            // The trace's replay reports why, in a hang's or an error's
            // report; said here too, since a run that ends well has none.
            tracing::warn!(
                call = %call.text,
                place = %call.place,
                "duplex: the live model refused a call the GPU run made (a disagreement between the model and NCCL; please report it): the model is dropped"
            );
            self.machine = None;
            self.refused = Some(format!(
                "the model refused `{}` ({}) of thread {}: {why}",
                call.text, call.place, call.thread
            ));
        }
    }
}

/// Whether thread `t` can make `call` now in `m`, once every handshake
/// the model lets finish has finished ([`Machine::resume_all`], as the
/// trace's replay does), not only the calling thread's: a thread whose
/// handshake the peer completed has returned from NCCL before another
/// thread's call on that communicator could be made (R11), and the model,
/// seeing it still inside its call, held the other's back and the live
/// machine was dropped for a valid program (found by review).
fn ready(m: &mut Machine, t: ThreadId, call: &duplex::machine::HostCall) -> bool {
    loop {
        match m.resume_all() {
            (_, Some(_)) => return false,
            (true, None) => {}
            (false, None) => return m.enabled(t, call),
        }
    }
}

/// The error of a launch the issue check refuses, from the check alone:
/// op `i` disagrees with the partner issued at its position.
fn issue_error(
    matcher: &IssueMatch,
    rank: Rank,
    ops: &[OpSpec],
    i: usize,
    grouped: bool,
    call: &TraceCall,
) -> Error {
    let position = matcher.positions(rank, ops, grouped)[i];
    let op = &ops[i];
    let Some(partner) = position.partner else {
        return Error::Aborted(format!("the issue check refused `{}`", call.text));
    };
    let kind =
        duplex::machine::issue::mismatch_kind((partner.bytes, partner.dtype), (op.bytes, op.dtype));
    let what = match kind {
        duplex::ProgramErrorKind::SizeMismatch => format!(
            "size mismatch (R3): {} bytes against {}",
            op.bytes, partner.bytes
        ),
        duplex::ProgramErrorKind::TypeMismatch => {
            format!("type mismatch (R3): {} against {}", op.dtype, partner.dtype)
        }
        _ => {
            let g = |g: bool| if g { "grouped" } else { "not grouped" };
            format!(
                "group mismatch (R8): {} against {}",
                g(grouped),
                g(partner.grouped)
            )
        }
    };
    Error::Program {
        kind,
        message: format!(
            "{what}: rank {rank}'s `{}` ({}) {} {} rank {} meets, as message #{} of its channel, the {} issued there",
            call.text,
            call.place,
            op.dir.name(),
            if op.dir == duplex::Dir::Send {
                "to"
            } else {
                "from"
            },
            op.peer,
            position.fifo,
            op.dir.other().name()
        ),
        ops: Vec::new(),
    }
}

/// The words that tell one kind of launch from another in the registry's
/// launch cache: the thread, whether grouped, the first op's call site, and
/// every field of each op (direction, type, peer, communicator, stream,
/// bytes), since the cache gives the ops as well as the text.
fn launch_key(key: &mut Vec<u64>, thread: usize, metas: &[&OpMeta], ops: &[OpRec], grouped: bool) {
    key.clear();
    key.extend([thread as u64, u64::from(grouped)]);
    if let Some(m) = metas.first() {
        key.push(std::ptr::from_ref(m.at) as usize as u64);
        // The site's text (a schedule's `line N`), hashed: two sites whose
        // hashes collide would share a place text in reports, nothing else.
        let site = m.site.as_deref().map_or(0, |s| {
            use std::hash::{Hash, Hasher};
            let mut h = rustc_hash::FxHasher::default();
            s.hash(&mut h);
            h.finish() | 1
        });
        key.push(site);
    }
    // The description's count is the ops' bytes over the type's size.
    for o in ops {
        key.extend([
            (o.dir as u64) | ((o.dtype as u64) << 8) | (u64::from(o.peer) << 32),
            u64::from(o.comm) | (u64::from(o.stream) << 32),
            o.bytes,
        ]);
    }
}

/// A launch's text in reports: its ops' texts, in `group { … }` when it
/// is a group.
pub(crate) fn launch_text<'a>(
    metas: impl IntoIterator<Item = &'a OpMeta>,
    grouped: bool,
) -> String {
    let texts: Vec<String> = metas.into_iter().map(|m| m.text()).collect();
    if grouped {
        format!("group {{ {} }}", texts.join("; "))
    } else {
        texts.join("; ")
    }
}

/// A launch as a rank reports it to the registry.
#[derive(Debug)]
pub(crate) struct LaunchRec<'a> {
    /// The registry's number of the issuing thread.
    pub(crate) thread: usize,
    /// Its ops.
    pub(crate) ops: &'a [OpRec],
    /// Their descriptions.
    pub(crate) metas: &'a [&'a OpMeta],
    /// Where the registry writes their FIFO positions.
    pub(crate) fifos: &'a mut [u64],
    /// Issued as a group.
    pub(crate) grouped: bool,
}

/// The registry of one local run.
///
/// Two locks: the issue path takes the first (`inner`: the trace and the
/// issue check) and never the second; the live machine (`live`) applies
/// the recorded calls later, in order, on whichever thread settles it (a
/// rank's watchdog, every tick; anything that reads it). A thread that
/// needs both takes `live` first.
#[derive(Debug)]
pub struct Registry {
    /// This run's number, unique in the process: the streams, events,
    /// buffers and threads a run makes carry it, so that one kept from
    /// another run (in a static, say) is refused, not taken for this
    /// run's of the same number ([`Registry::run`]).
    run: u64,
    model: Model,
    inner: Mutex<Reg>,
    live: Mutex<Live>,
    /// Compact the trace once it holds this many applied calls
    /// ([`Registry::local`]); `usize::MAX` keeps it whole.
    compact_at: usize,
    /// Cut the trace where the rank is quiet once it holds this many
    /// calls ([`Registry::for_rank`], [`Registry::cut_if_long`]);
    /// `usize::MAX` never.
    cut_at: usize,
    /// The one rank it records ([`Registry::for_rank`]); `None` when every
    /// rank records here.
    only: Option<Rank>,
}

/// How many calls a local run's trace holds before it is folded into a
/// snapshot of the live machine (about 10 MiB of calls).
const COMPACT_AT: usize = 1 << 16;

/// How many calls a process's trace holds before it is cut where its rank
/// is quiet (when a `synchronize` returns with nothing of the rank in
/// flight): a trace of this many grouped exchanges encodes to about 1 MiB,
/// well under what the store takes in one value (`store::proto::MAX_VALUE`),
/// so a rank can always publish it.
pub const CUT_AT: usize = 1 << 12;

/// A hang's analysis: the model's explanation, and the calls it refused.
#[derive(Clone, Debug)]
pub struct HangAnalysis {
    /// The stuck state, when the model finds one.
    pub stuck: Option<Stuck>,
    /// Calls the model refused while replaying.
    pub disagreements: Vec<Disagreement>,
    /// Why the other ranks' traces could not be joined with this one's,
    /// when they could not: the analysis then replayed this rank's own
    /// calls alone.
    pub unjoined: Option<String>,
    /// Connections the replay set up from mismatched calls (R7,
    /// `duplex::machine::Mismatch`), in words: what explains an NCCL error
    /// or a crash after them.
    pub mismatched_setups: Vec<String>,
    /// The first program error the replay met (`duplex::trace::Analysis::
    /// program_error`): what explains NCCL's own error for a size or type
    /// mismatch that no rank could see before launching (across processes).
    pub program_error: Option<duplex::machine::ProgramError>,
}

impl Registry {
    /// This run's number ([`Registry`]'s `run`).
    pub fn run(&self) -> u64 {
        self.run
    }

    /// A registry for `ranks` ranks whose hangs are analysed under `model`.
    pub fn new(ranks: u32, model: Model) -> Arc<Registry> {
        Registry::with_compaction(ranks, model, usize::MAX)
    }

    /// The registry of one process of a process-per-rank run, which
    /// records its rank `rank`'s calls alone: its trace is joined with the
    /// other ranks' for a hang's analysis, so it is not folded into a
    /// snapshot of a machine; it is cut instead, where the rank is quiet
    /// (when a `synchronize` returns with nothing in flight, [`Trace::cut`]),
    /// so that a long run's memory, and what it publishes, stay bounded;
    /// and the issue check keeps no op whose partner another process issues.
    pub fn for_rank(ranks: u32, model: Model, rank: Rank) -> Arc<Registry> {
        Registry::build(ranks, model, usize::MAX, CUT_AT, Some(rank))
    }

    /// A registry for a run whose ranks all record here (`Local`): its
    /// trace is folded into a snapshot of the live machine every
    /// 65,536 calls, so that a long run's memory does not grow with
    /// the calls it makes; the hang analysis replays the calls since from
    /// that snapshot ([`Trace::analyze_from`]). A process-per-rank run
    /// keeps its trace whole ([`Registry::new`]): the ranks' traces are
    /// joined for the analysis, and a snapshot of one rank's machine cannot
    /// be joined.
    pub fn local(ranks: u32, model: Model) -> Arc<Registry> {
        Registry::with_compaction(ranks, model, COMPACT_AT)
    }

    fn with_compaction(ranks: u32, model: Model, compact_at: usize) -> Arc<Registry> {
        Registry::build(ranks, model, compact_at, usize::MAX, None)
    }

    fn build(
        ranks: u32,
        model: Model,
        compact_at: usize,
        cut_at: usize,
        only: Option<Rank>,
    ) -> Arc<Registry> {
        static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Arc::new(Registry {
            run: RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            model,
            inner: Mutex::new(Reg {
                trace: Trace {
                    // `Handshakes::holds` (ctx.rs): a stream or copy lane
                    // shared with a launch in its handshake holds too.
                    held_for_streams: true,
                    ..Trace::new(ranks)
                },
                matcher: match only {
                    Some(rank) => IssueMatch::one_rank(model.one_sided_groups, rank),
                    None => IssueMatch::new(model.one_sided_groups),
                },
                launches: rustc_hash::FxHashMap::default(),
                key: Vec::new(),
                user_comms: Vec::new(),
                base: None,
                folded: 0,
                applied: 0,
            }),
            live: Mutex::new(Live {
                machine: Some(Machine::new(Arc::new(Setup::new(ranks, model)))),
                refused: None,
                origins: std::collections::HashMap::new(),
            }),
            compact_at,
            cut_at,
            only,
        })
    }

    /// Whether the trace holds enough calls to be cut
    /// ([`Registry::cut_if_long`]): a cheap look, for the caller to decide
    /// whether to find out if its rank is quiet.
    pub(crate) fn long(&self) -> bool {
        self.cut_at != usize::MAX && self.lock().trace.calls.len() >= self.cut_at
    }

    /// Cuts the trace ([`Trace::cut`]) when it is long and no thread is
    /// blocked in a wait: every call recorded so far is folded into the
    /// counts a replay starts from. The caller must know that every op
    /// recorded so far has completed and that no launch is under way
    /// (`RankCtx::cut_if_quiet` holds the issue lock and finds the ledger
    /// empty). Returns how many calls were folded.
    pub(crate) fn cut_if_long(&self) -> usize {
        if self.cut_at == usize::MAX {
            return 0;
        }
        let mut live = self.lock_live();
        let mut r = self.lock();
        if r.trace.calls.len() < self.cut_at || !r.trace.blocked.is_empty() {
            return 0;
        }
        // The live machine applies every call before it goes: the calls
        // left (the threads' ends) are applied ones.
        self.settle_held(&mut live, &mut r);
        let n = r.trace.calls.len();
        let folded = r.trace.cut(n);
        r.folded = r.applied - r.trace.calls.len();
        folded
    }

    /// Calls folded into the snapshot of a compacted trace so far.
    pub fn folded(&self) -> usize {
        self.lock().folded
    }

    /// Calls recorded so far (folded ones included).
    pub fn calls(&self) -> usize {
        let r = self.lock();
        r.folded + r.trace.calls.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Reg> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_live(&self) -> std::sync::MutexGuard<'_, Live> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The call of this run the live model refused, in words, if it
    /// refused one (the calls recorded so far applied first): a
    /// disagreement between the model and the run, which a run that ends
    /// well reports with its [`RankReport`](crate::RankReport)s (a hang's
    /// or an error's report says it through the trace's replay).
    pub fn refused(&self) -> Option<String> {
        let mut live = self.lock_live();
        self.settle_locked(&mut live);
        live.refused.clone()
    }

    /// Applies the calls recorded and not yet applied to the live machine,
    /// in order, and folds the trace into a snapshot once it is long
    /// ([`Registry::local`]). The calls are copied out under the first
    /// lock and applied under the second alone, so the issue path waits
    /// only for the copy.
    pub fn settle(&self) {
        let mut live = self.lock_live();
        self.settle_locked(&mut live);
    }

    /// [`Registry::settle`] unless another thread is settling (a watchdog's
    /// tick: the other thread does the work).
    pub(crate) fn settle_now_and_then(&self) {
        let mut live = match self.live.try_lock() {
            Ok(live) => live,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        self.settle_locked(&mut live);
    }

    fn settle_locked(&self, live: &mut Live) {
        let (batch, start, folded) = {
            let r = self.lock();
            let from = r.applied - r.folded;
            (r.trace.calls[from..].to_vec(), r.applied, r.folded)
        };
        if batch.is_empty() {
            return;
        }
        live.apply_all(&batch);
        let applied = start + batch.len();
        // `folded` changes only under the live lock, held here: the
        // snapshot is taken without blocking the issue path.
        let base = self.snapshot(live, applied - folded);
        self.lock().advance(applied, base);
    }

    /// [`Registry::settle`] with both locks held: the issue path waits
    /// meanwhile (the slow path of a disagreement).
    fn settle_held(&self, live: &mut Live, r: &mut Reg) {
        let from = r.applied - r.folded;
        live.apply_all(&r.trace.calls[from..]);
        let applied = r.folded + r.trace.calls.len();
        let base = self.snapshot(live, applied - r.folded);
        r.advance(applied, base);
    }

    /// A snapshot of the live machine to fold the trace into, once
    /// `unfolded` applied calls make the trace long ([`Registry::local`]);
    /// none after a refused call, which keeps the trace whole for its
    /// replay to report the refusal.
    fn snapshot(&self, live: &Live, unfolded: usize) -> Option<Machine> {
        (unfolded >= self.compact_at)
            .then(|| live.machine.clone())
            .flatten()
    }

    /// Declares communicator `logical` (every rank declares the same ones);
    /// `warm` when it was connected at creation, so that R6 and R7 never
    /// apply to it.
    pub fn comm(&self, logical: u32, name: &str, members: &[Rank], warm: bool) {
        self.declare_comm(logical, name, members, warm, false);
    }

    /// Declares copy-engine lane `logical` (`copy:a->b`, C1–C6 of
    /// `docs/semantics.md`): always connected, and its ops match whatever
    /// their grouping.
    pub fn copy_lane(&self, logical: u32, name: &str, members: &[Rank]) {
        self.declare_comm(logical, name, members, true, true);
    }

    fn declare_comm(&self, logical: u32, name: &str, members: &[Rank], warm: bool, copy: bool) {
        let mut live = self.lock_live();
        self.settle_locked(&mut live);
        let mut r = self.lock();
        let i = logical as usize;
        while r.trace.comms.len() <= i {
            r.trace.add_comm("", &[], true);
        }
        r.trace.comms[i] = duplex::trace::TraceComm {
            name: name.to_string(),
            members: members.to_vec(),
            warm,
            copy,
        };
        if copy {
            r.matcher.copy_lane(duplex::machine::CommId(logical));
        }
        let comms = r.trace.comms.len();
        if let Some(m) = live.machine.as_mut() {
            let setup = m.setup_mut();
            while setup.comms.len() < comms {
                setup.add_comm("", Vec::new(), true);
            }
            let c = &mut setup.comms[i];
            c.name = name.to_string();
            c.members = members.to_vec();
            c.warm = warm;
            c.copy = copy;
        }
    }

    /// The end of a local run in which every rank finished cleanly (every
    /// op complete): the `never-received` error of the first send that no
    /// recv took, if any. NCCL completes a send into its channel's buffer
    /// (R5) without its recv; once every rank has finished nothing will
    /// ever take those bytes, and a run that returned `Ok` would report a
    /// transfer that reached no one. The simulator ends such a run with
    /// the same error (the machine's `leftover`). Counted from what was
    /// issued (by the issue check, which sees every rank here), not from
    /// the model's waits, so that it holds whatever the model says of
    /// them. For a registry of one rank, see [`Registry::unreceived_with`].
    pub fn unreceived_at_end(&self) -> Option<Error> {
        let r = self.lock();
        let all = r.matcher.unreceived();
        let &((comm, from, to), fifo, count, sig) = all.first()?;
        let op = r
            .trace
            .last_sends(comm.0, from, to, u64::from(count), fifo)
            .unwrap_or_else(|| OpInfo {
                grouped: sig.grouped,
                ..r.trace.folded_send(
                    comm.0,
                    from,
                    to,
                    Some((sig.bytes, sig.dtype)),
                    fifo,
                    "(a call folded into the trace's snapshot)",
                )
            });
        Some(never_received(op, u64::from(count), all.len() - 1, ""))
    }

    /// What this registry's rank issued on each channel
    /// ([`Trace::channel_counts`]): what it posts as it finishes, for the
    /// end checks of the ranks that sent to it.
    pub fn channel_counts(&self) -> Vec<ChannelCount> {
        self.lock().trace.channel_counts()
    }

    /// What was issued on the channel from `from` to `to` on communicator
    /// `comm` (sends by `from`, recvs by `to`), for the registry of every
    /// rank (a local run): from its issue check, which counts every op
    /// however long the run, where [`Registry::channel_counts`] sees only
    /// the calls the trace still holds once the live model has compacted
    /// it. `None` for the registry of one rank, which sees one side.
    pub fn issued_on(&self, comm: u32, from: Rank, to: Rank) -> Option<ChannelCount> {
        if self.only.is_some() {
            return None;
        }
        let (sent, received) = self
            .lock()
            .matcher
            .issued(duplex::machine::CommId(comm), from, to);
        Some(ChannelCount {
            comm,
            from,
            to,
            sent,
            received,
        })
    }

    /// The peers this registry's rank sent to, from its counts `mine`
    /// ([`Registry::channel_counts`]), for its end check
    /// ([`Registry::unreceived_with`]).
    pub fn sent_to(&self, mine: &[ChannelCount]) -> Vec<Rank> {
        let me = self.only;
        let mut peers: Vec<Rank> = mine
            .iter()
            .filter(|c| c.sent > 0 && Some(c.from) == me && c.to != c.from)
            .map(|c| c.to)
            .collect();
        peers.sort_unstable();
        peers.dedup();
        peers
    }

    /// [`Registry::unreceived_at_end`] for the registry of one rank of a
    /// process-per-rank job ([`Registry::for_rank`]), the sender's side:
    /// its sends, from its counts `mine` ([`Registry::channel_counts`]),
    /// against the recvs each peer it sent to issued, from the counts that
    /// peer posted as it finished (`peers`). It names only this rank's
    /// sends, and judges only the channels to peers in `peers` (and to
    /// itself, from its own calls): a peer still running when the sender's
    /// wait ran out judges the rest as it finishes
    /// ([`Registry::unreceived_from`]).
    pub fn unreceived_with(
        &self,
        mine: &[ChannelCount],
        peers: &std::collections::BTreeMap<Rank, Vec<ChannelCount>>,
    ) -> Option<Error> {
        let Some(me) = self.only else {
            return self.unreceived_at_end();
        };
        let mut short = Vec::new();
        for c in mine.iter().filter(|c| c.from == me && c.sent > 0) {
            let received = if c.to == me {
                c.received
            } else {
                let Some(theirs) = peers.get(&c.to) else {
                    continue;
                };
                received_of(theirs, c)
            };
            if c.sent > received {
                short.push((*c, received));
            }
        }
        let &(first, received) = short.first()?;
        let count = first.sent - received;
        let op = unreceived_op(&self.lock().trace, first, count, received);
        Some(never_received(op, count, short.len() - 1, ""))
    }

    /// The receiver's side of [`Registry::unreceived_with`]: the sends that
    /// ranks which finished before this one left for it to judge (`owed`,
    /// [`crate::health::Health::post_owed`], each sender's counts on its
    /// channels to this rank), against the recvs this rank issued, from its
    /// counts `mine`. The `never-received` error of the first that no recv
    /// of this rank took, named from the sender's published trace when
    /// there is one, else from the counts. Whichever rank of a pair
    /// finishes second judges: the sender when the receiver finished
    /// within its wait, else the receiver.
    pub fn unreceived_from(
        &self,
        mine: &[ChannelCount],
        owed: &std::collections::BTreeMap<Rank, crate::health::Owed>,
    ) -> Option<Error> {
        let me = self.only?;
        let mut short = Vec::new();
        for (from, o) in owed {
            for c in o
                .counts
                .iter()
                .filter(|c| c.from == *from && c.to == me && c.sent > 0)
            {
                let received = received_of(mine, c);
                if c.sent > received {
                    short.push((*c, received, o));
                }
            }
        }
        let &(first, received, o) = short.first()?;
        let count = first.sent - received;
        let op = match &o.trace {
            Some(t) => unreceived_op(t, first, count, received),
            None => self.lock().trace.folded_send(
                first.comm,
                first.from,
                me,
                None,
                received,
                "(a call of a rank that finished first: it left its counts, not its calls)",
            ),
        };
        let judged = format!(
            " (rank {} finished first and left its sends for this rank, their receiver, to judge)",
            first.from
        );
        Some(never_received(op, count, short.len() - 1, &judged))
    }

    /// Sends or recvs that no op of the other side matched: at the end of
    /// a run that otherwise completed, a send that completed into the
    /// channel's buffer (R5) and that nobody received.
    pub fn unmatched(&self) -> Vec<OpInfo> {
        let mut live = self.lock_live();
        self.settle_locked(&mut live);
        match &live.machine {
            Some(m) => m.unmatched(),
            None => Vec::new(),
        }
    }

    /// Checks that the `k`-th user communicator is the same on every rank.
    pub fn user_comm(&self, k: usize, name: &str, members: &[Rank]) -> Result<(), String> {
        let mut r = self.lock();
        // Two threads of a rank may get their numbers in one order and
        // arrive here in the other: each is kept at its number.
        if r.user_comms.len() <= k {
            r.user_comms.resize(k + 1, None);
        }
        match &r.user_comms[k] {
            Some((n, m)) if n == name && m == members => Ok(()),
            Some((n, m)) => Err(format!(
                "communicator #{k} is `{name}` over {members:?} here but `{n}` over {m:?} on another rank: every rank must create communicators in the same order"
            )),
            None => {
                r.user_comms[k] = Some((name.to_string(), members.to_vec()));
                Ok(())
            }
        }
    }

    /// Adds to the setup of the live machine and of the trace at once,
    /// after the calls recorded so far are applied.
    fn declare<T>(
        &self,
        live_setup: impl FnOnce(&mut Machine),
        trace: impl FnOnce(&mut Trace) -> T,
    ) -> T {
        let mut live = self.lock_live();
        self.settle_locked(&mut live);
        if let Some(m) = live.machine.as_mut() {
            live_setup(m);
            m.sync_setup();
        }
        trace(&mut self.lock().trace)
    }

    /// Registers a stream; returns its number.
    pub fn stream(&self, rank: Rank, name: &str) -> u32 {
        self.declare(
            |m| {
                m.setup_mut().add_stream(rank, name);
            },
            |t| t.add_stream(rank, name),
        )
    }

    /// Registers an event; returns its number.
    pub fn event(&self, rank: Rank) -> u32 {
        self.declare(
            |m| {
                m.setup_mut().add_event(rank, "event");
            },
            |t| t.add_event(rank, "event"),
        )
    }

    /// Registers a host thread; returns its number.
    pub fn thread(&self, rank: Rank, name: &str) -> usize {
        self.declare(
            |m| {
                m.setup_mut().add_thread(rank, name);
            },
            |t| t.add_thread(rank, name) as usize,
        )
    }

    /// Records a launch. The issue check refuses it first when an op
    /// disagrees with the partner issued at its position on its channel
    /// (R3 size and type, R8 grouping); then the live machine, brought up
    /// to date, names both ops ([`Machine::check_issue`]); nothing is
    /// recorded when it fails. The FIFO positions go to `l.fifos`.
    pub(crate) fn launch(&self, l: LaunchRec<'_>) -> Result<(), Error> {
        let LaunchRec {
            thread,
            ops,
            metas,
            fifos,
            grouped,
        } = l;
        let mut r = self.lock();
        let mut key = std::mem::take(&mut r.key);
        launch_key(&mut key, thread, metas, ops, grouped);
        let (text, place, ops) = match r.launches.get(key.as_slice()) {
            Some((text, place, ops)) => (text.clone(), place.clone(), ops.clone()),
            None => {
                let text = launch_text(metas.iter().copied(), grouped);
                let place = metas.first().map(|m| m.place()).unwrap_or_default();
                if r.launches.len() >= 1 << 12 {
                    r.launches.clear();
                }
                let (text, place, ops): LaunchText = (text.into(), place.into(), ops.into());
                r.launches
                    .insert(key.clone(), (text.clone(), place.clone(), ops.clone()));
                (text, place, ops)
            }
        };
        r.key = key;
        let call = TraceCall {
            thread: thread as u32,
            call: Call::Launch { ops, grouped },
            text,
            place,
        };
        // A group's launch is named by the group's line; the op at fault
        // is named by its own too (found by review: in a group of several
        // sends, the report named none of their lines).
        let own = |i: usize| {
            metas
                .get(i)
                .filter(|_| metas.len() > 1)
                .map(|m| format!("`{}` at {}", m.text(), m.place()))
        };
        self.record_launch(r, call, fifos, &own)
    }

    /// The issue path's end: check `call` with the issue check, and when
    /// it finds a disagreement, let the live machine name it; else record
    /// the call and its FIFO positions.
    fn record_launch<'s>(
        &'s self,
        mut r: std::sync::MutexGuard<'s, Reg>,
        call: TraceCall,
        fifos: &mut [u64],
        own: &dyn Fn(usize) -> Option<String>,
    ) -> Result<(), Error> {
        let Call::Launch { ops, grouped } = &call.call else {
            return Ok(());
        };
        let rank = r
            .trace
            .threads
            .get(call.thread as usize)
            .map_or(0, |t| t.rank);
        let specs: smallvec::SmallVec<[OpSpec; 4]> = ops.iter().map(OpRec::spec).collect();
        let is_group = duplex::machine::is_group(*grouped, ops.len());
        let (mut bad, mut positions) = r.matcher.check(rank, &specs, is_group);
        if bad.is_some() {
            // Refused. The live machine names both ops when it can judge
            // the call: bring it up to date (the live lock first, then
            // both held, so that nothing is recorded meanwhile and the
            // machine sees what the check sees), and check again.
            drop(r);
            let mut live = self.lock_live();
            r = self.lock();
            self.settle_held(&mut live, &mut r);
            (bad, positions) = r.matcher.check(rank, &specs, is_group);
            if let Some(i) = bad {
                let e = match live.judge(&call) {
                    Some(e) => Error::from(e),
                    // The machine is gone (it refused an earlier call: the
                    // hang analysis reports that) or cannot judge: the
                    // check's own positions are NCCL's call order.
                    None => issue_error(&r.matcher, rank, &specs, i, is_group, &call),
                };
                let at_fault = own(i)
                    .map(|o| format!("; the op of the group at fault is {o}"))
                    .unwrap_or_default();
                return Err(match e {
                    Error::Program { kind, message, ops } => Error::Program {
                        kind,
                        message: format!(
                            "{message}{at_fault}; duplex refused to launch it, since NCCL's behaviour is undefined"
                        ),
                        ops,
                    },
                    other => other,
                });
            }
        }
        for (slot, fifo) in fifos.iter_mut().zip(positions) {
            *slot = fifo;
        }
        r.matcher.issue(rank, &specs, is_group);
        r.trace.push(call);
        Ok(())
    }

    /// [`Registry::record_launch`] for tests that record calls without
    /// `OpMeta`s.
    #[cfg(test)]
    fn issue(&self, call: TraceCall, fifos: &mut [u64]) -> Result<(), Error> {
        let r = self.lock();
        let result = self.record_launch(r, call, fifos, &|_| None);
        self.settle();
        result
    }

    /// Records a `record` or `wait` of an event on a stream.
    pub fn event_call(&self, thread: usize, record: bool, event: u32, stream: u32) {
        let call = if record {
            Call::Record { event, stream }
        } else {
            Call::Wait { event, stream }
        };
        self.lock().trace.push(TraceCall {
            thread: thread as u32,
            call,
            text: if record { "record" } else { "wait" }.into(),
            place: "".into(),
        });
    }

    /// Marks a thread's code as returned: it issues nothing more, so a
    /// hang's report can say that a partner will never come.
    pub fn ended(&self, thread: usize) {
        self.lock().trace.end(thread as u32);
    }

    /// Marks a thread blocked (or not).
    pub fn blocked(&self, thread: usize, what: Option<Blocked>) {
        let call = what.map(|b| b.trace_call(thread));
        self.lock().trace.block(thread as u32, call);
    }

    /// Marks a thread blocked in one call that the model expresses as
    /// several waits, in order (a split's `await` of each other rank).
    pub fn blocked_in(&self, thread: usize, waits: &[Blocked]) {
        let calls = waits.iter().map(|b| b.trace_call(thread)).collect();
        self.lock().trace.block_in(thread as u32, calls);
    }

    /// Records a host message sent (a split's arrival,
    /// `duplex::transport::check::split_tag`):
    /// `text` and `place` say where.
    pub fn notify_call(&self, thread: usize, to: Rank, tag: &str, text: &str, place: &str) {
        self.lock().trace.push(TraceCall {
            thread: thread as u32,
            call: Call::Notify {
                to,
                tag: tag.to_string(),
            },
            text: text.into(),
            place: place.into(),
        });
    }

    /// What every rank issued so far.
    pub fn trace(&self) -> Trace {
        self.lock().trace.clone()
    }

    /// Replays what every rank issued through the state machine and
    /// explains the stuck state, if the model finds one; lists every call
    /// the model refused.
    pub fn analyze(&self) -> HangAnalysis {
        self.analyze_with(Vec::new())
    }

    /// [`Registry::analyze`] over this registry's trace joined with the
    /// traces of ranks recorded elsewhere (other processes of the job).
    pub fn analyze_with(&self, others: Vec<Trace>) -> HangAnalysis {
        let (mine, base) = {
            let r = self.lock();
            (r.trace.clone(), r.base.clone())
        };
        if let Some(base) = base {
            // A compacted local trace: every rank is here, and the
            // snapshot stands for the calls folded into it.
            if !others.is_empty() {
                tracing::warn!("a compacted trace cannot be joined with other ranks' traces");
            }
            let Analysis {
                stuck,
                disagreements,
                mismatched_setups,
                program_error,
                ..
            } = mine.analyze_from(&base);
            return HangAnalysis {
                stuck,
                disagreements,
                unjoined: (!others.is_empty())
                    .then(|| "this rank's trace was compacted into a snapshot".to_string()),
                mismatched_setups,
                program_error,
            };
        }
        let mut unjoined = None;
        let trace = if others.is_empty() {
            mine
        } else {
            let mut parts = vec![mine];
            parts.extend(others);
            match Trace::merge(&parts) {
                Ok(t) => t,
                Err(why) => {
                    tracing::warn!("the ranks' traces do not join: {why}");
                    unjoined = Some(why);
                    parts.swap_remove(0)
                }
            }
        };
        let Analysis {
            stuck,
            disagreements,
            mismatched_setups,
            program_error,
            ..
        } = trace.analyze(self.model);
        HangAnalysis {
            stuck,
            disagreements,
            unjoined,
            mismatched_setups,
            program_error,
        }
    }
}

/// The recvs the receiver issued on `c`'s channel, from its counts
/// `theirs` ([`Trace::channel_counts`]).
fn received_of(theirs: &[ChannelCount], c: &ChannelCount) -> u64 {
    theirs
        .iter()
        .find(|t| (t.comm, t.from, t.to) == (c.comm, c.from, c.to))
        .map_or(0, |t| t.received)
}

/// The first of the `count` last sends on `first`'s channel, which no recv
/// took (`received` recvs took those before), from the sender's `trace`:
/// its call, or when a long run's cut folded it, described from the counts
/// with its size from the cut's last sizes when it is among them. Known
/// unreceived, it is reported all the same.
fn unreceived_op(trace: &Trace, first: ChannelCount, count: u64, received: u64) -> OpInfo {
    let (me, to) = (first.from, first.to);
    trace
        .last_sends(first.comm, me, to, count, received)
        .unwrap_or_else(|| {
            let after_cut = trace.sends_in_calls(first.comm, me, to);
            let bytes = trace
                .cuts
                .iter()
                .find(|c| c.rank == me)
                .and_then(|c| {
                    c.recent
                        .iter()
                        .find(|(k, p, _)| (*k, *p) == (first.comm, to))
                })
                .and_then(|(_, _, sizes)| {
                    let back = usize::try_from(count.checked_sub(after_cut)?).ok()?;
                    sizes
                        .len()
                        .checked_sub(back)
                        .and_then(|i| sizes.get(i))
                        .copied()
                });
            trace.folded_send(
                first.comm,
                me,
                to,
                bytes.map(|b| (b, duplex::DType::U8)),
                received,
                "(a call folded into the trace's cut: a long run keeps only its counts)",
            )
        })
}

/// The `never-received` error of `op`, the first of `count` sends on its
/// channel that no recv took, with `more` other channels like it
/// ([`Registry::unreceived_at_end`]), and `judged` (who judged it, when
/// that is not the sender) at its end.
fn never_received(op: OpInfo, count: u64, more: usize, judged: &str) -> Error {
    let e = Error::from(duplex::machine::ProgramError::NeverReceived { send: Box::new(op) });
    let Error::Program { kind, message, ops } = e else {
        return e;
    };
    let mut also = Vec::new();
    if count > 1 {
        also.push(format!("{} more after it on its channel", count - 1));
    }
    if more > 0 {
        also.push(format!("unreceived sends on {more} more channel(s)"));
    }
    let also = if also.is_empty() {
        String::new()
    } else {
        format!(" ({})", also.join("; "))
    };
    Error::Program {
        kind,
        message: format!(
            "{message}{also}: NCCL completed it into the channel's buffer (R5), and every rank finished without a recv for it, so its bytes reached no one{judged}"
        ),
        ops,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use duplex::trace::TraceOp;
    use duplex::{DType, Dir};

    /// A launch of one `u8` op by trace thread `t` on communicator `comm`.
    pub(crate) fn one_op(
        t: usize,
        dir: Dir,
        peer: u32,
        bytes: u64,
        comm: u32,
        stream: u32,
    ) -> TraceCall {
        TraceCall {
            thread: t as u32,
            call: Call::Launch {
                ops: Arc::new([TraceOp {
                    dir,
                    peer,
                    bytes,
                    dtype: DType::U8,
                    comm,
                    stream,
                }]),
                grouped: false,
            },
            text: format!("{} {bytes}", dir.name()).into(),
            place: "x.rs:1:1".into(),
        }
    }

    /// Records `call` through the issue path; its FIFO position, or the
    /// error's text.
    pub(crate) fn record(reg: &Registry, call: TraceCall) -> Result<u64, String> {
        let mut fifos = [u64::MAX];
        let r = reg.lock();
        reg.record_launch(r, call, &mut fifos, &|_| None)
            .map(|()| fifos[0])
            .map_err(|e| e.to_string())
    }

    /// The end of a local run: a send that no recv took is the
    /// `never-received` error naming it (its FIFO position after the
    /// messages received); once received, nothing.
    #[test]
    fn a_local_run_ends_with_never_received_for_a_send_nobody_took() {
        let reg = Registry::local(2, Model::default());
        reg.comm(0, "world", &[0, 1], true);
        let (s0, s1) = (reg.stream(0, "s"), reg.stream(1, "s"));
        let (t0, t1) = (reg.thread(0, "main"), reg.thread(1, "main"));
        record(&reg, one_op(t0, Dir::Send, 1, 4096, 0, s0)).expect("recorded");
        record(&reg, one_op(t1, Dir::Recv, 0, 4096, 0, s1)).expect("recorded");
        assert!(reg.unreceived_at_end().is_none());
        record(&reg, one_op(t0, Dir::Send, 1, 4096, 0, s0)).expect("recorded");
        record(&reg, one_op(t0, Dir::Send, 1, 4096, 0, s0)).expect("recorded");
        match reg.unreceived_at_end() {
            Some(Error::Program { kind, message, ops }) => {
                assert_eq!(kind, duplex::ProgramErrorKind::NeverReceived);
                assert_eq!(ops.len(), 1);
                assert_eq!((ops[0].rank, ops[0].peer, ops[0].fifo), (0, 1, 1));
                assert_eq!(ops[0].op, Dir::Send);
                assert!(message.contains("message never received"), "{message}");
                assert!(
                    message.contains("1 more after it on its channel"),
                    "{message}"
                );
                assert!(message.contains("reached no one"), "{message}");
            }
            other => panic!("expected never-received, got {other:?}"),
        }
        // A recv for each: nothing left.
        record(&reg, one_op(t1, Dir::Recv, 0, 4096, 0, s1)).expect("recorded");
        record(&reg, one_op(t1, Dir::Recv, 0, 4096, 0, s1)).expect("recorded");
        assert!(reg.unreceived_at_end().is_none());
    }

    /// Across processes each rank checks its own sends against the recv
    /// counts of the ranks it sent to, and leaves a channel whose receiver
    /// has not finished to that receiver, which judges it from the counts
    /// the sender left (naming the call from the sender's trace when it
    /// published one). A message to itself is checked from its own calls.
    #[test]
    fn a_rank_of_a_process_job_checks_its_sends_against_its_peers_counts() {
        let regs: Vec<Arc<Registry>> = (0..2)
            .map(|r| Registry::for_rank(2, Model::default(), r))
            .collect();
        let mut threads = Vec::new();
        for (r, reg) in regs.iter().enumerate() {
            reg.comm(0, "world", &[0, 1], true);
            let s = reg.stream(r as u32, "s");
            threads.push((reg.thread(r as u32, "main"), s));
        }
        let (t0, s0) = threads[0];
        let (t1, s1) = threads[1];
        for _ in 0..3 {
            record(&regs[0], one_op(t0, Dir::Send, 1, 4096, 0, s0)).expect("recorded");
        }
        record(&regs[1], one_op(t1, Dir::Recv, 0, 4096, 0, s1)).expect("recorded");
        assert_eq!(regs[0].sent_to(&regs[0].channel_counts()), vec![1]);
        assert!(regs[1].sent_to(&regs[1].channel_counts()).is_empty());
        let counts =
            |r: Rank| std::collections::BTreeMap::from([(r, regs[r as usize].channel_counts())]);
        // Rank 1 checks nothing of its own.
        assert!(
            regs[1]
                .unreceived_with(&regs[1].channel_counts(), &counts(0))
                .is_none()
        );
        let e = regs[0]
            .unreceived_with(&regs[0].channel_counts(), &counts(1))
            .expect("never-received");
        let Error::Program { ops, message, .. } = e else {
            panic!("{e}");
        };
        assert_eq!((ops[0].fifo, ops[0].op), (1, Dir::Send), "{message}");
        assert!(message.contains("1 more after it"), "{message}");
        // Without rank 1's counts the sender leaves that channel to it.
        assert!(
            regs[0]
                .unreceived_with(
                    &regs[0].channel_counts(),
                    &std::collections::BTreeMap::new()
                )
                .is_none()
        );
        // Rank 1 judges what rank 0 left for it: rank 0's counts toward it,
        // and its trace when it published one.
        let owed = |trace: bool| {
            std::collections::BTreeMap::from([(
                0,
                crate::health::Owed {
                    counts: regs[0]
                        .channel_counts()
                        .into_iter()
                        .filter(|c| c.to == 1)
                        .collect(),
                    trace: trace.then(|| regs[0].trace()),
                },
            )])
        };
        for with_trace in [true, false] {
            let e = regs[1]
                .unreceived_from(&regs[1].channel_counts(), &owed(with_trace))
                .expect("never-received");
            let Error::Program { ops, message, .. } = e else {
                panic!("{e}");
            };
            assert_eq!(
                (ops[0].rank, ops[0].peer, ops[0].fifo, ops[0].op),
                (0, 1, 1, Dir::Send),
                "{message}"
            );
            assert!(message.contains("1 more after it"), "{message}");
            assert!(message.contains("rank 0 finished first"), "{message}");
            assert_eq!(
                message.contains("left its counts, not its calls"),
                !with_trace,
                "{message}"
            );
        }
        // Rank 0 judges nothing of what others left for it.
        assert!(
            regs[0]
                .unreceived_from(&regs[0].channel_counts(), &owed(true))
                .is_none()
        );
        for _ in 0..2 {
            record(&regs[1], one_op(t1, Dir::Recv, 0, 4096, 0, s1)).expect("recorded");
        }
        assert!(
            regs[0]
                .unreceived_with(&regs[0].channel_counts(), &counts(1))
                .is_none()
        );
        assert!(
            regs[1]
                .unreceived_from(&regs[1].channel_counts(), &owed(true))
                .is_none()
        );
    }

    /// A send that no recv took, folded into the trace's cut by a long run
    /// (more than [`CUT_AT`] calls after it), is still reported: from the
    /// counts, with its size from the cut's last sizes.
    #[test]
    fn an_unreceived_send_folded_into_a_cut_is_still_reported() {
        let reg = Registry::for_rank(2, Model::default(), 0);
        reg.comm(0, "world", &[0, 1], true);
        let s = reg.stream(0, "s");
        let t = reg.thread(0, "main");
        record(&reg, one_op(t, Dir::Send, 1, 4096, 0, s)).expect("recorded");
        let pair = || TraceCall {
            thread: t as u32,
            call: Call::Launch {
                ops: Arc::new([
                    TraceOp {
                        dir: Dir::Send,
                        peer: 0,
                        bytes: 8,
                        dtype: DType::U8,
                        comm: 0,
                        stream: s,
                    },
                    TraceOp {
                        dir: Dir::Recv,
                        peer: 0,
                        bytes: 8,
                        dtype: DType::U8,
                        comm: 0,
                        stream: s,
                    },
                ]),
                grouped: true,
            },
            text: "group { send 0; recv 0 }".into(),
            place: "x.rs:2:1".into(),
        };
        for _ in 0..CUT_AT {
            record(&reg, pair()).expect("recorded");
        }
        assert!(reg.cut_if_long() > 0, "the trace was cut");
        assert!(reg.lock().trace.last_sends(0, 0, 1, 1, 0).is_none());
        let none_received = std::collections::BTreeMap::from([(1, Vec::new())]);
        let e = reg
            .unreceived_with(&reg.channel_counts(), &none_received)
            .expect("never-received");
        let Error::Program { ops, message, .. } = e else {
            panic!("{e}");
        };
        assert_eq!(
            (ops[0].peer, ops[0].fifo, ops[0].bytes),
            (1, 0, 4096),
            "{message}"
        );
        assert!(message.contains("folded into the trace's cut"), "{message}");
    }

    /// Both ranks' first ops on a communicator connected on first use are
    /// sends: the analysis names the connection set up from mismatched
    /// calls (R7), which explains NCCL's error after it
    /// (`run::explain_library_error`); a send and a recv pair rightly.
    #[test]
    fn both_first_sends_on_a_cold_communicator_are_a_mismatched_setup() {
        let cold = Model {
            lazy_connect: true,
            ..Model::default()
        };
        let setups = |second: Dir| {
            let reg = Registry::new(2, cold);
            reg.comm(0, "world", &[0, 1], false);
            let (s0, s1) = (reg.stream(0, "s"), reg.stream(1, "s"));
            let (t0, t1) = (reg.thread(0, "main"), reg.thread(1, "main"));
            record(&reg, one_op(t0, Dir::Send, 1, 4096, 0, s0)).expect("recorded");
            record(&reg, one_op(t1, second, 0, 4096, 0, s1)).expect("recorded");
            reg.analyze().mismatched_setups
        };
        let m = setups(Dir::Send);
        assert_eq!(m.len(), 1, "{m:?}");
        assert!(
            m[0].contains("setup round 1 of comm world between ranks 0 and 1")
                && m[0].contains("rank 1's `send 4096` (x.rs:1:1) sets up its send side"),
            "{m:?}"
        );
        assert!(setups(Dir::Recv).is_empty());
    }

    /// A send that no rank receives, once the other rank's code has
    /// returned: the report names the missing partner (seen on the H200s
    /// without `ended`: a hang whose report named nothing).
    #[test]
    fn a_send_whose_receiver_has_ended_is_reported_as_missing_its_partner() {
        let reg = Registry::new(2, Model::default());
        reg.comm(0, "world", &[0, 1], true);
        reg.comm(1, "lane:0->1", &[0, 1], true);
        let s0 = reg.stream(0, "lane:0->1");
        let s1 = reg.stream(1, "lane:0->1");
        assert_eq!((s0, s1), (0, 1));
        let (t0, t1) = (reg.thread(0, "main"), reg.thread(1, "main"));
        reg.lock().trace.push(TraceCall {
            thread: t0 as u32,
            call: Call::Launch {
                ops: Arc::new([TraceOp {
                    dir: Dir::Send,
                    peer: 1,
                    bytes: 128 << 20,
                    dtype: DType::U32,
                    comm: 1,
                    stream: s0,
                }]),
                grouped: false,
            },
            text: "send".into(),
            place: "x.rs:1:1".into(),
        });
        reg.blocked(
            t0,
            Some(Blocked::Sync(
                None,
                ("synchronize".into(), "x.rs:2:1".into()),
            )),
        );
        // While rank 1 may still issue the recv, the report cannot blame anyone.
        let open = reg.analyze();
        assert!(open.disagreements.is_empty(), "{:?}", open.disagreements);
        assert!(open.stuck.expect("stuck").missing.is_empty());
        reg.ended(t1);
        let stuck = reg.analyze().stuck.expect("stuck");
        assert_eq!(stuck.missing.len(), 1, "{stuck}");
        assert!(
            stuck.missing[0]
                .waits_for
                .contains("no thread of rank 1 will ever issue the matching recv"),
            "{stuck}"
        );
    }

    /// A thread of a rank whose handshake the peer completed, then another
    /// thread of the rank launching on the same communicator: the model
    /// finishes the first's handshake (it returned from NCCL before the
    /// second could call) and takes the second's launch, keeping the live
    /// machine (which it dropped when only the caller's handshake was
    /// finished, R11 holding the second back behind the first).
    #[test]
    fn a_handshake_the_peer_completed_does_not_hold_back_another_thread() {
        let cold = Model {
            lazy_connect: true,
            ..Model::default()
        };
        let reg = Registry::new(2, cold);
        reg.comm(0, "world", &[0, 1], false);
        let (s0a, s0b, s1) = (reg.stream(0, "a"), reg.stream(0, "b"), reg.stream(1, "s"));
        let (a, b) = (reg.thread(0, "a"), reg.thread(0, "b"));
        let p = reg.thread(1, "main");
        record(&reg, one_op(a, Dir::Send, 1, 4, 0, s0a)).expect("recorded");
        record(&reg, one_op(p, Dir::Recv, 0, 4, 0, s1)).expect("recorded");
        record(&reg, one_op(b, Dir::Send, 1, 4, 0, s0b)).expect("recorded");
        assert_eq!(
            reg.refused(),
            None,
            "the live model refused a valid program"
        );
        assert!(reg.lock_live().machine.is_some());
        assert!(reg.analyze().disagreements.is_empty());
    }

    /// A launch held back by another thread's launch in its handshake
    /// (R11, `NcclRank::after_handshakes`) is the thread's blocked call:
    /// the report shows it waiting for that thread, by the model's rule.
    #[test]
    fn a_launch_held_back_by_a_handshake_shows_in_the_report() {
        let reg = Registry::new(2, Model::default());
        reg.comm(0, "world", &[0, 1], false);
        reg.comm(1, "pair:0-1", &[0, 1], false);
        let (a, b) = (reg.stream(0, "pair"), reg.stream(0, "world"));
        let r1 = reg.stream(1, "world");
        let (first, main) = (reg.thread(0, "first"), reg.thread(0, "main"));
        let other = reg.thread(1, "main");
        // Rank 0's blocked send of 64 bytes to rank 1 on `comm`, `stream`.
        let send_64 = |comm, stream, text: &str, place: &str| {
            Blocked::Launch(
                Arc::new([TraceOp {
                    dir: Dir::Send,
                    peer: 1,
                    bytes: 64,
                    dtype: DType::U8,
                    comm,
                    stream,
                }]),
                false,
                (text.into(), place.into()),
            )
        };
        // Rank 0's first send on the pair: in its handshake, rank 1 being
        // blocked elsewhere.
        record(&reg, one_op(first, Dir::Send, 1, 64, 1, a)).expect("recorded");
        record(&reg, one_op(other, Dir::Recv, 0, 64, 0, r1)).expect("recorded");
        reg.blocked(
            other,
            Some(Blocked::Sync(
                None,
                ("synchronize".into(), "y.rs:2:1".into()),
            )),
        );
        let held = send_64(1, b, "send 64 (held back)", "x.rs:9:1");
        let before = reg.analyze().stuck.expect("stuck").to_string();
        assert!(!before.contains("held back"), "{before}");
        reg.blocked(main, Some(held));
        let stuck = reg.analyze().stuck.expect("stuck").to_string();
        assert!(stuck.contains("send 64 (held back)"), "{stuck}");
        assert!(
            stuck.contains(
                "waits for thread first of rank 0 to return from its call on comm pair:0-1"
            ),
            "{stuck}"
        );
        // Held back only because it shares the first send's stream
        // (another communicator): the model lets it through, but the
        // replay sees the first send still in its handshake on that
        // stream, which is the backend's own hold (`Handshakes::holds`,
        // `Trace::held_for_streams`), not a disagreement; the hang is
        // still explained.
        reg.blocked(
            main,
            Some(send_64(0, a, "send 64 (same stream)", "x.rs:10:1")),
        );
        let analysis = reg.analyze();
        assert!(
            analysis.disagreements.is_empty(),
            "{:?}",
            analysis.disagreements
        );
        let stuck = analysis.stuck.expect("still stuck").to_string();
        assert!(stuck.contains("wait-for cycle"), "{stuck}");
        // Blocked in a launch on a stream and a communicator no launch in
        // its handshake shares: nothing the backend does holds it back,
        // and the model lets it through: a disagreement, said.
        let s0c = reg.stream(0, "other");
        reg.blocked(
            main,
            Some(send_64(0, s0c, "send 64 (nothing holds it)", "x.rs:11:1")),
        );
        let analysis = reg.analyze();
        assert!(
            analysis.disagreements.iter().any(
                |d| d.call == "send 64 (nothing holds it)" && d.why.contains("lets it through")
            ),
            "{:?}",
            analysis.disagreements
        );
    }

    /// The issue check refuses a recv whose size differs from the send
    /// issued at its position, naming both ops through the live machine,
    /// even while the machine has not yet applied the send (it applies
    /// calls later, `Registry::settle`); it records nothing then, and the
    /// FIFO positions of the launches it lets through count on.
    #[test]
    fn a_size_mismatch_is_refused_before_nccl_sees_it() {
        let reg = Registry::local(2, Model::default());
        reg.comm(0, "world", &[0, 1], true);
        let s0 = reg.stream(0, "s");
        let s1 = reg.stream(1, "s");
        let (t0, t1) = (reg.thread(0, "main"), reg.thread(1, "main"));
        let launch = |t, (dir, peer, bytes, stream)| one_op(t, dir, peer, bytes, 0, stream);
        let op = |dir, peer, bytes, stream| (dir, peer, bytes, stream);
        let record = |call| record(&reg, call);
        assert_eq!(record(launch(t0, op(Dir::Send, 1, 4096, s0))), Ok(0));
        assert_eq!(record(launch(t0, op(Dir::Send, 1, 4096, s0))), Ok(1));
        // Not applied yet: the live machine is brought up to date to name
        // the ops.
        assert_eq!(reg.lock().applied, 0);
        let text = record(launch(t1, op(Dir::Recv, 0, 8192, s1))).expect_err("a size mismatch");
        assert!(text.contains("refused to launch"), "{text}");
        assert!(
            text.contains("send → 1 4KiB") && text.contains("recv ← 0 8KiB"),
            "{text}"
        );
        let calls = reg.calls();
        assert_eq!(calls, 2, "the refused recv is not recorded");
        assert_eq!(record(launch(t1, op(Dir::Recv, 0, 4096, s1))), Ok(0));
        assert_eq!(record(launch(t1, op(Dir::Recv, 0, 4096, s1))), Ok(1));
        reg.settle();
        assert_eq!(reg.lock().applied, 4);
        assert!(reg.analyze().disagreements.is_empty());
    }

    /// A rank's send to itself and its recv from itself meet inside one
    /// group (R12), and R3 compares them there: a group whose second pair
    /// differs in size is refused before NCCL sees it, naming both ops
    /// through the live machine, or from the issue check alone when the
    /// machine is gone; a group whose pairs agree is recorded.
    #[test]
    fn a_message_to_itself_that_differs_in_size_is_refused_inside_its_group() {
        for drop_model in [false, true] {
            let reg = Registry::local(1, Model::default());
            reg.comm(0, "world", &[0], true);
            let s = reg.stream(0, "s");
            let t = reg.thread(0, "main");
            if drop_model {
                reg.lock_live().machine = None;
            }
            let group = |sizes: [u64; 4]| {
                let ops: Vec<TraceOp> = [Dir::Send, Dir::Recv, Dir::Send, Dir::Recv]
                    .into_iter()
                    .zip(sizes)
                    .map(|(dir, bytes)| TraceOp {
                        dir,
                        peer: 0,
                        bytes,
                        dtype: DType::U8,
                        comm: 0,
                        stream: s,
                    })
                    .collect();
                let mut fifos = [u64::MAX; 4];
                let call = TraceCall {
                    thread: t as u32,
                    call: Call::Launch {
                        ops: ops.into(),
                        grouped: true,
                    },
                    text: format!("group {sizes:?}").into(),
                    place: "x.rs:1:1".into(),
                };
                let r = reg.lock();
                reg.record_launch(r, call, &mut fifos, &|_| None)
                    .map(|()| fifos)
                    .map_err(|e| e.to_string())
            };
            assert_eq!(group([1024, 1024, 4096, 4096]), Ok([0, 0, 1, 1]));
            let e = group([1024, 1024, 4096, 8192]).expect_err("4 KiB sent, 8 KiB received");
            assert!(
                e.contains("size mismatch") && e.contains("refused to launch"),
                "{e}"
            );
            if drop_model {
                assert!(e.contains("8192 bytes against 4096"), "{e}");
            } else {
                assert!(
                    e.contains("send → 0 4KiB") && e.contains("recv ← 0 8KiB"),
                    "{e}"
                );
            }
            assert_eq!(reg.calls(), 1, "the refused group is not recorded");
            assert_eq!(group([8, 8, 16, 16]), Ok([2, 2, 3, 3]));
        }
    }

    /// On a communicator connected on first use, a thread's second launch
    /// comes while the model still holds its first in the handshake (R7):
    /// the mismatch is found all the same (the thread's handshake is
    /// finished first), and without a live machine the issue check refuses
    /// it by itself.
    #[test]
    fn a_mismatch_on_a_cold_communicator_is_refused_with_or_without_the_model() {
        for drop_model in [false, true] {
            let reg = Registry::local(2, Model::default());
            reg.comm(0, "world", &[0, 1], false);
            let s0 = reg.stream(0, "s");
            let s1 = reg.stream(1, "s");
            let (t0, t1) = (reg.thread(0, "main"), reg.thread(1, "main"));
            if drop_model {
                reg.lock_live().machine = None;
            }
            let launch =
                |t, dir, peer, bytes, stream| record(&reg, one_op(t, dir, peer, bytes, 0, stream));
            assert_eq!(launch(t0, Dir::Send, 1, 4096, s0), Ok(0));
            assert_eq!(launch(t1, Dir::Recv, 0, 4096, s1), Ok(0));
            assert_eq!(launch(t0, Dir::Send, 1, 8192, s0), Ok(1));
            let e = launch(t1, Dir::Recv, 0, 4096, s1).expect_err("8 KiB sent, 4 KiB received");
            assert!(
                e.contains("size mismatch") && e.contains("refused to launch"),
                "{e}"
            );
            if !drop_model {
                // The model names both ops.
                assert!(e.contains("8KiB") && e.contains("4KiB"), "{e}");
            } else {
                assert!(e.contains("4096 bytes against 8192"), "{e}");
            }
            assert_eq!(launch(t1, Dir::Recv, 0, 8192, s1), Ok(1));
        }
    }

    /// Two ranks' threads issue while a third settles the live machine
    /// (as the watchdogs do): every call is applied once and in order, the
    /// trace is folded as it grows, and the run ends with nothing unmatched
    /// and no disagreement (the lock order: the live machine's first).
    #[test]
    fn issuing_while_another_thread_settles_applies_every_call_once() {
        const N: usize = 1000;
        let reg = Registry::with_compaction(2, Model::default(), 256);
        reg.comm(0, "world", &[0, 1], true);
        let s0 = reg.stream(0, "s");
        let s1 = reg.stream(1, "s");
        let (t0, t1) = (reg.thread(0, "main"), reg.thread(1, "main"));
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            let issue = |t: usize, dir: Dir, peer: u32, stream: u32| {
                let reg = &reg;
                move || {
                    for i in 0..N {
                        let fifo = record(reg, one_op(t, dir, peer, 4096, 0, stream));
                        assert_eq!(fifo, Ok(i as u64));
                    }
                }
            };
            let a = scope.spawn(issue(t0, Dir::Send, 1, s0));
            let b = scope.spawn(issue(t1, Dir::Recv, 0, s1));
            scope.spawn(|| {
                while !stop.load(std::sync::atomic::Ordering::Acquire) {
                    reg.settle_now_and_then();
                    std::thread::yield_now();
                }
            });
            a.join().expect("rank 0");
            b.join().expect("rank 1");
            stop.store(true, std::sync::atomic::Ordering::Release);
        });
        assert!(reg.unmatched().is_empty());
        let r = reg.lock();
        assert_eq!(r.applied, 2 * N);
        assert_eq!(r.folded + r.trace.calls.len(), 2 * N);
        assert!(r.folded > 0, "the trace was folded");
        drop(r);
        assert!(reg.analyze().disagreements.is_empty());
    }

    /// A long local run's trace is folded into a snapshot of the live
    /// machine, so that it stays bounded, and the hang analysis from the
    /// snapshot explains the same stuck state as the replay of every call.
    #[test]
    fn a_compacted_trace_stays_bounded_and_explains_the_same_hang() {
        let run = |reg: &Registry| {
            reg.comm(0, "world", &[0, 1], true);
            reg.comm(1, "pair:0-1", &[0, 1], true);
            let s0 = reg.stream(0, "pair:0-1");
            let s1 = reg.stream(1, "pair:0-1");
            let (t0, t1) = (reg.thread(0, "main"), reg.thread(1, "main"));
            let op = |t, dir, peer, bytes, stream| one_op(t, dir, peer, bytes, 1, stream);
            for _ in 0..50 {
                reg.issue(op(t0, Dir::Send, 1, 4096, s0), &mut [])
                    .expect("valid");
                reg.issue(op(t1, Dir::Recv, 0, 4096, s1), &mut [])
                    .expect("valid");
            }
            // The seed: both ranks send first, on one stream each.
            for (t, peer, s) in [(t0, 1, s0), (t1, 0, s1)] {
                reg.issue(op(t, Dir::Send, peer, 256 << 20, s), &mut [])
                    .expect("valid");
                reg.issue(op(t, Dir::Recv, peer, 256 << 20, s), &mut [])
                    .expect("valid");
                reg.blocked(
                    t,
                    Some(Blocked::Sync(
                        None,
                        ("synchronize".into(), "x.rs:2:1".into()),
                    )),
                );
            }
            reg.analyze()
        };
        let whole = Registry::new(2, Model::default());
        let compacted = Registry::with_compaction(2, Model::default(), 16);
        let (a, b) = (run(&whole), run(&compacted));
        assert_eq!(whole.folded(), 0);
        assert!(compacted.folded() >= 96, "{}", compacted.folded());
        assert!(compacted.trace().calls.len() < 16);
        assert!(a.disagreements.is_empty() && b.disagreements.is_empty());
        let (a, b) = (a.stuck.expect("a hang"), b.stuck.expect("a hang"));
        assert_eq!(a.cycle.len(), 4, "{a}");
        assert_eq!(a, b);
    }

    /// Two processes' registries, rank 0 sending `sends` and rank 1
    /// receiving `recvs` (bytes, element type) on `pair:0-1`, connected at
    /// creation or not (`warm`); rank 1's analysis of both ranks' calls.
    fn across_processes(
        sends: &[(u64, DType)],
        recvs: &[(u64, DType)],
        warm: bool,
    ) -> (HangAnalysis, HangAnalysis) {
        let regs: Vec<Arc<Registry>> = (0..2)
            .map(|r| Registry::for_rank(2, Model::default(), r))
            .collect();
        for (r, reg) in regs.iter().enumerate() {
            reg.comm(0, "world", &[0, 1], true);
            reg.comm(1, "pair:0-1", &[0, 1], warm);
            reg.thread(r as Rank, "main");
            reg.stream(r as Rank, "pair:0-1");
        }
        let launch = |dir, peer, (bytes, dtype): (u64, DType)| {
            let mut c = one_op(0, dir, peer, bytes, 1, 0);
            if let Call::Launch { ops, .. } = &mut c.call {
                let mut op = ops[0];
                op.dtype = dtype;
                *ops = Arc::new([op]);
            }
            c
        };
        for s in sends {
            regs[0]
                .issue(launch(Dir::Send, 1, *s), &mut [u64::MAX])
                .expect("rank 0 alone cannot see a mismatch");
        }
        for r in recvs {
            regs[1]
                .issue(launch(Dir::Recv, 0, *r), &mut [u64::MAX])
                .expect("rank 1 alone cannot see a mismatch");
        }
        (
            regs[1].analyze(),
            regs[1].analyze_with(vec![regs[0].trace()]),
        )
    }

    fn nccl(code: i32, text: &str) -> Error {
        Error::Library {
            library: "NCCL",
            call: "ncclCommGetAsyncError".into(),
            code,
            text: text.into(),
        }
    }

    /// One process per rank, FIFO order swapped (`fifo-order-swapped.sched`):
    /// rank 0 sends 4 KiB then 1 MiB, rank 1 receives 1 MiB then 4 KiB.
    /// Neither process can see the other's op before launching, so NCCL
    /// meets the mismatch first (over sockets: "message truncated", error
    /// 5); the joined traces name it as the program error it is, with both
    /// ops, and NCCL's words after it; on a communicator connected on first
    /// use too (the replay checks the match after the handshake).
    #[test]
    fn nccl_s_error_for_a_size_mismatch_across_processes_is_named_as_the_program_error() {
        let truncated = "invalid usage: message truncated : receiving 131072 bytes instead of 4096";
        for warm in [true, false] {
            let (alone, joined) = across_processes(
                &[(4096, DType::U8), (1 << 20, DType::U8)],
                &[(1 << 20, DType::U8), (4096, DType::U8)],
                warm,
            );
            assert!(alone.program_error.is_none(), "{:?}", alone.program_error);
            match crate::run::explained(nccl(5, truncated), joined) {
                Error::Program { kind, message, .. } => {
                    assert_eq!(kind, duplex::ProgramErrorKind::SizeMismatch, "{message}");
                    assert!(
                        message.contains("send → 1 4KiB") && message.contains("recv ← 0 1MiB"),
                        "{message}"
                    );
                    assert!(message.contains("NCCL met it first"), "{message}");
                    assert!(message.contains("message truncated"), "{message}");
                }
                other => panic!("warm {warm}: not named as a program error: {other}"),
            }
        }
        // Without the mismatch, NCCL's error stays NCCL's, unchanged.
        let (_, clean) = across_processes(&[(4096, DType::U8)], &[(4096, DType::U8)], true);
        assert!(clean.program_error.is_none(), "{:?}", clean.program_error);
        assert_eq!(
            crate::run::explained(nccl(3, "internal error"), clean).to_string(),
            nccl(3, "internal error").to_string()
        );
    }

    /// An NCCL error that a mismatch cannot have caused as NCCL reports one
    /// (a network error, beside a type mismatch NCCL cannot see: the bytes
    /// agree) stays NCCL's, with what the calls show said after it as
    /// what it may or may not be.
    #[test]
    fn another_nccl_error_beside_a_mismatch_stays_nccl_s() {
        let (_, joined) = across_processes(&[(4096, DType::F32)], &[(4096, DType::U8)], true);
        let network = "remote process exited or there was a network error";
        match crate::run::explained(nccl(6, network), joined) {
            Error::Library { code, text, .. } => {
                assert_eq!(code, 6);
                assert!(text.starts_with(network), "{text}");
                assert!(text.contains("may or may not be its cause"), "{text}");
                assert!(text.contains("type mismatch"), "{text}");
            }
            other => panic!("relabelled: {other}"),
        }
        // A size mismatch with an error other than invalid usage: NCCL's.
        let (_, joined) = across_processes(&[(4096, DType::U8)], &[(8192, DType::U8)], true);
        assert!(matches!(
            crate::run::explained(nccl(3, "internal error"), joined),
            Error::Library { code: 3, .. }
        ));
    }

    /// One process per rank: each process's trace is cut where its rank is
    /// quiet, at other points on each rank (so that a channel's sides are
    /// cut at other messages), and stays bounded however long the run; the
    /// hang that ends the run is explained by the joined traces exactly as
    /// by traces kept whole.
    #[test]
    fn traces_cut_where_quiet_stay_bounded_and_explain_the_same_hang_across_processes() {
        let run = |cut_at: [usize; 2]| {
            let regs: Vec<Arc<Registry>> = (0..2)
                .map(|r| {
                    Registry::build(2, Model::default(), usize::MAX, cut_at[r], Some(r as Rank))
                })
                .collect();
            for (r, reg) in regs.iter().enumerate() {
                reg.comm(0, "world", &[0, 1], true);
                reg.comm(1, "pair:0-1", &[0, 1], false);
                reg.thread(r as Rank, "main");
                reg.stream(r as Rank, "pair:0-1");
            }
            // Each process numbers its own thread and stream from 0.
            let (t, s) = (0, 0);
            let group = |peer: Rank, first: Dir| {
                let op = |dir| TraceOp {
                    dir,
                    peer,
                    bytes: 4096,
                    dtype: DType::U8,
                    comm: 1,
                    stream: s,
                };
                TraceCall {
                    thread: t as u32,
                    call: Call::Launch {
                        ops: Arc::new([op(first), op(first.other())]),
                        grouped: true,
                    },
                    text: "group { send; recv }".into(),
                    place: "x.rs:1:1".into(),
                }
            };
            for i in 0..1000 {
                regs[0]
                    .issue(group(1, Dir::Send), &mut [0, 0])
                    .expect("valid");
                regs[1]
                    .issue(group(0, Dir::Recv), &mut [0, 0])
                    .expect("valid");
                // Rank 0 is quiet after every exchange, rank 1 after every
                // seventh (the others' cuts find it busy).
                regs[0].cut_if_long();
                if i % 7 == 0 {
                    regs[1].cut_if_long();
                }
            }
            // The seed: both ranks send 256 MiB first.
            for (r, reg) in regs.iter().enumerate() {
                let peer = 1 - r as Rank;
                reg.issue(one_op(t, Dir::Send, peer, 256 << 20, 1, s), &mut [0])
                    .expect("valid");
                reg.issue(one_op(t, Dir::Recv, peer, 256 << 20, 1, s), &mut [0])
                    .expect("valid");
                reg.blocked(
                    t,
                    Some(Blocked::Sync(
                        None,
                        ("synchronize".into(), "x.rs:2:1".into()),
                    )),
                );
            }
            let published = regs[1].trace();
            let bytes = serde_json::to_vec(&published).expect("encodes").len();
            (
                regs[0].analyze_with(vec![published]),
                regs[0].trace(),
                bytes,
            )
        };
        let (whole, whole_trace, whole_bytes) = run([usize::MAX; 2]);
        let (cut, cut_trace, cut_bytes) = run([64, 100]);
        assert!(whole_trace.cuts.is_empty() && whole_trace.calls.len() == 1002);
        assert!(cut_trace.calls.len() < 70, "{}", cut_trace.calls.len());
        assert_eq!(cut_trace.cuts.len(), 1);
        assert!(
            cut_bytes * 5 < whole_bytes,
            "rank 1 publishes {cut_bytes} bytes cut, {whole_bytes} whole"
        );
        assert!(whole.disagreements.is_empty(), "{:?}", whole.disagreements);
        assert!(cut.disagreements.is_empty(), "{:?}", cut.disagreements);
        assert!(whole.unjoined.is_none() && cut.unjoined.is_none());
        let (a, b) = (whole.stuck.expect("a hang"), cut.stuck.expect("a hang"));
        assert_eq!(a.cycle.len(), 4, "{a}");
        assert_eq!(a.to_string(), b.to_string());
    }

    /// A call that the model says could not have been made (here: an
    /// `await` whose `notify` never came) is reported, not dropped.
    #[test]
    fn a_call_the_model_refuses_is_a_disagreement() {
        let reg = Registry::new(2, Model::default());
        reg.comm(0, "world", &[0, 1], true);
        let t0 = reg.thread(0, "main");
        reg.thread(1, "main");
        let s0 = reg.stream(0, "default");
        reg.lock().trace.push(TraceCall {
            thread: t0 as u32,
            call: Call::Await {
                from: 1,
                tag: "go".into(),
            },
            text: "await_notify(1, go)".into(),
            place: "x.rs:3:1".into(),
        });
        reg.event_call(t0, true, reg.event(0), s0);
        let a = reg.analyze();
        assert_eq!(a.disagreements.len(), 1, "{:?}", a.disagreements);
        let d = &a.disagreements[0];
        assert_eq!(d.call, "await_notify(1, go)");
        assert!(d.why.contains("notify"), "{d}");
        assert!(d.why.contains("1 later calls of this rank"), "{d}");
        // A run that ends well has no report of the trace's replay: the
        // live model says what it refused.
        let refused = reg.refused().expect("the live model refused the await");
        assert!(
            refused.contains("await_notify(1, go)") && refused.contains("x.rs:3:1"),
            "{refused}"
        );
    }
}
