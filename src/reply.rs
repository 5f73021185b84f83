//! Decoding the replies of the Lua scripts into named types.
//!
//! Every script whose reply is read is decoded by a type next to its caller that
//! implements [`redis::FromRedisValue`] with the helpers here. A script replies with a Lua
//! table (an array under RESP2 and RESP3), a number (an integer under both), a string (a
//! bulk string under both), or `false` (a nil under RESP2, a boolean under RESP3). A
//! reply of another shape is an error that names the script, never a panic.

use redis::{FromRedisValue, ParsingError, Value};

/// How every error of a reply that is not what it should be begins: such a reply is a
/// script and its decoder that disagree, not a state that passes, and is never retried
/// (see [`is_unexpected_reply`]).
const UNEXPECTED: &str = "unexpected reply of ";

/// An error for a reply of `script` that is not what it should be.
pub(crate) fn malformed(script: &str, expected: &str, got: &Value) -> ParsingError {
    format!("{UNEXPECTED}{script}: {got:?} where {expected} was expected").into()
}

/// Whether `e` is a script's reply that its decoder refused (as opposed to bytes on the
/// wire that do not parse, which a new connection fixes).
pub(crate) fn is_unexpected_reply(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::Parse && e.to_string().contains(UNEXPECTED)
}

/// The fields of a script's reply (a Lua table), taken in order.
pub(crate) struct Fields {
    script: &'static str,
    items: std::vec::IntoIter<Value>,
}

impl Fields {
    /// The `len` fields of `reply`, a table from `script`.
    pub(crate) fn new(
        script: &'static str,
        reply: Value,
        len: usize,
    ) -> Result<Self, ParsingError> {
        match reply {
            Value::Array(items) if items.len() == len => Ok(Fields {
                script,
                items: items.into_iter(),
            }),
            other => Err(malformed(
                script,
                &format!("a table of {len} fields"),
                &other,
            )),
        }
    }

    /// The next field, named `what` in an error.
    pub(crate) fn next<T: FromRedisValue>(&mut self, what: &str) -> Result<T, ParsingError> {
        let value = self.value();
        T::from_redis_value(value)
            .map_err(|e| format!("{UNEXPECTED}{}: field `{what}`: {e}", self.script).into())
    }

    /// The next field as it came (`Nil` past the end, which [`Fields::new`] rules out).
    pub(crate) fn value(&mut self) -> Value {
        self.items.next().unwrap_or(Value::Nil)
    }

    /// The next field, a string that must be one of the states `parse` knows.
    pub(crate) fn state<T>(
        &mut self,
        what: &str,
        parse: impl FnOnce(&str) -> Option<T>,
    ) -> Result<T, ParsingError> {
        let value = self.value();
        let text = text(&value);
        match text.as_deref().and_then(parse) {
            Some(state) => Ok(state),
            None => Err(malformed(self.script, &format!("a known `{what}`"), &value)),
        }
    }

    /// The script, for errors.
    pub(crate) fn script(&self) -> &'static str {
        self.script
    }
}

/// A string reply (bulk, simple or verbatim) as text, if it is one.
pub(crate) fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    }
}

/// Lua `false` or nothing: a nil under RESP2, a boolean false under RESP3.
pub(crate) fn is_false(value: &Value) -> bool {
    matches!(value, Value::Nil | Value::Boolean(false))
}

/// A Lua string, or `false` for none.
pub(crate) fn text_or_false(script: &str, value: Value) -> Result<Option<String>, ParsingError> {
    if is_false(&value) {
        return Ok(None);
    }
    match text(&value) {
        Some(text) => Ok(Some(text)),
        None => Err(malformed(script, "a string or false", &value)),
    }
}

/// An integer reply of `script` that must be one of the states `parse` knows.
pub(crate) fn int_state<T>(
    script: &str,
    what: &str,
    value: Value,
    parse: impl FnOnce(i64) -> Option<T>,
) -> Result<T, ParsingError> {
    match value {
        Value::Int(n) => parse(n).ok_or_else(|| malformed(script, what, &Value::Int(n))),
        other => Err(malformed(script, what, &other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_of_the_wrong_size_is_an_error_naming_the_script() {
        let err = Fields::new("x.lua", Value::Array(vec![Value::Int(1)]), 2)
            .err()
            .expect("one field where two are due");
        assert!(err.to_string().contains("x.lua"), "{err}");
        let err = Fields::new("x.lua", Value::Int(1), 1)
            .err()
            .expect("not a table");
        assert!(err.to_string().contains("x.lua"), "{err}");
    }

    #[test]
    fn a_field_of_the_wrong_type_is_an_error_naming_the_script_and_field() {
        let mut fields = Fields::new("x.lua", Value::Array(vec![Value::Nil]), 1).unwrap();
        let err = fields.next::<u64>("count").unwrap_err().to_string();
        assert!(err.contains("x.lua") && err.contains("count"), "{err}");
    }

    #[test]
    fn a_refused_reply_is_not_retried() {
        let refused: redis::RedisError = malformed("x.lua", "a table", &Value::Int(1)).into();
        assert!(is_unexpected_reply(&refused));
        assert!(
            !crate::error::redis_error_is_retryable(&refused),
            "{refused}"
        );
        let mut fields = Fields::new("x.lua", Value::Array(vec![Value::Nil]), 1).unwrap();
        let refused: redis::RedisError = fields.next::<u64>("count").unwrap_err().into();
        assert!(
            !crate::error::redis_error_is_retryable(&refused),
            "{refused}"
        );
        let wire: redis::RedisError = ParsingError::from("invalid response byte").into();
        assert!(crate::error::redis_error_is_retryable(&wire), "{wire}");
    }

    #[test]
    fn lua_false_is_nil_under_resp2_and_a_boolean_under_resp3() {
        assert_eq!(text_or_false("x.lua", Value::Nil).unwrap(), None);
        assert_eq!(text_or_false("x.lua", Value::Boolean(false)).unwrap(), None);
        assert_eq!(
            text_or_false("x.lua", Value::BulkString(b"s1".to_vec())).unwrap(),
            Some("s1".into())
        );
        assert!(text_or_false("x.lua", Value::Int(1)).is_err());
    }

    #[test]
    fn states_outside_the_known_ones_are_errors() {
        let mut fields = Fields::new(
            "x.lua",
            Value::Array(vec![Value::BulkString(b"odd".to_vec())]),
            1,
        )
        .unwrap();
        assert!(fields
            .state("answer", |s| (s == "done").then_some(()))
            .is_err());
        assert!(int_state("x.lua", "a verdict", Value::Int(9), |n| (n == 1)
            .then_some(()))
        .is_err());
    }
}
