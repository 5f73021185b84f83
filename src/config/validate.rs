//! The checks of [`Settings`]: each names the first setting the program cannot run with.

use std::net::SocketAddr;

use super::{redact_url, Settings};
use crate::error::{Error, Result};

impl Settings {
    /// Refuses values the program cannot run with, naming the setting.
    pub fn validate(&self) -> Result<()> {
        fn bad(name: &'static str, reason: impl Into<String>) -> Result<()> {
            Err(Error::Setting {
                name: name.into(),
                reason: reason.into(),
            })
        }
        match redis::parse_redis_url(&self.redis_url) {
            Some(url) if matches!(url.scheme(), "redis" | "rediss" | "unix" | "redis+unix") => {}
            _ => {
                return bad(
                    "redis_url",
                    format!(
                        "not a redis:// or rediss:// URL: {}",
                        redact_url(&self.redis_url)
                    ),
                )
            }
        }
        if redis::Client::open(self.redis_url.as_str()).is_err() {
            return bad("redis_url", "the URL does not name a Redis server");
        }
        if !(1..=100_000).contains(&self.chunk_size) {
            return bad(
                "chunk_size",
                format!("must be 1 to 100000, got {}", self.chunk_size),
            );
        }
        if !(1..=1024).contains(&self.concurrency) {
            return bad(
                "concurrency",
                format!("must be 1 to 1024, got {}", self.concurrency),
            );
        }
        if !(1..=64).contains(&self.chunks_in_flight) {
            return bad(
                "chunks_in_flight",
                format!("must be 1 to 64, got {}", self.chunks_in_flight),
            );
        }
        if self.latency_target_ms > 1000 {
            return bad(
                "latency_target_ms",
                format!("must be 0 (off) to 1000, got {}", self.latency_target_ms),
            );
        }
        if self.max_deliveries == 0 {
            return bad("max_deliveries", "must be at least 1");
        }
        if self.claim_min_idle_ms < 1000 {
            return bad("claim_min_idle_ms", "must be at least 1000");
        }
        if !(100..=60_000).contains(&self.block_ms) {
            return bad(
                "block_ms",
                format!("must be 100 to 60000, got {}", self.block_ms),
            );
        }
        if self.reconcile_interval_ms < 100 {
            return bad("reconcile_interval_ms", "must be at least 100");
        }
        if !(1..=10_000).contains(&self.sweep_count) {
            return bad(
                "sweep_count",
                format!("must be 1 to 10000, got {}", self.sweep_count),
            );
        }
        if self.heartbeat_grace_ms == 0 {
            return bad("heartbeat_grace_ms", "must be at least 1");
        }
        if self.guard_window_ms < 1000 {
            return bad("guard_window_ms", "must be at least 1000");
        }
        if !(self.guard_silence_fraction > 0.0 && self.guard_silence_fraction < 1.0) {
            return bad(
                "guard_silence_fraction",
                format!(
                    "must be above 0 and below 1 (a share of the fleet), got {}",
                    self.guard_silence_fraction
                ),
            );
        }
        if self.guard_silence_min == 0 {
            return bad("guard_silence_min", "must be at least 1");
        }
        if self.guard_hold_grace_ms < 1000 {
            return bad("guard_hold_grace_ms", "must be at least 1000");
        }
        // At most a year: Redis refuses a PEXPIRE past its largest time, and record.lua
        // would fail after its HSETNX, leaving a fence with no lifetime.
        const MAX_FENCE_TTL_MS: u64 = 365 * 24 * 3600 * 1000;
        if self.fence_ttl_ms < 60_000
            || self.fence_ttl_ms <= self.heartbeat_grace_ms
            || self.fence_ttl_ms > MAX_FENCE_TTL_MS
        {
            return bad(
                "fence_ttl_ms",
                format!(
                    "must be at least 60000, longer than heartbeat_grace_ms (a zombie must \
                     not outlive its fence) and at most {MAX_FENCE_TTL_MS} (a year), got {}",
                    self.fence_ttl_ms
                ),
            );
        }
        if self.fence_unknown_ttl_ms < 1000 || self.fence_unknown_ttl_ms > self.fence_ttl_ms {
            return bad(
                "fence_unknown_ttl_ms",
                format!(
                    "must be at least 1000 and at most fence_ttl_ms ({}), got {}",
                    self.fence_ttl_ms, self.fence_unknown_ttl_ms
                ),
            );
        }
        if self.evictions {
            let name = &self.evictions_stream;
            let taken = [
                "registry:events",
                "registry:events:dead",
                "registry",
                "servers",
            ];
            if name.is_empty()
                || name.len() > 200
                || name.bytes().any(|b| !b.is_ascii_graphic())
                || taken.contains(&name.as_str())
                || name.starts_with("user:")
                || name.starts_with("server:")
            {
                return bad(
                    "evictions_stream",
                    format!(
                        "must be 1 to 200 printable ASCII bytes and not a key of the registry's \
                         own (registry, servers, user:*, server:*, the events streams), got {name:?}"
                    ),
                );
            }
        }
        if self.maintenance_interval_ms < 100 {
            return bad("maintenance_interval_ms", "must be at least 100");
        }
        if self.stream_max_age_ms != 0
            && self.stream_max_age_ms < self.retention_ms.max(2 * self.maintenance_interval_ms)
        {
            return bad(
                "stream_max_age_ms",
                "must be 0 (no hard bound) or at least retention_ms and twice maintenance_interval_ms",
            );
        }
        if self.consumer_expiry_ms < 2 * self.claim_min_idle_ms {
            return bad(
                "consumer_expiry_ms",
                "must be at least twice claim_min_idle_ms, so a worker is never expired between two claim rounds",
            );
        }
        if self.max_payload_bytes < 64 {
            return bad("max_payload_bytes", "must be at least 64");
        }
        if let Some(name) = &self.consumer_name {
            if name.is_empty() || name.len() > 200 || name.bytes().any(|b| !b.is_ascii_graphic()) {
                return bad("consumer_name", "must be 1 to 200 printable ASCII bytes");
            }
        }
        if let Err(e) = self.metrics_listen_addr() {
            return bad("metrics_addr", e);
        }
        for seed in &self.redis_cluster_seeds {
            if redis::parse_redis_url(seed).is_none() {
                return bad(
                    "redis_cluster_seeds",
                    format!("not a redis:// URL: {}", redact_url(seed)),
                );
            }
        }
        self.validate_sentinel()?;
        let tls_url = self.redis_url.starts_with("rediss://");
        if let Some(seed) = self
            .redis_cluster_seeds
            .iter()
            .find(|seed| seed.starts_with("rediss://") != tls_url)
        {
            return bad(
                "redis_cluster_seeds",
                format!(
                    "{} does not use the scheme of redis_url: a cluster is TLS (rediss://) on every node or on none",
                    redact_url(seed)
                ),
            );
        }
        for (name, file) in [
            ("tls_ca_file", &self.tls_ca_file),
            ("tls_cert_file", &self.tls_cert_file),
            ("tls_key_file", &self.tls_key_file),
            ("redis_password_file", &self.redis_password_file),
        ] {
            if let Some(path) = file {
                if let Err(e) = std::fs::metadata(path) {
                    return bad(name, format!("cannot read {}: {e}", path.display()));
                }
                if name.starts_with("tls_") && !tls_url {
                    return bad(name, "is set, but redis_url is not a rediss:// URL");
                }
            }
        }
        if self.tls_cert_file.is_some() != self.tls_key_file.is_some() {
            return bad(
                "tls_cert_file",
                "tls_cert_file and tls_key_file go together",
            );
        }
        self.validate_receiver()
    }

    /// The alert receiver's settings that can be checked without reading files (the
    /// token and TLS files are read when `alert-receiver` starts, which names them if
    /// they are missing or empty).
    fn validate_receiver(&self) -> Result<()> {
        fn bad(name: &'static str, reason: impl Into<String>) -> Result<()> {
            Err(Error::Setting {
                name: name.into(),
                reason: reason.into(),
            })
        }
        if self.alert_receiver_addr.parse::<SocketAddr>().is_err() {
            return bad(
                "alert_receiver_addr",
                format!("expected host:port, got {:?}", self.alert_receiver_addr),
            );
        }
        let label = &self.alert_receiver_label;
        let label_ok = label
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !label_ok {
            return bad(
                "alert_receiver_label",
                format!("must be a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*), got {label:?}"),
            );
        }
        const YEAR_MS: u64 = 365 * 24 * 3600 * 1000;
        if !(60_000..=YEAR_MS).contains(&self.alert_receiver_dedup_ttl_ms) {
            return bad(
                "alert_receiver_dedup_ttl_ms",
                format!(
                    "must be 60000 (a minute) to {YEAR_MS} (a year), got {}",
                    self.alert_receiver_dedup_ttl_ms
                ),
            );
        }
        if !(1024..=64 * 1024 * 1024).contains(&self.alert_receiver_max_body_bytes) {
            return bad(
                "alert_receiver_max_body_bytes",
                format!(
                    "must be 1024 to 67108864 (64 MiB), got {}",
                    self.alert_receiver_max_body_bytes
                ),
            );
        }
        if self.alert_receiver_tls_cert_file.is_some() != self.alert_receiver_tls_key_file.is_some()
        {
            return bad(
                "alert_receiver_tls_cert_file",
                "alert_receiver_tls_cert_file and alert_receiver_tls_key_file go together",
            );
        }
        Ok(())
    }

    /// The Sentinel settings: all or none, not with a cluster, valid URLs.
    fn validate_sentinel(&self) -> Result<()> {
        fn bad(name: &'static str, reason: impl Into<String>) -> Result<()> {
            Err(Error::Setting {
                name: name.into(),
                reason: reason.into(),
            })
        }
        if self.redis_sentinels.is_empty() {
            if self.redis_sentinel_master.is_some() {
                return bad(
                    "redis_sentinels",
                    "redis_sentinel_master is set, but no sentinel is listed",
                );
            }
            if self.redis_sentinel_username.is_some() || self.redis_sentinel_password.is_some() {
                return bad(
                    "redis_sentinels",
                    "sentinel credentials are set, but no sentinel is listed",
                );
            }
            return Ok(());
        }
        match self.redis_sentinel_master.as_deref() {
            None => {
                return bad(
                    "redis_sentinel_master",
                    "redis_sentinels is set: name the primary the sentinels monitor",
                )
            }
            Some(name) if name.is_empty() || name.bytes().any(|b| !b.is_ascii_graphic()) => {
                return bad(
                    "redis_sentinel_master",
                    "must be a non-empty name of printable ASCII, without spaces",
                )
            }
            Some(_) => {}
        }
        if self.redis_cluster || !self.redis_cluster_seeds.is_empty() {
            return bad(
                "redis_sentinels",
                "Sentinel and Redis Cluster exclude each other: set redis_sentinels or \
                 redis_cluster (and redis_cluster_seeds), not both",
            );
        }
        if !matches!(
            redis::parse_redis_url(&self.redis_url)
                .map(|u| u.scheme().to_owned())
                .as_deref(),
            Some("redis" | "rediss")
        ) {
            return bad(
                "redis_url",
                "with redis_sentinels, redis_url must be a redis:// or rediss:// URL (its \
                 credentials, database and TLS are used for the primary)",
            );
        }
        let mut credentials = std::collections::BTreeSet::new();
        for url in &self.redis_sentinels {
            credentials.insert(sentinel_credentials(url)?);
        }
        if credentials.len() > 1
            && self.redis_sentinel_username.is_none()
            && self.redis_sentinel_password.is_none()
        {
            return bad(
                "redis_sentinels",
                "the sentinel URLs carry different users or passwords; one set is used for \
                 all sentinels: set redis_sentinel_username / redis_sentinel_password",
            );
        }
        Ok(())
    }
}

/// The user and password of one of `redis_sentinels`, which must be a redis:// or
/// rediss:// URL with a host and no database.
fn sentinel_credentials(url: &str) -> Result<(String, Option<String>)> {
    let bad = |reason: String| Error::Setting {
        name: "redis_sentinels".into(),
        reason,
    };
    let parsed = redis::parse_redis_url(url);
    let Some(parsed) = parsed.filter(|u| matches!(u.scheme(), "redis" | "rediss")) else {
        return Err(bad(format!(
            "not a redis:// or rediss:// URL: {}",
            redact_url(url)
        )));
    };
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(bad(format!("no host in {}", redact_url(url))));
    }
    let db = parsed.path().trim_start_matches('/');
    if !db.is_empty() && db != "0" {
        return Err(bad(format!(
            "a sentinel has no databases (the database is redis_url's): {}",
            redact_url(url)
        )));
    }
    Ok((
        parsed.username().to_owned(),
        parsed.password().map(str::to_owned),
    ))
}
