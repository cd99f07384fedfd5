"""Python azure-identity, unmodified, against `lanyard dev`."""

import time

import pytest
from azure.core.exceptions import ClientAuthenticationError
from azure.identity import (
    CredentialUnavailableError,
    DefaultAzureCredential,
    ManagedIdentityCredential,
)

import jwt_check

SCOPE = "https://storage.azure.com/.default"


def use(monkeypatch, dev, *names):
    for name in names:
        monkeypatch.setenv(name, dev.exports[name])


def check_token(dev, token):
    jwt_check.entra_access_token(token.token)
    now = time.time()
    assert now + 3000 < token.expires_on <= now + 3700
    dev.issued.append(token.token)


def test_imds_through_pod_identity_authority_host(dev, monkeypatch):
    use(monkeypatch, dev, "AZURE_POD_IDENTITY_AUTHORITY_HOST")
    cred = ManagedIdentityCredential()
    check_token(dev, cred.get_token(SCOPE))


def test_imds_with_bound_client_id(dev, monkeypatch):
    use(monkeypatch, dev, "AZURE_POD_IDENTITY_AUTHORITY_HOST")
    cred = ManagedIdentityCredential(client_id=dev.exports["AZURE_CLIENT_ID"])
    check_token(dev, cred.get_token(SCOPE))


def test_app_service_through_identity_endpoint(dev, monkeypatch):
    use(monkeypatch, dev, "IDENTITY_ENDPOINT", "IDENTITY_HEADER")
    cred = ManagedIdentityCredential()
    check_token(dev, cred.get_token(SCOPE))


def test_default_credential_chain_with_all_exports(dev, monkeypatch):
    for name in dev.exports:
        monkeypatch.setenv(name, dev.exports[name])
    cred = DefaultAzureCredential(
        exclude_cli_credential=True,
        exclude_developer_cli_credential=True,
        exclude_powershell_credential=True,
        exclude_visual_studio_code_credential=True,
        exclude_shared_token_cache_credential=True,
        exclude_interactive_browser_credential=True,
    )
    check_token(dev, cred.get_token(SCOPE))


def test_unbound_client_id_is_refused(dev, monkeypatch):
    use(monkeypatch, dev, "AZURE_POD_IDENTITY_AUTHORITY_HOST")
    cred = ManagedIdentityCredential(client_id="99999999-9999-9999-9999-999999999999")
    with pytest.raises(CredentialUnavailableError) as err:
        cred.get_token(SCOPE)
    assert "Identity not found" in str(err.value)


def test_wrong_identity_header_is_refused(dev, monkeypatch):
    monkeypatch.setenv("IDENTITY_ENDPOINT", dev.exports["IDENTITY_ENDPOINT"])
    monkeypatch.setenv("IDENTITY_HEADER", "not-the-secret")
    cred = ManagedIdentityCredential()
    with pytest.raises(ClientAuthenticationError) as err:
        cred.get_token(SCOPE)
    assert "X-IDENTITY-HEADER" in str(err.value)


def test_many_clients_cost_one_exchange(dev, monkeypatch):
    use(monkeypatch, dev, "AZURE_POD_IDENTITY_AUTHORITY_HOST")
    tokens = {ManagedIdentityCredential().get_token(SCOPE).token for _ in range(20)}
    assert len(tokens) == 1, "every client got the cached credential"
    dev.issued += list(tokens)
    assert dev.metric("lanyard_upstream_requests_total", cloud="azure", outcome="ok") == 1
    assert dev.metric("lanyard_cache_hits_total", cloud="azure") == 19
