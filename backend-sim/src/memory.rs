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
