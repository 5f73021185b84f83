//! `registry-janitor dead-letters list|replay|purge`, as an operator uses it.

mod common;

use std::{process::Command, time::Duration};

use common::*;
use registry_janitor::{config::Layout, event::ServerDead, stream};

fn run(cmd: &mut Command) -> (bool, String, String) {
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_replay_and_purge_dead_letters() {
    let f = Fixture::with(Layout::Hash, |s| s.max_payload_bytes = 100);
    let s = server("gw-big#1");
    f.seed(&s, 50).await;
    // Two events the worker refuses: one too large for max_payload_bytes=100, one garbage.
    let mut big = ServerDead::new(&s, Some("r".repeat(200)), None);
    big.source = Some("monitoring".into());
    stream::publish_event(&f.conn, &f.keys, &big.encode())
        .await
        .unwrap();
    f.publish_junk().await;
    let worker = spawn_worker(&f.settings);
    f.wait_idle().await;
    worker.stop().await;

    let (ok, out, err) = run(janitor(&f.settings).args(["dead-letters", "list", "--json"]));
    assert!(ok, "{err}");
    let letters: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(letters.len(), 2);
    let big_letter = letters
        .iter()
        .find(|l| l["server_id"] == "gw-big#1")
        .unwrap();
    assert!(big_letter["error"]
        .as_str()
        .unwrap()
        .contains("limit of 100"));
    assert_eq!(big_letter["kind"], "server.dead");
    let (ok, text, _) = run(janitor(&f.settings).args(["dead-letters", "list"]));
    assert!(
        ok && text.contains("2 dead letter(s) shown") && text.contains("limit of 100"),
        "{text}"
    );

    // Purge refuses without confirmation, and deletes nothing.
    let (ok, _, err) = run(janitor(&f.settings).args(["dead-letters", "purge", "--all"]));
    assert!(!ok && err.contains("--yes"), "{err}");
    assert_eq!(f.dead_letters().await.len(), 2);

    // After the fix (a bigger limit), the big one is replayed and cleaned.
    let id = big_letter["id"].as_str().unwrap();
    let (ok, out, err) = run(janitor(&f.settings).args(["dead-letters", "replay", id]));
    assert!(ok, "{err}");
    assert!(out.starts_with(&format!("{id} -> ")), "{out}");
    let remaining = f.dead_letters().await;
    assert_eq!(
        remaining.len(),
        1,
        "the replayed letter left the dead-letter stream"
    );
    let events = read_stream(&f.conn, &f.keys.events()).await;
    let replayed = events.last().unwrap();
    assert_eq!(
        replayed.fields.len(),
        2,
        "only the original fields: {:?}",
        replayed.fields
    );
    assert_eq!(replayed.field("payload"), Some(big.encode().as_slice()));
    let mut fixed = f.settings.clone();
    fixed.max_payload_bytes = 65536;
    let worker = spawn_worker(&fixed);
    f.wait_idle().await;
    assert_eq!(
        f.still_pointing(&s, 50).await,
        0,
        "the replayed event cleaned its server"
    );
    worker.stop().await;

    let (ok, out, err) =
        run(janitor(&f.settings).args(["dead-letters", "purge", "--all", "--yes"]));
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "1 dead letter(s) purged");
    assert!(f.dead_letters().await.is_empty());
}

#[test]
fn original_fields_named_like_the_janitors_are_restored() {
    use registry_janitor::{dead_letters::original_fields, event::Entry};
    let dead = Entry {
        id: "1-0".into(),
        fields: vec![
            (b"type".to_vec(), b"x".to_vec()),
            (b"original_error".to_vec(), b"theirs".to_vec()),
            (b"error".to_vec(), b"ours".to_vec()),
            (b"failed_at_ms".to_vec(), b"1".to_vec()),
        ],
    };
    assert_eq!(
        original_fields(&dead),
        vec![
            (b"type".to_vec(), b"x".to_vec()),
            (b"error".to_vec(), b"theirs".to_vec())
        ]
    );
}

/// A dead letter that cannot be written (the dead-letter key holds a String, so XADD fails
/// with WRONGTYPE) does not acknowledge its entry: it stays pending, is retried, and is
/// dead-lettered and acknowledged once the key is fixed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_is_acknowledged_only_once_its_dead_letter_is_written() {
    let f = Fixture::new(Layout::Hash);
    let _: () = f
        .query(
            redis::cmd("SET")
                .arg(f.keys.dead_letters())
                .arg("not a stream"),
        )
        .await;
    stream::ensure_group(&f.conn, &f.keys).await.unwrap();
    let id = f.publish_junk().await;
    let worker = spawn_worker(&f.settings);
    // Delivered, then taken over again after its dead letter failed (or, wrongly,
    // acknowledged without one; or the worker stopped on the error).
    wait_until(
        &f.redis,
        "a second delivery, an acknowledgement, or the worker stopped",
        Duration::from_secs(30),
        || async {
            let settled = pending_row(&f.conn, &f.keys, &id)
                .await
                .is_none_or(|(_, n)| n >= 2);
            worker.handle.is_finished() || (delivered(&f, &id).await && settled)
        },
    )
    .await;
    assert!(
        pending_row(&f.conn, &f.keys, &id).await.is_some(),
        "the entry was acknowledged although its dead letter could not be written"
    );
    let kind: String = f.query(redis::cmd("TYPE").arg(f.keys.dead_letters())).await;
    assert_eq!(kind, "string", "no dead letter was written anywhere");
    worker.stop.cancel();
    let _ = worker.handle.await;

    // The key fixed, the next takeover dead-letters and acknowledges it.
    let _: () = f.query(redis::cmd("DEL").arg(f.keys.dead_letters())).await;
    let worker = spawn_worker(&f.settings);
    f.wait_idle().await;
    assert_eq!(pending_row(&f.conn, &f.keys, &id).await, None);
    let letters = f.dead_letters().await;
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].field("payload"), Some(JUNK_PAYLOAD));
    worker.stop().await;
}

/// True once the group has delivered entry `id` (status cannot tell while the
/// dead-letter key has the wrong type).
async fn delivered(f: &Fixture, id: &str) -> bool {
    let groups: Vec<std::collections::HashMap<String, redis::Value>> = f
        .query(redis::cmd("XINFO").arg("GROUPS").arg(f.keys.events()))
        .await;
    groups.iter().any(|g| {
        matches!(g.get("last-delivered-id"), Some(redis::Value::BulkString(d)) if d == id.as_bytes())
    })
}

/// A replay whose XADD to the events stream fails (the stream has used up its last
/// possible id, so `XADD *` is refused at run time) keeps its dead letter; once the
/// stream is fixed, the replay publishes it and only then deletes the dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_is_removed_only_once_its_replay_is_written() {
    use registry_janitor::dead_letters;
    let f = Fixture::new(Layout::Hash);
    f.publish_junk().await;
    let worker = spawn_worker(&f.settings);
    f.wait_idle().await;
    worker.stop().await;
    let letters = f.dead_letters().await;
    assert_eq!(letters.len(), 1);
    let dead_id = letters[0].id.clone();
    let events_before = read_stream(&f.conn, &f.keys.events()).await;
    let last = events_before.last().unwrap().id.clone();

    let _: () = f
        .query(
            redis::cmd("XSETID")
                .arg(f.keys.events())
                .arg("18446744073709551615-18446744073709551615"),
        )
        .await;
    let refused = dead_letters::replay(&f.conn, &f.keys, std::slice::from_ref(&dead_id)).await;
    assert!(refused.is_err(), "{refused:?}");
    assert_eq!(
        f.dead_letters().await.len(),
        1,
        "the dead letter was deleted although its replay was not written"
    );
    assert_eq!(read_stream(&f.conn, &f.keys.events()).await, events_before);

    let _: () = f
        .query(redis::cmd("XSETID").arg(f.keys.events()).arg(&last))
        .await;
    let replayed = dead_letters::replay(&f.conn, &f.keys, std::slice::from_ref(&dead_id))
        .await
        .unwrap();
    assert_eq!(replayed.len(), 1);
    assert!(f.dead_letters().await.is_empty());
    let events = read_stream(&f.conn, &f.keys.events()).await;
    assert_eq!(events.len(), events_before.len() + 1);
    assert_eq!(events.last().unwrap().field("payload"), Some(JUNK_PAYLOAD));
}

/// `purge --all` on a dead-letter key that is not a stream fails and deletes nothing
/// (XLEN fails; a MULTI would still have run the DEL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_all_deletes_nothing_when_the_key_is_not_a_stream() {
    use registry_janitor::dead_letters;
    let f = Fixture::new(Layout::Hash);
    let _: () = f
        .query(redis::cmd("SET").arg(f.keys.dead_letters()).arg("not ours"))
        .await;
    let refused = dead_letters::purge(&f.conn, &f.keys, &[]).await;
    assert!(refused.is_err(), "{refused:?}");
    let kept: Option<String> = f.query(redis::cmd("GET").arg(f.keys.dead_letters())).await;
    assert_eq!(kept.as_deref(), Some("not ours"));
}

/// An entry with more fields than a script can take as arguments (Lua unpacks them onto a
/// stack of about 8,000 values) is still dead-lettered, whole, and acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_with_thousands_of_fields_is_dead_lettered_whole() {
    let f = Fixture::new(Layout::Hash);
    let fields: Vec<(Vec<u8>, Vec<u8>)> = (0..5_000)
        .map(|i| (format!("f{i}").into_bytes(), b"x".to_vec()))
        .collect();
    let borrowed: Vec<(&[u8], &[u8])> = fields
        .iter()
        .map(|(k, v)| (k.as_slice(), v.as_slice()))
        .collect();
    stream::publish(&f.conn, &f.keys.events(), &borrowed)
        .await
        .unwrap();
    let worker = spawn_worker(&f.settings);
    f.wait_idle().await;
    worker.stop().await;
    let letters = f.dead_letters().await;
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].fields.len(), 5_000 + 2);
    assert!(String::from_utf8_lossy(letters[0].field("error").unwrap()).contains("`type`"));
}
