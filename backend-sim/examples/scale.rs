//! The checker at scale: the families of issue 10 with their targets,
//! each decided in a child process of its own (so that its peak memory is
//! its own), printed as a markdown table. `scripts/checker-bench.sh`
//! regenerates the table in `docs/checker-stats.md`.
//!
//! Beside them, the two-rank seed exchange (each rank sends 256 MiB to the
//! other, then receives) as `duplex check` decides it and as a `loom` model
//! of the same device rules decides it (`loom:…` rows, see [`loom_seed`]):
//! executions and time for both, in the same run.
//!
//! `cargo run --release -p duplex-sim --example scale [-- --limit SECONDS]`

#[path = "../tests/support/pipeline.rs"]
mod pipeline;

use std::process::Command;
use std::time::{Duration, Instant};

use duplex::compile::compile;
use duplex_sim::check::{self, Options};

/// A family: its name, the program, the target in words, and the bounds
/// that meet it (seconds, MiB).
struct Family {
    name: String,
    target: &'static str,
    seconds: f64,
    mib: f64,
}

fn ring(n: usize, k: usize) -> String {
    let mut s = format!("ranks {n}\npolicy per-direction\n");
    for r in 0..n {
        s.push_str(&format!("rank {r}:\n"));
        for _ in 0..k {
            s.push_str(&format!(
                "  group {{ send {} 4KiB; recv {} 4KiB }}\n",
                (r + 1) % n,
                (r + n - 1) % n
            ));
        }
    }
    s
}

fn two(k: usize) -> String {
    let mut s = String::from("ranks 2\nrank 0:\n");
    for _ in 0..k {
        s.push_str("  send 1 4KiB\n");
    }
    s.push_str("rank 1:\n");
    for _ in 0..k {
        s.push_str("  recv 0 4KiB\n");
    }
    s
}

fn one_f_one_b(p: usize, m: usize, policy: &str) -> String {
    let mut s = format!("ranks {p}\npolicy {policy}\n");
    for st in 0..p {
        s.push_str(&format!("rank {st}:\n"));
        let f = |s: &mut String| {
            if st > 0 {
                s.push_str(&format!("  recv {} 4KiB\n", st - 1));
            }
            if st + 1 < p {
                s.push_str(&format!("  send {} 4KiB\n", st + 1));
            }
        };
        let b = |s: &mut String| {
            if st + 1 < p {
                s.push_str(&format!("  recv {} 4KiB\n", st + 1));
            }
            if st > 0 {
                s.push_str(&format!("  send {} 4KiB\n", st - 1));
            }
        };
        let warmup = (p - st - 1).min(m);
        for _ in 0..warmup {
            f(&mut s);
        }
        for _ in 0..m - warmup {
            f(&mut s);
            b(&mut s);
        }
        for _ in 0..warmup {
            b(&mut s);
        }
    }
    s
}

fn all_to_all(n: usize) -> String {
    let mut s = format!("ranks {n}\npolicy per-direction\n");
    for r in 0..n {
        s.push_str(&format!("rank {r}:\n"));
        for k in 1..n {
            s.push_str(&format!(
                "  group {{ send {} 4KiB; recv {} 4KiB }}\n",
                (r + k) % n,
                (r + n - k) % n
            ));
        }
    }
    s
}

fn threads(ranks: usize, n: usize) -> String {
    let mut s = format!("ranks {ranks}\n");
    for t in 0..n {
        s.push_str(&format!(
            "comm c{t} {}\n",
            (0..ranks)
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(" ")
        ));
    }
    for r in 0..ranks {
        for t in 0..n {
            if t == 0 {
                s.push_str(&format!("rank {r}:\n"));
            } else {
                s.push_str(&format!("rank {r} thread t{t}:\n"));
            }
            let (next, prev) = ((r + 1) % ranks, (r + ranks - 1) % ranks);
            for _ in 0..2 {
                s.push_str(&format!(
                    "  group {{ send {next} 4KiB comm=c{t} stream=s{t}; recv {prev} 4KiB comm=c{t} stream=s{t} }}\n"
                ));
            }
        }
    }
    s
}

/// 2 ranks × `n` host threads whose traffic depends: every thread issues a
/// group on the one communicator `world` (on a stream of its own), so the
/// order of a rank's threads decides which send meets which recv (R2, R3).
/// The orders of the two ranks' launches are (n!)² Mazurkiewicz traces at
/// least (launches of one rank on one communicator never commute); the
/// table compares the executions the checker runs with that bound.
fn dependent(n: usize) -> String {
    let mut s = String::from("ranks 2\n");
    for r in 0..2 {
        for t in 0..n {
            if t == 0 {
                s.push_str(&format!("rank {r}:\n"));
            } else {
                s.push_str(&format!("rank {r} thread t{t}:\n"));
            }
            s.push_str(&format!(
                "  group {{ send {0} 4KiB comm=world stream=s{t}; recv {0} 4KiB comm=world stream=s{t} }}\n",
                1 - r
            ));
        }
    }
    s
}

/// The seed exchange as a schedule: each rank sends 256 MiB to the other,
/// then receives.
fn seed(policy: &str) -> String {
    let mut s = format!("ranks 2\npolicy {policy}\n");
    for r in 0..2 {
        s.push_str(&format!(
            "rank {r}:\n  send {0} 256MiB\n  recv {0} 256MiB\n",
            1 - r
        ));
    }
    s
}

/// A `loom` model of the seed exchange on the device, written as one would
/// without duplex: a thread per stream, and NCCL's rendezvous (a send and
/// its recv complete once both have started, R4; 256 MiB is past any eager
/// buffer) as a mutex and a condition variable. Op 0 is rank 0's send, 1
/// its recv, 2 rank 1's send, 3 its recv; op `i` meets op `3 - i`. Under
/// `per-direction` every op has a stream (thread) of its own; under
/// `shared` a rank's send and recv share one, in that order, and loom
/// reports the deadlock (and aborts the process). Prints `EXECUTION` for
/// each execution loom runs (loom cannot model more than four streams at
/// once).
fn loom_seed(policy: &str, preemptions: usize) {
    use loom::sync::{Arc, Condvar, Mutex};
    fn op(state: &(Mutex<[bool; 4]>, Condvar), me: usize) {
        let (lock, cv) = state;
        let mut started = lock.lock().expect("no thread panics holding it");
        started[me] = true;
        cv.notify_all();
        while !started[3 - me] {
            started = cv.wait(started).expect("no thread panics holding it");
        }
    }
    let per_direction = policy == "per-direction";
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(preemptions);
    builder.check(move || {
        println!("EXECUTION");
        let state = Arc::new((Mutex::new([false; 4]), Condvar::new()));
        let streams: Vec<Vec<usize>> = if per_direction {
            vec![vec![0], vec![1], vec![2], vec![3]]
        } else {
            vec![vec![0, 1], vec![2, 3]]
        };
        let mut handles = Vec::new();
        for ops in streams.into_iter().skip(1) {
            let state = state.clone();
            handles.push(loom::thread::spawn(move || {
                for i in ops {
                    op(&state, i);
                }
            }));
        }
        let mine: &[usize] = if per_direction { &[0] } else { &[0, 1] };
        for i in mine {
            op(&state, *i);
        }
        for h in handles {
            h.join().expect("a stream thread");
        }
    });
}

/// The schedule file of a family (generating it is not timed).
fn text(name: &str) -> Option<String> {
    let parts: Vec<&str> = name.split(':').collect();
    let n = |i: usize| parts.get(i).and_then(|x| x.parse::<usize>().ok());
    let text = match parts[0] {
        "ring" => ring(n(1)?, n(2)?),
        "two" => two(n(1)?),
        "1f1b" => one_f_one_b(n(1)?, n(2)?, parts.get(3)?),
        "a2a" => all_to_all(n(1)?),
        "threads" => threads(n(1)?, n(2)?),
        "seed" => seed(parts.get(1)?),
        "deps" => dependent(n(1)?),
        "simring" | "simtwo" | "loom" => return None,
        _ => return None,
    };
    Some(text)
}

/// Prints a `Sim::check` family's `RESULT` line: its verdict, seconds,
/// peak MiB and executions.
fn sim_result(r: Result<duplex_sim::Run, duplex_sim::Failure>, start: Instant) {
    let (verdict, executions) = match r {
        Ok(run) => ("ok", run.executions),
        Err(_) => ("failed", 0),
    };
    println!(
        "RESULT {verdict} {:.3} {:.0} {executions} - -",
        start.elapsed().as_secs_f64(),
        peak_mib()
    );
}

/// Two ranks of `threads` threads that each launch one group (a send and
/// a recv) on the world communicator and one stream.
fn sim_deps(threads: usize) -> impl Fn(&duplex_sim::SimRank) -> duplex::Result<()> + Sync {
    use duplex::{Place, Transport};
    move |t: &duplex_sim::SimRank| {
        let peer = 1 - t.rank();
        let s = t.stream("s")?;
        let mut hs = Vec::new();
        for i in 0..threads {
            let s = s.clone();
            hs.push(t.spawn(&format!("t{i}"), move |t: &duplex_sim::SimRank| {
                let out = t.alloc::<u8>(16)?;
                let mut inb = t.alloc::<u8>(16)?;
                let at = Place {
                    comm: Some(t.world()),
                    stream: Some(s),
                };
                t.group(|| {
                    t.send_on(&out, peer, &at)?;
                    t.recv_on(&mut inb, peer, &at)
                })?;
                t.synchronize()
            })?);
        }
        for h in hs {
            t.join(h)?;
        }
        Ok(())
    }
}

/// Peak resident memory of this process, MiB (Linux).
fn peak_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// In a child: decides one family, prints `RESULT verdict seconds mib
/// executions steps branching`.
fn child(name: &str, limit: f64) {
    let start = Instant::now();
    if let Some(rest) = name.strip_prefix("simring:") {
        let n: u32 = rest.parse().unwrap_or(8);
        let ring = move |t: &duplex_sim::SimRank| -> duplex::Result<()> {
            use duplex::Transport;
            let (next, prev) = ((t.rank() + 1) % n, (t.rank() + n - 1) % n);
            let out = t.alloc::<u8>(16)?;
            let mut inb = t.alloc::<u8>(16)?;
            t.group(|| {
                t.send(&out, next)?;
                t.recv(&mut inb, prev)
            })?;
            t.synchronize()
        };
        let r = duplex_sim::Sim::new(n)
            .policy(duplex::Policy::PerDirection)
            .check(ring);
        return sim_result(r, start);
    }
    if let Some(rest) = name.strip_prefix("simpipe:") {
        // simpipe:STAGES:MICRO: `Sim::check` of a pipeline whose stages
        // each run a forward and a backward thread, each on its own lanes
        // (`backend-sim/tests/sim.rs`, `pipeline`): their steps touch
        // nothing in common, so the search needs one execution.
        let mut it = rest.split(':').map(|x| x.parse::<u32>().unwrap_or(2));
        let (stages, micro) = (it.next().unwrap_or(4), it.next().unwrap_or(2));
        let r = duplex_sim::Sim::new(stages)
            .policy(duplex::Policy::PerDirection)
            .check(pipeline::pipeline(stages, micro as usize));
        return sim_result(r, start);
    }
    if let Some(rest) = name.strip_prefix("simdeps:") {
        // simdeps:T: `Sim::check` of 2 ranks × T threads that each launch
        // one group on one communicator and stream (the `deps` family as
        // rank code, each thread then syncing its rank): every order of
        // each rank's launches matters, and where each sync falls among
        // the later launches (T!·T! per rank, its square for both ranks:
        // 1,296 traces for T = 3).
        let threads: usize = rest.parse().unwrap_or(3);
        let r = duplex_sim::Sim::new(2)
            .policy(duplex::Policy::PerDirection)
            .max_executions(10_000_000)
            .check(sim_deps(threads));
        return sim_result(r, start);
    }
    if let Some(rest) = name.strip_prefix("simtwo:") {
        // Two ranks, each sends N messages of 4 KiB on its lane, then
        // receives N, in one run (`Sim::run`: user code as `duplex run`
        // drives it): the time per op must not grow with the ops in flight.
        let n: usize = rest.parse().unwrap_or(1000);
        let two = move |t: &duplex_sim::SimRank| -> duplex::Result<()> {
            use duplex::Transport;
            let peer = 1 - t.rank();
            let mut bufs = Vec::with_capacity(2 * n);
            for _ in 0..2 * n {
                bufs.push(t.alloc::<u8>(4096)?);
            }
            let (sends, recvs) = bufs.split_at_mut(n);
            for b in sends.iter() {
                t.send(b, peer)?;
            }
            for b in recvs.iter_mut() {
                t.recv(b, peer)?;
            }
            t.synchronize()
        };
        let r = duplex_sim::Sim::new(2)
            .policy(duplex::Policy::PerDirection)
            .run(0, two);
        let verdict = if r.is_ok() { "ok" } else { "failed" };
        println!(
            "RESULT {verdict} {:.3} {:.0} 1 - -",
            start.elapsed().as_secs_f64(),
            peak_mib()
        );
        return;
    }
    if let Some(rest) = name.strip_prefix("loom:") {
        // loom:POLICY:PREEMPTIONS. A deadlock aborts the process that loom
        // runs in (it panics where it cannot unwind), so the model runs in
        // a process of its own that prints a line per execution.
        let exe = std::env::current_exe().expect("this binary");
        let out = Command::new(exe).args(["loom-run", rest]).output();
        let (verdict, executions) = match out {
            Ok(o) => {
                let executions = String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .filter(|l| *l == "EXECUTION")
                    .count();
                let verdict = if o.status.success() {
                    "ok"
                } else if String::from_utf8_lossy(&o.stderr).contains("deadlock") {
                    "deadlock"
                } else {
                    "crashed"
                };
                (verdict, executions)
            }
            Err(_) => ("crashed", 0),
        };
        println!(
            "RESULT {verdict} {:.3} {:.0} {executions} - -",
            start.elapsed().as_secs_f64(),
            peak_mib()
        );
        return;
    }
    let Some(text) = text(name) else {
        println!("RESULT bad-family 0 0 0 0 0");
        return;
    };
    // The clock starts once the file is in memory, as when `duplex check`
    // has read it.
    let start = Instant::now();
    let Ok(p) = duplex::schedule::parse(&text) else {
        println!("RESULT bad-family 0 0 0 0 0");
        return;
    };
    let parsed = start.elapsed().as_secs_f64();
    let c = compile(&p);

    let compiled = start.elapsed().as_secs_f64();
    let o = check::check(
        &c,
        &Options {
            time_limit: Some(Duration::from_secs_f64(limit)),
            ..Options::default()
        },
    );
    let verdict = o.verdict.kind();
    let total = start.elapsed().as_secs_f64();
    println!(
        "RESULT {verdict} {total:.3} {:.0} {} {} {} {parsed:.3}/{:.3}/{:.3} {}",
        peak_mib(),
        o.stats.executions,
        o.stats.transitions,
        o.stats.states,
        compiled - parsed,
        total - compiled,
        text.len() >> 20,
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let limit = args
        .iter()
        .position(|a| a == "--limit")
        .and_then(|i| args.get(i + 1))
        .and_then(|x| x.parse::<f64>().ok())
        .unwrap_or(60.0);
    if args.first().map(String::as_str) == Some("loom-run") {
        let rest = args.get(1).map_or("per-direction:2", String::as_str);
        let (policy, bound) = rest.split_once(':').unwrap_or((rest, "2"));
        loom_seed(policy, bound.parse().unwrap_or(2));
        return;
    }
    if args.first().map(String::as_str) == Some("child") {
        child(args.get(1).map_or("", String::as_str), limit);
        return;
    }
    let fam = |name: &str, target: &'static str, seconds: f64, mib: f64| Family {
        name: name.to_string(),
        target,
        seconds,
        mib,
    };
    let families = [
        fam(
            "ring:256:100",
            "ring 1,024 × 1,000 < 1 s, < 1 GB (smaller sizes for scaling)",
            f64::MAX,
            f64::MAX,
        ),
        fam("ring:1024:100", "(scaling)", f64::MAX, f64::MAX),
        fam("ring:1024:1000", "< 1 s, < 1 GB", 1.0, 1024.0),
        fam("two:1000", "time per op constant", f64::MAX, f64::MAX),
        fam("two:10000", "time per op constant", f64::MAX, f64::MAX),
        fam("two:100000", "< 1 s", 1.0, f64::MAX),
        fam(
            "two:500000",
            "time per op constant (10^6 ops)",
            f64::MAX,
            f64::MAX,
        ),
        fam("1f1b:64:256:per-direction", "< 5 s", 5.0, f64::MAX),
        fam("1f1b:64:256:shared", "< 5 s", 5.0, f64::MAX),
        fam("a2a:256", "< 5 s", 5.0, f64::MAX),
        fam("threads:2:5", "< 10 s, < 1 GB", 10.0, 1024.0),
        fam("threads:4:4", "< 10 s, < 1 GB", 10.0, 1024.0),
        fam("simring:1024", "Sim::check < 2 s", 2.0, f64::MAX),
        fam("simpipe:4:2", "Sim::check, 1 execution", f64::MAX, f64::MAX),
        fam("simpipe:8:4", "Sim::check, 1 execution", f64::MAX, f64::MAX),
        fam(
            "simdeps:3",
            "Sim::check, dependent threads: 1,296 traces",
            f64::MAX,
            f64::MAX,
        ),
        fam(
            "simtwo:10000",
            "Sim::run, time per op constant",
            f64::MAX,
            f64::MAX,
        ),
        fam(
            "simtwo:40000",
            "Sim::run, time per op constant",
            f64::MAX,
            f64::MAX,
        ),
        fam(
            "deps:4",
            "dependent threads: ≥ 576 traces",
            f64::MAX,
            f64::MAX,
        ),
        fam(
            "deps:5",
            "dependent threads: ≥ 14,400 traces",
            f64::MAX,
            f64::MAX,
        ),
        fam(
            "deps:6",
            "dependent threads: ≥ 518,400 traces",
            f64::MAX,
            f64::MAX,
        ),
        fam("seed:per-direction", "(beside loom)", f64::MAX, f64::MAX),
        fam(
            "loom:per-direction:1",
            "(loom, preemption bound 1)",
            f64::MAX,
            f64::MAX,
        ),
        fam(
            "loom:per-direction:2",
            "(loom, preemption bound 2)",
            f64::MAX,
            f64::MAX,
        ),
        fam(
            "loom:per-direction:3",
            "(loom, preemption bound 3)",
            f64::MAX,
            f64::MAX,
        ),
        fam("seed:shared", "(beside loom)", f64::MAX, f64::MAX),
        fam(
            "loom:shared:2",
            "(loom, preemption bound 2)",
            f64::MAX,
            f64::MAX,
        ),
    ];
    let exe = std::env::current_exe().expect("this binary");
    println!(
        "| family | verdict | seconds | parse / compile / check (s) | file MiB | peak MiB | executions | host steps | branching | target | met |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for f in &families {
        // The simulator's check has no time limit of its own: the child is
        // killed once it outlives the limit by half a minute.
        let child = Command::new(&exe)
            .args(["child", &f.name, "--limit", &limit.to_string()])
            .stdout(std::process::Stdio::piped())
            .spawn();
        let started = Instant::now();
        let line = match child {
            Ok(mut c) => {
                let killed = loop {
                    match c.try_wait() {
                        Ok(Some(_)) => break false,
                        Ok(None) if started.elapsed().as_secs_f64() > limit + 30.0 => {
                            let _ = c.kill();
                            break true;
                        }
                        Ok(None) => std::thread::sleep(Duration::from_millis(50)),
                        Err(_) => break true,
                    }
                };
                let out = c.wait_with_output().ok();
                if killed {
                    format!("killed {:.0} - - - -", started.elapsed().as_secs_f64())
                } else {
                    out.and_then(|o| {
                        String::from_utf8_lossy(&o.stdout)
                            .lines()
                            .find_map(|l| l.strip_prefix("RESULT ").map(str::to_string))
                    })
                    .unwrap_or_else(|| "crashed 0 0 0 0 0".into())
                }
            }
            Err(_) => "crashed 0 0 0 0 0".into(),
        };
        let v: Vec<&str> = line.split_whitespace().collect();
        let secs: f64 = v.get(1).and_then(|x| x.parse().ok()).unwrap_or(f64::NAN);
        let mib: f64 = v.get(2).and_then(|x| x.parse().ok()).unwrap_or(f64::NAN);
        let decided = matches!(v.first(), Some(&"ok") | Some(&"deadlock") | Some(&"error"));
        let met = if f.seconds == f64::MAX {
            "-"
        } else if decided && secs <= f.seconds && mib <= f.mib {
            "yes"
        } else {
            // The table is regenerated, the reason written beside it.
            "no (why: docs/checker-stats.md, \"Reading the benchmark\")"
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            f.name,
            v.first().unwrap_or(&"?"),
            v.get(1).unwrap_or(&"?"),
            v.get(6).unwrap_or(&"-"),
            v.get(7).unwrap_or(&"-"),
            v.get(2).unwrap_or(&"?"),
            v.get(3).unwrap_or(&"?"),
            v.get(4).unwrap_or(&"?"),
            v.get(5).unwrap_or(&"?"),
            f.target,
            met
        );
    }
}
