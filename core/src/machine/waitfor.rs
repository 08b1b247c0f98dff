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

use crate::report::{BlockedCall, Link, Stuck};

use crate::Size;
use crate::schedule::Dir;

use super::{
    ChannelKey, CommId, Entry, HostCall, LaunchRef, Machine, Next, OpStatus, Phase, Rank, Status,
    StreamId, TagId, ThreadId, Wait,
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
}

/// [`Threads`] that knows only each thread's next call: any thread that has
/// not ended may do anything later.
#[derive(Clone, Copy)]
pub struct Unknown<'a>(pub &'a dyn Fn(ThreadId) -> Option<HostCall>);

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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Node {
    Thread(ThreadId),
    Launch(LaunchRef),
    /// The `wait` entry at the head of a stream.
    Marker(StreamId),
    /// A partner that never comes (index into the missing texts).
    Missing(usize),
}

struct Edge {
    to: Node,
    rule: &'static str,
    why: String,
}

struct Graph<'m> {
    m: &'m Machine,
    threads: &'m dyn Threads,
    edges: BTreeMap<Node, Vec<Edge>>,
    missing: Vec<String>,
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
        };
        g.build();
        let cycle = g.cycle();
        let mut missing = Vec::new();
        for (from, edges) in &g.edges {
            for e in edges {
                if let Node::Missing(i) = e.to {
                    missing.push(Link {
                        node: g.describe(*from),
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
            .iter()
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
        }
    }

    fn head(&self, s: StreamId) -> Option<Node> {
        match self.state.streams[s.ix()].queue.front()? {
            Entry::Launch(l) => Some(Node::Launch(*l)),
            Entry::WaitEvent(..) => Some(Node::Marker(s)),
            Entry::Record => None,
        }
    }

    fn stream_name(&self, s: StreamId) -> String {
        let info = &self.setup.streams[s.ix()];
        format!("stream {} of rank {}", info.name, info.rank)
    }

    fn comm_name(&self, c: CommId) -> &str {
        &self.setup.comms[c.ix()].name
    }
}

impl Graph<'_> {
    fn add(&mut self, from: Node, to: Node, rule: &'static str, why: String) {
        self.edges
            .entry(from)
            .or_default()
            .push(Edge { to, rule, why });
    }

    fn add_missing(&mut self, from: Node, rule: &'static str, text: String) {
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
                self.thread_edges(t);
            }
        }
        let launches: Vec<LaunchRef> = m.state.launches.keys().copied().collect();
        for l in launches {
            self.launch_edges(l);
        }
        for i in 0..m.state.streams.len() {
            let s = StreamId(i as u32);
            if let Some(Entry::WaitEvent(Some((target, _)), _)) = m.state.streams[i].queue.front()
                && let Some(head) = m.head(*target)
            {
                let why = format!(
                    "waits for an event recorded on {}, behind its head",
                    m.stream_name(*target)
                );
                self.add(Node::Marker(s), head, "R9", why);
            }
        }
    }

    fn thread_edges(&mut self, t: ThreadId) {
        let m = self.m;
        let rank = m.rank_of(t);
        if m.next(t) == Next::Call {
            match self.threads.next_call(m, t) {
                Some(HostCall::Await { from, tag, .. }) => self.await_edges(t, rank, from, tag),
                Some(HostCall::Join { thread, .. }) => {
                    let info = &m.setup.threads[thread.ix()];
                    let why = format!(
                        "waits for thread {} of rank {} to finish",
                        info.name, info.rank
                    );
                    self.add(Node::Thread(t), Node::Thread(thread), "join", why);
                }
                _ => {}
            }
            return;
        }
        match &m.state.threads[t.ix()].wait {
            Wait::None => {}
            Wait::Streams { targets, origin } => {
                let rule = if origin.is_some() { "sync" } else { "end" };
                for (s, n) in targets {
                    if m.state.streams[s.ix()].base >= *n {
                        continue;
                    }
                    if let Some(head) = m.head(*s) {
                        let why = format!("waits for {} to drain", m.stream_name(*s));
                        self.add(Node::Thread(t), head, rule, why);
                    }
                }
            }
            Wait::Connect { pairs } => {
                for (c, peer, round) in pairs {
                    if m.peer_rounds(*c, *peer, rank) >= *round {
                        continue;
                    }
                    let comm = m.comm_name(*c).to_string();
                    let why = format!(
                        "connection handshake: waits for rank {peer} to issue an op toward rank {rank} on comm {comm} that needs a connection it has not set up (setup round {round})"
                    );
                    let others = self.issuers(*peer, *c, None, rank);
                    if others.is_empty() {
                        self.add_missing(
                            Node::Thread(t),
                            "R7",
                            format!("no thread of rank {peer} will ever issue an op toward rank {rank} on comm {comm}, so the connection handshake never completes"),
                        );
                    }
                    for u in others {
                        self.add(Node::Thread(t), Node::Thread(u), "R7", why.clone());
                    }
                }
            }
        }
    }

    fn await_edges(&mut self, t: ThreadId, rank: Rank, from: Rank, tag: TagId) {
        let m = self.m;
        let tag_name = &m.setup.tags[tag.ix()];
        let senders: Vec<ThreadId> = m
            .setup
            .threads_of(from)
            .filter(|u| !m.ended(*u) && self.threads.may_notify(m, *u, rank, tag))
            .collect();
        let why = format!("waits for `notify {rank} {tag_name}` from rank {from}");
        if senders.is_empty() {
            self.add_missing(
                Node::Thread(t),
                "await",
                format!("no thread of rank {from} will ever `notify {rank} {tag_name}`"),
            );
        }
        for u in senders {
            self.add(Node::Thread(t), Node::Thread(u), "await", why.clone());
        }
    }

    fn launch_edges(&mut self, lref: LaunchRef) {
        let m = self.m;
        let launch = &m.state.launches[&lref];
        let me = Node::Launch(lref);
        if !launch.started {
            for s in &launch.streams {
                if m.state.streams[s.ix()].queue.front() != Some(&Entry::Launch(lref))
                    && let Some(head) = m.head(*s)
                {
                    let why = format!(
                        "cannot start before the head of {} completes",
                        m.stream_name(*s)
                    );
                    self.add(me, head, "R1", why);
                }
            }
            let rank = &m.state.ranks[launch.rank as usize];
            let pos = rank.pending.iter().position(|p| *p == lref).unwrap_or(0);
            if m.setup.model.comm_order
                && let Some(earlier) = m.earlier_on_same_comm(&rank.pending[..pos], lref)
            {
                let comms: Vec<&str> = launch
                    .ops
                    .iter()
                    .map(|o| m.comm_name(o.spec.comm))
                    .collect();
                let why = format!(
                    "cannot start before an earlier op of rank {} on comm {} completes",
                    launch.rank,
                    comms.first().copied().unwrap_or("?")
                );
                self.add(me, Node::Launch(earlier), "R2", why);
            }
            if let Some(k) = m.setup.model.kernels
                && rank.running >= k
            {
                let running: Vec<LaunchRef> = rank
                    .pending
                    .iter()
                    .copied()
                    .filter(|p| m.state.launches[p].started)
                    .collect();
                for r in running {
                    let why = format!(
                        "no free kernel slot on rank {} (kernels={k}): waits for a running launch to complete",
                        launch.rank
                    );
                    self.add(me, Node::Launch(r), "R10", why);
                }
            }
            return;
        }
        for (i, op) in launch.ops.iter().enumerate() {
            if op.status != OpStatus::Active {
                continue;
            }
            let key = super::channel_key(launch.rank, &op.spec);
            self.partner_edges(me, key, op.spec.dir, lref, i as u16, op.spec.bytes);
        }
    }

    /// Edges of an active op: what keeps its channel's front pair from
    /// completing.
    fn partner_edges(
        &mut self,
        me: Node,
        key: ChannelKey,
        dir: Dir,
        lref: LaunchRef,
        index: u16,
        bytes: u64,
    ) {
        let m = self.m;
        let Some(ch) = m.state.channels.get(&key) else {
            return;
        };
        let (comm, src, dst) = key;
        let cname = m.comm_name(comm).to_string();
        let mine = match dir {
            Dir::Send => &ch.sends,
            Dir::Recv => &ch.recvs,
        };
        let pos = mine
            .iter()
            .position(|s| s.op.launch == lref && s.op.index == index)
            .unwrap_or(0);
        let status = |op: super::OpRef| m.state.launches[&op.launch].ops[op.index as usize].status;
        let front_send_ready = ch
            .sends
            .front()
            .is_some_and(|s| s.buffered || status(s.op) == OpStatus::Active);
        let msg = ch.delivered;
        let (rule, lead) = if pos == 0 {
            (
                "R4",
                format!(
                    "started; message #{msg} of {src}→{dst} on comm {cname} completes only when both sides have started: "
                ),
            )
        } else {
            let eager = m.setup.model.eager;
            let lead = if dir == Dir::Send && eager.bytes() > 0 {
                format!(
                    "started; the channel's buffer (eager={eager}) has no room for {} more, so it waits for message #{msg} to be received: ",
                    Size(bytes)
                )
            } else {
                format!(
                    "started; messages on a channel complete in order, so it waits for message #{msg} of {src}→{dst}: "
                )
            };
            ("R3", lead)
        };
        // Which side of the front pair is missing?
        if !front_send_ready {
            match ch.sends.front() {
                Some(s) => {
                    self.add(
                        me,
                        Node::Launch(s.op.launch),
                        rule,
                        format!("{lead}its send has not started"),
                    );
                }
                None => self.future_side(me, rule, &lead, comm, &cname, src, dst, Dir::Send),
            }
        } else {
            match ch.recvs.front() {
                Some(r) => {
                    self.add(
                        me,
                        Node::Launch(r.op.launch),
                        rule,
                        format!("{lead}its recv has not started"),
                    );
                }
                None => self.future_side(me, rule, &lead, comm, &cname, src, dst, Dir::Recv),
            }
        }
    }

    /// An edge to the threads that may still issue the missing side of a
    /// message, or to a missing partner.
    #[allow(clippy::too_many_arguments)]
    fn future_side(
        &mut self,
        me: Node,
        rule: &'static str,
        lead: &str,
        comm: CommId,
        cname: &str,
        src: Rank,
        dst: Rank,
        side: Dir,
    ) {
        let (rank, peer) = if side == Dir::Send {
            (src, dst)
        } else {
            (dst, src)
        };
        let issuers = self.issuers(rank, comm, Some(side), peer);
        if issuers.is_empty() {
            let text = format!(
                "{lead}no thread of rank {rank} will ever issue the matching {} {} {peer} on comm {cname}",
                side.name(),
                if side == Dir::Send { "to" } else { "from" }
            );
            self.add_missing(me, rule, text);
        }
        for u in issuers {
            let why = format!(
                "{lead}rank {rank} has not issued the matching {} yet",
                side.name()
            );
            self.add(me, Node::Thread(u), rule, why);
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
        let nodes: Vec<Node> = self.edges.keys().copied().collect();
        let mut color: BTreeMap<Node, Color> = nodes.iter().map(|n| (*n, Color::White)).collect();
        for start in &nodes {
            if color[start] != Color::White {
                continue;
            }
            // Iterative DFS keeping the path of (node, edge index).
            let mut path: Vec<(Node, usize)> = vec![(*start, 0)];
            color.insert(*start, Color::Grey);
            while let Some((node, i)) = path.last().copied() {
                let edges = self.edges.get(&node).map(|e| e.as_slice()).unwrap_or(&[]);
                if i >= edges.len() {
                    color.insert(node, Color::Black);
                    path.pop();
                    continue;
                }
                if let Some(last) = path.last_mut() {
                    last.1 += 1;
                }
                let to = edges[i].to;
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
                                let e = &self.edges[n][next - 1];
                                Link {
                                    node: self.describe(*n),
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
        }
    }

    fn blocked_call(&self, t: ThreadId) -> BlockedCall {
        let m = self.m;
        let info = &m.setup.threads[t.ix()];
        let th = &m.state.threads[t.ix()];
        let pending = if m.next(t) == Next::Call {
            self.threads.next_call(m, t)
        } else {
            None
        };
        let origin = match (&th.phase, &th.wait, pending) {
            (_, _, Some(HostCall::Await { origin, .. }))
            | (_, _, Some(HostCall::Join { origin, .. })) => Some(origin),
            (Phase::Connecting { spec, .. }, _, _) => Some(spec.origin),
            (_, Wait::Streams { origin, .. }, _) => *origin,
            _ => None,
        };
        let (call, at, line) = match origin.and_then(|o| m.setup.origins.get(o.ix())) {
            Some(o) => (o.text.clone(), o.place.clone(), o.line),
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
