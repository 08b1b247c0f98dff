//! The lane service's kit on real NCCL: a lane is a 2-rank communicator
//! from `ncclCommInitRankConfig` (non-blocking), connected by a one-byte
//! exchange each way in one group, advanced by polling only.
//!
//! Two of its steps are NCCL calls that need the rank's issue lock (P1 of
//! [`crate::guard`]): the setup call and the connecting group. The service
//! never waits for that lock: it queues the call (`RankCtx::assist_later`)
//! and runs the queue when the lock is free; a host thread that holds the
//! lock while it waits for another rank (the connection of a user
//! communicator at creation) runs the queue as it waits (`RankCtx::assist`). Nothing it abandons is freed on
//! its thread: an abort frees a communicator, which waits for the device
//! (P8), so each abandoned communicator is aborted on a thread of its own
//! ([`abort_aside`]); not on [`crate::reaper`], whose queue of frees could
//! wait behind the very kernel the abort stops.

use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use duplex::{Dir, Error, Result};

use super::{LaneEnd, LaneKit, LaneSpec};
use crate::comm::{Comm, Starting};
use crate::ctx::{LaneCost, NcclStream, RankCtx, StreamInner, abort_together, exchange_byte, lock};
use crate::cuda::{Event, Stream};
use crate::guard::Issuing;
use crate::nccl::sys::{NCCL_UNIQUE_ID_BYTES, ncclUniqueId};
use crate::sync::Ordering;

/// The kit of one rank: its context, once made.
#[derive(Debug)]
pub(crate) struct NcclKit {
    pub(crate) ctx: Weak<RankCtx>,
}

/// A call queued for the issue lock, and what it returned.
#[derive(Debug)]
enum Call<T> {
    Queued,
    /// Given up before it ran: it will not run.
    Cancelled,
    Ran(Result<T>),
    /// Its result was taken.
    Taken,
}

type Slot<T> = Arc<Mutex<Call<T>>>;

/// Takes a queued call's result, if it ran.
fn take<T>(slot: &Slot<T>) -> Option<Result<T>> {
    let mut call = lock(slot);
    match std::mem::replace(&mut *call, Call::Taken) {
        Call::Ran(r) => Some(r),
        other => {
            *call = other;
            None
        }
    }
}

/// This rank's part of a lane in progress.
pub(crate) struct NcclPart {
    started: Instant,
    /// Free device memory before the part started.
    before: u64,
    phase: Phase,
}

enum Phase {
    /// The setup call waits for the issue lock.
    Queued(Slot<Starting>),
    /// `ncclCommInitRankConfig` under way.
    Setup(Starting),
    /// The connecting group waits for the issue lock. The communicator is
    /// among the rank's (aborted with them, P8) from here on.
    Joining {
        comm: Comm,
        stream: Arc<Stream>,
        call: Slot<()>,
    },
    /// The connecting exchange is queued; NCCL may still be connecting.
    Connecting { comm: Comm, stream: Arc<Stream> },
    /// The exchange is launched; its event tells when it is done.
    Draining {
        comm: Comm,
        stream: Arc<Stream>,
        event: Event,
    },
    /// Connected: ready for `publish`.
    Connected { comm: Comm, stream: Stream },
    /// Made, or failed with nothing left to abandon.
    Over,
}

/// What a given-up part leaves to abort.
pub(crate) enum Leftover {
    Setup(Starting),
    Comm(Comm),
}

/// The sides this rank connects on `lane`: both ways (`None`), or only
/// its side of the lane's one direction (`LaneConnect::OneWay`).
fn connect_only(ctx: &RankCtx, lane: &LaneSpec) -> Option<Dir> {
    lane.slots(ctx.rank)
        .first()
        .and_then(|(_, dir)| ctx.lane_direction(*dir))
}

/// Aborts what a given-up part left, on a thread of its own: the abort
/// frees, and a free waits for every kernel of the device (P8), which
/// nothing here may wait for; the abort raises its communicator's flag
/// before it frees, so its own kernels stop first. If no thread can be
/// started, it is leaked (never freed under a kernel, P6).
pub(crate) fn abort_aside(what: Leftover) {
    let spawned = std::thread::Builder::new()
        .name("duplex lane abort".into())
        .spawn(move || match what {
            Leftover::Setup(starting) => drop(starting),
            Leftover::Comm(comm) => {
                abort_together(std::slice::from_ref(&comm));
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start a thread to abort a lane ({e}): leaking it");
    }
}

impl NcclKit {
    fn ctx(&self) -> Result<Arc<RankCtx>> {
        let ctx = self
            .ctx
            .upgrade()
            .ok_or_else(|| Error::Aborted("the rank has ended".into()))?;
        if ctx.fired.load(Ordering::Acquire) || ctx.closed.load(Ordering::Acquire) {
            return Err(Error::Aborted(format!(
                "rank {}'s communicators were aborted",
                ctx.rank
            )));
        }
        Ok(ctx)
    }
}

/// Queues `f` for the issue lock; its result comes back in the slot.
fn queue<T: Send + 'static>(
    ctx: &RankCtx,
    f: impl FnOnce(&Issuing<'_>) -> Result<T> + Send + 'static,
) -> Slot<T> {
    let slot: Slot<T> = Arc::new(Mutex::new(Call::Queued));
    let back = slot.clone();
    ctx.assist_later(Box::new(move |issuing| {
        let mut call = lock(&back);
        if matches!(*call, Call::Queued) {
            // The caller is a host thread in a wait, or the service: a
            // panic here must not unwind into it.
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(issuing)))
                .unwrap_or_else(|p| {
                    Err(Error::Aborted(format!(
                        "a lane's NCCL call panicked: {}",
                        crate::ctx::panic_text(&p)
                    )))
                });
            *call = Call::Ran(ran);
        }
    }));
    slot
}

/// Cancels a queued call; its result if it ran already.
fn cancel<T>(slot: &Slot<T>) -> Option<T> {
    let mut call = lock(slot);
    match std::mem::replace(&mut *call, Call::Cancelled) {
        Call::Ran(Ok(t)) => Some(t),
        _ => None,
    }
}

impl LaneKit for NcclKit {
    type Part = NcclPart;

    fn new_id(&self) -> Result<Vec<u8>> {
        let ctx = self.ctx()?;
        Ok(ctx.lib.unique_id()?.internal.to_vec())
    }

    fn start(&self, lane: &LaneSpec, id: &[u8]) -> Result<NcclPart> {
        let ctx = self.ctx()?;
        let raw = ncclUniqueId::from_bytes(id).ok_or_else(|| {
            Error::Aborted(format!(
                "a unique id of {} bytes, not {NCCL_UNIQUE_ID_BYTES}",
                id.len()
            ))
        })?;
        ctx.device.bind()?;
        let before = ctx.device.memory().map_or(0, |m| m.0 as u64);
        let (lib, device, ctas) = (ctx.lib, ctx.device.clone(), ctx.opts.ctas);
        let me = lane.rank_of(ctx.rank);
        // P1: a call that builds work, under the issue lock. It returns at
        // once: the setup goes on in NCCL's own thread.
        let call = queue(&ctx, move |issuing| {
            device.bind()?;
            let _busy = issuing.busy();
            Starting::begin(lib, raw, 2, me, ctas)
        });
        Ok(NcclPart {
            started: Instant::now(),
            before,
            phase: Phase::Queued(call),
        })
    }

    fn advance(&self, lane: &LaneSpec, part: &mut NcclPart) -> Result<bool> {
        let ctx = self.ctx()?;
        match &mut part.phase {
            Phase::Queued(call) => match take(call) {
                None => {
                    ctx.assist_if_free();
                    Ok(false)
                }
                Some(Err(e)) => {
                    part.phase = Phase::Over;
                    Err(e)
                }
                Some(Ok(starting)) => {
                    part.phase = Phase::Setup(starting);
                    Ok(false)
                }
            },
            // An error leaves the phase as it is, for `abandon`.
            Phase::Setup(starting) => {
                if !starting.poll()? {
                    return Ok(false);
                }
                let Phase::Setup(starting) = std::mem::replace(&mut part.phase, Phase::Over) else {
                    unreachable!("matched above")
                };
                let comm = starting.finish(lane.logical, &lane.name, lane.members.to_vec());
                // From now on an abort of the rank's communicators covers
                // this one (P8): its connecting kernels may wait for the
                // other rank.
                {
                    let mut comms = lock(&ctx.comms);
                    if ctx.closed.load(Ordering::Acquire) {
                        drop(comms);
                        abort_aside(Leftover::Comm(comm));
                        return Err(Error::Aborted(format!(
                            "rank {}'s communicators were aborted",
                            ctx.rank
                        )));
                    }
                    comms.push(comm.clone());
                }
                let stream = match ctx.device.bind().and_then(|()| Stream::new()) {
                    Ok(s) => Arc::new(s),
                    Err(e) => {
                        abort_aside(Leftover::Comm(comm));
                        return Err(e);
                    }
                };
                let peer = comm.rank_of(lane.other(ctx.rank)).unwrap_or(0);
                let warm = ctx.warmup.ptr();
                let (c, s, lib) = (comm.clone(), stream.clone(), ctx.lib);
                let only = connect_only(&ctx, lane);
                let call = queue(&ctx, move |issuing| {
                    let held = [c.enter()?];
                    // SAFETY: the rank's warm-up bytes live as long as its
                    // context, which outlives its communicators' kernels
                    // (aborted or done before it drops); the stream is
                    // live; a group under the issue lock.
                    let end = issuing.group(&lib, &held, || unsafe {
                        exchange_byte(&held[0], warm, peer, only, s.raw())
                    })?;
                    end.map(drop)
                });
                part.phase = Phase::Joining { comm, stream, call };
                Ok(false)
            }
            Phase::Joining { call, .. } => match take(call) {
                None => {
                    ctx.assist_if_free();
                    Ok(false)
                }
                Some(Err(e)) => Err(e),
                Some(Ok(())) => {
                    let Phase::Joining { comm, stream, .. } =
                        std::mem::replace(&mut part.phase, Phase::Over)
                    else {
                        unreachable!("matched above")
                    };
                    part.phase = Phase::Connecting { comm, stream };
                    Ok(false)
                }
            },
            Phase::Connecting { comm, stream } => {
                // `ncclCommGetAsyncError` needs no issue lock (P1).
                if !comm.enter()?.async_error()? {
                    return Ok(false);
                }
                // Its sides are connected (R7): a user's first launch on
                // the lane waits for its group's end under the lock.
                ctx.handshakes.connect_with(
                    lane.logical,
                    lane.other(ctx.rank),
                    connect_only(&ctx, lane),
                );
                ctx.device.bind()?;
                let event = Event::new(false)?;
                event.record(stream)?;
                let Phase::Connecting { comm, stream } =
                    std::mem::replace(&mut part.phase, Phase::Over)
                else {
                    unreachable!("matched above")
                };
                part.phase = Phase::Draining {
                    comm,
                    stream,
                    event,
                };
                Ok(false)
            }
            Phase::Draining { comm, event, .. } => {
                comm.check()?;
                if !event.done()? {
                    return Ok(false);
                }
                let Phase::Draining { comm, stream, .. } =
                    std::mem::replace(&mut part.phase, Phase::Over)
                else {
                    unreachable!("matched above")
                };
                // The only holder left: the queued call that shared it ran
                // and was dropped.
                match Arc::try_unwrap(stream) {
                    Ok(stream) => {
                        part.phase = Phase::Connected { comm, stream };
                        Ok(true)
                    }
                    Err(_) => {
                        abort_aside(Leftover::Comm(comm));
                        Err(Error::Aborted(format!(
                            "lane {}'s stream is still shared after its connection",
                            lane.name
                        )))
                    }
                }
            }
            Phase::Connected { .. } => Ok(true),
            Phase::Over => Err(Error::Aborted(format!(
                "lane {} was advanced after it ended",
                lane.name
            ))),
        }
    }

    fn publish(&self, lane: &LaneSpec, part: NcclPart) {
        let NcclPart {
            started,
            before,
            phase,
        } = part;
        let Phase::Connected { comm, stream } = phase else {
            tracing::warn!(lane = %lane.name, "a lane was published before it was connected");
            return self.abandon(
                lane,
                NcclPart {
                    started,
                    before,
                    phase,
                },
            );
        };
        match self.ctx.upgrade() {
            Some(ctx) => publish(&ctx, lane, started, before, comm, stream),
            None => abort_aside(Leftover::Comm(comm)),
        }
    }

    fn abandon(&self, _: &LaneSpec, part: NcclPart) {
        // A stream may be destroyed with work in it (CUDA releases it once
        // the work is done), so streams are simply dropped.
        match part.phase {
            Phase::Queued(call) => {
                if let Some(starting) = cancel(&call) {
                    abort_aside(Leftover::Setup(starting));
                }
            }
            Phase::Setup(starting) => abort_aside(Leftover::Setup(starting)),
            Phase::Joining { comm, call, .. } => {
                cancel(&call);
                abort_aside(Leftover::Comm(comm));
            }
            Phase::Connecting { comm, .. }
            | Phase::Draining { comm, .. }
            | Phase::Connected { comm, .. } => abort_aside(Leftover::Comm(comm)),
            Phase::Over => {}
        }
    }

    fn failed(&self) -> Option<(duplex::Rank, String)> {
        let ctx = self.ctx.upgrade()?;
        ctx.health.failed(ctx.rank)
    }

    fn gone(&self) -> bool {
        self.ctx.strong_count() == 0
    }
}

/// Puts a made lane in the rank's slots, registry and costs.
fn publish(
    ctx: &RankCtx,
    lane: &LaneSpec,
    started: Instant,
    before: u64,
    comm: Comm,
    stream: Stream,
) {
    let id = ctx.registry.stream(ctx.rank, &lane.name);
    let stream = NcclStream(Arc::new(StreamInner::new(
        stream,
        &lane.name,
        ctx.rank,
        (id, ctx.registry.run()),
        &ctx.device,
    )));
    lock(&ctx.streams).push(stream.clone());
    ctx.registry
        .comm(lane.logical, &lane.name, &lane.members, true);
    let end = LaneEnd {
        name: lane.name.clone(),
        comm: comm.clone(),
        stream,
    };
    for (peer, dir) in lane.slots(ctx.rank) {
        ctx.lanes.set(peer, dir, end.clone());
    }
    // `ncclCommMemStats` builds nothing, but P1 keeps every other call
    // under the lock: ask only if it is free.
    let stats = ctx.issue.try_lock().and_then(|_issuing| {
        let held = comm.enter().ok()?;
        // SAFETY: held, under the issue lock; it only reads the communicator.
        unsafe { held.call(|lib, raw| Ok(lib.memory(raw.0))) }.ok()?
    });
    let after = ctx.device.memory().map_or(0, |m| m.0 as u64);
    lock(&ctx.costs).push(LaneCost::measured(
        lane.name.clone(),
        started,
        stats,
        (before, after),
        "free device memory before and after (lanes made at once skew it)",
    ));
}
