//! The lane between two processes on the CPU: both halves in this process,
//! each with its own mapping of one real shared-memory segment (as two
//! processes have), and fake devices that share one memory map. The fake
//! copy stream runs when the test says ([`World::run`]).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use duplex::{DType, Dir, Error};

use super::{EVENTS, Feeder, IpcSender, OpenApi, RING, SLOTS, Segment, SendApi, TEXT};
use crate::copy::{CopyApi, CopyFailed, CopyLane, TicketState, satisfies};
use crate::sync::{Mutex, lock};

type Ready = Arc<AtomicBool>;

enum Pending {
    Copy {
        send: Ready,
        recv: Ready,
        dst: u64,
        src: u64,
        bytes: usize,
        done: Arc<AtomicBool>,
    },
    Write {
        slot: usize,
        value: u32,
    },
}

#[derive(Default)]
struct Inner {
    memory: HashMap<u64, Vec<u8>>,
    events: HashMap<u64, Ready>,
    next_event: u64,
    /// Events whose records do not complete until released.
    hold_events: bool,
    queue: VecDeque<Pending>,
    opens: usize,
    closes: usize,
    mapped: HashMap<u64, usize>,
    /// Per stream, its waits (slot, value), oldest first.
    waits: HashMap<u32, Vec<(usize, u32)>>,
    /// The destination released every slot while the segment did not yet
    /// say why: a source stream let go then finds no reason.
    released_before_why: bool,
}

/// The fake devices of both processes, and the segment as the destination
/// maps it.
#[derive(Clone)]
struct World {
    inner: Arc<Mutex<Inner>>,
    seg: Arc<Segment>,
}

impl World {
    fn put(&self, ptr: u64, data: Vec<u8>) {
        lock(&self.inner).memory.insert(ptr, data);
    }

    fn get(&self, ptr: u64) -> Vec<u8> {
        lock(&self.inner)
            .memory
            .get(&ptr)
            .cloned()
            .unwrap_or_default()
    }

    /// Runs the copy stream while it can (a copy waits for both ready
    /// events). Returns how many entries ran.
    fn run(&self) -> usize {
        let mut n = 0;
        let mut g = lock(&self.inner);
        while let Some(p) = g.queue.front() {
            match p {
                Pending::Copy {
                    send,
                    recv,
                    dst,
                    src,
                    bytes,
                    done,
                } => {
                    if !send.load(Ordering::Acquire) || !recv.load(Ordering::Acquire) {
                        break;
                    }
                    let mut data = g.memory.get(src).cloned().unwrap_or_default();
                    data.truncate(*bytes);
                    done.store(true, Ordering::Release);
                    let dst = *dst;
                    g.memory.insert(dst, data);
                }
                Pending::Write { slot, value } => {
                    let k = u64::from(value - 1) * SLOTS as u64 + *slot as u64;
                    self.seg
                        .control()
                        .copied
                        .store((k + 1) as u32, Ordering::Release);
                    self.seg.slot(*slot).store(*value, Ordering::Release);
                }
            }
            g.queue.pop_front();
            n += 1;
        }
        n
    }

    /// Whether every wait of `stream` is satisfied by the segment's slots.
    fn released(&self, stream: u32) -> bool {
        let g = lock(&self.inner);
        g.waits.get(&stream).is_none_or(|w| {
            w.iter()
                .all(|(s, v)| satisfies(self.seg.slot_value(*s), *v))
        })
    }

    /// Completes every event's record.
    fn complete_events(&self) {
        let mut g = lock(&self.inner);
        g.hold_events = false;
        for e in g.events.values() {
            e.store(true, Ordering::Release);
        }
    }
}

/// The source's fake device.
struct FakeSend(World);

impl SendApi for FakeSend {
    type Stream = u32;
    type Event = Ready;

    fn event(&self) -> Result<(Ready, [u8; 64]), Error> {
        let mut g = lock(&self.0.inner);
        g.next_event += 1;
        let id = g.next_event;
        let e = Arc::new(AtomicBool::new(false));
        g.events.insert(id, e.clone());
        let mut h = [0u8; 64];
        h[..8].copy_from_slice(&id.to_le_bytes());
        Ok((e, h))
    }

    fn record(&self, event: &Ready, _stream: &u32) -> Result<(), Error> {
        let hold = lock(&self.0.inner).hold_events;
        event.store(!hold, Ordering::Release);
        Ok(())
    }

    fn recorded(&self, event: &Ready) -> Result<bool, Error> {
        Ok(event.load(Ordering::Acquire))
    }

    fn wait(&self, stream: &u32, slot: usize, value: u32) -> Result<(), Error> {
        lock(&self.0.inner)
            .waits
            .entry(*stream)
            .or_default()
            .push((slot, value));
        Ok(())
    }

    fn arena(&self) -> [u8; 64] {
        let mut h = [0u8; 64];
        h[..8].copy_from_slice(&ARENA.to_le_bytes());
        h
    }

    fn arena_bytes(&self) -> u64 {
        ARENA_BYTES
    }

    fn offset(&self, ptr: u64) -> Option<u64> {
        (ARENA..ARENA + ARENA_BYTES)
            .contains(&ptr)
            .then(|| ptr - ARENA)
    }
}

/// The destination's fake opener: maps the arena at the same address (one
/// memory map stands for both devices).
struct FakeOpen(World);

fn id_of(h: &[u8; 64]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&h[..8]);
    u64::from_le_bytes(b)
}

impl OpenApi for FakeOpen {
    type Ready = Ready;

    fn open_event(&self, handle: &[u8; 64]) -> Result<Ready, Error> {
        lock(&self.0.inner)
            .events
            .get(&id_of(handle))
            .cloned()
            .ok_or_else(|| Error::Aborted("no such event".into()))
    }

    fn open_mem(&self, handle: &[u8; 64]) -> Result<u64, Error> {
        let mut g = lock(&self.0.inner);
        let base = id_of(handle);
        g.opens += 1;
        *g.mapped.entry(base).or_default() += 1;
        Ok(base)
    }
}

/// The destination's fake lane device.
struct FakeRecv(World);

impl CopyApi for FakeRecv {
    type Stream = u32;
    type Ready = Ready;
    type Done = Arc<AtomicBool>;

    fn ready(&self, _stream: &u32) -> Result<Ready, Error> {
        Ok(Arc::new(AtomicBool::new(true)))
    }

    fn wait(&self, stream: &u32, slot: usize, value: u32) -> Result<(), Error> {
        lock(&self.0.inner)
            .waits
            .entry(*stream)
            .or_default()
            .push((slot, value));
        Ok(())
    }

    fn copy(
        &self,
        send: &Ready,
        recv: &Ready,
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> Result<Arc<AtomicBool>, CopyFailed> {
        let done = Arc::new(AtomicBool::new(false));
        lock(&self.0.inner).queue.push_back(Pending::Copy {
            send: send.clone(),
            recv: recv.clone(),
            dst,
            src,
            bytes,
            done: done.clone(),
        });
        Ok(done)
    }

    fn release(&self, slot: usize, value: u32) -> Result<(), Error> {
        lock(&self.0.inner)
            .queue
            .push_back(Pending::Write { slot, value });
        let k = u64::from(value - 1) * SLOTS as u64 + slot as u64;
        self.0.seg.enqueued_through(k);
        Ok(())
    }

    fn done(&self, done: &Arc<AtomicBool>) -> Result<bool, Error> {
        Ok(done.load(Ordering::Acquire))
    }

    fn may_copy(&self, send: &Ready, _recv: &Ready) -> Result<bool, Error> {
        Ok(send.load(Ordering::Acquire))
    }

    fn release_all(&self) {
        if self.0.seg.why().is_none() {
            lock(&self.0.inner).released_before_why = true;
        }
        self.0.seg.release_all();
    }

    fn aborted(&self, why: &str) {
        self.0.seg.abort(why);
    }

    fn released_elsewhere(&self) -> Option<Arc<str>> {
        self.0.seg.why()
    }
}

/// A segment name no other test uses.
fn fresh_name() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "/duplex-test-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

struct Pair {
    world: World,
    sender: IpcSender<FakeSend>,
    lane: Arc<CopyLane<FakeRecv>>,
    feeder: Feeder<FakeRecv, FakeOpen>,
}

/// Both halves of lane 0 -> 1, the source with a ring wait of `timeout`.
fn pair_with(timeout: Duration) -> Pair {
    let name = fresh_name();
    let dst = Arc::new(Segment::create(&name).expect("a segment"));
    let src =
        Arc::new(Segment::open(&name, Instant::now() + Duration::from_secs(5)).expect("opened"));
    assert_ne!(
        dst.base(),
        src.base(),
        "two mappings, as two processes have"
    );
    let world = World {
        inner: Arc::new(Mutex::new(Inner::default())),
        seg: dst.clone(),
    };
    let sender =
        IpcSender::new("copy:0->1", FakeSend(world.clone()), src, timeout).expect("a source");
    let lane = Arc::new(CopyLane::new("copy:0->1", FakeRecv(world.clone())));
    let mut feeder = Feeder::new(&lane, dst, Arc::new(FakeOpen(world.clone())));
    feeder
        .prepare(Instant::now() + Duration::from_secs(5))
        .expect("everything opened at setup");
    assert_eq!(lock(&world.inner).opens, 1, "the arena, at setup");
    Pair {
        world,
        sender,
        lane,
        feeder,
    }
}

fn pair() -> Pair {
    pair_with(Duration::from_secs(5))
}

/// The source's arena in the fake.
const ARENA: u64 = 0x10_0000;
const ARENA_BYTES: u64 = 64 << 20;
const SRC: u64 = ARENA;
/// The destination's own buffers, outside the arena.
const DST: u64 = 0x1_0000_0000;

/// Waits (bounded) until `f` holds; the reaper unmaps on a thread of its
/// own.
fn eventually(what: &str, f: impl Fn() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(5), "never: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

impl Pair {
    fn send(&self, ptr: u64, bytes: usize, keep: &Arc<()>) -> Arc<crate::copy::Ticket> {
        self.sender
            .send(
                &1,
                ptr,
                bytes,
                DType::U8,
                "send 1 to rank 1",
                Box::new(keep.clone()),
            )
            .expect("issued")
    }

    fn recv(&self, ptr: u64, bytes: usize) -> Arc<crate::copy::Ticket> {
        self.lane
            .issue(
                Dir::Recv,
                &2,
                ptr,
                bytes,
                DType::U8,
                "recv from rank 0",
                Box::new(()),
            )
            .expect("issued")
    }

    /// A send of `bytes` at `ptr` named `text` that must be refused.
    fn refused(&self, ptr: u64, bytes: usize, text: &str) -> super::IssueFailure {
        self.sender
            .send(&1, ptr, bytes, DType::U8, text, Box::new(()))
            .expect_err("refused")
    }

    /// Posts message 0 as another process could, bypassing the source:
    /// `bytes` at `offset` of allocation `mem`.
    fn forge(&self, mem: [u8; 64], offset: u64, bytes: usize) {
        self.world.seg.post(&super::Posted {
            k: 0,
            bytes,
            dtype: DType::U8,
            mem,
            offset,
            event: 0,
            event_handle: [0; 64],
            text: "forged".into(),
        });
    }

    /// What the destination's threads and device do next.
    fn step(&mut self) {
        assert!(self.feeder.poll());
        self.lane.pump();
        self.world.run();
        let _ = self.lane.settle();
        let _ = self.sender.settle();
    }
}

#[test]
fn a_message_crosses_with_every_byte_and_the_send_knows_it_was_delivered() {
    let mut p = pair();
    p.world.put(SRC, (0..64).collect());
    let keep = Arc::new(());
    let s = p.send(SRC, 64, &keep);
    assert!(!p.world.released(1), "a send waits for its recv (C2)");
    p.step();
    assert_eq!(
        s.state(),
        TicketState::Waiting,
        "no recv yet: nothing copied"
    );
    assert!(!p.world.released(1));
    let r = p.recv(DST, 64);
    p.step();
    assert_eq!(p.world.get(DST), (0..64).collect::<Vec<u8>>());
    assert_eq!(r.state(), TicketState::Delivered);
    assert_eq!(s.state(), TicketState::Delivered);
    assert!(p.world.released(1) && p.world.released(2));
    // The copy is done there: the source lets its buffer go.
    let _ = p.sender.settle();
    assert_eq!(Arc::strong_count(&keep), 1, "let go");
    let g = lock(&p.world.inner);
    assert_eq!(
        (g.opens, g.closes),
        (1, 0),
        "the arena was opened at setup only"
    );
}

#[test]
fn a_recv_issued_first_waits_for_the_send_and_then_gets_its_bytes() {
    let mut p = pair();
    p.world.put(SRC + 16, vec![7; 32]);
    let r = p.recv(DST, 32);
    p.step();
    assert!(!p.world.released(2));
    let keep = Arc::new(());
    let s = p.send(SRC + 16, 32, &keep);
    p.step();
    assert_eq!(
        p.world.get(DST),
        vec![7; 32],
        "the offset in the allocation is kept"
    );
    assert_eq!(
        (r.state(), s.state()),
        (TicketState::Delivered, TicketState::Delivered)
    );
}

#[test]
fn a_size_mismatch_fails_both_sides_naming_both_ops_and_releases_both_streams() {
    let mut p = pair();
    p.world.put(SRC, vec![1; 64]);
    let keep = Arc::new(());
    let r = p.recv(DST, 32);
    let s = p.send(SRC, 64, &keep);
    p.step();
    let why = p.lane.aborted().expect("the destination aborted the lane");
    assert!(
        why.contains("differ in size") && why.contains("send 1 to rank 1"),
        "{why}"
    );
    let there = p.sender.aborted().expect("the source sees it");
    assert!(there.contains("differ in size"), "{there}");
    assert!(matches!(r.state(), TicketState::Failed(_)));
    assert!(matches!(s.state(), TicketState::Failed(_)));
    assert!(p.world.released(1) && p.world.released(2));
    assert!(
        !lock(&p.world.inner).released_before_why,
        "the streams were released before the segment said why"
    );
    assert!(p.world.get(DST).is_empty(), "no byte was copied");
    // Later sends are refused at once.
    let e = p.refused(SRC, 64, "send 2");
    assert!(e.to_string().contains("was aborted"), "{e}");
}

#[test]
fn an_abort_by_the_source_reaches_the_destination_and_releases_its_streams() {
    let mut p = pair();
    let r = p.recv(DST, 8);
    p.step();
    assert!(!p.world.released(2));
    p.sender.abort("rank 0 hung");
    p.step();
    let why = p.lane.aborted().expect("aborted there");
    assert!(
        why.contains("rank 0 hung") && why.contains("by its source"),
        "{why}"
    );
    assert!(matches!(r.state(), TicketState::Failed(_)));
    assert!(p.world.released(2));
}

/// The source aborts while a copy is enqueued and not yet run: its
/// release lets the destination's recv stream go before the bytes land.
/// The copy, seen done later (by a settle before the feeder saw the abort,
/// or by the feeder's own abort), must fail the recv, never deliver it
/// (found by review: both paths marked it delivered).
#[test]
fn a_copy_done_after_the_source_let_the_destinations_stream_go_is_not_delivered() {
    for settle_first in [true, false] {
        let mut p = pair();
        p.world.put(SRC, vec![5; 64]);
        let keep = Arc::new(());
        let _s = p.send(SRC, 64, &keep);
        assert!(p.feeder.poll());
        let r = p.recv(DST, 64);
        p.lane.pump();
        assert_eq!(copies_queued(&p.world), 1, "the copy is enqueued, not run");
        assert!(!p.world.released(2));
        p.sender.abort("rank 0 hung");
        assert!(
            p.world.released(2),
            "the recv's stream went on before its copy ran"
        );
        p.world.run();
        if settle_first {
            let _ = p.lane.settle();
            assert!(
                !matches!(r.state(), TicketState::Delivered),
                "settled before the feeder saw the abort: {:?}",
                r.state()
            );
        }
        assert!(p.feeder.poll());
        match r.state() {
            TicketState::Failed(why) => assert!(why.contains("rank 0 hung"), "{why}"),
            other => panic!("settle first {settle_first}: {other:?}"),
        }
        let why = p.lane.aborted().expect("aborted");
        assert!(why.contains("rank 0 hung"), "{why}");
    }
}

#[test]
fn an_abort_by_the_destination_fails_the_sources_undelivered_sends() {
    let mut p = pair();
    let keep = Arc::new(());
    let s = p.send(SRC, 8, &keep);
    p.step();
    p.lane.abort("rank 1 failed");
    p.step();
    assert!(matches!(s.state(), TicketState::Failed(w) if w.contains("rank 1 failed")));
    assert!(p.world.released(1));
    // The destination let go of its unmatched send's mapping: the source
    // may free the buffer.
    eventually("the buffer is let go once unmapped there", || {
        let _ = p.sender.settle();
        Arc::strong_count(&keep) == 1
    });
}

#[test]
fn a_buffer_the_destination_may_still_map_is_never_freed() {
    let mut p = pair();
    let keep = Arc::new(());
    let s = p.send(SRC, 8, &keep);
    p.step();
    // Taken by the feeder (mapped there), then the source aborts; the
    // destination has not looked yet.
    p.sender.abort("rank 0 hung");
    assert!(matches!(s.state(), TicketState::Failed(_)));
    drop(p.sender);
    assert_eq!(Arc::strong_count(&keep), 2, "leaked, never freed");
    assert_eq!(lock(&p.world.inner).closes, 0);
}

#[test]
fn an_event_is_recorded_again_only_once_its_last_record_completed_and_the_destination_waited() {
    let mut p = pair();
    p.world.put(SRC, vec![3; 8]);
    let keep = Arc::new(());
    // Message 0 on event 1; its wait is enqueued there once matched.
    p.send(SRC, 8, &keep);
    p.recv(DST, 8);
    p.step();
    p.send(SRC, 8, &keep);
    assert_eq!(p.sender.events(), 1, "event 1 was free again: reused");
    // Held records: message 1's event has not completed, so message 2
    // needs another, and so does 3 (2's wait is not enqueued there yet).
    lock(&p.world.inner).hold_events = true;
    p.send(SRC, 8, &keep);
    p.send(SRC, 8, &keep);
    assert_eq!(p.sender.events(), 3);
    p.world.complete_events();
    for _ in 0..3 {
        p.recv(DST, 8);
    }
    for _ in 0..3 {
        p.step();
    }
    assert_eq!(p.lane.copies_in_flight(), 0);
    p.send(SRC, 8, &keep);
    assert_eq!(p.sender.events(), 3, "a free one was found");
}

/// Copies the destination has enqueued on its copy stream and not run.
fn copies_queued(w: &World) -> usize {
    lock(&w.inner)
        .queue
        .iter()
        .filter(|p| matches!(p, Pending::Copy { .. }))
        .count()
}

#[test]
fn a_copy_is_enqueued_only_once_the_sources_ready_event_completed() {
    // The destination's copy stream never waits on the source process's
    // work: that process may die with it pending, and the wait would then
    // never end (`CopyApi::may_copy`).
    let mut p = pair();
    p.world.put(SRC, vec![5; 8]);
    let keep = Arc::new(());
    lock(&p.world.inner).hold_events = true;
    let s = p.send(SRC, 8, &keep);
    let r = p.recv(DST, 8);
    p.step();
    assert_eq!(copies_queued(&p.world), 0, "held back on the host");
    assert_eq!(r.state(), TicketState::Copying);
    p.lane.pump();
    assert_eq!(copies_queued(&p.world), 0, "still held back");
    // The source's stream reaches the record: the next pump enqueues it.
    p.world.complete_events();
    p.lane.pump();
    assert_eq!(copies_queued(&p.world), 1);
    p.world.run();
    let _ = p.lane.settle();
    let _ = p.sender.settle();
    assert_eq!(r.state(), TicketState::Delivered);
    assert_eq!(s.state(), TicketState::Delivered);
    assert_eq!(p.world.get(DST), vec![5; 8]);
}

#[test]
fn a_message_held_back_for_its_sources_event_fails_on_abort_and_is_never_enqueued() {
    let mut p = pair();
    let keep = Arc::new(());
    lock(&p.world.inner).hold_events = true;
    let s = p.send(SRC, 8, &keep);
    let r = p.recv(DST, 8);
    p.step();
    p.lane.abort("rank 0 died");
    p.world.complete_events();
    p.lane.pump();
    assert_eq!(
        copies_queued(&p.world),
        0,
        "nothing waits on the dead process"
    );
    assert!(matches!(r.state(), TicketState::Failed(w) if w.contains("rank 0 died")));
    let _ = p.sender.settle();
    assert!(matches!(s.state(), TicketState::Failed(w) if w.contains("rank 0 died")));
    assert!(p.world.released(1) && p.world.released(2));
}

#[test]
fn buffers_are_let_go_in_message_order_and_nothing_is_opened_after_setup() {
    let mut p = pair();
    p.world.put(SRC, vec![5; 8]);
    p.world.put(SRC + 4096, vec![6; 8]);
    let (a, b) = (Arc::new(()), Arc::new(()));
    p.send(SRC, 8, &a);
    p.send(SRC + 4096, 8, &b);
    p.step();
    p.recv(DST, 8);
    p.recv(DST + 8, 8);
    p.step();
    assert_eq!(p.world.get(DST + 8), vec![6; 8]);
    let _ = p.sender.settle();
    assert_eq!((Arc::strong_count(&a), Arc::strong_count(&b)), (1, 1));
    assert_eq!(p.sender.held(), 0);
    assert_eq!(lock(&p.world.inner).opens, 1);
}

#[test]
fn a_send_from_a_buffer_outside_the_arena_is_refused_naming_the_op() {
    let p = pair();
    let e = p.refused(DST, 8, "send 8 x u8 to rank 1");
    let text = e.to_string();
    assert!(
        text.contains("send 8 x u8 to rank 1") && text.contains("arena"),
        "{text}"
    );
    assert!(e.ticket.is_none(), "nothing was enqueued");
    assert!(p.sender.aborted().is_none(), "the lane goes on");
    assert!(p.world.released(1));
}

#[test]
fn more_unmatched_sends_than_events_fail_within_the_deadline() {
    let mut p = pair_with(Duration::from_millis(50));
    let keep = Arc::new(());
    for _ in 0..EVENTS {
        p.send(SRC, 8, &keep);
        p.step();
    }
    let e = p.refused(SRC, 8, "one send too many");
    assert!(e.to_string().contains("at most 256"), "{e}");
}

#[test]
fn a_posted_send_naming_what_was_not_opened_aborts_the_lane() {
    let mut p = pair();
    p.forge([9; 64], 0, 8);
    p.step();
    let why = p.lane.aborted().expect("aborted");
    assert!(why.contains("not within the source's arena"), "{why}");
}

#[test]
fn a_posted_send_past_the_arenas_end_aborts_the_lane() {
    let mut p = pair();
    let mut mem = [0u8; 64];
    mem[..8].copy_from_slice(&ARENA.to_le_bytes());
    p.forge(mem, ARENA_BYTES - 8, 16);
    p.step();
    let why = p.lane.aborted().expect("aborted, no copy out of bounds");
    assert!(why.contains("16 bytes at offset"), "{why}");
    assert!(lock(&p.world.inner).queue.is_empty(), "nothing enqueued");
}

#[test]
fn a_send_running_past_the_arenas_end_is_refused() {
    let p = pair();
    let e = p.refused(ARENA + ARENA_BYTES - 8, 16, "send 16");
    assert!(e.to_string().contains("arena"), "{e}");
}

#[test]
fn an_abort_by_either_side_writes_why_before_it_releases() {
    let mut p = pair();
    let keep = Arc::new(());
    let s = p.send(SRC, 8, &keep);
    p.step();
    // The destination aborts: by the time the source's stream is released,
    // the reason is in the segment.
    p.lane.abort("rank 1 hung");
    assert!(p.world.released(1));
    assert!(!lock(&p.world.inner).released_before_why);
    assert!(
        p.sender
            .aborted()
            .is_some_and(|w| w.contains("rank 1 hung"))
    );
    let _ = p.sender.settle();
    assert!(matches!(s.state(), TicketState::Failed(w) if w.contains("rank 1 hung")));
}

#[test]
fn the_arena_hands_out_aligned_ranges_first_fit_and_merges_what_comes_back() {
    let a = crate::cuda::Arena::over(4096, 8192, [0; 64]);
    let x = a.take(100).expect("room");
    let y = a.take(1000).expect("room");
    assert_eq!((x, y), (4096, 4096 + 512));
    assert_eq!(a.offset(y), Some(512));
    assert_eq!(a.offset(4096 + 8192), None);
    assert!(a.take(8192).is_none(), "no room for all of it");
    a.give(x, 100);
    assert_eq!(a.take(512), Some(4096), "first fit reuses the hole");
    a.give(4096, 512);
    a.give(y, 1000);
    assert_eq!(a.free_bytes(), 8192);
    assert_eq!(a.take(8192), Some(4096), "merged back into one range");
}

#[test]
fn a_full_ring_that_nobody_reads_fails_the_send_within_its_deadline() {
    let p = pair_with(Duration::from_millis(50));
    let keep = Arc::new(());
    for _ in 0..RING {
        p.send(SRC, 8, &keep);
    }
    let t = Instant::now();
    let e = p.refused(SRC, 8, "send 257");
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(e.to_string().contains("stuck or dead"), "{e}");
    assert!(p.sender.aborted().is_some());
}

#[test]
fn many_messages_reuse_slots_and_arrive_in_order() {
    let mut p = pair();
    let keep = Arc::new(());
    for i in 0..(SLOTS as u64 + 40) {
        let src = SRC + (i % 4) * 0x10_0000;
        p.world.put(src, vec![i as u8; 4]);
        let s = p.send(src, 4, &keep);
        let r = p.recv(DST, 4);
        p.step();
        assert_eq!(p.world.get(DST), vec![i as u8; 4], "message {i}");
        assert_eq!(
            (s.state(), r.state()),
            (TicketState::Delivered, TicketState::Delivered)
        );
    }
    assert!(
        p.sender.events() <= 2,
        "events are reused: {}",
        p.sender.events()
    );
}

#[test]
fn the_destination_unlinks_the_name_once_the_source_attached() {
    let mut p = pair();
    let name = p.world.seg.segment_name().to_string();
    p.step();
    let again = Segment::open(&name, Instant::now());
    assert!(again.is_err(), "the name is gone; both mappings live on");
    assert!(p.world.seg.why().is_none());
}

#[test]
fn a_source_without_a_destination_says_what_is_missing() {
    let e = Segment::open(&fresh_name(), Instant::now() + Duration::from_millis(20))
        .expect_err("nobody made it");
    assert!(e.to_string().contains("copy_from"), "{e}");
}

#[test]
fn names_are_the_same_for_one_job_and_differ_between_jobs_and_lanes() {
    assert_eq!(Segment::name(b"job", 0, 1), Segment::name(b"job", 0, 1));
    assert_ne!(Segment::name(b"job", 0, 1), Segment::name(b"job", 1, 0));
    assert_ne!(Segment::name(b"job", 0, 1), Segment::name(b"other", 0, 1));
}

#[test]
fn a_long_op_text_and_a_long_abort_reason_are_cut_at_a_char_boundary() {
    let mut p = pair();
    let text = "é".repeat(TEXT);
    p.sender
        .send(&1, SRC, 4, DType::U8, &text, Box::new(()))
        .expect("issued");
    p.recv(DST, 8);
    p.step();
    let why = p.lane.aborted().expect("a size mismatch");
    assert!(why.contains('é'));
    p.world.seg.abort(&"ü".repeat(4000));
    let _ = p.world.seg.why().expect("readable");
}
