//! The rules of `docs/semantics.md`, each written once: a function that
//! says what holds a step back.
//!
//! Device progress (module `device`) takes a step exactly when the step's
//! function here finds nothing, and the wait-for explanation (module
//! `waitfor`) turns what the same function finds into edges, so the two
//! cannot disagree. A [`Blocker`] names the rule, what holds the step
//! ([`Holder`]) and the facts the explanation prints ([`Why`]); building one
//! costs no allocation, so progress pays nothing for the explanation.
//!
//! To add a rule: add its check to the function of the step it holds back
//! (a launch's start, a `wait` entry, a pair of ops, a host call), a
//! [`Why`] variant with its facts, and its sentence in
//! [`Machine::explain`]; all three are in this file. A rule with a new
//! name also gets a [`Rule`] variant (`crate::report`).

use std::ops::ControlFlow;

use crate::Size;
use crate::report::Rule;
use crate::schedule::Dir;

use smallvec::SmallVec;

use super::{
    ChannelKey, CommId, Entry, EventId, HostCall, LaunchRef, Machine, OpStatus, Phase, Rank, Slot,
    StreamId, TagId, ThreadId, Wait, launch_channel,
};

/// What holds a step back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Holder {
    /// A launch (an op or a group) that must start or complete first.
    Launch(LaunchRef),
    /// The `wait` entry at the head of a stream (R9).
    Marker(StreamId),
    /// An entry that retires in the same progress pass (a `record` at the
    /// head of its stream); never seen in a settled state.
    Transient,
    /// A host thread (that must finish, or return from its call).
    Thread(ThreadId),
    /// An op that no thread of `rank` has issued yet: on `comm`, toward
    /// `peer`, in direction `dir` (seen from `rank`; `None` for either).
    Issue {
        /// The rank that must issue it.
        rank: Rank,
        /// The communicator.
        comm: CommId,
        /// Send or recv; `None` for either.
        dir: Option<Dir>,
        /// Its peer.
        peer: Rank,
    },
    /// A `notify` from `from` to `to` with `tag` that has not been posted.
    Notify {
        /// The sending rank.
        from: Rank,
        /// The receiving rank.
        to: Rank,
        /// The tag.
        tag: TagId,
    },
}

/// The facts of a [`Blocker`] that its explanation prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Why {
    /// R1: a launch is not at the head of this stream.
    StreamHead(StreamId),
    /// R2: an earlier launch of the rank shares this communicator.
    EarlierOnComm(CommId),
    /// R10: the rank's `k` kernel slots are taken.
    KernelSlots(u32),
    /// R9: the event was recorded on this stream, behind its head.
    Event(StreamId),
    /// R3/R4/R5: the front pair of a channel lacks `missing`; the waiting op
    /// is at `pos` in its side's queue and carries `bytes`.
    Message {
        /// The channel.
        key: ChannelKey,
        /// The waiting op's side.
        dir: Dir,
        /// Its position in its side's queue (0: the front pair).
        pos: usize,
        /// Its bytes.
        bytes: u64,
        /// The side of the front pair that has not started.
        missing: Dir,
        /// Whether that side has been issued at all.
        issued: bool,
    },
    /// `sync`/`end`: this stream has not drained.
    Drain(StreamId),
    /// R7: the peer has not entered this setup round on `comm`.
    Handshake {
        /// The communicator.
        comm: CommId,
        /// The peer.
        peer: Rank,
        /// The round.
        round: u32,
    },
    /// `await`: no such `notify` has arrived.
    Mail {
        /// The sender.
        from: Rank,
        /// The tag.
        tag: TagId,
    },
    /// `join`: the thread has not finished.
    Finish(ThreadId),
    /// R11: another thread of the rank is inside a call on `comm`.
    InCall(CommId),
}

/// One thing that holds a step back, and by which rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Blocker {
    pub(super) rule: Rule,
    pub(super) holder: Holder,
    pub(super) why: Why,
}

/// The front pair of a channel.
#[derive(Clone, Copy, Debug)]
pub(super) enum Front {
    /// Both sides have started (or the send is buffered): the pair completes.
    Ready(Slot, Slot),
    /// The send side has not started (`Some`) or not been issued (`None`).
    NoSend(Option<Slot>),
    /// The recv side has not started (`Some`) or not been issued (`None`).
    NoRecv(Option<Slot>),
}

type Visit<'a> = &'a mut dyn FnMut(Blocker) -> ControlFlow<()>;

impl Machine {
    /// The entry at the head of stream `s`, as a holder.
    pub(super) fn head_holder(&self, s: StreamId) -> Holder {
        match self.state.streams[s.ix()].queue.front() {
            Some(Entry::Launch(l)) => Holder::Launch(*l),
            Some(Entry::WaitEvent(..)) => Holder::Marker(s),
            Some(Entry::Record) | None => Holder::Transient,
        }
    }

    /// What keeps launch `lref` from starting: R1 (it is not at the head of
    /// every stream it is on; a group waits for all of them, R8), R2 (an
    /// earlier launch of its rank on one of its communicators has not
    /// completed), R10 (every kernel slot of the rank is taken).
    pub(super) fn launch_blockers(&self, lref: LaunchRef, f: Visit<'_>) -> ControlFlow<()> {
        let launch = &self.state.launches[&lref];
        for s in &launch.streams {
            if self.state.streams[s.ix()].queue.front() != Some(&Entry::Launch(lref)) {
                f(Blocker {
                    rule: Rule::R1,
                    holder: self.head_holder(*s),
                    why: Why::StreamHead(*s),
                })?;
            }
        }
        let rank = &self.state.ranks[launch.rank as usize];
        let copy = self.is_copy(lref);
        if self.setup.model.comm_order && !copy {
            // A launch is on one communicator (a group is launched once per
            // communicator, `Machine::op_refs`); the rank's launches on it
            // are queued in issue order.
            let comm = launch.comm();
            if let Some(earlier) = rank
                .on_comm
                .binary_search_by_key(&comm, |(c, _)| *c)
                .ok()
                .and_then(|i| rank.on_comm[i].1.front())
                && *earlier != lref
            {
                f(Blocker {
                    rule: Rule::R2,
                    holder: Holder::Launch(*earlier),
                    why: Why::EarlierOnComm(comm),
                })?;
            }
        }
        if let Some(k) = self.setup.model.kernels
            && !copy
            && rank.running >= k
        {
            for r in rank
                .pending
                .iter()
                .filter(|p| self.state.launches[p].started && !self.is_copy(**p))
            {
                f(Blocker {
                    rule: Rule::R10,
                    holder: Holder::Launch(*r),
                    why: Why::KernelSlots(k),
                })?;
            }
        }
        ControlFlow::Continue(())
    }

    /// R8: in a started launch, op `i` waits for the earlier ops of its
    /// launch on the same channel (ops to the same peer execute in order;
    /// sends and receives progress independently). The launch is what
    /// holds it; there is no edge of its own.
    pub(super) fn behind_in_group(&self, lref: LaunchRef, i: usize) -> bool {
        let ops = &self.state.launches[&lref].ops;
        let me = launch_channel(&ops[i].spec);
        ops[..i]
            .iter()
            .any(|o| o.status != OpStatus::Done && launch_channel(&o.spec) == me)
    }

    /// The front pair of channel `key` (R3: the k-th send meets the k-th
    /// recv; R4: they complete once both have started; a send buffered by
    /// R5 counts as started).
    pub(super) fn front(&self, key: ChannelKey) -> Option<Front> {
        let ch = self.state.channels.get(&key)?;
        // A ghost recv (`Machine::settle_from`) started long ago.
        let status = |s: &Slot| {
            if s.ghost {
                OpStatus::Active
            } else {
                self.state.launches[&s.op.launch].ops[s.op.index as usize].status
            }
        };
        let send = ch.sends.front().copied();
        let recv = ch.recvs.front().copied();
        match (send, recv) {
            (Some(s), Some(r))
                if (s.buffered || status(&s) == OpStatus::Active)
                    && status(&r) == OpStatus::Active =>
            {
                Some(Front::Ready(s, r))
            }
            (Some(s), _) if !(s.buffered || status(&s) == OpStatus::Active) => {
                Some(Front::NoSend(Some(s)))
            }
            (None, _) => Some(Front::NoSend(None)),
            (Some(_), r) => Some(Front::NoRecv(r)),
        }
    }

    /// What keeps started op `i` of launch `lref` from completing: the
    /// front pair of its channel lacks a side (R4 when it is that pair; R3
    /// when it waits for its turn behind it; R5 when it is a send the
    /// channel's buffer has no room for).
    pub(super) fn op_blockers(&self, lref: LaunchRef, i: usize, f: Visit<'_>) -> ControlFlow<()> {
        let launch = &self.state.launches[&lref];
        let op = &launch.ops[i];
        let key = super::channel_key(launch.rank, &op.spec);
        let Some(ch) = self.state.channels.get(&key) else {
            return ControlFlow::Continue(());
        };
        let mine = match op.spec.dir {
            Dir::Send => &ch.sends,
            Dir::Recv => &ch.recvs,
        };
        let pos = mine
            .iter()
            .position(|s| s.op.launch == lref && usize::from(s.op.index) == i)
            .unwrap_or(0);
        let rule = if pos == 0 {
            Rule::R4
        } else if op.spec.dir == Dir::Send && self.buffers(key) {
            Rule::R5
        } else if op.spec.dir == Dir::Send && self.eager_of(key) > 0 {
            // A channel that would buffer it, but not before its first
            // message was received (R6).
            Rule::R6
        } else {
            Rule::R3
        };
        let (comm, src, dst) = key;
        let (missing, slot) = match self.front(key) {
            Some(Front::NoSend(s)) => (Dir::Send, s),
            Some(Front::NoRecv(r)) => (Dir::Recv, r),
            Some(Front::Ready(..)) | None => return ControlFlow::Continue(()),
        };
        let holder = match slot {
            Some(s) => Holder::Launch(s.op.launch),
            None => Holder::Issue {
                rank: if missing == Dir::Send { src } else { dst },
                comm,
                dir: Some(missing),
                peer: if missing == Dir::Send { dst } else { src },
            },
        };
        f(Blocker {
            rule,
            holder,
            why: Why::Message {
                key,
                dir: op.spec.dir,
                pos,
                bytes: op.spec.bytes,
                missing,
                issued: slot.is_some(),
            },
        })
    }

    /// What keeps the `wait` entry at the head of stream `s` from
    /// completing (R9: until the recorded entry has completed).
    pub(super) fn marker_blockers(&self, s: StreamId, f: Visit<'_>) -> ControlFlow<()> {
        if let Some(Entry::WaitEvent(Some((target, index)), _)) =
            self.state.streams[s.ix()].queue.front()
            && self.state.streams[target.ix()].base <= *index
        {
            f(Blocker {
                rule: Rule::R9,
                holder: self.head_holder(*target),
                why: Why::Event(*target),
            })?;
        }
        ControlFlow::Continue(())
    }

    /// What keeps thread `t`'s current call from returning: the streams a
    /// `sync` (or its end) waits for (R1 drains them), the handshake rounds
    /// its call waits for (R7).
    pub(super) fn wait_blockers(&self, t: ThreadId, wait: &Wait, f: Visit<'_>) -> ControlFlow<()> {
        match wait {
            Wait::None => {}
            Wait::Streams { targets, origin } => {
                let rule = if origin.is_some() {
                    Rule::Sync
                } else {
                    Rule::End
                };
                for (s, n) in targets {
                    if self.state.streams[s.ix()].base < *n {
                        f(Blocker {
                            rule,
                            holder: self.head_holder(*s),
                            why: Why::Drain(*s),
                        })?;
                    }
                }
            }
            Wait::Connect { pairs } => {
                let rank = self.rank_of(t);
                for (comm, peer, round) in pairs {
                    if self.peer_rounds(*comm, *peer, rank) < *round {
                        f(Blocker {
                            rule: Rule::R7,
                            holder: Holder::Issue {
                                rank: *peer,
                                comm: *comm,
                                dir: None,
                                peer: rank,
                            },
                            why: Why::Handshake {
                                comm: *comm,
                                peer: *peer,
                                round: *round,
                            },
                        })?;
                    }
                }
            }
        }
        ControlFlow::Continue(())
    }

    /// What keeps thread `t`, between calls, from making `call`: an `await`
    /// waits for its message, a `join` for its thread to end, and a
    /// launch for every other thread of the rank to be out of its calls on
    /// the launch's communicators (R11).
    pub(super) fn call_blockers(
        &self,
        t: ThreadId,
        call: &HostCall,
        f: Visit<'_>,
    ) -> ControlFlow<()> {
        let rank = self.rank_of(t);
        match call {
            HostCall::Await { from, tag, .. } => {
                let arrived = self
                    .state
                    .mail
                    .get(&(*from, rank, *tag))
                    .is_some_and(|n| *n > 0);
                if !arrived {
                    f(Blocker {
                        rule: Rule::Await,
                        holder: Holder::Notify {
                            from: *from,
                            to: rank,
                            tag: *tag,
                        },
                        why: Why::Mail {
                            from: *from,
                            tag: *tag,
                        },
                    })?;
                }
            }
            HostCall::Join { thread, .. } => {
                // Its end made, not its rank's streams drained: the NCCL
                // backend's `join` waits for the thread's result only.
                let done = self.state.threads.get(thread.ix()).is_some() && self.ended(*thread);
                if !done {
                    f(Blocker {
                        rule: Rule::Join,
                        holder: Holder::Thread(*thread),
                        why: Why::Finish(*thread),
                    })?;
                }
            }
            HostCall::Launch(spec) => {
                for u in self.setup.threads_of(rank) {
                    if u == t {
                        continue;
                    }
                    if let Phase::Connecting { spec: theirs, .. } =
                        &self.state.threads[u.ix()].phase
                        && let Some(op) = spec
                            .ops
                            .iter()
                            .find(|o| theirs.ops.iter().any(|p| p.comm == o.comm))
                    {
                        f(Blocker {
                            rule: Rule::R11,
                            holder: Holder::Thread(u),
                            why: Why::InCall(op.comm),
                        })?;
                    }
                }
            }
            HostCall::Record { .. }
            | HostCall::Wait { .. }
            | HostCall::Sync { .. }
            | HostCall::Notify { .. }
            | HostCall::End => {}
        }
        ControlFlow::Continue(())
    }
}

impl Machine {
    /// The sentence of a blocker, for a node of `rank`. `future` is, for
    /// what a thread has not done yet, whether some thread may still do it.
    pub(super) fn explain(&self, rank: Rank, b: &Blocker, future: Option<bool>) -> String {
        let m = self;
        let never = future == Some(false);
        match b.why {
            Why::StreamHead(s) => format!(
                "cannot start before the head of {} completes",
                m.stream_name(s)
            ),
            Why::EarlierOnComm(c) => format!(
                "cannot start before an earlier op of rank {rank} on comm {} completes",
                m.comm_name(c)
            ),
            Why::KernelSlots(k) => format!(
                "no free kernel slot on rank {rank} (kernels={k}): waits for a running launch to complete"
            ),
            Why::Event(s) => format!(
                "waits for an event recorded on {}, behind its head",
                m.stream_name(s)
            ),
            Why::Drain(s) => format!("waits for {} to drain", m.stream_name(s)),
            Why::Handshake { comm, peer, round } => {
                let comm = m.comm_name(comm);
                if never {
                    format!(
                        "no thread of rank {peer} will ever issue an op toward rank {rank} on comm {comm}, so the connection handshake never completes"
                    )
                } else {
                    format!(
                        "connection handshake: waits for rank {peer} to issue an op toward rank {rank} on comm {comm} that needs a connection it has not set up (setup round {round})"
                    )
                }
            }
            Why::Mail { from, tag } => {
                let tag = &m.setup.tags[tag.ix()];
                if never {
                    format!("no thread of rank {from} will ever `notify {rank} {tag}`")
                } else {
                    format!("waits for `notify {rank} {tag}` from rank {from}")
                }
            }
            Why::Finish(u) => {
                let info = &m.setup.threads[u.ix()];
                format!(
                    "waits for thread {} of rank {} to end",
                    info.name, info.rank
                )
            }
            Why::InCall(c) => {
                let other = match b.holder {
                    Holder::Thread(u) => m.setup.threads[u.ix()].name.clone(),
                    _ => "another thread".into(),
                };
                format!(
                    "waits for thread {other} of rank {rank} to return from its call on comm {} (one caller per communicator at a time)",
                    m.comm_name(c)
                )
            }
            Why::Message {
                key,
                dir,
                pos,
                bytes,
                missing,
                issued,
            } => {
                let (comm, src, dst) = key;
                let cname = m.comm_name(comm);
                let msg = m.state.channels.get(&key).map_or(0, |c| c.delivered);
                let lead = if pos == 0 {
                    format!(
                        "started; message #{msg} of {src}→{dst} on comm {cname} completes only when both sides have started: "
                    )
                } else if b.rule == Rule::R5 {
                    format!(
                        "started; the channel's buffer (eager={}) has no room for {} more, so it waits for message #{msg} to be received: ",
                        m.setup.model.eager,
                        Size(bytes)
                    )
                } else if b.rule == Rule::R6 {
                    format!(
                        "started; the channel buffers nothing before its first message is received (R6: its connection is cold), so it waits for message #{msg} of {src}→{dst}: "
                    )
                } else {
                    format!(
                        "started; messages on a channel complete in order, so it waits for message #{msg} of {src}→{dst}: "
                    )
                };
                let _ = dir;
                let (who, peer) = if missing == Dir::Send {
                    (src, dst)
                } else {
                    (dst, src)
                };
                if issued {
                    format!("{lead}its {} has not started", missing.name())
                } else if never {
                    format!(
                        "{lead}no thread of rank {who} will ever issue the matching {} {} {peer} on comm {cname}",
                        missing.name(),
                        if missing == Dir::Send { "to" } else { "from" }
                    )
                } else {
                    format!(
                        "{lead}rank {who} has not issued the matching {} yet",
                        missing.name()
                    )
                }
            }
        }
    }
}

/// What a host call of one rank reads or changes, for telling which calls
/// of two threads of that rank commute ([`Machine::footprint`]). Objects
/// are the rank's own (two calls of different ranks are never compared).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Object {
    /// A stream: R1 order, a `sync` or `wait` target.
    Stream(StreamId),
    /// A communicator: R2 order, R11, channel positions, R3.
    Comm(CommId),
    /// An event (R9).
    Event(EventId),
    /// The notifications of a tag: an `await` takes one, a `notify` to
    /// one's own rank posts one.
    Tag(TagId),
    /// The notifications of a tag from one rank: two `await`s may take the
    /// same one.
    Inbox(Rank, TagId),
    /// Every stream of the rank: a `sync` of them all and a thread's end
    /// drain what was issued before them.
    Streams,
    /// The rank's kernel slots, under a bound (R10 serves launches in
    /// issue order).
    Slots,
}

/// How a call uses an [`Object`]. Two uses of one object conflict unless
/// both are the same shared kind: two launches both *issue* onto the
/// rank's streams and commute, a launch and a drain of them do not.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    /// Changes it: conflicts with every other use.
    Write,
    /// Posts a notification (shared with other posts).
    Post,
    /// Takes a notification (shared with other takes of other senders).
    Take,
    /// Puts work on the rank's streams (shared with other issues).
    Issue,
    /// Waits for the rank's streams to drain (shared with other drains).
    Drain,
    /// The host reads a buffer (shared with other host reads). Not used
    /// by the machine's calls: for a backend's own accesses.
    HostRead,
    /// A device op reads a buffer (shared with other device reads). As
    /// [`Mode::HostRead`], for a backend.
    DeviceRead,
}

impl Mode {
    /// Whether two uses of one object conflict (their order matters).
    pub fn conflicts(self, other: Mode) -> bool {
        self == Mode::Write || self != other
    }
}

impl Machine {
    /// What call `call` of a thread of some rank uses: two calls of two
    /// threads of one rank commute ([`Machine::commute`]) unless they use
    /// one object in conflicting modes. Launches use their streams and
    /// communicators, and issue onto the rank's streams (and, under a
    /// kernel bound, take its slots); `record`/`wait` use their stream and
    /// event and issue; a `sync` of one stream uses it, a `sync` of every
    /// stream drains them all; `await` takes from its tag and its sender's
    /// inbox; `notify` posts to its tag; `join` and a thread's end use
    /// nothing (the end's drain is seen by nothing but the run's end: a
    /// `join` waits for the end, not the drain).
    pub fn footprint(&self, call: &HostCall) -> SmallVec<[(Object, Mode); 4]> {
        use HostCall::*;
        let mut f: SmallVec<[(Object, Mode); 4]> = SmallVec::new();
        match call {
            Launch(spec) => {
                for o in &spec.ops {
                    for x in [Object::Stream(o.stream), Object::Comm(o.comm)] {
                        if !f.iter().any(|(y, _)| *y == x) {
                            f.push((x, Mode::Write));
                        }
                    }
                }
                f.push((Object::Streams, Mode::Issue));
                if self.setup.model.kernels.is_some() {
                    f.push((Object::Slots, Mode::Write));
                }
            }
            Record { event, stream, .. } | Wait { event, stream, .. } => {
                f.push((Object::Stream(*stream), Mode::Write));
                f.push((Object::Event(*event), Mode::Write));
                f.push((Object::Streams, Mode::Issue));
            }
            Sync {
                stream: Some(s), ..
            } => f.push((Object::Stream(*s), Mode::Write)),
            Sync { stream: None, .. } => f.push((Object::Streams, Mode::Drain)),
            // Its drain is seen by nothing but the run's end (a `join`
            // waits for the end, not the drain), and a stuck state stays
            // stuck whichever launches it waits for.
            End => {}
            Await { from, tag, .. } => {
                f.push((Object::Tag(*tag), Mode::Take));
                f.push((Object::Inbox(*from, *tag), Mode::Write));
            }
            Notify { tag, .. } => f.push((Object::Tag(*tag), Mode::Post)),
            Join { .. } => {}
        }
        f
    }

    /// Whether calls `a` and `b` of two different host threads of one rank
    /// commute (either order reaches the same state) and neither disables
    /// the other: what the checker's reduction needs to explore only one
    /// order. They do not when they use one object of
    /// [`Machine::footprint`] in conflicting modes: a common stream (R1
    /// order, a `sync` or `wait` target), a common communicator (R2 order,
    /// R11, channel positions, R3), a common event (R9), a message another
    /// may take (`await`) or that one posts to the other (`notify` to its
    /// own rank's `await` of the tag), a launch (or `record`, `wait`) and
    /// a `sync` of every stream (which drains what was issued before it),
    /// two launches under a kernel bound (R10 serves launches in issue
    /// order). `join` and a thread's end commute with everything.
    pub fn commute(&self, a: &HostCall, b: &HostCall) -> bool {
        let fb = self.footprint(b);
        !self
            .footprint(a)
            .iter()
            .any(|(x, m)| fb.iter().any(|(y, n)| x == y && m.conflicts(*n)))
    }

    /// The call thread `t` is making now: the launch of a handshake in
    /// progress, if it is in one.
    pub fn call_in_progress(&self, t: ThreadId) -> Option<HostCall> {
        match &self.state.threads[t.ix()].phase {
            Phase::Connecting { spec, .. } => Some(HostCall::Launch(spec.clone())),
            _ => None,
        }
    }
}

/// Runs a blocker function and says whether it found nothing.
pub(super) fn free(run: impl FnOnce(Visit<'_>) -> ControlFlow<()>) -> bool {
    run(&mut |_| ControlFlow::Break(())).is_continue()
}
