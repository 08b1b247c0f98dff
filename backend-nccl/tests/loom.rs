//! The concurrency protocol of `duplex_nccl::guard`, model-checked: loom
//! runs each scenario of `guard::scenarios` under every interleaving of
//! its threads, on the fake NCCL (those whose space is largest up to a
//! bound on preemptions, the `Some(..)` of each `model` call); and the
//! copy-engine lanes and the lane services of lanes made on first use, on
//! fakes of their own. The whole file runs in about three minutes on two
//! cores.
//!
//! ```console
//! RUSTFLAGS="--cfg loom" cargo test -p duplex-nccl --release --test loom
//! ```

#![cfg(loom)]

use std::time::Duration;

use duplex::{DType, Dir};
use duplex_nccl::copy::fake::Fake;
use duplex_nccl::copy::{CopyLane, IssueFailure, Ticket, TicketState};
use duplex_nccl::guard::scenarios::{self, Mode};
use loom::sync::Arc;
use loom::thread;

/// Message 0's recv issued (stream 2, into address 2), and a thread that
/// issues its send (stream 1, from address 1), which matches it and
/// enqueues the copy; the send may be refused if the lane was aborted.
fn recv_then_send(
    lane: &Arc<CopyLane<Fake>>,
) -> (
    std::sync::Arc<Ticket>,
    thread::JoinHandle<Result<std::sync::Arc<Ticket>, IssueFailure>>,
) {
    let r = lane
        .issue(Dir::Recv, &2, 2, 8, DType::U8, "recv", Box::new(()))
        .expect("the recv");
    let lane = lane.clone();
    let sender =
        thread::spawn(move || lane.issue(Dir::Send, &1, 1, 8, DType::U8, "send", Box::new(())));
    (r, sender)
}

/// A copy-engine lane on a fake device with one flag slot (so that
/// messages share it), holding `memory` (address, bytes).
fn one_slot_lane(memory: &[(u64, Vec<u8>)]) -> (Fake, Arc<CopyLane<Fake>>) {
    let fake = Fake::with_slots(1);
    for (ptr, bytes) in memory {
        fake.put(*ptr, bytes.clone());
    }
    let lane = Arc::new(CopyLane::new("copy:0->1", fake.clone()));
    (fake, lane)
}

/// A thread that aborts `lane` for `why` (a deadline, a peer's failure).
fn abort_on_a_thread(lane: &Arc<CopyLane<Fake>>, why: &'static str) -> thread::JoinHandle<()> {
    let lane = lane.clone();
    thread::spawn(move || lane.abort(why))
}

/// Runs `f` under loom, every interleaving (with at most `preemptions`
/// preemptions, if given), and prints how many executions that was.
fn model(name: &str, preemptions: Option<usize>, f: impl Fn() + Sync + Send + 'static) {
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = runs.clone();
    let mut b = loom::model::Builder::new();
    b.preemption_bound = preemptions;
    let start = std::time::Instant::now();
    b.check(move || {
        counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        f()
    });
    eprintln!(
        "loom {name}: {} executions in {:.2} s",
        runs.load(std::sync::atomic::Ordering::Relaxed),
        start.elapsed().as_secs_f64()
    );
}

#[test]
fn the_watchdog_and_the_teardown_abort_a_ranks_communicators_together() {
    model("abort_all vs abort_all, kernels in flight", None, || {
        scenarios::abort_all_with_kernels_in_flight()
    });
}

#[test]
fn the_watchdog_frees_a_group_blocked_in_nccl_with_its_kernels() {
    model("blocked group vs abort_all + forced free", None, || {
        scenarios::watchdog_frees_a_blocked_group_with_kernels()
    });
}

#[test]
fn issue_races_abort_on_a_non_blocking_communicator() {
    model("issue vs abort, non-blocking", None, || {
        scenarios::issue_races_abort(Mode::NonBlocking)
    });
}

#[test]
fn issue_blocked_in_nccl_races_abort_with_revoke() {
    model("issue blocked vs abort, revoke", None, || {
        scenarios::issue_races_abort(Mode::BlockedRevoke)
    });
}

#[test]
fn issue_blocked_in_nccl_races_the_watchdogs_forced_free() {
    model("issue blocked vs abort, forced free", None, || {
        scenarios::issue_races_abort(Mode::BlockedForce)
    });
}

#[test]
fn the_watchdogs_forced_free_waits_for_a_state_query() {
    model("forced free vs state query", Some(3), || {
        scenarios::forced_free_races_a_query()
    });
}

#[test]
fn two_issuers_never_overlap_in_nccl() {
    model("two issuers and a poller", Some(3), scenarios::two_issuers);
}

#[test]
fn a_launch_in_its_handshake_holds_back_only_its_parts() {
    model(
        "three launches ended in the background",
        Some(2),
        scenarios::handshake_beside_launches,
    );
}

#[test]
fn a_launch_in_its_handshake_holds_its_stream() {
    model(
        "two launches on one stream, ended in the background",
        None,
        scenarios::handshake_holds_its_stream,
    );
}

#[test]
fn a_buffer_is_freed_only_after_its_op() {
    model("buffer vs op", None, scenarios::buffer_outlives_its_op);
}

#[test]
fn a_post_racing_a_timeout_is_taken_once() {
    model("post vs timeout", None, || {
        scenarios::post_races_timeout(Duration::from_secs(1))
    });
}

#[test]
fn a_post_racing_two_timeouts_is_taken_once() {
    model("two takers, one post", None, || {
        scenarios::two_takers_one_post(Duration::from_secs(1))
    });
}

#[test]
fn a_hang_snapshot_sees_whole_groups() {
    model(
        "snapshot during a group",
        None,
        scenarios::snapshot_during_group,
    );
}

/// A copy-engine lane (`duplex_nccl::copy`) with one flag slot: message 0
/// (a send and its recv, issued on two threads; the sender then issues
/// message 1, which waits on the same slot) while a third thread aborts the
/// lane and a fourth enqueues and runs the copy (its slot write landing
/// after its done event) and settles. Whatever the interleaving: an op is
/// delivered only if its bytes are in the recv buffer, both ops of message
/// 0 end in the same state, and once the device has run and the lane
/// settled, no stream is left waiting (message 1's send included, which a
/// late write of message 0's generation would block again).
#[test]
fn a_copy_lane_never_reports_bytes_that_did_not_arrive() {
    model("copy lane: send, recv, abort, device", Some(2), || {
        let (fake, lane) = one_slot_lane(&[(1, vec![9; 8])]);
        let issue = |dir: Dir, stream: u32, ptr: u64, then: bool| {
            let lane = lane.clone();
            let fake = fake.clone();
            thread::spawn(move || {
                let t = lane
                    .issue(dir, &stream, ptr, 8, DType::U8, dir.name(), Box::new(()))
                    .ok()?;
                lane.settle().expect("the fake reports no device error");
                if t.state() == TicketState::Delivered {
                    assert_eq!(fake.get(2), vec![9; 8], "delivered before the bytes");
                }
                if then {
                    // Message 1, on the same slot; its recv never comes.
                    let _ = lane.issue(dir, &stream, ptr, 8, DType::U8, "send 1", Box::new(()));
                }
                Some(t)
            })
        };
        let s = issue(Dir::Send, 1, 1, true);
        let r = issue(Dir::Recv, 2, 2, false);
        let aborter = abort_on_a_thread(&lane, "deadline");
        let device = {
            let (lane, fake) = (lane.clone(), fake.clone());
            thread::spawn(move || {
                // As on the device: the copy's done event completes just
                // before its slot write lands.
                lane.pump();
                fake.run_done_only(1);
                lane.settle().expect("the fake reports no device error");
                fake.land_writes();
            })
        };
        let (s, r) = (s.join().unwrap(), r.join().unwrap());
        aborter.join().unwrap();
        device.join().unwrap();
        lane.pump();
        fake.run(usize::MAX);
        fake.land_writes();
        lane.settle().expect("no device error");
        for t in [&s, &r].into_iter().flatten() {
            if t.state() == TicketState::Delivered {
                assert_eq!(fake.get(2), vec![9; 8], "delivered without the bytes");
            }
        }
        if let (Some(s), Some(r)) = (&s, &r) {
            assert_eq!(s.state(), r.state());
        }
        assert!(
            fake.released(1) && fake.released(2),
            "a stream is left waiting"
        );
    });
}

/// A copy-engine lane's write releases the user streams only once the
/// lane knows the copy: a recv is issued, then its send on another thread
/// (which matches it and enqueues the copy), while a third thread runs the
/// device and, if the recv's stream is released, settles the lane as a
/// rank's wait does. Whatever the interleaving, a released stream finds its
/// op delivered: were the write enqueued with the copy, before the lane
/// registered it, the wait would find the op still copying and call its
/// bytes lost.
#[test]
fn a_copy_lane_releases_a_stream_only_once_it_knows_the_copy() {
    model("copy lane: release after registration", None, || {
        let (fake, lane) = one_slot_lane(&[(1, vec![4; 8])]);
        let (r, sender) = recv_then_send(&lane);
        let device = {
            let (lane, fake, r) = (lane.clone(), fake.clone(), r.clone());
            thread::spawn(move || {
                fake.run(1);
                if fake.released(2) {
                    lane.settle().expect("the fake reports no device error");
                    assert_eq!(r.state(), TicketState::Delivered, "released while unknown");
                    assert_eq!(fake.get(2), vec![4; 8]);
                }
            })
        };
        sender.join().unwrap().expect("the send");
        device.join().unwrap();
    });
}

/// A copy-engine lane aborted while a message's copy is being enqueued
/// (between its copy and its slot write, or before either), with the
/// device running: both streams end released, and the recv is either
/// delivered with its bytes or failed.
#[test]
fn a_copy_lane_aborted_between_its_copy_and_its_release_leaves_no_stream_waiting() {
    model("copy lane: abort vs copy and release", Some(3), || {
        let (fake, lane) = one_slot_lane(&[(1, vec![4; 8])]);
        let (r, sender) = recv_then_send(&lane);
        let aborter = abort_on_a_thread(&lane, "deadline");
        let device = {
            let fake = fake.clone();
            thread::spawn(move || {
                fake.run(1);
            })
        };
        let _ = sender.join().unwrap();
        aborter.join().unwrap();
        device.join().unwrap();
        fake.run(usize::MAX);
        lane.settle().expect("no device error");
        assert!(
            fake.released(1) && fake.released(2),
            "a stream is left waiting"
        );
        match r.state() {
            TicketState::Delivered => assert_eq!(fake.get(2), vec![4; 8]),
            TicketState::Failed(_) => {}
            s => panic!("the recv ended {s:?}"),
        }
    });
}

/// Two aborts of one lane at once (a deadline, and a settle or mismatch
/// that aborts it too), with a message matched: whatever the interleaving,
/// no release comes before the other side was told why (across processes
/// a stream let go would find no reason), and both streams end released.
#[test]
fn a_copy_lane_aborted_twice_at_once_tells_why_before_any_release() {
    model("copy lane: two aborts", Some(3), || {
        let (fake, lane) = one_slot_lane(&[(1, vec![2; 8])]);
        let (_r, sender) = recv_then_send(&lane);
        let aborts: Vec<_> = ["deadline", "rank 1 failed"]
            .into_iter()
            .map(|why| abort_on_a_thread(&lane, why))
            .collect();
        let _ = sender.join().unwrap();
        for a in aborts {
            a.join().unwrap();
        }
        assert!(!fake.released_untold(), "released before telling why");
        assert!(fake.told().is_some());
        fake.run(usize::MAX);
        lane.settle().expect("no device error");
        assert!(
            fake.released(1) && fake.released(2),
            "a stream is left waiting"
        );
    });
}

/// A matched message held back (its sending process's ready event not yet
/// complete: `CopyApi::may_copy`) while the lane is aborted and another
/// thread pumps (as the lane's service does) once the event completes:
/// whatever the interleaving, the message is copied once with its bytes
/// and delivered, or failed and never copied; no job is left in the lane
/// and no stream waiting.
#[test]
fn a_copy_lane_message_held_back_races_an_abort_and_the_service() {
    model("copy lane: held back vs abort vs service", Some(3), || {
        let (fake, lane) = one_slot_lane(&[(1, vec![6; 8])]);
        fake.hold_copies(true);
        let (r, sender) = recv_then_send(&lane);
        let aborter = abort_on_a_thread(&lane, "deadline");
        let service = {
            let (lane, fake) = (lane.clone(), fake.clone());
            thread::spawn(move || {
                fake.hold_copies(false);
                lane.pump();
            })
        };
        let s = sender.join().unwrap();
        aborter.join().unwrap();
        service.join().unwrap();
        lane.pump();
        fake.run(usize::MAX);
        lane.settle().expect("no device error");
        assert_eq!(lane.copies_in_flight(), 0, "a job is left in the lane");
        assert!(fake.copies() <= 1, "copied twice");
        assert!(
            fake.released(1) && fake.released(2),
            "a stream is left waiting"
        );
        match r.state() {
            TicketState::Delivered => {
                assert_eq!(fake.get(2), vec![6; 8]);
                assert_eq!(fake.copies(), 1);
            }
            TicketState::Failed(_) => {}
            s => panic!("the recv ended {s:?}"),
        }
        if let Ok(s) = s {
            assert_eq!(s.state(), r.state());
        }
    });
}

/// Two messages on one flag slot, their copies enqueued by the sending
/// thread (inline) and the lane's service (`pump`) at once, the device
/// running meanwhile: copies and slot writes stay in message order (the
/// fake refuses a slot that goes down), a stream released finds its op
/// delivered, and both messages arrive.
#[test]
fn a_copy_lanes_service_and_an_inline_pump_keep_message_order_on_a_shared_slot() {
    model(
        "copy lane: service vs inline pump, one slot",
        Some(3),
        || {
            let (fake, lane) = one_slot_lane(&[(1, vec![4; 8]), (3, vec![5; 8])]);
            let r0 = lane
                .issue(Dir::Recv, &2, 2, 8, DType::U8, "recv 0", Box::new(()))
                .expect("recv 0");
            let r1 = lane
                .issue(Dir::Recv, &4, 4, 8, DType::U8, "recv 1", Box::new(()))
                .expect("recv 1");
            let sender = {
                let lane = lane.clone();
                thread::spawn(move || {
                    lane.issue(Dir::Send, &1, 1, 8, DType::U8, "send 0", Box::new(()))
                        .expect("send 0");
                    lane.issue(Dir::Send, &3, 3, 8, DType::U8, "send 1", Box::new(()))
                        .expect("send 1");
                })
            };
            let service = {
                let lane = lane.clone();
                thread::spawn(move || {
                    lane.pump();
                })
            };
            let device = {
                let (fake, lane, r0) = (fake.clone(), lane.clone(), r0.clone());
                thread::spawn(move || {
                    fake.run(1);
                    if fake.released(2) {
                        lane.settle().expect("no device error");
                        assert_eq!(r0.state(), TicketState::Delivered, "released while unknown");
                    }
                })
            };
            sender.join().unwrap();
            service.join().unwrap();
            device.join().unwrap();
            lane.pump();
            fake.run(usize::MAX);
            lane.settle().expect("no device error");
            assert_eq!(r0.state(), TicketState::Delivered);
            assert_eq!(r1.state(), TicketState::Delivered);
            assert_eq!((fake.get(2), fake.get(4)), (vec![4; 8], vec![5; 8]));
            assert!(fake.released(1) && fake.released(2) && fake.released(4));
        },
    );
}

/// The lane services of two ranks (`duplex_nccl::lanes`) on a fake NCCL
/// that wakes a service when its part can go on: both ranks need lane
/// 0->1 at once (rank 0 to send, rank 1 to receive), under every
/// interleaving of the two host threads and the two services (up to a
/// bound on preemptions). Both needs are met, from one unique id, each
/// rank publishes the lane once, and nothing is abandoned.
mod lane_service {
    use super::*;
    use duplex::{Policy, Rank, Result};
    use duplex_nccl::board::{Board, LocalBoard};
    use duplex_nccl::lanes::{LaneKit, LaneMaker, LaneMsg, LaneSpec};
    use loom::sync::Mutex;

    #[derive(Default)]
    pub(super) struct Fabric {
        started: Mutex<Vec<(Rank, Vec<u8>)>>,
        published: Mutex<Vec<Rank>>,
        abandoned: Mutex<Vec<Rank>>,
        ids: Mutex<u8>,
    }

    pub(super) struct Kit {
        pub(super) me: Rank,
        pub(super) board: std::sync::Arc<LocalBoard>,
        pub(super) fabric: Arc<Fabric>,
    }

    impl LaneKit for Kit {
        type Part = Vec<u8>;

        fn new_id(&self) -> Result<Vec<u8>> {
            let mut n = self.fabric.ids.lock().expect("not poisoned");
            *n += 1;
            Ok(vec![*n])
        }

        fn start(&self, lane: &LaneSpec, id: &[u8]) -> Result<Vec<u8>> {
            self.fabric
                .started
                .lock()
                .expect("not poisoned")
                .push((self.me, id.to_vec()));
            // The other rank's part may now go on: wake its service.
            self.board
                .mail(lane.other(self.me), &LaneMsg::Wake.encode())?;
            Ok(id.to_vec())
        }

        fn advance(&self, lane: &LaneSpec, part: &mut Vec<u8>) -> Result<bool> {
            let started = self.fabric.started.lock().expect("not poisoned");
            let other = lane.other(self.me);
            Ok(started.iter().any(|(r, id)| *r == other && id == part))
        }

        fn publish(&self, _: &LaneSpec, _: Vec<u8>) {
            self.fabric
                .published
                .lock()
                .expect("not poisoned")
                .push(self.me);
        }

        fn abandon(&self, _: &LaneSpec, _: Vec<u8>) {
            self.fabric
                .abandoned
                .lock()
                .expect("not poisoned")
                .push(self.me);
        }

        fn failed(&self) -> Option<(Rank, String)> {
            None
        }
    }

    pub(super) fn both_ranks_need_one_lane() {
        let board = std::sync::Arc::new(LocalBoard::default());
        let fabric = Arc::new(Fabric::default());
        let makers: Vec<std::sync::Arc<LaneMaker<Kit>>> = (0..2)
            .map(|me| {
                std::sync::Arc::new(LaneMaker::new(
                    me,
                    2,
                    Policy::PerDirection,
                    Duration::from_secs(3600),
                    board.clone() as std::sync::Arc<dyn Board>,
                    Kit {
                        me,
                        board: board.clone(),
                        fabric: fabric.clone(),
                    },
                ))
            })
            .collect();
        let services: Vec<_> = makers
            .iter()
            .map(|m| {
                let m = m.clone();
                thread::spawn(move || m.serve())
            })
            .collect();
        let m1 = makers[1].clone();
        let host1 = thread::spawn(move || {
            let lane = m1.spec(0, Dir::Recv).expect("a lane");
            m1.need(&lane)
        });
        let lane = makers[0].spec(1, Dir::Send).expect("a lane");
        makers[0].need(&lane).expect("rank 0's need is met");
        host1
            .join()
            .expect("no panic")
            .expect("rank 1's need is met");
        for m in &makers {
            m.stop();
        }
        for s in services {
            s.join().expect("the service ends");
        }
        let started = fabric.started.lock().expect("not poisoned").clone();
        assert_eq!(started.len(), 2, "one part per rank: {started:?}");
        assert_eq!(started[0].1, started[1].1, "one unique id");
        let mut published = fabric.published.lock().expect("not poisoned").clone();
        published.sort_unstable();
        assert_eq!(published, vec![0, 1]);
        assert!(fabric.abandoned.lock().expect("not poisoned").is_empty());
    }
}

#[test]
fn two_lane_services_make_a_lane_both_ranks_need_at_once() {
    model("two lane services, both needing one lane", Some(2), || {
        lane_service::both_ranks_need_one_lane()
    });
}

/// Completion fences (`duplex_nccl::fence`): an issuing thread launches and
/// attaches (recording the fence itself every `every` launches) while the
/// device completes launch 1, another thread asks whether launch 1's fence
/// is done, and, if `flusher`, a third flushes the stream as `synchronize`
/// does (a flush records what is open, which can hide a fence that
/// answered too early, so the race is also run without it). Whatever the
/// order: no fence says done before every launch attached to it completed;
/// every fence, once recorded, covers each launch that attached to it; and
/// the fences of the stream are recorded in the order of their positions.
fn fences_race(every: u32, flusher: bool) {
    use duplex_nccl::fence::Fences;
    use duplex_nccl::fence::fake::Counter;

    let c = Arc::new(Counter::default());
    let f = Fences::new(c.clone(), 0, every);
    c.launch();
    let first = Fences::attach(&f).expect("attach 1");
    let asker = {
        let first = first.clone();
        thread::spawn(move || first.done())
    };
    let device = {
        let c = c.clone();
        thread::spawn(move || c.complete_to(1))
    };
    let flusher = flusher.then(|| {
        let f = f.clone();
        thread::spawn(move || f.flush().expect("flush"))
    });
    let issuer = {
        let (c, f) = (c.clone(), f.clone());
        thread::spawn(move || {
            let n = c.launch();
            (n, Fences::attach(&f).expect("attach 2"))
        })
    };
    let asked = asker.join().expect("the asker panicked");
    device.join().expect("the device panicked");
    if let Some(flusher) = flusher {
        flusher.join().expect("the flusher panicked");
    }
    let (n, second) = issuer.join().expect("the issuer panicked");
    assert_eq!(n, 2);
    if asked {
        assert_eq!(
            first.covers(),
            Some(1),
            "done while launch 2 was attached to it"
        );
    }
    // Launch 2 is not complete: no answer may say its fence is done.
    assert!(!second.done(), "launch 2 is not complete");
    f.flush().expect("flush");
    for (launch, fence) in [(1, &first), (2, &second)] {
        assert!(fence.sealed());
        assert!(
            fence.covers().is_some_and(|c| c >= launch),
            "a fence recorded before launch {launch} that attached to it"
        );
    }
    let (p1, p2) = (first.queue().1, second.queue().1);
    assert!(p1 <= p2);
    if p1 < p2 {
        assert!(
            first.covers() <= second.covers(),
            "recorded out of position order"
        );
    }
    if first.covers() == Some(1) {
        assert!(
            first.done(),
            "recorded after launch 1 only, which completed"
        );
    }
    c.complete_to(2);
    assert!(first.done() && second.done());
}

#[test]
fn a_completion_fence_covers_every_launch_attached_to_it() {
    model("fences: attach vs done vs device", None, || {
        fences_race(100, false)
    });
    // Four threads: bounded, as the largest scenario above.
    model("fences: attach vs done vs device vs flush", Some(3), || {
        fences_race(100, true)
    });
    model("fences: attach records every launch", Some(3), || {
        fences_race(1, true)
    });
    model(
        "fences: attach records every second launch",
        Some(2),
        || fences_race(2, true),
    );
}
