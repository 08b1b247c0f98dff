//! [proptest](mod@proptest) strategies for schedule [`Program`]s: well-formed programs,
//! and mutations that break them, so that any property of a schedule, a
//! placement or the checker can be tested on many small programs.
//!
//! * [`programs`] generates programs of a [`Shape`] (ranks, extra host
//!   threads, messages placed by the policy or explicitly with `comm=` and
//!   `stream=`, groups, `record`/`wait` pairs, `sync`, `notify`/`await`
//!   pairs, every model knob). They are well-formed: every send has its
//!   receive, on the same communicator, with the same size, both grouped or
//!   both not, and each channel's sends are issued by one host thread in the
//!   order its receives are posted, so no interleaving can mismatch (R3).
//!   Runs of grouped ops are merged into groups, and a group that ends up
//!   with one op is a plain call (R8), so a message may be grouped on one
//!   side only: generated programs set `one-sided-groups=accept`, as the
//!   calibrated model of the H200s does (the strict check has its own tests).
//!   They may still hang: that is what the checker is for.
//! * [`Mutation`] breaks a program: swap two adjacent statements, drop one,
//!   resize one side of a message, reverse a thread's statements.
//!   [`mutation`] generates them; [`mutants`] pairs programs with mutations
//!   that apply to them.
//!
//! Programs are small by default (2–4 ranks, at most five messages and a few
//! other statements, sizes in KiB), so the exhaustive checker decides each
//! in milliseconds and the simulated transport can run them too.
//!
//! Generation goes through a recipe of small numbers, so proptest shrinks a
//! failing program to fewer messages, threads and statements, default knobs
//! and policy placement. Print it with `{}` (the schedule format) in the
//! assertion message, and the shrunk failure reads as a schedule file:
//!
//! ```
//! use duplex::Size;
//! use duplex::schedule::parse;
//! use duplex_sim::check::Verdict;
//! use duplex_sim::check_program;
//! use duplex_tests::strategies::{self, Mutation, Shape};
//! use proptest::prelude::*;
//!
//! fn ok(p: &duplex::schedule::Program) -> bool {
//!     matches!(check_program(p).verdict, Verdict::Ok)
//! }
//!
//! // Your schedule: a ring on per-direction lanes. It cannot hang, and no
//! // resized message (any op of any rank) goes unnoticed.
//! let ring = parse(
//!     "ranks 3\npolicy per-direction\n\
//!      rank 0:\n send 1 4KiB\n recv 2 4KiB\n\
//!      rank 1:\n send 2 4KiB\n recv 0 4KiB\n\
//!      rank 2:\n send 0 4KiB\n recv 1 4KiB\n",
//! )
//! .unwrap();
//! assert!(ok(&ring));
//! proptest!(ProptestConfig::with_cases(16), |(at in any::<usize>())| {
//!     let broken = Mutation::Resize(at).apply(&ring).unwrap();
//!     prop_assert!(!ok(&broken), "a resize went unnoticed:\n{}", broken);
//! });
//!
//! // A property of programs in general: one that cannot hang under NCCL's
//! // contract (no eager capacity) cannot hang with the H200's capacity.
//! proptest!(ProptestConfig::with_cases(16), |(mut p in strategies::programs(Shape::default()))| {
//!     p.model.eager = Size(0);
//!     if ok(&p) {
//!         p.model.eager = Size(64 << 20);
//!         prop_assert!(ok(&p), "more capacity made it hang:\n{}", p);
//!     }
//! });
//! ```

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::ops::RangeInclusive;

use duplex::schedule::{CommDecl, Dir, Line, P2p, Program, Stmt, StmtKind, Thread};
use duplex::{Model, Policy, Size};
use proptest::collection::vec;
use proptest::prelude::*;

/// Stream names explicit placement, `record`, `wait` and `sync` choose from.
const STREAMS: [&str; 3] = ["default", "a", "b"];
/// Event names (per rank).
const EVENTS: [&str; 2] = ["e0", "e1"];
/// `notify`/`await` tags.
const TAGS: [&str; 2] = ["go", "meta"];
/// The most ops one generated group holds.
const GROUP_MAX: usize = 3;

/// What generated programs may contain. Every list must be non-empty; the
/// first value of each is what shrinking tends to.
#[derive(Clone, Debug)]
pub struct Shape {
    /// Number of ranks.
    pub ranks: RangeInclusive<u32>,
    /// Number of messages (each a send and its receive).
    pub messages: RangeInclusive<usize>,
    /// At most this many host threads besides each rank's main thread.
    pub extra_threads: usize,
    /// Message sizes.
    pub sizes: Vec<Size>,
    /// Placement policies.
    pub policies: Vec<Policy>,
    /// Under `per-direction`, the `copy-from=` values (copy-engine lanes;
    /// `None`: none). Chosen by the policy's knob divided by the number of
    /// policies, so that shapes with one value generate what they did
    /// before this existed.
    pub copy_from: Vec<Option<Size>>,
    /// Eager capacities (R5).
    pub eager: Vec<Size>,
    /// `lazy-connect` values (R6, R7).
    pub lazy_connect: Vec<bool>,
    /// `cold-channels=mismatched` values (R6: only a channel set up in a
    /// round of mismatched calls is cold). Chosen by the lazy-connect knob
    /// divided by the number of lazy-connect values, so that shapes with
    /// one value (the default: `rendezvous` only) generate what they did
    /// before this existed.
    pub cold_channels: Vec<bool>,
    /// `comm-order` values (R2).
    pub comm_order: Vec<bool>,
    /// `one-sided-groups=accept` values (R8; `false`: a group met by an
    /// ungrouped op is an error). Chosen by the comm-order knob divided by
    /// the number of comm-order values, so that shapes with one value (the
    /// default: `accept` only) generate what they did before this existed.
    /// Under `false` a generated program may err: a run of grouped ops on
    /// one thread becomes a group of several while its partners may stay a
    /// group of one, which is no group (R8). For properties of broken
    /// programs only.
    pub one_sided_groups: Vec<bool>,
    /// `kernels` values (R10); `None` is unbounded.
    pub kernels: Vec<Option<u32>>,
    /// Messages may be placed explicitly (`comm=`, `stream=`); otherwise
    /// every op is placed by the policy.
    pub explicit: bool,
    /// At most this many declared communicators (`comm cN ...`).
    pub comms: usize,
    /// Messages may be grouped (both sides, R8).
    pub groups: bool,
    /// At most this many `record E` / `wait E` pairs.
    pub events: usize,
    /// At most this many `sync` statements.
    pub syncs: usize,
    /// At most this many `notify` / `await` pairs.
    pub notifies: usize,
}

impl Default for Shape {
    /// 2–4 ranks, 1–5 messages of 1–16 KiB, one extra thread, everything
    /// the format has.
    fn default() -> Shape {
        Shape {
            ranks: 2..=4,
            messages: 1..=5,
            extra_threads: 1,
            sizes: vec![Size(4 << 10), Size(1 << 10), Size(16 << 10)],
            policies: vec![Policy::Shared, Policy::PerDirection],
            copy_from: vec![None],
            eager: vec![Size(0), Size(4 << 10), Size(16 << 10)],
            lazy_connect: vec![false, true],
            cold_channels: vec![false],
            comm_order: vec![true, false],
            one_sided_groups: vec![true],
            kernels: vec![None, Some(1), Some(2)],
            explicit: true,
            comms: 2,
            groups: true,
            events: 1,
            syncs: 2,
            notifies: 1,
        }
    }
}

impl Shape {
    /// Programs whose ops are all placed by the policy: no `comm=` or
    /// `stream=` on any op (events and syncs still name streams).
    pub fn policy_placed() -> Shape {
        Shape {
            explicit: false,
            comms: 0,
            ..Shape::default()
        }
    }

    /// Smaller programs (2–3 ranks, at most four messages), for properties
    /// that run each program many times, such as the simulated transport's
    /// exhaustive exploration.
    pub fn small() -> Shape {
        Shape {
            ranks: 2..=3,
            messages: 1..=4,
            syncs: 1,
            ..Shape::default()
        }
    }

    /// The same shape with copy-engine lanes for ops of 4 KiB and more
    /// (of the default sizes 1, 4 and 16 KiB) in about half the programs
    /// under `per-direction`.
    pub fn with_copy_lanes(self) -> Shape {
        Shape {
            copy_from: vec![None, Some(Size(4 << 10))],
            ..self
        }
    }

    fn assert_valid(&self) {
        assert!(
            !(self.sizes.is_empty()
                || self.policies.is_empty()
                || self.copy_from.is_empty()
                || self.eager.is_empty()
                || self.lazy_connect.is_empty()
                || self.cold_channels.is_empty()
                || self.comm_order.is_empty()
                || self.one_sided_groups.is_empty()
                || self.kernels.is_empty()),
            "every list of a Shape must hold at least one value: {self:?}"
        );
        assert!(
            *self.ranks.start() >= 1 && self.ranks.start() <= self.ranks.end(),
            "a Shape needs at least one rank: {self:?}"
        );
        assert!(
            self.messages.start() <= self.messages.end(),
            "empty message range: {self:?}"
        );
    }

    fn extras(&self) -> usize {
        self.events + self.syncs + self.notifies
    }
}

/// Well-formed programs of `shape` (see the module docs).
///
/// # Panics
///
/// If a list of `shape` is empty or a range is empty.
pub fn programs(shape: Shape) -> impl Strategy<Value = Program> {
    shape.assert_valid();
    recipes(&shape).prop_map(move |r| r.build(&shape))
}

/// Well-formed programs of the default [`Shape`].
pub fn program() -> impl Strategy<Value = Program> {
    programs(Shape::default())
}

/// Mutations; each applies to any program with something to change.
pub fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        any::<u16>().prop_map(|at| Mutation::Swap(at.into())),
        any::<u16>().prop_map(|at| Mutation::Drop(at.into())),
        any::<u16>().prop_map(|at| Mutation::Resize(at.into())),
        any::<u16>().prop_map(|at| Mutation::Reverse(at.into())),
        any::<u16>().prop_map(|at| Mutation::Ungroup(at.into())),
    ]
}

/// Well-formed programs of `shape`, each with a mutation that applies to it
/// and the mutated program: `(original, mutation, mutant)`.
pub fn mutants(shape: Shape) -> impl Strategy<Value = (Program, Mutation, Program)> {
    (programs(shape), mutation()).prop_filter_map("the mutation has nothing to change", |(p, m)| {
        m.apply(&p).map(|q| (p, m, q))
    })
}

/// A change that breaks a program. `at` picks what to change: it counts,
/// modulo their number, the candidates in file order (threads in order,
/// statements in order, ops of a group in order), so every value applies to
/// every program that has a candidate at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mutation {
    /// Swaps a statement with the next one of its thread.
    Swap(usize),
    /// Drops a statement, or one op of a group of several.
    Drop(usize),
    /// Resizes one op, one side of a message: doubles its size (0 becomes
    /// 1 byte). An `ok` program becomes one that errs (R3) or hangs.
    Resize(usize),
    /// Reverses the order of a thread's statements.
    Reverse(usize),
    /// Splits a group of several ops into its ops, one statement each, in
    /// order: their partners' launches stay grouped, so under
    /// `one-sided-groups=error` the program errs (R8).
    Ungroup(usize),
}

impl fmt::Display for Mutation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mutation::Swap(at) => write!(f, "swap statement #{at} with the next"),
            Mutation::Drop(at) => write!(f, "drop statement or group op #{at}"),
            Mutation::Resize(at) => write!(f, "resize op #{at}"),
            Mutation::Reverse(at) => write!(f, "reverse thread #{at}"),
            Mutation::Ungroup(at) => write!(f, "ungroup group #{at}"),
        }
    }
}

impl Mutation {
    /// The mutated program, or `None` when `program` has nothing this
    /// mutation can change (no thread of two statements to swap or reverse,
    /// no statement to drop, no op to resize, no group of several ops).
    pub fn apply(&self, program: &Program) -> Option<Program> {
        let mut p = program.clone();
        match *self {
            Mutation::Swap(at) => {
                let slots = p
                    .threads
                    .iter()
                    .enumerate()
                    .flat_map(|(t, th)| (1..th.body.len()).map(move |s| (t, s - 1)))
                    .collect();
                let (t, s) = nth(slots, at)?;
                p.threads[t].body.swap(s, s + 1);
            }
            Mutation::Reverse(at) => {
                let threads = (0..p.threads.len())
                    .filter(|t| p.threads[*t].body.len() >= 2)
                    .collect();
                let t = nth(threads, at)?;
                p.threads[t].body.reverse();
            }
            Mutation::Drop(at) => {
                let mut slots = Vec::new();
                for (t, th) in p.threads.iter().enumerate() {
                    for (s, stmt) in th.body.iter().enumerate() {
                        match &stmt.kind {
                            StmtKind::Group(ops) if ops.len() > 1 => {
                                slots.extend((0..ops.len()).map(|o| (t, s, Some(o))));
                            }
                            _ => slots.push((t, s, None)),
                        }
                    }
                }
                let (t, s, op) = nth(slots, at)?;
                let body = &mut p.threads[t].body;
                match (op, &mut body[s].kind) {
                    (Some(o), StmtKind::Group(ops)) => {
                        ops.remove(o);
                    }
                    _ => {
                        body.remove(s);
                    }
                }
            }
            Mutation::Ungroup(at) => {
                let mut slots = Vec::new();
                for (t, th) in p.threads.iter().enumerate() {
                    for (s, stmt) in th.body.iter().enumerate() {
                        if matches!(&stmt.kind, StmtKind::Group(ops) if ops.len() > 1) {
                            slots.push((t, s));
                        }
                    }
                }
                let (t, s) = nth(slots, at)?;
                let body = &mut p.threads[t].body;
                let group = body.remove(s);
                let StmtKind::Group(ops) = group.kind else {
                    return None;
                };
                for (k, op) in ops.into_iter().enumerate() {
                    let line = if op.line.0 != 0 { op.line } else { group.line };
                    body.insert(
                        s + k,
                        Stmt {
                            kind: StmtKind::Op(op),
                            line,
                        },
                    );
                }
            }
            Mutation::Resize(at) => {
                let mut slots = Vec::new();
                for (t, th) in p.threads.iter().enumerate() {
                    for (s, stmt) in th.body.iter().enumerate() {
                        match &stmt.kind {
                            StmtKind::Op(_) => slots.push((t, s, 0)),
                            StmtKind::Group(ops) => slots.extend((0..ops.len()).map(|o| (t, s, o))),
                            _ => {}
                        }
                    }
                }
                let (t, s, o) = nth(slots, at)?;
                let op = match &mut p.threads[t].body[s].kind {
                    StmtKind::Op(op) => op,
                    StmtKind::Group(ops) => &mut ops[o],
                    _ => return None,
                };
                op.size = Size(match op.size.0 {
                    0 => 1,
                    u64::MAX => u64::MAX - 1,
                    n => n.saturating_mul(2),
                });
            }
        }
        Some(p)
    }
}

/// The choices a program is built from: small numbers that proptest shrinks
/// toward zero, and that the fuzzers read from bytes. Every field is reduced
/// modulo what it picks from, so every recipe builds a well-formed program.
#[derive(Clone, Debug)]
pub(crate) struct Recipe {
    pub(crate) ranks: u32,
    /// Policy, eager, lazy-connect, comm-order and kernels: indices into the
    /// shape's lists.
    pub(crate) knobs: [u8; 5],
    /// Declared communicators: membership bit masks.
    pub(crate) comms: Vec<u8>,
    /// Extra host threads: the rank of each.
    pub(crate) threads: Vec<u8>,
    pub(crate) messages: Vec<Message>,
    pub(crate) extras: Vec<Extra>,
}

/// One message: a send and its receive.
#[derive(Clone, Debug)]
pub(crate) struct Message {
    pub(crate) src: u8,
    /// The destination, as an offset from `src` (never `src` itself).
    pub(crate) dst: u8,
    pub(crate) size: u8,
    /// Placed with `comm=`/`stream=` (when the shape allows it).
    pub(crate) explicit: bool,
    /// 0: `world`; else a declared communicator holding both ends. An even
    /// value also spells `comm=world` out when a stream is named.
    pub(crate) comm: u8,
    /// 0: no `stream=`; else a stream name.
    pub(crate) send_stream: u8,
    pub(crate) recv_stream: u8,
    pub(crate) grouped: bool,
    /// Which thread of the source (of the destination) issues it; only the
    /// first message of a channel chooses, the others follow it.
    pub(crate) send_thread: u8,
    pub(crate) recv_thread: u8,
    /// Where in their threads the two ops go (sorted by key).
    pub(crate) send_key: u8,
    pub(crate) recv_key: u8,
}

/// A statement other than a message: a `record`/`wait` pair, a `sync` or a
/// `notify`/`await` pair.
#[derive(Clone, Debug)]
pub(crate) struct Extra {
    pub(crate) kind: u8,
    /// The thread (of all threads) that records, syncs or notifies.
    pub(crate) thread: u8,
    /// The awaiting rank (an offset) and thread.
    pub(crate) other: u8,
    /// Event or tag name.
    pub(crate) name: u8,
    /// Stream of `record` or `sync` (0: none named), stream of `wait`.
    pub(crate) stream_a: u8,
    pub(crate) stream_b: u8,
    pub(crate) key_a: u8,
    pub(crate) key_b: u8,
}

fn recipes(shape: &Shape) -> impl Strategy<Value = Recipe> + use<> {
    let message = (
        (any::<u8>(), any::<u8>(), any::<u8>()),
        (any::<bool>(), any::<u8>(), 0..=3u8, 0..=3u8),
        (proptest::bool::weighted(0.3), any::<u8>(), any::<u8>()),
        (any::<u8>(), any::<u8>()),
    )
        .prop_map(
            |(
                (src, dst, size),
                (explicit, comm, send_stream, recv_stream),
                (grouped, send_thread, recv_thread),
                (send_key, recv_key),
            )| Message {
                src,
                dst,
                size,
                explicit,
                comm,
                send_stream,
                recv_stream,
                grouped,
                send_thread,
                recv_thread,
                send_key,
                recv_key,
            },
        );
    let extra = (
        (any::<u8>(), any::<u8>(), any::<u8>(), any::<u8>()),
        (0..=3u8, 0..=3u8, any::<u8>(), any::<u8>()),
    )
        .prop_map(
            |((kind, thread, other, name), (stream_a, stream_b, key_a, key_b))| Extra {
                kind,
                thread,
                other,
                name,
                stream_a,
                stream_b,
                key_a,
                key_b,
            },
        );
    let knob = |len: usize| 0..len.min(255) as u8;
    (
        shape.ranks.clone(),
        (
            // The policy and, under per-direction, the copy-engine
            // threshold (`k[0] / policies`): drawn below the number of
            // policies alone, the threshold was always the first, so no
            // program ever had copy-engine lanes (found by review).
            knob(shape.policies.len() * shape.copy_from.len()),
            knob(shape.eager.len()),
            knob(shape.lazy_connect.len() * shape.cold_channels.len()),
            knob(shape.comm_order.len() * shape.one_sided_groups.len()),
            knob(shape.kernels.len()),
        ),
        vec(any::<u8>(), 0..=shape.comms),
        vec(any::<u8>(), 0..=shape.extra_threads),
        vec(message, shape.messages.clone()),
        vec(extra, 0..=shape.extras()),
    )
        .prop_map(
            |(ranks, (a, b, c, d, e), comms, threads, messages, extras)| Recipe {
                ranks,
                knobs: [a, b, c, d, e],
                comms,
                threads,
                messages,
                extras,
            },
        )
}

/// Reads a recipe's numbers from bytes, one byte per choice; past the end
/// every byte reads as 0.
#[derive(Debug)]
pub(crate) struct Bytes<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Bytes<'a> {
    pub(crate) fn new(data: &'a [u8]) -> Bytes<'a> {
        Bytes { data, pos: 0 }
    }

    pub(crate) fn byte(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }

    /// A number in `range`.
    pub(crate) fn within(&mut self, range: &RangeInclusive<usize>) -> usize {
        let span = range.end().saturating_sub(*range.start()) + 1;
        range.start() + usize::from(self.byte()) % span
    }
}

impl Recipe {
    /// The recipe that `bytes` spell for `shape`.
    pub(crate) fn from_bytes(shape: &Shape, b: &mut Bytes<'_>) -> Recipe {
        let ranks = b.within(&(*shape.ranks.start() as usize..=*shape.ranks.end() as usize)) as u32;
        let knobs = [b.byte(), b.byte(), b.byte(), b.byte(), b.byte()];
        let n = b.within(&(0..=shape.comms));
        let comms = (0..n).map(|_| b.byte()).collect();
        let n = b.within(&(0..=shape.extra_threads));
        let threads = (0..n).map(|_| b.byte()).collect();
        let n = b.within(&shape.messages);
        let messages = (0..n)
            .map(|_| Message {
                src: b.byte(),
                dst: b.byte(),
                size: b.byte(),
                explicit: b.byte() & 1 == 1,
                comm: b.byte(),
                send_stream: b.byte() % 4,
                recv_stream: b.byte() % 4,
                grouped: b.byte() % 4 == 1,
                send_thread: b.byte(),
                recv_thread: b.byte(),
                send_key: b.byte(),
                recv_key: b.byte(),
            })
            .collect();
        let n = b.within(&(0..=shape.extras()));
        let extras = (0..n)
            .map(|_| Extra {
                kind: b.byte(),
                thread: b.byte(),
                other: b.byte(),
                name: b.byte(),
                stream_a: b.byte() % 4,
                stream_b: b.byte() % 4,
                key_a: b.byte(),
                key_b: b.byte(),
            })
            .collect();
        Recipe {
            ranks,
            knobs,
            comms,
            threads,
            messages,
            extras,
        }
    }

    /// The program this recipe spells under `shape`.
    pub(crate) fn build(&self, shape: &Shape) -> Program {
        Builder::new(self, shape).run()
    }
}

/// Candidate `at`, modulo their number.
fn nth<T: Copy>(candidates: Vec<T>, at: usize) -> Option<T> {
    match candidates.len() {
        0 => None,
        n => Some(candidates[at % n]),
    }
}

fn pick<T: Clone>(list: &[T], i: u8) -> T {
    list[usize::from(i) % list.len()].clone()
}

fn stream_name(choice: u8) -> Option<String> {
    (choice > 0).then(|| STREAMS[usize::from(choice - 1) % STREAMS.len()].to_string())
}

/// A statement-to-be of one thread, before ordering.
#[derive(Clone, Debug)]
struct Item {
    key: u8,
    /// Items of one chain keep their relative order: (chain, position).
    chain: Option<(usize, usize)>,
    what: What,
}

#[derive(Clone, Debug)]
enum What {
    Op(P2p, bool),
    Stmt(StmtKind),
}

/// A channel as the generator sees it: (communicator name or `None` for the
/// policy's lane, source, destination).
type Channel = (Option<String>, u32, u32);

struct Builder<'r> {
    recipe: &'r Recipe,
    shape: &'r Shape,
    ranks: u32,
    threads: Vec<Thread>,
    comms: Vec<CommDecl>,
    items: Vec<Vec<Item>>,
    /// Each channel's chain id, sending thread, receiving thread and
    /// messages so far.
    channels: HashMap<Channel, (usize, usize, usize, usize)>,
    chains: usize,
}

impl<'r> Builder<'r> {
    fn new(recipe: &'r Recipe, shape: &'r Shape) -> Builder<'r> {
        let ranks = recipe.ranks.max(1);
        let mut threads: Vec<Thread> = (0..ranks)
            .map(|rank| Thread {
                rank,
                name: None,
                body: Vec::new(),
                line: Line(0),
            })
            .collect();
        for (i, r) in recipe.threads.iter().take(shape.extra_threads).enumerate() {
            threads.push(Thread {
                rank: u32::from(*r) % ranks,
                name: Some(format!("t{i}")),
                body: Vec::new(),
                line: Line(0),
            });
        }
        threads.sort_by_key(|t| t.rank);
        let comms = recipe
            .comms
            .iter()
            .take(shape.comms)
            .enumerate()
            .map(|(i, mask)| {
                let mut members: Vec<u32> =
                    (0..ranks).filter(|r| mask >> (r % 8) & 1 == 1).collect();
                if members.len() < 2 {
                    members = (0..ranks).collect();
                }
                CommDecl {
                    name: format!("c{i}"),
                    ranks: members,
                    line: Line(0),
                }
            })
            .collect();
        let items = vec![Vec::new(); threads.len()];
        Builder {
            recipe,
            shape,
            ranks,
            threads,
            comms,
            items,
            channels: HashMap::new(),
            chains: 0,
        }
    }

    /// Thread `choice` (modulo their number) of `rank`.
    fn thread_of(&self, rank: u32, choice: u8) -> usize {
        let mine: Vec<usize> = (0..self.threads.len())
            .filter(|t| self.threads[*t].rank == rank)
            .collect();
        mine[usize::from(choice) % mine.len()]
    }

    fn chain(&mut self) -> usize {
        self.chains += 1;
        self.chains - 1
    }

    fn run(mut self) -> Program {
        let recipe = self.recipe;
        for m in &recipe.messages {
            self.message(m);
        }
        let mut left = [self.shape.events, self.shape.syncs, self.shape.notifies];
        let kinds: Vec<usize> = (0..3).filter(|k| left[*k] > 0).collect();
        for e in &recipe.extras {
            if kinds.is_empty() {
                break;
            }
            let kind = kinds[usize::from(e.kind) % kinds.len()];
            if left[kind] == 0 {
                continue;
            }
            left[kind] -= 1;
            match kind {
                0 => self.event(e),
                1 => self.sync(e),
                _ => self.control(e),
            }
        }
        let items = std::mem::take(&mut self.items);
        for (t, items) in items.into_iter().enumerate() {
            self.threads[t].body = order(items);
        }
        let k = recipe.knobs;
        let policy = pick(&self.shape.policies, k[0]);
        Program {
            ranks: self.ranks,
            policy,
            copy_from: if policy == Policy::PerDirection {
                pick(
                    &self.shape.copy_from,
                    k[0] / self.shape.policies.len() as u8,
                )
            } else {
                None
            },
            model: Model {
                eager: pick(&self.shape.eager, k[1]),
                lazy_connect: pick(&self.shape.lazy_connect, k[2]),
                cold_mismatched_only: pick(
                    &self.shape.cold_channels,
                    k[2] / self.shape.lazy_connect.len() as u8,
                ),
                comm_order: pick(&self.shape.comm_order, k[3]),
                kernels: pick(&self.shape.kernels, k[4]),
                one_sided_groups: pick(
                    &self.shape.one_sided_groups,
                    k[3] / self.shape.comm_order.len() as u8,
                ),
            },
            comms: self.comms,
            threads: self.threads,
        }
    }

    fn message(&mut self, m: &Message) {
        let n = self.ranks;
        if n < 2 {
            return;
        }
        let src = u32::from(m.src) % n;
        let dst = (src + 1 + u32::from(m.dst) % (n - 1)) % n;
        let size = pick(&self.shape.sizes, m.size);
        let explicit = self.shape.explicit && m.explicit;
        let comm = explicit.then(|| {
            let declared = match (m.comm, self.comms.len()) {
                (0, _) | (_, 0) => None,
                (c, k) => Some(&self.comms[(usize::from(c) - 1) % k]),
            };
            declared
                .filter(|c| c.ranks.contains(&src) && c.ranks.contains(&dst))
                .map_or_else(|| "world".to_string(), |c| c.name.clone())
        });
        let channel = (comm.clone(), src, dst);
        let fresh = (
            self.chains,
            self.thread_of(src, m.send_thread),
            self.thread_of(dst, m.recv_thread),
            0,
        );
        let entry = self.channels.entry(channel).or_insert(fresh);
        let (chain, send_thread, recv_thread, k) = *entry;
        entry.3 += 1;
        if k == 0 {
            self.chains += 1;
        }
        let grouped = self.shape.groups && m.grouped;
        let side = |dir: Dir, peer: u32, stream: u8| {
            let stream = if explicit { stream_name(stream) } else { None };
            let comm = match comm.as_deref() {
                None => None,
                Some("world") if stream.is_some() && m.comm % 2 == 1 => None,
                Some(c) => Some(c.into()),
            };
            P2p {
                dir,
                peer,
                size,
                comm,
                stream: stream.map(String::into_boxed_str),
                line: Line(0),
            }
        };
        let send = side(Dir::Send, dst, m.send_stream);
        let recv = side(Dir::Recv, src, m.recv_stream);
        self.items[send_thread].push(Item {
            key: m.send_key,
            chain: Some((chain, k)),
            what: What::Op(send, grouped),
        });
        self.items[recv_thread].push(Item {
            key: m.recv_key,
            chain: Some((chain, k)),
            what: What::Op(recv, grouped),
        });
    }

    fn event(&mut self, e: &Extra) {
        let t = usize::from(e.thread) % self.threads.len();
        let event = EVENTS[usize::from(e.name) % EVENTS.len()].to_string();
        let chain = self.chain();
        self.items[t].push(Item {
            key: e.key_a,
            chain: Some((chain, 0)),
            what: What::Stmt(StmtKind::Record {
                event: event.clone(),
                stream: stream_name(e.stream_a),
            }),
        });
        self.items[t].push(Item {
            key: e.key_b,
            chain: Some((chain, 1)),
            what: What::Stmt(StmtKind::Wait {
                event,
                stream: stream_name(e.stream_b),
            }),
        });
    }

    fn sync(&mut self, e: &Extra) {
        let t = usize::from(e.thread) % self.threads.len();
        self.items[t].push(Item {
            key: e.key_a,
            chain: None,
            what: What::Stmt(StmtKind::Sync {
                stream: stream_name(e.stream_a),
            }),
        });
    }

    fn control(&mut self, e: &Extra) {
        let n = self.ranks;
        if n < 2 {
            return;
        }
        let from = usize::from(e.thread) % self.threads.len();
        let from_rank = self.threads[from].rank;
        let to_rank = (from_rank + 1 + u32::from(e.other) % (n - 1)) % n;
        let to = self.thread_of(to_rank, e.other / 8);
        let tag = TAGS[usize::from(e.name) % TAGS.len()].to_string();
        self.items[from].push(Item {
            key: e.key_a,
            chain: None,
            what: What::Stmt(StmtKind::Notify {
                peer: to_rank,
                tag: tag.clone(),
            }),
        });
        self.items[to].push(Item {
            key: e.key_b,
            chain: None,
            what: What::Stmt(StmtKind::Await {
                peer: from_rank,
                tag,
            }),
        });
    }
}

/// Sorts a thread's items by key (ties in generation order), puts each
/// chain's items back in chain order on the places the chain got, and
/// merges runs of grouped ops into groups.
fn order(mut items: Vec<Item>) -> Vec<Stmt> {
    items.sort_by_key(|it| it.key);
    let mut chains: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, it) in items.iter().enumerate() {
        if let Some((c, _)) = it.chain {
            chains.entry(c).or_default().push(i);
        }
    }
    for places in chains.values() {
        let mut members: Vec<Item> = places.iter().map(|i| items[*i].clone()).collect();
        members.sort_by_key(|it| it.chain.map(|(_, k)| k));
        for (i, it) in places.iter().zip(members) {
            items[*i] = it;
        }
    }
    let mut body: Vec<Stmt> = Vec::new();
    let mut open = false;
    for it in items {
        let kind = match it.what {
            What::Op(op, true) => {
                if open
                    && let Some(StmtKind::Group(ops)) = body.last_mut().map(|s| &mut s.kind)
                    && ops.len() < GROUP_MAX
                {
                    ops.push(op);
                    continue;
                }
                open = true;
                body.push(Stmt {
                    kind: StmtKind::Group(vec![op]),
                    line: Line(0),
                });
                continue;
            }
            What::Op(op, false) => StmtKind::Op(op),
            What::Stmt(kind) => kind,
        };
        open = false;
        body.push(Stmt {
            kind,
            line: Line(0),
        });
    }
    body
}

#[cfg(test)]
mod tests {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;

    use super::*;

    #[test]
    fn generated_programs_print_and_parse_back() {
        let mut runner = TestRunner::deterministic();
        let strategy = program();
        for _ in 0..200 {
            let p = strategy.new_tree(&mut runner).unwrap().current();
            let text = p.to_string();
            assert_eq!(
                duplex::schedule::parse(&text).map(|q| q.without_lines()),
                Ok(p.without_lines()),
                "{text}"
            );
        }
    }

    #[test]
    fn bytes_build_programs_of_the_shape() {
        let shape = Shape::default();
        let data: Vec<u8> = (0..=255u8).cycle().take(600).collect();
        let p = Recipe::from_bytes(&shape, &mut Bytes::new(&data)).build(&shape);
        assert!(shape.ranks.contains(&p.ranks));
        let empty = Recipe::from_bytes(&shape, &mut Bytes::new(&[])).build(&shape);
        assert_eq!(empty.ranks, 2);
        assert_eq!(
            empty.to_string(),
            "ranks 2\npolicy shared\nmodel eager=0B lazy-connect=off comm-order=on kernels=unbounded one-sided-groups=accept\nrank 0:\n  send 1 4KiB\nrank 1:\n  recv 0 4KiB\n"
        );
    }
}
