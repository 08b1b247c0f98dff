//! What `duplex check` prints: the verdict with its details, as text or as
//! one JSON object.

use std::fmt;

use duplex::{Model, Policy, ProgramErrorKind, Size};
use serde::Serialize;

use crate::advice::{self, Latent, Repair};
use crate::check::{Outcome, Stats, Step, Verdict};
use duplex::machine::{OpInfo, ProgramError, Stuck};
use duplex::report::counted;
use duplex::schedule::Program;

/// A text report shows this many first steps of a long interleaving…
const SHOWN_HEAD: usize = 20;
/// …and this many last ones.
const SHOWN_TAIL: usize = 30;

/// A check's report, ready to print as text (`Display`) or JSON (`Serialize`).
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// What the check decided.
    pub verdict: VerdictKind,
    /// The file checked.
    pub file: String,
    /// The policy it was checked under.
    pub policy: Policy,
    /// Under `per-direction`, the size from which ops went on copy-engine
    /// lanes ([`Report::copy_from`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub copy_from: Option<Size>,
    /// The model it was checked under.
    pub model: Model,
    /// For a deadlock: why it is stuck.
    #[serde(skip_serializing_if = "Option::is_none", flatten)]
    pub stuck: Option<Stuck>,
    /// For an error: what and which ops.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorReport>,
    /// For a deadlock or an error: the host steps that lead there (empty
    /// where the program is stuck or wrong before any step).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps: Option<Vec<Step>>,
    /// For a deadlock or an error: the schedule that replays it
    /// (`duplex check FILE --replay SCHEDULE`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub schedule: Option<String>,
    /// The command that replays it: the schedule, with the command line's
    /// overrides of the file's policy and model ([`Report::overridden`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replay: Option<String>,
    /// Whether this reports one replayed interleaving (`--replay`) rather
    /// than a search of all of them.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub replayed: bool,
    /// For an `ok` verdict: hangs that the model's eager capacity or warm
    /// channels hide ([`crate::advice::latent`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub latent: Vec<Latent>,
    /// For a deadlock: repairs the checker verified ([`crate::advice::repairs`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub repairs: Vec<Repair>,
    /// Whether the advice (repairs, latent hangs) ran out of the time the
    /// command was given before it had checked every candidate: what it
    /// lists is then what it verified in time, not all there is.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub advice_cut: bool,
    /// Whether some of the advice's checks gave up at their bound of
    /// branching states ([`crate::advice::CANDIDATE_STATES`]): what they
    /// would have shown is not listed.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub advice_bounded: bool,
    /// Whether the command fails this `ok` program for its latent hangs
    /// (`duplex check --deny-latent`): the verdict stays `ok`, the exit
    /// status is 1.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub latent_denied: bool,
    /// Search statistics.
    pub stats: Stats,
}

/// What a check decided. Serializes as `ok`, `deadlock`, `error`,
/// `inconclusive`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum VerdictKind {
    /// No interleaving hangs or errs.
    Ok,
    /// Some interleaving hangs.
    Deadlock,
    /// Some interleaving hits a program error.
    Error,
    /// The search hit its bound before it could decide.
    Inconclusive,
}

/// A program error as the report shows it.
#[derive(Clone, Debug, Serialize)]
pub struct ErrorReport {
    /// Which error.
    pub kind: ProgramErrorKind,
    /// The error in words.
    pub message: String,
    /// The ops involved.
    pub ops: Vec<OpInfo>,
}

impl From<&ProgramError> for ErrorReport {
    fn from(e: &ProgramError) -> Self {
        ErrorReport {
            kind: e.kind(),
            message: e.to_string(),
            ops: e.ops(),
        }
    }
}

/// `word` as one shell word: as it is when it needs no quoting, else in
/// single quotes (for commands a report prints to be run again).
pub fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:+,@%".contains(c));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// The command that replays `schedule` of `file` with the command line's
/// `flags`, each quoted as a shell word.
fn replay_command(file: &str, flags: &[String], schedule: &str) -> String {
    // A file name that starts with `-` would be taken for an option.
    let file = if file.starts_with('-') && file != "-" {
        format!("./{file}")
    } else {
        file.to_string()
    };
    let mut words = vec!["duplex".to_string(), "check".into(), shell_word(&file)];
    words.extend(flags.iter().map(|f| shell_word(f)));
    words.extend(["--replay".into(), schedule.to_string()]);
    words.join(" ")
}

impl Report {
    /// The same report, its replay command carrying `flags`: the command
    /// line's overrides of the file's policy and model (`--policy P`,
    /// `--eager S`, `--model KEY=VALUE`, each a separate word), without
    /// which the schedule would replay another program.
    pub fn overridden(mut self, flags: &[String]) -> Report {
        if let Some(schedule) = &self.schedule {
            self.replay = Some(replay_command(&self.file, flags, schedule));
        }
        self
    }

    /// Says that ops from `size` up went on copy-engine lanes (the
    /// program's `copy-from=`).
    pub fn copy_from(mut self, size: Option<Size>) -> Report {
        self.copy_from = size;
        self
    }

    /// The policy as a schedule file writes it.
    fn policy_text(&self) -> String {
        match self.copy_from {
            Some(c) => format!("{} copy-from={c}", self.policy),
            None => self.policy.to_string(),
        }
    }

    /// Builds the report of `outcome` for `file`.
    pub fn new(file: &str, policy: Policy, model: Model, outcome: &Outcome) -> Report {
        let (verdict, stuck, error, steps, schedule) = match &outcome.verdict {
            Verdict::Ok => (VerdictKind::Ok, None, None, None, None),
            Verdict::Inconclusive => (VerdictKind::Inconclusive, None, None, None, None),
            Verdict::Deadlock {
                stuck,
                trace,
                schedule,
            } => (
                VerdictKind::Deadlock,
                Some((**stuck).clone()),
                None,
                Some(trace.clone()),
                Some(schedule.to_string()),
            ),
            Verdict::Error {
                error,
                trace,
                schedule,
            } => (
                VerdictKind::Error,
                None,
                Some(error.into()),
                Some(trace.clone()),
                Some(schedule.to_string()),
            ),
        };
        let replay = schedule.as_ref().map(|s| replay_command(file, &[], s));
        Report {
            verdict,
            file: file.to_string(),
            policy,
            copy_from: None,
            model,
            stuck,
            error,
            steps,
            schedule,
            replay,
            replayed: false,
            latent: Vec::new(),
            repairs: Vec::new(),
            advice_cut: false,
            advice_bounded: false,
            latent_denied: false,
            stats: outcome.stats,
        }
    }

    /// Adds the advice of [`crate::advice`]: for a deadlock, the repairs
    /// the checker verified; for `ok`, the hangs a knob hides. `source` is
    /// the file's text, to place edits by line; `budget` bounds the
    /// advice's checks (what is left of a command's `--time-limit`), and
    /// [`Report::advice_cut`] says when it ran out. `flag` says that the
    /// command line set the policy ([`advice::PolicyFlag`]).
    pub fn advise(
        mut self,
        program: &Program,
        source: Option<&str>,
        budget: &advice::Budget,
        flag: Option<&advice::PolicyFlag>,
    ) -> Report {
        match (&self.verdict, &self.stuck) {
            (VerdictKind::Deadlock, Some(stuck)) => {
                self.repairs = advice::repairs(program, source, stuck, budget, flag);
                self.advice_cut = budget.spent();
                self.advice_bounded = budget.gave_up();
            }
            (VerdictKind::Ok, _) => {
                self.latent = advice::latent(program, budget);
                self.advice_cut = budget.spent();
                self.advice_bounded = budget.gave_up();
            }
            _ => {}
        }
        self
    }

    /// The report of one replayed interleaving.
    pub fn replayed(mut self) -> Report {
        self.replayed = true;
        self
    }

    /// The process exit status the format page gives this verdict: 0 for
    /// ok, 1 for a hang or an error, 3 when the search hit its bound.
    pub fn exit_code(&self) -> i32 {
        match self.verdict {
            VerdictKind::Ok => 0,
            VerdictKind::Inconclusive => 3,
            VerdictKind::Deadlock | VerdictKind::Error => 1,
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let headline = match self.verdict {
            VerdictKind::Ok if self.replayed => {
                "OK: this interleaving completes, with no hang and no program error"
            }
            VerdictKind::Deadlock if self.replayed => "DEADLOCK: this interleaving hangs",
            VerdictKind::Error if self.replayed => "ERROR: this interleaving hits a program error",
            VerdictKind::Ok => {
                "OK: no interleaving of the host threads can hang, and no program error was found"
            }
            VerdictKind::Deadlock => "DEADLOCK: this program can hang",
            VerdictKind::Error => "ERROR: this program has an error",
            VerdictKind::Inconclusive => {
                "INCONCLUSIVE: the search stopped at a bound before it could decide"
            }
        };
        writeln!(f, "{}: {headline}", self.file)?;
        writeln!(
            f,
            "  checked under policy {}, model {}",
            self.policy_text(),
            self.model
        )?;
        if let Some(e) = &self.error {
            writeln!(f)?;
            match e.ops.as_slice() {
                [send, recv] => {
                    let what = match e.kind {
                        ProgramErrorKind::SizeMismatch => {
                            "size mismatch (R3): these ops are matched (same channel, same position) but disagree on their size"
                        }
                        ProgramErrorKind::TypeMismatch => {
                            "type mismatch (R3): these ops are matched (same channel, same position) but disagree on their element type"
                        }
                        _ => {
                            "grouped on one side only (R8): these ops are matched, but only one of them is in a group"
                        }
                    };
                    writeln!(f, "{what}:")?;
                    writeln!(f, "  send: {send}")?;
                    writeln!(f, "  recv: {recv}")?;
                }
                [send] => {
                    writeln!(
                        f,
                        "message never received: it completed into the channel's buffer (R5) and no recv ever took it:"
                    )?;
                    writeln!(f, "  send: {send}")?;
                }
                _ => writeln!(f, "{}", e.message)?,
            }
        }
        if let Some(stuck) = &self.stuck {
            writeln!(f)?;
            write!(f, "{stuck}")?;
        }
        if self.steps.as_ref().is_some_and(Vec::is_empty) {
            writeln!(f)?;
            writeln!(
                f,
                "interleaving that leads there: none (reached before the first host step)"
            )?;
        }
        if let Some(steps) = self.steps.as_ref().filter(|s| !s.is_empty()) {
            writeln!(f)?;
            writeln!(
                f,
                "interleaving that leads there ({}):",
                counted(steps.len() as u64, "host step")
            )?;
            // A long interleaving shows its start and the steps into the
            // hang; all of them are in `--format json`.
            let n = steps.len();
            let (head, tail) = if n > SHOWN_HEAD + SHOWN_TAIL + 1 {
                (SHOWN_HEAD, SHOWN_TAIL)
            } else {
                (n, 0)
            };
            let line = |f: &mut fmt::Formatter<'_>, s: &Step| {
                writeln!(
                    f,
                    "  {:>3}. rank {} {}: {}",
                    s.step, s.rank, s.thread, s.action
                )
            };
            for s in &steps[..head] {
                line(f, s)?;
            }
            if tail > 0 {
                writeln!(
                    f,
                    "  … {} not shown (all of them: --format json; as a timeline: --trace FILE) …",
                    counted((n - head - tail) as u64, "host step")
                )?;
                for s in &steps[n - tail..] {
                    line(f, s)?;
                }
            }
        }
        if let Some(schedule) = &self.schedule {
            writeln!(f, "schedule: {schedule}")?;
            if let Some(replay) = &self.replay {
                writeln!(f, "replay it with: {replay}")?;
            }
        }
        for l in &self.latent {
            writeln!(f)?;
            writeln!(
                f,
                "LATENT HANG: ok under {}; deadlocks under {} ({}):",
                self.model, l.setting, l.meaning
            )?;
            write!(f, "{}", l.stuck)?;
        }
        if !self.repairs.is_empty() {
            writeln!(f)?;
            writeln!(
                f,
                "repairs the checker verified (each alone makes the program ok, with no new error):"
            )?;
            for (i, r) in self.repairs.iter().enumerate() {
                // A repair with no edit to the file (the command line
                // overrode it) says so in its title, without a colon.
                let colon = if r.edits.is_empty() { "" } else { ":" };
                writeln!(f, "  {}. {}{colon}", i + 1, r.title)?;
                for e in r.edits.iter().take(duplex::report::LISTED) {
                    writeln!(f, "       {e}")?;
                }
                duplex::report::more(f, "       ", r.edits.len(), "edits")?;
            }
        }
        if self.advice_cut {
            writeln!(f)?;
            writeln!(
                f,
                "the advice stopped at its time limit (--time-limit, or {} s without one): repairs and latent hangs it had not checked by then are not listed",
                advice::DEFAULT_SECONDS
            )?;
        }
        if self.latent_denied {
            writeln!(f)?;
            writeln!(
                f,
                "--deny-latent: the latent hangs above fail this check (exit status 1)"
            )?;
        }
        if self.advice_bounded {
            writeln!(f)?;
            writeln!(
                f,
                "the advice gave up on some checks at their bound of {} branching states: the repairs and latent hangs they would have shown are not listed",
                advice::CANDIDATE_STATES
            )?;
        }
        if self.verdict == VerdictKind::Inconclusive {
            let (bound, how) = match self.stats.stopped {
                Some(crate::check::Bound::Time) => ("its time limit", "--time-limit"),
                _ => ("its state bound", "--max-states"),
            };
            writeln!(
                f,
                "  it reached {bound} after {}, {} and {} (paths up to {} deep), in {:.1} s, with no hang or error found so far.",
                counted(self.stats.executions as u64, "execution"),
                counted(self.stats.transitions as u64, "host step"),
                counted(self.stats.states as u64, "branching state"),
                counted(self.stats.depth as u64, "decision"),
                self.stats.elapsed.as_secs_f64()
            )?;
            writeln!(
                f,
                "  to go further: raise {how}; or check a smaller schedule (fewer ranks, host threads or ops per thread: a hang usually shows in a few iterations of a loop)."
            )?;
        }
        writeln!(f)?;
        if self.replayed {
            return writeln!(
                f,
                "replayed {} in {:.3} s",
                counted(self.stats.transitions as u64, "host step"),
                self.stats.elapsed.as_secs_f64()
            );
        }
        writeln!(
            f,
            "searched {}, {}, {}, in {:.3} s",
            counted(self.stats.executions as u64, "execution"),
            counted(self.stats.transitions as u64, "host step"),
            counted(self.stats.states as u64, "branching state"),
            self.stats.elapsed.as_secs_f64()
        )?;
        if let Some(t) = self.stats.snapshots {
            let again = counted(t.replayed as u64, "host step");
            if t.kept_none {
                writeln!(
                    f,
                    "a snapshot of the state was larger than the snapshot memory (--snapshot-memory): it kept none, and took {again} again from the start"
                )?;
            } else if t.every == 1 {
                writeln!(
                    f,
                    "some snapshots of the state were larger than the snapshot memory (--snapshot-memory) and were not kept: it took {again} again"
                )?;
            } else {
                writeln!(
                    f,
                    "to stay within its snapshot memory (--snapshot-memory) it kept a snapshot at one decision point in {} at most, and took {again} again",
                    t.every,
                )?;
            }
        }
        Ok(())
    }
}

/// A DOT string literal.
fn dot_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The DOT id of an op.
fn op_id(o: &duplex::report::OpInfo) -> String {
    dot_str(&format!(
        "op:{}:{}:{}:{}:{}",
        o.rank,
        o.comm,
        o.op.name(),
        o.peer,
        o.fifo
    ))
}

/// The DOT id of a link's node.
fn node_id(n: &duplex::report::Node) -> Option<String> {
    match n {
        duplex::report::Node::Call { call } => {
            Some(dot_str(&format!("call:{}:{}", call.rank, call.thread)))
        }
        duplex::report::Node::Launch { ops } => ops.first().map(op_id),
        duplex::report::Node::Wait { rank, stream, .. } => {
            Some(dot_str(&format!("wait:{rank}:{stream}")))
        }
    }
}

impl Report {
    /// The stuck state as a Graphviz graph (`duplex check --format dot`):
    /// a cluster per rank holding a cluster per stream (its pending ops,
    /// labelled with their communicator) and the rank's blocked host calls;
    /// the wait-for cycle in red, each edge labelled with its rule; waits
    /// nothing will satisfy as dashed edges to a `never` node. A program
    /// that cannot hang is one labelled node.
    pub fn dot(&self) -> String {
        use std::collections::BTreeMap;
        use std::fmt::Write as _;
        let mut g = String::new();
        let title = format!(
            "{}: {} (policy {}, model {})",
            self.file,
            match self.verdict {
                VerdictKind::Ok => "ok",
                VerdictKind::Deadlock => "DEADLOCK",
                VerdictKind::Error => "ERROR",
                VerdictKind::Inconclusive => "inconclusive",
            },
            self.policy_text(),
            self.model
        );
        let _ = writeln!(g, "digraph duplex {{");
        let _ = writeln!(
            g,
            "  label={}; labelloc=t; fontname=Helvetica;",
            dot_str(&title)
        );
        let _ = writeln!(
            g,
            "  node [shape=box, style=rounded, fontname=Helvetica, fontsize=10];"
        );
        let _ = writeln!(g, "  edge [fontname=Helvetica, fontsize=9];");
        let Some(stuck) = &self.stuck else {
            let what = match (&self.verdict, &self.error) {
                (_, Some(e)) => e.message.clone(),
                (VerdictKind::Ok, _) => "no interleaving hangs".to_string(),
                _ => "the search did not decide".to_string(),
            };
            let _ = writeln!(g, "  verdict [label={}];", dot_str(&what));
            let _ = writeln!(g, "}}");
            return g;
        };
        // Every op of the picture: pending ones, and those of the links.
        let mut ops: BTreeMap<String, duplex::report::OpInfo> = BTreeMap::new();
        for o in &stuck.ops {
            ops.insert(op_id(o), o.clone());
        }
        let mut calls: BTreeMap<String, duplex::report::BlockedCall> = BTreeMap::new();
        for b in &stuck.blocked {
            calls.insert(dot_str(&format!("call:{}:{}", b.rank, b.thread)), b.clone());
        }
        let mut waits: BTreeMap<String, (u32, String, String)> = BTreeMap::new();
        for l in stuck.cycle.iter().chain(&stuck.missing) {
            match &l.what {
                duplex::report::Node::Launch { ops: o } => {
                    for op in o {
                        ops.entry(op_id(op)).or_insert_with(|| op.clone());
                    }
                }
                duplex::report::Node::Call { call } => {
                    calls
                        .entry(dot_str(&format!("call:{}:{}", call.rank, call.thread)))
                        .or_insert_with(|| call.clone());
                }
                duplex::report::Node::Wait { rank, stream, at } => {
                    waits.insert(
                        dot_str(&format!("wait:{rank}:{stream}")),
                        (*rank, stream.clone(), at.clone()),
                    );
                }
            }
        }
        let mut ranks: Vec<u32> = ops
            .values()
            .map(|o| o.rank)
            .chain(calls.values().map(|c| c.rank))
            .chain(waits.values().map(|w| w.0))
            .collect();
        ranks.sort_unstable();
        ranks.dedup();
        for r in ranks {
            let _ = writeln!(g, "  subgraph \"cluster_rank_{r}\" {{");
            let _ = writeln!(g, "    label=\"rank {r}\"; style=rounded; color=gray40;");
            for (id, c) in calls.iter().filter(|(_, c)| c.rank == r) {
                let label = format!("{}: `{}`\n{}", c.thread, c.call, c.at);
                let _ = writeln!(
                    g,
                    "    {id} [label={}, shape=ellipse, style=filled, fillcolor=lightyellow];",
                    dot_str(&label)
                );
            }
            let mut streams: Vec<&str> = ops
                .values()
                .filter(|o| o.rank == r)
                .map(|o| o.stream.as_str())
                .collect();
            streams.sort_unstable();
            streams.dedup();
            for s in streams {
                let _ = writeln!(
                    g,
                    "    subgraph {} {{",
                    dot_str(&format!("cluster_rank_{r}_{s}"))
                );
                let _ = writeln!(
                    g,
                    "      label={}; style=dashed;",
                    dot_str(&format!("stream {s}"))
                );
                for (id, o) in ops.iter().filter(|(_, o)| o.rank == r && o.stream == s) {
                    let label = format!(
                        "{} {} {} ({}), {}\ncomm {}, message #{}\n{}",
                        o.op.name(),
                        if o.op == duplex::Dir::Send {
                            "→"
                        } else {
                            "←"
                        },
                        o.peer,
                        duplex::Size(o.bytes),
                        o.at,
                        o.comm,
                        o.fifo,
                        o.state
                    );
                    let _ = writeln!(g, "      {id} [label={}];", dot_str(&label));
                }
                let _ = writeln!(g, "    }}");
            }
            for (id, (_, s, at)) in waits.iter().filter(|(_, w)| w.0 == r) {
                let label = format!("wait on stream {s}\n{at}");
                let _ = writeln!(g, "    {id} [label={}, shape=hexagon];", dot_str(&label));
            }
            let _ = writeln!(g, "  }}");
        }
        let n = stuck.cycle.len();
        for (i, l) in stuck.cycle.iter().enumerate() {
            let next = &stuck.cycle[(i + 1) % n];
            if let (Some(a), Some(b)) = (node_id(&l.what), node_id(&next.what)) {
                let _ = writeln!(
                    g,
                    "  {a} -> {b} [label={}, tooltip={}, color=red, fontcolor=red, penwidth=2];",
                    dot_str(l.rule.name()),
                    dot_str(&l.waits_for)
                );
            }
        }
        if !stuck.missing.is_empty() {
            let _ = writeln!(
                g,
                "  never [label=\"never issued\", shape=octagon, color=red];"
            );
            for l in &stuck.missing {
                if let Some(a) = node_id(&l.what) {
                    let _ = writeln!(
                        g,
                        "  {a} -> never [label={}, tooltip={}, style=dashed, color=red];",
                        dot_str(l.rule.name()),
                        dot_str(&l.waits_for)
                    );
                }
            }
        }
        let _ = writeln!(g, "}}");
        g
    }
}
