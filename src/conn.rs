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

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use crate::error::Result;

/// Longest a short command may take before it counts as failed (and is retried).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A client for `url`; the URL was validated with the settings.
pub fn client(url: &str) -> Result<redis::Client> {
    Ok(redis::Client::open(url)?)
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
