//! The fault matrix of duplex-nccl on two GPUs: each case runs a job of two
//! ranks, injects one fault (a rank killed with SIGKILL before, during or
//! after a 256 MiB transfer, frozen with SIGSTOP (and left frozen, or
//! resumed once the others took it for dead: it must end too), returning early (its
//! partner waiting for a transfer, or for a notify), panicking,
//! rank 0 killed, a wrong `WORLD_SIZE`, NCCL missing on one rank), or of
//! four ranks on GPU 0 (a ring with one rank killed, frozen or panicking;
//! two pairs, one rank of one pair killed, so the other pair hears of it
//! only through the store), and judges
//! what the surviving ranks did: every one must exit by itself with an
//! error that names the failed rank, within its deadline plus a bounded
//! grace after the fault (a partner that returned early, before its
//! deadline: its unmatched op is known); no process may be left running; no rank may
//! report success for bytes that did not arrive (every transfer's bytes are
//! checked).
//!
//! `faults drive [--out FILE] [--only CASE]` runs the matrix and writes a
//! markdown table (`scripts/gpu.sh run faults` puts it in
//! `docs/gpu/faults.md`). With `DUPLEX_ONE_GPU=1`, on a machine with one
//! GPU, it runs the process cases only, both ranks on GPU 0 over loopback
//! sockets ([`duplex_nccl::shared_gpu_env`]): their behaviour, not their
//! speed. `faults rank CASE` and `faults local CASE` are
//! the children it starts.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use duplex::{Error, Policy, Transport};
use duplex_nccl::{Local, NcclRank, Process};

/// The deadline of every wait in the jobs.
const DEADLINE: Duration = Duration::from_secs(5);
/// What a survivor may take beyond its deadline after the fault: the
/// health monitor's silence (3 s) and heartbeat, a hang analysis's wait for
/// the others' traces (2 s), and teardown.
const GRACE: Duration = Duration::from_secs(10);
/// Elements of the 256 MiB transfers.
const LEN: usize = 64 << 20;

/// One case of the matrix.
struct Case {
    name: &'static str,
    /// Run as a process per rank (else: one process, a thread per rank).
    processes: bool,
    /// Ranks in the job.
    world: u32,
    /// The rank whose fault it is.
    victim: u32,
    /// What the driver does when the victim prints `MARK`.
    action: Action,
    /// Environment for the victim only.
    env: &'static [(&'static str, &'static str)],
}

#[derive(Clone, Copy, PartialEq)]
enum Action {
    None,
    Kill,
    Stop,
    /// SIGSTOP, then SIGCONT once the others have taken it for dead
    /// ([`RESUME_AFTER`]): the victim must end by itself too.
    StopResume,
}

/// How long a `StopResume` victim stays frozen: past the health monitor's
/// silence (3 s), so that the others take it for dead.
const RESUME_AFTER: Duration = Duration::from_secs(5);

const CASES: &[Case] = &[
    Case {
        name: "kill-before",
        processes: true,
        world: 2,
        victim: 1,
        action: Action::Kill,
        env: &[],
    },
    Case {
        name: "kill-during",
        processes: true,
        world: 2,
        victim: 1,
        action: Action::Kill,
        env: &[],
    },
    Case {
        name: "kill-after",
        processes: true,
        world: 2,
        victim: 1,
        action: Action::Kill,
        env: &[],
    },
    Case {
        name: "stop-during",
        processes: true,
        world: 2,
        victim: 1,
        action: Action::Stop,
        env: &[],
    },
    Case {
        name: "stop-resume",
        processes: true,
        world: 2,
        victim: 1,
        action: Action::StopResume,
        env: &[],
    },
    Case {
        name: "early-return",
        processes: true,
        world: 2,
        victim: 1,
        action: Action::None,
        env: &[],
    },
    Case {
        name: "early-return-await",
        processes: true,
        world: 2,
        victim: 1,
        action: Action::None,
        env: &[],
    },
    Case {
        name: "panic",
        processes: true,
        world: 2,
        victim: 1,
        action: Action::None,
        env: &[],
    },
    Case {
        name: "rank0-killed",
        processes: true,
        world: 2,
        victim: 0,
        action: Action::Kill,
        env: &[],
    },
    Case {
        name: "wrong-world-size",
        processes: true,
        world: 2,
        victim: 1,
        action: Action::None,
        env: &[("WORLD_SIZE", "3")],
    },
    Case {
        name: "nccl-missing",
        processes: true,
        world: 2,
        victim: 1,
        action: Action::None,
        env: &[("DUPLEX_NCCL_LIBRARY", "/bin/true")],
    },
    Case {
        name: "early-return",
        processes: false,
        world: 2,
        victim: 1,
        action: Action::None,
        env: &[],
    },
    Case {
        name: "early-return-await",
        processes: false,
        world: 2,
        victim: 1,
        action: Action::None,
        env: &[],
    },
    Case {
        name: "panic",
        processes: false,
        world: 2,
        victim: 1,
        action: Action::None,
        env: &[],
    },
    // Four ranks, a process each. A failure must reach every rank, not
    // only those that wait on the failed one: in `ring4-*` each rank sends
    // to the next and receives from the one before; in `pairs4-kill`
    // ranks 0 and 1 exchange only with each other, 2 and 3 likewise, and
    // rank 3 dies, so ranks 0 and 1 learn of it only through the store.
    Case {
        name: "ring4-kill-during",
        processes: true,
        world: 4,
        victim: 2,
        action: Action::Kill,
        env: &[],
    },
    Case {
        name: "ring4-stop-during",
        processes: true,
        world: 4,
        victim: 2,
        action: Action::Stop,
        env: &[],
    },
    Case {
        name: "ring4-panic",
        processes: true,
        world: 4,
        victim: 2,
        action: Action::None,
        env: &[],
    },
    Case {
        name: "pairs4-kill",
        processes: true,
        world: 4,
        victim: 3,
        action: Action::Kill,
        env: &[],
    },
];

/// The case of this name.
fn case_named(name: &str) -> Option<&'static Case> {
    CASES.iter().find(|c| c.name == name)
}

fn pattern(src: u32, i: usize) -> u32 {
    (i as u32).wrapping_mul(2_654_435_761) ^ (src << 28) ^ 0x5a5a
}

/// One 256 MiB exchange with the peer, every byte checked.
fn exchange(t: &NcclRank) -> duplex::Result<()> {
    exchange_with(t, 1 - t.rank())
}

/// One 256 MiB exchange with `peer` (this rank itself included) as a group
/// of a send and a recv, every byte checked.
fn exchange_with(t: &NcclRank, peer: u32) -> duplex::Result<()> {
    shift(t, peer, peer)
}

/// Sends 256 MiB to `to` and receives 256 MiB from `from` in one group,
/// every received byte checked.
fn shift(t: &NcclRank, to: u32, from: u32) -> duplex::Result<()> {
    let mut out = t.alloc::<u32>(LEN)?;
    let data: Vec<u32> = (0..LEN).map(|i| pattern(t.rank(), i)).collect();
    t.write(&mut out, &data)?;
    let mut inb = t.alloc::<u32>(LEN)?;
    t.group(|| {
        t.send(&out, to)?;
        t.recv(&mut inb, from)
    })?;
    t.synchronize()?;
    let got = t.read(&inb)?;
    if let Some(i) = (0..LEN).find(|i| got[*i] != pattern(from, *i)) {
        println!("WRONG-DATA at element {i}");
        return Err(Error::User(format!(
            "wrong data from rank {from} at element {i}"
        )));
    }
    Ok(())
}

fn mark() {
    println!("MARK");
    let _ = std::io::stdout().flush();
}

/// The rank code of a case.
fn rank_code(case: &str, t: &NcclRank) -> duplex::Result<()> {
    let me = t.rank();
    let victim = case_named(case).map_or(1, |c| c.victim);
    let n = t.world_size();
    match case {
        "kill-before" => {
            if me == victim {
                mark();
                std::thread::sleep(Duration::from_secs(120));
                Ok(())
            } else {
                std::thread::sleep(Duration::from_secs(1));
                exchange(t)
            }
        }
        "kill-during" | "stop-during" | "stop-resume" | "rank0-killed" => {
            for i in 0.. {
                if me == victim && i == 1 {
                    mark();
                }
                exchange(t)?;
                if i > 200 {
                    break;
                }
            }
            Ok(())
        }
        "kill-after" => {
            exchange(t)?;
            if me == victim {
                mark();
                std::thread::sleep(Duration::from_secs(120));
                Ok(())
            } else {
                // Waits for a message the victim never sends.
                t.await_notify(victim, "never")
            }
        }
        "early-return" => {
            if me == victim {
                Ok(())
            } else {
                exchange(t)
            }
        }
        "early-return-await" => {
            if me == victim {
                Ok(())
            } else {
                // A notify the victim, which returns at once, never sends.
                t.await_notify(victim, "never")
            }
        }
        "panic" => {
            if me == victim {
                panic!("rank {me} panics on purpose");
            }
            exchange(t)
        }
        "ring4-kill-during" | "ring4-stop-during" | "ring4-panic" => {
            for i in 0..200 {
                if me == victim && i == 1 {
                    if case == "ring4-panic" {
                        panic!("rank {me} panics on purpose");
                    }
                    mark();
                }
                shift(t, (me + 1) % n, (me + n - 1) % n)?;
            }
            Ok(())
        }
        "pairs4-kill" => {
            for i in 0..200 {
                if me == victim && i == 1 {
                    mark();
                }
                exchange_with(t, me ^ 1)?;
            }
            Ok(())
        }
        // Setup fails on the victim; the other rank would exchange.
        _ => exchange(t),
    }
}

fn print_result(r: duplex::Result<()>) {
    match r {
        Ok(()) => println!("RANK OK"),
        Err(e) => {
            let text = e.to_string().replace('\n', " | ");
            println!("RANK ERROR {text}");
        }
    }
}

/// With `DUPLEX_LOG=LEVEL` (error, warn, info, debug, trace), the child
/// writes duplex's tracing events to stderr, each with the seconds since
/// its start (the driver's `--logs DIR` keeps them, one file per rank).
fn log_to_stderr() {
    let Ok(level) = std::env::var("DUPLEX_LOG") else {
        return;
    };
    let level = level
        .parse::<tracing::Level>()
        .unwrap_or(tracing::Level::DEBUG);
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_timer(tracing_subscriber::fmt::time::uptime())
        .with_thread_names(true)
        .with_writer(std::io::stderr)
        .init();
}

fn child_rank(case: &str) {
    log_to_stderr();
    let r = Process::from_env().and_then(|p| {
        p.timeout(DEADLINE)
            .warm(true)
            .policy(Policy::PerDirection)
            .run(|t| rank_code(case, t))
            .map(drop)
    });
    print_result(r);
}

fn child_local(case: &str) {
    log_to_stderr();
    let r = Local::new(2).and_then(|l| {
        l.timeout(DEADLINE)
            .warm(true)
            .policy(Policy::PerDirection)
            .run(|t| rank_code(case, t))
            .map(drop)
    });
    print_result(r);
}

/// What one process did.
struct Seen {
    verdict: String,
    /// When its `RANK` line came (from the start of the case).
    verdict_after: Option<Duration>,
    exited_after: Option<Duration>,
    killed_by_driver: bool,
    wrong_data: bool,
}

fn watch(child: &mut Child, rank: u32, tx: mpsc::Sender<(u32, String)>) {
    if let Some(out) = child.stdout.take() {
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send((rank, line));
            }
        });
    }
}

fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill").args([sig, &pid.to_string()]).status();
}

fn run_case(
    exe: &std::path::Path,
    case: &Case,
    logs: Option<&str>,
) -> (String, Vec<Seen>, Option<Instant>) {
    let (tx, rx) = mpsc::channel();
    let mut children: Vec<(u32, Child)> = Vec::new();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(29_517);
    let ranks: Vec<u32> = if case.processes {
        (0..case.world).collect()
    } else {
        vec![0]
    };
    for &rank in &ranks {
        let mut cmd = Command::new(exe);
        if case.processes {
            cmd.args(["rank", case.name])
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", case.world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("DUPLEX_PORT", port.to_string())
                .env("DUPLEX_STORE_TOKEN", format!("duplex-faults-{port}-token"));
            // More ranks than two share GPU 0 on any machine: these cases
            // check behaviour, not speed.
            if duplex_nccl::one_gpu_asked() || case.world > 2 {
                cmd.envs(duplex_nccl::shared_gpu_env(rank, &port.to_string()));
            }
            if rank == case.victim {
                for (k, v) in case.env {
                    cmd.env(k, v);
                }
            }
        } else {
            cmd.args(["local", case.name]);
        }
        let stderr = match logs {
            Some(dir) => {
                let mode = if case.processes { "process" } else { "local" };
                let path = format!("{dir}/{}-{mode}-rank{rank}.log", case.name);
                if std::env::var_os("DUPLEX_LOG").is_none() {
                    cmd.env("DUPLEX_LOG", "debug");
                }
                match std::fs::create_dir_all(dir).and_then(|()| std::fs::File::create(&path)) {
                    Ok(f) => Stdio::from(f),
                    Err(e) => return (format!("cannot write {path}: {e}"), Vec::new(), None),
                }
            }
            None => Stdio::null(),
        };
        let mut child = match cmd.stdout(Stdio::piped()).stderr(stderr).spawn() {
            Ok(c) => c,
            Err(e) => return (format!("cannot start: {e}"), Vec::new(), None),
        };
        watch(&mut child, rank, tx.clone());
        children.push((rank, child));
    }
    drop(tx);
    let start = Instant::now();
    let limit = DEADLINE * 4 + GRACE * 3;
    let mut fault_at: Option<Instant> = None;
    let mut lines: Vec<(u32, String, Duration)> = Vec::new();
    let mut exited: Vec<Option<Duration>> = vec![None; children.len()];
    let mut stopped = false;
    let mut resume: Option<(u32, Instant)> = None;
    while start.elapsed() < limit && exited.iter().any(Option::is_none) {
        if let Some((pid, at)) = resume
            && Instant::now() >= at
        {
            signal(pid, "-CONT");
            resume = None;
        }
        while let Ok((rank, line)) = rx.try_recv() {
            if line == "MARK" && fault_at.is_none() && rank == case.victim {
                let pid = children
                    .iter()
                    .find(|(r, _)| *r == rank)
                    .map(|(_, c)| c.id());
                if let Some(pid) = pid {
                    match case.action {
                        Action::Kill => signal(pid, "-KILL"),
                        Action::Stop => {
                            signal(pid, "-STOP");
                            stopped = true;
                        }
                        Action::StopResume => {
                            signal(pid, "-STOP");
                            resume = Some((pid, Instant::now() + RESUME_AFTER));
                        }
                        Action::None => {}
                    }
                }
                fault_at = Some(Instant::now());
            }
            lines.push((rank, line, start.elapsed()));
        }
        for (i, (rank, c)) in children.iter_mut().enumerate() {
            if exited[i].is_none() && matches!(c.try_wait(), Ok(Some(_))) {
                exited[i] = Some(start.elapsed());
                // Faults that are the victim's own ending start the clock
                // when it ends.
                if *rank == case.victim && case.action == Action::None && fault_at.is_none() {
                    fault_at = Some(Instant::now());
                }
            }
        }
        // A stopped victim is never going to exit by itself: once the
        // others have, it is the driver's to end.
        if stopped
            && children
                .iter()
                .zip(&exited)
                .all(|((r, _), e)| *r == case.victim || e.is_some())
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(100));
    while let Ok((rank, line)) = rx.try_recv() {
        lines.push((rank, line, start.elapsed()));
    }
    let mut seen = Vec::new();
    for (i, (rank, mut c)) in children.into_iter().enumerate() {
        let killed_by_driver = exited[i].is_none();
        if killed_by_driver {
            signal(c.id(), "-KILL");
        }
        let _ = c.wait();
        let said = lines
            .iter()
            .filter(|(r, _, _)| *r == rank)
            .find_map(|(_, l, t)| l.strip_prefix("RANK ").map(|v| (v.to_string(), *t)));
        let wrong_data = lines
            .iter()
            .any(|(r, l, _)| *r == rank && l.starts_with("WRONG-DATA"));
        seen.push(Seen {
            verdict: said
                .as_ref()
                .map_or_else(|| "(nothing)".into(), |(v, _)| v.clone()),
            verdict_after: said.map(|(_, t)| t),
            exited_after: exited[i],
            killed_by_driver,
            wrong_data,
        });
    }
    (
        String::new(),
        seen,
        fault_at.map(|f| f.max(start)).or(Some(start)),
    )
}

/// The first rank a verdict names as a cause, `rank N failed`, `rank N
/// panicked` or `rank N finished`, with the word.
fn first_cause(verdict: &str) -> Option<(u32, &'static str)> {
    let mut rest = verdict;
    while let Some(i) = rest.find("rank ") {
        rest = &rest[i + "rank ".len()..];
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        let Ok(rank) = rest[..digits].parse::<u32>() else {
            continue;
        };
        for word in ["failed", "panicked", "finished"] {
            if rest[digits..].starts_with(&format!(" {word}")) {
                return Some((rank, word));
            }
        }
    }
    None
}

/// Judges a case: every survivor ended by itself, with an error naming the
/// failed rank, within deadline + grace of the fault; no wrong data.
fn judge(case: &Case, seen: &[Seen], start_to_fault: Duration) -> (bool, String) {
    let mut notes = Vec::new();
    let mut pass = true;
    for (i, s) in seen.iter().enumerate() {
        let rank = if case.processes { i as u32 } else { 0 };
        if s.wrong_data {
            pass = false;
            notes.push(format!("rank {rank} saw wrong data"));
        }
        // A victim resumed after the others took it for dead must end by
        // itself as well, with an error (it learns that the job took it
        // for dead, or that the store's host is gone), within deadline +
        // grace of its resumption.
        if case.processes && rank == case.victim && case.action == Action::StopResume {
            let ended = s
                .exited_after
                .map(|t| t.saturating_sub(start_to_fault + RESUME_AFTER));
            if s.killed_by_driver || ended.is_none_or(|t| t > DEADLINE + GRACE) {
                pass = false;
                notes.push(format!(
                    "rank {rank}, resumed, did not end by itself within deadline + grace"
                ));
            } else if !s.verdict.starts_with("ERROR")
                || !matches!(first_cause(&s.verdict), Some((_, "failed")))
            {
                pass = false;
                notes.push(format!(
                    "rank {rank}, resumed, did not end with an error naming a failed rank"
                ));
            }
            continue;
        }
        let survivor = !case.processes || rank != case.victim;
        if !survivor {
            continue;
        }
        if s.killed_by_driver {
            pass = false;
            notes.push(format!(
                "rank {rank} was left running and killed by the driver"
            ));
            continue;
        }
        if let Some(t) = s.exited_after
            && t.saturating_sub(start_to_fault) > DEADLINE + GRACE
        {
            pass = false;
            notes.push(format!(
                "rank {rank} ended {:.1} s after the fault (more than deadline + grace)",
                t.saturating_sub(start_to_fault).as_secs_f64()
            ));
        }
        // Named as the cause, and the right one, not merely mentioned (an
        // op "to rank 1" is no naming, nor a chain whose first cause is
        // another rank's echo: "rank 3 failed: ... because rank 2 failed"):
        // a rank that returned early finished; any other victim failed.
        let v = case.victim;
        let named = first_cause(&s.verdict);
        let names = if case.name.starts_with("early-return") {
            named == Some((v, "finished"))
        } else {
            matches!(named, Some((r, "failed" | "panicked")) if r == v)
        };
        if !s.verdict.starts_with("ERROR") || !names {
            pass = false;
            notes.push(format!(
                "rank {rank} did not end with an error naming rank {}",
                case.victim
            ));
        }
        // A partner that returned early leaves an op that can never be
        // matched: the wait for it ends once that is known (the survivor
        // says the op is never matched), before its deadline (which
        // begins after the case's start), not at it. With lanes made at
        // start NCCL may report the partner's closed socket first, which
        // ends the wait early too. A notify awaited has no NCCL path: the
        // survivor must say the await can never return.
        let early = match case.name {
            "early-return" => {
                s.verdict.contains("is never matched")
                    || s.verdict_after.is_some_and(|t| t < DEADLINE)
            }
            "early-return-await" => s.verdict.contains("can never return"),
            _ => true,
        };
        if !early {
            pass = false;
            notes.push(format!(
                "rank {rank} waited for its deadline, though its partner had finished without matching its op"
            ));
        }
    }
    (pass, notes.join("; "))
}

fn drive(out: Option<&str>, only: Option<&str>, logs: Option<&str>) {
    let exe = std::env::current_exe().expect("this binary");
    let mut table = String::from(
        "| case | mode | fault after (s) | rank 0 | rank 1 | ranks 2, 3 | result |\n|---|---|---|---|---|---|---|\n",
    );
    let (mut failed, mut ran, mut skipped) = (0, 0, 0);
    for case in CASES.iter().filter(|c| only.is_none_or(|o| o == c.name)) {
        if duplex_nccl::one_gpu_asked() && !case.processes {
            // A thread per rank needs a GPU per rank.
            skipped += 1;
            continue;
        }
        ran += 1;
        let mode = match (case.processes, case.world) {
            (false, _) => "local".to_string(),
            (true, 2) => "2 processes".to_string(),
            (true, n) => format!("{n} processes, GPU 0"),
        };
        eprintln!("== {} ({mode})", case.name);
        let started = Instant::now();
        let (err, seen, fault_at) = run_case(&exe, case, logs);
        let to_fault = fault_at.map_or(Duration::ZERO, |f| f.saturating_duration_since(started));
        let (pass, notes) = if err.is_empty() {
            judge(case, &seen, to_fault)
        } else {
            (false, err)
        };
        failed += usize::from(!pass);
        let cell = |i: usize| {
            seen.get(i).map_or("-".to_string(), |s| {
                let t = s
                    .exited_after
                    .map_or("killed".into(), |t| format!("{:.1} s", t.as_secs_f64()));
                let v: String = s.verdict.chars().take(160).collect();
                format!("{t}: {}", v.replace('|', "/"))
            })
        };
        let rest = (2..seen.len()).map(cell).collect::<Vec<_>>().join("; ");
        let row = format!(
            "| {} | {mode} | {:.1} | {} | {} | {} | {}{} |\n",
            case.name,
            to_fault.as_secs_f64(),
            cell(0),
            cell(1),
            if rest.is_empty() { "-" } else { &rest },
            if pass { "PASS" } else { "FAIL" },
            if notes.is_empty() {
                String::new()
            } else {
                format!(": {notes}")
            }
        );
        eprint!("{row}");
        // The whole of each verdict, which the table cuts, and when it
        // came against when the process ended.
        for (i, s) in seen.iter().enumerate() {
            let at =
                |t: Option<Duration>| t.map_or("-".into(), |t| format!("{:.2} s", t.as_secs_f64()));
            eprintln!(
                "   rank {i}: said at {}, ended at {}: {}",
                at(s.verdict_after),
                at(s.exited_after),
                s.verdict
            );
        }
        table.push_str(&row);
    }
    let mut summary = format!(
        "\n{} of {ran} cases passed (deadline {DEADLINE:?}, grace {GRACE:?}).\n",
        ran - failed,
    );
    if skipped > 0 {
        summary.push_str(&format!(
            "DUPLEX_ONE_GPU=1: every rank of each process case on GPU 0, over loopback sockets (behaviour, not speed); the {skipped} local cases need two GPUs and did not run.\n"
        ));
    }
    summary.push_str("The 4-rank cases always put every rank on GPU 0, over loopback sockets.\n");
    table.push_str(&summary);
    match out {
        Some(path) => {
            if let Err(e) = std::fs::write(path, &table) {
                eprintln!("cannot write {path}: {e}");
            }
        }
        None => print!("{table}"),
    }
    eprint!("{summary}");
    if failed > 0 {
        std::process::exit(1);
    }
}

/// One rank exchanging 256 MiB with itself (a group of a send and a recv to
/// its own rank), every byte checked.
fn self_exchange(t: &NcclRank) -> duplex::Result<()> {
    exchange_with(t, t.rank())
}

/// What one GPU can check of the machinery: a local and a process run of
/// one rank (NCCL, CUDA, the store, the health monitor, the trace), R12
/// ([`self_pairing`]), and a hang's report through the process path.
fn smoke() {
    let t0 = Instant::now();
    let local = Local::new(1).and_then(|l| l.timeout(DEADLINE).run(self_exchange).map(drop));
    println!(
        "local, 1 rank, 256 MiB to itself: {local:?} ({:.2} s)",
        t0.elapsed().as_secs_f64()
    );
    one_rank_env();
    let t0 = Instant::now();
    let p = Process::from_env();
    let r = p
        .as_ref()
        .map_err(Clone::clone)
        .and_then(|p| p.clone().timeout(DEADLINE).run(self_exchange).map(drop));
    println!(
        "process, 1 rank, 256 MiB to itself: {r:?} ({:.2} s)",
        t0.elapsed().as_secs_f64()
    );
    let t0 = Instant::now();
    let verdict = std::sync::Mutex::new(String::from("FAIL the rank did not finish"));
    let run = Local::new(1).and_then(|l| {
        l.timeout(DEADLINE)
            .run(|t| {
                let v = self_pairing(t)?;
                *verdict.lock().unwrap_or_else(|e| e.into_inner()) = v;
                Ok(())
            })
            .map(drop)
    });
    println!(
        "local, 1 rank, messages to itself (R12): {} ({run:?}, {:.2} s)",
        verdict.into_inner().unwrap_or_else(|e| e.into_inner()),
        t0.elapsed().as_secs_f64()
    );
    let t0 = Instant::now();
    println!(
        "local, 1 rank, a stream, event, buffer and thread kept from another run: {} ({:.2} s)",
        kept_from_another_run(),
        t0.elapsed().as_secs_f64()
    );
    // A hang through the process path: in a process of its own, since
    // `Process::run` runs once per process.
    let exe = std::env::current_exe().expect("this binary");
    match Command::new(exe).arg("smoke-hang").output() {
        Ok(o) => print!("{}", String::from_utf8_lossy(&o.stdout)),
        Err(e) => println!("process hang: cannot start the child: {e}"),
    }
}

/// Objects a run made, kept (here in a static) and used by a later run:
/// each is refused as made by another run, where its number could name
/// one of the later run's (the simulator refuses them alike). PASS when
/// every use is refused and the later run goes on.
fn kept_from_another_run() -> String {
    use duplex_nccl::{NcclBuffer, NcclEvent, NcclStream, NcclThread};
    type Kept = (NcclStream, NcclEvent, NcclBuffer<u8>, NcclThread);
    static KEPT: std::sync::Mutex<Option<Kept>> = std::sync::Mutex::new(None);
    let first = Local::new(1).and_then(|l| {
        l.timeout(DEADLINE)
            .run(|t| {
                let kept = (
                    t.stream("a")?,
                    t.event()?,
                    t.alloc::<u8>(16)?,
                    t.spawn("helper", |_: &NcclRank| Ok(()))?,
                );
                *KEPT.lock().unwrap_or_else(|e| e.into_inner()) = Some(kept);
                Ok(())
            })
            .map(drop)
    });
    if let Err(e) = first {
        return format!("FAIL the first run: {e}");
    }
    let verdict = std::sync::Mutex::new(String::from("FAIL the rank did not finish"));
    let second = Local::new(1).and_then(|l| {
        l.timeout(DEADLINE)
            .run(|t| {
                let Some((s, e, mut b, th)) = KEPT.lock().unwrap_or_else(|e| e.into_inner()).take()
                else {
                    return Err(Error::User("nothing kept".into()));
                };
                // This run's own, numbered as the kept ones were.
                let mine = t.stream("a")?;
                let _event = t.event()?;
                let uses = [
                    ("sync_stream", t.sync_stream(&s)),
                    ("record", t.record(&e, &mine)),
                    ("wait", t.wait(&e, &mine)),
                    ("with_stream", t.with_stream(&s, || Ok(()))),
                    ("write", t.write(&mut b, &[1; 16])),
                    ("read", t.read(&b).map(drop)),
                    ("send", t.group(|| t.send(&b, 0))),
                    ("join", t.join(th)),
                ];
                let wrong: Vec<String> = uses
                    .into_iter()
                    .filter(|(_, r)| {
                        !matches!(r, Err(e @ Error::Invalid { .. }) if e.to_string().contains("another run"))
                    })
                    .map(|(what, r)| format!("{what}: {r:?}"))
                    .collect();
                t.sync_stream(&mine)?;
                *verdict.lock().unwrap_or_else(|e| e.into_inner()) = if wrong.is_empty() {
                    "PASS (each refused as made by another run; the run went on)".into()
                } else {
                    format!("FAIL not refused: {}", wrong.join("; "))
                };
                Ok(())
            })
            .map(drop)
    });
    let v = verdict.into_inner().unwrap_or_else(|e| e.into_inner());
    match second {
        Ok(()) => v,
        Err(e) => format!("{v} (the second run: {e})"),
    }
}

/// One rank, on one GPU: R12. A recv of the rank from itself issued alone
/// is refused by duplex before NCCL sees it (NCCL itself refuses it at the
/// group's end with `ncclInvalidUsage`, "Trying to recv to self without a
/// matching send", and leaves the communicator in error); in one group
/// with its send it delivers every byte.
fn self_pairing(t: &NcclRank) -> duplex::Result<String> {
    let mut inb = t.alloc::<u32>(1 << 20)?;
    let alone = t.recv(&mut inb, t.rank());
    // A group of two messages to itself whose second pair differs in size
    // (R3): refused before NCCL sees it, naming the op at fault by its
    // own line, not only the group's.
    let (a, b) = (t.alloc::<u32>(16)?, t.alloc::<u32>(16)?);
    let (mut c, mut d) = (t.alloc::<u32>(16)?, t.alloc::<u32>(8)?);
    let line = std::sync::OnceLock::new();
    let mismatched = t.group(|| {
        t.send(&a, t.rank())?;
        line.get_or_init(|| std::panic::Location::caller().line() + 1);
        t.send(&b, t.rank())?;
        t.recv(&mut c, t.rank())?;
        t.recv(&mut d, t.rank())
    });
    // The second send, or the recv it meets two lines below.
    let send = line.get().copied().unwrap_or(0);
    let own = [send, send + 2].map(|l| format!("faults.rs:{l}:"));
    match mismatched {
        Err(Error::Program { message, .. })
            if own
                .iter()
                .any(|o| message.contains(&format!("at backend-nccl/examples/{o}"))) => {}
        other => {
            return Ok(format!(
                "FAIL a size mismatch in a group did not name the op's line ({own:?}): {other:?}"
            ));
        }
    }
    let grouped = self_exchange(t);
    Ok(match (alone, grouped) {
        (Ok(()), _) => "FAIL a recv from itself alone was accepted".into(),
        (Err(Error::Invalid { message, .. }), Ok(())) if message.contains("R12") => {
            format!(
                "PASS (refused: {message}; a size mismatch in a group named the op's own line; grouped: every byte arrived)"
            )
        }
        (Err(Error::Invalid { message, .. }), Err(e)) if message.contains("R12") => {
            format!("FAIL the grouped message: {e}")
        }
        (Err(e), _) => format!("FAIL a recv from itself alone failed, but not by R12: {e}"),
    })
}

/// Configures this process as the only rank of a job, as torchrun would,
/// on a free port. Call it while the process has one thread.
fn one_rank_env() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(29_518);
    for (k, v) in [
        ("RANK", "0".to_string()),
        ("LOCAL_RANK", "0".to_string()),
        ("WORLD_SIZE", "1".to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
        ("DUPLEX_PORT", port.to_string()),
        ("DUPLEX_STORE_TOKEN", format!("duplex-smoke-token-{port}")),
    ] {
        // SAFETY: no other thread reads the environment yet.
        unsafe { std::env::set_var(k, v) };
    }
}

/// The process path's hang report, one rank: `faults smoke-hang`.
fn smoke_hang() {
    one_rank_env();
    let t0 = Instant::now();
    let r = Process::from_env().and_then(|p| {
        p.timeout(Duration::from_secs(2))
            .run(|t| t.await_notify(0, "never"))
            .map(drop)
    });
    match r {
        Err(Error::Hang(h)) => println!(
            "process hang, reported in {:.2} s:\n{h}",
            t0.elapsed().as_secs_f64()
        ),
        other => println!("process hang: expected a hang, got {other:?}"),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .map(String::as_str)
    };
    match args.first().map(String::as_str) {
        Some("rank") => child_rank(args.get(1).map_or("", String::as_str)),
        Some("local") => child_local(args.get(1).map_or("", String::as_str)),
        Some("drive") => drive(arg("--out"), arg("--only"), arg("--logs")),
        Some("smoke") => smoke(),
        Some("smoke-hang") => smoke_hang(),
        _ => {
            eprintln!(
                "usage: faults drive [--out FILE] [--only CASE] [--logs DIR] | faults rank CASE | faults local CASE"
            );
            std::process::exit(2);
        }
    }
}
