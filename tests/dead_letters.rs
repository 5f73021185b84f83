//! `registry-janitor dead-letters list|replay|purge`, as an operator uses it.

mod common;

use std::process::Command;

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
    stream::publish(
        &f.conn,
        &f.keys.events(),
        &[(b"type", b"server.dead"), (b"payload", b"\x00junk")],
    )
    .await
    .unwrap();
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
