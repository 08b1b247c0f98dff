//! duplex-sim: the explorer and the simulated transport, on the CPU.
//!
//! Everything here drives the one state machine of NCCL's rules,
//! [`duplex::machine::Machine`] (R1–R12 of `docs/semantics.md`); nothing
//! here knows a rule. Around it:
//!
//! * [`check`] explores every interleaving of a compiled schedule's host
//!   threads ([`duplex::compile`]) and returns a [`check::Verdict`] with the
//!   interleaving (and its replayable schedule) that reaches a hang or an
//!   error; [`advice`] adds verified repairs and latent hangs;
//! * [`explore`] is the one explorer (schedulers and schedules) both
//!   [`check`] and [`sim`] use;
//! * [`report`] prints that as text or JSON (what `duplex check` shows);
//! * [`sim`] runs user code written against [`duplex::Transport`] through
//!   the same machine: [`Sim`] is the simulated transport, and [`dpor`] its
//!   search of every interleaving that matters.
//!
//! Start reading at [`check::check`], then [`sim`]'s module docs. The
//! property-test strategies and fuzz harnesses that exercise this crate live
//! in the test kit (`duplex-tests`), so that nothing here links `proptest`.

#![warn(clippy::print_stdout, clippy::print_stderr)]

pub mod advice;
pub mod check;
pub mod dpor;
pub mod explore;
mod memory;
pub mod perfetto;
pub mod report;
pub mod sim;

pub use sim::{Failure, Run, Sim, SimRank};

use duplex::schedule::Program;

/// Checks a program with the default bounds: the one-call form of
/// [`duplex::compile::compile`] followed by [`check::check`].
pub fn check_program(program: &Program) -> check::Outcome {
    check::check(
        &duplex::compile::compile(program),
        &check::Options::default(),
    )
}
