//! The `server.dead` event: its stream fields, its MessagePack payload and their checks.
//!
//! A stream entry carries exactly two fields, `type` and `payload`; the payload is a
//! MessagePack map with named keys (see `schemas/server-dead.schema.json`). Decoding
//! never trusts the producer: every rule of the contract is checked before a server id
//! goes into a key name.

use serde::{Deserialize, Serialize};

/// The value of the `type` field for our event.
pub const EVENT_TYPE: &str = "server.dead";
/// The newest payload schema version this code understands.
pub const SCHEMA_VERSION: u64 = 1;
/// Stream field that names the event type.
pub const FIELD_TYPE: &str = "type";
/// Stream field that holds the MessagePack payload.
pub const FIELD_PAYLOAD: &str = "payload";

mod msgpack;
use msgpack::{check_structure, MAX_NESTING};

const MAX_EVENT_ID: usize = 128;
const MAX_REASON: usize = 256;
const MAX_SOURCE: usize = 64;
const MAX_SERVER_ID: usize = 200;

/// Why a payload was refused. The text goes into the dead letter's `error` field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    #[error("payload is not a valid MessagePack map of the contract's keys: {0}")]
    Decode(String),
    /// Not a map with named keys: an array of the values in field order, or a map keyed by
    /// field numbers, which serde would otherwise accept for a struct.
    #[error("{0}")]
    NotNamedMap(String),
    #[error("payload is {size} bytes, more than the limit of {limit}")]
    TooLarge { size: usize, limit: usize },
    #[error("unsupported schema version v={0} (this worker supports {SCHEMA_VERSION})")]
    Version(i64),
    #[error("`{field}` {problem}")]
    Field {
        field: &'static str,
        problem: String,
    },
    #[error("bad server_id: {0}")]
    ServerId(String),
    #[error("stream entry has no `{0}` field")]
    MissingField(&'static str),
}

/// A validated server id: 1 to 200 bytes of printable ASCII, no whitespace, no braces
/// (a brace would break the `{<server>}` hash tag of the per-server keys).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServerId(String);

impl ServerId {
    pub fn parse(s: &str) -> Result<Self, EventError> {
        if s.is_empty() || s.len() > MAX_SERVER_ID {
            return Err(EventError::ServerId(format!(
                "must be 1 to {MAX_SERVER_ID} bytes, got {}",
                s.len()
            )));
        }
        if let Some(c) = s
            .bytes()
            .find(|&b| !b.is_ascii_graphic() || b == b'{' || b == b'}')
        {
            return Err(EventError::ServerId(format!(
                "byte 0x{c:02x} is not allowed (printable ASCII without whitespace or braces)"
            )));
        }
        Ok(ServerId(s.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for ServerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The payload of a `server.dead` event, as it travels (named MessagePack keys).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerDead {
    /// Schema version; decoders refuse versions newer than [`SCHEMA_VERSION`].
    pub v: i64,
    /// Unique id chosen by the producer (a ULID here), for tracing one event end to end.
    pub event_id: String,
    /// The dead server incarnation.
    pub server_id: String,
    /// Unix ms when the death was detected: the start of the stale window users feel.
    pub detected_at_ms: u64,
    /// Free text, e.g. `heartbeat timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Who emitted the event, e.g. `monitoring`, `reconciler`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

impl ServerDead {
    /// A new event for `server`, detected now, with a fresh ULID as its id.
    pub fn new(server: &ServerId, reason: Option<String>, source: Option<String>) -> Self {
        ServerDead {
            v: SCHEMA_VERSION as i64,
            event_id: ulid::Ulid::new().to_string(),
            server_id: server.as_str().to_owned(),
            detected_at_ms: crate::now_ms(),
            reason,
            source,
        }
    }

    /// MessagePack with named keys, as the contract requires.
    pub fn encode(&self) -> Vec<u8> {
        rmp_serde::to_vec_named(self).expect("a struct of strings and integers always encodes")
    }

    /// Decodes and validates a payload of at most `max_bytes` bytes.
    pub fn decode(bytes: &[u8], max_bytes: usize) -> Result<(Self, ServerId), EventError> {
        if bytes.len() > max_bytes {
            return Err(EventError::TooLarge {
                size: bytes.len(),
                limit: max_bytes,
            });
        }
        check_structure(bytes, MAX_NESTING)?;
        let event: ServerDead =
            rmp_serde::from_slice(bytes).map_err(|e| EventError::Decode(e.to_string()))?;
        let server = event.validate()?;
        Ok((event, server))
    }

    /// Checks every rule of the contract; returns the parsed server id.
    pub fn validate(&self) -> Result<ServerId, EventError> {
        if self.v < 1 || self.v as u64 > SCHEMA_VERSION {
            return Err(EventError::Version(self.v));
        }
        check_len("event_id", &self.event_id, 1, MAX_EVENT_ID)?;
        if let Some(reason) = &self.reason {
            check_len("reason", reason, 0, MAX_REASON)?;
        }
        if let Some(source) = &self.source {
            check_len("source", source, 0, MAX_SOURCE)?;
        }
        ServerId::parse(&self.server_id)
    }
}

fn check_len(field: &'static str, value: &str, min: usize, max: usize) -> Result<(), EventError> {
    if (min..=max).contains(&value.len()) {
        Ok(())
    } else {
        Err(EventError::Field {
            field,
            problem: format!("must be {min} to {max} bytes, got {}", value.len()),
        })
    }
}

/// A stream entry with its fields as raw bytes: producers are not trusted to send UTF-8.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub id: String,
    pub fields: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Entry {
    /// The value of the first field called `name`.
    pub fn field(&self, name: &str) -> Option<&[u8]> {
        self.fields
            .iter()
            .find(|(k, _)| k == name.as_bytes())
            .map(|(_, v)| v.as_slice())
    }
}

/// What a worker is to do with one stream entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Classified {
    /// A valid `server.dead`: clean the server, then acknowledge.
    ServerDead(ServerDead, ServerId),
    /// Another type: not ours; acknowledge and count as ignored.
    Foreign(String),
    /// Ours (or unidentifiable) but unusable: dead-letter with the reason, acknowledge.
    Malformed(EventError),
}

/// Sorts an entry into what the worker does with it. An entry without a `type` field is
/// treated as malformed rather than foreign: nothing says it belongs to someone else,
/// and dead-lettering it keeps it visible instead of dropping it silently.
pub fn classify(entry: &Entry, max_payload_bytes: usize) -> Classified {
    let Some(kind) = entry.field(FIELD_TYPE) else {
        return Classified::Malformed(EventError::MissingField(FIELD_TYPE));
    };
    if kind != EVENT_TYPE.as_bytes() {
        return Classified::Foreign(String::from_utf8_lossy(kind).into_owned());
    }
    let Some(payload) = entry.field(FIELD_PAYLOAD) else {
        return Classified::Malformed(EventError::MissingField(FIELD_PAYLOAD));
    };
    match ServerDead::decode(payload, max_payload_bytes) {
        Ok((event, server)) => Classified::ServerDead(event, server),
        Err(e) => Classified::Malformed(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(server: &str) -> ServerDead {
        ServerDead {
            v: 1,
            event_id: "01J".into(),
            server_id: server.into(),
            detected_at_ms: 5,
            reason: None,
            source: Some("test".into()),
        }
    }

    #[test]
    fn round_trips_with_named_keys() {
        let e = event("gw-1");
        let bytes = e.encode();
        // Named keys: the encoding is a map, and the key names appear in it.
        assert_eq!(bytes[0] & 0xf0, 0x80, "fixmap expected");
        assert!(bytes.windows(9).any(|w| w == b"server_id"));
        let (back, server) = ServerDead::decode(&bytes, 65536).unwrap();
        assert_eq!(back, e);
        assert_eq!(server.as_str(), "gw-1");
    }

    #[test]
    fn server_id_rules() {
        assert!(ServerId::parse("gw-7#1732181000123").is_ok());
        for bad in ["", "a b", "a{b", "a}b", "é", "a\tb", "a\u{7f}"] {
            assert!(ServerId::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert!(ServerId::parse(&"x".repeat(200)).is_ok());
        assert!(ServerId::parse(&"x".repeat(201)).is_err());
    }

    #[test]
    fn refuses_what_the_contract_refuses() {
        let mut e = event("gw-1");
        e.v = 2;
        assert_eq!(e.validate(), Err(EventError::Version(2)));
        let mut e = event("gw-1");
        e.event_id = String::new();
        assert!(matches!(
            e.validate(),
            Err(EventError::Field {
                field: "event_id",
                ..
            })
        ));
        let mut e = event("gw-1");
        e.reason = Some("r".repeat(257));
        assert!(matches!(
            e.validate(),
            Err(EventError::Field {
                field: "reason",
                ..
            })
        ));
        assert!(matches!(
            ServerDead::decode(b"\x81\xa1v\x01", 65536),
            Err(EventError::Decode(_))
        ));
        assert!(matches!(
            ServerDead::decode(&event("gw").encode(), 4),
            Err(EventError::TooLarge { .. })
        ));
    }

    #[test]
    fn only_a_map_with_named_keys_is_accepted() {
        let e = event("gw-1");
        let refused = |bytes: &[u8]| match ServerDead::decode(bytes, 65536) {
            Err(EventError::NotNamedMap(why)) => why,
            other => panic!("{bytes:x?} gave {other:?}"),
        };
        // The struct's values in field order, as rmp_serde::to_vec writes them.
        let positional = rmp_serde::to_vec(&e).unwrap();
        assert_eq!(positional[0] & 0xf0, 0x90, "fixarray");
        assert_eq!(
            refused(&positional),
            "payload is a MessagePack array; a map with named keys is required"
        );
        for (bytes, kind) in [
            (vec![0xdc, 0, 0], "array"),
            (vec![0xa1, b'x'], "string"),
            (vec![0x01], "integer"),
            (vec![0xc0], "nil"),
            (vec![0xc4, 1, 0], "binary"),
            (vec![0xd4, 1, 0], "extension"),
        ] {
            assert!(
                refused(&bytes).contains(&format!("MessagePack {kind};")),
                "{kind}"
            );
        }
        // A map keyed by field numbers: serde maps 0 -> `v`, 1 -> `event_id`...
        let numbered = [&[
            0x84, 0x00, 0x01, 0x01, 0xa1, b'e', 0x02, 0xa2, b'g', b'w', 0x03, 0x05,
        ][..]]
        .concat();
        assert_eq!(
            refused(&numbered),
            "key 1 of the payload map is a MessagePack integer; keys must be strings (field names)"
        );
        // One numbered key among named ones (here the 6th key, a binary "extra").
        let mut mixed = e.encode();
        mixed[0] += 1;
        mixed.extend_from_slice(&[0xc4, 5]);
        mixed.extend_from_slice(b"extra");
        mixed.extend_from_slice(&[0xa1, b'x']);
        assert!(refused(&mixed).starts_with("key 6 of the payload map is a MessagePack binary"));
        // Nested values of unknown keys may have any shape.
        assert!(ServerDead::decode(&super::msgpack::tests::nested(3), 65536).is_ok());
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            let _ = ServerDead::decode(&bytes, 65536);
        }

        #[test]
        fn mutated_valid_payloads_decode_or_fail_cleanly(
            i in 0usize..64, b in proptest::prelude::any::<u8>(), cut in 0usize..64
        ) {
            let mut p = event("gw-1#1").encode();
            let i = i % p.len();
            p[i] = b;
            p.truncate(p.len().saturating_sub(cut % 4));
            if let Ok((e, server)) = ServerDead::decode(&p, 65536) {
                // Whatever decodes is valid by the contract's rules.
                proptest::prop_assert_eq!(e.validate(), Ok(server));
            }
        }

        #[test]
        fn any_server_id_that_parses_is_safe_in_a_key(s in "\\PC{0,210}") {
            if let Ok(id) = ServerId::parse(&s) {
                let key = crate::keys::Keys::new("").server_users(&id);
                // Exactly one hash tag, and it is this server's.
                proptest::prop_assert_eq!(key.matches('{').count(), 1);
                proptest::prop_assert_eq!(key.matches('}').count(), 1);
                proptest::prop_assert!(!key.contains(char::is_whitespace));
            }
        }
    }

    #[test]
    fn classifies_entries() {
        let entry = |fields: &[(&str, &[u8])]| Entry {
            id: "1-0".into(),
            fields: fields
                .iter()
                .map(|(k, v)| (k.as_bytes().to_vec(), v.to_vec()))
                .collect(),
        };
        let ok = event("gw-1").encode();
        assert!(matches!(
            classify(&entry(&[("type", b"server.dead"), ("payload", &ok)]), 65536),
            Classified::ServerDead(..)
        ));
        assert_eq!(
            classify(&entry(&[("type", b"user.joined")]), 65536),
            Classified::Foreign("user.joined".into())
        );
        assert_eq!(
            classify(&entry(&[("type", b"server.dead")]), 65536),
            Classified::Malformed(EventError::MissingField("payload"))
        );
        assert_eq!(
            classify(&entry(&[("payload", &ok)]), 65536),
            Classified::Malformed(EventError::MissingField("type"))
        );
    }
}
