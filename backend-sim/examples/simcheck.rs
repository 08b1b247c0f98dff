//! A schedule file's threads run as rank code (`duplex::schedule::execute`)
//! under `Sim::check`, with and without the reduction, beside the schedule
//! checker's verdict on the same file: for cross-checking the search of
//! rank code against the checker on one program (a property test's case,
//! a file that disagrees).
//!
//! `cargo run --release -p duplex-sim --example simcheck -- FILE...`

use std::sync::Arc;
use std::time::Instant;

use duplex_sim::{Failure, Sim};

fn verdict(r: &Result<duplex_sim::Run, Failure>) -> String {
    match r {
        Ok(run) => format!("ok ({} executions, {} states)", run.executions, run.states),
        Err(Failure::Hang(h)) => {
            format!("deadlock: {}", h.to_string().lines().next().unwrap_or(""))
        }
        Err(Failure::Program { .. }) => "error".into(),
        Err(other) => format!("another failure: {other}"),
    }
}

fn main() {
    let mut status = 0;
    for path in std::env::args().skip(1) {
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("{path}: {e}");
                std::process::exit(2);
            }
        };
        let program = match duplex::schedule::parse(&text) {
            Ok(p) => Arc::new(p),
            Err(e) => {
                eprintln!("{path}: {e}");
                std::process::exit(2);
            }
        };
        let checker = duplex_sim::check::check(
            &duplex::compile::compile(&program),
            &duplex_sim::check::Options::default(),
        )
        .verdict
        .kind();
        println!("{path}");
        println!("  checker  : {checker}");
        for reduce in [true, false] {
            let mut sim = Sim::new(program.ranks)
                .policy(program.policy)
                .copy_from(program.copy_from)
                .model(program.model)
                .max_executions(2_000_000);
            if !reduce {
                sim = sim.without_reduction();
            }
            let start = Instant::now();
            let p = program.clone();
            let r = sim.check(move |t| duplex::schedule::execute(&p, t));
            let name = if reduce { "sim" } else { "sim full" };
            println!(
                "  {name:9}: {} in {:.3} s",
                verdict(&r),
                start.elapsed().as_secs_f64()
            );
            if let Err(f) = &r {
                println!("             schedule {}", f.schedule().unwrap_or("-"));
                if std::env::var("FULL_REPORT").is_ok() {
                    println!("{f}");
                }
            }
            let ok = r.is_ok();
            if ok != (checker == "ok") {
                status = 1;
            }
        }
    }
    std::process::exit(status);
}
