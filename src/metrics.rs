//! Prometheus metrics of one process, in a registry of its own (no global state, so tests
//! can run several workers in one process and read each one's numbers).

use prometheus::{
    Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};

/// What building a metric relies on: its name, help and labels are fixed in this file
/// and valid Prometheus names (a test builds them all).
const VALID: &str = "a metric's fixed name, help and labels are valid";
/// What registering relies on: each name is registered once, in a registry of its own.
const UNIQUE: &str = "each metric name is registered once in this process's registry";

/// Outcome label values of `registry_janitor_events_total`.
pub mod outcome {
    pub const CLEANED: &str = "cleaned";
    pub const IGNORED: &str = "ignored";
    pub const DEAD_LETTERED: &str = "dead_lettered";
    pub const FAILED: &str = "failed";
    pub const ABANDONED: &str = "abandoned";
}

/// Decision label values of `registry_janitor_guard_verdicts_total`.
pub mod guard_decision {
    /// A disputed verdict within `guard_disputed_limit`: it went ahead.
    pub const LET_THROUGH: &str = "let_through";
    /// A doubtful verdict beyond the limits: held.
    pub const HELD: &str = "held";
    /// A held verdict of a mass silence whose server heartbeats again: acknowledged,
    /// nothing done.
    pub const DROPPED: &str = "dropped";
    /// A held verdict let go (its server stayed silent past the hold's grace).
    pub const RELEASED: &str = "released";
    /// A further verdict for a server whose verdict is held: acknowledged.
    pub const DUPLICATE: &str = "duplicate";
    pub const ALL: [&str; 5] = [LET_THROUGH, HELD, DROPPED, RELEASED, DUPLICATE];
}

/// Label values of `registry_janitor_reconcile_outages_total`: what started a new
/// stretch of Redis-reachable time.
pub mod outage_cause {
    /// A call failed, or Redis took too long to answer.
    pub const FAILED_CALLS: &str = "failed_calls";
    /// Redis restarted or failed over, or started recently from disk.
    pub const RESTART: &str = "restart";
    /// Redis's clock (or the reconciler's) stepped forward.
    pub const CLOCK_JUMP: &str = "clock_jump";
    /// The reconciler itself did not run for longer than its watch allows.
    pub const STALL: &str = "stall";
    pub const ALL: [&str; 4] = [FAILED_CALLS, RESTART, CLOCK_JUMP, STALL];
}

/// Outcome label values of `registry_janitor_receiver_alerts_total`.
pub mod alert_outcome {
    /// A firing alert whose `server.dead` this request published.
    pub const PUBLISHED: &str = "published";
    /// A firing alert already published (a re-send, another replica): nothing new.
    pub const DUPLICATE: &str = "duplicate";
    /// A resolved alert: nothing is published.
    pub const RESOLVED: &str = "resolved";
    /// An alert refused (no server label, an invalid server id or start time...).
    pub const REFUSED: &str = "refused";
}

#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    /// Stream entries handled, by outcome.
    pub events: IntCounterVec,
    /// Forward entries deleted because they still pointed at a dead server.
    pub entries_deleted: IntCounter,
    /// Forward entries left alone because their user had moved to another server.
    pub entries_kept: IntCounter,
    /// Pending entries taken over from other consumers (XAUTOCLAIM).
    pub entries_claimed: IntCounter,
    /// Pending entries found deleted from the stream during takeover (dropped, not retried).
    pub entries_vanished: IntCounter,
    /// Time one cleanup took, from start to acknowledgement.
    pub cleanup_seconds: Histogram,
    /// Time from `detected_at_ms` to acknowledgement: the stale window users feel.
    pub stale_window_seconds: Histogram,
    /// On a cluster, time the end of a walk waited for the replicas to hold its deletes.
    pub replica_wait_seconds: Histogram,
    /// Redis commands that failed (each attempt).
    pub redis_errors: IntCounter,
    /// Reconciler passes over `servers` completed.
    pub reconcile_passes: IntCounter,
    /// `server.dead` events the reconciler published.
    pub reconcile_dead_found: IntCounter,
    /// Forward entries of dead owners removed by the drift sweep.
    pub drift_entries_removed: IntCounter,
    /// Reverse-set members removed because their user had moved.
    pub drift_members_removed: IntCounter,
    /// Liveness-key expiry notifications received.
    pub expiry_hints: IntCounter,
    /// Events not yet delivered to any worker (the group's lag), sampled.
    pub stream_lag: IntGauge,
    /// Events delivered but not acknowledged, sampled.
    pub stream_pending: IntGauge,
    /// Entries in the dead-letter stream, sampled.
    pub dead_letters: IntGauge,
    /// Stream entries this worker is handling now (cleaning, dead-lettering, acking).
    pub entries_in_hand: IntGauge,
    /// Writes of fenced servers refused by the protocol, by operation (read from the
    /// fences by the reconciler's pass; see [`Metrics::observe_fences`]).
    pub fence_refused_writes: IntCounterVec,
    /// Fences standing now, sampled by the reconciler.
    pub fenced_servers: IntGauge,
    /// Fenced servers that tried to write within `heartbeat_grace_ms`: a false positive
    /// or a zombie.
    pub fenced_servers_writing: IntGauge,
    /// Verdicts on servers the registry did not know (no liveness key, no users, not in
    /// `servers`): fenced for `fence_unknown_ttl_ms`, not indexed. Monitoring names
    /// servers the registry does not know.
    pub unknown_server_verdicts: IntCounter,
    /// `users.evicted` entries written to the evictions stream (cleanup and sweep).
    pub evictions_entries: IntCounter,
    /// Users announced in those entries.
    pub evictions_users: IntCounter,
    /// Users of a cluster cleanup (layout `keys`) that a master's check-and-delete script
    /// left to the per-slot scripts: their slot moved or was moving, or the node did not
    /// answer.
    pub cluster_users_rechecked: IntCounter,
    /// 1 while Redis answers PING, 0 while it does not (see `health::watch_redis`).
    pub redis_up: IntGauge,
    /// How long Redis has been reachable without a break, as the reconciler knows it
    /// (since its last outage, or since Redis started): verdicts on silent servers wait
    /// while it is under `heartbeat_grace_ms` (see `guard::reachable`).
    pub reconcile_reachable_seconds: Gauge,
    /// Redis outages the reconciler detected, by cause (`failed_calls`, `restart`,
    /// `clock_jump`, `stall`): each one holds verdicts for a grace.
    pub reconcile_outages: IntCounterVec,
    /// Servers whose verdict the last pass held because Redis had not been reachable
    /// for a full grace yet.
    pub reconcile_verdicts_waiting: IntGauge,
    /// The step limiter's window, steps in flight, queue delays and cuts
    /// (see `cleanup::limiter`).
    pub steps: crate::cleanup::limiter::LimiterMetrics,
    /// Verdicts the guard holds now (sampled by the workers' upkeep).
    pub guard_held: IntGauge,
    /// The guard's decisions on doubtful verdicts, and the ends of holds, by decision.
    pub guard_verdicts: IntCounterVec,
    /// The data format in use, as this worker last read it (0 before the first read).
    pub format_in_use: IntGauge,
    /// 1 while the format in use is newer than this worker's build: it takes no work.
    pub format_behind: IntGauge,
    /// Alert receiver: requests answered, by HTTP status code.
    pub receiver_requests: IntCounterVec,
    /// Alert receiver: alerts of accepted webhooks, by outcome ([`alert_outcome`]).
    pub receiver_alerts: IntCounterVec,
    /// Alert receiver: requests refused for a missing or wrong bearer token.
    pub receiver_unauthorized: IntCounter,
    /// Alert receiver: requests being answered now.
    pub receiver_in_flight: IntGauge,
    /// Stream entries trimmed past `stream_max_age_ms` while a group had not acknowledged
    /// them (pending or never delivered), by stream and group.
    pub stream_unacked_trimmed: IntCounterVec,
    /// Dead letters trimmed past `stream_max_age_ms`, never replayed nor purged.
    pub dead_letters_expired: IntCounter,
    /// Each group's entries not yet delivered (`lag`; absent while Redis cannot tell).
    pub stream_group_lag: IntGaugeVec,
    /// Each group's pending entries.
    pub stream_group_pending: IntGaugeVec,
    /// Age of each group's oldest entry still in the stream it has not acknowledged
    /// (0: none).
    pub stream_group_oldest_unacked_age: GaugeVec,
    /// Idle time of each group's most recently active consumer (absent: no consumer).
    pub stream_group_idle: GaugeVec,
    /// The `stream_max_age_ms` setting, in seconds (0: no hard bound).
    pub stream_max_age: Gauge,
    /// Refusals already counted, per fence and operation.
    fence_refusals_seen:
        std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, [u64; 3]>>>,
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let events = IntCounterVec::new(
            Opts::new(
                "registry_janitor_events_total",
                "Stream entries handled, by outcome",
            ),
            &["outcome"],
        )
        .expect(VALID);
        let entries_deleted = IntCounter::new(
            "registry_janitor_entries_deleted_total",
            "Forward registry entries deleted because they pointed at a dead server",
        )
        .expect(VALID);
        let entries_kept = IntCounter::new(
            "registry_janitor_entries_kept_total",
            "Forward registry entries kept because their user had moved to another server",
        )
        .expect(VALID);
        let entries_claimed = IntCounter::new(
            "registry_janitor_entries_claimed_total",
            "Pending stream entries taken over from other consumers",
        )
        .expect(VALID);
        let entries_vanished = IntCounter::new(
            "registry_janitor_pending_vanished_total",
            "Pending entries that had been deleted from the stream when a takeover found them",
        )
        .expect(VALID);
        let buckets = vec![
            0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
        ];
        let cleanup_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "registry_janitor_cleanup_duration_seconds",
                "Time to clean one dead server, start to acknowledgement",
            )
            .buckets(buckets.clone()),
        )
        .expect(VALID);
        let stale_window_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "registry_janitor_stale_window_seconds",
                "Time from detected_at_ms of a server.dead event to its cleanup being acknowledged",
            )
            .buckets(buckets.clone()),
        )
        .expect(VALID);
        let replica_wait_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "registry_janitor_cluster_replica_wait_seconds",
                "On a Redis Cluster, time the end of a walk waited for the replicas to hold the walk's deletes",
            )
            .buckets(buckets),
        )
        .expect(VALID);
        let redis_errors = IntCounter::new(
            "registry_janitor_redis_errors_total",
            "Redis commands that failed, each attempt counted",
        )
        .expect(VALID);
        let gauge = |name: &str, help: &str| IntGauge::new(name, help).expect(VALID);
        let stream_lag = gauge(
            "registry_janitor_stream_lag",
            "Events in registry:events not yet delivered to any worker (sampled)",
        );
        let stream_pending = gauge(
            "registry_janitor_stream_pending",
            "Events delivered to a worker but not acknowledged (sampled)",
        );
        let dead_letters = gauge(
            "registry_janitor_dead_letters",
            "Entries in the dead-letter stream (sampled)",
        );
        let entries_in_hand = gauge(
            "registry_janitor_entries_in_hand",
            "Stream entries this worker is handling now",
        );
        let fence_refused_writes = IntCounterVec::new(
            Opts::new(
                "registry_janitor_fence_refused_writes_total",
                "Writes of fenced (declared dead) servers refused by the connection-server protocol, by operation",
            ),
            &["op"],
        )
        .expect(VALID);
        let fenced_servers = gauge(
            "registry_janitor_fenced_servers",
            "Fences standing now (servers declared dead within fence_ttl_ms), sampled",
        );
        let fenced_servers_writing = gauge(
            "registry_janitor_fenced_servers_writing",
            "Fenced servers that tried to write within heartbeat_grace_ms: a false positive or a zombie",
        );
        let counter = |name: &str, help: &str| IntCounter::new(name, help).expect(VALID);
        let unknown_server_verdicts = counter(
            "registry_janitor_unknown_server_verdicts_total",
            "server.dead verdicts on servers the registry did not know (no liveness key, no users, not in servers): fenced for fence_unknown_ttl_ms, not indexed",
        );
        let reconcile_passes = counter(
            "registry_janitor_reconcile_passes_total",
            "Reconciler passes over the known servers",
        );
        let reconcile_dead_found = counter(
            "registry_janitor_reconcile_dead_servers_total",
            "server.dead events published by the reconciler",
        );
        let drift_entries_removed = counter(
            "registry_janitor_drift_entries_removed_total",
            "Forward entries of dead owners removed by the drift sweep",
        );
        let drift_members_removed = counter(
            "registry_janitor_drift_members_removed_total",
            "Reverse-index members removed by the drift sweep because the user had moved",
        );
        let expiry_hints = counter(
            "registry_janitor_expiry_hints_total",
            "Keyspace expiry notifications of liveness keys received",
        );
        let evictions_entries = counter(
            "registry_janitor_evictions_entries_total",
            "users.evicted entries written to the evictions stream",
        );
        let evictions_users = counter(
            "registry_janitor_evictions_users_total",
            "Users announced in users.evicted entries of the evictions stream",
        );
        let cluster_users_rechecked = counter(
            "registry_janitor_cluster_users_rechecked_total",
            "Users a master's check-and-delete script left to the per-slot scripts (cluster, layout keys)",
        );
        for c in [
            Box::new(evictions_entries.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(evictions_users.clone()),
            Box::new(cluster_users_rechecked.clone()),
            Box::new(reconcile_passes.clone()),
            Box::new(reconcile_dead_found.clone()),
            Box::new(drift_entries_removed.clone()),
            Box::new(drift_members_removed.clone()),
            Box::new(expiry_hints.clone()),
            Box::new(stream_lag.clone()),
            Box::new(stream_pending.clone()),
            Box::new(dead_letters.clone()),
            Box::new(entries_in_hand.clone()),
            Box::new(events.clone()),
            Box::new(entries_deleted.clone()),
            Box::new(entries_kept.clone()),
            Box::new(entries_claimed.clone()),
            Box::new(entries_vanished.clone()),
            Box::new(cleanup_seconds.clone()),
            Box::new(stale_window_seconds.clone()),
            Box::new(replica_wait_seconds.clone()),
            Box::new(redis_errors.clone()),
            Box::new(fence_refused_writes.clone()),
            Box::new(fenced_servers.clone()),
            Box::new(fenced_servers_writing.clone()),
            Box::new(unknown_server_verdicts.clone()),
        ] {
            registry.register(c).expect(UNIQUE);
        }
        let redis_up = gauge(
            "registry_janitor_redis_up",
            "1 while Redis answers PING (checked every 5 s), 0 while it does not",
        );
        registry.register(Box::new(redis_up.clone())).expect(UNIQUE);
        let reconcile_reachable_seconds = Gauge::new(
            "registry_janitor_reconcile_redis_reachable_seconds",
            "How long Redis has been reachable without a break, as the reconciler knows it; verdicts on silent servers wait while it is under heartbeat_grace_ms",
        )
        .expect(VALID);
        let reconcile_outages = IntCounterVec::new(
            Opts::new(
                "registry_janitor_reconcile_outages_total",
                "Redis outages the reconciler detected, by cause; each holds verdicts on silent servers for a grace",
            ),
            &["cause"],
        )
        .expect(VALID);
        let reconcile_verdicts_waiting = gauge(
            "registry_janitor_reconcile_verdicts_waiting",
            "Silent servers whose verdict the last reconcile pass held: Redis not yet reachable for a full grace",
        );
        for c in [
            Box::new(reconcile_reachable_seconds.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(reconcile_outages.clone()),
            Box::new(reconcile_verdicts_waiting.clone()),
        ] {
            registry.register(c).expect(UNIQUE);
        }
        for cause in outage_cause::ALL {
            reconcile_outages.with_label_values(&[cause]);
        }
        let steps = crate::cleanup::limiter::LimiterMetrics {
            window: gauge(
                "registry_janitor_step_window",
                "Cleanup steps this worker may have in flight in Redis now (the limiter's window)",
            ),
            in_flight: gauge(
                "registry_janitor_steps_in_flight",
                "Cleanup steps of this worker sent to Redis and not yet answered (limited steps)",
            ),
            queue_delay: Histogram::with_opts(
                HistogramOpts::new(
                    "registry_janitor_step_queue_delay_seconds",
                    "Time a cleanup step waited in Redis behind other commands: round trip minus its own execution",
                )
                .buckets(vec![
                    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
                ]),
            )
            .expect(VALID),
            cuts: counter(
                "registry_janitor_step_window_cuts_total",
                "Times the step window was halved because the queue delay exceeded latency_target_ms",
            ),
        };
        for c in [
            Box::new(steps.window.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(steps.in_flight.clone()),
            Box::new(steps.queue_delay.clone()),
            Box::new(steps.cuts.clone()),
        ] {
            registry.register(c).expect(UNIQUE);
        }
        let receiver_requests = IntCounterVec::new(
            Opts::new(
                "registry_janitor_receiver_requests_total",
                "Alert receiver: webhook requests answered, by HTTP status code",
            ),
            &["code"],
        )
        .expect(VALID);
        let receiver_alerts = IntCounterVec::new(
            Opts::new(
                "registry_janitor_receiver_alerts_total",
                "Alert receiver: alerts received, by outcome (published, duplicate, resolved, refused)",
            ),
            &["outcome"],
        )
        .expect(VALID);
        let receiver_unauthorized = counter(
            "registry_janitor_receiver_unauthorized_total",
            "Alert receiver: requests refused for a missing or wrong bearer token",
        );
        let receiver_in_flight = gauge(
            "registry_janitor_receiver_requests_in_flight",
            "Alert receiver: webhook requests being answered now",
        );
        for c in [
            Box::new(receiver_requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(receiver_alerts.clone()),
            Box::new(receiver_unauthorized.clone()),
            Box::new(receiver_in_flight.clone()),
        ] {
            registry.register(c).expect(UNIQUE);
        }
        for o in [
            alert_outcome::PUBLISHED,
            alert_outcome::DUPLICATE,
            alert_outcome::RESOLVED,
            alert_outcome::REFUSED,
        ] {
            receiver_alerts.with_label_values(&[o]);
        }
        for o in [
            outcome::CLEANED,
            outcome::IGNORED,
            outcome::DEAD_LETTERED,
            outcome::FAILED,
            outcome::ABANDONED,
        ] {
            events.with_label_values(&[o]);
        }
        for op in crate::fence::OPERATIONS {
            fence_refused_writes.with_label_values(&[op]);
        }
        let guard_held = gauge(
            "registry_janitor_guard_held",
            "Verdicts (server.dead) the guard holds now: doubtful, not fenced, not cleaned, not acknowledged (sampled)",
        );
        let guard_verdicts = IntCounterVec::new(
            Opts::new(
                "registry_janitor_guard_verdicts_total",
                "The guard's decisions on doubtful verdicts and the ends of holds, by decision",
            ),
            &["decision"],
        )
        .expect(VALID);
        for d in guard_decision::ALL {
            guard_verdicts.with_label_values(&[d]);
        }
        registry
            .register(Box::new(guard_held.clone()))
            .expect(UNIQUE);
        registry
            .register(Box::new(guard_verdicts.clone()))
            .expect(UNIQUE);
        let format_in_use = gauge(
            "registry_janitor_format_in_use",
            "The data format in use, as this worker last read it (0 before the first read)",
        );
        let format_behind = gauge(
            "registry_janitor_format_behind",
            "1 while the data format in use is newer than this worker's build: it takes no work and waits to be replaced",
        );
        for c in [
            Box::new(format_in_use.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(format_behind.clone()),
        ] {
            registry.register(c).expect(UNIQUE);
        }
        let stream_group = ["stream", "group"];
        let stream_unacked_trimmed = IntCounterVec::new(
            Opts::new(
                "registry_janitor_stream_unacked_trimmed_total",
                "Stream entries trimmed past stream_max_age_ms while a consumer group had not acknowledged them (pending or never delivered), by stream and group",
            ),
            &stream_group,
        )
        .expect(VALID);
        let dead_letters_expired = IntCounter::new(
            "registry_janitor_dead_letters_expired_total",
            "Dead letters trimmed past stream_max_age_ms, never replayed nor purged",
        )
        .expect(VALID);
        let stream_group_lag = IntGaugeVec::new(
            Opts::new(
                "registry_janitor_stream_group_lag",
                "Entries of the stream not yet delivered to the group (Redis's lag; absent while Redis cannot tell), sampled by the stream upkeep",
            ),
            &stream_group,
        )
        .expect(VALID);
        let stream_group_pending = IntGaugeVec::new(
            Opts::new(
                "registry_janitor_stream_group_pending",
                "Entries delivered to the group and not acknowledged, sampled by the stream upkeep",
            ),
            &stream_group,
        )
        .expect(VALID);
        let stream_group_oldest_unacked_age = GaugeVec::new(
            Opts::new(
                "registry_janitor_stream_group_oldest_unacked_age_seconds",
                "Age of the group's oldest entry still in the stream that it has not acknowledged (pending or not delivered; 0: none), sampled by the stream upkeep",
            ),
            &stream_group,
        )
        .expect(VALID);
        let stream_group_idle = GaugeVec::new(
            Opts::new(
                "registry_janitor_stream_group_idle_seconds",
                "Idle time of the group's most recently active consumer (absent: the group has no consumer), sampled by the stream upkeep",
            ),
            &stream_group,
        )
        .expect(VALID);
        let stream_max_age = Gauge::new(
            "registry_janitor_stream_max_age_seconds",
            "The stream_max_age_ms setting in seconds: the hard bound of the streams (0: none)",
        )
        .expect(VALID);
        for c in [
            Box::new(stream_unacked_trimmed.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(dead_letters_expired.clone()),
            Box::new(stream_group_lag.clone()),
            Box::new(stream_group_pending.clone()),
            Box::new(stream_group_oldest_unacked_age.clone()),
            Box::new(stream_group_idle.clone()),
            Box::new(stream_max_age.clone()),
        ] {
            registry.register(c).expect(UNIQUE);
        }
        Metrics {
            registry,
            events,
            entries_deleted,
            entries_kept,
            entries_claimed,
            entries_vanished,
            cleanup_seconds,
            stale_window_seconds,
            replica_wait_seconds,
            redis_errors,
            reconcile_passes,
            reconcile_dead_found,
            drift_entries_removed,
            drift_members_removed,
            expiry_hints,
            stream_lag,
            stream_pending,
            dead_letters,
            entries_in_hand,
            fence_refused_writes,
            fenced_servers,
            fenced_servers_writing,
            unknown_server_verdicts,
            evictions_entries,
            evictions_users,
            cluster_users_rechecked,
            redis_up,
            reconcile_reachable_seconds,
            reconcile_outages,
            reconcile_verdicts_waiting,
            steps,
            guard_held,
            guard_verdicts,
            format_in_use,
            format_behind,
            receiver_requests,
            receiver_alerts,
            receiver_unauthorized,
            receiver_in_flight,
            stream_unacked_trimmed,
            dead_letters_expired,
            stream_group_lag,
            stream_group_pending,
            stream_group_oldest_unacked_age,
            stream_group_idle,
            stream_max_age,
            fence_refusals_seen: Default::default(),
        }
    }

    /// Counts `entries` written to the evictions stream, announcing `users` users.
    pub fn observe_evictions(&self, entries: u64, users: u64) {
        if entries > 0 {
            self.evictions_entries.inc_by(entries);
            self.evictions_users.inc_by(users);
        }
    }

    /// Updates the fence metrics from the fences standing now: the refusals noted on each
    /// fence since this process last looked are added to the counter (a fence first seen
    /// adds all of its own; with several reconcilers, take the max over them, not the sum).
    pub fn observe_fences(&self, fences: &[crate::fence::Fence], writing_window_ms: u64) {
        let now = crate::now_ms();
        let mut seen = crate::lock::lock(&self.fence_refusals_seen);
        let mut standing = std::collections::HashMap::with_capacity(fences.len());
        for fence in fences {
            let before = seen.get(&fence.server_id).copied().unwrap_or_default();
            let mut after = [0; 3];
            for (i, op) in crate::fence::OPERATIONS.iter().enumerate() {
                after[i] = fence.refused_of(op);
                let new = after[i].saturating_sub(before[i]);
                self.fence_refused_writes
                    .with_label_values(&[op])
                    .inc_by(new);
            }
            standing.insert(fence.server_id.clone(), after);
        }
        *seen = standing;
        self.fenced_servers.set(fences.len() as i64);
        let writing = fences
            .iter()
            .filter(|f| f.writing(now, writing_window_ms))
            .count();
        self.fenced_servers_writing.set(writing as i64);
    }

    /// The text exposition format, as served on /metrics.
    pub fn render(&self) -> String {
        TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
