//! duplex-nccl: [`duplex::Transport`] on real NCCL and CUDA.
//!
//! NCCL is opened at run time ([`nccl::nccl`]: `$DUPLEX_NCCL_LIBRARY`, then
//! `libnccl.so.2`, `libnccl.so`, then Python wheels' `nvidia/nccl/lib`), and
//! CUDA through `cudarc`'s driver API with dynamic loading, so this crate
//! builds and its CPU tests run on machines without either; using it there
//! returns [`duplex::Error::Unavailable`] saying what is missing.
//!
//! Start at [`Local`] (several GPUs of one process, a thread per rank) or
//! [`Process`] (one rank per process, configured as torchrun configures
//! PyTorch). Both hand rank code an [`NcclRank`]. Its lanes are
//! communicators made by `ncclCommSplit` from the world communicator; under
//! [`duplex::Policy::PerDirection`] each ordered pair of ranks gets its own,
//! with a stream on each end, connected at creation in one group so that
//! no connection handshake can hang (R6, R7). Every communicator is
//! non-blocking and every wait has a deadline: a hang becomes
//! [`duplex::Error::Hang`] listing every pending op and the wait-for cycle
//! that the model's state machine finds in what the ranks issued
//! ([`registry`]; across processes the ranks exchange their traces,
//! [`health`]); the communicators involved are aborted, so the process
//! stays usable.
//!
//! Layers, as in `cudarc`: [`nccl::sys`] (raw ABI) → [`nccl`] (one checked
//! function per call) and [`cuda`] → [`comm`], [`ctx`] and [`rank`] (owning
//! types: a rank's shared context, and the per-thread handle). Which thread
//! may call NCCL on a communicator when, and when one is aborted and freed,
//! is [`guard`]'s protocol, model-checked with loom through the [`sync`]
//! shim.

#![warn(clippy::print_stdout, clippy::print_stderr)]

pub mod board;
pub mod comm;
pub mod copy;
pub mod ctx;
pub mod cuda;
pub mod fence;
pub mod guard;
pub mod health;
pub mod lanes;
pub mod nccl;
pub mod rank;
pub mod reaper;
pub mod registry;
mod run;
pub mod store;
pub mod sync;
pub mod threshold;

pub use ctx::{LaneConnect, LaneCost, LaneMode, NcclComm, NcclEvent, NcclStream, Options};
pub use rank::{NcclBuffer, NcclRank, NcclThread};
pub use run::{
    Local, MISMATCHED_SETUP, Process, RankReport, ipc_copy_asked, one_gpu_asked, shared_gpu_env,
};
