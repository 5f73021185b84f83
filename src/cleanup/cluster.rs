//! The cleanup on a Redis Cluster, where one script cannot touch the reverse set (slot of
//! `{S}`) and the forward entries (other slots) together. Each chunk is three steps:
//! scan (cluster_scan.lua), the check-and-delete ([`crate::forward::check_delete`]: per
//! slot, or for layout `keys` per master), advance the cursor (cluster_advance.lua).

use std::{
    future::Future,
    sync::{Arc, LazyLock},
    time::Duration,
};

use tokio_util::sync::CancellationToken;

use super::{limiter::Limiter, Cleaner, Report, Step};
use crate::{
    conn::{cluster_epoch, RedisConn},
    error::{Error, Result},
    event::ServerId,
    reply::Fields,
    retry::retrying_counted,
};

static CLUSTER_SCAN: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("cluster_scan.lua")));
static CLUSTER_ADVANCE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("cluster_advance.lua")));

/// One chunk of a cluster walk, as cluster_scan.lua replies it: {walk number, cursor
/// used, next cursor, members}; {'', '', '0', {}} when there is nothing to walk.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Chunk {
    /// The walk's number: an advance from an earlier walk is refused.
    walk: String,
    /// The cursor the chunk was scanned at, and the next one.
    at: String,
    next: Next,
    members: Vec<Vec<u8>>,
}

/// Where a cluster walk goes after a chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Next {
    /// The walk of the set is over (SSCAN's cursor 0), or there was nothing to walk.
    End,
    /// Members set aside were folded into the reverse set; the walk starts at the next
    /// scan (cursor `fold`).
    Fold,
    /// The walk goes on from this cursor.
    At(String),
}

impl Next {
    /// The cursor as cluster_advance.lua takes it.
    fn as_str(&self) -> &str {
        match self {
            Next::End => "0",
            Next::Fold => "fold",
            Next::At(cursor) => cursor,
        }
    }
}

impl redis::FromRedisValue for Chunk {
    fn from_redis_value(v: redis::Value) -> std::result::Result<Self, redis::ParsingError> {
        let mut f = Fields::new("cluster_scan.lua", v, 4)?;
        let (walk, at) = (f.next("walk")?, f.next("cursor")?);
        let next = match f.next::<String>("next cursor")?.as_str() {
            "0" => Next::End,
            "fold" => Next::Fold,
            cursor => Next::At(cursor.to_owned()),
        };
        let members = f.next("members")?;
        Ok(Chunk {
            walk,
            at,
            next,
            members,
        })
    }
}

/// What cluster_advance.lua did with a chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Advanced {
    /// Nothing is left to walk: the progress record is gone.
    Done,
    /// The walk is made again (a failover, or errors during it).
    Again,
    /// The cursor moved (or the next set is walked next).
    Moved,
    /// Another worker moved the cursor first, or the chunk's walk is over.
    Raced,
}

/// cluster_advance.lua's reply: {answer, total deleted, total kept}, the totals of the
/// cleanup so far.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Advance {
    advanced: Advanced,
    deleted: u64,
    kept: u64,
}

impl redis::FromRedisValue for Advance {
    fn from_redis_value(v: redis::Value) -> std::result::Result<Self, redis::ParsingError> {
        let mut f = Fields::new("cluster_advance.lua", v, 3)?;
        let advanced = f.state("answer", |s| match s {
            "done" => Some(Advanced::Done),
            "again" => Some(Advanced::Again),
            "advanced" => Some(Advanced::Moved),
            "raced" => Some(Advanced::Raced),
            _ => None,
        })?;
        Ok(Advance {
            advanced,
            deleted: f.next("total deleted")?,
            kept: f.next("total kept")?,
        })
    }
}

/// One WAIT of the end of a walk for the replicas to hold its deletes.
const REPLICATION_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// How long the end of a walk waits in all for replicas that lag while every master
/// answers: a replica that stays behind, or stops answering and is not yet flagged
/// `fail` by the masters (after `cluster-node-timeout` it no longer counts). No bound
/// applies while a master does not answer: its replica may take over without the
/// deletes, and the epoch then shows it.
const REPLICATION_PATIENCE: std::time::Duration = std::time::Duration::from_secs(60);

impl Cleaner {
    /// The cleanup on a Redis Cluster, where one script cannot touch the reverse set
    /// (slot of `{S}`) and the forward entries (other slots) together. Each chunk is three
    /// steps: scan (cluster_scan.lua), check-and-delete (check_delete.lua on the slot of
    /// `registry`, or for layout `keys` check_delete_node.lua per master, with
    /// check_delete.lua per slot for the keys of moving slots), advance the cursor
    /// (cluster_advance.lua).
    /// The cursor moves only after the chunk's deletes, so a crash repeats a chunk and
    /// never skips one. Replication is asynchronous, so a failover can lose deletes the
    /// old master acknowledged, and redis-rs rides out a failover without an error ever
    /// reaching this code: the cluster's epoch (the greatest config epoch) at the start of each walk is
    /// stored with the cursor, and a walk at whose end the epoch differs (every failover
    /// bumps it), or during which this worker saw errors, is made again (up to 3 times),
    /// by whichever worker holds the cleanup by then.
    pub(super) async fn clean_on_cluster(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        event_id: &str,
        entry: Option<&str>,
        stop: &CancellationToken,
        mut on_step: impl FnMut(&Step),
    ) -> Result<Report> {
        // This cleanup's failed attempts: any during a walk make it walk again.
        let errors =
            prometheus::IntCounter::new("cleanup_errors", "this cleanup's failed attempts")
                .expect("a fixed, valid counter name and help");
        let flush_errors = || {
            if let Some(global) = &self.errors {
                global.inc_by(errors.get());
            }
            errors.reset();
        };
        let mut report = Report::default();
        retrying_counted("checking the evictions stream", stop, Some(&errors), || {
            crate::evictions::check_stream(conn, &self.keys)
        })
        .await?;
        let mut epoch =
            retrying_counted("cluster epoch", stop, Some(&errors), || cluster_epoch(conn)).await?;
        // The cleanup's totals (deleted, kept) known so far: see [`totals_known`].
        let mut totals = (0, 0);
        loop {
            if stop.is_cancelled() {
                flush_errors();
                return Err(Error::Cancelled);
            }
            let (step, advanced) = self
                .cluster_chunk(conn, server, event_id, &mut epoch, &errors, stop)
                .await?;
            report.add(&step);
            on_step(&step);
            totals = totals_known(
                totals,
                (step.deleted, step.kept),
                (advanced.deleted, advanced.kept),
            );
            match advanced.advanced {
                Advanced::Done => {
                    flush_errors();
                    let event = entry.map(|entry| (entry, event_id, totals));
                    if self
                        .finish_on_cluster(conn, server, event, &mut report, stop)
                        .await?
                    {
                        return Ok(report);
                    }
                    tracing::info!(server_id = %server, "members were added to the reverse set as the cleanup finished: walking them");
                }
                Advanced::Again => {
                    flush_errors();
                    // A failover may have lost the fence as well as deletes: record it
                    // again (idempotent), before the walk that redoes them.
                    self.fence(conn, server, entry, stop, true).await?;
                    tracing::info!(server_id = %server, "the cluster failed over (or errors were seen) during the walk: walking the set once more");
                }
                Advanced::Moved | Advanced::Raced => {}
            }
        }
    }

    /// One chunk: scan (slot of `{S}`), check-and-delete (the entries' slots), the
    /// announcement of the evicted users (the evictions stream's slot), and at the end of
    /// a walk a fresh read of the epoch, then advance (slot of `{S}`). Returns the step
    /// and what the advance said, with the cleanup's totals (deleted, kept) as the
    /// progress record counted them.
    ///
    /// The announcement names the users this chunk deleted and those whose entry was
    /// already gone: the cursor moves only after it, so a chunk repeated after a crash, or
    /// walked again after a failover, announces the users whose delete an earlier attempt
    /// did but never announced. At least once, never a user whose entry names another
    /// server.
    async fn cluster_chunk(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        event_id: &str,
        epoch: &mut u64,
        errors: &prometheus::IntCounter,
        stop: &CancellationToken,
    ) -> Result<(Step, Advance)> {
        // The format in use lives in another slot than {S}: read before each chunk, and
        // passed to the chunk's scripts, which check the format the progress record was
        // written under and stamp it with this one.
        let in_use = retrying_counted("reading the data format", stop, Some(errors), || {
            crate::format::in_use(conn, &self.keys)
        })
        .await?;
        if !self.build.works_under(in_use) {
            return Err(Error::Format(format!(
                "format {in_use} is in use; this worker works under formats {} to {}",
                self.build.min, self.build.format
            )));
        }
        let step = self.cluster_step_members(conn).await;
        let size = step
            .saturating_mul(self.chunks_in_flight)
            .min(self.chunk_size);
        let chunk = retrying_counted("cleanup scan", stop, Some(errors), || {
            self.cluster_scan(conn, server, *epoch, in_use, size)
        })
        .await?;
        let members = &chunk.members;
        // The chunk's check-and-delete in steps of `step` members, at once: each is what
        // the limiter holds.
        let steps = members
            .chunks(step.max(1))
            .map(|part| self.limited_check_delete(conn, server, part, errors, stop));
        let mut checked = crate::forward::Checked::default();
        for part in futures_util::future::join_all(steps).await {
            checked.merge(part?);
        }
        let execution_us = checked
            .longest
            .map_or(0, |(execution, _)| execution.as_micros() as u64);
        let (deleted, kept, rechecked) = (checked.deleted, checked.kept, checked.rechecked);
        let mut gone = checked.deleted_users;
        gone.extend(checked.absent_users);
        let announced = retrying_counted("announcing evictions", stop, Some(errors), || {
            crate::evictions::announce_members(
                conn,
                &self.keys,
                self.layout,
                server,
                event_id,
                crate::evictions::Source::Cleanup,
                &gone,
            )
        })
        .await?;
        if chunk.next == Next::End {
            *epoch = if self.replica_wait {
                let started = std::time::Instant::now();
                let epoch = self.wait_for_replicas(conn, server, *epoch, stop).await?;
                if let Some(seconds) = &self.replica_wait_seconds {
                    seconds.observe(started.elapsed().as_secs_f64());
                }
                epoch
            } else {
                retrying_counted("cluster epoch", stop, Some(errors), || cluster_epoch(conn))
                    .await?
            };
        }
        let saw_errors = errors.get() > 0;
        // The chunk's token: the same on every retry of its advance, so that one whose
        // first attempt ran (its reply lost) does not count the chunk again.
        let token = format!("{:016x}", rand::random::<u64>());
        let advanced = retrying_counted("cleanup advance", stop, Some(errors), || {
            self.cluster_advance(
                conn,
                server,
                &chunk,
                (deleted, kept, &token),
                (*epoch, in_use),
                saw_errors,
            )
        })
        .await?;
        let step = Step {
            done: advanced.advanced == Advanced::Done,
            scanned: members.len() as u64,
            deleted,
            kept,
            announced,
            announced_users: if announced > 0 { gone.len() as u64 } else { 0 },
            execution_us,
            rechecked,
        };
        Ok((step, advanced))
    }

    /// The end of a walk: its deletes (on every master) reach the replicas before the
    /// epoch that decides whether they stand is read, so a failover after this cannot
    /// lose them, and one before it has changed the epoch and the walk is made again.
    /// While a replica the cluster counts as up has not acknowledged them, the walk does
    /// not move on: it WAITs again, and returns as soon as the epoch changes (a failover
    /// was decided: the walk is made again). Only a replica that stays behind for
    /// [`REPLICATION_PATIENCE`] is given up on, with a warning (the drift sweep then
    /// repairs what a failover to it would bring back). `walk_epoch` is the epoch the walk was made under; returns the epoch read last.
    async fn wait_for_replicas(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        walk_epoch: u64,
        stop: &CancellationToken,
    ) -> Result<u64> {
        // Since when only replicas lag (every master answering): the patience runs only
        // then, never while a master is gone (its replica may take over without the
        // deletes, which the epoch then shows).
        let mut lagging_since: Option<std::time::Instant> = None;
        let mut waited = false;
        loop {
            // The epoch and the masters asked come from one node's view of the cluster: a
            // failover that made a replica without the deletes a master shows in both.
            let found = retrying_counted("waiting for the replicas", stop, None, || {
                crate::conn::wait_replicated(conn, REPLICATION_WAIT, &self.keys)
            })
            .await?;
            let epoch = found.epoch;
            if found.all_held() || epoch != walk_epoch {
                if waited {
                    tracing::info!(server_id = %server, "the replicas hold the walk's deletes (or the cluster failed over): the cleanup goes on");
                }
                return Ok(epoch);
            }
            lagging_since = if found.only_replicas_lag() {
                lagging_since.or(Some(std::time::Instant::now()))
            } else {
                None
            };
            if lagging_since.is_some_and(|since| since.elapsed() >= REPLICATION_PATIENCE) {
                tracing::warn!(server_id = %server, masters = found.masters, masters_behind = found.masters - found.held, "a replica still lags behind the walk's deletes: going on without it (a failover to it could bring some back; the drift sweep removes them)");
                return Ok(epoch);
            }
            if !waited {
                tracing::info!(server_id = %server, masters = found.masters, answered = found.answered, masters_behind = found.masters - found.held, "the replicas do not all hold the walk's deletes: the cleanup waits before it moves on");
                waited = true;
            }
            // A master that is gone answers at once: ask again a little later.
            tokio::select! {
                () = stop.cancelled() => return Err(Error::Cancelled),
                () = tokio::time::sleep(std::time::Duration::from_millis(200)) => {}
            }
        }
    }

    /// After the step that found nothing left: `server.cleaned` on the evictions stream,
    /// then the acknowledgement (both in other slots, so they follow the step; in this
    /// order, so that a crash between them repeats the announcement rather than lose it),
    /// then one more check. A member added between
    /// the last step and the acknowledgement (a zombie, a registration in two steps) is
    /// walked next: returns false. S leaves `servers` only once nothing is left (true):
    /// should this worker die before, the reconciler still sees S and reports it again.
    /// `event`: the entry to acknowledge, the event_id and the cleanup's totals.
    async fn finish_on_cluster(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        event: Option<(&str, &str, (u64, u64))>,
        report: &mut Report,
        stop: &CancellationToken,
    ) -> Result<bool> {
        if let (Some((id, event_id, (deleted, kept))), false) = (event, report.acknowledged) {
            retrying_counted(
                "announcing server.cleaned",
                stop,
                self.errors.as_ref(),
                || {
                    crate::evictions::announce_cleaned(
                        conn, &self.keys, server, event_id, deleted, kept,
                    )
                },
            )
            .await?;
            retrying_counted("acknowledging", stop, self.errors.as_ref(), || {
                crate::stream::ack(conn, &self.keys, id)
            })
            .await?;
            report.acknowledged = true;
        }
        let left =
            retrying_counted("cleanup check", stop, None, || self.progress(conn, server)).await?;
        if left.is_some() {
            return Ok(false);
        }
        self.leave_servers(conn, server, stop).await?;
        Ok(true)
    }

    /// Once a cluster cleanup is done and acknowledged: S leaves `servers`.
    async fn leave_servers(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        stop: &CancellationToken,
    ) -> Result<()> {
        retrying_counted("cleanup finish", stop, self.errors.as_ref(), || async {
            let _: i64 = redis::cmd("ZREM")
                .arg(self.keys.servers())
                .arg(server.as_str())
                .query_async(&mut conn.clone())
                .await?;
            Ok(())
        })
        .await
    }

    /// One step of a chunk's check-and-delete, through the limiter when there is one: a
    /// permit per attempt (see [`retrying_limited`]), and its longest script's execution
    /// time reported with the round trip (its scripts are what a lookup waits behind).
    async fn limited_check_delete(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        members: &[Vec<u8>],
        errors: &prometheus::IntCounter,
        stop: &CancellationToken,
    ) -> Result<crate::forward::Checked> {
        let limiter = self.limiter.as_ref().filter(|_| !members.is_empty());
        // Measured only when the attempt did it all on the masters' scripts: the per-slot
        // scripts of keys that moved are no queue in Redis (the permit is then given back
        // unmeasured).
        let measured =
            |checked: &crate::forward::Checked| checked.longest.filter(|_| checked.rechecked == 0);
        retrying_limited(
            "cleanup delete",
            stop,
            Some(errors),
            limiter,
            measured,
            || crate::forward::check_delete(conn, &self.keys, self.layout, server, members),
        )
        .await
    }

    /// Members of one check-and-delete step: `chunk_size`, or with a limiter as many as
    /// make each master's script the limiter's step size (the members spread over the
    /// masters in layouts `keys` and `conns`; in layout `hash` they all go to the master of
    /// `registry`), at most `chunk_size`. A chunk walks `chunks_in_flight` such steps, at
    /// most `chunk_size` members, and sends its steps at once.
    async fn cluster_step_members(&self, conn: &RedisConn) -> usize {
        let Some(limiter) = &self.limiter else {
            return self.chunk_size;
        };
        let masters = match self.layout {
            crate::config::Layout::Hash => 1,
            _ => conn
                .slot_owners()
                .await
                .ok()
                .flatten()
                .map_or(1, |owners| owners.masters().max(1)),
        };
        limiter
            .step_size(self.chunk_size)
            .saturating_mul(masters)
            .min(self.chunk_size)
    }

    async fn cluster_scan(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        epoch: u64,
        in_use: u32,
        size: usize,
    ) -> Result<Chunk> {
        let mut call = CLUSTER_SCAN.prepare_invoke();
        call.key(self.keys.server_users(server))
            .key(self.keys.server_walking(server))
            .key(self.keys.server_cleanup(server))
            .key(self.keys.server_moved(server))
            .arg(size)
            .arg(epoch)
            .arg(self.build.format)
            .arg(self.build.min)
            .arg(in_use);
        Ok(call.invoke_async(&mut conn.clone()).await?)
    }

    /// cluster_advance.lua for `chunk`, with its counts (deleted, kept) and its token.
    async fn cluster_advance(
        &self,
        conn: &RedisConn,
        server: &ServerId,
        chunk: &Chunk,
        (deleted, kept, token): (u64, u64, &str),
        (epoch, in_use): (u64, u32),
        saw_errors: bool,
    ) -> Result<Advance> {
        let mut call = CLUSTER_ADVANCE.prepare_invoke();
        call.key(self.keys.server_users(server))
            .key(self.keys.server_walking(server))
            .key(self.keys.server_cleanup(server))
            .key(self.keys.server_moved(server))
            .arg(&chunk.walk)
            .arg(&chunk.at)
            .arg(chunk.next.as_str())
            .arg(chunk.members.len())
            .arg(epoch)
            .arg(if saw_errors { "1" } else { "0" })
            .arg(deleted)
            .arg(kept)
            .arg(self.build.format)
            .arg(self.build.min)
            .arg(in_use)
            .arg(token);
        Ok(call.invoke_async(&mut conn.clone()).await?)
    }
}

/// `op` retried as [`retrying_counted`] retries it, each attempt with a permit of its own
/// from `limiter` (when there is one), taken before the attempt is sent and given back as
/// it ends: the pauses between attempts hold no place in the window, so other cleanups'
/// steps go meanwhile. The permit of an attempt that succeeded is completed with what
/// `measured` makes of its result (execution time, entries), or given back unmeasured
/// when that is `None`; a failed attempt's is given back unmeasured.
async fn retrying_limited<T, F, Fut>(
    what: &str,
    stop: &CancellationToken,
    errors: Option<&prometheus::IntCounter>,
    limiter: Option<&Arc<Limiter>>,
    measured: impl Fn(&T) -> Option<(Duration, u64)>,
    mut op: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let measured = &measured;
    retrying_counted(what, stop, errors, || {
        let attempt = op();
        async move {
            let mut permit = match limiter {
                Some(limiter) => Some(limiter.acquire(0).await),
                None => None,
            };
            if let Some(permit) = permit.as_mut() {
                permit.sent();
            }
            let result = attempt.await;
            if let (Some(permit), Ok(value)) = (permit, &result) {
                if let Some((execution, entries)) = measured(value) {
                    permit.complete(execution, entries);
                }
            }
            result
        }
    })
    .await
}

/// The cleanup's totals (deleted, kept) known after a chunk: those known before plus the
/// chunk's own counts, or the progress record's totals in the advance's reply where they
/// are greater (they hold what other workers counted too). A reply of 'done' to a retried
/// advance whose first attempt ended the cleanup finds the record gone and answers 0, 0:
/// the totals known stand.
fn totals_known(before: (u64, u64), chunk: (u64, u64), reply: (u64, u64)) -> (u64, u64) {
    (
        (before.0 + chunk.0).max(reply.0),
        (before.1 + chunk.1).max(reply.1),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::{FromRedisValue, Value};

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn scan_replies_decode_into_a_chunk_with_its_next_cursor() {
        let chunk = |next: &str| {
            Chunk::from_redis_value(Value::Array(vec![
                bulk("2"),
                bulk("0"),
                bulk(next),
                Value::Array(vec![bulk("u1")]),
            ]))
            .unwrap()
        };
        assert_eq!(chunk("0").next, Next::End);
        assert_eq!(chunk("fold").next, Next::Fold);
        assert_eq!(chunk("17").next, Next::At("17".into()));
        assert_eq!(chunk("17").members, vec![b"u1".to_vec()]);
        assert!(Chunk::from_redis_value(Value::Array(vec![]))
            .unwrap_err()
            .to_string()
            .contains("cluster_scan.lua"));
    }

    #[test]
    fn advance_replies_decode_into_named_answers() {
        let advance = |answer: &str| {
            Advance::from_redis_value(Value::Array(vec![
                bulk(answer),
                Value::Int(5),
                Value::Int(2),
            ]))
        };
        assert_eq!(advance("done").unwrap().advanced, Advanced::Done);
        assert_eq!(advance("again").unwrap().advanced, Advanced::Again);
        assert_eq!(advance("advanced").unwrap().advanced, Advanced::Moved);
        assert_eq!(advance("raced").unwrap().advanced, Advanced::Raced);
        assert_eq!(advance("done").unwrap().deleted, 5);
        let err = advance("sideways").unwrap_err().to_string();
        assert!(err.contains("cluster_advance.lua"), "{err}");
    }

    /// The key names of one dead server's walk, in one hash tag (so a plain node takes
    /// them, as one cluster slot does).
    struct Walk {
        keys: crate::keys::Keys,
        server: ServerId,
        build: crate::format::Build,
    }

    impl Walk {
        fn scan(&self, c: &mut redis::Connection, size: usize) -> Chunk {
            CLUSTER_SCAN
                .key(self.keys.server_users(&self.server))
                .key(self.keys.server_walking(&self.server))
                .key(self.keys.server_cleanup(&self.server))
                .key(self.keys.server_moved(&self.server))
                .arg(size)
                .arg(1)
                .arg(self.build.format)
                .arg(self.build.min)
                .arg(self.build.format)
                .invoke(c)
                .unwrap()
        }

        fn advance(
            &self,
            c: &mut redis::Connection,
            chunk: &Chunk,
            (deleted, kept): (u64, u64),
            token: &str,
        ) -> Advance {
            CLUSTER_ADVANCE
                .key(self.keys.server_users(&self.server))
                .key(self.keys.server_walking(&self.server))
                .key(self.keys.server_cleanup(&self.server))
                .key(self.keys.server_moved(&self.server))
                .arg(&chunk.walk)
                .arg(&chunk.at)
                .arg(chunk.next.as_str())
                .arg(chunk.members.len())
                .arg(1)
                .arg("0")
                .arg(deleted)
                .arg(kept)
                .arg(self.build.format)
                .arg(self.build.min)
                .arg(self.build.format)
                .arg(token)
                .invoke(c)
                .unwrap()
        }
    }

    /// A private redis-server, a connection to it, and the walk of one dead server whose
    /// reverse set holds `members` users.
    fn walk_of(
        members: usize,
    ) -> (
        registry_janitor_testkit::RedisServer,
        redis::Connection,
        Walk,
    ) {
        let redis = registry_janitor_testkit::RedisServer::start().unwrap();
        let mut c = redis::Client::open(redis.url())
            .unwrap()
            .get_connection()
            .unwrap();
        let walk = Walk {
            keys: crate::keys::Keys::new("t:"),
            server: ServerId::parse("gw-a#1").unwrap(),
            build: crate::format::Build::compiled(),
        };
        let members: Vec<String> = (0..members).map(|n| format!("u{n}")).collect();
        redis::cmd("SADD")
            .arg(walk.keys.server_users(&walk.server))
            .arg(&members)
            .exec(&mut c)
            .unwrap();
        (redis, c, walk)
    }

    /// An advance retried after its first attempt ran (its reply lost) answers 'raced',
    /// with the chunk counted once in the totals; another chunk's advance adds its own.
    #[test]
    fn a_retried_advance_counts_its_chunk_once() {
        let (_redis, mut c, walk) = walk_of(500);
        let chunk = walk.scan(&mut c, 10);
        assert!(matches!(chunk.next, Next::At(_)), "{chunk:?}");
        let first = walk.advance(&mut c, &chunk, (7, 2), "a1");
        assert_eq!(
            (first.advanced, first.deleted, first.kept),
            (Advanced::Moved, 7, 2)
        );
        let retried = walk.advance(&mut c, &chunk, (7, 2), "a1");
        assert_eq!(
            (retried.advanced, retried.deleted, retried.kept),
            (Advanced::Raced, 7, 2),
            "the retry counts the chunk a second time"
        );
        let next = walk.scan(&mut c, 10);
        assert_eq!(next.at, chunk.next.as_str());
        let second = walk.advance(&mut c, &next, (3, 1), "b2");
        assert_eq!(
            (second.advanced, second.deleted, second.kept),
            (Advanced::Moved, 10, 3)
        );
    }

    /// The last chunk's advance answered 'done' and removed the progress record; its retry
    /// answers 'done' with 0, 0, and the totals known before stand.
    #[test]
    fn a_retried_last_advance_keeps_the_cleanups_totals() {
        let (_redis, mut c, walk) = walk_of(3);
        let chunk = walk.scan(&mut c, 10);
        assert_eq!(chunk.next, Next::End, "{chunk:?}");
        let done = walk.advance(&mut c, &chunk, (2, 1), "c3");
        assert_eq!(
            (done.advanced, done.deleted, done.kept),
            (Advanced::Done, 2, 1)
        );
        let known = totals_known((0, 0), (2, 1), (done.deleted, done.kept));
        assert_eq!(known, (2, 1));
        let retried = walk.advance(&mut c, &chunk, (2, 1), "c3");
        assert_eq!(retried.advanced, Advanced::Done);
        assert_eq!(
            totals_known((0, 0), (2, 1), (retried.deleted, retried.kept)),
            (2, 1),
            "server.cleaned would say deleted={} kept={}",
            retried.deleted,
            retried.kept
        );
    }

    /// A check-and-delete part whose attempts fail (a real Redis refusing writes with OOM,
    /// retryable) holds no permit through the pauses between its attempts: another
    /// cleanup's step on the same limiter (window of one) gets its permit meanwhile.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_retrying_part_lets_another_cleanups_step_through_the_window() {
        use std::sync::atomic::{AtomicU64, Ordering};
        let redis = registry_janitor_testkit::RedisServer::start().unwrap();
        let client = redis::Client::open(redis.url()).unwrap();
        let c = client.get_multiplexed_async_connection().await.unwrap();
        let set_maxmemory = |bytes: u64| {
            let mut c = c.clone();
            async move {
                redis::cmd("CONFIG")
                    .arg("SET")
                    .arg("maxmemory")
                    .arg(bytes)
                    .exec_async(&mut c)
                    .await
                    .unwrap();
            }
        };
        set_maxmemory(1).await;
        let limiter = Limiter::new(
            Duration::from_millis(50),
            1,
            super::super::limiter::StepOrder::RoundRobin,
            false,
            None,
        );
        assert_eq!(limiter.window(), 1);
        let stop = CancellationToken::new();
        let attempts = AtomicU64::new(0);
        let part = retrying_limited(
            "test part",
            &stop,
            None,
            Some(&limiter),
            |_: &()| None,
            || {
                let mut c = c.clone();
                let attempts = &attempts;
                async move {
                    attempts.fetch_add(1, Ordering::SeqCst);
                    redis::cmd("SET")
                        .arg("k")
                        .arg("v")
                        .exec_async(&mut c)
                        .await?;
                    Ok::<(), Error>(())
                }
            },
        );
        let other = async {
            while attempts.load(Ordering::SeqCst) < 2 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let permit = tokio::time::timeout(Duration::from_secs(3), limiter.acquire(0)).await;
            let got = permit.is_ok();
            drop(permit);
            set_maxmemory(0).await;
            got
        };
        let (part, got) = tokio::join!(part, other);
        part.unwrap();
        assert!(
            got,
            "another cleanup's step waited 3 s for a permit while the part was retrying"
        );
        assert_eq!(limiter.in_flight(), 0);
    }

    #[test]
    fn the_totals_known_are_the_chunks_counted_or_the_records_if_greater() {
        // Another worker's chunks are in the record's totals.
        assert_eq!(totals_known((10, 3), (5, 1), (40, 9)), (40, 9));
        // The record is gone (a retried 'done'): the totals known plus the chunk.
        assert_eq!(totals_known((10, 3), (5, 1), (0, 0)), (15, 4));
        // Each total on its own.
        assert_eq!(totals_known((10, 3), (5, 1), (12, 8)), (15, 8));
    }
}
