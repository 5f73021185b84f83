//! The cleanup on a single Redis node: each step is one call of clean_step.lua, which
//! walks the chunk and deletes its entries atomically, and `chunks_in_flight` steps are
//! kept queued so Redis never waits for the worker.

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        LazyLock,
    },
    time::Duration,
};

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio_util::sync::CancellationToken;

use super::{
    limiter::{Permit, StepOrder},
    Cleaner, Report, Step, WalkMode,
};
use crate::{
    conn::RedisConn,
    error::{Error, Result},
    event::ServerId,
    reply::{malformed, Fields},
    retry::retrying_counted,
};

static CLEAN_STEP: LazyLock<redis::Script> =
    LazyLock::new(|| crate::forward::with_prelude(include_str!("clean_step.lua")));

impl Cleaner {
    /// [`Cleaner::clean_event`] on one node: `chunks_in_flight` steps kept queued, each
    /// queued again until a step finds nothing left (see [`NodeWalk::step`]).
    pub(super) async fn clean_on_node(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        event_id: &str,
        entry: Option<&str>,
        stop: &CancellationToken,
        mut on_step: impl FnMut(&Step),
    ) -> Result<Report> {
        let walk = NodeWalk {
            cleaner: self,
            conn,
            server,
            event_id,
            entry,
            oom: AtomicBool::new(false),
            left: AtomicU64::new(self.members_left_for_order(conn, server).await),
        };
        let step = || retrying_counted("cleanup step", stop, self.errors.as_ref(), || walk.step());
        let mut report = Report::default();
        let mut in_flight: FuturesUnordered<_> =
            (0..self.chunks_in_flight).map(|_| step()).collect();
        // Steps queued behind the one that found nothing left may have started a new walk
        // (members registered after it): the cleanup ends only when the last step to
        // complete found nothing left, so no such walk is left half done.
        let mut done = false;
        while let Some(result) = in_flight.next().await {
            let outcome = match result {
                Err(Error::Cancelled) => continue,
                other => other?,
            };
            report.add(&outcome);
            on_step(&outcome);
            done = outcome.done;
            if !done && !stop.is_cancelled() {
                in_flight.push(step());
            }
        }
        if done {
            report.acknowledged = entry.is_some();
            Ok(report)
        } else {
            Err(Error::Cancelled)
        }
    }

    /// Members of `server` left to walk: its reverse set, the set being walked and the
    /// members set aside (SCARD, SCARD, ZCARD).
    async fn members_left(&self, conn: &RedisConn, server: &ServerId) -> Result<u64> {
        let (users, walking, moved): (u64, u64, u64) = redis::pipe()
            .scard(self.keys.server_users(server))
            .scard(self.keys.server_walking(server))
            .zcard(self.keys.server_moved(server))
            .query_async(&mut conn.clone())
            .await?;
        Ok(users + walking + moved)
    }

    /// With a limiter whose `step_order` is smallest_first, the members left (read once,
    /// then counted down by this worker's steps) order the cleanups' steps; 0 otherwise.
    async fn members_left_for_order(&self, conn: &RedisConn, server: &ServerId) -> u64 {
        match &self.limiter {
            Some(limiter) if limiter.order() == StepOrder::SmallestFirst => {
                self.members_left(conn, server).await.unwrap_or(u64::MAX)
            }
            _ => 0,
        }
    }

    /// One call of the step script, walking `chunk_size` members with SSCAN (see
    /// `step_sized`).
    pub async fn step(&self, conn: &RedisConn, server: &ServerId) -> Result<Step> {
        self.step_sized(conn, server, WalkMode::Scan, "", None, self.chunk_size)
            .await
    }

    /// One call of the step script (clean_step.lua) in `mode`, walking `size` members (the
    /// limiter's step size, or `chunk_size`); with `entry`, the step that finds nothing
    /// left acknowledges that entry. The users it deletes are announced on the evictions
    /// stream, with `event_id`.
    async fn step_sized(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        mode: WalkMode,
        event_id: &str,
        entry: Option<&str>,
        size: usize,
    ) -> Result<Step> {
        let layout = self.layout.as_str();
        let mut call = CLEAN_STEP.prepare_invoke();
        call.key(self.keys.server_users(server))
            .key(self.keys.server_walking(server))
            .key(self.keys.server_moved(server))
            .key(self.keys.server_cleanup(server))
            .key(self.keys.servers())
            .key(self.keys.registry())
            .key(self.keys.events())
            .key(self.keys.format_in_use());
        if let Some(stream) = self.keys.evictions() {
            call.key(stream);
        }
        call.arg(server.as_str())
            .arg(size)
            .arg(layout)
            .arg(self.keys.user_key_prefix())
            .arg(match mode {
                WalkMode::Scan => "scan",
                WalkMode::Pop => "pop",
            })
            .arg(crate::keys::GROUP)
            .arg(entry.unwrap_or(""))
            .arg(event_id)
            .arg(self.build.format)
            .arg(self.build.min);
        let reply: StepReply = call.invoke_async(&mut conn.clone()).await?;
        Ok(Step {
            done: reply.done,
            scanned: reply.scanned,
            deleted: reply.deleted,
            kept: reply.kept,
            announced: reply.announced,
            // On one node exactly the users the step deleted.
            announced_users: if reply.announced > 0 {
                reply.deleted
            } else {
                0
            },
            execution_us: reply.execution_us,
            rechecked: 0,
        })
    }
}

/// One cleanup's walk on one node, shared by its steps in flight.
struct NodeWalk<'a> {
    cleaner: &'a Cleaner,
    conn: &'a RedisConn,
    server: &'a ServerId,
    event_id: &'a str,
    entry: Option<&'a str>,
    /// Set once Redis says OOM: the rest of this cleanup walks in the mode that takes no
    /// memory, since the cleanup is what frees it.
    oom: AtomicBool,
    /// The members left, for the limiter's order (see [`Cleaner::members_left_for_order`]).
    left: AtomicU64,
}

impl NodeWalk<'_> {
    /// One step: a permit from the limiter (when there is one), the step at the size the
    /// limiter allows, and its time and size reported back to the limiter.
    async fn step(&self) -> Result<Step> {
        let limiter = self.cleaner.limiter.as_ref();
        let mut permit = match limiter {
            Some(limiter) => Some(limiter.acquire(self.left.load(Ordering::Relaxed)).await),
            None => None,
        };
        if let Some(permit) = permit.as_mut() {
            permit.sent();
        }
        let size = match limiter {
            Some(limiter) => limiter.step_size(self.cleaner.chunk_size),
            None => self.cleaner.chunk_size,
        };
        let result = self.step_or_pop(size, permit.as_mut()).await;
        if let (Some(permit), Ok(step)) = (permit, &result) {
            self.completed(permit, step);
        }
        result
    }

    /// The step in this walk's mode; one refused for out of memory while scanning is
    /// made again with SPOP, the mode for the rest of the walk.
    async fn step_or_pop(&self, size: usize, permit: Option<&mut Permit>) -> Result<Step> {
        let mode = if self.oom.load(Ordering::Relaxed) {
            WalkMode::Pop
        } else {
            WalkMode::Scan
        };
        match self.step_in(mode, size).await {
            Err(Error::Redis(e)) if e.code() == Some("OOM") && mode == WalkMode::Scan => {
                if !self.oom.swap(true, Ordering::Relaxed) {
                    tracing::warn!(server_id = %self.server, "Redis is out of memory: walking on with SPOP, which needs none");
                }
                // The round trip measured is the retry's alone.
                if let Some(permit) = permit {
                    permit.sent();
                }
                self.step_in(WalkMode::Pop, size).await
            }
            other => other,
        }
    }

    async fn step_in(&self, mode: WalkMode, size: usize) -> Result<Step> {
        self.cleaner
            .step_sized(
                self.conn,
                self.server,
                mode,
                self.event_id,
                self.entry,
                size,
            )
            .await
    }

    /// Tells the limiter how long the step ran and how many members it walked, and
    /// counts them off the members left.
    fn completed(&self, permit: Permit, step: &Step) {
        permit.complete(Duration::from_micros(step.execution_us), step.scanned);
        let _ = self
            .left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some(n.saturating_sub(step.scanned))
            });
    }
}

/// What clean_step.lua replies: {done (0/1), members walked, entries deleted, entries
/// kept, mode walked, evictions entries written, execution time in microseconds}.
#[derive(Debug, Clone, PartialEq, Eq)]
struct StepReply {
    /// This step found nothing left (and acknowledged the entry, when given one).
    done: bool,
    scanned: u64,
    deleted: u64,
    kept: u64,
    announced: u64,
    execution_us: u64,
}

impl redis::FromRedisValue for StepReply {
    fn from_redis_value(v: redis::Value) -> std::result::Result<Self, redis::ParsingError> {
        let mut f = Fields::new("clean_step.lua", v, 7)?;
        let done = f.next::<u8>("done")?;
        let (scanned, deleted, kept) = (f.next("members")?, f.next("deleted")?, f.next("kept")?);
        // The mode the step walked in: checked, not needed (a step the script switched
        // to SPOP walked all the same).
        let _walked = f.state("mode", |s| match s {
            "scan" => Some(WalkMode::Scan),
            "pop" => Some(WalkMode::Pop),
            _ => None,
        })?;
        let (announced, execution_us) = (f.next("announced")?, f.next("execution_us")?);
        let done = match done {
            0 => false,
            1 => true,
            n => {
                return Err(malformed(
                    f.script(),
                    "done 0 or 1",
                    &redis::Value::Int(n.into()),
                ))
            }
        };
        Ok(StepReply {
            done,
            scanned,
            deleted,
            kept,
            announced,
            execution_us,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::{FromRedisValue, Value};

    fn reply(mode: &str) -> Value {
        Value::Array(vec![
            Value::Int(1),
            Value::Int(10),
            Value::Int(7),
            Value::Int(3),
            Value::BulkString(mode.as_bytes().to_vec()),
            Value::Int(1),
            Value::Int(250),
        ])
    }

    #[test]
    fn the_step_reply_decodes_into_its_fields() {
        let step = StepReply::from_redis_value(reply("pop")).unwrap();
        assert_eq!(
            step,
            StepReply {
                done: true,
                scanned: 10,
                deleted: 7,
                kept: 3,
                announced: 1,
                execution_us: 250
            }
        );
    }

    #[test]
    fn a_malformed_step_reply_is_an_error_naming_the_script() {
        let err = StepReply::from_redis_value(reply("sideways")).unwrap_err();
        assert!(err.to_string().contains("clean_step.lua"), "{err}");
        let err = StepReply::from_redis_value(Value::Int(1)).unwrap_err();
        assert!(err.to_string().contains("clean_step.lua"), "{err}");
    }
}
