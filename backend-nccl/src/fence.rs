//! Completion fences: how a rank learns which of its ops the device has
//! finished, with one CUDA event for many launches of a stream instead of
//! one per launch (P6 and P9 of [`crate::guard`]).
//!
//! Each stream keeps at most one *open* fence. An op attaches to it once
//! its launch has returned, so the op's work is on the stream before the
//! fence is recorded, whenever that is: every `every` launches
//! ([`Fences::new`]) by the issuing thread, and whenever something needs to
//! know that the ops so far completed ([`Fences::flush`]: `synchronize` and
//! `sync_stream` before their own events, a hang report, the end of a
//! run). A recorded fence leaves its stream's slot; the next launch opens a
//! new one, so the fences of a stream are recorded in the order of their
//! positions, and one that completed says every earlier one did (the
//! ledger's bisection, [`crate::guard::Done::queue`]).
//!
//! Every order of launch, attach and record is safe: an op that attaches
//! after its fence was recorded takes the next one, which is only later.
//! The record takes only the stream's slot lock, never the rank's issue
//! lock. Asking whether a fence is done ([`Fence::done`]) only queries: an
//! open fence is not done, and no thread that asks (the ledger's pruning
//! under its lock, a busy-buffer check, the watchdog) enqueues work on a
//! stream, which the driver may hold up when the device makes no progress.
//! What the sharing costs: an op is known done only once the fence it
//! attached to was recorded and completed, that is once the ops launched
//! on its stream up to that record did. No wait of the transport waits for
//! one op (waits cover whole streams and flush first, and a host read or
//! write refuses a busy buffer, as the simulator does, rather than wait),
//! so the later ops add no dependency a program could hang on; they only
//! delay when the ledger lets an op go.
//!
//! The events are behind [`Marks`], so that the protocol runs without a
//! GPU: `tests/loom.rs` model-checks it on [`fake::Counter`].

use duplex::Error;

use crate::sync::{Arc, AtomicU8, Mutex, Ordering, lock};

/// The completion events of one stream.
pub trait Marks: Send + Sync + std::fmt::Debug + 'static {
    /// One event.
    type Mark: Send + Sync + std::fmt::Debug;
    /// A new event, not recorded (on the thread that launches, its
    /// device current).
    fn make(&self) -> Result<Self::Mark, Error>;
    /// Records `m` on the stream: it completes once everything queued
    /// there so far has.
    fn record(&self, m: &Self::Mark) -> Result<(), Error>;
    /// Whether `m` completed (an error: not known).
    fn query(&self, m: &Self::Mark) -> Result<bool, Error>;
}

/// Not recorded yet: the stream's open fence.
const OPEN: u8 = 0;
/// Recorded; not yet seen complete.
const RECORDED: u8 = 1;
/// Complete: seen so, or a later fence of its stream was.
const DONE: u8 = 2;
/// Its record failed: never known done, unless a later fence of its
/// stream completes (its ops keep their buffers, P6).
const LOST: u8 = 3;

/// At most this many completed events wait in a stream's spares.
const SPARES: usize = 64;

/// The fences of one stream. Dropping it records its open fence
/// ([`Fences::close`]), so drop it before the stream is destroyed.
#[derive(Debug)]
pub struct Fences<M: Marks> {
    /// First, so that its spare events go before `marks` (which may own
    /// what they need, a device).
    slot: Mutex<Slot<M>>,
    marks: M,
    /// The stream's number in the ledger ([`crate::guard::Done::queue`]).
    serial: usize,
    /// Launches after which the issuing thread records the open fence.
    every: u32,
}

#[derive(Debug)]
struct Slot<M: Marks> {
    /// The open fence (state [`OPEN`], always) and how many launches
    /// attached to it.
    open: Option<(Arc<Fence<M>>, u32)>,
    /// The next fence's position.
    next: u64,
    /// Completed events, to be recorded again.
    spare: Vec<M::Mark>,
    /// Set by [`Fences::close`]: the stream is going away.
    closed: bool,
}

/// A point of one stream that the ops attached to it wait behind: they are
/// done once it completed.
#[derive(Debug)]
pub struct Fence<M: Marks> {
    fences: Arc<Fences<M>>,
    mark: Option<M::Mark>,
    position: u64,
    state: AtomicU8,
}

impl<M: Marks> Fences<M> {
    /// The fences of the stream that `marks` records on, numbered `serial`
    /// in the ledger; the issuing thread records one every `every`
    /// launches (at least 1).
    pub fn new(marks: M, serial: usize, every: u32) -> Arc<Fences<M>> {
        Arc::new(Fences {
            marks,
            serial,
            every: every.max(1),
            slot: Mutex::new(Slot {
                open: None,
                next: 0,
                spare: Vec::new(),
                closed: false,
            }),
        })
    }

    /// The fence that the launch which just returned on this stream
    /// attaches to (called once per launch and stream, by the thread that
    /// launched, after the launch). An error: the fence could not be made,
    /// or this launch's record of it failed; either way what was launched
    /// is not tracked, and the ops already attached keep their buffers.
    pub fn attach(this: &Arc<Fences<M>>) -> Result<Arc<Fence<M>>, Error> {
        let mut slot = lock(&this.slot);
        if slot.closed {
            return Err(Error::Aborted("its stream was destroyed".into()));
        }
        let (fence, launches) = match &mut slot.open {
            Some((f, n)) => {
                *n += 1;
                (f.clone(), *n)
            }
            None => {
                let mark = match slot.spare.pop() {
                    Some(m) => m,
                    None => this.marks.make()?,
                };
                let f = Arc::new(Fence {
                    fences: this.clone(),
                    mark: Some(mark),
                    position: slot.next,
                    state: AtomicU8::new(OPEN),
                });
                slot.next += 1;
                slot.open = Some((f.clone(), 1));
                (f, 1)
            }
        };
        if launches >= this.every {
            let (sealed, result) = this.seal(&mut slot);
            drop(slot);
            drop(sealed);
            result?;
        }
        Ok(fence)
    }

    /// Records the open fence, if any, and lets it go (under the slot
    /// lock). The fence is handed back so that the caller drops it after
    /// the lock: dropping the last hold of a fence takes the lock.
    fn seal(&self, slot: &mut Slot<M>) -> (Option<Arc<Fence<M>>>, Result<(), Error>) {
        let Some((f, _)) = slot.open.take() else {
            return (None, Ok(()));
        };
        let result = match &f.mark {
            Some(m) => self.marks.record(m),
            None => Err(Error::Aborted("a fence without its event".into())),
        };
        f.state.store(
            if result.is_ok() { RECORDED } else { LOST },
            Ordering::Release,
        );
        if let Err(e) = &result {
            tracing::warn!(error = %e, "recording a completion fence failed: its ops keep their buffers");
        }
        (Some(f), result)
    }

    /// Records the open fence now, if there is one, and returns it
    /// (`synchronize` and `sync_stream` do before they record their own
    /// events, so that what they cover is known done once those complete;
    /// a hang report and the end of a run too). An error: the record
    /// failed, and the fence's ops are never known done by it.
    pub fn flush(&self) -> Result<Option<Arc<Fence<M>>>, Error> {
        let (sealed, result) = {
            let mut slot = lock(&self.slot);
            self.seal(&mut slot)
        };
        result.map(|()| sealed)
    }

    /// The stream is going away: its open fence is recorded, and no fence
    /// is made or recorded on it again (so nothing uses the stream after
    /// this returns). Idempotent.
    pub fn close(&self) {
        let (sealed, spare) = {
            let mut slot = lock(&self.slot);
            slot.closed = true;
            (self.seal(&mut slot).0, std::mem::take(&mut slot.spare))
        };
        drop((sealed, spare));
    }

    /// The stream's number in the ledger.
    pub fn queue_serial(&self) -> usize {
        self.serial
    }

    /// How many fences were opened on this stream so far.
    pub fn opened(&self) -> u64 {
        lock(&self.slot).next
    }
}

impl<M: Marks> Fence<M> {
    /// Whether the device is done with everything queued on its stream
    /// before it was recorded. It only asks: an open fence is not done
    /// (nothing is recorded here, see the module's text). A fence whose
    /// record or query failed answers no: its ops' buffers are then kept
    /// for good rather than freed under a kernel that may still run (P6),
    /// unless a later fence of its stream completes ([`Fence::mark_done`]).
    pub fn done(&self) -> bool {
        match self.state.load(Ordering::Acquire) {
            DONE => true,
            RECORDED => {
                let done = self
                    .mark
                    .as_ref()
                    .is_some_and(|m| self.fences.marks.query(m).unwrap_or(false));
                if done {
                    self.state.store(DONE, Ordering::Release);
                }
                done
            }
            _ => false,
        }
    }

    /// Told that it is done, because a later fence of its stream is, or a
    /// wait recorded after it on its stream completed. An
    /// open fence is left open: no later fence of its stream exists, so
    /// the call would be a mistake, and marking it would let the ops that
    /// attach next pass for done.
    pub fn mark_done(&self) {
        let _ = self
            .state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                (s != OPEN).then_some(DONE)
            });
    }

    /// Its stream's number and its position there.
    pub fn queue(&self) -> (usize, u64) {
        (self.fences.serial, self.position)
    }

    /// Whether it has been recorded (or given up on).
    pub fn sealed(&self) -> bool {
        self.state.load(Ordering::Acquire) != OPEN
    }
}

impl Fence<Arc<fake::Counter>> {
    /// On the fake stream: the launches queued before its record.
    pub fn covers(&self) -> Option<u64> {
        self.mark.as_ref().and_then(|m| m.covers())
    }
}

impl<M: Marks> Drop for Fence<M> {
    fn drop(&mut self) {
        // A completed event goes back to its stream, to be recorded again;
        // any other is destroyed (CUDA lets an event with work pending be).
        let Some(mark) = self.mark.take() else {
            return;
        };
        let done = match self.state.load(Ordering::Acquire) {
            DONE => true,
            RECORDED => self.fences.marks.query(&mark).unwrap_or(false),
            _ => false,
        };
        if done {
            let mut slot = lock(&self.fences.slot);
            if !slot.closed && slot.spare.len() < SPARES {
                slot.spare.push(mark);
            }
        }
    }
}

/// A fake stream for the protocol's tests: it counts the launches queued
/// on it, and each mark remembers how many were queued when it was
/// recorded; the test completes the stream up to a count. As CUDA's
/// `cuEventQuery`, a mark never recorded answers done; a switch makes
/// records fail.
pub mod fake {
    use duplex::Error;

    use crate::sync::{Arc, AtomicBool, AtomicU64, Mutex, Ordering, lock};

    /// A stream: launches queued, launches completed, and every mark made.
    #[derive(Debug, Default)]
    pub struct Counter {
        queued: AtomicU64,
        completed: AtomicU64,
        made: Mutex<Vec<Arc<FakeMark>>>,
        fail_records: AtomicBool,
    }

    /// A mark: the launches queued before its record (`None`: not
    /// recorded), and how many times it was recorded.
    #[derive(Debug, Default)]
    pub struct FakeMark {
        covers: Mutex<Option<u64>>,
        records: AtomicU64,
    }

    impl FakeMark {
        /// The launches queued before its latest record.
        pub fn covers(&self) -> Option<u64> {
            *lock(&self.covers)
        }

        /// How many times it was recorded.
        pub fn records(&self) -> u64 {
            self.records.load(Ordering::SeqCst)
        }
    }

    impl Counter {
        /// Queues one launch; returns its number (1, 2, ...).
        pub fn launch(&self) -> u64 {
            self.queued.fetch_add(1, Ordering::SeqCst) + 1
        }

        /// The device finishes launches up to `n`.
        pub fn complete_to(&self, n: u64) {
            self.completed.fetch_max(n, Ordering::SeqCst);
        }

        /// Every mark made so far.
        pub fn made(&self) -> Vec<Arc<FakeMark>> {
            lock(&self.made).clone()
        }

        /// From now on every record fails (`true`) or succeeds.
        pub fn fail_records(&self, fail: bool) {
            self.fail_records.store(fail, Ordering::SeqCst);
        }
    }

    impl super::Marks for Arc<Counter> {
        type Mark = Arc<FakeMark>;

        fn make(&self) -> Result<Arc<FakeMark>, Error> {
            let m = Arc::new(FakeMark::default());
            lock(&self.made).push(m.clone());
            Ok(m)
        }

        fn record(&self, m: &Arc<FakeMark>) -> Result<(), Error> {
            if self.fail_records.load(Ordering::SeqCst) {
                return Err(Error::Aborted("cuEventRecord failed (on purpose)".into()));
            }
            *lock(&m.covers) = Some(self.queued.load(Ordering::SeqCst));
            m.records.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }

        fn query(&self, m: &Arc<FakeMark>) -> Result<bool, Error> {
            // CUDA: an event never recorded has nothing to wait for.
            Ok(m.covers()
                .is_none_or(|c| c <= self.completed.load(Ordering::SeqCst)))
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::Arc;

    use super::fake::Counter;
    use super::*;

    fn stream(every: u32) -> (Arc<Counter>, Arc<Fences<Arc<Counter>>>) {
        let c = Arc::new(Counter::default());
        (c.clone(), Fences::new(c, 7, every))
    }

    /// One launch on `c`, attached to `f`'s fence.
    fn launch(c: &Counter, f: &Arc<Fences<Arc<Counter>>>) -> Arc<Fence<Arc<Counter>>> {
        c.launch();
        Fences::attach(f).expect("attach")
    }

    #[test]
    fn launches_share_a_fence_until_the_issuer_records_it() {
        let (c, f) = stream(3);
        let fences: Vec<_> = (0..7).map(|_| launch(&c, &f)).collect();
        // 3 + 3 + 1: two recorded by the issuer, the last still open.
        assert!(Arc::ptr_eq(&fences[0], &fences[2]));
        assert!(!Arc::ptr_eq(&fences[2], &fences[3]));
        assert!(Arc::ptr_eq(&fences[3], &fences[5]));
        assert_eq!(
            fences.iter().map(|x| x.queue()).collect::<Vec<_>>(),
            [0, 0, 0, 1, 1, 1, 2].map(|p| (7, p))
        );
        assert!(fences[0].sealed() && fences[3].sealed() && !fences[6].sealed());
        assert_eq!(fences[0].covers(), Some(3));
        assert_eq!(fences[3].covers(), Some(6));
        assert_eq!(f.opened(), 3);
    }

    #[test]
    fn an_open_fence_is_not_done_and_asking_records_nothing() {
        let (c, f) = stream(100);
        let a = launch(&c, &f);
        c.complete_to(1);
        // Its event, never recorded, would answer done to a query: asking
        // must not query it, nor record it.
        assert!(!a.done());
        assert!(!a.sealed());
        assert_eq!(c.made()[0].records(), 0);
    }

    #[test]
    fn a_fence_is_done_only_once_every_launch_attached_to_it_completed() {
        let (c, f) = stream(100);
        let a = launch(&c, &f);
        let b = launch(&c, &f);
        assert!(Arc::ptr_eq(&a, &b));
        c.complete_to(1);
        let sealed = f.flush().unwrap().unwrap();
        assert!(Arc::ptr_eq(&a, &sealed));
        // Launch 1 completed, launch 2 not: the shared fence is not done.
        assert!(!a.done());
        c.complete_to(2);
        assert!(a.done() && b.done());
        // The next launch opens a new fence.
        let d = launch(&c, &f);
        assert!(!Arc::ptr_eq(&a, &d));
        assert_eq!(d.queue(), (7, 1));
        assert!(!d.done());
    }

    #[test]
    fn an_op_that_attaches_after_a_record_takes_the_next_fence() {
        let (c, f) = stream(100);
        let a = launch(&c, &f);
        f.flush().unwrap();
        // A launch that returned after that record.
        let b = launch(&c, &f);
        assert!(!Arc::ptr_eq(&a, &b));
        c.complete_to(1);
        assert!(a.done());
        assert!(!b.done(), "launch 2 is not complete");
    }

    #[test]
    fn flush_records_the_open_fence_and_close_ends_the_stream() {
        let (c, f) = stream(100);
        let a = launch(&c, &f);
        assert!(f.flush().unwrap().is_some());
        assert!(a.sealed());
        assert!(f.flush().unwrap().is_none(), "nothing open: no record");
        assert_eq!(c.made()[0].records(), 1);
        let b = launch(&c, &f);
        f.close();
        assert!(b.sealed(), "closing records the open fence");
        assert!(Fences::attach(&f).is_err());
        c.complete_to(2);
        assert!(a.done() && b.done());
    }

    #[test]
    fn mark_done_leaves_an_open_fence_open() {
        let (c, f) = stream(100);
        let a = launch(&c, &f);
        a.mark_done();
        assert!(!a.sealed());
        assert!(!a.done());
        f.flush().unwrap();
        a.mark_done();
        assert!(a.done(), "a recorded fence told it is done");
    }

    #[test]
    fn a_fence_whose_record_failed_is_never_done_until_told() {
        let (c, f) = stream(100);
        let a = launch(&c, &f);
        c.fail_records(true);
        let e = f.flush().unwrap_err();
        assert!(e.to_string().contains("on purpose"), "{e}");
        assert!(a.sealed(), "given up on, not left open");
        // Its event was never recorded (CUDA would answer done): it must
        // not be asked.
        c.complete_to(1);
        assert!(!a.done());
        // A later fence completes: every earlier op of the stream did.
        c.fail_records(false);
        let b = launch(&c, &f);
        assert!(!Arc::ptr_eq(&a, &b));
        f.flush().unwrap();
        c.complete_to(2);
        assert!(b.done());
        a.mark_done();
        assert!(a.done());
    }

    #[test]
    fn an_issuers_record_that_fails_fails_its_launch() {
        let (c, f) = stream(2);
        let a = launch(&c, &f);
        c.fail_records(true);
        c.launch();
        let e = Fences::attach(&f).unwrap_err();
        assert!(e.to_string().contains("on purpose"), "{e}");
        c.complete_to(2);
        assert!(!a.done(), "the earlier launch's fence was not recorded");
        c.fail_records(false);
        // The next launch opens a fence of its own.
        let b = launch(&c, &f);
        assert!(!Arc::ptr_eq(&a, &b));
    }

    #[test]
    fn completed_events_are_recorded_again() {
        let (c, f) = stream(1);
        for i in 1..=5 {
            let a = launch(&c, &f);
            c.complete_to(i);
            assert!(a.done());
        }
        // Each fence was done and dropped before the next was made.
        assert_eq!(c.made().len(), 1);
        assert_eq!(c.made()[0].records(), 5);
    }

    #[test]
    fn an_event_not_complete_is_not_recorded_again() {
        let (c, f) = stream(1);
        drop(launch(&c, &f));
        drop(launch(&c, &f));
        assert_eq!(
            c.made().len(),
            2,
            "the first was still pending when dropped"
        );
    }
}
