//! Every point-to-point op opens a `duplex.op` span carrying its identity
//! (rank, thread, lane, peer, bytes), for a subscriber the user installs;
//! without one, nothing is recorded.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use duplex::{Policy, Transport};
use duplex_sim::{Sim, SimRank};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Records the fields of every span opened.
#[derive(Default)]
struct Spans {
    next: AtomicU64,
    seen: Mutex<Vec<(String, HashMap<String, String>)>>,
}

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0
            .insert(field.name().to_string(), format!("{value:?}"));
    }
}

/// The subscriber: a handle on the shared record.
struct Recorder(Arc<Spans>);

impl Subscriber for Recorder {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let mut fields = HashMap::new();
        span.record(&mut Fields(&mut fields));
        if let Ok(mut seen) = self.0.seen.lock() {
            seen.push((span.metadata().name().to_string(), fields));
        }
        Id::from_u64(self.0.next.fetch_add(1, Ordering::Relaxed) + 1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

fn exchange(t: &SimRank) -> duplex::Result<()> {
    let peer = 1 - t.rank();
    let out = t.alloc::<u32>(64)?;
    let mut inb = t.alloc::<u32>(64)?;
    t.send(&out, peer)?;
    t.recv(&mut inb, peer)?;
    t.synchronize()
}

#[test]
fn every_op_opens_a_span_with_its_identity() {
    let spans = Arc::new(Spans::default());
    tracing::subscriber::set_global_default(Recorder(spans.clone())).expect("the only subscriber");
    Sim::new(2)
        .policy(Policy::PerDirection)
        .run(1, exchange)
        .expect("completes");
    let seen = spans.seen.lock().expect("not poisoned");
    let ops: Vec<_> = seen.iter().filter(|(n, _)| n == "duplex.op").collect();
    assert_eq!(ops.len(), 4, "{seen:?}");
    for (_, f) in &ops {
        for key in ["backend", "rank", "thread", "lane", "op", "peer", "bytes"] {
            assert!(f.contains_key(key), "a span lacks {key}: {f:?}");
        }
        assert_eq!(f["bytes"], "256");
    }
    let send0 = ops
        .iter()
        .find(|(_, f)| f["rank"] == "0" && f["op"] == "\"send\"")
        .expect("rank 0's send");
    assert_eq!(send0.1["lane"], "lane:0->1");
    assert_eq!(send0.1["peer"], "1");
}
