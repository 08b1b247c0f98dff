//! A sampling profiler for one thread, small enough to carry to a machine
//! that has no `perf`: a CPU-time timer on the thread raises `SIGPROF`
//! every `period`, and the handler stores the interrupted instruction and
//! the return addresses found by following frame pointers (build with
//! `-C force-frame-pointers=yes` to get callers; without them a sample is
//! its leaf alone). [`Sampler::finish`] writes one sample per line (hex
//! addresses, leaf first) and the process's memory map after them, for
//! `scripts/profile_symbols.py` to name on the build machine.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Frames kept per sample.
const DEPTH: usize = 24;
/// Samples kept (later ones are dropped and counted).
const CAPACITY: usize = 1 << 17;

static mut SAMPLES: [[usize; DEPTH]; CAPACITY] = [[0; DEPTH]; CAPACITY];
static NEXT: AtomicUsize = AtomicUsize::new(0);
static STACK_LO: AtomicUsize = AtomicUsize::new(0);
static STACK_HI: AtomicUsize = AtomicUsize::new(0);

/// A running profile of the calling thread; dropped without
/// [`Sampler::finish`], it stops sampling and writes nothing.
#[derive(Debug)]
pub(crate) struct Sampler {
    timer: libc::timer_t,
    stopped: bool,
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop();
    }
}

extern "C" fn on_sigprof(_: libc::c_int, _: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let i = NEXT.fetch_add(1, Ordering::Relaxed);
    if i >= CAPACITY || ctx.is_null() {
        return;
    }
    let (lo, hi) = (
        STACK_LO.load(Ordering::Relaxed),
        STACK_HI.load(Ordering::Relaxed),
    );
    // SAFETY: the kernel passes the interrupted context; `SAMPLES[i]` is
    // written by this handler alone (one index per signal) and read only
    // after the timer is deleted; frame addresses are read only when they
    // lie in the thread's stack, 8-byte aligned, and rise with each frame.
    unsafe {
        let uc = &*(ctx as *const libc::ucontext_t);
        let row = &mut *std::ptr::addr_of_mut!(SAMPLES[i]);
        row[0] = uc.uc_mcontext.gregs[libc::REG_RIP as usize] as usize;
        let mut fp = uc.uc_mcontext.gregs[libc::REG_RBP as usize] as usize;
        for slot in row.iter_mut().skip(1) {
            // (`hi - 16` and not `fp + 16`: a garbage frame pointer near
            // the top of the address space must not wrap around.)
            if fp < lo || fp > hi.saturating_sub(16) || !fp.is_multiple_of(8) {
                break;
            }
            let ret = std::ptr::read_volatile((fp + 8) as *const usize);
            let next = std::ptr::read_volatile(fp as *const usize);
            *slot = ret;
            if next <= fp {
                break;
            }
            fp = next;
        }
    }
}

impl Sampler {
    /// Deletes the timer and ignores `SIGPROF` from here on, once: after
    /// it no handler writes `SAMPLES` (a signal already raised is
    /// delivered before `timer_delete` returns or not at all).
    fn stop(&mut self) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        // SAFETY: deleting our own timer, and a plain `signal` call.
        unsafe {
            libc::timer_delete(self.timer);
            libc::signal(libc::SIGPROF, libc::SIG_IGN);
        }
    }

    /// Starts sampling the calling thread every `period` of its CPU time.
    pub(crate) fn start(period: Duration) -> std::io::Result<Sampler> {
        let err = std::io::Error::last_os_error;
        // SAFETY: plain libc calls on zero-initialized C structs; the
        // handler is async-signal-safe (atomics and stores to its own row).
        unsafe {
            let mut attr: libc::pthread_attr_t = std::mem::zeroed();
            if libc::pthread_getattr_np(libc::pthread_self(), &mut attr) != 0 {
                return Err(err());
            }
            let (mut addr, mut size) = (std::ptr::null_mut(), 0usize);
            libc::pthread_attr_getstack(&attr, &mut addr, &mut size);
            libc::pthread_attr_destroy(&mut attr);
            STACK_LO.store(addr as usize, Ordering::Relaxed);
            STACK_HI.store(addr as usize + size, Ordering::Relaxed);

            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigprof as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
            if libc::sigaction(libc::SIGPROF, &sa, std::ptr::null_mut()) != 0 {
                return Err(err());
            }
            let mut ev: libc::sigevent = std::mem::zeroed();
            ev.sigev_notify = libc::SIGEV_THREAD_ID;
            ev.sigev_signo = libc::SIGPROF;
            ev.sigev_notify_thread_id = libc::gettid();
            let mut timer: libc::timer_t = std::mem::zeroed();
            if libc::timer_create(libc::CLOCK_THREAD_CPUTIME_ID, &mut ev, &mut timer) != 0 {
                return Err(err());
            }
            let ts = libc::timespec {
                tv_sec: period.as_secs() as libc::time_t,
                tv_nsec: libc::c_long::from(period.subsec_nanos() as i32),
            };
            let spec = libc::itimerspec {
                it_interval: ts,
                it_value: ts,
            };
            if libc::timer_settime(timer, 0, &spec, std::ptr::null_mut()) != 0 {
                return Err(err());
            }
            Ok(Sampler {
                timer,
                stopped: false,
            })
        }
    }

    /// Stops sampling and writes the samples and the memory map to `path`;
    /// returns (samples kept, samples dropped).
    pub(crate) fn finish(mut self, path: &str) -> std::io::Result<(usize, usize)> {
        use std::io::Write;
        self.stop();
        let taken = NEXT.load(Ordering::Relaxed);
        let kept = taken.min(CAPACITY);
        let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
        // SAFETY: no handler runs any more (above).
        let samples = unsafe { &*std::ptr::addr_of!(SAMPLES) };
        for row in samples.iter().take(kept) {
            let frames: Vec<String> = row
                .iter()
                .take_while(|a| **a != 0)
                .map(|a| format!("{a:x}"))
                .collect();
            writeln!(out, "{}", frames.join(" "))?;
        }
        writeln!(out, "# maps")?;
        out.write_all(&std::fs::read("/proc/self/maps")?)?;
        out.flush()?;
        Ok((kept, taken - kept))
    }
}
