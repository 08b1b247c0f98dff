//! A fake NCCL for tests without GPUs (compiled for tests and under
//! `--cfg loom`): it runs the protocol of [`crate::guard`] unchanged and
//! panics where real NCCL would misbehave silently.
//!
//! It checks, at every call: that the communicator was not freed (a use
//! after free), that no two threads are inside calls that build or launch
//! work at once (R11, P1), that groups do not overlap (P2), and that a
//! communicator is freed at most once, and that a free never waits for a
//! kernel that nothing told to stop: a free synchronizes the device, so a
//! kernel in flight ([`FakeNccl::launch_kernel`]) on a communicator whose
//! abort flag is not raised would make it wait for ever (P8). A blocking
//! communicator's `ncclGroupEnd` blocks until the communicator is revoked or aborted,
//! like a call that waits for a peer that never comes. With `revoke`, the
//! fake has `ncclCommRevoke`, and then it also checks that nothing frees a
//! communicator while a call is blocked inside it.

use std::fmt;

use duplex::Error;

use super::{CommApi, Done};
use crate::sync::{Arc, AtomicBool, AtomicUsize, Mutex, Ordering, lock, thread};

/// One fake communicator.
#[derive(Debug, Default)]
struct Comm {
    blocking: bool,
    freed: AtomicBool,
    frees: AtomicUsize,
    interrupted: AtomicBool,
    /// A call is blocked inside it.
    blocked: AtomicBool,
    /// Calls made on it (any kind).
    calls: AtomicUsize,
    /// A kernel is in flight on it, waiting for a peer: it ends only when
    /// the communicator is interrupted (its abort flag).
    kernel: AtomicBool,
    /// Non-blocking, its groups ended in the background
    /// ([`FakeNccl::in_background`]).
    background: bool,
    /// A group of it is in progress in the background: only the state
    /// query may be called on it until a query has found it done (the
    /// first query after the group's end says not yet, the next says
    /// done: the background job finishes at a point the model checker
    /// chooses among the other threads' steps).
    in_progress: AtomicUsize,
    /// A thread is inside `ncclCommGetAsyncError` on it.
    querying: AtomicBool,
    /// An op of the open group (or of the group being ended) is on it:
    /// NCCL links the group's job to it at the end, which a state query
    /// must not overlap.
    in_group: AtomicBool,
}

#[derive(Debug)]
struct Inner {
    revoke: bool,
    comms: Vec<Comm>,
    /// Threads inside calls that build or launch work.
    issuing: AtomicUsize,
    group_open: AtomicBool,
    /// Communicators of the open group's ops.
    queued: Mutex<Vec<usize>>,
    /// Streams of the open group's ops, with their communicators.
    queued_streams: Mutex<Vec<(usize, usize)>>,
    /// (communicator, stream): the streams of groups in progress in the
    /// background, on which nothing may be launched until they end.
    busy_streams: Mutex<Vec<(usize, usize)>>,
}

/// A fake NCCL with a fixed set of communicators `0..n` (cheap to clone).
#[derive(Clone)]
pub struct FakeNccl(Arc<Inner>);

impl fmt::Debug for FakeNccl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FakeNccl")
            .field("revoke", &self.0.revoke)
            .field("comms", &self.0.comms.len())
            .finish()
    }
}

/// Counts a thread inside a call that builds or launches work (R11).
struct Issuing<'a>(&'a Inner);

impl<'a> Issuing<'a> {
    fn new(inner: &'a Inner, call: &str) -> Issuing<'a> {
        let before = inner.issuing.fetch_add(1, Ordering::SeqCst);
        assert_eq!(before, 0, "{call}: another thread is inside NCCL (R11)");
        Issuing(inner)
    }
}

impl Drop for Issuing<'_> {
    fn drop(&mut self) {
        self.0.issuing.fetch_sub(1, Ordering::SeqCst);
    }
}

impl FakeNccl {
    /// Communicators `0..blocking.len()`, blocking where `blocking[i]`;
    /// with `revoke`, the library can revoke (NCCL's `ncclCommRevoke`).
    pub fn new(blocking: &[bool], revoke: bool) -> FakeNccl {
        FakeNccl(Arc::new(Inner {
            revoke,
            comms: blocking
                .iter()
                .map(|&b| Comm {
                    blocking: b,
                    ..Comm::default()
                })
                .collect(),
            issuing: AtomicUsize::new(0),
            group_open: AtomicBool::new(false),
            queued: Mutex::new(Vec::new()),
            queued_streams: Mutex::new(Vec::new()),
            busy_streams: Mutex::new(Vec::new()),
        }))
    }

    /// Communicators `0..n`, non-blocking, each group of which NCCL ends
    /// in the background (as NCCL 2.23 and later do): `ncclGroupEnd`
    /// returns in progress, and the state query says not ready once. It
    /// checks that no call but the state query
    /// is made on a communicator while its group is in progress (NCCL's
    /// rule for non-blocking communicators), and that no two threads query
    /// one communicator at once (the query reaps the group's job).
    pub fn in_background(n: usize) -> FakeNccl {
        let fake = FakeNccl::new(&vec![false; n], false);
        let mut inner = Arc::try_unwrap(fake.0).expect("just made");
        for c in &mut inner.comms {
            c.background = true;
        }
        FakeNccl(Arc::new(inner))
    }

    fn comm(&self, c: usize) -> &Comm {
        &self.0.comms[c]
    }

    /// An abort stops communicator `c`'s group in progress: nothing of it
    /// goes on its streams any more.
    fn stop_background(&self, c: usize) {
        self.comm(c).in_progress.store(0, Ordering::SeqCst);
        lock(&self.0.busy_streams).retain(|(x, _)| *x != c);
    }

    /// Every use of a handle: panics if it was freed.
    fn live(&self, c: usize, call: &str) -> &Comm {
        let comm = self.comm(c);
        assert!(
            !comm.freed.load(Ordering::SeqCst),
            "{call} on communicator {c} after it was freed"
        );
        comm.calls.fetch_add(1, Ordering::SeqCst);
        comm
    }

    fn interrupted(c: usize, call: &str) -> Error {
        Error::Aborted(format!("{call} on communicator {c}: interrupted"))
    }

    /// How many times communicator `c` was freed (0 or 1).
    pub fn frees(&self, c: usize) -> usize {
        self.comm(c).frees.load(Ordering::SeqCst)
    }

    /// True while a call is blocked inside communicator `c`, and after.
    pub fn blocked(&self, c: usize) -> bool {
        self.comm(c).blocked.load(Ordering::SeqCst)
    }

    /// How many calls used communicator `c`'s handle.
    pub fn calls(&self, c: usize) -> usize {
        self.comm(c).calls.load(Ordering::SeqCst)
    }

    /// Puts a kernel in flight on communicator `c` that waits for a peer
    /// that never comes: only the communicator's abort stops it.
    pub fn launch_kernel(&self, c: usize) {
        self.live(c, "launch").kernel.store(true, Ordering::SeqCst);
    }

    /// Frees communicator `c`, whose abort flag is raised: panics on a
    /// second free. The free synchronizes the device: it waits while a
    /// kernel of another communicator is in flight whose flag is not
    /// raised, and panics when nothing raises it (a hang on real NCCL).
    fn free(&self, comm: usize) {
        let c = self.comm(comm);
        assert!(
            !c.freed.swap(true, Ordering::SeqCst),
            "communicator {comm} freed twice"
        );
        c.frees.fetch_add(1, Ordering::SeqCst);
        // Another thread may still raise the flag: wait, but not for ever
        // (a bound in time on real threads, in steps under loom).
        #[cfg(not(loom))]
        let start = std::time::Instant::now();
        #[cfg(loom)]
        let mut steps = 0u32;
        while let Some(i) =
            self.0.comms.iter().position(|o| {
                o.kernel.load(Ordering::SeqCst) && !o.interrupted.load(Ordering::SeqCst)
            })
        {
            #[cfg(not(loom))]
            let waited_too_long = start.elapsed() > std::time::Duration::from_secs(5);
            #[cfg(loom)]
            let waited_too_long = {
                steps += 1;
                steps > 64
            };
            assert!(
                !waited_too_long,
                "freeing communicator {comm} synchronizes the device, which waits for the kernel of communicator {i}, never told to stop: a hang (NVIDIA/nccl#564)"
            );
            thread::yield_now();
        }
    }

    fn queue(&self, c: usize, call: &str, stream: usize) -> Result<bool, Error> {
        let _i = Issuing::new(&self.0, call);
        let comm = self.live(c, call);
        assert!(
            comm.in_progress.load(Ordering::SeqCst) == 0,
            "{call} on communicator {c} while its group is in progress (NCCL's rule for non-blocking communicators)"
        );
        if comm.interrupted.load(Ordering::SeqCst) {
            return Err(Self::interrupted(c, call));
        }
        assert!(
            !lock(&self.0.busy_streams).iter().any(|(_, s)| *s == stream),
            "{call} on stream {stream} while a group in progress on it has not put its work there (NCCL's rule for non-blocking communicators)"
        );
        if self.0.group_open.load(Ordering::SeqCst) {
            comm.in_group.store(true, Ordering::SeqCst);
            lock(&self.0.queued).push(c);
            lock(&self.0.queued_streams).push((c, stream));
        }
        Ok(true)
    }
}

impl CommApi for FakeNccl {
    type Comm = usize;
    type Stream = usize;

    fn group_start(&self) -> Result<(), Error> {
        let _i = Issuing::new(&self.0, "ncclGroupStart");
        assert!(
            !self.0.group_open.swap(true, Ordering::SeqCst),
            "ncclGroupStart: a group is already open (P2)"
        );
        Ok(())
    }

    fn group_end(&self) -> Result<bool, Error> {
        let _i = Issuing::new(&self.0, "ncclGroupEnd");
        assert!(
            self.0.group_open.load(Ordering::SeqCst),
            "ncclGroupEnd without ncclGroupStart"
        );
        let queued = std::mem::take(&mut *lock(&self.0.queued));
        let streams = std::mem::take(&mut *lock(&self.0.queued_streams));
        let mut result = Ok(true);
        for &c in &queued {
            self.live(c, "ncclGroupEnd");
        }
        for &c in &queued {
            let comm = self.comm(c);
            if comm.blocking {
                comm.blocked.store(true, Ordering::SeqCst);
                // Waits for a peer that never comes, until interrupted.
                while !comm.interrupted.load(Ordering::SeqCst) {
                    thread::yield_now();
                }
                if self.0.revoke {
                    assert!(
                        !comm.freed.load(Ordering::SeqCst),
                        "communicator {c} was freed while ncclGroupEnd was blocked in it"
                    );
                }
            }
            if comm.interrupted.load(Ordering::SeqCst) {
                result = Err(Self::interrupted(c, "ncclGroupEnd"));
            } else if comm.background {
                comm.in_progress.store(2, Ordering::SeqCst);
                lock(&self.0.busy_streams).extend(streams.iter().filter(|(x, _)| *x == c));
                if result.is_ok() {
                    result = Ok(false);
                }
            }
        }
        for &c in &queued {
            self.comm(c).in_group.store(false, Ordering::SeqCst);
        }
        self.0.group_open.store(false, Ordering::SeqCst);
        result
    }

    unsafe fn send(
        &self,
        comm: usize,
        _buf: u64,
        _count: usize,
        _dtype: i32,
        _peer: i32,
        stream: usize,
    ) -> Result<bool, Error> {
        self.queue(comm, "ncclSend", stream)
    }

    unsafe fn recv(
        &self,
        comm: usize,
        _buf: u64,
        _count: usize,
        _dtype: i32,
        _peer: i32,
        stream: usize,
    ) -> Result<bool, Error> {
        self.queue(comm, "ncclRecv", stream)
    }

    unsafe fn async_error(&self, comm: usize) -> Result<bool, Error> {
        let c = self.live(comm, "ncclCommGetAsyncError");
        assert!(
            !c.querying.swap(true, Ordering::SeqCst),
            "ncclCommGetAsyncError on communicator {comm} from two threads at once"
        );
        // A blocking communicator's group has no background job to reap.
        assert!(
            c.blocking || !c.in_group.load(Ordering::SeqCst),
            "ncclCommGetAsyncError on communicator {comm} while a group on it is built or ended"
        );
        let state = if c.interrupted.load(Ordering::SeqCst) {
            Err(Self::interrupted(comm, "ncclCommGetAsyncError"))
        } else {
            // 2 → 1: not yet; 1 → 0: done.
            let left = c.in_progress.load(Ordering::SeqCst);
            if left == 2 {
                c.in_progress.store(1, Ordering::SeqCst);
            } else if left == 1 {
                // Done: its work is on its streams.
                lock(&self.0.busy_streams).retain(|(x, _)| *x != comm);
                c.in_progress.store(0, Ordering::SeqCst);
            }
            Ok(left != 2)
        };
        c.querying.store(false, Ordering::SeqCst);
        state
    }

    unsafe fn revoke(&self, comm: usize) -> Result<bool, Error> {
        if !self.0.revoke {
            return Ok(false);
        }
        self.live(comm, "ncclCommRevoke")
            .interrupted
            .store(true, Ordering::SeqCst);
        self.stop_background(comm);
        Ok(true)
    }

    unsafe fn abort(&self, comm: usize) -> Result<(), Error> {
        // NCCL raises the communicator's abort flag, then frees it: a group
        // of one.
        // SAFETY: the caller's contract is the same.
        unsafe { self.abort_many(&[comm]) }
    }

    unsafe fn abort_many(&self, comms: &[usize]) -> Result<(), Error> {
        // Inside one group: every flag is raised as its abort is called;
        // the frees run at the group's end.
        for &c in comms {
            self.comm(c).interrupted.store(true, Ordering::SeqCst);
            self.stop_background(c);
        }
        for &c in comms {
            self.free(c);
        }
        Ok(())
    }
}

/// A fake device buffer: panics if freed (dropped) while an op that uses
/// it has not completed.
#[derive(Debug)]
pub struct FakeBuf {
    ops: Mutex<Vec<std::sync::Arc<AtomicBool>>>,
    freed: std::sync::Arc<AtomicBool>,
}

impl FakeBuf {
    /// A buffer, and a flag that says when it was freed.
    pub fn new() -> (std::sync::Arc<FakeBuf>, std::sync::Arc<AtomicBool>) {
        let freed = std::sync::Arc::new(AtomicBool::new(false));
        (
            std::sync::Arc::new(FakeBuf {
                ops: Mutex::new(Vec::new()),
                freed: freed.clone(),
            }),
            freed,
        )
    }
}

impl Drop for FakeBuf {
    fn drop(&mut self) {
        for done in lock(&self.ops).iter() {
            assert!(
                done.load(Ordering::SeqCst),
                "a buffer was freed while an op that uses it runs"
            );
        }
        self.freed.store(true, Ordering::SeqCst);
    }
}

/// A fake launched op: it holds its buffer, as `ctx::Issued` does, and
/// completes when the fake device says so.
#[derive(Clone, Debug)]
pub struct FakeOp {
    done: std::sync::Arc<AtomicBool>,
    /// Which communicator it was launched on.
    pub comm: usize,
    _buf: std::sync::Arc<FakeBuf>,
}

impl FakeOp {
    /// An op on `buf` launched on communicator `comm`.
    pub fn new(buf: &std::sync::Arc<FakeBuf>, comm: usize) -> FakeOp {
        let done = std::sync::Arc::new(AtomicBool::new(false));
        lock(&buf.ops).push(done.clone());
        FakeOp {
            done,
            comm,
            _buf: buf.clone(),
        }
    }

    /// What the fake device completes the op with; it does not hold the
    /// buffer.
    pub fn completion(&self) -> Completion {
        Completion(self.done.clone())
    }
}

/// The device's side of a [`FakeOp`].
#[derive(Clone, Debug)]
pub struct Completion(std::sync::Arc<AtomicBool>);

impl Completion {
    /// The device completes the op.
    pub fn complete(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl Done for FakeOp {
    fn done(&self) -> bool {
        self.done.load(Ordering::SeqCst)
    }
}
