//! duplex's benchmark on two GPUs: bandwidth one way and both ways at once
//! on per-direction lanes, through duplex and through plain NCCL calls on
//! the same communicators and streams; 4 KiB ping-pong latency through
//! duplex and through plain NCCL calls; the host time duplex adds to each
//! op; and what a lane costs. Then the same bandwidths on copy-engine lanes
//! (`copy_from` 1 MiB, a second run of [`Local`]) and raw peer copies
//! (`cuMemcpyPeerAsync`) between the two GPUs, from which it suggests the
//! size from which copy-engine lanes are faster. Prints a table and writes
//! JSON.
//!
//! `bench [--json FILE] [--trials N] [--quick] [--no-copy] [--min-ctas N --max-ctas N]`;
//! run `scripts/gpu.sh run bench` for the side-by-side run with PyTorch.
//!
//! Every figure is taken in `--trials` trials (default 5; `--quick`, which
//! measures 256 MiB bandwidth only, defaults to 3). The trials are
//! interleaved: trial k measures every figure once before trial k+1 starts,
//! and a duplex figure and its raw-NCCL twin are taken back to back, in
//! alternating order, so that drift over the run spreads over all figures
//! alike. Each measurement keeps its own warm-up (3 ops before a bandwidth
//! run, 50 round trips before a latency run). The lane cost is one trial
//! per run of [`Local`]: the main run, then `trials - 1` runs that only make
//! their lanes. The JSON (format 2) holds, for every figure, its unit,
//! which way is better, every trial's value, and their median, min and max;
//! `scripts/bench_table.py` reads it.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use duplex::{Dir, Place, Policy, Transport};
use duplex_nccl::{Local, NcclBuffer, NcclRank};

/// The unit of a figure, and which way is better.
#[derive(Clone, Copy, Debug)]
enum Unit {
    /// Bandwidth per direction, 10^9 bytes per second; higher is better.
    GbPerS,
    /// Microseconds; lower is better.
    Micros,
    /// Milliseconds; lower is better.
    Millis,
    /// Bytes of device memory; lower is better.
    Bytes,
}

impl Unit {
    fn name(self) -> &'static str {
        match self {
            Unit::GbPerS => "GB/s",
            Unit::Micros => "us",
            Unit::Millis => "ms",
            Unit::Bytes => "B",
        }
    }

    fn better(self) -> &'static str {
        match self {
            Unit::GbPerS => "higher",
            _ => "lower",
        }
    }
}

/// One figure: every trial's value and their summary.
#[derive(Debug, serde::Serialize)]
struct Figure {
    unit: &'static str,
    better: &'static str,
    /// The message size, for bandwidth figures.
    #[serde(skip_serializing_if = "Option::is_none")]
    bytes: Option<u64>,
    trials: Vec<f64>,
    median: f64,
    min: f64,
    max: f64,
}

/// The median of `v` (the mean of the middle two for an even count).
fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

impl Figure {
    fn new(unit: Unit, bytes: Option<u64>, trials: Vec<f64>) -> Figure {
        Figure {
            unit: unit.name(),
            better: unit.better(),
            bytes,
            median: median(&trials),
            min: trials.iter().copied().fold(f64::INFINITY, f64::min),
            max: trials.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            trials,
        }
    }
}

/// The samples one rank took: figure name → unit, size, values.
#[derive(Default)]
struct Samples(BTreeMap<String, (Unit, Option<u64>, Vec<f64>)>);

impl Samples {
    fn push(&mut self, name: String, unit: Unit, bytes: Option<u64>, value: f64) {
        self.0
            .entry(name)
            .or_insert_with(|| (unit, bytes, Vec::new()))
            .2
            .push(value);
    }
}

#[derive(Debug, Default, serde::Serialize)]
struct Results {
    /// 2: figures with trials (format 1, one value per figure, had no
    /// `format` field).
    format: u32,
    bench: &'static str,
    nccl: String,
    ctas: (Option<i32>, Option<i32>),
    /// The `NCCL_*` environment variables of the run (lane settings such
    /// as `NCCL_BUFFSIZE`, `NCCL_MAX_P2P_NCHANNELS`, `NCCL_PROTO`), and
    /// `DUPLEX_LANES` and `DUPLEX_LANE_CONNECT` (lanes made at start or on
    /// first use, connected both ways or one).
    env: BTreeMap<String, String>,
    trials: u32,
    quick: bool,
    /// Figure name → its trials and summary. Names: `one_way/SIZE`,
    /// `raw_one_way/SIZE`, `both_ways/SIZE`, `raw_both_ways/SIZE` (GB/s per
    /// direction, on rank 1's clock: it sees the data arrive),
    /// `latency_us`, `raw_latency_us` (4 KiB, half a round trip, rank 1),
    /// `host_us`, `raw_host_us` (host time to enqueue one 4 KiB op, rank
    /// 0), `lane_create_ms/LANE`, `lane_bytes/LANE` (rank 1's lanes);
    /// `copy_one_way/SIZE`, `copy_both_ways/SIZE` (copy-engine lanes),
    /// `ce_one_way/SIZE`, `ce_both_ways/SIZE` (raw peer copies, timed by
    /// events); `lane_latency_us`, `copy_latency_us` (4 KiB, half a round
    /// trip, placed by the policy, without and with copy-engine lanes).
    figures: BTreeMap<String, Figure>,
    /// What `Local::measure_copy_from` measured (`duplex_nccl::threshold`):
    /// the threshold a transport would pick on this machine, and why.
    #[serde(skip_serializing_if = "Option::is_none")]
    copy_threshold: Option<duplex_nccl::threshold::Measurement>,
    /// How long that measurement took, seconds (its run's setup included).
    #[serde(skip_serializing_if = "Option::is_none")]
    copy_threshold_s: Option<f64>,
    /// The lanes of the last run, with how their memory was measured.
    lanes: Vec<duplex_nccl::LaneCost>,
}

impl Results {
    fn add(&mut self, samples: Samples) {
        for (name, (unit, bytes, values)) in samples.0 {
            self.figures.insert(name, Figure::new(unit, bytes, values));
        }
    }
}

fn iters(bytes: u64) -> u32 {
    match bytes {
        b if b >= 256 << 20 => 20,
        b if b >= 64 << 20 => 50,
        _ => 400,
    }
}

fn gbps(bytes: u64, n: u32, d: Duration) -> f64 {
    (bytes * u64::from(n)) as f64 / d.as_secs_f64() / 1e9
}

/// A host barrier through duplex's host messages.
fn barrier(t: &NcclRank, tag: &str) -> duplex::Result<()> {
    let peer = 1 - t.rank();
    t.notify(peer, tag)?;
    t.await_notify(peer, tag)
}

/// Whether ops go through duplex or straight to `ncclSend`/`ncclRecv` on
/// the same lane communicators and streams (`NcclRank::raw_p2p`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Duplex,
    Raw,
}

impl Path {
    /// The prefix of this path's figure names.
    fn prefix(self) -> &'static str {
        match self {
            Path::Duplex => "",
            Path::Raw => "raw_",
        }
    }
}

/// A send and a receive buffer of one size, kept across trials.
struct Buffers {
    bytes: u64,
    out: NcclBuffer<u8>,
    inb: NcclBuffer<u8>,
}

impl Buffers {
    fn new(t: &NcclRank, bytes: u64) -> duplex::Result<Buffers> {
        Ok(Buffers {
            bytes,
            out: t.alloc::<u8>(bytes as usize)?,
            inb: t.alloc::<u8>(bytes as usize)?,
        })
    }
}

/// GB/s per direction of back-to-back messages of `b.bytes`, rank 0 to
/// rank 1 (`both`: both directions at once), on per-direction lanes.
fn bandwidth(
    t: &NcclRank,
    b: &mut Buffers,
    both: bool,
    path: Path,
    trial: u32,
) -> duplex::Result<f64> {
    let bytes = b.bytes;
    let n = iters(bytes);
    let peer = 1 - t.rank();
    let (out_ptr, in_ptr) = (t.raw_ptr(&b.out), t.raw_ptr(&b.inb));
    let len = bytes as usize;
    let mut run = |count: u32| -> duplex::Result<Duration> {
        barrier(t, &format!("bw{bytes}{both}{path:?}{trial}/{count}"))?;
        let start = Instant::now();
        for _ in 0..count {
            if both || t.rank() == 0 {
                match path {
                    Path::Duplex => t.send(&b.out, peer)?,
                    Path::Raw => t.raw_p2p(Dir::Send, peer, out_ptr, len, None)?,
                }
            }
            if both || t.rank() == 1 {
                match path {
                    Path::Duplex => t.recv(&mut b.inb, peer)?,
                    Path::Raw => t.raw_p2p(Dir::Recv, peer, in_ptr, len, None)?,
                }
            }
        }
        t.synchronize()?;
        Ok(start.elapsed())
    };
    run(3)?;
    let d = run(n)?;
    Ok(gbps(bytes, n, d))
}

/// What the ping-pong uses, made once: a stream of each rank, the lanes
/// toward and from the peer, and two 4 KiB buffers.
struct Pingpong {
    stream: duplex_nccl::NcclStream,
    out_lane: duplex::Lane<NcclRank>,
    in_lane: duplex::Lane<NcclRank>,
    out: NcclBuffer<u8>,
    inb: NcclBuffer<u8>,
}

impl Pingpong {
    fn new(t: &NcclRank) -> duplex::Result<Pingpong> {
        let peer = 1 - t.rank();
        Ok(Pingpong {
            stream: t.stream("pingpong")?,
            out_lane: t.lane(peer, Dir::Send)?,
            in_lane: t.lane(peer, Dir::Recv)?,
            out: t.alloc::<u8>(4096)?,
            inb: t.alloc::<u8>(4096)?,
        })
    }
}

/// Round trips of 4 KiB on one stream of each rank: rank 0 sends then
/// receives, rank 1 receives then sends; half the mean round trip. `Raw`
/// issues plain ncclSend/ncclRecv on the same communicators and stream.
fn latency(t: &NcclRank, p: &mut Pingpong, path: Path, trial: u32) -> duplex::Result<f64> {
    const N: u32 = 2000;
    let peer = 1 - t.rank();
    let (out_ptr, in_ptr) = (t.raw_ptr(&p.out), t.raw_ptr(&p.inb));
    let s = &p.stream;
    let send_place = Place::on(&p.out_lane.comm, s);
    let recv_place = Place::on(&p.in_lane.comm, s);
    let out = &p.out;
    let inb = &mut p.inb;
    let mut one = || -> duplex::Result<()> {
        let send = |_: &mut NcclBuffer<u8>| match path {
            Path::Raw => t.raw_p2p(Dir::Send, peer, out_ptr, 4096, Some(s)),
            Path::Duplex => t.send_on(out, peer, &send_place),
        };
        let recv = |inb: &mut NcclBuffer<u8>| match path {
            Path::Raw => t.raw_p2p(Dir::Recv, peer, in_ptr, 4096, Some(s)),
            Path::Duplex => t.recv_on(inb, peer, &recv_place),
        };
        if t.rank() == 0 {
            send(inb)?;
            recv(inb)
        } else {
            recv(inb)?;
            send(inb)
        }
    };
    for _ in 0..50 {
        one()?;
    }
    t.sync_stream(s)?;
    barrier(t, &format!("lat{path:?}{trial}"))?;
    let start = Instant::now();
    for _ in 0..N {
        one()?;
    }
    t.sync_stream(s)?;
    let d = start.elapsed();
    Ok(d.as_secs_f64() * 1e6 / f64::from(N) / 2.0)
}

/// Round trips of 4 KiB placed by the policy (each direction's lane and
/// stream: what copy-engine lanes route by size): half the mean round
/// trip, rank 1's clock. Run with and without copy-engine lanes, it says
/// what they cost a message that stays below their threshold.
fn policy_latency(t: &NcclRank, trial: u32, tag: &str) -> duplex::Result<f64> {
    const N: u32 = 2000;
    let peer = 1 - t.rank();
    let out = t.alloc::<u8>(4096)?;
    let mut inb = t.alloc::<u8>(4096)?;
    let mut one = || -> duplex::Result<()> {
        if t.rank() == 0 {
            t.send(&out, peer)?;
            t.recv(&mut inb, peer)
        } else {
            t.recv(&mut inb, peer)?;
            t.send(&out, peer)
        }
    };
    for _ in 0..50 {
        one()?;
    }
    t.synchronize()?;
    barrier(t, &format!("plat{tag}{trial}"))?;
    let start = Instant::now();
    for _ in 0..N {
        one()?;
    }
    t.synchronize()?;
    Ok(start.elapsed().as_secs_f64() * 1e6 / f64::from(N) / 2.0)
}

/// Host time per enqueued 4 KiB op, duplex vs plain ncclSend/ncclRecv on
/// the same lanes.
fn host_overhead(t: &NcclRank, path: Path, trial: u32) -> duplex::Result<f64> {
    const N: u32 = 4000;
    let peer = 1 - t.rank();
    let out = t.alloc::<u8>(4096)?;
    let mut inb = t.alloc::<u8>(4096)?;
    let (out_ptr, in_ptr) = (t.raw_ptr(&out), t.raw_ptr(&inb));
    barrier(t, &format!("host{path:?}{trial}"))?;
    let start = Instant::now();
    for _ in 0..N {
        match (t.rank(), path) {
            (0, Path::Raw) => t.raw_p2p(Dir::Send, peer, out_ptr, 4096, None)?,
            (0, Path::Duplex) => t.send(&out, peer)?,
            (_, Path::Raw) => t.raw_p2p(Dir::Recv, peer, in_ptr, 4096, None)?,
            (_, Path::Duplex) => t.recv(&mut inb, peer)?,
        }
    }
    let enqueue = start.elapsed();
    t.synchronize()?;
    Ok(enqueue.as_secs_f64() * 1e6 / f64::from(N))
}

/// Duplex and raw in alternating order: duplex first in even trials.
fn both_paths(trial: u32) -> [Path; 2] {
    if trial.is_multiple_of(2) {
        [Path::Duplex, Path::Raw]
    } else {
        [Path::Raw, Path::Duplex]
    }
}

/// The bandwidth sizes.
fn sizes(quick: bool) -> &'static [u64] {
    if quick {
        &[256 << 20]
    } else {
        &[1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
    }
}

/// The copy-engine lanes' bandwidths, on a run with `copy_from` set below
/// every size measured. Rank 1 keeps them.
fn measure_copy(t: &NcclRank, trials: u32, quick: bool) -> duplex::Result<Samples> {
    let mut s = Samples::default();
    let mut buffers = sizes(quick)
        .iter()
        .map(|&b| Buffers::new(t, b))
        .collect::<duplex::Result<Vec<_>>>()?;
    for trial in 0..trials {
        eprintln!(
            "rank {}: copy-engine lanes, trial {} of {trials}",
            t.rank(),
            trial + 1
        );
        for b in &mut buffers {
            for both in [false, true] {
                let g = bandwidth(t, b, both, Path::Duplex, trial)?;
                if t.rank() == 1 {
                    let what = if both { "both_ways" } else { "one_way" };
                    s.push(
                        format!("copy_{what}/{}", duplex::Size(b.bytes)),
                        Unit::GbPerS,
                        Some(b.bytes),
                        g,
                    );
                }
            }
        }
        if !quick {
            // 4 KiB stays below the threshold: NCCL lanes, after one size
            // comparison (C1).
            let us = policy_latency(t, trial, "copy")?;
            if t.rank() == 1 {
                s.push("copy_latency_us".into(), Unit::Micros, None, us);
            }
        }
    }
    Ok(s)
}

/// Raw peer copies between GPUs 0 and 1 (`cuMemcpyPeerAsync`, a stream on
/// each source GPU), one way and both ways at once, timed by events on
/// each copy's stream; GB/s per direction (both ways: the slower).
fn raw_copy_engines(trials: u32, quick: bool) -> Result<Samples, duplex::Error> {
    use duplex_nccl::cuda::{Device, Event, Memory, Stream};
    use std::sync::Arc;
    let mut s = Samples::default();
    let dev = [Arc::new(Device::new(0)?), Arc::new(Device::new(1)?)];
    dev[0].enable_peer(&dev[1])?;
    dev[1].enable_peer(&dev[0])?;
    for &bytes in sizes(quick) {
        let mut bufs = Vec::new();
        let mut streams = Vec::new();
        for d in &dev {
            d.bind()?;
            bufs.push((
                Memory::zeroed(bytes as usize)?,
                Memory::zeroed(bytes as usize)?,
            ));
            streams.push(Stream::new()?);
        }
        for _ in 0..trials {
            for both in [false, true] {
                let n = iters(bytes);
                let mut times = Vec::new();
                let mut marks = Vec::new();
                for from in 0..if both { 2 } else { 1 } {
                    let to = 1 - from;
                    dev[from].bind()?;
                    let (a, b) = (Event::new(true)?, Event::new(true)?);
                    a.record(&streams[from])?;
                    for _ in 0..n {
                        // SAFETY: both buffers hold `bytes` bytes and outlive
                        // the copies (the stream is synchronized below).
                        unsafe {
                            duplex_nccl::cuda::copy_peer(
                                &dev[to],
                                bufs[to].1.ptr(),
                                &dev[from],
                                bufs[from].0.ptr(),
                                bytes as usize,
                                &streams[from],
                            )
                        }?;
                    }
                    b.record(&streams[from])?;
                    marks.push((from, a, b));
                }
                for (from, a, b) in marks {
                    dev[from].bind()?;
                    streams[from].synchronize()?;
                    times.push(f64::from(b.since(&a)?) * 1e-3);
                }
                let slowest = times.iter().copied().fold(0.0, f64::max);
                let what = if both { "both_ways" } else { "one_way" };
                s.push(
                    format!("ce_{what}/{}", duplex::Size(bytes)),
                    Unit::GbPerS,
                    Some(bytes),
                    (bytes * u64::from(n)) as f64 / slowest / 1e9,
                );
            }
        }
    }
    Ok(s)
}

/// Every trial of every figure on one rank. Rank 1 keeps the bandwidth and
/// latency figures (its clock sees the data arrive), rank 0 the host time.
fn measure(t: &NcclRank, trials: u32, quick: bool) -> duplex::Result<Samples> {
    let mut s = Samples::default();
    let sizes = sizes(quick);
    let mut buffers = sizes
        .iter()
        .map(|&b| Buffers::new(t, b))
        .collect::<duplex::Result<Vec<_>>>()?;
    let mut pingpong = if quick { None } else { Some(Pingpong::new(t)?) };
    let receiver = t.rank() == 1;
    for trial in 0..trials {
        eprintln!("rank {}: trial {} of {trials}", t.rank(), trial + 1);
        for b in &mut buffers {
            let size = duplex::Size(b.bytes);
            for both in [false, true] {
                let what = if both { "both_ways" } else { "one_way" };
                for path in both_paths(trial) {
                    let g = bandwidth(t, b, both, path, trial)?;
                    if receiver {
                        let name = format!("{}{what}/{size}", path.prefix());
                        s.push(name, Unit::GbPerS, Some(b.bytes), g);
                    }
                }
            }
        }
        let Some(p) = pingpong.as_mut() else {
            continue;
        };
        for path in both_paths(trial) {
            let us = latency(t, p, path, trial)?;
            if receiver {
                s.push(
                    format!("{}latency_us", path.prefix()),
                    Unit::Micros,
                    None,
                    us,
                );
            }
        }
        let us = policy_latency(t, trial, "lanes")?;
        if receiver {
            s.push("lane_latency_us".into(), Unit::Micros, None, us);
        }
        for path in both_paths(trial) {
            let us = host_overhead(t, path, trial)?;
            if !receiver {
                s.push(format!("{}host_us", path.prefix()), Unit::Micros, None, us);
            }
        }
    }
    Ok(s)
}

/// Rank 1's lane costs as samples.
fn lane_samples(t: &NcclRank, s: &mut Samples) {
    for l in t.lane_costs() {
        s.push(
            format!("lane_create_ms/{}", l.name),
            Unit::Millis,
            None,
            l.create_ms,
        );
        s.push(
            format!("lane_bytes/{}", l.name),
            Unit::Bytes,
            None,
            l.bytes as f64,
        );
    }
}

fn cell(f: Option<&Figure>) -> String {
    match f {
        Some(f) => format!("{:.2} [{:.2}-{:.2}]", f.median, f.min, f.max),
        None => "-".into(),
    }
}

/// A table of bandwidth figures, a row per message size measured and a
/// column per figure name (`NAME/SIZE`).
fn print_sizes(r: &Results, headers: [&str; 4], names: [&str; 4]) {
    println!(
        "{:>8} {:>26} {:>26} {:>26} {:>26}",
        "size", headers[0], headers[1], headers[2], headers[3]
    );
    let mut sizes: Vec<u64> = r.figures.values().filter_map(|f| f.bytes).collect();
    sizes.sort_unstable();
    sizes.dedup();
    for b in sizes {
        let size = duplex::Size(b);
        let c = |name: &str| cell(r.figures.get(&format!("{name}/{size}")));
        println!(
            "{:>8} {:>26} {:>26} {:>26} {:>26}",
            size.to_string(),
            c(names[0]),
            c(names[1]),
            c(names[2]),
            c(names[3]),
        );
    }
}

fn print_table(r: &Results) {
    println!(
        "duplex bench, NCCL {}, lane CTAs {:?}, {} trials; median [min-max]",
        r.nccl, r.ctas, r.trials
    );
    if !r.env.is_empty() {
        let env: Vec<String> = r.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!("NCCL environment: {}", env.join(" "));
    }
    let f = |name: &str| r.figures.get(name);
    print_sizes(
        r,
        [
            "one way GB/s",
            "raw NCCL one way",
            "both ways (each)",
            "raw NCCL both ways",
        ],
        ["one_way", "raw_one_way", "both_ways", "raw_both_ways"],
    );
    if r.figures.keys().any(|k| k.starts_with("copy_")) {
        print_sizes(
            r,
            [
                "copy lane one way",
                "raw peer copy one way",
                "copy lanes both ways",
                "raw peer copies both",
            ],
            [
                "copy_one_way",
                "ce_one_way",
                "copy_both_ways",
                "ce_both_ways",
            ],
        );
    }
    if let (Some(m), Some(s)) = (&r.copy_threshold, r.copy_threshold_s) {
        println!("{m}\n(Local::measure_copy_from took {s:.2} s)");
    }
    if f("latency_us").is_some() {
        println!(
            "4 KiB latency (half a round trip), us: duplex {}, raw NCCL {}",
            cell(f("latency_us")),
            cell(f("raw_latency_us"))
        );
        println!(
            "host time per op, us: duplex {}, raw ncclSend {}",
            cell(f("host_us")),
            cell(f("raw_host_us"))
        );
    }
    for l in &r.lanes {
        println!(
            "lane {}: create ms {}, bytes {} ({})",
            l.name,
            cell(f(&format!("lane_create_ms/{}", l.name))),
            cell(f(&format!("lane_bytes/{}", l.name))),
            l.measured_by
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let ctas = (
        arg("--min-ctas").and_then(|v| v.parse().ok()),
        arg("--max-ctas").and_then(|v| v.parse().ok()),
    );
    // --quick: only 256 MiB bandwidth, for sweeps of settings.
    let quick = args.iter().any(|a| a == "--quick");
    let copy = !args.iter().any(|a| a == "--no-copy");
    let trials = match arg("--trials").map(|v| v.parse::<u32>()) {
        None => {
            if quick {
                3
            } else {
                5
            }
        }
        Some(Ok(n)) if n > 0 => n,
        Some(_) => {
            eprintln!("bench: --trials takes a positive number");
            std::process::exit(2);
        }
    };
    let results = Mutex::new(Results {
        format: 2,
        bench: "duplex",
        ctas,
        env: std::env::vars()
            .filter(|(k, _)| k.starts_with("NCCL_") || k.starts_with("DUPLEX_LANE"))
            .collect(),
        trials,
        quick,
        ..Default::default()
    });
    let local = match Local::new(2) {
        Ok(l) => l
            .policy(Policy::PerDirection)
            .timeout(Duration::from_secs(30))
            .ctas(ctas.0, ctas.1),
        Err(e) => {
            eprintln!("bench: {e}");
            std::process::exit(2);
        }
    };
    // Rank 1's lane costs, one trial per run of `local`.
    let lanes = Mutex::new(Samples::default());
    let r = local.run(|t| {
        let s = measure(t, trials, quick)?;
        eprintln!("rank {}: done", t.rank());
        let mut r = results.lock().unwrap_or_else(|e| e.into_inner());
        if t.rank() == 1 {
            r.nccl = t.nccl().version_string();
            r.lanes = t.lane_costs();
            lane_samples(t, &mut lanes.lock().unwrap_or_else(|e| e.into_inner()));
        }
        r.add(s);
        Ok(())
    });
    if let Err(e) = r {
        eprintln!("bench failed: {e}");
        std::process::exit(1);
    }
    // The lane cost's other trials: runs that make their lanes and end.
    for run in 2..=if quick { 1 } else { trials } {
        eprintln!("lane cost: run {run} of {trials}");
        let r = local.run(|t| {
            if t.rank() == 1 {
                lane_samples(t, &mut lanes.lock().unwrap_or_else(|e| e.into_inner()));
            }
            Ok(())
        });
        if let Err(e) = r {
            eprintln!("bench failed: lane cost run {run}: {e}");
            std::process::exit(1);
        }
    }
    if copy {
        // Copy-engine lanes from 1 MiB, every size measured above on them.
        let copies = local
            .clone()
            .copy_from(Some(duplex::Size(1 << 20)))
            .run(|t| {
                let s = measure_copy(t, trials, quick)?;
                results.lock().unwrap_or_else(|e| e.into_inner()).add(s);
                Ok(())
            });
        if let Err(e) = copies {
            eprintln!("bench failed: copy-engine lanes: {e}");
            std::process::exit(1);
        }
        match raw_copy_engines(trials, quick) {
            Ok(s) => results.lock().unwrap_or_else(|e| e.into_inner()).add(s),
            Err(e) => {
                eprintln!("bench failed: raw peer copies: {e}");
                std::process::exit(1);
            }
        }
    }
    let mut r = results.into_inner().unwrap_or_else(|e| e.into_inner());
    r.add(lanes.into_inner().unwrap_or_else(|e| e.into_inner()));
    let mut threshold_failed = None;
    if copy {
        // The threshold as a transport measures it for itself.
        let start = Instant::now();
        match local.measure_copy_from(&duplex_nccl::threshold::Plan::default()) {
            Ok(m) => {
                r.copy_threshold = Some(m);
                r.copy_threshold_s = Some(start.elapsed().as_secs_f64());
            }
            Err(e) => {
                // Reported after every other figure is printed and written.
                threshold_failed = Some(e);
            }
        }
    }
    print_table(&r);
    if let Some(path) = arg("--json") {
        let written = serde_json::to_string_pretty(&r)
            .map_err(|e| e.to_string())
            .and_then(|j| std::fs::write(&path, j).map_err(|e| e.to_string()));
        if let Err(e) = written {
            eprintln!("bench: cannot write {path}: {e}");
            std::process::exit(1);
        }
    }
    if let Some(e) = threshold_failed {
        eprintln!("bench failed: Local::measure_copy_from: {e}");
        std::process::exit(1);
    }
}
