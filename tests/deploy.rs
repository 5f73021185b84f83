//! Structural checks of the deployment files: k8s/ and the Dockerfile.
//!
//! `.ci/validate-deploy` checks each built-in Kubernetes object against the Kubernetes
//! schemas, lints the Dockerfile and checks the JSON Schema, offline. What those tools
//! cannot check is here: the CRD kinds (KEDA's ScaledObject and TriggerAuthentication,
//! the Prometheus Operator's ServiceMonitor) and the references between files (a
//! ScaledObject naming a Deployment that exists, probes on the port the container declares,
//! a ServiceMonitor on the Service's port name...). These tests need no Redis.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
};

use serde::Deserialize;
use serde_yaml::Value;

const WORKER: &str = "registry-janitor-worker";
const RECONCILER: &str = "registry-janitor-reconciler";
const SECRET: &str = "registry-janitor-redis";

fn repo_file(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// Every YAML document of a file under k8s/.
fn load_k8s(file: &str) -> Vec<Value> {
    let path = repo_file("k8s").join(file);
    let text =
        fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("parsing {file}: {e}")))
        .filter(|doc| !doc.is_null())
        .collect()
}

fn kustomization() -> Value {
    load_k8s("kustomization.yaml").remove(0)
}

/// The file names listed under `resources:` in k8s/kustomization.yaml.
fn resource_files() -> Vec<String> {
    kustomization()["resources"]
        .as_sequence()
        .expect("kustomization.yaml has a resources list")
        .iter()
        .map(|r| r.as_str().unwrap().to_string())
        .collect()
}

/// Every object the kustomization deploys.
fn resources() -> Vec<Value> {
    resource_files().iter().flat_map(|f| load_k8s(f)).collect()
}

fn of_kind(kind: &str) -> Vec<Value> {
    resources()
        .into_iter()
        .filter(|r| r["kind"] == kind)
        .collect()
}

/// The one deployed object of this kind and name.
fn object(kind: &str, name: &str) -> Value {
    let found: Vec<Value> = of_kind(kind)
        .into_iter()
        .filter(|r| r["metadata"]["name"] == name)
        .collect();
    assert_eq!(found.len(), 1, "expected exactly one {kind} named {name}");
    found.into_iter().next().unwrap()
}

fn text(v: &Value) -> &str {
    v.as_str()
        .unwrap_or_else(|| panic!("expected a string, found {v:?}"))
}

fn string_map(v: &Value) -> BTreeMap<String, String> {
    v.as_mapping()
        .unwrap_or_else(|| panic!("expected a mapping, found {v:?}"))
        .iter()
        .map(|(k, v)| (text(k).to_string(), text(v).to_string()))
        .collect()
}

/// True when every label of `selector` is among `labels`.
fn selects(selector: &Value, labels: &Value) -> bool {
    let labels = string_map(labels);
    let selector = string_map(selector);
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

fn deployments() -> Vec<Value> {
    vec![
        object("Deployment", WORKER),
        object("Deployment", RECONCILER),
    ]
}

fn container(deployment: &Value) -> &Value {
    let containers = deployment["spec"]["template"]["spec"]["containers"]
        .as_sequence()
        .unwrap();
    assert_eq!(containers.len(), 1, "one container per pod");
    &containers[0]
}

fn name_of(v: &Value) -> &str {
    text(&v["metadata"]["name"])
}

#[test]
fn every_kustomization_resource_exists_parses_and_has_no_namespace() {
    let files = resource_files();
    assert!(!files.is_empty());
    for file in &files {
        assert!(
            repo_file("k8s").join(file).is_file(),
            "k8s/{file} is missing"
        );
        let docs = load_k8s(file);
        assert!(!docs.is_empty(), "k8s/{file} holds no object");
        for doc in docs {
            assert!(doc["apiVersion"].is_string(), "{file}: apiVersion");
            assert!(doc["kind"].is_string(), "{file}: kind");
            assert!(doc["metadata"]["name"].is_string(), "{file}: metadata.name");
            assert!(
                doc["metadata"]["namespace"].is_null(),
                "{file}: the base is namespace-agnostic, set the namespace in an overlay"
            );
        }
    }
    assert!(kustomization()["namespace"].is_null());
}

#[test]
fn the_secret_is_referenced_but_only_its_example_is_shipped() {
    let files = resource_files();
    assert!(
        !files.iter().any(|f| f.contains("secret")),
        "secret.example.yaml must not be a kustomization resource: {files:?}"
    );
    assert!(
        of_kind("Secret").is_empty(),
        "no Secret is deployed by the base"
    );

    let example = load_k8s("secret.example.yaml").remove(0);
    assert_eq!(example["kind"], "Secret");
    assert_eq!(name_of(&example), SECRET);
    let keys = string_map(&example["stringData"]);
    for key in ["redis-url", "redis-username", "redis-password"] {
        assert!(keys.contains_key(key), "the example Secret has {key}");
    }
    assert!(keys["redis-url"].contains("REPLACE_ME"), "placeholder only");
    assert!(
        keys["redis-password"].contains("REPLACE_ME"),
        "placeholder only"
    );
}

#[test]
fn keda_scales_the_worker_deployment_on_the_consumer_group_lag() {
    let scaled = object("ScaledObject", WORKER);
    assert_eq!(scaled["apiVersion"], "keda.sh/v1alpha1");

    let target = &scaled["spec"]["scaleTargetRef"];
    assert_eq!(target["name"], WORKER);
    assert!(target["kind"].is_null() || target["kind"] == "Deployment");
    object("Deployment", text(&target["name"]));

    let min = scaled["spec"]["minReplicaCount"].as_u64().unwrap();
    let max = scaled["spec"]["maxReplicaCount"].as_u64().unwrap();
    assert!(min >= 1, "at least one worker always consumes");
    assert!(max >= min);

    let triggers = scaled["spec"]["triggers"].as_sequence().unwrap();
    assert_eq!(triggers.len(), 1);
    let trigger = &triggers[0];
    assert_eq!(trigger["type"], "redis-streams");
    // KEDA's trigger metadata is a map of strings: numbers must be quoted.
    let metadata = string_map(&trigger["metadata"]);
    assert_eq!(metadata["stream"], "registry:events");
    assert_eq!(metadata["consumerGroup"], "registry-janitor");
    let lag: u64 = metadata["lagCount"].parse().unwrap();
    assert!(lag > 0);
    assert!(
        !metadata.contains_key("pendingEntriesCount") && !metadata.contains_key("streamLength"),
        "scaling is on the group lag alone"
    );
    assert!(metadata.contains_key("address") || metadata.contains_key("host"));
    for secretish in ["password", "username"] {
        assert!(
            !metadata.contains_key(secretish),
            "{secretish} comes from the TriggerAuthentication"
        );
    }

    let auth_name = text(&trigger["authenticationRef"]["name"]);
    let auth = object("TriggerAuthentication", auth_name);
    assert_eq!(auth["apiVersion"], "keda.sh/v1alpha1");
    let refs = auth["spec"]["secretTargetRef"].as_sequence().unwrap();
    let example = string_map(&load_k8s("secret.example.yaml")[0]["stringData"]);
    let mut parameters = Vec::new();
    for r in refs {
        assert_eq!(r["name"], SECRET);
        assert!(
            example.contains_key(text(&r["key"])),
            "the Secret example documents the key {:?}",
            r["key"]
        );
        parameters.push(text(&r["parameter"]));
    }
    assert!(parameters.contains(&"password"), "{parameters:?}");
}

#[test]
fn the_service_monitor_scrapes_the_service_port_by_name() {
    let service = object("Service", "registry-janitor");
    let ports = service["spec"]["ports"].as_sequence().unwrap();
    assert_eq!(ports.len(), 1);
    let port = &ports[0];
    assert_eq!(port["port"].as_u64(), Some(9464));

    let monitor = object("ServiceMonitor", "registry-janitor");
    assert_eq!(monitor["apiVersion"], "monitoring.coreos.com/v1");
    assert!(selects(
        &monitor["spec"]["selector"]["matchLabels"],
        &service["metadata"]["labels"]
    ));
    let endpoints = monitor["spec"]["endpoints"].as_sequence().unwrap();
    assert!(!endpoints.is_empty());
    for endpoint in endpoints {
        assert_eq!(endpoint["port"], port["name"]);
        assert_eq!(endpoint["path"], "/metrics");
    }

    // The Service reaches the metrics port of both kinds of pod.
    for deployment in deployments() {
        let pod_labels = &deployment["spec"]["template"]["metadata"]["labels"];
        assert!(selects(&service["spec"]["selector"], pod_labels));
        assert!(declares_port(container(&deployment), &port["targetPort"]));
    }
}

/// True when `port` (a name or a number) is one of the container's ports.
fn declares_port(container: &Value, port: &Value) -> bool {
    container["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .any(|p| (port.is_string() && p["name"] == *port) || p["containerPort"] == *port)
}

#[test]
fn probes_check_healthz_and_readyz_on_the_declared_metrics_port() {
    for deployment in deployments() {
        let name = name_of(&deployment);
        let c = container(&deployment);
        let metrics = c["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|p| p["name"] == "metrics")
            .unwrap_or_else(|| panic!("{name}: a port named metrics"));
        assert_eq!(metrics["containerPort"].as_u64(), Some(9464));
        for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
            let get = &c[probe]["httpGet"];
            assert_eq!(get["path"], path, "{name}: {probe}");
            assert!(declares_port(c, &get["port"]), "{name}: {probe} port");
        }
    }
}

#[test]
fn worker_and_reconciler_run_their_subcommands() {
    let worker = object("Deployment", WORKER);
    let reconciler = object("Deployment", RECONCILER);
    assert_eq!(container(&worker)["args"][0], "worker");
    assert_eq!(container(&reconciler)["args"][0], "reconcile");
    assert!(worker["spec"]["replicas"].as_u64().unwrap() >= 1);
    assert!(reconciler["spec"]["replicas"].as_u64().unwrap() >= 1);
    for deployment in deployments() {
        // The pod template matches its own selector.
        assert!(selects(
            &deployment["spec"]["selector"]["matchLabels"],
            &deployment["spec"]["template"]["metadata"]["labels"]
        ));
    }
}

#[test]
fn the_grace_period_leaves_room_for_the_drain() {
    let drain_ms: u64 = string_map(&object("ConfigMap", "registry-janitor")["data"])
        .get("JANITOR_DRAIN_TIMEOUT_MS")
        .map_or(20_000, |v| v.parse().unwrap());
    for deployment in deployments() {
        let grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            .as_u64()
            .unwrap();
        assert!(grace >= 25, "{}: drain 20 s + margin", name_of(&deployment));
        assert!(grace * 1000 >= drain_ms + 5_000, "{}", name_of(&deployment));
    }
}

#[test]
fn pods_run_as_non_root_on_a_read_only_root_filesystem() {
    for deployment in deployments() {
        let name = name_of(&deployment);
        let pod = &deployment["spec"]["template"]["spec"]["securityContext"];
        let c = &container(&deployment)["securityContext"];
        let either = |key: &str| {
            if c[key].is_null() {
                pod[key].clone()
            } else {
                c[key].clone()
            }
        };
        assert_eq!(either("runAsNonRoot"), Value::Bool(true), "{name}");
        assert!(either("runAsUser").as_u64().unwrap() > 0, "{name}");
        assert!(either("runAsGroup").as_u64().unwrap() > 0, "{name}");
        assert_eq!(either("seccompProfile")["type"], "RuntimeDefault", "{name}");
        assert_eq!(c["readOnlyRootFilesystem"], Value::Bool(true), "{name}");
        assert_eq!(c["allowPrivilegeEscalation"], Value::Bool(false), "{name}");
        let dropped = c["capabilities"]["drop"].as_sequence().unwrap();
        assert!(dropped.iter().any(|d| d == "ALL"), "{name}");
        assert!(c["capabilities"]["add"].is_null(), "{name}");

        let resources = &container(&deployment)["resources"];
        for kind in ["requests", "limits"] {
            for what in ["cpu", "memory"] {
                assert!(!resources[kind][what].is_null(), "{name}: {kind}.{what}");
            }
        }
    }
}

#[test]
fn settings_come_from_the_configmap_and_the_url_from_the_secret() {
    let configmap = object("ConfigMap", "registry-janitor");
    for deployment in deployments() {
        let name = name_of(&deployment);
        let c = container(&deployment);
        let from = c["envFrom"].as_sequence().unwrap();
        assert!(
            from.iter()
                .any(|f| f["configMapRef"]["name"] == configmap["metadata"]["name"]),
            "{name}: envFrom the ConfigMap"
        );
        let env = c["env"].as_sequence().unwrap();
        let url = env
            .iter()
            .find(|e| e["name"] == "JANITOR_REDIS_URL")
            .unwrap_or_else(|| panic!("{name}: JANITOR_REDIS_URL"));
        assert!(url["value"].is_null(), "{name}: never a literal URL");
        let secret = &url["valueFrom"]["secretKeyRef"];
        assert_eq!(secret["name"], SECRET, "{name}");
        assert_eq!(secret["key"], "redis-url", "{name}");
        assert!(
            !env.iter().any(|e| e["name"] == "JANITOR_CONSUMER_NAME"),
            "{name}: each pod picks its own consumer name"
        );
    }
}

#[test]
fn the_configmap_holds_only_non_secret_janitor_settings() {
    let data = string_map(&object("ConfigMap", "registry-janitor")["data"]);
    assert!(!data.is_empty());
    for key in data.keys() {
        assert!(key.starts_with("JANITOR_"), "{key}");
        assert_eq!(key, &key.to_uppercase(), "{key}");
    }
    assert!(
        !data.contains_key("JANITOR_REDIS_URL"),
        "the URL holds the password"
    );
    assert!(
        !data.contains_key("JANITOR_CONSUMER_NAME"),
        "one name for all pods would merge their consumers"
    );
    assert_eq!(data["JANITOR_LOG_FORMAT"], "json");
    if let Some(addr) = data.get("JANITOR_METRICS_ADDR") {
        assert!(
            addr.ends_with(":9464"),
            "the probes and the Service use 9464"
        );
    }
}

#[test]
fn a_disruption_budget_takes_workers_down_one_at_a_time() {
    let pdb = object("PodDisruptionBudget", WORKER);
    // Not minAvailable: with KEDA at one replica it would block every node drain.
    assert_eq!(pdb["spec"]["maxUnavailable"].as_u64(), Some(1));
    assert!(pdb["spec"]["minAvailable"].is_null());
    let worker = object("Deployment", WORKER);
    assert!(selects(
        &pdb["spec"]["selector"]["matchLabels"],
        &worker["spec"]["template"]["metadata"]["labels"]
    ));
    let reconciler = object("Deployment", RECONCILER);
    assert!(!selects(
        &pdb["spec"]["selector"]["matchLabels"],
        &reconciler["spec"]["template"]["metadata"]["labels"]
    ));
}

/// The upgrade and rollback procedure of docs/operations.md is the worker Deployment's
/// rolling update: one new pod at a time beside the old ones, and an old pod stops only
/// once a new one is ready (a worker older than the data format in use is never ready,
/// so a rollback waits for `format set` with every newer worker still cleaning). The
/// values the procedure names are the manifest's, and readiness is probed on `/readyz`,
/// which says whether the build works under the format in use.
#[test]
fn the_documented_upgrade_and_rollback_is_the_workers_rolling_update() {
    let worker = object("Deployment", WORKER);
    let strategy = &worker["spec"]["strategy"];
    assert_eq!(strategy["type"], "RollingUpdate");
    let surge = strategy["rollingUpdate"]["maxSurge"].as_u64().unwrap();
    let unavailable = strategy["rollingUpdate"]["maxUnavailable"]
        .as_u64()
        .unwrap();
    assert!(surge >= 1, "a new pod starts beside the old ones");
    assert_eq!(
        unavailable, 0,
        "no ready worker goes before its replacement is ready"
    );
    assert_eq!(
        container(&worker)["readinessProbe"]["httpGet"]["path"],
        "/readyz"
    );
    let docs = fs::read_to_string(repo_file("docs/operations.md")).unwrap();
    let section = docs
        .split("## Upgrading and rolling back")
        .nth(1)
        .expect("docs/operations.md has a section on upgrading and rolling back");
    for named in [
        "`type: RollingUpdate`".to_owned(),
        format!("`maxSurge: {surge}`"),
        format!("`maxUnavailable: {unavailable}`"),
        format!("deployment/{WORKER}"),
        "registry-janitor format set".to_owned(),
        "registry-janitor format status".to_owned(),
    ] {
        assert!(
            section.contains(&named),
            "docs/operations.md's upgrade procedure does not name {named}"
        );
    }
}

/// The (protocol, port) pairs of a list of NetworkPolicy rules.
fn rule_ports(rules: &Value) -> Vec<(String, u64)> {
    rules
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|rule| rule["ports"].as_sequence().unwrap().clone())
        .map(|p| {
            let protocol = p["protocol"].as_str().unwrap_or("TCP").to_string();
            (protocol, p["port"].as_u64().unwrap())
        })
        .collect()
}

#[test]
fn the_network_policy_allows_redis_dns_and_metrics_only() {
    let policy = object("NetworkPolicy", "registry-janitor");
    for deployment in deployments() {
        assert!(selects(
            &policy["spec"]["podSelector"]["matchLabels"],
            &deployment["spec"]["template"]["metadata"]["labels"]
        ));
    }
    let types = policy["spec"]["policyTypes"].as_sequence().unwrap();
    assert!(types.iter().any(|t| t == "Ingress") && types.iter().any(|t| t == "Egress"));

    let ingress = rule_ports(&policy["spec"]["ingress"]);
    assert_eq!(ingress, vec![("TCP".to_string(), 9464)]);

    let mut egress = rule_ports(&policy["spec"]["egress"]);
    egress.sort();
    let expected: Vec<(String, u64)> = [("TCP", 53), ("TCP", 6379), ("UDP", 53)]
        .iter()
        .map(|(p, n)| (p.to_string(), *n))
        .collect();
    assert_eq!(egress, expected);
}

/// The Dockerfile's instructions as (INSTRUCTION, arguments), continuation lines joined
/// and comments dropped.
fn dockerfile() -> Vec<(String, String)> {
    let text = fs::read_to_string(repo_file("Dockerfile")).unwrap();
    let mut instructions = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if current.is_empty() && (trimmed.is_empty() || trimmed.starts_with('#')) {
            continue;
        }
        if let Some(part) = trimmed.strip_suffix('\\') {
            current.push_str(part);
            current.push(' ');
            continue;
        }
        current.push_str(trimmed);
        let (instruction, args) = current.split_once(char::is_whitespace).unwrap();
        instructions.push((instruction.to_uppercase(), args.trim().to_string()));
        current.clear();
    }
    instructions
}

#[test]
fn the_image_runs_the_janitor_as_a_non_root_user() {
    let all = dockerfile();
    let last_from = all.iter().rposition(|(i, _)| i == "FROM").unwrap();
    assert!(last_from > 0, "a multi-stage build");
    let builder = &all[..last_from];
    assert!(builder
        .iter()
        .any(|(i, a)| i == "RUN" && a.contains("cargo build --release --locked")));
    // The service crate only: the test harness and the lab do not ship in the image.
    assert!(builder.iter().any(|(i, a)| i == "RUN"
        && a.contains("cargo build")
        && a.contains("-p registry-janitor ")));

    let last_stage = &all[last_from..];
    let user = last_stage
        .iter()
        .rev()
        .find(|(i, _)| i == "USER")
        .map(|(_, a)| a.clone())
        .expect("the final stage sets USER");
    let user = user.split(':').next().unwrap();
    assert!(user != "root" && user != "0", "USER {user}");

    let entrypoint = last_stage
        .iter()
        .rev()
        .find(|(i, _)| i == "ENTRYPOINT")
        .map(|(_, a)| a.clone())
        .expect("the final stage sets ENTRYPOINT");
    let entrypoint: Vec<String> = serde_json::from_str(&entrypoint).expect("exec form");
    assert!(
        entrypoint[0].ends_with("/registry-janitor"),
        "{entrypoint:?}"
    );

    assert!(last_stage
        .iter()
        .any(|(i, a)| i == "EXPOSE" && a.split_whitespace().any(|p| p == "9464")));
}

/// Every object of the alert receiver's Component (`k8s/components/alert-receiver/`).
fn receiver_component() -> Vec<Value> {
    let k = load_k8s("components/alert-receiver/kustomization.yaml").remove(0);
    assert_eq!(k["kind"], "Component");
    let files: Vec<String> = k["resources"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|r| text(r).to_string())
        .collect();
    assert!(
        !files.iter().any(|f| f.contains("secret")),
        "the token Secret must stay an example: {files:?}"
    );
    // The base's image tag does not reach a component: the component repeats it.
    assert_eq!(k["images"], kustomization()["images"]);
    files
        .iter()
        .flat_map(|f| load_k8s(&format!("components/alert-receiver/{f}")))
        .collect()
}

#[test]
fn the_alert_receiver_component_serves_the_webhook_with_its_token_from_a_secret() {
    let objects = receiver_component();
    let find = |kind: &str| {
        objects
            .iter()
            .find(|o| o["kind"] == kind)
            .unwrap_or_else(|| panic!("no {kind} in the component"))
    };
    let deployment = find("Deployment");
    let c = container(deployment);
    assert_eq!(c["args"][0], "alert-receiver");
    assert!(selects(
        &deployment["spec"]["selector"]["matchLabels"],
        &deployment["spec"]["template"]["metadata"]["labels"]
    ));
    // Settings and the Redis URL as the other Deployments take them.
    assert_eq!(c["envFrom"][0]["configMapRef"]["name"], "registry-janitor");
    let env: BTreeMap<String, &Value> = c["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|e| (text(&e["name"]).to_string(), e))
        .collect();
    assert_eq!(
        env["JANITOR_REDIS_URL"]["valueFrom"]["secretKeyRef"]["name"],
        SECRET
    );
    // The token file is the Secret's `token`, mounted read-only.
    let token_file = text(&env["JANITOR_ALERT_RECEIVER_TOKEN_FILE"]["value"]);
    let mount = c["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| token_file.starts_with(&format!("{}/", text(&m["mountPath"]))))
        .expect("a volume mounted where the token file is");
    assert_eq!(mount["readOnly"], Value::Bool(true));
    let volume = deployment["spec"]["template"]["spec"]["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    let example = load_k8s("components/alert-receiver/secret.example.yaml").remove(0);
    assert_eq!(volume["secret"]["secretName"], example["metadata"]["name"]);
    assert_eq!(volume["secret"]["items"][0]["key"], "token");
    assert!(token_file.ends_with(&format!("/{}", text(&volume["secret"]["items"][0]["path"]))));
    assert!(!example["stringData"]["token"].is_null());
    // The webhook port: declared, listened on, behind the Service, open in the policy.
    let addr = text(&env["JANITOR_ALERT_RECEIVER_ADDR"]["value"]);
    assert!(addr.ends_with(":9465"), "{addr}");
    assert!(declares_port(c, &Value::from("alerts")));
    let service = find("Service");
    assert!(selects(
        &service["spec"]["selector"],
        &deployment["spec"]["template"]["metadata"]["labels"]
    ));
    assert_eq!(service["spec"]["ports"][0]["targetPort"], "alerts");
    let policy = find("NetworkPolicy");
    assert!(selects(
        &policy["spec"]["podSelector"]["matchLabels"],
        &deployment["spec"]["template"]["metadata"]["labels"]
    ));
    assert_eq!(
        rule_ports(&policy["spec"]["ingress"]),
        vec![("TCP".to_string(), 9465)]
    );
    // Probes, grace period and security as for the base's Deployments.
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        assert_eq!(c[probe]["httpGet"]["path"], path);
        assert!(declares_port(c, &c[probe]["httpGet"]["port"]));
    }
    let pod = &deployment["spec"]["template"]["spec"];
    assert!(pod["terminationGracePeriodSeconds"].as_u64().unwrap() >= 25);
    assert_eq!(pod["securityContext"]["runAsNonRoot"], Value::Bool(true));
    assert_eq!(
        c["securityContext"]["readOnlyRootFilesystem"],
        Value::Bool(true)
    );
    assert_eq!(
        c["securityContext"]["allowPrivilegeEscalation"],
        Value::Bool(false)
    );
    // The metrics Service of the base selects the receiver's pods too.
    assert!(selects(
        &object("Service", "registry-janitor")["spec"]["selector"],
        &deployment["spec"]["template"]["metadata"]["labels"]
    ));
}
