//! The conformance suite on real GPUs. Runs when `DUPLEX_NCCL=1`; otherwise
//! every scenario is reported as skipped, with the reason, never as passed.
//!
//! Each scenario runs in a child process (this test binary again, with
//! `DUPLEX_SCENARIO` set): a sticky CUDA error, which NCCL can cause (seen:
//! "illegal memory access" on cold channels with large messages, as PyTorch
//! hits it), then fails that scenario alone. Communicators are connected at
//! creation (`Local::warm`); cold communicators are exercised by the
//! calibration's examples, each in its own process too.

use std::process::Command;
use std::time::{Duration, Instant};

use duplex::Error;
use duplex_nccl::{Local, NcclRank};
use duplex_tests::{Expect, Outcome, scenarios, verify};

fn outcome(result: duplex::Result<Vec<duplex_nccl::RankReport>>) -> Outcome {
    match result {
        Ok(_) => Outcome::Completed,
        Err(Error::Hang(h)) => Outcome::Hang(h),
        Err(e) => Outcome::Failed(e),
    }
}

fn timeout() -> Duration {
    Duration::from_millis(
        std::env::var("DUPLEX_TIMEOUT_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(3000),
    )
}

fn local(ranks: u32) -> Local {
    Local::new(ranks)
        .expect("NCCL and GPUs are available")
        .timeout(timeout())
        .warm(true)
}

/// In a child: runs one scenario (or the reuse check) and prints its verdict.
fn child(name: &str) {
    // 128 MiB messages: above the eager capacity measured on the H200s
    // (64 MiB <= C < 96 MiB), so that what hangs under NCCL's contract hangs.
    duplex_tests::set_len(32 << 20);
    if name == "reuse-after-hang" {
        // After a hang (the communicators involved aborted), the process
        // makes new lanes and completes a run.
        let hang = local(2)
            .policy(duplex::Policy::Shared)
            .run(duplex_tests::seed::<NcclRank>);
        let again = local(2)
            .policy(duplex::Policy::PerDirection)
            .run(duplex_tests::seed::<NcclRank>);
        match (hang, again) {
            (Err(Error::Hang(_)), Ok(_)) => println!("RESULT PASS"),
            (h, a) => println!(
                "RESULT FAIL the first run should hang and the second complete: {:?} / {:?}",
                h.err(),
                a.err()
            ),
        }
        return;
    }
    let Some(s) = scenarios::<NcclRank>().into_iter().find(|s| s.name == name) else {
        println!("RESULT FAIL no scenario {name}");
        return;
    };
    let start = Instant::now();
    let o = outcome(local(s.ranks.min(2)).policy(s.policy).run(s.run));
    let elapsed = start.elapsed();
    if let Outcome::Hang(h) = &o {
        eprintln!("{h}");
    }
    if let Outcome::Failed(e) = &o {
        eprintln!("  {e}");
    }
    match verify(&s, &o, false) {
        Ok(())
            if matches!(s.expect, Expect::Hangs | Expect::MayHang)
                && elapsed > timeout() * 4 + Duration::from_secs(10) =>
        {
            println!("RESULT FAIL the hang took {elapsed:?}");
        }
        Ok(()) => println!("RESULT PASS {:.2}", elapsed.as_secs_f64()),
        Err(e) => println!("RESULT FAIL {e}"),
    }
}

#[test]
fn every_scenario_on_nccl() {
    if let Ok(name) = std::env::var("DUPLEX_SCENARIO") {
        child(&name);
        return;
    }
    if std::env::var("DUPLEX_NCCL").as_deref() != Ok("1") {
        for s in scenarios::<NcclRank>() {
            eprintln!(
                "SKIPPED {:<24} (set DUPLEX_NCCL=1 on a machine with 2 GPUs and NCCL to run it)",
                s.name
            );
        }
        return;
    }
    let exe = std::env::current_exe().expect("the test binary");
    let mut names: Vec<String> = scenarios::<NcclRank>()
        .into_iter()
        .map(|s| s.name.to_string())
        .collect();
    names.push("reuse-after-hang".into());
    let mut failures = Vec::new();
    for name in &names {
        let start = Instant::now();
        let out = Command::new(&exe)
            .args([
                "--exact",
                "every_scenario_on_nccl",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("DUPLEX_SCENARIO", name)
            .output()
            .expect("the test binary runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        // libtest prints "test ... " without a newline before the child's
        // own output, so the verdict may start mid-line.
        let verdict = stdout
            .lines()
            .find_map(|l| l.split_once("RESULT ").map(|(_, v)| v))
            .unwrap_or("FAIL the child printed no result");
        eprintln!(
            "{:<7} {name:<24} {:.2} s {}",
            if verdict.starts_with("PASS") {
                "PASS"
            } else {
                "FAIL"
            },
            start.elapsed().as_secs_f64(),
            verdict.trim_start_matches("PASS")
        );
        let report: String = stderr
            .lines()
            .filter(|l| !l.contains("NCCL WARN") && !l.trim().is_empty())
            .take(40)
            .collect::<Vec<_>>()
            .join("\n");
        if !report.is_empty() {
            eprintln!("{report}");
        }
        if !verdict.starts_with("PASS") {
            failures.push(format!("{name}: {verdict}"));
        }
    }
    eprintln!(
        "ran {} scenarios on NCCL, each in its own process",
        names.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
