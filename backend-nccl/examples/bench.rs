//! duplex's benchmark on two GPUs: bandwidth one way and both ways at once
//! on per-direction lanes, 4 KiB ping-pong latency through duplex and
//! through plain NCCL calls on the same communicators and stream, and the
//! host time duplex adds to each op. Prints a table and writes JSON.
//!
//! `bench [--json FILE] [--min-ctas N --max-ctas N]`; run
//! `scripts/gpu.sh run bench` for the side-by-side run with PyTorch.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use duplex::{Dir, Place, Policy, Transport};
use duplex_nccl::{Local, NcclRank};

#[derive(Debug, Default, serde::Serialize)]
struct Results {
    nccl: String,
    ctas: (Option<i32>, Option<i32>),
    /// bytes → GB/s, rank 0 to rank 1.
    one_way: Vec<(u64, f64)>,
    /// bytes → GB/s per direction, both directions at once.
    both_ways: Vec<(u64, f64)>,
    /// 4 KiB one-way latency (half a round trip), microseconds.
    latency_duplex_us: f64,
    latency_raw_us: f64,
    /// Host time to enqueue one op, microseconds.
    host_duplex_us: f64,
    host_raw_us: f64,
    lanes: Vec<duplex_nccl::LaneCost>,
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

fn bandwidth(t: &NcclRank, bytes: u64, both: bool) -> duplex::Result<f64> {
    let n = iters(bytes);
    let peer = 1 - t.rank();
    let out = t.alloc::<u8>(bytes as usize)?;
    let mut inb = t.alloc::<u8>(bytes as usize)?;
    let run = |count: u32, inb: &mut _| -> duplex::Result<Duration> {
        barrier(t, &format!("bw{bytes}{both}{count}"))?;
        let start = Instant::now();
        for _ in 0..count {
            if both || t.rank() == 0 {
                t.send(&out, peer)?;
            }
            if both || t.rank() == 1 {
                t.recv(inb, peer)?;
            }
        }
        t.synchronize()?;
        Ok(start.elapsed())
    };
    run(3, &mut inb)?;
    let d = run(n, &mut inb)?;
    Ok(gbps(bytes, n, d))
}

/// Round trips of 4 KiB on one stream of each rank: rank 0 sends then
/// receives, rank 1 receives then sends; half the mean round trip. `raw`
/// issues plain ncclSend/ncclRecv on the same communicators and stream.
fn latency(t: &NcclRank, raw: bool) -> duplex::Result<f64> {
    const N: u32 = 2000;
    let peer = 1 - t.rank();
    let s = t.stream("pingpong")?;
    let out_lane = t.lane(peer, Dir::Send)?;
    let in_lane = t.lane(peer, Dir::Recv)?;
    let out = t.alloc::<u8>(4096)?;
    let mut inb = t.alloc::<u8>(4096)?;
    let (out_ptr, in_ptr) = (t.raw_ptr(&out), t.raw_ptr(&inb));
    let send = |_: &mut duplex_nccl::NcclBuffer<u8>| -> duplex::Result<()> {
        if raw {
            t.raw_p2p(Dir::Send, peer, out_ptr, 4096, Some(&s))
        } else {
            t.send_on(&out, peer, &Place::on(&out_lane.comm, &s))
        }
    };
    let recv = |inb: &mut duplex_nccl::NcclBuffer<u8>| -> duplex::Result<()> {
        if raw {
            t.raw_p2p(Dir::Recv, peer, in_ptr, 4096, Some(&s))
        } else {
            t.recv_on(inb, peer, &Place::on(&in_lane.comm, &s))
        }
    };
    let one = |inb: &mut duplex_nccl::NcclBuffer<u8>| -> duplex::Result<()> {
        if t.rank() == 0 {
            send(inb)?;
            recv(inb)
        } else {
            recv(inb)?;
            send(inb)
        }
    };
    for _ in 0..50 {
        one(&mut inb)?;
    }
    t.sync_stream(&s)?;
    barrier(t, &format!("lat{raw}"))?;
    let start = Instant::now();
    for _ in 0..N {
        one(&mut inb)?;
    }
    t.sync_stream(&s)?;
    let d = start.elapsed();
    Ok(d.as_secs_f64() * 1e6 / f64::from(N) / 2.0)
}

/// Host time per enqueued 4 KiB op, duplex vs plain ncclSend/ncclRecv on
/// the same lanes.
fn host_overhead(t: &NcclRank, raw: bool) -> duplex::Result<f64> {
    const N: u32 = 4000;
    let peer = 1 - t.rank();
    let out = t.alloc::<u8>(4096)?;
    let mut inb = t.alloc::<u8>(4096)?;
    let (out_ptr, in_ptr) = (t.raw_ptr(&out), t.raw_ptr(&inb));
    barrier(t, &format!("host{raw}"))?;
    let start = Instant::now();
    for _ in 0..N {
        match (t.rank(), raw) {
            (0, true) => t.raw_p2p(Dir::Send, peer, out_ptr, 4096, None)?,
            (0, false) => t.send(&out, peer)?,
            (_, true) => t.raw_p2p(Dir::Recv, peer, in_ptr, 4096, None)?,
            (_, false) => t.recv(&mut inb, peer)?,
        }
    }
    let enqueue = start.elapsed();
    t.synchronize()?;
    Ok(enqueue.as_secs_f64() * 1e6 / f64::from(N))
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
    let results = Mutex::new(Results {
        ctas,
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
    let r = local.run(|t| {
        let mut one = Vec::new();
        let mut both = Vec::new();
        let phase = |name: &str| eprintln!("rank {}: {name}", t.rank());
        let sizes: &[u64] = if quick {
            &[256 << 20]
        } else {
            &[1 << 20, 64 << 20, 256 << 20]
        };
        for &bytes in sizes {
            phase(&format!("one way {bytes}"));
            one.push((bytes, bandwidth(t, bytes, false)?));
            phase(&format!("both ways {bytes}"));
            both.push((bytes, bandwidth(t, bytes, true)?));
        }
        if quick {
            let mut r = results.lock().unwrap_or_else(|e| e.into_inner());
            if t.rank() == 1 {
                r.one_way = one;
                r.both_ways = both;
                r.nccl = t.nccl().version_string();
            }
            return Ok(());
        }
        phase("latency");
        let lat_d = latency(t, false)?;
        let lat_r = latency(t, true)?;
        let lat_d2 = latency(t, false)?;
        let lat_r2 = latency(t, true)?;
        phase("host overhead");
        let host_d = host_overhead(t, false)?;
        let host_r = host_overhead(t, true)?;
        phase("done");
        if t.rank() == 1 {
            // The receiver's clock: it sees the data arrive.
            let mut r = results.lock().unwrap_or_else(|e| e.into_inner());
            r.nccl = t.nccl().version_string();
            r.one_way = one;
            r.both_ways = both;
            r.latency_duplex_us = lat_d.min(lat_d2);
            r.latency_raw_us = lat_r.min(lat_r2);
            r.lanes = t.lane_costs().to_vec();
        } else {
            let mut r = results.lock().unwrap_or_else(|e| e.into_inner());
            r.host_duplex_us = host_d;
            r.host_raw_us = host_r;
        }
        Ok(())
    });
    if let Err(e) = r {
        eprintln!("bench failed: {e}");
        std::process::exit(1);
    }
    let r = results.into_inner().unwrap_or_else(|e| e.into_inner());
    println!("duplex bench, NCCL {}, lane CTAs {:?}", r.nccl, r.ctas);
    println!(
        "{:>10} {:>14} {:>22}",
        "size", "one way GB/s", "both ways GB/s (each)"
    );
    for ((b, o), (_, w)) in r.one_way.iter().zip(&r.both_ways) {
        println!(
            "{:>10} {:>14.1} {:>22.1}",
            duplex::Size(*b).to_string(),
            o,
            w
        );
    }
    println!(
        "4 KiB latency: duplex {:.2} us, raw NCCL {:.2} us",
        r.latency_duplex_us, r.latency_raw_us
    );
    println!(
        "host time per op: duplex {:.2} us, raw ncclSend {:.2} us",
        r.host_duplex_us, r.host_raw_us
    );
    for l in &r.lanes {
        println!(
            "lane {}: {:.1} ms, {} bytes ({})",
            l.name, l.create_ms, l.bytes, l.measured_by
        );
    }
    if let Some(path) = arg("--json") {
        match serde_json::to_string_pretty(&r) {
            Ok(j) => {
                if let Err(e) = std::fs::write(&path, j) {
                    eprintln!("bench: cannot write {path}: {e}");
                }
            }
            Err(e) => eprintln!("bench: {e}"),
        }
    }
}
