//! [`IssueMatch`]: the issue check of R3 and R8 alone, for a backend that
//! checks each launch before NCCL sees it and steps the rest of the
//! machine later, on another thread.
//!
//! The k-th send on a channel meets its k-th recv (R3); they must agree on
//! size and element type, and a group's op may meet only a group's op
//! unless the model accepts one-sided groups (R8). [`Machine`]'s own check
//! ([`Machine::check_issue`]) asks the same of the ops it keeps until they
//! complete; this keeps, per channel, only the ops one side issued beyond
//! the other, and forgets a pair once both sides issued it. The comparison
//! is one function for both (`agree`). Its positions are the order of the
//! calls, which is NCCL's: on communicators connected at creation they are
//! the machine's too, and `tests/issue_match.rs` checks on random launches
//! that this refuses a launch exactly when the machine does, with the same
//! FIFO positions; on a communicator connected on first use the machine
//! queues an op only once its handshake (R7) is over, so this also sees a
//! partner the machine does not yet, and refuses at least what it refuses.
//!
//! [`Machine`]: super::Machine
//! [`Machine::check_issue`]: super::Machine::check_issue

use std::collections::{HashMap, VecDeque};

use smallvec::SmallVec;

use super::{ChannelKey, CommId, LaunchChannels, OpSpec, Rank, channel_key, table::FxHasher};
use crate::{DType, Dir};

/// What R3 and R8 compare of an op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Sig {
    /// Bytes moved.
    pub bytes: u64,
    /// Element type.
    pub dtype: DType,
    /// Launched as a group in the sense of R8 ([`super::LaunchSpec::is_group`]).
    pub grouped: bool,
}

/// Whether an op agrees with the partner issued at its position (R3 size
/// and type; R8 grouping, unless `one_sided_groups`).
pub(crate) fn agree(partner: &Sig, op: &Sig, one_sided_groups: bool) -> bool {
    partner.bytes == op.bytes
        && partner.dtype == op.dtype
        && (partner.grouped == op.grouped || one_sided_groups)
}

/// Which check an op fails against the partner at its position, once
/// `agree` says it fails one, each given as (bytes, element type): the
/// size first (R3), then the type (R3), else the grouping (R8). The one
/// order of the three, for the machine's errors and the NCCL backend's
/// issue check.
pub fn mismatch_kind(partner: (u64, DType), op: (u64, DType)) -> crate::ProgramErrorKind {
    if partner.0 != op.0 {
        crate::ProgramErrorKind::SizeMismatch
    } else if partner.1 != op.1 {
        crate::ProgramErrorKind::TypeMismatch
    } else {
        crate::ProgramErrorKind::GroupMismatch
    }
}

/// A channel's ops issued by one side beyond the other: `ahead` holds
/// them, oldest first; `matched` counts the pairs both sides issued.
#[derive(Clone, Debug, Default)]
struct Queue {
    matched: u64,
    ahead: Option<Dir>,
    ops: VecDeque<Sig>,
}

/// The issue check of R3 and R8 over every channel.
#[derive(Clone, Debug, Default)]
pub struct IssueMatch {
    channels: HashMap<ChannelKey, Queue, std::hash::BuildHasherDefault<FxHasher>>,
    one_sided_groups: bool,
    /// Copy-engine lanes, which ignore grouping (C6), sorted.
    copy: Vec<CommId>,
    /// The one rank whose launches this sees ([`IssueMatch::one_rank`]).
    only: Option<Rank>,
}

/// Where an op of a launch stands on its channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Position {
    /// Its message number on the channel (from 0).
    pub fifo: u64,
    /// The partner already issued at that number, if any.
    pub partner: Option<Sig>,
}

impl IssueMatch {
    /// An empty check under `one_sided_groups` (the model's knob).
    pub fn new(one_sided_groups: bool) -> IssueMatch {
        IssueMatch {
            one_sided_groups,
            ..IssueMatch::default()
        }
    }

    /// The check of a backend that sees one rank's launches alone (one
    /// process per rank): a channel to another rank never meets its
    /// partner here, so its ops are only counted, for their positions,
    /// and not kept (a long run would keep every one of them).
    pub fn one_rank(one_sided_groups: bool, rank: Rank) -> IssueMatch {
        IssueMatch {
            one_sided_groups,
            only: Some(rank),
            ..IssueMatch::default()
        }
    }

    /// Declares `comm` a copy-engine lane: its ops match whether or not
    /// either side grouped them (C6 of `docs/semantics.md`).
    pub fn copy_lane(&mut self, comm: CommId) {
        if let Err(i) = self.copy.binary_search(&comm) {
            self.copy.insert(i, comm);
        }
    }

    /// Whether an op on `comm` of a launch that is a group (`grouped`)
    /// counts as grouped.
    fn grouped(&self, comm: CommId, grouped: bool) -> bool {
        grouped && self.copy.binary_search(&comm).is_err()
    }

    /// Where each op of a launch by `rank` (`grouped`: a group in the
    /// sense of R8) stands: its FIFO position and the partner issued there,
    /// by an earlier launch or, for a message to itself (R12), by an
    /// earlier op of this one.
    /// (On the stack for launches of up to four ops: the NCCL backend asks
    /// this for every launch.)
    pub fn positions(&self, rank: Rank, ops: &[OpSpec], grouped: bool) -> SmallVec<[Position; 4]> {
        let launch = LaunchChannels::new(rank, ops);
        ops.iter()
            .enumerate()
            .map(|(i, o)| {
                let earlier = launch.earlier(i);
                let q = self.channels.get(&channel_key(rank, o));
                let (matched, mine, theirs) = match q {
                    None => (0, 0, 0),
                    Some(q) if q.ahead == Some(o.dir) => (q.matched, q.ops.len(), 0),
                    Some(q) if q.ahead.is_some() => (q.matched, 0, q.ops.len()),
                    Some(q) => (q.matched, 0, 0),
                };
                let partner = if earlier < theirs {
                    q.and_then(|q| q.ops.get(earlier).copied())
                } else {
                    launch.partner(i, mine + earlier - theirs).map(|j| Sig {
                        bytes: ops[j].bytes,
                        dtype: ops[j].dtype,
                        grouped: self.grouped(o.comm, grouped),
                    })
                };
                Position {
                    fifo: matched + (mine + earlier) as u64,
                    partner,
                }
            })
            .collect()
    }

    /// The first op of a launch by `rank` (`grouped`: a group in the sense
    /// of R8) that disagrees with the partner issued at its position, if
    /// any; with the FIFO positions of all of them.
    pub fn check(
        &self,
        rank: Rank,
        ops: &[OpSpec],
        grouped: bool,
    ) -> (Option<usize>, SmallVec<[u64; 4]>) {
        let positions = self.positions(rank, ops, grouped);
        let bad = ops.iter().zip(&positions).position(|(o, p)| {
            p.partner.is_some_and(|partner| {
                !agree(
                    &partner,
                    &Sig {
                        bytes: o.bytes,
                        dtype: o.dtype,
                        grouped: self.grouped(o.comm, grouped),
                    },
                    self.one_sided_groups,
                )
            })
        });
        (bad, positions.iter().map(|p| p.fifo).collect())
    }

    /// The channels on which sends were issued beyond the recvs, sorted by
    /// channel:
    /// the channel, the FIFO position of the first send no recv met, and
    /// how many there are. Only channels whose both sides this check sees
    /// (every channel, unless it sees [`IssueMatch::one_rank`]), with
    /// what R3 compares of that first send.
    pub fn unreceived(&self) -> Vec<(ChannelKey, u64, u32, Sig)> {
        let mut out: Vec<(ChannelKey, u64, u32, Sig)> = self
            .channels
            .iter()
            .filter(|(_, q)| q.ahead == Some(Dir::Send))
            .filter_map(|(key, q)| Some((*key, q.matched, q.ops.len() as u32, *q.ops.front()?)))
            .collect();
        out.sort_unstable_by_key(|(key, ..)| *key);
        out
    }

    /// How many sends and recvs were issued on the channel from `from` to
    /// `to` on `comm`: the pairs both sides issued and the ops one side
    /// issued beyond the other. Exact for every channel this check sees
    /// both sides of, however long the run (it forgets ops, never counts);
    /// under [`IssueMatch::one_rank`], the other rank's side of a channel
    /// counts what this rank issued.
    pub fn issued(&self, comm: CommId, from: Rank, to: Rank) -> (u64, u64) {
        let Some(q) = self.channels.get(&(comm, from, to)) else {
            return (0, 0);
        };
        let both = q.matched;
        let ahead = q.ops.len() as u64;
        match q.ahead {
            Some(Dir::Send) => (both + ahead, both),
            Some(Dir::Recv) => (both, both + ahead),
            None => (both, both),
        }
    }

    /// Records a launch by `rank` as issued.
    pub fn issue(&mut self, rank: Rank, ops: &[OpSpec], grouped: bool) {
        for o in ops {
            let grouped = self.grouped(o.comm, grouped);
            let unseen = self.only.is_some_and(|me| me != o.peer);
            let q = self.channels.entry(channel_key(rank, o)).or_default();
            if unseen {
                // Its partner is issued elsewhere: only its number counts.
                q.matched += 1;
            } else if q.ahead == Some(o.dir.other()) {
                q.ops.pop_front();
                q.matched += 1;
                if q.ops.is_empty() {
                    q.ahead = None;
                }
            } else {
                q.ahead = Some(o.dir);
                q.ops.push_back(Sig {
                    bytes: o.bytes,
                    dtype: o.dtype,
                    grouped,
                });
            }
        }
    }
}
