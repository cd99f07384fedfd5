"""`lanyard doctor`'s cloud commands, checked by the clouds' own CLIs and
against the setup pages, so that what it prints runs and says what the
docs say.

The doctor runs as a user runs it: the binary, a kubeconfig for the fake
API server (`lanyard-fake-kube`) holding the ServiceAccount, and the
agent's configuration. Then each command it prints goes to the real CLI
where one is installed here: `gcloud` and `aws` (v1) parse every argument
before they ask for credentials, so a command that gets as far as "no
credentials" was accepted by the CLI's own parser, and one it cannot
parse exits 2 (the control cases). `az` is not installable here: its
commands are compared, flag for flag, with docs/setup-azure.md's. The
Kubernetes documents (AKS identity bindings' RBAC grant) are validated
against the Kubernetes schemas. Each trust is also matched with the
template on its setup page, placeholders filled in."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from chart import FakeKube
from conftest import ROOT, lanyard_binary

CLIENT = "22222222-3333-4444-5555-666666666666"
RESOURCE_ID = "/subscriptions/0b1f6471-1bf0-4dda-aec3-111122223333/resourceGroups/rg-ml/providers/Microsoft.ManagedIdentity/userAssignedIdentities/mi-ray"
GSA = "reader@analytics-prod.iam.gserviceaccount.com"
ROLE = "arn:aws:iam::111122223333:role/ray/reader"
TARGET = "arn:aws:iam::444455556666:role/data-lake"
PROVIDER = "//iam.googleapis.com/projects/123456789012/locations/global/workloadIdentityPools/fleet/providers/aks-weu"
GCLOUD = shutil.which("gcloud")
AWS = shutil.which("aws")


@pytest.fixture(scope="module")
def kube(tmp_path_factory):
    fake = FakeKube(tmp_path_factory.mktemp("fake-kube"))
    fake.apply({
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"namespace": "ray", "name": "worker", "annotations": {
            "azure.workload.identity/client-id": CLIENT,
            "lanyard.dev/azure-resource-id": RESOURCE_ID,
            "iam.gke.io/gcp-service-account": GSA,
            "eks.amazonaws.com/role-arn": ROLE,
            "lanyard.dev/aws-target-role-arn": TARGET,
            "lanyard.dev/aws-external-id": "lake-7",
        }},
    })
    yield fake
    fake.stop()


def doctor(kube: FakeKube, tmp_path: Path, config: dict) -> dict:
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LANYARD_", "KUBERNETES_"))}
    env["KUBECONFIG"] = kube.kubeconfig
    proc = subprocess.run([lanyard_binary(), "--config", str(path), "doctor", "serviceaccount", "ray/worker",
                           "--output", "json"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


PROVIDER_CONFIG = {
    "azure": {"tenant_id": "00000000-0000-0000-0000-00000000000a"},
    "gcp": {"workload_identity_provider": PROVIDER, "project_id": "analytics-prod"},
}


@pytest.fixture(scope="module")
def report(kube, tmp_path_factory):
    return doctor(kube, tmp_path_factory.mktemp("doctor"), PROVIDER_CONFIG)


def commands(report: dict, cloud: str) -> list[str]:
    return [c for t in report["trust"] if t["cloud"] == cloud for c in t["commands"]]


def run_gcloud(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, CLOUDSDK_CONFIG=str(tmp_path / "gcloud"), CLOUDSDK_CORE_DISABLE_PROMPTS="1")
    env.pop("CLOUDSDK_CORE_PROJECT", None)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def run_aws(argv: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_CONFIG_FILE="/dev/null", AWS_SHARED_CREDENTIALS_FILE="/dev/null",
               AWS_EC2_METADATA_DISABLED="true", AWS_DEFAULT_REGION="us-east-1")
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


GCLOUD_NO_ACCOUNT = "You do not currently have an active account selected"
AWS_NO_CREDENTIALS = "Unable to locate credentials"


@pytest.mark.skipif(GCLOUD is None, reason="gcloud is not installed here")
def test_gcloud_parses_every_command_the_doctor_prints(report, tmp_path):
    printed = commands(report, "gcp")
    assert any(" add-iam-policy-binding " in c for c in printed), printed
    for line in printed:
        proc = run_gcloud(shlex.split(line), tmp_path)
        assert proc.returncode == 1 and GCLOUD_NO_ACCOUNT in proc.stderr, f"{line}\n{proc.stderr}"
    # The control: an argument gcloud's parser refuses exits 2.
    grant = next(c for c in printed if " add-iam-policy-binding " in c)
    broken = shlex.split(grant.replace("--role", "--rolez"))
    assert run_gcloud(broken, tmp_path).returncode == 2


@pytest.mark.skipif(AWS is None, reason="the aws CLI is not installed here")
def test_aws_parses_every_command_the_doctor_prints(report):
    printed = commands(report, "aws")
    assert sum(" update-assume-role-policy " in c for c in printed) == 2, printed
    for line in printed:
        argv = shlex.split(line)
        proc = run_aws(argv)
        assert proc.returncode == 255 and AWS_NO_CREDENTIALS in proc.stderr, f"{line}\n{proc.stderr}"
        if "--policy-document" in argv:
            json.loads(argv[argv.index("--policy-document") + 1])
    broken = shlex.split(printed[-1].replace("--role-name", "--role-namez"))
    assert run_aws(broken).returncode == 2


def flags(argv: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


def doc_command(page: str, start: str) -> list[str]:
    """The first command in `page`'s ```sh blocks that starts with `start`
    (continuation lines joined)."""
    text = (ROOT / "docs" / page).read_text()
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            if line.strip().startswith(start):
                return shlex.split(line)
    raise AssertionError(f"no `{start}` in docs/{page}")


def template(value: str) -> re.Pattern:
    """A docs value with `<PLACEHOLDERS>` as a pattern."""
    parts = re.split(r"<[A-Z_]+>", value)
    return re.compile("^" + ".+?".join(re.escape(p) for p in parts) + "$")


def test_az_commands_use_the_setup_pages_flags_and_values(report):
    docs = doc_command("setup-azure.md", "az identity federated-credential create")
    (trust,) = [t for t in report["trust"] if t["cloud"] == "azure"]
    create = next(shlex.split(c) for c in trust["commands"] if c.startswith("az identity federated-credential create"))
    assert flags(docs) <= flags(create) <= flags(docs) | {"--subscription"}
    values = dict(zip(create[4::2], create[5::2]))
    assert values["--identity-name"] == "mi-ray" and values["--resource-group"] == "rg-ml"
    assert values["--subject"] == "system:serviceaccount:ray:worker"
    docs_values = dict(zip(docs[4::2], docs[5::2]))
    assert template(docs_values["--subject"]).match(values["--subject"])
    assert values["--audiences"] == docs_values["--audiences"] == "api://AzureADTokenExchange"
    assert values["--issuer"] == report["issuer"]


def test_gcloud_grant_matches_the_setup_page(report):
    docs = doc_command("setup-google.md", "gcloud iam service-accounts add-iam-policy-binding")
    (trust,) = [t for t in report["trust"] if t["cloud"] == "gcp"]
    grant = next(shlex.split(c) for c in trust["commands"] if " add-iam-policy-binding " in c)
    assert flags(docs) <= flags(grant)
    assert template(docs[4]).match(grant[4])
    docs_member = next(a.split("=", 1)[1] for a in docs if a.startswith("--member"))
    member = grant[grant.index("--member") + 1]
    assert template(docs_member).match(member), (docs_member, member)
    assert member.endswith("/subject/system:serviceaccount:ray:worker")


def test_aws_trust_policy_matches_the_setup_page(report):
    text = (ROOT / "docs" / "setup-aws.md").read_text()
    docs_policy = next(json.loads(b) for b in re.findall(r"```json\n(.*?)```", text, re.S)
                       if "sts:AssumeRoleWithWebIdentity" in b)
    (trust, chained) = [t for t in report["trust"] if t["cloud"] == "aws"]
    policy = trust["document"]
    want, got = docs_policy["Statement"][0], policy["Statement"][0]
    assert set(want) == set(got) and want["Action"] == got["Action"] and want["Effect"] == got["Effect"]
    assert template(want["Principal"]["Federated"]).match(got["Principal"]["Federated"])
    want_cond, got_cond = want["Condition"]["StringEquals"], got["Condition"]["StringEquals"]
    for key, value in want_cond.items():
        (match,) = [k for k in got_cond if template(key).match(k)]
        assert template(value).match(got_cond[match]), (key, value, got_cond[match])
    provider = report["issuer"].removeprefix("https://").rstrip("/")
    assert got["Principal"]["Federated"] == f"arn:aws:iam::111122223333:oidc-provider/{provider}"
    # The chained target role trusts the first role, with the external id.
    target = chained["document"]["Statement"][0]
    assert target["Principal"] == {"AWS": ROLE}
    assert target["Condition"] == {"StringEquals": {"sts:ExternalId": "lake-7"}}


def test_gkes_pool_and_identity_bindings_print_their_own_forms(kube, tmp_path):
    import kubernetes_validate

    config = {
        "azure": {"tenant_id": "00000000-0000-0000-0000-00000000000a", "identity_binding_sni": "a7q3k1m0x9.ests.aks",
                  "audience": "api://AKSIdentityBinding"},
        "gcp": {"gke_cluster": "projects/analytics-prod/locations/europe-west4/clusters/ray",
                "project_id": "analytics-prod", "project_number": "123456789012"},
    }
    report = doctor(kube, tmp_path, config)
    (gcp,) = [t for t in report["trust"] if t["cloud"] == "gcp"]
    assert gcp["subject"] == "serviceAccount:analytics-prod.svc.id.goog[ray/worker]"
    docs = (ROOT / "docs" / "setup-google.md").read_text()
    assert "`serviceAccount:<PROJECT_ID>.svc.id.goog[<NAMESPACE>/<SERVICE_ACCOUNT>]`" in docs
    if GCLOUD:
        for line in gcp["commands"]:
            proc = run_gcloud(shlex.split(line), tmp_path)
            assert proc.returncode == 1 and GCLOUD_NO_ACCOUNT in proc.stderr, f"{line}\n{proc.stderr}"
    (azure,) = [t for t in report["trust"] if t["cloud"] == "azure"]
    assert azure["kind"] == "AKS identity binding (Kubernetes RBAC)"
    (line,) = azure["commands"]
    words = shlex.split(line)
    assert words[:2] == ["printf", "%s\\n"] and words[3:] == ["|", "kubectl", "apply", "-f", "-"]
    document = json.loads(words[2])
    assert document == azure["document"]
    for item in document["items"]:
        kubernetes_validate.validate(item, "1.33", strict=True)
    role, binding = document["items"]
    assert role["rules"] == [{"verbs": ["use-managed-identity"], "apiGroups": ["cid.wi.aks.azure.com"], "resources": [CLIENT]}]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "worker", "namespace": "ray"}]


def test_the_charts_agent_configuration_is_what_the_doctor_reads(kube, tmp_path):
    """docs/operations.md's way: the agent's configuration from the
    chart's ConfigMap, as `kubectl get configmap` gives it."""
    from chart import find, render

    objects = render({"cluster": {"name": "test"}, "azure": {"tenantId": "00000000-0000-0000-0000-00000000000a"}})
    config_map = find(objects, "ConfigMap", "lanyard-config")
    path = tmp_path / "agent.yaml"
    path.write_text(config_map["data"]["agent.yaml"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LANYARD_", "KUBERNETES_"))}
    env["KUBECONFIG"] = kube.kubeconfig
    proc = subprocess.run([lanyard_binary(), "--config", str(path), "doctor", "sa", "ray/worker", "--output", "json"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    assert [t["cloud"] for t in report["trust"]][:1] == ["azure"]
