//! What memory this process may use: the simulator's guard on buffers
//! and the checker's budget for snapshots read it.

/// The memory this process had available when first asked, if known: the
/// most a simulated run's buffers may hold, and what sets the checker's
/// default budget for snapshots. Linux's `MemAvailable`, and
/// under a cgroup v2 limit (a container) what the limit leaves
/// (`memory.max` less `memory.current`), whichever is less.
pub(crate) fn available() -> Option<u64> {
    static AVAILABLE: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let machine = (|| {
            let text = std::fs::read_to_string("/proc/meminfo").ok()?;
            let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            kib.checked_mul(1024)
        })();
        let read = |f: &str| -> Option<u64> {
            std::fs::read_to_string(format!("/sys/fs/cgroup/{f}"))
                .ok()?
                .trim()
                .parse()
                .ok()
        };
        // "max" (no limit) does not parse: no cgroup bound. Under cgroup
        // v1, the memory controller's limit (a huge number when unset).
        let cgroup = read("memory.max")
            .map(|max| max.saturating_sub(read("memory.current").unwrap_or(0)))
            .or_else(|| {
                read("memory/memory.limit_in_bytes").map(|max| {
                    max.saturating_sub(read("memory/memory.usage_in_bytes").unwrap_or(0))
                })
            });
        match (machine, cgroup) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    })
}

/// Bytes the simulator's buffers hold in this process, every run at once.
static HELD: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The bytes the simulator's buffers hold in this process.
pub(crate) fn held() -> u64 {
    HELD.load(std::sync::atomic::Ordering::Relaxed)
}

/// Counts `bytes` more held, if twice what would then be held fits in
/// `available` (or nothing is known of it).
fn hold(bytes: u64, available: Option<u64>) -> bool {
    use std::sync::atomic::Ordering;
    HELD.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
        let after = held.checked_add(bytes)?;
        match available {
            Some(free) if after.saturating_mul(2) > free => None,
            _ => Some(after),
        }
    })
    .is_ok()
}

/// A simulated buffer's `bytes` zeroed bytes, counted as held, when twice
/// what would then be held fits in `available` and the allocator gives
/// them; `None` otherwise, nothing counted.
pub(crate) fn held_zeroed(bytes: usize, available: Option<u64>) -> Option<Vec<u8>> {
    if !hold(bytes as u64, available) {
        return None;
    }
    let out = zeroed(bytes);
    if out.is_none() {
        release(bytes as u64);
    }
    out
}

/// `bytes` zeroed bytes, or `None` when the allocator cannot give them
/// (where `vec![0; bytes]` would abort the process). Zeroed by the
/// allocator, so that pages the run never touches cost nothing.
fn zeroed(bytes: usize) -> Option<Vec<u8>> {
    if bytes == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(bytes).ok()?;
    // SAFETY: `layout` has a non-zero size.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` comes from the global allocator with the layout of
    // `bytes` `u8`s (align 1), and all `bytes` of them are initialized
    // (zero), so it is a valid `Vec<u8>` of that length and capacity.
    Some(unsafe { Vec::from_raw_parts(p, bytes, bytes) })
}

/// Counts `bytes` fewer held (a run's buffers, as its world drops).
pub(crate) fn release(bytes: u64) {
    HELD.fetch_sub(bytes, std::sync::atomic::Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_held_is_counted_and_twice_it_must_fit() {
        // Twice 1 TiB more than anything held never fits in 1 TiB.
        assert!(!hold(1 << 40, Some(1 << 40)));
        assert!(held_zeroed(1 << 40, Some(1 << 40)).is_none());
        // Without a known limit, anything that adds up is held.
        assert!(hold(1 << 20, None));
        assert!(held() >= 1 << 20);
        release(1 << 20);
    }
}
