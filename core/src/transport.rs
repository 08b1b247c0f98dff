//! The [`Transport`] trait: what rank code is written against, once, for
//! every backend.

use std::fmt;

use crate::{Dir, Element, Policy, Result};

/// A rank number, `0..world_size`.
pub type Rank = u32;

/// Where an op goes: a communicator and a stream. What is left `None` comes
/// from the transport's policy (its lane toward the peer), or from the
/// innermost [`Transport::with_stream`] scope for the stream.
pub struct Place<T: Transport> {
    /// The communicator; `None` for the lane's.
    pub comm: Option<T::Comm>,
    /// The stream; `None` for the scoped stream, else the lane's.
    pub stream: Option<T::Stream>,
}

impl<T: Transport> Place<T> {
    /// The policy's lane (the default).
    pub fn lane() -> Place<T> {
        Place {
            comm: None,
            stream: None,
        }
    }

    /// The lane's communicator on this stream.
    pub fn stream(stream: &T::Stream) -> Place<T> {
        Place {
            comm: None,
            stream: Some(stream.clone()),
        }
    }

    /// This communicator and this stream.
    pub fn on(comm: &T::Comm, stream: &T::Stream) -> Place<T> {
        Place {
            comm: Some(comm.clone()),
            stream: Some(stream.clone()),
        }
    }
}

impl<T: Transport> Default for Place<T> {
    fn default() -> Self {
        Place::lane()
    }
}

impl<T: Transport> Clone for Place<T> {
    fn clone(&self) -> Self {
        Place {
            comm: self.comm.clone(),
            stream: self.stream.clone(),
        }
    }
}

impl<T: Transport> fmt::Debug for Place<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Place")
            .field("comm", &self.comm)
            .field("stream", &self.stream)
            .finish()
    }
}

/// The communicator and stream a policy gives to one direction of traffic
/// with one peer.
pub struct Lane<T: Transport> {
    /// A name for reports: `pair:0-1` (shared) or `lane:0->1` (per direction).
    pub name: String,
    /// The communicator.
    pub comm: T::Comm,
    /// The stream on this rank.
    pub stream: T::Stream,
}

impl<T: Transport> fmt::Debug for Lane<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lane")
            .field("name", &self.name)
            .field("comm", &self.comm)
            .field("stream", &self.stream)
            .finish()
    }
}

/// Device memory of one rank (host memory on the simulator).
pub trait DeviceBuffer {
    /// Number of elements.
    fn len(&self) -> usize;
    /// True when it holds no element.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Point-to-point communication between ranks, as one host thread of one
/// rank sees it.
///
/// A value of a `Transport` type is a handle for one host thread: the
/// backend runs a closure per rank and gives it one; [`Transport::spawn`]
/// starts another host thread of the same rank with its own handle.
///
/// Ops are asynchronous, as in NCCL: `send` and `recv` enqueue work on a
/// stream and return; [`Transport::sync_stream`] and
/// [`Transport::synchronize`] wait for it. What may hang, and why, is
/// `docs/semantics.md`. Every failure is an [`Error`](crate::Error)
/// value: a program that can hang gets [`Error::Hang`](crate::Error::Hang)
/// from the blocked call instead of blocking forever.
///
/// Placement: an op without a [`Place`] goes to the lane that the
/// transport's [`Policy`] gives to its peer and direction
/// ([`Transport::lane`]); [`Transport::with_stream`] changes the stream of
/// such ops for the calls inside it; [`Transport::send_on`] places one op
/// explicitly.
pub trait Transport: Sized + Send + 'static {
    /// A buffer of `E`s on this rank.
    type Buffer<E: Element>: DeviceBuffer + Send;
    /// A stream of this rank.
    type Stream: Clone + fmt::Debug + Send + Sync;
    /// An event of this rank.
    type Event: Clone + fmt::Debug + Send + Sync;
    /// A communicator.
    type Comm: Clone + fmt::Debug + Send + Sync;
    /// A host thread started by [`Transport::spawn`].
    type Thread: Send;

    /// This rank.
    fn rank(&self) -> Rank;
    /// Number of ranks.
    fn world_size(&self) -> u32;
    /// The placement policy of ops without a [`Place`].
    fn policy(&self) -> Policy;
    /// Under [`Policy::PerDirection`], the size in bytes from which ops
    /// without an explicit communicator go on their direction's copy-engine
    /// lane instead of its NCCL lane (`docs/semantics.md`, "Copy-engine
    /// lanes"; [`crate::compile::goes_by_copy`]). `None`, the default: no
    /// op does. [`Transport::lane`] is always the NCCL lane.
    fn copy_from(&self) -> Option<u64> {
        None
    }

    /// A zeroed buffer of `len` elements.
    fn alloc<E: Element>(&self, len: usize) -> Result<Self::Buffer<E>>;
    /// Copies `data` into `buf` (lengths must match). Fails with
    /// [`Error::Race`](crate::Error::Race) while a device op uses `buf`.
    fn write<E: Element>(&self, buf: &mut Self::Buffer<E>, data: &[E]) -> Result<()>;
    /// Copies `buf` out. Fails with [`Error::Race`](crate::Error::Race) while a
    /// device op uses `buf`: synchronize first. Never returns stale bytes as
    /// if they had arrived: on GPUs (`duplex-nccl`) it fails with
    /// [`Error::Aborted`](crate::Error::Aborted) when the last recv into
    /// `buf` since the host last wrote it may not have delivered (its
    /// communicator or lane was aborted, or reports an error, and no read or
    /// wait since the recv found it delivered; or its launch failed where
    /// NCCL may still run it). On the simulator a recv never ends without
    /// its bytes; once a run has failed, every call fails.
    fn read<E: Element>(&self, buf: &Self::Buffer<E>) -> Result<Vec<E>>;

    /// A new stream of this rank.
    fn stream(&self, name: &str) -> Result<Self::Stream>;
    /// A communicator over `members`. Collective: every rank of the world
    /// calls it, in the same order, with the same arguments (`members` as
    /// a set: its communicator ranks follow the world's, whatever order
    /// they are listed in); ranks outside `members` get `None`. It returns only once every rank has called it
    /// (`ncclCommSplit` of the world): a rank that waits for a peer still
    /// inside it, or never calls it, hangs the others.
    fn comm(&self, name: &str, members: &[Rank]) -> Result<Option<Self::Comm>>;
    /// The communicator of all ranks.
    fn world(&self) -> Self::Comm;
    /// The lane the policy gives to traffic with `peer` in direction `dir`.
    fn lane(&self, peer: Rank, dir: Dir) -> Result<Lane<Self>>;

    /// Sends all of `buf` to `peer`, placed by `place`.
    fn send_on<E: Element>(
        &self,
        buf: &Self::Buffer<E>,
        peer: Rank,
        place: &Place<Self>,
    ) -> Result<()>;
    /// Receives all of `buf` from `peer`, placed by `place`.
    fn recv_on<E: Element>(
        &self,
        buf: &mut Self::Buffer<E>,
        peer: Rank,
        place: &Place<Self>,
    ) -> Result<()>;
    /// Sends all of `buf` to `peer` on the policy's lane (or the scoped stream).
    #[track_caller]
    fn send<E: Element>(&self, buf: &Self::Buffer<E>, peer: Rank) -> Result<()> {
        self.send_on(buf, peer, &Place::lane())
    }
    /// Receives all of `buf` from `peer` on the policy's lane (or the scoped stream).
    #[track_caller]
    fn recv<E: Element>(&self, buf: &mut Self::Buffer<E>, peer: Rank) -> Result<()> {
        self.recv_on(buf, peer, &Place::lane())
    }
    /// Runs `f` and launches the sends and recvs it issues as one group (R8):
    /// they progress independently, so a send and a recv in one group cannot
    /// deadlock each other. If `f` fails (or panics), nothing it issued is
    /// launched. A group inside another joins it, as NCCL flattens nested
    /// groups: its ops are launched with the outer group's, and dropped
    /// alone if its own `f` fails. The ops are launched when the outermost
    /// `f` returns, as NCCL launches a group at `ncclGroupEnd`: a `synchronize` inside `f` does not wait for them,
    /// and a host `read` or `write` inside `f` of a buffer one of them
    /// uses fails with [`Error::Race`](crate::Error::Race).
    fn group<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R>;
    /// Runs `f` with `stream` as the stream of every policy-placed op that
    /// this thread issues inside it (the communicator stays the lane's).
    /// Other threads and explicitly placed ops are not affected.
    fn with_stream<R>(&self, stream: &Self::Stream, f: impl FnOnce() -> Result<R>) -> Result<R>;

    /// A new event of this rank.
    fn event(&self) -> Result<Self::Event>;
    /// Records `event` on `stream`: it completes when the work enqueued on
    /// `stream` so far has.
    fn record(&self, event: &Self::Event, stream: &Self::Stream) -> Result<()>;
    /// Makes `stream` wait for the latest record of `event` (R9).
    fn wait(&self, event: &Self::Event, stream: &Self::Stream) -> Result<()>;
    /// Blocks until the work enqueued on `stream` so far has completed.
    fn sync_stream(&self, stream: &Self::Stream) -> Result<()>;
    /// Blocks until the work enqueued on every stream of this rank so far has
    /// completed.
    fn synchronize(&self) -> Result<()>;

    /// Posts a host-to-host message with `tag` to `peer` (RPC metadata, say).
    /// Never blocks.
    fn notify(&self, peer: Rank, tag: &str) -> Result<()>;
    /// Blocks until a message with `tag` from `peer` has arrived, and takes it.
    fn await_notify(&self, peer: Rank, tag: &str) -> Result<()>;

    /// Starts another host thread of this rank, running `f` with its own handle.
    /// A rank has finished once all its threads have: one never joined is
    /// waited for when the rank's code returns (on the simulator, by the
    /// end of the execution; on GPUs, as long as a `join` would wait). A
    /// thread's error is the rank's, joined or not, from the moment the
    /// thread ends (on the simulator it ends the execution; on GPUs the
    /// other ranks' waits end on it): [`Transport::join`] returns it so
    /// that the code can stop, but a rank whose code goes on still fails
    /// with it. An error of a thread cannot be swallowed into a run that
    /// reports success.
    fn spawn<F>(&self, name: &str, f: F) -> Result<Self::Thread>
    where
        F: FnOnce(&Self) -> Result<()> + Send + 'static;
    /// Waits for a thread started by [`Transport::spawn`] and returns its
    /// result (an error is the rank's too: see [`Transport::spawn`]).
    fn join(&self, thread: Self::Thread) -> Result<()>;
}

/// Checks of user input that every backend makes the same way, so that the
/// same mistake gets the same error, naming the call and where it was made.
pub mod check {
    use std::panic::Location;

    use crate::{Error, Rank, Result};

    /// Where an op goes, as every backend resolves a [`Place`](super::Place)
    /// (`docs/schedule-format.md`, "Placement"): the communicator is the
    /// explicit one, else the lane's, else `world`; the stream is the
    /// explicit one, else the scoped one ([`Transport::with_stream`](super::Transport::with_stream)),
    /// else the lane's when the communicator is the lane's, else the rank's
    /// default stream. Explicitly placed ops never share a lane's stream.
    pub fn resolve<C, S>(
        comm: Option<C>,
        stream: Option<S>,
        scoped: Option<S>,
        lane: Option<(C, S)>,
        world: impl FnOnce() -> C,
        default: impl FnOnce() -> S,
    ) -> (C, S) {
        let explicit_comm = comm.is_some();
        let (lane_comm, lane_stream) = match lane {
            Some((c, s)) => (Some(c), Some(s)),
            None => (None, None),
        };
        let comm = comm.or(lane_comm).unwrap_or_else(world);
        let stream = stream
            .or(scoped)
            .or(if explicit_comm { None } else { lane_stream })
            .unwrap_or_else(default);
        (comm, stream)
    }

    std::thread_local! {
        /// The call site set by [`at_site`] on this thread.
        static SITE: std::cell::RefCell<Option<std::sync::Arc<str>>> =
            const { std::cell::RefCell::new(None) };
    }

    /// Runs `f` with its transport calls reported at `site` (`line 14`)
    /// instead of the Rust code that makes them: what
    /// [`crate::schedule::execute`] does, so that `duplex run FILE` names
    /// the schedule's lines. Backends ask [`place`] (or [`site`]).
    pub fn at_site<R>(site: &str, f: impl FnOnce() -> R) -> R {
        let old = SITE.with(|s| s.replace(Some(site.into())));
        struct Restore(Option<std::sync::Arc<str>>);
        impl Drop for Restore {
            fn drop(&mut self) {
                let old = self.0.take();
                SITE.with(|s| *s.borrow_mut() = old);
            }
        }
        let _restore = Restore(old);
        f()
    }

    /// The call site [`at_site`] set on this thread, if any.
    pub fn site() -> Option<std::sync::Arc<str>> {
        SITE.with(|s| s.borrow().clone())
    }

    /// Where a call was made: the site [`at_site`] set on this thread, else
    /// `file:line:column` of the caller.
    pub fn place(at: &Location<'_>) -> String {
        match site() {
            Some(s) => s.to_string(),
            None => format!("{}:{}:{}", at.file(), at.line(), at.column()),
        }
    }

    /// How every backend and report names a point-to-point op:
    /// `send 1024 x f32 to rank 1`, `recv 16 x u8 from rank 0`.
    pub fn op_text(dir: crate::Dir, count: usize, dtype: crate::DType, peer: Rank) -> String {
        format!(
            "{} {count} x {dtype} {} rank {peer}",
            dir.name(),
            if dir == crate::Dir::Send {
                "to"
            } else {
                "from"
            }
        )
    }

    /// The host messages that express `Transport::comm`'s k-th
    /// `ncclCommSplit` of the world (`docs/semantics.md`, "Host calls that
    /// are not NCCL calls"): on arrival the rank `notify`s every other rank
    /// with this tag, then `await`s each of theirs in rank order. Both
    /// backends record it so, so that a rank that never makes the split,
    /// or makes it only after it waits for a rank inside it, is a hang whose
    /// report names the cycle through the split.
    pub fn split_tag(k: usize, name: &str) -> String {
        format!("{SPLIT_TAG}{k} (comm {name})")
    }

    /// A user's `notify` or `await_notify` tag (`what` names the call):
    /// the tags of splits ([`split_tag`]) are the backends' own, so that a
    /// user's message can neither stand in for a rank's arrival at a split
    /// nor be taken for one.
    pub fn user_tag(at: &Location<'_>, what: impl FnOnce() -> String, tag: &str) -> Result<()> {
        if tag.starts_with(SPLIT_TAG) {
            invalid(
                at,
                format!(
                    "{}: tags that start with `{SPLIT_TAG}` are duplex's own (a communicator's split); choose another",
                    what()
                ),
            )
        } else {
            Ok(())
        }
    }

    /// How every split's tag starts.
    const SPLIT_TAG: &str = "ncclCommSplit #";

    /// The text of a step of the k-th split ([`split_tag`]): `what` is
    /// `tells rank R it has arrived` or `waits for rank R to arrive`.
    pub fn split_step(k: usize, name: &str, what: &str) -> String {
        format!("comm {name} (ncclCommSplit #{k}, collective over every rank): {what}")
    }

    /// The error of a host `read` or `write` (`what`) of a buffer that op
    /// `op` of the open group uses: the group is launched only when it
    /// ends, so the bytes are not there yet (a read) or would be sent or
    /// overwritten later (a write).
    pub fn in_open_group<T>(at: &Location<'_>, what: &str, op: &str) -> Result<T> {
        Err(Error::Race {
            at: place(at),
            message: format!(
                "{what} of a buffer that `{op}` of the open group uses: a group's ops are launched when the group ends; read or write it after the group, once a synchronize has waited for them"
            ),
        })
    }

    /// A group inside another: runs `f`, whose ops join the outer group (as
    /// NCCL flattens nested groups), and calls `drop_ops` to take back what
    /// `f` issued if it fails or panics, so that nothing of a failed group
    /// is launched, nested or not.
    pub fn nested_group<R>(f: impl FnOnce() -> Result<R>, mut drop_ops: impl FnMut()) -> Result<R> {
        let kept = std::cell::Cell::new(false);
        let _undo = OnDrop(|| {
            if !kept.get() {
                drop_ops();
            }
        });
        let result = f();
        kept.set(result.is_ok());
        result
    }

    /// Runs its closure when dropped, unwinding included: what a backend's
    /// `group` and `with_stream` undo however their closure ends (a panic
    /// the rank code catches must not leave its later ops in a group that
    /// is never launched, or on the scoped stream).
    pub struct OnDrop<F: FnMut()>(pub F);

    impl<F: FnMut()> Drop for OnDrop<F> {
        fn drop(&mut self) {
            (self.0)()
        }
    }

    impl<F: FnMut()> std::fmt::Debug for OnDrop<F> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("OnDrop")
        }
    }

    /// An invalid-call error at `at`.
    pub fn invalid<T>(at: &Location<'_>, message: String) -> Result<T> {
        Err(Error::Invalid {
            at: place(at),
            message,
        })
    }

    /// `peer` must be a rank of a world of `world` ranks; `what` names the
    /// call (built only on failure).
    pub fn peer(
        at: &Location<'_>,
        what: impl FnOnce() -> String,
        peer: Rank,
        world: u32,
    ) -> Result<()> {
        if peer < world {
            Ok(())
        } else {
            invalid(
                at,
                format!(
                    "{}: rank {peer} does not exist (there are {world} ranks)",
                    what()
                ),
            )
        }
    }

    /// A write must fill its buffer exactly.
    pub fn write_len(at: &Location<'_>, data: usize, buffer: usize) -> Result<()> {
        if data == buffer {
            Ok(())
        } else {
            invalid(
                at,
                format!("write of {data} elements into a buffer of {buffer}"),
            )
        }
    }

    /// A communicator's members: distinct ranks of the world, at least one.
    /// Returns them sorted.
    pub fn members(
        at: &Location<'_>,
        name: &str,
        members: &[Rank],
        world: u32,
    ) -> Result<Vec<Rank>> {
        let mut sorted = members.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != members.len()
            || members.is_empty()
            || members.iter().any(|r| *r >= world)
        {
            return invalid(
                at,
                format!(
                    "comm `{name}` over {members:?}: members must be distinct ranks below {world}"
                ),
            );
        }
        Ok(sorted)
    }
}
