//! duplex-sim: a deterministic simulator of NCCL's point-to-point rules.
//!
//! Everything here drives one pure state machine, [`machine::Machine`], which
//! implements the rules R1–R10 of `shared/design/semantics.md` and nothing
//! else: it does no I/O, reads no clock and starts no thread. Around it:
//!
//! * [`compile`] turns a schedule [`duplex::schedule::Program`] into the
//!   machine's setup and each host thread's calls (placement policies become
//!   lanes here);
//! * [`check`] explores every interleaving of the host threads and returns a
//!   [`check::Verdict`] with the shortest interleaving to a hang or error;
//! * [`report`] prints that as text or JSON (what `duplex check` shows);
//! * [`sim`] runs user code written against [`duplex::Transport`] through
//!   the same machine: [`Sim`] is the simulated transport.
//!
//! Start reading at [`machine`]'s module docs, then [`check::check`].

#![warn(clippy::print_stdout, clippy::print_stderr)]

pub mod check;
pub mod report;
pub mod sim;

pub use sim::{Failure, Run, Sim, SimRank};

use duplex::schedule::Program;

/// Checks a program with the default bounds: the one-call form of
/// [`compile::compile`] followed by [`check::check`].
pub fn check_program(program: &Program) -> check::Outcome {
    check::check(
        &duplex::compile::compile(program),
        &check::Options::default(),
    )
}
