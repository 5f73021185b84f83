//! Settings: defaults, then file, then `JANITOR_*` environment, then flags; then checks.
//!
//! The built-in defaults and their documentation are one file, `config.default.toml`,
//! compiled in. [`Settings::load`] layers the rest over it with figment and
//! [`Settings::validate`] names the first setting the program cannot run with.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
};

use figment::{
    providers::{Env, Format, Serialized, Toml},
    Figment,
};
use serde::{Deserialize, Serialize};

mod validate;

use crate::error::{Error, Result};

/// The documented defaults, compiled into the binary.
pub const DEFAULT_TOML: &str = include_str!("../config.default.toml");
/// Prefix of the environment variables that set settings.
pub const ENV_PREFIX: &str = "JANITOR_";

/// How the forward registry is stored (see `keys`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// One Hash `registry`: field = user id, value = server id.
    Hash,
    /// One String `user:<user>` per user.
    Keys,
    /// One Hash `user:{<user>}:conns` per user: field = connection id, value = server id
    /// (a user with several connections; see docs/connections.md).
    Conns,
}

impl Layout {
    /// The setting's value, which the Lua scripts also take as their layout argument.
    pub fn as_str(self) -> &'static str {
        match self {
            Layout::Hash => "hash",
            Layout::Keys => "keys",
            Layout::Conns => "conns",
        }
    }
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// How the alert receiver authenticates Alertmanager (`alert_receiver_auth`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReceiverAuth {
    /// A bearer token, read from `alert_receiver_token_file`, is required.
    Token,
    /// No authentication (a trusted network only).
    Off,
}

/// A secret setting: never printed (its `Debug` shows `***`).
#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// Every setting, after layering. Field docs are in `config.default.toml`.
#[derive(Debug, Clone, Deserialize)]
pub struct Settings {
    /// Where the registry, the stream and the group live.
    pub redis_url: String,
    /// Talk to a Redis Cluster: `redis_url` is a seed node.
    #[serde(default)]
    pub redis_cluster: bool,
    /// More seed nodes of the cluster (URLs), tried when `redis_url` is down.
    #[serde(default)]
    pub redis_cluster_seeds: Vec<String>,
    /// On a cluster, does the end of a walk wait until the replicas hold its deletes?
    pub cluster_replica_wait: bool,
    /// Redis Sentinel: the sentinels' URLs. With them, the primary is found through the
    /// sentinels (and followed across failovers); `redis_url` gives credentials, database
    /// and TLS, its host and port are not used.
    #[serde(default)]
    pub redis_sentinels: Vec<String>,
    /// The name of the primary the sentinels monitor (`sentinel monitor <name> ...`).
    #[serde(default)]
    pub redis_sentinel_master: Option<String>,
    /// User for the sentinels themselves (their own ACL), if they require one.
    #[serde(default)]
    pub redis_sentinel_username: Option<String>,
    /// Password for the sentinels themselves (`JANITOR_REDIS_SENTINEL_PASSWORD`).
    #[serde(default)]
    pub redis_sentinel_password: Option<Secret>,
    /// Password overriding the URL's (`JANITOR_REDIS_PASSWORD`).
    #[serde(default)]
    pub redis_password: Option<Secret>,
    /// File holding the password (a mounted Kubernetes Secret); beats the other two.
    #[serde(default)]
    pub redis_password_file: Option<PathBuf>,
    /// CA certificate (PEM) to verify the server of a `rediss://` URL; default: system roots.
    #[serde(default)]
    pub tls_ca_file: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS; goes with `tls_key_file`.
    #[serde(default)]
    pub tls_cert_file: Option<PathBuf>,
    /// Client private key (PEM) for mutual TLS.
    #[serde(default)]
    pub tls_key_file: Option<PathBuf>,
    /// Prefix of every key, so deployments and tests can share one Redis.
    pub key_prefix: String,
    /// Forward registry layout.
    pub layout: Layout,
    /// Users per Lua step: bounds the time Redis spends in one call.
    pub chunk_size: usize,
    /// Events one process cleans at once.
    pub concurrency: usize,
    /// Idle time after which a pending entry is taken over.
    pub claim_min_idle_ms: u64,
    /// Deliveries before an entry is dead-lettered.
    pub max_deliveries: u64,
    /// Name in the consumer group; `None` means host name plus a random suffix.
    pub consumer_name: Option<String>,
    /// Listener for metrics and health, or `off`.
    pub metrics_addr: String,
    /// Age of the last heartbeat after which a server without liveness key is dead.
    pub heartbeat_grace_ms: u64,
    /// Time between reconciliation passes.
    pub reconcile_interval_ms: u64,
    /// Lifetime of a fence (the verdict against a dead server's incarnation).
    pub fence_ttl_ms: u64,
    /// Lifetime of the fence of a server the registry does not know at its verdict.
    pub fence_unknown_ttl_ms: u64,
    /// Write the evictions stream?
    pub evictions: bool,
    /// The evictions stream's name, under `key_prefix`.
    pub evictions_stream: String,
    /// May the reconciler CONFIG SET notify-keyspace-events itself?
    pub keyspace_events_auto: bool,
    /// Drift sweep entries per step.
    pub sweep_count: usize,
    /// Pause between two drift sweep steps.
    pub sweep_pause_ms: u64,
    /// XREADGROUP BLOCK time; also the longest a shutdown waits for a read.
    pub block_ms: u64,
    /// Chunks of one cleanup in flight at once.
    pub chunks_in_flight: usize,
    /// Queue delay in Redis above which a worker sends fewer steps at once (0: off).
    pub latency_target_ms: u64,
    /// Which cleanup's step goes first when the window is full.
    pub step_order: crate::cleanup::limiter::StepOrder,
    /// How long in-flight cleanups may continue after SIGTERM.
    pub drain_timeout_ms: u64,
    /// Minimum age of acknowledged entries before they are trimmed.
    pub retention_ms: u64,
    /// Age past which stream entries go even if a group has not read or acknowledged them
    /// (never those the workers' own group still needs); 0: no such bound.
    pub stream_max_age_ms: u64,
    /// Idle time after which a consumer with nothing pending is removed.
    pub consumer_expiry_ms: u64,
    /// Period of the stream upkeep (trimming, consumer expiry).
    pub maintenance_interval_ms: u64,
    /// Largest payload accepted.
    pub max_payload_bytes: usize,
    /// Hold doubtful verdicts beyond the limits below instead of executing them.
    pub guard: bool,
    /// Servers whose last heartbeat is within this window make the recently live fleet
    /// that a mass silence is measured against; also the window of `guard_disputed_limit`.
    pub guard_window_ms: u64,
    /// Share of the recently live fleet silent at once above which a verdict for a silent
    /// server is one of a mass silence (a zone outage stays below it).
    pub guard_silence_fraction: f64,
    /// Fewest silent servers that make a mass silence, so that a small fleet losing one
    /// or two servers is never held.
    pub guard_silence_min: u64,
    /// Disputed verdicts (their server still heartbeats) executed per window; beyond it
    /// they are held.
    pub guard_disputed_limit: u64,
    /// A held verdict proceeds by itself once its server has been silent this long.
    pub guard_hold_grace_ms: u64,
    /// Log format on stderr.
    pub log_format: LogFormat,
    /// The alert receiver's listener (`alert-receiver`).
    pub alert_receiver_addr: String,
    /// The alert label that names the dead server.
    pub alert_receiver_label: String,
    /// How long the receiver remembers a published alert (fingerprint and start).
    pub alert_receiver_dedup_ttl_ms: u64,
    /// `token` (bearer token required) or `off`.
    pub alert_receiver_auth: ReceiverAuth,
    /// File holding the bearer token Alertmanager sends.
    #[serde(default)]
    pub alert_receiver_token_file: Option<PathBuf>,
    /// Largest webhook body accepted.
    pub alert_receiver_max_body_bytes: usize,
    /// Certificate chain (PEM) of the receiver's TLS listener; goes with the key.
    #[serde(default)]
    pub alert_receiver_tls_cert_file: Option<PathBuf>,
    /// Private key (PEM) of the receiver's TLS listener.
    #[serde(default)]
    pub alert_receiver_tls_key_file: Option<PathBuf>,
}

/// Settings given on the command line; `None` leaves the lower layers in force.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Overrides {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redis_url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_prefix: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layout: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chunk_size: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consumer_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_addr: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_format: Option<String>,
}

impl Settings {
    /// Layers defaults, `file` (or `JANITOR_CONFIG`), the environment and `overrides`,
    /// then validates.
    pub fn load(file: Option<&Path>, overrides: &Overrides) -> Result<Self> {
        let mut figment = Figment::from(Toml::string(DEFAULT_TOML));
        let env_file = std::env::var_os(format!("{ENV_PREFIX}CONFIG"));
        if let Some(path) = file.map(Path::to_path_buf).or(env_file.map(Into::into)) {
            if !path.is_file() {
                return Err(Error::Setting {
                    name: "config".into(),
                    reason: format!("no such file: {}", path.display()),
                });
            }
            figment = figment.merge(Toml::file(path));
        }
        let settings: Settings = figment
            .merge(Env::prefixed(ENV_PREFIX).ignore(&["config"]))
            .merge(Serialized::defaults(overrides))
            .extract()
            .map_err(setting_error)?;
        settings.validate()?;
        Ok(settings)
    }

    /// The guard's window in force: `guard_window_ms`, but never shorter than a grace
    /// period plus a reconcile interval plus a minute, so that the reconciler's verdicts
    /// (published a grace period after a server fell silent, or an interval later) still
    /// count their silent peers.
    pub fn guard_window(&self) -> u64 {
        let floor = self
            .heartbeat_grace_ms
            .saturating_add(self.reconcile_interval_ms)
            .saturating_add(60_000);
        self.guard_window_ms.max(floor)
    }

    /// The hold's grace in force: `guard_hold_grace_ms`, but never shorter than twice
    /// `heartbeat_grace_ms` (a held verdict waits longer than an ordinary one).
    pub fn guard_hold_grace(&self) -> u64 {
        self.guard_hold_grace_ms
            .max(self.heartbeat_grace_ms.saturating_mul(2))
    }

    /// The defaults alone, validated; handy for tests and the demo.
    pub fn defaults() -> Self {
        Figment::from(Toml::string(DEFAULT_TOML))
            .extract()
            .expect("the built-in defaults parse")
    }

    /// True when the primary is found through Redis Sentinel.
    pub fn uses_sentinel(&self) -> bool {
        !self.redis_sentinels.is_empty()
    }

    /// The Redis password: from `redis_password_file`, else `redis_password`, else none
    /// (the URL's own, if any, stays in force).
    pub fn redis_password(&self) -> Result<Option<Secret>> {
        if let Some(path) = &self.redis_password_file {
            let text = std::fs::read_to_string(path).map_err(|e| Error::Setting {
                name: "redis_password_file".into(),
                reason: format!("cannot read {}: {e}", path.display()),
            })?;
            return Ok(Some(Secret(text.trim_end_matches(['\r', '\n']).to_owned())));
        }
        Ok(self.redis_password.clone())
    }

    /// `None` when the metrics listener is `off`.
    pub fn metrics_listen_addr(&self) -> std::result::Result<Option<SocketAddr>, String> {
        if self.metrics_addr.eq_ignore_ascii_case("off") {
            return Ok(None);
        }
        self.metrics_addr
            .parse()
            .map(Some)
            .map_err(|_| format!("expected host:port or `off`, got {:?}", self.metrics_addr))
    }

    /// The configured consumer name, or host name plus a random suffix.
    pub fn consumer_name(&self) -> String {
        self.consumer_name
            .clone()
            .unwrap_or_else(default_consumer_name)
    }
}

/// Turns figment's error into one that names the setting as operators know it
/// (`chunk_size`, not the environment's `CHUNK_SIZE`) and says where the value came from.
fn setting_error(e: figment::Error) -> Error {
    let Some(key) = e.path.last() else {
        return Error::Settings(Box::new(e));
    };
    let name = key.to_ascii_lowercase();
    let origin = e
        .metadata
        .as_ref()
        .map(|m| format!(" (from {})", m.name))
        .unwrap_or_default();
    Error::Setting {
        name: name.into(),
        reason: format!("{}{origin}", e.kind),
    }
}

fn default_consumer_name() -> String {
    let host = gethostname::gethostname().to_string_lossy().into_owned();
    let host: String = host
        .chars()
        .filter(|c| c.is_ascii_graphic())
        .take(100)
        .collect();
    let suffix: u32 = rand::random();
    format!(
        "{}-{suffix:08x}",
        if host.is_empty() { "janitor" } else { &host }
    )
}

/// The URL with any password replaced by `***`, for logs and error messages.
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) if parsed.password().is_some() => {
            let _ = parsed.set_password(Some("***"));
            parsed.to_string()
        }
        Ok(parsed) => parsed.to_string(),
        Err(_) => "<unparsable URL>".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_contract() {
        let s = Settings::defaults();
        s.validate().unwrap();
        assert_eq!(s.redis_url, "redis://127.0.0.1:6379");
        assert_eq!(s.key_prefix, "");
        assert_eq!(s.layout, Layout::Hash);
        assert_eq!(s.chunk_size, 1000);
        assert_eq!(s.concurrency, 4);
        assert_eq!(s.claim_min_idle_ms, 30000);
        assert_eq!(s.max_deliveries, 5);
        assert_eq!(s.metrics_addr, "0.0.0.0:9464");
        assert_eq!(s.heartbeat_grace_ms, 30000);
        assert_eq!(s.reconcile_interval_ms, 30000);
        assert_eq!(s.fence_ttl_ms, 7 * 24 * 3600 * 1000);
        assert_eq!(s.fence_unknown_ttl_ms, 10 * 60 * 1000);
        assert!(s.evictions);
        assert_eq!(s.evictions_stream, crate::keys::DEFAULT_EVICTIONS_STREAM);
        assert!(s.consumer_name.is_none());
        assert_eq!(s.latency_target_ms, 1);
        assert_eq!(s.alert_receiver_addr, "0.0.0.0:9465");
        assert_eq!(s.alert_receiver_label, "server_id");
        assert_eq!(s.alert_receiver_dedup_ttl_ms, 7 * 24 * 3600 * 1000);
        assert_eq!(s.alert_receiver_auth, ReceiverAuth::Token);
        assert_eq!(s.alert_receiver_max_body_bytes, 1024 * 1024);
        assert_eq!(
            s.step_order,
            crate::cleanup::limiter::StepOrder::SmallestFirst
        );
        assert!(s.cluster_replica_wait);
    }

    #[test]
    fn the_replica_wait_is_read_from_the_file_and_a_wrong_value_names_it() {
        let read = |toml: &str| {
            Figment::from(Toml::string(DEFAULT_TOML))
                .merge(Toml::string(toml))
                .extract::<Settings>()
                .map_err(setting_error)
        };
        assert!(
            !read("cluster_replica_wait = false")
                .unwrap()
                .cluster_replica_wait
        );
        assert!(
            read("cluster_replica_wait = true")
                .unwrap()
                .cluster_replica_wait
        );
        let err = read("cluster_replica_wait = \"sometimes\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("cluster_replica_wait"), "{err}");
    }

    #[test]
    fn an_unknown_step_order_names_the_setting() {
        let err = Figment::from(Toml::string(DEFAULT_TOML))
            .merge(Toml::string("step_order = \"largest_first\""))
            .extract::<Settings>()
            .map_err(setting_error)
            .unwrap_err()
            .to_string();
        assert!(err.contains("step_order"), "{err}");
    }

    #[test]
    fn consumer_names_are_unique() {
        let s = Settings::defaults();
        assert_ne!(s.consumer_name(), s.consumer_name());
    }

    #[test]
    fn validate_names_the_setting() {
        let check = |f: fn(&mut Settings), name: &str| {
            let mut s = Settings::defaults();
            f(&mut s);
            let err = s.validate().unwrap_err().to_string();
            assert!(err.contains(&format!("`{name}`")), "{err}");
        };
        check(|s| s.chunk_size = 0, "chunk_size");
        check(|s| s.concurrency = 0, "concurrency");
        check(|s| s.redis_url = "http://x".into(), "redis_url");
        check(|s| s.redis_url = "not a url".into(), "redis_url");
        check(|s| s.metrics_addr = "nowhere".into(), "metrics_addr");
        check(|s| s.max_deliveries = 0, "max_deliveries");
        check(|s| s.latency_target_ms = 1001, "latency_target_ms");
        check(|s| s.fence_ttl_ms = 1000, "fence_ttl_ms");
        check(|s| s.fence_unknown_ttl_ms = 999, "fence_unknown_ttl_ms");
        check(
            |s| s.fence_unknown_ttl_ms = s.fence_ttl_ms + 1,
            "fence_unknown_ttl_ms",
        );
        check(
            |s| s.stream_max_age_ms = s.retention_ms - 1,
            "stream_max_age_ms",
        );
        check(
            |s| {
                s.retention_ms = 1000;
                s.stream_max_age_ms = s.maintenance_interval_ms;
            },
            "stream_max_age_ms",
        );
        check(|s| s.evictions_stream = String::new(), "evictions_stream");
        check(
            |s| s.evictions_stream = "registry:events".into(),
            "evictions_stream",
        );
        check(|s| s.evictions_stream = "user:x".into(), "evictions_stream");
        check(|s| s.fence_ttl_ms = s.heartbeat_grace_ms, "fence_ttl_ms");
        // Past what PEXPIRE takes, the fence would be left with no lifetime.
        check(|s| s.fence_ttl_ms = i64::MAX as u64, "fence_ttl_ms");
        check(
            |s| s.alert_receiver_addr = "nowhere".into(),
            "alert_receiver_addr",
        );
        check(
            |s| s.alert_receiver_label = "server-id".into(),
            "alert_receiver_label",
        );
        check(
            |s| s.alert_receiver_dedup_ttl_ms = 10,
            "alert_receiver_dedup_ttl_ms",
        );
        check(
            |s| s.alert_receiver_max_body_bytes = 10,
            "alert_receiver_max_body_bytes",
        );
        check(
            |s| s.alert_receiver_tls_key_file = Some("/k.pem".into()),
            "alert_receiver_tls_cert_file",
        );
    }

    #[test]
    fn sentinel_settings_go_together() {
        let check = |f: fn(&mut Settings), name: &str| {
            let mut s = Settings::defaults();
            f(&mut s);
            let err = s.validate().unwrap_err().to_string();
            assert!(err.contains(&format!("`{name}`")), "{err}");
        };
        fn sentinels(s: &mut Settings) {
            s.redis_sentinels = vec!["redis://127.0.0.1:26379".into()];
        }
        check(sentinels, "redis_sentinel_master");
        check(
            |s| s.redis_sentinel_master = Some("mymaster".into()),
            "redis_sentinels",
        );
        check(
            |s| s.redis_sentinel_password = Some(Secret("x".into())),
            "redis_sentinels",
        );
        check(
            |s| {
                sentinels(s);
                s.redis_sentinel_master = Some("mymaster".into());
                s.redis_cluster = true;
            },
            "redis_sentinels",
        );
        check(
            |s| {
                sentinels(s);
                s.redis_sentinel_master = Some("mymaster".into());
                s.redis_cluster_seeds = vec!["redis://127.0.0.1:7000".into()];
            },
            "redis_sentinels",
        );
        check(
            |s| {
                s.redis_sentinels = vec!["http://127.0.0.1:26379".into()];
                s.redis_sentinel_master = Some("mymaster".into());
            },
            "redis_sentinels",
        );
        check(
            |s| {
                sentinels(s);
                s.redis_sentinel_master = Some("my master".into());
            },
            "redis_sentinel_master",
        );
        check(
            |s| {
                s.redis_sentinels = vec![
                    "redis://:a@127.0.0.1:26379".into(),
                    "redis://:b@127.0.0.1:26380".into(),
                ];
                s.redis_sentinel_master = Some("mymaster".into());
            },
            "redis_sentinels",
        );
        let mut ok = Settings::defaults();
        sentinels(&mut ok);
        ok.redis_sentinel_master = Some("mymaster".into());
        ok.validate().unwrap();
        assert!(ok.uses_sentinel());
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            super::redact_url("redis://u:s3cret@h:1/0"),
            "redis://u:***@h:1/0"
        );
        assert_eq!(super::redact_url("redis://h:1"), "redis://h:1");
        assert!(!super::redact_url("rediss://:pw@h").contains("pw"));
    }
}
