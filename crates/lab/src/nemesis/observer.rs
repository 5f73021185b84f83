//! The observer: every few hundred milliseconds, while the faults run, it reads Redis and
//! checks the invariants against the truth the fleet holds.
//!
//! - **live entries kept**: every entry registered on a live server, and neither moved
//!   nor unregistered since, for the settling window, still names that server. The
//!   entries are snapshotted with their versions, read, and compared only if no
//!   operation touched them meanwhile;
//! - **acknowledged servers clean**: once every `server.dead` of a dead server is
//!   acknowledged (delivered, and no longer pending), no entry ever registered on it
//!   names it; each such entry the load still believed on it was deleted, so it must be
//!   announced;
//! - **evictions exactly once**: the evictions stream, read as it grows, announces each
//!   (server, entry) at most once; only entries that were registered on that server,
//!   never a live server's, never one a registration found still there and kept; and
//!   every deletion a registration found (its previous owner gone) is announced by the
//!   time it was found (one node: the same script deletes and announces);
//!
//! On a Redis Cluster (see docs/nemesis.md, "What it checks on a cluster"):
//! - **acknowledged servers clean**: an entry found naming an acknowledged server is a
//!   violation only if it still names it [`SWEPT_WITHIN`] later, untouched by the load
//!   meanwhile: the acknowledgement is in another slot than the walk's last step, and
//!   an entry written without its member (a registration cut between its two steps) is
//!   the drift sweep's to delete;
//! - **evictions at least once**: an entry may be announced more than once, and an
//!   entry a registration found still naming the dead server and replaced may be
//!   announced later (the walk announces members whose entry is gone, whatever removed
//!   it); every deletion a registration found is announced within
//!   [`ANNOUNCED_WITHIN`], unless a worker was SIGKILLed between the server's death and
//!   the find (a worker killed between a chunk's deletes and their announcement, the
//!   user reconnecting before the chunk is redone: the documented gap).
//! - **events settled**: no event waits longer than the deadline; malformed entries are
//!   dead-lettered with a reason, valid ones never are;
//! - **processes stay up**, **memory flat**: no janitor process exits by itself; each
//!   one's resident memory stays within [`rss_bound`](super::procs::rss_bound) of its
//!   baseline;
//! - **dead servers cleaned in time**: every dead server is acknowledged within the
//!   deadline after its death.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
    time::Instant,
};

use registry_janitor::{
    conn::RedisConn,
    event::{classify, Classified, ServerId},
    evictions::{self, Eviction},
    keys::{self, Keys, GROUP},
    stream,
};

use super::{
    fleet::{show, Fleet, Owner, State},
    procs::{tail, Janitors},
    verdicts::{invariant, Verdicts},
};

/// On a cluster, how long an entry may name an acknowledged server before it is a
/// violation: the drift sweep makes a complete pass every `reconcile_interval_ms` (1 s
/// here) once the guard lets it; this is many passes.
pub const SWEPT_WITHIN: std::time::Duration = std::time::Duration::from_secs(30);
/// On a cluster, how long after a registration found an entry deleted its announcement
/// may come: the announcement follows the deletes, retried through BUSY, OOM, a failover
/// (a few seconds each) and a paused worker.
pub const ANNOUNCED_WITHIN: std::time::Duration = std::time::Duration::from_secs(60);

/// The field that marks a malformed entry the nemesis published, and finds its dead
/// letter again.
pub const NONCE: &str = "nemesis_nonce";

/// A stream id, ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StreamId(u64, u64);

impl StreamId {
    pub fn parse(id: &str) -> Option<Self> {
        let (ms, seq) = id.split_once('-')?;
        Some(StreamId(ms.parse().ok()?, seq.parse().ok()?))
    }
}

#[derive(Debug, Clone)]
pub enum Class {
    Dead(ServerId),
    Foreign,
    Malformed(String),
}

impl std::fmt::Display for Class {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Class::Dead(server) => write!(f, "server.dead for {server}"),
            Class::Foreign => f.write_str("another type"),
            Class::Malformed(why) => write!(f, "malformed: {why}"),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Event {
    pub id: StreamId,
    pub text: String,
    pub class: Class,
    pub nonce: Option<String>,
}

/// The consumer group's state: what was delivered, what is pending.
struct Group {
    last_delivered: StreamId,
    pending: HashSet<StreamId>,
}

impl Group {
    fn acked(&self, id: StreamId) -> bool {
        id <= self.last_delivered && !self.pending.contains(&id)
    }
}

pub struct Observer {
    fleet: Arc<Fleet>,
    janitors: Arc<Mutex<Janitors>>,
    verdicts: Arc<Verdicts>,
    conn: RedisConn,
    keys: Keys,
    max_payload: usize,
    events_after: Option<String>,
    pub events: Vec<Event>,
    by_server: HashMap<ServerId, Vec<usize>>,
    evictions_after: Option<String>,
    announced: HashMap<(String, Vec<u8>), u32>,
    pub announced_entries: u64,
    pub cleaned_entries: u64,
    dead_after: Option<String>,
    pub dead_letters: HashMap<String, String>,
    pub acked: Vec<ServerId>,
    acked_set: HashSet<ServerId>,
    rotate: usize,
    expected_cursor: usize,
    /// On a cluster: each (acknowledged server, entry) found naming it, and since when.
    suspects: HashMap<(ServerId, usize), Instant>,
    /// On a cluster: deletions found and never announced, a worker having been killed
    /// between the server's death and the find (the documented gap).
    pub unannounced_after_kill: u64,
    /// On a cluster: the entries found naming an acknowledged server that were deleted
    /// later (by the drift sweep, or a later walk), and the longest such wait.
    pub swept_late: u64,
    pub swept_late_max: std::time::Duration,
    pub rounds: u64,
    pub skipped: u64,
    pub idle: bool,
}

type Res<T> = Result<T, String>;

impl Observer {
    pub fn new(
        fleet: Arc<Fleet>,
        janitors: Arc<Mutex<Janitors>>,
        verdicts: Arc<Verdicts>,
        conn: RedisConn,
        keys: Keys,
        max_payload: usize,
    ) -> Self {
        Observer {
            fleet,
            janitors,
            verdicts,
            conn,
            keys,
            max_payload,
            events_after: None,
            events: Vec::new(),
            by_server: HashMap::new(),
            evictions_after: None,
            announced: HashMap::new(),
            announced_entries: 0,
            cleaned_entries: 0,
            dead_after: None,
            dead_letters: HashMap::new(),
            acked: Vec::new(),
            acked_set: HashSet::new(),
            rotate: 0,
            expected_cursor: 0,
            suspects: HashMap::new(),
            unannounced_after_kill: 0,
            swept_late: 0,
            swept_late_max: std::time::Duration::ZERO,
            rounds: 0,
            skipped: 0,
            idle: false,
        }
    }

    /// The evictions invariant of this topology: exactly once on one node or Sentinel, at
    /// least once on a cluster.
    pub fn announced_invariant(&self) -> &'static str {
        if self.fleet.cluster {
            invariant::ANNOUNCED_AT_LEAST_ONCE
        } else {
            invariant::ANNOUNCED_ONCE
        }
    }

    fn janitors(&self) -> std::sync::MutexGuard<'_, Janitors> {
        self.janitors.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One round of every check. Checks that need Redis are skipped while it is away.
    pub async fn round(&mut self) {
        self.rounds += 1;
        self.processes();
        if let Err(e) = self.redis_checks().await {
            self.skipped += 1;
            if self.skipped % 20 == 1 {
                eprintln!("nemesis: observer round skipped (Redis: {e})");
            }
        }
    }

    fn processes(&mut self) {
        let (exits, over, alive) = {
            let mut j = self.janitors();
            let exits = j.exits();
            let over = j.sample_memory();
            (exits, over, j.procs.len())
        };
        self.verdicts.checked(invariant::PROCESSES_UP, alive as u64);
        self.verdicts.checked(invariant::MEMORY_FLAT, alive as u64);
        for exit in exits {
            self.verdicts.violation(
                invariant::PROCESSES_UP,
                format!("{} exited by itself: {}", exit.name, exit.status),
                vec![format!(
                    "its log ({}), last lines:\n{}",
                    exit.log.display(),
                    tail(&exit.log, 30)
                )],
            );
        }
        for (name, base, now) in over {
            self.verdicts.violation(
                invariant::MEMORY_FLAT,
                format!(
                    "{name}: resident memory {} MiB, baseline {} MiB (bound {} MiB)",
                    now >> 20,
                    base >> 20,
                    super::procs::rss_bound(base) >> 20
                ),
                vec![],
            );
        }
    }

    async fn redis_checks(&mut self) -> Res<()> {
        self.read_events().await?;
        let group = self.group().await?;
        self.see_fences().await?;
        let read_start = Instant::now();
        self.read_evictions().await?;
        self.check_expected(read_start);
        self.read_dead_letters().await?;
        self.live_entries().await?;
        if let Some(group) = &group {
            self.acknowledged_clean(group).await?;
            let holds = if self.past_deadline(group) {
                registry_janitor::guard::hold::list(&self.conn, &self.keys)
                    .await
                    .map_err(|e| e.to_string())?
            } else {
                Vec::new()
            };
            self.in_time(group, &holds);
            self.idle = self.events.iter().all(|e| group.acked(e.id));
        }
        Ok(())
    }

    /// New entries of the events stream, classified as the workers classify them.
    async fn read_events(&mut self) -> Res<()> {
        loop {
            let items = xrange(&self.conn, &self.keys.events(), &self.events_after).await?;
            let n = items.len();
            for item in items {
                let Some(entry) = stream::parse_entry(item).map_err(|e| e.to_string())? else {
                    continue;
                };
                self.events_after = Some(entry.id.clone());
                let Some(id) = StreamId::parse(&entry.id) else {
                    continue;
                };
                let nonce = entry
                    .field(NONCE)
                    .map(|n| String::from_utf8_lossy(n).into_owned());
                let class = match classify(&entry, self.max_payload) {
                    Classified::ServerDead(_, server) => Class::Dead(server),
                    Classified::Foreign(_) => Class::Foreign,
                    Classified::Malformed(e) => Class::Malformed(e.to_string()),
                };
                if let Class::Dead(server) = &class {
                    self.by_server
                        .entry(server.clone())
                        .or_default()
                        .push(self.events.len());
                }
                self.events.push(Event {
                    id,
                    text: entry.id,
                    class,
                    nonce,
                });
            }
            if n < 1000 {
                return Ok(());
            }
        }
    }

    async fn group(&self) -> Res<Option<Group>> {
        let info: redis::RedisResult<redis::streams::StreamInfoGroupsReply> = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(self.keys.events())
            .query_async(&mut self.conn.clone())
            .await;
        let info = match info {
            Ok(info) => info,
            Err(e) if e.to_string().contains("no such key") => return Ok(None),
            Err(e) => return Err(e.to_string()),
        };
        let Some(g) = info.groups.into_iter().find(|g| g.name == GROUP) else {
            return Ok(None);
        };
        let pending: redis::streams::StreamPendingCountReply = redis::cmd("XPENDING")
            .arg(self.keys.events())
            .arg(GROUP)
            .arg("-")
            .arg("+")
            .arg(100_000)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| e.to_string())?;
        Ok(Some(Group {
            last_delivered: StreamId::parse(&g.last_delivered_id).unwrap_or(StreamId(0, 0)),
            pending: pending
                .ids
                .iter()
                .filter_map(|p| StreamId::parse(&p.id))
                .collect(),
        }))
    }

    /// Records when each dead server's fence is first seen (for the route check).
    async fn see_fences(&mut self) -> Res<()> {
        let unseen: Vec<ServerId> = {
            let t = self.fleet.truth();
            t.servers
                .values()
                .filter(|s| {
                    s.state != State::Live && s.state != State::Starting && s.fence_seen.is_none()
                })
                .map(|s| s.id.clone())
                .collect()
        };
        if unseen.is_empty() {
            return Ok(());
        }
        // One pipeline on a node; on a cluster, one command per key (their slots differ).
        let exists = unseen
            .iter()
            .map(|s| {
                redis::cmd("EXISTS")
                    .arg(self.keys.server_fence(s))
                    .to_owned()
            })
            .collect();
        let seen: Vec<bool> = registry_janitor::conn::each_in_flight(&self.conn, exists)
            .await
            .map_err(|e| e.to_string())?;
        let now = Instant::now();
        let mut t = self.fleet.truth();
        for (s, fenced) in unseen.iter().zip(seen) {
            if fenced {
                if let Some(server) = t.servers.get_mut(s) {
                    server.fence_seen.get_or_insert(now);
                }
            }
        }
        Ok(())
    }

    /// New entries of the evictions stream, each checked as it comes.
    async fn read_evictions(&mut self) -> Res<()> {
        let stream = self.keys.evictions().expect("evictions on").to_owned();
        loop {
            let reply: redis::streams::StreamRangeReply = {
                let mut cmd = redis::cmd("XRANGE");
                cmd.arg(&stream)
                    .arg(match &self.evictions_after {
                        Some(id) => format!("({id}"),
                        None => "-".into(),
                    })
                    .arg("+")
                    .arg("COUNT")
                    .arg(1000);
                cmd.query_async(&mut self.conn.clone())
                    .await
                    .map_err(|e| e.to_string())?
            };
            let n = reply.ids.len();
            for entry in reply.ids {
                self.evictions_after = Some(entry.id.clone());
                let field = |name: &str| match entry.map.get(name) {
                    Some(redis::Value::BulkString(b)) => Some(b.clone()),
                    _ => None,
                };
                let decoded = match (field("type"), field("payload")) {
                    (Some(kind), Some(payload)) => {
                        evictions::decode(&String::from_utf8_lossy(&kind), &payload)
                    }
                    _ => None,
                };
                let announced: Vec<(String, Vec<u8>)> = match decoded {
                    Some(Eviction::Evicted {
                        server_id, users, ..
                    }) => users.into_iter().map(|u| (server_id.clone(), u)).collect(),
                    Some(Eviction::ConnectionsEvicted {
                        server_id,
                        connections,
                        ..
                    }) => connections
                        .into_iter()
                        .map(|(u, c)| (server_id.clone(), keys::conn_member(&c, &u)))
                        .collect(),
                    Some(Eviction::Cleaned { .. }) => {
                        self.cleaned_entries += 1;
                        Vec::new()
                    }
                    None => {
                        self.verdicts.violation(
                            self.announced_invariant(),
                            format!("entry {} of the evictions stream does not decode", entry.id),
                            vec![],
                        );
                        Vec::new()
                    }
                };
                self.announced_entries += announced.len() as u64;
                for (server, member) in announced {
                    self.one_announcement(&entry.id, server, member);
                }
            }
            if n < 1000 {
                return Ok(());
            }
        }
    }

    fn one_announcement(&mut self, id: &str, server: String, member: Vec<u8>) {
        let count = self
            .announced
            .entry((server.clone(), member.clone()))
            .or_default();
        *count += 1;
        let count = *count;
        let inv = self.announced_invariant();
        let cluster = self.fleet.cluster;
        self.verdicts.checked(inv, 1);
        let t = self.fleet.truth();
        let Some(&m) = t.by_bytes.get(&member) else {
            drop(t);
            self.verdicts.violation(
                inv,
                format!(
                    "{id} announces {} of {server}, an entry the load never wrote",
                    show(&member)
                ),
                vec![],
            );
            return;
        };
        let sid = ServerId::parse(&server).ok();
        let problem = if count > 1 && !cluster {
            Some(format!("announced {count} times"))
        } else if !sid
            .as_ref()
            .is_some_and(|s| t.members[m].attempted.contains(s))
        {
            Some("never registered on that server".to_owned())
        } else if sid.as_ref().is_some_and(|s| t.is_live(s)) {
            Some("its server is live".to_owned())
        } else if !cluster
            && sid
                .as_ref()
                .is_some_and(|s| t.kept.contains(&(s.clone(), m)))
        {
            Some("a registration found the entry still naming the dead server and replaced it (kept)".to_owned())
        } else {
            None
        };
        if let Some(problem) = problem {
            let described = t.describe(m);
            let about = sid.map(|s| t.describe_server(&s)).unwrap_or_default();
            drop(t);
            self.verdicts.violation(
                inv,
                format!("{id} announces {} of {server}: {problem}", show(&member)),
                vec![described, about],
            );
        }
    }

    /// Every deletion found before the evictions stream was read is announced (one node:
    /// the step that deletes announces). On a cluster, within [`ANNOUNCED_WITHIN`] of
    /// the find, unless a worker was SIGKILLed between the server's death and the find.
    fn check_expected(&mut self, read_start: Instant) {
        let inv = self.announced_invariant();
        let cluster = self.fleet.cluster;
        let kills = self
            .fleet
            .worker_kills
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let t = self.fleet.truth();
        let mut missing = None;
        let mut n = 0;
        while self.expected_cursor < t.expected.len() {
            let e = &t.expected[self.expected_cursor];
            if e.at >= read_start || (cluster && e.at + ANNOUNCED_WITHIN > read_start) {
                break;
            }
            n += 1;
            let member = &t.members[e.member].bytes;
            let announced = self
                .announced
                .contains_key(&(e.server.as_str().to_owned(), member.clone()));
            if !announced && cluster && killed_between(&t, &kills, &e.server, e.at) {
                self.unannounced_after_kill += 1;
            } else if !announced && missing.is_none() {
                missing = Some((e.server.clone(), e.member));
            }
            self.expected_cursor += 1;
        }
        self.verdicts.checked(inv, n);
        if let Some((server, m)) = missing {
            let described = t.describe(m);
            let about = t.describe_server(&server);
            let member = show(&t.members[m].bytes);
            drop(t);
            self.verdicts.violation(
                inv,
                if cluster {
                    format!(
                        "the entry of {member} on {server} was deleted and not announced {} s \
                         after a registration found it deleted (no worker was killed since \
                         {server} died)",
                        ANNOUNCED_WITHIN.as_secs()
                    )
                } else {
                    format!("the entry of {member} on {server} was deleted and never announced")
                },
                vec![described, about],
            );
        }
    }

    async fn read_dead_letters(&mut self) -> Res<()> {
        loop {
            let items = xrange(&self.conn, &self.keys.dead_letters(), &self.dead_after).await?;
            let n = items.len();
            for item in items {
                let Some(entry) = stream::parse_entry(item).map_err(|e| e.to_string())? else {
                    continue;
                };
                self.dead_after = Some(entry.id.clone());
                let error = entry
                    .field("error")
                    .map(|e| String::from_utf8_lossy(e).into_owned())
                    .unwrap_or_default();
                match entry.field(NONCE) {
                    Some(nonce) if !error.is_empty() => {
                        self.dead_letters
                            .insert(String::from_utf8_lossy(nonce).into_owned(), error);
                    }
                    Some(_) => self.verdicts.violation(
                        invariant::EVENTS_SETTLED,
                        format!("dead letter {} has no reason", entry.id),
                        vec![],
                    ),
                    None => self.verdicts.violation(
                        invariant::EVENTS_SETTLED,
                        format!("a valid event was dead-lettered ({}): {error}", entry.id),
                        vec![],
                    ),
                }
            }
            if n < 1000 {
                return Ok(());
            }
        }
    }

    /// Every settled entry of a live server still names it.
    async fn live_entries(&mut self) -> Res<()> {
        let settle = self.fleet.params.settle;
        let now = Instant::now();
        let snapshot: Vec<(usize, ServerId, u64, Vec<u8>)> = {
            let t = self.fleet.truth();
            t.members
                .iter()
                .enumerate()
                .filter_map(|(i, m)| match &m.owner {
                    Owner::Known(Some(s))
                        if !m.busy
                            && m.since + settle <= now
                            && t.servers.get(s).is_some_and(|s| {
                                s.state == State::Live
                                    && s.live_since.is_some_and(|l| l + settle <= now)
                            }) =>
                    {
                        Some((i, s.clone(), m.version, m.bytes.clone()))
                    }
                    _ => None,
                })
                .collect()
        };
        let mut owners = Vec::with_capacity(snapshot.len());
        for chunk in snapshot.chunks(500) {
            let members: Vec<Vec<u8>> = chunk.iter().map(|(_, _, _, b)| b.clone()).collect();
            owners.extend(
                self.fleet
                    .registry
                    .owners(&self.conn, &members)
                    .await
                    .map_err(|e| e.to_string())?,
            );
        }
        let mut lost = Vec::new();
        let mut checked = 0;
        {
            let t = self.fleet.truth();
            for ((m, server, version, _), owner) in snapshot.iter().zip(owners) {
                let member = &t.members[*m];
                if member.version != *version || member.busy || !t.is_live(server) {
                    continue;
                }
                checked += 1;
                if owner.as_deref() != Some(server.as_str()) {
                    lost.push((*m, server.clone(), owner));
                }
            }
        }
        self.verdicts.checked(invariant::LIVE_KEPT, checked);
        if let Some((m, server, owner)) = lost.first().cloned() {
            let fenced: bool = redis::cmd("EXISTS")
                .arg(self.keys.server_fence(&server))
                .query_async(&mut self.conn.clone())
                .await
                .unwrap_or(false);
            let (described, member) = {
                let t = self.fleet.truth();
                (t.describe(m), t.members[m].bytes.clone())
            };
            // The fleet judges whether this process starved the server.
            self.fleet.lost_live(
                &server,
                invariant::LIVE_KEPT,
                format!(
                    "{} live entries lost; the entry of {} names {}, not live server {server} \
                     (fenced: {fenced})",
                    lost.len(),
                    show(&member),
                    owner.as_deref().unwrap_or("none")
                ),
                vec![described, forward_key(&self.keys, &self.fleet, &member)],
            );
        }
        Ok(())
    }

    /// Dead servers whose every event is acknowledged: none of their entries names them.
    async fn acknowledged_clean(&mut self, group: &Group) -> Res<()> {
        let newly: Vec<ServerId> = {
            let t = self.fleet.truth();
            t.servers
                .values()
                .filter(|s| s.state == State::Dead || s.state == State::Zombie)
                .filter(|s| !self.acked_set.contains(&s.id))
                .filter(|s| {
                    self.by_server
                        .get(&s.id)
                        .is_some_and(|evs| evs.iter().all(|&i| group.acked(self.events[i].id)))
                })
                .map(|s| s.id.clone())
                .collect()
        };
        // The newly acknowledged servers whole, and a share of the older ones again.
        let mut to_check: Vec<ServerId> = newly.clone();
        if !self.acked.is_empty() {
            for _ in 0..self.acked.len().min(8) {
                self.rotate = (self.rotate + 1) % self.acked.len();
                to_check.push(self.acked[self.rotate].clone());
            }
        }
        for s in &newly {
            self.acked_set.insert(s.clone());
            self.acked.push(s.clone());
        }
        // On a cluster, the servers with entries found naming them again.
        for (s, _) in self.suspects.keys() {
            if !to_check.contains(s) {
                to_check.push(s.clone());
            }
        }
        let cluster = self.fleet.cluster;
        let now = Instant::now();
        for server in to_check {
            let snapshot: Vec<(usize, u64, bool, Vec<u8>)> = {
                let t = self.fleet.truth();
                let Some(s) = t.servers.get(&server) else {
                    continue;
                };
                s.members_ever
                    .iter()
                    .map(|&m| {
                        let member = &t.members[m];
                        let certain =
                            !member.busy && member.owner == Owner::Known(Some(server.clone()));
                        (m, member.version, certain, member.bytes.clone())
                    })
                    .collect()
            };
            let mut owners = Vec::with_capacity(snapshot.len());
            for chunk in snapshot.chunks(500) {
                let members: Vec<Vec<u8>> = chunk.iter().map(|(_, _, _, b)| b.clone()).collect();
                owners.extend(
                    self.fleet
                        .registry
                        .owners(&self.conn, &members)
                        .await
                        .map_err(|e| e.to_string())?,
                );
            }
            self.verdicts
                .checked(invariant::ACKED_CLEAN, snapshot.len() as u64);
            let mut t = self.fleet.truth();
            for ((m, version, certain, bytes), owner) in snapshot.iter().zip(owners) {
                let names = owner.as_deref() == Some(server.as_str());
                if cluster {
                    let key = (server.clone(), *m);
                    let untouched = t.members[*m].version == *version && !t.members[*m].busy;
                    if !names {
                        if let Some(first) = self.suspects.remove(&key) {
                            self.swept_late += 1;
                            self.swept_late_max = self.swept_late_max.max(now - first);
                        }
                        // Fall through to the inference below.
                    } else if !untouched {
                        // An operation of the load on it: judged again later.
                        continue;
                    } else {
                        let first = *self.suspects.entry(key).or_insert(now);
                        if now - first < SWEPT_WITHIN {
                            continue;
                        }
                    }
                }
                if names {
                    let described = t.describe(*m);
                    let about = t.describe_server(&server);
                    let events: Vec<String> = self.by_server[&server]
                        .iter()
                        .map(|&i| self.events[i].text.clone())
                        .collect();
                    drop(t);
                    let after = if cluster {
                        format!(
                            " {} s after it was first found naming it (the drift sweep's passes \
                             did not delete it)",
                            SWEPT_WITHIN.as_secs()
                        )
                    } else {
                        String::new()
                    };
                    self.verdicts.violation(
                        invariant::ACKED_CLEAN,
                        format!(
                            "every server.dead of {server} is acknowledged ({}), and the entry of {} still names it{after}",
                            events.join(", "),
                            show(bytes)
                        ),
                        vec![described, about, forward_key(&self.keys, &self.fleet, bytes)],
                    );
                    return Ok(());
                }
                // Believed on the server, untouched since: the janitor deleted it.
                if *certain && t.members[*m].version == *version && !t.members[*m].busy {
                    t.expect_deleted_pub(&server, *m);
                }
            }
        }
        Ok(())
    }

    /// The first event unacknowledged past the deadline.
    fn late_event(&self, group: &Group) -> Option<&Event> {
        let deadline = self.fleet.params.deadline.as_millis() as u64;
        let now_ms = registry_janitor::now_ms();
        self.events
            .iter()
            .find(|e| !group.acked(e.id) && e.id.0 + deadline < now_ms)
    }

    /// Whether `s` died longer than the deadline ago and its server.dead is not
    /// acknowledged.
    fn late_dead(&self, s: &super::fleet::Server) -> bool {
        s.state == State::Dead
            && s.died
                .is_some_and(|d| d.elapsed() > self.fleet.params.deadline)
            && !self.acked_set.contains(&s.id)
    }

    /// Whether anything waits past the deadline (an event, or a dead server).
    fn past_deadline(&self, group: &Group) -> bool {
        self.late_event(group).is_some()
            || self
                .fleet
                .truth()
                .servers
                .values()
                .any(|s| self.late_dead(s))
    }

    /// Nothing waits past the deadline: no event unacknowledged, no dead server
    /// unacknowledged after its death. A verdict the guard holds is named as held, with
    /// the guard's doubt and what it saw (`holds`: the guard's holds, read when anything
    /// is late).
    fn in_time(&mut self, group: &Group, holds: &[registry_janitor::guard::Hold]) {
        let deadline = self.fleet.params.deadline;
        let held = |entry: Option<&str>, server: &str| {
            holds
                .iter()
                .find(|h| entry.map_or(h.server_id == server, |e| h.entry == e))
                .map_or(String::new(), |h| {
                    format!(
                        "; the guard holds it ({}: {}) since {} ms ago",
                        h.doubt.as_str(),
                        h.detail,
                        registry_janitor::now_ms().saturating_sub(h.since_ms)
                    )
                })
        };
        if let Some(e) = self.late_event(group).cloned() {
            let why = held(Some(&e.text), "");
            self.verdicts.violation(
                invariant::EVENTS_SETTLED,
                format!(
                    "event {} ({}) is not acknowledged {} s after it was published{why}",
                    e.text,
                    e.class,
                    deadline.as_secs()
                ),
                vec![],
            );
        }
        let t = self.fleet.truth();
        let late = t.servers.values().find(|s| self.late_dead(s));
        if let Some(s) = late {
            let about = t.describe_server(&s.id);
            let id = s.id.clone();
            drop(t);
            let why = held(None, id.as_str());
            self.verdicts.violation(
                invariant::DEAD_FOUND,
                format!(
                    "{id} died more than {} s ago and its server.dead is not acknowledged{why}",
                    deadline.as_secs()
                ),
                vec![about],
            );
        }
    }

    /// True once every event read so far is acknowledged and every dead server too.
    pub fn settled(&self) -> bool {
        let t = self.fleet.truth();
        self.idle
            && self.suspects.is_empty()
            && t.servers.values().all(|s| match s.state {
                State::Dead => self.acked_set.contains(&s.id),
                State::Zombie => false,
                State::Live | State::Starting => true,
            })
    }

    /// The malformed entries the nemesis published whose dead letter has not come; and
    /// foreign entries that were dead-lettered.
    pub fn unsettled_malformed(&self) -> Vec<String> {
        let mut out = Vec::new();
        for e in &self.events {
            let Some(nonce) = &e.nonce else { continue };
            match (&e.class, self.dead_letters.contains_key(nonce)) {
                (Class::Malformed(why), false) => out.push(format!(
                    "{} ({why}) acknowledged without a dead letter",
                    e.text
                )),
                (Class::Foreign, true) => {
                    out.push(format!("{} (another type) was dead-lettered", e.text))
                }
                (Class::Dead(_), true) => {
                    out.push(format!("{} (a valid event) was dead-lettered", e.text))
                }
                _ => {}
            }
        }
        out
    }

    /// What the quiet end still waits for: unacknowledged events, unacknowledged dead
    /// servers, malformed entries without their dead letter (at most 20 lines).
    pub fn waiting(&self) -> Vec<String> {
        let mut out = self.unsettled_malformed();
        let t = self.fleet.truth();
        for s in t.servers.values() {
            if (s.state == State::Dead || s.state == State::Zombie)
                && !self.acked_set.contains(&s.id)
            {
                let events: Vec<&str> = self
                    .by_server
                    .get(&s.id)
                    .map(|evs| evs.iter().map(|&i| self.events[i].text.as_str()).collect())
                    .unwrap_or_default();
                out.push(format!(
                    "{} not acknowledged (its events: {events:?})",
                    t.describe_server(&s.id)
                ));
            }
        }
        if !self.idle {
            out.push("events of the stream are pending or not yet delivered".into());
        }
        for ((server, m), first) in &self.suspects {
            out.push(format!(
                "{} still names acknowledged {server} ({:.1}s after it was first found)",
                show(&t.members[*m].bytes),
                first.elapsed().as_secs_f64()
            ));
        }
        out.truncate(20);
        out
    }

    /// How each (server, entry) announcement count stands: the pairs announced, and the
    /// deletions expected and found announced.
    pub fn announced_pairs(&self) -> usize {
        self.announced.len()
    }

    pub fn announced_count(&self, server: &ServerId, member: &[u8]) -> u32 {
        self.announced
            .get(&(server.as_str().to_owned(), member.to_vec()))
            .copied()
            .unwrap_or(0)
    }
}

/// Whether the nemesis SIGKILLed a worker after `server` died and before `found`.
pub fn killed_between(
    t: &super::fleet::Truth,
    kills: &[Instant],
    server: &ServerId,
    found: Instant,
) -> bool {
    let died = t.servers.get(server).and_then(|s| s.died);
    kills
        .iter()
        .any(|&k| k <= found && died.is_none_or(|d| k >= d))
}

/// `XRANGE stream (after + COUNT 1000` as raw entries.
async fn xrange(conn: &RedisConn, stream: &str, after: &Option<String>) -> Res<Vec<redis::Value>> {
    let reply: redis::Value = redis::cmd("XRANGE")
        .arg(stream)
        .arg(match after {
            Some(id) => format!("({id}"),
            None => "-".into(),
        })
        .arg("+")
        .arg("COUNT")
        .arg(1000)
        .query_async(&mut conn.clone())
        .await
        .map_err(|e| e.to_string())?;
    match reply {
        redis::Value::Array(items) => Ok(items),
        redis::Value::Nil => Ok(Vec::new()),
        other => Err(format!("XRANGE answered {other:?}")),
    }
}

/// The key (and field) that holds an entry, for a report.
pub fn forward_key(keys: &Keys, fleet: &Fleet, member: &[u8]) -> String {
    match keys.forward_of_member(fleet.params.layout, member) {
        Some((key, Some(field))) => format!("key {} field {}", show(&key), show(&field)),
        Some((key, None)) => format!("key {}", show(&key)),
        None => String::new(),
    }
}
