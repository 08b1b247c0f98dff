//! The copy-engine lane's protocol on the CPU fake.

use std::sync::Arc;

use duplex::{DType, Dir, Error, ProgramErrorKind};

use super::fake::Fake;
use super::{CopyLane, SLOTS, TicketState};

/// Stream of the sending rank and of the receiving rank.
const S: u32 = 1;
const R: u32 = 2;

fn lane() -> (CopyLane<Fake>, Fake) {
    let fake = Fake::default();
    (CopyLane::new("copy:0->1", fake.clone()), fake)
}

fn keep() -> super::Keep {
    Box::new(())
}

fn send(
    l: &CopyLane<Fake>,
    ptr: u64,
    bytes: usize,
) -> Result<Arc<super::Ticket>, super::IssueFailure> {
    l.issue(
        Dir::Send,
        &S,
        ptr,
        bytes,
        DType::U8,
        &format!("send {bytes}"),
        keep(),
    )
}

fn recv(
    l: &CopyLane<Fake>,
    ptr: u64,
    bytes: usize,
) -> Result<Arc<super::Ticket>, super::IssueFailure> {
    l.issue(
        Dir::Recv,
        &R,
        ptr,
        bytes,
        DType::U8,
        &format!("recv {bytes}"),
        keep(),
    )
}

/// Message 0 of `l` issued on both sides (4 bytes, send at 1, recv at 2)
/// and its copy enqueued; returns what each side's `keep` holds, to count
/// who still holds it.
fn matched(l: &CopyLane<Fake>) -> (Arc<()>, Arc<()>) {
    let (a, b) = (Arc::new(()), Arc::new(()));
    l.issue(Dir::Send, &S, 1, 4, DType::U8, "send", Box::new(a.clone()))
        .expect("the send");
    l.issue(Dir::Recv, &R, 2, 4, DType::U8, "recv", Box::new(b.clone()))
        .expect("the recv");
    l.pump();
    (a, b)
}

#[test]
fn a_message_is_delivered_only_once_its_copy_is_done_whichever_side_comes_first() {
    for send_first in [true, false] {
        let (l, fake) = lane();
        fake.put(100, vec![7; 16]);
        let (s, r) = if send_first {
            let s = send(&l, 100, 16).unwrap();
            assert_eq!(s.state(), TicketState::Waiting);
            assert!(!fake.released(S), "a send blocks its stream until its copy");
            (s, recv(&l, 200, 16).unwrap())
        } else {
            let r = recv(&l, 200, 16).unwrap();
            (send(&l, 100, 16).unwrap(), r)
        };
        // The thread that matched it enqueued the copy.
        assert_eq!(fake.copies(), 1);
        assert_eq!(l.pump(), 0);
        assert_eq!(
            (s.state(), r.state()),
            (TicketState::Copying, TicketState::Copying)
        );
        assert!(!fake.released(S) && !fake.released(R));
        l.settle().unwrap();
        assert_eq!(s.state(), TicketState::Copying, "not done yet");
        assert_eq!(fake.run(1), 1);
        assert!(fake.released(S) && fake.released(R));
        assert_eq!(fake.get(200), vec![7; 16]);
        l.settle().unwrap();
        assert_eq!(
            (s.state(), r.state()),
            (TicketState::Delivered, TicketState::Delivered)
        );
        assert_eq!(l.copies_in_flight(), 0);
    }
}

#[test]
fn messages_match_in_order_and_share_slots_with_growing_generations() {
    let (l, fake) = lane();
    let n = SLOTS as u64 + 3;
    for k in 0..n {
        fake.put(1000 + k, vec![k as u8; 4]);
        send(&l, 1000 + k, 4).unwrap();
    }
    for k in 0..n {
        let t = recv(&l, 5000 + k, 4).unwrap();
        assert_eq!(t.message(), k);
    }
    // The issuing thread enqueued the first INLINE_DEPTH copies; past that
    // depth the service does.
    assert_eq!(fake.copies(), super::INLINE_DEPTH);
    assert_eq!(l.pump(), n as usize - super::INLINE_DEPTH);
    assert_eq!(fake.copies(), n as usize);
    let waits = fake.waits(R);
    assert_eq!(waits[0], (0, 1));
    assert_eq!(
        waits[SLOTS],
        (0, 2),
        "message SLOTS reuses slot 0, one generation up"
    );
    // Copies run in message order: after the first, message SLOTS's
    // waiter is still blocked although its slot was written.
    fake.run(1);
    assert_eq!(fake.slot(0), 1);
    assert!(!fake.released(R));
    fake.run(usize::MAX);
    assert!(fake.released(R) && fake.released(S));
    for k in 0..n {
        assert_eq!(fake.get(5000 + k), vec![k as u8; 4], "message {k}");
    }
}

#[test]
fn a_size_mismatch_names_both_ops_and_enqueues_nothing() {
    let (l, fake) = lane();
    let s = send(&l, 100, 16).unwrap();
    match recv(&l, 200, 8).map_err(|f| f.error) {
        Err(Error::Program { kind, message, .. }) => {
            assert_eq!(kind, ProgramErrorKind::SizeMismatch);
            assert!(
                message.contains("send 16") && message.contains("recv 8"),
                "{message}"
            );
        }
        other => panic!("expected a size mismatch, got {other:?}"),
    }
    assert_eq!(fake.copies(), 0);
    assert!(
        fake.waits(R).is_empty(),
        "the refused recv's stream waits for nothing"
    );
    assert_eq!(s.state(), TicketState::Waiting);
    // The next recv of the right size takes message #0.
    let r = recv(&l, 200, 16).unwrap();
    assert_eq!(r.message(), 0);
    match l.issue(Dir::Send, &S, 1, 4, DType::U8, "send 4", keep()) {
        Ok(_) => {}
        other => panic!("{other:?}"),
    }
    match l
        .issue(Dir::Recv, &R, 2, 4, DType::F32, "recv f32", keep())
        .map_err(|f| f.error)
    {
        Err(Error::Program { kind, .. }) => assert_eq!(kind, ProgramErrorKind::TypeMismatch),
        other => panic!("expected a type mismatch, got {other:?}"),
    }
}

#[test]
fn abort_fails_every_undelivered_op_releases_every_stream_and_refuses_new_ones() {
    let (l, fake) = lane();
    let s = send(&l, 100, 16).unwrap();
    assert!(!fake.released(S));
    l.abort("rank 1 failed");
    assert!(matches!(s.state(), TicketState::Failed(w) if &*w == "rank 1 failed"));
    assert!(fake.released(S));
    match recv(&l, 200, 16).map_err(|f| f.error) {
        Err(Error::Aborted(m)) => assert!(m.contains("rank 1 failed"), "{m}"),
        other => panic!("expected an abort, got {other:?}"),
    }
    assert_eq!(fake.copies(), 0);
}

#[test]
fn a_copy_that_finishes_after_the_abort_is_not_success_and_its_late_write_is_undone() {
    let (l, fake) = lane();
    // Message 0 is matched and its copy enqueued; message SLOTS (same
    // slot) is a send whose recv never comes.
    fake.put(100, vec![1; 4]);
    let s0 = send(&l, 100, 4).unwrap();
    let r0 = recv(&l, 200, 4).unwrap();
    l.pump();
    for k in 1..=SLOTS as u64 {
        send(&l, 100 + k, 4).unwrap();
    }
    l.abort("deadline");
    assert!(fake.released(S));
    // The copy runs late and writes generation 1 into slot 0: the waiter of
    // message SLOTS (generation 2) is blocked again...
    fake.run(1);
    assert!(!fake.released(S));
    // ...until the next settle releases every slot again.
    l.settle().unwrap();
    assert!(fake.released(S));
    // The bytes arrived, but after the abort failed the ops: they stay
    // failed, never success.
    assert!(matches!(s0.state(), TicketState::Failed(_)));
    assert!(matches!(r0.state(), TicketState::Failed(_)));
    assert_eq!(l.copies_in_flight(), 0);
}

#[test]
fn a_copy_that_cannot_be_enqueued_fails_both_ops_and_releases_both_streams() {
    for started in [false, true] {
        let (l, fake) = lane();
        let (a, b) = (Arc::new(()), Arc::new(()));
        let s = l
            .issue(
                Dir::Send,
                &S,
                100,
                4,
                DType::U8,
                "send",
                Box::new(a.clone()),
            )
            .unwrap();
        fake.fail_copies(started);
        // The recv is issued (its wait is on its stream); the copy that its
        // thread then tries to enqueue fails.
        let r = l
            .issue(
                Dir::Recv,
                &R,
                200,
                4,
                DType::U8,
                "recv",
                Box::new(b.clone()),
            )
            .unwrap();
        assert_eq!(l.pump(), 0);
        assert!(matches!(r.state(), TicketState::Failed(_)));
        assert!(matches!(s.state(), TicketState::Failed(_)));
        assert!(fake.released(S) && fake.released(R));
        assert!(l.aborted().is_some());
        // A copy that may have been enqueued keeps its buffers for good.
        let held = if started { 2 } else { 1 };
        assert_eq!((Arc::strong_count(&a), Arc::strong_count(&b)), (held, held));
    }
}

#[test]
fn a_release_that_cannot_be_enqueued_aborts_the_lane_and_keeps_the_buffers_until_the_copy_is_done()
{
    let (l, fake) = lane();
    fake.put(1, vec![5; 4]);
    fake.fail_releases();
    let (a, b) = matched(&l);
    // The copy is enqueued, its write is not: the lane is aborted, which
    // releases both streams and fails both ops.
    assert_eq!(fake.copies(), 1);
    assert!(
        l.aborted().is_some_and(|w| w.contains("release")),
        "{:?}",
        l.aborted()
    );
    assert!(fake.released(S) && fake.released(R));
    // The copy may still run: its buffers stay until it is done.
    assert_eq!((Arc::strong_count(&a), Arc::strong_count(&b)), (2, 2));
    fake.run(1);
    l.settle().unwrap();
    assert_eq!((Arc::strong_count(&a), Arc::strong_count(&b)), (1, 1));
    assert_eq!(l.copies_in_flight(), 0);
}

#[test]
fn an_abort_delivers_the_copies_already_done() {
    // A copy done on the device but not yet settled moved its bytes: an
    // abort then must not call it failed.
    let (l, fake) = lane();
    fake.put(100, vec![3; 4]);
    let s = send(&l, 100, 4).unwrap();
    let r = recv(&l, 200, 4).unwrap();
    l.pump();
    fake.run_done_only(1);
    l.abort("deadline");
    assert_eq!(s.state(), TicketState::Delivered);
    assert_eq!(r.state(), TicketState::Delivered);
    assert_eq!(fake.get(200), vec![3; 4]);
    assert!(fake.released(S) && fake.released(R));
}

#[test]
fn a_late_write_after_the_last_settle_is_undone_by_the_next() {
    // On the device a copy's done event completes just before its slot
    // write lands: a settle can see the copy done, release every slot,
    // and then the write lands.
    let (l, fake) = lane();
    fake.put(100, vec![1; 4]);
    send(&l, 100, 4).unwrap();
    recv(&l, 200, 4).unwrap();
    l.pump();
    for k in 1..=SLOTS as u64 {
        send(&l, 100 + k, 4).unwrap();
    }
    l.abort("deadline");
    fake.run_done_only(1);
    l.settle().unwrap();
    assert_eq!(l.copies_in_flight(), 0);
    fake.land_writes();
    assert!(!fake.released(S), "message SLOTS waits for generation 2");
    l.settle().unwrap();
    assert!(
        fake.released(S),
        "a settle of an aborted lane releases every slot again"
    );
}

#[test]
fn a_dropped_lane_never_frees_the_buffers_of_a_copy_not_seen_done() {
    let (l, fake) = lane();
    let (a, b) = matched(&l);
    l.abort("deadline");
    drop(l);
    assert_eq!((Arc::strong_count(&a), Arc::strong_count(&b)), (2, 2));
    // Once done, a dropped lane frees them.
    let (l, fake2) = lane();
    let (c, d) = matched(&l);
    fake2.run(1);
    drop(l);
    assert_eq!((Arc::strong_count(&c), Arc::strong_count(&d)), (1, 1));
    drop(fake);
}

#[test]
fn a_device_error_before_the_copy_aborts_the_lane() {
    let (l, fake) = lane();
    let s = send(&l, 100, 4).unwrap();
    fake.fail_waits();
    let f = recv(&l, 200, 4).unwrap_err();
    assert!(f.ticket.is_none(), "nothing of the recv is on its stream");
    assert!(l.aborted().is_some());
    assert!(matches!(s.state(), TicketState::Failed(_)));
    assert!(fake.released(S));
}

#[test]
fn buffers_are_kept_until_their_copy_is_done() {
    let (l, fake) = lane();
    let (a, b) = matched(&l);
    l.settle().unwrap();
    assert_eq!((Arc::strong_count(&a), Arc::strong_count(&b)), (2, 2));
    // An abort does not drop them: the copy may still run.
    l.abort("test");
    l.settle().unwrap();
    assert_eq!((Arc::strong_count(&a), Arc::strong_count(&b)), (2, 2));
    fake.run(1);
    l.settle().unwrap();
    assert_eq!((Arc::strong_count(&a), Arc::strong_count(&b)), (1, 1));
}

/// Puts the bytes of `n` messages (message k: `k` as 8 bytes at
/// `10_000 + k`) and sends them from a thread of their own.
fn sending(l: &Arc<CopyLane<Fake>>, fake: &Fake, n: u64) -> std::thread::JoinHandle<()> {
    for k in 0..n {
        fake.put(10_000 + k, k.to_le_bytes().to_vec());
    }
    let l = l.clone();
    std::thread::spawn(move || {
        for k in 0..n {
            send(&l, 10_000 + k, 8).expect("a send");
        }
    })
}

#[test]
fn two_threads_issuing_at_once_deliver_every_message_to_its_partner() {
    let (l, fake) = lane();
    let l = Arc::new(l);
    let n = 2000u64;
    let sender = sending(&l, &fake, n);
    let runner = {
        let (l, fake) = (l.clone(), fake.clone());
        std::thread::spawn(move || {
            let mut ran = 0;
            while ran < n as usize {
                l.pump();
                ran += fake.run(7);
                l.settle().unwrap();
                std::thread::yield_now();
            }
        })
    };
    let tickets: Vec<_> = (0..n).map(|k| recv(&l, 50_000 + k, 8).unwrap()).collect();
    sender.join().unwrap();
    runner.join().unwrap();
    l.settle().unwrap();
    for (k, t) in tickets.iter().enumerate() {
        assert_eq!(t.state(), TicketState::Delivered);
        assert_eq!(fake.get(50_000 + k as u64), (k as u64).to_le_bytes());
    }
}

#[test]
fn a_release_satisfies_every_wait_in_use_as_the_device_compares() {
    // CU_STREAM_WAIT_VALUE_GEQ is cyclic: u32::MAX is "before" 1.
    assert!(!super::satisfies(u32::MAX, 1));
    for g in [1, 2, 1000, super::generation_of(u64::from(u32::MAX), SLOTS)] {
        assert!(super::satisfies(super::RELEASED, g), "generation {g}");
        assert!(super::satisfies(g, g) && !super::satisfies(g - 1, g));
    }
}

mod random {
    //! Random interleavings of everything that can happen to a lane: sends
    //! and recvs (some of the wrong size), copies running on the device
    //! (their done events and their slot writes landing apart), settles and
    //! an abort; the invariants are checked after every step.

    use std::sync::Arc;

    use duplex::{DType, Dir};
    use proptest::prelude::*;

    use super::super::fake::Fake;
    use super::super::{CopyLane, Ticket, TicketState};
    use super::{R, S};

    #[derive(Clone, Copy, Debug)]
    enum Step {
        Send,
        Recv,
        /// A recv of the wrong size.
        BadRecv,
        Pump,
        Run,
        RunDoneOnly,
        Land,
        Settle,
        Abort,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => Just(Step::Send),
            4 => Just(Step::Recv),
            1 => Just(Step::BadRecv),
            3 => Just(Step::Pump),
            3 => Just(Step::Run),
            2 => Just(Step::RunDoneOnly),
            2 => Just(Step::Land),
            3 => Just(Step::Settle),
            1 => Just(Step::Abort),
        ]
    }

    /// Address of message k's send buffer and recv buffer.
    fn src(k: u64) -> u64 {
        1_000_000 + k
    }
    fn dst(k: u64) -> u64 {
        2_000_000 + k
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn a_lane_never_says_delivered_without_the_bytes_and_never_leaves_a_stream_waiting(
            steps in proptest::collection::vec(step(), 1..80),
            slots in 1usize..5,
        ) {
            let fake = Fake::with_slots(slots);
            let lane = CopyLane::new("copy:0->1", fake.clone());
            let mut sends: Vec<Arc<Ticket>> = Vec::new();
            let mut recvs: Vec<(u64, Arc<Ticket>)> = Vec::new();
            let mut aborted = false;
            let mut seen: [Vec<TicketState>; 2] = [Vec::new(), Vec::new()];
            for st in steps {
                match st {
                    Step::Send => {
                        let k = sends.len() as u64;
                        fake.put(src(k), vec![k as u8 ^ 0x5a; 8]);
                        if let Ok(t) = lane.issue(Dir::Send, &S, src(k), 8, DType::U8, "send", Box::new(())) {
                            prop_assert!(!aborted, "an aborted lane took a send");
                            sends.push(t);
                        }
                    }
                    Step::Recv | Step::BadRecv => {
                        let k = recvs.len() as u64;
                        let bytes = if matches!(st, Step::BadRecv) { 4 } else { 8 };
                        match lane.issue(Dir::Recv, &R, dst(k), bytes, DType::U8, "recv", Box::new(())) {
                            Ok(t) => {
                                prop_assert!(!aborted, "an aborted lane took a recv");
                                recvs.push((k, t));
                            }
                            Err(f) => prop_assert!(f.ticket.is_none(), "a refused recv is on its stream"),
                        }
                    }
                    Step::Pump => { lane.pump(); }
                    Step::Run => { fake.run(1); }
                    Step::RunDoneOnly => { fake.run_done_only(1); }
                    Step::Land => fake.land_writes(),
                    Step::Settle => lane.settle().unwrap(),
                    Step::Abort => {
                        lane.abort("test");
                        aborted = true;
                    }
                }
                // Delivered only with the bytes; states never go back.
                for (k, t) in &recvs {
                    if t.state() == TicketState::Delivered {
                        prop_assert_eq!(fake.get(dst(*k)), vec![*k as u8 ^ 0x5a; 8], "message {}", k);
                    }
                }
                let now = [
                    sends.iter().map(|t| t.state()).collect::<Vec<_>>(),
                    recvs.iter().map(|(_, t)| t.state()).collect::<Vec<_>>(),
                ];
                for (seen, now) in seen.iter().zip(&now) {
                    for (before, after) in seen.iter().zip(now) {
                        if matches!(before, TicketState::Delivered | TicketState::Failed(_)) {
                            prop_assert_eq!(before, after);
                        }
                    }
                }
                seen = now;
            }
            // The device finishes what was enqueued and the lane settles:
            // no stream may still wait, unless a message has no partner
            // and the lane was never aborted.
            lane.pump();
            fake.run(usize::MAX);
            fake.land_writes();
            lane.settle().unwrap();
            let matched = sends.len().min(recvs.len());
            if aborted {
                prop_assert!(fake.released(S) && fake.released(R), "an aborted lane left a stream waiting");
            } else {
                prop_assert_eq!(fake.released(S), sends.len() == matched, "sends {} recvs {}", sends.len(), recvs.len());
                prop_assert_eq!(fake.released(R), recvs.len() == matched);
                for t in sends.iter().take(matched).chain(recvs.iter().take(matched).map(|(_, t)| t)) {
                    prop_assert_eq!(t.state(), TicketState::Delivered);
                }
            }
        }
    }
}

mod step3 {
    //! A mismatch found after the side's wait is on its stream (the partner
    //! came while this side enqueued): a concurrent test with a fake whose
    //! wait on one stream blocks until opened (from review 3).
    use super::*;
    use crate::copy::{CopyApi, CopyFailed};
    use std::sync::{Condvar, Mutex};

    /// Fake whose `wait` on stream `gated` blocks until opened.
    #[derive(Clone)]
    struct Gate {
        fake: Fake,
        gated: u32,
        open: Arc<(Mutex<bool>, Condvar)>,
        entered: Arc<(Mutex<bool>, Condvar)>,
    }
    impl Gate {
        fn open(&self) {
            *self.open.0.lock().expect("the gate's lock") = true;
            self.open.1.notify_all();
        }
        fn wait_entered(&self) {
            let mut g = self.entered.0.lock().expect("the gate's lock");
            while !*g {
                g = self.entered.1.wait(g).expect("the gate's lock");
            }
        }
    }
    impl CopyApi for Gate {
        type Stream = u32;
        type Ready = u32;
        type Done = <Fake as CopyApi>::Done;
        fn ready(&self, s: &u32) -> Result<u32, Error> {
            self.fake.ready(s)
        }
        fn wait(&self, s: &u32, slot: usize, value: u32) -> Result<(), Error> {
            if *s == self.gated {
                *self.entered.0.lock().expect("the gate's lock") = true;
                self.entered.1.notify_all();
                let mut g = self.open.0.lock().expect("the gate's lock");
                while !*g {
                    g = self.open.1.wait(g).expect("the gate's lock");
                }
            }
            self.fake.wait(s, slot, value)
        }
        fn copy(
            &self,
            a: &u32,
            b: &u32,
            d: u64,
            s: u64,
            n: usize,
        ) -> Result<Self::Done, CopyFailed> {
            self.fake.copy(a, b, d, s, n)
        }
        fn release(&self, slot: usize, v: u32) -> Result<(), Error> {
            self.fake.release(slot, v)
        }
        fn done(&self, d: &Self::Done) -> Result<bool, Error> {
            self.fake.done(d)
        }
        fn release_all(&self) {
            self.fake.release_all()
        }
        fn slots(&self) -> usize {
            self.fake.slots()
        }
    }

    /// Side A in step 2 while side B does steps 1-3; A then finds the mismatch in step 3.
    #[test]
    fn step3_mismatch_message_number() {
        let fake = Fake::default();
        let g = Gate {
            fake: fake.clone(),
            gated: S,
            open: Arc::new((Mutex::new(false), Condvar::new())),
            entered: Arc::new((Mutex::new(false), Condvar::new())),
        };
        let l = Arc::new(CopyLane::new("copy:0->1", g.clone()));
        let a = {
            let l = l.clone();
            std::thread::spawn(move || {
                l.issue(Dir::Send, &S, 1, 16, DType::U8, "send 16", Box::new(()))
            })
        };
        g.wait_entered();
        let r = l
            .issue(Dir::Recv, &R, 2, 8, DType::U8, "recv 8", Box::new(()))
            .unwrap();
        g.open();
        let f = a.join().unwrap().unwrap_err();
        assert!(f.error.to_string().contains("message #0"), "{}", f.error);
        // The send's wait is on its stream: it is launched and failed, the
        // recv too, and the lane is aborted (both streams released).
        let s = f.ticket.expect("the send's wait was enqueued");
        assert!(matches!(s.state(), TicketState::Failed(_)));
        assert!(matches!(r.state(), TicketState::Failed(_)));
        assert!(l.aborted().is_some());
        assert!(fake.released(S) && fake.released(R));
    }
}

#[test]
fn with_the_service_running_every_message_is_enqueued_without_an_explicit_pump() {
    // Past INLINE_DEPTH copies in flight the issuing threads leave copies
    // to the service thread; nothing here calls `pump`.
    let fake = Fake::default();
    let l = Arc::new(CopyLane::new("copy:0->1", fake.clone()));
    CopyLane::start(&l).unwrap();
    let n = 3000u64;
    let sender = sending(&l, &fake, n);
    let device = {
        let (l, fake) = (l.clone(), fake.clone());
        std::thread::spawn(move || {
            let start = std::time::Instant::now();
            let mut ran = 0;
            while ran < n as usize && start.elapsed() < std::time::Duration::from_secs(20) {
                ran += fake.run(5);
                l.settle().unwrap();
                std::thread::yield_now();
            }
            ran
        })
    };
    let tickets: Vec<_> = (0..n).map(|k| recv(&l, 50_000 + k, 8).unwrap()).collect();
    sender.join().unwrap();
    assert_eq!(
        device.join().unwrap(),
        n as usize,
        "a matched copy was never enqueued"
    );
    l.settle().unwrap();
    for (k, t) in tickets.iter().enumerate() {
        assert_eq!(t.state(), TicketState::Delivered, "message {k}");
        assert_eq!(fake.get(50_000 + k as u64), (k as u64).to_le_bytes());
    }
}

/// Waits (bounded) until `f` holds: the lane's service works on a thread
/// of its own.
fn eventually(what: &str, f: impl Fn() -> bool) {
    let start = std::time::Instant::now();
    while !f() {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(5),
            "never: {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

#[test]
fn a_message_held_back_is_enqueued_by_the_service_alone_once_it_may_be() {
    let fake = Fake::default();
    let l = Arc::new(CopyLane::new("copy:0->1", fake.clone()));
    CopyLane::start(&l).expect("a service");
    fake.put(1, vec![7; 4]);
    fake.hold_copies(true);
    let s = send(&l, 1, 4).expect("issued");
    let r = recv(&l, 2, 4).expect("issued");
    // The issuing thread held it back; the service polls for it.
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(fake.copies(), 0, "held back");
    assert_eq!(l.copies_in_flight(), 1, "the job waits in the lane");
    fake.hold_copies(false);
    eventually("the service enqueued it", || fake.copies() == 1);
    fake.run(usize::MAX);
    eventually("the service settled it", || {
        s.state() == TicketState::Delivered && r.state() == TicketState::Delivered
    });
    assert_eq!(fake.get(2), vec![7; 4]);
    assert!(fake.released(S) && fake.released(R));
}

#[test]
fn messages_held_back_keep_their_order() {
    let (l, fake) = lane();
    fake.hold_copies(true);
    for k in 0..3u64 {
        fake.put(10 + k, vec![k as u8; 2]);
        send(&l, 10 + k, 2).expect("issued");
        recv(&l, 20 + k, 2).expect("issued");
    }
    assert_eq!(l.pump(), 0);
    fake.hold_copies(false);
    assert_eq!(l.pump(), 3);
    fake.run(usize::MAX);
    for k in 0..3u64 {
        assert_eq!(fake.get(20 + k), vec![k as u8; 2], "message {k}");
    }
}

#[test]
fn a_message_held_back_while_the_lane_is_aborted_fails_and_is_never_enqueued() {
    let fake = Fake::default();
    let l = Arc::new(CopyLane::new("copy:0->1", fake.clone()));
    fake.hold_copies(true);
    // The abort lands between the pump taking the job and putting it back.
    let weak = Arc::downgrade(&l);
    fake.on_hold(move || {
        if let Some(l) = weak.upgrade() {
            l.abort("rank 0 died");
        }
    });
    let s = send(&l, 1, 4).expect("issued");
    let r = recv(&l, 2, 4).expect("issued");
    for t in [&s, &r] {
        assert!(
            matches!(t.state(), TicketState::Failed(w) if w.contains("rank 0 died")),
            "{:?}",
            t.state()
        );
    }
    fake.hold_copies(false);
    assert_eq!(l.pump(), 0);
    assert_eq!(fake.copies(), 0, "never enqueued");
    assert_eq!(l.copies_in_flight(), 0, "not put back");
    assert!(fake.released(S) && fake.released(R));
}

#[test]
fn a_failed_query_of_whether_a_copy_may_go_aborts_the_lane_naming_both_ops() {
    let (l, fake) = lane();
    fake.fail_may_copy();
    let s = send(&l, 1, 4).expect("issued");
    let r = recv(&l, 2, 4).expect("issued");
    let why = l.aborted().expect("aborted");
    assert!(
        why.contains("send 4") && why.contains("recv 4") && why.contains("cuEventQuery"),
        "{why}"
    );
    for t in [&s, &r] {
        assert!(matches!(t.state(), TicketState::Failed(_)));
    }
    assert_eq!(fake.copies(), 0);
    assert!(fake.released(S) && fake.released(R));
}

#[test]
fn the_service_polls_a_held_message_quickly_again_whenever_one_moved() {
    use super::{HELD_POLL, HELD_POLL_MAX, held_poll};
    // Held and nothing moved: twice as long each time, to the cap.
    let mut p = HELD_POLL;
    let mut seen = vec![p];
    for _ in 0..12 {
        p = held_poll(p, true, false);
        seen.push(p);
    }
    assert!(seen.windows(2).all(|w| w[1] >= w[0]));
    assert_eq!(*seen.last().expect("some"), HELD_POLL_MAX);
    // A message moved: back to the quick poll (messages held one after
    // another, each for a moment, are each polled for quickly).
    assert_eq!(held_poll(HELD_POLL_MAX, true, true), HELD_POLL);
    // Nothing held: the quick poll is ready for the next.
    assert_eq!(held_poll(HELD_POLL_MAX, false, false), HELD_POLL);
}

#[test]
fn every_abort_tells_the_other_side_before_it_releases() {
    // (Across processes the mismatch found under the lock is checked in
    // `ipc::tests`; two aborts at once in the loom tests.)
    let (l, fake) = lane();
    let _s = send(&l, 1, 4).expect("issued");
    l.abort("deadline");
    l.abort("later");
    assert_eq!(fake.told().as_deref(), Some("deadline"), "the first reason");
    assert!(!fake.released_untold());
    assert!(fake.released(S));
}

#[test]
fn a_stream_let_go_before_the_abort_failed_its_ticket_finds_why() {
    // Between an abort's two halves (tell and release without the lock,
    // then fail the tickets under it), a rank whose stream went on asks
    // the lane why: it must not see a lane that was never aborted.
    let (l, fake) = lane();
    let s = send(&l, 1, 4).expect("issued");
    l.let_go("rank 1 failed");
    assert!(fake.released(S));
    assert_eq!(s.state(), TicketState::Waiting, "not failed yet");
    assert_eq!(l.aborted().as_deref(), Some("rank 1 failed"));
    l.abort("rank 1 failed");
    assert!(matches!(s.state(), TicketState::Failed(w) if w.contains("rank 1 failed")));
    assert_eq!(l.aborted().as_deref(), Some("rank 1 failed"));
}

#[test]
fn a_copy_seen_done_only_after_an_abort_let_the_streams_go_is_failed() {
    // The release let both streams go on before the copy ran: what came
    // after the ops there may have used the bytes from before, so the
    // copy, though it ran, delivers nothing the ranks may count on.
    let (l, fake) = lane();
    fake.put(100, vec![7; 16]);
    let s = send(&l, 100, 16).expect("issued");
    let r = recv(&l, 200, 16).expect("issued");
    assert_eq!(fake.copies(), 1, "enqueued");
    l.let_go("deadline");
    assert!(fake.released(S) && fake.released(R));
    fake.run(usize::MAX);
    l.settle().expect("no device error");
    for t in [&s, &r] {
        assert!(
            matches!(t.state(), TicketState::Failed(w) if w.contains("deadline")),
            "{:?}",
            t.state()
        );
    }
    // A copy done before the abort delivered its bytes: it stays so.
    let (l, fake) = lane();
    fake.put(100, vec![7; 16]);
    let s = send(&l, 100, 16).expect("issued");
    let r = recv(&l, 200, 16).expect("issued");
    fake.run(usize::MAX);
    l.abort("deadline");
    assert_eq!(s.state(), TicketState::Delivered);
    assert_eq!(r.state(), TicketState::Delivered);
    assert_eq!(fake.get(200), vec![7; 16]);
}

/// An abort lets the streams go while a copy is enqueued: the recv fails,
/// but its copy may still run and write the recv's buffer (here it does,
/// after the abort). The ticket says so until a settle sees the copy done,
/// so that the rank refuses the buffer meanwhile (`BufState::late_copy`;
/// found by review: a host write after the abort was allowed, and the
/// late copy overwrote it).
#[test]
fn a_copy_in_flight_at_an_abort_is_known_to_be_able_to_write_until_seen_done() {
    let (l, fake) = lane();
    fake.put(100, vec![1; 4]);
    let s = send(&l, 100, 4).unwrap();
    let r = recv(&l, 200, 4).unwrap();
    l.pump();
    assert_eq!(fake.copies(), 1);
    assert!(r.copy_may_run(), "enqueued");
    assert!(r.late().is_none(), "in flight, not failed");
    l.abort("rank 0 hung");
    assert!(fake.released(R));
    let why = r.late().expect("failed with its copy in flight");
    assert!(why.contains("rank 0 hung"), "{why}");
    // The late copy runs: it writes the buffer, then a settle sees it.
    fake.run(usize::MAX);
    assert_eq!(fake.get(200), vec![1; 4]);
    let _ = l.settle();
    assert!(
        !r.copy_may_run() && r.late().is_none(),
        "seen done: the buffer is free again"
    );
    assert!(
        matches!(r.state(), TicketState::Failed(_)),
        "still not delivered"
    );
    assert!(!s.copy_may_run());
}

/// A copy delivered normally is no longer able to run once a settle saw it.
#[test]
fn a_delivered_copy_cannot_run_again() {
    let (l, fake) = lane();
    let _s = send(&l, 100, 4).unwrap();
    let r = recv(&l, 200, 4).unwrap();
    l.pump();
    fake.run(usize::MAX);
    let _ = l.settle();
    assert_eq!(r.state(), TicketState::Delivered);
    assert!(!r.copy_may_run() && r.late().is_none());
}
