"""charts/lanyard, rendered by Helm's own engine for several values sets:
lint, Kubernetes schema validation, what matters for security asserted, the
values schema's refusals, and the rendered agent and webhook containers run
against the fake API server until they are ready (and the webhook, through
the chart's own TLS, injects the Ray example's pods).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from chart import (CHART, NAMESPACE, ROOT, Container, FakeKube, apply_json_patch, find, free_ports, pod_spec,
                   post_review, render, wait_for)
from conftest import lanyard_binary

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (tests/python/requirements.txt)")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

# The oldest Kubernetes the chart supports (native sidecars) and a current one.
KUBE_VERSIONS = ["1.29.0", "1.35.0"]
# Kinds from CRDs, which kubernetes-validate has no schema for.
CRD_KINDS = {"Certificate", "Issuer", "ServiceMonitor", "PrometheusRule"}

AZURE = {"tenantId": "72f988bf-86f1-41af-91ab-2d7cd011db47"}
GCP = {"workloadIdentityProvider": "//iam.googleapis.com/projects/123456789012/locations/global/workloadIdentityPools/ray/providers/aks",
       "projectId": "ml-data", "projectNumber": "123456789012"}
AWS = {"region": "eu-west-1", "stsEndpoint": "https://sts.eu-west-1.amazonaws.com"}
# One of the example sets shipped in policies/.
CEDAR = (ROOT / "policies" / "team-storage" / "team-storage.cedar").read_text()

VALUE_SETS = {
    "defaults": {},
    "azure": {"cluster": {"name": "aks-weu-1"}, "azure": AZURE},
    "google": {"cluster": {"name": "gke-euw4"}, "gcp": GCP},
    "aws": {"cluster": {"name": "eks-euw1"}, "aws": AWS},
    "all-clouds": {"cluster": {"name": "multi"}, "azure": AZURE, "gcp": GCP, "aws": AWS},
    "cert-manager": {"webhook": {"certManager": {"enabled": True}}},
    "cert-manager-issuer": {"webhook": {"certManager": {"enabled": True, "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}}}},
    "audit-export": {"cluster": {"name": "aks-weu-1"}, "audit": {
        "stdout": True, "syslog": {"url": "tls://syslog.logging.svc:6514", "caPem": "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"},
        "http": {"url": "https://audit.example.net/v1/records", "tokenSecret": "audit-collector"}, "exportWhenFull": "drop"}},
    "policies": {"policy": {"enabled": True, "policies": {"team-storage.cedar": CEDAR}}},
    "host-port": {"agent": {"reachVia": "hostPort"}},
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}, "networkPolicy": {"webhookFrom": ["10.0.0.0/16"]},
                "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}}, "grafanaDashboard": {"enabled": True}},
    "token-review-issuer": {"cluster": {"issuer": "https://oidc.prod-aks.azure.com/tenant/uuid/", "tokenReview": True}},
    "guard": {"cluster": {"name": "multi"}, "azure": AZURE, "gcp": GCP, "aws": AWS,
              "guard": {"enabled": True, "admissionPolicy": True, "extraAudiences": ["lanyard-data-lake"]}},
    "guard-identity-binding": {"cluster": {"name": "aks-weu-1"}, "azure": {**AZURE, "identityBinding": {"sniName": "a7q3k1m0x9.ests.aks"}},
                         "guard": {"enabled": True, "admissionPolicy": True}},
    "guard-cert-manager-host-port": {"agent": {"reachVia": "hostPort"}, "webhook": {"certManager": {"enabled": True}},
                                     "guard": {"enabled": True, "admissionPolicy": True, "namespaceLabel": "platform.example/governed",
                                               "namespaceLabelValue": "yes"}},
}
# Kinds that exist from a later Kubernetes version than the oldest supported.
SINCE = {"ValidatingAdmissionPolicy": "1.30.0", "ValidatingAdmissionPolicyBinding": "1.30.0"}


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request):
    return request.param, render(VALUE_SETS[request.param])


def test_lint_is_clean_for_every_values_set():
    for name, values in VALUE_SETS.items():
        report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE, kube_version="v1.35.0")
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        assert not problems, (name, problems)


def test_every_object_validates_against_the_kubernetes_schemas(rendered):
    name, objects = rendered
    checked = 0
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            continue
        for version in KUBE_VERSIONS:
            if obj["kind"] in SINCE and [int(x) for x in version.split(".")] < [int(x) for x in SINCE[obj["kind"]].split(".")]:
                continue
            kubernetes_validate.validate(obj, version, strict=True)
        checked += 1
    assert checked >= 12, (name, checked)


RECOMMENDED_LABELS = {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                      "app.kubernetes.io/managed-by", "app.kubernetes.io/part-of", "helm.sh/chart"}


def test_every_object_and_pod_carries_the_recommended_labels(rendered):
    """Kubernetes' recommended labels
    (https://kubernetes.io/docs/concepts/overview/working-with-objects/common-labels/)
    on every object the chart renders and on every pod it templates."""
    name, objects = rendered
    for obj in objects:
        labels = obj["metadata"].get("labels", {})
        assert RECOMMENDED_LABELS <= set(labels), (name, obj["kind"], obj["metadata"]["name"], RECOMMENDED_LABELS - set(labels))
        assert labels["app.kubernetes.io/part-of"] == "lanyard"
        template = obj.get("spec", {}).get("template")
        if template:
            missing = RECOMMENDED_LABELS - set(template["metadata"]["labels"])
            assert not missing, (name, obj["kind"], "pod template", missing)


def rules(objects, name):
    return find(objects, "ClusterRole", name)["rules"]


def test_rbac_is_exactly_what_the_docs_list():
    objects = render({})
    assert rules(objects, "lanyard-agent") == [
        {"apiGroups": [""], "resources": ["serviceaccounts", "pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
        {"nonResourceURLs": ["/.well-known/openid-configuration", "/openid/v1/jwks"], "verbs": ["get"]},
    ]
    assert rules(objects, "lanyard-webhook") == [
        {"apiGroups": [""], "resources": ["serviceaccounts"], "verbs": ["get", "list", "watch"]},
    ]
    # Policies add namespace labels; TokenReview adds its create; an issuer
    # URL removes the API's discovery paths.
    policy = rules(render(VALUE_SETS["policies"]), "lanyard-agent")
    assert {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]} in policy
    review = rules(render(VALUE_SETS["token-review-issuer"]), "lanyard-agent")
    assert {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]} in review
    assert not any("nonResourceURLs" in r for r in review)
    # No values set grants Secrets, wildcards or write verbs beyond events.
    for name, values in VALUE_SETS.items():
        for role in [o for o in render(values) if o["kind"] in ("ClusterRole", "Role")]:
            for rule in role["rules"]:
                assert "secrets" not in rule.get("resources", []), (name, rule)
                assert "*" not in rule.get("resources", []) + rule.get("verbs", []) + rule.get("apiGroups", []), (name, rule)
                writes = set(rule["verbs"]) - {"get", "list", "watch"}
                assert writes <= {"create", "patch"} and (not writes or rule.get("resources") in (["events"], ["tokenreviews"])), (name, rule)


def test_pods_are_restricted_and_never_on_the_host_network(rendered):
    name, objects = rendered
    for kind in ("DaemonSet", "Deployment"):
        spec = pod_spec(objects, kind)
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), (name, kind)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert sc.get("privileged") is not True and sc["capabilities"]["drop"] == ["ALL"]
            assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"]
        volume_kinds = {k for v in spec.get("volumes", []) for k in v if k != "name"}
        # Restricted Pod Security's volume types (hostPath only when asked).
        assert volume_kinds <= {"configMap", "secret", "emptyDir", "projected"}, (name, volume_kinds)
    agent = pod_spec(objects, "DaemonSet")
    assert agent["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in agent["tolerations"]
    env = {e["name"]: e for e in agent["containers"][0]["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    ds = find(objects, "DaemonSet")
    rolling = ds["spec"]["updateStrategy"]["rollingUpdate"]
    if agent["containers"][0]["ports"][0].get("hostPort"):
        # Two agents cannot hold the node's port: the old one stops first.
        assert rolling["maxSurge"] == 0 and rolling["maxUnavailable"], rolling
    else:
        # Behind the node-local Service the new agent is ready first.
        assert rolling["maxSurge"] and rolling["maxUnavailable"] == 0, rolling
    for kind, role in (("DaemonSet", "agent"), ("Deployment", "webhook")):
        # The grace period covers the shutdown delay and the drain.
        config = yaml.safe_load(find(objects, "ConfigMap", "lanyard-config")["data"][f"{role}.yaml"])
        assert pod_spec(objects, kind)["terminationGracePeriodSeconds"] == config["shutdown_delay_seconds"] + 25


def test_gkes_pool_reaches_the_agent_the_webhook_and_the_guard():
    cluster = "projects/ml-data-1/locations/europe-west4/clusters/ray"
    objects = render({"gcp": {"gkeCluster": cluster, "projectNumber": "123456789012",
                              "universeDomain": "apis-tpczero.goog"},
                      "guard": {"enabled": True, "admissionPolicy": True}})
    for role in ("agent", "webhook"):
        config = yaml.safe_load(find(objects, "ConfigMap", "lanyard-config")["data"][f"{role}.yaml"])
        assert config["gcp"]["gke_cluster"] == cluster, role
        assert config["gcp"]["universe_domain"] == "apis-tpczero.goog", role
        assert "workload_identity_provider" not in config["gcp"]
    policy = find(objects, "ValidatingAdmissionPolicy")
    (audiences,) = [v["expression"] for v in policy["spec"]["variables"] if v["name"] == "audiences"]
    assert '"ml-data-1.svc.id.goog"' in audiences, audiences


def test_identity_bindings_reach_the_agent_the_webhook_and_the_guard():
    """With azure.identityBinding.sniName, both roles ask for the proxy's
    audience and name the proxy, and the guard refuses that audience
    outside the sidecar."""
    objects = render(VALUE_SETS["guard-identity-binding"])
    for role in ("agent", "webhook"):
        config = yaml.safe_load(find(objects, "ConfigMap", "lanyard-config")["data"][f"{role}.yaml"])
        assert config["azure"]["audience"] == "api://AKSIdentityBinding", role
        assert config["azure"]["identity_binding_sni"] == "a7q3k1m0x9.ests.aks", role
    policy = find(objects, "ValidatingAdmissionPolicy")
    (audiences,) = [v["expression"] for v in policy["spec"]["variables"] if v["name"] == "audiences"]
    assert '"api://aksidentitybinding"' in audiences, audiences
    # Without it, the pods' token is Entra's and the guard still refuses
    # the proxy's audience outside the sidecar.
    config = yaml.safe_load(find(render(VALUE_SETS["azure"]), "ConfigMap", "lanyard-config")["data"]["agent.yaml"])
    assert config["azure"]["audience"] == "api://AzureADTokenExchange"
    assert "identity_binding_sni" not in config["azure"]


def test_the_agent_is_reached_on_its_own_node():
    objects = render({})
    service = find(objects, "Service", "lanyard-agent")
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    config = yaml.safe_load(find(objects, "ConfigMap", "lanyard-config")["data"]["webhook.yaml"])
    assert config["webhook"]["agent_url"] == f"http://lanyard-agent.{NAMESPACE}.svc:8700"
    # The documented alternative: the node's IP and a hostPort.
    objects = render(VALUE_SETS["host-port"])
    assert not [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "lanyard-agent"]
    (port,) = [p for p in pod_spec(objects, "DaemonSet")["containers"][0]["ports"] if p["name"] == "agent"]
    assert port["hostPort"] == 8700
    config = yaml.safe_load(find(objects, "ConfigMap", "lanyard-config")["data"]["webhook.yaml"])
    assert config["webhook"]["agent_url"] == "http://$(LANYARD_HOST_IP):8700"


def test_the_webhook_configuration_is_as_documented(rendered):
    name, objects = rendered
    (hook,) = find(objects, "MutatingWebhookConfiguration")["webhooks"]
    assert hook["objectSelector"] == {"matchLabels": {"lanyard.dev/inject": "true"}}
    (expr,) = hook["namespaceSelector"]["matchExpressions"]
    assert expr["key"] == "kubernetes.io/metadata.name" and expr["operator"] == "NotIn"
    assert set(expr["values"]) == {"kube-system", NAMESPACE}
    assert hook["failurePolicy"] == "Fail" and hook["reinvocationPolicy"] == "IfNeeded"
    assert hook["sideEffects"] == "None" and hook["matchPolicy"] == "Equivalent"
    assert 1 <= hook["timeoutSeconds"] <= 5
    assert hook["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                              "resources": ["pods"], "scope": "Namespaced"}]
    webhook = find(objects, "Deployment")
    assert webhook["spec"]["replicas"] == 2
    assert find(objects, "PodDisruptionBudget")["spec"]["minAvailable"] == 1
    assert pod_spec(objects, "Deployment")["affinity"]["podAntiAffinity"]
    if "cert-manager" in name:
        meta = find(objects, "MutatingWebhookConfiguration")["metadata"]
        assert meta["annotations"]["cert-manager.io/inject-ca-from"] == f"{NAMESPACE}/lanyard-webhook"
        assert "caBundle" not in hook["clientConfig"]
        assert find(objects, "Certificate")["spec"]["secretName"] == "lanyard-webhook-tls"
        assert not [o for o in objects if o["kind"] == "Secret"]
    else:
        secret = find(objects, "Secret", "lanyard-webhook-tls")
        assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]


def test_the_guard_is_off_by_default_and_fails_closed_in_governed_namespaces(rendered):
    name, objects = rendered
    kinds = {o["kind"] for o in objects}
    if not name.startswith("guard"):
        assert not kinds & {"ValidatingWebhookConfiguration", "ValidatingAdmissionPolicy",
                            "ValidatingAdmissionPolicyBinding"}, name
        return
    (hook,) = find(objects, "ValidatingWebhookConfiguration")["webhooks"]
    assert hook["clientConfig"]["service"]["path"] == "/validate"
    assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
    assert hook["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                              "resources": ["pods", "pods/ephemeralcontainers"], "scope": "Namespaced"}]
    assert "objectSelector" not in hook, "every pod of a governed namespace, opted in or not"
    label = VALUE_SETS[name]["guard"].get("namespaceLabel", "lanyard.dev/guard")
    value = VALUE_SETS[name]["guard"].get("namespaceLabelValue", "enforce")
    assert hook["namespaceSelector"]["matchLabels"] == {label: value}
    (expr,) = hook["namespaceSelector"]["matchExpressions"]
    assert expr["operator"] == "NotIn" and set(expr["values"]) == {"kube-system", NAMESPACE}
    binding = find(objects, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["matchResources"]["namespaceSelector"] == hook["namespaceSelector"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    policy = find(objects, "ValidatingAdmissionPolicy")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert policy["spec"]["matchConstraints"]["resourceRules"][0]["resources"] == ["pods", "pods/ephemeralcontainers"]
    # The agent reached at the node's IP leaves no host name to redirect.
    rules = [v.get("messageExpression", v.get("message", "")) for v in policy["spec"]["validations"]]
    by_service = VALUE_SETS[name].get("agent", {}).get("reachVia") != "hostPort"
    assert any("agent-address" in r for r in rules) == by_service, rules
    if "cert-manager" in name:
        meta = find(objects, "ValidatingWebhookConfiguration")["metadata"]
        assert meta["annotations"]["cert-manager.io/inject-ca-from"] == f"{NAMESPACE}/lanyard-webhook"
        assert "caBundle" not in hook["clientConfig"]
    else:
        assert hook["clientConfig"]["caBundle"] == find(objects, "Secret", "lanyard-webhook-tls")["data"]["ca.crt"]
    # Least privilege unchanged: the guard needs no permission.
    assert [o for o in objects if o["kind"] in ("ClusterRole", "Role")] == \
        [o for o in render({k: v for k, v in VALUE_SETS[name].items() if k != "guard"}) if o["kind"] in ("ClusterRole", "Role")]


def test_the_generated_certificate_names_the_service_and_chains_to_the_ca(tmp_path):
    secret = find(render({}), "Secret", "lanyard-webhook-tls")
    for key in ("tls.crt", "ca.crt"):
        (tmp_path / key).write_bytes(base64.b64decode(secret["data"][key]))
    verify = subprocess.run(["openssl", "verify", "-CAfile", tmp_path / "ca.crt", tmp_path / "tls.crt"],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    text = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", tmp_path / "tls.crt"],
                          capture_output=True, text=True, check=True).stdout
    assert f"DNS:lanyard-webhook.{NAMESPACE}.svc" in text, text


def test_values_schema_refuses_wrong_types_and_unknown_keys():
    chart = helm.Chart.load(str(CHART))
    chart.validate_schema(VALUE_SETS["all-clouds"])
    for bad in [
        {"webhook": {"replicas": "two"}},
        {"webhook": {"timeoutSeconds": 31}},
        {"agent": {"reachVia": "hostNetwork"}},
        {"audit": {"onFailure": "ignore"}},
        {"azure": {"tenantid": "x"}},
        {"unknownTopLevel": True},
        {"sidecar": {"resources": {"memoryLimit": 64}}},
        {"policy": {"policies": {"no-extension": "permit (principal, action, resource);"}}},
        # A Google provider needs its project (the agent would stop).
        {"gcp": {"workloadIdentityProvider": GCP["workloadIdentityProvider"]}},
        # GKE's pool needs its project's number, and excludes a provider.
        {"gcp": {"gkeCluster": "projects/ml-data-1/locations/europe-west4/clusters/ray"}},
        {"gcp": {"gkeCluster": "projects/ml-data-1/locations/europe-west4/clusters/ray", "projectNumber": "1",
                 "workloadIdentityProvider": GCP["workloadIdentityProvider"], "projectId": "ml-data-1"}},
        {"gcp": {"gkeCluster": "ml-data-1/ray", "projectNumber": "1"}},
        {"aws": {"region": "Europe"}},
    ]:
        with pytest.raises(helm.HelmError) as e:
            chart.validate_schema(bad)
        assert str(e.value), bad
        with pytest.raises(helm.HelmError):
            render(bad)


def test_checkov_finds_nothing_unexplained(tmp_path):
    checkov = Path(os.environ.get("LANYARD_CHECKOV") or ROOT / ".venv-checkov" / "bin" / "checkov")
    if not checkov.exists():
        pytest.skip("checkov is installed by scripts/test (LANYARD_CHECKOV, .venv-checkov)")
    for name, values in VALUE_SETS.items():
        docs = [o for o in render(values)]
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump_all(docs))
    out = subprocess.run([str(checkov), "-d", str(tmp_path), "--framework", "kubernetes", "-o", "json", "--quiet", "--compact"],
                         capture_output=True, text=True)
    report = json.loads(out.stdout)
    reports = report if isinstance(report, list) else [report]
    failed = [(c["check_id"], c["resource"], c["file_path"]) for r in reports for c in r.get("results", {}).get("failed_checks", [])]
    assert not failed, failed
    skipped = [c for r in reports for c in r.get("results", {}).get("skipped_checks", [])]
    # Every skip carries its reason in the chart's annotation.
    for c in skipped:
        assert c.get("suppress_comment"), c["check_id"]
    passed = sum(r.get("summary", {}).get("passed", 0) for r in reports)
    assert passed > 100, passed


def ready(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as r:
        return r.status == 200


def readyz(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def review(pod: dict, namespace: str) -> dict:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"}, "namespace": namespace,
        "operation": "CREATE", "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
        "object": pod, "dryRun": False}}


def test_the_rendered_agent_and_webhook_start_and_the_ray_example_is_injected(tmp_path):
    agent_port, agent_admin, hook_port, hook_admin = free_ports(4)
    values = {"cluster": {"name": "test"}, "azure": AZURE, "gcp": GCP, "aws": AWS,
              "policy": {"enabled": True, "policies": {"team-storage.cedar": CEDAR}},
              "agent": {"port": agent_port, "adminPort": agent_admin, "bindAddress": "127.0.0.1"},
              "webhook": {"port": hook_port, "adminPort": hook_admin}}
    objects = render(values)
    kube = FakeKube(tmp_path / "kube")
    examples = list(yaml.safe_load_all((ROOT / "docs/examples/ray-serviceaccount.yaml").read_text()))
    for obj in examples:
        kube.apply(obj)
    downward = {"spec.nodeName": "node-a", "status.hostIP": "127.0.0.1"}
    roles = []
    try:
        agent = Container(objects, "DaemonSet", lanyard_binary(), tmp_path / "agent", downward, kube.kubeconfig)
        roles.append(agent)
        webhook = Container(objects, "Deployment", lanyard_binary(), tmp_path / "webhook", downward, kube.kubeconfig)
        roles.append(webhook)
        for role, admin in ((agent, agent_admin), (webhook, hook_admin)):
            wait_for(lambda: ready(f"http://127.0.0.1:{admin}/readyz"), f"{role.argv[1]} ready", proc=role.proc)
        # The chart's own CA, for the name the API server calls it by.
        secret = find(objects, "Secret", "lanyard-webhook-tls")
        ca = ssl.create_default_context(cadata=base64.b64decode(secret["data"]["ca.crt"]).decode())
        raycluster = yaml.safe_load((ROOT / "docs/examples/raycluster.yaml").read_text())
        templates = [raycluster["spec"]["headGroupSpec"]["template"]] + [
            g["template"] for g in raycluster["spec"]["workerGroupSpecs"]]
        for template in templates:
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {**copy.deepcopy(template["metadata"]),
                   "generateName": "ray-data-", "namespace": "ray"}, "spec": copy.deepcopy(template["spec"])}
            for version in KUBE_VERSIONS:
                kubernetes_validate.validate(pod, version, strict=True)
            response = post_review(hook_port, ca, "/mutate", review(pod, "ray"))
            assert response["allowed"] is True, response
            mutated = apply_json_patch(pod, json.loads(base64.b64decode(response["patch"])))
            for version in KUBE_VERSIONS:
                kubernetes_validate.validate(mutated, version, strict=True)
            sidecar = mutated["spec"]["initContainers"][0]
            assert sidecar["command"] == ["lanyard-sidecar"] and sidecar["restartPolicy"] == "Always"
            assert sidecar["image"] == "lanyard:0.1.0"
            sidecar_env = {e["name"]: e.get("value") for e in sidecar["env"]}
            assert sidecar_env["LANYARD_AGENT_URL"] == f"http://lanyard-agent.{NAMESPACE}.svc:{agent_port}"
            assert sidecar["resources"]["limits"]["memory"] == "64Mi"
            app = mutated["spec"]["containers"][0]
            app_env = {e["name"] for e in app["env"]}
            for name in ("IDENTITY_ENDPOINT", "AZURE_CLIENT_ID", "GCE_METADATA_HOST",
                         "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_REGION"):
                assert name in app_env, (app["name"], name)
            audiences = {s["serviceAccountToken"]["audience"] for v in mutated["spec"]["volumes"]
                         if "projected" in v for s in v["projected"]["sources"] if "serviceAccountToken" in s}
            assert {"api://AzureADTokenExchange", "sts.amazonaws.com", GCP["workloadIdentityProvider"]} <= audiences
        # Each admission is recorded in the webhook's own audit volume.
        records = [json.loads(line) for line in
                   (tmp_path / "webhook" / "volumes" / "audit" / "audit.jsonl").read_text().splitlines()]
        admissions = [r for r in records if r["type"] == "admission"]
        assert len(admissions) == len(templates), records
        # SIGTERM, as the kubelet sends it: each role is not ready at once,
        # yet serves through the chart's shutdown delay (5 s), then exits.
        for role in roles:
            role.proc.send_signal(signal.SIGTERM)
        term = time.monotonic()
        for admin in (agent_admin, hook_admin):
            wait_for(lambda: readyz(f"http://127.0.0.1:{admin}/readyz") == (503, "not ready: shutting down"),
                     "not ready after SIGTERM", timeout=3)
        assert post_review(hook_port, ca, "/mutate", review(pod, "ray"))["allowed"] is True
        assert readyz(f"http://127.0.0.1:{agent_port}/healthz") == (200, "ok")
        assert time.monotonic() - term < 5, "the delay was over before the checks"
        exits = [role.proc.wait(timeout=30) for role in roles]
        stopped_after = time.monotonic() - term
        assert exits == [0, 0], exits
        assert 5 <= stopped_after < 15, stopped_after
    finally:
        codes = [r.stop() for r in roles]
        kube.stop()
    assert codes == [0] * len(roles), [(r.argv, r.output()[-2000:]) for r in roles]
