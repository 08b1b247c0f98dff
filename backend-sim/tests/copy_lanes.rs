//! Copy-engine lanes, rule by rule (C1–C6 of `docs/semantics.md`, "Copy-engine
//! lanes"). As in `rules.rs`, each rule is tested by programs that differ
//! only in what the rule is about: the same program with its large ops on
//! copy-engine lanes (`copy-from=1MiB`) and on NCCL lanes (`copy-from=` above
//! every op), so that a machine without the rule gets one verdict wrong.

use duplex::compile::compile;
use duplex::machine::{HostCall, ProgramError};
use duplex_sim::check::Verdict;

#[path = "common/verdicts.rs"]
mod verdicts;
use verdicts::{run, verdict};

/// Two ranks under `policy per-direction copy-from=COPY` and `model`.
fn two_ranks(copy: &str, model: &str, r0: &str, r1: &str) -> String {
    let model = if model.is_empty() {
        String::new()
    } else {
        format!("model {model}\n")
    };
    format!("ranks 2\npolicy per-direction copy-from={copy}\n{model}rank 0:\n{r0}\nrank 1:\n{r1}\n")
}

/// Copy-engine lanes for ops of 1 MiB and more.
const COPY: &str = "1MiB";
/// No op of these programs is this large: every op on NCCL lanes.
const NCCL: &str = "1GiB";

// C1 placement -------------------------------------------------------------------

#[test]
fn c1_large_ops_go_on_the_copy_lane_on_the_nccl_lanes_stream() {
    let src = two_ranks(
        COPY,
        "",
        "send 1 4MiB\nsend 1 4KiB",
        "recv 0 4MiB\nrecv 0 4KiB",
    );
    let compiled = compile(&duplex::schedule::parse(&src).expect("valid"));
    let setup = &compiled.setup;
    let placed: Vec<(String, bool, String)> = compiled.scripts[0]
        .iter()
        .filter_map(|c| match c {
            HostCall::Launch(l) => Some(&l.ops[0]),
            _ => None,
        })
        .map(|o| {
            let c = &setup.comms[o.comm.0 as usize];
            (
                c.name.clone(),
                c.copy,
                setup.streams[o.stream.0 as usize].name.clone(),
            )
        })
        .collect();
    assert_eq!(
        placed,
        [
            ("copy:0->1".to_string(), true, "lane:0->1".to_string()),
            ("lane:0->1".to_string(), false, "lane:0->1".to_string()),
        ]
    );
    assert_eq!(verdict(&src), "ok");
}

#[test]
fn c1_both_lanes_of_a_direction_share_its_stream() {
    // Rank 0's copy send is ahead of its NCCL send on the one stream
    // lane:0->1; rank 1 receives in the other order, so each waits for
    // the other (R1, R4). On separate streams both would complete.
    let src = two_ranks(
        COPY,
        "",
        "send 1 4MiB\nsend 1 4KiB",
        "recv 0 4KiB\nrecv 0 4MiB",
    );
    assert_eq!(verdict(&src), "deadlock");
    // The same on NCCL lanes alone is a size mismatch at the first pair.
    assert_eq!(verdict(&src.replace(COPY, NCCL)), "error");
}

#[test]
fn c1_a_pair_whose_sizes_straddle_the_threshold_meets_on_neither_lane() {
    let src = two_ranks(COPY, "", "send 1 2MiB", "recv 0 512KiB");
    let Verdict::Deadlock { stuck, .. } = run(&src).verdict else {
        panic!("expected a deadlock: each op waits on its own lane for a partner");
    };
    assert!(
        !stuck.missing.is_empty(),
        "both ops lack a partner on their lane: {stuck:?}"
    );
    // On one lane the two meet, and differ in size.
    assert_eq!(verdict(&src.replace(COPY, NCCL)), "error");
}

// C2 matching and rendezvous --------------------------------------------------------

#[test]
fn c2_a_size_mismatch_on_a_copy_lane_names_both_ops() {
    let src = two_ranks(COPY, "", "send 1 2MiB", "recv 0 3MiB");
    match run(&src).verdict {
        Verdict::Error {
            error: ProgramError::SizeMismatch { send, recv },
            ..
        } => {
            assert_eq!((send.bytes, recv.bytes), (2 << 20, 3 << 20));
            assert_eq!(send.comm, "copy:0->1");
        }
        other => panic!("expected a size mismatch, got {other:?}"),
    }
}

// C3 no buffering -------------------------------------------------------------------

#[test]
fn c3_a_copy_lane_never_buffers_whatever_the_eager_capacity() {
    // Rank 0 waits for its send before rank 1 may post the recv.
    let src = two_ranks(
        COPY,
        "eager=64MiB",
        "send 1 4MiB\nsync\nnotify 1 go",
        "await 0 go\nrecv 0 4MiB",
    );
    assert_eq!(verdict(&src), "deadlock");
    assert_eq!(verdict(&src.replace(COPY, NCCL)), "ok");
}

// C4 always connected -------------------------------------------------------------

#[test]
fn c4_copy_lanes_are_connected_under_lazy_connect() {
    let src = two_ranks(COPY, "lazy-connect=on", "send 1 4MiB", "recv 0 4MiB");
    let compiled = compile(&duplex::schedule::parse(&src).expect("valid"));
    let lane = compiled
        .setup
        .comms
        .iter()
        .find(|c| c.name == "copy:0->1")
        .expect("the copy lane exists");
    assert!(lane.copy && lane.warm);
    assert_eq!(verdict(&src), "ok");
}

// C5 no kernel ----------------------------------------------------------------------

#[test]
fn c5_a_copy_lane_takes_no_kernel_slot() {
    // Rank 0's large send is in progress while its small recv (NCCL, on the
    // other lane's stream) needs the one kernel slot; rank 1's small send
    // holds its slot until that recv runs, and its large recv comes after.
    let src = two_ranks(
        COPY,
        "kernels=1",
        "send 1 256MiB\nrecv 1 4KiB",
        "send 0 4KiB\nrecv 0 256MiB",
    );
    assert_eq!(verdict(&src), "ok");
    assert_eq!(verdict(&src.replace(COPY, NCCL)), "deadlock");
}

// C6 groups -------------------------------------------------------------------------

#[test]
fn c6_a_copy_op_matches_whether_or_not_either_side_grouped() {
    // Grouped on one side only: an error on NCCL lanes under
    // one-sided-groups=error (R8), not on copy-engine lanes.
    let src = two_ranks(
        COPY,
        "one-sided-groups=error",
        "group { send 1 4MiB; recv 1 4MiB }",
        "recv 0 4MiB\nsend 0 4MiB",
    );
    assert_eq!(verdict(&src), "ok");
    assert_eq!(verdict(&src.replace(COPY, NCCL)), "error");
}

#[test]
fn c6_a_groups_copy_launches_go_on_their_streams_after_its_nccl_launches() {
    // One group on rank 0 with a copy send written first and an NCCL send
    // second, both on stream lane:0->1: the NCCL launch goes first. (Rank
    // 1's plain recvs meet a group's ops: accepted, R8.)
    let group = "group { send 1 4MiB; send 1 4KiB }";
    let model = "one-sided-groups=accept";
    let nccl_first = two_ranks(COPY, model, group, "recv 0 4KiB\nrecv 0 4MiB");
    let copy_first = two_ranks(COPY, model, group, "recv 0 4MiB\nrecv 0 4KiB");
    assert_eq!(verdict(&nccl_first), "ok");
    assert_eq!(verdict(&copy_first), "deadlock");
}
