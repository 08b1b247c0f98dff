//! The conformance suite on the simulator: every scenario, explored over
//! every interleaving that matters.

use std::time::{Duration, Instant};

use duplex_sim::{Failure, Sim, SimRank};
use duplex_tests::{Backend, Outcome, scenarios, verify};

fn outcome(result: Result<duplex_sim::Run, Failure>) -> Outcome {
    match result {
        Ok(_) => Outcome::Completed,
        Err(Failure::Hang(h)) => Outcome::Hang(h),
        Err(Failure::Program { error, .. }) => Outcome::Failed(*error),
        Err(other) => Outcome::Failed(duplex::Error::User(other.to_string())),
    }
}

/// Every scenario, as declared and with every communicator connected on
/// first use (`lazy-connect=on`): the GPU suite runs each job both ways
/// (`DUPLEX_COLD=1`) and expects the same ending, which the model must
/// agree with. A scenario whose expectation held only warm would fail here.
#[test]
fn every_scenario_on_the_simulator() {
    let mut failures = Vec::new();
    let mut ran = 0;
    for s in scenarios::<SimRank>() {
        let ways: &[bool] = if s.cold { &[true] } else { &[false, true] };
        for &cold in ways {
            let start = Instant::now();
            let result = Sim::new(s.ranks)
                .policy(s.policy)
                .model(duplex_tests::model(cold))
                .copy_from(s.copy.then(duplex_tests::copy_threshold))
                .check(s.run);
            let elapsed = start.elapsed();
            let o = outcome(result);
            eprintln!(
                "{:<24} {:<5} {:?} in {:.3} s",
                s.name,
                if cold { "cold" } else { "warm" },
                s.expect,
                elapsed.as_secs_f64()
            );
            if let Err(e) = verify(&s, &o, Backend::Simulator) {
                failures.push(if cold { format!("(cold) {e}") } else { e });
            }
            if matches!(o, Outcome::Hang(_)) {
                // A program that can hang must return its hang in well
                // under a second, not block the test.
                assert!(
                    elapsed < Duration::from_secs(5),
                    "{}: the hang took {elapsed:?}",
                    s.name
                );
            }
            ran += 1;
        }
    }
    assert!(ran >= 32, "only {ran} runs");
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// The simulated transport records what its ranks issued as a
/// [`duplex::trace::Trace`]; replayed through the machine (what the NCCL
/// backend's hang analysis does with its own trace), every completing
/// scenario finishes with no call refused, as declared and cold.
#[test]
fn every_completing_scenario_replays_from_its_trace() {
    let mut replayed = 0;
    for s in scenarios::<SimRank>() {
        let ways: &[bool] = if s.cold { &[true] } else { &[false, true] };
        for &cold in ways {
            let model = duplex_tests::model(cold);
            let Ok(run) = Sim::new(s.ranks)
                .policy(s.policy)
                .model(model)
                .copy_from(s.copy.then(duplex_tests::copy_threshold))
                .run(7, s.run)
            else {
                continue;
            };
            assert!(!run.trace.calls.is_empty(), "{}: empty trace", s.name);
            let a = run.trace.analyze(model);
            assert!(
                a.disagreements.is_empty(),
                "{} (cold: {cold}): {:?}",
                s.name,
                a.disagreements
            );
            assert!(
                a.finished && a.stuck.is_none(),
                "{} (cold: {cold}): replay did not finish",
                s.name
            );
            replayed += 1;
        }
    }
    assert!(replayed >= 16, "only {replayed} runs completed");
}

/// The NCCL suite's `many-in-flight/copy` process job on the simulator: 300
/// messages on one copy-engine lane, received in batches, every byte
/// checked; the model sees no hazard in it (the 256-event bound is the
/// IPC lane's, outside the model: X3 of `docs/semantics.md`).
#[test]
fn many_in_flight_completes_on_the_simulator() {
    let run = Sim::new(2)
        .policy(duplex::Policy::PerDirection)
        .copy_from(Some(duplex::Size(64 << 10)))
        .run(7, |t| duplex_tests::many_in_flight(t, 300, 16 << 10));
    let run = match run {
        Ok(r) => r,
        Err(e) => panic!("many_in_flight failed on the simulator: {e}"),
    };
    let sends = run
        .trace
        .calls
        .iter()
        .filter(|c| c.text.starts_with("send"))
        .count();
    assert_eq!(sends, 600, "600 sends in the trace");
}

/// The rank code of the GPU suite's `long-then-seed/shared` process job
/// (which runs it with 5,000 exchanges), here with a few: every exchange
/// completes with its bytes, then the seed hangs under the shared policy,
/// with the cycle between the two ranks' sends.
#[test]
fn long_then_seed_hangs_after_its_exchanges_on_the_simulator() {
    let result = Sim::new(2)
        .policy(duplex::Policy::Shared)
        .run(3, |t| duplex_tests::long_then_seed(t, 4));
    match result {
        Err(duplex_sim::Failure::Hang(h)) => {
            assert!(!h.stuck.cycle.is_empty(), "a cycle: {h}");
        }
        other => panic!("long_then_seed should hang under the shared policy: {other:?}"),
    }
}

/// `connect/beside-send` with communicators connected on first use
/// (`lazy-connect=on`, the NCCL backend's default for shared lanes and the
/// world): rank 0's first send on its lane waits in its handshake (R7)
/// until rank 1's first op there, which comes only after rank 1 has
/// rank 0's message on the world communicator. The model lets rank 0's
/// other thread send it meanwhile (R11 holds back calls on the lane
/// only), so it completes; made to wait for the handshake first, the same
/// program hangs, and only because of the handshake (connected at
/// creation it completes), so the handshake is there to hold back.
#[test]
fn a_handshake_holds_back_only_its_communicator() {
    use duplex::Transport;
    let lazy = duplex::Model {
        lazy_connect: true,
        ..duplex::Model::default()
    };
    let sim = || Sim::new(2).policy(duplex::Policy::Shared);
    if let Err(e) = sim().model(lazy).check(duplex_tests::connect_beside_send) {
        panic!("the world's send must not wait for the lane's handshake: {e}");
    }
    // The world's send after the handshake has returned.
    let after = |t: &SimRank| -> duplex::Result<()> {
        if t.rank() == 0 {
            let out = t.alloc::<u32>(16)?;
            t.send(&out, 1)?;
            let world = t.world();
            let s = t.stream("world")?;
            t.send_on(&out, 1, &duplex::Place::on(&world, &s))?;
            t.synchronize()
        } else {
            let world = t.world();
            let s = t.stream("world")?;
            let mut inb = t.alloc::<u32>(16)?;
            t.recv_on(&mut inb, 0, &duplex::Place::on(&world, &s))?;
            t.synchronize()?;
            t.recv(&mut inb, 0)?;
            t.synchronize()
        }
    };
    match sim().model(lazy).check(after) {
        Err(Failure::Hang(h)) => assert!(h.to_string().contains("R7"), "{h}"),
        other => panic!("waiting for the handshake first hangs: {other:?}"),
    }
    if let Err(e) = sim().check(after) {
        panic!("connected at creation, nothing waits for a handshake: {e}");
    }
}

/// The copy scenarios run on copy-engine lanes, and can tell: every
/// message of at least the threshold goes on a copy-engine lane and every
/// smaller one on NCCL (the trace says), and `never-buffered/copy` hangs
/// even under an eager capacity that lets the same program complete on
/// NCCL lanes (C3). Found by review: under the suite's model (eager 0) a
/// copy lane behaves as an NCCL lane, so a simulator that routed nothing
/// by copy passed every copy scenario.
#[test]
fn the_copy_scenarios_run_on_copy_engine_lanes() {
    let threshold = duplex_tests::copy_threshold().bytes();
    let mut checked = 0;
    for s in scenarios::<SimRank>().into_iter().filter(|s| s.copy) {
        if s.expect != duplex_tests::Expect::Completes {
            continue;
        }
        let run = Sim::new(s.ranks)
            .policy(s.policy)
            .model(duplex_tests::model(false))
            .copy_from(Some(duplex_tests::copy_threshold()))
            .run(0, s.run)
            .unwrap_or_else(|f| panic!("{}: {f}", s.name));
        let (mut on_copy, mut wrong) = (0, Vec::new());
        for c in &run.trace.calls {
            if let duplex::trace::Call::Launch { ops, .. } = &c.call {
                for o in ops.iter() {
                    let copy = run.trace.comms[o.comm as usize].copy;
                    on_copy += usize::from(copy);
                    if copy != (o.bytes >= threshold) {
                        wrong.push(format!("{} bytes on copy lane {copy}", o.bytes));
                    }
                }
            }
        }
        assert!(on_copy > 0, "{}: no op on a copy-engine lane", s.name);
        assert!(wrong.is_empty(), "{}: {wrong:?}", s.name);
        checked += 1;
    }
    assert!(checked >= 4, "only {checked} copy scenarios checked");
    // C3: with an eager capacity above the message, NCCL lanes buffer the
    // sends and the program completes; copy-engine lanes never buffer.
    let s = scenarios::<SimRank>()
        .into_iter()
        .find(|s| s.name == "never-buffered/copy")
        .expect("the scenario");
    let eager = duplex::Model {
        eager: duplex::Size(threshold * 4),
        ..duplex_tests::model(false)
    };
    let on = |copy: Option<duplex::Size>| {
        outcome(
            Sim::new(s.ranks)
                .policy(s.policy)
                .model(eager)
                .copy_from(copy)
                .check(s.run),
        )
    };
    assert!(matches!(on(None), Outcome::Completed), "NCCL lanes buffer");
    assert!(
        matches!(on(Some(duplex_tests::copy_threshold())), Outcome::Hang(_)),
        "copy-engine lanes never buffer"
    );
}

/// A launch beside another thread's handshake on a shared stream: the
/// simulator (as the model, R11) lets it through, and the handshake may
/// finish only because of it. Its trace replays to the same completion:
/// the replay's hold for duplex-nccl's wider rule yields when nothing
/// else can move (found by review: it replayed as a deadlock).
#[test]
fn a_launch_beside_a_handshake_on_its_stream_replays_from_its_trace() {
    use duplex::{Place, Transport};
    let lazy = duplex::Model {
        lazy_connect: true,
        ..duplex::Model::default()
    };
    let prog = |t: &SimRank| -> duplex::Result<()> {
        let world = t.world();
        let s = t.stream("shared")?;
        if t.rank() == 0 {
            let out = t.alloc::<u32>(16)?;
            let s2 = s.clone();
            let first = t.spawn("first", move |t: &SimRank| {
                let out = t.alloc::<u32>(16)?;
                t.with_stream(&s2, || t.send(&out, 1))?;
                t.synchronize()
            })?;
            t.send_on(&out, 1, &Place::on(&world, &s))?;
            t.synchronize()?;
            t.join(first)
        } else {
            let mut inb = t.alloc::<u32>(16)?;
            t.recv_on(&mut inb, 0, &Place::on(&world, &s))?;
            t.synchronize()?;
            let mut lane = t.alloc::<u32>(16)?;
            t.recv(&mut lane, 0)?;
            t.synchronize()
        }
    };
    let mut replayed = 0;
    for seed in 0..20 {
        let Ok(run) = Sim::new(2)
            .policy(duplex::Policy::Shared)
            .model(lazy)
            .run(seed, prog)
        else {
            continue;
        };
        let a = run.trace.analyze(lazy);
        assert!(
            a.disagreements.is_empty() && a.finished && a.stuck.is_none(),
            "seed {seed}: {:?}\n{}",
            a.disagreements,
            a.stuck.map(|s| s.to_string()).unwrap_or_default()
        );
        replayed += 1;
    }
    assert!(replayed > 0, "no run completed");
}
