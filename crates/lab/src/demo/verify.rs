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
                .map(|n| user_id(registry.layout(), server, n))
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
    if registry.layout() == registry_janitor::config::Layout::Conns && !conn.is_cluster() {
        let (hashes, connections, naming_dead) = user_hashes(registry, conn, &dead_names).await?;
        summary.user_hashes = Some((hashes, connections));
        summary.stale += naming_dead;
    }
    Ok(summary)
}

/// Layout conns on one node: every user Hash under the prefix (SCAN), its connections,
/// and those naming a dead server (must be 0). An empty Hash cannot be (Redis deletes a
/// Hash with its last field); one would count as stale.
async fn user_hashes(
    registry: &Registry,
    conn: &RedisConn,
    dead: &[&str],
) -> Result<(u64, u64, u64)> {
    let pattern = registry.keys().user_conns_pattern();
    let (mut hashes, mut connections, mut stale) = (0, 0, 0);
    let mut cursor = 0;
    loop {
        let (next, found) = conn::scan_page(conn, cursor, &pattern, 1000, None).await?;
        let reads = found
            .iter()
            .map(|k| redis::cmd("HVALS").arg(k).to_owned())
            .collect();
        let values: Vec<Vec<String>> = conn::each_in_flight(conn, reads).await?;
        for owners in values {
            hashes += 1;
            connections += owners.len() as u64;
            if owners.is_empty() {
                stale += 1;
            }
            stale += owners.iter().filter(|o| dead.contains(&o.as_str())).count() as u64;
        }
        if next == 0 {
            return Ok((hashes, connections, stale));
        }
        cursor = next;
    }
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
        match entry {
            Some(Eviction::Evicted {
                server_id, users, ..
            }) => {
                entries += 1;
                for u in users {
                    *announced.entry((server_id.clone(), u)).or_default() += 1;
                }
            }
            // Layout conns: each pair as the member `<connection> <user>`.
            Some(Eviction::ConnectionsEvicted {
                server_id,
                connections,
                ..
            }) => {
                entries += 1;
                for (user, connection) in connections {
                    let member = registry_janitor::keys::conn_member(&connection, &user);
                    *announced.entry((server_id.clone(), member)).or_default() += 1;
                }
            }
            _ => {}
        }
    }
    summary.evicted = Some((entries, announced.values().sum()));
    summary.evicted_wrong = announced.values().filter(|n| **n > 1).count() as u64;
    for server in dead {
        for n in 0..users {
            let user = user_id(registry.layout(), server, n);
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
