//! Every Redis key, stream and group name the janitor touches, built in one place.
//!
//! The layout is the documented Redis data model. Every key carries the `key_prefix` setting so
//! that several deployments or test runs can share one Redis:
//!
//! | key                        | type   | owner                                   |
//! |----------------------------|--------|-----------------------------------------|
//! | `registry`                 | Hash   | connection servers (layout `hash`)      |
//! | `user:<user>`              | String | connection servers (layout `keys`)      |
//! | `user:{<user>}:conns`      | Hash   | connection servers (layout `conns`)     |
//! | `server:{<server>}:users`  | Set    | connection servers (reverse index)      |
//! | `server:{<server>}:alive`  | String | connection servers (liveness, with TTL) |
//! | `servers`                  | ZSet   | connection servers (last heartbeat)     |
//! | `registry:events`          | Stream | monitoring, the reconciler              |
//! | `registry:events:dead`     | Stream | the workers (dead letters)              |
//! | `registry:evictions`       | Stream | the workers, the reconciler (evictions) |
//! | `server:{<server>}:cleanup`| Hash   | the workers: the cleanup's scan cursor  |
//! | `server:{<server>}:walking`| Set    | the workers: the reverse set being walked|
//! | `server:{<server>}:moved`  | ZSet   | the reconciler: members set aside       |
//! | `server:{<server>}:reported`| String | the reconciler: "event published", TTL |
//! | `janitor:sweep`            | Hash   | the reconciler: the drift sweep's cursor|
//! | `server:{<server>}:fenced` | Hash   | the workers: the verdict, with a TTL    |
//! | `server:{<server>}:refused`| Hash   | connection servers: refused writes      |
//! | `janitor:fenced`           | ZSet   | the workers: index of fences, by time   |
//! | `janitor:{guard}:held`     | Hash   | the workers: verdicts the guard holds   |
//! | `janitor:{guard}:disputed` | ZSet   | the workers: disputed verdicts let through|
//! | `janitor:{guard}:reachable`| Hash   | the reconciler: Redis's last outage     |
//! | `janitor:{format}:in_use`  | String | the workers, `format set`: format in use|
//! | `janitor:{format}:workers` | Hash   | the workers: each one's format, seen    |
//! | `receiver:alert:{<events>}:<alert>` | String | the alert receiver: entry id, TTL |
//!
//! The janitor writes fifteen keys of its own: `registry:events:dead`, the evictions
//! stream (named by `evictions_stream`) and every key from `cleanup` on
//! except `refused`, which connection servers write when refused. `cleanup` records
//! how far the walk of a dead server's reverse set has gone, so that a cleanup taken over
//! after a crash resumes there; `walking` is the reverse set itself, renamed away at the start of a walk so that
//! members added meanwhile land in a new `users` set that is walked next (SSCAN does not
//! promise to return members added during a scan); `moved` holds members that the
//! reverse-index sweep took out of a live server's set, scored by when, until their
//! registration can no longer be in flight (the cleanup walks them too); `reported` keeps several reconcilers from publishing the same death more than
//! once per window; `janitor:sweep` lets a restarted reconciler resume its sweep;
//! `janitor:{guard}:reachable` records the run_ids of Redis and since when it has been
//! reachable, so that every reconciler (and every `reconcile --once`) holds its verdicts
//! after an outage any of them saw, or after a restart that reloaded it (see
//! `guard::reachable`); `janitor:{guard}:held` and `janitor:{guard}:disputed`
//! are the verdict hold's (see [`crate::guard::hold`]); `janitor:{format}:in_use` and
//! `janitor:{format}:workers` are the data format's: the format in use, and the format
//! each worker runs (see [`crate::format`]). The per-server ones share the
//! server's hash tag (same cluster slot as the reverse set).
//! `receiver:alert:*` records that the alert receiver published an alert (the entry id,
//! for `alert_receiver_dedup_ttl_ms`); its hash tag is the events stream's name, so that
//! it lives in the stream's cluster slot and one script can check it and publish.

use crate::event::ServerId;

/// The consumer group of the workers on the events stream (not prefixed: it is not a key).
pub const GROUP: &str = "registry-janitor";

/// The special stream ids the janitor uses, named once.
pub mod ids {
    /// XREADGROUP: entries never delivered to this group.
    pub const NEW_ENTRIES: &str = ">";
    /// XADD: let Redis choose the id.
    pub const AUTO: &str = "*";
    /// XGROUP CREATE: the group starts at the stream's beginning, so events published
    /// before the first worker started are processed too.
    pub const GROUP_START: &str = "0";
    /// XAUTOCLAIM: the cursor that starts a pass over the pending list (and that Redis
    /// returns after a complete one).
    pub const CLAIM_START: &str = "0-0";
}

/// Key names under one `key_prefix`.
#[derive(Debug, Clone)]
pub struct Keys {
    /// Prepended verbatim to every key; empty by default.
    prefix: String,
    /// The evictions stream's full name, or `None` when it is switched off.
    evictions: Option<String>,
}

/// The evictions stream's name under the prefix when the settings do not name one.
pub const DEFAULT_EVICTIONS_STREAM: &str = "registry:evictions";

impl Keys {
    /// Keys under `prefix`, with the evictions stream on, under its default name.
    pub fn new(prefix: impl Into<String>) -> Self {
        let prefix = prefix.into();
        Keys {
            evictions: Some(format!("{prefix}{DEFAULT_EVICTIONS_STREAM}")),
            prefix,
        }
    }

    /// Keys as the settings name them: `key_prefix`, and the evictions stream
    /// (`evictions_stream` under the prefix, unless `evictions` is false).
    pub fn for_settings(settings: &crate::config::Settings) -> Self {
        Keys::new(settings.key_prefix.clone()).evictions_stream(
            settings
                .evictions
                .then_some(settings.evictions_stream.as_str()),
        )
    }

    /// The evictions stream is `name` under the prefix, or off with `None`.
    pub fn evictions_stream(mut self, name: Option<&str>) -> Self {
        self.evictions = name.map(|n| format!("{}{n}", self.prefix));
        self
    }

    /// The stream of `users.evicted` and `server.cleaned` entries, unless switched off.
    pub fn evictions(&self) -> Option<&str> {
        self.evictions.as_deref()
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The forward registry Hash (layout `hash`): field = user id, value = server id.
    pub fn registry(&self) -> String {
        format!("{}registry", self.prefix)
    }

    /// What comes before the user id in a forward key of layout `keys`.
    pub fn user_key_prefix(&self) -> String {
        format!("{}user:", self.prefix)
    }

    /// The forward key of one user (layout `keys`). User ids may hold any bytes.
    pub fn user(&self, user: &[u8]) -> Vec<u8> {
        let mut key = self.user_key_prefix().into_bytes();
        key.extend_from_slice(user);
        key
    }

    /// The forward Hash of one user in layout `conns`: field = connection id, value =
    /// server id. The user id is the hash tag, so that it is one slot on a cluster.
    pub fn user_conns(&self, user: &[u8]) -> Vec<u8> {
        let mut key = self.user_key_prefix().into_bytes();
        key.push(b'{');
        key.extend_from_slice(user);
        key.extend_from_slice(b"}:conns");
        key
    }

    /// A SCAN MATCH pattern of every user's Hash of layout `conns`.
    pub fn user_conns_pattern(&self) -> String {
        let mut pattern = pattern_under(&format!("{}{{", self.user_key_prefix()));
        pattern.push_str("}:conns");
        pattern
    }

    /// The forward key of the reverse-set member `member` in `layout`, with the Hash
    /// field that holds the entry (`registry` and the user, `user:<user>` and none, or
    /// the user's connections Hash and the connection id). `None` for a `conns` member
    /// that is not `<connection id> <user id>`.
    pub fn forward_of_member(
        &self,
        layout: crate::config::Layout,
        member: &[u8],
    ) -> Option<(Vec<u8>, Option<Vec<u8>>)> {
        use crate::config::Layout;
        match layout {
            Layout::Hash => Some((self.registry().into_bytes(), Some(member.to_vec()))),
            Layout::Keys => Some((self.user(member), None)),
            Layout::Conns => {
                let (connection, user) = split_conn_member(member)?;
                Some((self.user_conns(user), Some(connection.to_vec())))
            }
        }
    }

    /// The reverse index of a server: the Set of its users.
    pub fn server_users(&self, server: &ServerId) -> String {
        self.server_key(server, "users")
    }

    /// The liveness key of a server, refreshed with a TTL on every heartbeat.
    pub fn server_alive(&self, server: &ServerId) -> String {
        self.server_key(server, "alive")
    }

    /// The janitor's progress record for cleaning a server (see the module docs).
    pub fn server_cleanup(&self, server: &ServerId) -> String {
        self.server_key(server, "cleanup")
    }

    /// The dead server's reverse set while a cleanup walks it (renamed from `users`).
    pub fn server_walking(&self, server: &ServerId) -> String {
        self.server_key(server, "walking")
    }

    /// Every key that may hold members of `server` still to be cleaned: the reverse set,
    /// the set being walked, the members set aside. The server is clean when none exists.
    pub fn server_members_left(&self, server: &ServerId) -> [String; 3] {
        [
            self.server_users(server),
            self.server_walking(server),
            self.server_moved(server),
        ]
    }

    /// Members the reverse-index sweep set aside (ZSet, score = unix ms when).
    pub fn server_moved(&self, server: &ServerId) -> String {
        self.server_key(server, "moved")
    }

    /// Set (with a TTL) when a reconciler has published this server's death.
    pub fn server_reported(&self, server: &ServerId) -> String {
        self.server_key(server, "reported")
    }

    /// The fence of a server declared dead (Hash with a TTL: `fenced_at_ms`, `entry`,
    /// `unknown` for a server the registry did not know). See [`crate::fence`].
    pub fn server_fence(&self, server: &ServerId) -> String {
        self.server_key(server, "fenced")
    }

    /// Writes of a fenced server refused by the protocol (Hash: one count per operation,
    /// `last_ms`), noted by the protocol scripts, with the fence's lifetime. A key apart
    /// from the fence, so that a connection server's ACL user may note refusals without
    /// being able to write (so create) a fence.
    pub fn server_refusals(&self, server: &ServerId) -> String {
        self.server_key(server, "refused")
    }

    /// The index of fences (ZSet: member = server id, score = unix ms of the latest
    /// verdict), so that `status` and the metrics find them without a SCAN.
    pub fn fences(&self) -> String {
        format!("{}janitor:fenced", self.prefix)
    }

    /// The reconciler's drift-sweep cursor.
    pub fn sweep(&self) -> String {
        format!("{}janitor:sweep", self.prefix)
    }

    /// Verdicts the guard holds (Hash: field = server id, value = the hold as JSON; see
    /// [`crate::guard`]). Shares a hash tag with [`Keys::guard_disputed`] (one slot on a
    /// cluster, so one script reads both).
    pub fn guard_held(&self) -> String {
        format!("{}janitor:{{guard}}:held", self.prefix)
    }

    /// Servers whose disputed verdict the guard let through within its window (ZSet:
    /// member = server id, score = unix ms), the budget of `guard_disputed_limit`.
    pub fn guard_disputed(&self) -> String {
        format!("{}janitor:{{guard}}:disputed", self.prefix)
    }

    /// The reconciler's reachable-time record (Hash: `run_ids`, `reachable_since_ms`);
    /// see `guard::reachable`.
    pub fn guard_reachable(&self) -> String {
        format!("{}janitor:{{guard}}:reachable", self.prefix)
    }

    /// The data format in use (String, a format number; absent: format 1). Shares a hash
    /// tag with [`Keys::format_workers`] (one slot on a cluster, so one script reads
    /// both). See [`crate::format`].
    pub fn format_in_use(&self) -> String {
        format!("{}janitor:{{format}}:in_use", self.prefix)
    }

    /// The workers' announcements of their format (Hash: field = consumer name, value =
    /// `<format>:<min format>:<since ms>:<seen ms>`). See [`crate::format`].
    pub fn format_workers(&self) -> String {
        format!("{}janitor:{{format}}:workers", self.prefix)
    }

    /// The liveness-key name pattern of every server, for expiry notifications:
    /// returns the server id if `key` is a liveness key under this prefix.
    pub fn server_of_alive_key<'k>(&self, key: &'k str) -> Option<&'k str> {
        key.strip_prefix(&self.prefix)?
            .strip_prefix("server:{")?
            .strip_suffix("}:alive")
    }

    /// The Sorted Set of known servers, scored by last heartbeat (unix ms).
    pub fn servers(&self) -> String {
        format!("{}servers", self.prefix)
    }

    /// The stream that carries `server.dead` events.
    pub fn events(&self) -> String {
        format!("{}registry:events", self.prefix)
    }

    /// The dead-letter stream.
    pub fn dead_letters(&self) -> String {
        format!("{}registry:events:dead", self.prefix)
    }

    /// The alert receiver's record of one published alert (String: the entry id, with a
    /// TTL). `alert` is the receiver's id of the alert (fingerprint and start). The hash
    /// tag is the events stream's full name, so that the key hashes to the stream's
    /// cluster slot: `{<prefix>registry:events}` when the prefix has no braces, and the
    /// prefix's own tag when it has one (both keys then start with it). A prefix with an
    /// unbalanced brace breaks this; [`Keys::alert_in_events_slot`] tells.
    pub fn alert_published(&self, alert: &str) -> String {
        format!(
            "{}receiver:alert:{{{}}}:{alert}",
            self.prefix,
            self.events()
        )
    }

    /// True when [`Keys::alert_published`] keys hash to the events stream's cluster slot.
    pub fn alert_in_events_slot(&self) -> bool {
        crate::conn::key_slot(self.alert_published("x").as_bytes())
            == crate::conn::key_slot(self.events().as_bytes())
    }

    fn server_key(&self, server: &ServerId, what: &str) -> String {
        format!("{}server:{{{}}}:{what}", self.prefix, server.as_str())
    }
}

/// The reverse-set member of a connection in layout `conns`: `<connection id> <user id>`.
pub fn conn_member(connection: &str, user: &[u8]) -> Vec<u8> {
    let mut member = Vec::with_capacity(connection.len() + 1 + user.len());
    member.extend_from_slice(connection.as_bytes());
    member.push(b' ');
    member.extend_from_slice(user);
    member
}

/// A member of layout `conns` split at its first space: (connection id, user id).
/// `None` for a member that is not one of this layout: without a space, or whose
/// connection id breaks the rule of ids (1 to 200 bytes of printable ASCII without
/// whitespace or braces), as the scripts' prelude decides too.
pub fn split_conn_member(member: &[u8]) -> Option<(&[u8], &[u8])> {
    let at = member.iter().position(|&b| b == b' ')?;
    let connection = &member[..at];
    let valid = (1..=200).contains(&connection.len())
        && connection
            .iter()
            .all(|&b| b.is_ascii_graphic() && b != b'{' && b != b'}');
    valid.then(|| (connection, &member[at + 1..]))
}

/// A SCAN MATCH pattern for every key that starts with `prefix` (glob characters in the
/// prefix escaped).
pub fn pattern_under(prefix: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + 1);
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('*');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_contract() {
        let k = Keys::new("t:");
        let s = ServerId::parse("gw-7#1732181000123").unwrap();
        assert_eq!(k.registry(), "t:registry");
        assert_eq!(k.user(b"u\xff1"), b"t:user:u\xff1".to_vec());
        assert_eq!(k.user_conns(b"u\xff1"), b"t:user:{u\xff1}:conns".to_vec());
        assert_eq!(k.user_conns_pattern(), "t:user:{*}:conns");
        assert_eq!(conn_member("c-1", b"u 2"), b"c-1 u 2".to_vec());
        assert_eq!(
            split_conn_member(b"c-1 u 2"),
            Some((&b"c-1"[..], &b"u 2"[..]))
        );
        assert_eq!(split_conn_member(b" u"), None);
        assert_eq!(split_conn_member(b"u"), None);
        assert_eq!(split_conn_member(b"c\xff u"), None);
        assert_eq!(split_conn_member(b"{c} u"), None);
        assert_eq!(
            split_conn_member(&[b"x".repeat(201), b" u".to_vec()].concat()),
            None
        );
        assert!(split_conn_member(&[b"x".repeat(200), b" u".to_vec()].concat()).is_some());
        assert_eq!(k.server_users(&s), "t:server:{gw-7#1732181000123}:users");
        assert_eq!(k.server_alive(&s), "t:server:{gw-7#1732181000123}:alive");
        assert_eq!(k.servers(), "t:servers");
        assert_eq!(k.server_fence(&s), "t:server:{gw-7#1732181000123}:fenced");
        assert_eq!(k.fences(), "t:janitor:fenced");
        assert_eq!(k.guard_held(), "t:janitor:{guard}:held");
        assert_eq!(k.guard_disputed(), "t:janitor:{guard}:disputed");
        assert_eq!(k.guard_reachable(), "t:janitor:{guard}:reachable");
        assert_eq!(k.events(), "t:registry:events");
        assert_eq!(k.dead_letters(), "t:registry:events:dead");
        assert_eq!(Keys::new("").registry(), "registry");
        assert_eq!(k.server_of_alive_key("t:server:{gw-1}:alive"), Some("gw-1"));
        assert_eq!(k.server_of_alive_key("server:{gw-1}:alive"), None);
        assert_eq!(k.server_of_alive_key("t:server:{gw-1}:users"), None);
        assert_eq!(pattern_under("a*b[1]:"), "a\\*b\\[1\\]:*");
        assert_eq!(
            k.alert_published("ab12:5"),
            "t:receiver:alert:{t:registry:events}:ab12:5"
        );
        assert!(k.alert_in_events_slot());
        assert!(Keys::new("").alert_in_events_slot());
        assert!(Keys::new("app{7}:").alert_in_events_slot());
        assert!(!Keys::new("a{b").alert_in_events_slot());
    }
}
