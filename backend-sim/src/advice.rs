//! What `duplex check` says beyond the verdict: hangs that only a knob
//! hides ([`latent`]), and repairs it has verified ([`repairs`]).
//!
//! **Latent hangs.** A program that is `ok` only because its channels have
//! eager capacity (R5) or are already connected (R6, R7) hangs on larger
//! messages, another transport, or new communicators. [`latent`] checks an
//! `ok` program again under NCCL's contract (`eager=0`) and on new
//! communicators (`lazy-connect=on`), and returns each variant that hangs,
//! with its explanation.
//!
//! **Repairs.** For a program that can hang, [`repairs`] builds candidate
//! edits (per-direction lanes; grouping the send and the recv of each rank
//! that takes part in the hang; a rank that receives before it sends; a
//! communicator and a stream of their own for one direction of explicitly
//! placed traffic), checks each edited program with the same checker, and
//! keeps only those whose verdict is `ok`: no hang and no error, so a
//! printed repair never trades one problem for another. Each is a list of
//! concrete edits to the file, by line.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use duplex::compile::compile_under;
use duplex::report::Stuck;
use duplex::schedule::{CommDecl, Dir, Line, MAX_WORD, P2p, Program, Stmt, StmtKind};
use duplex::{Policy, Size};
use serde::Serialize;

use crate::check::{self, Options, Verdict};
use crate::report::VerdictKind;

/// The most states one candidate's check may visit: repairs are advice, so
/// a candidate that is slow to decide is dropped rather than waited for
/// ([`Budget::gave_up`] says so).
pub const CANDIDATE_STATES: usize = 200_000;

/// The seconds `duplex check` gives the advice when its `--time-limit`
/// gives none: the verdict is known by then, and the advice must not keep
/// its user waiting in silence (a review's program waited 77 s after its
/// hang was found, for checks that gave up at their state bound).
pub const DEFAULT_SECONDS: u64 = 30;

/// A hang that a knob of the program's model hides.
#[derive(Clone, Debug, Serialize)]
pub struct Latent {
    /// The knob (`eager`, `lazy-connect`).
    pub knob: &'static str,
    /// The setting that hangs (`eager=0B`, `lazy-connect=on`).
    pub setting: String,
    /// What that setting means.
    pub meaning: &'static str,
    /// Why it is stuck under that setting.
    pub stuck: Stuck,
}

/// One change to a schedule file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "change", rename_all = "lowercase")]
pub enum Edit {
    /// Replace the statement on `line`.
    Replace {
        /// The line.
        line: u32,
        /// What is there.
        old: String,
        /// What to put there.
        new: String,
    },
    /// Delete the statement on `line`.
    Delete {
        /// The line.
        line: u32,
        /// What is there.
        old: String,
    },
    /// Insert a line after `after` (0: at the top).
    Insert {
        /// The line to insert after.
        after: u32,
        /// The new line.
        new: String,
    },
}

impl std::fmt::Display for Edit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Edit::Replace { line, old, new } => {
                write!(f, "line {line}: replace `{old}` with `{new}`")
            }
            Edit::Delete { line, old } => write!(f, "line {line}: delete `{old}`"),
            Edit::Insert { after: 0, new } => write!(f, "at the top: insert `{new}`"),
            Edit::Insert { after, new } => write!(f, "after line {after}: insert `{new}`"),
        }
    }
}

/// A repair the checker has verified.
#[derive(Clone, Debug, Serialize)]
pub struct Repair {
    /// What it does, in words.
    pub title: String,
    /// The edits, in line order.
    pub edits: Vec<Edit>,
    /// The verdict of the edited program (always `ok`).
    pub verdict: VerdictKind,
}

/// What the advice's checks may spend: all of them together until
/// `deadline` (each also at most 200,000 branching states, whatever the
/// search's own bound: a repair is offered only once its whole program is
/// checked). `duplex check` gives what is left of its `--time-limit`, so
/// that the command as a whole keeps to it.
#[derive(Debug, Default)]
pub struct Budget {
    /// When the advice stops checking: candidates not checked by then are
    /// not offered, and latent hangs not found by then not reported
    /// ([`Budget::spent`] says so).
    pub deadline: Option<Instant>,
    /// The snapshot memory of each check ([`Options::snapshot_memory`]).
    pub snapshot_memory: Option<usize>,
    /// Set when a check reached its bound of branching states before it
    /// decided ([`Budget::gave_up`]).
    bounded: std::sync::atomic::AtomicBool,
}

impl Budget {
    /// The options of one check, or `None` once the deadline has passed.
    fn options(&self) -> Option<Options> {
        let time_limit = match self.deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return None;
                }
                Some(left)
            }
            None => None,
        };
        Some(Options {
            max_states: CANDIDATE_STATES,
            reduce: true,
            time_limit,
            snapshot_memory: self.snapshot_memory,
        })
    }

    /// Whether the deadline has passed.
    pub fn spent(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// Whether some check gave up at its bound of branching states
    /// ([`CANDIDATE_STATES`]): a repair or latent hang it would have shown
    /// is not listed.
    pub fn gave_up(&self) -> bool {
        self.bounded.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A budget that stops at `deadline`, each check keeping
    /// `snapshot_memory`.
    pub fn new(deadline: Option<Instant>, snapshot_memory: Option<usize>) -> Budget {
        Budget {
            deadline,
            snapshot_memory,
            bounded: Default::default(),
        }
    }
}

/// [`check_quick_under`] of `p` under its own model.
fn check_quick(p: &Program, budget: &Budget) -> Option<Verdict> {
    check_quick_under(p, p.model, budget)
}

/// The verdict of `p` under `model` instead of its own, within `budget`:
/// `None` once its deadline has passed (inconclusive past it otherwise).
fn check_quick_under(p: &Program, model: duplex::Model, budget: &Budget) -> Option<Verdict> {
    let options = budget.options()?;
    let outcome = check::check(&compile_under(p, model), &options);
    if outcome.stats.stopped == Some(check::Bound::States) {
        budget
            .bounded
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
    Some(outcome.verdict)
}

/// Whether `lazy-connect=on` can change how `program` runs: some op is on
/// a communicator it leaves unconnected until first use (the world, a
/// declared communicator, a `shared` lane). Per-direction lanes are
/// connected at creation under either setting (`compile::lane_connected`),
/// so a per-direction program with no explicitly placed op compiles to the
/// same machine, and its check would repeat the first.
fn lazy_connect_matters(program: &Program) -> bool {
    // The policy's lanes under `lazy-connect=on`: the compiler's rule.
    !duplex::compile::lane_connected(program.policy, false)
        || program
            .threads
            .iter()
            .flat_map(|t| &t.body)
            .any(|s| s.p2ps().iter().any(P2p::is_explicit))
}

/// The hangs an `ok` program has under NCCL's contract (`eager=0`) or on
/// new communicators (`lazy-connect=on`); empty when it has none, or when
/// its own model already is that strict, or when the setting cannot change
/// how the program runs (every op on a per-direction lane). When both are
/// wanted they run at once, the first on a thread of its own (serially
/// where a thread cannot start).
pub fn latent(program: &Program, budget: &Budget) -> Vec<Latent> {
    let mut strict = program.model;
    strict.eager = Size(0);
    // New communicators under R6 as written: the strictest reading.
    let mut cold = program.model;
    cold.lazy_connect = true;
    cold.cold_mismatched_only = false;
    let wanted = [
        (program.model.eager.bytes() > 0).then_some((
            "eager",
            "eager=0B",
            "NCCL's contract: a send may wait for its recv",
            strict,
        )),
        (!program.model.lazy_connect && lazy_connect_matters(program)).then_some((
            "lazy-connect",
            "lazy-connect=on",
            "new communicators: first use connects, first message is a rendezvous",
            cold,
        )),
        (program.model.cold_mismatched_only
            && program.model.lazy_connect
            && program.model.eager.bytes() > 0)
            .then_some((
                "cold-channels",
                "cold-channels=rendezvous",
                "R6 as written from NVLink: every cold channel's first message is a rendezvous",
                // The program's model is already cold here: `cold` is it
                // under R6 as written.
                cold,
            )),
    ];
    let wanted: Vec<_> = wanted.iter().flatten().collect();
    let verdicts: Vec<_> = std::thread::scope(|scope| {
        // Every check but the last on a thread of its own; the last on
        // this one.
        let (last, others) = match wanted.split_last() {
            Some((last, others)) => (Some(last), others),
            None => (None, &[][..]),
        };
        let started: Vec<_> = others
            .iter()
            .map(|w| {
                let model = w.3;
                let run = std::thread::Builder::new()
                    .spawn_scoped(scope, move || check_quick_under(program, model, budget));
                (*w, run)
            })
            .collect();
        let here = last.map(|w| (*w, check_quick_under(program, w.3, budget)));
        started
            .into_iter()
            .map(|(w, run)| {
                let verdict = match run {
                    Ok(h) => h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)),
                    Err(_) => check_quick_under(program, w.3, budget),
                };
                (w, verdict)
            })
            .chain(here)
            .collect()
    });
    verdicts
        .into_iter()
        .filter_map(|((knob, setting, meaning, _), verdict)| match verdict {
            Some(Verdict::Deadlock { stuck, .. }) => Some(Latent {
                knob,
                setting: (*setting).into(),
                meaning,
                stuck: *stuck,
            }),
            _ => None,
        })
        .collect()
}

/// The most "let rank r receive before it sends" candidates [`repairs`]
/// tries, for the first ranks of the hang.
const MAX_SWAPS: usize = 8;

/// The command line set the program's policy (`duplex check --policy`),
/// which overrides the file's: an edit of the file's `policy` line changes
/// nothing then, so the policy repair is the flag.
#[derive(Clone, Copy, Debug, Default)]
pub struct PolicyFlag {
    /// The file's own `copy-from=` (which `--policy shared` set aside), or
    /// the command line's `--copy-from`: what `--policy per-direction`
    /// would check with.
    pub copy_from: Option<duplex::Size>,
}

/// The repairs of a program that can hang, each verified to make it `ok`.
/// `source` is the file's text (to place a `policy` line); `stuck` is the
/// hang found; `flag` says that the command line set the policy.
pub fn repairs(
    program: &Program,
    source: Option<&str>,
    stuck: &Stuck,
    budget: &Budget,
    flag: Option<&PolicyFlag>,
) -> Vec<Repair> {
    let mut candidates: Vec<(String, Program, Vec<Edit>)> = Vec::new();
    let lines = source.map(Lines::new);
    let lines = lines.as_ref();
    if program.policy == Policy::Shared {
        let mut p = program.clone();
        p.policy = Policy::PerDirection;
        let title = "give each direction its own lane (a communicator and a stream per ordered pair of ranks)";
        let (title, edits) = match flag {
            Some(flag) => {
                p.copy_from = flag.copy_from;
                (
                    format!(
                        "{title}: check it with `--policy per-direction` in place of the command line's `--policy shared`, which overrides the file's policy{}",
                        flag.copy_from
                            .map(|c| format!(" (ops of {c} and more then go on copy-engine lanes, as the file's `copy-from={c}` says)"))
                            .unwrap_or_default()
                    ),
                    Vec::new(),
                )
            }
            None => match policy_edit(source) {
                Some(edit) => (title.to_string(), vec![edit]),
                // The file says so already: the command line overrode it.
                None => (
                    format!(
                        "{title}: the file's `policy per-direction` does, once the command line's `--policy shared` no longer overrides it"
                    ),
                    Vec::new(),
                ),
            },
        };
        candidates.push((title, p, edits));
    }
    let ranks: Vec<u32> = {
        let mut r: Vec<u32> = stuck
            .ops
            .iter()
            .map(|o| o.rank)
            .chain(stuck.blocked.iter().map(|b| b.rank))
            .collect();
        r.sort_unstable();
        r.dedup();
        r
    };
    // Per rank of the hang: the first adjacent send/recv pair of plain,
    // one-line statements on one thread that starts at a pending op (the
    // op the rank is stuck at and the one after it), else the first that
    // ends at one.
    // (Sets, and one pass over the threads: a hang across thousands of
    // ranks made this loop quadratic, and more.)
    let pending_lines: HashSet<(u32, u32)> = stuck
        .ops
        .iter()
        .filter_map(|o| o.line.map(|l| (o.rank, l)))
        .collect();
    // Per rank of the hang, the pair of its first thread that has one.
    let mut first_pair: HashMap<u32, (usize, usize)> = HashMap::new();
    for (ti, t) in program.threads.iter().enumerate() {
        let rank = t.rank;
        if ranks.binary_search(&rank).is_err() || first_pair.contains_key(&rank) {
            continue;
        }
        let pending = |s: &Stmt| pending_lines.contains(&(rank, s.line.0));
        let opposite = |i: usize| {
            matches!((&t.body[i].kind, &t.body[i + 1].kind),
                (StmtKind::Op(x), StmtKind::Op(y)) if x.dir != y.dir)
        };
        let n = t.body.len().saturating_sub(1);
        let first = (0..n)
            .find(|&i| opposite(i) && pending(&t.body[i]))
            .or_else(|| (0..n).find(|&i| opposite(i) && pending(&t.body[i + 1])));
        if let Some(i) = first {
            first_pair.insert(rank, (ti, i));
        }
    }
    // (thread, first statement), in the order of the ranks
    let pairs: Vec<(usize, usize)> = ranks
        .iter()
        .filter_map(|r| first_pair.get(r).copied())
        .collect();
    if !pairs.is_empty() {
        let mut p = program.clone();
        let mut edits = Vec::new();
        for &(ti, i) in &pairs {
            let body = &mut p.threads[ti].body;
            let (a, b) = (body[i].clone(), body[i + 1].clone());
            let (StmtKind::Op(x), StmtKind::Op(y)) = (&a.kind, &b.kind) else {
                continue;
            };
            let group = StmtKind::Group(vec![x.clone(), y.clone()]);
            let (ta, tb) = (
                written(lines, a.line, &a.kind),
                written(lines, b.line, &b.kind),
            );
            edits.push(Edit::Replace {
                line: a.line.0,
                old: ta.clone(),
                new: format!("group {{ {ta}; {tb} }}"),
            });
            edits.push(Edit::Delete {
                line: b.line.0,
                old: tb,
            });
            body[i] = Stmt {
                kind: group,
                line: a.line,
            };
            body.remove(i + 1);
        }
        candidates.push((
            "group the send and the recv on each rank of the hang, so that neither waits for the other (R8)".into(),
            p,
            edits,
        ));
        // One candidate per rank, for the first ranks of the hang only:
        // each is a whole program to check, and a hang across thousands of
        // ranks would otherwise check thousands of them (minutes).
        for &(ti, i) in pairs.iter().take(MAX_SWAPS) {
            let mut p = program.clone();
            let t = &mut p.threads[ti];
            let (a, b) = (t.body[i].clone(), t.body[i + 1].clone());
            let first_is_send = matches!(&a.kind, StmtKind::Op(x) if x.dir == Dir::Send);
            if !first_is_send {
                continue; // receiving first already
            }
            t.body[i] = Stmt {
                kind: b.kind.clone(),
                line: a.line,
            };
            t.body[i + 1] = Stmt {
                kind: a.kind.clone(),
                line: b.line,
            };
            candidates.push((
                format!(
                    "let rank {} receive before it sends{}",
                    t.rank,
                    t.name
                        .as_ref()
                        .map(|n| format!(" (thread {n})"))
                        .unwrap_or_default()
                ),
                p,
                {
                    let (ta, tb) = (
                        written(lines, a.line, &a.kind),
                        written(lines, b.line, &b.kind),
                    );
                    vec![
                        Edit::Replace {
                            line: a.line.0,
                            old: ta.clone(),
                            new: tb.clone(),
                        },
                        Edit::Replace {
                            line: b.line.0,
                            old: tb,
                            new: ta,
                        },
                    ]
                },
            ));
        }
    }
    if let Some(c) = separate_comm(program, lines) {
        candidates.push(c);
    }
    candidates
        .into_iter()
        .filter(|(_, p, _)| matches!(check_quick(p, budget), Some(Verdict::Ok)))
        .map(|(title, _, mut edits)| {
            edits.sort_by_key(edit_line);
            Repair {
                title,
                edits,
                verdict: VerdictKind::Ok,
            }
        })
        .collect()
}

/// Applies `edits` (of one [`Repair`]) to a schedule file's text: what a
/// user does by hand, for tools and tests. A `Replace` keeps the line's
/// indentation and comment; an edit whose line does not hold its `old`
/// text is an error.
pub fn apply(source: &str, edits: &[Edit]) -> Result<String, String> {
    let mut lines: Vec<String> = source.lines().map(str::to_string).collect();
    let mut sorted = edits.to_vec();
    // Bottom up, so that earlier line numbers stay valid; at one line, a
    // replace or delete before an insert after it.
    sorted.sort_by_key(|e| std::cmp::Reverse((edit_line(e), matches!(e, Edit::Insert { .. }))));
    for e in &sorted {
        match e {
            Edit::Replace { line: 0, old, .. } | Edit::Delete { line: 0, old } => {
                return Err(format!("`{old}` has no line to edit"));
            }
            Edit::Replace { line, old, new } => {
                let l = lines
                    .get_mut(*line as usize - 1)
                    .ok_or_else(|| format!("line {line} does not exist"))?;
                if !l.contains(old.as_str()) {
                    return Err(format!("line {line} does not hold `{old}`: `{l}`"));
                }
                *l = l.replacen(old.as_str(), new, 1);
            }
            Edit::Delete { line, old } => {
                let i = *line as usize - 1;
                if !lines.get(i).is_some_and(|l| l.contains(old.as_str())) {
                    return Err(format!("line {line} does not hold `{old}`"));
                }
                lines.remove(i);
            }
            Edit::Insert { after, new } => {
                let i = (*after as usize).min(lines.len());
                lines.insert(i, new.clone());
            }
        }
    }
    let mut out = lines.join("\n");
    out.push('\n');
    Ok(out)
}

/// A file's lines by number, found without a vector of every line (a file
/// of 200 million blank lines took 5 GB that way) and without reading the
/// file from its start for each (which made the advice quadratic in the
/// ops it edits): a mark at the first line start after every 64 KiB, so
/// that finding a line reads at most 64 KiB and the line itself.
struct Lines<'a> {
    text: &'a str,
    /// (line number from 1, the byte where it starts), ascending.
    marks: Vec<(u32, usize)>,
}

impl<'a> Lines<'a> {
    const SPAN: usize = 64 << 10;

    fn new(text: &'a str) -> Lines<'a> {
        let mut marks = vec![(1, 0)];
        let mut line = 1u32;
        let mut next = Self::SPAN;
        for (i, b) in text.bytes().enumerate() {
            if b == b'\n' {
                line = line.saturating_add(1);
                if i + 1 >= next {
                    marks.push((line, i + 1));
                    next = i + 1 + Self::SPAN;
                }
            }
        }
        Lines { text, marks }
    }

    /// Line `n` (from 1) as [`str::lines`] gives it; `None` past the end.
    fn get(&self, n: u32) -> Option<&'a str> {
        let k = self
            .marks
            .partition_point(|(l, _)| *l <= n)
            .checked_sub(1)?;
        let (first, at) = self.marks[k];
        self.text[at..].lines().nth((n - first) as usize)
    }
}

/// The statement on `line` of the file as written (comment and
/// indentation dropped), else `fallback`.
fn written(lines: Option<&Lines<'_>>, line: Line, fallback: &StmtKind) -> String {
    lines
        .and_then(|s| s.get(line.0))
        .map(|l| l.split('#').next().unwrap_or("").trim().to_string())
        .filter(|l| !l.is_empty())
        .unwrap_or_else(|| fallback.to_string())
}

fn edit_line(e: &Edit) -> u32 {
    match e {
        Edit::Replace { line, .. } | Edit::Delete { line, .. } => *line,
        Edit::Insert { after, .. } => *after,
    }
}

/// The edit that sets `policy per-direction`: replaces the file's `policy`
/// line, or inserts one after `ranks`; `None` when the file's line says
/// so already (a `--policy` on the command line overrode it).
fn policy_edit(source: Option<&str>) -> Option<Edit> {
    // One pass, keeping no line but the `ranks` one's number.
    let mut after = None;
    for (i, l) in source.into_iter().flat_map(str::lines).enumerate() {
        // A byte-order mark, which the parser skips, is not text of the
        // first line.
        let l = if i == 0 {
            l.trim_start_matches('\u{feff}')
        } else {
            l
        };
        let l = l.split('#').next().unwrap_or("").trim();
        let n = u32::try_from(i + 1).unwrap_or(u32::MAX);
        if l.starts_with("policy") {
            if l.split_whitespace().eq(["policy", "per-direction"]) {
                return None;
            }
            return Some(Edit::Replace {
                line: n,
                old: l.to_string(),
                new: "policy per-direction".into(),
            });
        }
        if after.is_none() && l.starts_with("ranks") {
            after = Some(n);
        }
    }
    let after = after.unwrap_or(0);
    Some(Edit::Insert {
        after,
        new: "policy per-direction".into(),
    })
}

/// The communicator of an explicitly placed op (`comm=`, or `world` for
/// one that names only `stream=`); `None` for one the policy places.
fn explicit_comm(op: &P2p) -> Option<&str> {
    match (&op.comm, &op.stream) {
        (Some(c), _) => Some(c),
        (None, Some(_)) => Some("world"),
        (None, None) => None,
    }
}

/// For explicitly placed traffic between two ranks that shares one
/// communicator in both directions: a communicator and a stream of their
/// own for the direction from the higher rank to the lower.
fn separate_comm(
    program: &Program,
    lines: Option<&Lines<'_>>,
) -> Option<(String, Program, Vec<Edit>)> {
    // The first explicit communicator used in both directions by one pair.
    let mut uses: Vec<(&str, u32, u32)> = Vec::new(); // (comm, src, dst)
    for t in &program.threads {
        for s in &t.body {
            if let StmtKind::Op(op) = &s.kind
                && let Some(c) = explicit_comm(op)
            {
                let (src, dst) = match op.dir {
                    Dir::Send => (t.rank, op.peer),
                    Dir::Recv => (op.peer, t.rank),
                };
                uses.push((c, src, dst));
            }
        }
    }
    let used: HashSet<(&str, u32, u32)> = uses.iter().copied().collect();
    let (comm, a, b) = uses.iter().find_map(|&(c, s, d)| {
        used.contains(&(c, d, s))
            .then(|| (c.to_string(), s.min(d), s.max(d)))
    })?;
    let new_comm = format!("{comm}-{b}to{a}");
    if program.comms.iter().any(|c| c.name == new_comm) || new_comm.len() > MAX_WORD {
        return None;
    }
    let mut p = program.clone();
    let mut edits = Vec::new();
    for t in &mut p.threads {
        let rank = t.rank;
        for s in &mut t.body {
            let StmtKind::Op(op) = &s.kind else { continue };
            if explicit_comm(op) != Some(comm.as_str()) {
                continue;
            }
            let (src, dst) = match op.dir {
                Dir::Send => (rank, op.peer),
                Dir::Recv => (op.peer, rank),
            };
            if (src, dst) != (b, a) {
                continue;
            }
            let stream = format!("{}-{b}to{a}", op.stream.as_deref().unwrap_or("default"));
            if stream.len() > MAX_WORD {
                return None; // a name the edited file could not hold
            }
            let moved = P2p {
                comm: Some(new_comm.as_str().into()),
                stream: Some(stream.into()),
                ..op.clone()
            };
            let old = written(lines, s.line, &s.kind);
            s.kind = StmtKind::Op(moved);
            edits.push(Edit::Replace {
                line: s.line.0,
                old,
                new: s.kind.to_string(),
            });
        }
    }
    // Groups are left alone: a group holding this traffic makes the edit
    // more than a rename.
    let touches_group = p.threads.iter().any(|t| {
        t.body.iter().any(|s| {
            matches!(&s.kind, StmtKind::Group(ops) if ops.iter().any(|o| explicit_comm(o) == Some(comm.as_str())))
        })
    });
    if edits.is_empty() || touches_group {
        return None;
    }
    p.comms.push(CommDecl {
        name: new_comm.clone(),
        ranks: vec![a, b],
        line: Line(0),
    });
    let after = lines
        .and_then(|file| {
            file.text
                .lines()
                .enumerate()
                .filter(|(_, l)| {
                    let l = l.trim_start();
                    l.starts_with("comm ")
                        || l.starts_with("ranks")
                        || l.starts_with("policy")
                        || l.starts_with("model")
                })
                .map(|(i, _)| i as u32 + 1)
                .last()
        })
        .unwrap_or(0);
    edits.push(Edit::Insert {
        after,
        new: format!("comm {new_comm} {a} {b}"),
    });
    Some((
        format!(
            "give the traffic from rank {b} to rank {a} its own communicator and stream, apart from `{comm}`"
        ),
        p,
        edits,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Lines::get` gives what `str::lines().nth` does, across its marks,
    /// with `\r\n`, a last line with no newline, long lines and empty ones.
    #[test]
    fn lines_by_number_are_those_of_str_lines() {
        let long = "x".repeat(Lines::SPAN + 17);
        let mut text = String::new();
        for i in 0..40_000u32 {
            match i % 7 {
                0 => text.push('\n'),
                1 => text.push_str("  send 1 4KiB\r\n"),
                2 if i % 1_000 == 2 => {
                    text.push_str(&long);
                    text.push('\n');
                }
                _ => text.push_str(&format!("line {i}\n")),
            }
        }
        text.push_str("last, with no newline");
        for t in [text.as_str(), "", "\n", "a", "a\n\nb"] {
            let lines = Lines::new(t);
            let all: Vec<&str> = t.lines().collect();
            for n in 0..=all.len() as u32 + 2 {
                let want = n.checked_sub(1).and_then(|i| all.get(i as usize)).copied();
                assert_eq!(lines.get(n), want, "line {n}");
            }
        }
        assert!(Lines::new(&text).marks.len() > 10, "the text spans marks");
    }

    #[test]
    fn lazy_connect_matters_unless_every_op_is_on_a_per_direction_lane() {
        let matters =
            |src: &str| lazy_connect_matters(&duplex::schedule::parse(src).expect("valid"));
        let pair = "rank 0:\n  send 1 4KiB\nrank 1:\n  recv 0 4KiB\n";
        assert!(!matters(&format!("ranks 2\npolicy per-direction\n{pair}")));
        assert!(matters(&format!("ranks 2\npolicy shared\n{pair}")));
        assert!(matters(
            "ranks 2\npolicy per-direction\nrank 0:\n  group { send 1 4KiB; recv 1 4KiB comm=world }\nrank 1:\n  recv 0 4KiB\n  send 0 4KiB\n"
        ));
        // Where it matters, the advice checks it: two cold first sends
        // (R7) hang under lazy-connect=on on the world communicator.
        let cold = duplex::schedule::parse(
            "ranks 2\nmodel lazy-connect=off\nrank 0:\n  send 1 4KiB comm=world\n  recv 1 4KiB comm=world\nrank 1:\n  send 0 4KiB comm=world\n  recv 0 4KiB comm=world\n",
        )
        .expect("valid");
        assert!(
            latent(&cold, &Budget::default())
                .iter()
                .any(|l| l.knob == "lazy-connect"),
            "{:?}",
            latent(&cold, &Budget::default())
                .iter()
                .map(|l| l.knob)
                .collect::<Vec<_>>()
        );
    }

    fn stuck_of(src: &str) -> (Program, Stuck) {
        let p = duplex::schedule::parse(src).expect("valid");
        match check_quick(&p, &Budget::default()) {
            Some(Verdict::Deadlock { stuck, .. }) => (p, *stuck),
            other => panic!("expected a deadlock, got {other:?}"),
        }
    }

    /// Where a rank's pending op follows an op of the other direction,
    /// the pair to group or swap is the one that starts at the stuck op,
    /// not the one that ends at it (a review: only the lanes and one swap
    /// were offered, both grouping and rank 0's swap were missed).
    #[test]
    fn the_pair_repaired_starts_at_the_op_a_rank_is_stuck_at() {
        let src = "ranks 2\nrank 0:\n  send 1 4KiB\n  recv 1 4KiB\n  send 1 4KiB\n  recv 1 4KiB\nrank 1:\n  recv 0 4KiB\n  send 0 4KiB\n  send 0 4KiB\n  recv 0 4KiB\n";
        let (p, stuck) = stuck_of(src);
        let r = repairs(&p, Some(src), &stuck, &Budget::default(), None);
        let titles: Vec<&str> = r.iter().map(|r| r.title.as_str()).collect();
        assert!(
            titles.iter().any(|t| t.starts_with("group the send")),
            "{titles:?}"
        );
        assert!(
            titles.contains(&"let rank 0 receive before it sends"),
            "{titles:?}"
        );
        assert!(
            titles.contains(&"let rank 1 receive before it sends"),
            "{titles:?}"
        );
        let group = r.iter().find(|r| r.title.starts_with("group")).unwrap();
        assert!(
            matches!(group.edits[0], Edit::Replace { line: 5, .. }),
            "{:?}",
            group.edits
        );
    }

    #[test]
    fn the_seed_gets_lanes_grouping_and_a_reordered_rank_all_verified() {
        let src = "ranks 2\nrank 0:\n  send 1 4KiB\n  recv 1 4KiB\nrank 1:\n  send 0 4KiB\n  recv 0 4KiB\n";
        let (p, stuck) = stuck_of(src);
        let r = repairs(&p, Some(src), &stuck, &Budget::default(), None);
        let titles: Vec<&str> = r.iter().map(|r| r.title.as_str()).collect();
        assert!(titles.iter().any(|t| t.contains("own lane")), "{titles:?}");
        assert!(titles.iter().any(|t| t.contains("group")), "{titles:?}");
        assert!(
            titles.iter().any(|t| t.contains("receive before")),
            "{titles:?}"
        );
        let lanes = &r[0];
        assert_eq!(
            lanes.edits,
            vec![Edit::Insert {
                after: 1,
                new: "policy per-direction".into()
            }]
        );
        let group = r.iter().find(|r| r.title.contains("group")).expect("group");
        assert_eq!(group.edits.len(), 4, "{:?}", group.edits);
        assert_eq!(
            group.edits[0],
            Edit::Replace {
                line: 3,
                old: "send 1 4KiB".into(),
                new: "group { send 1 4KiB; recv 1 4KiB }".into()
            }
        );
    }

    #[test]
    fn a_hang_no_repair_fixes_gets_no_repair() {
        // A rank that sends to itself with no receive: no lane, group or
        // order helps, and nothing is suggested.
        let src = "ranks 2\nrank 0:\n  recv 1 4KiB\n  sync\n  send 1 4KiB\nrank 1:\n  recv 0 4KiB\n  sync\n  send 0 4KiB\n";
        let (p, stuck) = stuck_of(src);
        let r = repairs(&p, Some(src), &stuck, &Budget::default(), None);
        assert!(
            r.is_empty(),
            "per-direction does not fix recv; sync; send, and nothing else was tried: {:?}",
            r.iter().map(|r| &r.title).collect::<Vec<_>>()
        );
    }

    #[test]
    fn an_explicit_ring_gets_a_verified_grouping_or_a_separate_communicator() {
        let src = "ranks 2\ncomm c 0 1\nrank 0:\n  send 1 4KiB comm=c stream=s\n  recv 1 4KiB comm=c stream=s\nrank 1:\n  send 0 4KiB comm=c stream=s\n  recv 0 4KiB comm=c stream=s\n";
        let (p, stuck) = stuck_of(src);
        let r = repairs(&p, Some(src), &stuck, &Budget::default(), None);
        assert!(r.iter().any(|r| r.title.contains("group")), "{r:?}");
        assert!(r.iter().all(|r| r.verdict == VerdictKind::Ok));
        let own = r
            .iter()
            .find(|r| r.title.contains("own communicator"))
            .expect("a separate communicator and stream fixes it");
        assert!(
            own.edits
                .iter()
                .any(|e| matches!(e, Edit::Insert { after: 2, new } if new == "comm c-1to0 0 1")),
            "{own:?}"
        );
    }

    #[test]
    fn latent_hangs_behind_eager_capacity_and_warm_channels_are_found() {
        let eager = duplex::schedule::parse(
            "ranks 2\nmodel eager=64MiB\nrank 0:\n  send 1 4KiB\n  recv 1 4KiB\nrank 1:\n  send 0 4KiB\n  recv 0 4KiB\n",
        )
        .expect("valid");
        assert!(matches!(
            check_quick(&eager, &Budget::default()),
            Some(Verdict::Ok)
        ));
        let l = latent(&eager, &Budget::default());
        assert!(l.iter().any(|l| l.knob == "eager"), "{l:?}");
        assert!(l.iter().all(|l| !l.stuck.cycle.is_empty()));
        let strict = duplex::schedule::parse(
            "ranks 2\nrank 0:\n  send 1 4KiB\n  recv 1 4KiB\nrank 1:\n  recv 0 4KiB\n  send 0 4KiB\n",
        )
        .expect("valid");
        assert!(latent(&strict, &Budget::default()).is_empty());
    }

    /// A program that completes only because `cold-channels=mismatched`
    /// lets a cold channel set up by complementary calls buffer at once has
    /// a latent hang under R6 as written (`cold-channels=rendezvous`).
    #[test]
    fn a_program_ok_only_under_cold_channels_mismatched_has_a_latent_hang() {
        let file = include_str!("../../examples/r6-without-a-mismatched-round.sched");
        let mut p = duplex::schedule::parse(file).expect("valid");
        p.model.cold_mismatched_only = true;
        assert!(matches!(
            check_quick(&p, &Budget::default()),
            Some(Verdict::Ok)
        ));
        let l = latent(&p, &Budget::default());
        assert!(l.iter().any(|l| l.knob == "cold-channels"), "{l:?}");
        // Under the default there is nothing of the kind to say.
        p.model.cold_mismatched_only = false;
        assert!(
            latent(&p, &Budget::default())
                .iter()
                .all(|l| l.knob != "cold-channels")
        );
    }
}
