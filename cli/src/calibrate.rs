//! `duplex calibrate DIR`: measures the eager capacity of this machine's
//! NCCL (R5), runs every schedule file of DIR on the GPUs, and compares each
//! real outcome with `duplex check`'s verdict under the model fitted to
//! the machine.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use duplex::{Dir, Error, Model, Policy, Size, Transport};
use duplex_nccl::{Local, NcclRank};
use duplex_sim::check;

use crate::failure::Failure;
use crate::run::{Launch, Ran, on_nccl_isolated};

/// One probe of the eager capacity.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Probe {
    /// Messages sent back to back.
    pub(crate) messages: u32,
    /// Bytes of each.
    pub(crate) bytes: u64,
    /// True when every send completed before any recv was posted.
    pub(crate) completed_alone: bool,
}

/// The measured capacity: the largest total that completed without a recv,
/// and the smallest that did not. (R6, cold channels, is measured by the
/// examples that run the same exchange on cold and warm communicators.)
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Capacity {
    pub(crate) probes: Vec<Probe>,
    pub(crate) fits: u64,
    pub(crate) waits: Option<u64>,
}

impl Capacity {
    /// Where the probes contradict one capacity (R5 has one per channel),
    /// in words for the reports: a total waited that is no larger than one
    /// that completed alone (seen over loopback sockets, whose capacity
    /// varies from run to run). Empty when the probes agree.
    pub(crate) fn contradiction(&self) -> String {
        match self.waits {
            Some(w) if w <= self.fits => format!(
                " (contradictory: {} waited where {} completed alone, so no one capacity fits these probes: R5's fixed capacity does not hold for this run)",
                Size(w),
                Size(self.fits)
            ),
            _ => String::new(),
        }
    }
}

/// One example's row.
#[derive(Clone, Debug, serde::Serialize)]
pub(crate) struct Row {
    pub(crate) file: String,
    pub(crate) real: Ran,
    pub(crate) predicted: &'static str,
    pub(crate) agrees: &'static str,
    /// The checker's verdict under `cold-channels=mismatched` (R6 as the
    /// socket measurements fit), where it differs from `predicted`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) predicted_mismatched_only: Option<&'static str>,
}

const SIZES: &[(u32, u64)] = &[
    (1, 4 << 10),
    (1, 1 << 20),
    (1, 16 << 20),
    (1, 32 << 20),
    (1, 48 << 20),
    (1, 64 << 20),
    (1, 80 << 20),
    (1, 96 << 20),
    (1, 128 << 20),
    (1, 256 << 20),
    (2, 16 << 20),
    (4, 16 << 20),
    (5, 16 << 20),
    (6, 16 << 20),
    (8, 16 << 20),
    (2, 32 << 20),
    (2, 48 << 20),
    (2, 64 << 20),
];

/// Rank 0 sends `messages` x `bytes` on its lane and waits up to 300 ms for
/// them to complete with no recv posted; then tells rank 1 to receive.
fn probe(t: &NcclRank, messages: u32, bytes: u64, tag: &str) -> duplex::Result<bool> {
    let n = bytes as usize;
    if t.rank() == 0 {
        let bufs = (0..messages)
            .map(|_| t.alloc::<u8>(n))
            .collect::<duplex::Result<Vec<_>>>()?;
        for b in &bufs {
            t.send(b, 1)?;
        }
        let lane = t.lane(1, Dir::Send)?;
        let alone = t.try_sync(&lane.stream, Duration::from_millis(300))?;
        t.notify(1, tag)?;
        t.synchronize()?;
        Ok(alone)
    } else {
        let mut bufs = (0..messages)
            .map(|_| t.alloc::<u8>(n))
            .collect::<duplex::Result<Vec<_>>>()?;
        t.await_notify(0, tag)?;
        for b in bufs.iter_mut() {
            t.recv(b, 0)?;
        }
        t.synchronize()?;
        Ok(false)
    }
}

/// Every probe, in order, on rank `t`; rank 0 pushes its findings.
fn probes(t: &NcclRank, results: &std::sync::Mutex<Vec<Probe>>) -> duplex::Result<()> {
    for (i, (m, b)) in SIZES.iter().enumerate() {
        let alone = probe(t, *m, *b, &format!("p{i}"))?;
        if t.rank() == 0 {
            results
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(Probe {
                    messages: *m,
                    bytes: *b,
                    completed_alone: alone,
                });
        }
    }
    t.synchronize()
}

/// Measures the eager capacity on warm per-direction lanes, a thread per
/// rank.
pub(crate) fn capacity(timeout: Duration) -> Result<Capacity, Error> {
    let results = std::sync::Mutex::new(Vec::new());
    Local::new(2)?
        .policy(Policy::PerDirection)
        .timeout(timeout)
        .run(|t| probes(t, &results))?;
    Ok(fitted(results.into_inner().unwrap_or_default()))
}

/// `duplex calibrate --capacity-rank`: this process's part of the capacity
/// probes as one rank of a job of two ([`capacity_of_processes`]); rank 0's
/// report is `{"capacity": ...}`, the other's `{"outcome": "ok"}`.
pub(crate) fn capacity_rank(timeout: Duration) -> Result<serde_json::Value, Failure> {
    let process = duplex_nccl::Process::from_env()
        .map_err(|e| Failure::invalid("environment", e.to_string()))?
        .policy(Policy::PerDirection)
        .timeout(timeout);
    let results = std::sync::Mutex::new(Vec::new());
    let rank = process.rank();
    match process.run(|t| probes(t, &results)) {
        Ok(_) if rank == 0 => Ok(serde_json::json!({
            "capacity": fitted(results.into_inner().unwrap_or_default())
        })),
        Ok(_) => Ok(serde_json::json!({"outcome": "ok"})),
        Err(e @ Error::Unavailable { .. }) => Err(Failure::unavailable(e.to_string())),
        Err(e) => Err(Failure::failed(format!("rank {rank}: {e}"))),
    }
}

/// Measures the eager capacity with a process per rank (`launch`), each
/// running `duplex calibrate DIR --capacity-rank`.
fn capacity_of_processes(
    dir: &Path,
    timeout: Duration,
    one_gpu: bool,
) -> Result<Capacity, Failure> {
    let args: Vec<String> = [
        "calibrate".to_string(),
        dir.display().to_string(),
        "--capacity-rank".to_string(),
        "--timeout-ms".to_string(),
        timeout.as_millis().to_string(),
    ]
    .to_vec();
    let reports = crate::run::spawn_job(&args, 2, timeout, one_gpu)
        .map_err(|(_, why)| Failure::unavailable(why))?;
    // A rank that could not start (no NCCL, no GPU of its own) is the
    // answer, whatever the others said of it.
    for (rank, report) in reports.iter().enumerate() {
        if let Ok(r) = report
            && r["outcome"] == "unavailable"
        {
            return Err(Failure::unavailable(format!(
                "rank {rank}: {}",
                r["error"]["message"].as_str().unwrap_or("unavailable")
            )));
        }
    }
    let mut capacity = None;
    for (rank, report) in reports.into_iter().enumerate() {
        let failed = |why: String| {
            Failure::failed(format!(
                "measuring the eager capacity failed on rank {rank}: {why}"
            ))
        };
        let report = report.map_err(failed)?;
        if let Some(c) = report.get("capacity") {
            capacity = Some(
                serde_json::from_value::<Capacity>(c.clone())
                    .map_err(|e| failed(format!("its report cannot be read: {e}")))?,
            );
        } else if report["outcome"] != "ok" {
            return Err(failed(
                report["error"]["message"]
                    .as_str()
                    .map_or_else(|| report.to_string(), str::to_string),
            ));
        }
    }
    capacity.ok_or_else(|| Failure::unavailable("rank 0 reported no capacity".to_string()))
}

/// The model fitted to this machine, from a file's `model`: its measured
/// capacity, kernels in progress at once without bound, communicator
/// order, and one-sided grouping accepted (all measured in
/// docs/semantics.md); the file keeps whether its communicators are used
/// cold. The table's verdict is R6 as written (`cold-channels` is
/// `rendezvous`; the other value's verdict is beside it). The one
/// statement of it: the verdicts, the NCCL runs' settings
/// ([`fitted_settings`]) and the table's header use it.
pub(crate) fn fitted_model(file: duplex::Model, cap: &Capacity) -> duplex::Model {
    duplex::Model {
        eager: Size(cap.fits),
        kernels: None,
        comm_order: true,
        one_sided_groups: true,
        cold_mismatched_only: false,
        ..file
    }
}

/// The `--model` settings that give a run on NCCL the fitted model's
/// capacity and grouping ([`fitted_model`]; the rest are the backend's
/// defaults or the file's).
fn fitted_settings(cap: &Capacity) -> [String; 2] {
    let m = fitted_model(duplex::Model::default(), cap);
    [
        format!("eager={}", m.eager),
        format!(
            "one-sided-groups={}",
            if m.one_sided_groups {
                "accept"
            } else {
                "error"
            }
        ),
    ]
}

/// The capacity fitted to `probes`.
fn fitted(probes: Vec<Probe>) -> Capacity {
    let fits = probes
        .iter()
        .filter(|p| p.completed_alone)
        .map(|p| p.bytes * u64::from(p.messages))
        .max()
        .unwrap_or(0);
    let waits = probes
        .iter()
        .filter(|p| !p.completed_alone)
        .map(|p| p.bytes * u64::from(p.messages))
        .min();
    Capacity {
        probes,
        fits,
        waits,
    }
}

/// The checker's verdict on `program`, and whether the hang it found goes
/// through a connection set up from mismatched calls (R7), after which
/// NCCL may fail instead of hanging.
fn verdict(program: &duplex::schedule::Program) -> (&'static str, bool) {
    let p = predict(program);
    (p.verdict, p.mismatched)
}

/// The checker's verdict on a program, as calibration compares it.
struct Predicted {
    verdict: &'static str,
    /// The hang goes through a connection set up from mismatched calls.
    mismatched: bool,
    /// For an error: its kind as `duplex run --format json` spells it
    /// (`size-mismatch`, ...).
    error: Option<serde_json::Value>,
}

fn predict(program: &duplex::schedule::Program) -> Predicted {
    let outcome = check::check(
        &duplex::compile::compile(program),
        &check::Options::default(),
    );
    let mismatched = match &outcome.verdict {
        check::Verdict::Deadlock { stuck, .. } => !stuck.mismatched_setups.is_empty(),
        _ => false,
    };
    let error = match &outcome.verdict {
        check::Verdict::Error { error, .. } => serde_json::to_value(error.kind()).ok(),
        _ => None,
    };
    Predicted {
        verdict: outcome.verdict.kind(),
        mismatched,
        error,
    }
}

/// Whether a run's failure is NCCL's or CUDA's own error (not a process
/// killed at its limit, say), which the backend explained by a connection
/// set up from mismatched calls (R7).
fn explained_by_a_mismatched_round(real: &Ran) -> bool {
    real.error.as_ref().is_some_and(|e| {
        e["kind"] == "library"
            && e["message"]
                .as_str()
                .is_some_and(|m| m.contains(duplex_nccl::MISMATCHED_SETUP))
    })
}

/// Whether a real outcome agrees with the checker's verdict, in words:
/// `yes`, `consistent: ...` (the outcome is one the model allows for
/// it), `not run: ...` (the run could not start here), or `no...`/`NO`.
/// With the predicted error's kind (`predicted_error`) for a program the
/// checker finds an error in. The same outcome agrees only
/// when the run says no more than the model: a run the live model refused
/// a call of, a hang whose replay the model disagrees with or names no
/// cycle in, or an error of another kind, is no agreement. A run that
/// completed where the checker found a hang is consistent only where the
/// model lets some interleaving complete too (`completes`: a seed of the
/// simulator on which the program completes, [`completing_seed`]).
fn agreement(
    predicted: &str,
    mismatched: bool,
    predicted_error: Option<&serde_json::Value>,
    real: &Ran,
    completes: Option<u64>,
) -> &'static str {
    match (predicted, real.outcome.as_str()) {
        _ if real.model_refused.is_some() => {
            "no: the run completed, but the live model refused one of its calls (below)"
        }
        ("deadlock", "deadlock") => {
            let hang = real.hang.as_ref();
            let disagrees = hang
                .and_then(|h| h.get("disagreements"))
                .and_then(serde_json::Value::as_array)
                .is_some_and(|d| !d.is_empty());
            let named = |k: &str| {
                hang.and_then(|h| h["stuck"][k].as_array())
                    .is_some_and(|a| !a.is_empty())
            };
            if disagrees {
                "no: it hung, but the model refuses calls the run made (below)"
            } else if hang.is_some() && !named("cycle") && !named("missing") {
                "no: it hung, but the model's replay of the run names no cycle (below)"
            } else {
                "yes"
            }
        }
        ("error", "error") => match (predicted_error, real.error.as_ref().map(|e| &e["kind"])) {
            (Some(p), Some(r)) if p != r => "no: an error of another kind (below)",
            _ => "yes",
        },
        (p, r) if p == r => "yes",
        (_, "unavailable") => "not run: the run could not start with this launch (below)",
        ("deadlock", "ok") if completes.is_some() => {
            "consistent: the hang needs an interleaving this run did not take (the model completes it in others)"
        }
        ("deadlock", "crash") if mismatched && explained_by_a_mismatched_round(real) => {
            "consistent: NCCL failed on a connection the model finds set up from mismatched calls (R7), where it may fail instead of hanging"
        }
        ("deadlock", "crash") => "no: NCCL failed instead of hanging (see below)",
        _ => "NO",
    }
}

/// Random schedules of the simulator [`completing_seed`] tries.
const COMPLETION_SEEDS: u64 = 32;

/// The first of the simulator's random schedules (seeds below
/// [`COMPLETION_SEEDS`]) on which `program` completes: evidence that the
/// model lets some interleaving of its host threads complete, which a run
/// on the GPUs that completed where the checker found a hang needs to be
/// consistent with it. `None` when none of them completes.
fn completing_seed(program: &duplex::schedule::Program) -> Option<u64> {
    (0..COMPLETION_SEEDS).find(|&seed| crate::run::on_sim(program, seed, "").outcome == "ok")
}

/// Runs every `.sched` file of `dir` and builds the table. Every file is
/// read and parsed before the GPUs are touched: an invalid one is refused
/// (exit status 2) without a measurement; no NCCL or too few GPUs is exit
/// status 4.
pub(crate) fn calibrate(
    dir: &Path,
    timeout: Duration,
    launch: Launch,
) -> Result<Calibration, Failure> {
    let shown = dir.display().to_string();
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| {
            Failure::invalid("read", format!("cannot read {shown}: {e}")).at(&shown, None)
        })?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "sched"))
        .collect();
    files.sort();
    if files.is_empty() {
        // An empty table would read as "every example agrees".
        return Err(Failure::invalid(
            "read",
            format!("{shown} holds no .sched files: nothing to calibrate (give the folder of the examples, e.g. `duplex calibrate examples`)"),
        )
        .at(&shown, None));
    }
    let mut programs = Vec::new();
    for f in files {
        let path = f.display().to_string();
        let program = crate::load(&path)?;
        let name = f
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        programs.push((f, name, program));
    }
    let measuring = |e: Error| match e {
        Error::Unavailable { .. } => Failure::unavailable(e.to_string()),
        e => Failure::failed(format!("measuring the eager capacity failed: {e}")),
    };
    let cap = match launch {
        Launch::Threads => {
            // Nothing can run without NCCL, a CUDA driver and two GPUs.
            Local::new(2).map_err(|e| Failure::unavailable(e.to_string()))?;
            capacity(timeout).map_err(measuring)?
        }
        Launch::Processes { one_gpu } => capacity_of_processes(dir, timeout, one_gpu)?,
    };
    say!(
        "eager capacity: {} completes alone, {} waits{}",
        Size(cap.fits),
        cap.waits
            .map(|w| Size(w).to_string())
            .unwrap_or("nothing".into()),
        cap.contradiction()
    );
    let mut rows = Vec::new();
    for (f, name, mut program) in programs {
        // The run on NCCL gets the same model, so that duplex-nccl
        // launches what the fitted model accepts instead of refusing it.
        program.model = fitted_model(program.model, &cap);
        let Predicted {
            verdict: predicted,
            mismatched,
            error: predicted_error,
        } = predict(&program);
        let alternative = {
            let mut p = program.clone();
            p.model.cold_mismatched_only = true;
            Some(verdict(&p).0).filter(|v| *v != predicted)
        };
        say!("running {name} (predicted {predicted})");
        let real = on_nccl_isolated(&f, timeout, &fitted_settings(&cap), launch);
        // Only where it matters: a hang predicted, a completion seen, on a
        // program whose threads can interleave.
        let many_threads = program.threads.iter().any(|t| t.name.is_some());
        let completes = (predicted == "deadlock" && real.outcome == "ok" && many_threads)
            .then(|| completing_seed(&program))
            .flatten();
        let agrees = agreement(
            predicted,
            mismatched,
            predicted_error.as_ref(),
            &real,
            completes,
        );
        say!("  real {} in {:.2} s: {agrees}", real.outcome, real.seconds);
        rows.push(Row {
            file: name,
            real,
            predicted,
            agrees,
            predicted_mismatched_only: alternative,
        });
    }
    Ok(Calibration { cap, rows, launch })
}

/// Whether a row counts against the calibration (exit status 1): it
/// disagrees, or it could not run with this launch (which says nothing of
/// the model either way, and so cannot pass).
pub(crate) fn counts_against(row: &Row) -> bool {
    row.agrees == "NO" || row.agrees.starts_with("no:") || row.agrees.starts_with("not run")
}

/// What `duplex calibrate` found.
pub(crate) struct Calibration {
    /// How the ranks ran.
    pub launch: Launch,
    /// The eager capacity measured.
    pub cap: Capacity,
    /// Every example run, with the checker's verdict.
    pub rows: Vec<Row>,
}

/// The table as Markdown.
pub(crate) fn markdown(cal: &Calibration, model: &Model) -> String {
    let (cap, rows) = (&cal.cap, &cal.rows);
    let mut s = String::new();
    let _ = writeln!(s, "Ranks ran as {}.\n", cal.launch.describe());
    let _ = writeln!(s, "## Eager capacity (R5, R6), measured\n");
    let _ = writeln!(
        s,
        "| messages | bytes each | completed with no recv posted |\n|---|---|---|"
    );
    for p in &cap.probes {
        let _ = writeln!(
            s,
            "| {} | {} | {} |",
            p.messages,
            Size(p.bytes),
            if p.completed_alone {
                "yes"
            } else {
                "no (waited)"
            }
        );
    }
    let _ = writeln!(
        s,
        "\nFitted: eager={} (largest total that completed alone; smallest that waited: {}){}.\n",
        Size(cap.fits),
        cap.waits
            .map(|w| Size(w).to_string())
            .unwrap_or("none".into()),
        cap.contradiction(),
    );
    let _ = writeln!(
        s,
        "## Every example on the GPUs vs `duplex check` (model {model}; lazy-connect as each file sets it)\n"
    );
    let _ = writeln!(
        s,
        "| example | real outcome | time (s) | checker | agree |\n|---|---|---|---|---|"
    );
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {:.2} | {} | {} |",
            r.file, r.real.outcome, r.real.seconds, r.predicted, r.agrees
        );
    }
    let agree = rows
        .iter()
        .filter(|r| r.agrees == "yes" || r.agrees.starts_with("consistent"))
        .count();
    let not_run = rows
        .iter()
        .filter(|r| r.agrees.starts_with("not run"))
        .count();
    let _ = write!(s, "\n{agree} of {} examples agree", rows.len());
    let _ = writeln!(
        s,
        "{}.",
        if not_run > 0 {
            format!("; {not_run} could not run with this launch")
        } else {
            String::new()
        }
    );
    // Which R6 the GPUs side with: the rows whose verdict the knob changes.
    let r6: Vec<&Row> = rows
        .iter()
        .filter(|r| r.predicted_mismatched_only.is_some())
        .collect();
    if !r6.is_empty() {
        let _ = writeln!(
            s,
            "\n## R6: `cold-channels=rendezvous` (the default) or `mismatched`\n\n| example | real outcome | rendezvous | mismatched |\n|---|---|---|---|"
        );
        for r in &r6 {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} |",
                r.file,
                r.real.outcome,
                r.predicted,
                r.predicted_mismatched_only.unwrap_or(r.predicted)
            );
        }
    }
    for r in rows
        .iter()
        .filter(|r| r.agrees != "yes" && !r.real.detail.is_empty())
    {
        let first: Vec<&str> = r.real.detail.lines().take(2).collect();
        let _ = writeln!(s, "\n- {}: {}", r.file, first.join(" "));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example(name: &str) -> duplex::schedule::Program {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../examples")
            .join(name);
        let text = std::fs::read_to_string(&path).expect("the example");
        duplex::schedule::parse(&text).expect("it parses")
    }

    fn real(outcome: &str) -> Ran {
        serde_json::from_value(serde_json::json!({
            "outcome": outcome, "seconds": 1.0, "detail": ""
        }))
        .expect("a run")
    }

    /// The same outcome is no agreement where the run says more than the
    /// model: a call the live model refused, a hang whose replay it
    /// disagrees with or that names no cycle, an error of another kind.
    #[test]
    fn the_same_outcome_agrees_only_where_the_run_says_no_more() {
        let mut ok = real("ok");
        assert_eq!(agreement("ok", false, None, &ok, None), "yes");
        ok.model_refused = Some("the model refused `send` (x:1) of thread 0".into());
        assert!(agreement("ok", false, None, &ok, None).starts_with("no:"));
        let hung = |hang: serde_json::Value| Ran {
            hang: Some(hang),
            ..real("deadlock")
        };
        let cycle = serde_json::json!({"stuck": {"cycle": [{"rank": 0}], "missing": []}});
        assert_eq!(
            agreement("deadlock", false, None, &hung(cycle), None),
            "yes"
        );
        let missing = serde_json::json!({"stuck": {"cycle": [], "missing": [{"rank": 1}]}});
        assert_eq!(
            agreement("deadlock", false, None, &hung(missing), None),
            "yes"
        );
        let none = serde_json::json!({"stuck": {"cycle": [], "missing": []}});
        let a = agreement("deadlock", false, None, &hung(none), None);
        assert!(a.starts_with("no:") && a.contains("no cycle"), "{a}");
        let refused = serde_json::json!({
            "stuck": {"cycle": [{"rank": 0}], "missing": []},
            "disagreements": [{"call": "send", "why": "..."}]
        });
        let a = agreement("deadlock", false, None, &hung(refused), None);
        assert!(a.starts_with("no:") && a.contains("refuses"), "{a}");
        // An error of the predicted kind, and of another.
        let size = serde_json::to_value(duplex::ProgramErrorKind::SizeMismatch).expect("json");
        let failed = |kind: &str| Ran {
            error: Some(serde_json::json!({"kind": kind, "message": "..."})),
            ..real("error")
        };
        assert_eq!(size, serde_json::json!("size-mismatch"));
        assert_eq!(
            agreement("error", false, Some(&size), &failed("size-mismatch"), None),
            "yes"
        );
        let a = agreement("error", false, Some(&size), &failed("aborted"), None);
        assert!(a.starts_with("no:"), "{a}");
        // Each counts against the calibration.
        let row = Row {
            file: "x.sched".into(),
            real: real("error"),
            predicted: "error",
            agrees: a,
            predicted_mismatched_only: None,
        };
        assert!(counts_against(&row));
    }

    /// A run that completed where the checker found a hang is consistent
    /// only where the model completes the program in some interleaving
    /// too: `seed-rpc` (two threads a rank) completes on some schedule of
    /// the simulator; the seed with its threads named hangs in every one.
    #[test]
    fn a_completion_is_consistent_with_a_hang_only_where_the_model_completes_too() {
        // `seed-rpc.sched` with 4 KiB messages (its 256 MiB take a minute
        // of the debug build's simulator).
        let mut rpc = example("seed-rpc.sched");
        for t in &mut rpc.threads {
            for st in &mut t.body {
                if let duplex::schedule::StmtKind::Op(op) = &mut st.kind {
                    op.size = Size(4096);
                }
            }
        }
        assert_eq!(verdict(&rpc).0, "deadlock");
        let seed = completing_seed(&rpc);
        assert!(seed.is_some(), "seed-rpc completes on some schedule");
        assert!(agreement("deadlock", false, None, &real("ok"), seed).starts_with("consistent"));
        let always = duplex::schedule::parse(
            "ranks 2\nrank 0 thread a:\n  send 1 4KiB\n  recv 1 4KiB\nrank 1 thread b:\n  send 0 4KiB\n  recv 0 4KiB\n",
        )
        .expect("parses");
        assert_eq!(verdict(&always).0, "deadlock");
        assert_eq!(completing_seed(&always), None);
        assert_eq!(agreement("deadlock", false, None, &real("ok"), None), "NO");
    }

    /// Probes that no one capacity fits are said, not fitted in silence.
    #[test]
    fn contradictory_probes_are_said() {
        let probe = |bytes: u64, completed_alone| Probe {
            messages: 1,
            bytes,
            completed_alone,
        };
        let agree = fitted(vec![probe(1 << 20, true), probe(16 << 20, false)]);
        assert_eq!(agree.contradiction(), "");
        let contra = fitted(vec![probe(16 << 20, true), probe(8 << 20, false)]);
        let said = contra.contradiction();
        assert!(
            said.contains("contradictory") && said.contains("8MiB"),
            "{said}"
        );
    }

    #[test]
    fn the_table_says_which_r6_the_gpus_side_with() {
        let row = |file: &str, outcome: &str, predicted, alt| Row {
            file: file.into(),
            real: real(outcome),
            predicted,
            agrees: if predicted == outcome { "yes" } else { "NO" },
            predicted_mismatched_only: alt,
        };
        let cal = Calibration {
            launch: Launch::Threads,
            cap: fitted(Vec::new()),
            rows: vec![
                row("seed.sched", "deadlock", "deadlock", None),
                row("r6.sched", "ok", "deadlock", Some("ok")),
            ],
        };
        let md = markdown(&cal, &duplex::Model::default());
        assert!(md.contains("1 of 2 examples agree."), "{md}");
        assert!(md.contains("| r6.sched | ok | deadlock | ok |"), "{md}");
        assert!(
            !md.contains("| seed.sched | deadlock | deadlock | deadlock |"),
            "{md}"
        );
        // The main table is still the one the nightly reads, whole.
        let main = md.split("## R6").next().expect("before");
        assert_eq!(main.matches("| seed.sched |").count(), 1, "{md}");
    }

    fn nccl_failed() -> Ran {
        let mut r = real("crash");
        r.error = Some(serde_json::json!({
            "kind": "library",
            "message": "NCCL error 3 ...; the model finds a connection set up from mismatched calls, which NCCL makes from the wrong data, so that an NCCL error or a crash may come instead of a hang (R7): ..."
        }));
        r
    }

    #[test]
    fn nccl_failing_is_consistent_only_where_the_hang_goes_through_a_mismatched_round() {
        // Both ranks send first on a cold communicator: the hang the
        // checker finds sets a connection up from mismatched calls.
        for name in ["cold-send-first-4kib.sched", "pytorch-seed.sched"] {
            let (p, mismatched) = verdict(&example(name));
            assert_eq!((p, mismatched), ("deadlock", true), "{name}");
            let agrees = agreement(p, mismatched, None, &nccl_failed(), None);
            assert!(
                agrees.starts_with("consistent") && agrees.contains("R7"),
                "{agrees}"
            );
            // A process killed at its limit, or NCCL's error unexplained, is
            // no agreement.
            let killed = agreement(p, mismatched, None, &real("crash"), None);
            assert!(killed.starts_with("no:"), "{killed}");
            let mut unexplained = nccl_failed();
            unexplained.error =
                Some(serde_json::json!({"kind": "library", "message": "internal error"}));
            assert!(agreement(p, mismatched, None, &unexplained, None).starts_with("no:"));
        }
        // R6 alone: every round complementary.
        let (p, mismatched) = verdict(&example("r6-without-a-mismatched-round.sched"));
        assert_eq!((p, mismatched), ("deadlock", false));
        assert!(agreement(p, mismatched, None, &real("crash"), None).starts_with("no:"));
        assert_eq!(agreement(p, mismatched, None, &real("ok"), None), "NO");
        assert_eq!(agreement("ok", false, None, &real("ok"), None), "yes");
        assert!(agreement("ok", false, None, &real("unavailable"), None).starts_with("not run"));
    }
}
