//! What ranks issued, in order, with placement: the [`Trace`] every backend
//! produces and the state machine replays.
//!
//! A backend records each host call as it makes it (the communicator, the
//! stream, the sizes; where in the user's code), which threads have
//! returned, and the call each blocked thread is inside. [`Trace::analyze`]
//! replays the calls through the [`Machine`] under a model and explains the
//! state they lead to: the same analysis as `duplex check`, applied to what
//! really happened. Every call the model refuses (one it says could not have
//! been made yet, or that it rejects as a program error) is kept as a
//! [`Disagreement`], never dropped: it means the model and the hardware
//! disagree, which is what calibration is for.
//!
//! In one process the calls are in real issue order. Across processes each
//! rank records its own ([`Trace::merge`] joins them). The replay keeps
//! each rank's order and needs no order between ranks, since host steps of
//! different ranks commute (the checker's reduction rests on the same
//! fact): at each step it makes the first unreplayed call of some rank
//! that the model allows, preferring the earliest recorded.
//!
//! A real backend records the `sync`s it is blocked in, not those that
//! returned, so that eager capacity (R5) the analysis model does not grant
//! cannot make the replay refuse calls that followed them.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::machine::{
    CommId, EventId, HostCall, LaunchSpec, Machine, OpSpec, Origin, OriginInfo, Rank, Setup,
    Status, StreamId, ThreadId, Threads, Unknown,
};
use crate::report::{OpInfo, OpState, Stuck};
use crate::{DType, Dir, Model};

/// A communicator as a trace declares it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceComm {
    /// Its name (`world`, `lane:0->1`, a user's name).
    pub name: String,
    /// Member ranks.
    pub members: Vec<Rank>,
    /// Connected at creation: R6 and R7 never apply to it.
    pub warm: bool,
    /// A copy-engine lane ([`crate::machine::CommInfo::copy`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub copy: bool,
}

impl TraceComm {
    /// A placeholder for a communicator this part of a trace has not
    /// declared (a lane another rank made on first use): no name, no
    /// members. [`Trace::merge`] takes the declaration from a part that has
    /// it.
    pub fn is_undeclared(&self) -> bool {
        self.name.is_empty() && self.members.is_empty()
    }
}

/// A host thread, stream or event: the rank it belongs to and its name.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owned {
    /// The rank.
    pub rank: Rank,
    /// The name.
    pub name: String,
}

/// One point-to-point op of a launch, with its placement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceOp {
    /// Send or recv.
    pub dir: Dir,
    /// The other rank.
    pub peer: Rank,
    /// Bytes.
    pub bytes: u64,
    /// Element type.
    pub dtype: DType,
    /// The communicator (index into [`Trace::comms`]).
    pub comm: u32,
    /// The stream (index into [`Trace::streams`]).
    pub stream: u32,
}

/// A host call of a trace. Indices name the trace's own declarations.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Call {
    /// `send`/`recv` or a group.
    Launch {
        /// The ops, in issue order. An `Arc`, as the texts of
        /// [`TraceCall`]: the NCCL backend records the same few launches
        /// millions of times and shares their ops, so that recording one
        /// allocates nothing.
        ops: Arc<[TraceOp]>,
        /// Issued between group start and group end.
        grouped: bool,
    },
    /// `record` of an event on a stream.
    Record {
        /// The event.
        event: u32,
        /// The stream.
        stream: u32,
    },
    /// `wait` for an event on a stream.
    Wait {
        /// The event.
        event: u32,
        /// The stream.
        stream: u32,
    },
    /// A host `sync` of one stream, or of every stream of the rank.
    Sync {
        /// The stream; `None` for all.
        stream: Option<u32>,
    },
    /// A host-to-host message.
    Notify {
        /// The receiving rank.
        to: Rank,
        /// The tag.
        tag: String,
    },
    /// Taking a host-to-host message.
    Await {
        /// The sending rank.
        from: Rank,
        /// The tag.
        tag: String,
    },
    /// Waiting for another host thread of the rank to end.
    Join {
        /// The thread.
        thread: u32,
    },
    /// The thread's code returned (it then waits for its rank's streams to
    /// drain, as a real program's final synchronize).
    End,
}

/// A call, who made it and where.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceCall {
    /// The thread (index into [`Trace::threads`]).
    pub thread: u32,
    /// The call.
    pub call: Call,
    /// The call as the user wrote it (`send 1024 x f32 to rank 1`).
    /// An `Arc`: the NCCL backend's registry records the same few texts and
    /// places millions of times, and shares them.
    pub text: Arc<str>,
    /// Where (`src/main.rs:12:5`, `line 4`).
    pub place: Arc<str>,
}

/// What ranks issued. Build it with the `add_*` methods and
/// [`Trace::push`]; analyse it with [`Trace::analyze`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trace {
    /// Number of ranks.
    pub ranks: u32,
    /// Communicators.
    pub comms: Vec<TraceComm>,
    /// Host threads.
    pub threads: Vec<Owned>,
    /// Streams.
    pub streams: Vec<Owned>,
    /// Events.
    pub events: Vec<Owned>,
    /// Calls that were made (returned, or are blocked inside NCCL's
    /// connection handshake), in issue order.
    pub calls: Vec<TraceCall>,
    /// Threads whose code has returned: they issue nothing more (each also
    /// has a [`Call::End`] where it returned).
    pub ended: Vec<u32>,
    /// The host wait (a `sync`, `await` or `join`) each blocked thread is
    /// inside now: one per thread, or, for a call the model expresses as
    /// several (a split), its waits in order ([`Trace::block_in`]).
    pub blocked: Vec<TraceCall>,
    /// What each rank's calls before its cut left behind ([`Trace::cut`]),
    /// at most one per rank: a long run keeps these counts instead of
    /// those calls. Empty for a trace kept whole.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cuts: Vec<Cut>,
    /// The recording backend holds a launch back behind another thread's
    /// launch in its connection handshake when they share a stream or a
    /// copy-engine lane, not only a communicator as R11 does (duplex-nccl's
    /// `Handshakes::holds`): the replay then holds it back too, where it
    /// can (the replay's hold yields when nothing else moves). Off for a backend that holds only what R11
    /// holds (the simulator, [`Trace::from_calls`]), whose launches the
    /// replay must take in their recorded order.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub held_for_streams: bool,
}

/// What the calls of one rank before its trace's cut left behind
/// ([`Trace::cut`]): every op they launched had completed and every host
/// wait among them had returned, so a replay needs only these counts
/// ([`crate::machine::Settled`]), whatever the other ranks' cuts.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cut {
    /// The rank.
    pub rank: Rank,
    /// How many calls were folded into it.
    pub calls: u64,
    /// Per (communicator, peer): the sends issued to the peer.
    pub sent: Vec<(u32, Rank, u64)>,
    /// Per (communicator, peer): the sizes of the last sends to the peer
    /// (at most [`Cut::RECENT`], oldest first). A send completed before the
    /// cut may still sit in the channel's buffer (R5), unreceived, and take
    /// room there: the replay gives it its size.
    pub recent: Vec<(u32, Rank, Vec<u64>)>,
    /// Per (communicator, peer): the recvs issued from the peer.
    pub received: Vec<(u32, Rank, u64)>,
    /// R7, per (communicator, peer): the setup rounds entered toward it.
    pub rounds: Vec<(u32, Rank, u32)>,
    /// R7: the sides connected, (communicator, peer, direction).
    pub sides: Vec<(u32, Rank, Dir)>,
    /// Per (peer, tag): the `notify`s posted to it.
    pub notified: Vec<(Rank, String, u32)>,
    /// Per (peer, tag): the `await`s that consumed one of its.
    pub awaited: Vec<(Rank, String, u32)>,
}

impl Cut {
    /// How many send sizes a cut keeps per channel ([`Cut::recent`]).
    pub const RECENT: usize = 64;

    /// Every channel the cut names, `(communicator, peer)`, as often as it
    /// names it (what [`Trace::check_ids`] and [`Trace::merge`] check).
    fn channels(&self) -> impl Iterator<Item = (u32, Rank)> + '_ {
        self.sent
            .iter()
            .chain(&self.received)
            .map(|&(c, peer, _)| (c, peer))
            .chain(self.rounds.iter().map(|&(c, peer, _)| (c, peer)))
            .chain(self.recent.iter().map(|(c, peer, _)| (*c, *peer)))
            .chain(self.sides.iter().map(|&(c, peer, _)| (c, peer)))
    }
}

/// The value of `(a, b)` in a list of `(a, b, value)` kept sorted by
/// `(a, b)`, inserted as `V::default()` if it is not there.
fn entry<A: Ord, B: Ord, V: Default>(list: &mut Vec<(A, B, V)>, a: A, b: B) -> &mut V {
    let i = match list.binary_search_by(|(x, y, _)| (x, y).cmp(&(&a, &b))) {
        Ok(i) => i,
        Err(i) => {
            list.insert(i, (a, b, V::default()));
            i
        }
    };
    &mut list[i].2
}

/// Adds one to the count of `(a, b)` in a list kept sorted by it.
fn bump<A: Ord, B: Ord, N: Default + std::ops::AddAssign + From<u8>>(
    list: &mut Vec<(A, B, N)>,
    a: A,
    b: B,
) {
    *entry(list, a, b) += N::from(1);
}

/// A call the model refused while replaying a trace: the model and the
/// backend disagree.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Disagreement {
    /// The rank that made the call.
    pub rank: Rank,
    /// Its thread.
    pub thread: String,
    /// The call.
    pub call: String,
    /// Where.
    pub place: String,
    /// Why the model refused it.
    pub why: String,
}

impl std::fmt::Display for Disagreement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rank {} {}: `{}` ({}) was made, but the model refuses it: {}",
            self.rank, self.thread, self.call, self.place, self.why
        )
    }
}

/// A host call of a replay, at its step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostSpan {
    /// The rank.
    pub rank: Rank,
    /// The thread.
    pub thread: String,
    /// The call as the user wrote it.
    pub call: String,
    /// Where.
    pub place: String,
    /// The step it was made at (from 0).
    pub step: usize,
}

/// A device op of a replay: when it was issued, started and completed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpSpan {
    /// The op as a report shows it (its last state).
    pub op: crate::report::OpInfo,
    /// The step it was issued at.
    pub issued: usize,
    /// The step at which it was first seen started, if it was.
    pub started: Option<usize>,
    /// The step at which it completed, if it did.
    pub completed: Option<usize>,
}

/// What happened when, step by step, in a replay: for pictures (a
/// Perfetto trace) of an execution.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    /// Host calls, in the order made.
    pub calls: Vec<HostSpan>,
    /// Device ops, in the order issued.
    pub ops: Vec<OpSpan>,
    /// Steps in all.
    pub steps: usize,
    /// The explanation of the state it ends in, when stuck.
    pub stuck: Option<Stuck>,
}

/// What a replay found.
#[derive(Clone, Debug)]
pub struct Analysis {
    /// The explanation of the state the trace leads to, when it is stuck.
    pub stuck: Option<Stuck>,
    /// Whether every thread has finished in the model.
    pub finished: bool,
    /// Calls the model refused, in the order found.
    pub disagreements: Vec<Disagreement>,
    /// Connection setup rounds of the replay that NCCL makes from the
    /// wrong data (R7, [`crate::machine::Mismatch`]), in words, whether or
    /// not the replay is stuck: what explains an NCCL error or a crash
    /// after such a round.
    pub mismatched_setups: Vec<String>,
    /// The first program error the replay met (a size, type or group
    /// mismatch, R3 and R8), which the model refuses to go past: NCCL may
    /// answer it with an error of its own (across processes no rank sees
    /// the other's op before both are launched).
    pub program_error: Option<crate::machine::ProgramError>,
}

/// What the ranks of a trace issued on one channel `(comm, from, to)`:
/// the sends `from` issued on it and the recvs `to` issued on it
/// ([`Trace::channel_counts`]). Once every rank of a job has finished with
/// every op complete, a channel whose sends outnumber its recvs carried
/// messages that NCCL completed into its buffer (R5) and nobody took: the
/// machine's `never-received` error at the end of a run
/// ([`crate::machine::Machine::leftover`]), here counted from what really
/// happened, whatever the model says of the waits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelCount {
    /// The communicator (index into [`Trace::comms`]).
    pub comm: u32,
    /// The sender.
    pub from: Rank,
    /// The receiver.
    pub to: Rank,
    /// Sends `from` issued on it.
    pub sent: u64,
    /// Recvs `to` issued on it.
    pub received: u64,
}

impl Trace {
    /// An empty trace of `ranks` ranks.
    pub fn new(ranks: u32) -> Trace {
        Trace {
            ranks,
            ..Trace::default()
        }
    }

    /// Declares a communicator; returns its index.
    pub fn add_comm(&mut self, name: &str, members: &[Rank], warm: bool) -> u32 {
        self.comms.push(TraceComm {
            name: name.to_string(),
            members: members.to_vec(),
            warm,
            copy: false,
        });
        (self.comms.len() - 1) as u32
    }

    /// Declares a copy-engine lane; returns its index.
    pub fn add_copy_lane(&mut self, name: &str, members: &[Rank]) -> u32 {
        let i = self.add_comm(name, members, true);
        self.comms[i as usize].copy = true;
        i
    }

    /// Declares a host thread; returns its index.
    pub fn add_thread(&mut self, rank: Rank, name: &str) -> u32 {
        push(&mut self.threads, rank, name)
    }

    /// Declares a stream; returns its index.
    pub fn add_stream(&mut self, rank: Rank, name: &str) -> u32 {
        push(&mut self.streams, rank, name)
    }

    /// Declares an event; returns its index.
    pub fn add_event(&mut self, rank: Rank, name: &str) -> u32 {
        push(&mut self.events, rank, name)
    }

    /// Records a call that was made.
    pub fn push(&mut self, call: TraceCall) {
        self.calls.push(call);
    }

    /// Marks a thread's code as returned, at this point of the calls.
    pub fn end(&mut self, thread: u32) {
        if !self.ended.contains(&thread) {
            self.ended.push(thread);
            self.calls.push(TraceCall {
                thread,
                call: Call::End,
                text: "end of thread".into(),
                place: "its implicit final synchronize".into(),
            });
        }
    }

    /// Sets (or, with `None`, clears) the wait `thread` is blocked in.
    pub fn block(&mut self, thread: u32, wait: Option<TraceCall>) {
        self.block_in(thread, wait.into_iter().collect());
    }

    /// Sets the waits `thread` is blocked in: one call that the model
    /// expresses as several (a split: an `await` of each other rank), in
    /// order. The analysis makes those the model lets through and finds
    /// the thread blocked at the first it does not.
    pub fn block_in(&mut self, thread: u32, waits: Vec<TraceCall>) {
        self.blocked.retain(|b| b.thread != thread);
        self.blocked.extend(waits);
    }

    /// Folds the first `upto` calls into the cuts of their ranks
    /// ([`Cut`]), so that a long run's trace keeps only the calls since;
    /// a thread's end ([`Call::End`]) stays, so that a replay knows it
    /// ended. The caller must cut only where every op those calls launched
    /// has completed, and no thread is blocked inside one of them (the
    /// NCCL backend cuts a rank's trace when its ledger has nothing pending
    /// and no thread of it waits, under its issue lock): the replay then
    /// starts from the counts the cuts keep ([`Machine::settle_from`]),
    /// and a wait for an event recorded before the cut waits for nothing,
    /// as for an event recorded and completed. Returns how many calls were
    /// folded.
    pub fn cut(&mut self, upto: usize) -> usize {
        let upto = upto.min(self.calls.len());
        let mut kept = Vec::new();
        let mut folded = 0;
        for c in self.calls.drain(..upto) {
            let Some(rank) = self.threads.get(c.thread as usize).map(|t| t.rank) else {
                continue;
            };
            if matches!(c.call, Call::End) {
                kept.push(c);
                continue;
            }
            folded += 1;
            let i = match self.cuts.iter().position(|k| k.rank == rank) {
                Some(i) => i,
                None => {
                    self.cuts.push(Cut {
                        rank,
                        ..Cut::default()
                    });
                    self.cuts.len() - 1
                }
            };
            let comms = &self.comms;
            let cut = &mut self.cuts[i];
            cut.calls += 1;
            match &c.call {
                Call::Launch { ops, .. } => {
                    let specs: Vec<OpSpec> = ops.iter().map(TraceOp::spec).collect();
                    let warm = |c: CommId| comms.get(c.0 as usize).is_none_or(|k| k.warm);
                    let mut sides: crate::machine::Sides = cut
                        .sides
                        .iter()
                        .map(|&(c, p, d)| (CommId(c), rank, p, d))
                        .collect();
                    let new = crate::machine::new_sides_of(warm, &sides, rank, &specs);
                    if !new.is_empty() {
                        for (c, p) in &new {
                            bump(&mut cut.rounds, c.0, *p);
                        }
                        crate::machine::connect_sides_of(warm, &mut sides, rank, &specs);
                        cut.sides = sides.into_iter().map(|(c, _, p, d)| (c.0, p, d)).collect();
                    }
                    for o in ops.iter() {
                        match o.dir {
                            Dir::Send => {
                                bump(&mut cut.sent, o.comm, o.peer);
                                let sizes = entry(&mut cut.recent, o.comm, o.peer);
                                if sizes.len() == Cut::RECENT {
                                    sizes.remove(0);
                                }
                                sizes.push(o.bytes);
                            }
                            Dir::Recv => bump(&mut cut.received, o.comm, o.peer),
                        }
                    }
                }
                Call::Notify { to, tag } => bump(&mut cut.notified, *to, tag.clone()),
                Call::Await { from, tag } => bump(&mut cut.awaited, *from, tag.clone()),
                Call::Record { .. }
                | Call::Wait { .. }
                | Call::Sync { .. }
                | Call::Join { .. }
                | Call::End => {}
            }
        }
        kept.append(&mut self.calls);
        self.calls = kept;
        folded
    }

    /// What this trace's calls and cuts issued on each channel, sorted by
    /// channel ([`ChannelCount`]). A trace of one rank counts only that
    /// rank's side of a channel to another rank.
    pub fn channel_counts(&self) -> Vec<ChannelCount> {
        let mut out: BTreeMap<(u32, Rank, Rank), (u64, u64)> = BTreeMap::new();
        for cut in &self.cuts {
            for &(c, peer, n) in &cut.sent {
                out.entry((c, cut.rank, peer)).or_default().0 += n;
            }
            for &(c, peer, n) in &cut.received {
                out.entry((c, peer, cut.rank)).or_default().1 += n;
            }
        }
        for (thread, _, op) in self.launched_ops() {
            let (key, side) = op.channel_of(thread.rank);
            let count = out.entry(key).or_default();
            match side {
                Dir::Send => count.0 += 1,
                Dir::Recv => count.1 += 1,
            }
        }
        out.into_iter()
            .map(|((comm, from, to), (sent, received))| ChannelCount {
                comm,
                from,
                to,
                sent,
                received,
            })
            .collect()
    }

    /// The sends `from` issued to `to` on `comm` among this trace's calls
    /// alone (not its cuts).
    pub fn sends_in_calls(&self, comm: u32, from: Rank, to: Rank) -> u64 {
        self.launched_ops()
            .filter(|(t, _, op)| op.channel_of(t.rank) == ((comm, from, to), Dir::Send))
            .count() as u64
    }

    /// Every op of this trace's launches, in call order: the thread that
    /// launched it, the call, and the op.
    fn launched_ops(&self) -> impl DoubleEndedIterator<Item = (&Owned, &TraceCall, &TraceOp)> {
        self.calls.iter().flat_map(move |call| {
            let ops: &[TraceOp] = match &call.call {
                Call::Launch { ops, .. } => ops,
                _ => &[],
            };
            let thread = self.threads.get(call.thread as usize);
            ops.iter().filter_map(move |op| Some((thread?, call, op)))
        })
    }

    /// The name of communicator `comm`, or its number when undeclared.
    fn comm_name(&self, comm: u32) -> String {
        self.comms
            .get(comm as usize)
            .map_or_else(|| format!("#{comm}"), |c| c.name.clone())
    }

    /// The `k`-th last send of `from` to `to` on `comm` among this trace's
    /// calls, described as message `fifo` of its channel, with its buffered
    /// state: `None` when the trace has fewer such sends (a cut folded it).
    pub fn last_sends(&self, comm: u32, from: Rank, to: Rank, k: u64, fifo: u64) -> Option<OpInfo> {
        let n = usize::try_from(k.checked_sub(1)?).ok()?;
        let (thread, call, op) = self
            .launched_ops()
            .rev()
            .filter(|(t, _, op)| op.channel_of(t.rank) == ((comm, from, to), Dir::Send))
            .nth(n)?;
        let grouped = matches!(call.call, Call::Launch { grouped: true, .. });
        Some(OpInfo {
            thread: thread.name.clone(),
            stream: self
                .streams
                .get(op.stream as usize)
                .map_or_else(|| format!("#{}", op.stream), |s| s.name.clone()),
            grouped,
            call: call.text.to_string(),
            at: call.place.to_string(),
            ..self.folded_send(comm, from, to, Some((op.bytes, op.dtype)), fifo, "")
        })
    }

    /// A send of `from` to `to` on `comm` whose call this trace no longer
    /// holds, described from what is known of it: message `fifo` of its
    /// channel, completed into the channel's buffer (R5), its size and
    /// element type when known (`None`: 0 bytes of `u8`), and `folded`,
    /// where its call went, as its place.
    pub fn folded_send(
        &self,
        comm: u32,
        from: Rank,
        to: Rank,
        size: Option<(u64, DType)>,
        fifo: u64,
        folded: &str,
    ) -> OpInfo {
        let (bytes, dtype) = size.unwrap_or((0, DType::U8));
        OpInfo {
            rank: from,
            thread: String::new(),
            op: Dir::Send,
            peer: to,
            bytes,
            dtype,
            comm: self.comm_name(comm),
            stream: String::new(),
            fifo,
            state: OpState::Buffered,
            grouped: false,
            call: match size {
                Some((b, _)) => format!("send {} to rank {to}", crate::Size(b)),
                None => format!("send to rank {to}"),
            },
            at: folded.to_string(),
            line: None,
        }
    }

    /// Every index in the trace names a declaration: each call's thread,
    /// streams, events and communicators, each ended thread, and each
    /// cut's rank, communicators and peers. A trace that comes from
    /// another process is checked before anything indexes by it (the
    /// replay, [`Trace::merge`]); the first index that names nothing is
    /// the error.
    pub fn check_ids(&self) -> Result<(), Disagreement> {
        let t = self;
        // A disagreement of the trace as a whole, not of one call.
        let whole = |why: String| Disagreement {
            rank: 0,
            thread: String::new(),
            call: String::new(),
            place: String::new(),
            why,
        };
        let decl = |what: &str, rank: Rank| Disagreement {
            rank,
            ..whole(format!(
                "{what} belongs to rank {rank}, but there are {} ranks",
                t.ranks
            ))
        };
        for (what, list) in [
            ("a thread", &t.threads),
            ("a stream", &t.streams),
            ("an event", &t.events),
        ] {
            if let Some(o) = list.iter().find(|o| o.rank >= t.ranks) {
                return Err(decl(what, o.rank));
            }
        }
        if let Some(r) = t
            .comms
            .iter()
            .flat_map(|c| &c.members)
            .find(|r| **r >= t.ranks)
        {
            return Err(decl("a communicator member", *r));
        }
        let bad = |c: &TraceCall, why: String| Disagreement {
            rank: t.threads.get(c.thread as usize).map_or(0, |x| x.rank),
            thread: t
                .threads
                .get(c.thread as usize)
                .map_or_else(|| format!("#{}", c.thread), |x| x.name.clone()),
            call: c.text.to_string(),
            place: c.place.to_string(),
            why,
        };
        for c in t.calls.iter().chain(&t.blocked) {
            if c.thread as usize >= t.threads.len() {
                return Err(bad(c, format!("thread #{} was never declared", c.thread)));
            }
            let streams = match &c.call {
                Call::Launch { ops, .. } => {
                    if let Some(o) = ops.iter().find(|o| o.comm as usize >= t.comms.len()) {
                        return Err(bad(
                            c,
                            format!("communicator #{} was never declared", o.comm),
                        ));
                    }
                    ops.iter().map(|o| o.stream).collect()
                }
                Call::Record { event, stream } | Call::Wait { event, stream } => {
                    if *event as usize >= t.events.len() {
                        return Err(bad(c, format!("event #{event} was never declared")));
                    }
                    vec![*stream]
                }
                Call::Sync { stream } => stream.iter().copied().collect(),
                Call::Join { thread } => {
                    if *thread as usize >= t.threads.len() {
                        return Err(bad(c, format!("thread #{thread} was never declared")));
                    }
                    vec![]
                }
                Call::Notify { .. } | Call::Await { .. } | Call::End => vec![],
            };
            if let Some(s) = streams.iter().find(|s| **s as usize >= t.streams.len()) {
                return Err(bad(c, format!("stream #{s} was never declared")));
            }
        }
        if let Some(e) = t.ended.iter().find(|e| **e as usize >= t.threads.len()) {
            return Err(whole(format!(
                "thread #{e} ended, but it was never declared"
            )));
        }
        for cut in &t.cuts {
            if cut.rank >= t.ranks {
                return Err(decl("a cut", cut.rank));
            }
            let mut peers = cut.notified.iter().chain(&cut.awaited).map(|(r, ..)| *r);
            for (c, peer) in cut.channels() {
                if c as usize >= t.comms.len() || peer >= t.ranks {
                    return Err(whole(format!(
                        "rank {}'s cut names communicator #{c} and peer {peer}, which do not exist",
                        cut.rank
                    )));
                }
            }
            if let Some(r) = peers.find(|r| *r >= t.ranks) {
                return Err(whole(format!(
                    "rank {}'s cut names rank {r} in a notify or await, which does not exist",
                    cut.rank
                )));
            }
        }
        Ok(())
    }

    /// The ranks this trace holds anything of: a thread or a cut.
    fn present(&self) -> std::collections::BTreeSet<Rank> {
        self.threads
            .iter()
            .map(|t| t.rank)
            .chain(self.cuts.iter().map(|c| c.rank))
            .collect()
    }

    /// The trace as one process per rank records it: one part per rank,
    /// each with that rank's threads, streams, events, calls, waits and
    /// cut, renumbered from 0 ([`Trace::merge`] joins them again). For
    /// tests of the cross-process analysis; the NCCL backend records each
    /// rank's part itself.
    pub fn parts(&self) -> Vec<Trace> {
        (0..self.ranks).map(|rank| self.part(rank)).collect()
    }

    /// Rank `rank`'s part ([`Trace::parts`]).
    fn part(&self, rank: Rank) -> Trace {
        let mut part = Trace::new(self.ranks);
        part.comms = self.comms.clone();
        // Every process of the backend records under its hold.
        part.held_for_streams = self.held_for_streams;
        let renumber = |list: &[Owned], part: &mut Vec<Owned>| {
            let mut map = HashMap::new();
            for (i, o) in list.iter().enumerate() {
                if o.rank == rank {
                    map.insert(i as u32, part.len() as u32);
                    part.push(o.clone());
                }
            }
            map
        };
        let threads = renumber(&self.threads, &mut part.threads);
        let streams = renumber(&self.streams, &mut part.streams);
        let events = renumber(&self.events, &mut part.events);
        // An id this trace never declared (check_ids refuses it) maps to
        // one past the part's, which the part's check refuses too.
        let map = |m: &HashMap<u32, u32>, x: u32| m.get(&x).copied().unwrap_or(u32::MAX);
        let renamed = |c: &TraceCall| -> Option<TraceCall> {
            let thread = *threads.get(&c.thread)?;
            let mut c = c.clone();
            c.thread = thread;
            match &mut c.call {
                Call::Launch { ops, .. } => {
                    *ops = ops
                        .iter()
                        .map(|&o| TraceOp {
                            stream: map(&streams, o.stream),
                            ..o
                        })
                        .collect();
                }
                Call::Record { event, stream } | Call::Wait { event, stream } => {
                    *event = map(&events, *event);
                    *stream = map(&streams, *stream);
                }
                Call::Sync { stream } => {
                    if let Some(s) = stream {
                        *s = map(&streams, *s);
                    }
                }
                Call::Join { thread } => *thread = map(&threads, *thread),
                Call::Notify { .. } | Call::Await { .. } | Call::End => {}
            }
            Some(c)
        };
        for c in self.calls.iter().filter_map(renamed) {
            if matches!(c.call, Call::End) {
                part.end(c.thread);
            } else {
                part.push(c);
            }
        }
        // A thread ended with no End call (a trace built by hand).
        for t in self.ended.iter().filter_map(|t| threads.get(t)) {
            part.end(*t);
        }
        part.blocked = self.blocked.iter().filter_map(renamed).collect();
        part.cuts = self
            .cuts
            .iter()
            .filter(|c| c.rank == rank)
            .cloned()
            .collect();
        part
    }

    /// Joins the traces of the ranks of one job (one per process): threads,
    /// streams and events are renumbered; communicator `k` must be the same
    /// in every part that declares it. A part may leave some undeclared
    /// (shorter, or a placeholder, [`TraceComm::is_undeclared`]): a lane
    /// made on first use is declared only by the ranks that made it, and a
    /// rank that returned early made none. Each part's calls keep their
    /// order.
    pub fn merge(parts: &[Trace]) -> Result<Trace, String> {
        let Some(first) = parts.first() else {
            return Ok(Trace::default());
        };
        let mut out = Trace::new(first.ranks);
        let mut owners: std::collections::BTreeMap<Rank, usize> = Default::default();
        for (i, part) in parts.iter().enumerate() {
            out.held_for_streams |= part.held_for_streams;
            if part.ranks != first.ranks {
                return Err(format!(
                    "trace part {i} has {} ranks, part 0 has {}",
                    part.ranks, first.ranks
                ));
            }
            for (k, c) in part.comms.iter().enumerate() {
                if k == out.comms.len() {
                    out.comms.push(c.clone());
                } else if out.comms[k].is_undeclared() {
                    out.comms[k] = c.clone();
                } else if !c.is_undeclared() && *c != out.comms[k] {
                    return Err(format!(
                        "trace part {i} declares communicator #{k} as {} of ranks {:?}, an earlier part as {} of ranks {:?}: every rank must create communicators in the same order",
                        c.name, c.members, out.comms[k].name, out.comms[k].members
                    ));
                }
            }
            // Each part is input from another process: its ids are checked
            // before they are renumbered (which would otherwise overflow,
            // or move a bad id onto another part's thread).
            if let Err(d) = part.check_ids() {
                return Err(format!("trace part {i}: {}", d.why));
            }
            // Each part is one process's, one rank's: a rank in two parts,
            // or a part of two ranks, would replay as a job that never ran
            // (found by review: it was accepted, and its analysis said
            // "this is a bug").
            if parts.len() > 1 {
                let mut mine = part
                    .threads
                    .iter()
                    .map(|t| t.rank)
                    .chain(part.cuts.iter().map(|c| c.rank));
                if let Some(rank) = mine.next() {
                    if let Some(other) = mine.find(|r| *r != rank) {
                        return Err(format!(
                            "trace part {i} holds ranks {rank} and {other}: each part must be one rank's, from its own process"
                        ));
                    }
                    if let Some(j) = owners.insert(rank, i) {
                        return Err(format!(
                            "trace parts {j} and {i} are both rank {rank}'s: each rank's trace must come from one process"
                        ));
                    }
                }
            }
            let (t0, s0, e0) = (
                out.threads.len() as u32,
                out.streams.len() as u32,
                out.events.len() as u32,
            );
            out.threads.extend(part.threads.iter().cloned());
            out.streams.extend(part.streams.iter().cloned());
            out.events.extend(part.events.iter().cloned());
            let shift = |c: &TraceCall| {
                let mut c = c.clone();
                c.thread += t0;
                match &mut c.call {
                    Call::Launch { ops, .. } => {
                        *ops = ops
                            .iter()
                            .map(|&o| TraceOp {
                                stream: o.stream + s0,
                                ..o
                            })
                            .collect();
                    }
                    Call::Record { event, stream } | Call::Wait { event, stream } => {
                        *event += e0;
                        *stream += s0;
                    }
                    Call::Sync { stream } => {
                        if let Some(s) = stream {
                            *s += s0;
                        }
                    }
                    Call::Join { thread } => *thread += t0,
                    Call::Notify { .. } | Call::Await { .. } | Call::End => {}
                }
                c
            };
            out.calls.extend(part.calls.iter().map(shift));
            out.blocked.extend(part.blocked.iter().map(shift));
            out.ended.extend(part.ended.iter().map(|t| t + t0));
            for cut in &part.cuts {
                if out.cuts.iter().any(|c| c.rank == cut.rank) {
                    return Err(format!(
                        "trace part {i} has a cut of rank {}, which another part has too: each rank's trace must come from one process",
                        cut.rank
                    ));
                }
                out.cuts.push(cut.clone());
            }
        }
        // A communicator no part declared is a placeholder whatever flags
        // its parts gave it (the result does not depend on their order, and
        // a part cannot make it a copy lane), and nothing may use it: an op
        // on it would be charged to its rank as a program error.
        for c in out.comms.iter_mut().filter(|c| c.is_undeclared()) {
            c.warm = true;
            c.copy = false;
        }
        let undeclared = |k: u32| {
            out.comms
                .get(k as usize)
                .is_some_and(TraceComm::is_undeclared)
        };
        for call in out.calls.iter().chain(&out.blocked) {
            if let Call::Launch { ops, .. } = &call.call
                && let Some(o) = ops.iter().find(|o| undeclared(o.comm))
            {
                return Err(format!(
                    "`{}` ({}) is on communicator #{}, which no rank's trace declares",
                    call.text, call.place, o.comm
                ));
            }
        }
        for cut in &out.cuts {
            if let Some((c, _)) = cut.channels().find(|(c, _)| undeclared(*c)) {
                return Err(format!(
                    "rank {}'s cut counts messages on communicator #{c}, which no rank's trace declares",
                    cut.rank
                ));
            }
        }
        Ok(out)
    }

    /// The trace of calls made on a machine of `setup`, in the order made:
    /// what a backend that drives the machine itself (the simulator)
    /// records. [`HostCall::End`] marks its thread as ended.
    pub fn from_calls<'c>(
        setup: &Setup,
        calls: impl IntoIterator<Item = (ThreadId, &'c HostCall)>,
    ) -> Trace {
        let mut t = Trace::new(setup.ranks);
        for c in &setup.comms {
            if c.copy {
                t.add_copy_lane(&c.name, &c.members);
            } else {
                t.add_comm(&c.name, &c.members, c.warm);
            }
        }
        for x in &setup.threads {
            t.add_thread(x.rank, &x.name);
        }
        for x in &setup.streams {
            t.add_stream(x.rank, &x.name);
        }
        for x in &setup.events {
            t.add_event(x.rank, &x.name);
        }
        for (thread, call) in calls {
            let origin = |o: &Origin| setup.origins.get(o.0 as usize);
            let (call, o) = match call {
                HostCall::End => {
                    t.end(thread.0);
                    continue;
                }
                HostCall::Launch(spec) => (
                    Call::Launch {
                        ops: spec
                            .ops
                            .iter()
                            .map(|o| TraceOp {
                                dir: o.dir,
                                peer: o.peer,
                                bytes: o.bytes,
                                dtype: o.dtype,
                                comm: o.comm.0,
                                stream: o.stream.0,
                            })
                            .collect(),
                        grouped: spec.grouped,
                    },
                    origin(&spec.origin),
                ),
                HostCall::Record {
                    event,
                    stream,
                    origin: o,
                } => (
                    Call::Record {
                        event: event.0,
                        stream: stream.0,
                    },
                    origin(o),
                ),
                HostCall::Wait {
                    event,
                    stream,
                    origin: o,
                } => (
                    Call::Wait {
                        event: event.0,
                        stream: stream.0,
                    },
                    origin(o),
                ),
                HostCall::Sync { stream, origin: o } => (
                    Call::Sync {
                        stream: stream.map(|s| s.0),
                    },
                    origin(o),
                ),
                HostCall::Notify { to, tag, origin: o } => (
                    Call::Notify {
                        to: *to,
                        tag: setup.tags.get(tag.0 as usize).cloned().unwrap_or_default(),
                    },
                    origin(o),
                ),
                HostCall::Await {
                    from,
                    tag,
                    origin: o,
                } => (
                    Call::Await {
                        from: *from,
                        tag: setup.tags.get(tag.0 as usize).cloned().unwrap_or_default(),
                    },
                    origin(o),
                ),
                HostCall::Join { thread, origin: o } => {
                    (Call::Join { thread: thread.0 }, origin(o))
                }
            };
            t.push(TraceCall {
                thread: thread.0,
                call,
                text: o.map_or_else(|| "".into(), |o| o.text.clone()),
                place: o.map(|o| o.place()).unwrap_or_default().into(),
            });
        }
        t
    }

    /// Replays the calls under `model` and records when each host call was
    /// made and when each device op was issued, started and completed.
    pub fn timeline(&self, model: Model) -> Timeline {
        let mut r = Replayer::new(self, model);
        if r.check_ids().is_err() {
            return Timeline::default();
        }
        r.timeline = Some(Timeline::default());
        r.m.record_changed_launches();
        r.run();
        // A handshake that finished with the last call enqueued its ops.
        let step = r.timeline.as_ref().map_or(0, |t| t.steps);
        r.resume_all();
        r.record(step, None);
        let mut t = r.timeline.take().unwrap_or_default();
        let a = r.finish();
        t.stuck = a.stuck;
        t
    }

    /// Replays the calls under `model` and explains where they lead.
    pub fn analyze(&self, model: Model) -> Analysis {
        self.analyze_replay(Replayer::new(self, model))
    }

    /// [`Trace::analyze`] from `base`: a machine (under its own model) that
    /// has applied every call made before this trace's, which a long run
    /// keeps instead of those calls (`duplex-nccl`'s registry compacts its
    /// trace this way).
    pub fn analyze_from(&self, base: &Machine) -> Analysis {
        self.analyze_replay(Replayer::from_base(self, base.clone()))
    }

    fn analyze_replay(&self, mut r: Replayer<'_>) -> Analysis {
        if let Err(d) = r.check_ids() {
            return Analysis {
                stuck: None,
                finished: false,
                disagreements: vec![d],
                mismatched_setups: Vec::new(),
                program_error: None,
            };
        }
        r.run();
        r.finish()
    }
}

fn push(list: &mut Vec<Owned>, rank: Rank, name: &str) -> u32 {
    list.push(Owned {
        rank,
        name: name.to_string(),
    });
    (list.len() - 1) as u32
}

/// What the cuts of `trace` left behind, in the machine's terms (tags
/// interned in `setup`). Cuts come from other processes: a count listed
/// twice adds up without overflowing ([`Machine::settle_from`] refuses
/// counts no run reaches).
fn settled_of(trace: &Trace, setup: &mut Setup) -> crate::machine::Settled {
    let mut out = crate::machine::Settled::default();
    // The ranks this trace holds anything of. A channel to a rank it does
    // not (its trace did not come: a rank that died, most often) is left
    // unsettled: one side's count alone read as that many messages never
    // matched, and past `MAX_GHOSTS` (a million messages, an ordinary long
    // run) refused the replay (found by review).
    let present = trace.present();
    for cut in &trace.cuts {
        let me = cut.rank;
        for &(c, peer, n) in cut.sent.iter().filter(|(_, p, _)| present.contains(p)) {
            let e = &mut out.channels.entry((CommId(c), me, peer)).or_default().0;
            *e = e.saturating_add(n);
        }
        for &(c, peer, n) in cut.received.iter().filter(|(_, p, _)| present.contains(p)) {
            let e = &mut out.channels.entry((CommId(c), peer, me)).or_default().1;
            *e = e.saturating_add(n);
        }
        for (c, peer, sizes) in &cut.recent {
            out.recent.insert((CommId(*c), me, *peer), sizes.clone());
        }
        for &(c, peer, n) in &cut.rounds {
            out.rounds.insert((CommId(c), me, peer), n);
        }
        for &(c, peer, d) in &cut.sides {
            out.sides.insert((CommId(c), me, peer, d));
        }
        for (to, tag, n) in &cut.notified {
            let e = &mut out.mail.entry((me, *to, setup.tag(tag))).or_default().0;
            *e = e.saturating_add(*n);
        }
        for (from, tag, n) in &cut.awaited {
            let e = &mut out.mail.entry((*from, me, setup.tag(tag))).or_default().1;
            *e = e.saturating_add(*n);
        }
    }
    out
}

/// The replay of one trace.
struct Replayer<'t> {
    trace: &'t Trace,
    m: Machine,
    /// Each rank's calls not yet replayed (indices into `trace.calls`).
    queues: Vec<VecDeque<usize>>,
    /// Per thread: its last call replayed, if that was a launch that
    /// waited in its connection handshake (R7). With no wait after it
    /// (`Trace::blocked`), the thread may still be inside it.
    shook: Vec<Option<usize>>,
    /// The threads whose handshake has finished in the replay and that
    /// have not returned from it yet, in the order their handshakes
    /// finished ([`Replayer::note_ready`]).
    ready: VecDeque<(ThreadId, u64)>,
    /// Per thread, whether it is in [`Replayer::ready`].
    in_ready: Vec<bool>,
    /// Per thread, its calls not yet replayed.
    left: Vec<usize>,
    /// Threads whose return from a handshake met a program error.
    failed: std::collections::HashSet<ThreadId>,
    /// How many calls and returns the replay has made: the moment each
    /// thread in [`Replayer::ready`] joined it.
    steps: u64,
    /// Threads some of whose calls were given up ([`Replayer::drop_queue`]).
    unreplayed: std::collections::HashSet<ThreadId>,
    /// The machine's call for each trace call.
    calls: Vec<HostCall>,
    disagreements: Vec<Disagreement>,
    /// The first program error met (also a disagreement).
    program_error: Option<crate::machine::ProgramError>,
    /// The blocked waits, as machine calls: per thread, in order (a call
    /// the model expresses as several, a split, has several).
    waits: HashMap<ThreadId, Vec<HostCall>>,
    /// When recording: what happened at each step.
    timeline: Option<Timeline>,
    /// When recording: per live launch, its ops' indices in the timeline.
    seen: HashMap<crate::machine::LaunchRef, Vec<usize>>,
}

impl<'t> Replayer<'t> {
    fn new(trace: &'t Trace, model: Model) -> Replayer<'t> {
        Replayer::from_base(
            trace,
            Machine::new(Arc::new(Setup::new(trace.ranks, model))),
        )
    }

    /// A replay of `trace`'s calls from `base`, a machine that has applied
    /// the calls made before them; the trace declares everything `base`
    /// knows and what was declared since.
    fn from_base(trace: &'t Trace, mut m: Machine) -> Replayer<'t> {
        let setup = m.setup_mut();
        for (i, c) in trace.comms.iter().enumerate() {
            match setup.comms.get_mut(i) {
                // A communicator declared before may have been named since.
                Some(known) => {
                    known.name.clone_from(&c.name);
                    known.members.clone_from(&c.members);
                    known.warm = c.warm;
                    known.copy = c.copy;
                }
                None if c.copy => {
                    setup.add_copy_lane(c.name.clone(), c.members.clone());
                }
                None => {
                    setup.add_comm(c.name.clone(), c.members.clone(), c.warm);
                }
            }
        }
        for t in trace.threads.iter().skip(setup.threads.len()) {
            setup.add_thread(t.rank, t.name.clone());
        }
        for s in trace.streams.iter().skip(setup.streams.len()) {
            setup.add_stream(s.rank, s.name.clone());
        }
        for e in trace.events.iter().skip(setup.events.len()) {
            setup.add_event(e.rank, e.name.clone());
        }
        let calls: Vec<HostCall> = trace.calls.iter().map(|c| c.to_host(setup)).collect();
        let mut waits: HashMap<ThreadId, Vec<HostCall>> = HashMap::new();
        for c in &trace.blocked {
            waits
                .entry(ThreadId(c.thread))
                .or_default()
                .push(c.to_host(setup));
        }
        m.sync_setup();
        let mut disagreements = Vec::new();
        if !trace.cuts.is_empty() {
            let settled = settled_of(trace, m.setup_mut());
            if let Err(why) = m.settle_from(&settled) {
                disagreements.push(Disagreement {
                    rank: trace.cuts[0].rank,
                    thread: String::new(),
                    call: "the calls before the trace's cut".into(),
                    place: String::new(),
                    why,
                });
            }
        }
        let mut queues = vec![VecDeque::new(); trace.ranks as usize];
        let mut left = vec![0; trace.threads.len()];
        for (i, c) in trace.calls.iter().enumerate() {
            let rank = trace.threads.get(c.thread as usize).map(|t| t.rank);
            if let Some(q) = rank.and_then(|r| queues.get_mut(r as usize)) {
                q.push_back(i);
                left[c.thread as usize] += 1;
            }
        }
        Replayer {
            trace,
            m,
            queues,
            shook: vec![None; trace.threads.len()],
            ready: VecDeque::new(),
            in_ready: vec![false; trace.threads.len()],
            steps: 0,
            left,
            failed: Default::default(),
            unreplayed: Default::default(),
            calls,
            disagreements,
            program_error: None,
            waits,
            timeline: None,
            seen: HashMap::new(),
        }
    }

    /// After step `step`: the ops that appeared, started or completed.
    fn record(&mut self, step: usize, call: Option<usize>) {
        let Some(t) = self.timeline.as_mut() else {
            return;
        };
        if let Some(i) = call {
            let c = &self.trace.calls[i];
            let th = &self.trace.threads[c.thread as usize];
            t.calls.push(HostSpan {
                rank: th.rank,
                thread: th.name.clone(),
                call: c.text.to_string(),
                place: c.place.to_string(),
                step,
            });
        }
        t.steps = step + 1;
        // Only the launches the step touched can have changed; an op's
        // view changes only in its state.
        for lref in self.m.take_changed_launches() {
            let Some(n) = self.m.launch_ops(lref) else {
                // Completed since the last step (one that came and went
                // within a step was never seen, and is not recorded).
                for k in self.seen.remove(&lref).unwrap_or_default() {
                    let span = &mut t.ops[k];
                    span.started.get_or_insert(step);
                    if span.completed.is_none() {
                        span.completed = Some(step);
                        span.op.state = crate::report::OpState::Done;
                    }
                }
                continue;
            };
            let spans = self.seen.entry(lref).or_insert_with(|| {
                (0..n)
                    .filter_map(|i| {
                        let op = crate::machine::OpRef {
                            launch: lref,
                            index: i as u16,
                        };
                        let info = self.m.describe_op(op)?;
                        t.ops.push(OpSpan {
                            op: info,
                            issued: step,
                            started: None,
                            completed: None,
                        });
                        Some(t.ops.len() - 1)
                    })
                    .collect()
            });
            for (i, &k) in spans.iter().enumerate() {
                let op = crate::machine::OpRef {
                    launch: lref,
                    index: i as u16,
                };
                let Some(state) = self.m.op_state(op) else {
                    continue;
                };
                let span = &mut t.ops[k];
                if span.started.is_none() && !matches!(state, crate::report::OpState::NotStarted) {
                    span.started = Some(step);
                }
                if span.completed.is_none() && state == crate::report::OpState::Done {
                    span.completed = Some(step);
                }
                span.op.state = state;
            }
        }
    }

    /// Every index in the trace names a declaration ([`Trace::check_ids`]).
    fn check_ids(&self) -> Result<(), Disagreement> {
        self.trace.check_ids()
    }

    /// Keeps `e` as the replay's program error: the first met, but a
    /// mismatch of two ops (what NCCL itself may answer) before an invalid
    /// call.
    fn met(&mut self, e: crate::machine::ProgramError) {
        let invalid = |e: &crate::machine::ProgramError| {
            matches!(e, crate::machine::ProgramError::Invalid { .. })
        };
        let replace = match &self.program_error {
            None => true,
            Some(kept) => invalid(kept) && !invalid(&e),
        };
        if replace {
            self.program_error = Some(e);
        }
    }

    /// Notes the threads whose handshake has finished since the last
    /// call ([`Replayer::ready`]).
    fn note_ready(&mut self) {
        self.steps += 1;
        // Cheap tests first: this runs after every call, for every thread
        // (a thread parked in `ready` was scanned for, `ready` for each,
        // at every call: calls × threads², 15 s for a million calls beside
        // 256 parked threads).
        for i in 0..self.shook.len() {
            let t = ThreadId(i as u32);
            if !self.in_ready[i]
                && self.m.in_handshake(t)
                && !self.failed.contains(&t)
                && self.m.next(t) == crate::machine::Next::Resume
            {
                self.in_ready[i] = true;
                self.ready.push_back((t, self.steps));
            }
        }
    }

    /// Returns thread `t` from its finished handshake ([`Machine::resume`]);
    /// a handshake that meets a program error refuses the thread.
    fn resume(&mut self, t: ThreadId) {
        self.ready.retain(|(u, _)| *u != t);
        self.in_ready[t.ix()] = false;
        while self.m.next(t) == crate::machine::Next::Resume {
            if let Err(e) = self.m.resume(t) {
                // Refused once: it stays in its handshake, never ready
                // again (it looped, refusing it over and over).
                self.failed.insert(t);
                self.refuse_thread(t, format!("the model finds a program error: {e}"));
                self.met(e);
                break;
            }
        }
        self.note_ready();
    }

    /// Returns thread `t`, which the trace shows returned, and first those
    /// whose handshakes finished before its own (not those that finished
    /// with it: which of those returned first is not known).
    fn returned(&mut self, t: ThreadId) {
        let Some(&(_, at)) = self.ready.iter().find(|(u, _)| *u == t) else {
            return;
        };
        while let Some(&(u, when)) = self.ready.front() {
            if when >= at {
                break;
            }
            self.resume(u);
        }
        self.resume(t);
    }

    /// Returns every thread from its finished handshake, in the order the
    /// handshakes finished.
    fn resume_all(&mut self) {
        self.note_ready();
        while let Some(&(t, _)) = self.ready.front() {
            self.resume(t);
        }
    }

    /// The ranks the trace holds nothing of (their parts did not come):
    /// not ranks that issue nothing ([`Unknown`]).
    fn absent(&self) -> Vec<Rank> {
        let present = self.trace.present();
        (0..self.trace.ranks)
            .filter(|r| !present.contains(r))
            .collect()
    }

    /// The thread that made call `i`.
    fn thread_of(&self, i: usize) -> ThreadId {
        ThreadId(self.trace.calls[i].thread)
    }

    /// Replays: at each step the first unreplayed call of a rank that the
    /// model allows, the earliest recorded first. What remains is refused.
    fn run(&mut self) {
        loop {
            // A thread returns from its finished handshake at once when the
            // trace shows a later call of it; otherwise only when nothing
            // else can move, the first finished first. The trace does not
            // say when a launch that waited in its handshake returned, and
            // its ops reach their streams only then (found by a property
            // over moments of runs that complete: returned at once with no
            // later call, a thread's group went on a stream before another
            // thread's `sync` of it that the run had made first, and the
            // sync was refused; returned only at its next call, a thread's
            // recv went on its stream behind another thread's later `wait`).
            let mut moved = false;
            while let Some(&(t, _)) = self.ready.iter().find(|(t, _)| self.left[t.ix()] > 0) {
                self.resume(t);
                moved = true;
            }
            // The backend's hold (`held_back_by_a_handshake`) is a
            // preference, not a rule of the model, and only for a trace
            // recorded under it (`Trace::held_for_streams`): a trace of
            // another backend (the simulator, which holds only what R11
            // holds) may have let such a launch through, and its handshake
            // may finish only because of it (found by review: a completing
            // simulator run replayed as a deadlock), or the launch be
            // behind it on their stream (found by a property over moments
            // of runs: held, it went behind a later handshake's launch,
            // and a cycle was named that never was). So the hold yields
            // when nothing else can move.
            let pick_with = |hold: bool| {
                self.queues
                    .iter()
                    .enumerate()
                    .filter_map(|(r, q)| q.front().map(|i| (*i, r)))
                    .filter(|(i, _)| {
                        !(hold && self.trace.held_for_streams && self.held_back_by_a_handshake(*i))
                    })
                    .filter(|(i, _)| self.m.enabled(self.thread_of(*i), &self.calls[*i]))
                    .min()
            };
            let mut pick = pick_with(true);
            if pick.is_none() && !moved {
                // Only for a call still to replay: at the end, a thread
                // with no later call stays inside its launch (`finish`).
                let waiting = self.queues.iter().any(|q| !q.is_empty());
                if let Some(&(t, _)) = self.ready.front().filter(|_| waiting) {
                    self.resume(t);
                    continue;
                }
                pick = pick_with(false);
            }
            if let Some((i, r)) = pick {
                self.queues[r].pop_front();
                let t = self.thread_of(i);
                self.left[t.ix()] -= 1;
                if let Err(e) = self.m.apply(t, &self.calls[i]) {
                    self.refuse(i, format!("the model finds a program error: {e}"));
                    self.met(e);
                }
                self.shook[t.ix()] = self.m.in_handshake(t).then_some(i);
                self.note_ready();
                let step = self.timeline.as_ref().map_or(0, |t| t.steps);
                self.record(step, Some(i));
                moved = true;
            }
            if !moved {
                break;
            }
        }
        // What is left could not be replayed: say why for each rank's
        // first call left.
        let left: Vec<(usize, ThreadId)> = self
            .queues
            .iter()
            .filter_map(|q| q.front().map(|i| (*i, self.thread_of(*i))))
            .collect();
        if left.is_empty() {
            return;
        }
        let next: HashMap<ThreadId, HostCall> = left
            .iter()
            .map(|(i, t)| (*t, self.calls[*i].clone()))
            .collect();
        let lookup = |t: ThreadId| next.get(&t).cloned();
        let absent = self.absent();
        let stuck = self.m.stuck(&Unknown(&lookup, &absent));
        for (i, t) in left {
            let info = &self.m.setup().threads[t.0 as usize];
            let why = stuck
                .blocked
                .iter()
                .find(|b| b.rank == info.rank && b.thread == info.name)
                .map(|b| format!("in the model this thread is still blocked: {}", b.waits_for))
                .unwrap_or_else(|| "in the model this thread cannot make it yet".to_string());
            let rank = info.rank as usize;
            let n = self.queues[rank].len();
            let why = if n > 1 {
                format!("{why} ({} later calls of this rank not replayed)", n - 1)
            } else {
                why
            };
            self.refuse(i, why);
            self.drop_queue(rank);
        }
    }

    /// Whether call `i` is a launch the NCCL backend holds back: another
    /// thread of its rank has a launch in its connection handshake (R7)
    /// on one of its streams or communicators (duplex-nccl's
    /// `Handshakes::holds`, wider than R11, which holds back only the same
    /// communicator). The backend records such a launch once it is let
    /// go, so a rank's recorded order allows it; but the replay's order
    /// across ranks is a merge's (each rank's part in turn), and it would
    /// otherwise enqueue the launch behind the handshake on their shared
    /// stream and find a cycle that never was (found by review: the
    /// report depended on which rank analysed).
    fn held_back_by_a_handshake(&self, i: usize) -> bool {
        let HostCall::Launch(spec) = &self.calls[i] else {
            return false;
        };
        let t = self.thread_of(i);
        let setup = self.m.setup();
        let rank = setup.threads[t.ix()].rank;
        (0..setup.threads.len() as u32)
            .map(ThreadId)
            .filter(|o| *o != t && setup.threads[o.ix()].rank == rank)
            .filter_map(|o| self.m.handshake_launch(o))
            .any(|shaking| holds_back(shaking, spec, true))
    }

    fn refuse(&mut self, i: usize, why: String) {
        let c = &self.trace.calls[i];
        let info = &self.trace.threads[c.thread as usize];
        self.disagreements.push(Disagreement {
            rank: info.rank,
            thread: info.name.clone(),
            call: c.text.to_string(),
            place: c.place.to_string(),
            why,
        });
    }

    /// Gives up the rest of rank `rank`'s calls: their threads are not
    /// ended at the finish, since their code went on past what the replay
    /// took (found by the moments property: a thread ended although its
    /// later calls were not replayed issued nothing more, and a cycle was
    /// named through another thread of its rank).
    fn drop_queue(&mut self, rank: usize) {
        let Some(q) = self.queues.get_mut(rank) else {
            return;
        };
        let left: Vec<usize> = q.drain(..).collect();
        for i in left {
            let t = self.thread_of(i);
            self.unreplayed.insert(t);
        }
    }

    fn refuse_thread(&mut self, t: ThreadId, why: String) {
        let info = &self.trace.threads[t.0 as usize];
        self.disagreements.push(Disagreement {
            rank: info.rank,
            thread: info.name.clone(),
            call: "(a call blocked in its connection handshake)".into(),
            place: String::new(),
            why,
        });
        self.drop_queue(info.rank as usize);
    }

    /// The threads of `t`'s rank that may still be inside a launch that
    /// holds back `t`'s launch `spec` ([`Replayer::shook`]).
    fn may_hold(&self, t: ThreadId, spec: &LaunchSpec) -> Vec<ThreadId> {
        let setup = self.m.setup();
        let rank = setup.threads[t.ix()].rank;
        let waiting: std::collections::HashSet<u32> =
            self.trace.blocked.iter().map(|c| c.thread).collect();
        self.shook
            .iter()
            .enumerate()
            .filter(|(u, last)| {
                let Some(i) = last else {
                    return false;
                };
                let HostCall::Launch(theirs) = &self.calls[*i] else {
                    return false;
                };
                *u != t.ix()
                    && setup.threads[*u].rank == rank
                    && !waiting.contains(&(*u as u32))
                    && holds_back(theirs, spec, self.trace.held_for_streams)
            })
            .map(|(u, _)| ThreadId(u as u32))
            .collect()
    }

    fn held_back_disagrees(&mut self, t: ThreadId) {
        let info = &self.trace.threads[t.ix()];
        let held = self
            .trace
            .blocked
            .iter()
            .find(|c| c.thread == t.0 && matches!(c.call, Call::Launch { .. }));
        self.disagreements.push(Disagreement {
            rank: info.rank,
            thread: info.name.clone(),
            call: held.map_or_else(String::new, |c| c.text.to_string()),
            place: held.map_or_else(String::new, |c| c.place.to_string()),
            why: "the backend held this launch back, and the model lets it through: no other thread of its rank may still be inside a launch in its connection handshake on a communicator it shares (R11) or, where the backend holds for them too, a stream (the model saw every such handshake end, and a later call of each thread)".into(),
        });
    }

    /// The threads the trace shows neither ended nor blocked in a call:
    /// outside duplex (running their code, or blocked where duplex does
    /// not see it, which an early snapshot catches most). The machine,
    /// which has no call of theirs, shows them at their implicit final
    /// synchronize: said as what they are, and a hang with no cycle that
    /// ends at one is not called a bug of the analysis (found by review:
    /// "end of thread", and "this is a bug").
    fn outside_duplex(&self, stuck: &mut Stuck) {
        // Blocked in a call the trace records, whatever the replay made of
        // it (a launch the backend held back and the model lets through is
        // still a duplex call; found by review).
        let in_a_call: std::collections::HashSet<u32> =
            self.trace.blocked.iter().map(|c| c.thread).collect();
        let running: Vec<(Rank, String)> = (0..self.trace.threads.len())
            .filter(|t| {
                let t = *t as u32;
                !self.trace.ended.contains(&t) && !in_a_call.contains(&t)
            })
            .map(|t| {
                let info = &self.trace.threads[t];
                (info.rank, info.name.clone())
            })
            .collect();
        let mut named = Vec::new();
        for b in stuck.blocked.iter_mut() {
            if b.line.is_none()
                && b.call == "end of thread"
                && running.iter().any(|(r, n)| *r == b.rank && *n == b.thread)
            {
                b.call = "not inside a duplex call".into();
                b.at = "running its code, or blocked where duplex does not see it (its trace records no wait)".into();
                named.push(format!("rank {} {}", b.rank, b.thread));
            }
        }
        if stuck.cycle.is_empty()
            && stuck.missing.is_empty()
            && stuck.note.is_none()
            && !named.is_empty()
        {
            stuck.note = Some(format!(
                "no wait-for cycle among the calls duplex sees: what the others wait for may come from {}, not inside a duplex call (running its code, or blocked where duplex does not see it), so whether it ever comes is not known",
                named.join(", ")
            ));
        }
    }

    /// Ends the threads that returned, enters the blocked waits, and
    /// explains the state.
    fn finish(mut self) -> Analysis {
        // A thread in a wait, or ended, returned from its launch; one with
        // neither may still be inside it, and stays there: it can move, and
        // whether its ops reached their streams before those of another
        // thread's launch, on a stream they share, is not known (found by
        // the moments property: two handshakes that finished together,
        // returned in the threads' order, made a cycle the run's order did
        // not).
        let evident: Vec<ThreadId> = self
            .ready
            .iter()
            .map(|(t, _)| *t)
            .filter(|t| {
                self.waits.contains_key(t)
                    || (self.trace.ended.contains(&t.0) && !self.unreplayed.contains(t))
            })
            .collect();
        for t in evident {
            self.returned(t);
        }
        // Each blocked launch that another thread of its rank may still
        // hold back: that thread's last call is a launch that waited in its
        // handshake, on a communicator they share (R11) or, for a backend
        // that holds for them too, a stream (`Trace::held_for_streams`),
        // and the trace has it in no wait since. The replay resumes such a
        // launch once its handshake ends, but the backend lets the other
        // go only when its call returns, which the trace does not show
        // (found by a property over moments of runs that complete: the
        // hold was called a disagreement).
        let holders: HashMap<ThreadId, Vec<ThreadId>> = self
            .waits
            .iter()
            .filter_map(|(t, calls)| match calls.first() {
                Some(HostCall::Launch(spec)) => Some((*t, self.may_hold(*t, spec))),
                _ => None,
            })
            .filter(|(_, by)| !by.is_empty())
            .collect();
        // The held launches the model lets through, and whom they wait for
        // (none for a disagreement): the thread is in no call the model
        // can make, but its wait is known ([`Threads::held`]).
        let mut held: HashMap<ThreadId, (HostCall, Vec<ThreadId>)> = HashMap::new();
        for t in &self.trace.ended {
            let t = ThreadId(*t);
            if !self.unreplayed.contains(&t) && self.m.enabled(t, &HostCall::End) {
                // End is always valid; a leftover error shows at the end.
                let _ = self.m.apply(t, &HostCall::End);
            }
        }
        let mut next = HashMap::new();
        for (t, calls) in std::mem::take(&mut self.waits) {
            // A sync the model lets through is made (what it waits for
            // completed), and so is each await of a split but its last
            // whose rank has arrived; the thread is blocked at the first
            // wait it does not make. A split whose every rank arrived stays
            // at its last await, so that the report shows the split (and
            // that the model does not predict this hang), not the end of
            // the thread.
            let n = calls.len();
            for (i, call) in calls.into_iter().enumerate() {
                let through = match call {
                    HostCall::Sync { .. } => self.m.enabled(t, &call),
                    HostCall::Await { .. } => i + 1 < n && self.m.enabled(t, &call),
                    _ => false,
                };
                if through {
                    let _ = self.m.apply(t, &call);
                } else if matches!(call, HostCall::Launch(_)) && self.m.enabled(t, &call) {
                    // A launch a backend held back that the model lets
                    // through: the thread is left where the model cannot
                    // see it (it may still move), and it is said to
                    // disagree unless another thread may still hold it
                    // back (`held`, above).
                    let by = holders.get(&t).cloned().unwrap_or_default();
                    if by.is_empty() {
                        self.held_back_disagrees(t);
                    }
                    held.insert(t, (call, by));
                    break;
                } else {
                    next.insert(t, call);
                    break;
                }
            }
        }
        let lookup = |t: ThreadId| next.get(&t).cloned();
        let absent = self.absent();
        let threads = Held(Unknown(&lookup, &absent), &held);
        let status = self.m.status(&threads);
        // Threads that may still return from a finished handshake can
        // move, and nothing else can: a state to explain, as a stuck one.
        let returning: Vec<ThreadId> = self.ready.iter().map(|(t, _)| *t).collect();
        let explain = status == Status::Stuck
            || (status == Status::Running
                && self
                    .m
                    .runnable(&threads)
                    .iter()
                    .all(|t| returning.contains(t)));
        let stuck = explain.then(|| {
            let mut stuck = self.m.stuck(&threads);
            self.outside_duplex(&mut stuck);
            if stuck.cycle.is_empty() && stuck.missing.is_empty() && !returning.is_empty() {
                let names: Vec<String> = returning
                    .iter()
                    .map(|t| {
                        let info = &self.trace.threads[t.ix()];
                        format!("rank {} {}", info.rank, info.name)
                    })
                    .collect();
                let said = format!(
                    "{} may still be returning from a launch whose connection handshake the model finished (the trace shows no later call of it): what waits for its ops may still move",
                    names.join(", ")
                );
                add_note(&mut stuck, said);
            }
            if stuck.cycle.is_empty() && stuck.missing.is_empty() && !absent.is_empty() {
                let ranks: Vec<String> = absent.iter().map(|r| r.to_string()).collect();
                let said = format!(
                    "no wait-for cycle among the calls of the ranks whose traces are here: what they wait for may come from rank(s) {}, whose traces are not, so whether it ever comes is not known",
                    ranks.join(", ")
                );
                add_note(&mut stuck, said);
            }
            stuck
        });
        Analysis {
            stuck,
            finished: status == Status::Finished,
            disagreements: self.disagreements,
            mismatched_setups: self
                .m
                .mismatches()
                .map(|m| self.m.describe_mismatch(m))
                .collect(),
            program_error: self.program_error,
        }
    }
}

/// Whether a launch in its connection handshake, `theirs`, holds back
/// another thread's launch `mine`: they share a communicator (R11), or,
/// with `streams` (duplex-nccl's wider hold, `Trace::held_for_streams`), a
/// stream.
fn holds_back(theirs: &LaunchSpec, mine: &LaunchSpec, streams: bool) -> bool {
    theirs.ops.iter().any(|a| {
        mine.ops
            .iter()
            .any(|b| a.comm == b.comm || (streams && a.stream == b.stream))
    })
}

/// Adds `said` to the note of `stuck`, after what it says already.
fn add_note(stuck: &mut Stuck, said: String) {
    stuck.note = Some(match stuck.note.take() {
        Some(n) => format!("{n}; and {said}"),
        None => said,
    });
}

/// The replay's [`Threads`] at its end: [`Unknown`], and the launches a
/// backend held back that the model lets through, each with the threads
/// that hold it (none for a disagreement).
struct Held<'a>(
    Unknown<'a>,
    &'a HashMap<ThreadId, (HostCall, Vec<ThreadId>)>,
);

impl Threads for Held<'_> {
    fn next_call(&self, m: &Machine, t: ThreadId) -> Option<HostCall> {
        self.0.next_call(m, t)
    }
    fn may_issue(
        &self,
        m: &Machine,
        t: ThreadId,
        comm: CommId,
        dir: Option<Dir>,
        peer: Rank,
    ) -> bool {
        self.0.may_issue(m, t, comm, dir, peer)
    }
    fn may_notify(&self, m: &Machine, t: ThreadId, to: Rank, tag: crate::machine::TagId) -> bool {
        self.0.may_notify(m, t, to, tag)
    }
    fn absent(&self, rank: Rank) -> bool {
        self.0.absent(rank)
    }
    fn held(&self, _: &Machine, t: ThreadId) -> Option<(HostCall, Vec<ThreadId>)> {
        self.1.get(&t).cloned()
    }
}

impl TraceCall {
    /// The machine's call for this trace call, with its origin added to
    /// `setup` (its ids are the trace's own indices).
    pub fn to_host(&self, setup: &mut Setup) -> HostCall {
        let origin = setup.add_origin(OriginInfo::at(self.text.clone(), self.place.to_string()));
        host_call(setup, self, origin)
    }

    /// The machine's call for this trace call, at an origin already in
    /// `setup` (a backend that interns its call sites).
    pub fn to_host_at(&self, setup: &mut Setup, origin: Origin) -> HostCall {
        host_call(setup, self, origin)
    }
}

impl TraceOp {
    /// The channel `(communicator, sender, receiver)` of this op issued by
    /// `rank`, and its side of it.
    pub fn channel_of(&self, rank: Rank) -> ((u32, Rank, Rank), Dir) {
        match self.dir {
            Dir::Send => ((self.comm, rank, self.peer), Dir::Send),
            Dir::Recv => ((self.comm, self.peer, rank), Dir::Recv),
        }
    }

    /// The machine's op (ids are the trace's indices).
    pub fn spec(&self) -> OpSpec {
        OpSpec {
            dir: self.dir,
            peer: self.peer,
            bytes: self.bytes,
            dtype: self.dtype,
            comm: CommId(self.comm),
            stream: StreamId(self.stream),
            origin: None,
        }
    }
}

/// The machine's call for a trace call (ids are the trace's indices).
fn host_call(setup: &mut Setup, c: &TraceCall, origin: Origin) -> HostCall {
    match &c.call {
        Call::Launch { ops, grouped } => HostCall::Launch(LaunchSpec {
            ops: ops.iter().map(TraceOp::spec).collect(),
            grouped: *grouped,
            origin,
        }),
        Call::Record { event, stream } => HostCall::Record {
            event: EventId(*event),
            stream: StreamId(*stream),
            origin,
        },
        Call::Wait { event, stream } => HostCall::Wait {
            event: EventId(*event),
            stream: StreamId(*stream),
            origin,
        },
        Call::Sync { stream } => HostCall::Sync {
            stream: stream.map(StreamId),
            origin,
        },
        Call::Notify { to, tag } => HostCall::Notify {
            to: *to,
            tag: setup.tag(tag),
            origin,
        },
        Call::Await { from, tag } => HostCall::Await {
            from: *from,
            tag: setup.tag(tag),
            origin,
        },
        Call::Join { thread } => HostCall::Join {
            thread: ThreadId(*thread),
            origin,
        },
        Call::End => HostCall::End,
    }
}
