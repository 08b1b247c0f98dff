//! The device order of one rank's buffer accesses, and the races it finds
//! (D1 of `docs/semantics.md`).
//!
//! A send reads its buffer on the device and a recv writes it, at some time
//! after the host launched them. Two ops on one stream run in launch order
//! (R1), but ops on different streams run in any order unless something
//! orders them: an event recorded after the first and waited for on the
//! second's stream before the second was launched (R9), or a `sync_stream`
//! or `synchronize` that returned, after the first, before the second was
//! launched. Ops of one launch (a group) run at once, whatever their
//! streams. Two accesses to one buffer of which one writes (a recv), and
//! that nothing orders, are a *race*: the send may read the buffer before
//! the recv wrote it, or a recv may overwrite what a send has not read yet.
//! The bytes that arrive then depend on timing, so both backends refuse
//! the second op with [`Error::Race`], naming both.
//!
//! [`Order`] keeps, per rank, a vector clock per stream (which launches of
//! every stream the stream's next op runs after), what the host has seen
//! complete (its syncs), the clock each event recorded, and each buffer's
//! accesses since the host last knew it idle. It is driven in the order the
//! rank's calls were made, by every thread of the rank: a sync that
//! returned before a launch was made orders the launch after what the sync
//! waited for, whichever thread made them (real time on the GPU; the
//! explored interleaving on the simulator, which tries them all). Streams,
//! events and buffers are named by the backend's own numbers.
//!
//! Buffers are whole: duplex has no views of part of a buffer, so two ops
//! on disjoint halves of one buffer cannot be expressed.

use std::hash::{Hash, Hasher};
use std::panic::Location;
use std::sync::Arc;

use smallvec::SmallVec;

use crate::{DType, Dir, Error, Rank};

/// One op's access to its buffer, as the backend describes it at launch
/// (borrowed: a launch that races with nothing copies only what a later
/// report needs).
#[derive(Clone, Copy, Debug)]
pub struct Access<'a> {
    /// Send (reads the buffer) or recv (writes it).
    pub dir: Dir,
    /// The other rank.
    pub peer: Rank,
    /// Elements.
    pub count: usize,
    /// Element type.
    pub dtype: DType,
    /// The stream, by the backend's number.
    pub stream: u32,
    /// The stream's name.
    pub stream_name: &'a str,
    /// The part of the launch it belongs to, by the backend's number of
    /// its communicator (or copy-engine lane): a group's ops of one
    /// communicator are one launch of the model (R8), which waits for
    /// what came before on each of its streams and holds them all until it
    /// has completed; ops of different parts on one stream run in stream
    /// order.
    pub part: u32,
    /// Where the op was made.
    pub at: &'static Location<'static>,
    /// The call site set by [`crate::transport::check::at_site`] (a
    /// schedule's line), named instead of `at`.
    pub site: Option<&'a Arc<str>>,
}

impl Access<'_> {
    fn writes(&self) -> bool {
        self.dir == Dir::Recv
    }

    fn past(&self) -> Past {
        Past {
            dir: self.dir,
            peer: self.peer,
            count: self.count,
            dtype: self.dtype,
            at: self.at,
            site: self.site.cloned(),
        }
    }

    fn named(&self) -> Named {
        self.past().named(self.stream_name)
    }
}

/// An access recorded by [`Order`]: what a report names, less its stream
/// (named once per stream by the order).
#[derive(Clone, Debug)]
struct Past {
    dir: Dir,
    peer: Rank,
    count: usize,
    dtype: DType,
    at: &'static Location<'static>,
    site: Option<Arc<str>>,
}

impl Past {
    fn named(&self, stream: &str) -> Named {
        Named {
            text: crate::transport::check::op_text(self.dir, self.count, self.dtype, self.peer),
            place: match &self.site {
                Some(s) => s.to_string(),
                None => format!("{}:{}:{}", self.at.file(), self.at.line(), self.at.column()),
            },
            stream: stream.to_string(),
            writes: self.dir == Dir::Recv,
        }
    }
}

/// An op of a race, as its report names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Named {
    /// `send 1024 x f32 to rank 1`.
    pub text: String,
    /// Where it was made.
    pub place: String,
    /// Its stream's name.
    pub stream: String,
    /// A recv (it writes the buffer).
    pub writes: bool,
}

/// Two accesses to one buffer, at least one a write, that nothing orders.
#[derive(Clone, Debug)]
pub struct Race {
    /// The op being launched.
    pub now: Named,
    /// The earlier op it races with.
    pub earlier: Named,
    /// Both are ops of the launch being made (a group).
    pub same_launch: bool,
}

impl Race {
    /// The error both backends return for it, at the launch being made.
    pub fn error(&self) -> Error {
        let (now, earlier) = (&self.now, &self.earlier);
        let effect = match (now.writes, earlier.writes) {
            (false, _) => "the send may read it before the recv has written it",
            (true, false) => "the recv may overwrite it before the send has read it",
            (true, true) => "the two recvs may write it in either order",
        };
        let fix = if self.same_launch {
            "a group's ops run at once, whatever their streams: use another buffer, or put them in separate launches on one stream".to_string()
        } else {
            format!(
                "put them on one stream, or record an event on `{}` after `{}` and wait for it on `{}` before this launch, or sync_stream(`{}`) first",
                earlier.stream, earlier.text, now.stream, earlier.stream
            )
        };
        Error::Race {
            at: now.place.clone(),
            message: format!(
                "{} on stream `{}` {} a buffer that `{}` ({}, stream `{}`{}) {}, and nothing orders the two on the device: {effect}; {fix}",
                now.text,
                now.stream,
                if now.writes { "writes" } else { "reads" },
                earlier.text,
                earlier.place,
                earlier.stream,
                if self.same_launch {
                    ", in the same launch"
                } else {
                    ""
                },
                if earlier.writes { "writes" } else { "reads" },
            ),
        }
    }
}

/// An access with the launch it belongs to: the launch's number on its
/// stream (the stream by its index in [`Order`]).
#[derive(Clone, Debug)]
struct Stamped {
    stream: usize,
    seq: u64,
    op: Past,
}

/// A buffer's accesses since the host last knew it idle: the last write,
/// and the reads since it (the latest per stream; an earlier one on the
/// same stream is ordered before it).
#[derive(Clone, Debug, Default)]
struct Uses {
    write: Option<Stamped>,
    reads: SmallVec<[Stamped; 2]>,
}

impl Uses {
    fn is_empty(&self) -> bool {
        self.write.is_none() && self.reads.is_empty()
    }
}

/// One stream of a launch not yet on its streams
/// ([`Order::commit_pending`]).
#[derive(Clone, Debug)]
struct Pending {
    key: u64,
    /// The stream's index.
    stream: usize,
    /// The launch's number on it.
    seq: u64,
    /// The stream's clock before the launch: what an event recorded or a
    /// sync made on the stream now covers on the device.
    before: Clock,
}

/// A vector clock: per stream index, the launches of that stream known to
/// come before (missing entries are 0).
type Clock = Vec<u64>;

fn get(c: &Clock, i: usize) -> u64 {
    c.get(i).copied().unwrap_or(0)
}

fn join(into: &mut Clock, from: &Clock) {
    if into.len() < from.len() {
        into.resize(from.len(), 0);
    }
    for (a, b) in into.iter_mut().zip(from) {
        *a = (*a).max(*b);
    }
}

/// What a host sync waits for ([`Order::covers`]).
#[derive(Clone, Debug, Default)]
pub struct Covered(Clock);

impl Covered {
    /// Feeds what it covers to `h`, for an explorer's record of states
    /// seen (two syncs that cover the same have one digest, zeros at the
    /// end aside).
    pub fn digest(&self, h: &mut impl Hasher) {
        let end = self.0.iter().rposition(|x| *x != 0).map_or(0, |i| i + 1);
        h.write_usize(end);
        for x in &self.0[..end] {
            h.write_u64(*x);
        }
    }
}

/// One rank's device order (module docs). Drive it with every launch,
/// event `record` and `wait`, completed sync, and host access of a buffer,
/// in the order the rank made them.
#[derive(Debug, Default)]
pub struct Order {
    /// The backend's stream number → index. A map, not a table by number:
    /// a rank uses a few of a job's streams, whose numbers grow with the
    /// job (the simulator's lanes of 1,024 ranks are numbered up to 2
    /// million), and a table per rank cost O(ranks³) memory in all.
    index: rustc_hash::FxHashMap<u32, u32>,
    /// Per stream index: its name.
    names: Vec<Box<str>>,
    /// Per stream index: its clock, and the host epoch it last took in.
    clocks: Vec<(Clock, u64)>,
    /// What the host has seen complete.
    host: Clock,
    /// Bumped whenever `host` grows.
    epoch: u64,
    /// The clock each event last recorded, by the backend's number (a
    /// map, as `index`).
    events: rustc_hash::FxHashMap<u32, Clock>,
    /// Accesses per buffer, by the backend's number.
    uses: rustc_hash::FxHashMap<u64, Uses>,
    /// Launches committed before they are on their streams
    /// ([`Order::commit_pending`]), one entry per stream of each.
    pending: SmallVec<[Pending; 2]>,
    /// The next key of [`Order::commit_pending`].
    next_key: u64,
}

impl Order {
    /// A rank that has done nothing yet.
    pub fn new() -> Order {
        Order::default()
    }

    fn stream(&mut self, s: u32) -> usize {
        let next = self.clocks.len() as u32;
        let i = *self.index.entry(s).or_insert(next) as usize;
        if i == self.clocks.len() {
            self.clocks.push((Clock::new(), 0));
            self.names.push("".into());
        }
        // What the host knows complete precedes everything launched after.
        let epoch = self.epoch;
        let (clock, seen) = &mut self.clocks[i];
        if *seen != epoch {
            join(clock, &self.host);
            *seen = epoch;
        }
        i
    }

    /// Whether `e` comes before the next launch on stream index `s`.
    fn ordered(&self, e: &Stamped, s: usize) -> bool {
        get(&self.clocks[s].0, e.stream) >= e.seq
    }

    /// A launch of `ops` (each with its buffer's number), in issue order:
    /// [`Order::check`], then [`Order::commit`] if it passes.
    pub fn launch(&mut self, ops: &[(u64, Access<'_>)]) -> Result<(), Box<Race>> {
        self.check(ops)?;
        self.commit(ops);
        Ok(())
    }

    /// Whether a launch of `ops` may be made: the first op that races with
    /// an earlier access to its buffer, or with another op of the launch,
    /// is the error. Records no access: a backend that checks before it
    /// launches commits once the launch is made.
    pub fn check(&mut self, ops: &[(u64, Access<'_>)]) -> Result<(), Box<Race>> {
        let streams: SmallVec<[usize; 4]> =
            ops.iter().map(|(_, a)| self.stream(a.stream)).collect();
        for (i, (buf, now)) in ops.iter().enumerate() {
            // The streams of its part: it runs after what came before on
            // any of them.
            let part = ops
                .iter()
                .zip(&streams)
                .filter(|((_, a), _)| a.part == now.part)
                .map(|(_, s)| *s);
            if let Some(u) = self.uses.get(buf) {
                let reads = u.reads.iter().filter(|_| now.writes());
                if let Some(e) = u
                    .write
                    .iter()
                    .chain(reads)
                    .find(|e| !part.clone().any(|s| self.ordered(e, s)))
                {
                    return Err(Box::new(Race {
                        now: now.named(),
                        earlier: e.op.named(&self.names[e.stream]),
                        same_launch: false,
                    }));
                }
            }
            // Ops of one part run at once; of two parts, in stream order
            // on one stream, and unordered on two.
            if let Some(((_, earlier), _)) = ops[..i].iter().zip(&streams).find(|((b, e), s)| {
                b == buf
                    && (e.writes() || now.writes())
                    && (e.part == now.part || **s != streams[i])
            }) {
                return Err(Box::new(Race {
                    now: now.named(),
                    earlier: earlier.named(),
                    same_launch: true,
                }));
            }
        }
        Ok(())
    }

    /// Records the accesses of a launch of `ops` that was made.
    pub fn commit(&mut self, ops: &[(u64, Access<'_>)]) {
        self.commit_seqs(ops);
    }

    /// Records the accesses of a launch of `ops` that is under way but not
    /// yet on its streams (a backend whose launch waits, without its lock,
    /// for a library to put its work on the streams later): a later launch
    /// that touches its buffers unordered is a race, as after
    /// [`Order::commit`], but no event recorded or sync made meanwhile
    /// covers it, since its work may not be on the streams yet. Returns the
    /// key for [`Order::landed`]; until then, an event recorded or a sync
    /// made on one of its streams covers what the stream had before it,
    /// and a host access of one of its buffers keeps its access. No other
    /// launch may go on its streams until it lands (the backend holds them
    /// back), since the device order there would not be the order of the
    /// calls.
    pub fn commit_pending(&mut self, ops: &[(u64, Access<'_>)]) -> u64 {
        let key = self.next_key;
        self.next_key += 1;
        let mut before: SmallVec<[(usize, Clock); 2]> = SmallVec::new();
        for (_, a) in ops {
            let s = self.stream(a.stream);
            if !before.iter().any(|(x, _)| *x == s) {
                before.push((s, self.clocks[s].0.clone()));
            }
        }
        for (s, seq) in self.commit_seqs(ops) {
            // Each stream once (`commit_seqs`): its clock is moved out.
            let before = before
                .iter_mut()
                .find(|(x, _)| *x == s)
                .map(|(_, c)| std::mem::take(c))
                .unwrap_or_default();
            self.pending.push(Pending {
                key,
                stream: s,
                seq,
                before,
            });
        }
        key
    }

    /// The launch of [`Order::commit_pending`]'s `key` is on its streams
    /// (or never will be, and nothing of it runs: its communicators were
    /// aborted): events and syncs made from now on cover it.
    pub fn landed(&mut self, key: u64) {
        self.pending.retain(|p| p.key != key);
    }

    /// What stream index `s` has been ordered after on the device so far:
    /// its clock, or, behind a launch not yet on it, the clock it had
    /// before that launch.
    fn visible(&self, s: usize) -> &Clock {
        self.pending
            .iter()
            .filter(|p| p.stream == s)
            .min_by_key(|p| p.seq)
            .map_or(&self.clocks[s].0, |p| &p.before)
    }

    /// `c` without the launches not yet on their streams (and what came
    /// after them there).
    fn without_pending(&self, c: &mut Clock) {
        for p in &self.pending {
            if let Some(x) = c.get_mut(p.stream)
                && *x >= p.seq
            {
                *x = p.seq - 1;
            }
        }
    }

    /// [`Order::commit`], returning each stream's (index, number) of the
    /// launch.
    fn commit_seqs(&mut self, ops: &[(u64, Access<'_>)]) -> SmallVec<[(usize, u64); 4]> {
        let mut seqs: SmallVec<[(usize, u64); 4]> = SmallVec::new();
        let mut parts: SmallVec<[(u32, usize); 4]> = SmallVec::new();
        for (buf, op) in ops {
            let s = self.stream(op.stream);
            if self.names[s].is_empty() {
                self.names[s] = op.stream_name.into();
            }
            // One number per stream per launch: a launch's ops on one
            // stream run at once.
            let seq = match seqs.iter().find(|(x, _)| *x == s) {
                Some((_, q)) => *q,
                None => {
                    let clock = &mut self.clocks[s].0;
                    if clock.len() <= s {
                        clock.resize(s + 1, 0);
                    }
                    clock[s] += 1;
                    seqs.push((s, clock[s]));
                    clock[s]
                }
            };
            let stamped = Stamped {
                stream: s,
                seq,
                op: op.past(),
            };
            if !parts.iter().any(|(p, x)| *p == op.part && *x == s) {
                parts.push((op.part, s));
            }
            let u = self.uses.entry(*buf).or_default();
            if op.writes() {
                u.write = Some(stamped);
                u.reads.clear();
            } else {
                u.reads.retain(|r| r.stream != s);
                u.reads.push(stamped);
            }
        }
        // A part on several streams holds them all until it has completed
        // (R8): what comes after it on any of them comes after all of it.
        parts.sort_unstable();
        for mine in parts.chunk_by(|a, b| a.0 == b.0).filter(|m| m.len() > 1) {
            let mut all = Clock::new();
            for &(_, s) in mine {
                join(&mut all, &self.clocks[s].0);
            }
            for &(_, s) in mine {
                self.clocks[s].0.clone_from(&all);
            }
        }
        seqs
    }

    /// An event recorded on a stream: it completes after what the stream
    /// has been ordered after so far.
    pub fn record(&mut self, event: u32, stream: u32) {
        let s = self.stream(stream);
        let mut c = self.events.remove(&event).unwrap_or_default();
        c.clone_from(self.visible(s));
        if !self.pending.is_empty() {
            self.without_pending(&mut c);
        }
        self.events.insert(event, c);
    }

    /// A stream waits for an event: its later launches run after what the
    /// event's record came after. An event never recorded orders nothing.
    pub fn wait(&mut self, event: u32, stream: u32) {
        let s = self.stream(stream);
        if let Some(c) = self.events.get(&event) {
            join(&mut self.clocks[s].0, c);
        }
    }

    /// What a host sync of `stream` (or of every stream) made now waits
    /// for: what the stream (each stream) has been ordered after so far.
    /// Launches made while the sync waits are not covered.
    pub fn covers(&mut self, stream: Option<u32>) -> Covered {
        let mut c = Clock::new();
        match stream {
            Some(x) => {
                let s = self.stream(x);
                c.clone_from(self.visible(s));
            }
            None => {
                for s in 0..self.clocks.len() {
                    join(&mut c, self.visible(s));
                }
            }
        }
        self.without_pending(&mut c);
        Covered(c)
    }

    /// A host sync returned: what it covered ([`Order::covers`], taken when
    /// it was made) is complete. Returns the buffers some of whose
    /// accesses it completed (an explorer's record of what the sync
    /// changed).
    pub fn synced(&mut self, covered: Covered) -> Vec<u64> {
        join(&mut self.host, &covered.0);
        self.epoch += 1;
        // Accesses the host knows complete order everything after them.
        let host = &self.host;
        let done = |e: &Stamped| get(host, e.stream) >= e.seq;
        let mut changed = Vec::new();
        self.uses.retain(|b, u| {
            let before = (u.write.is_some(), u.reads.len());
            if u.write.as_ref().is_some_and(done) {
                u.write = None;
            }
            u.reads.retain(|r| !done(r));
            if before != (u.write.is_some(), u.reads.len()) {
                changed.push(*b);
            }
            !u.is_empty()
        });
        changed
    }

    /// Whether the host knows every device access of `buffer` complete: a
    /// completed sync covered each one (on its stream, or through events
    /// ordered before the synced stream), or the host accessed the buffer
    /// after them. A launch not yet on its streams
    /// ([`Order::commit_pending`]) keeps its buffers' accesses.
    pub fn idle(&self, buffer: u64) -> bool {
        !self.uses.contains_key(&buffer)
    }

    /// The host read or wrote `buffer` after finding no op using it: every
    /// earlier access is complete.
    /// An access of a launch not yet on its streams stays: the launch may
    /// not have run.
    pub fn host_access(&mut self, buffer: u64) {
        if self.pending.is_empty() {
            self.uses.remove(&buffer);
            return;
        }
        let pending = &self.pending;
        let waits = |e: &Stamped| {
            pending
                .iter()
                .any(|p| p.stream == e.stream && e.seq >= p.seq)
        };
        if let Some(u) = self.uses.get_mut(&buffer) {
            if !u.write.as_ref().is_some_and(waits) {
                u.write = None;
            }
            u.reads.retain(|r| waits(r));
            if u.is_empty() {
                self.uses.remove(&buffer);
            }
        }
    }

    /// Feeds what decides later verdicts (not the ops' texts) into `h`:
    /// two states with the same digest refuse the same launches. For an
    /// explorer's record of states seen.
    pub fn digest(&self, h: &mut impl Hasher) {
        // Canonical: streams by the backend's number, not by first use,
        // and every clock with what the host knows taken in (as the next
        // use of the stream will), so that one state reached in two orders
        // has one digest.
        let mut seen: Vec<(u32, usize)> =
            self.index.iter().map(|(n, i)| (*n, *i as usize)).collect();
        seen.sort_unstable();
        let clock = |c: &Clock, h: &mut dyn Hasher| {
            for &(_, l) in &seen {
                h.write_u64(get(c, l).max(get(&self.host, l)));
            }
        };
        for &(n, l) in &seen {
            h.write_u32(n);
            clock(&self.clocks[l].0, h);
        }
        clock(&Clock::new(), h);
        let mut events: Vec<_> = self.events.iter().collect();
        events.sort_unstable_by_key(|(e, _)| **e);
        for (e, c) in events {
            h.write_usize(*e as usize);
            clock(c, h);
        }
        let number = |l: usize| {
            seen.iter()
                .find(|(_, x)| *x == l)
                .map_or(u32::MAX, |(n, _)| *n)
        };
        let mut bufs: Vec<_> = self.uses.iter().collect();
        bufs.sort_unstable_by_key(|(b, _)| **b);
        for (b, u) in bufs {
            b.hash(h);
            let mut stamps: Vec<(u32, u64, bool)> = u
                .write
                .iter()
                .chain(&u.reads)
                .map(|e| (number(e.stream), e.seq, e.op.dir == Dir::Recv))
                .collect();
            stamps.sort_unstable();
            stamps.hash(h);
        }
        let mut pending: Vec<(u32, u64)> = self
            .pending
            .iter()
            .map(|p| (number(p.stream), p.seq))
            .collect();
        pending.sort_unstable();
        pending.hash(h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAMES: [&str; 6] = ["s0", "s1", "s2", "s3", "s4", "s5"];

    #[track_caller]
    fn op(dir: Dir, stream: u32) -> Access<'static> {
        Access {
            dir,
            peer: 1,
            count: 16,
            dtype: DType::U32,
            stream,
            stream_name: NAMES[stream as usize],
            part: 0,
            at: Location::caller(),
            site: None,
        }
    }

    #[track_caller]
    fn on(dir: Dir, stream: u32, part: u32) -> Access<'static> {
        Access {
            part,
            ..op(dir, stream)
        }
    }

    const X: u64 = 7;
    const Y: u64 = 8;

    fn race(r: Result<(), Box<Race>>) -> String {
        match r {
            Err(r) => r.error().to_string(),
            Ok(()) => panic!("no race found"),
        }
    }

    /// A launch committed before it is on its streams: a later unordered
    /// access races with it at once, but an event recorded or a sync made
    /// before it lands does not cover it; one made after it landed does.
    #[test]
    fn a_launch_not_yet_on_its_streams_is_covered_only_once_it_lands() {
        let mut o = Order::new();
        let key = o.commit_pending(&[(X, op(Dir::Recv, 0))]);
        assert!(o.check(&[(X, op(Dir::Send, 1))]).is_err(), "races at once");
        // An event recorded on its stream, waited for on another: orders
        // nothing yet.
        o.record(0, 0);
        o.wait(0, 1);
        assert!(o.check(&[(X, op(Dir::Send, 1))]).is_err());
        // A sync of every stream made now does not cover it either.
        let early = o.covers(None);
        o.synced(early);
        assert!(o.check(&[(X, op(Dir::Send, 1))]).is_err());
        o.landed(key);
        o.record(1, 0);
        o.wait(1, 1);
        o.check(&[(X, op(Dir::Send, 1))])
            .expect("ordered by an event recorded after it landed");
        let mut o2 = Order::new();
        let key = o2.commit_pending(&[(X, op(Dir::Recv, 0))]);
        o2.landed(key);
        let now = o2.covers(None);
        o2.synced(now);
        o2.check(&[(X, op(Dir::Send, 1))])
            .expect("covered by a sync made after it landed");
    }

    /// A launch not yet on its streams whose part spans two streams: a
    /// sync or an event on one of them covers only what that stream had
    /// before it, not what the launch would have joined into it.
    #[test]
    fn a_pending_launch_over_two_streams_lends_neither_its_order() {
        let mut o = Order::new();
        o.launch(&[(X, op(Dir::Recv, 1))]).unwrap();
        let key = o.commit_pending(&[(Y, op(Dir::Send, 0)), (Y, op(Dir::Send, 1))]);
        let s0 = o.covers(Some(0));
        o.synced(s0);
        assert!(
            o.check(&[(X, op(Dir::Send, 2))]).is_err(),
            "stream 0's sync did not wait for the recv on stream 1"
        );
        o.record(0, 0);
        o.wait(0, 2);
        assert!(o.check(&[(X, op(Dir::Send, 2))]).is_err());
        o.landed(key);
        o.record(1, 0);
        o.wait(1, 2);
        o.check(&[(X, op(Dir::Send, 2))])
            .expect("once it landed, stream 0 runs after the recv (R8)");
    }

    /// A host access while a launch on the buffer is not yet on its
    /// streams keeps that launch's access.
    #[test]
    fn a_host_access_keeps_a_pending_launchs_access() {
        let mut o = Order::new();
        o.launch(&[(X, op(Dir::Recv, 1))]).unwrap();
        let s1 = o.covers(Some(1));
        o.synced(s1);
        let key = o.commit_pending(&[(X, op(Dir::Send, 0))]);
        o.host_access(X);
        assert!(o.check(&[(X, op(Dir::Recv, 1))]).is_err());
        o.landed(key);
        o.host_access(X);
        o.check(&[(X, op(Dir::Recv, 1))])
            .expect("the host found it idle after it landed");
    }

    #[test]
    fn one_stream_orders_its_launches() {
        let mut o = Order::new();
        o.launch(&[(X, op(Dir::Recv, 0))]).unwrap();
        o.launch(&[(X, op(Dir::Send, 0))]).unwrap();
        o.launch(&[(X, op(Dir::Recv, 0))]).unwrap();
    }

    #[test]
    fn a_send_on_another_stream_after_a_recv_races_and_names_both() {
        let mut o = Order::new();
        o.launch(&[(X, op(Dir::Recv, 0))]).unwrap();
        let e = race(o.launch(&[(X, op(Dir::Send, 1))]));
        assert!(
            e.contains("send 16 x u32 to rank 1 on stream `s1` reads a buffer that `recv 16 x u32 from rank 1`"),
            "{e}"
        );
        assert!(
            e.contains("the send may read it before the recv has written it"),
            "{e}"
        );
        assert!(e.contains("record an event on `s0`"), "{e}");
        // Refused: nothing was recorded, so the same send still races.
        assert!(o.launch(&[(X, op(Dir::Send, 1))]).is_err());
    }

    #[test]
    fn an_event_orders_the_second_stream_after_the_first() {
        let mut o = Order::new();
        o.launch(&[(X, op(Dir::Recv, 0))]).unwrap();
        o.record(3, 0);
        o.wait(3, 1);
        o.launch(&[(X, op(Dir::Send, 1))]).unwrap();
        // The event was recorded before this recv: it does not order it.
        o.launch(&[(X, op(Dir::Recv, 0))]).unwrap_err();
    }

    #[test]
    fn an_event_recorded_before_the_op_orders_nothing() {
        let mut o = Order::new();
        o.record(3, 0);
        o.launch(&[(X, op(Dir::Recv, 0))]).unwrap();
        o.wait(3, 1);
        assert!(race(o.launch(&[(X, op(Dir::Send, 1))])).contains("reads"));
        // Recorded again, after the recv: now it does.
        o.record(3, 0);
        o.wait(3, 1);
        o.launch(&[(X, op(Dir::Send, 1))]).unwrap();
    }

    /// What a host read asks: a sync of stream 1 covers a recv on stream
    /// 0 once stream 1 waits for an event recorded after it, not before;
    /// a pending launch keeps its buffer busy whatever is synced.
    #[test]
    fn a_buffer_is_idle_once_a_sync_covers_its_ops_through_events() {
        let mut o = Order::new();
        assert!(o.idle(X));
        o.launch(&[(X, op(Dir::Recv, 0))]).unwrap();
        assert!(!o.idle(X));
        o.record(3, 0);
        let c = o.covers(Some(1));
        o.synced(c);
        assert!(!o.idle(X), "stream 1 does not wait for the event yet");
        o.wait(3, 1);
        let c = o.covers(Some(1));
        o.synced(c);
        assert!(o.idle(X));
        let key = o.commit_pending(&[(X, op(Dir::Recv, 0))]);
        let c = o.covers(None);
        o.synced(c);
        assert!(!o.idle(X), "a launch not yet on its stream");
        o.landed(key);
        let c = o.covers(None);
        o.synced(c);
        assert!(o.idle(X));
    }

    #[test]
    fn a_sync_of_the_first_stream_orders_every_later_launch() {
        let mut o = Order::new();
        o.launch(&[(X, op(Dir::Recv, 0))]).unwrap();
        let c = o.covers(Some(1));
        o.synced(c);
        o.launch(&[(X, op(Dir::Send, 1))]).unwrap_err();
        let c = o.covers(Some(0));
        o.synced(c);
        o.launch(&[(X, op(Dir::Send, 1))]).unwrap();
        o.launch(&[(X, op(Dir::Send, 2))]).unwrap();
        // Two reads on different streams do not race; a write after both
        // must be ordered after both.
        let e = race(o.launch(&[(X, op(Dir::Recv, 1))]));
        assert!(e.contains("stream `s2`"), "{e}");
        assert!(
            e.contains("overwrite it before the send has read it"),
            "{e}"
        );
        let c = o.covers(None);
        o.synced(c);
        o.launch(&[(X, op(Dir::Recv, 1))]).unwrap();
    }

    #[test]
    fn a_launch_made_while_a_sync_waits_is_not_covered_by_it() {
        let mut o = Order::new();
        let c = o.covers(Some(0));
        o.launch(&[(X, op(Dir::Recv, 0))]).unwrap();
        o.synced(c);
        assert!(o.launch(&[(X, op(Dir::Send, 1))]).is_err());
        let c = o.covers(None);
        o.synced(c);
        o.launch(&[(X, op(Dir::Send, 1))]).unwrap();
    }

    #[test]
    fn what_an_event_carries_is_transitive() {
        // s0 recv; s1 waits for s0; s2 waits for s1's later event.
        let mut o = Order::new();
        o.launch(&[(X, op(Dir::Recv, 0))]).unwrap();
        o.record(0, 0);
        o.wait(0, 1);
        o.launch(&[(Y, op(Dir::Send, 1))]).unwrap();
        o.record(1, 1);
        o.wait(1, 2);
        o.launch(&[(X, op(Dir::Send, 2))]).unwrap();
        assert!(race(o.launch(&[(X, op(Dir::Recv, 5))])).contains("stream `s0`"));
        // A sync of s2 tells the host that s0's recv is complete too.
        let c = o.covers(Some(2));
        o.synced(c);
        assert!(!o.uses.contains_key(&X));
        o.launch(&[(X, op(Dir::Recv, 5))]).unwrap();
    }

    #[test]
    fn ops_of_one_launch_on_one_buffer_race_whatever_their_streams() {
        let mut o = Order::new();
        let e = race(o.launch(&[(X, op(Dir::Send, 0)), (X, op(Dir::Recv, 0))]));
        assert!(e.contains("in the same launch"), "{e}");
        assert!(e.contains("a group's ops run at once"), "{e}");
        o.launch(&[(X, op(Dir::Send, 0)), (X, op(Dir::Send, 1))])
            .unwrap();
        o.launch(&[(X, op(Dir::Send, 0)), (Y, op(Dir::Recv, 1))])
            .unwrap();
    }

    #[test]
    fn a_launch_over_several_streams_orders_each_after_all_of_it() {
        // R8: the launch waits for what came before on each of its
        // streams, and what comes after on any of them waits for all of it.
        let mut o = Order::new();
        o.launch(&[(X, op(Dir::Recv, 0)), (Y, op(Dir::Send, 1))])
            .unwrap();
        o.launch(&[(X, op(Dir::Send, 1))]).unwrap();
        o.launch(&[(Y, op(Dir::Recv, 2))]).unwrap_err();
        // A sync of one of its streams covers all of it.
        let mut o = Order::new();
        o.launch(&[(X, op(Dir::Recv, 0)), (Y, op(Dir::Send, 1))])
            .unwrap();
        let c = o.covers(Some(1));
        o.synced(c);
        o.launch(&[(X, op(Dir::Send, 2))]).unwrap();
        // Before: a recv on stream 0, then a launch on streams 1 and 0.
        let mut o = Order::new();
        o.launch(&[(X, op(Dir::Recv, 0))]).unwrap();
        o.launch(&[(X, op(Dir::Send, 1)), (Y, op(Dir::Send, 0))])
            .unwrap();
        // Parts (communicators) apart are not joined.
        let mut o = Order::new();
        o.launch(&[(X, on(Dir::Recv, 0, 1)), (Y, on(Dir::Send, 1, 2))])
            .unwrap();
        o.launch(&[(X, op(Dir::Send, 1))]).unwrap_err();
    }

    #[test]
    fn parts_of_one_launch_on_one_stream_run_in_stream_order() {
        let mut o = Order::new();
        // A copy-engine lane's recv and an NCCL send of the same buffer,
        // in one group on one stream: the copies go on after NCCL's part.
        o.launch(&[(X, on(Dir::Send, 0, 1)), (X, on(Dir::Recv, 0, 2))])
            .unwrap();
        // On two streams, they race.
        let e = race(o.launch(&[(Y, on(Dir::Send, 0, 1)), (Y, on(Dir::Recv, 1, 2))]));
        assert!(e.contains("in the same launch"), "{e}");
    }

    fn digest(o: &Order) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        o.digest(&mut h);
        h.finish()
    }

    #[test]
    fn one_state_reached_in_two_orders_has_one_digest() {
        let mut a = Order::new();
        a.launch(&[(X, op(Dir::Recv, 0))]).unwrap();
        a.launch(&[(Y, op(Dir::Recv, 1))]).unwrap();
        let mut b = Order::new();
        b.launch(&[(Y, op(Dir::Recv, 1))]).unwrap();
        b.launch(&[(X, op(Dir::Recv, 0))]).unwrap();
        assert_eq!(digest(&a), digest(&b));
    }

    #[test]
    fn streams_and_events_numbered_in_the_millions_are_ordered_and_digested() {
        // A rank of a 1,024-rank simulated job uses lane streams numbered
        // up to 2 million: looked up, not tabled (which cost O(ranks³)).
        const FAR: u32 = 2_000_000;
        let far = |dir| Access {
            stream: FAR,
            stream_name: "far",
            ..op(dir, 0)
        };
        let mut a = Order::new();
        a.launch(&[(X, far(Dir::Recv))]).unwrap();
        a.record(4_000_000, FAR);
        a.launch(&[(Y, op(Dir::Recv, 1))]).unwrap();
        // Stream 1 waits for the event: its send of X comes after the recv.
        a.wait(4_000_000, 1);
        a.launch(&[(X, op(Dir::Send, 1))]).unwrap();
        assert!(a.index.len() == 2 && a.events.len() == 1);
        // Without the wait, it races.
        let mut b = Order::new();
        b.launch(&[(Y, op(Dir::Recv, 1))]).unwrap();
        b.launch(&[(X, far(Dir::Recv))]).unwrap();
        b.record(4_000_000, FAR);
        assert!(race(b.launch(&[(X, op(Dir::Send, 1))])).contains("far"));
        // One state reached in two orders has one digest.
        let mut c = Order::new();
        c.launch(&[(Y, op(Dir::Recv, 1))]).unwrap();
        c.launch(&[(X, far(Dir::Recv))]).unwrap();
        c.record(4_000_000, FAR);
        let mut d = Order::new();
        d.launch(&[(X, far(Dir::Recv))]).unwrap();
        d.record(4_000_000, FAR);
        d.launch(&[(Y, op(Dir::Recv, 1))]).unwrap();
        assert_eq!(digest(&c), digest(&d));
        d.record(5, 1);
        assert_ne!(digest(&c), digest(&d));
    }

    #[test]
    fn a_host_access_forgets_the_buffer() {
        let mut o = Order::new();
        o.launch(&[(X, op(Dir::Recv, 0))]).unwrap();
        o.host_access(X);
        o.launch(&[(X, op(Dir::Send, 1))]).unwrap();
    }

    #[test]
    fn syncs_forget_what_they_cover() {
        let mut o = Order::new();
        for b in 0..100 {
            o.launch(&[(b, op(Dir::Recv, (b % 3) as u32))]).unwrap();
        }
        let c = o.covers(Some(0));
        o.synced(c);
        assert_eq!(o.uses.len(), 66);
        let c = o.covers(None);
        o.synced(c);
        assert!(o.uses.is_empty());
    }

    #[test]
    fn the_digest_tells_a_synced_state_from_one_not_synced() {
        let mut a = Order::new();
        a.launch(&[(X, op(Dir::Recv, 0))]).unwrap();
        let mut b = Order::new();
        b.launch(&[(X, op(Dir::Recv, 0))]).unwrap();
        assert_eq!(digest(&a), digest(&b));
        let c = b.covers(Some(0));
        b.synced(c);
        assert_ne!(digest(&a), digest(&b));
    }
}
