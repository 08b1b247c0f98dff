//! duplex: NCCL point-to-point communication that cannot hang silently.
//!
//! This crate is the vocabulary every other part of duplex speaks: ranks,
//! sizes, element types, placement [`Policy`]s, the NCCL [`Model`] knobs of
//! `shared/design/semantics.md` (rules R1–R10), the schedule-file format
//! ([`schedule`]), what a hang looks like ([`report`]), and the [`Transport`]
//! trait that user code is written against. It holds no rules and does no
//! I/O: the rules live in one state machine in `duplex-sim`, which the
//! checker, the simulated transport and the fuzzers all drive; `duplex-nccl`
//! implements [`Transport`] on real GPUs.
//!
//! Start with [`Transport`] if you write rank code, with
//! [`schedule::parse`] if you write schedule files.

#![warn(clippy::print_stdout, clippy::print_stderr)]

pub mod compile;
mod element;
mod error;
pub mod machine;
mod model;
pub mod report;
pub mod schedule;
mod size;
pub mod trace;
pub mod transport;

pub use element::{DType, Element};
pub use error::{Error, Hang, ProgramErrorKind, Result};
pub use model::{Model, Policy};
pub use schedule::Dir;
pub use size::Size;
pub use transport::{Lane, Place, Rank, Transport};
