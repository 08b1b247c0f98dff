//! `duplex check --format dot` writes valid Graphviz: on every example the
//! output parses (with a real DOT parser), every edge joins declared nodes,
//! and a deadlock's graph has one red edge per link of its cycle.

use std::path::PathBuf;

use dot_parser::{ast, canonical};
use duplex::compile::compile;
use duplex::{Model, Policy};
use duplex_sim::check::{self, Options, Verdict};
use duplex_sim::report::Report;

fn examples() -> Vec<(String, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut out: Vec<(String, String)> = std::fs::read_dir(&dir)
        .expect("examples/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "sched"))
        .map(|p| {
            let name = p
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            (name, std::fs::read_to_string(&p).expect("readable"))
        })
        .collect();
    out.sort();
    out
}

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
