//! `IssueMatch` (the issue check of R3 and R8 alone) refuses a launch
//! exactly when the whole machine's check does, and gives the same FIFO
//! positions, on random launches of three ranks over two connected
//! communicators and a copy-engine lane; over communicators connected on first use it refuses
//! whatever the machine refuses (and more: it counts a partner the model
//! still holds in its handshake, R7, which NCCL has been called with).

use std::sync::Arc;

use duplex::machine::issue::IssueMatch;
use duplex::machine::{HostCall, LaunchSpec, Machine, OpSpec, Origin, Setup, ThreadId};
use duplex::{DType, Dir, Model};

struct Rng(u64);

impl Rng {
    fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

#[test]
fn issue_match_refuses_exactly_what_the_machine_refuses() {
    compare(true);
}

#[test]
fn on_cold_communicators_issue_match_refuses_at_least_what_the_machine_refuses() {
    compare(false);
}

fn compare(warm: bool) {
    let mut unreceived = 0;
    let mut refused = 0;
    let mut refused_to_itself = 0;
    let mut accepted = 0;
    for seed in 1..600u64 {
        for one_sided in [false, true] {
            let model = Model {
                one_sided_groups: one_sided,
                ..Model::default()
            };
            let mut setup = Setup::new(3, model);
            let comms = [
                setup.add_comm("a", vec![0, 1, 2], warm),
                setup.add_comm("b", vec![0, 1, 2], warm),
                // A copy-engine lane: grouping does not count (C6).
                setup.add_copy_lane("c", vec![0, 1, 2]),
            ];
            let threads: Vec<ThreadId> = (0..3).map(|r| setup.add_thread(r, "main")).collect();
            let streams: Vec<_> = (0..3).map(|r| setup.add_stream(r, "s")).collect();
            let origin = setup.add_origin(duplex::machine::OriginInfo::line("x".into(), 1));
            let mut m = Machine::new(Arc::new(setup));
            let mut check = IssueMatch::new(one_sided);
            check.copy_lane(comms[2]);
            let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
            for _ in 0..40 {
                let rank = rng.next(3) as u32;
                let n = 1 + rng.next(3) as usize;
                let grouped = n > 1 || rng.next(2) == 0;
                let mut ops: Vec<OpSpec> = (0..n)
                    .map(|_| {
                        let peer = (rank + 1 + rng.next(2) as u32) % 3;
                        OpSpec {
                            dir: if rng.next(2) == 0 {
                                Dir::Send
                            } else {
                                Dir::Recv
                            },
                            peer,
                            bytes: [4, 8][rng.next(2) as usize],
                            dtype: [DType::U8, DType::F32][rng.next(4).min(1) as usize],
                            comm: comms[rng.next(3) as usize],
                            stream: streams[rank as usize],
                            origin: None,
                        }
                    })
                    .collect();
                // A message to itself, now and then: both sides in this
                // launch (R12), which is where R3 compares them; their
                // sizes and types agree only by chance.
                let mut to_itself = false;
                if rng.next(4) == 0 {
                    let comm = comms[rng.next(3) as usize];
                    let mut side = |dir| OpSpec {
                        dir,
                        peer: rank,
                        bytes: [4, 8][rng.next(2) as usize],
                        dtype: [DType::U8, DType::F32][rng.next(4).min(1) as usize],
                        comm,
                        stream: streams[rank as usize],
                        origin: None,
                    };
                    let (a, b) = (side(Dir::Send), side(Dir::Recv));
                    to_itself = (a.bytes, a.dtype) != (b.bytes, b.dtype);
                    let at = rng.next(ops.len() as u64 + 1) as usize;
                    if rng.next(2) == 0 {
                        ops.insert(at, a);
                        ops.push(b);
                    } else {
                        ops.insert(at, b);
                        ops.push(a);
                    }
                }
                let grouped = grouped || ops.len() > 1;
                let spec = LaunchSpec {
                    ops,
                    grouped,
                    origin: Origin(origin.0),
                };
                let call = HostCall::Launch(spec.clone());
                let t = threads[rank as usize];
                // The thread first finishes a handshake the model lets it
                // finish (as the registry's live machine does); one still
                // waiting for its peer (R7) makes no call now.
                while m.next(t) == duplex::machine::Next::Resume {
                    m.resume(t).expect("resume");
                }
                if !m.enabled(t, &call) {
                    assert!(!warm, "a launch on a connected communicator is enabled");
                    continue;
                }
                let (bad, fifos) = check.check(rank, &spec.ops, spec.is_group());
                let machine = m.check_issue(t, &call);
                if warm {
                    assert_eq!(
                        bad.is_some(),
                        machine.is_err(),
                        "seed {seed}, one-sided {one_sided}: {spec:?}: {machine:?}"
                    );
                } else {
                    assert!(
                        bad.is_some() || machine.is_ok(),
                        "seed {seed}, one-sided {one_sided}: {spec:?}: {machine:?}"
                    );
                }
                if warm && to_itself {
                    // The two disagree: both checks refuse, whatever else
                    // the launch holds.
                    assert!(
                        bad.is_some() && machine.is_err(),
                        "seed {seed}: a message to itself that disagrees: {spec:?}"
                    );
                    refused_to_itself += 1;
                }
                if bad.is_some() || machine.is_err() {
                    refused += 1;
                    continue;
                }
                accepted += 1;
                if warm {
                    assert_eq!(
                        fifos.to_vec(),
                        m.fifo_positions(t, &call),
                        "seed {seed}: {spec:?}"
                    );
                }
                m.apply(t, &call).expect("checked");
                check.issue(rank, &spec.ops, spec.is_group());
            }
            if warm {
                // The sends no recv met (the end check of a local run,
                // `IssueMatch::unreceived`): the machine's own unmatched
                // sends, channel by channel, the first FIFO position and
                // how many.
                let mut machine: std::collections::BTreeMap<(String, u32, u32), (u64, u32)> =
                    std::collections::BTreeMap::new();
                for o in m.unmatched().into_iter().filter(|o| o.op == Dir::Send) {
                    let e = machine
                        .entry((o.comm.clone(), o.rank, o.peer))
                        .or_insert((o.fifo, 0));
                    e.0 = e.0.min(o.fifo);
                    e.1 += 1;
                }
                let names = ["a", "b", "c"];
                let ours: std::collections::BTreeMap<(String, u32, u32), (u64, u32)> = check
                    .unreceived()
                    .into_iter()
                    .map(|((c, from, to), fifo, n, _)| {
                        ((names[c.0 as usize].to_string(), from, to), (fifo, n))
                    })
                    .collect();
                assert_eq!(ours, machine, "seed {seed}, one-sided {one_sided}");
                unreceived += ours.len();
            }
        }
    }
    assert!(
        !warm || unreceived > 100,
        "{unreceived} channels with unreceived sends"
    );
    assert!(
        !warm || refused_to_itself > 100,
        "{refused_to_itself} launches refused for a message to itself"
    );
    // Both answers occur often enough for the comparison to mean something.
    assert!(
        refused > 1000 && accepted > 1000,
        "{refused} refused, {accepted} accepted"
    );
}

/// One process per rank: the check sees one rank's launches, so a channel
/// to another rank only counts its messages (their positions stay right)
/// while a message to itself is still compared with its partner.
#[test]
fn a_check_of_one_rank_counts_other_ranks_channels_and_compares_its_own() {
    let op = |dir, peer, bytes| OpSpec {
        dir,
        peer,
        bytes,
        dtype: DType::U8,
        comm: duplex::machine::CommId(0),
        stream: duplex::machine::StreamId(0),
        origin: None,
    };
    let mut whole = IssueMatch::new(false);
    let mut mine = IssueMatch::one_rank(false, 0);
    for i in 0..10_000u64 {
        let ops = [op(Dir::Send, 1, i % 7), op(Dir::Recv, 1, 8)];
        assert_eq!(whole.check(0, &ops, true), mine.check(0, &ops, true));
        whole.issue(0, &ops, true);
        mine.issue(0, &ops, true);
    }
    let next = [op(Dir::Send, 1, 4)];
    let (bad, fifos) = mine.check(0, &next, false);
    assert_eq!((bad, fifos.as_slice()), (None, &[10_000][..]));
    // To itself: a send of 4 bytes, then a recv of 5, is a size mismatch.
    mine.issue(0, &[op(Dir::Send, 0, 4)], false);
    let (bad, _) = mine.check(0, &[op(Dir::Recv, 0, 5)], false);
    assert_eq!(bad, Some(0));
}

/// `IssueMatch::issued` counts every op issued on a channel, both sides,
/// however many it has forgotten as matched: what the NCCL backend reads
/// for a rank that finished in one process (a wait whose op that rank
/// never matches ends early), where the trace keeps only recent calls.
#[test]
fn issued_counts_both_sides_of_a_channel_whatever_was_forgotten() {
    let op = |dir, peer, comm| OpSpec {
        dir,
        peer,
        bytes: 4,
        dtype: DType::U8,
        comm: duplex::machine::CommId(comm),
        stream: duplex::machine::StreamId(0),
        origin: None,
    };
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut m = IssueMatch::new(false);
    // (sent, received) per (comm, from, to), counted by hand.
    let mut want = std::collections::HashMap::<(u32, u32, u32), (u64, u64)>::new();
    for _ in 0..20_000 {
        let rank = rng.next(3) as u32;
        let peer = rng.next(3) as u32;
        let comm = rng.next(2) as u32;
        let dir = if rng.next(2) == 0 {
            Dir::Send
        } else {
            Dir::Recv
        };
        if peer == rank {
            continue;
        }
        let o = op(dir, peer, comm);
        m.issue(rank, &[o], false);
        match dir {
            Dir::Send => want.entry((comm, rank, peer)).or_default().0 += 1,
            Dir::Recv => want.entry((comm, peer, rank)).or_default().1 += 1,
        }
    }
    assert!(want.values().any(|(s, r)| s != r), "some channel one-sided");
    for comm in 0..3 {
        for from in 0..3 {
            for to in 0..3 {
                let expect = want.get(&(comm, from, to)).copied().unwrap_or((0, 0));
                assert_eq!(
                    m.issued(duplex::machine::CommId(comm), from, to),
                    expect,
                    "comm {comm}, {from} -> {to}"
                );
            }
        }
    }
}
