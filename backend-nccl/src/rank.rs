//! [`NcclRank`]: the NCCL backend's [`Transport`], one handle per host
//! thread of a rank, on the `RankCtx` its threads share; and the buffers
//! and threads it hands out.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::panic::Location;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use duplex::report::{BlockedCall, OpInfo, Stuck};
use duplex::transport::{DeviceBuffer, check};
use duplex::{DType, Dir, Element, Error, Hang, Lane, Place, Policy, Rank, Result, Transport};
use smallvec::{SmallVec, smallvec};

use crate::comm::{self, Comm, poll};
use crate::copy::Ticket;
use crate::ctx::{
    BufState, CopyEnd, EventInner, Issued, LaneCost, LastRecv, NcclComm, NcclEvent, NcclStream,
    OpEvent, OpMeta, RankCtx, StreamInner, Users, lock, panic_text,
};
use crate::cuda::{Event, HOST_COPY_LIMIT, Memory, Stream};
use crate::fence::Fences;
use crate::health::PeerCause;
use crate::lanes::LaneEnd;
use crate::nccl::Nccl;
use crate::registry::{self, Blocked, LaunchRec, OpRec};

/// How long a hang's analysis waits for the other processes' traces.
const GATHER_WAIT: Duration = Duration::from_secs(2);

/// How long a hang report waits for the completion fences it records to
/// complete (`RankCtx::flush_fences`): an idle stream's does at once.
const HANG_FLUSH: Duration = Duration::from_millis(20);

/// How long a wait lasts before it looks for an op that can never complete
/// because its peer finished without issuing its match
/// ([`RankCtx::unmatchable`]), or an `await_notify` for a peer that
/// finished without notifying: a fifth of the deadline, from half a second
/// to 30 s. Across processes the first look starts the health monitor's
/// watch for the wait's peers, a small store request per peer a heartbeat
/// until each is known to have finished (at 1,024 ranks 1.4x the plain
/// monitors' cost to the store, BENCHMARKS.md): a wait that ends sooner
/// never costs it.
fn unmatched_look(timeout: Duration) -> Duration {
    (timeout / 5).clamp(Duration::from_millis(500), Duration::from_secs(30))
}

/// How long a `join` waits for its thread, and the end of a rank for the
/// threads it never joined (`NcclRank::wait_spawned`): the thread's own
/// waits expire first (each at `timeout`), so half as long again and a
/// second more.
fn join_limit(timeout: Duration) -> Duration {
    timeout + timeout / 2 + Duration::from_secs(1)
}

/// What a hang's analysis replayed, in the report's words: what every
/// rank issued, or (across processes) what was missing from it, so that
/// a report never claims another rank will not issue what it only does
/// not know about.
fn replayed_from(me: Rank, missing: &[Rank], early: &[Rank], unjoined: Option<&str>) -> String {
    if let Some(why) = unjoined {
        return format!(
            "replayed from rank {me}'s own calls alone (the ranks' traces did not join: {why}), so what it says another rank will never issue is not known"
        );
    }
    let said = replayed_without(missing);
    if early.is_empty() {
        return said;
    }
    let names: Vec<String> = early.iter().map(|r| r.to_string()).collect();
    format!(
        "{said}; for rank(s) {} only the snapshot each published as it learned of the failure came (its own trace did not: a thread outside a duplex call, computing or blocked elsewhere, publishes nothing more), so what they did since is not known and the cycle may pass through a thread that has moved on",
        names.join(", ")
    )
}

/// [`replayed_from`]'s words for the ranks whose trace did not come.
fn replayed_without(missing: &[Rank]) -> String {
    match missing {
        [] => "replayed from what every rank issued".to_string(),
        [r] => format!(
            "replayed from what the ranks published, where rank {r}'s trace did not come within {GATHER_WAIT:?} (a rank that died, or is blocked where duplex does not see it, publishes none), so what it says rank {r} will never issue is not known"
        ),
        _ => {
            let names: Vec<String> = missing.iter().map(|r| r.to_string()).collect();
            format!(
                "replayed from what the ranks published, where the traces of ranks {} did not come within {GATHER_WAIT:?} (a rank that died, or is blocked where duplex does not see it, publishes none), so what it says they will never issue is not known",
                names.join(", ")
            )
        }
    }
}

/// The longest one slice of an `await_notify`, between checks of the
/// other ranks' health.
const AWAIT_SLICE: Duration = Duration::from_millis(250);

/// A buffer of device memory.
#[derive(Debug)]
pub struct NcclBuffer<E> {
    state: Arc<BufState>,
    len: usize,
    _e: PhantomData<fn() -> E>,
}

impl<E> DeviceBuffer for NcclBuffer<E> {
    fn len(&self) -> usize {
        self.len
    }
}

/// Why an object of another run is refused: its number could name one of
/// this run's.
fn stale(kind: &str) -> String {
    format!(
        "the {kind} was made by another run (each run starts with none: make it in the rank code)"
    )
}

/// A host thread started by `spawn`.
#[derive(Debug)]
pub struct NcclThread {
    name: String,
    registry_id: usize,
    result: std::sync::mpsc::Receiver<Result<()>>,
    handle: Option<std::thread::JoinHandle<()>>,
    /// The rank's spawned threads, told what became of this handle
    /// (`Drop`).
    spawned: Arc<Mutex<crate::ctx::Spawned>>,
    /// Whether a `join` took its result.
    joined: bool,
    /// The run that started it ([`Registry::run`](crate::Registry::run)).
    run: u64,
}

impl Drop for NcclThread {
    /// Tells the rank's record of its threads whether this handle was
    /// joined, under the lock the thread ends under: a thread still
    /// running then sends its result to no handle, and the error of one
    /// that ended says whether the rank's code saw it
    /// (`Spawned::first_error`).
    fn drop(&mut self) {
        lock(&self.spawned).handle_dropped(self.registry_id, self.joined);
    }
}

/// One host thread's handle on a rank.
#[derive(Debug)]
pub struct NcclRank {
    ctx: Arc<RankCtx>,
    thread: Arc<str>,
    thread_id: usize,
    group: RefCell<Option<Reqs>>,
    scoped: RefCell<Vec<NcclStream>>,
}

/// The ops of one launch. The issue path keeps its per-launch lists on the
/// stack up to this many ops (`smallvec`), so that a launch of a few ops
/// allocates only what outlives it (the trace's record and the ops it
/// tracks).
const INLINE_OPS: usize = 4;

/// The ops of one launch, on the stack up to [`INLINE_OPS`].
type Reqs = SmallVec<[Req; INLINE_OPS]>;

#[derive(Debug)]
struct Req {
    meta: OpMeta,
    ptr: u64,
    stream: NcclStream,
    buf: Arc<BufState>,
}

/// A launch's accesses of its buffers, for the device order (D1).
fn accesses(reqs: &[Req]) -> SmallVec<[(u64, duplex::order::Access<'_>); INLINE_OPS]> {
    reqs.iter()
        .map(|r| (r.buf.id, r.meta.access(r.stream.0.id)))
        .collect()
}

impl NcclRank {
    pub(crate) fn new(ctx: Arc<RankCtx>, thread: &str) -> NcclRank {
        let thread_id = ctx.registry.thread(ctx.rank, thread);
        NcclRank {
            ctx,
            thread: thread.into(),
            thread_id,
            group: RefCell::new(None),
            scoped: RefCell::new(Vec::new()),
        }
    }

    /// What each communicator duplex made for this rank cost to make: its
    /// lanes, the communicator that user communicators are split from
    /// (`splits (the parent of user communicators)`), and the user's
    /// communicators (`comm NAME`, the wait for the other ranks included).
    pub fn lane_costs(&self) -> Vec<LaneCost> {
        lock(&self.ctx.costs).clone()
    }

    /// How many ops this rank has issued on copy-engine lanes (C1), all
    /// threads together: what shows that messages of at least `copy_from`
    /// went by the copy engines.
    pub fn copy_ops(&self) -> u64 {
        self.ctx.copy_ops.load(Ordering::Relaxed)
    }

    /// The NCCL library in use.
    pub fn nccl(&self) -> &'static Nccl {
        self.ctx.lib
    }

    /// Waits up to `timeout` for `stream` to drain, without treating a
    /// timeout as a hang: `Ok(false)` when it has not drained. For probes
    /// that measure, not for programs.
    pub fn try_sync(&self, stream: &NcclStream, timeout: Duration) -> Result<bool> {
        self.ctx.device.bind()?;
        crate::ctx::drained(&stream.0.raw, timeout)
    }

    /// The device address of a buffer, for benchmarks that compare duplex
    /// with plain NCCL calls ([`NcclRank::raw_p2p`]).
    pub fn raw_ptr<E: Element>(&self, buf: &NcclBuffer<E>) -> u64 {
        buf.state.ptr()
    }

    /// A plain `ncclSend`/`ncclRecv` of `bytes` at `ptr` on a lane's
    /// communicator and `stream` (the lane's when `None`), bypassing duplex's
    /// bookkeeping: the baseline that benchmarks compare duplex with. It
    /// takes the rank's issue lock and, on a non-blocking communicator,
    /// waits out an operation NCCL reports in progress, as any correct
    /// caller must. It does not wait for another thread's launch in its
    /// handshake ([`crate::ctx::Handshakes`]): make it from a thread of
    /// its own, with no duplex launch under way on the rank (the
    /// benchmarks do).
    pub fn raw_p2p(
        &self,
        dir: Dir,
        peer: Rank,
        ptr: u64,
        bytes: usize,
        stream: Option<&NcclStream>,
    ) -> Result<()> {
        let Some(LaneEnd {
            comm,
            stream: lane_stream,
            ..
        }) = self.ctx.lane_end(peer, dir)?
        else {
            return Err(Error::Invalid {
                at: "raw_p2p".into(),
                message: format!("no lane toward rank {peer}"),
            });
        };
        let p = comm.rank_of(peer).unwrap_or(0);
        let s = stream.unwrap_or(lane_stream).0.raw.raw();
        let issuing = self.ctx.issue.lock();
        let held = comm.enter()?;
        let busy = issuing.busy();
        // SAFETY: the caller keeps the memory alive until the stream is
        // synchronized; the stream is live; the issue lock is held.
        let launched = unsafe {
            match dir {
                Dir::Send => held.send(ptr, bytes, DType::U8.nccl(), p, s),
                Dir::Recv => held.recv(ptr, bytes, DType::U8.nccl(), p, s),
            }
        }?;
        drop((busy, held));
        if !launched {
            self.ctx
                .ready_assisting(comm, &issuing, "ncclSend/ncclRecv")?;
        }
        Ok(())
    }

    /// A plain `ncclSend` to this rank and `ncclRecv` from it, of `bytes`
    /// at `out` and `inb`, in one NCCL group on `comm` and `stream`,
    /// bypassing duplex's bookkeeping: the one-GPU baseline of
    /// `examples/overhead.rs`. It takes the rank's issue lock and waits out
    /// a group NCCL reports in progress. The caller keeps the memory alive
    /// until the stream is synchronized. As [`NcclRank::raw_p2p`], it does
    /// not wait for another thread's launch in its handshake.
    pub fn raw_self_exchange(
        &self,
        comm: &NcclComm,
        stream: &NcclStream,
        out: u64,
        inb: u64,
        bytes: usize,
    ) -> Result<()> {
        let comm = &comm.0;
        let me = comm.rank_of(self.ctx.rank).unwrap_or(0);
        let s = stream.0.raw.raw();
        let issuing = self.ctx.issue.lock();
        let held = [comm.enter()?];
        let end = issuing.group(&self.ctx.lib, &held, || {
            // SAFETY: the caller keeps the memory alive until the stream
            // is synchronized; the stream is live; the issue lock is held.
            unsafe {
                held[0].send(out, bytes, DType::U8.nccl(), me, s)?;
                held[0].recv(inb, bytes, DType::U8.nccl(), me, s)?;
            }
            Ok(())
        })?;
        drop(held);
        if !end? {
            self.ctx.ready_assisting(comm, &issuing, "ncclGroupEnd")?;
        }
        Ok(())
    }

    /// Marks this thread's code as returned (for hang reports).
    pub(crate) fn end(&self) {
        self.ctx.registry.ended(self.thread_id);
    }

    /// The end of the rank's code: waits for the threads it started and
    /// never joined, as the simulator's execution does (a rank has
    /// finished once all its threads have, and only then may its peers
    /// take what it issued for all it will issue), bounded as a `join` is;
    /// fails with the error of the first of its threads that failed,
    /// joined or not (a thread's failure is the rank's, as on the
    /// simulator: [`crate::ctx::Spawned`]), or when one is still running
    /// at the bound. A failure of another rank ends the wait (those
    /// threads' own waits end on it).
    pub(crate) fn wait_spawned(&self) -> Result<()> {
        let ctx = &self.ctx;
        let limit = join_limit(ctx.opts.timeout);
        let all_ended =
            match ctx.poll_unless_failed(limit, || Ok(lock(&ctx.spawned).running.is_empty()))? {
                Ok(all) => all,
                Err((r, why)) => {
                    return Err(self.peer_failed("the end of the rank's code", r, &why));
                }
            };
        let s = lock(&ctx.spawned);
        if let Some(e) = s.first_error() {
            tracing::warn!(rank = ctx.rank, "a thread of the rank failed: {e}");
            return Err(e);
        }
        if !all_ended {
            let names: Vec<&str> = s.running.iter().map(|(_, n, _)| n.as_str()).collect();
            return Err(Error::Aborted(format!(
                "the code of rank {} returned while threads it started and never joined still ran ({}), and they did not end within {limit:?}",
                ctx.rank,
                names.join(", ")
            )));
        }
        Ok(())
    }

    /// The first error of a thread of this rank that has ended, as the
    /// rank's ([`crate::ctx::Spawned::first_error`]), and as the thread
    /// returned it (what a `join` returned to the rank's code).
    pub(crate) fn first_thread_error(&self) -> Option<(Error, Error)> {
        let s = lock(&self.ctx.spawned);
        Some((s.first_error()?, s.failed.first()?.2.clone()))
    }

    /// See [`RankCtx::teardown`].
    pub(crate) fn teardown(&self, failed: bool) {
        self.ctx.teardown(failed);
    }

    fn req<E: Element>(
        &self,
        at: &'static Location<'static>,
        dir: Dir,
        buf: &NcclBuffer<E>,
        peer: Rank,
        place_: &Place<Self>,
    ) -> Result<Req> {
        let what = || check::op_text(dir, buf.len, E::DTYPE, peer);
        check::peer(at, what, peer, self.ctx.world_size)?;
        self.mine(at, &what, "buffer", buf.state.rank, buf.state.run)?;
        if let Some(s) = &place_.stream {
            self.mine(at, &what, "stream", s.0.rank, s.0.run)?;
        }
        // A buffer that a failed recv may have left half written (its
        // launch failed where NCCL may still run it, or a write failed), or
        // whose last recv is over without its bytes, is not sent: the peer
        // would take stale bytes as delivered. As a read of it, the send
        // fails until the host writes it. A last recv still in flight is
        // judged by the waits (`verify_complete`).
        if dir == Dir::Send {
            let judge = {
                let users = lock(&buf.state.users);
                users.poisoned.is_some()
                    || users
                        .last_recv
                        .as_ref()
                        .is_some_and(|l| l.op.upgrade().is_none_or(|o| o.done()))
            };
            if judge {
                self.check_delivered(&buf.state, "send")?;
            }
        }
        // A lane connected one way only carries that way: an op against
        // it would need a connection (R7) that the model does not know of.
        if let Some(c) = &place_.comm
            && self.ctx.lane_direction(dir).is_some()
            && let Some(reverse) = self.ctx.lanes.get(peer, dir.other())
            && Arc::ptr_eq(&reverse.comm, &c.0)
        {
            return check::invalid(
                at,
                format!(
                    "{}: communicator {} carries messages one way only (lanes connected one way, DUPLEX_LANE_CONNECT=one-way); use the lane of this direction (`lane({peer}, Dir::{dir:?})`)",
                    what(),
                    reverse.name,
                ),
            );
        }
        // An op on an explicit communicator uses no lane (`check::resolve`).
        let lane = if peer == self.ctx.rank || place_.comm.is_some() {
            None
        } else {
            // Under lazy lanes, a lane not made yet is made now (this
            // waits for the two ranks' lane services, not for user code).
            self.ctx.lane_end(peer, dir)?
        };
        // Resolved by reference; only the chosen pair is cloned.
        let (comm, stream) = {
            let scoped = self.scoped.borrow();
            let (c, s) = check::resolve(
                place_.comm.as_ref().map(|c| &c.0),
                place_.stream.as_ref(),
                scoped.last(),
                lane.map(|e| (&e.comm, &e.stream)),
                || &self.ctx.world,
                || &self.ctx.default_stream,
            );
            (c.clone(), s.clone())
        };
        if comm.rank_of(peer).is_none() || comm.rank_of(self.ctx.rank).is_none() {
            return check::invalid(
                at,
                format!(
                    "{}: rank {peer} is not a member of communicator {}",
                    what(),
                    comm.name
                ),
            );
        }
        // C1: a policy-placed op of at least `copy_from` bytes goes on the
        // copy-engine lane of its direction, on the same stream.
        let copy = if place_.comm.is_none()
            && duplex::compile::goes_by_copy(
                self.ctx.policy,
                self.ctx.opts.copy_from,
                self.ctx.rank,
                peer,
                (buf.len * E::DTYPE.size()) as u64,
            ) {
            self.ctx.copy.get(&(peer, dir)).cloned()
        } else {
            None
        };
        Ok(Req {
            meta: OpMeta {
                rank: self.ctx.rank,
                thread: self.thread.clone(),
                dir,
                peer,
                count: buf.len,
                dtype: E::DTYPE,
                comm,
                copy,
                stream: stream.0.name.clone(),
                fifo: 0,
                grouped: false,
                at,
                site: check::site(),
            },
            ptr: buf.state.ptr(),
            stream,
            buf: buf.state.clone(),
        })
    }

    /// Launches `reqs` as one group: its NCCL ops in one NCCL group, then
    /// its ops on copy-engine lanes, in order (C6 of `docs/semantics.md`).
    fn issue(&self, mut reqs: Reqs, grouped: bool, at: &'static Location<'static>) -> Result<()> {
        let ctx = &self.ctx;
        for r in &reqs {
            if let Some(why) = ctx.late_copy(&r.buf) {
                return Err(Error::Aborted(format!(
                    "{}: its buffer cannot be used yet: {why}",
                    r.meta.text()
                )));
            }
            if let Some(c) = &r.meta.copy {
                if let Some(why) = c.lane.aborted() {
                    return Err(Error::Aborted(format!(
                        "{}: copy-engine lane {} was aborted: {why}",
                        r.meta.text(),
                        c.name
                    )));
                }
            } else if r.meta.comm.is_aborted() {
                // Aborted by the watchdog for another rank's failure: name it.
                return Err(ctx.watchdog_error(r.meta.comm.cell.aborted_error(), &r.meta.text()));
            }
        }
        let on_nccl = |r: &&Req| r.meta.copy.is_none();
        if let (Some(a), Some(b)) = (
            reqs.iter().filter(on_nccl).find(|r| r.meta.comm.blocking),
            reqs.iter().filter(on_nccl).find(|r| !r.meta.comm.blocking),
        ) {
            return check::invalid(
                at,
                format!(
                    "this group mixes {} (on {}, connected at creation, a blocking communicator) and {} (on {}, connected on first use, non-blocking); NCCL cannot launch them together: put them in separate groups, or connect every communicator at creation (Local::warm)",
                    a.meta.text(),
                    a.meta.comm.name,
                    b.meta.text(),
                    b.meta.comm.name
                ),
            );
        }
        // The model numbers a launch's ops in 16 bits: a larger group is
        // refused here, as by the simulator and the parser.
        if let Some(why) = duplex::machine::launch_too_large(reqs.len()) {
            return check::invalid(at, why);
        }
        let recs: SmallVec<[OpRec; INLINE_OPS]> = reqs
            .iter()
            .map(|r| OpRec {
                dir: r.meta.dir,
                peer: r.meta.peer,
                bytes: (r.meta.count * r.meta.dtype.size()) as u64,
                dtype: r.meta.dtype,
                comm: r.meta.logical(),
                stream: r.stream.0.id,
            })
            .collect();
        // R12: a message of this rank to itself needs its partner in the
        // same launch; NCCL would refuse it only at the group's end.
        if reqs.iter().any(|r| r.meta.peer == ctx.rank) {
            let specs: SmallVec<[duplex::machine::OpSpec; INLINE_OPS]> =
                recs.iter().map(OpRec::spec).collect();
            if let Some(i) = duplex::machine::unpaired_self_op(ctx.rank, &specs) {
                let m = &reqs[i].meta;
                return check::invalid(
                    at,
                    format!(
                        "{}: {}",
                        m.text(),
                        duplex::machine::self_unpaired_message(ctx.rank, &specs, i)
                    ),
                );
            }
        }
        // R11: a launch of another thread that waits in its connection
        // handshake holds back this one if they share a communicator, a
        // copy-engine lane or a stream, and only then; the wait is outside
        // the lock.
        let mut issuing = Some(ctx.issue.lock());
        if ctx.handshakes.marked()
            && let parts = parts_of(&reqs)
            && ctx.handshakes.holds(&parts, self.thread_id)
        {
            drop(issuing.take());
            let held_back = Blocked::Launch(
                recs.iter().cloned().collect(),
                grouped,
                (
                    registry::launch_text(reqs.iter().map(|r| &r.meta), grouped),
                    check::place(at),
                ),
            );
            issuing = Some(self.after_handshakes(&parts, &held_back)?);
        }
        // Set once this launch lets the lock go for its handshake: its
        // parts stay marked until it is over (its copy ops on their lanes
        // too), and its accesses are in the order, not yet on the streams.
        let mut shaking = None;
        for r in reqs.iter_mut() {
            r.meta.grouped = grouped;
        }
        // D1: a launch whose op races with an earlier access to its buffer
        // (or with another op of the launch) is refused before anything
        // records it. Its accesses are recorded once it is on its streams
        // (below): a sync or record another thread makes meanwhile then
        // covers it only if it does on the device.
        lock(&ctx.order)
            .check(&accesses(&reqs))
            .map_err(|race| race.error())?;
        let metas: SmallVec<[&OpMeta; INLINE_OPS]> = reqs.iter().map(|r| &r.meta).collect();
        let mut fifos: SmallVec<[u64; INLINE_OPS]> = smallvec![0; reqs.len()];
        ctx.registry.launch(LaunchRec {
            thread: self.thread_id,
            ops: &recs,
            metas: &metas,
            fifos: &mut fifos,
            grouped,
        })?;
        drop(metas);
        for (r, fifo) in reqs.iter_mut().zip(fifos) {
            r.meta.fifo = fifo;
        }
        // From here on the registry counts every op of the launch: a copy
        // op that does not reach its lane would leave the lane's numbering
        // and the registry's apart, so every error aborts the launch's copy
        // lanes (`abandon`).
        let ends: SmallVec<[Arc<CopyEnd>; INLINE_OPS]> =
            reqs.iter().filter_map(|r| r.meta.copy.clone()).collect();
        if let Err(e) = ctx.device.bind() {
            self.abandon(&ends, &e);
            return Err(e);
        }
        if reqs.iter().any(|r| r.meta.copy.is_none()) {
            match self.launch_nccl(&reqs, &mut issuing, &mut shaking, grouped) {
                Ok(None) => {}
                Ok(Some(Unfinished {
                    call,
                    error,
                    queued,
                })) => {
                    // NCCL's background job may still put this group's
                    // kernels on the streams: its communicators are aborted
                    // (which stops it), and its buffers are never freed,
                    // since nothing tracks those kernels (P6).
                    // Only the NCCL ops that reached NCCL (`queued`, in order)
                    // can run.
                    let reached = || reqs.iter().filter(|r| r.meta.copy.is_none()).take(queued);
                    let comms: Vec<Comm> = reached().map(|r| r.meta.comm.clone()).collect();
                    // Without the issue lock: an abort needs none (P1), and
                    // its free waits for the device, which must not hold
                    // back every other thread of the rank and its lane
                    // service meanwhile (found by review).
                    drop(issuing.take());
                    crate::ctx::abort_together(&comms);
                    // Its communicators are aborted: nothing more of it goes
                    // on its streams, so its accesses count as there (its
                    // buffers are kept for good below). Other threads held
                    // back by it now find its communicators aborted, rather
                    // than wait through the report; the trace is not cut
                    // until the report is made (its ops are in the
                    // registry, not in the ledger).
                    let _no_cut = ctx.handshakes.hold_cuts();
                    if let Some(h) = shaking.take() {
                        lock(&ctx.order).landed(h.key);
                    }
                    for r in reached() {
                        std::mem::forget(r.buf.clone());
                    }
                    poison_recvs(
                        reached(),
                        &match &error {
                            Some(e) => format!("its launch failed ({e})"),
                            None => format!("{call} did not return"),
                        },
                    );
                    drop(issuing);
                    return Err(match error {
                        Some(e) => {
                            self.abandon(&ends, &e);
                            e
                        }
                        None => {
                            // Its handshake overstayed the deadline: a hang.
                            let e = Error::Aborted(format!("{call} did not return"));
                            self.abandon(&ends, &e);
                            self.hang(&call, &check::place(at), None)
                        }
                    });
                }
                Err(e) => {
                    self.abandon(&ends, &e);
                    return Err(e);
                }
            }
        }
        let (tickets, launched, failed) = self.launch_copies(&reqs, grouped);
        if let Some(e) = &failed {
            self.abandon(&ends, e);
        }
        // On its streams (a copy op that failed is recorded too: its lane
        // is aborted, and a later op on its buffer is refused until a sync,
        // which errs on the safe side).
        match &shaking {
            None => lock(&ctx.order).commit(&accesses(&reqs)),
            Some(h) => lock(&ctx.order).landed(h.key),
        }
        // One completion fence per stream of the launch, attached to after
        // its last op there, shared by the launch's ops on that stream
        // (and by the stream's next launches until it is recorded).
        let mut fences: SmallVec<[(*mut std::ffi::c_void, crate::sync::Arc<OpEvent>); 2]> =
            SmallVec::new();
        let mut launch: SmallVec<[Arc<Issued>; INLINE_OPS]> = SmallVec::with_capacity(reqs.len());
        let (mut tickets, mut launched) = (tickets.into_iter(), launched.into_iter());
        let mut reqs = reqs.into_iter().map(|r| {
            let ticket = tickets.next().flatten();
            (r, ticket, launched.next().unwrap_or(true))
        });
        while let Some((r, ticket, launched)) = reqs.next() {
            if !launched {
                // Nothing of it is on its stream, and no copy uses its
                // buffer (`CopyLane::issue` keeps what a copy may touch).
                continue;
            }
            let raw = r.stream.0.raw.raw();
            let shared = fences
                .iter()
                .find(|(s, _)| *s == raw)
                .map(|(_, e)| e.clone());
            let event = match shared {
                Some(e) => e,
                None => match Fences::attach(&r.stream.0.fences) {
                    Ok(e) => {
                        fences.push((raw, e.clone()));
                        e
                    }
                    Err(e) => {
                        // The ops already given an event stay tracked (and
                        // keep their buffers) even though this launch failed;
                        // this one and the rest are not tracked, and keep
                        // their buffers for good, since nothing says when
                        // the device is done with them (P6).
                        ctx.ops.record(launch);
                        // Untracked copy ops must not keep their streams
                        // waiting: their lanes are aborted (which releases
                        // them).
                        self.abandon(&ends, &e);
                        let why = format!("its completion could not be tracked ({e})");
                        poison_recvs([&r], &why);
                        std::mem::forget(r.buf);
                        for (r, _, launched) in reqs {
                            if launched {
                                poison_recvs([&r], &why);
                                std::mem::forget(r.buf);
                            }
                        }
                        return Err(e);
                    }
                },
            };
            let issued = Arc::new(Issued {
                meta: r.meta,
                event,
                buf: r.buf,
                ctx: ticket.as_ref().map(|_| Arc::downgrade(ctx)),
                ticket,
                checked: std::sync::atomic::AtomicBool::new(false),
                known_done: std::sync::atomic::AtomicBool::new(false),
            });
            {
                let mut users = lock(&issued.buf.users);
                // Forget ops that are gone before the list would grow, so
                // that the cost per op stays constant however many are in
                // flight.
                if users.ops.len() == users.ops.capacity() {
                    users.ops.retain(|w| w.strong_count() > 0);
                }
                users.ops.push(Arc::downgrade(&issued));
                if issued.meta.dir == Dir::Recv
                    && let (Some(c), Some(t)) = (&issued.meta.copy, &issued.ticket)
                {
                    if users.copies.len() == users.copies.capacity() {
                        users.copies.retain(|(_, t)| t.copy_may_run());
                    }
                    users.copies.push((Arc::downgrade(c), t.clone()));
                }
                if issued.meta.dir == Dir::Recv {
                    users.last_recv = Some(LastRecv {
                        op: Arc::downgrade(&issued),
                        peer: issued.meta.peer,
                        comm: Arc::downgrade(&issued.meta.comm),
                        copy: issued
                            .meta
                            .copy
                            .as_ref()
                            .zip(issued.ticket.as_ref())
                            .map(|(c, t)| (Arc::downgrade(c), t.clone())),
                    });
                }
            }
            launch.push(issued);
        }
        // One launch enters the ledger whole: a hang report taken by another
        // thread lists all of it or none of it (P7).
        ctx.ops.record(launch);
        match failed {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The copy-engine part of a launch, after `ncclGroupEnd` (C6): each
    /// op's ticket, whether each op is launched (its wait is on its
    /// stream; NCCL ops always are), and the error that stopped it.
    fn launch_copies(
        &self,
        reqs: &[Req],
        grouped: bool,
    ) -> (Vec<Option<Arc<Ticket>>>, Vec<bool>, Option<Error>) {
        // Copy-engine ops, after `ncclGroupEnd` (C6): one launch per lane,
        // in the order the lanes first appear in the group (as the model's
        // launches), each lane's ops in group order. An op that fails to
        // enqueue stops the rest; it is launched only if its wait is on its
        // stream (`IssueFailure::ticket`).
        // Only a launch with copy ops allocates for them (the NCCL-only
        // path is the hot one): no ticket and every op launched otherwise.
        let copies: Vec<usize> = (0..reqs.len())
            .filter(|&i| reqs[i].meta.copy.is_some())
            .collect();
        if copies.is_empty() {
            return (Vec::new(), Vec::new(), None);
        }
        let mut tickets: Vec<Option<Arc<Ticket>>> = vec![None; reqs.len()];
        let mut launched: Vec<bool> = reqs.iter().map(|r| r.meta.copy.is_none()).collect();
        let mut failed: Option<Error> = None;
        let lane_of = |i: usize| {
            reqs[i]
                .meta
                .copy
                .as_ref()
                .map(|c| Arc::as_ptr(&c.lane) as *const ())
        };
        let mut parts: Vec<Vec<usize>> = Vec::new();
        for &i in &copies {
            match parts.iter_mut().find(|p| lane_of(p[0]) == lane_of(i)) {
                Some(p) => p.push(i),
                None => parts.push(vec![i]),
            }
        }
        'parts: for part in &parts {
            // A launch over several streams holds all of them from its start
            // to its end (R1, R8): the streams wait for each other first
            // and last.
            let streams: Vec<&Stream> = {
                let mut v: Vec<&Stream> = Vec::new();
                for &i in part {
                    let s = &reqs[i].stream.0.raw;
                    if !v.iter().any(|x| x.raw() == s.raw()) {
                        v.push(s);
                    }
                }
                v
            };
            if let Err(e) = join_streams(&streams) {
                failed = Some(e);
                break;
            }
            for &i in part {
                let r = &reqs[i];
                let m = &r.meta;
                let Some(c) = &m.copy else { continue };
                let _span = tracing::trace_span!(
                    "duplex.op",
                    backend = "nccl",
                    rank = m.rank,
                    thread = %m.thread,
                    lane = %c.name,
                    op = m.dir.name(),
                    peer = m.peer,
                    bytes = (m.count * m.dtype.size()) as u64,
                    grouped,
                )
                .entered();
                match c.lane.issue(
                    m.dir,
                    &r.stream.0.raw,
                    r.ptr,
                    m.count * m.dtype.size(),
                    m.dtype,
                    &m.text(),
                    Box::new(r.buf.clone()),
                ) {
                    Ok(t) => {
                        tickets[i] = Some(t);
                        launched[i] = true;
                        self.ctx.copy_ops.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(f) => {
                        if let Some(t) = f.ticket {
                            tickets[i] = Some(t);
                            launched[i] = true;
                        }
                        failed = Some(f.error);
                        break 'parts;
                    }
                }
            }
            if let Err(e) = join_streams(&streams) {
                failed = Some(e);
                break;
            }
        }
        (tickets, launched, failed)
    }

    /// After an error in a launch the registry has recorded: aborts the
    /// copy-engine lanes of its copy ops (which also releases any stream
    /// waiting on them), and says this rank failed, unless the error is a
    /// program error or an abort whose cause is reported already.
    fn abandon(&self, ends: &[Arc<CopyEnd>], e: &Error) {
        if ends.is_empty() {
            return;
        }
        for c in ends {
            c.lane.abort(&format!(
                "an op of rank {} on it failed to launch: {e}",
                self.ctx.rank
            ));
        }
        if !matches!(e, Error::Program { .. } | Error::Aborted(_)) {
            self.ctx.health.fail(
                self.ctx.rank,
                &format!("a copy-engine op failed to launch: {e}"),
            );
        }
    }

    /// The NCCL part of a launch: its ops on NCCL communicators in one
    /// group, under the issue lock (`issuing`). An error means nothing was
    /// launched; [`Unfinished`] means NCCL's background job may still
    /// launch the group (a non-blocking group whose connection handshake,
    /// R7, did not finish within the deadline, or reported an error).
    ///
    /// A group that NCCL leaves in progress is waited for under the lock
    /// when its sides are connected; when it opens a side (its connection
    /// handshake, R7), without the lock: its parts are marked first and
    /// its accesses committed to the order as not yet on their streams
    /// (`shaking`, kept by the caller until the launch is over), so that
    /// only the rank's launches on them wait (R11); the lock is taken
    /// again, after the group's holds are let go (the lock order of
    /// [`crate::guard`]), for the rest of the launch.
    fn launch_nccl<'c>(
        &'c self,
        reqs: &[Req],
        issuing: &mut Option<crate::guard::Issuing<'c>>,
        shaking: &mut Option<Shaking<'c>>,
        grouped: bool,
    ) -> Result<Option<Unfinished>> {
        let ctx = &self.ctx;
        let Some(lock) = issuing.as_ref() else {
            return Err(Error::Aborted(
                "a launch without the issue lock (a bug in duplex)".into(),
            ));
        };
        let nccl = || reqs.iter().filter(|r| r.meta.copy.is_none());
        // Hold every communicator the group names until its launch is over
        // (P3 of `crate::guard`); `slot[i]` is the hold of the i-th NCCL op.
        let mut comms: SmallVec<[&Comm; INLINE_OPS]> = SmallVec::new();
        let mut slot: SmallVec<[usize; INLINE_OPS]> = SmallVec::with_capacity(reqs.len());
        for r in nccl() {
            let i = match comms.iter().position(|c| Arc::ptr_eq(c, &r.meta.comm)) {
                Some(i) => i,
                None => {
                    comms.push(&r.meta.comm);
                    comms.len() - 1
                }
            };
            slot.push(i);
        }
        let held = comms
            .iter()
            .map(|c| c.enter())
            .collect::<Result<SmallVec<[_; INLINE_OPS]>>>()?;
        // How many ops reached NCCL, in order: only those can run.
        let mut queued = 0;
        let grouped_call = lock.group(&ctx.lib, &held, || {
            for (r, &i) in nccl().zip(&slot) {
                let m = &r.meta;
                let _span = tracing::trace_span!(
                    "duplex.op",
                    backend = "nccl",
                    rank = m.rank,
                    thread = %m.thread,
                    lane = %m.comm.name,
                    op = m.dir.name(),
                    peer = m.peer,
                    bytes = (m.count * m.dtype.size()) as u64,
                    grouped,
                )
                .entered();
                let peer = m.comm.rank_of(m.peer).unwrap_or(0);
                let stream = r.stream.0.raw.raw();
                // SAFETY: the op keeps its buffer alive until it is dropped,
                // which happens only after its event completed (P6); the
                // stream is live; the issue lock is held.
                let res = unsafe {
                    match m.dir {
                        Dir::Send => held[i].send(r.ptr, m.count, m.dtype.nccl(), peer, stream),
                        Dir::Recv => held[i].recv(r.ptr, m.count, m.dtype.nccl(), peer, stream),
                    }
                };
                res.map_err(|e| ctx.watchdog_error(e, &m.text()))?;
                queued += 1;
            }
            Ok(())
        });
        let first = || nccl().next().map(|r| r.meta.text()).unwrap_or_default();
        // An op that failed inside the group (its communicator aborted
        // meanwhile, say) or a failed group end: `ncclGroupEnd` ran, so the
        // ops queued before may run, untracked. The caller handles it as a
        // group NCCL may still launch, for the ops that reached NCCL. When
        // none did (the group's start or its first op failed), nothing can
        // run: a plain error.
        let ended = match grouped_call {
            Ok(end) => end.map_err(|e| ctx.watchdog_error(e, &first())),
            // An op's error, named already.
            Err(e) => Err(e),
        };
        let launched = match ended {
            Ok(launched) => launched,
            Err(e) if queued == 0 => return Err(e),
            Err(e) => {
                return Ok(Some(Unfinished {
                    call: first(),
                    error: Some(e),
                    queued,
                }));
            }
        };
        if !launched {
            // Non-blocking: NCCL ends the group in the background (every
            // group of a non-blocking communicator, from NCCL 2.23).
            let me = ctx.rank;
            let sides = || {
                nccl()
                    .filter(|r| r.meta.peer != me)
                    .map(|r| (r.meta.logical(), r.meta.peer, r.meta.dir))
            };
            // The group's end, polled under the deadline; the lane
            // service's calls run meanwhile when the lock is held.
            let end = |assist: Option<&crate::guard::Issuing<'_>>| {
                poll(ctx.opts.timeout, || {
                    for h in &held {
                        if !h.async_error()? {
                            if let Some(lock) = assist {
                                ctx.assist(lock);
                            }
                            return Ok(false);
                        }
                    }
                    Ok(true)
                })
            };
            let unfinished = |polled: Result<bool>, late: &str| match polled {
                Ok(true) => None,
                Ok(false) => Some(Unfinished {
                    call: format!("{} ({late})", first()),
                    error: None,
                    queued,
                }),
                Err(e) => Some(Unfinished {
                    call: first(),
                    error: Some(e),
                    queued,
                }),
            };
            if ctx.handshakes.all_connected(sides()) {
                // No handshake: the wait is short, under the lock, as for
                // a blocking communicator.
                return Ok(unfinished(end(Some(lock)), "its group's end"));
            }
            // It opens a side (R7): the handshake waits for the peer's
            // code. Wait for it under the deadline, without the issue lock
            // (the state query needs none, P1): the rank's launches on
            // other communicators and streams go on, and the lane service
            // makes its calls itself.
            let key = crate::ctx::lock(&ctx.order).commit_pending(&accesses(reqs));
            *shaking = Some(Shaking {
                _mark: ctx.handshakes.mark(self.thread_id, &parts_of(reqs)),
                key,
            });
            *issuing = None;
            let started = std::time::Instant::now();
            let text = || registry::launch_text(nccl().map(|r| &r.meta), grouped);
            tracing::debug!(launch = %text(), "in its connection handshake (R7): waits without the issue lock");
            let polled = end(None);
            tracing::debug!(
                launch = %text(),
                waited_ms = started.elapsed().as_secs_f64() * 1e3,
                done = matches!(polled, Ok(true)),
                "its connection handshake is over"
            );
            drop(held);
            if let Some(u) = unfinished(polled, "its connection handshake, R7") {
                return Ok(Some(u));
            }
            ctx.handshakes.connect(sides());
            *issuing = Some(ctx.issue.lock());
        }
        Ok(None)
    }

    /// The issue lock, once no other thread's launch on one of `parts`
    /// waits in its handshake ([`crate::ctx::Handshakes`]): waited for
    /// without the lock, under the deadline; past it, a hang of the
    /// launch. Meanwhile the launch (a [`Blocked::Launch`]) is the thread's
    /// blocked call in the registry, so that a hang report (this rank's or
    /// another's) shows it held back by the other thread's call (R11).
    fn after_handshakes(
        &self,
        parts: &[crate::ctx::Part],
        launch: &Blocked,
    ) -> Result<crate::guard::Issuing<'_>> {
        let ctx = &self.ctx;
        let start = std::time::Instant::now();
        // Held back (R11): the analysis sees the launch as this thread's
        // next call, which the model holds back too when the two share a
        // communicator; held back only by a shared stream, it is one the
        // model lets through, which the analysis says (a disagreement).
        let (call, at) = launch.call();
        ctx.registry.blocked(self.thread_id, Some(launch.clone()));
        let _unblock = Unblock(&ctx.registry, self.thread_id);
        loop {
            let left = ctx.opts.timeout.saturating_sub(start.elapsed());
            let free = match ctx
                .poll_unless_failed(left, || Ok(!ctx.handshakes.holds(parts, self.thread_id)))?
            {
                Ok(free) => free,
                Err((r, why)) => return Err(self.peer_failed(call, r, &why)),
            };
            if !free {
                return Err(self.hang(call, at, Some(launch.clone())));
            }
            let issuing = ctx.issue.lock();
            // Another launch may have begun its handshake meanwhile.
            if !ctx.handshakes.holds(parts, self.thread_id) {
                tracing::debug!(
                    launch = call,
                    waited_ms = start.elapsed().as_secs_f64() * 1e3,
                    "held back by another thread's connection handshake (R11)"
                );
                return Ok(issuing);
            }
        }
    }

    /// Waits until `done`, under the deadline; a timeout is a hang.
    fn wait(
        &self,
        call: &str,
        at: &str,
        blocked: Blocked,
        mut done: impl FnMut() -> Result<bool>,
    ) -> Result<()> {
        self.ctx
            .registry
            .blocked(self.thread_id, Some(blocked.clone()));
        let mut checks = 0u32;
        let start = std::time::Instant::now();
        let look_after = unmatched_look(self.ctx.opts.timeout);
        let mut unmatched = None;
        let result = poll(self.ctx.opts.timeout, || {
            if done()? {
                return Ok(true);
            }
            if let Some((r, why)) = self.ctx.failed_peer(&mut checks) {
                return Err(self.peer_failed(call, r, &why));
            }
            if checks.is_multiple_of(256) {
                // A wait that lasts: is it for an op whose peer finished
                // without issuing its match? Then it ends now, not at the
                // deadline.
                if start.elapsed() >= look_after
                    && let Some(why) = self.ctx.unmatchable()
                {
                    unmatched = Some(why);
                    return Ok(true);
                }
                // A failed communicator (a peer that died, say) is an error now.
                for op in self.ctx.pending() {
                    let checked = match &op.meta.copy {
                        Some(c) => match c.lane.aborted() {
                            Some(why) => Err(Error::Aborted(format!(
                                "copy-engine lane {} was aborted, so its ops did not move their bytes: {why}",
                                c.name
                            ))),
                            None => Ok(()),
                        },
                        None => op
                            .meta
                            .comm
                            .check_now()
                            .map_err(|e| self.blamed(call, &op.meta.comm.members, e)),
                    };
                    checked.inspect_err(|e| {
                        self.ctx.health.fail(self.ctx.rank, &e.to_string());
                    })?;
                }
            }
            Ok(false)
        });
        let result = match (result, unmatched) {
            (Ok(true), Some(why)) => Err(self.hang_because(
                call,
                at,
                Some(blocked),
                Some(&format!("ended before its deadline: {why}")),
            )),
            (Ok(true), None) => Ok(()),
            (Ok(false), _) => Err(self.hang(call, at, Some(blocked))),
            (Err(e), _) => Err(e),
        };
        self.ctx.registry.blocked(self.thread_id, None);
        result
    }

    /// `e`, an error a communicator of `members` reports (an NCCL error,
    /// or its abort), with its cause named when another rank is the cause
    /// ([`RankCtx::cause`], which waits for the health monitor up to
    /// [`crate::ctx::patience`]); else `e` as it is.
    fn blamed(&self, call: &str, members: &[Rank], e: Error) -> Error {
        match self.ctx.cause(members, &e, crate::ctx::patience()) {
            Some((r, cause)) => self.named(call, r, cause, &e.to_string()),
            None => e,
        }
    }

    /// A launch's error, once the issue lock is released: a raw NCCL error
    /// another rank can cause, or a communicator found aborted, whose cause
    /// the launch could not name without waiting (it held the lock) is
    /// named now, waiting for the health monitor as a wait does.
    fn launch_error(&self, e: Error, call: &str) -> Error {
        let unnamed = crate::ctx::nccl_remote(&e)
            // As `aborted_error` made it, not wrapped in a named cause.
            || matches!(&e, Error::Aborted(m)
                if m.starts_with("communicator ") && m.contains(crate::guard::ABORTED));
        if !unnamed {
            return e;
        }
        self.ctx.error_within(
            e,
            &format!("rank {} thread {}: `{call}`", self.ctx.rank, self.thread),
            crate::ctx::patience(),
        )
    }

    /// The error of `call` that rank `r` caused, with what this rank saw.
    fn named(&self, call: &str, r: Rank, cause: PeerCause, seen: &str) -> Error {
        match cause {
            PeerCause::Failed(why) => {
                self.peer_failed(call, r, &format!("{why} (on this rank: {seen})"))
            }
            PeerCause::Finished => Error::Aborted(format!(
                "rank {} thread {}: `{call}` ended because {} ({seen})",
                self.ctx.rank,
                self.thread,
                crate::ctx::finished_before(r, self.ctx.rank)
            )),
        }
    }

    /// An error of the job's board (the store, across processes): its host,
    /// rank 0, may have died; once the health monitor says so (it notices
    /// within [`crate::ctx::patience`]), the error names it. No lock is
    /// held here.
    fn board_error(&self, call: &str, e: Error) -> Error {
        if !self.ctx.health.remote() {
            return e;
        }
        let all: Vec<Rank> = (0..self.ctx.world_size).collect();
        match crate::health::culprit(
            &*self.ctx.health,
            self.ctx.rank,
            &all,
            crate::ctx::patience(),
        ) {
            Some((r, cause @ PeerCause::Failed(_))) => self.named(call, r, cause, &e.to_string()),
            _ => e,
        }
    }

    /// Posts `why` (a thread's failure) as this rank's failure, and,
    /// across processes, a snapshot of its trace for the others' analyses
    /// ([`crate::health::Health::publish_early`]: it stands in only until
    /// the rank's own trace comes, at the end of its code or at a wait
    /// that another rank's failure ends, and never replaces it).
    pub(crate) fn post_own_failure(&self, why: &str) {
        let ctx = &self.ctx;
        ctx.health.fail(ctx.rank, why);
        if ctx.health.remote() {
            ctx.health.publish_early(ctx.rank, &ctx.registry.trace());
        }
    }

    /// The error of a wait that ends because rank `r` of the job failed:
    /// this rank's trace goes to the others' analyses first (in a
    /// process-per-rank run), while its blocked call is still recorded;
    /// only the first such wait's, which no later publish of this rank
    /// replaces (the failed rank's analysis may read the trace at any time
    /// after, and a later one would show this rank past the call, at the
    /// end of its thread, say).
    fn peer_failed(&self, call: &str, r: Rank, why: &str) -> Error {
        let ctx = &self.ctx;
        if ctx.health.remote() && !ctx.published_for_peer.swap(true, Ordering::AcqRel) {
            ctx.health.publish(ctx.rank, &ctx.registry.trace());
        }
        Error::Aborted(format!(
            "rank {} thread {}: `{call}` ended because rank {r} failed: {why}",
            ctx.rank, self.thread
        ))
    }

    /// [`NcclRank::verify_complete`] with the sync still recorded as
    /// blocked (`blocked`): until its checks pass it has not returned. A
    /// trace records a sync only while it is blocked, so one published
    /// from these checks (`peer_failed`, when another rank's failure let
    /// this rank's copy-lane streams go and the sync's events completed)
    /// would otherwise show this rank with its ops issued and nothing
    /// blocked, free to go on, and the failed rank's analysis would find
    /// no cycle (seen on one H200 in `never-buffered/copy`; the model's
    /// side: `a_sync_missing_from_a_published_trace_hides_the_cycle` in
    /// `core/tests/trace.rs`).
    fn verified(&self, blocked: Blocked, covered: &[Arc<Issued>], call: &str) -> Result<()> {
        self.ctx.registry.blocked(self.thread_id, Some(blocked));
        let result = self.verify_complete(covered, call);
        self.ctx.registry.blocked(self.thread_id, None);
        result
    }

    /// Checks, after the device finished the ops a `sync` covered, that
    /// they really moved their bytes: none of their communicators was
    /// aborted or reports an asynchronous error (a peer that died or
    /// aborted can make NCCL's kernels exit early), and no other rank of the
    /// job failed.
    fn verify_complete(&self, covered: &[Arc<Issued>], call: &str) -> Result<()> {
        // Ops on copy-engine lanes that went past their waits without their
        // bytes, whether or not this wait covers them (the ledger may have
        // forgotten them).
        for op in covered.iter().filter(|op| op.ticket.is_some()) {
            op.done();
        }
        if let Some(first) = lock(&self.ctx.lost).first() {
            if let Some((r, why)) = self.ctx.peer_cause() {
                return Err(self.peer_failed(call, r, &why));
            }
            return Err(Error::Aborted(format!("`{call}`: {first}")));
        }
        for op in covered {
            if let (Some(c), Some(t)) = (&op.meta.copy, &op.ticket) {
                self.verify_copy(op, c, t, call)?;
                continue;
            }
            if let Err(e) = op.meta.comm.check() {
                // Another rank's failure is the cause: name it (the
                // watchdog aborted this rank's communicators for it).
                if let Some((r, why)) = self.ctx.peer_cause() {
                    return Err(self.peer_failed(call, r, &why));
                }
                // The cause judged from NCCL's own error, before it is
                // wrapped.
                let what = format!(
                    "{} finished on the device, but {e}; its bytes cannot be trusted",
                    op.meta.info()
                );
                let cause = self
                    .ctx
                    .cause(&op.meta.comm.members, &e, crate::ctx::patience());
                let err = match cause {
                    Some((r, cause)) => self.named(call, r, cause, &what),
                    None => Error::Aborted(format!("`{call}`: {what}")),
                };
                self.ctx.health.fail(self.ctx.rank, &err.to_string());
                return Err(err);
            }
        }
        if !covered.is_empty()
            && let Some((r, why)) = self.ctx.health.failed(self.ctx.rank)
        {
            return Err(self.peer_failed(call, r, &why));
        }
        // Their bytes arrived: a later abort does not unmake them.
        for op in covered.iter().filter(|op| op.meta.dir == Dir::Recv) {
            clear_last_recv(&op.buf, &Arc::downgrade(op));
        }
        Ok(())
    }

    /// Checks that an op on a copy-engine lane, whose stream went past it,
    /// moved its bytes: its ticket says its copy was seen done. A lane
    /// aborted first (a hang, a failed rank) fails it, even if the copy ran
    /// later.
    fn verify_copy(&self, op: &Issued, c: &CopyEnd, t: &Ticket, call: &str) -> Result<()> {
        // The copy's done event completes before the write that let the
        // stream go on (`crate::copy`): settling now sees it.
        c.lane.settle()?;
        let Some(why) = t.undelivered(&*c.lane) else {
            return Ok(());
        };
        if let Some((r, w)) = self.ctx.peer_cause() {
            return Err(self.peer_failed(call, r, &w));
        }
        let err = Error::Aborted(format!(
            "`{call}`: {} finished on the device, but copy-engine lane {} did not deliver it: {why}; its bytes cannot be trusted",
            op.meta.info(),
            c.name
        ));
        self.ctx.health.fail(self.ctx.rank, &err.to_string());
        Err(err)
    }

    /// The hang error: every pending op of this rank, the model's wait-for
    /// analysis where every rank's ops are known, and the communicators
    /// involved aborted so that no device work stays stuck.
    fn hang(&self, call: &str, at: &str, blocked: Option<Blocked>) -> Error {
        self.hang_because(call, at, blocked, None)
    }

    /// [`NcclRank::hang`] of a wait that ended before its deadline
    /// because an op of this rank, or the notify it waits for, can never
    /// come ([`RankCtx::unmatchable`]): `early` says how the call ended
    /// and why; `None`: its deadline expired.
    fn hang_because(
        &self,
        call: &str,
        at: &str,
        blocked: Option<Blocked>,
        early: Option<&str>,
    ) -> Error {
        let ctx = &self.ctx;
        let ended = match early {
            Some(ended) => ended.to_string(),
            None => format!(
                "did not return within its deadline of {:?}",
                ctx.opts.timeout
            ),
        };
        // The report lists what is not complete: open fences are recorded
        // first, and given a moment, so that ops that did complete leave.
        ctx.flush_fences(HANG_FLUSH);
        let pending = ctx.pending();
        let mine: Vec<OpInfo> = pending.iter().map(|p| p.meta.info()).collect();
        // The ranks this rank's pending ops wait on; asked now, so that
        // across processes the monitor has looked by the end of the report.
        let mut peers: Vec<Rank> = pending
            .iter()
            .flat_map(|p| p.meta.comm.members.iter().copied())
            .filter(|r| *r != ctx.rank)
            .collect();
        peers.sort_unstable();
        peers.dedup();
        let _ = ctx.health.finished_among(&peers);
        if let Some(b) = &blocked {
            ctx.registry.blocked(self.thread_id, Some(b.clone()));
        }
        // Say so first, so that the other ranks' waits end and (across
        // processes) they publish what they issued for the analysis below.
        ctx.health
            .fail(ctx.rank, &format!("hang: `{call}` ({at}) {ended}"));
        let r = &ctx.registry;
        let (analysis, missing, snapshots) = if ctx.health.remote() {
            ctx.health.publish(ctx.rank, &r.trace());
            let others = ctx.health.gather(ctx.world_size, ctx.rank, GATHER_WAIT);
            (r.analyze_with(others.traces), others.missing, others.early)
        } else {
            (r.analyze(), Vec::new(), Vec::new())
        };
        let mut disagreements = analysis.disagreements;
        // With a rank's calls missing (or only its early snapshot), a call
        // the replay refuses may wait on what that rank issued, not show a
        // disagreement of the model with the GPU (found by review: a
        // handshake with a missing rank left later calls refused): said.
        if !missing.is_empty() || !snapshots.is_empty() {
            let unknown: Vec<String> = missing
                .iter()
                .chain(&snapshots)
                .map(|r| r.to_string())
                .collect();
            for d in &mut disagreements {
                d.why.push_str(&format!(
                    " (what rank(s) {} issued is not fully known here, which may be why)",
                    unknown.join(", ")
                ));
            }
        }
        // A size, type or group mismatch in the joined calls is the hang's
        // cause: NCCL's behaviour for it is undefined, and here it hung
        // (across processes neither rank sees the other's op before both
        // are launched; in one process the issue check refuses it first).
        let program = analysis.program_error.clone().map(Error::from);
        let from = replayed_from(ctx.rank, &missing, &snapshots, analysis.unjoined.as_deref());
        let note;
        let stuck = match analysis.stuck {
            Some(mut s) => {
                note = format!(
                    "the wait-for cycle is the model's ({}), {from}",
                    ctx.opts.model_in_force()
                );
                if s.cycle.is_empty() && s.missing.is_empty() && s.note.is_none() {
                    // The model has every host call blocked but no device
                    // op waiting on anything it knows: the GPU did not do
                    // what the model says it can. Reported, never dropped.
                    s.note = Some(format!(
                        "the model ({}) finds no wait-for cycle in what it replayed ({from}): it says the pending ops below can complete, and the GPU did not complete them. That is a disagreement between the model and the GPU (please report it); causes seen outside the model: streams sharing a CUDA hardware queue (CUDA_DEVICE_MAX_CONNECTIONS) and IPC opens stalling (HQ and IPC in docs/semantics.md, \"Where the code and the record differ\")",
                        ctx.opts.model_in_force()
                    ));
                }
                s.ops = mine.clone();
                s
            }
            None => {
                note = if ctx.health.remote() {
                    format!(
                        "the model ({}) finds no hang in what it {from}; the pending ops are below",
                        ctx.opts.model_in_force()
                    )
                } else {
                    format!(
                        "the model ({}) does not predict this hang from what the ranks issued; the pending ops are below",
                        ctx.opts.model_in_force()
                    )
                };
                Stuck {
                    note: Some(note.clone()),
                    cycle: Vec::new(),
                    missing: Vec::new(),
                    blocked: vec![BlockedCall {
                        rank: ctx.rank,
                        thread: self.thread.to_string(),
                        call: call.to_string(),
                        at: at.to_string(),
                        line: None,
                        waits_for: match early {
                            Some(why) => why.to_string(),
                            None => format!("its deadline of {:?} expired", ctx.opts.timeout),
                        },
                    }],
                    ops: mine.clone(),
                    mismatched_setups: Vec::new(),
                }
            }
        };
        // Copy-engine lanes first: their abort releases the streams that
        // wait on them, and never blocks; freeing a communicator waits for
        // every stream of the device (P8 of `crate::guard`).
        let mut aborted = Vec::new();
        for p in &pending {
            if let Some(c) = &p.meta.copy
                && c.lane.aborted().is_none()
            {
                c.lane.abort(&format!(
                    "rank {} thread {}: `{call}` {ended}",
                    ctx.rank, self.thread
                ));
                aborted.push(c.name.clone());
            }
        }
        let comms: Vec<Comm> = pending
            .iter()
            .filter(|p| p.meta.copy.is_none())
            .map(|p| p.meta.comm.clone())
            .collect();
        aborted.extend(crate::ctx::abort_together(&comms));
        aborted.sort();
        aborted.dedup();
        // A peer that finished cleanly with ops of this rank toward it
        // pending: the likely reason (the model's report names the op it
        // never issued).
        let finished = match ctx.health.finished_among(&peers) {
            // An early end names the rank that finished already.
            Some(r) if early.is_none() => {
                format!("; {}", crate::ctx::finished_before(r, ctx.rank))
            }
            _ => String::new(),
        };
        // A host thread waiting for a lane made on first use has not issued
        // its op yet, so the model sees it as running: say so.
        let unmade = ctx.maker.get().map(|m| m.unmade()).unwrap_or_default();
        let lanes = if unmade.is_empty() {
            String::new()
        } else {
            format!(
                "; lanes of rank {} not made yet (an op waiting for one is not in the analysis): {}",
                ctx.rank,
                unmade.join("; ")
            )
        };
        let context = format!(
            "rank {} thread {}: `{call}` {ended}; {note}; aborted communicators: {}{finished}{lanes}",
            ctx.rank,
            self.thread,
            if aborted.is_empty() {
                "none".to_string()
            } else {
                aborted.join(", ")
            }
        );
        if let Some(Error::Program { kind, message, ops }) = program {
            // What the model refused is said too: a hang report would
            // list it, and this error stands in for one.
            return crate::run::said_after(
                Error::Program {
                    kind,
                    message: format!(
                        "{message}; NCCL's behaviour for it is undefined, and here it hung: {context}"
                    ),
                    ops,
                },
                &crate::run::disagreements_said(&disagreements),
            );
        }
        Error::Hang(Box::new(Hang {
            context,
            stuck,
            steps: Vec::new(),
            schedule: None,
            replay: None,
            disagreements,
        }))
    }

    /// Refuses an object (`kind`: a buffer, stream or event) of another
    /// rank, or of another run, whose numbers could name one of this run's
    /// (the sim refuses them alike).
    fn mine(
        &self,
        at: &Location<'_>,
        what: &dyn Fn() -> String,
        kind: &str,
        rank: Rank,
        run: u64,
    ) -> Result<()> {
        if rank != self.ctx.rank {
            return check::invalid(at, format!("{}: the {kind} belongs to rank {rank}", what()));
        }
        if run != self.ctx.registry.run() {
            return check::invalid(at, format!("{}: {}", what(), stale(kind)));
        }
        Ok(())
    }

    fn check_users(&self, at: &Location<'_>, buf: &BufState, what: &str) -> Result<()> {
        self.mine(at, &|| what.to_string(), "buffer", buf.rank, buf.run)?;
        if let Some(why) = self.ctx.late_copy(buf) {
            return Err(Error::Aborted(format!(
                "rank {} thread {}: {what} of a buffer that cannot be used yet: {why}",
                self.ctx.rank, self.thread
            )));
        }
        if let Some(reqs) = self.group.borrow().as_ref()
            && let Some(r) = reqs.iter().find(|r| std::ptr::eq(Arc::as_ptr(&r.buf), buf))
        {
            return check::in_open_group(at, what, &r.meta.text());
        }
        // The ops taken before the order is asked: an op launched on the
        // buffer after the question is not among them (its access is in
        // the order before it is in the buffer's list), so it is never
        // marked for one that a sync covered.
        let busy = buf.busy_ops();
        if let Some(op) = busy.first() {
            // A sync may have covered them through an event all the same
            // (D1: a sync of a stream that waited for an event recorded
            // after them on theirs).
            if lock(&self.ctx.order).idle(buf.id) {
                for op in &busy {
                    op.known_done.store(true, Ordering::Release);
                }
                return Ok(());
            }
            return Err(Error::Race {
                at: check::place(at),
                message: format!(
                    "{what} of a buffer that `{}` still uses ({}): synchronize its stream first",
                    op.meta.text(),
                    op.meta.info()
                ),
            });
        }
        Ok(())
    }
}

impl NcclRank {
    /// Whether a wait of this rank published its trace for another rank's
    /// analysis ([`RankCtx::published_for_peer`]).
    pub(crate) fn published_for_peer(&self) -> bool {
        self.ctx.published_for_peer.load(Ordering::Acquire)
    }

    /// Before a host read returns a buffer's bytes (every op on it is done,
    /// `check_users`), or a send takes them once its last recv is over
    /// (`call` names which): its last recv delivered them. A recv whose
    /// communicator was aborted or reports an asynchronous error, or whose
    /// copy-engine lane did not deliver, may have left the buffer stale,
    /// and the waits that would have said so need not have covered it. As
    /// a wait does (`verify_complete`), a communicator aborted after the
    /// recv completed counts too (nothing says which came first), unless a
    /// read or a wait already found the recv delivered: that clears it. A
    /// buffer poisoned by a launch that failed where NCCL may still run its
    /// recv fails every read until the host writes it. Two recvs in flight
    /// into one buffer at once (a race of the program's own) are not told
    /// apart: the later one is checked.
    fn check_delivered(&self, buf: &BufState, call: &str) -> Result<()> {
        let (last, poisoned) = {
            let users = lock(&buf.users);
            let last = users
                .last_recv
                .as_ref()
                .map(|l| (l.op.clone(), l.peer, l.comm.upgrade(), l.copy.clone()));
            (last, users.poisoned.clone())
        };
        if let Some(why) = poisoned {
            return Err(Error::Aborted(format!(
                "rank {} thread {}: {call} of a buffer that a recv may still be writing or may have left half written: {why}; the buffer's contents cannot be trusted (write it to use it again)",
                self.ctx.rank, self.thread
            )));
        }
        let Some((op, peer, comm, copy)) = last else {
            return Ok(());
        };
        let why = match copy {
            Some((end, ticket)) => match end.upgrade() {
                // A lane gone with its run: nothing left to ask.
                None => None,
                Some(end) => {
                    // Its done event completed before its stream went on
                    // (`crate::copy`): settling now sees it.
                    let _ = end.lane.settle();
                    ticket
                        .undelivered(&*end.lane)
                        .map(|why| format!("copy-engine lane {}: {why}", end.name))
                }
            },
            None => match comm.map(|c| c.check()) {
                None | Some(Ok(())) => None,
                Some(Err(e)) => Some(e.to_string()),
            },
        };
        let Some(why) = why else {
            // Delivered: later aborts do not unmake the bytes.
            clear_last_recv(buf, &op);
            return Ok(());
        };
        if let Some((r, w)) = self.ctx.peer_cause() {
            return Err(self.peer_failed(call, r, &w));
        }
        Err(Error::Aborted(format!(
            "rank {} thread {}: {call} of a buffer whose last recv (from rank {peer}) did not deliver its bytes: {why}; the buffer's contents cannot be trusted (write it to use it again)",
            self.ctx.rank, self.thread
        )))
    }
}

/// Forgets `buf`'s last recv once it is known delivered, if it is still
/// `op` (a later recv replaces it).
fn clear_last_recv(buf: &BufState, op: &std::sync::Weak<Issued>) {
    let mut users = lock(&buf.users);
    if users
        .last_recv
        .as_ref()
        .is_some_and(|l| std::sync::Weak::ptr_eq(&l.op, op))
    {
        users.last_recv = None;
    }
}

/// Marks the buffers of `reqs`' recvs: their launch failed where NCCL may
/// still run them untracked, so no read may return their bytes.
fn poison_recvs<'a>(reqs: impl IntoIterator<Item = &'a Req>, why: &str) {
    for r in reqs {
        if r.meta.dir == Dir::Recv {
            lock(&r.buf.users).poisoned = Some(format!("{}: {why}", r.meta.text()));
        }
    }
}

/// What a launch of `reqs` holds while it waits in its handshake, and what
/// holds it back while another's does (`crate::ctx::Handshakes`): its
/// communicators and copy-engine lanes, and its streams.
fn parts_of(reqs: &[Req]) -> SmallVec<[crate::ctx::Part; INLINE_OPS]> {
    reqs.iter()
        .map(|r| crate::ctx::part_comm(r.meta.logical()))
        .chain(reqs.iter().map(|r| crate::ctx::part_stream(r.stream.0.id)))
        .collect()
}

/// Clears a thread's blocked call in the registry when dropped, however
/// the wait ends (a panic included): a trace left blocked would never be
/// cut again.
struct Unblock<'a>(&'a crate::registry::Registry, usize);

impl Drop for Unblock<'_> {
    fn drop(&mut self) {
        self.0.blocked(self.1, None);
    }
}

/// A launch in its connection handshake, waiting without the issue lock
/// (`NcclRank::launch_nccl`): its parts marked until this drops, and its
/// accesses in the order under `key` until they are on their streams.
struct Shaking<'a> {
    _mark: crate::ctx::HandshakeMark<'a>,
    key: u64,
}

/// A group NCCL may still launch, whole or in part, untracked: a
/// non-blocking group whose handshake did not finish, or one in which an op
/// or the group's end failed after other ops reached NCCL. The call to
/// report, and the error (`None`: the handshake overstayed the deadline, a
/// hang).
struct Unfinished {
    call: String,
    error: Option<Error>,
    /// How many of the group's NCCL ops reached NCCL, in order (all, when
    /// the group ended): the ones that may run.
    queued: usize,
}

/// Makes each of `streams` (of one device) wait for everything issued so
/// far on the others.
fn join_streams(streams: &[&Stream]) -> Result<()> {
    if streams.len() < 2 {
        return Ok(());
    }
    let marks = streams
        .iter()
        .map(|s| {
            let e = Event::new(false)?;
            e.record(s)?;
            Ok(e)
        })
        .collect::<Result<Vec<_>>>()?;
    for (i, s) in streams.iter().enumerate() {
        for (j, e) in marks.iter().enumerate() {
            if i != j {
                s.wait(e)?;
            }
        }
    }
    Ok(())
}

impl Transport for NcclRank {
    type Buffer<E: Element> = NcclBuffer<E>;
    type Stream = NcclStream;
    type Event = NcclEvent;
    type Comm = NcclComm;
    type Thread = NcclThread;

    fn rank(&self) -> Rank {
        self.ctx.rank
    }

    fn world_size(&self) -> u32 {
        self.ctx.world_size
    }

    fn policy(&self) -> Policy {
        self.ctx.policy
    }

    fn copy_from(&self) -> Option<u64> {
        self.ctx
            .opts
            .copy_from
            .filter(|_| self.ctx.policy == Policy::PerDirection)
    }

    #[track_caller]
    fn alloc<E: Element>(&self, len: usize) -> Result<NcclBuffer<E>> {
        let at = Location::caller();
        let Some(bytes) = len.checked_mul(E::DTYPE.size()) else {
            return check::invalid(at, format!("alloc of {len} x {}: too large", E::DTYPE));
        };
        self.ctx.device.bind()?;
        // Across processes, a buffer a copy-engine op may use comes from
        // the rank's arena, which its peers opened at setup.
        let mem = match (&self.ctx.arena, self.ctx.opts.copy_from) {
            (Some(a), Some(from)) if bytes as u64 >= from => Memory::zeroed_in(a, bytes)?,
            _ => Memory::zeroed(bytes)?,
        };
        static BUFFERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Ok(NcclBuffer {
            state: Arc::new(BufState {
                id: BUFFERS.fetch_add(1, Ordering::Relaxed),
                mem: Some(mem),
                rank: self.ctx.rank,
                device: self.ctx.device.clone(),
                users: Mutex::new(Users::default()),
                kept: std::sync::atomic::AtomicBool::new(false),
                run: self.ctx.registry.run(),
            }),
            len,
            _e: PhantomData,
        })
    }

    #[track_caller]
    fn write<E: Element>(&self, buf: &mut NcclBuffer<E>, data: &[E]) -> Result<()> {
        let at = Location::caller();
        check::write_len(at, data.len(), buf.len)?;
        self.check_users(at, &buf.state, "write")?;
        let mut bytes = Vec::with_capacity(buf.len * E::DTYPE.size());
        for x in data {
            x.to_le(&mut bytes);
        }
        if let Some(m) = &buf.state.mem
            && let Err((e, running)) = m.write_within(&self.ctx.device, bytes, HOST_COPY_LIMIT)
        {
            let mut users = lock(&buf.state.users);
            users.last_recv = None;
            users.poisoned = Some(format!("a write did not complete ({e})"));
            if running {
                buf.state.kept.store(true, Ordering::Release);
            }
            return Err(e);
        }
        // The bytes are the host's now, whatever a recv did before; every
        // device access before is complete (D1).
        let mut users = lock(&buf.state.users);
        users.last_recv = None;
        users.poisoned = None;
        lock(&self.ctx.order).host_access(buf.state.id);
        Ok(())
    }

    #[track_caller]
    fn read<E: Element>(&self, buf: &NcclBuffer<E>) -> Result<Vec<E>> {
        let at = Location::caller();
        self.check_users(at, &buf.state, "read")?;
        self.check_delivered(&buf.state, "read")?;
        let bytes = match &buf.state.mem {
            Some(m) => {
                m.read_within(&self.ctx.device, HOST_COPY_LIMIT)
                    .map_err(|(e, running)| {
                        if running {
                            buf.state.kept.store(true, Ordering::Release);
                        }
                        e
                    })?
            }
            None => Vec::new(),
        };
        // No op used it, and the copy is done: every device access before
        // is complete (D1).
        lock(&self.ctx.order).host_access(buf.state.id);
        Ok(bytes
            .chunks_exact(E::DTYPE.size())
            .take(buf.len)
            .map(E::from_le)
            .collect())
    }

    fn stream(&self, name: &str) -> Result<NcclStream> {
        self.ctx.device.bind()?;
        let id = self.ctx.registry.stream(self.ctx.rank, name);
        let s = NcclStream(Arc::new(StreamInner::new(
            Stream::new()?,
            name,
            self.ctx.rank,
            (id, self.ctx.registry.run()),
            &self.ctx.device,
        )));
        lock(&self.ctx.streams).push(s.clone());
        Ok(s)
    }

    #[track_caller]
    fn comm(&self, name: &str, members: &[Rank]) -> Result<Option<NcclComm>> {
        let at = Location::caller();
        let sorted = check::members(at, name, members, self.ctx.world_size)?;
        let k = self.ctx.user_comms.fetch_add(1, Ordering::AcqRel);
        // However this call ends, its turn to split is over then.
        struct TurnEnd<'a>(&'a std::sync::Mutex<crate::ctx::SplitTurns>, usize);
        impl Drop for TurnEnd<'_> {
            fn drop(&mut self) {
                lock(self.0).end(self.1);
            }
        }
        let turn = TurnEnd(&self.ctx.split_turns, k);
        // Members as a set: the split orders them by rank whatever order
        // the call lists them in, so [1, 0] on one rank and [0, 1] on
        // another make one communicator.
        if let Err(m) = self.ctx.registry.user_comm(k, name, &sorted) {
            return check::invalid(at, m);
        }
        let logical = self.ctx.first_user_logical + k as u32;
        self.ctx.device.bind()?;
        let made = std::time::Instant::now();
        let before = self.ctx.device.memory().map(|m| m.0).unwrap_or(0);
        // The split is collective over the world: recorded as the simulator
        // makes it (`check::split_tag`), a notify to every other rank on
        // arrival, then an await of each, so that a split that never
        // completes is a hang whose report names the cycle through it.
        let place = check::place(at);
        let tag = check::split_tag(k, name);
        let others: Vec<Rank> = (0..self.ctx.world_size)
            .filter(|r| *r != self.ctx.rank)
            .collect();
        for &to in &others {
            let text = check::split_step(k, name, &format!("tells rank {to} it has arrived"));
            self.ctx
                .registry
                .notify_call(self.thread_id, to, &tag, &text, &place);
        }
        let waits: Vec<Blocked> = others
            .iter()
            .map(|&from| {
                let text = check::split_step(k, name, &format!("waits for rank {from} to arrive"));
                Blocked::Await(from, tag.clone(), (text, place.clone()))
            })
            .collect();
        self.ctx.registry.blocked_in(self.thread_id, &waits);
        // However the split ends (a panic in its wait included), the thread
        // is no longer blocked in it once this returns: a trace left
        // blocked would never be cut again.
        let _unblock = Unblock(&self.ctx.registry, self.thread_id);
        let call = format!("comm({name})");
        // A wait for the other ranks ends early when one of them failed;
        // its error is made (and this rank's trace published) once the
        // wait has let go of the parent (P8 of `crate::guard`).
        let mut checks = 0u32;
        let failed = std::cell::Cell::new(None);
        let mut peers = || {
            if let Some(f) = self.ctx.failed_peer(&mut checks) {
                failed.set(Some(f));
                return Err(Error::Aborted("another rank failed".into()));
            }
            Ok(())
        };
        // The parent splits one call at a time, in the order of the calls'
        // numbers (`SplitTurns`); the wait for the other ranks holds no
        // lock, so the rank's other threads go on issuing (R11).
        let turns = &self.ctx.split_turns;
        let start = std::time::Instant::now();
        let split = poll(self.ctx.opts.timeout, || {
            peers()?;
            Ok(lock(turns).is_turn(k))
        })
        .map_err(comm::Unready::Failed)
        .and_then(|turn| {
            if !turn {
                return Err(comm::Unready::Late(Error::Aborted(format!(
                    "{call}: an earlier split of this rank did not finish"
                ))));
            }
            comm::split(
                self.ctx.lib,
                &self.ctx.splits,
                self.ctx.rank,
                members,
                logical,
                name,
                // One deadline for the whole call.
                self.ctx.opts.timeout.saturating_sub(start.elapsed()),
                (None, None),
                self.ctx.opts.warm,
                Some(&self.ctx.issue),
                &mut peers,
            )
        });
        drop(turn);
        if let Some((r, why)) = failed.take() {
            return Err(self.peer_failed(&call, r, &why));
        }
        let comm = match split {
            Ok(c) => c,
            // Past the deadline: a hang, reported with the waits above.
            Err(comm::Unready::Late(_)) => {
                return Err(self.hang(&call, &place, None));
            }
            // An abort for another rank's failure names that rank.
            Err(comm::Unready::Failed(e)) => return Err(self.launch_error(e, &call)),
        };
        drop(_unblock);
        self.ctx
            .registry
            .comm(logical, name, &sorted, self.ctx.opts.warm);
        if let Some(c) = &comm {
            {
                // Under the lock the rank's abort collects them with (P8):
                // a communicator made while the rank was being aborted
                // (its watchdog fired as the split finished) would escape
                // that abort, live on an aborted rank, and a later group
                // on it would block with no watchdog left to end it
                // (found by review). It is aborted on its own instead.
                let mut comms = lock(&self.ctx.comms);
                if self.ctx.closed.load(Ordering::Acquire) {
                    drop(comms);
                    crate::lanes::nccl::abort_aside(crate::lanes::nccl::Leftover::Comm(c.clone()));
                    return Err(Error::Aborted(format!(
                        "rank {} thread {}: `{call}`: the rank's communicators were aborted while the split finished, so the new one was aborted too",
                        self.ctx.rank, self.thread
                    )));
                }
                comms.push(c.clone());
            }
            if self.ctx.opts.warm {
                self.ctx.connect(&[(c.clone(), None)])?;
            }
            let after = self.ctx.device.memory().map(|m| m.0).unwrap_or(0);
            // From NCCL where it has the query and the lock is free now
            // (no wait for it: this is only a report).
            let stats = self.ctx.issue.try_lock().and_then(|_issuing| {
                let held = c.enter().ok()?;
                // SAFETY: held, under the issue lock.
                unsafe { held.call(|lib, raw| Ok(lib.memory(raw.0))) }
                    .ok()
                    .flatten()
            });
            lock(&self.ctx.costs).push(LaneCost::measured(
                format!("comm {name}"),
                made,
                stats,
                (before as u64, after as u64),
                "free device memory before and after (the rank's other threads' allocations meanwhile count too)",
            ));
        }
        Ok(comm.map(NcclComm))
    }

    fn world(&self) -> NcclComm {
        NcclComm(self.ctx.world.clone())
    }

    #[track_caller]
    fn lane(&self, peer: Rank, dir: Dir) -> Result<Lane<Self>> {
        match self.ctx.lane_end(peer, dir)? {
            Some(LaneEnd { name, comm, stream }) => Ok(Lane {
                name: name.clone(),
                comm: NcclComm(comm.clone()),
                stream: stream.clone(),
            }),
            None => check::invalid(
                Location::caller(),
                format!(
                    "lane toward rank {peer}: there is none (there are {} ranks)",
                    self.ctx.world_size
                ),
            ),
        }
    }

    #[track_caller]
    fn send_on<E: Element>(
        &self,
        buf: &NcclBuffer<E>,
        peer: Rank,
        place_: &Place<Self>,
    ) -> Result<()> {
        let at = Location::caller();
        let r = self.req(at, Dir::Send, buf, peer, place_)?;
        if let Some(g) = self.group.borrow_mut().as_mut() {
            g.push(r);
            return Ok(());
        }
        self.issue(smallvec![r], false, at)
            .map_err(|e| self.launch_error(e, "send"))
    }

    #[track_caller]
    fn recv_on<E: Element>(
        &self,
        buf: &mut NcclBuffer<E>,
        peer: Rank,
        place_: &Place<Self>,
    ) -> Result<()> {
        let at = Location::caller();
        let r = self.req(at, Dir::Recv, buf, peer, place_)?;
        if let Some(g) = self.group.borrow_mut().as_mut() {
            g.push(r);
            return Ok(());
        }
        self.issue(smallvec![r], false, at)
            .map_err(|e| self.launch_error(e, "recv"))
    }

    #[track_caller]
    fn send<E: Element>(&self, buf: &NcclBuffer<E>, peer: Rank) -> Result<()> {
        self.send_on(buf, peer, &Place::lane())
    }

    #[track_caller]
    fn recv<E: Element>(&self, buf: &mut NcclBuffer<E>, peer: Rank) -> Result<()> {
        self.recv_on(buf, peer, &Place::lane())
    }

    #[track_caller]
    fn group<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let at = Location::caller();
        // (The borrow ends here: `f` issues into the group.)
        let open = self.group.borrow().as_ref().map(|reqs| reqs.len());
        if let Some(mark) = open {
            // Nested groups flatten, as in NCCL; what a nested group's
            // closure issued is dropped if it fails (or panics), so that
            // nothing of a failed group is launched.
            return check::nested_group(f, || {
                if let Some(reqs) = self.group.borrow_mut().as_mut() {
                    reqs.truncate(mark);
                }
            });
        }
        *self.group.borrow_mut() = Some(Reqs::new());
        // A panic in `f` that the code catches closes the group, dropping
        // its ops (nothing was issued: NCCL's group calls come at the
        // end), rather than leaving every later op in a group that is
        // never launched.
        let _close = check::OnDrop(|| drop(self.group.borrow_mut().take()));
        let result = f();
        let reqs = self.group.borrow_mut().take().unwrap_or_default();
        let value = result?;
        if !reqs.is_empty() {
            self.issue(reqs, true, at)
                .map_err(|e| self.launch_error(e, "group"))?;
        }
        Ok(value)
    }

    #[track_caller]
    fn with_stream<R>(&self, stream: &NcclStream, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let what = || "with_stream".to_string();
        self.mine(
            Location::caller(),
            &what,
            "stream",
            stream.0.rank,
            stream.0.run,
        )?;
        self.scoped.borrow_mut().push(stream.clone());
        // Popped however `f` ends, a caught panic included.
        let _pop = check::OnDrop(|| drop(self.scoped.borrow_mut().pop()));
        f()
    }

    fn event(&self) -> Result<NcclEvent> {
        self.ctx.device.bind()?;
        let id = self.ctx.registry.event(self.ctx.rank);
        Ok(NcclEvent(Arc::new(EventInner {
            raw: Event::new(false)?,
            rank: self.ctx.rank,
            id,
            run: self.ctx.registry.run(),
        })))
    }

    #[track_caller]
    fn record(&self, event: &NcclEvent, stream: &NcclStream) -> Result<()> {
        let at = Location::caller();
        let what = || "record".to_string();
        self.mine(at, &what, "event", event.0.rank, event.0.run)?;
        self.mine(at, &what, "stream", stream.0.rank, stream.0.run)?;
        self.ctx.device.bind()?;
        // The order first (D1): a launch another thread puts on the stream
        // in between is then left out of the event's clock, whether or not
        // the device record covers it, never counted in when it does not.
        lock(&self.ctx.order).record(event.0.id, stream.0.id);
        event.0.raw.record(&stream.0.raw)?;
        self.ctx
            .registry
            .event_call(self.thread_id, true, event.0.id, stream.0.id);
        Ok(())
    }

    #[track_caller]
    fn wait(&self, event: &NcclEvent, stream: &NcclStream) -> Result<()> {
        let at = Location::caller();
        let what = || "wait".to_string();
        self.mine(at, &what, "event", event.0.rank, event.0.run)?;
        self.mine(at, &what, "stream", stream.0.rank, stream.0.run)?;
        self.ctx.device.bind()?;
        stream.0.raw.wait(&event.0.raw)?;
        // After the device wait (D1): a launch in between is not counted
        // as ordered after the event.
        lock(&self.ctx.order).wait(event.0.id, stream.0.id);
        self.ctx
            .registry
            .event_call(self.thread_id, false, event.0.id, stream.0.id);
        Ok(())
    }

    #[track_caller]
    fn sync_stream(&self, stream: &NcclStream) -> Result<()> {
        let at = Location::caller();
        let what = || "sync_stream".to_string();
        self.mine(at, &what, "stream", stream.0.rank, stream.0.run)?;
        self.ctx.device.bind()?;
        // This stream's ops, by its serial (two streams may share a name).
        let covered: Vec<Arc<Issued>> = self
            .ctx
            .pending()
            .into_iter()
            .filter(|op| op.event.queue().0 == stream.0.serial())
            .collect();
        // What it covers is taken before its event is recorded (D1): a
        // launch in between is left out, never counted in.
        let covers = lock(&self.ctx.order).covers(Some(stream.0.id));
        let ev = stream.0.wait_event()?;
        let what = format!("sync_stream({})", stream.0.name);
        let blocked = Blocked::Sync(Some(stream.0.id), (what.clone(), check::place(at)));
        self.wait(&what, &check::place(at), blocked.clone(), || ev.done())?;
        // Every covered op was launched before `ev` was recorded on its
        // stream, so it completed: told so, its fence need not be asked
        // (nor answer, if its record failed).
        for op in &covered {
            op.event.mark_done();
        }
        lock(&self.ctx.order).synced(covers);
        self.verified(blocked, &covered, &what)?;
        self.ctx.cut_if_quiet();
        Ok(())
    }

    #[track_caller]
    fn synchronize(&self) -> Result<()> {
        let at = Location::caller();
        self.ctx.device.bind()?;
        let covered = self.ctx.pending();
        let covers = lock(&self.ctx.order).covers(None);
        let streams = lock(&self.ctx.streams).clone();
        let mut events = Vec::with_capacity(streams.len());
        for s in &streams {
            events.push(s.0.wait_event()?);
        }
        let blocked = Blocked::Sync(None, ("synchronize".into(), check::place(at)));
        self.wait("synchronize", &check::place(at), blocked.clone(), || {
            for e in &events {
                if !e.done()? {
                    return Ok(false);
                }
            }
            Ok(true)
        })?;
        // As in `sync_stream`: each covered op's stream had a wait's event
        // recorded after it, and that event completed.
        let synced: Vec<usize> = streams.iter().map(|s| s.0.serial()).collect();
        for op in &covered {
            if synced.contains(&op.event.queue().0) {
                op.event.mark_done();
            }
        }
        lock(&self.ctx.order).synced(covers);
        self.verified(blocked, &covered, "synchronize")?;
        self.ctx.cut_if_quiet();
        Ok(())
    }

    #[track_caller]
    fn notify(&self, peer: Rank, tag: &str) -> Result<()> {
        check::peer(
            Location::caller(),
            || format!("notify({peer}, {tag})"),
            peer,
            self.ctx.world_size,
        )?;
        check::user_tag(Location::caller(), || format!("notify({peer}, {tag})"), tag)?;
        let what = format!("notify({peer}, {tag})");
        self.ctx
            .board
            .post(self.ctx.rank, peer, tag)
            .map_err(|e| self.board_error(&what, e))
    }

    #[track_caller]
    fn await_notify(&self, peer: Rank, tag: &str) -> Result<()> {
        let at = Location::caller();
        let what = format!("await_notify({peer}, {tag})");
        check::peer(at, || what.clone(), peer, self.ctx.world_size)?;
        check::user_tag(at, || what.clone(), tag)?;
        self.ctx.registry.blocked(
            self.thread_id,
            Some(Blocked::Await(
                peer,
                tag.to_string(),
                (what.clone(), check::place(at)),
            )),
        );
        // In slices, so that another rank's failure ends the wait early.
        let start = std::time::Instant::now();
        let deadline = start + self.ctx.opts.timeout;
        let look_after = unmatched_look(self.ctx.opts.timeout);
        let mut never = None;
        let got = loop {
            if let Some((r, why)) = self.ctx.health.failed(self.ctx.rank) {
                break Err(self.peer_failed(&what, r, &why));
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self
                .ctx
                .board
                .take(peer, self.ctx.rank, tag, left.min(AWAIT_SLICE))
                .map_err(|e| self.board_error(&what, e))
            {
                Ok(false) if !left.is_zero() => {
                    // A peer that finished cleanly notifies no more: what
                    // it posted before it finished is on the board now, so
                    // one more look that finds nothing finds it never
                    // will (as `RankCtx::unmatchable` for ops).
                    if start.elapsed() >= look_after
                        && self.ctx.health.finished_among(&[peer]).is_some()
                    {
                        match self
                            .ctx
                            .board
                            .take(peer, self.ctx.rank, tag, Duration::ZERO)
                            .map_err(|e| self.board_error(&what, e))
                        {
                            Ok(false) => {
                                never = Some(format!(
                                    "rank {peer} finished without notifying rank {} with tag `{tag}` (any more)",
                                    self.ctx.rank
                                ));
                                break Ok(false);
                            }
                            other => break other,
                        }
                    }
                    continue;
                }
                other => break other,
            }
        };
        let result = match got {
            Ok(true) => Ok(()),
            Ok(false) => Err(self.hang_because(
                &what,
                &check::place(at),
                Some(Blocked::Await(
                    peer,
                    tag.to_string(),
                    (what.clone(), check::place(at)),
                )),
                never
                    .map(|why| format!("can never return: {why}"))
                    .as_deref(),
            )),
            Err(e) => Err(e),
        };
        self.ctx.registry.blocked(self.thread_id, None);
        result
    }

    fn spawn<F>(&self, name: &str, f: F) -> Result<NcclThread>
    where
        F: FnOnce(&Self) -> Result<()> + Send + 'static,
    {
        let handle = NcclRank::new(self.ctx.clone(), name);
        let registry_id = handle.thread_id;
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = self.ctx.spawned.clone();
        lock(&spawned)
            .running
            .push((registry_id, name.to_string(), crate::ctx::Handle::Held));
        let (thread_name, shared) = (name.to_string(), spawned.clone());
        let os = std::thread::Builder::new()
            .name(format!("duplex rank {} {name}", self.ctx.rank))
            .spawn(move || {
                let r = handle.ctx.device.bind().and_then(|()| {
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&handle)))
                        .unwrap_or_else(|p| {
                            Err(Error::User(format!(
                                "the thread panicked: {}",
                                panic_text(&p)
                            )))
                        })
                });
                handle.end();
                // A thread's failure is the rank's (`Spawned`): posted now,
                // as the simulator ends the execution at it, so the other
                // ranks' waits end on it rather than at their deadlines.
                if let Err(e) = &r {
                    handle.post_own_failure(&format!("thread {thread_name} failed: {e}"));
                }
                // Its hold on the rank goes before it counts as ended: the
                // rank's end (`wait_spawned`) then never leaves the last
                // hold, and the rank's teardown, to this thread.
                drop(handle);
                lock(&shared).thread_ended(registry_id, &thread_name, r, &tx);
            })
            .map_err(|e| {
                lock(&spawned).running.retain(|t| t.0 != registry_id);
                Error::Aborted(format!("cannot start a thread: {e}"))
            })?;
        Ok(NcclThread {
            name: name.to_string(),
            registry_id,
            result: rx,
            handle: Some(os),
            spawned,
            joined: false,
            run: self.ctx.registry.run(),
        })
    }

    #[track_caller]
    fn join(&self, mut thread: NcclThread) -> Result<()> {
        let at = Location::caller();
        if thread.run != self.ctx.registry.run() {
            return check::invalid(at, format!("join({}): {}", thread.name, stale("thread")));
        }
        let what = format!("join({})", thread.name);
        self.ctx.registry.blocked(
            self.thread_id,
            Some(Blocked::Join(
                thread.registry_id,
                (what.clone(), check::place(at)),
            )),
        );
        let r = thread
            .result
            .recv_timeout(join_limit(self.ctx.opts.timeout));
        let result = match r {
            Ok(result) => {
                thread.joined = true;
                if let Some(h) = thread.handle.take() {
                    let _ = h.join();
                }
                result
            }
            Err(_) => {
                // Given up before the analysis: a thread that ends during
                // it has no joiner any more.
                lock(&thread.spawned).handle_now(thread.registry_id, crate::ctx::Handle::GaveUp);
                Err(self.hang(
                    &what,
                    &check::place(at),
                    Some(Blocked::Join(
                        thread.registry_id,
                        (what.clone(), check::place(at)),
                    )),
                ))
            }
        };
        self.ctx.registry.blocked(self.thread_id, None);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::replayed_from;

    #[test]
    fn a_hang_report_says_whose_calls_it_did_not_know() {
        assert_eq!(
            replayed_from(0, &[], &[], None),
            "replayed from what every rank issued"
        );
        let one = replayed_from(0, &[1], &[], None);
        assert!(
            one.contains("rank 1's trace did not come")
                && one.contains("rank 1 will never issue is not known"),
            "{one}"
        );
        let two = replayed_from(0, &[1, 3], &[], None);
        assert!(
            two.contains("the traces of ranks 1, 3 did not come"),
            "{two}"
        );
        let early = replayed_from(0, &[], &[2], None);
        assert!(
            early.starts_with("replayed from what every rank issued")
                && early.contains("for rank(s) 2 only the snapshot")
                && early.contains("not known"),
            "{early}"
        );
        let alone = replayed_from(2, &[], &[], Some("comm 4 differs"));
        assert!(
            alone.contains("rank 2's own calls alone") && alone.contains("comm 4 differs"),
            "{alone}"
        );
    }
}
