//! [`SimRank`]: the simulator's [`Transport`], one handle per host thread.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::panic::Location;
use std::sync::Arc;

use duplex::transport::{DeviceBuffer, check};
use duplex::{Dir, Element, Error, Lane, Place, Policy, Rank, Result, Transport};

use super::Lanes;
use super::world::{BufData, Ctl, Ending, Shared, Use};
use duplex::machine::{CommId, EventId, HostCall, LaunchSpec, OpSpec, StreamId, ThreadId};

/// A buffer of simulated device memory (host memory; real bytes move).
/// Dropping it frees its bytes once the ops in flight on it are done with
/// them, as the GPU backend frees a dropped buffer's device memory.
#[derive(Debug)]
pub struct SimBuffer<E> {
    id: usize,
    /// The execution that made it ([`World::run`]).
    run: u64,
    len: usize,
    /// The execution's world, to free the bytes on drop (weak: a buffer
    /// kept past its execution keeps nothing alive).
    world: std::sync::Weak<Shared>,
    _e: PhantomData<fn() -> E>,
}

impl<E> Drop for SimBuffer<E> {
    fn drop(&mut self) {
        if let Some(shared) = self.world.upgrade() {
            let mut w = shared.lock();
            if w.run == self.run {
                w.drop_buffer(self.id);
            }
        }
    }
}

/// Why a buffer of another execution is refused.
const STALE: &str = "the buffer was made by another run or execution of the simulator (each execution starts with no buffers: allocate them in the rank code)";

/// Why a stream, event, communicator or thread of another execution is
/// refused: its number could name one of this execution's.
fn stale(what: &str) -> String {
    format!(
        "the {what} was made by another run or execution of the simulator (each execution starts with none: make it in the rank code)"
    )
}

impl<E> DeviceBuffer for SimBuffer<E> {
    fn len(&self) -> usize {
        self.len
    }
}

/// A simulated stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimStream {
    id: StreamId,
    rank: Rank,
    /// The execution that made it ([`World::run`]).
    run: u64,
}

/// A simulated event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimEvent {
    id: EventId,
    rank: Rank,
    /// The execution that made it ([`World::run`]).
    run: u64,
}

/// A simulated communicator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimComm {
    id: CommId,
    /// The execution that made it ([`World::run`]).
    run: u64,
}

/// A host thread started by [`SimRank::spawn`](Transport::spawn).
#[derive(Debug)]
pub struct SimThread {
    id: ThreadId,
    /// The execution that started it ([`World::run`]).
    run: u64,
}

/// One host thread's handle on a simulated rank.
#[derive(Debug)]
pub struct SimRank {
    shared: Arc<Shared>,
    rank: Rank,
    thread: ThreadId,
    /// The execution ([`World::run`]): what its streams, events,
    /// communicators and threads carry.
    run: u64,
    world_size: u32,
    policy: Policy,
    lanes: Arc<Lanes>,
    /// Ops collected by an open `group`, with their buffers and texts.
    group: RefCell<Option<Vec<(OpSpec, Use, String)>>>,
    /// Streams set by `with_stream`, innermost last.
    scoped: RefCell<Vec<StreamId>>,
}

/// Runs `f` as thread `handle` once the scheduler starts it, then ends it.
pub(crate) fn run_thread<F>(handle: SimRank, f: F)
where
    F: FnOnce(&SimRank) -> Result<()>,
{
    let shared = handle.shared.clone();
    let t = handle.thread;
    if shared.wait_turn(shared.lock(), t).is_err() {
        // The execution ended before this thread started.
        let mut w = shared.lock();
        w.ctl[t.0 as usize] = Ctl::Done;
        w.wake();
        return;
    }
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&handle)));
    let result = match result {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(panic) => Err(match panic.downcast_ref::<&str>() {
            Some(s) => format!("panicked: {s}"),
            None => match panic.downcast_ref::<String>() {
                Some(s) => format!("panicked: {s}"),
                None => "panicked".to_string(),
            },
        }),
    };
    shared.finish(t, result);
}

impl SimRank {
    pub(crate) fn new(
        shared: Arc<Shared>,
        rank: Rank,
        thread: ThreadId,
        run: u64,
        world_size: u32,
        policy: Policy,
        lanes: Arc<Lanes>,
    ) -> SimRank {
        SimRank {
            shared,
            rank,
            thread,
            run,
            world_size,
            policy,
            lanes,
            group: RefCell::new(None),
            scoped: RefCell::new(Vec::new()),
        }
    }

    /// Makes a host call that goes through the scheduler.
    fn call(&self, call: HostCall, bufs: Vec<Use>) -> Result<()> {
        self.shared.call(self.thread, call, bufs)
    }

    fn origin(&self, at: &Location<'_>, text: String) -> Result<duplex::machine::Origin> {
        let mut w = self.shared.lock();
        if w.over {
            return Err(self.shared.ended(w, self.thread));
        }
        Ok(w.origin(check::place(at), text))
    }

    /// The comm and stream of an op toward `peer`.
    fn resolve(
        &self,
        at: &Location<'_>,
        what: &str,
        peer: Rank,
        dir: Dir,
        bytes: u64,
        place: &Place<Self>,
    ) -> Result<(CommId, StreamId)> {
        check::peer(at, || what.to_string(), peer, self.world_size)?;
        let lane = {
            let mut w = self.shared.lock();
            self.lanes
                .open(w.machine.setup_mut(), self.rank, peer, dir, Some(bytes))
        };
        let Some((lane_comm, lane_stream, _)) = lane else {
            return check::invalid(at, format!("{what}: no lane toward rank {peer}"));
        };
        if let Some(c) = &place.comm
            && c.run != self.run
        {
            return check::invalid(at, format!("{what}: {}", stale("communicator")));
        }
        if let Some(s) = &place.stream
            && s.run != self.run
        {
            return check::invalid(at, format!("{what}: {}", stale("stream")));
        }
        if let Some(s) = &place.stream
            && s.rank != self.rank
        {
            return check::invalid(
                at,
                format!(
                    "{what}: the stream belongs to rank {}, not rank {}",
                    s.rank, self.rank
                ),
            );
        }
        Ok(check::resolve(
            place.comm.as_ref().map(|c| c.id),
            place.stream.as_ref().map(|s| s.id),
            self.scoped.borrow().last().copied(),
            Some((lane_comm, lane_stream)),
            || lane_comm,
            || self.lanes.defaults[self.rank as usize],
        ))
    }

    fn p2p<E: Element>(
        &self,
        at: &'static Location<'static>,
        dir: Dir,
        buf: &SimBuffer<E>,
        peer: Rank,
        place: &Place<Self>,
    ) -> Result<()> {
        let what = check::op_text(dir, buf.len, E::DTYPE, peer);
        {
            let w = self.shared.lock();
            if w.over {
                return Err(self.shared.ended(w, self.thread));
            }
            if buf.run != w.run {
                return check::invalid(at, format!("{what}: {STALE}"));
            }
            if w.buffers.get(buf.id).is_none_or(|b| b.rank != self.rank) {
                return check::invalid(at, format!("{what}: the buffer belongs to another rank"));
            }
        }
        let bytes = (buf.len * E::DTYPE.size()) as u64;
        let (comm, stream) = self.resolve(at, &what, peer, dir, bytes, place)?;
        let used = Use {
            buf: buf.id,
            dir,
            peer,
            count: buf.len,
            dtype: E::DTYPE,
            stream: stream.0,
            part: comm.0,
            at,
            site: check::site(),
        };
        let _span = tracing::trace_span!(
            "duplex.op",
            backend = "sim",
            rank = self.rank,
            thread = self.thread.0,
            lane = %self.comm_name(comm),
            op = dir.name(),
            peer,
            bytes = (buf.len * E::DTYPE.size()) as u64,
            grouped = self.group.borrow().is_some(),
        )
        .entered();
        let mut spec = OpSpec {
            dir,
            peer,
            bytes: (buf.len * E::DTYPE.size()) as u64,
            dtype: E::DTYPE,
            comm,
            stream,
            origin: None,
        };
        if self.group.borrow().is_some() {
            // An op of a group is reported at its own line, not the
            // group's: a group of several sends names the one at fault.
            spec.origin = Some(self.origin(at, what.clone())?);
            if let Some(ops) = self.group.borrow_mut().as_mut() {
                ops.push((spec, used, what));
            }
            return Ok(());
        }
        let origin = self.origin(at, what)?;
        self.call(
            HostCall::Launch(LaunchSpec {
                ops: vec![spec],
                grouped: false,
                origin,
            }),
            vec![used],
        )
    }

    /// The name of communicator `c` (for spans).
    fn comm_name(&self, c: CommId) -> String {
        self.shared
            .lock()
            .machine
            .setup()
            .comms
            .get(c.0 as usize)
            .map(|i| i.name.clone())
            .unwrap_or_default()
    }

    /// Refuses an event of another execution or rank for `call`.
    fn check_event(&self, at: &Location<'_>, e: &SimEvent, call: &str) -> Result<()> {
        if e.run != self.run {
            check::invalid(at, stale("event"))
        } else if e.rank != self.rank {
            check::invalid(at, format!("{call}: the event belongs to rank {}", e.rank))
        } else {
            Ok(())
        }
    }

    fn check_stream(&self, at: &Location<'_>, s: &SimStream) -> Result<()> {
        if s.run != self.run {
            check::invalid(at, stale("stream"))
        } else if s.rank == self.rank {
            Ok(())
        } else {
            check::invalid(
                at,
                format!(
                    "the stream belongs to rank {}, not rank {}",
                    s.rank, self.rank
                ),
            )
        }
    }

    /// A communicator is made by `ncclCommSplit` of the world, which is
    /// collective over every rank: each rank's `k`-th communicator returns
    /// only once every rank has called for its `k`-th. Modelled with the
    /// machine's own `notify` and `await`: the rank tells every other rank
    /// it has arrived, then waits for each of theirs; so a rank that never
    /// creates it, or creates it only after it waits for this rank, is a
    /// hang the explorer reports, with the cycle through the split.
    fn split_barrier(&self, at: &Location<'_>, k: usize, name: &str) -> Result<()> {
        let others: Vec<Rank> = (0..self.world_size).filter(|r| *r != self.rank).collect();
        if others.is_empty() {
            return Ok(());
        }
        let tag = {
            let mut w = self.shared.lock();
            w.machine.setup_mut().tag(&check::split_tag(k, name))
        };
        let said = |what: String| self.origin(at, check::split_step(k, name, &what));
        for &to in &others {
            let origin = said(format!("tells rank {to} it has arrived"))?;
            self.call(HostCall::Notify { to, tag, origin }, vec![])?;
        }
        for &from in &others {
            let origin = said(format!("waits for rank {from} to arrive"))?;
            self.call(HostCall::Await { from, tag, origin }, vec![])?;
        }
        Ok(())
    }

    fn buffer_users<E>(&self, at: &Location<'_>, buf: &SimBuffer<E>, what: &str) -> Result<()> {
        let id = buf.id;
        if let Some(ops) = self.group.borrow().as_ref()
            && let Some((_, _, text)) = ops.iter().find(|(_, u, _)| u.buf == id)
        {
            return check::in_open_group(at, what, text);
        }
        let mut w = self.shared.lock();
        if w.over {
            return Err(self.shared.ended(w, self.thread));
        }
        if buf.run != w.run {
            return check::invalid(at, format!("{what}: {STALE}"));
        }
        match w.buffers.get(id) {
            Some(b) if b.rank == self.rank => {}
            _ => return check::invalid(at, format!("{what}: the buffer belongs to another rank")),
        }
        if let Some((_, text)) = w.user_of(id) {
            // A sync may have covered its ops through an event all the
            // same (as the GPU backend asks, `NcclRank::check_users`).
            if w.orders[self.rank as usize].idle(id as u64) {
                w.host_knows_done(id);
            } else {
                // Whether the op has completed on the device is not said:
                // it depends on other ranks' steps, which the search takes
                // to commute with this rank's (a review's program branched
                // on it, and the search missed the order it failed in).
                // Whether the access is refused depends on the
                // interleaving: code that goes on after the error was told.
                w.observe(self.thread, b"refused");
                // A refused access is a use too: in another order it is
                // allowed, and the code may branch on which.
                w.note_buffer(self.thread, id, duplex::machine::Mode::HostRead);
                return Err(Error::Race {
                    at: check::place(at),
                    message: format!(
                        "{what} of a buffer that `{text}` uses, and no synchronize has waited for it: synchronize its stream first"
                    ),
                });
            }
        }
        // No op uses it as far as the host knows: the device accesses
        // before are complete (D1).
        w.orders[self.rank as usize].host_access(id as u64);
        Ok(())
    }
}

impl Transport for SimRank {
    type Buffer<E: Element> = SimBuffer<E>;
    type Stream = SimStream;
    type Event = SimEvent;
    type Comm = SimComm;
    type Thread = SimThread;

    fn rank(&self) -> Rank {
        self.rank
    }

    fn world_size(&self) -> u32 {
        self.world_size
    }

    fn policy(&self) -> Policy {
        self.policy
    }

    fn copy_from(&self) -> Option<u64> {
        self.lanes.copy_from()
    }

    #[track_caller]
    fn alloc<E: Element>(&self, len: usize) -> Result<SimBuffer<E>> {
        // Taken here: a closure does not pass on `track_caller`.
        let at = Location::caller();
        let mut w = self.shared.lock();
        if w.over {
            return Err(self.shared.ended(w, self.thread));
        }
        let bytes = len
            .checked_mul(E::DTYPE.size())
            .filter(|b| *b <= 1 << 34)
            .ok_or_else(|| Error::Invalid {
                at: check::place(at),
                message: format!(
                    "alloc of {len} x {}: too large for the simulator (16 GiB at most)",
                    E::DTYPE
                ),
            })?;
        // The simulator holds every buffer's bytes: refuse, with the
        // reason, what would run the machine out of memory (an allocation
        // failure aborts the process, and the kernel's OOM killer gives no
        // reason at all).
        // Twice the buffers: what a rank writes into one, and what a recv
        // moves into one, is a host copy as large (a schedule file's
        // payload, say), and a run's ranks hold theirs at once (a review
        // measured 4.2 GB for one 1 GiB message, a send's buffer and a
        // recv's; and a run that reserved one copy per buffer killed by the
        // OOM killer at 24 GB for buffers of 32 GiB). Counted over every
        // run of the process: `cargo test` runs tests in parallel.
        let available = crate::memory::available();
        let Some(zeroed) = crate::memory::held_zeroed(bytes, available) else {
            return Err(Error::Invalid {
                at: check::place(at),
                message: format!(
                    "alloc of {len} x {}: the simulator holds every buffer's bytes in host memory, with a host copy as large of what is written into it, and {} more on top of the {} the simulator's runs in this process hold, twice over, is more than this machine has{}; run it with smaller messages, or drop buffers it no longer uses (a dropped buffer's bytes are freed once its ops are done with them; `duplex check` needs no memory for messages)",
                    E::DTYPE,
                    duplex::Size(bytes as u64),
                    duplex::Size(crate::memory::held()),
                    available
                        .map(|a| format!(
                            " ({} available when the process first asked)",
                            duplex::Size(a)
                        ))
                        .unwrap_or_default()
                ),
            });
        };
        w.buffer_bytes += bytes as u64;
        let key = w.next_buffer_key(self.thread);
        w.buffers.push(BufData::new(self.rank, zeroed, key));
        Ok(SimBuffer {
            id: w.buffers.len() - 1,
            run: w.run,
            len,
            world: Arc::downgrade(&self.shared),
            _e: PhantomData,
        })
    }

    #[track_caller]
    fn write<E: Element>(&self, buf: &mut SimBuffer<E>, data: &[E]) -> Result<()> {
        let at = Location::caller();
        check::write_len(at, data.len(), buf.len)?;
        self.buffer_users(at, buf, "write")?;
        let mut bytes = Vec::with_capacity(buf.len * E::DTYPE.size());
        for x in data {
            x.to_le(&mut bytes);
        }
        let mut w = self.shared.lock();
        w.buffers[buf.id].set(bytes);
        w.note_buffer(self.thread, buf.id, duplex::machine::Mode::Write);
        Ok(())
    }

    #[track_caller]
    fn read<E: Element>(&self, buf: &SimBuffer<E>) -> Result<Vec<E>> {
        let at = Location::caller();
        self.buffer_users(at, buf, "read")?;
        let mut w = self.shared.lock();
        let size = E::DTYPE.size();
        let out = w.buffers[buf.id]
            .bytes
            .chunks_exact(size)
            .map(E::from_le)
            .collect();
        // What the code reads is what it may branch on: the bytes' hash,
        // which the explorer's fingerprint takes of the buffer anyway.
        let digest = w.buffers[buf.id].digest();
        w.observe(self.thread, &digest.to_le_bytes());
        w.note_buffer(self.thread, buf.id, duplex::machine::Mode::HostRead);
        Ok(out)
    }

    fn stream(&self, name: &str) -> Result<SimStream> {
        let mut w = self.shared.lock();
        if w.over {
            return Err(self.shared.ended(w, self.thread));
        }
        let id = w.machine.setup_mut().add_stream(self.rank, name);
        w.made_by[0].push(self.thread);
        w.machine.sync_setup();
        Ok(SimStream {
            id,
            rank: self.rank,
            run: self.run,
        })
    }

    #[track_caller]
    fn comm(&self, name: &str, members: &[Rank]) -> Result<Option<SimComm>> {
        let at = Location::caller();
        // Members as a set, as the NCCL backend's split orders them by
        // rank: [1, 0] on one rank and [0, 1] on another are one
        // communicator.
        let members = &check::members(at, name, members, self.world_size)?;
        let (k, id) = {
            let mut w = self.shared.lock();
            if w.over {
                return Err(self.shared.ended(w, self.thread));
            }
            let k = w.comm_calls[self.rank as usize];
            w.comm_calls[self.rank as usize] += 1;
            w.note(
                self.thread,
                crate::dpor::Obj::Comms,
                duplex::machine::Mode::Write,
            );
            let id = match w.user_comms.get(k) {
                Some((n, m, id)) if n == name && m == members => *id,
                Some((n, m, _)) => {
                    return check::invalid(
                        at,
                        format!(
                            "comm `{name}` over {members:?} is this rank's communicator #{k}, but another rank created `{n}` over {m:?} as #{k}: every rank must create communicators in the same order"
                        ),
                    );
                }
                None => {
                    let warm = !w.machine.setup().model.lazy_connect;
                    let id = w.machine.setup_mut().add_comm(name, members.to_vec(), warm);
                    w.made_by[3].push(self.thread);
                    w.user_comms.push((name.to_string(), members.to_vec(), id));
                    id
                }
            };
            (k, id)
        };
        self.split_barrier(at, k, name)?;
        Ok(members
            .contains(&self.rank)
            .then_some(SimComm { id, run: self.run }))
    }

    fn world(&self) -> SimComm {
        SimComm {
            id: CommId(0),
            run: self.run,
        }
    }

    #[track_caller]
    fn lane(&self, peer: Rank, dir: Dir) -> Result<Lane<Self>> {
        let lane = {
            let mut w = self.shared.lock();
            self.lanes
                .open(w.machine.setup_mut(), self.rank, peer, dir, None)
        };
        match lane {
            Some((comm, stream, name)) => Ok(Lane {
                name,
                comm: SimComm {
                    id: comm,
                    run: self.run,
                },
                stream: SimStream {
                    id: stream,
                    rank: self.rank,
                    run: self.run,
                },
            }),
            None => check::invalid(
                Location::caller(),
                format!(
                    "lane toward rank {peer}: it does not exist (there are {} ranks)",
                    self.world_size
                ),
            ),
        }
    }

    #[track_caller]
    fn send_on<E: Element>(
        &self,
        buf: &SimBuffer<E>,
        peer: Rank,
        place: &Place<Self>,
    ) -> Result<()> {
        self.p2p(Location::caller(), Dir::Send, buf, peer, place)
    }

    #[track_caller]
    fn recv_on<E: Element>(
        &self,
        buf: &mut SimBuffer<E>,
        peer: Rank,
        place: &Place<Self>,
    ) -> Result<()> {
        self.p2p(Location::caller(), Dir::Recv, buf, peer, place)
    }

    #[track_caller]
    fn send<E: Element>(&self, buf: &SimBuffer<E>, peer: Rank) -> Result<()> {
        self.p2p(Location::caller(), Dir::Send, buf, peer, &Place::lane())
    }

    #[track_caller]
    fn recv<E: Element>(&self, buf: &mut SimBuffer<E>, peer: Rank) -> Result<()> {
        self.p2p(Location::caller(), Dir::Recv, buf, peer, &Place::lane())
    }

    #[track_caller]
    fn group<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let at = Location::caller();
        // (The borrow ends here: `f` issues into the group.)
        let open = self.group.borrow().as_ref().map(|ops| ops.len());
        if let Some(mark) = open {
            // Nested groups flatten, as in NCCL; what a nested group's
            // closure issued is dropped if it fails (or panics), so that
            // nothing of a failed group is launched.
            return check::nested_group(f, || {
                if let Some(ops) = self.group.borrow_mut().as_mut() {
                    ops.truncate(mark);
                }
            });
        }
        *self.group.borrow_mut() = Some(Vec::new());
        // A panic in `f` that the code catches closes the group, dropping
        // its ops, rather than leaving every later op in a group that is
        // never launched.
        let _close = check::OnDrop(|| drop(self.group.borrow_mut().take()));
        let result = f();
        let ops = self.group.borrow_mut().take().unwrap_or_default();
        let value = result?;
        if ops.is_empty() {
            return Ok(value);
        }
        let texts: Vec<&str> = ops.iter().map(|(_, _, t)| t.as_str()).collect();
        let origin = self.origin(at, format!("group {{ {} }}", texts.join("; ")))?;
        let (specs, bufs) = ops.into_iter().map(|(s, u, _)| (s, u)).unzip();
        self.call(
            HostCall::Launch(LaunchSpec {
                ops: specs,
                grouped: true,
                origin,
            }),
            bufs,
        )?;
        Ok(value)
    }

    #[track_caller]
    fn with_stream<R>(&self, stream: &SimStream, f: impl FnOnce() -> Result<R>) -> Result<R> {
        self.check_stream(Location::caller(), stream)?;
        self.scoped.borrow_mut().push(stream.id);
        // Popped however `f` ends, a caught panic included.
        let _pop = check::OnDrop(|| {
            self.scoped.borrow_mut().pop();
        });
        f()
    }

    fn event(&self) -> Result<SimEvent> {
        let mut w = self.shared.lock();
        if w.over {
            return Err(self.shared.ended(w, self.thread));
        }
        let name = w.next_event_name(self.thread);
        let id = w.machine.setup_mut().add_event(self.rank, name);
        w.made_by[1].push(self.thread);
        w.machine.sync_setup();
        Ok(SimEvent {
            id,
            rank: self.rank,
            run: self.run,
        })
    }

    #[track_caller]
    fn record(&self, event: &SimEvent, stream: &SimStream) -> Result<()> {
        let at = Location::caller();
        self.check_stream(at, stream)?;
        self.check_event(at, event, "record")?;
        let origin = self.origin(at, "record".into())?;
        self.call(
            HostCall::Record {
                event: event.id,
                stream: stream.id,
                origin,
            },
            vec![],
        )
    }

    #[track_caller]
    fn wait(&self, event: &SimEvent, stream: &SimStream) -> Result<()> {
        let at = Location::caller();
        self.check_stream(at, stream)?;
        self.check_event(at, event, "wait")?;
        let origin = self.origin(at, "wait".into())?;
        self.call(
            HostCall::Wait {
                event: event.id,
                stream: stream.id,
                origin,
            },
            vec![],
        )
    }

    #[track_caller]
    fn sync_stream(&self, stream: &SimStream) -> Result<()> {
        let at = Location::caller();
        self.check_stream(at, stream)?;
        let origin = self.origin(at, "sync_stream".into())?;
        self.call(
            HostCall::Sync {
                stream: Some(stream.id),
                origin,
            },
            vec![],
        )
    }

    #[track_caller]
    fn synchronize(&self) -> Result<()> {
        let origin = self.origin(Location::caller(), "synchronize".into())?;
        self.call(
            HostCall::Sync {
                stream: None,
                origin,
            },
            vec![],
        )
    }

    #[track_caller]
    fn notify(&self, peer: Rank, tag: &str) -> Result<()> {
        let at = Location::caller();
        check::peer(
            at,
            || format!("notify({peer}, {tag})"),
            peer,
            self.world_size,
        )?;
        check::user_tag(Location::caller(), || format!("notify({peer}, {tag})"), tag)?;
        let origin = self.origin(at, format!("notify {peer} {tag}"))?;
        let tag = self.shared.lock().machine.setup_mut().tag(tag);
        self.call(
            HostCall::Notify {
                to: peer,
                tag,
                origin,
            },
            vec![],
        )
    }

    #[track_caller]
    fn await_notify(&self, peer: Rank, tag: &str) -> Result<()> {
        let at = Location::caller();
        check::peer(
            at,
            || format!("await_notify({peer}, {tag})"),
            peer,
            self.world_size,
        )?;
        check::user_tag(
            Location::caller(),
            || format!("await_notify({peer}, {tag})"),
            tag,
        )?;
        let origin = self.origin(at, format!("await {peer} {tag}"))?;
        let tag = self.shared.lock().machine.setup_mut().tag(tag);
        self.call(
            HostCall::Await {
                from: peer,
                tag,
                origin,
            },
            vec![],
        )
    }

    fn spawn<F>(&self, name: &str, f: F) -> Result<SimThread>
    where
        F: FnOnce(&Self) -> Result<()> + Send + 'static,
    {
        let mut w = self.shared.lock();
        if w.over {
            return Err(self.shared.ended(w, self.thread));
        }
        let id = w.machine.setup_mut().add_thread(self.rank, name);
        w.made_by[2].push(self.thread);
        if let Some(d) = w.dpor() {
            d.spawned(id, self.thread);
        }
        w.machine.sync_setup();
        w.ctl.push(Ctl::Starting);
        w.turns.push(std::sync::Arc::new(std::sync::Condvar::new()));
        w.results.push(None);
        let handle = SimRank::new(
            self.shared.clone(),
            self.rank,
            id,
            self.run,
            self.world_size,
            self.policy,
            self.lanes.clone(),
        );
        // Started without the world's lock: a closure that cannot start is
        // dropped inside `spawn`, and the buffers it holds take the lock
        // as they drop. The new thread waits for its turn, which this one
        // holds.
        drop(w);
        let started = std::thread::Builder::new()
            .name(format!("duplex-sim rank {} {name}", self.rank))
            .spawn(move || run_thread(handle, f));
        let mut w = self.shared.lock();
        match started {
            Ok(os) => {
                w.os_threads.push(os);
                Ok(SimThread { id, run: self.run })
            }
            Err(e) => {
                // The thread will never make its calls: the execution ends
                // with the reason, rather than wait for it.
                let error = format!(
                    "cannot start the OS thread of `{name}` ({e}): the simulator runs an OS thread per spawned thread; raise the limit on threads (ulimit -u, a container's pids limit) or on memory, or spawn fewer"
                );
                w.ctl[id.0 as usize] = Ctl::Done;
                w.end(Ending::Thread {
                    thread: self.thread,
                    error: error.clone(),
                });
                w.wake();
                Err(Error::Aborted(error))
            }
        }
    }

    #[track_caller]
    fn join(&self, thread: SimThread) -> Result<()> {
        if thread.run != self.run {
            return check::invalid(Location::caller(), stale("thread"));
        }
        let origin = self.origin(Location::caller(), "join".into())?;
        self.call(
            HostCall::Join {
                thread: thread.id,
                origin,
            },
            vec![],
        )?;
        let w = self.shared.lock();
        w.results
            .get(thread.id.0 as usize)
            .cloned()
            .flatten()
            .unwrap_or(Ok(()))
    }
}
