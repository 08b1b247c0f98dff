//! Copy-engine lanes (`duplex_nccl::copy`) on real GPUs, without NCCL: the
//! mechanism checked and measured on whatever GPUs the machine has. With two
//! GPUs its lanes go from GPU 0 to GPU 1 and back; with one, both "ranks"
//! are on GPU 0 (each with its own streams), which checks the protocol and
//! measures its overhead but not NVLink.
//!
//! ```console
//! cargo run --release -p duplex-nccl --example copylane -- [--trials 5] [--mib 256]
//! ```
//!
//! Checks (each prints `PASS` or `FAIL`; any failure is exit status 1):
//! - `data`: 48 messages of sizes from 0 B to 8 MiB each way, issued by a
//!   sending and a receiving thread at once; every ticket delivered and
//!   every byte compared.
//! - `seed`: both ranks send 256 MiB first, then receive, each direction on
//!   its own lane and streams (the seed hang of `examples/seed.sched`, on
//!   copy-engine lanes): completes, bytes compared.
//! - `abort`: a send whose recv never comes blocks its stream; aborting the
//!   lane releases it, and its ticket says failed.
//!
//! Figures (median [min–max] of `--trials`): a raw `cuMemcpyPeerAsync`, the
//! lane one way and both ways at once, each direction in GB/s timed by
//! events on its sender's stream (the copy and the release of the
//! sender's stream, which is what a send costs); µs per 4 KiB message
//! on the lane and raw; and a compute kernel's time alone and beside the
//! lane's copies (equal times: the copies take no SMs).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys};
use duplex::{DType, Dir};
use duplex_nccl::copy::{CopyLane, Cuda, Keep, TicketState};
use duplex_nccl::cuda::{self, Device, Event, Memory, Stream};

type Lane = CopyLane<Cuda>;

/// What the example is doing, for its watchdog.
static PHASE: std::sync::Mutex<&str> = std::sync::Mutex::new("start");

fn phase(p: &'static str) {
    *PHASE.lock().unwrap_or_else(|e| e.into_inner()) = p;
    eprintln!("copylane: {p}");
}

/// Ends the process if it is still running after `limit`, naming the phase
/// it was stuck in (a stream that never drains makes freeing memory block).
fn watchdog(limit: Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(limit);
        let p = *PHASE.lock().unwrap_or_else(|e| e.into_inner());
        println!("FAIL watchdog: still running after {limit:?}, in phase `{p}`");
        std::process::exit(3);
    });
}
type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// A rank: a device and two streams, one per lane direction.
struct Rank {
    dev: Arc<Device>,
    out: Stream,
    inn: Stream,
}

fn rank(ordinal: i32) -> Res<Rank> {
    let dev = Arc::new(Device::new(ordinal)?);
    Ok(Rank {
        out: Stream::new()?,
        inn: Stream::new()?,
        dev,
    })
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(31).wrapping_add(seed * 7) as u8)
        .collect()
}

fn keep(m: &Arc<Memory>) -> Keep {
    Box::new(m.clone())
}

/// Waits for `stream` with a deadline, settling the lanes meanwhile.
fn drain(stream: &Stream, lanes: &[&Lane], limit: Duration) -> Res<bool> {
    let e = Event::new(false)?;
    e.record(stream)?;
    let start = Instant::now();
    while !e.done()? {
        for l in lanes {
            l.settle()?;
        }
        if start.elapsed() > limit {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    for l in lanes {
        l.settle()?;
    }
    Ok(true)
}

fn check_data(a: &Rank, b: &Rank, ab: &Lane) -> Res<String> {
    let sizes: Vec<usize> = (0..48)
        .map(|k| match k % 6 {
            0 => 0,
            1 => 1,
            2 => 4096,
            3 => 1 << 20,
            4 => (8 << 20) - 3,
            _ => 12345 * (k + 1),
        })
        .collect();
    a.dev.bind()?;
    let src: Vec<Arc<Memory>> = sizes
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            let m = Memory::zeroed(n)?;
            m.write(&pattern(n, k as u64))?;
            Ok(Arc::new(m))
        })
        .collect::<Res<_>>()?;
    b.dev.bind()?;
    let dst: Vec<Arc<Memory>> = sizes
        .iter()
        .map(|&n| Memory::zeroed(n).map(Arc::new))
        .collect::<Result<_, _>>()?;
    let tickets = std::thread::scope(|s| -> Res<_> {
        let sender = s.spawn(|| -> Result<Vec<_>, duplex::Error> {
            a.dev.bind()?;
            src.iter()
                .zip(&sizes)
                .map(|(m, &n)| {
                    ab.issue(Dir::Send, &a.out, m.ptr(), n, DType::U8, "send", keep(m))
                        .map_err(duplex::Error::from)
                })
                .collect()
        });
        b.dev.bind()?;
        let recvs: Vec<_> = dst
            .iter()
            .zip(&sizes)
            .map(|(m, &n)| ab.issue(Dir::Recv, &b.inn, m.ptr(), n, DType::U8, "recv", keep(m)))
            .collect::<Result<_, _>>()?;
        let sends = sender.join().map_err(|_| "the sending thread panicked")??;
        Ok((sends, recvs))
    })?;
    if !drain(&b.inn, &[ab], Duration::from_secs(10))?
        || !drain(&a.out, &[ab], Duration::from_secs(10))?
    {
        return Err("the streams did not drain in 10 s".into());
    }
    for (k, t) in tickets.0.iter().chain(&tickets.1).enumerate() {
        if t.state() != TicketState::Delivered {
            return Err(format!("op {k} is {:?}, not delivered", t.state()).into());
        }
    }
    for (k, m) in dst.iter().enumerate() {
        if sizes[k] > 0 && m.read()? != pattern(sizes[k], k as u64) {
            return Err(format!("message {k} ({} B) arrived wrong", sizes[k]).into());
        }
    }
    Ok(format!(
        "{} messages each way, 0 B to 8 MiB, bytes compared",
        sizes.len()
    ))
}

fn check_seed(a: &Rank, b: &Rank, ab: &Lane, ba: &Lane, bytes: usize) -> Res<String> {
    a.dev.bind()?;
    let (a_src, a_dst) = (
        Arc::new(Memory::zeroed(bytes)?),
        Arc::new(Memory::zeroed(bytes)?),
    );
    a_src.write(&pattern(bytes, 1))?;
    b.dev.bind()?;
    let (b_src, b_dst) = (
        Arc::new(Memory::zeroed(bytes)?),
        Arc::new(Memory::zeroed(bytes)?),
    );
    b_src.write(&pattern(bytes, 2))?;
    let start = Instant::now();
    std::thread::scope(|s| -> Res<()> {
        let other = s.spawn(|| -> Result<(), duplex::Error> {
            b.dev.bind()?;
            ba.issue(
                Dir::Send,
                &b.out,
                b_src.ptr(),
                bytes,
                DType::U8,
                "rank 1 send",
                keep(&b_src),
            )?;
            ab.issue(
                Dir::Recv,
                &b.inn,
                b_dst.ptr(),
                bytes,
                DType::U8,
                "rank 1 recv",
                keep(&b_dst),
            )?;
            Ok(())
        });
        a.dev.bind()?;
        ab.issue(
            Dir::Send,
            &a.out,
            a_src.ptr(),
            bytes,
            DType::U8,
            "rank 0 send",
            keep(&a_src),
        )?;
        ba.issue(
            Dir::Recv,
            &a.inn,
            a_dst.ptr(),
            bytes,
            DType::U8,
            "rank 0 recv",
            keep(&a_dst),
        )?;
        other.join().map_err(|_| "rank 1 panicked")??;
        Ok(())
    })?;
    for s in [&a.out, &a.inn, &b.out, &b.inn] {
        if !drain(s, &[ab, ba], Duration::from_secs(10))? {
            return Err("the seed did not complete in 10 s".into());
        }
    }
    let took = start.elapsed();
    if a_dst.read()? != pattern(bytes, 2) || b_dst.read()? != pattern(bytes, 1) {
        return Err("the seed's bytes arrived wrong".into());
    }
    Ok(format!(
        "both ranks send {} MiB first: completed in {:.1} ms, bytes compared",
        bytes >> 20,
        took.as_secs_f64() * 1e3
    ))
}

fn check_abort(a: &Rank, b: &Rank) -> Res<String> {
    let lane = Arc::new(CopyLane::new(
        "copy:abort",
        Cuda::new(a.dev.clone(), b.dev.clone())?,
    ));
    CopyLane::start(&lane)?;
    a.dev.bind()?;
    let m = Arc::new(Memory::zeroed(1 << 20)?);
    let t = lane.issue(
        Dir::Send,
        &a.out,
        m.ptr(),
        1 << 20,
        DType::U8,
        "send",
        keep(&m),
    )?;
    let after = Event::new(false)?;
    after.record(&a.out)?;
    std::thread::sleep(Duration::from_millis(300));
    if after.done()? {
        return Err("a send without its recv did not block its stream".into());
    }
    let start = Instant::now();
    lane.abort("the test's deadline");
    while !after.done()? {
        if start.elapsed() > Duration::from_secs(2) {
            return Err("the abort did not release the stream in 2 s".into());
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    let released = start.elapsed();
    match t.state() {
        TicketState::Failed(_) => Ok(format!(
            "blocked 300 ms; released {:.0} µs after the abort; its ticket failed",
            released.as_secs_f64() * 1e6
        )),
        s => Err(format!("an aborted send's ticket is {s:?}").into()),
    }
}

/// The flag mechanism alone, step by step: a stream waiting on a slot
/// released by the host, and by another stream's write.
fn probe_flags(a: &Rank) -> Res<bool> {
    let lane = CopyLane::new("copy:probe", Cuda::new(a.dev.clone(), a.dev.clone())?);
    let api = lane.api();
    a.dev.bind()?;
    let after = Event::new(false)?;
    // 1. Wait on slot 0 for 1; the host releases every slot.
    use duplex_nccl::copy::CopyApi;
    api.wait(&a.out, 0, 1)?;
    after.record(&a.out)?;
    std::thread::sleep(Duration::from_millis(200));
    let blocked = !after.done()?;
    api.release_all();
    let start = Instant::now();
    while !after.done()? && start.elapsed() < Duration::from_secs(2) {}
    println!(
        "probe 1: a wait blocks its stream: {blocked}; the host's release frees it: {} ({:.0} µs)",
        after.done()?,
        start.elapsed().as_secs_f64() * 1e6
    );
    // 2. A fresh lane: a copy of 0 bytes writes the slot from the copy
    // stream, which waits for two ready events.
    let lane = Arc::new(CopyLane::new(
        "copy:probe2",
        Cuda::new(a.dev.clone(), a.dev.clone())?,
    ));
    CopyLane::start(&lane)?;
    let m = Arc::new(Memory::zeroed(16)?);
    let t1 = lane.issue(Dir::Send, &a.out, m.ptr(), 16, DType::U8, "send", keep(&m))?;
    let after1 = Event::new(false)?;
    after1.record(&a.out)?;
    let t2 = lane.issue(Dir::Recv, &a.inn, m.ptr(), 16, DType::U8, "recv", keep(&m))?;
    let after2 = Event::new(false)?;
    after2.record(&a.inn)?;
    let start = Instant::now();
    while !(after1.done()? && after2.done()?) && start.elapsed() < Duration::from_secs(2) {
        lane.settle()?;
    }
    lane.settle()?;
    println!(
        "probe 2: send stream released {}, recv stream released {}, copy stream idle {} ({:.0} µs); tickets {:?} {:?}",
        after1.done()?,
        after2.done()?,
        {
            let e = Event::new(false)?;
            e.record(lane.api().stream())?;
            std::thread::sleep(Duration::from_millis(10));
            e.done()?
        },
        start.elapsed().as_secs_f64() * 1e6,
        t1.state(),
        t2.state()
    );
    let ok = after1.done()? && after2.done()?;
    if !ok {
        lane.abort("probe");
    }
    Ok(ok && blocked)
}

/// Median, min and max.
fn stats(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn show(name: &str, unit: &str, v: Vec<f64>) {
    let (m, lo, hi) = stats(v);
    println!("| {name} | {m:.2} | [{lo:.2}–{hi:.2}] | {unit} |");
}

/// GB/s of one message of `bytes` on each lane of `ends` at once, each
/// timed on its sender's device: the recvs are issued first, then each
/// send between two timing events on its stream, so each time is the
/// copy plus the release of the sender's stream.
fn lane_gbps(
    ends: &[(&Lane, &Rank, &Rank)],
    bufs: &[(Arc<Memory>, Arc<Memory>)],
    bytes: usize,
) -> Res<Vec<f64>> {
    for ((lane, _, b), (_, dst)) in ends.iter().zip(bufs) {
        b.dev.bind()?;
        lane.issue(
            Dir::Recv,
            &b.inn,
            dst.ptr(),
            bytes,
            DType::U8,
            "recv",
            keep(dst),
        )?;
    }
    let mut events = Vec::new();
    for ((lane, a, _), (src, _)) in ends.iter().zip(bufs) {
        a.dev.bind()?;
        let (start, end) = (Event::new(true)?, Event::new(true)?);
        start.record(&a.out)?;
        lane.issue(
            Dir::Send,
            &a.out,
            src.ptr(),
            bytes,
            DType::U8,
            "send",
            keep(src),
        )?;
        end.record(&a.out)?;
        events.push((start, end));
    }
    let lanes: Vec<&Lane> = ends.iter().map(|e| e.0).collect();
    for (_, a, b) in ends {
        for (r, s) in [(a, &a.out), (b, &b.inn)] {
            r.dev.bind()?;
            if !drain(s, &lanes, Duration::from_secs(10))? {
                return Err("a timed copy did not finish".into());
            }
        }
    }
    events
        .iter()
        .map(|(s, e)| Ok(bytes as f64 / (f64::from(e.since(s)?) * 1e-3) / 1e9))
        .collect()
}

const SPIN_PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64
.visible .entry spin(.param .u64 cycles)
{
  .reg .u64 %rd<5>;
  .reg .pred %p;
  ld.param.u64 %rd1, [cycles];
  mov.u64 %rd2, %clock64;
LOOP:
  mov.u64 %rd3, %clock64;
  sub.u64 %rd4, %rd3, %rd2;
  setp.lt.u64 %p, %rd4, %rd1;
  @%p bra LOOP;
  ret;
}
"#;

/// A kernel that fills every SM for a while: `blocks` blocks of 1024
/// threads, each spinning `cycles` clock cycles.
struct Spin {
    f: sys::CUfunction,
    blocks: u32,
}

impl Spin {
    fn new(dev: &Device) -> Res<Spin> {
        dev.bind()?;
        let ptx = std::ffi::CString::new(SPIN_PTX)?;
        // SAFETY: a NUL-terminated PTX image.
        let module = unsafe { result::module::load_data(ptx.as_ptr() as *const _) }?;
        // SAFETY: the module is live (never unloaded).
        let f = unsafe { result::module::get_function(module, std::ffi::CString::new("spin")?) }?;
        let d = result::device::get(dev.ordinal())?;
        // SAFETY: a valid device.
        let sms = unsafe {
            result::device::get_attribute(
                d,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
        }?;
        // Two blocks of 1024 threads fill an SM's 2048 thread slots; four
        // waves of them.
        Ok(Spin {
            f,
            blocks: sms as u32 * 2 * 4,
        })
    }

    /// Milliseconds the kernel takes on `stream`.
    fn time(&self, stream: &Stream, cycles: u64) -> Res<f64> {
        let (start, end) = (Event::new(true)?, Event::new(true)?);
        start.record(stream)?;
        let mut c = cycles;
        let mut params = [&mut c as *mut u64 as *mut std::ffi::c_void];
        // SAFETY: one u64 parameter, as the kernel declares.
        unsafe {
            result::launch_kernel(
                self.f,
                (self.blocks, 1, 1),
                (1024, 1, 1),
                0,
                stream.raw() as sys::CUstream,
                &mut params,
            )
        }?;
        end.record(stream)?;
        stream.synchronize()?;
        Ok(f64::from(end.since(&start)?))
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("copylane: {e}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Res<bool> {
    let mut trials = 5usize;
    let mut mib = 256usize;
    let mut limit = 240u64;
    let mut probe = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| -> Res<usize> {
            Ok(args
                .next()
                .ok_or(format!("{name} needs a value"))?
                .parse()?)
        };
        match a.as_str() {
            "--trials" => trials = value("--trials")?.max(1),
            "--mib" => mib = value("--mib")?.max(1),
            "--limit" => limit = value("--limit")? as u64,
            "--probe" => probe = true,
            other => return Err(format!("unknown argument `{other}`").into()),
        }
    }
    let gpus = cuda::init()?;
    if gpus == 0 {
        return Err("no GPU: run it where there is one".into());
    }
    watchdog(Duration::from_secs(limit));
    let (a, b) = (rank(0)?, rank(if gpus >= 2 { 1 } else { 0 })?);
    if probe {
        return probe_flags(&a);
    }
    println!(
        "# copy-engine lanes: GPU {} and GPU {} ({gpus} GPU(s) on this machine)\n",
        a.dev.ordinal(),
        b.dev.ordinal()
    );
    let ab = Arc::new(CopyLane::new(
        "copy:0->1",
        Cuda::new(a.dev.clone(), b.dev.clone())?,
    ));
    let ba = Arc::new(CopyLane::new(
        "copy:1->0",
        Cuda::new(b.dev.clone(), a.dev.clone())?,
    ));
    CopyLane::start(&ab)?;
    CopyLane::start(&ba)?;
    let bytes = mib << 20;
    type Check<'a> = Box<dyn Fn() -> Res<String> + 'a>;
    let checks: [(&'static str, Check<'_>); 4] = [
        ("data", Box::new(|| check_data(&a, &b, &ab))),
        ("data (back)", Box::new(|| check_data(&b, &a, &ba))),
        ("seed", Box::new(|| check_seed(&a, &b, &ab, &ba, bytes))),
        ("abort", Box::new(|| check_abort(&a, &b))),
    ];
    for (name, check) in checks {
        phase(name);
        match check() {
            Ok(what) => println!("PASS {name}: {what}"),
            Err(e) => {
                println!("FAIL {name}: {e}");
                // Release every stream a lane holds, so that freeing memory
                // (which waits for the device) cannot block, and stop.
                ab.abort("a check failed");
                ba.abort("a check failed");
                return Ok(false);
            }
        }
    }
    phase("figures");
    println!("\n| figure | median | [min–max] | unit |\n|---|---|---|---|");
    // Raw peer copies on a stream of their own.
    a.dev.bind()?;
    let src = Arc::new(Memory::zeroed(bytes)?);
    let back_dst = Arc::new(Memory::zeroed(bytes)?);
    b.dev.bind()?;
    let dst = Arc::new(Memory::zeroed(bytes)?);
    let back_src = Arc::new(Memory::zeroed(bytes)?);
    a.dev.bind()?;
    let raw_stream = Stream::new()?;
    let mut raw = Vec::new();
    for _ in 0..trials {
        let (s, e) = (Event::new(true)?, Event::new(true)?);
        s.record(&raw_stream)?;
        // SAFETY: both buffers hold `bytes` bytes and outlive the copy.
        unsafe { cuda::copy_peer(&b.dev, dst.ptr(), &a.dev, src.ptr(), bytes, &raw_stream) }?;
        e.record(&raw_stream)?;
        raw_stream.synchronize()?;
        raw.push(bytes as f64 / (f64::from(e.since(&s)?) * 1e-3) / 1e9);
    }
    show(
        &format!("raw cuMemcpyPeerAsync {mib} MiB, one way"),
        "GB/s",
        raw,
    );
    let one = (0..trials)
        .map(|_| Ok(lane_gbps(&[(&ab, &a, &b)], &[(src.clone(), dst.clone())], bytes)?[0]))
        .collect::<Res<Vec<f64>>>()?;
    show(&format!("lane {mib} MiB, one way"), "GB/s", one);
    let mut both = [Vec::new(), Vec::new()];
    for _ in 0..trials {
        let g = lane_gbps(
            &[(&ab, &a, &b), (&ba, &b, &a)],
            &[
                (src.clone(), dst.clone()),
                (back_src.clone(), back_dst.clone()),
            ],
            bytes,
        )?;
        both[0].push(g[0]);
        both[1].push(g[1]);
    }
    let [fwd, back] = both;
    show(
        &format!("lane {mib} MiB, both ways at once, 0->1"),
        "GB/s",
        fwd,
    );
    show(
        &format!("lane {mib} MiB, both ways at once, 1->0"),
        "GB/s",
        back,
    );
    // Small messages: µs per message, 1000 in a row.
    let n = 1000;
    let small = 4096;
    let mut lane_us = Vec::new();
    let mut raw_us = Vec::new();
    for _ in 0..trials {
        let start = Instant::now();
        for _ in 0..n {
            a.dev.bind()?;
            ab.issue(
                Dir::Send,
                &a.out,
                src.ptr(),
                small,
                DType::U8,
                "send",
                keep(&src),
            )?;
            b.dev.bind()?;
            ab.issue(
                Dir::Recv,
                &b.inn,
                dst.ptr(),
                small,
                DType::U8,
                "recv",
                keep(&dst),
            )?;
        }
        drain(&b.inn, &[&ab], Duration::from_secs(10))?;
        drain(&a.out, &[&ab], Duration::from_secs(10))?;
        lane_us.push(start.elapsed().as_secs_f64() * 1e6 / f64::from(n));
        a.dev.bind()?;
        let start = Instant::now();
        for _ in 0..n {
            // SAFETY: as above.
            unsafe { cuda::copy_peer(&b.dev, dst.ptr(), &a.dev, src.ptr(), small, &raw_stream) }?;
        }
        raw_stream.synchronize()?;
        raw_us.push(start.elapsed().as_secs_f64() * 1e6 / f64::from(n));
    }
    show("lane 4 KiB, per message (1000 in a row)", "µs", lane_us);
    show("raw cuMemcpyPeerAsync 4 KiB, per message", "µs", raw_us);
    // SMs: a kernel that fills every SM of GPU 0, alone and beside copies.
    let spin = Spin::new(&a.dev)?;
    let kstream = Stream::new()?;
    let cycles = 20_000_000u64;
    spin.time(&kstream, cycles)?;
    let mut alone = Vec::new();
    let mut beside = Vec::new();
    for _ in 0..trials {
        alone.push(spin.time(&kstream, cycles)?);
        // Keep copies in flight both ways while the kernel runs.
        for _ in 0..16 {
            for (lane, x, y, s, d) in [
                (&ab, &a, &b, &src, &dst),
                (&ba, &b, &a, &back_src, &back_dst),
            ] {
                x.dev.bind()?;
                lane.issue(
                    Dir::Send,
                    &x.out,
                    s.ptr(),
                    bytes,
                    DType::U8,
                    "send",
                    keep(s),
                )?;
                y.dev.bind()?;
                lane.issue(
                    Dir::Recv,
                    &y.inn,
                    d.ptr(),
                    bytes,
                    DType::U8,
                    "recv",
                    keep(d),
                )?;
            }
        }
        a.dev.bind()?;
        beside.push(spin.time(&kstream, cycles)?);
        for s in [&a.out, &a.inn, &b.out, &b.inn] {
            drain(s, &[&ab, &ba], Duration::from_secs(20))?;
        }
    }
    let (am, _, _) = stats(alone.clone());
    let (bm, _, _) = stats(beside.clone());
    show("compute kernel on every SM of GPU 0, alone", "ms", alone);
    show("the same beside 32 lane copies in flight", "ms", beside);
    println!("\nkernel time beside copies / alone: {:.3}", bm / am);
    Ok(true)
}
