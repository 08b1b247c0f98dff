//! The checker and the simulated transport drive one state machine: running
//! a schedule file through `duplex::schedule::execute` on the simulator must
//! reach the verdict that `duplex check` gives the same file.

use std::path::Path;
use std::sync::Arc;

use duplex::Size;
use duplex::compile::compile;
use duplex::schedule::{Program, StmtKind, parse};
use duplex_sim::check;
use duplex_sim::{Failure, Sim};

/// Divides every size (rounding up) and the eager capacity by `2^16`, so
/// that the simulator moves kilobytes instead of gigabytes while every
/// comparison of R5 keeps its outcome on these examples.
fn scaled(mut p: Program) -> Program {
    let shrink = |s: &mut Size| s.0 = s.0.div_ceil(1 << 16);
    p.model.eager.0 >>= 16;
    // Ops keep their lanes: a ≥ c implies ⌈a/k⌉ ≥ ⌈c/k⌉.
    if let Some(c) = p.copy_from.as_mut() {
        shrink(c);
    }
    for t in &mut p.threads {
        for st in &mut t.body {
            match &mut st.kind {
                StmtKind::Op(op) => shrink(&mut op.size),
                StmtKind::Group(ops) => ops.iter_mut().for_each(|op| shrink(&mut op.size)),
                _ => {}
            }
        }
    }
    p
}

fn checker(p: &Program) -> &'static str {
    check::check(&compile(p), &check::Options::default())
        .verdict
        .kind()
}

fn simulator(p: &Program) -> &'static str {
    let program = Arc::new(p.clone());
    let result = Sim::new(p.ranks)
        .policy(p.policy)
        .copy_from(p.copy_from)
        .model(p.model)
        .check(|t| duplex::schedule::execute(&program, t));
    match result {
        Ok(_) => "ok",
        Err(Failure::Hang(_)) => "deadlock",
        Err(Failure::Program { .. }) => "error",
        // An invalid call (R12, say) is refused to the calling code, which
        // `execute` returns: the checker's `error` too.
        Err(Failure::Thread { error, .. }) if error.starts_with("invalid call") => "error",
        Err(other) => panic!("the simulator failed otherwise: {other}"),
    }
}

#[test]
fn every_example_gets_the_same_verdict_from_both() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).expect("examples/") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "sched") {
            continue;
        }
        let p = scaled(parse(&std::fs::read_to_string(&path).expect("readable")).expect("valid"));
        for policy in [duplex::Policy::Shared, duplex::Policy::PerDirection] {
            let mut p = p.clone();
            p.policy = policy;
            assert_eq!(
                checker(&p),
                simulator(&p),
                "{} under {policy}",
                path.display()
            );
            n += 1;
        }
    }
    assert!(n >= 30);
}

#[test]
fn a_size_mismatch_is_an_error_for_both() {
    let p = parse("ranks 2\nrank 0:\n  send 1 4KiB\nrank 1:\n  recv 0 8KiB\n").unwrap();
    assert_eq!(checker(&p), "error");
    assert_eq!(simulator(&p), "error");
}
