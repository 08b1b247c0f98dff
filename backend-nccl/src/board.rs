//! Host-to-host messages (`notify`/`await_notify`): the [`Board`] they wait
//! on, and its in-process form for local runs. Runs of one process per rank
//! use the TCP store of [`crate::store`] instead.

use std::collections::HashMap;
use std::time::Duration;

use duplex::{Error, Rank};

use crate::sync::{Condvar, Deadline, Mutex, MutexGuard, lock};

/// Where `notify` messages wait for their `await_notify`.
pub trait Board: Send + Sync + std::fmt::Debug {
    /// Posts a message from `from` to `to` with `tag`.
    fn post(&self, from: Rank, to: Rank, tag: &str) -> Result<(), Error>;
    /// Takes one message from `from` to `to` with `tag`, waiting up to
    /// `timeout`; false when none came.
    fn take(&self, from: Rank, to: Rank, tag: &str, timeout: Duration) -> Result<bool, Error>;
}

/// The board of a local run: counters under a mutex. A message is taken
/// under the same lock that the taker's deadline is checked under, so a
/// post that races a timeout is either taken by that wait or left for the
/// next one (model-checked: `tests/loom.rs`).
#[derive(Debug)]
pub struct LocalBoard {
    counts: Mutex<HashMap<(Rank, Rank, String), u64>>,
    arrived: Condvar,
}

impl Default for LocalBoard {
    fn default() -> Self {
        LocalBoard {
            counts: Mutex::new(HashMap::new()),
            arrived: Condvar::new(),
        }
    }
}

impl LocalBoard {
    fn lock(&self) -> MutexGuard<'_, HashMap<(Rank, Rank, String), u64>> {
        lock(&self.counts)
    }

    /// Lets the deadlines of waits expire, for tests: under loom the
    /// model's clock ([`crate::sync::Deadline`]), which wakes the waits;
    /// on real threads nothing (time passes by itself).
    #[cfg(any(test, loom))]
    pub fn expire_clock(&self) {
        crate::sync::clock::expire();
        let _g = self.lock();
        self.arrived.notify_all();
    }
}

impl Board for LocalBoard {
    fn post(&self, from: Rank, to: Rank, tag: &str) -> Result<(), Error> {
        *self.lock().entry((from, to, tag.to_string())).or_insert(0) += 1;
        self.arrived.notify_all();
        Ok(())
    }

    fn take(&self, from: Rank, to: Rank, tag: &str, timeout: Duration) -> Result<bool, Error> {
        let deadline = Deadline::after(timeout);
        let key = (from, to, tag.to_string());
        let mut counts = self.lock();
        loop {
            if let Some(n) = counts.get_mut(&key)
                && *n > 0
            {
                *n -= 1;
                return Ok(true);
            }
            if deadline.expired() {
                return Ok(false);
            }
            counts = deadline.wait(&self.arrived, counts);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn the_local_board_counts_messages_and_times_out() {
        let b = LocalBoard::default();
        b.post(0, 1, "meta").unwrap();
        b.post(0, 1, "meta").unwrap();
        assert!(b.take(0, 1, "meta", Duration::ZERO).unwrap());
        assert!(b.take(0, 1, "meta", Duration::ZERO).unwrap());
        let t = Instant::now();
        assert!(!b.take(0, 1, "meta", Duration::from_millis(30)).unwrap());
        assert!(t.elapsed() >= Duration::from_millis(30));
        assert!(
            !b.take(1, 0, "meta", Duration::ZERO).unwrap(),
            "direction matters"
        );
    }
}
