//! The janitor's processes: worker processes and a reconciler, started from this binary's
//! hidden `worker` and `reconcile` commands (the service's own code) or from a given
//! `registry-janitor` binary, configured by `JANITOR_*` variables only. Killed, paused
//! and started again by the nemesis, as Kubernetes would restart a pod; their exits and
//! their memory are watched. Where the run makes partitions, each process (a new one
//! after a kill too) runs in its network namespace, with its own `redis_url`
//! ([`Place`]).

use std::{
    fs::File,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

use registry_janitor::{
    config::Settings,
    error::{Error, Result},
};

/// The janitor's settings as the environment of its processes. Every other `JANITOR_*`
/// variable of this process is left out, so that the run is what its flags say.
pub fn janitor_env(s: &Settings) -> Vec<(String, String)> {
    let mut env = vec![
        ("JANITOR_REDIS_URL", s.redis_url.clone()),
        ("JANITOR_KEY_PREFIX", s.key_prefix.clone()),
        ("JANITOR_LAYOUT", s.layout.as_str().to_owned()),
        ("JANITOR_CHUNK_SIZE", s.chunk_size.to_string()),
        ("JANITOR_CONCURRENCY", s.concurrency.to_string()),
        ("JANITOR_CHUNKS_IN_FLIGHT", s.chunks_in_flight.to_string()),
        ("JANITOR_CLAIM_MIN_IDLE_MS", s.claim_min_idle_ms.to_string()),
        ("JANITOR_MAX_DELIVERIES", s.max_deliveries.to_string()),
        ("JANITOR_BLOCK_MS", s.block_ms.to_string()),
        (
            "JANITOR_HEARTBEAT_GRACE_MS",
            s.heartbeat_grace_ms.to_string(),
        ),
        (
            "JANITOR_RECONCILE_INTERVAL_MS",
            s.reconcile_interval_ms.to_string(),
        ),
        (
            "JANITOR_KEYSPACE_EVENTS_AUTO",
            s.keyspace_events_auto.to_string(),
        ),
        (
            "JANITOR_GUARD_HOLD_GRACE_MS",
            s.guard_hold_grace_ms.to_string(),
        ),
        ("JANITOR_DRAIN_TIMEOUT_MS", s.drain_timeout_ms.to_string()),
        ("JANITOR_LATENCY_TARGET_MS", s.latency_target_ms.to_string()),
        ("JANITOR_STEP_ORDER", s.step_order.as_str().to_owned()),
        ("JANITOR_MAX_PAYLOAD_BYTES", s.max_payload_bytes.to_string()),
        (
            "JANITOR_MAINTENANCE_INTERVAL_MS",
            s.maintenance_interval_ms.to_string(),
        ),
        ("JANITOR_EVICTIONS", "true".to_owned()),
        ("JANITOR_EVICTIONS_STREAM", s.evictions_stream.clone()),
        ("JANITOR_METRICS_ADDR", "off".to_owned()),
    ];
    if s.uses_sentinel() {
        let urls: Vec<String> = s.redis_sentinels.iter().map(|u| format!("{u:?}")).collect();
        env.push(("JANITOR_REDIS_SENTINELS", format!("[{}]", urls.join(","))));
        env.push((
            "JANITOR_REDIS_SENTINEL_MASTER",
            s.redis_sentinel_master.clone().unwrap_or_default(),
        ));
    }
    if s.redis_cluster {
        let urls: Vec<String> = s
            .redis_cluster_seeds
            .iter()
            .map(|u| format!("{u:?}"))
            .collect();
        env.push(("JANITOR_REDIS_CLUSTER", "true".to_owned()));
        env.push((
            "JANITOR_REDIS_CLUSTER_SEEDS",
            format!("[{}]", urls.join(",")),
        ));
    }
    env.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
}

/// What a process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Worker(usize),
    Reconciler,
}

impl Role {
    pub fn name(self) -> String {
        match self {
            Role::Worker(i) => format!("worker-{i}"),
            Role::Reconciler => "reconciler".into(),
        }
    }
}

/// One process slot: the process running now (if any) and what is known of it.
pub struct Proc {
    pub role: Role,
    child: Option<Child>,
    /// Processes started in this slot so far (the first is 1).
    pub generation: u32,
    started: Instant,
    pub stopped: bool,
    log: PathBuf,
    /// Resident memory: the largest of the first [`WARM_UP`], and the largest since.
    pub rss_baseline: Option<u64>,
    pub rss_max: u64,
    pub rss_last: u64,
    pub rss_first: Option<u64>,
}

/// How long a process's memory is watched before its baseline is fixed.
const WARM_UP: Duration = Duration::from_secs(20);

/// How far a process's resident memory may grow past its baseline: half of it, at least
/// 24 MiB (allocator arenas and caches settle; a leak per event or per user does not).
pub fn rss_bound(baseline: u64) -> u64 {
    baseline + (baseline / 2).max(24 << 20)
}

/// An exit nobody asked for.
pub struct Exit {
    pub name: String,
    pub status: ExitStatus,
    pub log: PathBuf,
}

/// Where a process runs: in network namespace `netns` (`ip netns exec`), reaching Redis
/// at `redis_url`.
#[derive(Debug, Clone)]
pub struct Place {
    pub netns: String,
    pub redis_url: String,
}

/// Every janitor process of the run.
pub struct Janitors {
    exe: PathBuf,
    env: Vec<(String, String)>,
    dir: PathBuf,
    /// The place of each process slot, in the order of `procs`; empty: all on the host.
    places: Vec<Place>,
    pub procs: Vec<Proc>,
    /// The log of every process started: (name, file).
    pub logs: Vec<(String, PathBuf)>,
}

impl Janitors {
    /// Starts `workers` workers and one reconciler from `exe`, their logs in `dir`; in
    /// `places` (one for each worker, then the reconciler's), or on the host if empty.
    pub fn start(
        exe: &Path,
        env: Vec<(String, String)>,
        dir: &Path,
        workers: usize,
        places: Vec<Place>,
    ) -> Result<Self> {
        let mut j = Janitors {
            exe: exe.to_owned(),
            env,
            dir: dir.to_owned(),
            places,
            procs: Vec::new(),
            logs: Vec::new(),
        };
        let roles = (0..workers).map(Role::Worker).chain([Role::Reconciler]);
        for role in roles {
            j.procs.push(Proc {
                role,
                child: None,
                generation: 0,
                started: Instant::now(),
                stopped: false,
                log: PathBuf::new(),
                rss_baseline: None,
                rss_max: 0,
                rss_last: 0,
                rss_first: None,
            });
            let i = j.procs.len() - 1;
            j.spawn(i)?;
        }
        Ok(j)
    }

    pub fn worker_index(&self, worker: usize) -> Option<usize> {
        self.index(Role::Worker(worker))
    }

    /// The slot of `role`.
    pub fn index(&self, role: Role) -> Option<usize> {
        self.procs.iter().position(|p| p.role == role)
    }

    fn spawn(&mut self, i: usize) -> Result<()> {
        let p = &mut self.procs[i];
        p.generation += 1;
        p.log = self
            .dir
            .join(format!("{}.{}.log", p.role.name(), p.generation));
        let log = File::create(&p.log).map_err(|e| Error::io("creating a process log", e))?;
        self.logs.push((
            format!("{} (process {})", p.role.name(), p.generation),
            p.log.clone(),
        ));
        let command = match p.role {
            Role::Worker(_) => "worker",
            Role::Reconciler => "reconcile",
        };
        let place = self.places.get(i);
        let mut cmd = match place {
            Some(place) => {
                let mut cmd = Command::new("ip");
                cmd.args(["netns", "exec", &place.netns]).arg(&self.exe);
                cmd
            }
            None => Command::new(&self.exe),
        };
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("JANITOR_") {
                cmd.env_remove(k);
            }
        }
        if let Role::Worker(w) = p.role {
            cmd.env(
                "JANITOR_CONSUMER_NAME",
                format!("nemesis-w{w}-{}", p.generation),
            );
        }
        cmd.arg(command).envs(self.env.iter().map(|(k, v)| (k, v)));
        if let Some(place) = place {
            cmd.env("JANITOR_REDIS_URL", &place.redis_url);
        }
        let child = cmd
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| Error::io(format!("starting {}", self.exe.display()), e))?;
        p.child = Some(child);
        p.started = Instant::now();
        p.stopped = false;
        p.rss_baseline = None;
        p.rss_max = 0;
        p.rss_first = None;
        Ok(())
    }

    /// SIGKILL the process of slot `i` (waited for: no zombie is left).
    pub fn kill(&mut self, i: usize) -> bool {
        match self.procs[i].child.take() {
            Some(mut child) => {
                let _ = child.kill();
                let _ = child.wait();
                self.procs[i].stopped = false;
                true
            }
            None => false,
        }
    }

    /// Starts a new process in slot `i` (after [`Janitors::kill`]).
    pub fn respawn(&mut self, i: usize) -> Result<()> {
        if self.procs[i].child.is_some() {
            return Ok(());
        }
        self.spawn(i)
    }

    /// Sends `signal` (`STOP`, `CONT`, `TERM`) to the process of slot `i`; its pid, if it runs.
    pub fn signal(&mut self, i: usize, signal: &str) -> Option<u32> {
        let pid = self.procs[i].child.as_ref()?.id();
        let ok = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            match signal {
                "STOP" => self.procs[i].stopped = true,
                "CONT" => self.procs[i].stopped = false,
                _ => {}
            }
        }
        ok.then_some(pid)
    }

    pub fn pid(&self, i: usize) -> Option<u32> {
        self.procs[i].child.as_ref().map(|c| c.id())
    }

    /// Processes that exited by themselves since the last look (their slots are left
    /// empty).
    pub fn exits(&mut self) -> Vec<Exit> {
        let mut out = Vec::new();
        for p in &mut self.procs {
            let Some(child) = p.child.as_mut() else {
                continue;
            };
            if let Ok(Some(status)) = child.try_wait() {
                p.child = None;
                out.push(Exit {
                    name: format!("{} (process {})", p.role.name(), p.generation),
                    status,
                    log: p.log.clone(),
                });
            }
        }
        out
    }

    /// Samples every process's resident memory; returns the processes past their bound
    /// (name, baseline, now).
    pub fn sample_memory(&mut self) -> Vec<(String, u64, u64)> {
        let mut over = Vec::new();
        for p in &mut self.procs {
            let Some(pid) = p.child.as_ref().map(|c| c.id()) else {
                continue;
            };
            let Some(rss) = rss(pid) else { continue };
            p.rss_last = rss;
            p.rss_max = p.rss_max.max(rss);
            p.rss_first.get_or_insert(rss);
            match p.rss_baseline {
                None if p.started.elapsed() >= WARM_UP => p.rss_baseline = Some(p.rss_max),
                Some(base) if rss > rss_bound(base) => over.push((
                    format!("{} (process {})", p.role.name(), p.generation),
                    base,
                    rss,
                )),
                _ => {}
            }
        }
        over
    }

    /// SIGCONT to every stopped process, and a new process in every empty slot.
    pub fn heal(&mut self) -> Result<()> {
        for i in 0..self.procs.len() {
            if self.procs[i].stopped {
                self.signal(i, "CONT");
            }
            if self.procs[i].child.is_none() {
                self.spawn(i)?;
            }
        }
        Ok(())
    }

    /// SIGTERM to every process; waits up to `timeout` for each; returns each process's
    /// exit code (None: it had to be killed).
    pub fn terminate(&mut self, timeout: Duration) -> Vec<(String, Option<i32>, PathBuf)> {
        for i in 0..self.procs.len() {
            self.signal(i, "CONT");
            self.signal(i, "TERM");
        }
        let deadline = Instant::now() + timeout;
        let mut out = Vec::new();
        for p in &mut self.procs {
            let Some(mut child) = p.child.take() else {
                continue;
            };
            let code = loop {
                if let Ok(Some(status)) = child.try_wait() {
                    break status.code();
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    break None;
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            out.push((p.role.name(), code, p.log.clone()));
        }
        out
    }
}

impl Drop for Janitors {
    fn drop(&mut self) {
        for i in 0..self.procs.len() {
            self.kill(i);
        }
    }
}

/// Resident memory of a process (VmRSS), in bytes.
pub fn rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// The last `lines` lines of a log file.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
