//! One group of tests per rule of `docs/semantics.md`. Each rule is tested by a
//! pair of programs that differ only in what the rule is about, so that a
//! checker without the rule gets one of the two verdicts wrong.

use duplex::compile::compile;
use duplex::machine::ProgramError;
use duplex::machine::ThreadId;
use duplex::report::Rule;
use duplex_sim::check::{self, Verdict};

#[path = "common/verdicts.rs"]
mod verdicts;
use verdicts::{run, verdict};

/// The rules named in the deadlock's cycle (or missing-partner chains).
fn cycle_rules(src: &str) -> Vec<Rule> {
    match run(src).verdict {
        Verdict::Deadlock { stuck, .. } => stuck
            .cycle
            .iter()
            .chain(&stuck.missing)
            .map(|l| l.rule)
            .collect(),
        other => panic!("expected a deadlock, got {other:?}"),
    }
}

fn two_ranks(header: &str, r0: &str, r1: &str) -> String {
    format!("ranks 2\n{header}\nrank 0:\n{r0}\nrank 1:\n{r1}\n")
}

// R1 stream order ----------------------------------------------------------

#[test]
fn r1_ops_on_one_stream_run_in_order() {
    let one_stream = two_ranks(
        "comm a 0 1\ncomm b 0 1",
        "send 1 1MiB comm=a stream=s\nrecv 1 1MiB comm=b stream=s",
        "send 0 1MiB comm=b stream=s\nrecv 0 1MiB comm=a stream=s",
    );
    let two_streams = one_stream
        .replace("recv 1 1MiB comm=b stream=s", "recv 1 1MiB comm=b stream=t")
        .replace("recv 0 1MiB comm=a stream=s", "recv 0 1MiB comm=a stream=t");
    assert_eq!(verdict(&one_stream), "deadlock");
    assert!(cycle_rules(&one_stream).contains(&Rule::R1));
    assert_eq!(verdict(&two_streams), "ok");
}

// R2 communicator order ----------------------------------------------------

#[test]
fn r2_ops_of_one_communicator_are_serialized_across_streams() {
    let src = two_ranks(
        "",
        "send 1 1MiB comm=world stream=a\nrecv 1 1MiB comm=world stream=b",
        "send 0 1MiB comm=world stream=a\nrecv 0 1MiB comm=world stream=b",
    );
    assert_eq!(verdict(&src), "deadlock");
    assert!(cycle_rules(&src).contains(&Rule::R2));
    let off = src.replace("ranks 2\n", "ranks 2\nmodel comm-order=off\n");
    assert_eq!(verdict(&off), "ok");
}

#[test]
fn r2_does_not_order_different_communicators() {
    let src = two_ranks(
        "comm a 0 1\ncomm b 0 1",
        "send 1 1MiB comm=a stream=x\nrecv 1 1MiB comm=b stream=y",
        "send 0 1MiB comm=b stream=y\nrecv 0 1MiB comm=a stream=x",
    );
    assert_eq!(verdict(&src), "ok");
}

// R3 matching ---------------------------------------------------------------

#[test]
fn r3_size_mismatch_names_both_ops() {
    let src = two_ranks("", "send 1 4KiB", "recv 0 8KiB");
    let Verdict::Error { error, .. } = run(&src).verdict else {
        panic!("expected an error")
    };
    let ProgramError::SizeMismatch { send, recv } = error else {
        panic!("expected a size mismatch, got {error}")
    };
    assert_eq!((send.rank, send.bytes, send.line), (0, 4096, Some(4)));
    assert_eq!((recv.rank, recv.bytes, recv.line), (1, 8192, Some(6)));
}

#[test]
fn r3_matching_is_by_position_in_the_channel() {
    let in_order = two_ranks("", "send 1 4KiB\nsend 1 8KiB", "recv 0 4KiB\nrecv 0 8KiB");
    let swapped = two_ranks("", "send 1 4KiB\nsend 1 8KiB", "recv 0 8KiB\nrecv 0 4KiB");
    assert_eq!(verdict(&in_order), "ok");
    assert_eq!(verdict(&swapped), "error");
}

#[test]
fn r3_channels_are_per_communicator() {
    // Same sizes in the other order, but on two communicators: each channel
    // matches on its own.
    let src = two_ranks(
        "comm a 0 1\ncomm b 0 1",
        "group { send 1 4KiB comm=a stream=s; send 1 8KiB comm=b stream=t }",
        "group { recv 0 8KiB comm=b stream=t; recv 0 4KiB comm=a stream=s }",
    );
    assert_eq!(verdict(&src), "ok");
}

#[test]
fn r3_a_buffered_message_never_received_is_an_error() {
    let src = two_ranks("model eager=1MiB", "send 1 4KiB", "");
    let Verdict::Error { error, .. } = run(&src).verdict else {
        panic!("expected an error")
    };
    assert!(
        matches!(error, ProgramError::NeverReceived { .. }),
        "{error}"
    );
}

// R4 rendezvous ---------------------------------------------------------------

#[test]
fn r4_a_send_waits_for_its_recv_to_start() {
    let send_first = two_ranks("", "send 1 4KiB\nrecv 1 4KiB", "send 0 4KiB\nrecv 0 4KiB");
    assert_eq!(verdict(&send_first), "deadlock");
    assert!(cycle_rules(&send_first).contains(&Rule::R4));
    let recv_first = two_ranks("", "send 1 4KiB\nrecv 1 4KiB", "recv 0 4KiB\nsend 0 4KiB");
    assert_eq!(verdict(&recv_first), "ok");
}

#[test]
fn r4_a_recv_whose_send_never_comes_is_reported_as_missing() {
    let src = two_ranks("", "recv 1 4KiB", "");
    let Verdict::Deadlock { stuck, .. } = run(&src).verdict else {
        panic!("expected a deadlock")
    };
    assert!(stuck.cycle.is_empty());
    assert_eq!(stuck.missing.len(), 1);
    assert!(
        stuck.missing[0]
            .waits_for
            .contains("no thread of rank 1 will ever issue the matching send")
    );
}

// R5 eager capacity -------------------------------------------------------------

#[test]
fn r5_sends_complete_into_a_connected_channel_buffer() {
    let prog = |size: &str| {
        two_ranks(
            "model eager=64MiB",
            &format!("send 1 {size}\nrecv 1 {size}"),
            &format!("send 0 {size}\nrecv 0 {size}"),
        )
    };
    assert_eq!(verdict(&prog("64MiB")), "ok");
    assert_eq!(verdict(&prog("65MiB")), "deadlock");
}

#[test]
fn r5_capacity_is_cumulative_per_channel() {
    let prog = |n: usize| {
        let sends = "send 1 16MiB\n".repeat(n);
        let recvs = "recv 0 16MiB\n".repeat(n);
        two_ranks(
            "model eager=64MiB",
            &format!("{sends}sync\nnotify 1 go"),
            &format!("await 0 go\n{recvs}"),
        )
    };
    assert_eq!(verdict(&prog(4)), "ok");
    assert_eq!(verdict(&prog(5)), "deadlock");
}

#[test]
fn r5_default_is_the_strict_contract() {
    let src = two_ranks("", "send 1 1B\nrecv 1 1B", "send 0 1B\nrecv 0 1B");
    assert_eq!(verdict(&src), "deadlock");
}

// R6 cold channel ----------------------------------------------------------------

#[test]
fn r6_the_first_message_of_a_cold_channel_is_a_rendezvous() {
    let cold = two_ranks(
        "model eager=64MiB lazy-connect=on",
        "send 1 4KiB comm=world stream=s\nrecv 1 4KiB comm=world stream=s",
        "send 0 4KiB comm=world stream=s\nrecv 0 4KiB comm=world stream=s",
    );
    assert_eq!(verdict(&cold), "deadlock");
    assert!(cycle_rules(&cold).contains(&Rule::R4));
    // Once a message has been delivered in each direction, the same
    // send-first exchange completes.
    let used = two_ranks(
        "model eager=64MiB lazy-connect=on",
        "group { send 1 4KiB comm=world stream=s; recv 1 4KiB comm=world stream=s }\nsend 1 4KiB comm=world stream=s\nrecv 1 4KiB comm=world stream=s",
        "group { send 0 4KiB comm=world stream=s; recv 0 4KiB comm=world stream=s }\nsend 0 4KiB comm=world stream=s\nrecv 0 4KiB comm=world stream=s",
    );
    assert_eq!(verdict(&used), "ok");
}

/// `cold-channels=mismatched`: only a channel with a side set up in a round
/// of mismatched calls (R7) is cold; a channel set up by complementary calls
/// buffers at once (as measured over loopback sockets).
#[test]
fn r6_under_cold_channels_mismatched_only_a_mismatched_round_leaves_a_channel_cold() {
    let both = |model: &str| {
        two_ranks(
            model,
            "send 1 4KiB comm=world stream=s\nrecv 1 4KiB comm=world stream=s",
            "send 0 4KiB comm=world stream=s\nrecv 0 4KiB comm=world stream=s",
        )
    };
    // Both ranks send first: the round is mismatched, the channels stay
    // cold, and the seed hangs as under R6 (NCCL: a hang over NVLink, an
    // internal error over sockets).
    let seed = both("model eager=64MiB lazy-connect=on cold-channels=mismatched");
    assert_eq!(verdict(&seed), "deadlock");
    assert!(cycle_rules(&seed).contains(&Rule::R4));
    assert!(!mismatched(&seed).is_empty());
    // R6 alone (`examples/r6-without-a-mismatched-round.sched`): every
    // round complementary, so nothing stays cold.
    let r6 = |knob: &str| {
        format!(
            "ranks 2\nmodel eager=64MiB lazy-connect=on {knob}\ncomm c 0 1\ncomm d 0 1\nrank 0:\n  send 1 4KiB comm=d stream=s\n  sync\n  send 1 4KiB comm=c stream=s\n  sync\n  send 1 4KiB comm=d stream=s\nrank 1:\n  recv 0 4KiB comm=d stream=s\n  recv 0 4KiB comm=d stream=s\n  recv 0 4KiB comm=c stream=s\n"
        )
    };
    assert_eq!(verdict(&r6("")), "deadlock");
    assert!(cycle_rules(&r6("")).contains(&Rule::R4));
    assert_eq!(verdict(&r6("cold-channels=mismatched")), "ok");
    // Ranks 0 and 1 of `comm c 0 2 1 3` are not half the communicator
    // apart: NCCL sends each direction's connection data separately, and a
    // send side waits for the peer's receive side, which the model's rounds
    // do not follow (R7, "Not followed by the model"): R6 stays there, and
    // their send-first exchange hangs under either value.
    let apart = |knob: &str| {
        format!(
            "ranks 4\nmodel eager=64MiB lazy-connect=on {knob}\ncomm c 0 2 1 3\nrank 0:\n  send 1 4KiB comm=c stream=s\n  recv 1 4KiB comm=c stream=s\nrank 1:\n  send 0 4KiB comm=c stream=s\n  recv 0 4KiB comm=c stream=s\n"
        )
    };
    assert_eq!(verdict(&apart("")), "deadlock");
    assert_eq!(verdict(&apart("cold-channels=mismatched")), "deadlock");
    // So does the seed on a world of three ranks (no two of them half
    // the communicator apart).
    let three = "ranks 3\nmodel eager=64MiB lazy-connect=on cold-channels=mismatched\nrank 0:\n  send 1 4KiB comm=world stream=s\n  recv 1 4KiB comm=world stream=s\nrank 1:\n  send 0 4KiB comm=world stream=s\n  recv 0 4KiB comm=world stream=s\n";
    assert_eq!(verdict(three), "deadlock");
    // The knob only removes waits: warm, it changes nothing.
    let warm = both("model eager=64MiB lazy-connect=off cold-channels=mismatched");
    assert_eq!(verdict(&warm), "ok");
}

// R7 lazy connection handshake ---------------------------------------------------

#[test]
fn r7_first_use_blocks_the_host_until_the_peer_uses_the_comm() {
    let src = two_ranks(
        "model lazy-connect=on\ncomm a 0 1\ncomm b 0 1",
        "send 1 4KiB comm=a stream=x\nrecv 1 4KiB comm=b stream=y",
        "send 0 4KiB comm=b stream=y\nrecv 0 4KiB comm=a stream=x",
    );
    let Verdict::Deadlock { stuck, .. } = run(&src).verdict else {
        panic!("expected a deadlock")
    };
    assert!(stuck.ops.is_empty(), "nothing reaches the device");
    assert_eq!(stuck.blocked.len(), 2);
    assert!(stuck.cycle.iter().all(|l| l.rule == Rule::R7));
    let warm = src.replace("model lazy-connect=on\n", "");
    assert_eq!(verdict(&warm), "ok");
}

#[test]
fn r7_the_handshake_is_completed_by_an_op_in_either_direction() {
    // Rank 1's first op on comm a is a send toward 0: it completes rank 0's
    // handshake for its recv.
    let src = two_ranks(
        "model lazy-connect=on\ncomm a 0 1",
        "recv 1 4KiB comm=a stream=x",
        "send 0 4KiB comm=a stream=x",
    );
    assert_eq!(verdict(&src), "ok");
}

#[test]
fn r7_each_side_of_a_connection_is_set_up_in_its_own_round() {
    // Both ranks' first sends pair up; rank 0's first recv then needs its
    // receive side, which pairs only with rank 1's next call that needs a
    // new side: rank 1's recv, issued after the notify that rank 0 posts
    // after its recv. Measured on the H200s (examples/cold-recv-needs-its-own-handshake.sched).
    let src = two_ranks(
        "model lazy-connect=on eager=64MiB",
        "send 1 4KiB comm=world stream=a\nrecv 1 4KiB comm=world stream=b\nnotify 1 go",
        "send 0 4KiB comm=world stream=a\nawait 0 go\nrecv 0 4KiB comm=world stream=b",
    );
    assert_eq!(verdict(&src), "deadlock");
    assert!(cycle_rules(&src).contains(&Rule::R7));
    // Notifying before the recv lets rank 1's recv pair with rank 0's: no
    // host call waits in a handshake any more (the program still hangs on
    // the device, R2 and R6, as the first messages of cold channels meet
    // sends serialized on one communicator).
    let fixed = src.replace(
        "recv 1 4KiB comm=world stream=b\nnotify 1 go",
        "notify 1 go\nrecv 1 4KiB comm=world stream=b",
    );
    assert!(
        !cycle_rules(&fixed).contains(&Rule::R7),
        "{:?}",
        cycle_rules(&fixed)
    );
}

#[test]
fn r7_per_direction_lanes_are_connected_at_creation() {
    let src = two_ranks(
        "model lazy-connect=on\npolicy per-direction",
        "send 1 4KiB\nrecv 1 4KiB",
        "send 0 4KiB\nrecv 0 4KiB",
    );
    assert_eq!(verdict(&src), "ok");
    let shared = src.replace("policy per-direction", "policy shared");
    assert_eq!(verdict(&shared), "deadlock");
}

/// The mismatched setups a program's hang names (R7, "A round of
/// mismatched calls").
fn mismatched(src: &str) -> Vec<String> {
    match run(src).verdict {
        Verdict::Deadlock { stuck, .. } => stuck.mismatched_setups,
        other => panic!("expected a deadlock, got {other:?}"),
    }
}

#[test]
fn r7_a_round_of_two_first_sends_is_named_and_a_send_with_a_recv_is_not() {
    let cold = "model lazy-connect=on";
    let sends = two_ranks(cold, "send 1 1MiB\nrecv 1 1MiB", "send 0 1MiB\nrecv 0 1MiB");
    let m = mismatched(&sends);
    assert_eq!(m.len(), 2, "{m:?}");
    assert!(
        m[0].contains("round 1")
            && m[0].contains("rank 1's `send 0 1MiB` (line 7) sets up its send side"),
        "{m:?}"
    );
    // Warm, no round at all.
    assert!(mismatched(&sends.replace("lazy-connect=on", "lazy-connect=off")).is_empty());
    // A send paired with a recv: complementary, nothing named (the hang
    // is another one: rank 1 sends a second message nobody receives).
    let matched = two_ranks(cold, "send 1 1MiB", "recv 0 1MiB\nsend 0 1MiB");
    assert!(mismatched(&matched).is_empty());
}

/// NCCL numbers a communicator's ranks by their world ranks (the split's
/// key), so "half the communicator apart" is in that order, not the order
/// the members were written in: in `comm c 0 2 1 3`, ranks 0 and 2 exchange
/// one message each way (named), ranks 0 and 1 do not (not named).
#[test]
fn r7_one_message_each_way_is_by_world_rank_order() {
    let prog = |a: u32, b: u32| {
        format!(
            "ranks 4\nmodel lazy-connect=on\ncomm c 0 2 1 3\nrank {a}:\n  send {b} 1MiB comm=c\n  recv {b} 1MiB comm=c\nrank {b}:\n  send {a} 1MiB comm=c\n  recv {a} 1MiB comm=c\n"
        )
    };
    assert_eq!(mismatched(&prog(0, 2)).len(), 2);
    assert!(mismatched(&prog(0, 1)).is_empty());
    assert!(mismatched(&prog(1, 3)).len() == 2);
}

// R8 groups -------------------------------------------------------------------------

#[test]
fn r8_ops_in_a_group_progress_independently() {
    let src = two_ranks(
        "",
        "group { send 1 1MiB; recv 1 1MiB }",
        "group { send 0 1MiB; recv 0 1MiB }",
    );
    assert_eq!(verdict(&src), "ok");
}

#[test]
fn r8_a_group_waits_for_every_stream_it_spans() {
    // Rank 0's group, on one communicator, spans streams a and b; stream b
    // first holds a recv that needs rank 1's second op, which is behind
    // rank 1's recv of the group's send. Rank 1's side is plain (a group of
    // one op is a plain call), which the calibrated model accepts (R8).
    let src = two_ranks(
        "model one-sided-groups=accept\ncomm c1 0 1\ncomm c3 0 1",
        "recv 1 1MiB comm=c3 stream=b\ngroup { send 1 1MiB comm=c1 stream=a; recv 1 1MiB comm=c1 stream=b }",
        "group { recv 0 1MiB comm=c1 stream=x }\nsend 0 1MiB comm=c3 stream=x\ngroup { send 0 1MiB comm=c1 stream=y }",
    );
    assert_eq!(verdict(&src), "deadlock");
    // Without the groups, the send on stream a is free to go.
    let ungrouped = src
        .replace(
            "group { send 1 1MiB comm=c1 stream=a; recv 1 1MiB comm=c1 stream=b }",
            "send 1 1MiB comm=c1 stream=a\nrecv 1 1MiB comm=c1 stream=b",
        )
        .replace(
            "group { recv 0 1MiB comm=c1 stream=x }",
            "recv 0 1MiB comm=c1 stream=x",
        )
        .replace(
            "group { send 0 1MiB comm=c1 stream=y }",
            "send 0 1MiB comm=c1 stream=y",
        );
    assert_eq!(verdict(&ungrouped), "ok");
}

#[test]
fn r8_a_group_is_launched_once_per_communicator() {
    // As measured on the H200s (examples/group-two-comms.sched): a group's
    // ops on two communicators are two launches, and only ops of one
    // communicator wait for each other's streams. The same program as
    // above with the group's recv on another communicator completes.
    let src = two_ranks(
        "model one-sided-groups=accept\ncomm c1 0 1\ncomm c3 0 1\ncomm c4 0 1",
        "recv 1 1MiB comm=c3 stream=b\ngroup { send 1 1MiB comm=c1 stream=a; recv 1 1MiB comm=c4 stream=b }",
        "group { recv 0 1MiB comm=c1 stream=x }\nsend 0 1MiB comm=c3 stream=x\ngroup { send 0 1MiB comm=c4 stream=x }",
    );
    assert_eq!(verdict(&src), "ok");
    // And two communicators' parts of one group on one stream run one
    // after the other (R1).
    let one_stream = two_ranks(
        "comm a 0 1\ncomm b 0 1",
        "group { send 1 4KiB comm=a stream=s; recv 1 4KiB comm=b stream=s }",
        "group { send 0 4KiB comm=b stream=s; recv 0 4KiB comm=a stream=s }",
    );
    assert_eq!(verdict(&one_stream), "deadlock");
}

#[test]
fn r8_grouping_on_one_side_only_is_an_error() {
    let src = two_ranks(
        "",
        "group { send 1 4KiB; recv 1 4KiB }",
        "recv 0 4KiB\nsend 0 4KiB",
    );
    let Verdict::Error { error, .. } = run(&src).verdict else {
        panic!("expected an error")
    };
    assert!(
        matches!(error, ProgramError::GroupMismatch { .. }),
        "{error}"
    );
    // A calibrated model that accepts it (NCCL 2.28 on the H200s completed
    // this pattern) runs it: the group's send meets the plain recv.
    let accepted = src.replace("ranks 2", "ranks 2\nmodel one-sided-groups=accept");
    assert_eq!(verdict(&accepted), "ok");
    // Accepting does not hide other errors: a size mismatch stays one.
    let resized = accepted.replace("recv 0 4KiB", "recv 0 8KiB");
    assert_eq!(verdict(&resized), "error");
}

#[test]
fn r8_a_large_group_runs_each_channel_in_order() {
    // 4,000 ops a side, sends and recvs interleaved: each op waits only
    // for the earlier ops of its own channel. (Each completion used to
    // look at every op of the group, and this took minutes.)
    // The i-th recv's size is the i-th send's, or the next one's.
    let ops = |peer: u32, shift: usize| {
        let body: Vec<String> = (0..2000)
            .map(|i| {
                format!(
                    "send {peer} {}B; recv {peer} {}B",
                    1 + i % 7,
                    1 + (i + shift) % 7
                )
            })
            .collect();
        format!("group {{ {} }}", body.join("; "))
    };
    assert_eq!(verdict(&two_ranks("", &ops(1, 0), &ops(0, 0))), "ok");
    // The same with rank 1's sizes in another order: the k-th send meets
    // the k-th recv of its channel (R3), and the mismatch is found.
    assert_eq!(verdict(&two_ranks("", &ops(1, 0), &ops(0, 1))), "error");
}

#[test]
fn r8_a_group_of_one_op_is_a_plain_call() {
    for (a, b) in [
        ("group { send 1 4KiB }", "recv 0 4KiB"),
        ("send 1 4KiB", "group { recv 0 4KiB }"),
        (
            "group { send 1 4KiB }\ngroup { recv 1 4KiB }",
            "recv 0 4KiB\nsend 0 4KiB",
        ),
    ] {
        let src = two_ranks("", a, b);
        assert_eq!(verdict(&src), "ok", "{src}");
    }
    // With its partner plain, a group of one that shares a stream with a
    // later op still orders like a plain call (R1): the seed's hang stays.
    let seed = two_ranks(
        "",
        "group { send 1 4KiB }\nrecv 1 4KiB",
        "group { send 0 4KiB }\nrecv 0 4KiB",
    );
    assert_eq!(verdict(&seed), "deadlock");
}

// R11 one caller per communicator at a time ----------------------------------

#[test]
fn r11_a_second_thread_waits_for_the_handshake_in_progress() {
    // Rank 0's two threads each send their first message on a cold
    // communicator. Whichever goes first enters the handshake (R7); the
    // other waits for that call to return (R11) and then finds the send
    // side connected, instead of entering a second handshake round that
    // rank 1, which needs only its receive side once, would never pair.
    let src = "ranks 2
model lazy-connect=on
rank 0:
  send 1 4KiB
rank 0 thread t:
  send 1 4KiB
rank 1:
  recv 0 4KiB
  recv 0 4KiB
";
    assert_eq!(verdict(src), "ok");
}

#[test]
fn r11_a_launch_waits_while_another_thread_is_inside_a_call_on_its_communicator() {
    // Thread main blocks in the handshake of its first send on c; thread t's
    // recv on c is held back until that call returns (R11), so t never posts
    // the `notify` that rank 1 waits for before it touches c: a cycle
    // through R7, `await` and R11.
    let src = "ranks 2
model lazy-connect=on
comm c 0 1
rank 0:
  send 1 4KiB comm=c stream=a
rank 0 thread t:
  recv 1 4KiB comm=c stream=b
  notify 1 go
rank 1:
  await 0 go
  recv 0 4KiB comm=c stream=x
  send 0 4KiB comm=c stream=x
";
    let program = duplex::schedule::parse(src).expect("valid");
    let c = compile(&program);
    let mut m = c.machine();
    let (main, t) = (ThreadId(0), ThreadId(1));
    m.apply(main, &c.scripts[0][0]).expect("valid");
    assert!(m.in_handshake(main));
    let recv = c.scripts[1][0].clone();
    assert!(!m.enabled(t, &recv), "R11 must hold thread t's call on c");
    let threads = duplex::compile::Remaining(&c);
    assert_eq!(m.status(&threads), duplex::machine::Status::Stuck);
    let stuck = m.stuck(&threads);
    let rules: Vec<Rule> = stuck.cycle.iter().map(|l| l.rule).collect();
    assert!(rules.contains(&Rule::R11), "{stuck}");
    assert!(rules.contains(&Rule::R7), "{stuck}");
    assert!(
        stuck.cycle.iter().any(|l| l
            .waits_for
            .contains("one caller per communicator at a time")),
        "{stuck}"
    );
    // The held-back call is named, not taken for the thread's end.
    let text = stuck.to_string();
    assert!(!text.contains("end of thread"), "{text}");
    assert!(text.contains("rank 0 t: host call `recv"), "{text}");
    // Every interleaving hangs: the checker finds it too.
    assert_eq!(verdict(src), "deadlock");
    // R11 holds only while the other call is in progress: on a fresh
    // machine, thread t's call is enabled.
    assert!(c.machine().enabled(t, &recv));
}

// R12 messages to itself ---------------------------------------------------------

/// One rank whose thread runs `body`.
fn one_rank(body: &str) -> String {
    format!("ranks 1\nrank 0:\n{body}\n")
}

#[test]
fn r12_a_message_to_itself_is_paired_within_its_launch() {
    // The same send and recv to itself: refused apart (NCCL would refuse
    // the first at its group's end), fine in one group, in either order.
    assert_eq!(verdict(&one_rank("send 0 4KiB\nrecv 0 4KiB")), "error");
    assert_eq!(verdict(&one_rank("recv 0 4KiB\nsend 0 4KiB")), "error");
    assert_eq!(
        verdict(&one_rank("group { send 0 4KiB; recv 0 4KiB }")),
        "ok"
    );
    assert_eq!(
        verdict(&one_rank("group { recv 0 4KiB; send 0 4KiB }")),
        "ok"
    );
    // Counts must match within the launch: a second send has no partner.
    assert_eq!(
        verdict(&one_rank("group { send 0 4KiB; send 0 4KiB; recv 0 4KiB }")),
        "error"
    );
    // Whatever the eager capacity: a lone send to itself is never buffered.
    assert_eq!(
        verdict("ranks 1\nmodel eager=64MiB\nrank 0:\nsend 0 4KiB\nrecv 0 4KiB\n"),
        "error"
    );
    // A message to another rank in the same group changes nothing.
    let two = "ranks 2\nmodel one-sided-groups=accept\nrank 0:\ngroup { send 1 4KiB; send 0 4KiB; recv 0 4KiB }\nrank 1:\nrecv 0 4KiB\n";
    assert_eq!(verdict(two), "ok");
}

// R9 events ---------------------------------------------------------------------------

#[test]
fn r9_wait_blocks_a_stream_until_the_recorded_op_completes() {
    let src = two_ranks(
        "comm c1 0 1\ncomm c2 0 1",
        "send 1 4KiB comm=c1 stream=a\nrecord e stream=a\nwait e stream=b\nrecv 1 4KiB comm=c2 stream=b",
        "send 0 4KiB comm=c2 stream=x\nrecv 0 4KiB comm=c1 stream=x",
    );
    assert_eq!(verdict(&src), "deadlock");
    assert!(cycle_rules(&src).contains(&Rule::R9));
    let no_wait = src.replace("wait e stream=b\n", "");
    assert_eq!(verdict(&no_wait), "ok");
}

#[test]
fn r9_waiting_for_an_event_never_recorded_waits_for_nothing() {
    let src = two_ranks(
        "",
        "wait e stream=b\nsend 1 4KiB comm=world stream=b",
        "recv 0 4KiB comm=world stream=b",
    );
    assert_eq!(verdict(&src), "ok");
}

#[test]
fn r9_wait_takes_the_latest_record_issued_before_it() {
    // The wait sees the first record (on stream a, before the blocked send)
    // only if it is issued before the second; here it is issued after both.
    let src = two_ranks(
        "comm c1 0 1\ncomm c2 0 1",
        "record e stream=a\nsend 1 4KiB comm=c1 stream=a\nrecord e stream=a\nwait e stream=b\nrecv 1 4KiB comm=c2 stream=b",
        "send 0 4KiB comm=c2 stream=x\nrecv 0 4KiB comm=c1 stream=x",
    );
    assert_eq!(verdict(&src), "deadlock");
    let earlier = src.replace(
        "record e stream=a\nsend 1 4KiB comm=c1 stream=a\nrecord e stream=a\nwait e stream=b",
        "record e stream=a\nwait e stream=b\nsend 1 4KiB comm=c1 stream=a\nrecord e stream=a",
    );
    assert_eq!(verdict(&earlier), "ok");
}

// R10 kernel concurrency -----------------------------------------------------------

#[test]
fn r10_a_bounded_number_of_launches_in_progress() {
    let src = two_ranks(
        "comm a 0 1\ncomm b 0 1",
        "send 1 1MiB comm=a stream=x\nrecv 1 1MiB comm=b stream=y",
        "send 0 1MiB comm=b stream=y\nrecv 0 1MiB comm=a stream=x",
    );
    assert_eq!(verdict(&src), "ok");
    let one = src.replace("ranks 2\n", "ranks 2\nmodel kernels=1\n");
    assert_eq!(verdict(&one), "deadlock");
    assert!(cycle_rules(&one).contains(&Rule::R10));
    let two = src.replace("ranks 2\n", "ranks 2\nmodel kernels=2\n");
    assert_eq!(verdict(&two), "ok");
}

#[test]
fn r10_a_group_takes_one_slot() {
    let src = two_ranks(
        "model kernels=1",
        "group { send 1 1MiB; recv 1 1MiB }",
        "group { send 0 1MiB; recv 0 1MiB }",
    );
    assert_eq!(verdict(&src), "ok");
}

// Host threads, sync, notify/await ---------------------------------------------------

#[test]
fn await_blocks_until_a_matching_notify_and_each_notify_is_consumed_once() {
    let ok = two_ranks("", "notify 1 t\nnotify 1 t", "await 0 t\nawait 0 t");
    assert_eq!(verdict(&ok), "ok");
    let one_short = two_ranks("", "notify 1 t", "await 0 t\nawait 0 t");
    let Verdict::Deadlock { stuck, .. } = run(&one_short).verdict else {
        panic!("expected a deadlock")
    };
    assert!(
        stuck.missing[0]
            .waits_for
            .contains("no thread of rank 0 will ever `notify 1 t`")
    );
}

#[test]
fn sync_waits_only_for_work_issued_before_it() {
    // Thread b's sync of stream s must not wait for the recv that thread a
    // issues later on the same stream: some interleaving lets b return first,
    // and b's notify is what lets rank 1 send.
    let src = "ranks 2
rank 0 thread a:
  await 0 synced
  recv 1 4KiB comm=world stream=s
rank 0 thread b:
  sync s
  notify 0 synced
  notify 1 go
rank 1:
  await 0 go
  send 0 4KiB comm=world stream=s
";
    assert_eq!(verdict(src), "ok");
}

#[test]
fn the_checker_explores_every_interleaving() {
    // Only the interleavings where both senders enqueue before either
    // receiver hang; the checker must find one of them.
    let src = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/seed-rpc.sched"
    ))
    .expect("example exists");
    let outcome = run(&src);
    assert!(matches!(outcome.verdict, Verdict::Deadlock { .. }));
    // Under per-direction lanes, every interleaving of the four threads
    // completes: the full search goes through them all, and the reduced
    // one, whose threads' steps commute (each thread on lanes of its own),
    // agrees from a single execution.
    let safe_src = src.replacen("ranks 2", "ranks 2\npolicy per-direction", 1);
    let program = duplex::schedule::parse(&safe_src).expect("valid");
    let full = check::check(
        &compile(&program),
        &check::Options {
            reduce: false,
            ..Default::default()
        },
    );
    assert!(matches!(full.verdict, Verdict::Ok), "{:?}", full.verdict);
    assert!(full.stats.executions > 10, "{:?}", full.stats);
    let safe = run(&safe_src);
    assert!(matches!(safe.verdict, Verdict::Ok), "{:?}", safe.verdict);
    assert!(
        safe.stats.executions < full.stats.executions,
        "{:?}",
        safe.stats
    );
}

#[test]
fn a_reported_trace_replays_to_the_same_stuck_state() {
    let src = two_ranks("", "send 1 4KiB\nrecv 1 4KiB", "send 0 4KiB\nrecv 0 4KiB");
    let program = duplex::schedule::parse(&src).expect("valid");
    let compiled = compile(&program);
    let Verdict::Deadlock { trace, stuck, .. } =
        check::check(&compiled, &check::Options::default()).verdict
    else {
        panic!("expected a deadlock")
    };
    let schedule: Vec<_> = trace
        .iter()
        .map(|s| {
            let t = compiled
                .setup
                .threads
                .iter()
                .position(|t| t.rank == s.rank && t.name == s.thread);
            duplex::machine::ThreadId(t.expect("thread exists") as u32)
        })
        .collect();
    let (m, _, result) = check::replay(&compiled, &schedule);
    assert!(result.is_ok());
    assert_eq!(
        m.status(&duplex::compile::Remaining(&compiled)),
        duplex::machine::Status::Stuck
    );
    assert_eq!(m.stuck(&duplex::compile::Remaining(&compiled)), *stuck);
}
