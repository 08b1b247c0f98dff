//! The rules R1–R12 of `docs/semantics.md` as one pure state machine.
//!
//! A [`Machine`] holds a [`Setup`] (who exists: ranks, host threads, streams,
//! communicators, events; static for the checker, grown by the simulated
//! transport) and a [`State`] (everything that changes). It does no I/O,
//! reads no clock and starts no thread. Drivers feed it host calls:
//!
//! * [`Machine::next`] says what a host thread can do now: make its next call,
//!   resume a call blocked in the connection handshake (R7), nothing because it
//!   is blocked, or nothing because it has finished;
//! * [`Machine::apply`] performs a thread's next [`HostCall`];
//! * [`Machine::resume`] completes a call that waited for a handshake.
//!
//! After every host step the device runs to a fixpoint (module `device`): device
//! progress is deterministic, so the only choices an execution makes are which
//! host thread steps next. `notify` messages carry no payload and are counted
//! per (sender rank, receiver rank, tag), so which `notify` an `await`
//! consumes is not a choice either. A schedule is therefore a list of thread
//! ids, and any run replays from it.
//!
//! [`Machine::stuck`] explains a state in which no thread can step: the
//! blocked host calls, the stuck device ops and the wait-for cycle that holds
//! them ([`waitfor`]).

mod device;
pub mod issue;
mod rules;
pub(crate) mod table;
mod view;
pub mod waitfor;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use smallvec::SmallVec;

use crate::schedule::Dir;
use crate::{DType, Model, ProgramErrorKind};

pub use crate::report::{OpInfo, Stuck};
pub use rules::{Mode, Object};
pub use view::describe_origin;
pub use waitfor::{Threads, Unknown};

/// A rank number.
pub type Rank = u32;

macro_rules! id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
        pub struct $name(pub u32);

        impl $name {
            pub(crate) fn ix(self) -> usize {
                self.0 as usize
            }
        }
    };
}

id!(
    /// A host thread, global over all ranks.
    ThreadId
);
id!(
    /// A stream, global over all ranks; every stream belongs to one rank.
    StreamId
);
id!(
    /// A communicator.
    CommId
);
id!(
    /// An event (events belong to one rank).
    EventId
);
id!(
    /// An interned `notify`/`await` tag.
    TagId
);
id!(
    /// Where a host call came from (a line of a schedule file, a source
    /// location of user code); opaque to the rules.
    Origin
);

/// A host thread's identity.
#[derive(Clone, Debug)]
pub struct ThreadInfo {
    /// The rank it belongs to.
    pub rank: Rank,
    /// `main` or the thread's name.
    pub name: String,
}

/// A stream's identity.
#[derive(Clone, Debug)]
pub struct StreamInfo {
    /// The rank it belongs to.
    pub rank: Rank,
    /// Its name, unique on that rank.
    pub name: String,
}

/// A communicator's identity.
#[derive(Clone, Debug)]
pub struct CommInfo {
    /// Its name.
    pub name: String,
    /// Member ranks.
    pub members: Vec<Rank>,
    /// Connected before the program starts: R6 and R7 never apply to it.
    pub warm: bool,
    /// A copy-engine lane of duplex's own, not an NCCL communicator
    /// (`docs/semantics.md`, "Copy-engine lanes"): always connected, never
    /// buffers (R5 off), takes no kernel slot (R10 off), is not ordered
    /// with the rank's other launches on it beyond its streams (R2 off),
    /// and ignores grouping (R8's `group-mismatch` off).
    pub copy: bool,
}

/// An event's identity.
#[derive(Clone, Debug)]
pub struct EventInfo {
    /// The rank it belongs to.
    pub rank: Rank,
    /// Its name.
    pub name: String,
}

/// Where a host call came from, for reports.
///
/// A schedule file has about three origins per line, and a large one has
/// millions of lines: an origin from a schedule line shares its text with
/// every equal statement and spells its place only when asked.
#[derive(Clone, Debug)]
pub struct OriginInfo {
    /// The statement or call as the user wrote it (`send 1 256MiB`).
    pub text: Arc<str>,
    /// Where: 16 bytes, so that an origin takes 32.
    place: Place,
}

/// Where a call was written.
#[derive(Clone, Debug)]
enum Place {
    /// A line of a schedule file.
    Line(u32),
    /// A place outside one (`src/main.rs:12:5`).
    Site(Box<str>),
}

impl OriginInfo {
    /// An origin at line `line` of a schedule file.
    pub fn line(text: Arc<str>, line: u32) -> OriginInfo {
        OriginInfo {
            text,
            place: Place::Line(line),
        }
    }

    /// An origin at `place` (`src/main.rs:12:5`), outside a schedule file.
    pub fn at(text: impl Into<Arc<str>>, place: impl Into<String>) -> OriginInfo {
        OriginInfo {
            text: text.into(),
            place: Place::Site(place.into().into_boxed_str()),
        }
    }

    /// The schedule line, when there is one.
    pub fn line_number(&self) -> Option<u32> {
        match self.place {
            Place::Line(n) => Some(n),
            Place::Site(_) => None,
        }
    }

    /// Where: `line 4`, `src/main.rs:12:5`.
    pub fn place(&self) -> String {
        match &self.place {
            Place::Line(n) => format!("line {n}"),
            Place::Site(s) => s.to_string(),
        }
    }
}

const _: () = assert!(std::mem::size_of::<OriginInfo>() == 32);

/// Who exists. Everything the rules need to know that does not change while
/// a program runs; the simulated transport adds to it as user code creates
/// streams, events and communicators.
#[derive(Clone, Debug)]
pub struct Setup {
    /// The model knobs.
    pub model: Model,
    /// Number of ranks.
    pub ranks: u32,
    /// Host threads (add them with [`Setup::add_thread`], which keeps each
    /// rank's list).
    pub threads: Vec<ThreadInfo>,
    /// Streams (add them with [`Setup::add_stream`]).
    pub streams: Vec<StreamInfo>,
    /// Communicators.
    pub comms: Vec<CommInfo>,
    /// Events.
    pub events: Vec<EventInfo>,
    /// `notify`/`await` tags.
    pub tags: Vec<String>,
    /// Call origins.
    pub origins: Vec<OriginInfo>,
    /// Each rank's threads and streams, kept by [`Setup::add_thread`] and
    /// [`Setup::add_stream`].
    by_rank: Vec<(Vec<ThreadId>, Vec<StreamId>)>,
    /// Each tag's number ([`Setup::tag`]): a program with many tags would
    /// otherwise intern them in quadratic time.
    tag_ids: std::collections::HashMap<String, u32>,
}

impl Setup {
    /// An empty world of `ranks` ranks under `model`.
    pub fn new(ranks: u32, model: Model) -> Setup {
        Setup {
            model,
            ranks,
            threads: Vec::new(),
            streams: Vec::new(),
            comms: Vec::new(),
            events: Vec::new(),
            tags: Vec::new(),
            origins: Vec::new(),
            by_rank: Vec::new(),
            tag_ids: std::collections::HashMap::new(),
        }
    }

    /// Adds a host thread.
    pub fn add_thread(&mut self, rank: Rank, name: impl Into<String>) -> ThreadId {
        self.threads.push(ThreadInfo {
            rank,
            name: name.into(),
        });
        let id = ThreadId(self.threads.len() as u32 - 1);
        self.rank_entry(rank).0.push(id);
        id
    }

    fn rank_entry(&mut self, rank: Rank) -> &mut (Vec<ThreadId>, Vec<StreamId>) {
        let i = rank as usize;
        if self.by_rank.len() <= i {
            self.by_rank.resize(i + 1, (Vec::new(), Vec::new()));
        }
        &mut self.by_rank[i]
    }

    /// Adds a stream.
    pub fn add_stream(&mut self, rank: Rank, name: impl Into<String>) -> StreamId {
        self.streams.push(StreamInfo {
            rank,
            name: name.into(),
        });
        let id = StreamId(self.streams.len() as u32 - 1);
        self.rank_entry(rank).1.push(id);
        id
    }

    /// Adds a communicator.
    pub fn add_comm(&mut self, name: impl Into<String>, members: Vec<Rank>, warm: bool) -> CommId {
        self.comms.push(CommInfo {
            name: name.into(),
            members,
            warm,
            copy: false,
        });
        CommId(self.comms.len() as u32 - 1)
    }

    /// Adds a copy-engine lane ([`CommInfo::copy`]).
    pub fn add_copy_lane(&mut self, name: impl Into<String>, members: Vec<Rank>) -> CommId {
        self.comms.push(CommInfo {
            name: name.into(),
            members,
            warm: true,
            copy: true,
        });
        CommId(self.comms.len() as u32 - 1)
    }

    /// Whether an op of a launch counts as grouped for R8's comparison: the
    /// launch is a group ([`LaunchSpec::is_group`]) and the op is on an
    /// NCCL communicator (copy-engine lanes ignore grouping).
    pub fn grouped(&self, spec: &LaunchSpec, op: &OpSpec) -> bool {
        spec.is_group() && !self.comms[op.comm.ix()].copy
    }

    /// Adds an event.
    pub fn add_event(&mut self, rank: Rank, name: impl Into<String>) -> EventId {
        self.events.push(EventInfo {
            rank,
            name: name.into(),
        });
        EventId(self.events.len() as u32 - 1)
    }

    /// Interns a tag.
    pub fn tag(&mut self, tag: &str) -> TagId {
        // `tags` is public: rebuild the index if it was changed directly.
        if self.tag_ids.len() != self.tags.len() {
            self.tag_ids = (self.tags.iter().enumerate().rev())
                .map(|(i, t)| (t.clone(), i as u32))
                .collect();
        }
        if let Some(&i) = self.tag_ids.get(tag) {
            return TagId(i);
        }
        self.tags.push(tag.to_string());
        let i = self.tags.len() as u32 - 1;
        self.tag_ids.insert(tag.to_string(), i);
        TagId(i)
    }

    /// Adds an origin.
    pub fn add_origin(&mut self, info: OriginInfo) -> Origin {
        self.origins.push(info);
        Origin(self.origins.len() as u32 - 1)
    }

    /// The streams of `rank`.
    pub fn streams_of(&self, rank: Rank) -> impl Iterator<Item = StreamId> + '_ {
        debug_assert_eq!(
            self.by_rank.iter().map(|e| e.1.len()).sum::<usize>(),
            self.streams.len(),
            "streams are added with Setup::add_stream"
        );
        self.by_rank
            .get(rank as usize)
            .map(|e| e.1.as_slice())
            .unwrap_or_default()
            .iter()
            .copied()
    }

    /// The threads of `rank`.
    pub fn threads_of(&self, rank: Rank) -> impl Iterator<Item = ThreadId> + '_ {
        debug_assert_eq!(
            self.by_rank.iter().map(|e| e.0.len()).sum::<usize>(),
            self.threads.len(),
            "threads are added with Setup::add_thread"
        );
        self.by_rank
            .get(rank as usize)
            .map(|e| e.0.as_slice())
            .unwrap_or_default()
            .iter()
            .copied()
    }
}

/// One point-to-point op of a launch, as a host call names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct OpSpec {
    /// Send or receive.
    pub dir: Dir,
    /// The other rank.
    pub peer: Rank,
    /// Bytes.
    pub bytes: u64,
    /// Element type (R3 matches it too; schedule files move `u8`).
    pub dtype: DType,
    /// The communicator.
    pub comm: CommId,
    /// The stream (of the calling rank).
    pub stream: StreamId,
    /// Where this op itself was written, when reports should name it rather
    /// than its launch's [`LaunchSpec::origin`] (an op of a group: its own
    /// line, its own text); `None` uses the launch's. Opaque to the rules.
    pub origin: Option<Origin>,
}

/// A launch: one op, or a whole group (R8).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LaunchSpec {
    /// The ops, in the order issued.
    pub ops: Vec<OpSpec>,
    /// Issued between group start and group end.
    pub grouped: bool,
    /// Where it was issued: the host call (a group's statement as a whole).
    /// Each op may name its own place too ([`OpSpec::origin`]).
    pub origin: Origin,
}

impl LaunchSpec {
    /// A group in the sense of R8: issued between group start and end with
    /// two or more ops. A group of one op is exactly a plain call (NCCL
    /// wraps every `ncclSend`/`ncclRecv` in a group of its own).
    pub fn is_group(&self) -> bool {
        is_group(self.grouped, self.ops.len())
    }
}

/// Whether a launch of `ops` ops, issued between group start and end when
/// `grouped`, is a group in the sense of R8 ([`LaunchSpec::is_group`]).
pub fn is_group(grouped: bool, ops: usize) -> bool {
    grouped && ops > 1
}

/// What a host thread asks of the machine.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum HostCall {
    /// Enqueue a `send`/`recv` or a group.
    Launch(LaunchSpec),
    /// `record E` on a stream (R9).
    Record {
        /// The event.
        event: EventId,
        /// The stream.
        stream: StreamId,
        /// Where.
        origin: Origin,
    },
    /// `wait E` on a stream (R9).
    Wait {
        /// The event.
        event: EventId,
        /// The stream.
        stream: StreamId,
        /// Where.
        origin: Origin,
    },
    /// Block until one stream, or every stream of the rank, has drained the
    /// work issued so far.
    Sync {
        /// `None` for every stream of the rank.
        stream: Option<StreamId>,
        /// Where.
        origin: Origin,
    },
    /// Post a host-to-host message (never blocks).
    Notify {
        /// Receiving rank.
        to: Rank,
        /// Tag.
        tag: TagId,
        /// Where.
        origin: Origin,
    },
    /// Take a message with this tag from this rank; enabled only once one
    /// has arrived ([`Machine::enabled`]).
    Await {
        /// Sending rank.
        from: Rank,
        /// Tag.
        tag: TagId,
        /// Where.
        origin: Origin,
    },
    /// Block until another host thread of the rank has finished.
    Join {
        /// The thread.
        thread: ThreadId,
        /// Where.
        origin: Origin,
    },
    /// The thread's end: wait for every stream of the rank to drain.
    End,
}

/// What a host thread can do now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// It can make its next call ([`Machine::apply`]).
    Call,
    /// Its call waited for a connection handshake that has completed: the
    /// call can finish ([`Machine::resume`]).
    Resume,
    /// It waits for something (a stream, a message, a handshake).
    Blocked,
    /// It has ended and its rank's streams have drained.
    Finished,
}

/// Whether a state can still move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Some thread can step.
    Running,
    /// Every thread has finished.
    Finished,
    /// Some thread has not finished and none can step: a hang.
    Stuck,
}

/// One side of a point-to-point op, as an error or a report names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpRef {
    /// The launch.
    pub launch: LaunchRef,
    /// The op's index inside the launch.
    pub index: u16,
}

/// A launch, named by the thread that issued it and its call number on that
/// thread: the same in every interleaving.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LaunchRef {
    /// The issuing thread.
    pub thread: ThreadId,
    /// The thread's call number.
    pub seq: u32,
    /// Which communicator's part of the call: a group's ops are launched
    /// once per communicator, in the order the communicators first appear
    /// in the group (R8).
    pub part: u16,
}

/// A program error found while running: both ops where two are involved.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProgramError {
    /// R3: the k-th send and the k-th recv of a channel disagree on size.
    #[error("size mismatch (R3): {send} is matched with {recv}")]
    SizeMismatch {
        /// The send.
        send: Box<OpInfo>,
        /// The recv.
        recv: Box<OpInfo>,
    },
    /// R3: the k-th send and the k-th recv of a channel disagree on type.
    #[error(
        "type mismatch (R3): {send} is matched with {recv} (the send's elements are {}, the recv's {})",
        send.dtype,
        recv.dtype
    )]
    TypeMismatch {
        /// The send.
        send: Box<OpInfo>,
        /// The recv.
        recv: Box<OpInfo>,
    },
    /// R8: a send and its recv where only one side is in a group.
    #[error("grouped on one side only (R8): {send} is matched with {recv}")]
    GroupMismatch {
        /// The send.
        send: Box<OpInfo>,
        /// The recv.
        recv: Box<OpInfo>,
    },
    /// A send completed into the channel's buffer but no recv ever took it.
    #[error("message never received: {send}")]
    NeverReceived {
        /// The send.
        send: Box<OpInfo>,
    },
    /// A call that cannot be made at all (a peer outside the communicator, a
    /// stream of another rank, ...). Nothing was changed.
    #[error("invalid call at {place}: {message}")]
    Invalid {
        /// Where.
        place: String,
        /// What is wrong.
        message: String,
    },
}

impl ProgramError {
    /// The kind of error.
    pub fn kind(&self) -> ProgramErrorKind {
        match self {
            ProgramError::SizeMismatch { .. } => ProgramErrorKind::SizeMismatch,
            ProgramError::TypeMismatch { .. } => ProgramErrorKind::TypeMismatch,
            ProgramError::GroupMismatch { .. } => ProgramErrorKind::GroupMismatch,
            ProgramError::NeverReceived { .. } => ProgramErrorKind::NeverReceived,
            ProgramError::Invalid { .. } => ProgramErrorKind::Invalid,
        }
    }

    /// The ops involved.
    pub fn ops(&self) -> Vec<OpInfo> {
        match self {
            ProgramError::SizeMismatch { send, recv }
            | ProgramError::TypeMismatch { send, recv }
            | ProgramError::GroupMismatch { send, recv } => {
                vec![(**send).clone(), (**recv).clone()]
            }
            ProgramError::NeverReceived { send } => vec![(**send).clone()],
            ProgramError::Invalid { .. } => vec![],
        }
    }
}

impl From<ProgramError> for crate::Error {
    fn from(e: ProgramError) -> Self {
        match e {
            ProgramError::Invalid { place, message } => {
                crate::Error::Invalid { at: place, message }
            }
            other => crate::Error::Program {
                kind: other.kind(),
                message: other.to_string(),
                ops: other.ops(),
            },
        }
    }
}

/// Where a host thread is.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Phase {
    /// Between calls.
    Running,
    /// In a call that waits for connection handshakes (R7); the launch is
    /// enqueued once they complete.
    Connecting { spec: LaunchSpec, seq: u32 },
    /// Past its last call.
    Ended,
}

/// What a host thread waits for before it can step again.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Wait {
    None,
    /// Each stream has completed at least this many entries.
    Streams {
        targets: Vec<(StreamId, u32)>,
        origin: Option<Origin>,
    },
    /// The peers have entered these connection setup rounds (R7).
    Connect {
        pairs: Vec<(CommId, Rank, u32)>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct ThreadState {
    phase: Phase,
    wait: Wait,
    /// Calls made so far; the next call's sequence number.
    calls: u32,
}

/// An entry of a stream's FIFO.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Entry {
    Launch(LaunchRef),
    Record,
    /// Waits until entry `.1` of stream `.0` has completed; `None` when the
    /// event had never been recorded (waits for nothing).
    WaitEvent(Option<(StreamId, u32)>, Origin),
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
struct StreamState {
    /// Entries completed (and removed) so far.
    base: u32,
    /// Entries not yet completed, in order.
    queue: VecDeque<Entry>,
}

impl StreamState {
    fn issued(&self) -> u32 {
        self.base + self.queue.len() as u32
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum OpStatus {
    /// Its launch has not started, or an earlier op of its group on the same
    /// channel has not completed (R8).
    Waiting,
    /// Started: it can match.
    Active,
    Done,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Op {
    spec: OpSpec,
    /// Position in its channel's FIFO (0-based, counting every message ever
    /// issued on the channel).
    fifo: u64,
    status: OpStatus,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Launch {
    rank: Rank,
    streams: SmallVec<[StreamId; 2]>,
    /// At least one; all on one communicator.
    ops: SmallVec<[Op; 2]>,
    /// How many of `ops` are not done: the launch completes at 0.
    left: u32,
    started: bool,
    grouped: bool,
    origin: Origin,
}

impl Launch {
    /// The communicator of a launch ([`Machine::op_refs`] gives each
    /// communicator of a group a launch of its own).
    fn comm(&self) -> CommId {
        self.ops[0].spec.comm
    }
}

impl Machine {
    /// Whether a launch is on a copy-engine lane ([`CommInfo::copy`]).
    fn is_copy(&self, lref: LaunchRef) -> bool {
        self.setup.comms[self.state.launches[&lref].comm().ix()].copy
    }

    /// Whether `rank`'s launches take kernel slots (R10) in the order they
    /// were issued whatever the timing: true under `kernels=1` when no
    /// copy-engine lane of the rank exists, or may come to exist (a lane
    /// the simulated transport has declared and not opened yet has no
    /// members, and may be the rank's), and always without a bound.
    ///
    /// Why: with one slot and no copy lane, a launch of the rank holds the
    /// slot from its start to its completion, and whatever keeps an
    /// unstarted launch from starting (R1: an entry ahead of it on a
    /// stream; R2: an earlier launch on its communicator; R9: a `wait` for
    /// a `record` issued before it) was issued before it. So while the slot
    /// is free, the oldest unfinished launch is ready and starts first
    /// (slots go to ready launches in issue order), and a launch starts
    /// exactly when every launch its rank issued before it has completed:
    /// a condition that, once true, stays true. Device progress is then
    /// monotone, as without a bound, and host steps of different ranks
    /// commute (the checker's reduction relies on this). With two slots,
    /// one completion can make two launches ready while a third, issued
    /// later, took the other slot at its issue; with a copy lane, a launch
    /// can wait behind a copy, which holds no slot, while a later launch
    /// takes the slot. There the order of host steps across ranks decides
    /// which launch runs.
    pub fn slots_in_issue_order(&self, rank: Rank) -> bool {
        match self.setup.model.kernels {
            None => true,
            Some(k) => {
                k == 1
                    && !self
                        .setup
                        .comms
                        .iter()
                        .any(|c| c.copy && (c.members.is_empty() || c.members.contains(&rank)))
            }
        }
    }

    /// Under a kernel-slot bound (R10): the NCCL launches of `rank` issued
    /// and not completed, each of which holds or waits for a slot.
    pub fn slots_wanted(&self, rank: Rank) -> usize {
        self.state.ranks.get(rank as usize).map_or(0, |r| {
            r.pending.iter().filter(|l| !self.is_copy(**l)).count()
        })
    }

    /// The kernel slots a launch of `spec` takes (R10): one per
    /// communicator of its that is not a copy-engine lane.
    pub fn slots_of(&self, spec: &LaunchSpec) -> usize {
        let mut comms: smallvec::SmallVec<[CommId; 4]> = spec
            .ops
            .iter()
            .map(|o| o.comm)
            .filter(|c| !self.setup.comms[c.ix()].copy)
            .collect();
        comms.sort_unstable();
        comms.dedup();
        comms.len()
    }
}

/// A channel: (communicator, source rank, destination rank).
type ChannelKey = (CommId, Rank, Rank);

/// What a channel remembers of an op that has not been received yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Slot {
    op: OpRef,
    bytes: u64,
    dtype: DType,
    grouped: bool,
    origin: Origin,
    stream: StreamId,
    /// For sends: completed into the channel's buffer (R5).
    buffered: bool,
    /// A message whose side this is was completed before the calls the
    /// machine has seen ([`Machine::settle_from`]): a ghost send is
    /// buffered, a ghost recv is started; neither has a launch, and
    /// neither is compared with its partner (R3, R8), since what it
    /// carried is gone.
    ghost: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
struct Channel {
    /// Messages received so far: the FIFO index of the front slots.
    delivered: u64,
    /// Sends not yet received, in FIFO order.
    sends: VecDeque<Slot>,
    /// Recvs not yet completed, in FIFO order.
    recvs: VecDeque<Slot>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
struct RankState {
    /// NCCL launches issued and not completed, in issue order: kept only
    /// under a kernel-slot bound (R10), which hands slots out in that
    /// order; without one, the order across communicators is not part of
    /// the state.
    pending: VecDeque<LaunchRef>,
    /// Per communicator, the launches on it issued and not completed, in
    /// issue order (R2); sorted by communicator, no empty queues (a rank
    /// has a few communicators in flight at once).
    on_comm: Vec<(CommId, VecDeque<LaunchRef>)>,
    /// Launches holding a kernel slot (R10).
    running: u32,
}

/// Everything that changes while a program runs. Cheap to clone, and
/// hashable: two interleavings that reach equal states have the same futures.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    threads: Vec<ThreadState>,
    streams: Vec<StreamState>,
    ranks: Vec<RankState>,
    launches: table::Table<LaunchRef, Launch>,
    channels: table::Table<ChannelKey, Channel>,
    /// Latest `record` of each event: (stream, entry index).
    events: Vec<Option<(StreamId, u32)>>,
    /// Messages posted and not consumed: (from, to, tag) → count;
    /// negative when a machine settled from a cut ([`Machine::settle_from`])
    /// knows of `await`s that consumed messages whose `notify` it has not
    /// seen yet.
    mail: BTreeMap<(Rank, Rank, TagId), i64>,
    /// R7: (comm, a, b) means rank a has issued an op toward b on comm.
    /// R7: connection setup rounds rank a has entered toward b on comm c.
    rounds: BTreeMap<(CommId, Rank, Rank), u32>,
    /// R7: connected sides: (comm, a, b, Send) is a's send side toward b,
    /// (comm, a, b, Recv) a's receive side from b.
    sides: BTreeSet<(CommId, Rank, Rank, Dir)>,
    /// R7: the setup rounds whose two calls' sides do not complement each
    /// other ([`Mismatch`]). A set, and each ordered by rank, so that steps
    /// of different ranks still commute (the explorer's reduction).
    mismatches: BTreeSet<Mismatch>,
}

/// The sides of a connection that one call sets up in a setup round (R7).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NewSides {
    /// Its send side toward the peer.
    pub send: bool,
    /// Its receive side from the peer.
    pub recv: bool,
}

impl NewSides {
    /// Whether a call that sets up these sides and the peer's call that
    /// sets up `theirs` set up the two ends of the same connections: my
    /// send side with their receive side, my receive side with their send
    /// side.
    pub fn complements(self, theirs: NewSides) -> bool {
        self.send == theirs.recv && self.recv == theirs.send
    }

    fn describe(self) -> &'static str {
        match (self.send, self.recv) {
            (true, true) => "its send and receive sides",
            (true, false) => "its send side",
            (false, true) => "its receive side",
            (false, false) => "no side",
        }
    }
}

/// R7, as NCCL 2.28 does it (`ncclTransportP2pSetup` in `transport.cc`):
/// in a setup round between two ranks that exchange one message each way
/// (a communicator of two ranks, or two ranks half the communicator apart),
/// each rank sends the connection data of the sides it sets up and reads
/// the peer's as the data of the matching ends: its send side connects with
/// the first entries of what the peer sent, taken for the peer's receive
/// side. When the two calls' sides do not complement each other (both
/// ranks' first ops toward each other are sends, say), connections are made
/// from the wrong data: undefined behaviour, seen on GPUs as a hang, a
/// crash ("illegal memory access") and an NCCL internal error
/// (`docs/semantics.md`, R7).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Mismatch {
    /// The communicator.
    pub comm: CommId,
    /// The round.
    pub round: u32,
    /// The two ranks of the round, the sides each call set up, and the
    /// call; the lower rank first.
    pub calls: [(Rank, NewSides, Origin); 2],
}

impl Mismatch {
    /// Whether this round set up a side of channel `key` (from, to): the
    /// sender's send side toward the receiver, or the receiver's receive
    /// side from the sender, in a round between those two ranks.
    fn set_up(&self, (comm, from, to): ChannelKey) -> bool {
        let of = |rank: Rank| self.calls.iter().find(|(r, _, _)| *r == rank);
        self.comm == comm
            && match (of(from), of(to)) {
                (Some((_, sender, _)), Some((_, receiver, _))) => sender.send || receiver.recv,
                _ => false,
            }
    }
}

/// A message movement, reported to drivers that move real bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// A send completed into its channel's buffer (R5): its bytes must be
    /// taken now, the sender may overwrite them.
    Buffered {
        /// The send.
        send: OpRef,
    },
    /// A recv completed with the bytes of this send (taken earlier if the send
    /// was buffered).
    Delivered {
        /// The send.
        send: OpRef,
        /// The recv.
        recv: OpRef,
    },
}

/// The state machine: a [`Setup`] and a [`State`].
#[derive(Clone, Debug)]
pub struct Machine {
    setup: Arc<Setup>,
    state: State,
    /// Message movements since the last [`Machine::take_deliveries`], when
    /// recording is on (not part of the state).
    deliveries: Option<Vec<Delivery>>,
    /// Launches issued, started, with an op that changed, or completed
    /// since the last [`Machine::take_changed_launches`], when recording is
    /// on (not part of the state): a timeline looks at these, not at every
    /// live op after every step.
    changed: Option<Vec<LaunchRef>>,
    /// What device progress still has to look at, and which ranks a step
    /// touched (not part of the state: empty between steps, except for
    /// the parked streams and the touched ranks, which are caches).
    work: device::Work,
}

impl Machine {
    /// The initial state of `setup`: nothing issued, nothing connected.
    pub fn new(setup: Arc<Setup>) -> Machine {
        let state = State {
            threads: Vec::new(),
            streams: Vec::new(),
            ranks: vec![RankState::default(); setup.ranks as usize],
            launches: table::Table::default(),
            channels: table::Table::default(),
            events: Vec::new(),
            mail: BTreeMap::new(),
            rounds: BTreeMap::new(),
            sides: BTreeSet::new(),
            mismatches: BTreeSet::new(),
        };
        let mut m = Machine {
            setup,
            state,
            deliveries: None,
            changed: None,
            work: device::Work::default(),
        };
        m.sync_setup();
        m
    }

    /// Starts recording [`Delivery`] events.
    pub fn record_deliveries(&mut self) {
        self.deliveries.get_or_insert_with(Vec::new);
    }

    /// The deliveries since the last call, in the order they happened.
    pub fn take_deliveries(&mut self) -> Vec<Delivery> {
        self.deliveries
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Starts recording which launches change ([`Machine::take_changed_launches`]).
    pub fn record_changed_launches(&mut self) {
        self.changed.get_or_insert_with(Vec::new);
    }

    /// The launches issued, started, with an op whose status changed, or
    /// completed since the last call (each once, in key order, as
    /// [`Machine::live_ops`] lists them); empty unless recording is on.
    pub fn take_changed_launches(&mut self) -> Vec<LaunchRef> {
        let mut v = self
            .changed
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Notes that launch `lref` changed, when recording.
    fn launch_changed(&mut self, lref: LaunchRef) {
        if let Some(c) = self.changed.as_mut() {
            c.push(lref);
        }
    }

    /// How many ops launch `lref` has, `None` once it completed (or if it
    /// was never issued).
    pub fn launch_ops(&self, lref: LaunchRef) -> Option<usize> {
        self.state.launches.get(&lref).map(|l| l.ops.len())
    }

    /// True once op `op` has completed (or was never issued by a live launch).
    pub fn op_done(&self, op: OpRef) -> bool {
        self.state
            .launches
            .get(&op.launch)
            .is_none_or(|l| l.ops[op.index as usize].status == OpStatus::Done)
    }

    /// Every op of every launch not yet completed (the group's completed
    /// ops included), described: for timelines.
    pub fn live_ops(&self) -> Vec<(OpRef, OpInfo)> {
        self.state
            .launches
            .sorted()
            .into_iter()
            .flat_map(|(lref, l)| {
                (0..l.ops.len()).map(move |i| {
                    (
                        OpRef {
                            launch: *lref,
                            index: i as u16,
                        },
                        self.op_view(*lref, i),
                    )
                })
            })
            .collect()
    }

    /// Describes a live op (for data-race reports).
    pub fn describe_op(&self, op: OpRef) -> Option<OpInfo> {
        let launch = self.state.launches.get(&op.launch)?;
        (usize::from(op.index) < launch.ops.len())
            .then(|| self.op_view(op.launch, op.index as usize))
    }

    /// The setup.
    pub fn setup(&self) -> &Setup {
        &self.setup
    }

    /// Changes the setup (only to add to it: the simulated transport creates
    /// streams, events and communicators as user code runs).
    pub fn setup_mut(&mut self) -> &mut Setup {
        Arc::make_mut(&mut self.setup)
    }

    /// Makes room in the state for threads, streams and events added to the
    /// setup since the last call.
    pub fn sync_setup(&mut self) {
        let s = &self.setup;
        self.state.threads.resize(
            s.threads.len(),
            ThreadState {
                phase: Phase::Running,
                wait: Wait::None,
                calls: 0,
            },
        );
        self.state
            .streams
            .resize(s.streams.len(), StreamState::default());
        self.state.events.resize(s.events.len(), None);
        self.work.fit(s.ranks as usize, s.streams.len());
    }

    /// The state, for hashing and comparison.
    pub fn state(&self) -> &State {
        &self.state
    }

    /// Calls made by thread `t` so far.
    pub fn calls(&self, t: ThreadId) -> u32 {
        self.state.threads[t.ix()].calls
    }

    /// What thread `t` can do now.
    pub fn next(&self, t: ThreadId) -> Next {
        let th = &self.state.threads[t.ix()];
        let ready = self.wait_satisfied(t, &th.wait);
        match (&th.phase, ready) {
            (Phase::Ended, true) => Next::Finished,
            (_, false) => Next::Blocked,
            (Phase::Connecting { .. }, true) => Next::Resume,
            (Phase::Running, true) => Next::Call,
        }
    }

    /// True while thread `t`'s last call waits for a connection handshake (R7).
    pub fn in_handshake(&self, t: ThreadId) -> bool {
        matches!(self.state.threads[t.ix()].phase, Phase::Connecting { .. })
    }

    /// The launch thread `t` has in its connection handshake (R7), if any.
    pub fn handshake_launch(&self, t: ThreadId) -> Option<&LaunchSpec> {
        match &self.state.threads[t.ix()].phase {
            Phase::Connecting { spec, .. } => Some(spec),
            _ => None,
        }
    }

    /// The error a finished program still has: a message sent into a
    /// channel's buffer (R5) that no recv took.
    pub fn leftover(&self) -> Option<ProgramError> {
        self.state
            .channels
            .sorted()
            .into_iter()
            .find_map(|(key, ch)| {
                ch.sends
                    .iter()
                    .find(|s| !s.ghost)
                    .map(|slot| ProgramError::NeverReceived {
                        send: Box::new(self.slot_view(*key, Dir::Send, slot, ch.delivered)),
                    })
            })
    }

    fn rank_of(&self, t: ThreadId) -> Rank {
        self.setup.threads[t.ix()].rank
    }

    fn wait_satisfied(&self, t: ThreadId, wait: &Wait) -> bool {
        rules::free(|f| self.wait_blockers(t, wait, f))
    }

    /// Whether thread `t` can make `call` now: it is between calls and
    /// nothing holds the call back (`call_blockers` in `rules.rs`: for `await`,
    /// a matching message has arrived; for `join`, the joined thread has
    /// finished; for a launch, no other thread of the rank is inside a call
    /// on its communicators, R11).
    pub fn enabled(&self, t: ThreadId, call: &HostCall) -> bool {
        self.next(t) == Next::Call && rules::free(|f| self.call_blockers(t, call, f))
    }

    /// Checks a call without changing anything: an invalid call (a rank that
    /// does not exist, a peer outside the communicator, a stream or event of
    /// another rank) is refused and the machine stays usable.
    pub fn check_call(&self, t: ThreadId, call: &HostCall) -> Result<(), ProgramError> {
        let rank = self.rank_of(t);
        match call {
            HostCall::Launch(spec) => self.validate(rank, spec),
            HostCall::Record {
                event,
                stream,
                origin,
            }
            | HostCall::Wait {
                event,
                stream,
                origin,
            } => {
                self.check_stream(rank, *stream, *origin)?;
                self.check_event(rank, *event, *origin)
            }
            HostCall::Sync {
                stream: Some(s),
                origin,
            } => self.check_stream(rank, *s, *origin),
            HostCall::Sync { stream: None, .. } | HostCall::End => Ok(()),
            HostCall::Notify { to: r, origin, .. }
            | HostCall::Await {
                from: r, origin, ..
            } => self.check_rank(*r, *origin),
            HostCall::Join { thread, origin } => match self.setup.threads.get(thread.ix()) {
                Some(info) if info.rank == rank && *thread != t => Ok(()),
                _ => Err(self.invalid(
                    *origin,
                    format!("thread #{} is not another thread of rank {rank}", thread.0),
                )),
            },
        }
    }

    /// Checks a call as [`Machine::apply`] would, without changing
    /// anything: [`Machine::check_call`], and for a launch whether an op
    /// meets a partner already issued that disagrees with it on size, type
    /// or grouping (R3, R8). A real backend calls this before NCCL sees the
    /// call.
    pub fn check_issue(&self, t: ThreadId, call: &HostCall) -> Result<(), ProgramError> {
        self.check_call(t, call)?;
        match call {
            // A launch that enters a connection handshake (R7) is enqueued,
            // and compared with its partners (R3), only once the handshake
            // is over ([`Machine::resume`]); if it never is, it never is.
            HostCall::Launch(spec) if !self.would_handshake(t, spec) => self.match_check(t, spec),
            _ => Ok(()),
        }
    }

    /// Performs thread `t`'s next call, which must be [`Machine::enabled`].
    /// A call that fails [`Machine::check_issue`] (invalid, or a mismatch
    /// with its partner) changes nothing, so the machine stays usable.
    pub fn apply(&mut self, t: ThreadId, call: &HostCall) -> Result<(), ProgramError> {
        debug_assert!(self.enabled(t, call));
        self.check_issue(t, call)?;
        self.perform(t, call)
    }

    /// [`Machine::apply`] of a call that [`Machine::check_issue`] has just
    /// accepted on this very state (a real backend checks before it
    /// launches, then records): the check is not made twice.
    pub fn apply_checked(&mut self, t: ThreadId, call: &HostCall) -> Result<(), ProgramError> {
        debug_assert!(self.enabled(t, call));
        debug_assert!(self.check_issue(t, call).is_ok());
        self.perform(t, call)
    }

    /// The effect of thread `t`'s next call, checked.
    fn perform(&mut self, t: ThreadId, call: &HostCall) -> Result<(), ProgramError> {
        let rank = self.rank_of(t);
        self.touch(rank);
        let th = &mut self.state.threads[t.ix()];
        let seq = th.calls;
        th.calls += 1;
        match *call {
            HostCall::Launch(ref spec) => {
                let pairs = self.handshakes(rank, spec);
                if pairs.is_empty() {
                    self.enqueue(t, seq, spec);
                } else {
                    for (_, peer, _) in &pairs {
                        self.touch(*peer);
                    }
                    let th = &mut self.state.threads[t.ix()];
                    th.phase = Phase::Connecting {
                        spec: spec.clone(),
                        seq,
                    };
                    th.wait = Wait::Connect { pairs };
                }
            }
            HostCall::Record { event, stream, .. } => {
                let s = &mut self.state.streams[stream.ix()];
                let index = s.issued();
                s.queue.push_back(Entry::Record);
                self.state.events[event.ix()] = Some((stream, index));
                self.stream_changed(stream);
            }
            HostCall::Wait {
                event,
                stream,
                origin,
            } => {
                let target = self.state.events[event.ix()];
                self.state.streams[stream.ix()]
                    .queue
                    .push_back(Entry::WaitEvent(target, origin));
                self.stream_changed(stream);
            }
            HostCall::Sync { stream, origin } => {
                let targets = self.drain_targets(rank, stream);
                self.state.threads[t.ix()].wait = Wait::Streams {
                    targets,
                    origin: Some(origin),
                };
                self.forget_satisfied_waits(rank);
            }
            HostCall::Notify { to, tag, .. } => {
                let key = (rank, to, tag);
                let n = self.state.mail.entry(key).or_insert(0);
                *n += 1;
                if *n == 0 {
                    self.state.mail.remove(&key);
                }
                self.touch(to);
            }
            HostCall::Await { from, tag, .. } => {
                let key = (from, rank, tag);
                if let Some(n) = self.state.mail.get_mut(&key) {
                    *n -= 1;
                    if *n == 0 {
                        self.state.mail.remove(&key);
                    }
                }
            }
            HostCall::Join { .. } => {}
            HostCall::End => {
                let targets = self.drain_targets(rank, None);
                let th = &mut self.state.threads[t.ix()];
                th.phase = Phase::Ended;
                th.wait = Wait::Streams {
                    targets,
                    origin: None,
                };
                self.forget_satisfied_waits(rank);
            }
        }
        self.progress();
        Ok(())
    }

    /// Finishes thread `t`'s call that waited for handshakes. Requires
    /// [`Machine::next`] to be [`Next::Resume`].
    pub fn resume(&mut self, t: ThreadId) -> Result<(), ProgramError> {
        let Phase::Connecting { spec, .. } = &self.state.threads[t.ix()].phase else {
            debug_assert!(false, "resume without a pending handshake");
            return Ok(());
        };
        self.match_check(t, spec)?;
        let th = &mut self.state.threads[t.ix()];
        let phase = std::mem::replace(&mut th.phase, Phase::Running);
        th.wait = Wait::None;
        let Phase::Connecting { spec, seq } = phase else {
            return Ok(());
        };
        let rank = self.rank_of(t);
        self.touch(rank);
        self.connect_sides(rank, &spec);
        self.enqueue(t, seq, &spec);
        self.progress();
        Ok(())
    }

    /// Finishes every call that waited for handshakes and can finish now
    /// ([`Machine::resume`] for each thread whose [`Machine::next`] is
    /// [`Next::Resume`]), in thread order, in one pass: whether any did,
    /// and the first that met a program error (the pass stops there, the
    /// thread still waiting). A handshake finished may let a lower thread's
    /// finish too: a caller that wants every one asks again until none does.
    pub fn resume_all(&mut self) -> (bool, Option<(ThreadId, ProgramError)>) {
        let mut any = false;
        for i in 0..self.setup.threads.len() {
            let t = ThreadId(i as u32);
            while self.next(t) == Next::Resume {
                if let Err(e) = self.resume(t) {
                    return (any, Some((t, e)));
                }
                any = true;
            }
        }
        (any, None)
    }

    fn drain_targets(&self, rank: Rank, stream: Option<StreamId>) -> Vec<(StreamId, u32)> {
        let issued = |s: StreamId| (s, self.state.streams[s.ix()].issued());
        match stream {
            Some(s) => vec![issued(s)],
            None => self
                .setup
                .streams_of(rank)
                .map(issued)
                .filter(|(s, n)| self.state.streams[s.ix()].base < *n)
                .collect(),
        }
    }

    fn invalid(&self, origin: Origin, message: String) -> ProgramError {
        ProgramError::Invalid {
            place: describe_origin(&self.setup, origin),
            message,
        }
    }

    fn check_rank(&self, r: Rank, origin: Origin) -> Result<(), ProgramError> {
        if r < self.setup.ranks {
            Ok(())
        } else {
            Err(self.invalid(
                origin,
                format!(
                    "rank {r} does not exist (there are {} ranks)",
                    self.setup.ranks
                ),
            ))
        }
    }

    fn check_stream(&self, rank: Rank, s: StreamId, origin: Origin) -> Result<(), ProgramError> {
        match self.setup.streams.get(s.ix()) {
            Some(info) if info.rank == rank => Ok(()),
            Some(info) => Err(self.invalid(
                origin,
                format!(
                    "stream `{}` belongs to rank {}, not rank {rank}",
                    info.name, info.rank
                ),
            )),
            None => Err(self.invalid(origin, format!("stream #{} does not exist", s.0))),
        }
    }

    fn check_event(&self, rank: Rank, e: EventId, origin: Origin) -> Result<(), ProgramError> {
        match self.setup.events.get(e.ix()) {
            Some(info) if info.rank == rank => Ok(()),
            Some(info) => Err(self.invalid(
                origin,
                format!(
                    "event `{}` belongs to rank {}, not rank {rank}",
                    info.name, info.rank
                ),
            )),
            None => Err(self.invalid(origin, format!("event #{} does not exist", e.0))),
        }
    }

    fn validate(&self, rank: Rank, spec: &LaunchSpec) -> Result<(), ProgramError> {
        if spec.ops.is_empty() {
            return Err(self.invalid(spec.origin, "a group must hold at least one op".into()));
        }
        if let Some(message) = launch_too_large(spec.ops.len()) {
            return Err(self.invalid(spec.origin, message));
        }
        for op in &spec.ops {
            let origin = op.origin.unwrap_or(spec.origin);
            self.check_rank(op.peer, origin)?;
            self.check_stream(rank, op.stream, origin)?;
            let Some(comm) = self.setup.comms.get(op.comm.ix()) else {
                return Err(self.invalid(
                    origin,
                    format!("communicator #{} does not exist", op.comm.0),
                ));
            };
            for (who, r) in [("the calling rank", rank), ("the peer", op.peer)] {
                if !comm.members.contains(&r) {
                    return Err(self.invalid(
                        origin,
                        format!(
                            "{} {} {}: rank {r} ({who}) is not a member of communicator `{}`",
                            op.dir.name(),
                            op.peer,
                            crate::Size(op.bytes),
                            comm.name
                        ),
                    ));
                }
            }
        }
        if let Some(i) = unpaired_self_op(rank, &spec.ops) {
            let op = &spec.ops[i];
            return Err(self.invalid(
                op.origin.unwrap_or(spec.origin),
                self_unpaired_message(rank, &spec.ops, i),
            ));
        }
        Ok(())
    }

    /// Rounds of connection setup `peer` has entered toward `rank` on `comm`.
    pub(crate) fn peer_rounds(&self, comm: CommId, peer: Rank, rank: Rank) -> u32 {
        self.state
            .rounds
            .get(&(comm, peer, rank))
            .copied()
            .unwrap_or(0)
    }

    /// R7, as measured: a call whose ops need a side of a connection this
    /// rank has not set up (its send side toward a peer, or its receive side
    /// from it) enters a setup round with that peer, and blocks until the
    /// peer has entered the same round, by any call that needs a new side
    /// toward this rank. Each round connects the sides its own call needed.
    /// Returns the (comm, peer, round) the call waits for. The call returns
    /// by a [`Machine::resume`] step, on both sides of a round, which also
    /// makes the two orders of two first uses lead to the same state.
    ///
    /// A round whose two calls' sides do not complement each other, where
    /// NCCL exchanges the data of the two as if they did, is recorded as a
    /// [`Mismatch`] (the hang report names it; the calls go on as the
    /// model's rounds say).
    fn handshakes(&mut self, rank: Rank, spec: &LaunchSpec) -> Vec<(CommId, Rank, u32)> {
        let pairs = self.new_sides(rank, spec);
        let mut out = Vec::with_capacity(pairs.len());
        for (comm, peer) in pairs {
            let n = self.state.rounds.entry((comm, rank, peer)).or_insert(0);
            *n += 1;
            let n = *n;
            let mine = self.sides_set_up(comm, rank, peer, &spec.ops);
            if let Some((theirs, origin)) = self.in_round(comm, peer, rank, n)
                && !mine.complements(theirs)
                && self.one_message_each_way(comm, rank, peer)
            {
                let (a, b) = ((peer, theirs, origin), (rank, mine, spec.origin));
                self.state.mismatches.insert(Mismatch {
                    comm,
                    round: n,
                    calls: if a.0 < b.0 { [a, b] } else { [b, a] },
                });
            }
            out.push((comm, peer, n));
        }
        out
    }

    /// The call of `rank` waiting in setup round `n` with `peer` on `comm`,
    /// if `rank` has entered it: the sides it sets up and where it was
    /// made. Such a call is still connecting when the peer enters round
    /// `n`, since it returns only once the peer has (and by R11 no other
    /// call of `rank` on `comm` starts a round meanwhile).
    fn in_round(&self, comm: CommId, rank: Rank, peer: Rank, n: u32) -> Option<(NewSides, Origin)> {
        self.setup.threads_of(rank).find_map(|u| {
            let th = &self.state.threads[u.ix()];
            match (&th.phase, &th.wait) {
                (Phase::Connecting { spec, .. }, Wait::Connect { pairs })
                    if pairs.contains(&(comm, peer, n)) =>
                {
                    Some((self.sides_set_up(comm, rank, peer, &spec.ops), spec.origin))
                }
                _ => None,
            }
        })
    }

    /// The sides toward `peer` on `comm` that `ops` of `rank` need and
    /// `rank` has not connected.
    fn sides_set_up(&self, comm: CommId, rank: Rank, peer: Rank, ops: &[OpSpec]) -> NewSides {
        let mut s = NewSides::default();
        for op in ops {
            if op.comm == comm
                && op.peer == peer
                && !self.state.sides.contains(&(comm, rank, peer, op.dir))
            {
                match op.dir {
                    Dir::Send => s.send = true,
                    Dir::Recv => s.recv = true,
                }
            }
        }
        s
    }

    /// Whether NCCL's setup exchanges one message each way between `a` and
    /// `b` on `comm` (`ncclTransportP2pSetup`: its send peer and its
    /// receive peer at step i are the same rank): a communicator of two,
    /// or two ranks half of it apart. Otherwise a rank's send side waits
    /// for the peer's receive side by its own message, which the model's
    /// rounds do not follow (`docs/semantics.md`, R7). NCCL numbers a
    /// communicator's ranks in the order of their ranks in the world (the
    /// split's key), whatever order the members were written in.
    fn one_message_each_way(&self, comm: CommId, a: Rank, b: Rank) -> bool {
        let mut members = self.setup.comms[comm.ix()].members.clone();
        members.sort_unstable();
        let n = members.len();
        match (
            members.iter().position(|&r| r == a),
            members.iter().position(|&r| r == b),
        ) {
            (Some(i), Some(j)) => n == 2 || 2 * ((j + n - i) % n) == n,
            _ => false,
        }
    }

    /// The setup rounds so far whose calls' sides did not complement each
    /// other ([`Mismatch`]).
    pub fn mismatches(&self) -> impl Iterator<Item = &Mismatch> {
        self.state.mismatches.iter()
    }

    /// Whether channel `key` buffers its first message under
    /// `cold-channels=mismatched`: it joins two ranks whose setup rounds
    /// the model pairs as NCCL does (one message each way,
    /// [`Machine::one_message_each_way`]; elsewhere NCCL waits for a side
    /// the model's rounds do not follow, so R6 stays), and no side of it
    /// was set up in a round of mismatched calls (R7).
    fn warm_by_its_round(&self, key: ChannelKey) -> bool {
        let (comm, from, to) = key;
        from != to
            && self.one_message_each_way(comm, from, to)
            && !self.state.mismatches.iter().any(|m| m.set_up(key))
    }

    /// A [`Mismatch`] in words.
    pub fn describe_mismatch(&self, m: &Mismatch) -> String {
        let call = |(rank, sides, origin): (Rank, NewSides, Origin)| {
            let (text, place) = match self.setup.origins.get(origin.ix()) {
                Some(o) => (o.text.to_string(), o.place()),
                None => (format!("call #{}", origin.0), String::new()),
            };
            let place = if place.is_empty() {
                String::new()
            } else {
                format!(" ({place})")
            };
            format!("rank {rank}'s `{text}`{place} sets up {}", sides.describe())
        };
        let [a, b] = m.calls;
        format!(
            "setup round {} of comm {} between ranks {} and {}: {}, {}; NCCL reads each rank's connection data as the data of the other's matching ends",
            m.round,
            self.setup.comms[m.comm.ix()].name,
            a.0,
            b.0,
            call(a),
            call(b)
        )
    }

    /// The (communicator, peer) pairs with which a launch of `rank` needs a
    /// side it has not connected (R7).
    fn new_sides(&self, rank: Rank, spec: &LaunchSpec) -> Vec<(CommId, Rank)> {
        new_sides_of(
            |c| self.setup.comms[c.ix()].warm,
            &self.state.sides,
            rank,
            &spec.ops,
        )
    }

    /// Whether thread `t` making launch `spec` now would block in a
    /// connection handshake (R7). Changes nothing.
    pub fn would_handshake(&self, t: ThreadId, spec: &LaunchSpec) -> bool {
        !self.new_sides(self.rank_of(t), spec).is_empty()
    }

    /// The sides a launch's handshake connected (on [`Machine::resume`]).
    fn connect_sides(&mut self, rank: Rank, spec: &LaunchSpec) {
        let comms = &self.setup.comms;
        connect_sides_of(
            |c| comms[c.ix()].warm,
            &mut self.state.sides,
            rank,
            &spec.ops,
        );
    }

    /// The [`OpRef`] each op of a call gets, in the call's order: a group's
    /// ops are launched once per communicator (R8, as measured: only ops of
    /// one communicator wait for each other's streams), in the order the
    /// communicators first appear.
    pub fn op_refs(thread: ThreadId, seq: u32, spec: &LaunchSpec) -> Vec<OpRef> {
        Machine::op_refs_inline(thread, seq, spec).into_vec()
    }

    /// [`Machine::op_refs`], kept inline for launches of a few ops.
    fn op_refs_inline(thread: ThreadId, seq: u32, spec: &LaunchSpec) -> SmallVec<[OpRef; 2]> {
        let mut comms: SmallVec<[(CommId, u16); 2]> = SmallVec::new();
        spec.ops
            .iter()
            .map(|o| {
                let part = match comms.iter().position(|(c, _)| *c == o.comm) {
                    Some(p) => p,
                    None => {
                        comms.push((o.comm, 0));
                        comms.len() - 1
                    }
                };
                let index = comms[part].1;
                comms[part].1 += 1;
                OpRef {
                    launch: LaunchRef {
                        thread,
                        seq,
                        part: part as u16,
                    },
                    index,
                }
            })
            .collect()
    }

    /// R3 and R8 at issue: each op of a launch by `rank` meets the op at
    /// its position on the other side of its channel, if that one has been
    /// issued; they must agree on size, element type and grouping. Changes
    /// nothing.
    fn match_check(&self, t: ThreadId, spec: &LaunchSpec) -> Result<(), ProgramError> {
        let rank = self.rank_of(t);
        let launch = LaunchChannels::new(rank, &spec.ops);
        for (i, o) in spec.ops.iter().enumerate() {
            let key = channel_key(rank, o);
            let ch = self.state.channels.get(&key);
            let (mine, theirs) = match (ch, o.dir) {
                (None, _) => (0, 0),
                (Some(ch), Dir::Send) => (ch.sends.len(), ch.recvs.len()),
                (Some(ch), Dir::Recv) => (ch.recvs.len(), ch.sends.len()),
            };
            let position = mine + launch.earlier(i);
            let delivered = ch.map_or(0, |ch| ch.delivered);
            let copy = self.setup.comms[o.comm.ix()].copy;
            let sig = |bytes, dtype, grouped| issue::Sig {
                bytes,
                dtype,
                grouped,
            };
            let this_sig = sig(o.bytes, o.dtype, self.setup.grouped(spec, o));
            // The partner at its position: issued by an earlier launch, or
            // (a message to itself, R12) an earlier op of this one, whose
            // grouping is this op's.
            let partner = match ch {
                Some(ch) if position < theirs => {
                    let slot = match o.dir {
                        Dir::Send => &ch.recvs[position],
                        Dir::Recv => &ch.sends[position],
                    };
                    if slot.ghost {
                        continue;
                    }
                    // A partner is on the same channel, so on the same
                    // kind of communicator.
                    Partner::Slot(slot)
                }
                _ => match launch.partner(i, position - theirs) {
                    Some(j) => Partner::Launch(&spec.ops[j]),
                    None => continue,
                },
            };
            let partner_sig = match partner {
                Partner::Slot(p) => sig(p.bytes, p.dtype, p.grouped && !copy),
                Partner::Launch(p) => sig(p.bytes, p.dtype, this_sig.grouped),
            };
            if issue::agree(&partner_sig, &this_sig, self.setup.model.one_sided_groups) {
                continue;
            }
            let fifo = delivered + position as u64;
            let this = self.issuing_view(t, o, spec, fifo);
            let that = match partner {
                Partner::Slot(p) => self.slot_view(key, o.dir.other(), p, delivered),
                Partner::Launch(p) => self.issuing_view(t, p, spec, fifo),
            };
            let (send, recv) = if o.dir == Dir::Send {
                (this, that)
            } else {
                (that, this)
            };
            let (send, recv) = (Box::new(send), Box::new(recv));
            return Err(
                match issue::mismatch_kind(
                    (partner_sig.bytes, partner_sig.dtype),
                    (o.bytes, o.dtype),
                ) {
                    ProgramErrorKind::SizeMismatch => ProgramError::SizeMismatch { send, recv },
                    ProgramErrorKind::TypeMismatch => ProgramError::TypeMismatch { send, recv },
                    _ => ProgramError::GroupMismatch { send, recv },
                },
            );
        }
        Ok(())
    }

    /// The FIFO position (message number on its channel, from 0) each op
    /// of launch `call` by thread `t` gets if it is issued now.
    pub fn fifo_positions(&self, t: ThreadId, call: &HostCall) -> Vec<u64> {
        let HostCall::Launch(spec) = call else {
            return Vec::new();
        };
        let rank = self.rank_of(t);
        let launch = LaunchChannels::new(rank, &spec.ops);
        (0..spec.ops.len())
            .map(|i| {
                let o = &spec.ops[i];
                let issued = self
                    .state
                    .channels
                    .get(&channel_key(rank, o))
                    .map_or(0, |ch| {
                        ch.delivered
                            + match o.dir {
                                Dir::Send => ch.sends.len(),
                                Dir::Recv => ch.recvs.len(),
                            } as u64
                    });
                issued + launch.earlier(i) as u64
            })
            .collect()
    }

    /// Sends and recvs issued on a channel beyond what its other side has
    /// issued: at the end of a run, ops whose partner never came.
    pub fn unmatched(&self) -> Vec<OpInfo> {
        let mut out = Vec::new();
        for (key, ch) in self.state.channels.sorted() {
            // A ghost has no launch to describe.
            for s in ch.sends.iter().skip(ch.recvs.len()).filter(|s| !s.ghost) {
                out.push(self.slot_view(*key, Dir::Send, s, ch.delivered));
            }
            for r in ch.recvs.iter().skip(ch.sends.len()).filter(|r| !r.ghost) {
                out.push(self.slot_view(*key, Dir::Recv, r, ch.delivered));
            }
        }
        out
    }

    /// Puts a call's launches (one per communicator, R8) on their streams
    /// and their ops in their channels. [`Machine::match_check`] has
    /// passed.
    fn enqueue(&mut self, t: ThreadId, seq: u32, spec: &LaunchSpec) {
        let rank = self.rank_of(t);
        let refs = Machine::op_refs_inline(t, seq, spec);
        type Part = (LaunchRef, SmallVec<[Op; 2]>, SmallVec<[StreamId; 2]>);
        let mut parts: SmallVec<[Part; 2]> = SmallVec::new();
        for (o, op_ref) in spec.ops.iter().zip(&refs) {
            let ch = self.state.channels.entry(channel_key(rank, o)).or_default();
            let slot = Slot {
                op: *op_ref,
                bytes: o.bytes,
                dtype: o.dtype,
                grouped: spec.is_group(),
                origin: o.origin.unwrap_or(spec.origin),
                stream: o.stream,
                buffered: false,
                ghost: false,
            };
            let mine = match o.dir {
                Dir::Send => &mut ch.sends,
                Dir::Recv => &mut ch.recvs,
            };
            let fifo = ch.delivered + mine.len() as u64;
            mine.push_back(slot);
            let part = op_ref.launch.part as usize;
            if parts.len() <= part {
                parts.push((op_ref.launch, SmallVec::new(), SmallVec::new()));
            }
            let (_, ops, streams) = &mut parts[part];
            ops.push(Op {
                spec: o.clone(),
                fifo,
                status: OpStatus::Waiting,
            });
            if !streams.contains(&o.stream) {
                streams.push(o.stream);
            }
        }
        // A group's launches on copy-engine lanes go on their streams after
        // its NCCL launches: the backend issues them after `ncclGroupEnd`.
        parts.sort_by_key(|(_, ops, _)| self.setup.comms[ops[0].spec.comm.ix()].copy);
        for (lref, ops, streams) in parts {
            for s in &streams {
                self.state.streams[s.ix()]
                    .queue
                    .push_back(Entry::Launch(lref));
                self.stream_changed(*s);
            }
            let comm = ops[0].spec.comm;
            let r = &mut self.state.ranks[rank as usize];
            if self.setup.model.kernels.is_some() {
                r.pending.push_back(lref);
            }
            match r.on_comm.binary_search_by_key(&comm, |(c, _)| *c) {
                Ok(i) => r.on_comm[i].1.push_back(lref),
                Err(i) => r.on_comm.insert(i, (comm, VecDeque::from([lref]))),
            }
            self.launch_changed(lref);
            self.state.launches.insert(
                lref,
                Launch {
                    rank,
                    streams,
                    left: ops.len() as u32,
                    ops,
                    started: false,
                    grouped: spec.grouped,
                    origin: spec.origin,
                },
            );
        }
    }
}

/// R7's connected sides: (comm, a, b, Send) is a's send side toward b,
/// (comm, a, b, Recv) a's receive side from b.
pub type Sides = BTreeSet<(CommId, Rank, Rank, Dir)>;

/// R7: the (communicator, peer) pairs with which launch `ops` of `rank`
/// needs a side it has not connected (`sides`); each enters one setup
/// round. `warm` says which communicators were connected at creation.
pub fn new_sides_of(
    warm: impl Fn(CommId) -> bool,
    sides: &Sides,
    rank: Rank,
    ops: &[OpSpec],
) -> Vec<(CommId, Rank)> {
    let mut peers: Vec<(CommId, Rank)> = Vec::new();
    for op in ops {
        if warm(op.comm) || op.peer == rank {
            continue;
        }
        let pair = (op.comm, op.peer);
        if !sides.contains(&(op.comm, rank, op.peer, op.dir)) && !peers.contains(&pair) {
            peers.push(pair);
        }
    }
    peers
}

/// R7: the sides launch `ops` of `rank` connected, once its handshake
/// rounds (if [`new_sides_of`] found any) have completed.
pub fn connect_sides_of(
    warm: impl Fn(CommId) -> bool,
    sides: &mut Sides,
    rank: Rank,
    ops: &[OpSpec],
) {
    for op in ops {
        if !warm(op.comm) {
            sides.insert((op.comm, rank, op.peer, op.dir));
        }
    }
}

/// The most messages the two sides of a settled channel may be apart
/// ([`Machine::settle_from`]): each is a ghost in the state.
pub const MAX_GHOSTS: u32 = 1 << 20;

/// The most messages a settled channel may have counted
/// ([`Machine::settle_from`]): half the message numbers, so that a run
/// that goes on from there cannot overflow them.
pub const MAX_SETTLED: u64 = u64::MAX / 2;

/// What calls made before the ones a machine will see left behind, when
/// every op they launched had completed and every host wait among them had
/// returned (a rank's trace cut at such a point, `crate::trace::Cut`): only
/// counts remain, and [`Machine::settle_from`] starts a machine from them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Settled {
    /// Per channel (communicator, source, destination): the sends its
    /// source and the recvs its destination issued before, all completed.
    /// Either side may have issued more than the other (the ranks' cuts
    /// are taken at different times).
    pub channels: BTreeMap<(CommId, Rank, Rank), (u64, u64)>,
    /// Per channel: the sizes of its source's last sends, oldest first,
    /// for the ones still in the channel's buffer (R5); a send older than
    /// these counts as empty.
    pub recent: BTreeMap<(CommId, Rank, Rank), Vec<u64>>,
    /// R7: connection setup rounds rank a entered toward b on comm c.
    pub rounds: BTreeMap<(CommId, Rank, Rank), u32>,
    /// R7: the sides connected.
    pub sides: Sides,
    /// Per (from, to, tag): the `notify`s posted and the `await`s that
    /// consumed one.
    pub mail: BTreeMap<(Rank, Rank, TagId), (u32, u32)>,
}

impl Machine {
    /// Starts this machine, which must not have run a call yet, from
    /// `settled`: each channel has delivered the messages both its sides
    /// issued; a message only one side issued stays as a ghost of that
    /// side (a buffered send, a started recv) for the other side's next op
    /// to meet, without the comparison of sizes a live partner gets
    /// (R3, R8), and taking no room in the buffer (R5), since what it
    /// carried is not known. The sides and rounds of R7 and the `notify`
    /// counts are as the calls before left them.
    pub fn settle_from(&mut self, settled: &Settled) -> Result<(), String> {
        let fresh = self.state.launches.is_empty()
            && self.state.channels.is_empty()
            && self.state.mail.is_empty()
            && self.state.rounds.is_empty()
            && self.state.sides.is_empty()
            && self.state.threads.iter().all(|t| t.calls == 0);
        if !fresh {
            return Err("a machine can be settled only before its first call".into());
        }
        let mut refused: Vec<String> = Vec::new();
        for (&(comm, src, dst), &(sends, recvs)) in &settled.channels {
            if comm.ix() >= self.setup.comms.len()
                || src >= self.setup.ranks
                || dst >= self.setup.ranks
            {
                refused.push(format!(
                    "a settled channel names communicator #{} and ranks {src} and {dst}, which do not exist",
                    comm.0
                ));
                continue;
            }
            let delivered = sends.min(recvs);
            if sends == 0 && recvs == 0 {
                continue;
            }
            // Cuts come from other processes: a count no run reaches
            // between two cuts is refused, not a memory blow-up, and so is
            // one too close to the end of the message numbers for the run
            // to go on counting (each delivery adds one).
            // A channel refused is left unsettled and the others settle
            // all the same (found by review: the first refusal stopped
            // the rest, which the replay then refused in turn); each is
            // said.
            if sends.max(recvs) > MAX_SETTLED {
                refused.push(format!(
                    "a settled channel (communicator #{}, rank {src} to rank {dst}) has {sends} sends and {recvs} recvs: more than the {MAX_SETTLED} messages a channel is numbered to",
                    comm.0
                ));
                continue;
            }
            if sends.abs_diff(recvs) > u64::from(MAX_GHOSTS) {
                refused.push(format!(
                    "a settled channel (communicator #{}, rank {src} to rank {dst}) has {sends} sends and {recvs} recvs: more than {MAX_GHOSTS} messages apart",
                    comm.0
                ));
                continue;
            }
            let mut ch = Channel {
                delivered,
                ..Channel::default()
            };
            let recent = settled
                .recent
                .get(&(comm, src, dst))
                .map_or(&[][..], Vec::as_slice);
            for fifo in delivered..sends.max(recvs) {
                // A ghost send `fifo` is the (sends - fifo)-th last send,
                // of its recorded size if it is among the recent ones.
                let bytes = if sends > recvs {
                    let back = (sends - fifo) as usize;
                    recent.len().checked_sub(back).map_or(0, |i| recent[i])
                } else {
                    0
                };
                let ghost = Slot {
                    op: OpRef {
                        launch: LaunchRef {
                            thread: ThreadId(u32::MAX),
                            // Its number among the channel's ghosts (at
                            // most MAX_GHOSTS): unique in its list.
                            seq: u32::try_from(fifo - delivered).unwrap_or(u32::MAX),
                            part: 0,
                        },
                        index: 0,
                    },
                    bytes,
                    dtype: DType::U8,
                    grouped: false,
                    origin: Origin(u32::MAX),
                    stream: StreamId(u32::MAX),
                    buffered: sends > recvs,
                    ghost: true,
                };
                if sends > recvs {
                    ch.sends.push_back(ghost);
                } else {
                    ch.recvs.push_back(ghost);
                }
            }
            // Nothing moves until an op of the channel starts, which
            // looks at it again.
            self.state.channels.insert((comm, src, dst), ch);
        }
        let max_rounds = u32::MAX / 2;
        if let Some((&(comm, a, b), n)) = settled.rounds.iter().find(|(_, n)| **n > max_rounds) {
            return Err(format!(
                "a settled channel of communicator #{} between ranks {a} and {b} has entered {n} setup rounds: more than {max_rounds}",
                comm.0
            ));
        }
        self.state.rounds = settled.rounds.clone();
        self.state.sides = settled.sides.clone();
        for (&key, &(posted, consumed)) in &settled.mail {
            let n = i64::from(posted) - i64::from(consumed);
            if n != 0 {
                self.state.mail.insert(key, n);
            }
        }
        if refused.is_empty() {
            Ok(())
        } else {
            Err(refused.join("; "))
        }
    }
}

/// The most ops one launch (a group, or a plain call) may hold: the model
/// numbers a launch's ops with 16 bits ([`OpRef::index`]). NCCL itself
/// states no bound; a group this large is most likely a generated program
/// gone wrong, and is refused with this reason rather than numbered wrong.
pub const MAX_LAUNCH_OPS: usize = u16::MAX as usize;

/// Why a launch of `ops` ops is refused, if it is: more than
/// [`MAX_LAUNCH_OPS`]. Every backend and the parser ask this before the
/// model numbers the ops.
pub fn launch_too_large(ops: usize) -> Option<String> {
    (ops > MAX_LAUNCH_OPS).then(|| {
        format!(
            "a group of {ops} ops: at most {MAX_LAUNCH_OPS} ops may be launched together; split it into several groups"
        )
    })
}

/// R12: the op of a launch by `rank` to or from `rank` itself that has no
/// partner in the same launch, if any. NCCL pairs a rank's messages to
/// itself within one group launch, per communicator, in order
/// (`src/enqueue.cc`: "Trying to send to self without a matching recv",
/// `ncclInvalidUsage`); a self send or recv left over is refused there, it
/// never waits for a later launch. One function for the model
/// ([`Machine::check_call`]) and the NCCL backend's own check.
pub fn unpaired_self_op(rank: Rank, ops: &[OpSpec]) -> Option<usize> {
    if !ops.iter().any(|o| o.peer == rank) {
        return None;
    }
    // The op beyond the count of its partners on its communicator: in one
    // sort, so that a group of many messages to itself is not quadratic.
    let l = LaunchChannels::new(rank, ops);
    (0..ops.len()).find(|&i| ops[i].peer == rank && l.earlier(i) >= l.other_len(i))
}

/// What a refusal of R12 says of op `i` of a launch of `ops` by `rank`
/// ([`unpaired_self_op`]). Where the launch has a partner for it on
/// another communicator, it says that the two must share one (found by
/// review: `group { send 0 4KiB comm=world; recv 0 4KiB }` was told to
/// put both in one group, which they were).
pub fn self_unpaired_message(rank: Rank, ops: &[OpSpec], i: usize) -> String {
    let o = &ops[i];
    let (op, partner) = match o.dir {
        Dir::Send => ("send", "recv"),
        Dir::Recv => ("recv", "send"),
    };
    let elsewhere = ops
        .iter()
        .any(|p| p.peer == rank && p.dir != o.dir && p.comm != o.comm);
    let fix = if elsewhere {
        format!(
            "the launch's {partner} from itself is on another communicator: put both on one communicator"
        )
    } else {
        "put both in one group, on one communicator".to_string()
    };
    format!(
        "`{op} {rank} {}` is a message of rank {rank} to itself with no {partner} from itself on its communicator in the same launch: NCCL pairs a rank's messages to itself within one group, per communicator, and refuses one left over (R12); {fix}",
        crate::Size(o.bytes)
    )
}

/// The ops of one launch by a rank, by channel: for each op, how many ops
/// of the launch before it go the same way on its channel, and which go the
/// other way (only a rank's messages to itself have both sides of a channel
/// in one launch, R12). Made in one sort, so that a launch of the most ops
/// a launch may have ([`MAX_LAUNCH_OPS`]) costs n log n, not n²; kept
/// inline for launches of a few ops (the NCCL backend makes one per launch).
pub(crate) struct LaunchChannels {
    /// The ops' indices sorted by channel, then direction, then index.
    order: SmallVec<[u32; 4]>,
    /// Per op: how many ops before it in the launch go the same way on
    /// its channel (its place in its run of `order`).
    earlier: SmallVec<[u32; 4]>,
    /// Per op: the run in `order` of the other direction on its channel
    /// (start, length); empty when there is none.
    other: SmallVec<[(u32, u32); 4]>,
}

impl LaunchChannels {
    /// The channels of the ops `ops` of a launch by `rank`.
    pub(crate) fn new(rank: Rank, ops: &[OpSpec]) -> LaunchChannels {
        let n = ops.len();
        let key = |i: u32| {
            let o = &ops[i as usize];
            (channel_key(rank, o), o.dir == Dir::Recv)
        };
        let mut order: SmallVec<[u32; 4]> = (0..n as u32).collect();
        if n > 1 {
            order.sort_by_key(|&i| (key(i), i));
        }
        let mut earlier: SmallVec<[u32; 4]> = smallvec::smallvec![0; n];
        let mut other: SmallVec<[(u32, u32); 4]> = smallvec::smallvec![(0, 0); n];
        // The runs, in order: (start, end) of each (channel, direction).
        let mut runs: SmallVec<[(usize, usize); 4]> = SmallVec::new();
        let mut g = 0;
        while g < n {
            let k = key(order[g]);
            let mut e = g + 1;
            while e < n && key(order[e]) == k {
                e += 1;
            }
            runs.push((g, e));
            g = e;
        }
        for (r, &(g, e)) in runs.iter().enumerate() {
            let (channel, recv) = key(order[g]);
            // Sends sort before recvs: the other direction's run is the
            // next one (for sends) or the one before (for recvs), if it is
            // on the same channel.
            let neighbour = if recv {
                r.checked_sub(1).map(|p| runs[p])
            } else {
                runs.get(r + 1).copied()
            }
            .filter(|&(og, _)| key(order[og]).0 == channel);
            for j in g..e {
                let i = order[j] as usize;
                earlier[i] = (j - g) as u32;
                other[i] = neighbour.map_or((0, 0), |(og, oe)| (og as u32, (oe - og) as u32));
            }
        }
        LaunchChannels {
            order,
            earlier,
            other,
        }
    }

    /// Ops of the launch before op `i` that go the same way on its channel.
    pub(crate) fn earlier(&self, i: usize) -> usize {
        self.earlier[i] as usize
    }

    /// How many ops of the launch go the other way on op `i`'s channel
    /// (none unless it is a message to itself).
    pub(crate) fn other_len(&self, i: usize) -> usize {
        self.other[i].1 as usize
    }

    /// The op of the launch that is op `i`'s partner on its channel (R3)
    /// when that partner is an earlier op of the launch: the `k`-th op of
    /// the other direction on op `i`'s channel, where `k` is op `i`'s
    /// position counted from the first position the channel's other side
    /// had not issued before the launch. Only a message to itself can have
    /// one. The one place both issue checks ([`Machine::match_check`] and
    /// [`IssueMatch`](issue::IssueMatch)) find it.
    pub(crate) fn partner(&self, i: usize, k: usize) -> Option<usize> {
        let (start, len) = self.other[i];
        if k >= len as usize {
            return None;
        }
        let j = self.order[start as usize + k] as usize;
        (j < i).then_some(j)
    }
}

/// Where [`Machine::match_check`] found an op's partner.
enum Partner<'a> {
    /// In its channel, issued by an earlier launch.
    Slot(&'a Slot),
    /// An earlier op of the same launch (a message to itself).
    Launch(&'a OpSpec),
}

/// An op's channel within its launch: communicator, peer, direction. Ops
/// of one launch with the same one run in order (R8). Not
/// [`channel_key`]: a rank's send to itself and its recv from itself are
/// one channel there, two here.
fn launch_channel(op: &OpSpec) -> (CommId, Rank, Dir) {
    (op.comm, op.peer, op.dir)
}

/// The channel an op of `rank` travels on.
fn channel_key(rank: Rank, op: &OpSpec) -> ChannelKey {
    match op.dir {
        Dir::Send => (op.comm, rank, op.peer),
        Dir::Recv => (op.comm, op.peer, rank),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A seeded xorshift: each call gives a number below its argument.
    fn xorshift(mut x: u64) -> impl FnMut(u64) -> u64 {
        move |n| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        }
    }

    /// `n` ops of 4 bytes, each a send or a recv, to one of `peers` ranks
    /// (from 0), on one of two communicators.
    fn random_ops(next: &mut impl FnMut(u64) -> u64, n: usize, peers: u64) -> Vec<OpSpec> {
        (0..n)
            .map(|_| OpSpec {
                dir: if next(2) == 0 { Dir::Send } else { Dir::Recv },
                peer: next(peers) as Rank,
                bytes: 4,
                dtype: DType::U8,
                comm: CommId(next(2) as u32),
                stream: StreamId(0),
                origin: None,
            })
            .collect()
    }

    /// [`LaunchChannels`] gives, on random launches of up to 300 ops over
    /// two communicators, three peers and the rank itself, what the two
    /// definitions say op by op: the count of earlier ops the same way on
    /// the channel, and the `k`-th earlier op the other way.
    #[test]
    fn launch_channels_agree_with_their_definitions() {
        let mut next = xorshift(0x2545_F491_4F6C_DD1D);
        let rank = 1;
        let mut partners = 0;
        for _ in 0..400 {
            let n = 1 + next(300) as usize;
            let ops = random_ops(&mut next, n, 4);
            let l = LaunchChannels::new(rank, &ops);
            for (i, o) in ops.iter().enumerate() {
                let key = channel_key(rank, o);
                let same = |p: &OpSpec| channel_key(rank, p) == key;
                let earlier = ops[..i]
                    .iter()
                    .filter(|p| p.dir == o.dir && same(p))
                    .count();
                assert_eq!(l.earlier(i), earlier, "op {i} of {ops:?}");
                let others: Vec<usize> = (0..i)
                    .filter(|&j| ops[j].dir != o.dir && same(&ops[j]))
                    .collect();
                for k in 0..4 {
                    assert_eq!(l.partner(i, k), others.get(k).copied(), "op {i}, k {k}");
                }
                partners += others.len().min(4);
                if o.peer != rank {
                    assert!(others.is_empty(), "only a message to itself has both sides");
                }
            }
        }
        assert!(partners > 1000, "{partners} partners met");
    }

    /// R12's check in one sort gives what its definition says: the first
    /// op to or from the rank itself beyond the count of its partners on
    /// its communicator.
    #[test]
    fn unpaired_self_op_agrees_with_its_definition() {
        let mut next = xorshift(0x9E37_79B9_7F4A_7C15);
        let rank = 0;
        let (mut found, mut none) = (0, 0);
        for _ in 0..2000 {
            let n = 1 + next(12) as usize;
            let ops = random_ops(&mut next, n, 2);
            let selfs = || ops.iter().enumerate().filter(|(_, o)| o.peer == rank);
            let naive = selfs().find_map(|(i, o)| {
                let others = selfs()
                    .filter(|(_, p)| p.comm == o.comm && p.dir != o.dir)
                    .count();
                let before = selfs()
                    .filter(|(j, p)| *j < i && p.comm == o.comm && p.dir == o.dir)
                    .count();
                (before >= others).then_some(i)
            });
            assert_eq!(unpaired_self_op(rank, &ops), naive, "{ops:?}");
            if naive.is_some() {
                found += 1;
            } else {
                none += 1;
            }
        }
        assert!(found > 100 && none > 100, "{found} unpaired, {none} paired");
    }
}
