//! Element types of buffers, and their NCCL datatypes.

use std::fmt;

/// A datatype as NCCL knows it. Schedule files move raw bytes (`U8`).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// `ncclInt8`
    I8,
    /// `ncclUint8`; also raw bytes.
    U8,
    /// `ncclInt32`
    I32,
    /// `ncclUint32`
    U32,
    /// `ncclInt64`
    I64,
    /// `ncclUint64`
    U64,
    /// `ncclFloat32`
    F32,
    /// `ncclFloat64`
    F64,
}

impl DType {
    /// Every type, in declaration order.
    pub const ALL: [DType; 8] = [
        DType::I8,
        DType::U8,
        DType::I32,
        DType::U32,
        DType::I64,
        DType::U64,
        DType::F32,
        DType::F64,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
        }
    }

    /// The value of `ncclDataType_t` (NCCL 2.x).
    pub fn nccl(self) -> i32 {
        match self {
            DType::I8 => 0,
            DType::U8 => 1,
            DType::I32 => 2,
            DType::U32 => 3,
            DType::I64 => 4,
            DType::U64 => 5,
            DType::F32 => 7,
            DType::F64 => 8,
        }
    }

    /// The type whose `ncclDataType_t` is `code` ([`DType::nccl`]'s
    /// inverse), if duplex has one.
    pub fn from_nccl(code: i32) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.nccl() == code)
    }

    /// The Rust name of the type.
    pub fn name(self) -> &'static str {
        match self {
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::I64 => "i64",
            DType::U64 => "u64",
            DType::F32 => "f32",
            DType::F64 => "f64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A type that buffers can hold and NCCL can move.
pub trait Element: Copy + Default + PartialEq + fmt::Debug + Send + Sync + 'static {
    /// Its NCCL datatype.
    const DTYPE: DType;
    /// Its bytes, little-endian (the simulator moves bytes).
    fn to_le(self, out: &mut Vec<u8>);
    /// Reads one value from `size_of::<Self>()` little-endian bytes.
    fn from_le(bytes: &[u8]) -> Self;
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => {$(
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn to_le(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn from_le(bytes: &[u8]) -> Self {
                let mut raw = [0u8; std::mem::size_of::<$t>()];
                raw.copy_from_slice(&bytes[..std::mem::size_of::<$t>()]);
                <$t>::from_le_bytes(raw)
            }
        }
    )*};
}

element!(i8 => I8, u8 => U8, i32 => I32, u32 => U32, i64 => I64, u64 => U64, f32 => F32, f64 => F64);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_nccl_is_the_inverse_of_nccl() {
        for d in DType::ALL {
            assert_eq!(DType::from_nccl(d.nccl()), Some(d));
        }
        // ALL holds the eight types, each once.
        let named: std::collections::BTreeSet<&str> = DType::ALL.iter().map(|d| d.name()).collect();
        assert_eq!(named.len(), 8);
        for code in [-1, 6, 9, 99] {
            assert_eq!(DType::from_nccl(code), None);
        }
    }

    #[test]
    fn sizes_match_rust() {
        assert_eq!(<f64 as Element>::DTYPE.size(), 8);
        assert_eq!(<u8 as Element>::DTYPE.size(), 1);
        assert_eq!(<i32 as Element>::DTYPE.size(), 4);
        let mut b = Vec::new();
        1.5f32.to_le(&mut b);
        assert_eq!(f32::from_le(&b), 1.5);
    }
}
