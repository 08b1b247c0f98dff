//! Explorers: who decides which host thread steps next. Random (one seeded
//! schedule), depth-first over every interleaving that matters (with the
//! same persistent-set reduction and state caching as the checker), and
//! replay of an encoded schedule.

use std::collections::{HashSet, VecDeque};

use duplex::machine::ThreadId;

/// What an explorer answers at a decision point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Choice {
    /// Step this thread.
    Take(ThreadId),
    /// Stop this execution: what follows was explored before.
    Prune,
    /// Stop: the schedule being replayed does not fit the program.
    Mismatch,
}

/// Decides at each decision point.
pub(crate) trait Explorer {
    /// `enabled` are the threads that can step, `options` the subset worth
    /// exploring (the reduction), `fingerprint` the machine state's.
    fn choose(&mut self, enabled: &[ThreadId], options: &[ThreadId], fingerprint: u128) -> Choice;
}

/// One seeded random schedule (xorshift64*; no dependency needed).
#[derive(Debug)]
pub(crate) struct Random {
    state: u64,
}

impl Random {
    pub(crate) fn new(seed: u64) -> Random {
        Random {
            state: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
        }
    }

    fn next(&mut self) -> u64 {
        let mut x = self.state;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.state = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

impl Explorer for Random {
    fn choose(&mut self, enabled: &[ThreadId], _: &[ThreadId], _: u128) -> Choice {
        let i = (self.next() % enabled.len() as u64) as usize;
        Choice::Take(enabled[i])
    }
}

/// Replays an encoded schedule: the thread chosen at every decision point
/// where more than one thread could step.
#[derive(Debug)]
pub(crate) struct Replay {
    choices: VecDeque<ThreadId>,
}

impl Replay {
    pub(crate) fn new(choices: Vec<ThreadId>) -> Replay {
        Replay {
            choices: choices.into(),
        }
    }
}

impl Explorer for Replay {
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
}

/// Depth-first search over executions: each execution follows the choices
/// on the stack, then takes first options, pushing new frames; afterwards
/// [`Dfs::backtrack`] moves to the next untried option. A decision point
/// whose state was seen before is pruned: in a depth-first search every
/// state seen before is fully explored or an ancestor, and the state graph
/// has no cycles.
#[derive(Debug, Default)]
pub(crate) struct Dfs {
    stack: Vec<Frame>,
    depth: usize,
    visited: HashSet<u128>,
}

impl Dfs {
    /// Moves to the next execution; false when every option was tried.
    pub(crate) fn backtrack(&mut self) -> bool {
        self.depth = 0;
        while let Some(top) = self.stack.last_mut() {
            if top.next + 1 < top.options.len() {
                top.next += 1;
                return true;
            }
            self.stack.pop();
        }
        false
    }

    /// Distinct states seen at decision points.
    pub(crate) fn states(&self) -> usize {
        self.visited.len()
    }
}

impl Explorer for Dfs {
    fn choose(&mut self, _: &[ThreadId], options: &[ThreadId], fingerprint: u128) -> Choice {
        let d = self.depth;
        self.depth += 1;
        if let Some(frame) = self.stack.get(d) {
            return Choice::Take(frame.options[frame.next]);
        }
        if !self.visited.insert(fingerprint) {
            return Choice::Prune;
        }
        self.stack.push(Frame {
            options: options.to_vec(),
            next: 0,
        });
        Choice::Take(options[0])
    }
}

/// The explorer of one run.
#[derive(Debug)]
pub(crate) enum Strategy {
    Random(Random),
    Replay(Replay),
    Dfs(Dfs),
}

impl Explorer for Strategy {
    fn choose(&mut self, enabled: &[ThreadId], options: &[ThreadId], fp: u128) -> Choice {
        match self {
            Strategy::Random(e) => e.choose(enabled, options, fp),
            Strategy::Replay(e) => e.choose(enabled, options, fp),
            Strategy::Dfs(e) => e.choose(enabled, options, fp),
        }
    }
}

/// Encodes the choices of an execution as a schedule string.
pub(crate) fn encode(choices: &[ThreadId]) -> String {
    let ids: Vec<String> = choices.iter().map(|t| t.0.to_string()).collect();
    format!("v1:{}", ids.join("."))
}

/// Decodes a schedule string.
pub(crate) fn decode(schedule: &str) -> Result<Vec<ThreadId>, String> {
    let body = schedule.trim().strip_prefix("v1:").ok_or_else(|| {
        format!("`{schedule}` is not a duplex schedule: it should start with `v1:`")
    })?;
    if body.is_empty() {
        return Ok(Vec::new());
    }
    body.split('.')
        .map(|s| {
            s.parse::<u32>()
                .map(ThreadId)
                .map_err(|_| format!("`{s}` in the schedule is not a thread number"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_round_trip() {
        let choices = vec![ThreadId(0), ThreadId(3), ThreadId(1)];
        assert_eq!(encode(&choices), "v1:0.3.1");
        assert_eq!(decode(&encode(&choices)), Ok(choices));
        assert_eq!(decode("v1:"), Ok(vec![]));
        assert!(decode("0.1").unwrap_err().contains("v1:"));
        assert!(decode("v1:0.x").unwrap_err().contains("`x`"));
    }

    #[test]
    fn dfs_visits_every_option_once() {
        let mut dfs = Dfs::default();
        let (a, b) = (ThreadId(0), ThreadId(1));
        let mut seen = Vec::new();
        loop {
            let first = dfs.choose(&[a, b], &[a, b], 1);
            let second = dfs.choose(&[a, b], &[a, b], 2 + seen.len() as u128 * 10);
            seen.push((first, second));
            if !dfs.backtrack() {
                break;
            }
        }
        let take = |x, y| (Choice::Take(x), Choice::Take(y));
        assert_eq!(seen, vec![take(a, a), take(a, b), take(b, a), take(b, b)]);
    }
}
