//! What every rank of one process has issued, shared between them (local
//! mode): it catches size and type mismatches before NCCL sees them, and it
//! replays the issued ops into the simulator's state machine when a deadline
//! expires, so that a real hang is reported with the model's wait-for cycle.
//!
//! The backend does not re-implement any rule: the analysis is
//! [`duplex::machine::Machine::stuck`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use duplex::report::{OpInfo, Stuck};

use crate::ctx::OpMeta;
use duplex::machine::{
    EventId, HostCall, LaunchSpec, Machine, Next, OpSpec, OriginInfo, Setup, Status, StreamId,
    ThreadId, Unknown,
};
use duplex::{DType, Dir, Error, Model, Rank};

/// One op as the registry knows it.
#[derive(Clone, Debug)]
pub struct OpRec {
    /// Send or recv.
    pub dir: Dir,
    /// Peer rank.
    pub peer: Rank,
    /// Bytes.
    pub bytes: u64,
    /// Element type.
    pub dtype: DType,
    /// Logical communicator.
    pub comm: u32,
    /// Stream number in the registry.
    pub stream: u32,
}

/// What a host thread is blocked in; the last field is the call's text
/// and place.
#[derive(Clone, Debug)]
pub enum Blocked {
    /// `sync_stream` (one stream) or `synchronize` (`None`).
    Sync(Option<u32>, (String, String)),
    /// `await_notify(from, tag)`.
    Await(Rank, String, (String, String)),
    /// `join` of a thread.
    Join(usize, (String, String)),
}

#[derive(Debug)]
enum Call {
    Launch {
        ops: Vec<OpRec>,
        grouped: bool,
        metas: Vec<OpMeta>,
    },
    Record {
        event: u32,
        stream: u32,
    },
    Wait {
        event: u32,
        stream: u32,
    },
}

#[derive(Debug, Default)]
struct Reg {
    /// Name, members, and whether it was connected at creation.
    comms: Vec<(String, Vec<Rank>, bool)>,
    streams: Vec<(Rank, String)>,
    events: Vec<Rank>,
    threads: Vec<(Rank, String)>,
    /// Threads whose code has returned: they will issue nothing more.
    ended: Vec<usize>,
    calls: Vec<(usize, Call)>,
    blocked: HashMap<usize, Blocked>,
    /// (comm, src, dst) → sends and recvs issued, with their descriptions.
    channels: HashMap<ChannelKey, (Vec<Side>, Vec<Side>)>,
    user_comms: Vec<(String, Vec<Rank>)>,
}

/// (communicator, source rank, destination rank).
type ChannelKey = (u32, Rank, Rank);

/// A launch as a rank reports it to the registry.
#[derive(Debug)]
pub(crate) struct LaunchRec<'a> {
    /// The registry's number of the issuing thread.
    pub(crate) thread: usize,
    /// The issuing rank.
    pub(crate) rank: Rank,
    /// Its ops.
    pub(crate) ops: &'a [OpRec],
    /// Their descriptions; the registry sets their FIFO positions.
    pub(crate) metas: &'a mut [OpMeta],
    /// Issued as a group.
    pub(crate) grouped: bool,
}

#[derive(Clone, Debug)]
struct Side {
    bytes: u64,
    dtype: DType,
    grouped: bool,
    meta: OpMeta,
}

/// The registry of one local run.
#[derive(Debug)]
pub struct Registry {
    ranks: u32,
    model: Model,
    inner: Mutex<Reg>,
}

impl Registry {
    /// A registry for `ranks` ranks whose hangs are analysed under `model`.
    pub fn new(ranks: u32, model: Model) -> Arc<Registry> {
        Arc::new(Registry {
            ranks,
            model,
            inner: Mutex::new(Reg::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Reg> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Declares communicator `logical` (every rank declares the same ones);
    /// `warm` when it was connected at creation, so that R6 and R7 never
    /// apply to it.
    pub fn comm(&self, logical: u32, name: &str, members: &[Rank], warm: bool) {
        let mut r = self.lock();
        let i = logical as usize;
        if r.comms.len() <= i {
            r.comms.resize(i + 1, (String::new(), Vec::new(), true));
        }
        r.comms[i] = (name.to_string(), members.to_vec(), warm);
    }

    /// Sends or recvs that no op of the other side ever matched: at the end
    /// of a run that otherwise completed, a send that completed into the
    /// channel's buffer (R5) and that nobody received.
    pub fn unmatched(&self) -> Vec<OpInfo> {
        let r = self.lock();
        let mut out = Vec::new();
        for (sends, recvs) in r.channels.values() {
            for side in sends
                .iter()
                .skip(recvs.len())
                .chain(recvs.iter().skip(sends.len()))
            {
                out.push(side.meta.info());
            }
        }
        out
    }

    /// Checks that the `k`-th user communicator is the same on every rank.
    pub fn user_comm(&self, k: usize, name: &str, members: &[Rank]) -> Result<(), String> {
        let mut r = self.lock();
        match r.user_comms.get(k) {
            Some((n, m)) if n == name && m == members => Ok(()),
            Some((n, m)) => Err(format!(
                "communicator #{k} is `{name}` over {members:?} here but `{n}` over {m:?} on another rank: every rank must create communicators in the same order"
            )),
            None => {
                r.user_comms.push((name.to_string(), members.to_vec()));
                Ok(())
            }
        }
    }

    /// Registers a stream; returns its number.
    pub fn stream(&self, rank: Rank, name: &str) -> u32 {
        let mut r = self.lock();
        r.streams.push((rank, name.to_string()));
        (r.streams.len() - 1) as u32
    }

    /// Registers an event; returns its number.
    pub fn event(&self, rank: Rank) -> u32 {
        let mut r = self.lock();
        r.events.push(rank);
        (r.events.len() - 1) as u32
    }

    /// Registers a host thread; returns its number.
    pub fn thread(&self, rank: Rank, name: &str) -> usize {
        let mut r = self.lock();
        r.threads.push((rank, name.to_string()));
        r.threads.len() - 1
    }

    /// Checks a launch against what the other side of each channel has
    /// issued (R3 size and type, R8 grouping) and records it. Nothing is
    /// recorded when it fails.
    pub(crate) fn launch(&self, l: LaunchRec<'_>) -> Result<(), Error> {
        let LaunchRec {
            thread,
            rank,
            ops,
            metas,
            grouped,
        } = l;
        let mut r = self.lock();
        // First check every op, then record them all.
        let mut positions: Vec<((ChannelKey, Dir), usize)> = Vec::new();
        for (op, meta) in ops.iter().zip(metas.iter_mut()) {
            let key = channel(rank, op);
            let (sends, recvs) = r
                .channels
                .get(&key)
                .map(|(s, v)| (s.len(), v.len()))
                .unwrap_or((0, 0));
            let offset = match positions.iter_mut().find(|(k, _)| *k == (key, op.dir)) {
                Some((_, n)) => n,
                None => {
                    positions.push(((key, op.dir), 0));
                    &mut positions.last_mut().expect("just pushed").1
                }
            };
            let (mine, theirs) = match op.dir {
                Dir::Send => (sends + *offset, r.channels.get(&key).map(|c| &c.1)),
                Dir::Recv => (recvs + *offset, r.channels.get(&key).map(|c| &c.0)),
            };
            *offset += 1;
            meta.fifo = mine as u32;
            if let Some(other) = theirs.and_then(|t| t.get(mine)) {
                let kind = if other.bytes != op.bytes {
                    Some("size-mismatch")
                } else if other.dtype != op.dtype {
                    Some("type-mismatch")
                } else if other.grouped != grouped {
                    Some("group-mismatch")
                } else {
                    None
                };
                if let Some(kind) = kind {
                    let this = meta.info();
                    let that = other.meta.info();
                    let (send, recv) = if op.dir == Dir::Send {
                        (this, that)
                    } else {
                        (that, this)
                    };
                    return Err(Error::Program {
                        kind,
                        message: format!(
                            "{send} is matched with {recv} ({}); duplex refused to launch it, since NCCL's behaviour is undefined",
                            match kind {
                                "size-mismatch" => "R3: their sizes differ",
                                "type-mismatch" => "R3: their element types differ",
                                _ => "R8: only one of them is in a group",
                            }
                        ),
                        ops: vec![send, recv],
                    });
                }
            }
        }
        for (op, meta) in ops.iter().zip(metas.iter()) {
            let key = channel(rank, op);
            let entry = r.channels.entry(key).or_default();
            let list = if op.dir == Dir::Send {
                &mut entry.0
            } else {
                &mut entry.1
            };
            list.push(Side {
                bytes: op.bytes,
                dtype: op.dtype,
                grouped,
                meta: meta.clone(),
            });
        }
        r.calls.push((
            thread,
            Call::Launch {
                ops: ops.to_vec(),
                grouped,
                metas: metas.to_vec(),
            },
        ));
        Ok(())
    }

    /// Records a `record` or `wait` of an event on a stream.
    pub fn event_call(&self, thread: usize, record: bool, event: u32, stream: u32) {
        let call = if record {
            Call::Record { event, stream }
        } else {
            Call::Wait { event, stream }
        };
        self.lock().calls.push((thread, call));
    }

    /// Marks a thread's code as returned: it issues nothing more, so a
    /// hang's report can say that a partner will never come.
    pub fn ended(&self, thread: usize) {
        let mut r = self.lock();
        if !r.ended.contains(&thread) {
            r.ended.push(thread);
        }
    }

    /// Marks a thread blocked (or not).
    pub fn blocked(&self, thread: usize, what: Option<Blocked>) {
        let mut r = self.lock();
        match what {
            Some(b) => r.blocked.insert(thread, b),
            None => r.blocked.remove(&thread),
        };
    }

    /// Replays what every rank issued into the state machine and explains
    /// the stuck state, if the model finds one.
    pub fn analyze(&self) -> Option<Stuck> {
        let r = self.lock();
        let mut setup = Setup::new(self.ranks, self.model);
        for (name, members, warm) in &r.comms {
            setup.add_comm(name.clone(), members.clone(), *warm);
        }
        for (rank, name) in &r.streams {
            setup.add_stream(*rank, name.clone());
        }
        for rank in &r.events {
            setup.add_event(*rank, "event");
        }
        for (rank, name) in &r.threads {
            setup.add_thread(*rank, name.clone());
        }
        let mut origins = Vec::new();
        for (_, call) in &r.calls {
            if let Call::Launch { metas, grouped, .. } = call {
                let texts: Vec<String> = metas.iter().map(OpMeta::text).collect();
                let text = if *grouped {
                    format!("group {{ {} }}", texts.join("; "))
                } else {
                    texts.join("; ")
                };
                let place = metas.first().map(OpMeta::place).unwrap_or_default();
                origins.push(setup.add_origin(OriginInfo {
                    text,
                    place,
                    line: None,
                }));
            }
        }
        let mut next: HashMap<ThreadId, HostCall> = HashMap::new();
        let mut blocked_calls = Vec::new();
        for (t, b) in &r.blocked {
            let (text, place) = match b {
                Blocked::Sync(_, w) | Blocked::Await(_, _, w) | Blocked::Join(_, w) => w.clone(),
            };
            let origin = setup.add_origin(OriginInfo {
                text,
                place,
                line: None,
            });
            let call = match b {
                Blocked::Sync(s, _) => HostCall::Sync {
                    stream: s.map(StreamId),
                    origin,
                },
                Blocked::Await(from, tag, _) => HostCall::Await {
                    from: *from,
                    tag: setup.tag(tag),
                    origin,
                },
                Blocked::Join(u, _) => HostCall::Join {
                    thread: ThreadId(*u as u32),
                    origin,
                },
            };
            blocked_calls.push((ThreadId(*t as u32), call));
        }
        let mut m = Machine::new(Arc::new(setup));
        let mut o = origins.into_iter();
        for (t, call) in &r.calls {
            let t = ThreadId(*t as u32);
            let hc = match call {
                Call::Launch { ops, grouped, .. } => HostCall::Launch(LaunchSpec {
                    ops: ops
                        .iter()
                        .map(|op| OpSpec {
                            dir: op.dir,
                            peer: op.peer,
                            bytes: op.bytes,
                            dtype: op.dtype,
                            comm: duplex::machine::CommId(op.comm),
                            stream: StreamId(op.stream),
                        })
                        .collect(),
                    grouped: *grouped,
                    origin: o.next().unwrap_or(duplex::machine::Origin(0)),
                }),
                Call::Record { event, stream } => HostCall::Record {
                    event: EventId(*event),
                    stream: StreamId(*stream),
                    origin: duplex::machine::Origin(0),
                },
                Call::Wait { event, stream } => HostCall::Wait {
                    event: EventId(*event),
                    stream: StreamId(*stream),
                    origin: duplex::machine::Origin(0),
                },
            };
            // A call that waited for a connection handshake (R7) returns
            // once the other side has issued its own first op.
            while m.next(t) == Next::Resume {
                if m.resume(t).is_err() {
                    return None;
                }
            }
            if m.enabled(t, &hc) && m.apply(t, hc).is_err() {
                return None;
            }
        }
        for i in 0..r.threads.len() {
            let t = ThreadId(i as u32);
            while m.next(t) == Next::Resume {
                if m.resume(t).is_err() {
                    return None;
                }
            }
        }
        for t in &r.ended {
            let t = ThreadId(*t as u32);
            while m.next(t) == Next::Resume {
                if m.resume(t).is_err() {
                    return None;
                }
            }
            if m.enabled(t, &HostCall::End) && m.apply(t, HostCall::End).is_err() {
                return None;
            }
        }
        for (t, call) in blocked_calls {
            match call {
                HostCall::Sync { .. } => {
                    if m.enabled(t, &call) && m.apply(t, call).is_err() {
                        return None;
                    }
                }
                other => {
                    next.insert(t, other);
                }
            }
        }
        let lookup = |t: ThreadId| next.get(&t).cloned();
        let threads = Unknown(&lookup);
        match m.status(&threads) {
            Status::Stuck => Some(m.stuck(&threads)),
            Status::Running | Status::Finished => None,
        }
    }
}

fn channel(rank: Rank, op: &OpRec) -> ChannelKey {
    match op.dir {
        Dir::Send => (op.comm, rank, op.peer),
        Dir::Recv => (op.comm, op.peer, rank),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(rank: Rank, dir: Dir, peer: Rank) -> OpRec {
        OpRec {
            dir,
            peer,
            bytes: 128 << 20,
            dtype: DType::U32,
            comm: 1,
            stream: rank,
        }
    }

    /// A send that no rank receives, once the other rank's code has
    /// returned: the report names the missing partner (seen on the H200s
    /// without `ended`: a hang whose report named nothing).
    #[test]
    fn a_send_whose_receiver_has_ended_is_reported_as_missing_its_partner() {
        let reg = Registry::new(2, Model::default());
        reg.comm(0, "world", &[0, 1], true);
        reg.comm(1, "lane:0->1", &[0, 1], true);
        let s0 = reg.stream(0, "lane:0->1");
        let s1 = reg.stream(1, "lane:0->1");
        assert_eq!((s0, s1), (0, 1));
        let (t0, t1) = (reg.thread(0, "main"), reg.thread(1, "main"));
        let mut calls = reg.lock();
        calls.calls.push((
            t0,
            Call::Launch {
                ops: vec![meta(0, Dir::Send, 1)],
                grouped: false,
                metas: Vec::new(),
            },
        ));
        drop(calls);
        reg.blocked(
            t0,
            Some(Blocked::Sync(
                None,
                ("synchronize".into(), "x.rs:1:1".into()),
            )),
        );
        // While rank 1 may still issue the recv, the report cannot blame anyone.
        let open = reg.analyze().expect("stuck");
        assert!(open.missing.is_empty());
        reg.ended(t1);
        let stuck = reg.analyze().expect("stuck");
        assert_eq!(stuck.missing.len(), 1, "{stuck}");
        assert!(
            stuck.missing[0]
                .waits_for
                .contains("no thread of rank 1 will ever issue the matching recv"),
            "{stuck}"
        );
    }
}
