//! Copy-engine lanes: one direction of traffic between two GPUs moved by
//! the GPUs' copy engines instead of NCCL kernels, with the blocking rules
//! C1–C6 of `docs/semantics.md` ("Copy-engine lanes").
//!
//! # How a message moves
//!
//! Message *k* of a lane (its *k*-th send meets its *k*-th recv, C2) goes
//! like this, whichever side is issued first:
//!
//! 1. Each side, when issued on its stream, records a **ready** event there
//!    (everything before the op on that stream is done: the send's bytes are
//!    written, the recv's buffer is free) and then makes its stream **wait**
//!    until the lane's flag slot `k % SLOTS` holds at least `k / SLOTS + 1`.
//!    The stream is now blocked at the op, as an NCCL op blocks it until its
//!    partner runs (R4); nothing on the host blocks.
//! 2. When the second side is issued, the two are compared (size, element
//!    type: a difference is a program error naming both, and nothing is
//!    enqueued), and the lane's own **copy stream** is given: wait for both
//!    ready events, copy the bytes into the recv buffer, record a **done**
//!    event; then, once the lane has registered the copy, write
//!    `k / SLOTS + 1` into the slot. The write releases both user streams.
//!    The done event is recorded before the write, and the copy registered
//!    before the write is enqueued, so a stream released by it finds the
//!    copy done and known to the lane ([`CopyLane::settle`] delivers it).
//!
//! No lock of the lane's state is held across an enqueue (it blocks while
//! a stream's queue is full, and a lane is shared by two ranks), only
//! across the settle's event queries (which do not wait for the device,
//! though one may wait for the driver while another thread is inside it;
//! so an abort tells and releases before it takes the lock): a side reserves its
//! message number under the lock, enqueues on its own stream without it,
//! then registers or matches under it. Matched copies are enqueued in
//! message order under the pump lock, by the thread that matched them
//! while the copy stream is shallow ([`INLINE_DEPTH`]), else by the lane's
//! service thread ([`CopyLane::start`]). A lane whose sending side is
//! another process holds a matched copy back until that process's ready
//! event has completed ([`CopyApi::may_copy`]); the service polls for it.
//!
//! Copies of a lane run in message order on its one copy stream, so each
//! slot's value only grows and a waiter is never released by an older
//! message. The flags live in pinned host memory mapped into every device,
//! so the host can write them too.
//!
//! # Never success without the bytes
//!
//! Each op gets a [`Ticket`]. It says [`Delivered`](TicketState::Delivered)
//! only once the lane has seen the copy's done event complete
//! ([`CopyLane::settle`]) before any abort let the streams go; an op whose
//! stream passed its wait for any other reason (an abort released it) is
//! [`Failed`](TicketState::Failed), even if its copy runs later: what came
//! after it on its stream may have used the bytes from before.
//!
//! # Abort
//!
//! [`CopyLane::abort`] (a hang past its deadline, a failed rank) marks every
//! ticket not yet delivered failed, refuses every later op, and writes
//! [`RELEASED`] into every slot, which releases every stream waiting on the
//! lane. A copy already enqueued may still run later (when its ready events
//! fire) and write its own smaller value into its slot; while aborted,
//! every [`CopyLane::settle`] writes [`RELEASED`] again, so such a write
//! can hold a stream back only until the next settle (the lane's service
//! settles every 50 ms when it is not blocked in an enqueue) or the next
//! tick of the rank's watchdog, which releases an aborted lane's slots
//! again with host stores ([`CopyPath::watch`]). An abort says why to the
//! other side and releases the slots before it takes the lane's lock
//! ([`CopyLane::let_go`]). The buffers of an
//! enqueued copy are held ([`CopyLane::issue`]'s `keep`) until its done
//! event completes, or for good if it never does (P6 of `crate::guard`).
//! They are dropped with no lane lock held; dropping one must not wait for
//! the device (the backend's buffers hand their memory to
//! `crate::reaper`).
//!
//! The device side is the [`CopyApi`] trait: [`Cuda`] on GPUs, and a fake in
//! the tests that checks this protocol on the CPU.

use std::collections::VecDeque;

use duplex::{DType, Dir, Error, ProgramErrorKind};

use std::sync::Arc;

use crate::guard::GetMut;
use crate::sync::{AtomicBool, Mutex, Ordering, lock};

/// Copies in flight on a lane's copy stream up to which the issuing thread
/// enqueues a matched copy itself (each takes five entries of the stream's
/// queue, which holds about a thousand before an enqueue blocks).
pub const INLINE_DEPTH: usize = 64;

/// How often the lane's service pumps while a matched message is held back
/// ([`CopyApi::may_copy`]): first every 20 µs, then less often, to every
/// [`HELD_POLL_MAX`] ([`held_poll`]).
pub const HELD_POLL: std::time::Duration = std::time::Duration::from_micros(20);

/// The longest wait between two pumps while a message is held back.
pub const HELD_POLL_MAX: std::time::Duration = std::time::Duration::from_millis(1);

/// The service's next wait after one of `poll` while a message is held
/// back: [`HELD_POLL`] again whenever the pump moved a message (a lane
/// whose source records each message's event only once the one before it
/// was copied holds every message back for a moment: each must be polled
/// for quickly), else twice as long, to [`HELD_POLL_MAX`] (the source's
/// stream may be busy for long); [`HELD_POLL`] once nothing is held.
pub fn held_poll(poll: std::time::Duration, held: bool, moved: bool) -> std::time::Duration {
    if !held || moved {
        HELD_POLL
    } else {
        (poll * 2).min(HELD_POLL_MAX)
    }
}

/// Flag slots per lane: messages `k` and `k + SLOTS` share a slot.
pub const SLOTS: usize = 1024;

/// The value message `k` waits for in its slot, with `n` slots.
fn generation_of(k: u64, n: usize) -> u32 {
    // CUDA compares cyclically (below): fine below 2^31 generations of
    // SLOTS messages.
    (k / n as u64 + 1) as u32
}

/// What a release writes into every slot. A stream's wait is satisfied
/// when `(slot - value) as i32 >= 0` (`CU_STREAM_WAIT_VALUE_GEQ` compares
/// cyclically, ignoring wraparound), so `u32::MAX` would read as -1 and
/// satisfy nothing; `i32::MAX` is ahead of every generation in use.
pub const RELEASED: u32 = i32::MAX as u32;

/// Whether a slot holding `slot` satisfies a wait for `value`, as the
/// device decides (`CU_STREAM_WAIT_VALUE_GEQ`).
pub fn satisfies(slot: u32, value: u32) -> bool {
    slot.wrapping_sub(value) as i32 >= 0
}

/// The slot of message `k`, with `n` slots.
fn slot_of(k: u64, n: usize) -> usize {
    (k % n as u64) as usize
}

/// What a copy-engine lane needs of the device. Every call enqueues work
/// and returns; none blocks on the device.
pub trait CopyApi: Send + Sync {
    /// A user's stream.
    type Stream;
    /// A ready event recorded on a user's stream.
    type Ready: Send;
    /// A done event recorded on the copy stream.
    type Done: Send;
    /// Records a ready event on `stream`.
    fn ready(&self, stream: &Self::Stream) -> Result<Self::Ready, Error>;
    /// Makes `stream` wait until flag `slot` holds at least `value`.
    fn wait(&self, stream: &Self::Stream, slot: usize, value: u32) -> Result<(), Error>;
    /// On the copy stream: wait for both ready events, copy `bytes` from
    /// `src` to `dst`, record a done event. A failure says whether the copy
    /// may have been enqueued.
    fn copy(
        &self,
        send: &Self::Ready,
        recv: &Self::Ready,
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> Result<Self::Done, CopyFailed>;
    /// On the copy stream, after the last copy: write `value` into `slot`,
    /// which releases the user streams waiting for it. Enqueued only once
    /// the lane knows the copy before it ([`CopyLane::settle`] can see its
    /// done event), so that a stream it releases never finds its op's copy
    /// unknown.
    fn release(&self, slot: usize, value: u32) -> Result<(), Error>;
    /// Whether a copy's done event has completed.
    fn done(&self, done: &Self::Done) -> Result<bool, Error>;
    /// Writes [`RELEASED`] into every slot, from the host.
    fn release_all(&self);
    /// Whether the copy of a matched message may be enqueued now. By
    /// default always: the copy stream waits for both ready events. A lane
    /// whose sending side is another process ([`ipc`]) says no until that
    /// process's ready event has completed, so that no stream of this
    /// process ever waits on another process's work: that process may die
    /// with the work pending, and the wait, with everything here that
    /// waits for the device (an abort, a free, the process's exit), would
    /// then never end. A message held back is enqueued by a later pump:
    /// the lane's service polls while one is ([`held_poll`]), so a lane
    /// whose `may_copy` can say no must have its service started
    /// ([`CopyLane::start`]).
    fn may_copy(&self, _send: &Self::Ready, _recv: &Self::Ready) -> Result<bool, Error> {
        Ok(true)
    }
    /// The number of flag slots ([`SLOTS`] on GPUs).
    fn slots(&self) -> usize {
        SLOTS
    }
    /// Never frees the flags: a stream may still wait on them after an
    /// abort, and freeing pinned memory waits for the device.
    fn leak(&self) {}
    /// The lane was aborted for `why`, called by every abort before its
    /// [`CopyApi::release_all`] (so idempotent: the first reason wins): a
    /// lane whose other side is in another process tells it here
    /// ([`ipc`]), so that a stream there that the release lets go finds
    /// why.
    fn aborted(&self, _why: &str) {}
    /// Why the other side, in another process, aborted the lane, once it
    /// has ([`ipc`]: it says why before it releases every slot, and the
    /// release lets this process's streams go too, before this lane's own
    /// abort has run): a copy seen done from then on may have landed after
    /// its streams went on, so it is failed, not delivered
    /// (`CopyLane::deliver_done`). `None` for a lane within one process,
    /// whose two sides share the lane's own abort.
    fn released_elsewhere(&self) -> Option<Arc<str>> {
        None
    }
}

/// Where an op of a lane stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TicketState {
    /// Issued; its partner has not been issued yet.
    Waiting,
    /// Matched; its copy is enqueued and not seen done yet.
    Copying,
    /// Its copy completed: the bytes are in the recv buffer.
    Delivered,
    /// It will never be delivered, or nobody can say it was: why.
    Failed(Arc<str>),
}

/// One op of a lane: message `k`, and where it stands.
#[derive(Debug)]
pub struct Ticket {
    k: u64,
    state: Mutex<TicketState>,
    /// Its copy was enqueued (or may have been) and not yet seen done: it
    /// may still write the recv's buffer, even once the ticket has failed
    /// (an abort lets the streams go without waiting for it).
    may_run: std::sync::atomic::AtomicBool,
}

impl Ticket {
    /// Message `k`'s op, waiting for its partner.
    fn waiting(k: u64) -> Arc<Ticket> {
        Arc::new(Ticket {
            k,
            state: Mutex::new(TicketState::Waiting),
            may_run: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Whether its copy may still run on the device: enqueued (or maybe
    /// enqueued, by a call that failed) and not seen done by a settle. A
    /// failed op whose copy may still run may yet write its recv buffer
    /// (found by review: after an abort, a host write of the buffer was
    /// allowed, and the late copy then overwrote it); the rank refuses
    /// to use such a buffer (`BufState::late_copy`).
    pub fn copy_may_run(&self) -> bool {
        self.may_run.load(std::sync::atomic::Ordering::Acquire)
    }

    fn set_may_run(&self, may: bool) {
        self.may_run
            .store(may, std::sync::atomic::Ordering::Release);
    }

    /// Why its op failed while its copy may still run, if so: the reason
    /// the buffer of a recv cannot be trusted or written yet.
    pub(crate) fn late(&self) -> Option<Arc<str>> {
        match self.state() {
            TicketState::Failed(why) if self.copy_may_run() => Some(why),
            _ => None,
        }
    }

    /// Why its op, whose stream went past its wait, did not deliver its
    /// bytes (`None`: it did), for a caller that settled `lane` just
    /// before: the reason the lane failed it, or that of an abort that let
    /// the stream go before failing the ticket.
    pub(crate) fn undelivered(&self, lane: &dyn CopyPath) -> Option<String> {
        match self.state() {
            TicketState::Delivered => None,
            TicketState::Failed(why) => Some(why.to_string()),
            s => Some(match lane.let_go_why() {
                Some(why) => why.to_string(),
                None => format!(
                    "its stream went on while its copy is {s:?}, which duplex does not expect (please report it)"
                ),
            }),
        }
    }

    /// The op's message number on its lane.
    pub fn message(&self) -> u64 {
        self.k
    }

    /// Where it stands.
    pub fn state(&self) -> TicketState {
        lock(&self.state).clone()
    }

    /// Moves to `to`, except out of `Failed` or `Delivered`.
    fn set(&self, to: TicketState) {
        let mut s = lock(&self.state);
        if matches!(*s, TicketState::Waiting | TicketState::Copying) {
            *s = to;
        }
    }
}

/// Something to keep alive until a copy is done (the op's buffer). Its drop
/// must not wait for the device (a lane drops it wherever it finishes).
pub type Keep = Box<dyn std::any::Any + Send + Sync>;

/// An op issued whose partner has not come yet.
struct Side<R> {
    ready: R,
    ptr: u64,
    bytes: usize,
    dtype: DType,
    text: String,
    ticket: Arc<Ticket>,
    keep: Keep,
}

/// A matched message whose copy the service has not enqueued yet.
struct Job<R> {
    k: u64,
    send: Side<R>,
    recv: Side<R>,
}

/// A copy enqueued and not seen done yet.
struct Enqueued<D> {
    done: D,
    tickets: [Arc<Ticket>; 2],
    keep: [Keep; 2],
}

struct State<A: CopyApi> {
    /// Sends, then recvs, issued beyond the other side (one of the two is
    /// empty), oldest first.
    ahead: [VecDeque<Side<A::Ready>>; 2],
    /// The next message number of sends and of recvs.
    next: [u64; 2],
    /// Matched messages for the service to enqueue, in message order.
    jobs: VecDeque<Job<A::Ready>>,
    /// Copies enqueued, in message order.
    copies: VecDeque<Enqueued<A::Done>>,
    /// Why the lane was aborted.
    aborted: Option<Arc<str>>,
}

fn ix(dir: Dir) -> usize {
    match dir {
        Dir::Send => 0,
        Dir::Recv => 1,
    }
}

/// One copy-engine lane: the traffic from one rank to another.
///
/// No lock of the lane's state is held across a device call: enqueuing
/// can block (a stream's queue is finite), and a lane is shared by two
/// ranks. Each side enqueues its own ready event and wait on its own
/// stream; the copies are enqueued, in message order, under the pump lock:
/// by the issuing thread that matched them when the copy stream is not deep
/// ([`INLINE_DEPTH`]) and no other thread is pumping, else by the lane's
/// service thread ([`CopyLane::serve`]), or a test ([`CopyLane::pump`]).
pub struct CopyLane<A: CopyApi> {
    name: String,
    api: A,
    state: Mutex<State<A>>,
    /// Serializes [`CopyLane::pump`], so that copies go on the copy stream
    /// in message order.
    pumping: Mutex<()>,
    /// The service thread ([`CopyLane::start`]), woken when a job is
    /// queued.
    service: std::sync::OnceLock<std::thread::Thread>,
    /// The last pump held a matched message back ([`CopyApi::may_copy`]):
    /// the service polls for it ([`held_poll`]).
    held: AtomicBool,
    /// Why the lane was aborted, first (set by the first half of every
    /// abort, [`CopyLane::let_go`], before its release and with no lock):
    /// a stream let go finds it even before the abort has failed the
    /// tickets, and the rank's watchdog then releases every slot again
    /// each tick ([`CopyPath::watch`]).
    let_go: std::sync::OnceLock<Arc<str>>,
}

impl<A: CopyApi> std::fmt::Debug for CopyLane<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyLane")
            .field("name", &self.name)
            .finish()
    }
}

/// The error of op `text` refused, or failed, because lane `lane` was
/// aborted for `why`.
fn lane_aborted(text: &str, lane: &str, why: &str) -> Error {
    Error::Aborted(format!("{text}: {lane} was aborted: {why}"))
}

/// What failed a side that was reserved: its wait may be on its stream.
fn failure(error: Error, ticket: Option<Arc<Ticket>>) -> IssueFailure {
    IssueFailure { error, ticket }
}

impl<A: CopyApi> CopyLane<A> {
    /// A lane named `name` (`copy:0->1`) on `api`. Its copies are enqueued
    /// by [`CopyLane::pump`]: start [`CopyLane::serve`] on a thread of its
    /// own, or call `pump` (tests).
    pub fn new(name: impl Into<String>, api: A) -> CopyLane<A> {
        CopyLane {
            name: name.into(),
            api,
            state: Mutex::new(State {
                ahead: [VecDeque::new(), VecDeque::new()],
                next: [0, 0],
                jobs: VecDeque::new(),
                copies: VecDeque::new(),
                aborted: None,
            }),
            pumping: Mutex::new(()),
            service: std::sync::OnceLock::new(),
            held: AtomicBool::new(false),
            let_go: std::sync::OnceLock::new(),
        }
    }

    /// The lane's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device side.
    pub fn api(&self) -> &A {
        &self.api
    }

    /// Issues one side of the next message on `stream`: `dir` from the
    /// lane's point of view (a send of its source rank, a recv of its
    /// destination rank), `ptr` the buffer's device address, `text` the op
    /// as reports name it. `keep` is held until the copy is done. Each side
    /// is issued by one thread at a time, in its stream order (the rank's
    /// issue lock).
    ///
    /// On failure, [`IssueFailure::ticket`] says whether the op is on its
    /// stream all the same (its wait was enqueued: it is launched, and
    /// failed). A device error aborts the lane.
    #[allow(clippy::too_many_arguments)]
    pub fn issue(
        &self,
        dir: Dir,
        stream: &A::Stream,
        ptr: u64,
        bytes: usize,
        dtype: DType,
        text: &str,
        keep: Keep,
    ) -> Result<Arc<Ticket>, IssueFailure> {
        let me = ix(dir);
        // 1. Under the lock: refuse on an abort or a mismatch with the
        // partner already issued; reserve the message number.
        let k = {
            let st = lock(&self.state);
            if let Some(why) = &st.aborted {
                let e = lane_aborted(text, &self.name, why);
                return Err(failure(e, None));
            }
            let k = st.next[me];
            if let Some(e) = self.mismatch(&st, k, dir, bytes, dtype, text) {
                return Err(failure(e, None));
            }
            k
        };
        // 2. No lock: the side's ready event and wait on its own stream (a
        // call that may block while the stream's queue is full).
        let (slot, value) = (
            slot_of(k, self.api.slots()),
            generation_of(k, self.api.slots()),
        );
        let ready = self.api.ready(stream).and_then(|r| {
            self.api.wait(stream, slot, value)?;
            Ok(r)
        });
        let ready = match ready {
            Ok(r) => r,
            Err(e) => {
                // Nothing of this op is on its stream that blocks it; the
                // caller's records count it: the lane is done for.
                self.abort(&format!("{text}: {e}"));
                return Err(failure(e, None));
            }
        };
        let ticket = Ticket::waiting(k);
        let side = Side {
            ready,
            ptr,
            bytes,
            dtype,
            text: text.to_string(),
            ticket: ticket.clone(),
            keep,
        };
        // 3. Under the lock: register the side, or match it.
        let mut dropped = Vec::new();
        let result = {
            let mut st = lock(&self.state);
            st.next[me] = k + 1;
            if let Some(why) = st.aborted.clone() {
                // Aborted meanwhile: the abort released the slots, so the
                // wait just enqueued passes; the op failed.
                ticket.set(TicketState::Failed(why.clone()));
                dropped.push(side.keep);
                let e = lane_aborted(text, &self.name, &why);
                Err(failure(e, Some(ticket)))
            } else if let Some(e) = self.mismatch(&st, k, dir, bytes, dtype, text) {
                // The partner came meanwhile, and differs: this op's wait is
                // on its stream; fail both and release them.
                dropped.push(side.keep);
                self.abort_locked(&mut st, &e.to_string(), &mut dropped);
                ticket.set(TicketState::Failed(e.to_string().into()));
                Err(failure(e, Some(ticket)))
            } else {
                self.place(&mut st, k, dir, side);
                Ok(ticket)
            }
        };
        drop(dropped);
        if result.is_ok() {
            self.pump_inline();
        }
        result
    }

    /// Matches side `k` of `dir` with its partner issued before it (a job
    /// for the pump), or queues it ahead of its partner. Under the lock,
    /// after [`CopyLane::mismatch`] found none.
    fn place(&self, st: &mut State<A>, k: u64, dir: Dir, side: Side<A::Ready>) {
        if let Some(p) = st.ahead[ix(dir.other())].pop_front() {
            tracing::debug!(lane = %self.name, k, ?dir, "copy lane: matched at issue");
            side.ticket.set(TicketState::Copying);
            p.ticket.set(TicketState::Copying);
            let (send, recv) = if dir == Dir::Send {
                (side, p)
            } else {
                (p, side)
            };
            st.jobs.push_back(Job { k, send, recv });
        } else {
            tracing::debug!(lane = %self.name, k, ?dir, "copy lane: issued ahead of its partner");
            st.ahead[ix(dir)].push_back(side);
        }
    }

    /// The program error if the partner issued at this side's position `k`
    /// differs in size or element type.
    fn mismatch(
        &self,
        st: &State<A>,
        k: u64,
        dir: Dir,
        bytes: usize,
        dtype: DType,
        text: &str,
    ) -> Option<Error> {
        let p = st.ahead[ix(dir.other())].front()?;
        if p.bytes == bytes && p.dtype == dtype {
            return None;
        }
        let (send, recv) = if dir == Dir::Send {
            (text, p.text.as_str())
        } else {
            (p.text.as_str(), text)
        };
        // R3's order (size first, then type) from the model's own
        // comparison, as NCCL lanes' issue check takes it.
        let kind =
            duplex::machine::issue::mismatch_kind((p.bytes as u64, p.dtype), (bytes as u64, dtype));
        let what = match kind {
            ProgramErrorKind::SizeMismatch => "size",
            _ => "element type",
        };
        Some(Error::Program {
            kind,
            message: format!(
                "message #{k} of {}: {send} is matched with {recv}, which differ in {what} (R3)",
                self.name
            ),
            ops: Vec::new(),
        })
    }

    /// The send side of message `k` issued by the source rank in another
    /// process ([`ipc`]): its ready event (opened here), its buffer (mapped
    /// here), and what it keeps mapped until its copy is done. Its ready
    /// event and its wait are on the sender's stream already; this only
    /// registers or matches it, as [`CopyLane::issue`]'s last step. Sends
    /// come in message order (`k` is the next send's number, else the lane
    /// is aborted). A mismatch with the recv issued at `k` is a program
    /// error naming both; it aborts the lane, which tells the sender.
    #[allow(clippy::too_many_arguments)]
    pub fn issue_remote(
        &self,
        k: u64,
        ready: A::Ready,
        ptr: u64,
        bytes: usize,
        dtype: DType,
        text: String,
        keep: Keep,
    ) -> Result<(), Error> {
        let mut dropped = Vec::new();
        let result = {
            let mut st = lock(&self.state);
            if let Some(why) = &st.aborted {
                dropped.push(keep);
                Err(lane_aborted(&text, &self.name, why))
            } else if st.next[0] != k {
                dropped.push(keep);
                let e = Error::Aborted(format!(
                    "{}: the sending process posted message #{k} where #{} was due",
                    self.name, st.next[0]
                ));
                self.abort_locked(&mut st, &e.to_string(), &mut dropped);
                Err(e)
            } else if let Some(e) = self.mismatch(&st, k, Dir::Send, bytes, dtype, &text) {
                dropped.push(keep);
                self.abort_locked(&mut st, &e.to_string(), &mut dropped);
                Err(e)
            } else {
                st.next[0] = k + 1;
                let ticket = Ticket::waiting(k);
                let side = Side {
                    ready,
                    ptr,
                    bytes,
                    dtype,
                    text,
                    ticket,
                    keep,
                };
                self.place(&mut st, k, Dir::Send, side);
                Ok(())
            }
        };
        drop(dropped);
        if result.is_ok() {
            self.pump_inline();
        }
        result
    }

    /// Enqueues the copies of the messages matched so far, in message
    /// order, each with no lane lock held. Returns how many it enqueued.
    pub fn pump(&self) -> usize {
        let _one = lock(&self.pumping);
        self.pump_held(usize::MAX)
    }

    /// What the issuing thread that matched a message does: enqueue the
    /// copy itself, unless another thread is doing so (it then takes this
    /// one too) or the copy stream already holds [`INLINE_DEPTH`] copies,
    /// which the service then enqueues (an enqueue into a full stream
    /// blocks, and the issuing thread holds its rank's issue lock).
    fn pump_inline(&self) {
        let Ok(_one) = self.pumping.try_lock() else {
            // The holder may be about to return without seeing this job:
            // the service takes it now rather than at its next poll.
            self.wake();
            return;
        };
        self.pump_held(INLINE_DEPTH);
    }

    /// [`CopyLane::pump`] with its lock held, while fewer than `depth`
    /// copies are in flight.
    fn pump_held(&self, depth: usize) -> usize {
        let mut n = 0;
        loop {
            if lock(&self.state).copies.len() >= depth {
                // Copies done but not yet seen done count too: look first.
                let _ = self.settle();
            }
            let job = {
                let mut st = lock(&self.state);
                if st.copies.len() >= depth {
                    // Deep: the service takes the rest.
                    drop(st);
                    self.wake();
                    return n;
                }
                st.jobs.pop_front()
            };
            let Some(job) = job else {
                self.held.store(false, Ordering::Release);
                return n;
            };
            // Not yet (another process's ready event): back at the front,
            // for a later pump; message order holds, since only a pump,
            // under the pump lock, takes jobs.
            match self.api.may_copy(&job.send.ready, &job.recv.ready) {
                Ok(true) => {}
                Ok(false) => {
                    let mut dropped = Vec::new();
                    {
                        let mut st = lock(&self.state);
                        match st.aborted.clone() {
                            // Aborted meanwhile: the abort failed the jobs
                            // it found; this one is failed here.
                            Some(why) => {
                                for s in [job.send, job.recv] {
                                    s.ticket.set(TicketState::Failed(why.clone()));
                                    dropped.push(s.keep);
                                }
                            }
                            None => st.jobs.push_front(job),
                        }
                    }
                    drop(dropped);
                    self.held.store(true, Ordering::Release);
                    // The service polls for it (waking itself would spin).
                    if self
                        .service
                        .get()
                        .is_some_and(|t| t.id() != std::thread::current().id())
                    {
                        self.wake();
                    }
                    return n;
                }
                Err(e) => {
                    let why = format!(
                        "{}: querying whether {} is ready to be copied into {} failed: {e}",
                        self.name, job.send.text, job.recv.text
                    );
                    let mut dropped = vec![job.send.keep, job.recv.keep];
                    for t in [&job.send.ticket, &job.recv.ticket] {
                        t.set(TicketState::Failed(why.as_str().into()));
                    }
                    {
                        let mut st = lock(&self.state);
                        self.abort_locked(&mut st, &why, &mut dropped);
                    }
                    drop(dropped);
                    continue;
                }
            }
            let Job { k, send, recv } = job;
            let (slot, value) = (
                slot_of(k, self.api.slots()),
                generation_of(k, self.api.slots()),
            );
            tracing::debug!(lane = %self.name, k, bytes = send.bytes, "copy lane: enqueuing a copy");
            let r = self
                .api
                .copy(&send.ready, &recv.ready, recv.ptr, send.ptr, send.bytes);
            let mut dropped = Vec::new();
            let mut release = None;
            {
                let mut st = lock(&self.state);
                match r {
                    Ok(done) => {
                        send.ticket.set_may_run(true);
                        recv.ticket.set_may_run(true);
                        match &st.aborted {
                            Some(why) => {
                                // Aborted while it was enqueued: it may run,
                                // but nobody waits for it (the abort released
                                // every slot).
                                send.ticket.set(TicketState::Failed(why.clone()));
                                recv.ticket.set(TicketState::Failed(why.clone()));
                            }
                            None => release = Some(send.text),
                        }
                        st.copies.push_back(Enqueued {
                            done,
                            tickets: [send.ticket, recv.ticket],
                            keep: [send.keep, recv.keep],
                        });
                        n += 1;
                    }
                    Err(CopyFailed { error, started }) => {
                        let why: Arc<str> =
                            format!("enqueuing the copy of {} failed: {error}", send.text).into();
                        send.ticket.set(TicketState::Failed(why.clone()));
                        recv.ticket.set(TicketState::Failed(why.clone()));
                        if started {
                            // The copy may run: nothing says when it is done,
                            // so its buffers are never freed (P6), and the
                            // recv's is never trusted again.
                            send.ticket.set_may_run(true);
                            recv.ticket.set_may_run(true);
                            std::mem::forget(send.keep);
                            std::mem::forget(recv.keep);
                        } else {
                            dropped.extend([send.keep, recv.keep]);
                        }
                        self.abort_locked(&mut st, &why, &mut dropped);
                    }
                }
            }
            // The copy is registered: now its write may release the streams.
            if let Some(text) = release
                && let Err(e) = self.api.release(slot, value)
            {
                let why = format!("enqueuing the release of {text} failed: {e}");
                let mut st = lock(&self.state);
                self.abort_locked(&mut st, &why, &mut dropped);
            }
            drop(dropped);
        }
    }

    /// Starts the lane's service on a thread of its own ([`CopyLane::serve`]).
    pub fn start(lane: &Arc<CopyLane<A>>) -> Result<(), Error>
    where
        A: 'static,
    {
        let weak = Arc::downgrade(lane);
        let t = std::thread::Builder::new()
            .name(format!("duplex {}", lane.name))
            .spawn(move || CopyLane::serve(weak))
            .map_err(|e| {
                Error::Aborted(format!("cannot start the service of {}: {e}", lane.name))
            })?;
        let _ = lane.service.set(t.thread().clone());
        Ok(())
    }

    /// The lane's service: settles and pumps whenever woken
    /// ([`CopyLane::start`] lets matches wake it), every 50 ms, and while a
    /// message is held back ([`CopyApi::may_copy`]) every [`held_poll`],
    /// until the lane is dropped. It holds the lane only while it works, so
    /// the lane is dropped (and its device side freed) by whoever drops it
    /// last, not here. The settle is here rather than on the rank's
    /// watchdog, whose checks must never wait on a device query.
    pub fn serve(lane: std::sync::Weak<CopyLane<A>>) {
        let mut poll = HELD_POLL;
        loop {
            let (moved, held) = match lane.upgrade() {
                Some(l) => {
                    let _ = l.settle();
                    let moved = l.pump();
                    (moved > 0, l.held.load(Ordering::Acquire))
                }
                None => return,
            };
            poll = held_poll(poll, held, moved);
            std::thread::park_timeout(if held {
                poll
            } else {
                std::time::Duration::from_millis(50)
            });
        }
    }

    /// Wakes the service, if it runs.
    fn wake(&self) {
        if let Some(t) = self.service.get() {
            t.unpark();
        }
    }

    /// Marks the copies seen done delivered, and drops what they kept (with
    /// the lane's lock released). While the lane is aborted, releases every
    /// slot again, every time (see the module docs). Returns an error if
    /// the device reports one; the lane is then aborted.
    pub fn settle(&self) -> Result<(), Error> {
        let mut dropped = Vec::new();
        let r = self.settle_locked(&mut dropped);
        drop(dropped);
        r
    }

    fn settle_locked(&self, dropped: &mut Vec<Keep>) -> Result<(), Error> {
        let mut st = lock(&self.state);
        if let Err(e) = self.deliver_done(&mut st, dropped) {
            let why = format!("a copy of {} failed: {e}", self.name);
            self.abort_locked(&mut st, &why, dropped);
            return Err(e);
        }
        if st.aborted.is_some() {
            // A copy's own write can land after any earlier release (its
            // done event completes just before it): write them all again.
            self.api.release_all();
        }
        Ok(())
    }

    /// Aborts the lane (see the module docs); idempotent. Says why to the
    /// other side and releases every slot before it takes the lane's lock
    /// (a settle holds it across its event queries).
    pub fn abort(&self, why: &str) {
        self.let_go(why);
        let mut dropped = Vec::new();
        {
            let mut st = lock(&self.state);
            self.abort_locked(&mut st, why, &mut dropped);
        }
        drop(dropped);
    }

    /// The first half of an abort, which takes no lock (a settle holds the
    /// lane's across its event queries): tells the other side why, then
    /// releases every slot. The rank aborts all its lanes this way before
    /// it finishes any abort ([`crate::ctx`]), so that no stream waits on a
    /// lane because another lane's lock is held.
    pub fn let_go(&self, why: &str) {
        // Copies done by now delivered their bytes before any stream goes
        // on without them: marked so first, if the lock is free (a copy
        // seen done only after the release is failed, `deliver_done`).
        if self.let_go.get().is_none()
            && let Ok(mut st) = self.state.try_lock()
        {
            let mut dropped = Vec::new();
            let _ = self.deliver_done(&mut st, &mut dropped);
            drop(st);
            drop(dropped);
        }
        self.tell(why);
        self.api.release_all();
    }

    /// Keeps the abort's reason and tells the other side, before any
    /// release of every abort: a stream let go by the release finds why,
    /// in this process ([`CopyLane::aborted`]) and another (`ipc`; a
    /// stream of the source let go first saw its op pass undelivered with
    /// no reason, on a GPU). Every abort tells, not only the first: the
    /// first may not have told yet (the other side keeps the first
    /// reason).
    fn tell(&self, why: &str) {
        let _ = self.let_go.set(why.into());
        self.api.aborted(why);
    }

    /// Marks delivered the copies whose done events completed, oldest
    /// first, and lets their buffers go. A copy seen done only after an
    /// abort let the streams go ([`CopyLane::let_go`]) is failed instead:
    /// its streams may have gone on before it ran, so what came after it
    /// there (a send of the received buffer, say) may have used the bytes
    /// from before.
    fn deliver_done(&self, st: &mut State<A>, dropped: &mut Vec<Keep>) -> Result<(), Error> {
        while let Some(c) = st.copies.front() {
            if !self.api.done(&c.done)? {
                break;
            }
            // Asked after the copy was seen done: a release by the other
            // side (which says why first) before the copy landed is then
            // seen (found by review: across processes the destination's
            // streams went on at the source's abort, and a copy done in
            // the window before this lane's own abort was delivered).
            let released = self
                .let_go
                .get()
                .cloned()
                .or_else(|| self.api.released_elsewhere());
            let outcome = match released {
                Some(why) => TicketState::Failed(why),
                None => TicketState::Delivered,
            };
            for t in &c.tickets {
                t.set(outcome.clone());
            }
            for t in &c.tickets {
                t.set_may_run(false);
            }
            if let Some(c) = st.copies.pop_front() {
                dropped.extend(c.keep);
            }
        }
        Ok(())
    }

    /// Aborts under the lock; what the unmatched ops and the jobs not
    /// enqueued kept goes to `dropped` (no copy will touch it).
    fn abort_locked(&self, st: &mut State<A>, why: &str, dropped: &mut Vec<Keep>) {
        // Copies already done delivered their bytes, aborted or not.
        let _ = self.deliver_done(st, dropped);
        let why: Arc<str> = match &st.aborted {
            Some(w) => w.clone(),
            None => why.into(),
        };
        st.aborted = Some(why.clone());
        self.tell(&why);
        for side in st.ahead.iter_mut() {
            for s in side.drain(..) {
                s.ticket.set(TicketState::Failed(why.clone()));
                dropped.push(s.keep);
            }
        }
        for j in st.jobs.drain(..) {
            for s in [j.send, j.recv] {
                s.ticket.set(TicketState::Failed(why.clone()));
                dropped.push(s.keep);
            }
        }
        for c in &st.copies {
            for t in &c.tickets {
                t.set(TicketState::Failed(why.clone()));
            }
        }
        self.api.release_all();
    }

    /// Why the lane was aborted, if it was.
    pub fn aborted(&self) -> Option<Arc<str>> {
        // The reason the tickets got; else that of an abort whose first
        // half (`let_go`) is done and whose second is not yet.
        lock(&self.state)
            .aborted
            .clone()
            .or_else(|| self.let_go.get().cloned())
    }

    /// Why the lane's streams may have been let go: its own abort
    /// ([`CopyLane::aborted`]), or the other side's, in another process,
    /// that this lane has not yet taken up ([`CopyApi::released_elsewhere`]).
    pub fn let_go_why(&self) -> Option<Arc<str>> {
        self.aborted().or_else(|| self.api.released_elsewhere())
    }

    /// Copies matched or enqueued and not seen done.
    pub fn copies_in_flight(&self) -> usize {
        let st = lock(&self.state);
        st.jobs.len() + st.copies.len()
    }
}

impl<A: CopyApi> Drop for CopyLane<A> {
    fn drop(&mut self) {
        let st = self.state.get_mut_or_lock();
        let idle = st.aborted.is_none()
            && st.copies.is_empty()
            && st.jobs.is_empty()
            && st.ahead.iter().all(|a| a.is_empty());
        if !idle {
            // A stream may still wait on the flags: release it, and never
            // free them (a source in another process learns why first).
            if st.aborted.is_none() {
                self.api
                    .aborted(&format!("{} was dropped with ops pending", self.name));
            }
            self.api.release_all();
            self.api.leak();
        }
        // A copy not seen done may still write into its buffers: they are
        // never freed (P6 of `crate::guard`).
        for c in st.copies.drain(..) {
            if matches!(self.api.done(&c.done), Ok(true)) {
                drop(c.keep);
            } else {
                std::mem::forget(c.keep);
            }
        }
    }
}

/// What a rank's ops see of a copy-engine lane, wherever its other end
/// is: a [`CopyLane`] shared by two ranks of one process, or one half of a
/// lane between two processes ([`ipc::IpcSender`] at the source,
/// a [`CopyLane`] fed by [`ipc::Feeder`] at the destination).
pub trait CopyPath: Send + Sync + std::fmt::Debug {
    /// [`CopyLane::issue`].
    #[allow(clippy::too_many_arguments)]
    fn issue(
        &self,
        dir: Dir,
        stream: &crate::cuda::Stream,
        ptr: u64,
        bytes: usize,
        dtype: DType,
        text: &str,
        keep: Keep,
    ) -> Result<Arc<Ticket>, IssueFailure>;
    /// [`CopyLane::settle`].
    fn settle(&self) -> Result<(), Error>;
    /// What the rank's watchdog does for the lane each tick, with no lock
    /// and no device call, which could keep the watchdog from its checks:
    /// once aborted, a lane releases every slot again (a copy enqueued
    /// before the abort may write its own smaller value later). A lane's
    /// service settles its copies ([`CopyLane::serve`]).
    fn watch(&self);
    /// [`CopyLane::let_go`].
    fn let_go(&self, why: &str);
    /// [`CopyLane::abort`].
    fn abort(&self, why: &str);
    /// [`CopyLane::aborted`].
    fn aborted(&self) -> Option<Arc<str>>;
    /// Why its streams may have been let go ([`CopyLane::let_go_why`]);
    /// by default, why it was aborted.
    fn let_go_why(&self) -> Option<Arc<str>> {
        self.aborted()
    }
}

impl<A: CopyApi<Stream = crate::cuda::Stream> + 'static> CopyPath for CopyLane<A> {
    fn issue(
        &self,
        dir: Dir,
        stream: &crate::cuda::Stream,
        ptr: u64,
        bytes: usize,
        dtype: DType,
        text: &str,
        keep: Keep,
    ) -> Result<Arc<Ticket>, IssueFailure> {
        CopyLane::issue(self, dir, stream, ptr, bytes, dtype, text, keep)
    }
    fn settle(&self) -> Result<(), Error> {
        CopyLane::settle(self)
    }
    fn watch(&self) {
        if self.let_go.get().is_some() {
            self.api.release_all();
        }
    }
    fn let_go(&self, why: &str) {
        CopyLane::let_go(self, why)
    }
    fn abort(&self, why: &str) {
        CopyLane::abort(self, why)
    }
    fn aborted(&self) -> Option<Arc<str>> {
        CopyLane::aborted(self)
    }

    fn let_go_why(&self) -> Option<Arc<str>> {
        CopyLane::let_go_why(self)
    }
}

/// Why [`CopyLane::issue`] failed, and whether the op is on its stream all
/// the same.
#[derive(Debug)]
pub struct IssueFailure {
    /// What went wrong.
    pub error: Error,
    /// The op's ticket (failed) when its wait was enqueued on its stream:
    /// it is launched and must be tracked until its stream passes it.
    pub ticket: Option<Arc<Ticket>>,
}

impl std::fmt::Display for IssueFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for IssueFailure {}

impl From<IssueFailure> for Error {
    fn from(f: IssueFailure) -> Error {
        f.error
    }
}

/// Why [`CopyApi::copy`] failed.
#[derive(Debug)]
pub struct CopyFailed {
    /// What went wrong.
    pub error: Error,
    /// Whether the copy may have been enqueued before the failure (its
    /// buffers may then be written at any time).
    pub started: bool,
}

impl From<Error> for CopyFailed {
    /// A failure before anything was enqueued.
    fn from(error: Error) -> CopyFailed {
        CopyFailed {
            error,
            started: false,
        }
    }
}

pub use cuda::Cuda;

mod cuda {
    use std::ffi::c_void;

    use cudarc::driver::sys;
    use duplex::Error;

    use super::{CopyApi, CopyFailed, SLOTS};
    use crate::cuda::{Device, Event, Stream, check, copy_peer};

    /// [`CopyApi::copy`] on `stream` (of the current context), whatever
    /// moves the bytes: wait for both ready events, `copy` (not called for
    /// no bytes), record the done event. What can fail without enqueuing
    /// comes first; a failure once the copy is enqueued says it started.
    pub(crate) fn enqueue_copy(
        stream: &Stream,
        send: &Event,
        recv: &Event,
        bytes: usize,
        copy: impl FnOnce() -> Result<(), Error>,
    ) -> Result<Event, CopyFailed> {
        let done = Event::new(false)?;
        stream.wait(send)?;
        stream.wait(recv)?;
        if bytes > 0 {
            copy()?;
        }
        done.record(stream).map_err(|error| CopyFailed {
            error,
            started: true,
        })?;
        Ok(done)
    }

    /// Pinned host memory mapped into every device: the lane's flag slots.
    #[derive(Debug)]
    struct Flags {
        host: *mut u32,
        /// Never freed (`CopyApi::leak`).
        leak: std::sync::atomic::AtomicBool,
    }

    // SAFETY: the memory is plain pinned host memory, written with volatile
    // stores and read by the devices.
    unsafe impl Send for Flags {}
    // SAFETY: as above.
    unsafe impl Sync for Flags {}

    impl Flags {
        fn new() -> Result<Flags, Error> {
            let mut p: *mut c_void = std::ptr::null_mut();
            // SAFETY: allocates SLOTS u32s of pinned memory, mapped into the
            // address space of every context (portable, device-mapped; with
            // unified addressing the device address is the host address).
            check("cuMemHostAlloc", unsafe {
                sys::cuMemHostAlloc(
                    &mut p,
                    SLOTS * 4,
                    sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
                )
            })?;
            let flags = Flags {
                host: p as *mut u32,
                leak: std::sync::atomic::AtomicBool::new(false),
            };
            for i in 0..SLOTS {
                // SAFETY: `i` is within the allocation.
                unsafe { flags.host.add(i).write_volatile(0) };
            }
            Ok(flags)
        }

        fn device(&self, slot: usize) -> sys::CUdeviceptr {
            // SAFETY: within the allocation.
            unsafe { self.host.add(slot) as sys::CUdeviceptr }
        }
    }

    impl Drop for Flags {
        fn drop(&mut self) {
            if self.leak.load(std::sync::atomic::Ordering::Acquire) {
                return;
            }
            // SAFETY: allocated by cuMemHostAlloc, freed once, by a lane
            // that was never aborted and has nothing in flight
            // (`CopyLane`'s drop), so no stream waits on it.
            let _ = unsafe { sys::cuMemFreeHost(self.host as *mut c_void) };
        }
    }

    /// The CUDA side of a lane from device `src` to device `dst` (the same
    /// device in a test): flags, and a copy stream on `src` (copies are
    /// pushed by the source GPU's copy engines).
    #[derive(Debug)]
    pub struct Cuda {
        flags: Flags,
        src: std::sync::Arc<Device>,
        dst: std::sync::Arc<Device>,
        stream: Stream,
    }

    impl Cuda {
        /// The device side of a lane from `src` to `dst`. Enables peer
        /// access between the two when they differ.
        pub fn new(
            src: std::sync::Arc<Device>,
            dst: std::sync::Arc<Device>,
        ) -> Result<Cuda, Error> {
            if src.ordinal() != dst.ordinal() {
                src.enable_peer(&dst)?;
                dst.enable_peer(&src)?;
            }
            // The flag-wait kernel of both contexts, before any op waits.
            dst.bind()?;
            crate::cuda::wait_kernel()?;
            src.bind()?;
            crate::cuda::wait_kernel()?;
            let flags = Flags::new()?;
            let stream = Stream::new()?;
            Ok(Cuda {
                flags,
                src,
                dst,
                stream,
            })
        }

        /// The copy stream.
        pub fn stream(&self) -> &Stream {
            &self.stream
        }
    }

    impl Drop for Cuda {
        fn drop(&mut self) {
            if !self.flags.leak.load(std::sync::atomic::Ordering::Acquire) {
                // An idle lane: its last copy's flag write may still be
                // landing; let it before the flags are freed.
                if let Ok(_bound) = self.src.bind_scoped() {
                    let _ = self.stream.synchronize();
                }
            }
        }
    }

    impl CopyApi for Cuda {
        type Stream = Stream;
        type Ready = Event;
        type Done = Event;

        fn ready(&self, stream: &Stream) -> Result<Event, Error> {
            let e = Event::new(false)?;
            e.record(stream)?;
            Ok(e)
        }

        fn wait(&self, stream: &Stream, slot: usize, value: u32) -> Result<(), Error> {
            // A kernel, not a stream-wait (`crate::cuda::wait_flag` says
            // why); the flags are mapped pinned memory that lives as long
            // as the lane, or for good.
            crate::cuda::wait_flag(stream, self.flags.device(slot), value)
        }

        fn copy(
            &self,
            send: &Event,
            recv: &Event,
            dst: u64,
            src: u64,
            bytes: usize,
        ) -> Result<Event, CopyFailed> {
            let _bound = self.src.bind_scoped()?;
            enqueue_copy(&self.stream, send, recv, bytes, || {
                // SAFETY: both buffers hold `bytes` bytes and are kept alive
                // until the done event completes (the lane's `keep`).
                unsafe { copy_peer(&self.dst, dst, &self.src, src, bytes, &self.stream) }
            })
        }

        fn release(&self, slot: usize, value: u32) -> Result<(), Error> {
            let _bound = self.src.bind_scoped()?;
            // SAFETY: as in `wait`.
            check("cuStreamWriteValue32", unsafe {
                sys::cuStreamWriteValue32_v2(
                    self.stream.raw() as sys::CUstream,
                    self.flags.device(slot),
                    value,
                    sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
                )
            })
        }

        fn done(&self, done: &Event) -> Result<bool, Error> {
            done.done()
        }

        fn leak(&self) {
            self.flags
                .leak
                .store(true, std::sync::atomic::Ordering::Release);
        }

        fn release_all(&self) {
            for i in 0..SLOTS {
                // SAFETY: within the allocation.
                unsafe { self.flags.host.add(i).write_volatile(super::RELEASED) };
            }
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        }
    }
}

pub mod ipc;

#[cfg(any(test, loom))]
pub mod fake;

#[cfg(all(test, not(loom)))]
mod tests;
