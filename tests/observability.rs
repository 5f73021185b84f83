//! What an on-call engineer watches: a worker process's /metrics, /healthz and /readyz.

mod common;

use std::time::Duration;

use common::*;
use registry_janitor::config::Layout;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_move_as_a_worker_process_cleans() {
    let mut f = Fixture::new(Layout::Hash);
    let addr = free_addr();
    f.settings.metrics_addr = addr.clone();
    let (dead, live) = (server("gw-dead#1"), server("gw-live#1"));
    f.seed(&dead, 3_000).await;
    f.seed(&live, 10).await;
    f.reconnect(&user(&dead, 0), &live).await;
    let worker = WorkerProcess::start(&f.settings);

    wait_until(
        &f.redis,
        "/readyz answers 200",
        Duration::from_secs(20),
        || async { http_get(&addr, "/readyz").0 == 200 },
    )
    .await;
    assert_eq!(http_get(&addr, "/healthz"), (200, "ok\n".into()));
    let (status, before) = http_get(&addr, "/metrics");
    assert_eq!(status, 200);
    assert_eq!(
        sample(
            &before,
            r#"registry_janitor_events_total{outcome="cleaned"}"#
        ),
        Some(0.0)
    );
    assert_eq!(
        sample(&before, "registry_janitor_entries_deleted_total"),
        Some(0.0)
    );

    f.kill(&dead).await;
    f.kill(&server("gw-nobody#1")).await;
    f.query::<String>(
        redis::cmd("XADD")
            .arg(f.keys.events())
            .arg("*")
            .arg("type")
            .arg("server.dead")
            .arg("payload")
            .arg("junk"),
    )
    .await;
    f.wait_idle().await;
    let mut after = String::new();
    wait_until(
        &f.redis,
        "the counters to move",
        Duration::from_secs(10),
        || {
            after = http_get(&addr, "/metrics").1;
            let done = sample(
                &after,
                r#"registry_janitor_events_total{outcome="cleaned"}"#,
            ) == Some(2.0)
                && sample(&after, "registry_janitor_dead_letters") == Some(1.0);
            async move { done }
        },
    )
    .await;
    assert_eq!(
        sample(
            &after,
            r#"registry_janitor_events_total{outcome="dead_lettered"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(&after, "registry_janitor_entries_deleted_total"),
        Some(2_999.0)
    );
    assert_eq!(
        sample(&after, "registry_janitor_entries_kept_total"),
        Some(1.0)
    );
    assert_eq!(
        sample(&after, "registry_janitor_cleanup_duration_seconds_count"),
        Some(2.0)
    );
    assert_eq!(
        sample(&after, "registry_janitor_stale_window_seconds_count"),
        Some(2.0)
    );
    assert_eq!(sample(&after, "registry_janitor_stream_pending"), Some(0.0));
    // Bounded label sets: no label carries a server or a user id.
    assert!(
        !after.contains("gw-dead"),
        "a server id leaked into a label"
    );

    assert_eq!(http_get(&addr, "/").0, 404);
    assert_eq!(http_get(&addr, "/debug/pprof").0, 404);

    // Redis goes away: not ready, but still alive (the loop keeps turning while it retries).
    f.redis.kill();
    wait_until(
        &f.redis,
        "/readyz to fail",
        Duration::from_secs(20),
        || async { http_get(&addr, "/readyz").0 == 503 },
    )
    .await;
    assert_eq!(http_get(&addr, "/healthz").0, 200);
    let errors = sample(
        &http_get(&addr, "/metrics").1,
        "registry_janitor_redis_errors_total",
    )
    .unwrap();
    f.redis.restart().unwrap();
    wait_until(
        &f.redis,
        "/readyz to recover",
        Duration::from_secs(30),
        || async { http_get(&addr, "/readyz").0 == 200 },
    )
    .await;
    assert!(errors >= 1.0, "the outage counted as redis errors");

    worker.signal("TERM");
    let (status, log) = worker.wait(Duration::from_secs(10));
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
}

#[test]
fn a_busy_metrics_port_does_not_stop_the_worker() {
    let redis = redis();
    let mut settings = settings(&redis, Layout::Hash);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    settings.metrics_addr = taken.local_addr().unwrap().to_string();
    let mut worker = WorkerProcess::start(&settings);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(worker.is_running(), "{}", worker.log());
    assert!(
        worker.log().contains("cannot serve metrics_addr"),
        "{}",
        worker.log()
    );
}

/// JSON logs on request: one JSON object per line, a span per event with its ids, and the
/// Redis password nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_carry_event_ids_and_never_the_password() {
    let redis = redis_with(&["--requirepass", "s3cret-pw"]);
    let f = Fixture::on(redis, Layout::Hash, |s| {
        s.redis_url = s.redis_url.replace("redis://", "redis://:s3cret-pw@");
    });
    let dead = server("gw-json#1");
    f.seed(&dead, 100).await;
    let id = f.kill(&dead).await;
    let worker = WorkerProcess::start_with(&f.settings, &[("JANITOR_LOG_FORMAT", "json")]);
    f.wait_idle().await;
    worker.signal("TERM");
    let (status, log) = worker.wait(Duration::from_secs(10));
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert!(
        !log.contains("s3cret-pw"),
        "the password leaked into the logs:\n{log}"
    );
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let started = lines
        .iter()
        .find(|l| l["fields"]["message"] == "worker starting")
        .unwrap();
    assert!(started["fields"]["redis"].as_str().unwrap().contains("***"));
    let cleaned = lines
        .iter()
        .find(|l| l["fields"]["message"] == "server cleaned")
        .unwrap();
    assert_eq!(cleaned["span"]["server_id"], "gw-json#1");
    assert_eq!(cleaned["span"]["entry"], id.as_str());
    assert!(
        cleaned["span"]["event_id"]
            .as_str()
            .is_some_and(|e| e.len() == 26),
        "a ULID event id"
    );
    assert_eq!(cleaned["fields"]["deleted"], 100);
}
