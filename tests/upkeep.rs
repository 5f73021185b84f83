//! Stream upkeep: retention never drops what a group still needs, and consumer expiry
//! never removes a consumer that holds pending entries.

mod common;

use std::time::Duration;

use common::*;
use registry_janitor::{config::Layout, keys::GROUP, maintenance, stream};

async fn ids(f: &Fixture) -> Vec<String> {
    read_stream(&f.conn, &f.keys.events())
        .await
        .into_iter()
        .map(|e| e.id)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trimming_keeps_pending_and_unread_entries() {
    let f = Fixture::new(Layout::Hash);
    stream::ensure_group(&f.conn, &f.keys).await.unwrap();
    let stuck = f.kill(&server("gw-stuck#1")).await;
    stream::read_new(&f.conn, &f.keys, "crashed", 1, 100)
        .await
        .unwrap(); // pending forever
    let mut later = Vec::new();
    for i in 0..4 {
        later.push(f.kill(&server(&format!("gw-{i}#1"))).await);
    }
    let read = stream::read_new(&f.conn, &f.keys, "done", 2, 100)
        .await
        .unwrap();
    for e in &read {
        stream::ack(&f.conn, &f.keys, &e.id).await.unwrap();
    }
    // Entry 1 is pending, 2 and 3 acknowledged, 4 and 5 not yet delivered: nothing before
    // the pending one may go, and nothing at all is older than it, so nothing is trimmed.
    let removed = maintenance::trim_acknowledged(&f.conn, &f.keys, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(removed, 0);
    assert_eq!(ids(&f).await.len(), 5);

    // Once the stuck entry is acknowledged, the acknowledged prefix goes; undelivered stay.
    stream::ack(&f.conn, &f.keys, &stuck).await.unwrap();
    let removed = maintenance::trim_acknowledged(&f.conn, &f.keys, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(removed, 3);
    assert_eq!(ids(&f).await, later[2..].to_vec());

    // Retention: acknowledged entries younger than the retention time are kept.
    let read = stream::read_new(&f.conn, &f.keys, "done", 10, 100)
        .await
        .unwrap();
    for e in &read {
        stream::ack(&f.conn, &f.keys, &e.id).await.unwrap();
    }
    let removed = maintenance::trim_acknowledged(&f.conn, &f.keys, Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(removed, 0);
    assert_eq!(ids(&f).await.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trimming_respects_every_group_on_the_stream() {
    let f = Fixture::new(Layout::Hash);
    stream::ensure_group(&f.conn, &f.keys).await.unwrap();
    // Another system reads the same stream with its own group, and has read nothing yet.
    let _: () = f
        .query(
            redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(f.keys.events())
                .arg("audit")
                .arg("0"),
        )
        .await;
    for i in 0..3 {
        f.kill(&server(&format!("gw-{i}#1"))).await;
    }
    for e in stream::read_new(&f.conn, &f.keys, "w", 10, 100)
        .await
        .unwrap()
    {
        stream::ack(&f.conn, &f.keys, &e.id).await.unwrap();
    }
    let removed = maintenance::trim_acknowledged(&f.conn, &f.keys, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(removed, 0, "the audit group has not read them");
    assert_eq!(ids(&f).await.len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_trims_what_it_acknowledged() {
    let f = Fixture::with(Layout::Hash, |s| {
        s.retention_ms = 0;
        s.maintenance_interval_ms = 100;
    });
    let worker = spawn_worker(&f.settings);
    for i in 0..5 {
        f.kill(&server(&format!("gw-{i}#1"))).await;
    }
    f.wait_idle().await;
    wait_until(
        &f.redis,
        "the stream trimmed to nothing",
        Duration::from_secs(10),
        || async { ids(&f).await.is_empty() },
    )
    .await;
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_with_pending_entries_are_never_expired() {
    let f = Fixture::new(Layout::Hash);
    stream::ensure_group(&f.conn, &f.keys).await.unwrap();
    stream::register_consumer(&f.conn, &f.keys, "gone")
        .await
        .unwrap();
    f.kill(&server("gw-1#1")).await;
    stream::read_new(&f.conn, &f.keys, "gone-with-work", 1, 100)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let removed = maintenance::expire_consumers(&f.conn, &f.keys, Duration::from_millis(200))
        .await
        .unwrap();
    assert_eq!(removed, vec!["gone".to_owned()]);
    let consumers: Vec<redis::Value> = f
        .query(
            redis::cmd("XINFO")
                .arg("CONSUMERS")
                .arg(f.keys.events())
                .arg(GROUP),
        )
        .await;
    assert_eq!(
        consumers.len(),
        1,
        "the consumer holding a pending entry stays"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_live_worker_registers_itself_again() {
    let f = Fixture::new(Layout::Hash);
    let worker = spawn_worker(&f.settings);
    let listed = || async {
        registry_janitor::status::collect_from(&f.conn, &f.keys)
            .await
            .is_ok_and(|s| s.consumers.iter().any(|c| c.name == worker.consumer))
    };
    wait_until(
        &f.redis,
        "the worker is listed",
        Duration::from_secs(10),
        listed,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Redis 7.2 (and Valkey) changed what XINFO CONSUMERS' `idle` means: the time since the
    // consumer's last attempted read or claim, which a worker blocked on an empty stream
    // refreshes; and they added `inactive` (since its last successful one). On 7.0, `idle`
    // is the time since the last successful interaction, so a live but idle worker looks
    // gone. The field tells which server this is.
    let consumers: Vec<std::collections::HashMap<String, redis::Value>> = f
        .query(
            redis::cmd("XINFO")
                .arg("CONSUMERS")
                .arg(f.keys.events())
                .arg(registry_janitor::keys::GROUP),
        )
        .await;
    let attempts_refresh_idle = consumers.iter().all(|c| c.contains_key("inactive"));
    let removed = maintenance::expire_consumers(&f.conn, &f.keys, Duration::from_millis(200))
        .await
        .unwrap();
    if attempts_refresh_idle {
        assert!(
            removed.is_empty(),
            "a live worker blocked on its reads is not idle on Redis 7.2+: {removed:?}"
        );
        worker.stop().await;
        return;
    }
    assert_eq!(
        removed,
        vec![worker.consumer.clone()],
        "idle with nothing pending looks gone on Redis 7.0"
    );
    wait_until(
        &f.redis,
        "the worker is listed again",
        Duration::from_secs(10),
        listed,
    )
    .await;
    worker.stop().await;
}

/// The entries of `stream`, counted.
async fn len(f: &Fixture, stream: &str) -> u64 {
    f.query(redis::cmd("XLEN").arg(stream)).await
}

fn unacked_trimmed(metrics: &registry_janitor::metrics::Metrics, stream: &str, group: &str) -> u64 {
    counter_of(
        metrics,
        &format!(
            "registry_janitor_stream_unacked_trimmed_total{{group=\"{group}\",stream=\"{stream}\"}}"
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgotten_group_no_longer_pins_the_evictions_stream_past_the_hard_bound() {
    let f = Fixture::with(Layout::Hash, |s| {
        s.retention_ms = 0;
        s.maintenance_interval_ms = 100;
        s.stream_max_age_ms = 4000;
    });
    let evictions = f.keys.evictions().unwrap().to_owned();
    // A group made while debugging, then forgotten: it read one entry and acknowledged
    // nothing.
    let _: () = f
        .query(
            redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(&evictions)
                .arg("forgotten")
                .arg("$")
                .arg("MKSTREAM"),
        )
        .await;
    let gw = server("gw-1#1");
    f.seed(&gw, 2500).await;
    let worker = spawn_worker(&f.settings);
    f.kill(&gw).await;
    f.wait_idle().await;
    worker.settled().await;
    assert_eq!(f.still_pointing(&gw, 2500).await, 0);
    let _: redis::Value = f
        .query(
            redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg("forgotten")
                .arg("debugger")
                .arg("COUNT")
                .arg(1)
                .arg("STREAMS")
                .arg(&evictions)
                .arg(">"),
        )
        .await;
    // Every entry written is either still in the stream or counted as trimmed
    // unacknowledged: the group acknowledged none. users.evicted entries, and one
    // server.cleaned.
    let written = counter_of(&worker.metrics, "registry_janitor_evictions_entries_total") + 1;
    assert!(
        written >= 4,
        "2,500 users in entries of at most 1,000, and server.cleaned"
    );
    let young = len(&f, &evictions).await;
    assert!(
        young > 0,
        "retention (0 ms) trims nothing the group has not acknowledged"
    );
    assert_eq!(
        young + unacked_trimmed(&worker.metrics, &evictions, "forgotten"),
        written
    );
    // Past the hard bound every entry goes, the one pending in the group included.
    wait_until(
        &f.redis,
        "the evictions stream trimmed past stream_max_age_ms",
        Duration::from_secs(30),
        || async { len(&f, &evictions).await == 0 },
    )
    .await;
    // The group's gauges: its one pending entry stays in its pending list after the
    // entry itself is trimmed.
    let pending = || {
        sample(
            &worker.metrics.render(),
            &format!(
                "registry_janitor_stream_group_pending{{group=\"forgotten\",stream=\"{evictions}\"}}"
            ),
        )
    };
    wait_until(
        &f.redis,
        "the group's gauge",
        Duration::from_secs(10),
        || async { pending() == Some(1.0) },
    )
    .await;
    let counted = || unacked_trimmed(&worker.metrics, &evictions, "forgotten");
    wait_until(
        &f.redis,
        "the trim counted",
        Duration::from_secs(10),
        || async { counted() == written },
    )
    .await;
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hard_bound_never_trims_what_the_workers_group_still_needs() {
    let f = Fixture::new(Layout::Hash);
    let events = f.keys.events();
    let bound = Duration::from_millis(300);
    // Before the workers' group exists, the events wait for it whatever their age, even
    // with another group on the stream.
    let first = f.kill(&server("gw-early#1")).await;
    let _: () = f
        .query(
            redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(&events)
                .arg("audit")
                .arg("0"),
        )
        .await;
    tokio::time::sleep(bound * 2).await;
    let report = maintenance::trim_streams(&f.conn, &f.keys, Duration::ZERO, bound)
        .await
        .unwrap();
    assert_eq!(report.removed, 0);
    assert_eq!(ids(&f).await, vec![first.clone()]);

    // The workers' group: the first event pending in a crashed worker, two more never
    // delivered; every one older than the bound. None goes.
    stream::ensure_group(&f.conn, &f.keys).await.unwrap();
    let crashed = stream::read_new(&f.conn, &f.keys, "crashed", 1, 100)
        .await
        .unwrap();
    assert_eq!(crashed[0].id, first);
    let mut later = vec![first.clone()];
    for i in 0..2 {
        later.push(f.kill(&server(&format!("gw-{i}#1"))).await);
    }
    tokio::time::sleep(bound * 2).await;
    let report = maintenance::trim_streams(&f.conn, &f.keys, Duration::ZERO, bound)
        .await
        .unwrap();
    assert_eq!(report.removed, 0, "{report:?}");
    assert_eq!(ids(&f).await, later);
    let ours = report
        .groups
        .iter()
        .find(|g| g.stream == events && g.group == GROUP)
        .unwrap();
    assert_eq!(ours.pending, 1);
    assert!(ours.oldest_unacked_age_ms.unwrap() >= bound.as_millis() as u64);

    // Once the workers handled the first, it goes past the bound though the audit group
    // never read it; the two the workers have not read stay.
    stream::ack(&f.conn, &f.keys, &first).await.unwrap();
    let metrics = registry_janitor::metrics::Metrics::new();
    let report = maintenance::trim_streams(&f.conn, &f.keys, Duration::ZERO, bound)
        .await
        .unwrap();
    maintenance::observe(&metrics, &report, &mut Default::default());
    assert_eq!(report.removed, 1);
    assert_eq!(ids(&f).await, later[1..].to_vec());
    assert_eq!(unacked_trimmed(&metrics, &events, "audit"), 1);
    assert_eq!(unacked_trimmed(&metrics, &events, GROUP), 0);
    let age = sample(
        &metrics.render(),
        &format!(
            "registry_janitor_stream_group_oldest_unacked_age_seconds{{group=\"audit\",stream=\"{events}\"}}"
        ),
    )
    .unwrap();
    assert!(age >= bound.as_secs_f64(), "{age}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_go_past_the_hard_bound_and_are_counted() {
    let f = Fixture::new(Layout::Hash);
    let bound = Duration::from_millis(300);
    let dead = f.keys.dead_letters();
    for _ in 0..3 {
        let _: String = f
            .query(
                redis::cmd("XADD")
                    .arg(&dead)
                    .arg("*")
                    .arg("type")
                    .arg("server.dead")
                    .arg("error")
                    .arg("test"),
            )
            .await;
    }
    // Retention alone keeps dead letters: they wait for an operator.
    let report = maintenance::trim_streams(&f.conn, &f.keys, Duration::ZERO, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(report.removed, 0);
    assert_eq!(len(&f, &dead).await, 3);
    tokio::time::sleep(bound * 2).await;
    let metrics = registry_janitor::metrics::Metrics::new();
    let report = maintenance::trim_streams(&f.conn, &f.keys, Duration::ZERO, bound)
        .await
        .unwrap();
    maintenance::observe(&metrics, &report, &mut Default::default());
    assert_eq!(len(&f, &dead).await, 0);
    assert_eq!(
        counter_of(&metrics, "registry_janitor_dead_letters_expired_total"),
        3
    );
}
