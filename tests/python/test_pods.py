"""End to end as a cluster runs it: the chart's agent on two nodes and its
webhook, the Ray example's pods admitted by that webhook and run by the
kubelet-like harness (tests/python/kubelet.py) in network namespaces of
their own, real SDKs in the app containers, the clouds emulated behind
their real names and counted there.

Skipped, with the reason, only where the machine cannot create network
namespaces."""

from __future__ import annotations

import base64
import copy
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from chart import Container, find, render, wait_for
from conftest import ROOT, lanyard_binary
from kubelet import (API_IP, Cluster, FakeKubeProcess, Pod, Refused, can_create_namespaces, install_admission,
                     mesh_configuration, request, results, trust_bundle, with_service_account, with_trust_store)

REASON = can_create_namespaces()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"pods end to end: {REASON}")

TENANT = "5f0c8b0e-6a3b-4c1e-9a51-3d2f1e0c7b21"
PROVIDER = ("//iam.googleapis.com/projects/123456789012/locations/global/"
            "workloadIdentityPools/e2e/providers/cluster")
AGENT_PORT, AGENT_ADMIN, HOOK_PORT, HOOK_ADMIN = 8700, 8701, 8443, 8444
# How long the harness's endpoints keep routing to a replica after its
# SIGTERM: the endpoints controller and the API server's view lag the
# kubelet (a second or more in a real cluster).
ENDPOINTS_LAG = 1.0
EXAMPLE_SA = list(yaml.safe_load_all((ROOT / "docs/examples/ray-serviceaccount.yaml").read_text()))
RAY = EXAMPLE_SA[1]["metadata"]["annotations"]


def identity(namespace: str, name: str, client_id: str, gcp_sa: str, role: str, **chain) -> dict:
    """`chain`: aws_target_role_arn and aws_external_id, a target role the
    role chains into (trusting its sessions, with sts:TagSession)."""
    return {"namespace": namespace, "service_account": name, "azure_client_id": client_id,
            "gcp_service_account": gcp_sa, "aws_role_arn": role, **chain}


IDENTITIES = [
    identity("ray", "ray-worker", RAY["azure.workload.identity/client-id"],
             RAY["iam.gke.io/gcp-service-account"], RAY["eks.amazonaws.com/role-arn"]),
    identity("etl", "etl-runner", "11111111-2222-3333-4444-555555555555",
             "etl@lanyard-e2e.iam.gserviceaccount.com", "arn:aws:iam::111122223333:role/etl"),
    identity("legacy", "scripts", "66666666-7777-8888-9999-000000000000",
             "scripts@lanyard-e2e.iam.gserviceaccount.com", "arn:aws:iam::111122223333:role/scripts"),
    # A namespace the guard governs (labelled below).
    identity("governed", "builder", "77777777-8888-9999-aaaa-bbbbbbbbbbbb",
             "builder@lanyard-e2e.iam.gserviceaccount.com", "arn:aws:iam::111122223333:role/builder"),
    # A managed identity assigned to the node pool, which a multi-tenant
    # app, provisioned in another tenant, trusts as its federated
    # credential (the Anyscale operator's shape on AKS): the pod gets the
    # app's tokens in that tenant, the identity's from the node's IMDS.
    identity("anyscale", "operator", "99999999-aaaa-4bbb-8ccc-dddddddddddd",
             "operator@lanyard-e2e.iam.gserviceaccount.com", "arn:aws:iam::111122223333:role/operator",
             azure_app_client_id="c0ffee00-1234-4abc-8def-0123456789ab",
             azure_app_tenant_id="9d8c7b6a-5f4e-4d3c-8b2a-190817263544"),
    # Chains into a data lake's role in another account, as an EKS Pod
    # Identity target role association does.
    identity("lake", "loader", "88888888-9999-aaaa-bbbb-cccccccccccc",
             "loader@lanyard-e2e.iam.gserviceaccount.com", "arn:aws:iam::111122223333:role/loader",
             aws_target_role_arn="arn:aws:iam::222233334444:role/data-lake", aws_external_id="e2e-lake-4f1c"),
]
CLUSTER_ARN = "arn:aws:eks:us-east-1:111122223333:cluster/e2e"
# The identities that come from the node's IMDS: the clouds assign them to
# the node pool (with the app that trusts each), the chart lists them, and
# the policy permits each to its ServiceAccount alone.
NODE_IDENTITIES = [i for i in IDENTITIES if "azure_app_client_id" in i]
POLICY = "\n".join([
    '@id("allow-bound")',
    'permit (principal, action in Action::"credential", resource) unless { resource.source == "node" };',
] + [f'''@id("node-identity-{i['namespace']}-{i['service_account']}")
permit (principal == ServiceAccount::"{i['namespace']}/{i['service_account']}", action in Action::"credential", resource)
when {{ resource.source == "node" && resource has via && resource.via.id == "{i['azure_client_id']}" }};''' for i in NODE_IDENTITIES])
# Namespaces the guard governs (its webhook and its ValidatingAdmissionPolicy
# both on): the Ray cluster's and the builder's.
GOVERNED = {name: {"lanyard.dev/guard": "enforce"} for name in ("governed", "ray")}


def expected(ident: dict) -> dict:
    """Whose credentials each cloud must have issued to a pod of `ident`."""
    azure = f"{ident.get('azure_app_tenant_id', TENANT)}/{ident.get('azure_app_client_id', ident['azure_client_id'])}"
    return {"azure": azure, "gcp": ident["gcp_service_account"],
            "aws": ident.get("aws_target_role_arn", ident["aws_role_arn"])}


def fake_kube_binary() -> Path:
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    binary = Path(os.environ.get("LANYARD_FAKE_KUBE_BIN") or target / "debug" / "lanyard-fake-kube")
    assert binary.exists(), f"{binary}: cargo build -p lanyard-fake-kube --features server"
    return binary


class E2E:
    """The running cluster: API server with clouds, webhook, two nodes."""

    def __init__(self, workdir: Path, gke_cluster: str | None = None, identity_binding: str | None = None):
        """`gke_cluster`: Google through GKE's own pool for that cluster
        (`projects/P/locations/L/clusters/C`), its grants written as GKE
        Workload Identity's, instead of through a provider.
        `identity_binding`: Azure through AKS identity bindings, the proxy
        answering to that server name on the API server's address, each
        identity's use granted to its ServiceAccount by Learn's ClusterRole
        and ClusterRoleBinding, instead of a federated credential per
        ServiceAccount."""
        self.started = time.monotonic()
        self.workdir = workdir
        self.cluster = Cluster(workdir)
        self.roles: list[Container] = []
        self.startup: list[float] = []
        self.figures: dict = {}
        federated = [{k: v for k, v in i.items() if not k.startswith("azure_app_")} for i in IDENTITIES]
        clouds = {"azure_tenant_id": TENANT, "gcp_provider": PROVIDER, "identities": federated,
                  "azure_node_identities": [{"client_id": i["azure_client_id"],
                                             "app_client_id": i["azure_app_client_id"],
                                             "app_tenant_id": i["azure_app_tenant_id"]} for i in NODE_IDENTITIES]}
        gcp = {"workloadIdentityProvider": PROVIDER, "projectId": "lanyard-e2e", "projectNumber": "123456789012"}
        if gke_cluster:
            clouds.update(gcp_gke_cluster=gke_cluster, gcp_project_number="123456789012")
            gcp = {"gkeCluster": gke_cluster, "projectNumber": "123456789012"}
        azure = {"tenantId": TENANT, "nodeIdentities": [i["azure_client_id"] for i in NODE_IDENTITIES]}
        if identity_binding:
            clouds["azure_identity_binding"] = identity_binding
            azure["identityBinding"] = {"sniName": identity_binding}
        self.kube = FakeKubeProcess(self.cluster, fake_kube_binary(), clouds)
        self.bundle = trust_bundle(workdir, self.kube.clouds_ca)
        self.values = {
            "cluster": {"name": "e2e"},
            "azure": azure,
            "policy": {"enabled": True, "policies": {"e2e.cedar": POLICY}},
            "gcp": gcp,
            "aws": {"region": "us-east-1", "clusterArn": CLUSTER_ARN},
            # Shutdown delays shorter than the chart's 5 s: the harness's
            # endpoints lag by ENDPOINTS_LAG, not by a real cluster's seconds.
            "agent": {"port": AGENT_PORT, "adminPort": AGENT_ADMIN, "reachVia": "hostPort",
                      "shutdownDelaySeconds": 1},
            "webhook": {"port": HOOK_PORT, "adminPort": HOOK_ADMIN, "shutdownDelaySeconds": 2},
            "guard": {"enabled": True, "admissionPolicy": True, "imdsEgress": {"namespaces": sorted(GOVERNED)}},
        }
        self.objects = render(self.values)
        # The cluster's CNI enforces the chart's egress NetworkPolicies.
        self.cluster.network_policies = [o for o in self.objects if o["kind"] == "NetworkPolicy"]
        secret = find(self.objects, "Secret", "lanyard-webhook-tls")
        self.webhook_ca = base64.b64decode(secret["data"]["ca.crt"]).decode()
        # The chart's webhooks and policy, and a mesh's injector beside them:
        # pods are admitted by the fake API server as a cluster admits them.
        self.endpoints = [f"{API_IP}:{HOOK_PORT}"]
        install_admission(self.kube, self.objects, self.endpoints)
        self.kube.apply(mesh_configuration(self.kube))
        for obj in EXAMPLE_SA:
            if obj["kind"] == "Namespace":
                obj = {**obj, "metadata": {**obj["metadata"], "labels": GOVERNED.get(obj["metadata"]["name"], {})}}
            self.kube.apply(obj)
        for ident in IDENTITIES[1:]:
            ns = ident["namespace"]
            self.kube.apply({"apiVersion": "v1", "kind": "Namespace",
                             "metadata": {"name": ns, "labels": GOVERNED.get(ns, {})}})
            chain = {f"lanyard.dev/{cloud}-{key}": ident[f"{cloud}_{key.replace('-', '_')}"]
                     for cloud, key in (("aws", "target-role-arn"), ("aws", "external-id"),
                                        ("azure", "app-client-id"), ("azure", "app-tenant-id"))
                     if f"{cloud}_{key.replace('-', '_')}" in ident}
            self.kube.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {
                "name": ident["service_account"], "namespace": ident["namespace"], "annotations": {
                    "azure.workload.identity/client-id": ident["azure_client_id"],
                    "iam.gke.io/gcp-service-account": ident["gcp_service_account"],
                    "eks.amazonaws.com/role-arn": ident["aws_role_arn"], **chain}}})
        if identity_binding:
            for ident in IDENTITIES:
                for obj in use_managed_identity(ident["azure_client_id"], ident["namespace"],
                                                ident["service_account"]):
                    self.kube.apply(obj)
        self.webhook = Container(self.objects, "Deployment", lanyard_binary(), workdir / "webhook",
                                 {"spec.nodeName": "control-plane", "status.hostIP": API_IP},
                                 self.kube.kubeconfig, prefix=["ip", "netns", "exec", self.cluster.api])
        self.roles.append(self.webhook)
        self.nodes = [self.cluster.add_node("node-a"), self.cluster.add_node("node-b")]
        self.agents = {node.name: self.start_agent(node) for node in self.nodes}
        wait_for(lambda: request(self.cluster.api, "GET", f"http://127.0.0.1:{HOOK_ADMIN}/readyz").status == 200,
                   "the webhook is ready")
        self.bin_dir = Path(lanyard_binary()).parent
        self.pods: list[Pod] = []

    def start_agent(self, node, binary: str | None = None, generation: int = 0) -> Container:
        # LANYARD_E2E_AGENT_LOG: a log filter for the agents (RUST_LOG), to
        # debug a failing run.
        debug = {"RUST_LOG": os.environ["LANYARD_E2E_AGENT_LOG"]} if os.environ.get("LANYARD_E2E_AGENT_LOG") else {}
        workdir = self.workdir / (f"agent-{node.name}" + (f"-{generation}" if generation else ""))
        # As the kubelet runs every container: the API server's Service in
        # KUBERNETES_SERVICE_HOST/_PORT, and the ServiceAccount plugin's
        # kube-api-access volume (the cluster CA, the namespace) at its path.
        api = urlsplit(self.kube.api_https)
        in_cluster = {"KUBERNETES_SERVICE_HOST": api.hostname, "KUBERNETES_SERVICE_PORT": str(api.port)}
        agent = Container(self.objects, "DaemonSet", binary or lanyard_binary(), workdir,
                          {"spec.nodeName": node.name, "status.hostIP": node.address}, self.kube.kubeconfig,
                          prefix=["ip", "netns", "exec", node.ns, *with_trust_store(self.bundle),
                                  *with_service_account(workdir / "kube-api-access", self.kube.ca_pem,
                                                        "lanyard-system")],
                          extra_env={**in_cluster, **debug})
        self.roles.append(agent)
        wait_for(lambda: agent.proc.poll() is None and request(
            node.ns, "GET", f"http://127.0.0.1:{AGENT_ADMIN}/readyz").status == 200,
            f"the agent on {node.name} is ready", timeout=60)
        # The DaemonSet's pod as the API server holds it once the kubelet
        # reports it ready (what `kubectl get pods` and `lanyard doctor` see).
        template = find(self.objects, "DaemonSet")["spec"]["template"]
        self.kube.apply({"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"name": f"lanyard-agent-{node.name}", "namespace": "lanyard-system",
                                      "labels": template["metadata"]["labels"]},
                         "spec": {**copy.deepcopy(template["spec"]), "nodeName": node.name},
                         "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}})
        return agent

    def upgrade_agent(self, node) -> dict:
        """The DaemonSet's rolling update on `node` with reachVia hostPort
        (maxSurge 0): the old agent gets SIGTERM and, once it has exited,
        the new one starts from the new image (here another copy of the
        binary: this build is both versions; tests/agent_wire.rs holds the
        older sidecars' requests to the frozen wire format). Returns the
        timeline."""
        new_binary = self.workdir / "image-next" / "lanyard"
        if not new_binary.exists():
            new_binary.parent.mkdir(exist_ok=True)
            shutil.copy2(lanyard_binary(), new_binary)
        old = self.agents[node.name]
        t = {"sigterm": time.time()}
        code = old.stop()
        t["old_exited"] = time.time()
        assert code == 0, old.output()[-2000:]
        self.agents[node.name] = self.start_agent(node, str(new_binary), generation=1)
        t["new_ready"] = time.time()
        return t

    def roll_webhook(self, role: str, address: str, new_env: dict[str, str] | None = None) -> dict:
        """The webhook Deployment's rolling update as the chart sets it
        (maxSurge 1, maxUnavailable 0): a new replica in a namespace of its
        own at `address` starts, joins the Service's endpoints once its
        readiness probe passes, then the old one gets SIGTERM and leaves the
        endpoints ENDPOINTS_LAG later. Returns the timeline and the old
        replica's exit code."""
        ns = self.cluster.add_host(role, address)
        new = Container(self.objects, "Deployment", lanyard_binary(), self.workdir / role,
                        {"spec.nodeName": "control-plane", "status.hostIP": address}, self.kube.kubeconfig,
                        prefix=["ip", "netns", "exec", ns], extra_env=new_env)
        self.roles.append(new)
        t = {"started": time.time()}
        wait_for(lambda: new.proc.poll() is None and request(
            ns, "GET", f"http://127.0.0.1:{HOOK_ADMIN}/readyz").status == 200, f"webhook {role} is ready")
        t["new_ready"] = time.time()
        old, old_address = self.webhook, self.endpoints[-1]
        self.endpoints = [old_address, f"{address}:{HOOK_PORT}"]
        self.kube.set_endpoints("lanyard-system", "lanyard-webhook", self.endpoints)
        time.sleep(0.3)
        old.proc.send_signal(signal.SIGTERM)
        t["sigterm"] = time.time()
        time.sleep(ENDPOINTS_LAG)
        self.endpoints = self.endpoints[1:]
        self.kube.set_endpoints("lanyard-system", "lanyard-webhook", self.endpoints)
        t["dropped"] = time.time()
        t["old_code"] = old.proc.wait(timeout=40)
        t["old_exited"] = time.time()
        old.log.close()
        self.webhook = new
        return t

    def run_pod(self, node, template: dict, name: str, namespace: str, rotate_every: float | None = None,
                sidecar_env: dict[str, str] | None = None) -> Pod:
        """Creation through the API server's admission, scheduling onto
        `node` (the scheduler's binding), then the kubelet. `sidecar_env` is
        a test's lever on the injected sidecar (added to its env after
        admission), never something a pod could do."""
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {**copy.deepcopy(template.get("metadata", {})), "name": name, "namespace": namespace},
               "spec": copy.deepcopy(template["spec"])}
        mutated = self.kube.create_pod(pod)
        mutated["spec"]["nodeName"] = node.name
        if os.environ.get("LANYARD_E2E_SIDECAR_LOG"):
            # A log filter for the sidecars (RUST_LOG), to debug a failing run.
            sidecar_env = {**(sidecar_env or {}), "RUST_LOG": os.environ["LANYARD_E2E_SIDECAR_LOG"]}
        if sidecar_env:
            sidecar = next(c for c in mutated["spec"]["initContainers"] if c.get("restartPolicy") == "Always")
            sidecar.setdefault("env", []).extend({"name": k, "value": v} for k, v in sidecar_env.items())
        stored = self.kube.apply(mutated)
        running = Pod(self.cluster, self.kube, node, stored, self.bin_dir, rotate_every)
        self.pods.append(running)
        running.start_init_containers()
        return running

    def whose(self, line: dict) -> str | None:
        found = self.kube.whois(line["credential"])
        assert found is None or found["cloud"] == line["cloud"], (line["cloud"], found)
        return found and found["principal"]

    def close(self) -> list[str]:
        for pod in self.pods:
            pod.stop()
        codes = [(r.argv[1], r.stop()) for r in self.roles if r.proc.poll() is None]
        problems = [f"{role} exited {code}" for role, code in codes if code != 0]
        problems += self.cluster.close()
        return problems + self.leaks()

    def leaks(self) -> list[str]:
        """No projected token (a JWT) and no credential an SDK received in
        any log of Lanyard's: agents, webhook, sidecars."""
        issued = {line["credential"] for out in self.workdir.glob("pod-*/*.out")
                  for line in results(out) if line["ok"]}
        logs = [*self.workdir.glob("agent-*/*.log"), *self.workdir.glob("webhook*/*.log"),
                *self.workdir.glob("pod-*-lanyard*.log"), *self.workdir.glob("pod-*-rogue.log")]
        found = []
        for log in logs:
            text = log.read_text(errors="replace")
            if "eyJ" in text or any(c in text for c in issued):
                found.append(f"a token or credential in {log.name}")
        return found if issued else ["no credential was issued at all"]


def use_managed_identity(client_id: str, namespace: str, name: str) -> list[dict]:
    """Microsoft Learn's grant ("Identity bindings" how-to): a ClusterRole
    allowing `use-managed-identity` on the identity's client id in API
    group `cid.wi.aks.azure.com`, bound to the ServiceAccount."""
    role = f"use-mi-{client_id}-{namespace}-{name}"
    return [{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": role},
             "rules": [{"verbs": ["use-managed-identity"], "apiGroups": ["cid.wi.aks.azure.com"],
                        "resources": [client_id]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": role},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
             "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]}]


def running_e2e(gke_cluster: str | None = None, figures_name: str = "pods-e2e-figures.json",
                identity_binding: str | None = None):
    """The cluster for a module's tests; on the way out, no namespace,
    process problem or leaked token may be left, and its figures are
    written to the target directory."""
    workdir = Path(tempfile.mkdtemp(prefix="lanyard-pods-"))
    env = None
    try:
        env = E2E(workdir, gke_cluster, identity_binding)
        yield env
    finally:
        problems = env.close() if env else []
        if env:
            figures = {"startup_p50_s": statistics.median(env.startup) if env.startup else None,
                       "startup_samples": len(env.startup),
                       "harness_s": round(time.monotonic() - env.started, 1), **env.figures}
            target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
            (target / figures_name).write_text(json.dumps(figures))
            print("pods end to end:", figures)
        leftover = [ns for ns in os.listdir("/var/run/netns") if env and ns.startswith(env.cluster.tag)] \
            if os.path.isdir("/var/run/netns") else []
        if not os.environ.get("LANYARD_KEEP_PODS"):
            shutil.rmtree(workdir, ignore_errors=True)
        assert not leftover, f"namespaces left behind: {leftover}"
        assert not problems, problems


@pytest.fixture(scope="module")
def e2e():
    yield from running_e2e()


def ray_templates() -> tuple[dict, dict]:
    raycluster = yaml.safe_load((ROOT / "docs/examples/raycluster.yaml").read_text())
    return raycluster["spec"]["headGroupSpec"]["template"], raycluster["spec"]["workerGroupSpecs"][0]["template"]


def plain_template(service_account: str, annotations: dict | None = None) -> dict:
    return {"metadata": {"labels": {"lanyard.dev/inject": "true"}, "annotations": annotations or {}},
            "spec": {"serviceAccountName": service_account, "automountServiceAccountToken": False,
                     "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
                                         "seccompProfile": {"type": "RuntimeDefault"}},
                     "containers": [{"name": "app", "image": "python:3.11-slim",
                                     "securityContext": {"allowPrivilegeEscalation": False,
                                                         "capabilities": {"drop": ["ALL"]}}}]}}


def run_app(e2e: E2E, pod: Pod, *sdk_args: str, timeout: float = 120.0) -> list[dict]:
    """The pod's first app container runs the SDK script to completion."""
    proc, out = pod.start_app(pod.app_containers()[0], list(sdk_args))
    code = proc.proc.wait(timeout=timeout)
    assert code == 0, proc.output()
    lines = results(out)
    if pod.sidecar_started is not None and lines and lines[0]["ok"]:
        first = min(line["t"] for line in lines if line["ok"])
        # Wall clock of the script against the monotonic start: convert.
        e2e.startup.append(first - (time.time() - (time.monotonic() - pod.sidecar_started)))
        e2e.figures.setdefault("sidecar_ready_s", []).append(round(pod.sidecar_ready - pod.sidecar_started, 3))
    return lines


def assert_all_ok_and_owned(e2e: E2E, lines: list[dict], ident: dict) -> None:
    want = expected(ident)
    failed = [line for line in lines if not line["ok"]]
    assert not failed, failed
    for line in lines:
        assert e2e.whose(line) == want[line["cloud"]], (line["cloud"], want[line["cloud"]])


def test_a_target_role_in_another_account_serves_boto3_with_ekss_session_tags(e2e):
    lake = IDENTITIES[-1]
    node = e2e.nodes[1]
    pod = e2e.run_pod(node, plain_template("loader"), "loader-0", "lake")
    (line,) = run_app(e2e, pod, "--clouds", "aws")
    assert_all_ok_and_owned(e2e, [line], lake)
    chained = [s for s in e2e.kube.aws_sessions() if s["access_key_id"] == line["credential"]]
    assert len(chained) == 1 and chained[0]["action"] == "AssumeRole", chained
    (session,) = chained
    assert session["role_arn"] == lake["aws_target_role_arn"]
    assert session["source_role_arn"] == lake["aws_role_arn"]
    assert session["external_id"] == lake["aws_external_id"]
    assert session["duration_seconds"] <= 3600
    tags = dict(session["tags"])
    assert tags == {"eks-cluster-arn": CLUSTER_ARN, "eks-cluster-name": "e2e", "kubernetes-namespace": "lake",
                    "kubernetes-service-account": "loader", "kubernetes-pod-name": "loader-0",
                    "kubernetes-pod-uid": pod.meta["uid"]}, tags
    assert sorted(session["transitive_tag_keys"]) == sorted(tags)


def test_an_app_trusting_the_node_identity_serves_azure_identity_in_its_tenant(e2e):
    operator = next(i for i in IDENTITIES if "azure_app_client_id" in i)
    pod = e2e.run_pod(e2e.nodes[0], plain_template("operator"), "operator-0", "anyscale")
    rust = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "debug" / "lanyard-rust-clients"
    image = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp"}
    if rust.exists():
        # A herd of a thousand credentials at once, the operator's first
        # calls on this node: one exchange of each hop, the identity's
        # token from IMDS and the app's from Entra.
        before = e2e.kube.counts()["azure"]
        out = pod.exec(pod.app_containers()[0], [str(rust), "azure-herd", "1000",
                                                 "https://storage.azure.com/.default"], image_env=image)
        assert out.returncode == 0, out.stdout + out.stderr
        herd = json.loads(out.stdout.splitlines()[-1])
        assert (herd["requests"], herd["distinct"]) == (1000, 1), herd
        after = e2e.kube.counts()["azure"]
        issued = {p: n - before.get(p, 0) for p, n in after.items() if n != before.get(p, 0)}
        assert issued == {f"{TENANT}/{operator['azure_client_id']}": 1, expected(operator)["azure"]: 1}, issued
        e2e.figures["app_hop_herd"] = {"requests": 1000, "exchanges": issued}
    (line,) = run_app(e2e, pod, "--clouds", "azure")
    # Owned by the app in the resource tenant, as Entra's ledger says.
    assert_all_ok_and_owned(e2e, [line], operator)
    # @azure/identity in the same container, with nothing but its
    # environment (the webhook's AZURE_CLIENT_ID names the identity).
    node = shutil.which("node")
    if node and (ROOT / "tests/node/node_modules").is_dir():
        app = pod.app_containers()[0]
        out = pod.exec(app, [node, str(ROOT / "tests/node/azure.mjs"), "managed-identity-client-id"],
                       image_env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp"})
        assert out.returncode == 0, out.stderr
        token = json.loads(out.stdout.splitlines()[-1])["token"]
        assert e2e.kube.whois(token)["principal"] == expected(operator)["azure"]
    # The Rust SDK's ManagedIdentityCredential, likewise.
    if rust.exists():
        out = pod.exec(pod.app_containers()[0], [str(rust), "azure"], image_env=image)
        assert out.returncode == 0, out.stdout + out.stderr
        token = json.loads(out.stdout.splitlines()[-1])["token"]
        assert e2e.kube.whois(token)["principal"] == expected(operator)["azure"]
    # Another ServiceAccount annotated with the operator's identity and app:
    # the policy permits it to the operator's ServiceAccount alone.
    e2e.kube.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {
        "name": "intruder", "namespace": "anyscale", "annotations": {
            "azure.workload.identity/client-id": operator["azure_client_id"],
            "lanyard.dev/azure-app-client-id": operator["azure_app_client_id"],
            "lanyard.dev/azure-app-tenant-id": operator["azure_app_tenant_id"]}}})
    pod = e2e.run_pod(e2e.nodes[1], plain_template("intruder"), "intruder-0", "anyscale")
    (line,) = run_app(e2e, pod, "--clouds", "azure")
    assert not line["ok"], line
    # Nothing upstream checks which pod asks for a node identity: the
    # policy refuses it.
    assert "Denied by Lanyard policy" in line["error"] and "anyscale/intruder" in line["error"], line["error"]
    # Each hop was asked once for the operator, and the identity's token
    # came from the node's IMDS, never through a federated credential.
    audit = e2e.workdir / "agent-node-a" / "volumes" / "audit" / "audit.jsonl"
    records = [r for r in map(json.loads, audit.read_text().splitlines())
               if r["type"] == "credential" and r["request"].get("via") == operator["azure_client_id"]]
    assert records and all(r["request"]["source"] == "node" for r in records), records
    assert {(r["request"]["account"], r["request"]["via_account"]) for r in records} == {
        (operator["azure_app_tenant_id"], TENANT)}, records


def test_a_wrong_external_id_is_access_denied_in_boto3(e2e):
    lake = IDENTITIES[-1]
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {
        "name": "loader", "namespace": "lake", "annotations": {
            "azure.workload.identity/client-id": lake["azure_client_id"],
            "iam.gke.io/gcp-service-account": lake["gcp_service_account"],
            "eks.amazonaws.com/role-arn": lake["aws_role_arn"],
            "lanyard.dev/aws-target-role-arn": lake["aws_target_role_arn"],
            "lanyard.dev/aws-external-id": "not-the-lakes-id"}}}
    e2e.kube.apply(sa)
    try:
        def refused():
            pod = e2e.run_pod(e2e.nodes[0], plain_template("loader"), f"loader-x{time.monotonic_ns() % 10_000}",
                              "lake")
            (line,) = run_app(e2e, pod, "--clouds", "aws")
            pod.stop()
            return line
        # The agents follow the ServiceAccount's annotations through their
        # watch: wait until the new external id is the one presented.
        deadline = time.monotonic() + 20
        while True:
            line = refused()
            if not line["ok"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert not line["ok"], line
        assert "AccessDenied" in line["error"] and "sts:AssumeRole on resource" in line["error"], line["error"]
    finally:
        sa["metadata"]["annotations"]["lanyard.dev/aws-external-id"] = lake["aws_external_id"]
        e2e.kube.apply(sa)


def test_one_raycluster_on_one_node_shares_one_exchange_per_identity(e2e):
    head, worker = ray_templates()
    node = e2e.nodes[0]
    before = e2e.kube.counts()
    pods = [e2e.run_pod(node, head, "ray-data-head", "ray")]
    pods += [e2e.run_pod(node, worker, f"ray-data-worker-{i}", "ray") for i in range(2)]
    for pod in pods:
        # The head's autoscaler container is skipped; its Ray container and
        # the workers' get the SDK variables.
        container = pod.app_containers()[0]
        names = {e["name"] for e in container.get("env", [])}
        assert {"IDENTITY_ENDPOINT", "GCE_METADATA_HOST", "AWS_CONTAINER_CREDENTIALS_FULL_URI"} <= names
        assert_all_ok_and_owned(e2e, run_app(e2e, pod, "--count", "2"), IDENTITIES[0])
    after = e2e.kube.counts()
    want = expected(IDENTITIES[0])
    for cloud, principal in want.items():
        issued = after[cloud].get(principal, 0) - before[cloud].get(principal, 0)
        assert issued == 1, f"{cloud}: {issued} exchanges for {principal} across three pods"
    # Google: one STS exchange under it, for the federated principal.
    sts = {p: n for p, n in after["gcp"].items() if "subject/system:serviceaccount:ray:ray-worker" in p}
    assert list(sts.values()) == [1], sts


def test_kuberay_pods_beside_a_mesh_in_a_governed_namespace_are_stored_as_a_cluster_stores_them(e2e):
    """The Ray namespace is governed (the guard's webhook and policy on) and
    a mesh injector runs after Lanyard's webhook: the API server calls
    Lanyard's again, reruns the ServiceAccount plugin (which mounts the API
    token into the mesh's container but not into Lanyard's sidecar), and
    the policy and the guard admit the pod they finally see, which starts
    and serves its SDKs."""
    head, worker = ray_templates()
    node = e2e.nodes[1]
    before = len(e2e.kube.webhook_calls())
    head_pod = e2e.run_pod(node, head, "ray-mesh-head", "ray")
    calls = e2e.kube.webhook_calls()[before:]
    assert calls == ["inject.lanyard.dev CREATE", "inject.mesh.example CREATE", "inject.lanyard.dev CREATE",
                     "ValidatingAdmissionPolicy lanyard-guard CREATE", "guard.lanyard.dev CREATE"], calls
    worker_pod = e2e.run_pod(node, worker, "ray-mesh-worker-0", "ray")
    spec = head_pod.spec
    sidecar = next(c for c in spec["initContainers"] if c["name"] == "lanyard")
    assert [m["name"] for m in sidecar["volumeMounts"]] == ["lanyard-tokens", "lanyard-app-token",
                                                           "lanyard-no-api-token"]
    api = [v["name"] for v in spec["volumes"] if v["name"].startswith("kube-api-access-")]
    assert len(api) == 1, spec["volumes"]
    assert [c["name"] for c in spec["containers"]] == ["ray-head", "mesh-proxy"]
    for c in spec["containers"]:
        assert any(m["name"] == api[0] for m in c["volumeMounts"]), c
    # The worker opts out of the API token (automountServiceAccountToken:
    # false), in its mesh container too.
    assert not [v for v in worker_pod.spec["volumes"] if v["name"].startswith("kube-api-access-")]
    # The kubelet wrote the API token for the head's own container; the
    # sidecar sees an empty directory there.
    app = head_pod.app_containers()[0]
    token = head_pod.exec(app, ["cat", "/var/run/secrets/kubernetes.io/serviceaccount/token"])
    assert token.returncode == 0 and token.stdout.startswith("eyJ"), token.stderr
    nothing = head_pod.exec(sidecar, ["ls", "-A", "/var/run/secrets/kubernetes.io/serviceaccount"],
                            image_env={"PATH": "/usr/bin:/bin", "HOME": "/"})
    assert nothing.returncode == 0 and nothing.stdout == "", (nothing.stdout, nothing.stderr)
    for pod in (head_pod, worker_pod):
        assert_all_ok_and_owned(e2e, run_app(e2e, pod, "--clouds", "azure,aws"), IDENTITIES[0])
    # A label on the running head, as kubectl label sends it (a merge
    # patch): admitted by both guards.
    labelled = e2e.kube.api("PATCH", "/api/v1/namespaces/ray/pods/ray-mesh-head",
                            {"metadata": {"labels": {"ray.io/role": "data"}}}, "application/merge-patch+json")
    assert labelled.status == 200, labelled.body
    assert e2e.kube.webhook_calls()[-2:] == ["ValidatingAdmissionPolicy lanyard-guard UPDATE",
                                             "guard.lanyard.dev UPDATE"]


def test_pods_of_other_service_accounts_get_their_own_identity_and_not_each_others_sidecar(e2e):
    node = e2e.nodes[0]
    _, worker = ray_templates()
    ray_pod = e2e.run_pod(node, worker, "ray-data-worker-iso", "ray")
    etl_pod = e2e.run_pod(node, plain_template("etl-runner"), "etl-0", "etl")
    assert_all_ok_and_owned(e2e, run_app(e2e, etl_pod), IDENTITIES[1])
    assert_all_ok_and_owned(e2e, run_app(e2e, ray_pod, "--clouds", "azure"), IDENTITIES[0])
    sidecar = next(c for c in ray_pod.spec["initContainers"] if c.get("restartPolicy") == "Always")
    port = sidecar["args"][sidecar["args"].index("--listen") + 1].rsplit(":", 1)[1]
    # From the etl pod: the ray pod's SDK port is on the ray pod's loopback
    # only; its own loopback port is its own sidecar.
    with pytest.raises(OSError):
        request(etl_pod.ns, "GET", f"http://{ray_pod.ip}:{port}/metadata/identity/oauth2/token"
                "?api-version=2018-02-01&resource=https://storage.azure.com", headers={"Metadata": "true"},
                timeout=3)
    app = etl_pod.app_containers()[0]
    probe = etl_pod.exec(app, ["curl", "-sS", "--max-time", "5", "-H", "Metadata-Flavor: Google",
                               f"http://127.0.0.1:{port}/computeMetadata/v1/instance/service-accounts/default/email"])
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == IDENTITIES[1]["gcp_service_account"]


def doctor(e2e: E2E, tmp_path: Path, target: str) -> tuple[int, dict]:
    """`lanyard doctor pod TARGET` as an operator runs it: the agent's
    configuration and policies from the chart's ConfigMaps (as `kubectl
    get configmap` gives them), the cluster's kubeconfig, from a host
    that reaches the API server."""
    config = tmp_path / "agent.yaml"
    config.write_text(find(e2e.objects, "ConfigMap", "lanyard-config")["data"]["agent.yaml"])
    policies = tmp_path / "policies"
    policies.mkdir(exist_ok=True)
    for name, text in find(e2e.objects, "ConfigMap", "lanyard-policies")["data"].items():
        (policies / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LANYARD_", "KUBERNETES_"))}
    env["KUBECONFIG"] = e2e.kube.kubeconfig
    proc = subprocess.run(["ip", "netns", "exec", e2e.cluster.api, lanyard_binary(), "--config", str(config),
                           "doctor", "pod", target, "--output", "json", "--policy-dir", str(policies)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_lanyard_doctor_explains_a_running_pod_and_one_left_out(e2e, tmp_path):
    """A pod admitted through the API server's whole admission chain and
    running on a node with its agent: every check passes, the policy
    allows each identity as the agent did, and the trust names the
    cluster's issuer. A pod without the label is named as left out."""
    etl = IDENTITIES[1]
    node = e2e.nodes[0]
    pod = e2e.run_pod(node, plain_template("etl-runner"), "etl-doctor-0", "etl")
    assert_all_ok_and_owned(e2e, run_app(e2e, pod), etl)
    code, report = doctor(e2e, tmp_path, "etl/etl-doctor-0")
    assert code == 0, json.dumps(report, indent=2)
    by = {}
    for f in report["findings"]:
        by.setdefault((f["check"], f.get("cloud")), []).append(f)
    for check in ("pod", "opted-in", "sidecar", "agent", "serviceaccount", "issuer"):
        assert by[(check, None)][0]["status"] == "ok", by.get((check, None))
    # The chart runs the sidecar and the agent from one image.
    assert ("release", None) not in by, by[("release", None)]
    for cloud in ("azure", "gcp", "aws"):
        assert by[("token-audience", cloud)][0]["status"] == "ok"
        assert by[("binding", cloud)][0]["status"] == "ok"
        (policy,) = by[("policy", cloud)]
        assert policy["status"] == "ok" and "allowed by allow-bound" in policy["message"], policy
    trust = {t["cloud"]: t for t in report["trust"]}
    assert set(trust) == {"azure", "gcp", "aws"}
    assert trust["azure"]["identity"] == etl["azure_client_id"]
    assert trust["azure"]["subject"] == "system:serviceaccount:etl:etl-runner"
    assert trust["gcp"]["identity"] == etl["gcp_service_account"]
    assert trust["aws"]["identity"] == etl["aws_role_arn"]
    assert all(t["issuer"] == report["issuer"] for t in trust.values())

    left_out = copy.deepcopy(plain_template("etl-runner"))
    left_out["metadata"]["labels"] = {}
    e2e.run_pod(node, left_out, "etl-plain-0", "etl")
    code, report = doctor(e2e, tmp_path, "etl/etl-plain-0")
    assert code == 1
    failed = [f for f in report["findings"] if f["status"] == "fail"]
    assert [f["check"] for f in failed] == ["opted-in"], failed
    assert "lanyard.dev/inject" in failed[0]["fix"]


def test_a_pod_on_another_node_is_refused_by_this_nodes_agent(e2e):
    node_a, node_b = e2e.nodes
    _, worker = ray_templates()
    pod = e2e.run_pod(node_b, worker, "ray-data-worker-b", "ray")
    assert_all_ok_and_owned(e2e, run_app(e2e, pod, "--clouds", "aws"), IDENTITIES[0])
    # The same pod pointed at node A's agent (as a pod that rewrote its
    # sidecar's agent URL would be): refused, in the SDK's own format.
    sidecar = next(c for c in pod.spec["initContainers"] if c.get("restartPolicy") == "Always")
    rogue = copy.deepcopy(sidecar)
    rogue["name"] = "rogue"
    rogue["env"] = [e for e in rogue["env"] if e["name"] != "LANYARD_AGENT_URL"] + [
        {"name": "LANYARD_AGENT_URL", "value": f"http://{node_a.address}:{AGENT_PORT}"}]
    rogue["args"] = ["--listen", "127.0.0.1:18000", "--probe-listen", "0.0.0.0:18001"]
    proc = pod.start(rogue, pod.image_command(rogue), {"PATH": "/usr/bin:/bin", "HOME": "/"})
    app = pod.app_containers()[0]
    try:
        def refused():
            r = pod.exec(app, ["curl", "-sS", "--max-time", "5", "-H", "Metadata:true",
                               "http://127.0.0.1:18000/metadata/identity/oauth2/token"
                               "?api-version=2018-02-01&resource=https://storage.azure.com", "-w", "\n%{http_code}"])
            body, _, status = r.stdout.rpartition("\n")
            return (status, body) if status not in ("000", "") else None
        status, body = wait_for(refused, "the rogue sidecar answers", timeout=30)
        assert status == "403", (status, body)
        assert "access_token" not in body
    finally:
        proc.stop()
    # Node A's agent recorded why: the token names node B.
    audit = e2e.workdir / f"agent-{node_a.name}" / "volumes" / "audit" / "audit.jsonl"
    refusals = [r for r in map(json.loads, audit.read_text().splitlines())
                if r["type"] == "credential" and r["decision"].get("reason") == "other_node"]
    assert len(refusals) == 1, refusals
    assert "node-b" in refusals[0]["outcome"]["message"]


def test_token_rotation_while_the_app_keeps_calling_fails_no_call(e2e):
    _, worker = ray_templates()
    pod = e2e.run_pod(e2e.nodes[0], worker, "ray-data-worker-rot", "ray", rotate_every=0.25)
    lines = run_app(e2e, pod, "--count", "40", "--interval", "0.05")
    assert pod.rotations >= 8, f"only {pod.rotations} rotations while the app called"
    assert len(lines) == 120
    assert_all_ok_and_owned(e2e, lines, IDENTITIES[0])


def test_agent_upgrade_under_three_calling_pods_fails_no_call(e2e):
    """The agent DaemonSet rolls on a node while three pods call every
    cloud: the old agent serves through its shutdown delay, then the
    sidecars hold the requests that find no agent until the new one
    listens. No SDK call fails, and none gets another pod's credential.

    The sidecars run with grant reuse off, so that every SDK call crosses
    to the agent: with the default window (10 s) a call repeated during
    the upgrade is answered from the sidecar's last grant and never meets
    the gap at all."""
    node = e2e.nodes[0]
    _, worker = ray_templates()
    every_call = {"LANYARD_SIDECAR_GRANT_REUSE_SECONDS": "0"}
    pods = [e2e.run_pod(node, worker, f"ray-data-worker-u{i}", "ray", sidecar_env=every_call) for i in range(2)]
    pods.append(e2e.run_pod(node, plain_template("etl-runner"), "etl-u", "etl", sidecar_env=every_call))
    owners = [IDENTITIES[0], IDENTITIES[0], IDENTITIES[1]]
    stop_file = e2e.workdir / "stop-upgrade"
    apps = [pod.start_app(pod.app_containers()[0], ["--count", "100000", "--interval", "0.05",
                                                    "--stop-file", str(stop_file)]) for pod in pods]
    wait_for(lambda: all(len(results(out)) >= 6 for _, out in apps), "every pod has called", timeout=60)
    t = e2e.upgrade_agent(node)
    wait_for(lambda: all(any(l["ok"] and l["started"] > t["new_ready"] for l in results(out)) for _, out in apps),
             "every pod got credentials from the new agent", timeout=60)
    time.sleep(1)
    stop_file.write_text("")
    for proc, _ in apps:
        assert proc.proc.wait(timeout=60) == 0, proc.output()
    gap = [l for _, out in apps for l in results(out) if l["started"] < t["new_ready"] and l["t"] > t["old_exited"]]
    # Each failure with its call's start and end against the old agent's
    # exit (seconds), to tell where in the upgrade it fell.
    failed = [f"{l['cloud']} [{l['started'] - t['old_exited']:+.2f}, {l['t'] - t['old_exited']:+.2f}] s: "
              f"{l['error'][:300]}" for _, out in apps for l in results(out) if not l["ok"]]
    e2e.figures["upgrade_old_agent_served_s"] = round(t["old_exited"] - t["sigterm"], 2)
    e2e.figures["upgrade_no_agent_s"] = round(t["new_ready"] - t["old_exited"], 2)
    e2e.figures["upgrade_sigterm_s"] = round(t["sigterm"] - t["old_exited"], 2)
    e2e.figures["upgrade_calls_across_gap"] = len(gap)
    e2e.figures["upgrade_slowest_call_s"] = round(max((l["t"] - l["started"] for l in gap), default=0), 2)
    e2e.figures["upgrade_failed_calls"] = failed
    assert gap, "no call spanned the time without an agent"
    assert not failed, failed
    for (_, out), ident in zip(apps, owners):
        want = expected(ident)
        for line in results(out):
            assert e2e.whose(line) == want[line["cloud"]]


def admit_while(e2e: E2E, stop: threading.Event, prefix: str) -> list[dict]:
    """Creates opted-in pods through admission every 20 ms until `stop`:
    each outcome, with whether the stored pod has its sidecar. A webhook
    that cannot be reached refuses the pod (failurePolicy Fail)."""
    outcomes, i = [], 0
    while not stop.is_set():
        template = plain_template("etl-runner")
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {**template["metadata"], "name": f"{prefix}-{i}",
                                                               "namespace": "etl"}, "spec": template["spec"]}
        began = time.time()
        try:
            stored = e2e.kube.create_pod(copy.deepcopy(pod))
            sidecars = [c for c in stored["spec"].get("initContainers", []) if c.get("restartPolicy") == "Always"]
            outcomes.append({"t": began, "end": time.time(), "ok": True, "sidecar": len(sidecars) == 1})
        except (OSError, Refused, AssertionError) as e:
            outcomes.append({"t": began, "end": time.time(), "ok": False,
                             "error": f"{type(e).__name__}: {str(e)[:200]}"})
        i += 1
        time.sleep(0.02)
    return outcomes


def roll_under_creations(e2e: E2E, role: str, address: str, new_env: dict | None = None) -> tuple[dict, list]:
    stop = threading.Event()
    outcomes: list[dict] = []
    creator = threading.Thread(target=lambda: outcomes.extend(admit_while(e2e, stop, role)))
    creator.start()
    try:
        time.sleep(0.3)
        t = e2e.roll_webhook(role, address, new_env)
        time.sleep(0.3)
    finally:
        stop.set()
        creator.join(timeout=30)
    return t, outcomes


def test_the_webhook_rolls_while_pods_are_created_and_refuses_none(e2e):
    """Every pod created during the webhook's rolling update is admitted
    with its sidecar: the old replica answers reviews through its shutdown
    delay while the endpoints drop it. The same roll from a replica
    without the delay refuses the pods routed to it in the meantime, so the
    first half can fail."""
    t, outcomes = roll_under_creations(e2e, "webhook-b", "10.250.0.21", {"LANYARD_SHUTDOWN_DELAY_SECONDS": "0"})
    refused = [o for o in outcomes if not o["ok"]]
    during = [o for o in outcomes if t["sigterm"] <= o["t"] <= t["dropped"]]
    e2e.figures["webhook_roll"] = {"creations": len(outcomes), "during_lag": len(during), "refused": len(refused),
                                   "old_served_after_sigterm_s": round(t["old_exited"] - t["sigterm"], 2)}
    assert t["old_code"] == 0
    assert len(during) >= 10, f"only {len(during)} creations while the endpoints lagged"
    assert not refused, refused[:3]
    assert all(o["sidecar"] for o in outcomes), "a pod was admitted without its sidecar"
    # The control: replica b runs without a shutdown delay.
    t, outcomes = roll_under_creations(e2e, "webhook-c", "10.250.0.22")
    refused = [o for o in outcomes if not o["ok"]]
    e2e.figures["webhook_roll_without_delay"] = {"creations": len(outcomes), "refused": len(refused),
                                                 "refused_for_s": round(max(o["t"] for o in refused) - min(
                                                     o["t"] for o in refused), 2) if refused else 0}
    assert refused, "the roll without a shutdown delay refused no pod: the harness cannot see refusals"
    # Refused: only creations that overlapped the time from the old
    # replica's SIGTERM to its leaving the endpoints (a creation calls
    # Lanyard's webhook twice, reinvoked after the mesh's, so one begun
    # just before the SIGTERM can meet it).
    assert all(o["end"] >= t["sigterm"] and o["t"] <= t["dropped"] + 0.1 for o in refused), refused[:3]
    assert all(o["sidecar"] for o in outcomes if o["ok"])


def test_a_deleted_pod_stops_getting_credentials(e2e):
    _, worker = ray_templates()
    pod = e2e.run_pod(e2e.nodes[0], worker, "ray-data-worker-del", "ray")
    assert_all_ok_and_owned(e2e, run_app(e2e, pod, "--clouds", "azure,aws"), IDENTITIES[0])
    e2e.kube.delete("pods", "ray", pod.name)
    deleted = time.time()

    def refused():
        lines = run_app(e2e, pod, "--clouds", "azure,aws")
        return all(not line["ok"] for line in lines) and lines
    lines = wait_for(refused, "the deleted pod is refused", timeout=30, interval=0.5)
    e2e.figures["deleted_pod_refused_after_s"] = round(lines[-1]["t"] - deleted, 2)
    assert all("pod" in line["error"] for line in lines), lines
    assert all("access_token" not in line["error"] for line in lines), lines


def test_transparent_mode_serves_clients_that_only_know_169_254_169_254(e2e):
    node = e2e.nodes[0]
    opted = e2e.run_pod(node, plain_template("scripts", {"lanyard.dev/transparent": "true"}), "legacy-0", "legacy")
    plain = e2e.run_pod(node, plain_template("scripts"), "legacy-1", "legacy")
    names = [c["name"] for c in opted.spec["initContainers"]]
    assert names[:2] == ["lanyard-redirect", "lanyard"], names
    assert [c["name"] for c in plain.spec.get("initContainers", [])] == ["lanyard"]
    want = expected(IDENTITIES[2])
    app = opted.app_containers()[0]
    curl = ["curl", "-sS", "--fail", "--max-time", "5"]
    # AWS IMDSv2 with curl.
    token = opted.exec(app, [*curl, "-X", "PUT", "-H", "X-aws-ec2-metadata-token-ttl-seconds: 60",
                             "http://169.254.169.254/latest/api/token"])
    assert token.returncode == 0, token.stderr
    role = opted.exec(app, [*curl, "-H", f"X-aws-ec2-metadata-token: {token.stdout}",
                            "http://169.254.169.254/latest/meta-data/iam/security-credentials/"])
    assert role.returncode == 0, role.stderr
    creds = opted.exec(app, [*curl, "-H", f"X-aws-ec2-metadata-token: {token.stdout}",
                             f"http://169.254.169.254/latest/meta-data/iam/security-credentials/{role.stdout.strip()}"])
    assert creds.returncode == 0, creds.stderr
    assert e2e.whose({"cloud": "aws", "credential": json.loads(creds.stdout)["AccessKeyId"]}) == want["aws"]
    # Azure IMDS with curl.
    azure = opted.exec(app, [*curl, "-H", "Metadata: true", "http://169.254.169.254/metadata/identity/oauth2/token"
                             "?api-version=2018-02-01&resource=https://storage.azure.com/"])
    assert azure.returncode == 0, azure.stderr
    assert e2e.whose({"cloud": "azure", "credential": json.loads(azure.stdout)["access_token"]}) == want["azure"]
    # google-auth with no GCE_METADATA_* variable: metadata.google.internal
    # through the pod's hostAliases, then the redirect.
    script = ("import os\n"
              "[os.environ.pop(k) for k in list(os.environ) if k.startswith('GCE_METADATA')]\n"
              "import google.auth, google.auth.transport.requests\n"
              "c, _ = google.auth.default()\n"
              "c.refresh(google.auth.transport.requests.Request())\n"
              "print(c.token)\n")
    from kubelet import SDK_PYTHON
    google = opted.exec(app, [SDK_PYTHON, "-c", script])
    assert google.returncode == 0, google.stderr
    assert e2e.whose({"cloud": "gcp", "credential": google.stdout.strip()}) == want["gcp"]
    # Without the annotation nothing is redirected: the node's own IMDS
    # answers, with the node pool's identity, not the pod's (this namespace
    # is not one whose egress to IMDS the chart blocks).
    miss = plain.exec(plain.app_containers()[0], [*curl, "--max-time", "3", "-H", "Metadata: true",
                                                  "http://169.254.169.254/metadata/identity/oauth2/token"
                                                  "?api-version=2018-02-01&resource=https://storage.azure.com/"])
    assert miss.returncode == 0, miss.stderr
    node_identity = next(i for i in IDENTITIES if "azure_app_client_id" in i)["azure_client_id"]
    assert e2e.whose({"cloud": "azure", "credential": json.loads(miss.stdout)["access_token"]}) == \
        f"{TENANT}/{node_identity}"


def imds_curl(pod: Pod, client_id: str) -> subprocess.CompletedProcess:
    return pod.exec(pod.app_containers()[0], [
        "curl", "-sS", "--max-time", "3", "-H", "Metadata: true",
        "http://169.254.169.254/metadata/identity/oauth2/token?api-version=2018-02-01"
        f"&resource=https://storage.azure.com/&client_id={client_id}"])


def test_a_governed_pod_cannot_reach_the_nodes_imds_itself(e2e):
    """The node pool's identity is reachable at the node's IMDS by any pod
    whose egress is not blocked: the chart's NetworkPolicy blocks it in the
    namespaces listed (guard.imdsEgress), so that only Lanyard's agent, under
    its policy, hands it out."""
    operator = next(i for i in IDENTITIES if "azure_app_client_id" in i)
    # Ungoverned: a pod takes the node identity's token around Lanyard.
    legacy = e2e.run_pod(e2e.nodes[0], plain_template("scripts"), "imds-legacy", "legacy")
    got = imds_curl(legacy, operator["azure_client_id"])
    assert got.returncode == 0 and "access_token" in got.stdout, (got.stdout, got.stderr)
    assert e2e.kube.whois(json.loads(got.stdout)["access_token"])["principal"] == \
        f"{TENANT}/{operator['azure_client_id']}"
    # Governed: the same request never arrives.
    governed = governed_pod(e2e)
    blocked = imds_curl(governed, operator["azure_client_id"])
    assert blocked.returncode == 28 and "access_token" not in blocked.stdout, (blocked.stdout, blocked.stderr)


def own_token_template(service_account: str, audience: str) -> dict:
    """A pod that projects its own token for `audience` into its app, as a
    pod author going around Lanyard would (no inject label)."""
    template = plain_template(service_account)
    del template["metadata"]["labels"]["lanyard.dev/inject"]
    template["spec"]["volumes"] = [{"name": "aws-token", "projected": {"sources": [
        {"serviceAccountToken": {"audience": audience, "expirationSeconds": 3600, "path": "token"}}]}}]
    template["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "aws-token", "mountPath": "/var/run/secrets/eks.amazonaws.com/serviceaccount", "readOnly": True}]
    return template


def governed_pod(e2e: E2E) -> Pod:
    """The injected pod of the governed namespace, run once."""
    found = [p for p in e2e.pods if p.namespace == "governed" and p.name == "builder-0"]
    return found[0] if found else e2e.run_pod(e2e.nodes[1], plain_template("builder"), "builder-0", "governed")


def test_the_guard_refuses_a_pods_own_cloud_token_only_in_a_governed_namespace(e2e):
    node = e2e.nodes[1]
    # The ValidatingAdmissionPolicy runs before the validating webhooks and
    # refuses first, in the API server's words.
    with pytest.raises(Refused) as refused:
        e2e.run_pod(node, own_token_template("builder", "sts.amazonaws.com"), "own-token", "governed")
    assert refused.value.webhook == "lanyard-guard", refused.value
    assert refused.value.status["code"] == 403
    message = refused.value.status["message"]
    assert message.startswith('pods "own-token" is forbidden: ValidatingAdmissionPolicy \'lanyard-guard\' with '
                              "binding 'lanyard-guard' denied request: lanyard guard (cloud-token-mount): container app"), \
        message
    # Without the policy (guard.admissionPolicy off), the guard's webhook
    # refuses the same pod.
    binding = find(e2e.objects, "ValidatingAdmissionPolicyBinding", "lanyard-guard")
    assert e2e.kube.control("DELETE", "/admission/ValidatingAdmissionPolicyBinding/lanyard-guard").status == 200
    try:
        with pytest.raises(Refused) as refused:
            e2e.run_pod(node, own_token_template("builder", "sts.amazonaws.com"), "own-token", "governed")
        assert refused.value.webhook == "guard.lanyard.dev"
        assert refused.value.status["code"] == 403
        assert "cloud-token-mount" in refused.value.status["message"]
        assert 'container "app"' in refused.value.status["message"]
    finally:
        e2e.kube.apply(binding)
    # Ungoverned, the same pod is admitted (and runs with its own token).
    own = e2e.run_pod(node, own_token_template("scripts", "sts.amazonaws.com"), "own-token", "legacy")
    token = own.exec(own.app_containers()[0], ["cat", "/var/run/secrets/eks.amazonaws.com/serviceaccount/token"])
    assert token.returncode == 0 and token.stdout.startswith("eyJ"), token.stderr
    # An injected pod in the governed namespace is admitted and served.
    pod = governed_pod(e2e)
    lines = run_app(e2e, pod, "--clouds", "aws")
    assert_all_ok_and_owned(e2e, lines, IDENTITIES[3])
    calls = e2e.kube.webhook_calls()
    assert "guard.lanyard.dev CREATE" in calls and "ValidatingAdmissionPolicy lanyard-guard CREATE" in calls


def test_kubectl_on_a_governed_pod_debugs_and_labels_but_cannot_reach_the_tokens(e2e):
    """kubectl itself, against the API server: a plain `kubectl debug` and
    `kubectl label` are admitted on the stored pod; a debug container that
    mounts the token volume, or traces the sidecar (the general profile's
    SYS_PTRACE with --target=lanyard), and an image swapped on the sidecar
    are refused."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed here")
    pod = governed_pod(e2e)
    name = ["-n", "governed", "pod/builder-0"]
    plain = e2e.kube.kubectl("debug", *name, "--image=busybox:1.36", "--target=app", "--profile=legacy")
    assert plain.returncode == 0, plain.stderr
    labelled = e2e.kube.kubectl("label", *name, "team=data")
    assert labelled.returncode == 0, labelled.stderr
    traced = e2e.kube.kubectl("debug", *name, "--image=busybox:1.36", "--target=lanyard", "--profile=general")
    assert traced.returncode != 0 and "lanyard guard (process-access)" in traced.stderr, traced.stderr
    custom = e2e.workdir / "debug-mounts.json"
    custom.write_text(json.dumps({"volumeMounts": [{"name": "lanyard-tokens", "mountPath": "/stolen"}]}))
    stolen = e2e.kube.kubectl("debug", *name, "--image=busybox:1.36", "--profile=legacy", f"--custom={custom}")
    assert stolen.returncode != 0 and "lanyard guard (cloud-token-mount)" in stolen.stderr, stolen.stderr
    swapped = e2e.kube.kubectl("set", "image", *name, "lanyard=attacker.example/lanyard:1")
    assert swapped.returncode != 0 and "lanyard guard (cloud-token-mount)" in swapped.stderr, swapped.stderr
    stored = e2e.kube.api("GET", "/api/v1/namespaces/governed/pods/builder-0").json()
    assert stored["metadata"]["labels"]["team"] == "data"
    debuggers = stored["spec"]["ephemeralContainers"]
    assert len(debuggers) == 1 and debuggers[0]["name"].startswith("debugger-"), debuggers
    assert debuggers[0]["targetContainerName"] == "app" and "securityContext" not in debuggers[0]
    # The running pod still gets its credentials.
    assert_all_ok_and_owned(e2e, run_app(e2e, pod, "--clouds", "aws"), IDENTITIES[3])


def test_a_process_of_the_sidecars_user_cannot_read_its_tokens_through_proc(e2e):
    """Containers that share the sidecar's process namespace (the harness
    runs them all in one, as shareProcessNamespace or hostPID would) see
    its /proc entry; as the sidecar's own uid they still cannot read its
    token volume through /proc/PID/root, nor its memory: it is not
    dumpable."""
    pod = governed_pod(e2e)
    sidecar_pid = pod.processes["lanyard"].proc.pid
    # /var/run is a symlink to /run, which /proc/PID/root would resolve in
    # the reader's root: name the target.
    tokens = f"/proc/{sidecar_pid}/root{os.path.realpath('/var/run')}/lanyard/tokens/aws"
    # The path is right: root (with CAP_SYS_PTRACE) reads the token there.
    with open(tokens) as f:
        assert f.read().startswith("eyJ")
    same_user = copy.deepcopy(pod.app_containers()[0])
    same_user["securityContext"] = {**same_user.get("securityContext", {}), "runAsUser": 65532, "runAsGroup": 65532}
    for path in (tokens, f"/proc/{sidecar_pid}/environ"):
        read = pod.exec(same_user, ["cat", path])
        assert read.returncode != 0 and "eyJ" not in read.stdout, (path, read.stdout[:80])
        assert "Permission denied" in read.stderr, (path, read.stderr)


def first_credential_after(lines: list[dict], started_monotonic: float) -> float:
    """Seconds from `started_monotonic` to the first credential the app got
    (the script's wall clock converted to the harness's monotonic one)."""
    first = min(line["t"] for line in lines if line["ok"])
    return first - (time.time() - (time.monotonic() - started_monotonic))


def test_start_overhead_against_a_pod_without_lanyard(e2e):
    """What a pod's start costs with Lanyard: from the pod's first container
    starting to the app's first AWS credential, for injected pods on a node
    whose agent already holds the credential (a warm node cache), against
    the same app in a pod without Lanyard reading static keys from a file.
    Figures only (speed is judged by bench/start, not here); the test
    checks that both kinds of pod get their credential."""
    samples = int(os.environ.get("LANYARD_START_SAMPLES", "3"))
    node = e2e.nodes[0]
    warm = e2e.run_pod(node, plain_template("scripts"), "start-warm", "legacy")
    assert_all_ok_and_owned(e2e, run_app(e2e, warm, "--clouds", "aws"), IDENTITIES[2])
    with_lanyard, without = [], []
    for i in range(samples):
        pod = e2e.run_pod(node, plain_template("scripts"), f"start-{i}", "legacy")
        proc, out = pod.start_app(pod.app_containers()[0], ["--clouds", "aws"])
        assert proc.proc.wait(timeout=120) == 0, proc.output()
        lines = results(out)
        assert_all_ok_and_owned(e2e, lines, IDENTITIES[2])
        with_lanyard.append(first_credential_after(lines, pod.sidecar_started))
    for i in range(samples):
        # Static keys in a file of the pod's own volume.
        template = plain_template("scripts")
        del template["metadata"]["labels"]["lanyard.dev/inject"]
        template["spec"]["volumes"] = [{"name": "keys", "emptyDir": {}}]
        app = template["spec"]["containers"][0]
        app["volumeMounts"] = [{"name": "keys", "mountPath": "/var/run/keys", "readOnly": True}]
        app["env"] = [{"name": "AWS_SHARED_CREDENTIALS_FILE", "value": "/var/run/keys/credentials"},
                      {"name": "AWS_CONFIG_FILE", "value": "/var/run/keys/config"},
                      {"name": "AWS_EC2_METADATA_DISABLED", "value": "true"}]
        pod = e2e.run_pod(node, template, f"baseline-{i}", "legacy")
        assert not pod.spec.get("initContainers"), "not injected"
        keys = pod.volumes["keys"] / "credentials"
        keys.write_text("[default]\naws_access_key_id = AKIASTATICBASELINE01\n"
                        "aws_secret_access_key = c3RhdGljLWJhc2VsaW5lLXNlY3JldC1rZXktMDE\n")
        keys.chmod(0o644)
        started = time.monotonic()
        proc, out = pod.start_app(pod.app_containers()[0], ["--clouds", "aws"])
        assert proc.proc.wait(timeout=120) == 0, proc.output()
        lines = results(out)
        assert [line["credential"] for line in lines if line["ok"]] == ["AKIASTATICBASELINE01"], lines
        without.append(first_credential_after(lines, started))
    e2e.figures["start_with_lanyard_s"] = [round(x, 3) for x in with_lanyard]
    e2e.figures["start_without_lanyard_s"] = [round(x, 3) for x in without]
