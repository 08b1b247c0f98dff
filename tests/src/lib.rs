//! duplex-tests: the conformance suite, written once against
//! [`duplex::Transport`] and run on every backend.
//!
//! Each scenario is a plain function generic over the transport, with what
//! it needs (ranks, policy) and what must happen ([`Expect`], under NCCL's
//! contract: no eager capacity, so a real backend's runner sets messages
//! larger than its capacity with [`set_len`]): complete with
//! every delivered byte checked, hang with a report that names the cycle,
//! or fail with a named program error. A backend has one test that runs
//! [`scenarios`] through its own runner and hands each outcome to
//! [`verify`]; a scenario the backend cannot run is reported as skipped,
//! never as passed. Start at [`scenarios`].

#![warn(clippy::print_stdout, clippy::print_stderr)]

pub mod fuzzing;
pub mod strategies;

use duplex::{Dir, Error, Hang, Place, Policy, ProgramErrorKind, Rank, Result, Transport};

use std::sync::atomic::{AtomicUsize, Ordering};

/// Elements per message in the scenarios: 4096 `u32` (16 KiB) unless a
/// runner sets more with [`set_len`].
static LEN: AtomicUsize = AtomicUsize::new(4096);

/// Sets the elements per message of every scenario. A real backend's
/// runner makes messages larger than its eager capacity (R5), so that the
/// scenarios that hang under NCCL's contract hang on it too; the simulator
/// keeps them small.
pub fn set_len(elements: usize) {
    LEN.store(elements.max(2), Ordering::Relaxed);
}

fn len() -> usize {
    LEN.load(Ordering::Relaxed)
}

/// The `copy_from` of the scenarios on copy-engine lanes
/// ([`Scenario::copy`]): half a message, in bytes, so that a message of
/// the scenarios' length ([`set_len`]) goes on the copy-engine lane and
/// one of a quarter of that stays on NCCL.
pub fn copy_threshold() -> duplex::Size {
    duplex::Size((len() * std::mem::size_of::<u32>() / 2) as u64)
}

/// What a scenario must do on a correct backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// Complete on every rank, with every delivered byte checked.
    Completes,
    /// Hang: the backend must return its hang error, naming a cycle or a
    /// missing partner, instead of blocking.
    Hangs,
    /// Hang in some interleavings of its host threads: an exhaustive backend
    /// must find the hang; a real one may complete (with every byte checked)
    /// or hang (with a report).
    MayHang,
    /// Fail with the program error of this kind (`size-mismatch`,
    /// `type-mismatch`).
    Fails(ProgramErrorKind),
    /// A send that no rank receives, small enough for NCCL to buffer (R5):
    /// never `Ok`. A backend that completes the send into its channel's
    /// buffer (NCCL, and the model under an eager capacity) must fail with
    /// `never-received` once every rank has finished, naming the send; one
    /// that does not buffer it (the model's contract, eager capacity 0)
    /// must report the hang, naming the missing partner.
    Unreceived,
    /// A thread's own error, whose text contains this, must be the run's:
    /// never `Ok`, whatever the rank's code did with it.
    ThreadFails(&'static str),
}

/// One scenario.
pub struct Scenario<T: Transport> {
    /// Its name.
    pub name: &'static str,
    /// What it shows.
    pub about: &'static str,
    /// The ranks it runs on.
    pub ranks: u32,
    /// The placement policy.
    pub policy: Policy,
    /// Under `per-direction`, large ops go on copy-engine lanes, from
    /// [`copy_threshold`] up (C1–C6 of `docs/semantics.md`).
    pub copy: bool,
    /// Its communicators are connected on first use (`lazy-connect=on`;
    /// `Local::warm(false)` on GPUs), not at creation as in every other
    /// scenario: its first op on a channel waits in its connection
    /// handshake (R7).
    pub cold: bool,
    /// What must happen.
    pub expect: Expect,
    /// The rank code.
    pub run: fn(&T) -> Result<()>,
}

impl<T: Transport> Scenario<T> {
    /// The model it is checked under on the simulator: the default, with
    /// `lazy-connect` on when it is [`Scenario::cold`].
    pub fn model(&self) -> duplex::Model {
        model(self.cold)
    }
}

/// The default model, with `lazy-connect` on when `cold`: every scenario
/// is checked under both on the simulator, since the GPU suite runs every
/// job cold too (`DUPLEX_COLD=1`) and expects the same ending.
pub fn model(cold: bool) -> duplex::Model {
    duplex::Model {
        lazy_connect: cold,
        ..duplex::Model::default()
    }
}

impl<T: Transport> std::fmt::Debug for Scenario<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scenario")
            .field("name", &self.name)
            .field("ranks", &self.ranks)
            .field("policy", &self.policy)
            .field("copy", &self.copy)
            .field("cold", &self.cold)
            .field("expect", &self.expect)
            .finish()
    }
}

/// What a backend observed when it ran a scenario.
#[derive(Clone, Debug)]
pub enum Outcome {
    /// Every rank completed.
    Completed,
    /// The backend reported a hang.
    Hang(Box<Hang>),
    /// A rank failed with this error.
    Failed(Error),
    /// The backend could not run the scenario, and why.
    Skipped(String),
}

/// The backend an outcome came from, for what [`verify`] accepts of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The simulator under [`model`]: it explores every interleaving (it
    /// must find a [`Expect::MayHang`] hang) and buffers nothing (eager
    /// capacity 0), so a send no rank receives hangs.
    Simulator,
    /// NCCL, one run. Warm (`cold` false), a small send no rank receives
    /// completes into its channel's buffer (R5) and must end in
    /// `never-received`; cold, it waits in its connection handshake (R7)
    /// and hangs.
    Nccl {
        /// Its communicators connect on first use.
        cold: bool,
    },
}

/// Checks an outcome of `backend` against the scenario's expectation.
pub fn verify<T: Transport>(
    s: &Scenario<T>,
    outcome: &Outcome,
    backend: Backend,
) -> std::result::Result<(), String> {
    let exhaustive = backend == Backend::Simulator;
    // Which ending an unreceived send must have on this backend (found by
    // review: either was accepted on either, so a simulator that buffered
    // under eager 0, or a warm NCCL run that hung, passed).
    let unreceived_hangs = matches!(backend, Backend::Simulator | Backend::Nccl { cold: true });
    match (s.expect, outcome) {
        (Expect::MayHang, Outcome::Completed) if !exhaustive => Ok(()),
        (Expect::Unreceived, Outcome::Hang(_)) if !unreceived_hangs => Err(format!(
            "{}: expected never-received ({backend:?} buffers a small send no rank receives), got {}",
            s.name,
            describe(outcome)
        )),
        (Expect::Unreceived, Outcome::Failed(_)) if unreceived_hangs => Err(format!(
            "{}: expected a hang ({backend:?} does not buffer a send no rank receives), got {}",
            s.name,
            describe(outcome)
        )),
        (_, Outcome::Skipped(why)) => Err(format!("{}: skipped ({why})", s.name)),
        (Expect::Completes, Outcome::Completed) => Ok(()),
        (Expect::Hangs | Expect::MayHang | Expect::Unreceived, Outcome::Hang(h)) => {
            if h.stuck.cycle.is_empty() && h.stuck.missing.is_empty() {
                Err(format!(
                    "{}: the hang report names no cycle and no missing partner:\n{h}",
                    s.name
                ))
            } else {
                Ok(())
            }
        }
        (Expect::Unreceived, Outcome::Failed(Error::Program { kind: k, ops, .. }))
            if *k == ProgramErrorKind::NeverReceived =>
        {
            if ops.iter().any(|o| o.op == duplex::Dir::Send) {
                Ok(())
            } else {
                Err(format!(
                    "{}: the never-received error names no send",
                    s.name
                ))
            }
        }
        (Expect::ThreadFails(text), Outcome::Failed(Error::User(m))) if m.contains(text) => Ok(()),
        (Expect::Fails(kind), Outcome::Failed(Error::Program { kind: k, ops, .. }))
            if *k == kind =>
        {
            if ops.is_empty() {
                Err(format!("{}: the {kind} error names no op", s.name))
            } else {
                Ok(())
            }
        }
        (expect, got) => Err(format!(
            "{}: expected {expect:?}, got {}",
            s.name,
            describe(got)
        )),
    }
}

fn describe(o: &Outcome) -> String {
    match o {
        Outcome::Completed => "completion".into(),
        Outcome::Hang(h) => format!("a hang:\n{h}"),
        Outcome::Failed(e) => format!("an error: {e}"),
        Outcome::Skipped(why) => format!("a skip: {why}"),
    }
}

/// Every scenario, for a backend whose transport is `T`.
pub fn scenarios<T: Transport>() -> Vec<Scenario<T>> {
    use Expect::*;
    use Policy::*;
    let s = |name, about, ranks, policy, expect, run| Scenario {
        name,
        about,
        ranks,
        policy,
        copy: false,
        cold: false,
        expect,
        run,
    };
    let copy = |name, about, ranks, expect, run| Scenario {
        name,
        about,
        ranks,
        policy: PerDirection,
        copy: true,
        cold: false,
        expect,
        run,
    };
    vec![
        s(
            "seed/shared",
            "both ranks send, then receive, on PyTorch's placement: the original hang",
            2,
            Shared,
            Hangs,
            seed::<T>,
        ),
        s(
            "seed/per-direction",
            "the same program on per-direction lanes completes",
            2,
            PerDirection,
            Completes,
            seed::<T>,
        ),
        s(
            "seed-rpc/shared",
            "a sender and a receiver thread per rank, the receiver awaiting the sender's metadata",
            2,
            Shared,
            MayHang,
            seed_rpc::<T>,
        ),
        s(
            "seed-rpc/per-direction",
            "the RPC form on per-direction lanes",
            2,
            PerDirection,
            Completes,
            seed_rpc::<T>,
        ),
        s(
            "ring",
            "every rank sends to the next and receives from the previous, sends first",
            4,
            PerDirection,
            Completes,
            ring::<T>,
        ),
        s(
            "all-to-all",
            "every rank sends to every other, then receives from every other",
            4,
            PerDirection,
            Completes,
            all_to_all::<T>,
        ),
        s(
            "all-to-all/grouped",
            "the same, each rank's sends and recvs in one group, on shared lanes",
            4,
            Shared,
            Completes,
            all_to_all_grouped::<T>,
        ),
        s(
            "1f1b/per-direction",
            "a 1F1B pipeline schedule, 4 stages, 4 microbatches",
            4,
            PerDirection,
            Completes,
            pipeline_1f1b::<T>,
        ),
        s(
            "1f1b/shared",
            "the same schedule on shared lanes: activations and gradients collide",
            4,
            Shared,
            Hangs,
            pipeline_1f1b::<T>,
        ),
        s(
            "group/shared",
            "send and recv fused in a group on one shared lane",
            2,
            Shared,
            Completes,
            grouped::<T>,
        ),
        s(
            "group/read-inside",
            "a host read inside a group of a buffer its recv uses fails with a race, even after a synchronize inside the group; after the group, the bytes are there",
            2,
            Shared,
            Completes,
            read_inside_group::<T>,
        ),
        s(
            "group/nested-fails",
            "a group nested in another whose closure fails: the send it issued is dropped, the outer group's exchange is launched and every byte arrives",
            2,
            Shared,
            Completes,
            nested_group_fails::<T>,
        ),
        s(
            "events",
            "a recv on one stream, an event, and a send of the received data on another stream",
            2,
            PerDirection,
            Completes,
            events_across_streams::<T>,
        ),
        s(
            "events/missing",
            "the same without the event: the send of the received data on the other stream is refused with a race that names the recv; then made with the event, it completes",
            2,
            PerDirection,
            Completes,
            events_missing::<T>,
        ),
        s(
            "events/host-read",
            "a recv on one stream, an event recorded there and waited for on another stream, then a sync of that other stream: the host may read the received bytes (CUDA orders them); a sync of the other stream without the wait covers nothing, nor does it cover a second recv launched after the record: those reads are refused with a race",
            2,
            PerDirection,
            Completes,
            events_host_read::<T>,
        ),
        s(
            "dtype/half",
            "bf16 and f16 buffers (ncclBfloat16, ncclFloat16) each way on per-direction lanes: every element's bits arrive",
            2,
            PerDirection,
            Completes,
            half_precision::<T>,
        ),
        s(
            "group/same-buffer",
            "a group that sends a buffer and receives into it is refused with a race (a group's ops run at once); with two buffers it completes",
            2,
            Shared,
            Completes,
            group_same_buffer::<T>,
        ),
        s(
            "comm/after-wait",
            "rank 1 makes a communicator (ncclCommSplit, collective over every rank) and then sends; rank 0 makes it only after it has received that message: a hang whose cycle runs through the split",
            2,
            Shared,
            Hangs,
            comm_after_wait::<T>,
        ),
        s(
            "comm/beside-send",
            "rank 0 makes a communicator on one thread while another thread of it sends to rank 1, which makes the communicator only after it has received that message: the split holds back no other communicator's calls (R11), so it completes",
            2,
            PerDirection,
            Completes,
            comm_beside_send::<T>,
        ),
        s(
            "spawn/unjoined",
            "rank 0 starts a thread that sends to rank 1 a moment later, and returns without joining it: a rank has finished once all its threads have, so the message arrives",
            2,
            PerDirection,
            Completes,
            unjoined_sender::<T>,
        ),
        s(
            "spawn/join-before-drain",
            "rank 0's thread rx waits for a message that rank 1 sends only once rank 0's code has joined another thread, which ended at once: a join waits for the thread's end, not for the rank's streams to drain, so the message arrives (the model's join waited for the drain until 2026-12-05 and reported a hang here)",
            2,
            PerDirection,
            Completes,
            join_before_drain::<T>,
        ),
        s(
            "spawn/swallowed",
            "rank 0's thread sends to rank 1, then fails its own check; rank 0's code joins it, ignores the error and returns Ok: a thread's error is the rank's, so the run fails with it, never Ok",
            2,
            PerDirection,
            ThreadFails(SWALLOWED),
            swallowed_error::<T>,
        ),
        s(
            "spawn/swallowed-then-wait",
            "rank 0's thread fails before it notifies rank 1; rank 0's code joins it, ignores the error and waits for rank 1's reply, which rank 1 sends only once notified: the thread's failure is the rank's at once, so both ranks end with it (the simulator ends the execution there), not at their deadlines",
            2,
            PerDirection,
            ThreadFails(SWALLOWED),
            swallowed_then_wait::<T>,
        ),
        Scenario {
            cold: true,
            ..s(
                "connect/beside-send",
                "rank 0's first send on its shared lane toward rank 1 waits in its connection handshake (R7, communicators connected on first use) while another thread of rank 0 sends on the world communicator what rank 1 waits for before its first op on that lane: a call on one communicator holds back calls on that one only (R11), so it completes (with lanes made on first use the lane service connects the lane, and only the world's send handshakes)",
                2,
                Shared,
                Completes,
                connect_beside_send::<T>,
            )
        },
        s(
            "reply-after-wait",
            "rank 0 posts a recv, then sends; rank 1 waits for that message before it replies: rank 0's lane toward rank 1 is used (under lazy lanes: made) while its recv waits on the device",
            2,
            PerDirection,
            Completes,
            reply_after_wait::<T>,
        ),
        s(
            "scoped-stream",
            "with_stream places the ops inside it on the user's stream",
            2,
            PerDirection,
            Completes,
            scoped_stream::<T>,
        ),
        s(
            "size-mismatch",
            "rank 0 sends 4096 elements, rank 1 receives 2048",
            2,
            PerDirection,
            Fails(ProgramErrorKind::SizeMismatch),
            size_mismatch::<T>,
        ),
        s(
            "type-mismatch",
            "rank 0 sends u32, rank 1 receives f32",
            2,
            PerDirection,
            Fails(ProgramErrorKind::TypeMismatch),
            type_mismatch::<T>,
        ),
        s(
            "wrong-peer",
            "a send to a rank that does not exist is refused, naming the op; the rank goes on",
            2,
            PerDirection,
            Completes,
            wrong_peer::<T>,
        ),
        s(
            "self-unpaired",
            "a message to itself outside a group is refused, naming the op (R12); in a group it arrives; the rank goes on",
            2,
            PerDirection,
            Completes,
            self_unpaired::<T>,
        ),
        s(
            "unmatched-send",
            "a send that no rank receives",
            2,
            PerDirection,
            Hangs,
            unmatched_send::<T>,
        ),
        s(
            "unmatched-send/small",
            "a 4 KiB send that no rank receives: NCCL completes it into the channel's buffer (R5), so the run must end with never-received naming it, not Ok (under the model's contract, eager capacity 0, it hangs)",
            2,
            PerDirection,
            Unreceived,
            unmatched_send_small::<T>,
        ),
        copy(
            "seed/copy",
            "the seed with its messages on copy-engine lanes completes",
            2,
            Completes,
            seed::<T>,
        ),
        copy(
            "seed-rpc/copy",
            "the RPC form on copy-engine lanes",
            2,
            Completes,
            seed_rpc::<T>,
        ),
        copy(
            "all-to-all/copy",
            "every rank sends to every other, then receives, on copy-engine lanes",
            4,
            Completes,
            all_to_all::<T>,
        ),
        copy(
            "mixed-sizes/copy",
            "large and small messages interleaved both ways: the large on copy-engine lanes, the small on NCCL, one stream per direction (C1)",
            2,
            Completes,
            mixed_sizes::<T>,
        ),
        copy(
            "never-buffered/copy",
            "each rank waits for its send before it receives: a copy-engine lane never buffers (C3)",
            2,
            Hangs,
            send_sync_recv::<T>,
        ),
        copy(
            "size-mismatch/copy",
            "rank 0 sends a message, rank 1 receives three quarters of it, both on the copy-engine lane",
            2,
            Fails(ProgramErrorKind::SizeMismatch),
            size_mismatch_copy::<T>,
        ),
    ]
}

/// Large and small messages interleaved, both ways at once, each checked.
pub fn mixed_sizes<T: Transport>(t: &T) -> Result<()> {
    let peer = 1 - t.rank();
    let sizes = [len(), len() / 4, len(), len() / 4];
    let mut outs = Vec::new();
    for (tag, &n) in sizes.iter().enumerate() {
        outs.push(filled_with(t, peer, tag as u32, n)?);
    }
    let mut ins = Vec::new();
    for &n in &sizes {
        ins.push(t.alloc::<u32>(n)?);
    }
    for o in &outs {
        t.send(o, peer)?;
    }
    for i in ins.iter_mut() {
        t.recv(i, peer)?;
    }
    t.synchronize()?;
    for (tag, i) in ins.iter().enumerate() {
        check(t, i, peer, tag as u32)?;
    }
    Ok(())
}

/// More messages in flight on one lane than a copy-engine lane across
/// processes has interprocess events (256, `duplex_nccl::copy::ipc::EVENTS`):
/// rank 0 sends `count` messages of `n` elements to rank 1 at once, while
/// rank 1 posts its receives in batches of 16 with a pause before each, so
/// that past the 256th send the sender records events again while the
/// destination is still behind (X3 of `docs/semantics.md`); then the same
/// from rank 1 to rank 0. Every byte of every message is checked.
pub fn many_in_flight<T: Transport>(t: &T, count: usize, n: usize) -> Result<()> {
    let peer = 1 - t.rank();
    for src in 0..2 {
        if t.rank() == src {
            let outs = (0..count)
                .map(|k| filled_with(t, peer, k as u32, n))
                .collect::<Result<Vec<_>>>()?;
            for o in &outs {
                t.send(o, peer)?;
            }
            t.synchronize()?;
        } else {
            let mut ins = (0..count)
                .map(|_| t.alloc::<u32>(n))
                .collect::<Result<Vec<_>>>()?;
            for (k, i) in ins.iter_mut().enumerate() {
                if k % 16 == 0 {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                t.recv(i, peer)?;
            }
            t.synchronize()?;
            for (k, i) in ins.iter().enumerate() {
                check(t, i, peer, k as u32)?;
            }
        }
    }
    Ok(())
}

/// Send, wait for the send, then receive: completes only where a send can
/// complete before its recv starts (R5); never on copy-engine lanes (C3).
pub fn send_sync_recv<T: Transport>(t: &T) -> Result<()> {
    send_sync_recv_late(t, std::time::Duration::ZERO)
}

/// [`send_sync_recv`] with rank 1 pausing `late` between its send and its
/// first `synchronize`, so that rank 0's wait reaches its deadline first.
pub fn send_sync_recv_late<T: Transport>(t: &T, late: std::time::Duration) -> Result<()> {
    let peer = 1 - t.rank();
    let out = filled(t, peer, 0)?;
    let mut inb = t.alloc::<u32>(len())?;
    t.send(&out, peer)?;
    if t.rank() == 1 && !late.is_zero() {
        std::thread::sleep(late);
    }
    t.synchronize()?;
    t.recv(&mut inb, peer)?;
    t.synchronize()?;
    check(t, &inb, peer, 0)
}

/// `n` exchanges of 4 KiB, each grouped and synchronized, every one's
/// bytes checked, then the seed: a run long enough that one process per
/// rank cuts its trace where its rank is quiet (`Registry::for_rank` cuts
/// past 4,096 calls), before the hang whose analysis must still name the
/// cycle across the processes from the cut traces.
pub fn long_then_seed<T: Transport>(t: &T, n: u32) -> Result<()> {
    let peer = 1 - t.rank();
    let mut inb = t.alloc::<u32>(1024)?;
    for i in 0..n {
        // The tag numbers the exchange, modulo 4,096.
        let tag = i & 0xfff;
        let out = filled_with(t, peer, tag, 1024)?;
        t.group(|| {
            t.send(&out, peer)?;
            t.recv(&mut inb, peer)
        })?;
        t.synchronize()?;
        check(t, &inb, peer, tag)?;
    }
    seed(t)
}

/// A size mismatch where both sides are on the copy-engine lane.
pub fn size_mismatch_copy<T: Transport>(t: &T) -> Result<()> {
    if t.rank() == 0 {
        let out = filled(t, 1, 0)?;
        t.send(&out, 1)?;
    } else {
        let mut inb = t.alloc::<u32>(len() * 3 / 4)?;
        t.recv(&mut inb, 0)?;
    }
    t.synchronize()
}

/// The value at `i` of a message from `src` to `dst` with `tag`: a hash of
/// the four (SplitMix64's finalizer, a bijection of 64 bits, of the four
/// packed without overlap for ranks below 256, tags below 65,536 and
/// messages below 2^32 elements), cut to 32 bits. Element `i` of one
/// message then equals element `j` of another message, or of itself at
/// another place, only by a 32-bit coincidence, so a delivery into the
/// wrong message or the wrong place fails the element-by-element check
/// (the old `src << 28 ^ dst << 24 ^ tag << 16 ^ i` repeated itself inside
/// a message of 2^16 elements or more).
pub fn pattern(src: Rank, dst: Rank, tag: u32, i: usize) -> u32 {
    let mut x = (u64::from(src & 0xff) << 56)
        ^ (u64::from(dst & 0xff) << 48)
        ^ (u64::from(tag & 0xffff) << 32)
        ^ (i as u64 & 0xffff_ffff);
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    x as u32
}

fn filled<T: Transport>(t: &T, dst: Rank, tag: u32) -> Result<T::Buffer<u32>> {
    filled_with(t, dst, tag, len())
}

/// A buffer of `n` elements holding the message to `dst` with `tag`.
fn filled_with<T: Transport>(t: &T, dst: Rank, tag: u32, n: usize) -> Result<T::Buffer<u32>> {
    let mut buf = t.alloc::<u32>(n)?;
    let data: Vec<u32> = (0..n).map(|i| pattern(t.rank(), dst, tag, i)).collect();
    t.write(&mut buf, &data)?;
    Ok(buf)
}

/// Checks every element of a message from `src` with `tag`.
pub fn check<T: Transport>(t: &T, buf: &T::Buffer<u32>, src: Rank, tag: u32) -> Result<()> {
    use duplex::transport::DeviceBuffer;
    let got = t.read(buf)?;
    // Every element of the buffer, not what the read returned: a read cut
    // short would otherwise pass (found by review).
    if got.len() != buf.len() {
        return Err(Error::User(format!(
            "rank {} read {} elements of a {}-element buffer from rank {src} (tag {tag})",
            t.rank(),
            got.len(),
            buf.len()
        )));
    }
    for (i, g) in got.iter().enumerate() {
        let want = pattern(src, t.rank(), tag, i);
        if *g != want {
            return Err(Error::User(format!(
                "rank {} got wrong data from rank {src} (tag {tag}) at element {i}: {g:#x}, expected {want:#x}",
                t.rank()
            )));
        }
    }
    Ok(())
}

/// A host read inside a group of a buffer a recv of that group uses fails
/// with a race: the group is launched only when it ends, so a
/// `synchronize` inside it waits for nothing of it. After the group and a
/// `synchronize`, the bytes are there.
pub fn read_inside_group<T: Transport>(t: &T) -> Result<()> {
    let peer = 1 - t.rank();
    let out = filled(t, peer, 0)?;
    let mut inb = t.alloc::<u32>(len())?;
    let inside = t.group(|| {
        t.send(&out, peer)?;
        t.recv(&mut inb, peer)?;
        t.synchronize()?;
        Ok(t.read(&inb).map(|v| v.len()))
    })?;
    match inside {
        Err(Error::Race { .. }) => {}
        other => {
            return Err(Error::User(format!(
                "rank {}: a read inside the group of the buffer its recv uses should fail with a race, not {other:?}",
                t.rank()
            )));
        }
    }
    t.synchronize()?;
    check(t, &inb, peer, 0)
}

/// The seed: send to the peer, then receive from it.
pub fn seed<T: Transport>(t: &T) -> Result<()> {
    let peer = 1 - t.rank();
    let out = filled(t, peer, 0)?;
    let mut inb = t.alloc::<u32>(len())?;
    t.send(&out, peer)?;
    t.recv(&mut inb, peer)?;
    t.synchronize()?;
    check(t, &inb, peer, 0)
}

/// The seed's RPC form: a sender thread and a receiver thread per rank.
pub fn seed_rpc<T: Transport>(t: &T) -> Result<()> {
    let peer = 1 - t.rank();
    let tx = t.spawn("tx", move |t: &T| {
        let out = filled(t, peer, 1)?;
        t.notify(peer, "meta")?;
        t.send(&out, peer)?;
        let lane = t.lane(peer, Dir::Send)?;
        t.sync_stream(&lane.stream)
    })?;
    let rx = t.spawn("rx", move |t: &T| {
        let mut inb = t.alloc::<u32>(len())?;
        t.await_notify(peer, "meta")?;
        t.recv(&mut inb, peer)?;
        let lane = t.lane(peer, Dir::Recv)?;
        t.sync_stream(&lane.stream)?;
        check(t, &inb, peer, 1)
    })?;
    t.join(tx)?;
    t.join(rx)
}

/// Rank 0's code starts a thread that sends to rank 1 a moment later and
/// returns without joining it. A rank has finished once every thread of it
/// has (the simulator's execution waits for them; the NCCL backend's end
/// of a rank does too), so the send is made and rank 1 receives it.
pub fn unjoined_sender<T: Transport>(t: &T) -> Result<()> {
    let peer = 1 - t.rank();
    if t.rank() == 0 {
        let _never_joined = t.spawn("late", move |t: &T| {
            std::thread::sleep(std::time::Duration::from_millis(100));
            let out = filled(t, peer, 7)?;
            t.send(&out, peer)?;
            t.synchronize()
        })?;
        Ok(())
    } else {
        let mut inb = t.alloc::<u32>(len())?;
        t.recv(&mut inb, peer)?;
        t.synchronize()?;
        check(t, &inb, peer, 7)
    }
}

/// Rank 0 starts `rx`, which receives from rank 1, and `early`, which
/// ends at once; it joins `early`, then tells rank 1 to send, then joins
/// `rx`. A `join` waits for the thread's end, not for the rank's streams
/// to drain (the NCCL backend's `join` waits for the thread's result), so
/// `rx`'s recv, waiting for the message the notify releases, holds
/// nothing up.
pub fn join_before_drain<T: Transport>(t: &T) -> Result<()> {
    let peer = 1 - t.rank();
    if t.rank() == 0 {
        let rx = t.spawn("rx", move |t: &T| {
            let mut inb = t.alloc::<u32>(len())?;
            t.recv(&mut inb, peer)?;
            t.sync_stream(&t.lane(peer, duplex::Dir::Recv)?.stream)?;
            check(t, &inb, peer, 11)
        })?;
        let early = t.spawn("early", |_: &T| Ok(()))?;
        t.join(early)?;
        t.notify(peer, "go")?;
        t.join(rx)
    } else {
        t.await_notify(peer, "go")?;
        let out = filled(t, peer, 11)?;
        t.send(&out, peer)?;
        t.synchronize()
    }
}

/// What the thread of `spawn/swallowed` fails with.
pub const SWALLOWED: &str = "thread checker's own check failed on purpose";

/// Rank 0 starts a thread that sends to rank 1 and then fails; rank 0's
/// code joins it, ignores its error and returns `Ok`. The error is the
/// rank's all the same (`Transport::spawn`).
pub fn swallowed_error<T: Transport>(t: &T) -> Result<()> {
    let peer = 1 - t.rank();
    if t.rank() == 0 {
        let checker = t.spawn("checker", move |t: &T| {
            let out = filled(t, peer, 9)?;
            t.send(&out, peer)?;
            t.synchronize()?;
            Err(Error::User(SWALLOWED.into()))
        })?;
        // What a careless caller does: the error is dropped here.
        let _ignored = t.join(checker);
        Ok(())
    } else {
        let mut inb = t.alloc::<u32>(len())?;
        t.recv(&mut inb, peer)?;
        t.synchronize()?;
        check(t, &inb, peer, 9)
    }
}

/// The check of `spawn/swallowed-then-wait`'s thread, which fails.
fn failing_check() -> Result<()> {
    Err(Error::User(SWALLOWED.into()))
}

/// Rank 0 starts a thread that fails before it notifies rank 1; rank 0's
/// code joins it, ignores its error and waits for rank 1's reply, which
/// rank 1 sends once notified. The thread's failure is rank 0's at once
/// (`Transport::spawn`): no rank waits for its deadline.
pub fn swallowed_then_wait<T: Transport>(t: &T) -> Result<()> {
    if t.rank() == 0 {
        let checker = t.spawn("checker", move |t: &T| {
            failing_check()?;
            t.notify(1, "go")
        })?;
        let _ignored = t.join(checker);
        t.await_notify(1, "reply")
    } else {
        t.await_notify(0, "go")?;
        t.notify(0, "reply")
    }
}

/// Rank 0 receives first and sends second; rank 1 waits on the host for
/// rank 0's message before it replies. Rank 0's send goes out while its
/// recv waits on the device: with lanes made on first use, the lane it
/// goes on is made then (L1 of `docs/semantics.md`).
pub fn reply_after_wait<T: Transport>(t: &T) -> Result<()> {
    let peer = 1 - t.rank();
    let mut inb = t.alloc::<u32>(len())?;
    if t.rank() == 0 {
        t.recv(&mut inb, peer)?;
        let out = filled(t, peer, 5)?;
        t.send(&out, peer)?;
        t.synchronize()?;
        check(t, &inb, peer, 6)
    } else {
        t.recv(&mut inb, peer)?;
        t.synchronize()?;
        check(t, &inb, peer, 5)?;
        let out = filled(t, peer, 6)?;
        t.send(&out, peer)?;
        t.synchronize()
    }
}

/// A ring: send to the next rank, receive from the previous.
pub fn ring<T: Transport>(t: &T) -> Result<()> {
    let n = t.world_size();
    let (next, prev) = ((t.rank() + 1) % n, (t.rank() + n - 1) % n);
    let out = filled(t, next, 2)?;
    let mut inb = t.alloc::<u32>(len())?;
    t.send(&out, next)?;
    t.recv(&mut inb, prev)?;
    t.synchronize()?;
    check(t, &inb, prev, 2)
}

/// All-to-all by plain sends, then plain recvs.
pub fn all_to_all<T: Transport>(t: &T) -> Result<()> {
    let peers: Vec<Rank> = (0..t.world_size()).filter(|p| *p != t.rank()).collect();
    let outs = peers
        .iter()
        .map(|p| filled(t, *p, 3))
        .collect::<Result<Vec<_>>>()?;
    let mut ins = peers
        .iter()
        .map(|_| t.alloc::<u32>(len()))
        .collect::<Result<Vec<_>>>()?;
    for (p, out) in peers.iter().zip(&outs) {
        t.send(out, *p)?;
    }
    for (p, inb) in peers.iter().zip(ins.iter_mut()) {
        t.recv(inb, *p)?;
    }
    t.synchronize()?;
    for (p, inb) in peers.iter().zip(&ins) {
        check(t, inb, *p, 3)?;
    }
    Ok(())
}

/// All-to-all with each rank's sends and recvs in one group.
pub fn all_to_all_grouped<T: Transport>(t: &T) -> Result<()> {
    let peers: Vec<Rank> = (0..t.world_size()).filter(|p| *p != t.rank()).collect();
    let outs = peers
        .iter()
        .map(|p| filled(t, *p, 4))
        .collect::<Result<Vec<_>>>()?;
    let mut ins = peers
        .iter()
        .map(|_| t.alloc::<u32>(len()))
        .collect::<Result<Vec<_>>>()?;
    t.group(|| {
        for (p, out) in peers.iter().zip(&outs) {
            t.send(out, *p)?;
        }
        for (p, inb) in peers.iter().zip(ins.iter_mut()) {
            t.recv(inb, *p)?;
        }
        Ok(())
    })?;
    t.synchronize()?;
    for (p, inb) in peers.iter().zip(&ins) {
        check(t, inb, *p, 4)?;
    }
    Ok(())
}

/// A 1F1B pipeline: stage `s` runs `n - s - 1` warm-up forwards, then
/// alternates one forward and one backward, then drains the backwards.
/// Forward: receive activations from `s - 1`, send to `s + 1`. Backward:
/// receive gradients from `s + 1`, send to `s - 1`.
pub fn pipeline_1f1b<T: Transport>(t: &T) -> Result<()> {
    const MICROBATCHES: u32 = 4;
    let (s, n) = (t.rank(), t.world_size());
    let warmup = (n - s - 1).min(MICROBATCHES);
    let mut acts = Vec::new();
    let mut grads = Vec::new();
    let mut outs = Vec::new();
    let forward = |mb: u32,
                   acts: &mut Vec<(T::Buffer<u32>, u32)>,
                   outs: &mut Vec<T::Buffer<u32>>|
     -> Result<()> {
        if s > 0 {
            let mut a = t.alloc::<u32>(len())?;
            t.recv(&mut a, s - 1)?;
            acts.push((a, mb));
        }
        if s + 1 < n {
            let out = filled(t, s + 1, 10 + mb)?;
            t.send(&out, s + 1)?;
            outs.push(out);
        }
        Ok(())
    };
    let backward = |mb: u32,
                    grads: &mut Vec<(T::Buffer<u32>, u32)>,
                    outs: &mut Vec<T::Buffer<u32>>|
     -> Result<()> {
        if s + 1 < n {
            let mut g = t.alloc::<u32>(len())?;
            t.recv(&mut g, s + 1)?;
            grads.push((g, mb));
        }
        if s > 0 {
            let out = filled(t, s - 1, 20 + mb)?;
            t.send(&out, s - 1)?;
            outs.push(out);
        }
        Ok(())
    };
    for mb in 0..warmup {
        forward(mb, &mut acts, &mut outs)?;
    }
    for i in 0..MICROBATCHES - warmup {
        forward(warmup + i, &mut acts, &mut outs)?;
        backward(i, &mut grads, &mut outs)?;
    }
    for mb in MICROBATCHES - warmup..MICROBATCHES {
        backward(mb, &mut grads, &mut outs)?;
    }
    t.synchronize()?;
    for (a, mb) in &acts {
        check(t, a, s - 1, 10 + mb)?;
    }
    for (g, mb) in &grads {
        check(t, g, s + 1, 20 + mb)?;
    }
    Ok(())
}

/// Send and recv in one group, on one shared lane.
pub fn grouped<T: Transport>(t: &T) -> Result<()> {
    let out = filled(t, 1 - t.rank(), 5)?;
    exchange_grouped(t, &out, 5)
}

/// A group nested in another whose closure fails: what it issued is
/// dropped and the outer group's ops are launched. Were the nested send
/// launched, the peer's recv would meet it first (wrong data), and the
/// exchange's send would be left without a recv (a hang).
pub fn nested_group_fails<T: Transport>(t: &T) -> Result<()> {
    let peer = 1 - t.rank();
    let extra = filled(t, peer, 13)?;
    let out = filled(t, peer, 14)?;
    let mut inb = t.alloc::<u32>(len())?;
    t.group(|| {
        let inner = t.group(|| {
            t.send(&extra, peer)?;
            Err::<(), _>(Error::User("the nested group's closure fails".into()))
        });
        if inner.is_ok() {
            return Err(Error::User("the nested group's error was lost".into()));
        }
        t.send(&out, peer)?;
        t.recv(&mut inb, peer)
    })?;
    t.synchronize()?;
    check(t, &inb, peer, 14)
}

/// Sends `out` (the message with `tag`) to the peer and receives the
/// peer's into a new buffer, in one group; checks every byte.
fn exchange_grouped<T: Transport>(t: &T, out: &T::Buffer<u32>, tag: u32) -> Result<()> {
    let peer = 1 - t.rank();
    let mut inb = t.alloc::<u32>(len())?;
    t.group(|| {
        t.send(out, peer)?;
        t.recv(&mut inb, peer)
    })?;
    t.synchronize()?;
    check(t, &inb, peer, tag)
}

/// Rank 0 sends a message to rank 1; rank 1 receives it on stream `a`,
/// records an event there, makes stream `b` wait for it, and sends the
/// received buffer back on `b`. Rank 0 must get its own data back: without
/// the event, the send could read the buffer before the recv filled it.
pub fn events_across_streams<T: Transport>(t: &T) -> Result<()> {
    if t.rank() == 0 {
        let out = filled(t, 1, 6)?;
        let mut back = t.alloc::<u32>(len())?;
        t.send(&out, 1)?;
        t.recv(&mut back, 1)?;
        t.synchronize()?;
        let got = t.read(&back)?;
        let want: Vec<u32> = (0..len()).map(|i| pattern(0, 1, 6, i)).collect();
        if got != want {
            return Err(Error::User(
                "rank 0 did not get its own data back through rank 1".into(),
            ));
        }
        Ok(())
    } else {
        relay_across_streams(t, false)
    }
}

/// Rank 1's part of [`events_across_streams`]; with `early`, it first
/// sends the received data on stream `b` with no event between, which
/// must be refused with a race (D1) naming the recv, nothing launched.
fn relay_across_streams<T: Transport>(t: &T, early: bool) -> Result<()> {
    let a = t.stream("a")?;
    let b = t.stream("b")?;
    let e = t.event()?;
    let mut buf = t.alloc::<u32>(len())?;
    let from0 = t.lane(0, Dir::Recv)?;
    let to0 = t.lane(0, Dir::Send)?;
    t.recv_on(&mut buf, 0, &Place::on(&from0.comm, &a))?;
    if early {
        let sent = t.send_on(&buf, 0, &Place::on(&to0.comm, &b));
        expect_race(
            t,
            sent,
            "a send on stream b of what a recv on stream a writes, with no event between",
            &format!("recv {} x u32 from rank 0", len()),
        )?;
    }
    t.record(&e, &a)?;
    t.wait(&e, &b)?;
    t.send_on(&buf, 0, &Place::on(&to0.comm, &b))?;
    t.synchronize()?;
    check(t, &buf, 0, 6)
}

/// Fails unless `r` is a race whose message names `earlier`.
fn expect_race(t: &impl Transport, r: Result<()>, what: &str, earlier: &str) -> Result<()> {
    match r {
        Err(Error::Race { message, .. }) if message.contains(earlier) => Ok(()),
        other => Err(Error::User(format!(
            "rank {}: {what} should be refused with a race naming `{earlier}`, not {other:?}",
            t.rank()
        ))),
    }
}

/// [`events_across_streams`] where rank 1 first sends the received data
/// on the other stream with no event between: refused with a race (D1),
/// nothing launched; then with the event, as there.
pub fn events_missing<T: Transport>(t: &T) -> Result<()> {
    if t.rank() == 0 {
        events_across_streams(t)
    } else {
        relay_across_streams(t, true)
    }
}

/// Rank 0 sends two messages to rank 1, which receives the first on
/// stream `a`, records an event there, and receives the second on `a`
/// after it. A sync of stream `b` before `b` waits for the event covers
/// nothing on `a`: a host read of the first buffer is refused with a race
/// naming its recv. Once `b` waits for the event, a sync of `b` covers the
/// first recv (D1) and the read returns the message; it does not cover the
/// second, launched after the record, whose read stays refused until a
/// sync of `a` (on a GPU both recvs share one completion fence of `a`
/// until it is recorded: the first being covered says nothing of the
/// second).
pub fn events_host_read<T: Transport>(t: &T) -> Result<()> {
    if t.rank() == 0 {
        let first = filled(t, 1, 9)?;
        let second = filled(t, 1, 10)?;
        t.send(&first, 1)?;
        t.send(&second, 1)?;
        return t.synchronize();
    }
    let a = t.stream("a")?;
    let b = t.stream("b")?;
    let e = t.event()?;
    let mut first = t.alloc::<u32>(len())?;
    let mut second = t.alloc::<u32>(len())?;
    let from0 = t.lane(0, Dir::Recv)?;
    let recv_text = format!("recv {} x u32 from rank 0", len());
    t.recv_on(&mut first, 0, &Place::on(&from0.comm, &a))?;
    t.record(&e, &a)?;
    t.recv_on(&mut second, 0, &Place::on(&from0.comm, &a))?;
    t.sync_stream(&b)?;
    expect_race(
        t,
        t.read(&first).map(drop),
        "a host read after a sync of a stream that does not wait for the recv's event",
        &recv_text,
    )?;
    t.wait(&e, &b)?;
    t.sync_stream(&b)?;
    check(t, &first, 0, 9)?;
    expect_race(
        t,
        t.read(&second).map(drop),
        "a host read of a recv launched after the event that the sync covered",
        &recv_text,
    )?;
    t.sync_stream(&a)?;
    check(t, &second, 0, 10)?;
    t.synchronize()
}

/// Each rank sends the other a bf16 and an f16 message (bit patterns that
/// name the sender and the element) and checks every element it receives.
pub fn half_precision<T: Transport>(t: &T) -> Result<()> {
    use duplex::{Bf16, F16};
    let peer = 1 - t.rank();
    let n = len();
    let bits = |r: Rank, kind: u16, i: usize| (r as u16) << 15 | kind << 14 | (i as u16 & 0x3fff);
    let mut bf = t.alloc::<Bf16>(n)?;
    let mut hf = t.alloc::<F16>(n)?;
    t.write(
        &mut bf,
        &(0..n)
            .map(|i| Bf16(bits(t.rank(), 0, i)))
            .collect::<Vec<_>>(),
    )?;
    t.write(
        &mut hf,
        &(0..n)
            .map(|i| F16(bits(t.rank(), 1, i)))
            .collect::<Vec<_>>(),
    )?;
    let mut bf_in = t.alloc::<Bf16>(n)?;
    let mut hf_in = t.alloc::<F16>(n)?;
    t.group(|| {
        t.send(&bf, peer)?;
        t.send(&hf, peer)?;
        t.recv(&mut bf_in, peer)?;
        t.recv(&mut hf_in, peer)
    })?;
    t.synchronize()?;
    let got_bf = t.read(&bf_in)?;
    let got_hf = t.read(&hf_in)?;
    for i in 0..n {
        if got_bf[i] != Bf16(bits(peer, 0, i)) || got_hf[i] != F16(bits(peer, 1, i)) {
            return Err(Error::User(format!(
                "rank {} got wrong half-precision data from rank {peer} at element {i}: {:?} {:?}",
                t.rank(),
                got_bf[i],
                got_hf[i]
            )));
        }
    }
    Ok(())
}

/// A group that sends a buffer and receives into the same buffer: its ops
/// run at once, so the recv may overwrite what the send has not read yet;
/// refused with a race (D1), nothing launched. Then with two buffers.
pub fn group_same_buffer<T: Transport>(t: &T) -> Result<()> {
    let peer = 1 - t.rank();
    let mut buf = filled(t, peer, 8)?;
    let inplace = t.group(|| {
        t.send(&buf, peer)?;
        // A second handle on the same buffer cannot be had in safe Rust;
        // the recv takes the buffer mutably after the send's borrow ends.
        t.recv(&mut buf, peer)
    });
    expect_race(
        t,
        inplace,
        "a group that sends a buffer and receives into it",
        &format!("send {} x u32 to rank {peer}", len()),
    )?;
    exchange_grouped(t, &buf, 8)
}

/// Rank 0 receives from rank 1 and waits for it before it makes a
/// communicator; rank 1 makes the communicator first, then sends. Making a
/// communicator is `ncclCommSplit` of the world, collective over every
/// rank, so each waits for the other: a hang through the split.
pub fn comm_after_wait<T: Transport>(t: &T) -> Result<()> {
    let mut b = filled(t, 1 - t.rank(), 9)?;
    if t.rank() == 0 {
        t.recv(&mut b, 1)?;
        t.synchronize()?;
        t.comm("late", &[0, 1])?;
    } else {
        t.comm("late", &[0, 1])?;
        t.send(&b, 0)?;
        t.synchronize()?;
    }
    Ok(())
}

/// Rank 0 splits on a thread of its own while its main thread sends to
/// rank 1; rank 1 makes the communicator only once that message is in.
/// The sender starts a little later, so that on a real backend the split
/// is under way when the send is issued: the split must not hold back the
/// rank's calls on other communicators (R11 serializes calls per
/// communicator).
pub fn comm_beside_send<T: Transport>(t: &T) -> Result<()> {
    if t.rank() == 0 {
        let split = t.spawn("split", |t: &T| t.comm("side", &[0, 1]).map(drop))?;
        std::thread::sleep(std::time::Duration::from_millis(50));
        let out = filled(t, 1, 10)?;
        t.send(&out, 1)?;
        t.synchronize()?;
        t.join(split)
    } else {
        let mut inb = t.alloc::<u32>(len())?;
        t.recv(&mut inb, 0)?;
        t.synchronize()?;
        check(t, &inb, 0, 10)?;
        t.comm("side", &[0, 1]).map(drop)
    }
}

/// Rank 0 sends on its shared lane toward rank 1, on a thread of its own,
/// while its main thread sends on the world communicator; rank 1 receives
/// the world's message, waits for it, and only then makes its first op
/// on the lane, which ends rank 0's handshake there (R7: on a lane not
/// connected at creation). The main thread sends 200 ms after it started
/// the other, so that on a real backend the handshake is under way when
/// it sends: it must hold back only calls on the lane (R11). On the NCCL
/// backend only lanes made at start show it: a lane made on first use is
/// connected by the rank's lane service, which no user code waits for.
pub fn connect_beside_send<T: Transport>(t: &T) -> Result<()> {
    let world = t.world();
    let s = t.stream("world")?;
    if t.rank() == 0 {
        // The world's message is ready before the first thread starts, and
        // the lane's is small, so that on a real backend the first send is
        // in its handshake well before the world's send (a message of the
        // suite's length takes a good part of the wait to fill).
        let out = filled(t, 1, 12)?;
        let first = t.spawn("first", |t: &T| {
            let out = filled_with(t, 1, 11, 16)?;
            t.send(&out, 1)?;
            t.synchronize()
        })?;
        std::thread::sleep(std::time::Duration::from_millis(200));
        t.send_on(&out, 1, &Place::on(&world, &s))?;
        t.synchronize()?;
        t.join(first)
    } else {
        let mut on_world = t.alloc::<u32>(len())?;
        t.recv_on(&mut on_world, 0, &Place::on(&world, &s))?;
        t.synchronize()?;
        check(t, &on_world, 0, 12)?;
        let mut on_lane = t.alloc::<u32>(16)?;
        t.recv(&mut on_lane, 0)?;
        t.synchronize()?;
        check(t, &on_lane, 0, 11)
    }
}

/// The feature request's pitch: "with use_stream(s): send(...)".
pub fn scoped_stream<T: Transport>(t: &T) -> Result<()> {
    let peer = 1 - t.rank();
    let mine = t.stream("mine")?;
    let out = filled(t, peer, 7)?;
    let mut inb = t.alloc::<u32>(len())?;
    t.with_stream(&mine, || t.send(&out, peer))?;
    t.recv(&mut inb, peer)?;
    t.sync_stream(&mine)?;
    t.synchronize()?;
    check(t, &inb, peer, 7)
}

/// Rank 0 sends `len()` elements, rank 1 receives half as many.
pub fn size_mismatch<T: Transport>(t: &T) -> Result<()> {
    if t.rank() == 0 {
        let out = filled(t, 1, 8)?;
        t.send(&out, 1)?;
    } else {
        let mut inb = t.alloc::<u32>(len() / 2)?;
        t.recv(&mut inb, 0)?;
    }
    t.synchronize()
}

/// Rank 0 sends `u32`s, rank 1 receives `f32`s of the same size.
pub fn type_mismatch<T: Transport>(t: &T) -> Result<()> {
    if t.rank() == 0 {
        let out = filled(t, 1, 9)?;
        t.send(&out, 1)?;
    } else {
        let mut inb = t.alloc::<f32>(len())?;
        t.recv(&mut inb, 0)?;
    }
    t.synchronize()
}

/// A send to a rank that does not exist is refused with an error naming
/// the op; the program then goes on and completes a real exchange.
pub fn wrong_peer<T: Transport>(t: &T) -> Result<()> {
    let out = filled(t, 0, 11)?;
    let bad = t.world_size();
    match t.send(&out, bad) {
        Err(Error::Invalid { message, .. }) if message.contains(&format!("rank {bad}")) => {}
        Err(e) => {
            return Err(Error::User(format!(
                "a send to rank {bad} failed with the wrong error: {e}"
            )));
        }
        Ok(()) => return Err(Error::User(format!("a send to rank {bad} was accepted"))),
    }
    seed(t)
}

/// Each rank sends a message to itself alone, which is refused (R12: NCCL
/// pairs a rank's messages to itself within one group); then sends and
/// receives it in one group, checks every element, and runs the seed.
pub fn self_unpaired<T: Transport>(t: &T) -> Result<()> {
    let me = t.rank();
    let out = filled(t, me, 12)?;
    let mut inb = t.alloc::<u32>(len())?;
    match t.send(&out, me) {
        Err(Error::Invalid { message, .. }) if message.contains("R12") => {}
        Err(e) => {
            return Err(Error::User(format!(
                "a send of rank {me} to itself alone failed with the wrong error: {e}"
            )));
        }
        Ok(()) => {
            return Err(Error::User(format!(
                "a send of rank {me} to itself alone was accepted"
            )));
        }
    }
    self_exchange(t, &out, &mut inb, 12)?;
    seed(t)
}

/// Rank `t`'s grouped exchange of `out` (filled with `tag`) with itself
/// into `inb`, synchronized, and every element of `inb` checked.
fn self_exchange<T: Transport>(
    t: &T,
    out: &T::Buffer<u32>,
    inb: &mut T::Buffer<u32>,
    tag: u32,
) -> Result<()> {
    let me = t.rank();
    t.group(|| {
        t.send(out, me)?;
        t.recv(inb, me)
    })?;
    t.synchronize()?;
    check(t, inb, me, tag)
}

/// Rank 0 sends 4 KiB that no rank receives, and synchronizes; rank 1
/// does nothing.
pub fn unmatched_send_small<T: Transport>(t: &T) -> Result<()> {
    if t.rank() == 0 {
        let out = filled_with(t, 1, 13, 1024)?;
        t.send(&out, 1)?;
    }
    t.synchronize()
}

/// Rank 0's code returns at once; every other rank works `late` longer,
/// then exchanges a message with itself in a group and checks every
/// element: the ranks that outlive rank 0 (the store's host, across
/// processes) must not take its end for a failure.
pub fn outlive_rank_0<T: Transport>(t: &T, late: std::time::Duration) -> Result<()> {
    let me = t.rank();
    if me == 0 {
        return Ok(());
    }
    std::thread::sleep(late);
    let out = filled(t, me, 14)?;
    let mut inb = t.alloc::<u32>(len())?;
    self_exchange(t, &out, &mut inb, 14)
}

/// [`unmatched_send_small`] the other way: rank 1 sends 4 KiB to rank 0,
/// which issues no recv and ends its code only `late` after starting it.
pub fn unmatched_send_late_receiver<T: Transport>(t: &T, late: std::time::Duration) -> Result<()> {
    if t.rank() == 1 {
        let out = filled_with(t, 0, 13, 1024)?;
        t.send(&out, 0)?;
    } else {
        std::thread::sleep(late);
    }
    t.synchronize()
}

/// Rank 0 sends a message that no rank receives.
pub fn unmatched_send<T: Transport>(t: &T) -> Result<()> {
    if t.rank() == 0 {
        let out = filled(t, 1, 12)?;
        t.send(&out, 1)?;
    }
    t.synchronize()
}

#[cfg(test)]
mod pattern_tests {
    use super::pattern;

    /// Two messages that differ in source, destination or tag, and one
    /// message against itself shifted, agree only by 32-bit coincidence
    /// (the old pattern agreed everywhere between tag `t` at `i` and tag
    /// `t ^ 1` at `i ^ 2^16`).
    #[test]
    fn messages_do_not_repeat_each_other() {
        let n = 1 << 18;
        let base: Vec<u32> = (0..n).map(|i| pattern(0, 1, 0, i)).collect();
        let others: [(u32, u32, u32, usize); 5] = [
            (1, 1, 0, 0),
            (0, 2, 0, 0),
            (0, 1, 1, 0),
            (0, 1, 1, 1 << 16),
            (0, 1, 0, 1),
        ];
        for (src, dst, tag, shift) in others {
            let same = (0..n - shift)
                .filter(|&i| base[i] == pattern(src, dst, tag, i + shift))
                .count();
            assert!(
                same < 4,
                "({src}, {dst}, {tag}, +{shift}): {same} equal elements"
            );
        }
    }
}
