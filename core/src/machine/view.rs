//! Descriptions of ops for errors and reports: every field a user needs to
//! find the op in their program.

use crate::report::{OpInfo, OpState};
use crate::schedule::Dir;

use super::{ChannelKey, LaunchRef, Machine, OpStatus, Origin, OriginInfo, Setup, Slot};

/// The state of an op of status `status` in a launch that has `started` or
/// not.
fn op_state(status: OpStatus, started: bool) -> OpState {
    match (status, started) {
        (OpStatus::Done, _) => OpState::Done,
        (_, false) => OpState::NotStarted,
        (OpStatus::Waiting, true) => OpState::BehindInGroup,
        (OpStatus::Active, true) => OpState::Started,
    }
}

/// `line 4` or a source location, for a call's origin.
pub fn describe_origin(setup: &Setup, origin: Origin) -> String {
    match setup.origins.get(origin.ix()) {
        Some(o) => o.place(),
        None => format!("call #{}", origin.0),
    }
}

impl Machine {
    /// The view of op `index` of a live launch.
    pub(super) fn op_view(&self, lref: LaunchRef, index: usize) -> OpInfo {
        let launch = &self.state.launches[&lref];
        let op = &launch.ops[index];
        let state = op_state(op.status, launch.started);
        self.view(
            lref,
            op.spec.dir,
            op.spec.peer,
            op.spec.bytes,
            op.spec.dtype,
            op.spec.comm,
            op.spec.stream,
            op.fifo,
            state,
            launch.grouped,
            op.spec.origin.unwrap_or(launch.origin),
        )
    }

    /// How far op `op` of a live launch got ([`OpInfo::state`], which is
    /// all of an op's view that changes while it lives), `None` once its
    /// launch completed.
    pub fn op_state(&self, op: super::OpRef) -> Option<OpState> {
        let launch = self.state.launches.get(&op.launch)?;
        let status = launch.ops.get(usize::from(op.index))?.status;
        Some(op_state(status, launch.started))
    }

    /// The view of op `o` of a launch that thread `t` is issuing.
    pub(super) fn issuing_view(
        &self,
        t: super::ThreadId,
        o: &super::OpSpec,
        spec: &super::LaunchSpec,
        fifo: u64,
    ) -> OpInfo {
        let lref = LaunchRef {
            thread: t,
            seq: 0,
            part: 0,
        };
        self.view(
            lref,
            o.dir,
            o.peer,
            o.bytes,
            o.dtype,
            o.comm,
            o.stream,
            fifo,
            OpState::JustIssued,
            // As R3 and R8 compared it, and as a slot keeps it: a group of
            // one op is not a group.
            spec.is_group(),
            o.origin.unwrap_or(spec.origin),
        )
    }

    /// The view of an op still in a channel (it may have completed into the
    /// buffer and left its launch).
    pub(super) fn slot_view(
        &self,
        key: ChannelKey,
        dir: Dir,
        slot: &Slot,
        delivered: u64,
    ) -> OpInfo {
        let ch = &self.state.channels.get(&key);
        let list = ch.map(|c| match dir {
            Dir::Send => &c.sends,
            Dir::Recv => &c.recvs,
        });
        let pos = list
            .and_then(|l| l.iter().position(|s| s.op == slot.op))
            .unwrap_or(0) as u64;
        let peer = if dir == Dir::Send { key.2 } else { key.1 };
        let live = self.state.launches.get(&slot.op.launch);
        let state = if slot.buffered {
            OpState::Buffered
        } else {
            match live {
                Some(l) if l.started => OpState::Started,
                Some(_) => OpState::NotStarted,
                None => OpState::Done,
            }
        };
        self.view(
            slot.op.launch,
            dir,
            peer,
            slot.bytes,
            slot.dtype,
            key.0,
            slot.stream,
            delivered + pos,
            state,
            slot.grouped,
            slot.origin,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn view(
        &self,
        lref: LaunchRef,
        dir: Dir,
        peer: u32,
        bytes: u64,
        dtype: crate::DType,
        comm: super::CommId,
        stream: super::StreamId,
        fifo: u64,
        state: OpState,
        grouped: bool,
        origin: Origin,
    ) -> OpInfo {
        let s = &self.setup;
        let thread = &s.threads[lref.thread.ix()];
        let o = s.origins.get(origin.ix());
        OpInfo {
            rank: thread.rank,
            thread: thread.name.clone(),
            op: dir,
            peer,
            bytes,
            dtype,
            comm: s.comms[comm.ix()].name.clone(),
            stream: s.streams[stream.ix()].name.clone(),
            fifo,
            state,
            grouped,
            call: o.map(|o| o.text.to_string()).unwrap_or_default(),
            at: describe_origin(s, origin),
            line: o.and_then(OriginInfo::line_number),
        }
    }
}
