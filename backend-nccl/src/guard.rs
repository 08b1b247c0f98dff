//! Who may call NCCL on a communicator, and when a communicator may be
//! aborted and freed: the backend's concurrency protocol, as types.
//!
//! NCCL's rules (R11 of `docs/semantics.md`): no two threads may issue
//! operations to one communicator in parallel, nor to independent
//! communicators of one device; one thread issues all the operations of a
//! group. And `ncclCommAbort` both stops a communicator's work and frees
//! it, so a handle that another thread is about to pass to NCCL must not
//! be aborted under it.
//!
//! # The protocol
//!
//! - **P1, one caller per rank.** Every call that builds or launches work
//!   (`ncclGroupStart`/`End`, `ncclSend`/`Recv`, `ncclCommSplit`) is made
//!   by the thread that holds the rank's [`IssueLock`] (an [`Issuing`]).
//!   All communicators of a rank live on its device, so this covers both
//!   of NCCL's rules, with one exception. A call on a non-blocking
//!   communicator that NCCL finishes in the background holds the lock
//!   for the call only when its wait is for another rank's code: a split
//!   of the parent of user communicators, and a group that opens a side
//!   (its connection handshake, R7; [`Handshakes`]), whose
//!   communicators, copy-engine lanes and streams are marked first, so
//!   that no other thread of the rank calls NCCL on them, nor launches on
//!   those streams, until it is over (NCCL's rule for a non-blocking
//!   communicator; an event recorded or a sync made on such a stream
//!   meanwhile is not held back, and the order counts it as covering what
//!   the stream had before the launch, `duplex::order::Order::commit_pending`;
//!   loom scenarios `handshake_beside_launches`, `handshake_holds_its_stream`). The rule against parallel calls on independent
//!   communicators of one device is not kept during that wait: NCCL's
//!   group state is per thread, and its background job works on the
//!   marked communicators only (`docs/semantics.md`, D1 and R11).
//!   The wait holds the communicator (P3), not the lock, and lets the
//!   communicator go before it takes the lock again (the lock order
//!   below). A group of a non-blocking communicator whose sides are all
//!   connected waits for its end under the lock. The lane service of lazy
//!   lanes ([`crate::lanes`]) never waits for the lock: its calls (a
//!   communicator's setup, its connecting group) are queued, and run by
//!   whoever holds the lock next, including a thread that holds it while
//!   it waits for another rank. Two calls are made without it: the state
//!   query `ncclCommGetAsyncError` (it reads the communicator's state, as
//!   PyTorch's watchdog does from its own thread; one thread at a time per
//!   communicator, and, on a non-blocking one, never while a group on it
//!   is built or ended, since it also reaps the group's background job; a
//!   query is not counted inside NCCL, so `force_free` waits for it:
//!   [`Use::async_error`],
//!   [`Use::try_async_error`]), and the abort path (P4, P5), which exists to interrupt the
//!   caller.
//! - **P2, a group is one thread's.** A group is built inside
//!   [`Issuing::group`]: start, the ops, end, on the thread that holds the
//!   lock ([`Issuing`] and [`Use`] cannot move to another thread). The end
//!   is called even when an op fails, so NCCL's per-thread group state
//!   never stays open.
//! - **P3, the handle only inside a hold.** A communicator's raw handle is
//!   reachable only through a [`Use`], a counted hold on its [`CommCell`],
//!   and only for the duration of one call ([`Use::call`]). A group holds
//!   a `Use` of each of its communicators from before its first op until
//!   `ncclGroupEnd` has returned, since that call launches the queued ops
//!   and reads every communicator they name.
//! - **P4, abort marks; the last holder frees.** [`CommCell::abort`] marks
//!   the communicator aborted. From then on no new call is made through it:
//!   [`Use::call`] fails with [`Error::Aborted`] without calling NCCL;
//!   only the closing `ncclGroupEnd` of a group already open still runs
//!   (P2). If nobody holds the communicator, abort frees it at once
//!   (`ncclCommAbort`). Otherwise abort asks the library to stop the calls
//!   in flight without freeing anything ([`CommApi::revoke`]), and the
//!   last holder to leave frees it. Abort never waits for anybody, is
//!   idempotent, and the free happens exactly once.
//! - **P5, a call blocked inside NCCL.** A thread blocked inside a call on
//!   a blocking communicator (an `ncclGroupEnd` waiting for a peer, say)
//!   holds it, so P4 alone would not free it until the call returns; and
//!   on a library without `ncclCommRevoke` (NCCL 2.28 and older) the only
//!   thing that interrupts the call is `ncclCommAbort` itself, the way
//!   NCCL documents for unblocking a blocked call from another thread.
//!   [`CommCell::force_free`] does that for an aborted communicator whose
//!   every holder is counted inside an NCCL call, so no holder can be
//!   about to start a new call with the handle (P4 refuses those). It is
//!   `unsafe`: its caller, the rank's watchdog, must know that the
//!   holders really are blocked inside NCCL, which it judges by time (the
//!   rank's NCCL call has lasted longer than the deadline, plus a grace
//!   after the abort). What is left is NCCL's: the interrupted call's own
//!   reads of the freed communicator.
//! - **P6, buffers outlive their ops.** Each launched op holds its buffer;
//!   the rank's [`Ledger`] drops an op only once the op, or a later op of
//!   its stream, says it completed ([`Done`]: the completion fence it
//!   attached to after its launch, a CUDA event shared by the launches of
//!   its stream until it is recorded, [`crate::fence`]; the fences of one
//!   stream are recorded, so complete, in the order of their positions,
//!   on a stream serial unique in the process), and never drops one that
//!   has not: at the end of a run, or when the ledger is dropped, ops that
//!   never completed are leaked with their buffers rather than freed under
//!   a kernel.
//! - **P7, snapshots see whole launches.** The ops of one launch enter the
//!   ledger under one lock ([`Ledger::record`]), after the launch, so a
//!   snapshot ([`Ledger::pending`], what a hang report lists) holds all
//!   of a group or none of it. Aborting the communicators of a snapshot
//!   while another thread is halfway through a group is P4: that thread's
//!   next op fails, its group still ends, and the free waits for it.
//! - **P8, a rank's communicators are aborted together.** Freeing a
//!   communicator synchronizes the device (`cudaFree`, `cuMemFreeHost`),
//!   which waits for every kernel of the device, those of the rank's other
//!   communicators too; a kernel waiting for a peer that died ends only
//!   once its own communicator's abort flag is raised. Aborted one at a
//!   time, the first free waits for the kernel of a communicator not yet
//!   aborted, for ever (NVIDIA/nccl#564; seen on the H200s with a killed
//!   peer). [`abort_all`] therefore marks every communicator of the rank
//!   and makes them one batch, freed in one [`CommApi::abort_many`] (which
//!   raises every abort flag before it frees anything) when the batch's
//!   last member is released: at once when nobody holds any; else by the
//!   last holder to leave, or by the watchdog's forced free (P5). Nothing
//!   is freed while a member is held, since NCCL 2.28 cannot stop a held
//!   communicator's kernel without freeing it, and the free of the others
//!   would wait for that kernel on the very thread (the watchdog) that
//!   must then force the held one free. A group's holds released one by
//!   one release their members of the batch; the last frees them all.
//!
//! Lock order: the issue lock, then a communicator's state lock. A state
//! lock is held only for a few counter updates, never across an NCCL call;
//! the ledger's lock is never held across one either.
//!
//! NCCL itself is behind [`CommApi`], implemented by [`crate::nccl::Nccl`]
//! and, for tests on machines without GPUs, by `fake::FakeNccl`; the
//! synchronization primitives come from [`crate::sync`], so the loom tests
//! (`tests/loom.rs`) check this very code.

use std::fmt;
use std::marker::PhantomData;
use std::time::{Duration, Instant};

use duplex::{Dir, Error, Rank};

use crate::sync::{Arc, AtomicU64, AtomicUsize, Mutex, MutexGuard, Ordering, lock};

#[cfg(any(test, loom))]
pub mod fake;
#[cfg(any(test, loom))]
pub mod scenarios;

/// A part of a launch that [`Handshakes`] marks: a communicator or a
/// copy-engine lane, by logical number ([`part_comm`]), or a stream, by
/// the backend's number ([`part_stream`]).
pub type Part = u64;

/// The [`Part`] of the communicator or copy-engine lane `logical`.
pub fn part_comm(logical: u32) -> Part {
    Part::from(logical)
}

/// The [`Part`] of stream `id` (the backend's number).
pub fn part_stream(id: u32) -> Part {
    (1 << 32) | Part::from(id)
}

/// The parts (communicators, copy-engine lanes and streams) of the
/// launches that wait in their connection handshake, each with its
/// thread, and the sides (R7) the rank's non-blocking communicators have
/// connected.
///
/// A launch on a non-blocking communicator that opens a side not yet
/// connected marks its parts under the issue lock before it lets the lock
/// go to wait (`crate::rank`), and keeps them marked until it is
/// over; another thread's launch on one of them waits, without the lock,
/// until none is marked (R11: a call on a communicator waits while another
/// thread is inside a call on it). Its streams are parts too: NCCL's
/// background job puts the group's kernels on them only when it finishes
/// (nothing else may go on them before, NCCL's rule for non-blocking
/// communicators), so the order of each stream stays the order of the
/// launches. The launch's copy ops still reach their lanes in the order
/// the registry numbered them. A launch whose sides are all connected
/// waits for its group's end under the lock, as every launch did before
/// (`connected`): NCCL ends every group of a non-blocking communicator in
/// the background (from 2.23), handshake or not.
#[derive(Debug, Default)]
pub struct Handshakes {
    /// How many parts are marked: read without the lock, since marks are
    /// made and checked under the issue lock, so that a launch pays
    /// nothing while none is.
    marked: AtomicUsize,
    parts: Mutex<Vec<(usize, Part)>>,
    /// Launches that failed in their handshake and are making their
    /// report ([`Handshakes::hold_cuts`]).
    failing: AtomicUsize,
    /// (communicator, peer, direction): the sides of this rank that a
    /// launch on a non-blocking communicator has connected (R7).
    connected: Mutex<rustc_hash::FxHashSet<(u32, Rank, Dir)>>,
}

impl Handshakes {
    /// Whether a thread other than `me` has a launch on one of `parts` in
    /// its handshake.
    pub fn holds(&self, parts: &[Part], me: usize) -> bool {
        self.marked()
            && lock(&self.parts)
                .iter()
                .any(|(t, p)| *t != me && parts.contains(p))
    }

    /// Whether any launch is in its handshake (read without a lock: a
    /// launch pays nothing more while none is).
    pub fn marked(&self) -> bool {
        self.marked.load(Ordering::Acquire) != 0
    }

    /// Whether any launch is in its handshake, or making the report of a
    /// handshake that failed: its ops are in the registry, not in the
    /// ledger, so the trace must not be cut.
    pub fn any(&self) -> bool {
        self.marked() || self.failing.load(Ordering::Acquire) != 0
    }

    /// Keeps [`Handshakes::any`] true until the guard drops: for a launch
    /// that failed in its handshake, from before it lets its marks go
    /// until its report is made.
    pub fn hold_cuts(&self) -> CutHold<'_> {
        self.failing.fetch_add(1, Ordering::AcqRel);
        CutHold(self)
    }

    /// Marks thread `me`'s launch on `parts` until the mark drops.
    pub fn mark(&self, me: usize, parts: &[Part]) -> HandshakeMark<'_> {
        let mut v = lock(&self.parts);
        v.extend(parts.iter().map(|p| (me, *p)));
        self.marked.store(v.len(), Ordering::Release);
        HandshakeMark { of: self, me }
    }

    /// Whether every side of `sides` (communicator, peer, direction) is
    /// connected.
    pub fn all_connected(&self, sides: impl IntoIterator<Item = (u32, Rank, Dir)>) -> bool {
        let c = lock(&self.connected);
        sides.into_iter().all(|s| c.contains(&s))
    }

    /// `sides` are connected: a group that opened them has ended.
    pub fn connect(&self, sides: impl IntoIterator<Item = (u32, Rank, Dir)>) {
        lock(&self.connected).extend(sides);
    }

    /// A group that exchanged with `peer` on communicator `logical` has
    /// ended: both of this rank's sides toward it are connected, or only
    /// the `only` one.
    pub fn connect_with(&self, logical: u32, peer: Rank, only: Option<Dir>) {
        self.connect(
            [Dir::Send, Dir::Recv]
                .into_iter()
                .filter(|d| only.is_none_or(|o| o == *d))
                .map(|d| (logical, peer, d)),
        );
    }
}

/// [`Handshakes::hold_cuts`]'s guard.
#[derive(Debug)]
pub struct CutHold<'a>(&'a Handshakes);

impl Drop for CutHold<'_> {
    fn drop(&mut self) {
        self.0.failing.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A launch's parts marked in [`Handshakes`], until dropped.
#[derive(Debug)]
pub struct HandshakeMark<'a> {
    of: &'a Handshakes,
    me: usize,
}

impl Drop for HandshakeMark<'_> {
    fn drop(&mut self) {
        let mut v = lock(&self.of.parts);
        v.retain(|(t, _)| *t != self.me);
        self.of.marked.store(v.len(), Ordering::Release);
    }
}

/// What the error of a call on an aborted communicator says
/// ([`CommCell::aborted_error`]), so that callers can tell it apart.
pub const ABORTED: &str = "was aborted after a hang or an error";

/// The NCCL calls the protocol makes, so that it runs without GPUs.
pub trait CommApi: Send + Sync {
    /// A communicator's raw handle.
    type Comm: Copy + Send + Sync + fmt::Debug;
    /// A CUDA stream's raw handle.
    type Stream: Copy;

    /// `ncclGroupStart`.
    fn group_start(&self) -> Result<(), Error>;

    /// `ncclGroupEnd`: `Ok(true)` when launched, `Ok(false)` while in
    /// progress on non-blocking communicators.
    fn group_end(&self) -> Result<bool, Error>;

    /// `ncclSend`: `Ok(false)` while in progress on a non-blocking
    /// communicator.
    ///
    /// # Safety
    /// `comm` must be live; `buf` must hold `count` elements of `dtype` on
    /// the communicator's device until the op completes; `stream` must be
    /// live.
    unsafe fn send(
        &self,
        comm: Self::Comm,
        buf: u64,
        count: usize,
        dtype: i32,
        peer: i32,
        stream: Self::Stream,
    ) -> Result<bool, Error>;

    /// `ncclRecv`, as [`CommApi::send`].
    ///
    /// # Safety
    /// As [`CommApi::send`], and the buffer must be writable.
    unsafe fn recv(
        &self,
        comm: Self::Comm,
        buf: u64,
        count: usize,
        dtype: i32,
        peer: i32,
        stream: Self::Stream,
    ) -> Result<bool, Error>;

    /// `ncclCommGetAsyncError`: `Ok(true)` when ready, `Ok(false)` while an
    /// operation is in progress, `Err` when the communicator failed.
    ///
    /// # Safety
    /// `comm` must be live.
    unsafe fn async_error(&self, comm: Self::Comm) -> Result<bool, Error>;

    /// Stops the communicator's work in flight, and interrupts host calls
    /// blocked in it, without freeing it: `Ok(false)` when the library
    /// cannot (then only [`CommApi::abort`] interrupts).
    ///
    /// # Safety
    /// `comm` must be live; other threads may be inside calls on it.
    unsafe fn revoke(&self, comm: Self::Comm) -> Result<bool, Error> {
        let _ = comm;
        Ok(false)
    }

    /// `ncclCommAbort`: stops the communicator's work and frees it.
    ///
    /// # Safety
    /// `comm` must be live, and is never used again.
    unsafe fn abort(&self, comm: Self::Comm) -> Result<(), Error>;

    /// Aborts several communicators of the rank as one (P8): every one's
    /// work is told to stop before any is freed. NCCL: `ncclCommAbort` of
    /// each inside one `ncclGroupStart`/`ncclGroupEnd`, which raises each
    /// abort flag at once and frees them all at the group's end.
    ///
    /// # Safety
    /// As [`CommApi::abort`], for each.
    unsafe fn abort_many(&self, comms: &[Self::Comm]) -> Result<(), Error>;
}

impl<A: CommApi + ?Sized> CommApi for &A {
    type Comm = A::Comm;
    type Stream = A::Stream;

    fn group_start(&self) -> Result<(), Error> {
        (**self).group_start()
    }

    fn group_end(&self) -> Result<bool, Error> {
        (**self).group_end()
    }

    unsafe fn send(
        &self,
        comm: Self::Comm,
        buf: u64,
        count: usize,
        dtype: i32,
        peer: i32,
        stream: Self::Stream,
    ) -> Result<bool, Error> {
        // SAFETY: the caller's contract is the same.
        unsafe { (**self).send(comm, buf, count, dtype, peer, stream) }
    }

    unsafe fn recv(
        &self,
        comm: Self::Comm,
        buf: u64,
        count: usize,
        dtype: i32,
        peer: i32,
        stream: Self::Stream,
    ) -> Result<bool, Error> {
        // SAFETY: the caller's contract is the same.
        unsafe { (**self).recv(comm, buf, count, dtype, peer, stream) }
    }

    unsafe fn async_error(&self, comm: Self::Comm) -> Result<bool, Error> {
        // SAFETY: the caller's contract is the same.
        unsafe { (**self).async_error(comm) }
    }

    unsafe fn revoke(&self, comm: Self::Comm) -> Result<bool, Error> {
        // SAFETY: the caller's contract is the same.
        unsafe { (**self).revoke(comm) }
    }

    unsafe fn abort(&self, comm: Self::Comm) -> Result<(), Error> {
        // SAFETY: the caller's contract is the same.
        unsafe { (**self).abort(comm) }
    }

    unsafe fn abort_many(&self, comms: &[Self::Comm]) -> Result<(), Error> {
        // SAFETY: the caller's contract is the same.
        unsafe { (**self).abort_many(comms) }
    }
}

/// Where a communicator is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Usable.
    Live,
    /// Aborted: no new call; freed when the last holder leaves (P4).
    Aborted,
    /// Freed: no thread will use it again, and it was given to
    /// `ncclCommAbort` once, alone or with the rest of its batch (P8; a
    /// batch is freed when its last member is).
    Freed,
}

struct CellState<A: CommApi> {
    phase: Phase,
    /// Live [`Use`]s, and an abort that is revoking (P4).
    holders: usize,
    /// Holders inside an NCCL call on it (P5).
    inside: usize,
    /// The batch it was aborted with ([`abort_all`]): freed with it.
    batch: Option<Arc<Batch<A>>>,
}

impl<A: CommApi> fmt::Debug for CellState<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CellState")
            .field("phase", &self.phase)
            .field("holders", &self.holders)
            .field("inside", &self.inside)
            .field("batch", &self.batch.is_some())
            .finish()
    }
}

/// Communicators aborted together (P8): freed in one
/// [`CommApi::abort_many`] once none of them can be used any more, so
/// that every abort flag is raised before anything is freed, whichever
/// member is the last to be released.
struct Batch<A: CommApi> {
    api: A,
    state: Mutex<BatchState<A>>,
}

struct BatchState<A: CommApi> {
    /// The members' handles.
    raws: Vec<A::Comm>,
    /// Members not yet released (phase `Freed`).
    waiting: usize,
}

impl<A: CommApi> fmt::Debug for Batch<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = lock(&self.state);
        f.debug_struct("Batch")
            .field("members", &st.raws.len())
            .field("waiting", &st.waiting)
            .finish()
    }
}

impl<A: CommApi> Batch<A> {
    /// A member was released; the last one frees them all.
    fn release(&self) {
        let raws = {
            let mut st = lock(&self.state);
            st.waiting -= 1;
            if st.waiting > 0 {
                return;
            }
            std::mem::take(&mut st.raws)
        };
        // SAFETY: every member moved to `Freed` once, under its state lock,
        // with no holder outside NCCL (P4, P5); no new hold or call can
        // start on any of them.
        if let Err(e) = unsafe { self.api.abort_many(&raws) } {
            tracing::warn!(error = %e, "aborting the communicators failed");
        }
    }
}

/// A communicator handle that is freed only when no thread can use it
/// (P3–P5).
pub struct CommCell<A: CommApi> {
    api: A,
    raw: A::Comm,
    name: String,
    state: Mutex<CellState<A>>,
    /// Serializes the state queries ([`Use::async_error`]) with each other
    /// and with the building and end of a group on the communicator
    /// ([`Issuing::group`]): NCCL's `ncclCommGetAsyncError` joins and
    /// unlinks the communicator's background group job without atomics
    /// (NCCL 2.26 and later, `init.cc`), so two threads querying one
    /// communicator at once could free the job twice, and a query during
    /// `ncclGroupEnd` could reap a job being linked.
    query: Mutex<()>,
    /// Blocking ([`CommCell::blocking`]): its groups end in the calling
    /// thread, with no background job for a query to reap, so
    /// [`Issuing::group`] leaves its query lock alone.
    blocking: bool,
}

impl<A: CommApi> fmt::Debug for CommCell<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CommCell")
            .field("name", &self.name)
            .field("raw", &self.raw)
            .field("state", &*lock(&self.state))
            .finish()
    }
}

impl<A: CommApi> CommCell<A> {
    /// Takes ownership of `raw`, a live communicator of `api`, named `name`
    /// in errors.
    ///
    /// # Safety
    /// `raw` must be live, and nothing else may free it.
    pub unsafe fn new(api: A, raw: A::Comm, name: &str) -> CommCell<A> {
        CommCell {
            api,
            raw,
            name: name.to_string(),
            state: Mutex::new(CellState {
                phase: Phase::Live,
                holders: 0,
                inside: 0,
                batch: None,
            }),
            query: Mutex::new(()),
            blocking: false,
        }
    }

    /// Marks it blocking or not (NCCL's `blocking` config; not, unless
    /// said): a blocking one's group ends run in the calling thread, so
    /// state queries need not wait for them.
    pub fn blocking(mut self, blocking: bool) -> Self {
        self.blocking = blocking;
        self
    }

    /// The library.
    pub fn api(&self) -> &A {
        &self.api
    }

    /// Where it is in its life.
    pub fn phase(&self) -> Phase {
        lock(&self.state).phase
    }

    /// True once aborted.
    pub fn is_aborted(&self) -> bool {
        self.phase() != Phase::Live
    }

    /// The error of a call on an aborted communicator.
    pub fn aborted_error(&self) -> Error {
        Error::Aborted(format!(
            "communicator {} {ABORTED}; create a new transport to get new lanes",
            self.name
        ))
    }

    /// A hold on the communicator, unless it was aborted.
    pub fn enter(&self) -> Result<Use<'_, A>, Error> {
        let mut st = lock(&self.state);
        if st.phase != Phase::Live {
            return Err(self.aborted_error());
        }
        st.holders += 1;
        Ok(Use {
            cell: self,
            _not_send: PhantomData,
        })
    }

    /// Aborts the communicator (P4): no new call from now on; freed now if
    /// nobody holds it, else by the last holder, after asking the library
    /// to stop the calls in flight. Never waits. True when this call did
    /// it (the communicator was live).
    pub fn abort(&self) -> bool
    where
        A: Clone,
    {
        !abort_all(&[self]).is_empty()
    }

    /// Frees an aborted communicator whose every holder is inside an NCCL
    /// call (P5); false when it is not aborted, already freed, or a holder
    /// is outside NCCL (it will leave on its own: its next call fails).
    ///
    /// # Safety
    /// Every holder counted inside must be blocked inside NCCL, not about
    /// to enter it: only a call that has lasted far longer than any call
    /// that does not wait can be trusted to be. `ncclCommAbort` then
    /// interrupts the blocked call, which reads the freed communicator
    /// once more on its way out (NCCL's documented way to unblock it).
    pub unsafe fn force_free(&self) -> bool {
        let mut st = lock(&self.state);
        if st.phase != Phase::Aborted || st.holders != st.inside {
            return false;
        }
        st.phase = Phase::Freed;
        let batch = st.batch.take();
        drop(st);
        self.free(batch);
        true
    }

    fn leave(&self) {
        let mut st = lock(&self.state);
        st.holders -= 1;
        if st.holders == 0 && st.phase == Phase::Aborted {
            st.phase = Phase::Freed;
            let batch = st.batch.take();
            drop(st);
            self.free(batch);
        }
    }

    /// The one release: called by whoever moved the phase to `Freed`. A
    /// member of a batch is freed with the batch, by its last member to be
    /// released; any other communicator alone, now.
    fn free(&self, batch: Option<Arc<Batch<A>>>) {
        if let Some(b) = batch {
            b.release();
            return;
        }
        // SAFETY: the phase moved to `Freed` once, under the state lock,
        // with no holder outside NCCL (P4, P5); no new hold or call can
        // start, so the handle is never used again by duplex.
        if let Err(e) = unsafe { self.api.abort(self.raw) } {
            tracing::warn!(comm = %self.name, error = %e, "abort failed");
        }
    }
}

/// A cell of [`abort_all`], its index in the caller's list, and its state,
/// locked.
type Locked<'a, A> = (usize, &'a CommCell<A>, MutexGuard<'a, CellState<A>>);

/// Aborts every communicator of `cells` as one (P4 for each, P8). Each is
/// marked aborted, so no new call is made through it, and all of them form
/// one batch, freed in one [`CommApi::abort_many`] when its last member is
/// released: at once when nobody holds any of them; else when the last
/// holder leaves, or by the watchdog's [`CommCell::force_free`] (P5). The
/// library is asked to stop the held ones' work now
/// ([`CommApi::revoke`]). Freeing the unheld ones first would wait for a
/// kernel of a held one whose abort flag nothing raised (NCCL 2.28 has no
/// revoke), and the thread that would raise it (the watchdog) would be the
/// one waiting. Never waits for a holder. Returns the indices in `cells`
/// of those this call aborted (those that were live; a cell named twice
/// counts once). All cells must be of one library (one rank's).
pub fn abort_all<A: CommApi + Clone>(cells: &[&CommCell<A>]) -> Vec<usize> {
    // Each cell once, locked in address order (two callers never wait on
    // each other's locks), all locks held while the batch is formed, so
    // that no holder leaves and frees its cell alone in between.
    let mut order: Vec<(usize, &CommCell<A>)> = cells.iter().copied().enumerate().collect();
    order.sort_by_key(|(i, c)| (std::ptr::from_ref(*c) as usize, *i));
    order.dedup_by_key(|(_, c)| std::ptr::from_ref(*c) as usize);
    let mut locked: Vec<Locked<'_, A>> = order
        .into_iter()
        .map(|(i, c)| (i, c, lock(&c.state)))
        .filter(|(_, _, st)| st.phase == Phase::Live)
        .collect();
    let Some(api) = locked.first().map(|(_, c, _)| c.api.clone()) else {
        return Vec::new();
    };
    let batch = Arc::new(Batch {
        api,
        state: Mutex::new(BatchState {
            raws: locked.iter().map(|(_, c, _)| c.raw).collect(),
            waiting: locked.len(),
        }),
    });
    let mut aborted = Vec::new();
    let mut held = Vec::new();
    let mut released = 0;
    for (i, c, st) in &mut locked {
        aborted.push(*i);
        st.phase = Phase::Aborted;
        if st.holders > 0 {
            // Held while revoking, so that it is not freed under the call.
            st.holders += 1;
            st.batch = Some(batch.clone());
            held.push(*c);
        } else {
            st.phase = Phase::Freed;
            released += 1;
        }
    }
    drop(locked);
    for _ in 0..released {
        batch.release();
    }
    for c in &held {
        // SAFETY: held, so not freed; other threads may be inside calls on
        // it, which revoke allows.
        if let Err(e) = unsafe { c.api.revoke(c.raw) } {
            tracing::warn!(comm = %c.name, error = %e, "revoke failed");
        }
    }
    for c in &held {
        c.leave();
    }
    aborted.sort_unstable();
    aborted
}

impl<A: CommApi> Drop for CommCell<A> {
    fn drop(&mut self) {
        // No `Use` borrows it any more: free it unless that happened.
        let st = self.state.get_mut_or_lock();
        if st.phase != Phase::Freed {
            st.phase = Phase::Freed;
            let batch = st.batch.take();
            self.free(batch);
        }
    }
}

/// `get_mut` that ignores poisoning, for both `std` and loom mutexes.
pub(crate) trait GetMut<T> {
    fn get_mut_or_lock(&mut self) -> &mut T;
}

impl<T> GetMut<T> for Mutex<T> {
    fn get_mut_or_lock(&mut self) -> &mut T {
        self.get_mut().unwrap_or_else(|e| e.into_inner())
    }
}

/// A hold on a communicator (P3): while it lives, the communicator is not
/// freed except by [`CommCell::force_free`]. Not `Send`: a hold belongs to
/// the thread that calls NCCL with it.
pub struct Use<'a, A: CommApi> {
    cell: &'a CommCell<A>,
    _not_send: PhantomData<*const ()>,
}

impl<A: CommApi> fmt::Debug for Use<'_, A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Use")
            .field("comm", &self.cell.name)
            .finish()
    }
}

impl<A: CommApi> Drop for Use<'_, A> {
    fn drop(&mut self) {
        self.cell.leave();
    }
}

/// Counts a holder inside an NCCL call until dropped (P5).
struct Inside<'a, A: CommApi>(&'a CommCell<A>);

impl<'a, A: CommApi> Inside<'a, A> {
    /// Enters unless aborted; `closing` (the end of an open group) enters
    /// in any phase but `Freed`, which a holder outside NCCL never sees.
    fn new(cell: &'a CommCell<A>, closing: bool) -> Result<Inside<'a, A>, Error> {
        let mut st = lock(&cell.state);
        let ok = match st.phase {
            Phase::Live => true,
            Phase::Aborted => closing,
            Phase::Freed => false,
        };
        if !ok {
            return Err(cell.aborted_error());
        }
        st.inside += 1;
        Ok(Inside(cell))
    }
}

impl<A: CommApi> Drop for Inside<'_, A> {
    fn drop(&mut self) {
        lock(&self.0.state).inside -= 1;
    }
}

impl<A: CommApi> Use<'_, A> {
    /// The communicator.
    pub fn cell(&self) -> &CommCell<A> {
        self.cell
    }

    /// Makes one NCCL call `f` with the raw handle; fails with
    /// [`Error::Aborted`], without calling, once the communicator was
    /// aborted.
    ///
    /// # Safety
    /// `f` must not keep the handle past its return; what `f` calls NCCL
    /// for must be allowed by P1 (the caller holds the issue lock, or
    /// calls `ncclCommGetAsyncError`).
    pub unsafe fn call<R>(
        &self,
        f: impl FnOnce(&A, A::Comm) -> Result<R, Error>,
    ) -> Result<R, Error> {
        let _inside = Inside::new(self.cell, false)?;
        f(&self.cell.api, self.cell.raw)
    }

    /// `ncclSend` of `count` elements at `buf` to `peer` on `stream`.
    ///
    /// # Safety
    /// As [`CommApi::send`] for the buffer and stream; the caller holds the
    /// issue lock (P1).
    pub unsafe fn send(
        &self,
        buf: u64,
        count: usize,
        dtype: i32,
        peer: i32,
        stream: A::Stream,
    ) -> Result<bool, Error> {
        // SAFETY: the handle is live inside `call`; the rest is the caller's.
        unsafe { self.call(|api, c| api.send(c, buf, count, dtype, peer, stream)) }
    }

    /// `ncclRecv`, as [`Use::send`].
    ///
    /// # Safety
    /// As [`Use::send`], and the buffer must be writable.
    pub unsafe fn recv(
        &self,
        buf: u64,
        count: usize,
        dtype: i32,
        peer: i32,
        stream: A::Stream,
    ) -> Result<bool, Error> {
        // SAFETY: the handle is live inside `call`; the rest is the caller's.
        unsafe { self.call(|api, c| api.recv(c, buf, count, dtype, peer, stream)) }
    }

    /// `ncclCommGetAsyncError` (allowed without the issue lock, P1; one
    /// thread at a time per communicator, and, on a non-blocking one, not
    /// while a group on it is being built or ended, [`Issuing::group`]).
    pub fn async_error(&self) -> Result<bool, Error> {
        let _one = lock(&self.cell.query);
        self.query()
    }

    /// The query itself. Made through the hold, like any call, but not
    /// counted inside NCCL (P5): a query never blocks, so a holder in it
    /// must keep [`CommCell::force_free`] away rather than pass for one
    /// blocked in a call.
    fn query(&self) -> Result<bool, Error> {
        if lock(&self.cell.state).phase != Phase::Live {
            return Err(self.cell.aborted_error());
        }
        // SAFETY: this hold keeps the handle from being freed (P4: only the
        // last holder frees; `force_free` waits while a holder is outside
        // a call), and it is not kept.
        unsafe { self.cell.api.async_error(self.cell.raw) }
    }

    /// [`Use::async_error`], or `None` at once when another thread is
    /// querying the communicator or (a non-blocking one) building or
    /// ending a group on it: for the health checks of waits, which must
    /// not wait on it.
    pub fn try_async_error(&self) -> Option<Result<bool, Error>> {
        let _one = self.cell.query.try_lock().ok()?;
        Some(self.query())
    }
}

/// An NCCL call queued for whoever holds the issue lock next
/// ([`IssueLock::later`]): the lane service's setup and connection calls.
pub type Queued = Box<dyn FnOnce(&Issuing<'_>) + Send>;

/// The rank's lock around every NCCL call (P1), the mark of a call in
/// progress that the watchdog reads, and the calls queued for the lock's
/// next holder.
pub struct IssueLock {
    lock: Mutex<()>,
    /// When the NCCL call in progress started (nanoseconds since `epoch`),
    /// 0 when none is.
    busy_since: AtomicU64,
    epoch: Instant,
    /// Calls queued by a thread that does not hold the lock
    /// ([`IssueLock::later`]), and how many (read without the queue's
    /// lock by every release of the issue lock). Not loom's: the loom
    /// scenarios queue nothing, and an atomic of loom's read at every
    /// release would multiply their interleavings.
    queued: std::sync::Mutex<Vec<Queued>>,
    queued_len: std::sync::atomic::AtomicUsize,
}

impl fmt::Debug for IssueLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IssueLock")
            .field(
                "queued",
                &self.queued_len.load(std::sync::atomic::Ordering::Acquire),
            )
            .finish_non_exhaustive()
    }
}

impl Default for IssueLock {
    fn default() -> Self {
        IssueLock {
            lock: Mutex::new(()),
            busy_since: AtomicU64::new(0),
            epoch: Instant::now(),
            queued: std::sync::Mutex::new(Vec::new()),
            queued_len: std::sync::atomic::AtomicUsize::new(0),
        }
    }
}

impl IssueLock {
    /// Waits for the lock: from then on this thread is the rank's only
    /// NCCL caller until the [`Issuing`] drops.
    pub fn lock(&self) -> Issuing<'_> {
        Issuing {
            owner: self,
            _g: lock(&self.lock),
        }
    }

    /// The lock, if no other thread holds it now.
    pub fn try_lock(&self) -> Option<Issuing<'_>> {
        let g = match self.lock.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(Issuing { owner: self, _g: g })
    }

    /// Queues `call` for the lock's holder (P1): run now if the lock is
    /// free, else by the thread that holds it, before it lets it go
    /// ([`Issuing`]'s drop) or while it waits holding it
    /// ([`IssueLock::run_queued`]). (They waited for a `try_lock` of the
    /// lane service that a rank launching back to back seldom let win:
    /// 2 of 940 tries in 2 s, found by review.)
    pub fn later(&self, call: Queued) {
        {
            let mut q = self.queued.lock().unwrap_or_else(|e| e.into_inner());
            q.push(call);
            self.queued_len
                .store(q.len(), std::sync::atomic::Ordering::Release);
        }
        // The drop runs the queue.
        drop(self.try_lock());
    }

    /// Runs the queued calls under `issuing`, this lock held.
    pub fn run_queued(&self, issuing: &Issuing<'_>) {
        use std::sync::atomic::Ordering;
        if self.queued_len.load(Ordering::Acquire) == 0 {
            return;
        }
        let calls = {
            let mut q = self.queued.lock().unwrap_or_else(|e| e.into_inner());
            self.queued_len.store(0, Ordering::Release);
            std::mem::take(&mut *q)
        };
        for call in calls {
            call(issuing);
        }
    }

    /// How long the NCCL call in progress has lasted, if one is.
    pub fn busy_for(&self) -> Option<Duration> {
        let since = self.busy_since.load(Ordering::Acquire);
        (since != 0).then(|| {
            let now = self.epoch.elapsed().as_nanos() as u64;
            Duration::from_nanos(now.saturating_sub(since))
        })
    }
}

/// The rank's issue lock, held (P1). Not `Send` (it holds a mutex guard):
/// the group it builds stays on one thread (P2).
pub struct Issuing<'a> {
    owner: &'a IssueLock,
    _g: MutexGuard<'a, ()>,
}

impl fmt::Debug for Issuing<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Issuing")
    }
}

impl Drop for Issuing<'_> {
    /// Before the lock goes: the calls queued for its holder
    /// ([`IssueLock::later`]), unless this thread is unwinding.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.owner.run_queued(self);
        }
    }
}

/// An NCCL call in progress, as the watchdog sees it (see
/// [`IssueLock::busy_for`]).
#[derive(Debug)]
pub struct Busy<'a>(&'a IssueLock);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.busy_since.store(0, Ordering::Release);
    }
}

impl Issuing<'_> {
    /// Marks an NCCL call in progress until the guard drops.
    pub fn busy(&self) -> Busy<'_> {
        let now = self.owner.epoch.elapsed().as_nanos() as u64;
        self.owner.busy_since.store(now.max(1), Ordering::Release);
        Busy(self.owner)
    }

    /// One group (P2): `ncclGroupStart`, `ops` (the sends and recvs, made
    /// through `uses`, which hold every communicator the group names, P3),
    /// then `ncclGroupEnd`, called even when `ops` fails. The outer result
    /// is `ops`'s; the inner one `ncclGroupEnd`'s (`Ok(false)`: in progress
    /// on non-blocking communicators).
    pub fn group<A: CommApi>(
        &self,
        api: &A,
        uses: &[Use<'_, A>],
        ops: impl FnOnce() -> Result<(), Error>,
    ) -> Result<Result<bool, Error>, Error> {
        let _busy = self.busy();
        // No state query on a communicator of the group until its end has
        // returned: NCCL links the group's background job to the
        // communicator there, and the query reaps it (NCCL 2.26 and
        // later), so a query in between could reap a job not yet started
        // or join one still in its handshake. Queries that must not wait
        // ([`Use::try_async_error`]) skip the communicator meanwhile. A
        // blocking communicator has no such job, and its group end may
        // wait for a peer: its queries go on.
        let mut queries: smallvec::SmallVec<[(&CommCell<A>, MutexGuard<'_, ()>); 4]> =
            smallvec::SmallVec::new();
        for u in uses.iter().filter(|u| !u.cell.blocking) {
            if !queries.iter().any(|(c, _)| std::ptr::eq(*c, u.cell)) {
                queries.push((u.cell, lock(&u.cell.query)));
            }
        }
        api.group_start()?;
        let result = ops();
        // The end launches what the group queued on every communicator
        // held: count them inside NCCL (P5), aborted ones included. None
        // is freed: a holder outside NCCL (this thread, until now) keeps
        // `force_free` away.
        // On the stack: a group names a few communicators, and this runs
        // for every launch.
        let mut inside: smallvec::SmallVec<[Inside<'_, A>; 4]> = smallvec::SmallVec::new();
        for u in uses {
            if let Ok(i) = Inside::new(u.cell, true) {
                inside.push(i);
            }
        }
        let end = api.group_end();
        drop(inside);
        result.map(|()| end)
    }
}

/// Whether the device is done with something (for an op: a query of the
/// completion fence it attached to, [`crate::fence`]).
pub trait Done {
    /// True once the device can no longer touch it.
    fn done(&self) -> bool;

    /// The queue it completes in, and its position there: things of one
    /// queue complete in the order of their positions (ops of one CUDA
    /// stream, by the order their events were recorded), so that once one
    /// is done, every earlier one is, and once one is not, no later one is;
    /// the ledger then need not ask each. `None` (the default): no such
    /// order.
    fn queue(&self) -> Option<(usize, u64)> {
        None
    }

    /// Told that it is done, because a later thing of its queue is: it
    /// need not ask the device again (the default forgets it).
    fn mark_done(&self) {}
}

impl<T: Done + ?Sized> Done for std::sync::Arc<T> {
    fn done(&self) -> bool {
        (**self).done()
    }

    fn queue(&self) -> Option<(usize, u64)> {
        (**self).queue()
    }

    fn mark_done(&self) {
        (**self).mark_done()
    }
}

/// Drops the completed ones of `ops`. The ops of a queue are done for a
/// prefix of their positions (an op is done once a later one of its queue
/// is), so each queue is searched by bisection: a few questions find its
/// last op that is done, and every op up to it leaves unasked. Ops of no
/// queue are asked one by one. An op leaves only once it, or a later op of
/// its queue, said it is done.
fn prune<T: Done>(ops: &mut Vec<T>) {
    // Per queue: (queue, [(position, index)]).
    let mut queues: Vec<(usize, Vec<(u64, usize)>)> = Vec::new();
    for (i, o) in ops.iter().enumerate() {
        if let Some((q, pos)) = o.queue() {
            match queues.iter_mut().find(|(lq, _)| *lq == q) {
                Some((_, v)) => v.push((pos, i)),
                None => queues.push((q, vec![(pos, i)])),
            }
        }
    }
    // Per queue: the last position known done, if any.
    let mut done_to: Vec<(usize, Option<u64>)> = Vec::with_capacity(queues.len());
    for (q, mut v) in queues {
        v.sort_unstable();
        // The first index in `v` that is not done: bisection over a
        // predicate true on a prefix.
        let (mut lo, mut hi) = (0, v.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if ops[v[mid].1].done() {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        done_to.push((q, lo.checked_sub(1).map(|k| v[k].0)));
    }
    ops.retain(|o| match o.queue() {
        Some((q, pos)) => {
            let done = done_to
                .iter()
                .any(|(dq, to)| *dq == q && to.is_some_and(|to| pos <= to));
            if done {
                o.mark_done();
            }
            !done
        }
        None => !o.done(),
    });
}

/// The ops of a rank that may still run on its device (P6, P7).
pub struct Ledger<T: Done> {
    ops: Mutex<Vec<T>>,
    /// Length at which completed ops are next pruned.
    prune_at: AtomicUsize,
}

impl<T: Done> fmt::Debug for Ledger<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ledger")
            .field("ops", &lock(&self.ops).len())
            .finish()
    }
}

impl<T: Done> Default for Ledger<T> {
    fn default() -> Self {
        Ledger {
            ops: Mutex::new(Vec::new()),
            prune_at: AtomicUsize::new(256),
        }
    }
}

impl<T: Done + Clone> Ledger<T> {
    /// Adds the ops of one launch, all under one lock (P7). Completed ops
    /// leave now and then; the next pruning waits until the list has
    /// doubled, so the cost per op stays constant however many are in
    /// flight.
    pub fn record(&self, launch: impl IntoIterator<Item = T>) {
        let mut ops = lock(&self.ops);
        ops.extend(launch);
        if ops.len() >= self.prune_at.load(Ordering::Relaxed) {
            prune(&mut ops);
            self.prune_at
                .store((2 * ops.len()).max(256), Ordering::Relaxed);
        }
    }

    /// The ops not completed, in launch order: a snapshot that holds whole
    /// launches (P7). Completed ops leave.
    pub fn pending(&self) -> Vec<T> {
        let mut ops = lock(&self.ops);
        prune(&mut ops);
        ops.clone()
    }

    /// Whether every op recorded has completed (those that have are let
    /// go): nothing of the rank is in flight.
    pub fn quiet(&self) -> bool {
        let mut ops = lock(&self.ops);
        prune(&mut ops);
        ops.is_empty()
    }

    /// Gives up the ops not completed without dropping them: their buffers
    /// are leaked, never freed under a kernel (P6). Returns how many.
    pub fn leak_pending(&self) -> usize {
        let stuck: Vec<T> = std::mem::take(&mut *lock(&self.ops))
            .into_iter()
            .filter(|o| !o.done())
            .collect();
        let n = stuck.len();
        std::mem::forget(stuck);
        n
    }
}

impl<T: Done> Drop for Ledger<T> {
    fn drop(&mut self) {
        let ops = std::mem::take(self.ops.get_mut_or_lock());
        let (done, stuck): (Vec<T>, Vec<T>) = ops.into_iter().partition(|o| o.done());
        drop(done);
        // Ops still running keep their buffers for good (P6).
        std::mem::forget(stuck);
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
