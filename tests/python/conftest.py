"""Fixtures: a running `lanyard dev` and the environment it exports.

Each test gets the exports as a dict and can apply them to os.environ with
monkeypatch, exactly as a user would `eval` them in a shell. At teardown the
fixture asserts that no issued token and no JWT ever appeared in Lanyard's
logs.
"""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Variables a developer's shell might carry that would redirect the SDKs.
SDK_VARIABLES = [
    "AZURE_POD_IDENTITY_AUTHORITY_HOST", "IDENTITY_ENDPOINT", "IDENTITY_HEADER",
    "AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_FEDERATED_TOKEN_FILE",
    "AZURE_CLIENT_SECRET", "MSI_ENDPOINT", "MSI_SECRET", "IMDS_ENDPOINT",
    "IDENTITY_SERVER_THUMBPRINT", "AZURE_AUTHORITY_HOST",
    "GCE_METADATA_HOST", "GCE_METADATA_IP", "GCE_METADATA_ROOT",
    "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CONFIG",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
    "AWS_EC2_METADATA_SERVICE_ENDPOINT", "AWS_EC2_METADATA_DISABLED", "AWS_REGION",
    "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
    "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
]


def stop_process(proc, timeout: float = 15.0) -> int:
    """SIGTERM, then SIGKILL after `timeout` seconds; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def lanyard_binary() -> str:
    explicit = os.environ.get("LANYARD_BIN")
    if explicit:
        return explicit
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    for profile in ("debug", "release"):
        candidate = target / profile / "lanyard"
        if candidate.exists():
            return str(candidate)
    raise RuntimeError("lanyard binary not found; run `cargo build` or set LANYARD_BIN")


def sidecar_binary() -> str:
    """The slim `lanyard-sidecar`, built next to `lanyard`."""
    candidate = Path(lanyard_binary()).with_name("lanyard-sidecar")
    if not candidate.exists():
        raise RuntimeError(f"{candidate} not found; run `cargo build`")
    return str(candidate)


class Dev:
    """A `lanyard dev` process, its exports and its log."""

    def __init__(self, args, log_path: Path, extra_env=None):
        env = {k: v for k, v in os.environ.items() if not k.startswith("LANYARD_")}
        env.setdefault("RUST_LOG", "debug")
        env.update(extra_env or {})
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [lanyard_binary(), "dev", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", *args],
            stdout=subprocess.PIPE, stderr=self.log, env=env,
        )
        self.exports = {}
        self.admin = None
        self.token_dir = None
        self.upstreams = {}
        self.issued = []  # every token the tests saw, checked against the log
        deadline = time.time() + 30
        while time.time() < deadline:
            line = self.proc.stdout.readline().decode()
            if not line or line.strip() == "# lanyard dev ready":
                break
            admin = re.match(r"^# lanyard admin (\S+)$", line.strip())
            if admin:
                self.admin = admin.group(1)
            token_dir = re.match(r"^# lanyard token-dir (.+)$", line.strip())
            if token_dir:
                self.token_dir = token_dir.group(1)
            upstream = re.match(r"^# lanyard upstream (\S+) (\S+)$", line.strip())
            if upstream:
                self.upstreams[upstream.group(1)] = upstream.group(2)
            m = re.match(r"^export ([A-Z0-9_]+)=(.*)$", line.strip())
            if m:
                self.exports[m.group(1)] = m.group(2).strip("'")
        if "IDENTITY_ENDPOINT" not in self.exports:
            self.stop()
            log = self.log_path.read_text(errors="replace")
            raise RuntimeError("lanyard dev did not print its exports:\n" + log)

    def metric(self, name: str, **labels) -> float:
        """Sum of a Prometheus metric's samples whose labels include `labels`."""
        import urllib.request
        text = urllib.request.urlopen(self.admin + "/metrics", timeout=5).read().decode()
        total = 0.0
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})? (\S+)$", line)
            if not m or m.group(1) != name:
                continue
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
            if all(got.get(k) == v for k, v in labels.items()):
                total += float(m.group(4))
        return total

    def read_log(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        code = stop_process(self.proc)
        self.log.close()
        return code


@pytest.fixture
def dev(tmp_path, monkeypatch):
    for name in SDK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    # No user configuration may leak into the clients under test.
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    d = Dev([], tmp_path / "lanyard.log")
    yield d
    code = d.stop()
    log = d.log_path.read_text(errors="replace")
    assert code == 0, f"lanyard dev exited with {code} on SIGTERM:\n{log}"
    assert "shutting down" in log
    for token in d.issued:
        assert token not in log, "an issued token appeared in Lanyard's log"
    assert not re.search(r"eyJ[A-Za-z0-9_-]{10,}\.", log), "a JWT appeared in Lanyard's log"
    assert d.exports["IDENTITY_HEADER"] not in log, "the identity header secret appeared in the log"
