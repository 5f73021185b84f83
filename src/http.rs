//! The metrics and health listener: `/metrics`, `/healthz`, `/readyz`, nothing else.
//!
//! - `/healthz` (liveness): the process's main loop has turned recently. A Redis outage
//!   does not fail it (the loop keeps turning while it retries); a stuck loop does.
//! - `/readyz` (readiness): nothing of the process's work is failing on a transient Redis
//!   state, Redis answers and, for a worker, its consumer can be registered in the group
//!   (a write: refused under OOM, NOREPLICAS, MISCONF, READONLY).
//! - `/metrics`: the Prometheus text format of this process's registry.
//!
//! The listener is handed a bound [`TcpListener`], so tests bind port 0.

use std::{
    convert::Infallible,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use crate::conn::RedisConn;
use http_body_util::Full;
use hyper::{
    body::Bytes, server::conn::http1, service::service_fn, Method, Request, Response, StatusCode,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use crate::{
    keys::{Keys, GROUP},
    metrics::Metrics,
    retry::Failing,
};

/// Liveness: when the main loop last turned.
#[derive(Debug)]
pub struct Health {
    last_beat_ms: AtomicU64,
    /// How long without a beat counts as stuck.
    stall_after: Duration,
}

impl Health {
    pub fn new(stall_after: Duration) -> Arc<Self> {
        Arc::new(Health {
            last_beat_ms: AtomicU64::new(crate::now_ms()),
            stall_after,
        })
    }

    /// Called by the main loop each time it turns.
    pub fn beat(&self) {
        self.last_beat_ms.store(crate::now_ms(), Ordering::Relaxed);
    }

    /// Milliseconds since the last beat.
    pub fn silent_for_ms(&self) -> u64 {
        crate::now_ms().saturating_sub(self.last_beat_ms.load(Ordering::Relaxed))
    }

    pub fn is_live(&self) -> bool {
        self.silent_for_ms() <= self.stall_after.as_millis() as u64
    }
}

/// Readiness: can this process do its job right now?
///
/// Not ready while any of its work is failing on a transient Redis state (see
/// [`Failing`]: BUSY, LOADING, OOM, NOREPLICAS, MISCONF, READONLY, a refused connection...),
/// while Redis does not answer PING, and, for a worker, while its consumer cannot be
/// registered in the group.
#[derive(Clone)]
pub struct Readiness {
    pub conn: RedisConn,
    pub keys: Keys,
    /// A worker's consumer name; None for the reconciler. The worker's probe runs
    /// `XGROUP CREATECONSUMER` for it: a write (flagged `denyoom`) that changes nothing
    /// when the consumer exists, so Redis refuses it in every state that refuses the
    /// worker's writes (OOM, NOREPLICAS, MISCONF, READONLY) and when the group is gone,
    /// even while the worker has nothing to do. (A consumer removed by consumer expiry is
    /// registered again, as the worker itself does between reads.)
    pub consumer: Option<String>,
    /// The work of this process failing right now.
    pub failing: Arc<Failing>,
}

impl Readiness {
    pub async fn check(&self) -> Result<(), String> {
        if let Some((what, error)) = self.failing.any() {
            return Err(format!("{what} failing: {error}"));
        }
        let mut c = self.conn.clone();
        let check = async {
            let _: String = redis::cmd("PING")
                .query_async(&mut c)
                .await
                .map_err(|e| format!("redis: {e}"))?;
            if let Some(consumer) = &self.consumer {
                let registered: redis::RedisResult<i64> = redis::cmd("XGROUP")
                    .arg("CREATECONSUMER")
                    .arg(self.keys.events())
                    .arg(GROUP)
                    .arg(consumer)
                    .query_async(&mut c)
                    .await;
                match registered {
                    Ok(_) => {}
                    Err(e) if e.code() == Some("NOGROUP") => {
                        return Err(format!("consumer group {GROUP} does not exist yet"))
                    }
                    Err(e) => return Err(format!("consumer group: {e}")),
                }
            }
            Ok(())
        };
        tokio::time::timeout(Duration::from_secs(2), check)
            .await
            .unwrap_or_else(|_| Err("redis did not answer within 2 s".into()))
    }
}

/// Binds the listener for `addr`.
pub async fn bind(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    metrics: Metrics,
    health: Arc<Health>,
    ready: Readiness,
    shutdown: CancellationToken,
) {
    if let Ok(addr) = listener.local_addr() {
        info!(%addr, "serving /metrics, /healthz and /readyz");
    }
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    debug!(error = %e, "accept failed");
                    continue;
                }
            },
            _ = shutdown.cancelled() => return,
        };
        let (metrics, health, ready) = (metrics.clone(), health.clone(), ready.clone());
        let service = service_fn(move |req| {
            let (metrics, health, ready) = (metrics.clone(), health.clone(), ready.clone());
            async move { Ok::<_, Infallible>(respond(req, &metrics, &health, &ready).await) }
        });
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(5))
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                r = conn => if let Err(e) = r { debug!(%peer, error = %e, "metrics connection ended"); },
                _ = shutdown.cancelled() => {}
            }
        });
    }
}

async fn respond(
    req: Request<hyper::body::Incoming>,
    metrics: &Metrics,
    health: &Health,
    ready: &Readiness,
) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n".into());
    }
    match req.uri().path() {
        "/metrics" => {
            let mut r = text(StatusCode::OK, metrics.render());
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            r
        }
        "/healthz" if health.is_live() => text(StatusCode::OK, "ok\n".into()),
        "/healthz" => text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "stalled: the main loop has not turned for {} ms\n",
                health.silent_for_ms()
            ),
        ),
        "/readyz" => match ready.check().await {
            Ok(()) => text(StatusCode::OK, "ready\n".into()),
            Err(why) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {why}\n"),
            ),
        },
        _ => text(
            StatusCode::NOT_FOUND,
            "not found: /metrics, /healthz, /readyz\n".into(),
        ),
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r
}
