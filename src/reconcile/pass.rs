//! The heartbeat pass: servers in `servers` whose heartbeat is older than the grace
//! period and whose liveness key is gone get a `server.dead` event (report_dead.lua
//! re-checks both at the instant it publishes; on a cluster, report_dead_cluster.lua
//! in the slot of `{S}`). Fenced servers (see [`crate::fence`]) are dead for good: one
//! with anything left to clean is reported again, whatever its liveness key and score
//! say (a plain writer, without the protocol's fence check, may still heartbeat), until it is clean; a
//! clean one is not reported again. A server that is not fenced is never declared dead
//! while Redis has not been reachable for a full grace since its last outage
//! ([`crate::guard::reachable`]): the verdict waits ([`Verdict::Waiting`]).

use std::sync::LazyLock;

use tracing::{info, warn};

use super::{PassReport, Reconciler, Verdict, PAGE};
use crate::{
    clock,
    conn::RedisConn,
    error::Result,
    event::{ServerDead, ServerId},
    guard::reachable::Hold,
    keys::Keys,
    reply::{int_state, malformed, Fields},
};

static REPORT_DEAD: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("report_dead.lua")));
static REPORT_DEAD_CLUSTER: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("report_dead_cluster.lua")));

impl Reconciler {
    /// Publishes `server.dead` for `server` if it is dead at this instant. While Redis
    /// has not been reachable for a full grace since its last outage, only a fenced
    /// server may be: another one without a liveness key gets [`Verdict::Waiting`].
    pub async fn check(&self, server: &ServerId) -> Result<Verdict> {
        let hold = self.hold().await?;
        let event = ServerDead::new(
            server,
            Some("heartbeat timeout".into()),
            Some("reconciler".into()),
        );
        let marker_ttl = self
            .settings
            .reconcile_interval_ms
            .saturating_mul(2)
            .max(1000);
        if self.conn.is_cluster() {
            return self
                .check_on_cluster(server, &event, marker_ttl, hold)
                .await;
        }
        let bound = self.reach.time_bound_ms();
        let mut call = REPORT_DEAD.prepare_invoke();
        call.key(self.keys.server_alive(server))
            .key(self.keys.servers())
            .key(self.keys.server_reported(server))
            .key(self.keys.events())
            .key(self.keys.server_fence(server));
        for key in self.keys.server_members_left(server) {
            call.key(key);
        }
        call.arg(server.as_str())
            .arg(self.settings.heartbeat_grace_ms)
            .arg(event.encode())
            .arg(marker_ttl)
            .arg(if hold.is_ready() { "0" } else { "1" })
            .arg(self.tolerance_ms())
            .arg(bound.map_or(String::new(), |b| b.to_string()));
        let found: Found = call.invoke_async(&mut self.conn.clone()).await?;
        Ok(match found {
            Found::Published { entry } => {
                self.metrics.reconcile_dead_found.inc();
                info!(server_id = %server, entry = %entry, event_id = %event.event_id, "server is dead; published server.dead");
                Verdict::Published(entry)
            }
            Found::Alive => Verdict::Alive,
            Found::TooRecent {
                heartbeat_ms,
                remaining_ms,
            } => Verdict::TooRecent {
                heartbeat_ms,
                remaining_ms,
            },
            Found::AlreadyReported => Verdict::AlreadyReported,
            Found::FencedClean => Verdict::FencedClean,
            Found::Waiting => Verdict::Waiting {
                remaining_ms: hold.remaining_ms(self.settings.heartbeat_grace_ms),
            },
            Found::ClockAhead { redis_ms } => {
                self.reach.verdict_past_bound(redis_ms);
                Verdict::Waiting {
                    remaining_ms: self.settings.heartbeat_grace_ms,
                }
            }
        })
    }

    /// [`Reconciler::check`] on a cluster: the same checks, in single-slot steps (the
    /// heartbeat's age, then liveness and marker in the slot of `{S}`, then the event).
    pub(super) async fn check_on_cluster(
        &self,
        server: &ServerId,
        event: &ServerDead,
        marker_ttl: u64,
        hold: Hold,
    ) -> Result<Verdict> {
        let mut c = self.conn.clone();
        // Taken before the first read: Redis's time past it, or the whole verdict taking
        // longer than its slack (a stall of any master meanwhile), holds the verdict.
        let (started, bound) = (std::time::Instant::now(), self.reach.time_bound_ms());
        // A fenced server is dead whatever its heartbeat says (the script checks again).
        let fenced = crate::fence::is_fenced(&self.conn, &self.keys, server).await?;
        if !fenced {
            if !hold.is_ready() {
                let alive: bool = redis::cmd("EXISTS")
                    .arg(self.keys.server_alive(server))
                    .query_async(&mut c)
                    .await?;
                return Ok(if alive {
                    Verdict::Alive
                } else {
                    Verdict::Waiting {
                        remaining_ms: hold.remaining_ms(self.settings.heartbeat_grace_ms),
                    }
                });
            }
            // The score and Redis's time, in the slot of `servers` (a score in the future
            // lowered first: see `crate::clock`). A time past the guard's bound is a step
            // of that clock since the guard last observed it, or a stall: no verdict by it.
            let seen = self.lowered(&[server.as_str()]).await?;
            if self.reach.past_bound(bound, seen.now_ms) {
                return Ok(Verdict::Waiting {
                    remaining_ms: self.settings.heartbeat_grace_ms,
                });
            }
            let grace = self.settings.heartbeat_grace_ms;
            // A score still in the future (its lowering refused) counts as now, as in
            // report_dead.lua.
            let ceiling = (seen.now_ms + self.tolerance_ms()) as f64;
            let score = seen.scores[0].map(|s| if s > ceiling { seen.now_ms as f64 } else { s });
            if let Some(score) = score.filter(|&s| !clock::is_past_grace(s, seen.now_ms, grace)) {
                let heartbeat_ms = score as u64;
                return Ok(Verdict::TooRecent {
                    heartbeat_ms,
                    remaining_ms: (heartbeat_ms + grace).saturating_sub(seen.now_ms),
                });
            }
        }
        let mut call = REPORT_DEAD_CLUSTER.prepare_invoke();
        call.key(self.keys.server_alive(server))
            .key(self.keys.server_reported(server))
            .key(self.keys.server_fence(server))
            .key(self.keys.server_users(server))
            .key(self.keys.server_walking(server))
            .key(self.keys.server_moved(server))
            .arg(marker_ttl);
        match call.invoke_async::<FoundOnCluster>(&mut c).await? {
            FoundOnCluster::Alive => Ok(Verdict::Alive),
            FoundOnCluster::AlreadyReported => Ok(Verdict::AlreadyReported),
            FoundOnCluster::FencedClean => Ok(Verdict::FencedClean),
            FoundOnCluster::Dead => {
                // The liveness key was read by the script, after the other steps: a stall
                // of the master of `{S}` before it (its heartbeats blocked, its key expired
                // meanwhile) shows as a verdict longer than its slack. Published later,
                // once Redis has been reachable for a full grace again: the marker this
                // verdict set goes (best effort; left, it delays the report by one marker
                // TTL at most).
                if !fenced && self.reach.took_too_long(started.elapsed()) {
                    let _: redis::RedisResult<()> = redis::cmd("DEL")
                        .arg(self.keys.server_reported(server))
                        .query_async(&mut c)
                        .await;
                    return Ok(Verdict::Waiting {
                        remaining_ms: self.settings.heartbeat_grace_ms,
                    });
                }
                let id =
                    crate::stream::publish_event(&self.conn, &self.keys, &event.encode()).await?;
                self.metrics.reconcile_dead_found.inc();
                info!(server_id = %server, entry = %id, event_id = %event.event_id, "server is dead; published server.dead");
                Ok(Verdict::Published(id))
            }
        }
    }

    /// Every member of `servers` with its score (last heartbeat), by ZSCAN. Heartbeats move
    /// scores and cleanups remove members all the time, so paging by rank or by offset
    /// would skip members whose place shifted between two pages; ZSCAN returns every
    /// member present for the whole walk, whatever happens to the others (duplicates,
    /// which ZSCAN may give, are dropped).
    pub(super) async fn known_servers(&self) -> Result<Vec<(String, f64)>> {
        let mut seen = std::collections::BTreeMap::new();
        let mut cursor = 0u64;
        loop {
            let (next, flat): (u64, Vec<(String, f64)>) = redis::cmd("ZSCAN")
                .arg(self.keys.servers())
                .arg(cursor)
                .arg("COUNT")
                .arg(PAGE)
                .query_async(&mut self.conn.clone())
                .await?;
            seen.extend(flat);
            if next == 0 {
                return Ok(seen.into_iter().collect());
            }
            cursor = next;
        }
    }

    /// One pass over `servers`: lowers the scores that lie in the future (see
    /// [`crate::clock`]), then checks every server whose heartbeat is older than the
    /// grace period by Redis's time, and every fenced server (see the module docs).
    pub async fn pass(&self) -> Result<PassReport> {
        let mut report = PassReport::default();
        // Observed once before the candidates are listed; each check looks again.
        self.hold().await?;
        // Taken before the list: a stall meanwhile only makes it more careful.
        let now = self.lower_scores_ahead().await?;
        let grace = self.settings.heartbeat_grace_ms;
        let mut candidates: std::collections::BTreeSet<String> = self
            .known_servers()
            .await?
            .into_iter()
            .filter(|(_, score)| clock::is_past_grace(*score, now, grace))
            .map(|(member, _)| member)
            .collect();
        let fences =
            crate::fence::standing(&self.conn, &self.keys, Some(self.settings.fence_ttl_ms))
                .await?;
        self.metrics
            .observe_fences(&fences, self.settings.heartbeat_grace_ms);
        candidates.extend(fences.into_iter().map(|f| f.server_id));
        for member in candidates {
            report.candidates += 1;
            let Ok(server) = ServerId::parse(&member) else {
                report.invalid += 1;
                warn!(member = %member.escape_debug(), "`servers` holds an invalid server id; left alone");
                continue;
            };
            match self.check(&server).await? {
                Verdict::Published(_) => report.published += 1,
                Verdict::Alive => report.alive += 1,
                Verdict::TooRecent { .. } => report.too_recent += 1,
                Verdict::AlreadyReported => report.already_reported += 1,
                Verdict::FencedClean => report.fenced_clean += 1,
                Verdict::Waiting { .. } => report.waiting += 1,
            }
        }
        self.metrics
            .reconcile_verdicts_waiting
            .set(report.waiting as i64);
        self.metrics.reconcile_passes.inc();
        Ok(report)
    }

    /// The tolerance of a score in the future ([`clock::tolerance_ms`]).
    pub(super) fn tolerance_ms(&self) -> u64 {
        clock::tolerance_ms(self.settings.heartbeat_grace_ms)
    }

    /// Redis's time and the scores of `members`, those in the future lowered first
    /// ([`clock::lower`]).
    pub(super) async fn lowered(&self, members: &[&str]) -> Result<clock::Lowered> {
        let seen = clock::lower(&self.conn, &self.keys, self.tolerance_ms(), members).await?;
        if seen.refused > 0
            && !self
                .lowering_refused
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            warn!(
                refused = seen.refused,
                "`servers` holds scores in the future (a writer scoring with a clock that runs \
                 ahead) that could not be lowered to Redis's time: ZADD on `servers` was refused \
                 (an ACL without it, see k8s/redis-acl.example.conf, or Redis out of memory); \
                 such servers are declared dead only once their score is past"
            );
        }
        Ok(seen)
    }

    /// Lowers every score of `servers` in the future to Redis's time; returns that time.
    pub(super) async fn lower_scores_ahead(&self) -> Result<u64> {
        loop {
            let seen = self.lowered(&[]).await?;
            if seen.lowered > 0 {
                tracing::debug!(
                    lowered = seen.lowered,
                    "`servers` scores in the future (written with a clock that runs ahead) lowered to Redis's time"
                );
            }
            if seen.lowered < clock::LOWER_PAGE as u64 {
                return Ok(seen.now_ms);
            }
        }
    }

    /// Live servers: a liveness key, or a heartbeat within the grace period (by Redis's
    /// time).
    pub async fn live_servers(&self) -> Result<Vec<ServerId>> {
        let now = clock::now_ms(&self.conn, &self.keys).await?;
        let grace = self.settings.heartbeat_grace_ms;
        let mut live = Vec::new();
        let servers: Vec<(ServerId, f64)> = self
            .known_servers()
            .await?
            .into_iter()
            .filter_map(|(m, score)| ServerId::parse(&m).ok().map(|s| (s, score)))
            .collect();
        let ids: Vec<ServerId> = servers.iter().map(|(s, _)| s.clone()).collect();
        let alive = crate::registry::have_liveness_keys(&self.conn, &self.keys, &ids).await?;
        for ((server, score), has_key) in servers.into_iter().zip(alive) {
            if has_key || !clock::is_past_grace(score, now, grace) {
                live.push(server);
            }
        }
        Ok(live)
    }
}

/// Counts servers that are dead now (heartbeat older than the grace by Redis's time, and
/// no liveness key), read-only.
pub async fn count_dead(conn: &RedisConn, keys: &Keys, grace_ms: u64) -> Result<u64> {
    let cutoff = clock::now_ms(conn, keys).await?.saturating_sub(grace_ms);
    let stale: Vec<String> = redis::cmd("ZRANGEBYSCORE")
        .arg(keys.servers())
        .arg("-inf")
        .arg(cutoff)
        .query_async(&mut conn.clone())
        .await?;
    let servers: Vec<ServerId> = stale
        .iter()
        .filter_map(|s| ServerId::parse(s).ok())
        .collect();
    let alive = crate::registry::have_liveness_keys(conn, keys, &servers).await?;
    Ok(alive.iter().filter(|a| !**a).count() as u64)
}

/// report_dead.lua's reply, {verdict, detail}: what it found, and what it did.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Found {
    /// Dead: `server.dead` published as `entry` (verdict 1).
    Published { entry: String },
    /// The liveness key exists (0).
    Alive,
    /// The last heartbeat is within the grace period (2, detail its score, then the ms
    /// until it is past the grace, both by Redis's time).
    TooRecent {
        heartbeat_ms: u64,
        remaining_ms: u64,
    },
    /// Another reconciler reported it within the marker's lifetime (3).
    AlreadyReported,
    /// Fenced, with nothing left to clean (4).
    FencedClean,
    /// Not fenced, and Redis has not been reachable for a full grace (5).
    Waiting,
    /// Not fenced, and Redis's clock is past the guard's bound: it stepped forward (6,
    /// detail Redis's time).
    ClockAhead { redis_ms: u64 },
}

impl redis::FromRedisValue for Found {
    fn from_redis_value(v: redis::Value) -> std::result::Result<Self, redis::ParsingError> {
        let mut f = Fields::new("report_dead.lua", v, 3)?;
        let verdict: i64 = f.next("verdict")?;
        let detail: String = f.next("detail")?;
        let wait: u64 = f.next("wait")?;
        Ok(match verdict {
            1 => Found::Published { entry: detail },
            0 => Found::Alive,
            2 => Found::TooRecent {
                heartbeat_ms: detail.parse::<f64>().map_or(0, |f| f as u64),
                remaining_ms: wait,
            },
            3 => Found::AlreadyReported,
            4 => Found::FencedClean,
            5 => Found::Waiting,
            6 => Found::ClockAhead {
                redis_ms: detail.parse().unwrap_or(0),
            },
            other => {
                return Err(malformed(
                    f.script(),
                    "a verdict from 0 to 6",
                    &redis::Value::Int(other),
                ))
            }
        })
    }
}

/// report_dead_cluster.lua's verdict (the event is published after it, by the caller).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FoundOnCluster {
    /// Dead, and the marker is set: publish (1).
    Dead,
    /// The liveness key exists (0).
    Alive,
    /// The marker was there: reported within its lifetime (3).
    AlreadyReported,
    /// Fenced, with nothing left to clean (4).
    FencedClean,
}

impl redis::FromRedisValue for FoundOnCluster {
    fn from_redis_value(v: redis::Value) -> std::result::Result<Self, redis::ParsingError> {
        int_state(
            "report_dead_cluster.lua",
            "a verdict 0, 1, 3 or 4",
            v,
            |n| match n {
                1 => Some(FoundOnCluster::Dead),
                0 => Some(FoundOnCluster::Alive),
                3 => Some(FoundOnCluster::AlreadyReported),
                4 => Some(FoundOnCluster::FencedClean),
                _ => None,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::{FromRedisValue, Value};

    fn reply(verdict: i64, detail: &str) -> Value {
        Value::Array(vec![
            Value::Int(verdict),
            Value::BulkString(detail.as_bytes().to_vec()),
            Value::Int(if verdict == 2 { 1_500 } else { 0 }),
        ])
    }

    #[test]
    fn report_dead_verdicts_decode_into_named_states() {
        let decode = |v, d| Found::from_redis_value(reply(v, d)).unwrap();
        assert_eq!(
            decode(1, "1-0"),
            Found::Published {
                entry: "1-0".into()
            }
        );
        assert_eq!(decode(0, ""), Found::Alive);
        assert_eq!(
            decode(2, "1700000000000"),
            Found::TooRecent {
                heartbeat_ms: 1_700_000_000_000,
                remaining_ms: 1_500
            }
        );
        assert_eq!(decode(3, ""), Found::AlreadyReported);
        assert_eq!(decode(4, ""), Found::FencedClean);
        assert_eq!(decode(5, ""), Found::Waiting);
        let err = Found::from_redis_value(reply(9, ""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("report_dead.lua"), "{err}");
        let err = FoundOnCluster::from_redis_value(Value::Int(2))
            .unwrap_err()
            .to_string();
        assert!(err.contains("report_dead_cluster.lua"), "{err}");
        assert_eq!(
            FoundOnCluster::from_redis_value(Value::Int(1)).unwrap(),
            FoundOnCluster::Dead
        );
    }
}
