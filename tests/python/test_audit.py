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
