//! The synchronization primitives of the concurrency protocol
//! ([`crate::guard`]) and of the local board ([`crate::board`]): `std`'s, or
//! under `--cfg loom` the model checker's, as tokio does. Code of the
//! protocol uses only what this module exports, so the loom tests
//! (`tests/loom.rs`) explore the same code the backend runs.
//!
//! Time is part of the shim too: a [`Deadline`] is real time, except under
//! loom, which has no clock; there a deadline that is not already zero
//! expires when the model calls `clock::expire`, at any point of an
//! execution the model checker chooses.

use std::time::Duration;

#[cfg(loom)]
pub use loom::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
pub use loom::sync::{Arc, Condvar, Mutex, MutexGuard};
#[cfg(loom)]
pub use loom::thread;

#[cfg(not(loom))]
pub use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub use std::sync::{Arc, Condvar, Mutex, MutexGuard};
#[cfg(not(loom))]
pub use std::thread;

/// Locks `m`, ignoring poisoning: every critical section of the protocol
/// leaves its state consistent before anything in it can panic.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// When a wait gives up.
#[derive(Clone, Copy, Debug)]
pub struct Deadline {
    #[cfg(not(loom))]
    at: Option<std::time::Instant>,
    #[cfg(loom)]
    zero: bool,
}

impl Deadline {
    /// The deadline `timeout` from now.
    pub fn after(timeout: Duration) -> Deadline {
        #[cfg(not(loom))]
        {
            // A timeout too large to represent never expires.
            Deadline {
                at: std::time::Instant::now().checked_add(timeout),
            }
        }
        #[cfg(loom)]
        {
            Deadline {
                zero: timeout.is_zero(),
            }
        }
    }

    /// True once the deadline has passed.
    pub fn expired(&self) -> bool {
        #[cfg(not(loom))]
        {
            self.at.is_some_and(|at| std::time::Instant::now() >= at)
        }
        #[cfg(loom)]
        {
            self.zero || clock::expired()
        }
    }

    /// Waits on `cv` with `guard` until notified, or until the deadline;
    /// spurious wake-ups happen, so callers loop. Under loom the model's
    /// clock notifies no one by itself: whoever calls `clock::expire`
    /// notifies the condition variables that waits with a deadline use
    /// (see `LocalBoard::expire_clock`).
    pub fn wait<'a, T>(&self, cv: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        #[cfg(not(loom))]
        {
            let left = match self.at {
                Some(at) => at.saturating_duration_since(std::time::Instant::now()),
                None => Duration::from_secs(3600),
            };
            cv.wait_timeout(guard, left)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0)
        }
        #[cfg(loom)]
        {
            cv.wait(guard).unwrap_or_else(|e| e.into_inner())
        }
    }
}

/// The clock of a test: real time expires by itself, so there is nothing
/// to do; under loom, [`clock::expire`] is the model's clock.
#[cfg(all(test, not(loom)))]
pub mod clock {
    /// Nothing: real time passes by itself.
    pub fn expire() {}
}

/// The clock of a loom model: every deadline that is not zero expires when
/// the model calls [`clock::expire`] (once per execution).
#[cfg(loom)]
pub mod clock {
    use super::{AtomicBool, Ordering};

    loom::lazy_static! {
        static ref EXPIRED: AtomicBool = AtomicBool::new(false);
    }

    /// Lets every deadline of this execution expire.
    pub fn expire() {
        EXPIRED.store(true, Ordering::SeqCst);
    }

    pub(super) fn expired() -> bool {
        EXPIRED.load(Ordering::SeqCst)
    }
}
