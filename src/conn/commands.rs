//! Commands over several keys or many in flight, on one node or a cluster alike: many
//! single-key commands in flight, a transaction, a SCAN page, deleting under a prefix.

use super::{cluster_masters, node_client, shared, RedisConn};
use crate::{config::Settings, error::Result};

/// Commands in flight at once on a cluster, where they cannot be pipelined.
const CLUSTER_IN_FLIGHT: usize = 64;

/// Runs `cmds` (on a cluster each maybe in its own slot, where they cannot be pipelined)
/// with many in flight; replies in order, or the first command's error. On one node they
/// go as one pipeline.
pub async fn each_in_flight<T: redis::FromRedisValue + Send + 'static>(
    conn: &RedisConn,
    cmds: Vec<redis::Cmd>,
) -> Result<Vec<T>> {
    Ok(each_reply_in_flight(conn, cmds)
        .await?
        .into_iter()
        .collect::<redis::RedisResult<Vec<T>>>()?)
}

/// [`each_in_flight`] with each command's reply on its own: an error reply (WRONGTYPE, for
/// one) is that command's `Err` and the others still answer. The outer `Err` is a failure
/// of the whole call (the connection).
pub async fn each_reply_in_flight<T: redis::FromRedisValue + Send + 'static>(
    conn: &RedisConn,
    cmds: Vec<redis::Cmd>,
) -> Result<Vec<redis::RedisResult<T>>> {
    use futures_util::StreamExt;
    if !conn.is_cluster() {
        if cmds.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for cmd in cmds {
            pipe.add_command(cmd);
        }
        return Ok(pipe.query_async(&mut conn.clone()).await?);
    }
    let calls = cmds.into_iter().map(|cmd| {
        let mut c = conn.clone();
        async move { cmd.query_async::<T>(&mut c).await }
    });
    Ok(futures_util::stream::iter(calls)
        .buffered(CLUSTER_IN_FLIGHT)
        .collect()
        .await)
}

/// Runs `cmds` as one MULTI/EXEC on a single node: no other client's command runs between
/// them, and a command refused when queued (syntax, arity, ACL, OOM) discards them all.
/// It is **not** all or nothing on errors: a command that fails at EXEC time (WRONGTYPE,
/// for one) does not stop the others, and nothing is rolled back. Where a write must
/// happen only if another succeeded, use a script (see `dead_letter.lua`). On a cluster
/// the keys may live in different slots, where no MULTI can hold them: the commands run
/// one after another, in the given order, stopping at the first error, and a crash
/// between two of them leaves the earlier ones done. Callers order the commands so that
/// any such partial state is harmless.
pub async fn transaction(conn: &RedisConn, cmds: Vec<redis::Cmd>) -> Result<Vec<redis::Value>> {
    if conn.is_cluster() {
        let mut replies = Vec::with_capacity(cmds.len());
        for cmd in cmds {
            replies.push(cmd.query_async(&mut conn.clone()).await?);
        }
        return Ok(replies);
    }
    let mut pipe = redis::pipe();
    pipe.atomic();
    for cmd in cmds {
        pipe.add_command(cmd);
    }
    Ok(pipe.query_async(&mut conn.clone()).await?)
}

/// Deletes every key under `prefix` (SCAN + UNLINK): on a cluster, SCAN on every master
/// and UNLINK key by key (keys of different slots cannot go in one command).
pub async fn delete_prefixed(settings: &Settings, conn: &RedisConn, prefix: &str) -> Result<()> {
    let pattern = crate::keys::pattern_under(prefix);
    let nodes = if conn.is_cluster() {
        let mut nodes = Vec::new();
        for (host, port) in cluster_masters(conn).await? {
            nodes.push(shared(&node_client(settings, &host, port)?)?);
        }
        nodes
    } else {
        vec![conn.clone()]
    };
    for node in nodes {
        let mut cursor = 0u64;
        loop {
            let (next, found) = scan_page(&node, cursor, &pattern, 1000, None).await?;
            if conn.is_cluster() {
                let unlinks = found
                    .iter()
                    .map(|k| redis::cmd("UNLINK").arg(k).to_owned())
                    .collect();
                let _: Vec<i64> = each_in_flight(conn, unlinks).await?;
            } else if !found.is_empty() {
                let _: i64 = redis::cmd("UNLINK")
                    .arg(found)
                    .query_async(&mut node.clone())
                    .await?;
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    Ok(())
}

/// One page of SCAN on one node: keys matching `pattern` (and of `kind`, if given).
pub async fn scan_page(
    node: &RedisConn,
    cursor: u64,
    pattern: &str,
    count: usize,
    kind: Option<&str>,
) -> Result<(u64, Vec<Vec<u8>>)> {
    let mut cmd = redis::cmd("SCAN");
    cmd.arg(cursor)
        .arg("MATCH")
        .arg(pattern)
        .arg("COUNT")
        .arg(count);
    if let Some(kind) = kind {
        cmd.arg("TYPE").arg(kind);
    }
    Ok(cmd.query_async(&mut node.clone()).await?)
}
