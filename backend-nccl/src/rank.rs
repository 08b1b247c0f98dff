//! [`NcclRank`]: the NCCL backend's [`Transport`], one handle per host
//! thread of a rank, and [`RankCtx`], what the threads of one rank share.

use std::cell::RefCell;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::panic::Location;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use duplex::report::{BlockedCall, OpInfo, Stuck};
use duplex::transport::{DeviceBuffer, check};
use duplex::{
    DType, Dir, Element, Error, Hang, Lane, Model, Place, Policy, Rank, Result, Transport,
};

use crate::board::Board;
use crate::comm::{self, Comm, poll};
use crate::cuda::{Device, Event, Memory, Stream};
use crate::nccl::Nccl;
use crate::registry::{Blocked, LaunchRec, OpRec, Registry};

/// Settings of a run.
#[derive(Clone, Debug)]
pub struct Options {
    /// The deadline of every wait: a sync, an `await_notify`, a `join`, a
    /// communicator's setup. Default 10 s, or `DUPLEX_TIMEOUT_MS`.
    pub timeout: Duration,
    /// Connect the world communicator, shared lanes and user communicators
    /// at creation (the schedule format's `lazy-connect=off`). Per-direction
    /// lanes are always connected at creation.
    pub warm: bool,
    /// The model under which a real hang is explained.
    pub model: Model,
    /// CTA bounds of lane communicators (`ncclConfig_t.minCTAs`/`maxCTAs`).
    pub ctas: (Option<i32>, Option<i32>),
}

impl Default for Options {
    fn default() -> Self {
        let ms = std::env::var("DUPLEX_TIMEOUT_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(10_000);
        Options {
            timeout: Duration::from_millis(ms),
            warm: false,
            model: Model::default(),
            ctas: (None, None),
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

/// A stream of a rank.
#[derive(Clone, Debug)]
pub struct NcclStream(Arc<StreamInner>);

#[derive(Debug)]
struct StreamInner {
    raw: Stream,
    name: Arc<str>,
    rank: Rank,
    id: u32,
}

/// An event of a rank.
#[derive(Clone, Debug)]
pub struct NcclEvent(Arc<EventInner>);

#[derive(Debug)]
struct EventInner {
    raw: Event,
    rank: Rank,
    id: u32,
}

/// A communicator.
#[derive(Clone, Debug)]
pub struct NcclComm(Comm);

/// A buffer of device memory.
#[derive(Debug)]
pub struct NcclBuffer<E> {
    state: Arc<BufState>,
    len: usize,
    _e: PhantomData<fn() -> E>,
}

/// A buffer's memory, kept alive by the buffer and by every op that uses it:
/// it is freed only once no launched op can touch it.
#[derive(Debug)]
pub(crate) struct BufState {
    mem: Option<Memory>,
    rank: Rank,
    device: Arc<Device>,
    /// Ops launched on it (weak: an op holds its buffer, not the reverse).
    users: Mutex<Vec<std::sync::Weak<Issued>>>,
}

impl BufState {
    fn ptr(&self) -> u64 {
        self.mem.as_ref().map(|m| m.ptr()).unwrap_or(0)
    }

    /// The first op on this buffer that has not completed.
    fn busy(&self) -> Option<Arc<Issued>> {
        let mut users = lock(&self.users);
        users.retain(|w| w.upgrade().is_some_and(|i| !i.done()));
        users.first().and_then(std::sync::Weak::upgrade)
    }
}

impl Drop for BufState {
    fn drop(&mut self) {
        // No op holds this buffer any more, so none can touch it.
        if let Some(mem) = self.mem.take() {
            let _ = self.device.bind();
            if let Err(e) = mem.free() {
                tracing::warn!(rank = self.rank, error = %e, "freeing a buffer failed");
            }
        }
    }
}

impl<E> DeviceBuffer for NcclBuffer<E> {
    fn len(&self) -> usize {
        self.len
    }
}

/// A host thread started by `spawn`.
#[derive(Debug)]
pub struct NcclThread {
    name: String,
    registry_id: usize,
    result: std::sync::mpsc::Receiver<Result<()>>,
    handle: std::thread::JoinHandle<()>,
}

/// An op that was launched: what it is, an event recorded after it, and
/// the buffer it uses (kept alive until the op is dropped, after it completed).
#[derive(Debug)]
pub(crate) struct Issued {
    meta: OpMeta,
    event: Option<Event>,
    ctx: std::sync::Weak<RankCtx>,
    _buf: Arc<BufState>,
}

impl Issued {
    fn done(&self) -> bool {
        self.event.as_ref().is_none_or(|e| e.done().unwrap_or(true))
    }
}

impl Drop for Issued {
    fn drop(&mut self) {
        // A completed op's event goes back to its rank's pool.
        if let (Some(e), Some(ctx)) = (self.event.take(), self.ctx.upgrade())
            && e.done().unwrap_or(false)
        {
            let mut pool = lock(&ctx.events);
            if pool.len() < 4096 {
                pool.push(e);
            }
        }
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
    pub(crate) stream: Arc<str>,
    pub(crate) fifo: u32,
    pub(crate) grouped: bool,
    pub(crate) at: &'static Location<'static>,
}

impl OpMeta {
    /// `send 1024 x f32 to rank 1`.
    pub(crate) fn text(&self) -> String {
        format!(
            "{} {} x {} {} rank {}",
            self.dir.name(),
            self.count,
            self.dtype,
            if self.dir == Dir::Send { "to" } else { "from" },
            self.peer
        )
    }

    /// Where the call was made.
    pub(crate) fn place(&self) -> String {
        check::place(self.at)
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
            comm: self.comm.name.clone(),
            stream: self.stream.to_string(),
            fifo: self.fifo,
            state: "not complete",
            grouped: self.grouped,
            call: self.text(),
            at: self.place(),
            line: None,
        }
    }
}

/// What the host threads of one rank share.
#[derive(Debug)]
pub(crate) struct RankCtx {
    pub(crate) rank: Rank,
    pub(crate) world_size: u32,
    pub(crate) policy: Policy,
    pub(crate) opts: Options,
    pub(crate) lib: &'static Nccl,
    lanes: HashMap<(Rank, Dir), (String, Comm, NcclStream)>,
    world: Comm,
    default_stream: NcclStream,
    streams: Mutex<Vec<NcclStream>>,
    comms: Mutex<Vec<Comm>>,
    issue: Mutex<()>,
    ops: Mutex<Vec<Arc<Issued>>>,
    board: Arc<dyn Board>,
    registry: Option<Arc<Registry>>,
    user_comms: AtomicUsize,
    next_logical: AtomicU32,
    fifo: Mutex<HashMap<(u32, Rank, Rank), u32>>,
    /// Events of completed ops, for reuse.
    events: Mutex<Vec<Event>>,
    /// Length of `ops` at which completed ops are next pruned.
    prune_at: AtomicUsize,
    /// When an NCCL call of this rank started (nanoseconds since `epoch`),
    /// 0 when none is in progress; the watchdog reads it.
    busy_since: AtomicU64,
    epoch: Instant,
    /// Set when the watchdog aborted this rank's communicators.
    fired: AtomicBool,
    pub(crate) costs: Vec<LaneCost>,
    // Last, so that it is released after every stream and communicator.
    pub(crate) device: Arc<Device>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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
    pub registry: Option<Arc<Registry>>,
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
        } = s;
        let mut streams = Vec::new();
        let reg_stream = |name: &str| registry.as_ref().map(|r| r.stream(rank, name)).unwrap_or(0);
        let new_stream = |name: &str, streams: &mut Vec<NcclStream>| -> Result<NcclStream> {
            let st = NcclStream(Arc::new(StreamInner {
                raw: Stream::new()?,
                name: name.into(),
                rank,
                id: reg_stream(name),
            }));
            streams.push(st.clone());
            Ok(st)
        };
        if let Some(r) = &registry {
            r.comm(0, "world", &world.members, opts.warm);
        }
        let default_stream = new_stream("default", &mut streams)?;
        let mut lanes = HashMap::new();
        let mut costs = Vec::new();
        let mut comms = vec![world.clone()];
        let mut logical = 1u32;
        // Every rank walks the same pairs in the same order: each split is
        // collective over the world communicator.
        for a in 0..n {
            for b in 0..n {
                let (members, name) = match policy {
                    Policy::PerDirection if a != b => (vec![a, b], format!("lane:{a}->{b}")),
                    Policy::Shared if a < b => (vec![a, b], format!("pair:{a}-{b}")),
                    _ => continue,
                };
                let before = device.memory().map(|m| m.0).unwrap_or(0);
                let start = Instant::now();
                // Lanes connected at creation are blocking communicators:
                // their calls never wait for a peer's host (see `watchdog`).
                let connected = policy == Policy::PerDirection || opts.warm;
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
                )?;
                if let Some(r) = &registry {
                    r.comm(
                        logical,
                        &name,
                        &members,
                        policy == Policy::PerDirection || opts.warm,
                    );
                }
                logical += 1;
                let Some(comm) = comm else { continue };
                let stream = new_stream(&name, &mut streams)?;
                let peer = if a == rank { b } else { a };
                match policy {
                    Policy::PerDirection => {
                        let dir = if a == rank { Dir::Send } else { Dir::Recv };
                        lanes.insert((peer, dir), (name.clone(), comm.clone(), stream));
                    }
                    Policy::Shared => {
                        lanes.insert(
                            (peer, Dir::Send),
                            (name.clone(), comm.clone(), stream.clone()),
                        );
                        lanes.insert((peer, Dir::Recv), (name.clone(), comm.clone(), stream));
                    }
                }
                comms.push(comm.clone());
                let after = device.memory().map(|m| m.0).unwrap_or(0);
                // SAFETY: the communicator is live.
                let (bytes, measured_by) = match unsafe { lib.memory(comm.raw()?) } {
                    Some(b) => (b, "ncclCommMemStats"),
                    None => (
                        before.saturating_sub(after) as u64,
                        "free device memory before and after",
                    ),
                };
                costs.push(LaneCost {
                    name,
                    create_ms: start.elapsed().as_secs_f64() * 1e3,
                    bytes,
                    measured_by,
                });
            }
        }
        let ctx = Arc::new(RankCtx {
            rank,
            world_size: n,
            policy,
            lib,
            lanes,
            world,
            default_stream,
            streams: Mutex::new(streams),
            comms: Mutex::new(comms),
            issue: Mutex::new(()),
            ops: Mutex::new(Vec::new()),
            board,
            registry,
            user_comms: AtomicUsize::new(0),
            next_logical: AtomicU32::new(logical),
            fifo: Mutex::new(HashMap::new()),
            events: Mutex::new(Vec::new()),
            prune_at: AtomicUsize::new(256),
            busy_since: AtomicU64::new(0),
            epoch: Instant::now(),
            fired: AtomicBool::new(false),
            costs,
            device,
            opts,
        });
        watchdog(&ctx);
        // Per-direction lanes are connected now (R6, R7); with `warm`, the
        // world communicator and shared lanes too. One group per rank holding
        // every connection: a group's ops cannot block each other (R8).
        let mut warm: Vec<Comm> = Vec::new();
        if ctx.policy == Policy::PerDirection || ctx.opts.warm {
            warm.extend(ctx.lanes.values().map(|(_, c, _)| c.clone()));
        }
        if ctx.opts.warm {
            warm.push(ctx.world.clone());
        }
        ctx.connect(&warm)?;
        Ok(ctx)
    }

    /// Connects `comms` by a one-byte exchange between every pair of their
    /// members, in one group.
    fn connect(&self, comms: &[Comm]) -> Result<()> {
        let mut seen = Vec::new();
        let comms: Vec<&Comm> = comms
            .iter()
            .filter(|c| {
                let new = !seen.contains(&c.logical);
                seen.push(c.logical);
                new
            })
            .collect();
        if comms.is_empty() {
            return Ok(());
        }
        self.device.bind()?;
        let mem = Memory::zeroed(2)?;
        let stream = Stream::new()?;
        // NCCL refuses blocking and non-blocking communicators in one group.
        for blocking in [true, false] {
            let group: Vec<&&Comm> = comms.iter().filter(|c| c.blocking == blocking).collect();
            if group.is_empty() {
                continue;
            }
            let _g = lock(&self.issue);
            let _busy = self.busy();
            self.lib.group_start()?;
            for c in &group {
                let raw = c.raw()?;
                for peer in &c.members {
                    if *peer == self.rank {
                        continue;
                    }
                    let p = c.rank_of(*peer).unwrap_or(0);
                    // SAFETY: the 2-byte buffer lives until the stream is synchronized below.
                    unsafe {
                        self.lib
                            .send(mem.ptr(), 1, DType::U8.nccl(), p, raw, stream.raw())?;
                        self.lib
                            .recv(mem.ptr() + 1, 1, DType::U8.nccl(), p, raw, stream.raw())?;
                    }
                }
            }
            if let Err(e) = self.lib.group_end() {
                return Err(self.watchdog_error(e, "connecting the lanes"));
            }
            for c in &group {
                c.ready(self.opts.timeout, "connecting")?;
            }
        }
        let ev = Event::new(false)?;
        ev.record(&stream)?;
        if !poll(self.opts.timeout, || ev.done())? {
            return Err(Error::Aborted(format!(
                "connecting the lanes of rank {} did not finish within {:?}",
                self.rank, self.opts.timeout
            )));
        }
        mem.free()
    }

    fn pending(&self) -> Vec<Arc<Issued>> {
        let mut ops = lock(&self.ops);
        ops.retain(|o| !o.done());
        ops.clone()
    }

    /// Marks an NCCL call in progress until the guard drops.
    fn busy(&self) -> Busy<'_> {
        let now = self.epoch.elapsed().as_nanos() as u64;
        self.busy_since.store(now.max(1), Ordering::Release);
        Busy(self)
    }

    /// The error of an NCCL call that failed: after the watchdog aborted the
    /// communicators, a hang.
    fn watchdog_error(&self, e: Error, what: &str) -> Error {
        if self.fired.load(Ordering::Acquire) {
            Error::Aborted(format!(
                "{what}: an NCCL call of rank {} did not return within {:?}; the watchdog aborted the rank's communicators ({e})",
                self.rank, self.opts.timeout
            ))
        } else {
            e
        }
    }

    /// An event for a new op: a completed op's, or a new one.
    fn event(&self) -> Result<Event> {
        match lock(&self.events).pop() {
            Some(e) => Ok(e),
            None => Event::new(false),
        }
    }

    /// Aborts every communicator of the rank.
    fn abort_all(&self) {
        for c in lock(&self.comms).iter() {
            c.abort();
        }
        for (_, c, _) in self.lanes.values() {
            c.abort();
        }
        self.world.abort();
    }

    /// The end of a run: waits (under the deadline) for every op of this
    /// rank; if some never complete, aborts every communicator of the rank
    /// so that no kernel stays stuck, waits briefly for the aborted work to
    /// stop, and leaks the buffers of what is still not complete rather than
    /// free memory a kernel may use. Never blocks past the deadline.
    pub(crate) fn teardown(&self) {
        let _ = self.device.bind();
        if matches!(
            poll(self.opts.timeout, || Ok(self.pending().is_empty())),
            Ok(true)
        ) {
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
            let stuck = std::mem::take(&mut *lock(&self.ops));
            tracing::warn!(
                rank = self.rank,
                ops = stuck.len(),
                "ops did not stop after abort: leaking their buffers"
            );
            std::mem::forget(stuck);
        }
    }
}

/// An NCCL call in progress (see [`RankCtx::busy`]).
struct Busy<'a>(&'a RankCtx);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.busy_since.store(0, Ordering::Release);
    }
}

/// Starts the rank's watchdog: a thread that aborts every communicator of
/// the rank when one NCCL call has been in progress longer than the
/// deadline (a blocking communicator whose call waits on a peer, say), so
/// that no thread stays blocked inside NCCL. It ends with the rank.
fn watchdog(ctx: &Arc<RankCtx>) {
    let weak = Arc::downgrade(ctx);
    let limit = ctx.opts.timeout.as_nanos() as u64;
    let _ = std::thread::Builder::new()
        .name(format!("duplex watchdog {}", ctx.rank))
        .spawn(move || {
            loop {
                std::thread::sleep(Duration::from_millis(20));
                let Some(ctx) = weak.upgrade() else { return };
                let since = ctx.busy_since.load(Ordering::Acquire);
                let now = ctx.epoch.elapsed().as_nanos() as u64;
                if since != 0
                    && now.saturating_sub(since) > limit
                    && !ctx.fired.swap(true, Ordering::AcqRel)
                {
                    tracing::warn!(
                        rank = ctx.rank,
                        "an NCCL call overstayed the deadline: aborting the rank's communicators"
                    );
                    ctx.abort_all();
                }
            }
        });
}

/// One host thread's handle on a rank.
#[derive(Debug)]
pub struct NcclRank {
    ctx: Arc<RankCtx>,
    thread: Arc<str>,
    thread_id: usize,
    group: RefCell<Option<Vec<Req>>>,
    scoped: RefCell<Vec<NcclStream>>,
}

#[derive(Debug)]
struct Req {
    meta: OpMeta,
    ptr: u64,
    stream: NcclStream,
    buf: Arc<BufState>,
}

impl NcclRank {
    pub(crate) fn new(ctx: Arc<RankCtx>, thread: &str) -> NcclRank {
        let thread_id = ctx
            .registry
            .as_ref()
            .map(|r| r.thread(ctx.rank, thread))
            .unwrap_or(0);
        NcclRank {
            ctx,
            thread: thread.into(),
            thread_id,
            group: RefCell::new(None),
            scoped: RefCell::new(Vec::new()),
        }
    }

    /// What each lane of this rank cost to make.
    pub fn lane_costs(&self) -> &[LaneCost] {
        &self.ctx.costs
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
        let ev = Event::new(false)?;
        ev.record(&stream.0.raw)?;
        poll(timeout, || ev.done())
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
    /// caller must.
    pub fn raw_p2p(
        &self,
        dir: Dir,
        peer: Rank,
        ptr: u64,
        bytes: usize,
        stream: Option<&NcclStream>,
    ) -> Result<()> {
        let Some((_, comm, lane_stream)) = self.ctx.lanes.get(&(peer, dir)) else {
            return Err(Error::Invalid {
                at: "raw_p2p".into(),
                message: format!("no lane toward rank {peer}"),
            });
        };
        let raw = comm.raw()?;
        let p = comm.rank_of(peer).unwrap_or(0);
        let s = stream.unwrap_or(lane_stream).0.raw.raw();
        let _g = lock(&self.ctx.issue);
        let _busy = self.ctx.busy();
        // SAFETY: the caller keeps the memory alive until the stream is
        // synchronized; the communicator and stream are live.
        let launched = unsafe {
            match dir {
                Dir::Send => self.ctx.lib.send(ptr, bytes, DType::U8.nccl(), p, raw, s),
                Dir::Recv => self.ctx.lib.recv(ptr, bytes, DType::U8.nccl(), p, raw, s),
            }
        }?;
        if !launched {
            comm.ready(self.ctx.opts.timeout, "ncclSend/ncclRecv")?;
        }
        Ok(())
    }

    /// Marks this thread's code as returned (for hang reports).
    pub(crate) fn end(&self) {
        if let Some(reg) = &self.ctx.registry {
            reg.ended(self.thread_id);
        }
    }

    /// See [`RankCtx::teardown`].
    pub(crate) fn teardown(&self) {
        self.ctx.teardown();
    }

    fn req<E: Element>(
        &self,
        at: &'static Location<'static>,
        dir: Dir,
        buf: &NcclBuffer<E>,
        peer: Rank,
        place_: &Place<Self>,
    ) -> Result<Req> {
        let what = || {
            format!(
                "{} {} x {} {} rank {peer}",
                dir.name(),
                buf.len,
                E::DTYPE,
                if dir == Dir::Send { "to" } else { "from" }
            )
        };
        check::peer(at, what, peer, self.ctx.world_size)?;
        if buf.state.rank != self.ctx.rank {
            return check::invalid(
                at,
                format!("{}: the buffer belongs to rank {}", what(), buf.state.rank),
            );
        }
        let lane = if peer == self.ctx.rank {
            None
        } else {
            self.ctx.lanes.get(&(peer, dir))
        };
        let comm = match (&place_.comm, lane) {
            (Some(c), _) => c.0.clone(),
            (None, Some((_, c, _))) => c.clone(),
            (None, None) => self.ctx.world.clone(),
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
        let stream = match (&place_.stream, self.scoped.borrow().last(), lane) {
            (Some(s), _, _) => {
                if s.0.rank != self.ctx.rank {
                    return check::invalid(
                        at,
                        format!("{}: the stream belongs to rank {}", what(), s.0.rank),
                    );
                }
                s.clone()
            }
            (None, Some(s), _) => s.clone(),
            (None, None, Some((_, _, s))) if place_.comm.is_none() => s.clone(),
            _ => self.ctx.default_stream.clone(),
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
                stream: stream.0.name.clone(),
                fifo: 0,
                grouped: false,
                at,
            },
            ptr: buf.state.ptr(),
            stream,
            buf: buf.state.clone(),
        })
    }

    /// Launches `reqs` as one group.
    fn issue(
        &self,
        mut reqs: Vec<Req>,
        grouped: bool,
        at: &'static Location<'static>,
    ) -> Result<()> {
        let ctx = &self.ctx;
        for r in &reqs {
            r.meta.comm.raw()?;
        }
        if let (Some(a), Some(b)) = (
            reqs.iter().find(|r| r.meta.comm.blocking),
            reqs.iter().find(|r| !r.meta.comm.blocking),
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
        let _g = lock(&ctx.issue);
        for r in reqs.iter_mut() {
            r.meta.grouped = grouped;
        }
        match &ctx.registry {
            Some(reg) => {
                let mut metas: Vec<OpMeta> = reqs.iter().map(|r| r.meta.clone()).collect();
                let recs: Vec<OpRec> = reqs
                    .iter()
                    .map(|r| OpRec {
                        dir: r.meta.dir,
                        peer: r.meta.peer,
                        bytes: (r.meta.count * r.meta.dtype.size()) as u64,
                        dtype: r.meta.dtype,
                        comm: r.meta.comm.logical,
                        stream: r.stream.0.id,
                    })
                    .collect();
                reg.launch(LaunchRec {
                    thread: self.thread_id,
                    rank: ctx.rank,
                    ops: &recs,
                    metas: &mut metas,
                    grouped,
                })?;
                for (r, m) in reqs.iter_mut().zip(metas) {
                    r.meta.fifo = m.fifo;
                }
            }
            None => {
                let mut f = lock(&ctx.fifo);
                for r in reqs.iter_mut() {
                    let key = match r.meta.dir {
                        Dir::Send => (r.meta.comm.logical, ctx.rank, r.meta.peer),
                        Dir::Recv => (r.meta.comm.logical, r.meta.peer, ctx.rank),
                    };
                    let n = f.entry(key).or_insert(0);
                    r.meta.fifo = *n;
                    *n += 1;
                }
            }
        }
        ctx.device.bind()?;
        let busy = ctx.busy();
        ctx.lib.group_start()?;
        for r in &reqs {
            let m = &r.meta;
            let raw = m.comm.raw()?;
            let peer = m.comm.rank_of(m.peer).unwrap_or(0);
            let stream = r.stream.0.raw.raw();
            // SAFETY: the op keeps its buffer alive until it is dropped, which
            // happens only after its event completed; the communicator and
            // stream are live.
            let res = unsafe {
                match m.dir {
                    Dir::Send => ctx
                        .lib
                        .send(r.ptr, m.count, m.dtype.nccl(), peer, raw, stream),
                    Dir::Recv => ctx
                        .lib
                        .recv(r.ptr, m.count, m.dtype.nccl(), peer, raw, stream),
                }
            };
            if let Err(e) = res {
                let _ = ctx.lib.group_end();
                return Err(ctx.watchdog_error(e, &m.text()));
            }
        }
        let launched = ctx
            .lib
            .group_end()
            .map_err(|e| ctx.watchdog_error(e, &reqs[0].meta.text()))?;
        drop(busy);
        if !launched {
            // Non-blocking: the group (a connection handshake, R7) finishes in
            // the background. Wait for it under the deadline.
            let comms: Vec<Comm> = reqs.iter().map(|r| r.meta.comm.clone()).collect();
            let ok = poll(ctx.opts.timeout, || {
                for c in &comms {
                    // SAFETY: live (checked above).
                    if !unsafe { ctx.lib.async_error(c.raw()?) }? {
                        return Ok(false);
                    }
                }
                Ok(true)
            })?;
            if !ok {
                drop(_g);
                return Err(self.hang(
                    &format!("{} (its connection handshake, R7)", reqs[0].meta.text()),
                    &check::place(at),
                    None,
                ));
            }
        }
        for r in reqs {
            let event = ctx.event()?;
            event.record(&r.stream.0.raw)?;
            let issued = Arc::new(Issued {
                meta: r.meta,
                event: Some(event),
                ctx: Arc::downgrade(ctx),
                _buf: r.buf.clone(),
            });
            {
                let mut users = lock(&r.buf.users);
                users.retain(|w| w.strong_count() > 0);
                users.push(Arc::downgrade(&issued));
            }
            let mut ops = lock(&ctx.ops);
            ops.push(issued);
            if ops.len() >= ctx.prune_at.load(Ordering::Relaxed) {
                // Completed ops leave (and give their events back); the next
                // pruning waits until the list has doubled, so the cost per
                // op stays constant however many ops are in flight.
                ops.retain(|o| !o.done());
                ctx.prune_at
                    .store((2 * ops.len()).max(256), Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// Waits until `done`, under the deadline; a timeout is a hang.
    fn wait(
        &self,
        call: &str,
        at: &str,
        blocked: Blocked,
        mut done: impl FnMut() -> Result<bool>,
    ) -> Result<()> {
        if let Some(reg) = &self.ctx.registry {
            reg.blocked(self.thread_id, Some(blocked.clone()));
        }
        let mut checks = 0u32;
        let result = poll(self.ctx.opts.timeout, || {
            if done()? {
                return Ok(true);
            }
            checks = checks.wrapping_add(1);
            if checks % 256 == 0 {
                // A failed communicator (a peer that died, say) is an error now.
                for op in self.ctx.pending() {
                    op.meta.comm.check()?;
                }
            }
            Ok(false)
        });
        let result = match result {
            Ok(true) => Ok(()),
            Ok(false) => Err(self.hang(call, at, Some(blocked))),
            Err(e) => Err(e),
        };
        if let Some(reg) = &self.ctx.registry {
            reg.blocked(self.thread_id, None);
        }
        result
    }

    /// The hang error: every pending op of this rank, the model's wait-for
    /// analysis where every rank's ops are known, and the communicators
    /// involved aborted so that no device work stays stuck.
    fn hang(&self, call: &str, at: &str, blocked: Option<Blocked>) -> Error {
        let ctx = &self.ctx;
        let pending = ctx.pending();
        let mine: Vec<OpInfo> = pending.iter().map(|p| p.meta.info()).collect();
        if let (Some(reg), Some(b)) = (&ctx.registry, &blocked) {
            reg.blocked(self.thread_id, Some(b.clone()));
        }
        let analysis = ctx.registry.as_ref().and_then(|r| r.analyze());
        let note;
        let stuck = match analysis {
            Some(mut s) => {
                note = format!(
                    "the wait-for cycle is the model's ({}), replayed from what every rank issued",
                    ctx.opts.model
                );
                s.ops = mine.clone();
                s
            }
            None => {
                note = if ctx.registry.is_some() {
                    format!(
                        "the model ({}) does not predict this hang from what the ranks issued; the pending ops are below",
                        ctx.opts.model
                    )
                } else {
                    "other ranks' pending ops are unknown in one-process-per-rank mode".to_string()
                };
                Stuck {
                    cycle: Vec::new(),
                    missing: Vec::new(),
                    blocked: vec![BlockedCall {
                        rank: ctx.rank,
                        thread: self.thread.to_string(),
                        call: call.to_string(),
                        at: at.to_string(),
                        line: None,
                        waits_for: format!("its deadline of {:?} expired", ctx.opts.timeout),
                    }],
                    ops: mine.clone(),
                }
            }
        };
        let mut aborted = Vec::new();
        for p in &pending {
            if !p.meta.comm.is_aborted() {
                aborted.push(p.meta.comm.name.clone());
                p.meta.comm.abort();
            }
        }
        aborted.sort();
        aborted.dedup();
        Error::Hang(Box::new(Hang {
            context: format!(
                "rank {} thread {}: `{call}` did not return within its deadline of {:?}; {note}; aborted communicators: {}",
                ctx.rank,
                self.thread,
                ctx.opts.timeout,
                if aborted.is_empty() {
                    "none".to_string()
                } else {
                    aborted.join(", ")
                }
            ),
            stuck,
            steps: Vec::new(),
            schedule: None,
            replay: None,
        }))
    }

    fn check_users(&self, at: &Location<'_>, buf: &BufState, what: &str) -> Result<()> {
        if let Some(op) = buf.busy() {
            return Err(Error::Race {
                at: check::place(at),
                message: format!(
                    "{what} of a buffer that {} still uses: synchronize its stream first",
                    op.meta.info()
                ),
            });
        }
        Ok(())
    }
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

    #[track_caller]
    fn alloc<E: Element>(&self, len: usize) -> Result<NcclBuffer<E>> {
        let at = Location::caller();
        let Some(bytes) = len.checked_mul(E::DTYPE.size()) else {
            return check::invalid(at, format!("alloc of {len} x {}: too large", E::DTYPE));
        };
        self.ctx.device.bind()?;
        Ok(NcclBuffer {
            state: Arc::new(BufState {
                mem: Some(Memory::zeroed(bytes)?),
                rank: self.ctx.rank,
                device: self.ctx.device.clone(),
                users: Mutex::new(Vec::new()),
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
        self.ctx.device.bind()?;
        match &buf.state.mem {
            Some(m) => m.write(&bytes),
            None => Ok(()),
        }
    }

    #[track_caller]
    fn read<E: Element>(&self, buf: &NcclBuffer<E>) -> Result<Vec<E>> {
        let at = Location::caller();
        self.check_users(at, &buf.state, "read")?;
        self.ctx.device.bind()?;
        let bytes = match &buf.state.mem {
            Some(m) => m.read()?,
            None => Vec::new(),
        };
        Ok(bytes
            .chunks_exact(E::DTYPE.size())
            .take(buf.len)
            .map(E::from_le)
            .collect())
    }

    fn stream(&self, name: &str) -> Result<NcclStream> {
        self.ctx.device.bind()?;
        let id = self
            .ctx
            .registry
            .as_ref()
            .map(|r| r.stream(self.ctx.rank, name))
            .unwrap_or(0);
        let s = NcclStream(Arc::new(StreamInner {
            raw: Stream::new()?,
            name: name.into(),
            rank: self.ctx.rank,
            id,
        }));
        lock(&self.ctx.streams).push(s.clone());
        Ok(s)
    }

    #[track_caller]
    fn comm(&self, name: &str, members: &[Rank]) -> Result<Option<NcclComm>> {
        let at = Location::caller();
        let sorted = check::members(at, name, members, self.ctx.world_size)?;
        let k = self.ctx.user_comms.fetch_add(1, Ordering::AcqRel);
        if let Some(reg) = &self.ctx.registry
            && let Err(m) = reg.user_comm(k, name, members)
        {
            return check::invalid(at, m);
        }
        let logical = self.ctx.next_logical.fetch_add(1, Ordering::AcqRel);
        self.ctx.device.bind()?;
        let comm = {
            let _g = lock(&self.ctx.issue);
            comm::split(
                self.ctx.lib,
                &self.ctx.world,
                self.ctx.rank,
                members,
                logical,
                name,
                self.ctx.opts.timeout,
                (None, None),
                self.ctx.opts.warm,
            )?
        };
        if let Some(reg) = &self.ctx.registry {
            reg.comm(logical, name, &sorted, self.ctx.opts.warm);
        }
        if let Some(c) = &comm {
            lock(&self.ctx.comms).push(c.clone());
            if self.ctx.opts.warm {
                self.ctx.connect(std::slice::from_ref(c))?;
            }
        }
        Ok(comm.map(NcclComm))
    }

    fn world(&self) -> NcclComm {
        NcclComm(self.ctx.world.clone())
    }

    #[track_caller]
    fn lane(&self, peer: Rank, dir: Dir) -> Result<Lane<Self>> {
        match self.ctx.lanes.get(&(peer, dir)) {
            Some((name, comm, stream)) => Ok(Lane {
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
        self.issue(vec![r], false, at)
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
        self.issue(vec![r], false, at)
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
        if self.group.borrow().is_some() {
            return f();
        }
        *self.group.borrow_mut() = Some(Vec::new());
        let result = f();
        let reqs = self.group.borrow_mut().take().unwrap_or_default();
        let value = result?;
        if !reqs.is_empty() {
            self.issue(reqs, true, at)?;
        }
        Ok(value)
    }

    #[track_caller]
    fn with_stream<R>(&self, stream: &NcclStream, f: impl FnOnce() -> Result<R>) -> Result<R> {
        if stream.0.rank != self.ctx.rank {
            return check::invalid(
                Location::caller(),
                format!("with_stream: the stream belongs to rank {}", stream.0.rank),
            );
        }
        self.scoped.borrow_mut().push(stream.clone());
        let r = f();
        self.scoped.borrow_mut().pop();
        r
    }

    fn event(&self) -> Result<NcclEvent> {
        self.ctx.device.bind()?;
        let id = self
            .ctx
            .registry
            .as_ref()
            .map(|r| r.event(self.ctx.rank))
            .unwrap_or(0);
        Ok(NcclEvent(Arc::new(EventInner {
            raw: Event::new(false)?,
            rank: self.ctx.rank,
            id,
        })))
    }

    #[track_caller]
    fn record(&self, event: &NcclEvent, stream: &NcclStream) -> Result<()> {
        let at = Location::caller();
        if event.0.rank != self.ctx.rank || stream.0.rank != self.ctx.rank {
            return check::invalid(
                at,
                "record: the event and the stream must belong to this rank".into(),
            );
        }
        self.ctx.device.bind()?;
        event.0.raw.record(&stream.0.raw)?;
        if let Some(reg) = &self.ctx.registry {
            reg.event_call(self.thread_id, true, event.0.id, stream.0.id);
        }
        Ok(())
    }

    #[track_caller]
    fn wait(&self, event: &NcclEvent, stream: &NcclStream) -> Result<()> {
        let at = Location::caller();
        if event.0.rank != self.ctx.rank || stream.0.rank != self.ctx.rank {
            return check::invalid(
                at,
                "wait: the event and the stream must belong to this rank".into(),
            );
        }
        self.ctx.device.bind()?;
        stream.0.raw.wait(&event.0.raw)?;
        if let Some(reg) = &self.ctx.registry {
            reg.event_call(self.thread_id, false, event.0.id, stream.0.id);
        }
        Ok(())
    }

    #[track_caller]
    fn sync_stream(&self, stream: &NcclStream) -> Result<()> {
        let at = Location::caller();
        if stream.0.rank != self.ctx.rank {
            return check::invalid(
                at,
                format!("sync_stream: the stream belongs to rank {}", stream.0.rank),
            );
        }
        self.ctx.device.bind()?;
        let ev = Event::new(false)?;
        ev.record(&stream.0.raw)?;
        let what = format!("sync_stream({})", stream.0.name);
        self.wait(
            &what,
            &check::place(at),
            Blocked::Sync(Some(stream.0.id), (what.clone(), check::place(at))),
            || ev.done(),
        )
    }

    #[track_caller]
    fn synchronize(&self) -> Result<()> {
        let at = Location::caller();
        self.ctx.device.bind()?;
        let streams = lock(&self.ctx.streams).clone();
        let mut events = Vec::with_capacity(streams.len());
        for s in &streams {
            let ev = Event::new(false)?;
            ev.record(&s.0.raw)?;
            events.push(ev);
        }
        self.wait(
            "synchronize",
            &check::place(at),
            Blocked::Sync(None, ("synchronize".into(), check::place(at))),
            || {
                for e in &events {
                    if !e.done()? {
                        return Ok(false);
                    }
                }
                Ok(true)
            },
        )
    }

    #[track_caller]
    fn notify(&self, peer: Rank, tag: &str) -> Result<()> {
        if peer >= self.ctx.world_size {
            return check::invalid(
                Location::caller(),
                format!("notify rank {peer}: it does not exist"),
            );
        }
        self.ctx.board.post(self.ctx.rank, peer, tag)
    }

    #[track_caller]
    fn await_notify(&self, peer: Rank, tag: &str) -> Result<()> {
        let at = Location::caller();
        if peer >= self.ctx.world_size {
            return check::invalid(at, format!("await_notify rank {peer}: it does not exist"));
        }
        let what = format!("await_notify({peer}, {tag})");
        if let Some(reg) = &self.ctx.registry {
            reg.blocked(
                self.thread_id,
                Some(Blocked::Await(
                    peer,
                    tag.to_string(),
                    (what.clone(), check::place(at)),
                )),
            );
        }
        let got = self
            .ctx
            .board
            .take(peer, self.ctx.rank, tag, self.ctx.opts.timeout);
        let result = match got {
            Ok(true) => Ok(()),
            Ok(false) => Err(self.hang(
                &what,
                &check::place(at),
                Some(Blocked::Await(
                    peer,
                    tag.to_string(),
                    (what.clone(), check::place(at)),
                )),
            )),
            Err(e) => Err(e),
        };
        if let Some(reg) = &self.ctx.registry {
            reg.blocked(self.thread_id, None);
        }
        result
    }

    fn spawn<F>(&self, name: &str, f: F) -> Result<NcclThread>
    where
        F: FnOnce(&Self) -> Result<()> + Send + 'static,
    {
        let handle = NcclRank::new(self.ctx.clone(), name);
        let registry_id = handle.thread_id;
        let (tx, rx) = std::sync::mpsc::channel();
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
                let _ = tx.send(r);
            })
            .map_err(|e| Error::Aborted(format!("cannot start a thread: {e}")))?;
        Ok(NcclThread {
            name: name.to_string(),
            registry_id,
            result: rx,
            handle: os,
        })
    }

    #[track_caller]
    fn join(&self, thread: NcclThread) -> Result<()> {
        let at = Location::caller();
        let what = format!("join({})", thread.name);
        if let Some(reg) = &self.ctx.registry {
            reg.blocked(
                self.thread_id,
                Some(Blocked::Join(
                    thread.registry_id,
                    (what.clone(), check::place(at)),
                )),
            );
        }
        // The joined thread's own waits expire first; allow for them.
        let r = thread.result.recv_timeout(
            self.ctx.opts.timeout + self.ctx.opts.timeout / 2 + Duration::from_secs(1),
        );
        let result = match r {
            Ok(result) => {
                let _ = thread.handle.join();
                result
            }
            Err(_) => Err(self.hang(
                &what,
                &check::place(at),
                Some(Blocked::Join(
                    thread.registry_id,
                    (what.clone(), check::place(at)),
                )),
            )),
        };
        if let Some(reg) = &self.ctx.registry {
            reg.blocked(self.thread_id, None);
        }
        result
    }
}

/// The text of a panic payload.
pub(crate) fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}
