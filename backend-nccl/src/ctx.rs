//! What the host threads of one rank share: `RankCtx` (its device, world
//! communicator and lanes, streams, the ops in flight, the watchdog), the
//! settings of a run, and the small handle types of streams, events and
//! communicators. [`crate::rank`] builds the per-thread handle on it.

use smallvec::SmallVec;
use std::collections::HashMap;
use std::panic::Location;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use duplex::report::OpInfo;
use duplex::trace::ChannelCount;
use duplex::transport::check;
use duplex::{DType, Dir, Error, Model, Policy, Rank, Result};

use crate::board::Board;
use crate::comm::{self, Comm, CommInner, poll};
use crate::copy::{CopyLane, CopyPath, Cuda, Ticket, TicketState};
use crate::cuda::{Device, Event, Memory, Stream, StreamMarks};
use crate::fence::{Fence, Fences};
use crate::guard::{Done, IssueLock, Issuing, Ledger};
use crate::health::{BEAT_EVERY, Health, PeerCause, SILENCE};
use crate::lanes::nccl::NcclKit;
use crate::lanes::{LaneEnd, LaneMaker, Lanes};
use crate::nccl::Nccl;
use crate::registry::Registry;
use duplex::compile;

/// Settings of a run.
#[derive(Clone, Debug)]
pub struct Options {
    /// The deadline of every wait: a sync, an `await_notify`, a `join`, a
    /// communicator's setup. Default 10 s; the runners (`Local`,
    /// `Process`) take `DUPLEX_TIMEOUT_MS` when it is set, and refuse a
    /// value that is not a whole number of milliseconds of at least 1.
    pub timeout: Duration,
    /// Connect the world communicator, shared lanes and user communicators
    /// at creation (the schedule format's `lazy-connect=off`). Per-direction
    /// lanes are always connected at creation.
    pub warm: bool,
    /// The model under which a real hang is explained; its `lazy-connect`
    /// follows `warm` ([`Options::model_in_force`]).
    pub model: Model,
    /// CTA bounds of lane communicators (`ncclConfig_t.minCTAs`/`maxCTAs`).
    pub ctas: (Option<i32>, Option<i32>),
    /// Under [`Policy::PerDirection`], ops of at least this many bytes
    /// without an explicit communicator go on copy-engine lanes
    /// ([`crate::copy`]; C1–C6 of `docs/semantics.md`). One process only
    /// ([`crate::Local`]).
    pub copy_from: Option<u64>,
    /// When lanes are made: all at creation, or each when first needed.
    pub lanes: LaneMode,
    /// Which directions of a per-direction lane are connected.
    pub lane_connect: LaneConnect,
}

/// Which directions of a per-direction lane `lane:a->b` duplex connects
/// before any op uses it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LaneConnect {
    /// Both (a one-byte exchange each way), as measured so far.
    #[default]
    Both,
    /// Only a→b, the one its policy-placed ops use: NCCL then sets up the
    /// buffers of one direction, not two (a lane's memory, issue 12). An op
    /// placed explicitly on the lane's communicator against its direction
    /// is refused (it would need a connection the model does not know of).
    OneWay,
}

impl std::str::FromStr for LaneConnect {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<LaneConnect, String> {
        match s {
            "both" => Ok(LaneConnect::Both),
            "one-way" => Ok(LaneConnect::OneWay),
            other => Err(format!(
                "lane connection `{other}`: expected `both` or `one-way`"
            )),
        }
    }
}

/// When a run makes its lanes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LaneMode {
    /// Every lane at creation, by `ncclCommSplit` of the world, connected
    /// in one group: 2(n−1) lane ends per rank under per-direction.
    #[default]
    Eager,
    /// A lane when one of its ranks first needs it, by its two ranks' lane
    /// services ([`crate::lanes`]): only the pairs that talk pay for one.
    /// A host call that needs a lane not yet made waits for it (a
    /// communicator's setup, tens of milliseconds).
    Lazy,
}

impl std::fmt::Display for LaneMode {
    /// The word [`LaneMode::from_str`](std::str::FromStr) reads back.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LaneMode::Eager => "eager",
            LaneMode::Lazy => "lazy",
        })
    }
}

impl std::str::FromStr for LaneMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<LaneMode, String> {
        match s {
            "eager" => Ok(LaneMode::Eager),
            "lazy" => Ok(LaneMode::Lazy),
            other => Err(format!("lanes `{other}`: expected `eager` or `lazy`")),
        }
    }
}

impl Options {
    /// The model hangs are explained under, as reports name it: [`Options::model`]
    /// with `lazy-connect` set by [`Options::warm`], which is what the
    /// backend does (the trace's communicators say each one's connection
    /// either way; this is the setting the report names).
    pub fn model_in_force(&self) -> Model {
        Model {
            lazy_connect: !self.warm,
            ..self.model
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            timeout: Duration::from_millis(10_000),
            warm: false,
            model: Model::default(),
            ctas: (None, None),
            copy_from: None,
            lanes: LaneMode::Eager,
            lane_connect: LaneConnect::Both,
        }
    }
}

/// What a lane cost to make.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LaneCost {
    /// The lane.
    pub name: String,
    /// Creation time (split, setup and warm-up), milliseconds.
    pub create_ms: f64,
    /// Device memory it took: from `ncclCommMemStats` where the library has
    /// it (2.29.7 and later), else the drop in free device memory across its
    /// creation (other work on the device skews the latter).
    pub bytes: u64,
    /// How `bytes` was measured.
    pub measured_by: &'static str,
}

impl LaneCost {
    /// The cost of lane `name`, begun at `started`: `stats` from
    /// `ncclCommMemStats` where the library has it, else the drop in free
    /// device memory from `before` to `after`, measured as `how` says.
    pub(crate) fn measured(
        name: String,
        started: Instant,
        stats: Option<u64>,
        (before, after): (u64, u64),
        how: &'static str,
    ) -> LaneCost {
        let (bytes, measured_by) = match stats {
            Some(b) => (b, "ncclCommMemStats"),
            None => (before.saturating_sub(after), how),
        };
        LaneCost {
            name,
            create_ms: started.elapsed().as_secs_f64() * 1e3,
            bytes,
            measured_by,
        }
    }
}

/// A stream of a rank.
#[derive(Clone, Debug)]
pub struct NcclStream(pub(crate) Arc<StreamInner>);

#[derive(Debug)]
pub(crate) struct StreamInner {
    pub(crate) raw: Stream,
    pub(crate) name: Arc<str>,
    pub(crate) rank: Rank,
    pub(crate) id: u32,
    /// The run that made it ([`Registry::run`]).
    pub(crate) run: u64,
    /// Its completion fences ([`crate::fence`]): the ops launched on it
    /// attach to them. Numbered in the ledger by a number no other stream
    /// of this process has, ever (an address can be reused, and a
    /// registry's stream number is only unique within one run).
    pub(crate) fences: crate::sync::Arc<Fences<StreamMarks>>,
}

/// Launches of a stream after which the issuing thread records its open
/// completion fence (a sync, a hang report or the end of a run records it
/// sooner): one event record per this many launches instead of one per
/// launch.
pub(crate) const FENCE_EVERY: u32 = 16;

impl StreamInner {
    /// A stream of `rank` on `device`, numbered `id` by the registry of
    /// run `run`.
    pub(crate) fn new(
        raw: Stream,
        name: &str,
        rank: Rank,
        (id, run): (u32, u64),
        device: &Arc<Device>,
    ) -> StreamInner {
        static SERIAL: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let fences = Fences::new(
            raw.marks(device.clone()),
            SERIAL.fetch_add(1, Ordering::Relaxed),
            FENCE_EVERY,
        );
        StreamInner {
            raw,
            name: name.into(),
            rank,
            id,
            run,
            fences,
        }
    }

    /// Its number in the ledger.
    pub(crate) fn serial(&self) -> usize {
        self.fences.queue_serial()
    }

    /// An event recorded now, for a host wait that covers the work queued
    /// so far: the open completion fence is recorded first, so that once
    /// the event completed the ops it covered are known done.
    pub(crate) fn wait_event(&self) -> Result<Event> {
        self.fences.flush()?;
        let ev = Event::new(false)?;
        ev.record(&self.raw)?;
        Ok(ev)
    }
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        // Its open fence is recorded while the stream still exists; no
        // fence uses the stream after this.
        self.fences.close();
    }
}

/// An event of a rank.
#[derive(Clone, Debug)]
pub struct NcclEvent(pub(crate) Arc<EventInner>);

#[derive(Debug)]
pub(crate) struct EventInner {
    pub(crate) raw: Event,
    pub(crate) rank: Rank,
    pub(crate) id: u32,
    /// The run that made it ([`Registry::run`]).
    pub(crate) run: u64,
}

/// A communicator.
#[derive(Clone, Debug)]
pub struct NcclComm(pub(crate) Comm);

/// A buffer's memory, kept alive by the buffer and by every op that uses it:
/// it is freed only once no launched op can touch it.
#[derive(Debug)]
pub(crate) struct BufState {
    /// Its number in the rank's device order (D1), never reused.
    pub(crate) id: u64,
    pub(crate) mem: Option<Memory>,
    pub(crate) rank: Rank,
    pub(crate) device: Arc<Device>,
    /// Ops launched on it (weak: an op holds its buffer, not the reverse),
    /// and the last recv into it.
    pub(crate) users: Mutex<Users>,
    /// A host copy into or out of it did not finish in time and may still
    /// run: its memory is never freed (P6).
    pub(crate) kept: AtomicBool,
    /// The run that made it ([`Registry::run`]).
    pub(crate) run: u64,
}

/// What a buffer knows of the ops launched on it.
#[derive(Debug, Default)]
pub(crate) struct Users {
    /// Every op not yet known to be gone.
    pub(crate) ops: Vec<std::sync::Weak<Issued>>,
    /// The last recv launched into the buffer since the host last wrote
    /// it and not yet found delivered: a host read checks it
    /// (`NcclRank::read`), since the waits that would say so may never
    /// have covered it. A check that succeeds, a read's or a wait's, clears
    /// it: a communicator aborted later does not unmake bytes that
    /// arrived. Weak references: a buffer keeps no communicator or lane
    /// alive.
    pub(crate) last_recv: Option<LastRecv>,
    /// Why a recv into the buffer may have run untracked (its launch
    /// failed after NCCL may have queued it): every read fails until the
    /// host writes the buffer.
    pub(crate) poisoned: Option<String>,
    /// The recvs into the buffer on copy-engine lanes whose copies may
    /// still run ([`Ticket::copy_may_run`]), each with its lane: one that
    /// failed with its copy in flight (an abort) may yet write the buffer,
    /// so the buffer is refused until that copy is seen done
    /// ([`BufState::late_copy`]).
    pub(crate) copies: Vec<(std::sync::Weak<CopyEnd>, Arc<Ticket>)>,
}

/// A recv as a host read of its buffer checks it.
#[derive(Debug)]
pub(crate) struct LastRecv {
    /// The op (weak: only to know it again, `Weak::ptr_eq`).
    pub(crate) op: std::sync::Weak<Issued>,
    /// The rank it receives from.
    pub(crate) peer: Rank,
    /// Its NCCL communicator (unused for a copy-engine op).
    pub(crate) comm: std::sync::Weak<crate::comm::CommInner>,
    /// On a copy-engine lane: the lane and the op's ticket.
    pub(crate) copy: Option<(std::sync::Weak<CopyEnd>, Arc<Ticket>)>,
}

impl BufState {
    pub(crate) fn ptr(&self) -> u64 {
        self.mem.as_ref().map(|m| m.ptr()).unwrap_or(0)
    }

    /// The ops on this buffer that the host does not know complete, in
    /// launch order: neither their fence says so nor a host sync covered
    /// them ([`Issued::known_done`]).
    pub(crate) fn busy_ops(&self) -> SmallVec<[Arc<Issued>; 2]> {
        let mut busy = SmallVec::new();
        lock(&self.users).ops.retain(|w| match w.upgrade() {
            Some(i) if !i.done() && !i.known_done.load(Ordering::Acquire) => {
                busy.push(i);
                true
            }
            _ => false,
        });
        busy
    }

    /// Why the buffer cannot be used yet, if so: a recv into it on a
    /// copy-engine lane failed (its lane was aborted) while its copy may
    /// still run, and would overwrite what the host or a later op puts
    /// there. Settles the lane first, so that a copy done by now counts
    /// as done.
    pub(crate) fn late_copy(&self) -> Option<String> {
        let copies = {
            let mut users = lock(&self.users);
            if users.copies.is_empty() {
                return None;
            }
            users.copies.retain(|(_, t)| t.copy_may_run());
            users.copies.clone()
        };
        // Only a failed op's copy matters (one in flight normally is the
        // buffer's busy op, which `check_users` judges), and a settle takes
        // the lane's lock: only those are settled.
        for (end, ticket) in copies {
            if ticket.late().is_none() {
                continue;
            }
            let end = end.upgrade();
            if let Some(end) = &end {
                let _ = end.lane.settle();
            }
            if let Some(why) = ticket.late() {
                let lane = end.map_or_else(|| "(gone)".to_string(), |e| e.name.clone());
                return Some(format!(
                    "the copy of message {} on copy-engine lane {lane} may still write it: its lane was aborted with the copy in flight ({why}); use another buffer (this one can be used again once that copy is seen done, which may be never: a copy whose enqueue failed midway, or one waiting for a process that died)",
                    ticket.message()
                ));
            }
        }
        None
    }
}

impl Drop for BufState {
    fn drop(&mut self) {
        // No op holds this buffer any more, so none can touch it. Freeing
        // device memory waits for the device, which may wait for something
        // only the dropping thread would do next (issue an op, answer a
        // peer): the process's reaper frees it (`crate::reaper`).
        if let Some(mem) = self.mem.take() {
            if self.kept.load(Ordering::Acquire) {
                mem.leak();
                return;
            }
            crate::reaper::reap(vec![Freeing {
                mem: Some(mem),
                device: self.device.clone(),
                rank: self.rank,
            }]);
        }
    }
}

/// A buffer's memory on its way to be freed, by whoever drops this (the
/// reaper).
struct Freeing {
    mem: Option<Memory>,
    device: Arc<Device>,
    rank: Rank,
}

impl Drop for Freeing {
    fn drop(&mut self) {
        if let Some(mem) = self.mem.take() {
            let _bound = self.device.bind_scoped();
            if let Err(e) = mem.free() {
                tracing::warn!(rank = self.rank, error = %e, "freeing a buffer failed");
            }
        }
    }
}

/// Whether `e` is one of NCCL's errors that another rank can cause:
/// `ncclSystemError` (2) or `ncclRemoteError` (6), say a peer's process
/// that exited or its socket that closed.
pub(crate) fn nccl_remote(e: &Error) -> bool {
    matches!(e, Error::Library { library, code, .. } if *library == "NCCL" && matches!(code, 2 | 6))
}

/// Why work of rank `me` can never complete when rank `r` finished first:
/// the one wording of that cause, for every error that names it.
pub(crate) fn finished_before(r: Rank, me: Rank) -> String {
    format!(
        "rank {r} finished while rank {me}'s work with it was pending, so what would match it was never issued"
    )
}

/// How long a wait that failed with an error another rank may have caused
/// waits for the health monitor to name that rank ([`RankCtx::cause`]): it
/// notices a death by [`SILENCE`], polls every [`BEAT_EVERY`], and a poll
/// of a store that stopped answering takes up to a second.
pub(crate) fn patience() -> Duration {
    SILENCE + BEAT_EVERY * 2 + Duration::from_secs(1)
}

/// The completion fence an op attached to after its launch
/// ([`crate::fence`]): the op is done once it completed.
pub(crate) type OpEvent = Fence<StreamMarks>;

/// An op that was launched: what it is, the completion fence it attached
/// to after its launch (with the rest of its launch on its stream), and
/// the buffer it uses
/// (kept alive until the op is dropped, after it completed). An op on a
/// copy-engine lane also has its ticket, which says whether its bytes
/// arrived.
#[derive(Debug)]
pub(crate) struct Issued {
    pub(crate) meta: OpMeta,
    pub(crate) event: crate::sync::Arc<OpEvent>,
    pub(crate) buf: Arc<BufState>,
    pub(crate) ticket: Option<Arc<Ticket>>,
    /// Its rank, where an undelivered copy is remembered
    /// ([`Issued::check_delivery`]); only for an op with a ticket.
    pub(crate) ctx: Option<std::sync::Weak<RankCtx>>,
    /// Whether its delivery was checked once its stream passed it
    /// ([`Issued::check_delivery`]).
    pub(crate) checked: AtomicBool,
    /// A host sync covered it while its fence may still be open: a sync
    /// of another stream that an event ordered after it (D1,
    /// `NcclRank::check_users`). Only its buffer's host accesses read it
    /// ([`BufState::busy_ops`]): the fence, and with it the ledger's
    /// pruning and the buffer's memory, stays with the device, since the
    /// fence is shared with later ops of its stream that nothing covered.
    pub(crate) known_done: AtomicBool,
}

/// One end of a copy-engine lane: the lane, shared with the rank at its
/// other end, and its number and name in the registry.
#[derive(Debug)]
pub(crate) struct CopyEnd {
    pub(crate) name: String,
    pub(crate) logical: u32,
    pub(crate) lane: Arc<dyn CopyPath>,
}

/// The copy-engine lanes of a job, by (source, destination) rank.
/// Between ranks of one process a lane is one [`CopyLane`], shared by both;
/// across processes each rank holds its half ([`crate::copy::ipc`]).
pub(crate) type CopyLanes = Vec<((Rank, Rank), Arc<dyn CopyPath>)>;

/// Makes the copy-engine lanes of a job of `ranks` ranks on GPUs
/// `0..ranks` of this process, one per ordered pair (when `opts` asks for
/// them under `policy`).
pub(crate) fn copy_lanes(ranks: u32, policy: Policy, opts: &Options) -> Result<CopyLanes> {
    if policy != Policy::PerDirection || opts.copy_from.is_none() {
        return Ok(Vec::new());
    }
    let devices = (0..ranks)
        .map(|r| Device::new(r as i32).map(Arc::new))
        .collect::<Result<Vec<_>>>()?;
    compile::lane_pairs(Policy::PerDirection, ranks)
        .map(|(a, b)| {
            let (name, _, _) = compile::copy_lane(a, Dir::Send, b);
            let api = Cuda::new(devices[a as usize].clone(), devices[b as usize].clone())?;
            let lane = Arc::new(CopyLane::new(name, api));
            CopyLane::start(&lane)?;
            Ok(((a, b), lane as Arc<dyn CopyPath>))
        })
        .collect()
}

impl Issued {
    /// Whether the op's stream went past it ([`Fence::done`]): the device
    /// can no longer touch its buffers, except by the copy of an op on a
    /// copy-engine lane aborted with the copy in flight, which the buffer
    /// itself tracks ([`BufState::late_copy`]; a wait must not wait for
    /// it: it may never run). Whether the op succeeded is another question,
    /// answered with its error by the waits
    /// (`NcclRank::verify_complete`).
    pub(crate) fn done(&self) -> bool {
        let done = self.event.done();
        if done {
            self.check_delivery();
        }
        done
    }

    /// Once its stream passed it: an op on a copy-engine lane whose bytes
    /// were not delivered (its lane was aborted) is remembered in its
    /// rank's [`RankCtx::lost`], so that every later wait of the rank
    /// reports it, even after the ledger forgot the op.
    fn check_delivery(&self) {
        let (Some(t), Some(c)) = (&self.ticket, &self.meta.copy) else {
            return;
        };
        if self.checked.load(Ordering::Acquire) {
            return;
        }
        if t.state() != TicketState::Delivered {
            let _ = c.lane.settle();
        }
        let Some(why) = t.undelivered(&*c.lane) else {
            self.checked.store(true, Ordering::Release);
            return;
        };
        if let Some(ctx) = self.ctx.as_ref().and_then(std::sync::Weak::upgrade) {
            // Marked checked only with the entry in place, so that a
            // second caller (another thread's prune) returns only once
            // every later wait sees it.
            let mut lost = lock(&ctx.lost);
            if !self.checked.swap(true, Ordering::AcqRel) {
                lost.push(format!(
                    "{} finished on the device, but copy-engine lane {} did not deliver it ({why}); its bytes cannot be trusted",
                    self.meta.info(),
                    c.name
                ));
            }
        }
    }
}

impl Done for Issued {
    fn done(&self) -> bool {
        Issued::done(self)
    }

    /// Its stream and its fence's position there: the fences of a stream
    /// are recorded in the order of their positions, so complete in it.
    fn queue(&self) -> Option<(usize, u64)> {
        Some(self.event.queue())
    }

    fn mark_done(&self) {
        self.event.mark_done();
        self.check_delivery();
    }
}

/// What describes an op, made of cheap clones on the hot path; the words
/// of a report ([`OpMeta::info`]) are built only when one is needed.
#[derive(Clone, Debug)]
pub(crate) struct OpMeta {
    pub(crate) rank: Rank,
    pub(crate) thread: Arc<str>,
    pub(crate) dir: Dir,
    pub(crate) peer: Rank,
    pub(crate) count: usize,
    pub(crate) dtype: DType,
    pub(crate) comm: Comm,
    /// The copy-engine lane it goes on instead of `comm` (C1).
    pub(crate) copy: Option<Arc<CopyEnd>>,
    pub(crate) stream: Arc<str>,
    pub(crate) fifo: u64,
    pub(crate) grouped: bool,
    pub(crate) at: &'static Location<'static>,
    /// The call site set by `duplex::transport::check::at_site` when the op
    /// was made (a schedule's line), which reports name instead of `at`.
    pub(crate) site: Option<Arc<str>>,
}

impl OpMeta {
    /// Its access to its buffer on stream `stream` (the registry's number),
    /// for the device order (D1).
    pub(crate) fn access(&self, stream: u32) -> duplex::order::Access<'_> {
        duplex::order::Access {
            dir: self.dir,
            peer: self.peer,
            count: self.count,
            dtype: self.dtype,
            stream,
            stream_name: &self.stream,
            part: self.logical(),
            at: self.at,
            site: self.site.as_ref(),
        }
    }

    /// `send 1024 x f32 to rank 1`.
    pub(crate) fn text(&self) -> String {
        check::op_text(self.dir, self.count, self.dtype, self.peer)
    }

    /// Its communicator's number in the registry: its copy-engine lane's,
    /// if it has one.
    pub(crate) fn logical(&self) -> u32 {
        self.copy.as_ref().map_or(self.comm.logical, |c| c.logical)
    }

    /// Its communicator's name, or its copy-engine lane's.
    pub(crate) fn comm_name(&self) -> &str {
        self.copy.as_ref().map_or(&self.comm.name, |c| &c.name)
    }

    /// Where the call was made.
    pub(crate) fn place(&self) -> String {
        match &self.site {
            Some(s) => s.to_string(),
            None => check::place(self.at),
        }
    }

    /// The op as a report shows it.
    pub(crate) fn info(&self) -> OpInfo {
        OpInfo {
            rank: self.rank,
            thread: self.thread.to_string(),
            op: self.dir,
            peer: self.peer,
            bytes: (self.count * self.dtype.size()) as u64,
            dtype: self.dtype,
            comm: self.comm_name().to_string(),
            stream: self.stream.to_string(),
            fifo: self.fifo,
            state: duplex::report::OpState::NotComplete,
            grouped: self.grouped,
            call: self.text(),
            at: self.place(),
            line: None,
        }
    }
}

/// A rank's threads started by `Transport::spawn` ([`RankCtx::spawned`]),
/// shared with each of them and their handles (`NcclThread`): a thread
/// leaves `running` only once its own hold on the rank is gone, so that
/// the rank is never torn down from a thread of its own after its end.
/// A thread's error is the rank's whether or not it is joined (a `join`
/// returns it too), as on the simulator, where a thread's failure ends
/// the execution: the failure is posted as the rank's when the thread
/// ends (so the other ranks' waits end on it), and the rank does not end
/// `Ok` ([`NcclRank::wait_spawned`]).
///
/// [`NcclRank::wait_spawned`]: crate::rank::NcclRank::wait_spawned
#[derive(Debug, Default)]
pub(crate) struct Spawned {
    /// Those running, by registry number, with their names and what
    /// became of their handles.
    pub(crate) running: Vec<(usize, String, Handle)>,
    /// Those that ended with an error, in the order they ended: registry
    /// number, name, error, and what became of the handle (kept up to
    /// date after the thread's end: a handle held then may be joined or
    /// dropped later).
    pub(crate) failed: Vec<(usize, String, Error, Handle)>,
}

impl Spawned {
    /// Thread `id` (`name`) ended with `r`, its hold on the rank gone: an
    /// error is recorded as the rank's, and the result goes to its handle
    /// while one is held (`tx`). Called under the lock its handle's drop
    /// takes ([`Spawned::handle_dropped`]), so a handle dropped meanwhile
    /// never misses a result it waits for.
    pub(crate) fn thread_ended(
        &mut self,
        id: usize,
        name: &str,
        r: Result<()>,
        tx: &std::sync::mpsc::Sender<Result<()>>,
    ) {
        let at = self.running.iter().position(|t| t.0 == id);
        let state = at.map_or(Handle::Dropped, |i| self.running.remove(i).2);
        if let Err(e) = &r {
            self.failed.push((id, name.to_string(), e.clone(), state));
        }
        if state == Handle::Held {
            let _ = tx.send(r);
        }
    }

    /// What became of thread `id`'s handle: `state`, unless a join already
    /// gave up on it (its hang was reported then).
    pub(crate) fn handle_now(&mut self, id: usize, state: Handle) {
        let slot = match self.running.iter_mut().find(|t| t.0 == id) {
            Some(t) => &mut t.2,
            None => match self.failed.iter_mut().find(|t| t.0 == id) {
                Some(t) => &mut t.3,
                None => return,
            },
        };
        if *slot != Handle::GaveUp {
            *slot = state;
        }
    }

    /// Thread `id`'s handle was dropped (`joined`: after a `join` took
    /// its result): a thread still running is told, so that its result
    /// goes to no handle, and the error of one that ended says so.
    pub(crate) fn handle_dropped(&mut self, id: usize, joined: bool) {
        self.handle_now(
            id,
            if joined {
                Handle::Joined
            } else {
                Handle::Dropped
            },
        );
    }

    /// The first error of a thread that ended, as the rank's: its own kind
    /// (so that the most telling error of a job is chosen as the simulator
    /// would), the thread named where the error does not say it.
    pub(crate) fn first_error(&self) -> Option<Error> {
        let (_, name, e, handle) = self.failed.first()?;
        let how = match handle {
            Handle::Joined => "joined, and the rank's code went on after its error",
            Handle::Held | Handle::Dropped => "never joined",
            Handle::GaveUp => "a join gave up on it",
        };
        Some(match e {
            Error::User(m) => Error::User(format!("thread {name} ({how}): {m}")),
            Error::Aborted(m) => Error::Aborted(format!("thread {name} ({how}): {m}")),
            other => other.clone(),
        })
    }
}

/// What became of a thread's handle ([`Spawned`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Handle {
    /// Held: the thread's result goes to it.
    Held,
    /// Dropped without a join.
    Dropped,
    /// Dropped after a `join` took the thread's result.
    Joined,
    /// Given up by a `join` that timed out (which reported a hang).
    GaveUp,
}

/// What the host threads of one rank share.
#[derive(Debug)]
pub(crate) struct RankCtx {
    pub(crate) rank: Rank,
    pub(crate) world_size: u32,
    pub(crate) policy: Policy,
    pub(crate) opts: Options,
    pub(crate) lib: &'static Nccl,
    /// The rank's lane ends, made at creation or on first need.
    pub(crate) lanes: Lanes,
    /// Under [`LaneMode::Lazy`], the rank's lane service.
    pub(crate) maker: OnceLock<Arc<LaneMaker<NcclKit>>>,
    /// The lane service's thread, joined at teardown.
    pub(crate) service: Mutex<Option<std::thread::JoinHandle<()>>>,

    /// NCCL calls of the lane service waiting for the issue lock: the lane
    /// service runs them when it gets the lock, and a host thread that
    /// holds the lock while it waits for another rank (the connection of
    /// a user communicator at creation) runs them as it waits ([`RankCtx::assist`]), so that making
    /// a lane never waits for any rank's user code.
    /// Set by [`RankCtx::abort_all`] before it collects the communicators:
    /// a lane made after that is aborted, not added.
    pub(crate) closed: AtomicBool,
    /// Copy-engine lanes toward (send) and from (recv) each peer.
    pub(crate) copy: HashMap<(Rank, Dir), Arc<CopyEnd>>,
    /// Across processes, the arena that buffers of at least `copy_from`
    /// bytes are taken from (its peers opened it at setup).
    pub(crate) arena: Option<Arc<crate::cuda::Arena>>,
    pub(crate) world: Comm,
    /// The parent of the user's communicators ([`SPLITS`]): never used
    /// for ops, so a split waiting on it holds back nothing else.
    pub(crate) splits: Comm,
    /// The order in which this rank's `Transport::comm` calls split
    /// [`RankCtx::splits`]: the order they were numbered in, which every
    /// rank follows.
    pub(crate) split_turns: Mutex<SplitTurns>,
    pub(crate) default_stream: NcclStream,
    pub(crate) streams: Mutex<Vec<NcclStream>>,
    pub(crate) comms: Mutex<Vec<Comm>>,
    /// The lock around every NCCL call of the rank (P1 of [`crate::guard`]).
    pub(crate) issue: IssueLock,
    /// The launches that wait in their connection handshake (R7) without
    /// the issue lock: their communicators and copy-engine lanes hold back
    /// the rank's other launches on them, and only those (R11).
    pub(crate) handshakes: Handshakes,
    /// The device order of the rank's buffer accesses (D1 of
    /// `docs/semantics.md`): launches, events and syncs in the order the
    /// rank's threads made them. Taken alone, or before the registry's
    /// lock, never while a thread waits.
    pub(crate) order: Mutex<duplex::order::Order>,
    /// The ops that may still run on the device (P6, P7).
    pub(crate) ops: Ledger<Arc<Issued>>,
    pub(crate) board: Arc<dyn Board>,
    /// What this rank (and, in a local run, every rank) issued: the trace
    /// of the hang analysis and the live issue checks.
    pub(crate) registry: Arc<Registry>,
    /// The job's failures: how this rank reports its own and learns of the
    /// others' ([`crate::health`]).
    pub(crate) health: Arc<dyn Health>,
    pub(crate) user_comms: AtomicUsize,
    /// The logical number of the first user communicator: the `k`-th
    /// `Transport::comm` call's is this plus `k`, the same on every rank
    /// whatever order a rank's threads made their calls in (a number taken
    /// apart from `k` could differ between ranks, and the ranks' traces
    /// would then count one communicator's messages under two numbers).
    pub(crate) first_user_logical: u32,
    /// Ops on copy-engine lanes whose streams went on without their bytes
    /// ([`Issued::check_delivery`]): every later wait of the rank fails
    /// naming the first.
    pub(crate) lost: Mutex<Vec<String>>,
    /// The threads started by `Transport::spawn` still running, and the
    /// errors of those that ended, joined or not ([`Spawned`]): the rank's
    /// end waits for the first and fails with the second
    /// (`NcclRank::wait_spawned`), as the simulator's execution does.
    pub(crate) spawned: Arc<Mutex<Spawned>>,
    /// Set when a wait of this rank ended because another rank failed, and
    /// published this rank's trace then (`NcclRank::peer_failed`): that
    /// trace, with the interrupted call still blocked, is what the failed
    /// rank's analysis needs, and nothing later replaces it.
    pub(crate) published_for_peer: AtomicBool,
    /// Set when the watchdog aborted this rank's communicators.
    pub(crate) fired: AtomicBool,
    /// The watchdog aborted the rank's communicators because another rank
    /// failed (not for this rank's own deadline): errors then name that
    /// rank as the cause.
    pub(crate) fired_for_peer: AtomicBool,
    pub(crate) costs: Mutex<Vec<LaneCost>>,
    /// Ops issued on copy-engine lanes ([`crate::NcclRank::copy_ops`]).
    pub(crate) copy_ops: std::sync::atomic::AtomicU64,
    /// Two device bytes that every connecting exchange uses
    /// ([`exchange_byte`]): made at creation, freed with the context after
    /// every communicator (a free synchronizes the device, P8 of
    /// [`crate::guard`]), never while an exchange may run.
    pub(crate) warmup: Memory,
    // Last, so that it is released after every stream and communicator.
    pub(crate) device: Arc<Device>,
}

impl Drop for RankCtx {
    /// Frees every communicator of the rank in one batch (P8 of
    /// [`crate::guard`]: one `ncclGroupStart` around their
    /// `ncclCommAbort`s), before the fields drop. Dropped one by one, each
    /// `ncclCommAbort` ran its teardown alone, and the rank paid for the
    /// sum; in a group NCCL runs each communicator's on a thread of its
    /// own, and the rank pays for the slowest. With a peer gone each took
    /// 0.5 to 1 s on one H200 (`peer-dies`, docs/gpu/ab-1gpu.md). Those a
    /// teardown or the watchdog aborted are freed already and skipped.
    ///
    /// The copy-engine lanes go first, as in [`RankCtx::abort_all`] (and
    /// as the fields' order had them): freeing a communicator waits for
    /// the device, which a lane's flag-wait kernel would hold. A
    /// communicator still held (no thread of the rank's can hold one here:
    /// the lane service holds the context while it works) would keep the
    /// whole batch until its holder left (P4), the others' work stopped
    /// only then.
    fn drop(&mut self) {
        drop(std::mem::take(&mut self.copy));
        let all = self.all_comms();
        let started = Instant::now();
        let aborted = abort_together(&all);
        if !aborted.is_empty() {
            tracing::debug!(
                rank = self.rank,
                comms = aborted.len(),
                ms = started.elapsed().as_secs_f64() * 1e3,
                "the rank's communicators are aborted together"
            );
        }
    }
}

/// The name of the communicator that user communicators are split from
/// ([`RankCtx::splits`]), as lane costs report it.
pub(crate) const SPLITS: &str = "splits (the parent of user communicators)";

/// Its logical number: it has no ops, so it appears in no trace.
const SPLITS_LOGICAL: u32 = u32::MAX;

/// Whose turn it is to split [`RankCtx::splits`]: the `k`-th call of
/// `Transport::comm` on every rank pairs with every other rank's `k`-th,
/// so a rank's splits reach NCCL in the order of their numbers, one at a
/// time (the parent is busy until a split is over).
#[derive(Debug, Default)]
pub(crate) struct SplitTurns {
    /// The number whose turn it is.
    next: usize,
    /// Numbers above `next` whose calls ended before their turn came (a
    /// refused call, a wait past the deadline): skipped when it comes.
    ended: std::collections::BTreeSet<usize>,
}

impl SplitTurns {
    /// Whether call `k` may split now.
    pub(crate) fn is_turn(&self, k: usize) -> bool {
        self.next == k
    }

    /// Call `k` is over, split or not.
    pub(crate) fn end(&mut self, k: usize) {
        if k != self.next {
            self.ended.insert(k);
            return;
        }
        self.next += 1;
        while self.ended.remove(&self.next) {
            self.next += 1;
        }
    }
}

pub(crate) use crate::guard::{HandshakeMark, Handshakes, Part, part_comm, part_stream};

/// An NCCL call of the lane service, run by whoever holds the issue lock
/// ([`crate::guard::IssueLock::later`]).
pub(crate) type Assist = crate::guard::Queued;

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Queues, on `held`'s communicator and `stream`, a one-byte send to
/// `peer` from the rank's warm-up bytes and a one-byte recv from it into
/// them: both, or only the one `only` names. How duplex connects a
/// communicator before its first op (R7), and primes NCCL (to itself).
///
/// # Safety
/// `warmup` is [`RankCtx::warmup`] (it outlives the communicators'
/// kernels), `stream` is live, and the caller builds a group under the
/// rank's issue lock (P1, P2 of [`crate::guard`]).
pub(crate) unsafe fn exchange_byte(
    held: &comm::NcclUse<'_>,
    warmup: u64,
    peer: i32,
    only: Option<Dir>,
    stream: *mut std::ffi::c_void,
) -> Result<()> {
    // SAFETY: as the caller promised.
    unsafe {
        if only != Some(Dir::Recv) {
            held.send(warmup, 1, DType::U8.nccl(), peer, stream)?;
        }
        if only != Some(Dir::Send) {
            held.recv(warmup + 1, 1, DType::U8.nccl(), peer, stream)?;
        }
    }
    Ok(())
}

/// Whether the work queued on `stream` so far finishes within `timeout`.
pub(crate) fn drained(stream: &Stream, timeout: Duration) -> Result<bool> {
    let ev = Event::new(false)?;
    ev.record(stream)?;
    poll(timeout, || ev.done())
}

/// Everything a rank needs to create its context.
pub(crate) struct RankSetup {
    pub rank: Rank,
    pub world_size: u32,
    pub policy: Policy,
    pub opts: Options,
    pub lib: &'static Nccl,
    pub device: Arc<Device>,
    pub world: Comm,
    pub board: Arc<dyn Board>,
    pub registry: Arc<Registry>,
    pub health: Arc<dyn Health>,
    /// The job's copy-engine lanes ([`copy_lanes`]), or none.
    pub copy: CopyLanes,
    /// Across processes, the arena its buffers for copy-engine ops come
    /// from ([`crate::copy::ipc::lanes`]).
    pub arena: Option<Arc<crate::cuda::Arena>>,
}

impl RankCtx {
    /// Creates the rank's lanes from its world communicator, in an order
    /// every rank follows, and connects them.
    pub(crate) fn create(s: RankSetup) -> Result<Arc<RankCtx>> {
        let RankSetup {
            rank,
            world_size: n,
            policy,
            opts,
            lib,
            device,
            world,
            board,
            registry,
            health,
            copy: copy_lanes,
            arena,
        } = s;
        let mut streams = Vec::new();
        let reg_stream = |name: &str| registry.stream(rank, name);
        let new_stream = |name: &str, streams: &mut Vec<NcclStream>| -> Result<NcclStream> {
            let st = NcclStream(Arc::new(StreamInner::new(
                Stream::new()?,
                name,
                rank,
                (reg_stream(name), registry.run()),
                &device,
            )));
            streams.push(st.clone());
            Ok(st)
        };
        registry.comm(0, "world", &world.members, opts.warm);
        let default_stream = new_stream("default", &mut streams)?;
        let lanes = Lanes::new(n);
        let mut costs = Vec::new();
        let lazy = opts.lanes == LaneMode::Lazy;
        if lazy && let Ok(v) = std::env::var("NCCL_COMM_ID") {
            return Err(Error::Invalid {
                at: "NCCL_COMM_ID".into(),
                message: format!(
                    "NCCL_COMM_ID={v} gives every communicator the same unique id, so lanes cannot be made on first use; unset it, or use eager lanes"
                ),
            });
        }
        // NCCL's variable overrides every communicator's config: children
        // would share the world's resources, and NCCL forbids calls on a
        // parent and its child in parallel, which duplex makes (a split
        // waits while the rank's other threads issue on lanes).
        if let Ok(v) = std::env::var("NCCL_COMM_SPLIT_SHARE_RESOURCES")
            && v.trim() != "0"
        {
            return Err(Error::Invalid {
                at: "NCCL_COMM_SPLIT_SHARE_RESOURCES".into(),
                message: format!(
                    "NCCL_COMM_SPLIT_SHARE_RESOURCES={v} makes every communicator duplex splits share the world communicator's resources, and NCCL then forbids calls on a parent and its children in parallel, which duplex makes (a split waits for the other ranks while the rank's other threads issue on its lanes): unset it, or set it to 0"
                ),
            });
        }
        let mut comms = vec![world.clone()];
        let mut logical = 1u32;
        // Every rank walks the same pairs in the same order: each split is
        // collective over the world communicator.
        // Lazily made lanes keep the numbers eager ones have.
        if lazy {
            logical +=
                u32::try_from(compile::lane_count(policy, n)).map_err(|_| Error::Invalid {
                    at: "world size".into(),
                    message: format!("{n} ranks have more lanes than duplex numbers"),
                })?;
        }
        let eager_pairs = compile::lane_pairs(policy, n).filter(|_| !lazy);
        for (a, b) in eager_pairs {
            let (name, members, _) = compile::lane(policy, a, Dir::Send, b);
            let before = device.memory().map(|m| m.0).unwrap_or(0);
            let start = Instant::now();
            // Lanes connected at creation are blocking communicators:
            // their calls never wait for a peer's host (see `watchdog`).
            let connected = compile::lane_connected(policy, opts.warm);
            let comm = comm::split(
                lib,
                &world,
                rank,
                &members,
                logical,
                &name,
                opts.timeout,
                opts.ctas,
                connected,
                None,
                &mut || Ok(()),
            )?;
            registry.comm(logical, &name, &members, connected);
            logical += 1;
            let Some(comm) = comm else { continue };
            let stream = new_stream(&name, &mut streams)?;
            let peer = if a == rank { b } else { a };
            let end = LaneEnd {
                name: name.clone(),
                comm: comm.clone(),
                stream,
            };
            match policy {
                Policy::PerDirection => {
                    let dir = if a == rank { Dir::Send } else { Dir::Recv };
                    lanes.set(peer, dir, end);
                }
                Policy::Shared => {
                    lanes.set(peer, Dir::Send, end.clone());
                    lanes.set(peer, Dir::Recv, end);
                }
            }
            comms.push(comm.clone());
            let after = device.memory().map(|m| m.0).unwrap_or(0);
            // SAFETY: held, and this is the rank's only thread so far.
            let stats = unsafe { comm.enter()?.call(|lib, raw| Ok(lib.memory(raw.0))) }?;
            costs.push(LaneCost::measured(
                name,
                start,
                stats,
                (before as u64, after as u64),
                "free device memory before and after",
            ));
        }
        // The parent of user communicators (`Transport::comm`), split off
        // the world by every rank here, where no user code runs yet: a
        // user's split waits for the other ranks on it, non-blocking and
        // without the issue lock, and leaves the world communicator free
        // for the rank's other threads (R11: a call on one communicator
        // holds back calls on that one only).
        let splits = {
            let before = device.memory().map(|m| m.0).unwrap_or(0);
            let start = Instant::now();
            let all: Vec<Rank> = (0..n).collect();
            let splits = comm::split(
                lib,
                &world,
                rank,
                &all,
                SPLITS_LOGICAL,
                SPLITS,
                opts.timeout,
                // It launches nothing: one channel.
                (Some(1), Some(1)),
                false,
                None,
                &mut || Ok(()),
            )?
            .ok_or_else(|| Error::Aborted(format!("{SPLITS} was not made on rank {rank}")))?;
            let after = device.memory().map(|m| m.0).unwrap_or(0);
            // SAFETY: held, and this is the rank's only thread so far.
            let stats = unsafe { splits.enter()?.call(|lib, raw| Ok(lib.memory(raw.0))) }?;
            costs.push(LaneCost::measured(
                SPLITS.to_string(),
                start,
                stats,
                (before as u64, after as u64),
                "free device memory before and after",
            ));
            comms.push(splits.clone());
            splits
        };
        // Copy-engine lanes: numbered after the NCCL lanes, in the same order
        // on every rank, each declared by every rank (as the lanes are).
        let mut copy = HashMap::new();
        if !copy_lanes.is_empty() {
            for (a, b) in compile::lane_pairs(Policy::PerDirection, n) {
                let (name, members, _) = compile::copy_lane(a, Dir::Send, b);
                registry.copy_lane(logical, &name, &members);
                if a == rank || b == rank {
                    let lane = copy_lanes
                        .iter()
                        .find(|(pair, _)| *pair == (a, b))
                        .map(|(_, l)| l.clone())
                        .ok_or_else(|| Error::Aborted(format!("{name} was not made")))?;
                    let key = if a == rank {
                        (b, Dir::Send)
                    } else {
                        (a, Dir::Recv)
                    };
                    copy.insert(
                        key,
                        Arc::new(CopyEnd {
                            name,
                            logical,
                            lane,
                        }),
                    );
                }
                logical += 1;
            }
        }
        device.bind()?;
        let warmup = Memory::zeroed(2)?;
        let ctx = Arc::new(RankCtx {
            rank,
            world_size: n,
            policy,
            lib,
            lanes,
            maker: OnceLock::new(),
            service: Mutex::new(None),
            warmup,
            closed: AtomicBool::new(false),
            copy_ops: Default::default(),
            copy,
            arena,
            world,
            splits,
            split_turns: Mutex::new(SplitTurns::default()),
            default_stream,
            streams: Mutex::new(streams),
            comms: Mutex::new(comms),
            issue: IssueLock::default(),
            handshakes: Handshakes::default(),
            order: Mutex::new(duplex::order::Order::new()),
            ops: Ledger::default(),
            board,
            registry,
            health,
            user_comms: AtomicUsize::new(0),
            first_user_logical: logical,
            lost: Mutex::new(Vec::new()),
            spawned: Arc::default(),
            published_for_peer: AtomicBool::new(false),
            fired: AtomicBool::new(false),
            fired_for_peer: AtomicBool::new(false),
            costs: Mutex::new(costs),
            device,
            opts,
        });
        watchdog(&ctx);
        // Per-direction lanes are connected now (R6, R7); with `warm`, the
        // world communicator and shared lanes too. One group per rank holding
        // every connection: a group's ops cannot block each other (R8).
        let mut warm: Vec<(Comm, Option<Dir>)> = Vec::new();
        if ctx.policy == Policy::PerDirection || ctx.opts.warm {
            warm.extend(
                ctx.lanes
                    .iter()
                    .map(|(_, dir, e)| (e.comm.clone(), ctx.lane_direction(dir))),
            );
        }
        if ctx.opts.warm {
            warm.push((ctx.world.clone(), None));
        }
        if let Err(e) = ctx.connect(&warm) {
            // Its kernels may wait for a peer for ever: stop them all before
            // anything is freed (P8 of `crate::guard`), not one
            // communicator at a time as dropping them would.
            ctx.abort_all();
            return Err(e);
        }
        // Last, so that no error path leaves the service running.
        if lazy {
            if let Err(e) = ctx.prime() {
                ctx.abort_all();
                return Err(e);
            }
            let maker = Arc::new(LaneMaker::new(
                rank,
                n,
                policy,
                ctx.opts.timeout,
                ctx.board.clone(),
                NcclKit {
                    ctx: Arc::downgrade(&ctx),
                },
            ));
            let _ = ctx.maker.set(maker.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("duplex lanes {rank}"))
                .spawn(move || maker.serve());
            match spawned {
                Ok(service) => *lock(&ctx.service) = Some(service),
                Err(e) => {
                    ctx.abort_all();
                    return Err(Error::Aborted(format!(
                        "starting rank {rank}'s lane service: {e}"
                    )));
                }
            }
        }
        Ok(ctx)
    }

    /// Runs the lane service's NCCL calls that wait for the issue lock,
    /// which the caller holds.
    pub(crate) fn assist(&self, issuing: &Issuing<'_>) {
        self.issue.run_queued(issuing);
    }

    /// Waits until `comm`'s launch is done ([`CommInner::ready_with`]),
    /// running the lane service's queued NCCL calls meanwhile under
    /// `issuing`, which the caller holds.
    pub(crate) fn ready_assisting(
        &self,
        comm: &CommInner,
        issuing: &Issuing<'_>,
        what: &str,
    ) -> Result<()> {
        Ok(comm.ready_with(self.opts.timeout, what, &mut || {
            self.assist(issuing);
            Ok(())
        })?)
    }

    /// Why `buf` cannot be used yet ([`BufState::late_copy`]); never for a
    /// rank without copy-engine lanes, whose launches and host accesses
    /// then take no lock for it.
    pub(crate) fn late_copy(&self, buf: &BufState) -> Option<String> {
        if self.copy.is_empty() {
            return None;
        }
        buf.late_copy()
    }

    /// Queues an NCCL call of the lane service, and runs the queue now if
    /// the issue lock is free.
    pub(crate) fn assist_later(&self, job: Assist) {
        self.issue.later(job);
    }

    /// Runs the queued NCCL calls of the lane service if the issue lock is
    /// free; else whoever holds it will, before it lets it go.
    pub(crate) fn assist_if_free(&self) {
        drop(self.issue.try_lock());
    }

    /// The lane toward (`Send`) or from (`Recv`) `peer`: made at creation,
    /// or under [`LaneMode::Lazy`] made now if it is not yet (waiting, up
    /// to the deadline, for the two ranks' lane services). `None` for no
    /// lane (this rank itself, a rank outside the job).
    pub(crate) fn lane_end(&self, peer: Rank, dir: Dir) -> Result<Option<&LaneEnd>> {
        if let Some(end) = self.lanes.get(peer, dir) {
            return Ok(Some(end));
        }
        let Some(maker) = self.maker.get() else {
            return Ok(None);
        };
        let Some(spec) = maker.spec(peer, dir) else {
            return Ok(None);
        };
        // A lane not made because another rank failed (its communicators
        // aborted for it, its store gone) names that rank; no lock is held
        // here, so this may wait for the health monitor.
        maker
            .need(&spec)
            .map_err(|e| self.error_within(e, &format!("making lane {}", spec.name), patience()))?;
        Ok(self.lanes.get(peer, dir))
    }

    /// Launches NCCL work once before any user code runs: a message of the
    /// rank to itself on the world communicator, in one group (R12; it
    /// needs no connection, R7). NCCL's first communicator and first launch
    /// of a process wait for every kernel running on the device (L1 of
    /// `docs/semantics.md`, measured on one H200); with lanes made on first
    /// use, neither may be a lane made while the rank's kernels wait for
    /// their peers. The world communicator is the first; this is the launch.
    fn prime(&self) -> Result<()> {
        self.device.bind()?;
        let stream = Stream::new()?;
        let me = self.world.rank_of(self.rank).unwrap_or(0);
        let issuing = self.issue.lock();
        let held = [self.world.enter()?];
        // SAFETY: the warm-up bytes; the stream is live; a group under
        // the issue lock.
        let end = issuing.group(&self.lib, &held, || unsafe {
            exchange_byte(&held[0], self.warmup.ptr(), me, None, stream.raw())
        })?;
        drop(held);
        if !end? {
            self.world.ready(self.opts.timeout, "priming NCCL")?;
        }
        drop(issuing);
        if !drained(&stream, self.opts.timeout)? {
            return Err(Error::Aborted(format!(
                "rank {}'s first NCCL launch (a message to itself) did not finish within {:?}",
                self.rank, self.opts.timeout
            )));
        }
        Ok(())
    }

    /// The one direction this rank connects on its lane of direction `dir`
    /// (`None`: both), by [`Options::lane_connect`].
    pub(crate) fn lane_direction(&self, dir: Dir) -> Option<Dir> {
        (self.policy == Policy::PerDirection && self.opts.lane_connect == LaneConnect::OneWay)
            .then_some(dir)
    }

    /// Connects `comms` by a one-byte exchange between every pair of their
    /// members, in one group: each way, or only the way a comm's `Dir`
    /// says (this rank's send side, or its receive side).
    pub(crate) fn connect(&self, comms: &[(Comm, Option<Dir>)]) -> Result<()> {
        let mut seen = Vec::new();
        let comms: Vec<&(Comm, Option<Dir>)> = comms
            .iter()
            .filter(|(c, _)| {
                let new = !seen.contains(&c.logical);
                seen.push(c.logical);
                new
            })
            .collect();
        if comms.is_empty() {
            return Ok(());
        }
        self.device.bind()?;
        let stream = Stream::new()?;
        // NCCL refuses blocking and non-blocking communicators in one group.
        for blocking in [true, false] {
            let group: Vec<&&(Comm, Option<Dir>)> = comms
                .iter()
                .filter(|(c, _)| c.blocking == blocking)
                .collect();
            if group.is_empty() {
                continue;
            }
            let issuing = self.issue.lock();
            let held = group
                .iter()
                .map(|(c, _)| c.enter())
                .collect::<Result<Vec<_>>>()?;
            let end = issuing.group(&self.lib, &held, || {
                for ((c, only), h) in group.iter().zip(&held) {
                    for peer in &c.members {
                        if *peer == self.rank {
                            continue;
                        }
                        let p = c.rank_of(*peer).unwrap_or(0);
                        // SAFETY: the warm-up bytes; the stream is live; a
                        // group under the issue lock.
                        unsafe { exchange_byte(h, self.warmup.ptr(), p, *only, stream.raw())? };
                    }
                }
                Ok(())
            })?;
            if let Err(e) = end {
                return Err(self.watchdog_error(e, "connecting the lanes"));
            }
            drop(held);
            // Under the issue lock still: no other NCCL call of the rank
            // until the group's communicators are ready.
            for c in &group {
                self.ready_assisting(&c.0, &issuing, "connecting")?;
            }
            // Their sides are connected (R7): a launch on them opens none.
            for (c, only) in &group {
                for peer in c.members.iter().filter(|p| **p != self.rank) {
                    self.handshakes.connect_with(c.logical, *peer, *only);
                }
            }
            drop(issuing);
        }
        if !drained(&stream, self.opts.timeout)? {
            return Err(Error::Aborted(format!(
                "connecting the lanes of rank {} did not finish within {:?}",
                self.rank, self.opts.timeout
            )));
        }
        Ok(())
    }

    /// The ops not completed: whole launches (P7 of [`crate::guard`]).
    pub(crate) fn pending(&self) -> Vec<Arc<Issued>> {
        self.ops.pending()
    }

    /// Another rank's failure, asked on every 64th poll of a wait
    /// (`checks` counts the polls, which spin at first: not every one asks).
    pub(crate) fn failed_peer(&self, checks: &mut u32) -> Option<(Rank, String)> {
        *checks = checks.wrapping_add(1);
        if checks.is_multiple_of(64) {
            self.health.failed(self.rank)
        } else {
            None
        }
    }

    /// A pending op of this rank (of any of its threads: the rank's end
    /// waits for it, so the rank is stuck whichever op a wait is for) that
    /// can never complete, and why: its
    /// peer finished cleanly without issuing what would match it (a recv
    /// past the sends the peer issued on its channel, or a send past its
    /// recvs: [`crate::health::unmatched_by`]). Reads what the health
    /// monitor knows of finished ranks (across processes, asking starts
    /// its watch), then each such peer's counts: in one process the
    /// registry's, across processes those the peer posted as it finished,
    /// as the monitor read them ([`Health::finished_counts`]: no store
    /// request here, so a wait never blocks on the store). A send NCCL may have completed
    /// into its channel's buffer (R5) without its recv is judged only
    /// once the rank's completion fences are flushed: one still pending
    /// then waits for its recv.
    pub(crate) fn unmatchable(&self) -> Option<String> {
        let pending = self.pending();
        let mut peers: Vec<Rank> = pending
            .iter()
            .map(|op| op.meta.peer)
            .filter(|p| *p != self.rank)
            .collect();
        peers.sort_unstable();
        peers.dedup();
        peers.retain(|p| self.health.finished_among(&[*p]).is_some());
        if peers.is_empty() {
            return None;
        }
        let mut found = None;
        for op in &pending {
            let m = &op.meta;
            if !peers.contains(&m.peer) {
                continue;
            }
            let (from, to) = match m.dir {
                Dir::Send => (self.rank, m.peer),
                Dir::Recv => (m.peer, self.rank),
            };
            let (one, posted);
            let theirs: &[ChannelCount] = match self.registry.issued_on(m.logical(), from, to) {
                // One process: the registry's issue check counts both sides.
                Some(c) => {
                    one = [c];
                    &one
                }
                None => match self.health.finished_counts(m.peer) {
                    Some(c) => {
                        posted = c;
                        &posted
                    }
                    None => continue,
                },
            };
            let unmatched =
                crate::health::unmatched_by(self.rank, m.peer, m.dir, m.logical(), m.fifo, theirs);
            tracing::debug!(
                rank = self.rank,
                peer = m.peer,
                op = %m.text(),
                comm = m.logical(),
                fifo = m.fifo,
                ?unmatched,
                "a pending op whose peer finished"
            );
            if let Some(issued) = unmatched {
                found = Some((op.clone(), issued));
                break;
            }
        }
        let (op, issued) = found?;
        if op.meta.dir == Dir::Send {
            self.flush_fences(Duration::from_millis(20));
            if !self.pending().iter().any(|p| Arc::ptr_eq(p, &op)) {
                tracing::debug!(
                    rank = self.rank,
                    "the unmatched send completed into its channel's buffer"
                );
                return None;
            }
        }
        let m = &op.meta;
        let (theirs, mine) = match m.dir {
            Dir::Send => ("recvs from", "send"),
            Dir::Recv => ("sends to", "recv"),
        };
        Some(format!(
            "rank {peer} finished having issued {issued} {theirs} rank {me} on {comm}, so `{text}` ({at}, thread {thread}), {mine} {n} of rank {me} there, is never matched and rank {me} can never finish",
            peer = m.peer,
            me = self.rank,
            thread = m.thread,
            comm = m.comm_name(),
            text = m.text(),
            at = m.place(),
            n = m.fifo + 1,
        ))
    }

    /// [`poll`] of `done` for up to `limit`, ended early by another rank's
    /// failure, asked as every wait asks ([`RankCtx::failed_peer`]):
    /// `Ok(Err(failure))` then, else whether `done` held in time.
    pub(crate) fn poll_unless_failed(
        &self,
        limit: Duration,
        mut done: impl FnMut() -> Result<bool>,
    ) -> Result<std::result::Result<bool, (Rank, String)>> {
        let mut checks = 0u32;
        let mut failed = None;
        let held = poll(limit, || {
            if let Some(f) = self.failed_peer(&mut checks) {
                failed = Some(f);
                return Ok(true);
            }
            done()
        })?;
        Ok(failed.map_or(Ok(held), Err))
    }

    /// Cuts the registry's trace ([`Registry::cut_if_long`]) when it is
    /// long and this rank is quiet: no launch under way (the issue lock,
    /// taken only if it is free, and no launch in its handshake, which
    /// waits without the lock) and nothing in flight (the ledger holds
    /// no op). Called when a `synchronize` or `sync_stream` returns, where
    /// a rank is most often quiet; a rank that is never quiet keeps its
    /// whole trace, as before.
    pub(crate) fn cut_if_quiet(&self) {
        if !self.registry.long() {
            return;
        }
        let Some(_issuing) = self.issue.try_lock() else {
            return;
        };
        // A launch in its handshake is under way without the lock: its ops
        // are in the registry, not yet in the ledger.
        if self.handshakes.any() || !self.ops.quiet() {
            return;
        }
        let folded = self.registry.cut_if_long();
        if folded > 0 {
            tracing::debug!(
                rank = self.rank,
                folded,
                "cut this rank's trace where it is quiet"
            );
        }
    }

    /// Records the open completion fence of each stream of the rank, and
    /// waits up to `within` for those to complete (a stream that is idle
    /// completes its fence at once; one behind a stuck op never does). A
    /// record that fails leaves its ops never known done (P6).
    pub(crate) fn flush_fences(&self, within: Duration) {
        let streams = lock(&self.streams).clone();
        let sealed: Vec<_> = streams
            .iter()
            .filter_map(|s| s.0.fences.flush().ok().flatten())
            .collect();
        if !sealed.is_empty() && !within.is_zero() {
            let _ = poll(within, || Ok(sealed.iter().all(|f| f.done())));
        }
    }

    /// The error of an NCCL call that failed: after the watchdog aborted the
    /// communicators, a hang; an error another rank caused names it
    /// ([`RankCtx::cause`]).
    pub(crate) fn watchdog_error(&self, e: Error, what: &str) -> Error {
        // No waiting, and no request (`culprit` reads what the monitor
        // knows): callers may hold the issue lock and communicators.
        self.error_within(e, what, Duration::ZERO)
    }

    /// [`RankCtx::watchdog_error`], waiting up to `patience` for the health
    /// monitor to name the rank that caused `e`: for callers that hold no
    /// lock.
    pub(crate) fn error_within(&self, e: Error, what: &str, patience: Duration) -> Error {
        if let Some((r, why)) = self.peer_cause() {
            return Error::Aborted(format!(
                "{what}: rank {r} failed ({why}), so rank {}'s communicators were aborted ({e})",
                self.rank
            ));
        }
        if self.fired.load(Ordering::Acquire) {
            return Error::Aborted(format!(
                "{what}: an NCCL call of rank {} did not return within {:?}; the watchdog aborted the rank's communicators ({e})",
                self.rank, self.opts.timeout
            ));
        }
        let everyone: Vec<Rank> = (0..self.world_size).collect();
        match self.cause(&everyone, &e, patience) {
            Some((r, PeerCause::Failed(why))) => Error::Aborted(format!(
                "{what}: rank {r} failed ({why}); on rank {}: {e}",
                self.rank
            )),
            Some((r, PeerCause::Finished)) => {
                Error::Aborted(format!("{what}: {} ({e})", finished_before(r, self.rank)))
            }
            None => e,
        }
    }

    /// Which other rank of `members` caused `e`, when `e` is an error
    /// another rank can cause (NCCL's remote and system errors, say a
    /// peer's process that exited or its socket that closed, or an abort):
    /// a rank known to have failed, or one that finished while work of
    /// this rank with it was pending (on NVLink this rank would hang
    /// instead, and its report would name what was never issued). Waits up
    /// to `patience` for one: NCCL's network transport sees a peer's socket
    /// close before duplex's health monitor sees the peer's silence
    /// ([`patience`] is that wait).
    pub(crate) fn cause(
        &self,
        members: &[Rank],
        e: &Error,
        patience: Duration,
    ) -> Option<(Rank, PeerCause)> {
        let remote = nccl_remote(e) || matches!(e, Error::Aborted(_));
        // This rank's own watchdog fired for its own hang: its errors are
        // its own (`culprit` also stops at a failure this rank posted).
        // (The watchdog sets `fired` before `fired_for_peer` when it fires
        // for a peer: a failure known elsewhere marks that case.)
        let own_hang = self.fired.load(Ordering::Acquire)
            && !self.fired_for_peer.load(Ordering::Acquire)
            && self.health.failed(self.rank).is_none();
        if !remote || own_hang {
            return None;
        }
        crate::health::culprit(&*self.health, self.rank, members, patience)
    }

    /// The failed rank (and why) for which the watchdog aborted this rank's
    /// communicators, if that is why they were aborted.
    pub(crate) fn peer_cause(&self) -> Option<(Rank, String)> {
        if self.fired_for_peer.load(Ordering::Acquire) {
            self.health.failed(self.rank)
        } else {
            None
        }
    }

    /// Every communicator of the rank (lanes and user communicators are in
    /// `comms` too, but a lane's entry is kept for certainty).
    fn all_comms(&self) -> Vec<Comm> {
        let mut all = lock(&self.comms).clone();
        all.extend(self.lanes.ends().map(|e| e.comm.clone()));
        all.push(self.world.clone());
        all
    }

    /// Aborts every communicator of the rank, together (P8 of
    /// [`crate::guard`]): each is freed now, or when the last thread that
    /// holds it leaves (P4).
    pub(crate) fn abort_all(&self) {
        // Before the communicators are collected (under their lock): a lane
        // service that adds one later sees the flag and aborts it itself.
        self.closed.store(true, Ordering::Release);
        // Copy-engine lanes first: aborting them releases the streams that
        // wait on them, and never blocks; freeing a communicator waits for
        // every stream of the device (P8 of [`crate::guard`]).
        let why = format!("rank {}'s communicators and lanes were aborted", self.rank);
        // Every lane told and released before any lane's lock is taken: a
        // stream must not wait on one lane because another's is held.
        for end in self.copy.values() {
            end.lane.let_go(&why);
        }
        for end in self.copy.values() {
            end.lane.abort(&why);
        }
        abort_together(&self.all_comms());
    }

    /// Frees the aborted communicators that only a call blocked inside NCCL
    /// still holds, interrupting it (P5 of [`crate::guard`]). The watchdog
    /// calls it once the rank's NCCL call has been in progress for longer
    /// than the deadline plus [`FORCE_GRACE`] after the abort.
    fn force_free_all(&self) -> usize {
        let mut n = 0;
        for c in self.all_comms() {
            // SAFETY: the watchdog calls this only when the rank's one NCCL
            // call (the issue lock lets one thread call at a time) has lasted
            // longer than the deadline and then `FORCE_GRACE` after the abort
            // refused every new call: a holder counted inside NCCL for that
            // long is blocked there, not about to enter.
            if unsafe { c.cell.force_free() } {
                n += 1;
            }
        }
        n
    }

    /// The end of a run: waits (under the deadline) for every op of this
    /// rank; if some never complete, aborts every communicator of the rank
    /// so that no kernel stays stuck, waits briefly for the aborted work to
    /// stop, and leaks the buffers of what is still not complete rather than
    /// free memory a kernel may use. Never blocks past the deadline.
    ///
    /// A rank that `failed` has posted its failure, and every other rank
    /// ends its work with it on learning of that, so whether its ops
    /// complete no longer matters: those not complete within
    /// [`TEARDOWN_AFTER_FAILURE`] are aborted then, not at the deadline (a
    /// rank whose wait ended on an error from NCCL, a peer's closed
    /// connection say, left its ops pending, some of which never would).
    pub(crate) fn teardown(&self, failed: bool) {
        let _ = self.device.bind();
        // What the ops' fences say is all the waits below know.
        self.flush_fences(Duration::ZERO);
        // No lane is made from now on; lanes in progress are abandoned.
        if let Some(m) = self.maker.get() {
            m.stop();
        }
        let service = lock(&self.service).take();
        if let Some(s) = service {
            let asked = Instant::now();
            // The service stops within a poll; an abandon that waits on the
            // device (P8) is what could keep it: never wait past the deadline.
            let stopped = poll(self.opts.timeout, || Ok(s.is_finished()));
            if matches!(stopped, Ok(true)) {
                let _ = s.join();
                tracing::debug!(
                    rank = self.rank,
                    ms = asked.elapsed().as_secs_f64() * 1e3,
                    "the lane service stopped"
                );
            } else {
                tracing::warn!(
                    rank = self.rank,
                    "the lane service did not stop: leaving it"
                );
            }
        }
        let settle = if failed {
            TEARDOWN_AFTER_FAILURE.min(self.opts.timeout)
        } else {
            self.opts.timeout
        };
        if matches!(poll(settle, || Ok(self.pending().is_empty())), Ok(true)) {
            return;
        }
        tracing::warn!(
            rank = self.rank,
            "ops still pending at the end of the run: aborting this rank's communicators"
        );
        self.abort_all();
        if !matches!(
            poll(Duration::from_secs(2), || Ok(self.pending().is_empty())),
            Ok(true)
        ) {
            let stuck = self.ops.leak_pending();
            tracing::warn!(
                rank = self.rank,
                ops = stuck,
                "ops did not stop after abort: leaking their buffers"
            );
        }
    }
}

/// How long the end of a rank that failed waits for its ops to complete
/// before it aborts them ([`RankCtx::teardown`]).
pub(crate) const TEARDOWN_AFTER_FAILURE: Duration = Duration::from_millis(100);

/// Aborts `comms` together (P8 of [`crate::guard`]): every abort flag is
/// raised before any communicator is freed. The names of those this call
/// aborted (they were live).
pub(crate) fn abort_together(comms: &[Comm]) -> Vec<String> {
    let cells: Vec<_> = comms.iter().map(|c| &c.cell).collect();
    crate::guard::abort_all(&cells)
        .into_iter()
        .map(|i| comms[i].name.clone())
        .collect()
}

/// How long after aborting the communicators of a rank whose NCCL call
/// overstayed the deadline the watchdog waits before it frees those that
/// the call still holds, to interrupt it (P5 of [`crate::guard`]).
pub(crate) const FORCE_GRACE: Duration = Duration::from_millis(500);

/// Starts the rank's watchdog: a thread that aborts every communicator of
/// the rank when one NCCL call has been in progress longer than the
/// deadline (a blocking communicator whose call waits on a peer, say), and
/// if that call still has not returned `FORCE_GRACE` later, frees the
/// communicators it holds to interrupt it (P5 of [`crate::guard`]), so
/// that no thread stays blocked inside NCCL. Each tick it also settles the
/// registry's live model. It ends with the rank.
pub(crate) fn watchdog(ctx: &Arc<RankCtx>) {
    let weak = Arc::downgrade(ctx);
    let limit = ctx.opts.timeout;
    let _ = std::thread::Builder::new()
        .name(format!("duplex watchdog {}", ctx.rank))
        .spawn(move || {
            let mut fired_at: Option<Instant> = None;
            loop {
                std::thread::sleep(Duration::from_millis(20));
                let Some(ctx) = weak.upgrade() else { return };
                // The live model applies what the ranks issued since the
                // last tick, off their issue path (`Registry::settle`).
                ctx.registry.settle_now_and_then();
                // Another rank of the job failed: this rank's work cannot
                // complete, so nothing of it may stay blocked inside NCCL.
                if let Some((r, why)) = ctx.health.failed(ctx.rank)
                    && !ctx.fired.swap(true, Ordering::AcqRel)
                {
                    ctx.fired_for_peer.store(true, Ordering::Release);
                    tracing::warn!(
                        rank = ctx.rank,
                        failed = r,
                        why = %why,
                        "another rank failed: aborting this rank's communicators"
                    );
                    // Across processes the failed rank's analysis joins
                    // the others' traces: a snapshot of this rank's goes
                    // now, whether or not one of its threads was waiting
                    // (a thread that was issuing, or computing, publishes
                    // nothing else), under a key of its own, so that it
                    // never takes the place of a later publish.
                    // On a thread of its own: the abort can wait for the
                    // device (P8 of `crate::guard`; on one GPU with one
                    // hardware queue, HQ, it outlasted the failed rank's
                    // wait for traces), and a store that is gone makes the
                    // publish wait for its timeout.
                    if ctx.health.remote() {
                        let (health, rank) = (ctx.health.clone(), ctx.rank);
                        let trace = ctx.registry.trace();
                        let _ = std::thread::Builder::new()
                            .name(format!("duplex publish {rank}"))
                            .spawn(move || health.publish_early(rank, &trace));
                    }
                    ctx.abort_all();
                    fired_at = Some(Instant::now());
                    continue;
                }
                overstay(&ctx, limit, &mut fired_at);
                // Copy-engine lanes: what needs no device call (a source
                // across processes learns from the segment what was copied
                // or aborted). Each lane's service settles its copies and,
                // after an abort, releases every stream again
                // (`CopyLane::serve`): an event query can wait on the
                // driver while another thread is inside it, and the checks
                // above must never wait for one.
                for end in ctx.copy.values() {
                    end.lane.watch();
                }
            }
        });
}

/// The watchdog's check of the rank's NCCL call: one that has lasted past
/// the deadline `limit` aborts the rank's communicators; one still inside
/// NCCL `FORCE_GRACE` after that has them freed to interrupt it.
fn overstay(ctx: &Arc<RankCtx>, limit: Duration, fired_at: &mut Option<Instant>) {
    let Some(busy) = ctx.issue.busy_for() else {
        return;
    };
    if busy <= limit {
        return;
    }
    if !ctx.fired.swap(true, Ordering::AcqRel) {
        tracing::warn!(
            rank = ctx.rank,
            "an NCCL call overstayed the deadline: aborting the rank's communicators"
        );
        ctx.health.fail(
            ctx.rank,
            &format!(
                "an NCCL call of rank {} did not return within {:?}; its communicators were aborted",
                ctx.rank, ctx.opts.timeout
            ),
        );
        ctx.abort_all();
        *fired_at = Some(Instant::now());
    } else if fired_at.is_some_and(|t| t.elapsed() > FORCE_GRACE) {
        let n = ctx.force_free_all();
        if n > 0 {
            tracing::warn!(
                rank = ctx.rank,
                comms = n,
                "an NCCL call is still blocked after the abort: freeing its communicators to interrupt it"
            );
        }
    }
}

/// The text of a panic payload.
pub(crate) fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

#[cfg(test)]
mod tests {
    use super::SplitTurns;

    /// A spawned thread's error is the rank's exactly once, whichever of
    /// its end and its handle's drop (or join) comes first, and reaches a
    /// join that waits for it. Each round races a thread's end against its
    /// handle's drop on two OS threads, under the protocol
    /// `NcclRank::spawn` and `NcclThread`'s drop follow.
    #[test]
    fn a_spawned_threads_error_is_the_ranks_once_however_its_end_and_its_handle_race() {
        use super::{Handle, Spawned};
        use duplex::Error;
        use std::sync::{Arc, Mutex, mpsc};
        for round in 0..2_000usize {
            let spawned = Arc::new(Mutex::new(Spawned::default()));
            let failing = round % 3 != 0;
            let join = round % 4 == 0;
            let (tx, rx) = mpsc::channel();
            spawned
                .lock()
                .unwrap()
                .running
                .push((round, "t".into(), Handle::Held));
            let s2 = spawned.clone();
            let ender = std::thread::spawn(move || {
                if round % 2 == 0 {
                    std::thread::yield_now();
                }
                let r = if failing {
                    Err(Error::User(format!("round {round}")))
                } else {
                    Ok(())
                };
                s2.lock().unwrap().thread_ended(round, "t", r, &tx);
            });
            let mut seen_by_join = None;
            if join {
                // A join waits for the result, then drops the handle.
                seen_by_join = Some(rx.recv().expect("the result"));
            } else if round % 2 == 1 {
                std::thread::yield_now();
            }
            spawned.lock().unwrap().handle_dropped(round, join);
            drop(rx);
            ender.join().unwrap();
            let s = spawned.lock().unwrap();
            assert!(s.running.is_empty(), "round {round}: the thread ended");
            match (failing, join) {
                (true, true) => {
                    assert!(matches!(seen_by_join, Some(Err(_))), "round {round}");
                    assert_eq!(s.failed.len(), 1, "round {round}: and the rank");
                    assert_eq!(s.failed[0].3, Handle::Joined, "round {round}");
                }
                (true, false) => {
                    assert_eq!(s.failed.len(), 1, "round {round}: the rank sees it");
                    assert_eq!(
                        s.failed[0].3,
                        Handle::Dropped,
                        "round {round}: never joined"
                    );
                }
                (false, _) => assert!(s.failed.is_empty(), "round {round}"),
            }
        }
    }

    /// A thread that ends after its handle was dropped unjoined, or after a
    /// join gave up on it, is reported as such; one whose handle was held
    /// as it ended is reported as its handle went later (a join took its
    /// result, or it was dropped unjoined).
    #[test]
    fn a_failed_threads_report_says_what_became_of_its_handle() {
        use super::{Handle, Spawned};
        use duplex::Error;
        let fail = || Err(Error::User("boom".into()));
        let how = |s: &Spawned| s.first_error().unwrap().to_string();
        for (joined, says) in [
            (false, "never joined"),
            (true, "joined, and the rank's code went on"),
        ] {
            let mut s = Spawned::default();
            let (tx, rx) = std::sync::mpsc::channel();
            s.running.push((1, "t".into(), Handle::Held));
            s.thread_ended(1, "t", fail(), &tx);
            assert!(rx.try_recv().is_ok(), "the held handle got it");
            s.handle_dropped(1, joined);
            assert!(how(&s).contains(says), "{}", how(&s));
        }
        // Dropped before the end.
        let mut s = Spawned::default();
        let (tx, _rx) = std::sync::mpsc::channel();
        s.running.push((1, "t".into(), Handle::Held));
        s.handle_dropped(1, false);
        s.thread_ended(1, "t", fail(), &tx);
        assert!(how(&s).contains("never joined"), "{}", how(&s));
        // A join that gave up, then the thread's end and the handle's drop.
        let mut s = Spawned::default();
        let (tx, _rx) = std::sync::mpsc::channel();
        s.running.push((1, "t".into(), Handle::Held));
        s.handle_now(1, Handle::GaveUp);
        s.thread_ended(1, "t", fail(), &tx);
        s.handle_dropped(1, true);
        assert!(how(&s).contains("a join gave up on it"), "{}", how(&s));
        assert!(how(&s).contains("thread t") && how(&s).contains("boom"));
    }

    /// A launch in its handshake holds back other threads' launches on
    /// its parts, not its own thread's, nor launches on other parts, and
    /// only until its mark drops.
    #[test]
    fn a_handshake_holds_back_other_threads_on_its_parts_only() {
        let h = super::Handshakes::default();
        assert!(!h.holds(&[1, 2], 7));
        let mark = h.mark(3, &[2, 5]);
        assert!(h.holds(&[1, 2], 7));
        assert!(h.holds(&[5], 7));
        assert!(!h.holds(&[1, 4], 7), "other parts go on");
        assert!(!h.holds(&[2], 3), "its own thread is not held back");
        let other = h.mark(4, &[1]);
        drop(mark);
        assert!(!h.holds(&[2, 5], 7));
        assert!(h.holds(&[1], 7));
        drop(other);
        assert!(!h.holds(&[1, 2, 5], 7));
        assert!(!h.any());
    }

    /// A communicator and a stream of one number are different parts; a
    /// side is connected only once a group that opened it ended.
    #[test]
    fn streams_are_parts_of_their_own_and_sides_connect_one_by_one() {
        use super::{part_comm, part_stream};
        use duplex::Dir;
        let h = super::Handshakes::default();
        let mark = h.mark(3, &[part_comm(1), part_stream(4)]);
        assert!(h.any());
        assert!(h.holds(&[part_stream(4)], 7), "its stream");
        assert!(!h.holds(&[part_stream(1), part_comm(4)], 7));
        drop(mark);
        assert!(h.all_connected([]), "a launch to itself opens no side");
        assert!(!h.all_connected([(0, 1, Dir::Send)]));
        h.connect([(0, 1, Dir::Send)]);
        assert!(h.all_connected([(0, 1, Dir::Send)]));
        assert!(!h.all_connected([(0, 1, Dir::Send), (0, 1, Dir::Recv)]));
        assert!(!h.all_connected([(2, 1, Dir::Send)]), "per communicator");
    }

    /// Splits go in the order of their numbers; a call that ended before
    /// its turn (refused, or past its deadline) is skipped when it comes,
    /// and one that ends at its turn passes it on.
    #[test]
    fn split_turns_follow_the_numbers_and_skip_calls_that_ended() {
        let mut t = SplitTurns::default();
        assert!(t.is_turn(0) && !t.is_turn(1));
        // 2 and 3 end before their turn; 1 is still waiting.
        t.end(2);
        t.end(3);
        assert!(t.is_turn(0) && !t.is_turn(1));
        t.end(0);
        assert!(t.is_turn(1) && !t.is_turn(2));
        t.end(1);
        assert!(t.is_turn(4), "2 and 3 are skipped: {t:?}");
        t.end(4);
        assert!(t.is_turn(5) && t.ended.is_empty());
    }
}
