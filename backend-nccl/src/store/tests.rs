use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use duplex::Error;

use super::proto::{self, MAX_LINE, Request, Response, Secret, VERSION, hex};
use super::{Limits, Store, secret_from, serve_on};
use crate::board::Board;

const ID: &[u8] = b"the unique id, 32 bytes of it...";
const TOKEN: &str = "0123456789abcdef-a-test-token";

fn secret() -> Secret {
    Secret::new(TOKEN)
}

fn server(limits: Limits) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    serve_on(listener, ID.to_vec(), secret(), limits).unwrap()
}

fn limits(io_ms: u64) -> Limits {
    Limits {
        io_timeout: Duration::from_millis(io_ms),
        ..super::LIMITS
    }
}

/// The store's limits, but silences from 100 ms on asked as such (the
/// store asks about at least 1 s), for tests of silent ranks.
fn quick_silence() -> Limits {
    Limits {
        min_silence: Duration::from_millis(100),
        ..super::LIMITS
    }
}

fn client(addr: SocketAddr) -> Store {
    Store::client("127.0.0.1", addr.port(), secret())
}

/// A connection to the store at `addr`, past its `AUTH`.
fn authenticated(addr: SocketAddr) -> TcpStream {
    let mut c = TcpStream::connect(addr).unwrap();
    c.write_all(&auth()).unwrap();
    let mut ok = [0u8; 3];
    c.read_exact(&mut ok).unwrap();
    assert_eq!(&ok, b"OK\n");
    c
}

fn auth() -> Vec<u8> {
    proto::encode_request(&Request::Auth {
        version: VERSION,
        token: secret(),
    })
    .unwrap()
}

/// Sends `bytes` (then closes the sending side if `close`), and returns all
/// the store replied until it closed the connection.
fn raw(addr: SocketAddr, bytes: &[u8], close: bool) -> String {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // The store may close before reading everything: that is its right.
    let _ = c.write_all(bytes);
    if close {
        let _ = c.shutdown(Shutdown::Write);
    }
    let mut reply = Vec::new();
    let _ = c.read_to_end(&mut reply);
    String::from_utf8_lossy(&reply).into_owned()
}

#[test]
fn the_tcp_store_hands_out_the_id_and_carries_messages_between_processes() {
    let addr = server(super::LIMITS);
    let c = client(addr);
    assert_eq!(c.unique_id(Duration::from_secs(5)).unwrap(), ID);
    let waiter = std::thread::spawn(move || client(addr).take(0, 1, "go", Duration::from_secs(5)));
    std::thread::sleep(Duration::from_millis(50));
    c.post(0, 1, "go").unwrap();
    assert!(waiter.join().unwrap().unwrap());
    assert!(!c.take(0, 1, "go", Duration::from_millis(20)).unwrap());
    // Tags are carried exactly: spaces, newlines, unicode, the empty tag.
    for tag in ["a b", "a_b", "line\nbreak", "é🦀", ""] {
        c.post(2, 3, tag).unwrap();
    }
    for tag in ["", "é🦀", "line\nbreak", "a_b", "a b"] {
        assert!(c.take(2, 3, tag, Duration::ZERO).unwrap(), "{tag:?}");
    }
    assert!(
        !c.take(3, 2, "a b", Duration::ZERO).unwrap(),
        "direction matters"
    );
}

#[test]
fn hostile_requests_get_an_error_and_the_store_keeps_serving() {
    let addr = server(limits(2_000));
    let with_auth = |rest: &[u8]| [auth(), rest.to_vec()].concat();
    let other_token = proto::encode_request(&Request::Auth {
        version: VERSION,
        token: Secret::new("0123456789abcdef-another-token"),
    })
    .unwrap();
    let cases: Vec<(&str, Vec<u8>, bool, &str)> = vec![
        ("no auth", b"ID\n".to_vec(), false, "authenticate first"),
        (
            "wrong token",
            [other_token, b"ID\n".to_vec()].concat(),
            false,
            "bad token",
        ),
        (
            "missing token",
            b"AUTH 1\n".to_vec(),
            false,
            "AUTH takes 2 fields, got 1",
        ),
        (
            "empty token",
            b"AUTH 1 \n".to_vec(),
            false,
            "token of 0 bytes",
        ),
        (
            "odd token",
            b"AUTH 1 abc\n".to_vec(),
            false,
            "token is not lowercase hex",
        ),
        (
            "other version",
            format!("AUTH 1 {}\n", hex(TOKEN.as_bytes())).into_bytes(),
            false,
            "unsupported protocol version 1",
        ),
        (
            "http",
            b"GET / HTTP/1.1\r\n\r\n".to_vec(),
            false,
            "byte 0x0d at offset 14",
        ),
        (
            "not utf-8",
            b"\xff\xfe\n".to_vec(),
            false,
            "byte 0xff at offset 0",
        ),
        ("empty line", b"\n".to_vec(), false, "unknown request"),
        ("truncated", b"AUTH 1 30".to_vec(), true, "truncated line"),
        (
            "oversized",
            vec![b'A'; 3 * MAX_LINE],
            false,
            "line of more than 4096 bytes",
        ),
        (
            "oversized after auth",
            with_auth(format!("POST 0 1 {}\n", "61".repeat(MAX_LINE)).as_bytes()),
            false,
            "line of more than 4096 bytes",
        ),
        (
            "tag too long",
            with_auth(format!("POST 0 1 {}\n", "61".repeat(1025)).as_bytes()),
            false,
            "tag of 1025 bytes is outside 1..=1024",
        ),
        (
            "tag not utf-8",
            with_auth(b"POST 0 1 ff\n"),
            false,
            "tag is not utf-8",
        ),
        (
            "negative wait",
            with_auth(b"TAKE 0 1 - -5\n"),
            false,
            "millis is not a number",
        ),
        (
            "rank too big",
            with_auth(b"POST 4294967296 1 -\n"),
            false,
            "from is not a number",
        ),
        (
            "truncated after auth",
            with_auth(b"ID"),
            true,
            "truncated line",
        ),
        (
            "auth twice",
            with_auth(&auth()),
            false,
            "already authenticated",
        ),
        (
            "garbage after auth",
            with_auth(b"\x00\x01\x02\n"),
            false,
            "not printable ascii",
        ),
    ];
    for (name, bytes, close, expected) in cases {
        let reply = raw(addr, &bytes, close);
        assert!(reply.ends_with('\n'), "{name}: {reply:?}");
        let last = reply.lines().last().unwrap_or_default();
        assert!(
            last.starts_with("ERROR ") && last.contains(expected),
            "{name}: {reply:?}"
        );
        assert!(!reply.contains(&hex(ID)), "{name}: the id leaked");
        // ... and everyone else is still served.
        assert_eq!(client(addr).unique_id(Duration::from_secs(5)).unwrap(), ID);
    }
}

#[test]
fn a_wrong_or_missing_token_is_a_clear_error_for_the_client() {
    let addr = server(super::LIMITS);
    let wrong = Store::client(
        "127.0.0.1",
        addr.port(),
        Secret::new("0123456789abcdef-wrong"),
    );
    for e in [
        wrong.unique_id(Duration::from_secs(5)).unwrap_err(),
        wrong.post(0, 1, "go").unwrap_err(),
        wrong.take(0, 1, "go", Duration::ZERO).unwrap_err(),
    ] {
        assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
        let text = e.to_string();
        assert!(
            text.contains("bad token") && text.contains("DUPLEX_STORE_TOKEN"),
            "{text}"
        );
        assert!(!text.contains(TOKEN) && !text.contains("wrong"), "{text}");
    }
    let none = Store::client("127.0.0.1", addr.port(), Secret::new(""));
    let e = none.unique_id(Duration::from_secs(5)).unwrap_err();
    assert!(
        matches!(&e, Error::Invalid { at, .. } if at == "DUPLEX_STORE_TOKEN"),
        "{e:?}"
    );
    // A tag the store would refuse is refused before it is sent.
    let e = client(addr).post(0, 1, &"x".repeat(1025)).unwrap_err();
    assert!(e.to_string().contains("tag of 1025 bytes"), "{e}");
    assert_eq!(client(addr).unique_id(Duration::from_secs(5)).unwrap(), ID);
}

#[test]
fn an_idle_or_trickling_client_does_not_block_others_and_is_dropped() {
    let addr = server(limits(1_500));
    let start = Instant::now();
    let mut idle = TcpStream::connect(addr).unwrap();
    let trickler = std::thread::spawn(move || {
        let mut c = TcpStream::connect(addr).unwrap();
        // Never a whole line: one byte every 100 ms, for up to 5 s.
        for _ in 0..50 {
            if c.write_all(b"A").is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let mut reply = String::new();
        let _ = c.read_to_string(&mut reply);
        reply
    });
    let c = client(addr);
    assert_eq!(c.unique_id(Duration::from_secs(5)).unwrap(), ID);
    c.post(0, 1, "x").unwrap();
    assert!(c.take(0, 1, "x", Duration::ZERO).unwrap());
    assert!(
        start.elapsed() < Duration::from_millis(1_500),
        "others were served late"
    );
    let mut reply = String::new();
    idle.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    idle.read_to_string(&mut reply).unwrap();
    assert_eq!(reply, "ERROR timed out waiting for a request\n");
    assert!(trickler.join().unwrap().contains("timed out"));
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "the trickler held on"
    );
}

#[test]
fn too_many_connections_are_refused_and_their_places_come_back() {
    let addr = server(Limits {
        max_connections: 2,
        ..limits(500)
    });
    // Two connections past their AUTH hold the two places.
    let idle: Vec<TcpStream> = (0..2).map(|_| authenticated(addr)).collect();
    assert_eq!(
        raw(addr, &auth(), false),
        "ERROR busy: too many connections\n"
    );
    for mut c in idle {
        // Closed without a word once quiet for the I/O timeout.
        let mut s = String::new();
        c.read_to_string(&mut s).unwrap();
        assert_eq!(s, "");
    }
    // The idle connections' places come back once the store has closed them.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match client(addr).unique_id(Duration::from_secs(5)) {
            Ok(id) => break assert_eq!(id, ID),
            Err(e) if Instant::now() < deadline => {
                assert!(e.to_string().contains("busy"), "{e}");
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("{e}"),
        }
    }
}

/// Connections that never authenticate (anything that can reach the
/// port) have a pool of their own: they cannot take the places of the
/// job's ranks, are bounded in all and per host, and are closed after the
/// AUTH timeout.
#[test]
fn connections_that_never_authenticate_cannot_take_the_ranks_places() {
    let addr = server(Limits {
        max_connections: 2,
        max_unauthenticated: 8,
        max_unauthenticated_per_host: 8,
        auth_timeout: Duration::from_millis(1_500),
        ..limits(5_000)
    });
    let mut silent: Vec<TcpStream> = (0..6).map(|_| TcpStream::connect(addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(100));
    // Beside six silent connections, two clients that authenticate take
    // both places of authenticated connections.
    let (a, b) = (client(addr), client(addr));
    assert_eq!(a.unique_id(Duration::from_secs(5)).unwrap(), ID);
    assert_eq!(b.unique_id(Duration::from_secs(5)).unwrap(), ID);
    // The pool of connections not yet authenticated fills, and is full.
    silent.extend((0..2).map(|_| TcpStream::connect(addr).unwrap()));
    std::thread::sleep(Duration::from_millis(100));
    let reply = raw(addr, b"", false);
    assert!(
        reply.starts_with("ERROR busy: too many connections not yet authenticated"),
        "{reply}"
    );
    // Served on their kept connections all along.
    assert_eq!(a.unique_id(Duration::from_secs(5)).unwrap(), ID);
    // The silent ones are closed at their AUTH timeout, and their places
    // come back.
    for mut c in silent {
        let mut s = String::new();
        c.read_to_string(&mut s).unwrap();
        assert!(s.contains("timed out"), "{s}");
    }
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut s = String::new();
    let _ = c.read_to_string(&mut s);
    assert!(s.contains("timed out"), "{s}");
    // Per host too.
    let addr = server(Limits {
        max_unauthenticated_per_host: 2,
        auth_timeout: Duration::from_millis(500),
        ..limits(5_000)
    });
    let _held: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(100));
    let reply = raw(addr, b"", false);
    assert!(
        reply.starts_with("ERROR busy: too many connections not yet authenticated from this host"),
        "{reply}"
    );
}

#[test]
fn pending_messages_are_bounded() {
    let addr = server(Limits {
        max_pending: 2,
        ..super::LIMITS
    });
    let c = client(addr);
    c.post(0, 1, "a").unwrap();
    c.post(0, 1, "a").unwrap();
    c.post(0, 1, "b").unwrap();
    let e = c.post(0, 1, "c").unwrap_err();
    assert!(
        e.to_string().contains("too many pending notify messages"),
        "{e}"
    );
    assert!(c.take(0, 1, "b", Duration::ZERO).unwrap());
    c.post(0, 1, "c").unwrap();
}

#[test]
fn a_huge_wait_is_capped_instead_of_overflowing() {
    let addr = server(super::LIMITS);
    let c = client(addr);
    c.post(0, 1, "t").unwrap();
    let take = proto::encode_request(&Request::Take {
        from: 0,
        to: 1,
        tag: "t".into(),
        wait_ms: u64::MAX,
    })
    .unwrap();
    assert_eq!(raw(addr, &[auth(), take].concat(), true), "OK\nOK\n");
    c.post(0, 1, "t").unwrap();
    assert!(c.take(0, 1, "t", Duration::MAX).unwrap());
}

#[test]
fn an_unreachable_store_says_what_to_check() {
    let c = Store::client("127.0.0.1", 1, secret());
    let e = c
        .unique_id(Duration::from_millis(200))
        .unwrap_err()
        .to_string();
    assert!(e.contains("MASTER_ADDR"), "{e}");
}

#[test]
fn the_store_binds_the_address_it_is_given() {
    let addr = Store::serve("127.0.0.1", 0, ID.to_vec(), secret()).unwrap();
    assert!(addr.ip().is_loopback(), "{addr}");
    assert_eq!(client(addr).unique_id(Duration::from_secs(5)).unwrap(), ID);
    // An address of another machine (TEST-NET-1) cannot be bound.
    let e = Store::serve("192.0.2.1", 0, ID.to_vec(), secret())
        .unwrap_err()
        .to_string();
    assert!(e.contains("DUPLEX_STORE_BIND"), "{e}");
    let e = Store::serve("127.0.0.1", 0, Vec::new(), secret()).unwrap_err();
    assert!(matches!(e, Error::Invalid { .. }), "{e}");
}

fn env(vars: &[(&str, &str)]) -> Result<Secret, Error> {
    let vars: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    secret_from(|k| vars.get(k).cloned())
}

#[test]
fn the_secret_comes_from_the_token_or_from_torchrun() {
    let torchrun = [
        ("TORCHELASTIC_RUN_ID", "3f2c5e0a-run"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
        ("WORLD_SIZE", "8"),
    ];
    // The token wins.
    let token = env(&[("DUPLEX_STORE_TOKEN", TOKEN), torchrun[0]]).unwrap();
    assert_eq!(token, secret());
    // Derived: the same for every rank of a job, different for another job.
    let a = env(&torchrun).unwrap();
    assert_eq!(a, env(&torchrun).unwrap());
    let mut other = torchrun;
    other[2] = ("MASTER_PORT", "29501");
    assert_ne!(a, env(&other).unwrap());
    other = torchrun;
    other[0] = ("TORCHELASTIC_RUN_ID", "another-run");
    assert_ne!(a, env(&other).unwrap());
    // Refused, each saying how to set DUPLEX_STORE_TOKEN.
    let mut none = torchrun;
    none[0] = ("TORCHELASTIC_RUN_ID", "none");
    for (vars, says) in [
        (&[][..], "DUPLEX_STORE_TOKEN"),
        (&none[..], "`none`"),
        (&torchrun[..2], "MASTER_PORT is not"),
        (&[("DUPLEX_STORE_TOKEN", "short")][..], "has 5 bytes"),
        (&[("DUPLEX_STORE_TOKEN", "")][..], "has 0 bytes"),
    ] {
        let e = env(vars).unwrap_err().to_string();
        assert!(
            e.contains(says) && e.contains("export DUPLEX_STORE_TOKEN="),
            "{e}"
        );
    }
    let long = "x".repeat(2000);
    let e = env(&[("DUPLEX_STORE_TOKEN", &long)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("has 2000 bytes") && !e.contains(&long), "{e}");
}

#[test]
fn secrets_and_ids_are_never_printed() {
    let s = format!("{:?}", secret());
    assert!(!s.contains("0123") && s.contains("bytes"), "{s}");
    let r = format!(
        "{:?}",
        Request::Auth {
            version: 1,
            token: secret()
        }
    );
    assert!(
        !r.contains("0123") && !r.contains(&hex(TOKEN.as_bytes())),
        "{r}"
    );
    let r = format!("{:?}", Response::UniqueId(ID.to_vec()));
    assert!(!r.contains("unique") && !r.contains(&hex(ID)), "{r}");
    let store = format!("{:?}", client("127.0.0.1:1".parse().unwrap()));
    assert!(!store.contains("0123"), "{store}");
}

#[test]
fn failures_and_silent_ranks_are_reported_to_the_others() {
    let addr = server(quick_silence());
    let store = client(addr);
    let t = Duration::from_secs(5);
    let silence = Duration::from_millis(300);
    for r in 0..3 {
        store.beat(r, t).unwrap();
    }
    assert_eq!(store.health(0, silence, t).unwrap(), None);
    store.fail(2, "hang: deadline of 10 s expired", t).unwrap();
    // A rank's own failure is not reported to it; the others see it.
    assert_eq!(store.health(2, silence, t).unwrap(), None);
    let seen = store.health(0, silence, t).unwrap().expect("rank 2 failed");
    assert_eq!(seen, (2, "hang: deadline of 10 s expired".to_string()));
    // The first failure of a rank is kept.
    store.fail(2, "something later", t).unwrap();
    assert_eq!(store.health(1, silence, t).unwrap().unwrap().1, seen.1);

    // A rank that stops beating is reported once it has been silent longer
    // than asked.
    let addr = server(quick_silence());
    let store = client(addr);
    store.beat(0, t).unwrap();
    store.beat(1, t).unwrap();
    std::thread::sleep(Duration::from_millis(400));
    store.beat(0, t).unwrap();
    let (rank, why) = store
        .health(0, silence, t)
        .unwrap()
        .expect("rank 1 is silent");
    assert_eq!(rank, 1);
    assert!(why.contains("no heartbeat"), "{why}");
    // Once found silent, it stays the failed rank for every asker, whatever
    // silence that one asks about, and if it beats again.
    store.beat(1, t).unwrap();
    assert_eq!(
        store.health(0, Duration::from_secs(60), t).unwrap(),
        Some((rank, why))
    );
}

#[test]
fn a_silent_rank_is_named_before_the_echoes_of_its_death() {
    let t = Duration::from_secs(5);
    let silence = Duration::from_millis(300);
    // Four ranks; rank 2 dies (stops beating). Rank 3 learns of it from its
    // silence, fails in turn and posts that; rank 0, asking after, must
    // hear of rank 2, which failed first, not of rank 3's echo.
    let store = client(server(quick_silence()));
    for r in 0..4 {
        store.beat(r, t).unwrap();
    }
    for _ in 0..4 {
        std::thread::sleep(Duration::from_millis(100));
        for r in [0, 1, 3] {
            store.beat(r, t).unwrap();
        }
    }
    let (rank, why) = store
        .health(3, silence, t)
        .unwrap()
        .expect("rank 2 is silent");
    assert_eq!(rank, 2, "{why}");
    store
        .fail(3, "aborted: `synchronize` ended because rank 2 failed", t)
        .unwrap();
    let (rank, why) = store.health(0, silence, t).unwrap().expect("a failure");
    assert_eq!(rank, 2, "{why}");
    assert!(why.contains("no heartbeat"), "{why}");
    // Rank 2 resumes (a frozen process continued): every asker still hears
    // of rank 2, not of the echo.
    store.beat(2, t).unwrap();
    assert_eq!(store.health(1, silence, t).unwrap().map(|f| f.0), Some(2));
    // Rank 3's echo was recorded after rank 2's silence.
    assert_eq!(store.health(2, silence, t).unwrap().map(|f| f.0), Some(3));
    // A failure posted before any rank fell silent is the one named.
    let store = client(server(quick_silence()));
    for r in 0..3 {
        store.beat(r, t).unwrap();
    }
    store.fail(1, "panicked", t).unwrap();
    for _ in 0..4 {
        std::thread::sleep(Duration::from_millis(100));
        store.beat(0, t).unwrap();
    }
    assert_eq!(
        store.health(0, silence, t).unwrap(),
        Some((1, "panicked".to_string()))
    );
}

#[test]
fn values_round_trip_and_get_waits_for_them() {
    let addr = server(super::LIMITS);
    let store = client(addr);
    let t = Duration::from_secs(5);
    assert_eq!(
        store.get("trace/1", Duration::from_millis(50)).unwrap(),
        None
    );
    let big: Vec<u8> = (0..=255u8).cycle().take(3 << 20).collect();
    store.put("trace/0", &big, t).unwrap();
    assert_eq!(store.get("trace/0", t).unwrap().as_deref(), Some(&big[..]));
    store.put("empty", &[], t).unwrap();
    assert_eq!(store.get("empty", t).unwrap(), Some(Vec::new()));
    // A get waits for a put from another thread.
    let later = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        client(addr).put("trace/1", b"{}", t).unwrap();
    });
    let start = Instant::now();
    assert_eq!(
        store.get("trace/1", t).unwrap().as_deref(),
        Some(&b"{}"[..])
    );
    assert!(start.elapsed() >= Duration::from_millis(90));
    later.join().unwrap();
}

#[test]
fn a_truncated_or_oversized_value_is_refused_and_the_store_keeps_serving() {
    let addr = server(limits(300));
    let mut session = auth();
    session.extend_from_slice(b"PUT 6b 10\nabc");
    let reply = raw(addr, &session, true);
    assert!(
        reply.contains("ERROR truncated value: 3 of 10 bytes"),
        "{reply}"
    );
    let mut session = auth();
    session.extend_from_slice(format!("PUT 6b {}\n", proto::MAX_VALUE + 1).as_bytes());
    let reply = raw(addr, &session, true);
    assert!(reply.contains("ERROR value length"), "{reply}");
    let store = client(addr);
    store.put("k", b"v", Duration::from_secs(5)).unwrap();
    assert_eq!(
        store.get("k", Duration::from_secs(1)).unwrap().as_deref(),
        Some(&b"v"[..])
    );
    // The store's total is bounded.
    let small = server(Limits {
        max_stored: 10,
        ..super::LIMITS
    });
    let e = client(small)
        .put("k", &[0; 11], Duration::from_secs(5))
        .unwrap_err();
    assert!(e.to_string().contains("full"), "{e}");
}

#[test]
fn inboxes_deliver_in_order_wait_and_are_bounded() {
    let addr = server(super::LIMITS);
    let store = client(addr);
    let t = Duration::from_secs(5);
    assert_eq!(store.inbox(1, Duration::from_millis(30)).unwrap(), None);
    store.mail(1, b"first", t).unwrap();
    store.mail(1, b"", t).unwrap();
    store.mail(2, b"other", t).unwrap();
    assert_eq!(store.inbox(1, t).unwrap().as_deref(), Some(&b"first"[..]));
    assert_eq!(store.inbox(1, t).unwrap(), Some(Vec::new()));
    assert_eq!(store.inbox(1, Duration::ZERO).unwrap(), None);
    assert_eq!(store.inbox(2, t).unwrap().as_deref(), Some(&b"other"[..]));
    // A read waits for a message mailed later by another client.
    let later = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        client(addr).mail(3, b"late", t).unwrap();
    });
    let start = Instant::now();
    assert_eq!(store.inbox(3, t).unwrap().as_deref(), Some(&b"late"[..]));
    assert!(start.elapsed() >= Duration::from_millis(90));
    later.join().unwrap();
    // Oversized or truncated messages are refused; the store goes on.
    let mut session = auth();
    session.extend_from_slice(format!("MAIL 0 {}\n", proto::MAX_MAIL + 1).as_bytes());
    let reply = raw(addr, &session, true);
    assert!(reply.contains("ERROR mail length"), "{reply}");
    let mut session = auth();
    session.extend_from_slice(b"MAIL 0 10\nabc");
    let reply = raw(addr, &session, true);
    assert!(reply.contains("ERROR truncated value"), "{reply}");
    // The inboxes together are bounded.
    let small = server(Limits {
        max_mail: 2,
        ..super::LIMITS
    });
    let small = client(small);
    small.mail(0, b"a", t).unwrap();
    small.mail(1, b"b", t).unwrap();
    let e = small.mail(0, b"c", t).unwrap_err();
    assert!(e.to_string().contains("too many messages"), "{e}");
    assert_eq!(small.inbox(0, t).unwrap().as_deref(), Some(&b"a"[..]));
    small.mail(0, b"c", t).unwrap();
}

#[test]
fn the_store_says_which_ranks_ended_in_one_request() {
    let addr = server(quick_silence());
    let store = client(addr);
    let t = Duration::from_secs(5);
    let silence = Duration::from_millis(300);
    assert_eq!(store.ended(silence, t).unwrap(), Vec::<duplex::Rank>::new());
    store.put("done/3", b"ok", t).unwrap();
    store.put("done/0", b"ok", t).unwrap();
    store.put("trace/1", b"{}", t).unwrap();
    // Only `done/RANK` says a rank finished, once however often stored.
    store.put("done/3", b"again", t).unwrap();
    store.put("done/x", b"ok", t).unwrap();
    store.put("undone/4", b"ok", t).unwrap();
    store.put("done/4/early", b"ok", t).unwrap();
    // Nor does a rank written otherwise than in plain decimal.
    store.put("done/+1", b"ok", t).unwrap();
    store.put("done/01", b"ok", t).unwrap();
    assert_eq!(store.ended(silence, t).unwrap(), vec![0, 3]);
    // Failed ranks have ended too, each once.
    store.fail(5, "panicked", t).unwrap();
    store.fail(2, "hang", t).unwrap();
    store.fail(3, "later", t).unwrap();
    assert_eq!(store.ended(silence, t).unwrap(), vec![0, 2, 3, 5]);
    // So have ranks silent past the silence asked for (killed, frozen),
    // every one of them; a rank that beats is alive.
    store.beat(7, t).unwrap();
    store.beat(8, t).unwrap();
    store.beat(3, t).unwrap();
    assert_eq!(store.ended(silence, t).unwrap(), vec![0, 2, 3, 5]);
    std::thread::sleep(silence + Duration::from_millis(100));
    store.beat(8, t).unwrap();
    assert_eq!(store.ended(silence, t).unwrap(), vec![0, 2, 3, 5, 7]);
    assert_eq!(
        store.ended(Duration::from_secs(60), t).unwrap(),
        vec![0, 2, 3, 5]
    );
}

#[test]
fn once_reached_a_store_that_refuses_connections_fails_at_once() {
    // Never reached: retried until the deadline (rank 0 may not listen yet).
    let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = gone.local_addr().unwrap().port();
    drop(gone);
    let fresh = Store::client("127.0.0.1", port, Secret::new("0123456789abcdef-x"));
    let t0 = Instant::now();
    assert!(
        fresh
            .connect(Instant::now() + Duration::from_millis(600))
            .is_err()
    );
    assert!(
        t0.elapsed() >= Duration::from_millis(550),
        "{:?}",
        t0.elapsed()
    );
    // Reached once, then its process is gone: refused means dead, at once.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let c = Store::client("127.0.0.1", port, Secret::new("0123456789abcdef-x"));
    c.connect(Instant::now() + Duration::from_secs(5)).unwrap();
    drop(listener);
    let t0 = Instant::now();
    let e = c
        .connect(Instant::now() + Duration::from_secs(5))
        .unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    assert!(e.to_string().contains("connecting to"), "{e}");
}

/// A clean finish stores four keys per rank (`done`, `counts`, `left` and
/// its trace): a job of 1,100 ranks fits under the default limits (4,096
/// keys did not: its last ranks' `done` was refused, and they were taken
/// for dead), and `KEYS` lists by prefix.
#[test]
fn a_thousand_ranks_finishing_fit_and_keys_list_by_prefix() {
    let addr = server(super::LIMITS);
    let store = client(addr);
    let t = Duration::from_secs(5);
    for r in 0..1100 {
        for key in ["done", "counts", "left", "trace"] {
            store.put(&format!("{key}/{r}"), b"ok", t).unwrap();
        }
    }
    store.put("owed/1/0", b"[]", t).unwrap();
    store.put("owed/1/12", b"[]", t).unwrap();
    store.put("owed/12/1", b"[]", t).unwrap();
    assert_eq!(store.keys("owed/1/", t).unwrap(), ["owed/1/0", "owed/1/12"]);
    assert_eq!(store.keys("owed/2/", t).unwrap(), Vec::<String>::new());
    assert_eq!(store.keys("done/109", t).unwrap().len(), 11);
    // Any bytes of a key survive the listing.
    store.put("odd key/é", b"", t).unwrap();
    assert_eq!(store.keys("odd", t).unwrap(), ["odd key/é"]);
    // An empty prefix is refused by the client, before any request.
    assert!(store.keys("", t).is_err());
}

/// A listing longer than the store allows (1 MiB) is refused with a reason,
/// and the store keeps serving.
#[test]
fn a_listing_too_long_is_refused_and_the_store_keeps_serving() {
    let addr = server(super::LIMITS);
    let store = client(addr);
    let t = Duration::from_secs(5);
    let long = "k".repeat(proto::MAX_KEY - 8);
    for i in 0..2100 {
        store.put(&format!("{long}{i:08}"), b"", t).unwrap();
    }
    let e = store.keys("k", t).expect_err("too long").to_string();
    assert!(e.contains("too many to list"), "{e}");
    assert_eq!(store.keys(&format!("{long}0000000"), t).unwrap().len(), 10);
}

/// The local address of the connection `c` keeps, if it keeps one.
fn kept_port(c: &Store) -> Option<u16> {
    let kept = c.kept.lock().unwrap();
    kept.last()
        .map(|(conn, _)| conn.local_addr().unwrap().port())
}

#[test]
fn a_client_keeps_its_connection_for_the_next_requests() {
    let addr = server(super::LIMITS);
    let c = client(addr);
    let t = Duration::from_secs(5);
    c.beat(0, t).unwrap();
    let first = kept_port(&c).expect("a connection kept");
    // Every kind of request, 100 times over: one connection, the same one.
    for i in 0..100u32 {
        c.beat(i % 4, t).unwrap();
        c.health(0, Duration::from_secs(3), t).unwrap();
        c.put(&format!("k{i}"), b"v", t).unwrap();
        assert_eq!(
            c.get(&format!("k{i}"), Duration::ZERO).unwrap().as_deref(),
            Some(&b"v"[..])
        );
        assert_eq!(c.get("absent", Duration::ZERO).unwrap(), None);
        c.mail(1, b"m", t).unwrap();
        assert_eq!(c.inbox(1, t).unwrap().as_deref(), Some(&b"m"[..]));
        assert_eq!(c.unique_id(t).unwrap(), ID);
    }
    assert_eq!(kept_port(&c), Some(first));
    assert_eq!(c.kept.lock().unwrap().len(), 1);
    // Threads sharing a client use a connection each, kept for later.
    let c = std::sync::Arc::new(c);
    let threads: Vec<_> = (0..3)
        .map(|r| {
            let c = c.clone();
            std::thread::spawn(move || {
                for _ in 0..50 {
                    c.beat(r, t).unwrap();
                    assert_eq!(
                        c.get("k1", Duration::ZERO).unwrap().as_deref(),
                        Some(&b"v"[..])
                    );
                }
            })
        })
        .collect();
    for th in threads {
        th.join().unwrap();
    }
    let kept = c.kept.lock().unwrap().len();
    assert!((1..=super::KEPT).contains(&kept), "{kept}");
}

/// Waits until the store has closed the connection `c` kept last.
fn closed_by_store(c: &Store) {
    let conn = c
        .kept
        .lock()
        .unwrap()
        .last()
        .expect("kept")
        .0
        .try_clone()
        .unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    assert_eq!(conn.peek(&mut [0u8; 1]).unwrap(), 0, "closed by the store");
}

#[test]
fn a_kept_connection_the_store_closed_is_replaced_and_the_request_served_once() {
    // The store closes a connection quiet for its I/O timeout (200 ms
    // here); the client, keeping it up to 5 s, finds it closed and sends
    // the request on a new one: each message is posted once.
    let addr = server(limits(200));
    let c = client(addr);
    let t = Duration::from_secs(5);
    for round in 0..5 {
        c.post(0, 1, "x").unwrap();
        let before = kept_port(&c).expect("kept");
        closed_by_store(&c);
        c.post(0, 1, "x").unwrap();
        assert_ne!(
            kept_port(&c),
            Some(before),
            "round {round}: a new connection"
        );
        c.mail(2, b"once", t).unwrap();
        closed_by_store(&c);
        assert_eq!(c.inbox(2, t).unwrap().as_deref(), Some(&b"once"[..]));
        assert_eq!(c.inbox(2, Duration::ZERO).unwrap(), None, "round {round}");
    }
    for _ in 0..10 {
        assert!(c.take(0, 1, "x", Duration::ZERO).unwrap());
    }
    assert!(
        !c.take(0, 1, "x", Duration::ZERO).unwrap(),
        "posted once each"
    );
}

/// As a store would, accepts a connection on `listener` and answers its
/// `AUTH` and one request `OK`; the connection, still open.
fn answer_auth_and_one(listener: &TcpListener) -> TcpStream {
    let (conn, _) = listener.accept().unwrap();
    let mut reader = std::io::BufReader::new(&conn);
    for _ in 0..2 {
        let line = proto::read_line(&mut reader).unwrap();
        assert!(!line.is_empty());
        (&conn).write_all(b"OK\n").unwrap();
    }
    conn
}

#[test]
fn a_kept_connection_to_a_store_that_is_gone_fails_the_request_at_once() {
    // A store that answers `AUTH` and one request, then its process is
    // gone (its connections closed, nothing listening): the next request
    // finds its kept connection closed, and a new one refused.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let fake = std::thread::spawn(move || {
        let _conn = answer_auth_and_one(&listener);
        // The listener and the connection close together.
    });
    let c = Store::client("127.0.0.1", port, secret());
    c.beat(0, Duration::from_secs(5)).unwrap();
    fake.join().unwrap();
    let t0 = Instant::now();
    let e = c.beat(0, Duration::from_secs(5)).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    assert!(e.to_string().contains("connecting to"), "{e}");
}

#[test]
fn the_store_serves_no_more_connections_than_the_open_files_allow() {
    use super::connections_within;
    assert_eq!(connections_within(None), super::LIMITS.max_connections);
    assert_eq!(connections_within(Some(1024)), 768);
    assert_eq!(connections_within(Some(100)), 64);
    assert_eq!(connections_within(Some(1 << 20)), 1 << 14);
    // The soft limit is raised as far as the store needs, within the hard
    // one, and never lowered.
    let files = super::raise_file_limit().expect("readable");
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid rlimit to write.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    assert_eq!(files, lim.rlim_cur);
    assert!(lim.rlim_cur >= (super::LIMITS.max_connections as u64 + 1024).min(lim.rlim_max));
    assert_eq!(super::raise_file_limit(), Some(files), "raised once");
}

#[test]
fn a_request_that_times_out_drops_the_kept_connections() {
    // A store that answers on one connection and never on a second (its
    // process frozen as the second came): a request on the second times
    // out, and the client keeps neither for the next (each would wait as
    // long again).
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let fake = std::thread::spawn(move || {
        let _answered = answer_auth_and_one(&listener);
        let (_silent, _) = listener.accept().unwrap();
        let _ = rx.recv();
    });
    let c = Store::client("127.0.0.1", port, secret());
    c.beat(0, Duration::from_secs(5)).unwrap();
    // A second kept connection, as another thread's would be; used first.
    let second = TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.kept.lock().unwrap().push((second, Instant::now()));
    assert_eq!(c.kept.lock().unwrap().len(), 2);
    let t0 = Instant::now();
    assert!(c.beat(0, Duration::from_millis(200)).is_err());
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(
        c.kept.lock().unwrap().is_empty(),
        "a timed-out store's connections are dropped"
    );
    tx.send(()).unwrap();
    fake.join().unwrap();
}

#[test]
fn health_finds_the_silent_ranks_in_its_beat_order() {
    use std::time::Instant;
    let mut h = super::Health::default();
    let Some(t0) = Instant::now().checked_sub(Duration::from_secs(10)) else {
        eprintln!("skipped: this machine's clock began less than 10 s ago");
        return;
    };
    let at = |s: u64| t0 + Duration::from_secs(s);
    h.beat(5, at(0));
    h.beat(2, at(0));
    h.beat(9, at(1));
    h.beat(4, at(2));
    let silent = |h: &super::Health, me, s| {
        h.silent(me, Duration::from_millis(s))
            .map(|(r, _)| r)
            .collect::<Vec<_>>()
    };
    // Longest silent first, the lower rank first among equals.
    assert_eq!(silent(&h, None, 0), vec![2, 5, 9, 4]);
    assert_eq!(silent(&h, Some(2), 0), vec![5, 9, 4]);
    // Silent past 8.5 s: only those that beat 10 and 9 s ago.
    assert_eq!(silent(&h, None, 8_500), vec![2, 5, 9]);
    assert_eq!(silent(&h, None, 9_500), vec![2, 5]);
    assert_eq!(silent(&h, None, 60_000), Vec::<u32>::new());
    // A rank that beats again is not silent; one that finished never is,
    // whatever it does after.
    h.beat(2, at(5));
    h.finish(5);
    assert_eq!(silent(&h, None, 0), vec![9, 4, 2]);
    h.beat(5, at(0));
    h.finish(5);
    assert_eq!(silent(&h, None, 0), vec![9, 4, 2]);
    // A rank that finished before it ever beat.
    h.finish(11);
    h.beat(11, at(0));
    assert_eq!(silent(&h, None, 0), vec![9, 4, 2]);
    // Every rank that beats and has not finished is in the order once.
    assert_eq!(h.by_beat.len(), 3);
    assert_eq!(h.beats.len(), 5);
}

#[test]
fn the_store_queues_a_job_of_connects_at_once() {
    // With std's queue of 128, connects past it are dropped until the
    // store accepts: a job's ranks connecting at once waited a second or
    // more each. Nothing accepts here, so the queue alone holds them.
    let cap: usize = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let n = cap.min(400);
    if n <= 200 {
        eprintln!("skipped: net.core.somaxconn is {cap}, which no listener can pass");
        return;
    }
    let connects = |l: &TcpListener, n: usize| -> usize {
        let at = l.local_addr().unwrap();
        let mut held = Vec::new();
        for _ in 0..n {
            match TcpStream::connect_timeout(&at, Duration::from_millis(1500)) {
                Ok(c) => held.push(c),
                Err(_) => break,
            }
        }
        held.len()
    };
    // What std's queue holds here (a system that queues past it, unlike
    // Linux, shows nothing either way).
    let narrow = TcpListener::bind("127.0.0.1:0").unwrap();
    eprintln!(
        "std's queue of 128 held {} of {n} connects",
        connects(&narrow, n)
    );
    let wide = TcpListener::bind("127.0.0.1:0").unwrap();
    assert_eq!(super::widen_backlog(&wide), Some(cap.min(1 << 16) as u32));
    assert_eq!(connects(&wide, n), n);
}

/// A store (or whatever answers at its address) that sends its reply a
/// byte at a time cannot hold a request past its timeout: the client's
/// reads share one deadline, not a timeout each.
#[test]
fn a_reply_sent_a_byte_at_a_time_ends_at_the_requests_deadline() {
    use std::io::{BufRead, BufReader};
    let listener = TcpListener::bind("127.0.0.1:0").expect("binds");
    let port = listener.local_addr().expect("an address").port();
    std::thread::spawn(move || {
        let Ok((c, _)) = listener.accept() else {
            return;
        };
        let mut r = BufReader::new(c.try_clone().expect("clones"));
        let mut w = c;
        let mut line = String::new();
        let _ = r.read_line(&mut line); // AUTH
        let _ = w.write_all(b"OK\n");
        line.clear();
        let _ = r.read_line(&mut line); // HEALTH
        for b in b"HEALTHY\n" {
            if w.write_all(&[*b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(700));
        }
    });
    let c = Store::client("127.0.0.1", port, secret());
    let t = Instant::now();
    let r = c.health(1, Duration::from_secs(3), Duration::from_secs(1));
    let took = t.elapsed();
    assert!(
        r.is_err(),
        "a reply cut off by the deadline is no answer: {r:?}"
    );
    // The request's second, and the exchange's second of grace.
    assert!(took < Duration::from_millis(3_000), "took {took:?}");
}

/// The bytes of `PUT` bodies still being read count against the store's
/// limit before they are read: a second body that would not fit beside
/// one in flight is refused at once, not read into memory first.
#[test]
fn put_bodies_in_flight_count_against_the_stores_limit() {
    let addr = server(Limits {
        max_stored: 1 << 20,
        ..limits(5_000)
    });
    let put = |key: &str, len: usize| {
        proto::encode_request(&Request::Put {
            key: key.into(),
            len,
        })
        .unwrap()
    };
    // A body of 800 KB, held one byte short.
    let mut first = TcpStream::connect(addr).unwrap();
    first.write_all(&auth()).unwrap();
    first.write_all(&put("a", 800_000)).unwrap();
    first.write_all(&vec![7u8; 799_999]).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    // A second that would not fit beside it: refused, its body read and
    // dropped (none of it kept), and the refusal read by its client.
    let mut second = auth();
    second.extend(put("b", 800_000));
    second.extend(vec![0u8; 800_000]);
    let reply = raw(addr, &second, false);
    assert!(reply.contains("full"), "{reply}");
    let e = client(addr)
        .put("b", &vec![0u8; 8 << 20], Duration::from_secs(5))
        .unwrap_err();
    assert!(
        e.to_string().contains("the store is full"),
        "the client reads the refusal, not a broken pipe: {e}"
    );
    // A small one fits beside it.
    client(addr)
        .put("c", &[1; 100], Duration::from_secs(5))
        .expect("fits");
    // The first completes and is stored; its room is then its value's.
    first.write_all(&[7]).unwrap();
    first
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    // The AUTH's reply, then the PUT's.
    let mut reply = [0u8; 6];
    first.read_exact(&mut reply).unwrap();
    assert_eq!(&reply, b"OK\nOK\n");
    let store = client(addr);
    assert_eq!(
        store
            .get("a", Duration::from_secs(1))
            .unwrap()
            .map(|v| v.len()),
        Some(800_000)
    );
    // Replacing a value frees its room first.
    store
        .put("a", &vec![2; 900_000], Duration::from_secs(5))
        .expect("replaces");
}

/// A store that answers only `ERROR busy` for longer than the health
/// monitor's silence (its places all taken) is alive: its host, rank 0, is
/// not taken for dead.
#[test]
fn a_store_busy_past_the_silence_is_not_taken_for_dead() {
    let addr = server(Limits {
        max_connections: 1,
        ..limits(60_000)
    });
    let held = authenticated(addr);
    let h = crate::health::StoreHealth::start(client(addr), 1);
    std::thread::sleep(crate::health::SILENCE + Duration::from_secs(2));
    assert_eq!(crate::health::Health::failed(&*h, 1), None);
    drop(held);
}

/// A store that says it is busy is asked again until the request's
/// deadline: a rank that connects while its host's other ranks do, or
/// while the store's places are taken for a moment, is served once one is
/// free; past the deadline it is told why, and what to look at.
#[test]
fn a_busy_store_is_asked_again_until_the_deadline() {
    let addr = server(Limits {
        max_connections: 1,
        ..limits(700)
    });
    let held = authenticated(addr);
    // Past a short deadline: told why.
    let e = client(addr)
        .unique_id(Duration::from_millis(200))
        .unwrap_err();
    assert!(
        e.to_string().contains("until the request's deadline") && e.to_string().contains("busy"),
        "{e}"
    );
    // Within a longer one: served once the idle connection is closed.
    let t = Instant::now();
    assert_eq!(client(addr).unique_id(Duration::from_secs(5)).unwrap(), ID);
    assert!(
        t.elapsed() >= Duration::from_millis(200),
        "{:?}",
        t.elapsed()
    );
    drop(held);
}

/// A connection past its `AUTH` that sent `request`, a wait, and is then
/// closed before any reply: its client left mid-wait.
fn leave_during(addr: SocketAddr, request: &Request) {
    let mut c = authenticated(addr);
    c.write_all(&proto::encode_request(request).unwrap())
        .unwrap();
    // The store has read the request and is waiting.
    std::thread::sleep(Duration::from_millis(100));
    drop(c);
}

/// A `TAKE` whose client closed the connection mid-wait takes nothing: a
/// notify posted after it left is there for the next `TAKE`, where the
/// store used to keep waiting for the whole wait, take the notify when it
/// came, and lose it in a reply to nobody.
#[test]
fn a_wait_whose_client_left_takes_nothing() {
    let addr = server(super::LIMITS);
    leave_during(
        addr,
        &Request::Take {
            from: 0,
            to: 1,
            tag: "t".into(),
            wait_ms: 60_000,
        },
    );
    // Past a look or two of the store at the connection.
    std::thread::sleep(3 * super::GONE_EVERY);
    let c = client(addr);
    c.post(0, 1, "t").unwrap();
    assert!(
        c.take(0, 1, "t", Duration::ZERO).unwrap(),
        "the notify went to the client that left"
    );
    // A message in an inbox, likewise.
    leave_during(
        addr,
        &Request::Inbox {
            me: 3,
            wait_ms: 60_000,
        },
    );
    std::thread::sleep(3 * super::GONE_EVERY);
    c.mail(3, b"kept", Duration::from_secs(5)).unwrap();
    assert_eq!(
        c.inbox(3, Duration::ZERO).unwrap().as_deref(),
        Some(&b"kept"[..])
    );
}

/// A connection whose client left mid-wait gives its place back within a
/// look or two, not at the end of its wait: with one place, the next
/// client is served.
#[test]
fn a_wait_whose_client_left_gives_its_place_back() {
    let addr = server(Limits {
        max_connections: 1,
        ..super::LIMITS
    });
    leave_during(
        addr,
        &Request::Get {
            key: "never".into(),
            wait_ms: 60_000,
        },
    );
    let start = Instant::now();
    let id = client(addr).unique_id(Duration::from_secs(5));
    assert_eq!(id.unwrap(), ID, "served after {:?}", start.elapsed());
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
}

/// A client that waits and stays is not taken for one that left: its wait
/// runs past many looks and ends with what it waited for.
#[test]
fn a_client_that_stays_keeps_waiting() {
    let addr = server(super::LIMITS);
    let later = std::thread::spawn(move || {
        std::thread::sleep(5 * super::GONE_EVERY);
        client(addr).post(0, 1, "late").unwrap();
    });
    assert!(
        client(addr)
            .take(0, 1, "late", Duration::from_secs(10))
            .unwrap()
    );
    later.join().unwrap();
}

/// A silence shorter than the store's least is asked as that least: one
/// client asking with a silence of 0 does not mark every live rank failed
/// for every asker (a silence found is recorded for all).
#[test]
fn a_silence_below_the_least_does_not_fail_live_ranks() {
    let store = client(server(super::LIMITS));
    let t = Duration::from_secs(5);
    for r in 0..3 {
        store.beat(r, t).unwrap();
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(store.health(0, Duration::ZERO, t).unwrap(), None);
    assert_eq!(store.health(1, Duration::from_millis(10), t).unwrap(), None);
    assert_eq!(
        store.ended(Duration::ZERO, t).unwrap(),
        Vec::<duplex::Rank>::new()
    );
}

/// A connection that asks for `key` (`AUTH`, then `GET`) and reads
/// nothing yet: the store's reply waits on it.
fn get_unread(addr: SocketAddr, key: &str) -> TcpStream {
    let mut c = TcpStream::connect(addr).unwrap();
    let mut session = auth();
    session.extend(
        proto::encode_request(&Request::Get {
            key: key.into(),
            wait_ms: 0,
        })
        .unwrap(),
    );
    c.write_all(&session).unwrap();
    c
}

/// A reply goes out within the I/O timeout as a whole: a client that
/// reads a 16 MiB value slowly does not hold the connection's thread (and
/// the value) past it, though each of its reads comes within the timeout.
#[test]
fn a_slow_reader_is_cut_off_at_the_reply_deadline() {
    let addr = server(limits(300));
    let store = client(addr);
    let big = vec![7u8; proto::MAX_VALUE];
    store.put("big", &big, Duration::from_secs(5)).unwrap();
    let mut c = get_unread(addr, "big");
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // Reads of 64 KiB every 100 ms: each within the timeout, the whole
    // far past it (16 MiB would take 25 s).
    let start = Instant::now();
    let mut got = 0usize;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        std::thread::sleep(Duration::from_millis(100));
        match c.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
        assert!(start.elapsed() < Duration::from_secs(20), "still sending");
    }
    assert!(got < big.len(), "the whole value came: {got} bytes");
    // The store goes on.
    assert_eq!(store.unique_id(Duration::from_secs(5)).unwrap(), ID);
}

/// A store that holds 40 MiB, room for two 16 MiB values and not three,
/// whose I/O timeout (5 s) outlasts a test's slow replies.
fn store_of_40_mib() -> SocketAddr {
    server(Limits {
        max_stored: 40 << 20,
        io_timeout: Duration::from_secs(5),
        ..super::LIMITS
    })
}

/// A value replaced while a reply is sending it still counts against the
/// store's limit until the reply lets go of it: replies in flight cannot
/// hold more than the limit.
#[test]
fn a_replaced_value_a_reply_holds_counts_against_the_limit() {
    let mib = 1 << 20;
    let addr = store_of_40_mib();
    let store = client(addr);
    let t = Duration::from_secs(5);
    let value = vec![1u8; 16 * mib];
    store.put("a", &value, t).unwrap();
    // A GET that reads nothing: the reply blocks with most of the value
    // unsent (more than the sockets' buffers hold), holding it.
    let slow = get_unread(addr, "a");
    std::thread::sleep(Duration::from_millis(300));
    // Replaced: 16 MiB stored, 16 MiB retired.
    store.put("a", &value, t).unwrap();
    let e = store.put("b", &value, t).unwrap_err();
    assert!(e.to_string().contains("full"), "{e}");
    // Once the reply is gone, its bytes are free again.
    drop(slow);
    let start = Instant::now();
    while store.put("b", &value, t).is_err() {
        assert!(start.elapsed() < Duration::from_secs(10), "never freed");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Two `PUT`s of one key in flight at once: the value they replace counts
/// as freed for one of them only (each was credited with it, so together
/// they could pass the limit by a value).
#[test]
fn two_puts_of_one_key_at_once_are_credited_its_old_value_once() {
    let mib = 1 << 20;
    let addr = store_of_40_mib();
    let store = client(addr);
    let value = vec![3u8; 16 * mib];
    store.put("k", &value, Duration::from_secs(5)).unwrap();
    let put_line = proto::encode_request(&Request::Put {
        key: "k".into(),
        len: value.len(),
    })
    .unwrap();
    // The first holds its room: its line sent, its body not yet.
    let mut first = TcpStream::connect(addr).unwrap();
    let mut session = auth();
    session.extend(&put_line);
    first.write_all(&session).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // The second, body and all: 16 MiB stored, 16 MiB reserved by the
    // first (which frees the old value), 16 MiB more passes 40 MiB.
    let mut second = auth();
    second.extend(&put_line);
    second.extend(&value);
    let reply = raw(addr, &second, true);
    assert!(reply.contains("ERROR") && reply.contains("full"), "{reply}");
    // The first, finished, replaces the value.
    first.write_all(&value).unwrap();
    first.shutdown(Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    first.read_to_end(&mut rest).unwrap();
    assert!(String::from_utf8_lossy(&rest).contains("OK"), "{rest:?}");
    assert_eq!(
        store
            .get("k", Duration::from_secs(1))
            .unwrap()
            .map(|v| v.len()),
        Some(value.len())
    );
}

/// Traces fill the store to three quarters of its limit at most, the
/// end-of-job values fill the rest, and a rank's mark that it finished
/// (`done/RANK`) is taken whatever the store holds: a full store refused
/// it, and the rank, silent once it exited, was taken for killed (found by
/// review).
#[test]
fn a_full_store_still_takes_a_ranks_finish_mark() {
    let kib = 1 << 10;
    let store = client(server(Limits {
        max_stored: 1024 * kib,
        ..quick_silence()
    }));
    let t = Duration::from_secs(5);
    store.put("trace/0", &vec![0u8; 700 * kib], t).unwrap();
    let e = store.put("trace/1", &vec![0u8; 100 * kib], t).unwrap_err();
    assert!(e.to_string().contains("full"), "{e}");
    // The end-of-job values have the last quarter: filled to 4 bytes
    // short of the limit (a key's bytes count with its value's).
    let rest = 1024 * kib - 4 - ("trace/0".len() + 700 * kib) - "counts/0".len();
    store.put("counts/0", &vec![0u8; rest], t).unwrap();
    let e = store.put("counts/1", &vec![0u8; 100 * kib], t).unwrap_err();
    assert!(e.to_string().contains("full"), "{e}");
    // Full: the finish mark is still taken, and the rank counts as
    // finished, not as failed, once it falls silent.
    store.beat(1, t).unwrap();
    store.put("done/1", b"ok", t).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        store.health(0, Duration::from_millis(100), t).unwrap(),
        None
    );
    assert_eq!(store.ended(Duration::from_millis(100), t).unwrap(), vec![1]);
    // Only a mark: a bigger value under `done/` is no exception.
    let e = store.put("done/2", &vec![0u8; 100 * kib], t).unwrap_err();
    assert!(e.to_string().contains("full"), "{e}");
}
