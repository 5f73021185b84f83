//! Where the sentinels are and how to reach them and the primary they name, from the
//! settings.

use std::sync::Arc;

use redis::{
    sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType},
    ConnectionAddr, RedisResult, TlsMode,
};

use crate::{
    config::Settings,
    error::{Error, Result},
};

/// What a connection through the sentinels needs: the sentinels, the master's name, the
/// sentinels' credentials, and the primary's credentials, database and TLS (those of
/// `redis_url`). Cheap to clone.
#[derive(Clone)]
pub struct SentinelTarget(pub(super) Arc<TargetInner>);

pub(super) struct TargetInner {
    pub(super) sentinels: Vec<ConnectionAddr>,
    pub(super) master: String,
    pub(super) sentinel_username: Option<String>,
    pub(super) sentinel_password: Option<String>,
    /// `redis_url` with the password override: its host and port are replaced by the
    /// primary's.
    pub(super) primary: redis::ConnectionInfo,
    /// The settings' TLS files, for the primary (and for `rediss://` sentinels).
    pub(super) certs: Option<redis::TlsCertificates>,
}

impl SentinelTarget {
    /// From validated settings; `primary` is `redis_url` with its password override.
    pub(in crate::conn) fn new(
        settings: &Settings,
        primary: redis::ConnectionInfo,
        certs: Option<redis::TlsCertificates>,
    ) -> Result<Self> {
        let bad = |reason: String| Error::Setting {
            name: "redis_sentinels".into(),
            reason,
        };
        let mut sentinels = Vec::new();
        let (mut url_user, mut url_password) = (None, None);
        for url in &settings.redis_sentinels {
            let info = redis::IntoConnectionInfo::into_connection_info(url.as_str())
                .map_err(|e| bad(format!("{}: {e}", crate::config::redact_url(url))))?;
            let redis = info.redis_settings();
            url_user = url_user.or(redis.username().map(str::to_owned));
            url_password = url_password.or(redis.password().map(str::to_owned));
            sentinels.push(info.addr().clone());
        }
        let sentinel_username = settings.redis_sentinel_username.clone().or(url_user);
        let sentinel_password = settings
            .redis_sentinel_password
            .as_ref()
            .map(|p| p.expose().to_owned())
            .or(url_password);
        let target = SentinelTarget(Arc::new(TargetInner {
            sentinels,
            master: settings
                .redis_sentinel_master
                .clone()
                .expect("validated: redis_sentinel_master goes with redis_sentinels"),
            sentinel_username,
            sentinel_password,
            primary,
            certs,
        }));
        // Refuses at start what redis-rs would refuse at each lookup (TLS files with a
        // sentinel that is not rediss://, for one).
        target
            .sentinel_client()
            .map_err(|e| bad(format!("the sentinels cannot be used: {e}")))?;
        Ok(target)
    }

    /// The master's name.
    pub fn master(&self) -> &str {
        &self.0.master
    }

    /// A redis-rs client that asks the sentinels for the primary and checks it.
    pub(super) fn sentinel_client(&self) -> RedisResult<SentinelClient> {
        let t = &self.0;
        let mut b = SentinelClientBuilder::new(
            t.sentinels.iter().cloned(),
            &t.master,
            SentinelServerType::Master,
        )?;
        if let Some(user) = &t.sentinel_username {
            b = b.set_client_to_sentinel_username(user);
        }
        if let Some(password) = &t.sentinel_password {
            b = b.set_client_to_sentinel_password(password);
        }
        let tls_sentinels = t
            .sentinels
            .iter()
            .any(|a| matches!(a, ConnectionAddr::TcpTls { .. }));
        if let (true, Some(certs)) = (tls_sentinels, &t.certs) {
            b = b.set_client_to_sentinel_certificates(certs.clone());
        }
        let redis = t.primary.redis_settings();
        b = b
            .set_client_to_redis_db(redis.db())
            .set_client_to_redis_protocol(redis.protocol());
        if let Some(user) = redis.username() {
            b = b.set_client_to_redis_username(user);
        }
        if let Some(password) = redis.password() {
            b = b.set_client_to_redis_password(password);
        }
        if let ConnectionAddr::TcpTls { insecure, .. } = t.primary.addr() {
            b = b.set_client_to_redis_tls_mode(if *insecure {
                TlsMode::Insecure
            } else {
                TlsMode::Secure
            });
            if let Some(certs) = &t.certs {
                b = b.set_client_to_redis_certificates(certs.clone());
            }
        }
        b.build()
    }

    /// The client for the primary at `host:port`: `redis_url`'s credentials, database
    /// and TLS, as on a single node (see [`super::client_for`]).
    pub(super) fn primary_client(&self, host: String, port: u16) -> Result<redis::Client> {
        let t = &self.0;
        let addr = match t.primary.addr() {
            ConnectionAddr::TcpTls { insecure, .. } => ConnectionAddr::TcpTls {
                host,
                port,
                insecure: *insecure,
                tls_params: None,
            },
            _ => ConnectionAddr::Tcp(host, port),
        };
        super::super::client_with(t.primary.clone().set_addr(addr), t.certs.clone())
    }
}
