"""Decoding a JWT payload for assertions (signatures are checked elsewhere)."""

import base64
import json


def payload(token: str) -> dict:
    part = token.split(".")[1]
    part += "=" * (-len(part) % 4)
    return json.loads(base64.urlsafe_b64decode(part))


def entra_access_token(token: str, resource: str = "https://storage.azure.com") -> dict:
    """Asserts `token` is an Entra v1 access token for `resource`, shaped as
    Entra issues them to apps (what the Entra emulator signs), and returns
    its claims."""
    claims = payload(token)
    # A trailing "/" on the resource is kept in `aud` as it was asked for.
    assert claims["aud"].rstrip("/") == resource.rstrip("/"), claims
    assert claims["iss"] == f"https://sts.windows.net/{claims['tid']}/", claims
    assert claims["ver"] == "1.0" and claims["idtyp"] == "app", claims
    assert claims["oid"] and claims["appid"], claims
    assert claims["nbf"] <= claims["iat"] < claims["exp"], claims
    return claims
