//! What a hang or a program error looks like, whichever backend found it:
//! the ops involved, the blocked host calls, and the wait-for cycle.
//!
//! These are plain data with a `Display` (the text `duplex check` prints)
//! and a `Serialize` (its JSON). The simulator's analysis fills them from its
//! state machine; the NCCL backend fills them from the ops it has in flight.

use std::fmt;

use crate::schedule::Dir;
use crate::{Rank, Size};

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
    pub fifo: u32,
    /// `not started`, `started`, `buffered` (completed into the channel's
    /// buffer, R5) or `done`.
    pub state: &'static str,
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
    /// The waiting host call or device op.
    pub node: String,
    /// The rule that makes it wait (`R1` … `R10`, `sync`, `await`).
    pub rule: &'static str,
    /// What it waits for.
    pub waits_for: String,
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
            writeln!(
                f,
                "no wait-for cycle was found (this is a bug in duplex's analysis; please report it)"
            )?;
        }
        writeln!(f, "blocked host calls:")?;
        for b in &self.blocked {
            writeln!(
                f,
                "  rank {} {}: `{}` ({}) {}",
                b.rank, b.thread, b.call, b.at, b.waits_for
            )?;
        }
        writeln!(f, "device ops issued and not completed:")?;
        if self.ops.is_empty() {
            writeln!(f, "  (none)")?;
        }
        for o in &self.ops {
            writeln!(f, "  {o}")?;
        }
        Ok(())
    }
}
