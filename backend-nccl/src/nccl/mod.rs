//! NCCL, opened at run time: the library search ([`candidates`], [`nccl`]), the loaded
//! function table ([`Nccl`]), and one thin function per call that turns
//! `ncclResult_t` into [`duplex::Error`] with NCCL's own text.

pub mod sys;

use std::ffi::{CStr, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use duplex::Error;

use crate::guard::CommApi;
use sys::{ncclComm_t, ncclConfig_t, ncclResult_t, ncclUniqueId};

/// The environment variable that names the NCCL library to use.
pub const LIBRARY_VAR: &str = "DUPLEX_NCCL_LIBRARY";

/// The oldest NCCL duplex supports (`ncclCommSplit` and config version 2.18).
pub const MIN_VERSION: c_int = 21800;

/// The loaded library and the functions duplex calls.
pub struct Nccl {
    _lib: libloading::Library,
    /// Where it was loaded from.
    pub path: String,
    /// `ncclGetVersion`'s code, e.g. 22803.
    pub version: c_int,
    get_unique_id: sys::ncclGetUniqueId,
    init_rank_config: sys::ncclCommInitRankConfig,
    split: sys::ncclCommSplit,
    destroy: sys::ncclCommOp,
    abort: sys::ncclCommOp,
    get_async_error: sys::ncclCommGetAsyncError,
    get_error_string: sys::ncclGetErrorString,
    get_last_error: Option<sys::ncclGetLastError>,
    group_start: sys::ncclGroupOp,
    group_end: sys::ncclGroupOp,
    send: sys::ncclSend,
    recv: sys::ncclRecv,
    mem_stats: Option<sys::ncclCommMemStats>,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

/// The library, opened once per process.
pub fn nccl() -> Result<&'static Nccl, Error> {
    static NCCL: OnceLock<Result<Nccl, Error>> = OnceLock::new();
    NCCL.get_or_init(load).as_ref().map_err(Clone::clone)
}

/// Where to look, in order: `$DUPLEX_NCCL_LIBRARY` alone when it is set;
/// else `libnccl.so.2`, `libnccl.so` (the dynamic linker's search path), then
/// the `nvidia/nccl/lib` folder of Python wheels in the usual site-packages
/// folders and in those of `python3` on the `PATH`.
pub fn candidates() -> Vec<PathBuf> {
    if let Some(p) = library_var() {
        return vec![PathBuf::from(p)];
    }
    let mut out = vec![PathBuf::from("libnccl.so.2"), PathBuf::from("libnccl.so")];
    for dir in wheel_dirs() {
        for name in ["libnccl.so.2", "libnccl.so"] {
            let p = dir.join(name);
            if p.exists() && !out.contains(&p) {
                out.push(p);
            }
        }
    }
    out
}

/// `$DUPLEX_NCCL_LIBRARY`, unless it is unset or empty (`VAR= cmd` unsets
/// it, as for the dynamic linker's own variables).
fn library_var() -> Option<std::ffi::OsString> {
    std::env::var_os(LIBRARY_VAR).filter(|v| !v.is_empty())
}

/// A loader's error with the reason the system gave: libloading's own
/// text is only "dlopen failed" or "dlsym failed", and the dynamic
/// linker's (`invalid ELF header`, a missing dependency such as
/// `libcudart.so.12`, `No such file or directory`) is its source.
pub(crate) fn dl_error(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(why) => format!("{e}: {why}"),
        None => e.to_string(),
    }
}

/// `nvidia/nccl/lib` folders of Python wheels.
fn wheel_dirs() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    let mut add_glob = |base: &Path| {
        // base/lib/python3.*/{site,dist}-packages
        let Ok(entries) = std::fs::read_dir(base.join("lib")) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            if name.to_string_lossy().starts_with("python3") {
                for sp in ["site-packages", "dist-packages"] {
                    roots.push(e.path().join(sp));
                }
            }
        }
    };
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        add_glob(Path::new(&v));
    }
    if let Some(v) = std::env::var_os("CONDA_PREFIX") {
        add_glob(Path::new(&v));
    }
    if let Some(h) = std::env::var_os("HOME") {
        add_glob(&Path::new(&h).join(".local"));
    }
    add_glob(Path::new("/usr/local"));
    add_glob(Path::new("/usr"));
    // The site-packages of `python3` on the PATH, asked without importing anything.
    if let Ok(out) = std::process::Command::new(
        std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()),
    )
    .args([
        "-c",
        "import site,sys; print('\\n'.join(site.getsitepackages()+[p for p in sys.path if p]))",
    ])
    .stderr(std::process::Stdio::null())
    .output()
        && out.status.success()
    {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            roots.push(PathBuf::from(line.trim()));
        }
    }
    let mut dirs = Vec::new();
    for r in roots {
        let d = r.join("nvidia").join("nccl").join("lib");
        if d.is_dir() && !dirs.contains(&d) {
            dirs.push(d);
        }
    }
    dirs
}

fn load() -> Result<Nccl, Error> {
    let mut tried = Vec::new();
    for path in candidates() {
        // SAFETY: loading a shared library runs its initialisers; NCCL's are
        // safe to run in any process.
        match unsafe { libloading::Library::new(&path) } {
            Ok(lib) => return Nccl::from_library(lib, path.display().to_string()),
            Err(e) => tried.push(format!("{} ({})", path.display(), dl_error(&e))),
        }
    }
    let how = if library_var().is_some() {
        format!(
            "{LIBRARY_VAR} is set, and loading it failed: {}. Point {LIBRARY_VAR} at NCCL's libnccl.so.2, or unset it to search the usual places",
            tried.join("; ")
        )
    } else {
        format!(
            "tried {}. Install NCCL (Debian/Ubuntu: libnccl2; or `pip install nvidia-nccl-cu12`), or point {LIBRARY_VAR} at libnccl.so.2",
            tried.join("; ")
        )
    };
    Err(Error::Unavailable {
        what: "the NCCL library".into(),
        how,
    })
}

macro_rules! symbol {
    ($lib:expr, $path:expr, $name:literal) => {{
        // SAFETY: the type is the one `nccl.h` declares for this symbol.
        match unsafe { $lib.get::<_>(concat!($name, "\0").as_bytes()) } {
            Ok(s) => *s,
            Err(e) => {
                return Err(Error::Unavailable {
                    what: format!("NCCL's {}", $name),
                    how: format!(
                        "{} does not export it ({}): it is not NCCL's libnccl.so.2, or an NCCL older than 2.18, which duplex needs; point {} at NCCL 2.18 or later",
                        $path,
                        $crate::nccl::dl_error(&e),
                        $crate::nccl::LIBRARY_VAR
                    ),
                });
            }
        }
    }};
}

impl Nccl {
    fn from_library(lib: libloading::Library, path: String) -> Result<Nccl, Error> {
        let get_version: sys::ncclGetVersion = symbol!(lib, path, "ncclGetVersion");
        let mut version: c_int = 0;
        // SAFETY: `ncclGetVersion` writes one int.
        let r = unsafe { get_version(&mut version) };
        if r != sys::NCCL_SUCCESS || version < MIN_VERSION {
            return Err(Error::Unavailable {
                what: format!("NCCL 2.18 or later (found version code {version} at {path})"),
                how: format!("install a newer NCCL or point {LIBRARY_VAR} at one"),
            });
        }
        // SAFETY (for each `get`): the types are those of `nccl.h`.
        let optional = |name: &[u8]| unsafe { lib.get::<*const c_void>(name).ok().map(|s| *s) };
        let get_last_error = optional(b"ncclGetLastError\0")
            // SAFETY: the symbol has this signature in every NCCL that exports it.
            .map(|p| unsafe { std::mem::transmute::<*const c_void, sys::ncclGetLastError>(p) });
        let mem_stats = optional(b"ncclCommMemStats\0")
            // SAFETY: as above.
            .map(|p| unsafe { std::mem::transmute::<*const c_void, sys::ncclCommMemStats>(p) });
        Ok(Nccl {
            get_unique_id: symbol!(lib, path, "ncclGetUniqueId"),
            init_rank_config: symbol!(lib, path, "ncclCommInitRankConfig"),
            split: symbol!(lib, path, "ncclCommSplit"),
            destroy: symbol!(lib, path, "ncclCommDestroy"),
            abort: symbol!(lib, path, "ncclCommAbort"),
            get_async_error: symbol!(lib, path, "ncclCommGetAsyncError"),
            get_error_string: symbol!(lib, path, "ncclGetErrorString"),
            group_start: symbol!(lib, path, "ncclGroupStart"),
            group_end: symbol!(lib, path, "ncclGroupEnd"),
            send: symbol!(lib, path, "ncclSend"),
            recv: symbol!(lib, path, "ncclRecv"),
            get_last_error,
            mem_stats,
            _lib: lib,
            path,
            version,
        })
    }

    /// `2.28.3` for version code 22803.
    pub fn version_string(&self) -> String {
        let v = self.version;
        format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
    }

    /// The error for result `r` of `call`, with NCCL's text and, when a
    /// communicator is known, its last error message.
    pub fn error(&self, call: &str, r: ncclResult_t, comm: Option<ncclComm_t>) -> Error {
        // SAFETY: ncclGetErrorString returns a static string for any code.
        let mut text = unsafe { cstr((self.get_error_string)(r)) };
        if let (Some(last), Some(c)) = (self.get_last_error, comm) {
            // SAFETY: the communicator is live (callers pass only live ones).
            let detail = unsafe { cstr(last(c)) };
            if !detail.is_empty() {
                text = format!("{text}: {detail}");
            }
        }
        Error::Library {
            library: "NCCL",
            call: call.to_string(),
            code: r,
            text,
        }
    }

    fn check(&self, call: &str, r: ncclResult_t, comm: Option<ncclComm_t>) -> Result<(), Error> {
        if r == sys::NCCL_SUCCESS || r == sys::NCCL_IN_PROGRESS {
            Ok(())
        } else {
            Err(self.error(call, r, comm))
        }
    }

    /// A config for a communicator of this library, blocking or not, with
    /// the given CTA bounds.
    pub fn config(
        &self,
        min_ctas: Option<i32>,
        max_ctas: Option<i32>,
        blocking: bool,
    ) -> ncclConfig_t {
        // `from_library` refused versions below MIN_VERSION, so `new` succeeds.
        let mut c = ncclConfig_t::new(self.version)
            .unwrap_or(ncclConfig_t::new(MIN_VERSION).expect("2.18 is supported"));
        c.blocking = i32::from(blocking);
        if let Some(n) = min_ctas {
            c.minCTAs = n;
        }
        if let Some(n) = max_ctas {
            c.maxCTAs = n;
        }
        c
    }

    /// `ncclGetUniqueId`.
    pub fn unique_id(&self) -> Result<ncclUniqueId, Error> {
        let mut id = ncclUniqueId {
            internal: [0; sys::NCCL_UNIQUE_ID_BYTES],
        };
        // SAFETY: writes one ncclUniqueId.
        let r = unsafe { (self.get_unique_id)(&mut id) };
        self.check("ncclGetUniqueId", r, None)?;
        Ok(id)
    }

    /// `ncclCommInitRankConfig`. On a non-blocking communicator NCCL writes
    /// `*slot` again when its asynchronous setup finishes.
    ///
    /// # Safety
    /// The calling thread's current CUDA context must be the rank's device,
    /// and `slot` must stay valid until the communicator is ready
    /// ([`Nccl::async_error`] returns `Ok(true)`).
    pub unsafe fn init_rank(
        &self,
        nranks: i32,
        id: ncclUniqueId,
        rank: i32,
        config: &mut ncclConfig_t,
        slot: *mut ncclComm_t,
    ) -> Result<(), Error> {
        // SAFETY: as documented.
        let r = unsafe { (self.init_rank_config)(slot, nranks, id, rank, config) };
        self.check("ncclCommInitRankConfig", r, None)
    }

    /// `ncclCommSplit`. On a non-blocking parent NCCL writes `*slot` (null
    /// for [`sys::NCCL_SPLIT_NOCOLOR`]) when the split's asynchronous job
    /// finishes, which the parent's readiness tells.
    ///
    /// # Safety
    /// `comm` must be a live, ready communicator, and `slot` must stay valid
    /// until the parent is ready again.
    pub unsafe fn split(
        &self,
        comm: ncclComm_t,
        color: i32,
        key: i32,
        config: &mut ncclConfig_t,
        slot: *mut ncclComm_t,
    ) -> Result<(), Error> {
        // SAFETY: as documented.
        let r = unsafe { (self.split)(comm, color, key, slot, config) };
        self.check("ncclCommSplit", r, Some(comm))
    }

    /// `ncclCommGetAsyncError`: `Ok(true)` when ready, `Ok(false)` while an
    /// operation is in progress, `Err` when the communicator failed.
    ///
    /// # Safety
    /// `comm` must be a live communicator.
    pub unsafe fn async_error(&self, comm: ncclComm_t) -> Result<bool, Error> {
        let mut state: ncclResult_t = sys::NCCL_SUCCESS;
        // SAFETY: as documented.
        let r = unsafe { (self.get_async_error)(comm, &mut state) };
        self.check("ncclCommGetAsyncError", r, Some(comm))?;
        match state {
            sys::NCCL_SUCCESS => Ok(true),
            sys::NCCL_IN_PROGRESS => Ok(false),
            e => Err(self.error("ncclCommGetAsyncError", e, Some(comm))),
        }
    }

    /// `ncclCommAbort`.
    ///
    /// # Safety
    /// `comm` must be live and never used again.
    pub unsafe fn abort(&self, comm: ncclComm_t) -> Result<(), Error> {
        // SAFETY: as documented.
        let r = unsafe { (self.abort)(comm) };
        self.check("ncclCommAbort", r, None)
    }

    /// `ncclCommAbort` of each of `comms` inside one group: NCCL raises
    /// each one's abort flag as it is named and frees them all at
    /// `ncclGroupEnd` (P8 of [`crate::guard`]). Every abort is attempted;
    /// the first error is returned.
    ///
    /// # Safety
    /// Each of `comms` must be live and never used again.
    pub unsafe fn abort_many(&self, comms: &[ncclComm_t]) -> Result<(), Error> {
        self.group_start()?;
        let mut first = Ok(());
        for &c in comms {
            // SAFETY: as documented.
            let r = unsafe { (self.abort)(c) };
            if first.is_ok() {
                first = self.check("ncclCommAbort", r, None);
            }
        }
        let end = self.group_end().map(drop);
        first.and(end)
    }

    /// `ncclCommDestroy`.
    ///
    /// # Safety
    /// `comm` must be live, idle, and never used again.
    pub unsafe fn destroy(&self, comm: ncclComm_t) -> Result<(), Error> {
        // SAFETY: as documented.
        let r = unsafe { (self.destroy)(comm) };
        self.check("ncclCommDestroy", r, None)
    }

    /// `ncclGroupStart`.
    pub fn group_start(&self) -> Result<(), Error> {
        // SAFETY: no arguments.
        let r = unsafe { (self.group_start)() };
        self.check("ncclGroupStart", r, None)
    }

    /// `ncclGroupEnd`: `Ok(true)` when the group was launched, `Ok(false)`
    /// when it is in progress on non-blocking communicators.
    pub fn group_end(&self) -> Result<bool, Error> {
        // SAFETY: no arguments.
        let r = unsafe { (self.group_end)() };
        self.check("ncclGroupEnd", r, None)?;
        Ok(r == sys::NCCL_SUCCESS)
    }

    /// `ncclSend`: `Ok(true)` when launched (or queued in an open group),
    /// `Ok(false)` when a non-blocking communicator reports it in progress.
    ///
    /// # Safety
    /// `buf` must point to `count` elements of `dtype` on the communicator's
    /// device that stay valid until the op completes; `comm` and `stream`
    /// must be live.
    pub unsafe fn send(
        &self,
        buf: u64,
        count: usize,
        dtype: i32,
        peer: i32,
        comm: ncclComm_t,
        stream: *mut c_void,
    ) -> Result<bool, Error> {
        // SAFETY: as documented.
        let r = unsafe { (self.send)(buf as *const c_void, count, dtype, peer, comm, stream) };
        self.check("ncclSend", r, Some(comm))?;
        Ok(r == sys::NCCL_SUCCESS)
    }

    /// `ncclRecv`, answering as [`Nccl::send`].
    ///
    /// # Safety
    /// As [`Nccl::send`], and the buffer must be writable.
    pub unsafe fn recv(
        &self,
        buf: u64,
        count: usize,
        dtype: i32,
        peer: i32,
        comm: ncclComm_t,
        stream: *mut c_void,
    ) -> Result<bool, Error> {
        // SAFETY: as documented.
        let r = unsafe { (self.recv)(buf as *mut c_void, count, dtype, peer, comm, stream) };
        self.check("ncclRecv", r, Some(comm))?;
        Ok(r == sys::NCCL_SUCCESS)
    }

    /// `ncclCommMemStats(ncclStatGpuMemTotal)`, where the library has it
    /// (2.29.7 and later).
    ///
    /// # Safety
    /// `comm` must be live.
    pub unsafe fn memory(&self, comm: ncclComm_t) -> Option<u64> {
        let f = self.mem_stats?;
        let mut v = 0u64;
        // SAFETY: as documented.
        let r = unsafe { f(comm, sys::NCCL_STAT_GPU_MEM_TOTAL, &mut v) };
        (r == sys::NCCL_SUCCESS).then_some(v)
    }
}

/// A communicator handle that may cross threads: NCCL handles may be used
/// from any thread, under the protocol of [`crate::guard`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawComm(pub ncclComm_t);

// SAFETY: a handle is an address; who may use it when is `guard`'s protocol.
unsafe impl Send for RawComm {}
// SAFETY: as above.
unsafe impl Sync for RawComm {}

/// NCCL under the protocol: each method is the `Nccl` method of the same
/// name. NCCL 2.28 has no call that stops a communicator's work without
/// freeing it, so `revoke` keeps the default (`Ok(false)`): a call blocked
/// in NCCL is interrupted by `ncclCommAbort` only (P5 of [`crate::guard`]).
impl CommApi for Nccl {
    type Comm = RawComm;
    type Stream = *mut c_void;

    fn group_start(&self) -> Result<(), Error> {
        Nccl::group_start(self)
    }

    fn group_end(&self) -> Result<bool, Error> {
        Nccl::group_end(self)
    }

    unsafe fn send(
        &self,
        comm: RawComm,
        buf: u64,
        count: usize,
        dtype: i32,
        peer: i32,
        stream: *mut c_void,
    ) -> Result<bool, Error> {
        // SAFETY: the trait's contract is `Nccl::send`'s.
        unsafe { Nccl::send(self, buf, count, dtype, peer, comm.0, stream) }
    }

    unsafe fn recv(
        &self,
        comm: RawComm,
        buf: u64,
        count: usize,
        dtype: i32,
        peer: i32,
        stream: *mut c_void,
    ) -> Result<bool, Error> {
        // SAFETY: the trait's contract is `Nccl::recv`'s.
        unsafe { Nccl::recv(self, buf, count, dtype, peer, comm.0, stream) }
    }

    unsafe fn async_error(&self, comm: RawComm) -> Result<bool, Error> {
        // SAFETY: the trait's contract is `Nccl::async_error`'s.
        unsafe { Nccl::async_error(self, comm.0) }
    }

    unsafe fn abort(&self, comm: RawComm) -> Result<(), Error> {
        let started = std::time::Instant::now();
        // SAFETY: the trait's contract is `Nccl::abort`'s.
        let r = unsafe { Nccl::abort(self, comm.0) };
        aborted(1, started);
        r
    }

    unsafe fn abort_many(&self, comms: &[RawComm]) -> Result<(), Error> {
        let raw: Vec<ncclComm_t> = comms.iter().map(|c| c.0).collect();
        let started = std::time::Instant::now();
        // SAFETY: the trait's contract is `Nccl::abort_many`'s.
        let r = unsafe { Nccl::abort_many(self, &raw) };
        aborted(raw.len(), started);
        r
    }
}

/// A debug event for `ncclCommAbort` calls that took long: an abort
/// whose peer is gone may wait on NCCL's own teardown (its proxy, its
/// sockets), on whichever thread frees the communicator.
fn aborted(comms: usize, started: std::time::Instant) {
    let took = started.elapsed();
    if took >= std::time::Duration::from_millis(50) {
        tracing::debug!(
            comms,
            ms = took.as_secs_f64() * 1e3,
            "ncclCommAbort took long"
        );
    }
}

/// # Safety
/// `p` is null or a NUL-terminated string.
unsafe fn cstr(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: as documented.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A library that cannot be loaded says why, in the dynamic linker's
    /// words, not only "dlopen failed".
    #[test]
    fn a_load_failure_keeps_the_linkers_reason() {
        let missing = "/nonexistent/duplex-test/libnccl.so.2";
        // SAFETY: the file does not exist; nothing is loaded.
        let e = unsafe { libloading::Library::new(missing) }.expect_err("no such file");
        let text = dl_error(&e);
        assert!(text.contains("No such file or directory"), "{text}");
        // A file that is not a shared library.
        let not_elf = std::env::current_dir()
            .expect("a directory")
            .join("Cargo.toml");
        // SAFETY: not an ELF file: the loader refuses it before running anything.
        let e = unsafe { libloading::Library::new(&not_elf) }.expect_err("not a library");
        let text = dl_error(&e);
        assert!(text.len() > "dlopen failed: ".len() + 10, "{text}");
        assert!(text.starts_with("dlopen failed: "), "{text}");
    }

    #[test]
    fn the_search_order_is_the_documented_one() {
        // SAFETY-free: only reads the environment of this test process.
        if std::env::var_os(LIBRARY_VAR).is_none() {
            let c = candidates();
            assert_eq!(c[0], PathBuf::from("libnccl.so.2"));
            assert_eq!(c[1], PathBuf::from("libnccl.so"));
            assert!(
                c[2..]
                    .iter()
                    .all(|p| p.to_string_lossy().contains("nvidia/nccl/lib"))
            );
        }
    }
}
