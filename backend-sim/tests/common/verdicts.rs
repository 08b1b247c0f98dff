//! Checking a schedule's text to a verdict: what the rule-by-rule test
//! files share (`rules.rs`, `copy_lanes.rs`).

use duplex::compile::compile;
use duplex_sim::check::{self, Outcome};

/// The checker's outcome on `src` (a valid schedule).
pub(crate) fn run(src: &str) -> Outcome {
    let program = duplex::schedule::parse(src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    check::check(&compile(&program), &check::Options::default())
}

/// The checker's verdict on `src`: `ok`, `deadlock`, `error` or
/// `inconclusive`.
pub(crate) fn verdict(src: &str) -> &'static str {
    run(src).verdict.kind()
}
