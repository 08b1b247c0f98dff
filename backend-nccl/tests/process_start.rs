//! A process-per-rank job whose ranks cannot all start, on a machine
//! without NCCL or GPUs (CPU-only CI): the failure reaches every rank
//! through the store, named, within a bounded time, instead of leaving a
//! rank waiting for a peer that will never come (issue 9, item 2).
//!
//! Each rank is this test binary run again as a child (`child_rank`, an
//! ignored test), configured as torchrun would configure it.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const TIMEOUT_MS: u64 = 2000;

/// In a child: one rank of the job; prints `RESULT ...`.
#[test]
#[ignore = "a child of the tests below"]
fn child_rank() {
    if std::env::var_os("DUPLEX_TEST_CHILD").is_none() {
        return;
    }
    // DUPLEX_TEST_COPY: the job asks for copy-engine lanes across
    // processes.
    let copy = std::env::var_os("DUPLEX_TEST_COPY").map(|_| duplex::Size(1 << 20));
    let r = duplex_nccl::Process::from_env().and_then(|p| {
        p.timeout(Duration::from_millis(TIMEOUT_MS))
            .policy(duplex::Policy::PerDirection)
            .copy_from(copy)
            .run(|_| Ok(()))
            .map(drop)
    });
    match r {
        Ok(()) => println!("RESULT OK"),
        Err(e) => println!("RESULT ERROR {}", e.to_string().replace('\n', " | ")),
    }
}

/// Runs a two-rank job (each rank's extra environment given), and returns
/// what each rank printed and how long the job took.
fn job(envs: [&[(&str, &str)]; 2]) -> (Vec<String>, Duration) {
    let exe = std::env::current_exe().expect("the test binary");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let start = Instant::now();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            let mut cmd = Command::new(&exe);
            cmd.args(["--exact", "child_rank", "--ignored", "--nocapture"])
                .env("DUPLEX_TEST_CHILD", "1")
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("DUPLEX_PORT", port.to_string())
                .env("DUPLEX_STORE_TOKEN", format!("duplex-start-test-{port}"))
                .env_remove("DUPLEX_IPC_COPY")
                .stdout(Stdio::piped())
                .stderr(Stdio::null());
            for (k, v) in envs[rank] {
                cmd.env(k, v);
            }
            cmd.spawn().expect("a child rank")
        })
        .collect();
    let said = children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().expect("the child's output");
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .find_map(|l| l.strip_prefix("RESULT ").map(str::to_string))
                .unwrap_or_else(|| "(nothing)".into())
        })
        .collect();
    (said, start.elapsed())
}

fn without_nccl() -> bool {
    duplex_nccl::Local::new(2).is_err()
}

/// Deadline, the health monitor's silence, and slack for two processes'
/// start on a loaded machine: far below "waits for ever".
const BOUND: Duration = Duration::from_secs(20);

#[test]
fn a_rank_whose_nccl_is_missing_is_named_by_the_others() {
    if !without_nccl() {
        return; // NCCL and GPUs here: the GPU fault matrix covers this.
    }
    let (said, took) = job([&[], &[]]);
    assert!(said[0].starts_with("ERROR"), "rank 0: {}", said[0]);
    assert!(
        said[0].contains("not available"),
        "rank 0 says what is missing: {}",
        said[0]
    );
    assert!(
        said[1].starts_with("ERROR")
            && said[1].contains("rank 0 cannot start")
            && said[1].contains("not available"),
        "rank 1 names rank 0 and why: {}",
        said[1]
    );
    assert!(took < BOUND, "the job took {took:?}");
}

#[test]
fn a_wrong_world_size_is_named_on_the_rank_that_has_it() {
    if !without_nccl() {
        return;
    }
    let (said, took) = job([&[], &[("WORLD_SIZE", "3")]]);
    assert!(
        said[1].starts_with("ERROR")
            && said[1].contains("WORLD_SIZE=3")
            && said[1].contains("rank 0 has WORLD_SIZE=2"),
        "rank 1: {}",
        said[1]
    );
    assert!(said[0].starts_with("ERROR"), "rank 0: {}", said[0]);
    assert!(took < BOUND, "the job took {took:?}");
}

/// Copy-engine lanes across processes are experimental: without
/// `DUPLEX_IPC_COPY=1` every rank refuses them at once, saying why and how
/// to use them anyway, whether or not NCCL is here.
#[test]
fn copy_lanes_across_processes_are_refused_unless_asked_for() {
    let (said, took) = job([&[("DUPLEX_TEST_COPY", "1")], &[("DUPLEX_TEST_COPY", "1")]]);
    for (rank, s) in said.iter().enumerate() {
        assert!(
            s.starts_with("ERROR") && s.contains("experimental") && s.contains("DUPLEX_IPC_COPY=1"),
            "rank {rank}: {s}"
        );
    }
    assert!(took < BOUND, "the job took {took:?}");
}
