"""A small client of the OCI distribution API (v2): push and fetch blobs
and manifests by digest or tag, which is all that attaching signatures
and attestations takes.

Why not a tool: the image goes up with podman and the chart with Helm's
own engine; what is left is writing cosign's `sha256-<hex>.sig` and
`.att` manifests, which neither podman nor skopeo can (Debian's builds
have sigstore signing compiled out: "Debian-local change: sigstore
disabled") and cosign is not packaged here.

The protocol is the distribution spec's
(https://github.com/opencontainers/distribution-spec/blob/main/spec.md):
a monolithic blob upload is `POST /v2/<name>/blobs/uploads/` then `PUT
<location>?digest=`; a manifest is `PUT /v2/<name>/manifests/<ref>` with
its media type; the registry answers `Docker-Content-Digest`.

Authentication: none, HTTP Basic with the credentials it is given, or
the bearer-token challenge registries such as ghcr.io and Docker Hub
answer with (the token fetched with those credentials). The password is sent only to the registry and its token
realm, and never printed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import urllib.error
import urllib.parse
import urllib.request

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
ACCEPT = ", ".join([OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST])


class RegistryError(Exception):
    """A registry refused a request or could not be reached."""


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def split_reference(ref: str) -> tuple[str, str]:
    """`host[:port]/path` → (host, path)."""
    host, _, path = ref.partition("/")
    if not host or not path:
        raise RegistryError(f"not a registry repository: {ref!r} (want HOST[:PORT]/PATH)")
    return host, path


class Registry:
    def __init__(
        self, host: str, *, plain_http: bool = False, credentials: tuple[str, str] | None = None, timeout: float = 60.0
    ):
        self.base = f"{'http' if plain_http else 'https'}://{host}"
        self.timeout = timeout
        self._user, self._password = credentials or (None, None)
        self._auth: str | None = None

    # -- transport --------------------------------------------------------

    def _basic(self) -> str | None:
        if self._user is None or self._password is None:
            return None
        pair = f"{self._user}:{self._password}".encode()
        return "Basic " + base64.b64encode(pair).decode()

    def _token(self, challenge: str) -> str:
        params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
        realm = params.pop("realm", None)
        if not realm:
            raise RegistryError("the registry's bearer challenge names no realm")
        url = realm + "?" + urllib.parse.urlencode(params)
        req = urllib.request.Request(url)
        basic = self._basic()
        if basic:
            req.add_header("Authorization", basic)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as err:
            raise RegistryError(f"token request to {realm} refused: HTTP {err.code}") from None
        token = body.get("token") or body.get("access_token")
        if not token:
            raise RegistryError(f"the token service {realm} returned no token")
        return "Bearer " + token

    def _request(self, method: str, url: str, data: bytes | None = None, headers: dict | None = None):
        if not url.startswith("http"):
            url = self.base + url
        for attempt in range(2):
            req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
            if self._auth:
                req.add_header("Authorization", self._auth)
            try:
                return urllib.request.urlopen(req, timeout=self.timeout)
            except urllib.error.HTTPError as err:
                challenge = err.headers.get("WWW-Authenticate", "")
                if err.code == 401 and attempt == 0:
                    if challenge.lower().startswith("bearer"):
                        self._auth = self._token(challenge)
                        continue
                    if challenge.lower().startswith("basic") and self._basic():
                        self._auth = self._basic()
                        continue
                detail = err.read(2048).decode("utf-8", "replace")
                raise RegistryError(f"{method} {urllib.parse.urlsplit(url).path}: HTTP {err.code} {detail.strip()}") from None
            except urllib.error.URLError as err:
                raise RegistryError(f"{method} {url}: {err.reason}") from None
        raise RegistryError(f"{method} {url}: not authorised")

    # -- blobs and manifests ----------------------------------------------

    def has_blob(self, repo: str, digest: str) -> bool:
        try:
            self._request("HEAD", f"/v2/{repo}/blobs/{digest}").close()
            return True
        except RegistryError as err:
            if "HTTP 404" in str(err):
                return False
            raise

    def push_blob(self, repo: str, data: bytes) -> str:
        digest = sha256_digest(data)
        if self.has_blob(repo, digest):
            return digest
        with self._request("POST", f"/v2/{repo}/blobs/uploads/", b"") as resp:
            location = resp.headers["Location"]
        url = urllib.parse.urljoin(self.base + "/", location)
        sep = "&" if "?" in url else "?"
        self._request(
            "PUT",
            f"{url}{sep}digest={urllib.parse.quote(digest)}",
            data,
            {"Content-Type": "application/octet-stream", "Content-Length": str(len(data))},
        ).close()
        return digest

    def push_manifest(self, repo: str, ref: str, body: bytes, media_type: str) -> str:
        with self._request("PUT", f"/v2/{repo}/manifests/{ref}", body, {"Content-Type": media_type}) as resp:
            digest = resp.headers.get("Docker-Content-Digest") or sha256_digest(body)
        if digest != sha256_digest(body):
            raise RegistryError(f"the registry stored {repo}:{ref} as {digest}, not as the manifest sent")
        return digest

    def manifest(self, repo: str, ref: str) -> tuple[bytes, str, str]:
        """(body, media type, digest) of a manifest, or RegistryError (404 included)."""
        with self._request("GET", f"/v2/{repo}/manifests/{ref}", headers={"Accept": ACCEPT}) as resp:
            body = resp.read()
            media_type = resp.headers.get("Content-Type", "")
        return body, media_type, sha256_digest(body)

    def blob(self, repo: str, digest: str) -> bytes:
        with self._request("GET", f"/v2/{repo}/blobs/{digest}") as resp:
            data = resp.read()
        if sha256_digest(data) != digest:
            raise RegistryError(f"blob {digest} of {repo} does not match its digest")
        return data
