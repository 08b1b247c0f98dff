//! Runs a schedule [`Program`] through any [`Transport`]: the same file that
//! `duplex check` reasons about, executed by the simulated transport or on
//! GPUs.
//!
//! Each rank calls [`execute`] with its own handle. Named host threads are
//! started with [`Transport::spawn`] and joined at the end; every thread ends
//! with a synchronize of all its rank's streams, as the format says. A send
//! carries bytes derived from (source, destination, size, and its number on
//! its channel where one thread sends and one receives on it) and every recv
//! checks them, so a corrupted, misrouted or swapped message is an error.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use super::{Dir, P2p, Program, StmtKind};
use crate::transport::check::at_site;
use crate::{Error, Place, Rank, Result, Transport};

/// Per-rank objects shared by the rank's host threads.
struct RankObjects<T: Transport> {
    comms: HashMap<String, T::Comm>,
    streams: Mutex<HashMap<String, T::Stream>>,
    events: Mutex<HashMap<String, T::Event>>,
    /// The channels whose messages carry their number ([`numbered`]).
    numbered: HashSet<Channel>,
}

/// The channel an op goes on, as the program places it: its communicator
/// as written (`world` when only its stream is), or the policy's lane of
/// its direction (`true`: the copy-engine lane, for a message of at least
/// `copy-from`), with the sender and the receiver. Messages of a channel
/// match in order (R3).
type Channel = (Option<Box<str>>, bool, Rank, Rank);

fn channel_of(program: &Program, rank: Rank, op: &P2p) -> Channel {
    let (src, dst) = match op.dir {
        Dir::Send => (rank, op.peer),
        Dir::Recv => (op.peer, rank),
    };
    if op.is_explicit() {
        let comm = op.comm.clone().unwrap_or_else(|| "world".into());
        (Some(comm), false, src, dst)
    } else {
        let copy = crate::compile::goes_by_copy(
            program.policy,
            program.copy_from.map(crate::Size::bytes),
            src,
            dst,
            op.size.bytes(),
        );
        (None, copy, src, dst)
    }
}

/// The channels on which one thread sends and one thread receives: there
/// each side numbers its messages in its own program order, which is the
/// channel's (R3), so a message carries its number and a recv that got
/// another message of the same size (two swapped) is caught. On a channel
/// that several threads of a rank use, the order depends on the run, and
/// its messages carry no number (found by review: two sends of one size
/// swapped on their way passed the check).
fn numbered(program: &Program) -> HashSet<Channel> {
    let mut users: HashMap<Channel, [HashSet<usize>; 2]> = HashMap::new();
    for (i, thread) in program.threads.iter().enumerate() {
        for stmt in &thread.body {
            for op in stmt.p2ps() {
                let side = usize::from(op.dir == Dir::Recv);
                users
                    .entry(channel_of(program, thread.rank, op))
                    .or_default()[side]
                    .insert(i);
            }
        }
    }
    users
        .into_iter()
        // A rank's messages to itself are left out: their send and recv
        // meet within one launch anyway (R12), and a backend may carry the
        // implicit ones on the same channel as those written `comm=world`
        // (duplex-nccl does), which this key tells apart (found by review).
        .filter(|((_, _, src, dst), [s, r])| src != dst && s.len() <= 1 && r.len() <= 1)
        .map(|(c, _)| c)
        .collect()
}

/// The bytes of a message of `len` bytes from `src` to `dst`, message
/// `number` of its channel where it is numbered: a 4 KiB block derived
/// from (source, destination, length, number), each repetition offset by
/// its index, so that a message from another pair, of another length, of
/// another number, or shifted by a block, differs.
pub fn payload(src: Rank, dst: Rank, len: u64, number: Option<u64>) -> Vec<u8> {
    try_payload(src, dst, len, number)
        .unwrap_or_else(|| panic!("{len} bytes of payload: out of memory"))
}

/// [`payload`], or `None` when the host cannot hold it.
fn try_payload(src: Rank, dst: Rank, len: u64, number: Option<u64>) -> Option<Vec<u8>> {
    let bytes = payload_bytes(src, dst, len, number);
    let mut out = Vec::new();
    out.try_reserve_exact(usize::try_from(len).ok()?).ok()?;
    out.extend(bytes);
    Some(out)
}

/// The bytes of [`payload`], one at a time (to check a message without a
/// second copy of it).
fn payload_bytes(src: Rank, dst: Rank, len: u64, number: Option<u64>) -> impl Iterator<Item = u8> {
    let seed = (u64::from(src) << 40)
        ^ (u64::from(dst) << 32)
        ^ len.wrapping_mul(0x9E37_79B9)
        ^ number.map_or(0, |k| (k + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93));
    let block: Vec<u8> = (0..4096u64)
        .map(|i| {
            let x = seed ^ i.wrapping_mul(0x2545_F491_4F6C_DD1D);
            (x ^ (x >> 29) ^ (x >> 47)) as u8
        })
        .collect();
    (0..len).map(move |i| block[(i % 4096) as usize] ^ (i / 4096) as u8)
}

/// Runs rank `t.rank()`'s part of `program`. Every rank must call it; the
/// transport's policy should be the program's, and its copy-engine lanes
/// ([`Transport::copy_from`]) must be: a program whose large ops the
/// checker put on copy-engine lanes is not run on NCCL lanes.
pub fn execute<T: Transport>(program: &Arc<Program>, t: &T) -> Result<()> {
    let rank = t.rank();
    let wanted = program
        .copy_from
        .filter(|_| program.policy == crate::Policy::PerDirection)
        .map(crate::Size::bytes);
    if t.copy_from() != wanted {
        let say = |c: Option<u64>| match c {
            Some(c) => format!("from {} on copy-engine lanes", crate::Size(c)),
            None => "none on copy-engine lanes".to_string(),
        };
        return Err(Error::Invalid {
            at: "schedule".into(),
            message: format!(
                "the program puts ops {}, the transport {}",
                say(wanted),
                say(t.copy_from())
            ),
        });
    }
    if t.world_size() != program.ranks {
        return Err(Error::Invalid {
            at: "schedule".into(),
            message: format!(
                "the program has {} ranks, the transport {}",
                program.ranks,
                t.world_size()
            ),
        });
    }
    let mut comms = HashMap::new();
    for c in &program.comms {
        if let Some(comm) = t.comm(&c.name, &c.ranks)? {
            comms.insert(c.name.clone(), comm);
        }
    }
    comms.insert("world".to_string(), t.world());
    let objects = Arc::new(RankObjects::<T> {
        comms,
        streams: Mutex::new(HashMap::new()),
        events: Mutex::new(HashMap::new()),
        numbered: numbered(program),
    });
    let mut spawned = Vec::new();
    for (i, thread) in program.threads.iter().enumerate() {
        if thread.rank != rank || thread.name.is_none() {
            continue;
        }
        let (program, objects) = (program.clone(), objects.clone());
        let name = thread.display_name().to_string();
        spawned.push(t.spawn(&name, move |t: &T| run_thread(&program, i, &objects, t))?);
    }
    let main = program
        .threads
        .iter()
        .position(|th| th.rank == rank && th.name.is_none());
    let mut results = Vec::new();
    if let Some(i) = main {
        results.push(run_thread(program, i, &objects, t));
    }
    for s in spawned {
        results.push(t.join(s));
    }
    // A rank without a main thread still ends with its streams drained,
    // unless a thread already failed (that wait would only add a deadline).
    // Reported as that, not at this file's line: the file has no block to
    // point at.
    if main.is_none() && results.iter().all(Result::is_ok) {
        let what = if program.threads.iter().any(|th| th.rank == rank) {
            format!(
                "the end of rank {rank}, which has no `rank {rank}:` block, once its threads have ended"
            )
        } else {
            format!("the end of rank {rank}, which has no block in the file")
        };
        results.push(at_site(&what, || t.synchronize()));
    }
    // One thread's hang aborts what the others wait on: report the hang,
    // not the echoes (`Error::severity`).
    match Error::most_telling(results.into_iter().filter_map(Result::err)) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn stream<T: Transport>(objects: &RankObjects<T>, t: &T, name: &str) -> Result<T::Stream> {
    let mut streams = objects.streams.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(s) = streams.get(name) {
        return Ok(s.clone());
    }
    let s = t.stream(name)?;
    streams.insert(name.to_string(), s.clone());
    Ok(s)
}

fn event<T: Transport>(objects: &RankObjects<T>, t: &T, name: &str) -> Result<T::Event> {
    let mut events = objects.events.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(e) = events.get(name) {
        return Ok(e.clone());
    }
    let e = t.event()?;
    events.insert(name.to_string(), e.clone());
    Ok(e)
}

/// A recv buffer and what it must hold once received.
struct Pending<T: Transport> {
    buf: T::Buffer<u8>,
    src: Rank,
    line: u32,
    /// Its number on its channel, where numbered.
    number: Option<u64>,
    /// Its size as written.
    len: usize,
}

fn run_thread<T: Transport>(
    program: &Program,
    index: usize,
    objects: &RankObjects<T>,
    t: &T,
) -> Result<()> {
    let thread = &program.threads[index];
    let mut sent = Vec::new();
    let mut received: Vec<Pending<T>> = Vec::new();
    // This thread's sends and recvs so far on each numbered channel (both,
    // on a channel of its rank to itself).
    let mut counts: HashMap<(Channel, Dir), u64> = HashMap::new();
    let mut number = |op: &P2p| {
        let c = channel_of(program, thread.rank, op);
        objects.numbered.contains(&c).then(|| {
            let n = counts.entry((c, op.dir)).or_insert(0);
            *n += 1;
            *n - 1
        })
    };
    // Reports name the schedule's lines, not this file's (`at_site`).
    let at = |line: u32| format!("line {line}");
    for stmt in &thread.body {
        at_site(&at(stmt.line.0), || -> Result<()> {
            match &stmt.kind {
                StmtKind::Op(op) => {
                    let k = number(op);
                    p2p(objects, t, op, (stmt.line.0, k), &mut sent, &mut received)?
                }
                StmtKind::Group(ops) => t.group(|| {
                    for op in ops {
                        // Each op of a multi-line group names its own line.
                        let line = if op.line.0 != 0 { op.line } else { stmt.line };
                        let k = number(op);
                        at_site(&at(line.0), || {
                            p2p(objects, t, op, (line.0, k), &mut sent, &mut received)
                        })?;
                    }
                    Ok(())
                })?,
                StmtKind::Record {
                    event: e,
                    stream: s,
                } => {
                    let s = stream(objects, t, s.as_deref().unwrap_or("default"))?;
                    t.record(&event(objects, t, e)?, &s)?;
                }
                StmtKind::Wait {
                    event: e,
                    stream: s,
                } => {
                    let s = stream(objects, t, s.as_deref().unwrap_or("default"))?;
                    t.wait(&event(objects, t, e)?, &s)?;
                }
                StmtKind::Sync { stream: None } => t.synchronize()?,
                StmtKind::Sync { stream: Some(s) } => t.sync_stream(&stream(objects, t, s)?)?,
                StmtKind::Notify { peer, tag } => t.notify(*peer, tag)?,
                StmtKind::Await { peer, tag } => t.await_notify(*peer, tag)?,
            }
            Ok(())
        })?;
    }
    // The thread's end (its implicit synchronize) is reported by its
    // header's line, saying so: no `synchronize` is written there.
    at_site(
        &format!("the end of the thread that {} begins", at(thread.line.0)),
        || t.synchronize(),
    )?;
    for p in &received {
        let got = t.read(&p.buf)?;
        if got.len() != p.len {
            return Err(Error::User(format!(
                "line {}: rank {} read {} bytes of a {}-byte recv from rank {}",
                p.line,
                t.rank(),
                got.len(),
                p.len,
                p.src
            )));
        }
        let want = payload_bytes(p.src, t.rank(), p.len as u64, p.number);
        if let Some(i) = got.iter().zip(want).position(|(g, w)| *g != w) {
            let which = p
                .number
                .map_or(String::new(), |k| format!(" (message #{k} of its channel)"));
            return Err(Error::User(format!(
                "line {}: rank {} received wrong bytes from rank {}{which} at byte {i}",
                p.line,
                t.rank(),
                p.src
            )));
        }
    }
    drop(sent);
    Ok(())
}

fn p2p<T: Transport>(
    objects: &RankObjects<T>,
    t: &T,
    op: &P2p,
    (line, number): (u32, Option<u64>),
    sent: &mut Vec<T::Buffer<u8>>,
    received: &mut Vec<Pending<T>>,
) -> Result<()> {
    let len = usize::try_from(op.size.bytes()).map_err(|_| Error::Invalid {
        at: format!("line {line}"),
        message: "message too large for this machine".into(),
    })?;
    let place = if op.is_explicit() {
        let name = op.comm.as_deref().unwrap_or("world");
        let comm = objects.comms.get(name).ok_or_else(|| Error::Invalid {
            at: format!("line {line}"),
            message: format!("rank {} is not in communicator `{name}`", t.rank()),
        })?;
        Place::on(
            comm,
            &stream(objects, t, op.stream.as_deref().unwrap_or("default"))?,
        )
    } else {
        Place::lane()
    };
    match op.dir {
        Dir::Send => {
            let mut buf = t.alloc::<u8>(len)?;
            let data = try_payload(t.rank(), op.peer, len as u64, number).ok_or_else(|| {
                Error::Invalid {
                    at: format!("line {line}"),
                    message: format!(
                        "the {} this send carries do not fit in this machine's memory",
                        crate::Size(len as u64)
                    ),
                }
            })?;
            t.write(&mut buf, &data)?;
            t.send_on(&buf, op.peer, &place)?;
            sent.push(buf);
        }
        Dir::Recv => {
            let mut buf = t.alloc::<u8>(len)?;
            t.recv_on(&mut buf, op.peer, &place)?;
            received.push(Pending {
                buf,
                src: op.peer,
                line,
                number,
                len,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{channel_of, numbered, payload};
    use crate::schedule::parse;

    /// Two messages of one size on one channel carry different bytes, so
    /// that a recv given the other (two swapped on their way) is caught;
    /// where several threads of a rank use the channel, its order depends
    /// on the run and its messages are not numbered.
    #[test]
    fn messages_of_one_size_on_a_channel_of_one_thread_each_side_differ() {
        assert_ne!(payload(0, 1, 4096, Some(0)), payload(0, 1, 4096, Some(1)));
        assert_ne!(payload(0, 1, 4096, Some(0)), payload(0, 1, 4096, None));
        assert_eq!(payload(0, 1, 4096, Some(3)), payload(0, 1, 4096, Some(3)));
        let p = parse(
            "ranks 2\n\
             rank 0:\n  group { send 1 4KiB; send 1 4KiB }\n  send 1 4KiB comm=world\n\
             rank 0 thread t:\n  send 1 4KiB comm=world\n\
             rank 1:\n  group { recv 0 4KiB; recv 0 4KiB }\n  recv 0 4KiB comm=world\n  recv 0 4KiB comm=world\n",
        )
        .expect("parses");
        let set = numbered(&p);
        let main0 = &p
            .threads
            .iter()
            .find(|t| t.rank == 0 && t.name.is_none())
            .unwrap();
        let ops: Vec<_> = main0.body.iter().flat_map(|s| s.p2ps()).collect();
        // The policy's lane 0 -> 1: one thread each side, numbered.
        assert!(set.contains(&channel_of(&p, 0, ops[0])));
        // `world` 0 -> 1: two threads of rank 0 send on it, not numbered.
        assert!(!set.contains(&channel_of(&p, 0, ops[2])));
        assert_eq!(set.len(), 1, "{set:?}");
    }
}
