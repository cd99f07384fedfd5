"""The real SDKs through a separate `lanyard sidecar` and `lanyard agent`,
with `lanyard dev` providing only the issuer, the cloud emulators and the
pod's projected token files. The agent is killed and restarted: the sidecar
answers retryable errors meanwhile and the SDKs work again afterwards."""

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import boto3
import pytest
import requests
from azure.identity import ManagedIdentityCredential

import jwt_check
from conftest import lanyard_binary, sidecar_binary

SCOPE = "https://storage.azure.com/.default"
PROVIDER = "//iam.googleapis.com/projects/123456789012/locations/global/workloadIdentityPools/lanyard-dev/providers/dev-cluster"


ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def reported(proc, log_path, message: str, key: str, offset: int = 0, timeout: float = 20.0) -> str:
    """The address in field `key` of the first line containing `message`
    that the process logged (to `log_path`, from byte `offset` on): the
    processes listen on port 0 and say where they bound."""
    field = re.compile(rf"(?:^|\s){re.escape(key)}=(\S+)")
    deadline = time.time() + timeout
    while True:
        with open(log_path, "rb") as f:
            f.seek(offset)
            text = ANSI.sub("", f.read().decode(errors="replace"))
        for line in text.splitlines():
            if message in line:
                m = field.search(line)
                assert m, f"no {key}= in {line!r}"
                return m.group(1)
        if proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}) before logging {message!r}:\n{text}")
        if time.time() > deadline:
            raise AssertionError(f"never logged {message!r}:\n{text}")
        time.sleep(0.05)


def role_env(**extra):
    """The environment without Lanyard settings, logging at least the
    info lines that report the bound addresses."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LANYARD_")}
    env.setdefault("RUST_LOG", "info")
    return {**env, **extra}


def wait_ready(url: str, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if requests.get(url, timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never became ready")


class Agent:
    """`lanyard agent` on `listen` (port 0: any free port); `port` is the
    port its API reported once it serves."""

    def __init__(self, config_path, listen, log_path):
        offset = log_path.stat().st_size if log_path.exists() else 0
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [lanyard_binary(), "--config", str(config_path), "agent",
             "--listen", listen, "--admin-listen", "127.0.0.1:0",
             "--node-name", "lanyard-dev-node"],
            stdout=subprocess.DEVNULL, stderr=self.log, env=role_env(),
        )
        api = reported(self.proc, log_path, "lanyard agent serving", "api", offset)
        self.port = int(api.rsplit(":", 1)[1])

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=15)
        self.log.close()


@pytest.fixture
def split(dev, tmp_path):
    up = dev.upstreams
    config = tmp_path / "agent.yaml"
    config.write_text(textwrap.dedent(f"""
        azure:
          authority_host: {up["azure"]}
          tenant_id: {dev.exports["AZURE_TENANT_ID"]}
        gcp:
          workload_identity_provider: "{PROVIDER}"
          project_id: lanyard-dev
          sts_endpoint: {up["gcp-sts"]}
          iamcredentials_endpoint: {up["gcp-iamcredentials"]}
        aws:
          sts_endpoint: {up["aws-sts"]}
        cluster:
          issuer: {up["issuer"]}
          service_accounts:
            - namespace: default
              name: ray-worker
              annotations:
                azure.workload.identity/client-id: {dev.exports["AZURE_CLIENT_ID"]}
                iam.gke.io/gcp-service-account: ray-worker@lanyard-dev.iam.gserviceaccount.com
                eks.amazonaws.com/role-arn: arn:aws:iam::111122223333:role/ray-worker
    """))
    agent_log = tmp_path / "agent.log"
    agent = Agent(config, "127.0.0.1:0", agent_log)
    agent_port = agent.port
    sidecar_log = open(tmp_path / "sidecar.log", "wb")
    sidecar = subprocess.Popen(
        [sidecar_binary(), "--listen", "127.0.0.1:0",
         "--agent", f"http://127.0.0.1:{agent_port}", "--token-dir", dev.token_dir],
        stdout=subprocess.DEVNULL, stderr=sidecar_log,
        env=role_env(IDENTITY_HEADER="split-test-header"),
    )
    sidecar_addr = reported(sidecar, tmp_path / "sidecar.log", "lanyard sidecar serving", "addr")
    sidecar_port = int(sidecar_addr.rsplit(":", 1)[1])
    base = f"http://127.0.0.1:{sidecar_port}"
    wait_ready(base + "/readyz")
    state = {"agent": agent, "config": config, "agent_port": agent_port, "base": base,
             "agent_log": agent_log, "sidecar_port": sidecar_port}
    yield state
    sidecar.terminate()
    sidecar.wait(timeout=15)
    sidecar_log.close()
    if state["agent"].proc.poll() is None:
        state["agent"].stop()
    for log in (agent_log, tmp_path / "sidecar.log"):
        text = log.read_text(errors="replace")
        assert "eyJ" not in text, f"a JWT appeared in {log.name}"
        for token in dev.issued:
            assert token not in text, f"an issued credential appeared in {log.name}"


def google_token(dev, base) -> str:
    env = dict(os.environ, GCE_METADATA_HOST=base.removeprefix("http://"), GCE_METADATA_IP=base.removeprefix("http://"))
    code = textwrap.dedent("""
        import json, google.auth, google.auth.transport.requests
        creds, project = google.auth.default()
        creds.refresh(google.auth.transport.requests.Request())
        print(json.dumps({"token": creds.token, "project": project, "email": creds.service_account_email}))
    """)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["project"] == "lanyard-dev"
    assert result["email"] == "ray-worker@lanyard-dev.iam.gserviceaccount.com"
    return result["token"]


def all_sdks(dev, split, monkeypatch):
    base = split["base"]
    monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", base)
    token = ManagedIdentityCredential().get_token(SCOPE).token
    jwt_check.entra_access_token(token)
    dev.issued.append(token)
    dev.issued.append(google_token(dev, base))
    monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", base + "/v1/credentials")
    monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", os.path.join(dev.token_dir, "app"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", dev.exports["AWS_DEFAULT_REGION"])
    frozen = boto3.Session().get_credentials().get_frozen_credentials()
    assert frozen.access_key.startswith("ASIA")
    dev.issued += [frozen.secret_key, frozen.token]


def test_sdks_through_sidecar_and_agent_survive_an_agent_restart(dev, split, monkeypatch):
    all_sdks(dev, split, monkeypatch)

    split["agent"].stop()
    resp = requests.get(
        split["base"] + "/metadata/identity/oauth2/token",
        params={"api-version": "2018-02-01", "resource": "https://vault.azure.net"},
        headers={"Metadata": "true"}, timeout=10,
    )
    assert resp.status_code == 503, resp.text
    assert "access_token" not in resp.text
    assert requests.get(split["base"] + "/readyz", timeout=5).status_code == 503

    # Back on the port the first agent reported: the sidecar reconnects.
    split["agent"] = Agent(split["config"], f"127.0.0.1:{split['agent_port']}", split["agent_log"])
    wait_ready(split["base"] + "/readyz")
    all_sdks(dev, split, monkeypatch)
