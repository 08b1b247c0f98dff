//! The checker's advice on every example: each printed repair, applied to
//! the file as its edits say, gives a program the checker finds `ok`; and
//! every `ok` example with eager capacity or warm channels is checked for a
//! latent hang.

mod common;
use common::examples;

use duplex::compile::compile;
use duplex_sim::advice::{Budget, apply, latent, repairs};
use duplex_sim::check::{self, Options, Verdict};

fn verdict(text: &str) -> Verdict {
    let p = duplex::schedule::parse(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    check::check(&compile(&p), &Options::default()).verdict
}

#[test]
fn every_printed_repair_applied_to_its_file_gives_an_ok_program() {
    let mut repaired = 0;
    let mut hangs = 0;
    for (name, text) in examples() {
        let p = duplex::schedule::parse(&text).expect("valid");
        let Verdict::Deadlock { stuck, .. } = verdict(&text) else {
            continue;
        };
        hangs += 1;
        for r in repairs(&p, Some(&text), &stuck, &Budget::default(), None) {
            let fixed = apply(&text, &r.edits)
                .unwrap_or_else(|e| panic!("{name}: `{}` does not apply: {e}", r.title));
            assert!(
                matches!(verdict(&fixed), Verdict::Ok),
                "{name}: `{}` does not make it ok:\n{fixed}",
                r.title
            );
            repaired += 1;
        }
    }
    assert!(hangs >= 15, "only {hangs} examples hang");
    assert!(
        repaired >= hangs,
        "only {repaired} repairs for {hangs} hangs"
    );
}

#[test]
fn the_seed_is_repaired_by_lanes_and_its_eager_form_has_a_latent_hang() {
    let seed = examples()
        .into_iter()
        .find(|(n, _)| n == "seed.sched")
        .expect("seed.sched")
        .1;
    let p = duplex::schedule::parse(&seed).expect("valid");
    let Verdict::Deadlock { stuck, .. } = verdict(&seed) else {
        panic!("the seed hangs")
    };
    let r = repairs(&p, Some(&seed), &stuck, &Budget::default(), None);
    assert!(r[0].title.contains("own lane"), "{r:?}");
    // With eager capacity above the messages, the seed completes, but only
    // because of it.
    let small = seed
        .replace("256MiB", "4KiB")
        .replacen("ranks 2", "ranks 2\nmodel eager=64MiB", 1);
    assert!(matches!(verdict(&small), Verdict::Ok));
    let l = latent(
        &duplex::schedule::parse(&small).expect("valid"),
        &Budget::default(),
    );
    // It hangs under NCCL's contract, and on new communicators (whose
    // first message is a rendezvous).
    let settings: Vec<&str> = l.iter().map(|l| l.setting.as_str()).collect();
    assert_eq!(settings, ["eager=0B", "lazy-connect=on"]);
    assert!(l.iter().all(|l| l.stuck.cycle.len() == 4));
}

/// The repairs of `text` (which hangs), each applied to it: the edited
/// files, which must parse and check `ok`.
fn repaired(text: &str) -> Vec<(String, String)> {
    let p = duplex::schedule::parse(text).expect("valid");
    let Verdict::Deadlock { stuck, .. } = verdict(text) else {
        panic!("it hangs:\n{text}")
    };
    repairs(&p, Some(text), &stuck, &Budget::default(), None)
        .into_iter()
        .map(|r| {
            let fixed = apply(text, &r.edits).expect("applies");
            assert!(
                matches!(verdict(&fixed), Verdict::Ok),
                "`{}` does not make it ok:\n{fixed}",
                r.title
            );
            (r.title, fixed)
        })
        .collect()
}

/// Traffic placed by `stream=` alone is explicitly placed, on `world`: it
/// gets the repair that gives one direction a communicator of its own, as
/// traffic with `comm=` does (found by review: the README promised it, and
/// only `comm=` got it).
#[test]
fn traffic_placed_by_its_stream_alone_gets_a_communicator_per_direction() {
    let text = "ranks 2\nrank 0:\n  send 1 4KiB stream=s\n  recv 1 4KiB stream=s\nrank 1:\n  send 0 4KiB stream=s\n  recv 0 4KiB stream=s\n";
    let r = repaired(text);
    assert!(
        r.iter()
            .any(|(t, f)| t.contains("its own communicator") && f.contains("comm=world-1to0")),
        "{r:?}"
    );
}

/// A repair whose new names would be longer than a name may be is not
/// offered: every repair printed must give a file that parses (found by
/// review: a 251-byte communicator name became `comm=` and 256 bytes, which
/// the parser counted as a word of 261).
#[test]
fn a_repair_never_writes_a_name_the_parser_refuses() {
    let text = |long: &str| {
        format!(
            "ranks 2\ncomm {long} 0 1\nrank 0:\n  send 1 4KiB comm={long}\n  recv 1 4KiB comm={long}\nrank 1:\n  send 0 4KiB comm={long}\n  recv 0 4KiB comm={long}\n"
        )
    };
    // A name of the longest length, with `comm=` before it or `:` after
    // it, is valid.
    let max = "d".repeat(duplex::schedule::MAX_WORD);
    let ok = format!(
        "ranks 2\ncomm {max} 0 1\nrank 0 thread {max}:\n  send 1 4KiB comm={max}\nrank 1:\n  recv 0 4KiB comm={max}\n"
    );
    duplex::schedule::parse(&ok).unwrap_or_else(|e| panic!("{e}"));
    // 251 bytes and `-1to0`: the longest name, offered (and parsed, by
    // `repaired`); one byte more, not offered.
    let fits = "c".repeat(251);
    assert!(
        repaired(&text(&fits))
            .iter()
            .any(|(_, f)| f.contains(&format!("{fits}-1to0"))),
        "the repair with a name of 256 bytes"
    );
    let long = "c".repeat(252);
    for (title, fixed) in repaired(&text(&long)) {
        assert!(!fixed.contains(&format!("{long}-1to0")), "{title}");
    }
}
