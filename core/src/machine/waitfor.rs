//! Why a stuck state is stuck: the wait-for graph of blocked host calls and
//! unfinished device ops, and the cycle (or the missing partner) that holds
//! them.
//!
//! Nodes are host threads, launches (an op or a group), and `wait` entries at
//! the head of a stream. Every edge names the rule that makes its source wait.
//! What a host thread will do next, and may do later, is not in the state;
//! [`Threads`] says it (the checker knows each thread's remaining statements;
//! the simulated transport knows each thread's pending call and assumes any
//! unfinished thread may do anything later).

use std::collections::BTreeMap;

use std::ops::ControlFlow;

use crate::report::{BlockedCall, Link, Rule, Stuck};

use crate::schedule::Dir;

use super::rules::{Blocker, Holder};
use super::{
    CommId, Entry, HostCall, LaunchRef, Machine, Next, OpStatus, Phase, Rank, Status, StreamId,
    TagId, ThreadId, Wait,
};

/// What host threads do, beyond what the state shows.
pub trait Threads {
    /// The call thread `t` makes next, when it is between calls and that is
    /// known (a thread parked at an `await` or a `join` that is not enabled).
    fn next_call(&self, m: &Machine, t: ThreadId) -> Option<HostCall>;
    /// Whether thread `t` may still issue a point-to-point op on `comm` whose
    /// direction (seen from `t`) is `dir` and whose peer is `peer`; `None`
    /// for `dir` means either direction.
    fn may_issue(
        &self,
        m: &Machine,
        t: ThreadId,
        comm: CommId,
        dir: Option<Dir>,
        peer: Rank,
    ) -> bool;
    /// Whether thread `t` may still `notify` rank `to` with `tag`.
    fn may_notify(&self, m: &Machine, t: ThreadId, to: Rank, tag: TagId) -> bool;
    /// Whether thread `t` may still make a call that does not commute with
    /// `call`, the next step of thread `other` of its rank
    /// ([`Machine::commute`]). Conservatively `true` when unknown.
    fn may_conflict(&self, m: &Machine, t: ThreadId, other: ThreadId, call: &HostCall) -> bool {
        let _ = (m, t, other, call);
        true
    }
    /// The kernel slots (R10, [`Machine::slots_of`]) the launches thread
    /// `t` may still make take, counting the one it is inside; `None`
    /// when unknown.
    fn slots_to_come(&self, m: &Machine, t: ThreadId) -> Option<usize> {
        let _ = (m, t);
        None
    }
    /// Whether nothing is known of rank `rank`'s threads (its part of a
    /// trace did not come, across processes): it may still issue or notify
    /// anything, and a wait on it is no partner that never comes.
    fn absent(&self, rank: Rank) -> bool {
        let _ = rank;
        false
    }
    /// For a thread between calls whose next call is not known
    /// ([`Threads::next_call`] is `None`) because a backend holds it back
    /// though the model lets it through (duplex-nccl holds a launch behind
    /// another thread's launch in its connection handshake on a stream
    /// they share, not only a communicator as R11 does): that call, and
    /// the threads of its rank it waits for to return. `None` for a thread
    /// that is not held.
    fn held(&self, m: &Machine, t: ThreadId) -> Option<(HostCall, Vec<ThreadId>)> {
        let _ = (m, t);
        None
    }
}

/// [`Threads`] that knows only each thread's next call: any thread that has
/// not ended may do anything later; and nothing of the ranks listed (whose
/// traces did not come).
#[derive(Clone, Copy)]
pub struct Unknown<'a>(pub &'a dyn Fn(ThreadId) -> Option<HostCall>, pub &'a [Rank]);

impl std::fmt::Debug for Unknown<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Unknown")
    }
}

impl Threads for Unknown<'_> {
    fn next_call(&self, _: &Machine, t: ThreadId) -> Option<HostCall> {
        (self.0)(t)
    }
    fn may_issue(&self, m: &Machine, t: ThreadId, _: CommId, _: Option<Dir>, _: Rank) -> bool {
        !m.ended(t)
    }
    fn may_notify(&self, m: &Machine, t: ThreadId, _: Rank, _: TagId) -> bool {
        !m.ended(t)
    }
    fn absent(&self, rank: Rank) -> bool {
        self.1.contains(&rank)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Node {
    Thread(ThreadId),
    Launch(LaunchRef),
    /// The `wait` entry at the head of a stream.
    Marker(StreamId),
    /// A partner that never comes (index into the missing texts).
    Missing(usize),
    /// A rank nothing is known of ([`Threads::absent`]): it may still move.
    Absent(Rank),
}

struct Edge {
    to: Node,
    rule: Rule,
    why: String,
    /// Which of its node's blockers this edge is one holder of: a node
    /// waits for each of its blockers (all must go), and for one holder of
    /// each (any will do: any thread that may still issue the op).
    blocker: u32,
}

struct Graph<'m> {
    m: &'m Machine,
    threads: &'m dyn Threads,
    edges: BTreeMap<Node, Vec<Edge>>,
    missing: Vec<String>,
    /// Per node, the index of its blocker whose edges are being added.
    blockers: BTreeMap<Node, u32>,
    /// Per node, the rule of its last blocker.
    last: BTreeMap<Node, Rule>,
}

impl Machine {
    /// True once thread `t` has made its last call.
    pub fn ended(&self, t: ThreadId) -> bool {
        matches!(self.state.threads[t.ix()].phase, Phase::Ended)
    }

    /// The threads that can take a step: finish a handshake, or make their
    /// next call (which `threads` knows).
    pub fn runnable(&self, threads: &dyn Threads) -> Vec<ThreadId> {
        (0..self.state.threads.len())
            .map(|i| ThreadId(i as u32))
            .filter(|t| match self.next(*t) {
                Next::Resume => true,
                Next::Call => threads
                    .next_call(self, *t)
                    .is_some_and(|c| self.enabled(*t, &c)),
                Next::Blocked | Next::Finished => false,
            })
            .collect()
    }

    /// Whether the state can move, has finished, or is stuck.
    pub fn status(&self, threads: &dyn Threads) -> Status {
        if !self.runnable(threads).is_empty() {
            return Status::Running;
        }
        let finished =
            (0..self.state.threads.len()).all(|i| self.next(ThreadId(i as u32)) == Next::Finished);
        if finished {
            Status::Finished
        } else {
            Status::Stuck
        }
    }

    /// True when thread `t` cannot step now and has not finished.
    fn is_blocked(&self, threads: &dyn Threads, t: ThreadId) -> bool {
        match self.next(t) {
            Next::Blocked => true,
            Next::Call => !threads
                .next_call(self, t)
                .is_some_and(|c| self.enabled(t, &c)),
            Next::Resume | Next::Finished => false,
        }
    }

    /// Explains a stuck state (see [`Machine::status`]).
    pub fn stuck(&self, threads: &dyn Threads) -> Stuck {
        let mut g = Graph {
            m: self,
            threads,
            edges: BTreeMap::new(),
            missing: Vec::new(),
            blockers: BTreeMap::new(),
            last: BTreeMap::new(),
        };
        g.build();
        let cycle = g.cycle();
        let mut missing = Vec::new();
        for (from, edges) in &g.edges {
            for e in edges {
                if let Node::Missing(i) = e.to {
                    missing.push(Link {
                        node: g.describe(*from),
                        what: g.structured(*from),
                        rule: e.rule,
                        waits_for: g.missing[i].clone(),
                    });
                }
            }
        }
        let blocked = (0..self.state.threads.len())
            .map(|i| ThreadId(i as u32))
            .filter(|t| self.is_blocked(threads, *t))
            .map(|t| g.blocked_call(t))
            .collect();
        let ops = self
            .state
            .launches
            .sorted()
            .into_iter()
            .flat_map(|(lref, l)| {
                l.ops
                    .iter()
                    .enumerate()
                    .filter(|(_, o)| o.status != OpStatus::Done)
                    .map(|(i, _)| self.op_view(*lref, i))
            })
            .collect();
        Stuck {
            cycle,
            missing,
            blocked,
            ops,
            note: None,
            mismatched_setups: self
                .state
                .mismatches
                .iter()
                .map(|m| self.describe_mismatch(m))
                .collect(),
        }
    }

    pub(super) fn stream_name(&self, s: StreamId) -> String {
        let info = &self.setup.streams[s.ix()];
        format!("stream {} of rank {}", info.name, info.rank)
    }

    pub(super) fn comm_name(&self, c: CommId) -> &str {
        &self.setup.comms[c.ix()].name
    }
}

impl Graph<'_> {
    /// An edge for `from`'s current blocker ([`Graph::add_blocker`]).
    fn add(&mut self, from: Node, to: Node, rule: Rule, why: String) {
        let blocker = self.blockers.get(&from).copied().unwrap_or(0);
        self.edges.entry(from).or_default().push(Edge {
            to,
            rule,
            why,
            blocker,
        });
    }

    /// Starts `from`'s next blocker: the next edges are its.
    fn next_blocker(&mut self, from: Node) {
        *self.blockers.entry(from).or_default() += 1;
    }

    fn add_missing(&mut self, from: Node, rule: Rule, text: String) {
        self.missing.push(text);
        let to = Node::Missing(self.missing.len() - 1);
        let why = self.missing[self.missing.len() - 1].clone();
        self.add(from, to, rule, why);
    }

    /// Threads of `rank` that may still issue an op on `comm` toward `peer`.
    fn issuers(&self, rank: Rank, comm: CommId, dir: Option<Dir>, peer: Rank) -> Vec<ThreadId> {
        let m = self.m;
        m.setup
            .threads_of(rank)
            .filter(|t| {
                let pending = match &m.state.threads[t.ix()].phase {
                    Phase::Connecting { spec, .. } => spec.ops.iter().any(|o| {
                        o.comm == comm && o.peer == peer && dir.is_none_or(|d| d == o.dir)
                    }),
                    _ => false,
                };
                pending || (!m.ended(*t) && self.threads.may_issue(m, *t, comm, dir, peer))
            })
            .collect()
    }

    fn build(&mut self) {
        let m = self.m;
        for i in 0..m.state.threads.len() {
            let t = ThreadId(i as u32);
            if m.is_blocked(self.threads, t) {
                let mut found = Vec::new();
                let mut collect = |b: Blocker| {
                    found.push(b);
                    ControlFlow::Continue(())
                };
                let mut held = Vec::new();
                let _ = if m.next(t) == Next::Call {
                    match self.threads.next_call(m, t) {
                        Some(call) => m.call_blockers(t, &call, &mut collect),
                        None => {
                            held = self.threads.held(m, t).map(|h| h.1).unwrap_or_default();
                            ControlFlow::Continue(())
                        }
                    }
                } else {
                    m.wait_blockers(t, &m.state.threads[t.ix()].wait, &mut collect)
                };
                for b in found {
                    self.add_blocker(Node::Thread(t), b);
                }
                // Held back by the backend until each of these returns
                // (all of them: each is a blocker of its own). Left as a
                // thread that may still move, it freed whatever waited on
                // its rank, and a cycle through it was not named (found by
                // review).
                for u in held {
                    let from = Node::Thread(t);
                    if self.last.insert(from, Rule::R11).is_some() {
                        self.next_blocker(from);
                    }
                    let info = &m.setup.threads[u.ix()];
                    let why = format!(
                        "held back by the backend until thread {} of rank {} returns from its launch, in its connection handshake on a communicator or stream they share",
                        info.name, info.rank
                    );
                    self.add(from, Node::Thread(u), Rule::R11, why);
                }
            }
        }
        for (lref, launch) in m.state.launches.sorted() {
            let mut found = Vec::new();
            let mut collect = |b: Blocker| {
                found.push(b);
                ControlFlow::Continue(())
            };
            if launch.started {
                for (i, op) in launch.ops.iter().enumerate() {
                    if op.status == OpStatus::Active {
                        let _ = m.op_blockers(*lref, i, &mut collect);
                    }
                }
            } else {
                let _ = m.launch_blockers(*lref, &mut collect);
            }
            for b in found {
                self.add_blocker(Node::Launch(*lref), b);
            }
        }
        for i in 0..m.state.streams.len() {
            let s = StreamId(i as u32);
            let mut found = Vec::new();
            let _ = m.marker_blockers(s, &mut |b| {
                found.push(b);
                ControlFlow::Continue(())
            });
            for b in found {
                self.add_blocker(Node::Marker(s), b);
            }
        }
    }

    /// The rank a node belongs to.
    fn rank_of(&self, n: Node) -> Rank {
        let m = self.m;
        match n {
            Node::Thread(t) => m.rank_of(t),
            Node::Launch(l) => m.state.launches[&l].rank,
            Node::Marker(s) => m.setup.streams[s.ix()].rank,
            Node::Missing(_) => 0,
            Node::Absent(r) => r,
        }
    }

    /// Turns what a rule function found into edges: to the node that holds
    /// `from`, to every thread that may still provide what it waits for,
    /// or to a missing partner when no thread ever will.
    fn add_blocker(&mut self, from: Node, b: Blocker) {
        // R10 names each launch that holds a kernel slot as a blocker of
        // its own, and any one of them ending frees a slot: they are one
        // blocker with several holders (found by a property over moments
        // of runs that complete: a launch waiting for a slot was put in a
        // cycle through one slot holder while another could end).
        let slot = b.rule == Rule::R10;
        match self.last.insert(from, b.rule) {
            Some(Rule::R10) if slot => {}
            Some(_) => self.next_blocker(from),
            None => {}
        }
        self.add_holders(from, b);
    }

    /// The edges of a blocker that any one of `threads` of rank `who` may
    /// lift (issue the op, post the `notify`): one to each, or, with none,
    /// to the rank when nothing is known of it ([`Threads::absent`]), else
    /// to a partner that never comes.
    fn add_any_of(&mut self, from: Node, b: &Blocker, who: Rank, threads: Vec<ThreadId>) {
        let m = self.m;
        let rank = self.rank_of(from);
        if threads.is_empty() && self.threads.absent(who) {
            let why = format!(
                "{} (rank {who}'s trace is not here: whether it will is not known)",
                m.explain(rank, b, Some(true))
            );
            self.add(from, Node::Absent(who), b.rule, why);
        } else if threads.is_empty() {
            let text = m.explain(rank, b, Some(false));
            self.add_missing(from, b.rule, text);
        }
        let why = m.explain(rank, b, Some(true));
        for u in threads {
            self.add(from, Node::Thread(u), b.rule, why.clone());
        }
    }

    /// [`Graph::add_blocker`]'s edges.
    fn add_holders(&mut self, from: Node, b: Blocker) {
        let m = self.m;
        let rank = self.rank_of(from);
        match b.holder {
            Holder::Transient => {}
            Holder::Launch(l) => self.add(from, Node::Launch(l), b.rule, m.explain(rank, &b, None)),
            Holder::Marker(s) => self.add(from, Node::Marker(s), b.rule, m.explain(rank, &b, None)),
            Holder::Thread(u) => self.add(from, Node::Thread(u), b.rule, m.explain(rank, &b, None)),
            Holder::Issue {
                rank: who,
                comm,
                dir,
                peer,
            } => {
                let issuers = self.issuers(who, comm, dir, peer);
                self.add_any_of(from, &b, who, issuers);
            }
            Holder::Notify { from: who, to, tag } => {
                let senders: Vec<ThreadId> = m
                    .setup
                    .threads_of(who)
                    .filter(|u| !m.ended(*u) && self.threads.may_notify(m, *u, to, tag))
                    .collect();
                self.add_any_of(from, &b, who, senders);
            }
        }
    }

    /// The nodes that can never move: to a fixpoint, those with a blocker
    /// none of whose holders can move (a missing partner never does). A
    /// node with no blocker can: a thread whose next call is not known
    /// (outside duplex, in a hang analysis), or a wait that ends by itself.
    /// In a stuck state that knows every thread's calls (the checker's),
    /// that is every node with a blocker.
    fn never_move(&self) -> std::collections::BTreeSet<Node> {
        let mut stuck: std::collections::BTreeSet<Node> = self.edges.keys().copied().collect();
        loop {
            let held = |n: &Node| {
                let edges = &self.edges[n];
                let mut blockers: Vec<u32> = edges.iter().map(|e| e.blocker).collect();
                blockers.dedup();
                blockers.into_iter().any(|b| {
                    edges
                        .iter()
                        .filter(|e| e.blocker == b)
                        .all(|e| matches!(e.to, Node::Missing(_)) || stuck.contains(&e.to))
                })
            };
            let freed: Vec<Node> = stuck.iter().copied().filter(|n| !held(n)).collect();
            if freed.is_empty() {
                return stuck;
            }
            for n in freed {
                stuck.remove(&n);
            }
        }
    }

    /// The first cycle found by depth-first search from threads, then ops.
    fn cycle(&self) -> Vec<Link> {
        #[derive(Clone, Copy, PartialEq)]
        enum Color {
            White,
            Grey,
            Black,
        }
        // Only the nodes that can never move, and only their edges to such
        // nodes: a wait one of whose holders can still move (a thread
        // outside duplex, in a hang analysis, that may still issue the
        // op) is in no cycle (found by a property over moments of runs
        // that complete: a recv waiting for a peer rank's op, which a thread
        // of that rank outside duplex was about to issue, was named in a
        // cycle through the rank's other thread).
        let stuck = self.never_move();
        let edges: BTreeMap<Node, Vec<&Edge>> = self
            .edges
            .iter()
            .filter(|(n, _)| stuck.contains(n))
            .map(|(n, e)| (*n, e.iter().filter(|e| stuck.contains(&e.to)).collect()))
            .collect();
        let nodes: Vec<Node> = edges.keys().copied().collect();
        let mut color: BTreeMap<Node, Color> = nodes.iter().map(|n| (*n, Color::White)).collect();
        for start in &nodes {
            if color[start] != Color::White {
                continue;
            }
            // Iterative DFS keeping the path of (node, edge index).
            let mut path: Vec<(Node, usize)> = vec![(*start, 0)];
            color.insert(*start, Color::Grey);
            while let Some((node, i)) = path.last().copied() {
                let out = edges.get(&node).map(|e| e.as_slice()).unwrap_or(&[]);
                if i >= out.len() {
                    color.insert(node, Color::Black);
                    path.pop();
                    continue;
                }
                if let Some(last) = path.last_mut() {
                    last.1 += 1;
                }
                let to = out[i].to;
                match color.get(&to).copied().unwrap_or(Color::Black) {
                    Color::White => {
                        color.insert(to, Color::Grey);
                        path.push((to, 0));
                    }
                    Color::Grey => {
                        let from = path.iter().position(|(n, _)| *n == to).unwrap_or(0);
                        return path[from..]
                            .iter()
                            .map(|(n, next)| {
                                let e = edges[n][next - 1];
                                Link {
                                    node: self.describe(*n),
                                    what: self.structured(*n),
                                    rule: e.rule,
                                    waits_for: e.why.clone(),
                                }
                            })
                            .collect();
                    }
                    Color::Black => {}
                }
            }
        }
        Vec::new()
    }

    /// A node as data (a missing partner is never the source of a link).
    fn structured(&self, n: Node) -> crate::report::Node {
        let m = self.m;
        match n {
            Node::Thread(t) => crate::report::Node::Call {
                call: self.blocked_call(t),
            },
            Node::Launch(l) => crate::report::Node::Launch {
                ops: (0..m.state.launches[&l].ops.len())
                    .map(|i| m.op_view(l, i))
                    .collect(),
            },
            Node::Marker(s) => crate::report::Node::Wait {
                rank: m.setup.streams[s.ix()].rank,
                stream: m.setup.streams[s.ix()].name.clone(),
                at: match m.state.streams[s.ix()].queue.front() {
                    Some(Entry::WaitEvent(_, o)) => super::describe_origin(&m.setup, *o),
                    _ => String::new(),
                },
            },
            // Never the source of a link: a missing partner waits for
            // nothing, and an absent rank may still move.
            Node::Missing(_) | Node::Absent(_) => crate::report::Node::Launch { ops: Vec::new() },
        }
    }

    fn describe(&self, n: Node) -> String {
        let m = self.m;
        match n {
            Node::Thread(t) => {
                let b = self.blocked_call(t);
                format!(
                    "rank {} {}: host call `{}` ({})",
                    b.rank, b.thread, b.call, b.at
                )
            }
            Node::Launch(l) => {
                let launch = &m.state.launches[&l];
                if launch.ops.len() == 1 {
                    m.op_view(l, 0).to_string()
                } else {
                    let ops: Vec<String> = (0..launch.ops.len())
                        .map(|i| m.op_view(l, i).to_string())
                        .collect();
                    format!("group of {} ops: {}", ops.len(), ops.join("; "))
                }
            }
            Node::Marker(s) => {
                let at = match m.state.streams[s.ix()].queue.front() {
                    Some(Entry::WaitEvent(_, o)) => super::describe_origin(&m.setup, *o),
                    _ => String::new(),
                };
                format!("`wait` on {} ({at})", m.stream_name(s))
            }
            Node::Missing(i) => self.missing[i].clone(),
            Node::Absent(r) => format!("rank {r}, whose trace is not here"),
        }
    }

    fn blocked_call(&self, t: ThreadId) -> BlockedCall {
        let m = self.m;
        let info = &m.setup.threads[t.ix()];
        let th = &m.state.threads[t.ix()];
        let pending = if m.next(t) == Next::Call {
            self.threads
                .next_call(m, t)
                .or_else(|| self.threads.held(m, t).map(|h| h.0))
        } else {
            None
        };
        let origin = match (&th.phase, &th.wait, pending) {
            (_, _, Some(HostCall::Await { origin, .. }))
            | (_, _, Some(HostCall::Join { origin, .. })) => Some(origin),
            (Phase::Connecting { spec, .. }, _, _) => Some(spec.origin),
            // A launch held back before it is made (R11).
            (_, _, Some(HostCall::Launch(spec))) => Some(spec.origin),
            (_, Wait::Streams { origin, .. }, _) => *origin,
            _ => None,
        };
        let (call, at, line) = match origin.and_then(|o| m.setup.origins.get(o.ix())) {
            Some(o) => (o.text.to_string(), o.place(), o.line_number()),
            None => (
                "end of thread".to_string(),
                "its implicit final synchronize".to_string(),
                None,
            ),
        };
        let waits_for = self
            .edges
            .get(&Node::Thread(t))
            .and_then(|e| e.first())
            .map(|e| e.why.clone())
            .unwrap_or_default();
        BlockedCall {
            rank: info.rank,
            thread: info.name.clone(),
            call,
            at,
            line,
            waits_for,
        }
    }
}
