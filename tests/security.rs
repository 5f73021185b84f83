//! Least privilege, TLS and secrets, against real redis-servers: the ACL roles shipped in
//! k8s/ run the whole flow and nothing more; rediss:// with a custom CA and client
//! certificates; passwords from files and variables never shown.

mod common;

use std::{path::Path, process::Output, time::Duration};

use common::*;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType, IsCa, KeyPair,
};
use registry_janitor::{
    config::Layout, conn::RedisConn, error::Error, event::ServerId, registry::Registry,
};
use registry_janitor_testkit::RedisServer;

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files in `dir`.
/// Every certificate gets its own name: a leaf whose subject equals its issuer's looks
/// self-signed to OpenSSL.
fn certificates(dir: &Path, name: &str) {
    let named = |mut params: CertificateParams, cn: String| {
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, cn);
        params
    };
    let mut ca_params = named(
        CertificateParams::new(Vec::<String>::new()).unwrap(),
        format!("{name} test CA"),
    );
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    std::fs::write(dir.join(format!("{name}-ca.pem")), ca.pem()).unwrap();
    for (who, sans) in [
        (
            "server",
            vec!["127.0.0.1".to_owned(), "localhost".to_owned()],
        ),
        ("client", vec!["janitor".to_owned()]),
    ] {
        let key = KeyPair::generate().unwrap();
        let params = named(
            CertificateParams::new(sans).unwrap(),
            format!("{name} {who}"),
        );
        let cert = params.signed_by(&key, &ca).unwrap();
        std::fs::write(dir.join(format!("{name}-{who}.pem")), cert.pem()).unwrap();
        std::fs::write(
            dir.join(format!("{name}-{who}-key.pem")),
            key.serialize_pem(),
        )
        .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_flow_runs_over_mutual_tls_and_a_wrong_ca_fails_fast() {
    let dir = tempfile::tempdir().unwrap();
    certificates(dir.path(), "good");
    certificates(dir.path(), "other");
    let p = |f: &str| dir.path().join(f).to_string_lossy().into_owned();
    let tls_addr = free_addr();
    let tls_port = tls_addr.rsplit(':').next().unwrap().to_owned();
    let server = redis_with(&[
        "--tls-port",
        &tls_port,
        "--tls-cert-file",
        &p("good-server.pem"),
        "--tls-key-file",
        &p("good-server-key.pem"),
        "--tls-ca-cert-file",
        &p("good-ca.pem"),
        "--tls-auth-clients",
        "yes",
    ]);
    // Seeding goes over the plain port; the janitor talks TLS only.
    let f = Fixture::on(server, Layout::Hash, |_| {});
    let dead = server_id("gw-tls#1");
    f.seed(&dead, 2_000).await;
    let mut tls = f.settings.clone();
    tls.redis_url = format!("rediss://127.0.0.1:{tls_port}");
    let tls_env = |ca: &str, cert: &str, key: &str| {
        vec![
            ("JANITOR_REDIS_URL".to_owned(), tls.redis_url.clone()),
            ("JANITOR_TLS_CA_FILE".to_owned(), p(ca)),
            ("JANITOR_TLS_CERT_FILE".to_owned(), p(cert)),
            ("JANITOR_TLS_KEY_FILE".to_owned(), p(key)),
        ]
    };
    let good = tls_env("good-ca.pem", "good-client.pem", "good-client-key.pem");

    let out = janitor(&tls)
        .envs(good.clone())
        .args(["emit", "server-dead", "gw-tls#1"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    let worker = {
        let env: Vec<(&str, &str)> = good.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        WorkerProcess::start_with(&tls, &env)
    };
    f.wait_idle().await;
    assert_eq!(f.still_pointing(&dead, 2_000).await, 0, "cleaned over TLS");
    worker.signal("TERM");
    let (status, log) = worker.wait(Duration::from_secs(10));
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");

    // A CA that did not sign the server's certificate: a clear error, quickly.
    let wrong = tls_env("other-ca.pem", "good-client.pem", "good-client-key.pem");
    let started = std::time::Instant::now();
    let out = janitor(&tls)
        .envs(wrong.clone())
        .args(["status"])
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.to_lowercase().contains("certificate"), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    // A worker with the wrong CA stops at start-up with the reason, instead of retrying.
    let env: Vec<(&str, &str)> = wrong
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let worker = WorkerProcess::start_with(&tls, &env);
    let (status, log) = worker.wait(Duration::from_secs(15));
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(1),
        "the worker must stop: {log}"
    );
    assert!(log.to_lowercase().contains("certificate"), "{log}");

    // Without a client certificate the server (tls-auth-clients yes) refuses the client.
    let mut no_client = tls_env("good-ca.pem", "good-client.pem", "good-client-key.pem");
    no_client.truncate(2);
    let out = janitor(&tls)
        .envs(no_client)
        .args(["status"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "{:?}", text(&out));

    // TLS files with a plain URL are a setting error.
    let out = janitor(&f.settings)
        .envs([("JANITOR_TLS_CA_FILE", p("good-ca.pem"))])
        .args(["status"])
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert!(
        stderr.contains("tls_ca_file") && stderr.contains("rediss://"),
        "{stderr}"
    );
}

fn server_id(s: &str) -> ServerId {
    server(s)
}

/// Loads the ACL users of k8s/redis-acl.example.conf, each with password `pw-<name>`.
fn load_acl_users(redis: &RedisServer) -> Vec<String> {
    let conf = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/k8s/redis-acl.example.conf"
    ))
    .unwrap();
    let client = redis::Client::open(redis.url()).unwrap();
    let mut c = client.get_connection().unwrap();
    let mut names = Vec::new();
    for line in conf.lines().filter(|l| l.starts_with("user ")) {
        let mut tokens: Vec<String> = line.split_whitespace().skip(1).map(str::to_owned).collect();
        let name = tokens.remove(0);
        for t in tokens.iter_mut().filter(|t| t.starts_with('#')) {
            *t = format!(">pw-{name}");
        }
        let () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg(&name)
            .arg(&tokens)
            .query(&mut c)
            .unwrap();
        names.push(name);
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_role_runs_the_flow_with_only_its_acl_rules() {
    each_role_runs_the_flow(Layout::Hash).await;
}

/// The same flow in layout conns: the worker's cleanup, the reconciler's sweep and the
/// connection server's scripts of that layout, each with only its role's rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_role_runs_the_flow_with_only_its_acl_rules_conns_layout() {
    each_role_runs_the_flow(Layout::Conns).await;
}

async fn each_role_runs_the_flow(layout: Layout) {
    let f = Fixture::with(layout, |s| {
        s.key_prefix = String::new(); // the shipped rules name the keys without a prefix
        s.reconcile_interval_ms = 200;
    });
    let users = load_acl_users(&f.redis);
    for role in [
        "janitor-worker",
        "janitor-reconciler",
        "janitor-emitter",
        "janitor-operator",
        "connection-server",
    ] {
        assert!(
            users.iter().any(|u| u == role),
            "{role} missing from the ACL example"
        );
    }
    let as_role = |role: &str| {
        let mut s = f.settings.clone();
        s.redis_url = f
            .redis
            .url()
            .replace("redis://", &format!("redis://{role}:pw-{role}@"));
        s
    };
    let (announced, silent) = (server("gw-announced#1"), server("gw-silent#1"));
    f.seed(&announced, 1_000).await;
    f.seed(&silent, 1_000).await;
    // gw-silent stopped heartbeating long ago; nobody announced its death.
    let _: () = f
        .query(
            redis::cmd("ZADD")
                .arg(f.keys.servers())
                .arg(1)
                .arg(silent.as_str()),
        )
        .await;
    let _: () = f
        .query(redis::cmd("DEL").arg(f.keys.server_alive(&silent)))
        .await;

    let worker = WorkerProcess::start(&as_role("janitor-worker"));
    let out = janitor(&as_role("janitor-emitter"))
        .args(["emit", "server-dead", "gw-announced#1"])
        .output()
        .unwrap();
    assert!(out.status.success(), "emitter: {:?}", text(&out));
    // A malformed entry: the worker dead-letters it, the operator replays and purges it.
    f.publish_junk().await;
    // The announced server is cleaned before the reconciler looks: a fenced server with
    // entries left is reported again by design, which would make this count 2.
    f.wait_idle().await;
    let out = janitor(&as_role("janitor-reconciler"))
        .args(["reconcile", "--once"])
        .output()
        .unwrap();
    assert!(out.status.success(), "reconciler: {:?}", text(&out));
    assert!(text(&out).0.contains("1 published"), "{:?}", text(&out));
    f.wait_idle().await;
    assert_eq!(f.still_pointing(&announced, 1_000).await, 0);
    assert_eq!(f.still_pointing(&silent, 1_000).await, 0);
    let out = janitor(&as_role("janitor-operator"))
        .args(["status", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "operator status: {:?}", text(&out));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["format"]["in_use"], 1, "{status}");
    // The data format: the operator reads it, and sets it (to the live worker's format).
    for args in [&["format", "status"][..], &["format", "set", "1"][..]] {
        let out = janitor(&as_role("janitor-operator"))
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "operator {args:?}: {:?}", text(&out));
    }
    let out = janitor(&as_role("janitor-operator"))
        .args(["dead-letters", "list"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "operator dead-letters: {:?}",
        text(&out)
    );
    assert_eq!(f.dead_letters().await.len(), 1);
    let out = janitor(&as_role("janitor-operator"))
        .args(["dead-letters", "replay", "--all"])
        .output()
        .unwrap();
    assert!(out.status.success(), "operator replay: {:?}", text(&out));
    f.wait_idle().await;
    let out = janitor(&as_role("janitor-operator"))
        .args(["dead-letters", "purge", "--all", "--yes"])
        .output()
        .unwrap();
    assert!(out.status.success(), "operator purge: {:?}", text(&out));
    assert!(f.dead_letters().await.is_empty());
    worker.signal("TERM");
    let (status, log) = worker.wait(Duration::from_secs(10));
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert!(
        !log.contains("NoPerm") && !log.to_lowercase().contains("no permissions"),
        "the worker needed a permission it lacks:\n{log}"
    );
    connection_server_runs_the_protocol(&f, &connect(&as_role("connection-server")), &announced)
        .await;
    // `status` is also the worker role's (the ACL example says so); it reads the refusal
    // notes that the connection server has now written.
    let out = janitor(&as_role("janitor-worker"))
        .args(["status"])
        .output()
        .unwrap();
    assert!(out.status.success(), "worker status: {:?}", text(&out));
    assert!(text(&out).0.contains("gw-announced#1"), "{:?}", text(&out));

    // Outside its rules a role fails, and the error names what was refused.
    let out = janitor(&as_role("janitor-emitter"))
        .args(["status"])
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    // Checked by the refusal's code (redis-rs names NOPERM `NoPerm`) and the command it
    // names, not by the server's wording, which differs between Redis and Valkey versions.
    assert!(
        stderr.contains("NoPerm") && stderr.to_lowercase().contains("xlen"),
        "{stderr}"
    );
    let out = janitor(&as_role("janitor-worker"))
        .args(["dead-letters", "purge", "--all", "--yes"])
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    // Newer servers word a key refusal `No permissions to access a key`: the code, not
    // the words.
    assert!(
        !out.status.success() && stderr.contains("NoPerm"),
        "{stderr}"
    );
}

/// As the `connection-server` user, with only its ACL rules: the protocol of protocol/*.lua
/// in both layouts, refused as FENCED on `fenced` (which the worker fenced under its own
/// rules); and refused by the ACL for what a connection server never runs.
async fn connection_server_runs_the_protocol(f: &Fixture, conn: &RedisConn, fenced: &ServerId) {
    let live = server("gw-live#1");
    let hash = Registry::new(f.keys.clone(), Layout::Hash);
    for registry in [hash.clone(), Registry::new(f.keys.clone(), Layout::Keys)] {
        registry.heartbeat(conn, &live, 60_000).await.unwrap();
        for u in [&b"cs-a"[..], b"cs-b"] {
            registry.register(conn, u, &live).await.unwrap();
        }
        let route = registry.route(conn, b"cs-a").await.unwrap();
        assert_eq!(route.as_deref(), Some(live.as_str()));
        registry.unregister(conn, b"cs-a", &live).await.unwrap();
        assert_eq!(registry.route(conn, b"cs-a").await.unwrap(), None);
        assert_eq!(registry.owner(&f.conn, b"cs-a").await.unwrap(), None);
        let owner = registry.owner(&f.conn, b"cs-b").await.unwrap();
        assert_eq!(owner.as_deref(), Some(live.as_str()));
        registry.unregister(conn, b"cs-b", &live).await.unwrap();
    }
    let members: usize = f
        .query(redis::cmd("SCARD").arg(f.keys.server_users(&live)))
        .await;
    assert_eq!(members, 0);

    // The worker fenced `fenced`: its writes are refused, and the refusals are noted.
    let refused = hash.heartbeat(conn, fenced, 60_000).await;
    assert!(matches!(refused, Err(Error::Fenced { .. })), "{refused:?}");
    let refused = hash.register(conn, b"cs-late", fenced).await;
    assert!(matches!(refused, Err(Error::Fenced { .. })), "{refused:?}");
    assert_eq!(hash.owner(&f.conn, b"cs-late").await.unwrap(), None);
    let notes: Vec<Option<u64>> = f
        .query(
            redis::cmd("HMGET")
                .arg(f.keys.server_refusals(fenced))
                .arg("heartbeat")
                .arg("register"),
        )
        .await;
    assert_eq!(notes, [Some(1), Some(1)]);
    // A routing lookup never returns the fenced owner; it only reads (the entry, written
    // behind the back of the finished cleanup, is the drift sweep's to delete).
    for registry in [hash.clone(), Registry::new(f.keys.clone(), Layout::Keys)] {
        registry
            .register_legacy(&f.conn, b"cs-stale", fenced)
            .await
            .unwrap();
        assert_eq!(registry.route(conn, b"cs-stale").await.unwrap(), None);
        assert_eq!(
            registry
                .owner(&f.conn, b"cs-stale")
                .await
                .unwrap()
                .as_deref(),
            Some(fenced.as_str())
        );
    }

    // Outside its rules: the streams, and lifting a fence.
    let (fence, events) = (f.keys.server_fence(fenced), f.keys.events());
    for line in [
        format!("XADD {events} * type server.dead"),
        format!("XLEN {events}"),
        format!("DEL {fence}"),
        format!("HDEL {fence} fenced_at_ms"),
        format!("PEXPIRE {fence} 1"),
    ] {
        let mut words = line.split_whitespace();
        let mut cmd = redis::cmd(words.next().unwrap());
        cmd.arg(words.collect::<Vec<_>>());
        let reply: redis::RedisResult<redis::Value> = cmd.query_async(&mut conn.clone()).await;
        assert!(
            reply.as_ref().is_err_and(|e| e.code() == Some("NOPERM")),
            "connection-server must be refused `{line}`: {reply:?}"
        );
    }
    assert!(registry_janitor::fence::is_fenced(&f.conn, &f.keys, fenced)
        .await
        .unwrap());

    // Layout conns: the connection scripts and the lookup of every live connection.
    let conns = Registry::new(f.keys.clone(), Layout::Conns);
    for connection in ["phone", "laptop"] {
        conns
            .register_connection(conn, b"cs-c", connection, &live)
            .await
            .unwrap();
    }
    assert_eq!(
        conns.route_user(conn, b"cs-c").await.unwrap(),
        vec![live.as_str()]
    );
    let refused = conns
        .register_connection(conn, b"cs-c", "tab", fenced)
        .await;
    assert!(matches!(refused, Err(Error::Fenced { .. })), "{refused:?}");
    for connection in ["phone", "laptop"] {
        conns
            .unregister_connection(conn, b"cs-c", connection, &live)
            .await
            .unwrap();
    }
    let left: u64 = f
        .query(redis::cmd("EXISTS").arg(f.keys.user_conns(b"cs-c")))
        .await;
    assert_eq!(left, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_come_from_a_file_or_a_variable_and_are_never_shown() {
    let f = Fixture::on(
        redis_with(&["--requirepass", "hunter2-pw"]),
        Layout::Hash,
        |s| {
            s.redis_url = s.redis_url.replace("redis://", "redis://:hunter2-pw@");
        },
    );
    let dead = server("gw-pw#1");
    f.seed(&dead, 100).await;
    f.kill(&dead).await;
    let plain = {
        let mut s = f.settings.clone();
        s.redis_url = f.redis.url();
        s
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("password");
    std::fs::write(&file, "hunter2-pw\n").unwrap();

    let worker = WorkerProcess::start_with(
        &plain,
        &[("JANITOR_REDIS_PASSWORD_FILE", file.to_str().unwrap())],
    );
    f.wait_idle().await;
    worker.signal("TERM");
    let (status, log) = worker.wait(Duration::from_secs(10));
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert!(!log.contains("hunter2"), "{log}");
    assert_eq!(f.still_pointing(&dead, 100).await, 0);

    let out = janitor(&plain)
        .env("JANITOR_REDIS_PASSWORD", "hunter2-pw")
        .args(["status", "--json"])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(!stdout.contains("hunter2") && !stderr.contains("hunter2"));
    // A wrong password: a clear error that does not repeat the password.
    let out = janitor(&plain)
        .env("JANITOR_REDIS_PASSWORD", "wrong-secret")
        .args(["status"])
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(!stderr.contains("wrong-secret"), "{stderr}");
    assert!(
        stderr.contains("WRONGPASS") || stderr.to_lowercase().contains("auth"),
        "{stderr}"
    );
}

/// A Redis Cluster over mutual TLS (`tls-cluster yes`, client certificates required): the
/// janitor knows only `rediss://` seeds and the certificate files, as an operator would
/// configure it. A worker cleans a dead server (the per-slot steps reach every master
/// over TLS), `status` reads the cluster, and the reconciler's drift sweep (SCAN on each
/// master, over a TLS connection of its own) removes drift. A CA that did not sign the
/// servers' certificates is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_runs_over_mutual_tls() {
    use registry_janitor::{
        config::Settings, conn, keys::Keys, metrics::Metrics, reconcile::Reconciler, status,
    };
    use registry_janitor_testkit::RedisCluster;
    init_logs();
    if !RedisCluster::supported() {
        cannot_run("this redis-server cannot run a cluster (or redis-cli is missing)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    certificates(dir.path(), "good");
    certificates(dir.path(), "other");
    let p = |f: &str| dir.path().join(f).to_string_lossy().into_owned();
    let mut tls_ports = Vec::new();
    let (cert, key, ca) = (
        p("good-server.pem"),
        p("good-server-key.pem"),
        p("good-ca.pem"),
    );
    let cluster = {
        let per_node = || {
            let port = free_addr().rsplit(':').next().unwrap().to_owned();
            tls_ports.push(port.clone());
            [
                "--tls-port",
                &port,
                "--tls-cluster",
                "yes",
                "--tls-cert-file",
                &cert,
                "--tls-key-file",
                &key,
                "--tls-ca-cert-file",
                &ca,
                "--tls-auth-clients",
                "yes",
            ]
            .map(str::to_owned)
            .to_vec()
        };
        RedisCluster::start_with(3, 0, per_node).expect("start a local TLS cluster")
    };
    let layout = Layout::Keys;
    // Seeding and checking go over the plain ports; the janitor talks TLS only.
    let plain = cluster_settings(&cluster, layout);
    let plain_conn = conn::shared_for(&conn::target_for(&plain).unwrap())
        .await
        .unwrap();
    let keys = Keys::for_settings(&plain);
    let registry = Registry::new(keys.clone(), layout);
    let tls_with = |ca: &str| -> Settings {
        let mut s = plain.clone();
        s.redis_url = format!("rediss://127.0.0.1:{}", tls_ports[0]);
        s.redis_cluster_seeds = tls_ports[1..]
            .iter()
            .map(|port| format!("rediss://127.0.0.1:{port}"))
            .collect();
        s.tls_ca_file = Some(p(ca).into());
        s.tls_cert_file = Some(p("good-client.pem").into());
        s.tls_key_file = Some(p("good-client-key.pem").into());
        s.validate().expect("valid TLS cluster settings");
        s
    };
    let tls = tls_with("good-ca.pem");

    let (dead, live, ghost) = (
        ServerId::parse("gw-tls-dead#1").unwrap(),
        ServerId::parse("gw-tls-live#1").unwrap(),
        ServerId::parse("gw-tls-ghost#1").unwrap(),
    );
    seed(&registry, &plain_conn, &dead, 3_000).await;
    seed(&registry, &plain_conn, &live, 1_000).await;
    registry
        .register(&plain_conn, &user(&dead, 7), &live)
        .await
        .unwrap();
    let tls_conn = conn::shared_for(&conn::target_for(&tls).unwrap())
        .await
        .unwrap();
    let worker = spawn_worker(&tls);
    kill(&tls_conn, &keys, &dead).await;
    wait_until(
        &cluster.nodes[0],
        "the dead server cleaned over TLS",
        Duration::from_secs(60),
        || async {
            status::collect_from(&tls_conn, &keys)
                .await
                .is_ok_and(|s| s.is_idle())
        },
    )
    .await;
    assert_eq!(
        still_pointing(&registry, &plain_conn, &dead, 3_000).await,
        0
    );
    assert_eq!(
        still_pointing(&registry, &plain_conn, &live, 1_000).await,
        1_000
    );
    assert_eq!(
        registry
            .owner(&plain_conn, &user(&dead, 7))
            .await
            .unwrap()
            .as_deref(),
        Some(live.as_str())
    );
    worker.stop().await;

    // Drift: entries of a server no index knows, found by SCAN on every master over TLS.
    let mut c = plain_conn.clone();
    for n in 0..200 {
        let _: () = redis::cmd("SET")
            .arg(keys.user(&user(&ghost, n)))
            .arg(ghost.as_str())
            .query_async(&mut c)
            .await
            .unwrap();
    }
    let report = Reconciler::new(&tls, Metrics::new())
        .await
        .unwrap()
        .run_once()
        .await
        .unwrap();
    assert_eq!(report.sweep.entries_removed, 200, "{report}");
    assert_eq!(still_pointing(&registry, &plain_conn, &ghost, 200).await, 0);

    // A CA that did not sign the servers' certificates: refused, not a hang.
    let wrong = tls_with("other-ca.pem");
    let refused = tokio::time::timeout(Duration::from_secs(30), async {
        let conn = conn::shared_for(&conn::target_for(&wrong)?).await?;
        status::collect_from(&conn, &keys).await
    })
    .await
    .expect("a wrong CA fails, it does not hang");
    assert!(refused.is_err(), "a wrong CA was accepted");
}
