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
        /// Which error.
        kind: ProgramErrorKind,
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
    /// How much this error says about what went wrong, for choosing one of
    /// several (lower says more): a program error, then an invalid call or
    /// race, then a hang with its wait-for cycle (or a partner that never
    /// comes), a user, library or availability error (which may have left
    /// others waiting), any other hang, and last [`Error::Aborted`], which
    /// is usually the echo of another thread's or rank's failure.
    pub fn severity(&self) -> u8 {
        match self {
            Error::Program { .. } => 0,
            Error::Invalid { .. } | Error::Race { .. } => 1,
            Error::Hang(h) if !h.stuck.cycle.is_empty() || !h.stuck.missing.is_empty() => 2,
            Error::User(_) | Error::Library { .. } | Error::Unavailable { .. } => 3,
            Error::Hang(_) => 4,
            Error::Aborted(_) => 5,
        }
    }

    /// The most telling of `errors` ([`Error::severity`]; the first of
    /// equals).
    pub fn most_telling(errors: impl IntoIterator<Item = Error>) -> Option<Error> {
        errors.into_iter().min_by_key(Error::severity)
    }

    /// The hang report, if this is a hang.
    pub fn hang(&self) -> Option<&Hang> {
        match self {
            Error::Hang(h) => Some(h),
            _ => None,
        }
    }
}

/// The kinds of program error. Prints (and serializes) as `size-mismatch`,
/// `type-mismatch`, `group-mismatch`, `never-received`, `invalid`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProgramErrorKind {
    /// R3: the k-th send and the k-th recv of a channel disagree on size.
    SizeMismatch,
    /// R3: they disagree on element type.
    TypeMismatch,
    /// R8: a matched pair where only one side is in a group of two or more.
    GroupMismatch,
    /// A send completed into a channel's buffer (R5) and no recv took it.
    NeverReceived,
    /// A call that cannot be made (reported as [`Error::Invalid`] by the
    /// transports; `invalid` in `duplex check` reports).
    Invalid,
}

impl ProgramErrorKind {
    /// The name reports print.
    pub fn name(self) -> &'static str {
        match self {
            ProgramErrorKind::SizeMismatch => "size-mismatch",
            ProgramErrorKind::TypeMismatch => "type-mismatch",
            ProgramErrorKind::GroupMismatch => "group-mismatch",
            ProgramErrorKind::NeverReceived => "never-received",
            ProgramErrorKind::Invalid => "invalid",
        }
    }
}

impl fmt::Display for ProgramErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
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
    /// The simulator's encoded schedule that reproduces it (`Sim::replay` of
    /// `duplex-sim`; not a `duplex check --replay` schedule), where there is one.
    pub schedule: Option<String>,
    /// The exact call or command that replays it.
    pub replay: Option<String>,
    /// Calls a real backend made that the model refuses: the model and the
    /// hardware disagree here (see [`crate::trace`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub disagreements: Vec<crate::trace::Disagreement>,
}

impl fmt::Display for Hang {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.context)?;
        write!(f, "{}", self.stuck)?;
        if !self.disagreements.is_empty() {
            writeln!(
                f,
                "calls the model refuses (the model and the hardware disagree; please report this):"
            )?;
            for d in &self.disagreements {
                writeln!(f, "  {d}")?;
            }
        }
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
            writeln!(
                f,
                "simulator schedule: {s} (`Sim::replay`; not a `duplex check --replay` schedule)"
            )?;
        }
        if let Some(r) = &self.replay {
            writeln!(f, "replay it with: {r}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_most_telling_error_is_the_cause_not_its_echo() {
        let hang = Error::Hang(Box::new(Hang {
            context: "rank 0 thread tx: deadline".into(),
            stuck: Stuck {
                cycle: Vec::new(),
                missing: Vec::new(),
                blocked: Vec::new(),
                ops: Vec::new(),
                note: None,
                mismatched_setups: Vec::new(),
            },
            steps: Vec::new(),
            schedule: None,
            replay: None,
            disagreements: Vec::new(),
        }));
        let echo = Error::Aborted("communicator pair:0-1 was aborted".into());
        let user = Error::User("wrong data".into());
        // A hang that aborted what another thread waited on: the hang.
        let e = Error::most_telling([echo.clone(), hang.clone()]).unwrap();
        assert!(e.hang().is_some(), "{e}");
        // A library or user error may be what left another thread waiting
        // until its deadline: it outranks a hang with no cycle.
        assert!(matches!(
            Error::most_telling([echo.clone(), hang, user.clone()]),
            Some(Error::User(_))
        ));
        // Equals: the first.
        let other = Error::Aborted("second".into());
        assert_eq!(
            Error::most_telling([echo, other]).unwrap().to_string(),
            "aborted: communicator pair:0-1 was aborted"
        );
        assert!(Error::most_telling(Vec::new()).is_none());
    }
}
