//! From a schedule [`Program`] to what the state machine runs: a [`Setup`]
//! (threads, streams, communicators, events, origins) and each thread's list
//! of [`HostCall`]s. This is where placement policies become lanes.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::schedule::{Dir, P2p, Program, Stmt, StmtKind};
use crate::{DType, Policy, Size};

use crate::machine::{
    CommId, EventId, HostCall, LaunchSpec, Machine, OpSpec, Origin, OriginInfo, Rank, Setup,
    StreamId, TagId, ThreadId, waitfor,
};

/// A program ready to run: the setup and every thread's calls (the last
/// call of each thread is [`HostCall::End`]).
#[derive(Clone, Debug)]
pub struct Compiled {
    /// Who exists.
    pub setup: Arc<Setup>,
    /// Each thread's calls, indexed by [`ThreadId`].
    pub scripts: Vec<Vec<HostCall>>,
}

impl Compiled {
    /// The call thread `t` makes after `calls` calls, if any is left.
    pub fn call(&self, t: ThreadId, calls: u32) -> Option<&HostCall> {
        self.scripts[t.0 as usize].get(calls as usize)
    }

    /// A fresh machine at the program's start.
    pub fn machine(&self) -> Machine {
        Machine::new(self.setup.clone())
    }
}

/// The lane names a policy gives to the traffic between `rank` and `peer`.
///
/// Returns the communicator's name and members and the stream's name on
/// `rank`. The names contain `:`, which schedule files cannot write, so lanes
/// never share a stream or a communicator with explicitly placed ops.
pub fn lane(policy: Policy, rank: Rank, dir: Dir, peer: Rank) -> (String, Vec<Rank>, String) {
    match policy {
        Policy::Shared => {
            let (a, b) = (rank.min(peer), rank.max(peer));
            let name = format!("pair:{a}-{b}");
            let members = if a == b { vec![a] } else { vec![a, b] };
            (name.clone(), members, name)
        }
        Policy::PerDirection => {
            let (src, dst) = match dir {
                Dir::Send => (rank, peer),
                Dir::Recv => (peer, rank),
            };
            let name = format!("lane:{src}->{dst}");
            let members = if src == dst {
                vec![src]
            } else {
                vec![src, dst]
            };
            (name.clone(), members, name)
        }
    }
}

/// Whether a policy-placed op of `rank` toward `peer` of `bytes` goes on
/// its direction's copy-engine lane ([`copy_lane`]) rather than the
/// policy's [`lane`]: under [`Policy::PerDirection`] with `copy_from` set,
/// ops of at least `copy_from` bytes to another rank do (a rank's messages
/// to itself stay on NCCL). Both ends of a message decide alike, since a
/// matched pair has one size (R3); a pair whose sizes differ across the
/// threshold is matched on neither lane with the other, as on a backend.
pub fn goes_by_copy(
    policy: Policy,
    copy_from: Option<u64>,
    rank: Rank,
    peer: Rank,
    bytes: u64,
) -> bool {
    policy == Policy::PerDirection && rank != peer && copy_from.is_some_and(|c| bytes >= c)
}

/// The copy-engine lane of traffic between `rank` and `peer` in `dir`:
/// the lane `copy:src->dst` (members src and dst), on the stream of the
/// direction's NCCL lane, `lane:src->dst`, so that the direction's ops stay
/// in issue order on each rank whichever lane carries them.
pub fn copy_lane(rank: Rank, dir: Dir, peer: Rank) -> (String, Vec<Rank>, String) {
    let (_, members, stream) = lane(Policy::PerDirection, rank, dir, peer);
    let (src, dst) = match dir {
        Dir::Send => (rank, peer),
        Dir::Recv => (peer, rank),
    };
    (format!("copy:{src}->{dst}"), members, stream)
}

/// Whether the policy's lanes are connected before the program's first
/// call, so that R6 and R7 never apply to them: duplex connects
/// per-direction lanes at creation, in an order that cannot hang; shared
/// lanes are PyTorch's, connected only when every communicator is
/// (`connected_at_creation`, the opposite of `lazy-connect=on`).
pub fn lane_connected(policy: Policy, connected_at_creation: bool) -> bool {
    policy == Policy::PerDirection || connected_at_creation
}

/// The lanes a policy creates among `ranks` ranks, as the ordered pairs
/// (a, b) whose [`lane`] from a toward b is a communicator of its own, in
/// the order every rank creates them: a lane per ordered pair under
/// `per-direction`, one per unordered pair (a < b) under `shared`.
pub fn lane_pairs(policy: Policy, ranks: u32) -> impl Iterator<Item = (Rank, Rank)> {
    (0..ranks)
        .flat_map(move |a| (0..ranks).map(move |b| (a, b)))
        .filter(move |(a, b)| match policy {
            Policy::PerDirection => a != b,
            Policy::Shared => a < b,
        })
}

/// How many lanes [`lane_pairs`] lists among `ranks` ranks.
pub fn lane_count(policy: Policy, ranks: u32) -> u64 {
    let n = u64::from(ranks);
    match policy {
        Policy::PerDirection => n * n.saturating_sub(1),
        Policy::Shared => n * n.saturating_sub(1) / 2,
    }
}

/// The position in [`lane_pairs`] of the lane that carries traffic from `a`
/// to `b` (`None` for `a == b` or a rank outside `0..ranks`): the lane's
/// number, the same on every rank, computed without listing the pairs (a
/// job of 1,024 ranks has a million of them).
pub fn lane_index(policy: Policy, ranks: u32, a: Rank, b: Rank) -> Option<u64> {
    if a == b || a >= ranks || b >= ranks {
        return None;
    }
    let n = u64::from(ranks);
    let (a, b) = (u64::from(a), u64::from(b));
    Some(match policy {
        Policy::PerDirection => a * (n - 1) + if b < a { b } else { b - 1 },
        Policy::Shared => {
            let (a, b) = (a.min(b), a.max(b));
            // Pairs (i, j), i < j, before row a: (n-1) + (n-2) + ... + (n-a).
            a * (n - 1) - a * a.saturating_sub(1) / 2 + (b - a - 1)
        }
    })
}

/// The pair of [`lane_pairs`] at position `index`, the inverse of
/// [`lane_index`]; `None` past the last lane.
pub fn lane_at(policy: Policy, ranks: u32, index: u64) -> Option<(Rank, Rank)> {
    if index >= lane_count(policy, ranks) {
        return None;
    }
    let n = u64::from(ranks);
    let (a, b) = match policy {
        Policy::PerDirection => {
            let (a, k) = (index / (n - 1), index % (n - 1));
            (a, if k < a { k } else { k + 1 })
        }
        Policy::Shared => {
            let (mut a, mut left) = (0, index);
            while left >= n - 1 - a {
                left -= n - 1 - a;
                a += 1;
            }
            (a, a + 1 + left)
        }
    };
    Some((Rank::try_from(a).ok()?, Rank::try_from(b).ok()?))
}

struct Builder<'p> {
    program: &'p Program,
    /// The model compiled under (the program's own, or an override).
    model: crate::Model,
    setup: Setup,
    comms: HashMap<String, CommId>,
    streams: HashMap<(Rank, String), StreamId>,
    events: HashMap<(Rank, String), EventId>,
    /// Statement texts, shared by equal statements.
    texts: HashSet<Arc<str>>,
    /// The text of each op seen, by what it says (not where): a large
    /// program repeats a few statements many times, and spelling each one
    /// again costs more than the rest of compiling it.
    op_texts: HashMap<OpKey<'p>, Arc<str>, Fx>,
    /// The texts of each group seen and of its ops, by what the ops say.
    group_texts: HashMap<Vec<OpKey<'p>>, GroupTexts, Fx>,
    /// The lane of each (rank, direction, peer, by copy engine) seen.
    lanes: HashMap<(Rank, Dir, Rank, bool), (CommId, StreamId), Fx>,
    /// Scratch: the key of the group being looked up.
    key: Vec<OpKey<'p>>,
}

/// A group's text and each of its ops' texts.
type GroupTexts = (Arc<str>, Arc<[Arc<str>]>);

/// The compiler's hasher: its keys are small and not chosen by an attacker.
type Fx = std::hash::BuildHasherDefault<crate::machine::table::FxHasher>;

/// What an op says, without where it was written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct OpKey<'p> {
    dir: Dir,
    peer: Rank,
    size: u64,
    comm: Option<&'p str>,
    stream: Option<&'p str>,
}

impl<'p> OpKey<'p> {
    fn of(op: &'p P2p) -> OpKey<'p> {
        OpKey {
            dir: op.dir,
            peer: op.peer,
            size: op.size.bytes(),
            comm: op.comm.as_deref(),
            stream: op.stream.as_deref(),
        }
    }
}

/// Compiles a (valid) program. Explicitly placed ops default to comm `world`
/// and stream `default`; the others go to the policy's lanes.
pub fn compile(program: &Program) -> Compiled {
    compile_under(program, program.model)
}

/// [`compile`] under `model` in place of the program's own (what `duplex
/// check --model` and the latent-hang advice do, without copying the
/// program).
pub fn compile_under(program: &Program, model: crate::Model) -> Compiled {
    let mut b = Builder {
        program,
        model,
        setup: Setup::new(program.ranks, model),
        comms: HashMap::new(),
        streams: HashMap::new(),
        events: HashMap::new(),
        texts: HashSet::new(),
        op_texts: HashMap::default(),
        group_texts: HashMap::default(),
        lanes: HashMap::default(),
        key: Vec::new(),
    };
    let world = b
        .setup
        .add_comm("world", (0..program.ranks).collect(), !model.lazy_connect);
    b.comms.insert("world".into(), world);
    for c in &program.comms {
        let id = b
            .setup
            .add_comm(c.name.clone(), c.ranks.clone(), !model.lazy_connect);
        b.comms.insert(c.name.clone(), id);
    }
    let mut scripts = Vec::with_capacity(program.threads.len());
    for thread in &program.threads {
        b.setup.add_thread(thread.rank, thread.display_name());
    }
    // An origin per statement and one per op of a group, in one allocation
    // (a large program has millions).
    let origins: usize = program
        .threads
        .iter()
        .flat_map(|t| &t.body)
        .map(|s| match &s.kind {
            StmtKind::Group(ops) => 1 + ops.len(),
            _ => 1,
        })
        .sum();
    b.setup.origins.reserve_exact(origins);
    for thread in &program.threads {
        let rank = thread.rank;
        let mut calls = Vec::with_capacity(thread.body.len() + 1);
        for stmt in &thread.body {
            let call = match &stmt.kind {
                StmtKind::Op(op) => {
                    let text = b.op_text(op);
                    let origin = b.setup.add_origin(OriginInfo::line(text, stmt.line.0));
                    HostCall::Launch(LaunchSpec {
                        ops: vec![b.op(rank, op)],
                        grouped: false,
                        origin,
                    })
                }
                StmtKind::Group(ops) => {
                    // The group's text and its ops' texts, found together.
                    let (text, each) = b.group_texts(ops);
                    let origin = b.setup.add_origin(OriginInfo::line(text, stmt.line.0));
                    HostCall::Launch(LaunchSpec {
                        // (Zipped slices keep their exact length, so the
                        // Vec is allocated exactly, 64 bytes for two ops.)
                        ops: ops
                            .iter()
                            .zip(each.iter())
                            .map(|(op, text)| {
                                // Reports of the op name it and its own line
                                // (a group may span lines); the host call
                                // keeps the group's statement.
                                let line = if op.line.0 != 0 { op.line } else { stmt.line };
                                let own =
                                    b.setup.add_origin(OriginInfo::line(text.clone(), line.0));
                                OpSpec {
                                    origin: Some(own),
                                    ..b.op(rank, op)
                                }
                            })
                            .collect(),
                        grouped: true,
                        origin,
                    })
                }
                StmtKind::Record { event, stream } => HostCall::Record {
                    origin: b.statement_origin(stmt),
                    event: b.event(rank, event),
                    stream: b.stream(rank, stream.as_deref().unwrap_or("default")),
                },
                StmtKind::Wait { event, stream } => HostCall::Wait {
                    origin: b.statement_origin(stmt),
                    event: b.event(rank, event),
                    stream: b.stream(rank, stream.as_deref().unwrap_or("default")),
                },
                StmtKind::Sync { stream } => HostCall::Sync {
                    origin: b.statement_origin(stmt),
                    stream: stream.as_deref().map(|s| b.stream(rank, s)),
                },
                StmtKind::Notify { peer, tag } => HostCall::Notify {
                    origin: b.statement_origin(stmt),
                    to: *peer,
                    tag: b.tag(tag),
                },
                StmtKind::Await { peer, tag } => HostCall::Await {
                    origin: b.statement_origin(stmt),
                    from: *peer,
                    tag: b.tag(tag),
                },
            };
            calls.push(call);
        }
        calls.push(HostCall::End);
        scripts.push(calls);
    }
    Compiled {
        setup: Arc::new(b.setup),
        scripts,
    }
}

impl<'p> Builder<'p> {
    fn op(&mut self, rank: Rank, op: &P2p) -> OpSpec {
        let (comm, stream) = if op.is_explicit() {
            let comm = self.comms[op.comm.as_deref().unwrap_or("world")];
            (
                comm,
                self.stream(rank, op.stream.as_deref().unwrap_or("default")),
            )
        } else {
            let policy = self.program.policy;
            let copy = goes_by_copy(
                policy,
                self.program.copy_from.map(Size::bytes),
                rank,
                op.peer,
                op.size.bytes(),
            );
            if let Some(lane) = self.lanes.get(&(rank, op.dir, op.peer, copy)) {
                *lane
            } else {
                let (name, members, stream) = if copy {
                    copy_lane(rank, op.dir, op.peer)
                } else {
                    lane(policy, rank, op.dir, op.peer)
                };
                let warm = lane_connected(policy, !self.model.lazy_connect);
                let comm = match self.comms.get(&name) {
                    Some(c) => *c,
                    None => {
                        let c = if copy {
                            self.setup.add_copy_lane(name.clone(), members)
                        } else {
                            self.setup.add_comm(name.clone(), members, warm)
                        };
                        self.comms.insert(name, c);
                        c
                    }
                };
                let placed = (comm, self.stream(rank, &stream));
                self.lanes.insert((rank, op.dir, op.peer, copy), placed);
                placed
            }
        };
        OpSpec {
            dir: op.dir,
            peer: op.peer,
            bytes: Size::bytes(op.size),
            dtype: DType::U8,
            comm,
            stream,
            origin: None,
        }
    }

    /// The text of an op, shared with every op that says the same.
    fn op_text(&mut self, op: &'p P2p) -> Arc<str> {
        let key = OpKey::of(op);
        if let Some(t) = self.op_texts.get(&key) {
            return t.clone();
        }
        let t = self.text(op.to_string());
        self.op_texts.insert(key, t.clone());
        t
    }

    /// The text of a group and of each of its ops, shared with every group
    /// that says the same (one lookup for all of them).
    fn group_texts(&mut self, ops: &'p [P2p]) -> GroupTexts {
        let mut key = std::mem::take(&mut self.key);
        key.clear();
        key.extend(ops.iter().map(OpKey::of));
        let found = self.group_texts.get(key.as_slice()).cloned();
        let texts = match found {
            Some(t) => t,
            None => {
                let group = self.text(StmtKind::Group(ops.to_vec()).to_string());
                let each: Arc<[Arc<str>]> = ops.iter().map(|op| self.op_text(op)).collect();
                self.group_texts
                    .insert(key.clone(), (group.clone(), each.clone()));
                (group, each)
            }
        };
        self.key = key;
        texts
    }

    /// The origin of a statement that is not a launch: its text, shared,
    /// at its line.
    fn statement_origin(&mut self, stmt: &Stmt) -> Origin {
        let text = self.text(stmt.kind.to_string());
        self.setup.add_origin(OriginInfo::line(text, stmt.line.0))
    }

    /// The shared copy of a statement's text.
    fn text(&mut self, text: String) -> Arc<str> {
        match self.texts.get(text.as_str()) {
            Some(t) => t.clone(),
            None => {
                let t: Arc<str> = text.into();
                self.texts.insert(t.clone());
                t
            }
        }
    }

    fn stream(&mut self, rank: Rank, name: &str) -> StreamId {
        let key = (rank, name.to_string());
        if let Some(s) = self.streams.get(&key) {
            return *s;
        }
        let s = self.setup.add_stream(rank, name);
        self.streams.insert(key, s);
        s
    }

    fn event(&mut self, rank: Rank, name: &str) -> EventId {
        let key = (rank, name.to_string());
        if let Some(e) = self.events.get(&key) {
            return *e;
        }
        let e = self.setup.add_event(rank, name);
        self.events.insert(key, e);
        e
    }

    fn tag(&mut self, tag: &str) -> TagId {
        self.setup.tag(tag)
    }
}

/// The checker's [`waitfor::Threads`]: a thread may still do what its
/// remaining calls say.
#[derive(Clone, Copy, Debug)]
pub struct Remaining<'a>(pub &'a Compiled);

impl waitfor::Threads for Remaining<'_> {
    fn next_call(&self, m: &Machine, t: ThreadId) -> Option<HostCall> {
        self.0.call(t, m.calls(t)).cloned()
    }

    fn may_issue(
        &self,
        m: &Machine,
        t: ThreadId,
        comm: CommId,
        dir: Option<Dir>,
        peer: Rank,
    ) -> bool {
        let rest = &self.0.scripts[t.0 as usize];
        rest.iter().skip(m.calls(t) as usize).any(|c| match c {
            HostCall::Launch(spec) => spec
                .ops
                .iter()
                .any(|o| o.comm == comm && o.peer == peer && dir.is_none_or(|d| d == o.dir)),
            _ => false,
        })
    }

    fn may_notify(&self, m: &Machine, t: ThreadId, to: Rank, tag: TagId) -> bool {
        let rest = &self.0.scripts[t.0 as usize];
        rest.iter()
            .skip(m.calls(t) as usize)
            .any(|c| matches!(c, HostCall::Notify { to: t2, tag: g, .. } if *t2 == to && *g == tag))
    }

    fn slots_to_come(&self, m: &Machine, t: ThreadId) -> Option<usize> {
        let rest = &self.0.scripts[t.0 as usize];
        Some(
            m.call_in_progress(t)
                .iter()
                .chain(rest.iter().skip(m.calls(t) as usize))
                .map(|c| match c {
                    HostCall::Launch(spec) => m.slots_of(spec),
                    _ => 0,
                })
                .sum(),
        )
    }

    fn may_conflict(&self, m: &Machine, t: ThreadId, _: ThreadId, call: &HostCall) -> bool {
        if m.ended(t) {
            return false;
        }
        let rest = &self.0.scripts[t.0 as usize];
        m.call_in_progress(t)
            .iter()
            .chain(rest.iter().skip(m.calls(t) as usize))
            .any(|c| !m.commute(call, c))
    }
}

#[cfg(test)]
mod lane_numbering {
    use super::*;

    #[test]
    fn lane_index_and_lane_at_agree_with_lane_pairs() {
        for policy in [Policy::PerDirection, Policy::Shared] {
            for ranks in 0..9 {
                let pairs: Vec<_> = lane_pairs(policy, ranks).collect();
                assert_eq!(pairs.len() as u64, lane_count(policy, ranks));
                for (i, &(a, b)) in pairs.iter().enumerate() {
                    assert_eq!(lane_index(policy, ranks, a, b), Some(i as u64));
                    assert_eq!(lane_at(policy, ranks, i as u64), Some((a, b)));
                    if policy == Policy::Shared {
                        assert_eq!(lane_index(policy, ranks, b, a), Some(i as u64));
                    }
                }
                assert_eq!(lane_at(policy, ranks, pairs.len() as u64), None);
                assert_eq!(lane_index(policy, ranks, 0, 0), None);
                assert_eq!(lane_index(policy, ranks, 0, ranks), None);
            }
        }
    }
}
