//! The simulated transport: replay strings, random schedules, bounds, and
//! errors that user code gets instead of hangs or panics.

use std::time::{Duration, Instant};

use duplex::{Dir, Error, Model, Place, Policy, Transport};
use duplex_sim::{Failure, Sim, SimRank};

fn seed(t: &SimRank) -> duplex::Result<()> {
    let peer = 1 - t.rank();
    let out = t.alloc::<u64>(256)?;
    let mut inb = t.alloc::<u64>(256)?;
    t.send(&out, peer)?;
    t.recv(&mut inb, peer)?;
    t.synchronize()
}

/// Three host threads per rank, so that interleavings differ.
fn rpc(t: &SimRank) -> duplex::Result<()> {
    let peer = 1 - t.rank();
    let tx = t.spawn("tx", move |t: &SimRank| {
        let out = t.alloc::<u8>(64)?;
        t.notify(peer, "meta")?;
        t.send(&out, peer)?;
        t.synchronize()
    })?;
    let rx = t.spawn("rx", move |t: &SimRank| {
        let mut inb = t.alloc::<u8>(64)?;
        t.await_notify(peer, "meta")?;
        t.recv(&mut inb, peer)?;
        t.synchronize()
    })?;
    t.join(tx)?;
    t.join(rx)
}

#[test]
fn a_hang_comes_back_as_an_error_with_its_cycle_quickly() {
    let start = Instant::now();
    let failure = Sim::new(2).check(seed).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(1));
    let hang = failure.hang().expect("a hang");
    assert_eq!(hang.stuck.cycle.len(), 4);
    assert!(
        hang.stuck
            .cycle
            .iter()
            .any(|l| l.rule == duplex::report::Rule::R4)
    );
    assert!(
        hang.stuck.ops.iter().all(|o| o.at.contains("tests/sim.rs")),
        "ops name the user's lines"
    );
    let text = failure.to_string();
    assert!(text.contains("wait-for cycle"), "{text}");
    assert!(text.contains(".replay(\"v1:"), "{text}");
}

#[test]
fn every_blocked_call_returns_the_hang() {
    let seen = std::sync::Mutex::new(Vec::new());
    let _ = Sim::new(2).run(7, |t| {
        let r = seed(t);
        seen.lock()
            .unwrap()
            .push(r.as_ref().err().map(|e| e.hang().is_some()));
        r
    });
    let seen = seen.into_inner().unwrap();
    assert_eq!(
        seen,
        vec![Some(true), Some(true)],
        "both ranks get Error::Hang from their blocked call"
    );
}

#[test]
fn a_failing_schedule_replays_to_the_same_failure() {
    let failure = Sim::new(2).check(rpc).unwrap_err();
    let schedule = failure.schedule().expect("a schedule").to_string();
    let again = Sim::new(2).replay(&schedule, rpc).unwrap_err();
    assert_eq!(again.schedule(), Some(schedule.as_str()));
    let (a, b) = (failure.hang().unwrap(), again.hang().unwrap());
    assert_eq!(a.stuck, b.stuck);
    assert_eq!(a.steps, b.steps);
}

#[test]
fn a_schedule_that_does_not_fit_is_refused() {
    let e = Sim::new(2).replay("v1:7.7.7", rpc).unwrap_err();
    assert!(matches!(e, Failure::Schedule(_)), "{e}");
    let e = Sim::new(2).replay("garbage", rpc).unwrap_err();
    assert!(e.to_string().contains("v1:"), "{e}");
    // `v2:` and `v3:` schedules are the checker's: the simulated transport
    // says so.
    for reduced in ["v2:0", "v3:0"] {
        let e = Sim::new(2).replay(reduced, rpc).unwrap_err();
        assert!(matches!(e, Failure::Schedule(_)), "{e}");
        assert!(e.to_string().contains("duplex check"), "{e}");
    }
}

#[test]
fn random_schedules_find_the_rpc_hang_and_replay() {
    let mut found = None;
    for seed in 0..200 {
        if let Err(f) = Sim::new(2).run(seed, rpc) {
            found = Some(f);
            break;
        }
    }
    let f = found.expect("some random schedule hangs");
    let replayed = Sim::new(2).replay(f.schedule().unwrap(), rpc).unwrap_err();
    assert_eq!(f.hang().unwrap().stuck, replayed.hang().unwrap().stuck);
}

#[test]
fn per_direction_lanes_make_the_rpc_form_safe_in_every_interleaving() {
    let run = Sim::new(2)
        .policy(Policy::PerDirection)
        .check(rpc)
        .expect("no hang");
    let full = Sim::new(2)
        .policy(Policy::PerDirection)
        .without_reduction()
        .check(rpc)
        .expect("no hang in the full search either");
    // Each thread's `synchronize` waits for the other's launch in some
    // orders and not in others: the search explores several orders, and
    // fewer than every interleaving.
    assert!(
        run.executions > 1 && run.executions * 4 < full.executions,
        "{} executions, {} without the reduction",
        run.executions,
        full.executions
    );
}

#[test]
fn hitting_the_bound_is_an_error_that_says_what_to_do() {
    let e = Sim::new(2)
        .policy(Policy::PerDirection)
        .max_executions(3)
        .check(rpc)
        .unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, Failure::Bound { executions: 3, .. }), "{text}");
    assert!(text.contains("DUPLEX_MAX_EXECUTIONS"), "{text}");
}

/// A time limit stops the search after the execution under way (here at
/// once: the limit is zero), with an error that names the limit.
#[test]
fn a_time_limit_stops_the_search_and_says_so() {
    let e = Sim::new(2)
        .policy(Policy::PerDirection)
        .time_limit(Duration::ZERO)
        .check(rpc)
        .unwrap_err();
    let text = e.to_string();
    assert!(
        matches!(
            e,
            Failure::Bound {
                executions: 1,
                time_limit: Some(Duration::ZERO),
                ..
            }
        ),
        "{text}"
    );
    assert!(text.contains("Sim::time_limit"), "{text}");
}

#[test]
fn reading_a_buffer_with_a_pending_recv_is_a_data_race() {
    let f = Sim::new(2).policy(Policy::PerDirection).check(|t| {
        let peer = 1 - t.rank();
        let out = t.alloc::<f32>(8)?;
        let mut inb = t.alloc::<f32>(8)?;
        t.recv(&mut inb, peer)?;
        match t.read(&inb) {
            Err(Error::Race { message, at }) => {
                assert!(message.contains("recv 8 x f32 from rank"), "{message}");
                assert!(at.contains("tests/sim.rs"), "{at}");
            }
            other => panic!("expected a race, got {other:?}"),
        }
        t.send(&out, peer)?;
        t.synchronize()?;
        t.read(&inb).map(drop)
    });
    assert!(f.is_ok(), "{}", f.unwrap_err());
}

#[test]
fn delivered_data_is_the_sent_data_even_when_buffered() {
    let model = Model {
        eager: duplex::Size(1 << 20),
        ..Model::default()
    };
    Sim::new(2)
        .model(model)
        .check(|t| {
            let peer = 1 - t.rank();
            let mut out = t.alloc::<i64>(16)?;
            t.write(&mut out, &[t.rank() as i64 + 40; 16])?;
            let mut inb = t.alloc::<i64>(16)?;
            t.send(&out, peer)?; // completes into the buffer (eager)
            t.synchronize()?;
            t.write(&mut out, &[-1; 16])?; // overwriting after completion is fine
            t.recv(&mut inb, peer)?;
            t.synchronize()?;
            let got = t.read(&inb)?;
            if got != vec![peer as i64 + 40; 16] {
                return Err(Error::User(format!("got {got:?}")));
            }
            Ok(())
        })
        .expect("eager sends deliver what was sent");
}

#[test]
fn a_panic_in_rank_code_is_reported_not_propagated() {
    let e = Sim::new(2).run(1, |t| {
        if t.rank() == 1 {
            panic!("boom");
        }
        Ok(())
    });
    match e {
        Err(Failure::Thread { error, thread, .. }) => {
            assert!(error.contains("boom"));
            assert_eq!(thread, "rank 1 main");
        }
        other => panic!("expected a thread failure, got {other:?}"),
    }
}

/// Failures name threads as hang reports do (`rank 0 tx`, not a number),
/// a program error lists the calls that led to it, and an error of `alloc`
/// points at the caller.
#[test]
fn failures_name_threads_and_the_calls_that_led_there() {
    let e = Sim::new(2).run(1, |t| {
        if t.rank() == 0 {
            let out = t.alloc::<u32>(8)?;
            t.send(&out, 1)?;
        } else {
            let mut inb = t.alloc::<u32>(4)?;
            t.recv(&mut inb, 0)?;
        }
        t.synchronize()
    });
    match e {
        Err(e @ Failure::Program { .. }) => {
            let Failure::Program { thread, steps, .. } = &e else {
                unreachable!()
            };
            assert!(
                thread.as_deref().is_some_and(|t| t.starts_with("rank ")),
                "{e}"
            );
            // The calls made before the refused one, each by its thread.
            assert!(!steps.is_empty(), "{e}");
            assert!(steps.iter().all(|s| s.starts_with("rank ")), "{e}");
            assert!(e.to_string().contains("host steps"), "{e}");
        }
        other => panic!("expected a size mismatch, got {other:?}"),
    }
    let e = Sim::new(2).run(1, |t| {
        let tx = t.spawn("tx", |_: &SimRank| Err(Error::User("tx failed".into())))?;
        t.join(tx)
    });
    match e {
        Err(Failure::Thread { thread, .. }) => assert!(thread.ends_with(" tx"), "{thread}"),
        other => panic!("expected a thread failure, got {other:?}"),
    }
    let e = Sim::new(1).run(1, |t| t.alloc::<u64>(usize::MAX / 4).map(drop));
    match e {
        Err(Failure::Thread { error, .. }) => {
            assert!(error.contains("backend-sim/tests/sim.rs"), "{error}")
        }
        other => panic!("expected an alloc error, got {other:?}"),
    }
}

/// A size mismatch between ops of groups names each op's own line, not
/// its group's: in a group of two sends, the one at fault.
#[test]
fn a_mismatch_in_a_group_names_the_ops_own_line() {
    let line = std::sync::OnceLock::new();
    let e = Sim::new(2).check(|t| {
        let peer = 1 - t.rank();
        let a = t.alloc::<u8>(4)?;
        let b = t.alloc::<u8>(4 + t.rank() as usize)?;
        let mut c = t.alloc::<u8>(4)?;
        let mut d = t.alloc::<u8>(4)?;
        t.group(|| {
            t.send(&a, peer)?;
            line.get_or_init(|| std::panic::Location::caller().line() + 1);
            t.send(&b, peer)?;
            t.recv(&mut c, peer)?;
            t.recv(&mut d, peer)
        })?;
        t.synchronize()
    });
    let e = e.expect_err("the second sends' sizes differ");
    let text = e.to_string();
    assert!(text.contains("size mismatch"), "{text}");
    let at = |l: u32| format!("backend-sim/tests/sim.rs:{l}:");
    let send = *line.get().expect("ran");
    assert!(text.contains(&at(send)), "names the second send:\n{text}");
    // The recv it meets is two lines further down.
    assert!(
        text.contains(&at(send + 2)),
        "names the second recv:\n{text}"
    );
    assert!(!text.contains(&at(send - 1)), "not the first send:\n{text}");
}

#[test]
fn a_group_past_the_models_bound_is_refused_not_numbered_wrong() {
    // The model numbers a launch's ops in 16 bits (`MAX_LAUNCH_OPS`): one
    // more op is an invalid call naming the bound, not an overflow.
    Sim::new(2)
        .run(1, |t| {
            if t.rank() == 0 {
                let buf = t.alloc::<u8>(1)?;
                let n = duplex::machine::MAX_LAUNCH_OPS + 1;
                let bad = t.group(|| {
                    for _ in 0..n {
                        t.send(&buf, 1)?;
                    }
                    Ok(())
                });
                let text = format!("{bad:?}");
                assert!(
                    matches!(bad, Err(Error::Invalid { .. })) && text.contains("at most 65535"),
                    "{text}"
                );
            }
            Ok(())
        })
        .expect("the refused group leaves nothing pending");
}

#[test]
fn invalid_calls_are_refused_and_leave_the_rank_usable() {
    Sim::new(2)
        .policy(Policy::PerDirection)
        .check(|t| {
            let buf = t.alloc::<u8>(4)?;
            for bad in [t.send(&buf, 9), t.notify(5, "x"), t.await_notify(5, "x")] {
                assert!(matches!(bad, Err(Error::Invalid { .. })), "{bad:?}");
            }
            for (bad, call) in [
                (t.notify(5, "x"), "notify(5, x)"),
                (t.await_notify(5, "x"), "await_notify(5, x)"),
            ] {
                let text = bad.unwrap_err().to_string();
                assert!(
                    text.contains(call) && text.contains("rank 5 does not exist"),
                    "{text}"
                );
            }
            let other = t.stream("s")?;
            let c = t.comm("only-0", &[0])?;
            if t.rank() == 1 {
                assert!(c.is_none());
            }
            let _ = other;
            Ok(())
        })
        .expect("the ranks go on");
}

#[test]
fn communicators_must_be_created_in_the_same_order_everywhere() {
    let f = Sim::new(2).run(0, |t| {
        let name = if t.rank() == 0 { "a" } else { "b" };
        t.comm(name, &[0, 1]).map(drop)
    });
    let text = f.unwrap_err().to_string();
    assert!(text.contains("same order"), "{text}");
    // The members are a set: listed in another order on another rank,
    // they make the same communicator (the split orders them by rank).
    Sim::new(2)
        .check(|t| {
            let members: &[u32] = if t.rank() == 0 { &[0, 1] } else { &[1, 0] };
            let c = t.comm("c", members)?.expect("member");
            let s = t.stream("s")?;
            let out = t.alloc::<u8>(8)?;
            let mut inb = t.alloc::<u8>(8)?;
            let at = duplex::Place::on(&c, &s);
            t.group(|| {
                t.send_on(&out, 1 - t.rank(), &at)?;
                t.recv_on(&mut inb, 1 - t.rank(), &at)
            })?;
            t.synchronize()
        })
        .expect("one communicator, whatever order its members are listed in");
}

#[test]
fn explicit_placement_on_user_comms_and_streams() {
    Sim::new(2)
        .check(|t| {
            let peer = 1 - t.rank();
            let c01 = t.comm("c01", &[0, 1])?.expect("member");
            let c10 = t.comm("c10", &[0, 1])?.expect("member");
            let (sc, rc) = if t.rank() == 0 {
                (&c01, &c10)
            } else {
                (&c10, &c01)
            };
            let s = t.stream("tx")?;
            let r = t.stream("rx")?;
            let out = t.alloc::<u8>(32)?;
            let mut inb = t.alloc::<u8>(32)?;
            t.send_on(&out, peer, &duplex::Place::on(sc, &s))?;
            t.recv_on(&mut inb, peer, &duplex::Place::on(rc, &r))?;
            t.synchronize()
        })
        .expect("a comm and a stream per direction complete, even on shared lanes");
}

#[test]
fn pct_schedules_find_the_rpc_hang_and_replay() {
    let sim = Sim::new(2).policy(Policy::Shared);
    let found = (0..64).find_map(|seed| sim.pct(seed, 2, rpc).err());
    let failure = found.expect("some PCT schedule of depth 2 hangs the shared RPC form");
    let schedule = failure
        .schedule()
        .expect("a hang has a schedule")
        .to_string();
    let again = sim.replay(&schedule, rpc).unwrap_err();
    assert_eq!(again.schedule(), Some(schedule.as_str()));
    assert!(again.hang().is_some(), "{again}");
    // PCT never invents a hang: per-direction lanes complete under every seed.
    let safe = Sim::new(2).policy(Policy::PerDirection);
    for seed in 0..16 {
        safe.pct(seed, 3, rpc)
            .unwrap_or_else(|f| panic!("seed {seed}: {f}"));
    }
}

/// A schedule that does not fit the program is refused naming the
/// schedule given, not the part of it that was followed.
#[test]
fn a_schedule_that_does_not_fit_names_the_one_given() {
    let given = "v1:3.3.3.3.3.3.3.3.3.9";
    match Sim::new(2).replay(given, seed) {
        Err(Failure::Schedule(m)) => assert!(m.contains(given), "{m}"),
        other => panic!("expected a refused schedule, got {other:?}"),
    }
}

/// A communicator is made by `ncclCommSplit`, collective over every rank:
/// a rank that makes it only after it waits for a peer that is inside the
/// split hangs (the simulator said OK before), and so does a split that
/// one rank never makes; made by every rank first, it completes.
#[test]
fn making_a_communicator_waits_for_every_rank() {
    let late = |t: &SimRank| -> duplex::Result<()> {
        let mut b = t.alloc::<u32>(16)?;
        if t.rank() == 0 {
            t.recv(&mut b, 1)?;
            t.synchronize()?;
            t.comm("late", &[0, 1])?;
        } else {
            t.comm("late", &[0, 1])?;
            t.send(&b, 0)?;
            t.synchronize()?;
        }
        Ok(())
    };
    match Sim::new(2).check(late) {
        Err(Failure::Hang(h)) => {
            assert!(!h.stuck.cycle.is_empty(), "{h}");
            assert!(h.to_string().contains("ncclCommSplit"), "{h}");
        }
        other => panic!("a split after a wait for the peer inside it hangs: {other:?}"),
    }
    let missing = |t: &SimRank| -> duplex::Result<()> {
        if t.rank() < 2 {
            t.comm("pair", &[0, 1])?;
        }
        Ok(())
    };
    assert!(
        matches!(Sim::new(3).check(missing), Err(Failure::Hang(_))),
        "a split rank 2 never makes hangs"
    );
    let first = |t: &SimRank| -> duplex::Result<()> {
        let c = t.comm("pair", &[0, 1])?;
        if let Some(c) = c {
            let peer = 1 - t.rank();
            let out = t.alloc::<u32>(16)?;
            let mut inb = t.alloc::<u32>(16)?;
            let s = t.stream("s")?;
            let on = duplex::Place::on(&c, &s);
            t.group(|| {
                t.send_on(&out, peer, &on)?;
                t.recv_on(&mut inb, peer, &on)
            })?;
        }
        t.synchronize()
    };
    Sim::new(3)
        .check(first)
        .expect("a split every rank makes first completes");
}

/// Rank 0 receives into a buffer on stream `a`, and a second thread sends
/// it on stream `b`, while the first thread syncs `a` (or, with
/// `sync_first`, before it starts the second): D1 of `docs/semantics.md`.
fn recv_then_send_on_another_thread(sync_first: bool) -> impl Fn(&SimRank) -> duplex::Result<()> {
    move |t: &SimRank| {
        if t.rank() == 1 {
            let out = t.alloc::<u32>(8)?;
            let mut back = t.alloc::<u32>(8)?;
            t.send(&out, 0)?;
            t.recv(&mut back, 0)?;
            return t.synchronize();
        }
        let (a, b) = (t.stream("a")?, t.stream("b")?);
        let (from, to) = (t.lane(1, Dir::Recv)?, t.lane(1, Dir::Send)?);
        let mut x = t.alloc::<u32>(8)?;
        t.recv_on(&mut x, 1, &Place::on(&from.comm, &a))?;
        if sync_first {
            t.sync_stream(&a)?;
        }
        let tx = t.spawn("tx", move |t: &SimRank| {
            t.send_on(&x, 1, &Place::on(&to.comm, &b))?;
            t.synchronize()
        })?;
        t.sync_stream(&a)?;
        t.join(tx)
    }
}

#[test]
fn a_race_between_streams_is_found_in_the_interleavings_that_have_it() {
    let sim = Sim::new(2).policy(Policy::PerDirection);
    let failure = sim
        .check(recv_then_send_on_another_thread(false))
        .unwrap_err();
    let text = failure.to_string();
    assert!(
        text.contains(
            "send 8 x u32 to rank 1 on stream `b` reads a buffer that `recv 8 x u32 from rank 1`"
        ),
        "{text}"
    );
    assert!(
        text.contains("nothing orders the two on the device"),
        "{text}"
    );
    assert!(text.contains("rank 0 tx"), "the thread is named: {text}");
    // The interleaving where the sync returns before the send is made has
    // no race: some random schedules complete.
    let completed = (0..40)
        .filter(|s| sim.run(*s, recv_then_send_on_another_thread(false)).is_ok())
        .count();
    assert!(
        completed > 0 && completed < 40,
        "{completed} of 40 completed"
    );
    // Synced before the second thread starts: no interleaving races.
    let ok = sim.check(recv_then_send_on_another_thread(true));
    assert!(ok.is_ok(), "{}", ok.unwrap_err());
}

#[test]
fn the_replay_hint_of_a_non_default_model_is_rust_that_compiles() {
    // The expression the hint prints, written here so that it compiles.
    let model = duplex::Model {
        eager: duplex::Size(1024),
        lazy_connect: true,
        comm_order: true,
        kernels: Some(2),
        one_sided_groups: false,
        cold_mismatched_only: false,
    };
    let failure = Sim::new(2).model(model).check(seed).unwrap_err();
    let text = failure.to_string();
    assert!(
        text.contains(
            "duplex_sim::Sim::new(2).policy(Policy::Shared).model(duplex::Model { eager: duplex::Size(1024), lazy_connect: true, comm_order: true, kernels: Some(2), one_sided_groups: false, cold_mismatched_only: false }).replay(\"v1:"
        ),
        "{text}"
    );
}

/// A group over two streams of one communicator holds both until it has
/// completed (R8): a send on one of them of what the group received on
/// the other is ordered after it, and so is anything after a sync of
/// either (D1 must not refuse these).
#[test]
fn a_group_over_two_streams_orders_each_after_all_of_it() {
    let prog = |t: &SimRank| -> duplex::Result<()> {
        let peer = 1 - t.rank();
        let (a, b, c) = (t.stream("a")?, t.stream("b")?, t.stream("c")?);
        let world = t.world();
        let out = t.alloc::<u32>(8)?;
        let mut x = t.alloc::<u32>(8)?;
        let mut back = t.alloc::<u32>(8)?;
        t.group(|| {
            t.recv_on(&mut x, peer, &Place::on(&world, &a))?;
            t.send_on(&out, peer, &Place::on(&world, &b))
        })?;
        t.group(|| {
            t.send_on(&x, peer, &Place::on(&world, &b))?;
            t.recv_on(&mut back, peer, &Place::on(&world, &c))
        })?;
        t.sync_stream(&b)?;
        // `back`'s recv was in the second group, on c and b: synced.
        let mut last = t.alloc::<u32>(8)?;
        t.group(|| {
            t.send_on(&back, peer, &Place::on(&world, &a))?;
            t.recv_on(&mut last, peer, &Place::on(&world, &a))
        })?;
        t.synchronize()
    };
    let r = Sim::new(2).check(prog);
    assert!(r.is_ok(), "{}", r.unwrap_err());
}

/// A thread that waits for another outside the transport (here a channel
/// from its rank's main thread, which is parked in a transport call) would
/// hang the test: past the limit the execution ends with an error that
/// names it, and the test goes on.
#[test]
fn a_wait_outside_the_transport_is_an_error_not_a_hung_test() {
    let start = Instant::now();
    let failure = Sim::new(2)
        .user_code_limit(Duration::from_millis(300))
        .run(0, |t| {
            if t.rank() == 1 {
                return t.synchronize();
            }
            let (tx, rx) = std::sync::mpsc::channel::<u32>();
            let waiter = t.spawn("waiter", move |t: &SimRank| {
                let n = rx.recv().map_err(|e| Error::User(e.to_string()))?;
                let buf = t.alloc::<u32>(n as usize)?;
                t.send(&buf, 1)
            })?;
            t.synchronize()?;
            tx.send(8).map_err(|e| Error::User(e.to_string()))?;
            t.join(waiter)
        })
        .unwrap_err();
    let text = failure.to_string();
    assert!(text.contains("rank 0 waiter failed"), "{text}");
    assert!(text.contains("without a transport call"), "{text}");
    assert!(text.contains("Sim::user_code_limit"), "{text}");
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
}

/// Host reads and writes are transport calls too: a thread that makes only
/// those, for longer than the limit, is not stuck.
#[test]
fn host_reads_and_writes_count_as_progress() {
    let r = Sim::new(1)
        .user_code_limit(Duration::from_millis(200))
        .run(0, |t| {
            let mut b = t.alloc::<u32>(4)?;
            let helper = t.spawn("helper", |t: &SimRank| t.synchronize())?;
            let start = Instant::now();
            while start.elapsed() < Duration::from_millis(700) {
                t.write(&mut b, &[1, 2, 3, 4])?;
                t.read(&b)?;
                std::thread::sleep(Duration::from_millis(5));
            }
            t.join(helper)
        });
    assert!(r.is_ok(), "{}", r.unwrap_err());
}

#[test]
fn a_user_tag_may_not_pose_as_a_split() {
    let r = Sim::new(2).run(0, |t| {
        match t.notify(1 - t.rank(), "ncclCommSplit #0 (comm x)") {
            Err(Error::Invalid { message, .. }) => {
                assert!(message.contains("duplex's own"), "{message}");
                Ok(())
            }
            other => panic!("expected an invalid call, got {other:?}"),
        }
    });
    assert!(r.is_ok(), "{}", r.unwrap_err());
}

/// Rank 0's threads each send their own number on one lane, so the order
/// they launch in decides which of rank 1's receives gets which; rank 1
/// fails on one order of the data it reads. The machine ends every order in
/// one state: the search must still tell them apart by the bytes delivered
/// (a review found `check` passing this when its fingerprint left the data
/// out).
fn feeders(threads: u32, bad: Vec<u32>) -> impl Fn(&SimRank) -> duplex::Result<()> + Sync {
    move |t: &SimRank| {
        if t.rank() == 0 {
            let mut spawned = Vec::new();
            for v in 1..=threads {
                spawned.push(t.spawn(&format!("t{v}"), move |t: &SimRank| {
                    let mut b = t.alloc::<u32>(1)?;
                    t.write(&mut b, &[v])?;
                    t.send(&b, 1)?;
                    t.synchronize()
                })?);
            }
            for s in spawned {
                t.join(s)?;
            }
            t.notify(1, "done")
        } else {
            let mut bufs = Vec::new();
            for _ in 0..threads {
                let mut b = t.alloc::<u32>(1)?;
                t.recv(&mut b, 0)?;
                bufs.push(b);
            }
            t.synchronize()?;
            t.await_notify(0, "done")?;
            let mut got = Vec::new();
            for b in &bufs {
                got.push(t.read(b)?[0]);
            }
            if got == bad {
                return Err(Error::Aborted(format!("the order {got:?}")));
            }
            Ok(())
        }
    }
}

#[test]
fn the_search_tells_apart_executions_that_delivered_different_data() {
    let orders: Vec<Vec<u32>> = vec![
        vec![1, 2],
        vec![2, 1],
        vec![1, 2, 3],
        vec![2, 1, 3],
        vec![3, 1, 2],
        vec![3, 2, 1],
        vec![2, 3, 1],
    ];
    for bad in orders {
        let threads = bad.len() as u32;
        for policy in [Policy::PerDirection, Policy::Shared] {
            for reduce in [true, false] {
                let mut sim = Sim::new(2).policy(policy);
                if !reduce {
                    sim = sim.without_reduction();
                }
                let failure = sim
                    .check(feeders(threads, bad.clone()))
                    .expect_err("some order of the sends delivers the bad data");
                let text = failure.to_string();
                assert!(
                    text.contains(&format!("the order {bad:?}")),
                    "{bad:?} under {policy:?}, reduce {reduce}: {text}"
                );
            }
        }
    }
}

/// Data in the fingerprint keeps the search finite and small: the program
/// that fails on no order of three feeders takes 354 executions (164 when
/// the search merged executions that delivered different data, and missed
/// the bad orders).
#[test]
fn data_in_the_fingerprint_keeps_the_search_finite_and_small() {
    let run = Sim::new(2)
        .policy(Policy::PerDirection)
        .check(feeders(3, vec![]))
        .expect("no order is bad");
    assert!(run.executions >= 6, "{} executions", run.executions);
    assert!(run.executions <= 400, "{} executions", run.executions);
}

/// A buffer kept from another execution (in a static, say) is refused with
/// an error that says so, not taken for this execution's buffer of the same
/// index (it wrote over another buffer before).
#[test]
fn a_buffer_from_another_run_is_refused() {
    use std::sync::Mutex;
    static KEPT: Mutex<Vec<duplex_sim::sim::SimBuffer<u32>>> = Mutex::new(Vec::new());
    Sim::new(1)
        .run(0, |t: &SimRank| {
            KEPT.lock().unwrap().push(t.alloc::<u32>(4)?);
            Ok(())
        })
        .expect("the first run");
    let failure = Sim::new(1)
        .run(0, |t: &SimRank| {
            let mine = t.alloc::<u8>(1)?;
            let mut stale = KEPT.lock().unwrap().pop().expect("kept");
            let e = t.write(&mut stale, &[7; 4]).expect_err("a stale buffer");
            assert!(e.to_string().contains("another run"), "{e}");
            assert_eq!(t.read(&mine)?, vec![0]);
            t.send(&stale, 0).map(drop)
        })
        .expect_err("the send of a stale buffer");
    assert!(failure.to_string().contains("another run"), "{failure}");
}

/// So are a stream, an event, a communicator (a lane's) and a thread kept
/// from another execution: each would name one of this execution's by its
/// number (a stale stream's sync acted on this run's stream of that number).
#[test]
fn streams_events_comms_and_threads_from_another_run_are_refused() {
    use duplex_sim::sim::{SimEvent, SimStream, SimThread};
    use std::sync::Mutex;
    type Kept = (SimStream, SimEvent, duplex::Lane<SimRank>, SimThread);
    static KEPT: Mutex<Option<Kept>> = Mutex::new(None);
    let make = |t: &SimRank| -> duplex::Result<()> {
        let s = t.stream("a")?;
        let e = t.event()?;
        let lane = t.lane(0, Dir::Send)?;
        let th = t.spawn("helper", |_: &SimRank| Ok(()))?;
        *KEPT.lock().unwrap() = Some((s, e, lane, th));
        Ok(())
    };
    Sim::new(1).run(0, make).expect("the first run");
    Sim::new(1)
        .run(0, |t: &SimRank| {
            // This run's own, with the same numbers as the kept ones.
            let mine = t.stream("a")?;
            let _event = t.event()?;
            let (s, e, lane, th) = KEPT.lock().unwrap().take().expect("kept");
            let b = t.alloc::<u8>(4)?;
            let place = Place::on(&lane.comm, &mine);
            let refused = [
                ("sync_stream", t.sync_stream(&s)),
                ("record", t.record(&e, &mine)),
                ("wait", t.wait(&e, &mine)),
                ("with_stream", t.with_stream(&s, || Ok(()))),
                ("send_on a stale comm", t.send_on(&b, 0, &place)),
                (
                    "send_on a stale stream",
                    t.send_on(&b, 0, &Place::stream(&s)),
                ),
                ("join", t.join(th)),
            ];
            for (what, r) in refused {
                let e = r.expect_err(what);
                assert!(
                    matches!(e, Error::Invalid { .. }) && e.to_string().contains("another run"),
                    "{what}: {e}"
                );
            }
            // The run's own objects still work.
            t.sync_stream(&mine)
        })
        .expect("every stale object refused, the run goes on");
}

/// A panic the rank code catches inside `group` or `with_stream` does not
/// leave the group open or the stream scoped: later ops launch as usual.
#[test]
fn a_caught_panic_in_group_or_with_stream_leaves_nothing_behind() {
    use std::panic::{AssertUnwindSafe, catch_unwind};
    Sim::new(2)
        .policy(Policy::PerDirection)
        .check(|t: &SimRank| {
            let peer = 1 - t.rank();
            let side = t.stream("side")?;
            let _ = catch_unwind(AssertUnwindSafe(|| {
                t.group(|| -> duplex::Result<()> { panic!("in a group") })
            }));
            let _ = catch_unwind(AssertUnwindSafe(|| {
                t.with_stream(&side, || -> duplex::Result<()> { panic!("on a stream") })
            }));
            // Both ranks send first: only per-direction lanes (not the
            // stream `side`, shared by both directions) keep this from a
            // hang, and the bytes must arrive.
            let mut out = t.alloc::<u32>(2)?;
            t.write(&mut out, &[t.rank(), 7])?;
            let mut inb = t.alloc::<u32>(2)?;
            t.send(&out, peer)?;
            t.recv(&mut inb, peer)?;
            t.synchronize()?;
            assert_eq!(t.read(&inb)?, vec![peer, 7]);
            Ok(())
        })
        .expect("the lanes carry both directions");
}

/// Settings that cannot run are refused before anything runs; a replayed
/// schedule with choices left over is not the program's.
#[test]
fn no_ranks_no_executions_and_a_long_schedule_are_refused() {
    let ok = |_: &SimRank| Ok(());
    for failure in [
        Sim::new(0).check(ok).unwrap_err(),
        Sim::new(0).run(0, ok).unwrap_err(),
        Sim::new(2).max_executions(0).check(ok).unwrap_err(),
    ] {
        assert!(matches!(failure, Failure::Setting(_)), "{failure}");
    }
    let run = Sim::new(2).run(3, rpc).expect("rpc runs");
    Sim::new(2)
        .replay(&run.schedule, rpc)
        .expect("its own schedule");
    let longer = format!("{}.0.1.0", run.schedule.trim_end_matches(':'));
    let longer = longer.replace(":.", ":");
    let failure = Sim::new(2).replay(&longer, rpc).unwrap_err();
    assert!(matches!(failure, Failure::Schedule(_)), "{failure}");
    assert!(failure.to_string().contains("left when"), "{failure}");
}

/// Once an execution has failed, `alloc` fails too, as every call does.
#[test]
fn alloc_after_a_failed_execution_fails() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let refused = AtomicBool::new(false);
    let failure = Sim::new(2)
        .run(0, |t: &SimRank| {
            if t.rank() == 0 {
                t.await_notify(1, "ready")?;
                return Err(Error::Aborted("rank 0 gives up".into()));
            }
            // Rank 1 waits for a notify that never comes, and is told why.
            t.notify(0, "ready")?;
            let e = t.await_notify(0, "never").expect_err("rank 0 failed");
            if let Err(again) = t.alloc::<u8>(8) {
                refused.store(again.to_string() == e.to_string(), Ordering::SeqCst);
            }
            Err(e)
        })
        .unwrap_err();
    assert!(failure.to_string().contains("rank 0 gives up"), "{failure}");
    assert!(
        refused.load(Ordering::SeqCst),
        "alloc went on after the failure"
    );
}

/// A dropped buffer's bytes are freed, so that code that makes and drops a
/// large buffer per step runs in the memory of one (1 GiB, 64 times: far
/// past what this machine has, where every buffer was kept to the end of
/// the run).
#[test]
fn a_dropped_buffer_frees_its_bytes() {
    let r = Sim::new(1).run(0, |t| {
        for step in 0..64 {
            let b = t
                .alloc::<u8>(1 << 30)
                .map_err(|e| Error::User(format!("step {step}: {e}")))?;
            drop(b);
        }
        Ok(())
    });
    assert!(r.is_ok(), "{}", r.unwrap_err());
}

/// A buffer dropped while an op of its is in flight keeps its bytes until
/// the op is done with them: the send delivers what was written, and a
/// recv into a dropped buffer still completes.
#[test]
fn a_buffer_dropped_in_flight_still_delivers() {
    Sim::new(2)
        .policy(Policy::PerDirection)
        .check(|t| {
            if t.rank() == 0 {
                for value in [7, 8] {
                    let mut out = t.alloc::<u32>(64)?;
                    t.write(&mut out, &[value; 64])?;
                    t.send(&out, 1)?;
                    drop(out);
                }
                t.synchronize()
            } else {
                let mut spare = t.alloc::<u32>(64)?;
                t.recv(&mut spare, 0)?;
                drop(spare);
                let mut inb = t.alloc::<u32>(64)?;
                t.recv(&mut inb, 0)?;
                t.synchronize()?;
                let got = t.read(&inb)?;
                if got != [8; 64] {
                    return Err(Error::User(format!("got {got:?}")));
                }
                Ok(())
            }
        })
        .map(drop)
        .unwrap_or_else(|f| panic!("{f}"));
}

/// The host may read a buffer once a sync covers its op through an event:
/// a recv on A, an event recorded on A and waited for on B, then a sync of
/// B (CUDA orders it, and the GPU backend allows it). Without the wait,
/// the sync of B covers nothing on A, and the read is a race.
#[test]
fn a_sync_covers_what_events_ordered_before_its_stream() {
    for chained in [true, false] {
        let r = Sim::new(2).policy(Policy::PerDirection).check(move |t| {
            let mut b = t.alloc::<u32>(4)?;
            if t.rank() == 0 {
                t.write(&mut b, &[5; 4])?;
                t.send(&b, 1)?;
                return t.synchronize();
            }
            let a = t.lane(0, Dir::Recv)?.stream;
            let s = t.stream("consumer")?;
            let e = t.event()?;
            t.recv_on(&mut b, 0, &Place::stream(&a))?;
            t.record(&e, &a)?;
            if chained {
                t.wait(&e, &s)?;
            }
            t.sync_stream(&s)?;
            let got = t.read(&b);
            if chained {
                let got = got?;
                if got != [5; 4] {
                    return Err(Error::User(format!("got {got:?}")));
                }
            } else {
                match got {
                    Err(Error::Race { message, .. }) => {
                        assert!(message.contains("recv 4 x u32 from rank 0"), "{message}")
                    }
                    other => panic!("expected a race, got {other:?}"),
                }
            }
            t.synchronize()
        });
        assert!(r.is_ok(), "chained {chained}: {}", r.unwrap_err());
    }
}

/// Rank code that retries a failed wait (as it may on GPUs, where a hang is
/// a deadline that passed) is ended once the execution is over, where it
/// spun for ever: the run returns the hang.
#[test]
fn a_thread_that_retries_after_the_end_is_ended() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = Sim::new(2).run(0, |t| {
            if t.rank() == 0 {
                while t.await_notify(1, "go").is_err() {}
            }
            Ok(()) // rank 1 never notifies
        });
        let _ = tx.send(r.map(drop).map_err(|e| e.to_string()));
    });
    let r = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("Sim::run returned");
    let e = r.expect_err("a hang");
    assert!(e.contains("`await 1 go`"), "{e}");
    assert!(e.contains("will ever `notify 0 go`"), "{e}");
}

/// The same loop in a correct program, explored: executions that the
/// search cuts short end its threads too, and the check completes.
#[test]
fn a_retry_loop_in_a_correct_program_is_explored_to_the_end() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = Sim::new(2).check(|t| {
            let peer = 1 - t.rank();
            let a = t.spawn("a", move |t: &SimRank| {
                while t.await_notify(peer, "go").is_err() {}
                Ok(())
            })?;
            let b = t.spawn("b", move |t: &SimRank| t.notify(peer, "go"))?;
            t.join(a)?;
            t.join(b)
        });
        let _ = tx.send(r.map(|r| r.executions).map_err(|e| e.to_string()));
    });
    let r = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("Sim::check returned");
    assert!(r.is_ok(), "{}", r.unwrap_err());
}

/// Rank code that does something else when run again (here a counter kept
/// across executions; a clock, randomness or a HashMap's order do the
/// same) cannot be searched: `Sim::check` says so, where it returned Ok.
#[test]
fn rank_code_that_changes_between_executions_is_reported() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static EXECUTIONS: AtomicUsize = AtomicUsize::new(0);
    let r = Sim::new(2)
        .policy(Policy::PerDirection)
        .check(|t: &SimRank| {
            if t.rank() == 0 {
                // Two sends on one lane: their order is a choice.
                let a = t.spawn("tx", |t: &SimRank| {
                    let b = t.alloc::<u8>(1)?;
                    t.send(&b, 1)
                })?;
                let c = t.spawn("tx2", |t: &SimRank| {
                    let b = t.alloc::<u8>(1)?;
                    t.send(&b, 1)
                })?;
                t.join(a)?;
                t.join(c)
            } else {
                if EXECUTIONS.fetch_add(1, Ordering::Relaxed) >= 1 {
                    t.notify(0, "only-sometimes")?;
                }
                let mut a = t.alloc::<u8>(1)?;
                let mut b = t.alloc::<u8>(1)?;
                t.recv(&mut a, 0)?;
                t.recv(&mut b, 0)?;
                t.synchronize()
            }
        });
    match r {
        Err(Failure::Nondeterministic(m)) => assert!(m.contains("same first"), "{m}"),
        other => panic!("expected the nondeterminism found, got {other:?}"),
    }
}

/// Half-precision buffers move their bits, and a bf16 send met by an f16
/// recv of as many bytes is a type mismatch, as on NCCL (which moves
/// `ncclBfloat16` and `ncclFloat16`).
#[test]
fn half_precision_moves_and_its_two_kinds_are_told_apart() {
    use duplex::{Bf16, F16};
    Sim::new(2)
        .policy(Policy::PerDirection)
        .check(|t| {
            if t.rank() == 0 {
                let mut out = t.alloc::<Bf16>(8)?;
                t.write(&mut out, &[Bf16(0x3fc0); 8])?;
                t.send(&out, 1)?;
                t.synchronize()
            } else {
                let mut inb = t.alloc::<Bf16>(8)?;
                t.recv(&mut inb, 0)?;
                t.synchronize()?;
                let got = t.read(&inb)?;
                if got != [Bf16(0x3fc0); 8] {
                    return Err(Error::User(format!("got {got:?}")));
                }
                Ok(())
            }
        })
        .map(drop)
        .unwrap_or_else(|f| panic!("{f}"));
    let f = Sim::new(2)
        .policy(Policy::PerDirection)
        .check(|t| {
            if t.rank() == 0 {
                let out = t.alloc::<Bf16>(8)?;
                t.send(&out, 1)?;
            } else {
                let mut inb = t.alloc::<F16>(8)?;
                t.recv(&mut inb, 0)?;
            }
            t.synchronize()
        })
        .expect_err("a type mismatch");
    let text = f.to_string();
    assert!(text.contains("bf16") && text.contains("f16"), "{text}");
    assert!(matches!(f, Failure::Program { .. }), "{text}");
}

/// A thread ended for calling after the end unwinds its code; a `Drop` on
/// the way that calls the transport again gets the error, and the process
/// does not abort (a second unwind from a destructor would).
#[test]
fn calls_from_a_drop_while_the_thread_is_ended_get_errors() {
    struct SyncOnDrop<'a>(&'a SimRank);
    impl Drop for SyncOnDrop<'_> {
        fn drop(&mut self) {
            for _ in 0..300 {
                let _ = self.0.synchronize();
            }
        }
    }
    let e = Sim::new(2)
        .run(0, |t| {
            if t.rank() == 0 {
                let _guard = SyncOnDrop(t);
                while t.await_notify(1, "go").is_err() {}
            }
            Ok(())
        })
        .expect_err("a hang");
    assert!(e.to_string().contains("`await 1 go`"), "{e}");
}

#[path = "support/pipeline.rs"]
mod pipeline;
use pipeline::pipeline;

/// Threads whose steps touch nothing in common are explored in one
/// execution: the search learns from what each step used which orders
/// matter (`duplex_sim::dpor`). Four stages of two micro-batches took more
/// than 100,000 executions (2.4 min) before, searching every order of each
/// rank's two threads; three stages of one, 855.
#[test]
fn a_pipeline_whose_threads_are_independent_is_one_execution() {
    for (stages, micro) in [(2, 1), (3, 2), (4, 2), (8, 4)] {
        let run = Sim::new(stages)
            .policy(Policy::PerDirection)
            .check(pipeline(stages, micro))
            .unwrap_or_else(|f| panic!("{stages} stages: {f}"));
        assert_eq!(run.executions, 1, "{stages} stages × {micro}");
    }
    // The search without the reduction agrees, with every interleaving.
    let full = Sim::new(2)
        .policy(Policy::PerDirection)
        .without_reduction()
        .check(pipeline(2, 1))
        .expect("no failure in any interleaving");
    assert!(full.executions > 10, "{}", full.executions);
}

/// A launch that starts a connection handshake holds up the rank's other
/// launches on its communicator until the handshake ends: the search must
/// see that it disabled them (their own check, when they run, finds it
/// ordered before them by the handshake's end). Found by the property
/// test that the simulator and the checker agree: the search tried only
/// rank 1's recv first, and missed the hang that its other thread's send
/// first makes.
#[test]
fn a_launch_that_holds_up_another_threads_launch_is_tried_both_ways() {
    let text = "ranks 2\npolicy shared\nmodel eager=4KiB lazy-connect=on cold-channels=mismatched\nrank 0:\n  send 1 4KiB comm=world\n  recv 1 4KiB comm=world\nrank 1:\n  recv 0 4KiB comm=world\nrank 1 thread t0:\n  send 0 4KiB comm=world\n";
    let p = duplex::schedule::parse(text).expect("valid");
    let program = std::sync::Arc::new(p.clone());
    for reduce in [true, false] {
        let mut sim = Sim::new(p.ranks).policy(p.policy).model(p.model);
        if !reduce {
            sim = sim.without_reduction();
        }
        let got = sim.check(|t| duplex::schedule::execute(&program, t));
        assert!(
            matches!(got, Err(Failure::Hang(_))),
            "reduce={reduce}: {:?}",
            got.map(|r| r.executions)
        );
    }
}
