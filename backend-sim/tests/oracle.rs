//! An independent oracle for the checker: a plain exhaustive search over
//! machine states (no reduction, exact `State` caching), compared with
//! `check::check`, reduced and not, on random small schedule files; every
//! counterexample is replayed by the oracle's own stepping and judged by
//! `check::judge_schedule`; and where each rank has one thread, numbering
//! the streams in another order (no-op `sync`s first) must not change the
//! verdict. `ORACLE_N` programs from `ORACLE_SEED` (defaults 120 and 1);
//! `ORACLE_FILE` checks one file; failures are written to `ORACLE_OUT`.
//! What it found is in `tests/reduction.rs`
//! (`what_the_oracle_found_gets_its_verdicts`).

use std::collections::HashSet;

use duplex::compile::{Compiled, compile};
use duplex::machine::{HostCall, Machine, Next, State, ThreadId};
use duplex_sim::check::{self, Verdict};

/// What a naive exhaustive search finds: whether some reachable terminal
/// state is stuck, and whether some step or end is an error; `None` when
/// it gave up at `cap` states.
fn oracle(c: &Compiled, cap: usize) -> Option<(bool, bool)> {
    let (mut seen, mut stuck, mut err) = (HashSet::<State>::new(), false, false);
    let mut stack = vec![c.machine()];
    while let Some(m) = stack.pop() {
        if !seen.insert(m.state().clone()) {
            continue;
        }
        if seen.len() > cap {
            return None;
        }
        let en = enabled(c, &m);
        if en.is_empty() {
            if all_finished(&m) {
                err |= m.leftover().is_some();
            } else {
                stuck = true;
            }
        }
        for t in en {
            let mut next = m.clone();
            if naive_step(c, &mut next, t).is_err() {
                err = true;
            } else {
                stack.push(next);
            }
        }
    }
    Some((stuck, err))
}

fn all_finished(m: &Machine) -> bool {
    let n = m.setup().threads.len() as u32;
    (0..n).all(|t| m.next(ThreadId(t)) == Next::Finished)
}

fn call(c: &Compiled, m: &Machine, t: ThreadId) -> HostCall {
    c.scripts[t.0 as usize]
        .get(m.calls(t) as usize)
        .cloned()
        .unwrap_or(HostCall::End)
}

fn enabled(c: &Compiled, m: &Machine) -> Vec<ThreadId> {
    (0..m.setup().threads.len() as u32)
        .map(ThreadId)
        .filter(|&t| match m.next(t) {
            Next::Resume => true,
            Next::Call => m.enabled(t, &call(c, m, t)),
            _ => false,
        })
        .collect()
}

fn naive_step(
    c: &Compiled,
    m: &mut Machine,
    t: ThreadId,
) -> Result<(), duplex::machine::ProgramError> {
    match m.next(t) {
        Next::Resume => m.resume(t),
        _ => {
            let k = call(c, m, t);
            m.apply(t, &k)
        }
    }
}

/// Replays a reported trace with the naive stepping: the kind it ends in.
fn replay_kind(c: &Compiled, trace: &[check::Step]) -> Result<&'static str, String> {
    let mut m = c.machine();
    for s in trace {
        let t = (0..m.setup().threads.len())
            .map(|i| ThreadId(i as u32))
            .find(|t| {
                let i = &m.setup().threads[t.0 as usize];
                i.rank == s.rank && i.name == s.thread
            })
            .ok_or("no such thread")?;
        if !enabled(c, &m).contains(&t) {
            return Err(format!("step {} not enabled", s.step));
        }
        if naive_step(c, &mut m, t).is_err() {
            return Ok(if s.step == trace.len() {
                "error"
            } else {
                "early-error"
            });
        }
    }
    if !enabled(c, &m).is_empty() {
        return Ok("not-terminal");
    }
    Ok(match (all_finished(&m), m.leftover().is_some()) {
        (true, true) => "error",
        (true, false) => "ok",
        (false, _) => "deadlock",
    })
}

fn env_or(k: &str, d: u64) -> u64 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn p(&mut self, pct: u64) -> bool {
        self.next() % 100 < pct
    }
    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[self.below(xs.len())]
    }
}

/// A random small schedule file: 2–3 ranks, 1–3 threads each, messages on
/// both sides of the thresholds, groups, explicit communicators and
/// streams, events, syncs, notifies, and every model knob.
fn generate(r: &mut Rng) -> String {
    let ranks = 2 + r.below(2);
    let mut out = format!("ranks {ranks}\n");
    out += &match r.below(4) {
        0 | 1 => "policy shared\n".to_string(),
        2 => "policy per-direction\n".into(),
        _ => format!(
            "policy per-direction copy-from={}\n",
            r.pick(&["0", "4KiB", "16KiB", "64KiB"])
        ),
    };
    let kernels = if r.p(env_or("ORACLE_KPCT", 50)) {
        r.pick(&["1", "1", "2"])
    } else {
        "unbounded"
    };
    out += &format!(
        "model eager={} lazy-connect={} comm-order={} kernels={kernels} one-sided-groups={} cold-channels={}\n",
        r.pick(&["0", "0", "4KiB", "16KiB", "64KiB"]),
        r.pick(&["off", "on"]),
        r.pick(&["on", "on", "off"]),
        r.pick(&["error", "accept"]),
        r.pick(&["rendezvous", "rendezvous", "mismatched"])
    );
    let mut comms: Vec<(String, Vec<usize>)> = vec![("world".into(), (0..ranks).collect())];
    for i in 0..r.below(3) {
        let m: Vec<usize> = if r.p(50) {
            (0..ranks).collect()
        } else {
            let a = r.below(ranks);
            vec![a.min((a + 1) % ranks), a.max((a + 1) % ranks)]
        };
        let names: Vec<String> = m.iter().map(|x| x.to_string()).collect();
        out += &format!("comm c{i} {}\n", names.join(" "));
        comms.push((format!("c{i}"), m));
    }
    let nthreads: Vec<usize> = (0..ranks)
        .map(|_| 1 + if r.p(60) { r.below(3) } else { 0 })
        .collect();
    let mut body: Vec<Vec<Vec<String>>> = nthreads.iter().map(|&n| vec![Vec::new(); n]).collect();
    let sizes = [
        "0", "1KiB", "4KiB", "4KiB", "8KiB", "16KiB", "64KiB", "100KiB",
    ];
    // Where an op goes: its text, its communicator (`""`: the policy's).
    let place = |r: &mut Rng, a: usize, b: usize, comm: Option<String>| -> (String, String) {
        let comm = comm.unwrap_or_else(|| {
            let ok: Vec<&(String, Vec<usize>)> = comms
                .iter()
                .filter(|(_, m)| m.contains(&a) && m.contains(&b))
                .collect();
            if r.p(40) {
                String::new()
            } else {
                ok[r.below(ok.len())].0.clone()
            }
        });
        let stream = r.pick(&["default", "a", "b"]);
        let text = if comm.is_empty() {
            String::new()
        } else if comm == "world" && r.p(30) {
            format!(" stream={stream}")
        } else if stream == "default" && r.p(30) {
            format!(" comm={comm}")
        } else {
            format!(" comm={comm} stream={stream}")
        };
        let shown = if text.contains("comm=") || text.is_empty() {
            comm
        } else {
            "world".into()
        };
        (text, shown)
    };
    let put = |r: &mut Rng, body: &mut Vec<Vec<Vec<String>>>, rank: usize, s: String| {
        let t = r.below(body[rank].len());
        let l = &mut body[rank][t];
        let at = r.below(l.len() + 1);
        l.insert(at, s);
    };
    for _ in 0..1 + r.below(env_or("ORACLE_MSGS", 6) as usize) {
        let (a, b) = (r.below(ranks), r.below(ranks));
        if a == b && !r.p(12) {
            continue;
        }
        let size = r.pick(&sizes);
        let rsize = if r.p(8) { r.pick(&sizes) } else { size };
        let (ps, comm) = place(r, a, b, None);
        let pr = if r.p(10) {
            place(r, b, a, None).0
        } else {
            place(r, b, a, Some(comm.clone())).0
        };
        let pr = if comm.is_empty() && !r.p(10) {
            String::new()
        } else {
            pr
        };
        if a == b {
            let s = if r.p(85) {
                format!("group {{ send {b} {size}{ps}; recv {a} {rsize}{ps} }}")
            } else {
                format!("send {b} {size}{ps}")
            };
            put(r, &mut body, a, s);
        } else {
            put(r, &mut body, a, format!("send {b} {size}{ps}"));
            put(r, &mut body, b, format!("recv {a} {rsize}{pr}"));
        }
    }
    for _ in 0..r.below(env_or("ORACLE_OTHER", 5) as usize) {
        let a = r.below(ranks);
        match r.below(5) {
            0 | 4 => {
                let e = r.pick(&["e0", "e1"]);
                let s = r.pick(&["default", "a", "b"]);
                put(r, &mut body, a, format!("record {e} stream={s}"));
                if r.p(85) {
                    let s = r.pick(&["default", "a", "b"]);
                    put(r, &mut body, a, format!("wait {e} stream={s}"));
                }
            }
            1 => {
                let s = r.pick(&["", " default", " a", " b", " stream=a"]);
                put(r, &mut body, a, format!("sync{s}"));
            }
            _ => {
                let b = r.below(ranks);
                let tag = r.pick(&["go", "meta"]);
                if r.p(95) {
                    put(r, &mut body, a, format!("notify {b} {tag}"));
                }
                if r.p(95) {
                    put(r, &mut body, b, format!("await {a} {tag}"));
                }
            }
        }
    }
    for (rank, threads) in body.iter().enumerate() {
        for (t, stmts) in threads.iter().enumerate() {
            if stmts.is_empty() && t > 0 && r.p(50) {
                continue;
            }
            out += &if t == 0 {
                format!("rank {rank}:\n#PRE\n")
            } else {
                format!("rank {rank} thread t{t}:\n")
            };
            let op = |s: &str| s.starts_with("send") || s.starts_with("recv");
            let mut i = 0;
            while i < stmts.len() {
                if op(&stmts[i]) && r.p(30) {
                    let mut g = vec![stmts[i].clone()];
                    i += 1;
                    while i < stmts.len() && op(&stmts[i]) && g.len() < 3 && r.p(70) {
                        g.push(stmts[i].clone());
                        i += 1;
                    }
                    out += &format!("  group {{ {} }}\n", g.join("; "));
                } else {
                    out += &format!("  {}\n", stmts[i]);
                    i += 1;
                }
            }
        }
    }
    out
}

#[test]
fn the_checker_agrees_with_a_naive_exhaustive_search() {
    let (n, seed0) = (env_or("ORACLE_N", 120), env_or("ORACLE_SEED", 1));
    let out = std::env::var("ORACLE_OUT").unwrap_or_else(|_| {
        std::env::temp_dir()
            .join("duplex-oracle-failures")
            .display()
            .to_string()
    });
    let (mut compared, mut skipped, mut bad) = (0, 0, 0);
    for seed in seed0..seed0 + n {
        let text = match std::env::var("ORACLE_FILE") {
            Ok(f) => std::fs::read_to_string(f).expect("ORACLE_FILE is readable"),
            Err(_) => generate(&mut Rng(seed)),
        };
        // The same program with its streams numbered in another order (a
        // `sync` of a stream with nothing issued does nothing), where each
        // rank has one thread (else another thread may have issued).
        let mut perm = ["default", "a", "b"];
        let mut r2 = Rng(seed ^ 0x5555);
        for i in (1..3).rev() {
            let j = r2.below(i + 1);
            perm.swap(i, j);
        }
        let pre: String = perm.iter().map(|s| format!("  sync {s}\n")).collect();
        let renumbered = text.replace("#PRE\n", &pre);
        let renumbered_kind = if text.contains(" thread ") {
            None
        } else {
            duplex::schedule::parse(&renumbered).ok().map(|p| {
                check::check(&compile(&p), &Default::default())
                    .verdict
                    .kind()
            })
        };
        let Ok(p) = duplex::schedule::parse(&text) else {
            skipped += 1;
            continue;
        };
        let c = compile(&p);
        let Some((stuck, err)) = oracle(&c, 200_000) else {
            skipped += 1;
            continue;
        };
        let mut problems = Vec::new();
        let mut reduced = "";
        for reduce in [true, false] {
            let options = check::Options {
                reduce,
                ..Default::default()
            };
            let v = check::check(&c, &options).verdict;
            let k = v.kind();
            if reduce {
                reduced = k;
            }
            let agree = match k {
                "ok" => !stuck && !err,
                "deadlock" => stuck,
                "error" => err,
                _ => false,
            };
            if !agree {
                problems.push(format!(
                    "reduce={reduce}: checker {k}, oracle stuck={stuck} error={err}"
                ));
            }
            if let Verdict::Deadlock {
                trace, schedule, ..
            }
            | Verdict::Error {
                trace, schedule, ..
            } = &v
            {
                match replay_kind(&c, trace) {
                    Ok(r) if r == k => {}
                    other => problems.push(format!("reduce={reduce}: {k} replays to {other:?}")),
                }
                match check::judge_schedule(&c, schedule) {
                    Ok((j, _)) if j.kind() == k => {}
                    other => problems.push(format!(
                        "reduce={reduce}: {k}'s schedule {schedule} judges {:?}",
                        other.map(|(j, _)| j.kind())
                    )),
                }
            }
        }
        if let Some(rk) = renumbered_kind
            && (rk == "ok") != (reduced == "ok")
        {
            problems.push(format!(
                "renumbered streams: {rk} vs {reduced}\n{renumbered}"
            ));
        }
        compared += 1;
        if !problems.is_empty() {
            bad += 1;
            let _ = std::fs::create_dir_all(&out);
            let _ = std::fs::write(
                format!("{out}/seed-{seed}.sched"),
                format!("# {}\n{text}", problems.join("\n# ")),
            );
            eprintln!("seed {seed}: {}\n{text}", problems.join("; "));
        }
    }
    eprintln!("compared {compared}, skipped {skipped}, disagreements {bad}");
    assert!(compared * 10 >= n * 9, "only {compared} of {n} compared");
    assert_eq!(
        bad, 0,
        "the checker and the oracle disagree (files in {out})"
    );
}
