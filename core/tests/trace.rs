//! The trace a backend records replays through the machine to the state the
//! backend saw: on every example, a run of the machine is recorded as a
//! [`Trace`], replayed, and the replay must reach the same verdict with the
//! same explanation and refuse nothing. Split by rank (as one process per
//! rank records it) and merged again, it must too. A call the model cannot
//! allow is refused, never dropped.

use std::path::PathBuf;

use duplex::compile::{Compiled, Remaining, compile};
use duplex::machine::{HostCall, Machine, Next, Status, ThreadId};
use duplex::trace::{Call, Trace, TraceCall, TraceOp};

/// A trace's launch of one op by `thread`: `bytes` to or from `peer` on
/// communicator `comm` and stream `stream`, written `text`.
fn one_op(
    thread: u32,
    dir: duplex::Dir,
    peer: u32,
    bytes: u64,
    (comm, stream): (u32, u32),
    text: &str,
) -> TraceCall {
    TraceCall {
        thread,
        call: Call::Launch {
            ops: vec![TraceOp {
                dir,
                peer,
                bytes,
                dtype: duplex::DType::U8,
                comm,
                stream,
            }]
            .into(),
            grouped: false,
        },
        text: text.into(),
        place: "x".into(),
    }
}

/// A trace's `synchronize` of every stream by `thread`.
fn synchronize(thread: u32) -> TraceCall {
    TraceCall {
        thread,
        call: Call::Sync { stream: None },
        text: "synchronize".into(),
        place: "x".into(),
    }
}

fn examples() -> Vec<(String, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut out: Vec<(String, String)> = std::fs::read_dir(&dir)
        .expect("examples/ exists")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "sched"))
        .map(|p| {
            (
                p.file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned(),
                std::fs::read_to_string(&p).expect("readable"),
            )
        })
        .collect();
    out.sort();
    out
}

/// Runs the program to its end or a stuck state, always stepping the last
/// runnable thread (an interleaving unlike the checker's first choice),
/// and records every call made. `None` when a program error stops it.
fn run(c: &Compiled) -> Option<(Machine, Vec<(ThreadId, HostCall)>)> {
    run_noting_quiet(c).map(|r| (r.machine, r.calls))
}

#[test]
fn every_example_replays_from_its_trace_to_the_same_state() {
    let mut checked = 0;
    for (name, text) in examples() {
        let program = duplex::schedule::parse(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
        let c = compile(&program);
        let Some((m, calls)) = run(&c) else {
            continue; // a program error: nothing to compare
        };
        let status = m.status(&Remaining(&c));
        let trace = Trace::from_calls(&c.setup, calls.iter().map(|(t, c)| (*t, c)));
        // Only what happened is in the trace: a stuck state's pending next
        // calls (an `await` that never returns) are not, so compare what the
        // machine says without knowledge of the future.
        let a = trace.analyze(program.model);
        assert!(
            a.disagreements.is_empty(),
            "{name}: the model refuses its own run: {:?}",
            a.disagreements
        );
        let merged = Trace::merge(&trace.parts()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let b = merged.analyze(program.model);
        assert!(
            b.disagreements.is_empty(),
            "{name}: the merged per-rank traces are refused: {:?}",
            b.disagreements
        );
        match status {
            Status::Finished => {
                assert!(
                    a.finished && b.finished,
                    "{name}: finished, replay did not: {} {} {:?} {:?}",
                    a.finished,
                    b.finished,
                    a.stuck.map(|s| s.to_string()),
                    b.stuck.map(|s| s.to_string())
                );
            }
            Status::Stuck => {
                let (sa, sb) = (
                    a.stuck
                        .unwrap_or_else(|| panic!("{name}: replay not stuck")),
                    b.stuck
                        .unwrap_or_else(|| panic!("{name}: merged replay not stuck")),
                );
                assert_eq!(sa.ops.len(), sb.ops.len(), "{name}");
                assert_eq!(sa.cycle.len(), sb.cycle.len(), "{name}:\n{sa}\n{sb}");
            }
            Status::Running => unreachable!("run() stops only when nothing can step"),
        }
        checked += 1;
    }
    assert!(checked >= 30, "only {checked} examples replayed");
}

#[test]
fn a_call_made_too_early_is_a_disagreement() {
    // Rank 0 returned from `await` without rank 1's notify: the model refuses
    // the await and every later call of that thread, and says so.
    let p = duplex::schedule::parse(
        "ranks 2\nrank 0:\n  await 1 go\n  send 1 4KiB\nrank 1:\n  recv 0 4KiB\n  notify 0 go\n",
    )
    .expect("valid");
    let c = compile(&p);
    let calls: Vec<(ThreadId, HostCall)> = (0..2)
        .map(|i| (ThreadId(0), c.scripts[0][i].clone()))
        .collect();
    let trace = Trace::from_calls(&c.setup, calls.iter().map(|(t, c)| (*t, c)));
    let a = trace.analyze(p.model);
    assert_eq!(a.disagreements.len(), 1, "{:?}", a.disagreements);
    let d = &a.disagreements[0];
    assert_eq!((d.rank, d.call.as_str()), (0, "await 1 go"));
    assert!(d.why.contains("notify 0 go"), "{d}");
    assert!(d.why.contains("1 later calls of this rank"), "{d}");
}

#[test]
fn a_trace_naming_what_was_never_declared_is_refused_not_a_panic() {
    let mut t = Trace::new(2);
    t.add_thread(0, "main");
    t.push(TraceCall {
        thread: 0,
        call: Call::Record {
            event: 7,
            stream: 0,
        },
        text: "record".into(),
        place: "".into(),
    });
    let a = t.analyze(duplex::Model::default());
    assert!(
        a.disagreements[0].why.contains("event #7"),
        "{:?}",
        a.disagreements
    );
    let mut t = Trace::new(2);
    t.add_thread(5, "main");
    let a = t.analyze(duplex::Model::default());
    assert!(
        a.disagreements[0].why.contains("rank 5"),
        "{:?}",
        a.disagreements
    );
}

/// What another process published is checked before anything indexes by
/// it: an ended thread, a cut's rank, communicator or peer that names
/// nothing is a disagreement of the analysis (not a panic), and `merge`
/// refuses such a part before it renumbers its ids (which would overflow,
/// or move the bad id onto another part's thread).
#[test]
fn a_published_trace_whose_ends_or_cuts_name_nothing_is_refused_not_a_panic() {
    let part = |rank: u32| {
        let mut t = Trace::new(2);
        t.add_comm("world", &[0, 1], true);
        t.add_thread(rank, "main");
        t
    };
    let mut bad: Vec<(Trace, &str)> = Vec::new();
    let mut t = part(0);
    t.ended.push(7);
    bad.push((t, "thread #7 ended"));
    let mut t = part(0);
    t.ended.push(u32::MAX);
    bad.push((t, "ended"));
    for (rank, comm, peer, what) in [
        (9, 0, 1, "rank 9"),
        (0, 3, 1, "communicator #3"),
        (0, 0, 2, "peer 2"),
    ] {
        let mut t = part(0);
        t.cuts.push(duplex::trace::Cut {
            rank,
            sent: vec![(comm, peer, u64::MAX)],
            ..Default::default()
        });
        bad.push((t, what));
    }
    let mut t = part(0);
    t.cuts.push(duplex::trace::Cut {
        rank: 0,
        notified: vec![(4, "go".into(), 1)],
        ..Default::default()
    });
    bad.push((t, "rank 4"));
    // Counts in range but at the end of the message numbers: the next
    // delivery would overflow them. Refused by the replay's settle (it
    // names the channel), never a panic.
    let mut t = part(0);
    t.cuts.push(duplex::trace::Cut {
        rank: 0,
        sent: vec![(0, 1, u64::MAX)],
        ..Default::default()
    });
    let mut u = part(1);
    u.cuts.push(duplex::trace::Cut {
        rank: 1,
        received: vec![(0, 0, u64::MAX)],
        ..Default::default()
    });
    let whole = Trace::merge(&[t, u]).expect("ids in range");
    let a = whole.analyze(duplex::Model::default());
    assert!(
        a.disagreements.len() == 1 && a.disagreements[0].why.contains("numbered to"),
        "{:?}",
        a.disagreements
    );
    let mut t = part(0);
    t.cuts.push(duplex::trace::Cut {
        rank: 0,
        rounds: vec![(0, 1, u32::MAX)],
        ..Default::default()
    });
    let a = t.analyze(duplex::Model::default());
    assert!(
        a.disagreements.len() == 1 && a.disagreements[0].why.contains("setup rounds"),
        "{:?}",
        a.disagreements
    );
    for (t, what) in &bad {
        let a = t.analyze(duplex::Model::default());
        assert!(
            a.disagreements.len() == 1 && a.disagreements[0].why.contains(what),
            "{what}: {:?}",
            a.disagreements
        );
        assert!(a.stuck.is_none());
        // As the second part of a job: refused by the merge, naming it.
        let e = Trace::merge(&[part(1), t.clone()]).expect_err(what);
        assert!(
            e.contains("trace part 1") && e.contains(what),
            "{what}: {e}"
        );
    }
    // The same parts without the bad ids merge and replay.
    let whole = Trace::merge(&[part(0), part(1)]).expect("well-formed parts");
    assert!(
        whole
            .analyze(duplex::Model::default())
            .disagreements
            .is_empty()
    );
}

/// Both ranks send to each other on copy-engine lanes, then synchronize:
/// neither send completes before its recv is posted (C3), a cycle. A
/// backend's trace holds a sync only while it is blocked, so what one
/// rank published decides whether an analysis finds the cycle: with its
/// sync blocked, the cycle stands; published just after its sync stopped
/// being blocked (its thread neither blocked nor ended), the rank looks
/// free to go on and issue the recvs, and no cycle is found. So a backend
/// must publish a rank's trace with the sync still blocked while the sync
/// has not returned (the NCCL backend's `NcclRank::verified`).
#[test]
fn a_sync_missing_from_a_published_trace_hides_the_cycle() {
    let p = duplex::schedule::parse(
        "ranks 2\npolicy per-direction copy-from=0\nrank 0:\n  send 1 4KiB\n  sync\nrank 1:\n  send 0 4KiB\n  sync\n",
    )
    .expect("valid");
    let c = compile(&p);
    let trace = |rank0_blocked: bool| {
        // Each rank's send; its sync is in the trace only while blocked.
        let calls: Vec<(ThreadId, HostCall)> = (0..2u32)
            .map(|r| (ThreadId(r), c.scripts[r as usize][0].clone()))
            .collect();
        let mut t = Trace::from_calls(&c.setup, calls.iter().map(|(t, c)| (*t, c)));
        let syncs: Vec<(ThreadId, HostCall)> = (0..2u32)
            .map(|r| (ThreadId(r), c.scripts[r as usize][1].clone()))
            .collect();
        let blocked = Trace::from_calls(&c.setup, syncs.iter().map(|(t, c)| (*t, c)));
        for s in blocked.calls {
            if s.thread == 1 || rank0_blocked {
                t.block(s.thread, Some(s));
            }
        }
        t
    };
    let both = trace(true).analyze(p.model);
    let stuck = both.stuck.expect("a hang");
    assert_eq!(stuck.cycle.len(), 4, "{stuck:?}");
    assert!(both.disagreements.is_empty(), "{:?}", both.disagreements);
    let unblocked = trace(false).analyze(p.model);
    let stuck = unblocked.stuck.expect("rank 1 is still blocked");
    assert!(
        stuck.cycle.is_empty() && stuck.missing.is_empty(),
        "rank 0 looks free to issue the recvs: {stuck:?}"
    );
}

/// A run of a program ([`run`]).
struct Run {
    machine: Machine,
    calls: Vec<(ThreadId, HostCall)>,
    /// `quiet[r]`: how many calls rank `r` had made at each point where it
    /// was quiet: none of its ops live and none of its threads waiting (in
    /// a `sync`, an `await`, a `join` or a handshake), so where its trace
    /// may be cut.
    quiet: Vec<Vec<usize>>,
}

/// [`run`], noting where each rank is quiet ([`Run::quiet`]).
fn run_noting_quiet(c: &Compiled) -> Option<Run> {
    let mut m = c.machine();
    let mut calls = Vec::new();
    let ranks = c.setup.ranks;
    let mut made = vec![0usize; ranks as usize];
    let mut quiet = vec![Vec::new(); ranks as usize];
    loop {
        for r in 0..ranks {
            let live = m
                .live_ops()
                .iter()
                .any(|(op, _)| c.setup.threads[op.launch.thread.0 as usize].rank == r);
            let waiting = c
                .setup
                .threads_of(r)
                .any(|t| !matches!(m.next(t), Next::Call | Next::Finished));
            let q = &mut quiet[r as usize];
            if !live && !waiting && q.last() != Some(&made[r as usize]) {
                q.push(made[r as usize]);
            }
        }
        let runnable = m.runnable(&Remaining(c));
        let Some(&t) = runnable.last() else {
            return Some(Run {
                machine: m,
                calls,
                quiet,
            });
        };
        match m.next(t) {
            Next::Resume => m.resume(t).ok()?,
            Next::Call => {
                let call = c.call(t, m.calls(t)).cloned().unwrap_or(HostCall::End);
                calls.push((t, call.clone()));
                made[c.setup.threads[t.0 as usize].rank as usize] += 1;
                m.apply(t, &call).ok()?;
            }
            Next::Blocked | Next::Finished => unreachable!("runnable"),
        }
    }
}

/// A long run in one process per rank keeps its trace bounded by cutting
/// it where the rank is quiet (`Trace::cut`): on every example, under both
/// policies, with each rank's trace cut at its first, middle and last
/// quiet point (and the ranks cut at different points, so that a channel's
/// sides are cut at different messages), the merged replay must reach the
/// same verdict with the same explanation as the whole traces, and refuse
/// nothing.
#[test]
fn traces_cut_where_each_rank_is_quiet_explain_the_same_state() {
    let (mut compared, mut folded, mut unbalanced) = (0, 0, 0);
    for (name, text) in examples() {
        let mut program = duplex::schedule::parse(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
        for policy in [duplex::Policy::Shared, duplex::Policy::PerDirection] {
            program.policy = policy;
            let c = compile(&program);
            let Some(Run {
                machine: m,
                calls,
                quiet,
            }) = run_noting_quiet(&c)
            else {
                continue;
            };
            let status = m.status(&Remaining(&c));
            let whole = Trace::from_calls(&c.setup, calls.iter().map(|(t, c)| (*t, c)));
            let parts = whole.parts();
            let full = Trace::merge(&parts)
                .unwrap_or_else(|e| panic!("{name}: {e}"))
                .analyze(program.model);
            let choices: [fn(&[usize], usize) -> usize; 4] = [
                |q, _| q.first().copied().unwrap_or(0),
                |q, _| q.get(q.len() / 2).copied().unwrap_or(0),
                |q, _| q.last().copied().unwrap_or(0),
                // Rank-dependent: even ranks late, odd ranks early.
                |q, r| {
                    if r % 2 == 0 { q.last() } else { q.first() }
                        .copied()
                        .unwrap_or(0)
                },
            ];
            for (k, choose) in choices.iter().enumerate() {
                let mut cut_parts = parts.clone();
                let mut points = Vec::new();
                for (r, part) in cut_parts.iter_mut().enumerate() {
                    let at = choose(&quiet[r], r);
                    folded += part.cut(at);
                    points.push(at);
                }
                let counts: Vec<_> = cut_parts.iter().flat_map(|p| p.cuts.clone()).collect();
                if counts.iter().any(|a| {
                    a.sent.iter().any(|&(comm, peer, n)| {
                        let got = counts
                            .iter()
                            .find(|b| b.rank == peer)
                            .and_then(|b| b.received.iter().find(|x| x.0 == comm && x.1 == a.rank))
                            .map_or(0, |x| x.2);
                        got != n
                    })
                }) {
                    unbalanced += 1;
                }
                let merged = Trace::merge(&cut_parts).unwrap_or_else(|e| panic!("{name}: {e}"));
                // The cuts survive the wire format the backend publishes.
                let json = serde_json::to_string(&merged).expect("a trace encodes");
                let merged: Trace = serde_json::from_str(&json).expect("and decodes");
                let a = merged.analyze(program.model);
                let what = format!("{name} ({policy:?}), cuts #{k} at {points:?}");
                // What each channel carried counts the same cut or whole
                // (the end check of a process job, `Trace::channel_counts`).
                assert_eq!(
                    merged.channel_counts(),
                    Trace::merge(&parts).expect("joins").channel_counts(),
                    "{what}: the cuts lost messages"
                );
                assert!(
                    a.disagreements.is_empty(),
                    "{what}: the cut traces are refused: {:?}",
                    a.disagreements
                );
                match status {
                    Status::Finished => assert!(
                        a.finished && full.finished,
                        "{what}: finished, the cut replay did not: {:?}",
                        a.stuck.map(|s| s.to_string())
                    ),
                    Status::Stuck => {
                        let sf = full
                            .stuck
                            .clone()
                            .unwrap_or_else(|| panic!("{what}: whole replay not stuck"));
                        let sc = a
                            .stuck
                            .unwrap_or_else(|| panic!("{what}: cut replay not stuck"));
                        assert_eq!(sf.to_string(), sc.to_string(), "{what}");
                    }
                    Status::Running => unreachable!("run() stops only when nothing can step"),
                }
                compared += 1;
            }
        }
    }
    eprintln!(
        "{compared} cut replays, {folded} calls folded, {unbalanced} with a channel's sides apart"
    );
    assert!(compared >= 200, "only {compared} cut replays compared");
    assert!(folded > 400, "only {folded} calls folded into cuts");
    assert!(
        unbalanced > 10,
        "only {unbalanced} cut replays left a channel's sides apart"
    );
}

/// A cut keeps `notify` counts either way round: the receiver may have
/// consumed (before its cut) a message whose `notify` the sender made
/// after its own, so the replay owes it one; or the sender posted more
/// than the receiver took, and they wait in the mailbox.
#[test]
fn a_settled_machine_keeps_notify_counts_either_way_round() {
    use duplex::machine::{OriginInfo, Settled, Setup};
    use std::sync::Arc;
    let machine = |posted: u32, consumed: u32| {
        let mut setup = Setup::new(2, duplex::Model::default());
        let t0 = setup.add_thread(0, "main");
        let t1 = setup.add_thread(1, "main");
        let tag = setup.tag("ready");
        let origin = setup.add_origin(OriginInfo::at("call", "here"));
        let mut m = Machine::new(Arc::new(setup));
        let mut settled = Settled::default();
        settled.mail.insert((0, 1, tag), (posted, consumed));
        m.settle_from(&settled).expect("a fresh machine settles");
        let notify = HostCall::Notify { to: 1, tag, origin };
        let wait = HostCall::Await {
            from: 0,
            tag,
            origin,
        };
        (m, t0, t1, notify, wait)
    };
    // Owed one: the first notify after the cut pays it back.
    let (mut m, t0, t1, notify, wait) = machine(0, 1);
    assert!(!m.enabled(t1, &wait));
    m.apply(t0, &notify).expect("notify");
    assert!(!m.enabled(t1, &wait), "the notify paid the debt");
    m.apply(t0, &notify).expect("notify");
    assert!(m.enabled(t1, &wait));
    // Two posted, one taken: one waits in the mailbox.
    let (mut m, _, t1, _, wait) = machine(2, 1);
    assert!(m.enabled(t1, &wait));
    m.apply(t1, &wait).expect("await");
    assert!(!m.enabled(t1, &wait));
    // Only a fresh machine settles, and a channel of what does not exist
    // is refused, not a panic (cuts come from other processes).
    let (mut m, t0, _, notify, _) = machine(0, 0);
    m.apply(t0, &notify).expect("notify");
    assert!(m.settle_from(&Settled::default()).is_err());
    let mut bad = Settled::default();
    bad.channels
        .insert((duplex::machine::CommId(7), 0, 9), (3, 1));
    let mut fresh = Machine::new(Arc::new(Setup::new(2, duplex::Model::default())));
    assert!(fresh.settle_from(&bad).is_err());
    // Nor is a count no run reaches between two cuts.
    let mut setup = Setup::new(2, duplex::Model::default());
    setup.add_comm("world", vec![0, 1], true);
    let mut far = Settled::default();
    far.channels
        .insert((duplex::machine::CommId(0), 0, 1), (u64::MAX, 0));
    let mut fresh = Machine::new(Arc::new(setup));
    assert!(fresh.settle_from(&far).is_err());
}

/// A channel's message numbers go past 2^32: a long run (a server that
/// sends small messages for days) settles from cuts whose counts passed
/// them, and goes on numbering; they were 32 bits and wrapped, so a recv
/// after the wrap was judged against a finished peer's count as "never
/// matched".
#[test]
fn message_numbers_go_on_past_two_to_the_32() {
    use duplex::Dir;
    use duplex::machine::{LaunchSpec, OpSpec, OriginInfo, Settled, Setup};
    use std::sync::Arc;
    let mut setup = Setup::new(2, duplex::Model::default());
    let world = setup.add_comm("world", vec![0, 1], true);
    let t0 = setup.add_thread(0, "main");
    let t1 = setup.add_thread(1, "main");
    let s0 = setup.add_stream(0, "s");
    let s1 = setup.add_stream(1, "s");
    let origin = setup.add_origin(OriginInfo::at("call", "here"));
    let mut m = Machine::new(Arc::new(setup));
    let n: u64 = (1 << 32) + 2;
    let mut settled = Settled::default();
    // Rank 0 sent n; rank 1 received n - 1: one send is buffered.
    settled.channels.insert((world, 0, 1), (n, n - 1));
    m.settle_from(&settled).expect("a count past 2^32 settles");
    let launch = |dir, peer, stream| {
        HostCall::Launch(LaunchSpec {
            ops: vec![OpSpec {
                dir,
                peer,
                bytes: 0,
                dtype: duplex::DType::U8,
                comm: world,
                stream,
                origin: None,
            }],
            grouped: false,
            origin,
        })
    };
    let recv = launch(Dir::Recv, 0, s1);
    assert_eq!(m.fifo_positions(t1, &recv), vec![n - 1]);
    m.apply(t1, &recv)
        .expect("the recv meets the buffered send");
    let send = launch(Dir::Send, 1, s0);
    assert_eq!(m.fifo_positions(t0, &send), vec![n]);
    m.apply(t0, &send).expect("a send past 2^32");
    let unmatched = m.unmatched();
    assert!(
        unmatched.iter().any(|o| o.fifo == n),
        "{:?}",
        unmatched.iter().map(|o| o.fifo).collect::<Vec<_>>()
    );
}

/// A split as the NCCL backend records it (`check::split_tag`): a notify
/// to every other rank on arrival, and the thread blocked in an await of
/// each, in order. The analysis makes the awaits whose rank has arrived and
/// finds the thread blocked at the first it does not: with three ranks,
/// ranks 0 and 2 inside the split and rank 1 waiting for a message rank 0
/// sends only after it, rank 0 is blocked at its first await (of rank 1)
/// though its second (of rank 2) could be made, and the cycle runs from
/// rank 0's wait for rank 1 to rank 1's wait for rank 0.
#[test]
fn a_split_blocked_at_its_first_rank_not_arrived_names_the_cycle() {
    let tag = duplex::transport::check::split_tag(0, "x");
    let mut t = Trace::new(3);
    t.add_comm("world", &[0, 1, 2], true);
    let threads: Vec<u32> = (0..3).map(|r| t.add_thread(r, "main")).collect();
    let call = |thread: u32, call: Call, text: &str| TraceCall {
        thread,
        call,
        text: text.into(),
        place: "x.rs:1:1".into(),
    };
    for r in [0u32, 2] {
        let others: Vec<u32> = (0..3).filter(|o| *o != r).collect();
        for &to in &others {
            t.push(call(
                threads[r as usize],
                Call::Notify {
                    to,
                    tag: tag.clone(),
                },
                "arrives",
            ));
        }
        let waits = others
            .iter()
            .map(|&from| {
                call(
                    threads[r as usize],
                    Call::Await {
                        from,
                        tag: tag.clone(),
                    },
                    &format!("waits for rank {from} to arrive"),
                )
            })
            .collect();
        t.block_in(threads[r as usize], waits);
    }
    t.block(
        threads[1],
        Some(call(
            threads[1],
            Call::Await {
                from: 0,
                tag: "go".into(),
            },
            "await 0 go",
        )),
    );
    let a = t.analyze(duplex::Model::default());
    assert!(a.disagreements.is_empty(), "{:?}", a.disagreements);
    let stuck = a.stuck.expect("stuck");
    let text = stuck.to_string();
    assert!(!stuck.cycle.is_empty(), "{text}");
    assert!(text.contains("waits for rank 1 to arrive"), "{text}");
    assert!(text.contains("await 0 go"), "{text}");
    assert!(
        !text.contains("waits for rank 2 to arrive"),
        "rank 2 has arrived: {text}"
    );
}

/// A split every rank reached that still did not return (NCCL's split
/// overstayed, or its new communicator's setup): the analysis keeps each
/// thread at its split's last await, which the model could make, so it
/// predicts no hang there, rather than showing the threads at their end.
#[test]
fn a_split_every_rank_reached_stays_at_its_last_await() {
    let tag = duplex::transport::check::split_tag(0, "x");
    let mut t = Trace::new(2);
    t.add_comm("world", &[0, 1], true);
    let threads: Vec<u32> = (0..2).map(|r| t.add_thread(r, "main")).collect();
    for r in 0..2u32 {
        let other = 1 - r;
        let call = |call: Call| TraceCall {
            thread: threads[r as usize],
            call,
            text: "split".into(),
            place: "x.rs:1:1".into(),
        };
        t.push(call(Call::Notify {
            to: other,
            tag: tag.clone(),
        }));
        t.block_in(
            threads[r as usize],
            vec![call(Call::Await {
                from: other,
                tag: tag.clone(),
            })],
        );
    }
    let a = t.analyze(duplex::Model::default());
    assert!(a.disagreements.is_empty(), "{:?}", a.disagreements);
    match a.stuck {
        None => {}
        Some(s) => {
            let text = s.to_string();
            assert!(!text.contains("end of thread"), "{text}");
            assert!(text.contains("split"), "{text}");
        }
    }
    assert!(!a.finished, "the threads are inside their split");
}

/// Lanes made on first use are declared by the ranks that made them only:
/// a rank that returned early before making any publishes a trace with
/// fewer communicators, or placeholders where another rank's lanes are.
/// The parts still join (seen on one H200 with lanes made on first use:
/// "trace part 1 declares other communicators than part 0", and the
/// analysis fell back to one rank's calls), and the replay names the recv
/// that rank 1 will never issue; two parts that declare one communicator
/// differently are still refused.
#[test]
fn parts_that_declared_different_lanes_made_on_first_use_still_join() {
    let mut t0 = Trace::new(2);
    t0.add_comm("world", &[0, 1], true);
    // A lane rank 1 made and rank 0 did not: a placeholder on rank 0.
    t0.add_comm("", &[], true);
    let lane01 = t0.add_comm("lane:0->1", &[0, 1], false);
    let main = t0.add_thread(0, "main");
    let s = t0.add_stream(0, "lane:0->1");
    let send = TraceCall {
        thread: main,
        call: Call::Launch {
            ops: vec![TraceOp {
                dir: duplex::Dir::Send,
                peer: 1,
                bytes: 4096,
                dtype: duplex::DType::U8,
                comm: lane01,
                stream: s,
            }]
            .into(),
            grouped: false,
        },
        text: "send 4096 x u8 to rank 1".into(),
        place: "main.rs:3".into(),
    };
    t0.push(send);
    let sync = TraceCall {
        thread: main,
        call: Call::Sync { stream: None },
        text: "synchronize".into(),
        place: "main.rs:4".into(),
    };
    t0.block(main, Some(sync));
    // Rank 1 returned at once: only the world communicator.
    let mut t1 = Trace::new(2);
    t1.add_comm("world", &[0, 1], true);
    let main1 = t1.add_thread(1, "main");
    t1.end(main1);
    for parts in [[t0.clone(), t1.clone()], [t1.clone(), t0.clone()]] {
        let whole = Trace::merge(&parts).expect("the parts join");
        assert_eq!(whole.comms.len(), 3);
        assert_eq!(whole.comms[2].name, "lane:0->1");
        assert!(whole.comms[1].is_undeclared());
        let a = whole.analyze(duplex::Model::default());
        assert!(a.disagreements.is_empty(), "{:?}", a.disagreements);
        let stuck = a.stuck.expect("rank 0's send is never received");
        let text = format!("{stuck}");
        assert!(
            text.contains("lane:0->1") && text.contains("never"),
            "{text}"
        );
    }
    // An op on a communicator that no part declares is refused, naming
    // it, not charged to its rank as a program error (found by review).
    let mut stray = t1.clone();
    let ghost = stray.add_comm("", &[], false);
    let s1 = stray.add_stream(1, "s");
    stray.push(TraceCall {
        thread: main1,
        call: Call::Launch {
            ops: vec![TraceOp {
                dir: duplex::Dir::Recv,
                peer: 0,
                bytes: 4096,
                dtype: duplex::DType::U8,
                comm: ghost,
                stream: s1,
            }]
            .into(),
            grouped: false,
        },
        text: "recv 4096 x u8 from rank 0".into(),
        place: "main.rs:9".into(),
    });
    let mut only_world = Trace::new(2);
    only_world.add_comm("world", &[0, 1], true);
    only_world.add_thread(0, "main");
    let e = Trace::merge(&[only_world.clone(), stray]).expect_err("an op on no communicator");
    assert!(
        e.contains("communicator #1") && e.contains("main.rs:9"),
        "{e}"
    );
    let mut cut = t1.clone();
    cut.add_comm("", &[], true);
    cut.cuts.push(duplex::trace::Cut {
        rank: 1,
        received: vec![(1, 0, 3)],
        ..Default::default()
    });
    let e = Trace::merge(&[only_world, cut]).expect_err("a cut on no communicator");
    assert!(e.contains("communicator #1") && e.contains("cut"), "{e}");
    // A placeholder's flags do not depend on which part came first.
    // (Rank 0's part, which declares the lane as a placeholder copy lane.)
    let mut copyish = Trace::new(2);
    copyish.add_comm("world", &[0, 1], true);
    copyish.add_copy_lane("", &[]);
    copyish.add_thread(0, "main");
    let a = Trace::merge(&[copyish.clone(), t1.clone()]).expect("joins");
    let b = Trace::merge(&[t1.clone(), copyish]).expect("joins");
    assert_eq!(a.comms, b.comms);
    assert!(!a.comms[1].copy);
    // One communicator declared two ways is refused, naming both.
    let mut other = t1.clone();
    other.add_comm("", &[], true);
    other.add_comm("lane:1->0", &[0, 1], false);
    let e = Trace::merge(&[t0, other]).expect_err("conflicting declarations");
    assert!(
        e.contains("communicator #2") && e.contains("lane:0->1") && e.contains("lane:1->0"),
        "{e}"
    );
}

/// Each part of a merge is one rank's, from its own process: two parts of
/// one rank, or a part holding two ranks, are refused (found by review:
/// both were accepted, and the analysis then said "this is a bug").
#[test]
fn a_merge_refuses_a_rank_in_two_parts_and_a_part_of_two_ranks() {
    let part = |ranks: &[u32]| {
        let mut t = Trace::new(2);
        t.add_comm("world", &[0, 1], true);
        for r in ranks {
            t.add_thread(*r, "main");
        }
        t
    };
    assert!(Trace::merge(&[part(&[0]), part(&[1])]).is_ok());
    let e = Trace::merge(&[part(&[0]), part(&[0])]).unwrap_err();
    assert!(e.contains("both rank 0's"), "{e}");
    let e = Trace::merge(&[part(&[0, 1]), part(&[])]).unwrap_err();
    assert!(e.contains("holds ranks 0 and 1"), "{e}");
    // One part alone (a local run's whole trace) holds every rank.
    assert!(Trace::merge(&[part(&[0, 1])]).is_ok());
}

/// A thread the trace shows neither ended nor blocked in a call is outside
/// duplex (running its code, or blocked where duplex does not see it: what
/// an early snapshot catches). The report says so, and a hang that ends at
/// it is not called a bug of the analysis (found by review: "end of
/// thread (its implicit final synchronize)", then "this is a bug").
#[test]
fn a_thread_outside_any_duplex_call_is_said_so_not_called_a_bug() {
    let mut t = Trace::new(2);
    let world = t.add_comm("world", &[0, 1], true);
    let main0 = t.add_thread(0, "main");
    let _main1 = t.add_thread(1, "main");
    let s = t.add_stream(0, "default");
    t.push(one_op(
        main0,
        duplex::Dir::Send,
        1,
        256 << 20,
        (world, s),
        "send 256MiB to rank 1",
    ));
    t.block(main0, Some(synchronize(main0)));
    let a = t.analyze(duplex::Model::default());
    let stuck = a.stuck.expect("rank 0 is stuck");
    let text = format!("{stuck}");
    assert!(!text.contains("this is a bug"), "{text}");
    assert!(text.contains("not inside a duplex call"), "{text}");
    assert!(!text.contains("end of thread"), "{text}");
    // Ended, the same thread is a partner that will never come.
    t.end(_main1);
    let text = format!(
        "{}",
        t.analyze(duplex::Model::default()).stuck.expect("stuck")
    );
    assert!(!text.contains("not inside a duplex call"), "{text}");
}

/// A rank whose trace did not come (it died, most often) after a long
/// run: the other's cut counts its sends to it, and those alone read as a
/// million messages never matched, which the replay refused, and the first
/// channel refused stopped the rest from settling (found by review: "no
/// wait-for cycle was found (this is a bug…)"). A channel to a rank the
/// trace holds nothing of is left unsettled, and what waits on that rank
/// waits on a rank not known, not on one that never comes.
#[test]
fn a_missing_rank_after_a_long_run_leaves_its_channels_unsettled() {
    let mut t = Trace::new(2);
    let world = t.add_comm("world", &[0, 1], true);
    let main0 = t.add_thread(0, "main");
    let s = t.add_stream(0, "default");
    t.cuts.push(duplex::trace::Cut {
        rank: 0,
        calls: 2 << 20,
        sent: vec![(world, 1, 2 << 20)],
        ..Default::default()
    });
    t.push(one_op(
        main0,
        duplex::Dir::Send,
        1,
        256 << 20,
        (world, s),
        "send 256MiB to rank 1",
    ));
    t.block(main0, Some(synchronize(main0)));
    let a = t.analyze(duplex::Model::default());
    assert!(a.disagreements.is_empty(), "{:?}", a.disagreements);
    let text = format!("{}", a.stuck.expect("rank 0 is stuck"));
    assert!(!text.contains("this is a bug"), "{text}");
    // Rank 1's trace is not here: what it would issue is not known, so
    // it is not said never to come (found by a property over moments of
    // runs that complete: a partner read as never coming made a cycle).
    assert!(!text.contains("will ever issue"), "{text}");
    assert!(
        text.contains("may come from rank(s) 1, whose traces are not"),
        "{text}"
    );
}

/// The report does not depend on which rank analyses (the merged parts'
/// order). Rank 1's thread t0 receives on a cold communicator over stream
/// `a`; its main thread's send on `world`, on `a` too, was held back by
/// the NCCL backend until t0's handshake was over, and recorded after.
/// Replayed with rank 1's part first, the send went behind the handshake
/// on their stream, and a cycle was named that never was (found by
/// review): the replay holds a launch back as the backend does.
#[test]
fn a_launch_the_backend_held_back_for_a_handshake_is_replayed_after_it() {
    let launch = |thread: u32, dir, peer: u32, comm: u32, stream: u32, text: &str| {
        one_op(thread, dir, peer, 4096, (comm, stream), text)
    };
    let comms = |t: &mut Trace| {
        t.add_comm("world", &[0, 1], true);
        t.add_comm("c0", &[0, 1], false);
    };
    let mut p0 = Trace::new(2);
    comms(&mut p0);
    let m0 = p0.add_thread(0, "main");
    let s0 = p0.add_stream(0, "default");
    p0.push(launch(m0, duplex::Dir::Send, 1, 1, s0, "send 1 on c0"));
    p0.push(launch(m0, duplex::Dir::Recv, 1, 0, s0, "recv 1 on world"));
    p0.block(
        m0,
        Some(TraceCall {
            thread: m0,
            call: Call::Await {
                from: 1,
                tag: "go".into(),
            },
            text: "await 1 go".into(),
            place: "x".into(),
        }),
    );
    let mut p1 = Trace::new(2);
    comms(&mut p1);
    let m1 = p1.add_thread(1, "main");
    let t1 = p1.add_thread(1, "t0");
    let a = p1.add_stream(1, "a");
    p1.push(launch(t1, duplex::Dir::Recv, 0, 1, a, "recv 0 on c0"));
    p1.push(launch(m1, duplex::Dir::Send, 0, 0, a, "send 0 on world"));
    p1.end(t1);
    p1.end(m1);
    let model = duplex::Model {
        lazy_connect: true,
        ..duplex::Model::default()
    };
    // Recorded by duplex-nccl, which holds such a launch back.
    p0.held_for_streams = true;
    p1.held_for_streams = true;
    for parts in [[p0.clone(), p1.clone()], [p1, p0]] {
        let a = Trace::merge(&parts).expect("joins").analyze(model);
        let s = a.stuck.expect("rank 0 awaits a notify that never comes");
        assert!(s.cycle.is_empty(), "a cycle that never was:\n{s}");
        assert!(a.disagreements.is_empty(), "{:?}", a.disagreements);
    }
}

/// Rank 1's t0 receives on cold `c0` over stream `a` (in its handshake,
/// waiting for rank 0 to issue on `c0`); its main is blocked in a send on
/// `world`, on `a` too, held back; rank 0 synchronizes on a recv of that
/// send.
fn held_back_beside_a_handshake() -> Trace {
    let launch = |thread: u32, dir, peer: u32, comm: u32, stream: u32, text: &str| {
        one_op(thread, dir, peer, 4096, (comm, stream), text)
    };
    let mut t = Trace::new(2);
    t.add_comm("world", &[0, 1], true);
    t.add_comm("c0", &[0, 1], false);
    let (m0, m1, t1) = (
        t.add_thread(0, "main"),
        t.add_thread(1, "main"),
        t.add_thread(1, "t0"),
    );
    let (s0, a) = (t.add_stream(0, "default"), t.add_stream(1, "a"));
    t.push(launch(m0, duplex::Dir::Recv, 1, 0, s0, "recv 1 on world"));
    t.block(m0, Some(synchronize(m0)));
    t.push(launch(t1, duplex::Dir::Recv, 0, 1, a, "recv 0 on c0"));
    t.block(
        m1,
        Some(launch(m1, duplex::Dir::Send, 0, 0, a, "send 0 on world")),
    );
    t
}

/// A thread blocked in a launch the backend held back (and the model lets
/// through) is in a duplex call, not outside one (found by review).
#[test]
fn a_thread_blocked_in_a_held_back_launch_is_inside_a_duplex_call() {
    let t = held_back_beside_a_handshake();
    let an = t.analyze(duplex::Model {
        lazy_connect: true,
        ..Default::default()
    });
    let text = an.stuck.expect("stuck").to_string();
    assert!(!text.contains("not inside a duplex call"), "{text}");
}

/// A launch duplex-nccl held back behind another thread's launch in its
/// handshake on a stream they share (`Trace::held_for_streams`), which the
/// model lets through, is still a wait on that thread: the hang it is part
/// of is a cycle through it. Rank 1's t0 receives on cold `c0` over stream
/// `a`, waiting for rank 0 to issue on `c0`; its main's send on `world`,
/// on `a` too, is held back; rank 0 synchronizes on a recv of that send.
/// Left as a thread that may still move, the held launch freed everything
/// that waited on rank 1 (any of its threads may issue), and the report
/// named no cycle ("this is a bug in duplex's analysis", found by review).
#[test]
fn a_launch_held_back_behind_a_handshake_on_its_stream_is_in_the_cycle() {
    let mut t = held_back_beside_a_handshake();
    t.held_for_streams = true;
    let model = duplex::Model {
        lazy_connect: true,
        ..Default::default()
    };
    for trace in [
        t.clone(),
        Trace::merge(&t.parts()).expect("joins"),
        Trace::merge(&t.parts().into_iter().rev().collect::<Vec<_>>()).expect("joins"),
    ] {
        let an = trace.analyze(model);
        assert!(an.disagreements.is_empty(), "{:?}", an.disagreements);
        let stuck = an.stuck.expect("stuck");
        let text = stuck.to_string();
        assert!(!stuck.cycle.is_empty(), "{text}");
        assert!(
            stuck
                .cycle
                .iter()
                .any(|l| l.node.contains("send 0 on world")),
            "{text}"
        );
        assert!(!text.contains("end of thread"), "{text}");
    }
}

/// Each part of a trace recorded under duplex-nccl's wider hold says so,
/// as every process of that backend records it: [`Trace::parts`] kept
/// nothing of it, and a trace split and merged again was replayed without
/// the hold (its held launches called disagreements; found by review).
/// It survives JSON too.
#[test]
fn parts_of_a_trace_recorded_under_the_wider_hold_keep_it() {
    let mut t = Trace::new(2);
    t.add_comm("world", &[0, 1], true);
    t.add_thread(0, "main");
    t.add_thread(1, "main");
    t.held_for_streams = true;
    assert!(t.parts().iter().all(|p| p.held_for_streams));
    assert!(Trace::merge(&t.parts()).expect("joins").held_for_streams);
    let json = serde_json::to_string(&t).expect("encodes");
    let back: Trace = serde_json::from_str(&json).expect("decodes");
    assert_eq!(back, t);
    t.held_for_streams = false;
    let json = serde_json::to_string(&t).expect("encodes");
    assert!(!json.contains("held_for_streams"), "{json}");
    assert!(!Trace::merge(&t.parts()).expect("joins").held_for_streams);
}

/// Rank 0's trace did not come. Rank 2's main waits in its handshake on
/// the lane to rank 0; rank 1's send to rank 2 waits in its handshake for
/// rank 2's recv, which rank 2's main issues next; rank 2's t0 awaits
/// rank 1's `notify`, which rank 1 makes after its send. Rank 0 may well
/// issue its send: no cycle. It was named (rank 1 ↔ rank 2's t0), rank 0
/// read as never issuing (found by the moments property in
/// tests/tests/properties.rs, under lazy connection, which that property
/// no longer merges).
#[test]
fn a_missing_rank_under_lazy_connection_is_not_a_partner_that_never_comes() {
    let mut t = Trace::new(4);
    let c02 = t.add_comm("pair:0-2", &[0, 2], false);
    let c12 = t.add_comm("pair:1-2", &[1, 2], false);
    let r1 = t.add_thread(1, "main");
    let r2 = t.add_thread(2, "main");
    let t0 = t.add_thread(2, "t0");
    t.add_thread(3, "main");
    let s1 = t.add_stream(1, "pair:1-2");
    let s2 = t.add_stream(2, "pair:0-2");
    t.push(one_op(
        r1,
        duplex::Dir::Send,
        2,
        4096,
        (c12, s1),
        "send 2 4KiB",
    ));
    t.push(one_op(
        r2,
        duplex::Dir::Recv,
        0,
        4096,
        (c02, s2),
        "recv 0 4KiB",
    ));
    t.block(
        t0,
        Some(TraceCall {
            thread: t0,
            call: Call::Await {
                from: 1,
                tag: "go".into(),
            },
            text: "await 1 go".into(),
            place: "x".into(),
        }),
    );
    let a = t.analyze(duplex::Model {
        lazy_connect: true,
        ..duplex::Model::default()
    });
    let s = a.stuck.expect("nothing can move in what is here");
    assert!(s.cycle.is_empty(), "a cycle that never was:\n{s}");
    let text = s.to_string();
    assert!(!text.contains("will ever issue"), "{text}");
    assert!(
        text.contains("may come from rank(s) 0, whose traces are not"),
        "{text}"
    );
}
