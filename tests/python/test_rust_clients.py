"""The official Rust SDKs, unmodified, with only the pod's environment:
`aws-config`'s default provider chain receives a target role's
credentials from the container surface and from IMDSv2, and
`google-cloud-auth`'s default credentials a token from the metadata
surface (tests/rust-clients, built by scripts/test)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import boto3
import pytest

from conftest import ROOT, Dev

TARGET_SESSION = "arn:aws:sts::222233334444:assumed-role/data-lake/lanyard-default_ray-worker"


def client_binary() -> Path:
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    binary = target / "debug" / "lanyard-rust-clients"
    if not binary.exists():
        pytest.skip(f"{binary}: cargo build -p lanyard-rust-clients (scripts/test does)")
    return binary


@pytest.fixture
def chain_dev(tmp_path):
    d = Dev([], tmp_path / "lanyard.log", extra_env={
        "LANYARD_DEV_AWS_TARGET_ROLE_ARN": "arn:aws:iam::222233334444:role/data-lake",
        "LANYARD_DEV_AWS_EXTERNAL_ID": "lanyard-dev-7f3a"})
    yield d
    log = d.read_log()
    assert d.stop() == 0, log
    for secret in d.issued:
        assert secret not in log


def run(dev, tmp_path, client: str, drop=()) -> dict:
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TZ")}
    env["HOME"] = str(tmp_path)
    env.update({k: v for k, v in dev.exports.items() if k not in drop and k != "AWS_ENDPOINT_URL_STS"})
    out = subprocess.run([str(client_binary()), client], env=env, capture_output=True, text=True, timeout=60)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0 and result["ok"], out.stdout + out.stderr
    return result


@pytest.mark.parametrize("surface", ["container", "imdsv2"])
def test_aws_config_receives_the_target_roles_credentials(chain_dev, tmp_path, surface):
    drop = ("AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE") \
        if surface == "imdsv2" else ()
    result = run(chain_dev, tmp_path, "aws", drop)
    assert result["region"] == chain_dev.exports["AWS_REGION"]
    sts = boto3.client("sts", endpoint_url=chain_dev.exports["AWS_ENDPOINT_URL_STS"], region_name="us-east-1",
                       aws_access_key_id=result["access_key_id"], aws_secret_access_key=result["secret_access_key"],
                       aws_session_token=result["session_token"])
    assert sts.get_caller_identity()["Arn"] == TARGET_SESSION
    surface = {"container": "aws_container", "imdsv2": "aws_imds"}[surface]
    assert f'surface="{surface}"' in chain_dev.read_log()
    chain_dev.issued += [result["secret_access_key"], result["session_token"]]


@pytest.fixture
def gke_dev(tmp_path):
    """`lanyard dev` with Google through GKE's own pool."""
    d = Dev([], tmp_path / "lanyard-gke.log", extra_env={
        "LANYARD_GCP_GKE_CLUSTER": "projects/ray-prod-4821/locations/us-central1/clusters/ray",
        "LANYARD_GCP_PROJECT_NUMBER": "310987654321"})
    yield d
    log = d.read_log()
    assert d.stop() == 0, log
    for secret in d.issued:
        assert secret not in log


def test_google_cloud_auth_gets_a_token_from_the_metadata_surface(gke_dev, tmp_path):
    result = run(gke_dev, tmp_path, "google")
    # Through GKE's pool: the emulated IAM grants the service account only
    # to GKE's member, serviceAccount:ray-prod-4821.svc.id.goog[default/ray-worker].
    assert result["token"].startswith("ya29.emulated-sa.")
    gke_dev.issued.append(result["token"])
