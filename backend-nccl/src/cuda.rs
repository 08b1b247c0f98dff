//! The few CUDA driver calls duplex makes, through `cudarc`'s driver API
//! with dynamic loading: devices, streams, events and device memory. Each
//! wrapper owns its handle and releases it in `Drop` without panicking;
//! every failure is a [`duplex::Error`] naming the call.

use std::ffi::c_void;
use std::sync::OnceLock;

use cudarc::driver::{result, sys};
use duplex::Error;

/// A CUDA error as a duplex error.
fn err(call: &str, e: result::DriverError) -> Error {
    Error::Library {
        library: "CUDA",
        call: call.to_string(),
        code: e.0 as i32,
        text: error_text(e),
    }
}

/// A raw driver result as a duplex error naming `call`.
pub fn check(call: &str, r: sys::CUresult) -> Result<(), Error> {
    r.result().map_err(|e| err(call, e))
}

/// Every CUDA driver function duplex-nccl calls, directly (`sys::`) or
/// through cudarc's `result::` wrappers, by the symbol cudarc loads (with
/// the `cuda-12080` bindings): [`init`] looks each up before the first
/// call. The test `every_driver_function_called_is_looked_up_first` keeps
/// it complete.
pub const DRIVER: &[&str] = &[
    "cuInit",
    "cuDeviceGetCount",
    "cuGetErrorString",
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxEnablePeerAccess",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuStreamQuery",
    "cuStreamWriteValue32_v2",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventElapsedTime",
    "cuEventQuery",
    "cuEventRecord",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetInfo_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyPeerAsync",
    "cuMemsetD8Async",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostGetDevicePointer_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuIpcGetEventHandle",
    "cuIpcGetMemHandle",
    "cuIpcOpenEventHandle",
    "cuIpcOpenMemHandle_v2",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuLaunchKernel",
];

/// Loads the driver and initializes it, once; returns the number of devices.
pub fn init() -> Result<usize, Error> {
    static INIT: OnceLock<Result<usize, Error>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only probes for the library; loads nothing else.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::Unavailable {
                what: "the CUDA driver (libcuda.so.1)".into(),
                how: "no NVIDIA driver library was found: run on a machine with an NVIDIA GPU and driver, or add the driver's folder to LD_LIBRARY_PATH".into(),
            });
        }
        // cudarc resolves each driver function at its first call and
        // panics when the library lacks it (a stub `libcuda.so.1`, or a
        // driver older than a function duplex calls): every function duplex
        // calls is looked up here first ([`DRIVER`]), so that such a
        // library is said to be unusable, not a panic later.
        // SAFETY: opens the library cudarc uses (as it would) and looks up
        // symbols without calling them.
        let lib = unsafe { sys::culib() };
        // SAFETY: only the symbols' addresses are taken, never called here.
        if let Some(missing) = DRIVER
            .iter()
            .find(|f| unsafe { lib.get::<*const c_void>(f.as_bytes()) }.is_err())
        {
            return Err(Error::Unavailable {
                what: "a usable CUDA driver (libcuda.so.1)".into(),
                how: format!(
                    "the libcuda.so.1 found lacks `{missing}`, so it is not an NVIDIA driver's library (a CUDA toolkit's stub, or a driver too old): put the driver's own library first on LD_LIBRARY_PATH, or run on a machine with an NVIDIA GPU and driver"
                ),
            });
        }
        result::init().map_err(|e| match e.0 {
            // No GPU visible, the toolkit's stub library, a driver that
            // does not match its kernel module or is not ready: nothing to
            // run on here, said as such (exit status 4 from the CLI).
            sys::CUresult::CUDA_ERROR_NO_DEVICE => Error::Unavailable {
                what: "a GPU".into(),
                how: format!(
                    "the CUDA driver sees none ({}): check that CUDA_VISIBLE_DEVICES (now {}) names this machine's GPUs, and that `nvidia-smi` lists them",
                    error_text(e),
                    std::env::var("CUDA_VISIBLE_DEVICES")
                        .map(|v| format!("`{v}`"))
                        .unwrap_or_else(|_| "unset".into())
                ),
            },
            sys::CUresult::CUDA_ERROR_STUB_LIBRARY
            | sys::CUresult::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH
            | sys::CUresult::CUDA_ERROR_SYSTEM_NOT_READY => {
                Error::Unavailable {
                    what: "a usable CUDA driver (libcuda.so.1)".into(),
                    how: format!(
                        "cuInit says: {}: put the NVIDIA driver's own libcuda.so.1 first on LD_LIBRARY_PATH (not a CUDA toolkit's stub), or update the driver",
                        error_text(e)
                    ),
                }
            }
            _ => err("cuInit", e),
        })?;
        let n = result::device::get_count().map_err(|e| err("cuDeviceGetCount", e))?;
        Ok(n.max(0) as usize)
    })
    .clone()
}

/// A CUDA error's text (its number where the driver has none).
fn error_text(e: result::DriverError) -> String {
    e.error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0))
}

/// A device's primary context.
#[derive(Debug)]
pub struct Device {
    ordinal: i32,
    ctx: sys::CUcontext,
}

// SAFETY: a CUDA context handle may be used from any thread once made current there.
unsafe impl Send for Device {}
// SAFETY: as above; the driver synchronizes access to the context.
unsafe impl Sync for Device {}

impl Device {
    /// Retains device `ordinal`'s primary context and makes it current on
    /// this thread.
    pub fn new(ordinal: i32) -> Result<Device, Error> {
        let n = init()?;
        if ordinal < 0 || ordinal as usize >= n {
            return Err(Error::Unavailable {
                what: format!("GPU {ordinal}"),
                how: format!(
                    "this machine has {n} GPU(s); ask for fewer ranks or run where there are more"
                ),
            });
        }
        let dev = result::device::get(ordinal).map_err(|e| err("cuDeviceGet", e))?;
        // SAFETY: `dev` is a valid device handle.
        let ctx = unsafe { result::primary_ctx::retain(dev) }
            .map_err(|e| err("cuDevicePrimaryCtxRetain", e))?;
        CONTEXTS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(ctx as usize)
            .or_default()
            .devices += 1;
        let d = Device { ordinal, ctx };
        d.bind()?;
        Ok(d)
    }

    /// The device number.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Makes this device's context current on the calling thread (a
    /// no-op when it already is: reading the current context is cheaper
    /// than setting it, and this runs before every op).
    pub fn bind(&self) -> Result<(), Error> {
        if matches!(result::ctx::get_current(), Ok(Some(c)) if c == self.ctx) {
            return Ok(());
        }
        // SAFETY: the context is retained for the life of `self`.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(|e| err("cuCtxSetCurrent", e))
    }

    /// Makes this device's context current until the guard is dropped,
    /// which makes the previous one current again.
    pub fn bind_scoped(&self) -> Result<Bound, Error> {
        let current = result::ctx::get_current().map_err(|e| err("cuCtxGetCurrent", e))?;
        if current == Some(self.ctx) {
            return Ok(Bound { previous: None });
        }
        // SAFETY: the context is retained for the life of `self`.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(|e| err("cuCtxSetCurrent", e))?;
        Ok(Bound { previous: current })
    }

    /// Lets this device's context reach `peer`'s memory directly (peer
    /// access); already enabled is fine.
    pub fn enable_peer(&self, peer: &Device) -> Result<(), Error> {
        let _bound = self.bind_scoped()?;
        // SAFETY: both contexts are retained.
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer.ctx, 0) };
        if r == sys::cudaError_enum::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Ok(());
        }
        check("cuCtxEnablePeerAccess", r)
    }

    /// Free and total device memory, in bytes.
    pub fn memory(&self) -> Result<(usize, usize), Error> {
        self.bind()?;
        result::mem_get_info().map_err(|e| err("cuMemGetInfo", e))
    }
}

/// The kernel a copy-engine lane's op waits on its flag with: one thread
/// polls the flag (volatile loads of host memory mapped into the device,
/// a short sleep between) until it holds at least `value`, compared
/// cyclically as `CU_STREAM_WAIT_VALUE_GEQ` does. A kernel, not
/// `cuStreamWaitValue32`: a stream-wait is done by the front end of the
/// hardware queue the stream is mapped to (CUDA maps streams onto
/// `CUDA_DEVICE_MAX_CONNECTIONS` queues, 8 by default), which then stops
/// every stream that shares the queue, so a rank's recv waiting on its
/// flag could hold back its own send's ready event, which its peer's copy
/// waits for. Measured on one H200, two processes
/// (`process:seed-rpc/copy` with `CUDA_DEVICE_MAX_CONNECTIONS=1`): hung 3
/// times in 3 with stream-waits, passed 3 in 3 with this kernel. A
/// launched kernel holds its queue no longer than its launch, as an NCCL
/// kernel does. What it costs: a 4 KiB message on a lane of one GPU took
/// 21.7 µs, against 10.8–14.5 in earlier stream-wait runs on other machines
/// (`docs/gpu/copylane-1gpu.txt`), and a waiting op
/// holds one thread of one SM.
const WAIT_PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64
.visible .entry duplex_wait_flag(.param .u64 flag, .param .u32 value)
{
  .reg .u64 %rd<3>;
  .reg .u32 %r<4>;
  .reg .pred %p;
  ld.param.u64 %rd1, [flag];
  ld.param.u32 %r1, [value];
LOOP:
  ld.volatile.u32 %r2, [%rd1];
  sub.u32 %r3, %r2, %r1;
  setp.ge.s32 %p, %r3, 0;
  @%p bra DONE;
  nanosleep.u32 200;
  bra LOOP;
DONE:
  fence.sc.sys;
  ret;
}
"#;

/// The flag-wait kernel of the current context, loaded on first use.
/// Copy-engine lanes load it at setup ([`wait_kernel`] in their makers):
/// loading a module is one more driver call that had better not run
/// while a stream of the process waits on a lane.
pub fn wait_kernel() -> Result<sys::CUfunction, Error> {
    let ctx = result::ctx::get_current()
        .map_err(|e| err("cuCtxGetCurrent", e))?
        .ok_or_else(|| Error::Aborted("no CUDA context is current".into()))?;
    let mut all = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
    let kept = all.get_mut(&(ctx as usize));
    if let Some(f) = kept.as_ref().and_then(|c| c.kernel) {
        return Ok(f as sys::CUfunction);
    }
    let ptx = std::ffi::CString::new(WAIT_PTX)
        .map_err(|_| Error::Aborted("the flag-wait kernel has a NUL".into()))?;
    // SAFETY: a NUL-terminated PTX image, JIT-compiled for the current
    // context's device; the module is never unloaded.
    let module = unsafe { result::module::load_data(ptx.as_ptr() as *const _) }
        .map_err(|e| err("cuModuleLoadData", e))?;
    let name = std::ffi::CString::new("duplex_wait_flag")
        .map_err(|_| Error::Aborted("bad kernel name".into()))?;
    // SAFETY: the module is live.
    let f = unsafe { result::module::get_function(module, name) }
        .map_err(|e| err("cuModuleGetFunction", e))?;
    if let Some(c) = kept {
        c.kernel = Some(f as usize);
    }
    Ok(f)
}

/// Makes `stream` (of the current context) wait until the 32-bit word at
/// device address `flag` holds at least `value` (cyclically), with the
/// flag-wait kernel (`WAIT_PTX`, whose comment says why a kernel), loaded
/// once per context.
pub fn wait_flag(stream: &Stream, flag: u64, value: u32) -> Result<(), Error> {
    let f = wait_kernel()?;
    let (mut flag, mut value) = (flag, value);
    let mut params = [
        &mut flag as *mut u64 as *mut c_void,
        &mut value as *mut u32 as *mut c_void,
    ];
    // SAFETY: one block of one thread; the parameters are as the kernel
    // declares them, and the flag is mapped memory that outlives the wait
    // (a lane's flags are freed only when nothing waits on them, or never).
    unsafe { result::launch_kernel(f, (1, 1, 1), (1, 1, 1), 0, stream.raw, &mut params) }
        .map_err(|e| err("cuLaunchKernel", e))
}

/// The context that was current before [`Device::bind_scoped`].
#[derive(Debug)]
pub struct Bound {
    previous: Option<sys::CUcontext>,
}

impl Drop for Bound {
    fn drop(&mut self) {
        if let Some(c) = self.previous {
            // SAFETY: the context was current on this thread a moment ago;
            // whoever made it current keeps it alive.
            let _ = unsafe { result::ctx::set_current(c) };
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // What duplex kept for the context goes with its last Device,
        // while the context is still retained (`PerContext`).
        let kept = {
            let mut all = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
            let last = all.get_mut(&(self.ctx as usize)).is_some_and(|c| {
                c.devices = c.devices.saturating_sub(1);
                c.devices == 0
            });
            if last {
                all.remove(&(self.ctx as usize))
            } else {
                None
            }
        };
        drop(kept);
        if let Ok(dev) = result::device::get(self.ordinal) {
            // SAFETY: releases the retain taken in `new`.
            let _ = unsafe { result::primary_ctx::release(dev) };
        }
    }
}

/// A non-blocking stream.
#[derive(Debug)]
pub struct Stream {
    raw: sys::CUstream,
}

// SAFETY: stream handles are usable from any thread of the process.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    /// A new stream on the current context, not synchronizing with the
    /// legacy default stream.
    pub fn new() -> Result<Stream, Error> {
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| err("cuStreamCreate", e))?;
        Ok(Stream { raw })
    }

    /// The raw handle (NCCL's `cudaStream_t`).
    pub fn raw(&self) -> *mut c_void {
        self.raw as *mut c_void
    }

    /// Blocks the calling thread until the stream's work is done (tools
    /// and tests only: the transport never blocks without a deadline).
    pub fn synchronize(&self) -> Result<(), Error> {
        // SAFETY: the stream is live.
        unsafe { result::stream::synchronize(self.raw) }.map_err(|e| err("cuStreamSynchronize", e))
    }

    /// Makes the stream wait for `event` (R9).
    pub fn wait(&self, event: &Event) -> Result<(), Error> {
        // SAFETY: both handles are live.
        unsafe {
            result::stream::wait_event(
                self.raw,
                event.raw,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| err("cuStreamWaitEvent", e))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: the stream is live; work still queued completes first.
        let _ = unsafe { result::stream::destroy(self.raw) };
    }
}

/// Enqueues on `stream` (of `src`'s context) a copy of `bytes` from `src_ptr` on
/// device `src` to `dst_ptr` on device `dst` (`cuMemcpyPeerAsync`; the same
/// device is allowed).
///
/// # Safety
///
/// Both addresses must hold `bytes` bytes that stay allocated until the
/// copy has run.
pub unsafe fn copy_peer(
    dst: &Device,
    dst_ptr: u64,
    src: &Device,
    src_ptr: u64,
    bytes: usize,
    stream: &Stream,
) -> Result<(), Error> {
    // SAFETY: the caller's promise; the contexts are retained by the
    // devices and the stream is live.
    check("cuMemcpyPeerAsync", unsafe {
        sys::cuMemcpyPeerAsync(dst_ptr, dst.ctx, src_ptr, src.ctx, bytes, stream.raw)
    })
}

/// The completion events of one stream ([`crate::fence::Marks`]): events
/// made on its device and recorded on it.
#[derive(Debug)]
pub struct StreamMarks {
    raw: sys::CUstream,
    device: std::sync::Arc<Device>,
}

// SAFETY: stream handles are usable from any thread of the process; the
// handle is used only while its stream lives (`crate::fence::Fences`
// records nothing after `close`, which the stream's owner calls before the
// stream is destroyed).
unsafe impl Send for StreamMarks {}
// SAFETY: as above.
unsafe impl Sync for StreamMarks {}

impl Stream {
    /// What records completion events on this stream, a stream of
    /// `device`. Its owner must close the fences made of it before the
    /// stream is destroyed.
    pub fn marks(&self, device: std::sync::Arc<Device>) -> StreamMarks {
        StreamMarks {
            raw: self.raw,
            device,
        }
    }
}

impl crate::fence::Marks for StreamMarks {
    type Mark = Event;

    fn make(&self) -> Result<Event, Error> {
        let _bound = self.device.bind_scoped()?;
        Event::new(false)
    }

    fn record(&self, m: &Event) -> Result<(), Error> {
        // From any thread of the process: the device's context current.
        let _bound = self.device.bind_scoped()?;
        // SAFETY: the event is live, and so is the stream (see above).
        unsafe { result::event::record(m.raw, self.raw) }.map_err(|e| err("cuEventRecord", e))
    }

    fn query(&self, m: &Event) -> Result<bool, Error> {
        m.done()
    }
}

/// An event without timing.
#[derive(Debug)]
pub struct Event {
    raw: sys::CUevent,
}

// SAFETY: event handles are usable from any thread of the process.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// A new event on the current context; `timing` enables elapsed times.
    pub fn new(timing: bool) -> Result<Event, Error> {
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        let raw = result::event::create(flags).map_err(|e| err("cuEventCreate", e))?;
        Ok(Event { raw })
    }

    /// Records the event on `stream`.
    pub fn record(&self, stream: &Stream) -> Result<(), Error> {
        // SAFETY: both handles are live.
        unsafe { result::event::record(self.raw, stream.raw) }.map_err(|e| err("cuEventRecord", e))
    }

    /// True once the work recorded before the event has completed.
    pub fn done(&self) -> Result<bool, Error> {
        // SAFETY: the event is live.
        match unsafe { result::event::query(self.raw) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(err("cuEventQuery", e)),
        }
    }

    /// A new interprocess event (no timing) on the current context, and
    /// the handle by which another process opens it
    /// ([`Event::open_interprocess`]).
    pub fn interprocess() -> Result<(Event, [u8; 64]), Error> {
        let flags = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // SAFETY: creates an event on the current context.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, flags)
        })?;
        let event = Event { raw };
        // SAFETY: an all-zero handle is a plain array of bytes.
        let mut h: sys::CUipcEventHandle = unsafe { std::mem::zeroed() };
        // SAFETY: the event is live and interprocess.
        check("cuIpcGetEventHandle", unsafe {
            sys::cuIpcGetEventHandle(&mut h, event.raw)
        })?;
        Ok((event, h.reserved.map(|c| c as u8)))
    }

    /// Opens another process's interprocess event on the current context.
    pub fn open_interprocess(handle: &[u8; 64]) -> Result<Event, Error> {
        // SAFETY: as above.
        let mut h: sys::CUipcEventHandle = unsafe { std::mem::zeroed() };
        h.reserved = handle.map(|b| b as std::ffi::c_char);
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // SAFETY: a handle from `cuIpcGetEventHandle` of a live event (a
        // stale one is refused by the driver).
        check("cuIpcOpenEventHandle", unsafe {
            sys::cuIpcOpenEventHandle(&mut raw, h)
        })?;
        Ok(Event { raw })
    }

    /// Milliseconds between `start` and this event (both recorded with timing).
    pub fn since(&self, start: &Event) -> Result<f32, Error> {
        // SAFETY: both events are live and have completed.
        unsafe { result::event::elapsed(start.raw, self.raw) }
            .map_err(|e| err("cuEventElapsedTime", e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the event is live.
        let _ = unsafe { result::event::destroy(self.raw) };
    }
}

/// One device allocation exported for CUDA IPC once, from which a rank's
/// buffers for copy-engine lanes across processes are carved
/// (`crate::copy::ipc`): its peers open it once, at setup, since an IPC
/// open while a stream of the process waits on a lane can stall. Never
/// freed (it lives as long as the process).
#[derive(Debug)]
pub struct Arena {
    base: u64,
    size: usize,
    handle: [u8; 64],
    /// Free ranges (address, bytes), by address.
    free: std::sync::Mutex<Vec<(u64, usize)>>,
}

/// Arena ranges start at multiples of this.
const ARENA_ALIGN: usize = 512;

impl Arena {
    /// An arena of `bytes` on the current context.
    pub fn new(bytes: usize) -> Result<Arena, Error> {
        // SAFETY: allocates on the current context; never freed.
        let base = unsafe { result::malloc_sync(bytes) }.map_err(|e| err("cuMemAlloc", e))?;
        // SAFETY: an all-zero handle is a plain array of bytes.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        // SAFETY: `base` is the start of a `cuMemAlloc` allocation.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut h, base)
        })?;
        Ok(Arena::over(base, bytes, h.reserved.map(|c| c as u8)))
    }

    /// The bookkeeping of an arena at `base` (tests give any address).
    pub fn over(base: u64, size: usize, handle: [u8; 64]) -> Arena {
        Arena {
            base,
            size,
            handle,
            free: std::sync::Mutex::new(vec![(base, size)]),
        }
    }

    /// Its IPC handle.
    pub fn handle(&self) -> [u8; 64] {
        self.handle
    }

    /// Its size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Where `ptr` is in the arena, if it is.
    pub fn offset(&self, ptr: u64) -> Option<u64> {
        (ptr >= self.base && ptr < self.base + self.size as u64).then(|| ptr - self.base)
    }

    /// A range of `bytes` (first fit), or `None` if none is free.
    pub fn take(&self, bytes: usize) -> Option<u64> {
        if bytes > self.size {
            return None;
        }
        let n = bytes.div_ceil(ARENA_ALIGN).checked_mul(ARENA_ALIGN)?;
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let i = free.iter().position(|(_, len)| *len >= n)?;
        let (at, len) = free[i];
        if len == n {
            free.remove(i);
        } else {
            free[i] = (at + n as u64, len - n);
        }
        Some(at)
    }

    /// Gives back the range of `bytes` at `ptr` (from [`Arena::take`]).
    pub fn give(&self, ptr: u64, bytes: usize) {
        let n = bytes.div_ceil(ARENA_ALIGN).saturating_mul(ARENA_ALIGN);
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let i = free.partition_point(|(at, _)| *at < ptr);
        debug_assert!(
            free.get(i).is_none_or(|(at, _)| ptr + n as u64 <= *at)
                && (i == 0 || free[i - 1].0 + free[i - 1].1 as u64 <= ptr),
            "a range given back twice or overlapping a free one"
        );
        free.insert(i, (ptr, n));
        // Merge with the next, then with the previous.
        if i + 1 < free.len() && free[i].0 + free[i].1 as u64 == free[i + 1].0 {
            free[i].1 += free[i + 1].1;
            free.remove(i + 1);
        }
        if i > 0 && free[i - 1].0 + free[i - 1].1 as u64 == free[i].0 {
            free[i - 1].1 += free[i].1;
            free.remove(i);
        }
    }

    /// Bytes free.
    pub fn free_bytes(&self) -> usize {
        let free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        free.iter().map(|(_, n)| n).sum()
    }
}

/// How long a buffer's zeroing may take before `alloc` gives up on it:
/// far longer than zeroing any buffer takes, so only a device that makes
/// no progress reaches it.
pub const ZEROING_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// What duplex keeps per CUDA context while a [`Device`] of it lives: the
/// flag-wait kernel ([`wait_kernel`]), loaded once, and the streams that
/// zero new buffers ([`zero`]), made once (a stream per allocation cost a
/// create and a destroy each). The last [`Device`] of a context to go
/// drops it before it releases the context: a release may destroy the
/// context, and a later retain may give one with the same handle, where
/// none of it would exist. A context with no [`Device`] keeps nothing.
#[derive(Default)]
struct PerContext {
    devices: usize,
    kernel: Option<usize>,
    zeroing: Vec<Stream>,
}

/// Each context's [`PerContext`], by its handle.
static CONTEXTS: std::sync::Mutex<std::collections::BTreeMap<usize, PerContext>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

/// Zeroes `n` bytes at `ptr` and waits for it, up to `within`: on a stream
/// of its own, since `cuMemsetD8` runs on the legacy stream, which duplex's
/// non-blocking streams do not wait for, so a recv issued at once could
/// have its bytes zeroed after it. An error says whether the zeroing may
/// still run, in which case the caller must not free the memory (P6 of
/// `crate::guard`).
/// A synchronous copy of `data` to device address `ptr`.
///
/// # Safety
/// `ptr` must hold at least `data.len()` bytes.
unsafe fn copy_to_device(ptr: u64, data: &[u8]) -> Result<(), Error> {
    // SAFETY: as the caller promised.
    unsafe { result::memcpy_htod_sync(ptr, data) }.map_err(|e| err("cuMemcpyHtoD", e))
}

/// A synchronous copy of `n` bytes at device address `ptr` to the host.
///
/// # Safety
/// `ptr` must hold at least `n` bytes.
unsafe fn copy_to_host(ptr: u64, n: usize) -> Result<Vec<u8>, Error> {
    let mut out = vec![0u8; n];
    // SAFETY: as the caller promised.
    unsafe { result::memcpy_dtoh_sync(&mut out, ptr) }.map_err(|e| err("cuMemcpyDtoH", e))?;
    Ok(out)
}

fn zero(ptr: sys::CUdeviceptr, n: usize, within: std::time::Duration) -> Result<(), (Error, bool)> {
    let ctx = result::ctx::get_current()
        .map_err(|e| (err("cuCtxGetCurrent", e), false))?
        .map_or(0, |c| c as usize);
    let pooled = CONTEXTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_mut(&ctx)
        .and_then(|c| c.zeroing.pop());
    let stream = match pooled {
        Some(s) => s,
        None => Stream::new().map_err(|e| (e, false))?,
    };
    // SAFETY: `ptr` points to `n` bytes of device memory of the current
    // context, ours; the stream is live.
    unsafe { result::memset_d8_async(ptr, 0, n, stream.raw) }
        .map_err(|e| (err("cuMemsetD8Async", e), false))?;
    let start = std::time::Instant::now();
    let mut polls = 0u32;
    loop {
        // SAFETY: the stream is live.
        match unsafe { sys::cuStreamQuery(stream.raw) } {
            sys::cudaError_enum::CUDA_SUCCESS => break,
            sys::cudaError_enum::CUDA_ERROR_NOT_READY => {}
            e => return Err((err("cuStreamQuery", result::DriverError(e)), true)),
        }
        if start.elapsed() >= within {
            // Still queued: the stream is never used or destroyed again.
            std::mem::forget(stream);
            return Err((
                Error::Aborted(format!(
                    "zeroing a new buffer of {n} bytes did not finish within {within:?}: the GPU is not making progress (a kernel that never ends, or streams sharing a CUDA hardware queue: HQ in docs/semantics.md); the memory is kept, not freed"
                )),
                true,
            ));
        }
        // Yield while it is likely a moment away, then sleep, longer and
        // longer, to 1 ms.
        polls += 1;
        if polls < 1000 {
            std::thread::yield_now();
        } else {
            let step = 50u64 << (polls - 1000).min(5);
            std::thread::sleep(std::time::Duration::from_micros(step.min(1000)));
        }
    }
    let mut all = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = all.get_mut(&ctx)
        && c.zeroing.len() < 64
    {
        c.zeroing.push(stream);
    }
    Ok(())
}

/// How long a copy between the host and a buffer may take before `read`
/// or `write` gives up on it: as [`ZEROING_LIMIT`], far longer than any
/// copy takes, so only a device that makes no progress reaches it.
pub const HOST_COPY_LIMIT: std::time::Duration = ZEROING_LIMIT;

/// At most this many host-copy threads wait idle for the next copy.
const IDLE_COPIERS: usize = 4;

type Job = Box<dyn FnOnce() + Send>;

/// Idle host-copy threads, each by the sender of its jobs.
static COPIERS: std::sync::Mutex<Vec<std::sync::mpsc::Sender<Job>>> =
    std::sync::Mutex::new(Vec::new());

/// Runs `copy` (`what`: a synchronous copy between the host and the
/// device, which the driver may hold up without limit when the device
/// makes no progress, say a hardware queue stopped behind a stream wait:
/// HQ in `docs/semantics.md`) on a host-copy thread, and waits for it up to
/// `within`. A late copy's error says it may still run (`true`): its
/// thread stays with it, and the caller must keep the device memory for
/// good (P6). Threads that finish go back to a small pool.
pub(crate) fn bounded<T: Send + 'static>(
    within: std::time::Duration,
    what: &str,
    copy: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, (Error, bool)> {
    let (reply, answer) = std::sync::mpsc::sync_channel(1);
    let mut job: Job = Box::new(move || {
        let _ = reply.send(copy());
    });
    loop {
        let idle = COPIERS.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let tx = match idle {
            Some(tx) => tx,
            None => spawn_copier().map_err(|e| (e, false))?,
        };
        match tx.send(job) {
            Ok(()) => break,
            // That thread is gone: the job comes back, to another.
            Err(e) => job = e.0,
        }
    }
    match answer.recv_timeout(within) {
        Ok(r) => r.map_err(|e| (e, false)),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err((
            Error::Aborted(format!(
                "{what} did not finish within {within:?}: the GPU is not making progress (a kernel that never ends, or streams sharing a CUDA hardware queue: HQ in docs/semantics.md); the buffer's memory is kept, not freed"
            )),
            true,
        )),
        // The thread died in the copy (a panic): nothing says the copy
        // ended.
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err((
            Error::Aborted(format!("{what} ended without an answer")),
            true,
        )),
    }
}

/// A new host-copy thread: it runs the jobs it is sent and, after each,
/// goes back to [`COPIERS`] (or ends, when enough wait there).
fn spawn_copier() -> Result<std::sync::mpsc::Sender<Job>, Error> {
    let (tx, rx) = std::sync::mpsc::channel::<Job>();
    let mine = tx.clone();
    std::thread::Builder::new()
        .name("duplex host copy".into())
        .spawn(move || {
            while let Ok(job) = rx.recv() {
                job();
                let mut idle = COPIERS.lock().unwrap_or_else(|e| e.into_inner());
                if idle.len() >= IDLE_COPIERS {
                    return;
                }
                idle.push(mine.clone());
            }
        })
        .map_err(|e| Error::Aborted(format!("starting a host-copy thread: {e}")))?;
    Ok(tx)
}

/// Device memory on the current context.
#[derive(Debug)]
pub struct Memory {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    /// Part of an arena ([`Arena`]), given back to it instead of freed.
    arena: Option<std::sync::Arc<Arena>>,
}

// SAFETY: a device pointer is a plain address, valid in every thread.
unsafe impl Send for Memory {}
// SAFETY: as above.
unsafe impl Sync for Memory {}

impl Memory {
    /// `bytes` of zeroed device memory (at least one byte is allocated).
    pub fn zeroed(bytes: usize) -> Result<Memory, Error> {
        Memory::zeroed_within(bytes, ZEROING_LIMIT)
    }

    /// [`Memory::zeroed`], giving up (with an error, the memory kept) if
    /// the zeroing has not finished within `within`.
    pub fn zeroed_within(bytes: usize, within: std::time::Duration) -> Result<Memory, Error> {
        let n = bytes.max(1);
        // SAFETY: allocates on the current context.
        let ptr = unsafe { result::malloc_sync(n) }.map_err(|e| err("cuMemAlloc", e))?;
        // SAFETY: `ptr` points to `n` bytes just allocated.
        Memory {
            ptr,
            bytes,
            arena: None,
        }
        .zeroed_now(within)
    }

    /// This memory, just allocated, zeroed (waiting up to `within`); on an
    /// error it is kept rather than freed or given back if the zeroing may
    /// still write into it (P6).
    fn zeroed_now(self, within: std::time::Duration) -> Result<Memory, Error> {
        match zero(self.ptr, self.bytes.max(1), within) {
            Ok(()) => Ok(self),
            Err((e, running)) => {
                if running {
                    std::mem::forget(self);
                }
                Err(e)
            }
        }
    }

    /// `bytes` of zeroed device memory from `arena`, given back to it when
    /// dropped; an error when it has no room.
    pub fn zeroed_in(arena: &std::sync::Arc<Arena>, bytes: usize) -> Result<Memory, Error> {
        let n = bytes.max(1);
        let ptr = arena.take(n).ok_or_else(|| Error::Unavailable {
            what: format!("{n} bytes in the copy-lane arena ({} MiB)", arena.size >> 20),
            how: "buffers for copy-engine lanes across processes come from one arena per rank, opened by its peers at setup; set DUPLEX_IPC_ARENA_MIB larger".into(),
        })?;
        Memory {
            ptr,
            bytes,
            arena: Some(arena.clone()),
        }
        .zeroed_now(ZEROING_LIMIT)
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// [`Memory::write`] on a host-copy thread (`bounded`), waiting for
    /// it up to `within`. On an error that says the copy may still run
    /// (`true`), the caller must keep the memory for good (P6).
    pub fn write_within(
        &self,
        device: &std::sync::Arc<Device>,
        data: Vec<u8>,
        within: std::time::Duration,
    ) -> Result<(), (Error, bool)> {
        let (ptr, n) = (self.ptr, data.len().min(self.bytes));
        let device = device.clone();
        bounded(within, "a copy from the host to a buffer", move || {
            device.bind()?;
            // SAFETY: the destination holds at least `n` bytes, kept by
            // the caller until this returns, or for good if it is late.
            unsafe { copy_to_device(ptr, &data[..n]) }
        })
    }

    /// [`Memory::read`] on a host-copy thread (`bounded`), as
    /// [`Memory::write_within`].
    pub fn read_within(
        &self,
        device: &std::sync::Arc<Device>,
        within: std::time::Duration,
    ) -> Result<Vec<u8>, (Error, bool)> {
        let (ptr, n) = (self.ptr, self.bytes);
        let device = device.clone();
        bounded(within, "a copy from a buffer to the host", move || {
            device.bind()?;
            // SAFETY: the source holds `n` bytes, kept by the caller until
            // this returns, or for good if it is late.
            unsafe { copy_to_host(ptr, n) }
        })
    }

    /// Copies `data` (at most the allocation's size) to the device.
    pub fn write(&self, data: &[u8]) -> Result<(), Error> {
        let n = data.len().min(self.bytes);
        // SAFETY: the destination holds at least `n` bytes.
        unsafe { copy_to_device(self.ptr, &data[..n]) }
    }

    /// Copies the allocation to the host.
    pub fn read(&self) -> Result<Vec<u8>, Error> {
        // SAFETY: the source holds `self.bytes` bytes.
        unsafe { copy_to_host(self.ptr, self.bytes) }
    }

    /// Frees the memory now. Only when no device work uses it any more.
    pub fn free(mut self) -> Result<(), Error> {
        if self.arena.is_some() {
            // Given back by the drop.
            return Ok(());
        }
        let ptr = std::mem::replace(&mut self.ptr, 0);
        std::mem::forget(self);
        // SAFETY: `ptr` came from `malloc_sync` and is freed once.
        unsafe { result::free_sync(ptr) }.map_err(|e| err("cuMemFree", e))
    }

    /// Never frees the memory: for memory a stuck device op may still use.
    pub fn leak(self) {
        std::mem::forget(self);
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        if let Some(a) = &self.arena {
            a.give(self.ptr, self.bytes.max(1));
            return;
        }
        if self.ptr != 0 {
            // SAFETY: `ptr` came from `malloc_sync` and is freed once.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn a_host_copy_in_time_answers_with_its_result() {
        assert_eq!(
            bounded(Duration::from_secs(5), "a copy", || Ok(7)).unwrap(),
            7
        );
        let (e, running) = bounded::<()>(Duration::from_secs(5), "a copy", || {
            Err(Error::Aborted("refused".into()))
        })
        .unwrap_err();
        assert!(!running, "it ended");
        assert!(e.to_string().contains("refused"), "{e}");
    }

    #[test]
    fn a_late_host_copy_is_an_error_that_says_it_may_still_run() {
        let (release, held) = std::sync::mpsc::channel::<()>();
        let start = Instant::now();
        let (e, running) = bounded(
            Duration::from_millis(100),
            "a copy from a buffer to the host",
            move || {
                let _ = held.recv();
                Ok(())
            },
        )
        .unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(running, "the copy may still run: its memory must be kept");
        let text = e.to_string();
        assert!(
            text.contains("a copy from a buffer to the host did not finish within 100ms"),
            "{text}"
        );
        assert!(text.contains("kept, not freed"), "{text}");
        // The stuck copy holds its own thread; others still run.
        assert_eq!(
            bounded(Duration::from_secs(5), "a copy", || Ok(1)).unwrap(),
            1
        );
        release.send(()).unwrap();
    }

    /// Every driver function the crate's sources call, directly
    /// (`sys::cuX`) or through cudarc's `result::` wrappers (each mapped to
    /// the symbols it loads, read in cudarc 0.19's `driver/result.rs`), is
    /// in [`DRIVER`], so that [`init`] refuses a driver that lacks one
    /// instead of cudarc panicking at its first call. A wrapper not in the
    /// map fails the test: read what it loads in cudarc and add it.
    #[test]
    fn every_driver_function_called_is_looked_up_first() {
        const WRAPPERS: &[(&str, &[&str])] = &[
            ("ctx::get_current", &["cuCtxGetCurrent"]),
            ("ctx::set_current", &["cuCtxSetCurrent"]),
            ("device::get", &["cuDeviceGet"]),
            ("device::get_count", &["cuDeviceGetCount"]),
            ("event::create", &["cuEventCreate"]),
            ("event::destroy", &["cuEventDestroy_v2"]),
            ("event::elapsed", &["cuEventElapsedTime"]),
            ("event::query", &["cuEventQuery"]),
            ("event::record", &["cuEventRecord"]),
            ("free_sync", &["cuMemFree_v2"]),
            ("init", &["cuInit"]),
            ("launch_kernel", &["cuLaunchKernel"]),
            ("malloc_sync", &["cuMemAlloc_v2"]),
            ("mem_get_info", &["cuMemGetInfo_v2"]),
            ("memcpy_dtoh_sync", &["cuMemcpyDtoH_v2"]),
            ("memcpy_htod_sync", &["cuMemcpyHtoD_v2"]),
            ("memset_d8_async", &["cuMemsetD8Async"]),
            ("module::get_function", &["cuModuleGetFunction"]),
            ("module::load_data", &["cuModuleLoadData"]),
            ("primary_ctx::release", &["cuDevicePrimaryCtxRelease_v2"]),
            ("primary_ctx::retain", &["cuDevicePrimaryCtxRetain"]),
            ("stream::create", &["cuStreamCreate"]),
            ("stream::destroy", &["cuStreamDestroy_v2"]),
            ("stream::synchronize", &["cuStreamSynchronize"]),
            ("stream::wait_event", &["cuStreamWaitEvent"]),
        ];
        fn sources(dir: &std::path::Path, out: &mut Vec<(String, String)>) {
            for e in std::fs::read_dir(dir).expect("readable").flatten() {
                let p = e.path();
                if p.is_dir() {
                    sources(&p, out);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    let text = std::fs::read_to_string(&p).expect("readable");
                    out.push((p.display().to_string(), text));
                }
            }
        }
        let mut files = Vec::new();
        sources(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
            &mut files,
        );
        assert!(files.len() > 10, "the sources were not found");
        // The path (with `::`) that follows each `prefix` and is called:
        // an opening parenthesis right after it.
        let after = |text: &str, prefix: &str| -> Vec<String> {
            text.match_indices(prefix)
                .filter(|(i, _)| {
                    !text[..*i]
                        .chars()
                        .next_back()
                        .is_some_and(|c| c.is_alphanumeric() || c == '_')
                })
                .filter_map(|(i, _)| {
                    let rest = &text[i + prefix.len()..];
                    let name: String = rest
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                        .collect();
                    rest[name.len()..].starts_with('(').then_some(name)
                })
                .collect()
        };
        let (mut direct, mut wrapped) = (0, 0);
        for (path, text) in &files {
            for name in after(text, "sys::cu") {
                let symbol = format!("cu{name}");
                // The library handle, not a driver function.
                if symbol == "culib" {
                    continue;
                }
                direct += 1;
                assert!(
                    DRIVER.contains(&symbol.as_str()),
                    "{path} calls sys::{symbol}, which DRIVER does not list"
                );
            }
            for name in after(text, "result::") {
                // A type's constructor (`result::DriverError(..)`).
                if name.starts_with(char::is_uppercase) {
                    continue;
                }
                let Some((_, symbols)) = WRAPPERS.iter().find(|(w, _)| *w == name) else {
                    panic!("{path} calls result::{name}: add what it loads to WRAPPERS and DRIVER");
                };
                wrapped += 1;
                for s in *symbols {
                    assert!(
                        DRIVER.contains(s),
                        "{path} calls result::{name}, which loads {s}, not in DRIVER"
                    );
                }
            }
        }
        assert!(
            direct > 10 && wrapped > 20,
            "{direct} direct, {wrapped} wrapped calls found"
        );
    }

    #[test]
    fn a_host_copy_that_panics_is_an_error_not_a_hang() {
        let (e, running) =
            bounded::<()>(Duration::from_secs(5), "a copy", || panic!("on purpose")).unwrap_err();
        assert!(running, "nothing says the copy ended");
        assert!(e.to_string().contains("ended without an answer"), "{e}");
        assert_eq!(
            bounded(Duration::from_secs(5), "a copy", || Ok(2)).unwrap(),
            2
        );
    }
}
