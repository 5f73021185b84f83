//! Connections to Redis.
//!
//! Two kinds, because a blocking command on a multiplexed connection stalls every other
//! command on it:
//! - [`shared`]: one auto-reconnecting multiplexed connection for all short commands
//!   (scripts, XACK, XADD...), cloned freely between tasks;
//! - [`blocking`]: a connection of its own for XREADGROUP BLOCK, whose response timeout
//!   is longer than the BLOCK time (redis-rs times out responses after 500 ms by default).
//!
//! Both are created lazily: a worker starts while Redis is down and its retry loops
//! connect when Redis comes back.

use std::time::Duration;

use redis::{
    aio::{ConnectionManager, ConnectionManagerConfig},
    IntoConnectionInfo,
};

use crate::{
    config::Settings,
    error::{Error, Result},
};

/// Longest a short command may take before it counts as failed (and is retried).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A client for `url` alone (no password override, no certificate files).
pub fn client(url: &str) -> Result<redis::Client> {
    install_crypto_provider();
    Ok(redis::Client::open(url)?)
}

/// The client the settings describe: `redis_url`, the password from `redis_password_file`
/// or `redis_password` if set, and the TLS files for a `rediss://` URL.
pub fn client_for(settings: &Settings) -> Result<redis::Client> {
    install_crypto_provider();
    let mut info = settings.redis_url.as_str().into_connection_info()?;
    if let Some(password) = settings.redis_password()? {
        let redis = info
            .redis_settings()
            .clone()
            .set_password(password.expose());
        info = info.set_redis_settings(redis);
    }
    let read = |name: &'static str, path: &std::path::Path| {
        std::fs::read(path).map_err(|e| Error::Setting {
            name: name.into(),
            reason: format!("cannot read {}: {e}", path.display()),
        })
    };
    let root_cert = settings
        .tls_ca_file
        .as_deref()
        .map(|p| read("tls_ca_file", p))
        .transpose()?;
    let client_tls = match (&settings.tls_cert_file, &settings.tls_key_file) {
        (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
            client_cert: read("tls_cert_file", cert)?,
            client_key: read("tls_key_file", key)?,
        }),
        _ => None,
    };
    if root_cert.is_none() && client_tls.is_none() {
        return Ok(redis::Client::open(info)?);
    }
    redis::Client::build_with_tls(
        info,
        redis::TlsCertificates {
            client_tls,
            root_cert,
        },
    )
    .map_err(|e| Error::Setting {
        name: "tls_ca_file".into(),
        reason: format!("the TLS certificates could not be used: {e}"),
    })
}

/// rustls needs a process-wide crypto provider before the first `rediss://` connection.
fn install_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

fn config(response_timeout: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_response_timeout(Some(response_timeout))
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_min_delay(Duration::from_millis(50))
        .set_max_delay(Duration::from_secs(2))
        .set_number_of_retries(2)
}

/// The shared connection for short commands.
pub fn shared(client: &redis::Client) -> Result<ConnectionManager> {
    Ok(ConnectionManager::new_lazy_with_config(
        client.clone(),
        config(COMMAND_TIMEOUT),
    )?)
}

/// A dedicated connection for commands that block up to `block`.
pub fn blocking(client: &redis::Client, block: Duration) -> Result<ConnectionManager> {
    Ok(ConnectionManager::new_lazy_with_config(
        client.clone(),
        config(block + COMMAND_TIMEOUT),
    )?)
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
