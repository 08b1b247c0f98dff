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
