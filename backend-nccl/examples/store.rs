//! The rendezvous store's cost, with connections kept between requests
//! (protocol version 5) against one connection per request (as before),
//! side by side in one run, on the CPU (no GPU, no NCCL):
//!
//! ```text
//! cargo run --release -p duplex-nccl --example store -- [--trials 3] [--monitors 1024] [--seconds 5] [--finished 0] [--watching]
//! ```
//!
//! Two figures per mode, each the median [min–max] of `--trials` trials,
//! the modes alternating within each trial:
//!
//! - **throughput**: 1, 4 and 16 clients, each a thread with its own
//!   client, asking `BEAT` then `HEALTH` back to back (a health monitor's
//!   poll with no pause): requests served per second.
//! - **monitors**: `--monitors` threads, each polling as a rank's health
//!   monitor does (`BEAT` and `HEALTH` every 200 ms) for `--seconds`: the
//!   process's CPU time per second of wall time (the store and its clients
//!   together, both in this process), the slowest poll (a rank silent for
//!   3 s is taken for dead), and how many polls each monitor made a second
//!   (5 are due; a few more when a trial's end cuts into a period).
//!
//! `--finished N` first stores the four keys of N ranks that finished
//! (`trace`, `counts`, `done`, `left`), as the end of a job does.
//!
//! `--watching` adds two monitor modes, beside the two, connections kept:
//! what the monitor of a rank adds once one of its waits has lasted a
//! fifth of its deadline (it watches for ranks that finished, to end a
//! wait whose op they never matched). "Watching its peers": each poll
//! also looks up `done/PEER` of two peers (a wait's peers, up to 8, are
//! looked up one by one). "Watching every rank": every fifth poll also
//! asks `ENDED` (an analysis asks about every rank). Their figures
//! against plain "kept" are the watch's cost to the store.
//!
//! Client and store share this machine's cores, so the figures are the
//! two sides' cost together; on a job the clients run on the ranks' hosts
//! and only the store's side lands on rank 0's. "Per request" is a client
//! that keeps no connection (`Store::keep_connections(0)`): a connect, an
//! `AUTH` and a store thread per request, as before the store's version 5,
//! though against today's store (which the client leaves by closing).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use duplex_nccl::store::{Secret, Store};

const ID: &[u8] = b"the unique id of a benchmark job";
const BEAT_EVERY: Duration = Duration::from_millis(200);
/// A request's timeout, as a rank's health monitor gives its own.
const REQUEST: Duration = Duration::from_secs(1);

fn main() {
    let mut trials = 3usize;
    let mut monitors = 1024u32;
    let mut seconds = 5u64;
    let mut finished = 0u32;
    let mut watching = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| -> u64 {
            args.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| fail(&format!("{name} takes a number")))
        };
        match a.as_str() {
            "--trials" => trials = value("--trials").max(1) as usize,
            "--monitors" => monitors = value("--monitors").clamp(1, 8192) as u32,
            "--seconds" => seconds = value("--seconds").max(1),
            "--finished" => finished = value("--finished").min(1 << 16) as u32,
            "--watching" => watching = true,
            other => fail(&format!(
                "unknown argument {other:?} (--trials N, --monitors N, --seconds S, --finished N, --watching)"
            )),
        }
    }
    let secret = Secret::new("a-benchmark-token-of-enough-bytes");
    let addr = Store::serve("127.0.0.1", 0, ID.to_vec(), secret.clone())
        .unwrap_or_else(|e| fail(&e.to_string()));
    let client = |keep: bool| {
        Store::client("127.0.0.1", addr.port(), secret.clone()).keep_connections(if keep {
            4
        } else {
            0
        })
    };
    // Ranks that finished before the figures are taken, each with the
    // four keys a clean finish stores (its trace a few KiB), numbered after
    // the clients and monitors.
    let c = client(true);
    for r in 0..finished {
        let rank = 1_000_000 + r;
        for (key, len) in [("trace", 4096), ("counts", 64), ("done", 2), ("left", 2)] {
            if let Err(e) = c.put(&format!("{key}/{rank}"), &vec![b'x'; len], REQUEST * 5) {
                fail(&format!("storing rank {rank}'s {key}: {e}"));
            }
        }
    }
    let modes = [("kept", true), ("per request", false)];
    // The monitor modes: the two, and with --watching a third, connections
    // kept and `ENDED` asked at every poll.
    let mut monitor_modes = vec![
        ("kept", true, Watch::None),
        ("per request", false, Watch::None),
    ];
    if watching {
        monitor_modes.push(("kept, watching its peers", true, Watch::Peers));
        monitor_modes.push(("kept, watching every rank", true, Watch::All));
    }
    let nm = monitor_modes.len();
    println!(
        "# duplex's store: connections kept against one per request ({trials} trials; {finished} ranks finished before)\n"
    );
    println!("| clients | mode | requests/s | slowest request ms |");
    println!("|---|---|---|---|");
    for clients in [1u32, 4, 16] {
        let mut figures: Vec<(Vec<f64>, Vec<f64>)> = vec![Default::default(); 2];
        for t in 0..trials {
            for i in 0..2 {
                // The first mode of each trial switches, so drift falls on both.
                let m = (i + t) % 2;
                let (rate, worst) = throughput(clients, || client(modes[m].1));
                figures[m].0.push(rate);
                figures[m].1.push(worst * 1e3);
            }
        }
        for (m, (rate, worst)) in figures.iter().enumerate() {
            println!(
                "| {clients} | {} | {} | {} |",
                modes[m].0,
                spread(rate, 0),
                spread(worst, 1)
            );
        }
        let ratio = median(&figures[0].0) / median(&figures[1].0);
        println!("| {clients} | kept / per request | {ratio:.1}x | |");
    }
    println!(
        "\n| monitors | mode | CPU s per s | slowest poll ms | polls | per monitor per s (5 due) | failed |\n|---|---|---|---|---|---|---|"
    );
    let mut figures: Vec<(Vec<f64>, Vec<f64>, u64, u64)> = vec![Default::default(); nm];
    let mut errors: Vec<Option<String>> = vec![None; nm];
    for t in 0..trials {
        for i in 0..nm {
            // Each trial starts with another mode, so drift falls on all.
            let m = (i + t) % nm;
            let (_, keep, how) = monitor_modes[m];
            let w = watch(monitors, Duration::from_secs(seconds), how, || client(keep));
            figures[m].0.push(w.cpu);
            figures[m].1.push(w.worst * 1e3);
            figures[m].2 += w.polls;
            figures[m].3 += w.failed;
            if errors[m].is_none() {
                errors[m] = w.error;
            }
            // The per-request mode's connections linger in TIME_WAIT and
            // its server threads wind down: let them go before the next.
            std::thread::sleep(Duration::from_secs(2));
        }
    }
    // A monitor polls every 200 ms: 5 a second are due.
    let monitor_seconds = f64::from(monitors) * seconds as f64 * trials as f64;
    for (m, (cpu, worst, polls, failed)) in figures.iter().enumerate() {
        println!(
            "| {monitors} | {} | {} | {} | {polls} | {:.2} | {failed} |",
            monitor_modes[m].0,
            spread(cpu, 2),
            spread(worst, 1),
            *polls as f64 / monitor_seconds
        );
    }
    println!(
        "| {monitors} | per request / kept (CPU) | {:.1}x | | | | |",
        median(&figures[1].0) / median(&figures[0].0)
    );
    for (m, (name, _, how)) in monitor_modes.iter().enumerate() {
        if *how != Watch::None {
            println!(
                "| {monitors} | {name} / kept (CPU) | {:.2}x | | | | |",
                median(&figures[m].0) / median(&figures[0].0)
            );
        }
    }
    for (m, e) in errors.iter().enumerate() {
        if let Some(e) = e {
            println!("\nthe first failed poll, {}: {e}", monitor_modes[m].0);
        }
    }
}

/// `clients` threads asking `BEAT` and `HEALTH` back to back for 1 s:
/// requests per second, and the slowest request in seconds.
fn throughput(clients: u32, client: impl Fn() -> Store) -> (f64, f64) {
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let threads: Vec<_> = (0..clients)
        .map(|r| {
            let (c, stop) = (client(), stop.clone());
            std::thread::spawn(move || {
                let (mut n, mut worst) = (0u64, Duration::ZERO);
                while !stop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    if let Err(e) = poll(&c, r, Watch::None, 0) {
                        fail(&format!("a request failed: {e}"));
                    }
                    worst = worst.max(t.elapsed() / 2);
                    n += 2;
                }
                (n, worst)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(1));
    stop.store(true, Ordering::Relaxed);
    let (mut n, mut worst) = (0, Duration::ZERO);
    for t in threads {
        let (k, w) = t.join().expect("a client thread");
        n += k;
        worst = worst.max(w);
    }
    (
        n as f64 / start.elapsed().as_secs_f64(),
        worst.as_secs_f64(),
    )
}

/// `monitors` threads polling every 200 ms for `run`, watching for
/// finished ranks as `how` says.
fn watch(monitors: u32, run: Duration, how: Watch, client: impl Fn() -> Store) -> Watched {
    let stop = Arc::new(AtomicBool::new(false));
    let cpu0 = cpu_seconds();
    let start = Instant::now();
    let threads: Vec<_> = (0..monitors)
        .map(|r| {
            let (c, stop) = (client(), stop.clone());
            std::thread::Builder::new()
                .stack_size(128 << 10)
                .spawn(move || {
                    // Spread over the period, as ranks that started apart.
                    std::thread::sleep(BEAT_EVERY * (r % 200) / 200);
                    let (mut n, mut worst, mut failed) = (0u64, Duration::ZERO, 0u64);
                    let mut said = None;
                    while !stop.load(Ordering::Relaxed) {
                        let t = Instant::now();
                        if let Err(e) = poll(&c, r, how, n) {
                            failed += 1;
                            said.get_or_insert(e);
                        }
                        let took = t.elapsed();
                        worst = worst.max(took);
                        n += 1;
                        std::thread::sleep(BEAT_EVERY.saturating_sub(took));
                    }
                    (n, worst, failed, said)
                })
                .unwrap_or_else(|e| fail(&format!("cannot start a monitor thread: {e}")))
        })
        .collect();
    std::thread::sleep(run);
    stop.store(true, Ordering::Relaxed);
    let mut out = Watched::default();
    for t in threads {
        let (k, w, f, said) = t.join().expect("a monitor thread");
        out.polls += k;
        out.worst = out.worst.max(w.as_secs_f64());
        out.failed += f;
        if out.error.is_none() {
            out.error = said;
        }
    }
    out.cpu = (cpu_seconds() - cpu0) / start.elapsed().as_secs_f64();
    out
}

/// What [`watch`] saw.
#[derive(Default)]
struct Watched {
    /// CPU seconds of this process per wall second.
    cpu: f64,
    /// The slowest poll, in seconds.
    worst: f64,
    polls: u64,
    /// Polls that failed, and the first one's error.
    failed: u64,
    error: Option<String>,
}

/// How a monitor watches for finished ranks ([`StoreHealth`]'s watch).
///
/// [`StoreHealth`]: duplex_nccl::health::StoreHealth
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Watch {
    /// Not at all.
    None,
    /// `done/PEER` of its two neighbours, each poll.
    Peers,
    /// `ENDED` every fifth poll.
    All,
}

/// Poll `n` of a health monitor: `BEAT`, then `HEALTH`, then what `how`
/// watches; the error of a request that failed (a monitor would take the
/// store's host for dead after 3 s of them).
fn poll(c: &Store, rank: u32, how: Watch, n: u64) -> Result<(), String> {
    let silence = Duration::from_secs(3);
    c.beat(rank, REQUEST)
        .and_then(|()| c.health(rank, silence, REQUEST))
        .and_then(|_| match how {
            Watch::None => Ok(()),
            Watch::Peers => [rank.wrapping_sub(1), rank + 1]
                .iter()
                .try_for_each(|p| c.get(&format!("done/{p}"), Duration::ZERO).map(|_| ())),
            Watch::All if n.is_multiple_of(5) => c.ended(silence, REQUEST).map(|_| ()),
            Watch::All => Ok(()),
        })
        .map_err(|e| e.to_string())
}

/// User and system CPU time of this process so far, in seconds.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF is always valid.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

fn spread(v: &[f64], digits: usize) -> String {
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{:.digits$} [{min:.digits$}–{max:.digits$}]", median(v))
}

fn fail(what: &str) -> ! {
    eprintln!("store benchmark: {what}");
    std::process::exit(2)
}
