//! The events stream and its consumer group: reading, acknowledging, dead-lettering.
//!
//! Replies are parsed from raw [`redis::Value`]s into [`Entry`]s with byte-string
//! fields, so that an entry with non-UTF-8 field names (hostile or buggy producers) is
//! still read, dead-lettered and acknowledged instead of failing the whole batch.

use redis::Value;

use crate::conn::RedisConn;

use crate::{
    error::{Error, Result},
    event::{Entry, FIELD_PAYLOAD, FIELD_TYPE},
    keys::{ids, Keys, GROUP},
};

/// Creates the group (see [`ensure_group`]) and registers `consumer` in it, so that an
/// idle worker shows in `XINFO CONSUMERS` (Redis 7.0 creates a consumer only when a read
/// returns entries).
pub async fn join_group(conn: &RedisConn, keys: &Keys, consumer: &str) -> Result<()> {
    ensure_group(conn, keys).await?;
    register_consumer(conn, keys, consumer).await
}

static TOUCH_ENTRY: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("touch_entry.lua")));

/// Resets the idle time of entry `id` if `consumer` still owns it (see touch_entry.lua).
/// Returns false when the entry is no longer ours.
pub async fn touch(conn: &RedisConn, keys: &Keys, consumer: &str, id: &str) -> Result<bool> {
    let mut call = TOUCH_ENTRY.prepare_invoke();
    call.key(keys.events()).arg(GROUP).arg(consumer).arg(id);
    let touched: bool = call.invoke_async(&mut conn.clone()).await?;
    Ok(touched)
}

static HAND_OFF: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("hand_off.lua")));

/// Hands entry `id` over after a graceful stop (see hand_off.lua): gives its delivery back
/// and makes it claimable at once (idle for `idle_ms`), if `consumer` still owns it.
/// Returns the delivery count left, or `None` if the entry is no longer ours.
pub async fn hand_off(
    conn: &RedisConn,
    keys: &Keys,
    consumer: &str,
    id: &str,
    idle_ms: u64,
) -> Result<Option<u64>> {
    let mut call = HAND_OFF.prepare_invoke();
    call.key(keys.events())
        .arg(GROUP)
        .arg(consumer)
        .arg(id)
        .arg(idle_ms);
    let handed: HandedOff = call.invoke_async(&mut conn.clone()).await?;
    Ok(handed.0)
}

/// Up to `count` entries pending to `consumer`, oldest first: (id, idle ms).
pub async fn pending_of(
    conn: &RedisConn,
    keys: &Keys,
    consumer: &str,
    count: usize,
) -> Result<Vec<(String, u64)>> {
    let rows: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(keys.events())
        .arg(GROUP)
        .arg("-")
        .arg("+")
        .arg(count)
        .arg(consumer)
        .query_async(&mut conn.clone())
        .await?;
    Ok(rows
        .into_iter()
        .map(|(id, _, idle, _)| (id, idle))
        .collect())
}

/// hand_off.lua's reply: the delivery count left, or -1 when the consumer no longer owns
/// the entry (`None`).
struct HandedOff(Option<u64>);

impl redis::FromRedisValue for HandedOff {
    fn from_redis_value(v: Value) -> std::result::Result<Self, redis::ParsingError> {
        match v {
            Value::Int(-1) => Ok(HandedOff(None)),
            Value::Int(n) if n >= 0 => Ok(HandedOff(Some(n as u64))),
            other => Err(crate::reply::malformed(
                "hand_off.lua",
                "a delivery count or -1",
                &other,
            )),
        }
    }
}

/// Registers `consumer` in the group if it is not there (a no-op otherwise).
pub async fn register_consumer(conn: &RedisConn, keys: &Keys, consumer: &str) -> Result<()> {
    let _: i64 = redis::cmd("XGROUP")
        .arg("CREATECONSUMER")
        .arg(keys.events())
        .arg(GROUP)
        .arg(consumer)
        .query_async(&mut conn.clone())
        .await?;
    Ok(())
}

/// Creates the consumer group at the start of the stream (id `0`), so that events
/// published before the first worker ever started are processed too; creates the
/// stream if missing. An existing group is left as it is.
pub async fn ensure_group(conn: &RedisConn, keys: &Keys) -> Result<()> {
    let created: redis::RedisResult<()> = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(keys.events())
        .arg(GROUP)
        .arg(ids::GROUP_START)
        .arg("MKSTREAM")
        .query_async(&mut conn.clone())
        .await;
    match created {
        Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
        other => Ok(other?),
    }
}

/// True for the errors Redis gives when the stream or the group is gone (deleted, or lost
/// in a restart without persistence): the group must be created again. `NOGROUP` comes
/// back to a new read; `UNBLOCKED` to a read that was blocked when the key was deleted.
pub fn is_no_group(e: &Error) -> bool {
    matches!(e, Error::Redis(r) if matches!(r.code(), Some("NOGROUP" | "UNBLOCKED")))
}

/// Reads up to `count` new entries for `consumer`, blocking up to `block_ms`.
pub async fn read_new(
    conn: &RedisConn,
    keys: &Keys,
    consumer: &str,
    count: usize,
    block_ms: u64,
) -> Result<Vec<Entry>> {
    let reply: Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(GROUP)
        .arg(consumer)
        .arg("COUNT")
        .arg(count)
        .arg("BLOCK")
        .arg(block_ms)
        .arg("STREAMS")
        .arg(keys.events())
        .arg(ids::NEW_ENTRIES)
        .query_async(&mut conn.clone())
        .await?;
    parse_read_reply(reply)
}

/// Acknowledges one entry; returns whether it was still pending.
pub async fn ack(conn: &RedisConn, keys: &Keys, id: &str) -> Result<bool> {
    let n: i64 = redis::cmd("XACK")
        .arg(keys.events())
        .arg(GROUP)
        .arg(id)
        .query_async(&mut conn.clone())
        .await?;
    Ok(n == 1)
}

static DEAD_LETTER: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("dead_letter.lua")));

/// Field-value pairs above which an entry does not go through a script: Lua unpacks a
/// script's arguments onto its C stack, which holds about 8,000 values.
pub(crate) const MAX_SCRIPT_FIELDS: usize = 3_000;

/// Copies `entry` to the dead-letter stream with `error` and `failed_at_ms`, and then
/// acknowledges it, the second only if the first succeeded: an entry is never acknowledged
/// without its dead letter (MULTI/EXEC would not do: it does not roll back, and runs the
/// XACK after a failed XADD). On one node, one script (dead_letter.lua). On a cluster the
/// two streams live in different slots, and an entry too large for a script's arguments
/// takes the same path: XADD, then XACK; a crash between them leaves the entry pending,
/// and its retry writes a second dead letter (duplicated, never lost).
pub async fn dead_letter(conn: &RedisConn, keys: &Keys, entry: &Entry, error: &str) -> Result<()> {
    let mut fields: Vec<(Vec<u8>, &[u8])> = Vec::with_capacity(entry.fields.len() + 2);
    for (k, v) in &entry.fields {
        // The janitor's own fields are written below; an original field of the same name
        // is kept under another name rather than silently overwritten.
        if k == b"error" || k == b"failed_at_ms" {
            fields.push(([b"original_".as_slice(), k].concat(), v));
        } else {
            fields.push((k.clone(), v));
        }
    }
    let now = crate::now_ms().to_string().into_bytes();
    fields.push((b"error".to_vec(), error.as_bytes()));
    fields.push((b"failed_at_ms".to_vec(), &now));
    if conn.is_cluster() || fields.len() > MAX_SCRIPT_FIELDS {
        let mut xadd = redis::cmd("XADD");
        xadd.arg(keys.dead_letters()).arg(ids::AUTO);
        for (k, v) in &fields {
            xadd.arg(k).arg(*v);
        }
        let _: String = xadd.query_async(&mut conn.clone()).await?;
        ack(conn, keys, &entry.id).await?;
        return Ok(());
    }
    let mut call = DEAD_LETTER.prepare_invoke();
    call.key(keys.events())
        .key(keys.dead_letters())
        .arg(GROUP)
        .arg(&entry.id);
    for (k, v) in &fields {
        call.arg(k).arg(*v);
    }
    let _: String = call.invoke_async(&mut conn.clone()).await?;
    Ok(())
}

/// Publishes one entry with the given fields; returns its id.
pub async fn publish(conn: &RedisConn, stream: &str, fields: &[(&[u8], &[u8])]) -> Result<String> {
    let mut xadd = redis::cmd("XADD");
    xadd.arg(stream).arg(ids::AUTO);
    for (k, v) in fields {
        xadd.arg(*k).arg(*v);
    }
    Ok(xadd.query_async(&mut conn.clone()).await?)
}

/// Publishes a `server.dead` payload on the events stream; returns the entry id.
pub async fn publish_event(conn: &RedisConn, keys: &Keys, payload: &[u8]) -> Result<String> {
    publish(
        conn,
        &keys.events(),
        &[
            (FIELD_TYPE.as_bytes(), crate::event::EVENT_TYPE.as_bytes()),
            (FIELD_PAYLOAD.as_bytes(), payload),
        ],
    )
    .await
}

/// Parses an XREADGROUP/XREAD reply (RESP2 arrays or RESP3 maps; nil on timeout).
pub fn parse_read_reply(reply: Value) -> Result<Vec<Entry>> {
    let streams = match reply {
        Value::Nil => return Ok(Vec::new()),
        Value::Array(streams) => streams
            .into_iter()
            .map(|s| match s {
                Value::Array(kv) => match <[Value; 2]>::try_from(kv) {
                    Ok([_, entries]) => Ok(entries),
                    Err(kv) => Err(protocol("stream", &Value::Array(kv))),
                },
                other => Err(protocol("stream", &other)),
            })
            .collect::<Result<Vec<_>>>()?,
        Value::Map(streams) => streams.into_iter().map(|(_, v)| v).collect(),
        other => return Err(protocol("XREADGROUP reply", &other)),
    };
    let mut entries = Vec::new();
    for stream in streams {
        match stream {
            Value::Array(items) => {
                for item in items {
                    if let Some(entry) = parse_entry(item)? {
                        entries.push(entry);
                    }
                }
            }
            Value::Nil => {}
            other => return Err(protocol("stream entries", &other)),
        }
    }
    Ok(entries)
}

/// Parses one `[id, [field, value, ...]]`; `None` for an entry deleted while pending
/// (its fields come back as nil).
pub fn parse_entry(item: Value) -> Result<Option<Entry>> {
    let Value::Array(pair) = item else {
        return Err(protocol("stream entry", &item));
    };
    let [id, fields] = <[Value; 2]>::try_from(pair)
        .map_err(|pair| Error::Protocol(format!("stream entry of {} items", pair.len())))?;
    let id = bytes(id)?;
    let id = String::from_utf8(id).map_err(|_| Error::Protocol("non-UTF-8 entry id".into()))?;
    let flat = match fields {
        Value::Nil => return Ok(None),
        Value::Array(flat) => flat,
        Value::Map(pairs) => pairs.into_iter().flat_map(|(k, v)| [k, v]).collect(),
        other => return Err(protocol("entry fields", &other)),
    };
    let mut fields = Vec::with_capacity(flat.len() / 2);
    let mut it = flat.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        fields.push((bytes(k)?, bytes(v)?));
    }
    Ok(Some(Entry { id, fields }))
}

fn bytes(v: Value) -> Result<Vec<u8>> {
    match v {
        Value::BulkString(b) => Ok(b),
        Value::SimpleString(s) => Ok(s.into_bytes()),
        Value::Int(i) => Ok(i.to_string().into_bytes()),
        other => Err(protocol("bulk string", &other)),
    }
}

fn protocol(what: &str, got: &Value) -> Error {
    Error::Protocol(format!("expected {what}, got {got:?}"))
}

/// What one XAUTOCLAIM round took over.
#[derive(Debug, Default)]
pub struct Claimed {
    /// Where the next round starts (`0-0` after a full pass over the pending list).
    pub next_cursor: String,
    /// Entries now ours, with their delivery count (this delivery included).
    pub entries: Vec<(Entry, u64)>,
    /// Pending ids whose entries had been deleted from the stream; Redis 7 drops them from
    /// the pending list itself, and they are only counted here.
    pub deleted: usize,
}

static AUTOCLAIM: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("autoclaim.lua")));

/// Takes over up to `count` entries idle for at least `min_idle_ms`, starting at `cursor`,
/// each with its delivery count, in one script (autoclaim.lua): the claim and the counts
/// cannot be separated by a failure, and each count is read by the entry's exact id.
pub async fn autoclaim(
    conn: &RedisConn,
    keys: &Keys,
    consumer: &str,
    min_idle_ms: u64,
    cursor: &str,
    count: usize,
) -> Result<Claimed> {
    let mut call = AUTOCLAIM.prepare_invoke();
    call.key(keys.events())
        .arg(GROUP)
        .arg(consumer)
        .arg(min_idle_ms)
        .arg(cursor)
        .arg(count);
    let reply: Autoclaimed = call.invoke_async(&mut conn.clone()).await?;
    let mut entries = Vec::with_capacity(reply.claimed.len());
    for (item, n) in reply.claimed.into_iter().zip(reply.counts) {
        // An entry deleted while pending may come back without fields (Redis 6.2):
        // skipped. Redis 7 leaves such entries out and lists their ids under `deleted`.
        if let Some(entry) = parse_entry(item)? {
            entries.push((entry, n.max(1) as u64));
        }
    }
    Ok(Claimed {
        next_cursor: reply.next_cursor,
        entries,
        deleted: reply.deleted,
    })
}

/// autoclaim.lua's reply: {next cursor, entries claimed, ids deleted while pending, the
/// delivery count of each entry claimed}.
struct Autoclaimed {
    next_cursor: String,
    /// The entries as XAUTOCLAIM gave them (parsed by [`parse_entry`]).
    claimed: Vec<Value>,
    deleted: usize,
    counts: Vec<i64>,
}

impl redis::FromRedisValue for Autoclaimed {
    fn from_redis_value(v: Value) -> std::result::Result<Self, redis::ParsingError> {
        let mut f = crate::reply::Fields::new("autoclaim.lua", v, 4)?;
        let next_cursor = f.next("next cursor")?;
        let claimed = match f.value() {
            Value::Array(items) => items,
            other => return Err(crate::reply::malformed(f.script(), "entries", &other)),
        };
        let deleted = match f.value() {
            Value::Array(ids) => ids.len(),
            _ => 0,
        };
        let counts: Vec<i64> = f.next("delivery counts")?;
        if claimed.len() != counts.len() {
            return Err(format!(
                "autoclaim.lua: {} entries but {} counts",
                claimed.len(),
                counts.len()
            )
            .into());
        }
        Ok(Autoclaimed {
            next_cursor,
            claimed,
            deleted,
            counts,
        })
    }
}
