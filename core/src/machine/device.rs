//! Device progress: runs every rank's streams to a fixpoint after each host
//! step. Nothing here is a choice.
//!
//! Progress is event-driven: a host step names what it touched (the streams
//! it appended to, through [`Work`]), and each device step names what it
//! may have unblocked: a stream whose head completed is looked at again,
//! with the streams of its rank parked behind a rank-wide rule (R2, R9);
//! an op that became active or completed has its channel looked at again;
//! a launch whose ops all completed has its streams looked at again. So a
//! step costs what it changes, not the number of streams, channels or
//! launches.
//!
//! Without kernel slots every device step is monotone (what can start,
//! match or complete stays so until it does), so the fixpoint does not
//! depend on the order the work is taken in, and equal states have equal
//! successors. Kernel slots (R10) go to ready launches in issue order,
//! which a worklist cannot promise; with `kernels=` set, progress sweeps
//! every rank in issue order instead ([`Machine::progress_sweep`]).

use smallvec::SmallVec;

use super::rules::{Front, free};
use super::{
    ChannelKey, CommId, Entry, LaunchRef, Machine, OpRef, OpStatus, Rank, StreamId, Wait,
    channel_key, launch_channel,
};
use crate::Dir;

/// What device progress still has to look at (empty between steps), the
/// streams parked behind a rank-wide rule, and the ranks touched since
/// [`Machine::take_touched`].
#[derive(Clone, Debug, Default)]
pub(super) struct Work {
    /// Streams whose head may be able to move.
    streams: Vec<StreamId>,
    /// Channels whose front may be able to move.
    channels: Vec<ChannelKey>,
    /// Per rank: streams whose head was held back when last looked at; a
    /// completion on the rank looks at them again (R2, R9).
    parked: Vec<Vec<StreamId>>,
    /// Per stream: whether it is in its rank's `parked`.
    is_parked: Vec<bool>,
    /// Ranks one of whose streams completed an entry during this progress
    /// (their threads' waits are looked at again).
    advanced: Vec<Rank>,
    /// Per rank: whether it is in `advanced`.
    is_advanced: Vec<bool>,
    /// Ranks whose threads may have become able or unable to step since
    /// the last [`Machine::take_touched`].
    touched: Vec<Rank>,
    /// Per rank: whether it is in `touched`.
    is_touched: Vec<bool>,
}

impl Work {
    /// Makes room for `ranks` ranks and `streams` streams.
    pub(super) fn fit(&mut self, ranks: usize, streams: usize) {
        self.parked.resize(ranks, Vec::new());
        self.is_advanced.resize(ranks, false);
        self.is_touched.resize(ranks, false);
        self.is_parked.resize(streams, false);
    }
}

impl Machine {
    /// Notes that stream `s` has something new that may move.
    pub(super) fn stream_changed(&mut self, s: StreamId) {
        self.work.streams.push(s);
    }

    /// Notes that rank `r`'s threads may have become able or unable to step.
    pub(super) fn touch(&mut self, r: Rank) {
        let i = r as usize;
        if i < self.work.is_touched.len() && !self.work.is_touched[i] {
            self.work.is_touched[i] = true;
            self.work.touched.push(r);
        }
    }

    /// Puts in `out` (after clearing it) the ranks whose threads may have
    /// become able or unable to step (by [`Machine::next`] and
    /// [`Machine::enabled`]) since the last call: the rank of each thread
    /// that stepped, the ranks whose streams completed entries, the peers
    /// of handshake rounds and the receivers of `notify`. A driver that
    /// keeps the set of runnable threads looks at the threads of these
    /// ranks only.
    pub fn take_touched(&mut self, out: &mut Vec<Rank>) {
        out.clear();
        std::mem::swap(out, &mut self.work.touched);
        for r in out.iter() {
            self.work.is_touched[*r as usize] = false;
        }
    }

    /// Applies every device step that can happen, until none can.
    pub(super) fn progress(&mut self) {
        if self.setup.model.kernels.is_some() {
            self.work.streams.clear();
            self.work.channels.clear();
            self.progress_sweep();
            return;
        }
        loop {
            if let Some(s) = self.work.streams.pop() {
                self.settle_stream(s);
            } else if let Some(key) = self.work.channels.pop() {
                self.settle_channel(key);
            } else {
                break;
            }
        }
        let advanced = std::mem::take(&mut self.work.advanced);
        for r in &advanced {
            self.work.is_advanced[*r as usize] = false;
            self.forget_satisfied_waits(*r);
            self.touch(*r);
        }
        self.work.advanced = advanced;
        self.work.advanced.clear();
        #[cfg(debug_assertions)]
        self.check_fixpoint();
    }

    /// In debug builds, on small machines: the sweep finds nothing left to
    /// do after event-driven progress (a missed wake-up would be a wrong
    /// verdict).
    #[cfg(debug_assertions)]
    fn check_fixpoint(&self) {
        if self.state.streams.len() + self.state.channels.len() > 64 {
            return;
        }
        let mut swept = self.clone();
        swept.deliveries = None;
        swept.changed = None;
        swept.progress_sweep();
        debug_assert!(
            swept.state == self.state,
            "event-driven device progress stopped short of the fixpoint"
        );
    }

    /// Notes that an entry of stream `s` of `rank` completed.
    fn advance(&mut self, s: StreamId, rank: Rank) {
        let stream = &mut self.state.streams[s.ix()];
        stream.queue.pop_front();
        stream.base += 1;
        let r = rank as usize;
        if !self.work.is_advanced[r] {
            self.work.is_advanced[r] = true;
            self.work.advanced.push(rank);
        }
        for p in std::mem::take(&mut self.work.parked[r]) {
            self.work.is_parked[p.ix()] = false;
            self.work.streams.push(p);
        }
    }

    fn park(&mut self, s: StreamId, rank: Rank) {
        if !self.work.is_parked[s.ix()] {
            self.work.is_parked[s.ix()] = true;
            self.work.parked[rank as usize].push(s);
        }
    }

    /// Moves the head of stream `s` as far as it goes: markers retire (R1,
    /// R9), the head launch starts (R1, R2) and, once all its ops have
    /// completed, finishes.
    fn settle_stream(&mut self, s: StreamId) {
        let rank = self.setup.streams[s.ix()].rank;
        loop {
            match self.state.streams[s.ix()].queue.front().copied() {
                None => return,
                Some(Entry::Record | Entry::WaitEvent(..)) => {
                    if !free(|f| self.marker_blockers(s, f)) {
                        self.park(s, rank);
                        return;
                    }
                    self.advance(s, rank);
                }
                Some(Entry::Launch(lref)) => {
                    if !self.state.launches[&lref].started {
                        if !free(|f| self.launch_blockers(lref, f)) {
                            self.park(s, rank);
                            return;
                        }
                        self.start(lref);
                    }
                    if self.state.launches[&lref].left > 0 {
                        return;
                    }
                    self.finish(lref);
                }
            }
        }
    }

    /// Starts a launch: it takes a kernel slot, and its ops that nothing of
    /// their own launch holds back become active.
    fn start(&mut self, lref: LaunchRef) {
        let launch = self
            .state
            .launches
            .get_mut(&lref)
            .expect("head launch is live");
        launch.started = true;
        let rank = launch.rank;
        self.launch_changed(lref);
        if !self.is_copy(lref) {
            self.state.ranks[rank as usize].running += 1;
        }
        self.activate(lref);
    }

    /// In a launch that starts, an op becomes active once nothing of its
    /// own launch holds it back ([`Machine::behind_in_group`], R8: the
    /// first op of each channel of the launch); its channel is looked at
    /// again. One pass, remembering the channels seen, so that a group of
    /// n ops costs O(n) and not O(n²).
    fn activate(&mut self, lref: LaunchRef) {
        let n = self.state.launches[&lref].ops.len();
        // A few channels are compared in place; a large group hashes them.
        let mut few: SmallVec<[(CommId, Rank, Dir); 4]> = SmallVec::new();
        let mut many: std::collections::HashSet<(CommId, Rank, Dir)> = Default::default();
        for i in 0..n {
            let op = &self.state.launches[&lref].ops[i];
            let channel = launch_channel(&op.spec);
            let first = if n <= 16 {
                !few.contains(&channel) && {
                    few.push(channel);
                    true
                }
            } else {
                many.insert(channel)
            };
            if op.status != OpStatus::Waiting || !first {
                continue;
            }
            debug_assert!(!self.behind_in_group(lref, i));
            self.activate_op(lref, i);
        }
    }

    fn activate_op(&mut self, lref: LaunchRef, i: usize) {
        let rank = self.state.launches[&lref].rank;
        let key = channel_key(rank, &self.state.launches[&lref].ops[i].spec);
        self.set_status(
            OpRef {
                launch: lref,
                index: i as u16,
            },
            OpStatus::Active,
        );
        self.work.channels.push(key);
    }

    /// An op completed: the next op of its launch on its channel becomes
    /// active (R8: ops of a launch on one channel run in order, so the op
    /// that completed was the first not done there), and a launch whose
    /// ops have all completed is looked at again.
    fn complete_op(&mut self, op: OpRef) {
        self.set_status(op, OpStatus::Done);
        let launch = &self.state.launches[&op.launch];
        if launch.left == 0 {
            let s = launch.streams[0];
            self.work.streams.push(s);
            return;
        }
        let me = launch_channel(&launch.ops[op.index as usize].spec);
        let next = launch.ops[op.index as usize + 1..]
            .iter()
            .position(|o| launch_channel(&o.spec) == me)
            .map(|k| op.index as usize + 1 + k);
        if let Some(i) = next
            && launch.ops[i].status == OpStatus::Waiting
        {
            debug_assert!(!self.behind_in_group(op.launch, i));
            self.activate_op(op.launch, i);
        }
    }

    /// The eager capacity of channel `key` (R5): the model's, and none on
    /// a copy-engine lane, which never buffers.
    pub(super) fn eager_of(&self, key: ChannelKey) -> u64 {
        if self.setup.comms[key.0.ix()].copy {
            0
        } else {
            self.setup.model.eager.bytes()
        }
    }

    /// Whether channel `key` buffers sends now (R5): it has an eager
    /// capacity, and it is connected (warm), or has carried a message, or
    /// counts as warm under `cold-channels=mismatched`. Otherwise its
    /// first message is a rendezvous (R6): a channel with ghosts
    /// (`Machine::settle_from`) has carried one; with
    /// `cold-channels=mismatched`, only a channel set up in a round of
    /// mismatched calls (R7) is cold, where the model's rounds follow
    /// NCCL's (a pair that exchanges one message each way); elsewhere, and
    /// for a rank's messages to itself, R6 stays. The one statement of
    /// the rule, for the device's moves and the hang report's words.
    pub(super) fn buffers(&self, key: ChannelKey) -> bool {
        if self.eager_of(key) == 0 {
            return false;
        }
        if self.setup.comms[key.0.ix()].warm {
            return true;
        }
        let Some(ch) = self.state.channels.get(&key) else {
            return false;
        };
        ch.delivered > 0
            || ch.sends.front().is_some_and(|g| g.ghost)
            || ch.recvs.front().is_some_and(|g| g.ghost)
            || (self.setup.model.cold_mismatched_only && self.warm_by_its_round(key))
    }

    /// Moves messages through channel `key` as far as they go: the front
    /// pair completes once both sides have started (R3, R4), and sends
    /// complete into a connected channel's buffer while it has room (R5,
    /// R6).
    fn settle_channel(&mut self, key: ChannelKey) {
        let eager = self.eager_of(key);
        loop {
            let mut changed = false;
            while let Some(Front::Ready(send, recv)) = self.front(key) {
                let ch = self.state.channels.get_mut(&key).expect("channel exists");
                ch.sends.pop_front();
                ch.recvs.pop_front();
                ch.delivered += 1;
                // A ghost (`Machine::settle_from`) has no op to complete
                // and moves no bytes a driver could take.
                if !recv.ghost {
                    self.complete_op(recv.op);
                }
                if !send.buffered {
                    self.complete_op(send.op);
                }
                if let Some(d) = self.deliveries.as_mut()
                    && !send.ghost
                    && !recv.ghost
                {
                    d.push(super::Delivery::Delivered {
                        send: send.op,
                        recv: recv.op,
                    });
                }
                changed = true;
            }
            let Some(ch) = self.state.channels.get(&key) else {
                return;
            };
            if ch.sends.is_empty() && ch.recvs.is_empty() {
                // A channel is made with a slot in it and a slot leaves only
                // when delivered, so an empty channel remembers a delivery
                // (R6) and stays.
                debug_assert!(ch.delivered > 0);
                return;
            }
            if self.buffers(key) {
                let mut inflight: u64 = 0;
                let mut i = 0;
                // Sends leave in FIFO order: the buffer takes active ones
                // from the front while they fit.
                while let Some(slot) = self.state.channels.get(&key).and_then(|c| c.sends.get(i)) {
                    let slot = *slot;
                    i += 1;
                    if slot.buffered {
                        inflight += slot.bytes;
                        continue;
                    }
                    let active = self.state.launches[&slot.op.launch].ops[slot.op.index as usize]
                        .status
                        == OpStatus::Active;
                    if !active || inflight.saturating_add(slot.bytes) > eager {
                        break;
                    }
                    inflight += slot.bytes;
                    if let Some(ch) = self.state.channels.get_mut(&key) {
                        ch.sends[i - 1].buffered = true;
                    }
                    self.complete_op(slot.op);
                    if let Some(d) = self.deliveries.as_mut() {
                        d.push(super::Delivery::Buffered { send: slot.op });
                    }
                    changed = true;
                }
            }
            if !changed {
                return;
            }
        }
    }

    fn set_status(&mut self, op: OpRef, status: OpStatus) {
        self.launch_changed(op.launch);
        if let Some(l) = self.state.launches.get_mut(&op.launch) {
            let slot = &mut l.ops[op.index as usize].status;
            match (*slot == OpStatus::Done, status == OpStatus::Done) {
                (false, true) => l.left -= 1,
                (true, false) => l.left += 1,
                _ => {}
            }
            *slot = status;
        }
    }

    /// A launch completes when all its ops have; it frees its streams and its
    /// kernel slot.
    fn finish(&mut self, lref: LaunchRef) {
        let Some(launch) = self.state.launches.remove(&lref) else {
            return;
        };
        self.launch_changed(lref);
        let comm = launch.comm();
        let copy = self.setup.comms[comm.ix()].copy;
        let rank = &mut self.state.ranks[launch.rank as usize];
        // Launches on one communicator complete in issue order (R2): the
        // one to drop is at the front (anywhere with `comm-order=off`, or on
        // a copy-engine lane).
        if let Ok(i) = rank.on_comm.binary_search_by_key(&comm, |(c, _)| *c) {
            let q = &mut rank.on_comm[i].1;
            if let Some(pos) = q.iter().position(|p| *p == lref) {
                q.remove(pos);
            }
            if q.is_empty() {
                rank.on_comm.remove(i);
            }
        }
        if let Some(pos) = rank.pending.iter().position(|p| *p == lref) {
            rank.pending.remove(pos);
        }
        if !copy {
            rank.running -= 1;
        }
        for s in launch.streams {
            debug_assert_eq!(
                self.state.streams[s.ix()].queue.front(),
                Some(&Entry::Launch(lref))
            );
            self.advance(s, launch.rank);
            self.work.streams.push(s);
        }
    }

    /// Drops rank `r`'s threads' stream targets that have been reached, so
    /// that equal futures have equal states (whether a stream had drained
    /// when a `sync` was called or drained since does not matter once it
    /// has).
    pub(super) fn forget_satisfied_waits(&mut self, r: Rank) {
        let streams = &self.state.streams;
        for t in self.setup.threads_of(r) {
            let th = &mut self.state.threads[t.ix()];
            if let Wait::Streams { targets, .. } = &mut th.wait {
                targets.retain(|(s, n)| streams[s.ix()].base < *n);
                if targets.is_empty() {
                    th.wait = Wait::None;
                }
            }
        }
    }

    /// Progress by sweeps over every stream, launch and channel until none
    /// moves: the order kernel slots need (R10: ready launches take them in
    /// issue order per rank), and the reference the event-driven progress
    /// is checked against in debug builds.
    pub(super) fn progress_sweep(&mut self) {
        loop {
            // Markers retire to their fixpoint before any slot is handed
            // out: a `wait` on a stream numbered below its `record`'s
            // stream would otherwise retire a pass late, after a launch
            // issued later took the slot its launch is owed (R10).
            let mut changed = false;
            while self.sweep_markers() {
                changed = true;
            }
            changed |= self.sweep_starts();
            let keys: Vec<ChannelKey> = self
                .state
                .channels
                .sorted()
                .into_iter()
                .map(|(k, _)| *k)
                .collect();
            for key in keys {
                self.settle_channel(key);
            }
            let done: Vec<LaunchRef> = self
                .head_launches()
                .into_iter()
                .filter(|r| {
                    let l = &self.state.launches[r];
                    l.started && l.left == 0
                })
                .collect();
            changed |= !done.is_empty();
            for l in done {
                self.finish(l);
            }
            self.work.streams.clear();
            self.work.channels.clear();
            if !changed {
                break;
            }
        }
        for r in 0..self.setup.ranks {
            self.forget_satisfied_waits(r);
            self.touch(r);
        }
        for parked in self.work.parked.iter_mut() {
            for s in parked.drain(..) {
                self.work.is_parked[s.ix()] = false;
            }
        }
        for r in std::mem::take(&mut self.work.advanced) {
            self.work.is_advanced[r as usize] = false;
        }
    }

    /// `record` completes when it reaches the head of its stream (R1);
    /// `wait` completes once the recorded entry has completed (R9).
    fn sweep_markers(&mut self) -> bool {
        let mut changed = false;
        for i in 0..self.state.streams.len() {
            let s = StreamId(i as u32);
            let rank = self.setup.streams[i].rank;
            while matches!(
                self.state.streams[i].queue.front(),
                Some(Entry::Record | Entry::WaitEvent(..))
            ) && free(|f| self.marker_blockers(s, f))
            {
                self.advance(s, rank);
                changed = true;
            }
        }
        changed
    }

    /// The launches at the head of some stream, in `LaunchRef` order. Only
    /// these can start (R1), and every started launch is among them: it
    /// started at the head of all its streams and stays there until it
    /// completes.
    fn head_launches(&self) -> Vec<LaunchRef> {
        let mut heads: Vec<LaunchRef> = self
            .state
            .streams
            .iter()
            .filter_map(|s| match s.queue.front() {
                Some(Entry::Launch(l)) => Some(*l),
                _ => None,
            })
            .collect();
        heads.sort_unstable();
        heads.dedup();
        heads
    }

    /// Starts every launch that nothing holds back
    /// ([`Machine::launch_blockers`]: R1, R2, R10), in issue order per rank.
    fn sweep_starts(&mut self) -> bool {
        let mut changed = false;
        if self.setup.model.kernels.is_none() {
            // Only heads can start, and starting one holds back no other.
            for lref in self.head_launches() {
                if self.state.launches[&lref].started || !free(|f| self.launch_blockers(lref, f)) {
                    continue;
                }
                self.start(lref);
                changed = true;
            }
            return changed;
        }
        for r in 0..self.state.ranks.len() {
            let pending = self.state.ranks[r].pending.clone();
            for lref in pending {
                if self.state.launches[&lref].started || !free(|f| self.launch_blockers(lref, f)) {
                    continue;
                }
                self.start(lref);
                changed = true;
            }
        }
        changed
    }
}
