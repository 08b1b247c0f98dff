//! The partial-order reduction of the checker rests on facts about the
//! state machine: host steps of threads of different ranks commute, and
//! neither disables the other; a `notify` or a `join` step commutes with any
//! other step and neither disables the other. These tests check those facts
//! in every reachable state of every example (and of programs with
//! same-rank notifies and joins), and that the reduced and the full search
//! agree on every example's verdict.

use std::collections::HashSet;
use std::path::Path;

use duplex::compile::{Compiled, compile};
use duplex::machine::{HostCall, Machine, Next, ThreadId};
use duplex_sim::check::{self, fingerprint, runnable, step};

fn examples() -> Vec<(String, Compiled)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("examples/") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "sched") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("readable");
        let mut program = duplex::schedule::parse(&text).expect("valid example");
        out.push((path.display().to_string(), compile(&program)));
        // Also under the other policy: lanes change which steps interact.
        program.policy = match program.policy {
            duplex::Policy::Shared => duplex::Policy::PerDirection,
            duplex::Policy::PerDirection => duplex::Policy::Shared,
        };
        out.push((
            format!("{} (other policy)", path.display()),
            compile(&program),
        ));
        // And cold with an eager capacity under `cold-channels=mismatched`,
        // where whether a send buffers depends on the setup rounds so far.
        if program.model.lazy_connect {
            program.model.cold_mismatched_only = true;
            program.model.eager = duplex::Size(program.model.eager.bytes().max(64 << 20));
            out.push((
                format!("{} (cold-channels=mismatched)", path.display()),
                compile(&program),
            ));
        }
    }
    out
}

/// Steps every pair of threads of different ranks that can step, in both
/// orders, in every reachable state of `c` (and same-rank pairs where one
/// is a `notify` or a `join`): the pairs compared, and the first that does
/// not commute or disables the other, described.
fn commuting_pairs(c: &Compiled) -> (usize, Option<String>) {
    let mut pairs = 0usize;
    let mut seen = HashSet::new();
    let mut stack = vec![c.machine()];
    while let Some(m) = stack.pop() {
        if !seen.insert(fingerprint(&m)) {
            continue;
        }
        let threads: Vec<_> = runnable(c, &m);
        for &a in &threads {
            for &b in &threads {
                let (ra, rb) = (
                    m.setup().threads[a.0 as usize].rank,
                    m.setup().threads[b.0 as usize].rank,
                );
                let local = |t: ThreadId| {
                    matches!(
                        c.call(t, m.calls(t)),
                        Some(HostCall::Notify { .. } | HostCall::Join { .. })
                    ) && m.next(t) == Next::Call
                };
                if a >= b || (ra == rb && !local(a) && !local(b)) {
                    continue;
                }
                // `x` then `y`: the machine after, and whether either step
                // erred; an error if `x`'s step disabled `y`.
                let in_order = |x: ThreadId, y: ThreadId, rx: u32, ry: u32| {
                    let mut after = m.clone();
                    let ex = step(c, &mut after, x).is_err();
                    if !(ex || matches!(after.next(y), Next::Call | Next::Resume)) {
                        return Err(format!("a step of rank {rx} disabled rank {ry}"));
                    }
                    let exy = ex || step(c, &mut after, y).is_err();
                    Ok((after, exy))
                };
                let orders = (in_order(a, b, ra, rb), in_order(b, a, rb, ra));
                let ((ab, eab), (ba, eba)) = match orders {
                    (Ok(ab), Ok(ba)) => (ab, ba),
                    (Err(why), _) | (_, Err(why)) => return (pairs, Some(why)),
                };
                if eab != eba {
                    return (pairs, Some("an error in one order only".into()));
                }
                if !eab && ab.state() != ba.state() {
                    return (
                        pairs,
                        Some(format!(
                            "steps of ranks {ra} and {rb} do not commute\n{:#?}\n{:#?}",
                            ab.state(),
                            ba.state()
                        )),
                    );
                }
                pairs += 1;
            }
        }
        for t in threads {
            let mut next: Machine = m.clone();
            if step(c, &mut next, t).is_ok() {
                stack.push(next);
            }
        }
    }
    (pairs, None)
}

#[test]
fn steps_of_different_ranks_commute_and_do_not_disable_each_other() {
    let mut pairs = 0usize;
    for (name, c) in examples() {
        let (n, bad) = commuting_pairs(&c);
        assert!(bad.is_none(), "{name}: {}", bad.unwrap_or_default());
        pairs += n;
    }
    assert!(pairs > 1000, "only {pairs} pairs were checked");
}

/// `c` under the model knob `kernels=k`.
fn with_kernels(c: &Compiled, k: u32) -> Compiled {
    let mut out = c.clone();
    let mut setup = (*c.setup).clone();
    setup.model.kernels = Some(k);
    out.setup = std::sync::Arc::new(setup);
    out
}

/// Under `kernels=1` a rank without a copy-engine lane runs its launches
/// one at a time in issue order whatever the timing
/// (`Machine::slots_in_issue_order`), so steps of different ranks still
/// commute: every example without copy lanes, checked under `kernels=1`
/// in every reachable state. Under `kernels=2` they do not (one
/// completion can make two launches ready while a later one took a slot at
/// its issue), nor under `kernels=1` with a copy lane (a launch waits
/// behind a copy, which holds no slot): the check finds a pair that does
/// not commute there, so it can fail.
#[test]
fn under_one_kernel_slot_without_copy_lanes_steps_of_different_ranks_commute() {
    let mut pairs = 0usize;
    let mut checked = 0;
    for (name, c) in examples() {
        if c.setup.comms.iter().any(|k| k.copy) {
            continue;
        }
        let one = with_kernels(&c, 1);
        assert!((0..one.setup.ranks).all(|r| one.machine().slots_in_issue_order(r)));
        let (n, bad) = commuting_pairs(&one);
        assert!(
            bad.is_none(),
            "{name} under kernels=1: {}",
            bad.unwrap_or_default()
        );
        pairs += n;
        checked += 1;
    }
    assert!(
        checked > 40 && pairs > 1000,
        "{checked} examples, {pairs} pairs"
    );
    let program = |text: &str| compile(&duplex::schedule::parse(text).expect("valid"));
    // Rank 1's recv on stream a holds one of two slots; its sends on
    // streams c and d wait for it (an event); its recv on stream b is ready
    // when issued. If rank 1 issues it first, it takes the free slot and
    // rank 0's send, completing the recv on a, readies one send; the other
    // way round, both sends take the slots and the recv on b waits.
    let two = program(
        "ranks 2\nmodel kernels=2\ncomm c1 0 1\ncomm c2 0 1\ncomm c3 0 1\ncomm w 0 1\nrank 0:\n  send 1 4KiB comm=w\n  recv 1 4KiB comm=c1\n  recv 1 4KiB comm=c2\n  send 1 4KiB comm=c3\nrank 1:\n  recv 0 4KiB comm=w stream=a\n  record e stream=a\n  wait e stream=c\n  wait e stream=d\n  send 0 4KiB comm=c1 stream=c\n  send 0 4KiB comm=c2 stream=d\n  recv 0 4KiB comm=c3 stream=b\n",
    );
    assert!(!two.machine().slots_in_issue_order(1));
    let (_, bad) = commuting_pairs(&two);
    assert!(bad.is_some(), "kernels=2: every pair commuted");
    let copy = program(
        "ranks 2\npolicy per-direction copy-from=16KiB\nmodel kernels=1\ncomm c 0 1\nrank 1:\n  recv 0 16KiB\n  recv 0 4KiB\n  recv 0 4KiB comm=c\nrank 0:\n  send 1 16KiB\n  send 1 4KiB comm=c\n  send 1 4KiB\n",
    );
    assert!(!copy.machine().slots_in_issue_order(1));
    let (_, bad) = commuting_pairs(&copy);
    assert!(
        bad.is_some(),
        "kernels=1 with a copy lane: every pair commuted"
    );
}

#[test]
fn the_reduced_search_agrees_with_the_full_search() {
    for (name, c) in examples() {
        let (reduced, full) = reduced_and_full(&c);
        assert_eq!(full.verdict.kind(), reduced.verdict.kind(), "{name}");
        assert!(reduced.stats.states <= full.stats.states, "{name}");
    }
}

/// `n` host threads per rank, thread `t` of each rank exchanging `k`
/// grouped messages with the same thread of the other rank on a
/// communicator and stream of its own (`shared`: all on one communicator).
fn threads(n: usize, k: usize, shared: bool) -> Compiled {
    let mut text = String::from("ranks 2\n");
    for t in 0..n {
        text.push_str(&format!("comm c{t} 0 1\n"));
    }
    for r in 0..2 {
        for t in 0..n {
            if t == 0 {
                text.push_str(&format!("rank {r}:\n"));
            } else {
                text.push_str(&format!("rank {r} thread t{t}:\n"));
            }
            let c = if shared { 0 } else { t };
            for _ in 0..k {
                text.push_str(&format!(
                    "  group {{ send {p} 4KiB comm=c{c} stream=s{t}; recv {p} 4KiB comm=c{c} stream=s{t} }}\n",
                    p = 1 - r
                ));
            }
        }
    }
    compile(&duplex::schedule::parse(&text).expect("valid"))
}

/// The reduced and the full search of `c`.
fn reduced_and_full(c: &Compiled) -> (check::Outcome, check::Outcome) {
    let full = check::Options {
        reduce: false,
        ..Default::default()
    };
    (
        check::check(c, &check::Options::default()),
        check::check(c, &full),
    )
}

#[test]
fn threads_with_independent_traffic_are_explored_in_one_order() {
    // Five threads per rank, each on its own communicator and stream: one
    // Mazurkiewicz trace, one execution.
    let c = threads(5, 2, false);
    let reduced = check::check(&c, &check::Options::default());
    assert_eq!(reduced.verdict.kind(), "ok");
    assert_eq!(reduced.stats.executions, 1, "{:?}", reduced.stats);
    // Three, against the full search: the same verdict, from one execution
    // against hundreds.
    let (reduced, full) = reduced_and_full(&threads(3, 1, false));
    assert_eq!(reduced.verdict.kind(), full.verdict.kind());
    assert_eq!(reduced.stats.executions, 1);
    assert!(full.stats.executions > 100, "{:?}", full.stats);
    // On one shared communicator the threads' order matters, and the
    // search still finds the interleavings that hang (R2 serializes the
    // groups of the two ranks in different orders).
    let (reduced, full) = reduced_and_full(&threads(3, 1, true));
    assert_eq!(reduced.verdict.kind(), full.verdict.kind());
    assert!(reduced.stats.executions > 1);
}

/// Programs an independent exhaustive search (`tests/oracle.rs`) found the
/// checker wrong on, with the verdict R1–R12 give, reduced and not:
/// under a kernel-slot bound steps of different ranks do not commute (a
/// step of rank 0 that completes a copy makes rank 1's next launch ready,
/// while rank 1's own next step issues a launch for the same slot); a
/// `wait` on a stream numbered below its `record`'s retired a device pass
/// late, after a later launch took the slot; and a launch blocked for ever
/// in its connection handshake (R7) is never compared with its partner
/// (R3), so it hangs rather than errs.
#[test]
fn what_the_oracle_found_gets_its_verdicts() {
    let cases = [
        (
            "copy lanes and one kernel slot",
            "ranks 2\npolicy per-direction copy-from=16KiB\nmodel kernels=1\ncomm c 0 1\nrank 1:\n  recv 0 16KiB\n  recv 0 4KiB\n  recv 0 4KiB comm=c\nrank 0:\n  send 1 16KiB\n  send 1 4KiB comm=c\n  send 1 4KiB\n",
            "deadlock",
        ),
        (
            "a wait on a lower stream than its record",
            "ranks 2\nmodel kernels=1\ncomm c 0 1\nrank 0:\n  sync a\n  send 1 4KiB stream=b\n  record e stream=b\n  wait e stream=a\n  send 1 4KiB comm=c stream=a\n  send 1 4KiB stream=c\n  notify 1 go\nrank 1:\n  await 0 go\n  recv 0 4KiB comm=world\n  recv 0 4KiB comm=world\n  recv 0 4KiB comm=c\n",
            "deadlock",
        ),
        (
            "the same order of launches, the slot to the earlier",
            "ranks 2\nmodel kernels=1\ncomm c 0 1\nrank 0:\n  sync a\n  send 1 4KiB stream=b\n  record e stream=b\n  wait e stream=a\n  send 1 4KiB comm=c stream=a\n  await 1 go\n  send 1 4KiB stream=c\nrank 1:\n  notify 0 go\n  recv 0 4KiB comm=world\n  recv 0 4KiB comm=c\n  recv 0 4KiB comm=world\n",
            "ok",
        ),
        (
            "a send blocked in its handshake for ever",
            "ranks 2\nmodel lazy-connect=on\nrank 0:\n  recv 1 4KiB\n  send 1 4KiB\nrank 1:\n  recv 0 8KiB\n",
            "deadlock",
        ),
    ];
    for (what, text, want) in cases {
        let program = duplex::schedule::parse(text).expect("valid");
        let c = compile(&program);
        for reduce in [true, false] {
            let v = check::check(
                &c,
                &check::Options {
                    reduce,
                    ..Default::default()
                },
            )
            .verdict;
            assert_eq!(v.kind(), want, "{what} (reduce={reduce})");
        }
    }
}

/// Under a kernel-slot bound no rank can reach (its launches in flight and
/// to come fit under it), steps of different ranks commute as without a
/// bound, and the checker reduces across them again; where a rank can
/// reach a bound of two, it does not.
#[test]
fn a_kernel_bound_no_rank_can_reach_keeps_the_reduction() {
    let (_, c) = examples()
        .into_iter()
        .find(|(name, _)| name.ends_with("/copy-lanes-no-kernel-slot.sched"))
        .expect("the example");
    assert_eq!(c.setup.model.kernels, Some(1));
    let (reduced, full) = reduced_and_full(&c);
    assert_eq!(reduced.verdict.kind(), "ok");
    assert_eq!(full.verdict.kind(), "ok");
    assert_eq!(reduced.stats.executions, 1, "{:?}", reduced.stats);
    assert!(full.stats.executions > 1, "{:?}", full.stats);
    // Under kernels=2 three launches on a rank contend for two slots, and
    // which two run depends on steps of both ranks: the same threads are
    // searched without the reduction across ranks.
    let bounded = with_kernels(&threads(3, 1, false), 2);
    assert!(!bounded.machine().slots_in_issue_order(0));
    let (reduced, full) = reduced_and_full(&bounded);
    assert_eq!(reduced.verdict.kind(), full.verdict.kind());
    assert!(reduced.stats.executions > 1, "{:?}", reduced.stats);
}

/// Under `kernels=1` without copy lanes each rank runs its launches in
/// issue order, so the reduction across ranks stays on: a program of three
/// ranks, rank 0 with two threads, that took 2,374 branching states when
/// any reachable bound turned it off takes a handful, with the verdict of
/// the full search.
#[test]
fn one_kernel_slot_keeps_the_reduction_across_ranks() {
    let text = "ranks 3\nmodel kernels=1\npolicy per-direction\nrank 0 thread a:\n  recv 1 1MiB\n  recv 1 1MiB\nrank 0 thread b:\n  send 2 1MiB\n  send 2 1MiB\n  send 2 1MiB\nrank 1:\n  send 0 1MiB\n  send 0 1MiB\n  send 2 1MiB\n  send 2 1MiB\nrank 2:\n  recv 0 1MiB\n  recv 0 1MiB\n  recv 0 1MiB\n  recv 1 1MiB\n  recv 1 1MiB\n";
    let c = compile(&duplex::schedule::parse(text).expect("valid"));
    let (reduced, full) = reduced_and_full(&c);
    assert_eq!(reduced.verdict.kind(), "ok");
    assert_eq!(full.verdict.kind(), "ok");
    assert!(reduced.stats.states <= 10, "{:?}", reduced.stats);
    assert!(full.stats.states > 1000, "{:?}", full.stats);
}

/// The simulated transport declares its copy-engine lanes before the run
/// and gives each its members when a rank first uses it: a lane not yet
/// opened may be any rank's, so under `kernels=1` it keeps the reduction
/// across ranks off as an opened one does. Found by review: the reduced
/// `Sim::check` answered ok (70 executions) on this program, which hangs
/// when rank 0's first send comes after rank 1's last recv (rank 1's lane
/// recv waits behind its copy recv while the recv on stream b takes the
/// one slot); the checker, whose lanes have members from the start, and
/// both full searches say deadlock.
#[test]
fn the_simulator_counts_copy_lanes_not_yet_opened() {
    use duplex_sim::{Failure, Sim};
    let text = "ranks 3\npolicy per-direction copy-from=16KiB\nmodel kernels=1\nrank 0:\n  send 1 4KiB comm=world\n  await 2 done\n  send 1 4KiB comm=world stream=b\nrank 1:\n  recv 0 4KiB comm=world\n  recv 2 4KiB\n  await 2 go\n  recv 2 16KiB\n  recv 2 4KiB\n  recv 0 4KiB comm=world stream=b\nrank 2:\n  send 1 4KiB\n  send 1 16KiB\n  notify 1 go\n  send 1 4KiB\n  sync\n  notify 0 done\n";
    let p = duplex::schedule::parse(text).expect("valid");
    let (reduced, full) = reduced_and_full(&compile(&p));
    assert_eq!(reduced.verdict.kind(), "deadlock");
    assert_eq!(full.verdict.kind(), "deadlock");
    let program = std::sync::Arc::new(p.clone());
    for reduce in [true, false] {
        let mut sim = Sim::new(p.ranks)
            .policy(p.policy)
            .copy_from(p.copy_from)
            .model(p.model);
        if !reduce {
            sim = sim.without_reduction();
        }
        let got = sim.check(|t| duplex::schedule::execute(&program, t));
        assert!(
            matches!(got, Err(Failure::Hang(_))),
            "Sim::check (reduce={reduce}): {:?}",
            got.map(|r| r.executions)
        );
    }
}
