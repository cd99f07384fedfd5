"""Several identities for one ServiceAccount, chosen by the SDK's own
selector and decided by Cedar, against `lanyard dev` with real clients.

The dev ServiceAccount lists three identities per cloud: the shared one
(its default), the `etl` job's and the `train` job's; the dev pod carries
the job label `jobs.example.com/name: etl`. The policy is the shape of
`policies/ray-job-identities`: a job's pods may have only their job's
identity. So the pod gets etl's identity by selecting it and by selecting
nothing, is refused train's with the policy's denial, and an identity the
ServiceAccount does not list is "not found", as it always was.
"""

import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import boto3
import pytest
from azure.core.exceptions import ClientAuthenticationError
from azure.identity import ManagedIdentityCredential

import jwt_check
from conftest import Dev
from test_gcloud import gcloud_env
from test_policy import clean_env, stop  # noqa: F401  (clean_env: a pytest fixture)

STORAGE = "https://storage.azure.com/.default"
TENANT = "3b8e4f60-1c2d-4e5f-8a9b-7c6d5e4f3a2b"
AZURE = {"shared": "5f2c9e1a-8d4b-4c7e-9a13-0d6e2b7f4c21",
         "etl": "0e7d6c5b-4a39-4821-9f0e-1d2c3b4a5f60", "train": "9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d"}
GCP = {"shared": "ray-worker@lanyard-dev.iam.gserviceaccount.com",
       "etl": "job-etl@lanyard-dev.iam.gserviceaccount.com", "train": "job-train@lanyard-dev.iam.gserviceaccount.com"}
AWS = {"shared": "arn:aws:iam::111122223333:role/ray-worker",
       "etl": "arn:aws:iam::111122223333:role/job-etl", "train": "arn:aws:iam::111122223333:role/job-train"}
UNLISTED_CLIENT = "44444444-5555-6666-7777-888888888888"


def identity_uid(cloud: str, account: str, ident: str) -> str:
    return f'CloudIdentity::"{cloud}/{account}/{ident}"'


# A job's pods may have only their job's identity, in every cloud; pods of
# no job only the shared ones.
POLICY = "\n".join(
    [f'''@id("shared-{cloud}")
permit (principal, action in Action::"credential", resource == {identity_uid(cloud, account, ids["shared"])})
unless {{ context.pod.hasTag("jobs.example.com/name") }};
''' for cloud, account, ids in [("azure", TENANT, AZURE), ("gcp", "lanyard-dev", GCP), ("aws", "111122223333", AWS)]]
    + [f'''@id("job-{job}-{cloud}")
permit (principal, action in Action::"credential", resource == {identity_uid(cloud, account, ids[job])})
when {{ context.pod.hasTag("jobs.example.com/name") && context.pod.getTag("jobs.example.com/name") == "{job}" }};
''' for job in ("etl", "train")
       for cloud, account, ids in [("azure", TENANT, AZURE), ("gcp", "lanyard-dev", GCP), ("aws", "111122223333", AWS)]])


@pytest.fixture
def jobs_dev(tmp_path, clean_env):
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "jobs.cedar").write_text(POLICY)
    config = tmp_path / "lanyard.yaml"
    config.write_text(json.dumps({
        "policy": {"dir": str(policies)},
        "dev": {"azure_client_ids": [AZURE["etl"], AZURE["train"]],
                "gcp_service_accounts": [GCP["etl"], GCP["train"]],
                "aws_role_arns": [AWS["etl"], AWS["train"]],
                "pod_labels": {"jobs.example.com/name": "etl", "ray.io/node-type": "worker"}},
    }))
    dev = Dev(["--config", str(config)], tmp_path / "lanyard.log")
    yield dev
    stop(dev)  # exits cleanly; no token or credential in its log


def audited_identities(dev, cloud: str, *wanted: tuple[str, str]) -> list[tuple[str, str]]:
    """(verdict, identity) of each audit record of `cloud`, in order; with
    `wanted`, once they are all there (the log is written after the answer
    is sent), or after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        records = audit_records(dev, cloud)
        if all(w in records for w in wanted) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def audit_records(dev, cloud: str) -> list[tuple[str, str]]:
    """(verdict, identity) of each audit record of `cloud` logged so far."""
    out = []
    for line in dev.read_log().splitlines():
        if "lanyard::audit" not in line or f'cloud="{cloud}"' not in line:
            continue
        verdict = re.search(r' decision="(\w+)"', line)
        ident = re.search(r' identity="([^"]+)"', line)
        if verdict and ident:
            out.append((verdict.group(1), ident.group(1)))
    return out


def test_azure_identity_selects_by_client_id_and_the_policy_decides(jobs_dev, monkeypatch):
    monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", jobs_dev.exports["AZURE_POD_IDENTITY_AUTHORITY_HOST"])
    monkeypatch.setenv("IDENTITY_ENDPOINT", jobs_dev.exports["IDENTITY_ENDPOINT"])
    monkeypatch.setenv("IDENTITY_HEADER", jobs_dev.exports["IDENTITY_HEADER"])
    token = ManagedIdentityCredential(client_id=AZURE["etl"]).get_token(STORAGE)
    jobs_dev.issued.append(token.token)
    assert jwt_check.entra_access_token(token.token)["appid"] == AZURE["etl"]
    # Selecting nothing: the first listed identity the policy allows, etl's
    # (the shared default is not for a job's pods).
    token = ManagedIdentityCredential().get_token(STORAGE)
    jobs_dev.issued.append(token.token)
    assert jwt_check.entra_access_token(token.token)["appid"] == AZURE["etl"]
    with pytest.raises(ClientAuthenticationError) as denied:
        ManagedIdentityCredential(client_id=AZURE["train"]).get_token(STORAGE)
    assert "Denied by Lanyard policy" in str(denied.value), str(denied.value)
    with pytest.raises(ClientAuthenticationError) as missing:
        ManagedIdentityCredential(client_id=UNLISTED_CLIENT).get_token(STORAGE)
    assert "Denied by Lanyard policy" not in str(missing.value)
    assert re.search(r"not found|not bound|unknown", str(missing.value), re.I), str(missing.value)
    records = audited_identities(jobs_dev, "azure", ("allow", AZURE["etl"]), ("deny", AZURE["train"]))
    assert ("allow", AZURE["etl"]) in records and ("deny", AZURE["train"]) in records, records
    assert not any(ident == AZURE["shared"] and verdict == "allow" for verdict, ident in records), records


def test_boto3_gets_the_jobs_role_from_the_container_endpoint_and_imds_lists_it(jobs_dev, monkeypatch):
    for name in ("AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", "AWS_REGION", "AWS_DEFAULT_REGION",
                 "AWS_ENDPOINT_URL_STS"):
        monkeypatch.setenv(name, jobs_dev.exports[name])
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    session = boto3.Session()
    frozen = session.get_credentials().get_frozen_credentials()
    jobs_dev.issued.append(frozen.secret_key)
    arn = session.client("sts").get_caller_identity()["Arn"]
    assert arn.startswith("arn:aws:sts::111122223333:assumed-role/job-etl/"), arn
    # IMDS lists one role, the one selecting nothing gets; asking for the
    # train job's by name is the policy's 403, an unlisted one IMDS's 404.
    base = jobs_dev.exports["AWS_EC2_METADATA_SERVICE_ENDPOINT"].rstrip("/")
    put = urllib.request.Request(base + "/latest/api/token", method="PUT",
                                 headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
    imds_token = urllib.request.urlopen(put, timeout=5).read().decode()

    def get(path):
        req = urllib.request.Request(base + path, headers={"X-aws-ec2-metadata-token": imds_token})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    roles = "/latest/meta-data/iam/security-credentials/"
    assert get(roles) == (200, "job-etl")
    status, body = get(roles + "job-etl")
    assert status == 200 and json.loads(body)["Code"] == "Success"
    jobs_dev.issued.append(json.loads(body)["SecretAccessKey"])
    assert get(roles + "job-train")[0] == 403
    assert get(roles + "not-listed")[0] == 404
    records = audited_identities(jobs_dev, "aws", ("allow", AWS["etl"]), ("deny", AWS["train"]))
    assert ("allow", AWS["etl"]) in records and ("deny", AWS["train"]) in records, records


def test_gcloud_sees_the_allowed_accounts_and_selects_one(jobs_dev, tmp_path):
    base = jobs_dev.exports["GCE_METADATA_ROOT"]
    req = urllib.request.Request(f"http://{base}/computeMetadata/v1/instance/service-accounts/",
                                 headers={"Metadata-Flavor": "Google"})
    listing = urllib.request.urlopen(req, timeout=10).read().decode().split()
    assert listing == ["default/", f"{GCP['etl']}/"], listing
    gcloud, env = gcloud_env(jobs_dev, tmp_path)
    out = subprocess.run([gcloud, "auth", "list", "--format=value(account)"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert GCP["etl"] in out.stdout and GCP["train"] not in out.stdout, out.stdout
    out = subprocess.run([gcloud, "auth", "print-identity-token", f"--account={GCP['etl']}",
                          "--audiences=https://svc.example.com", "--token-format=full"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    token = out.stdout.strip()
    jobs_dev.issued.append(token)
    assert jwt_check.payload(token)["email"] == GCP["etl"]
    records = audited_identities(jobs_dev, "gcp", ("allow", GCP["etl"]))
    assert records and all(r == ("allow", GCP["etl"]) for r in records), records


def node_env(dev, tmp_path) -> dict:
    from test_node_clients import client_env
    return client_env(dev.exports, tmp_path)


def node(script: str, *args, env: dict) -> subprocess.CompletedProcess:
    from test_node_clients import NODE, NODE_DIR
    if NODE is None or not (NODE_DIR / "node_modules").is_dir():
        pytest.skip("node or tests/node/node_modules is missing (scripts/test installs them)")
    return subprocess.run([NODE, str(NODE_DIR / script), *args], cwd=NODE_DIR, env=env,
                          capture_output=True, text=True, timeout=120)


def test_node_sdks_select_by_their_own_options(jobs_dev, tmp_path):
    env = node_env(jobs_dev, tmp_path)
    out = node("azure.mjs", "managed-identity-select", AZURE["etl"], env=env)
    assert out.returncode == 0, out.stderr
    token = json.loads(out.stdout.splitlines()[-1])["token"]
    jobs_dev.issued.append(token)
    assert jwt_check.entra_access_token(token)["appid"] == AZURE["etl"]
    out = node("azure.mjs", "managed-identity-select", AZURE["train"], env=env)
    assert out.returncode == 1 and "Denied by Lanyard policy" in out.stderr, out.stderr
    out = node("azure.mjs", "managed-identity-select", UNLISTED_CLIENT, env=env)
    assert out.returncode == 1 and "Denied by Lanyard policy" not in out.stderr, out.stderr
    assert re.search(r"not found", out.stderr, re.I), out.stderr

    out = node("google.mjs", "compute-select", GCP["etl"], "https://svc.example.com", env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    jobs_dev.issued += [got["token"], got["idToken"]]
    assert jwt_check.payload(got["idToken"])["email"] == GCP["etl"]
    out = node("google.mjs", "compute-select", GCP["train"], "https://svc.example.com", env=env)
    assert out.returncode == 1 and "403" in out.stderr, out.stderr
    out = node("google.mjs", "compute-select", "nobody@lanyard-dev.iam.gserviceaccount.com",
               "https://svc.example.com", env=env)
    assert out.returncode == 1 and "404" in out.stderr, out.stderr
    records = audited_identities(jobs_dev, "gcp", ("allow", GCP["etl"]), ("deny", GCP["train"]))
    assert ("allow", GCP["etl"]) in records and ("deny", GCP["train"]) in records, records


# The managed-identity-to-app hop: the dev identity, a managed identity
# assigned to the (emulated) node pool, is trusted by a multi-tenant app
# provisioned in another tenant; SDKs that ask for the identity get the
# app's token in that tenant. The identity's own token comes from the
# node's IMDS: Entra refuses one obtained through its federated credential
# as the app's (AADSTS700231), and so does `lanyard dev` up front.
APP = "c0ffee00-1234-4abc-8def-0123456789ab"
RESOURCE_TENANT = "9d8c7b6a-5f4e-4d3c-8b2a-190817263544"


@pytest.fixture
def app_dev(tmp_path, clean_env):
    # A node identity is served only under a policy that permits it.
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "app.cedar").write_text(
        '@id("dev-reaches-the-app")\n'
        'permit (principal == ServiceAccount::"default/ray-worker", action, resource)\n'
        f'when {{ resource.source == "node" && resource has via && resource.via.id == "{AZURE["shared"]}" }};\n')
    config = tmp_path / "lanyard.yaml"
    config.write_text(json.dumps({"dev": {"azure_app_client_id": APP, "azure_app_tenant_id": RESOURCE_TENANT},
                                  "azure": {"node_identities": [AZURE["shared"]]},
                                  "policy": {"dir": str(policies)}}))
    dev = Dev(["--config", str(config)], tmp_path / "lanyard.log")
    yield dev
    stop(dev)


def rust_azure(dev, tmp_path) -> dict | None:
    """azure_identity (Rust) with the pod's environment; None where
    tests/rust-clients is not built."""
    from test_rust_clients import client_binary

    try:
        binary = client_binary()
    except pytest.skip.Exception:
        return None
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TZ")}
    env["HOME"] = str(tmp_path)
    env.update({k: v for k, v in dev.exports.items() if k != "AWS_ENDPOINT_URL_STS"})
    out = subprocess.run([str(binary), "azure"], env=env, capture_output=True, text=True, timeout=60)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0 and result["ok"], out.stdout + out.stderr
    return result


def test_azure_sdks_get_the_apps_token_in_its_tenant_through_the_node_identity(app_dev, tmp_path, monkeypatch):
    for name in ("AZURE_POD_IDENTITY_AUTHORITY_HOST", "IDENTITY_ENDPOINT", "IDENTITY_HEADER", "AZURE_CLIENT_ID"):
        monkeypatch.setenv(name, app_dev.exports[name])
    # The webhook's environment names the managed identity, as it always has.
    assert app_dev.exports["AZURE_CLIENT_ID"] == AZURE["shared"]
    token = ManagedIdentityCredential(client_id=os.environ["AZURE_CLIENT_ID"]).get_token(STORAGE)
    app_dev.issued.append(token.token)
    claims = jwt_check.entra_access_token(token.token)
    assert (claims["appid"], claims["tid"]) == (APP, RESOURCE_TENANT), claims
    out = node("azure.mjs", "managed-identity-client-id", env=node_env(app_dev, tmp_path))
    assert out.returncode == 0, out.stderr
    token = json.loads(out.stdout.splitlines()[-1])["token"]
    app_dev.issued.append(token)
    claims = jwt_check.entra_access_token(token)
    assert (claims["appid"], claims["tid"]) == (APP, RESOURCE_TENANT), claims
    rust = rust_azure(app_dev, tmp_path)
    if rust is not None:
        app_dev.issued.append(rust["token"])
        claims = jwt_check.entra_access_token(rust["token"])
        assert (claims["appid"], claims["tid"]) == (APP, RESOURCE_TENANT), claims
    # Every record names the app (the file record also the identity and
    # both tenants: src/audit/credential_record.rs).
    records = [line for line in app_dev.read_log().splitlines()
               if "lanyard::audit" in line and "credential issued" in line]
    assert records, app_dev.read_log()
    for line in records:
        assert f'identity="{APP}"' in line, line


def dev_refusing(tmp_path, config: dict) -> subprocess.CompletedProcess:
    """`lanyard dev` with `config` (and no LANYARD_ variable), which must
    refuse to start: its output."""
    from conftest import lanyard_binary

    path = tmp_path / "lanyard.yaml"
    path.write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LANYARD_")}
    out = subprocess.run([lanyard_binary(), "dev", "--config", str(path)], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0, out.stdout
    return out


def test_dev_refuses_an_app_reached_through_a_federated_identity(tmp_path, clean_env):
    """Without the identity on the node, Entra would refuse the hop
    (AADSTS700231): `lanyard dev` says so and does not start."""
    out = dev_refusing(tmp_path, {"dev": {"azure_app_client_id": APP}})
    assert "dev.azure_app_client_id" in out.stderr and "AADSTS700231" in out.stderr, out.stderr
    assert "azure.node_identities" in out.stderr, out.stderr


# A node-assigned identity's own tokens, brokered per pod: nothing of the
# pod's is sent upstream, so the policy is what decides which pods may use
# it (resource.source == "node").
NODE_POLICY = """@id("node-identities-for-labelled-pods")
forbid (principal, action, resource)
when { resource.source == "node" }
unless { context.pod.hasTag("azure.example.com/node-identity") };

@id("everything-else")
permit (principal, action, resource);
"""


def node_dev(tmp_path, labels: dict) -> Dev:
    policies = tmp_path / "policies"
    policies.mkdir(exist_ok=True)
    (policies / "node.cedar").write_text(NODE_POLICY)
    config = tmp_path / f"lanyard-{len(labels)}.yaml"
    config.write_text(json.dumps({"policy": {"dir": str(policies)}, "azure": {"node_identities": [AZURE["shared"]]},
                                  "audit": {"file": str(tmp_path / f"audit-{len(labels)}.jsonl")},
                                  "dev": {"pod_labels": labels}}))
    return Dev(["--config", str(config)], tmp_path / f"lanyard-{len(labels)}.log")


def test_a_node_identitys_own_tokens_are_decided_per_pod_and_audited(tmp_path, clean_env, monkeypatch):
    refused = node_dev(tmp_path, {})
    try:
        for name in ("IDENTITY_ENDPOINT", "IDENTITY_HEADER", "AZURE_CLIENT_ID"):
            monkeypatch.setenv(name, refused.exports[name])
        with pytest.raises(ClientAuthenticationError) as err:
            ManagedIdentityCredential(client_id=os.environ["AZURE_CLIENT_ID"]).get_token(STORAGE)
        assert "node-identities-for-labelled-pods" in str(err.value), err.value
    finally:
        stop(refused)
    allowed = node_dev(tmp_path, {"azure.example.com/node-identity": "true"})
    try:
        for name in ("IDENTITY_ENDPOINT", "IDENTITY_HEADER", "AZURE_CLIENT_ID"):
            monkeypatch.setenv(name, allowed.exports[name])
        token = ManagedIdentityCredential(client_id=os.environ["AZURE_CLIENT_ID"]).get_token(STORAGE)
        allowed.issued.append(token.token)
        claims = jwt_check.entra_access_token(token.token)
        assert claims["appid"] == AZURE["shared"], claims
        # The audit file's record says where the credential came from.
        records = [json.loads(line) for line in (tmp_path / "audit-1.jsonl").read_text().splitlines()]
        issued = [r for r in records if r.get("type") == "credential" and r["decision"]["verdict"] == "allow"]
        assert issued, records
        assert all(r["request"]["source"] == "node" and r["request"]["identity"] == AZURE["shared"]
                   for r in issued), issued
    finally:
        stop(allowed)
    denied = [json.loads(line) for line in (tmp_path / "audit-0.jsonl").read_text().splitlines()]
    denied = [r for r in denied if r.get("type") == "credential"]
    assert denied and all(r["decision"]["verdict"] == "deny" and r["request"]["source"] == "node"
                          for r in denied), denied


# AKS identity bindings: every federated identity's token comes through the
# cluster's identity-binding proxy (emulated by `lanyard dev` on a TLS
# listener of its own, with a cluster CA of its own), which checks the
# ServiceAccount's RBAC grant and presents the identity's one
# `aks-identity-binding` credential to Entra: the pod's token, for
# api://AKSIdentityBinding, never reaches Entra.
IB_SNI = "a7q3k1m0x9.ests.aks"


def test_azure_sdks_get_the_identitys_token_through_the_identity_binding_proxy(tmp_path, clean_env, monkeypatch):
    config = tmp_path / "ib.yaml"
    config.write_text(json.dumps({"azure": {"identity_binding_sni": IB_SNI, "audience": "api://AKSIdentityBinding"},
                                  "audit": {"file": str(tmp_path / "ib-audit.jsonl")}}))
    dev = Dev(["--config", str(config)], tmp_path / "ib.log")
    try:
        # The pod's Azure token is for the proxy's audience (the file
        # appears as the kubelet would write it, shortly after start).
        token_file = Path(dev.token_dir) / "azure"
        deadline = time.monotonic() + 10
        while not token_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        pod_token = token_file.read_text()
        assert jwt_check.payload(pod_token)["aud"] in ("api://AKSIdentityBinding", ["api://AKSIdentityBinding"])
        for name in ("AZURE_POD_IDENTITY_AUTHORITY_HOST", "IDENTITY_ENDPOINT", "IDENTITY_HEADER", "AZURE_CLIENT_ID"):
            monkeypatch.setenv(name, dev.exports[name])
        token = ManagedIdentityCredential(client_id=os.environ["AZURE_CLIENT_ID"]).get_token(STORAGE)
        dev.issued.append(token.token)
        claims = jwt_check.entra_access_token(token.token)
        assert claims["appid"] == AZURE["shared"], claims
        out = node("azure.mjs", "managed-identity-client-id", env=node_env(dev, tmp_path))
        assert out.returncode == 0, out.stderr
        token = json.loads(out.stdout.splitlines()[-1])["token"]
        dev.issued.append(token)
        assert jwt_check.entra_access_token(token)["appid"] == AZURE["shared"]
        rust = rust_azure(dev, tmp_path)
        if rust is not None:
            dev.issued.append(rust["token"])
            assert jwt_check.entra_access_token(rust["token"])["appid"] == AZURE["shared"]
    finally:
        stop(dev)
    records = [json.loads(line) for line in (tmp_path / "ib-audit.jsonl").read_text().splitlines()]
    issued = [r for r in records if r.get("type") == "credential" and r["decision"]["verdict"] == "allow"]
    assert issued, records
    assert all(r["request"]["source"] == "identity-binding" for r in issued), issued


def test_dev_refuses_identity_bindings_for_another_audience(tmp_path, clean_env):
    """The proxy takes tokens for api://AKSIdentityBinding only: a
    configuration that would send it another is refused at start."""
    out = dev_refusing(tmp_path, {"azure": {"identity_binding_sni": IB_SNI}})
    assert "azure.audience" in out.stderr and "api://AKSIdentityBinding" in out.stderr, out.stderr
