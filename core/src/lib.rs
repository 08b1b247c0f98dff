//! duplex: NCCL point-to-point communication that cannot hang silently.
//!
//! This crate is the vocabulary every other part of duplex speaks: ranks,
//! sizes, placement [`Policy`]s, the NCCL [`Model`] knobs of
//! `shared/design/semantics.md` (rules R1–R10), and the schedule-file format
//! ([`schedule`]) that describes what each rank's host threads do. It holds no
//! rules and does no I/O: the rules live in one state machine in `duplex-sim`,
//! which the checker, the simulated transport and the fuzzers all drive.
//!
//! Start with [`schedule::parse`] and [`schedule::Program`] to see how a
//! program is represented, then read `duplex-sim`'s `machine` module.

mod model;
pub mod schedule;
mod size;

pub use model::{Model, Policy};
pub use size::Size;
