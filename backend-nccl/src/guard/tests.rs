//! The protocol on the fake NCCL, on real threads: each step of it alone,
//! then the races of [`super::scenarios`] many times (loom explores them
//! exhaustively: `tests/loom.rs`).

use std::time::Duration;

use duplex::Error;

use super::fake::{FakeBuf, FakeNccl, FakeOp};
use super::scenarios::{self, Mode};
use super::{CommCell, IssueLock, Ledger, Phase};

fn cell(api: &FakeNccl, c: usize) -> CommCell<FakeNccl> {
    // SAFETY: every test gives each fake communicator one cell.
    unsafe { CommCell::new(api.clone(), c, "lane") }
}

#[test]
fn an_unheld_communicator_is_freed_by_its_abort() {
    let api = FakeNccl::new(&[false], false);
    let c = cell(&api, 0);
    assert!(c.abort());
    assert_eq!(c.phase(), Phase::Freed);
    assert_eq!(api.frees(0), 1);
    assert!(!c.abort(), "abort is idempotent");
    assert!(matches!(c.enter(), Err(Error::Aborted(_))));
    drop(c);
    assert_eq!(
        api.frees(0),
        1,
        "dropping an aborted cell frees nothing more"
    );
}

#[test]
#[should_panic(expected = "NVIDIA/nccl#564")]
fn aborting_one_at_a_time_with_kernels_in_flight_hangs_on_real_nccl() {
    // What the fake's check catches: the first free waits for the other
    // communicator's kernel, which is told to stop only by the second abort.
    let api = FakeNccl::new(&[false, false], false);
    let (a, b) = (cell(&api, 0), cell(&api, 1));
    api.launch_kernel(0);
    api.launch_kernel(1);
    a.abort();
    b.abort();
}

#[test]
fn abort_all_frees_nothing_while_a_held_one_cannot_be_stopped() {
    // NCCL 2.28 cannot stop a held communicator's kernel without freeing
    // it: freeing the others first would wait for that kernel (P8).
    let api = FakeNccl::new(&[false, false, false], false);
    let cells: Vec<_> = (0..3).map(|i| cell(&api, i)).collect();
    for i in 0..3 {
        api.launch_kernel(i);
    }
    let held = cells[1].enter().unwrap();
    let refs: Vec<&CommCell<FakeNccl>> = cells.iter().collect();
    assert_eq!(super::abort_all(&refs), [0, 1, 2]);
    assert_eq!((api.frees(0), api.frees(1), api.frees(2)), (0, 0, 0));
    assert!(matches!(held.async_error(), Err(Error::Aborted(_))));
    assert!(matches!(cells[0].enter(), Err(Error::Aborted(_))));
    // The last holder leaves: the whole batch is freed, flags first.
    drop(held);
    assert_eq!((api.frees(0), api.frees(1), api.frees(2)), (1, 1, 1));
    assert!(super::abort_all(&refs).is_empty(), "idempotent");
}

#[test]
fn a_groups_holds_released_one_by_one_free_the_batch_once() {
    // One thread holds both communicators of a group, each with a kernel
    // in flight, when the watchdog aborts them; it drops its holds in
    // turn: the first leaves its communicator to the batch, the second
    // frees both together (alone, the first free would wait for the
    // second's kernel, which only the thread's next drop would stop).
    let api = FakeNccl::new(&[false, false], false);
    let cells: Vec<_> = (0..2).map(|i| cell(&api, i)).collect();
    api.launch_kernel(0);
    api.launch_kernel(1);
    let mut held: Vec<_> = cells.iter().map(|c| c.enter().unwrap()).collect();
    let refs: Vec<&CommCell<FakeNccl>> = cells.iter().collect();
    assert_eq!(super::abort_all(&refs), [0, 1]);
    drop(held.remove(0));
    assert_eq!((api.frees(0), api.frees(1)), (0, 0));
    drop(held);
    assert_eq!((api.frees(0), api.frees(1)), (1, 1));
}

#[test]
fn the_watchdog_frees_a_blocked_group_on_threads() {
    for _ in 0..100 {
        scenarios::watchdog_frees_a_blocked_group_with_kernels();
    }
}

#[test]
fn the_watchdog_and_the_teardown_abort_together_on_threads() {
    for _ in 0..200 {
        scenarios::abort_all_with_kernels_in_flight();
    }
}

#[test]
fn a_held_communicator_is_freed_by_its_last_holder() {
    let api = FakeNccl::new(&[false], false);
    let c = cell(&api, 0);
    let (a, b) = (c.enter().unwrap(), c.enter().unwrap());
    assert!(a.async_error().unwrap());
    assert!(c.abort());
    assert_eq!(c.phase(), Phase::Aborted);
    assert_eq!(api.frees(0), 0, "not freed under its holders");
    let calls = api.calls(0);
    assert!(matches!(a.async_error(), Err(Error::Aborted(_))));
    assert_eq!(
        api.calls(0),
        calls,
        "a call after the abort never reaches NCCL"
    );
    drop(a);
    assert_eq!(api.frees(0), 0);
    drop(b);
    assert_eq!(api.frees(0), 1);
    assert_eq!(c.phase(), Phase::Freed);
}

#[test]
fn a_live_communicator_is_freed_when_dropped() {
    let api = FakeNccl::new(&[false], false);
    drop(cell(&api, 0));
    assert_eq!(api.frees(0), 1);
}

#[test]
fn force_free_waits_for_every_holder_to_be_inside_nccl() {
    let api = FakeNccl::new(&[false], false);
    let c = cell(&api, 0);
    // SAFETY (each force_free below): the fake has no real handle.
    assert!(
        !unsafe { c.force_free() },
        "a live communicator is not forced"
    );
    let h = c.enter().unwrap();
    c.abort();
    assert!(
        !unsafe { c.force_free() },
        "a holder outside NCCL could be about to use the handle"
    );
    drop(h);
    assert_eq!(api.frees(0), 1);
    assert!(!unsafe { c.force_free() }, "freed once");
}

#[test]
fn a_group_ends_even_when_an_op_fails() {
    let api = FakeNccl::new(&[false, false], false);
    let (a, b) = (cell(&api, 0), cell(&api, 1));
    let lock = IssueLock::default();
    let issuing = lock.lock();
    let held = vec![a.enter().unwrap(), b.enter().unwrap()];
    let r = issuing.group(&api, &held, || {
        // SAFETY: fake buffers; the issue lock is held.
        unsafe { held[0].send(1, 1, 0, 1, 0) }?;
        b.abort();
        // SAFETY: as above.
        unsafe { held[1].send(1, 1, 0, 1, 0) }?;
        Ok(())
    });
    assert!(matches!(r, Err(Error::Aborted(_))), "{r:?}");
    assert!(lock.busy_for().is_none(), "the group's call is over");
    // The fake panics on a second ncclGroupStart while one is open: the
    // failed group was closed.
    let end = issuing.group(&api, &held[..1], || Ok(())).unwrap();
    assert!(end.unwrap());
    drop(held);
    assert_eq!(api.frees(1), 1, "freed once its group let go");
}

#[test]
fn the_ledger_records_launches_whole_and_keeps_running_ops() {
    let ledger = Ledger::<FakeOp>::default();
    let (buf, freed) = FakeBuf::new();
    let ops = vec![FakeOp::new(&buf, 0), FakeOp::new(&buf, 1)];
    let done: Vec<_> = ops.iter().map(FakeOp::completion).collect();
    ledger.record(ops);
    drop(buf);
    assert_eq!(ledger.pending().len(), 2);
    done[0].complete();
    assert_eq!(ledger.pending().len(), 1);
    // The ledger is dropped with an op still running: its buffer is leaked
    // (the fake buffer panics if freed under a running op).
    drop(ledger);
    assert!(!freed.load(std::sync::atomic::Ordering::SeqCst));
}

#[test]
fn the_ledger_frees_buffers_of_completed_ops() {
    let ledger = Ledger::<FakeOp>::default();
    let (buf, freed) = FakeBuf::new();
    let op = FakeOp::new(&buf, 0);
    let done = op.completion();
    ledger.record(vec![op]);
    drop(buf);
    done.complete();
    assert!(ledger.pending().is_empty());
    assert!(freed.load(std::sync::atomic::Ordering::SeqCst));
    assert_eq!(ledger.leak_pending(), 0);
}

#[test]
fn the_watchdog_sees_a_call_in_progress() {
    let lock = IssueLock::default();
    assert!(lock.busy_for().is_none());
    let issuing = lock.lock();
    let busy = issuing.busy();
    assert!(lock.busy_for().is_some());
    drop(busy);
    assert!(lock.busy_for().is_none());
}

const RUNS: usize = 300;

#[test]
fn issues_racing_aborts_on_threads() {
    for mode in [Mode::NonBlocking, Mode::BlockedRevoke, Mode::BlockedForce] {
        for _ in 0..RUNS {
            scenarios::issue_races_abort(mode);
        }
    }
}

#[test]
fn forced_free_racing_a_query_on_threads() {
    for _ in 0..RUNS {
        scenarios::forced_free_races_a_query();
    }
}

#[test]
fn two_issuers_on_threads() {
    for _ in 0..RUNS {
        scenarios::two_issuers();
    }
}

#[test]
fn handshakes_beside_launches_on_threads() {
    for _ in 0..RUNS {
        scenarios::handshake_beside_launches();
    }
}

#[test]
fn a_handshake_holds_its_stream_on_threads() {
    for _ in 0..RUNS {
        scenarios::handshake_holds_its_stream();
    }
}

#[test]
fn buffers_outlive_their_ops_on_threads() {
    for _ in 0..RUNS {
        scenarios::buffer_outlives_its_op();
    }
}

#[test]
fn board_posts_racing_timeouts_on_threads() {
    for i in 0..RUNS {
        let t = Duration::from_micros((i % 7) as u64 * 20);
        scenarios::post_races_timeout(t);
        scenarios::two_takers_one_post(t);
    }
}

#[test]
fn snapshots_during_groups_on_threads() {
    for _ in 0..RUNS {
        scenarios::snapshot_during_group();
    }
}

/// An op of a queue, counting the queries of its completion.
#[derive(Clone, Debug)]
struct Queued {
    queue: usize,
    position: u64,
    done: bool,
    asked: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl super::Done for Queued {
    fn done(&self) -> bool {
        self.asked
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.done
    }

    fn queue(&self) -> Option<(usize, u64)> {
        Some((self.queue, self.position))
    }

    fn mark_done(&self) {
        // Only an op that is done may be told so.
        assert!(self.done, "an op not done was marked done");
        MARKED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Ops told they are done by a pruning (tests share the counter: they read
/// it only as a lower bound).
static MARKED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn queued(
    asked: &std::sync::Arc<std::sync::atomic::AtomicUsize>,
    ops: &[(usize, bool)],
) -> Vec<Queued> {
    let mut next = [0u64; 4];
    ops.iter()
        .map(|&(queue, done)| {
            next[queue] += 1;
            Queued {
                queue,
                position: next[queue],
                done,
                asked: asked.clone(),
            }
        })
        .collect()
}

#[test]
fn pruning_bisects_each_queue() {
    let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // Queue 0: 3 done, then 101 not done; queue 1: 1 done, 2 not done.
    let mut spec = vec![(0, true), (1, true), (0, true), (0, true)];
    spec.extend((0..101).map(|_| (0, false)));
    spec.extend([(1, false), (1, false)]);
    let ledger = Ledger::default();
    ledger.record(queued(&asked, &spec));
    let left = ledger.pending();
    assert_eq!(left.len(), 103, "the completed ones leave, the rest stay");
    assert!(left.iter().all(|o| !o.done));
    // About log2 of each queue's length: 104 ops, 7 questions; 3 ops, 2.
    let n = asked.load(std::sync::atomic::Ordering::Relaxed);
    assert!(n <= 7 + 2, "{n} questions");
}

#[test]
fn pruning_a_queue_whose_ops_are_all_done_empties_it() {
    let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let spec: Vec<(usize, bool)> = (0..300).map(|i| (i % 2, true)).collect();
    let ledger = Ledger::default();
    ledger.record(queued(&asked, &spec));
    assert!(ledger.pending().is_empty());
    // 300 ops reach the pruning (at 256): a bisection of 150 per queue.
    let n = asked.load(std::sync::atomic::Ordering::Relaxed);
    assert!(n <= 2 * 8, "{n} questions");
    // Each dropped op was told it is done, so it never asks again.
    assert!(MARKED.load(std::sync::atomic::Ordering::Relaxed) >= 300);
}

#[test]
fn pruning_never_drops_an_op_that_no_later_op_of_its_queue_vouches_for() {
    // Whatever the done pattern of one queue (done on a prefix, as the
    // device guarantees), exactly the prefix leaves.
    for done in 0..=20 {
        let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let spec: Vec<(usize, bool)> = (0..20).map(|i| (0, i < done)).collect();
        let ledger = Ledger::default();
        ledger.record(queued(&asked, &spec));
        let left = ledger.pending();
        assert_eq!(left.len(), 20 - done);
        assert!(left.iter().all(|o| !o.done));
    }
}

#[test]
fn pruning_keeps_every_op_of_a_shared_position_together() {
    // Ops of one queue sharing positions (the launches attached to one
    // completion fence, `crate::fence`): positions 1..=5, four ops each,
    // done for positions up to `done`.
    for done in 0..=5u64 {
        let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let ops: Vec<Queued> = (1..=5u64)
            .flat_map(|p| {
                let asked = asked.clone();
                (0..4).map(move |_| Queued {
                    queue: 0,
                    position: p,
                    done: p <= done,
                    asked: asked.clone(),
                })
            })
            .collect();
        let ledger = Ledger::default();
        ledger.record(ops);
        let left = ledger.pending();
        assert_eq!(left.len() as u64, 4 * (5 - done), "done up to {done}");
        assert!(left.iter().all(|o| !o.done && o.position > done));
    }
}

/// A call queued while another thread holds the issue lock runs before
/// that thread lets the lock go (P1: queued calls run by whoever holds the
/// lock), not only when a `try_lock` of the queuing thread wins (found by
/// review: a rank launching back to back let the lane service's
/// `try_lock` win 2 times in 940, and a lane took seconds to be made).
#[test]
fn a_call_queued_while_the_lock_is_held_runs_before_it_is_let_go() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let lock = Arc::new(IssueLock::default());
    let ran = Arc::new(AtomicBool::new(false));
    let held = lock.lock();
    {
        let (lock, ran) = (lock.clone(), ran.clone());
        std::thread::spawn(move || {
            let r = ran.clone();
            lock.later(Box::new(move |_issuing| r.store(true, Ordering::Release)));
        })
        .join()
        .expect("queued");
    }
    assert!(!ran.load(Ordering::Acquire), "the lock is held: not yet");
    drop(held);
    assert!(
        ran.load(Ordering::Acquire),
        "run by the holder as it let go"
    );
    // With the lock free, a call queued runs at once.
    let again = Arc::new(AtomicBool::new(false));
    let a = again.clone();
    lock.later(Box::new(move |_| a.store(true, Ordering::Release)));
    assert!(again.load(Ordering::Acquire));
}
