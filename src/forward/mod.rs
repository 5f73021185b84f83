//! The forward registry's atomic check-and-delete, shared by the cleanup (on a cluster)
//! and the reconciler's drift sweep: an entry is deleted only if, at that instant, it
//! still names the dead server, so a user who reconnected elsewhere keeps the new entry.
//!
//! `owners.lua` is the Lua prelude that every script reading forward entries starts with
//! (owner lookup per layout, the batched delete, the server id rule): `with_prelude`
//! builds such a script.

use std::sync::LazyLock;

use futures_util::stream::{FuturesUnordered, StreamExt};

use crate::{
    config::Layout, conn::RedisConn, error::Result, event::ServerId, keys::Keys, reply::Fields,
};

/// The shared Lua prelude (see owners.lua), with the evictions stream's writer
/// (evictions/announce.lua), so that the scripts that delete also announce.
pub(crate) const PRELUDE: &str = concat!(
    include_str!("owners.lua"),
    include_str!("../evictions/announce.lua")
);

/// A script made of the shared prelude followed by `body`.
pub(crate) fn with_prelude(body: &str) -> redis::Script {
    redis::Script::new(&format!("{PRELUDE}{body}"))
}

static CHECK_DELETE: LazyLock<redis::Script> =
    LazyLock::new(|| with_prelude(include_str!("check_delete.lua")));

/// Check-and-delete scripts (one per slot) of one chunk in flight at once on a cluster.
const SLOTS_IN_FLIGHT: usize = 64;

/// What a check-and-delete did.
#[derive(Debug, Default)]
pub struct Checked {
    /// Entries deleted (they still named the dead server).
    pub deleted: u64,
    /// Entries left alone: they name another server now.
    pub kept: u64,
    /// The users whose entry was deleted.
    pub deleted_users: Vec<Vec<u8>>,
    /// The users who had no entry at all.
    pub absent_users: Vec<Vec<u8>>,
    /// Users that a master's script on a cluster did not check (their slot moved or is
    /// moving, or the script failed) and that went through the per-slot scripts.
    pub rechecked: u64,
    /// The script that ran longest inside Redis: its execution time and the entries it
    /// was given (what the step limiter measures a step by).
    pub longest: Option<(std::time::Duration, u64)>,
}

impl Checked {
    /// Adds what one script did with `users` (its reply names positions from 1).
    fn add(&mut self, reply: SlotReply, users: &[&Vec<u8>]) {
        let execution = std::time::Duration::from_micros(reply.execution_us);
        self.keep_longest(Some((execution, users.len() as u64)));
        self.deleted += reply.deleted;
        self.kept += reply.kept;
        let at = |i: usize| users.get(i.wrapping_sub(1)).map(|u| (*u).clone());
        self.deleted_users
            .extend(reply.deleted_at.into_iter().filter_map(at));
        self.absent_users
            .extend(reply.absent_at.into_iter().filter_map(at));
    }

    /// Adds another check-and-delete's totals and users.
    pub(crate) fn merge(&mut self, more: Checked) {
        self.deleted += more.deleted;
        self.kept += more.kept;
        self.deleted_users.extend(more.deleted_users);
        self.absent_users.extend(more.absent_users);
        self.rechecked += more.rechecked;
        self.keep_longest(more.longest);
    }

    /// Keeps `script` (execution time, entries) as [`Checked::longest`] if it ran longer.
    fn keep_longest(&mut self, script: Option<(std::time::Duration, u64)>) {
        if let Some((execution, _)) = script {
            if self.longest.is_none_or(|(longest, _)| execution > longest) {
                self.longest = script;
            }
        }
    }
}

/// What check_delete.lua replies: {deleted, kept, positions deleted, positions absent,
/// execution time in microseconds} (positions count from 1 in the users given).
#[derive(Debug, Clone, PartialEq, Eq)]
struct SlotReply {
    deleted: u64,
    kept: u64,
    deleted_at: Vec<usize>,
    absent_at: Vec<usize>,
    execution_us: u64,
}

impl redis::FromRedisValue for SlotReply {
    fn from_redis_value(v: redis::Value) -> std::result::Result<Self, redis::ParsingError> {
        let mut f = Fields::new("check_delete.lua", v, 5)?;
        Ok(SlotReply {
            deleted: f.next("deleted")?,
            kept: f.next("kept")?,
            deleted_at: f.next("deleted positions")?,
            absent_at: f.next("absent positions")?,
            execution_us: f.next("execution time")?,
        })
    }
}

/// What check_delete_node.lua replies: check_delete.lua's fields, with the positions of
/// the users whose slot that node does not serve before the execution time.
#[derive(Debug, Clone, PartialEq, Eq)]
struct NodeReply {
    slot: SlotReply,
    elsewhere_at: Vec<usize>,
}

impl redis::FromRedisValue for NodeReply {
    fn from_redis_value(v: redis::Value) -> std::result::Result<Self, redis::ParsingError> {
        let mut f = Fields::new("check_delete_node.lua", v, 6)?;
        let (deleted, kept) = (f.next("deleted")?, f.next("kept")?);
        let (deleted_at, absent_at) = (f.next("deleted positions")?, f.next("absent positions")?);
        let elsewhere_at = f.next("positions served elsewhere")?;
        Ok(NodeReply {
            slot: SlotReply {
                deleted,
                kept,
                deleted_at,
                absent_at,
                execution_us: f.next("execution time")?,
            },
            elsewhere_at,
        })
    }
}

/// Check-and-delete of `users`' forward entries that still name `server`. Kept are
/// entries that name another server now. Works on one node and on a cluster: one call
/// for layout `hash` (its entries share the `registry` key); for layouts `keys` and
/// `conns` (members `<connection> <user>`, the entry a field of the user's Hash) on a
/// cluster, one script per master (`check_delete_node.lua`, the users grouped by the
/// master that serves their slot), and one per slot (`check_delete.lua`) for the users
/// whose slot is moving or whose node did not answer.
pub async fn check_delete(
    conn: &RedisConn,
    keys: &Keys,
    layout: Layout,
    server: &ServerId,
    users: &[Vec<u8>],
) -> Result<Checked> {
    if users.is_empty() {
        return Ok(Checked::default());
    }
    if layout != Layout::Hash && conn.is_cluster() {
        return check_delete_by_node(conn, keys, layout, server, users).await;
    }
    check_delete_by_slot(conn, keys, layout, server, users.iter().collect()).await
}

/// The script of one master: `check_delete.lua` for many slots (see the script).
static CHECK_DELETE_NODE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(CHECK_DELETE_NODE_CODE));
const CHECK_DELETE_NODE_CODE: &str = include_str!("check_delete_node.lua");

/// Layouts `keys` and `conns` on a cluster: the users (members) grouped by the master
/// that serves their slot (by this process's slot map), one `check_delete_node.lua` per
/// master, all at once.
/// The users that a master did not serve (a slot moved or moving: its script reports
/// them), or of a master whose script failed (a failover, a node not connected), go
/// through the per-slot scripts, which redis-rs routes and redirects; the slot map is
/// then read again before the next chunk.
async fn check_delete_by_node(
    conn: &RedisConn,
    keys: &Keys,
    layout: Layout,
    server: &ServerId,
    users: &[Vec<u8>],
) -> Result<Checked> {
    let mut checked = Checked::default();
    let owners = match conn.slot_owners().await {
        Ok(owners) => owners,
        Err(e) => {
            tracing::debug!(error = %e, "no slot map: checking the chunk slot by slot");
            None
        }
    };
    let Some(owners) = owners else {
        return check_delete_by_slot(conn, keys, layout, server, users.iter().collect()).await;
    };
    checked.absent_users.extend(
        users
            .iter()
            .filter(|u| keys.forward_of_member(layout, u).is_none())
            .cloned(),
    );
    let (groups, mut elsewhere) = by_master(&owners, keys, layout, users);
    let mut in_flight = FuturesUnordered::new();
    for (slot, users) in groups {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(CHECK_DELETE_NODE.get_hash())
            .arg(0)
            .arg(server.as_str())
            .arg(layout.as_str());
        for u in &users {
            // by_master grouped only members that have a forward key.
            if let Some((key, field)) = keys.forward_of_member(layout, u) {
                cmd.arg(key);
                if let Some(field) = field {
                    cmd.arg(field);
                }
            }
        }
        in_flight.push(async move { (on_node(conn, slot, cmd).await, users) });
    }
    while let Some((reply, users)) = in_flight.next().await {
        let NodeReply { slot, elsewhere_at } = match reply {
            Ok(reply) => reply,
            Err(e) => {
                tracing::debug!(error = %e, users = users.len(), "a master's check-and-delete failed: checking its users slot by slot");
                elsewhere.extend(users);
                continue;
            }
        };
        checked.add(slot, &users);
        elsewhere.extend(
            elsewhere_at
                .into_iter()
                .filter_map(|i| users.get(i.wrapping_sub(1)).copied()),
        );
    }
    if !elsewhere.is_empty() {
        tracing::debug!(
            users = elsewhere.len(),
            "users not served where the slot map said: checking them slot by slot"
        );
        checked.rechecked += elsewhere.len() as u64;
        conn.forget_slot_owners();
        let more = check_delete_by_slot(conn, keys, layout, server, elsewhere).await?;
        checked.merge(more);
    }
    Ok(checked)
}

/// The users of one master, with a slot it serves (where their script is sent).
type Group<'u> = (u16, Vec<&'u Vec<u8>>);

/// `users` grouped by the master that serves their slot (by `owners`), each group with a
/// slot of that master (where its script is sent); and the users of slots no master
/// serves in that map.
fn by_master<'u>(
    owners: &crate::conn::SlotOwners,
    keys: &Keys,
    layout: Layout,
    users: &'u [Vec<u8>],
) -> (Vec<Group<'u>>, Vec<&'u Vec<u8>>) {
    let mut groups: Vec<Option<Group>> = Vec::new();
    groups.resize_with(owners.masters(), || None);
    let mut elsewhere = Vec::new();
    for u in users {
        // A member with no forward key (layout conns, no `<connection> <user>`) has no
        // entry: the caller left it out.
        let Some((key, _)) = keys.forward_of_member(layout, u) else {
            continue;
        };
        let slot = crate::conn::key_slot(&key);
        match owners.master_of(slot) {
            Some(m) => groups[m as usize]
                .get_or_insert_with(|| (slot, Vec::new()))
                .1
                .push(u),
            None => elsewhere.push(u),
        }
    }
    (groups.into_iter().flatten().collect(), elsewhere)
}

/// `cmd` (an EVALSHA of `check_delete_node.lua`) on the master of `slot`, loading the
/// script there first if that node does not have it.
async fn on_node(conn: &RedisConn, slot: u16, cmd: redis::Cmd) -> Result<NodeReply> {
    let reply = match conn.on_master_of(slot, cmd.clone()).await {
        Err(crate::error::Error::Redis(e)) if e.code() == Some("NOSCRIPT") => {
            let load = redis::cmd("SCRIPT")
                .arg("LOAD")
                .arg(CHECK_DELETE_NODE_CODE)
                .to_owned();
            conn.on_master_of(slot, load).await?;
            conn.on_master_of(slot, cmd).await?
        }
        other => other?,
    };
    redis::from_redis_value(reply).map_err(|e| crate::error::Error::Protocol(e.to_string()))
}

/// Check-and-delete of `users`' forward entries that still name `server`: one script per
/// slot (one call for layout `hash`, whose entries share the `registry` key; for layout
/// `keys`, the users grouped by slot, many calls in flight).
async fn check_delete_by_slot(
    conn: &RedisConn,
    keys: &Keys,
    layout: Layout,
    server: &ServerId,
    users: Vec<&Vec<u8>>,
) -> Result<Checked> {
    let mut checked = Checked::default();
    if users.is_empty() {
        return Ok(checked);
    }
    let calls = slot_calls(keys, layout, server, users, &mut checked);
    // A plain loop rather than an iterator of closures: the latter trips rustc's
    // higher-ranked `Send` inference when the worker spawns this future.
    let mut queued = calls.iter();
    let mut in_flight = FuturesUnordered::new();
    loop {
        while in_flight.len() < SLOTS_IN_FLIGHT {
            let Some((call, users)) = queued.next() else {
                break;
            };
            let mut c = conn.clone();
            in_flight.push(async move {
                call.invoke_async::<SlotReply>(&mut c)
                    .await
                    .map(|reply| (reply, users))
            });
        }
        let Some(reply) = in_flight.next().await else {
            break;
        };
        let (reply, users) = reply?;
        checked.add(reply, users);
    }
    Ok(checked)
}

/// The check-and-delete calls of [`check_delete_by_slot`], one per slot, each with the
/// users it is given (in order). A `conns` member that is not of the layout has no entry:
/// reported absent in `checked`.
fn slot_calls<'u>(
    keys: &Keys,
    layout: Layout,
    server: &ServerId,
    users: Vec<&'u Vec<u8>>,
    checked: &mut Checked,
) -> Vec<(redis::ScriptInvocation<'static>, Vec<&'u Vec<u8>>)> {
    // Each call with the users it was given, in order (its answer names positions).
    let mut calls = Vec::new();
    match layout {
        Layout::Hash => {
            let mut call = CHECK_DELETE.prepare_invoke();
            call.key(keys.registry()).arg(server.as_str()).arg("hash");
            for u in &users {
                call.arg(*u);
            }
            calls.push((call, users));
        }
        Layout::Conns => {
            // Members `<connection> <user>`, grouped by the slot of their user's Hash, each
            // with its key and connection; a member of another shape has no entry
            // (reported absent).
            type Entry<'m> = (&'m Vec<u8>, Vec<u8>, Vec<u8>);
            let mut by_slot: std::collections::HashMap<u16, Vec<Entry<'u>>> =
                std::collections::HashMap::new();
            for m in users {
                match keys.forward_of_member(Layout::Conns, m) {
                    Some((key, Some(connection))) => by_slot
                        .entry(crate::conn::key_slot(&key))
                        .or_default()
                        .push((m, key, connection)),
                    _ => checked.absent_users.push(m.clone()),
                }
            }
            for entries in by_slot.into_values() {
                let mut call = CHECK_DELETE.prepare_invoke();
                call.arg(server.as_str()).arg("conns");
                let mut members = Vec::with_capacity(entries.len());
                for (m, key, connection) in entries {
                    call.key(key).arg(connection);
                    members.push(m);
                }
                calls.push((call, members));
            }
        }
        Layout::Keys => {
            let mut by_slot: std::collections::HashMap<u16, Vec<&Vec<u8>>> =
                std::collections::HashMap::new();
            for u in users {
                by_slot
                    .entry(crate::conn::key_slot(&keys.user(u)))
                    .or_default()
                    .push(u);
            }
            for users in by_slot.into_values() {
                let mut call = CHECK_DELETE.prepare_invoke();
                call.arg(server.as_str()).arg("keys");
                for u in &users {
                    call.key(keys.user(u));
                }
                calls.push((call, users));
            }
        }
    }
    calls
}
