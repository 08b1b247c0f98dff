//! Copy-engine lanes between two processes of one host: CUDA IPC for the
//! bytes and the events, a POSIX shared-memory segment for the flags and
//! the messages. The rules are C1–C6 of `docs/semantics.md`, as for a lane
//! of one process ([`super`]); what differs is who does what, and the
//! section "Across processes" of `docs/semantics.md` says why (X1–X4 were
//! measured before this was written).
//!
//! # Who does what
//!
//! The **segment** ([`Segment`]) is made by the destination rank (it
//! copies) and opened by the source rank; both register it with CUDA, so
//! each device can wait on and write its flag slots. It holds the slots,
//! a few counters, why the lane was aborted, and a ring of posted sends.
//!
//! The **source** ([`IpcSender`]) issues a send as a lane of one process
//! does (a ready event and a wait on the message's slot, on its own
//! stream), except that the ready event is an interprocess event of its
//! pool, and then posts the send into the ring: its message number, the
//! event's number and handle, its buffer's allocation handle and offset,
//! size, element type, and the op as reports name it.
//!
//! The **destination** keeps the lane's state: a [`CopyLane`] whose sends
//! come from the ring ([`Feeder`], a thread of its own: it opens the event
//! and the buffer, and hands the send to [`CopyLane::issue_remote`]) and
//! whose recvs are its own rank's. It matches them, copies on its own copy
//! stream and writes the slot, which releases both ranks' streams. Before
//! the slot it writes the **copied** counter (message number + 1), which is
//! how the source knows its send delivered: a slot passed because of an
//! abort says nothing.
//!
//! # What keeps it safe
//!
//! - **Nothing is opened once an op can wait.** An IPC open in a process
//!   whose streams wait on a lane stalled, on one H200, until those waits
//!   ended, and the copy that would end them with it
//!   (`docs/gpu/ipc-copy-1gpu.md`). So each rank carves the buffers of its
//!   copy-engine ops out of one **arena** ([`crate::cuda::Arena`], exported
//!   once), the source makes its [`EVENTS`] interprocess events up front,
//!   and the destination opens the arena and every event at setup
//!   ([`Feeder::prepare`], in [`lanes`]), before either rank's code runs.
//!   A send from a buffer outside the arena is refused, naming the op.
//! - **Events.** A re-recorded interprocess event does not complete while
//!   its earlier record is held, and a wait enqueued after a re-record
//!   waits for the later one (X3): so the source re-records an event of
//!   its pool only once its last record completed and the destination has
//!   enqueued its wait on it (the **enqueued** counter, written once each
//!   copy with its waits is on the copy stream). With all [`EVENTS`] held
//!   (that many sends unmatched), a send waits for one until its deadline,
//!   then fails saying so.
//! - **Buffers.** The destination lets go of each message once its copy is
//!   done (or will never be enqueued) and raises the **unmapped** counter
//!   over the messages let go, in message order. The source keeps each
//!   send's buffer until that counter passes it, so no part of the arena is
//!   reused while a copy may read it. After an abort a buffer the
//!   destination may still read is never given back (P6 of
//!   `crate::guard`).
//! - **Aborts.** Either side writes why into the segment, then releases
//!   every slot with host stores (X2); the other side sees it at its next
//!   settle (the source), or its feeder's next look (the destination). A
//!   dead process cannot release its own streams, but its streams died with
//!   it.
//! - **The ring** is bounded ([`RING`] sends posted and not yet read);
//!   the feeder reads it whatever the destination's code does, so a full
//!   ring means that process is stuck or dead, and a send waits for room
//!   only until its deadline.
//!
//! The device side is two traits, [`SendApi`] and [`OpenApi`] (with
//! [`CopyApi`] for the destination's lane): CUDA on GPUs ([`cuda`]), and
//! fakes in the tests, where the two halves run in one process over a real
//! segment.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use duplex::{DType, Dir, Error};

use super::{
    CopyApi, CopyLane, CopyPath, IssueFailure, Keep, RELEASED, SLOTS, Ticket, TicketState, failure,
    generation_of, lane_aborted, satisfies, slot_of,
};
use crate::guard::GetMut;
use crate::sync::{Mutex, lock};

/// Sends posted and not yet read by the destination's feeder, at most.
pub const RING: usize = 256;
/// Bytes of one posted send in the ring.
const DESC: usize = 512;
/// Bytes of an op's text in a posted send (longer text is cut).
const TEXT: usize = 320;
/// Bytes of why a lane was aborted (longer is cut).
const WHY: usize = 1024;
/// Where the counters start: after the slots.
const CONTROL_AT: usize = SLOTS * 4;
/// Where why starts.
const WHY_AT: usize = CONTROL_AT + 512;
/// Where the ring starts.
const RING_AT: usize = CONTROL_AT + 4096;
/// Where the source's table starts: its arena's handle, then its events'.
const TABLE_AT: usize = RING_AT + RING * DESC;
/// Interprocess events per lane, all made and opened at setup: at most
/// this many sends of a lane are in flight unmatched (or not yet waited
/// for by the destination's copy stream).
pub const EVENTS: usize = 256;
/// The segment's size.
pub const SEGMENT: usize = TABLE_AT + 64 + EVENTS * 64 + 4032;
/// What a segment holds once its maker has set it up.
const MAGIC: u64 = u64::from_le_bytes(*b"duplexC1");

/// The counters, shared by the two processes.
#[repr(C)]
struct Control {
    magic: AtomicU64,
    /// The source opened and registered the segment.
    attached: AtomicU32,
    /// The source wrote its table (its arena's and events' handles).
    prepared: AtomicU32,
    /// 0: not aborted; 1: why is being written; 2: why is there.
    aborted: AtomicU32,
    why_len: AtomicU32,
    /// A futex word: bumped after each post and on an abort.
    bell: AtomicU32,
    /// Written by the destination's copy stream: the last message copied,
    /// plus one (compared cyclically).
    copied: AtomicU32,
    /// Sends posted.
    posted: AtomicU64,
    /// Sends read by the feeder.
    consumed: AtomicU64,
    /// Messages whose copy, with its wait on the send's ready event, is on
    /// the copy stream.
    enqueued: AtomicU64,
    /// Messages whose buffer mapping the destination no longer holds.
    unmapped: AtomicU64,
}

/// A posted send.
#[repr(C)]
struct Desc {
    /// `k + 1` once the rest is written.
    seq: AtomicU64,
    k: u64,
    bytes: u64,
    offset: u64,
    dtype: i32,
    event: u32,
    text_len: u32,
    _pad: u32,
    mem: [u8; 64],
    event_handle: [u8; 64],
    text: [u8; TEXT],
}

const _: () = assert!(std::mem::size_of::<Control>() <= WHY_AT - CONTROL_AT);
const _: () = assert!(std::mem::size_of::<Desc>() <= DESC);
const _: () = assert!(WHY_AT + WHY <= RING_AT);
const _: () = assert!(SEGMENT.is_multiple_of(4096));

/// Whether `bytes` at `offset` lie within an arena of `size` bytes: checked
/// by the source before it posts a send, and again by the destination of
/// what another process posted.
fn within_arena(offset: u64, bytes: usize, size: u64) -> bool {
    offset
        .checked_add(bytes as u64)
        .is_some_and(|end| end <= size)
}

/// What the source writes for the destination to open at setup: its
/// arena's handle and size, and its events' handles.
type Table = ([u8; 64], u64, Vec<[u8; 64]>);

/// The shared-memory segment of one lane, mapped in this process.
#[derive(Debug)]
pub struct Segment {
    base: *mut u8,
    name: String,
    /// Made here (the destination): it unlinks the name.
    maker: bool,
    unlinked: AtomicBool,
    /// Never unmapped: a stream may still wait on it.
    leak: AtomicBool,
}

// SAFETY: the mapping is shared memory accessed through atomics (the
// counters, each posted send's `seq`) or written before and read after
// one (the rest of a posted send, why).
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

fn os_error(what: &str, name: &str) -> Error {
    Error::Aborted(format!(
        "{what} of shared-memory segment {name} failed: {}",
        std::io::Error::last_os_error()
    ))
}

impl Segment {
    /// The name of the segment of lane `src -> dst` of the job whose
    /// world communicator's unique id is `job` (the same on every rank).
    pub fn name(job: &[u8], src: u32, dst: u32) -> String {
        // FNV-1a: enough to tell jobs apart on one host.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in job {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        format!("/duplex-{h:016x}-{src}-{dst}")
    }

    /// Makes the segment `name` (the destination's side). Fails if it
    /// exists.
    pub fn create(name: &str) -> Result<Segment, Error> {
        let c = std::ffi::CString::new(name)
            .map_err(|_| Error::Aborted(format!("bad segment name {name:?}")))?;
        // SAFETY: a plain POSIX call on a NUL-terminated name.
        let fd = unsafe {
            libc::shm_open(
                c.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                0o600,
            )
        };
        if fd < 0 {
            return Err(os_error("creating", name));
        }
        // SAFETY: `fd` is the new object.
        let sized = unsafe { libc::ftruncate(fd, SEGMENT as libc::off_t) } == 0;
        let seg = if sized {
            Segment::map(fd, name, true)
        } else {
            Err(os_error("sizing", name))
        };
        // SAFETY: `fd` is open; the mapping (if any) outlives it.
        unsafe { libc::close(fd) };
        let seg = match seg {
            Ok(s) => s,
            Err(e) => {
                // SAFETY: as above.
                unsafe { libc::shm_unlink(c.as_ptr()) };
                return Err(e);
            }
        };
        seg.control().magic.store(MAGIC, Ordering::Release);
        Ok(seg)
    }

    /// Opens the segment `name` made by the destination, waiting for it
    /// until `deadline`.
    pub fn open(name: &str, deadline: Instant) -> Result<Segment, Error> {
        let c = std::ffi::CString::new(name)
            .map_err(|_| Error::Aborted(format!("bad segment name {name:?}")))?;
        loop {
            // SAFETY: a plain POSIX call on a NUL-terminated name.
            let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR, 0) };
            if fd >= 0 {
                // SAFETY: `fd` is open.
                let mut st: libc::stat = unsafe { std::mem::zeroed() };
                // SAFETY: as above.
                let ok = unsafe { libc::fstat(fd, &mut st) } == 0;
                let seg = if ok && st.st_size as usize >= SEGMENT {
                    Segment::map(fd, name, false).map(Some)
                } else {
                    Ok(None)
                };
                // SAFETY: as above.
                unsafe { libc::close(fd) };
                if let Some(seg) = seg?
                    && seg.control().magic.load(Ordering::Acquire) == MAGIC
                {
                    return Ok(seg);
                }
            }
            if Instant::now() >= deadline {
                return Err(Error::Aborted(format!(
                    "shared-memory segment {name} did not appear: is the destination rank's process running duplex with copy_from set, on this host?"
                )));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn map(fd: i32, name: &str, maker: bool) -> Result<Segment, Error> {
        // SAFETY: maps `SEGMENT` bytes of the object, shared.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                SEGMENT,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_error("mapping", name));
        }
        Ok(Segment {
            base: p as *mut u8,
            name: name.to_string(),
            maker,
            unlinked: AtomicBool::new(false),
            leak: AtomicBool::new(false),
        })
    }

    /// Its name.
    pub fn segment_name(&self) -> &str {
        &self.name
    }

    /// The address of the mapping in this process (what CUDA registers).
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    fn control(&self) -> &Control {
        // SAFETY: within the mapping, aligned (page + 4096), and only ever
        // accessed through atomics.
        unsafe { &*(self.base.add(CONTROL_AT) as *const Control) }
    }

    /// The byte offset of flag slot `i` in the segment.
    pub fn slot_offset(i: usize) -> usize {
        i * 4
    }

    /// The byte offset of the copied counter in the segment.
    pub fn copied_offset() -> usize {
        CONTROL_AT + std::mem::offset_of!(Control, copied)
    }

    fn slot(&self, i: usize) -> &AtomicU32 {
        // SAFETY: slot `i < SLOTS` is within the mapping and aligned; the
        // devices write it too, whole words.
        unsafe { &*(self.base.add(Segment::slot_offset(i % SLOTS)) as *const AtomicU32) }
    }

    /// What flag slot `i` holds.
    pub fn slot_value(&self, i: usize) -> u32 {
        self.slot(i).load(Ordering::Acquire)
    }

    /// The copied counter (message number + 1 of the last copy).
    pub fn copied(&self) -> u32 {
        self.control().copied.load(Ordering::Acquire)
    }

    /// Messages whose copy is enqueued with its waits.
    pub fn enqueued(&self) -> u64 {
        self.control().enqueued.load(Ordering::Acquire)
    }

    /// Messages whose mapping the destination no longer holds.
    pub fn unmapped(&self) -> u64 {
        self.control().unmapped.load(Ordering::Acquire)
    }

    /// Writes `RELEASED` into every slot, from the host (X2).
    pub fn release_all(&self) {
        for i in 0..SLOTS {
            self.slot(i).store(RELEASED, Ordering::Release);
        }
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Says the lane was aborted for `why`, unless it was already; rings
    /// the bell. True if this was the first.
    pub fn abort(&self, why: &str) -> bool {
        let c = self.control();
        if c.aborted
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        let mut n = why.len().min(WHY);
        while !why.is_char_boundary(n) {
            n -= 1;
        }
        // SAFETY: `WHY` bytes at `WHY_AT` are within the mapping; only the
        // one writer that won the exchange above writes them, and readers
        // read them only after `aborted` is 2.
        unsafe { std::ptr::copy_nonoverlapping(why.as_ptr(), self.base.add(WHY_AT), n) };
        c.why_len.store(n as u32, Ordering::Release);
        c.aborted.store(2, Ordering::Release);
        self.ring();
        true
    }

    /// Why the lane was aborted, once that is readable.
    pub fn why(&self) -> Option<Arc<str>> {
        let c = self.control();
        match c.aborted.load(Ordering::Acquire) {
            0 => return None,
            // Being written (or its writer died writing it).
            1 => return Some("the lane was aborted by its other side".into()),
            _ => {}
        }
        let n = (c.why_len.load(Ordering::Acquire) as usize).min(WHY);
        // SAFETY: written before `aborted` became 2, never again.
        let bytes = unsafe { std::slice::from_raw_parts(self.base.add(WHY_AT), n) };
        Some(String::from_utf8_lossy(bytes).into())
    }

    fn ring(&self) {
        let bell = &self.control().bell;
        bell.fetch_add(1, Ordering::AcqRel);
        // SAFETY: a futex wake on a word of a shared mapping (not private:
        // the waiter is another process).
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                bell.as_ptr(),
                libc::FUTEX_WAKE,
                i32::MAX,
                std::ptr::null::<libc::timespec>(),
                std::ptr::null::<u32>(),
                0,
            )
        };
    }

    /// Waits until the bell moves from `seen`, at most `timeout`.
    fn wait_bell(&self, seen: u32, timeout: Duration) {
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: as in `ring`; returns at once if the word moved.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.control().bell.as_ptr(),
                libc::FUTEX_WAIT,
                seen,
                &ts as *const libc::timespec,
                std::ptr::null::<u32>(),
                0,
            )
        };
    }

    fn bell(&self) -> u32 {
        self.control().bell.load(Ordering::Acquire)
    }

    /// The source says it opened the segment.
    fn attach(&self) {
        self.control().attached.store(1, Ordering::Release);
    }

    /// Removes the name once the source has opened it (or always, with
    /// `force`): the memory lives while either process maps it.
    fn unlink(&self, force: bool) {
        if !self.maker || self.unlinked.load(Ordering::Acquire) {
            return;
        }
        if !force && self.control().attached.load(Ordering::Acquire) == 0 {
            return;
        }
        if !self.unlinked.swap(true, Ordering::AcqRel)
            && let Ok(c) = std::ffi::CString::new(self.name.as_str())
        {
            // SAFETY: a plain POSIX call.
            unsafe { libc::shm_unlink(c.as_ptr()) };
        }
    }

    /// Never unmaps it.
    pub fn leak(&self) {
        self.leak.store(true, Ordering::Release);
    }

    /// The source writes its table: its arena's handle and its events'.
    fn write_table(&self, arena: &[u8; 64], bytes: u64, events: &[[u8; 64]]) {
        // SAFETY: the table is within the mapping; only the source writes
        // it, once, before `prepared`; the destination reads it after.
        unsafe {
            std::ptr::copy_nonoverlapping(arena.as_ptr(), self.base.add(TABLE_AT), 64);
            std::ptr::write_volatile(
                self.base.add(TABLE_AT + 64 + EVENTS * 64) as *mut u64,
                bytes,
            );
            for (i, h) in events.iter().take(EVENTS).enumerate() {
                std::ptr::copy_nonoverlapping(
                    h.as_ptr(),
                    self.base.add(TABLE_AT + 64 + i * 64),
                    64,
                );
            }
        }
        self.control()
            .prepared
            .store(events.len().min(EVENTS) as u32 + 1, Ordering::Release);
    }

    /// The source's table once written: its arena's handle and size, and its
    /// events', waiting for it until `deadline`.
    fn read_table(&self, deadline: Instant) -> Result<Table, Error> {
        loop {
            let n = self.control().prepared.load(Ordering::Acquire);
            if n > 0 {
                let read = |at: usize| {
                    let mut h = [0u8; 64];
                    // SAFETY: written before `prepared` (acquire above).
                    unsafe { std::ptr::copy_nonoverlapping(self.base.add(at), h.as_mut_ptr(), 64) };
                    h
                };
                let events = (0..(n as usize - 1).min(EVENTS))
                    .map(|i| read(TABLE_AT + 64 + i * 64))
                    .collect();
                // SAFETY: as above; 8-aligned (TABLE_AT and 64-byte steps).
                let bytes = unsafe {
                    std::ptr::read_volatile(self.base.add(TABLE_AT + 64 + EVENTS * 64) as *const u64)
                };
                return Ok((read(TABLE_AT), bytes, events));
            }
            if let Some(why) = self.why() {
                return Err(Error::Aborted(format!("{}: {why}", self.name)));
            }
            if Instant::now() >= deadline {
                return Err(Error::Aborted(format!(
                    "the source of {} did not say what to open within its deadline",
                    self.name
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn desc(&self, k: u64) -> *mut Desc {
        // SAFETY: entry `k % RING` is within the mapping and aligned.
        unsafe { self.base.add(RING_AT + (k as usize % RING) * DESC) as *mut Desc }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        self.unlink(true);
        if !self.leak.load(Ordering::Acquire) {
            // SAFETY: mapped by `map`, unmapped once.
            unsafe { libc::munmap(self.base as *mut libc::c_void, SEGMENT) };
        }
    }
}

/// A send as posted: what the feeder reads.
#[derive(Debug, Clone)]
pub struct Posted {
    /// Its message number.
    pub k: u64,
    /// Its size in bytes.
    pub bytes: usize,
    /// Its element type.
    pub dtype: DType,
    /// Its buffer's allocation, and where in it the buffer starts.
    pub mem: [u8; 64],
    /// Where in the allocation.
    pub offset: u64,
    /// Its ready event's number in the source's pool, and handle.
    pub event: u32,
    /// The event's handle.
    pub event_handle: [u8; 64],
    /// The op as reports name it.
    pub text: String,
}

impl Segment {
    /// Writes posted send `p` (message `p.k`) into the ring and rings the
    /// bell. The caller made sure the entry is free (`posted - consumed <
    /// RING`), and posts in message order.
    fn post(&self, p: &Posted) {
        let d = self.desc(p.k);
        let text = p.text.as_bytes();
        let mut n = text.len().min(TEXT);
        while !p.text.is_char_boundary(n) {
            n -= 1;
        }
        // SAFETY: the entry is not read until `seq` says so (the feeder
        // read its earlier use before `consumed` let this one be written).
        unsafe {
            (*d).k = p.k;
            (*d).bytes = p.bytes as u64;
            (*d).offset = p.offset;
            (*d).dtype = p.dtype.nccl();
            (*d).event = p.event;
            (*d).text_len = n as u32;
            (*d).mem = p.mem;
            (*d).event_handle = p.event_handle;
            std::ptr::copy_nonoverlapping(text.as_ptr(), (*d).text.as_mut_ptr(), n);
            (*d).seq.store(p.k + 1, Ordering::Release);
        }
        self.control().posted.store(p.k + 1, Ordering::Release);
        self.ring();
    }

    /// The next posted send the feeder has not read, if it is there.
    fn next_posted(&self) -> Option<Result<Posted, Error>> {
        let c = self.control();
        let k = c.consumed.load(Ordering::Acquire);
        if c.posted.load(Ordering::Acquire) <= k {
            return None;
        }
        let d = self.desc(k);
        // SAFETY: the entry was written before its `seq` (acquire).
        unsafe {
            if (*d).seq.load(Ordering::Acquire) != k + 1 {
                return None;
            }
            let n = ((*d).text_len as usize).min(TEXT);
            let mut raw = [0u8; TEXT];
            std::ptr::copy_nonoverlapping(
                std::ptr::addr_of!((*d).text) as *const u8,
                raw.as_mut_ptr(),
                TEXT,
            );
            let text = String::from_utf8_lossy(&raw[..n]).into_owned();
            let Some(dtype) = DType::from_nccl((*d).dtype) else {
                return Some(Err(Error::Aborted(format!(
                    "{}: posted send #{k} names element type code {}",
                    self.name,
                    (*d).dtype
                ))));
            };
            if (*d).k != k {
                return Some(Err(Error::Aborted(format!(
                    "{}: the ring's entry for message #{k} holds #{}",
                    self.name,
                    (*d).k
                ))));
            }
            Some(Ok(Posted {
                k,
                bytes: (*d).bytes as usize,
                dtype,
                mem: (*d).mem,
                offset: (*d).offset,
                event: (*d).event,
                event_handle: (*d).event_handle,
                text,
            }))
        }
    }

    /// The feeder read message `k`.
    fn consumed(&self, k: u64) {
        self.control().consumed.store(k + 1, Ordering::Release);
    }

    /// Posted minus read.
    fn unread(&self) -> u64 {
        let c = self.control();
        c.posted
            .load(Ordering::Acquire)
            .saturating_sub(c.consumed.load(Ordering::Acquire))
    }
}

// ---------------------------------------------------------------------------
// The source.

/// What the source of a lane needs of its device. Every call enqueues or
/// asks and returns; none blocks on the device.
pub trait SendApi: Send + Sync {
    /// A user's stream.
    type Stream;
    /// An interprocess event.
    type Event: Send;
    /// A new interprocess event and its handle.
    fn event(&self) -> Result<(Self::Event, [u8; 64]), Error>;
    /// Records `event` on `stream`.
    fn record(&self, event: &Self::Event, stream: &Self::Stream) -> Result<(), Error>;
    /// Whether the event's last record completed.
    fn recorded(&self, event: &Self::Event) -> Result<bool, Error>;
    /// Makes `stream` wait until flag `slot` of the segment holds `value`.
    fn wait(&self, stream: &Self::Stream, slot: usize, value: u32) -> Result<(), Error>;
    /// The handle of the rank's arena, the one allocation its buffers for
    /// copy-engine lanes come from (opened by the destinations at setup).
    fn arena(&self) -> [u8; 64];
    /// The arena's size.
    fn arena_bytes(&self) -> u64;
    /// `ptr`'s offset in the arena, if it is in it.
    fn offset(&self, ptr: u64) -> Option<u64>;
    /// Never unregisters the segment (a stream may wait on it).
    fn leak(&self) {}
}

struct PoolEvent<E> {
    event: E,
    handle: [u8; 64],
    /// The message of its last record.
    last: Option<u64>,
}

/// A send posted and not yet let go.
struct Out {
    k: u64,
    ticket: Arc<Ticket>,
    /// Its buffer, held until the destination no longer maps it.
    keep: Keep,
}

struct SendState {
    next: u64,
    out: VecDeque<Out>,
    aborted: Option<Arc<str>>,
}

/// The source's half of a lane between two processes.
pub struct IpcSender<A: SendApi> {
    name: String,
    api: A,
    seg: Arc<Segment>,
    /// How long a send waits for room in the ring.
    timeout: Duration,
    state: Mutex<SendState>,
    /// The event pool: used only by the issuing thread (one at a time), so
    /// held across its device calls without holding up settles.
    pool: Mutex<Vec<PoolEvent<A::Event>>>,
}

impl<A: SendApi> std::fmt::Debug for IpcSender<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcSender")
            .field("name", &self.name)
            .field("segment", &self.seg.name)
            .finish()
    }
}

impl<A: SendApi> IpcSender<A> {
    /// The source's half of lane `name` over `seg` (opened, and registered
    /// by `api`); a send waits at most `timeout` for room in the ring.
    /// Makes its [`EVENTS`] interprocess events and writes their handles
    /// and its arena's into the segment, for the destination to open them
    /// all before any op can wait ([`Feeder::prepare`]): an IPC open in a
    /// process whose streams wait on a lane can stall until the waits end
    /// (`docs/gpu/ipc-copy-1gpu.md`).
    pub fn new(
        name: impl Into<String>,
        api: A,
        seg: Arc<Segment>,
        timeout: Duration,
    ) -> Result<Self, Error> {
        seg.attach();
        let mut pool = Vec::with_capacity(EVENTS);
        for _ in 0..EVENTS {
            let (event, handle) = api.event()?;
            pool.push(PoolEvent {
                event,
                handle,
                last: None,
            });
        }
        let handles: Vec<[u8; 64]> = pool.iter().map(|e| e.handle).collect();
        seg.write_table(&api.arena(), api.arena_bytes(), &handles);
        Ok(IpcSender {
            name: name.into(),
            api,
            seg,
            timeout,
            state: Mutex::new(SendState {
                next: 0,
                out: VecDeque::new(),
                aborted: None,
            }),
            pool: Mutex::new(pool),
        })
    }

    /// The device side.
    pub fn api(&self) -> &A {
        &self.api
    }

    /// Interprocess events of the pool that were ever recorded.
    pub fn events(&self) -> usize {
        lock(&self.pool).iter().filter(|e| e.last.is_some()).count()
    }

    /// Sends posted whose buffers are still held.
    pub fn held(&self) -> usize {
        lock(&self.state).out.len()
    }

    fn aborted_now(&self, st: &mut SendState) -> Option<Arc<str>> {
        if st.aborted.is_none() {
            st.aborted = self.seg.why();
        }
        st.aborted.clone()
    }

    /// Issues the next send on `stream` (see [`CopyLane::issue`]); posts it
    /// for the destination.
    #[allow(clippy::too_many_arguments)]
    pub fn send(
        &self,
        stream: &A::Stream,
        ptr: u64,
        bytes: usize,
        dtype: DType,
        text: &str,
        keep: Keep,
    ) -> Result<Arc<Ticket>, IssueFailure> {
        let aborted = |why: &str| lane_aborted(text, &self.name, why);
        let k = {
            let mut st = lock(&self.state);
            if let Some(why) = self.aborted_now(&mut st) {
                return Err(failure(aborted(&why), None));
            }
            st.next
        };
        // Room in the ring (the feeder reads it whatever its rank does),
        // then a free event: one deadline for both. While waiting: the
        // error that ends the wait, if one does (an abort; the deadline,
        // which aborts the lane for `what`).
        let start = Instant::now();
        let stop = |what: &dyn Fn() -> String| -> Option<IssueFailure> {
            if let Some(why) = self.seg.why() {
                return Some(failure(aborted(&why), None));
            }
            if start.elapsed() > self.timeout {
                let why = what();
                self.abort(&why);
                return Some(failure(aborted(&why), None));
            }
            std::thread::sleep(Duration::from_micros(100));
            None
        };
        while self.seg.unread() >= RING as u64 {
            if let Some(f) = stop(&|| {
                format!(
                    "the destination's process read none of the last {RING} sends within {:?}: it is stuck or dead",
                    self.timeout
                )
            }) {
                return Err(f);
            }
        }
        // The buffer first: a failure leaves nothing on the stream.
        let inside = |o: &u64| within_arena(*o, bytes, self.api.arena_bytes());
        let Some(offset) = self.api.offset(ptr).filter(inside) else {
            return Err(failure(
                Error::Invalid {
                    at: text.to_string(),
                    message: format!(
                        "its buffer is not in this rank's copy-lane arena, so {} cannot carry it (allocate it with this rank's alloc)",
                        self.name
                    ),
                },
                None,
            ));
        };
        let mem = self.api.arena();
        let (slot, value) = (slot_of(k, SLOTS), generation_of(k, SLOTS));
        let mut pool = lock(&self.pool);
        // A free event of the pool: waits (bounded) while every one is held
        // by a send not yet waited for by the destination's copy stream.
        let (index, handle) = loop {
            match self.pick(&pool) {
                Ok(Some(i)) => break i,
                Ok(None) => {}
                Err(e) => {
                    self.abort(&format!("{text}: {e}"));
                    return Err(failure(e, None));
                }
            }
            if let Some(f) = stop(&|| {
                format!(
                    "all {EVENTS} interprocess events of the lane are held by sends whose copies the destination has not enqueued within {:?} (at most {EVENTS} sends of a lane across processes may be in flight unmatched)",
                    self.timeout
                )
            }) {
                return Err(f);
            }
        };
        let enqueued = self.api.record(&pool[index].event, stream).and_then(|()| {
            self.api.wait(stream, slot, value)?;
            Ok(())
        });
        if let Err(e) = enqueued {
            // Nothing of it blocks its stream; the lane is done for.
            self.abort(&format!("{text}: {e}"));
            return Err(failure(e, None));
        }
        pool[index].last = Some(k);
        drop(pool);
        let ticket = Ticket::waiting(k);
        let mut st = lock(&self.state);
        st.next = k + 1;
        let why = self.aborted_now(&mut st);
        st.out.push_back(Out {
            k,
            ticket: ticket.clone(),
            keep,
        });
        if let Some(why) = why {
            // Aborted meanwhile: the abort released the slots, so the wait
            // just enqueued passes; the op failed. Not posted.
            ticket.set(TicketState::Failed(why.clone()));
            return Err(failure(aborted(&why), Some(ticket)));
        }
        tracing::debug!(lane = %self.name, k, event = index, bytes, "ipc: posting a send");
        self.seg.post(&Posted {
            k,
            bytes,
            dtype,
            mem,
            offset,
            event: index as u32,
            event_handle: handle,
            text: text.to_string(),
        });
        Ok(ticket)
    }

    /// An event of the pool that may be recorded again: never recorded, or
    /// its last record completed and the destination enqueued its wait on
    /// it (X3).
    fn pick(&self, pool: &[PoolEvent<A::Event>]) -> Result<Option<(usize, [u8; 64])>, Error> {
        let enqueued = self.seg.enqueued();
        for (i, e) in pool.iter().enumerate() {
            let free = match e.last {
                None => true,
                Some(j) => enqueued > j && self.api.recorded(&e.event)?,
            };
            if free {
                return Ok(Some((i, e.handle)));
            }
        }
        Ok(None)
    }

    /// Marks the sends the destination copied delivered, and those of an
    /// aborted lane failed; lets go of the buffers the destination no
    /// longer maps.
    pub fn settle(&self) -> Result<(), Error> {
        let copied = self.seg.copied();
        let unmapped = self.seg.unmapped();
        let mut dropped = Vec::new();
        {
            let mut st = lock(&self.state);
            let why = self.aborted_now(&mut st);
            if why.is_some() {
                // A late copy's own write can land after any release.
                self.seg.release_all();
            }
            for o in &st.out {
                match &why {
                    // Once aborted, a send not yet seen delivered fails,
                    // even if its copy ran: the abort may have let its
                    // stream go on before the copy read the buffer (as the
                    // destination fails a copy seen done after its abort).
                    Some(w) => o.ticket.set(TicketState::Failed(w.clone())),
                    None if satisfies(copied, (o.k + 1) as u32) => {
                        o.ticket.set(TicketState::Delivered)
                    }
                    None => {}
                }
            }
            while st.out.front().is_some_and(|o| o.k < unmapped) {
                if let Some(o) = st.out.pop_front() {
                    dropped.push(o.keep);
                }
            }
        }
        drop(dropped);
        Ok(())
    }

    /// Aborts the lane, here and for the destination (see the module
    /// docs); idempotent.
    pub fn abort(&self, why: &str) {
        // The reason before the release: a stream the release lets go finds
        // why on either side.
        self.tell(why);
        {
            let mut st = lock(&self.state);
            if st.aborted.is_none() {
                st.aborted = Some(self.seg.why().unwrap_or_else(|| why.into()));
            }
        }
        self.seg.release_all();
        let _ = self.settle();
    }

    /// Writes the abort's reason into the segment (the first one stays).
    fn tell(&self, why: &str) {
        self.seg.abort(&format!("{why} (aborted by its source)"));
    }

    /// Why the lane was aborted, on either side.
    pub fn aborted(&self) -> Option<Arc<str>> {
        let mut st = lock(&self.state);
        self.aborted_now(&mut st)
    }
}

impl<A: SendApi> Drop for IpcSender<A> {
    fn drop(&mut self) {
        let _ = self.settle();
        let st = self.state.get_mut_or_lock();
        if !st.out.is_empty() || st.aborted.is_some() {
            // The destination may still map these buffers, and a stream of
            // this process may still wait on the segment: keep all of it.
            for o in st.out.drain(..) {
                std::mem::forget(o.keep);
            }
            // The destination's copy stream may still wait on them.
            std::mem::forget(std::mem::take(self.pool.get_mut_or_lock()));
            self.api.leak();
            self.seg.leak();
        }
    }
}

impl<A: SendApi<Stream = crate::cuda::Stream> + 'static> CopyPath for IpcSender<A> {
    fn issue(
        &self,
        dir: Dir,
        stream: &crate::cuda::Stream,
        ptr: u64,
        bytes: usize,
        dtype: DType,
        text: &str,
        keep: Keep,
    ) -> Result<Arc<Ticket>, IssueFailure> {
        if dir != Dir::Send {
            return Err(failure(
                Error::Aborted(format!("{text}: {} carries sends only", self.name)),
                None,
            ));
        }
        self.send(stream, ptr, bytes, dtype, text, keep)
    }
    fn settle(&self) -> Result<(), Error> {
        IpcSender::settle(self)
    }
    fn watch(&self) {
        // Host memory only: the segment's counters and why (and, once
        // aborted, every slot released again).
        let _ = self.settle();
    }
    fn let_go(&self, why: &str) {
        self.tell(why);
        self.seg.release_all();
    }
    fn abort(&self, why: &str) {
        IpcSender::abort(self, why)
    }
    fn aborted(&self) -> Option<Arc<str>> {
        IpcSender::aborted(self)
    }
}

// ---------------------------------------------------------------------------
// The destination.

/// What the destination needs of its device to take the source's sends:
/// open its events and map its arena, both at setup ([`Feeder::prepare`]).
pub trait OpenApi: Send + Sync + 'static {
    /// An opened event: the destination lane's ready event.
    type Ready: Clone + Send;
    /// Opens the source's event.
    fn open_event(&self, handle: &[u8; 64]) -> Result<Self::Ready, Error>;
    /// Maps the source's arena; returns its address here. It stays mapped
    /// for the life of the process.
    fn open_mem(&self, handle: &[u8; 64]) -> Result<u64, Error>;
}

/// Which messages the destination let go of (their copies done, or never
/// to be enqueued), above the first it still holds.
#[derive(Default)]
struct LetGo {
    above: BTreeSet<u64>,
    /// Every message below it was let go.
    next: u64,
}

/// A message's hold on the source's buffer: dropped once its copy is done
/// (or will never be enqueued); then the source may reuse the buffer's
/// part of its arena once every earlier message was let go too (the
/// segment's `unmapped` counter, raised in message order).
struct Hold {
    k: u64,
    let_go: Arc<Mutex<LetGo>>,
    seg: Arc<Segment>,
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut g = lock(&self.let_go);
        g.above.insert(self.k);
        while g.above.first() == Some(&g.next) {
            g.above.pop_first();
            g.next += 1;
        }
        self.seg.control().unmapped.store(g.next, Ordering::Release);
    }
}

/// The destination's reader of the ring: takes each posted send into its
/// lane.
pub struct Feeder<A: CopyApi, O: OpenApi<Ready = A::Ready>> {
    lane: std::sync::Weak<CopyLane<A>>,
    seg: Arc<Segment>,
    open: Arc<O>,
    /// The source's events, opened at setup, by their number.
    events: Vec<O::Ready>,
    /// The source's arena: its handle, and where it is mapped here.
    arena: Option<([u8; 64], u64)>,
    /// The source's arena's size.
    arena_bytes: u64,
    let_go: Arc<Mutex<LetGo>>,
}

impl<A: CopyApi + 'static, O: OpenApi<Ready = A::Ready>> Feeder<A, O>
where
    A::Ready: Clone,
{
    /// The feeder of `lane` over `seg`.
    pub fn new(lane: &Arc<CopyLane<A>>, seg: Arc<Segment>, open: Arc<O>) -> Self {
        Feeder {
            lane: Arc::downgrade(lane),
            seg,
            open,
            events: Vec::new(),
            arena: None,
            arena_bytes: 0,
            let_go: Arc::new(Mutex::new(LetGo::default())),
        }
    }

    /// Opens everything the source will name, before any op of either
    /// rank can wait on a lane: its arena and its events, once the source
    /// wrote their handles (waiting for that until `deadline`).
    pub fn prepare(&mut self, deadline: Instant) -> Result<(), Error> {
        let (arena, bytes, events) = self.seg.read_table(deadline)?;
        let base = self.open.open_mem(&arena)?;
        self.arena = Some((arena, base));
        self.arena_bytes = bytes;
        self.events = events
            .iter()
            .map(|h| self.open.open_event(h))
            .collect::<Result<_, _>>()?;
        Ok(())
    }

    /// Takes what was posted; passes an abort either way. False once the
    /// lane is gone.
    pub fn poll(&mut self) -> bool {
        let Some(lane) = self.lane.upgrade() else {
            return false;
        };
        self.seg.unlink(false);
        if let Some(why) = self.seg.why()
            && lane.aborted().is_none()
        {
            lane.abort(&why);
        }
        while lane.aborted().is_none() {
            let p = match self.seg.next_posted() {
                None => break,
                Some(Ok(p)) => p,
                Some(Err(e)) => {
                    lane.abort(&e.to_string());
                    break;
                }
            };
            if let Err(e) = self.take(&lane, p) {
                lane.abort(&e.to_string());
            }
        }
        true
    }

    fn take(&mut self, lane: &CopyLane<A>, p: Posted) -> Result<(), Error> {
        let Some(ready) = self.events.get(p.event as usize).cloned() else {
            return Err(Error::Aborted(format!(
                "{}: send #{} names event {}, which the source did not give at setup",
                lane.name(),
                p.k,
                p.event
            )));
        };
        let base = match self.arena {
            Some((h, base)) if h == p.mem && within_arena(p.offset, p.bytes, self.arena_bytes) => {
                base
            }
            _ => {
                return Err(Error::Aborted(format!(
                    "{}: send #{} ({} bytes at offset {}) is not within the source's arena",
                    lane.name(),
                    p.k,
                    p.bytes,
                    p.offset
                )));
            }
        };
        let keep = Hold {
            k: p.k,
            let_go: self.let_go.clone(),
            seg: self.seg.clone(),
        };
        self.seg.consumed(p.k);
        tracing::debug!(
            lane = lane.name(),
            k = p.k,
            event = p.event,
            "ipc: took a send"
        );
        lane.issue_remote(
            p.k,
            ready,
            base + p.offset,
            p.bytes,
            p.dtype,
            p.text,
            Box::new(keep),
        )
    }

    /// Runs the feeder on a thread of its own until the lane is dropped.
    pub fn start(mut self, name: &str) -> Result<(), Error>
    where
        O: 'static,
        A::Ready: 'static,
    {
        std::thread::Builder::new()
            .name(format!("duplex feeder {name}"))
            .spawn(move || {
                loop {
                    let seen = self.seg.bell();
                    if !self.poll() {
                        return;
                    }
                    self.seg.wait_bell(seen, Duration::from_millis(50));
                }
            })
            .map(drop)
            .map_err(|e| Error::Aborted(format!("cannot start the feeder of {name}: {e}")))
    }
}

impl<A: CopyApi, O: OpenApi<Ready = A::Ready>> std::fmt::Debug for Feeder<A, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Feeder")
            .field("segment", &self.seg.name)
            .finish()
    }
}

impl Segment {
    /// The destination's copy stream wrote message `k`'s slot: it enqueued
    /// `k`'s waits before (the source may record `k`'s event again).
    fn enqueued_through(&self, k: u64) {
        self.control().enqueued.fetch_max(k + 1, Ordering::AcqRel);
    }
}

pub use cuda::lanes;

/// The CUDA side: [`SendApi`], [`OpenApi`] and the destination's
/// [`CopyApi`] on GPUs, and [`lanes`], which makes a rank's lanes.
pub mod cuda {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    use cudarc::driver::sys;
    use duplex::{Dir, Error, Policy, Rank, compile};

    use super::{Feeder, IpcSender, OpenApi, SEGMENT, SLOTS, Segment, SendApi};
    use crate::copy::{CopyApi, CopyFailed, CopyLane, CopyPath};
    use crate::cuda::{Arena, Device, Event, Stream, check};

    /// The segment registered with CUDA: its device address.
    #[derive(Debug)]
    struct Registered {
        host: *mut u8,
        dev: u64,
        leak: AtomicBool,
        /// Unregistered with its context current.
        device: Arc<Device>,
    }

    // SAFETY: a registration is a plain address range, usable from any
    // thread.
    unsafe impl Send for Registered {}
    // SAFETY: as above.
    unsafe impl Sync for Registered {}

    impl Registered {
        fn new(seg: &Segment, device: &Arc<Device>) -> Result<Registered, Error> {
            let host = seg.base();
            // SAFETY: `SEGMENT` bytes of a live shared mapping, page-aligned;
            // unregistered before it is unmapped (field order of the
            // holders) or never.
            check("cuMemHostRegister", unsafe {
                sys::cuMemHostRegister_v2(
                    host as *mut std::ffi::c_void,
                    SEGMENT,
                    sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
                )
            })?;
            let mut dev: sys::CUdeviceptr = 0;
            // SAFETY: the range was just registered, device-mapped.
            let r = check("cuMemHostGetDevicePointer", unsafe {
                sys::cuMemHostGetDevicePointer_v2(&mut dev, host as *mut std::ffi::c_void, 0)
            });
            if let Err(e) = r {
                // SAFETY: registered above.
                unsafe { sys::cuMemHostUnregister(host as *mut std::ffi::c_void) };
                return Err(e);
            }
            Ok(Registered {
                host,
                dev,
                leak: AtomicBool::new(false),
                device: device.clone(),
            })
        }

        fn slot(&self, slot: usize) -> sys::CUdeviceptr {
            self.dev + Segment::slot_offset(slot % SLOTS) as u64
        }

        fn wait(&self, stream: &Stream, slot: usize, value: u32) -> Result<(), Error> {
            // A kernel, not a stream-wait (`crate::cuda::wait_flag`); the
            // segment is registered for every context.
            crate::cuda::wait_flag(stream, self.slot(slot), value)
        }

        fn write(&self, stream: &Stream, at: sys::CUdeviceptr, value: u32) -> Result<(), Error> {
            // SAFETY: as in `wait`.
            check("cuStreamWriteValue32", unsafe {
                sys::cuStreamWriteValue32_v2(
                    stream.raw() as sys::CUstream,
                    at,
                    value,
                    sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
                )
            })
        }
    }

    impl Drop for Registered {
        fn drop(&mut self) {
            if !self.leak.load(Ordering::Acquire)
                && let Ok(_bound) = self.device.bind_scoped()
            {
                // SAFETY: registered by `new`, once.
                unsafe { sys::cuMemHostUnregister(self.host as *mut std::ffi::c_void) };
            }
        }
    }

    /// The source's device: its interprocess events, its waits, its
    /// buffers' handles.
    #[derive(Debug)]
    pub struct IpcSend {
        reg: Registered,
        device: Arc<Device>,
        arena: Arc<Arena>,
    }

    impl SendApi for IpcSend {
        type Stream = Stream;
        type Event = Event;

        fn event(&self) -> Result<(Event, [u8; 64]), Error> {
            let _bound = self.device.bind_scoped()?;
            Event::interprocess()
        }

        fn record(&self, event: &Event, stream: &Stream) -> Result<(), Error> {
            event.record(stream)
        }

        fn recorded(&self, event: &Event) -> Result<bool, Error> {
            event.done()
        }

        fn wait(&self, stream: &Stream, slot: usize, value: u32) -> Result<(), Error> {
            self.reg.wait(stream, slot, value)
        }

        fn arena(&self) -> [u8; 64] {
            self.arena.handle()
        }

        fn arena_bytes(&self) -> u64 {
            self.arena.size() as u64
        }

        fn offset(&self, ptr: u64) -> Option<u64> {
            self.arena.offset(ptr)
        }

        fn leak(&self) {
            self.reg.leak.store(true, Ordering::Release);
        }
    }

    /// The destination's device: opens the source's events and buffers.
    #[derive(Debug)]
    pub struct IpcOpen {
        device: Arc<Device>,
    }

    impl OpenApi for IpcOpen {
        type Ready = Arc<Event>;

        fn open_event(&self, handle: &[u8; 64]) -> Result<Arc<Event>, Error> {
            let _bound = self.device.bind_scoped()?;
            Event::open_interprocess(handle).map(Arc::new)
        }

        fn open_mem(&self, handle: &[u8; 64]) -> Result<u64, Error> {
            let _bound = self.device.bind_scoped()?;
            // SAFETY: as in `IpcSend::export`.
            let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
            h.reserved = handle.map(|b| b as std::ffi::c_char);
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: the handle of the source's arena, which lives as long
            // as its process; peer access is enabled as needed. Opened once,
            // at setup, and never closed.
            check("cuIpcOpenMemHandle", unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    h,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            })?;
            Ok(ptr)
        }
    }

    /// The destination's lane device: its copy stream, and the segment's
    /// slots and copied counter.
    #[derive(Debug)]
    pub struct IpcRecv {
        reg: Registered,
        device: Arc<Device>,
        stream: Stream,
        seg: Arc<Segment>,
    }

    impl Drop for IpcRecv {
        fn drop(&mut self) {
            if !self.reg.leak.load(Ordering::Acquire)
                && let Ok(_bound) = self.device.bind_scoped()
            {
                // An idle lane: its last writes may still be landing.
                let _ = self.stream.synchronize();
            }
        }
    }

    impl CopyApi for IpcRecv {
        type Stream = Stream;
        type Ready = Arc<Event>;
        type Done = Event;

        fn ready(&self, stream: &Stream) -> Result<Arc<Event>, Error> {
            let e = Event::new(false)?;
            e.record(stream)?;
            Ok(Arc::new(e))
        }

        fn wait(&self, stream: &Stream, slot: usize, value: u32) -> Result<(), Error> {
            self.reg.wait(stream, slot, value)
        }

        fn copy(
            &self,
            send: &Arc<Event>,
            recv: &Arc<Event>,
            dst: u64,
            src: u64,
            bytes: usize,
        ) -> Result<Event, CopyFailed> {
            let _bound = self.device.bind_scoped()?;
            crate::copy::cuda::enqueue_copy(&self.stream, send, recv, bytes, || {
                // SAFETY: the recv buffer is this process's and the send's
                // is in the source's arena, mapped here; both are kept until
                // the done event completes (the lane's `keep`).
                check("cuMemcpyDtoDAsync", unsafe {
                    sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.stream.raw() as sys::CUstream)
                })
            })
        }

        fn may_copy(&self, send: &Arc<Event>, _recv: &Arc<Event>) -> Result<bool, Error> {
            // The source's ready event, recorded in the source's process:
            // the copy stream waits on it only once it has completed
            // (`CopyApi::may_copy`). X3 keeps the source from recording it
            // again until the copy is enqueued, so what was seen complete
            // here is what the copy stream waits for.
            let _bound = self.device.bind_scoped()?;
            send.done()
        }

        fn release(&self, slot: usize, value: u32) -> Result<(), Error> {
            let _bound = self.device.bind_scoped()?;
            // Message k of slot `slot`, generation `value` (`generation_of`).
            let k = u64::from(value - 1) * SLOTS as u64 + slot as u64;
            // The copied counter first: a source released by the slot finds
            // its message copied.
            let copied = self.reg.dev + Segment::copied_offset() as u64;
            let at = self.reg.slot(slot);
            self.reg.write(&self.stream, copied, (k + 1) as u32)?;
            self.reg.write(&self.stream, at, value)?;
            self.seg.enqueued_through(k);
            tracing::debug!(k, slot, value, "ipc: copy and release enqueued");
            Ok(())
        }

        fn done(&self, done: &Event) -> Result<bool, Error> {
            done.done()
        }

        fn release_all(&self) {
            self.seg.release_all();
        }

        fn leak(&self) {
            self.reg.leak.store(true, Ordering::Release);
            self.seg.leak();
        }

        fn aborted(&self, why: &str) {
            self.seg
                .abort(&format!("{why} (aborted by its destination)"));
        }

        fn released_elsewhere(&self) -> Option<Arc<str>> {
            self.seg.why()
        }
    }

    /// The copy-engine lanes of rank `rank` of a job of `world` processes
    /// on one host, each rank on its own `device` (or all on one): for each
    /// other rank, the lane to it (its source half) and the lane from it
    /// (its destination half, with its feeder), and the rank's arena of
    /// `arena` bytes, from which its `alloc` must take the buffers of
    /// copy-engine ops. `job` is the same on every rank (the world
    /// communicator's unique id) and names the segments. Everything the
    /// lanes will open is opened here, before any op can wait; a rank
    /// waits up to `timeout` for its peers' parts.
    pub fn lanes(
        rank: Rank,
        world: u32,
        device: &Arc<Device>,
        job: &[u8],
        timeout: Duration,
        arena: usize,
    ) -> Result<(crate::ctx::CopyLanes, Arc<Arena>), Error> {
        let mut out: Vec<((Rank, Rank), Arc<dyn CopyPath>)> = Vec::new();
        device.bind()?;
        // Everything the lanes will use, before any op can wait.
        crate::cuda::wait_kernel()?;
        let own = Arc::new(Arena::new(arena)?);
        // Destinations first, so that no rank waits for a segment its peer
        // makes only after it waited for one of this rank's.
        let mut feeders = Vec::new();
        for (a, b) in compile::lane_pairs(Policy::PerDirection, world).filter(|p| p.1 == rank) {
            let (name, _, _) = compile::copy_lane(a, Dir::Send, b);
            let seg = Arc::new(Segment::create(&Segment::name(job, a, b))?);
            let api = IpcRecv {
                reg: Registered::new(&seg, device)?,
                device: device.clone(),
                stream: Stream::new()?,
                seg: seg.clone(),
            };
            let lane = Arc::new(CopyLane::new(name.clone(), api));
            CopyLane::start(&lane)?;
            let open = Arc::new(IpcOpen {
                device: device.clone(),
            });
            feeders.push((name, Feeder::new(&lane, seg, open)));
            out.push(((a, b), lane));
        }
        let deadline = Instant::now() + timeout;
        for (a, b) in compile::lane_pairs(Policy::PerDirection, world).filter(|p| p.0 == rank) {
            let (name, _, _) = compile::copy_lane(a, Dir::Send, b);
            let seg = Arc::new(Segment::open(&Segment::name(job, a, b), deadline)?);
            let api = IpcSend {
                reg: Registered::new(&seg, device)?,
                device: device.clone(),
                arena: own.clone(),
            };
            out.push(((a, b), Arc::new(IpcSender::new(name, api, seg, timeout)?)));
        }
        for (name, mut f) in feeders {
            f.prepare(deadline)?;
            f.start(&name)?;
        }
        Ok((out, own))
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
