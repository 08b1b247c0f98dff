//! A pipeline of rank code that `tests/sim.rs` checks and
//! `examples/scale.rs` times (included by path in both).

use duplex::{Dir, Transport};
use duplex_sim::SimRank;

/// A pipeline stage's two threads: `up` receives from the previous stage
/// and sends to the next, `down` the other way, each on its own lanes and
/// syncing only the lane it used.
pub(crate) fn pipeline(
    stages: u32,
    micro: usize,
) -> impl Fn(&SimRank) -> duplex::Result<()> + Sync {
    move |t: &SimRank| {
        let stage = move |t: &SimRank, up: bool| -> duplex::Result<()> {
            let r = t.rank();
            let (from, to) = if up {
                (r.checked_sub(1), (r + 1 < stages).then_some(r + 1))
            } else {
                ((r + 1 < stages).then_some(r + 1), r.checked_sub(1))
            };
            let mut b = t.alloc::<u32>(64)?;
            for _ in 0..micro {
                if let Some(p) = from {
                    t.recv(&mut b, p)?;
                    t.sync_stream(&t.lane(p, Dir::Recv)?.stream)?;
                }
                if let Some(p) = to {
                    t.send(&b, p)?;
                    t.sync_stream(&t.lane(p, Dir::Send)?.stream)?;
                }
            }
            Ok(())
        };
        let up = t.spawn("up", move |t| stage(t, true))?;
        let down = t.spawn("down", move |t| stage(t, false))?;
        t.join(up)?;
        t.join(down)
    }
}
