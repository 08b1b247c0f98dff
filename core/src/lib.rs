//! duplex: NCCL point-to-point communication that cannot hang silently.
//!
//! This crate is the model and the vocabulary every other part of duplex
//! speaks. It holds the rules of `docs/semantics.md` (R1–R12) as one pure
//! state machine ([`machine`]): it does no I/O, reads no clock and starts no
//! thread. The checker and the simulated transport (`duplex-sim`), the
//! fuzzers and the NCCL backend's hang analysis (`duplex-nccl`) all drive
//! it. Around it: sizes, element types, placement [`Policy`]s and the
//! [`Model`] knobs; the schedule-file format ([`schedule`],
//! `docs/schedule-format.md`) and its compiler to machine calls, where
//! placement becomes lanes ([`compile`]); the [`trace::Trace`] of what ranks
//! issued, which every backend produces and the machine replays; what a
//! hang looks like ([`report`]); and the [`Transport`] trait that user code
//! is written against.
//!
//! Start with [`Transport`] if you write rank code, with
//! [`schedule::parse`] if you write schedule files, and with [`machine`]'s
//! module docs (then `machine/rules.rs`) if you work on the model.

#![warn(clippy::print_stdout, clippy::print_stderr)]

pub mod compile;
mod element;
mod error;
pub mod machine;
mod model;
pub mod order;
pub mod report;
pub mod schedule;
mod size;
pub mod trace;
pub mod transport;

pub use element::{Bf16, DType, Element, F16};
pub use error::{Error, Hang, ProgramErrorKind, Result};
pub use model::{Model, Policy};
pub use schedule::Dir;
pub use size::{Size, positive_count};
pub use transport::{Lane, Place, Rank, Transport};
