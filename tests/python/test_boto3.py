"""boto3/botocore and the aws CLI, unmodified, against `lanyard dev`'s AWS surfaces."""

import datetime
import json
import os
import shutil
import subprocess

import boto3
import botocore.session
import pytest
import requests

MIN_REMAINING = datetime.timedelta(minutes=15)


def resolved(session):
    creds = session.get_credentials()
    assert creds is not None
    frozen = creds.get_frozen_credentials()
    return creds, frozen


def check_expiry(creds):
    expiry = creds._expiry_time  # botocore's RefreshableCredentials
    remaining = expiry - datetime.datetime.now(datetime.timezone.utc)
    assert remaining > MIN_REMAINING, remaining


def test_container_provider(dev, monkeypatch):
    # Every AWS variable the pod gets, and nothing else: the region too
    # must come from them (botocore reads AWS_DEFAULT_REGION only).
    for name, value in dev.exports.items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    session = boto3.Session()
    assert session.region_name == dev.exports["AWS_REGION"]
    assert session.client("sts").meta.region_name == dev.exports["AWS_REGION"]
    creds, frozen = resolved(session)
    assert creds.method == "container-role"
    assert frozen.access_key.startswith("ASIA")
    assert frozen.token
    check_expiry(creds)
    dev.issued += [frozen.secret_key, frozen.token]


def test_imdsv2_provider(dev, monkeypatch):
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", dev.exports["AWS_EC2_METADATA_SERVICE_ENDPOINT"])
    session = botocore.session.get_session()
    creds, frozen = resolved(session)
    assert creds.method == "iam-role"
    assert frozen.access_key.startswith("ASIA")
    check_expiry(creds)
    dev.issued += [frozen.secret_key, frozen.token]


def test_aws_cli_resolves_credentials(dev, tmp_path):
    aws = shutil.which("aws")
    if aws is None:
        pytest.skip("aws CLI not installed on this machine")
    env = {k: v for k, v in os.environ.items()}
    for name in ("AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", "AWS_REGION"):
        env[name] = dev.exports[name]
    env["AWS_EC2_METADATA_DISABLED"] = "true"
    out = subprocess.run(
        [aws, "configure", "export-credentials", "--format", "process"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    if out.returncode == 0:
        creds = json.loads(out.stdout)
        assert creds["AccessKeyId"].startswith("ASIA")
        dev.issued += [creds["SecretAccessKey"], creds["SessionToken"]]
        return
    # aws CLI v1 has no export-credentials: `configure list` resolves the
    # credential chain and names the provider that answered.
    assert "Invalid choice" in out.stderr, out.stderr
    for provider, extra in (
        ("container-role", {}),
        ("iam-role", {
            "AWS_CONTAINER_CREDENTIALS_FULL_URI": "",
            "AWS_EC2_METADATA_DISABLED": "false",
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": dev.exports["AWS_EC2_METADATA_SERVICE_ENDPOINT"],
        }),
    ):
        run_env = dict(env, **extra)
        if not run_env["AWS_CONTAINER_CREDENTIALS_FULL_URI"]:
            del run_env["AWS_CONTAINER_CREDENTIALS_FULL_URI"]
        out = subprocess.run([aws, "configure", "list"], env=run_env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines() if line.split()}
        assert rows["access_key"][1] == provider, out.stdout
        assert rows["access_key"][0].startswith("****"), out.stdout


def test_container_endpoint_refuses_wrong_authorization(dev):
    url = dev.exports["AWS_CONTAINER_CREDENTIALS_FULL_URI"]
    for headers in ({}, {"Authorization": "wrong"}):
        resp = requests.get(url, headers=headers, timeout=5)
        assert resp.status_code == 401
        assert resp.json()["code"] == "AccessDenied"
        assert "SecretAccessKey" not in resp.text


def test_imdsv1_is_refused(dev):
    base = dev.exports["AWS_EC2_METADATA_SERVICE_ENDPOINT"]
    resp = requests.get(base + "latest/meta-data/iam/security-credentials/", timeout=5)
    assert resp.status_code == 401
    bad_ttl = requests.put(base + "latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": "21601"}, timeout=5)
    assert bad_ttl.status_code == 400
    forwarded = requests.put(
        base + "latest/api/token",
        headers={"X-aws-ec2-metadata-token-ttl-seconds": "60", "X-Forwarded-For": "1.2.3.4"},
        timeout=5,
    )
    assert forwarded.status_code == 403


SOURCE_ROLE = "arn:aws:iam::111122223333:role/ray-worker"
TARGET_ROLE = "arn:aws:iam::222233334444:role/data-lake"
TARGET_SESSION = "arn:aws:sts::222233334444:assumed-role/data-lake/lanyard-default_ray-worker"


@pytest.fixture
def chain_dev(tmp_path, monkeypatch):
    """`lanyard dev` whose ServiceAccount chains into a target role in
    another account, with an external id and EKS's session tags, its audit
    records in a file."""
    from conftest import Dev
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    d = Dev([], tmp_path / "lanyard.log", extra_env={
        "LANYARD_DEV_AWS_TARGET_ROLE_ARN": TARGET_ROLE,
        "LANYARD_DEV_AWS_EXTERNAL_ID": "lanyard-dev-7f3a",
        "LANYARD_AWS_CLUSTER_ARN": "arn:aws:eks:us-east-1:111122223333:cluster/lanyard-dev",
        "LANYARD_AUDIT_FILE": str(tmp_path / "audit.jsonl")})
    d.audit_file = tmp_path / "audit.jsonl"
    yield d
    assert d.stop() == 0, d.read_log()


def pod_env(dev, *names) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({n: dev.exports[n] for n in names})
    return env


def test_boto3_gets_the_target_roles_credentials_on_both_surfaces(chain_dev, monkeypatch):
    for name, value in chain_dev.exports.items():
        if name.startswith("AWS_") and name != "AWS_ENDPOINT_URL_STS":
            monkeypatch.setenv(name, value)
    creds, frozen = resolved(boto3.Session())
    assert creds.method == "container-role"
    remaining = creds._expiry_time - datetime.datetime.now(datetime.timezone.utc)
    assert datetime.timedelta(minutes=15) < remaining <= datetime.timedelta(hours=1), remaining
    # Asked of the dev STS, which knows the session: the target role.
    sts = boto3.Session().client("sts", endpoint_url=chain_dev.exports["AWS_ENDPOINT_URL_STS"])
    assert sts.get_caller_identity()["Arn"] == TARGET_SESSION
    chain_dev.issued += [frozen.secret_key, frozen.token]
    # IMDSv2 serves the same role, by its name.
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_FULL_URI")
    monkeypatch.delenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE")
    session = botocore.session.get_session()
    creds, frozen = resolved(session)
    assert creds.method == "iam-role"
    base = chain_dev.exports["AWS_EC2_METADATA_SERVICE_ENDPOINT"].rstrip("/")
    token = requests.put(f"{base}/latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}).text
    listed = requests.get(f"{base}/latest/meta-data/iam/security-credentials/",
                          headers={"X-aws-ec2-metadata-token": token}).text
    assert listed.strip() == "data-lake"
    chain_dev.issued += [frozen.secret_key, frozen.token]


def test_aws_cli_get_caller_identity_names_the_target(chain_dev, tmp_path):
    aws = shutil.which("aws")
    if aws is None:
        pytest.skip("aws CLI not installed on this machine")
    env = pod_env(chain_dev, "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
                  "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_STS")
    env["AWS_EC2_METADATA_DISABLED"] = "true"
    out = subprocess.run([aws, "sts", "get-caller-identity"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    identity = json.loads(out.stdout)
    assert identity["Arn"] == TARGET_SESSION
    assert identity["Account"] == "222233334444"


def test_the_record_names_both_roles_and_both_request_ids(chain_dev):
    url = chain_dev.exports["AWS_CONTAINER_CREDENTIALS_FULL_URI"]
    with open(chain_dev.exports["AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"]) as f:
        token = f.read().strip()
    body = requests.get(url, headers={"Authorization": token}, timeout=10).json()
    chain_dev.issued += [body["SecretAccessKey"], body["Token"]]
    records = [json.loads(line) for line in chain_dev.audit_file.read_text().splitlines()]
    (issued,) = [r for r in records if r["type"] == "credential" and r["request"]["cloud"] == "aws"]
    assert issued["request"]["identity"] == TARGET_ROLE
    assert issued["request"]["via"] == SOURCE_ROLE
    ids = issued["upstream"]["request_id"].split(",")
    assert len(ids) == 2 and all(len(i) == 36 for i in ids), ids
