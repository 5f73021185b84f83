//! The topology of a Redis Cluster, for what is per node rather than per slot: the masters
//! (keyspace notifications and SCAN are per node), a client for one node, and the
//! cluster's epoch (every failover bumps it).

use std::time::Duration;

use super::{client_with, connection_info, install_crypto_provider, tls_certificates, RedisConn};
use crate::{
    config::Settings,
    error::{Error, Result},
    event::ServerId,
    keys::Keys,
};

/// Whether CLUSTER NODES flags (comma-separated) name a master that is not failed nor
/// suspected of failing (`fail`, `fail?`). Flags are compared whole: `nofailover`, which
/// `cluster-replica-no-failover yes` shows on masters too, is not a failure.
fn serving_master(flags: &str) -> bool {
    let mut master = false;
    for flag in flags.split(',') {
        match flag {
            "master" => master = true,
            "fail" | "fail?" => return false,
            _ => {}
        }
    }
    master
}

/// CLUSTER NODES of one node of the cluster.
async fn cluster_nodes(conn: &RedisConn) -> Result<String> {
    Ok(redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(&mut conn.clone())
        .await?)
}

/// The masters of the cluster now, as (host, port), from CLUSTER NODES: nodes flagged
/// master, not failed, that serve slots.
pub async fn cluster_masters(conn: &RedisConn) -> Result<Vec<(String, u16)>> {
    let text = cluster_nodes(conn).await?;
    let mut masters: Vec<(String, u16)> = text
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            if fields.len() <= 8 || !serving_master(fields.get(2)?) {
                return None;
            }
            let addr = fields.get(1)?.split(['@', ',']).next()?;
            let (host, port) = addr.rsplit_once(':')?;
            Some((host.to_owned(), port.parse().ok()?))
        })
        .collect();
    masters.sort();
    Ok(masters)
}

/// Whether CLUSTER NODES flags name a replica the cluster counts as up: a failover may
/// promote it. `fail?` (suspected by one node) still counts; `fail` (agreed by the
/// masters) does not.
fn replica_up(flags: &str) -> bool {
    let mut replica = false;
    for flag in flags.split(',') {
        match flag {
            "slave" | "replica" => replica = true,
            "fail" | "handshake" | "noaddr" => return false,
            _ => {}
        }
    }
    replica
}

/// A master as CLUSTER NODES shows it: one of its slots, its node id, and how many
/// replicas the cluster counts as up for it ([`replica_up`]).
#[derive(Debug, Clone, PartialEq, Eq)]
struct MasterSeen {
    slot: u16,
    id: String,
    replicas: i64,
}

/// Each master from a CLUSTER NODES reply: `None` while the masters neither failed nor
/// unlinked do not cover all 16384 slots (a master is down and its replica not yet
/// promoted).
fn masters_seen(text: &str) -> Option<Vec<MasterSeen>> {
    let mut replicas: std::collections::HashMap<&str, i64> = Default::default();
    for line in text.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        if fields.len() >= 4 && replica_up(fields[2]) {
            *replicas.entry(fields[3]).or_default() += 1;
        }
    }
    let mut served = 0usize;
    let mut masters = Vec::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        if fields.len() <= 8 || !serving_master(fields[2]) {
            continue;
        }
        let ranges: Vec<(u16, u16)> = fields[8..]
            .iter()
            .filter(|range| !range.starts_with('['))
            .filter_map(|range| {
                let (first, last) = range.split_once('-').unwrap_or((range, range));
                Some((first.parse().ok()?, last.parse().ok()?))
            })
            .collect();
        served += ranges
            .iter()
            .map(|(first, last)| usize::from(*last) + 1 - usize::from(*first))
            .sum::<usize>();
        if let Some((first, _)) = ranges.first() {
            masters.push(MasterSeen {
                slot: *first,
                id: fields[0].to_owned(),
                replicas: replicas.get(fields[0]).copied().unwrap_or(0),
            });
        }
    }
    (served >= 16384).then_some(masters)
}

/// [`masters_seen`] of the cluster now, with [`max_config_epoch`] of the same reply: the
/// two are one node's view, so a failover that shows in the masters shows in the epoch.
/// A command routed to a master's slot reaches the master (redis-rs follows MOVED and
/// learns a new topology), over the connection the cleanup wrote through.
async fn a_slot_of_each_master(conn: &RedisConn) -> Result<(Option<Vec<MasterSeen>>, u64)> {
    let text = cluster_nodes(conn).await?;
    Ok((masters_seen(&text), max_config_epoch(&text)?))
}

/// The greatest config epoch in a CLUSTER NODES reply. Every failover (elected, or
/// `CLUSTER FAILOVER` of any kind) gives the promoted replica a config epoch greater than
/// any other node's, so it grows with every failover.
fn max_config_epoch(text: &str) -> Result<u64> {
    text.lines()
        .filter_map(|line| line.split(' ').nth(6)?.parse::<u64>().ok())
        .max()
        .ok_or_else(|| Error::Protocol("CLUSTER NODES without a config epoch".into()))
}

/// Whether every replica of `master` holds every write the master had taken when asked
/// (`master_repl_offset`), whichever connection made it: true once each has acknowledged
/// that offset (the `offset` of its `slaveN` line). The replicas waited for are as many
/// as the master counts (`connected_slaves`: gossip may not yet know a new replica's
/// role) or the cluster counts as up for it ([`replica_up`]), whichever is more: a
/// replica whose link the master dropped (its `repl-timeout` passed) is not in the
/// master's count, and a failover may still promote it. A WAIT for them (at most
/// `timeout`) comes in between, to hasten their acknowledgements; its own count is not
/// relied on, as it counts from the offset of the connection it is sent on, which on
/// Redis 7.4 need not cover other connections' writes. Each question goes with CLUSTER
/// MYID in one pipeline, and counts only if the master answered it, as a master
/// (`role:master`): redis-rs sends a request whose node is gone to another node, and a
/// demoted master has no replicas of its own. `None` when it did not: the caller asks
/// again. A question refused for good (an ACL without CLUSTER MYID, INFO or WAIT, or a
/// hosted service that disables one) is not one that waiting answers: it is logged and
/// the master counted as done, nothing waited for.
async fn replicated_on(
    conn: &RedisConn,
    master: &MasterSeen,
    timeout: Duration,
    keys: &Keys,
) -> Option<bool> {
    let on_node = |question: redis::Cmd| async move {
        let mut pipe = redis::pipe();
        pipe.cmd("CLUSTER").arg("MYID").add_command(question);
        let replies = conn
            .pipeline_on_master_of(master.slot, pipe, 2)
            .await
            .ok()?;
        let [id, answer]: [redis::Value; 2] = replies.try_into().ok()?;
        if let Some(why) = refusal(&id) {
            return Some(Said::Refused(why));
        }
        let id: String = redis::from_redis_value(id).ok()?;
        if id != master.id {
            learn_the_master_of(conn, master.slot, keys).await;
            return None;
        }
        if let Some(why) = refusal(&answer) {
            return Some(Said::Refused(why));
        }
        Some(Said::Answer(answer))
    };
    let refused = |why: String| {
        tracing::warn!(error = %why, "the end of a walk cannot ask a master for its replicas (refused): it goes on without waiting for them, and a failover may bring some of the walk's deletes back until the drift sweep removes them");
        Some(true)
    };
    let replication = || async {
        let info = match on_node(redis::cmd("INFO").arg("replication").to_owned()).await? {
            Said::Answer(info) => info,
            Said::Refused(why) => return Some(Err(why)),
        };
        let text = redis::from_redis_value::<String>(info).ok()?;
        text.lines()
            .any(|l| l.trim_end() == "role:master")
            .then_some(Ok(text))
    };
    let before = match replication().await? {
        Ok(text) => text,
        Err(why) => return refused(why),
    };
    let field = |text: &str, name: &str| -> Option<i64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|n| n.trim().parse().ok())
    };
    let replicas = field(&before, "connected_slaves")?.max(master.replicas);
    if replicas == 0 {
        return Some(true);
    }
    let target = field(&before, "master_repl_offset")?;
    let wait = redis::cmd("WAIT")
        .arg(replicas)
        .arg(timeout.as_millis() as u64)
        .to_owned();
    match on_node(wait).await? {
        Said::Answer(count) => redis::from_redis_value::<i64>(count).ok()?,
        Said::Refused(why) => return refused(why),
    };
    let after = match replication().await? {
        Ok(text) => text,
        Err(why) => return refused(why),
    };
    Some(replicas_at(&after, target) >= replicas)
}

/// What a master answered to one question of [`replicated_on`].
enum Said {
    Answer(redis::Value),
    /// The command is refused for good (an ACL without it, a command renamed or disabled
    /// by a hosted service), with the error.
    Refused(String),
}

/// The error of `reply`, when it refuses its command for good rather than in a state
/// that passes ([`crate::error::redis_code_is_transient`]).
fn refusal(reply: &redis::Value) -> Option<String> {
    match reply {
        redis::Value::ServerError(e)
            if !crate::error::redis_code_is_transient(e.code(), e.details().unwrap_or("")) =>
        {
            Some(format!("{} {}", e.code(), e.details().unwrap_or("")))
        }
        _ => None,
    }
}

/// Makes redis-rs learn which master serves `slot` now, after a command sent there by
/// its slot map reached another node. Commands without keys (CLUSTER MYID, INFO, WAIT)
/// never get MOVED, so redis-rs, which reads the slot map again only on a redirect or a
/// failure, would send them to the same node for as long as nothing else touches that
/// slot: after a reshard moved a master's first slot, a walk's end would ask the wrong
/// node forever. A read of a key in that slot (the liveness key of a server id chosen for
/// its slot, which the worker's ACL covers) gets MOVED from the wrong node, and redis-rs
/// follows it and reads the slot map again. Where no such key exists (a `key_prefix`
/// with a hash tag of its own puts every key in one slot), the connection is built again
/// with a fresh slot map instead. Its outcome is not needed.
async fn learn_the_master_of(conn: &RedisConn, slot: u16, keys: &Keys) {
    match key_in_slot(slot, keys) {
        Some(key) => {
            let _: redis::RedisResult<redis::Value> = redis::cmd("EXISTS")
                .arg(key)
                .query_async(&mut conn.clone())
                .await;
        }
        None => {
            conn.rebuild_now(&format!(
                "a node answered for the master of slot {slot} as another node, and no key of the janitor's is in that slot (a key_prefix with a hash tag)"
            ))
            .await
        }
    }
}

/// A liveness key of ours whose hash slot is `slot`, among the first [`KEY_TRIES`] server
/// ids `slot-<n>` (about 16,384 tries on average). With a hash tag in the key prefix every
/// key is in the prefix's slot: three ids in one slot show it (a chance of 1 in 16,384^2
/// otherwise), and no other slot is searched.
fn key_in_slot(slot: u16, keys: &Keys) -> Option<String> {
    let candidates = (0..KEY_TRIES)
        .filter_map(|n| ServerId::parse(&format!("slot-{n}")).ok())
        .map(|server| keys.server_alive(&server));
    let first: Vec<String> = candidates.clone().take(3).collect();
    let slots: Vec<u16> = first.iter().map(|k| key_slot(k.as_bytes())).collect();
    if slots.windows(2).all(|w| w[0] == w[1]) {
        return first.into_iter().find(|k| key_slot(k.as_bytes()) == slot);
    }
    candidates
        .into_iter()
        .find(|key| key_slot(key.as_bytes()) == slot)
}

/// How many server ids [`key_in_slot`] tries: a slot is missed with a probability under
/// e^-16.
const KEY_TRIES: u32 = 1 << 18;

/// How many replicas in INFO replication's `slaveN:...,state=online,offset=N,...` lines
/// have acknowledged replication offset `target`.
fn replicas_at(info: &str, target: i64) -> i64 {
    info.lines()
        .filter(|l| l.starts_with("slave") && l.contains(":ip="))
        .filter(|l| {
            let fields = l.split_once(':').map_or("", |(_, f)| f);
            let value = |name: &str| {
                fields
                    .split(',')
                    .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            };
            value("state") == Some("online")
                && value("offset")
                    .and_then(|o| o.trim().parse::<i64>().ok())
                    .is_some_and(|o| o >= target)
        })
        .count() as i64
}

/// What [`wait_replicated`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replicated {
    /// Masters that serve slots.
    pub masters: usize,
    /// Masters that answered, themselves.
    pub answered: usize,
    /// Masters all of whose replicas acknowledged every write the master had taken when
    /// asked.
    pub held: usize,
    /// The masters up cover every slot.
    pub every_slot: bool,
    /// [`cluster_epoch`], from the same view of the cluster as the masters asked.
    pub epoch: u64,
}

impl Replicated {
    /// Every master answered and every replica holds the writes.
    pub fn all_held(&self) -> bool {
        self.every_slot && self.held == self.masters
    }

    /// Every master answered, and only replicas lag.
    pub fn only_replicas_lag(&self) -> bool {
        self.every_slot && self.answered == self.masters
    }
}

/// Asks every master at once whether all its replicas hold every write it had taken
/// (with a WAIT of at most `timeout` to hasten them): the writes are then on the replicas
/// too, so a failover after it cannot lose them. A master that does not answer, or not itself, is not counted as
/// done, and neither are slots that have no master up.
pub async fn wait_replicated(
    conn: &RedisConn,
    timeout: Duration,
    keys: &Keys,
) -> Result<Replicated> {
    let (masters, epoch) = a_slot_of_each_master(conn).await?;
    let Some(masters) = masters else {
        return Ok(Replicated {
            masters: 0,
            answered: 0,
            held: 0,
            every_slot: false,
            epoch,
        });
    };
    let waits = masters
        .iter()
        .map(|master| replicated_on(conn, master, timeout, keys));
    let answers = futures_util::future::join_all(waits).await;
    Ok(Replicated {
        masters: masters.len(),
        answered: answers.iter().flatten().count(),
        held: answers.iter().filter(|a| **a == Some(true)).count(),
        every_slot: true,
        epoch,
    })
}

/// A client for one node of the cluster, with the settings' credentials: for what is
/// per node (keyspace notifications, SCAN).
/// Over TLS (with the settings' certificate files) when `redis_url` is `rediss://`: the
/// cluster then names its nodes by their TLS ports (`tls-cluster yes`).
pub fn node_client(settings: &Settings, host: &str, port: u16) -> Result<redis::Client> {
    install_crypto_provider();
    let info = connection_info(settings)?;
    let addr = match info.addr() {
        redis::ConnectionAddr::TcpTls {
            insecure,
            tls_params,
            ..
        } => redis::ConnectionAddr::TcpTls {
            host: host.to_owned(),
            port,
            insecure: *insecure,
            tls_params: tls_params.clone(),
        },
        _ => redis::ConnectionAddr::Tcp(host.to_owned(), port),
    };
    client_with(info.set_addr(addr), tls_certificates(settings)?)
}

/// The cluster's epoch as one node sees it: the greatest config epoch in its CLUSTER
/// NODES. It grows with every failover.
pub async fn cluster_epoch(conn: &RedisConn) -> Result<u64> {
    max_config_epoch(&cluster_nodes(conn).await?)
}

/// Number of hash slots of a Redis Cluster.
const SLOTS: usize = 16384;

/// The hash slot of `key` (CRC16-XMODEM of the key, or of its hash tag, modulo 16384),
/// as Redis computes it.
pub fn key_slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    (crc16::State::<crc16::XMODEM>::calculate(tagged) as usize % SLOTS) as u16
}

/// Which master serves each slot, as one node saw it (CLUSTER SLOTS): masters are
/// numbered, so that keys can be grouped by the node that serves them.
#[derive(Debug)]
pub struct SlotOwners {
    /// Per slot, the number of its master; `u16::MAX` for a slot no node serves.
    owner: Vec<u16>,
    masters: usize,
}

impl SlotOwners {
    /// The number (0..[`SlotOwners::masters`]) of the master serving `slot`, if any.
    pub fn master_of(&self, slot: u16) -> Option<u16> {
        self.owner
            .get(slot as usize)
            .copied()
            .filter(|&m| m != u16::MAX)
    }

    /// How many masters serve slots.
    pub fn masters(&self) -> usize {
        self.masters
    }
}

/// The slot map as read from one node now (CLUSTER SLOTS).
pub(super) async fn read_slot_owners(conn: &RedisConn) -> Result<SlotOwners> {
    let reply: redis::Value = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(&mut conn.clone())
        .await?;
    parse_slot_owners(reply)
}

fn parse_slot_owners(reply: redis::Value) -> Result<SlotOwners> {
    use redis::Value;
    let bad = || Error::Protocol("CLUSTER SLOTS reply of an unknown form".into());
    let Value::Array(ranges) = reply else {
        return Err(bad());
    };
    let mut owner = vec![u16::MAX; SLOTS];
    let mut masters: Vec<(Vec<u8>, i64)> = Vec::new();
    for range in ranges {
        let Value::Array(fields) = range else {
            return Err(bad());
        };
        let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(master))) =
            (fields.first(), fields.get(1), fields.get(2))
        else {
            return Err(bad());
        };
        // The master's node ID (Redis 4+ gives it third): endpoints do not tell masters
        // apart where they are empty or `?` (cluster-preferred-endpoint-type
        // unknown-endpoint) and every node has the same port (Kubernetes). Without an ID,
        // its (endpoint, port): an empty endpoint means the answering node, and is the
        // same name for each of its ranges.
        let endpoint = match master.first() {
            Some(Value::BulkString(host)) => host.clone(),
            _ => Vec::new(),
        };
        let Some(Value::Int(port)) = master.get(1) else {
            return Err(bad());
        };
        let id = match master.get(2) {
            Some(Value::BulkString(node_id)) => (node_id.clone(), 0),
            _ => (endpoint, *port),
        };
        let number = match masters.iter().position(|m| *m == id) {
            Some(n) => n,
            None => {
                masters.push(id);
                masters.len() - 1
            }
        };
        let (start, end) = (*start as usize, *end as usize);
        if start > end || end >= SLOTS {
            return Err(bad());
        }
        owner[start..=end].fill(number as u16);
    }
    Ok(SlotOwners {
        owner,
        masters: masters.len(),
    })
}

/// The slot map a [`RedisConn`] keeps (see [`RedisConn::slot_owners`]).
#[derive(Default)]
pub struct SlotCache(std::sync::Mutex<Option<std::sync::Arc<SlotOwners>>>);

impl SlotCache {
    pub(super) fn get(&self) -> Option<std::sync::Arc<SlotOwners>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(super) fn set(&self, owners: std::sync::Arc<SlotOwners>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(owners);
    }

    pub(super) fn forget(&self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn master_flags_are_compared_whole() {
        assert!(serving_master("master"));
        assert!(serving_master("myself,master"));
        assert!(serving_master("master,nofailover"));
        assert!(serving_master("myself,master,nofailover"));
        assert!(!serving_master("master,fail"));
        assert!(!serving_master("master,fail?"));
        assert!(!serving_master("myself,slave"));
        assert!(!serving_master("slave,nofailover"));
    }

    #[test]
    fn masters_are_seen_with_the_replicas_the_cluster_counts_up() {
        let nodes = "\
a1 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460
a2 127.0.0.1:7001@17001 master - 0 0 2 connected 5461-10922
a3 127.0.0.1:7002@17002 master,nofailover - 0 0 3 connected 10923-16383
r1 127.0.0.1:7003@17003 slave a1 0 0 1 connected
r2 127.0.0.1:7004@17004 slave,fail? a1 0 0 1 connected
r3 127.0.0.1:7005@17005 slave,fail a2 0 0 2 disconnected
r4 127.0.0.1:7006@17006 slave,nofailover a3 0 0 3 connected
";
        let seen = masters_seen(nodes).expect("every slot served");
        let replicas: Vec<(&str, u16, i64)> = seen
            .iter()
            .map(|m| (m.id.as_str(), m.slot, m.replicas))
            .collect();
        assert_eq!(
            replicas,
            [("a1", 0, 2), ("a2", 5461, 0), ("a3", 10923, 1)],
            "a replica suspected by one node still counts; one the masters agree failed does not"
        );
        assert_eq!(max_config_epoch(nodes).unwrap(), 3);
        let promoted = nodes.replace("slave,fail? a1 0 0 1", "master - 0 0 7");
        assert_eq!(max_config_epoch(&promoted).unwrap(), 7);
        assert!(max_config_epoch("").is_err());
        let short = nodes.replace("10923-16383", "10923-16382");
        assert_eq!(masters_seen(&short), None, "a slot without a master");
    }

    #[test]
    fn replicas_count_at_an_offset_only_when_online_and_there() {
        let info = "# Replication\r\nrole:master\r\nconnected_slaves:2\r\n\
            slave0:ip=127.0.0.1,port=7001,state=online,offset=500,lag=0\r\n\
            slave1:ip=127.0.0.1,port=7002,state=wait_bgsave,offset=900,lag=0\r\n\
            master_repl_offset:900\r\nslave_read_only:1\r\n";
        assert_eq!(replicas_at(info, 500), 1);
        assert_eq!(replicas_at(info, 501), 0);
        assert_eq!(replicas_at(info, 0), 1);
    }

    #[test]
    fn a_key_of_ours_is_found_in_any_slot_unless_the_prefix_has_a_hash_tag() {
        let plain = Keys::new("app:");
        for slot in [0, 1, 5461, 10923, 16383] {
            let key = key_in_slot(slot, &plain).expect("a key in every slot");
            assert_eq!(key_slot(key.as_bytes()), slot);
            assert!(key.starts_with("app:server:{slot-"), "{key}");
        }
        let tagged = Keys::new("app{7}:");
        let own = key_slot(b"7");
        assert_eq!(
            key_in_slot(own, &tagged).map(|k| key_slot(k.as_bytes())),
            Some(own)
        );
        assert_eq!(key_in_slot((own + 1) % 16384, &tagged), None);
    }

    #[test]
    fn key_slots_are_those_of_redis() {
        // Values from CLUSTER KEYSLOT on Redis 7.0.
        assert_eq!(key_slot(b"a"), 15495);
        assert_eq!(key_slot(b"b"), 3300);
        assert_eq!(key_slot(b"n"), 3432);
        assert_eq!(key_slot(b"123456789"), 0x31c3);
        // A hash tag: only what is between the first { and the next }.
        assert_eq!(key_slot(b"x{a}y"), key_slot(b"a"));
        assert_eq!(key_slot(b"x{}y"), 16116);
        assert_eq!(key_slot(b"{user1000}.following"), 3443);
    }

    #[test]
    fn slot_owners_number_the_masters() {
        use redis::Value;
        let node = |host: &str, port: i64| {
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
            ])
        };
        let reply = Value::Array(vec![
            Value::Array(vec![Value::Int(0), Value::Int(99), node("10.0.0.1", 7000)]),
            Value::Array(vec![
                Value::Int(100),
                Value::Int(16383),
                node("10.0.0.2", 7000),
                node("10.0.0.3", 7000),
            ]),
            Value::Array(vec![Value::Int(5), Value::Int(5), node("10.0.0.1", 7000)]),
        ]);
        let owners = parse_slot_owners(reply).unwrap();
        assert_eq!(owners.masters(), 2);
        // Endpoints that do not tell masters apart ('?', one port for all): their IDs do.
        let node_id = |id: &str| {
            Value::Array(vec![
                Value::BulkString(b"?".to_vec()),
                Value::Int(6379),
                Value::BulkString(id.as_bytes().to_vec()),
            ])
        };
        let same_endpoints = Value::Array(vec![
            Value::Array(vec![Value::Int(0), Value::Int(8191), node_id("a1")]),
            Value::Array(vec![Value::Int(8192), Value::Int(16383), node_id("b2")]),
            Value::Array(vec![Value::Int(9000), Value::Int(9000), node_id("a1")]),
        ]);
        let by_id = parse_slot_owners(same_endpoints).unwrap();
        assert_eq!(by_id.masters(), 2);
        assert_eq!(by_id.master_of(0), by_id.master_of(9000));
        assert_ne!(by_id.master_of(0), by_id.master_of(8192));
        assert_eq!(owners.master_of(0), Some(0));
        assert_eq!(owners.master_of(100), Some(1));
        assert_eq!(owners.master_of(16383), Some(1));
        assert_eq!(owners.master_of(16384), None);
    }
}
