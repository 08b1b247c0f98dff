//! An execution as a Chrome/Perfetto trace (the trace-event JSON format
//! that ui.perfetto.dev and chrome://tracing open): a process per rank, a
//! track per host thread and per stream; host calls and device ops as
//! spans, one millisecond per host step, each with what it is and, for what
//! never completed, the rule that held it.
//!
//! `duplex check FILE --trace OUT.json` writes the counterexample's;
//! [`crate::Sim::trace_to`] makes a failing `Sim::check` write its own.

use std::collections::BTreeMap;

use duplex::report::{Node, Stuck};
use duplex::trace::Timeline;
use serde_json::{Value, json};

/// Microseconds per host step.
const STEP_US: u64 = 1000;

/// Why an op that never completed is held, from the stuck state's cycle or
/// missing partners.
fn held_by(stuck: Option<&Stuck>, op: &duplex::report::OpInfo) -> Option<String> {
    let stuck = stuck?;
    stuck
        .cycle
        .iter()
        .chain(&stuck.missing)
        .find(|l| match &l.what {
            Node::Launch { ops } => ops.iter().any(|o| {
                o.rank == op.rank && o.comm == op.comm && o.fifo == op.fifo && o.op == op.op
            }),
            _ => false,
        })
        .map(|l| format!("{}: {}", l.rule, l.waits_for))
}

/// The trace-event JSON of a timeline.
pub fn chrome_trace(t: &Timeline, title: &str) -> Value {
    let mut events: Vec<Value> = Vec::new();
    let end = (t.steps as u64 + 1) * STEP_US;
    // Tracks: (rank, name) → tid; threads first, then streams.
    let mut tids: BTreeMap<(u32, String), u64> = BTreeMap::new();
    let tid = |rank: u32, name: String, tids: &mut BTreeMap<(u32, String), u64>| -> u64 {
        let next = tids.len() as u64 + 1;
        *tids.entry((rank, name)).or_insert(next)
    };
    for (i, c) in t.calls.iter().enumerate() {
        let id = tid(c.rank, format!("thread {}", c.thread), &mut tids);
        // A call lasts until the thread's next call (it was blocked until
        // then), or to the end if it is the thread's last.
        let next = t.calls[i + 1..]
            .iter()
            .find(|n| n.rank == c.rank && n.thread == c.thread)
            .map(|n| n.step);
        let blocked = t.stuck.as_ref().and_then(|s| {
            s.blocked
                .iter()
                .find(|b| b.rank == c.rank && b.thread == c.thread && next.is_none())
                .map(|b| b.waits_for.clone())
        });
        let stop = next.map_or(end, |s| s as u64 * STEP_US);
        let start = c.step as u64 * STEP_US;
        events.push(json!({
            "name": c.call,
            "cat": "host",
            "ph": "X",
            "pid": c.rank,
            "tid": id,
            "ts": start,
            "dur": stop.saturating_sub(start).max(STEP_US / 4),
            "args": { "at": c.place, "step": c.step + 1, "blocked": blocked },
        }));
    }
    for o in &t.ops {
        let info = &o.op;
        let id = tid(info.rank, format!("stream {}", info.stream), &mut tids);
        let start = o.issued as u64 * STEP_US;
        let stop = o
            .completed
            .map_or(end, |s| s as u64 * STEP_US + STEP_US / 2);
        let name = format!(
            "{} {} {} {}",
            info.op.name(),
            if info.op == duplex::Dir::Send {
                "→"
            } else {
                "←"
            },
            info.peer,
            duplex::Size(info.bytes)
        );
        events.push(json!({
            "name": name,
            "cat": if o.completed.is_some() { "device" } else { "device,stuck" },
            "ph": "X",
            "pid": info.rank,
            "tid": id,
            "ts": start,
            "dur": stop.saturating_sub(start).max(STEP_US / 4),
            "args": {
                "comm": info.comm,
                "message": info.fifo,
                "state": info.state.name(),
                "at": info.at,
                "issued at step": o.issued + 1,
                "started at step": o.started.map(|s| s + 1),
                "completed at step": o.completed.map(|s| s + 1),
                "held by": if o.completed.is_none() { held_by(t.stuck.as_ref(), info) } else { None },
            },
        }));
    }
    let mut ranks: Vec<u32> = tids.keys().map(|(r, _)| *r).collect();
    ranks.dedup();
    for r in ranks {
        events.push(json!({
            "name": "process_name", "ph": "M", "pid": r, "tid": 0,
            "args": { "name": format!("rank {r}") },
        }));
    }
    for ((rank, name), id) in &tids {
        events.push(json!({
            "name": "thread_name", "ph": "M", "pid": rank, "tid": id,
            "args": { "name": name },
        }));
        events.push(json!({
            "name": "thread_sort_index", "ph": "M", "pid": rank, "tid": id,
            "args": { "sort_index": id },
        }));
    }
    json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": { "title": title, "unit": "one millisecond per host step" },
    })
}
