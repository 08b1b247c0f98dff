//! Host-to-host messages (`notify`/`await_notify`, and the inboxes of the
//! lane services, [`crate::lanes`]): the [`Board`] they wait on, and its
//! in-process form for local runs. Runs of one process per rank use the TCP
//! store of [`crate::store`] instead.

use std::collections::{HashMap, VecDeque};
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
    /// Appends `message` to rank `to`'s inbox.
    fn mail(&self, to: Rank, message: &[u8]) -> Result<(), Error>;
    /// The oldest message of rank `me`'s inbox, waiting up to `timeout` for
    /// one.
    fn inbox(&self, me: Rank, timeout: Duration) -> Result<Option<Vec<u8>>, Error>;
    /// How often a reader that has other work to poll between reads (a
    /// lane service making a lane, [`crate::lanes`]) should read an inbox,
    /// at most: zero for the in-process board, where a read is a lock.
    fn inbox_every(&self) -> Duration {
        Duration::ZERO
    }
}

/// The board of a local run: counters under a mutex. A message is taken
/// under the same lock that the taker's deadline is checked under, so a
/// post that races a timeout is either taken by that wait or left for the
/// next one (model-checked: `tests/loom.rs`).
#[derive(Debug)]
pub struct LocalBoard {
    counts: Mutex<HashMap<(Rank, Rank, String), u64>>,
    arrived: Condvar,
    mail: Mutex<HashMap<Rank, VecDeque<Vec<u8>>>>,
    mailed: Condvar,
}

impl Default for LocalBoard {
    fn default() -> Self {
        LocalBoard {
            counts: Mutex::new(HashMap::new()),
            arrived: Condvar::new(),
            mail: Mutex::new(HashMap::new()),
            mailed: Condvar::new(),
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
                // A tag none of whose messages wait holds no memory (the
                // store's board does the same): a tag per step would
                // otherwise grow the board for ever.
                if *n == 0 {
                    counts.remove(&key);
                }
                return Ok(true);
            }
            if deadline.expired() {
                return Ok(false);
            }
            counts = deadline.wait(&self.arrived, counts);
        }
    }

    fn mail(&self, to: Rank, message: &[u8]) -> Result<(), Error> {
        lock(&self.mail)
            .entry(to)
            .or_default()
            .push_back(message.to_vec());
        self.mailed.notify_all();
        Ok(())
    }

    fn inbox(&self, me: Rank, timeout: Duration) -> Result<Option<Vec<u8>>, Error> {
        let deadline = Deadline::after(timeout);
        let mut boxes = lock(&self.mail);
        loop {
            if let Some(m) = boxes.get_mut(&me).and_then(VecDeque::pop_front) {
                return Ok(Some(m));
            }
            if deadline.expired() {
                return Ok(None);
            }
            boxes = deadline.wait(&self.mailed, boxes);
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
        // A tag per step holds no memory once its messages are taken.
        for step in 0..10_000 {
            let tag = format!("step {step}");
            b.post(0, 1, &tag).unwrap();
            assert!(b.take(0, 1, &tag, Duration::ZERO).unwrap());
        }
        b.post(1, 0, "left").unwrap();
        assert_eq!(b.lock().len(), 1, "only the tag with a message waiting");
    }

    #[test]
    fn the_local_inboxes_keep_order_and_wait() {
        let b = std::sync::Arc::new(LocalBoard::default());
        b.mail(1, b"a").unwrap();
        b.mail(1, b"b").unwrap();
        assert_eq!(
            b.inbox(1, Duration::ZERO).unwrap().as_deref(),
            Some(&b"a"[..])
        );
        assert_eq!(
            b.inbox(1, Duration::ZERO).unwrap().as_deref(),
            Some(&b"b"[..])
        );
        assert_eq!(b.inbox(1, Duration::from_millis(20)).unwrap(), None);
        let b2 = b.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            b2.mail(0, b"late").unwrap();
        });
        let got = b.inbox(0, Duration::from_secs(5)).unwrap();
        assert_eq!(got.as_deref(), Some(&b"late"[..]));
        t.join().unwrap();
    }
}
