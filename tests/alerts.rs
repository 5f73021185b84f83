//! The shipped alerts and dashboard (k8s/components/) against a real Prometheus: the test
//! starts a worker process with its metrics on a free port and a `prometheus` process on
//! another, which scrapes the worker every second and evaluates the rules of
//! `k8s/components/alerts/rules.yaml` every second. The worker cleans a dead server,
//! dead-letters a malformed event and loses its Redis (SIGKILL); the test then asks
//! Prometheus' HTTP API:
//! - the dead-letter and Redis-down alerts reach `firing` within their `for` windows;
//! - every query of every panel of the Grafana dashboard returns data (a finite value).
//!
//! Time is shortened, in the open: the test loads a copy of the rules in which every
//! duration (each `for:` and each range or subquery window of an `expr`) is divided by 60,
//! and at least 5 s ([`shorten`]): `for: 1m` becomes `for: 5s`, `[1h]` becomes `[60s]`.
//! The copy is printed when the test fails.
//!
//! Needs `prometheus` (Debian's package `prometheus`; `PROMETHEUS` names another binary).
//! Without it the test is skipped with a message, unless `CI` is set: then it fails.

mod common;

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use common::{monitoring::*, *};
use registry_janitor::config::Layout;
use serde_json::Value;

const RULES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/k8s/components/alerts/rules.yaml"
);
const DASHBOARD: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/k8s/components/dashboard/registry-janitor.json"
);

/// The test's time scale: a duration of the rules is divided by this...
const SCALE: u64 = 60;
/// ...and is at least this long (5 scrapes: a rate needs two samples in its window).
const SHORTEST_MS: u64 = 5_000;
/// The scrape job's name: the rules and the dashboard select on `job`.
const JOB: &str = "registry-janitor";
/// How long past its `for` window an alert may take to fire: the worker samples Redis
/// every 5 s, Prometheus scrapes and evaluates every second, and the machine is busy
/// (tests run in parallel on 2 cores). Generous on purpose: the test must not flake.
const SLACK: Duration = Duration::from_secs(60);
/// What `$__rate_interval` (Grafana's) becomes in the dashboard's queries: longer than
/// the test, so that a rate covers everything the worker did.
const RATE_INTERVAL: &str = "10m";

/// The Prometheus binary, if it runs; otherwise None (the test is skipped), or a panic
/// when `CI` is set.
fn prometheus() -> Option<String> {
    prometheus_binary("to test the alerts and the dashboard against a real Prometheus")
}

/// Milliseconds of a Prometheus duration (`90s`, `5m`, `1h30m`, `1d`...), None if `s` is
/// not one.
fn duration_ms(s: &str) -> Option<u64> {
    let (mut total, mut digits, mut rest) = (0u64, String::new(), s.trim());
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let c = rest.chars().next()?;
        if c.is_ascii_digit() {
            digits.push(c);
            rest = &rest[1..];
            continue;
        }
        let (unit_ms, len) = if rest.starts_with("ms") {
            (1, 2)
        } else {
            let ms = match c {
                's' => 1_000,
                'm' => 60_000,
                'h' => 3_600_000,
                'd' => 86_400_000,
                'w' => 7 * 86_400_000,
                'y' => 365 * 86_400_000,
                _ => return None,
            };
            (ms, 1)
        };
        total += digits.parse::<u64>().ok()? * unit_ms;
        digits.clear();
        rest = &rest[len..];
    }
    digits.is_empty().then_some(total)
}

/// The test's version of a duration of the rules: divided by [`SCALE`], at least
/// [`SHORTEST_MS`]. `5m` becomes `5s`, `15m` `15s`, `1h` `60s`, `1d` `1440s`.
fn shorten(duration: &str) -> String {
    let ms = duration_ms(duration)
        .unwrap_or_else(|| panic!("{duration:?} is not a Prometheus duration"))
        / SCALE;
    let ms = ms.max(SHORTEST_MS);
    if ms % 1_000 == 0 {
        format!("{}s", ms / 1_000)
    } else {
        format!("{ms}ms")
    }
}

/// `expr` with every range window and subquery window and step (`[5m]`, `[15m:1m]`)
/// shortened.
fn shorten_windows(expr: &str) -> String {
    let mut out = String::new();
    let mut rest = expr;
    while let Some(open) = rest.find('[') {
        let close = open + rest[open..].find(']').expect("a ] for every [");
        out.push_str(&rest[..=open]);
        let parts: Vec<String> = rest[open + 1..close]
            .split(':')
            .map(|p| {
                if p.trim().is_empty() {
                    String::new()
                } else {
                    shorten(p)
                }
            })
            .collect();
        out.push_str(&parts.join(":"));
        out.push(']');
        rest = &rest[close + 1..];
    }
    out.push_str(rest);
    out
}

/// The rules file with every `for:` and every window of an `expr` shortened, and the
/// shortened `for` of each alert.
fn shortened_rules() -> (String, Vec<(String, Duration)>) {
    let mut rules: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(RULES).unwrap()).unwrap();
    let mut fors = Vec::new();
    for group in rules["groups"].as_sequence_mut().unwrap() {
        for rule in group["rules"].as_sequence_mut().unwrap() {
            let rule = rule.as_mapping_mut().unwrap();
            let expr = rule["expr"].as_str().unwrap().to_owned();
            rule.insert("expr".into(), shorten_windows(&expr).into());
            let mut for_ = Duration::ZERO;
            if let Some(f) = rule.get("for").and_then(|f| f.as_str()).map(str::to_owned) {
                let short = shorten(&f);
                for_ = Duration::from_millis(duration_ms(&short).unwrap());
                rule.insert("for".into(), short.into());
            }
            if let Some(name) = rule.get("alert").and_then(|a| a.as_str()) {
                fors.push((name.to_owned(), for_));
            }
        }
    }
    (serde_yaml::to_string(&rules).unwrap(), fors)
}

/// A real Prometheus on a free port, with its own data directory; killed on drop.
struct Prometheus {
    child: Child,
    addr: String,
    dir: tempfile::TempDir,
    rules: String,
}

impl Prometheus {
    /// Starts `bin`, scraping `target` (host:port) every second as job [`JOB`], with the
    /// shortened rules evaluated every second.
    fn start(bin: &str, target: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (rules, _) = shortened_rules();
        std::fs::write(dir.path().join("rules.yaml"), &rules).unwrap();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files: [rules.yaml]\n\
             scrape_configs:\n  - job_name: {JOB}\n    static_configs:\n      - targets: ['{target}']\n"
        );
        std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
        let addr = free_addr();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
        let child = Command::new(bin)
            .current_dir(dir.path())
            .arg(format!(
                "--config.file={}",
                dir.path().join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let p = Prometheus {
            child,
            addr,
            dir,
            rules,
        };
        p.wait_for("Prometheus to be ready", Duration::from_secs(60), || {
            p.get("/-/ready").0 == 200
        });
        p
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// An HTTP GET of Prometheus: status and body.
    fn get(&self, path_and_query: &str) -> (u16, String) {
        http_get(&self.addr, path_and_query)
    }

    /// GET of an API path: the `data` of a successful answer.
    fn api(&self, path_and_query: &str) -> Value {
        let (status, body) = self.get(path_and_query);
        let reply: Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("{path_and_query}: HTTP {status}, not JSON ({e}): {body}"));
        assert_eq!(
            reply["status"], "success",
            "{path_and_query}: HTTP {status}: {reply}"
        );
        reply["data"].clone()
    }

    /// The instant vector of `query`, as (labels, value).
    fn query(&self, query: &str) -> Vec<(Value, f64)> {
        let data = self.api(&format!("/api/v1/query?query={}", encode(query)));
        assert_eq!(data["resultType"], "vector", "{query}: {data}");
        data["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                let v = s["value"][1].as_str().unwrap();
                (s["metric"].clone(), v.parse::<f64>().unwrap())
            })
            .collect()
    }

    /// The state of alert `name` (`pending`, `firing`) with its labels, if it is active.
    fn alert(&self, name: &str) -> Option<(String, Value)> {
        self.api("/api/v1/alerts")["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["labels"]["alertname"] == name)
            .map(|a| (a["state"].as_str().unwrap().to_owned(), a["labels"].clone()))
    }

    /// Polls `check` until true; on timeout fails with Prometheus' log and rules.
    fn wait_for(&self, what: &str, timeout: Duration, mut check: impl FnMut() -> bool) {
        let deadline = Instant::now() + timeout;
        while !check() {
            assert!(
                Instant::now() < deadline,
                "timed out after {timeout:?} waiting for: {what}\n--- prometheus log ---\n{}\n\
                 --- the rules it was given (shortened) ---\n{}",
                self.log(),
                self.rules
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Waits until alert `name` fires, at most its `for` plus [`SLACK`] after `since`;
    /// returns how long it took and its labels.
    fn wait_firing(
        &self,
        name: &str,
        fors: &[(String, Duration)],
        since: Instant,
    ) -> (Duration, Value) {
        let for_ = fors
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no alert {name} in {RULES}"))
            .1;
        let mut seen_pending = false;
        let mut labels = Value::Null;
        let budget = (for_ + SLACK).saturating_sub(since.elapsed());
        self.wait_for(
            &format!("{name} to fire (for: {for_:?})"),
            budget,
            || match self.alert(name) {
                Some((state, l)) if state == "firing" => {
                    labels = l;
                    true
                }
                Some((state, _)) => {
                    seen_pending |= state == "pending";
                    false
                }
                None => false,
            },
        );
        let took = since.elapsed();
        eprintln!(
            "{name}: firing {took:?} after its cause (for: {for_:?}; seen pending: {seen_pending})"
        );
        (took, labels)
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every (panel title, query) of the dashboard, and its template variables' queries.
fn dashboard() -> (Vec<(String, String)>, Value) {
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(DASHBOARD).unwrap()).unwrap();
    let mut queries = Vec::new();
    for panel in dash["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = target["expr"].as_str() {
                queries.push((panel["title"].as_str().unwrap().to_owned(), expr.to_owned()));
            }
        }
    }
    (queries, dash["templating"]["list"].clone())
}

#[test]
fn the_shortened_rules_keep_every_alert_and_divide_durations_by_60() {
    assert_eq!(shorten("5m"), "5s");
    assert_eq!(shorten("1m"), "5s");
    assert_eq!(shorten("15m"), "15s");
    assert_eq!(shorten("1h"), "60s");
    assert_eq!(shorten("1d"), "1440s");
    assert_eq!(shorten("1h30m"), "90s");
    assert_eq!(
        shorten_windows("rate(a[5m]) + max_over_time(b[15m:1m]) + c[1h:]"),
        "rate(a[5s]) + max_over_time(b[15s:5s]) + c[60s:]"
    );
    let (rules, fors) = shortened_rules();
    assert!(fors.len() >= 8, "{fors:?}");
    assert!(
        !rules.contains("m]") && !rules.contains("h]") && !rules.contains("d]"),
        "a window was not shortened:\n{rules}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_queries_return_data_and_alerts_fire_in_a_real_prometheus() {
    let Some(bin) = prometheus() else { return };
    let (_, fors) = shortened_rules();
    let mut f = Fixture::new(Layout::Hash);
    let metrics = free_addr();
    f.settings.metrics_addr = metrics.clone();
    let dead = server("gw-alerts#1");
    f.seed(&dead, 200).await;
    let worker = WorkerProcess::start(&f.settings);
    let prom = Prometheus::start(&bin, &metrics);
    let context = |prom: &Prometheus, worker: &WorkerProcess| {
        format!(
            "\n--- worker log ---\n{}\n--- prometheus log ---\n{}",
            worker.log(),
            prom.log()
        )
    };

    // Prometheus scrapes the worker, and has seen its counters at 0 (an alert on an
    // increase needs the sample before it).
    prom.wait_for(
        "the worker scraped, its counters at 0",
        Duration::from_secs(60),
        || {
            prom.query(r#"registry_janitor_events_total{outcome="dead_lettered"}"#)
                .iter()
                .any(|(_, v)| *v == 0.0)
                && prom
                    .query(r#"registry_janitor_redis_up == 1"#)
                    .iter()
                    .any(|(l, _)| l["job"] == JOB)
        },
    );

    // A dead server cleaned, a malformed event dead-lettered.
    f.kill(&dead).await;
    let junk_at = Instant::now();
    f.publish_junk().await;
    f.wait_idle().await;
    assert_eq!(f.still_pointing(&dead, 200).await, 0);
    assert_eq!(f.dead_letters().await.len(), 1);

    let (took, labels) = prom.wait_firing("RegistryJanitorDeadLetters", &fors, junk_at);
    assert_eq!(labels["severity"], "warning", "{labels}");
    assert_eq!(labels["job"], JOB, "{labels}");
    assert!(took < SLACK, "{took:?}{}", context(&prom, &worker));

    // Redis goes away: the worker's PING fails, redis_up drops to 0, the alert fires.
    f.redis.kill();
    let lost_at = Instant::now();
    let (took, labels) = prom.wait_firing("RegistryJanitorRedisDown", &fors, lost_at);
    assert_eq!(labels["severity"], "critical", "{labels}");
    assert_eq!(labels["job"], JOB, "{labels}");
    assert!(
        took >= Duration::from_secs(5),
        "fired before its `for` of 5 s: {took:?}"
    );
    assert_eq!(
        prom.query("max(registry_janitor_redis_up)")
            .first()
            .map(|(_, v)| *v),
        Some(0.0)
    );

    // Every panel's every query returns data: the template variables as Grafana sets
    // them (`$job` from its own label_values query), `$__rate_interval` long enough to
    // cover the whole test.
    let (queries, variables) = dashboard();
    let mut job = None;
    for var in variables.as_array().unwrap() {
        if var["name"] == "job" {
            let q = var["definition"].as_str().unwrap();
            let (metric, label) = q
                .strip_prefix("label_values(")
                .and_then(|r| r.strip_suffix(')'))
                .and_then(|r| r.split_once(','))
                .unwrap_or_else(|| panic!("the job variable's query: {q}"));
            let values = prom.api(&format!(
                "/api/v1/label/{}/values?match[]={}",
                label.trim(),
                encode(metric.trim())
            ));
            assert_eq!(values, serde_json::json!([JOB]), "{q}");
            job = Some(JOB);
        }
    }
    let job = job.expect("the dashboard has a job variable");
    assert!(queries.len() >= 10, "{queries:?}");
    let mut empty = Vec::new();
    for (title, expr) in &queries {
        let q = expr
            .replace("$__rate_interval", RATE_INTERVAL)
            .replace("$job", job);
        assert!(!q.contains('$'), "{title}: a variable left in {q}");
        let result = prom.query(&q);
        if !result.iter().any(|(_, v)| v.is_finite()) {
            empty.push(format!("{title}: {q} -> {result:?}"));
        }
    }
    assert!(
        empty.is_empty(),
        "dashboard queries without data:\n{}{}",
        empty.join("\n"),
        context(&prom, &worker)
    );
    eprintln!("{} dashboard queries, all with data", queries.len());
}
