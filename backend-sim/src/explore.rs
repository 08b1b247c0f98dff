//! The one explorer: who decides which host thread steps next, for the
//! checker and for the simulated transport alike.
//!
//! A driver (the checker's over a compiled schedule, [`crate::check`]; the
//! simulated transport's over user code, [`crate::sim`]) runs the machine and,
//! at every point where some host threads can step, asks a [`Scheduler`]
//! which one. Every choice where more than one thread could step is recorded,
//! and that list is the [`Schedule`]: printed as `v1:0.3.1`, it replays the
//! same interleaving exactly ([`Replay`]), whichever strategy found it.
//!
//! Strategies, one type each:
//!
//! * [`Dfs`]: every interleaving that matters, depth-first, over the
//!   persistent sets of the reduction (`check::reduce`), pruning states
//!   already explored (by 128-bit fingerprint). A driver that can snapshot
//!   the machine resumes from the snapshot of the frame that changed
//!   ([`Dfs::backtrack`]); one that cannot (real threads) re-executes from
//!   the start;
//! * [`Random`]: one uniformly random choice at each point, seeded
//!   (`rand`'s `StdRng`);
//! * [`Pct`]: probabilistic concurrency testing (Burckhardt et al., ASPLOS
//!   2010): random thread priorities and `depth - 1` random points where the
//!   running thread's priority drops, which finds any bug of depth `d` with
//!   probability at least 1/(n·k^(d-1));
//! * [`Replay`]: follows a [`Schedule`];
//! * [`crate::dpor::Dpor`]: the simulated transport's search of rank code,
//!   whose future calls are unknown: dynamic partial-order reduction, which
//!   learns from the steps it runs which orders matter. It decides in the
//!   simulated transport's world, which tells it what each step used.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::str::FromStr;

use duplex::machine::ThreadId;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The choices of one execution. Prints as a version, `:`, and the thread
/// numbers joined by `.`; parses back from that.
///
/// * `v1:` records the thread chosen at every point where more than one
///   thread could step (the simulated transport's schedules, and the
///   checker's without reduction);
/// * `v3:` records it only where the checker's reduction left more than one
///   thread to explore; elsewhere the replay takes the thread the checker
///   took ([`crate::check`]). A program whose ranks have one thread each
///   has the empty `v3:` schedule however long its run, where its `v1:`
///   schedule names a thread at nearly every step.
/// * `v2:` is the same under the rule of earlier versions of duplex, where
///   a thread alone on its rank took one step at a time rather than a
///   burst (`check::BURST`): its decision points are other ones, so it
///   keeps its own tag and replays under that rule.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Schedule {
    /// The threads chosen, in order.
    pub choices: Vec<ThreadId>,
    /// `v2` or `v3`: choices only at the reduced search's decision points.
    pub reduced: bool,
    /// For a reduced schedule, the steps a thread alone on its rank takes
    /// in a row in the search it was recorded in: 1 for `v2:`,
    /// `check::BURST` for `v3:`.
    pub burst: u32,
}

impl Schedule {
    /// A `v1:` schedule: a choice wherever more than one thread could step.
    pub fn v1(choices: Vec<ThreadId>) -> Schedule {
        Schedule {
            choices,
            reduced: false,
            burst: 1,
        }
    }

    /// A `v2:` schedule: a choice wherever the reduction of earlier
    /// versions (one step at a time) left more than one thread.
    pub fn v2(choices: Vec<ThreadId>) -> Schedule {
        Schedule {
            choices,
            reduced: true,
            burst: 1,
        }
    }

    /// A `v3:` schedule: a choice wherever the checker's reduction left
    /// more than one thread.
    pub fn v3(choices: Vec<ThreadId>) -> Schedule {
        Schedule {
            choices,
            reduced: true,
            burst: crate::check::BURST,
        }
    }

    /// `v1:`, `v2:` or `v3:`.
    fn tag(&self) -> &'static str {
        match (self.reduced, self.burst) {
            (false, _) => "v1:",
            (true, 1) => "v2:",
            (true, _) => "v3:",
        }
    }
}

impl Default for Schedule {
    /// The empty `v1:` schedule.
    fn default() -> Schedule {
        Schedule::v1(Vec::new())
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.tag())?;
        for (i, t) in self.choices.iter().enumerate() {
            if i > 0 {
                f.write_str(".")?;
            }
            write!(f, "{}", t.0)?;
        }
        Ok(())
    }
}

impl FromStr for Schedule {
    type Err = String;

    fn from_str(schedule: &str) -> Result<Schedule, String> {
        let s = schedule.trim();
        let empty = [Schedule::v1, Schedule::v2, Schedule::v3]
            .into_iter()
            .map(|make| make(Vec::new()))
            .find(|e| s.starts_with(e.tag()));
        let Some(empty) = empty else {
            return Err(format!(
                "`{schedule}` is not a duplex schedule: it should start with `v1:`, `v2:` or `v3:`"
            ));
        };
        let body = &s[empty.tag().len()..];
        if body.is_empty() {
            return Ok(empty);
        }
        body.split('.')
            .map(|s| {
                s.parse::<u32>()
                    .map(ThreadId)
                    .map_err(|_| format!("`{s}` in the schedule is not a thread number"))
            })
            .collect::<Result<_, _>>()
            .map(|choices| Schedule { choices, ..empty })
    }
}

/// What a scheduler answers at a decision point.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Choice {
    /// Step this thread.
    Take(ThreadId),
    /// Stop this execution: what follows was explored before.
    Prune,
    /// Stop: the schedule being replayed does not fit the program.
    Mismatch,
}

/// Decides, at each point where threads can step, which one does.
pub trait Scheduler {
    /// `enabled` are the threads that can step (in id order), `options` the
    /// subset worth exploring (a persistent set; `enabled` without the
    /// reduction), `fingerprint` the machine state's.
    fn choose(&mut self, enabled: &[ThreadId], options: &[ThreadId], fingerprint: u128) -> Choice;
}

/// One seeded random schedule: a uniform choice among the enabled threads.
#[derive(Debug)]
pub struct Random {
    rng: StdRng,
}

impl Random {
    /// The schedule of `seed`.
    pub fn new(seed: u64) -> Random {
        Random {
            rng: StdRng::seed_from_u64(seed),
        }
    }
}

impl Scheduler for Random {
    fn choose(&mut self, enabled: &[ThreadId], _: &[ThreadId], _: u128) -> Choice {
        Choice::Take(enabled[self.rng.random_range(0..enabled.len())])
    }
}

/// Probabilistic concurrency testing: each thread gets a random priority
/// (from `depth` up) when first seen, the highest-priority enabled thread
/// steps, and at `depth - 1` random steps among the first `steps` the
/// running thread's priority drops below every initial one.
#[derive(Debug)]
pub struct Pct {
    rng: StdRng,
    priorities: HashMap<ThreadId, u64>,
    /// Steps at which the chosen thread's priority drops, with the value.
    changes: HashMap<u64, u64>,
    step: u64,
    depth: u64,
}

impl Pct {
    /// A PCT schedule of `seed` for bugs of depth `depth` (1: no priority
    /// change) in executions of about `steps` decision points.
    pub fn new(seed: u64, depth: u32, steps: u64) -> Pct {
        let mut rng = StdRng::seed_from_u64(seed);
        let depth = u64::from(depth.max(1));
        let changes = (1..depth)
            .map(|i| (rng.random_range(0..steps.max(1)), depth - i))
            .collect();
        Pct {
            rng,
            priorities: HashMap::new(),
            changes,
            step: 0,
            depth,
        }
    }
}

impl Scheduler for Pct {
    fn choose(&mut self, enabled: &[ThreadId], _: &[ThreadId], _: u128) -> Choice {
        for t in enabled {
            if !self.priorities.contains_key(t) {
                // Distinct with overwhelming probability; ties go to the
                // lower thread id.
                let p = self.depth + self.rng.random_range(0..u64::from(u32::MAX));
                self.priorities.insert(*t, p);
            }
        }
        let t = *enabled
            .iter()
            .max_by_key(|t| (self.priorities[*t], std::cmp::Reverse(t.0)))
            .expect("a decision has an enabled thread");
        if let Some(low) = self.changes.get(&self.step) {
            self.priorities.insert(t, *low);
        }
        self.step += 1;
        Choice::Take(t)
    }
}

/// Follows a [`Schedule`]: at every point where more than one thread can
/// step, the next recorded thread, which must be one of them.
#[derive(Debug)]
pub struct Replay {
    choices: VecDeque<ThreadId>,
    reduced: bool,
    burst: u32,
}

impl Replay {
    /// Replays `schedule`.
    pub fn new(schedule: Schedule) -> Replay {
        Replay {
            choices: schedule.choices.into(),
            reduced: schedule.reduced,
            burst: schedule.burst,
        }
    }

    /// The steps a thread alone on its rank takes in a row in the reduced
    /// search the schedule was recorded in ([`Schedule::burst`]).
    pub fn burst(&self) -> u32 {
        self.burst
    }

    /// Whether the schedule is `v2:` or `v3:` (choices only where the
    /// checker's reduction left more than one thread).
    pub fn reduced(&self) -> bool {
        self.reduced
    }

    /// Choices not used yet.
    pub fn left(&self) -> usize {
        self.choices.len()
    }

    /// The choices not used yet, in words (`1 choice is`, `3 choices
    /// are`), when there are any: a schedule that has them left when its
    /// execution ends is not the program's.
    pub fn left_over(&self) -> Option<String> {
        match self.left() {
            0 => None,
            1 => Some("1 choice is".into()),
            n => Some(format!("{n} choices are")),
        }
    }

    /// Takes the next recorded choice (for a driver that has checked
    /// itself that more than one thread can step).
    pub fn take_next(&mut self) -> Option<ThreadId> {
        self.choices.pop_front()
    }
}

impl Scheduler for Replay {
    fn choose(&mut self, enabled: &[ThreadId], _: &[ThreadId], _: u128) -> Choice {
        if enabled.len() == 1 {
            return Choice::Take(enabled[0]);
        }
        match self.choices.pop_front() {
            Some(t) if enabled.contains(&t) => Choice::Take(t),
            _ => Choice::Mismatch,
        }
    }
}

#[derive(Debug)]
struct Frame {
    options: Vec<ThreadId>,
    next: usize,
    /// The state's fingerprint when the frame was made (checked on replay
    /// by a verifying search, [`Dfs::verifying`]).
    fingerprint: u128,
}

/// Depth-first search over executions: each execution follows the choices
/// on the stack, then takes first options, pushing new frames; afterwards
/// [`Dfs::backtrack`] moves to the next untried option. A decision point
/// whose state was seen before is pruned: in a depth-first search every
/// state seen before is fully explored or an ancestor, and the state graph
/// has no cycles (every step issues a call or completes one).
#[derive(Debug, Default)]
pub struct Dfs {
    stack: Vec<Frame>,
    depth: usize,
    visited: HashSet<u128>,
    /// Whether a replayed decision must find the state it recorded.
    verify: bool,
    /// The first replayed decision that did not ([`Dfs::diverged`]).
    diverged: Option<usize>,
}

impl Dfs {
    /// A search that checks, at every decision it replays on the way to the
    /// next untried choice, that the state and the threads to choose from
    /// are those it recorded there; where they are not, it stops with
    /// [`Choice::Mismatch`] and [`Dfs::diverged`] says where. For a driver
    /// that re-executes code which must be deterministic (the simulated
    /// transport's rank code) and passes the real fingerprint at every
    /// decision; a driver that passes none on replay (the schedule
    /// checker, whose machine is deterministic) uses the default search.
    pub fn verifying() -> Dfs {
        Dfs {
            verify: true,
            ..Dfs::default()
        }
    }

    /// The first decision (0-based) at which a verifying search found,
    /// replaying, another state than it had recorded there.
    pub fn diverged(&self) -> Option<usize> {
        self.diverged
    }

    /// Moves to the next execution; returns the depth (decision index) of
    /// the frame whose choice changed, or `None` when every option was
    /// tried. The next execution starts from the beginning; a driver that
    /// kept the machine as it was at that frame calls [`Dfs::rewind`] with
    /// it and continues from there.
    pub fn backtrack(&mut self) -> Option<usize> {
        self.depth = 0;
        while let Some(top) = self.stack.last_mut() {
            if top.next + 1 < top.options.len() {
                top.next += 1;
                return Some(self.stack.len() - 1);
            }
            self.stack.pop();
        }
        None
    }

    /// Continues the current execution at decision `depth` (a driver that
    /// restored its snapshot of that point).
    pub fn rewind(&mut self, depth: usize) {
        self.depth = depth;
    }

    /// The index of the next decision on the current execution.
    pub fn cursor(&self) -> usize {
        self.depth
    }

    /// Distinct states seen at decision points.
    pub fn states(&self) -> usize {
        self.visited.len()
    }

    /// Decision points on the current path.
    pub fn depth(&self) -> usize {
        self.stack.len()
    }
}

impl Scheduler for Dfs {
    fn choose(&mut self, _: &[ThreadId], options: &[ThreadId], fingerprint: u128) -> Choice {
        let d = self.depth;
        self.depth += 1;
        if let Some(frame) = self.stack.get(d) {
            if self.verify && (frame.fingerprint != fingerprint || frame.options != options) {
                self.diverged = Some(d);
                return Choice::Mismatch;
            }
            return Choice::Take(frame.options[frame.next]);
        }
        if !self.visited.insert(fingerprint) {
            return Choice::Prune;
        }
        self.stack.push(Frame {
            options: options.to_vec(),
            next: 0,
            fingerprint,
        });
        Choice::Take(options[0])
    }
}

/// A strategy, as a value the simulated transport can hand between
/// executions.
#[derive(Debug)]
pub enum Strategy {
    /// [`Random`].
    Random(Random),
    /// [`Pct`].
    Pct(Pct),
    /// [`Replay`].
    Replay(Replay),
    /// [`Dfs`].
    Dfs(Dfs),
    /// [`crate::dpor::Dpor`]: the simulated transport's search, which
    /// decides in the world itself.
    Dpor(Box<crate::dpor::Dpor>),
}

impl Scheduler for Strategy {
    fn choose(&mut self, enabled: &[ThreadId], options: &[ThreadId], fp: u128) -> Choice {
        match self {
            Strategy::Random(e) => e.choose(enabled, options, fp),
            Strategy::Pct(e) => e.choose(enabled, options, fp),
            Strategy::Replay(e) => e.choose(enabled, options, fp),
            Strategy::Dfs(e) => e.choose(enabled, options, fp),
            // Decides in `World::schedule` (it needs the uses of each step).
            Strategy::Dpor(_) => Choice::Take(options[0]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_round_trip() {
        let s = Schedule::v1(vec![ThreadId(0), ThreadId(3), ThreadId(1)]);
        assert_eq!(s.to_string(), "v1:0.3.1");
        assert_eq!(s.to_string().parse(), Ok(s));
        assert_eq!("v1:".parse(), Ok(Schedule::default()));
        let s = Schedule::v2(vec![ThreadId(2)]);
        assert_eq!(s.to_string(), "v2:2");
        assert_eq!(s.to_string().parse(), Ok(s));
        assert_eq!("v2:".parse(), Ok(Schedule::v2(Vec::new())));
        let s = Schedule::v3(vec![ThreadId(1), ThreadId(4)]);
        assert_eq!(s.to_string(), "v3:1.4");
        assert_eq!("v3:1.4".parse(), Ok(s));
        assert_eq!(
            "v3:".parse::<Schedule>().map(|s| s.burst),
            Ok(crate::check::BURST)
        );
        assert_eq!("v2:3".parse::<Schedule>().map(|s| s.burst), Ok(1));
        assert!("0.1".parse::<Schedule>().unwrap_err().contains("v1:"));
        assert!("v1:0.x".parse::<Schedule>().unwrap_err().contains("`x`"));
    }

    #[test]
    fn dfs_visits_every_option_once() {
        let mut dfs = Dfs::default();
        let (a, b) = (ThreadId(0), ThreadId(1));
        let mut seen = Vec::new();
        let mut changed = Vec::new();
        loop {
            let first = dfs.choose(&[a, b], &[a, b], 1);
            let second = dfs.choose(&[a, b], &[a, b], 2 + seen.len() as u128 * 10);
            seen.push((first, second));
            match dfs.backtrack() {
                Some(d) => changed.push(d),
                None => break,
            }
        }
        let take = |x, y| (Choice::Take(x), Choice::Take(y));
        assert_eq!(seen, vec![take(a, a), take(a, b), take(b, a), take(b, b)]);
        assert_eq!(changed, vec![1, 0, 1]);
    }

    #[test]
    fn random_and_pct_are_determined_by_their_seed_and_vary_with_it() {
        let threads: Vec<ThreadId> = (0..4).map(ThreadId).collect();
        let run = |s: &mut dyn Scheduler| -> Vec<Choice> {
            (0..32).map(|_| s.choose(&threads, &threads, 0)).collect()
        };
        assert_eq!(run(&mut Random::new(1)), run(&mut Random::new(1)));
        assert_ne!(run(&mut Random::new(1)), run(&mut Random::new(2)));
        assert_eq!(run(&mut Pct::new(1, 3, 32)), run(&mut Pct::new(1, 3, 32)));
        let firsts: HashSet<_> = (0..32)
            .map(|seed| run(&mut Pct::new(seed, 1, 32))[0])
            .collect();
        assert!(
            firsts.len() > 1,
            "PCT's priorities do not depend on the seed"
        );
        // Depth 1: no priority change, so one thread runs throughout.
        let one = run(&mut Pct::new(5, 1, 32));
        assert!(one.iter().all(|c| *c == one[0]));
        // Depth 3 changes the running thread at least once in 32 steps.
        let three = run(&mut Pct::new(5, 3, 32));
        assert!(three.iter().any(|c| *c != three[0]));
    }

    #[test]
    fn replay_follows_the_schedule_and_says_when_it_does_not_fit() {
        let (a, b) = (ThreadId(0), ThreadId(1));
        let mut r = Replay::new(Schedule::v1(vec![b, a]));
        assert_eq!(r.choose(&[a], &[a], 0), Choice::Take(a));
        assert_eq!(r.choose(&[a, b], &[a, b], 0), Choice::Take(b));
        assert_eq!(r.left(), 1);
        assert_eq!(r.choose(&[b, ThreadId(2)], &[b], 0), Choice::Mismatch);
    }
}
