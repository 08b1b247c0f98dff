//! One execution of each race the protocol of [`crate::guard`] must
//! survive, on [`FakeNccl`] (compiled for tests and under `--cfg loom`).
//! `tests/loom.rs` runs each under the loom model checker, which explores
//! every interleaving of its threads; the crate's unit tests run each many
//! times on real threads. Each panics when a property fails.
//!
//! The threads issue through the protocol's types exactly as the backend
//! does (`rank.rs`: `IssueLock::lock`, `CommCell::enter`,
//! `Issuing::group`, `Ledger::record`; `ctx.rs`: `CommCell::abort`,
//! `CommCell::force_free`, `Ledger::pending`, `Ledger::leak_pending`).

use std::time::Duration;

use duplex::Error;

use super::fake::{FakeBuf, FakeNccl, FakeOp};
use super::{CommCell, Handshakes, IssueLock, Ledger, Phase, part_comm, part_stream};
use crate::board::{Board, LocalBoard};
use crate::sync::{Arc, Ordering, thread};

/// How the communicator of [`issue_races_abort`] behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Non-blocking: every call returns at once.
    NonBlocking,
    /// Blocking, its launch waiting for a peer that never comes, on a
    /// library with `ncclCommRevoke`: abort revokes, the last holder frees.
    BlockedRevoke,
    /// Blocking and waiting as above, on a library without revoke: the
    /// watchdog frees it under the blocked call (P5).
    BlockedForce,
}

/// What one issuing thread does (rank.rs's `issue`, without CUDA): takes
/// the issue lock, holds `comms`, sends on each in one group, and polls
/// their state once, as a non-blocking launch is waited for.
pub fn issue(lock: &IssueLock, comms: &[&CommCell<FakeNccl>]) -> Result<bool, Error> {
    let issuing = lock.lock();
    let held = comms
        .iter()
        .map(|c| c.enter())
        .collect::<Result<Vec<_>, _>>()?;
    let Some(first) = comms.first() else {
        return Ok(true);
    };
    let end = issuing.group(first.api(), &held, || {
        for h in &held {
            // SAFETY: the fake's buffers are plain numbers; the issue lock
            // is held.
            unsafe { h.send(0x1000, 1, 0, 1, 0) }?;
        }
        Ok(())
    })?;
    let launched = end?;
    for h in &held {
        h.async_error()?;
    }
    Ok(launched)
}

fn aborted_or_ok(r: &Result<bool, Error>) {
    match r {
        Ok(_) | Err(Error::Aborted(_)) => {}
        Err(e) => panic!("an issue racing an abort ended with {e}"),
    }
}

/// An issue races the watchdog's abort of its communicator: the handle is
/// never used after it was freed (the fake checks every call), it is freed
/// exactly once, the issue completes or fails with [`Error::Aborted`], and
/// the abort completes (with [`Mode::BlockedForce`], the watchdog's forced
/// free once the call is blocked).
pub fn issue_races_abort(mode: Mode) {
    let blocking = mode != Mode::NonBlocking;
    let api = FakeNccl::new(&[blocking], mode == Mode::BlockedRevoke);
    let lock = Arc::new(IssueLock::default());
    // SAFETY: communicator 0 of the fake is live and owned by this cell.
    let cell = Arc::new(unsafe { CommCell::new(api.clone(), 0, "lane") }.blocking(blocking));
    let t = {
        let (lock, cell) = (lock.clone(), cell.clone());
        thread::spawn(move || issue(&lock, &[&*cell]))
    };
    // The watchdog.
    cell.abort();
    if mode == Mode::BlockedForce {
        // "Still blocked after the grace": the fake says the call is
        // blocked inside it (the time the real watchdog waits for).
        while cell.phase() != Phase::Freed {
            // SAFETY: only once the call is blocked inside the fake.
            if api.blocked(0) && unsafe { cell.force_free() } {
                break;
            }
            thread::yield_now();
        }
    }
    let r = t.join().expect("the issuing thread panicked");
    aborted_or_ok(&r);
    assert_eq!(cell.phase(), Phase::Freed, "aborted and unheld, not freed");
    assert_eq!(api.frees(0), 1);
}

/// The watchdog's forced free (P5) races a wait's health poll: on a
/// blocking communicator without revoke, an issue is blocked inside NCCL
/// while another thread holds the communicator and queries its state. A
/// query is not counted inside NCCL, so the forced free waits until the
/// poller has left: the handle is never queried after it was freed (the
/// fake checks every call), it is freed exactly once, and the poll ends
/// with the state or [`Error::Aborted`].
pub fn forced_free_races_a_query() {
    let api = FakeNccl::new(&[true], false);
    let lock = Arc::new(IssueLock::default());
    // SAFETY: communicator 0 of the fake is live and owned by this cell.
    let cell = Arc::new(unsafe { CommCell::new(api.clone(), 0, "lane") }.blocking(true));
    let issuer = {
        let (lock, cell) = (lock.clone(), cell.clone());
        thread::spawn(move || issue(&lock, &[&*cell]))
    };
    // A wait's health check (`CommInner::check`), outside the issue lock.
    let poller = {
        let cell = cell.clone();
        thread::spawn(move || cell.enter().and_then(|h| h.async_error()))
    };
    // The watchdog: abort, then, if the issue is blocked inside NCCL, the
    // forced free, racing the poll (one try: a spin beside the poller
    // exceeds loom's branch limit); then, the poll done, the forced free
    // until it is done, as in `issue_races_abort`.
    cell.abort();
    if api.blocked(0) {
        // SAFETY: the call is blocked in the fake (it stays blocked until
        // the free).
        unsafe { cell.force_free() };
    }
    aborted_or_ok(&poller.join().expect("the polling thread panicked"));
    while cell.phase() != Phase::Freed {
        // SAFETY: as above, only once the call is blocked in the fake.
        if api.blocked(0) && unsafe { cell.force_free() } {
            break;
        }
        thread::yield_now();
    }
    aborted_or_ok(&issuer.join().expect("the issuing thread panicked"));
    assert_eq!(cell.phase(), Phase::Freed, "aborted and unheld, not freed");
    assert_eq!(api.frees(0), 1);
}

/// Two threads of one rank issue at once, on two communicators, while a
/// third polls their state without the issue lock: the fake checks that
/// no two threads are ever inside calls that build or launch work (R11,
/// P1) and that groups never overlap (P2).
pub fn two_issuers() {
    let api = FakeNccl::new(&[false, false], false);
    let lock = Arc::new(IssueLock::default());
    // SAFETY: communicators 0 and 1 of the fake are live, one cell each.
    let cells = Arc::new(unsafe {
        [
            CommCell::new(api.clone(), 0, "a"),
            CommCell::new(api.clone(), 1, "b"),
        ]
    });
    let spawn = |i: usize| {
        let (lock, cells) = (lock.clone(), cells.clone());
        thread::spawn(move || issue(&lock, &[&cells[i]]))
    };
    let (a, b) = (spawn(0), spawn(1));
    // A wait's health check (`CommInner::check`), outside the issue lock.
    if let Ok(h) = cells[0].enter() {
        h.async_error().expect("healthy");
    }
    for t in [a, b] {
        assert!(t.join().expect("an issuing thread panicked").is_ok());
    }
    assert!(api.calls(0) >= 3 && api.calls(1) >= 3);
}

/// What one launch on a non-blocking communicator whose group opens a
/// side does (rank.rs's `issue`, `after_handshakes` and `launch_nccl`,
/// without CUDA), on communicator `comm` (its cell) and `stream`: takes
/// the issue lock once no other thread's launch in its handshake holds
/// either (waited for without the lock), sends in one group, and, the
/// group in progress in NCCL's background, marks both, lets the lock go, polls the communicator's state until the
/// group is done, lets the hold go and takes the lock again for the rest
/// of the launch.
pub fn launch_in_background(
    lock: &IssueLock,
    marks: &Handshakes,
    me: usize,
    cell: &CommCell<FakeNccl>,
    comm: u32,
    stream: usize,
) -> Result<(), Error> {
    let parts = [part_comm(comm), part_stream(stream as u32)];
    let parts = &parts[..];
    let mut issuing = lock.lock();
    while marks.holds(parts, me) {
        drop(issuing);
        while marks.holds(parts, me) {
            thread::yield_now();
        }
        issuing = lock.lock();
    }
    let held = [cell.enter()?];
    let end = issuing.group(cell.api(), &held, || {
        // SAFETY: the fake's buffers are plain numbers; the issue lock is
        // held.
        unsafe { held[0].send(0x1000, 1, 0, 1, stream) }.map(drop)
    })?;
    if end? {
        return Ok(());
    }
    let _mark = marks.mark(me, parts);
    drop(issuing);
    while !held[0].async_error()? {
        thread::yield_now();
    }
    drop(held);
    // The rest of the launch (copy ops, fences, the ledger), under the
    // lock again; the mark drops after it.
    let _issuing = lock.lock();
    Ok(())
}

/// A rank of the handshake scenarios: a fake NCCL whose groups end in the
/// background, with communicators 0 (`lane`) and 1 (`world`).
#[derive(Clone)]
struct BackgroundRank {
    api: FakeNccl,
    lock: Arc<IssueLock>,
    marks: Arc<Handshakes>,
    cells: Arc<[CommCell<FakeNccl>; 2]>,
}

impl BackgroundRank {
    fn new() -> BackgroundRank {
        let api = FakeNccl::in_background(2);
        // SAFETY: communicators 0 and 1 of the fake are live, one cell each.
        let cells = Arc::new(unsafe {
            [
                CommCell::new(api.clone(), 0, "lane"),
                CommCell::new(api.clone(), 1, "world"),
            ]
        });
        BackgroundRank {
            api,
            lock: Arc::new(IssueLock::default()),
            marks: Arc::new(Handshakes::default()),
            cells,
        }
    }

    /// [`launch_in_background`] by thread `me` on communicator `c` (its
    /// cell and its number) and `stream`.
    fn launch(&self, me: usize, c: usize, stream: usize) -> Result<(), Error> {
        launch_in_background(
            &self.lock,
            &self.marks,
            me,
            &self.cells[c],
            c as u32,
            stream,
        )
    }

    /// [`BackgroundRank::launch`] on a thread of its own.
    fn spawn(&self, me: usize, c: usize, stream: usize) -> thread::JoinHandle<Result<(), Error>> {
        let rank = self.clone();
        thread::spawn(move || rank.launch(me, c, stream))
    }
}

/// Three launches of one rank whose groups NCCL ends in the background
/// (each opens a side, R7): two on one communicator (a lane) on two
/// streams, one on another (the world) on a third. The fake checks that
/// nothing but the state query is called on a communicator while its
/// group is in progress (the second launch on the lane waits for the
/// first's mark), that no two threads query one communicator at once, nor
/// query one while a group on it is built or ended (a fourth thread polls
/// the lane's health as a wait does, `CommInner::check_now`), and that no
/// two threads are inside calls that build or launch work (P1; the launch
/// on the world may go while a launch on the lane waits without the
/// lock). Every launch completes, and no mark is left.
pub fn handshake_beside_launches() {
    let rank = BackgroundRank::new();
    let lane = rank.spawn(1, 0, 0);
    let world = rank.spawn(2, 1, 1);
    let poller = {
        let cells = rank.cells.clone();
        thread::spawn(move || {
            if let Ok(h) = cells[0].enter() {
                // Busy or not, never an error: nothing failed.
                if let Some(state) = h.try_async_error() {
                    state.expect("healthy");
                }
            }
        })
    };
    rank.launch(0, 0, 2).expect("the second launch on the lane");
    for t in [lane, world] {
        t.join()
            .expect("a launching thread panicked")
            .expect("a launch failed");
    }
    poller.join().expect("the poller panicked");
    assert!(!rank.marks.any(), "a mark outlived its launch");
    // Each launch: ncclSend, and at least two state queries.
    assert!(rank.api.calls(0) >= 6 && rank.api.calls(1) >= 3);
}

/// Two launches of one rank on two communicators but one stream, whose
/// groups NCCL ends in the background (each opens a side): the fake
/// checks that nothing is launched on a stream while a group in progress
/// has not yet put its work there (NCCL's rule for non-blocking
/// communicators): whichever goes second waits for the first's mark on
/// the stream. Both complete, and no mark is left.
pub fn handshake_holds_its_stream() {
    let rank = BackgroundRank::new();
    let lane = rank.spawn(1, 0, 0);
    rank.launch(0, 1, 0).expect("the world's launch");
    lane.join()
        .expect("the lane's thread panicked")
        .expect("the lane's launch");
    assert!(!rank.marks.any(), "a mark outlived its launch");
    // Each launch: ncclSend, and at least two state queries.
    assert!(rank.api.calls(0) >= 3 && rank.api.calls(1) >= 3);
}

/// A launched op holds its buffer; the user drops the buffer while the
/// device completes the op and the end of the run (teardown) races both:
/// the buffer is freed only after the op completed (the fake buffer checks
/// in its `Drop`), and if the op had not completed at teardown, it is
/// leaked with its buffer rather than freed.
pub fn buffer_outlives_its_op() {
    let ledger = Arc::new(Ledger::<FakeOp>::default());
    let (buf, freed) = FakeBuf::new();
    let op = FakeOp::new(&buf, 0);
    let device = op.completion();
    let issuer = {
        let ledger = ledger.clone();
        thread::spawn(move || {
            ledger.record(vec![op]);
            // The user drops the buffer right after the send.
            drop(buf);
        })
    };
    let gpu = thread::spawn(move || device.complete());
    // A hang report's snapshot clones the pending ops, then drops them.
    drop(ledger.pending());
    issuer.join().expect("issuer panicked");
    // Teardown: what is still pending is leaked.
    let leaked = ledger.leak_pending();
    gpu.join().expect("device panicked");
    drop(ledger);
    let freed = freed.load(Ordering::SeqCst);
    assert_eq!(freed, leaked == 0, "freed: {freed}, leaked: {leaked}");
}

/// A `notify` races an `await_notify` whose deadline expires: the message
/// is consumed exactly once, by that wait or by a later one; never lost,
/// never taken twice. `timeout` is the wait's (under loom, the model's
/// clock decides when it expires).
pub fn post_races_timeout(timeout: Duration) {
    let board = Arc::new(LocalBoard::default());
    let poster = {
        let board = board.clone();
        thread::spawn(move || board.post(0, 1, "go"))
    };
    let taker = {
        let board = board.clone();
        thread::spawn(move || board.take(0, 1, "go", timeout))
    };
    board.expire_clock();
    poster.join().expect("poster panicked").expect("post");
    let took = taker.join().expect("taker panicked").expect("take");
    let later = board.take(0, 1, "go", Duration::ZERO).expect("take");
    assert!(took != later, "took: {took}, later: {later}");
    assert!(!board.take(0, 1, "go", Duration::ZERO).expect("take"));
}

/// Two waits race for one message while their deadlines expire: at most
/// one gets it, and if neither did it is still there.
pub fn two_takers_one_post(timeout: Duration) {
    let board = Arc::new(LocalBoard::default());
    let takers: Vec<_> = (0..2)
        .map(|_| {
            let board = board.clone();
            thread::spawn(move || board.take(0, 1, "go", timeout))
        })
        .collect();
    board.post(0, 1, "go").expect("post");
    board.expire_clock();
    let got = takers
        .into_iter()
        .map(|t| t.join().expect("taker panicked").expect("take"))
        .filter(|&t| t)
        .count();
    let left = board.take(0, 1, "go", Duration::ZERO).expect("take");
    assert_eq!(got + usize::from(left), 1, "got {got}, left {left}");
}

/// A hang report is taken while another thread is halfway through a group
/// of two sends on two communicators, and aborts the communicators of what
/// it found pending, and the watchdog aborts the first one: the snapshot
/// holds the whole group or none of it (P7), the issuing thread completes
/// or gets [`Error::Aborted`], no handle is used after it was freed, and
/// each is freed exactly once.
pub fn snapshot_during_group() {
    let api = FakeNccl::new(&[false, false], false);
    let lock = Arc::new(IssueLock::default());
    // SAFETY: communicators 0 and 1 of the fake are live, one cell each.
    let cells = Arc::new(unsafe {
        [
            CommCell::new(api.clone(), 0, "a"),
            CommCell::new(api.clone(), 1, "b"),
        ]
    });
    let ledger = Arc::new(Ledger::<FakeOp>::default());
    let (buf, _freed) = FakeBuf::new();
    let issuer = {
        let (lock, cells, ledger) = (lock.clone(), cells.clone(), ledger.clone());
        thread::spawn(move || {
            let r = issue(&lock, &[&cells[0], &cells[1]]);
            if r.is_ok() {
                ledger.record(vec![FakeOp::new(&buf, 0), FakeOp::new(&buf, 1)]);
            }
            r
        })
    };
    // The hang report.
    let snap = ledger.pending();
    assert!(
        snap.is_empty() || snap.len() == 2,
        "a snapshot holds {} ops of a group of 2",
        snap.len()
    );
    for op in &snap {
        cells[op.comm].abort();
    }
    // The watchdog.
    cells[0].abort();
    let r = issuer.join().expect("the issuing thread panicked");
    aborted_or_ok(&r);
    for op in ledger.pending() {
        op.completion().complete();
    }
    drop(cells);
    assert_eq!((api.frees(0), api.frees(1)), (1, 1));
}

/// The watchdog and the rank's teardown abort a rank's communicators at
/// once, each with a kernel in flight that waits for a peer that died:
/// every communicator is freed exactly once, and no free waits for a
/// kernel that nothing told to stop (P8; the fake panics where a device
/// synchronization would wait for ever).
pub fn abort_all_with_kernels_in_flight() {
    let api = FakeNccl::new(&[false, false, false], false);
    // SAFETY: communicators 0..3 of the fake are live, one cell each.
    let cells: Arc<Vec<CommCell<FakeNccl>>> = Arc::new(unsafe {
        (0..3)
            .map(|c| CommCell::new(api.clone(), c, "lane"))
            .collect()
    });
    for c in 0..3 {
        api.launch_kernel(c);
    }
    let watchdog = {
        let cells = cells.clone();
        thread::spawn(move || super::abort_all(&cells.iter().collect::<Vec<_>>()))
    };
    let mut both = super::abort_all(&cells.iter().collect::<Vec<_>>());
    both.extend(watchdog.join().expect("the watchdog panicked"));
    both.sort_unstable();
    assert_eq!(both, [0, 1, 2], "each communicator aborted by one caller");
    for (i, c) in cells.iter().enumerate() {
        assert_eq!(c.phase(), Phase::Freed);
        assert_eq!(api.frees(i), 1);
    }
}

/// P5 with P8: a thread is blocked inside a blocking `ncclGroupEnd` of two
/// lanes whose kernels wait for a peer that died, and the world
/// communicator is unheld. The watchdog aborts all of them (nothing is
/// freed yet: a free would wait for the lanes' kernels, whose flags NCCL
/// 2.28 cannot raise without freeing), then frees the blocked lanes
/// (`force_free`, as after its grace): the last of the batch frees all
/// three together. No free waits for a kernel that nothing told to stop,
/// each is freed once, and the issuing thread ends with an error.
pub fn watchdog_frees_a_blocked_group_with_kernels() {
    let blocking = [false, true, true];
    let api = FakeNccl::new(&blocking, false);
    let lock = Arc::new(IssueLock::default());
    // SAFETY: communicators 0..3 of the fake are live, one cell each.
    let cells: Arc<Vec<CommCell<FakeNccl>>> = Arc::new(unsafe {
        (0..3)
            .map(|c| CommCell::new(api.clone(), c, "lane").blocking(blocking[c]))
            .collect()
    });
    api.launch_kernel(1);
    api.launch_kernel(2);
    let issuer = {
        let (lock, cells) = (lock.clone(), cells.clone());
        thread::spawn(move || issue(&lock, &[&cells[1], &cells[2]]))
    };
    // The watchdog: the deadline passed (the call is blocked).
    while !api.blocked(1) {
        thread::yield_now();
    }
    let all: Vec<&CommCell<FakeNccl>> = cells.iter().collect();
    assert_eq!(super::abort_all(&all), [0, 1, 2]);
    // ... and the grace after it.
    for c in cells.iter() {
        // SAFETY: the fake says the call is blocked inside it; its holds
        // are all inside NCCL.
        unsafe { c.force_free() };
    }
    let r = issuer.join().expect("the issuing thread panicked");
    assert!(matches!(r, Err(Error::Aborted(_))), "{r:?}");
    for (i, c) in cells.iter().enumerate() {
        assert_eq!(c.phase(), Phase::Freed);
        assert_eq!(api.frees(i), 1);
    }
}
