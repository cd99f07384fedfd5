"""Chained AWS credentials against an STS that is not Lanyard's: moto's
server, with its IAM authentication on. The agent's second hop, a
SigV4-signed `sts:AssumeRole` made with the first session's keys, must pass
moto's own signature check and its IAM permission check, and the
credentials boto3 then gets from the container surface must be the target
role's for moto's `GetCallerIdentity` (also signed, also checked).

moto does not validate web identity tokens, so the first hop proves
nothing here (Lanyard's emulator checks it); the signature of the second
is the point. moto's server comes from a venv of its own, which
scripts/test installs (`LANYARD_MOTO_SERVER`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import boto3
import pytest
import requests

from conftest import Dev, stop_process

MOTO = os.environ.get("LANYARD_MOTO_SERVER", "")
pytestmark = pytest.mark.skipif(not Path(MOTO).is_file(),
                                reason="moto's server is installed by scripts/test (LANYARD_MOTO_SERVER)")

ACCOUNT = "123456789012"  # moto's default account
SOURCE = f"arn:aws:iam::{ACCOUNT}:role/ray-worker"
TARGET = f"arn:aws:iam::{ACCOUNT}:role/data-lake"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def moto(tmp_path):
    port = free_port()
    log = open(tmp_path / "moto.log", "wb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.Popen([MOTO, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            requests.get(f"{url}/moto-api/", timeout=1)
            break
        except requests.ConnectionError:
            time.sleep(0.2)
    yield url
    stop_process(proc)
    log.close()


def admin(url: str, service: str):
    """A client for setting moto up, while its authentication is off."""
    return boto3.client(service, endpoint_url=url, region_name="us-east-1",
                        aws_access_key_id="AKIAIOSFODNN7EXAMPLE", aws_secret_access_key="setup-only")


def test_moto_accepts_the_signed_second_hop_and_the_chained_credentials(moto, tmp_path, monkeypatch):
    iam = admin(moto, "iam")
    # moto compares a trust policy's principal with the caller's session ARN
    # literally, where AWS matches a role ARN to its sessions: the trust is
    # "*" here, and moto's permission check of the first role is the one
    # that must pass.
    trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {"AWS": "*"},
                                                      "Action": ["sts:AssumeRole", "sts:TagSession"]}]}
    for name in ("ray-worker", "data-lake"):
        iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(trust))
    # The first role may assume the target; the target may ask who it is.
    iam.put_role_policy(RoleName="ray-worker", PolicyName="chain", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["sts:AssumeRole", "sts:TagSession"],
                                                "Resource": "*"}]}))
    iam.put_role_policy(RoleName="data-lake", PolicyName="whoami", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:GetCallerIdentity",
                                                "Resource": "*"}]}))

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    dev = Dev([], tmp_path / "lanyard.log", extra_env={
        "LANYARD_AWS_STS_ENDPOINT": moto,
        "LANYARD_DEV_AWS_ROLE_ARN": SOURCE,
        "LANYARD_DEV_AWS_TARGET_ROLE_ARN": TARGET})
    try:
        # From here on moto authenticates every request but one: the
        # unsigned web identity exchange, which carries no signature.
        assert requests.post(f"{moto}/moto-api/reset-auth", data=b"1", timeout=5).ok
        for name in ("AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
                     "AWS_DEFAULT_REGION"):
            monkeypatch.setenv(name, dev.exports[name])
        session = boto3.Session()
        frozen = session.get_credentials().get_frozen_credentials()
        sts = session.client("sts", endpoint_url=moto)
        assert sts.get_caller_identity()["Arn"] == \
            f"arn:aws:sts::{ACCOUNT}:assumed-role/data-lake/lanyard-default_ray-worker"
        # moto's check can fail: the same call with a wrong secret is refused.
        forged = boto3.client("sts", endpoint_url=moto, region_name="us-east-1",
                              aws_access_key_id=frozen.access_key, aws_secret_access_key="not-the-secret",
                              aws_session_token=frozen.token)
        with pytest.raises(Exception) as refused:
            forged.get_caller_identity()
        assert "SignatureDoesNotMatch" in str(refused.value) or "InvalidClientTokenId" in str(refused.value)
        log = dev.read_log()
        assert "credential issued" in log
        assert frozen.secret_key not in log and frozen.token not in log
    finally:
        assert dev.stop() == 0, dev.read_log()
