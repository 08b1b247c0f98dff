//! The seed program on the simulator: the hang explained under
//! `Policy::Shared`, completion under `Policy::PerDirection`, and the
//! scoped-stream form. Run with `cargo run -p duplex-sim --example seed`.

use duplex::{Policy, Transport};
use duplex_sim::{Sim, SimRank};

/// Two ranks each send 64 Ki floats to the other, then receive.
fn seed<T: Transport>(t: &T) -> duplex::Result<()> {
    let peer = 1 - t.rank();
    let mut out = t.alloc::<f32>(1 << 16)?;
    t.write(&mut out, &vec![t.rank() as f32; 1 << 16])?;
    let mut inb = t.alloc::<f32>(1 << 16)?;
    t.send(&out, peer)?;
    t.recv(&mut inb, peer)?;
    t.synchronize()?;
    let got = t.read(&inb)?;
    assert!(got.iter().all(|x| *x == peer as f32));
    Ok(())
}

/// The same program with the feature request's pitch: "with use_stream(s):
/// send(...)". One stream of the user's own for the send; the recv stays on
/// its lane. Under `Shared` both lanes are one communicator, so R2 still
/// serializes them: a stream alone does not fix the hang.
fn seed_scoped<T: Transport>(t: &T) -> duplex::Result<()> {
    let peer = 1 - t.rank();
    let out = t.alloc::<f32>(1 << 16)?;
    let mut inb = t.alloc::<f32>(1 << 16)?;
    let s = t.stream("sender")?;
    t.with_stream(&s, || t.send(&out, peer))?;
    t.recv(&mut inb, peer)?;
    t.synchronize()
}

fn main() {
    let shared = Sim::new(2).policy(Policy::Shared);
    match shared.check(|t: &SimRank| seed(t)) {
        Ok(run) => println!("unexpected: completed ({} executions)", run.executions),
        Err(failure) => println!("under Policy::Shared:\n{failure}"),
    }
    let run = Sim::new(2)
        .policy(Policy::PerDirection)
        .check(|t: &SimRank| seed(t))
        .expect("per-direction lanes remove the hang");
    println!(
        "under Policy::PerDirection: every interleaving completes ({} executions, {} states)\n",
        run.executions, run.states
    );
    match shared.check(|t: &SimRank| seed_scoped(t)) {
        Ok(_) => println!("scoped stream under Shared: completes"),
        Err(f) => println!(
            "scoped stream under Shared still hangs (R2: one communicator):\n{}",
            f.hang().map(|h| h.stuck.to_string()).unwrap_or_default()
        ),
    }
    let run = Sim::new(2)
        .policy(Policy::PerDirection)
        .check(|t: &SimRank| seed_scoped(t))
        .expect("completes");
    println!(
        "scoped stream under PerDirection: completes ({} executions)",
        run.executions
    );
}
