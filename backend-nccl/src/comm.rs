//! Communicators: creation (init, split), readiness under a deadline, and
//! abort. A communicator's handle lives in a [`CommCell`], which lets a
//! thread use it only while holding it and frees it only once no thread
//! can ([`crate::guard`]).

use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::time::{Duration, Instant};

use duplex::{Error, Rank};

use crate::guard::{CommCell, IssueLock, Use};
use crate::nccl::sys::{NCCL_SPLIT_NOCOLOR, ncclComm_t, ncclUniqueId};
use crate::nccl::{Nccl, RawComm};

/// A communicator of this rank: its handle, under the protocol of
/// [`crate::guard`], and what reports call it.
#[derive(Debug)]
pub struct CommInner {
    /// The handle: reachable only through a hold ([`CommCell::enter`]),
    /// freed once no thread can use it.
    pub cell: CommCell<&'static Nccl>,
    /// Its number, the same on every rank (world 0, then lanes, then user
    /// communicators in creation order).
    pub logical: u32,
    /// Its name (`world`, `lane:0->1`, `pair:0-1`, a user's name).
    pub name: String,
    /// Member ranks in communicator-rank order.
    pub members: Vec<Rank>,
    /// A blocking communicator: its calls return when done. duplex makes
    /// blocking only communicators connected at creation, whose calls never
    /// wait for a peer's host; a rank's watchdog aborts it if a call still
    /// overstays the deadline.
    pub blocking: bool,
}

/// A shared handle to a communicator.
pub type Comm = Arc<CommInner>;

/// A hold on a communicator of the real library.
pub type NcclUse<'a> = Use<'a, &'static Nccl>;

/// Polls `done` until it returns true or `timeout` passes. Spins briefly,
/// then yields, then sleeps, so that short waits stay short.
pub fn poll(
    timeout: Duration,
    mut done: impl FnMut() -> Result<bool, Error>,
) -> Result<bool, Error> {
    let start = Instant::now();
    let mut n: u32 = 0;
    loop {
        if done()? {
            return Ok(true);
        }
        if start.elapsed() >= timeout {
            return Ok(false);
        }
        n = n.saturating_add(1);
        if n < 2000 {
            std::hint::spin_loop();
        } else if n < 4000 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(if n < 6000 { 20 } else { 200 }));
        }
    }
}

/// Why a wait for a communicator's work ([`CommInner::ready_with`]) ended
/// without it: a caller that reports a hang past the deadline tells the
/// two apart by type.
#[derive(Debug)]
pub enum Unready {
    /// The deadline passed first; the error says what did not finish.
    Late(Error),
    /// NCCL reported an error, the communicator was aborted, or the
    /// caller's check between polls failed.
    Failed(Error),
}

impl From<Unready> for Error {
    fn from(u: Unready) -> Error {
        match u {
            Unready::Late(e) | Unready::Failed(e) => e,
        }
    }
}

impl CommInner {
    fn new(
        lib: &'static Nccl,
        raw: ncclComm_t,
        logical: u32,
        name: &str,
        members: Vec<Rank>,
        blocking: bool,
    ) -> CommInner {
        CommInner {
            cell: {
                // SAFETY: `raw` is a live communicator that nothing else frees.
                unsafe { CommCell::new(lib, RawComm(raw), name) }.blocking(blocking)
            },
            logical,
            name: name.to_string(),
            members,
            blocking,
        }
    }

    /// A hold on the communicator, unless it was aborted.
    pub fn enter(&self) -> Result<NcclUse<'_>, Error> {
        self.cell.enter()
    }

    /// This communicator's rank of global rank `r`, if a member.
    pub fn rank_of(&self, r: Rank) -> Option<i32> {
        self.members.iter().position(|m| *m == r).map(|i| i as i32)
    }

    /// True once aborted.
    pub fn is_aborted(&self) -> bool {
        self.cell.is_aborted()
    }

    /// Waits until no operation is in progress on it.
    pub fn ready(&self, timeout: Duration, what: &str) -> Result<(), Error> {
        Ok(self.ready_with(timeout, what, &mut || Ok(()))?)
    }

    /// [`CommInner::ready`], calling `between` while it waits, which ends
    /// the wait with its error: a caller that holds the rank's issue lock
    /// passes the lane service's NCCL calls (`RankCtx::assist`), which
    /// must not wait for the lock while the holder waits for another rank;
    /// one that waits for other ranks checks that none failed.
    pub fn ready_with(
        &self,
        timeout: Duration,
        what: &str,
        between: &mut dyn FnMut() -> Result<(), Error>,
    ) -> Result<(), Unready> {
        let held = self.enter().map_err(Unready::Failed)?;
        let ok = poll(timeout, || {
            if held.async_error()? {
                return Ok(true);
            }
            between()?;
            Ok(false)
        })
        .map_err(Unready::Failed)?;
        if ok {
            Ok(())
        } else {
            Err(Unready::Late(Error::Aborted(format!(
                "{what} on communicator {} did not finish within {timeout:?}",
                self.name
            ))))
        }
    }

    /// Non-fatal check of the communicator's asynchronous state: `Err` when
    /// NCCL reports a failure (a peer that died, say) or when the
    /// communicator was aborted, since then its ops' bytes cannot be trusted
    /// even where their events completed.
    pub fn check(&self) -> Result<(), Error> {
        self.check_with(|held| held.async_error())
    }

    /// [`CommInner::check`] for the health polls of a wait: when another
    /// thread is querying the communicator, or (a non-blocking one)
    /// building or ending a group on it, it says nothing now rather than
    /// wait (the next poll asks again). Never the check that lets an op
    /// report success: that one waits its turn.
    pub fn check_now(&self) -> Result<(), Error> {
        self.check_with(|held| held.try_async_error().unwrap_or(Ok(true)))
    }

    /// The check, with the state query `query`.
    fn check_with(
        &self,
        query: impl FnOnce(&NcclUse<'_>) -> Result<bool, Error>,
    ) -> Result<(), Error> {
        let aborted = || {
            Err(Error::Aborted(format!(
                "communicator {} was aborted, so its ops did not move their bytes",
                self.name
            )))
        };
        if self.is_aborted() {
            return aborted();
        }
        let Ok(held) = self.enter() else {
            return aborted();
        };
        query(&held).map(drop)
    }
}

/// Where NCCL stores a new communicator's handle. NCCL writes it from its
/// own thread when an asynchronous setup finishes, so it lives on the heap
/// until the setup is over (and is leaked if the setup never ends).
struct Slot(Box<AtomicPtr<c_void>>);

impl Slot {
    fn new() -> Slot {
        Slot(Box::new(AtomicPtr::new(std::ptr::null_mut())))
    }

    fn ptr(&self) -> *mut ncclComm_t {
        self.0.as_ptr()
    }

    fn get(&self) -> ncclComm_t {
        self.0.load(Ordering::Acquire)
    }

    /// Gives the slot up to NCCL for good: for a setup that did not finish.
    fn abandon(self) {
        std::mem::forget(self);
    }
}

/// A communicator whose asynchronous setup (`ncclCommInitRankConfig` on a
/// non-blocking config) is under way: [`Starting::poll`] it until ready,
/// then [`Starting::finish`]. Dropped unfinished, it is aborted (allowed
/// while the setup is in progress) and its slot is left to NCCL; the abort
/// frees the communicator, which waits for the device (P8 of
/// [`crate::guard`]), so drop it where that may wait (the lane service
/// drops one on a thread of its own).
/// Only its owner touches it until it is finished, so its handle needs no
/// [`CommCell`] yet.
#[derive(Debug)]
pub struct Starting {
    lib: &'static Nccl,
    /// `None` once finished.
    slot: Option<Slot>,
    raw: ncclComm_t,
}

// SAFETY: the handle is only passed to NCCL calls that any thread may make
// (`ncclCommGetAsyncError`, `ncclCommAbort`), by one owner at a time.
unsafe impl Send for Starting {}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Slot")
    }
}

impl Starting {
    /// Starts this rank's part of a new communicator of `nranks` ranks
    /// from `id`, as rank `rank` of it. The caller made the rank's device
    /// current and holds the rank's issue lock (or is its only thread).
    pub fn begin(
        lib: &'static Nccl,
        id: ncclUniqueId,
        nranks: u32,
        rank: u32,
        ctas: (Option<i32>, Option<i32>),
    ) -> Result<Starting, Error> {
        let mut config = lib.config(ctas.0, ctas.1, false);
        let slot = Slot::new();
        // SAFETY: the device is current (the caller's duty); the slot lives
        // until the setup finishes, or is left to NCCL by the drop.
        unsafe { lib.init_rank(nranks as i32, id, rank as i32, &mut config, slot.ptr()) }?;
        let raw = slot.get();
        if raw.is_null() {
            return Err(Error::Aborted(
                "ncclCommInitRankConfig returned no communicator".into(),
            ));
        }
        Ok(Starting {
            lib,
            slot: Some(slot),
            raw,
        })
    }

    /// True once the setup has finished; an error if it failed.
    pub fn poll(&self) -> Result<bool, Error> {
        // SAFETY: `raw` is the communicator NCCL is setting up, not freed.
        unsafe { self.lib.async_error(self.raw) }
    }

    /// The communicator, once [`Starting::poll`] said ready.
    pub fn finish(mut self, logical: u32, name: &str, members: Vec<Rank>) -> Comm {
        self.slot = None;
        Arc::new(CommInner::new(
            self.lib, self.raw, logical, name, members, false,
        ))
    }
}

impl Drop for Starting {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            slot.abandon();
            // SAFETY: abort is allowed while setup is in progress; nothing
            // else holds the handle.
            let _ = unsafe { self.lib.abort(self.raw) };
        }
    }
}

/// Creates this rank's handle on a new communicator of `nranks` ranks.
/// The setup waits for every rank, under `timeout`, and ends early when
/// `failed` names another rank of the job that failed (it cannot come).
pub fn init(
    lib: &'static Nccl,
    id: ncclUniqueId,
    nranks: u32,
    rank: Rank,
    timeout: Duration,
    ctas: (Option<i32>, Option<i32>),
    failed: &dyn Fn() -> Option<(Rank, String)>,
) -> Result<Comm, Error> {
    let starting = Starting::begin(lib, id, nranks, rank, ctas)?;
    let mut checks = 0u32;
    let mut peer = None;
    let ready = poll(timeout, || {
        checks = checks.wrapping_add(1);
        if checks.is_multiple_of(256)
            && let Some(f) = failed()
        {
            peer = Some(f);
            return Ok(true);
        }
        starting.poll()
    });
    if let Some((r, why)) = peer {
        drop(starting);
        return Err(Error::Aborted(format!(
            "creating the world communicator of rank {rank}: rank {r} failed: {why}"
        )));
    }
    match ready {
        Ok(true) => {}
        other => {
            drop(starting);
            return Err(other.err().unwrap_or_else(|| Error::Aborted(format!(
                "ncclCommInitRankConfig did not finish within {timeout:?}: is every rank starting?"
            ))));
        }
    }
    Ok(starting.finish(0, "world", (0..nranks).collect()))
}

/// Splits `parent`: every rank of `parent` calls it; ranks in `members` get
/// the new communicator, the others `None`. The split itself follows the
/// parent's mode (non-blocking, under the deadline `timeout`, which counts
/// from the call); the new communicator
/// is `blocking` or not. `issue` is the rank's issue lock, taken for the
/// `ncclCommSplit` call only (P1 of [`crate::guard`]): the wait for the
/// other ranks holds no lock, so the rank's other threads go on issuing.
/// `None` when the caller holds it already or is the rank's only thread.
/// `between` runs while it waits, and ends the wait with its error
/// ([`CommInner::ready_with`]).
#[allow(clippy::too_many_arguments)]
pub fn split(
    lib: &'static Nccl,
    parent: &Comm,
    rank: Rank,
    members: &[Rank],
    logical: u32,
    name: &str,
    timeout: Duration,
    ctas: (Option<i32>, Option<i32>),
    blocking: bool,
    issue: Option<&IssueLock>,
    between: &mut dyn FnMut() -> Result<(), Error>,
) -> Result<Option<Comm>, Unready> {
    let mut sorted = members.to_vec();
    sorted.sort_unstable();
    let mine = sorted.contains(&rank);
    let color = if mine { 0 } else { NCCL_SPLIT_NOCOLOR };
    let mut config = lib.config(ctas.0, ctas.1, blocking);
    let until = Instant::now() + timeout;
    let left = || until.saturating_duration_since(Instant::now());
    let slot = Slot::new();
    {
        // The issue lock before the hold, as everywhere (lock order of
        // `crate::guard`): a hold kept while waiting for the lock would
        // keep an aborted batch from being freed (P8).
        let _issuing = issue.map(IssueLock::lock);
        if left().is_zero() {
            return Err(Unready::Late(Error::Aborted(format!(
                "ncclCommSplit of communicator {}: its deadline of {timeout:?} passed before it was called",
                parent.name
            ))));
        }
        let held = parent.enter().map_err(Unready::Failed)?;
        // SAFETY: the parent is held and ready, the issue lock is held (or
        // this is the rank's only thread); the slot lives until the split
        // is over (or is leaked below).
        unsafe {
            held.call(|lib, raw| lib.split(raw.0, color, rank as i32, &mut config, slot.ptr()))
        }
        .map_err(Unready::Failed)?;
    }
    // The split is collective over the parent, and its job reports there.
    if let Err(e) = parent.ready_with(left(), "ncclCommSplit", between) {
        slot.abandon();
        return Err(e);
    }
    let raw = slot.get();
    if !mine || raw.is_null() {
        return Ok(None);
    }
    let comm = Arc::new(CommInner::new(lib, raw, logical, name, sorted, blocking));
    if let Err(e) = comm.ready_with(left(), "ncclCommSplit", between) {
        // Not freed on this thread by its drop: a free waits for every
        // kernel of the device (P8 of `crate::guard`), which may wait for
        // this rank's peers; aborted on a thread of its own (found by
        // review).
        crate::lanes::nccl::abort_aside(crate::lanes::nccl::Leftover::Comm(comm));
        return Err(e);
    }
    Ok(Some(comm))
}
