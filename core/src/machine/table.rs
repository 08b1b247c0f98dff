//! [`Table`]: the hash map the machine's state keeps its launches and
//! channels in.
//!
//! A step looks launches and channels up by key many times; a hash map
//! does that in constant time where an ordered map walks a tree. What an
//! ordered map gave for free is kept where it matters: the state's hash is
//! independent of insertion order (entries are hashed in key order), and
//! every iteration whose order a report or a choice could show goes
//! through [`Table::sorted`].

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::ops::{Deref, DerefMut};

/// A small, fast, deterministic hasher for the machine's integer keys
/// (the multiply-rotate of rustc's `FxHasher`).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct FxHasher(u64);

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u8(&mut self, i: u8) {
        self.write_u64(u64::from(i));
    }

    fn write_u16(&mut self, i: u16) {
        self.write_u64(u64::from(i));
    }

    fn write_u32(&mut self, i: u32) {
        self.write_u64(u64::from(i));
    }

    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0.rotate_left(5) ^ i).wrapping_mul(SEED);
    }

    fn write_usize(&mut self, i: usize) {
        self.write_u64(i as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A hash map with a deterministic hasher whose [`Hash`] does not depend on
/// the order entries were inserted in.
#[derive(Debug)]
pub(super) struct Table<K, V>(HashMap<K, V, BuildHasherDefault<FxHasher>>);

/// A clone sized to the entries: a derived clone keeps every bucket the
/// map ever needed, so the checker's snapshot of a machine whose launches
/// came in a burst and completed held 234 times what its entries take
/// (a review measured 314,496 bytes for a table of a few launches).
impl<K: Clone + Eq + Hash, V: Clone> Clone for Table<K, V> {
    fn clone(&self) -> Self {
        Table(self.0.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
    }
}

impl<K, V> Default for Table<K, V> {
    fn default() -> Self {
        Table(HashMap::default())
    }
}

impl<K: Eq + Hash, V: PartialEq> PartialEq for Table<K, V> {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}

impl<K: Eq + Hash, V: Eq> Eq for Table<K, V> {}

impl<K: Ord + Hash, V: Hash> Hash for Table<K, V> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        let entries = self.sorted();
        entries.len().hash(state);
        for (k, v) in entries {
            k.hash(state);
            v.hash(state);
        }
    }
}

impl<K, V> Deref for Table<K, V> {
    type Target = HashMap<K, V, BuildHasherDefault<FxHasher>>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl<K, V> DerefMut for Table<K, V> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl<K: Ord, V> Table<K, V> {
    /// The entries in key order.
    pub(super) fn sorted(&self) -> Vec<(&K, &V)> {
        let mut v: Vec<(&K, &V)> = self.0.iter().collect();
        v.sort_unstable_by(|a, b| a.0.cmp(b.0));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::DefaultHasher;

    fn hash_of(t: &Table<u32, u32>) -> u64 {
        let mut h = DefaultHasher::new();
        t.hash(&mut h);
        h.finish()
    }

    #[test]
    fn hash_and_equality_ignore_insertion_order() {
        let mut a: Table<u32, u32> = Table::default();
        let mut b: Table<u32, u32> = Table::default();
        for i in 0..100 {
            a.insert(i, i * 7);
            b.insert(99 - i, (99 - i) * 7);
        }
        assert_eq!(a, b);
        assert_eq!(hash_of(&a), hash_of(&b));
        b.insert(5, 0);
        assert_ne!(a, b);
        assert_ne!(hash_of(&a), hash_of(&b));
        let keys: Vec<u32> = a.sorted().iter().map(|(k, _)| **k).collect();
        assert_eq!(keys, (0..100).collect::<Vec<_>>());
    }
}
