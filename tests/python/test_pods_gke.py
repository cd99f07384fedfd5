"""GKE's own Workload Identity pool end to end: the chart's agent and
webhook with `gcp.gkeCluster`, the clouds holding only the grants GKE
Workload Identity users already have (`serviceAccount:PROJECT.svc.id.goog[NS/KSA]`,
written by the fake API server's clouds for each identity), and real
Google clients in pods with nothing but the pod's environment.

Skipped, with the reason, only where the machine cannot create network
namespaces."""

from __future__ import annotations

import pytest

from kubelet import can_create_namespaces
from test_pods import IDENTITIES, plain_template, ray_templates, run_app, running_e2e

REASON = can_create_namespaces()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"pods end to end: {REASON}")

CLUSTER = "projects/lanyard-e2e/locations/europe-west4/clusters/e2e"
POOL = "lanyard-e2e.svc.id.goog"
PROJECT_NUMBER = "123456789012"


@pytest.fixture(scope="module")
def gke():
    yield from running_e2e(CLUSTER, "pods-gke-figures.json")


def principal(namespace: str, name: str) -> str:
    return (f"principal://iam.googleapis.com/projects/{PROJECT_NUMBER}/locations/global/"
            f"workloadIdentityPools/{POOL}/subject/ns/{namespace}/sa/{name}")


def test_google_auth_and_gcloud_act_as_the_granted_service_account(gke):
    _, worker = ray_templates()
    node = gke.nodes[0]
    before = gke.kube.counts()["gcp"]
    pod = gke.run_pod(node, worker, "ray-gke-worker-0", "ray")
    lines = run_app(gke, pod, "--clouds", "gcp,gcloud")
    assert [line["client"] for line in lines] == ["gcp", "gcloud"]
    assert all(line["ok"] for line in lines), lines
    for line in lines:
        assert gke.whose(line) == IDENTITIES[0]["gcp_service_account"], line["client"]
    after = gke.kube.counts()["gcp"]
    # Every STS exchange went through GKE's pool, for GKE's principal (one
    # per impersonated token: gcloud asks for scopes of its own).
    issued = {p: n - before.get(p, 0) for p, n in after.items() if n != before.get(p, 0)}
    federated = {p: n for p, n in issued.items() if "workloadIdentityPools" in p}
    assert list(federated) == [principal("ray", "ray-worker")], issued
    # The metadata surface reports the cluster's project, as GKE's does.
    app = pod.app_containers()[0]
    sidecar = next(c for c in pod.spec["initContainers"] if c.get("restartPolicy") == "Always")
    port = sidecar["args"][sidecar["args"].index("--listen") + 1].rsplit(":", 1)[1]
    for path, want in [("project/project-id", "lanyard-e2e"), ("project/numeric-project-id", PROJECT_NUMBER),
                       ("universe/universe-domain", "googleapis.com")]:
        probe = pod.exec(app, ["curl", "-sS", "--max-time", "5", "-H", "Metadata-Flavor: Google",
                               f"http://127.0.0.1:{port}/computeMetadata/v1/{path}"])
        assert probe.returncode == 0 and probe.stdout.strip() == want, (path, probe.stdout, probe.stderr)


def test_direct_resource_access_gets_the_federated_token_of_gkes_principal(gke):
    node = gke.nodes[1]
    gke.kube.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {
        "name": "direct", "namespace": "etl", "annotations": {
            # A binding for another cloud only: Google serves the federated principal.
            "azure.workload.identity/client-id": IDENTITIES[1]["azure_client_id"]}}})
    pod = gke.run_pod(node, plain_template("direct"), "direct-0", "etl")
    (line,) = run_app(gke, pod, "--clouds", "gcp")
    assert line["ok"], line
    assert gke.whose(line) == principal("etl", "direct")


def test_an_ungranted_service_account_is_refused_with_googles_error(gke):
    node = gke.nodes[0]
    # Names etl-runner's Google service account, which only
    # serviceAccount:lanyard-e2e.svc.id.goog[etl/etl-runner] may impersonate.
    gke.kube.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {
        "name": "intruder", "namespace": "etl", "annotations": {
            "iam.gke.io/gcp-service-account": IDENTITIES[1]["gcp_service_account"]}}})
    pod = gke.run_pod(node, plain_template("intruder"), "intruder-0", "etl")
    (line,) = run_app(gke, pod, "--clouds", "gcp")
    assert not line["ok"], line
    assert "PERMISSION_DENIED" in line["error"] or "403" in line["error"], line["error"]
