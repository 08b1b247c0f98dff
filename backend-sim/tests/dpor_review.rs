//! The search of rank code (`duplex_sim::dpor`) against the search without
//! reduction, on programs a review of it wrote to break it: two threads
//! woken in one step whose code conflicts (the search falls back to the
//! search of every order of a rank's threads), and a refused host read
//! (a use all the same).
use std::sync::{Arc, Mutex};

use duplex::{Place, Transport};
use duplex_sim::{Failure, Sim, SimRank};

fn both<F>(name: &str, sim: impl Fn() -> Sim, f: F)
where
    F: Fn(&SimRank) -> duplex::Result<()> + Sync + Clone,
{
    let a = sim().check(f.clone());
    let b = sim().without_reduction().check(f);
    let show = |r: &Result<duplex_sim::Run, Failure>| match r {
        Ok(run) => format!("Ok({} executions)", run.executions),
        Err(e) => format!(
            "Err({})",
            e.to_string()
                .lines()
                .next()
                .unwrap_or("")
                .chars()
                .take(200)
                .collect::<String>()
        ),
    };
    assert_eq!(
        a.is_ok(),
        b.is_ok(),
        "{name}: the search says {}, the full search {}",
        show(&a),
        show(&b)
    );
}

/// Two threads woken in one transition; their segments conflict; another
/// order of other ranks' steps wakes them apart, in the other order.
#[test]
fn woken_together() {
    std::panic::set_hook(Box::new(|_| {}));
    for (x, y, z) in [
        (1u32, 2u32, 3u32),
        (1, 3, 2),
        (2, 1, 3),
        (2, 3, 1),
        (3, 1, 2),
        (3, 2, 1),
    ] {
        both(
            &format!("woken_together x={x} y={y} z={z}"),
            || Sim::new(4),
            move |t: &SimRank| {
                let r = t.rank();
                if r != 0 {
                    let b = t.alloc::<u32>(1)?;
                    t.send(&b, 0)?;
                    return t.synchronize();
                }
                let w = Arc::new(Mutex::new(t.alloc::<u32>(1)?));
                let sb = t.stream("sB")?;
                let ev = t.event()?;
                let mut b1 = t.alloc::<u32>(1)?;
                t.recv_on(&mut b1, x, &Place::stream(&sb))?;
                t.record(&ev, &sb)?;
                let w2 = w.clone();
                let ev2 = ev.clone();
                let c = t.spawn("C", move |t: &SimRank| {
                    let sc = t.stream("sC")?;
                    t.wait(&ev2, &sc)?;
                    let mut b3 = t.alloc::<u32>(1)?;
                    t.recv_on(&mut b3, y, &Place::stream(&sc))?;
                    t.sync_stream(&sc)?;
                    let v = t.read(&*w2.lock().unwrap())?;
                    if v[0] == 0 {
                        panic!("C ran before B");
                    }
                    Ok(())
                })?;
                let mut b2 = t.alloc::<u32>(1)?;
                t.recv_on(&mut b2, z, &Place::stream(&sb))?;
                t.sync_stream(&sb)?;
                t.write(&mut *w.lock().unwrap(), &[1])?;
                t.join(c)
            },
        );
    }
}

/// As `woken_together`, with the other ranks' sends held until a notifier
/// thread of rank 0 releases them (in the order y, z, x).
#[test]
fn woken_together_late() {
    let order_env = std::env::var("ORDER").unwrap_or("yzx".into());
    std::panic::set_hook(Box::new(|_| {}));
    for (x, y, z) in [(3u32, 1u32, 2u32), (3, 2, 1), (1, 2, 3), (2, 1, 3)] {
        let order = order_env.clone();
        both(
            &format!("late {order} x={x} y={y} z={z}"),
            || Sim::new(4),
            move |t: &SimRank| {
                let r = t.rank();
                if r != 0 {
                    let b = t.alloc::<u32>(1)?;
                    t.await_notify(0, "go")?;
                    t.send(&b, 0)?;
                    return t.synchronize();
                }
                let w = Arc::new(Mutex::new(t.alloc::<u32>(1)?));
                let sb = t.stream("sB")?;
                let ev = t.event()?;
                let mut b1 = t.alloc::<u32>(1)?;
                t.recv_on(&mut b1, x, &Place::stream(&sb))?;
                t.record(&ev, &sb)?;
                let w2 = w.clone();
                let ev2 = ev.clone();
                let c = t.spawn("C", move |t: &SimRank| {
                    let sc = t.stream("sC")?;
                    t.wait(&ev2, &sc)?;
                    let mut b3 = t.alloc::<u32>(1)?;
                    t.recv_on(&mut b3, y, &Place::stream(&sc))?;
                    t.notify(0, "c")?;
                    t.sync_stream(&sc)?;
                    let v = t.read(&*w2.lock().unwrap())?;
                    if v[0] == 0 {
                        panic!("C ran before B");
                    }
                    Ok(())
                })?;
                let order = order.clone();
                let g = t.spawn("G", move |t: &SimRank| {
                    t.await_notify(0, "b")?;
                    t.await_notify(0, "c")?;
                    for ch in order.chars() {
                        let p = match ch {
                            'x' => x,
                            'y' => y,
                            _ => z,
                        };
                        t.notify(p, "go")?;
                    }
                    Ok(())
                })?;
                let mut b2 = t.alloc::<u32>(1)?;
                t.recv_on(&mut b2, z, &Place::stream(&sb))?;
                t.notify(0, "b")?;
                t.sync_stream(&sb)?;
                t.write(&mut *w.lock().unwrap(), &[1])?;
                t.join(c)?;
                t.join(g)
            },
        );
    }
}

/// A read refused as a race records no use of the buffer: the order in
/// which the recv's sync returns first (and the read is allowed) is never
/// tried.
#[test]
fn refused_read_records_no_use() {
    std::panic::set_hook(Box::new(|_| {}));
    both(
        "refused_read",
        || Sim::new(2),
        |t: &SimRank| {
            if t.rank() == 1 {
                let b = t.alloc::<u32>(1)?;
                t.send(&b, 0)?;
                t.synchronize()?;
                return t.notify(0, "t");
            }
            let x = Arc::new(Mutex::new(t.alloc::<u32>(1)?));
            let x2 = x.clone();
            let a = t.spawn("A", move |t: &SimRank| {
                t.recv(&mut *x2.lock().unwrap(), 1)?;
                t.synchronize()
            })?;
            t.await_notify(1, "t")?;
            let ok = t.read(&*x.lock().unwrap()).is_ok();
            if ok {
                panic!("the read was allowed");
            }
            t.join(a)
        },
    );
}
