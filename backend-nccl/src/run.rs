//! Running rank code: [`Local`] drives several GPUs from one process with a
//! thread per rank; [`Process`] is one rank of a one-process-per-rank job
//! (torchrun, Slurm, mpirun), configured from the environment.

use std::sync::Arc;
use std::time::{Duration, Instant};

use duplex::{Error, Model, Policy, Rank, Result, Transport};

use crate::board::{Board, LocalBoard};
use crate::comm;
use crate::ctx::{LaneCost, Options, RankCtx, RankSetup, panic_text};
use crate::cuda::{self, Device};
use crate::health::{Health, LocalHealth, SILENCE, StoreHealth};
use crate::nccl::sys::{NCCL_UNIQUE_ID_BYTES, ncclUniqueId};
use crate::nccl::{Nccl, nccl};
use crate::rank::NcclRank;
use crate::registry::Registry;
use crate::store::{Secret, Store, secret_from_env};

/// What a rank's run reports besides its result.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RankReport {
    /// The rank.
    pub rank: Rank,
    /// Setup time (world communicator, lanes, connections), milliseconds.
    pub setup_ms: f64,
    /// What each lane cost.
    pub lanes: Vec<LaneCost>,
    /// A call of the run that duplex's live model refused, in words: the
    /// model and NCCL disagree there, which is a bug of duplex's to report
    /// (the run's bytes were checked all the same). `None` when the model
    /// took every call.
    pub model_refused: Option<String>,
}

/// The default settings, with `DUPLEX_TIMEOUT_MS` (the deadline of every
/// wait, in milliseconds, at least 1), `DUPLEX_LANES` (`eager` or `lazy`)
/// and `DUPLEX_LANE_CONNECT` (`both` or `one-way`) read from the
/// environment; a value that does not parse is an error naming the
/// variable, not a silent default.
fn options_from_env() -> Result<Options> {
    /// The setting in variable `name`, if set; an error naming it if it
    /// does not parse.
    fn setting<T: std::str::FromStr<Err = String>>(name: &str) -> Result<Option<T>> {
        let Some(v) = optional_env(name)? else {
            return Ok(None);
        };
        v.parse().map(Some).map_err(|message| Error::Invalid {
            at: name.into(),
            message,
        })
    }
    let mut opts = Options::default();
    if let Some(ms) = setting::<TimeoutMs>("DUPLEX_TIMEOUT_MS")? {
        opts.timeout = Duration::from_millis(ms.0);
    }
    if let Some(mode) = setting("DUPLEX_LANES")? {
        opts.lanes = mode;
    }
    if let Some(connect) = setting("DUPLEX_LANE_CONNECT")? {
        opts.lane_connect = connect;
    }
    Ok(opts)
}

/// `DUPLEX_TIMEOUT_MS`: a whole number of milliseconds, at least 1.
struct TimeoutMs(u64);

impl std::str::FromStr for TimeoutMs {
    type Err = String;

    fn from_str(v: &str) -> std::result::Result<TimeoutMs, String> {
        match duplex::positive_count(v) {
            Some(ms) => Ok(TimeoutMs(ms)),
            None => Err(format!(
                "`{v}` is not a deadline: give a whole number of milliseconds, at least 1 (the default is 10000)"
            )),
        }
    }
}

/// How a run's placement and lane settings are written in the store
/// (`job/lanes`), which every rank must share: the policy (ranks placing
/// one message on different communicators wait for each other forever),
/// when lanes are made (a rank that splits every lane at start waits for
/// ranks that never split), how they connect, and the size from which a
/// message goes by the copy engines (C1: each end chooses by its own
/// threshold, so a message between two thresholds went by copy at one end
/// and by NCCL at the other, and both waited; found by review).
fn lanes_word(policy: Policy, opts: &Options) -> String {
    let mode = opts.lanes;
    let connect = match opts.lane_connect {
        crate::LaneConnect::Both => "connected both ways",
        crate::LaneConnect::OneWay => "connected one way",
    };
    let copy = match opts.copy_from {
        Some(b) => format!("copy-engine lanes from {}", duplex::Size(b)),
        None => "no copy-engine lanes".into(),
    };
    format!("policy {policy:?}, lanes {mode}, {connect}, {copy}")
}

/// Settings shared by both runners.
#[derive(Clone, Debug)]
struct Settings {
    policy: Policy,
    opts: Options,
}

macro_rules! builder {
    () => {
        /// Places ops without a [`duplex::Place`] by `policy`.
        pub fn policy(mut self, policy: Policy) -> Self {
            self.settings.policy = policy;
            self
        }

        /// The deadline of every wait (default 10 s or `DUPLEX_TIMEOUT_MS`).
        pub fn timeout(mut self, timeout: Duration) -> Self {
            self.settings.opts.timeout = timeout;
            self
        }

        /// Connects the world communicator, shared lanes and user
        /// communicators at creation (`lazy-connect=off`).
        pub fn warm(mut self, warm: bool) -> Self {
            self.settings.opts.warm = warm;
            self
        }

        /// When lanes are made: all at creation ([`crate::LaneMode::Eager`],
        /// the default, or `DUPLEX_LANES=eager`), or each by its two ranks'
        /// lane services when first needed ([`crate::LaneMode::Lazy`],
        /// `DUPLEX_LANES=lazy`; [`crate::lanes`]).
        pub fn lanes(mut self, mode: crate::LaneMode) -> Self {
            self.settings.opts.lanes = mode;
            self
        }

        /// Which directions of a per-direction lane are connected before
        /// its first op: both ([`crate::LaneConnect::Both`], the default,
        /// or `DUPLEX_LANE_CONNECT=both`), or only its own
        /// ([`crate::LaneConnect::OneWay`], `DUPLEX_LANE_CONNECT=one-way`).
        pub fn lane_connect(mut self, connect: crate::LaneConnect) -> Self {
            self.settings.opts.lane_connect = connect;
            self
        }

        /// The model under which hangs are explained. Its `lazy-connect`
        /// is replaced by what [`Self::warm`] sets (`Options::model_in_force`):
        /// the backend connects by `warm`, whatever the model says.
        pub fn model(mut self, model: Model) -> Self {
            self.settings.opts.model = model;
            self
        }

        /// CTA bounds for lane communicators.
        pub fn ctas(mut self, min: Option<i32>, max: Option<i32>) -> Self {
            self.settings.opts.ctas = (min, max);
            self
        }

        /// Under [`Policy::PerDirection`], puts ops of at least `size`
        /// bytes without an explicit communicator on copy-engine lanes
        /// (C1–C6 of `docs/semantics.md`; [`crate::copy`]). `None`, the
        /// default: no op. Across processes ([`crate::Process`]) they are
        /// experimental and refused unless `DUPLEX_IPC_COPY=1`
        /// ([`crate::ipc_copy_asked`]); the ranks must then be on one host
        /// (CUDA IPC and shared memory, [`crate::copy::ipc`]).
        pub fn copy_from(mut self, size: Option<duplex::Size>) -> Self {
            self.settings.opts.copy_from = size.map(duplex::Size::bytes);
            self
        }
    };
}

/// Several GPUs of this process, a thread per rank.
#[derive(Clone, Debug)]
pub struct Local {
    ranks: u32,
    lib: &'static Nccl,
    settings: Settings,
}

impl Local {
    /// A run over GPUs `0..ranks`. Fails, saying what is missing and how to
    /// point duplex at it, without NCCL, a CUDA driver or enough GPUs.
    pub fn new(ranks: u32) -> Result<Local> {
        let opts = options_from_env()?;
        let lib = nccl()?;
        let n = cuda::init()?;
        if (n as u32) < ranks || ranks == 0 {
            return Err(Error::Unavailable {
                what: format!("a GPU for each of {ranks} ranks"),
                how: format!(
                    "this machine has {n}; run with fewer ranks, or a process per rank across machines (`Process`, `duplex run --processes` under a launcher), or, to test behaviour and not speed, every rank on GPU 0 over sockets (`duplex run --processes --one-gpu`)"
                ),
            });
        }
        Ok(Local {
            ranks,
            lib,
            settings: Settings {
                policy: Policy::PerDirection,
                opts,
            },
        })
    }

    builder!();

    /// Runs `f` on every rank (each on its own thread and GPU). Every rank's
    /// streams are synchronized when `f` returns; every communicator is
    /// destroyed before this returns, also after a hang. Returns the most
    /// telling error of any rank.
    pub fn run<F>(&self, f: F) -> Result<Vec<RankReport>>
    where
        F: Fn(&NcclRank) -> Result<()> + Sync,
    {
        let id = self.lib.unique_id()?;
        let copy = crate::ctx::copy_lanes(self.ranks, self.settings.policy, &self.settings.opts)?;
        let registry = Registry::local(self.ranks, self.settings.opts.model_in_force());
        let board: Arc<dyn Board> = Arc::new(LocalBoard::default());
        let health: Arc<dyn Health> = Arc::new(LocalHealth::default());
        let results: Vec<Result<RankReport>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..self.ranks)
                .map(|r| {
                    let (registry, board, health, copy, f) = (
                        registry.clone(),
                        board.clone(),
                        health.clone(),
                        copy.clone(),
                        &f,
                    );
                    scope.spawn(move || {
                        rank_main(
                            self.lib,
                            r,
                            self.ranks,
                            r as i32,
                            &self.settings,
                            Links {
                                id,
                                board,
                                registry,
                                health,
                                copy,
                                across: false,
                            },
                            f,
                        )
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|p| {
                        Err(Error::User(format!(
                            "rank thread panicked: {}",
                            panic_text(&p)
                        )))
                    })
                })
                .collect()
        });
        let mut reports = combine(results).map_err(|e| explain_library_error(e, &registry))?;
        // Once every rank is done: a rank that finished first made its
        // report before the others' last calls were applied.
        let refused = registry.refused();
        for r in &mut reports {
            r.model_refused.clone_from(&refused);
        }
        // Every rank finished: a send that no recv took reached no one.
        match registry.unreceived_at_end() {
            Some(e) => Err(e),
            None => Ok(reports),
        }
    }

    /// Measures from which message size copy-engine lanes are faster than
    /// NCCL lanes between GPUs 0 and 1 of this machine
    /// ([`crate::threshold`]), in a run of its own with two ranks and this
    /// run's settings otherwise (its CTA bounds, timeout and model), lanes
    /// connected at creation. Pass the result's
    /// [`copy_from`](crate::threshold::Measurement::copy_from) to
    /// [`Local::copy_from`]; print the result to show why. Takes a second
    /// or two, mostly to make the run's communicators.
    pub fn measure_copy_from(
        &self,
        plan: &crate::threshold::Plan,
    ) -> Result<crate::threshold::Measurement> {
        if self.ranks < 2 {
            return Err(Error::Unavailable {
                what: "a second GPU".into(),
                how: format!(
                    "copy-engine lanes move data between two GPUs, and this run has {} rank; measure with Local::new(2) or more",
                    self.ranks
                ),
            });
        }
        plan.check()?;
        let smallest = plan.sizes[0];
        let mut probe = self.clone();
        probe.ranks = 2;
        probe.settings.policy = Policy::PerDirection;
        probe.settings.opts.copy_from = Some(smallest);
        probe.settings.opts.warm = true;
        let samples = std::sync::Mutex::new(Vec::new());
        probe.run(|t| {
            let mine = crate::threshold::measure(t, plan)?;
            samples
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(mine);
            Ok(())
        })?;
        let samples = samples.into_inner().unwrap_or_else(|e| e.into_inner());
        crate::threshold::Measurement::new(plan, &samples)
    }
}

/// One rank of a one-process-per-rank job.
#[derive(Clone, Debug)]
pub struct Process {
    rank: Rank,
    world: u32,
    device: i32,
    /// Where rank 0 listens (`DUPLEX_STORE_BIND`, else `MASTER_ADDR`).
    bind: String,
    /// Where every rank connects (`MASTER_ADDR`).
    host: String,
    port: u16,
    secret: Secret,
    /// NCCL and CUDA, or why not: a rank without them still joins the
    /// store in [`Process::run`] to tell the others why it cannot start.
    lib: std::result::Result<&'static Nccl, Error>,
    settings: Settings,
}

/// The error of a rank whose code returned `code` after a thread of it
/// failed (`thread`: the thread's error as the rank's, and as the thread
/// returned it): the code's own where it is the thread's error, returned
/// through a join (`join(t)?`); else the more telling of the two, the
/// thread's of equals (it came first).
fn after_thread_failed(code: Error, thread: (Error, Error)) -> Error {
    let (as_ranks, raw) = thread;
    if code.to_string() == raw.to_string() {
        return code;
    }
    Error::most_telling([as_ranks, code]).expect("two errors")
}

/// Variable `name`, `None` when it is not set; set to bytes that are not
/// UTF-8, an error, not the default.
fn optional_env(name: &str) -> Result<Option<String>> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(Error::Invalid {
            at: name.into(),
            message: format!("{name} is not UTF-8 text"),
        }),
    }
}

/// A launcher's variable: one that is missing, or not text, is a wrong
/// launcher environment (`Error::Invalid`, which `duplex run` reports as
/// `environment`, status 2), named with how to set it.
fn env_var(name: &str) -> Result<String> {
    const HOW: &str = "run under torchrun, or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT as torchrun does";
    std::env::var(name).map_err(|e| Error::Invalid {
        at: name.into(),
        message: match e {
            std::env::VarError::NotPresent => format!("{name} is not set: {HOW}"),
            std::env::VarError::NotUnicode(_) => format!("{name} is not UTF-8 text: {HOW}"),
        },
    })
}

fn env_num(name: &str) -> Result<u32> {
    let v = env_var(name)?;
    v.parse().map_err(|_| Error::Invalid {
        at: name.into(),
        message: format!("{name}={v} is not a number"),
    })
}

/// The store's port, one above torchrun's `MASTER_PORT`: a clear error,
/// naming `DUPLEX_PORT`, when there is no such port (a `MASTER_PORT` of
/// 65535 or above, or 0, would wrap to another service's port).
fn store_port(master: u32) -> Result<u16> {
    match u16::try_from(master) {
        Ok(p) if p > 0 && p < u16::MAX => Ok(p + 1),
        _ => Err(Error::Invalid {
            at: "MASTER_PORT".into(),
            message: format!(
                "MASTER_PORT={master}: duplex's store listens one port above it, and there is no such port; pick a MASTER_PORT from 1 to 65534, or set DUPLEX_PORT"
            ),
        }),
    }
}

/// Whether a test harness was asked to run a job's process ranks on one
/// GPU ([`shared_gpu_env`]): `DUPLEX_ONE_GPU=1`, read by the GPU suite and
/// the fault matrix.
pub fn one_gpu_asked() -> bool {
    switched_on("DUPLEX_ONE_GPU")
}

/// Whether the environment variable `name` is `1`.
fn switched_on(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1")
}

/// The environment under which rank `rank` of a process-per-rank job runs
/// on GPU 0 beside the job's other ranks, on a machine with fewer GPUs than
/// ranks: for testing a job's behaviour (hangs, failures, lanes), never its
/// speed. NCCL refuses two ranks of one host on one GPU ("Duplicate GPU
/// detected"), so each rank names a host of its own (`NCCL_HOSTID`, unique
/// to `job` and `rank`) and the ranks talk over loopback sockets
/// (`NCCL_SOCKET_IFNAME=lo`), not NVLink. Give each rank's process these
/// variables (with `RANK` and the rest) before it starts: NCCL reads them
/// when it is loaded. Measured on one H200 with NCCL 2.28
/// (`scripts/one_gpu_two_ranks.py`): two such ranks make a communicator
/// and exchange bytes intact.
pub fn shared_gpu_env(rank: Rank, job: &str) -> [(&'static str, String); 3] {
    [
        ("LOCAL_RANK", "0".to_string()),
        (
            "NCCL_HOSTID",
            format!("duplex-shared-gpu-{job}-rank-{rank}"),
        ),
        ("NCCL_SOCKET_IFNAME", "lo".to_string()),
    ]
}

impl Process {
    /// This process's rank, from the variables torchrun sets: `RANK`,
    /// `WORLD_SIZE`, `LOCAL_RANK` (the GPU), `MASTER_ADDR` and `MASTER_PORT`.
    /// Rank 0 serves a small store on `MASTER_ADDR` (or `DUPLEX_STORE_BIND`)
    /// at port `MASTER_PORT + 1` (or `DUPLEX_PORT`) for the NCCL unique id
    /// and the `notify` messages; every connection must show the job's
    /// secret (`DUPLEX_STORE_TOKEN`, or derived from torchrun's
    /// `TORCHELASTIC_RUN_ID`: see [`crate::store`]).
    ///
    /// A missing NCCL library or GPU is not an error here but in
    /// [`Process::run`], which first tells the other ranks through the
    /// store, so that their waits end naming this rank instead of waiting
    /// for it until their deadlines.
    pub fn from_env() -> Result<Process> {
        let rank = env_num("RANK")?;
        let world = env_num("WORLD_SIZE")?;
        let device = env_num("LOCAL_RANK")? as i32;
        let addr = env_var("MASTER_ADDR")?;
        let port = match optional_env("DUPLEX_PORT")? {
            Some(p) => p.parse::<u16>().map_err(|_| Error::Invalid {
                at: "DUPLEX_PORT".into(),
                message: format!("DUPLEX_PORT={p} is not a port"),
            })?,
            None => store_port(env_num("MASTER_PORT")?)?,
        };
        if rank >= world {
            return Err(Error::Invalid {
                at: "RANK".into(),
                message: format!("RANK={rank} is not below WORLD_SIZE={world}"),
            });
        }
        let secret = secret_from_env()?;
        let bind = optional_env("DUPLEX_STORE_BIND")?
            .filter(|b| !b.is_empty())
            .unwrap_or_else(|| addr.clone());
        // The GPU this rank is given must exist: a machine with fewer GPUs
        // than local ranks is said as such (as `Local::new` says it), not
        // left to a CUDA error when the device is opened.
        let lib = nccl().and_then(|lib| {
            let n = cuda::init()?;
            if device as usize >= n {
                let how = if n == 0 {
                    "the CUDA driver sees no GPU here: check CUDA_VISIBLE_DEVICES and that `nvidia-smi` lists the GPUs".to_string()
                } else {
                    format!(
                        "this machine has {n} GPU{} visible: start at most one rank per GPU on it (torchrun --nproc-per-node {n}), check CUDA_VISIBLE_DEVICES, or, to test behaviour and not speed, put every rank on GPU 0 over sockets (`duplex run --processes --one-gpu`, `duplex_nccl::shared_gpu_env`)",
                        if n == 1 { "" } else { "s" }
                    )
                };
                return Err(Error::Unavailable {
                    what: format!("GPU {device} (LOCAL_RANK={device})"),
                    how,
                });
            }
            Ok(lib)
        });
        Ok(Process {
            rank,
            world,
            device,
            bind,
            host: addr,
            port,
            secret,
            lib,
            settings: Settings {
                policy: Policy::PerDirection,
                opts: options_from_env()?,
            },
        })
    }

    builder!();

    /// This process's rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The job's number of ranks (`WORLD_SIZE`).
    pub fn world(&self) -> u32 {
        self.world
    }

    /// Runs `f` as this rank. Rank 0 must be started for the others to
    /// connect; every wait, the rendezvous included, has the deadline.
    ///
    /// With lanes made on first use ([`crate::LaneMode::Lazy`]), a rank
    /// whose `f` has returned keeps its lane service for the others before
    /// this returns: until every other rank has finished, any rank has
    /// failed, or the deadline and the silence that counts as death
    /// ([`crate::health`]) have passed. Code after `run` that waits for a
    /// rank still inside its `run` waits that long at most.
    ///
    /// Once per process: rank 0's store keeps serving the job's unique id
    /// and messages for as long as the process lives (the others may still
    /// be reading them), so a second run would find its port taken on rank
    /// 0 and the first run's id and messages on the other ranks. A second
    /// call is refused with an error; start a new process per job, as
    /// torchrun does.
    pub fn run<F>(&self, f: F) -> Result<RankReport>
    where
        F: Fn(&NcclRank) -> Result<()>,
    {
        if self.settings.policy == Policy::PerDirection
            && let Some(c) = self.settings.opts.copy_from
            && !ipc_copy_asked()
        {
            return Err(Error::Unavailable {
                what: format!(
                    "copy-engine lanes across processes (copy_from {})",
                    duplex::Size(c)
                ),
                how: "they are experimental: on one H200 shared by two processes a job with a sending and a receiving thread per rank hung in about 1 run in 3, an IPC open stalled while the process's streams waited; everything is now opened at setup, which passed every run on one GPU but has not run on two yet (docs/semantics.md, \"Across processes\"); set DUPLEX_IPC_COPY=1 to use them anyway, run the ranks as threads of one process (Local), or leave copy_from unset".into(),
            });
        }
        static RAN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if RAN.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return Err(Error::Invalid {
                at: "Process::run".into(),
                message: "Process::run runs once per process: rank 0's store still serves the first run's unique id and messages; start a new process for another job, as torchrun does".into(),
            });
        }
        let timeout = self.settings.opts.timeout;
        let client = Store::client(self.host.clone(), self.port, self.secret.clone());
        // NCCL and CUDA, and on rank 0 the job's unique id: what this rank
        // needs to start, or why it cannot. Rank 0 serves the store even
        // when it cannot start, with no unique id (`NO_ID`), so that the
        // others learn why.
        let (lib, id) = match (self.rank, &self.lib) {
            (0, Ok(lib)) => match lib.unique_id() {
                Ok(id) => (Ok(*lib), Some(id)),
                Err(e) => (Err(e), None),
            },
            (_, lib) => (lib.clone(), None),
        };
        if self.rank == 0 {
            let served = id
                .as_ref()
                .map_or(NO_ID.to_vec(), |id| id.internal.to_vec());
            Store::serve(&self.bind, self.port, served, self.secret.clone())?;
            // The job's size, which every other rank checks its own against.
            client.put("job/world-size", self.world.to_string().as_bytes(), timeout)?;
            // And when lanes are made, which every rank must agree on: a
            // rank that splits every lane at start waits for ranks that
            // never split.
            client.put(
                "job/lanes",
                lanes_word(self.settings.policy, &self.settings.opts).as_bytes(),
                timeout,
            )?;
            if let Err(e) = &lib {
                return Err(self.cannot_start(&client, e.clone()));
            }
        }
        // Waits (under the deadline) for rank 0 to serve.
        let bytes = client.unique_id(timeout)?;
        if self.rank != 0 {
            let theirs = client.get("job/world-size", timeout)?.unwrap_or_default();
            let theirs = String::from_utf8_lossy(&theirs).into_owned();
            if theirs != self.world.to_string() {
                let e = Error::Invalid {
                    at: "WORLD_SIZE".into(),
                    message: format!(
                        "rank {} has WORLD_SIZE={}, rank 0 has WORLD_SIZE={theirs}: every rank of a job must be given the same",
                        self.rank, self.world
                    ),
                };
                return Err(self.cannot_start(&client, e));
            }
            let theirs = client.get("job/lanes", timeout)?.unwrap_or_default();
            let theirs = String::from_utf8_lossy(&theirs).into_owned();
            let mine = lanes_word(self.settings.policy, &self.settings.opts);
            if theirs != mine {
                let e = Error::Invalid {
                    at: "the placement policy and lane settings".into(),
                    message: format!(
                        "rank {} has {mine}; rank 0 has {theirs}: every rank of a job must be given the same policy and lane settings (Process::policy, DUPLEX_LANES / Process::lanes, DUPLEX_LANE_CONNECT / Process::lane_connect, Process::copy_from)",
                        self.rank
                    ),
                };
                return Err(self.cannot_start(&client, e));
            }
        }
        if bytes == NO_ID {
            // Rank 0 cannot start; it posts why right after serving.
            let mut why = None;
            let _ = comm::poll(timeout, || {
                why = client.health(self.rank, SILENCE, timeout).ok().flatten();
                if why.is_none() {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Ok(why.is_some())
            });
            let (r, why) = why.unwrap_or((0, "it served no unique id".into()));
            let e = Error::Aborted(format!(
                "rank {r} cannot start, so neither can rank {}: {why}",
                self.rank
            ));
            return Err(self.cannot_start(&client, e));
        }
        let lib = match lib {
            Ok(lib) => lib,
            Err(e) => return Err(self.cannot_start(&client, e)),
        };
        // Never print the id: it lets anyone join the communicator.
        let id = ncclUniqueId::from_bytes(&bytes).ok_or_else(|| {
            Error::Aborted(format!(
                "the store sent a unique id of {} bytes, not {NCCL_UNIQUE_ID_BYTES}",
                bytes.len()
            ))
        })?;
        let board: Arc<dyn Board> = Arc::new(client);
        // This process records only its own rank's calls; on a hang the
        // ranks exchange their traces through the store (crate::health).
        let registry =
            Registry::for_rank(self.world, self.settings.opts.model_in_force(), self.rank);
        let health: Arc<dyn Health> = StoreHealth::start(
            Store::client(self.host.clone(), self.port, self.secret.clone()),
            self.rank,
        );
        let result = rank_main(
            lib,
            self.rank,
            self.world,
            self.device,
            &self.settings,
            Links {
                id,
                board,
                registry,
                health: health.clone(),
                // Made once the world communicator is (every rank is up):
                // across processes by CUDA IPC (`crate::copy::ipc`).
                copy: Vec::new(),
                across: true,
            },
            &f,
        );
        if self.rank == 0 {
            // The store lives in this process: it stays up until every other
            // rank has ended (finished, failed, or fallen silent: killed or
            // frozen), however long they run, so that their waits never
            // read its end as rank 0's death, and a rank that finishes late
            // still has the store for its end check. A rank that is alive
            // beats; one that is not falls silent within the silence.
            //
            // Without a bound only when this rank's code returned cleanly,
            // which it ran only once every rank had joined the world
            // communicator (each was heard by the store before it started:
            // its monitor beats once before the rank starts). Before that a
            // rank may never have started (a wrong `WORLD_SIZE`), and one
            // never heard never falls silent. And once the job has failed
            // (this rank, or another as far as it knows), the others' waits
            // end within the deadline and the silence: no longer than that.
            let bound = self.settings.opts.timeout + SILENCE;
            let wait = if result.is_ok() { Duration::MAX } else { bound };
            let since = Instant::now();
            health.linger(self.world, 0, wait, bound);
            // And until those that finished are done with their end checks
            // (they read each other's counts from it): a second or two.
            health.wait_left(self.world, 0, Duration::from_secs(5));
            tracing::debug!(
                ms = since.elapsed().as_secs_f64() * 1e3,
                "rank 0 kept the store up until the others had ended"
            );
        }
        result
    }

    /// The error of a rank that cannot start (no NCCL or GPU, a wrong
    /// `WORLD_SIZE`), posted to the store first so that the other ranks'
    /// waits end naming it; rank 0, the store's host, stays until they
    /// have read it (bounded).
    fn cannot_start(&self, client: &Store, e: Error) -> Error {
        let timeout = self.settings.opts.timeout;
        let _ = client.fail(self.rank, &e.to_string(), timeout);
        if self.rank == 0 {
            let health = StoreHealth::start(
                Store::client(self.host.clone(), self.port, self.secret.clone()),
                0,
            );
            health.linger(self.world, 0, timeout + SILENCE, timeout + SILENCE);
        }
        e
    }
}

/// The size of each rank's copy-lane arena across processes:
/// `DUPLEX_IPC_ARENA_MIB` MiB, 4096 by default (when unset; set to bytes
/// that are not UTF-8, an error, as its siblings are).
fn ipc_arena_bytes() -> Result<usize> {
    match optional_env("DUPLEX_IPC_ARENA_MIB")? {
        None => Ok(4096 << 20),
        Some(v) => match v.trim().parse::<usize>() {
            Ok(m) if m > 0 && m < (1 << 24) => Ok(m << 20),
            _ => Err(Error::Invalid {
                at: "DUPLEX_IPC_ARENA_MIB".into(),
                message: format!("{v:?} is not a number of MiB between 1 and 16777215"),
            }),
        },
    }
}

/// Whether copy-engine lanes across processes, which are experimental,
/// were asked for (`DUPLEX_IPC_COPY=1`); otherwise a [`Process`] with
/// `copy_from` set is refused.
pub fn ipc_copy_asked() -> bool {
    switched_on("DUPLEX_IPC_COPY")
}

/// The most calls a rank that finished cleanly publishes for the others'
/// hang analyses (a longer trace is not sent: its encoding would slow
/// every clean exit).
const PUBLISH_AT_EXIT_MAX: usize = 100_000;

/// What rank 0 serves instead of a unique id when it cannot start (no
/// NCCL or GPU): one byte, never an NCCL id (128 bytes).
const NO_ID: [u8; 1] = [0];

/// How a rank reaches the others: the world communicator's id, messages,
/// its trace, failures.
struct Links {
    id: ncclUniqueId,
    board: Arc<dyn Board>,
    registry: Arc<Registry>,
    health: Arc<dyn Health>,
    /// The job's copy-engine lanes, in one process.
    copy: crate::ctx::CopyLanes,
    /// One rank per process: the rank makes its copy-engine lanes itself.
    across: bool,
}

fn rank_main<F>(
    lib: &'static Nccl,
    rank: Rank,
    world: u32,
    device: i32,
    settings: &Settings,
    links: Links,
    f: &F,
) -> Result<RankReport>
where
    F: Fn(&NcclRank) -> Result<()>,
{
    let Links {
        id,
        board,
        registry,
        health,
        mut copy,
        across,
    } = links;
    // A panic outside the rank's code (its setup, its final synchronize)
    // ends the thread without a word: say the rank failed, so that the
    // others' waits (and lingers) end too.
    let outcome = Posted {
        health: health.as_ref(),
        rank,
        posted: std::cell::Cell::new(false),
    };
    let start = Instant::now();
    let failed = |e: Error| {
        // A rank that fails says so, so that the others' waits end too.
        health.fail(rank, &e.to_string());
        e
    };
    let device = Arc::new(Device::new(device).map_err(failed)?);
    let opts = settings.opts.clone();
    let world_comm = comm::init(lib, id, world, rank, opts.timeout, (None, None), &|| {
        health.failed(rank)
    })
    .map_err(failed)?;
    let mut arena = None;
    if across && settings.policy == Policy::PerDirection && settings.opts.copy_from.is_some() {
        let (lanes, own) = ipc_arena_bytes()
            .and_then(|bytes| {
                crate::copy::ipc::lanes(rank, world, &device, &id.internal, opts.timeout, bytes)
            })
            .map_err(failed)?;
        copy = lanes;
        arena = Some(own);
    }
    let ctx = RankCtx::create(RankSetup {
        rank,
        world_size: world,
        policy: settings.policy,
        opts,
        lib,
        device,
        world: world_comm,
        board,
        registry: registry.clone(),
        health: health.clone(),
        copy,
        arena,
    })
    .map_err(failed)?;
    let setup_ms = start.elapsed().as_secs_f64() * 1e3;
    let handle = NcclRank::new(ctx, "main");
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&handle)))
        .unwrap_or_else(|p| {
            Err(Error::User(format!(
                "rank {rank} panicked: {}",
                panic_text(&p)
            )))
        });
    // A thread of the rank that failed before its code returned failed
    // first: where the code returned an error too (after it, or because
    // of it), the more telling of the two is the rank's, the thread's of
    // equals, as the simulator's execution ends at the thread's failure.
    let thread_first = handle.first_thread_error();
    // The end of a rank's code waits for the threads it started and never
    // joined, then for its streams, as a real program's final synchronize
    // (and as the simulator's end of execution).
    handle.end();
    let result = match (result, thread_first) {
        (Err(code), Some(thread)) => Err(after_thread_failed(code, thread)),
        (result, _) => result.and_then(|()| handle.wait_spawned()),
    }
    .and_then(|()| handle.synchronize());
    let mut unreceived = None;
    if result.is_ok() {
        if health.remote() {
            let wait = settings.opts.timeout + SILENCE;
            unreceived = finish_remote(&registry, health.as_ref(), rank, wait);
        } else {
            health.finished(rank);
        }
    }
    outcome.posted.set(true);
    let mut result = result;
    if let Err(e) = &result {
        health.fail(rank, &e.to_string());
        // The others' hang analyses need what this rank issued; unless a
        // wait already published it as another rank's failure ended that
        // wait, which shows the call that was blocked (this one would show
        // the end of the thread instead, and the cycle would be lost).
        if health.remote() && !handle.published_for_peer() {
            health.publish(rank, &registry.trace());
        }
        // Across processes, NCCL's error is explained from every rank's
        // calls: a size, type or group mismatch that no rank could see
        // before both ops were launched (the program error, naming both
        // ops), or a connection set up from mismatched calls (R7). The
        // others publish their calls as they fail or finish (a second at
        // most, and only on an NCCL or CUDA error of this rank's own, not
        // on the abort another rank's failure caused).
        if health.remote() && matches!(e, Error::Library { .. }) {
            let others = health.gather(world, rank, Duration::from_secs(1));
            let analysis = registry.analyze_with(others.traces);
            result = result.map_err(|e| explained(e, analysis));
        }
    }
    // A send of this rank's that no recv took fails the rank, after the
    // rest (it finished, and said so).
    if let Some(e) = unreceived {
        result = Err(e);
    }
    // With lanes made on first use, a rank that finished keeps its lane
    // service for the others a while: a peer's late first message to it
    // (a send it never receives, say) then meets a lane and hangs as it
    // would on a lane made at start, with a hang report, rather than
    // failing to make the lane. Until every other rank has finished, any
    // rank is known to have failed (the job is ending), or the deadline
    // and the silence that counts as death have passed.
    if result.is_ok() && settings.opts.lanes == crate::LaneMode::Lazy {
        health.linger(world, rank, settings.opts.timeout + SILENCE, Duration::ZERO);
    }
    // Whatever happened, nothing of this rank stays stuck on the device.
    let ending = Instant::now();
    handle.teardown(result.is_err());
    tracing::debug!(
        rank,
        ms = ending.elapsed().as_secs_f64() * 1e3,
        "this rank's streams and lanes are torn down"
    );
    // Lanes made on first use are in it too.
    let lanes = handle.lane_costs();
    drop(handle);
    result.map(|()| RankReport {
        rank,
        setup_ms,
        lanes,
        // This process's registry; a local run's ranks share one, which
        // `Local::run` asks once every rank is done.
        model_refused: if across { registry.refused() } else { None },
    })
}

/// What a rank of a process-per-rank job does as it finishes cleanly: it
/// leaves what it issued for the others (its trace for their hang
/// analyses, its counts for their end checks), says it finished, runs its
/// end check ([`end_check`], waiting up to `wait`) and says it is done
/// with the store. The error is the end check's.
fn finish_remote(
    registry: &Registry,
    health: &dyn Health,
    rank: Rank,
    wait: Duration,
) -> Option<Error> {
    // Its trace, so that a partner it never matched is named (a send whose
    // recv this rank never issued); above a bound the trace is not worth
    // the time it would add to every clean exit.
    if registry.calls() <= PUBLISH_AT_EXIT_MAX {
        health.publish(rank, &registry.trace());
    }
    let counts = registry.channel_counts();
    health.post_counts(rank, &counts);
    health.finished(rank);
    let unreceived = end_check(registry, &counts, health, rank, wait);
    health.left(rank);
    unreceived
}

/// The end check of a rank of a process-per-rank job that finished
/// cleanly, which posted its counts `mine` before: the `never-received`
/// error of the first send that no recv took, as a local run's end finds
/// for every rank. Whichever rank of a pair finishes second judges the
/// pair's channels:
///
/// * as a receiver, this rank judges the sends that ranks which finished
///   before it left for it ([`Registry::unreceived_from`]);
/// * as a sender, it waits up to `wait` for the ranks it sent to to
///   finish and judges its sends to them ([`Registry::unreceived_with`]);
///   for a rank still running when the wait runs out, it leaves its sends
///   to it for that rank to judge ([`Health::post_owed`]), then looks once
///   more for that rank's counts.
///
/// Every post comes before the look it pairs with (the counts before the
/// list of what was left, what was left before the last look for the
/// counts); each request takes effect in the store, under its lock,
/// before it is answered, and each rank makes its requests one after
/// another, so of two ranks finishing at once at least one sees the
/// other's. When any rank failed
/// meanwhile, nothing (the job fails, and says why elsewhere); when it
/// cannot judge, a warning says why.
fn end_check(
    registry: &Registry,
    mine: &[duplex::trace::ChannelCount],
    health: &dyn Health,
    rank: Rank,
    wait: Duration,
) -> Option<Error> {
    let cannot = |why: &str| {
        tracing::warn!(
            rank,
            "whether every send of this rank was received could not be judged: {why}"
        );
    };
    let theirs = match health.owed_to(rank) {
        Ok(owed) => registry.unreceived_from(mine, &owed),
        Err(why) => {
            tracing::warn!(
                rank,
                "whether every send to this rank was received could not be judged: {why}"
            );
            None
        }
    };
    let peers = registry.sent_to(mine);
    if peers.is_empty() {
        return theirs;
    }
    let mut heard = match health.counts_of(rank, &peers, wait) {
        Ok(Some(heard)) => heard,
        Ok(None) => return theirs,
        Err(why) => {
            cannot(&why);
            return theirs;
        }
    };
    for peer in std::mem::take(&mut heard.missing) {
        let toward: Vec<_> = mine
            .iter()
            .filter(|c| c.from == rank && c.to == peer)
            .copied()
            .collect();
        if let Err(why) = health.post_owed(rank, peer, &toward) {
            cannot(&format!(
                "rank {peer} had not finished within {:.1} s, and this rank's sends to it could not be left for it: {why}",
                wait.as_secs_f64()
            ));
            continue;
        }
        match health.counts_of(rank, &[peer], Duration::ZERO) {
            Ok(Some(last)) if !last.counts.is_empty() => heard.counts.extend(last.counts),
            Err(why) => cannot(&format!(
                "rank {peer} had not finished within {:.1} s, and the last look for its counts failed: {why}",
                wait.as_secs_f64()
            )),
            _ => tracing::info!(
                rank,
                peer,
                "rank {peer} had not finished within {:.1} s: it judges this rank's sends to it as it finishes",
                wait.as_secs_f64()
            ),
        }
    }
    registry.unreceived_with(mine, &heard.counts).or(theirs)
}

/// Posts a rank's failure when dropped unless its outcome was posted: what
/// a panic outside the rank's code leaves.
struct Posted<'a> {
    health: &'a dyn Health,
    rank: Rank,
    posted: std::cell::Cell<bool>,
}

impl Drop for Posted<'_> {
    fn drop(&mut self) {
        if !self.posted.get() && std::thread::panicking() {
            self.health
                .fail(self.rank, "the rank's thread panicked outside its code");
        }
    }
}

/// An NCCL or CUDA error of a local run, with the model's explanation
/// when there is one: a connection set up from mismatched calls (R7 of
/// `docs/semantics.md`), which NCCL makes from the wrong data and may
/// answer with an internal error or a crash instead of the hang the model
/// reports. Every rank's calls are in `registry` here; across processes
/// `rank_main` gathers the other ranks' published calls for it.
fn explain_library_error(e: Error, registry: &Registry) -> Error {
    if !matches!(e, Error::Library { .. }) {
        return e;
    }
    explained(e, registry.analyze())
}

/// NCCL's error `e` explained by the model's `analysis` of what the ranks
/// issued. A size mismatch that NCCL reported as invalid usage (over
/// sockets: "message truncated") becomes the program error, naming both
/// ops, with NCCL's words after it: across processes neither rank sees the
/// other's op before both are launched, so NCCL meets it first. Any other
/// error stays NCCL's (it may have another cause, and NCCL cannot see a
/// type or group mismatch), with what the joined calls show said after it:
/// a program error, and connections set up from mismatched calls
/// ([`with_mismatched_setups`]).
pub(crate) fn explained(e: Error, analysis: crate::registry::HangAnalysis) -> Error {
    /// `ncclInvalidUsage`.
    const INVALID_USAGE: i32 = 5;
    let refused = disagreements_said(&analysis.disagreements);
    let program = analysis.program_error.map(Error::from);
    let e = match (program, e) {
        (
            Some(Error::Program {
                kind: duplex::ProgramErrorKind::SizeMismatch,
                message,
                ops,
            }),
            Error::Library {
                library: "NCCL",
                call,
                code: INVALID_USAGE,
                text,
            },
        ) => Error::Program {
            kind: duplex::ProgramErrorKind::SizeMismatch,
            message: format!(
                "{message}; NCCL met it first, in {call} (error {INVALID_USAGE}): {text}"
            ),
            ops,
        },
        (
            Some(Error::Program { message, .. }),
            Error::Library {
                library,
                call,
                code,
                text,
            },
        ) => with_mismatched_setups(
            Error::Library {
                library,
                call,
                code,
                text: format!(
                    "{text}; the calls of the ranks also show a program error, which may or may not be its cause: {message}"
                ),
            },
            &analysis.mismatched_setups,
        ),
        (_, e) => with_mismatched_setups(e, &analysis.mismatched_setups),
    };
    said_after(e, &refused)
}

/// What an error explained by a connection set up from mismatched calls
/// (R7) says, in those words (`with_mismatched_setups`); judges of a
/// run's outcome (the GPU suite, `duplex calibrate`) look for it.
pub const MISMATCHED_SETUP: &str = "the model finds a connection set up from mismatched calls";

/// `e` with `setups` ([`crate::registry::HangAnalysis::mismatched_setups`])
/// said after its own text; `e` itself when there are none.
fn with_mismatched_setups(e: Error, setups: &[String]) -> Error {
    if setups.is_empty() {
        return e;
    }
    let said = format!(
        "; {MISMATCHED_SETUP}, which NCCL makes from the wrong data, so that an NCCL error or a crash may come instead of a hang (R7): {}",
        setups.join("; ")
    );
    said_after(e, &said)
}

/// What the model's replay refused of the run ([`duplex::trace::Disagreement`]s),
/// in words to put after an error's text (a hang's report lists them in
/// its own section): the model and the hardware disagree there, which is
/// reported, never dropped. Empty when there are none.
pub(crate) fn disagreements_said(disagreements: &[duplex::trace::Disagreement]) -> String {
    if disagreements.is_empty() {
        return String::new();
    }
    let each: Vec<String> = disagreements.iter().map(ToString::to_string).collect();
    format!(
        "; calls the model refuses (the model and the hardware disagree; please report this): {}",
        each.join("; ")
    )
}

/// `e` with `said` after its text (an NCCL error's, an abort's or a
/// program error's); other errors as they are.
pub(crate) fn said_after(e: Error, said: &str) -> Error {
    if said.is_empty() {
        return e;
    }
    match e {
        Error::Program { kind, message, ops } => Error::Program {
            kind,
            message: message + said,
            ops,
        },
        Error::Library {
            library,
            call,
            code,
            text,
        } => Error::Library {
            library,
            call,
            code,
            text: text + said,
        },
        Error::Aborted(why) => Error::Aborted(why + said),
        other => other,
    }
}

/// The most telling of several ranks' errors: a hang or a program error
/// first, an error that is only the echo of another rank's last.
fn combine(results: Vec<Result<RankReport>>) -> Result<Vec<RankReport>> {
    let mut errors: Vec<Error> = Vec::new();
    let mut ok = Vec::new();
    for r in results {
        match r {
            Ok(rep) => ok.push(rep),
            Err(e) => errors.push(e),
        }
    }
    match Error::most_telling(errors) {
        Some(e) => Err(e),
        None => Ok(ok),
    }
}

#[cfg(test)]
mod tests {
    /// Every setting by which two ranks would place or route one message
    /// differently is in the word rank 0 posts and the others compare
    /// (`job/lanes`): the policy, when lanes are made, how they connect,
    /// and the copy-engine threshold (found by review: ranks with
    /// `copy_from` 1 MiB and 4 MiB started, and a 2 MiB message went by
    /// copy at one end and by NCCL at the other).
    #[test]
    fn ranks_that_would_route_a_message_differently_are_told_apart_at_start() {
        use super::{Options, lanes_word};
        use duplex::Policy;
        let base = Options::default();
        let word = |p: Policy, o: &Options| lanes_word(p, o);
        assert_eq!(
            word(Policy::PerDirection, &base),
            word(Policy::PerDirection, &base.clone())
        );
        let mut differing = vec![
            (Policy::Shared, base.clone()),
            (
                Policy::PerDirection,
                Options {
                    copy_from: Some(1 << 20),
                    ..base.clone()
                },
            ),
            (
                Policy::PerDirection,
                Options {
                    copy_from: Some(4 << 20),
                    ..base.clone()
                },
            ),
            (
                Policy::PerDirection,
                Options {
                    lanes: crate::LaneMode::Lazy,
                    ..base.clone()
                },
            ),
            (
                Policy::PerDirection,
                Options {
                    lane_connect: crate::LaneConnect::OneWay,
                    ..base.clone()
                },
            ),
        ];
        differing.push((Policy::PerDirection, base.clone()));
        let words: std::collections::BTreeSet<String> =
            differing.iter().map(|(p, o)| word(*p, o)).collect();
        assert_eq!(words.len(), differing.len(), "{words:#?}");
    }

    /// A thread's error that the code returned through `join(t)?` is the
    /// rank's as it is; one the code went on from yields to the code's
    /// error only when that says more.
    #[test]
    fn a_rank_that_failed_after_its_thread_says_the_first_and_most_telling() {
        use duplex::Error;
        let raw = Error::User("boom".into());
        let labelled = Error::User(
            "thread t (joined, and the rank's code went on after its error): boom".into(),
        );
        let e = after_thread_failed(raw.clone(), (labelled.clone(), raw.clone()));
        assert_eq!(e.to_string(), "boom");
        let echo = Error::Aborted("rank 1 failed".into());
        let e = after_thread_failed(echo, (labelled.clone(), raw.clone()));
        assert_eq!(e.to_string(), labelled.to_string());
        let own = Error::User("the code's own check".into());
        let e = after_thread_failed(own, (labelled.clone(), raw));
        assert_eq!(
            e.to_string(),
            labelled.to_string(),
            "equals: the thread's, first"
        );
    }

    use super::*;

    /// What the model's replay refused is said with an NCCL error it
    /// explains, not dropped (it was, on every path but a hang's).
    #[test]
    fn an_explained_error_says_what_the_model_refused() {
        let analysis = crate::registry::HangAnalysis {
            stuck: None,
            disagreements: vec![duplex::trace::Disagreement {
                rank: 1,
                thread: "main".into(),
                call: "send 4 x u8 to rank 0".into(),
                place: "x.rs:3:1".into(),
                why: "the thread cannot make it there".into(),
            }],
            unjoined: None,
            mismatched_setups: Vec::new(),
            program_error: None,
        };
        let nccl = Error::Library {
            library: "NCCL",
            call: "ncclGroupEnd".into(),
            code: 3,
            text: "internal error".into(),
        };
        let e = explained(nccl, analysis).to_string();
        assert!(
            e.contains("internal error")
                && e.contains("calls the model refuses")
                && e.contains("send 4 x u8 to rank 0"),
            "{e}"
        );
        assert_eq!(disagreements_said(&[]), "");
    }

    /// Two ranks of a process job on a store of their own: rank 0 sends
    /// `sent` messages of 4 KiB to rank 1, which issues `received` recvs.
    fn pair(sent: usize, received: usize) -> (Vec<Arc<Registry>>, [Arc<StoreHealth>; 2]) {
        use crate::registry::tests::{one_op, record};
        let secret = Secret::new("0123456789abcdef-end-check");
        let addr = Store::serve("127.0.0.1", 0, vec![7; 8], secret.clone()).expect("serves");
        let health =
            |r| StoreHealth::start(Store::client("127.0.0.1", addr.port(), secret.clone()), r);
        let regs: Vec<Arc<Registry>> = (0..2)
            .map(|r| Registry::for_rank(2, Model::default(), r))
            .collect();
        for (r, reg) in regs.iter().enumerate() {
            reg.comm(0, "world", &[0, 1], true);
            let s = reg.stream(r as u32, "s");
            let t = reg.thread(r as u32, "main");
            let (dir, peer, n) = if r == 0 {
                (duplex::Dir::Send, 1, sent)
            } else {
                (duplex::Dir::Recv, 0, received)
            };
            for _ in 0..n {
                record(reg, one_op(t, dir, peer, 4096, 0, s)).expect("recorded");
            }
        }
        (regs, [health(0), health(1)])
    }

    /// The message of `e`, which must be `never-received` naming rank 0's
    /// send to rank 1 at FIFO position `fifo`.
    fn never_received(e: Option<Error>, fifo: u64) -> String {
        match e {
            Some(Error::Program {
                kind: duplex::ProgramErrorKind::NeverReceived,
                message,
                ops,
            }) => {
                assert_eq!(
                    (ops[0].rank, ops[0].peer, ops[0].fifo),
                    (0, 1, fifo),
                    "{message}"
                );
                message
            }
            other => panic!("expected never-received, got {other:?}"),
        }
    }

    /// Whichever rank of a pair finishes second judges its channels: the
    /// sender, when its receiver finishes within its wait; else the
    /// receiver, from the sends the sender left for it. A pair that matched
    /// reports nothing either way.
    #[test]
    fn the_rank_of_a_pair_that_finishes_second_judges_an_unreceived_send() {
        // The receiver finishes within the sender's wait: the sender judges.
        let (regs, [h0, h1]) = pair(2, 1);
        let late = {
            let (reg, h1) = (regs[1].clone(), h1.clone());
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                finish_remote(&reg, h1.as_ref(), 1, Duration::from_secs(10))
            })
        };
        let message = never_received(
            finish_remote(&regs[0], h0.as_ref(), 0, Duration::from_secs(10)),
            1,
        );
        assert!(!message.contains("finished first"), "{message}");
        assert!(
            late.join().expect("joins").is_none(),
            "rank 1 finished first"
        );
        // The receiver finishes after the sender's wait: the receiver judges,
        // naming the sender's call from its published trace.
        let (regs, [h0, h1]) = pair(2, 1);
        let wait = Duration::from_millis(100);
        assert!(finish_remote(&regs[0], h0.as_ref(), 0, wait).is_none());
        let message = never_received(finish_remote(&regs[1], h1.as_ref(), 1, wait), 1);
        assert!(message.contains("rank 0 finished first"), "{message}");
        assert!(message.contains("x.rs:1:1"), "the sender's call: {message}");
        // Matched: nothing, in either order.
        for receiver_late in [false, true] {
            let (regs, hs) = pair(2, 2);
            let order: [usize; 2] = if receiver_late { [0, 1] } else { [1, 0] };
            for r in order {
                let e = finish_remote(&regs[r], hs[r].as_ref(), r as Rank, wait);
                assert!(e.is_none(), "rank {r}: {e:?}");
            }
        }
    }

    /// A rank's [`StoreHealth`] whose requests that the end check's
    /// ordering rests on (posting counts, listing what was left, looking
    /// for counts, leaving sends) wait for their turn in a schedule shared
    /// with the other rank: `turns[k]` is the rank whose request is `k`-th.
    /// A rank whose turns are over, or whose partner is done, goes freely.
    #[derive(Debug)]
    struct Scripted {
        inner: Arc<StoreHealth>,
        me: usize,
        turns: Arc<(std::sync::Mutex<Turns>, std::sync::Condvar)>,
    }

    #[derive(Debug)]
    struct Turns {
        schedule: Vec<usize>,
        next: usize,
        done: [bool; 2],
    }

    impl Scripted {
        fn gated<T>(&self, op: impl FnOnce() -> T) -> T {
            let (lock, cv) = &*self.turns;
            let mut t = lock.lock().unwrap();
            loop {
                // Skip the turns of a rank that is done.
                while t.next < t.schedule.len() && t.done[t.schedule[t.next]] {
                    t.next += 1;
                }
                if t.next >= t.schedule.len()
                    || t.schedule[t.next] == self.me
                    || t.done[1 - self.me]
                {
                    break;
                }
                t = cv.wait(t).unwrap();
            }
            // Held while the request runs: the other rank's turn comes
            // after its answer.
            let out = op();
            t.next += 1;
            cv.notify_all();
            out
        }

        fn done(&self) {
            let (lock, cv) = &*self.turns;
            lock.lock().unwrap().done[self.me] = true;
            cv.notify_all();
        }
    }

    impl Health for Scripted {
        fn fail(&self, rank: Rank, why: &str) {
            self.inner.fail(rank, why)
        }
        fn failed(&self, me: Rank) -> Option<(Rank, String)> {
            self.inner.failed(me)
        }
        fn remote(&self) -> bool {
            true
        }
        fn publish(&self, rank: Rank, trace: &duplex::trace::Trace) {
            self.inner.publish(rank, trace)
        }
        fn publish_early(&self, rank: Rank, trace: &duplex::trace::Trace) {
            self.inner.publish_early(rank, trace)
        }
        fn gather(&self, ranks: u32, me: Rank, wait: Duration) -> crate::health::Gathered {
            self.inner.gather(ranks, me, wait)
        }
        fn finished(&self, rank: Rank) {
            self.inner.finished(rank)
        }
        fn finished_among(&self, ranks: &[Rank]) -> Option<Rank> {
            self.inner.finished_among(ranks)
        }
        fn finished_counts(&self, rank: Rank) -> Option<Arc<Vec<duplex::trace::ChannelCount>>> {
            self.inner.finished_counts(rank)
        }
        fn failed_itself(&self, me: Rank) -> bool {
            self.inner.failed_itself(me)
        }
        fn linger(&self, ranks: u32, me: Rank, wait: Duration, after_failure: Duration) {
            self.inner.linger(ranks, me, wait, after_failure)
        }
        fn post_counts(&self, rank: Rank, counts: &[duplex::trace::ChannelCount]) {
            self.gated(|| self.inner.post_counts(rank, counts))
        }
        fn counts_of(
            &self,
            me: Rank,
            peers: &[Rank],
            wait: Duration,
        ) -> std::result::Result<Option<crate::health::Heard>, String> {
            self.gated(|| self.inner.counts_of(me, peers, wait))
        }
        fn post_owed(
            &self,
            rank: Rank,
            to: Rank,
            counts: &[duplex::trace::ChannelCount],
        ) -> std::result::Result<(), String> {
            self.gated(|| self.inner.post_owed(rank, to, counts))
        }
        fn owed_to(
            &self,
            me: Rank,
        ) -> std::result::Result<std::collections::BTreeMap<Rank, crate::health::Owed>, String>
        {
            self.gated(|| self.inner.owed_to(me))
        }
        fn left(&self, rank: Rank) {
            self.inner.left(rank)
        }
    }

    /// Of two ranks finishing at once, at least one sees the other's post,
    /// however their requests interleave, even with no wait at all: every
    /// order of the sender's five ordered requests (its counts, its list,
    /// its look, leaving its sends, its last look) and the receiver's two
    /// (its counts, its list) judges the unreceived send.
    #[test]
    fn an_unreceived_send_is_judged_however_two_finishing_ranks_interleave() {
        let (sender, receiver) = (5, 2);
        let mut orders = 0;
        for mask in 0u32..1 << (sender + receiver) {
            if mask.count_ones() != receiver {
                continue;
            }
            orders += 1;
            let schedule: Vec<usize> = (0..sender + receiver)
                .map(|k| usize::from(mask >> k & 1 == 1))
                .collect();
            let (regs, hs) = pair(1, 0);
            let turns = Arc::new((
                std::sync::Mutex::new(Turns {
                    schedule: schedule.clone(),
                    next: 0,
                    done: [false; 2],
                }),
                std::sync::Condvar::new(),
            ));
            let ends: Vec<_> = (0..2)
                .map(|r| {
                    let reg = regs[r].clone();
                    let h = Scripted {
                        inner: hs[r].clone(),
                        me: r,
                        turns: turns.clone(),
                    };
                    std::thread::spawn(move || {
                        let e = finish_remote(&reg, &h, r as Rank, Duration::ZERO);
                        h.done();
                        e
                    })
                })
                .collect();
            let ends: Vec<Option<Error>> =
                ends.into_iter().map(|t| t.join().expect("joins")).collect();
            assert!(
                ends.iter().any(Option::is_some),
                "nobody judged under {schedule:?}"
            );
            for e in ends.into_iter().flatten() {
                never_received(Some(e), 0);
            }
        }
        assert_eq!(orders, 21);
    }

    /// `DUPLEX_TIMEOUT_MS` takes a whole number of milliseconds, at least
    /// 1; anything else is refused with the value and what to give, where
    /// it once fell back to 10 s without a word.
    #[test]
    fn a_deadline_that_is_not_a_whole_number_of_milliseconds_is_refused() {
        for good in ["1", "250", " 5000 ", "600000"] {
            assert_eq!(
                good.parse::<TimeoutMs>().map(|t| t.0),
                Ok(good.trim().parse().expect("a number"))
            );
        }
        for bad in [
            "",
            "0",
            "-5",
            "1.5",
            "10s",
            "abc",
            "99999999999999999999999",
        ] {
            let e = bad.parse::<TimeoutMs>().err().expect(bad);
            assert!(
                e.contains(&format!("`{bad}`")) && e.contains("milliseconds"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn the_store_port_is_one_above_master_port_or_a_clear_error() {
        assert_eq!(store_port(29500).ok(), Some(29501));
        assert_eq!(store_port(65534).ok(), Some(65535));
        for bad in [0, 65535, 65536, 70000] {
            let e = store_port(bad).expect_err("no such port").to_string();
            assert!(e.contains("DUPLEX_PORT"), "{e}");
        }
    }

    #[test]
    fn without_nccl_or_a_gpu_the_error_says_what_is_missing_and_how_to_fix_it() {
        match Local::new(2) {
            Ok(_) => {} // a machine with NCCL and two GPUs: nothing to check here
            Err(Error::Unavailable { what, how }) => {
                assert!(!what.is_empty());
                assert!(
                    how.contains("DUPLEX_NCCL_LIBRARY")
                        || how.contains("LD_LIBRARY_PATH")
                        || how.contains("GPU"),
                    "{how}"
                );
            }
            Err(e) => panic!("expected Unavailable, got {e}"),
        }
    }

    #[test]
    fn a_missing_torchrun_variable_is_named() {
        // The test process has no RANK (cargo test does not set it).
        if std::env::var_os("RANK").is_none() {
            let e = Process::from_env().unwrap_err().to_string();
            assert!(e.contains("RANK") && e.contains("torchrun"), "{e}");
        }
    }

    #[test]
    fn an_nccl_error_after_a_mismatched_setup_says_so() {
        let nccl = || Error::Library {
            library: "NCCL",
            call: "ncclCommGetAsyncError".into(),
            code: 3,
            text: "internal error".into(),
        };
        let setups = vec!["setup round 1 of comm world between ranks 0 and 1: ...".to_string()];
        let e = with_mismatched_setups(nccl(), &setups).to_string();
        assert!(
            e.starts_with("NCCL error 3 in ncclCommGetAsyncError: internal error; the model finds a connection set up from mismatched calls")
                && e.ends_with("(R7): setup round 1 of comm world between ranks 0 and 1: ..."),
            "{e}"
        );
        let aborted = with_mismatched_setups(Error::Aborted("x".into()), &setups).to_string();
        assert!(aborted.contains("(R7): setup round 1"), "{aborted}");
        assert_eq!(
            with_mismatched_setups(nccl(), &[]).to_string(),
            nccl().to_string()
        );
        let user = with_mismatched_setups(Error::User("mine".into()), &setups);
        assert_eq!(user.to_string(), "mine", "only NCCL's errors and aborts");
    }

    #[test]
    fn the_worst_error_of_the_ranks_is_reported() {
        let hang = Error::Hang(Box::new(duplex::Hang {
            context: String::new(),
            stuck: duplex::report::Stuck {
                cycle: vec![],
                missing: vec![],
                blocked: vec![],
                ops: vec![],
                note: None,
                mismatched_setups: vec![],
            },
            steps: vec![],
            schedule: None,
            replay: None,
            disagreements: vec![],
        }));
        let r = combine(vec![
            Err(Error::Aborted("echo".into())),
            Err(hang),
            Ok(RankReport {
                rank: 2,
                setup_ms: 0.0,
                lanes: vec![],
                model_refused: None,
            }),
        ]);
        assert!(matches!(r, Err(Error::Hang(_))));
    }
}
