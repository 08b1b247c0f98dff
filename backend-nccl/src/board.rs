//! Host-to-host messages (`notify`/`await_notify`) and the rendezvous of
//! one-process-per-rank runs: an in-process board for local runs, and a
//! small TCP store served by rank 0 for runs under torchrun, Slurm or mpirun.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use duplex::{Error, Rank};

/// Where `notify` messages wait for their `await_notify`.
pub trait Board: Send + Sync + std::fmt::Debug {
    /// Posts a message from `from` to `to` with `tag`.
    fn post(&self, from: Rank, to: Rank, tag: &str) -> Result<(), Error>;
    /// Takes one message from `from` to `to` with `tag`, waiting up to
    /// `timeout`; false when none came.
    fn take(&self, from: Rank, to: Rank, tag: &str, timeout: Duration) -> Result<bool, Error>;
}

/// The board of a local run: counters under a mutex.
#[derive(Debug, Default)]
pub struct LocalBoard {
    counts: Mutex<HashMap<(Rank, Rank, String), u64>>,
    arrived: Condvar,
}

impl LocalBoard {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(Rank, Rank, String), u64>> {
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Board for LocalBoard {
    fn post(&self, from: Rank, to: Rank, tag: &str) -> Result<(), Error> {
        *self.lock().entry((from, to, tag.to_string())).or_insert(0) += 1;
        self.arrived.notify_all();
        Ok(())
    }

    fn take(&self, from: Rank, to: Rank, tag: &str, timeout: Duration) -> Result<bool, Error> {
        let deadline = Instant::now() + timeout;
        let key = (from, to, tag.to_string());
        let mut counts = self.lock();
        loop {
            if let Some(n) = counts.get_mut(&key)
                && *n > 0
            {
                *n -= 1;
                return Ok(true);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            counts = self
                .arrived
                .wait_timeout(counts, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }
}

fn io(what: &str, e: std::io::Error) -> Error {
    Error::Unavailable {
        what: format!("the duplex rendezvous ({what})"),
        how: format!(
            "{e}; check MASTER_ADDR and MASTER_PORT (duplex listens on MASTER_PORT+1, or DUPLEX_PORT) and that rank 0 is running"
        ),
    }
}

/// The TCP store served by rank 0: the NCCL unique id and the message board.
#[derive(Debug)]
pub struct Store {
    addr: String,
}

#[derive(Debug, Default)]
struct StoreState {
    counts: HashMap<String, u64>,
}

impl Store {
    /// Serves the store on `port` (all interfaces) in a background thread,
    /// handing out `id` (hex) to every rank.
    pub fn serve(port: u16, id: String) -> Result<(), Error> {
        let listener = TcpListener::bind(("0.0.0.0", port))
            .map_err(|e| io(&format!("listening on port {port}"), e))?;
        let state = Arc::new((Mutex::new(StoreState::default()), Condvar::new()));
        std::thread::Builder::new()
            .name("duplex-store".into())
            .spawn(move || {
                for conn in listener.incoming().flatten() {
                    let (state, id) = (state.clone(), id.clone());
                    let _ = std::thread::Builder::new()
                        .name("duplex-store-conn".into())
                        .spawn(move || {
                            let _ = handle(conn, &state, &id);
                        });
                }
            })
            .map_err(|e| io("starting the store thread", e))?;
        Ok(())
    }

    /// A client of the store at `addr` (`host:port`).
    pub fn client(addr: String) -> Store {
        Store { addr }
    }

    fn request(&self, line: &str, timeout: Duration) -> Result<String, Error> {
        let deadline = Instant::now() + timeout;
        let mut last = None;
        // Rank 0 may not be listening yet: retry until the deadline.
        let mut conn = loop {
            let addrs = self
                .addr
                .to_socket_addrs()
                .map_err(|e| io(&format!("resolving {}", self.addr), e))?;
            let mut connected = None;
            for a in addrs {
                match TcpStream::connect_timeout(&a, Duration::from_millis(500)) {
                    Ok(c) => {
                        connected = Some(c);
                        break;
                    }
                    Err(e) => last = Some(e),
                }
            }
            if let Some(c) = connected {
                break c;
            }
            if Instant::now() >= deadline {
                return Err(io(
                    &format!("connecting to {}", self.addr),
                    last.unwrap_or_else(|| std::io::Error::other("no address")),
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let remaining = deadline.saturating_duration_since(Instant::now()) + Duration::from_secs(1);
        conn.set_read_timeout(Some(remaining))
            .map_err(|e| io("configuring a connection", e))?;
        conn.write_all(format!("{line}\n").as_bytes())
            .map_err(|e| io("sending a request", e))?;
        let mut reply = String::new();
        BufReader::new(conn)
            .read_line(&mut reply)
            .map_err(|e| io("reading a reply", e))?;
        Ok(reply.trim().to_string())
    }

    /// The NCCL unique id rank 0 generated.
    pub fn unique_id(&self, timeout: Duration) -> Result<String, Error> {
        self.request("ID", timeout)
    }
}

fn handle(conn: TcpStream, state: &(Mutex<StoreState>, Condvar), id: &str) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let reply = match words.as_slice() {
        ["ID"] => id.to_string(),
        ["POST", key] => {
            let mut s = state.0.lock().unwrap_or_else(|e| e.into_inner());
            *s.counts.entry((*key).to_string()).or_insert(0) += 1;
            state.1.notify_all();
            "OK".into()
        }
        ["TAKE", key, ms] => {
            let timeout = Duration::from_millis(ms.parse().unwrap_or(0));
            let deadline = Instant::now() + timeout;
            let mut s = state.0.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(n) = s.counts.get_mut(*key)
                    && *n > 0
                {
                    *n -= 1;
                    break "OK".into();
                }
                let now = Instant::now();
                if now >= deadline {
                    break "TIMEOUT".into();
                }
                s = state
                    .1
                    .wait_timeout(s, deadline - now)
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0);
            }
        }
        _ => "ERROR unknown request".into(),
    };
    let mut conn = conn;
    conn.write_all(format!("{reply}\n").as_bytes())
}

fn key(from: Rank, to: Rank, tag: &str) -> String {
    let tag: String = tag
        .chars()
        .map(|c| if c.is_whitespace() { '_' } else { c })
        .collect();
    format!("{from}/{to}/{tag}")
}

impl Board for Store {
    fn post(&self, from: Rank, to: Rank, tag: &str) -> Result<(), Error> {
        match self
            .request(
                &format!("POST {}", key(from, to, tag)),
                Duration::from_secs(30),
            )?
            .as_str()
        {
            "OK" => Ok(()),
            other => Err(Error::Aborted(format!(
                "the store refused a notify: {other}"
            ))),
        }
    }

    fn take(&self, from: Rank, to: Rank, tag: &str, timeout: Duration) -> Result<bool, Error> {
        let ms = timeout.as_millis();
        match self
            .request(
                &format!("TAKE {} {ms}", key(from, to, tag)),
                timeout + Duration::from_secs(5),
            )?
            .as_str()
        {
            "OK" => Ok(true),
            "TIMEOUT" => Ok(false),
            other => Err(Error::Aborted(format!(
                "the store refused an await: {other}"
            ))),
        }
    }
}

/// Hex text of bytes.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Bytes of hex text.
pub fn unhex(text: &str) -> Option<Vec<u8>> {
    if text.len() % 2 != 0 {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_local_board_counts_messages_and_times_out() {
        let b = LocalBoard::default();
        b.post(0, 1, "meta").unwrap();
        b.post(0, 1, "meta").unwrap();
        assert!(b.take(0, 1, "meta", Duration::ZERO).unwrap());
        assert!(b.take(0, 1, "meta", Duration::ZERO).unwrap());
        let t = Instant::now();
        assert!(!b.take(0, 1, "meta", Duration::from_millis(30)).unwrap());
        assert!(t.elapsed() >= Duration::from_millis(30));
        assert!(
            !b.take(1, 0, "meta", Duration::ZERO).unwrap(),
            "direction matters"
        );
    }

    #[test]
    fn the_tcp_store_hands_out_the_id_and_carries_messages_between_processes() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        Store::serve(port, "abcd".into()).unwrap();
        let client = Store::client(format!("127.0.0.1:{port}"));
        assert_eq!(client.unique_id(Duration::from_secs(5)).unwrap(), "abcd");
        let waiter = std::thread::spawn(move || {
            let c = Store::client(format!("127.0.0.1:{port}"));
            c.take(0, 1, "go", Duration::from_secs(5)).unwrap()
        });
        std::thread::sleep(Duration::from_millis(50));
        client.post(0, 1, "go").unwrap();
        assert!(waiter.join().unwrap());
        assert!(!client.take(0, 1, "go", Duration::from_millis(20)).unwrap());
    }

    #[test]
    fn an_unreachable_store_says_what_to_check() {
        let c = Store::client("127.0.0.1:1".into());
        let e = c
            .unique_id(Duration::from_millis(200))
            .unwrap_err()
            .to_string();
        assert!(e.contains("MASTER_ADDR"), "{e}");
    }

    #[test]
    fn hex_round_trips() {
        let b: Vec<u8> = (0..=255).collect();
        assert_eq!(unhex(&hex(&b)).unwrap(), b);
        assert!(unhex("abc").is_none());
        assert!(unhex("zz").is_none());
    }
}
