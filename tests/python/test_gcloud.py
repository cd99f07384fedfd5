"""The gcloud CLI, unmodified, against `lanyard dev`'s GCE metadata surface."""

import os
import shutil
import subprocess

import pytest


def test_gcloud_print_access_token(dev, tmp_path):
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
    out = subprocess.run([gcloud, "auth", "print-access-token"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    token = out.stdout.strip()
    assert token.startswith("ya29."), out.stdout
    dev.issued.append(token)
    out = subprocess.run([gcloud, "config", "list", "--format=value(core.account)"], env=env, capture_output=True, text=True, timeout=120)
    assert "ray-worker@lanyard-dev.iam.gserviceaccount.com" in out.stdout + out.stderr
