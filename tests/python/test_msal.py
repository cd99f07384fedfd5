"""MSAL Python's ManagedIdentityClient, the async azure-identity credential,
and the older App Service protocol (MSI_ENDPOINT + MSI_SECRET, api-version
2017-09-01), unmodified, against `lanyard dev`.

Each test starts from the Azure variables `lanyard dev` exports, which are
what the webhook injects; a test that is about one surface drops the
variables of the surfaces an SDK would take before it, as a container that
sets its own environment would.
"""

import asyncio
import time

import msal
import pytest
import requests
from azure.identity.aio import ManagedIdentityCredential as AsyncManagedIdentityCredential

import jwt_check

RESOURCE = "https://storage.azure.com/"
SCOPE = RESOURCE + ".default"
AZURE = (
    "AZURE_POD_IDENTITY_AUTHORITY_HOST", "IDENTITY_ENDPOINT", "IDENTITY_HEADER",
    "MSI_ENDPOINT", "MSI_SECRET", "AZURE_CLIENT_ID", "AZURE_TENANT_ID",
)
# What an SDK takes before each surface (msal's and azure-identity's order:
# App Service, then the 2017 protocol, then IMDS).
BEFORE = {
    "app_service": (),
    "msi_2017": ("IDENTITY_ENDPOINT", "IDENTITY_HEADER"),
    "imds": ("IDENTITY_ENDPOINT", "IDENTITY_HEADER", "MSI_ENDPOINT", "MSI_SECRET"),
}


def pod_env(dev, monkeypatch, surface):
    for name in AZURE:
        if name in dev.exports and name not in BEFORE[surface]:
            monkeypatch.setenv(name, dev.exports[name])


def identities(dev):
    return [
        ("system", msal.SystemAssignedManagedIdentity()),
        ("user", msal.UserAssignedManagedIdentity(client_id=dev.exports["AZURE_CLIENT_ID"])),
    ]


def check(dev, result):
    assert "access_token" in result, result
    jwt_check.entra_access_token(result["access_token"])
    dev.issued.append(result["access_token"])


@pytest.mark.parametrize("surface", ["imds", "app_service", "msi_2017"])
def test_msal_managed_identity_client(dev, monkeypatch, surface):
    pod_env(dev, monkeypatch, surface)
    expected = {
        "imds": msal.managed_identity.DEFAULT_TO_VM,
        "app_service": msal.managed_identity.APP_SERVICE,
        "msi_2017": msal.managed_identity.MACHINE_LEARNING,
    }[surface]
    assert msal.managed_identity.get_managed_identity_source() is expected
    for name, identity in identities(dev):
        client = msal.ManagedIdentityClient(identity, http_client=requests.Session())
        result = client.acquire_token_for_client(resource=RESOURCE)
        check(dev, result)
        # msal keeps it: the token is taken from its cache while it is
        # comfortably valid, so Lanyard's expiry must be far enough out.
        again = client.acquire_token_for_client(resource=RESOURCE)
        assert again["access_token"] == result["access_token"], name
        assert again.get("token_source") == "cache", (name, again.get("token_source"))


def test_msal_unbound_client_id_is_refused(dev, monkeypatch):
    pod_env(dev, monkeypatch, "msi_2017")
    client = msal.ManagedIdentityClient(
        msal.UserAssignedManagedIdentity(client_id="99999999-9999-9999-9999-999999999999"),
        http_client=requests.Session(),
    )
    result = client.acquire_token_for_client(resource=RESOURCE)
    assert "access_token" not in result
    assert "Identity not found" in str(result), result


@pytest.mark.parametrize("surface", ["imds", "app_service", "msi_2017"])
def test_async_azure_identity(dev, monkeypatch, surface):
    pod_env(dev, monkeypatch, surface)

    async def get(client_id):
        async with AsyncManagedIdentityCredential(client_id=client_id) as cred:
            return await cred.get_token(SCOPE)

    for client_id in (None, dev.exports["AZURE_CLIENT_ID"]):
        token = asyncio.run(get(client_id))
        jwt_check.entra_access_token(token.token)
        now = time.time()
        assert now + 3000 < token.expires_on <= now + 3700, (surface, token.expires_on - now)
        dev.issued.append(token.token)


# -- through lanyard-sidecar + lanyard agent ---------------------------------

from test_agent_sidecar import split  # noqa: E402,F401  (a pytest fixture)
from test_node_clients import sidecar_exports, surfaces_since  # noqa: E402


def sidecar_env(dev, split, monkeypatch, surface):
    """The Azure variables the webhook injects next to the sidecar, less
    those an SDK takes before `surface`."""
    env = sidecar_exports(dev, split)
    for name in AZURE:
        monkeypatch.delenv(name, raising=False)
        if name in env and name not in BEFORE[surface]:
            monkeypatch.setenv(name, env[name])


@pytest.mark.parametrize("surface", ["imds", "app_service", "msi_2017"])
def test_msal_and_async_azure_identity_through_sidecar_and_agent(dev, split, monkeypatch, surface):
    sidecar_env(dev, split, monkeypatch, surface)
    offset = split["agent_log"].stat().st_size
    for _, identity in identities(dev):
        client = msal.ManagedIdentityClient(identity, http_client=requests.Session())
        check(dev, client.acquire_token_for_client(resource=RESOURCE))

    async def get():
        async with AsyncManagedIdentityCredential() as cred:
            return await cred.get_token(SCOPE)

    token = asyncio.run(get())
    jwt_check.entra_access_token(token.token)
    dev.issued.append(token.token)
    # The agent decided them, for the surface the SDKs called.
    expected = "azure_imds" if surface == "imds" else "app_service"
    assert set(surfaces_since(split["agent_log"], offset)) == {expected}
