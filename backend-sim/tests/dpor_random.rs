//! The search of rank code (`duplex_sim::dpor`) against the search without
//! reduction, on random rank code. Each rank's threads share streams and
//! events, exchange messages and notifications with the other rank, read
//! and write their buffers from the host (a refused access is data too),
//! and one thread, the checker, folds what it saw into a number. The
//! wide generator (a review's) adds host buffers the threads of a rank
//! share under locks, helpers spawned to write them, and a third thread
//! on the other rank; the woken one (another review's) makes rank 1's
//! sends wake rank 0's threads blocked in syncs.
//!
//! Where the full search finds a failure (a hang, a data race), the
//! reduced one must too. Where it finds none, both searches must see the
//! same set of the checker's numbers (each is a function of a trace, and
//! the search must try every trace that matters), and with the checker
//! told to fail on the number the full search saw last, both must fail.
//!
//! `DPOR_RANDOM_CASES` sets how many programs (default 24, 16 of the wide
//! generator, 12 of the woken one with helpers and 12 without), `DPOR_RANDOM_SEED` the first seed, and
//! `DPOR_RANDOM_VERBOSE` prints each program's results.
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use duplex::{Error, Model, Place, Policy, Size, Transport};
use duplex_sim::{Failure, Sim, SimRank};

#[path = "support/show.rs"]
mod support;
use support::show;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

type SimStream = <SimRank as Transport>::Stream;
type SimEvent = <SimRank as Transport>::Event;
type HostBuffer = <SimRank as Transport>::Buffer<u32>;

/// One thing a thread does.
#[derive(Clone, Debug)]
enum Act {
    Send {
        peer: u32,
        stream: usize,
    },
    Recv {
        peer: u32,
        stream: usize,
    },
    Write {
        buf: usize,
        value: u32,
    },
    Read {
        buf: usize,
    },
    SyncStream(usize),
    Synchronize,
    Record {
        event: usize,
        stream: usize,
    },
    Wait {
        event: usize,
        stream: usize,
    },
    Notify {
        peer: u32,
        tag: usize,
    },
    Await {
        peer: u32,
        tag: usize,
    },
    /// A host write of a buffer the rank's threads share (under a lock
    /// held only for the access).
    SharedWrite {
        buf: usize,
        value: u32,
    },
    SharedRead {
        buf: usize,
    },
    /// Spawns a helper that writes a shared buffer, and joins it.
    SpawnWrite {
        buf: usize,
        value: u32,
    },
}

/// Per rank, per thread (0 is the main thread, which spawns the others
/// first and joins them last), what it does; and the checker thread
/// (rank, thread).
#[derive(Clone, Debug)]
struct Program {
    ranks: u32,
    policy: Policy,
    /// Whether small sends complete into NCCL's buffer (R5) before their
    /// recv runs.
    eager: bool,
    threads: Vec<Vec<Vec<Act>>>,
    checker: (u32, usize),
    /// The wider generator: shared buffers, helpers, up to three threads
    /// on the other rank.
    wide: bool,
}

const BUFFERS: usize = 2;
const STREAMS: usize = 2;
const EVENTS: usize = 2;
/// Programs whose search without reduction needs more executions are
/// skipped. Since a blocked call's return became a step of its own, the
/// full search of these programs takes median ~1,000 executions and up to
/// ~48,000; a debug build (CI's) compares those up to 4,000 (all of
/// `FOUND`, and 45 of the 64 default programs), a release build those up
/// to 10,000 (54 of 64).
const FULL_BOUND: usize = if cfg!(debug_assertions) {
    4_000
} else {
    10_000
};

fn insert(rng: &mut StdRng, list: &mut Vec<Act>, act: Act) {
    let at = rng.random_range(0..=list.len());
    list.insert(at, act);
}

/// The program of `seed`; `wide` adds shared host buffers, spawned
/// helpers and a third thread on the rank that is not the checker's.
fn program(seed: u64, wide: bool) -> Program {
    let mut rng = StdRng::seed_from_u64(seed);
    let ranks = 2;
    let policy = if rng.random_bool(0.75) {
        Policy::PerDirection
    } else {
        Policy::Shared
    };
    let eager = rng.random_bool(0.5);
    // The checker's rank has two threads at least: orders of its threads
    // are what the search of rank code decides.
    let cr = rng.random_range(0..ranks);
    let mut threads: Vec<Vec<Vec<Act>>> = (0..ranks)
        .map(|r| {
            vec![
                Vec::new();
                if r == cr {
                    rng.random_range(2..=3)
                } else {
                    rng.random_range(1..=if wide { 3 } else { 2 })
                }
            ]
        })
        .collect();
    let checker = (cr, rng.random_range(0..threads[cr as usize].len()));
    let pick = |rng: &mut StdRng, threads: &Vec<Vec<Vec<Act>>>, r: usize| {
        rng.random_range(0..threads[r].len())
    };
    // Messages, each a send and its recv, more of them toward the
    // checker's rank.
    for _ in 0..rng.random_range(2..=3) {
        let to = if rng.random_bool(0.65) {
            cr as usize
        } else {
            1 - cr as usize
        };
        let from = 1 - to;
        let (a, b) = (pick(&mut rng, &threads, from), pick(&mut rng, &threads, to));
        // Mostly sends on one stream and recvs on the other, so that
        // not every program hangs.
        let (s, r) = if rng.random_bool(0.7) {
            (0, 1)
        } else {
            (rng.random_range(0..STREAMS), rng.random_range(0..STREAMS))
        };
        insert(
            &mut rng,
            &mut threads[from][a],
            Act::Send {
                peer: to as u32,
                stream: s,
            },
        );
        insert(
            &mut rng,
            &mut threads[to][b],
            Act::Recv {
                peer: from as u32,
                stream: r,
            },
        );
    }
    // Sometimes a notification.
    if rng.random_bool(0.2) {
        let from = rng.random_range(0..ranks) as usize;
        let to = 1 - from;
        let (a, b) = (pick(&mut rng, &threads, from), pick(&mut rng, &threads, to));
        insert(
            &mut rng,
            &mut threads[from][a],
            Act::Notify {
                peer: to as u32,
                tag: 0,
            },
        );
        insert(
            &mut rng,
            &mut threads[to][b],
            Act::Await {
                peer: from as u32,
                tag: 0,
            },
        );
    }
    // Host work and stream work, where the threads of a rank meet; half
    // of the checker rank's goes to the checker.
    for r in 0..ranks as usize {
        for _ in 0..rng.random_range(1..=3) {
            let t = if r == cr as usize && rng.random_bool(0.5) {
                checker.1
            } else {
                pick(&mut rng, &threads, r)
            };
            let act = match rng.random_range(0..if wide { 30 } else { 20 }) {
                20..24 => Act::SharedRead {
                    buf: rng.random_range(0..BUFFERS),
                },
                24..27 => Act::SharedWrite {
                    buf: rng.random_range(0..BUFFERS),
                    value: rng.random_range(1..4),
                },
                27..30 => Act::SpawnWrite {
                    buf: rng.random_range(0..BUFFERS),
                    value: rng.random_range(4..6),
                },
                0..7 => Act::Read {
                    buf: rng.random_range(0..BUFFERS),
                },
                7..10 => Act::Write {
                    buf: rng.random_range(0..BUFFERS),
                    value: rng.random_range(1..4),
                },
                10..12 => Act::SyncStream(rng.random_range(0..STREAMS)),
                12..14 => Act::Synchronize,
                14..17 => Act::Record {
                    event: rng.random_range(0..EVENTS),
                    stream: rng.random_range(0..STREAMS),
                },
                _ => Act::Wait {
                    event: rng.random_range(0..EVENTS),
                    stream: rng.random_range(0..STREAMS),
                },
            };
            insert(&mut rng, &mut threads[r][t], act);
        }
    }
    Program {
        ranks,
        policy,
        eager,
        threads,
        checker,
        wide,
    }
}

/// The woken generator (from a review), biased toward blocked calls woken
/// by the other rank's steps: rank 1 sends to rank 0, whose threads recv on shared streams and
/// sync them (often another thread than the recv's), then touch shared
/// host buffers with few values (so that states merge).
fn program_woken(seed: u64, spawn: bool) -> Program {
    let mut rng = StdRng::seed_from_u64(seed);
    let ranks = 2;
    let policy = if rng.random_bool(0.6) {
        Policy::PerDirection
    } else {
        Policy::Shared
    };
    let eager = rng.random_bool(0.3);
    let cr = 0u32;
    let n0 = rng.random_range(2..=3);
    let n1 = rng.random_range(1..=2);
    let mut threads: Vec<Vec<Vec<Act>>> = vec![vec![Vec::new(); n0], vec![Vec::new(); n1]];
    let checker = (cr, rng.random_range(0..n0));
    for _ in 0..rng.random_range(2..=3) {
        let a = rng.random_range(0..n1);
        let b = rng.random_range(0..n0);
        let s = rng.random_range(0..STREAMS);
        let r = rng.random_range(0..STREAMS);
        insert(
            &mut rng,
            &mut threads[1][a],
            Act::Send { peer: 0, stream: s },
        );
        let at = rng.random_range(0..=threads[0][b].len());
        threads[0][b].insert(at, Act::Recv { peer: 1, stream: r });
        // A sync of that stream: by the same thread after its recv, or by
        // another thread anywhere.
        let c = if rng.random_bool(0.5) {
            b
        } else {
            rng.random_range(0..n0)
        };
        let act = if rng.random_bool(0.8) {
            Act::SyncStream(r)
        } else {
            Act::Synchronize
        };
        if c == b {
            let at2 = rng.random_range(at + 1..=threads[0][b].len());
            threads[0][b].insert(at2, act);
        } else {
            insert(&mut rng, &mut threads[0][c], act);
        }
    }
    if rng.random_bool(0.25) {
        let a = rng.random_range(0..n0);
        let b = rng.random_range(0..n1);
        insert(
            &mut rng,
            &mut threads[0][a],
            Act::Send { peer: 1, stream: 0 },
        );
        insert(
            &mut rng,
            &mut threads[1][b],
            Act::Recv { peer: 0, stream: 1 },
        );
    }
    for _ in 0..rng.random_range(0..=2) {
        let from = rng.random_range(0..2usize);
        let to = 1 - from;
        let a = rng.random_range(0..threads[from].len());
        let b = rng.random_range(0..threads[to].len());
        let tag = rng.random_range(0..2);
        insert(
            &mut rng,
            &mut threads[from][a],
            Act::Notify {
                peer: to as u32,
                tag,
            },
        );
        insert(
            &mut rng,
            &mut threads[to][b],
            Act::Await {
                peer: from as u32,
                tag,
            },
        );
    }
    for _ in 0..rng.random_range(2..=4) {
        let t = rng.random_range(0..n0);
        let act = match rng.random_range(0..10) {
            0..4 => Act::SharedRead {
                buf: rng.random_range(0..BUFFERS),
            },
            4..8 => Act::SharedWrite {
                buf: rng.random_range(0..BUFFERS),
                value: rng.random_range(1..3),
            },
            8 if spawn => Act::SpawnWrite {
                buf: rng.random_range(0..BUFFERS),
                value: rng.random_range(1..3),
            },
            8 => Act::SharedRead { buf: 0 },
            _ => Act::SyncStream(rng.random_range(0..STREAMS)),
        };
        insert(&mut rng, &mut threads[0][t], act);
    }
    if rng.random_bool(0.3) {
        let t = rng.random_range(0..n1);
        let act = Act::Record {
            event: 0,
            stream: rng.random_range(0..STREAMS),
        };
        insert(&mut rng, &mut threads[1][t], act);
    }
    if rng.random_bool(0.3) {
        let t = rng.random_range(0..n0);
        let act = if rng.random_bool(0.5) {
            Act::Record {
                event: rng.random_range(0..EVENTS),
                stream: rng.random_range(0..STREAMS),
            }
        } else {
            Act::Wait {
                event: rng.random_range(0..EVENTS),
                stream: rng.random_range(0..STREAMS),
            }
        };
        insert(&mut rng, &mut threads[0][t], act);
    }
    Program {
        ranks,
        policy,
        eager,
        threads,
        checker,
        wide: true,
    }
}

/// What the threads of one rank share: streams and events, and (in wide
/// programs) host buffers, each under a lock held only for one access (a
/// lock held across a call that parks would be a wait outside the
/// transport). A thread's device ops use buffers of its own; threads
/// meet through the streams, the events and the syncs, which cover every
/// thread's ops, and through the shared buffers.
#[derive(Clone)]
struct Shared {
    host: Arc<Vec<Mutex<HostBuffer>>>,
    streams: Vec<SimStream>,
    events: Vec<SimEvent>,
}

/// A shared buffer's lock (held for one access; no thread panics while
/// holding it).
fn lock(b: &Mutex<HostBuffer>) -> std::sync::MutexGuard<'_, HostBuffer> {
    b.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn mix(acc: u64, x: u64) -> u64 {
    acc.wrapping_mul(31).wrapping_add(x)
}

/// What one check records and fails on.
#[derive(Clone, Default)]
struct Watch {
    /// The checker's numbers, in the order executions reached them.
    seen: Arc<Mutex<Vec<u64>>>,
    /// The number the checker fails on.
    bad: Option<u64>,
}

/// Runs thread `k`'s acts. Each device op has a buffer of its own (two
/// ops on one buffer of one thread race at once, and would fail every
/// program); host reads and writes go to the last `BUFFERS` of them.
fn run_thread(p: &Program, t: &SimRank, k: usize, sh: &Shared, w: &Watch) -> duplex::Result<()> {
    let r = t.rank();
    let mut bufs = Vec::new();
    let mut seen: u64 = 0;
    let fresh = |t: &SimRank, n: usize| -> duplex::Result<_> {
        let mut b = t.alloc::<u32>(1)?;
        t.write(&mut b, &[100 * r + 10 * k as u32 + n as u32])?;
        Ok(b)
    };
    let pick = |n: usize, i: usize| n.saturating_sub(1 + i % BUFFERS.min(n.max(1)));
    for act in &p.threads[r as usize][k] {
        match *act {
            Act::Send { peer, stream } => {
                let b = fresh(t, bufs.len())?;
                t.send_on(&b, peer, &Place::stream(&sh.streams[stream]))?;
                bufs.push(b);
            }
            Act::Recv { peer, stream } => {
                let mut b = fresh(t, bufs.len())?;
                t.recv_on(&mut b, peer, &Place::stream(&sh.streams[stream]))?;
                bufs.push(b);
            }
            Act::Write { buf, value } => {
                let i = pick(bufs.len(), buf);
                if let Some(b) = bufs.get_mut(i) {
                    seen = mix(seen, t.write(b, &[value]).map_or(7, |()| 1));
                }
            }
            Act::Read { buf } => {
                let i = pick(bufs.len(), buf);
                if let Some(b) = bufs.get(i) {
                    seen = mix(seen, t.read(b).map_or(11, |v| 2 + u64::from(v[0])));
                }
            }
            Act::SyncStream(s) => t.sync_stream(&sh.streams[s])?,
            Act::Synchronize => t.synchronize()?,
            Act::Record { event, stream } => t.record(&sh.events[event], &sh.streams[stream])?,
            Act::Wait { event, stream } => t.wait(&sh.events[event], &sh.streams[stream])?,
            Act::Notify { peer, tag } => t.notify(peer, &format!("n{tag}"))?,
            Act::Await { peer, tag } => t.await_notify(peer, &format!("n{tag}"))?,
            Act::SharedWrite { buf, value } => {
                let r = t.write(&mut *lock(&sh.host[buf]), &[value]);
                seen = mix(seen, r.map_or(7, |()| 1));
            }
            Act::SharedRead { buf } => {
                let r = t.read(&*lock(&sh.host[buf]));
                seen = mix(seen, r.map_or(11, |v| 2 + u64::from(v[0])));
            }
            Act::SpawnWrite { buf, value } => {
                let host = sh.host.clone();
                let h = t.spawn("helper", move |t: &SimRank| {
                    t.write(&mut *lock(&host[buf]), &[value])
                })?;
                t.join(h)?;
            }
        }
    }
    if p.checker == (r, k) {
        // What arrived, once the rank's streams are drained.
        t.synchronize()?;
        for b in &bufs {
            seen = mix(seen, t.read(b).map_or(11, |v| 2 + u64::from(v[0])));
        }
        for b in sh.host.iter() {
            seen = mix(seen, t.read(&*lock(b)).map_or(11, |v| 2 + u64::from(v[0])));
        }
        w.seen.lock().expect("no panic while recording").push(seen);
        if w.bad == Some(seen) {
            return Err(Error::User(format!("saw {seen}")));
        }
    }
    Ok(())
}

fn rank_code(p: Arc<Program>, w: Watch) -> impl Fn(&SimRank) -> duplex::Result<()> + Sync + Clone {
    move |t: &SimRank| {
        let host = if p.wide {
            (0..BUFFERS)
                .map(|_| t.alloc::<u32>(1).map(Mutex::new))
                .collect::<duplex::Result<_>>()?
        } else {
            Vec::new()
        };
        let sh = Shared {
            host: Arc::new(host),
            streams: (0..STREAMS)
                .map(|i| t.stream(&format!("s{i}")))
                .collect::<duplex::Result<_>>()?,
            events: (0..EVENTS)
                .map(|_| t.event())
                .collect::<duplex::Result<_>>()?,
        };
        let mut spawned = Vec::new();
        for k in 1..p.threads[t.rank() as usize].len() {
            let (p, sh, w) = (p.clone(), sh.clone(), w.clone());
            spawned.push(t.spawn(&format!("t{k}"), move |t: &SimRank| {
                run_thread(&p, t, k, &sh, &w)
            })?);
        }
        run_thread(&p, t, 0, &sh, &w)?;
        for h in spawned {
            t.join(h)?;
        }
        Ok(())
    }
}

/// One search of `p`: its result and the checker's numbers.
fn search(
    p: &Arc<Program>,
    reduce: bool,
    bad: Option<u64>,
) -> (Result<duplex_sim::Run, Failure>, Vec<u64>) {
    let w = Watch {
        seen: Arc::default(),
        bad,
    };
    let model = Model {
        eager: Size(if p.eager { 1024 } else { 0 }),
        ..Model::default()
    };
    let mut sim = Sim::new(p.ranks).policy(p.policy).model(model);
    if !reduce {
        sim = sim.without_reduction().max_executions(FULL_BOUND);
    }
    let r = sim.check(rank_code(p.clone(), w.clone()));
    let seen = w.seen.lock().expect("no panic while recording").clone();
    (r, seen)
}

/// What comparing the two searches on one program found.
enum Compared {
    /// The full search ran out of executions: not compared.
    TooLarge,
    /// Both failed.
    Failing,
    /// Both Ok with the same numbers; `true` if there were several and
    /// the search found the order the checker was told to fail on.
    Same(bool),
}

/// Compares the reduced search with the full one on the program of
/// `seed`; panics, naming the seed, where they disagree.
fn compare(seed: u64, kind: Gen, verbose: bool) -> Compared {
    let p = Arc::new(match kind {
        Gen::Base => program(seed, false),
        Gen::Wide => program(seed, true),
        Gen::Woken { spawn } => program_woken(seed, spawn),
    });
    let (full, full_seen) = search(&p, false, None);
    if matches!(full, Err(Failure::Bound { .. })) {
        return Compared::TooLarge; // too large to decide without the reduction
    }
    let (reduced, seen) = search(&p, true, None);
    if verbose {
        eprintln!("seed {seed}: {} / full {}", show(&reduced), show(&full));
    }
    assert!(
        !matches!(reduced, Err(Failure::Bound { .. })),
        "seed {seed}: the reduced search ran out of executions"
    );
    assert_eq!(
        reduced.is_ok(),
        full.is_ok(),
        "seed {seed}: the search says {}, the full search {}\n{p:#?}",
        show(&reduced),
        show(&full)
    );
    if full.is_err() {
        return Compared::Failing;
    }
    let (a, b): (BTreeSet<u64>, BTreeSet<u64>) = (
        seen.iter().copied().collect(),
        full_seen.iter().copied().collect(),
    );
    assert_eq!(
        a, b,
        "seed {seed}: the checker's numbers differ (reduced, full)\n{p:#?}"
    );
    // The number the full search reached last, as the one that fails.
    if a.len() > 1
        && let Some(&bad) = full_seen.last()
    {
        let (r, _) = search(&p, true, Some(bad));
        if verbose {
            eprintln!(
                "seed {seed}: {} numbers; failing on {bad}: {}",
                a.len(),
                show(&r)
            );
        }
        assert!(
            matches!(&r, Err(Failure::Thread { error, .. }) if error.contains(&format!("saw {bad}"))),
            "seed {seed}: the search missed the order in which the checker sees {bad}: {}\n{p:#?}",
            show(&r)
        );
        return Compared::Same(true);
    }
    Compared::Same(false)
}

/// Compares the searches on `cases` programs from the seed in
/// `DPOR_RANDOM_SEED` (default `first`), `DPOR_RANDOM_CASES` (default
/// `cases`) of them.
fn agree_on_random_programs(kind: Gen, cases: u64, first: u64) {
    let cases: u64 = std::env::var("DPOR_RANDOM_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    let first: u64 = std::env::var("DPOR_RANDOM_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(first);
    let verbose = std::env::var_os("DPOR_RANDOM_VERBOSE").is_some();
    let (mut compared, mut failing, mut targeted) = (0, 0, 0);
    for seed in first..first + cases {
        match compare(seed, kind, verbose) {
            Compared::TooLarge => continue,
            Compared::Failing => failing += 1,
            Compared::Same(several) => targeted += usize::from(several),
        }
        compared += 1;
    }
    // The generator must make programs of both kinds, and programs whose
    // checker sees more than one number, or the comparison says little.
    eprintln!(
        "{compared} programs compared, {failing} failing, {targeted} with more than one number"
    );
    assert!(
        compared * 2 > cases as usize,
        "{compared} of {cases} compared"
    );
    assert!(
        failing > 0 && failing < compared,
        "{failing} of {compared} fail"
    );
    assert!(
        targeted * 8 > compared,
        "{targeted} of {compared} with more than one number"
    );
}

#[test]
fn the_search_of_rank_code_agrees_with_the_full_search_on_random_programs() {
    agree_on_random_programs(Gen::Base, 24, 1);
}

/// The wider generator (from a review): rank threads that share host
/// buffers, spawn helpers that write them, and a third thread.
#[test]
fn the_search_agrees_on_programs_that_share_buffers_and_spawn_helpers() {
    agree_on_random_programs(Gen::Wide, 16, 1);
}

/// The woken generator (from a review): rank 0's threads receive from
/// rank 1 on shared streams and sync them, often from another thread, so
/// that rank 1's steps wake them, then touch shared buffers of few values
/// (so that states merge), with and without helpers that write them.
#[test]
fn the_search_agrees_on_programs_whose_threads_the_other_rank_wakes() {
    agree_on_random_programs(Gen::Woken { spawn: true }, 12, 1);
    agree_on_random_programs(Gen::Woken { spawn: false }, 12, 1);
}

/// Seeds whose programs found a miss of the search, with their generator,
/// compared in every run: 9324 (the checker's numbers differed: woken code
/// in a send's step made the sender's later notify, and the recv it let
/// through, seem to happen after the woken thread's earlier recv); 7 and
/// 73 of the woken generator (a review's: a helper that woken code
/// started ran after the code of another thread woken in the same step,
/// an order no other interleaving gave; a pruned state did not ask where
/// its woken code's call was applied in the new prefix).
const FOUND: &[(u64, Gen)] = &[
    (9324, Gen::Base),
    (7, Gen::Woken { spawn: true }),
    (73, Gen::Woken { spawn: false }),
];

#[test]
fn the_programs_that_found_misses_agree() {
    for &(seed, kind) in FOUND {
        assert!(
            !matches!(compare(seed, kind, false), Compared::TooLarge),
            "seed {seed}: too large to compare (the generator changed?)"
        );
    }
}

/// Which random programs.
#[derive(Clone, Copy, Debug)]
enum Gen {
    /// The first generator.
    Base,
    /// The wide one: shared host buffers, helpers, a third thread.
    Wide,
    /// The woken one ([`program_woken`]), with helpers or without.
    Woken { spawn: bool },
}
