//! The `duplex` binary end to end: every example's verdict, exit statuses,
//! and bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn duplex(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(args)
        .output()
        .expect("the duplex binary runs")
}

fn examples() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("examples/ exists")
        .map(|e| e.expect("readable").path())
        .filter(|p| p.extension().is_some_and(|e| e == "sched"))
        .collect();
    files.sort();
    files
}

/// `# expect[ ARGS]: VERDICT` lines of an example.
fn expectations(text: &str) -> Vec<(Vec<String>, String)> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# expect"))
        .filter_map(|rest| {
            let (args, verdict) = rest.split_once(':')?;
            let args = args.split_whitespace().map(String::from).collect();
            Some((args, verdict.trim().to_string()))
        })
        .collect()
}

#[test]
fn every_example_gets_its_expected_verdicts() {
    let files = examples();
    assert!(files.len() >= 15, "examples/ holds {} files", files.len());
    for file in files {
        let text = std::fs::read_to_string(&file).expect("readable");
        let expected = expectations(&text);
        assert!(
            !expected.is_empty(),
            "{} has no `# expect:` line",
            file.display()
        );
        for (args, verdict) in expected {
            let mut argv = vec![
                "check",
                file.to_str().expect("utf-8 path"),
                "--format",
                "json",
            ];
            argv.extend(args.iter().map(String::as_str));
            let out = duplex(&argv);
            let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
                panic!(
                    "{argv:?}: not JSON ({e}): {}",
                    String::from_utf8_lossy(&out.stdout)
                )
            });
            assert_eq!(json["verdict"], verdict.as_str(), "{argv:?}");
            let code = if verdict == "ok" { 0 } else { 1 };
            assert_eq!(out.status.code(), Some(code), "{argv:?}");
        }
    }
}

#[test]
fn the_seed_prints_its_cycle_and_per_direction_removes_it() {
    let seed = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/seed.sched");
    let seed = seed.to_str().expect("utf-8 path");
    let out = duplex(&["check", seed]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("DEADLOCK"), "{text}");
    assert!(text.contains("wait-for cycle (4 links"), "{text}");
    assert!(
        text.contains("rank 0 main: send → 1 256MiB (line 14)"),
        "{text}"
    );
    assert!(text.contains("R4: started"), "{text}");
    assert!(text.contains("R1: cannot start"), "{text}");
    assert!(
        text.contains("interleaving that leads there (6 host steps)"),
        "{text}"
    );
    let out = duplex(&["check", seed, "--policy", "per-direction"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("OK"));
}

#[test]
fn json_reports_carry_the_details() {
    let seed = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/seed.sched");
    let out = duplex(&["check", seed.to_str().expect("utf-8"), "--format", "json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(json["verdict"], "deadlock");
    assert_eq!(json["cycle"].as_array().map(Vec::len), Some(4));
    // Structured all the way down: each link's node is data too.
    let first = &json["cycle"][0]["what"];
    assert_eq!(first["kind"], "launch", "{first}");
    assert_eq!(first["ops"][0]["rank"], 0);
    assert_eq!(first["ops"][0]["op"], "send");
    assert_eq!(first["ops"][0]["line"], 14);
    assert_eq!(json["blocked"].as_array().map(Vec::len), Some(2));
    let op = &json["ops"][0];
    for field in [
        "rank", "thread", "op", "peer", "bytes", "comm", "stream", "fifo", "state", "line",
    ] {
        assert!(!op[field].is_null(), "op lacks {field}: {op}");
    }
    assert_eq!(json["steps"].as_array().map(Vec::len), Some(6));
    assert!(json["stats"]["transitions"].as_u64().is_some_and(|n| n > 0));
    // One host thread per rank: the reduction leaves one execution.
    assert_eq!(json["stats"]["executions"], 1);
    assert!(
        json["schedule"]
            .as_str()
            .is_some_and(|s| s.starts_with("v1:")),
        "{json}"
    );
}

#[test]
fn a_size_mismatch_names_both_ops() {
    let dir = tempdir();
    let file = dir.join("mismatch.sched");
    std::fs::write(
        &file,
        "ranks 2\nrank 0:\n  send 1 4KiB\nrank 1:\n  recv 0 8KiB\n",
    )
    .expect("write");
    let out = duplex(&["check", file.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("ERROR"), "{text}");
    assert!(
        text.contains("send: rank 0 main: send → 1 4KiB (line 3)"),
        "{text}"
    );
    assert!(
        text.contains("recv: rank 1 main: recv ← 0 8KiB (line 5)"),
        "{text}"
    );
    let out = duplex(&["check", file.to_str().expect("utf-8"), "--format", "json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(json["verdict"], "error");
    assert_eq!(json["error"]["kind"], "size-mismatch");
    assert_eq!(json["error"]["ops"].as_array().map(Vec::len), Some(2));
}

/// This test process's folder of files, shared by its tests (which run at
/// once, so none can remove it): on its first use, the folders of earlier
/// runs whose process is gone are removed (where `/proc` says so).
fn tempdir() -> PathBuf {
    static SWEEP: std::sync::Once = std::sync::Once::new();
    SWEEP.call_once(|| {
        if !Path::new("/proc/self").exists() {
            return;
        }
        let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let Some(pid) = name
                .to_str()
                .and_then(|n| n.strip_prefix("duplex-cli-test-"))
                .and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    });
    let dir = std::env::temp_dir().join(format!("duplex-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

#[test]
fn bad_input_exits_2_and_names_the_line() {
    let dir = tempdir();
    let cases: &[(&str, &[u8], &str)] = &[
        (
            "garbage.sched",
            b"ranks 2\nrank 0:\n  send 1 lots\n",
            "garbage.sched:3: `lots` is not a size",
        ),
        (
            "empty.sched",
            b"",
            "empty.sched:1: the file has no `ranks N`",
        ),
        (
            "binary.sched",
            b"ranks 2\n\xff\xfe\x00\n",
            "binary.sched:2: the file is not UTF-8",
        ),
        (
            "peer.sched",
            b"ranks 2\nrank 0:\n  recv 7 1B\n",
            "peer.sched:3: rank 7 does not exist",
        ),
        (
            "huge.sched",
            b"ranks 2\nrank 0:\n  group {\n    send 1 4KiB\n    send 1 2048GiB\n  }\n",
            "huge.sched:5: `2048GiB` is larger than any device's memory",
        ),
    ];
    for (name, bytes, expected) in cases {
        let file = dir.join(name);
        std::fs::write(&file, bytes).expect("write");
        let out = duplex(&["check", file.to_str().expect("utf-8")]);
        assert_eq!(out.status.code(), Some(2), "{name}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expected), "{name}: {err}");
        assert!(out.stdout.is_empty(), "{name}: nothing is checked");
    }
    let out = duplex(&["check", "/nonexistent/file.sched"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read /nonexistent/file.sched"));
}

#[test]
fn bad_flags_exit_2() {
    let seed = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/seed.sched");
    let seed = seed.to_str().expect("utf-8");
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let examples = examples.to_str().expect("utf-8");
    for args in [
        vec!["check", seed, "--policy", "sideways"],
        vec!["check", seed, "--eager", "lots"],
        vec!["check", seed, "--model", "kernels=0"],
        vec!["check", seed, "--format", "xml"],
        vec!["check", seed, "--max-states", "0"],
        vec!["run", seed, "--timeout-ms", "0"],
        // A folder calibrate could read: only the 0 makes this exit 2.
        vec!["calibrate", examples, "--timeout-ms", "0"],
        vec!["check"],
    ] {
        let out = duplex(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(!out.stderr.is_empty(), "{args:?}");
    }
}

/// A program with many interleavings that matter: `n` threads per rank,
/// each with one send (rank 0) or recv (rank 1) on one shared
/// communicator, so the order they issue in decides which send meets which
/// recv. It completes in every one.
fn shared_comm(name: &str, n: usize) -> String {
    let mut text = String::from("ranks 2\ncomm c 0 1\n");
    for r in 0..2 {
        for t in 0..n {
            if t == 0 {
                text.push_str(&format!("rank {r}:\n"));
            } else {
                text.push_str(&format!("rank {r} thread t{t}:\n"));
            }
            let op = if r == 0 { "send 1" } else { "recv 0" };
            text.push_str(&format!("  {op} 4KiB comm=c stream=s{t}\n"));
        }
    }
    let file = tempdir().join(name);
    std::fs::write(&file, text).expect("write");
    file.to_str().expect("utf-8").to_string()
}

#[test]
fn hitting_the_state_bound_is_inconclusive_not_ok() {
    let many = shared_comm("bound.sched", 4);
    assert_eq!(duplex(&["check", &many]).status.code(), Some(0));
    let out = duplex(&["check", &many, "--max-states", "5"]);
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stdout).contains("INCONCLUSIVE"));
}

#[test]
fn a_printed_schedule_replays_to_the_same_hang() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/seed-rpc.sched");
    let file = file.to_str().expect("utf-8");
    let out = duplex(&["check", file, "--format", "json"]);
    let found: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let schedule = found["schedule"]
        .as_str()
        .expect("a deadlock has a schedule");
    let text = String::from_utf8_lossy(&duplex(&["check", file]).stdout).into_owned();
    assert!(
        text.contains(&format!(
            "replay it with: duplex check {file} --replay {schedule}"
        )),
        "{text}"
    );
    let out = duplex(&["check", file, "--replay", schedule, "--format", "json"]);
    assert_eq!(out.status.code(), Some(1));
    let again: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(again["verdict"], "deadlock");
    assert_eq!(again["cycle"], found["cycle"]);
    assert_eq!(again["steps"], found["steps"]);
    assert_eq!(again["replayed"], true);
    // The same interleaving under per-direction lanes completes.
    let out = duplex(&[
        "check",
        file,
        "--policy",
        "per-direction",
        "--replay",
        schedule,
    ]);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("this interleaving completes"));
}

/// A hang found under command-line overrides of the file's policy and
/// model replays with the command the report prints: the overrides are in
/// it (without them the schedule would follow another program).
#[test]
fn the_printed_replay_command_carries_the_overrides() {
    let file =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/seed-rpc-per-direction.sched");
    let file = file.to_str().expect("utf-8");
    let args = ["check", file, "--policy", "shared", "--model", "eager=0"];
    let out = duplex(&args);
    assert_eq!(out.status.code(), Some(1), "the overrides make it hang");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let command = text
        .lines()
        .find_map(|l| l.strip_prefix("replay it with: duplex "))
        .expect("a replay command");
    assert!(
        command.contains("--policy shared --model eager=0 --replay v1:"),
        "{command}"
    );
    let json: serde_json::Value =
        serde_json::from_slice(&duplex(&[&args[..], &["--format", "json"]].concat()).stdout)
            .expect("json");
    assert_eq!(json["replay"], format!("duplex {command}"));
    let words: Vec<&str> = command.split_whitespace().collect();
    let again = duplex(&words);
    assert_eq!(again.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("this interleaving hangs"),
        "{}",
        String::from_utf8_lossy(&again.stdout)
    );
}

#[test]
fn a_schedule_that_does_not_fit_is_refused_with_a_reason() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/seed-rpc.sched");
    let file = file.to_str().expect("utf-8");
    for (schedule, says) in [
        ("v1:9", "names a thread that cannot step"),
        ("v1:0", "not a complete schedule"),
        ("0.1", "should start with `v1:`"),
        ("v1:0.x", "`x`"),
    ] {
        let out = duplex(&["check", file, "--replay", schedule]);
        assert_eq!(out.status.code(), Some(2), "{schedule}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{schedule}: {err}");
    }
}

#[test]
fn repairs_are_verified_edits_and_latent_hangs_can_fail_ci() {
    let seed = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/seed.sched");
    let seed = seed.to_str().expect("utf-8");
    let out = duplex(&["check", seed, "--format", "json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let repairs = json["repairs"].as_array().expect("repairs");
    assert!(repairs.len() >= 2, "{json}");
    for r in repairs {
        assert_eq!(r["verdict"], "ok");
        assert!(r["edits"].as_array().is_some_and(|e| !e.is_empty()), "{r}");
    }
    assert_eq!(repairs[0]["edits"][0]["change"], "insert");
    assert_eq!(repairs[0]["edits"][0]["new"], "policy per-direction");
    let text = String::from_utf8_lossy(&duplex(&["check", seed]).stdout).into_owned();
    assert!(text.contains("repairs the checker verified"), "{text}");

    // `recv; sync; send` on both ranks: per-direction lanes do not fix it,
    // and no repair is offered.
    let dir = tempdir();
    let file = dir.join("recv-sync-send.sched");
    std::fs::write(
        &file,
        "ranks 2\nrank 0:\n  recv 1 4KiB\n  sync\n  send 1 4KiB\nrank 1:\n  recv 0 4KiB\n  sync\n  send 0 4KiB\n",
    )
    .expect("write");
    let out = duplex(&["check", file.to_str().expect("utf-8"), "--format", "json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(json["verdict"], "deadlock");
    assert!(json.get("repairs").is_none(), "{json}");

    // Ok only thanks to eager capacity: a latent hang, an error with
    // --deny-latent.
    let file = dir.join("eager.sched");
    std::fs::write(
        &file,
        "ranks 2\nmodel eager=64MiB\nrank 0:\n  send 1 4KiB\n  recv 1 4KiB\nrank 1:\n  send 0 4KiB\n  recv 0 4KiB\n",
    )
    .expect("write");
    let f = file.to_str().expect("utf-8");
    let out = duplex(&["check", f]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.contains("LATENT HANG: ok under eager=64MiB"), "{text}");
    assert!(text.contains("deadlocks under eager=0B"), "{text}");
    assert_eq!(
        duplex(&["check", f, "--deny-latent"]).status.code(),
        Some(1)
    );
    let json: serde_json::Value =
        serde_json::from_slice(&duplex(&["check", f, "--format", "json"]).stdout).expect("json");
    assert_eq!(json["latent"][0]["knob"], "eager");
    assert_eq!(json["latent"][0]["cycle"].as_array().map(Vec::len), None);
    assert_eq!(
        json["latent"][0]["stuck"]["cycle"].as_array().map(Vec::len),
        Some(4)
    );
}

/// Writes `text` as `name` in the test's temporary folder.
fn write(name: &str, text: &str) -> String {
    let file = tempdir().join(name);
    std::fs::write(&file, text).expect("write");
    file.to_str().expect("utf-8").to_string()
}

#[test]
fn a_mismatch_inside_a_multi_line_group_names_the_ops_own_lines() {
    let file = write(
        "group-mismatch.sched",
        "ranks 2\nrank 0:\n  group {\n    send 1 4KiB\n    send 1 8KiB\n  }\nrank 1:\n  group { recv 0 4KiB\n    recv 0 4KiB }\n",
    );
    let out = duplex(&["check", &file]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("send: rank 0 main: send → 1 8KiB (line 5, in a group)"),
        "{text}"
    );
    assert!(
        text.contains("recv: rank 1 main: recv ← 0 4KiB (line 9, in a group)"),
        "{text}"
    );
    // The host call is still the group, at its opening line.
    assert!(
        text.contains("`group { send 1 4KiB; send 1 8KiB }` (line 3)"),
        "{text}"
    );
    let out = duplex(&["check", &file, "--format", "json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(json["error"]["kind"], "size-mismatch");
    let ops = &json["error"]["ops"];
    assert_eq!(ops[0]["line"], 5, "{json}");
    assert_eq!(ops[0]["at"], "line 5");
    assert_eq!(ops[0]["call"], "send 1 8KiB");
    assert_eq!(ops[1]["line"], 9, "{json}");
    assert_eq!(ops[1]["call"], "recv 0 4KiB");
}

#[test]
fn a_cycle_through_grouped_ops_names_each_ops_line() {
    // Groups of two ops (a group of one is a plain call under R8).
    let file = write(
        "group-cycle.sched",
        "ranks 2\nrank 0:\n  group {\n    send 1 256MiB\n    send 1 1MiB\n  }\n  group { recv 1 256MiB; recv 1 1MiB }\nrank 1:\n  group {\n\n    send 0 256MiB\n    send 0 1MiB\n  }\n  group { recv 0 256MiB; recv 0 1MiB }\n",
    );
    let out = duplex(&["check", &file]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    let cycle = text
        .lines()
        .skip_while(|l| !l.starts_with("wait-for cycle"))
        .take_while(|l| !l.starts_with("blocked host calls"))
        .collect::<Vec<_>>()
        .join("\n");
    for op in [
        "rank 0 main: send → 1 256MiB (line 4, in a group)",
        "rank 0 main: send → 1 1MiB (line 5, in a group)",
        "rank 1 main: send → 0 256MiB (line 11, in a group)",
        "rank 1 main: send → 0 1MiB (line 12, in a group)",
    ] {
        assert!(cycle.contains(op), "{op}: {text}");
    }
    // The host calls are the groups, at their opening lines.
    assert!(
        text.contains("`group { send 0 256MiB; send 0 1MiB }` (line 9)"),
        "{text}"
    );
    let out = duplex(&["check", &file, "--format", "json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(json["verdict"], "deadlock");
    let nodes: Vec<&str> = json["cycle"]
        .as_array()
        .expect("a cycle")
        .iter()
        .filter_map(|l| l["node"].as_str())
        .collect();
    assert!(
        nodes
            .iter()
            .any(|n| n.contains("send → 0 1MiB (line 12, in a group)")),
        "{nodes:?}"
    );
    let mut lines: Vec<u64> = json["ops"]
        .as_array()
        .expect("ops")
        .iter()
        .filter(|o| o["grouped"] == true)
        .filter_map(|o| o["line"].as_u64())
        .collect();
    lines.sort();
    assert_eq!(lines, [4, 5, 7, 7, 11, 12, 14, 14], "{json}");
}

/// The one JSON object a failed command prints on stdout.
fn json_failure(out: &Output, args: &[&str]) -> serde_json::Value {
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.lines().count(), 1, "{args:?}: one line: {text}");
    assert!(
        out.stderr.is_empty(),
        "{args:?}: nothing on stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {text}"))
}

#[test]
fn errors_are_json_when_json_was_asked_for() {
    let seed = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/seed.sched");
    let seed = seed.to_str().expect("utf-8");
    let bad = write("json-bad.sched", "ranks 2\nrank 0:\n  send 1 lots\n");
    let binary = tempdir().join("json-binary.sched");
    std::fs::write(&binary, b"ranks 2\n\xff\n").expect("write");
    let binary = binary.to_str().expect("utf-8");
    let cases: &[(&[&str], &str, Option<u64>, &str)] = &[
        (
            &["check", "/nonexistent/x.sched"],
            "read",
            None,
            "cannot read",
        ),
        (&["check", &bad], "parse", Some(3), "`lots` is not a size"),
        (&["check", binary], "encoding", Some(2), "not UTF-8"),
        (
            &["check", seed, "--policy", "sideways"],
            "usage",
            None,
            "sideways",
        ),
        (&["check", seed, "--eager", "lots"], "usage", None, "lots"),
        (
            &["check", seed, "--model", "kernels=0"],
            "usage",
            None,
            "kernels=0",
        ),
        (&["check", seed, "--bogus"], "usage", None, "--bogus"),
        (&["check"], "usage", None, "required"),
        (
            &["check", seed, "--replay", "v1:9"],
            "replay",
            None,
            "cannot step",
        ),
        (&["check", seed, "--replay", "0.1"], "replay", None, "v1:"),
    ];
    for (args, kind, line, says) in cases {
        for format in [&["--format", "json"][..], &["--format=json"][..]] {
            let mut argv = args.to_vec();
            argv.extend(format);
            let out = duplex(&argv);
            assert_eq!(out.status.code(), Some(2), "{argv:?}");
            let json = json_failure(&out, &argv);
            assert_eq!(json["verdict"], "invalid", "{argv:?}: {json}");
            assert_eq!(json["error"]["kind"], *kind, "{argv:?}: {json}");
            assert_eq!(json["error"]["line"].as_u64(), *line, "{argv:?}: {json}");
            let message = json["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains(says), "{argv:?}: {json}");
            assert!(!message.contains('\n'), "{argv:?}: one line: {json}");
        }
    }
    // The file is named when one is to blame.
    let out = duplex(&["check", &bad, "--format", "json"]);
    assert_eq!(json_failure(&out, &[])["file"], bad.as_str());
    // Text stays text, on stderr.
    let out = duplex(&["check", &bad]);
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("{bad}:3: `lots`")));
}

/// A run on NCCL where NCCL cannot be loaded, whatever the machine has.
fn without_nccl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(args)
        .env("DUPLEX_NCCL_LIBRARY", "/nonexistent/libnccl.so.2")
        .output()
        .expect("the duplex binary runs")
}

#[test]
fn an_unavailable_backend_exits_4_and_an_invalid_file_2() {
    let seed = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/seed.sched");
    let seed = seed.to_str().expect("utf-8");
    let out = without_nccl(&["run", seed, "--backend", "nccl"]);
    assert_eq!(out.status.code(), Some(4));
    assert!(out.stdout.is_empty());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("NCCL library is not available"), "{err}");
    let args = ["run", seed, "--backend", "nccl", "--format", "json"];
    let out = without_nccl(&args);
    assert_eq!(out.status.code(), Some(4));
    let json = json_failure(&out, &args);
    assert_eq!(json["outcome"], "unavailable", "{json}");
    assert_eq!(json["error"]["kind"], "unavailable", "{json}");
    // The file is read first: an invalid one is 2, whatever the backend.
    let bad = write("run-bad.sched", "ranks 2\nrank 0:\n  send 1 lots\n");
    let args = ["run", bad.as_str(), "--backend", "nccl", "--format", "json"];
    let out = without_nccl(&args);
    assert_eq!(out.status.code(), Some(2));
    let json = json_failure(&out, &args);
    assert_eq!(json["outcome"], "invalid", "{json}");
    assert_eq!(json["error"]["line"], 3, "{json}");
    // calibrate: every file is parsed before the GPUs are asked for.
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let args = [
        "calibrate",
        examples.to_str().expect("utf-8"),
        "--format",
        "json",
    ];
    let out = without_nccl(&args);
    assert_eq!(out.status.code(), Some(4));
    assert_eq!(json_failure(&out, &args)["outcome"], "unavailable");
    let dir = tempdir().join("calibrate-bad");
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(dir.join("a.sched"), "ranks 2\nrank 0:\n  recv 9 1B\n").expect("write");
    let args = [
        "calibrate",
        dir.to_str().expect("utf-8"),
        "--format",
        "json",
    ];
    let out = without_nccl(&args);
    assert_eq!(out.status.code(), Some(2));
    let json = json_failure(&out, &args);
    assert_eq!(json["error"]["kind"], "parse", "{json}");
    assert_eq!(json["error"]["line"], 3, "{json}");
    // A folder without examples is refused, not an empty table that
    // would read as "every example agrees".
    let empty = tempdir().join("calibrate-empty");
    std::fs::create_dir_all(&empty).expect("dir");
    let args = ["calibrate", empty.to_str().expect("utf-8")];
    let out = without_nccl(&args);
    assert_eq!(out.status.code(), Some(2));
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("holds no .sched files"), "{text}");
    // `--lanes` is the NCCL backend's: the simulator refuses it.
    let ok = write(
        "run-lanes.sched",
        "ranks 2\nrank 0:\n  send 1 4KiB\nrank 1:\n  recv 0 4KiB\n",
    );
    let args = ["run", ok.as_str(), "--lanes", "lazy"];
    let out = duplex(&args);
    assert_eq!(out.status.code(), Some(2));
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("--backend nccl"), "{text}");
}

#[test]
fn a_job_of_processes_that_cannot_start_says_which_rank_and_why() {
    let seed = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/seed.sched");
    let seed = seed.to_str().expect("utf-8");
    // A process per rank, on one GPU or on one each: every rank finds no
    // NCCL; the job is unavailable (4), naming the rank and what it lacks.
    for one_gpu in [false, true] {
        let mut args = vec!["run", seed, "--backend", "nccl", "--processes"];
        if one_gpu {
            args.push("--one-gpu");
        }
        args.extend(["--format", "json"]);
        let out = without_nccl(&args);
        assert_eq!(out.status.code(), Some(4), "{args:?}");
        let json = json_failure(&out, &args);
        assert_eq!(json["outcome"], "unavailable", "{json}");
        let message = json["error"]["message"].as_str().expect("a message");
        assert!(message.contains("did not start"), "{message}");
        assert!(message.contains("rank "), "{message}");
        assert!(
            message.contains("NCCL library is not available"),
            "{message}"
        );
    }
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let args = [
        "calibrate",
        examples.to_str().expect("utf-8"),
        "--processes",
        "--one-gpu",
        "--format",
        "json",
    ];
    let out = without_nccl(&args);
    assert_eq!(out.status.code(), Some(4));
    let json = json_failure(&out, &args);
    assert_eq!(json["outcome"], "unavailable", "{json}");
    assert!(
        json["error"]["message"]
            .as_str()
            .expect("a message")
            .contains("rank 0"),
        "{json}"
    );
    // One rank from a launcher's environment that does not fit the file.
    let out = from_env(
        seed,
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "3"),
            ("DUPLEX_STORE_TOKEN", "a-token-of-sixteen-bytes"),
            ("DUPLEX_NCCL_LIBRARY", "/nonexistent/libnccl.so.2"),
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("WORLD_SIZE=3 but the file's program has 2 ranks"),
        "{text}"
    );
    // Without a launcher's environment: what is missing and how to set it,
    // a wrong environment (status 2), as a malformed RANK is.
    let out = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["run", seed, "--backend", "nccl", "--from-env"])
        .env_remove("RANK")
        .output()
        .expect("the duplex binary runs");
    assert_eq!(out.status.code(), Some(2));
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("RANK is not set") && text.contains("torchrun"),
        "{text}"
    );
    // What cannot work with a process per rank is refused before anything
    // starts.
    for (args, says) in [
        (
            vec!["run", "-", "--backend", "nccl", "--processes"],
            "not standard input",
        ),
        (
            vec![
                "run",
                seed,
                "--backend",
                "nccl",
                "--processes",
                "--copy-from",
                "auto",
            ],
            "--copy-from auto",
        ),
        (
            vec!["run", seed, "--one-gpu", "--backend", "nccl"],
            "--processes",
        ),
        (
            vec![
                "run",
                seed,
                "--backend",
                "nccl",
                "--processes",
                "--from-env",
            ],
            "--from-env",
        ),
    ] {
        let out = without_nccl(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(text.contains(says), "{args:?}: {text}");
    }
}

#[test]
fn help_lists_the_exit_statuses() {
    let out = duplex(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    for says in [
        "Exit status:",
        "2  a file or the command line is invalid",
        "4  the backend is unavailable",
        "2, then 1, then 3, then 0",
    ] {
        assert!(text.contains(says), "{says}: {text}");
    }
}

#[test]
fn a_simulated_run_reports_its_hang_as_data() {
    let file = write(
        "run-hang.sched",
        "ranks 2\nrank 0:\n  send 1 4KiB\n  recv 1 4KiB\nrank 1:\n  send 0 4KiB\n  recv 0 4KiB\n",
    );
    let out = duplex(&["run", &file, "--format", "json"]);
    assert_eq!(out.status.code(), Some(1));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(json["outcome"], "deadlock");
    let cycle = json["hang"]["stuck"]["cycle"].as_array().expect("a cycle");
    assert_eq!(cycle.len(), 4, "{json}");
    assert!(json["hang"]["stuck"]["ops"][0]["peer"].is_u64(), "{json}");
    // Ops and calls are named at the schedule's lines, not at the code
    // that runs the schedule.
    let text = json.to_string();
    assert!(text.contains("line 3") && text.contains("line 6"), "{json}");
    assert!(!text.contains("execute.rs"), "{json}");
    // A rank with no block in the file still ends with a synchronize,
    // reported as that, and the schedule printed is the simulator's, not
    // one for `duplex check --replay`.
    let file = write(
        "run-hang-3.sched",
        "ranks 3\nrank 0:\n  send 1 4KiB\n  recv 1 4KiB\nrank 1:\n  send 0 4KiB\n  recv 0 4KiB\n",
    );
    let out = duplex(&["run", &file, "--seed", "1"]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains(".rs:"), "{text}");
    assert!(
        text.contains("synchronize (the end of rank 2, which has no block in the file)"),
        "{text}"
    );
    assert!(text.contains("simulator schedule: v1:"), "{text}");
    assert!(
        text.contains(&format!("duplex run {file} --seed 1")),
        "{text}"
    );
    let file = write(
        "run-mismatch.sched",
        "ranks 2\nrank 0:\n  send 1 4KiB\nrank 1:\n  recv 0 8KiB\n",
    );
    let out = duplex(&["run", &file, "--format", "json"]);
    assert_eq!(out.status.code(), Some(1));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(json["outcome"], "error");
    assert_eq!(json["error"]["kind"], "size-mismatch", "{json}");
    assert_eq!(json["error"]["ops"].as_array().map(Vec::len), Some(2));
}

/// Runs `duplex ARGS` with `input` on its standard input.
fn duplex_with_stdin(args: &[&str], input: &[u8]) -> Output {
    use std::io::Write as _;
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the duplex binary runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input)
        .expect("write stdin");
    child.wait_with_output().expect("output")
}

#[test]
fn a_dash_reads_the_schedule_from_stdin() {
    let seed = std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/seed.sched"))
        .expect("the seed");
    let out = duplex_with_stdin(&["check", "-"], &seed);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.starts_with("-: DEADLOCK"),
        "named `-` as given: {text}"
    );
    assert!(text.contains("duplex check - --replay v1:"), "{text}");
    let out = duplex_with_stdin(&["check", "-", "--policy", "per-direction"], &seed);
    assert_eq!(out.status.code(), Some(0));
    let args = ["check", "-", "--format", "json"];
    let out = duplex_with_stdin(&args, b"ranks 2\nrank 0:\n  recv 7 1B\n");
    assert_eq!(out.status.code(), Some(2));
    let json = json_failure(&out, &args);
    assert_eq!(json["file"], "-", "{json}");
    assert_eq!(json["error"]["line"], 3, "{json}");
    let out = duplex_with_stdin(&["check", "-"], b"ranks 2\n\xff\n");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("duplex: -:2: the file is not UTF-8"));
}

#[test]
fn several_files_get_a_verdict_each_and_the_worst_status() {
    let ok = write(
        "many-ok.sched",
        "ranks 2\nrank 0:\n  send 1 4KiB\nrank 1:\n  recv 0 4KiB\n",
    );
    let hang = write(
        "many-hang.sched",
        "ranks 2\nrank 0:\n  send 1 4KiB\n  recv 1 4KiB\nrank 1:\n  send 0 4KiB\n  recv 0 4KiB\n",
    );
    let bad = write("many-bad.sched", "ranks 2\nrank 0:\n  send 1 lots\n");
    // Text: one report after another, in the order given.
    let out = duplex(&["check", &ok, &hang, &ok]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    let heads: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with(tempdir().to_str().expect("utf-8")))
        .collect();
    assert_eq!(heads.len(), 3, "{text}");
    assert!(heads[0].contains("many-ok.sched: OK"), "{text}");
    assert!(heads[1].contains("many-hang.sched: DEADLOCK"), "{text}");
    assert!(heads[2].contains("many-ok.sched: OK"), "{text}");
    // JSON: one object per line, one line per file, an invalid file's too.
    let args = ["check", &ok, &bad, &hang, "--format", "json"];
    let out = duplex(&args);
    assert_eq!(out.status.code(), Some(2), "an invalid file is the worst");
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON object per line"))
        .collect();
    let verdicts: Vec<&str> = lines.iter().filter_map(|j| j["verdict"].as_str()).collect();
    assert_eq!(verdicts, ["ok", "invalid", "deadlock"]);
    assert_eq!(lines[1]["file"], bad.as_str());
    assert_eq!(lines[2]["file"], hang.as_str());
    // Text: the invalid file's message on stderr, the others' reports.
    let out = duplex(&["check", &bad, &ok]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("many-bad.sched:3:"));
    assert!(String::from_utf8_lossy(&out.stdout).contains("many-ok.sched: OK"));
    let out = duplex(&["check", &ok, &ok]);
    assert_eq!(out.status.code(), Some(0));
    // Deciding beats giving up: a hang (1) is worse than inconclusive (3),
    // which is worse than ok (0).
    let rpc = shared_comm("many-threads.sched", 4);
    let rpc = rpc.as_str();
    let stuck = write("many-stuck.sched", "ranks 2\nrank 0:\n  recv 1 4KiB\n");
    let bound = ["--max-states", "5"];
    for (files, status) in [
        (vec![ok.as_str(), rpc], 3),
        (vec![rpc, ok.as_str()], 3),
        (vec![rpc, stuck.as_str()], 1),
        (vec![stuck.as_str(), rpc, ok.as_str()], 1),
    ] {
        let mut args = vec!["check"];
        args.extend(&files);
        args.extend(bound);
        let out = duplex(&args);
        assert_eq!(out.status.code(), Some(status), "{args:?}");
    }
    // One --replay schedule fits one program.
    let out = duplex(&["check", &ok, &hang, "--replay", "v1:0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("give one file"));
}

#[test]
fn a_time_limit_makes_a_long_check_inconclusive_and_says_how_far_it_got() {
    let file = shared_comm("time.sched", 7);
    let f = file.as_str();
    let out = duplex(&["check", f, "--time-limit", "0.001", "--format", "json"]);
    assert_eq!(out.status.code(), Some(3));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(json["verdict"], "inconclusive");
    assert_eq!(json["stats"]["stopped"], "time");
    // The limit is looked at every 16 host steps: the search got at least
    // that far, and says so.
    assert!(
        json["stats"]["transitions"]
            .as_u64()
            .is_some_and(|n| n >= 16),
        "{json}"
    );
    let out = duplex(&["check", f, "--time-limit", "0.001"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("it reached its time limit after"), "{text}");
    assert!(text.contains("raise --time-limit"), "{text}");
    let out = duplex(&["check", f, "--time-limit", "-1"]);
    assert_eq!(out.status.code(), Some(2));
}

/// A snapshot budget too small for the search's path re-executes instead
/// of resuming: the same verdict and counts, and the report says what it
/// took again; a budget that is not a size is refused.
#[test]
fn a_small_snapshot_memory_gives_the_same_verdict_and_says_what_it_redid() {
    let file = shared_comm("snapshots.sched", 4);
    let f = file.as_str();
    let json = |extra: &[&str]| {
        let mut args = vec!["check", f, "--format", "json"];
        args.extend(extra);
        let out = duplex(&args);
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        serde_json::from_slice::<serde_json::Value>(&out.stdout).expect("json")
    };
    let full = json(&[]);
    let small = json(&["--snapshot-memory", "1KiB"]);
    assert_eq!(small["verdict"], full["verdict"]);
    for key in ["states", "transitions", "executions", "depth"] {
        assert_eq!(small["stats"][key], full["stats"][key], "{key}");
    }
    assert!(full["stats"].get("snapshots").is_none(), "{full}");
    let thinned = &small["stats"]["snapshots"];
    assert!(
        thinned["replayed"].as_u64().is_some_and(|n| n > 0),
        "{small}"
    );
    assert_eq!(thinned["kept_none"], true, "{small}");
    let out = duplex(&["check", f, "--snapshot-memory", "1KiB"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("it kept none"), "{text}");
    // Room for a few snapshots: some kept, the others taken again.
    let some = json(&["--snapshot-memory", "8KiB"]);
    assert_eq!(some["stats"]["states"], full["stats"]["states"]);
    let thinned = &some["stats"]["snapshots"];
    assert_eq!(thinned["kept_none"], false, "{some}");
    assert!(thinned["every"].as_u64().is_some_and(|n| n > 1), "{some}");
    let out = duplex(&["check", f, "--snapshot-memory", "lots"]);
    assert_eq!(out.status.code(), Some(2));
}

/// A hang after a long run: the text shows the start and the end of the
/// interleaving, and the schedule is the compact `v3:` form (the ranks have
/// one thread each, so the search had no choice to record), which replays
/// to the same hang.
#[test]
fn a_long_interleaving_is_shortened_and_its_v3_schedule_replays() {
    let k = 200;
    let mut text = String::from("ranks 2\nrank 0:\n");
    text.push_str(&"  send 1 4KiB\n".repeat(k));
    text.push_str("  recv 1 256MiB\n  send 1 256MiB\nrank 1:\n");
    text.push_str(&"  recv 0 4KiB\n".repeat(k));
    text.push_str("  recv 0 256MiB\n  send 0 256MiB\n");
    let dir = tempdir();
    let file = dir.join("long.sched");
    std::fs::write(&file, &text).expect("write");
    let file = file.to_str().expect("utf-8");
    let out = duplex(&["check", file]);
    assert_eq!(out.status.code(), Some(1));
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(shown.contains("host steps not shown"), "{shown}");
    assert!(shown.lines().count() < 120, "{shown}");
    let out = duplex(&["check", file, "--format", "json"]);
    let found: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(found["steps"].as_array().map(Vec::len), Some(2 * k + 6));
    let schedule = found["schedule"].as_str().expect("a schedule");
    assert_eq!(schedule, "v3:");
    let out = duplex(&["check", file, "--replay", schedule, "--format", "json"]);
    assert_eq!(out.status.code(), Some(1));
    let again: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(again["cycle"], found["cycle"]);
    assert_eq!(again["steps"], found["steps"]);
}

/// A `v2:` schedule, printed by duplex before the search took bursts of
/// steps (2026-12-01, commit 5ccf6c1, for this program: `v2:0.2`), still
/// replays to the interleaving it named then: ranks 2 and 3 in one-step
/// turns, then rank 0's two threads and rank 1's, into the deadlock of
/// their sends on one communicator. Today's search prints `v3:0.2` for the
/// same choices, whose interleaving runs rank 2 and rank 3 in bursts and
/// reaches the same stuck state.
#[test]
fn a_v2_schedule_of_an_earlier_version_replays_as_it_did() {
    let mut text = String::from("ranks 4\n");
    text.push_str("rank 0 thread a:\n  send 1 256MiB comm=world stream=s1\n");
    text.push_str("rank 0 thread b:\n  recv 1 256MiB comm=world stream=s2\n");
    text.push_str("rank 1 thread c:\n  send 0 256MiB comm=world stream=s1\n");
    text.push_str("rank 1 thread d:\n  recv 0 256MiB comm=world stream=s2\n");
    text.push_str("rank 2:\n");
    text.push_str(&"  group { send 3 4KiB; recv 3 4KiB }\n".repeat(100));
    text.push_str("rank 3:\n");
    text.push_str(&"  group { send 2 4KiB; recv 2 4KiB }\n".repeat(100));
    let dir = tempdir();
    let file = dir.join("bursts.sched");
    std::fs::write(&file, &text).expect("write");
    let file = file.to_str().expect("utf-8");
    let run = |args: &[&str]| -> serde_json::Value {
        let out = duplex(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        serde_json::from_slice(&out.stdout).expect("json")
    };
    let ranks = |v: &serde_json::Value| -> String {
        v["steps"]
            .as_array()
            .expect("steps")
            .iter()
            .map(|s| s["rank"].to_string())
            .collect()
    };
    let old = run(&["check", file, "--replay", "v2:0.2", "--format", "json"]);
    assert_eq!(old["verdict"], "deadlock");
    // (101 steps each: 100 groups and the end of the thread.)
    assert_eq!(ranks(&old), format!("{}00001111", "23".repeat(101)));
    let found = run(&["check", file, "--format", "json"]);
    assert_eq!(found["schedule"], "v3:0.2");
    assert!(
        ranks(&found).starts_with(&"2".repeat(64)),
        "{}",
        ranks(&found)
    );
    let new = run(&["check", file, "--replay", "v3:0.2", "--format", "json"]);
    assert_eq!(ranks(&new), ranks(&found));
    for key in ["cycle", "blocked", "ops"] {
        assert_eq!(new[key], old[key], "{key}");
    }
}

#[test]
fn copy_engine_lanes_need_the_per_direction_policy() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let seed = dir.join("seed.sched");
    let seed = seed.to_str().expect("utf-8 path");
    // The seed's policy is shared: --copy-from alone is a usage error.
    let out = duplex(&["check", seed, "--copy-from", "1MiB"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--policy per-direction"), "{err}");
    let out = duplex(&[
        "check",
        seed,
        "--policy",
        "per-direction",
        "--copy-from",
        "1MiB",
    ]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("checked under policy per-direction copy-from=1MiB"),
        "{text}"
    );
    // A bad policy setting in a file names its line.
    let bad = std::env::temp_dir().join(format!("duplex-copy-{}.sched", std::process::id()));
    std::fs::write(&bad, "ranks 2\npolicy shared copy-from=1MiB\n").expect("write");
    let out = duplex(&["check", bad.to_str().expect("utf-8")]);
    let _ = std::fs::remove_file(&bad);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(":2:") && err.contains("per direction"),
        "{err}"
    );
    // `auto` measures on GPUs: the simulator needs a size; a bad value
    // names both forms.
    for (args, says) in [
        (
            vec![
                "run",
                seed,
                "--policy",
                "per-direction",
                "--copy-from",
                "auto",
            ],
            "--backend nccl",
        ),
        (vec!["run", seed, "--copy-from", "fast"], "or `auto`"),
    ] {
        let out = duplex(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
    let copy = dir.join("copy-lanes-seed.sched");
    // The simulator runs it (smaller, as the simulator moves real bytes).
    let small =
        std::env::temp_dir().join(format!("duplex-copy-small-{}.sched", std::process::id()));
    let text = std::fs::read_to_string(&copy)
        .expect("read")
        .replace("256MiB", "2MiB");
    std::fs::write(&small, text).expect("write");
    let out = duplex(&["run", small.to_str().expect("utf-8")]);
    let _ = std::fs::remove_file(&small);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The README shows what `duplex check examples/seed.sched` prints: its
/// shown lines are the command's own (the README elides some with `...`
/// and `[...]`), so the sample cannot go stale.
#[test]
fn the_readmes_sample_output_is_what_the_checker_prints() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let sample: Vec<&str> = readme
        .split("## What the checker prints")
        .nth(1)
        .and_then(|s| s.split("```").nth(1))
        .expect("the README's sample block")
        .lines()
        .filter(|l| !l.trim().is_empty() && l.trim() != "...")
        .collect();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_duplex"))
        .current_dir(&root)
        .args(["check", "examples/seed.sched"])
        .output()
        .expect("the duplex binary runs");
    let printed = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = printed.lines().collect();
    assert!(sample.len() > 10, "{sample:?}");
    for shown in sample {
        // `[...]` stands for the end of a line the README shortens.
        let found = match shown.split_once("[...]") {
            Some((head, _)) => lines.iter().any(|l| l.starts_with(head)),
            None => lines.contains(&shown),
        };
        assert!(
            found,
            "the README shows a line the checker does not print:\n{shown}\n---\n{printed}"
        );
    }
}

/// `duplex run` on the simulator says how to replay what it found with the
/// same command (its seed follows the same schedule), not with the
/// simulator's Rust API; and following it finds the same.
#[test]
fn run_says_how_to_replay_with_the_command_line() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/size-mismatch.sched");
    let file = file.to_str().expect("a UTF-8 path");
    let args = ["run", file, "--seed", "5", "--model", "eager=0B"];
    let out = duplex(&args);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let hint = format!("replay it with: duplex run {file} --seed 5 --model eager=0B");
    assert!(text.contains(&hint), "{text}");
    assert!(!text.contains("duplex_sim::"), "{text}");
    // The same again, but for the time on the first line.
    let again = String::from_utf8_lossy(&duplex(&args).stdout).into_owned();
    let body = |t: &str| t.split_once('\n').map(|(_, b)| b.to_string());
    assert_eq!(body(&again), body(&text));
}

/// `--trace`: a hang's interleaving is written as a Chrome trace; an ok
/// program writes none and says so; a trace that cannot be written is said
/// on standard error, and the report and exit status are the check's.
#[test]
fn a_trace_is_written_for_a_hang_and_its_failures_are_said() {
    let dir = std::env::temp_dir().join(format!("duplex-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    let ex = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let seed = ex.join("seed.sched");
    let seed = seed.to_str().expect("utf-8 path");
    let out_path = dir.join("seed.json");
    let out = duplex(&["check", seed, "--trace", out_path.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(1));
    let trace: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&out_path).expect("the trace was written"))
            .expect("the trace is JSON");
    assert!(trace.to_string().contains("rank 0"), "{trace}");
    // An ok program: no trace, and a note.
    let ok = ex.join("seed-rpc-per-direction.sched");
    let none = dir.join("none.json");
    let out = duplex(&[
        "check",
        ok.to_str().expect("utf-8"),
        "--trace",
        none.to_str().expect("utf-8"),
    ]);
    assert_eq!(out.status.code(), Some(0));
    assert!(!none.exists());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no trace written"), "{err}");
    // A path that cannot be written: the report still comes, exit 1.
    let out = duplex(&["check", seed, "--trace", "/nonexistent-duplex-dir/t.json"]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("wait-for cycle"), "{text}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot write the trace"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A hang across many ranks lists 40 of its blocked calls and ops in the
/// text, and says how many more there are and where they all are; the
/// JSON keeps every one.
#[test]
fn a_hang_across_many_ranks_lists_forty_and_says_how_many_more() {
    let ranks = 120;
    let mut text = format!("ranks {ranks}\n");
    for r in 0..ranks {
        let peer = r ^ 1;
        text.push_str(&format!(
            "rank {r}:\n  send {peer} 256MiB\n  recv {peer} 256MiB\n"
        ));
    }
    let dir = tempdir();
    let file = dir.join("pairs.sched");
    std::fs::write(&file, text).expect("writes");
    let file = file.to_str().expect("utf-8 path");
    let out = duplex(&["check", file]);
    assert_eq!(out.status.code(), Some(1));
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        report.contains(
            "… 80 more not shown (all of them: the report's `blocked` list, `--format json`)"
        ),
        "{report}"
    );
    assert!(
        report.contains(
            "… 200 more not shown (all of them: the report's `ops` list, `--format json`)"
        ),
        "{report}"
    );
    let out = duplex(&["check", file, "--format", "json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(
        json["blocked"].as_array().map(Vec::len),
        Some(ranks),
        "{json}"
    );
    // Each rank's send and its recv, both pending.
    assert_eq!(
        json["ops"].as_array().map(Vec::len),
        Some(2 * ranks),
        "{json}"
    );
}

/// An argument that is not UTF-8 (a Latin-1 file name, say) gets clap's
/// error and status 2, in text and in JSON, never a panic.
#[test]
fn an_argument_that_is_not_utf8_is_refused_without_a_panic() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    for args in [
        vec![OsStr::new("check"), OsStr::from_bytes(b"caf\xe9.sched")],
        vec![
            OsStr::new("check"),
            OsStr::new("--format"),
            OsStr::new("json"),
            OsStr::from_bytes(b"caf\xe9.sched"),
        ],
        vec![OsStr::from_bytes(b"\xff")],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_duplex"))
            .args(&args)
            .output()
            .expect("the duplex binary runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// The repair that sets `policy per-direction` puts its line after
/// `ranks` in a file that starts with a byte-order mark (not at the top,
/// where the parser refuses it), and is no edit at all where the file
/// says so already and only `--policy shared` overrode it.
#[test]
fn the_policy_repair_fits_a_byte_order_mark_and_a_policy_given_on_the_command_line() {
    let dir = std::env::temp_dir().join(format!("duplex-policy-repair-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let seed = "rank 0:\n  send 1 4KiB\n  recv 1 4KiB\nrank 1:\n  send 0 4KiB\n  recv 0 4KiB\n";
    let bom = dir.join("bom.sched");
    std::fs::write(&bom, format!("\u{feff}ranks 2\n{seed}")).unwrap();
    let out = duplex(&["check", bom.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("after line 1: insert `policy per-direction`"),
        "{text}"
    );
    let said = dir.join("said.sched");
    std::fs::write(&said, format!("ranks 2\npolicy per-direction\n{seed}")).unwrap();
    let out = duplex(&["check", said.to_str().unwrap(), "--policy", "shared"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("check it with `--policy per-direction` in place of the command line's `--policy shared`"),
        "{text}"
    );
    assert!(
        !text.contains("with `policy per-direction`"),
        "a replacement that changes nothing: {text}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--time-limit` bounds the whole command, the advice after the search
/// included: a ring of 256 ranks of 4 threads each, with a seed pair that
/// hangs, whose repairs took 158 s to check under `--time-limit 1` when
/// each candidate had its own bound (6 s here: a debug build's search
/// needs more than 1 to find the hang); the report says the advice
/// stopped.
#[test]
fn the_time_limit_bounds_the_advice_too() {
    let dir = std::env::temp_dir().join(format!("duplex-advice-limit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // The seed pair first (ranks 0 and 1), so that the search finds its
    // hang at once; then the ring, on ranks 2 and up.
    let ring = 256u32;
    let mut text = format!(
        "ranks {}\nrank 0:\n  send 1 4KiB\n  recv 1 4KiB\nrank 1:\n  send 0 4KiB\n  recv 0 4KiB\n",
        ring + 2
    );
    for r in 0..ring {
        for t in 0..4 {
            text += &format!(
                "rank {} thread t{t}:\n  send {} 4KiB\n  recv {} 4KiB\n",
                r + 2,
                (r + 1) % ring + 2,
                (r + ring - 1) % ring + 2
            );
        }
    }
    let file = dir.join("ring-plus-seed.sched");
    std::fs::write(&file, text).unwrap();
    let start = std::time::Instant::now();
    let out = duplex(&[
        "check",
        file.to_str().unwrap(),
        "--time-limit",
        "6",
        "--format",
        "json",
    ]);
    let took = start.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        took < std::time::Duration::from_secs(30),
        "took {took:?}: {stdout}"
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    let report = &v["reports"][0];
    let report = if report.is_null() { &v } else { report };
    assert_eq!(report["verdict"], "deadlock", "{stdout}");
    assert_eq!(report["advice_cut"], true, "{stdout}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The command `duplex run` prints to replay a failure is one a shell
/// runs as it is: a path with a space is quoted, as `check` quotes it.
#[test]
fn run_quotes_the_path_in_its_replay_command() {
    let dir = std::env::temp_dir().join(format!("duplex run quoting {}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("seed it.sched");
    std::fs::write(
        &file,
        "ranks 2\nrank 0:\n  send 1 4KiB\n  recv 1 4KiB\nrank 1:\n  send 0 4KiB\n  recv 0 4KiB\n",
    )
    .unwrap();
    let out = duplex(&["run", file.to_str().unwrap()]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let quoted = format!("replay it with: duplex run '{}' --seed 0", file.display());
    assert!(text.contains(&quoted), "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A device is refused before it is read (`/dev/zero` never ends: it was
/// read up to the 1 GiB bound first), and standard input given twice is a
/// usage error rather than an empty second program.
#[test]
fn a_device_and_standard_input_twice_are_refused_at_once() {
    let out = duplex(&["check", "/dev/zero"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("is a device"), "{stderr}");
    let out = duplex(&["check", "-", "-"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("more than once"), "{stderr}");
}

fn example(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(name)
        .to_str()
        .expect("utf-8 path")
        .to_string()
}

fn json_of(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// Under `--policy shared` on the command line, an edit of the file's
/// `policy` line would change nothing: the policy repair is the flag, and
/// the flag does make the program ok.
#[test]
fn a_policy_given_on_the_command_line_is_repaired_by_the_flag() {
    for name in ["seed.sched", "copy-lanes-seed.sched"] {
        let file = example(name);
        let out = duplex(&["check", &file, "--policy", "shared", "--format", "json"]);
        assert_eq!(out.status.code(), Some(1), "{name}");
        let json = json_of(&out);
        let first = &json["repairs"][0];
        let title = first["title"].as_str().expect("a title");
        assert!(
            title.contains("check it with `--policy per-direction`"),
            "{name}: {title}"
        );
        assert_eq!(first["edits"].as_array().map(Vec::len), Some(0), "{name}");
        let out = duplex(&["check", &file, "--policy", "per-direction"]);
        assert_eq!(out.status.code(), Some(0), "{name}");
    }
}

/// A hang there before the first host step has an interleaving of no
/// steps: `steps` is `[]` in JSON, as for any deadlock, and the text says so.
#[test]
fn a_hang_before_any_step_has_an_empty_interleaving() {
    let file = write(
        "awaits.sched",
        "ranks 2\nrank 0:\n  await 1 x\nrank 1:\n  await 0 y\n",
    );
    let file = file.as_str();
    let out = duplex(&["check", file, "--format", "json"]);
    let json = json_of(&out);
    assert_eq!(json["verdict"], "deadlock");
    assert_eq!(json["steps"], serde_json::json!([]), "{json}");
    let text = String::from_utf8_lossy(&duplex(&["check", file]).stdout).into_owned();
    assert!(
        text.contains("interleaving that leads there: none"),
        "{text}"
    );
}

/// The replay command a report prints runs as printed, even for a file
/// whose name starts with `-`.
#[test]
fn the_replay_command_of_a_dash_file_runs() {
    let dir = tempdir().join("dash");
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::copy(example("seed.sched"), dir.join("-seed.sched")).expect("copy");
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_duplex"))
            .args(args)
            .current_dir(&dir)
            .output()
            .expect("runs")
    };
    let json = json_of(&run(&["check", "--format", "json", "--", "-seed.sched"]));
    let replay = json["replay"].as_str().expect("a replay command");
    let words: Vec<&str> = replay.split(' ').collect();
    assert_eq!(
        &words[..3],
        ["duplex", "check", "./-seed.sched"],
        "{replay}"
    );
    let out = run(&words[1..]);
    assert_eq!(out.status.code(), Some(1), "{replay}: {out:?}");
}

/// Two files whose traces would go to one file are refused before any is
/// checked, where the second trace overwrote the first.
#[test]
fn traces_that_would_collide_are_refused() {
    let dir = tempdir().join("collide");
    std::fs::create_dir_all(dir.join("a")).expect("dir");
    std::fs::copy(example("seed.sched"), dir.join("a/b.sched")).expect("copy");
    std::fs::copy(example("seed.sched"), dir.join("a_b.sched")).expect("copy");
    let out = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["check", "a/b.sched", "a_b.sched", "--trace", "t.json"])
        .current_dir(&dir)
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("would both go to t.json.a_b.sched"), "{err}");
    assert!(!dir.join("t.json.a_b.sched").exists());
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_duplex"))
            .args(args)
            .current_dir(&dir)
            .output()
            .expect("runs")
    };
    // A trace that would overwrite a file given is refused too.
    std::fs::copy(example("seed.sched"), dir.join("t.a_b.sched")).expect("copy");
    let out = run(&["check", "a_b.sched", "t.a_b.sched", "--trace", "t"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("would overwrite t.a_b.sched"), "{err}");
    // Named another way (`./`), the file given is still refused as the
    // trace, and left as it was.
    let before = std::fs::read(dir.join("a_b.sched")).expect("read");
    let out = run(&["check", "a_b.sched", "--trace", "./a_b.sched"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("would overwrite a_b.sched"), "{err}");
    assert_eq!(std::fs::read(dir.join("a_b.sched")).expect("read"), before);
    // The same file twice writes the same trace twice: no clash.
    let out = run(&["check", "a_b.sched", "a_b.sched", "--trace", "t2"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(dir.join("t2.a_b.sched").exists());
}

/// A report that cannot be written is an error (status 2, said on stderr),
/// not a silent verdict.
#[test]
fn a_report_that_cannot_be_written_is_an_error() {
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        return; // no /dev/full here: nothing to show
    };
    let out = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["check", &example("seed.sched")])
        .stdout(full)
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot write the report"), "{err}");
}

/// A standard error that cannot be written loses its lines, never the
/// exit status: a malformed file is still status 2, not a panic's 101
/// (found by review: `duplex check bad.sched 2>/dev/full` panicked).
#[test]
fn a_standard_error_that_cannot_be_written_is_not_a_panic() {
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        return; // no /dev/full here: nothing to show
    };
    let dir = std::env::temp_dir().join(format!("duplex-cli-stderr-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let bad = dir.join("bad.sched");
    std::fs::write(&bad, "ranks 2\nrank 0:\n  send 1 lots\n").expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["check", bad.to_str().expect("utf-8 path")])
        .stderr(full)
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A launcher's environment that does not fit is said as the variable's
/// problem (not "invalid call at RANK"), and a world size other than the
/// file's comes first, before the store's secret (found by review).
#[test]
fn a_wrong_launcher_environment_names_the_variable_and_the_world_size_first() {
    let seed = example("seed.sched");
    let out = from_env(
        &seed,
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "3"),
            ("DUPLEX_STORE_TOKEN", "short"),
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("WORLD_SIZE=3 but the file's program has 2 ranks")
            && !text.contains("invalid call"),
        "{text}"
    );
    let out = from_env(&seed, &[("RANK", "-1"), ("WORLD_SIZE", "2")]);
    assert_eq!(out.status.code(), Some(2));
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("the launcher's environment: RANK=-1") && !text.contains("invalid call"),
        "{text}"
    );
}

/// `duplex run FILE --backend nccl --from-env` as one rank of a launcher
/// on this host (`LOCAL_RANK` 0, the store at 127.0.0.1:29500), with
/// `envs` besides.
fn from_env(file: &str, envs: &[(&str, &str)]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["run", file, "--backend", "nccl", "--from-env"])
        .envs([
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .envs(envs.iter().copied())
        .output()
        .expect("the duplex binary runs")
}

/// A file past the 256 MiB bound is refused before it is parsed, by its
/// size where it is a regular file (a sparse one here: nothing is read)
/// and after the bound where it comes through a pipe, in text and JSON.
#[test]
fn a_file_past_the_bound_is_refused_before_it_is_parsed() {
    let bound = 256u64 << 20;
    let big = tempdir().join("big.sched");
    let f = std::fs::File::create(&big).expect("create");
    f.set_len(bound + 1).expect("a sparse file");
    drop(f);
    let path = big.to_str().expect("utf-8 path");
    let out = duplex(&["check", path]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("is larger than 256MiB"), "{stderr}");
    let out = duplex(&["check", path, "--format", "json"]);
    assert_eq!(out.status.code(), Some(2));
    let json = json_of(&out);
    assert_eq!(json["verdict"], "invalid", "{json}");
    assert_eq!(json["error"]["kind"], "read", "{json}");
    let message = json["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("larger than 256MiB"), "{json}");
    // Just at the bound the file is read: here it is all zero bytes, which
    // the parser refuses as text that is not a schedule, not by its size.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&big)
        .expect("open");
    f.set_len(bound).expect("truncate");
    drop(f);
    let out = duplex(&["check", path]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(!stderr.contains("is larger than"), "{stderr}");
    std::fs::remove_file(&big).expect("remove");
    // Through a pipe, one byte past the bound.
    let mut input = b"ranks 2\n".to_vec();
    input.resize(bound as usize + 1, b'#');
    let out = duplex_with_stdin(&["check", "-"], &input);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("standard input is larger than 256MiB"),
        "{stderr}"
    );
}

/// A stub NCCL (it loads; every call fails) and a stub CUDA driver whose
/// `cuInit` returns `STUB_INIT`, with every function duplex looks up, but
/// lacking `cuGetErrorString` when `lacking`, compiled into `dir` with the C compiler that links Rust
/// here: what a machine without a usable GPU looks like to duplex.
fn stub_libraries(dir: &Path, lacking: Option<&str>) -> (PathBuf, PathBuf) {
    let nccl = r#"
int ncclGetVersion(int*v){*v=22803;return 0;}
int ncclGetUniqueId(void*p){return 3;}
int ncclCommInitRankConfig(){return 3;}
int ncclCommSplit(){return 3;}
int ncclCommDestroy(){return 3;}
int ncclCommAbort(){return 3;}
int ncclCommGetAsyncError(){return 3;}
const char* ncclGetErrorString(int r){return "stub error";}
int ncclGroupStart(){return 3;}
int ncclGroupEnd(){return 3;}
int ncclSend(){return 3;}
int ncclRecv(){return 3;}
"#;
    let cuda = format!(
        r#"
#include <stdlib.h>
int cuInit(unsigned f){{const char*v=getenv("STUB_INIT");return v?atoi(v):100;}}
int cuDriverGetVersion(int*v){{*v=12040;return 0;}}
int cuDeviceGetCount(int*c){{const char*v=getenv("STUB_COUNT");*c=v?atoi(v):0;return 0;}}
int cuGetErrorName(int e,const char**s){{*s="CUDA_ERROR_STUB";return 0;}}
{}
{}
"#,
        if lacking == Some("cuGetErrorString") {
            ""
        } else {
            r#"int cuGetErrorString(int e,const char**s){*s= e==100?"no CUDA-capable device is detected":"CUDA driver is a stub library";return 0;}"#
        },
        // Every other function duplex looks up before its first call
        // (`duplex_nccl::cuda::DRIVER`), failing as a stub's do.
        duplex_nccl::cuda::DRIVER
            .iter()
            .filter(|f| !["cuInit", "cuDeviceGetCount", "cuGetErrorString"].contains(f))
            .filter(|f| lacking != Some(**f))
            .map(|f| format!("int {f}(){{return 34;}}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let build = |name: &str, lib: &str, source: &str| {
        let sub = dir.join(name);
        std::fs::create_dir_all(&sub).expect("dir");
        let c = sub.join("stub.c");
        std::fs::write(&c, source).expect("write");
        let so = sub.join(lib);
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let built = Command::new(&cc)
            .args(["-shared", "-fPIC", "-o"])
            .arg(&so)
            .arg(&c)
            .status()
            .unwrap_or_else(|e| panic!("the C compiler `{cc}` (set CC) runs: {e}"));
        assert!(built.success(), "{cc} built {lib}");
        so
    };
    let nccl = build("nccl", "libnccl.so.2", nccl);
    let cuda = build(
        &format!("cuda-lacking-{}", lacking.unwrap_or("none")),
        "libcuda.so.1",
        &cuda,
    );
    (nccl, cuda)
}

/// No usable GPU, both as a thread per rank and as a process per rank:
/// the CUDA driver sees no device, is a toolkit's stub, lacks a function,
/// or the machine has fewer GPUs than the job's local ranks. Each is exit
/// status 4 with what is missing and how to point at it; never a crash
/// (exit 1), never a panic (a stub lacking a symbol panicked in cudarc).
#[test]
fn no_usable_gpu_is_unavailable_whichever_way_the_ranks_run() {
    let dir = tempdir().join("stubs");
    let (nccl, cuda) = stub_libraries(&dir, None);
    let (_, lacking) = stub_libraries(&dir, Some("cuGetErrorString"));
    // A driver older than a function duplex calls later (cudarc panicked
    // at its first call; now refused before the first): with a device.
    let (_, old) = stub_libraries(&dir, Some("cuStreamWriteValue32_v2"));
    let seed = example("seed.sched");
    let cases: [(&Path, &str, &str, &str); 5] = [
        (&cuda, "100", "1", "the CUDA driver sees none"),
        (&old, "0", "2", "lacks `cuStreamWriteValue32_v2`"),
        (
            &cuda,
            "34",
            "1",
            "put the NVIDIA driver's own libcuda.so.1 first",
        ),
        (&lacking, "100", "1", "lacks `cuGetErrorString`"),
        (&cuda, "0", "0", "GPU"),
    ];
    for (lib, init, count, said) in cases {
        for launch in [&[][..], &["--processes"][..]] {
            let mut args = vec!["run", seed.as_str(), "--backend", "nccl"];
            args.extend_from_slice(launch);
            let out = Command::new(env!("CARGO_BIN_EXE_duplex"))
                .args(&args)
                .env("DUPLEX_NCCL_LIBRARY", &nccl)
                .env("LD_LIBRARY_PATH", lib.parent().expect("the stub's folder"))
                .env("STUB_INIT", init)
                .env("STUB_COUNT", count)
                .env_remove("CUDA_VISIBLE_DEVICES")
                .output()
                .expect("the duplex binary runs");
            let err = String::from_utf8_lossy(&out.stderr);
            let case = format!("cuInit {init}, {count} GPUs, {lib:?}, {launch:?}");
            assert_eq!(out.status.code(), Some(4), "{case}: {err}");
            assert!(
                err.contains("is not available") && err.contains(said),
                "{case}: {err}"
            );
            assert!(!err.contains("panicked"), "{case}: {err}");
        }
    }
}

/// A run checks every message's bytes, each carrying its number on its
/// channel where one thread sends and one receives there: a rank's
/// messages to itself count sends and recvs apart (they were counted
/// together, and a second message to itself read as wrong bytes).
#[test]
fn messages_to_itself_and_to_a_peer_arrive_with_their_bytes() {
    let file = write(
        "self.sched",
        "ranks 2\nrank 0:\n  group { send 0 4KiB; recv 0 4KiB }\n  group { send 0 4KiB; recv 0 4KiB }\n  send 1 4KiB\n  send 1 4KiB\nrank 1:\n  recv 0 4KiB\n  recv 0 4KiB\n",
    );
    let out = duplex(&["run", &file]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every example the checker finds cannot hang (`# expect: ok`, with no
/// setting or with a policy or a copy-engine threshold, which `run` takes
/// too) and whose messages are at most 4 MiB (a debug build takes some 40
/// s to fill and check 256 MiB ones) runs on the simulator to its end with
/// every message's bytes checked: a run that moved the wrong bytes, or
/// that the payload check misjudged (found by review: a rank's messages to
/// itself), fails here.
#[test]
fn every_example_the_checker_passes_runs_with_its_bytes() {
    let mut ran = 0;
    for file in examples() {
        let text = std::fs::read_to_string(&file).expect("readable");
        let program = duplex::schedule::parse(&text).expect("an example parses");
        let largest = program
            .threads
            .iter()
            .flat_map(|t| &t.body)
            .flat_map(|s| s.p2ps())
            .map(|o| o.size.bytes())
            .max()
            .unwrap_or(0);
        if largest > 4 << 20 {
            continue;
        }
        for (args, verdict) in expectations(&text) {
            let runnable = args.is_empty()
                || (args.len() == 2 && ["--policy", "--copy-from"].contains(&args[0].as_str()));
            if verdict != "ok" || !runnable {
                continue;
            }
            let mut argv = vec!["run", file.to_str().expect("utf-8 path")];
            argv.extend(args.iter().map(String::as_str));
            let out = duplex(&argv);
            assert_eq!(
                out.status.code(),
                Some(0),
                "{argv:?}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            ran += 1;
        }
    }
    assert!(ran >= 10, "only {ran} runs");
}
