//! Where copy-engine lanes start to pay: the message size from which a
//! transport puts policy-placed ops on copy-engine lanes instead of NCCL
//! lanes (`copy_from`, C1 of `docs/semantics.md`), measured rather than
//! guessed.
//!
//! A copy-engine lane costs more host work per message than an NCCL lane
//! (about nine driver calls), and moves large messages faster, with no SMs
//! (`BENCHMARKS.md`). Where the two cross depends on the GPUs, their links
//! and the driver, so [`measure`] times both kinds of lane, on ranks 0 and
//! 1 of a running transport, at each size of a [`Plan`]: the host time per
//! message of back-to-back messages (a throughput, not one message's
//! latency), one way and both ways at once, the two kinds of lane in
//! alternating order, after a pass that checks every byte each path
//! delivered. [`Measurement::new`]
//! takes the median of the trials and [`choose`] picks the threshold.
//!
//! [`measure`] is generic over [`Transport`], so the procedure itself (the
//! pairing of ops, the byte check, the absence of any hang, also where one
//! NCCL kernel runs at a time and with eager buffering off) is tested on
//! the simulator on the CPU; only its times need GPUs. On GPUs,
//! [`crate::Local::measure_copy_from`] runs it.

use std::fmt;
use std::time::Instant;

use duplex::{Dir, Error, Place, Policy, Rank, Result, Size, Transport};

/// The sizes measured by default: 64 KiB to 256 MiB, by fours.
pub const SIZES: [u64; 7] = [
    64 << 10,
    256 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
    64 << 20,
    256 << 20,
];

/// What [`measure`] times.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Message sizes in bytes, ascending.
    pub sizes: Vec<u64>,
    /// Timings of each (size, path, direction); the median is kept.
    pub trials: u32,
    /// About how many bytes each timing moves per direction (between 2 and
    /// 256 messages).
    pub bytes_per_timing: u64,
}

impl Default for Plan {
    fn default() -> Self {
        Plan {
            sizes: SIZES.to_vec(),
            trials: 5,
            bytes_per_timing: 256 << 20,
        }
    }
}

impl Plan {
    /// Messages per timing at `bytes`.
    fn messages(&self, bytes: u64) -> u32 {
        (self.bytes_per_timing / bytes.max(1)).clamp(2, 256) as u32
    }

    /// Refuses a plan [`measure`] cannot run.
    pub(crate) fn check(&self) -> Result<()> {
        let why = if self.sizes.is_empty() {
            Some("it has no sizes".to_string())
        } else if self.sizes.windows(2).any(|w| w[0] >= w[1]) {
            Some(format!(
                "its sizes {:?} are not strictly ascending",
                self.sizes
            ))
        } else if self.sizes[0] == 0 {
            Some("a size of 0 bytes times nothing".to_string())
        } else if self.trials == 0 {
            Some("it has no trials".to_string())
        } else {
            None
        };
        match why {
            Some(why) => Err(Error::User(format!(
                "copy-lane threshold: cannot measure this plan: {why}"
            ))),
            None => Ok(()),
        }
    }
}

/// The kind of lane a timing used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Path {
    /// The direction's NCCL lane (ops placed on its communicator and stream).
    Nccl,
    /// The direction's copy-engine lane (ops placed by the policy).
    Copy,
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Path::Nccl => "nccl",
            Path::Copy => "copy",
        })
    }
}

/// One timing on one rank: host time per message from a common start to
/// its streams' completion.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Sample {
    /// The rank that timed it.
    pub rank: Rank,
    /// The message size.
    pub bytes: u64,
    /// The lane kind.
    pub path: Path,
    /// Both directions at once (`false`: rank 0 to rank 1 only).
    pub both_ways: bool,
    /// Which trial.
    pub trial: u32,
    /// Microseconds per message.
    pub micros: f64,
}

/// Times NCCL lanes and copy-engine lanes between ranks 0 and 1 of `t`'s
/// job at every size of `plan`, and returns this rank's samples (none on
/// other ranks, which only return). Needs [`Policy::PerDirection`] with
/// copy-engine lanes for every size of the plan (`copy_from` at most its
/// smallest size). Ranks 0 and 1 must both call it, at the same point of
/// their programs; before any timing each path delivers one message of
/// every size each way, and every byte is checked.
pub fn measure<T: Transport>(t: &T, plan: &Plan) -> Result<Vec<Sample>> {
    plan.check()?;
    if t.world_size() < 2 {
        return Err(Error::User(format!(
            "copy-lane threshold: needs two ranks, the job has {}",
            t.world_size()
        )));
    }
    let smallest = plan.sizes[0];
    match (t.policy(), t.copy_from()) {
        (Policy::PerDirection, Some(c)) if c <= smallest => {}
        (policy, c) => {
            return Err(Error::User(format!(
                "copy-lane threshold: needs per-direction lanes with copy-engine lanes from {} (the smallest size measured) or less; this transport has policy {policy} and copy lanes {}",
                Size(smallest),
                c.map_or("off".to_string(), |c| format!("from {}", Size(c)))
            )));
        }
    }
    let rank = t.rank();
    if rank > 1 {
        return Ok(Vec::new());
    }
    let peer = 1 - rank;
    let out_lane = t.lane(peer, Dir::Send)?;
    let in_lane = t.lane(peer, Dir::Recv)?;
    let nccl_send = Place::on(&out_lane.comm, &out_lane.stream);
    let nccl_recv = Place::on(&in_lane.comm, &in_lane.stream);
    let mut bufs = plan
        .sizes
        .iter()
        .map(|&b| Ok((b, t.alloc::<u8>(b as usize)?, t.alloc::<u8>(b as usize)?)))
        .collect::<Result<Vec<_>>>()?;
    let mut barriers = 0u64;
    let mut barrier = || -> Result<()> {
        barriers += 1;
        let tag = format!("duplex-threshold/{barriers}");
        t.notify(peer, &tag)?;
        t.await_notify(peer, &tag)
    };
    // Each op of one message, on `path`.
    let send = |path: Path, buf: &T::Buffer<u8>| match path {
        Path::Nccl => t.send_on(buf, peer, &nccl_send),
        Path::Copy => t.send(buf, peer),
    };
    let recv = |path: Path, buf: &mut T::Buffer<u8>| match path {
        Path::Nccl => t.recv_on(buf, peer, &nccl_recv),
        Path::Copy => t.recv(buf, peer),
    };

    // The byte check, which also connects and warms every path.
    for path in [Path::Nccl, Path::Copy] {
        for (bytes, out, inb) in &mut bufs {
            t.write(out, &pattern(*bytes, rank, path))?;
            barrier()?;
            // Rank 0 sends first, rank 1 receives first: no R4/R5 hazard.
            if rank == 0 {
                send(path, &*out)?;
                recv(path, inb)?;
            } else {
                recv(path, inb)?;
                send(path, &*out)?;
            }
            t.synchronize()?;
            delivered(rank, peer, path, &t.read(inb)?)?;
        }
    }

    let mut samples = Vec::new();
    for trial in 0..plan.trials {
        for (bytes, out, inb) in &mut bufs {
            let n = plan.messages(*bytes);
            for both_ways in [false, true] {
                let paths = if trial % 2 == 0 {
                    [Path::Nccl, Path::Copy]
                } else {
                    [Path::Copy, Path::Nccl]
                };
                for path in paths {
                    barrier()?;
                    let start = Instant::now();
                    // Rank 1 receives before it sends, as in the byte check:
                    // both ranks sending first would hang wherever only one
                    // NCCL kernel runs at a time (R10, `kernels=1`).
                    for _ in 0..n {
                        if rank == 1 {
                            recv(path, inb)?;
                        }
                        if both_ways || rank == 0 {
                            send(path, &*out)?;
                        }
                        if both_ways && rank == 0 {
                            recv(path, inb)?;
                        }
                    }
                    t.synchronize()?;
                    samples.push(Sample {
                        rank,
                        bytes: *bytes,
                        path,
                        both_ways,
                        trial,
                        micros: start.elapsed().as_secs_f64() * 1e6 / f64::from(n),
                    });
                }
            }
        }
    }
    Ok(samples)
}

/// Whether `got`, received by `rank` on `path`, holds every byte of what
/// `peer` sent in the byte check.
fn delivered(rank: Rank, peer: Rank, path: Path, got: &[u8]) -> Result<()> {
    let bytes = got.len() as u64;
    let want = pattern(bytes, peer, path);
    match got.iter().zip(&want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(Error::User(format!(
            "copy-lane threshold: rank {rank} got wrong data from rank {peer} on the {path} lane, {} message, at byte {i}: {} instead of {}; the transport is not delivering, so no threshold is measured",
            Size(bytes),
            got[i],
            want[i]
        ))),
    }
}

/// What rank `from` sends on `path` in the byte check: differs by rank,
/// path and size.
fn pattern(bytes: u64, from: Rank, path: Path) -> Vec<u8> {
    let salt = (from as u64) * 3 + path as u64 + bytes.trailing_zeros() as u64;
    (0..bytes)
        .map(|i| ((i.wrapping_mul(131) ^ (i >> 8)).wrapping_add(salt) % 251) as u8)
        .collect()
}

/// The medians at one size, microseconds per message; each timing is the
/// slower of the two ranks'.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SizeTimes {
    /// The message size.
    pub bytes: u64,
    /// NCCL lane, rank 0 to rank 1.
    pub nccl_one_way: f64,
    /// Copy-engine lane, rank 0 to rank 1.
    pub copy_one_way: f64,
    /// NCCL lanes, both directions at once.
    pub nccl_both_ways: f64,
    /// Copy-engine lanes, both directions at once.
    pub copy_both_ways: f64,
}

impl SizeTimes {
    /// Whether copy-engine lanes take less time than NCCL lanes, one way
    /// and both ways counted alike.
    pub fn copy_wins(&self) -> bool {
        self.copy_one_way + self.copy_both_ways < self.nccl_one_way + self.nccl_both_ways
    }
}

/// The threshold: the smallest size from which copy-engine lanes win
/// ([`SizeTimes::copy_wins`]) at that size and at every larger size
/// measured. `None` when they do not win at the largest size: copy-engine
/// lanes then stay off.
pub fn choose(sizes: &[SizeTimes]) -> Option<u64> {
    let losing = sizes.iter().rposition(|s| !s.copy_wins());
    match losing {
        None => sizes.first().map(|s| s.bytes),
        Some(i) => sizes.get(i + 1).map(|s| s.bytes),
    }
}

/// A measurement's result: the times at every size and the threshold
/// chosen from them.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Measurement {
    /// Trials per figure.
    pub trials: u32,
    /// The medians, by size.
    pub sizes: Vec<SizeTimes>,
    /// [`choose`]'s threshold: what to pass as `copy_from`.
    pub copy_from: Option<Size>,
}

impl Measurement {
    /// Summarizes the samples of ranks 0 and 1 (in any order) of a run of
    /// [`measure`] with `plan`. Fails if a figure lacks a sample of either
    /// rank.
    pub fn new(plan: &Plan, samples: &[Sample]) -> Result<Measurement> {
        let mut sizes = Vec::new();
        for &bytes in &plan.sizes {
            let figure = |path: Path, both_ways: bool| -> Result<f64> {
                let mut per_trial = Vec::new();
                for trial in 0..plan.trials {
                    let of_rank = |rank: Rank| {
                        samples.iter().find(|s| {
                            (s.rank, s.bytes, s.path, s.both_ways, s.trial)
                                == (rank, bytes, path, both_ways, trial)
                        })
                    };
                    match (of_rank(0), of_rank(1)) {
                        (Some(a), Some(b)) => per_trial.push(a.micros.max(b.micros)),
                        _ => {
                            return Err(Error::User(format!(
                                "copy-lane threshold: no sample of both ranks for {} on the {path} lane ({}), trial {trial}",
                                Size(bytes),
                                if both_ways { "both ways" } else { "one way" }
                            )));
                        }
                    }
                }
                Ok(median(&mut per_trial))
            };
            sizes.push(SizeTimes {
                bytes,
                nccl_one_way: figure(Path::Nccl, false)?,
                copy_one_way: figure(Path::Copy, false)?,
                nccl_both_ways: figure(Path::Nccl, true)?,
                copy_both_ways: figure(Path::Copy, true)?,
            });
        }
        Ok(Measurement {
            trials: plan.trials,
            copy_from: choose(&sizes).map(Size),
            sizes,
        })
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

impl fmt::Display for Measurement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "copy-engine lanes against NCCL lanes, ranks 0 and 1, microseconds per message (median of {} trials):",
            self.trials
        )?;
        writeln!(
            f,
            "  {:>8}  {:>10} {:>10}  {:>10} {:>10}  faster",
            "size", "nccl 1way", "copy 1way", "nccl 2way", "copy 2way"
        )?;
        for s in &self.sizes {
            writeln!(
                f,
                "  {:>8}  {:>10.1} {:>10.1}  {:>10.1} {:>10.1}  {}",
                Size(s.bytes).to_string(),
                s.nccl_one_way,
                s.copy_one_way,
                s.nccl_both_ways,
                s.copy_both_ways,
                if s.copy_wins() { "copy" } else { "nccl" }
            )?;
        }
        match self.copy_from {
            Some(c) => write!(
                f,
                "copy_from {c}: copy-engine lanes are faster from there up, one way and both ways counted alike"
            ),
            None => write!(
                f,
                "copy_from off: copy-engine lanes are not faster at the largest size measured"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(bytes: u64, nccl: f64, copy: f64) -> SizeTimes {
        SizeTimes {
            bytes,
            nccl_one_way: nccl,
            copy_one_way: copy,
            nccl_both_ways: nccl,
            copy_both_ways: copy,
        }
    }

    #[test]
    fn the_threshold_is_where_copy_lanes_win_from_there_up() {
        let s = [
            at(1, 5.0, 9.0),
            at(2, 6.0, 7.0),
            at(4, 9.0, 8.0),
            at(8, 20.0, 10.0),
        ];
        assert_eq!(choose(&s), Some(4));
    }

    #[test]
    fn a_win_below_a_loss_does_not_count() {
        // Noise at a small size: copy wins at 1, loses at 2, wins from 4.
        let s = [at(1, 9.0, 5.0), at(2, 6.0, 7.0), at(4, 9.0, 8.0)];
        assert_eq!(choose(&s), Some(4));
    }

    #[test]
    fn no_threshold_when_copy_lanes_lose_at_the_largest_size() {
        let s = [at(1, 9.0, 5.0), at(2, 6.0, 7.0)];
        assert_eq!(choose(&s), None);
        assert_eq!(choose(&[]), None);
    }

    #[test]
    fn every_size_when_copy_lanes_always_win() {
        let s = [at(1, 9.0, 5.0), at(2, 9.0, 7.0)];
        assert_eq!(choose(&s), Some(1));
    }

    #[test]
    fn one_way_and_both_ways_count_alike() {
        let mut s = at(1, 10.0, 10.0);
        s.copy_one_way = 12.0; // 1 µs slower one way...
        s.copy_both_ways = 7.0; // ...3 µs faster both ways.
        assert!(s.copy_wins());
        s.copy_both_ways = 9.0;
        assert!(!s.copy_wins());
    }

    fn sample(rank: Rank, path: Path, both_ways: bool, trial: u32, micros: f64) -> Sample {
        Sample {
            rank,
            bytes: 64,
            path,
            both_ways,
            trial,
            micros,
        }
    }

    #[test]
    fn a_figure_is_the_median_over_trials_of_the_slower_rank() {
        let plan = Plan {
            sizes: vec![64],
            trials: 3,
            bytes_per_timing: 64,
        };
        let mut samples = Vec::new();
        for trial in 0..3 {
            for path in [Path::Nccl, Path::Copy] {
                for both in [false, true] {
                    // Rank 1 is slower in trial 0 only.
                    let base = f64::from(trial + 1) * 10.0;
                    samples.push(sample(0, path, both, trial, base));
                    samples.push(sample(
                        1,
                        path,
                        both,
                        trial,
                        base + f64::from(trial == 0) * 100.0,
                    ));
                }
            }
        }
        let m = Measurement::new(&plan, &samples).expect("every sample");
        // Trials: max(10, 110) = 110, 20, 30: median 30.
        assert_eq!(m.sizes[0].nccl_one_way, 30.0);
        assert_eq!(m.sizes[0].copy_both_ways, 30.0);
        samples.pop();
        let e = Measurement::new(&plan, &samples).expect_err("a sample is missing");
        assert!(e.to_string().contains("trial 2"), "{e}");
    }

    #[test]
    fn plans_that_cannot_run_are_refused() {
        for (sizes, trials) in [(vec![], 1), (vec![4, 2], 1), (vec![0, 2], 1), (vec![2], 0)] {
            let plan = Plan {
                sizes,
                trials,
                bytes_per_timing: 1,
            };
            assert!(plan.check().is_err(), "{plan:?}");
        }
        assert!(Plan::default().check().is_ok());
    }

    #[test]
    fn the_byte_check_names_the_first_wrong_byte() {
        let mut got = pattern(4096, 0, Path::Copy);
        assert!(delivered(1, 0, Path::Copy, &got).is_ok());
        // Another path's bytes, or one byte changed, are not a delivery.
        assert!(delivered(1, 0, Path::Nccl, &got).is_err());
        got[1000] = got[1000].wrapping_add(1);
        let e = delivered(1, 0, Path::Copy, &got).expect_err("one byte is wrong");
        assert!(
            e.to_string()
                .contains("copy lane, 4KiB message, at byte 1000"),
            "{e}"
        );
    }

    #[test]
    fn patterns_differ_by_rank_and_path() {
        let p = |r, path| pattern(4096, r, path);
        assert_ne!(p(0, Path::Nccl), p(1, Path::Nccl));
        assert_ne!(p(0, Path::Nccl), p(0, Path::Copy));
        assert_eq!(p(1, Path::Copy).len(), 4096);
    }
}
