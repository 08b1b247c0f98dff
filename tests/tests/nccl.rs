//! The conformance suite on real GPUs. Runs when `DUPLEX_NCCL=1`; otherwise
//! every scenario is reported as skipped, with the reason, never as passed.

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

#[test]
fn every_scenario_on_nccl() {
    let gpus = match std::env::var("DUPLEX_NCCL").as_deref() {
        Ok("1") => 2,
        _ => {
            for s in scenarios::<NcclRank>() {
                eprintln!(
                    "SKIPPED {:<24} (set DUPLEX_NCCL=1 on a machine with 2 GPUs and NCCL to run it)",
                    s.name
                );
            }
            return;
        }
    };
    let timeout = Duration::from_millis(
        std::env::var("DUPLEX_TIMEOUT_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(3000),
    );
    // 128 MiB messages: above the eager capacity measured on the H200s
    // (64 MiB <= C < 96 MiB), so that what hangs under NCCL's contract hangs.
    duplex_tests::set_len(32 << 20);
    let mut failures = Vec::new();
    let mut ran = 0;
    for s in scenarios::<NcclRank>() {
        if s.ranks > gpus {
            // Scenarios written for more ranks run on the GPUs there are,
            // when they make sense with 2.
            if s.name.starts_with("ring")
                || s.name.starts_with("all-to-all")
                || s.name.starts_with("1f1b")
            {
            } else {
                eprintln!("SKIPPED {:<24} (needs {} GPUs)", s.name, s.ranks);
                continue;
            }
        }
        let ranks = s.ranks.min(gpus);
        let start = Instant::now();
        let local = Local::new(ranks)
            .expect("NCCL and GPUs are available")
            .policy(s.policy)
            .timeout(timeout);
        let o = outcome(local.run(s.run));
        let elapsed = start.elapsed();
        let verdict = verify(&s, &o, false);
        eprintln!(
            "{} {:<24} expected {:?}, took {:.2} s{}",
            if verdict.is_ok() {
                "PASS   "
            } else {
                "FAIL   "
            },
            s.name,
            s.expect,
            elapsed.as_secs_f64(),
            match &o {
                Outcome::Hang(h) => format!("\n{h}"),
                Outcome::Failed(e) => format!("\n  {e}"),
                _ => String::new(),
            }
        );
        if matches!(s.expect, Expect::Hangs | Expect::MayHang) {
            assert!(
                elapsed < timeout * 4 + Duration::from_secs(10),
                "{}: the hang took {elapsed:?}",
                s.name
            );
        }
        if let Err(e) = verdict {
            failures.push(e);
        }
        ran += 1;
    }
    // After every hang above, the process is still usable: new lanes work.
    let again = Local::new(2)
        .expect("still usable")
        .run(duplex_tests::seed::<NcclRank>);
    assert!(again.is_ok(), "a run after the hangs failed: {again:?}");
    eprintln!("ran {ran} scenarios on NCCL");
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
