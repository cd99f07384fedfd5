"""The container image scripts/build-image builds (Containerfile), as the
test command builds it (LANYARD_TEST_IMAGE, in the podman store at
LANYARD_PODMAN_ROOT): its configuration, its exact contents, and its
binaries run chrooted into it as uid 65532 (containers cannot be run here:
the OCI runtime needs cgroups). The statically linked agent, in a copy of
the image, resolves a name through /etc/resolv.conf (a DNS server of the
test's own) and trusts a TLS issuer only through the image's CA bundle.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import socketserver
import ssl
import struct
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

IMAGE = os.environ.get("LANYARD_TEST_IMAGE")
pytestmark = pytest.mark.skipif(
    not IMAGE or os.geteuid() != 0,
    reason="no image built (scripts/test builds one with podman, as root; LANYARD_TEST_IMAGE)",
)

EXPECTED_FILES = {
    "usr/local/bin/lanyard",
    "usr/local/bin/lanyard-sidecar",
    "etc/ssl/certs/ca-certificates.crt",
    "usr/share/doc/lanyard/LICENSE",
    "usr/share/doc/lanyard/THIRD-PARTY-LICENSES",
    "usr/share/doc/lanyard/glibc.copyright",
    "usr/share/doc/lanyard/LGPL-2.1",
    "usr/share/doc/lanyard/ca-certificates.copyright",
    "usr/share/doc/lanyard/MPL-2.0",
    "usr/share/doc/lanyard/sbom.cdx.json",
}
# Roots that the clouds' token endpoints chain to: Entra ID
# (login.microsoftonline.com), Google (sts/iamcredentials.googleapis.com),
# AWS STS.
CLOUD_ROOTS = ["DigiCert Global Root G2", "GTS Root R1", "Amazon Root CA 1"]
ISSUER_HOST = "issuer.lanyard.test"
# Found on the test's PATH: the chrooted process gets the image's own env.
CHROOT = shutil.which("chroot") or "/usr/sbin/chroot"


def podman(*args: str) -> str:
    root = os.environ.get("LANYARD_PODMAN_ROOT")
    cmd = ["podman"]
    if root:
        cmd += ["--storage-driver", "vfs", "--root", f"{root}/storage", "--runroot", f"{root}/run"]
    out = subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.fixture(scope="module")
def image():
    config = json.loads(podman("image", "inspect", IMAGE))[0]
    mount = Path(podman("image", "mount", IMAGE))
    try:
        yield config, mount
    finally:
        podman("image", "unmount", IMAGE)


def files_under(root: Path) -> set[str]:
    found = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            found.add(str(Path(dirpath, name).relative_to(root)))
        for name in dirnames:
            p = Path(dirpath, name)
            if p.is_symlink():
                found.add(str(p.relative_to(root)))
    return found


def chroot(root: Path, *argv: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([CHROOT, "--userspec=65532:65532", str(root), *argv],
                          env=env, capture_output=True, text=True, **kw)


def image_env(config: dict) -> dict:
    return dict(e.split("=", 1) for e in config["Config"]["Env"])


def test_configuration_user_entrypoint_labels(image):
    config, _ = image
    c = config["Config"]
    assert c["User"] == "65532:65532"
    assert c["Entrypoint"] == ["/usr/local/bin/lanyard"]
    env = image_env(config)
    assert env["PATH"] == "/usr/local/bin"
    assert env["SSL_CERT_FILE"] == "/etc/ssl/certs/ca-certificates.crt"
    labels = c["Labels"]
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert labels["org.opencontainers.image.version"] == "0.1.0"
    assert labels["org.opencontainers.image.source"] and labels["org.opencontainers.image.revision"]
    print(f"\nimage {IMAGE}: {config['Size'] / 2**20:.1f} MiB")


def test_only_binaries_certificates_and_licences_are_inside(image):
    _, root = image
    assert files_under(root) == EXPECTED_FILES
    for binary in ("lanyard", "lanyard-sidecar"):
        headers = subprocess.run(["readelf", "-l", str(root / "usr/local/bin" / binary)],
                                 capture_output=True, text=True, check=True).stdout
        assert "INTERP" not in headers, f"{binary} is dynamically linked"
    bundle = root / "etc/ssl/certs/ca-certificates.crt"
    subjects = subprocess.run(
        f"openssl crl2pkcs7 -nocrl -certfile {bundle} | openssl pkcs7 -print_certs -noout",
        shell=True, capture_output=True, text=True, check=True).stdout
    for name in CLOUD_ROOTS:
        assert name in subjects, name
    third_party = (root / "usr/share/doc/lanyard/THIRD-PARTY-LICENSES").read_text()
    for crate in ("tokio ", "rustls ", "cedar-policy ", "aws-lc-rs "):
        assert f"\n{crate}" in third_party, crate
    assert "Permission is hereby granted" in third_party  # the MIT texts themselves
    # The SBOM inside it (scripts/sbom; tests/python/test_sbom.py checks
    # its content): CycloneDX, naming the binaries' crates.
    sbom = json.loads((root / "usr/share/doc/lanyard/sbom.cdx.json").read_text())
    assert sbom["bomFormat"] == "CycloneDX" and sbom["specVersion"] == "1.5"
    names = {c["name"] for c in sbom["components"]}
    assert {"tokio", "rustls", "cedar-policy", "lanyard-sidecar", "libc6-dev"} <= names


def test_the_binaries_run_chrooted_as_the_image_user(image):
    config, root = image
    env = image_env(config)
    version = chroot(root, "/usr/local/bin/lanyard", "--version", env=env, timeout=30)
    assert version.returncode == 0 and "0.1.0" in version.stdout, version
    dev = chroot(root, "lanyard", "dev", "--help", env=env, timeout=30)
    assert dev.returncode == 0 and "--token-lifetime" in dev.stdout, dev
    # As the webhook injects it: `command: [lanyard-sidecar]`, found on PATH.
    sidecar = chroot(root, "lanyard-sidecar", "--help", env=env, timeout=30)
    assert sidecar.returncode == 0 and "--agent" in sidecar.stdout, sidecar


class DnsServer(socketserver.BaseRequestHandler):
    """Answers A queries for ISSUER_HOST with 127.0.0.1, NXDOMAIN otherwise."""

    queries: list[str] = []

    def handle(self):
        data, sock = self.request
        tid, _flags, _qd = struct.unpack(">HHH", data[:6])
        i, labels = 12, []
        while data[i]:
            labels.append(data[i + 1:i + 1 + data[i]].decode())
            i += data[i] + 1
        qtype = struct.unpack(">H", data[i + 1:i + 3])[0]
        name = ".".join(labels)
        DnsServer.queries.append(name)
        question = data[12:i + 5]
        if name == ISSUER_HOST and qtype == 1:
            answer = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 30, 4) + socket.inet_aton("127.0.0.1")
            header = struct.pack(">HHHHHH", tid, 0x8180, 1, 1, 0, 0)
        else:
            answer = b""
            rcode = 0 if name == ISSUER_HOST else 3
            header = struct.pack(">HHHHHH", tid, 0x8180 | rcode, 1, 0, 0, 0)
        sock.sendto(header + question + answer, self.client_address)


def make_issuer_tls(tmp: Path) -> tuple[Path, Path, Path, dict]:
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", tmp / "ca.key", "-out", tmp / "ca.crt",
        "-days", "1", "-subj", "/CN=Lanyard test root")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", tmp / "server.key", "-out", tmp / "server.csr",
        "-subj", f"/CN={ISSUER_HOST}")
    (tmp / "ext").write_text(f"subjectAltName=DNS:{ISSUER_HOST}\n")
    run("x509", "-req", "-in", tmp / "server.csr", "-CA", tmp / "ca.crt", "-CAkey", tmp / "ca.key",
        "-CAcreateserial", "-out", tmp / "server.crt", "-days", "1", "-extfile", tmp / "ext")
    # The issuer's signing key, published as an RS256 JWK.
    run("genrsa", "-out", tmp / "signing.key", "2048")
    modulus = subprocess.run(["openssl", "rsa", "-in", tmp / "signing.key", "-noout", "-modulus"],
                             capture_output=True, text=True, check=True).stdout.strip().split("=", 1)[1]
    import base64

    n = base64.urlsafe_b64encode(bytes.fromhex(modulus)).rstrip(b"=").decode()
    jwk = {"kty": "RSA", "alg": "RS256", "use": "sig", "kid": "test", "n": n, "e": "AQAB"}
    return tmp / "ca.crt", tmp / "server.crt", tmp / "server.key", jwk


def serve_issuer(cert: Path, key: Path, jwk: dict) -> tuple[HTTPServer, list[str]]:
    seen: list[str] = []
    holder = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            seen.append(self.path)
            base = f"https://{ISSUER_HOST}:{holder['port']}"
            docs = {"/.well-known/openid-configuration": {"issuer": base, "jwks_uri": f"{base}/openid/v1/jwks",
                                                          "response_types_supported": ["id_token"],
                                                          "subject_types_supported": ["public"],
                                                          "id_token_signing_alg_values_supported": ["RS256"]},
                    "/openid/v1/jwks": {"keys": [jwk]}}
            body = json.dumps(docs.get(self.path, {})).encode()
            self.send_response(200 if self.path in docs else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    holder["port"] = server.server_address[1]
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


def start_agent(root: Path, env: dict, admin_port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [CHROOT, "--userspec=65532:65532", str(root), "lanyard", "--config", "/lanyard.yaml", "agent",
         "--listen", "127.0.0.1:0", "--admin-listen", f"127.0.0.1:{admin_port}"],
        env={**env, "NODE_NAME": "node-a"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def test_the_static_agent_resolves_names_and_trusts_only_the_image_roots(image, tmp_path):
    config, mounted = image
    try:
        dns = socketserver.UDPServer(("127.0.0.1", 53), DnsServer)
    except OSError as e:
        pytest.skip(f"port 53 on loopback is taken ({e}); the DNS check needs it")
    threading.Thread(target=dns.serve_forever, daemon=True).start()
    ca, cert, key, jwk = make_issuer_tls(tmp_path)
    server, seen = serve_issuer(cert, key, jwk)
    root = tmp_path / "rootfs"
    shutil.copytree(mounted, root, symlinks=True)
    (root / "etc/resolv.conf").write_text("nameserver 127.0.0.1\n")
    (root / "etc/hosts").write_text("127.0.0.1 localhost\n")
    port = server.server_address[1]
    (root / "lanyard.yaml").write_text(
        f"cluster:\n  issuer: https://{ISSUER_HOST}:{port}\n  service_accounts:\n"
        "    - namespace: ray\n      name: ray-worker\n")
    env = image_env(config)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        admin = s.getsockname()[1]
    try:
        # Without the test root in the image's bundle: refused, and says why.
        agent = start_agent(root, env, admin)
        out, _ = agent.communicate(timeout=60)
        assert agent.returncode != 0, out
        assert "certificate" in out.lower() or "unknown issuer" in out.lower() or "invalid peer" in out.lower(), out
        assert ISSUER_HOST in DnsServer.queries, DnsServer.queries
        # With it: the agent resolves the issuer, fetches its keys and is ready.
        with open(root / "etc/ssl/certs/ca-certificates.crt", "a") as bundle:
            bundle.write(ca.read_text())
        seen.clear()
        agent = start_agent(root, env, admin)
        try:
            deadline = time.monotonic() + 60
            while not ready(admin):
                assert agent.poll() is None, agent.stdout.read()
                assert time.monotonic() < deadline, "agent not ready"
                time.sleep(0.2)
            assert "/openid/v1/jwks" in seen or "/.well-known/openid-configuration" in seen, seen
        finally:
            agent.terminate()
            agent.wait(timeout=15)
        assert agent.returncode == 0, agent.stdout.read()
    finally:
        server.shutdown()
        dns.shutdown()
        dns.server_close()
