//! The drift sweep on a cluster: HSCAN of `registry` through the cluster connection
//! (layout hash) or SCAN of `user:*` on every master (layout keys); entries of dead owners
//! are deleted by the shared check-and-delete ([`crate::forward::check_delete`]).

use std::{sync::LazyLock, time::Duration};

use tokio_util::sync::CancellationToken;

use super::{pause_or_stop, Reconciler, SweepReport};
use crate::{
    config::Layout,
    conn::{self, RedisConn},
    error::Result,
    event::ServerId,
};

static REVERSE_PAGE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("reverse_page_cluster.lua")));
static REVERSE_APPLY: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("reverse_apply_cluster.lua")));

impl Reconciler {
    /// The forward sweep on a cluster: HSCAN of `registry` through the cluster connection
    /// (layout hash), or SCAN of `user:*` on every master over a connection of its own
    /// (layout keys); owners checked with single-key commands; entries of dead owners
    /// deleted by the same check-and-delete as the cleanup ([`crate::forward::check_delete`]).
    /// Then the reverse sets of live servers, as on one node but in two single-slot
    /// scripts around a read of the owners ([`Reconciler::sweep_reverse_step_on_cluster`]).
    /// A cycle always starts at the beginning. Each
    /// step (a page read, then its check-and-deletes, both idempotent) is retried through
    /// transient states; [`Error::Cancelled`] as soon as `stop` fires.
    pub(super) async fn sweep_on_cluster(
        &self,
        pause: Duration,
        stop: &CancellationToken,
    ) -> Result<SweepReport> {
        let mut report = SweepReport::default();
        self.watch()
            .retrying("checking the evictions stream", stop, || {
                crate::evictions::check_stream(&self.conn, &self.keys)
            })
            .await?;
        match self.settings.layout {
            Layout::Hash => self.sweep_hash_on_cluster(pause, stop, &mut report).await?,
            Layout::Keys | Layout::Conns => {
                let masters = self
                    .watch()
                    .retrying("listing the cluster's masters", stop, || {
                        conn::cluster_masters(&self.conn)
                    })
                    .await?;
                for (host, port) in masters {
                    let node = conn::shared(&conn::node_client(&self.settings, &host, port)?)?;
                    self.sweep_keys_on_node(&node, pause, stop, &mut report)
                        .await?;
                }
            }
        }
        self.sweep_reverse_sets(pause, &mut report, stop).await?;
        Ok(report)
    }

    /// One step of the reverse sweep of `server`'s set on a cluster, where the set (slot
    /// of `{S}`) and the forward entries (other slots) cannot be read in one script:
    /// reverse_page_cluster.lua reads a page of the set and the members due for settling,
    /// the owners of both are read here, and reverse_apply_cluster.lua sets aside, puts
    /// back and drops (its header says why reading the owners outside it is safe).
    /// A forward key of another type is no entry ([`crate::registry::Registry::owners`]):
    /// its member stays in the set, or is dropped when due in `moved`, as on one node.
    /// The SSCAN cursor belongs to the node that issued it: after a failover of that slot a
    /// cycle may miss members, which the next cycle finds. Returns (next cursor, members
    /// scanned, members set aside).
    pub(super) async fn sweep_reverse_step_on_cluster(
        &self,
        server: &ServerId,
        cursor: &str,
    ) -> Result<(String, u64, u64)> {
        let (users, moved) = (
            self.keys.server_users(server),
            self.keys.server_moved(server),
        );
        let ReversePage { next, members, due } = REVERSE_PAGE
            .key(&users)
            .key(&moved)
            .arg(cursor)
            .arg(self.settings.sweep_count)
            .arg(self.settings.heartbeat_grace_ms)
            .invoke_async(&mut self.conn.clone())
            .await?;
        let read: Vec<Vec<u8>> = members.iter().chain(&due).cloned().collect();
        let owners: Vec<Option<Vec<u8>>> =
            crate::registry::Registry::new(self.keys.clone(), self.settings.layout)
                .owners_as(&self.conn, &read)
                .await?;
        let (member_owners, due_owners) = owners.split_at(members.len());
        let own = server.as_str().as_bytes();
        let aside: Vec<&Vec<u8>> = members
            .iter()
            .zip(member_owners)
            .filter(|(_, o)| o.as_deref().is_some_and(|o| o != own))
            .map(|(m, _)| m)
            .collect();
        let (back, dropped): (Vec<_>, Vec<_>) = due
            .iter()
            .zip(due_owners)
            .partition(|(_, o)| o.as_deref() == Some(own));
        if aside.is_empty() && back.is_empty() && dropped.is_empty() {
            return Ok((next, members.len() as u64, 0));
        }
        let mut call = REVERSE_APPLY.prepare_invoke();
        call.key(&users)
            .key(&moved)
            .arg(self.settings.heartbeat_grace_ms)
            .arg(aside.len())
            .arg(back.len());
        for member in aside {
            call.arg(member);
        }
        for (member, _) in back.into_iter().chain(dropped) {
            call.arg(member);
        }
        let removed: u64 = call.invoke_async(&mut self.conn.clone()).await?;
        Ok((next, members.len() as u64, removed))
    }

    /// Layout hash: HSCAN of `registry` (one key, one slot) through the cluster connection.
    async fn sweep_hash_on_cluster(
        &self,
        pause: Duration,
        stop: &CancellationToken,
        report: &mut SweepReport,
    ) -> Result<()> {
        let watch = self.watch();
        let mut cursor = 0u64;
        loop {
            let (next, flat): (u64, Vec<Vec<u8>>) = watch
                .retrying("drift sweep", stop, || async {
                    Ok(redis::cmd("HSCAN")
                        .arg(self.keys.registry())
                        .arg(cursor)
                        .arg("COUNT")
                        .arg(self.settings.sweep_count)
                        .query_async(&mut self.conn.clone())
                        .await?)
                })
                .await?;
            let pairs: Vec<(Vec<u8>, Vec<u8>)> = flat
                .chunks_exact(2)
                .map(|p| (p[0].clone(), p[1].clone()))
                .collect();
            self.remove_entries_of_dead_owners(&pairs, report, stop)
                .await?;
            if next == 0 {
                return Ok(());
            }
            cursor = next;
            pause_or_stop(pause, stop).await?;
        }
    }

    /// Layout keys: SCAN of `user:*` on one master over a connection of its own (SCAN is
    /// per node), then one GET per key, pipelined on that connection. Layout conns: SCAN
    /// of the Hashes `user:{*}:conns`, then one HGETALL per Hash; each field goes on as
    /// the member `<connection> <user>`.
    async fn sweep_keys_on_node(
        &self,
        node: &RedisConn,
        pause: Duration,
        stop: &CancellationToken,
        report: &mut SweepReport,
    ) -> Result<()> {
        let watch = self.watch();
        let conns = self.settings.layout == Layout::Conns;
        let pattern = if conns {
            self.keys.user_conns_pattern()
        } else {
            crate::keys::pattern_under(&self.keys.user_key_prefix())
        };
        let user_prefix = self.keys.user_key_prefix().into_bytes();
        let mut cursor = 0u64;
        loop {
            let (next, pairs) = watch
                .retrying("drift sweep", stop, || async {
                    if conns {
                        return self.conns_page(node, cursor, &pattern).await;
                    }
                    let (next, found) = conn::scan_page(
                        node,
                        cursor,
                        &pattern,
                        self.settings.sweep_count,
                        Some("string"),
                    )
                    .await?;
                    let gets = found
                        .iter()
                        .map(|k| redis::cmd("GET").arg(k).to_owned())
                        .collect();
                    let owners: Vec<Option<Vec<u8>>> = conn::each_in_flight(node, gets).await?;
                    let pairs: Vec<(Vec<u8>, Vec<u8>)> = found
                        .iter()
                        .zip(owners)
                        .filter_map(|(k, o)| {
                            Some((k.strip_prefix(user_prefix.as_slice())?.to_vec(), o?))
                        })
                        .collect();
                    Ok((next, pairs))
                })
                .await?;
            self.remove_entries_of_dead_owners(&pairs, report, stop)
                .await?;
            if next == 0 {
                return Ok(());
            }
            cursor = next;
            pause_or_stop(pause, stop).await?;
        }
    }

    /// One page of the conns sweep on `node`: (next cursor, (member, owner) pairs).
    async fn conns_page(
        &self,
        node: &RedisConn,
        cursor: u64,
        pattern: &str,
    ) -> Result<(u64, Vec<(Vec<u8>, Vec<u8>)>)> {
        let (next, found) = conn::scan_page(
            node,
            cursor,
            pattern,
            self.settings.sweep_count,
            Some("hash"),
        )
        .await?;
        let head = self.keys.user_key_prefix().len() + 1;
        let reads = found
            .iter()
            .map(|k| redis::cmd("HGETALL").arg(k).to_owned())
            .collect();
        let fields: Vec<Vec<(Vec<u8>, Vec<u8>)>> = conn::each_in_flight(node, reads).await?;
        let mut pairs = Vec::new();
        for (key, fields) in found.iter().zip(fields) {
            let Some(user) = key
                .get(head..key.len().saturating_sub(b"}:conns".len()))
                .filter(|_| key.len() >= head + b"}:conns".len())
            else {
                continue;
            };
            // Only a key of this layout (MATCH is a glob): exactly user:{<user>}:conns.
            if self.keys.user_conns(user) != *key {
                continue;
            }
            for (connection, owner) in fields {
                // A field that is no connection id (a space would split the member
                // elsewhere) is never read as an entry of another user.
                let Ok(connection) = std::str::from_utf8(&connection) else {
                    continue;
                };
                if ServerId::parse(connection).is_err() {
                    continue;
                }
                pairs.push((crate::keys::conn_member(connection, user), owner));
            }
        }
        Ok((next, pairs))
    }

    /// Of (user, owner) pairs read by a sweep step, deletes (atomically re-checked) the
    /// entries whose owner is dead now; retried through transient states (idempotent).
    pub(super) async fn remove_entries_of_dead_owners(
        &self,
        pairs: &[(Vec<u8>, Vec<u8>)],
        report: &mut SweepReport,
        stop: &CancellationToken,
    ) -> Result<()> {
        let removed = self
            .watch()
            .retrying("drift sweep", stop, || {
                self.entries_of_dead_owners_removed(pairs)
            })
            .await?;
        report.steps += 1;
        report.entries_scanned += pairs.len() as u64;
        report.entries_removed += removed;
        self.metrics.drift_entries_removed.inc_by(removed);
        self.health.beat();
        Ok(())
    }

    /// One attempt of [`Reconciler::remove_entries_of_dead_owners`]; returns how many
    /// entries it deleted.
    pub(super) async fn entries_of_dead_owners_removed(
        &self,
        pairs: &[(Vec<u8>, Vec<u8>)],
    ) -> Result<u64> {
        let mut by_owner: std::collections::BTreeMap<ServerId, Vec<Vec<u8>>> = Default::default();
        for (user, owner) in pairs {
            // An owner that is not a valid server id never goes into a key name.
            if let Some(owner) = std::str::from_utf8(owner)
                .ok()
                .and_then(|o| ServerId::parse(o).ok())
            {
                by_owner.entry(owner).or_default().push(user.clone());
            }
        }
        if by_owner.is_empty() {
            return Ok(0);
        }
        let owners: Vec<&ServerId> = by_owner.keys().collect();
        let exists = owners
            .iter()
            .map(|s| {
                redis::cmd("EXISTS")
                    .arg(self.keys.server_alive(s))
                    .to_owned()
            })
            .collect();
        let fences = owners
            .iter()
            .map(|s| {
                redis::cmd("EXISTS")
                    .arg(self.keys.server_fence(s))
                    .to_owned()
            })
            .collect();
        // Taken before the reads: Redis's time past it (a step of its clock, or reads
        // that waited in its queue) holds these verdicts.
        let bound = self.reach.time_bound_ms();
        let alive: Vec<bool> = conn::each_in_flight(&self.conn, exists).await?;
        // The scores and Redis's time, in the slot of `servers`.
        let names: Vec<&str> = owners.iter().map(|s| s.as_str()).collect();
        let seen = self.lowered(&names).await?;
        let (now, scores) = (seen.now_ms, seen.scores);
        let fenced: Vec<bool> = conn::each_in_flight(&self.conn, fences).await?;
        // Read after the owners: an outage meanwhile holds these verdicts too.
        let holding = self.reach.past_bound(bound, now) || !self.hold().await?.is_ready();
        let silence = self.silence_proves_death().await?;
        let grace = self.settings.heartbeat_grace_ms;
        let mut removed = 0;
        let states = alive.into_iter().zip(scores).zip(fenced);
        for ((owner, users), ((has_key, score), fenced)) in by_owner.iter().zip(states) {
            // Fenced: declared dead for good, whatever its liveness key says. Others only
            // once Redis has been reachable for a full grace.
            // While silence proves nothing, only a score of 0 (a walk's own, see
            // clean_step.lua) is past.
            let past = |s: f64| match silence {
                true => crate::clock::is_past_grace(s, now, grace),
                false => s <= 0.0,
            };
            let dead = fenced || (!holding && !has_key && score.is_none_or(past));
            if dead {
                let checked = crate::forward::check_delete(
                    &self.conn,
                    &self.keys,
                    self.settings.layout,
                    owner,
                    users,
                )
                .await?;
                removed += checked.deleted;
                // After the deletes, in another slot. Those of the page's entries that are
                // gone are announced too, as on the cleanup's path: a retry of this step
                // (a transient error after the deletes) finds its own deletes absent. A
                // crash in between still loses the announcement (a documented limit).
                let mut gone = checked.deleted_users;
                gone.extend(checked.absent_users);
                self.announce_sweep(owner, &gone).await?;
            }
        }
        Ok(removed)
    }

    /// Announces the users whose entries of `owner` the cluster sweep deleted, retried
    /// through transient states.
    async fn announce_sweep(&self, owner: &ServerId, users: &[Vec<u8>]) -> Result<()> {
        let entries = crate::evictions::announce_members(
            &self.conn,
            &self.keys,
            self.settings.layout,
            owner,
            "",
            crate::evictions::Source::Sweep,
            users,
        )
        .await?;
        self.metrics.observe_evictions(entries, users.len() as u64);
        Ok(())
    }
}

/// reverse_page_cluster.lua's reply: {next cursor, members of the page, members set
/// aside that are due for settling}.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ReversePage {
    next: String,
    members: Vec<Vec<u8>>,
    due: Vec<Vec<u8>>,
}

impl redis::FromRedisValue for ReversePage {
    fn from_redis_value(v: redis::Value) -> std::result::Result<Self, redis::ParsingError> {
        let mut f = crate::reply::Fields::new("reverse_page_cluster.lua", v, 3)?;
        Ok(ReversePage {
            next: f.next("next cursor")?,
            members: f.next("members")?,
            due: f.next("due")?,
        })
    }
}
