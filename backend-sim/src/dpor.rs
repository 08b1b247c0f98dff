//! Dynamic partial-order reduction: how [`crate::Sim::check`] explores rank
//! code, whose future calls nobody knows before it runs.
//!
//! The schedule checker knows every thread's remaining calls, so it picks a
//! persistent set before it steps ([`crate::check::reduce`]). Rank code is
//! opaque: a thread's next call is known only once it is parked, and what
//! it does after is known only once it has done it. The search therefore
//! learns which steps depend on each other from the executions it runs, as
//! loom and other model checkers of real code do (Flanagan and Godefroid,
//! "Dynamic partial-order reduction for model checking software", POPL
//! 2005): it runs one interleaving, and where two steps of different
//! threads that did not commute ran in an order nothing forced (no chain of
//! dependent steps between them), it adds the other order as a choice at
//! the decision point before the first of them. Threads whose steps touch
//! nothing in common (a pipeline's forward and backward threads, each on
//! its own lanes) are explored in one execution.
//!
//! **Transitions and what they use.** A transition is one thread's step:
//! its call, and, where the call returns at once, its user code up to its
//! next call; or the return of its call that blocked, once another step
//! let it return, and its code up to its next call. Threads that its code
//! starts run their code up to their first call in it too. Each use is an
//! object of the thread's rank and a [`Mode`]: the machine's objects of a
//! call ([`duplex::machine::Machine::footprint`], the one definition of
//! which calls commute, shared with the checker), a buffer (a host read or
//! write, a device op's read or write, a sync that covers ops on it, its
//! drop) and the rank's numbering of communicators. Uses of different
//! ranks are never compared: steps of different ranks commute and never
//! disable each other (`check.rs`); that one enables another (a send lets a
//! recv's sync return, a notify an await) is an edge of the happens-before
//! order, taken from the threads that became enabled in each transition.
//!
//! **Races.** Each transition gets a vector clock. When a transition ends,
//! every earlier transition that used one of its objects in a
//! conflicting mode and does not happen before it is a race (Flanagan and
//! Godefroid take the latest only; that needs every happens-before edge,
//! and a parked call that returns at once after another rank's step has
//! none from it, so a race that only seemed the latest hid the real one:
//! found by review, `a_call_that_returns_at_once_gets_no_edge_from_the_other_rank`):
//! the transition's chosen thread is added to the choices of the decision
//! before that earlier one (or, if it could not move there, the threads that
//! lead to it, or every thread that could). A call parked when the
//! execution ends (a hang, a pruned execution aside) is checked the same
//! way, as if it ran last.
//!
//! **Sleep sets.** Once every execution that continues with a thread's
//! step at a decision has been explored, that thread falls asleep in the
//! decision's later branches, with the step it took there, and stays
//! asleep while the steps taken commute with that one (no object of one
//! rank used in conflicting modes, no thread run by both): a sleeping
//! thread is not taken, a race that asks for it there is dropped, and an
//! execution where every thread that could move is asleep stops
//! (Godefroid's sleep sets, as Flanagan and Godefroid combine them with
//! their rule; a forced thread asleep does not stop it, the others are
//! decided as anywhere, since the forced thread's persistence covers the
//! machine's calls, not the others' user code). They remove the
//! executions that only reorder steps that commute around a reversed
//! pair. A thread whose call blocked where it fell asleep, taken later,
//! may find its call able to return at once and run its code in the same
//! step; that is the blocked step and its return taken one after the
//! other, which the branch where it fell asleep explored.
//!
//! **State caching.** A decision whose state was fully explored before is
//! pruned, as in the schedule checker. Dynamic POR alone would lose what
//! that state's subtree would have told the prefix: which of its
//! transitions race with the prefix's. So each explored state keeps a
//! summary of every use made after it (a bit set over the uses seen, and
//! the parked calls checked there: each thread's next step), and
//! a pruned execution checks each summarized use against its prefix,
//! conservatively (after Yang, Chen, Gopalakrishnan and Kirby, "Efficient
//! stateful dynamic partial order reduction", SPIN 2008): with no clock
//! for the use, what happens before it after the state is unknown, so
//! every conflicting use of another thread that no later conflicting use
//! follows in the happens-before order counts as a race (the race the
//! rule above would pick is among them). A state explored with threads
//! asleep did not take them, so it is pruned only where every thread
//! asleep then is asleep now; else it is explored again, and afterwards
//! counts as explored with the threads asleep both times. The search
//! stays sound and merges states as the checker does.
//!
//! **Woken code is a step of its own.** User code that runs once a
//! step of another thread lets a blocked call return is not run inside
//! that step: the thread becomes enabled, and its return is a transition
//! the search decides like any other, after the step that enabled it.
//! Until 2026-12-05 the simulator ran woken code inside the waking step,
//! in thread order; the search then needed rules of its own for it (the
//! step that applied the call asked again, the code's root, uses marked
//! as raced for pruned states, sleepers woken by blocked steps, a
//! fallback where two woken threads' code conflicted), and reviews and
//! random programs found eleven orders it missed, all around those rules
//! (`backend-sim/tests/dpor_review.rs` keeps each as a test). The
//! simulator's own order was also too narrow: two threads that one step
//! woke ran their code in thread order only, in every search.
//!
//! The tests check it against the search without reduction and against
//! the schedule checker (`backend-sim/tests/sim.rs`, `tests/properties.rs`),
//! and on random rank code (`backend-sim/tests/dpor_random.rs`); the
//! `simcheck` example runs a schedule file's threads through both
//! searches beside the checker, for one program that disagrees.

use std::collections::HashMap;
use std::sync::Arc;

use duplex::machine::{Mode, Object, Rank, ThreadId};
use smallvec::SmallVec;

use crate::explore::Choice;

/// What a step uses, besides the machine's objects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Obj {
    /// An object of the machine's rules.
    Machine(Object),
    /// A buffer, by its key (the thread that allocated it and its count
    /// there), which is the same whichever order threads allocate in.
    Buffer(ThreadId, u32),
    /// The rank's numbering of the communicators it creates.
    Comms,
}

/// One use: the thread, its rank, the object, the mode.
type Use = (ThreadId, Rank, Obj, Mode);

/// A summarized use: the chosen thread of its transition, and the use.
type Item = (ThreadId, Use);

/// A parked call: its thread, the thread's rank, what the call uses.
pub(crate) type Pending = (ThreadId, Rank, SmallVec<[(Obj, Mode); 6]>);

/// A use recorded in an execution.
#[derive(Clone, Copy, Debug)]
struct Entry {
    /// The transition.
    at: u32,
    thread: ThreadId,
    mode: Mode,
}

/// The uses of one object in this execution.
#[derive(Debug, Default)]
struct History {
    /// The last [`Mode::Write`]: every earlier use happens before it.
    write: Option<Entry>,
    /// Since it: the last use of each thread in each shared mode.
    shared: SmallVec<[Entry; 4]>,
}

impl History {
    /// The uses since the last write (and it) by another thread than `t`
    /// in a mode that conflicts with `mode`.
    fn others(&self, t: ThreadId, mode: Mode) -> impl Iterator<Item = &Entry> {
        self.shared
            .iter()
            .chain(self.write.iter())
            .filter(move |e| e.thread != t && mode.conflicts(e.mode))
    }
}

#[derive(Debug)]
struct Transition {
    /// The thread chosen (`None`: the threads' start, before any call).
    chosen: Option<ThreadId>,
    /// The decision it was chosen at, on the stack (`None`: it was the
    /// only thread that could move).
    frame: Option<usize>,
    /// Per thread: one more than the last transition chosen by that thread
    /// that happens before this one or is it (0: none).
    clock: Vec<u32>,
}

/// The transition under way.
#[derive(Debug, Default)]
struct Open {
    chosen: Option<ThreadId>,
    frame: Option<usize>,
    /// Threads that ran in it: the chosen one, and those its code started
    /// (each runs its code up to its first call in the step).
    threads: SmallVec<[ThreadId; 4]>,
    /// Threads started in it, each with the thread whose code spawned it.
    spawned: SmallVec<[(ThreadId, ThreadId); 2]>,
    uses: Vec<Use>,
}

/// A set of summarized uses, by their index in [`Dpor::items`].
#[derive(Clone, Debug, Default)]
struct Bits(Vec<u64>);

impl Bits {
    fn insert(&mut self, i: u32) {
        let (w, b) = ((i / 64) as usize, i % 64);
        if self.0.len() <= w {
            self.0.resize(w + 1, 0);
        }
        self.0[w] |= 1 << b;
    }

    fn union(&mut self, other: &Bits) {
        if self.0.len() < other.0.len() {
            self.0.resize(other.0.len(), 0);
        }
        for (a, b) in self.0.iter_mut().zip(&other.0) {
            *a |= *b;
        }
    }

    fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().enumerate().flat_map(|(w, x)| {
            (0..64u32)
                .filter(move |b| x & (1 << b) != 0)
                .map(move |b| w as u32 * 64 + b)
        })
    }
}

/// Whether two uses conflict: one object of one rank, in conflicting
/// modes (the threads are not compared).
fn conflict(a: &Use, b: &Use) -> bool {
    a.1 == b.1 && a.2 == b.2 && a.3.conflicts(b.3)
}

/// A step as a sleep set keeps it: what it used and which threads ran in
/// it.
#[derive(Debug)]
struct Step {
    uses: Vec<Use>,
    threads: SmallVec<[ThreadId; 4]>,
}

impl Step {
    /// Whether this step and one that used `uses`, with `threads` running,
    /// commute: no thread ran in both, and no object of one rank used by
    /// both in conflicting modes.
    fn independent(&self, uses: &[Use], threads: &[ThreadId]) -> bool {
        !self.threads.iter().any(|t| threads.contains(t))
            && !self
                .uses
                .iter()
                .any(|a| uses.iter().any(|b| conflict(a, b)))
    }
}

/// A sleeping thread and the step it took where it fell asleep.
type Sleeper = (ThreadId, Arc<Step>);

/// Whether thread `t` is among the `sleepers`.
fn asleep_in(sleepers: &[Sleeper], t: ThreadId) -> bool {
    sleepers.iter().any(|(q, _)| *q == t)
}

/// What a fully explored state keeps.
#[derive(Clone, Debug)]
struct Explored {
    /// Every use made after it.
    summary: Arc<Bits>,
    /// The threads asleep there, each time it was explored: those its
    /// explorations did not take (sorted).
    asleep: Vec<ThreadId>,
}

#[derive(Debug)]
struct Frame {
    /// The state's, where the search takes it (none at a forced thread).
    fingerprint: Option<u128>,
    /// The threads asleep when the search reached it.
    sleep: Vec<Sleeper>,
    /// The step each thread took here, as it was taken.
    steps: Vec<Sleeper>,
    /// What an earlier exploration of the same state, with other threads
    /// asleep, left ([`Explored`]).
    prior: Option<Explored>,
    /// The threads that could move.
    enabled: Vec<ThreadId>,
    /// The thread this execution takes.
    chosen: ThreadId,
    /// Threads taken here so far (the chosen one included).
    done: Vec<ThreadId>,
    /// Threads races asked for, not taken yet.
    todo: Vec<ThreadId>,
    /// Every use made after this decision, in every execution through it.
    summary: Bits,
}

impl Frame {
    fn ask(&mut self, t: ThreadId) {
        if !self.done.contains(&t) && !self.todo.contains(&t) && !self.asleep(t) {
            self.todo.push(t);
        }
    }

    fn asleep(&self, t: ThreadId) -> bool {
        asleep_in(&self.sleep, t)
    }

    /// The threads asleep in the branch of the chosen thread: those asleep
    /// here and those taken here before it.
    fn branch_sleep(&self) -> Vec<Sleeper> {
        let mut out = self.sleep.clone();
        for t in &self.done {
            if *t == self.chosen {
                continue;
            }
            if let Some(s) = self.steps.iter().find(|(q, _)| q == t) {
                out.push(s.clone());
            }
        }
        out
    }
}

/// The search ([module docs](self)).
#[derive(Debug, Default)]
pub struct Dpor {
    stack: Vec<Frame>,
    /// The next decision's index on this execution.
    depth: usize,
    /// States decided at, with what their explorations left once every
    /// choice there was explored (`None` while on the stack).
    visited: HashMap<u128, Option<Explored>>,
    /// Interned summarized uses.
    items: Vec<Item>,
    item_ix: HashMap<Item, u32>,
    /// The first replayed decision that found another state than it had
    /// recorded ([`Dpor::diverged`]).
    diverged: Option<usize>,
    // This execution.
    trace: Vec<Transition>,
    open: Option<Open>,
    objects: HashMap<(Rank, Obj), History>,
    /// Per thread: the last transition it ran in.
    last: Vec<Option<u32>>,
    /// Per thread: the clocks of the transitions that enabled it since
    /// (a step of another thread that let its call return or be made),
    /// joined; its next transition happens after them.
    enablers: Vec<Vec<u32>>,
    /// Per thread: whether it could move at the last decision.
    enabled: Vec<bool>,
    /// The deepest decision of this execution so far.
    frame: Option<usize>,
    /// The threads asleep now: each took, at a decision of this execution,
    /// a step that every step since commutes with, and every execution
    /// that continues with it was explored from there.
    asleep: Vec<Sleeper>,
    /// Executions stopped because every thread that could move was
    /// asleep.
    blocked: usize,
}

fn join(into: &mut Vec<u32>, from: &[u32]) {
    if into.len() < from.len() {
        into.resize(from.len(), 0);
    }
    for (a, b) in into.iter_mut().zip(from) {
        *a = (*a).max(*b);
    }
}

fn get(clock: &[u32], t: ThreadId) -> u32 {
    clock.get(t.0 as usize).copied().unwrap_or(0)
}

/// Thread `t`'s entry of a per-thread vector, grown to hold it.
pub(crate) fn slot<T: Clone + Default>(v: &mut Vec<T>, t: ThreadId) -> &mut T {
    let i = t.0 as usize;
    if v.len() <= i {
        v.resize(i + 1, T::default());
    }
    &mut v[i]
}

impl Dpor {
    /// A search that has run nothing yet.
    pub fn new() -> Dpor {
        let mut d = Dpor::default();
        d.restart();
        d
    }

    /// Per-execution state, for the next execution.
    fn restart(&mut self) {
        self.depth = 0;
        self.trace.clear();
        self.open = Some(Open::default());
        self.objects.clear();
        self.last.clear();
        self.enablers.clear();
        self.enabled.clear();
        self.frame = None;
        self.asleep.clear();
    }

    /// The first decision (0-based) at which an execution, replaying the
    /// choices before it, found another state than the one recorded.
    pub fn diverged(&self) -> Option<usize> {
        self.diverged
    }

    /// Distinct states decided at.
    pub fn states(&self) -> usize {
        self.visited.len()
    }

    /// Executions stopped because every thread that could move was
    /// asleep (their futures were explored from an earlier decision).
    pub fn blocked(&self) -> usize {
        self.blocked
    }

    fn is_asleep(&self, t: ThreadId) -> bool {
        asleep_in(&self.asleep, t)
    }

    /// Thread `t` ran in the transition under way.
    pub(crate) fn ran(&mut self, t: ThreadId) {
        if let Some(o) = &mut self.open
            && !o.threads.contains(&t)
        {
            o.threads.push(t);
        }
    }

    /// Thread `child`, spawned by `parent`'s code, starts in the
    /// transition under way: its code happens after its parent's.
    pub(crate) fn spawned(&mut self, child: ThreadId, parent: ThreadId) {
        if let Some(o) = &mut self.open {
            o.spawned.push((child, parent));
        }
    }

    /// Thread `t` of `rank` used `obj` in `mode` in the transition under
    /// way.
    pub(crate) fn uses(&mut self, t: ThreadId, rank: Rank, obj: Obj, mode: Mode) {
        self.ran(t);
        if let Some(o) = &mut self.open {
            let u = (t, rank, obj, mode);
            if !o.uses.contains(&u) {
                o.uses.push(u);
            }
        }
    }

    /// The threads whose calls parked now the search needs
    /// ([`Dpor::decide`]'s `pending`): those that ran in the transition
    /// under way, and those of the ranks it used objects of.
    pub(crate) fn touched(&self) -> (SmallVec<[Rank; 4]>, SmallVec<[ThreadId; 4]>) {
        let mut ranks: SmallVec<[Rank; 4]> = SmallVec::new();
        let Some(o) = &self.open else {
            return (ranks, SmallVec::new());
        };
        for u in &o.uses {
            if !ranks.contains(&u.1) {
                ranks.push(u.1);
            }
        }
        (ranks, o.threads.clone())
    }

    /// The decision between the `enabled` threads (not empty). Ends the
    /// transition under way first; `pending` are the calls parked now of
    /// the threads [`Dpor::touched`] names (a thread, its rank, what its
    /// call uses). `forced` is a thread that is a persistent set alone
    /// for the machine's calls ([`crate::check::closed_rank`]): it is
    /// taken first, without the state's fingerprint, and others only if
    /// a race asks for them (its user code, which the machine does not
    /// know, may race with another thread's call). `fingerprint` is the
    /// state's where there is no forced thread and more than one can move.
    pub(crate) fn decide(
        &mut self,
        enabled: &[ThreadId],
        pending: &[Pending],
        forced: Option<ThreadId>,
        fingerprint: Option<u128>,
    ) -> Choice {
        self.close(enabled, pending);
        if enabled.len() == 1 {
            if self.is_asleep(enabled[0]) {
                self.blocked += 1;
                return Choice::Prune;
            }
            self.open(enabled[0], None);
            return Choice::Take(enabled[0]);
        }
        let d = self.depth;
        self.depth += 1;
        if let Some(frame) = self.stack.get(d) {
            if frame.fingerprint != fingerprint || frame.enabled != enabled {
                self.diverged = Some(d);
                return Choice::Mismatch;
            }
            let t = frame.chosen;
            self.asleep = frame.branch_sleep();
            self.frame = Some(d);
            self.open(t, Some(d));
            return Choice::Take(t);
        }
        // The thread to take: the forced one, or the first awake; none
        // (every thread that could move asleep): every future from here
        // was explored. A forced thread asleep does not stop the
        // execution: it alone needs taking for the machine's calls, but
        // the others' user code may race with them, so the others are
        // decided as anywhere.
        let t = match forced {
            Some(f) if !self.is_asleep(f) => Some(f),
            _ => enabled.iter().copied().find(|t| !self.is_asleep(*t)),
        };
        let Some(t) = t else {
            self.blocked += 1;
            return Choice::Prune;
        };
        let mut prior = None;
        if let Some(fp) = fingerprint {
            match self.visited.get(&fp) {
                // Seen and fully explored with no thread asleep that is
                // awake now (the state graph has no cycles, so a state
                // seen before is not on the stack).
                Some(Some(e)) if e.asleep.iter().all(|t| self.is_asleep(*t)) => {
                    let summary = e.summary.clone();
                    self.pruned(&summary);
                    return Choice::Prune;
                }
                Some(Some(e)) => prior = Some(e.clone()),
                Some(None) => {
                    self.pruned(&Bits::default());
                    return Choice::Prune;
                }
                None => {}
            }
            self.visited.insert(fp, None);
        }
        self.stack.push(Frame {
            fingerprint,
            sleep: self.asleep.clone(),
            steps: Vec::new(),
            prior,
            enabled: enabled.to_vec(),
            chosen: t,
            done: vec![t],
            todo: Vec::new(),
            summary: Bits::default(),
        });
        self.frame = Some(d);
        self.open(t, Some(d));
        Choice::Take(t)
    }

    fn open(&mut self, t: ThreadId, frame: Option<usize>) {
        self.open = Some(Open {
            chosen: Some(t),
            frame,
            threads: SmallVec::from_slice(&[t]),
            spawned: SmallVec::new(),
            uses: Vec::new(),
        });
    }

    /// The execution ended with no thread able to move; `parked` are the
    /// calls still parked, which are checked as if they ran last.
    pub(crate) fn end(&mut self, parked: &[Pending]) {
        self.close(&[], parked);
        for (t, rank, uses) in parked {
            let clock = self.base(*t);
            self.pending_race(*t, *rank, uses, clock);
            for (obj, mode) in uses {
                self.summarize(*t, (*t, *rank, *obj, *mode));
            }
        }
    }

    /// The races of thread `t`'s parked call (of `rank`, using `uses`)
    /// with the transitions so far, `clock` being the thread's: the latest
    /// conflicting one of another thread that does not happen before it.
    fn pending_race(&mut self, t: ThreadId, rank: Rank, uses: &[(Obj, Mode)], mut clock: Vec<u32>) {
        let base = clock.clone();
        let mut race = Vec::new();
        for (obj, mode) in uses {
            self.scan(t, rank, *obj, *mode, &base, &mut clock, &mut race);
        }
        race.sort_unstable();
        race.dedup();
        for i in race {
            self.race(i, t, &clock);
        }
    }

    /// Thread `t`'s last transition.
    fn last(&self, t: ThreadId) -> Option<u32> {
        self.last.get(t.0 as usize).copied().flatten()
    }

    /// What happens before thread `t`'s next transition: its last one,
    /// and the transitions that enabled it since.
    fn base(&self, t: ThreadId) -> Vec<u32> {
        let mut clock = self
            .last(t)
            .map(|l| self.trace[l as usize].clock.clone())
            .unwrap_or_default();
        if let Some(e) = self.enablers.get(t.0 as usize) {
            join(&mut clock, e);
        }
        clock
    }

    /// Transition `at` is thread `t`'s last; its clock holds what enabled
    /// the thread before it.
    fn set_last(&mut self, t: ThreadId, at: u32) {
        *slot(&mut self.last, t) = Some(at);
        if let Some(e) = self.enablers.get_mut(t.0 as usize) {
            e.clear();
        }
    }

    /// Adds a use made after the deepest decision so far to its summary.
    fn summarize(&mut self, chosen: ThreadId, u: Use) {
        let Some(f) = self.frame else { return };
        let ix = self.intern((chosen, u));
        self.stack[f].summary.insert(ix);
    }

    /// The index of a summarized use in [`Dpor::items`].
    fn intern(&mut self, item: Item) -> u32 {
        match self.item_ix.get(&item) {
            Some(ix) => *ix,
            None => {
                let ix = self.items.len() as u32;
                self.items.push(item);
                self.item_ix.insert(item, ix);
                ix
            }
        }
    }

    /// The uses of `obj` that conflict with `mode` by another thread than
    /// `t`, latest first, back to the last write: joins their clocks into
    /// `clock`, and makes the latest one that does not happen before
    /// `base` the race, if later than `race`.
    #[allow(clippy::too_many_arguments)]
    fn scan(
        &self,
        t: ThreadId,
        rank: Rank,
        obj: Obj,
        mode: Mode,
        base: &[u32],
        clock: &mut Vec<u32>,
        race: &mut Vec<u32>,
    ) {
        let Some(h) = self.objects.get(&(rank, obj)) else {
            return;
        };
        for e in h.others(t, mode) {
            let earlier = &self.trace[e.at as usize];
            join(clock, &earlier.clock);
            let Some(c) = earlier.chosen else { continue };
            if get(base, c) > e.at {
                continue; // happens before
            }
            race.push(e.at);
        }
    }

    /// Ends the transition under way; `enabled` are the threads that can
    /// move after it, `pending` the parked calls of [`Dpor::touched`]'s
    /// threads.
    ///
    /// Besides the transition's own races, it checks the parked calls, as
    /// Flanagan and Godefroid check each thread's next step in every
    /// state: a thread that ran in it and parked a call has that call
    /// checked against every earlier transition (its clock is the
    /// transition's); a thread parked before, that could move before it,
    /// races with it if the transition used what its call uses (the
    /// transition may have disabled the call: a launch that starts a
    /// connection handshake holds up the rank's other launches on its
    /// communicator, and the call's own check, when it runs, finds the
    /// transition ordered before it by the handshake's end).
    fn close(&mut self, enabled: &[ThreadId], pending: &[Pending]) {
        let Some(open) = self.open.take() else { return };
        let j = self.trace.len() as u32;
        let Some(c) = open.chosen else {
            // The threads' start: one event, before every other.
            let mut clock = Vec::new();
            let mut race = Vec::new();
            for &(t, rank, obj, mode) in &open.uses {
                let base = self.base(t);
                self.scan(t, rank, obj, mode, &base, &mut clock, &mut race);
            }
            self.push_event(None, open.frame, clock, &open.uses);
            for t in &open.threads {
                self.set_last(*t, j);
            }
            self.after(j, &open, enabled, pending);
            return;
        };
        // The events of the transition: the chosen thread's (its call and
        // the code after it), then one for each thread its code started
        // (its code up to its first call), after its spawner's.
        let own = self.base(c);
        let mine: Vec<Use> = open.uses.iter().filter(|u| u.0 == c).copied().collect();
        self.event(c, own, open.frame, &mine);
        let mut done: SmallVec<[(ThreadId, u32); 4]> = SmallVec::new();
        done.push((c, j));
        let mut left: SmallVec<[ThreadId; 4]> =
            open.threads.iter().copied().filter(|t| *t != c).collect();
        while !left.is_empty() {
            let parent_of = |w: ThreadId| {
                open.spawned
                    .iter()
                    .find(|(child, _)| *child == w)
                    .map(|(_, p)| *p)
            };
            let ready = left
                .iter()
                .position(|w| {
                    parent_of(*w).is_none_or(|p| {
                        done.iter().any(|(t, _)| *t == p) || !open.threads.contains(&p)
                    })
                })
                .unwrap_or(0);
            let w = left.remove(ready);
            let spawner = parent_of(w).and_then(|p| done.iter().find(|(t, _)| *t == p).copied());
            let mut base = self.trace[spawner.map_or(j, |(_, e)| e) as usize]
                .clock
                .clone();
            join(&mut base, &self.base(w));
            let theirs: Vec<Use> = open.uses.iter().filter(|u| u.0 == w).copied().collect();
            let k = self.event(w, base, open.frame, &theirs);
            done.push((w, k));
        }
        for &u in &open.uses {
            self.summarize(c, u);
        }
        self.after(j, &open, enabled, pending);
        // Sleep sets: a thread stays asleep while the steps taken commute
        // with the step it took where it fell asleep; the step taken at a
        // decision is kept there for the branches after it.
        if !self.asleep.is_empty() {
            self.asleep
                .retain(|(_, s)| s.independent(&open.uses, &open.threads));
        }
        if let Some(f) = open.frame
            && !self.stack[f].steps.iter().any(|(t, _)| *t == c)
        {
            let step = Step {
                uses: open.uses,
                threads: open.threads,
            };
            self.stack[f].steps.push((c, Arc::new(step)));
        }
    }

    /// Records thread `t`'s event of the transition under way, which used
    /// `uses` and happens after `base`: asks for its races with earlier
    /// events, and makes it `t`'s last. Returns its index.
    fn event(&mut self, t: ThreadId, base: Vec<u32>, frame: Option<usize>, uses: &[Use]) -> u32 {
        let k = self.trace.len() as u32;
        let mut clock = base.clone();
        let mut race = Vec::new();
        for &(u, rank, obj, mode) in uses {
            self.scan(u, rank, obj, mode, &base, &mut clock, &mut race);
        }
        race.sort_unstable();
        race.dedup();
        for i in race {
            self.race(i, t, &base);
        }
        *slot(&mut clock, t) = k + 1;
        self.push_event(Some(t), frame, clock, uses);
        self.set_last(t, k);
        k
    }

    /// Records an event: its transition and its uses.
    fn push_event(
        &mut self,
        chosen: Option<ThreadId>,
        frame: Option<usize>,
        clock: Vec<u32>,
        uses: &[Use],
    ) {
        let at = self.trace.len() as u32;
        self.trace.push(Transition {
            chosen,
            frame,
            clock,
        });
        for &(t, rank, obj, mode) in uses {
            let e = Entry {
                at,
                thread: t,
                mode,
            };
            let h = self.objects.entry((rank, obj)).or_default();
            if mode == Mode::Write {
                h.write = Some(e);
                h.shared.clear();
            } else if let Some(s) = h
                .shared
                .iter_mut()
                .find(|s| s.thread == t && s.mode == mode)
            {
                *s = e;
            } else {
                h.shared.push(e);
            }
        }
    }

    /// What follows a transition whose first event is `j`: the parked
    /// calls' checks ([`Dpor::close`]) and the threads it enabled.
    fn after(&mut self, j: u32, open: &Open, enabled: &[ThreadId], pending: &[Pending]) {
        for (t, rank, uses) in pending {
            if open.threads.contains(t) {
                let clock = self.base(*t);
                self.pending_race(*t, *rank, uses, clock);
                // Summarized as a use after this state: a state pruned
                // later must pass it on (its next step's races with the
                // prefix).
                for (obj, mode) in uses {
                    self.summarize(*t, (*t, *rank, *obj, *mode));
                }
            } else if self.enabled.get(t.0 as usize).copied().unwrap_or(false) {
                // The latest event of the transition that used what the
                // parked call uses.
                let hit = open
                    .uses
                    .iter()
                    .filter(|(u, r, obj, mode)| {
                        u != t
                            && r == rank
                            && uses.iter().any(|(o, m)| o == obj && m.conflicts(*mode))
                    })
                    .filter_map(|(u, ..)| self.last(*u))
                    .max();
                if let Some(i) = hit {
                    let clock = self.trace[i as usize].clock.clone();
                    self.race(i, *t, &clock);
                }
            }
        }
        let was = std::mem::take(&mut self.enabled);
        for t in enabled {
            // Enabled by the step (threads that ran have their own event):
            // its next transition happens after this one.
            if !was.get(t.0 as usize).copied().unwrap_or(false) && !open.threads.contains(t) {
                let clock = self.trace[j as usize].clock.clone();
                join(slot(&mut self.enablers, *t), &clock);
            }
        }
        let mut now = was;
        now.iter_mut().for_each(|x| *x = false);
        for t in enabled {
            let i = t.0 as usize;
            if now.len() <= i {
                now.resize(i + 1, false);
            }
            now[i] = true;
        }
        self.enabled = now;
    }

    /// Transition `i` races with a later one of thread `t`, whose clock is
    /// `clock`: ask the decision before `i` for `t`, or for the threads
    /// that lead to it, or for every thread that could move there.
    fn race(&mut self, i: u32, t: ThreadId, clock: &[u32]) {
        let Some(f) = self.trace[i as usize].frame else {
            return; // the only thread that could move there moved
        };
        let frame = &mut self.stack[f];
        if frame.enabled.contains(&t) {
            frame.ask(t);
            return;
        }
        // The threads chosen after `i` in a transition that happens
        // before the racing one: the first step of one of them (one whose
        // steps in between nothing else there precedes) must move before
        // `i` for the racing one to. Asking only the first of them lost
        // the race where that one was asleep or not the start of the
        // chain (found by review:
        // `a_sleeper_whose_await_blocked_hides_an_order`).
        let leads: SmallVec<[ThreadId; 4]> = frame
            .enabled
            .iter()
            .copied()
            .filter(|q| get(clock, *q) > i + 1)
            .collect();
        if !leads.is_empty() {
            for q in leads {
                frame.ask(q);
            }
            return;
        }
        for q in frame.enabled.clone() {
            frame.ask(q);
        }
    }

    /// The execution reached a state explored before, whose summary is
    /// `summary`: every use made after that state is checked against the
    /// prefix with no clock of its own (what happens before it after the
    /// state is not known here), so each conflicting use of another thread
    /// that may be the race Flanagan and Godefroid's rule picks is one.
    fn pruned(&mut self, summary: &Bits) {
        let mut asks: Vec<(usize, ThreadId)> = Vec::new();
        for ix in summary.iter() {
            let (chosen, (t, rank, obj, mode)) = self.items[ix as usize];
            let Some(h) = self.objects.get(&(rank, obj)) else {
                continue;
            };
            let base = self.base(t);
            // The uses it conflicts with that no other such use comes
            // after in the happens-before order: the one that Flanagan and
            // Godefroid's rule picks (the latest that does not happen
            // before it) is among them, whatever the unknown order between
            // the prefix and the use (a use that happens before a later
            // conflicting one is either before the use too, or not the
            // latest). Every use before the last write happens before it.
            let candidates: SmallVec<[Entry; 8]> = h.others(t, mode).copied().collect();
            for e in &candidates {
                let earlier = &self.trace[e.at as usize];
                let (Some(c), Some(f)) = (earlier.chosen, earlier.frame) else {
                    continue;
                };
                if get(&base, c) > e.at {
                    continue; // before the thread's state here
                }
                let covered = candidates
                    .iter()
                    .any(|x| x.at > e.at && get(&self.trace[x.at as usize].clock, c) > e.at);
                if !covered {
                    asks.push((f, chosen));
                }
            }
        }
        asks.sort_unstable();
        asks.dedup();
        for (f, t) in asks {
            let frame = &mut self.stack[f];
            if frame.enabled.contains(&t) {
                frame.ask(t);
            } else {
                for q in frame.enabled.clone() {
                    frame.ask(q);
                }
            }
        }
        if let Some(f) = self.frame {
            self.stack[f].summary.union(summary);
        }
    }

    /// Moves to the next execution: the deepest decision with a thread
    /// still to take takes it. Returns its depth, or `None` when every
    /// choice has been explored.
    pub fn backtrack(&mut self) -> Option<usize> {
        self.restart();
        while let Some(top) = self.stack.last_mut() {
            if !top.todo.is_empty() {
                let t = top.todo.remove(0);
                top.done.push(t);
                top.chosen = t;
                return Some(self.stack.len() - 1);
            }
            let Some(mut frame) = self.stack.pop() else {
                break;
            };
            let mut asleep: Vec<ThreadId> = frame.sleep.iter().map(|(t, _)| *t).collect();
            asleep.sort_unstable();
            asleep.dedup();
            if let Some(prior) = &frame.prior {
                // Explored twice: what either left unexplored.
                frame.summary.union(&prior.summary);
                asleep.retain(|t| prior.asleep.contains(t));
            }
            let summary = Arc::new(frame.summary);
            if let Some(parent) = self.stack.last_mut() {
                parent.summary.union(&summary);
            }
            if let Some(fp) = frame.fingerprint {
                self.visited.insert(fp, Some(Explored { summary, asleep }));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use duplex::machine::CommId;

    const A: ThreadId = ThreadId(0);
    const B: ThreadId = ThreadId(1);
    const C: ThreadId = ThreadId(2);

    fn buffer(n: u32) -> Obj {
        Obj::Buffer(A, n)
    }

    /// One execution of two threads of `rank_b`'s and rank 0: A moves
    /// first (its user code uses `a`), then B (its call uses `b`).
    fn two_steps(d: &mut Dpor, a: (Obj, Mode), b: (Rank, Obj, Mode)) -> Choice {
        let first = d.decide(&[A, B], &[], None, Some(1));
        if first == Choice::Take(A) {
            d.uses(A, 0, a.0, a.1);
            assert_eq!(d.decide(&[B], &[], None, None), Choice::Take(B));
            d.uses(B, b.0, b.1, b.2);
        } else {
            d.uses(B, b.0, b.1, b.2);
            assert_eq!(d.decide(&[A], &[], None, None), Choice::Take(A));
            d.uses(A, 0, a.0, a.1);
        }
        d.end(&[]);
        first
    }

    #[test]
    fn a_read_by_one_thread_and_a_later_write_by_another_are_tried_both_ways() {
        let mut d = Dpor::new();
        let read = (buffer(0), Mode::HostRead);
        let write = (0, buffer(0), Mode::Write);
        assert_eq!(two_steps(&mut d, read, write), Choice::Take(A));
        assert_eq!(d.backtrack(), Some(0));
        assert_eq!(two_steps(&mut d, read, write), Choice::Take(B));
        assert_eq!(d.backtrack(), None);
    }

    #[test]
    fn steps_that_share_nothing_or_are_of_two_ranks_are_tried_one_way() {
        for (a, b) in [
            ((buffer(0), Mode::HostRead), (0, buffer(1), Mode::Write)),
            ((buffer(0), Mode::HostRead), (0, buffer(0), Mode::HostRead)),
            ((buffer(0), Mode::Write), (1, buffer(0), Mode::Write)),
            (
                (Obj::Machine(Object::Streams), Mode::Issue),
                (0, Obj::Machine(Object::Streams), Mode::Issue),
            ),
        ] {
            let mut d = Dpor::new();
            two_steps(&mut d, a, b);
            assert_eq!(d.backtrack(), None, "{a:?} {b:?}");
        }
    }

    /// A's launch starts a handshake on a communicator and holds up B's
    /// launch on it (B cannot move until A's call returns): B's parked
    /// call, which B could make before A's, races with it.
    #[test]
    fn a_step_that_disables_a_parked_call_races_with_it() {
        let comm = Obj::Machine(Object::Comm(CommId(0)));
        let mut d = Dpor::new();
        assert_eq!(d.decide(&[A, B], &[], None, Some(1)), Choice::Take(A));
        d.uses(A, 0, comm, Mode::Write);
        let parked: Pending = (B, 0, SmallVec::from_slice(&[(comm, Mode::Write)]));
        // A waits in its handshake, then returns; B waited meanwhile.
        assert_eq!(
            d.decide(&[A], std::slice::from_ref(&parked), None, None),
            Choice::Take(A)
        );
        d.end(&[]);
        assert_eq!(d.backtrack(), Some(0));
        assert_eq!(d.decide(&[A, B], &[], None, Some(1)), Choice::Take(B));
    }

    /// A state reached again is pruned; what its explored future used is
    /// checked against the new prefix: C's write after the state races
    /// with B's read before it on the second path, which the first path
    /// did not have.
    #[test]
    fn a_pruned_state_passes_on_what_followed_it() {
        let (x, y) = (buffer(0), buffer(1));
        let mut d = Dpor::new();
        // A writes y; B writes y (a race: B is asked first at decision 0);
        // the state after is 9; C writes x.
        assert_eq!(d.decide(&[A, B, C], &[], None, Some(1)), Choice::Take(A));
        d.uses(A, 0, y, Mode::Write);
        assert_eq!(d.decide(&[B, C], &[], None, Some(9)), Choice::Take(B));
        d.uses(B, 0, y, Mode::Write);
        assert_eq!(d.decide(&[C], &[], None, None), Choice::Take(C));
        d.uses(C, 0, x, Mode::Write);
        d.end(&[]);
        assert_eq!(d.backtrack(), Some(0));
        // B first, reading x; then state 9 again.
        assert_eq!(d.decide(&[A, B, C], &[], None, Some(1)), Choice::Take(B));
        d.uses(B, 0, x, Mode::HostRead);
        assert_eq!(d.decide(&[A, C], &[], None, Some(9)), Choice::Prune);
        d.end(&[]);
        assert_eq!(d.backtrack(), Some(0));
        assert_eq!(d.decide(&[A, B, C], &[], None, Some(1)), Choice::Take(C));
    }

    /// Runs one execution of threads that each take one step, with the
    /// uses given, at decisions without fingerprints (no state caching):
    /// the order taken, or `None` if the search stopped it.
    fn one_step_each(d: &mut Dpor, steps: &[(ThreadId, &[(Obj, Mode)])]) -> Option<Vec<ThreadId>> {
        let mut left: Vec<ThreadId> = steps.iter().map(|s| s.0).collect();
        let mut order = Vec::new();
        while !left.is_empty() {
            match d.decide(&left, &[], None, None) {
                Choice::Take(t) => {
                    let (_, uses) = steps
                        .iter()
                        .find(|s| s.0 == t)
                        .expect("a thread of the test");
                    for (o, m) in uses.iter() {
                        d.uses(t, 0, *o, *m);
                    }
                    left.retain(|x| *x != t);
                    order.push(t);
                }
                Choice::Prune => return None,
                Choice::Mismatch => panic!("the test's threads do the same every time"),
            }
        }
        d.end(&[]);
        Some(order)
    }

    /// A writes x, B writes y, C writes both: four traces (A and C in
    /// either order, B and C in either order). Without sleep sets the
    /// search also ran B before A with C last, the trace of A, B, C it
    /// had run first (a fifth execution); asleep, A is not taken after B
    /// until C's step, which it depends on, wakes it.
    #[test]
    fn a_thread_asleep_is_not_taken_again_where_nothing_it_depends_on_ran() {
        let (x, y) = (buffer(0), buffer(1));
        let w = Mode::Write;
        let steps: [(ThreadId, &[(Obj, Mode)]); 3] =
            [(A, &[(x, w)]), (B, &[(y, w)]), (C, &[(x, w), (y, w)])];
        let mut d = Dpor::new();
        let mut runs = Vec::new();
        loop {
            runs.push(one_step_each(&mut d, &steps));
            if d.backtrack().is_none() {
                break;
            }
        }
        let orders: Vec<Vec<ThreadId>> = runs.iter().flatten().cloned().collect();
        let pos = |o: &Vec<ThreadId>, t| o.iter().position(|x| *x == t);
        let mut traces: Vec<(bool, bool)> = orders
            .iter()
            .map(|o| (pos(o, A) < pos(o, C), pos(o, B) < pos(o, C)))
            .collect();
        traces.sort_unstable();
        traces.dedup();
        assert_eq!(traces.len(), 4, "every trace: {orders:?}");
        assert_eq!(runs.len(), 4, "one execution per trace: {runs:?}");
    }

    /// Replaying a decision that meets another state than it recorded
    /// stops, and says where.
    #[test]
    fn a_replay_that_meets_another_state_is_a_mismatch() {
        let mut d = Dpor::new();
        let read = (buffer(0), Mode::HostRead);
        two_steps(&mut d, read, (0, buffer(0), Mode::Write));
        assert_eq!(d.backtrack(), Some(0));
        assert_eq!(d.decide(&[A, B], &[], None, Some(2)), Choice::Mismatch);
        assert_eq!(d.diverged(), Some(0));
    }
}
