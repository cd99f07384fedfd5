"""The Node.js SDKs, unmodified, against `lanyard dev` and against a separate
`lanyard-sidecar` + `lanyard agent`: @azure/identity, google-auth-library,
gcp-metadata and @aws-sdk/credential-providers (versions pinned in
tests/node/package.json; scripts/test installs them with `npm ci`).

Each scenario runs `node tests/node/<cloud>.mjs SCENARIO` in a fresh process
whose environment is only the inherited basics (PATH, locale, ...) plus the
variables a pod gets (what `lanyard dev` exports, or what the webhook would
inject for the sidecar), minus those a test removes to force one surface.
Nothing names a region, an endpoint or a secret by hand. HOME is a fresh,
empty directory, as in a pod, so a developer's ~/.aws, ~/.azure or gcloud
credentials can never answer instead of Lanyard.

The scripts print one JSON line with what the client got; every credential
they print goes into `dev.issued`, which the fixtures check never appears in
Lanyard's logs.
"""

import json
import os
import re
import shutil
import subprocess
import time

import pytest

import jwt_check
from conftest import ROOT, SDK_VARIABLES, Dev

# The `split` fixture (separate agent and sidecar on top of `lanyard dev`),
# shared with the Python SDKs' sidecar test.
from test_agent_sidecar import split  # noqa: F401  (a pytest fixture)

NODE_DIR = ROOT / "tests" / "node"
NODE = shutil.which("node")

pytestmark = [
    pytest.mark.skipif(NODE is None, reason="node is not installed on this machine"),
    pytest.mark.skipif(
        not (NODE_DIR / "node_modules").is_dir(),
        reason="tests/node/node_modules is missing: run `npm ci --prefix tests/node` (scripts/test does)",
    ),
]

# What a process inherits from the machine, whatever it is; nothing that
# could point an SDK somewhere (no proxies either: the surfaces are loopback).
BASICS = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "TERM",
          "USER", "LOGNAME", "SHELL", "SYSTEMROOT")

# Variables that select App Service over IMDS in @azure/identity (msal-node
# takes IDENTITY_ENDPOINT + IDENTITY_HEADER first, then MSI_ENDPOINT).
APP_SERVICE_VARIABLES = ("IDENTITY_ENDPOINT", "IDENTITY_HEADER", "MSI_ENDPOINT", "MSI_SECRET")
# Variables that select the container endpoint over IMDSv2 in the AWS SDK.
AWS_CONTAINER_VARIABLES = ("AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE")

# The IDENTITY_HEADER the `split` fixture gives its sidecar.
SIDECAR_IDENTITY_HEADER = "split-test-header"

FIVE_MINUTES_MS = 5 * 60 * 1000
FIFTEEN_MINUTES_MS = 15 * 60 * 1000
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def client_env(exports: dict, tmp_path, drop=()) -> dict:
    """The basics, a fresh HOME, and the pod's variables minus `drop`."""
    home = tmp_path / "node-home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k in BASICS and k not in SDK_VARIABLES}
    env["HOME"] = str(home)
    env.update({k: v for k, v in exports.items() if k not in drop})
    return env


def run_node(script: str, *args, env: dict) -> dict:
    out = subprocess.run(
        [NODE, str(NODE_DIR / script), *args],
        cwd=NODE_DIR, env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, f"node {script} {' '.join(args)} exited {out.returncode}:\n{out.stderr}{out.stdout}"
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert lines, f"node {script} printed nothing:\n{out.stderr}"
    return json.loads(lines[-1])


def log_size(path) -> int:
    return path.stat().st_size if path.exists() else 0


def surfaces_since(path, offset: int, timeout: float = 5.0) -> list:
    """The `surface` of every "credential issued" audit line logged to
    `path` from byte `offset` on (waiting briefly for at least one)."""
    deadline = time.time() + timeout
    while True:
        with open(path, "rb") as f:
            f.seek(offset)
            text = ANSI.sub("", f.read().decode(errors="replace"))
        found = [m.group(1) for line in text.splitlines() if "credential issued" in line
                 for m in [re.search(r'\bsurface="?([A-Za-z0-9_]+)', line)] if m]
        if found or time.time() > deadline:
            return found
        time.sleep(0.05)


def check_azure(dev, result, credential: str):
    assert result["credential"] == credential
    jwt_check.entra_access_token(result["token"])
    now_ms = time.time() * 1000
    assert result["expiresOnTimestamp"] > now_ms + FIVE_MINUTES_MS, result
    dev.issued.append(result["token"])


def check_google_access_token(dev, result):
    assert result["client"] == "Compute", result["client"]
    assert result["token"].startswith("ya29."), result["token"][:10]
    assert result["projectId"] == "lanyard-dev"
    assert result["universeDomain"] == "googleapis.com"
    assert result["email"] == "ray-worker@lanyard-dev.iam.gserviceaccount.com"
    assert result["expiryDate"] > time.time() * 1000 + FIVE_MINUTES_MS, result["expiryDate"]
    dev.issued.append(result["token"])


def check_google_id_token(dev, result, audience: str):
    dev.issued.append(result["token"])
    claims = jwt_check.payload(result["token"])
    assert claims["aud"] == audience
    assert claims["exp"] > time.time() + 600


def check_aws(dev, result, feature=None):
    dev.issued += [result["secretAccessKey"], result["sessionToken"]]
    assert result["accessKeyId"].startswith("ASIA"), result["accessKeyId"]
    assert result["sessionToken"]
    assert result["expiration"] > time.time() * 1000 + FIFTEEN_MINUTES_MS, result["expiration"]
    if feature is not None:
        assert feature in result["features"], result["features"]


# -- against `lanyard dev` ---------------------------------------------------

@pytest.mark.parametrize("scenario", ["managed-identity", "managed-identity-client-id"])
def test_azure_managed_identity_over_imds(dev, tmp_path, scenario):
    # Without the App Service variables msal-node falls back to IMDS at
    # AZURE_POD_IDENTITY_AUTHORITY_HOST (it requests the path lower-cased
    # and with a trailing slash: /metadata/identity/oauth2/token/).
    env = client_env(dev.exports, tmp_path, drop=APP_SERVICE_VARIABLES)
    offset = log_size(dev.log_path)
    check_azure(dev, run_node("azure.mjs", scenario, env=env), "ManagedIdentityCredential")
    assert surfaces_since(dev.log_path, offset) == ["azure_imds"]


@pytest.mark.parametrize("scenario", ["managed-identity", "managed-identity-client-id"])
def test_azure_managed_identity_over_app_service(dev, tmp_path, scenario):
    # Every export: IDENTITY_ENDPOINT + IDENTITY_HEADER win.
    env = client_env(dev.exports, tmp_path)
    offset = log_size(dev.log_path)
    check_azure(dev, run_node("azure.mjs", scenario, env=env), "ManagedIdentityCredential")
    assert surfaces_since(dev.log_path, offset) == ["app_service"]


def test_azure_default_credential(dev, tmp_path):
    env = client_env(dev.exports, tmp_path)
    offset = log_size(dev.log_path)
    check_azure(dev, run_node("azure.mjs", "default", env=env), "DefaultAzureCredential")
    assert surfaces_since(dev.log_path, offset) == ["app_service"]


def test_google_auth_access_token_and_project(dev, tmp_path):
    env = client_env(dev.exports, tmp_path)
    offset = log_size(dev.log_path)
    check_google_access_token(dev, run_node("google.mjs", "access-token", env=env))
    assert set(surfaces_since(dev.log_path, offset)) == {"gce"}


@pytest.fixture
def gke_dev(tmp_path):
    """`lanyard dev` with Google through GKE's own pool, in another
    universe."""
    d = Dev([], tmp_path / "lanyard-gke.log", extra_env={
        "LANYARD_GCP_GKE_CLUSTER": "projects/ray-prod-4821/locations/us-central1/clusters/ray",
        "LANYARD_GCP_PROJECT_NUMBER": "310987654321",
        "LANYARD_GCP_UNIVERSE_DOMAIN": "apis-tpczero.goog"})
    yield d
    assert d.stop() == 0, d.read_log()


def test_google_auth_reads_project_and_universe_through_gkes_pool(gke_dev, tmp_path):
    env = client_env(gke_dev.exports, tmp_path)
    result = run_node("google.mjs", "access-token", env=env)
    assert result["token"].startswith("ya29."), result
    assert result["projectId"] == "ray-prod-4821"
    assert result["universeDomain"] == "apis-tpczero.goog"
    assert result["email"] == "ray-worker@lanyard-dev.iam.gserviceaccount.com"


def test_google_auth_id_token_has_requested_audience(dev, tmp_path):
    audience = "https://service.example.com"
    env = client_env(dev.exports, tmp_path)
    offset = log_size(dev.log_path)
    result = run_node("google.mjs", "id-token", audience, env=env)
    assert result["client"] == "IdTokenClient"
    assert result["provider"] == "Compute", "the metadata server's identity endpoint"
    check_google_id_token(dev, result, audience)
    assert set(surfaces_since(dev.log_path, offset)) == {"gce"}


def test_gcp_metadata_detects_and_reads(dev, tmp_path):
    env = client_env(dev.exports, tmp_path)
    result = run_node("google.mjs", "metadata", env=env)
    assert result == {
        "available": True,
        "email": "ray-worker@lanyard-dev.iam.gserviceaccount.com",
        "projectId": "lanyard-dev",
    }


def test_aws_node_provider_chain_uses_container_endpoint(dev, tmp_path):
    env = client_env(dev.exports, tmp_path)
    offset = log_size(dev.log_path)
    check_aws(dev, run_node("aws.mjs", "node-chain", env=env), "CREDENTIALS_HTTP")
    assert surfaces_since(dev.log_path, offset) == ["aws_container"]


@pytest.fixture
def chain_dev(tmp_path):
    """`lanyard dev` whose ServiceAccount chains into a target role in
    another account."""
    d = Dev([], tmp_path / "lanyard-chain.log", extra_env={
        "LANYARD_DEV_AWS_TARGET_ROLE_ARN": "arn:aws:iam::222233334444:role/data-lake",
        "LANYARD_DEV_AWS_EXTERNAL_ID": "lanyard-dev-7f3a"})
    yield d
    assert d.stop() == 0, d.read_log()


@pytest.mark.parametrize("scenario", ["http", "instance-metadata"])
def test_aws_sdk_receives_the_target_roles_credentials(chain_dev, tmp_path, scenario):
    drop = AWS_CONTAINER_VARIABLES if scenario == "instance-metadata" else ()
    env = client_env({k: v for k, v in chain_dev.exports.items() if k != "AWS_ENDPOINT_URL_STS"}, tmp_path, drop)
    result = run_node("aws.mjs", scenario, env=env)
    # Whose they are, asked of the dev STS that issued them.
    import boto3
    sts = boto3.client("sts", endpoint_url=chain_dev.exports["AWS_ENDPOINT_URL_STS"], region_name="us-east-1",
                       aws_access_key_id=result["accessKeyId"], aws_secret_access_key=result["secretAccessKey"],
                       aws_session_token=result["sessionToken"])
    assert sts.get_caller_identity()["Arn"] == \
        "arn:aws:sts::222233334444:assumed-role/data-lake/lanyard-default_ray-worker"
    chain_dev.issued += [result["secretAccessKey"], result["sessionToken"]]


def test_aws_from_http_reads_the_token_file(dev, tmp_path):
    # fromHttp, not fromContainerMetadata: see tests/node/aws.mjs.
    env = client_env(dev.exports, tmp_path)
    offset = log_size(dev.log_path)
    check_aws(dev, run_node("aws.mjs", "http", env=env), "CREDENTIALS_HTTP")
    assert surfaces_since(dev.log_path, offset) == ["aws_container"]


@pytest.mark.parametrize("scenario", ["instance-metadata", "node-chain"])
def test_aws_imdsv2(dev, tmp_path, scenario):
    # Without the container variables: fromInstanceMetadata directly, and
    # the provider chain's fallback to it, both at AWS_EC2_METADATA_SERVICE_ENDPOINT.
    # (The chain calls @smithy's provider directly, which records no
    # CREDENTIALS_IMDS feature; Lanyard's audit line names the surface.)
    env = client_env(dev.exports, tmp_path, drop=AWS_CONTAINER_VARIABLES)
    offset = log_size(dev.log_path)
    feature = "CREDENTIALS_IMDS" if scenario == "instance-metadata" else None
    check_aws(dev, run_node("aws.mjs", scenario, env=env), feature)
    assert surfaces_since(dev.log_path, offset) == ["aws_imds"]


# -- through lanyard-sidecar + lanyard agent ---------------------------------

def sidecar_exports(dev, split) -> dict:
    """What the webhook injects into an app container next to the sidecar:
    the same variables (one source, serve::sdk_env) naming the sidecar's
    loopback address, its IDENTITY_HEADER and the app token file in the
    token directory it reads."""
    dev_host = dev.exports["GCE_METADATA_HOST"]
    sidecar_host = split["base"].removeprefix("http://")
    env = {k: v.replace(dev_host, sidecar_host) for k, v in dev.exports.items()}
    env["IDENTITY_HEADER"] = env["MSI_SECRET"] = SIDECAR_IDENTITY_HEADER
    env["AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"] = os.path.join(dev.token_dir, "app")
    assert not any(dev_host in v for v in env.values())
    return env


# name: (script, arguments, variables removed, surface the agent audits)
SIDECAR_SCENARIOS = {
    "azure-imds": ("azure.mjs", ["managed-identity"], APP_SERVICE_VARIABLES, "azure_imds"),
    "azure-app-service": ("azure.mjs", ["managed-identity"], (), "app_service"),
    "google-access-token": ("google.mjs", ["access-token"], (), "gce"),
    "google-id-token": ("google.mjs", ["id-token", "https://service.example.com"], (), "gce"),
    "aws-node-chain": ("aws.mjs", ["node-chain"], (), "aws_container"),
    "aws-imdsv2": ("aws.mjs", ["instance-metadata"], AWS_CONTAINER_VARIABLES, "aws_imds"),
}


@pytest.mark.parametrize("name", list(SIDECAR_SCENARIOS))
def test_through_sidecar_and_agent(dev, split, tmp_path, name):
    script, args, drop, surface = SIDECAR_SCENARIOS[name]
    env = client_env(sidecar_exports(dev, split), tmp_path, drop=drop)
    agent_offset, dev_offset = log_size(split["agent_log"]), log_size(dev.log_path)
    result = run_node(script, *args, env=env)
    if name.startswith("azure"):
        check_azure(dev, result, "ManagedIdentityCredential")
    elif name == "google-access-token":
        check_google_access_token(dev, result)
    elif name == "google-id-token":
        check_google_id_token(dev, result, args[1])
    else:
        check_aws(dev, result, "CREDENTIALS_IMDS" if name == "aws-imdsv2" else "CREDENTIALS_HTTP")
    # The agent issued it, for the surface the sidecar was asked on; the
    # `lanyard dev` surfaces were never reached.
    assert set(surfaces_since(split["agent_log"], agent_offset)) == {surface}
    assert surfaces_since(dev.log_path, dev_offset, timeout=0) == []
