//! The lane services' protocol on a fake NCCL: lanes made by the services
//! of real threads over the in-process board.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use duplex::{Dir, Policy, Rank, Result};

use super::{LaneKit, LaneMaker, LaneMsg, LaneSpec};
use crate::board::{Board, LocalBoard};

/// Who started a part from each unique id: (rank, rank in the lane).
type Joined = HashMap<Vec<u8>, Vec<(Rank, u32)>>;

/// What the fake NCCL knows: which ranks started a part from each id.
#[derive(Default)]
struct Fabric {
    parts: Mutex<Joined>,
    next: AtomicU64,
    failed: Mutex<Option<(Rank, String)>>,
    made: Mutex<Vec<(Rank, u64)>>,
    abandoned: Mutex<Vec<(Rank, u64)>>,
    starts: Mutex<Vec<(Rank, u64)>>,
    /// While set, no part gets past its setup.
    hold: std::sync::atomic::AtomicBool,
}

struct FakeKit {
    me: Rank,
    fabric: Arc<Fabric>,
}

impl LaneKit for FakeKit {
    type Part = (Vec<u8>, u32);

    fn new_id(&self) -> Result<Vec<u8>> {
        Ok(self
            .fabric
            .next
            .fetch_add(1, Ordering::Relaxed)
            .to_le_bytes()
            .to_vec())
    }

    fn start(&self, lane: &LaneSpec, id: &[u8]) -> Result<Self::Part> {
        self.fabric
            .starts
            .lock()
            .expect("not poisoned")
            .push((self.me, lane.index));
        let mut parts = self.fabric.parts.lock().expect("not poisoned");
        parts
            .entry(id.to_vec())
            .or_default()
            .push((self.me, lane.rank_of(self.me)));
        Ok((id.to_vec(), 0))
    }

    fn advance(&self, _: &LaneSpec, part: &mut Self::Part) -> Result<bool> {
        if self.fabric.hold.load(Ordering::Acquire) {
            return Ok(false);
        }
        let joined = self.fabric.parts.lock().expect("not poisoned")[&part.0].len();
        if joined < 2 {
            return Ok(false);
        }
        // A few polls more, as a real setup and connection take.
        part.1 += 1;
        Ok(part.1 >= 3)
    }

    fn publish(&self, lane: &LaneSpec, _: Self::Part) {
        self.fabric
            .made
            .lock()
            .expect("not poisoned")
            .push((self.me, lane.index));
    }

    fn abandon(&self, lane: &LaneSpec, _: Self::Part) {
        self.fabric
            .abandoned
            .lock()
            .expect("not poisoned")
            .push((self.me, lane.index));
    }

    fn failed(&self) -> Option<(Rank, String)> {
        self.fabric
            .failed
            .lock()
            .expect("not poisoned")
            .clone()
            .filter(|(r, _)| *r != self.me)
    }
}

struct Job {
    makers: Vec<Arc<LaneMaker<FakeKit>>>,
    services: Vec<std::thread::JoinHandle<()>>,
    fabric: Arc<Fabric>,
    board: Arc<dyn Board>,
}

/// A job of `ranks` ranks whose services run for the ranks in `serving`.
fn job(ranks: u32, policy: Policy, timeout: Duration, serving: &[Rank]) -> Job {
    job_on(
        Arc::new(LocalBoard::default()),
        ranks,
        policy,
        timeout,
        serving,
    )
}

/// [`job`], its messages on `board`.
fn job_on(
    board: Arc<dyn Board>,
    ranks: u32,
    policy: Policy,
    timeout: Duration,
    serving: &[Rank],
) -> Job {
    let fabric = Arc::new(Fabric::default());
    let makers: Vec<_> = (0..ranks)
        .map(|me| {
            Arc::new(LaneMaker::new(
                me,
                ranks,
                policy,
                timeout,
                board.clone(),
                FakeKit {
                    me,
                    fabric: fabric.clone(),
                },
            ))
        })
        .collect();
    let services = serving
        .iter()
        .map(|&r| {
            let m = makers[r as usize].clone();
            std::thread::spawn(move || m.serve())
        })
        .collect();
    Job {
        makers,
        services,
        fabric,
        board,
    }
}

impl Job {
    fn need(&self, rank: Rank, dir: Dir, peer: Rank) -> Result<()> {
        let m = &self.makers[rank as usize];
        m.need(&m.spec(peer, dir).expect("a lane"))
    }

    fn stop(self) -> Arc<Fabric> {
        for m in &self.makers {
            m.stop();
        }
        for s in self.services {
            s.join().expect("the service ends");
        }
        self.fabric
    }
}

const T: Duration = Duration::from_secs(10);

#[test]
fn both_ranks_needing_one_lane_at_once_make_it_once_from_one_id() {
    for _ in 0..20 {
        let job = Arc::new(job(2, Policy::PerDirection, T, &[0, 1]));
        let (a, b) = (job.clone(), job.clone());
        let send = std::thread::spawn(move || a.need(0, Dir::Send, 1));
        let recv = std::thread::spawn(move || b.need(1, Dir::Recv, 0));
        send.join().unwrap().unwrap();
        recv.join().unwrap().unwrap();
        let job = Arc::try_unwrap(job).ok().unwrap();
        let fabric = job.stop();
        let parts = fabric.parts.lock().expect("not poisoned");
        assert_eq!(parts.len(), 1, "one unique id for the lane");
        let mut joined = parts.values().next().unwrap().clone();
        joined.sort();
        assert_eq!(joined, vec![(0, 0), (1, 1)]);
        let mut made = fabric.made.lock().expect("not poisoned").clone();
        made.sort();
        assert_eq!(made, vec![(0, 0), (1, 0)], "lane:0->1 is lane 0");
    }
}

#[test]
fn the_other_rank_makes_its_part_without_being_asked_by_its_own_code() {
    let job = job(2, Policy::PerDirection, T, &[0, 1]);
    // Rank 1 (not the owner) needs lane 1->0; rank 0's code never does.
    job.need(1, Dir::Send, 0).unwrap();
    let spec = job.makers[0].spec(1, Dir::Recv).unwrap();
    assert_eq!(spec.name, "lane:1->0");
    let start = Instant::now();
    while !job.makers[0].made(&spec) {
        assert!(
            start.elapsed() < T,
            "rank 0's service did not finish its part"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // Rank 0's later need returns at once.
    job.need(0, Dir::Recv, 1).unwrap();
    let fabric = job.stop();
    assert_eq!(fabric.parts.lock().expect("not poisoned").len(), 1);
}

#[test]
fn a_lane_waiting_for_a_silent_service_is_listed_as_not_made_until_it_fails() {
    // Rank 1's service never runs: rank 0's lane to it (rank 0 owns it, so
    // its service makes its part at once) stays unmade, and says so, until
    // the need gives up.
    let job = job(2, Policy::PerDirection, Duration::from_millis(300), &[0]);
    assert!(job.makers[0].unmade().is_empty());
    let m = job.makers[0].clone();
    let waiter = std::thread::spawn(move || m.need(&m.spec(1, Dir::Send).expect("a lane")));
    let start = Instant::now();
    let listed = loop {
        // First `asked of this rank's lane service` (the want on its way),
        // then the service's state.
        let unmade = job.makers[0].unmade();
        if unmade.iter().any(|u| u.contains("making its part")) {
            break unmade;
        }
        assert!(start.elapsed() < T, "never listed: {unmade:?}");
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert!(
        listed[0].starts_with("lane:0->1: this rank's lane service is making its part, for "),
        "{listed:?}"
    );
    let e = waiter.join().expect("no panic").unwrap_err();
    assert!(e.to_string().contains("lane:0->1"), "{e}");
    // Given up: no longer pending.
    assert!(job.makers[0].unmade().is_empty());
    job.stop();
}

#[test]
fn services_of_a_ring_that_all_need_lanes_at_once_do_not_wait_in_a_cycle() {
    // Every rank needs its lane to the next rank and from the previous one,
    // at once: each service is the owner of one lane and the joiner of
    // another. A service that waited for one lane before the next would
    // wait in a cycle.
    let n = 5;
    let job = Arc::new(job(n, Policy::PerDirection, T, &(0..n).collect::<Vec<_>>()));
    let threads: Vec<_> = (0..n)
        .flat_map(|r| {
            let (a, b) = (job.clone(), job.clone());
            [
                std::thread::spawn(move || a.need(r, Dir::Send, (r + 1) % n)),
                std::thread::spawn(move || b.need(r, Dir::Recv, (r + n - 1) % n)),
            ]
        })
        .collect();
    for t in threads {
        t.join().unwrap().unwrap();
    }
    let job = Arc::try_unwrap(job).ok().unwrap();
    let fabric = job.stop();
    assert_eq!(
        fabric.parts.lock().expect("not poisoned").len(),
        n as usize,
        "one id per lane"
    );
    assert_eq!(
        fabric.made.lock().expect("not poisoned").len(),
        2 * n as usize
    );
    assert!(fabric.abandoned.lock().expect("not poisoned").is_empty());
}

#[test]
fn a_shared_lane_serves_both_directions() {
    let job = job(3, Policy::Shared, T, &[0, 1, 2]);
    job.need(2, Dir::Recv, 0).unwrap();
    let spec = job.makers[2].spec(0, Dir::Send).unwrap();
    assert_eq!(spec.name, "pair:0-2");
    assert!(job.makers[2].made(&spec), "one lane for both directions");
    assert_eq!(spec.slots(2), vec![(0, Dir::Send), (0, Dir::Recv)]);
    job.stop();
}

#[test]
fn a_failed_peer_fails_the_lane_at_once_naming_it() {
    let job = job(2, Policy::PerDirection, T, &[0]);
    *job.fabric.failed.lock().expect("not poisoned") = Some((1, "killed by SIGKILL".into()));
    let start = Instant::now();
    let e = job.need(0, Dir::Send, 1).unwrap_err().to_string();
    assert!(start.elapsed() < T / 2, "did not wait for the deadline");
    assert!(
        e.contains("lane:0->1") && e.contains("rank 1 failed (killed by SIGKILL)"),
        "{e}"
    );
    // The failure is kept: the next op on the lane fails at once too.
    let e2 = job.need(0, Dir::Send, 1).unwrap_err().to_string();
    assert_eq!(e, e2);
    let fabric = job.stop();
    assert_eq!(
        *fabric.abandoned.lock().expect("not poisoned"),
        vec![(0, 0)],
        "its part was aborted"
    );
}

#[test]
fn a_peer_without_a_service_is_an_error_at_the_deadline_not_a_hang() {
    let t = Duration::from_millis(300);
    // The owner waits for the joiner; the joiner waits for the owner.
    let job = job(2, Policy::PerDirection, t, &[0]);
    let e = job.need(0, Dir::Send, 1).unwrap_err().to_string();
    assert!(e.contains("rank 1 did not join it within"), "{e}");
    let job2 = self::job(2, Policy::PerDirection, t, &[1]);
    let e = job2.need(1, Dir::Recv, 0).unwrap_err().to_string();
    assert!(e.contains("rank 0 did not answer within"), "{e}");
    job.stop();
    job2.stop();
}

#[test]
fn malformed_or_foreign_messages_are_dropped_and_the_service_goes_on() {
    let job = job(3, Policy::PerDirection, T, &[0, 1]);
    for junk in [
        &b""[..],
        b"want",
        b"want 01",
        b"want -1",
        b"want 1 2",
        b"join 0 zz",
        b"join 0 ",
        b"make 99999999999999999999",
        b"\xff\xfe",
        b"hello world",
    ] {
        job.board.mail(0, junk).unwrap();
    }
    // Lane 4 is lane:2->0, which rank 1 is not in.
    job.board.mail(1, &LaneMsg::Make(4).encode()).unwrap();
    job.need(0, Dir::Send, 1).unwrap();
    job.stop();
}

#[test]
fn stopping_fails_the_waits_for_lanes_not_made() {
    let job = Arc::new(job(2, Policy::PerDirection, T, &[0]));
    let j = job.clone();
    let waiter = std::thread::spawn(move || j.need(0, Dir::Send, 1));
    std::thread::sleep(Duration::from_millis(50));
    job.makers[0].stop();
    let e = waiter.join().unwrap().unwrap_err().to_string();
    assert!(e.contains("shutting down"), "{e}");
    let job = Arc::try_unwrap(job).ok().unwrap();
    job.stop();
}

#[test]
fn lane_messages_round_trip_and_nothing_else_parses() {
    for m in [
        LaneMsg::Want(0),
        LaneMsg::Make(1 << 40),
        LaneMsg::Join(7, (0..128).collect()),
        LaneMsg::Wake,
    ] {
        assert_eq!(LaneMsg::parse(&m.encode()), Some(m));
    }
    let id = format!("join 1 {}", "ab".repeat(513));
    assert_eq!(LaneMsg::parse(id.as_bytes()), None, "ids are bounded");
    assert_eq!(LaneMsg::parse(b"join 1 AB"), None, "lowercase hex only");
    assert_eq!(LaneMsg::parse(b"want  1"), None);
    assert!(
        !format!("{:?}", LaneMsg::Join(1, vec![0xab; 4])).contains("ab"),
        "the id is never printed"
    );
}

#[test]
fn lane_specs_number_lanes_as_eager_creation_does() {
    for policy in [Policy::PerDirection, Policy::Shared] {
        let n = 4;
        for (i, (a, b)) in duplex::compile::lane_pairs(policy, n).enumerate() {
            let s = LaneSpec::at(policy, n, i as u64).unwrap();
            assert_eq!(s.logical, i as u32 + 1);
            assert_eq!(s.members, [a.min(b), a.max(b)]);
            assert_eq!(s.name, duplex::compile::lane(policy, a, Dir::Send, b).0);
            assert_eq!(
                LaneSpec::between(policy, n, a, Dir::Send, b),
                Some(s.clone())
            );
            assert_eq!(LaneSpec::between(policy, n, b, Dir::Recv, a), Some(s));
        }
    }
}

#[test]
fn a_need_after_the_service_stopped_fails_at_once() {
    let job = job(2, Policy::PerDirection, T, &[0, 1]);
    job.makers[0].stop();
    let start = Instant::now();
    let e = job.need(0, Dir::Send, 1).unwrap_err().to_string();
    assert!(e.contains("shutting down"), "{e}");
    assert!(start.elapsed() < T / 2, "did not wait for the deadline");
    job.stop();
}

#[test]
fn a_wait_that_gives_up_fails_the_lane_for_good() {
    // Rank 1's service never runs; rank 0's host gives up at its deadline
    // and the lane stays failed, even if rank 1 joins later.
    let t = Duration::from_millis(200);
    let job = job(2, Policy::PerDirection, t, &[0]);
    let first = job.need(0, Dir::Send, 1).unwrap_err().to_string();
    let again = job.need(0, Dir::Send, 1).unwrap_err().to_string();
    assert_eq!(first, again);
    job.stop();
}

#[test]
fn a_lane_given_up_by_its_host_is_never_published_later() {
    let job = Arc::new(job(2, Policy::PerDirection, T, &[0, 1]));
    job.fabric.hold.store(true, Ordering::Release);
    let j = job.clone();
    let waiter = std::thread::spawn(move || j.need(0, Dir::Send, 1));
    // Both parts started, neither can finish.
    let start = Instant::now();
    while job
        .fabric
        .parts
        .lock()
        .expect("not poisoned")
        .values()
        .all(|p| p.len() < 2)
    {
        assert!(start.elapsed() < T, "the parts did not start");
        std::thread::sleep(Duration::from_millis(1));
    }
    // Rank 0's host gives up (as at its deadline); then the parts could
    // finish.
    job.makers[0].fail(0, "given up by its host".into());
    job.fabric.hold.store(false, Ordering::Release);
    let e = waiter.join().expect("no panic").unwrap_err().to_string();
    assert!(e.contains("given up by its host"), "{e}");
    // Rank 0's service abandons its part instead of publishing it.
    while !job
        .fabric
        .abandoned
        .lock()
        .expect("not poisoned")
        .contains(&(0, 0))
    {
        assert!(start.elapsed() < T, "rank 0's part was not abandoned");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        !job.fabric
            .made
            .lock()
            .expect("not poisoned")
            .contains(&(0, 0)),
        "published after its host gave up"
    );
    let again = job.need(0, Dir::Send, 1).unwrap_err().to_string();
    assert_eq!(e, again);
    let job = Arc::try_unwrap(job).ok().expect("one holder");
    job.stop();
}

/// A board whose `want` mail is delivered but whose reply is lost (the
/// sender gets an error), and whose first `make` mail is slow: the host
/// gives the lane up (its `need` fails) while its peer's service is still
/// asking the owner.
#[derive(Debug, Default)]
struct LostReply {
    inner: LocalBoard,
    in_make: std::sync::atomic::AtomicBool,
    host_failed: std::sync::atomic::AtomicBool,
}

fn spin_until(flag: &std::sync::atomic::AtomicBool) {
    let start = Instant::now();
    while !flag.load(Ordering::Acquire) {
        assert!(start.elapsed() < T, "never set");
        std::thread::sleep(Duration::from_millis(1));
    }
}

impl Board for LostReply {
    fn post(&self, from: Rank, to: Rank, tag: &str) -> Result<()> {
        self.inner.post(from, to, tag)
    }
    fn take(&self, from: Rank, to: Rank, tag: &str, timeout: Duration) -> Result<bool> {
        self.inner.take(from, to, tag, timeout)
    }
    fn mail(&self, to: Rank, message: &[u8]) -> Result<()> {
        if message.starts_with(b"want") {
            self.inner.mail(to, message)?;
            spin_until(&self.in_make);
            return Err(duplex::Error::Aborted("the store's reply was lost".into()));
        }
        if message.starts_with(b"make") && !self.in_make.swap(true, Ordering::AcqRel) {
            spin_until(&self.host_failed);
        }
        self.inner.mail(to, message)
    }
    fn inbox(&self, me: Rank, timeout: Duration) -> Result<Option<Vec<u8>>> {
        self.inner.inbox(me, timeout)
    }
}

/// A lane whose host was told it failed for good (its `need` returned the
/// error) is never made later, even when its service was asking the
/// owner for it at that moment (found by review: the service set the lane
/// `Asked` over `Failed` once its slow mail returned, and the lane was
/// made, and a later `need` found it).
#[test]
fn a_lane_its_host_was_told_failed_is_not_made_later() {
    let board = Arc::new(LostReply::default());
    let job = job_on(board.clone(), 2, Policy::PerDirection, T, &[0, 1]);
    let e = job.need(1, Dir::Send, 0).unwrap_err().to_string();
    assert!(e.contains("reply was lost"), "{e}");
    board.host_failed.store(true, Ordering::Release);
    std::thread::sleep(Duration::from_millis(500));
    let again = job.need(1, Dir::Send, 0);
    let made = job.fabric.made.lock().expect("not poisoned").clone();
    job.stop();
    assert!(
        again.is_err() && !made.contains(&(1, 1)),
        "the lane failed for good on rank 1, then was made anyway: {again:?}, {made:?}"
    );
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: 24,
        ..proptest::prelude::ProptestConfig::default()
    })]

    /// Any ranks needing any lanes in any order, at once: every need is
    /// met; each lane is made once on each of its two ranks, from one id;
    /// no part is started twice or abandoned.
    #[test]
    fn any_needs_in_any_order_make_each_lane_once(
        ranks in 2u32..6,
        shared in proptest::bool::ANY,
        needs in proptest::collection::vec((0u32..6, 1u32..6, proptest::bool::ANY, 0u64..3), 1..16),
    ) {
        let policy = if shared { Policy::Shared } else { Policy::PerDirection };
        let job = Arc::new(job(ranks, policy, T, &(0..ranks).collect::<Vec<_>>()));
        let threads: Vec<_> = needs
            .iter()
            .map(|&(r, off, send, delay)| {
                let (r, peer) = (r % ranks, (r % ranks + off % (ranks - 1) + 1) % ranks);
                let dir = if send { Dir::Send } else { Dir::Recv };
                let j = job.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(delay));
                    j.need(r, dir, peer).map(|()| (r, dir, peer))
                })
            })
            .collect();
        let mut lanes = std::collections::BTreeSet::new();
        for t in threads {
            let (r, dir, peer) = t.join().expect("no panic").expect("every need is met");
            lanes.insert(job.makers[r as usize].spec(peer, dir).expect("a lane").index);
        }
        // Each needed lane gets made on both its ranks (the other by its
        // service, unasked), so wait for those before counting.
        let want: Vec<(Rank, u64)> = lanes
            .iter()
            .flat_map(|&l| {
                let s = LaneSpec::at(policy, ranks, l).expect("a lane");
                [(s.members[0], l), (s.members[1], l)]
            })
            .collect();
        let start = Instant::now();
        loop {
            let made = job.fabric.made.lock().expect("not poisoned").clone();
            if want.iter().all(|w| made.contains(w)) {
                break;
            }
            proptest::prop_assert!(start.elapsed() < T, "not every lane made on both ranks");
            std::thread::sleep(Duration::from_millis(1));
        }
        let job = Arc::try_unwrap(job).ok().expect("one holder");
        let fabric = job.stop();
        let mut made = fabric.made.lock().expect("not poisoned").clone();
        made.sort();
        let mut starts = fabric.starts.lock().expect("not poisoned").clone();
        starts.sort();
        let mut expected = want.clone();
        expected.sort();
        proptest::prop_assert_eq!(&made, &expected, "each lane made once per rank");
        proptest::prop_assert_eq!(&starts, &expected, "each part started once");
        proptest::prop_assert_eq!(fabric.parts.lock().expect("not poisoned").len(), lanes.len(), "one id per lane");
        proptest::prop_assert!(fabric.abandoned.lock().expect("not poisoned").is_empty());
    }
}

/// The in-process board, rigged for the tests below: it loses the first
/// message of each kind in `lose` (`join`, `make`), as a store whose reader
/// died with it would; it counts its inbox reads; and it asks to be read
/// every `every`, as the store does.
#[derive(Debug, Default)]
struct Rigged {
    inner: LocalBoard,
    lose: Mutex<Vec<&'static str>>,
    every: Duration,
    reads: AtomicU64,
}

impl Board for Rigged {
    fn post(&self, from: Rank, to: Rank, tag: &str) -> Result<()> {
        self.inner.post(from, to, tag)
    }

    fn take(&self, from: Rank, to: Rank, tag: &str, timeout: Duration) -> Result<bool> {
        self.inner.take(from, to, tag, timeout)
    }

    fn mail(&self, to: Rank, message: &[u8]) -> Result<()> {
        let mut lose = self.lose.lock().expect("not poisoned");
        if let Some(i) = lose.iter().position(|k| message.starts_with(k.as_bytes())) {
            lose.remove(i);
            return Ok(());
        }
        self.inner.mail(to, message)
    }

    fn inbox(&self, me: Rank, timeout: Duration) -> Result<Option<Vec<u8>>> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.inner.inbox(me, timeout)
    }

    fn inbox_every(&self) -> Duration {
        self.every
    }
}

#[test]
fn a_lost_want_make_or_join_is_sent_again() {
    for lose in [
        vec!["join"],
        vec!["make"],
        vec!["make", "join"],
        vec!["want"],
    ] {
        let board = Arc::new(Rigged {
            lose: Mutex::new(lose.clone()),
            ..Rigged::default()
        });
        let job = job_on(board.clone(), 2, Policy::PerDirection, T, &[0, 1]);
        // Rank 1 (not the owner) needs lane 1->0: it asks with `make`, the
        // owner answers with `join`.
        let start = Instant::now();
        job.need(1, Dir::Send, 0).expect("made despite the loss");
        assert!(
            start.elapsed() < T / 2,
            "{lose:?}: took {:?}",
            start.elapsed()
        );
        assert!(
            board.lose.lock().expect("not poisoned").is_empty(),
            "{lose:?}: nothing was lost"
        );
        job.stop();
    }
}

#[test]
fn lane_settings_parse_what_the_environment_may_say_and_name_the_rest() {
    use crate::{LaneConnect, LaneMode};
    assert_eq!("eager".parse::<LaneMode>(), Ok(LaneMode::Eager));
    assert_eq!("lazy".parse::<LaneMode>(), Ok(LaneMode::Lazy));
    let e = "Lazy".parse::<LaneMode>().unwrap_err();
    assert!(
        e.contains("`Lazy`") && e.contains("`eager` or `lazy`"),
        "{e}"
    );
    assert_eq!("both".parse::<LaneConnect>(), Ok(LaneConnect::Both));
    assert_eq!("one-way".parse::<LaneConnect>(), Ok(LaneConnect::OneWay));
    let e = "oneway".parse::<LaneConnect>().unwrap_err();
    assert!(
        e.contains("`oneway`") && e.contains("`both` or `one-way`"),
        "{e}"
    );
}

#[test]
fn a_service_making_a_lane_reads_the_store_at_the_stores_pace() {
    // The parts' progress is polled every 2 ms; across processes each
    // inbox read is a request to the store, which asks for one every
    // 20 ms: two services making one lane for 600 ms read it some 60
    // times, not some 600.
    let board = Arc::new(Rigged {
        every: crate::store::STORE_INBOX_EVERY,
        ..Rigged::default()
    });
    let job = Arc::new(job_on(board.clone(), 2, Policy::PerDirection, T, &[0, 1]));
    job.fabric.hold.store(true, Ordering::Release);
    let j = job.clone();
    let need = std::thread::spawn(move || j.need(0, Dir::Send, 1));
    // Both parts started (each service read its `make` or `join`).
    let start = Instant::now();
    while job.fabric.starts.lock().expect("not poisoned").len() < 2 {
        assert!(start.elapsed() < T, "the parts never started");
        std::thread::sleep(Duration::from_millis(1));
    }
    let before = board.reads.load(Ordering::Relaxed);
    let held = Instant::now();
    std::thread::sleep(Duration::from_millis(600));
    let reads = board.reads.load(Ordering::Relaxed) - before;
    let ms = held.elapsed().as_millis() as u64;
    job.fabric.hold.store(false, Ordering::Release);
    need.join().unwrap().expect("made once released");
    // Each service: one read per 20 ms, and one more at each end.
    let most = 2 * (ms / 20 + 2);
    assert!(
        reads <= most,
        "{reads} inbox reads in {ms} ms while making: more than {most}"
    );
    Arc::try_unwrap(job).ok().expect("one owner").stop();
}
