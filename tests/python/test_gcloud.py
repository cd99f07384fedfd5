"""The gcloud CLI, unmodified, against `lanyard dev`'s GCE metadata surface."""

import os
import shutil
import subprocess

import pytest

import jwt_check
from conftest import Dev


def gcloud_env(dev, tmp_path) -> tuple[str, dict]:
    gcloud = shutil.which("gcloud")
    if gcloud is None:
        pytest.skip("gcloud not installed on this machine")
    env = dict(os.environ)
    env["CLOUDSDK_CONFIG"] = str(tmp_path / "gcloud-config")
    env["GCE_METADATA_ROOT"] = dev.exports["GCE_METADATA_ROOT"]
    env["GCE_METADATA_IP"] = dev.exports["GCE_METADATA_IP"]
    env["CLOUDSDK_CORE_DISABLE_PROMPTS"] = "1"
    env["CLOUDSDK_COMPONENT_MANAGER_DISABLE_UPDATE_CHECK"] = "1"
    env["CLOUDSDK_CORE_DISABLE_USAGE_REPORTING"] = "1"
    return gcloud, env


def test_gcloud_print_access_token(dev, tmp_path):
    gcloud, env = gcloud_env(dev, tmp_path)
    out = subprocess.run([gcloud, "auth", "print-access-token"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    token = out.stdout.strip()
    assert token.startswith("ya29."), out.stdout
    dev.issued.append(token)
    out = subprocess.run([gcloud, "config", "list", "--format=value(core.account)"], env=env, capture_output=True, text=True, timeout=120)
    assert "ray-worker@lanyard-dev.iam.gserviceaccount.com" in out.stdout + out.stderr


def test_gcloud_print_identity_token(dev, tmp_path):
    gcloud, env = gcloud_env(dev, tmp_path)
    out = subprocess.run([gcloud, "auth", "print-identity-token", "--audiences=https://svc.example.com"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    token = out.stdout.strip()
    claims = jwt_check.payload(token)
    assert claims["aud"] == "https://svc.example.com"
    assert claims["iss"] == "https://accounts.google.com"
    dev.issued.append(token)


@pytest.fixture
def gke_dev(tmp_path, monkeypatch):
    """`lanyard dev` with Google through GKE's own pool."""
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    d = Dev([], tmp_path / "lanyard.log", extra_env={
        "LANYARD_GCP_GKE_CLUSTER": "projects/ray-prod-4821/locations/us-central1/clusters/ray",
        "LANYARD_GCP_PROJECT_NUMBER": "310987654321"})
    yield d
    assert d.stop() == 0, d.read_log()


def test_gcloud_in_dev_through_gkes_pool(gke_dev, tmp_path):
    gcloud, env = gcloud_env(gke_dev, tmp_path)
    out = subprocess.run([gcloud, "auth", "print-access-token"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("ya29.")
    out = subprocess.run([gcloud, "config", "list", "--format=value(core.project)"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip() == "ray-prod-4821", out.stdout + out.stderr
    log = gke_dev.read_log()
    assert "issued" in log and "ray-worker@lanyard-dev.iam.gserviceaccount.com" in log
