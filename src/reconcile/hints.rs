//! Expiry hints: keyspace notifications of liveness keys (`__keyevent@<db>__:expired`)
//! trigger the pass's check of that server at once, on one node or on every master of a
//! cluster. Pub/Sub loses messages and notifications may be off: a hint only makes a
//! cleanup start sooner; the pass finds every dead server anyway.

use std::{sync::Arc, time::Duration};

use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::{Reconciler, Verdict, HINT_CHECKS};

/// Behind Redis Sentinel, how often the expiry-hint subscription checks that it listens
/// on the primary.
const FOLLOW_EVERY: Duration = Duration::from_secs(2);
use crate::{
    conn::{self, RedisConn},
    event::ServerId,
    retry::policy,
};

impl Reconciler {
    /// Listens for liveness-key expiries and checks those servers at once: on one node,
    /// or on every master of a cluster (notifications are per node).
    pub(super) async fn hint_loop(self: Arc<Self>, shutdown: CancellationToken) {
        if let Some(client) = self.client.clone() {
            let db = client.get_connection_info().redis_settings().db();
            return self.subscribe_hints(client, db, shutdown).await;
        }
        if let RedisConn::Sentinel(primary) = self.conn.clone() {
            return self.hint_loop_on_sentinel(primary, shutdown).await;
        }
        self.hint_loop_on_cluster(shutdown).await
    }

    /// Behind Redis Sentinel: one subscription, on the current primary. Every
    /// [`FOLLOW_EVERY`] the primary is checked (ROLE, through the connection that looks it
    /// up again through the sentinels when it is lost or demoted); when another node is
    /// the primary, the subscription moves there. A subscription left on a demoted primary
    /// would hear nothing: replicas do not expire keys themselves.
    pub(super) async fn hint_loop_on_sentinel(
        self: Arc<Self>,
        primary: conn::SentinelConn,
        shutdown: CancellationToken,
    ) {
        let db = self.conn_db();
        let mut known: Option<String> = None;
        let mut subscription = CancellationToken::new();
        loop {
            match primary.primary_client().await {
                Ok(client) => {
                    let addr = client.get_connection_info().addr().to_string();
                    if known.as_deref() != Some(addr.as_str()) {
                        subscription.cancel();
                        subscription = shutdown.child_token();
                        tokio::spawn(self.clone().subscribe_hints(
                            client,
                            db,
                            subscription.clone(),
                        ));
                        info!(primary = %addr, "listening for liveness-key expiries on the primary");
                        known = Some(addr);
                    }
                }
                Err(e) => {
                    self.reach.failed(&e);
                    debug!(error = %e, "finding the primary for expiry hints failed")
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(FOLLOW_EVERY) => {}
                _ = shutdown.cancelled() => return,
            }
        }
    }

    /// The database of the connection (keyspace notifications are per database).
    fn conn_db(&self) -> i64 {
        redis::aio::ConnectionLike::get_db(&self.conn)
    }

    /// One subscription per master; when the set of masters changes (a failover, a
    /// reshard), the subscriptions are made again.
    pub(super) async fn hint_loop_on_cluster(self: Arc<Self>, shutdown: CancellationToken) {
        let mut known: Vec<(String, u16)> = Vec::new();
        let mut subscriptions = CancellationToken::new();
        loop {
            match conn::cluster_masters(&self.conn).await {
                Ok(masters) if masters != known => {
                    subscriptions.cancel();
                    subscriptions = shutdown.child_token();
                    for (host, port) in &masters {
                        let client = match conn::node_client(&self.settings, host, *port) {
                            Ok(c) => c,
                            Err(e) => {
                                warn!(%host, port, error = %e, "no client for a master; its expiry hints are missed");
                                continue;
                            }
                        };
                        tokio::spawn(self.clone().subscribe_hints(
                            client,
                            0,
                            subscriptions.clone(),
                        ));
                    }
                    info!(
                        masters = masters.len(),
                        "listening for liveness-key expiries on every master"
                    );
                    known = masters;
                }
                Ok(_) => {}
                Err(e) => {
                    self.reach.failed(&e);
                    debug!(error = %e, "listing the cluster's masters failed")
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(5)) => {}
                _ = shutdown.cancelled() => return,
            }
        }
    }

    /// Subscribes `client` to `__keyevent@<db>__:expired` and checks the servers whose
    /// liveness keys expire. Reconnects with backoff; after each (re)subscription a pass
    /// covers what was missed.
    pub(super) async fn subscribe_hints(
        self: Arc<Self>,
        client: redis::Client,
        db: i64,
        shutdown: CancellationToken,
    ) {
        let channel = format!("__keyevent@{db}__:expired");
        let mut backoff = backon::BackoffBuilder::build(policy());
        loop {
            let subscribed = async {
                let mut pubsub = client.get_async_pubsub().await?;
                pubsub.subscribe(&channel).await?;
                Ok::<_, redis::RedisError>(pubsub)
            };
            let pubsub = tokio::select! {
                p = subscribed => p,
                _ = shutdown.cancelled() => return,
            };
            let mut messages = match pubsub {
                Ok(p) => {
                    backoff = backon::BackoffBuilder::build(policy());
                    info!(%channel, "listening for liveness-key expiries");
                    // Checked on every (re)subscription, not once at start: Redis may have
                    // been down or busy then, and a restart forgets a CONFIG SET.
                    if let Ok(node) = conn::shared(&client) {
                        self.ensure_notifications(&node).await;
                    }
                    p.into_on_message()
                }
                Err(e) => {
                    self.reach.failed(&e.clone().into());
                    debug!(error = %e, "subscribing to expiry notifications failed");
                    let wait = backoff.next().unwrap_or(Duration::from_secs(5));
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => continue,
                        _ = shutdown.cancelled() => return,
                    }
                }
            };
            // Hints may have been lost while not subscribed.
            let (catch_up, stop) = (self.clone(), shutdown.clone());
            tokio::spawn(async move {
                tokio::select! {
                    r = catch_up.pass() => if let Err(e) = r {
                        catch_up.reach.failed(&e);
                        debug!(error = %e, "catch-up pass failed");
                    },
                    _ = stop.cancelled() => {}
                }
            });
            loop {
                let msg = tokio::select! {
                    m = messages.next() => m,
                    _ = shutdown.cancelled() => return,
                };
                let Some(msg) = msg else { break };
                let Ok(key) = std::str::from_utf8(msg.get_payload_bytes()) else {
                    continue;
                };
                if let Some(server) = self
                    .keys
                    .server_of_alive_key(key)
                    .and_then(|s| ServerId::parse(s).ok())
                {
                    self.metrics.expiry_hints.inc();
                    self.clone().spawn_hint_check(server, &shutdown);
                }
            }
            if shutdown.is_cancelled() {
                return;
            }
            self.reach
                .note_failure("the expiry notification subscription was lost");
            warn!("expiry notification subscription lost; subscribing again");
        }
    }

    /// Starts [`Reconciler::on_expiry`] for `server`, unless it is being checked already
    /// or [`HINT_CHECKS`] checks are under way: then the hint is dropped, and the server
    /// is found by the pass, as when a notification is lost.
    pub(super) fn spawn_hint_check(self: Arc<Self>, server: ServerId, stop: &CancellationToken) {
        let Ok(permit) = self.hint_permits.clone().try_acquire_owned() else {
            debug!(server_id = %server, limit = HINT_CHECKS, "too many expiry hints being checked; this one is left to the pass");
            return;
        };
        if !crate::lock::lock(&self.hinted).insert(server.clone()) {
            return;
        }
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = self.on_expiry(&server) => {}
                _ = stop.cancelled() => {}
            }
            crate::lock::lock(&self.hinted).remove(&server);
            drop(permit);
        });
    }

    /// Checks a server whose liveness key just expired; if its heartbeat is still within
    /// the grace period, checks again when the grace period ends; if Redis has not been
    /// reachable for a full grace since its last outage, checks again when it has.
    pub(super) async fn on_expiry(&self, server: &ServerId) {
        for _ in 0..3 {
            match self.check(server).await {
                // Measured on Redis's clock by the check itself: no local clock is read.
                Ok(Verdict::TooRecent { remaining_ms, .. }) => {
                    let wait = remaining_ms.min(self.settings.heartbeat_grace_ms);
                    tokio::time::sleep(Duration::from_millis(wait + 50)).await;
                }
                Ok(Verdict::Waiting { remaining_ms }) => {
                    tokio::time::sleep(Duration::from_millis(remaining_ms + 50)).await;
                }
                Ok(verdict) => {
                    debug!(server_id = %server, ?verdict, "expiry hint checked");
                    return;
                }
                Err(e) => {
                    self.reach.failed(&e);
                    debug!(server_id = %server, error = %e, "expiry hint check failed; the periodic pass will see it");
                    return;
                }
            }
        }
    }

    /// Makes sure expiry notifications are on, or says how to turn them on.
    pub(super) async fn ensure_notifications(&self, node: &RedisConn) {
        let mut c = node.clone();
        let current: redis::RedisResult<Vec<String>> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("notify-keyspace-events")
            .query_async(&mut c)
            .await;
        let flags = match current {
            Ok(v) => v.get(1).cloned().unwrap_or_default(),
            Err(e) => {
                warn!(error = %e, "cannot read notify-keyspace-events; expiry hints may not arrive (the periodic pass still finds dead servers)");
                return;
            }
        };
        let has = |c: char| flags.contains(c);
        if has('E') && (has('x') || has('A')) {
            return;
        }
        if !self.settings.keyspace_events_auto {
            warn!(
                current = %flags,
                "keyspace expiry notifications are off: dead servers are found by the periodic pass only. \
                 To find them within a second: CONFIG SET notify-keyspace-events Ex (keeping other flags), \
                 or set keyspace_events_auto = true"
            );
            return;
        }
        let wanted = format!("{flags}Ex");
        match redis::cmd("CONFIG")
            .arg("SET")
            .arg("notify-keyspace-events")
            .arg(&wanted)
            .query_async::<()>(&mut c)
            .await
        {
            Ok(()) => info!(flags = %wanted, "turned on keyspace expiry notifications"),
            Err(e) => warn!(error = %e, "could not turn on keyspace expiry notifications"),
        }
    }
}
