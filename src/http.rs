//! The metrics and health listener: `/metrics`, `/healthz`, `/readyz`, nothing else.
//!
//! - `/healthz` answers from [`Health`], `/readyz` from [`Readiness`] (both in
//!   [`crate::health`], shared by the worker and the reconciler);
//! - `/metrics`: the Prometheus text format of this process's registry.
//!
//! The listener is handed a bound [`TcpListener`], so tests bind port 0.

use std::{convert::Infallible, sync::Arc, time::Duration};

use http_body_util::Full;
use hyper::{
    body::Bytes, server::conn::http1, service::service_fn, Method, Request, Response, StatusCode,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

pub use crate::health::{Health, Readiness};
use crate::metrics::Metrics;

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
            Ok(note) if note.is_empty() => text(StatusCode::OK, "ready\n".into()),
            Ok(note) => text(StatusCode::OK, format!("ready; {note}\n")),
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
