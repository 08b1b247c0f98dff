//! The schedule-file parser: text in, a validated [`Program`] or an error that
//! names the line.

use std::collections::HashMap;

use super::{CommDecl, Dir, Line, P2p, Program, Stmt, StmtKind, Thread};
use crate::{Model, Policy, Size};

/// The most ranks a schedule may declare.
pub const MAX_RANKS: u32 = 4096;

/// The largest message a `send` or `recv` may move: 1 TiB.
///
/// Both ends of a message hold it in device memory, and no device has a
/// TiB: the largest GPUs have under 300 GB (an H200 141 GB, a B300 or an
/// MI355X 288 GB). A bigger size is a typo (`4096GiB` for `4096KiB`) or a
/// unit mistake, and a program that ran it would fail at allocation, on
/// the GPUs or in the simulator (which moves real bytes in host memory).
/// The parser refuses it, naming the line, before any backend tries. The
/// bound leaves room for devices about four times larger than today's;
/// raise it when they come.
pub const MAX_MESSAGE_BYTES: u64 = 1 << 40;

/// A schedule file that cannot be read: the line (1-based) and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct ParseError {
    /// 1-based line number.
    pub line: u32,
    /// What is wrong, in words.
    pub message: String,
}

/// Parses and validates a schedule file.
///
/// On success every rank, peer, communicator and membership in the program is
/// valid, so later stages need no checks of their own.
pub fn parse(text: &str) -> Result<Program, ParseError> {
    let workers = if text.len() < PARALLEL_FROM {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get().min(MAX_WORKERS))
    };
    parse_with(text, workers)
}

/// Files smaller than this are read by one thread: below it, starting
/// threads costs more than they save.
const PARALLEL_FROM: usize = 1 << 20;

/// The most threads [`parse`] reads one file with.
const MAX_WORKERS: usize = 8;

/// The longest word a schedule may hold, in bytes. No keyword, number,
/// size or name needs more; a longer one is refused before any message
/// echoes it (a megabyte-long name would make a megabyte-long error).
pub const MAX_WORD: usize = 256;

/// The length [`MAX_WORD`] bounds of a token: a name's, without the
/// `comm=` or `stream=` before it or the `:` that may touch it (a name of
/// 256 bytes is valid there too; found by review).
fn word_len(token: &str) -> usize {
    let t = token
        .strip_prefix("comm=")
        .or_else(|| token.strip_prefix("stream="))
        .unwrap_or(token);
    t.strip_suffix(':').unwrap_or(t).len()
}

/// [`parse`] with at most `workers` threads (and at most 8).
///
/// The rank blocks of a file are independent once its head (`ranks`,
/// `policy`, `model`, `comm`) is read, so a large file is cut at rank
/// block headers into `workers` pieces, read at once, and their threads
/// joined in file order. Only a file that parses cleanly is accepted that
/// way: any error, in a piece or in the joined program, sends the whole
/// file through one reader, so an error is exactly the one reading it line
/// by line gives (the first in the file, with its line). The program is the
/// same whatever `workers` is; `parallel_parse_is_serial_parse` in the tests
/// checks that.
pub fn parse_with(text: &str, workers: usize) -> Result<Program, ParseError> {
    read(text, workers).map_err(|e| ParseError {
        line: e.line,
        message: visible(&e.message),
    })
}

/// `message` with the characters a terminal does not show (controls other
/// than tab and newline, and invisible format characters: a zero-width space, a
/// direction mark) written as `\u{...}`, so that an error that quotes the
/// file shows what is there (`send\u{200b}`, not a `send` that looks right).
fn visible(message: &str) -> String {
    let hidden = |c: char| {
        (c.is_control() && c != '\t' && c != '\n')
            || matches!(c, '\u{00AD}' | '\u{061C}' | '\u{180E}' | '\u{FEFF}')
            || ('\u{200B}'..='\u{200F}').contains(&c)
            || ('\u{202A}'..='\u{202E}').contains(&c)
            || ('\u{2060}'..='\u{2069}').contains(&c)
            || matches!(c, '\u{2028}' | '\u{2029}' | '\u{3164}' | '\u{FFA0}')
            || ('\u{FE00}'..='\u{FE0F}').contains(&c)
            || ('\u{E0000}'..='\u{E007F}').contains(&c)
    };
    if !message.chars().any(hidden) {
        return message.to_string();
    }
    message
        .chars()
        .map(|c| {
            if hidden(c) {
                format!("\\u{{{:x}}}", c as u32)
            } else {
                c.to_string()
            }
        })
        .collect()
}

fn read(text: &str, workers: usize) -> Result<Program, ParseError> {
    // A byte-order mark some editors put first: invisible in an error
    // message, so skipped rather than reported as part of `ranks`.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let serial = || Parser::default().run(text);
    let workers = workers.min(MAX_WORKERS);
    if workers < 2 {
        return serial();
    }
    let Some(pieces) = pieces(text, workers) else {
        return serial();
    };
    // The head, read as the one reader would.
    let mut head = Parser::default();
    let ranks = match (head.lines(&text[..pieces[0].0], 0), head.ranks) {
        (Ok(_), Some(ranks)) if head.group.is_none() => ranks,
        _ => return serial(),
    };
    // A piece whose thread cannot start (a process at its thread limit)
    // comes back as `None`, and the file is read by one reader.
    let results: Vec<Option<Result<Vec<Thread>>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = pieces
            .iter()
            .enumerate()
            .map(|(i, &(start, first_line))| {
                let end = pieces.get(i + 1).map_or(text.len(), |p| p.0);
                let mut p = Parser {
                    ranks: head.ranks,
                    policy: head.policy,
                    copy_from: head.copy_from,
                    model: head.model,
                    comms: head.comms.clone(),
                    threads: Vec::new(),
                    group: None,
                    seen: HashMap::new(),
                    // A piece holds rank blocks only, where `comm` is
                    // refused before names are looked up.
                    comm_lines: HashMap::new(),
                };
                std::thread::Builder::new()
                    .spawn_scoped(scope, move || {
                        p.lines(&text[start..end], first_line)?;
                        if p.group.is_some() {
                            return err(0, "a group is open at the end of a piece");
                        }
                        Ok(p.threads)
                    })
                    .ok()
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.and_then(|h| h.join().ok()))
            .collect()
    });
    let mut threads = Vec::new();
    for r in results {
        match r {
            Some(Ok(t)) => threads.extend(t),
            _ => return serial(),
        }
    }
    // A thread defined in two pieces is an error the pieces cannot see.
    let mut seen = std::collections::HashSet::with_capacity(threads.len());
    if !threads
        .iter()
        .all(|t| seen.insert((t.rank, t.name.as_deref())))
    {
        return serial();
    }
    head.threads = threads;
    head.finish(ranks).or_else(|_| serial())
}

/// Where the pieces of a parallel read start: (byte offset, the number of
/// lines before it), each at a rank block header (a line whose first word
/// is `rank`), the first at the file's first header. `None` when the file
/// has fewer than two headers to cut at.
fn pieces(text: &str, workers: usize) -> Option<Vec<(usize, u32)>> {
    let bytes = text.as_bytes();
    // The start of the line holding byte `at` or, when `at` is not a line
    // start, of the next line (a line start is always a char boundary).
    // The start of the line after the one holding byte `at`.
    let next_line = |at: usize| -> usize {
        bytes[at..]
            .iter()
            .position(|&b| b == b'\n')
            .map_or(bytes.len(), |i| at + i + 1)
    };
    let line_start = |at: usize| -> usize {
        if at == 0 || bytes[at - 1] == b'\n' {
            at
        } else {
            next_line(at)
        }
    };
    // The start of the first header line at or after line start `from`.
    let header_from = |mut from: usize| -> Option<usize> {
        while from < bytes.len() {
            let end = next_line(from);
            let line = text[from..end].trim_start();
            if line
                .strip_prefix("rank")
                .is_some_and(|r| r.starts_with(char::is_whitespace))
            {
                return Some(from);
            }
            from = end;
        }
        None
    };
    let first = header_from(0)?;
    let mut starts = vec![first];
    for i in 1..workers {
        let want = first + (bytes.len() - first) * i / workers;
        let last = starts[starts.len() - 1];
        match header_from(line_start(want.max(last + 1))) {
            Some(s) => starts.push(s),
            None => break,
        }
    }
    starts.dedup();
    if starts.len() < 2 {
        return None;
    }
    let (mut lines, mut at) = (0u32, 0usize);
    let out = starts
        .into_iter()
        .map(|s| {
            let n = bytes[at..s].iter().filter(|&&b| b == b'\n').count();
            lines = lines.saturating_add(u32::try_from(n).unwrap_or(u32::MAX));
            at = s;
            (s, lines)
        })
        .collect();
    Some(out)
}

type Result<T, E = ParseError> = std::result::Result<T, E>;

fn err<T>(line: u32, message: impl Into<String>) -> Result<T> {
    Err(ParseError {
        line,
        message: message.into(),
    })
}

/// The most tokens a line may hold: more than a group of the most ops a
/// launch may have ([`crate::machine::MAX_LAUNCH_OPS`]), each with both of
/// its options, on one line. A longer line is refused as it is split, so
/// that a hostile one (a gigabyte of `;`) costs no more than about this
/// many tokens of memory (16 bytes each; the vector's last doubling may
/// reserve up to 32 MiB).
pub const MAX_LINE_TOKENS: usize = 1 << 20;

/// Splits a line into tokens, making `{`, `}` and `;` tokens of their own;
/// false, with `out` cut short, when the line holds more than
/// [`MAX_LINE_TOKENS`].
fn tokenize<'a>(line: &'a str, out: &mut Vec<&'a str>) -> bool {
    out.clear();
    for word in line.split_whitespace() {
        let mut start = 0;
        for (i, c) in word.char_indices() {
            if matches!(c, '{' | '}' | ';') {
                if start < i {
                    out.push(&word[start..i]);
                }
                out.push(&word[i..i + 1]);
                start = i + 1;
                if out.len() > MAX_LINE_TOKENS {
                    return false;
                }
            }
        }
        if start < word.len() {
            out.push(&word[start..]);
        }
        if out.len() > MAX_LINE_TOKENS {
            return false;
        }
    }
    true
}

fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

fn name(line: u32, what: &str, s: &str) -> Result<String> {
    if is_name(s) {
        Ok(s.to_string())
    } else {
        err(
            line,
            format!("`{s}` is not a valid {what} name: use letters, digits, `_`, `-` and `.`"),
        )
    }
}

#[derive(Default)]
struct Parser {
    ranks: Option<u32>,
    policy: Option<(Policy, u32)>,
    copy_from: Option<Size>,
    model: Model,
    comms: Vec<CommDecl>,
    threads: Vec<Thread>,
    /// An open `group {` spanning lines: its ops and the line it started on.
    group: Option<(Vec<P2p>, u32)>,
    /// Each thread block's index in `threads`, by rank and name.
    seen: HashMap<(u32, Option<String>), usize>,
    /// The line of each communicator declared, by name.
    comm_lines: HashMap<String, u32>,
}

impl Parser {
    fn run(mut self, text: &str) -> Result<Program> {
        let last = self.lines(text, 0)?;
        if let Some((_, start)) = self.group {
            return err(start, "`group {` is never closed with `}`");
        }
        let Some(ranks) = self.ranks else {
            return err(
                last.max(1),
                "the file has no `ranks N` statement: it must be the first statement",
            );
        };
        self.finish(ranks)
    }

    /// The program read, of `ranks` ranks, validated.
    fn finish(self, ranks: u32) -> Result<Program> {
        let program = Program {
            ranks,
            policy: self.policy.map(|(p, _)| p).unwrap_or_default(),
            copy_from: self.copy_from,
            model: self.model,
            comms: self.comms,
            threads: self.threads,
        };
        validate(&program)?;
        Ok(program)
    }

    /// Reads `text`, whose first line is line `before + 1` of the file.
    /// Returns the number of the last line read.
    fn lines(&mut self, text: &str, before: u32) -> Result<u32> {
        let mut last = before;
        let mut tokens = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = u32::try_from(i + 1)
                .unwrap_or(u32::MAX)
                .saturating_add(before);
            last = line;
            // A CR left at the end of a line (`\r\r\n`, or a last line
            // ending in `\r`) is whitespace, as any whitespace control
            // character is; a CR inside a line means CR-only line endings.
            let code = raw.split('#').next().unwrap_or("").trim_end_matches('\r');
            if let Some((at, c)) = code
                .char_indices()
                .find(|(_, c)| *c == '\r' || (c.is_control() && !c.is_whitespace()))
            {
                let column = code[..at].chars().count() + 1;
                return err(
                    line,
                    if c == '\r' {
                        format!(
                            "a carriage return in column {column}: are the file's lines ended by CR alone? end them with LF or CRLF"
                        )
                    } else {
                        format!(
                            "a control character (U+{:04X}) in column {column}",
                            c as u32
                        )
                    },
                );
            }
            if !tokenize(code, &mut tokens) {
                return err(
                    line,
                    format!(
                        "a line of more than {MAX_LINE_TOKENS} words: no statement is that long (a group holds at most {} ops); put its ops on lines of their own",
                        crate::machine::MAX_LAUNCH_OPS
                    ),
                );
            }
            if tokens.is_empty() {
                continue;
            }
            if let Some(long) = tokens.iter().find(|t| word_len(t) > MAX_WORD) {
                let start: String = long.chars().take(24).collect();
                return err(
                    line,
                    format!(
                        "a word of {} bytes (`{start}…`): no keyword, number, size or name is longer than {MAX_WORD}",
                        word_len(long)
                    ),
                );
            }
            self.line(line, &tokens)?;
        }
        Ok(last)
    }

    fn line(&mut self, line: u32, tokens: &[&str]) -> Result<()> {
        if self.group.is_some() {
            return self.group_tokens(line, tokens);
        }
        let keyword = tokens[0];
        if self.ranks.is_none() && keyword != "ranks" {
            return err(
                line,
                format!("expected `ranks N` as the first statement, found `{keyword}`"),
            );
        }
        let in_thread = !self.threads.is_empty();
        match keyword {
            "ranks" => {
                if self.ranks.is_some() {
                    return err(line, "`ranks` is given twice");
                }
                let [_, n] = tokens else {
                    return err(line, "expected `ranks N`");
                };
                let n: u32 = crate::size::decimal(n)
                    .filter(|n| (1..=MAX_RANKS).contains(n))
                    .ok_or_else(|| ParseError {
                        line,
                        message: format!(
                            "`{n}` is not a rank count: expected a number from 1 to {MAX_RANKS}"
                        ),
                    })?;
                self.ranks = Some(n);
                Ok(())
            }
            "policy" | "model" | "comm" if in_thread => err(
                line,
                format!("`{keyword}` must come before the first `rank` block"),
            ),
            "policy" => {
                if let Some((_, first)) = self.policy {
                    return err(
                        line,
                        format!("`policy` is given twice (first at line {first})"),
                    );
                }
                let (p, copy) = match tokens {
                    [_, p] => (p, None),
                    [_, p, copy] => (p, Some(copy)),
                    _ => {
                        return err(
                            line,
                            "expected `policy shared`, `policy per-direction` or `policy per-direction copy-from=SIZE`",
                        );
                    }
                };
                let p = Policy::parse(p).map_err(|m| ParseError { line, message: m })?;
                if let Some(copy) = copy {
                    let Some(size) = copy.strip_prefix("copy-from=") else {
                        return err(
                            line,
                            format!(
                                "unknown policy setting `{copy}`: the only one is `copy-from=SIZE`"
                            ),
                        );
                    };
                    if p != Policy::PerDirection {
                        return err(
                            line,
                            "copy-engine lanes (`copy-from=`) are per direction: write `policy per-direction copy-from=SIZE`",
                        );
                    }
                    let size = Size::parse(size).map_err(|m| ParseError {
                        line,
                        message: format!("copy-from: {m}"),
                    })?;
                    self.copy_from = Some(size);
                }
                self.policy = Some((p, line));
                Ok(())
            }
            "model" => {
                if tokens.len() < 2 {
                    return err(line, "expected `model KEY=VALUE ...`");
                }
                for setting in &tokens[1..] {
                    self.model
                        .set(setting)
                        .map_err(|m| ParseError { line, message: m })?;
                }
                Ok(())
            }
            "comm" => self.comm(line, tokens),
            "rank" => self.rank_header(line, tokens),
            "rank:" => err(line, "expected `rank R:`: the rank number is missing"),
            _ if !in_thread => err(
                line,
                format!(
                    "`{keyword}` is a statement of a host thread, but no `rank R:` block has started"
                ),
            ),
            _ => {
                let stmt = self.stmt(line, tokens)?;
                if let Some(stmt) = stmt {
                    self.current().body.push(stmt);
                }
                Ok(())
            }
        }
    }

    fn current(&mut self) -> &mut Thread {
        // Only called once a thread block exists (checked by the caller).
        let last = self.threads.len() - 1;
        &mut self.threads[last]
    }

    fn comm(&mut self, line: u32, tokens: &[&str]) -> Result<()> {
        if tokens.len() < 3 {
            return err(line, "expected `comm NAME R R ...`");
        }
        let name = name(line, "communicator", tokens[1])?;
        if name == "world" {
            return err(line, "`world` always exists and cannot be declared");
        }
        if let Some(&first) = self.comm_lines.get(&name) {
            return err(
                line,
                format!("communicator `{name}` is already declared at line {first}"),
            );
        }
        let mut ranks = Vec::new();
        // Ranks are below `MAX_RANKS`: one flag each, so that a long list
        // is checked in linear time.
        let mut listed = vec![false; self.ranks.unwrap_or(0) as usize];
        for t in &tokens[2..] {
            let r = self.rank_number(line, t)?;
            if std::mem::replace(&mut listed[r as usize], true) {
                return err(
                    line,
                    format!("rank {r} is listed twice in communicator `{name}`"),
                );
            }
            ranks.push(r);
        }
        self.comm_lines.insert(name.clone(), line);
        self.comms.push(CommDecl {
            name,
            ranks,
            line: Line(line),
        });
        Ok(())
    }

    fn rank_number(&self, line: u32, t: &str) -> Result<u32> {
        let n = self.ranks.unwrap_or(0);
        match crate::size::decimal::<u32>(t) {
            Some(r) if r < n => Ok(r),
            Some(r) => err(
                line,
                format!("rank {r} does not exist: ranks are 0 to {}", n - 1),
            ),
            None => err(line, format!("`{t}` is not a rank number")),
        }
    }

    fn rank_header(&mut self, line: u32, tokens: &[&str]) -> Result<()> {
        // `rank R:` | `rank R :` | `rank R thread NAME:` | `rank R thread NAME :`
        let mut words: Vec<&str> = tokens.to_vec();
        let closed = match words.last() {
            Some(&":") => {
                words.pop();
                true
            }
            Some(w) if w.ends_with(':') => {
                let w = words.pop().unwrap_or_default();
                words.push(&w[..w.len() - 1]);
                true
            }
            _ => false,
        };
        if !closed {
            // `rank 0: send 1 4KiB`: the `:` is there, with a statement after
            // it, which belongs on the next line.
            if let Some(i) = words.iter().position(|w| w.ends_with(':')) {
                return err(
                    line,
                    format!(
                        "a rank block's header ends at its `:`; `{}` after it belongs on the next line",
                        words[i + 1..].join(" ")
                    ),
                );
            }
            return err(
                line,
                "a rank block starts with `rank R:` or `rank R thread NAME:` (missing `:`)",
            );
        }
        let (rank, name) = match words.as_slice() {
            ["rank"] => return err(line, "expected `rank R:`: the rank number is missing"),
            ["rank", r] => (self.rank_number(line, r)?, None),
            ["rank", r, "thread", n] => {
                (self.rank_number(line, r)?, Some(name(line, "thread", n)?))
            }
            _ => return err(line, "expected `rank R:` or `rank R thread NAME:`"),
        };
        if name.as_deref() == Some("main") {
            return err(
                line,
                "`main` is the name of the rank's own block: write `rank R:`",
            );
        }
        if let Some(&i) = self.seen.get(&(rank, name.clone())) {
            let first = &self.threads[i];
            return err(
                line,
                format!(
                    "rank {rank} thread {} is already defined at line {}",
                    first.display_name(),
                    first.line.0
                ),
            );
        }
        self.seen.insert((rank, name.clone()), self.threads.len());
        self.threads.push(Thread {
            rank,
            name,
            body: Vec::new(),
            line: Line(line),
        });
        Ok(())
    }

    /// One statement of a thread (a whole line). Returns `None` when the line
    /// opened a multi-line group.
    fn stmt(&mut self, line: u32, tokens: &[&str]) -> Result<Option<Stmt>> {
        let kind = match tokens[0] {
            "send" | "recv" => StmtKind::Op(self.p2p(line, tokens)?),
            "group" => {
                if tokens.get(1) != Some(&"{") {
                    return err(line, "expected `group { OP; OP; ... }`");
                }
                // Room for the ops this line names (a group written on one
                // line is common and large files hold many of them).
                let ops = tokens[2..]
                    .iter()
                    .filter(|t| matches!(**t, "send" | "recv"))
                    .count();
                self.group = Some((Vec::with_capacity(ops), line));
                self.group_tokens(line, &tokens[2..])?;
                return Ok(None);
            }
            "record" | "wait" => {
                let (event, stream) = match tokens {
                    [_, e] => (name(line, "event", e)?, None),
                    [_, e, s] => (name(line, "event", e)?, Some(self.stream_opt(line, s)?)),
                    _ => return err(line, format!("expected `{} EVENT [stream=S]`", tokens[0])),
                };
                if tokens[0] == "record" {
                    StmtKind::Record { event, stream }
                } else {
                    StmtKind::Wait { event, stream }
                }
            }
            "sync" => match tokens {
                [_] => StmtKind::Sync { stream: None },
                [_, s] => StmtKind::Sync {
                    stream: Some(name(
                        line,
                        "stream",
                        s.strip_prefix("stream=").unwrap_or(s),
                    )?),
                },
                _ => return err(line, "expected `sync` or `sync STREAM`"),
            },
            "notify" | "await" => {
                let [kw, p, tag] = tokens else {
                    return err(line, format!("expected `{} PEER TAG`", tokens[0]));
                };
                let peer = self.rank_number(line, p)?;
                let tag = name(line, "tag", tag)?;
                if *kw == "notify" {
                    StmtKind::Notify { peer, tag }
                } else {
                    StmtKind::Await { peer, tag }
                }
            }
            "{" | "}" | ";" => return err(line, format!("unexpected `{}`", tokens[0])),
            other => {
                return err(
                    line,
                    format!(
                        "unknown statement `{other}`: expected send, recv, group, record, wait, sync, notify or await"
                    ),
                );
            }
        };
        Ok(Some(Stmt {
            kind,
            line: Line(line),
        }))
    }

    fn stream_opt(&self, line: u32, s: &str) -> Result<String> {
        match s.strip_prefix("stream=") {
            Some(v) => name(line, "stream", v),
            None => err(line, format!("expected `stream=NAME`, found `{s}`")),
        }
    }

    /// Tokens inside an open group: ops separated by `;` or line ends, then `}`.
    fn group_tokens(&mut self, line: u32, tokens: &[&str]) -> Result<()> {
        let mut rest = tokens;
        loop {
            let end = rest
                .iter()
                .position(|t| *t == ";" || *t == "}")
                .unwrap_or(rest.len());
            let (op, after) = rest.split_at(end);
            if !op.is_empty() {
                if !matches!(op[0], "send" | "recv") {
                    let start = self.group.as_ref().map_or(line, |(_, start)| *start);
                    if op[0] == "rank" && start < line {
                        // The next block starts inside the group: the group
                        // is never closed, an error of its `group {` line.
                        return err(
                            start,
                            format!(
                                "`group {{` is never closed with `}}`: line {line} starts the next block inside it"
                            ),
                        );
                    }
                    let hint = if start < line {
                        format!(": is the `group {{` of line {start} missing its `}}`?")
                    } else {
                        String::new()
                    };
                    return err(
                        line,
                        format!(
                            "a group holds only `send` and `recv`, found `{}`{hint}",
                            op[0]
                        ),
                    );
                }
                let p = self.p2p(line, op)?;
                if let Some((ops, start)) = self.group.as_mut() {
                    // Refused as it grows past the bound, before a
                    // generated file makes it any larger.
                    if let Some(why) = crate::machine::launch_too_large(ops.len() + 1) {
                        return err(*start, why);
                    }
                    ops.push(p);
                }
            }
            match after.first() {
                None => return Ok(()),
                Some(&";") => rest = &after[1..],
                Some(_) => {
                    // `}` closes the group
                    if after.len() > 1 {
                        return err(line, format!("unexpected `{}` after `}}`", after[1]));
                    }
                    let Some((ops, start)) = self.group.take() else {
                        return err(line, "unexpected `}`");
                    };
                    if ops.is_empty() {
                        return err(start, "a group must hold at least one `send` or `recv`");
                    }
                    self.current().body.push(Stmt {
                        kind: StmtKind::Group(ops),
                        line: Line(start),
                    });
                    return Ok(());
                }
            }
        }
    }

    fn p2p(&self, line: u32, tokens: &[&str]) -> Result<P2p> {
        let dir = if tokens[0] == "send" {
            Dir::Send
        } else {
            Dir::Recv
        };
        if tokens.len() < 3 {
            return err(
                line,
                format!("expected `{} PEER SIZE [comm=C] [stream=S]`", dir.name()),
            );
        }
        let peer = self.rank_number(line, tokens[1])?;
        let size = Size::parse(tokens[2]).map_err(|m| ParseError { line, message: m })?;
        if size.bytes() > MAX_MESSAGE_BYTES {
            return err(
                line,
                format!(
                    "`{}` is larger than any device's memory: a message may move at most {} (1 TiB)",
                    tokens[2],
                    Size(MAX_MESSAGE_BYTES)
                ),
            );
        }
        let mut comm = None;
        let mut stream = None;
        for opt in &tokens[3..] {
            let (slot, value, key) = match opt.split_once('=') {
                Some(("comm", v)) => (&mut comm, v, "comm"),
                Some(("stream", v)) => (&mut stream, v, "stream"),
                _ => {
                    return err(
                        line,
                        format!(
                            "unexpected `{opt}`: `{}` takes only `comm=C` and `stream=S` after its size",
                            dir.name()
                        ),
                    );
                }
            };
            if slot.is_some() {
                return err(line, format!("`{key}=` is given twice"));
            }
            *slot = Some(name(line, key, value)?.into_boxed_str());
        }
        Ok(P2p {
            dir,
            peer,
            size,
            comm,
            stream,
            line: Line(line),
        })
    }
}

/// Checks what a line-by-line reading cannot: that every communicator named
/// by an op exists and holds both ends.
fn validate(program: &Program) -> Result<()> {
    let comms: HashMap<&str, &CommDecl> =
        program.comms.iter().map(|c| (c.name.as_str(), c)).collect();
    for thread in &program.threads {
        for stmt in &thread.body {
            for op in stmt.p2ps() {
                // A group's op names its own line.
                let line = if op.line.0 != 0 { op.line } else { stmt.line };
                let Some(name) = op.comm.as_deref() else {
                    continue;
                };
                if name == "world" {
                    continue;
                }
                let Some(comm) = comms.get(name) else {
                    return err(
                        line.0,
                        format!(
                            "communicator `{name}` is not declared: add `comm {name} R R ...` before the first rank block"
                        ),
                    );
                };
                for (who, r) in [("this thread's rank", thread.rank), ("the peer", op.peer)] {
                    if !comm.ranks.contains(&r) {
                        return err(
                            line.0,
                            format!(
                                "rank {r} ({who}) is not a member of communicator `{name}` (declared at line {})",
                                comm.line.0
                            ),
                        );
                    }
                }
            }
        }
    }
    Ok(())
}
