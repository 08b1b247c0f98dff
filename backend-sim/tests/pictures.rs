//! `duplex check --format dot` writes valid Graphviz: on every example the
//! output parses (with a real DOT parser), every edge joins declared nodes,
//! and a deadlock's graph has one red edge per link of its cycle.

mod common;
use common::examples;

use dot_parser::{ast, canonical};
use duplex::compile::compile;
use duplex::{Model, Policy};
use duplex_sim::check::{self, Options, Verdict};
use duplex_sim::report::Report;

fn report(name: &str, text: &str) -> Report {
    let p = duplex::schedule::parse(text).expect("valid");
    let outcome = check::check(&compile(&p), &Options::default());
    Report::new(name, p.policy, p.model, &outcome)
}

#[test]
fn every_example_draws_as_valid_dot_with_its_cycle_in_red() {
    let mut deadlocks = 0;
    for (name, text) in examples() {
        let r = report(&name, &text);
        let dot = r.dot();
        let parsed = ast::Graph::try_from(dot.as_str())
            .unwrap_or_else(|e| panic!("{name}: not valid DOT ({e:?}):\n{dot}"));
        let g = canonical::Graph::from(parsed);
        for e in &g.edges.set {
            for end in [&e.from, &e.to] {
                assert!(
                    g.nodes.set.contains_key(end.as_str()),
                    "{name}: edge end {end} is not a declared node:\n{dot}"
                );
            }
        }
        if let Some(stuck) = &r.stuck {
            deadlocks += 1;
            let red = g
                .edges
                .set
                .iter()
                .filter(|e| {
                    e.attr.elems.iter().any(|(k, v)| {
                        let (k, v): (String, String) = (k.clone().into(), v.clone().into());
                        k == "penwidth" && v == "2"
                    })
                })
                .count();
            assert_eq!(red, stuck.cycle.len(), "{name}:\n{dot}");
        }
    }
    assert!(deadlocks >= 15, "only {deadlocks} deadlocks drawn");
}

#[test]
fn a_program_that_cannot_hang_draws_as_one_node() {
    let r = Report::new(
        "ok",
        Policy::PerDirection,
        Model::default(),
        &check::Outcome {
            verdict: Verdict::Ok,
            stats: check::check(
                &compile(&duplex::schedule::parse("ranks 2\nrank 0:\nrank 1:\n").expect("valid")),
                &Options::default(),
            )
            .stats,
        },
    );
    let dot = r.dot();
    let g = canonical::Graph::from(ast::Graph::try_from(dot.as_str()).expect("valid DOT"));
    assert_eq!(g.nodes.set.len(), 1);
    assert!(g.edges.set.is_empty());
}

/// Checks `trace` against the trace-event format (the subset Perfetto
/// needs): a `traceEvents` array of objects with a name, a phase, integer
/// pid and tid; complete events (`X`) with non-negative `ts` and `dur`;
/// metadata (`M`) naming processes and threads. Returns the complete events.
fn complete_events(trace: &serde_json::Value) -> Vec<serde_json::Value> {
    let events = trace["traceEvents"].as_array().expect("traceEvents");
    let mut complete = Vec::new();
    for e in events {
        assert!(e["name"].is_string(), "{e}");
        assert!(e["pid"].is_u64() && e["tid"].is_u64(), "{e}");
        match e["ph"].as_str() {
            Some("X") => {
                assert!(e["ts"].is_u64() && e["dur"].is_u64(), "{e}");
                complete.push(e.clone());
            }
            Some("M") => assert!(e["args"]["name"].is_string() || e["args"]["sort_index"].is_u64()),
            other => panic!("unexpected phase {other:?}: {e}"),
        }
    }
    complete
}

#[test]
fn a_counterexample_opens_as_a_perfetto_trace_with_what_held_each_op() {
    let text = examples()
        .into_iter()
        .find(|(n, _)| n == "seed-rpc.sched")
        .expect("seed-rpc")
        .1;
    let p = duplex::schedule::parse(&text).expect("valid");
    let c = compile(&p);
    let Verdict::Deadlock { schedule, .. } = check::check(&c, &Options::default()).verdict else {
        panic!("seed-rpc hangs")
    };
    let timeline = check::trace_of(&c, &schedule)
        .expect("fits")
        .timeline(p.model);
    let json = duplex_sim::perfetto::chrome_trace(&timeline, "seed-rpc");
    let events = complete_events(&serde_json::from_str(&json.to_string()).expect("JSON"));
    let host = events.iter().filter(|e| e["cat"] == "host").count();
    let stuck: Vec<_> = events
        .iter()
        .filter(|e| e["cat"] == "device,stuck")
        .collect();
    assert!(host >= 8, "{json}");
    assert_eq!(stuck.len(), 4, "the four ops of the cycle: {json}");
    for e in stuck {
        let held = e["args"]["held by"].as_str().expect("held by");
        assert!(held.starts_with("R4") || held.starts_with("R1"), "{held}");
    }
}

#[test]
fn a_failing_simulated_check_writes_its_trace() {
    use duplex::Transport;
    let path = std::env::temp_dir().join(format!("duplex-sim-trace-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let seed = |t: &duplex_sim::SimRank| -> duplex::Result<()> {
        let peer = 1 - t.rank();
        let out = t.alloc::<u32>(16)?;
        let mut inb = t.alloc::<u32>(16)?;
        t.send(&out, peer)?;
        t.recv(&mut inb, peer)?;
        t.synchronize()
    };
    assert!(duplex_sim::Sim::new(2).trace_to(&path).check(seed).is_err());
    let written = std::fs::read_to_string(&path).expect("the trace was written");
    let events = complete_events(&serde_json::from_str(&written).expect("JSON"));
    assert_eq!(
        events.iter().filter(|e| e["cat"] == "device,stuck").count(),
        4,
        "{written}"
    );
    let _ = std::fs::remove_file(&path);
    // A check that passes writes nothing.
    duplex_sim::Sim::new(2)
        .policy(Policy::PerDirection)
        .trace_to(&path)
        .check(seed)
        .expect("per-direction completes");
    assert!(!path.exists());
}
