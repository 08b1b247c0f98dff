//! The rendezvous of one-process-per-rank runs ([`crate::Process`]): a small
//! TCP store served by rank 0 that hands out the NCCL unique id and carries
//! `notify` messages between processes.
//!
//! Everything the store reads comes from the network, so it trusts nothing:
//! every line goes through the pure parser of [`proto`] (bounded, strict,
//! never panics; fuzzed by the `store` target in `fuzz/`), every read has a
//! deadline, and nothing is served before the client has shown the job's
//! secret.
//!
//! # Protocol
//!
//! A connection's first line is `AUTH <version> <token-hex>`; the store
//! answers `OK` when the version is [`proto::VERSION`] and the token equals
//! the job's secret (compared in constant time), and otherwise
//! `ERROR <why>` and closes the connection. Then come requests (`ID`,
//! `POST`, `TAKE`, ...; grammar in [`proto`]), each answered before the
//! next is read. A line that does not parse, a request before `AUTH`, or a
//! client silent for 3 s before its `AUTH` gets `ERROR <why>` and the
//! connection is closed; a connection quiet for 10 s between requests is
//! closed without a word. The store goes on serving everyone else (a
//! thread per connection, at most 16,384 at once past their `AUTH`, and no
//! more than the process's limit on open files allows, which the store
//! raises as far as it needs within the hard limit; past that a new
//! connection is told `ERROR busy`, and a client asks again until its
//! request's deadline). Connections not yet past their `AUTH` have a pool
//! of their own (4,096 at once, 256 from one host; past that `ERROR
//! busy`), so that whatever can reach the port without the secret cannot
//! take the places of the ranks' connections (it can still delay new ones
//! while it fills that pool). A `PUT`'s bytes count against the store's
//! limit on stored bytes before they are read; a `PUT` refused as too big
//! for it has its bytes read and dropped, so its client reads the refusal.
//! A rank's trace (`trace/…`) may fill the store to three quarters of its
//! limit at most, leaving the rest to the small values a job's end needs,
//! and a rank's mark that it finished (`done/RANK`) is never refused as too
//! big: a store full of traces kept a rank that finished cleanly from
//! saying so, and the others took it for killed once it fell silent.
//! A reply is sent within 10 s as a whole (a client that reads it a few
//! bytes at a time is cut off there), and a value that a `PUT` replaced
//! while a reply was sending it counts against the limit until that reply
//! lets go of it, so replies in flight cannot hold more than the limit. A
//! `HEALTH` or `ENDED` asking about a silence under 1 s asks about 1 s: a
//! silence found is recorded for every rank that asks (so that all name
//! the same failed rank), and one client asking with no silence at all
//! would otherwise mark every live rank failed.
//! A request that waits (`TAKE`, `GET`, `INBOX`) looks every 200 ms
//! whether its client is still there: once the client has closed the
//! connection (or only its sending side) the wait ends with `TIMEOUT` and
//! takes nothing, so no message is taken for a client that left, and the
//! connection's place comes back at once, not at the end of the wait.
//!
//! A client ([`Store`]) keeps up to four connections open between its
//! requests, each for at most 5 s unused: a rank's health monitor, which
//! asks twice every 200 ms, then makes no new connection at all, where a
//! connection per request cost the store a thread and the client a
//! connect and an `AUTH` round trip each time. A kept connection the store
//! has closed is found closed before any byte of a reply (the store
//! answers every request it reads), and the request goes on a new one.
//!
//! # Environment
//!
//! * `DUPLEX_STORE_TOKEN`: the job's secret, the same on every rank, 16 to
//!   1024 bytes (e.g. `export DUPLEX_STORE_TOKEN=$(openssl rand -hex 16)`).
//! * Otherwise, under torchrun, the secret is derived from
//!   `TORCHELASTIC_RUN_ID` with `MASTER_ADDR`, `MASTER_PORT` and
//!   `WORLD_SIZE`. It is only as secret as the run id: torchrun's
//!   `--standalone` makes a random one, but its default `--rdzv-id` is
//!   `none`, the same for every job, which duplex refuses; a Slurm job id is
//!   guessable. Set `DUPLEX_STORE_TOKEN` when others can reach the port.
//! * Neither: [`secret_from_env`] fails, saying how to set
//!   `DUPLEX_STORE_TOKEN`.
//! * `DUPLEX_STORE_BIND`: the address rank 0 listens on; by default
//!   `MASTER_ADDR` (never every interface unless asked: `0.0.0.0`).
//! * `DUPLEX_PORT`: the port; by default `MASTER_PORT + 1`.
//!
//! Neither the secret nor the unique id is ever logged or put in an error.
//! Both travel in clear text, as NCCL's own bootstrap traffic does: the
//! secret keeps out whoever can reach the port, not whoever can read the
//! network.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use duplex::{Error, Rank};

use crate::board::Board;

pub mod proto;

use proto::{MAX_ID, MAX_TOKEN, Request, Response, VERSION};
pub use proto::{Secret, fuzz_parse, hex, unhex};

/// The shortest `DUPLEX_STORE_TOKEN` accepted, in bytes.
pub const MIN_TOKEN: usize = 16;

/// The longest a `TAKE` waits, whatever it asks for.
pub const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);

const HOW_TO_SET: &str = "set DUPLEX_STORE_TOKEN to the same random value (16 to 1024 bytes) on every rank, e.g. `export DUPLEX_STORE_TOKEN=$(openssl rand -hex 16)` before starting the job";

/// The job's secret, from the environment: `DUPLEX_STORE_TOKEN`, else one
/// derived from torchrun's `TORCHELASTIC_RUN_ID` (see the module docs).
pub fn secret_from_env() -> Result<Secret, Error> {
    // A variable that is set but not text is an error, not an unset one;
    // the run id only where no token takes precedence over it.
    for name in ["DUPLEX_STORE_TOKEN", "TORCHELASTIC_RUN_ID"] {
        match std::env::var(name) {
            Ok(_) => break,
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(Error::Invalid {
                    at: name.into(),
                    message: format!("{name} is not UTF-8 text; {HOW_TO_SET}"),
                });
            }
            Err(std::env::VarError::NotPresent) => {}
        }
    }
    secret_from(|name| std::env::var(name).ok())
}

/// [`secret_from_env`] with `get` in place of the environment.
fn secret_from(get: impl Fn(&str) -> Option<String>) -> Result<Secret, Error> {
    if let Some(token) = get("DUPLEX_STORE_TOKEN") {
        if !(MIN_TOKEN..=MAX_TOKEN).contains(&token.len()) {
            return Err(Error::Invalid {
                at: "DUPLEX_STORE_TOKEN".into(),
                message: format!(
                    "DUPLEX_STORE_TOKEN has {} bytes, not {MIN_TOKEN} to {MAX_TOKEN}; {HOW_TO_SET}",
                    token.len()
                ),
            });
        }
        return Ok(Secret::new(token));
    }
    // No secret is a wrong launcher environment, as a missing RANK is
    // (`duplex run` says `environment`, status 2).
    let unavailable = |how: String| Error::Invalid {
        at: "DUPLEX_STORE_TOKEN".into(),
        message: format!("no secret for the duplex rendezvous: {how}"),
    };
    match get("TORCHELASTIC_RUN_ID") {
        Some(run) if !run.is_empty() && run != "none" => {
            let mut secret = format!("duplex-store-v{VERSION}\n{run}");
            for name in ["MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"] {
                let value = get(name).ok_or_else(|| {
                    unavailable(format!(
                        "TORCHELASTIC_RUN_ID is set but {name} is not; {HOW_TO_SET}"
                    ))
                })?;
                secret.push('\n');
                secret.push_str(&value);
            }
            if secret.len() > MAX_TOKEN {
                return Err(unavailable(format!(
                    "TORCHELASTIC_RUN_ID is too long to derive a token from; {HOW_TO_SET}"
                )));
            }
            Ok(Secret::new(secret))
        }
        Some(_) => Err(unavailable(format!(
            "TORCHELASTIC_RUN_ID is `none` (torchrun's default --rdzv-id, shared by every job); pass torchrun a random --rdzv-id, or {HOW_TO_SET}"
        ))),
        None => Err(unavailable(format!(
            "{HOW_TO_SET} (under torchrun, a random --rdzv-id also works)"
        ))),
    }
}

/// `host:port`, with brackets around an IPv6 host.
fn show(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

fn io(what: &str, e: std::io::Error) -> Error {
    Error::Unavailable {
        what: format!("the duplex rendezvous ({what})"),
        how: format!(
            "{e}; check MASTER_ADDR and MASTER_PORT (duplex listens on MASTER_PORT+1, or DUPLEX_PORT) and that rank 0 is running"
        ),
    }
}

/// `now + t`, or far in the future when that overflows (`Duration::MAX`,
/// say).
pub(crate) fn deadline_after(t: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(t)
        .or_else(|| now.checked_add(MAX_WAIT * 365))
        .unwrap_or(now)
}

/// The longest reply to `KEYS`, in bytes: each is built for its request
/// (a `GET` shares the stored value), so that connections at once cannot
/// hold much. A rank lists the sends left for it (`owed/RANK/`), a few
/// bytes per other rank.
const MAX_KEYS_REPLY: usize = 1 << 20;

/// The server's limits: the defaults, or short ones in tests.
#[derive(Clone, Copy, Debug)]
struct Limits {
    /// How long a client may take to send each line.
    io_timeout: Duration,
    /// Connections served at once past their `AUTH`; more are refused.
    max_connections: usize,
    /// Connections not yet past their `AUTH`, in all and from one host:
    /// they have a pool of their own ([`PreAuth`]), so connections that
    /// never authenticate (anything that can reach the port) cannot take
    /// the slots of the job's ranks.
    max_unauthenticated: usize,
    max_unauthenticated_per_host: usize,
    /// How long a new connection may take to send its `AUTH` line.
    auth_timeout: Duration,
    /// Distinct (from, to, tag) with messages waiting; more are refused.
    max_pending: usize,
    /// Keys `PUT` may create; more are refused.
    max_keys: usize,
    /// Bytes all values together may hold; more are refused.
    max_stored: usize,
    /// Messages all inboxes together may hold; more are refused.
    max_mail: usize,
    /// The shortest silence a `HEALTH` or `ENDED` asks about: one asked
    /// with less is asked with this. A silence found is recorded for every
    /// asker (so that all name the same failed rank), so one client asking
    /// with a silence of 0 would mark every live rank failed; the ranks
    /// ask with [`crate::health::SILENCE`].
    min_silence: Duration,
}

impl Limits {
    /// Whether a `PUT` of `len` bytes under `key` fits when the stored
    /// values (all together, with it) come to `stored` bytes. A rank's
    /// mark that it finished cleanly (`done/RANK`, a few bytes) always
    /// fits (its keys are bounded by [`Limits::max_keys`]): without it a
    /// rank that finished is taken for killed once it falls silent. A
    /// rank's trace (`trace/…`: megabytes at most, for a hang's analysis,
    /// and the job goes on without it) may fill the store only to three
    /// quarters of [`Limits::max_stored`]: the rest stays for the small
    /// values the end of a job needs (`counts/RANK`, `left/RANK`, `owed/…`)
    /// (found by review: a store that traces had filled refused
    /// `done/RANK`, and the rank, silent after it exited, was taken for
    /// killed).
    fn fits(&self, key: &str, len: usize, stored: usize) -> bool {
        if key.starts_with("done/") && len <= 16 {
            return true;
        }
        let room = if key.starts_with("trace/") {
            self.max_stored / 4 * 3
        } else {
            self.max_stored
        };
        stored <= room
    }

    /// The silence a `HEALTH` or `ENDED` asking about `ms` milliseconds
    /// asks about: at least [`Limits::min_silence`].
    fn silence(&self, ms: u64) -> Duration {
        Duration::from_millis(ms).max(self.min_silence)
    }
}

const LIMITS: Limits = Limits {
    io_timeout: Duration::from_secs(10),
    // Clients keep connections open between requests, a few per rank:
    // 1,024 ranks may hold some 3,000.
    max_connections: 1 << 14,
    // A job's ranks connect at once at its start, each sending its AUTH
    // as soon as it is connected: a host of 8 ranks opens a few dozen.
    max_unauthenticated: 4096,
    max_unauthenticated_per_host: 256,
    auth_timeout: Duration::from_secs(3),
    max_pending: 1 << 16,
    // A rank stores up to five keys of its own (`done`, `counts`, `left`,
    // its trace and its early snapshot) and one per rank it left sends for
    // (`owed`): 4,096 keys stopped a job at about 800 ranks.
    max_keys: 1 << 18,
    max_stored: 256 << 20,
    max_mail: 1 << 16,
    min_silence: Duration::from_secs(1),
};

/// What the store knows of the ranks' health. Every rank's monitor asks
/// (`HEALTH`) several times a second, so an answer costs O(log ranks),
/// not a walk over every rank: at N ranks a walk made the store's work
/// grow as N² a second.
#[derive(Debug, Default)]
struct Health {
    /// Failures, posted or silences recorded by [`Shared::check`], in the
    /// order they happened, with when; one per rank.
    failures: Vec<(Rank, String, Instant)>,
    /// Each rank's last heartbeat.
    beats: HashMap<Rank, Instant>,
    /// The last heartbeats of the ranks that have not finished, oldest
    /// first: the ranks silent past any silence are a prefix of it.
    by_beat: std::collections::BTreeSet<(Instant, Rank)>,
    /// The ranks in `failures`: their silence no longer matters, and they
    /// are kept out of `by_beat`, so that the longest-silent rank there is
    /// one not yet recorded.
    failed: std::collections::HashSet<Rank>,
    /// The ranks that stored `done/RANK` (they finished cleanly, and their
    /// silence is no failure), kept as each is stored: a scan of the
    /// stored keys would cost every request all of the job's keys.
    finished: std::collections::BTreeSet<Rank>,
    /// The ranks in `failures` because they fell silent (not because they
    /// posted a failure): one that beats again was frozen, or starved,
    /// and is told that the job took it for dead ([`Shared::check`]).
    silenced: std::collections::HashSet<Rank>,
}

impl Health {
    /// Rank `rank`'s heartbeat at `now`.
    fn beat(&mut self, rank: Rank, now: Instant) {
        if let Some(old) = self.beats.insert(rank, now) {
            self.by_beat.remove(&(old, rank));
        }
        if !self.finished.contains(&rank) && !self.failed.contains(&rank) {
            self.by_beat.insert((now, rank));
        }
    }

    /// Records that `rank` failed at `at`, why, in the order failures
    /// happened; only a rank's first failure counts, and at most 2^16.
    fn record(&mut self, rank: Rank, why: String, at: Instant) {
        if self.failed.contains(&rank) || self.failures.len() >= 1 << 16 {
            return;
        }
        let i = self.failures.partition_point(|(_, _, t)| *t <= at);
        self.failures.insert(i, (rank, why, at));
        self.failed.insert(rank);
        if let Some(b) = self.beats.get(&rank) {
            self.by_beat.remove(&(*b, rank));
        }
    }

    /// Rank `rank` finished cleanly: its silence from now on is no failure.
    fn finish(&mut self, rank: Rank) {
        if self.finished.insert(rank)
            && let Some(at) = self.beats.get(&rank)
        {
            self.by_beat.remove(&(*at, rank));
        }
    }

    /// The ranks that sent a heartbeat once and none for longer than
    /// `silence`, except `me` and those that finished, longest silent
    /// first (the lower rank first among equals), each with how long.
    fn silent(
        &self,
        me: Option<Rank>,
        silence: Duration,
    ) -> impl Iterator<Item = (Rank, Duration)> + '_ {
        let now = Instant::now();
        self.by_beat
            .iter()
            .map(move |(at, r)| (*r, now.saturating_duration_since(*at)))
            .take_while(move |(_, quiet)| *quiet > silence)
            .filter(move |(r, _)| Some(*r) != me)
    }
}

/// A stored value. One that a `PUT` replaced while a `GET` was sending it
/// is retired: its bytes count against the store's limit
/// ([`Values::retired`]) until the last sender lets go of it, so that
/// replies in flight cannot hold more than the limit.
#[derive(Debug)]
struct Value {
    data: Vec<u8>,
    /// [`Values::retired`], where this value's bytes are counted once it
    /// is replaced, and given back when it drops.
    retired: Arc<AtomicUsize>,
    is_retired: AtomicBool,
}

impl Value {
    /// The bytes a `PUT` of `key` that replaces this value frees: the key
    /// and the value, or only the key when a reply still holds the value
    /// (it stays, retired). Asked under the values' lock, where the
    /// holders can only go down (a `GET` clones the value under it).
    fn freed(self: &Arc<Value>, key: &str) -> usize {
        if Arc::strong_count(self) == 1 {
            key.len() + self.data.len()
        } else {
            key.len()
        }
    }

    /// Takes it out of the store: its bytes count as retired until it
    /// drops.
    fn retire(&self) {
        self.retired.fetch_add(self.data.len(), Ordering::AcqRel);
        self.is_retired.store(true, Ordering::Release);
    }
}

impl Drop for Value {
    fn drop(&mut self) {
        if self.is_retired.load(Ordering::Acquire) {
            self.retired.fetch_sub(self.data.len(), Ordering::AcqRel);
        }
    }
}

/// Values stored by `PUT`.
#[derive(Debug, Default)]
struct Values {
    map: HashMap<String, Arc<Value>>,
    bytes: usize,
    /// The bytes of values replaced while a reply still holds them
    /// ([`Value::retire`]).
    retired: Arc<AtomicUsize>,
    /// The `PUT`s in flight per key ([`Shared::reserve`]).
    replacing: HashMap<String, u32>,
    /// The bytes of `PUT` bodies being read ([`Shared::reserve`]): they
    /// count against the store's limit before they are read, so bodies in
    /// flight on many connections cannot hold more than it.
    reserved: usize,
}

/// The store's state, shared by the connections' threads.
#[derive(Debug)]
struct Shared {
    id: Vec<u8>,
    secret: Secret,
    limits: Limits,
    counts: Mutex<HashMap<(Rank, Rank, String), u64>>,
    arrived: Condvar,
    active: AtomicUsize,
    /// Connections not yet past their `AUTH`, by the client's address.
    unauthenticated: Mutex<HashMap<std::net::IpAddr, usize>>,
    health: Mutex<Health>,
    values: Mutex<Values>,
    stored: Condvar,
    /// Each rank's inbox (`MAIL`/`INBOX`), oldest first.
    mail: Mutex<Inboxes>,
    mailed: Condvar,
}

/// The inboxes of `MAIL`.
#[derive(Debug, Default)]
struct Inboxes {
    boxes: HashMap<Rank, std::collections::VecDeque<Vec<u8>>>,
    /// Messages held, all inboxes together.
    held: usize,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(Rank, Rank, String), u64>> {
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn post(&self, key: (Rank, Rank, String)) -> Result<Response, End> {
        let mut counts = self.lock();
        if !counts.contains_key(&key) && counts.len() >= self.limits.max_pending {
            return Err(End::Refuse("too many pending notify messages".into()));
        }
        let n = counts.entry(key).or_insert(0);
        *n = n.saturating_add(1);
        self.arrived.notify_all();
        Ok(Response::Ok)
    }

    fn health(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn values(&self) -> std::sync::MutexGuard<'_, Values> {
        self.values.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn fail(&self, rank: Rank, why: String) -> Response {
        self.health().record(rank, why, Instant::now());
        Response::Ok
    }

    fn beat(&self, rank: Rank) -> Result<Response, End> {
        let mut h = self.health();
        if !h.beats.contains_key(&rank) && h.beats.len() >= 1 << 20 {
            return Err(End::Refuse("too many ranks".into()));
        }
        h.beat(rank, Instant::now());
        Ok(Response::Ok)
    }

    /// The first failure of another rank than `me`, in the order the
    /// failures happened: a posted failure at its post, a silent rank at
    /// the moment its silence passed `silence_ms` (a rank that stored
    /// `done/RANK` finished cleanly: its silence is no failure).
    ///
    /// A rank killed or frozen posts nothing; the ranks that learn of its
    /// silence fail in turn and post their failures, which name it as
    /// their cause. Reporting posts before silence named such an echo as
    /// the failed rank to a rank that asked a moment later (seen with four
    /// ranks in a ring on one H200: "rank 3 failed: ... because rank 2
    /// failed"). So the first ask that finds a rank silent records its
    /// silence as a failure, dated when the silence passed the mark, among
    /// the posted ones: every later ask gets the same answer, even if the
    /// rank beats again (a frozen process resumed: the job has failed by
    /// then). That rank itself, asking once it runs again, gets its own
    /// silence when no other failure is on record: `Failed` naming `me`.
    fn check(&self, me: Rank, silence_ms: u64) -> Response {
        let mut h = self.health();
        let silence = self.limits.silence(silence_ms);
        // Recorded ranks are out of the beat order: the longest silent is
        // one not yet recorded, found in O(log ranks).
        let longest = h.silent(Some(me), silence).next();
        if let Some((rank, quiet)) = longest {
            let now = Instant::now();
            let at = now.checked_sub(quiet - silence).unwrap_or(now);
            let why = format!(
                "no heartbeat for {} ms: the process was killed, crashed or is frozen",
                quiet.as_millis()
            );
            h.silenced.insert(rank);
            h.record(rank, why, at);
        }
        if let Some((rank, why, _)) = h.failures.iter().find(|(r, _, _)| *r != me) {
            return Response::Failed {
                rank: *rank,
                why: why.clone(),
            };
        }
        // Only this rank's own silence is on record: it was frozen (or
        // starved) past the silence, the others ended their waits on it,
        // and it asks again now that it runs (found by review: it went on
        // as if the job were whole, and its next op on a partner that had
        // aborted waited out its whole deadline). Told so, it ends too.
        if h.silenced.contains(&me)
            && let Some((_, why, _)) = h.failures.iter().find(|(r, _, _)| *r == me)
        {
            return Response::Failed {
                rank: me,
                why: format!(
                    "the other ranks took rank {me} for dead, and the job has ended: {why}"
                ),
            };
        }
        Response::Healthy
    }

    /// Reserves room for a `PUT` of `len` bytes under `key` before its body
    /// is read: refused as a full store when the stored values, the bodies
    /// being read and this one would pass the limit (a key's value that it
    /// replaces counts as freed). The room is given back when the returned
    /// guard drops, once the body is stored or refused.
    fn reserve(&self, key: &str, len: usize) -> Result<Reserved<'_>, End> {
        let mut v = self.values();
        // The value a PUT replaces counts as freed for one PUT of the key
        // in flight only: two at once were each credited with it.
        let old = if v.replacing.contains_key(key) {
            0
        } else {
            v.map.get(key).map_or(0, |x| x.freed(key))
        };
        let new = key.len() + len;
        let retired = v.retired.load(Ordering::Acquire);
        let stored = (v.bytes + v.reserved + retired).saturating_sub(old) + new;
        if !self.limits.fits(key, len, stored) {
            return Err(End::Refuse("the store is full".into()));
        }
        v.reserved += new;
        *v.replacing.entry(key.to_string()).or_insert(0) += 1;
        Ok(Reserved {
            shared: self,
            key: key.to_string(),
            bytes: new,
        })
    }

    fn put(&self, key: String, value: Vec<u8>) -> Result<Response, End> {
        let mut v = self.values();
        // A key's bytes count with its value's.
        // What the map holds for the key now, and what replacing it frees.
        let (old, freed) = v
            .map
            .get(&key)
            .map_or((0, 0), |x| (key.len() + x.data.len(), x.freed(&key)));
        let new = key.len() + value.len();
        if old == 0 && !v.map.contains_key(&key) && v.map.len() >= self.limits.max_keys {
            return Err(End::Refuse("too many stored values".into()));
        }
        let retired = v.retired.load(Ordering::Acquire);
        let stored = (v.bytes - freed + retired).saturating_add(new);
        if !self.limits.fits(&key, value.len(), stored) {
            return Err(End::Refuse("the store is full".into()));
        }
        v.bytes = v.bytes - old + new;
        // Only the key a rank stores as it finishes (`done/RANK`, the rank
        // in decimal as written): `done/+1` or `done/01` finish no rank.
        let done = key
            .strip_prefix("done/")
            .and_then(|r| r.parse::<Rank>().ok().filter(|n| n.to_string() == r));
        let value = Arc::new(Value {
            data: value,
            retired: v.retired.clone(),
            is_retired: false.into(),
        });
        if let Some(old) = v.map.insert(key, value) {
            // Counted as retired until the replies sending it let go (at
            // once, when none does).
            old.retire();
        }
        drop(v);
        // The values' lock is let go first: no thread holds both. Waiters
        // are woken after, so one woken by `done/RANK` finds RANK finished.
        if let Some(r) = done {
            self.health().finish(r);
        }
        self.stored.notify_all();
        Ok(Response::Ok)
    }

    fn get(&self, key: &str, wait_ms: u64, gone: &dyn Fn() -> bool) -> Option<Arc<Value>> {
        wait_for(&self.values, &self.stored, wait_ms, gone, |v| {
            v.map.get(key).cloned()
        })
    }

    /// The reply to `KEYS prefix`: the hex of each stored key that starts
    /// with `prefix`, ascending, separated by spaces; refused when it
    /// would not fit in one value.
    fn keys(&self, prefix: &str) -> Result<Vec<u8>, End> {
        let v = self.values();
        let mut keys: Vec<&str> = v
            .map
            .keys()
            .filter(|k| k.starts_with(prefix))
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        let len: usize = keys.iter().map(|k| 2 * k.len() + 1).sum();
        if len > MAX_KEYS_REPLY {
            return Err(End::Refuse(format!(
                "{} keys start with that prefix: too many to list",
                keys.len()
            )));
        }
        Ok(keys
            .iter()
            .map(|k| proto::hex(k.as_bytes()))
            .collect::<Vec<_>>()
            .join(" ")
            .into_bytes())
    }

    fn inboxes(&self) -> std::sync::MutexGuard<'_, Inboxes> {
        self.mail.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn mail(&self, to: Rank, message: Vec<u8>) -> Result<Response, End> {
        let mut m = self.inboxes();
        if m.held >= self.limits.max_mail {
            return Err(End::Refuse("too many messages in the inboxes".into()));
        }
        m.held += 1;
        m.boxes.entry(to).or_default().push_back(message);
        self.mailed.notify_all();
        Ok(Response::Ok)
    }

    fn inbox(&self, me: Rank, wait_ms: u64, gone: &dyn Fn() -> bool) -> Option<Vec<u8>> {
        wait_for(&self.mail, &self.mailed, wait_ms, gone, |m| {
            let q = m.boxes.get_mut(&me)?;
            let message = q.pop_front()?;
            if q.is_empty() {
                m.boxes.remove(&me);
            }
            m.held -= 1;
            Some(message)
        })
    }

    fn take(&self, key: (Rank, Rank, String), wait_ms: u64, gone: &dyn Fn() -> bool) -> Response {
        let taken = wait_for(&self.counts, &self.arrived, wait_ms, gone, |counts| {
            let n = counts.get_mut(&key).filter(|n| **n > 0)?;
            *n -= 1;
            if *n == 0 {
                counts.remove(&key);
            }
            Some(())
        });
        match taken {
            Some(()) => Response::Ok,
            None => Response::Timeout,
        }
    }
}

/// How often a waiting request looks whether its client is still there.
const GONE_EVERY: Duration = Duration::from_millis(200);

/// Waits on `cv` until `take` finds what it looks for in the state under
/// `m`, or `wait_ms` (at most [`MAX_WAIT`]) has passed, or `gone` says the
/// client left (asked every [`GONE_EVERY`], without the lock): then `None`,
/// and nothing was taken.
fn wait_for<S, T>(
    m: &Mutex<S>,
    cv: &Condvar,
    wait_ms: u64,
    gone: &dyn Fn() -> bool,
    mut take: impl FnMut(&mut S) -> Option<T>,
) -> Option<T> {
    let lock = || m.lock().unwrap_or_else(|e| e.into_inner());
    let deadline = Instant::now() + Duration::from_millis(wait_ms).min(MAX_WAIT);
    let mut look = Instant::now() + GONE_EVERY;
    let mut state = lock();
    loop {
        if let Some(t) = take(&mut state) {
            return Some(t);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        if now >= look {
            drop(state);
            if gone() {
                return None;
            }
            look = now + GONE_EVERY;
            state = lock();
            continue;
        }
        state = cv
            .wait_timeout(state, deadline.min(look) - now)
            .map(|(g, _)| g)
            .unwrap_or_else(|e| e.into_inner().0);
    }
}

/// Whether the client of `conn` has closed the connection, or its sending
/// side, or the connection broke: looked at without blocking and without
/// reading (bytes the client sent ahead stay for its next request).
fn client_gone(conn: &TcpStream) -> bool {
    if conn.set_nonblocking(true).is_err() {
        return false;
    }
    let mut byte = [0u8; 1];
    let gone = match conn.peek(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
        ),
    };
    // Back to blocking reads (with their deadlines) for the next request;
    // a socket that cannot be is of no more use.
    gone | conn.set_nonblocking(false).is_err()
}

/// A connection's place among [`Limits::max_connections`], given back on
/// drop.
#[derive(Debug)]
struct Slot(Arc<Shared>);

impl Slot {
    fn take(shared: &Arc<Shared>) -> Option<Slot> {
        let max = shared.limits.max_connections;
        shared
            .active
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot(shared.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A slot of a connection not yet past its `AUTH`, from `host`: taken at
/// accept, given back on drop, once the connection authenticated (it then
/// takes a [`Slot`]) or ended. Bounded in all and per host
/// ([`Limits::max_unauthenticated`]), apart from the slots of
/// authenticated connections.
struct PreAuth {
    shared: Arc<Shared>,
    host: std::net::IpAddr,
}

impl PreAuth {
    /// A slot for a connection from `host`, or why there is none.
    fn take(shared: &Arc<Shared>, host: std::net::IpAddr) -> Result<PreAuth, &'static str> {
        let mut u = shared
            .unauthenticated
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let all: usize = u.values().sum();
        if all >= shared.limits.max_unauthenticated {
            return Err("too many connections not yet authenticated");
        }
        let here = u.entry(host).or_insert(0);
        if *here >= shared.limits.max_unauthenticated_per_host {
            return Err("too many connections not yet authenticated from this host");
        }
        *here += 1;
        Ok(PreAuth {
            shared: shared.clone(),
            host,
        })
    }
}

impl Drop for PreAuth {
    fn drop(&mut self) {
        let mut u = self
            .shared
            .unauthenticated
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(n) = u.get_mut(&self.host) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                u.remove(&self.host);
            }
        }
    }
}

/// Reads a stream until a deadline: each read waits only for what is left,
/// so a client that trickles bytes cannot hold a thread past it.
#[derive(Debug)]
struct DeadlineReader<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

/// What is left until `deadline`, as a socket timeout: `TimedOut` once it
/// has passed (a zero timeout would mean none at all).
fn time_left(deadline: Instant) -> std::io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(std::io::ErrorKind::TimedOut.into());
    }
    Ok(left)
}

impl Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.stream
            .set_read_timeout(Some(time_left(self.deadline)?))?;
        let mut stream = self.stream;
        stream.read(buf)
    }
}

/// The writing side of [`DeadlineReader`]: each write waits only for what
/// is left of one deadline, so a peer that reads a byte at a time cannot
/// stretch a request past it.
struct DeadlineWriter<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

impl Write for DeadlineWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stream
            .set_write_timeout(Some(time_left(self.deadline)?))?;
        let mut stream = self.stream;
        stream.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let mut stream = self.stream;
        stream.flush()
    }
}

/// How a connection ends early.
#[derive(Debug)]
enum End {
    /// Reply `ERROR` with this text, then close.
    Refuse(String),
    /// The client is gone (or the connection broke): just close.
    Gone,
}

/// The next request of a connection, or how the connection ends.
fn next_request(reader: &mut BufReader<DeadlineReader<'_>>) -> Result<Request, End> {
    let line = proto::read_line(reader).map_err(|e| match e.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => {
            End::Refuse("timed out waiting for a request".into())
        }
        _ => End::Gone,
    })?;
    if line.is_empty() {
        return Err(End::Gone);
    }
    proto::parse_request(&line).map_err(|e| End::Refuse(e.to_string()))
}

/// Sends a reply, all of it within `timeout` (a client that reads a byte
/// at a time cannot hold the connection's thread past it).
fn send(conn: &TcpStream, response: &Response, timeout: Duration) -> Result<(), End> {
    send_all(conn, response, &[], timeout)
}

/// A reply line and the bytes that follow it, under one deadline.
fn send_all(
    conn: &TcpStream,
    response: &Response,
    bytes: &[u8],
    timeout: Duration,
) -> Result<(), End> {
    let line = proto::encode_response(response).map_err(|e| End::Refuse(e.to_string()))?;
    let mut w = DeadlineWriter {
        stream: conn,
        deadline: Instant::now() + timeout,
    };
    w.write_all(&line)
        .and_then(|()| w.write_all(bytes))
        .map_err(|_| End::Gone)
}

/// Room for a `PUT` body being read ([`Shared::reserve`]), given back on
/// drop.
struct Reserved<'a> {
    shared: &'a Shared,
    key: String,
    bytes: usize,
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        let mut v = self.shared.values();
        v.reserved = v.reserved.saturating_sub(self.bytes);
        if let Some(n) = v.replacing.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                v.replacing.remove(&self.key);
            }
        }
    }
}

/// The `len` bytes that follow a `PUT` or `MAIL` line: exactly that many,
/// under a fresh deadline, never more.
fn read_body(
    reader: &mut BufReader<DeadlineReader<'_>>,
    len: usize,
    timeout: Duration,
) -> Result<Vec<u8>, End> {
    reader.get_mut().deadline = Instant::now() + timeout;
    let mut value = Vec::with_capacity(len.min(1 << 20));
    let got = reader
        .by_ref()
        .take(len as u64)
        .read_to_end(&mut value)
        .map_err(|_| End::Refuse("timed out reading a value".into()))?;
    if got != len {
        return Err(End::Refuse(format!(
            "truncated value: {got} of {len} bytes"
        )));
    }
    Ok(value)
}

/// Reads and drops the `len` bytes that follow a request refused before
/// its body was read, under a fresh deadline, holding none of them.
fn skip_body(
    reader: &mut BufReader<DeadlineReader<'_>>,
    len: usize,
    timeout: Duration,
) -> Result<(), End> {
    reader.get_mut().deadline = Instant::now() + timeout;
    let skipped = std::io::copy(&mut reader.by_ref().take(len as u64), &mut std::io::sink())
        .map_err(|_| End::Gone)?;
    if skipped as usize != len {
        return Err(End::Gone);
    }
    Ok(())
}

/// A `VALUE` reply: the line, then the bytes, within `timeout`.
fn send_value(conn: &TcpStream, bytes: &[u8], timeout: Duration) -> Result<(), End> {
    send_all(conn, &Response::Value(bytes.len()), bytes, timeout)
}

/// One connection: `AUTH` (within [`Limits::auth_timeout`], holding
/// `pre`), then, holding a [`Slot`] in its place, requests, each answered
/// before the next is read, until the client closes it or falls quiet.
fn session(conn: &TcpStream, shared: &Arc<Shared>, pre: PreAuth) -> Result<(), End> {
    let timeout = shared.limits.io_timeout;
    let mut reader = BufReader::with_capacity(
        proto::MAX_LINE + 1,
        DeadlineReader {
            stream: conn,
            deadline: Instant::now() + shared.limits.auth_timeout.min(timeout),
        },
    );
    match next_request(&mut reader)? {
        Request::Auth { version, .. } if version != VERSION => {
            return Err(End::Refuse(format!(
                "unsupported protocol version {version} (this store speaks {VERSION})"
            )));
        }
        Request::Auth { token, .. } if token == shared.secret => {}
        Request::Auth { .. } => return Err(End::Refuse("bad token".into())),
        _ => return Err(End::Refuse("authenticate first (AUTH)".into())),
    }
    let Some(_slot) = Slot::take(shared) else {
        return Err(End::Refuse("busy: too many connections".into()));
    };
    drop(pre);
    send(conn, &Response::Ok, timeout)?;
    loop {
        reader.get_mut().deadline = Instant::now() + timeout;
        // Between requests, a client that sends nothing for the I/O
        // timeout is done with the connection (it keeps one unused for
        // half as long), as is one that closed it: close it without a
        // word. Once a byte of a request came, the request is answered.
        if !matches!(reader.fill_buf(), Ok(b) if !b.is_empty()) {
            return Err(End::Gone);
        }
        let request = next_request(&mut reader)?;
        serve_one(conn, &mut reader, shared, request)?;
    }
}

/// Serves one request of an authenticated connection: its reply is sent
/// when this returns `Ok`.
fn serve_one(
    conn: &TcpStream,
    reader: &mut BufReader<DeadlineReader<'_>>,
    shared: &Shared,
    request: Request,
) -> Result<(), End> {
    let timeout = shared.limits.io_timeout;
    let gone = || client_gone(conn);
    let response = match request {
        Request::Auth { .. } => return Err(End::Refuse("already authenticated".into())),
        Request::UniqueId => Response::UniqueId(shared.id.clone()),
        Request::Post { from, to, tag } => shared.post((from, to, tag))?,
        Request::Take {
            from,
            to,
            tag,
            wait_ms,
        } => shared.take((from, to, tag), wait_ms, &gone),
        Request::Fail { rank, why } => shared.fail(rank, why),
        Request::Beat { rank } => shared.beat(rank)?,
        Request::Health { me, silence_ms } => shared.check(me, silence_ms),
        Request::Put { key, len } => {
            let room = match shared.reserve(&key, len) {
                Ok(room) => room,
                Err(full) => {
                    // Its bytes are read and dropped (none kept), so the
                    // client, still sending them, reads the refusal
                    // rather than a broken connection.
                    skip_body(reader, len, timeout)?;
                    return Err(full);
                }
            };
            let value = read_body(reader, len, timeout)?;
            // Given back first: the value's bytes count as stored now.
            drop(room);
            shared.put(key, value)?
        }
        Request::Mail { to, len } => {
            let message = read_body(reader, len, timeout)?;
            shared.mail(to, message)?
        }
        Request::Ended { silence_ms } => {
            let h = shared.health();
            let mut ranks: Vec<Rank> = h.finished.iter().copied().collect();
            ranks.extend(
                h.silent(None, shared.limits.silence(silence_ms))
                    .map(|(r, _)| r),
            );
            ranks.extend(h.failures.iter().map(|(r, _, _)| *r));
            drop(h);
            ranks.sort_unstable();
            ranks.dedup();
            let text: Vec<String> = ranks.iter().map(Rank::to_string).collect();
            let body = text.join(",").into_bytes();
            return send_value(conn, &body, timeout);
        }
        Request::Keys { prefix } => {
            let body = shared.keys(&prefix)?;
            return send_value(conn, &body, timeout);
        }
        Request::Inbox { me, wait_ms } => match shared.inbox(me, wait_ms, &gone) {
            Some(message) => {
                return send_value(conn, &message, timeout);
            }
            None => Response::Timeout,
        },
        Request::Get { key, wait_ms } => match shared.get(&key, wait_ms, &gone) {
            Some(value) => {
                return send_value(conn, &value.data, timeout);
            }
            None => Response::Timeout,
        },
    };
    send(conn, &response, timeout)
}

/// Refuses a connection: `ERROR text`, then a clean close (what else the
/// client sent is read and dropped, for at most 200 ms and 16 KiB, so that
/// the close does not reset the connection before the client has read the
/// reply).
fn refuse(conn: &TcpStream, text: &str) {
    let mut c = conn;
    if let Ok(line) = proto::encode_response(&Response::error(text))
        && c.write_all(&line).is_ok()
        && conn.shutdown(Shutdown::Write).is_ok()
    {
        let mut rest = DeadlineReader {
            stream: conn,
            deadline: Instant::now() + Duration::from_millis(200),
        }
        .take(4 * proto::MAX_LINE as u64);
        let _ = std::io::copy(&mut rest, &mut std::io::sink());
    }
}

fn handle(conn: TcpStream, pre: PreAuth) {
    let shared = pre.shared.clone();
    let _ = conn.set_write_timeout(Some(shared.limits.io_timeout));
    let _ = conn.set_nodelay(true);
    if let Err(End::Refuse(text)) = session(&conn, &shared, pre) {
        // The text says what was wrong with the request; it never holds the
        // secret or the unique id.
        tracing::debug!(peer = ?conn.peer_addr().ok(), "duplex store: refused a request: {text}");
        refuse(&conn, &text);
    }
}

fn serve_on(
    listener: TcpListener,
    id: Vec<u8>,
    secret: Secret,
    limits: Limits,
) -> Result<SocketAddr, Error> {
    if !(1..=MAX_ID).contains(&id.len()) {
        return Err(Error::Invalid {
            at: "the duplex rendezvous".into(),
            message: format!("a unique id of {} bytes, not 1 to {MAX_ID}", id.len()),
        });
    }
    let addr = listener
        .local_addr()
        .map_err(|e| io("reading the listening address", e))?;
    let shared = Arc::new(Shared {
        id,
        secret,
        limits,
        counts: Mutex::new(HashMap::new()),
        arrived: Condvar::new(),
        active: AtomicUsize::new(0),
        unauthenticated: Mutex::new(HashMap::new()),
        health: Mutex::new(Health::default()),
        values: Mutex::new(Values::default()),
        stored: Condvar::new(),
        mail: Mutex::new(Inboxes::default()),
        mailed: Condvar::new(),
    });
    std::thread::Builder::new()
        .name("duplex-store".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let conn = match conn {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of descriptors, say: do not spin.
                        tracing::debug!("duplex store: accept failed: {e}");
                        std::thread::sleep(Duration::from_millis(10));
                        continue;
                    }
                };
                let host = match conn.peer_addr() {
                    Ok(a) => a.ip(),
                    Err(_) => continue,
                };
                let pre = match PreAuth::take(&shared, host) {
                    Ok(p) => p,
                    Err(why) => {
                        tell_busy(&conn, why);
                        continue;
                    }
                };
                // A connection lives as long as its client keeps it: a
                // thread each. One that cannot start (a limit on threads or
                // processes) is told so, rather than closed without a word.
                let told = conn.try_clone();
                let spawned = std::thread::Builder::new()
                    .name("duplex-store-conn".into())
                    .stack_size(256 << 10)
                    .spawn(move || handle(conn, pre));
                if let Err(e) = spawned {
                    tracing::warn!(
                        "duplex store: cannot start a thread for a connection ({e}); it is refused"
                    );
                    if let Ok(c) = told {
                        tell_busy(&c, "cannot start a thread for this connection");
                    }
                }
            }
        })
        .map_err(|e| io("starting the store thread", e))?;
    Ok(addr)
}

/// Tells a connection the store will not serve `ERROR busy: why`, from the
/// accepting thread: one write, waiting at most a second, no draining (as
/// [`refuse`] does on a connection's own thread).
fn tell_busy(conn: &TcpStream, why: &str) {
    let _ = conn.set_write_timeout(Some(Duration::from_secs(1)));
    if let Ok(line) = proto::encode_response(&Response::error(&format!("busy: {why}"))) {
        let mut c = conn;
        let _ = c.write_all(&line);
    }
}

/// The longest queue of connections not yet accepted that the store asks
/// of the system, which caps it (Linux: `net.core.somaxconn`, 4,096 since
/// 5.4). The system's own cap is the point: a job's ranks all connect at
/// its start.
const BACKLOG: libc::c_int = 1 << 16;

/// Widens the queue of `listener`'s connections not yet accepted from the
/// 128 that `std` gives every listener to [`BACKLOG`], as far as the
/// system allows (a second `listen` on a listening socket sets only its
/// queue's length). With 128, a job whose ranks connect at once overflows
/// it: the system drops the connects past it, and their clients wait for
/// a retransmission, a second or more, each (at 2,048 ranks on one
/// machine: polls of more than a second, and failed ones,
/// `examples/store.rs`). `None` when the system refused; else the length
/// asked for, capped by the system's cap where it can be read
/// (`/proc/sys/net/core/somaxconn`), for the store's debug event.
fn widen_backlog(listener: &TcpListener) -> Option<u32> {
    use std::os::fd::AsRawFd;
    // SAFETY: `listen` on a socket this process owns, which is listening:
    // it only changes the length of its queue.
    if unsafe { libc::listen(listener.as_raw_fd(), BACKLOG) } != 0 {
        tracing::debug!(
            "duplex store: cannot widen the listening queue: {}",
            std::io::Error::last_os_error()
        );
        return None;
    }
    let cap = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok());
    Some(cap.map_or(BACKLOG as u32, |c| c.min(BACKLOG as u32)))
}

/// Raises this process's limit on open files to what the store may need
/// (its most connections and 1,024 more for the rest of the process), or
/// to the hard limit if that is lower; never lowers it (a hard limit of a
/// billion, as `LimitNOFILE=infinity` gives, would slow whatever closes
/// every descriptor up to the limit, in this process and its children).
/// The soft limit after, if it can be read.
fn raise_file_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit for getrlimit and setrlimit to read
    // and write.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return None;
        }
        let want = (LIMITS.max_connections as u64 + 1024).min(lim.rlim_max);
        if lim.rlim_cur < want {
            let raised = libc::rlimit {
                rlim_cur: want,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim.rlim_cur = want;
            }
        }
    }
    Some(lim.rlim_cur)
}

/// The connections the store serves at once within a limit of `files`
/// open files: the default, or fewer, leaving 256 for the rest of the
/// process (a rank's own files, NCCL's sockets), so that a client past
/// the limit is told the store is busy rather than left unaccepted.
fn connections_within(files: Option<u64>) -> usize {
    match files {
        Some(f) => usize::try_from(f.saturating_sub(256))
            .unwrap_or(usize::MAX)
            .clamp(64, LIMITS.max_connections),
        None => LIMITS.max_connections,
    }
}

/// How many connections a client keeps open between requests.
const KEPT: usize = 4;

/// How long a client keeps a connection it does not use: the store closes
/// one that has been quiet for its I/O timeout (10 s), and a client that
/// reused it then would only find it closed.
const KEPT_IDLE: Duration = Duration::from_secs(5);

/// How an exchange on a connection failed.
#[derive(Debug)]
enum Exchange {
    /// The connection was closed before any byte of the reply: the store
    /// never read the request (on a connection kept idle, it closed it).
    Unanswered(Error),
    /// Anything else: the request may have been served.
    Failed(Error),
}

impl Exchange {
    fn error(self) -> Error {
        match self {
            Exchange::Unanswered(e) | Exchange::Failed(e) => e,
        }
    }
}

/// Whether `e` says the peer closed the connection.
fn closed(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(e.kind(), ConnectionReset | ConnectionAborted | BrokenPipe)
}

/// A client of the TCP store served by rank 0: the NCCL unique id and the
/// message board.
#[derive(Debug)]
pub struct Store {
    host: String,
    port: u16,
    secret: Secret,
    /// Whether a connection to the store ever succeeded (shared by clones):
    /// from then on a refused connection means the store's process is
    /// gone, and a request fails at once instead of retrying until its
    /// deadline.
    reached: Arc<AtomicBool>,
    /// Connections past their `AUTH`, each with when its last exchange
    /// ended, for the next requests (the last one kept is used first).
    kept: Mutex<Vec<(TcpStream, Instant)>>,
    /// How many it keeps at most: [`KEPT`].
    keep_at_most: usize,
    /// When the store last answered a request of this client, whatever
    /// it said ([`Store::last_heard`]).
    heard: Mutex<Option<Instant>>,
}

impl Store {
    /// Serves the store on `bind:port` in background threads, handing out
    /// `id` to every client that shows `secret`. Returns the address it
    /// listens on (port 0 picks a free one).
    pub fn serve(bind: &str, port: u16, id: Vec<u8>, secret: Secret) -> Result<SocketAddr, Error> {
        let listener = TcpListener::bind((bind, port)).map_err(|e| Error::Unavailable {
            what: format!("the duplex rendezvous (listening on {})", show(bind, port)),
            how: format!(
                "{e}; rank 0 listens on MASTER_ADDR (or DUPLEX_STORE_BIND) at MASTER_PORT+1 (or DUPLEX_PORT): set DUPLEX_STORE_BIND to an address of this machine (0.0.0.0 for every interface), or DUPLEX_PORT to a free port"
            ),
        })?;
        let backlog = widen_backlog(&listener);
        // Each connection is a descriptor of this process, and clients keep
        // theirs open between requests: a few per rank.
        let files = raise_file_limit();
        let limits = Limits {
            max_connections: connections_within(files),
            ..LIMITS
        };
        tracing::debug!(
            files = ?files,
            max_connections = limits.max_connections,
            backlog = ?backlog,
            "duplex store: serving"
        );
        serve_on(listener, id, secret, limits)
    }

    /// A client of the store at `host:port`, showing `secret`.
    pub fn client(host: impl Into<String>, port: u16, secret: Secret) -> Store {
        Store {
            host: host.into(),
            port,
            secret,
            reached: Arc::new(AtomicBool::new(false)),
            kept: Mutex::new(Vec::new()),
            keep_at_most: KEPT,
            heard: Mutex::new(None),
        }
    }

    /// When the store last answered a request of this client, whatever it
    /// said: one that refuses connections as busy, or a request as too
    /// big, is alive, and its host with it (the health monitor takes rank
    /// 0 for dead only when the store has answered nothing for
    /// [`crate::health::SILENCE`]).
    pub(crate) fn last_heard(&self) -> Option<Instant> {
        *self.heard.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps at most `n` connections open between requests (4 by
    /// default); 0 opens one per request, as duplex did before version 5
    /// of the protocol. For `examples/store.rs`, which compares the two.
    #[doc(hidden)]
    pub fn keep_connections(mut self, n: usize) -> Store {
        self.keep_at_most = n;
        self
    }

    fn addr(&self) -> String {
        show(&self.host, self.port)
    }

    /// A connection, retried until `deadline`: rank 0 may not listen yet.
    /// Once the store was reached, a refused connection is not retried:
    /// nothing listens any more, so its host (rank 0) is gone, and every
    /// waiting request (the health monitor's among them) learns it at once.
    fn connect(&self, deadline: Instant) -> Result<TcpStream, Error> {
        let mut last = None;
        loop {
            let addrs = (self.host.as_str(), self.port)
                .to_socket_addrs()
                .map_err(|e| io(&format!("resolving {}", self.addr()), e))?;
            // Refused by every address (a timeout, or a full backlog that
            // drops the connection, is no proof).
            let mut refused = true;
            for a in addrs {
                match TcpStream::connect_timeout(&a, Duration::from_millis(500)) {
                    Ok(c) => {
                        self.reached.store(true, Ordering::Relaxed);
                        // A request with a body is two writes (its line,
                        // then its bytes): under Nagle's rule the second
                        // waits for the store's delayed ACK of the first,
                        // 40 ms on Linux, for every `PUT`.
                        let _ = c.set_nodelay(true);
                        return Ok(c);
                    }
                    Err(e) => {
                        refused &= e.kind() == std::io::ErrorKind::ConnectionRefused;
                        last = Some(e);
                    }
                }
            }
            let refused = refused && last.is_some();
            if Instant::now() >= deadline || (refused && self.reached.load(Ordering::Relaxed)) {
                return Err(io(
                    &format!("connecting to {}", self.addr()),
                    last.unwrap_or_else(|| std::io::Error::other("no address")),
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Sends `request`; the store's reply to it.
    fn request(&self, request: &Request, timeout: Duration) -> Result<Response, Error> {
        self.request_with(request, &[], timeout).map(|(r, _)| r)
    }

    /// Sends `request` followed by `body` (on a kept connection, or a new
    /// one after its `AUTH`); the store's reply,
    /// and the bytes that follow a [`Response::Value`]. Each request is a
    /// `trace` event with its verb and how long it took (`DUPLEX_LOG=trace`).
    fn request_with(
        &self,
        request: &Request,
        body: &[u8],
        timeout: Duration,
    ) -> Result<(Response, Vec<u8>), Error> {
        let started = Instant::now();
        let result = self.round_trip(request, body, timeout);
        tracing::trace!(
            request = request.verb(),
            ms = started.elapsed().as_secs_f64() * 1e3,
            ok = result.is_ok(),
            "duplex store: a request"
        );
        result
    }

    /// [`Store::request_with`]'s work, on a connection kept from an earlier
    /// request when there is one, else on a new one (`AUTH` first). A kept
    /// connection that the store closed while it sat idle is left for
    /// another (the request never reached the store: it answers every
    /// request it reads, and closes only between requests).
    fn round_trip(
        &self,
        request: &Request,
        body: &[u8],
        timeout: Duration,
    ) -> Result<(Response, Vec<u8>), Error> {
        let line = proto::encode_request(request).map_err(|e| Error::Invalid {
            at: "the duplex rendezvous".into(),
            message: format!("this request cannot be sent: {e}"),
        })?;
        let deadline = deadline_after(timeout);
        loop {
            let (conn, kept) = match self.kept() {
                Some(c) => (c, true),
                None => (self.open(deadline)?, false),
            };
            match self.exchange(&conn, &line, body, deadline) {
                Ok(reply) => {
                    // The store closes a connection after an `ERROR`.
                    if !matches!(reply.0, Response::Error(_)) {
                        self.keep(conn);
                    }
                    return Ok(reply);
                }
                Err(Exchange::Unanswered(_)) if kept => continue,
                Err(Exchange::Unanswered(e)) => return Err(e),
                Err(Exchange::Failed(e)) => {
                    // A store that timed out (frozen, or its host gone)
                    // would do the same on the others: the next request
                    // connects anew, which fails at once when nothing
                    // listens any more.
                    self.kept.lock().unwrap_or_else(|e| e.into_inner()).clear();
                    return Err(e);
                }
            }
        }
    }

    /// The most recently used connection of those kept, if one was used
    /// within [`KEPT_IDLE`]; older ones are closed.
    fn kept(&self) -> Option<TcpStream> {
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        while let Some((conn, since)) = kept.pop() {
            if since.elapsed() < KEPT_IDLE {
                return Some(conn);
            }
        }
        None
    }

    /// Keeps `conn`, whose last exchange ended cleanly, for a later
    /// request (at most [`KEPT`] connections; more are closed).
    fn keep(&self, conn: TcpStream) {
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        kept.retain(|(_, since)| since.elapsed() < KEPT_IDLE);
        if kept.len() < self.keep_at_most {
            kept.push((conn, Instant::now()));
        }
    }

    /// A new connection to the store, past its `AUTH`. A store that says
    /// it is busy (its connections at their limit, or its pool of
    /// connections not yet authenticated full: many ranks of a host
    /// connecting at once) is asked again, less and less often, until
    /// `deadline`.
    fn open(&self, deadline: Instant) -> Result<TcpStream, Error> {
        let auth = proto::encode_request(&Request::Auth {
            version: VERSION,
            token: self.secret.clone(),
        })
        .map_err(|e| Error::Invalid {
            at: "DUPLEX_STORE_TOKEN".into(),
            message: format!("the store token cannot be sent: {e}"),
        })?;
        let mut pause = Duration::from_millis(20);
        loop {
            let conn = self.connect(deadline)?;
            let reply = self
                .exchange(&conn, &auth, &[], deadline)
                .map_err(Exchange::error)?;
            match reply.0 {
                Response::Ok => return Ok(conn),
                Response::Error(why) if why.starts_with("busy") => {
                    if Instant::now() + pause < deadline {
                        tracing::debug!("duplex store: {why}; asking again in {pause:?}");
                        std::thread::sleep(pause);
                        pause = (pause * 2).min(Duration::from_millis(500));
                        continue;
                    }
                    let how = if why.contains("not yet authenticated") {
                        format!(
                            "it refused this connection until the request's deadline ({why}): the store takes at most 4,096 connections at once that have not shown the job's secret, 256 from one host; many ranks of one host connecting at once, or something else holding connections to its port without the secret (look for it on rank 0's host: ss -tn sport = :PORT)"
                        )
                    } else {
                        format!(
                            "it refused this connection until the request's deadline ({why}): rank 0's process serves no more connections than its limits on open files and threads allow; raise them there (ulimit -n, the job's pids limit)"
                        )
                    };
                    return Err(Error::Unavailable {
                        what: format!("the duplex rendezvous at {}", self.addr()),
                        how,
                    });
                }
                Response::Error(why) => {
                    return Err(Error::Unavailable {
                        what: format!("the duplex rendezvous at {}", self.addr()),
                        how: format!(
                            "it refused this rank ({why}); every rank of a job needs the same DUPLEX_STORE_TOKEN (or, under torchrun, the same TORCHELASTIC_RUN_ID, MASTER_ADDR, MASTER_PORT and WORLD_SIZE)"
                        ),
                    });
                }
                other => return Err(self.unexpected("AUTH", &other)),
            }
        }
    }

    /// Sends `line` and `body` on `conn`; the reply, and the bytes that
    /// follow a [`Response::Value`].
    fn exchange(
        &self,
        conn: &TcpStream,
        line: &[u8],
        body: &[u8],
        deadline: Instant,
    ) -> Result<(Response, Vec<u8>), Exchange> {
        // One deadline for the whole exchange, not a timeout per read: a
        // store (or whatever answers at its address) that sends its reply
        // a byte at a time cannot keep a request going past it.
        let until = deadline.max(Instant::now()) + Duration::from_secs(1);
        // Until a byte of the reply came, a closed connection means the
        // store never read the request.
        let unanswered = |what: &str, e: std::io::Error| {
            if closed(&e) {
                Exchange::Unanswered(io(what, e))
            } else {
                Exchange::Failed(io(what, e))
            }
        };
        let mut w = DeadlineWriter {
            stream: conn,
            deadline: until,
        };
        w.write_all(line)
            .and_then(|()| w.write_all(body))
            .map_err(|e| unanswered("sending a request", e))?;
        let mut reader = BufReader::new(DeadlineReader {
            stream: conn,
            deadline: until,
        });
        match reader.fill_buf() {
            Ok([]) => {
                return Err(Exchange::Unanswered(Error::Aborted(format!(
                    "the duplex store at {} closed the connection without replying",
                    self.addr()
                ))));
            }
            Ok(_) => {}
            Err(e) => return Err(unanswered("reading a reply", e)),
        }
        // A byte of the reply came: the request was read and served (a
        // reply cut short fails to parse below).
        let reply = proto::read_line(&mut reader)
            .map_err(|e| Exchange::Failed(io("reading a reply", e)))?;
        let reply = proto::parse_response(&reply).map_err(|e| {
            Exchange::Failed(Error::Aborted(format!(
                "the duplex store at {} sent a malformed reply: {e}",
                self.addr()
            )))
        })?;
        *self.heard.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        let mut value = Vec::new();
        if let Response::Value(len) = reply {
            let got = reader
                .take(len as u64)
                .read_to_end(&mut value)
                .map_err(|e| Exchange::Failed(io("reading a value", e)))?;
            if got != len {
                return Err(Exchange::Failed(Error::Aborted(format!(
                    "the duplex store at {} sent {got} of {len} bytes of a value",
                    self.addr()
                ))));
            }
        }
        Ok((reply, value))
    }

    fn unexpected(&self, what: &str, reply: &Response) -> Error {
        match reply {
            Response::Error(why) => Error::Aborted(format!(
                "the duplex store at {} refused {what}: {why}",
                self.addr()
            )),
            other => Error::Aborted(format!(
                "the duplex store at {} answered {what} with {other:?}",
                self.addr()
            )),
        }
    }

    /// Records that `rank` failed, and why; every other rank's
    /// [`Store::health`] reports it from now on.
    pub fn fail(&self, rank: Rank, why: &str, timeout: Duration) -> Result<(), Error> {
        let mut why: String = why.chars().take(proto::MAX_WHY / 4).collect();
        if why.is_empty() {
            why.push_str("failed");
        }
        match self.request(&Request::Fail { rank, why }, timeout)? {
            Response::Ok => Ok(()),
            other => Err(self.unexpected("a failure report", &other)),
        }
    }

    /// A heartbeat of `rank`.
    pub fn beat(&self, rank: Rank, timeout: Duration) -> Result<(), Error> {
        match self.request(&Request::Beat { rank }, timeout)? {
            Response::Ok => Ok(()),
            other => Err(self.unexpected("a heartbeat", &other)),
        }
    }

    /// The first failure of a rank other than `me` (posted, or no
    /// heartbeat for `silence`): `(rank, why)`, or `None` when all are well.
    pub fn health(
        &self,
        me: Rank,
        silence: Duration,
        timeout: Duration,
    ) -> Result<Option<(Rank, String)>, Error> {
        let request = Request::Health {
            me,
            silence_ms: u64::try_from(silence.as_millis()).unwrap_or(u64::MAX),
        };
        match self.request(&request, timeout)? {
            Response::Healthy => Ok(None),
            Response::Failed { rank, why } => Ok(Some((rank, why))),
            other => Err(self.unexpected("a health check", &other)),
        }
    }

    /// Stores `value` under `key` (at most [`proto::MAX_VALUE`] bytes).
    pub fn put(&self, key: &str, value: &[u8], timeout: Duration) -> Result<(), Error> {
        let request = Request::Put {
            key: key.into(),
            len: value.len(),
        };
        match self.request_with(&request, value, timeout)? {
            (Response::Ok, _) => Ok(()),
            (other, _) => Err(self.unexpected("a put", &other)),
        }
    }

    /// The value under `key`, waiting up to `wait` for it to be stored.
    pub fn get(&self, key: &str, wait: Duration) -> Result<Option<Vec<u8>>, Error> {
        self.value_within(wait, Duration::from_secs(5), "a get", |wait_ms| {
            Request::Get {
                key: key.into(),
                wait_ms,
            }
        })
    }

    /// The value stored under `key` now, if any, without waiting for one:
    /// the request fails past `timeout` (and a second's grace), where
    /// [`Store::get`] gives the store 5 s more.
    pub fn peek(&self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>, Error> {
        self.value_within(Duration::ZERO, timeout, "a get", |wait_ms| Request::Get {
            key: key.into(),
            wait_ms,
        })
    }

    /// The bytes of a `VALUE` reply to the request `request` makes of a
    /// wait of up to `wait` (at most [`MAX_WAIT`]), given `grace` more to
    /// answer; `None` when the store answered `TIMEOUT`.
    fn value_within(
        &self,
        wait: Duration,
        grace: Duration,
        what: &str,
        request: impl FnOnce(u64) -> Request,
    ) -> Result<Option<Vec<u8>>, Error> {
        let wait = wait.min(MAX_WAIT);
        let request = request(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX));
        match self.request_with(&request, &[], wait + grace)? {
            (Response::Value(_), value) => Ok(Some(value)),
            (Response::Timeout, _) => Ok(None),
            (other, _) => Err(self.unexpected(what, &other)),
        }
    }

    /// Appends `message` (at most [`proto::MAX_MAIL`] bytes) to rank `to`'s
    /// inbox.
    pub fn mail(&self, to: Rank, message: &[u8], timeout: Duration) -> Result<(), Error> {
        let request = Request::Mail {
            to,
            len: message.len(),
        };
        match self.request_with(&request, message, timeout)? {
            (Response::Ok, _) => Ok(()),
            (other, _) => Err(self.unexpected("a message", &other)),
        }
    }

    /// The oldest message of rank `me`'s inbox, waiting up to `wait` for
    /// one.
    pub fn inbox(&self, me: Rank, wait: Duration) -> Result<Option<Vec<u8>>, Error> {
        self.value_within(wait, Duration::from_secs(5), "an inbox read", |wait_ms| {
            Request::Inbox { me, wait_ms }
        })
    }

    /// The ranks that have ended: finished cleanly (stored `done/RANK`),
    /// posted a failure, or sent no heartbeat for longer than `silence`
    /// (killed or frozen).
    pub fn ended(&self, silence: Duration, timeout: Duration) -> Result<Vec<Rank>, Error> {
        let silence_ms = u64::try_from(silence.as_millis()).unwrap_or(u64::MAX);
        match self.request_with(&Request::Ended { silence_ms }, &[], timeout)? {
            (Response::Value(_), body) => {
                let text = String::from_utf8(body).map_err(|_| {
                    Error::Aborted(format!(
                        "the duplex store at {} sent ended ranks that are not text",
                        self.addr()
                    ))
                })?;
                text.split(',')
                    .filter(|w| !w.is_empty())
                    .map(|w| {
                        w.parse().map_err(|_| {
                            Error::Aborted(format!(
                                "the duplex store at {} sent `{w}` as an ended rank",
                                self.addr()
                            ))
                        })
                    })
                    .collect()
            }
            (other, _) => Err(self.unexpected("an ended-ranks request", &other)),
        }
    }

    /// The stored keys that start with `prefix` (1 to [`proto::MAX_KEY`]
    /// bytes), in ascending order.
    pub fn keys(&self, prefix: &str, timeout: Duration) -> Result<Vec<String>, Error> {
        let request = Request::Keys {
            prefix: prefix.into(),
        };
        match self.request_with(&request, &[], timeout)? {
            (Response::Value(_), body) => {
                let bad = |what: &str| {
                    Error::Aborted(format!(
                        "the duplex store at {} sent a key list that {what}",
                        self.addr()
                    ))
                };
                let text = String::from_utf8(body).map_err(|_| bad("is not text"))?;
                text.split(' ')
                    .filter(|w| !w.is_empty())
                    .map(|w| {
                        let key = proto::unhex(w).ok_or_else(|| bad("is not hex"))?;
                        let key = String::from_utf8(key).map_err(|_| bad("is not utf-8"))?;
                        if key.starts_with(prefix) {
                            Ok(key)
                        } else {
                            Err(bad("holds a key without the prefix"))
                        }
                    })
                    .collect()
            }
            (other, _) => Err(self.unexpected("a key list request", &other)),
        }
    }

    /// The NCCL unique id rank 0 generated.
    pub fn unique_id(&self, timeout: Duration) -> Result<Vec<u8>, Error> {
        match self.request(&Request::UniqueId, timeout)? {
            Response::UniqueId(id) => Ok(id),
            other => Err(self.unexpected("a unique id request", &other)),
        }
    }
}

/// How often a lane service making a lane reads its inbox on the store
/// ([`Board::inbox_every`]): each read is a request to rank 0's process,
/// where its part's progress is polled every 2 ms (at that pace, 400
/// requests a second for each rank making a lane, each a connection of its
/// own before the store's version 5, seen on one H200).
pub(crate) const STORE_INBOX_EVERY: Duration = Duration::from_millis(20);

impl Board for Store {
    fn inbox_every(&self) -> Duration {
        STORE_INBOX_EVERY
    }

    fn post(&self, from: Rank, to: Rank, tag: &str) -> Result<(), Error> {
        let request = Request::Post {
            from,
            to,
            tag: tag.into(),
        };
        match self.request(&request, Duration::from_secs(30))? {
            Response::Ok => Ok(()),
            other => Err(self.unexpected("a notify", &other)),
        }
    }

    fn take(&self, from: Rank, to: Rank, tag: &str, timeout: Duration) -> Result<bool, Error> {
        let wait = timeout.min(MAX_WAIT);
        let request = Request::Take {
            from,
            to,
            tag: tag.into(),
            wait_ms: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
        };
        match self.request(&request, wait + Duration::from_secs(5))? {
            Response::Ok => Ok(true),
            Response::Timeout => Ok(false),
            other => Err(self.unexpected("an await", &other)),
        }
    }

    fn mail(&self, to: Rank, message: &[u8]) -> Result<(), Error> {
        Store::mail(self, to, message, Duration::from_secs(30))
    }

    fn inbox(&self, me: Rank, timeout: Duration) -> Result<Option<Vec<u8>>, Error> {
        Store::inbox(self, me, timeout)
    }
}

#[cfg(test)]
mod tests;
