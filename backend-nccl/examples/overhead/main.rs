//! The host time duplex adds to an op, and where it goes, on one GPU (so
//! that it can be measured wherever a single GPU is): a rank sends 4 KiB to
//! itself and receives it, in one group, `N` times, through duplex and
//! through plain `ncclSend`/`ncclRecv` on the same communicator and stream
//! ([`NcclRank::raw_self_exchange`]): a communicator of its own, connected
//! at creation, so a blocking one as per-direction lanes are (on a
//! non-blocking one, such as the world communicator, every group end hands
//! its work to NCCL's own thread and both paths poll for it, which is most
//! of their time); then the CUDA calls duplex makes per
//! op on top of NCCL's, each alone: recording an event (duplex records one
//! per op, for its completion tracking) and querying one. Every figure is
//! taken in `--trials` trials (default 5), duplex and raw back to back in
//! alternating order; it prints the median, min and max of each, in
//! microseconds per op (a group of two ops counts two), and the heap
//! allocations the issuing thread makes per op (Rust's, counted by this
//! example's global allocator; NCCL's and CUDA's own are not seen).
//!
//! `--spin SECONDS` instead issues through duplex for that long and prints
//! nothing else: a steady state to sample with a debugger. With
//! `--profile FILE` as well, the issuing thread samples itself
//! (`sampler.rs`, every 100 µs of its CPU time) and writes the samples to
//! FILE; `scripts/profile_symbols.py FILE BINARY` names them here, from
//! the same build with its line tables (build with frame pointers to see
//! callers: `scripts/gpu.sh build` stages one as `.gpu/overhead-fp`, and
//! BINARY is then `target/fp/release/examples/overhead`).
//!
//! It also prints what each communicator duplex made for the rank cost
//! (`NcclRank::lane_costs`: the parent of user communicators, the one of
//! the exchanges); `--comms N` makes N more first, one after another, to
//! show what each costs.
//!
//! `overhead [--trials N] [--comms N] [--spin SECONDS [--profile FILE]]`; with the
//! `device` tool on one H200:
//! `run(command=".gpu/overhead", carry=[".gpu"], kind="nvidia-h200")`.

// The sampler reads x86-64 registers from a Linux signal context.
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
mod sampler;

use std::time::{Duration, Instant};

use duplex::{Place, Transport};
use duplex_nccl::cuda::{Event, Stream};
use duplex_nccl::{Local, NcclComm, NcclRank, NcclStream};

const N: u32 = 4000;
const BYTES: usize = 4096;

/// Counts the Rust heap allocations of each thread (NCCL's and CUDA's own
/// `malloc`s are not counted): the issue path should make none per op.
struct Counting;

std::thread_local! {
    static ALLOCATIONS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

fn count_one() {
    let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
}

/// Allocations made by this thread so far.
fn allocations() -> u64 {
    ALLOCATIONS.try_with(std::cell::Cell::get).unwrap_or(0)
}

// SAFETY: every call goes to `System` unchanged; counting touches only a
// thread-local integer (no allocation, no destructor).
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        count_one();
        // SAFETY: as the caller promised for `layout`.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        count_one();
        // SAFETY: as the caller promised for `layout`.
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new: usize) -> *mut u8 {
        count_one();
        // SAFETY: as the caller promised for `ptr`, `layout` and `new`.
        unsafe { std::alloc::System.realloc(ptr, layout, new) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: as the caller promised for `ptr` and `layout`.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn median_min_max(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// Host time per op of `N` self-exchanges on `comm` and `stream`,
/// synchronized after, and the issuing thread's heap allocations per op.
fn exchanges(t: &NcclRank, on: &(NcclComm, NcclStream), raw: bool) -> duplex::Result<(f64, f64)> {
    let (comm, stream) = on;
    let out = t.alloc::<u8>(BYTES)?;
    let mut inb = t.alloc::<u8>(BYTES)?;
    let (o, i) = (t.raw_ptr(&out), t.raw_ptr(&inb));
    let place = Place::on(comm, stream);
    let mut once = || {
        if raw {
            t.raw_self_exchange(comm, stream, o, i, BYTES)
        } else {
            t.group(|| {
                t.send_on(&out, t.rank(), &place)?;
                t.recv_on(&mut inb, t.rank(), &place)
            })
        }
    };
    // Warm-up.
    for _ in 0..20 {
        once()?;
    }
    t.synchronize()?;
    let allocated = allocations();
    let start = Instant::now();
    for _ in 0..N {
        once()?;
    }
    let enqueue = start.elapsed();
    let allocated = allocations() - allocated;
    t.synchronize()?;
    Ok((
        enqueue.as_secs_f64() * 1e6 / f64::from(2 * N),
        allocated as f64 / f64::from(2 * N),
    ))
}

/// The communicator and stream the exchanges run on.
fn own_comm(t: &NcclRank) -> duplex::Result<(NcclComm, NcclStream)> {
    let comm = t
        .comm("self", &[t.rank()])?
        .ok_or_else(|| duplex::Error::Aborted("no communicator".into()))?;
    Ok((comm, t.stream("self")?))
}

/// Runs `f` with the calling thread sampled, and writes the samples to
/// `path` (`sampler.rs`).
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
fn profiled(path: &str, f: impl FnOnce() -> duplex::Result<()>) -> duplex::Result<()> {
    let s = sampler::Sampler::start(Duration::from_micros(100))
        .map_err(|e| duplex::Error::Aborted(format!("--profile: {e}")))?;
    f()?;
    let (kept, dropped) = s
        .finish(path)
        .map_err(|e| duplex::Error::Aborted(format!("--profile {path}: {e}")))?;
    println!("{kept} samples in {path} ({dropped} dropped)");
    Ok(())
}

/// `--profile` where the sampler cannot run.
#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
fn profiled(_: &str, _: impl FnOnce() -> duplex::Result<()>) -> duplex::Result<()> {
    Err(duplex::Error::Aborted(
        "--profile samples x86-64 Linux only".into(),
    ))
}

/// Microseconds per call of `f`, `N` calls.
fn per_call(mut f: impl FnMut() -> duplex::Result<()>) -> duplex::Result<f64> {
    let start = Instant::now();
    for _ in 0..N {
        f()?;
    }
    Ok(start.elapsed().as_secs_f64() * 1e6 / f64::from(N))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let trials: usize = args
        .iter()
        .position(|a| a == "--trials")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(5);
    // Connected at creation (`warm`): the exchanges' own communicator is
    // then a blocking one, as per-direction lanes are, so a launch returns
    // when it is queued.
    let local = match Local::new(1) {
        Ok(l) => l.timeout(Duration::from_secs(30)).warm(true),
        Err(e) => {
            eprintln!("overhead: {e}");
            std::process::exit(2);
        }
    };
    let figures: std::sync::Mutex<[(&str, Vec<f64>); 7]> = std::sync::Mutex::new([
        ("duplex: group { send; recv } to itself, per op", Vec::new()),
        ("raw NCCL: the same group, per op", Vec::new()),
        ("duplex minus raw, per op", Vec::new()),
        ("cuEventRecord, per call", Vec::new()),
        ("cuEventQuery, per call", Vec::new()),
        ("duplex: heap allocations per op (count)", Vec::new()),
        ("raw NCCL: heap allocations per op (count)", Vec::new()),
    ]);
    let spin: Option<f64> = args
        .iter()
        .position(|a| a == "--spin")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok());
    let profile = args
        .iter()
        .position(|a| a == "--profile")
        .and_then(|i| args.get(i + 1))
        .cloned();
    if let Some(secs) = spin {
        let r = local.run(|t| {
            let on = own_comm(t)?;
            exchanges(t, &on, false)?;
            let start = Instant::now();
            let spin = || {
                while start.elapsed().as_secs_f64() < secs {
                    exchanges(t, &on, false)?;
                }
                Ok(())
            };
            match &profile {
                Some(path) => profiled(path, spin),
                None => spin(),
            }
        });
        if let Err(e) = r {
            eprintln!("overhead failed: {e}");
            std::process::exit(1);
        }
        return;
    }
    let costs = std::sync::Mutex::new(Vec::new());
    // --comms N: N more communicators of this one rank, made before the
    // figures are taken, to show what each costs (printed with the rest).
    let comms: usize = args
        .iter()
        .position(|a| a == "--comms")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let r = local.run(|t| {
        for i in 0..comms {
            t.comm(&format!("probe-{i}"), &[t.rank()])?;
        }
        let on = own_comm(t)?;
        let stream = Stream::new()?;
        let event = Event::new(false)?;
        for trial in 0..trials {
            let order = if trial % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            let mut got = [(0.0, 0.0); 2];
            for raw in order {
                got[usize::from(raw)] = exchanges(t, &on, raw)?;
            }
            let (allocs, got) = ([got[0].1, got[1].1], [got[0].0, got[1].0]);
            let record = per_call(|| event.record(&stream))?;
            let query = per_call(|| event.done().map(drop))?;
            let mut f = figures.lock().unwrap_or_else(|e| e.into_inner());
            for (k, v) in [
                got[0],
                got[1],
                got[0] - got[1],
                record,
                query,
                allocs[0],
                allocs[1],
            ]
            .into_iter()
            .enumerate()
            {
                f[k].1.push(v);
            }
        }
        *costs.lock().unwrap_or_else(|e| e.into_inner()) = t.lane_costs();
        Ok(())
    });
    if let Err(e) = r {
        eprintln!("overhead failed: {e}");
        std::process::exit(1);
    }
    println!("communicators duplex made besides the world's (one rank), in order:");
    for c in costs.into_inner().unwrap_or_else(|e| e.into_inner()) {
        println!(
            "  {:<50} {:7.1} ms, {:.1} MiB ({})",
            c.name,
            c.create_ms,
            c.bytes as f64 / (1 << 20) as f64,
            c.measured_by
        );
    }
    println!("host time, microseconds (median [min-max] of {trials} trials, {N} groups each)");
    let mut figures = figures.into_inner().unwrap_or_else(|e| e.into_inner());
    for (name, v) in &mut figures {
        let (m, lo, hi) = median_min_max(v);
        println!("  {name:<50} {m:7.2} [{lo:.2}-{hi:.2}]");
    }
}
