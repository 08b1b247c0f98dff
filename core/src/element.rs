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
    /// `ncclFloat16` (IEEE half precision; [`F16`] holds its bits)
    F16,
    /// `ncclBfloat16` ([`Bf16`] holds its bits)
    BF16,
}

impl DType {
    /// Every type, in declaration order.
    pub const ALL: [DType; 10] = [
        DType::I8,
        DType::U8,
        DType::I32,
        DType::U32,
        DType::I64,
        DType::U64,
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
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
            DType::F16 => 6,
            DType::F32 => 7,
            DType::F64 => 8,
            DType::BF16 => 9,
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
            DType::F16 => "f16",
            DType::BF16 => "bf16",
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

/// A half-precision float (IEEE 754 binary16) as its bits, for buffers of
/// `ncclFloat16`: duplex moves and compares elements, it does no
/// arithmetic, so the bits are all it needs (the `half` crate's
/// `f16::to_bits` / `from_bits` convert).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct F16(pub u16);

/// A bfloat16 as its bits, for buffers of `ncclBfloat16` (as [`F16`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Bf16(pub u16);

macro_rules! bits16 {
    ($($t:ident => $d:ident),*) => {$(
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn to_le(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.0.to_le_bytes());
            }
            fn from_le(bytes: &[u8]) -> Self {
                $t(u16::from_le_bytes([bytes[0], bytes[1]]))
            }
        }
    )*};
}

bits16!(F16 => F16, Bf16 => BF16);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_nccl_is_the_inverse_of_nccl() {
        for d in DType::ALL {
            assert_eq!(DType::from_nccl(d.nccl()), Some(d));
        }
        // ALL holds the ten types, each once.
        let named: std::collections::BTreeSet<&str> = DType::ALL.iter().map(|d| d.name()).collect();
        assert_eq!(named.len(), 10);
        // ncclFloat16 and ncclBfloat16 (NCCL's nccl.h: 6 and 9).
        assert_eq!(DType::from_nccl(6), Some(DType::F16));
        assert_eq!(DType::from_nccl(9), Some(DType::BF16));
        // ncclFloat8e4m3 and ncclFloat8e5m2 (10, 11): none in duplex.
        for code in [-1, 10, 11, 99] {
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
        assert_eq!(<Bf16 as Element>::DTYPE.size(), 2);
        let mut b = Vec::new();
        Bf16(0x3fc0).to_le(&mut b);
        F16(0x3e00).to_le(&mut b);
        assert_eq!(b, [0xc0, 0x3f, 0x00, 0x3e]);
        assert_eq!(Bf16::from_le(&b[..2]), Bf16(0x3fc0));
        assert_eq!(F16::from_le(&b[2..]), F16(0x3e00));
    }
}
