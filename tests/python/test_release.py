"""The release, done as a user meets it: `scripts/release` pushes the image
and the chart to an OCI registry (Debian's docker-registry, on loopback),
and everything is then checked from the registry alone, with code that is
not Lanyard's:

- the signatures of the image and the chart by sigstore-rs, the Sigstore
  project's Rust implementation of cosign's verification
  (tests/cosign-verify wires its client and `PublicKeyVerifier`; Debian's
  podman and skopeo, which the issue proposed, have sigstore signing and
  verification compiled out: "Debian-local change: sigstore disabled");
- the attestations' DSSE envelopes by securesystemslib, the SBOM by
  CycloneDX's own validator, the chart pulled and installed by Helm's
  engine, the image pulled by podman;
- a replaced image, a replaced chart, a forged attestation and a foreign
  key each fail.

The image is the one the test command builds (LANYARD_TEST_IMAGE); the
release command is given it instead of building another.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import stop_process

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from releasing import cosign, oci, statements  # noqa: E402

VERSION = "0.1.0"
IMAGE = os.environ.get("LANYARD_TEST_IMAGE")
REGISTRY_BIN = shutil.which("docker-registry")
VERIFY = Path(os.environ.get("LANYARD_COSIGN_VERIFY", ROOT / "target" / "debug" / "lanyard-cosign-verify"))
PASSPHRASE = "correct horse battery staple"

needs_registry = pytest.mark.skipif(
    REGISTRY_BIN is None or IMAGE is None or not VERIFY.exists(),
    reason="needs docker-registry, the test image (LANYARD_TEST_IMAGE) and tests/cosign-verify built (scripts/test)",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_registry(tmp: Path, users: dict | None = None) -> tuple[subprocess.Popen, str]:
    """Debian's docker-registry on a loopback port; with `users`, behind
    HTTP Basic authentication (an htpasswd file of bcrypt hashes)."""
    import bcrypt

    port = free_port()
    config = {
        "version": 0.1,
        "log": {"level": "warn"},
        "storage": {"filesystem": {"rootdirectory": str(tmp / "data")}, "delete": {"enabled": True}},
        "http": {"addr": f"127.0.0.1:{port}"},
    }
    if users:
        htpasswd = tmp / "htpasswd"
        htpasswd.write_text("".join(f"{u}:{bcrypt.hashpw(p.encode(), bcrypt.gensalt()).decode()}\n" for u, p in users.items()))
        config["auth"] = {"htpasswd": {"realm": "lanyard-test", "path": str(htpasswd)}}
    (tmp / "config.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([REGISTRY_BIN, "serve", str(tmp / "config.yml")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2):
                break
        except urllib.error.HTTPError as err:
            if users and err.code == 401:
                break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"docker-registry did not start: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.1)
    return proc, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    proc, address = start_registry(tmp_path_factory.mktemp("registry"))
    yield address
    stop_process(proc)


def keygen(directory: Path, name: str) -> tuple[Path, Path]:
    out = subprocess.run(
        [sys.executable, "scripts/release", "keygen", str(directory / name)],
        cwd=ROOT, env={**os.environ, "COSIGN_PASSWORD": PASSPHRASE}, check=True, capture_output=True, text=True,
    ).stdout.split()
    return Path(out[0]), Path(out[1])


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keys")
    private, public = keygen(tmp, "release")
    passphrase = tmp / "passphrase"
    passphrase.write_text(PASSPHRASE + "\n")
    _, foreign = keygen(tmp, "someone-else")
    return {"private": private, "public": public, "passphrase": passphrase, "foreign": foreign}


def release(registry: str, keys: dict, path: str, env: dict | None = None) -> subprocess.CompletedProcess:
    argv = [
        sys.executable, "scripts/release", "--version", VERSION, "--registry", f"{registry}/{path}",
        "--key", str(keys["private"]), "--passphrase-file", str(keys["passphrase"]),
        "--public-key-url", "https://keys.example/lanyard/cosign.pub", "--plain-http", "--image", IMAGE,
    ]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def released(registry: str, keys: dict, path: str) -> dict:
    proc = release(registry, keys, path)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def published(registry, keys):
    return released(registry, keys, "platform")


def verify(reference: str, public: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(VERIFY), "--key", str(public), "--plain-http", reference], capture_output=True, text=True, timeout=120
    )


def image_ref(summary: dict) -> tuple[str, str]:
    name, _, digest = summary["image"].partition("@")
    return name, digest


def repo_of(name: str) -> tuple[str, str]:
    """'HOST/PATH' -> (HOST, PATH)."""
    return oci.split_reference(name)


pytestmark = needs_registry


def test_the_image_and_the_chart_verify_against_the_release_key(published, keys):
    name, digest = image_ref(published)
    for reference in (f"{name}:{VERSION}", f"{name}@{digest}"):
        proc = verify(reference, keys["public"])
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == f"verified {digest}"
    chart = published["chart"]["ref"].removeprefix("oci://")
    proc = verify(f"{chart}:{VERSION}", keys["public"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"verified {published['chart']['digest']}"


def test_another_key_verifies_nothing(published, keys):
    name, _ = image_ref(published)
    chart = published["chart"]["ref"].removeprefix("oci://")
    for reference in (f"{name}:{VERSION}", f"{chart}:{VERSION}"):
        proc = verify(reference, keys["foreign"])
        assert proc.returncode == 1
        assert "verifies under the key" in proc.stderr


def test_a_replaced_image_fails_verification(registry, keys, tmp_path):
    """The tag is moved to an image whose config runs as root, first
    unsigned, then signed with another key: neither verifies, while the
    released digest still does."""
    summary = released(registry, keys, "tampered-image")
    name, digest = image_ref(summary)
    host, repo = repo_of(name)
    client = oci.Registry(host, plain_http=True)
    manifest = json.loads(client.manifest(repo, VERSION)[0])
    config = json.loads(client.blob(repo, manifest["config"]["digest"]))
    assert config["config"]["User"] == "65532:65532"
    config["config"]["User"] = "0:0"
    body = json.dumps(config).encode()
    manifest["config"] = {**manifest["config"], "digest": client.push_blob(repo, body), "size": len(body)}
    forged = client.push_manifest(repo, VERSION, json.dumps(manifest).encode(), manifest["mediaType"])
    assert forged != digest

    proc = verify(f"{name}:{VERSION}", keys["public"])
    assert proc.returncode == 1 and f"no signature for {forged}" in proc.stderr

    attacker = cosign.load_private_key(*_unlocked(tmp_path))
    cosign.sign(client, repo, forged, attacker, identity=name)
    proc = verify(f"{name}:{VERSION}", keys["public"])
    assert proc.returncode == 1 and "verifies under the key" in proc.stderr

    assert verify(f"{name}@{digest}", keys["public"]).returncode == 0


def _unlocked(tmp_path: Path) -> tuple[bytes, bytes]:
    private, _ = keygen(tmp_path, "attacker")
    return private.read_bytes(), PASSPHRASE.encode()


def test_a_replaced_chart_fails_verification(registry, keys, tmp_path):
    """The same chart version pushed again with its image digest changed:
    Helm pulls the new one, and its signature check fails."""
    import helm_python as helm
    import helm_python.registry as helm_registry

    summary = released(registry, keys, "tampered-chart")
    ref = summary["chart"]["ref"]
    pulled = tmp_path / "pulled"
    helm_registry.pull(ref, version=VERSION, destination=pulled, untar=True, untar_dir=pulled, plain_http=True)
    values = pulled / "lanyard" / "values.yaml"
    text = values.read_text()
    _, digest = image_ref(summary)
    assert f'digest: "{digest}"' in text
    values.write_text(text.replace(digest, "sha256:" + "0" * 64))
    archive = helm.package(pulled / "lanyard", destination=tmp_path)
    helm_registry.push(archive, ref.rsplit("/", 1)[0], plain_http=True)

    again = tmp_path / "again"
    helm_registry.pull(ref, version=VERSION, destination=again, untar=True, untar_dir=again, plain_http=True)
    assert "0" * 64 in (again / "lanyard" / "values.yaml").read_text()
    proc = verify(f"{ref.removeprefix('oci://')}:{VERSION}", keys["public"])
    assert proc.returncode == 1 and "no signature for" in proc.stderr


def attestations(reference: str, digest: str) -> list[dict]:
    """The envelopes in cosign's `.att` of `digest`, fetched over the
    registry API."""
    host, repo = repo_of(reference)
    client = oci.Registry(host, plain_http=True)
    manifest = json.loads(client.manifest(repo, cosign.tag_for(digest, "att"))[0])
    out = []
    for layer in manifest["layers"]:
        assert layer["mediaType"] == "application/vnd.dsse.envelope.v1+json"
        envelope = json.loads(client.blob(repo, layer["digest"]))
        out.append({"annotations": layer["annotations"], "envelope": envelope})
    return out


def verified_statement(envelope: dict, public: Path) -> dict:
    """securesystemslib's DSSE verification under the public key; the
    statement it verified."""
    from cryptography.hazmat.primitives.serialization import load_pem_public_key
    from securesystemslib.dsse import Envelope
    from securesystemslib.signer import SSlibKey

    # cosign writes an empty keyid; securesystemslib matches keyids
    # before it verifies, so the key is given the same (empty) one.
    computed = SSlibKey.from_crypto(load_pem_public_key(public.read_bytes()))
    key = SSlibKey("", computed.keytype, computed.scheme, computed.keyval)
    parsed = Envelope.from_dict(json.loads(json.dumps(envelope)))
    assert parsed.payload_type == "application/vnd.in-toto+json"
    parsed.verify([key], 1)
    return json.loads(parsed.payload)


def test_the_sbom_and_the_provenance_are_signed_attestations_of_the_image(published, keys):
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator
    from test_sbom import cargo_tree

    name, digest = image_ref(published)
    found = {a["annotations"]["predicateType"]: a["envelope"] for a in attestations(name, digest)}
    assert set(found) == {statements.CYCLONEDX, statements.SLSA_PROVENANCE_V1}

    sbom_statement = verified_statement(found[statements.CYCLONEDX], keys["public"])
    assert sbom_statement["_type"] == statements.STATEMENT == "https://in-toto.io/Statement/v0.1"
    assert sbom_statement["subject"] == [{"name": name, "digest": {"sha256": digest.removeprefix("sha256:")}}]
    sbom = sbom_statement["predicate"]
    assert JsonStrictValidator(SchemaVersion.V1_5).validate_str(json.dumps(sbom)) is None
    assert sbom["metadata"]["component"]["hashes"] == [{"alg": "SHA-256", "content": digest.removeprefix("sha256:")}]
    named = {(c["name"], c["version"]) for c in sbom["components"] if c.get("purl", "").startswith("pkg:cargo/")}
    linked = set(cargo_tree()) - {("lanyard", sbom["metadata"]["component"]["version"])}
    assert named == linked, "the attested SBOM does not name exactly the crates the binaries are built from"
    debian = {c["name"] for c in sbom["components"] if c.get("purl", "").startswith("pkg:deb/")}
    assert {"ca-certificates", "libc6-dev"} <= debian
    assert all(c.get("licenses") for c in sbom["components"])

    provenance = verified_statement(found[statements.SLSA_PROVENANCE_V1], keys["public"])
    chart = published["chart"]
    assert provenance["subject"] == [
        {"name": name, "digest": {"sha256": digest.removeprefix("sha256:")}},
        {"name": chart["ref"].removeprefix("oci://"), "digest": {"sha256": chart["digest"].removeprefix("sha256:")}},
    ]
    build = provenance["predicate"]["buildDefinition"]
    assert build["buildType"] == statements.BUILD_TYPE
    assert build["externalParameters"]["version"] == VERSION
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    deps = {d.get("name", "source"): d for d in build["resolvedDependencies"]}
    assert deps["source"]["digest"] == {"gitCommit": commit}
    import hashlib

    assert deps["Cargo.lock"]["digest"]["sha256"] == hashlib.sha256((ROOT / "Cargo.lock").read_bytes()).hexdigest()

    # The chart carries the same provenance.
    chart_att = attestations(chart["ref"].removeprefix("oci://"), chart["digest"])
    assert [a["annotations"]["predicateType"] for a in chart_att] == [statements.SLSA_PROVENANCE_V1]
    assert verified_statement(chart_att[0]["envelope"], keys["public"]) == provenance


def test_a_forged_attestation_or_a_foreign_key_fails(published, keys):
    from securesystemslib.exceptions import VerificationError

    name, digest = image_ref(published)
    envelope = next(a["envelope"] for a in attestations(name, digest)
                    if a["annotations"]["predicateType"] == statements.CYCLONEDX)
    statement = json.loads(base64.b64decode(envelope["payload"]))
    statement["predicate"]["components"] = statement["predicate"]["components"][1:]
    forged = {**envelope, "payload": base64.b64encode(json.dumps(statement).encode()).decode()}
    with pytest.raises(VerificationError):
        verified_statement(forged, keys["public"])
    with pytest.raises(VerificationError):
        verified_statement(envelope, keys["foreign"])
    # The control: the untouched envelope verifies.
    assert verified_statement(envelope, keys["public"])["subject"][0]["name"] == name


def test_the_chart_installs_from_the_registry_pinned_to_the_signed_image(published):
    """Helm's engine pulls the chart from the registry and renders an
    install (client dry run, no cluster): every container runs the
    released image by digest, and the chart says what Artifact Hub reads."""
    import helm_python as helm
    import helm_python.registry as helm_registry

    name, digest = image_ref(published)
    with helm.Config(storage_driver="memory", namespace="lanyard-system") as config:
        rendered = config.install(
            published["chart"]["ref"], "lanyard", {"cluster": {"name": "test"}},
            namespace="lanyard-system", dry_run="client", chart_version=VERSION, plain_http=True,
        )
    objects = [o for o in yaml.safe_load_all(rendered["manifest"]) if o]
    images = set()
    for o in objects:
        spec = o.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            images.add(c["image"])
    assert images == {f"{name}@{digest}"}
    # The webhook injects the same image as the sidecar.
    assert f"{name}@{digest}" in json.dumps([o for o in objects if o["kind"] == "ConfigMap"])

    shown = yaml.safe_load(helm_registry.show(f"{published['chart']['ref']}:{VERSION}", output_format="chart",
                                              plain_http=True))
    assert shown["version"] == VERSION and shown["appVersion"] == VERSION
    notes = shown["annotations"]
    assert yaml.safe_load(notes["artifacthub.io/images"]) == [{"name": "lanyard", "image": f"{name}@{digest}"}]
    assert yaml.safe_load(notes["artifacthub.io/signKey"]) == {
        "fingerprint": published["publicKeySha256"], "url": "https://keys.example/lanyard/cosign.pub"}
    assert notes["artifacthub.io/license"] == "Apache-2.0"
    assert yaml.safe_load(notes["artifacthub.io/changes"])


def test_podman_pulls_the_image_by_digest_and_it_runs_as_65532(published):
    name, digest = image_ref(published)
    # podman refuses a run root longer than 50 characters.
    # The store is removed whatever happens (vfs copies every layer).
    with tempfile.TemporaryDirectory(prefix="lanyard-pull-", ignore_cleanup_errors=True) as tmp:
        store = Path(tmp)
        podman = ["podman", "--storage-driver", "vfs", "--root", str(store / "s"), "--runroot", str(store / "r")]
        subprocess.run(podman + ["pull", "--quiet", "--tls-verify=false", f"{name}@{digest}"], check=True,
                       capture_output=True, timeout=300)
        config = json.loads(subprocess.run(podman + ["image", "inspect", f"{name}@{digest}"], check=True,
                                           capture_output=True, text=True).stdout)[0]
    assert config["Config"]["User"] == "65532:65532"
    assert config["Digest"] == digest


def test_a_wrong_passphrase_or_version_stops_the_release_before_anything_is_pushed(registry, keys, tmp_path):
    bad = tmp_path / "wrong"
    bad.write_text("not it\n")
    proc = release(registry, {**keys, "passphrase": bad}, "refused")
    assert proc.returncode == 1 and "wrong passphrase" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "scripts/release", "--version", "v1", "--registry", f"{registry}/refused",
         "--key", str(keys["private"]), "--passphrase-file", str(keys["passphrase"]),
         "--public-key-url", "https://keys.example/k", "--plain-http", "--image", IMAGE],
        cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1 and "not a semantic version" in proc.stderr
    with urllib.request.urlopen(f"http://{registry}/v2/_catalog") as resp:
        assert not [r for r in json.load(resp)["repositories"] if r.startswith("refused/")]


@pytest.mark.skipif(shutil.which("actionlint") is None, reason="actionlint is installed by scripts/test")
def test_the_release_workflow_passes_actionlint(tmp_path):
    workflows = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
    assert workflows
    proc = subprocess.run(["actionlint", *map(str, workflows)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The linter's control: an undefined expression and a wrong input fail.
    broken = tmp_path / "broken.yml"
    broken.write_text((ROOT / ".github/workflows/release.yml").read_text()
                      .replace("${{ matrix.triple }}", "${{ matrix.tripel }}"))
    proc = subprocess.run(["actionlint", str(broken)], capture_output=True, text=True)
    assert proc.returncode == 1 and "tripel" in proc.stdout


def test_the_kyverno_example_asks_for_what_the_release_attaches(published):
    policy = yaml.safe_load((ROOT / "docs" / "examples" / "kyverno-verify-lanyard.yaml").read_text())
    assert policy["kind"] == "ClusterPolicy"
    (rule,) = policy["spec"]["rules"]
    (verify_images,) = rule["verifyImages"]
    assert verify_images["failureAction"] == "Enforce" and verify_images["verifyDigest"]
    # The key-signed release writes no Rekor entry: the policy must not ask for one.
    keys_entries = [verify_images["attestors"][0]["entries"][0]["keys"]]
    keys_entries += [a["attestors"][0]["entries"][0]["keys"] for a in verify_images["attestations"]]
    assert all(k["rekor"]["ignoreTlog"] and k["ctlog"]["ignoreSCT"] for k in keys_entries)
    # Each attestation type is one the release attaches, and each condition
    # holds on what the release attached.
    name, digest = image_ref(published)
    found = {a["annotations"]["predicateType"]: a["envelope"] for a in attestations(name, digest)}
    assert {a["type"] for a in verify_images["attestations"]} == set(found)
    for attestation in verify_images["attestations"]:
        predicate = json.loads(base64.b64decode(found[attestation["type"]]["payload"]))["predicate"]
        for condition in attestation["conditions"][0]["all"]:
            path = condition["key"].strip("{} ").split(".")
            value = predicate
            for part in path:
                value = value[part]
            assert condition["operator"] == "Equals" and value == condition["value"]
    # The image patterns match the released image's name in the example's registry.
    patterns = verify_images["imageReferences"]
    assert all(p.startswith("registry.example.com/platform/lanyard") for p in patterns)


def test_a_registry_that_asks_for_credentials_gets_them_and_only_then(keys, tmp_path):
    """Basic authentication: podman logs in (password on stdin), Helm logs
    in, the signatures and attestations go up with the same credentials;
    without them the release stops at the first push, saying so."""
    proc, address = start_registry(tmp_path, {"releaser": "pa55-word"})
    try:
        refused = release(address, keys, "platform")
        assert refused.returncode == 1 and "failed" in refused.stderr
        env = {**os.environ, "LANYARD_REGISTRY_USER": "releaser", "LANYARD_REGISTRY_PASSWORD": "pa55-word"}
        done = release(address, keys, "platform", env=env)
        assert done.returncode == 0, done.stderr
        assert "pa55-word" not in done.stdout + done.stderr
        summary = json.loads(done.stdout)
        name, digest = image_ref(summary)
        client = oci.Registry(address, plain_http=True, credentials=("releaser", "pa55-word"))
        for repo, d in (("platform/lanyard", digest), ("platform/charts/lanyard", summary["chart"]["digest"])):
            assert client.manifest(repo, cosign.tag_for(d, "sig"))[2]
            assert client.manifest(repo, cosign.tag_for(d, "att"))[2]
        with pytest.raises(oci.RegistryError, match="HTTP 401"):
            oci.Registry(address, plain_http=True).manifest("platform/lanyard", VERSION)
    finally:
        stop_process(proc)
