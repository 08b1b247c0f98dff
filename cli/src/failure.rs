//! Why a command did no work, for one file or at all, and the exit
//! statuses (`docs/schedule-format.md`, "Exit statuses").
//!
//! A failure prints as `duplex: WHAT` on stderr, or, when JSON was asked
//! for, as one JSON object on stdout (one line):
//! `{"verdict": "invalid", "file": FILE, "error": {"kind", "message", "line"}}`
//! (`outcome` instead of `verdict` for `duplex run` and `duplex calibrate`,
//! whose reports name their result so).

use serde_json::json;

/// No hang and no error; a run completed; a calibration agreed.
pub(crate) const OK: u8 = 0;
/// A hang or a program error was found; a run hung or failed; a
/// calibration disagreed.
pub(crate) const FOUND: u8 = 1;
/// A file or the command line is invalid: nothing was checked.
pub(crate) const INVALID: u8 = 2;
/// The search reached `--max-states` before deciding.
pub(crate) const INCONCLUSIVE: u8 = 3;
/// The backend cannot start here (no NCCL, no CUDA driver, too few GPUs).
pub(crate) const UNAVAILABLE: u8 = 4;

/// The worst of two exit statuses, for a call over several files: invalid
/// (2) over found (1) over inconclusive (3) over ok (0); unavailable (4)
/// over all.
pub(crate) fn worst(a: u8, b: u8) -> u8 {
    let rank = |s: u8| match s {
        OK => 0,
        INCONCLUSIVE => 1,
        FOUND => 2,
        INVALID => 3,
        _ => 4,
    };
    if rank(b) > rank(a) { b } else { a }
}

/// Why a command could not do its work.
#[derive(Clone, Debug)]
pub(crate) struct Failure {
    /// The exit status: [`INVALID`], [`UNAVAILABLE`] or [`FOUND`].
    pub(crate) status: u8,
    /// `read`, `encoding`, `parse`, `usage`, `replay`, `unavailable` or
    /// `failed`.
    pub(crate) kind: &'static str,
    /// The file concerned, as given on the command line.
    pub(crate) file: Option<String>,
    /// The line of the file, when one is to blame.
    pub(crate) line: Option<u32>,
    /// What is wrong, in words.
    pub(crate) message: String,
}

impl Failure {
    /// An invalid file or command line (exit status 2).
    pub(crate) fn invalid(kind: &'static str, message: impl Into<String>) -> Failure {
        Failure {
            status: INVALID,
            kind,
            file: None,
            line: None,
            message: message.into(),
        }
    }

    /// Work that started and failed (exit status 1, kind `failed`).
    pub(crate) fn failed(message: impl Into<String>) -> Failure {
        Failure {
            status: FOUND,
            kind: "failed",
            file: None,
            line: None,
            message: message.into(),
        }
    }

    /// A backend that cannot start (exit status 4).
    pub(crate) fn unavailable(message: impl Into<String>) -> Failure {
        Failure {
            status: UNAVAILABLE,
            kind: "unavailable",
            file: None,
            line: None,
            message: message.into(),
        }
    }

    /// The same failure, about `file` (at `line`, if given).
    pub(crate) fn at(mut self, file: &str, line: Option<u32>) -> Failure {
        self.file = Some(file.to_string());
        self.line = line;
        self
    }

    /// `invalid`, `unavailable` or `failed`: the value of the report's
    /// `verdict` (or `outcome`) field.
    fn verdict(&self) -> &'static str {
        match self.status {
            INVALID => "invalid",
            UNAVAILABLE => "unavailable",
            _ => "failed",
        }
    }

    /// The text on stderr: `FILE:LINE: what` where a line is to blame.
    pub(crate) fn text(&self) -> String {
        match (&self.file, self.line) {
            (Some(f), Some(l)) => format!("{f}:{l}: {}", self.message),
            _ => self.message.clone(),
        }
    }

    /// The JSON object; `key` is `verdict` or `outcome`.
    pub(crate) fn json(&self, key: &str) -> serde_json::Value {
        let mut v = json!({
            "file": self.file,
            "error": {
                "kind": self.kind,
                "message": self.message,
                "line": self.line,
            },
        });
        v[key] = json!(self.verdict());
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worst_status_wins_whatever_the_order() {
        let order = [OK, INCONCLUSIVE, FOUND, INVALID, UNAVAILABLE];
        for (i, a) in order.iter().enumerate() {
            for (j, b) in order.iter().enumerate() {
                let want = order[i.max(j)];
                assert_eq!(worst(*a, *b), want, "worst({a}, {b})");
            }
        }
        assert_eq!(
            [OK, FOUND, INCONCLUSIVE, OK].into_iter().fold(OK, worst),
            FOUND
        );
    }

    #[test]
    fn a_failure_prints_its_line_and_serializes_its_fields() {
        let f = Failure::invalid("parse", "`lots` is not a size").at("a.sched", Some(3));
        assert_eq!(f.text(), "a.sched:3: `lots` is not a size");
        let j = f.json("verdict");
        assert_eq!(j["verdict"], "invalid");
        assert_eq!(j["file"], "a.sched");
        assert_eq!(j["error"]["kind"], "parse");
        assert_eq!(j["error"]["line"], 3);
        let u = Failure::unavailable("no NCCL");
        assert_eq!(u.status, UNAVAILABLE);
        assert_eq!(u.json("outcome")["outcome"], "unavailable");
        assert!(u.json("outcome")["error"]["line"].is_null());
    }
}
