//! A cluster connection that is built again when it stops answering.
//!
//! redis-rs's cluster connection is one background task fed by a channel. After a live
//! reshard or a failover on a loaded machine, it was seen to answer `timed out` to every
//! command for minutes (why, inside redis-rs, is not established). A process that kept
//! that connection would wait as long.
//!
//! [`ClusterConn`] holds the current redis-rs connection and watches its results. When
//! no command has had an answer (a reply or a server error) for [`REBUILD_AFTER`] while
//! commands kept failing on the transport (a timeout, a dropped or refused connection, no
//! connection for a slot), it builds a new connection from the same client and settings,
//! reading the slot map afresh, and the commands that follow use it. Requests already on
//! the old connection finish or time out there; it goes when the last clone of it does.
//! When the cluster itself is down, building fails and is tried again after another
//! [`REBUILD_AFTER`]: nothing is lost by trying.
//!
//! A timed-out command's outcome is unknown (it may still run, late, on the old
//! connection): the callers treat a timeout so already, as every step they retry is
//! idempotent or checked.

use std::{
    sync::Mutex,
    time::{Duration, Instant},
};

use redis::{
    aio::ConnectionLike,
    cluster::{ClusterClient, ClusterConfig},
    cluster_async::ClusterConnection,
    RedisFuture, RedisResult,
};

use crate::lock::lock as locked;

/// How long commands may fail on the transport, with no answer at all, before the
/// connection is built again. Three command timeouts: a failover's own pause (a few
/// seconds) never triggers it.
pub const REBUILD_AFTER: Duration = Duration::from_secs(15);

/// A redis-rs cluster connection, built again when it stops answering (module docs).
pub struct ClusterConn {
    client: ClusterClient,
    config: ClusterConfig,
    rebuild_after: Duration,
    state: Mutex<State>,
    /// Held while a new connection is being built, so that only one is.
    building: tokio::sync::Mutex<()>,
}

struct State {
    conn: ClusterConnection,
    /// How many connections were built before this one.
    generation: u64,
    /// Since when commands have failed on the transport with no answer in between.
    failing_since: Option<Instant>,
}

/// What a command's result says of the connection.
enum Outcome {
    /// A reply, or a server's error reply: the connection works.
    Answered,
    /// No answer: a timeout, a dropped or refused connection, no connection for a slot.
    NoAnswer,
}

fn outcome<T>(result: &RedisResult<T>) -> Outcome {
    match result {
        Ok(_) => Outcome::Answered,
        Err(e)
            if e.is_timeout()
                || e.is_io_error()
                || e.is_connection_dropped()
                || e.is_connection_refusal()
                || e.kind() == redis::ErrorKind::ClusterConnectionNotFound =>
        {
            Outcome::NoAnswer
        }
        Err(_) => Outcome::Answered,
    }
}

impl ClusterConn {
    /// Connects to the cluster `client` names, with `config`.
    pub async fn connect(client: ClusterClient, config: ClusterConfig) -> RedisResult<Self> {
        let conn = client
            .get_async_connection_with_config(config.clone())
            .await?;
        Ok(ClusterConn {
            client,
            config,
            rebuild_after: REBUILD_AFTER,
            state: Mutex::new(State {
                conn,
                generation: 0,
                failing_since: None,
            }),
            building: tokio::sync::Mutex::new(()),
        })
    }

    /// The same, built again after `stretch` without an answer instead of
    /// [`REBUILD_AFTER`].
    pub fn rebuild_after(mut self, stretch: Duration) -> Self {
        self.rebuild_after = stretch;
        self
    }

    /// The connection commands use now, and its generation.
    pub fn current(&self) -> (ClusterConnection, u64) {
        let state = locked(&self.state);
        (state.conn.clone(), state.generation)
    }

    /// How many times the connection was built again since [`ClusterConn::connect`].
    pub fn rebuilds(&self) -> u64 {
        locked(&self.state).generation
    }

    /// Notes what a command sent on connection `generation` got, and builds the
    /// connection again when it has stopped answering (module docs). Commands sent
    /// through [`RedisConn`](super::RedisConn) are observed already.
    pub async fn observe<T>(&self, generation: u64, result: &RedisResult<T>) {
        let stalled_for = {
            let mut state = locked(&self.state);
            if state.generation != generation {
                // About a connection already replaced: says nothing of the current one.
                return;
            }
            match outcome(result) {
                Outcome::Answered => {
                    state.failing_since = None;
                    return;
                }
                Outcome::NoAnswer => state
                    .failing_since
                    .get_or_insert_with(Instant::now)
                    .elapsed(),
            }
        };
        if stalled_for >= self.rebuild_after {
            let why = format!(
                "the cluster connection has had no answer for {}s",
                stalled_for.as_secs()
            );
            self.rebuild(generation, &why).await;
        }
    }

    /// Builds the connection again now, with a fresh slot map, for `why` (unless another
    /// task is building it already).
    pub async fn rebuild_now(&self, why: &str) {
        let generation = self.current().1;
        self.rebuild(generation, why).await;
    }

    async fn rebuild(&self, generation: u64, why: &str) {
        let Ok(_building) = self.building.try_lock() else {
            return; // another task is building it
        };
        if locked(&self.state).generation != generation {
            return; // built while this task waited
        }
        tracing::warn!("{why}: building it again");
        match self
            .client
            .get_async_connection_with_config(self.config.clone())
            .await
        {
            Ok(conn) => {
                let mut state = locked(&self.state);
                state.conn = conn;
                state.generation += 1;
                state.failing_since = None;
                tracing::info!(
                    generation = state.generation,
                    "the cluster connection was built again"
                );
            }
            Err(e) => {
                // The cluster does not answer a new connection either: tried again after
                // another stretch without an answer.
                let mut state = locked(&self.state);
                if state.generation == generation {
                    state.failing_since = Some(Instant::now());
                }
                tracing::warn!(
                    error = %e,
                    "the cluster does not answer a new connection either; trying again later"
                );
            }
        }
    }

    /// Sends `cmd` on the current connection, then [`ClusterConn::observe`]s the result.
    pub fn req_packed_command<'a>(&'a self, cmd: &'a redis::Cmd) -> RedisFuture<'a, redis::Value> {
        Box::pin(async move {
            let (mut conn, generation) = self.current();
            let result = conn.req_packed_command(cmd).await;
            self.observe(generation, &result).await;
            result
        })
    }

    /// Sends `pipe` on the current connection, then [`ClusterConn::observe`]s the result.
    pub fn req_packed_commands<'a>(
        &'a self,
        pipe: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<redis::Value>> {
        Box::pin(async move {
            let (mut conn, generation) = self.current();
            let result = conn.req_packed_commands(pipe, offset, count).await;
            self.observe(generation, &result).await;
            result
        })
    }

    pub fn get_db(&self) -> i64 {
        self.current().0.get_db()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io(kind: std::io::ErrorKind) -> RedisResult<()> {
        Err(std::io::Error::from(kind).into())
    }

    #[test]
    fn a_server_error_is_an_answer_and_a_timeout_is_not() {
        let answered = |r: RedisResult<()>| matches!(outcome(&r), Outcome::Answered);
        assert!(answered(Ok(())));
        assert!(answered(Err(redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::BusyLoading),
            "LOADING"
        )))));
        assert!(answered(Err(redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::Moved),
            "MOVED"
        )))));
        assert!(!answered(io(std::io::ErrorKind::TimedOut)));
        assert!(!answered(io(std::io::ErrorKind::ConnectionReset)));
        assert!(!answered(io(std::io::ErrorKind::ConnectionRefused)));
        assert!(!answered(Err(redis::RedisError::from((
            redis::ErrorKind::ClusterConnectionNotFound,
            "no connection"
        )))));
    }
}
