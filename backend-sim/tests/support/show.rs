//! A search's result in one short line, for the messages of the tests
//! that compare two searches (`tests/dpor_review.rs`,
//! `tests/dpor_random.rs`; included by path in both).

use duplex_sim::{Failure, Run};

/// `Ok(N executions)`, or `Err(` the first line of the failure, at most
/// 200 characters `)`.
pub(crate) fn show(r: &Result<Run, Failure>) -> String {
    match r {
        Ok(run) => format!("Ok({} executions)", run.executions),
        Err(e) => format!(
            "Err({})",
            e.to_string()
                .lines()
                .next()
                .unwrap_or("")
                .chars()
                .take(200)
                .collect::<String>()
        ),
    }
}
