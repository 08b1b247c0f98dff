//! The checker's snapshot budget (`check::Options::snapshot_memory`): a
//! search that keeps fewer snapshots than its path has decision points
//! re-executes from the nearest one it kept, and must find exactly what
//! the search that keeps them all finds; and the estimate of a snapshot's
//! bytes the budget is counted in must be close to what a clone of the
//! machine allocates (measured here with a counting allocator).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

mod common;

use duplex::compile::{Compiled, compile};
use duplex::schedule::parse;
use duplex_sim::check::{self, Options, Runnable};

/// Counts the bytes each thread allocated and not yet freed (the tests
/// run in parallel; a clone is made and dropped on one thread).
struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn live() -> isize {
    LIVE.with(Cell::get)
}

// SAFETY: forwards to the system allocator, counting sizes on the side.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = LIVE.try_with(|n| {
            n.set(n.get() + layout.size() as isize);
            let _ = PEAK.try_with(|p| p.set(p.get().max(n.get())));
        });
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let _ = LIVE.try_with(|n| n.set(n.get() - layout.size() as isize));
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn examples() -> Vec<(String, Compiled)> {
    common::examples()
        .into_iter()
        .map(|(name, text)| (name, compile(&parse(&text).expect("valid example"))))
        .collect()
}

/// A ring of `n` ranks, `t` host threads each, every thread sending to the
/// next rank and receiving from the one before, `k` times: deep searches
/// whose machine grows with `n`.
fn ring(n: u32, t: u32, k: u32) -> String {
    let mut s = format!("ranks {n}\npolicy per-direction\n");
    for r in 0..n {
        for j in 0..t {
            s += &if j == 0 {
                format!("rank {r}:\n")
            } else {
                format!("rank {r} thread t{j}:\n")
            };
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            for _ in 0..k {
                if r % 2 == 0 {
                    s += &format!("  send {next} 1MiB\n  recv {prev} 1MiB\n");
                } else {
                    s += &format!("  recv {prev} 1MiB\n  send {next} 1MiB\n");
                }
            }
        }
    }
    s
}

/// Every pair of `n` ranks exchanges one message each way on two threads
/// per rank, under PyTorch's placement (`shared`): sends first on one
/// thread, receives on the other.
fn all_to_all(n: u32) -> String {
    let mut s = format!("ranks {n}\npolicy shared\n");
    for r in 0..n {
        s += &format!("rank {r}:\n");
        for p in (0..n).filter(|p| *p != r) {
            s += &format!("  send {p} 4KiB\n");
        }
        s += &format!("rank {r} thread rx:\n");
        for p in (0..n).filter(|p| *p != r) {
            s += &format!("  recv {p} 4KiB\n");
        }
    }
    s
}

/// Programs whose host threads share ranks, so that their searches
/// branch: rings and all-to-alls of a few ranks, under both placements.
fn branching() -> Vec<(String, Compiled)> {
    let mut texts = Vec::new();
    for (n, t, k) in [
        (2, 2, 2),
        (3, 2, 2),
        (4, 2, 1),
        (4, 3, 1),
        (6, 2, 1),
        (3, 3, 2),
    ] {
        texts.push((
            format!("ring of {n}, {t} threads, {k} rounds"),
            ring(n, t, k),
        ));
    }
    for n in [3, 4] {
        texts.push((format!("all-to-all of {n}"), all_to_all(n)));
    }
    let mut out = Vec::new();
    for (name, text) in texts {
        let mut program = parse(&text).expect("valid program");
        out.push((name.clone(), compile(&program)));
        program.policy = match program.policy {
            duplex::Policy::Shared => duplex::Policy::PerDirection,
            duplex::Policy::PerDirection => duplex::Policy::Shared,
        };
        out.push((format!("{name} (other policy)"), compile(&program)));
    }
    out
}

/// Rank 0 sends `n` messages in a burst that rank 1 receives, then two
/// threads on each rank exchange `k` more on one communicator: the burst
/// fills the launch table, which then drains, and the search branches
/// after it (a review found a clone of such a table 234 times its
/// estimate: it kept every bucket it ever had).
fn burst_then_deep(n: u32, k: u32) -> String {
    let mut s = String::from("ranks 2\npolicy shared\ncomm c01 0 1\nrank 0:\n");
    s += &"  send 1 4KiB\n".repeat(n as usize);
    s += "  sync\n  notify 1 go\n  notify 1 go\n";
    for t in ["a", "b"] {
        s += &format!("rank 0 thread {t}:\n  await 1 go\n");
        s += &"  recv 1 4KiB comm=c01 stream=t\n".repeat(k as usize);
    }
    s += "rank 1:\n";
    s += &"  recv 0 4KiB\n".repeat(n as usize);
    s += "  sync\n  notify 0 go\n  notify 0 go\n";
    for t in ["a", "b"] {
        s += &format!("rank 1 thread {t}:\n  await 0 go\n");
        s += &"  send 0 4KiB comm=c01 stream=t\n".repeat(k as usize);
    }
    s
}

/// Every program the estimate is measured on.
fn programs() -> Vec<(String, Compiled)> {
    let mut out = examples();
    out.extend(branching());
    out.push((
        "a burst of 300, then two threads a rank".into(),
        compile(&parse(&burst_then_deep(300, 3)).expect("valid program")),
    ));
    let big = ring(256, 4, 2);
    out.push((
        "ring of 256, 4 threads each".into(),
        compile(&parse(&big).expect("valid program")),
    ));
    out
}

/// A budget of one byte keeps no snapshot (every backtrack re-executes
/// from the start; on the smaller searches), and 64 KiB some of them: both must explore exactly the
/// states, executions and host steps of the search that keeps them all,
/// and reach the same verdict by the same schedule.
#[test]
fn a_small_budget_finds_what_a_large_one_finds() {
    let mut squeezed = 0;
    let examples = examples();
    let n = examples.len();
    for (i, (name, c)) in examples.into_iter().chain(branching()).enumerate() {
        let run = |budget: usize| {
            check::check(
                &c,
                &Options {
                    max_states: 20_000,
                    snapshot_memory: Some(budget),
                    ..Options::default()
                },
            )
        };
        let full = run(usize::MAX);
        assert_eq!(full.stats.snapshots, None, "{name}");
        // No snapshot at all costs each execution the whole path again:
        // only on the smaller searches (a debug build runs these).
        if full.stats.transitions > 20_000 {
            continue;
        }
        // Room for three snapshots of the start.
        let mut m = c.machine();
        let start = Runnable::new(&c, &mut m);
        let three = 3 * check::estimated_snapshot_bytes(&m, &start);
        for budget in [1, three] {
            let small = run(budget);
            let what = format!("{name} within {budget} bytes: {:?}", small.stats);
            assert_eq!(small.verdict.kind(), full.verdict.kind(), "{what}");
            assert_eq!(small.stats.states, full.stats.states, "{what}");
            assert_eq!(small.stats.executions, full.stats.executions, "{what}");
            assert_eq!(small.stats.transitions, full.stats.transitions, "{what}");
            assert_eq!(small.stats.depth, full.stats.depth, "{what}");
            assert_eq!(schedule(&small.verdict), schedule(&full.verdict), "{what}");
            // The generated programs backtrack deep: there the budget of
            // three snapshots must have dropped some and re-executed.
            let thinned = small.stats.snapshots;
            if budget == 1 && full.stats.depth > 0 {
                assert!(thinned.is_some_and(|t| t.kept_none), "{what}");
                if full.stats.executions > 1 {
                    assert!(thinned.is_some_and(|t| t.replayed > 0), "{what}");
                }
            }
            if i >= n && budget > 1 && full.stats.executions > 1 {
                let t = thinned.expect("thinned");
                assert!(t.every > 1 && !t.kept_none && t.replayed > 0, "{what}");
                squeezed += 1;
            }
        }
    }
    assert!(squeezed >= 10, "only {squeezed} searches re-executed steps");
}

fn schedule(v: &check::Verdict) -> Option<String> {
    match v {
        check::Verdict::Deadlock { schedule, .. } | check::Verdict::Error { schedule, .. } => {
            Some(schedule.to_string())
        }
        _ => None,
    }
}

/// The estimate is close to the bytes a clone of the machine and its
/// runnable set allocates, at every step of a program's first execution
/// (the first 40 of the ring of 256 ranks): never below half (the budget
/// must hold), at most three times (an over-estimate costs only speed).
#[test]
fn the_estimate_of_a_snapshot_is_close_to_what_a_clone_allocates() {
    let mut worst: (f64, String) = (1.0, String::new());
    for (name, c) in programs() {
        let mut m = c.machine();
        let mut run = Runnable::new(&c, &mut m);
        let mut steps = 0;
        loop {
            let before = live();
            let copy = (m.clone(), run.clone());
            let real = (live() - before) as f64;
            drop(copy);
            let estimate = check::estimated_snapshot_bytes(&m, &run) as f64;
            let ratio = estimate / real.max(1.0);
            if real > 4096.0 {
                let what = format!("{name} after {steps} steps: estimate {estimate}, clone {real}");
                assert!((0.5..=3.0).contains(&ratio), "{what}");
                if (ratio.ln()).abs() > worst.0.ln().abs() {
                    worst = (ratio, what);
                }
            }
            let Some(t) = run.first() else { break };
            let limit = if name.contains("256") { 40 } else { 5_000 };
            if steps > limit || check::step(&c, &mut m, t).is_err() {
                break;
            }
            run.update(&c, &mut m);
            steps += 1;
        }
    }
    eprintln!("the worst estimate: {:.2}x, {}", worst.0, worst.1);
}

/// What the search holds stays near its budget: the peak of the bytes this
/// thread allocated during a check, above what it held before, is at most
/// that of the same search keeping no snapshot (the machine it steps, the
/// states seen, the path) plus three times the budget (the snapshots kept
/// within the budget by their estimate, which is at least half of what
/// they hold); on a program whose launch table filled and drained before
/// the search branched (a review measured 16.5 MiB for a budget of 1 MiB
/// before a table's clone was sized to its entries) and on a ring.
#[test]
fn a_check_holds_about_its_snapshot_budget() {
    for (name, text) in [
        ("a burst of 100", burst_then_deep(100, 4)),
        ("ring of 32, 2 threads", ring(32, 2, 2)),
    ] {
        let c = compile(&parse(&text).expect("valid program"));
        let peak = |budget: usize| {
            let base = live();
            PEAK.with(|p| p.set(base));
            let outcome = check::check(
                &c,
                &Options {
                    max_states: 200,
                    snapshot_memory: Some(budget),
                    ..Options::default()
                },
            );
            ((PEAK.with(Cell::get) - base) as usize, outcome.stats)
        };
        let (none, _) = peak(1);
        let (all, _) = peak(usize::MAX);
        // Room for four snapshots of the start.
        let mut m = c.machine();
        let start = Runnable::new(&c, &mut m);
        let budget = 4 * check::estimated_snapshot_bytes(&m, &start);
        let (held, stats) = peak(budget);
        assert!(stats.snapshots.is_some(), "{name}: {stats:?}");
        assert!(
            held <= none + 3 * budget,
            "{name}: peak {held} bytes for a budget of {budget}, {none} keeping none, {all} keeping all: {stats:?}"
        );
    }
}
