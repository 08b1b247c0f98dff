//! A device for copy-engine lanes on the CPU: memory is a map of byte
//! vectors, the flag slots an array, and the copy stream a queue that runs
//! when the test says so ([`Fake::run`]). It records what each user stream
//! was asked to wait for, so a test can ask whether a stream is released
//! ([`Fake::released`]), comparing as the device does (cyclically,
//! [`super::satisfies`]). Used by the unit tests and the loom tests.

use std::collections::{HashMap, VecDeque};

use duplex::Error;

use super::{CopyApi, CopyFailed, SLOTS};
use crate::sync::{Arc, AtomicBool, Mutex, Ordering, lock};

/// A user stream: a number.
pub type FakeStream = u32;

/// What the copy stream holds, in order.
#[derive(Debug)]
enum Pending {
    /// A copy and its done event.
    Copy {
        dst: u64,
        src: u64,
        bytes: usize,
        done: Arc<AtomicBool>,
    },
    /// A slot write (`CopyApi::release`).
    Write { slot: usize, value: u32 },
}

#[derive(Debug)]
struct Inner {
    memory: HashMap<u64, Vec<u8>>,
    slots: Vec<u32>,
    /// Per stream, the (slot, value) waits enqueued, oldest first.
    waits: HashMap<FakeStream, Vec<(usize, u32)>>,
    queue: VecDeque<Pending>,
    /// Calls to `copy` fail from now on; `true`: after enqueuing the copy.
    fail_copies: Option<bool>,
    /// Calls to `wait` fail from now on.
    fail_waits: bool,
    /// Calls to `release` fail from now on.
    fail_releases: bool,
    /// Copies run whose slot write has not landed yet
    /// ([`Fake::run_done_only`]).
    writes: Vec<(usize, u32)>,
    copies: usize,
    /// `may_copy` says no ([`Fake::hold_copies`]).
    hold: bool,
    /// `may_copy` fails.
    fail_may_copy: bool,
    /// Run (once) when `may_copy` says no, with no lock of the fake held.
    on_hold: Hook,
    /// The first reason the lane gave the other side (`aborted`).
    told: Option<String>,
    /// A `release_all` came before any `aborted`: a stream of another
    /// process let go then would find no reason.
    released_untold: bool,
}

/// Something a test runs from inside a call of the lane ([`Fake::on_hold`]).
#[derive(Default)]
struct Hook(Option<Box<dyn FnOnce() + Send>>);

impl std::fmt::Debug for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Hook(set)"
        } else {
            "Hook"
        })
    }
}

/// The fake device.
#[derive(Debug, Clone)]
pub struct Fake(Arc<Mutex<Inner>>);

impl Default for Fake {
    fn default() -> Self {
        Fake::with_slots(SLOTS)
    }
}

impl Fake {
    /// A fake with `n` flag slots (few, to exercise their reuse).
    pub fn with_slots(n: usize) -> Fake {
        Fake(Arc::new(Mutex::new(Inner {
            memory: HashMap::new(),
            slots: vec![0; n.max(1)],
            waits: HashMap::new(),
            queue: VecDeque::new(),
            fail_copies: None,
            fail_waits: false,
            fail_releases: false,
            writes: Vec::new(),
            copies: 0,
            hold: false,
            fail_may_copy: false,
            on_hold: Hook::default(),
            told: None,
            released_untold: false,
        })))
    }

    /// Puts `data` at address `ptr`.
    pub fn put(&self, ptr: u64, data: Vec<u8>) {
        lock(&self.0).memory.insert(ptr, data);
    }

    /// The bytes at `ptr`.
    pub fn get(&self, ptr: u64) -> Vec<u8> {
        lock(&self.0).memory.get(&ptr).cloned().unwrap_or_default()
    }

    /// Runs up to `n` enqueued copies, in order: copies the bytes, marks
    /// the copy done, writes its slot. Returns how many ran.
    pub fn run(&self, n: usize) -> usize {
        lock(&self.0).run(n, true)
    }

    /// Whether every wait enqueued on `stream` is satisfied now.
    pub fn released(&self, stream: FakeStream) -> bool {
        let g = lock(&self.0);
        g.waits
            .get(&stream)
            .is_none_or(|w| w.iter().all(|(s, v)| super::satisfies(g.slots[*s], *v)))
    }

    /// The value in flag `slot`.
    pub fn slot(&self, slot: usize) -> u32 {
        lock(&self.0).slots[slot]
    }

    /// Makes every later `copy` call fail; `started`: after enqueuing the
    /// copy (as when recording its done event fails).
    pub fn fail_copies(&self, started: bool) {
        lock(&self.0).fail_copies = Some(started);
    }

    /// Makes every later `wait` call fail.
    pub fn fail_waits(&self) {
        lock(&self.0).fail_waits = true;
    }

    /// Makes every later `release` call fail.
    pub fn fail_releases(&self) {
        lock(&self.0).fail_releases = true;
    }

    /// Makes `may_copy` say no (`true`) or yes (`false`): as a lane whose
    /// source process has not yet reached a message's ready event.
    pub fn hold_copies(&self, hold: bool) {
        lock(&self.0).hold = hold;
    }

    /// Makes every later `may_copy` call fail.
    pub fn fail_may_copy(&self) {
        lock(&self.0).fail_may_copy = true;
    }

    /// The first reason the lane gave the other side ([`CopyApi::aborted`]).
    pub fn told(&self) -> Option<String> {
        lock(&self.0).told.clone()
    }

    /// Whether some `release_all` came before any reason was given.
    pub fn released_untold(&self) -> bool {
        lock(&self.0).released_untold
    }

    /// Runs `f` the next time `may_copy` says no, just before it returns.
    pub fn on_hold(&self, f: impl FnOnce() + Send + 'static) {
        lock(&self.0).on_hold = Hook(Some(Box::new(f)));
    }

    /// Runs up to `n` copies as far as their done events: the bytes move
    /// and the copies are done, but their slot writes land only at
    /// [`Fake::land_writes`] (on the device the done event completes just
    /// before the write).
    pub fn run_done_only(&self, n: usize) -> usize {
        lock(&self.0).run(n, false)
    }

    /// Lands the slot writes of [`Fake::run_done_only`].
    pub fn land_writes(&self) {
        lock(&self.0).land();
    }

    /// Copies enqueued so far.
    pub fn copies(&self) -> usize {
        lock(&self.0).copies
    }

    /// The waits enqueued on `stream`.
    pub fn waits(&self, stream: FakeStream) -> Vec<(usize, u32)> {
        lock(&self.0)
            .waits
            .get(&stream)
            .cloned()
            .unwrap_or_default()
    }
}

/// The error of a call the fake was told to fail.
fn told_to_fail(call: &str) -> Error {
    Error::Library {
        library: "CUDA",
        call: call.into(),
        code: 1,
        text: "the fake was told to fail".into(),
    }
}

impl Inner {
    /// Runs up to `n` copies in order, with the slot writes enqueued after
    /// them; the writes land now, or (not `write`) at the next
    /// [`Inner::land`]. The copy stream runs in order: an earlier copy's
    /// write lands before a later copy runs. A write not enqueued yet
    /// (`release` not called) waits for a later run.
    fn run(&mut self, n: usize, write: bool) -> usize {
        if n > 0 {
            self.land();
        }
        let mut ran = 0;
        loop {
            match self.queue.front() {
                None => break,
                Some(Pending::Copy { .. }) if ran == n => break,
                _ => {}
            }
            match self.queue.pop_front() {
                Some(Pending::Copy {
                    dst,
                    src,
                    bytes,
                    done,
                }) => {
                    let data = self.memory.get(&src).cloned().unwrap_or_default();
                    let d = self.memory.entry(dst).or_default();
                    d.clear();
                    d.extend_from_slice(&data[..bytes.min(data.len())]);
                    done.store(true, Ordering::SeqCst);
                    ran += 1;
                }
                Some(Pending::Write { slot, value }) => {
                    self.writes.push((slot, value));
                    if write {
                        self.land();
                    }
                }
                None => break,
            }
        }
        ran
    }

    /// Lands the pending slot writes. A lane's copies run in message
    /// order, so a slot's value only grows, except from [`super::RELEASED`]
    /// (an abort's), which a late write may lower until the next settle:
    /// anything else is a bug of the lane, which this catches.
    fn land(&mut self) {
        for (slot, value) in std::mem::take(&mut self.writes) {
            let old = self.slots[slot];
            assert!(
                old == super::RELEASED || value >= old,
                "slot {slot} went from {old} down to {value}: copies out of message order"
            );
            self.slots[slot] = value;
        }
    }
}

impl CopyApi for Fake {
    type Stream = FakeStream;
    type Ready = FakeStream;
    type Done = Arc<AtomicBool>;

    fn ready(&self, stream: &FakeStream) -> Result<FakeStream, Error> {
        Ok(*stream)
    }

    fn wait(&self, stream: &FakeStream, slot: usize, value: u32) -> Result<(), Error> {
        let mut g = lock(&self.0);
        if g.fail_waits {
            return Err(told_to_fail("cuStreamWaitValue32"));
        }
        g.waits.entry(*stream).or_default().push((slot, value));
        Ok(())
    }

    fn copy(
        &self,
        _send: &FakeStream,
        _recv: &FakeStream,
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> Result<Arc<AtomicBool>, CopyFailed> {
        let mut g = lock(&self.0);
        let fail = g.fail_copies;
        if fail == Some(false) {
            return Err(CopyFailed {
                error: told_to_fail("cuMemcpyPeerAsync"),
                started: false,
            });
        }
        let done = Arc::new(AtomicBool::new(false));
        g.queue.push_back(Pending::Copy {
            dst,
            src,
            bytes,
            done: done.clone(),
        });
        if fail == Some(true) {
            // As if the memcpy was enqueued and a later call failed.
            return Err(CopyFailed {
                error: told_to_fail("cuEventRecord"),
                started: true,
            });
        }
        g.copies += 1;
        Ok(done)
    }

    fn release(&self, slot: usize, value: u32) -> Result<(), Error> {
        let mut g = lock(&self.0);
        if g.fail_releases {
            return Err(told_to_fail("cuStreamWriteValue32"));
        }
        g.queue.push_back(Pending::Write { slot, value });
        Ok(())
    }

    fn done(&self, done: &Arc<AtomicBool>) -> Result<bool, Error> {
        Ok(done.load(Ordering::SeqCst))
    }

    fn slots(&self) -> usize {
        lock(&self.0).slots.len()
    }

    fn may_copy(&self, _send: &Self::Ready, _recv: &Self::Ready) -> Result<bool, Error> {
        let (hold, hook) = {
            let mut g = lock(&self.0);
            if g.fail_may_copy {
                return Err(told_to_fail("cuEventQuery"));
            }
            let hook = if g.hold { g.on_hold.0.take() } else { None };
            (g.hold, hook)
        };
        if let Some(f) = hook {
            f();
        }
        Ok(!hold)
    }

    fn aborted(&self, why: &str) {
        let mut g = lock(&self.0);
        if g.told.is_none() {
            g.told = Some(why.to_string());
        }
    }

    fn release_all(&self) {
        let mut g = lock(&self.0);
        if g.told.is_none() {
            g.released_untold = true;
        }
        for s in g.slots.iter_mut() {
            *s = super::RELEASED;
        }
    }
}
