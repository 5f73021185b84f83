//! The demo's verification: every seeded user's entry, and the evictions stream.

use std::collections::HashMap;

use registry_janitor::{
    conn::{self, RedisConn},
    error::Result,
    event::ServerId,
    registry::Registry,
};

use super::{user_id, Summary};

/// Checks every seeded user: entries of users still on a dead server are gone, users who
/// moved kept their new entry, users of live servers kept theirs.
pub(super) async fn verify(
    registry: &Registry,
    conn: &RedisConn,
    dead: &[ServerId],
    live: &[ServerId],
    users: usize,
    moved: &HashMap<Vec<u8>, ServerId>,
) -> Result<Summary> {
    let mut summary = Summary::default();
    let dead_names: Vec<&str> = dead.iter().map(ServerId::as_str).collect();
    for server in dead.iter().chain(live) {
        let is_dead = dead_names.contains(&server.as_str());
        for start in (0..users).step_by(1000) {
            let ids: Vec<Vec<u8>> = (start..users.min(start + 1000))
                .map(|n| user_id(server, n))
                .collect();
            let owners = registry.owners(conn, &ids).await?;
            for (user, owner) in ids.iter().zip(owners) {
                let expected = match moved.get(user) {
                    Some(to) => Some(to.as_str()),
                    None if is_dead => None,
                    None => Some(server.as_str()),
                };
                match (owner.as_deref(), expected) {
                    (Some(o), _) if dead_names.contains(&o) => summary.stale += 1,
                    (o, e) if o != e => summary.lost += 1,
                    (Some(_), _) if is_dead => summary.kept += 1,
                    (None, _) => summary.deleted += 1,
                    _ => {}
                }
            }
        }
    }
    // A clean server has no reverse set and no `servers` entry left either (on a cluster
    // the sets are in as many slots).
    let (mut sets, mut scores) = (Vec::new(), Vec::new());
    for server in dead {
        sets.push(
            redis::cmd("EXISTS")
                .arg(&registry.keys().server_members_left(server)[..])
                .to_owned(),
        );
        scores.push(
            redis::cmd("ZSCORE")
                .arg(registry.keys().servers())
                .arg(server.as_str())
                .to_owned(),
        );
    }
    let sets: Vec<u64> = conn::each_in_flight(conn, sets).await?;
    let scores: Vec<Option<f64>> = conn::each_in_flight(conn, scores).await?;
    summary.stale += sets.iter().sum::<u64>() + scores.iter().flatten().count() as u64;
    Ok(summary)
}

/// Checks the evictions stream against the registry's end state: every entry of a dead
/// server that is gone was announced once; an announced user whose entry exists again
/// must have reconnected (after the eviction); nobody is announced twice.
pub(super) async fn check_evictions(
    summary: &mut Summary,
    registry: &Registry,
    conn: &RedisConn,
    dead: &[ServerId],
    users: usize,
    moved: &HashMap<Vec<u8>, ServerId>,
) -> Result<()> {
    use registry_janitor::evictions::{read_all, Eviction};
    let (mut entries, mut announced) = (0, HashMap::<(String, Vec<u8>), u64>::new());
    for (_, entry) in read_all(conn, registry.keys()).await? {
        if let Some(Eviction::Evicted {
            server_id, users, ..
        }) = entry
        {
            entries += 1;
            for u in users {
                *announced.entry((server_id.clone(), u)).or_default() += 1;
            }
        }
    }
    summary.evicted = Some((entries, announced.values().sum()));
    summary.evicted_wrong = announced.values().filter(|n| **n > 1).count() as u64;
    for server in dead {
        for n in 0..users {
            let user = user_id(server, n);
            let was_announced = announced.contains_key(&(server.as_str().to_owned(), user.clone()));
            let came_back = moved.contains_key(&user);
            match (was_announced, came_back) {
                (true, true) => summary.evicted_then_back += 1,
                (true, false) | (false, true) => {}
                // Gone (verify counts it deleted) but never announced.
                (false, false) => summary.evicted_wrong += 1,
            }
        }
    }
    // Announced users whose entry was never deleted: announced, then found kept without
    // having moved, cannot be; announced ones outside the dead servers' users neither.
    let known: usize = dead.len() * users;
    let extra = announced.len().saturating_sub(known);
    summary.evicted_wrong += extra as u64;
    Ok(())
}
