//! The Alertmanager webhook receiver, `registry-janitor alert-receiver`, as real processes
//! against a real redis-server, posted to over real HTTP(S):
//! - firing alerts publish one `server.dead` each, with the alert's fields; a batch sent
//!   again, to a restarted receiver, or to two receivers at once publishes nothing more;
//!   resolved alerts publish nothing;
//! - what is refused and how: a wrong token (401), a body over the limit (413), bad JSON,
//!   another version, another content type (400), alerts without a usable server (422,
//!   the rest of the batch published), Redis away (503, then published when it is back);
//! - TLS with a generated certificate; start-up refusing a missing token file; SIGTERM
//!   letting a request in flight finish with its answer;
//! - on a local Redis Cluster: two receivers, each alert once, its record in the stream's
//!   slot (skipped only when this redis-server cannot run a cluster);
//! - a real Alertmanager delivering to it (with its re-sends and resolved notifications),
//!   and the whole chain: a real Prometheus sees a connection server's exporter go away,
//!   its rule fires, Alertmanager notifies the receiver, a worker cleans the registry.
//!
//! The last two need `prometheus-alertmanager` and `prometheus` (Debian's packages;
//! `bash .ci/ensure-prometheus` installs both). Without them they are skipped with a
//! message, unless `CI` is set: then they fail.

mod common;

use std::{
    io::{Read, Write},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use common::{monitoring::*, *};
use registry_janitor::{
    config::{Layout, Settings},
    event::{classify, Classified, ServerDead},
};
use serde_json::{json, Value};

const TOKEN: &str = "s3cret-t0ken-for-the-tests";

/// A bearer token in a file of its own.
fn token_file(dir: &Path, token: &str) -> PathBuf {
    let path = dir.join("token");
    std::fs::write(&path, format!("{token}\n")).unwrap();
    path
}

/// An `alert-receiver` process with its listener and its metrics on free ports.
struct Receiver {
    process: WorkerProcess,
    addr: String,
    metrics: String,
}

impl Receiver {
    /// Starts one with the token in `token` and the extra `JANITOR_*` variables `env`;
    /// waits until it answers /readyz.
    fn start(settings: &Settings, token: &Path, env: &[(&str, &str)]) -> Self {
        let (addr, metrics) = (free_addr(), free_addr());
        let token = token.display().to_string();
        let mut all = vec![
            ("JANITOR_ALERT_RECEIVER_ADDR", addr.as_str()),
            ("JANITOR_ALERT_RECEIVER_TOKEN_FILE", token.as_str()),
            ("JANITOR_METRICS_ADDR", metrics.as_str()),
        ];
        all.extend_from_slice(env);
        let mut process = WorkerProcess::start_command(settings, &all, &["alert-receiver"]);
        let deadline = Instant::now() + Duration::from_secs(60);
        while http_get(&metrics, "/readyz").0 != 200 {
            assert!(
                process.is_running(),
                "the receiver exited:\n{}",
                process.log()
            );
            assert!(
                Instant::now() < deadline,
                "the receiver never became ready:\n{}",
                process.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Receiver {
            process,
            addr,
            metrics,
        }
    }

    /// POSTs `body` to /alerts as Alertmanager does (JSON, the bearer token).
    fn post(&self, body: &str) -> (u16, Value) {
        self.post_with(&[("Authorization", &format!("Bearer {TOKEN}"))], body)
    }

    /// POSTs `body` to /alerts with `headers` (JSON unless they say otherwise); the
    /// answer's JSON body.
    fn post_with(&self, headers: &[(&str, &str)], body: &str) -> (u16, Value) {
        let mut all = headers.to_vec();
        if !headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        {
            all.push(("Content-Type", "application/json"));
        }
        let (status, text) = http_post(&self.addr, "/alerts", &all, body.as_bytes());
        let value = serde_json::from_str(&text).unwrap_or_else(|e| {
            panic!(
                "HTTP {status}: not JSON ({e}): {text:?}\n--- receiver log ---\n{}",
                self.process.log()
            )
        });
        (status, value)
    }

    /// The value of one series of the receiver's /metrics (0 when absent).
    fn metric(&self, series: &str) -> f64 {
        sample(&http_get(&self.metrics, "/metrics").1, series).unwrap_or(0.0)
    }

    fn alerts(&self, outcome: &str) -> f64 {
        self.metric(&format!(
            "registry_janitor_receiver_alerts_total{{outcome=\"{outcome}\"}}"
        ))
    }

    /// SIGTERM; asserts a clean exit within 30 s.
    fn stop(self) {
        self.process.signal("TERM");
        let (status, log) = self.process.wait(Duration::from_secs(30));
        assert!(status.is_some_and(|s| s.success()), "{status:?}\n{log}");
    }
}

/// One alert as Alertmanager sends it in a webhook.
fn alert(status: &str, labels: Value, annotations: Value, fingerprint: &str, starts: u64) -> Value {
    json!({
        "status": status,
        "labels": labels,
        "annotations": annotations,
        "startsAt": rfc3339(starts),
        "endsAt": if status == "resolved" { rfc3339(starts + 60_000) } else { "0001-01-01T00:00:00Z".into() },
        "generatorURL": "http://prometheus.example/graph",
        "fingerprint": fingerprint,
    })
}

/// A webhook (version 4) carrying `alerts`.
fn webhook(alerts: Vec<Value>) -> String {
    json!({
        "version": "4",
        "groupKey": "{}:{alertname=\"ConnectionServerDown\"}",
        "truncatedAlerts": 0,
        "status": "firing",
        "receiver": "registry-janitor",
        "groupLabels": {"alertname": "ConnectionServerDown"},
        "commonLabels": {},
        "commonAnnotations": {},
        "externalURL": "http://alertmanager.example",
        "alerts": alerts,
    })
    .to_string()
}

/// Every `server.dead` of the events stream, decoded by the crate's own decoder.
async fn events(f: &Fixture) -> Vec<ServerDead> {
    events_of(&f.conn, &f.keys).await
}

async fn events_of(
    conn: &registry_janitor::conn::RedisConn,
    keys: &registry_janitor::keys::Keys,
) -> Vec<ServerDead> {
    read_stream(conn, &keys.events())
        .await
        .iter()
        .map(|entry| match classify(entry, 65536) {
            Classified::ServerDead(event, _) => event,
            other => panic!("entry {} is not a valid server.dead: {other:?}", entry.id),
        })
        .collect()
}

const T0: u64 = 1_732_181_000_123;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn firing_alerts_publish_one_event_each_once_across_resends_and_restarts() {
    let f = Fixture::new(Layout::Hash);
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(dir.path(), TOKEN);
    let receiver = Receiver::start(&f.settings, &token, &[]);
    let long_summary = "é".repeat(200);
    let batch = webhook(vec![
        alert(
            "firing",
            json!({"alertname": "ConnectionServerDown", "server_id": "gw-a#1"}),
            json!({"summary": "gw-a#1 is down", "description": "no scrape for 1m"}),
            "aaaa000000000001",
            T0,
        ),
        alert(
            "firing",
            json!({"alertname": "ConnectionServerDown", "server_id": "gw-b#1"}),
            json!({"summary": long_summary}),
            "bbbb000000000002",
            T0 + 5,
        ),
        alert(
            "firing",
            json!({"alertname": "ConnectionServerDown", "server_id": "gw-c#1"}),
            json!({}),
            "cccc000000000003",
            T0 + 7,
        ),
        alert(
            "resolved",
            json!({"alertname": "ConnectionServerDown", "server_id": "gw-d#1"}),
            json!({}),
            "dddd000000000004",
            T0,
        ),
    ]);

    let (status, answer) = receiver.post(&batch);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        answer,
        json!({"published": 3, "duplicate": 0, "resolved": 1, "refused": []})
    );
    let published = events(&f).await;
    let by_server = |s: &str| {
        published
            .iter()
            .find(|e| e.server_id == s)
            .unwrap_or_else(|| panic!("no event for {s}: {published:?}"))
    };
    assert_eq!(published.len(), 3, "{published:?}");
    let a = by_server("gw-a#1");
    assert_eq!(a.v, 1);
    assert_eq!(a.detected_at_ms, T0);
    assert_eq!(a.reason.as_deref(), Some("gw-a#1 is down"));
    assert_eq!(a.source.as_deref(), Some("alertmanager"));
    assert_eq!(a.event_id, format!("alertmanager:aaaa000000000001:{T0}"));
    let b = by_server("gw-b#1");
    assert_eq!(b.detected_at_ms, T0 + 5);
    // 200 two-byte characters cut to the contract's 256 bytes, on a character boundary.
    assert_eq!(b.reason.as_deref(), Some("é".repeat(128).as_str()));
    let c = by_server("gw-c#1");
    assert_eq!(c.reason.as_deref(), Some("ConnectionServerDown"));
    assert!(
        !published.iter().any(|e| e.server_id == "gw-d#1"),
        "a resolved alert was published"
    );

    // Alertmanager sends the batch again (group interval): nothing more is published.
    let (status, answer) = receiver.post(&batch);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        answer,
        json!({"published": 0, "duplicate": 3, "resolved": 1, "refused": []})
    );
    assert_eq!(events(&f).await, published);
    assert_eq!(receiver.alerts("published"), 3.0);
    assert_eq!(receiver.alerts("duplicate"), 3.0);
    assert_eq!(receiver.alerts("resolved"), 2.0);
    assert_eq!(
        receiver.metric(r#"registry_janitor_receiver_requests_total{code="200"}"#),
        2.0
    );
    // The record of an alert lasts alert_receiver_dedup_ttl_ms (7 days by default).
    let ttl: i64 = f
        .query(redis::cmd("PTTL").arg(f.keys.alert_published(&format!("aaaa000000000001:{T0}"))))
        .await;
    assert!(
        (7 * 86_400_000 - 600_000..=7 * 86_400_000).contains(&ttl),
        "{ttl}"
    );

    // A receiver stopped (SIGTERM) and started again still knows the alerts.
    receiver.stop();
    let receiver = Receiver::start(&f.settings, &token, &[]);
    let (status, answer) = receiver.post(&batch);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["duplicate"], 3, "{answer}");
    assert_eq!(events(&f).await, published);

    // The same alert starting again later (a new firing) is a new event.
    let again = webhook(vec![alert(
        "firing",
        json!({"alertname": "ConnectionServerDown", "server_id": "gw-a#1"}),
        json!({}),
        "aaaa000000000001",
        T0 + 3_600_000,
    )]);
    let (status, answer) = receiver.post(&again);
    assert_eq!((status, answer["published"].clone()), (200, json!(1)));
    assert_eq!(events(&f).await.len(), 4);
    receiver.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_receivers_given_the_same_alerts_at_once_publish_each_once() {
    let f = Fixture::new(Layout::Hash);
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(dir.path(), TOKEN);
    let receivers = [
        Receiver::start(&f.settings, &token, &[]),
        Receiver::start(&f.settings, &token, &[]),
    ];
    let servers: Vec<String> = (0..12).map(|n| format!("gw-{n}#1")).collect();
    let batch = webhook(
        servers
            .iter()
            .enumerate()
            .map(|(n, s)| {
                alert(
                    "firing",
                    json!({"alertname": "ConnectionServerDown", "server_id": s}),
                    json!({}),
                    &format!("{n:016x}"),
                    T0 + n as u64,
                )
            })
            .collect(),
    );
    std::thread::scope(|scope| {
        for r in &receivers {
            for _ in 0..2 {
                let batch = &batch;
                scope.spawn(move || {
                    for _ in 0..3 {
                        let (status, answer) = r.post(batch);
                        assert_eq!(status, 200, "{answer}");
                    }
                });
            }
        }
    });
    let published = events(&f).await;
    let mut named: Vec<&str> = published.iter().map(|e| e.server_id.as_str()).collect();
    named.sort_unstable();
    let mut expected: Vec<&str> = servers.iter().map(String::as_str).collect();
    expected.sort_unstable();
    assert_eq!(named, expected, "each alert once");
    let total = |outcome| receivers.iter().map(|r| r.alerts(outcome)).sum::<f64>();
    assert_eq!(total("published"), 12.0);
    assert_eq!(total("duplicate"), 12.0 * 11.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_cannot_be_used_is_refused_and_named_and_nothing_of_it_published() {
    let f = Fixture::new(Layout::Hash);
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(dir.path(), TOKEN);
    let receiver = Receiver::start(
        &f.settings,
        &token,
        &[("JANITOR_ALERT_RECEIVER_MAX_BODY_BYTES", "4096")],
    );
    let one = webhook(vec![alert(
        "firing",
        json!({"alertname": "ConnectionServerDown", "server_id": "gw-x#1"}),
        json!({}),
        "0000000000000001",
        T0,
    )]);

    // Authentication.
    let (status, answer) = receiver.post_with(&[("Authorization", "Bearer wrong")], &one);
    assert_eq!(status, 401, "{answer}");
    let (status, _) = receiver.post_with(&[], &one);
    assert_eq!(status, 401);
    let (status, _) = receiver.post_with(&[("Authorization", &format!("Basic {TOKEN}"))], &one);
    assert_eq!(status, 401);
    assert_eq!(
        receiver.metric("registry_janitor_receiver_unauthorized_total"),
        3.0
    );
    assert_eq!(
        receiver.metric(r#"registry_janitor_receiver_requests_total{code="401"}"#),
        3.0
    );

    // Too large, declared or streamed.
    let big = format!("{{\"version\":\"4\",\"pad\":\"{}\"}}", "x".repeat(5000));
    let (status, answer) = receiver.post(&big);
    assert_eq!(status, 413, "{answer}");
    assert!(answer["error"]
        .as_str()
        .unwrap()
        .contains("alert_receiver_max_body_bytes"));
    let chunked = format!("{:x}\r\n{big}\r\n0\r\n\r\n", big.len());
    let (status, _) = http_post(
        &receiver.addr,
        "/alerts",
        &[
            ("Authorization", &format!("Bearer {TOKEN}")),
            ("Content-Type", "application/json"),
            ("Transfer-Encoding", "chunked"),
        ],
        chunked.as_bytes(),
    );
    assert_eq!(status, 413);

    // Not a version 4 webhook.
    for (body, says) in [
        ("{\"version\": \"4\", \"alerts\": [", "not valid JSON"),
        ("{\"version\": \"3\", \"alerts\": []}", "version \"3\""),
        ("{\"alerts\": []}", "no string `version`"),
        (
            "{\"version\": \"4\", \"alerts\": {}}",
            "not an Alertmanager webhook payload",
        ),
    ] {
        let (status, answer) = receiver.post(body);
        assert_eq!(status, 400, "{body}: {answer}");
        let error = answer["error"].as_str().unwrap();
        assert!(
            error.contains(says),
            "{body}: {error:?} does not say {says:?}"
        );
    }
    let (status, answer) = receiver.post_with(
        &[
            ("Authorization", &format!("Bearer {TOKEN}")),
            ("Content-Type", "text/plain"),
        ],
        &one,
    );
    assert_eq!(status, 400, "{answer}");
    assert!(answer["error"].as_str().unwrap().contains("Content-Type"));
    assert!(events(&f).await.is_empty(), "a refused request published");

    // One batch: a good alert, one without the label, one with a server id that cannot
    // be one. The good one is published; the answer names the others and why.
    let batch = webhook(vec![
        alert(
            "firing",
            json!({"alertname": "ConnectionServerDown", "server_id": "gw-ok#1"}),
            json!({}),
            "0000000000000002",
            T0,
        ),
        alert(
            "firing",
            json!({"alertname": "ConnectionServerDown", "instance": "10.0.0.7:9100"}),
            json!({}),
            "0000000000000003",
            T0,
        ),
        alert(
            "firing",
            json!({"alertname": "Weird", "server_id": "gw {bad}"}),
            json!({}),
            "0000000000000004",
            T0,
        ),
    ]);
    let (status, answer) = receiver.post(&batch);
    assert_eq!(status, 422, "{answer}");
    assert_eq!(answer["published"], 1, "{answer}");
    let refused = answer["refused"].as_array().unwrap();
    assert_eq!(refused.len(), 2, "{answer}");
    assert_eq!(refused[0]["index"], 1);
    assert_eq!(refused[0]["fingerprint"], "0000000000000003");
    assert_eq!(refused[0]["alertname"], "ConnectionServerDown");
    assert!(refused[0]["reason"]
        .as_str()
        .unwrap()
        .contains("no label `server_id`"));
    assert_eq!(refused[1]["index"], 2);
    assert!(refused[1]["reason"]
        .as_str()
        .unwrap()
        .contains("bad server_id"));
    let published = events(&f).await;
    assert_eq!(published.len(), 1, "{published:?}");
    assert_eq!(published[0].server_id, "gw-ok#1");
    assert_eq!(receiver.alerts("refused"), 2.0);
    assert_eq!(
        receiver.metric(r#"registry_janitor_receiver_requests_total{code="422"}"#),
        1.0
    );

    // Only POST /alerts.
    let (status, _) = http_get(&receiver.addr, "/alerts");
    assert_eq!(status, 405);
    let (status, _) = http_post(&receiver.addr, "/elsewhere", &[], b"{}");
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_needs_a_token_unless_auth_is_off() {
    let f = Fixture::new(Layout::Hash);
    let dir = tempfile::tempdir().unwrap();
    let empty = token_file(dir.path(), "");
    let run = |env: &[(&str, &str)]| {
        let out = janitor(&f.settings)
            .envs(env.iter().copied())
            .env("JANITOR_ALERT_RECEIVER_ADDR", free_addr())
            .arg("alert-receiver")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for env in [
        vec![],
        vec![("JANITOR_ALERT_RECEIVER_TOKEN_FILE", "/nonexistent/token")],
        vec![("JANITOR_ALERT_RECEIVER_TOKEN_FILE", empty.to_str().unwrap())],
    ] {
        let (code, stderr) = run(&env);
        assert_ne!(code, Some(0), "{env:?}: {stderr}");
        assert!(
            stderr.contains("alert_receiver_token_file"),
            "{env:?}: {stderr:?} does not name the setting"
        );
    }
    let (code, stderr) = run(&[("JANITOR_ALERT_RECEIVER_AUTH", "sometimes")]);
    assert_ne!(code, Some(0));
    assert!(stderr.contains("alert_receiver_auth"), "{stderr}");

    // With auth off, no token is asked for.
    let receiver = Receiver::start(
        &f.settings,
        &empty,
        &[("JANITOR_ALERT_RECEIVER_AUTH", "off")],
    );
    let body = webhook(vec![alert(
        "firing",
        json!({"server_id": "gw-open#1"}),
        json!({}),
        "0000000000000005",
        T0,
    )]);
    let (status, answer) = receiver.post_with(&[], &body);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(events(&f).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_away_gets_503_and_the_alert_is_published_when_it_is_back() {
    let mut f = Fixture::new(Layout::Hash);
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(dir.path(), TOKEN);
    let receiver = Receiver::start(&f.settings, &token, &[]);
    let body = webhook(vec![alert(
        "firing",
        json!({"alertname": "ConnectionServerDown", "server_id": "gw-r#1"}),
        json!({}),
        "0000000000000006",
        T0,
    )]);
    f.redis.kill();
    let sent = Instant::now();
    let (status, answer) = receiver.post(&body);
    let took = sent.elapsed();
    assert_eq!(status, 503, "{answer}");
    assert!(
        took < Duration::from_secs(30),
        "the answer took {took:?} (the deadline is 10 s)"
    );
    assert_eq!(http_get(&receiver.metrics, "/readyz").0, 503);

    // Redis is back (empty: no persistence): Alertmanager's retry is published.
    f.redis.restart().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, answer) = receiver.post(&body);
        if status == 200 {
            assert_eq!(answer["published"], 1, "{answer}");
            break;
        }
        assert_eq!(status, 503, "{answer}");
        assert!(
            Instant::now() < deadline,
            "still {status} after Redis came back"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let published = events_of(&connect(&f.settings), &f.keys).await;
    assert_eq!(published.len(), 1);
    assert_eq!(published[0].server_id, "gw-r#1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_request_in_flight_finish_with_its_answer() {
    let f = Fixture::new(Layout::Hash);
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(dir.path(), TOKEN);
    let receiver = Receiver::start(&f.settings, &token, &[]);
    let body = webhook(vec![alert(
        "firing",
        json!({"alertname": "ConnectionServerDown", "server_id": "gw-drain#1"}),
        json!({}),
        "0000000000000008",
        T0,
    )]);
    // Redis holds every write, scripts included, for 4 s: the request waits in Redis.
    let () = f
        .query(redis::cmd("CLIENT").arg("PAUSE").arg(4000).arg("WRITE"))
        .await;
    let (status, answer) = std::thread::scope(|scope| {
        let posting = scope.spawn(|| receiver.post(&body));
        let deadline = Instant::now() + Duration::from_secs(30);
        while receiver.metric("registry_janitor_receiver_requests_in_flight") < 1.0 {
            assert!(!posting.is_finished(), "the request ended before SIGTERM");
            assert!(Instant::now() < deadline, "the request never arrived");
            std::thread::sleep(Duration::from_millis(20));
        }
        receiver.process.signal("TERM");
        posting.join().unwrap()
    });
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["published"], 1, "{answer}");
    let log = receiver.process.log();
    assert!(
        log.contains("finishing the requests in flight"),
        "SIGTERM did not find the request in flight:\n{log}"
    );
    receiver.stop();
    let published = events(&f).await;
    assert_eq!(published.len(), 1);
    assert_eq!(published[0].server_id, "gw-drain#1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_tls_with_the_configured_certificate() {
    let f = Fixture::new(Layout::Hash);
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(dir.path(), TOKEN);
    let generated = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert, generated.cert.pem()).unwrap();
    std::fs::write(&key, generated.signing_key.serialize_pem()).unwrap();
    let receiver = Receiver::start(
        &f.settings,
        &token,
        &[
            (
                "JANITOR_ALERT_RECEIVER_TLS_CERT_FILE",
                cert.to_str().unwrap(),
            ),
            ("JANITOR_ALERT_RECEIVER_TLS_KEY_FILE", key.to_str().unwrap()),
        ],
    );
    let mut roots = rustls::RootCertStore::empty();
    roots.add(generated.cert.der().clone()).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let body = webhook(vec![alert(
        "firing",
        json!({"server_id": "gw-tls#1"}),
        json!({}),
        "0000000000000007",
        T0,
    )]);
    let post_tls = || {
        let tcp = std::net::TcpStream::connect(&receiver.addr).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let conn = rustls::ClientConnection::new(Arc::new(config.clone()), name).unwrap();
        post_over(
            rustls::StreamOwned::new(conn, tcp),
            "localhost",
            "/alerts",
            &[
                ("Authorization", &format!("Bearer {TOKEN}")),
                ("Content-Type", "application/json"),
            ],
            body.as_bytes(),
        )
    };
    let (status, answer) = post_tls();
    assert_eq!(status, 200, "{answer}\n{}", receiver.process.log());
    let published = events(&f).await;
    assert_eq!(published.len(), 1);
    assert_eq!(published[0].server_id, "gw-tls#1");
    // Plain HTTP to the TLS listener gets no answer.
    let (status, _) = http_post(&receiver.addr, "/alerts", &[], body.as_bytes());
    assert_ne!(status, 200);
    assert_eq!(events(&f).await.len(), 1);
}

/// A real Alertmanager on free ports (clustering off) whose one route sends every alert
/// to the receiver at `receiver_addr` with the token of `token`, resolved ones too.
fn alertmanager(bin: &str, receiver_addr: &str, token: &Path, repeat: &str) -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "route:\n  receiver: registry-janitor\n  group_by: [alertname, server_id]\n  \
         group_wait: 0s\n  group_interval: 1s\n  repeat_interval: {repeat}\n\
         receivers:\n  - name: registry-janitor\n    webhook_configs:\n      \
         - url: http://{receiver_addr}/alerts\n        send_resolved: true\n        \
         http_config:\n          authorization:\n            credentials_file: {}\n",
        token.display()
    );
    std::fs::write(dir.path().join("alertmanager.yml"), config).unwrap();
    Daemon::start(
        "alertmanager",
        bin,
        dir,
        |dir, addr| {
            vec![
                format!("--config.file={}", dir.join("alertmanager.yml").display()),
                format!("--storage.path={}", dir.join("data").display()),
                format!("--web.listen-address={addr}"),
                // No gossip port: it would be a fixed one (9094).
                "--cluster.listen-address=".into(),
            ]
        },
        "/-/ready",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_alertmanager_delivers_each_firing_alert_once() {
    let Some(bin) = alertmanager_binary("to test the receiver against a real Alertmanager") else {
        return;
    };
    let f = Fixture::new(Layout::Hash);
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(dir.path(), TOKEN);
    let receiver = Receiver::start(&f.settings, &token, &[]);
    let mut am = alertmanager(&bin, &receiver.addr, &token, "2s");

    let starts = registry_janitor::now_ms() - 1_000;
    let labels = json!({"alertname": "ConnectionServerDown", "server_id": "gw-am#1", "job": "connection-servers"});
    let fire = json!([{
        "labels": labels,
        "annotations": {"summary": "connection server gw-am#1 is down"},
        "startsAt": rfc3339(starts),
    }])
    .to_string();
    let (status, body) = http_post(
        &am.addr,
        "/api/v2/alerts",
        &[("Content-Type", "application/json")],
        fire.as_bytes(),
    );
    assert_eq!(status, 200, "{body}");

    let deadline = Instant::now() + Duration::from_secs(60);
    let published = loop {
        let published = events(&f).await;
        if !published.is_empty() {
            break published;
        }
        assert!(
            Instant::now() < deadline,
            "no event within 60 s\n--- alertmanager ---\n{}\n--- receiver ---\n{}",
            am.log(),
            receiver.process.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(published.len(), 1, "{published:?}");
    let event = &published[0];
    assert_eq!(event.server_id, "gw-am#1");
    assert_eq!(event.detected_at_ms, starts);
    assert_eq!(event.source.as_deref(), Some("alertmanager"));
    assert_eq!(
        event.reason.as_deref(),
        Some("connection server gw-am#1 is down")
    );
    assert_eq!(receiver.alerts("refused"), 0.0);
    assert_eq!(
        receiver.metric("registry_janitor_receiver_unauthorized_total"),
        0.0
    );

    // Alertmanager notifies again (repeat_interval 2 s): found published, nothing more.
    am.wait_for("a repeated notification", Duration::from_secs(60), |_| {
        receiver.alerts("duplicate") >= 1.0
    });
    assert_eq!(events(&f).await.len(), 1);

    // The alert resolves: Alertmanager says so (send_resolved), nothing is published.
    let resolve = json!([{
        "labels": labels,
        "annotations": {"summary": "connection server gw-am#1 is down"},
        "startsAt": rfc3339(starts),
        "endsAt": rfc3339(registry_janitor::now_ms() - 500),
    }])
    .to_string();
    let (status, body) = http_post(
        &am.addr,
        "/api/v2/alerts",
        &[("Content-Type", "application/json")],
        resolve.as_bytes(),
    );
    assert_eq!(status, 200, "{body}");
    am.wait_for("the resolved notification", Duration::from_secs(60), |_| {
        receiver.alerts("resolved") >= 1.0
    });
    assert_eq!(events(&f).await.len(), 1);
    assert_eq!(
        receiver.metric(r#"registry_janitor_receiver_requests_total{code="401"}"#),
        0.0
    );
}

/// A connection server's metrics endpoint, as Prometheus scrapes it: answers every
/// request with one sample until stopped, then refuses connections.
struct Exporter {
    addr: String,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Exporter {
    fn start() -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if stopped.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(mut conn) = conn else { continue };
                let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
                let mut request = Vec::new();
                let mut buf = [0u8; 1024];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
                let body = "# TYPE connections gauge\nconnections 300\n";
                let _ = write!(
                    conn,
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n\
                     Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        Exporter {
            addr,
            stop,
            thread: Some(thread),
        }
    }

    /// Stops answering: the port is closed when this returns.
    fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = std::net::TcpStream::connect(&self.addr);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        self.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_to_alertmanager_to_receiver_to_worker_cleans_the_dead_server() {
    let needed = "for the end-to-end test (Prometheus, Alertmanager, receiver, worker)";
    let (Some(prometheus), Some(am_bin)) = (prometheus_binary(needed), alertmanager_binary(needed))
    else {
        return;
    };
    let f = Fixture::new(Layout::Hash);
    let (dead, live) = (server("gw-e2e#1"), server("gw-live#1"));
    f.seed(&dead, 300).await;
    f.seed(&live, 200).await;
    // One of the dead server's users reconnected to the live one before it died.
    f.reconnect(&user(&dead, 42), &live).await;

    let dir = tempfile::tempdir().unwrap();
    let token = token_file(dir.path(), TOKEN);
    let receiver = Receiver::start(&f.settings, &token, &[]);
    let am = alertmanager(&am_bin, &receiver.addr, &token, "1h");
    let mut exporter = Exporter::start();
    let prom_dir = tempfile::tempdir().unwrap();
    std::fs::write(
        prom_dir.path().join("rules.yaml"),
        "groups:\n  - name: connection-servers\n    rules:\n      \
         - alert: ConnectionServerDown\n        expr: up{job=\"connection-servers\"} == 0\n        \
         for: 0s\n        labels:\n          severity: critical\n        annotations:\n          \
         summary: 'connection server {{ $labels.server_id }} is down'\n",
    )
    .unwrap();
    std::fs::write(
        prom_dir.path().join("prometheus.yml"),
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files: [rules.yaml]\n\
             alerting:\n  alertmanagers:\n    - static_configs:\n        - targets: ['{}']\n\
             scrape_configs:\n  - job_name: connection-servers\n    static_configs:\n      \
             - targets: ['{}']\n        labels:\n          server_id: '{dead}'\n",
            am.addr, exporter.addr
        ),
    )
    .unwrap();
    let mut prom = Daemon::start(
        "prometheus",
        &prometheus,
        prom_dir,
        |dir, addr| {
            vec![
                format!("--config.file={}", dir.join("prometheus.yml").display()),
                format!("--storage.tsdb.path={}", dir.join("data").display()),
                format!("--web.listen-address={addr}"),
            ]
        },
        "/-/ready",
    );
    let worker = spawn_worker(&f.settings);

    // Prometheus scrapes the live exporter: nothing fires, nothing is published.
    let up = format!(
        "/api/v1/query?query={}",
        encode(&format!(
            "up{{job=\"connection-servers\",server_id=\"{dead}\"}} == 1"
        ))
    );
    prom.wait_for(
        "the exporter scraped and up",
        Duration::from_secs(60),
        |p| {
            let (status, body) = p.get(&up);
            status == 200
                && serde_json::from_str::<Value>(&body)
                    .is_ok_and(|v| v["data"]["result"].as_array().is_some_and(|r| r.len() == 1))
        },
    );
    assert!(events(&f).await.is_empty());
    assert_eq!(f.still_pointing(&dead, 300).await, 299);

    // The connection server dies: its heartbeats stop (its liveness key is gone, as when
    // its TTL runs out) and its exporter goes away.
    let () = f
        .query(redis::cmd("DEL").arg(f.keys.server_alive(&dead)))
        .await;
    exporter.stop();
    let context = |prom: &Daemon, am: &Daemon, receiver: &Receiver| {
        format!(
            "\n--- prometheus ---\n{}\n--- alertmanager ---\n{}\n--- receiver ---\n{}",
            prom.log(),
            am.log(),
            receiver.process.log()
        )
    };
    let deadline = Instant::now() + Duration::from_secs(90);
    while f.still_pointing(&dead, 300).await > 0 {
        assert!(
            Instant::now() < deadline,
            "the dead server's users were not cleaned within 90 s{}",
            context(&prom, &am, &receiver)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    f.wait_idle().await;

    // The registry's end state: the dead server's users are gone, the live server's and
    // the one that had moved are kept.
    assert_eq!(f.still_pointing(&live, 200).await, 200);
    assert_eq!(
        f.owner(&user(&dead, 42)).await.as_deref(),
        Some("gw-live#1")
    );
    assert_eq!(f.owner(&user(&dead, 7)).await, None);
    let left: u64 = f
        .query(
            redis::cmd("EXISTS")
                .arg(f.keys.server_users(&dead))
                .arg(f.keys.server_walking(&dead)),
        )
        .await;
    assert_eq!(left, 0, "the dead server's reverse index is still there");
    let published = events(&f).await;
    assert_eq!(published.len(), 1, "{published:?}");
    assert_eq!(published[0].server_id, dead.as_str());
    assert_eq!(published[0].source.as_deref(), Some("alertmanager"));
    assert_eq!(
        published[0].reason.as_deref(),
        Some("connection server gw-e2e#1 is down")
    );
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_redis_cluster_each_alert_is_published_once_from_the_streams_slot() {
    init_logs();
    if !registry_janitor_testkit::RedisCluster::supported() {
        cannot_run("this redis-server cannot run a cluster (or redis-cli is missing)");
        return;
    }
    let cluster =
        tokio::task::spawn_blocking(|| registry_janitor_testkit::RedisCluster::start(3, 0))
            .await
            .unwrap()
            .expect("start a local cluster");
    let mut settings = settings(&cluster.nodes[0], Layout::Hash);
    settings.redis_cluster = true;
    let seeds = serde_json::to_string(&cluster.seeds()).unwrap();
    let cluster_env = [
        ("JANITOR_REDIS_CLUSTER", "true"),
        ("JANITOR_REDIS_CLUSTER_SEEDS", seeds.as_str()),
    ];
    let conn = fresh_conn(&settings).await;
    let keys = registry_janitor::keys::Keys::for_settings(&settings);
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(dir.path(), TOKEN);

    // A prefix whose brace would break the records' hash tag is refused at start-up.
    let out = janitor(&settings)
        .envs(cluster_env)
        .env("JANITOR_KEY_PREFIX", "a{b:")
        .env("JANITOR_ALERT_RECEIVER_ADDR", free_addr())
        .env("JANITOR_ALERT_RECEIVER_TOKEN_FILE", &token)
        .arg("alert-receiver")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("key_prefix"), "{stderr}");

    let receivers = [
        Receiver::start(&settings, &token, &cluster_env),
        Receiver::start(&settings, &token, &cluster_env),
    ];
    let servers: Vec<String> = (0..8).map(|n| format!("gw-c{n}#1")).collect();
    let batch = webhook(
        servers
            .iter()
            .enumerate()
            .map(|(n, s)| {
                alert(
                    "firing",
                    json!({"alertname": "ConnectionServerDown", "server_id": s}),
                    json!({}),
                    &format!("c{n:015x}"),
                    T0 + n as u64,
                )
            })
            .collect(),
    );
    std::thread::scope(|scope| {
        for r in &receivers {
            let batch = &batch;
            scope.spawn(move || {
                for _ in 0..2 {
                    let (status, answer) = r.post(batch);
                    assert_eq!(status, 200, "{answer}\n{}", r.process.log());
                }
            });
        }
    });
    let published = events_of(&conn, &keys).await;
    let mut named: Vec<&str> = published.iter().map(|e| e.server_id.as_str()).collect();
    named.sort_unstable();
    assert_eq!(
        named,
        servers.iter().map(String::as_str).collect::<Vec<_>>()
    );
    // Each record is in the stream's slot and holds its event's entry id.
    let entries = read_stream(&conn, &keys.events()).await;
    let record = keys.alert_published(&format!("c{:015x}:{T0}", 0));
    assert_eq!(
        registry_janitor::conn::key_slot(record.as_bytes()),
        registry_janitor::conn::key_slot(keys.events().as_bytes())
    );
    let id: String = redis::cmd("GET")
        .arg(&record)
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    let first = entries
        .iter()
        .find(|e| {
            matches!(classify(e, 65536), Classified::ServerDead(ev, _) if ev.server_id == "gw-c0#1")
        })
        .unwrap();
    assert_eq!(id, first.id);
    let total = |outcome| receivers.iter().map(|r| r.alerts(outcome)).sum::<f64>();
    assert_eq!(total("published"), 8.0);
    assert_eq!(total("duplicate"), 24.0);
}
