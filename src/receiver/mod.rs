//! The Alertmanager webhook receiver (`registry-janitor alert-receiver`): an HTTP(S)
//! listener that takes Alertmanager's webhook on `POST /alerts` and publishes one
//! `server.dead` per firing alert that names a server (label `alert_receiver_label`).
//!
//! It owns the listener, authentication (bearer token, compared in constant time), the
//! body limit, TLS, the answer codes and the receiver's metrics. What an alert becomes is
//! `webhook`; publishing it exactly once is `publish`.
//!
//! The answer tells Alertmanager what to do next: 200 when every alert is handled; 422
//! (not retried by Alertmanager) when some alert was refused, the rest of the batch being
//! handled; 400/401/413 for a request that is wrong as a whole (nothing published); 503
//! (retried) when Redis did not take every valid firing alert within [`REDIS_DEADLINE`].
//! A 2xx is sent only after every valid firing alert's event is in the stream.

mod credentials;
pub(crate) mod publish;
pub(crate) mod webhook;

use std::{
    convert::Infallible,
    sync::Arc,
    time::{Duration, Instant},
};

use http_body_util::{BodyExt, Full, Limited};
use hyper::{
    body::{Bytes, Incoming},
    header::{HeaderValue, AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, WWW_AUTHENTICATE},
    server::conn::http1,
    service::service_fn,
    Method, Request, Response, StatusCode,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpListener,
};
use tokio_rustls::TlsAcceptor;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{debug, info, warn};

use crate::{
    config::Settings,
    conn::RedisConn,
    error::{Error, Result},
    health::{Failing, Health, Readiness},
    keys::Keys,
    metrics::{alert_outcome, Metrics},
    retry::Watch,
};
use credentials::constant_time_eq;
pub use credentials::{read_token, tls_acceptor};
use publish::Published;
use webhook::{Answer, Decision, Refusal};

/// The path Alertmanager posts to.
pub const PATH: &str = "/alerts";
/// The longest a request waits for Redis to take its events before it is answered 503
/// (Alertmanager sends it again). Transient states (an outage, LOADING, BUSY, OOM...) are
/// retried with backoff until then.
pub const REDIS_DEADLINE: Duration = Duration::from_secs(10);
/// The longest a client may take to send a request's headers, its body, or a TLS
/// handshake.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);

/// The receiver's checked settings and its Redis connection. Cheap to clone.
#[derive(Clone)]
pub struct Receiver {
    inner: Arc<Inner>,
}

struct Inner {
    conn: RedisConn,
    keys: Keys,
    label: String,
    ttl_ms: u64,
    /// The bearer token, or None with `alert_receiver_auth = "off"`.
    token: Option<Vec<u8>>,
    max_body: usize,
    metrics: Metrics,
    watch: Watch,
    /// Never cancelled: a request in flight at shutdown waits for Redis until its own
    /// deadline ([`REDIS_DEADLINE`], shorter than the drain), so that it gets its real
    /// answer.
    no_cancel: CancellationToken,
}

impl Receiver {
    /// A receiver from validated settings; reads the token file (see [`read_token`]).
    pub fn new(settings: &Settings, conn: RedisConn, metrics: Metrics) -> Result<Self> {
        let keys = Keys::for_settings(settings);
        publish::check_slot(&conn, &keys)?;
        let watch = Watch {
            errors: metrics.redis_errors.clone(),
            health: Health::new(Duration::from_secs(60)),
            failing: Failing::new(),
            on_failure: None,
        };
        Ok(Receiver {
            inner: Arc::new(Inner {
                conn,
                keys,
                label: settings.alert_receiver_label.clone(),
                ttl_ms: settings.alert_receiver_dedup_ttl_ms,
                token: read_token(settings)?,
                max_body: settings.alert_receiver_max_body_bytes,
                metrics,
                watch,
                no_cancel: CancellationToken::new(),
            }),
        })
    }

    /// Liveness: the accept loop turns (see [`Receiver::serve`]).
    pub fn health(&self) -> Arc<Health> {
        self.inner.watch.health.clone()
    }

    /// Readiness: Redis answers, and no request is waiting out a Redis failure.
    pub fn readiness(&self) -> Readiness {
        Readiness {
            conn: self.inner.conn.clone(),
            keys: self.inner.keys.clone(),
            consumer: None,
            failing: self.inner.watch.failing.clone(),
            format: None,
        }
    }

    /// Serves `listener` (through `tls` if given) until `shutdown`; then stops accepting,
    /// lets the requests in flight finish (at most `drain`), and returns.
    pub async fn serve(
        &self,
        listener: TcpListener,
        tls: Option<TlsAcceptor>,
        shutdown: CancellationToken,
        drain: Duration,
    ) {
        if let Ok(addr) = listener.local_addr() {
            let scheme = if tls.is_some() { "https" } else { "http" };
            info!(%addr, "alert receiver: serving {scheme} POST {PATH}");
        }
        let connections = TaskTracker::new();
        let mut beat = tokio::time::interval(Duration::from_secs(1));
        loop {
            let (stream, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        debug!(error = %e, "accept failed");
                        continue;
                    }
                },
                _ = beat.tick() => {
                    self.inner.watch.health.beat();
                    continue;
                }
                _ = shutdown.cancelled() => break,
            };
            let (receiver, tls, shutdown) = (self.clone(), tls.clone(), shutdown.clone());
            connections.spawn(async move {
                match tls {
                    None => receiver.serve_connection(stream, shutdown).await,
                    Some(tls) => {
                        match tokio::time::timeout(CLIENT_TIMEOUT, tls.accept(stream)).await {
                            Ok(Ok(stream)) => receiver.serve_connection(stream, shutdown).await,
                            Ok(Err(e)) => debug!(%peer, error = %e, "TLS handshake failed"),
                            Err(_) => debug!(%peer, "TLS handshake timed out"),
                        }
                    }
                }
            });
        }
        connections.close();
        let open = connections.len();
        if open > 0 {
            info!(
                connections = open,
                "alert receiver: stopped accepting; finishing the requests in flight"
            );
        }
        if tokio::time::timeout(drain, connections.wait())
            .await
            .is_err()
        {
            warn!(
                ?drain,
                "alert receiver: requests still in flight after the drain timeout; abandoned \
                 (Alertmanager sends them again)"
            );
        }
    }

    /// One HTTP/1 connection; on `shutdown`, the request in flight is finished and the
    /// connection closed.
    async fn serve_connection<I>(&self, io: I, shutdown: CancellationToken)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let receiver = self.clone();
        let service = service_fn(move |req| {
            let receiver = receiver.clone();
            async move { Ok::<_, Infallible>(receiver.answer(req).await) }
        });
        let conn = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(CLIENT_TIMEOUT)
            .serve_connection(TokioIo::new(io), service);
        tokio::pin!(conn);
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r { debug!(error = %e, "receiver connection ended"); }
            }
            _ = shutdown.cancelled() => {
                conn.as_mut().graceful_shutdown();
                if let Err(e) = conn.await { debug!(error = %e, "receiver connection ended"); }
            }
        }
    }

    /// Answers one request and counts it by status code.
    pub async fn answer(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        let in_flight = &self.inner.metrics.receiver_in_flight;
        in_flight.inc();
        let response = self.respond(req).await;
        in_flight.dec();
        self.inner
            .metrics
            .receiver_requests
            .with_label_values(&[response.status().as_str()])
            .inc();
        response
    }

    async fn respond(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        if req.uri().path() != PATH {
            return error(StatusCode::NOT_FOUND, format!("not found: POST {PATH}"));
        }
        if req.method() != Method::POST {
            let mut r = error(StatusCode::METHOD_NOT_ALLOWED, format!("only POST {PATH}"));
            r.headers_mut()
                .insert(hyper::header::ALLOW, HeaderValue::from_static("POST"));
            return r;
        }
        if !self.authorized(&req) {
            self.inner.metrics.receiver_unauthorized.inc();
            let mut r = error(
                StatusCode::UNAUTHORIZED,
                "missing or wrong bearer token (Authorization: Bearer <token>)".into(),
            );
            r.headers_mut()
                .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return r;
        }
        let too_large = || {
            error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "the body is larger than alert_receiver_max_body_bytes ({} bytes)",
                    self.inner.max_body
                ),
            )
        };
        let declared = req
            .headers()
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|n| n > self.inner.max_body as u64) {
            return too_large();
        }
        if let Some(kind) = req.headers().get(CONTENT_TYPE) {
            let kind = String::from_utf8_lossy(kind.as_bytes()).to_ascii_lowercase();
            if !kind.starts_with("application/json") {
                return error(
                    StatusCode::BAD_REQUEST,
                    format!("Content-Type must be application/json, got {kind:?}"),
                );
            }
        }
        let body = Limited::new(req.into_body(), self.inner.max_body);
        let body = match tokio::time::timeout(CLIENT_TIMEOUT, body.collect()).await {
            Err(_) => {
                return error(
                    StatusCode::REQUEST_TIMEOUT,
                    "the body did not arrive in time".into(),
                )
            }
            Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => return too_large(),
            Ok(Err(e)) => {
                return error(
                    StatusCode::BAD_REQUEST,
                    format!("cannot read the body: {e}"),
                )
            }
            Ok(Ok(collected)) => collected.to_bytes(),
        };
        let hook = match webhook::parse(&body) {
            Ok(h) => h,
            Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
        };
        debug!(receiver = %hook.receiver, group_key = %hook.group_key, alerts = hook.alerts.len(), "webhook");
        self.handle(&hook).await
    }

    /// Handles every alert of a parsed webhook, in order. Stops at the first failure to
    /// publish (503: Alertmanager sends the whole batch again, and what was published
    /// is found published).
    async fn handle(&self, hook: &webhook::Webhook) -> Response<Full<Bytes>> {
        let deadline = tokio::time::Instant::now() + REDIS_DEADLINE;
        let mut answer = Answer::default();
        for (index, alert) in hook.alerts.iter().enumerate() {
            match webhook::decide(alert, &self.inner.label) {
                Decision::Resolved => {
                    answer.resolved += 1;
                    self.count(alert_outcome::RESOLVED);
                }
                Decision::Refused(reason) => {
                    warn!(index, fingerprint = %alert.fingerprint, %reason, "alert refused");
                    self.count(alert_outcome::REFUSED);
                    answer.refused.push(Refusal {
                        index,
                        fingerprint: alert.fingerprint.clone(),
                        alertname: alert.labels.get("alertname").cloned(),
                        reason,
                    });
                }
                Decision::Publish {
                    alert_id,
                    event,
                    server,
                } => {
                    let published = self
                        .publish(alert, &alert_id, &event, &server, deadline)
                        .await;
                    match published {
                        Ok(Published::New(_)) => answer.published += 1,
                        Ok(Published::Before(_)) => answer.duplicate += 1,
                        Err(response) => return response,
                    }
                }
            }
        }
        let status = if answer.refused.is_empty() {
            StatusCode::OK
        } else {
            StatusCode::UNPROCESSABLE_ENTITY
        };
        json(
            status,
            serde_json::to_vec(&answer)
                .expect("an answer of strings and numbers always serializes to JSON"),
        )
    }

    /// Counts one alert with `outcome`.
    fn count(&self, outcome: &str) {
        self.inner
            .metrics
            .receiver_alerts
            .with_label_values(&[outcome])
            .inc()
    }

    /// Publishes a firing alert's `event` once per `alert_id`, waiting out transient
    /// states until `deadline`. Err: the response to send at once (Redis refused, or did
    /// not take the event in time; nothing is lost, Alertmanager sends again).
    async fn publish(
        &self,
        alert: &webhook::Alert,
        alert_id: &str,
        event: &crate::event::ServerDead,
        server: &crate::event::ServerId,
        deadline: tokio::time::Instant,
    ) -> std::result::Result<Published, Response<Full<Bytes>>> {
        let payload = event.encode();
        let publish = || {
            publish::publish_once(
                &self.inner.conn,
                &self.inner.keys,
                alert_id,
                &payload,
                self.inner.ttl_ms,
            )
        };
        let started = Instant::now();
        let done = tokio::time::timeout_at(
            deadline,
            self.inner
                .watch
                .retrying("publishing alerts", &self.inner.no_cancel, publish),
        )
        .await;
        match done {
            Ok(Ok(published)) => {
                match &published {
                    Published::New(entry) => {
                        self.count(alert_outcome::PUBLISHED);
                        info!(server_id = %server, %entry, event_id = %event.event_id, "alert firing; published server.dead");
                    }
                    Published::Before(entry) => {
                        self.count(alert_outcome::DUPLICATE);
                        debug!(server_id = %server, %entry, "alert already published");
                    }
                }
                Ok(published)
            }
            Ok(Err(e)) => Err(redis_failed(&e)),
            Err(_) => Err(error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "redis did not take the event of alert {} within {:?} \
                     (see /readyz); nothing is lost: send again",
                    alert.fingerprint,
                    started.elapsed()
                ),
            )),
        }
    }

    /// True when auth is off or the request carries the token, compared in constant time.
    fn authorized(&self, req: &Request<Incoming>) -> bool {
        let Some(token) = &self.inner.token else {
            return true;
        };
        let given = req
            .headers()
            .get(AUTHORIZATION)
            .map(HeaderValue::as_bytes)
            .and_then(|v| {
                let (scheme, rest) = v.split_at_checked(7)?;
                scheme.eq_ignore_ascii_case(b"bearer ").then_some(rest)
            })
            .unwrap_or_default();
        constant_time_eq(given, token)
    }
}

/// 503 for a transient failure (Alertmanager sends again), 500 for one that needs an
/// operator (a permission, a key of the wrong type); nothing was acknowledged either way.
fn redis_failed(e: &Error) -> Response<Full<Bytes>> {
    let status = if e.is_retryable() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::INTERNAL_SERVER_ERROR
    };
    warn!(error = %e, %status, "alert receiver: publishing failed");
    error(status, format!("publishing failed: {e}"))
}

fn error(status: StatusCode, message: String) -> Response<Full<Bytes>> {
    json(
        status,
        serde_json::to_vec(&serde_json::json!({ "error": message }))
            .expect("an object of one string always serializes to JSON"),
    )
}

fn json(status: StatusCode, body: Vec<u8>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compares_tokens() {
        assert!(constant_time_eq(b"s3cret", b"s3cret"));
        assert!(!constant_time_eq(b"s3cret", b"s3creT"));
        assert!(!constant_time_eq(b"s3cret", b"s3cre"));
        assert!(!constant_time_eq(b"", b"x"));
    }

    #[test]
    fn the_token_file_is_required_when_auth_is_on() {
        let mut s = Settings::defaults();
        let err = read_token(&s).unwrap_err().to_string();
        assert!(err.contains("`alert_receiver_token_file`"), "{err}");
        let file = std::env::temp_dir().join(format!("janitor-token-{}", ulid::Ulid::new()));
        s.alert_receiver_token_file = Some(file.clone());
        let err = read_token(&s).unwrap_err().to_string();
        assert!(err.contains("`alert_receiver_token_file`"), "{err}");
        std::fs::write(&file, "\n").unwrap();
        let err = read_token(&s).unwrap_err().to_string();
        assert!(err.contains("empty"), "{err}");
        std::fs::write(&file, "abc\n").unwrap();
        assert_eq!(read_token(&s).unwrap(), Some(b"abc".to_vec()));
        std::fs::remove_file(&file).unwrap();
        s.alert_receiver_auth = crate::config::ReceiverAuth::Off;
        s.alert_receiver_token_file = None;
        assert_eq!(read_token(&s).unwrap(), None);
    }
}
