//! The census of the fleet a mass silence is told by: how many servers heartbeated
//! lately and how many of them are silent, reused for a short while.

use std::time::{Duration, Instant};

use serde::Serialize;
use tracing::warn;

use super::{list, Doubt, Guard};
use crate::{
    conn::RedisConn,
    error::{Error, Result},
    event::ServerId,
    keys::Keys,
};

/// How long a census of the fleet is reused, at most: a zone outage brings many verdicts
/// at once, and one census a second answers them all. Never more than a quarter of the
/// grace period (see [`Guard::new`]).
pub(super) const CENSUS_TTL: Duration = Duration::from_secs(1);

/// The servers that heartbeated within the guard's window, and how many of them are
/// silent (no liveness key) now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Census {
    pub recent: u64,
    pub silent: u64,
}

impl Guard {
    /// Counts the servers that heartbeated within the window and, of those, the silent
    /// ones (liveness key gone). Reused for `census_ttl`.
    pub async fn census(&self, conn: &RedisConn) -> Result<Census> {
        if let Some((at, census)) = *crate::lock::lock(&self.census) {
            if at.elapsed() < self.census_ttl {
                return Ok(census);
            }
        }
        // A silence that has lasted longer than the window still counts until its
        // verdicts may proceed anyway (the hold's grace).
        let window = self.window_ms.max(self.hold_grace_ms);
        let census = take_census(conn, &self.keys, window).await?;
        *crate::lock::lock(&self.census) = Some((Instant::now(), census));
        Ok(census)
    }

    /// Whether a verdict of a mass silence is held now. Reused for `census_ttl`. Where
    /// the holds may not be read, the answer is yes (the careful one), said once.
    pub async fn holds_mass_silence(&self, conn: &RedisConn) -> Result<bool> {
        if let Some((at, held)) = *crate::lock::lock(&self.mass_held) {
            if at.elapsed() < self.census_ttl {
                return Ok(held);
            }
        }
        let held = match list(conn, &self.keys).await {
            Ok(holds) => holds.iter().any(|h| h.doubt == Doubt::MassSilence),
            Err(Error::Redis(e)) if !crate::error::redis_error_is_retryable(&e) => {
                if !self
                    .holds_refused
                    .swap(true, std::sync::atomic::Ordering::Relaxed)
                {
                    warn!(error = %e, "the guard's holds may not be read: the drift sweep deletes nothing on silence");
                }
                true
            }
            Err(e) => return Err(e),
        };
        *crate::lock::lock(&self.mass_held) = Some((Instant::now(), held));
        Ok(held)
    }

    /// Whether `census` shows a mass silence.
    pub fn is_mass_silence(&self, census: Census) -> bool {
        census.silent >= self.silence_min
            && census.silent as f64 > self.silence_fraction * census.recent as f64
    }
}

/// See [`Guard::census`]. The window is measured on Redis's clock, as the scores are
/// written (see [`crate::clock`]).
async fn take_census(conn: &RedisConn, keys: &Keys, window_ms: u64) -> Result<Census> {
    let since = crate::clock::now_ms(conn, keys)
        .await?
        .saturating_sub(window_ms);
    let recent: Vec<String> = redis::cmd("ZRANGEBYSCORE")
        .arg(keys.servers())
        .arg(since)
        .arg("+inf")
        .query_async(&mut conn.clone())
        .await?;
    let servers: Vec<ServerId> = recent
        .iter()
        .filter_map(|s| ServerId::parse(s).ok())
        .collect();
    let alive = crate::registry::have_liveness_keys(conn, keys, &servers).await?;
    Ok(Census {
        recent: servers.len() as u64,
        silent: alive.iter().filter(|a| !**a).count() as u64,
    })
}
