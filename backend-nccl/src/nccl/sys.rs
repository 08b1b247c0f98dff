//! Raw NCCL ABI: the types and function signatures duplex uses, as
//! `nccl.h` declares them (2.18 and later). No CUDA headers are needed:
//! `cudaStream_t` is an opaque pointer.

#![allow(non_camel_case_types, non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `ncclResult_t`.
pub type ncclResult_t = c_int;
/// `ncclSuccess`
pub const NCCL_SUCCESS: ncclResult_t = 0;
/// `ncclInvalidArgument`
pub const NCCL_INVALID_ARGUMENT: ncclResult_t = 4;
/// `ncclInProgress`
pub const NCCL_IN_PROGRESS: ncclResult_t = 7;

/// `ncclComm_t`: an opaque handle.
pub type ncclComm_t = *mut c_void;
/// `cudaStream_t` (the same object as a driver `CUstream`).
pub type cudaStream_t = *mut c_void;
/// `ncclDataType_t`.
pub type ncclDataType_t = c_int;

/// `NCCL_UNIQUE_ID_BYTES`
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;
/// `ncclUniqueId`. Its `Debug` does not show its bytes: they let anyone
/// join the communicator.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ncclUniqueId {
    /// Opaque bytes.
    pub internal: [u8; NCCL_UNIQUE_ID_BYTES],
}

impl std::fmt::Debug for ncclUniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ncclUniqueId(<{NCCL_UNIQUE_ID_BYTES} bytes>)")
    }
}

impl ncclUniqueId {
    /// The id whose bytes another rank sent; `None` unless there are
    /// exactly [`NCCL_UNIQUE_ID_BYTES`].
    pub fn from_bytes(bytes: &[u8]) -> Option<ncclUniqueId> {
        Some(ncclUniqueId {
            internal: bytes.try_into().ok()?,
        })
    }
}

/// `NCCL_CONFIG_UNDEF_INT`
pub const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// `NCCL_SPLIT_NOCOLOR`
pub const NCCL_SPLIT_NOCOLOR: c_int = -1;
/// `NCCL_API_MAGIC`
pub const NCCL_API_MAGIC: c_uint = 0xcafe_beef;

/// `ncclConfig_t` with every field up to NCCL 2.28 (`ncclConfig_v22800`).
/// Older libraries get a prefix of it: [`config_size`] gives the size and
/// version NCCL's own header would have filled in for that library, and the
/// fields past it are never read.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclConfig_t {
    /// Size of the struct as the caller's header declared it.
    pub size: usize,
    /// `NCCL_API_MAGIC`.
    pub magic: c_uint,
    /// The caller's `NCCL_VERSION_CODE`.
    pub version: c_uint,
    /// 2.14: 0 for a non-blocking communicator.
    pub blocking: c_int,
    /// 2.14
    pub cgaClusterSize: c_int,
    /// 2.14
    pub minCTAs: c_int,
    /// 2.14
    pub maxCTAs: c_int,
    /// 2.14
    pub netName: *const c_char,
    /// 2.18
    pub splitShare: c_int,
    /// Between 2.18 and 2.27.
    pub trafficClass: c_int,
    /// Between 2.18 and 2.27.
    pub commName: *const c_char,
    /// Between 2.18 and 2.27.
    pub collnetEnable: c_int,
    /// 2.27
    pub CTAPolicy: c_int,
    /// 2.27
    pub shrinkShare: c_int,
    /// 2.27
    pub nvlsCTAs: c_int,
    /// 2.28
    pub nChannelsPerNetPeer: c_int,
    /// 2.28
    pub nvlinkCentricSched: c_int,
}

/// The header version and struct size to declare for a library of
/// `version` (as `ncclGetVersion` reports it), or `None` below 2.18.
pub fn config_size(version: c_int) -> Option<(c_uint, usize)> {
    use std::mem::{offset_of, size_of};
    let end = |off: usize, len: usize| off + len;
    let (v, size) = if version >= 22800 {
        (22800, size_of::<ncclConfig_t>())
    } else if version >= 22700 {
        (
            22700,
            end(offset_of!(ncclConfig_t, nvlsCTAs), size_of::<c_int>()),
        )
    } else if version >= 21800 {
        (
            21800,
            end(offset_of!(ncclConfig_t, splitShare), size_of::<c_int>()),
        )
    } else {
        return None;
    };
    // The C struct is padded to its alignment (8, for the pointers).
    Some((v, size.next_multiple_of(8)))
}

impl ncclConfig_t {
    /// `NCCL_CONFIG_INITIALIZER` for a library of `version`.
    pub fn new(version: c_int) -> Option<ncclConfig_t> {
        let (v, size) = config_size(version)?;
        Some(ncclConfig_t {
            size,
            magic: NCCL_API_MAGIC,
            version: v,
            blocking: NCCL_CONFIG_UNDEF_INT,
            cgaClusterSize: NCCL_CONFIG_UNDEF_INT,
            minCTAs: NCCL_CONFIG_UNDEF_INT,
            maxCTAs: NCCL_CONFIG_UNDEF_INT,
            netName: std::ptr::null(),
            splitShare: NCCL_CONFIG_UNDEF_INT,
            trafficClass: NCCL_CONFIG_UNDEF_INT,
            commName: std::ptr::null(),
            collnetEnable: NCCL_CONFIG_UNDEF_INT,
            CTAPolicy: NCCL_CONFIG_UNDEF_INT,
            shrinkShare: NCCL_CONFIG_UNDEF_INT,
            nvlsCTAs: NCCL_CONFIG_UNDEF_INT,
            nChannelsPerNetPeer: NCCL_CONFIG_UNDEF_INT,
            nvlinkCentricSched: NCCL_CONFIG_UNDEF_INT,
        })
    }
}

/// `ncclGetVersion`
pub type ncclGetVersion = unsafe extern "C" fn(version: *mut c_int) -> ncclResult_t;
/// `ncclGetUniqueId`
pub type ncclGetUniqueId = unsafe extern "C" fn(id: *mut ncclUniqueId) -> ncclResult_t;
/// `ncclCommInitRankConfig`
pub type ncclCommInitRankConfig = unsafe extern "C" fn(
    comm: *mut ncclComm_t,
    nranks: c_int,
    id: ncclUniqueId,
    rank: c_int,
    config: *mut ncclConfig_t,
) -> ncclResult_t;
/// `ncclCommSplit`
pub type ncclCommSplit = unsafe extern "C" fn(
    comm: ncclComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ncclConfig_t,
) -> ncclResult_t;
/// `ncclCommFinalize`, `ncclCommDestroy`, `ncclCommAbort`
pub type ncclCommOp = unsafe extern "C" fn(comm: ncclComm_t) -> ncclResult_t;
/// `ncclCommGetAsyncError`
pub type ncclCommGetAsyncError =
    unsafe extern "C" fn(comm: ncclComm_t, err: *mut ncclResult_t) -> ncclResult_t;
/// `ncclGetErrorString`
pub type ncclGetErrorString = unsafe extern "C" fn(result: ncclResult_t) -> *const c_char;
/// `ncclGetLastError`
pub type ncclGetLastError = unsafe extern "C" fn(comm: ncclComm_t) -> *const c_char;
/// `ncclGroupStart`, `ncclGroupEnd`
pub type ncclGroupOp = unsafe extern "C" fn() -> ncclResult_t;
/// `ncclSend`
pub type ncclSend = unsafe extern "C" fn(
    sendbuff: *const c_void,
    count: usize,
    datatype: ncclDataType_t,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t;
/// `ncclRecv`
pub type ncclRecv = unsafe extern "C" fn(
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t;
/// `ncclCommMemStats` (2.29.7 and later)
pub type ncclCommMemStats =
    unsafe extern "C" fn(comm: ncclComm_t, stat: c_int, value: *mut u64) -> ncclResult_t;
/// `ncclStatGpuMemTotal`
pub const NCCL_STAT_GPU_MEM_TOTAL: c_int = 3;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_2_28_layout_matches_nccl_h() {
        // ncclConfig_v22800 on x86-64: 16 bytes of header, 4 ints, a
        // pointer, 2 ints, a pointer, 6 ints.
        assert_eq!(std::mem::size_of::<ncclConfig_t>(), 80);
        assert_eq!(std::mem::offset_of!(ncclConfig_t, netName), 32);
        assert_eq!(std::mem::offset_of!(ncclConfig_t, commName), 48);
        assert_eq!(std::mem::offset_of!(ncclConfig_t, nvlinkCentricSched), 76);
    }

    #[test]
    fn older_libraries_get_the_prefix_their_header_declares() {
        assert_eq!(config_size(22803), Some((22800, 80)));
        assert_eq!(config_size(22703), Some((22700, 72)));
        // Between 2.18 and 2.27 the 2.18 prefix, which every later library accepts.
        assert_eq!(config_size(22304), Some((21800, 48)));
        assert_eq!(config_size(21805), Some((21800, 48)));
        assert_eq!(config_size(21703), None);
        let c = ncclConfig_t::new(22803).expect("2.28 is supported");
        assert_eq!(c.magic, 0xcafe_beef);
        assert_eq!(c.blocking, c_int::MIN);
    }
}
