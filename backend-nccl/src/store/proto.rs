//! The store's wire protocol: message types, and a pure parser and encoder.
//!
//! Every message is one line of printable ASCII (bytes `0x20..=0x7e`) ended
//! by `\n`, at most [`MAX_LINE`] bytes with the newline. Fields are
//! separated by exactly one space. Numbers are decimal without sign or
//! leading zeros; bytes are lowercase hex ([`hex`]); a tag is the hex of
//! its UTF-8 bytes, or `-` when empty.
//!
//! ```text
//! request  = "AUTH" SP version SP token-hex        ; first line of every connection
//!          / "ID"                                  ; the NCCL unique id
//!          / "POST" SP from SP to SP tag           ; a notify message
//!          / "TAKE" SP from SP to SP tag SP millis ; take one, waiting up to millis
//!          / "FAIL" SP rank SP why-hex / "BEAT" SP rank / "HEALTH" SP rank SP millis
//!          / "PUT" SP key-hex SP len               ; len bytes follow the line
//!          / "GET" SP key-hex SP millis
//!          / "MAIL" SP to SP len                   ; a message to a rank's inbox; len bytes follow
//!          / "INBOX" SP rank SP millis             ; the oldest message of a rank's inbox
//!          / "ENDED" SP millis                     ; the ranks that finished, posted a failure or fell silent
//!          / "KEYS" SP prefix-hex                  ; the stored keys that start with prefix
//! response = "OK" / "TIMEOUT" / "ID" SP id-hex / "ERROR" SP text
//!          / "HEALTHY" / "FAILED" SP rank SP why-hex / "VALUE" SP len
//! ```
//!
//! The grammar is strict, so every line that parses is the encoding of what
//! it parsed to ([`fuzz_parse`] checks this). Parsing never panics, looks at
//! no more than [`MAX_LINE`] bytes and allocates at most that much.

use std::io::{BufRead, Read};

use duplex::Rank;

/// The protocol version a client presents in `AUTH`: 5 since a connection
/// carries many requests (4 added `KEYS`).
pub const VERSION: u32 = 5;
/// The longest line, its newline included, in bytes.
pub const MAX_LINE: usize = 4096;
/// The longest token, in bytes (its hex is twice as long).
pub const MAX_TOKEN: usize = 1024;
/// The longest `notify` tag, in bytes of UTF-8.
pub const MAX_TAG: usize = 1024;
/// The longest unique id, in bytes (NCCL's is 128).
pub const MAX_ID: usize = 512;
/// The longest error text of a reply, in bytes.
pub const MAX_ERROR: usize = 512;
/// The longest key of `PUT`/`GET`, in bytes.
pub const MAX_KEY: usize = 256;
/// The longest reason of a `FAIL`, in bytes.
pub const MAX_WHY: usize = 512;
/// The largest value a `PUT` carries, in bytes (a rank's trace).
pub const MAX_VALUE: usize = 16 << 20;
/// The largest message of a rank's inbox (`MAIL`), in bytes.
pub const MAX_MAIL: usize = 4096;

/// Why a line is not a message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// More than [`MAX_LINE`] bytes.
    #[error("line of more than {max} bytes")]
    TooLong {
        /// The limit.
        max: usize,
    },
    /// The line does not end with a newline: the peer closed the connection
    /// mid-line, or sent nothing.
    #[error("truncated line (no newline after {len} bytes)")]
    Truncated {
        /// How many bytes came.
        len: usize,
    },
    /// A byte that is not printable ASCII (this covers non-UTF-8 input).
    #[error("byte {byte:#04x} at offset {at} is not printable ascii")]
    NotAscii {
        /// The byte.
        byte: u8,
        /// Its offset in the line.
        at: usize,
    },
    /// The first word is no message of this direction.
    #[error("unknown {kind}")]
    Unknown {
        /// `request` or `response`.
        kind: &'static str,
    },
    /// A message with too few or too many fields.
    #[error("{command} takes {expected} fields, got {got}")]
    Arity {
        /// The message.
        command: &'static str,
        /// How many fields it takes after its name.
        expected: usize,
        /// How many came.
        got: usize,
    },
    /// A field that is not a canonical decimal number in range.
    #[error("{field} is not a number")]
    Number {
        /// The field.
        field: &'static str,
    },
    /// A field that is not lowercase hex of whole bytes.
    #[error("{field} is not lowercase hex")]
    Hex {
        /// The field.
        field: &'static str,
    },
    /// A field of the wrong length.
    #[error("{field} of {len} bytes is outside 1..={max}")]
    Length {
        /// The field.
        field: &'static str,
        /// Its length in bytes (decoded).
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A tag that is not UTF-8.
    #[error("tag is not utf-8")]
    TagNotUtf8,
    /// A text field whose bytes are not UTF-8.
    #[error("{field} is not utf-8")]
    NotUtf8 {
        /// Which field.
        field: &'static str,
    },
}

/// A secret: the job's store token. Its `Debug` shows only its length and
/// its `==` takes the same time wherever the first difference is.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// A secret of these bytes.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Secret {
        Secret(bytes.into())
    }

    /// The bytes.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret(<{} bytes>)", self.0.len())
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Secret) -> bool {
        ct_eq(&self.0, &other.0)
    }
}

impl Eq for Secret {}

/// Whether `a == b`, in time that depends on their lengths only (not on
/// where they differ): an xor-fold over every byte.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// What a client sends.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Request {
    /// The first line of every connection: the protocol version and the
    /// job's secret.
    Auth {
        /// [`VERSION`] of the client.
        version: u32,
        /// The job's secret.
        token: Secret,
    },
    /// Asks for the NCCL unique id.
    UniqueId,
    /// Posts a `notify` message from `from` to `to`.
    Post {
        /// The sender.
        from: Rank,
        /// The receiver.
        to: Rank,
        /// The message's tag.
        tag: String,
    },
    /// Takes one message from `from` to `to`, waiting up to `wait_ms`.
    Take {
        /// The sender.
        from: Rank,
        /// The receiver.
        to: Rank,
        /// The message's tag.
        tag: String,
        /// How long to wait, in milliseconds.
        wait_ms: u64,
    },
    /// Records that `rank` failed, and why (the first failure of a rank is
    /// kept).
    Fail {
        /// The rank.
        rank: Rank,
        /// Why, in words.
        why: String,
    },
    /// A heartbeat of `rank`: it is alive.
    Beat {
        /// The rank.
        rank: Rank,
    },
    /// Asks whether another rank than `me` failed, or has sent no heartbeat
    /// for `silence_ms`: the first failure in the order failures happened
    /// (a silence counts from when it passed `silence_ms`, and once found
    /// it is kept, so every asker hears of the same rank).
    Health {
        /// The asking rank (never reported to itself).
        me: Rank,
        /// The silence after which a rank counts as dead or frozen.
        silence_ms: u64,
    },
    /// Stores `len` bytes under `key`; the bytes follow the line.
    Put {
        /// The key.
        key: String,
        /// The number of bytes after the line.
        len: usize,
    },
    /// Gets the bytes under `key`, waiting up to `wait_ms` for them.
    Get {
        /// The key.
        key: String,
        /// How long to wait, in milliseconds.
        wait_ms: u64,
    },
    /// Appends a message of `len` bytes (which follow the line) to the
    /// inbox of rank `to`.
    Mail {
        /// The receiver.
        to: Rank,
        /// The number of bytes after the line.
        len: usize,
    },
    /// Takes the oldest message of rank `me`'s inbox, waiting up to
    /// `wait_ms` for one.
    Inbox {
        /// The rank whose inbox.
        me: Rank,
        /// How long to wait, in milliseconds.
        wait_ms: u64,
    },
    /// Asks which ranks have ended: finished cleanly (stored `done/RANK`),
    /// posted a failure, or sent no heartbeat for longer than `silence_ms`
    /// (killed or frozen). The reply is a `VALUE` of their numbers in
    /// decimal, ascending, separated by commas.
    Ended {
        /// The silence, in milliseconds, after which a rank counts as dead.
        silence_ms: u64,
    },
    /// Asks for the keys stored (`PUT`) that start with `prefix`. The reply
    /// is a `VALUE` of their hex ([`hex`]), in ascending order, separated
    /// by single spaces; a refusal when that would be longer than the
    /// store allows a listing (1 MiB).
    Keys {
        /// The prefix, 1 to [`MAX_KEY`] bytes.
        prefix: String,
    },
}

impl Request {
    /// The request's first word on the wire (`GET`, `PUT`, ...), for logs.
    pub fn verb(&self) -> &'static str {
        match self {
            Request::Auth { .. } => "AUTH",
            Request::UniqueId => "ID",
            Request::Post { .. } => "POST",
            Request::Take { .. } => "TAKE",
            Request::Fail { .. } => "FAIL",
            Request::Beat { .. } => "BEAT",
            Request::Health { .. } => "HEALTH",
            Request::Put { .. } => "PUT",
            Request::Get { .. } => "GET",
            Request::Mail { .. } => "MAIL",
            Request::Inbox { .. } => "INBOX",
            Request::Ended { .. } => "ENDED",
            Request::Keys { .. } => "KEYS",
        }
    }
}

/// What the store replies.
#[derive(Clone, PartialEq, Eq)]
pub enum Response {
    /// Done (authenticated, posted, taken).
    Ok,
    /// `TAKE` found no message in time.
    Timeout,
    /// The NCCL unique id.
    UniqueId(Vec<u8>),
    /// The request was refused; the text says why.
    Error(String),
    /// `HEALTH`: no other rank failed or fell silent.
    Healthy,
    /// `HEALTH`: this rank failed (or fell silent), for this reason.
    Failed {
        /// The rank.
        rank: Rank,
        /// Why.
        why: String,
    },
    /// `GET`: the value, whose `len` bytes follow the line.
    Value(usize),
}

impl std::fmt::Debug for Response {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Response::Ok => f.write_str("Ok"),
            Response::Timeout => f.write_str("Timeout"),
            // The id lets anyone join the NCCL communicator: never print it.
            Response::UniqueId(id) => write!(f, "UniqueId(<{} bytes>)", id.len()),
            Response::Error(text) => f.debug_tuple("Error").field(text).finish(),
            Response::Healthy => f.write_str("Healthy"),
            Response::Failed { rank, why } => f
                .debug_struct("Failed")
                .field("rank", rank)
                .field("why", why)
                .finish(),
            Response::Value(len) => write!(f, "Value(<{len} bytes>)"),
        }
    }
}

impl Response {
    /// An error reply saying `text`, made encodable: bytes that are not
    /// printable ASCII become `?`, and the text is cut to [`MAX_ERROR`].
    pub fn error(text: &str) -> Response {
        let mut clean: String = text
            .chars()
            .map(|c| {
                if c == ' ' || c.is_ascii_graphic() {
                    c
                } else {
                    '?'
                }
            })
            .take(MAX_ERROR)
            .collect();
        if clean.is_empty() {
            clean.push_str("error");
        }
        Response::Error(clean)
    }
}

/// Lowercase hex of bytes.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 15)]));
    }
    s
}

/// The bytes of lowercase hex text as [`hex`] writes it; `None` for odd
/// length or any other character. Total: never panics, on any input.
pub fn unhex(text: &str) -> Option<Vec<u8>> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let bytes = text.as_bytes();
    if !bytes.len().is_multiple_of(2) {
        return None;
    }
    bytes
        .chunks_exact(2)
        .map(|p| Some((digit(p[0])? << 4) | digit(p[1])?))
        .collect()
}

/// Reads one line (up to and including `\n`) of at most [`MAX_LINE`] + 1
/// bytes: never more, whatever the peer sends. What it returns goes to
/// [`parse_request`] or [`parse_response`], which say what is wrong with it
/// (too long, truncated).
pub fn read_line(r: &mut impl BufRead) -> std::io::Result<Vec<u8>> {
    let mut line = Vec::new();
    r.by_ref()
        .take(MAX_LINE as u64 + 1)
        .read_until(b'\n', &mut line)?;
    Ok(line)
}

/// The fields of a line after its checks: length, newline, ASCII.
fn fields(line: &[u8]) -> Result<Vec<&str>, ProtoError> {
    if line.len() > MAX_LINE {
        return Err(ProtoError::TooLong { max: MAX_LINE });
    }
    let Some(body) = line.strip_suffix(b"\n") else {
        return Err(ProtoError::Truncated { len: line.len() });
    };
    if let Some(at) = body.iter().position(|b| !(0x20..=0x7e).contains(b)) {
        return Err(ProtoError::NotAscii { byte: body[at], at });
    }
    // Printable ASCII is UTF-8.
    let text = std::str::from_utf8(body).map_err(|e| ProtoError::NotAscii {
        byte: body[e.valid_up_to()],
        at: e.valid_up_to(),
    })?;
    Ok(text.split(' ').collect())
}

fn arity(command: &'static str, args: &[&str], expected: usize) -> Result<(), ProtoError> {
    if args.len() == expected {
        Ok(())
    } else {
        Err(ProtoError::Arity {
            command,
            expected,
            got: args.len(),
        })
    }
}

/// A canonical decimal: digits only, no leading zero (but `0`).
fn number<T: std::str::FromStr>(field: &'static str, text: &str) -> Result<T, ProtoError> {
    let canonical = !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit())
        && (text == "0" || !text.starts_with('0'));
    if !canonical {
        return Err(ProtoError::Number { field });
    }
    text.parse().map_err(|_| ProtoError::Number { field })
}

fn bytes(field: &'static str, text: &str, max: usize) -> Result<Vec<u8>, ProtoError> {
    // Check the length before decoding: never decode more than the limit.
    if text.len() / 2 > max {
        return Err(ProtoError::Length {
            field,
            len: text.len() / 2,
            max,
        });
    }
    let b = unhex(text).ok_or(ProtoError::Hex { field })?;
    if b.is_empty() {
        return Err(ProtoError::Length { field, len: 0, max });
    }
    Ok(b)
}

fn tag(text: &str) -> Result<String, ProtoError> {
    if text == "-" {
        return Ok(String::new());
    }
    String::from_utf8(bytes("tag", text, MAX_TAG)?).map_err(|_| ProtoError::TagNotUtf8)
}

/// A non-empty UTF-8 text field sent as hex, at most `max` bytes.
fn text(field: &'static str, hexed: &str, max: usize) -> Result<String, ProtoError> {
    String::from_utf8(bytes(field, hexed, max)?).map_err(|_| ProtoError::NotUtf8 { field })
}

fn encode_text(field: &'static str, text: &str, max: usize) -> Result<String, ProtoError> {
    check_len(field, text.len(), max)?;
    Ok(hex(text.as_bytes()))
}

fn length(field: &'static str, text: &str, max: usize) -> Result<usize, ProtoError> {
    let n: usize = number(field, text)?;
    if n > max {
        return Err(ProtoError::Length { field, len: n, max });
    }
    Ok(n)
}

fn encode_tag(tag: &str) -> Result<String, ProtoError> {
    match tag.len() {
        0 => Ok("-".into()),
        n if n > MAX_TAG => Err(ProtoError::Length {
            field: "tag",
            len: n,
            max: MAX_TAG,
        }),
        _ => Ok(hex(tag.as_bytes())),
    }
}

fn check_len(field: &'static str, len: usize, max: usize) -> Result<(), ProtoError> {
    if (1..=max).contains(&len) {
        Ok(())
    } else {
        Err(ProtoError::Length { field, len, max })
    }
}

/// Parses one request line, its `\n` included. Never panics.
pub fn parse_request(line: &[u8]) -> Result<Request, ProtoError> {
    let f = fields(line)?;
    let Some((&command, args)) = f.split_first() else {
        return Err(ProtoError::Unknown { kind: "request" });
    };
    match command {
        "AUTH" => {
            arity("AUTH", args, 2)?;
            Ok(Request::Auth {
                version: number("version", args[0])?,
                token: Secret(bytes("token", args[1], MAX_TOKEN)?),
            })
        }
        "ID" => {
            arity("ID", args, 0)?;
            Ok(Request::UniqueId)
        }
        "POST" => {
            arity("POST", args, 3)?;
            Ok(Request::Post {
                from: number("from", args[0])?,
                to: number("to", args[1])?,
                tag: tag(args[2])?,
            })
        }
        "TAKE" => {
            arity("TAKE", args, 4)?;
            Ok(Request::Take {
                from: number("from", args[0])?,
                to: number("to", args[1])?,
                tag: tag(args[2])?,
                wait_ms: number("millis", args[3])?,
            })
        }
        "FAIL" => {
            arity("FAIL", args, 2)?;
            Ok(Request::Fail {
                rank: number("rank", args[0])?,
                why: text("why", args[1], MAX_WHY)?,
            })
        }
        "BEAT" => {
            arity("BEAT", args, 1)?;
            Ok(Request::Beat {
                rank: number("rank", args[0])?,
            })
        }
        "HEALTH" => {
            arity("HEALTH", args, 2)?;
            Ok(Request::Health {
                me: number("rank", args[0])?,
                silence_ms: number("millis", args[1])?,
            })
        }
        "PUT" => {
            arity("PUT", args, 2)?;
            Ok(Request::Put {
                key: text("key", args[0], MAX_KEY)?,
                len: length("value length", args[1], MAX_VALUE)?,
            })
        }
        "GET" => {
            arity("GET", args, 2)?;
            Ok(Request::Get {
                key: text("key", args[0], MAX_KEY)?,
                wait_ms: number("millis", args[1])?,
            })
        }
        "MAIL" => {
            arity("MAIL", args, 2)?;
            Ok(Request::Mail {
                to: number("to", args[0])?,
                len: length("mail length", args[1], MAX_MAIL)?,
            })
        }
        "ENDED" => {
            arity("ENDED", args, 1)?;
            Ok(Request::Ended {
                silence_ms: number("millis", args[0])?,
            })
        }
        "KEYS" => {
            arity("KEYS", args, 1)?;
            Ok(Request::Keys {
                prefix: text("prefix", args[0], MAX_KEY)?,
            })
        }
        "INBOX" => {
            arity("INBOX", args, 2)?;
            Ok(Request::Inbox {
                me: number("rank", args[0])?,
                wait_ms: number("millis", args[1])?,
            })
        }
        _ => Err(ProtoError::Unknown { kind: "request" }),
    }
}

/// The line of a request, `\n` included; an error for a request that
/// [`parse_request`] would refuse (a tag or token too long or empty).
pub fn encode_request(request: &Request) -> Result<Vec<u8>, ProtoError> {
    let line = match request {
        Request::Auth { version, token } => {
            check_len("token", token.0.len(), MAX_TOKEN)?;
            format!("AUTH {version} {}\n", hex(&token.0))
        }
        Request::UniqueId => "ID\n".into(),
        Request::Post { from, to, tag } => format!("POST {from} {to} {}\n", encode_tag(tag)?),
        Request::Take {
            from,
            to,
            tag,
            wait_ms,
        } => format!("TAKE {from} {to} {} {wait_ms}\n", encode_tag(tag)?),
        Request::Fail { rank, why } => {
            format!("FAIL {rank} {}\n", encode_text("why", why, MAX_WHY)?)
        }
        Request::Beat { rank } => format!("BEAT {rank}\n"),
        Request::Health { me, silence_ms } => format!("HEALTH {me} {silence_ms}\n"),
        Request::Put { key, len } => {
            if *len > MAX_VALUE {
                return Err(ProtoError::Length {
                    field: "value length",
                    len: *len,
                    max: MAX_VALUE,
                });
            }
            format!("PUT {} {len}\n", encode_text("key", key, MAX_KEY)?)
        }
        Request::Get { key, wait_ms } => {
            format!("GET {} {wait_ms}\n", encode_text("key", key, MAX_KEY)?)
        }
        Request::Mail { to, len } => {
            if *len > MAX_MAIL {
                return Err(ProtoError::Length {
                    field: "mail length",
                    len: *len,
                    max: MAX_MAIL,
                });
            }
            format!("MAIL {to} {len}\n")
        }
        Request::Inbox { me, wait_ms } => format!("INBOX {me} {wait_ms}\n"),
        Request::Ended { silence_ms } => format!("ENDED {silence_ms}\n"),
        Request::Keys { prefix } => {
            format!("KEYS {}\n", encode_text("prefix", prefix, MAX_KEY)?)
        }
    };
    Ok(line.into_bytes())
}

/// Parses one response line, its `\n` included. Never panics.
pub fn parse_response(line: &[u8]) -> Result<Response, ProtoError> {
    let f = fields(line)?;
    let Some((&command, args)) = f.split_first() else {
        return Err(ProtoError::Unknown { kind: "response" });
    };
    match command {
        "OK" => {
            arity("OK", args, 0)?;
            Ok(Response::Ok)
        }
        "TIMEOUT" => {
            arity("TIMEOUT", args, 0)?;
            Ok(Response::Timeout)
        }
        "ID" => {
            arity("ID", args, 1)?;
            Ok(Response::UniqueId(bytes("id", args[0], MAX_ID)?))
        }
        "ERROR" => {
            // The text is the rest of the line, spaces and all.
            let text = args.join(" ");
            check_len("error text", text.len(), MAX_ERROR)?;
            Ok(Response::Error(text))
        }
        "HEALTHY" => {
            arity("HEALTHY", args, 0)?;
            Ok(Response::Healthy)
        }
        "FAILED" => {
            arity("FAILED", args, 2)?;
            Ok(Response::Failed {
                rank: number("rank", args[0])?,
                why: text("why", args[1], MAX_WHY)?,
            })
        }
        "VALUE" => {
            arity("VALUE", args, 1)?;
            Ok(Response::Value(length("value length", args[0], MAX_VALUE)?))
        }
        _ => Err(ProtoError::Unknown { kind: "response" }),
    }
}

/// The line of a response, `\n` included; an error for a response that
/// [`parse_response`] would refuse (make error replies with
/// [`Response::error`]).
pub fn encode_response(response: &Response) -> Result<Vec<u8>, ProtoError> {
    let line = match response {
        Response::Ok => "OK\n".into(),
        Response::Timeout => "TIMEOUT\n".into(),
        Response::UniqueId(id) => {
            check_len("id", id.len(), MAX_ID)?;
            format!("ID {}\n", hex(id))
        }
        Response::Error(text) => {
            check_len("error text", text.len(), MAX_ERROR)?;
            if let Some(at) = text.bytes().position(|b| !(0x20..=0x7e).contains(&b)) {
                return Err(ProtoError::NotAscii {
                    byte: text.as_bytes()[at],
                    at,
                });
            }
            format!("ERROR {text}\n")
        }
        Response::Healthy => "HEALTHY\n".into(),
        Response::Failed { rank, why } => {
            format!("FAILED {rank} {}\n", encode_text("why", why, MAX_WHY)?)
        }
        Response::Value(len) => {
            if *len > MAX_VALUE {
                return Err(ProtoError::Length {
                    field: "value length",
                    len: *len,
                    max: MAX_VALUE,
                });
            }
            format!("VALUE {len}\n")
        }
    };
    Ok(line.into_bytes())
}

/// The harness of the `store` fuzz target (`fuzz/fuzz_targets/store.rs`),
/// which `backend-nccl/tests/store_corpus.rs` also runs on the committed
/// corpus: feeds `data` to both parsers, to [`unhex`] and, as a byte
/// stream, through [`read_line`]. Panics if an invariant breaks: every line
/// that parses is exactly the encoding of what it parsed to, and parses
/// back to the same value; [`read_line`] never returns more than
/// [`MAX_LINE`] + 1 bytes; [`unhex`] accepts only what [`hex`] writes.
pub fn fuzz_parse(data: &[u8]) {
    check_line(data);
    let mut stream = std::io::Cursor::new(data);
    loop {
        let line = match read_line(&mut stream) {
            Ok(line) if !line.is_empty() => line,
            Ok(_) => break,
            Err(e) => panic!("reading from memory failed: {e}"),
        };
        assert!(line.len() <= MAX_LINE + 1, "read_line read past its bound");
        check_line(&line);
    }
    if let Ok(text) = std::str::from_utf8(data)
        && let Some(b) = unhex(text)
    {
        assert_eq!(hex(&b), text, "unhex accepted non-canonical hex");
    }
}

fn check_line(line: &[u8]) {
    if let Ok(r) = parse_request(line) {
        let again = encode_request(&r).expect("a parsed request encodes");
        assert_eq!(again, line, "a request's encoding differs from its line");
        assert_eq!(parse_request(&again), Ok(r), "a request does not re-parse");
    }
    if let Ok(r) = parse_response(line) {
        let again = encode_response(&r).expect("a parsed response encodes");
        assert_eq!(again, line, "a response's encoding differs from its line");
        assert_eq!(
            parse_response(&again),
            Ok(r),
            "a response does not re-parse"
        );
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn token(s: &str) -> Secret {
        Secret::new(s)
    }

    fn requests() -> Vec<Request> {
        vec![
            Request::Auth {
                version: VERSION,
                token: token("0123456789abcdef"),
            },
            Request::Auth {
                version: u32::MAX,
                token: Secret::new(vec![0xff; MAX_TOKEN]),
            },
            Request::UniqueId,
            Request::Post {
                from: 0,
                to: 1,
                tag: "go".into(),
            },
            Request::Post {
                from: u32::MAX,
                to: 0,
                tag: String::new(),
            },
            Request::Take {
                from: 1,
                to: 0,
                tag: "a b\n\u{0}é🦀".into(),
                wait_ms: 0,
            },
            Request::Take {
                from: 7,
                to: 3,
                tag: "x".repeat(MAX_TAG),
                wait_ms: u64::MAX,
            },
            Request::Fail {
                rank: 1,
                why: "hang: deadline of 10 s expired; é 🦀".into(),
            },
            Request::Fail {
                rank: u32::MAX,
                why: "w".repeat(MAX_WHY),
            },
            Request::Beat { rank: 3 },
            Request::Health {
                me: 0,
                silence_ms: 3000,
            },
            Request::Put {
                key: "trace/1".into(),
                len: 0,
            },
            Request::Put {
                key: "k".repeat(MAX_KEY),
                len: MAX_VALUE,
            },
            Request::Get {
                key: "trace/0".into(),
                wait_ms: 500,
            },
            Request::Mail { to: 1, len: 0 },
            Request::Mail {
                to: u32::MAX,
                len: MAX_MAIL,
            },
            Request::Inbox { me: 0, wait_ms: 0 },
            Request::Ended { silence_ms: 3000 },
            Request::Ended {
                silence_ms: u64::MAX,
            },
            Request::Keys {
                prefix: "owed/1/".into(),
            },
            Request::Keys {
                prefix: "k".repeat(MAX_KEY),
            },
        ]
    }

    fn responses() -> Vec<Response> {
        vec![
            Response::Ok,
            Response::Timeout,
            Response::UniqueId(vec![0; 128]),
            Response::UniqueId((0..=255).cycle().take(MAX_ID).collect()),
            Response::Error("bad token".into()),
            Response::Error("  spaces  kept ".into()),
            Response::Error("~".repeat(MAX_ERROR)),
            Response::Healthy,
            Response::Failed {
                rank: 2,
                why: "no heartbeat for 3000 ms".into(),
            },
            Response::Value(0),
            Response::Value(MAX_VALUE),
        ]
    }

    #[test]
    fn every_message_round_trips() {
        for r in requests() {
            let line = encode_request(&r).unwrap();
            assert!(line.len() <= MAX_LINE, "{r:?}");
            assert_eq!(parse_request(&line), Ok(r.clone()));
            // The verb the logs give is the line's first word.
            let word = line.split(|b| *b == b' ' || *b == b'\n').next();
            assert_eq!(word, Some(r.verb().as_bytes()), "{r:?}");
            fuzz_parse(&line);
        }
        for r in responses() {
            let line = encode_response(&r).unwrap();
            assert!(line.len() <= MAX_LINE, "{r:?}");
            assert_eq!(parse_response(&line), Ok(r.clone()));
            fuzz_parse(&line);
        }
    }

    #[test]
    fn the_lines_are_as_documented() {
        let r = Request::Take {
            from: 1,
            to: 0,
            tag: "go".into(),
            wait_ms: 250,
        };
        assert_eq!(encode_request(&r).unwrap(), b"TAKE 1 0 676f 250\n");
        let r = Request::Post {
            from: 0,
            to: 1,
            tag: String::new(),
        };
        assert_eq!(encode_request(&r).unwrap(), b"POST 0 1 -\n");
        let r = Request::Auth {
            version: 1,
            token: token("ab"),
        };
        assert_eq!(encode_request(&r).unwrap(), b"AUTH 1 6162\n");
        assert_eq!(encode_response(&Response::Ok).unwrap(), b"OK\n");
    }

    #[test]
    fn hostile_lines_are_errors() {
        use ProtoError as E;
        let long = [vec![b'A'; MAX_LINE], b"\n".to_vec()].concat();
        let cases: Vec<(&[u8], ProtoError)> = vec![
            (b"", E::Truncated { len: 0 }),
            (b"ID", E::Truncated { len: 2 }),
            (b"POST 0 1 61", E::Truncated { len: 11 }),
            (&long, E::TooLong { max: MAX_LINE }),
            (b"\n", E::Unknown { kind: "request" }),
            (b"id\n", E::Unknown { kind: "request" }),
            (b"ID\n\n", E::NotAscii { byte: b'\n', at: 2 }),
            (b"ID\r\n", E::NotAscii { byte: b'\r', at: 2 }),
            (b"\xff\xfe\n", E::NotAscii { byte: 0xff, at: 0 }),
            ("POST 0 1 é\n".as_bytes(), E::NotAscii { byte: 0xc3, at: 9 }),
            (
                b"ID \n",
                E::Arity {
                    command: "ID",
                    expected: 0,
                    got: 1,
                },
            ),
            (
                b"AUTH 1\n",
                E::Arity {
                    command: "AUTH",
                    expected: 2,
                    got: 1,
                },
            ),
            (
                b"AUTH  1 61\n",
                E::Arity {
                    command: "AUTH",
                    expected: 2,
                    got: 3,
                },
            ),
            (
                b"AUTH 1 \n",
                E::Length {
                    field: "token",
                    len: 0,
                    max: MAX_TOKEN,
                },
            ),
            (b"AUTH 01 61\n", E::Number { field: "version" }),
            (b"AUTH +1 61\n", E::Number { field: "version" }),
            (b"AUTH 1 6\n", E::Hex { field: "token" }),
            (b"AUTH 1 6G\n", E::Hex { field: "token" }),
            (b"AUTH 1 6A\n", E::Hex { field: "token" }),
            (
                b"POST 0 1 \n",
                E::Length {
                    field: "tag",
                    len: 0,
                    max: MAX_TAG,
                },
            ),
            (b"POST 0 1 ff\n", E::TagNotUtf8),
            (b"POST -1 1 61\n", E::Number { field: "from" }),
            (b"POST 0 4294967296 61\n", E::Number { field: "to" }),
            (
                b"TAKE 0 1 61 18446744073709551616\n",
                E::Number { field: "millis" },
            ),
            (
                b"TAKE 0 1 61\n",
                E::Arity {
                    command: "TAKE",
                    expected: 4,
                    got: 3,
                },
            ),
        ];
        for (line, expected) in cases {
            assert_eq!(
                parse_request(line),
                Err(expected),
                "{:?}",
                String::from_utf8_lossy(line)
            );
            fuzz_parse(line);
        }
        let tag = format!("POST 0 1 {}\n", "61".repeat(MAX_TAG + 1));
        assert_eq!(
            parse_request(tag.as_bytes()),
            Err(E::Length {
                field: "tag",
                len: MAX_TAG + 1,
                max: MAX_TAG
            })
        );
        for (line, expected) in [
            (
                &b"ERROR\n"[..],
                E::Length {
                    field: "error text",
                    len: 0,
                    max: MAX_ERROR,
                },
            ),
            (
                b"ERROR \n",
                E::Length {
                    field: "error text",
                    len: 0,
                    max: MAX_ERROR,
                },
            ),
            (
                b"ID\n",
                E::Arity {
                    command: "ID",
                    expected: 1,
                    got: 0,
                },
            ),
            (
                b"OK then\n",
                E::Arity {
                    command: "OK",
                    expected: 0,
                    got: 1,
                },
            ),
            (b"AUTH 1 61\n", E::Unknown { kind: "response" }),
        ] {
            assert_eq!(parse_response(line), Err(expected));
        }
    }

    #[test]
    fn the_encoder_refuses_what_the_parser_would() {
        let tag = Request::Post {
            from: 0,
            to: 1,
            tag: "x".repeat(MAX_TAG + 1),
        };
        assert!(encode_request(&tag).is_err());
        let empty = Request::Auth {
            version: 1,
            token: token(""),
        };
        assert!(encode_request(&empty).is_err());
        assert!(encode_response(&Response::UniqueId(vec![])).is_err());
        assert!(encode_response(&Response::Error("a\nb".into())).is_err());
        assert!(encode_response(&Response::Error(String::new())).is_err());
        // Response::error makes any text encodable.
        for text in ["", "a\nb", "é", &"x".repeat(2 * MAX_ERROR)] {
            let line = encode_response(&Response::error(text)).unwrap();
            assert!(parse_response(&line).is_ok(), "{text:?}");
        }
    }

    #[test]
    fn unhex_is_total() {
        let b: Vec<u8> = (0..=255).collect();
        assert_eq!(unhex(&hex(&b)).unwrap(), b);
        // The old `&text[i..i + 2]` panicked on a char boundary here.
        for text in ["abc", "zz", "aéb", "éé", "🦀", "AB", " 0", "+1"] {
            assert_eq!(unhex(text), None, "{text}");
        }
        assert_eq!(unhex(""), Some(vec![]));
    }

    #[test]
    fn read_line_reads_no_more_than_its_bound() {
        let data = [vec![b'A'; 10 * MAX_LINE], b"\n".to_vec()].concat();
        let mut r = std::io::Cursor::new(&data);
        let line = read_line(&mut r).unwrap();
        assert_eq!(line.len(), MAX_LINE + 1);
        assert_eq!(
            parse_request(&line),
            Err(ProtoError::TooLong { max: MAX_LINE })
        );
        let mut r = std::io::Cursor::new(b"ID\nOK\n");
        assert_eq!(read_line(&mut r).unwrap(), b"ID\n");
        assert_eq!(read_line(&mut r).unwrap(), b"OK\n");
        assert_eq!(read_line(&mut r).unwrap(), b"");
    }

    /// Text of 1 to `max` bytes, ASCII or any characters.
    fn text(max: usize) -> impl Strategy<Value = String> {
        prop_oneof![
            "[ -~]{1,40}",
            proptest::collection::vec(any::<char>(), 1..=max)
                .prop_map(|c| c.into_iter().collect::<String>())
                .prop_map(move |t| {
                    // Whole characters, within `max` bytes.
                    let mut end = t.len().min(max);
                    while !t.is_char_boundary(end) {
                        end -= 1;
                    }
                    t[..end].to_string()
                })
                .prop_filter("not empty", |t| !t.is_empty())
        ]
    }

    /// Every kind of request, each field anywhere in its range.
    fn request() -> impl Strategy<Value = Request> {
        let tag = prop_oneof![Just(String::new()), text(MAX_TAG)];
        prop_oneof![
            (
                any::<u32>(),
                proptest::collection::vec(any::<u8>(), 1..=MAX_TOKEN)
            )
                .prop_map(|(version, t)| Request::Auth {
                    version,
                    token: Secret::new(t)
                }),
            Just(Request::UniqueId),
            (any::<u32>(), any::<u32>(), tag.clone()).prop_map(|(from, to, tag)| Request::Post {
                from,
                to,
                tag
            }),
            (any::<u32>(), any::<u32>(), tag, any::<u64>()).prop_map(|(from, to, tag, wait_ms)| {
                Request::Take {
                    from,
                    to,
                    tag,
                    wait_ms,
                }
            }),
            (any::<u32>(), text(MAX_WHY)).prop_map(|(rank, why)| Request::Fail { rank, why }),
            any::<u32>().prop_map(|rank| Request::Beat { rank }),
            (any::<u32>(), any::<u64>())
                .prop_map(|(me, silence_ms)| Request::Health { me, silence_ms }),
            (text(MAX_KEY), 0..=MAX_VALUE).prop_map(|(key, len)| Request::Put { key, len }),
            (text(MAX_KEY), any::<u64>()).prop_map(|(key, wait_ms)| Request::Get { key, wait_ms }),
            (any::<u32>(), 0..=MAX_MAIL).prop_map(|(to, len)| Request::Mail { to, len }),
            (any::<u32>(), any::<u64>()).prop_map(|(me, wait_ms)| Request::Inbox { me, wait_ms }),
            any::<u64>().prop_map(|silence_ms| Request::Ended { silence_ms }),
            text(MAX_KEY).prop_map(|prefix| Request::Keys { prefix }),
        ]
    }

    /// Every kind of response, each field anywhere in its range.
    fn response() -> impl Strategy<Value = Response> {
        prop_oneof![
            Just(Response::Ok),
            Just(Response::Timeout),
            proptest::collection::vec(any::<u8>(), 1..=MAX_ID).prop_map(Response::UniqueId),
            "[ -~]{1,512}".prop_map(Response::Error),
            Just(Response::Healthy),
            (any::<u32>(), text(MAX_WHY)).prop_map(|(rank, why)| Response::Failed { rank, why }),
            (0..=MAX_VALUE).prop_map(Response::Value),
        ]
    }

    /// Lines over the protocol's own alphabet, so that many of them parse.
    fn near_lines() -> impl Strategy<Value = Vec<u8>> {
        let word = prop_oneof![
            Just(b"AUTH".to_vec()),
            Just(b"ID".to_vec()),
            Just(b"POST".to_vec()),
            Just(b"TAKE".to_vec()),
            Just(b"FAIL".to_vec()),
            Just(b"BEAT".to_vec()),
            Just(b"HEALTH".to_vec()),
            Just(b"PUT".to_vec()),
            Just(b"GET".to_vec()),
            Just(b"MAIL".to_vec()),
            Just(b"INBOX".to_vec()),
            Just(b"ENDED".to_vec()),
            Just(b"KEYS".to_vec()),
            Just(b"OK".to_vec()),
            Just(b"TIMEOUT".to_vec()),
            Just(b"ERROR".to_vec()),
            Just(b"HEALTHY".to_vec()),
            Just(b"FAILED".to_vec()),
            Just(b"VALUE".to_vec()),
            Just(b"-".to_vec()),
            "[0-9a-f]{0,6}".prop_map(String::into_bytes),
            "[0-9]{1,21}".prop_map(String::into_bytes),
            proptest::collection::vec(any::<u8>(), 0..4),
        ];
        proptest::collection::vec(word, 0..6).prop_map(|words| {
            let mut line = words.join(&b' ');
            line.push(b'\n');
            line
        })
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic_the_parser(data in proptest::collection::vec(any::<u8>(), 0..2 * MAX_LINE)) {
            fuzz_parse(&data);
        }

        #[test]
        fn near_miss_lines_never_panic_the_parser(line in near_lines()) {
            fuzz_parse(&line);
        }

        #[test]
        fn any_request_round_trips(r in request()) {
            let line = encode_request(&r).unwrap();
            prop_assert!(line.len() <= MAX_LINE);
            prop_assert_eq!(parse_request(&line), Ok(r));
            fuzz_parse(&line);
        }

        #[test]
        fn any_response_round_trips(r in response()) {
            let line = encode_response(&r).unwrap();
            prop_assert!(line.len() <= MAX_LINE);
            prop_assert_eq!(parse_response(&line), Ok(r));
            fuzz_parse(&line);
        }

        #[test]
        fn any_error_text_round_trips(text in ".{0,600}") {
            let r = Response::error(&text);
            let line = encode_response(&r).unwrap();
            prop_assert_eq!(parse_response(&line), Ok(r));
        }
    }
}
