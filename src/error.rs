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

    /// What the user asked for does not exist (a dead-letter id given on the command line).
    #[error("no {what} with id {id}")]
    NotFound { what: &'static str, id: String },

    /// A spawned task panicked or was cancelled before it returned.
    #[error("a task failed: {0}")]
    Task(#[from] tokio::task::JoinError),

    /// A private `redis-server` (the one `registry-janitor-lab` starts for the demo and the
    /// benchmark) is missing, did not start, or a local cluster of them did not form.
    #[error("local redis-server: {0}")]
    LocalRedis(String),

    /// The server is fenced: a `server.dead` verdict stands against this incarnation, and
    /// the connection-server protocol refuses its writes (Redis error code `FENCED`). Its
    /// connection server must close its sockets, so that clients reconnect elsewhere, and
    /// start again under a new server id. See [`crate::registry`].
    #[error("server {server} is fenced (declared dead); close its sockets and start again under a new server id")]
    Fenced { server: String },

    /// A cleanup step refused by the data format (Redis error code `FORMAT`): the format
    /// in use, or the format the cleanup's progress was written under, is outside what
    /// this worker's build works under. The cleanup stops without acknowledging, and its
    /// entry is handed over to a worker that works under the format in use. See
    /// [`crate::format`].
    #[error("the data format moved on: {0}")]
    Format(String),

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
        if e.code() == Some("FORMAT") {
            return Error::Format(e.detail().unwrap_or("").to_owned());
        }
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

    /// An [`Error::Io`] with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

/// Classifies a Redis error: transport failures and states of the server that pass are
/// retryable; errors that no waiting can fix (bad credentials, missing permission, a
/// script error, a key of the wrong type) are not. The one place this decision is made.
///
/// Server errors are classified by their code string ([`redis_code_is_transient`]), not
/// by redis-rs's `ErrorKind`: redis-rs knows some codes as `ServerErrorKind` variants and
/// reports the rest (BUSY, OOM, NOREPLICAS, MISCONF...) as `Extension` with the code, so a
/// kind-based match silently treats every code it does not list as permanent. A pipeline
/// or MULTI/EXEC that failed is retryable only if every command in it failed in a
/// transient way (an OOM or NOREPLICAS refused while queuing makes EXEC answer EXECABORT).
pub fn redis_error_is_retryable(e: &redis::RedisError) -> bool {
    if is_configuration_error(e) {
        return false;
    }
    // Refused, reset, dropped, timed out: the connection comes back, or another node answers.
    if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal() {
        return true;
    }
    match e.kind() {
        // A cluster node that redis-rs has no connection to yet (a failover, a reshard).
        redis::ErrorKind::ClusterConnectionNotFound => return true,
        // A reply that does not parse: the connection is replaced and the command retried.
        // Not a script's reply that its decoder refused: that is a defect, not a state.
        redis::ErrorKind::Parse => return !crate::reply::is_unexpected_reply(e),
        // Redis Sentinel names no valid primary: during a failover the old one is marked
        // down and the new one is not promoted yet. (A wrong redis_sentinel_master looks
        // the same, and is logged as failing, with this message, until it is fixed.)
        redis::ErrorKind::MasterNameNotFoundBySentinel => return true,
        _ => {}
    }
    if let Some(inner) = e.clone().into_server_errors() {
        // One server error, or the failed commands of a pipeline or transaction.
        return !inner.is_empty()
            && inner
                .iter()
                .all(|(_, s)| redis_code_is_transient(s.code(), s.details().unwrap_or("")));
    }
    match e.code() {
        Some(code) => redis_code_is_transient(code, e.detail().unwrap_or("")),
        None => false,
    }
}

/// The server's error codes for states that pass, and why waiting is the fix. Any code
/// not listed here is not retried: an unknown code is reported, not guessed at.
pub const TRANSIENT_CODES: &[(&str, &str)] = &[
    (
        "BUSY",
        "another client's script or function runs past busy-reply-threshold; the server \
         answers again when it ends or is killed",
    ),
    (
        "LOADING",
        "the server is loading its dataset (restart, replica full sync); it answers when done",
    ),
    (
        "NOREPLICAS",
        "min-replicas-to-write is not met, e.g. while a replica restarts; writes resume \
         when it reconnects",
    ),
    (
        "MISCONF",
        "a background save failed with stop-writes-on-bgsave-error; writes resume after \
         the next good save or when an operator fixes the disk",
    ),
    (
        "OOM",
        "maxmemory reached under noeviction; memory is freed by cleanups (ours among them), \
         expiries and the operator",
    ),
    (
        "MASTERDOWN",
        "a replica lost its master and does not serve stale data; ends with the failover",
    ),
    (
        "READONLY",
        "the address points at a node demoted to replica by a failover; it points at the \
         new master soon (Sentinel, DNS, or the cluster client's refreshed slot map)",
    ),
    (
        "TRYAGAIN",
        "a multi-key command during a slot migration in a cluster",
    ),
    (
        "CLUSTERDOWN",
        "the cluster has slots not served (a master failed, no failover yet)",
    ),
    (
        "MOVED",
        "the slot moved; the cluster client follows and refreshes its slot map",
    ),
    ("ASK", "the slot is migrating; the cluster client follows"),
    (
        "NOSCRIPT",
        "the script cache was flushed (restart, failover, SCRIPT FLUSH); the script is \
         loaded again on the next call",
    ),
    (
        "UNBLOCKED",
        "a blocked read was released (its key deleted, CLIENT UNBLOCK); read again",
    ),
];

/// Codes that no waiting fixes, and why: a process stops (or, in the worker, the entry
/// goes the `max_deliveries` way) instead of retrying forever.
pub const PERMANENT_CODES: &[(&str, &str)] = &[
    ("WRONGPASS", "wrong user or password: a setting to fix"),
    (
        "NOAUTH",
        "the server wants a password and none was given: a setting to fix",
    ),
    (
        "NOPERM",
        "the ACL user may not run this command or touch this key: the ACL to fix",
    ),
    (
        "WRONGTYPE",
        "a key holds another type than the contract says: data to fix, not a state",
    ),
    (
        "ERR",
        "a command or script error (wrong arguments, a Lua error): retrying gives the \
         same answer (except `max number of clients reached`, below)",
    ),
    (
        "EXECABORT",
        "a transaction refused while queuing; permanent unless every refused command was \
         transient (see redis_error_is_retryable)",
    ),
    (
        "NOGROUP",
        "the stream or its group is missing; the worker creates it again itself",
    ),
    (
        "FENCED",
        "the connection-server protocol refuses a write of a server declared dead: it must \
         start again under a new server id (see registry::Registry)",
    ),
    (
        "CROSSSLOT",
        "keys of one command in several slots: a bug, not a state",
    ),
    (
        "FORMAT",
        "a cleanup step of a worker whose build does not work under the data format in \
         use (or the format of the cleanup's progress): it hands the cleanup over (see \
         format)",
    ),
];

/// True when a server error with `code` (and `detail`, the text after it) may succeed if
/// tried again later. See [`TRANSIENT_CODES`] and [`PERMANENT_CODES`].
pub fn redis_code_is_transient(code: &str, detail: &str) -> bool {
    if code == "ERR" {
        // `ERR max number of clients reached`: maxclients is full; clients come and go.
        return detail.starts_with("max number of clients reached");
    }
    TRANSIENT_CODES.iter().any(|(c, _)| *c == code)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A `RedisError` as redis-rs makes it from a server's error reply (`-CODE detail`).
    fn reply(line: &str) -> redis::RedisError {
        redis::parse_redis_value(format!("-{line}\r\n").as_bytes())
            .unwrap()
            .extract_error()
            .unwrap_err()
    }

    fn io(kind: std::io::ErrorKind) -> redis::RedisError {
        std::io::Error::from(kind).into()
    }

    /// Every transient state, as the server words it (Redis 7.0), and as a Lua script
    /// relays it from `redis.call`.
    #[test]
    fn states_that_pass_are_retryable() {
        let transient = [
            "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
            "LOADING Redis is loading the dataset in memory",
            "NOREPLICAS Not enough good replicas to write.",
            "NOREPLICAS Not enough good replicas to write. script: a9c3, on @user_script:1.",
            "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.",
            "OOM command not allowed when used memory > 'maxmemory'.",
            "OOM command not allowed when used memory > 'maxmemory'. script: a9c3, on @user_script:1.",
            "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
            "READONLY You can't write against a read only replica.",
            "TRYAGAIN Multiple keys request during rehashing of slot",
            "CLUSTERDOWN The cluster is down",
            "MOVED 3999 127.0.0.1:6381",
            "ASK 3999 127.0.0.1:6381",
            "NOSCRIPT No matching script. Please use EVAL.",
            "UNBLOCKED the stream key no longer exists",
            "ERR max number of clients reached",
        ];
        for line in transient {
            let e = reply(line);
            assert!(redis_error_is_retryable(&e), "{line} ({:?})", e.kind());
            assert!(Error::from(e).is_retryable(), "{line}");
        }
        for kind in [
            std::io::ErrorKind::ConnectionRefused,
            std::io::ErrorKind::ConnectionReset,
            std::io::ErrorKind::ConnectionAborted,
            std::io::ErrorKind::BrokenPipe,
            std::io::ErrorKind::UnexpectedEof,
            std::io::ErrorKind::TimedOut,
        ] {
            assert!(redis_error_is_retryable(&io(kind)), "{kind:?}");
        }
    }

    #[test]
    fn errors_no_waiting_can_fix_are_not_retryable() {
        let permanent = [
            "WRONGPASS invalid username-password pair or user is disabled.",
            "NOAUTH Authentication required.",
            "NOPERM User janitor-worker has no permissions to run the 'config|set' command",
            "WRONGTYPE Operation against a key holding the wrong kind of value",
            "WRONGTYPE Operation against a key holding the wrong kind of value script: a9c3, on @user_script:1.",
            "ERR user_script:1: Script attempted to access nonexistent global variable 'x' script: a9c3",
            "ERR wrong number of arguments for 'hset' command",
            "EXECABORT Transaction discarded because of previous errors.",
            "NOGROUP No such key 'registry:events' or consumer group 'registry-janitor'",
            "CROSSSLOT Keys in request don't hash to the same slot",
            // A code nobody listed is reported, not guessed at.
            "SOMETHINGNEW a code of a future Redis",
        ];
        for line in permanent {
            let e = reply(line);
            assert!(!redis_error_is_retryable(&e), "{line} ({:?})", e.kind());
        }
        let auth: redis::RedisError = (
            redis::ErrorKind::AuthenticationFailed,
            "Password authentication failed",
        )
            .into();
        assert!(!redis_error_is_retryable(&auth));
        let tls = std::io::Error::other("invalid peer certificate: UnknownIssuer");
        assert!(!redis_error_is_retryable(&tls.into()));
        assert!(!Error::Cancelled.is_retryable());
        assert!(!Error::Protocol("x".into()).is_retryable());
        // Errors of the user, of a task and of the local tooling: no waiting fixes them.
        assert!(!Error::NotFound {
            what: "dead letter",
            id: "0-1".into()
        }
        .is_retryable());
        assert!(!Error::LocalRedis("x".into()).is_retryable());
        let join = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(async {
                let task = tokio::spawn(std::future::pending::<()>());
                task.abort();
                task.await.unwrap_err()
            });
        assert!(!Error::from(join).is_retryable());
    }

    /// Every code in the tables is classified as its table says, and no code is in both.
    #[test]
    fn the_tables_agree_with_the_classification() {
        for (code, why) in TRANSIENT_CODES {
            assert!(!why.is_empty());
            assert!(redis_code_is_transient(code, ""), "{code}");
            assert!(!PERMANENT_CODES.iter().any(|(c, _)| c == code), "{code}");
        }
        for (code, why) in PERMANENT_CODES {
            assert!(!why.is_empty());
            assert!(!redis_code_is_transient(code, ""), "{code}");
        }
    }

    /// Pipelines and transactions refused by a real server: retryable only when every
    /// refusal is transient.
    #[test]
    fn pipelines_and_transactions_are_classified_by_their_failed_commands() {
        let server = registry_janitor_testkit::RedisServer::start().unwrap();
        let mut c = redis::Client::open(server.url())
            .unwrap()
            .get_connection()
            .unwrap();
        let _: () = redis::cmd("SET").arg("s").arg("x").query(&mut c).unwrap();
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg("1")
            .exec(&mut c)
            .unwrap();
        let refused = redis::pipe()
            .cmd("SET")
            .arg("a")
            .arg("1")
            .cmd("SET")
            .arg("b")
            .arg("1")
            .query::<()>(&mut c)
            .unwrap_err();
        assert!(redis_error_is_retryable(&refused), "{refused}");
        let aborted = redis::pipe()
            .atomic()
            .cmd("SET")
            .arg("a")
            .arg("1")
            .query::<()>(&mut c)
            .unwrap_err();
        assert!(redis_error_is_retryable(&aborted), "{aborted}");
        // One transient refusal and one WRONGTYPE: not retryable.
        let mixed = redis::pipe()
            .cmd("SET")
            .arg("a")
            .arg("1")
            .cmd("HGET")
            .arg("s")
            .arg("f")
            .query::<()>(&mut c)
            .unwrap_err();
        assert!(!redis_error_is_retryable(&mixed), "{mixed}");
    }
}
