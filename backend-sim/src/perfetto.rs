//! An execution as a Chrome/Perfetto trace (the trace-event JSON format
//! that ui.perfetto.dev and chrome://tracing open): a process per rank, a
//! track per host thread and per stream; host calls and device ops as
//! spans, one millisecond per host step, each with what it is and, for what
//! never completed, the rule that held it.
//!
//! `duplex check FILE --trace OUT.json` writes the counterexample's;
//! [`crate::Sim::trace_to`] makes a failing `Sim::check` write its own.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;

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

/// The trace-event JSON of a timeline, as one value (for tests and small
/// timelines; [`write_chrome_trace`] writes it without building it).
pub fn chrome_trace(t: &Timeline, title: &str) -> Value {
    let mut bytes = Vec::new();
    write_chrome_trace(t, title, &mut bytes).expect("writing to memory cannot fail");
    serde_json::from_slice(&bytes).expect("write_chrome_trace writes JSON")
}

/// Writes the trace-event JSON of a timeline to `out`, one event at a
/// time: its memory does not grow with the timeline (a counterexample of a
/// million host steps took 6.4 GB as one JSON value). Buffer `out`.
pub fn write_chrome_trace(t: &Timeline, title: &str, out: &mut dyn Write) -> std::io::Result<()> {
    write!(out, "{{\"displayTimeUnit\":\"ms\",\"otherData\":")?;
    serde_json::to_writer(
        &mut *out,
        &json!({ "title": title, "unit": "one millisecond per host step" }),
    )?;
    write!(out, ",\"traceEvents\":[")?;
    let mut first = true;
    let mut event = |out: &mut dyn Write, e: Value| -> std::io::Result<()> {
        if !std::mem::take(&mut first) {
            out.write_all(b",")?;
        }
        serde_json::to_writer(&mut *out, &e)?;
        Ok(())
    };
    let end = (t.steps as u64 + 1) * STEP_US;
    // Tracks: (rank, name) → tid; threads first, then streams.
    let mut tids: BTreeMap<(u32, String), u64> = BTreeMap::new();
    let tid = |rank: u32, name: String, tids: &mut BTreeMap<(u32, String), u64>| -> u64 {
        let next = tids.len() as u64 + 1;
        *tids.entry((rank, name)).or_insert(next)
    };
    // Each call's thread's next call, found in one pass from the end.
    let mut next_of: Vec<Option<usize>> = vec![None; t.calls.len()];
    let mut later: HashMap<(u32, &str), usize> = HashMap::new();
    for (i, c) in t.calls.iter().enumerate().rev() {
        next_of[i] = later.insert((c.rank, c.thread.as_str()), i);
    }
    drop(later);
    for (i, c) in t.calls.iter().enumerate() {
        let id = tid(c.rank, format!("thread {}", c.thread), &mut tids);
        // A call lasts until the thread's next call (it was blocked until
        // then), or to the end if it is the thread's last.
        let next = next_of[i].map(|n| t.calls[n].step);
        let blocked = t.stuck.as_ref().and_then(|s| {
            s.blocked
                .iter()
                .find(|b| b.rank == c.rank && b.thread == c.thread && next.is_none())
                .map(|b| b.waits_for.clone())
        });
        let stop = next.map_or(end, |s| s as u64 * STEP_US);
        let start = c.step as u64 * STEP_US;
        event(
            out,
            json!({
                "name": c.call,
                "cat": "host",
                "ph": "X",
                "pid": c.rank,
                "tid": id,
                "ts": start,
                "dur": stop.saturating_sub(start).max(STEP_US / 4),
                "args": { "at": c.place, "step": c.step + 1, "blocked": blocked },
            }),
        )?;
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
        event(
            out,
            json!({
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
            }),
        )?;
    }
    let mut ranks: Vec<u32> = tids.keys().map(|(r, _)| *r).collect();
    ranks.dedup();
    for r in ranks {
        event(
            out,
            json!({
                "name": "process_name", "ph": "M", "pid": r, "tid": 0,
                "args": { "name": format!("rank {r}") },
            }),
        )?;
    }
    for ((rank, name), id) in &tids {
        event(
            out,
            json!({
                "name": "thread_name", "ph": "M", "pid": rank, "tid": id,
                "args": { "name": name },
            }),
        )?;
        event(
            out,
            json!({
                "name": "thread_sort_index", "ph": "M", "pid": rank, "tid": id,
                "args": { "sort_index": id },
            }),
        )?;
    }
    write!(out, "]}}")?;
    out.flush()
}

/// Writes the trace-event JSON of a timeline to the file at `path`; a
/// regular file it could not finish is removed (a device or a pipe is
/// left alone).
pub fn write_chrome_trace_to(
    t: &Timeline,
    title: &str,
    path: &std::path::Path,
) -> std::io::Result<()> {
    let file = std::fs::File::create(path)?;
    let regular = file.metadata().is_ok_and(|m| m.is_file());
    let mut out = std::io::BufWriter::new(file);
    let written = write_chrome_trace(t, title, &mut out)
        .and_then(|()| out.into_inner().map(drop).map_err(|e| e.into_error()));
    if written.is_err() && regular {
        let _ = std::fs::remove_file(path);
    }
    written
}
