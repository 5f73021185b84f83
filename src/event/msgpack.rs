//! The structural check of a payload's MessagePack, before anything decodes it: bounded
//! nesting, lengths no larger than the bytes there, one value, and the contract's shape
//! (a map with string keys). A loop over the bytes, never recursion.

use super::EventError;

/// How deep MessagePack values may nest (the payload itself is depth 1; unknown keys may
/// carry a little structure of their own).
pub(super) const MAX_NESTING: usize = 32;

/// Walks a MessagePack document without recursion before anything decodes it: at most
/// `max_depth` levels of arrays and maps, exactly one value, and no declared length
/// (string, binary, array, map) larger than the bytes that are actually there. Hostile
/// payloads are refused here without deep recursion (a stack overflow would kill the
/// worker) and without allocating what a length header claims.
///
/// It also enforces the contract's shape, which serde does not: the document is a map,
/// and every key of that map is a string. serde's derived `Deserialize` accepts a struct
/// as an array of its values in field order, and as a map keyed by field numbers; both
/// are positional forms that would silently shift meaning if a field were ever added or
/// reordered. (The fields' own values are scalars, which no array or map can stand for.)
pub(super) fn check_structure(bytes: &[u8], max_depth: usize) -> Result<(), EventError> {
    walk(bytes, max_depth).map_err(|e| match e {
        Walk::Shape(e) => e,
        Walk::Malformed(m) => EventError::Decode(m),
    })
}

/// What a MessagePack marker byte starts, for error messages.
fn kind(marker: u8) -> &'static str {
    match marker {
        0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3 => "integer",
        0x80..=0x8f | 0xde | 0xdf => "map",
        0x90..=0x9f | 0xdc | 0xdd => "array",
        0xa0..=0xbf | 0xd9..=0xdb => "string",
        0xc0 => "nil",
        0xc2 | 0xc3 => "boolean",
        0xc4..=0xc6 => "binary",
        0xca | 0xcb => "float",
        0xc7..=0xc9 | 0xd4..=0xd8 => "extension",
        0xc1 => "invalid marker (0xc1)",
    }
}

/// Why a walk stopped: the shape the contract requires, or bytes that are not MessagePack.
enum Walk {
    Shape(EventError),
    Malformed(String),
}

impl From<String> for Walk {
    fn from(m: String) -> Self {
        Walk::Malformed(m)
    }
}

impl From<&str> for Walk {
    fn from(m: &str) -> Self {
        Walk::Malformed(m.to_owned())
    }
}

/// The walk of [`check_structure`].
fn walk(bytes: &[u8], max_depth: usize) -> Result<(), Walk> {
    // Keys of the top-level map seen so far, for error messages.
    let mut top_keys = 0u64;
    let mut pos = 0usize;
    // Values still to read at each open level (the document itself is one value).
    let mut pending: Vec<u64> = vec![1];
    loop {
        // 1: the document itself; 2: its elements (the document is checked to be a map,
        // whose elements count down from 2n, so an even count left means a key).
        let depth = pending.len();
        let Some(left) = pending.last_mut() else {
            break;
        };
        if *left == 0 {
            pending.pop();
            continue;
        }
        let is_top_key = depth == 2 && *left % 2 == 0;
        *left -= 1;
        let marker = *bytes.get(pos).ok_or("truncated")?;
        pos += 1;
        if marker == 0xc1 {
            return Err("invalid MessagePack marker 0xc1".into());
        }
        if is_top_key {
            top_keys += 1;
        }
        check_shape(marker, depth, is_top_key, top_keys)?;
        let (skip, children) = sizes(marker, bytes, &mut pos)?;
        let remaining = (bytes.len() - pos) as u64;
        if skip > remaining || children > remaining {
            return Err(format!(
                "a length of {} exceeds the {remaining} bytes left",
                skip.max(children)
            )
            .into());
        }
        pos += skip as usize;
        if children > 0 {
            if pending.len() > max_depth {
                return Err(format!("values nested deeper than {max_depth} levels").into());
            }
            pending.push(children);
        }
    }
    if pos != bytes.len() {
        return Err(format!("{} bytes after the end of the payload", bytes.len() - pos).into());
    }
    Ok(())
}

/// The contract's shape: the document is a map, and its keys are strings (field names).
fn check_shape(marker: u8, depth: usize, is_top_key: bool, top_keys: u64) -> Result<(), Walk> {
    if depth == 1 && kind(marker) != "map" {
        return Err(Walk::Shape(EventError::NotNamedMap(format!(
            "payload is a MessagePack {}; a map with named keys is required",
            kind(marker)
        ))));
    }
    if is_top_key && kind(marker) != "string" {
        return Err(Walk::Shape(EventError::NotNamedMap(format!(
            "key {top_keys} of the payload map is a MessagePack {}; keys must be strings (field names)",
            kind(marker)
        ))));
    }
    Ok(())
}

/// The value a `marker` opens, read from its length header at `pos` (moved past it):
/// (bytes of payload to skip, elements of a new level).
fn sizes(marker: u8, bytes: &[u8], pos: &mut usize) -> Result<(u64, u64), Walk> {
    let mut take = |n: usize| read_be(bytes, pos, n);
    Ok(match marker {
        0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
        0x80..=0x8f => (0, u64::from(marker & 0x0f) * 2),
        0x90..=0x9f => (0, u64::from(marker & 0x0f)),
        0xa0..=0xbf => (u64::from(marker & 0x1f), 0),
        0xc4 | 0xd9 => (take(1)?, 0),
        0xc5 | 0xda => (take(2)?, 0),
        0xc6 | 0xdb => (take(4)?, 0),
        0xc7 => (take(1)? + 1, 0),
        0xc8 => (take(2)? + 1, 0),
        0xc9 => (take(4)? + 1, 0),
        0xca => (4, 0),
        0xcb => (8, 0),
        0xcc | 0xd0 => (1, 0),
        0xcd | 0xd1 => (2, 0),
        0xce | 0xd2 => (4, 0),
        0xcf | 0xd3 => (8, 0),
        0xd4 => (2, 0),
        0xd5 => (3, 0),
        0xd6 => (5, 0),
        0xd7 => (9, 0),
        0xd8 => (17, 0),
        0xdc => (0, take(2)?),
        0xdd => (0, take(4)?),
        0xde => (0, take(2)? * 2),
        0xdf => (0, take(4)? * 2),
        0xc1 => return Err("invalid MessagePack marker 0xc1".into()),
    })
}

/// A big-endian unsigned integer of `n` bytes at `pos` (moved past it).
fn read_be(bytes: &[u8], pos: &mut usize, n: usize) -> Result<u64, Walk> {
    let end = pos
        .checked_add(n)
        .filter(|&e| e <= bytes.len())
        .ok_or("truncated")?;
    let v = bytes[*pos..end]
        .iter()
        .fold(0u64, |acc, &b| (acc << 8) | u64::from(b));
    *pos = end;
    Ok(v)
}

#[cfg(test)]
pub(super) mod tests {
    use crate::event::*;

    /// A payload with an unknown key whose value is `depth` nested one-element arrays.
    pub(in crate::event) fn nested(depth: usize) -> Vec<u8> {
        let mut p = vec![0x85];
        for (k, v) in [
            ("v", vec![0x01]),
            ("event_id", vec![0xa1, b'e']),
            ("server_id", vec![0xa2, b'g', b'w']),
        ] {
            p.push(0xa0 | k.len() as u8);
            p.extend_from_slice(k.as_bytes());
            p.extend(v);
        }
        p.extend_from_slice(&[0xae]);
        p.extend_from_slice(b"detected_at_ms");
        p.push(0x01);
        p.extend_from_slice(&[0xa1, b'x']);
        p.extend(std::iter::repeat_n(0x91, depth));
        p.push(0xc0);
        p
    }

    #[test]
    fn deep_nesting_is_refused_without_exhausting_the_stack() {
        assert!(
            ServerDead::decode(&nested(10), 65536).is_ok(),
            "shallow unknown values are fine"
        );
        // 60,000 levels fit in the 64 KiB limit; decoding stops at rmp-serde's depth limit.
        let deep = nested(60_000);
        assert!(deep.len() <= 65536);
        assert!(matches!(
            ServerDead::decode(&deep, 65536),
            Err(EventError::Decode(_))
        ));
    }

    #[test]
    fn huge_length_headers_are_refused_without_allocating() {
        // Each claims ~4 billion elements or bytes that are not there.
        for payload in [
            vec![0xdd, 0xff, 0xff, 0xff, 0xff],                   // array32
            vec![0xdf, 0xff, 0xff, 0xff, 0xff],                   // map32 at the top
            vec![0x81, 0xa1, b'x', 0xdb, 0xff, 0xff, 0xff, 0xff], // str32 value
            vec![0x81, 0xa1, b'x', 0xc6, 0xff, 0xff, 0xff, 0xff], // bin32 value
            vec![0x81, 0xa1, b'x', 0xdd, 0xff, 0xff, 0xff, 0xff], // array32 value
        ] {
            assert!(ServerDead::decode(&payload, 65536).is_err(), "{payload:x?}");
        }
    }
}
