//! Host-to-host messages (`notify`/`await_notify`): the [`Board`] they wait
//! on, and its in-process form for local runs. Runs of one process per rank
//! use the TCP store of [`crate::store`] instead.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use duplex::{Error, Rank};

/// Where `notify` messages wait for their `await_notify`.
pub trait Board: Send + Sync + std::fmt::Debug {
    /// Posts a message from `from` to `to` with `tag`.
    fn post(&self, from: Rank, to: Rank, tag: &str) -> Result<(), Error>;
    /// Takes one message from `from` to `to` with `tag`, waiting up to
    /// `timeout`; false when none came.
    fn take(&self, from: Rank, to: Rank, tag: &str, timeout: Duration) -> Result<bool, Error>;
}

/// The board of a local run: counters under a mutex.
#[derive(Debug, Default)]
pub struct LocalBoard {
    counts: Mutex<HashMap<(Rank, Rank, String), u64>>,
    arrived: Condvar,
}

impl LocalBoard {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(Rank, Rank, String), u64>> {
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Board for LocalBoard {
    fn post(&self, from: Rank, to: Rank, tag: &str) -> Result<(), Error> {
        *self.lock().entry((from, to, tag.to_string())).or_insert(0) += 1;
        self.arrived.notify_all();
        Ok(())
    }

    fn take(&self, from: Rank, to: Rank, tag: &str, timeout: Duration) -> Result<bool, Error> {
        let deadline = Instant::now() + timeout;
        let key = (from, to, tag.to_string());
        let mut counts = self.lock();
        loop {
            if let Some(n) = counts.get_mut(&key)
                && *n > 0
            {
                *n -= 1;
                return Ok(true);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            counts = self
                .arrived
                .wait_timeout(counts, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
