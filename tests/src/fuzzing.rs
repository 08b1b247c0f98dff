//! The harnesses of the fuzz targets in `fuzz/`. Each target's body is one
//! call of a function here, so that `cargo test` on the stable toolchain
//! replays the committed corpus and every past crash through the same code
//! (`tests/tests/fuzz_corpus.rs`). A harness returns normally when
//! every invariant holds and panics otherwise, printing the program in the
//! schedule format.
//!
//! * [`parse`]: arbitrary bytes through the schedule parser;
//! * [`program`]: programs spelled by bytes (the recipe of
//!   [`crate::strategies`], plus an optional [`Mutation`]) through the
//!   checker, against [`invariants`] and the monotonicity of the model knobs.

use duplex::Size;
use duplex::schedule::Program;

use crate::strategies::{Bytes, Mutation, Recipe, Shape};
use duplex::compile::{Compiled, Remaining, compile};
use duplex::machine::{Status, ThreadId};
use duplex_sim::check::{self, Options, Step, Verdict};

/// The state bound of a check of a program built by [`program`]: far above
/// what the programs of [`shape`] need, so reaching it is a finding.
pub const MAX_STATES: usize = 200_000;

/// The state bound of the search without reduction that [`invariants`]
/// compares with the reduced one: that search grows fast with the number of
/// threads, and a program it cannot finish within this bound is not
/// compared.
pub const FULL_MAX_STATES: usize = 4_000;

/// The state bound of a check of a program that [`parse`] read: such
/// programs may be arbitrarily large, so reaching it is not a finding.
pub const PARSED_MAX_STATES: usize = 5_000;

/// The shape of the programs of [`program`]: the default [`Shape`] with
/// one to four ranks, up to six messages, sizes from 0 bytes to 64 KiB,
/// one more of everything else, and every model knob both ways: groups on
/// one side accepted or an error (R8), copy-engine lanes from 4 KiB or
/// none under `per-direction`, and R6 as measured or as written
/// (`cold-channels=mismatched`).
pub fn shape() -> Shape {
    Shape {
        copy_from: vec![None, Some(Size(4 << 10))],
        cold_channels: vec![false, true],
        one_sided_groups: vec![true, false],
        ranks: 1..=4,
        messages: 0..=6,
        extra_threads: 2,
        sizes: vec![
            Size(4 << 10),
            Size(0),
            Size(1),
            Size(1 << 10),
            Size(16 << 10),
            Size(64 << 10),
        ],
        eager: vec![
            Size(0),
            Size(1),
            Size(4 << 10),
            Size(16 << 10),
            Size(1 << 20),
        ],
        kernels: vec![None, Some(1), Some(2), Some(3)],
        comms: 3,
        events: 2,
        syncs: 2,
        notifies: 2,
        ..Shape::default()
    }
}

/// The `parse` target. Whatever the bytes, the parser returns, and read by
/// one thread or by three it returns the same; a program it accepts prints
/// in a form that parses to the same program and prints the same again
/// ([`round_trip`]); a small one (at most 8 ranks and 32 statements)
/// compiles and passes [`invariants`] within [`PARSED_MAX_STATES`].
pub fn parse(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let parsed = duplex::schedule::parse(text);
    // Read by three threads, the file gives the same program or error.
    assert_eq!(duplex::schedule::parse_with(text, 3), parsed, "{text:?}");
    let Ok(program) = parsed else {
        return;
    };
    round_trip(&program);
    let statements: usize = program.threads.iter().map(|t| t.body.len()).sum();
    if program.ranks <= 8 && statements <= 32 {
        invariants(&program, PARSED_MAX_STATES, false);
    }
}

/// The `program` target. The bytes spell a well-formed program of
/// [`shape`] and, optionally, a [`Mutation`] of it. The program prints and
/// parses back; the checker decides it within [`MAX_STATES`] and passes
/// [`invariants`]; a well-formed (unmutated) program never has a program
/// error; and when it is `ok`, it stays `ok` with more eager capacity and,
/// if each rank has one host thread, with `lazy-connect=off`.
pub fn program(data: &[u8]) {
    let shape = shape();
    let mut bytes = Bytes::new(data);
    let original = Recipe::from_bytes(&shape, &mut bytes).build(&shape);
    let at = usize::from(bytes.byte());
    let mutation = match bytes.byte() % 6 {
        1 => Some(Mutation::Swap(at)),
        2 => Some(Mutation::Drop(at)),
        3 => Some(Mutation::Resize(at)),
        4 => Some(Mutation::Reverse(at)),
        5 => Some(Mutation::Ungroup(at)),
        _ => None,
    };
    let mutant = mutation.and_then(|m| m.apply(&original));
    let well_formed = mutant.is_none();
    let p = mutant.unwrap_or(original);
    round_trip(&p);
    let verdict = invariants(&p, MAX_STATES, true);
    if well_formed {
        // The recipe may group one side of a message and not the other:
        // under `one-sided-groups=error` that is the program error R8
        // names, between two ops of which exactly one is grouped, and no
        // other error is.
        let one_sided = |v: &Verdict| {
            matches!(v, Verdict::Error {
                error: duplex::machine::ProgramError::GroupMismatch { send, recv },
                ..
            } if !p.model.one_sided_groups && send.grouped != recv.grouped)
        };
        assert!(
            !matches!(verdict, Verdict::Error { .. }) || one_sided(&verdict),
            "a well-formed program has a program error: {verdict:?}\n{p}"
        );
    }
    if !matches!(verdict, Verdict::Ok) {
        return;
    }
    let extra = [1, 1 << 10, 64 << 10, 1 << 30][usize::from(bytes.byte()) % 4];
    let mut more = p.clone();
    more.model.eager = Size(p.model.eager.0.saturating_add(extra));
    assert!(
        is_ok(&more),
        "ok with eager={}, not with eager={}:\n{p}",
        p.model.eager,
        more.model.eager
    );
    // With several host threads on a rank this does not hold (a handshake
    // can hide a race with another thread's `sync`: see
    // tests/properties.rs), so only with one thread per rank.
    if p.model.lazy_connect && p.threads.iter().all(|t| t.name.is_none()) {
        let mut warm = p.clone();
        warm.model.lazy_connect = false;
        assert!(
            is_ok(&warm),
            "ok with lazy-connect=on, not with lazy-connect=off:\n{p}"
        );
    }
}

fn is_ok(p: &Program) -> bool {
    let options = Options {
        max_states: MAX_STATES,
        reduce: true,
        ..Options::default()
    };
    matches!(check::check(&compile(p), &options).verdict, Verdict::Ok)
}

/// Printing `p` and parsing the text gives `p` back, and printing that gives
/// the same text.
///
/// # Panics
///
/// When either fails.
pub fn round_trip(p: &Program) {
    let text = p.to_string();
    match duplex::schedule::parse(&text) {
        Ok(again) => {
            assert!(
                again.without_lines() == p.without_lines(),
                "printing and parsing changed the program:\n{text}\nparsed back as\n{again}"
            );
            assert_eq!(again.to_string(), text, "printing is not canonical");
        }
        Err(e) => panic!("the printed program does not parse: {e}\n{text}"),
    }
}

/// The checker's invariants on one program, checked within `max_states`:
///
/// * it returns (no panic), and, when `conclusive`, decides;
/// * a deadlock's reported interleaving replays (through
///   [`check::replay`]) step for step to a stuck state with the reported
///   explanation; an error's replays to the same error;
/// * the search without reduction ([`Options::reduce`] off) finds an
///   interleaving that hangs or errs exactly when the reduced one does
///   (compared when both decide, the full one within
///   [`FULL_MAX_STATES`]).
///
/// Returns the reduced search's verdict.
///
/// # Panics
///
/// When an invariant fails, with the program in the message.
pub fn invariants(p: &Program, max_states: usize, conclusive: bool) -> Verdict {
    let c = compile(p);
    let reduced = check::check(
        &c,
        &Options {
            max_states,
            reduce: true,
            ..Options::default()
        },
    )
    .verdict;
    if conclusive {
        assert!(
            !matches!(reduced, Verdict::Inconclusive),
            "the check did not decide within {max_states} states:\n{p}"
        );
    }
    match &reduced {
        Verdict::Deadlock {
            stuck,
            trace,
            schedule: printed,
        } => {
            let (m2, steps2, result2) = check::replay_schedule(&c, printed)
                .unwrap_or_else(|e| panic!("a deadlock's schedule does not replay: {e}\n{p}"));
            assert!(result2.is_ok(), "{p}");
            assert_eq!(
                steps2, *trace,
                "a deadlock's schedule replays other steps:\n{p}"
            );
            assert_eq!(
                m2.stuck(&Remaining(&c)),
                **stuck,
                "a deadlock's schedule replays to another stuck state:\n{p}"
            );
            let (m, steps, result) = check::replay(&c, &schedule(&c, trace, p));
            assert!(
                result.is_ok(),
                "a deadlock's interleaving replays to an error {result:?}:\n{p}"
            );
            assert_eq!(
                steps, *trace,
                "a deadlock's interleaving does not replay step for step:\n{p}"
            );
            assert_eq!(
                m.status(&Remaining(&c)),
                Status::Stuck,
                "a deadlock's interleaving does not replay to a stuck state:\n{p}"
            );
            assert_eq!(
                m.stuck(&Remaining(&c)),
                **stuck,
                "a deadlock's interleaving replays to another stuck state:\n{p}"
            );
        }
        Verdict::Error {
            error,
            trace,
            schedule: printed,
        } => {
            let (_, steps2, _) = check::replay_schedule(&c, printed)
                .unwrap_or_else(|e| panic!("an error's schedule does not replay: {e}\n{p}"));
            assert_eq!(
                steps2, *trace,
                "an error's schedule replays other steps:\n{p}"
            );
            let (m, steps, result) = check::replay(&c, &schedule(&c, trace, p));
            assert_eq!(
                steps, *trace,
                "an error's interleaving does not replay step for step:\n{p}"
            );
            let found = match result {
                Err(e) => Some(e),
                Ok(()) => {
                    assert_eq!(m.status(&Remaining(&c)), Status::Finished, "{p}");
                    m.leftover()
                }
            };
            assert_eq!(
                found.as_ref(),
                Some(error),
                "an error's interleaving replays to another outcome:\n{p}"
            );
        }
        Verdict::Ok | Verdict::Inconclusive => {}
    }
    let full = check::check(
        &c,
        &Options {
            max_states: max_states.min(FULL_MAX_STATES),
            reduce: false,
            ..Options::default()
        },
    )
    .verdict;
    if !matches!(reduced, Verdict::Inconclusive) && !matches!(full, Verdict::Inconclusive) {
        assert_eq!(
            matches!(reduced, Verdict::Ok),
            matches!(full, Verdict::Ok),
            "the reduced search says {}, the full search {}:\n{p}",
            reduced.kind(),
            full.kind()
        );
    }
    reduced
}

/// The threads that took a reported interleaving's steps.
fn schedule(c: &Compiled, trace: &[Step], p: &Program) -> Vec<ThreadId> {
    trace
        .iter()
        .map(|s| {
            let i = c
                .setup
                .threads
                .iter()
                .position(|t| t.rank == s.rank && t.name == s.thread);
            match i {
                Some(i) => ThreadId(i as u32),
                None => panic!(
                    "step {} names rank {} thread {}, which does not exist:\n{p}",
                    s.step, s.rank, s.thread
                ),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_harnesses_accept_what_they_should() {
        parse(b"ranks 2\nrank 0:\n  send 1 4KiB\n  recv 1 4KiB\nrank 1:\n  send 0 4KiB\n  recv 0 4KiB\n");
        parse(b"\xff\xfe not utf-8");
        parse(b"ranks nope");
        program(&[]);
        program(&(0..=255u8).collect::<Vec<_>>());
    }
}
