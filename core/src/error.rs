//! The one error type of every [`Transport`](crate::Transport).

use std::fmt;

use crate::report::{OpInfo, Stuck};

/// A result of a transport call.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong in a transport call. Every failure is a value: no
/// backend panics on user input or hangs a process.
#[derive(Clone, Debug, thiserror::Error)]
pub enum Error {
    /// The program cannot make progress (the simulator proved it; the NCCL
    /// backend's deadline expired). The report says what is stuck and why.
    #[error("hang: {0}")]
    Hang(Box<Hang>),
    /// A program error: a size or type mismatch (R3), a send grouped on one
    /// side only (R8), a message never received. Names every op involved.
    #[error("program error ({kind}): {message}")]
    Program {
        /// `size-mismatch`, `type-mismatch`, `group-mismatch`, `never-received`.
        kind: &'static str,
        /// What is wrong, naming the ops.
        message: String,
        /// The ops involved.
        ops: Vec<OpInfo>,
    },
    /// A call that cannot be made: a peer that does not exist or is not in the
    /// communicator, a stream of another rank, a buffer too small.
    #[error("invalid call at {at}: {message}")]
    Invalid {
        /// Where the call was made.
        at: String,
        /// What is wrong.
        message: String,
    },
    /// A host read or write of a buffer that a device op still uses.
    #[error("data race at {at}: {message}")]
    Race {
        /// Where the access was made.
        at: String,
        /// Which op uses the buffer.
        message: String,
    },
    /// A library or device is missing; says how to point duplex at it.
    #[error("{what} is not available: {how}")]
    Unavailable {
        /// What is missing.
        what: String,
        /// What was tried and how to fix it.
        how: String,
    },
    /// The run was stopped because another thread failed or the explorer
    /// abandoned this execution; the first failure is reported separately.
    #[error("aborted: {0}")]
    Aborted(String),
    /// An error raised by user code: a failed data check, say.
    #[error("{0}")]
    User(String),
    /// An error reported by NCCL or CUDA, with its code and text.
    #[error("{library} error {code} in {call}: {text}")]
    Library {
        /// `NCCL` or `CUDA`.
        library: &'static str,
        /// The call that failed.
        call: String,
        /// The numeric result code.
        code: i32,
        /// The library's own text for it.
        text: String,
    },
}

impl Error {
    /// The hang report, if this is a hang.
    pub fn hang(&self) -> Option<&Hang> {
        match self {
            Error::Hang(h) => Some(h),
            _ => None,
        }
    }
}

/// A hang report: the stuck state with its wait-for analysis, and how to get
/// back to it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Hang {
    /// Who found it and how (`simulator, schedule …`; `deadline of 10 s
    /// expired on rank 0`).
    pub context: String,
    /// What is stuck and the cycle that holds it.
    pub stuck: Stuck,
    /// The host steps that lead there, where known (numbered, one a line).
    pub steps: Vec<String>,
    /// The encoded schedule that reproduces it, where there is one.
    pub schedule: Option<String>,
    /// The exact call or command that replays it.
    pub replay: Option<String>,
}

impl fmt::Display for Hang {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.context)?;
        write!(f, "{}", self.stuck)?;
        if !self.steps.is_empty() {
            writeln!(
                f,
                "interleaving that leads there ({} host steps):",
                self.steps.len()
            )?;
            for s in &self.steps {
                writeln!(f, "  {s}")?;
            }
        }
        if let Some(s) = &self.schedule {
            writeln!(f, "schedule: {s}")?;
        }
        if let Some(r) = &self.replay {
            writeln!(f, "replay it with: {r}")?;
        }
        Ok(())
    }
}
