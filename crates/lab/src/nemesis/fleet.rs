//! The connection servers, simulated in this process through the protocol, and the truth
//! they hold: which entry is registered on which server right now, and which servers are
//! dead.
//!
//! Each server heartbeats (heartbeat.lua, through [`Registry`]) from its start to its
//! death; users connect, move between servers, disconnect (unregister.lua) and are looked
//! up (route.lua) all along. A registration is register.lua (register_conn.lua in layout
//! `conns`) in a MULTI with a read of the entry it replaces: the protocol's own write,
//! plus the oracle that tells, atomically, whether the janitor had deleted the entry
//! (previous owner none), or whether the entry was still there and is kept (previous
//! owner the dead server). That is what the evictions stream is checked against.
//!
//! On a Redis Cluster the forward entry and the server's keys are in different slots, so
//! no MULTI holds both. A registration there takes the protocol's cluster steps (the
//! fence read; the forward entry; register.lua on the server's keys alone, which checks
//! the fence and adds the member; release.lua if that was refused), and the forward entry
//! is written by a script that returns the entry it replaces: the oracle is atomic with
//! the write itself, in the entry's slot, which is all it needs (nothing but the load
//! and the janitor write entries, and the janitor only deletes them).
//!
//! An operation that fails without an answer (Redis killed, BUSY, a timeout) may or may
//! not have been applied: its entry is *uncertain* (any of the owners it may have) until
//! the next registration reads it again. Uncertain entries are left out of the checks
//! that need to know the owner.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex, MutexGuard,
    },
    time::{Duration, Instant},
};

use rand::{rngs::StdRng, Rng, SeedableRng};
use registry_janitor::{
    config::Layout,
    conn::RedisConn,
    error::Error,
    event::{ServerDead, ServerId},
    keys::{self, Keys},
    registry::Registry,
    stream,
};
use tokio_util::sync::CancellationToken;

use super::verdicts::{invariant, Verdicts};

static REGISTER: &str = include_str!("../../../../protocol/register.lua");
static REGISTER_CONN: &str = include_str!("../../../../protocol/register_conn.lua");
static RELEASE: &str = include_str!("../../../../protocol/release.lua");

/// On a cluster: the forward entry written (HSET of a field, or SET), the value it
/// replaces returned, in one script of the entry's slot.
/// `KEYS[1]` the forward key, `ARGV[1]` the field (`''` for SET), `ARGV[2]` the server,
/// `ARGV[3]` `'hash'` (a field) or `'keys'`.
const WRITE_READING: &str = r"
local prev
if ARGV[3] == 'hash' then
  prev = redis.call('HGET', KEYS[1], ARGV[1])
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
else
  prev = redis.call('GET', KEYS[1])
  redis.call('SET', KEYS[1], ARGV[2])
end
return prev";

/// The fleet's shape and pace.
#[derive(Debug, Clone)]
pub struct Params {
    pub layout: Layout,
    /// Entries: users (layouts `hash`, `keys`) or connections, two per user (`conns`).
    pub entries: usize,
    pub slots: usize,
    /// Operations per second (registrations, moves, unregisters, lookups).
    pub rate: u32,
    /// Liveness TTL of every heartbeat.
    pub ttl: Duration,
    pub heartbeat_every: Duration,
    /// An entry is live once registered on a live server, and neither moved nor
    /// unregistered since, for this long.
    pub settle: Duration,
    /// Longest a dead server may wait for its fence, or its events for their
    /// acknowledgement.
    pub deadline: Duration,
}

/// What is known of one entry's owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Owner {
    Known(Option<ServerId>),
    /// An operation failed without an answer: any of these.
    Uncertain(Vec<Option<ServerId>>),
}

/// A server, or `none`.
pub fn named(owner: &Option<ServerId>) -> String {
    owner
        .as_ref()
        .map_or_else(|| "none".into(), |s| s.to_string())
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Owner::Known(o) => f.write_str(&named(o)),
            Owner::Uncertain(all) => {
                let all: Vec<String> = all.iter().map(named).collect();
                write!(f, "uncertain: one of {}", all.join(", "))
            }
        }
    }
}

pub struct Member {
    pub bytes: Vec<u8>,
    pub owner: Owner,
    /// When `owner` last changed.
    pub since: Instant,
    /// An operation on it is in flight.
    pub busy: bool,
    /// Bumped at the start and the end of every operation.
    pub version: u64,
    /// Every server a registration of it was sent to.
    pub attempted: Vec<ServerId>,
    history: VecDeque<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Started, no heartbeat answered yet.
    Starting,
    Live,
    /// Hung: neither heartbeats nor writes, until its fence stands.
    Zombie,
    Dead,
}

/// What one server's heartbeats saw: for telling a starved harness from a Redis outage.
#[derive(Debug, Clone, Default)]
pub struct Heartbeats {
    last_attempt: Option<Instant>,
    /// Longest time between two heartbeat attempts (this process's own pace).
    max_attempt_gap: Duration,
    /// Start of the last heartbeat that was answered 1.
    last_ok_start: Option<Instant>,
    /// Longest time from the start of one answered heartbeat to the answer of the next:
    /// at least the longest time the liveness key went without a refresh.
    max_ok_gap: Duration,
    pub ok: u64,
    pub refused: u64,
}

pub struct Server {
    pub id: ServerId,
    pub slot: usize,
    pub state: State,
    pub live_since: Option<Instant>,
    pub died: Option<Instant>,
    /// How it died: `crash`, `zone`, `zombie`, `fenced while live`.
    pub how: &'static str,
    /// Every entry a registration was sent for on it.
    pub members_ever: HashSet<usize>,
    pub heartbeats: Heartbeats,
    /// When the observer (or the zombie) first saw its fence.
    pub fence_seen: Option<Instant>,
}

pub struct Slot {
    pub current: Option<ServerId>,
    incarnations: u32,
}

/// A deletion the janitor made that the evictions stream must announce once.
pub struct Expected {
    pub server: ServerId,
    pub member: usize,
    pub at: Instant,
}

pub struct Truth {
    pub members: Vec<Member>,
    pub by_bytes: HashMap<Vec<u8>, usize>,
    pub servers: HashMap<ServerId, Server>,
    pub slots: Vec<Slot>,
    pub expected: Vec<Expected>,
    expected_set: HashSet<(ServerId, usize)>,
    /// (dead server, entry): a registration found the entry still naming the dead server
    /// and replaced it; the janitor must never announce it.
    pub kept: HashSet<(ServerId, usize)>,
    rng: StdRng,
}

impl Truth {
    pub fn is_live(&self, s: &ServerId) -> bool {
        self.servers.get(s).is_some_and(|s| s.state == State::Live)
    }

    fn live_servers(&self) -> Vec<ServerId> {
        self.slots
            .iter()
            .filter_map(|s| s.current.clone())
            .filter(|s| self.is_live(s))
            .collect()
    }

    /// The history of entry `m`, for a report.
    pub fn describe(&self, m: usize) -> String {
        let member = &self.members[m];
        format!(
            "entry {} (owner {}; registered on {}); last operations:\n      {}",
            show(&member.bytes),
            member.owner,
            member
                .attempted
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            member
                .history
                .iter()
                .cloned()
                .collect::<Vec<_>>()
                .join("\n      ")
        )
    }

    pub fn describe_server(&self, s: &ServerId) -> String {
        match self.servers.get(s) {
            Some(server) => format!(
                "server {} (slot {}, {}; {} entries ever; heartbeats {} ok, {} refused, \
                 longest gap between attempts {} ms, between answered ones {} ms)",
                s,
                server.slot,
                match server.state {
                    State::Dead | State::Zombie => format!("dead: {}", server.how),
                    State::Live => "live".into(),
                    State::Starting => "starting".into(),
                },
                server.members_ever.len(),
                server.heartbeats.ok,
                server.heartbeats.refused,
                server.heartbeats.max_attempt_gap.as_millis(),
                server.heartbeats.max_ok_gap.as_millis()
            ),
            None => format!("server {s} (not one of the fleet's)"),
        }
    }

    fn expect_deleted(&mut self, server: &ServerId, m: usize) {
        if self.expected_set.insert((server.clone(), m)) {
            self.expected.push(Expected {
                server: server.clone(),
                member: m,
                at: Instant::now(),
            });
        }
    }

    /// Records that the janitor deleted the entry of `m` on dead `server`: it must be
    /// announced.
    pub fn expect_deleted_pub(&mut self, server: &ServerId, m: usize) {
        self.expect_deleted(server, m)
    }
}

/// Bytes as text where they are, escaped where not.
pub fn show(bytes: &[u8]) -> String {
    format!("{:?}", String::from_utf8_lossy(bytes))
}

#[derive(Default)]
pub struct Stats {
    pub registers: AtomicU64,
    pub moves: AtomicU64,
    pub reconnects: AtomicU64,
    pub unregisters: AtomicU64,
    pub routes: AtomicU64,
    pub op_errors: AtomicU64,
    pub refused_fenced: AtomicU64,
    pub found_deleted: AtomicU64,
    pub found_kept: AtomicU64,
    pub servers_started: AtomicU64,
    pub servers_died: AtomicU64,
    pub zombies_told: AtomicU64,
    pub monitoring_events: AtomicU64,
}

/// An entry of a live server found deleted.
struct Lost {
    server: ServerId,
    what: String,
    keys: Vec<String>,
}

/// What a registration found and did.
struct Told {
    prev: Option<String>,
    outcome: Result<(), String>,
    /// On a cluster: whether the forward entry was written (the entry read in `prev`
    /// was replaced), and if register.lua then refused, whether release.lua deleted it
    /// again (None: no answer).
    written: bool,
    released: Option<bool>,
}

pub struct Fleet {
    pub keys: Keys,
    pub registry: Registry,
    pub params: Params,
    conn: RedisConn,
    heartbeat_conn: RedisConn,
    verdicts: Arc<Verdicts>,
    truth: Mutex<Truth>,
    pub stats: Stats,
    /// Users connect, move and leave while set (cleared for the quiet end of the run).
    pub churn: AtomicBool,
    /// On a Redis Cluster.
    pub cluster: bool,
    /// When the nemesis SIGKILLed a worker: on a cluster a worker killed between a
    /// chunk's deletes and their announcement may leave a deletion unannounced.
    pub worker_kills: Mutex<Vec<Instant>>,
    stop: CancellationToken,
    start: Instant,
}

pub enum Op {
    Register {
        m: usize,
        to: ServerId,
        kind: &'static str,
    },
    Unregister {
        m: usize,
        from: ServerId,
    },
    Route {
        m: usize,
    },
}

impl Fleet {
    pub fn new(
        keys: Keys,
        params: Params,
        conn: RedisConn,
        heartbeat_conn: RedisConn,
        verdicts: Arc<Verdicts>,
        seed: u64,
        stop: CancellationToken,
    ) -> Arc<Fleet> {
        let now = Instant::now();
        let members: Vec<Member> = (0..params.entries)
            .map(|n| Member {
                bytes: entry_bytes(params.layout, n),
                owner: Owner::Known(None),
                since: now,
                busy: false,
                version: 0,
                attempted: Vec::new(),
                history: VecDeque::new(),
            })
            .collect();
        let by_bytes = members
            .iter()
            .enumerate()
            .map(|(i, m)| (m.bytes.clone(), i))
            .collect();
        let slots = (0..params.slots)
            .map(|_| Slot {
                current: None,
                incarnations: 0,
            })
            .collect();
        Arc::new(Fleet {
            cluster: conn.is_cluster(),
            worker_kills: Mutex::default(),
            registry: Registry::new(keys.clone(), params.layout),
            keys,
            params,
            conn,
            heartbeat_conn,
            verdicts,
            truth: Mutex::new(Truth {
                members,
                by_bytes,
                servers: HashMap::new(),
                slots,
                expected: Vec::new(),
                expected_set: HashSet::new(),
                kept: HashSet::new(),
                rng: StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15),
            }),
            stats: Stats::default(),
            churn: AtomicBool::new(true),
            stop,
            start: now,
        })
    }

    pub fn truth(&self) -> MutexGuard<'_, Truth> {
        self.truth.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn t(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Starts a server in every slot and waits until each has heartbeated; then
    /// registers `share` of the entries.
    pub async fn start(self: &Arc<Self>, share: f64) {
        for slot in 0..self.params.slots {
            self.start_server(slot);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.truth().live_servers().len() < self.params.slots && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let n = (self.params.entries as f64 * share) as usize;
        let mut joins = tokio::task::JoinSet::new();
        for m in 0..n {
            let to = {
                let mut t = self.truth();
                let live = t.live_servers();
                let to = live[t.rng.random_range(0..live.len())].clone();
                t.members[m].busy = true;
                to
            };
            let me = self.clone();
            joins.spawn(async move { me.register(m, to, "connect").await });
            while joins.len() >= 32 {
                joins.join_next().await;
            }
        }
        while joins.join_next().await.is_some() {}
    }

    /// A new incarnation in `slot`: heartbeats from now on; live once one is answered.
    pub fn start_server(self: &Arc<Self>, slot: usize) -> ServerId {
        let id = {
            let mut t = self.truth();
            t.slots[slot].incarnations += 1;
            let id = ServerId::parse(&format!("gw-{slot}#{}", t.slots[slot].incarnations))
                .expect("a valid server id");
            t.slots[slot].current = Some(id.clone());
            t.servers.insert(
                id.clone(),
                Server {
                    id: id.clone(),
                    slot,
                    state: State::Starting,
                    live_since: None,
                    died: None,
                    how: "",
                    members_ever: HashSet::new(),
                    heartbeats: Heartbeats::default(),
                    fence_seen: None,
                },
            );
            id
        };
        self.stats.servers_started.fetch_add(1, Ordering::Relaxed);
        let me = self.clone();
        let server = id.clone();
        tokio::spawn(async move { me.heartbeat_loop(server).await });
        id
    }

    async fn heartbeat_loop(self: Arc<Self>, server: ServerId) {
        let ttl = self.params.ttl.as_millis() as u64;
        loop {
            {
                let t = self.truth();
                match t.servers.get(&server).map(|s| s.state) {
                    Some(State::Starting | State::Live) => {}
                    _ => return,
                }
            }
            if self.stop.is_cancelled() {
                return;
            }
            let started = Instant::now();
            {
                let mut t = self.truth();
                let hb = &mut t.servers.get_mut(&server).expect("known").heartbeats;
                if let Some(last) = hb.last_attempt {
                    hb.max_attempt_gap = hb.max_attempt_gap.max(started - last);
                }
                hb.last_attempt = Some(started);
            }
            let reply = self
                .registry
                .heartbeat(&self.heartbeat_conn, &server, ttl)
                .await;
            let mut fenced = false;
            {
                let mut t = self.truth();
                let s = t.servers.get_mut(&server).expect("known");
                match reply {
                    Ok(()) if matches!(s.state, State::Starting | State::Live) => {
                        let hb = &mut s.heartbeats;
                        if let Some(last) = hb.last_ok_start {
                            hb.max_ok_gap = hb.max_ok_gap.max(started.elapsed() + (started - last));
                        }
                        hb.last_ok_start = Some(started);
                        hb.ok += 1;
                        if s.state == State::Starting {
                            s.state = State::Live;
                            s.live_since = Some(Instant::now());
                        }
                    }
                    Ok(()) => {}
                    Err(Error::Fenced { .. }) => fenced = true,
                    Err(_) => s.heartbeats.refused += 1,
                }
            }
            if fenced {
                self.fenced_while_live(&server, "its heartbeat was refused as FENCED");
                return;
            }
            let every = self.params.heartbeat_every;
            tokio::select! {
                _ = tokio::time::sleep(every.saturating_sub(started.elapsed())) => {}
                _ = self.stop.cancelled() => return,
            }
        }
    }

    /// A server this process kept alive was fenced (`invariant` = fencing), or lost an
    /// entry (live entries kept). Either this process starved (its heartbeats were not
    /// even sent for a liveness TTL: the janitor was right to find it silent), or the
    /// janitor took a live server for dead: while its liveness key stood, or after
    /// heartbeats that Redis refused (an outage, which the guard must ride out). The
    /// server then starts again under a new id, as the protocol says.
    pub fn lost_live(
        self: &Arc<Self>,
        server: &ServerId,
        invariant: &'static str,
        what: String,
        mut keys: Vec<String>,
    ) {
        let ttl = self.params.ttl;
        let verdict = {
            let mut t = self.truth();
            let Some(s) = t.servers.get_mut(server) else {
                return;
            };
            if !matches!(s.state, State::Live | State::Starting) {
                return;
            }
            let now = Instant::now();
            let hb = &s.heartbeats;
            let attempt_gap = hb
                .max_attempt_gap
                .max(hb.last_attempt.map_or(Duration::ZERO, |l| now - l));
            let ok_gap = hb
                .max_ok_gap
                .max(hb.last_ok_start.map_or(Duration::ZERO, |l| now - l));
            let verdict = if ok_gap < ttl {
                Some(format!(
                    "{what}, although its liveness key never went a TTL ({} ms) without a \
                     refresh (longest {} ms)",
                    ttl.as_millis(),
                    ok_gap.as_millis()
                ))
            } else if attempt_gap + Duration::from_millis(500) >= ttl {
                None
            } else {
                Some(format!(
                    "{what}, after a Redis outage: it sent a heartbeat at least every {} ms, \
                     Redis refused {} of them, and the liveness key went {} ms without a refresh",
                    attempt_gap.as_millis(),
                    hb.refused,
                    ok_gap.as_millis()
                ))
            };
            keys.push(t.describe_server(server));
            let s = t.servers.get_mut(server).expect("known");
            s.state = State::Dead;
            s.died = Some(now);
            s.how = "taken for dead while live";
            verdict.ok_or(attempt_gap)
        };
        match verdict {
            Ok(what) => self.verdicts.violation(invariant, what, keys),
            Err(gap) => self.verdicts.note(format!(
                "{what}; this process had sent it no heartbeat for {} ms (the harness \
                 starved: the janitor was right); it starts again under a new id",
                gap.as_millis()
            )),
        }
        self.stats.servers_died.fetch_add(1, Ordering::Relaxed);
        self.after_death(server, Duration::ZERO);
    }

    fn fenced_while_live(self: &Arc<Self>, server: &ServerId, how: &str) {
        self.lost_live(
            server,
            invariant::FENCING,
            format!("live server {server} was fenced ({how})"),
            Vec::new(),
        );
    }

    /// After `server` died: most of its users reconnect elsewhere over the next seconds
    /// (racing its cleanup), and its slot starts a new incarnation after `back_after`.
    fn after_death(self: &Arc<Self>, server: &ServerId, back_after: Duration) {
        let (slot, reconnects) = {
            let mut t = self.truth();
            let Some(s) = t.servers.get(server) else {
                return;
            };
            let slot = s.slot;
            let mine: Vec<usize> = s
                .members_ever
                .iter()
                .copied()
                .filter(|&m| t.members[m].owner == Owner::Known(Some(server.clone())))
                .collect();
            let mut reconnects = Vec::new();
            for m in mine {
                if t.rng.random_bool(0.6) {
                    let delay = Duration::from_millis(t.rng.random_range(0..8000));
                    reconnects.push((m, delay));
                }
            }
            if t.slots[slot].current.as_ref() == Some(server) {
                t.slots[slot].current = None;
            }
            (slot, reconnects)
        };
        for (m, delay) in reconnects {
            let me = self.clone();
            let dead = server.clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                me.reconnect(m, &dead).await;
            });
        }
        let me = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(back_after).await;
            if !me.stop.is_cancelled() {
                me.start_server(slot);
            }
        });
    }

    /// Entry `m`, of dead `server`, reconnects to a live server (if it is still there).
    async fn reconnect(self: &Arc<Self>, m: usize, dead: &ServerId) {
        let to = {
            let mut t = self.truth();
            let member = &t.members[m];
            if member.busy || member.owner != Owner::Known(Some(dead.clone())) {
                return;
            }
            let live = t.live_servers();
            if live.is_empty() || self.stop.is_cancelled() || !self.churn.load(Ordering::Relaxed) {
                return;
            }
            let to = live[t.rng.random_range(0..live.len())].clone();
            t.members[m].busy = true;
            t.members[m].version += 1;
            to
        };
        self.stats.reconnects.fetch_add(1, Ordering::Relaxed);
        self.register(m, to, "reconnect").await;
    }

    /// Crashes the servers of `slots` at once (the live ones); returns those crashed.
    pub fn crash(
        self: &Arc<Self>,
        slots: &[usize],
        back_after: Duration,
        how: &'static str,
    ) -> Vec<ServerId> {
        let crashed: Vec<ServerId> = {
            let mut t = self.truth();
            let ids: Vec<ServerId> = slots
                .iter()
                .filter_map(|&s| t.slots[s].current.clone())
                .filter(|id| t.is_live(id))
                .collect();
            let now = Instant::now();
            for id in &ids {
                let s = t.servers.get_mut(id).expect("known");
                s.state = State::Dead;
                s.died = Some(now);
                s.how = how;
            }
            ids
        };
        for id in &crashed {
            self.stats.servers_died.fetch_add(1, Ordering::Relaxed);
            self.after_death(id, back_after);
        }
        crashed
    }

    /// Monitoring's `server.dead` for `servers`, once their liveness TTL has passed (a
    /// verdict while the key stands would be a disputed one).
    pub fn report_dead_later(self: &Arc<Self>, servers: Vec<ServerId>) {
        let me = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(me.params.ttl + Duration::from_millis(500)).await;
            for s in servers {
                let event = ServerDead::new(
                    &s,
                    Some("crashed".into()),
                    Some("nemesis-monitoring".into()),
                );
                for _ in 0..20 {
                    if stream::publish_event(&me.conn, &me.keys, &event.encode())
                        .await
                        .is_ok()
                    {
                        me.stats.monitoring_events.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        });
    }

    /// The server of `slot` hangs: no heartbeat, no write, until its fence stands; then it
    /// wakes up, its heartbeat and a registration must be refused with FENCED, and it
    /// starts again under a new id. Returns the zombie, or None if the slot's server is
    /// not live.
    pub fn zombie(self: &Arc<Self>, slot: usize) -> Option<ServerId> {
        let id = {
            let mut t = self.truth();
            let id = t.slots[slot].current.clone()?;
            if !t.is_live(&id) {
                return None;
            }
            let s = t.servers.get_mut(&id).expect("known");
            s.state = State::Zombie;
            s.died = Some(Instant::now());
            s.how = "zombie";
            id
        };
        self.stats.servers_died.fetch_add(1, Ordering::Relaxed);
        let me = self.clone();
        let zombie = id.clone();
        tokio::spawn(async move { me.zombie_wakes(zombie).await });
        Some(id)
    }

    async fn zombie_wakes(self: Arc<Self>, z: ServerId) {
        let fence = self.keys.server_fence(&z);
        let deadline = Instant::now() + self.params.deadline;
        loop {
            if self.stop.is_cancelled() {
                return;
            }
            let exists: Result<bool, _> = redis::cmd("EXISTS")
                .arg(&fence)
                .query_async(&mut self.conn.clone())
                .await;
            if exists == Ok(true) {
                break;
            }
            if Instant::now() > deadline {
                let described = self.truth().describe_server(&z);
                self.verdicts.violation(
                    invariant::DEAD_FOUND,
                    format!(
                        "zombie {z} went silent {} s ago and was never fenced",
                        self.params.deadline.as_secs()
                    ),
                    vec![described],
                );
                return;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        {
            let mut t = self.truth();
            let s = t.servers.get_mut(&z).expect("known");
            s.fence_seen.get_or_insert(Instant::now());
        }
        let nap = Duration::from_millis(self.truth().rng.random_range(0..1500));
        tokio::time::sleep(nap).await;
        // Its heartbeat: FENCED (retried while Redis is away or refusing).
        let ttl = self.params.ttl.as_millis() as u64;
        let mut told = false;
        for _ in 0..60 {
            match self.registry.heartbeat(&self.heartbeat_conn, &z, ttl).await {
                Err(Error::Fenced { .. }) => {
                    told = true;
                    break;
                }
                Ok(()) => {
                    let described = self.truth().describe_server(&z);
                    self.verdicts.violation(
                        invariant::FENCING,
                        format!("the heartbeat of fenced zombie {z} was taken"),
                        vec![described, format!("key {fence}")],
                    );
                    return;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
        // A registration: FENCED, nothing written.
        let offline = {
            let mut t = self.truth();
            let n = t.members.len();
            let mut found = None;
            for _ in 0..50 {
                let m = t.rng.random_range(0..n);
                if !t.members[m].busy && t.members[m].owner == Owner::Known(None) {
                    found = Some(m);
                    break;
                }
            }
            if let Some(m) = found {
                t.members[m].busy = true;
                t.members[m].version += 1;
            }
            found
        };
        if let Some(m) = offline {
            self.register(m, z.clone(), "zombie write").await;
        }
        if told {
            self.stats.zombies_told.fetch_add(1, Ordering::Relaxed);
        }
        {
            let mut t = self.truth();
            t.servers.get_mut(&z).expect("known").state = State::Dead;
        }
        self.after_death(&z, Duration::ZERO);
    }

    /// The load: `rate` operations a second while `churn` is set, at most 16 in flight
    /// (beyond that, operations are dropped rather than queued: Redis may be away).
    pub async fn run_load(self: Arc<Self>) {
        let permits = Arc::new(tokio::sync::Semaphore::new(16));
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut last = Instant::now();
        let mut budget = 0.0f64;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = self.stop.cancelled() => return,
            }
            let now = Instant::now();
            budget = (budget + self.params.rate as f64 * (now - last).as_secs_f64()).min(50.0);
            last = now;
            if !self.churn.load(Ordering::Relaxed) {
                budget = 0.0;
                continue;
            }
            while budget >= 1.0 {
                budget -= 1.0;
                let Ok(permit) = permits.clone().try_acquire_owned() else {
                    break;
                };
                let Some(op) = self.pick() else { continue };
                let me = self.clone();
                tokio::spawn(async move {
                    me.run_op(op).await;
                    drop(permit);
                });
            }
        }
    }

    /// Draws the next operation and marks its entry busy (a lookup marks nothing).
    fn pick(&self) -> Option<Op> {
        let mut guard = self.truth();
        let t: &mut Truth = &mut guard;
        let live = t.live_servers();
        if live.is_empty() {
            return None;
        }
        let n = t.members.len();
        let roll = t.rng.random_range(0..100);
        if roll < 30 {
            return Some(Op::Route {
                m: t.rng.random_range(0..n),
            });
        }
        let want_live = roll < 65;
        let mut found = None;
        for _ in 0..40 {
            let m = t.rng.random_range(0..n);
            let member = &t.members[m];
            let on_live = matches!(&member.owner, Owner::Known(Some(s)) if t.is_live(s));
            if !member.busy && on_live == want_live {
                found = Some(m);
                break;
            }
        }
        let m = found?;
        let op = if roll < 50 {
            let Owner::Known(Some(from)) = t.members[m].owner.clone() else {
                return None;
            };
            let others: Vec<&ServerId> = live.iter().filter(|s| **s != from).collect();
            if others.is_empty() {
                return None;
            }
            let to = others[t.rng.random_range(0..others.len())].clone();
            Op::Register {
                m,
                to,
                kind: "move",
            }
        } else if roll < 65 {
            let Owner::Known(Some(from)) = t.members[m].owner.clone() else {
                return None;
            };
            Op::Unregister { m, from }
        } else {
            let to = live[t.rng.random_range(0..live.len())].clone();
            Op::Register {
                m,
                to,
                kind: "connect",
            }
        };
        t.members[m].busy = true;
        t.members[m].version += 1;
        Some(op)
    }

    async fn run_op(self: &Arc<Self>, op: Op) {
        match op {
            Op::Register { m, to, kind } => self.register(m, to, kind).await,
            Op::Unregister { m, from } => self.unregister(m, from).await,
            Op::Route { m } => self.route(m).await,
        }
    }

    /// Registers entry `m` on `to` (its entry is marked busy by the caller), through the
    /// protocol's script, reading the entry it replaces in the same MULTI.
    pub async fn register(self: &Arc<Self>, m: usize, to: ServerId, kind: &'static str) {
        let bytes = {
            let mut t = self.truth();
            let member = &mut t.members[m];
            member.busy = true;
            if !member.attempted.contains(&to) {
                member.attempted.push(to.clone());
            }
            let bytes = member.bytes.clone();
            if let Some(s) = t.servers.get_mut(&to) {
                s.members_ever.insert(m);
            }
            bytes
        };
        let told = self.tell_register(&bytes, &to).await;
        match kind {
            "move" => self.stats.moves.fetch_add(1, Ordering::Relaxed),
            _ => self.stats.registers.fetch_add(1, Ordering::Relaxed),
        };
        let mut fenced_live = false;
        let mut lost = None;
        {
            let mut t = self.truth();
            let before = t.members[m].owner.clone();
            let line = match &told {
                Ok(told) => format!(
                    "+{:.2}s {kind} to {to}: previous owner {}, {}",
                    self.t(),
                    told.prev.as_deref().unwrap_or("none"),
                    match &told.outcome {
                        Ok(()) => "registered".to_owned(),
                        Err(e) => format!("refused: {e}"),
                    }
                ),
                Err(e) => format!("+{:.2}s {kind} to {to}: no answer ({e})", self.t()),
            };
            push_history(&mut t.members[m], line);
            let owner = match told {
                Err(_) => {
                    self.stats.op_errors.fetch_add(1, Ordering::Relaxed);
                    Owner::Uncertain(widen(&before, Some(to.clone())))
                }
                Ok(Told {
                    prev,
                    outcome,
                    written,
                    released,
                }) => {
                    let prev = prev.and_then(|p| ServerId::parse(&p).ok());
                    let replaced = outcome.is_ok() || written;
                    lost = self.judge_previous(&mut t, m, &before, &prev, replaced);
                    match outcome {
                        Ok(()) => Owner::Known(Some(to.clone())),
                        Err(e) if e.starts_with("FENCED") => {
                            self.stats.refused_fenced.fetch_add(1, Ordering::Relaxed);
                            fenced_live = t.is_live(&to);
                            match (written, released) {
                                (false, _) => Owner::Known(prev),
                                // Released: deleted while it named `to` (by release.lua, or
                                // by the janitor, `to` being fenced).
                                (true, Some(_)) => Owner::Known(None),
                                (true, None) => Owner::Uncertain(vec![None, Some(to.clone())]),
                            }
                        }
                        Err(_) => {
                            self.stats.op_errors.fetch_add(1, Ordering::Relaxed);
                            Owner::Uncertain(widen(&Owner::Known(prev), Some(to.clone())))
                        }
                    }
                }
            };
            let member = &mut t.members[m];
            if member.owner != owner {
                member.since = Instant::now();
            }
            member.owner = owner;
            member.busy = false;
            member.version += 1;
            if kind == "zombie write" && member.owner == Owner::Known(Some(to.clone())) {
                let described = t.describe(m);
                drop(t);
                self.verdicts.violation(
                    invariant::FENCING,
                    format!("a registration on fenced zombie {to} was taken"),
                    vec![described],
                );
            }
        }
        if let Some(Lost { server, what, keys }) = lost {
            self.lost_live(&server, invariant::LIVE_KEPT, what, keys);
        }
        if fenced_live {
            self.fenced_while_live(&to, "a registration on it was refused as FENCED");
        }
    }

    /// What the entry a registration replaced says about the janitor: deleted (the
    /// evictions stream must announce it), kept (it must never announce it), or not what
    /// the load wrote (a violation).
    fn judge_previous(
        &self,
        t: &mut Truth,
        m: usize,
        before: &Owner,
        prev: &Option<ServerId>,
        replaced: bool,
    ) -> Option<Lost> {
        match before {
            Owner::Known(expected) if expected == prev => {
                if let (Some(d), true) = (prev, replaced) {
                    if !t.is_live(d) {
                        t.kept.insert((d.clone(), m));
                        self.stats.found_kept.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Owner::Known(Some(d)) if prev.is_none() => {
                self.stats.found_deleted.fetch_add(1, Ordering::Relaxed);
                if t.is_live(d) {
                    return Some(Lost {
                        server: d.clone(),
                        what: format!(
                            "the entry of {} on live server {d} was deleted (a registration found none)",
                            show(&t.members[m].bytes)
                        ),
                        keys: vec![t.describe(m)],
                    });
                }
                t.expect_deleted(d, m);
            }
            // One of the owners it may have had is dead: the janitor may have deleted it
            // (and announced it, which the evictions check allows: it was registered
            // there).
            Owner::Uncertain(possible)
                if prev.is_none() && possible.iter().flatten().any(|s| !t.is_live(s)) => {}
            Owner::Uncertain(possible) if possible.contains(prev) => {
                if let (Some(d), true) = (prev, replaced) {
                    if !t.is_live(d) {
                        t.kept.insert((d.clone(), m));
                    }
                }
            }
            _ => {
                let described = t.describe(m);
                self.verdicts.violation(
                    invariant::OWNERS_WRITTEN,
                    format!(
                        "the entry of {} named {}, which the load never left there (it expected {before})",
                        show(&t.members[m].bytes),
                        named(prev)
                    ),
                    vec![described],
                );
            }
        }
        None
    }

    /// register.lua (register_conn.lua) in a MULTI after a read of the entry; on a
    /// cluster, [`Fleet::tell_register_cluster`].
    async fn tell_register(&self, member: &[u8], to: &ServerId) -> Result<Told, String> {
        if self.cluster {
            return self.tell_register_cluster(member, to).await;
        }
        let (key, field) = self
            .keys
            .forward_of_member(self.params.layout, member)
            .ok_or("not an entry of the layout")?;
        let mut read = match &field {
            Some(_) => redis::cmd("HGET"),
            None => redis::cmd("GET"),
        };
        read.arg(&key);
        if let Some(f) = &field {
            read.arg(f);
        }
        let mut eval = redis::cmd("EVAL");
        let script = match self.params.layout {
            Layout::Conns => REGISTER_CONN,
            _ => REGISTER,
        };
        eval.arg(script)
            .arg(4)
            .arg(self.keys.server_fence(to))
            .arg(self.keys.server_refusals(to))
            .arg(self.keys.server_users(to))
            .arg(&key);
        match self.params.layout {
            Layout::Conns => {
                let (connection, user) =
                    keys::split_conn_member(member).ok_or("not a conns member")?;
                eval.arg(user).arg(to.as_str()).arg(connection);
            }
            layout => {
                eval.arg(member).arg(to.as_str()).arg(layout.as_str());
            }
        }
        let mut pipe = redis::pipe();
        pipe.atomic()
            .ignore_errors()
            .add_command(read)
            .add_command(eval);
        let replies: Vec<redis::Value> = pipe
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| e.to_string())?;
        let [prev, outcome] =
            <[redis::Value; 2]>::try_from(replies).map_err(|r| format!("EXEC answered {r:?}"))?;
        let prev = match prev {
            redis::Value::Nil => None,
            redis::Value::ServerError(e) => return Err(format!("the read failed: {e:?}")),
            v => Some(redis::from_redis_value::<String>(v).map_err(|e| e.to_string())?),
        };
        let outcome = match outcome {
            redis::Value::Int(1) => Ok(()),
            redis::Value::ServerError(e) => {
                Err(format!("{} {}", e.code(), e.details().unwrap_or_default()))
            }
            other => Err(format!("unexpected reply {other:?}")),
        };
        Ok(Told {
            prev,
            outcome,
            written: false,
            released: None,
        })
    }

    /// The protocol's registration on a cluster, as `Registry::register` makes it: the
    /// fence read (a fenced server writes no forward entry, and its register.lua alone
    /// refuses); the forward entry, written by [`WRITE_READING`], which returns the entry
    /// it replaced; register.lua (register_conn.lua) on the server's keys only; and if
    /// it answers FENCED, release.lua.
    async fn tell_register_cluster(&self, member: &[u8], to: &ServerId) -> Result<Told, String> {
        let (key, field) = self
            .keys
            .forward_of_member(self.params.layout, member)
            .ok_or("not an entry of the layout")?;
        let script = match self.params.layout {
            Layout::Conns => REGISTER_CONN,
            _ => REGISTER,
        };
        let mut eval = redis::cmd("EVAL");
        eval.arg(script)
            .arg(3)
            .arg(self.keys.server_fence(to))
            .arg(self.keys.server_refusals(to))
            .arg(self.keys.server_users(to));
        match self.params.layout {
            Layout::Conns => {
                let (connection, user) =
                    keys::split_conn_member(member).ok_or("not a conns member")?;
                eval.arg(user).arg(to.as_str()).arg(connection);
            }
            layout => {
                eval.arg(member).arg(to.as_str()).arg(layout.as_str());
            }
        }
        let mut c = self.conn.clone();
        let outcome = |reply: redis::RedisResult<i64>| -> Result<Result<(), String>, String> {
            match reply {
                Ok(1) => Ok(Ok(())),
                Ok(other) => Ok(Err(format!("unexpected reply {other}"))),
                Err(e) if e.code() == Some("FENCED") => Ok(Err(format!("FENCED {e}"))),
                Err(e) => Err(e.to_string()),
            }
        };
        let fenced: bool = redis::cmd("EXISTS")
            .arg(self.keys.server_fence(to))
            .query_async(&mut c)
            .await
            .map_err(|e| e.to_string())?;
        let field_arg: Vec<u8> = field.clone().unwrap_or_default();
        let kind = if field.is_some() { "hash" } else { "keys" };
        if fenced {
            // Nothing written: the entry is read on its own, to judge it (only the
            // janitor may have changed it meanwhile, and only by deleting it).
            let refused = match outcome(eval.query_async(&mut c).await)? {
                // The fence went away between the read and the script: the member is
                // written without its forward entry, as `Registry::register` would. Not
                // a registration the load can count on.
                Ok(()) => {
                    return Err(
                        "register.lua took the member after the fence read found the fence: \
                         no forward entry"
                            .into(),
                    )
                }
                refused => refused,
            };
            let mut read = match &field {
                Some(_) => redis::cmd("HGET"),
                None => redis::cmd("GET"),
            };
            read.arg(&key);
            if let Some(f) = &field {
                read.arg(f);
            }
            let prev: Option<String> = read.query_async(&mut c).await.map_err(|e| e.to_string())?;
            return Ok(Told {
                prev,
                outcome: refused,
                written: false,
                released: None,
            });
        }
        let prev: Option<String> = redis::cmd("EVAL")
            .arg(WRITE_READING)
            .arg(1)
            .arg(&key)
            .arg(&field_arg)
            .arg(to.as_str())
            .arg(kind)
            .query_async(&mut c)
            .await
            .map_err(|e| e.to_string())?;
        let told = match outcome(eval.query_async(&mut c).await) {
            Ok(told) => told,
            // The entry is written; the member may or may not be.
            Err(e) => Err(format!("no answer from register.lua ({e})")),
        };
        let released = if told.as_ref().is_err_and(|e| e.starts_with("FENCED")) {
            let deleted: redis::RedisResult<i64> = redis::cmd("EVAL")
                .arg(RELEASE)
                .arg(1)
                .arg(&key)
                .arg(&field_arg)
                .arg(to.as_str())
                .arg(kind)
                .query_async(&mut c)
                .await;
            deleted.ok().map(|d| d == 1)
        } else {
            None
        };
        Ok(Told {
            prev,
            outcome: told,
            written: true,
            released,
        })
    }

    async fn unregister(self: &Arc<Self>, m: usize, from: ServerId) {
        let bytes = self.truth().members[m].bytes.clone();
        let reply = self.registry.unregister(&self.conn, &bytes, &from).await;
        self.stats.unregisters.fetch_add(1, Ordering::Relaxed);
        let mut fenced_live = false;
        {
            let mut t = self.truth();
            let line = format!(
                "+{:.2}s unregister from {from}: {}",
                self.t(),
                match &reply {
                    Ok(()) => "done".to_owned(),
                    Err(Error::Fenced { .. }) => "refused: FENCED".to_owned(),
                    Err(e) => format!("no answer ({e})"),
                }
            );
            let owner = match reply {
                Ok(()) => Owner::Known(None),
                Err(Error::Fenced { .. }) => {
                    fenced_live = t.is_live(&from);
                    Owner::Known(None)
                }
                Err(_) => {
                    self.stats.op_errors.fetch_add(1, Ordering::Relaxed);
                    Owner::Uncertain(widen(&t.members[m].owner, None))
                }
            };
            let member = &mut t.members[m];
            push_history(member, line);
            member.owner = owner;
            member.since = Instant::now();
            member.busy = false;
            member.version += 1;
        }
        if fenced_live {
            self.fenced_while_live(&from, "an unregister on it was refused as FENCED");
        }
    }

    async fn route(self: &Arc<Self>, m: usize) {
        let started = Instant::now();
        let bytes = self.truth().members[m].bytes.clone();
        self.stats.routes.fetch_add(1, Ordering::Relaxed);
        let Ok(Some(owner)) = self.registry.route(&self.conn, &bytes).await else {
            return;
        };
        let t = self.truth();
        let Ok(owner) = ServerId::parse(&owner) else {
            return;
        };
        let fenced_before = t
            .servers
            .get(&owner)
            .and_then(|s| s.fence_seen)
            .is_some_and(|seen| seen < started);
        self.verdicts.checked(invariant::ROUTE, 1);
        if fenced_before {
            let described = t.describe(m);
            let server = t.describe_server(&owner);
            drop(t);
            self.verdicts.violation(
                invariant::ROUTE,
                format!("route returned {owner}, whose fence was seen before the lookup began"),
                vec![described, server],
            );
        }
    }
}

fn push_history(member: &mut Member, line: String) {
    if member.history.len() >= 10 {
        member.history.pop_front();
    }
    member.history.push_back(line);
}

/// Every owner `owner` may be, and `more`.
fn widen(owner: &Owner, more: Option<ServerId>) -> Vec<Option<ServerId>> {
    let mut all = match owner {
        Owner::Known(o) => vec![o.clone()],
        Owner::Uncertain(all) => all.clone(),
    };
    if !all.contains(&more) {
        all.push(more);
    }
    all
}

/// The `n`th entry of the run: a user id (layouts `hash`, `keys`), or in layout `conns` a
/// member `c<j> <user>` (two connections per user). One user in 16 has an id of any
/// bytes: spaces, braces, invalid UTF-8, a NUL.
pub fn entry_bytes(layout: Layout, n: usize) -> Vec<u8> {
    let user_n = match layout {
        Layout::Conns => n / 2,
        _ => n,
    };
    let mut user = format!("u{user_n}").into_bytes();
    if user_n % 16 == 5 {
        user.extend_from_slice(b" {odd} \xff\x00\xe2\x9c\x93");
    }
    match layout {
        Layout::Conns => keys::conn_member(&format!("c{}", n % 2), &user),
        _ => user,
    }
}
