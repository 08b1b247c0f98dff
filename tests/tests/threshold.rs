//! The copy-lane threshold's measurement (`duplex_nccl::threshold`) on the
//! simulator: its ops pair up and complete under every schedule tried,
//! each path delivers every byte of its check, and every figure gets a
//! sample of both ranks. Its times mean nothing here; on GPUs,
//! `Local::measure_copy_from` runs the same procedure.

use std::sync::Mutex;

use duplex::{Policy, Size};
use duplex_nccl::threshold::{Measurement, Plan, measure};
use duplex_sim::Sim;

fn plan() -> Plan {
    Plan {
        sizes: vec![1 << 10, 4 << 10],
        trials: 2,
        bytes_per_timing: 8 << 10,
    }
}

#[test]
fn the_measurement_completes_and_summarizes_on_three_ranks() {
    let plan = plan();
    for seed in 0..4 {
        let samples = Mutex::new(Vec::new());
        let run = Sim::new(3)
            .policy(Policy::PerDirection)
            .copy_from(Some(Size(1 << 10)))
            .run(seed, |t| {
                let mine = measure(t, &plan)?;
                // Only ranks 0 and 1 time anything.
                assert_eq!(mine.is_empty(), duplex::Transport::rank(t) == 2);
                samples.lock().unwrap().extend(mine);
                Ok(())
            })
            .unwrap_or_else(|f| panic!("seed {seed}: {f}"));
        // Each size went both on NCCL lanes and on copy-engine lanes.
        let mut carried = std::collections::BTreeSet::new();
        for c in &run.trace.calls {
            if let duplex::trace::Call::Launch { ops, .. } = &c.call {
                for o in ops.iter() {
                    carried.insert((o.bytes, run.trace.comms[o.comm as usize].copy));
                }
            }
        }
        let want: std::collections::BTreeSet<_> = [1 << 10, 4 << 10]
            .into_iter()
            .flat_map(|b| [(b, false), (b, true)])
            .collect();
        assert_eq!(carried, want, "seed {seed}");
        let samples = samples.into_inner().unwrap();
        // Two ranks x two sizes x two paths x two directions x two trials.
        assert_eq!(samples.len(), 32);
        let m = Measurement::new(&plan, &samples).expect("every figure sampled");
        assert_eq!(m.sizes.len(), 2);
        assert!(
            m.sizes.iter().all(|s| [
                s.nccl_one_way,
                s.copy_one_way,
                s.nccl_both_ways,
                s.copy_both_ways
            ]
            .iter()
            .all(|&x| x.is_finite() && x > 0.0)),
            "{m:?}"
        );
        assert!(m.to_string().contains("copy_from"), "{m}");
    }
}

/// Where only one NCCL kernel runs at a time (R10), two ranks that both
/// send first on NCCL lanes hang; the measurement must not, under that model
/// or with eager buffering (R5).
#[test]
fn the_measurement_completes_under_one_kernel_and_under_eager_buffering() {
    let plan = plan();
    for (name, model) in [
        (
            "kernels=1",
            duplex::Model {
                kernels: Some(1),
                ..duplex::Model::default()
            },
        ),
        (
            "eager=64MiB",
            duplex::Model {
                eager: Size(64 << 20),
                ..duplex::Model::default()
            },
        ),
    ] {
        for seed in 0..4 {
            Sim::new(2)
                .policy(Policy::PerDirection)
                .copy_from(Some(Size(1 << 10)))
                .model(model)
                .run(seed, |t| measure(t, &plan).map(drop))
                .unwrap_or_else(|f| panic!("{name}, seed {seed}: {f}"));
        }
    }
}

#[test]
fn a_transport_without_copy_lanes_for_every_size_is_refused() {
    let plan = plan();
    for copy_from in [None, Some(Size(2 << 10))] {
        let f = Sim::new(2)
            .policy(Policy::PerDirection)
            .copy_from(copy_from)
            .run(0, |t| measure(t, &plan).map(drop))
            .expect_err("refused");
        assert!(f.to_string().contains("needs per-direction lanes"), "{f}");
    }
    let f = Sim::new(2)
        .copy_from(Some(Size(1 << 10)))
        .run(0, |t| measure(t, &plan).map(drop))
        .expect_err("shared lanes are refused");
    assert!(f.to_string().contains("policy shared"), "{f}");
}
