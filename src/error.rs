//! The library's error type.
//!
//! Every error knows whether it is worth retrying ([`Error::is_retryable`]): a Redis
//! outage must be waited out and retried, never mistaken for a poison message that is
//! dead-lettered, and never turned into an acknowledgement of work that was not done.

use crate::event::EventError;

/// `Result` with the library's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting has a value the program cannot run with.
    #[error("invalid setting `{name}`: {reason}")]
    Setting {
        name: std::borrow::Cow<'static, str>,
        reason: String,
    },

    /// The settings could not be read (a bad TOML file, a value of the wrong type).
    #[error("invalid settings: {0}")]
    Settings(#[from] Box<figment::Error>),

    /// A command to Redis failed. Not chained as a `source`: redis-rs already prints its
    /// own cause in its message, and chaining it would print it twice.
    #[error("redis: {0}")]
    Redis(redis::RedisError),

    /// A `server.dead` payload that cannot be decoded or validated.
    #[error("invalid event: {0}")]
    Event(#[from] EventError),

    /// Redis answered with something this program does not expect (a script returned
    /// the wrong shape, a stream reply of an unknown form).
    #[error("unexpected reply from redis: {0}")]
    Protocol(String),

    /// Work was stopped by a shutdown before it finished; the stream entry stays pending
    /// so another worker takes it over.
    #[error("stopped by shutdown before the work was finished")]
    Cancelled,

    /// Local I/O (starting a private redis-server, reading a file).
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl From<redis::RedisError> for Error {
    fn from(e: redis::RedisError) -> Self {
        Error::Redis(e)
    }
}

impl Error {
    /// True when the same operation may succeed if tried again later: the connection
    /// dropped or timed out, Redis is loading, failing over or read-only, a script cache
    /// was flushed. False for bad data, bad settings and shutdown.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Redis(e) => redis_error_is_retryable(e),
            _ => false,
        }
    }

    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

/// Classifies a Redis error: transport failures and transient server states are
/// retryable; command errors (WRONGTYPE, a script error, no permission) are not.
pub fn redis_error_is_retryable(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind as S};
    if is_configuration_error(e) {
        return false;
    }
    if e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_cluster_error()
        || e.is_unrecoverable_error()
    {
        return true;
    }
    match e.kind() {
        ErrorKind::Server(kind) => matches!(
            kind,
            S::BusyLoading
                | S::TryAgain
                | S::ClusterDown
                | S::MasterDown
                | S::ReadOnly
                | S::NoScript
        ),
        ErrorKind::ClusterConnectionNotFound => true,
        _ => false,
    }
}

/// Failures that waiting will not fix: a certificate the client does not trust (or that
/// the server refuses), a wrong password, a missing permission. They stop a worker at
/// start-up with the message instead of retrying forever. redis-rs wraps TLS failures in
/// an I/O error whose cause cannot be downcast, so those are recognised by their text.
pub fn is_configuration_error(e: &redis::RedisError) -> bool {
    if matches!(e.kind(), redis::ErrorKind::AuthenticationFailed)
        || matches!(e.code(), Some("NOAUTH" | "WRONGPASS" | "NOPERM"))
    {
        return true;
    }
    let text = e.to_string().to_ascii_lowercase();
    text.contains("certificate") || text.contains("handshake") || text.contains("unknownissuer")
}
