//! The published schemas (`schemas/server-dead.schema.json`, `schemas/asyncapi.yaml`) and
//! the code agree: what the code encodes is valid per the schema, hand-written payloads
//! that the schema accepts decode, and what the schema rejects the decoder rejects too.
//! Pure tests: no Redis.

use registry_janitor::event::{ServerDead, ServerId, EVENT_TYPE, SCHEMA_VERSION};
use rmpv::Value as Mp;
use serde_json::{json, Value as Json};

const SCHEMA: &str = include_str!("../schemas/server-dead.schema.json");
const ASYNCAPI: &str = include_str!("../schemas/asyncapi.yaml");
const SCHEMA_FILE: &str = "server-dead.schema.json";
const MAX: usize = 65536;

fn schema() -> Json {
    serde_json::from_str(SCHEMA).unwrap()
}

fn validator() -> jsonschema::Validator {
    jsonschema::validator_for(&schema()).unwrap()
}

fn schema_errors(instance: &Json) -> Vec<String> {
    validator()
        .iter_errors(instance)
        .map(|e| format!("{} at {}", e, e.instance_path))
        .collect()
}

/// MessagePack value -> its JSON equivalent, for validation against the JSON Schema.
fn mp_to_json(v: &Mp) -> Json {
    match v {
        Mp::Nil => Json::Null,
        Mp::Boolean(b) => Json::Bool(*b),
        Mp::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), _) => json!(u),
            (None, Some(s)) => json!(s),
            (None, None) => unreachable!("an integer is u64 or i64"),
        },
        Mp::F32(f) => json!(f),
        Mp::F64(f) => json!(f),
        Mp::String(s) => Json::String(s.as_str().expect("UTF-8 string").to_owned()),
        Mp::Array(items) => Json::Array(items.iter().map(mp_to_json).collect()),
        Mp::Map(pairs) => Json::Object(
            pairs
                .iter()
                .map(|(k, v)| {
                    let k = k.as_str().expect("map keys are strings").to_owned();
                    (k, mp_to_json(v))
                })
                .collect(),
        ),
        Mp::Binary(_) | Mp::Ext(..) => panic!("no JSON equivalent for {v:?}"),
    }
}

/// JSON value -> MessagePack value, to feed JSON examples to the decoder.
fn json_to_mp(v: &Json) -> Mp {
    match v {
        Json::Null => Mp::Nil,
        Json::Bool(b) => Mp::Boolean(*b),
        Json::Number(n) => {
            if let Some(u) = n.as_u64() {
                Mp::from(u)
            } else if let Some(i) = n.as_i64() {
                Mp::from(i)
            } else {
                Mp::F64(n.as_f64().unwrap())
            }
        }
        Json::String(s) => Mp::from(s.as_str()),
        Json::Array(items) => Mp::Array(items.iter().map(json_to_mp).collect()),
        Json::Object(map) => Mp::Map(
            map.iter()
                .map(|(k, v)| (Mp::from(k.as_str()), json_to_mp(v)))
                .collect(),
        ),
    }
}

fn bytes_to_json(bytes: &[u8]) -> Json {
    let value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
    mp_to_json(&value)
}

fn encode_mp(v: &Mp) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

/// A map with these keys in this order.
fn mp_map(pairs: &[(&str, Mp)]) -> Mp {
    Mp::Map(
        pairs
            .iter()
            .map(|(k, v)| (Mp::from(*k), v.clone()))
            .collect(),
    )
}

fn valid_pairs() -> Vec<(&'static str, Mp)> {
    vec![
        ("v", Mp::from(1)),
        ("event_id", Mp::from("01JD3Q8M2X7Y4K9P0R5S6T7V8W")),
        ("server_id", Mp::from("gw-7#1732181000123")),
        ("detected_at_ms", Mp::from(1_732_181_030_456_u64)),
    ]
}

fn with(key: &'static str, value: Mp) -> Vec<(&'static str, Mp)> {
    let mut pairs = valid_pairs();
    match pairs.iter_mut().find(|(k, _)| *k == key) {
        Some(pair) => pair.1 = value,
        None => pairs.push((key, value)),
    }
    pairs
}

fn without(key: &str) -> Vec<(&'static str, Mp)> {
    valid_pairs()
        .into_iter()
        .filter(|(k, _)| *k != key)
        .collect()
}

#[test]
fn schema_is_a_valid_draft_2020_12_schema() {
    let s = schema();
    assert_eq!(
        s["$schema"], "https://json-schema.org/draft/2020-12/schema",
        "draft 2020-12"
    );
    jsonschema::meta::validate(&s).unwrap();
    assert_eq!(validator().draft(), jsonschema::Draft::Draft202012);
    // The schema's version bounds are the code's version.
    assert_eq!(s["properties"]["v"]["minimum"], json!(1));
    assert_eq!(s["properties"]["v"]["maximum"], json!(SCHEMA_VERSION));
    assert_eq!(s["additionalProperties"], json!(true));
    // Every property is documented.
    for (name, prop) in s["properties"].as_object().unwrap() {
        assert!(
            prop["description"].as_str().is_some_and(|d| !d.is_empty()),
            "{name} has no description"
        );
    }
}

#[test]
fn schema_examples_are_valid_and_decode() {
    let s = schema();
    let examples = s["examples"].as_array().unwrap();
    assert!(!examples.is_empty());
    for example in examples {
        assert_eq!(schema_errors(example), Vec::<String>::new(), "{example}");
        let bytes = encode_mp(&json_to_mp(example));
        let (event, server) = ServerDead::decode(&bytes, MAX).unwrap();
        assert_eq!(event.server_id, example["server_id"].as_str().unwrap());
        assert_eq!(server.as_str(), event.server_id);
        assert_eq!(
            event.detected_at_ms,
            example["detected_at_ms"].as_u64().unwrap()
        );
    }
}

#[test]
fn encoded_events_are_valid_per_schema() {
    let server = ServerId::parse("gw-7#1732181000123").unwrap();
    let full = ServerDead::new(
        &server,
        Some("heartbeat timeout".to_owned()),
        Some("monitoring".to_owned()),
    );
    let bare = ServerDead::new(&server, None, None);
    let s = schema();
    let known: Vec<&String> = s["properties"].as_object().unwrap().keys().collect();
    let required: Vec<&str> = s["required"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap())
        .collect();

    for event in [&full, &bare] {
        let bytes = event.encode();
        let instance = bytes_to_json(&bytes);
        assert_eq!(schema_errors(&instance), Vec::<String>::new(), "{instance}");
        let obj = instance.as_object().unwrap();
        // Named keys, all of them known to the schema, the required ones present.
        for key in obj.keys() {
            assert!(known.contains(&key), "encoded key {key} not in the schema");
        }
        for key in &required {
            assert!(obj.contains_key(*key), "encoded payload lacks {key}");
        }
        assert_eq!(instance["v"], json!(SCHEMA_VERSION));
        assert_eq!(instance["server_id"], "gw-7#1732181000123");
        assert_eq!(instance["detected_at_ms"], json!(event.detected_at_ms));
    }
    let full_json = bytes_to_json(&full.encode());
    assert_eq!(full_json["reason"], "heartbeat timeout");
    assert_eq!(full_json["source"], "monitoring");
    // Absent options are omitted, not encoded as nil.
    let bare_json = bytes_to_json(&bare.encode());
    assert!(bare_json.get("reason").is_none(), "{bare_json}");
    assert!(bare_json.get("source").is_none(), "{bare_json}");
}

#[test]
fn hand_written_payload_decodes() {
    // Keys in another order than the struct, an unknown key, and a positive fixint.
    let map = mp_map(&[
        ("source", Mp::from("monitoring")),
        ("trace_id", Mp::from("4bf92f3577b34da6a3ce929d0e0e4736")),
        ("detected_at_ms", Mp::from(42)),
        ("server_id", Mp::from("gw-3#1732180000000")),
        ("reason", Mp::from("heartbeat timeout")),
        ("event_id", Mp::from("evt-1")),
        ("v", Mp::from(1)),
    ]);
    let bytes = encode_mp(&map);
    assert_eq!(
        schema_errors(&mp_to_json(&map)),
        Vec::<String>::new(),
        "the schema accepts unknown keys"
    );
    let (event, server) = ServerDead::decode(&bytes, MAX).unwrap();
    assert_eq!(
        event,
        ServerDead {
            v: 1,
            event_id: "evt-1".to_owned(),
            server_id: "gw-3#1732180000000".to_owned(),
            detected_at_ms: 42,
            reason: Some("heartbeat timeout".to_owned()),
            source: Some("monitoring".to_owned()),
        }
    );
    assert_eq!(server, ServerId::parse("gw-3#1732180000000").unwrap());

    // Only the required keys.
    let bytes = encode_mp(&mp_map(&valid_pairs()));
    let (event, _) = ServerDead::decode(&bytes, MAX).unwrap();
    assert_eq!(event.reason, None);
    assert_eq!(event.source, None);
    assert_eq!(event.detected_at_ms, 1_732_181_030_456);
}

#[test]
fn schema_and_decoder_reject_the_same_payloads() {
    let cases: Vec<(&str, Vec<(&'static str, Mp)>)> = vec![
        ("missing server_id", without("server_id")),
        ("missing event_id", without("event_id")),
        ("missing v", without("v")),
        ("missing detected_at_ms", without("detected_at_ms")),
        ("server_id with {", with("server_id", Mp::from("gw{7}"))),
        ("server_id with }", with("server_id", Mp::from("gw}7"))),
        (
            "server_id with a space",
            with("server_id", Mp::from("gw 7")),
        ),
        (
            "server_id with DEL",
            with("server_id", Mp::from("gw\u{7f}")),
        ),
        ("server_id non-ASCII", with("server_id", Mp::from("gwé"))),
        ("empty server_id", with("server_id", Mp::from(""))),
        (
            "server_id too long",
            with("server_id", Mp::from("x".repeat(201))),
        ),
        ("server_id not a string", with("server_id", Mp::from(7))),
        ("v = 2", with("v", Mp::from(2))),
        ("v = 0", with("v", Mp::from(0))),
        ("v a string", with("v", Mp::from("1"))),
        (
            "detected_at_ms negative",
            with("detected_at_ms", Mp::from(-5)),
        ),
        (
            "detected_at_ms a string",
            with("detected_at_ms", Mp::from("1732181030456")),
        ),
        ("empty event_id", with("event_id", Mp::from(""))),
        (
            "event_id too long",
            with("event_id", Mp::from("e".repeat(129))),
        ),
        ("reason too long", with("reason", Mp::from("r".repeat(257)))),
        ("source too long", with("source", Mp::from("s".repeat(65)))),
        ("reason not a string", with("reason", Mp::from(3))),
    ];
    for (what, pairs) in cases {
        let map = mp_map(&pairs);
        let instance = mp_to_json(&map);
        assert!(
            !validator().is_valid(&instance),
            "schema accepted {what}: {instance}"
        );
        let result = ServerDead::decode(&encode_mp(&map), MAX);
        assert!(result.is_err(), "decoder accepted {what}: {result:?}");
    }
    // Limits are inclusive in both.
    for pairs in [
        with("server_id", Mp::from("x".repeat(200))),
        with("event_id", Mp::from("e".repeat(128))),
        with("reason", Mp::from("r".repeat(256))),
        with("source", Mp::from("s".repeat(64))),
        with("server_id", Mp::from("!|~z")),
        with("detected_at_ms", Mp::from(0)),
    ] {
        let map = mp_map(&pairs);
        let instance = mp_to_json(&map);
        assert_eq!(schema_errors(&instance), Vec::<String>::new(), "{instance}");
        ServerDead::decode(&encode_mp(&map), MAX).unwrap();
    }
}

/// Follows a local `$ref` (`#/a/b`) in the AsyncAPI document, if `v` is one.
fn resolve<'a>(doc: &'a Json, v: &'a Json) -> &'a Json {
    match v.get("$ref").and_then(Json::as_str) {
        Some(r) if r.starts_with("#/") => {
            let target = doc
                .pointer(&r[1..])
                .unwrap_or_else(|| panic!("dangling $ref {r}"));
            resolve(doc, target)
        }
        _ => v,
    }
}

#[test]
fn asyncapi_document_matches_the_contract() {
    let doc: Json = serde_yaml::from_str(ASYNCAPI).unwrap();
    assert_eq!(doc["asyncapi"], "3.0.0");
    assert!(doc["info"]["title"].is_string());
    assert!(doc["info"]["version"].is_string());
    assert_eq!(doc["servers"]["redis"]["protocol"], "redis");
    assert_eq!(doc["servers"]["redis"]["host"], "127.0.0.1:6379");

    let events = &doc["channels"]["registryEvents"];
    let address = events["address"].as_str().unwrap();
    assert!(address.contains("registry:events"), "{address}");
    assert_eq!(address, "{key_prefix}registry:events");
    assert!(events["parameters"].get("key_prefix").is_some());
    let dead = &doc["channels"]["deadLetters"];
    assert_eq!(dead["address"], "{key_prefix}registry:events:dead");

    // The message: MessagePack, header `type` = server.dead, payload = the JSON Schema.
    let message = resolve(&doc, &events["messages"]["serverDead"]);
    assert_eq!(message["contentType"], "application/msgpack");
    assert_eq!(message["name"], EVENT_TYPE);
    let headers = resolve(&doc, &message["headers"]);
    assert_eq!(headers["properties"]["type"]["const"], EVENT_TYPE);
    assert!(headers["required"]
        .as_array()
        .unwrap()
        .contains(&json!("type")));
    let payload = resolve(&doc, &message["payload"]);
    let s = schema();
    match payload.get("$ref").and_then(Json::as_str) {
        Some(r) => {
            assert!(r.ends_with(SCHEMA_FILE), "payload refers to {r}");
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("schemas")
                .join(r);
            let file: Json = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
            assert_eq!(file, s);
        }
        None => assert_eq!(payload["required"], s["required"]),
    }
    // Its examples are valid payloads that the code decodes.
    for example in message["examples"].as_array().into_iter().flatten() {
        assert_eq!(example["headers"]["type"], EVENT_TYPE);
        let p = &example["payload"];
        assert_eq!(schema_errors(p), Vec::<String>::new(), "{p}");
        ServerDead::decode(&encode_mp(&json_to_mp(p)), MAX).unwrap();
    }

    // Dead letters: the janitor's own fields.
    let dl = resolve(&doc, &dead["messages"]["deadLetter"]);
    let dl_headers = resolve(&doc, &dl["headers"]);
    for field in ["error", "failed_at_ms"] {
        assert!(
            dl_headers["properties"].get(field).is_some(),
            "dead letter lacks {field}"
        );
    }

    // Operations point at existing channels and at messages of those channels.
    let expect = [
        ("publishServerDead", "send", "#/channels/registryEvents"),
        ("consumeServerDead", "receive", "#/channels/registryEvents"),
        ("receiveDeadLetters", "receive", "#/channels/deadLetters"),
    ];
    for (name, action, channel) in expect {
        let op = &doc["operations"][name];
        assert_eq!(op["action"], action, "{name}");
        assert_eq!(op["channel"]["$ref"], channel, "{name}");
        let ch = resolve(&doc, &op["channel"]);
        for m in op["messages"].as_array().unwrap() {
            let r = m["$ref"].as_str().unwrap();
            assert!(
                r.starts_with(&format!("{channel}/messages/")),
                "{name}: {r}"
            );
            let resolved = resolve(&doc, m);
            assert!(
                ch["messages"]
                    .as_object()
                    .unwrap()
                    .values()
                    .any(|cm| resolve(&doc, cm) == resolved),
                "{name}: message {r} not in its channel"
            );
        }
    }
    assert_eq!(
        doc["operations"]["consumeServerDead"]["x-redis-consumer-group"],
        "registry-janitor"
    );
}
