//! Alertmanager's webhook payload (version 4) and what the receiver makes of each alert:
//! a `server.dead` to publish, a resolved alert, or a refusal with its reason. Nothing
//! here talks to Redis.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::event::{ServerDead, ServerId, SCHEMA_VERSION};

/// The payload version this receiver understands.
pub const WEBHOOK_VERSION: &str = "4";
/// `source` of every event the receiver publishes.
pub const SOURCE: &str = "alertmanager";
/// The longest `reason` of an event (the contract's limit).
pub const MAX_REASON: usize = 256;
/// The longest fingerprint accepted (Alertmanager's are 16 hex digits).
const MAX_FINGERPRINT: usize = 64;

/// A whole webhook request body.
#[derive(Debug, Clone, Deserialize)]
pub struct Webhook {
    /// Required by the payload's shape (a body without it is refused), not read.
    #[allow(dead_code)]
    pub version: String,
    #[allow(dead_code)]
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub receiver: String,
    #[serde(rename = "groupKey", default)]
    pub group_key: String,
    pub alerts: Vec<Alert>,
}

/// One alert of a webhook.
#[derive(Debug, Clone, Deserialize)]
pub struct Alert {
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    #[serde(rename = "startsAt", default)]
    pub starts_at: String,
    #[allow(dead_code)]
    #[serde(rename = "endsAt", default)]
    pub ends_at: String,
    #[serde(default)]
    pub fingerprint: String,
}

/// Why a request body is refused as a whole (HTTP 400): nothing of it is published.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PayloadError {
    #[error("the body is not valid JSON: {0}")]
    Json(String),
    #[error("the body has no string `version`: not an Alertmanager webhook payload")]
    NoVersion,
    #[error("unsupported webhook payload version {0:?} (this receiver understands \"4\")")]
    Version(String),
    #[error("not an Alertmanager webhook payload: {0}")]
    Shape(String),
}

/// Parses a request body, checking the version before the shape, so that a payload of
/// another version is named as such.
pub fn parse(body: &[u8]) -> Result<Webhook, PayloadError> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| PayloadError::Json(e.to_string()))?;
    match value.get("version").and_then(|v| v.as_str()) {
        None => return Err(PayloadError::NoVersion),
        Some(v) if v != WEBHOOK_VERSION => return Err(PayloadError::Version(v.to_owned())),
        Some(_) => {}
    }
    serde_json::from_value(value).map_err(|e| PayloadError::Shape(e.to_string()))
}

/// What to do with one alert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Firing and naming a server: publish `event` once per `alert_id`.
    Publish {
        /// The receiver's id of the alert: fingerprint and start (unix ms). The same
        /// alert sent again has the same id.
        alert_id: String,
        event: ServerDead,
        server: ServerId,
    },
    /// Resolved: nothing to publish.
    Resolved,
    /// Not usable; the reason goes into the 422 answer.
    Refused(String),
}

/// Decides what to do with `alert`, whose server is named by label `label`.
pub fn decide(alert: &Alert, label: &str) -> Decision {
    match alert.status.as_str() {
        "firing" => {}
        "resolved" => return Decision::Resolved,
        other => {
            return Decision::Refused(format!(
                "status {other:?} is neither \"firing\" nor \"resolved\""
            ))
        }
    }
    let Some(value) = alert.labels.get(label) else {
        return Decision::Refused(format!("no label `{label}` naming the dead server"));
    };
    let server = match ServerId::parse(value) {
        Ok(s) => s,
        Err(e) => return Decision::Refused(format!("label `{label}`: {e}")),
    };
    let fp = &alert.fingerprint;
    if fp.is_empty() || fp.len() > MAX_FINGERPRINT || !fp.bytes().all(|b| b.is_ascii_alphanumeric())
    {
        return Decision::Refused(format!(
            "`fingerprint` must be 1 to {MAX_FINGERPRINT} letters or digits, got {fp:?}"
        ));
    }
    let started_ms = match rfc3339_ms(&alert.starts_at) {
        Some(ms) => ms,
        None => {
            return Decision::Refused(format!(
                "`startsAt` is not an RFC 3339 time after 1970: {:?}",
                alert.starts_at
            ))
        }
    };
    let alert_id = format!("{fp}:{started_ms}");
    let event = ServerDead {
        v: SCHEMA_VERSION as i64,
        event_id: format!("{SOURCE}:{alert_id}"),
        server_id: server.as_str().to_owned(),
        detected_at_ms: started_ms,
        reason: Some(reason(alert)),
        source: Some(SOURCE.to_owned()),
    };
    Decision::Publish {
        alert_id,
        event,
        server,
    }
}

/// The event's `reason`: annotation `summary`, else `description`, else the alert's
/// name, cut to [`MAX_REASON`] bytes on a character boundary.
pub fn reason(alert: &Alert) -> String {
    let text = ["summary", "description"]
        .iter()
        .filter_map(|k| alert.annotations.get(*k))
        .chain(alert.labels.get("alertname"))
        .find(|t| !t.trim().is_empty())
        .map(String::as_str)
        .unwrap_or("alert from Alertmanager");
    truncate(text, MAX_REASON).to_owned()
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
pub fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Unix milliseconds of an RFC 3339 date-time (`2024-05-01T12:00:00.123456789Z`,
/// `...+02:00`); None if `s` is not one or is before 1970.
pub fn rfc3339_ms(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    let num = |from: usize, len: usize| -> Option<i64> {
        let part = b.get(from..from + len)?;
        if !part.iter().all(u8::is_ascii_digit) {
            return None;
        }
        std::str::from_utf8(part).ok()?.parse().ok()
    };
    let sep = |at: usize, c: &[u8]| b.get(at).is_some_and(|x| c.contains(x));
    let (year, month, day) = (num(0, 4)?, num(5, 2)?, num(8, 2)?);
    let (hour, minute, second) = (num(11, 2)?, num(14, 2)?, num(17, 2)?);
    if !(sep(4, b"-") && sep(7, b"-") && sep(10, b"Tt ") && sep(13, b":") && sep(16, b":")) {
        return None;
    }
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let days_in_month = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => return None,
    };
    // A leap second (:60) is read as the last millisecond of its minute.
    if day < 1 || day > days_in_month || hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    let mut i = 19;
    let mut millis = 0i64;
    if sep(i, b".") {
        i += 1;
        let start = i;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            if i - start < 3 {
                millis = millis * 10 + i64::from(b[i] - b'0');
            }
            i += 1;
        }
        if i == start {
            return None;
        }
        for _ in (i - start)..3 {
            millis *= 10;
        }
    }
    let offset_s = match b.get(i)? {
        b'Z' | b'z' if i + 1 == b.len() => 0,
        sign @ (b'+' | b'-') if i + 6 == b.len() && sep(i + 3, b":") => {
            let (h, m) = (num(i + 1, 2)?, num(i + 4, 2)?);
            if h > 23 || m > 59 {
                return None;
            }
            let s = h * 3600 + m * 60;
            if *sign == b'+' {
                s
            } else {
                -s
            }
        }
        _ => return None,
    };
    let days = days_from_civil(year, month, day);
    let seconds = days * 86_400 + hour * 3600 + minute * 60 + second.min(59) - offset_s;
    let millis = if second == 60 { 999 } else { millis };
    let ms = seconds.checked_mul(1000)?.checked_add(millis)?;
    u64::try_from(ms).ok()
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// One refused alert, as the 422 answer lists it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Refusal {
    /// Position of the alert in the webhook's `alerts`, from 0.
    pub index: usize,
    pub fingerprint: String,
    pub alertname: Option<String>,
    pub reason: String,
}

/// The JSON answer to an accepted webhook (200, or 422 when some alert was refused).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Answer {
    /// Events published by this request.
    pub published: usize,
    /// Firing alerts already published before (nothing new).
    pub duplicate: usize,
    /// Resolved alerts (nothing published).
    pub resolved: usize,
    /// Alerts refused, each with why; the others were handled.
    pub refused: Vec<Refusal>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alert(status: &str, labels: &[(&str, &str)]) -> Alert {
        Alert {
            status: status.into(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect(),
            annotations: BTreeMap::new(),
            starts_at: "2024-05-01T12:00:00.250Z".into(),
            ends_at: "0001-01-01T00:00:00Z".into(),
            fingerprint: "0a1b2c3d4e5f6789".into(),
        }
    }

    #[test]
    fn parses_rfc3339() {
        assert_eq!(rfc3339_ms("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(rfc3339_ms("2024-05-01T12:00:00Z"), Some(1_714_564_800_000));
        assert_eq!(
            rfc3339_ms("2024-05-01T12:00:00.123456789Z"),
            Some(1_714_564_800_123)
        );
        assert_eq!(
            rfc3339_ms("2024-05-01T12:00:00.5Z"),
            Some(1_714_564_800_500)
        );
        assert_eq!(
            rfc3339_ms("2024-05-01T14:00:00+02:00"),
            Some(1_714_564_800_000)
        );
        assert_eq!(
            rfc3339_ms("2024-05-01T07:30:00-04:30"),
            Some(1_714_564_800_000)
        );
        assert_eq!(rfc3339_ms("2024-02-29T00:00:00Z"), Some(1_709_164_800_000));
        for bad in [
            "",
            "2023-02-29T00:00:00Z",
            "2024-05-01",
            "2024-05-01T12:00:00",
            "2024-05-01T12:00:00.Z",
            "2024-13-01T12:00:00Z",
            "2024-05-01T24:00:00Z",
            "0001-01-01T00:00:00Z",
            "2024-05-01T12:00:00Zjunk",
            "2024-05-01T12:00:00+2:00",
            "２024-05-01T12:00:00Z",
        ] {
            assert_eq!(rfc3339_ms(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn truncates_on_a_char_boundary() {
        assert_eq!(truncate("abc", 256), "abc");
        let s = "é".repeat(200); // 400 bytes
        let t = truncate(&s, MAX_REASON);
        assert_eq!(t.len(), 256);
        let s = format!("a{}", "é".repeat(200));
        assert_eq!(truncate(&s, MAX_REASON).len(), 255);
    }

    #[test]
    fn decides_per_alert() {
        let mut a = alert("firing", &[("server_id", "gw-1"), ("alertname", "Down")]);
        let Decision::Publish {
            alert_id,
            event,
            server,
        } = decide(&a, "server_id")
        else {
            panic!()
        };
        assert_eq!(alert_id, "0a1b2c3d4e5f6789:1714564800250");
        assert_eq!(server.as_str(), "gw-1");
        assert_eq!(event.detected_at_ms, 1_714_564_800_250);
        assert_eq!(event.reason.as_deref(), Some("Down"));
        assert_eq!(event.source.as_deref(), Some(SOURCE));
        assert_eq!(
            event.event_id,
            "alertmanager:0a1b2c3d4e5f6789:1714564800250"
        );
        event.validate().unwrap();
        a.annotations.insert("description".into(), "d".into());
        a.annotations.insert("summary".into(), "x".repeat(300));
        let Decision::Publish { event, .. } = decide(&a, "server_id") else {
            panic!()
        };
        assert_eq!(event.reason.unwrap().len(), 256);

        assert_eq!(
            decide(&alert("resolved", &[]), "server_id"),
            Decision::Resolved
        );
        let refused = |a: &Alert| match decide(a, "server_id") {
            Decision::Refused(why) => why,
            other => panic!("{other:?}"),
        };
        assert!(refused(&alert("firing", &[])).contains("no label `server_id`"));
        assert!(refused(&alert("firing", &[("server_id", "a b")])).contains("bad server_id"));
        assert!(refused(&alert("pending", &[])).contains("pending"));
        let mut a = alert("firing", &[("server_id", "gw-1")]);
        a.starts_at = "yesterday".into();
        assert!(refused(&a).contains("startsAt"));
        a.starts_at = "2024-05-01T12:00:00Z".into();
        a.fingerprint = String::new();
        assert!(refused(&a).contains("fingerprint"));
    }

    #[test]
    fn parses_only_version_4() {
        assert!(matches!(parse(b"{"), Err(PayloadError::Json(_))));
        assert_eq!(
            parse(b"{\"alerts\":[]}").unwrap_err(),
            PayloadError::NoVersion
        );
        assert_eq!(
            parse(b"{\"version\":\"5\",\"alerts\":[]}").unwrap_err(),
            PayloadError::Version("5".into())
        );
        assert!(matches!(
            parse(b"{\"version\":\"4\"}"),
            Err(PayloadError::Shape(_))
        ));
        let w = parse(
            br#"{"version":"4","status":"firing","receiver":"r","groupKey":"{}:{}",
                 "alerts":[{"status":"firing","labels":{"server_id":"gw-1"},"annotations":{},
                 "startsAt":"2024-05-01T12:00:00Z","endsAt":"0001-01-01T00:00:00Z",
                 "generatorURL":"http://x","fingerprint":"abc"}],"truncatedAlerts":0}"#,
        )
        .unwrap();
        assert_eq!(w.alerts.len(), 1);
        assert_eq!(w.group_key, "{}:{}");
    }
}
