"""Cedar policy, decided for real SDK clients against `lanyard dev`.

Each test starts its own `lanyard dev` with a policy directory, and the
clients see only the environment a pod would have. Denials must reach the
SDK as its own error, naming the policies that decided; a policy change
bites on the next request, cached credential or not; an invalid set is
refused with the file and line, at start and on reload.
"""

import os
import re
import time

import boto3
import pytest
from azure.core.exceptions import ClientAuthenticationError
from azure.identity import ManagedIdentityCredential
from botocore.exceptions import CredentialRetrievalError, MetadataRetrievalError, NoCredentialsError

from conftest import SDK_VARIABLES, Dev

STORAGE = "https://storage.azure.com/.default"
MANAGEMENT = "https://management.azure.com/.default"

# Namespaces labelled team=a may get storage for their own identity, never
# the management plane; AWS sessions are limited to an hour.
TEAM_STORAGE = """
@id("team-a-storage")
permit (principal, action == Action::"access_token", resource)
when {
  principal.namespace.hasTag("team") &&
  principal.namespace.getTag("team") == "a" &&
  resource.cloud == "azure" &&
  context.scopes.containsAll(["https://storage.azure.com"])
};

@id("no-management")
forbid (principal, action, resource)
when { context.scopes.contains("https://management.azure.com") };

@id("aws-for-everyone")
permit (principal, action == Action::"aws_credentials", resource);

@id("aws-at-most-an-hour")
forbid (principal, action == Action::"aws_credentials", resource)
when { context has lifetime && context.lifetime > 3600 };
"""

NOTHING_FOR_AZURE = """
@id("azure-revoked")
forbid (principal, action, resource) when { resource.cloud == "azure" };
"""


class PolicyDev:
    """A `lanyard dev` with a policy directory and its configuration."""

    def __init__(self, tmp_path, session_duration=3600):
        self.dir = tmp_path / "policies"
        self.dir.mkdir(exist_ok=True)
        self.config = tmp_path / "lanyard.yaml"
        self.config.write_text(
            "policy:\n"
            f"  dir: {self.dir}\n"
            "  reload_seconds: 1\n"
            "aws:\n"
            f"  session_duration: {session_duration}\n"
            "dev:\n"  # the emulators' credentials live as long as asked
            f"  token_lifetime: {max(session_duration, 3600)}\n"
            "cluster:\n"
            "  namespaces:\n"
            "    - name: default\n"
            "      labels: {team: a}\n"
        )
        self.log_path = tmp_path / "lanyard.log"

    def write(self, name, text):
        path = self.dir / name
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)  # as a ConfigMap update swaps it: at once

    def start(self):
        return Dev(["--config", str(self.config)], self.log_path)


@pytest.fixture
def clean_env(tmp_path, monkeypatch):
    for name in SDK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    return monkeypatch


def wait_for_metric(dev, name, at_least, **labels):
    deadline = time.time() + 15
    while time.time() < deadline:
        if dev.metric(name, **labels) >= at_least:
            return
        time.sleep(0.1)
    pytest.fail(f"{name}{labels} never reached {at_least}:\n{dev.read_log()}")


def azure_token(dev, monkeypatch, scope):
    monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", dev.exports["AZURE_POD_IDENTITY_AUTHORITY_HOST"])
    # A new credential each time: azure-identity keeps tokens in memory per
    # credential, and each call here must reach Lanyard.
    token = ManagedIdentityCredential().get_token(scope)
    dev.issued.append(token.token)
    return token


def stop(dev):
    code = dev.stop()
    log = dev.log_path.read_text(errors="replace")
    assert code == 0, log
    for token in dev.issued:
        assert token not in log
    assert not re.search(r"eyJ[A-Za-z0-9_-]{10,}\.", log)
    return log


def test_allow_and_deny_reach_the_sdk(tmp_path, clean_env):
    p = PolicyDev(tmp_path)
    p.write("team.cedar", TEAM_STORAGE)
    dev = p.start()
    try:
        azure_token(dev, clean_env, STORAGE)
        with pytest.raises(ClientAuthenticationError) as err:
            azure_token(dev, clean_env, MANAGEMENT)
        message = str(err.value)
        assert "Denied by Lanyard policy" in message, message
        assert "no-management" in message, message
        assert dev.metric("lanyard_decisions_total", cloud="azure", decision="deny", reason="policy_denied") >= 1
    finally:
        log = stop(dev)
    assert "no-management" in log, "the audit record names the deciding policy"


def test_a_policy_change_revokes_a_cached_credential(tmp_path, clean_env):
    p = PolicyDev(tmp_path)
    p.write("team.cedar", TEAM_STORAGE)
    dev = p.start()
    try:
        azure_token(dev, clean_env, STORAGE)
        azure_token(dev, clean_env, STORAGE)
        assert dev.metric("lanyard_cache_hits_total", cloud="azure") >= 1, "the credential is cached"
        loaded = dev.metric("lanyard_policy_reloads_total", result="loaded")
        p.write("revoke.cedar", NOTHING_FOR_AZURE)
        wait_for_metric(dev, "lanyard_policy_reloads_total", loaded + 1, result="loaded")
        with pytest.raises(ClientAuthenticationError) as err:
            azure_token(dev, clean_env, STORAGE)
        assert "azure-revoked" in str(err.value)
    finally:
        stop(dev)


def test_an_invalid_reload_keeps_the_last_good_set(tmp_path, clean_env):
    p = PolicyDev(tmp_path)
    p.write("team.cedar", TEAM_STORAGE)
    dev = p.start()
    try:
        p.write("broken.cedar", 'permit (principal, action, resource) when { context.nonexistent == 1 };\n')
        wait_for_metric(dev, "lanyard_policy_reloads_total", 1, result="rejected")
        azure_token(dev, clean_env, STORAGE)  # the last good set still decides
        with pytest.raises(ClientAuthenticationError):
            azure_token(dev, clean_env, MANAGEMENT)
    finally:
        log = stop(dev)
    assert "broken.cedar" in log, log
    # The audit trail names the set in force at start, and the rejected
    # set once, though the watch saw it many times.
    audit = [line for line in log.splitlines() if "lanyard::audit" in line and "policy_reload" in line]
    assert sum("policy set in force" in line for line in audit) == 1, audit
    assert sum("rejected" in line for line in audit) == 1, audit


def test_an_invalid_set_refuses_to_start(tmp_path, clean_env):
    p = PolicyDev(tmp_path)
    p.write("team.cedar", TEAM_STORAGE)
    p.write("typo.cedar", "permit (principal, action, resource)\nwhen { principal.nmae == \"x\" };\n")
    with pytest.raises(RuntimeError):
        p.start()
    log = p.log_path.read_text(errors="replace")
    assert "typo.cedar" in log, log
    assert re.search(r"typo\.cedar:2", log), log


def test_aws_sessions_longer_than_an_hour_are_denied(tmp_path, clean_env):
    p = PolicyDev(tmp_path, session_duration=7200)
    p.write("team.cedar", TEAM_STORAGE)
    dev = p.start()
    try:
        for name in ("AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", "AWS_REGION"):
            clean_env.setenv(name, dev.exports[name])
        clean_env.setenv("AWS_EC2_METADATA_DISABLED", "true")
        with pytest.raises((CredentialRetrievalError, MetadataRetrievalError, NoCredentialsError)) as err:
            boto3.Session().get_credentials().get_frozen_credentials()
        assert "aws-at-most-an-hour" in str(err.value), str(err.value)
    finally:
        stop(dev)
