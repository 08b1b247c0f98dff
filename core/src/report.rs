//! What a hang or a program error looks like, whichever backend found it:
//! the ops involved, the blocked host calls, and the wait-for cycle.
//!
//! These are plain data with a `Display` (the text `duplex check` prints)
//! and a `Serialize` (its JSON). The simulator's analysis fills them from its
//! state machine; the NCCL backend fills them from the ops it has in flight.

use std::fmt;

use crate::schedule::Dir;
use crate::{Rank, Size};

/// A rule of `docs/semantics.md`, or a host call that waits by its own
/// nature: what a wait-for edge names. Prints (and serializes) as `R1` …
/// `R11`, `sync`, `end`, `await`, `join`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum Rule {
    /// Stream order.
    R1,
    /// Communicator order.
    R2,
    /// Matching: the k-th send meets the k-th recv of a channel.
    R3,
    /// Rendezvous: a pair completes once both sides have started.
    R4,
    /// Eager capacity of a connected channel.
    R5,
    /// A cold channel's first message is a rendezvous.
    R6,
    /// The lazy connection handshake.
    R7,
    /// Groups.
    R8,
    /// Events.
    R9,
    /// Kernel concurrency.
    R10,
    /// One caller per communicator at a time.
    R11,
    /// A host `sync` waits for streams to drain.
    #[serde(rename = "sync")]
    Sync,
    /// A thread's end waits for its rank's streams to drain.
    #[serde(rename = "end")]
    End,
    /// An `await` waits for a `notify`.
    #[serde(rename = "await")]
    Await,
    /// A `join` waits for a thread to end.
    #[serde(rename = "join")]
    Join,
}

impl Rule {
    /// The name reports print: `R4`, `sync`.
    pub fn name(self) -> &'static str {
        match self {
            Rule::R1 => "R1",
            Rule::R2 => "R2",
            Rule::R3 => "R3",
            Rule::R4 => "R4",
            Rule::R5 => "R5",
            Rule::R6 => "R6",
            Rule::R7 => "R7",
            Rule::R8 => "R8",
            Rule::R9 => "R9",
            Rule::R10 => "R10",
            Rule::R11 => "R11",
            Rule::Sync => "sync",
            Rule::End => "end",
            Rule::Await => "await",
            Rule::Join => "join",
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How far a point-to-point op got.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum OpState {
    /// Issued; its launch has not started (R1, R2, R10 hold it).
    #[serde(rename = "not started")]
    NotStarted,
    /// Its launch started, but an earlier op of its group to the same peer
    /// and in the same direction has not completed (R8).
    #[serde(rename = "started, behind an earlier op of its group")]
    BehindInGroup,
    /// Started: it waits for its partner (R4) or its turn (R3).
    #[serde(rename = "started")]
    Started,
    /// A send that completed into the channel's buffer (R5), not yet
    /// received.
    #[serde(rename = "buffered")]
    Buffered,
    /// Completed.
    #[serde(rename = "done")]
    Done,
    /// The op being issued when an error was found.
    #[serde(rename = "just issued")]
    JustIssued,
    /// A real backend's op whose completion is not known.
    #[serde(rename = "not complete")]
    NotComplete,
}

impl OpState {
    /// The words reports print.
    pub fn name(self) -> &'static str {
        match self {
            OpState::NotStarted => "not started",
            OpState::BehindInGroup => "started, behind an earlier op of its group",
            OpState::Started => "started",
            OpState::Buffered => "buffered",
            OpState::Done => "done",
            OpState::JustIssued => "just issued",
            OpState::NotComplete => "not complete",
        }
    }
}

impl fmt::Display for OpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How many blocked calls, and how many ops, a report's text lists (a hang
/// across thousands of ranks blocks thousands of calls); the structured
/// report keeps all of them.
pub const LISTED: usize = 40;

/// The line, indented by `indent`, that says how many of a list of `n`
/// (the report's `field`) were not shown, if any: a report's text lists
/// [`LISTED`] of each.
pub fn more(f: &mut fmt::Formatter<'_>, indent: &str, n: usize, field: &str) -> fmt::Result {
    if n > LISTED {
        writeln!(
            f,
            "{indent}… {} more not shown (all of them: the report's `{field}` list, `--format json`)",
            n - LISTED
        )?;
    }
    Ok(())
}

/// `n` and `noun`, plural unless `n` is 1: "1 host step", "2 host steps"
/// (a noun whose plural adds `s`).
pub fn counted(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// One point-to-point op as a report shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct OpInfo {
    /// The rank that issued it.
    pub rank: u32,
    /// The issuing host thread.
    pub thread: String,
    /// `send` or `recv`.
    pub op: Dir,
    /// The other rank.
    pub peer: u32,
    /// Bytes.
    pub bytes: u64,
    /// Element type.
    pub dtype: crate::DType,
    /// The communicator.
    pub comm: String,
    /// The stream.
    pub stream: String,
    /// Its position in its channel's FIFO: it is message `#fifo` (from 0)
    /// from `src` to `dst` on `comm`.
    pub fifo: u64,
    /// How far it got.
    pub state: OpState,
    /// Issued inside a group.
    pub grouped: bool,
    /// The statement or call that issued it.
    pub call: String,
    /// Where that is (`line 4`, `src/main.rs:12:5`).
    pub at: String,
    /// The schedule line, when there is one.
    pub line: Option<u32>,
}

impl fmt::Display for OpInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let arrow = match self.op {
            Dir::Send => "→",
            Dir::Recv => "←",
        };
        let (src, dst) = match self.op {
            Dir::Send => (self.rank, self.peer),
            Dir::Recv => (self.peer, self.rank),
        };
        write!(
            f,
            "rank {} {}: {} {arrow} {} {}{} ({}{}) [stream {}, comm {}, message #{} of {src}→{dst}, {}]",
            self.rank,
            self.thread,
            self.op.name(),
            self.peer,
            Size(self.bytes),
            if self.dtype == crate::DType::U8 {
                String::new()
            } else {
                format!(" of {}", self.dtype)
            },
            self.at,
            if self.grouped { ", in a group" } else { "" },
            self.stream,
            self.comm,
            self.fifo,
            self.state
        )
    }
}

/// A host call that cannot return.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct BlockedCall {
    /// The rank.
    pub rank: Rank,
    /// The thread.
    pub thread: String,
    /// The call (`sync`, `await 1 meta`, `end of thread`, ...).
    pub call: String,
    /// Where it was made.
    pub at: String,
    /// The schedule line, when there is one.
    pub line: Option<u32>,
    /// What it waits for.
    pub waits_for: String,
}

/// One step of a wait-for chain: `node` waits, by `rule`, for what
/// `waits_for` says (the next link's node, in a cycle).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Link {
    /// The waiting host call or device op, in words.
    pub node: String,
    /// What the node is, as data.
    pub what: Node,
    /// The rule that makes it wait.
    pub rule: Rule,
    /// What it waits for.
    pub waits_for: String,
}

/// What a node of a wait-for chain is.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Node {
    /// A host call that cannot return.
    Call {
        /// The call.
        call: BlockedCall,
    },
    /// A device launch: one op, or the ops of a group on one communicator.
    Launch {
        /// Its ops.
        ops: Vec<OpInfo>,
    },
    /// A `wait` entry at the head of a stream.
    Wait {
        /// The rank.
        rank: Rank,
        /// The stream.
        stream: String,
        /// Where the `wait` was issued.
        at: String,
    },
}

/// The explanation of a stuck state.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Stuck {
    /// The wait-for cycle; each link waits for the next, the last for the
    /// first. Empty when the hang has no cycle.
    pub cycle: Vec<Link>,
    /// Waits whose partner no thread will ever provide (an op whose partner
    /// is never issued, a message never sent).
    pub missing: Vec<Link>,
    /// Every host call that cannot return.
    pub blocked: Vec<BlockedCall>,
    /// Every issued device op that has not completed.
    pub ops: Vec<OpInfo>,
    /// Why the analysis could not say more, when it could not (a real
    /// backend missing some rank's calls, say).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// Connection setup rounds that NCCL makes from the wrong data (R7):
    /// each paired two calls whose sides do not complement each other
    /// ([`crate::machine::Mismatch`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mismatched_setups: Vec<String>,
}

impl fmt::Display for Stuck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.cycle.is_empty() {
            writeln!(
                f,
                "wait-for cycle ({} links; each waits for the next, the last for the first):",
                self.cycle.len()
            )?;
            for (i, l) in self.cycle.iter().enumerate() {
                writeln!(f, "  {}. {}", i + 1, l.node)?;
                writeln!(f, "       {}: {}", l.rule, l.waits_for)?;
            }
        }
        if !self.missing.is_empty() {
            writeln!(f, "waits that nothing will ever satisfy:")?;
            for l in &self.missing {
                writeln!(f, "  - {}", l.node)?;
                writeln!(f, "       {}: {}", l.rule, l.waits_for)?;
            }
        }
        if self.cycle.is_empty() && self.missing.is_empty() {
            match &self.note {
                Some(note) => writeln!(f, "{note}")?,
                None => writeln!(
                    f,
                    "no wait-for cycle was found (this is a bug in duplex's analysis; please report it)"
                )?,
            }
        }
        if !self.mismatched_setups.is_empty() {
            writeln!(
                f,
                "connection setups NCCL makes from the wrong data (R7; undefined behaviour: on GPUs a hang, a crash or an NCCL error instead of this report):"
            )?;
            for m in &self.mismatched_setups {
                writeln!(f, "  - {m}")?;
            }
        }
        writeln!(f, "blocked host calls:")?;
        for b in self.blocked.iter().take(LISTED) {
            writeln!(
                f,
                "  rank {} {}: `{}` ({}) {}",
                b.rank, b.thread, b.call, b.at, b.waits_for
            )?;
        }
        more(f, "  ", self.blocked.len(), "blocked")?;
        writeln!(f, "device ops issued and not completed:")?;
        if self.ops.is_empty() {
            writeln!(f, "  (none)")?;
        }
        for o in self.ops.iter().take(LISTED) {
            writeln!(f, "  {o}")?;
        }
        more(f, "  ", self.ops.len(), "ops")
    }
}
