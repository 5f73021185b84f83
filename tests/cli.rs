//! The `registry-janitor` binary as operators and other systems use it: real processes,
//! configured through `JANITOR_*` variables only, against a real redis-server.

mod common;

use std::{
    process::{Command, Stdio},
    time::Duration,
};

use common::*;
use registry_janitor::{
    config::Layout,
    event::{ServerDead, ServerId},
    status,
};

fn run(cmd: &mut Command) -> (i32, String, String) {
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_wrong_setting_stops_startup_naming_the_setting() {
    let redis = redis();
    let settings = settings(&redis, Layout::Hash);
    let cases: &[(&str, &str, &str)] = &[
        ("JANITOR_CHUNK_SIZE", "0", "chunk_size"),
        ("JANITOR_CHUNK_SIZE", "lots", "chunk_size"),
        ("JANITOR_LAYOUT", "columns", "layout"),
        ("JANITOR_REDIS_URL", "http://example", "redis_url"),
        ("JANITOR_CONCURRENCY", "0", "concurrency"),
        ("JANITOR_METRICS_ADDR", "everywhere", "metrics_addr"),
        ("JANITOR_CONFIG", "/nonexistent/janitor.toml", "config"),
    ];
    for (var, value, name) in cases {
        let (code, _, stderr) = run(janitor(&settings).env(var, value).arg("worker"));
        assert_ne!(code, 0, "{var}={value} was accepted");
        assert!(
            stderr.contains(name),
            "{var}={value}: {stderr:?} does not name `{name}`"
        );
        assert_eq!(
            stderr.trim().lines().count(),
            1,
            "one-line error expected: {stderr:?}"
        );
    }
    // A flag beats the environment, and is checked the same way.
    let (code, _, stderr) = run(janitor(&settings).args(["--chunk-size", "0", "worker"]));
    assert_ne!(code, 0);
    assert!(stderr.contains("chunk_size"), "{stderr}");
}

#[test]
fn settings_come_from_file_then_env_then_flags() {
    let redis = redis();
    let settings = settings(&redis, Layout::Hash);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("janitor.toml");
    std::fs::write(
        &file,
        format!(
            "key_prefix = \"from-file:\"\nredis_url = \"{}\"\n",
            redis.url()
        ),
    )
    .unwrap();
    let prefix_used = |env_prefix: Option<&str>, flag: Option<&str>| {
        let mut cmd = janitor(&settings);
        cmd.env_remove("JANITOR_KEY_PREFIX")
            .env("JANITOR_CONFIG", &file);
        if let Some(p) = env_prefix {
            cmd.env("JANITOR_KEY_PREFIX", p);
        }
        if let Some(p) = flag {
            cmd.args(["--key-prefix", p]);
        }
        let (code, out, err) = run(cmd.args(["status", "--json"]));
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v["stream"]
            .as_str()
            .unwrap()
            .trim_end_matches("registry:events")
            .to_owned()
    };
    assert_eq!(prefix_used(None, None), "from-file:");
    assert_eq!(prefix_used(Some("from-env:"), None), "from-env:");
    assert_eq!(
        prefix_used(Some("from-env:"), Some("from-flag:")),
        "from-flag:"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emit_publishes_an_event_and_prints_its_id() {
    let f = Fixture::new(Layout::Hash);
    let (code, stdout, stderr) = run(janitor(&f.settings).args([
        "emit",
        "server-dead",
        "gw-9#1732181000123",
        "--reason",
        "heartbeat timeout",
    ]));
    assert_eq!(code, 0, "{stderr}");
    let id = stdout.trim();
    let (ms, seq) = id
        .split_once('-')
        .expect("an entry id like 1732181000123-0");
    assert!(
        ms.parse::<u64>().is_ok() && seq.parse::<u64>().is_ok(),
        "{id}"
    );

    let entries = read_stream(&f.conn, &f.keys.events()).await;
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].id, id);
    assert_eq!(entries[0].fields.len(), 2, "exactly `type` and `payload`");
    assert_eq!(entries[0].field("type"), Some(&b"server.dead"[..]));
    let (event, server) = ServerDead::decode(entries[0].field("payload").unwrap(), 65536).unwrap();
    assert_eq!(server.as_str(), "gw-9#1732181000123");
    assert_eq!(event.reason.as_deref(), Some("heartbeat timeout"));
    assert_eq!(event.v, 1);

    let (code, _, stderr) = run(janitor(&f.settings).args(["emit", "server-dead", "bad{id}"]));
    assert_ne!(code, 0);
    assert!(stderr.contains("SERVER_ID"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_and_sigint_stop_a_worker_cleanly() {
    let f = Fixture::new(Layout::Hash);
    for sig in ["TERM", "INT"] {
        let worker = WorkerProcess::start(&f.settings);
        wait_until(
            &f.redis,
            "the worker joined the group",
            Duration::from_secs(20),
            || async {
                status::collect_from(&f.conn, &f.keys)
                    .await
                    .is_ok_and(|s| s.consumers.len() == usize::from(sig == "INT") + 1)
            },
        )
        .await;
        worker.signal(sig);
        let (status, log) = worker.wait(Duration::from_secs(10));
        assert_eq!(
            status.and_then(|s| s.code()),
            Some(0),
            "SIG{sig}: exit status; log:\n{log}"
        );
        assert!(log.contains(&format!("SIG{sig} received")), "{log}");
    }
}

/// The acceptance check of the core: a producer that knows only the contract (raw XADD
/// of a MessagePack map built by hand), several worker processes configured only through
/// `JANITOR_*`, 120,000 users on dead servers, users reconnecting elsewhere meanwhile,
/// malformed entries among the events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_processes_clean_many_dead_servers_while_users_reconnect() {
    let f = Fixture::with(Layout::Hash, |s| s.chunk_size = 1000);
    const USERS: usize = 30_000;
    let dead: Vec<ServerId> = (0..4)
        .map(|i| server(&format!("gw-{i}#1700000000000")))
        .collect();
    let live = server("gw-live#1700000000001");
    for s in dead.iter().chain([&live]) {
        f.seed(s, USERS).await;
    }

    let workers: Vec<_> = (0..3).map(|_| WorkerProcess::start(&f.settings)).collect();
    let hand_made = |server: &ServerId, n: u64| {
        use rmpv::Value as V;
        let map = V::Map(vec![
            (V::from("server_id"), V::from(server.as_str())),
            (V::from("detected_at_ms"), V::from(1_700_000_000_000u64 + n)),
            (V::from("event_id"), V::from(format!("01HANDMADE{n:016}"))),
            (V::from("v"), V::from(1)),
            (V::from("source"), V::from("monitoring")),
            (V::from("trace_id"), V::from("extra keys are ignored")),
        ]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &map).unwrap();
        bytes
    };
    let xadd = |fields: Vec<(&'static str, Vec<u8>)>| {
        let conn = f.conn.clone();
        let stream = f.keys.events();
        async move {
            let mut cmd = redis::cmd("XADD");
            cmd.arg(stream).arg("*");
            for (k, v) in fields {
                cmd.arg(k).arg(v);
            }
            let _: String = cmd.query_async(&mut conn.clone()).await.unwrap();
        }
    };
    let malformed = [
        b"\xc1garbage".to_vec(),
        b"\x81\xa9server_id\xa4gw-1".to_vec(), // a map with only server_id
    ];
    for (n, s) in dead.iter().enumerate() {
        xadd(vec![
            ("type", b"server.dead".to_vec()),
            ("payload", hand_made(s, n as u64)),
        ])
        .await;
        xadd(vec![
            ("type", b"server.dead".to_vec()),
            ("payload", malformed[n % 2].clone()),
        ])
        .await;
        xadd(vec![
            ("type", b"user.joined".to_vec()),
            ("payload", b"\x80".to_vec()),
        ])
        .await;
    }
    // Users reconnect to the live server while the workers clean.
    let mut moved = Vec::new();
    for (i, s) in dead.iter().enumerate() {
        for n in (i..USERS).step_by(97) {
            f.reconnect(&user(s, n), &live).await;
            moved.push((s.clone(), n));
        }
    }
    wait_until(
        &f.redis,
        "every event acknowledged",
        Duration::from_secs(120),
        || async {
            status::collect_from(&f.conn, &f.keys)
                .await
                .is_ok_and(|s| s.is_idle() && s.stream_length == 12)
        },
    )
    .await;

    let mut stale = 0;
    for s in &dead {
        stale += f.still_pointing(s, USERS).await;
    }
    assert_eq!(stale, 0, "stale entries left");
    assert_eq!(
        f.still_pointing(&live, USERS).await,
        USERS,
        "live entries lost"
    );
    for (s, n) in &moved {
        assert_eq!(f.owner(&user(s, *n)).await.as_deref(), Some(live.as_str()));
    }
    let dead_letters = f.dead_letters().await;
    assert_eq!(
        dead_letters.len(),
        dead.len(),
        "every malformed entry dead-lettered"
    );
    assert!(dead_letters
        .iter()
        .all(|d| d.field("error").is_some_and(|e| !e.is_empty())));
    let status = status::collect_from(&f.conn, &f.keys).await.unwrap();
    assert_eq!(status.pending, 0);
    assert_eq!(status.consumers.len(), 3, "three distinct consumers joined");
    for w in workers {
        w.signal("TERM");
        let (code, log) = w.wait(Duration::from_secs(10));
        assert_eq!(code.and_then(|c| c.code()), Some(0), "{log}");
    }
}

/// Text logs that go to a file or a pipe (as under Kubernetes) carry no terminal colour
/// codes; the log collector would store them as text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_logs_to_a_file_have_no_colour_codes() {
    let f = Fixture::new(Layout::Hash);
    let worker = WorkerProcess::start(&f.settings);
    wait_until(
        &f.redis,
        "the worker's first log line",
        Duration::from_secs(30),
        || async { worker.log().contains("worker starting") },
    )
    .await;
    let log = worker.log();
    assert!(
        !log.contains('\u{1b}'),
        "colour codes in a log file:\n{log}"
    );
}

/// A Redis that renames EVAL and EVALSHA (as some managed services and proxies can): the
/// worker and the reconciler stop at start-up saying that they need Lua scripts, rather
/// than dead-lettering every event later. The events stay in the stream for a worker on a Redis that can.
#[test]
fn a_redis_without_lua_scripts_stops_the_worker_at_start_up() {
    let redis = redis_with(&[
        "--rename-command",
        "EVAL",
        "EVAL_renamed_by_the_test",
        "--rename-command",
        "EVALSHA",
        "EVALSHA_renamed_by_the_test",
    ]);
    let settings = settings(&redis, Layout::Hash);
    for command in ["worker", "reconcile"] {
        let (code, _, stderr) = run(janitor(&settings).arg(command));
        assert_ne!(code, 0, "{command} ran without Lua scripts: {stderr}");
        assert!(
            stderr.contains("refuses Lua scripts"),
            "{command}: {stderr}"
        );
    }
}
