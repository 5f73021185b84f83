//! What can go wrong when starting and driving local Redis processes.

/// A local `redis-server` (or a cluster or Sentinel group of them) is missing, did not
/// start, or did not reach the state asked for.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The server or group did not do what was asked in time, or refused.
    #[error("local redis-server: {0}")]
    LocalRedis(String),

    /// Local I/O: starting a process, writing its configuration, finding a free port.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    /// A command to a local server failed.
    #[error("local redis-server: {0}")]
    Redis(#[from] redis::RedisError),
}

impl Error {
    /// An I/O error with what was being done.
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

/// The result of the harness's operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;
