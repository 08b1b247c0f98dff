//! Device progress: runs every rank's streams to a fixpoint after each host
//! step. Nothing here is a choice; the order of the passes only matters for
//! kernel slots (R10), which go to ready launches in issue order.

use super::rules::{Front, free};
use super::{Entry, LaunchRef, Machine, OpRef, OpStatus, StreamId, Wait};

impl Machine {
    /// Applies every device step that can happen, until none can.
    pub(super) fn progress(&mut self) {
        loop {
            let mut changed = self.retire_markers();
            changed |= self.start_launches();
            changed |= self.activate_group_ops();
            changed |= self.move_messages();
            changed |= self.finish_launches();
            if !changed {
                break;
            }
        }
        self.forget_satisfied_waits();
    }

    /// Drops stream targets that have been reached, so that equal futures
    /// have equal states (whether a stream had drained when a `sync` was
    /// called or drained since does not matter once it has).
    fn forget_satisfied_waits(&mut self) {
        let streams = &self.state.streams;
        for th in &mut self.state.threads {
            if let Wait::Streams { targets, .. } = &mut th.wait {
                targets.retain(|(s, n)| streams[s.ix()].base < *n);
                if targets.is_empty() {
                    th.wait = Wait::None;
                }
            }
        }
    }

    /// `record` completes when it reaches the head of its stream (R1);
    /// `wait` completes once the recorded entry has completed (R9).
    fn retire_markers(&mut self) -> bool {
        let mut changed = false;
        for i in 0..self.state.streams.len() {
            loop {
                let done = match self.state.streams[i].queue.front() {
                    Some(Entry::Record | Entry::WaitEvent(..)) => {
                        free(|f| self.marker_blockers(StreamId(i as u32), f))
                    }
                    Some(Entry::Launch(_)) | None => false,
                };
                if !done {
                    break;
                }
                let s = &mut self.state.streams[i];
                s.queue.pop_front();
                s.base += 1;
                changed = true;
            }
        }
        changed
    }

    /// The launches at the head of some stream, in `LaunchRef` order. Only
    /// these can start (R1), and every started launch is among them: it
    /// started at the head of all its streams and stays there until it
    /// completes. So a pass costs the number of streams, not of launches.
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
    fn start_launches(&mut self) -> bool {
        if self.setup.model.kernels.is_none() {
            // Without kernel slots, starting one launch never holds back
            // another, so the order does not matter: only stream heads can
            // start.
            let mut changed = false;
            for lref in self.head_launches() {
                let launch = &self.state.launches[&lref];
                if launch.started || !free(|f| self.launch_blockers(lref, f)) {
                    continue;
                }
                let rank = launch.rank as usize;
                self.state.ranks[rank].running += 1;
                if let Some(l) = self.state.launches.get_mut(&lref) {
                    l.started = true;
                }
                changed = true;
            }
            return changed;
        }
        let mut changed = false;
        for r in 0..self.state.ranks.len() {
            let pending = self.state.ranks[r].pending.clone();
            for lref in pending {
                if self.state.launches[&lref].started || !free(|f| self.launch_blockers(lref, f)) {
                    continue;
                }
                self.state.ranks[r].running += 1;
                let launch = self
                    .state
                    .launches
                    .get_mut(&lref)
                    .expect("pending launch is live");
                launch.started = true;
                changed = true;
            }
        }
        changed
    }

    /// In a started launch, an op becomes active once nothing of its own
    /// launch holds it back ([`Machine::behind_in_group`], R8).
    fn activate_group_ops(&mut self) -> bool {
        let mut changed = false;
        let started: Vec<LaunchRef> = self
            .head_launches()
            .into_iter()
            .filter(|r| {
                let l = &self.state.launches[r];
                l.started && l.ops.iter().any(|o| o.status == OpStatus::Waiting)
            })
            .collect();
        for lref in started {
            for i in 0..self.state.launches[&lref].ops.len() {
                if self.state.launches[&lref].ops[i].status == OpStatus::Waiting
                    && !self.behind_in_group(lref, i)
                {
                    self.set_status(
                        OpRef {
                            launch: lref,
                            index: i as u16,
                        },
                        OpStatus::Active,
                    );
                    changed = true;
                }
            }
        }
        changed
    }

    /// Moves messages through channels: the front pair completes once both
    /// sides have started (R3, R4), and sends complete into a connected
    /// channel's buffer while it has room (R5, R6).
    fn move_messages(&mut self) -> bool {
        let mut changed = false;
        let eager = self.setup.model.eager.bytes();
        let keys: Vec<_> = self.state.channels.keys().copied().collect();
        for key in keys {
            let warm = self.setup.comms[key.0.ix()].warm;
            while let Some(Front::Ready(send, recv)) = self.front(key) {
                self.set_status(recv.op, OpStatus::Done);
                if !send.buffered {
                    self.set_status(send.op, OpStatus::Done);
                }
                if let Some(d) = self.deliveries.as_mut() {
                    d.push(super::Delivery::Delivered {
                        send: send.op,
                        recv: recv.op,
                    });
                }
                let ch = self.state.channels.get_mut(&key).expect("channel exists");
                ch.sends.pop_front();
                ch.recvs.pop_front();
                ch.delivered += 1;
                changed = true;
            }
            if eager == 0 {
                continue;
            }
            let ch = &self.state.channels[&key];
            if !(warm || ch.delivered > 0) {
                continue; // R6: the first message of a cold channel is a rendezvous
            }
            let mut inflight: u64 = 0;
            let mut buffer = Vec::new();
            for (i, slot) in ch.sends.iter().enumerate() {
                if slot.buffered {
                    inflight += slot.bytes;
                    continue;
                }
                if self.state.launches[&slot.op.launch].ops[slot.op.index as usize].status
                    == OpStatus::Active
                    && inflight.saturating_add(slot.bytes) <= eager
                {
                    inflight += slot.bytes;
                    buffer.push((i, slot.op));
                    continue;
                }
                break; // sends leave in FIFO order
            }
            for (i, op) in buffer {
                self.set_status(op, OpStatus::Done);
                if let Some(d) = self.deliveries.as_mut() {
                    d.push(super::Delivery::Buffered { send: op });
                }
                let ch = self.state.channels.get_mut(&key).expect("channel exists");
                ch.sends[i].buffered = true;
                changed = true;
            }
        }
        self.state.channels.retain(|_, ch| {
            // An empty channel is kept only for what it remembers: having
            // delivered a message (R6) matters only when it is cold.
            !(ch.sends.is_empty() && ch.recvs.is_empty() && ch.delivered == 0)
        });
        changed
    }

    fn set_status(&mut self, op: OpRef, status: OpStatus) {
        if let Some(l) = self.state.launches.get_mut(&op.launch) {
            l.ops[op.index as usize].status = status;
        }
    }

    /// A launch completes when all its ops have; it frees its streams and its
    /// kernel slot.
    fn finish_launches(&mut self) -> bool {
        let done: Vec<LaunchRef> = self
            .head_launches()
            .into_iter()
            .filter(|r| {
                let l = &self.state.launches[r];
                l.started && l.ops.iter().all(|o| o.status == OpStatus::Done)
            })
            .collect();
        for lref in &done {
            let Some(launch) = self.state.launches.remove(lref) else {
                continue;
            };
            let rank = &mut self.state.ranks[launch.rank as usize];
            // Launches mostly complete in issue order: the one to drop is
            // usually at the front.
            if let Some(pos) = rank.pending.iter().position(|p| p == lref) {
                rank.pending.remove(pos);
            }
            rank.running -= 1;
            for s in launch.streams {
                let stream = &mut self.state.streams[s.ix()];
                debug_assert_eq!(stream.queue.front(), Some(&Entry::Launch(*lref)));
                stream.queue.pop_front();
                stream.base += 1;
            }
        }
        !done.is_empty()
    }
}
