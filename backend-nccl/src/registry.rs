//! What the ranks of one process have issued: every rank in a local run,
//! shared between them; this process's rank in a process-per-rank run,
//! whose hang analysis joins the other processes' traces
//! ([`Registry::analyze_with`]). The registry holds no rule of its own: it records each call in a
//! [`Trace`] and applies it to a live [`Machine`], whose issue check (R3
//! sizes and types, R8 grouping) refuses a mismatch before NCCL sees it;
//! when a deadline expires, [`Registry::analyze`] replays the trace through
//! the machine ([`Trace::analyze`]) and explains the hang with the model's
//! wait-for cycle. Calls the model refuses are kept as disagreements
//! between the model and the GPU, and reported with the hang.

use std::sync::{Arc, Mutex};

use duplex::machine::{Machine, Next, Setup, ThreadId};
use duplex::report::{OpInfo, Stuck};
use duplex::trace::{Analysis, Call, Disagreement, Trace, TraceCall};
use duplex::{Error, Model, Rank};

use crate::ctx::OpMeta;

pub use duplex::trace::TraceOp as OpRec;

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

impl Blocked {
    fn trace_call(&self, thread: usize) -> TraceCall {
        let (call, (text, place)) = match self {
            Blocked::Sync(s, w) => (Call::Sync { stream: *s }, w),
            Blocked::Await(from, tag, w) => (
                Call::Await {
                    from: *from,
                    tag: tag.clone(),
                },
                w,
            ),
            Blocked::Join(u, w) => (Call::Join { thread: *u as u32 }, w),
        };
        TraceCall {
            thread: thread as u32,
            call,
            text: text.as_str().into(),
            place: place.as_str().into(),
        }
    }
}

/// A kind of launch's text, place and origin in the live machine.
type LaunchText = (Arc<str>, Arc<str>, Option<duplex::machine::Origin>);

#[derive(Debug)]
struct Reg {
    trace: Trace,
    /// The calls applied as they are made; `None` once the model refused
    /// one (the trace keeps everything; its replay reports the refusal).
    live: Option<Machine>,
    /// The live machine's origins, one per distinct call text and place, so
    /// that a long run does not grow them.
    origins: std::collections::HashMap<(String, String), duplex::machine::Origin>,
    /// The text, place and origin of each kind of launch (thread, call
    /// site, ops), so that a launch like an earlier one formats nothing:
    /// keyed by [`launch_key`]'s words; cleared when it grows large.
    launches: std::collections::HashMap<Vec<u64>, LaunchText>,
    /// The key of the launch being recorded (reused).
    key: Vec<u64>,
    user_comms: Vec<(String, Vec<Rank>)>,
    /// The live machine as it was when the trace was last compacted: it
    /// stands for every call made before the trace's (see
    /// [`Registry::local`]).
    base: Option<Machine>,
    /// Calls folded into `base` so far.
    folded: usize,
}

impl Reg {
    /// Folds the trace's calls into a copy of the live machine once they
    /// reach `at`, so that a long run keeps a bounded trace. Only while the
    /// live machine has applied every call (a refused call drops it, and
    /// the trace is then kept whole for its replay to report the
    /// refusal).
    fn compact(&mut self, at: usize) {
        if self.trace.calls.len() < at {
            return;
        }
        let Some(live) = &self.live else { return };
        self.base = Some(live.clone());
        self.folded += self.trace.calls.len();
        self.trace.calls.clear();
    }
}

impl Reg {
    /// The live machine's origin of a call with this text and place,
    /// interned.
    fn origin(&mut self, text: &str, place: &str) -> Option<duplex::machine::Origin> {
        let m = self.live.as_mut()?;
        let key = (text.to_string(), place.to_string());
        Some(match self.origins.get(&key) {
            Some(o) => *o,
            None => {
                let o = m
                    .setup_mut()
                    .add_origin(duplex::machine::OriginInfo::at(text, place));
                self.origins.insert(key, o);
                o
            }
        })
    }

    /// `call` as the live machine's call, at an interned origin (`origin`
    /// when the caller knows it).
    fn host_call(
        &mut self,
        call: &TraceCall,
        origin: Option<duplex::machine::Origin>,
    ) -> Option<duplex::machine::HostCall> {
        let origin = match origin {
            Some(o) => o,
            None => self.origin(&call.text, &call.place)?,
        };
        let m = self.live.as_mut()?;
        Some(call.to_host_at(m.setup_mut(), origin))
    }

    /// The live machine and `call` as its call, once the calling thread has
    /// finished any handshake the model lets it finish. `None` when there
    /// is no live machine any more, or when the model says the thread
    /// cannot make this call now: then the live machine is dropped, and the
    /// trace's replay reports the disagreement.
    fn live_call(
        &mut self,
        call: &TraceCall,
        origin: Option<duplex::machine::Origin>,
    ) -> Option<(&mut Machine, duplex::machine::HostCall)> {
        let hc = self.host_call(call, origin)?;
        let t = ThreadId(call.thread);
        let enabled = {
            let m = self.live.as_mut()?;
            while m.next(t) == Next::Resume {
                if m.resume(t).is_err() {
                    break;
                }
            }
            m.enabled(t, &hc)
        };
        if !enabled {
            self.live = None;
            return None;
        }
        Some((self.live.as_mut()?, hc))
    }
}

/// The words that tell one kind of launch from another in the registry's
/// text cache: the thread, whether grouped, the first op's call site, and
/// each op's direction, type, peer and count (what its text says).
fn launch_key(key: &mut Vec<u64>, thread: usize, metas: &[&OpMeta], grouped: bool) {
    key.clear();
    key.extend([thread as u64, u64::from(grouped)]);
    if let Some(m) = metas.first() {
        key.push(std::ptr::from_ref(m.at) as usize as u64);
        // The site's text (a schedule's `line N`), hashed: two sites whose
        // hashes collide would share a place text in reports, nothing else.
        let site = m.site.as_deref().map_or(0, |s| {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            s.hash(&mut h);
            h.finish() | 1
        });
        key.push(site);
    }
    for m in metas {
        key.extend([
            (m.dir as u64) | ((m.dtype as u64) << 8),
            u64::from(m.peer),
            m.count as u64,
        ]);
    }
}

/// A launch as a rank reports it to the registry.
#[derive(Debug)]
pub(crate) struct LaunchRec<'a> {
    /// The registry's number of the issuing thread.
    pub(crate) thread: usize,
    /// Its ops.
    pub(crate) ops: Vec<OpRec>,
    /// Their descriptions.
    pub(crate) metas: &'a [&'a OpMeta],
    /// Where the registry writes their FIFO positions.
    pub(crate) fifos: &'a mut [u32],
    /// Issued as a group.
    pub(crate) grouped: bool,
}

/// The registry of one local run.
#[derive(Debug)]
pub struct Registry {
    model: Model,
    inner: Mutex<Reg>,
    /// Compact the trace once it holds this many calls ([`Registry::local`]);
    /// `usize::MAX` keeps it whole.
    compact_at: usize,
}

/// How many calls a local run's trace holds before it is folded into a
/// snapshot of the live machine (about 10 MiB of calls).
const COMPACT_AT: usize = 1 << 16;

/// A hang's analysis: the model's explanation, and the calls it refused.
#[derive(Clone, Debug)]
pub struct HangAnalysis {
    /// The stuck state, when the model finds one.
    pub stuck: Option<Stuck>,
    /// Calls the model refused while replaying.
    pub disagreements: Vec<Disagreement>,
}

impl Registry {
    /// A registry for `ranks` ranks whose hangs are analysed under `model`.
    pub fn new(ranks: u32, model: Model) -> Arc<Registry> {
        Registry::with_compaction(ranks, model, usize::MAX)
    }

    /// A registry for a run whose ranks all record here (`Local`): its
    /// trace is folded into a snapshot of the live machine every
    /// 65,536 calls, so that a long run's memory does not grow with
    /// the calls it makes; the hang analysis replays the calls since from
    /// that snapshot ([`Trace::analyze_from`]). A process-per-rank run
    /// keeps its trace whole ([`Registry::new`]): the ranks' traces are
    /// joined for the analysis, and a snapshot of one rank's machine cannot
    /// be joined.
    pub fn local(ranks: u32, model: Model) -> Arc<Registry> {
        Registry::with_compaction(ranks, model, COMPACT_AT)
    }

    fn with_compaction(ranks: u32, model: Model, compact_at: usize) -> Arc<Registry> {
        Arc::new(Registry {
            model,
            inner: Mutex::new(Reg {
                trace: Trace::new(ranks),
                live: Some(Machine::new(Arc::new(Setup::new(ranks, model)))),
                origins: std::collections::HashMap::new(),
                launches: std::collections::HashMap::new(),
                key: Vec::new(),
                user_comms: Vec::new(),
                base: None,
                folded: 0,
            }),
            compact_at,
        })
    }

    /// Calls folded into the snapshot of a compacted trace so far.
    pub fn folded(&self) -> usize {
        self.lock().folded
    }

    /// Calls recorded so far (folded ones included).
    pub fn calls(&self) -> usize {
        let r = self.lock();
        r.folded + r.trace.calls.len()
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
        while r.trace.comms.len() <= i {
            r.trace.add_comm("", &[], true);
        }
        r.trace.comms[i] = duplex::trace::TraceComm {
            name: name.to_string(),
            members: members.to_vec(),
            warm,
        };
        let comms = r.trace.comms.clone();
        if let Some(m) = r.live.as_mut() {
            let setup = m.setup_mut();
            while setup.comms.len() < comms.len() {
                setup.add_comm("", Vec::new(), true);
            }
            let c = &mut setup.comms[i];
            c.name = name.to_string();
            c.members = members.to_vec();
            c.warm = warm;
        }
    }

    /// Sends or recvs that no op of the other side matched: at the end of
    /// a run that otherwise completed, a send that completed into the
    /// channel's buffer (R5) and that nobody received.
    pub fn unmatched(&self) -> Vec<OpInfo> {
        let r = self.lock();
        match &r.live {
            Some(m) => m.unmatched(),
            None => Vec::new(),
        }
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
        if let Some(m) = r.live.as_mut() {
            m.setup_mut().add_stream(rank, name);
            m.sync_setup();
        }
        r.trace.add_stream(rank, name)
    }

    /// Registers an event; returns its number.
    pub fn event(&self, rank: Rank) -> u32 {
        let mut r = self.lock();
        if let Some(m) = r.live.as_mut() {
            m.setup_mut().add_event(rank, "event");
            m.sync_setup();
        }
        r.trace.add_event(rank, "event")
    }

    /// Registers a host thread; returns its number.
    pub fn thread(&self, rank: Rank, name: &str) -> usize {
        let mut r = self.lock();
        if let Some(m) = r.live.as_mut() {
            m.setup_mut().add_thread(rank, name);
            m.sync_setup();
        }
        r.trace.add_thread(rank, name) as usize
    }

    /// Records a launch. The live machine checks it first (R3 size and
    /// type, R8 grouping, against what the other side of each channel has
    /// issued, [`Machine::check_issue`]); nothing is recorded when it fails.
    pub(crate) fn launch(&self, l: LaunchRec<'_>) -> Result<(), Error> {
        let LaunchRec {
            thread,
            ops,
            metas,
            fifos,
            grouped,
        } = l;
        let mut r = self.lock();
        let mut key = std::mem::take(&mut r.key);
        launch_key(&mut key, thread, metas, grouped);
        let (text, place, origin) = match r.launches.get(key.as_slice()) {
            Some((text, place, origin)) => (text.clone(), place.clone(), *origin),
            None => {
                let texts: Vec<String> = metas.iter().map(|m| m.text()).collect();
                let text = if grouped {
                    format!("group {{ {} }}", texts.join("; "))
                } else {
                    texts.join("; ")
                };
                let place = metas.first().map(|m| m.place()).unwrap_or_default();
                let origin = r.origin(&text, &place);
                if r.launches.len() >= 1 << 12 {
                    r.launches.clear();
                }
                let (text, place): (Arc<str>, Arc<str>) = (text.into(), place.into());
                r.launches
                    .insert(key.clone(), (text.clone(), place.clone(), origin));
                (text, place, origin)
            }
        };
        r.key = key;
        let call = TraceCall {
            thread: thread as u32,
            call: Call::Launch { ops, grouped },
            text,
            place,
        };
        self.issue_locked(&mut r, call, fifos, origin)
    }

    /// [`Registry::issue_locked`], taking the lock (for tests that record
    /// calls without `OpMeta`s).
    #[cfg(test)]
    fn issue(&self, call: TraceCall, fifos: &mut [u32]) -> Result<(), Error> {
        let mut r = self.lock();
        self.issue_locked(&mut r, call, fifos, None)
    }

    /// Records launch `call` under the registry's lock `r`, at `origin`
    /// when the caller knows it: the live machine checks it first, and the
    /// FIFO positions it gives the ops go to `fifos` (which may be empty).
    fn issue_locked(
        &self,
        r: &mut Reg,
        call: TraceCall,
        fifos: &mut [u32],
        origin: Option<duplex::machine::Origin>,
    ) -> Result<(), Error> {
        let thread = call.thread as usize;
        if let Some((m, hc)) = r.live_call(&call, origin) {
            let t = ThreadId(thread as u32);
            if let Err(e) = m.check_issue(t, &hc) {
                let e: Error = e.into();
                return Err(match e {
                    Error::Program { kind, message, ops } => Error::Program {
                        kind,
                        message: format!(
                            "{message}; duplex refused to launch it, since NCCL's behaviour is undefined"
                        ),
                        ops,
                    },
                    other => other,
                });
            }
            for (slot, fifo) in fifos.iter_mut().zip(m.fifo_positions(t, &hc)) {
                *slot = fifo;
            }
            let _ = m.apply_checked(t, &hc);
        }
        r.trace.push(call);
        r.compact(self.compact_at);
        Ok(())
    }

    /// Records a `record` or `wait` of an event on a stream.
    pub fn event_call(&self, thread: usize, record: bool, event: u32, stream: u32) {
        let call = if record {
            Call::Record { event, stream }
        } else {
            Call::Wait { event, stream }
        };
        let mut r = self.lock();
        let c = TraceCall {
            thread: thread as u32,
            call,
            text: if record { "record" } else { "wait" }.into(),
            place: "".into(),
        };
        let t = ThreadId(thread as u32);
        let refused = r
            .live_call(&c, None)
            .is_some_and(|(m, hc)| m.apply(t, &hc).is_err());
        if refused {
            r.live = None;
        }
        r.trace.push(c);
        r.compact(self.compact_at);
    }

    /// Marks a thread's code as returned: it issues nothing more, so a
    /// hang's report can say that a partner will never come.
    pub fn ended(&self, thread: usize) {
        self.lock().trace.end(thread as u32);
    }

    /// Marks a thread blocked (or not).
    pub fn blocked(&self, thread: usize, what: Option<Blocked>) {
        let call = what.map(|b| b.trace_call(thread));
        self.lock().trace.block(thread as u32, call);
    }

    /// What every rank issued so far.
    pub fn trace(&self) -> Trace {
        self.lock().trace.clone()
    }

    /// Replays what every rank issued through the state machine and
    /// explains the stuck state, if the model finds one; lists every call
    /// the model refused.
    pub fn analyze(&self) -> HangAnalysis {
        self.analyze_with(Vec::new())
    }

    /// [`Registry::analyze`] over this registry's trace joined with the
    /// traces of ranks recorded elsewhere (other processes of the job).
    pub fn analyze_with(&self, others: Vec<Trace>) -> HangAnalysis {
        let (mine, base) = {
            let r = self.lock();
            (r.trace.clone(), r.base.clone())
        };
        if let Some(base) = base {
            // A compacted local trace: every rank is here, and the
            // snapshot stands for the calls folded into it.
            if !others.is_empty() {
                tracing::warn!("a compacted trace cannot be joined with other ranks' traces");
            }
            let Analysis {
                stuck,
                disagreements,
                ..
            } = mine.analyze_from(&base);
            return HangAnalysis {
                stuck,
                disagreements,
            };
        }
        let trace = if others.is_empty() {
            mine
        } else {
            let mut parts = vec![mine];
            parts.extend(others);
            match Trace::merge(&parts) {
                Ok(t) => t,
                Err(why) => {
                    tracing::warn!("the ranks' traces do not join: {why}");
                    parts.swap_remove(0)
                }
            }
        };
        let Analysis {
            stuck,
            disagreements,
            ..
        } = trace.analyze(self.model);
        HangAnalysis {
            stuck,
            disagreements,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use duplex::trace::TraceOp;
    use duplex::{DType, Dir};

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
        reg.lock().trace.push(TraceCall {
            thread: t0 as u32,
            call: Call::Launch {
                ops: vec![TraceOp {
                    dir: Dir::Send,
                    peer: 1,
                    bytes: 128 << 20,
                    dtype: DType::U32,
                    comm: 1,
                    stream: s0,
                }],
                grouped: false,
            },
            text: "send".into(),
            place: "x.rs:1:1".into(),
        });
        reg.blocked(
            t0,
            Some(Blocked::Sync(
                None,
                ("synchronize".into(), "x.rs:2:1".into()),
            )),
        );
        // While rank 1 may still issue the recv, the report cannot blame anyone.
        let open = reg.analyze();
        assert!(open.disagreements.is_empty(), "{:?}", open.disagreements);
        assert!(open.stuck.expect("stuck").missing.is_empty());
        reg.ended(t1);
        let stuck = reg.analyze().stuck.expect("stuck");
        assert_eq!(stuck.missing.len(), 1, "{stuck}");
        assert!(
            stuck.missing[0]
                .waits_for
                .contains("no thread of rank 1 will ever issue the matching recv"),
            "{stuck}"
        );
    }

    /// A long local run's trace is folded into a snapshot of the live
    /// machine, so that it stays bounded, and the hang analysis from the
    /// snapshot explains the same stuck state as the replay of every call.
    #[test]
    fn a_compacted_trace_stays_bounded_and_explains_the_same_hang() {
        let run = |reg: &Registry| {
            reg.comm(0, "world", &[0, 1], true);
            reg.comm(1, "pair:0-1", &[0, 1], true);
            let s0 = reg.stream(0, "pair:0-1");
            let s1 = reg.stream(1, "pair:0-1");
            let (t0, t1) = (reg.thread(0, "main"), reg.thread(1, "main"));
            let op = |t: usize, dir: Dir, peer: u32, bytes: u64, stream: u32| TraceCall {
                thread: t as u32,
                call: Call::Launch {
                    ops: vec![TraceOp {
                        dir,
                        peer,
                        bytes,
                        dtype: DType::U8,
                        comm: 1,
                        stream,
                    }],
                    grouped: false,
                },
                text: format!("{} {bytes}", dir.name()).into(),
                place: "x.rs:1:1".into(),
            };
            for _ in 0..50 {
                reg.issue(op(t0, Dir::Send, 1, 4096, s0), &mut [])
                    .expect("valid");
                reg.issue(op(t1, Dir::Recv, 0, 4096, s1), &mut [])
                    .expect("valid");
            }
            // The seed: both ranks send first, on one stream each.
            for (t, peer, s) in [(t0, 1, s0), (t1, 0, s1)] {
                reg.issue(op(t, Dir::Send, peer, 256 << 20, s), &mut [])
                    .expect("valid");
                reg.issue(op(t, Dir::Recv, peer, 256 << 20, s), &mut [])
                    .expect("valid");
                reg.blocked(
                    t,
                    Some(Blocked::Sync(
                        None,
                        ("synchronize".into(), "x.rs:2:1".into()),
                    )),
                );
            }
            reg.analyze()
        };
        let whole = Registry::new(2, Model::default());
        let compacted = Registry::with_compaction(2, Model::default(), 16);
        let (a, b) = (run(&whole), run(&compacted));
        assert_eq!(whole.folded(), 0);
        assert!(compacted.folded() >= 96, "{}", compacted.folded());
        assert!(compacted.trace().calls.len() < 16);
        assert!(a.disagreements.is_empty() && b.disagreements.is_empty());
        let (a, b) = (a.stuck.expect("a hang"), b.stuck.expect("a hang"));
        assert_eq!(a.cycle.len(), 4, "{a}");
        assert_eq!(a, b);
    }

    /// A call that the model says could not have been made (here: an
    /// `await` whose `notify` never came) is reported, not dropped.
    #[test]
    fn a_call_the_model_refuses_is_a_disagreement() {
        let reg = Registry::new(2, Model::default());
        reg.comm(0, "world", &[0, 1], true);
        let t0 = reg.thread(0, "main");
        reg.thread(1, "main");
        let s0 = reg.stream(0, "default");
        reg.lock().trace.push(TraceCall {
            thread: t0 as u32,
            call: Call::Await {
                from: 1,
                tag: "go".into(),
            },
            text: "await_notify(1, go)".into(),
            place: "x.rs:3:1".into(),
        });
        reg.event_call(t0, true, reg.event(0), s0);
        let a = reg.analyze();
        assert_eq!(a.disagreements.len(), 1, "{:?}", a.disagreements);
        let d = &a.disagreements[0];
        assert_eq!(d.call, "await_notify(1, go)");
        assert!(d.why.contains("notify"), "{d}");
        assert!(d.why.contains("1 later calls of this rank"), "{d}");
    }
}
