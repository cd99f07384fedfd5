"""AKS identity bindings end to end: the chart with `azure.identityBinding`,
the agent exchanging each pod's own token (audience
`api://AKSIdentityBinding`) at the identity-binding proxy on the API
server's address, told apart by its TLS server name and trusted through
the cluster CA the kubelet gives the agent, and the proxy letting a
ServiceAccount use an identity only when a ClusterRoleBinding grants it
`use-managed-identity`, as Microsoft Learn's how-to writes the grant
(tests/fake-kube/src/rbac.rs). Entra trusts each identity only through the
one `aks-identity-binding` credential AKS creates: no per-ServiceAccount
credential exists, so every token here came through the proxy.

Skipped, with the reason, only where the machine cannot create network
namespaces."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from chart import wait_for
from conftest import ROOT
from kubelet import can_create_namespaces
from test_pods import (IDENTITIES, assert_all_ok_and_owned, expected, plain_template, ray_templates, run_app,
                       running_e2e, use_managed_identity)

REASON = can_create_namespaces()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"pods end to end: {REASON}")

SNI = "e2e-4k7q2.ests.aks"
IMAGE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp"}


@pytest.fixture(scope="module")
def bound():
    yield from running_e2e(figures_name="pods-identity-binding-figures.json", identity_binding=SNI)


def audit_records(e2e, node: str, namespace: str, name: str) -> list[dict]:
    audit = e2e.workdir / f"agent-{node}" / "volumes" / "audit" / "audit.jsonl"
    return [r for r in map(json.loads, audit.read_text().splitlines())
            if r["type"] == "credential" and r.get("caller", {}).get("namespace") == namespace
            and r.get("caller", {}).get("service_account") == name]


def test_sdks_in_a_governed_ray_pod_get_the_identitys_token_through_the_proxy(bound):
    _, worker = ray_templates()
    ray = IDENTITIES[0]
    pod = bound.run_pod(bound.nodes[0], worker, "ray-ib-worker-0", "ray")
    # azure-identity in Python beside the other clouds, unchanged by the binding.
    assert_all_ok_and_owned(bound, run_app(bound, pod, "--clouds", "azure,gcp,aws"), ray)
    app = pod.app_containers()[0]
    # @azure/identity and the Rust SDK, with nothing but the pod's environment.
    node = shutil.which("node")
    if node and (ROOT / "tests/node/node_modules").is_dir():
        out = pod.exec(app, [node, str(ROOT / "tests/node/azure.mjs"), "managed-identity-client-id"],
                       image_env=IMAGE_ENV)
        assert out.returncode == 0, out.stderr
        token = json.loads(out.stdout.splitlines()[-1])["token"]
        assert bound.kube.whois(token)["principal"] == expected(ray)["azure"]
    rust = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "debug" / "lanyard-rust-clients"
    if rust.exists():
        out = pod.exec(app, [str(rust), "azure"], image_env=IMAGE_ENV)
        assert out.returncode == 0, out.stdout + out.stderr
        token = json.loads(out.stdout.splitlines()[-1])["token"]
        assert bound.kube.whois(token)["principal"] == expected(ray)["azure"]
    # The agent names the path in its audit trail.
    records = [r for r in audit_records(bound, "node-a", "ray", "ray-worker")
               if r["request"].get("cloud") == "azure"]
    assert records and all(r["request"]["source"] == "identity-binding" for r in records), records


def test_a_service_account_without_a_grant_is_refused_until_a_clusterrolebinding_grants_it(bound):
    etl = IDENTITIES[1]
    # Annotated with etl-runner's identity; RBAC grants it nothing yet.
    bound.kube.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {
        "name": "newcomer", "namespace": "etl", "annotations": {
            "azure.workload.identity/client-id": etl["azure_client_id"]}}})
    pod = bound.run_pod(bound.nodes[1], plain_template("newcomer"), "newcomer-0", "etl")
    (line,) = run_app(bound, pod, "--clouds", "azure")
    assert not line["ok"], line
    # The proxy's RBAC refusal reaches the SDK, naming what is missing.
    assert "use-managed-identity" in line["error"] and "etl/newcomer" in line["error"], line["error"]
    for obj in use_managed_identity(etl["azure_client_id"], "etl", "newcomer"):
        bound.kube.apply(obj)
    granted = []

    def served():
        (again,) = run_app(bound, pod, "--clouds", "azure")
        granted[:] = [again]
        return again["ok"]

    # The agent holds a refusal briefly (its negative cache), then asks again.
    wait_for(served, "the grant takes effect", timeout=60)
    assert bound.whose(granted[0]) == expected(etl)["azure"]
    # Deleting the binding takes the grant away for new exchanges: a scope
    # not cached yet is refused again.
    start = time.monotonic()
    bound.kube.delete("clusterrolebindings", "-", f"use-mi-{etl['azure_client_id']}-etl-newcomer")
    (line,) = run_app(bound, pod, "--clouds", "azure", "--azure-scope", "https://vault.azure.net/.default")
    assert not line["ok"] and "use-managed-identity" in line["error"], (line, time.monotonic() - start)
