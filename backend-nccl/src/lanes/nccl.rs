//! The lane service's kit on real NCCL: a lane is a 2-rank communicator
//! from `ncclCommInitRankConfig` (non-blocking), connected by a one-byte
//! exchange each way in one group, advanced by polling only.

use std::sync::{Arc, Weak};
use std::time::Instant;

use duplex::{DType, Error, Result};

use super::{LaneEnd, LaneKit, LaneSpec};
use crate::comm::{Comm, Starting};
use crate::ctx::{LaneCost, NcclStream, RankCtx, StreamInner, abort_together, lock};
use crate::cuda::{Event, Stream};
use crate::nccl::sys::{NCCL_UNIQUE_ID_BYTES, ncclUniqueId};
use crate::sync::Ordering;

/// The kit of one rank: its context, once made.
#[derive(Debug)]
pub(crate) struct NcclKit {
    pub(crate) ctx: Weak<RankCtx>,
}

/// This rank's part of a lane in progress.
pub(crate) struct NcclPart {
    started: Instant,
    /// Free device memory before the part started.
    before: u64,
    phase: Phase,
}

enum Phase {
    /// `ncclCommInitRankConfig` under way.
    Setup(Starting),
    /// The connecting exchange is queued; NCCL may still be connecting.
    Connecting { comm: Comm, stream: Stream },
    /// The exchange is launched; its event tells when it is done.
    Draining {
        comm: Comm,
        stream: Stream,
        event: Event,
    },
    /// Nothing left (moved out while advancing).
    Gone,
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

impl LaneKit for NcclKit {
    type Part = NcclPart;

    fn new_id(&self) -> Result<Vec<u8>> {
        let ctx = self.ctx()?;
        Ok(ctx.lib.unique_id()?.internal.to_vec())
    }

    fn start(&self, lane: &LaneSpec, id: &[u8]) -> Result<NcclPart> {
        let ctx = self.ctx()?;
        if id.len() != NCCL_UNIQUE_ID_BYTES {
            return Err(Error::Aborted(format!(
                "a unique id of {} bytes, not {NCCL_UNIQUE_ID_BYTES}",
                id.len()
            )));
        }
        let mut raw = ncclUniqueId {
            internal: [0; NCCL_UNIQUE_ID_BYTES],
        };
        raw.internal.copy_from_slice(id);
        ctx.device.bind()?;
        let before = ctx.device.memory().map_or(0, |m| m.0 as u64);
        // P1: an NCCL call that builds work, under the issue lock. It
        // returns at once: the setup goes on in NCCL's own thread.
        let issuing = ctx.issue.lock();
        let starting = Starting::begin(ctx.lib, raw, 2, lane.rank_of(ctx.rank), ctx.opts.ctas)?;
        drop(issuing);
        Ok(NcclPart {
            started: Instant::now(),
            before,
            phase: Phase::Setup(starting),
        })
    }

    fn advance(&self, lane: &LaneSpec, part: &mut NcclPart) -> Result<bool> {
        let ctx = self.ctx()?;
        match std::mem::replace(&mut part.phase, Phase::Gone) {
            Phase::Setup(starting) => {
                if !starting.poll()? {
                    part.phase = Phase::Setup(starting);
                    return Ok(false);
                }
                let comm = starting.finish(lane.logical, &lane.name, lane.members.to_vec());
                // From now on an abort of the rank's communicators covers
                // this one (P8): its connecting kernels may wait for the
                // other rank.
                {
                    let mut comms = lock(&ctx.comms);
                    if ctx.closed.load(Ordering::Acquire) {
                        drop(comms);
                        abort_together(&[comm]);
                        return Err(Error::Aborted(format!(
                            "rank {}'s communicators were aborted",
                            ctx.rank
                        )));
                    }
                    comms.push(comm.clone());
                }
                ctx.device.bind()?;
                let stream = Stream::new()?;
                let peer = comm.rank_of(lane.other(ctx.rank)).unwrap_or(0);
                let warm = ctx.warmup.ptr();
                let issuing = ctx.issue.lock();
                let held = [comm.enter()?];
                let end = issuing.group(&ctx.lib, &held, || {
                    // SAFETY: the rank's warm-up bytes live as long as its
                    // context, which outlives its communicators' kernels
                    // (they are aborted or done before it drops); the
                    // stream is live; the issue lock is held.
                    unsafe {
                        held[0].send(warm, 1, DType::U8.nccl(), peer, stream.raw())?;
                        held[0].recv(warm + 1, 1, DType::U8.nccl(), peer, stream.raw())?;
                    }
                    Ok(())
                })?;
                drop(held);
                drop(issuing);
                end?;
                part.phase = Phase::Connecting { comm, stream };
                Ok(false)
            }
            Phase::Connecting { comm, stream } => {
                // `ncclCommGetAsyncError` needs no issue lock (P1).
                if !comm.enter()?.async_error()? {
                    part.phase = Phase::Connecting { comm, stream };
                    return Ok(false);
                }
                ctx.device.bind()?;
                let event = Event::new(false)?;
                event.record(&stream)?;
                part.phase = Phase::Draining {
                    comm,
                    stream,
                    event,
                };
                Ok(false)
            }
            Phase::Draining {
                comm,
                stream,
                event,
            } => {
                comm.check()?;
                if !event.done()? {
                    part.phase = Phase::Draining {
                        comm,
                        stream,
                        event,
                    };
                    return Ok(false);
                }
                publish(&ctx, lane, part, comm, stream)?;
                Ok(true)
            }
            Phase::Gone => Err(Error::Aborted(format!(
                "lane {} was advanced after it ended",
                lane.name
            ))),
        }
    }

    fn abandon(&self, _: &LaneSpec, part: NcclPart) {
        match part.phase {
            Phase::Setup(starting) => starting.abandon(),
            Phase::Connecting { comm, stream } | Phase::Draining { comm, stream, .. } => {
                abort_together(&[comm]);
                // Its kernels may still be stopping: keep the stream.
                std::mem::forget(stream);
            }
            Phase::Gone => {}
        }
    }

    fn failed(&self) -> Option<(duplex::Rank, String)> {
        let ctx = self.ctx.upgrade()?;
        ctx.health.failed(ctx.rank)
    }
}

/// Puts a made lane in the rank's slots, registry and costs.
fn publish(
    ctx: &RankCtx,
    lane: &LaneSpec,
    part: &NcclPart,
    comm: Comm,
    stream: Stream,
) -> Result<()> {
    let id = ctx.registry.stream(ctx.rank, &lane.name);
    let stream = NcclStream(Arc::new(StreamInner::new(stream, &lane.name, ctx.rank, id)));
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
    // SAFETY: held; `ncclCommMemStats` only reads the communicator.
    let stats = unsafe { comm.enter()?.call(|lib, raw| Ok(lib.memory(raw.0))) }?;
    let (bytes, measured_by) = match stats {
        Some(b) => (b, "ncclCommMemStats"),
        None => (
            part.before
                .saturating_sub(ctx.device.memory().map_or(0, |m| m.0 as u64)),
            "free device memory before and after (lanes made at once skew it)",
        ),
    };
    lock(&ctx.costs).push(LaneCost {
        name: lane.name.clone(),
        create_ms: part.started.elapsed().as_secs_f64() * 1e3,
        bytes,
        measured_by,
    });
    Ok(())
}
