//! The schedule parser: valid files, and every kind of invalid file, whose
//! error must name the right line.

use duplex::schedule::{Dir, MAX_MESSAGE_BYTES, StmtKind, parse, parse_with};
use duplex::{Policy, Size};

#[test]
fn parses_the_format_pages_example() {
    let p = parse(
        "# two ranks each send, then receive\nranks 2\nrank 0:\n  send 1 256MiB\n  recv 1 256MiB\nrank 1:\n  send 0 256MiB\n  recv 0 256MiB\n",
    )
    .expect("valid");
    assert_eq!(p.ranks, 2);
    assert_eq!(p.policy, Policy::Shared);
    assert_eq!(p.threads.len(), 2);
    let StmtKind::Op(op) = &p.threads[1].body[0].kind else {
        panic!("expected an op")
    };
    assert_eq!((op.dir, op.peer, op.size), (Dir::Send, 0, Size(256 << 20)));
    assert_eq!(p.threads[1].body[0].line.0, 7);
}

#[test]
fn parses_every_statement() {
    let p = parse(
        "ranks 3
policy per-direction
model eager=64MiB lazy-connect=on
model kernels=2 comm-order=off
comm pair 0 1
rank 0:
  send 1 4KiB comm=pair stream=s
  recv 2 1B stream=t
  group { send 1 4KiB; recv 1 4KiB comm=pair }
  group {
    send 2 8KiB
    recv 2 8KiB;
  }
  record e stream=s
  wait e
  sync
  sync s
  notify 1 tag-1
rank 0 thread rx:
  await 1 tag-2
rank 1 :
rank 2 thread x :
",
    )
    .expect("valid");
    assert_eq!(p.policy, Policy::PerDirection);
    assert_eq!(p.model.eager, Size(64 << 20));
    assert!(p.model.lazy_connect && !p.model.comm_order);
    assert_eq!(p.model.kernels, Some(2));
    let body = &p.threads[0].body;
    assert_eq!(body.len(), 9);
    assert!(matches!(&body[2].kind, StmtKind::Group(ops) if ops.len() == 2));
    assert!(matches!(&body[3].kind, StmtKind::Group(ops) if ops.len() == 2));
    assert_eq!(
        body[3].line.0, 10,
        "a multi-line group is at its opening line"
    );
    let lines = |kind: &StmtKind| match kind {
        StmtKind::Group(ops) => ops.iter().map(|o| o.line.0).collect::<Vec<_>>(),
        StmtKind::Op(op) => vec![op.line.0],
        _ => Vec::new(),
    };
    assert_eq!(
        lines(&body[0].kind),
        [7],
        "a plain op is at its statement's line"
    );
    assert_eq!(
        lines(&body[2].kind),
        [9, 9],
        "a one-line group's ops share its line"
    );
    assert_eq!(
        lines(&body[3].kind),
        [11, 12],
        "each op of a multi-line group is at its own line"
    );
    assert_eq!(p.threads.len(), 4);
    assert_eq!(p.threads[1].display_name(), "rx");
}

#[test]
fn printing_and_parsing_again_gives_the_same_program() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/seed-rpc.sched"
    ))
    .expect("example exists");
    let p = parse(&text).expect("valid");
    let again = parse(&p.to_string()).expect("printed form is valid");
    assert_eq!(p.without_lines(), again.without_lines());
    assert_ne!(
        p, again,
        "lines are part of equality: the file has comments the printed form drops"
    );
    assert_eq!(p.to_string(), again.to_string());
}

#[test]
fn without_lines_clears_the_lines_of_grouped_ops() {
    let text = "ranks 2\nrank 0:\n  group {\n    send 1 4KiB\n    recv 1 4KiB\n  }\nrank 1:\n  group { recv 0 4KiB; send 0 4KiB }\n";
    let p = parse(text).expect("valid");
    let again = parse(&p.to_string()).expect("printed form is valid");
    assert_ne!(p, again, "the printed form puts the group on one line");
    assert_eq!(p.without_lines(), again.without_lines());
    for t in &p.without_lines().threads {
        for s in &t.body {
            if let StmtKind::Group(ops) = &s.kind {
                assert!(ops.iter().all(|o| o.line.0 == 0), "{ops:?}");
            }
        }
    }
}

#[test]
fn a_message_beyond_any_device_is_refused_at_its_line() {
    let at_most = format!("ranks 2\nrank 0:\n  send 1 {}\n", Size(MAX_MESSAGE_BYTES));
    assert!(parse(&at_most).is_ok(), "{at_most}");
    for (text, line) in [
        (
            format!("ranks 2\nrank 0:\n  send 1 {}\n", MAX_MESSAGE_BYTES + 1),
            3,
        ),
        (
            "ranks 2\nrank 0:\n  recv 1 4096GiB comm=world\n".to_string(),
            3,
        ),
        (
            "ranks 2\nrank 0:\n  group {\n    send 1 4KiB\n    send 1 2048GiB\n  }\n".to_string(),
            5,
        ),
        (
            "ranks 2\nrank 0:\n  group { recv 1 4KiB; recv 1 1025GiB }\n".to_string(),
            3,
        ),
    ] {
        let e = parse(&text).expect_err(&text);
        assert_eq!(e.line, line, "{text:?}: {e}");
        assert!(e.message.contains("larger than any device's memory"), "{e}");
        assert!(e.message.contains("1024GiB"), "{e}");
    }
}

/// Each case: the file, the line the error must name, and a fragment of the
/// message.
const BAD: &[(&str, u32, &str)] = &[
    ("", 1, "no `ranks N`"),
    ("# only a comment\n\n", 2, "no `ranks N`"),
    ("rank 0:\n", 1, "expected `ranks N` as the first statement"),
    ("ranks\n", 1, "expected `ranks N`"),
    ("ranks zero\n", 1, "not a rank count"),
    ("ranks 0\n", 1, "not a rank count"),
    ("ranks 99999\n", 1, "not a rank count"),
    ("ranks 2\nranks 2\n", 2, "given twice"),
    ("ranks 2\npolicy fastest\n", 2, "unknown policy"),
    ("ranks 2\npolicy shared\npolicy shared\n", 3, "given twice"),
    ("ranks 2\nmodel eager\n", 2, "KEY=VALUE"),
    ("ranks 2\nmodel eager=lots\n", 2, "not a size"),
    ("ranks 2\nmodel kernels=0\n", 2, "from 1 to 4294967295"),
    ("ranks 2\nmodel kernels=+2\n", 2, "from 1 to 4294967295"),
    ("ranks +2\n", 1, "not a rank count"),
    ("ranks 2\nrank +0:\n", 2, "not a rank number"),
    ("ranks 2\nrank 0:\n  send +1 4KiB\n", 3, "not a rank number"),
    ("ranks 2\nrank 0:\n  send 1 1.5MiB\n", 3, "no fractions"),
    (
        "ranks 2\nrank 0: send 1 4KiB\n",
        2,
        "`send 1 4KiB` after it belongs on the next line",
    ),
    ("ranks 2\nrank:\n", 2, "the rank number is missing"),
    (
        "ranks 2\nrank 0:\n  rank:\n",
        3,
        "the rank number is missing",
    ),
    ("ranks 2\nmodel\n", 2, "expected `model KEY=VALUE"),
    ("ranks 2\ncomm world 0 1\n", 2, "`world` always exists"),
    ("ranks 2\ncomm a 0 2\n", 2, "rank 2 does not exist"),
    ("ranks 2\ncomm a 0 0\n", 2, "listed twice"),
    (
        "ranks 2\ncomm a 0 1\ncomm a 0 1\n",
        3,
        "already declared at line 2",
    ),
    ("ranks 2\ncomm a\n", 2, "expected `comm NAME R R ...`"),
    (
        "ranks 2\ncomm a/b 0 1\n",
        2,
        "not a valid communicator name",
    ),
    (
        "ranks 2\nsend 1 4KiB\n",
        2,
        "no `rank R:` block has started",
    ),
    ("ranks 2\nrank 2:\n", 2, "rank 2 does not exist"),
    ("ranks 2\nrank 0\n", 2, "missing `:`"),
    (
        "ranks 2\nrank 0 thread:\n",
        2,
        "expected `rank R:` or `rank R thread NAME:`",
    ),
    ("ranks 2\nrank 0 thread main:\n", 2, "`main` is the name"),
    (
        "ranks 2\nrank 0:\nrank 0:\n",
        3,
        "already defined at line 2",
    ),
    (
        "ranks 2\nrank 0:\n  policy shared\n",
        3,
        "must come before the first `rank` block",
    ),
    (
        "ranks 2\nrank 0:\n  send 1\n",
        3,
        "expected `send PEER SIZE",
    ),
    (
        "ranks 2\nrank 0:\n  send 5 4KiB\n",
        3,
        "rank 5 does not exist",
    ),
    ("ranks 2\nrank 0:\n  send x 4KiB\n", 3, "not a rank number"),
    ("ranks 2\nrank 0:\n  send 1 4KB\n", 3, "unknown unit"),
    (
        "ranks 2\nrank 0:\n  send 1 4KiB tag=3\n",
        3,
        "takes only `comm=C` and `stream=S`",
    ),
    (
        "ranks 2\nrank 0:\n  send 1 4KiB comm=a comm=b\n",
        3,
        "given twice",
    ),
    (
        "ranks 2\nrank 0:\n\n  recv 1 4KiB comm=nope\n",
        4,
        "communicator `nope` is not declared",
    ),
    (
        "ranks 3\ncomm a 0 1\nrank 0:\n  send 2 4KiB comm=a\n",
        4,
        "rank 2 (the peer) is not a member",
    ),
    (
        "ranks 3\ncomm a 0 1\nrank 2:\n  send 0 4KiB comm=a\n",
        4,
        "rank 2 (this thread's rank) is not a member",
    ),
    (
        "ranks 2\nrank 0:\n  group {\n    send 1 4KiB\n    recv 1 4KiB comm=nope\n  }\n",
        5,
        "communicator `nope` is not declared",
    ),
    (
        "ranks 2\nrank 0:\n  group send 1 4KiB\n",
        3,
        "expected `group {",
    ),
    ("ranks 2\nrank 0:\n  group { }\n", 3, "at least one"),
    (
        "ranks 2\nrank 0:\n  group { sync }\n",
        3,
        "holds only `send` and `recv`",
    ),
    (
        "ranks 2\nrank 0:\n  group {\n    send 1 4KiB\n",
        3,
        "never closed",
    ),
    // A group left open before the next block: the error is at the
    // group's line, as for a group left open at the end of the file, and
    // names where the block starts.
    (
        "ranks 2\nrank 0:\n  group {\n    send 1 4KiB\nrank 1:\n  recv 0 4KiB\n",
        3,
        "never closed with `}`: line 5 starts the next block",
    ),
    // Lines ended by CR alone read as one line: the error says so.
    ("ranks 2\rrank 0:\r  send 1 4KiB\r", 1, "ended by CR alone"),
    ("ranks 2\nrank 0:\n  send 1\u{0}4KiB\n", 3, "U+0000"),
    // A name of a megabyte is refused without being echoed.
    (
        "ranks 2\ncomm xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx 0 1\n",
        2,
        "a word of 273 bytes",
    ),
    (
        "ranks 2\nrank 0:\n  group { send 1 4KiB } recv 1 4KiB\n",
        3,
        "after `}`",
    ),
    ("ranks 2\nrank 0:\n  }\n", 3, "unexpected `}`"),
    ("ranks 2\nrank 0:\n  record\n", 3, "expected `record EVENT"),
    (
        "ranks 2\nrank 0:\n  wait e s\n",
        3,
        "expected `stream=NAME`",
    ),
    (
        "ranks 2\nrank 0:\n  sync a b\n",
        3,
        "expected `sync` or `sync STREAM`",
    ),
    (
        "ranks 2\nrank 0:\n  notify 1\n",
        3,
        "expected `notify PEER TAG`",
    ),
    (
        "ranks 2\nrank 0:\n  await 3 t\n",
        3,
        "rank 3 does not exist",
    ),
    (
        "ranks 2\nrank 0:\n  jump 1\n",
        3,
        "unknown statement `jump`",
    ),
    (
        "ranks 2\nrank 0:\n  send 1 4KiB stream=lane:0->1\n",
        3,
        "not a valid stream name",
    ),
];

#[test]
fn a_group_past_the_models_bound_names_its_line() {
    let ops = vec!["send 1 1B"; duplex::machine::MAX_LAUNCH_OPS + 1].join("; ");
    let text = format!("ranks 2\nrank 0:\n  group {{ {ops} }}\n");
    let e = parse(&text).expect_err("too many ops in one group");
    assert_eq!(e.line, 3, "{e}");
    assert!(e.message.contains("at most 65535"), "{e}");
}

#[test]
fn a_cr_at_a_lines_end_is_whitespace() {
    let plain = "ranks 2\nrank 0:\n  send 1 4KiB\nrank 1:\n  recv 0 4KiB\n";
    for text in [
        "ranks 2\r\nrank 0:\r\n  send 1 4KiB\r\nrank 1:\r\n  recv 0 4KiB\r",
        "ranks 2\r\r\nrank 0:\r\n  send 1 4KiB\x0b\r\nrank 1:\r\n  recv 0 4KiB\x0c\r\n",
    ] {
        assert_eq!(
            parse(text).unwrap_or_else(|e| panic!("{e}: {text:?}")),
            parse(plain).expect("parses")
        );
    }
}

#[test]
fn a_byte_order_mark_is_skipped() {
    let plain = "ranks 2\nrank 0:\n  send 1 4KiB\nrank 1:\n  recv 0 4KiB\n";
    let marked = format!("\u{feff}{plain}");
    assert_eq!(
        parse(&marked).expect("a file that starts with a BOM parses"),
        parse(plain).expect("parses")
    );
}

/// The next value of the xorshift generator whose state is `x`.
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

#[test]
fn every_error_names_its_line() {
    for (text, line, fragment) in BAD {
        match parse(text) {
            Ok(p) => panic!("accepted invalid input {text:?} as {p:?}"),
            Err(e) => {
                assert_eq!(e.line, *line, "wrong line for {text:?}: {e}");
                assert!(
                    e.message.contains(fragment),
                    "message for {text:?} is {:?}, expected it to contain {fragment:?}",
                    e.message
                );
            }
        }
    }
}

#[test]
fn arbitrary_bytes_never_panic() {
    // A small deterministic generator (xorshift) over a vocabulary of the
    // format's tokens and junk: the parser must return, never panic.
    let words = [
        "ranks",
        "2",
        "3",
        "rank",
        "0:",
        "1:",
        "thread",
        "t:",
        "send",
        "recv",
        "group",
        "{",
        "}",
        ";",
        "4KiB",
        "256MiB",
        "comm=world",
        "stream=s",
        "record",
        "wait",
        "e",
        "sync",
        "notify",
        "await",
        "policy",
        "shared",
        "per-direction",
        "model",
        "eager=1MiB",
        "kernels=1",
        "comm",
        "a",
        "#",
        "\n",
        "\n",
        "\n",
        ":",
        "=",
        "-1",
        "99999999999999999999999",
        "\u{1F600}",
        "\t",
    ];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for _ in 0..20_000 {
        let mut text = String::new();
        let n = (x % 40) as usize;
        for _ in 0..n {
            text.push_str(words[(next(&mut x) % words.len() as u64) as usize]);
            text.push(' ');
        }
        next(&mut x);
        let serial = parse(&text);
        for workers in [2, 3] {
            assert_eq!(
                parse_with(&text, workers),
                serial,
                "{workers} readers: {text:?}"
            );
        }
        if let Ok(p) = serial {
            // What parses prints to something that parses to the same program.
            assert_eq!(parse(&p.to_string()).as_ref(), Ok(&p), "{text:?}");
        }
    }
    // Whole lines, most of them valid, so that many files parse and the
    // round trip is tried on many programs, not the few the words make.
    let lines = [
        "rank 0:",
        "rank 1:",
        "rank 1 thread t:",
        "  send 1 4KiB",
        "  send 0 4KiB",
        "  recv 0 4KiB",
        "  recv 1 4KiB",
        "  send 1 256MiB comm=world stream=s",
        "  recv 0 256MiB comm=world stream=s",
        "  group { send 1 4KiB; recv 1 4KiB }",
        "  sync",
        "  notify 0 go",
        "  await 1 go",
        "  record e stream=s",
        "  wait e stream=s",
        "policy per-direction",
        "model eager=1MiB kernels=1",
        "comm c 0 1",
        "  send 1 1MiB comm=c",
        "# a comment",
        "",
        "  frobnicate 3",
    ];
    let mut parsed = 0;
    for _ in 0..10_000 {
        let mut text = String::from("ranks 2\n");
        for _ in 0..(x % 12) {
            text.push_str(lines[(next(&mut x) % lines.len() as u64) as usize]);
            text.push('\n');
        }
        next(&mut x);
        let serial = parse(&text);
        assert_eq!(parse_with(&text, 2), serial, "2 readers: {text:?}");
        if let Ok(p) = serial {
            parsed += 1;
            // The same program, up to its line numbers (printing drops
            // comments and blank lines).
            let printed = p.to_string();
            let again =
                parse(&printed).unwrap_or_else(|e| panic!("{text:?} printed as {printed:?}: {e}"));
            assert_eq!(again.to_string(), printed, "{text:?}");
        }
    }
    assert!(parsed > 1000, "only {parsed} of 10,000 files parsed");
}

/// A file cut into pieces and read by several threads gives the program,
/// or the error (its line and message), that one reader gives: on the
/// examples, on every bad input above, and on a large file with an error
/// placed before, across and after the cuts.
#[test]
fn parallel_parse_is_serial_parse() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples");
    let mut texts: Vec<String> = std::fs::read_dir(dir)
        .expect("examples/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "sched"))
        .map(|p| std::fs::read_to_string(p).expect("example"))
        .collect();
    assert!(texts.len() > 10, "examples found: {}", texts.len());
    texts.extend(BAD.iter().map(|(t, _, _)| t.to_string()));
    // A ring of 8 ranks, 20 lines each; then the same with one fault.
    let ring = |fault: &dyn Fn(u32, u32) -> Option<String>| {
        let mut s = String::from("ranks 8\npolicy per-direction\ncomm c 0 1\n# the ring\n\n");
        for r in 0..8 {
            s.push_str(&format!("rank {r}:\n"));
            for i in 0..20 {
                match fault(r, i) {
                    Some(line) => s.push_str(&line),
                    None => s.push_str(&format!(
                        "  group {{ send {} 4KiB; recv {} 4KiB }}  # {i}\n",
                        (r + 1) % 8,
                        (r + 7) % 8
                    )),
                }
            }
            if r == 3 {
                s.push_str(&format!("rank {r} thread side:\n  sync\n\n"));
            }
        }
        s
    };
    texts.push(ring(&|_, _| None));
    for at in [0, 2, 3, 5, 7] {
        for (i, fault) in [
            "  group {\n",
            "  send 9 4KiB\n",
            "  send 1 4KiB comm=nowhere\n",
            "  send 1 4KiB comm=c\n",
            "rank 0:\n",
            "rank 3 thread side:\n",
            "policy shared\n",
            "  group { send 1 4KiB\n",
            "  \u{1F600}\n",
        ]
        .into_iter()
        .enumerate()
        {
            let text = ring(&|r, j| (r == at && j == 19 - i as u32).then(|| fault.to_string()));
            texts.push(text);
        }
    }
    for text in &texts {
        let serial = parse_with(text, 1);
        for workers in [2, 3, 4, 16] {
            assert_eq!(
                parse_with(text, workers),
                serial,
                "{workers} readers: {text}"
            );
        }
    }
    // Errors made a difference: most faulty rings are refused.
    let refused = texts.iter().filter(|t| parse_with(t, 1).is_err()).count();
    assert!(refused > 40, "{refused} refused");
}

/// An error that quotes the file shows the characters a terminal would
/// hide: a zero-width space after `send` is written out.
#[test]
fn an_error_shows_invisible_characters() {
    let e = parse("ranks 2\nrank 0:\n  send\u{200b} 1 4KiB\n").expect_err("unknown statement");
    assert_eq!(e.line, 3);
    assert!(e.message.contains("`send\\u{200b}`"), "{}", e.message);
}
