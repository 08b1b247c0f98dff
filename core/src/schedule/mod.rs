//! Schedule files: what each rank's host threads do, as text.
//!
//! The format is fixed by `docs/schedule-format.md`; [`parse`] reads
//! it into a [`Program`] and validates it completely (every error names the
//! line), and [`Program`]'s `Display` prints it back in a canonical form that
//! parses to the same program, and [`execute`] runs it through any
//! [`Transport`](crate::Transport).

mod execute;
mod parse;
mod print;

pub use execute::{execute, payload};
pub use parse::{
    MAX_LINE_TOKENS, MAX_MESSAGE_BYTES, MAX_RANKS, MAX_WORD, ParseError, parse, parse_with,
};

use crate::{Model, Policy, Size};

/// A source line number (1-based; 0 for programs built in code).
///
/// Lines compare as numbers. Positions are not part of a program's meaning:
/// compare programs with [`Program::without_lines`] to ignore them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(transparent)]
pub struct Line(pub u32);

/// A whole schedule: ranks, placement, model, communicators and host threads.
///
/// Equality includes source lines; [`Program::without_lines`] gives the
/// program's meaning alone (a program printed and parsed again has the
/// same meaning, not the same lines).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Program {
    /// Number of ranks; ranks are `0..ranks`.
    pub ranks: u32,
    /// How ops without `comm=`/`stream=` are placed.
    pub policy: Policy,
    /// Under [`Policy::PerDirection`], policy-placed ops of at least this
    /// many bytes go on the copy-engine lane of their direction instead of
    /// its NCCL lane (`policy per-direction copy-from=SIZE`).
    pub copy_from: Option<Size>,
    /// The model knobs.
    pub model: Model,
    /// Declared communicators (`world` is implicit and never listed here).
    pub comms: Vec<CommDecl>,
    /// Host threads in file order.
    pub threads: Vec<Thread>,
}

impl Program {
    /// The same program with every source line set to 0, for comparing
    /// programs by meaning.
    pub fn without_lines(&self) -> Program {
        let mut p = self.clone();
        for c in &mut p.comms {
            c.line = Line(0);
        }
        for t in &mut p.threads {
            t.line = Line(0);
            for s in &mut t.body {
                s.line = Line(0);
                match &mut s.kind {
                    StmtKind::Op(op) => op.line = Line(0),
                    StmtKind::Group(ops) => ops.iter_mut().for_each(|op| op.line = Line(0)),
                    _ => {}
                }
            }
        }
        p
    }
}

/// `comm NAME R R ...`
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CommDecl {
    /// The communicator's name.
    pub name: String,
    /// Its member ranks, in the order written.
    pub ranks: Vec<u32>,
    /// Where it was declared.
    pub line: Line,
}

/// A host thread: `rank R:` (the main thread) or `rank R thread NAME:`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Thread {
    /// The rank this thread belongs to.
    pub rank: u32,
    /// `None` for the rank's main thread.
    pub name: Option<String>,
    /// The statements, run in order.
    pub body: Vec<Stmt>,
    /// Where the block starts.
    pub line: Line,
}

impl Thread {
    /// `main` or the thread's name.
    pub fn display_name(&self) -> &str {
        self.name.as_deref().unwrap_or("main")
    }
}

/// One statement of a host thread.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Stmt {
    /// What the statement does.
    pub kind: StmtKind,
    /// Where it was written.
    pub line: Line,
}

impl Stmt {
    /// The sends and recvs of the statement: its op, a group's ops, or
    /// none for any other statement.
    pub fn p2ps(&self) -> &[P2p] {
        match &self.kind {
            StmtKind::Op(op) => std::slice::from_ref(op),
            StmtKind::Group(ops) => ops,
            _ => &[],
        }
    }
}

/// The statements of the format page.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum StmtKind {
    /// `send` or `recv` on its own.
    Op(P2p),
    /// `group { OP; OP; ... }`: ops launched as one unit (R8). The group's
    /// line is the statement's (that of `group {`); each op keeps its own
    /// ([`P2p::line`]), so that a report can name the op of a multi-line
    /// group.
    Group(Vec<P2p>),
    /// `record E [stream=S]`
    Record {
        /// Event name (per rank).
        event: String,
        /// Stream name; `None` means `default`.
        stream: Option<String>,
    },
    /// `wait E [stream=S]`
    Wait {
        /// Event name (per rank).
        event: String,
        /// Stream name; `None` means `default`.
        stream: Option<String>,
    },
    /// `sync [S]`: `None` synchronizes every stream of the rank.
    Sync {
        /// The stream to drain, or all of them.
        stream: Option<String>,
    },
    /// `notify P TAG`
    Notify {
        /// Destination rank.
        peer: u32,
        /// Message tag.
        tag: String,
    },
    /// `await P TAG`
    Await {
        /// Source rank.
        peer: u32,
        /// Message tag.
        tag: String,
    },
}

/// Direction of a point-to-point op.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Dir {
    /// `send`
    Send,
    /// `recv`
    Recv,
}

impl Dir {
    /// `send` or `recv`.
    pub fn name(self) -> &'static str {
        match self {
            Dir::Send => "send",
            Dir::Recv => "recv",
        }
    }

    /// The other side: a send's partner is a recv.
    pub fn other(self) -> Dir {
        match self {
            Dir::Send => Dir::Recv,
            Dir::Recv => Dir::Send,
        }
    }
}

/// `send P SIZE [comm=C] [stream=S]` or `recv P SIZE [comm=C] [stream=S]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct P2p {
    /// Send or receive.
    pub dir: Dir,
    /// The other rank.
    pub peer: u32,
    /// Bytes moved.
    pub size: Size,
    /// `comm=` as written. (A boxed `str`, not a `String`: a large file
    /// holds millions of ops, and the spare capacity word is 8 bytes each.)
    pub comm: Option<Box<str>>,
    /// `stream=` as written.
    pub stream: Option<Box<str>>,
    /// Where the op was written: the statement's line for a plain op, its
    /// own line inside a multi-line group (0 for programs built in code).
    pub line: Line,
}

impl P2p {
    /// True when the op names a communicator or a stream, so that the policy
    /// is not consulted.
    pub fn is_explicit(&self) -> bool {
        self.comm.is_some() || self.stream.is_some()
    }
}
