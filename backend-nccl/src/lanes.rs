//! A rank's lanes, and lanes made on first use (issue 12 item 3).
//!
//! `Lanes` holds the lane ends a rank has, one slot per peer and
//! direction, read without a lock on the issue path. Eager runs fill every
//! slot at creation (`ncclCommSplit` of the world, [`crate::ctx`]). Lazy
//! runs ([`crate::LaneMode::Lazy`]) fill a slot when the rank first needs
//! it: the lane is a 2-rank communicator of its own (`ncclCommInitRank`
//! from a unique id that its owner, the lower of its two ranks, makes and
//! mails to the other), so only the pairs that talk pay for a lane.
//!
//! # The protocol
//!
//! Each rank runs a **lane service**, a thread that owns every lane the
//! rank is making. It reads the rank's inbox on the job's [`Board`] (the
//! in-process board, or the TCP store across processes) and answers three
//! messages, each naming a lane by its number in
//! [`duplex::compile::lane_pairs`]:
//!
//! - `want L`, from a host thread of its own rank that needs lane L
//!   ([`LaneMaker::need`]; one per lane). The owner begins L; the other
//!   rank mails `make L` to the owner.
//! - `make L`, to the owner: begin L unless it is being made or made.
//! - `join L ID`, from the owner to the other rank: start its part of L
//!   from unique id ID, unless it already has.
//!
//! To *begin* is to make a unique id, mail `join` to the other rank and
//! start this rank's part. A part in progress is advanced by polling
//! ([`LaneKit::advance`]: the communicator's setup, then a one-byte
//! exchange that connects it, then that exchange's completion), never by
//! waiting, so a service making several lanes at once cannot wait in a
//! cycle with the services of other ranks. Once its part is done, the
//! service fills the rank's slots and the waiting host threads go on.
//!
//! No step waits for any rank's user code: a lane is made by the two
//! ranks' services alone, and only then does an op use it. Two steps are
//! NCCL calls that need the rank's issue lock (P1 of [`crate::guard`]),
//! which a host thread may hold while it waits for another rank (the
//! connection of a user communicator at creation): the service
//! never waits for that lock; it queues the call, and whoever holds the
//! lock runs the queue, the service itself when the lock is free, the
//! waiting host thread as it waits (`RankCtx::assist`). Nothing the
//! service gives up is freed on its thread (a free waits for the device,
//! P8): it goes to [`crate::reaper`]. So a lane made
//! on first use is, to the model, a lane connected at creation (R6 and R7
//! never apply to it), under one assumption of its own, L1 of
//! `docs/semantics.md`: that NCCL can set up and connect a communicator
//! while kernels of the device's other communicators wait for peers. On
//! one H200 that holds except for a process's first communicator and first
//! NCCL launch, so a rank with lazy lanes makes both before its user code
//! runs (`RankCtx::prime`).
//!
//! The store hands a message out once, so a reader that dies with it
//! loses it: a service sends `make` again while it waits for the owner,
//! and the owner sends `join` again while the lane is being made; both
//! are ignored where they are not needed.
//!
//! A lane that is not made within the deadline, or whose other rank
//! failed, fails for good on this rank: every op that needs it returns an
//! error that names the lane and the cause.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use duplex::{Dir, Error, Policy, Rank, Result, compile};

use crate::board::Board;
use crate::comm::Comm;
use crate::ctx::NcclStream;
use crate::store::{hex, unhex};
use crate::sync::{AtomicBool, Condvar, Deadline, Mutex, Ordering, lock};

/// One end of a lane: its communicator and this rank's stream on it.
#[derive(Clone, Debug)]
pub(crate) struct LaneEnd {
    pub(crate) name: String,
    pub(crate) comm: Comm,
    pub(crate) stream: NcclStream,
}

/// A rank's lane ends, by peer and direction: filled once each, read
/// without a lock.
#[derive(Debug)]
pub(crate) struct Lanes {
    /// `slots[peer]`: the lane toward `peer` (send) and from it (recv).
    slots: Vec<[OnceLock<LaneEnd>; 2]>,
}

fn slot(dir: Dir) -> usize {
    match dir {
        Dir::Send => 0,
        Dir::Recv => 1,
    }
}

impl Lanes {
    /// Empty slots for a job of `ranks` ranks.
    pub(crate) fn new(ranks: u32) -> Lanes {
        Lanes {
            slots: (0..ranks).map(|_| Default::default()).collect(),
        }
    }

    /// The lane toward (`Send`) or from (`Recv`) `peer`, if made.
    pub(crate) fn get(&self, peer: Rank, dir: Dir) -> Option<&LaneEnd> {
        self.slots.get(peer as usize)?[slot(dir)].get()
    }

    /// Fills a slot; false if it was filled already.
    pub(crate) fn set(&self, peer: Rank, dir: Dir, end: LaneEnd) -> bool {
        match self.slots.get(peer as usize) {
            Some(s) => s[slot(dir)].set(end).is_ok(),
            None => false,
        }
    }

    /// Every lane end made, with its peer and direction (a shared lane
    /// appears under both directions).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (Rank, Dir, &LaneEnd)> {
        self.slots.iter().enumerate().flat_map(|(peer, s)| {
            [Dir::Send, Dir::Recv]
                .into_iter()
                .filter_map(move |dir| Some((peer as Rank, dir, s[slot(dir)].get()?)))
        })
    }

    /// Every lane end made (a shared lane appears under both directions).
    pub(crate) fn ends(&self) -> impl Iterator<Item = &LaneEnd> {
        self.iter().map(|(_, _, end)| end)
    }
}

/// A lane of the job, as every rank numbers it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaneSpec {
    /// Its position in [`compile::lane_pairs`].
    pub index: u64,
    /// The communicator's name (`lane:a->b`, `pair:a-b`).
    pub name: String,
    /// Its two ranks, lower first: the owner, then the other.
    pub members: [Rank; 2],
    /// Its communicator's number in traces: after the world's, in
    /// [`compile::lane_pairs`] order, as when every lane is made at start.
    pub logical: u32,
    /// The direction each member uses it in, under `per-direction`
    /// (`None` under `shared`: both).
    pub from: Option<Rank>,
}

impl LaneSpec {
    /// Lane number `index` of a job of `ranks` ranks under `policy`.
    pub fn at(policy: Policy, ranks: u32, index: u64) -> Option<LaneSpec> {
        let (a, b) = compile::lane_at(policy, ranks, index)?;
        let (name, _, _) = compile::lane(policy, a, Dir::Send, b);
        Some(LaneSpec {
            index,
            name,
            members: [a.min(b), a.max(b)],
            logical: u32::try_from(index.checked_add(1)?).ok()?,
            from: (policy == Policy::PerDirection).then_some(a),
        })
    }

    /// The lane that carries `rank`'s traffic with `peer` in `dir`.
    pub fn between(
        policy: Policy,
        ranks: u32,
        rank: Rank,
        dir: Dir,
        peer: Rank,
    ) -> Option<LaneSpec> {
        let (a, b) = match dir {
            Dir::Send => (rank, peer),
            Dir::Recv => (peer, rank),
        };
        LaneSpec::at(policy, ranks, compile::lane_index(policy, ranks, a, b)?)
    }

    /// The member that makes the unique id.
    pub fn owner(&self) -> Rank {
        self.members[0]
    }

    /// The member that is not `me`.
    pub fn other(&self, me: Rank) -> Rank {
        if self.members[0] == me {
            self.members[1]
        } else {
            self.members[0]
        }
    }

    /// `me`'s rank in the lane's communicator.
    pub fn rank_of(&self, me: Rank) -> u32 {
        u32::from(self.members[1] == me)
    }

    /// The slots of `me` this lane fills: (peer, direction).
    pub fn slots(&self, me: Rank) -> Vec<(Rank, Dir)> {
        let peer = self.other(me);
        match self.from {
            Some(src) if src == me => vec![(peer, Dir::Send)],
            Some(_) => vec![(peer, Dir::Recv)],
            None => vec![(peer, Dir::Send), (peer, Dir::Recv)],
        }
    }
}

/// A message between lane services.
#[derive(Clone, PartialEq, Eq)]
pub enum LaneMsg {
    /// From a host thread to its own rank's service: lane L is needed.
    Want(u64),
    /// To the owner of lane L: please begin it.
    Make(u64),
    /// From the owner: start your part of lane L from this unique id.
    Join(u64, Vec<u8>),
    /// From [`LaneMaker::stop`] to its own service: look at the stop flag
    /// now rather than at the end of its wait.
    Wake,
}

impl std::fmt::Debug for LaneMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LaneMsg::Want(l) => write!(f, "Want({l})"),
            LaneMsg::Make(l) => write!(f, "Make({l})"),
            // The id lets anyone join the communicator: never print it.
            LaneMsg::Join(l, id) => write!(f, "Join({l}, <{} bytes>)", id.len()),
            LaneMsg::Wake => f.write_str("Wake"),
        }
    }
}

/// The longest unique id a `join` carries (NCCL's is 128 bytes).
const MAX_ID: usize = 512;

impl LaneMsg {
    /// The message as sent: one line of ASCII.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            LaneMsg::Want(l) => format!("want {l}"),
            LaneMsg::Make(l) => format!("make {l}"),
            LaneMsg::Join(l, id) => format!("join {l} {}", hex(id)),
            LaneMsg::Wake => "wake".into(),
        }
        .into_bytes()
    }

    /// Parses what [`LaneMsg::encode`] writes, and nothing else; `None`
    /// for anything else (it comes from the network). Never panics.
    pub fn parse(bytes: &[u8]) -> Option<LaneMsg> {
        let text = std::str::from_utf8(bytes).ok()?;
        if text == "wake" {
            return Some(LaneMsg::Wake);
        }
        let mut words = text.split(' ');
        let (kind, lane) = (words.next()?, words.next()?);
        let lane: u64 = lane.parse().ok().filter(|n: &u64| n.to_string() == lane)?;
        let msg = match kind {
            "want" => LaneMsg::Want(lane),
            "make" => LaneMsg::Make(lane),
            "join" => {
                let id = unhex(words.next()?)?;
                if id.is_empty() || id.len() > MAX_ID {
                    return None;
                }
                LaneMsg::Join(lane, id)
            }
            _ => return None,
        };
        words.next().is_none().then_some(msg)
    }
}

/// What a lane service does with NCCL (and, in tests, without it).
pub trait LaneKit: Send + Sync {
    /// A part of a lane in progress.
    type Part: Send;
    /// A new unique id.
    fn new_id(&self) -> Result<Vec<u8>>;
    /// Starts this rank's part of `lane` from `id`. Never waits for the
    /// other rank.
    fn start(&self, lane: &LaneSpec, id: &[u8]) -> Result<Self::Part>;
    /// Advances a part without waiting for the other rank: true once the
    /// lane is made and connected, ready for [`LaneKit::publish`].
    fn advance(&self, lane: &LaneSpec, part: &mut Self::Part) -> Result<bool>;
    /// Puts a made lane in the rank's slots, from where ops use it. Called
    /// once, under the service's state lock, only while the lane's state
    /// is still "making" (no host thread gave up on it).
    fn publish(&self, lane: &LaneSpec, part: Self::Part);
    /// Gives a part up (aborts what it started).
    fn abandon(&self, lane: &LaneSpec, part: Self::Part);
    /// A failed rank of the job other than this one, and why.
    fn failed(&self) -> Option<(Rank, String)>;
    /// True once the rank this kit serves has ended: the service stops.
    fn gone(&self) -> bool {
        false
    }
}

/// Where a lane stands on this rank.
#[derive(Clone, Debug)]
enum State {
    /// A host thread needs it (since then); its `want` is on the way to the
    /// service.
    Wanted(Instant),
    /// The service asked the owner (`make`); the time is the first need's.
    Asked(Instant),
    /// The service is making its part; the time is the first need's, or
    /// when the service started unasked.
    Making(Instant),
    /// In the rank's slots.
    Made,
    /// It will not be made; why.
    Failed(String),
}

/// How long an idle service waits for a message before it looks again at
/// its stop flag and at the job's health (across processes, each wait is a
/// request to the store).
const IDLE: Duration = Duration::from_millis(200);

/// How long a service that waits for the other rank's answer waits for a
/// message.
const ASKED: Duration = Duration::from_millis(20);

/// How long a service making a part waits for a message before it polls
/// the part again.
const MAKING: Duration = Duration::from_millis(2);

/// How soon a service first sends again a message that may have been lost
/// (the store hands a message out once, and a reader that dies with it
/// loses it): `make` while it waits for the owner, `join` while the lane
/// is being made. Each later resend waits twice as long, up to
/// [`RESEND_MAX`], so that a job making many lanes at once does not flood
/// the store.
#[cfg(not(loom))]
const RESEND: Duration = Duration::from_millis(250);
/// Under loom, whose executions must not depend on real time: never.
#[cfg(loom)]
const RESEND: Duration = Duration::from_secs(1 << 30);

/// The longest wait between two sends of one message.
const RESEND_MAX: Duration = Duration::from_secs(2);

/// A message a service sends again until its lane leaves `state`.
#[derive(Debug)]
struct Resend {
    to: Rank,
    msg: LaneMsg,
    at: Instant,
    /// How long after `at` it is sent again.
    every: Duration,
    /// Sent while the lane is asked for (`make`), or being made (`join`).
    while_asked: bool,
}

/// How much longer than the deadline a host thread waits for the service
/// to make a lane, so that the service's reason for a failure (which
/// comes at the deadline) is what the thread reports.
const GRACE: Duration = Duration::from_secs(1);

/// The lane service of one rank, and what its host threads wait on.
pub struct LaneMaker<K: LaneKit> {
    me: Rank,
    ranks: u32,
    policy: Policy,
    timeout: Duration,
    board: std::sync::Arc<dyn Board>,
    kit: K,
    states: Mutex<HashMap<u64, State>>,
    changed: Condvar,
    stop: AtomicBool,
    /// The service's messages to send again (only its thread uses it).
    resend: Mutex<HashMap<u64, Resend>>,
}

impl<K: LaneKit> std::fmt::Debug for LaneMaker<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaneMaker")
            .field("me", &self.me)
            .field("ranks", &self.ranks)
            .finish_non_exhaustive()
    }
}

impl<K: LaneKit> LaneMaker<K> {
    /// The lane service of rank `me`; run it with [`LaneMaker::serve`].
    pub fn new(
        me: Rank,
        ranks: u32,
        policy: Policy,
        timeout: Duration,
        board: std::sync::Arc<dyn Board>,
        kit: K,
    ) -> LaneMaker<K> {
        LaneMaker {
            me,
            ranks,
            policy,
            timeout,
            board,
            kit,
            states: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            resend: Mutex::new(HashMap::new()),
        }
    }

    /// The kit.
    pub fn kit(&self) -> &K {
        &self.kit
    }

    /// The lane that carries this rank's traffic with `peer` in `dir`.
    pub fn spec(&self, peer: Rank, dir: Dir) -> Option<LaneSpec> {
        LaneSpec::between(self.policy, self.ranks, self.me, dir, peer)
    }

    /// Waits until `lane` is made (asking the service for it, the first
    /// time), up to the deadline. Called by host threads; the service
    /// does the work.
    pub fn need(&self, lane: &LaneSpec) -> Result<()> {
        let deadline = Deadline::after(self.timeout + GRACE);
        let mut states = lock(&self.states);
        if let std::collections::hash_map::Entry::Vacant(v) = states.entry(lane.index) {
            if self.stop.load(Ordering::Acquire) {
                return Err(Error::Aborted(format!(
                    "making lane {} of rank {}: rank {} is shutting down",
                    lane.name, self.me, self.me
                )));
            }
            v.insert(State::Wanted(Instant::now()));
            drop(states);
            let posted = self
                .board
                .mail(self.me, &LaneMsg::Want(lane.index).encode());
            if let Err(e) = posted {
                self.fail(lane.index, format!("asking its own lane service: {e}"));
            }
            states = lock(&self.states);
        }
        loop {
            match states.get(&lane.index) {
                Some(State::Made) => return Ok(()),
                Some(State::Failed(why)) => {
                    return Err(Error::Aborted(format!(
                        "making lane {} of rank {}: {why}",
                        lane.name, self.me
                    )));
                }
                _ => {}
            }
            if deadline.expired() {
                drop(states);
                // For good, as the service's own deadline would: a later op
                // must not find the lane made after this one gave up.
                self.fail(
                    lane.index,
                    format!(
                        "it was not made within {:?} (rank {}'s lane service, or this rank's, did not finish it)",
                        self.timeout + GRACE,
                        lane.other(self.me)
                    ),
                );
                states = lock(&self.states);
                continue;
            }
            states = deadline.wait(&self.changed, states);
        }
    }

    /// Whether `lane` is made on this rank.
    pub fn made(&self, lane: &LaneSpec) -> bool {
        matches!(lock(&self.states).get(&lane.index), Some(State::Made))
    }

    /// The lanes of this rank that are asked for or being made and not
    /// made yet, each in words with how long (`lane:0->1: this rank's lane
    /// service is making its part, for 2.1 s`): for hang reports, where a
    /// host thread waiting in [`LaneMaker::need`] has no call in the model.
    pub fn unmade(&self) -> Vec<String> {
        let states = lock(&self.states);
        let mut out: Vec<(u64, String)> = states
            .iter()
            .filter_map(|(lane, state)| {
                let (since, what) = match state {
                    State::Wanted(t) => (t, "asked of this rank's lane service"),
                    State::Asked(t) => (t, "waiting for the other rank's lane service"),
                    State::Making(t) => (t, "this rank's lane service is making its part"),
                    State::Made | State::Failed(_) => return None,
                };
                let name = LaneSpec::at(self.policy, self.ranks, *lane)
                    .map_or_else(|| format!("lane #{lane}"), |l| l.name);
                Some((
                    *lane,
                    format!("{name}: {what}, for {:.1} s", since.elapsed().as_secs_f64()),
                ))
            })
            .collect();
        out.sort();
        out.into_iter().map(|(_, s)| s).collect()
    }

    /// Asks the service to stop: lanes in progress are abandoned, and
    /// waits for lanes not made fail.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        {
            let _g = lock(&self.states);
            self.changed.notify_all();
        }
        let _ = self.board.mail(self.me, &LaneMsg::Wake.encode());
    }

    fn set(&self, states: &mut HashMap<u64, State>, lane: u64, state: State) {
        states.insert(lane, state);
        self.changed.notify_all();
    }

    fn fail(&self, lane: u64, why: String) {
        let mut states = lock(&self.states);
        if !matches!(states.get(&lane), Some(State::Made | State::Failed(_))) {
            tracing::warn!(rank = self.me, lane, why = %why, "a lane was not made");
            self.set(&mut states, lane, State::Failed(why));
        }
    }

    /// Handles the messages in this rank's inbox: the first read waits up
    /// to `wait`, the rest (64 at most) only drain.
    fn read_inbox(&self, mut wait: Duration, parts: &mut HashMap<u64, (LaneSpec, K::Part)>) {
        for _ in 0..64 {
            match self.board.inbox(self.me, wait) {
                Ok(Some(m)) => self.handle(&m, parts),
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(
                        rank = self.me,
                        "the lane service cannot read its inbox: {e}"
                    );
                    // Perhaps for a moment (a busy store): lanes in
                    // progress go on, and fail at their deadlines if it
                    // lasts; a dead store is a failed rank 0, which the
                    // job's health reports.
                    std::thread::sleep(ASKED);
                    break;
                }
            }
            wait = Duration::ZERO;
        }
    }

    /// The service: runs until [`LaneMaker::stop`].
    pub fn serve(&self) {
        let mut parts: HashMap<u64, (LaneSpec, K::Part)> = HashMap::new();
        // When the inbox was last read: while parts are polled every
        // `MAKING`, it is read no oftener than the board asks.
        let mut read_at: Option<Instant> = None;
        loop {
            if self.stop.load(Ordering::Acquire) || self.kit.gone() {
                for (_, (spec, part)) in parts.drain() {
                    self.kit.abandon(&spec, part);
                }
                let mut states = lock(&self.states);
                let open: Vec<u64> = states
                    .iter()
                    .filter(|(_, s)| !matches!(s, State::Made | State::Failed(_)))
                    .map(|(l, _)| *l)
                    .collect();
                for l in open {
                    self.set(
                        &mut states,
                        l,
                        State::Failed(format!("rank {} is shutting down", self.me)),
                    );
                }
                return;
            }
            let waiting = lock(&self.states)
                .values()
                .any(|s| matches!(s, State::Wanted(_) | State::Asked(_)));
            // Messages: the first read waits a little, the rest only drain.
            let wait = if !parts.is_empty() {
                MAKING
            } else if waiting {
                ASKED
            } else {
                IDLE
            };
            let due =
                parts.is_empty() || read_at.is_none_or(|t| t.elapsed() >= self.board.inbox_every());
            if due {
                read_at = Some(Instant::now());
                self.read_inbox(wait, &mut parts);
            } else {
                // The parts' progress only, at the pace a read's wait gives.
                std::thread::sleep(MAKING);
            }
            // A `want` of this rank's own that never arrived (lost): as if
            // it had.
            let lost: Vec<u64> = lock(&self.states)
                .iter()
                .filter(|(_, s)| matches!(s, State::Wanted(t) if t.elapsed() > RESEND))
                .map(|(l, _)| *l)
                .collect();
            for l in lost {
                self.handle(&LaneMsg::Want(l).encode(), &mut parts);
            }
            // Parts of lanes a host thread gave up on are given up too.
            let given_up: Vec<u64> = {
                let states = lock(&self.states);
                parts
                    .keys()
                    .filter(|l| matches!(states.get(l), Some(State::Failed(_))))
                    .copied()
                    .collect()
            };
            for l in given_up {
                if let Some((spec, part)) = parts.remove(&l) {
                    self.kit.abandon(&spec, part);
                }
            }
            // Parts in progress.
            let mut done = Vec::new();
            for (l, (spec, part)) in parts.iter_mut() {
                match self.kit.advance(spec, part) {
                    Ok(true) => done.push((*l, None)),
                    Ok(false) => {}
                    Err(e) => done.push((*l, Some(e.to_string()))),
                }
            }
            for (l, err) in done {
                let Some((spec, part)) = parts.remove(&l) else {
                    continue;
                };
                match err {
                    None => {
                        let mut states = lock(&self.states);
                        if matches!(states.get(&l), Some(State::Making(_))) {
                            self.kit.publish(&spec, part);
                            self.set(&mut states, l, State::Made);
                        } else {
                            drop(states);
                            self.kit.abandon(&spec, part);
                        }
                    }
                    Some(why) => {
                        self.kit.abandon(&spec, part);
                        self.fail(l, why);
                    }
                }
            }
            self.resend_lost();
            // Deadlines, and the other ranks' failures.
            let now = Instant::now();
            let late: Vec<(u64, String)> = lock(&self.states)
                .iter()
                .filter_map(|(l, s)| match s {
                    State::Asked(t) if now.duration_since(*t) > self.timeout => {
                        Some((*l, "answer"))
                    }
                    State::Making(t) if now.duration_since(*t) > self.timeout => {
                        Some((*l, "join it"))
                    }
                    _ => None,
                })
                .map(|(l, did)| {
                    let other = LaneSpec::at(self.policy, self.ranks, l)
                        .map_or(0, |s| s.other(self.me));
                    let why = format!(
                        "rank {other} did not {did} within {:?} (is its process running duplex with lazy lanes?)",
                        self.timeout
                    );
                    (l, why)
                })
                .collect();
            for (l, why) in late {
                if let Some((spec, part)) = parts.remove(&l) {
                    self.kit.abandon(&spec, part);
                }
                self.fail(l, why);
            }
            if let Some((r, why)) = self.kit.failed() {
                let policy = self.policy;
                let ranks = self.ranks;
                let me = self.me;
                self.fail_open(
                    &mut parts,
                    |l| LaneSpec::at(policy, ranks, l).is_some_and(|s| s.other(me) == r),
                    &format!("rank {r} failed ({why})"),
                );
            }
        }
    }

    /// Sends again what may have been lost, for lanes still waiting on it;
    /// forgets the rest. Duplicates are harmless: a `make` for a lane being
    /// made or made, and a `join` for a lane already joined, are ignored.
    fn resend_lost(&self) {
        let states = lock(&self.states);
        let mut resend = lock(&self.resend);
        resend.retain(|l, r| match states.get(l) {
            Some(State::Asked(_)) => r.while_asked,
            Some(State::Making(_)) => !r.while_asked,
            _ => false,
        });
        drop(states);
        for r in resend.values_mut() {
            if r.at.elapsed() >= r.every {
                r.at = Instant::now();
                r.every = (r.every * 2).min(RESEND_MAX);
                if let Err(e) = self.board.mail(r.to, &r.msg.encode()) {
                    tracing::debug!(rank = self.me, to = r.to, "sending again failed: {e}");
                }
            }
        }
    }

    /// Fails every lane not made (abandoning its part) that `which` picks.
    fn fail_open(
        &self,
        parts: &mut HashMap<u64, (LaneSpec, K::Part)>,
        which: impl Fn(u64) -> bool,
        why: &str,
    ) {
        let open: Vec<u64> = lock(&self.states)
            .iter()
            .filter(|(l, s)| !matches!(s, State::Made | State::Failed(_)) && which(**l))
            .map(|(l, _)| *l)
            .collect();
        for l in open {
            if let Some((spec, part)) = parts.remove(&l) {
                self.kit.abandon(&spec, part);
            }
            self.fail(l, why.to_string());
        }
    }

    fn handle(&self, bytes: &[u8], parts: &mut HashMap<u64, (LaneSpec, K::Part)>) {
        let Some(msg) = LaneMsg::parse(bytes) else {
            tracing::warn!(
                rank = self.me,
                "the lane service dropped a malformed message"
            );
            return;
        };
        let l = match &msg {
            LaneMsg::Want(l) | LaneMsg::Make(l) | LaneMsg::Join(l, _) => *l,
            LaneMsg::Wake => return,
        };
        let Some(spec) =
            LaneSpec::at(self.policy, self.ranks, l).filter(|s| s.members.contains(&self.me))
        else {
            tracing::warn!(
                rank = self.me,
                ?msg,
                "the lane service dropped a message about a lane it is not in"
            );
            return;
        };
        let state = lock(&self.states).get(&l).cloned();
        match msg {
            LaneMsg::Want(_) => {
                let Some(State::Wanted(since)) = state else {
                    return;
                };
                if spec.owner() == self.me {
                    self.begin(&spec, since, parts);
                } else {
                    let asked = self.board.mail(spec.owner(), &LaneMsg::Make(l).encode());
                    let mut states = lock(&self.states);
                    // The mail can take the store's whole timeout: the
                    // host may have given the lane up meanwhile (`need`
                    // sets `Failed` for good), and that must stand (found
                    // by review: a lane its host was told had failed was
                    // then made and published).
                    if !matches!(states.get(&l), Some(State::Wanted(_))) {
                        return;
                    }
                    match asked {
                        Ok(()) => {
                            self.set(&mut states, l, State::Asked(since));
                            lock(&self.resend).insert(
                                l,
                                Resend {
                                    to: spec.owner(),
                                    msg: LaneMsg::Make(l),
                                    at: Instant::now(),
                                    every: RESEND,
                                    while_asked: true,
                                },
                            );
                        }
                        Err(e) => self.set(
                            &mut states,
                            l,
                            State::Failed(format!("asking rank {} for it: {e}", spec.owner())),
                        ),
                    }
                }
            }
            LaneMsg::Make(_) => {
                if spec.owner() == self.me {
                    match state {
                        None => self.begin(&spec, Instant::now(), parts),
                        Some(State::Wanted(since)) => self.begin(&spec, since, parts),
                        _ => {}
                    }
                }
            }
            LaneMsg::Wake => {}
            LaneMsg::Join(_, id) => {
                if spec.owner() != self.me {
                    match state {
                        None => self.start(&spec, &id, Instant::now(), parts),
                        Some(State::Wanted(since) | State::Asked(since)) => {
                            self.start(&spec, &id, since, parts)
                        }
                        _ => false,
                    };
                }
            }
        }
    }

    /// The owner's beginning: a unique id, mailed to the other rank, and
    /// this rank's part.
    fn begin(
        &self,
        spec: &LaneSpec,
        since: Instant,
        parts: &mut HashMap<u64, (LaneSpec, K::Part)>,
    ) {
        let id = match self.kit.new_id() {
            Ok(id) => id,
            Err(e) => return self.fail(spec.index, format!("making its unique id: {e}")),
        };
        if !self.start(spec, &id, since, parts) {
            return;
        }
        let other = spec.other(self.me);
        let join = LaneMsg::Join(spec.index, id);
        if let Err(e) = self.board.mail(other, &join.encode()) {
            if let Some((spec, part)) = parts.remove(&spec.index) {
                self.kit.abandon(&spec, part);
            }
            self.fail(
                spec.index,
                format!("sending its unique id to rank {other}: {e}"),
            );
            return;
        }
        lock(&self.resend).insert(
            spec.index,
            Resend {
                to: other,
                msg: join,
                at: Instant::now(),
                every: RESEND,
                while_asked: false,
            },
        );
    }

    /// Starts this rank's part; false (and the lane failed) if it cannot.
    fn start(
        &self,
        spec: &LaneSpec,
        id: &[u8],
        since: Instant,
        parts: &mut HashMap<u64, (LaneSpec, K::Part)>,
    ) -> bool {
        match self.kit.start(spec, id) {
            Ok(part) => {
                let mut states = lock(&self.states);
                if matches!(states.get(&spec.index), Some(State::Failed(_))) {
                    // A host thread gave up on it meanwhile.
                    drop(states);
                    self.kit.abandon(spec, part);
                    return false;
                }
                parts.insert(spec.index, (spec.clone(), part));
                self.set(&mut states, spec.index, State::Making(since));
                true
            }
            Err(e) => {
                self.fail(spec.index, format!("starting its communicator: {e}"));
                false
            }
        }
    }
}

pub(crate) mod nccl;

#[cfg(all(test, not(loom)))]
mod tests;
