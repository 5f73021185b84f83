//! Health and readiness of a worker or reconciler process, apart from the HTTP listener
//! that serves them ([`crate::http`]):
//! - [`Health`] (liveness): the process's main loop has turned recently. A Redis outage
//!   does not fail it (the loop keeps turning while it retries); a stuck loop does.
//! - [`Readiness`]: nothing of the process's work is failing on a transient Redis state,
//!   Redis answers and, for a worker, its build works under the data format in use (see
//!   [`crate::format`]) and its consumer can be registered in the group (a write: refused
//!   under OOM, NOREPLICAS, MISCONF, READONLY).
//! - [`watch_redis`]: the gauge `registry_janitor_redis_up`, from a PING every few
//!   seconds, so that an alert can tell "Redis unreachable" without probing `/readyz`.

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use tokio_util::sync::CancellationToken;

use crate::{
    conn::RedisConn,
    keys::{Keys, GROUP},
};

/// Liveness: when the main loop last turned.
#[derive(Debug)]
pub struct Health {
    last_beat_ms: AtomicU64,
    /// How long without a beat counts as stuck.
    stall_after: Duration,
}

impl Health {
    pub fn new(stall_after: Duration) -> Arc<Self> {
        Arc::new(Health {
            last_beat_ms: AtomicU64::new(crate::now_ms()),
            stall_after,
        })
    }

    /// Called by the main loop each time it turns.
    pub fn beat(&self) {
        self.last_beat_ms.store(crate::now_ms(), Ordering::Relaxed);
    }

    /// Milliseconds since the last beat.
    pub fn silent_for_ms(&self) -> u64 {
        crate::now_ms().saturating_sub(self.last_beat_ms.load(Ordering::Relaxed))
    }

    pub fn is_live(&self) -> bool {
        self.silent_for_ms() <= self.stall_after.as_millis() as u64
    }
}

/// Readiness: can this process do its job right now?
///
/// Not ready while any of its work is failing on a transient Redis state (see
/// [`Failing`]: BUSY, LOADING, OOM, NOREPLICAS, MISCONF, READONLY, a refused connection...),
/// while Redis does not answer PING, and, for a worker, while its build does not work
/// under the data format in use or its consumer cannot be registered in the group.
#[derive(Clone)]
pub struct Readiness {
    pub conn: RedisConn,
    pub keys: Keys,
    /// A worker's consumer name; None for the reconciler. The worker's probe runs
    /// `XGROUP CREATECONSUMER` for it: a write (flagged `denyoom`) that changes nothing
    /// when the consumer exists, so Redis refuses it in every state that refuses the
    /// worker's writes (OOM, NOREPLICAS, MISCONF, READONLY) and when the group is gone,
    /// even while the worker has nothing to do. (A consumer removed by consumer expiry is
    /// registered again, as the worker itself does between reads.)
    pub consumer: Option<String>,
    /// The work of this process failing right now.
    pub failing: Arc<Failing>,
    /// A worker's view of the data format: not ready while its build does not work
    /// under the format in use (it takes no work then). None for the other processes.
    pub format: Option<Arc<crate::format::Gate>>,
}

impl Readiness {
    /// Ready or not, with the reason; when ready, what an operator should know (the
    /// verdicts the guard holds, by server), empty otherwise. Holding verdicts is the
    /// guard doing its work, not a fault: the process stays ready.
    pub async fn check(&self) -> Result<String, String> {
        self.check_ready().await?;
        let holds = crate::guard::hold::list(&self.conn, &self.keys)
            .await
            .unwrap_or_default();
        if holds.is_empty() {
            return Ok(String::new());
        }
        let names: Vec<&str> = holds
            .iter()
            .take(20)
            .map(|h| h.server_id.as_str())
            .collect();
        Ok(format!(
            "{} verdict(s) held by the guard (not fenced, not cleaned): {}{}",
            holds.len(),
            names.join(", "),
            if holds.len() > names.len() {
                ", ..."
            } else {
                ""
            }
        ))
    }

    async fn check_ready(&self) -> Result<(), String> {
        if let Some((what, error)) = self.failing.any() {
            return Err(format!("{what} failing: {error}"));
        }
        if let Some(why) = self.format.as_ref().and_then(|gate| gate.refusal()) {
            return Err(why);
        }
        let mut c = self.conn.clone();
        let check = async {
            let _: String = redis::cmd("PING")
                .query_async(&mut c)
                .await
                .map_err(|e| format!("redis: {e}"))?;
            if let Some(consumer) = &self.consumer {
                let registered: redis::RedisResult<i64> = redis::cmd("XGROUP")
                    .arg("CREATECONSUMER")
                    .arg(self.keys.events())
                    .arg(GROUP)
                    .arg(consumer)
                    .query_async(&mut c)
                    .await;
                match registered {
                    Ok(_) => {}
                    Err(e) if e.code() == Some("NOGROUP") => {
                        return Err(format!("consumer group {GROUP} does not exist yet"))
                    }
                    Err(e) => return Err(format!("consumer group: {e}")),
                }
            }
            Ok(())
        };
        tokio::time::timeout(Duration::from_secs(2), check)
            .await
            .unwrap_or_else(|_| Err("redis did not answer within 2 s".into()))
    }
}

/// The work of one process that is failing right now on a transient error, with the
/// last error of each: `/readyz` answers 503 while anything is. Keyed by what the work
/// is ("reading events", "reconcile pass"); several tasks doing the same work count
/// separately, so the work recovers when the last of them does.
#[derive(Debug, Default)]
pub struct Failing {
    now: Mutex<BTreeMap<String, (usize, String)>>,
}

impl Failing {
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// One more task of `what` is failing; true if `what` was not failing before.
    pub(crate) fn start(&self, what: &str, error: String) -> bool {
        let mut now = crate::lock::lock(&self.now);
        let entry = now.entry(what.to_owned()).or_insert((0, String::new()));
        entry.0 += 1;
        entry.1 = error;
        entry.0 == 1
    }

    pub(crate) fn update(&self, what: &str, error: String) {
        if let Some(entry) = crate::lock::lock(&self.now).get_mut(what) {
            entry.1 = error;
        }
    }

    /// One task of `what` stopped failing; true if no task of `what` fails any more.
    pub(crate) fn end(&self, what: &str) -> bool {
        let mut now = crate::lock::lock(&self.now);
        match now.get_mut(what) {
            Some(entry) if entry.0 > 1 => {
                entry.0 -= 1;
                false
            }
            Some(_) => {
                now.remove(what);
                true
            }
            None => true,
        }
    }

    /// Something failing now and its last error, if anything is.
    pub fn any(&self) -> Option<(String, String)> {
        let now = crate::lock::lock(&self.now);
        now.iter().next().map(|(w, (_, e))| (w.clone(), e.clone()))
    }
}

/// How often [`watch_redis`] pings.
pub const REDIS_UP_EVERY: Duration = Duration::from_secs(5);

/// Spawns [`watch_redis`] for the life of the returned guard (and no longer than
/// `shutdown`).
pub fn spawn_redis_watch(
    conn: RedisConn,
    up: prometheus::IntGauge,
    shutdown: &CancellationToken,
) -> tokio_util::sync::DropGuard {
    let stop = shutdown.child_token();
    tokio::spawn(watch_redis(conn, up, stop.clone()));
    stop.drop_guard()
}

/// Sets `up` to 1 while Redis answers PING within 2 s (as `/readyz` asks it), 0 otherwise,
/// every [`REDIS_UP_EVERY`] until `stop`. Run by the worker and the reconciler for the
/// gauge `registry_janitor_redis_up`.
pub async fn watch_redis(conn: RedisConn, up: prometheus::IntGauge, stop: CancellationToken) {
    loop {
        let mut c = conn.clone();
        let cmd = redis::cmd("PING");
        let ping = cmd.query_async::<String>(&mut c);
        let answered = matches!(
            tokio::time::timeout(Duration::from_secs(2), ping).await,
            Ok(Ok(_))
        );
        up.set(i64::from(answered));
        tokio::select! {
            _ = tokio::time::sleep(REDIS_UP_EVERY) => {}
            _ = stop.cancelled() => return,
        }
    }
}
