"""The durable audit file, as an operator relies on it: real SDK clients
under load, `kill -9` in the middle, a restart; every credential a client
received has its record, the chain verifies, and no secret is in it."""

import hashlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from azure.identity import ManagedIdentityCredential

from conftest import Dev, lanyard_binary


def fingerprint(secret: str) -> str:
    """Lanyard's credential fingerprint: sha256: and 12 hex digits."""
    return "sha256:" + hashlib.sha256(secret.encode()).hexdigest()[:12]


def records(path):
    with open(path, "rb") as f:
        return [json.loads(line) for line in f.read().splitlines() if line.strip()]


def verify(*files):
    return subprocess.run(
        [lanyard_binary(), "audit", "verify", *map(str, files)],
        capture_output=True, text=True, timeout=60,
    )


def start(tmp_path, audit_file, name):
    return Dev([], tmp_path / f"{name}.log", extra_env={
        "LANYARD_AUDIT_FILE": str(audit_file),
        "LANYARD_AUDIT_CLUSTER": "test-cluster",
    })


def test_every_credential_received_before_a_kill_9_has_its_record(tmp_path, monkeypatch):
    for name in ("IDENTITY_ENDPOINT", "IDENTITY_HEADER", "MSI_ENDPOINT", "MSI_SECRET"):
        monkeypatch.delenv(name, raising=False)
    audit_file = tmp_path / "audit" / "audit.jsonl"
    dev = start(tmp_path, audit_file, "first")
    monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", dev.exports["AZURE_POD_IDENTITY_AUTHORITY_HOST"])
    received = []  # (scope, token) every client got back
    errors = []
    stop = threading.Event()

    def client(n):
        i = 0
        while not stop.is_set():
            # A new resource each time: each is a new exchange, a new record.
            scope = f"api://app-{n}-{i}/.default"
            i += 1
            try:
                token = ManagedIdentityCredential().get_token(scope).token
                received.append((scope, token))
            except Exception as e:  # the kill: connection refused / reset
                errors.append(repr(e))
                return

    threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while len(received) < 40 and time.time() < deadline:
        time.sleep(0.05)
    os.kill(dev.proc.pid, signal.SIGKILL)
    dev.proc.wait()
    stop.set()
    for t in threads:
        t.join(timeout=60)
    dev.log.close()
    assert len(received) >= 40, f"only {len(received)} credentials before the kill; errors: {errors[:3]}"

    on_disk = records(audit_file)
    recorded = {r["credential"]["fingerprint"] for r in on_disk if r["type"] == "credential" and "credential" in r}
    missing = [scope for scope, token in received if fingerprint(token) not in recorded]
    assert not missing, f"{len(missing)} credentials left without their record, e.g. {missing[:3]}"
    out = verify(audit_file)
    assert out.returncode == 0, out.stdout + out.stderr

    # A restart continues the same chain; no secret is in any record.
    dev = start(tmp_path, audit_file, "second")
    monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", dev.exports["AZURE_POD_IDENTITY_AUTHORITY_HOST"])
    try:
        token = ManagedIdentityCredential().get_token("https://storage.azure.com/.default").token
        received.append(("storage", token))
    finally:
        assert dev.stop() == 0
    on_disk = records(audit_file)
    assert on_disk[-1]["credential"]["fingerprint"] == fingerprint(token)
    assert on_disk[-1]["cluster"] == "test-cluster"
    out = verify(audit_file)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(on_disk)} records" in out.stdout, out.stdout
    text = audit_file.read_text()
    for _, token in received:
        assert token not in text
    assert "eyJ" not in text, "a JWT in the audit file"


def test_verify_names_a_tampered_record(tmp_path, monkeypatch):
    audit_file = tmp_path / "audit.jsonl"
    dev = start(tmp_path, audit_file, "dev")
    monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", dev.exports["AZURE_POD_IDENTITY_AUTHORITY_HOST"])
    try:
        for i in range(5):
            ManagedIdentityCredential().get_token(f"api://tamper-{i}/.default")
    finally:
        assert dev.stop() == 0
    lines = audit_file.read_text().splitlines(keepends=True)
    assert len(lines) == 5
    assert verify(audit_file).returncode == 0

    # The identity of record 3 changed by hand: named by file and line.
    edited = list(lines)
    edited[2] = edited[2].replace("tamper-2", "tamper-X")
    audit_file.write_text("".join(edited))
    out = verify(audit_file)
    assert out.returncode == 1
    assert f"{audit_file}:3:" in out.stderr and "altered" in out.stderr, out.stderr

    audit_file.write_text("".join(lines[:2] + lines[3:]))
    out = verify(audit_file)
    assert out.returncode == 1 and f"{audit_file}:3:" in out.stderr and "missing" in out.stderr, out.stderr

    audit_file.write_text("".join(lines)[:-30])
    out = verify(audit_file)
    assert out.returncode == 1 and "truncated" in out.stderr, out.stderr


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs of the test's own (root only), unmounted at the end."""
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {out.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_refuses_credentials_until_it_has_room_again(tmp_path, small_disk, monkeypatch):
    import requests
    audit_file = small_disk / "audit.jsonl"
    filler = small_disk / "filler"
    dev = start(tmp_path, audit_file, "dev")
    url = dev.exports["AZURE_POD_IDENTITY_AUTHORITY_HOST"] + "/metadata/identity/oauth2/token"
    try:
        # Leave room for a few records only.
        free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
        filler.write_bytes(b"\0" * max(free - 8192, 0))
        granted, refused = [], None
        for i in range(200):
            r = requests.get(url, params={"api-version": "2018-02-01", "resource": f"api://full-{i}"},
                             headers={"Metadata": "true"}, timeout=30)
            if r.status_code == 200:
                granted.append(r.json()["access_token"])
                continue
            refused = r
            break
        assert refused is not None, "the disk never filled"
        assert refused.status_code == 503, refused.text
        assert "access_token" not in refused.text
        assert "audit record could not be written" in refused.json()["error_description"]
        # Every credential that did leave has its record.
        recorded = {rec["credential"]["fingerprint"] for rec in records(audit_file) if "credential" in rec}
        assert all(fingerprint(t) in recorded for t in granted)
        # Room again: credentials flow, and the outage is in the file.
        filler.unlink()
        monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", dev.exports["AZURE_POD_IDENTITY_AUTHORITY_HOST"])
        for name in ("IDENTITY_ENDPOINT", "IDENTITY_HEADER", "MSI_ENDPOINT", "MSI_SECRET"):
            monkeypatch.delenv(name, raising=False)
        token = ManagedIdentityCredential().get_token("api://after-full/.default").token
        granted.append(token)
    finally:
        assert dev.stop() == 0
    on_disk = records(audit_file)
    failures = [r for r in on_disk if r["type"] == "sink_failure"]
    assert len(failures) == 1 and failures[0]["records"] >= 1 and failures[0]["handling"] == "refused", failures
    assert on_disk[-1]["credential"]["fingerprint"] == fingerprint(token)
    assert verify(audit_file).returncode == 0
    log = (tmp_path / "dev.log").read_text(errors="replace")
    assert "audit file unavailable" in log
    for t in granted:
        assert t not in log


def test_no_secret_of_any_cloud_reaches_the_audit_file_or_the_log(tmp_path, monkeypatch):
    import boto3
    import google.auth
    import google.auth.transport.requests
    from google.oauth2 import id_token as google_id_token

    audit_file = tmp_path / "audit.jsonl"
    dev = start(tmp_path, audit_file, "dev")
    for name, value in dev.exports.items():
        monkeypatch.setenv(name, value)
    secrets = [dev.exports["IDENTITY_HEADER"]]
    try:
        secrets.append(ManagedIdentityCredential().get_token("https://storage.azure.com/.default").token)
        creds, _ = google.auth.default()
        creds.refresh(google.auth.transport.requests.Request())
        secrets.append(creds.token)
        secrets.append(google_id_token.fetch_id_token(google.auth.transport.requests.Request(), "https://svc.example"))
        frozen = boto3.Session().get_credentials().get_frozen_credentials()
        secrets += [frozen.secret_key, frozen.token]
        # The projected tokens the pod presents, and the app token.
        for f in Path(dev.token_dir).iterdir():
            secrets.append(f.read_text().strip())
    finally:
        assert dev.stop() == 0
    kinds = {(r["request"]["cloud"], r["request"]["kind"]) for r in records(audit_file) if r["type"] == "credential"}
    assert kinds == {("azure", "access_token"), ("gcp", "access_token"), ("gcp", "id_token"), ("aws", "aws_credentials")}, kinds
    places = {"audit file": audit_file.read_text(), "log": (tmp_path / "dev.log").read_text(errors="replace")}
    for where, text in places.items():
        for secret in secrets:
            assert secret and secret not in text, f"a secret ({secret[:6]}…) in the {where}"
        assert "eyJ" not in text, f"a JWT in the {where}"


def test_records_name_the_upstream_call_a_request_waited_on(tmp_path, monkeypatch):
    """A miss names its upstream exchange (latency, and the cloud's request
    id where the cloud sends one: Entra's x-ms-request-id, STS's
    x-amzn-RequestId); a cache hit waited on none and names none."""
    import re
    import sys

    import boto3

    audit_file = tmp_path / "audit.jsonl"
    dev = start(tmp_path, audit_file, "dev")
    for name, value in dev.exports.items():
        monkeypatch.setenv(name, value)
    try:
        for _ in range(2):  # a miss, then a hit
            ManagedIdentityCredential().get_token("https://storage.azure.com/.default")
        # google-auth reads the metadata host when first imported: in a
        # process of its own, so that an earlier test's import cannot point
        # it at an earlier `lanyard dev`.
        google = ("import google.auth, google.auth.transport.requests as r; "
                  "c, _ = google.auth.default(); c.refresh(r.Request())")
        subprocess.run([sys.executable, "-c", google], env={**os.environ, **dev.exports},
                       check=True, timeout=60)
        boto3.Session().get_credentials().get_frozen_credentials()
    finally:
        assert dev.stop() == 0
    granted = [r for r in records(audit_file) if r["type"] == "credential" and r["decision"]["verdict"] == "allow"]
    by_cloud = {}
    for r in granted:
        by_cloud.setdefault(r["request"]["cloud"], []).append(r)
    uuid = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
    azure_miss, azure_hit = by_cloud["azure"]
    assert azure_miss["outcome"]["cache"] == "miss" and azure_hit["outcome"]["cache"] == "hit"
    assert uuid.match(azure_miss["upstream"]["request_id"]), azure_miss
    assert 0 < azure_miss["upstream"]["latency_ms"] <= azure_miss["latency_ms"]
    assert "upstream" not in azure_hit, azure_hit
    (aws,) = by_cloud["aws"]
    assert uuid.match(aws["upstream"]["request_id"]), aws
    # Google's token endpoints send no request id: the latency alone.
    (gcp,) = by_cloud["gcp"]
    assert gcp["upstream"]["latency_ms"] > 0 and "request_id" not in gcp["upstream"], gcp
