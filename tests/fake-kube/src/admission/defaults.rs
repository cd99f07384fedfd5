//! The defaults kube-apiserver fills into a Pod when it decodes one, on the
//! JSON form (so nothing the fake does not know is lost), for Kubernetes
//! 1.33.
//!
//! Applied to every request body and again after every mutating webhook's
//! patch (`k8s.io/apiserver/pkg/admission/plugin/webhook/mutating/
//! dispatcher.go` `callAttrMutatingHook`: `o.GetObjectDefaulter().Default(
//! attr.VersionedObject)` after the patch is decoded), which is why a
//! webhook's own objects come back with defaults it did not write.
//!
//! Sources, `pkg/apis/core/v1/defaults.go` unless said otherwise:
//! - `SetDefaults_PodSpec`: `dnsPolicy: ClusterFirst`, `restartPolicy:
//!   Always`, `securityContext: {}`, `terminationGracePeriodSeconds: 30`,
//!   `schedulerName: default-scheduler`;
//! - `SetDefaults_Pod`: `enableServiceLinks: true`; in init and app
//!   containers (not ephemeral ones) each resource limit without a request
//!   becomes the request; with `hostNetwork`, `hostPort` = `containerPort`;
//! - `SetDefaults_Container` (and `SetDefaults_EphemeralContainer`):
//!   `imagePullPolicy` `Always` for the tag `latest` or no tag and no
//!   digest, else `IfNotPresent` (`parsers.ParseImageName`);
//!   `terminationMessagePath: /dev/termination-log`,
//!   `terminationMessagePolicy: File`; ports' `protocol: TCP`
//!   (`k8s.io/api/core/v1/types.go` `+default="TCP"`);
//! - `SetDefaults_Probe`: `timeoutSeconds: 1`, `periodSeconds: 10`,
//!   `successThreshold: 1`, `failureThreshold: 3`;
//!   `SetDefaults_HTTPGetAction` (probes and lifecycle hooks): `path: /`,
//!   `scheme: HTTP`;
//! - `SetDefaults_ObjectFieldSelector`: `apiVersion: v1` (env `fieldRef`,
//!   downward API items, also inside projected volumes);
//! - `SetDefaults_Volume`: a volume with no source is an `emptyDir`;
//!   secret, configMap, downwardAPI and projected volumes `defaultMode:
//!   420`; `SetDefaults_ServiceAccountTokenProjection`:
//!   `expirationSeconds: 3600`; `SetDefaults_HostPathVolumeSource`:
//!   `type: ""`;
//! - `pkg/apis/core/v1/conversion.go`: `serviceAccountName` from the
//!   deprecated `serviceAccount` when empty on decode, and
//!   `serviceAccount` = `serviceAccountName` on every encode
//!   ([`encode`]).
//!
//! Not modelled: 1.33 has no `resizePolicy` defaulting (removed by
//! kubernetes/kubernetes#128920), and pod-level resources are behind an
//! alpha gate.

use serde_json::{json, Map, Value};

/// Fills the defaults into `pod` (a Pod's JSON).
pub(crate) fn pod(pod: &mut Value) {
    let Some(spec) = pod.get_mut("spec").and_then(Value::as_object_mut) else {
        return;
    };
    let name = spec
        .get("serviceAccountName")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if name.is_empty() {
        if let Some(deprecated) = spec.get("serviceAccount").and_then(Value::as_str) {
            if !deprecated.is_empty() {
                let deprecated = deprecated.to_string();
                spec.insert("serviceAccountName".into(), json!(deprecated));
            }
        }
    }
    or_insert(spec, "dnsPolicy", json!("ClusterFirst"));
    or_insert(spec, "restartPolicy", json!("Always"));
    if spec.get("securityContext").is_none_or(Value::is_null) {
        spec.insert("securityContext".into(), json!({}));
    }
    or_insert(spec, "terminationGracePeriodSeconds", json!(30));
    or_insert(spec, "schedulerName", json!("default-scheduler"));
    if spec.get("enableServiceLinks").is_none_or(Value::is_null) {
        spec.insert("enableServiceLinks".into(), json!(true));
    }
    let host_network = spec.get("hostNetwork").and_then(Value::as_bool) == Some(true);
    for list in ["initContainers", "containers", "ephemeralContainers"] {
        let ephemeral = list == "ephemeralContainers";
        for c in items(spec, list) {
            container(c, ephemeral, host_network);
        }
    }
    for volume in items(spec, "volumes") {
        self::volume(volume);
    }
}

/// Sets `spec.serviceAccount` to `spec.serviceAccountName`, as every
/// encoding of a v1 Pod does (`Convert_core_PodSpec_To_v1_PodSpec`).
pub(crate) fn encode(pod: &mut Value) {
    let Some(spec) = pod.get_mut("spec").and_then(Value::as_object_mut) else {
        return;
    };
    match spec.get("serviceAccountName").and_then(Value::as_str) {
        Some(name) if !name.is_empty() => {
            let name = name.to_string();
            spec.insert("serviceAccount".into(), json!(name));
        }
        _ => {
            spec.remove("serviceAccount");
        }
    }
}

/// `pod` as the API server encodes it: Go's `omitempty` leaves out empty
/// lists, empty maps (`labels`, `annotations`, `nodeSelector`) and absent
/// pointers (`null`), while a struct field is always written, so every
/// container carries `resources: {}`.
pub(crate) fn canonical(mut pod: Value) -> Value {
    prune(&mut pod);
    if let Some(spec) = pod.get_mut("spec").and_then(Value::as_object_mut) {
        for list in ["initContainers", "containers", "ephemeralContainers"] {
            for c in items(spec, list) {
                if let Some(c) = c.as_object_mut() {
                    c.entry("resources").or_insert_with(|| json!({}));
                }
            }
        }
    }
    pod
}

/// Whether two pods are equal as `apiequality.Semantic.DeepEqual` compares
/// them: an empty list or map equals an absent one.
pub(crate) fn semantic_eq(a: &Value, b: &Value) -> bool {
    canonical(a.clone()) == canonical(b.clone())
}

const MAPS: [&str; 3] = ["labels", "annotations", "nodeSelector"];

fn prune(value: &mut Value) {
    match value {
        Value::Object(map) => {
            for v in map.values_mut() {
                prune(v);
            }
            map.retain(|key, v| match v {
                Value::Null => false,
                Value::Array(items) => !items.is_empty(),
                Value::Object(inner) => !(inner.is_empty() && MAPS.contains(&key.as_str())),
                _ => true,
            });
        }
        Value::Array(items) => items.iter_mut().for_each(prune),
        _ => {}
    }
}

fn or_insert(map: &mut Map<String, Value>, key: &str, value: Value) {
    let empty = match map.get(key) {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) => s.is_empty(),
        _ => false,
    };
    if empty {
        map.insert(key.to_string(), value);
    }
}

fn items<'a>(map: &'a mut Map<String, Value>, key: &str) -> impl Iterator<Item = &'a mut Value> {
    map.get_mut(key)
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
}

fn container(c: &mut Value, ephemeral: bool, host_network: bool) {
    let Some(c) = c.as_object_mut() else {
        return;
    };
    let image = c.get("image").and_then(Value::as_str).unwrap_or_default();
    let policy = pull_policy(image);
    or_insert(c, "imagePullPolicy", json!(policy));
    or_insert(c, "terminationMessagePath", json!("/dev/termination-log"));
    or_insert(c, "terminationMessagePolicy", json!("File"));
    for port in items(c, "ports") {
        if let Some(port) = port.as_object_mut() {
            or_insert(port, "protocol", json!("TCP"));
            if host_network && !ephemeral {
                let container_port = port.get("containerPort").cloned();
                let host_port = port.get("hostPort").and_then(Value::as_i64).unwrap_or(0);
                if let (0, Some(container_port)) = (host_port, container_port) {
                    port.insert("hostPort".into(), container_port);
                }
            }
        }
    }
    for probe in ["livenessProbe", "readinessProbe", "startupProbe"] {
        if let Some(probe) = c.get_mut(probe).and_then(Value::as_object_mut) {
            or_insert(probe, "timeoutSeconds", json!(1));
            or_insert(probe, "periodSeconds", json!(10));
            or_insert(probe, "successThreshold", json!(1));
            or_insert(probe, "failureThreshold", json!(3));
            http_get(probe);
        }
    }
    if let Some(lifecycle) = c.get_mut("lifecycle").and_then(Value::as_object_mut) {
        for hook in ["postStart", "preStop"] {
            if let Some(hook) = lifecycle.get_mut(hook).and_then(Value::as_object_mut) {
                http_get(hook);
            }
        }
    }
    for var in items(c, "env") {
        if let Some(field) = var.pointer_mut("/valueFrom/fieldRef") {
            field_selector(field);
        }
    }
    if ephemeral {
        return;
    }
    if let Some(resources) = c.get_mut("resources").and_then(Value::as_object_mut) {
        let limits = resources.get("limits").and_then(Value::as_object).cloned();
        if let Some(limits) = limits.filter(|l| !l.is_empty()) {
            let requests = resources
                .entry("requests")
                .or_insert_with(|| json!({}))
                .as_object_mut();
            if let Some(requests) = requests {
                for (name, quantity) in limits {
                    requests.entry(name).or_insert(quantity);
                }
            }
        }
    }
}

fn http_get(handler: &mut Map<String, Value>) {
    if let Some(get) = handler.get_mut("httpGet").and_then(Value::as_object_mut) {
        or_insert(get, "path", json!("/"));
        or_insert(get, "scheme", json!("HTTP"));
    }
}

fn field_selector(field: &mut Value) {
    if let Some(field) = field.as_object_mut() {
        or_insert(field, "apiVersion", json!("v1"));
    }
}

/// Kubernetes' default `imagePullPolicy` (`SetDefaults_Container`): the
/// tag, as `ParseImageName` reads it, is `latest` when the reference names
/// neither a tag nor a digest.
pub(crate) fn pull_policy(image: &str) -> &'static str {
    let (name, digest) = match image.split_once('@') {
        Some((name, digest)) => (name, Some(digest)),
        None => (image, None),
    };
    let last = name.rsplit('/').next().unwrap_or(name);
    let tag = last.rsplit_once(':').map(|(_, tag)| tag);
    match (tag, digest) {
        (Some("latest"), _) | (None, None) => "Always",
        _ => "IfNotPresent",
    }
}

const SOURCES: [&str; 28] = [
    "hostPath",
    "emptyDir",
    "gcePersistentDisk",
    "awsElasticBlockStore",
    "gitRepo",
    "secret",
    "nfs",
    "iscsi",
    "glusterfs",
    "persistentVolumeClaim",
    "rbd",
    "flexVolume",
    "cinder",
    "cephfs",
    "flocker",
    "downwardAPI",
    "fc",
    "azureFile",
    "configMap",
    "vsphereVolume",
    "quobyte",
    "azureDisk",
    "photonPersistentDisk",
    "projected",
    "portworxVolume",
    "scaleIO",
    "storageos",
    "csi",
];

fn volume(v: &mut Value) {
    let Some(v) = v.as_object_mut() else {
        return;
    };
    let has_source = SOURCES
        .iter()
        .chain(&["ephemeral", "image"])
        .any(|s| v.get(*s).is_some_and(|s| !s.is_null()));
    if !has_source {
        v.insert("emptyDir".into(), json!({}));
    }
    for kind in ["secret", "configMap", "downwardAPI", "projected"] {
        if let Some(source) = v.get_mut(kind).and_then(Value::as_object_mut) {
            or_insert(source, "defaultMode", json!(420));
        }
    }
    if let Some(host_path) = v.get_mut("hostPath").and_then(Value::as_object_mut) {
        host_path.entry("type").or_insert(json!(""));
    }
    if let Some(items) = v
        .get_mut("downwardAPI")
        .and_then(|d| d.get_mut("items"))
        .and_then(Value::as_array_mut)
    {
        for item in items {
            if let Some(field) = item.get_mut("fieldRef") {
                field_selector(field);
            }
        }
    }
    let sources = v
        .get_mut("projected")
        .and_then(|p| p.get_mut("sources"))
        .and_then(Value::as_array_mut);
    for source in sources.into_iter().flatten() {
        if let Some(token) = source
            .get_mut("serviceAccountToken")
            .and_then(Value::as_object_mut)
        {
            or_insert(token, "expirationSeconds", json!(3600));
        }
        let downward = source
            .get_mut("downwardAPI")
            .and_then(|d| d.get_mut("items"))
            .and_then(Value::as_array_mut);
        for item in downward.into_iter().flatten() {
            if let Some(field) = item.get_mut("fieldRef") {
                field_selector(field);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pull_policies_follow_parse_image_name() {
        for (image, policy) in [
            ("busybox", "Always"),
            ("reg:5000/busybox", "Always"),
            ("busybox:latest", "Always"),
            ("busybox:latest@sha256:0a", "Always"),
            ("busybox:1.36", "IfNotPresent"),
            ("busybox@sha256:0a", "IfNotPresent"),
            ("reg:5000/team/busybox:1", "IfNotPresent"),
        ] {
            assert_eq!(pull_policy(image), policy, "{image}");
        }
    }

    #[test]
    fn a_minimal_pod_gets_what_the_api_server_stores() {
        let mut p = json!({"spec": {
            "serviceAccount": "old-style",
            "containers": [{"name": "a", "image": "busybox",
                            "ports": [{"containerPort": 80}],
                            "env": [{"name": "N", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
                            "readinessProbe": {"httpGet": {"port": 80}},
                            "resources": {"limits": {"memory": "1Gi"}}}],
            "ephemeralContainers": [{"name": "d", "image": "busybox:1.36", "resources": {"limits": {"cpu": "1"}}}],
            "volumes": [{"name": "v"}, {"name": "t", "projected": {"sources": [
                {"serviceAccountToken": {"path": "token", "audience": "x"}}]}}]}});
        pod(&mut p);
        let spec = &p["spec"];
        assert_eq!(spec["serviceAccountName"], "old-style");
        assert_eq!(spec["dnsPolicy"], "ClusterFirst");
        assert_eq!(spec["restartPolicy"], "Always");
        assert_eq!(spec["securityContext"], json!({}));
        assert_eq!(spec["terminationGracePeriodSeconds"], 30);
        assert_eq!(spec["schedulerName"], "default-scheduler");
        assert_eq!(spec["enableServiceLinks"], true);
        let c = &spec["containers"][0];
        assert_eq!(c["imagePullPolicy"], "Always");
        assert_eq!(c["terminationMessagePath"], "/dev/termination-log");
        assert_eq!(c["ports"][0]["protocol"], "TCP");
        assert_eq!(c["env"][0]["valueFrom"]["fieldRef"]["apiVersion"], "v1");
        assert_eq!(
            c["readinessProbe"],
            json!({"httpGet": {"port": 80, "path": "/", "scheme": "HTTP"}, "timeoutSeconds": 1,
                   "periodSeconds": 10, "successThreshold": 1, "failureThreshold": 3})
        );
        assert_eq!(c["resources"]["requests"]["memory"], "1Gi");
        // Ephemeral containers get no requests from their limits.
        assert!(spec["ephemeralContainers"][0]["resources"]
            .get("requests")
            .is_none());
        assert_eq!(spec["volumes"][0]["emptyDir"], json!({}));
        assert_eq!(spec["volumes"][1]["projected"]["defaultMode"], 420);
        assert_eq!(
            spec["volumes"][1]["projected"]["sources"][0]["serviceAccountToken"]
                ["expirationSeconds"],
            3600
        );
        // Idempotent, as applying it after every webhook requires.
        let once = p.clone();
        pod(&mut p);
        assert_eq!(p, once);
        encode(&mut p);
        assert_eq!(p["spec"]["serviceAccount"], "old-style");
    }
}
