//! The forward registry's atomic check-and-delete, shared by the cleanup (on a cluster)
//! and the reconciler's drift sweep: an entry is deleted only if, at that instant, it
//! still names the dead server, so a user who reconnected elsewhere keeps the new entry.
//!
//! `owners.lua` is the Lua prelude that every script reading forward entries starts with
//! (owner lookup per layout, the batched delete, the server id rule): `with_prelude`
//! builds such a script.

use std::sync::LazyLock;

use futures_util::stream::{FuturesUnordered, StreamExt};

use crate::{config::Layout, conn::RedisConn, error::Result, event::ServerId, keys::Keys};

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
}

/// Check-and-delete of `users`' forward entries that still name `server`: one script per
/// slot (one call for layout `hash`, whose entries share the `registry` key; for layout
/// `keys`, the users grouped by slot, many calls in flight). Kept are entries that name
/// another server now. Works on one node and on a cluster.
pub async fn check_delete(
    conn: &RedisConn,
    keys: &Keys,
    layout: Layout,
    server: &ServerId,
    users: &[Vec<u8>],
) -> Result<Checked> {
    let mut checked = Checked::default();
    if users.is_empty() {
        return Ok(checked);
    }
    // Each call with the users it was given, in order (its answer names positions).
    let mut calls = Vec::new();
    match layout {
        Layout::Hash => {
            let mut call = CHECK_DELETE.prepare_invoke();
            call.key(keys.registry()).arg(server.as_str()).arg("hash");
            for u in users {
                call.arg(u);
            }
            calls.push((call, users.iter().collect::<Vec<_>>()));
        }
        Layout::Keys => {
            let mut by_slot: std::collections::HashMap<
                redis::cluster_routing::Slot,
                Vec<&Vec<u8>>,
            > = std::collections::HashMap::new();
            for u in users {
                by_slot
                    .entry(redis::cluster_routing::Slot::for_key(keys.user(u)))
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
                type Reply = (u64, u64, Vec<usize>, Vec<usize>);
                call.invoke_async::<Reply>(&mut c)
                    .await
                    .map(|reply| (reply, users))
            });
        }
        let Some(reply) = in_flight.next().await else {
            break;
        };
        let ((deleted, kept, deleted_at, absent_at), users) = reply?;
        checked.deleted += deleted;
        checked.kept += kept;
        let at = |i: usize| users.get(i.wrapping_sub(1)).map(|u| (*u).clone());
        checked
            .deleted_users
            .extend(deleted_at.into_iter().filter_map(at));
        checked
            .absent_users
            .extend(absent_at.into_iter().filter_map(at));
    }
    Ok(checked)
}
