"""Cosign's formats, as `cosign verify --key` and `cosign
verify-attestation --key`, Kyverno's `verifyImages` and containers/image
(podman, skopeo, CRI-O: `sigstoreSigned` in policy.json) read them.

- **Keys**: cosign's `ENCRYPTED SIGSTORE PRIVATE KEY` PEM (older cosign
  wrote `ENCRYPTED COSIGN PRIVATE KEY`): base64 of a JSON document with
  `kdf` (scrypt N, r, p and a salt), `cipher` (`nacl/secretbox` and a
  24-byte nonce) and `ciphertext`, the secretbox of the PKCS#8 DER of an
  ECDSA P-256 key; the box key is scrypt(passphrase, salt) of 32 bytes
  (go-securesystemslib's `encrypted` package, which cosign uses). An
  unencrypted PKCS#8 `PRIVATE KEY` PEM is accepted too.
- **Signatures** (the "simple signing" payload): for the artifact with
  manifest digest D in repository R, the JSON `{"critical": {"identity":
  {"docker-reference": R}, "image": {"docker-manifest-digest": D}, "type":
  "cosign container image signature"}, "optional": …}`, signed with
  ECDSA-P256-SHA256 (ASN.1 DER), stored as a layer of media type
  `application/vnd.dev.cosign.simplesigning.v1+json` whose annotation
  `dev.cosignproject.cosign/signature` holds the base64 signature, in an
  image manifest tagged `sha256-<hex of D>.sig` in R.
- **Attestations**: a DSSE envelope (payload type
  `application/vnd.in-toto+json`, signature over the DSSE v1 PAE) of an
  in-toto statement, as a layer of media type
  `application/vnd.dsse.envelope.v1+json` with the annotation
  `predicateType`, in an image manifest tagged `sha256-<hex of D>.att`.

Sources: cosign's `pkg/oci/static` and `pkg/types` media types and
annotation names, containers/image `docs/containers-policy.json.5.md`
(`sigstoreSigned`, `use-sigstore-attachments` in
containers-registries.d(5)), the DSSE protocol
(https://github.com/secure-systems-lab/dsse/blob/master/protocol.md).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from .oci import OCI_MANIFEST, Registry

SIMPLESIGNING = "application/vnd.dev.cosign.simplesigning.v1+json"
DSSE_ENVELOPE = "application/vnd.dsse.envelope.v1+json"
IN_TOTO = "application/vnd.in-toto+json"
SIGNATURE_ANNOTATION = "dev.cosignproject.cosign/signature"
PEM_LABELS = ("ENCRYPTED SIGSTORE PRIVATE KEY", "ENCRYPTED COSIGN PRIVATE KEY")
SCRYPT_MAXMEM = 256 * 1024 * 1024


class SigningKeyError(Exception):
    """The signing key cannot be read (format, passphrase)."""


def load_private_key(pem: bytes, passphrase: bytes) -> ec.EllipticCurvePrivateKey:
    text = pem.decode("ascii", "replace")
    for label in PEM_LABELS:
        begin, end = f"-----BEGIN {label}-----", f"-----END {label}-----"
        if begin in text:
            body = text.split(begin, 1)[1].split(end, 1)[0]
            return _decrypt(base64.b64decode("".join(body.split())), passphrase)
    try:
        key = serialization.load_pem_private_key(pem, password=passphrase or None)
    except (ValueError, TypeError) as err:
        raise SigningKeyError(f"not a cosign key nor a PKCS#8 PEM key: {err}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
        raise SigningKeyError("the key is not ECDSA P-256, which cosign's key pairs are")
    return key


def _decrypt(document: bytes, passphrase: bytes) -> ec.EllipticCurvePrivateKey:
    import nacl.exceptions
    import nacl.secret

    try:
        doc = json.loads(document)
        kdf, cipher = doc["kdf"], doc["cipher"]
        if kdf["name"] != "scrypt" or cipher["name"] != "nacl/secretbox":
            raise SigningKeyError(f"unknown key encryption {kdf['name']}/{cipher['name']}")
        params = kdf["params"]
        box_key = hashlib.scrypt(
            passphrase,
            salt=base64.b64decode(kdf["salt"]),
            n=int(params["N"]),
            r=int(params["r"]),
            p=int(params["p"]),
            maxmem=SCRYPT_MAXMEM,
            dklen=32,
        )
        der = nacl.secret.SecretBox(box_key).decrypt(
            base64.b64decode(doc["ciphertext"]), base64.b64decode(cipher["nonce"])
        )
    except nacl.exceptions.CryptoError:
        raise SigningKeyError("wrong passphrase for the signing key") from None
    except (KeyError, ValueError, TypeError) as err:
        raise SigningKeyError(f"malformed cosign key: {err}") from None
    key = serialization.load_der_private_key(der, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise SigningKeyError("the key is not ECDSA")
    return key


def write_key_pair(prefix: str, passphrase: bytes) -> tuple[str, str]:
    """A new key pair in cosign's files: PREFIX.key (encrypted) and PREFIX.pub."""
    import nacl.secret

    key = ec.generate_private_key(ec.SECP256R1())
    der = key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    salt, nonce = os.urandom(32), os.urandom(24)
    n, r, p = 32768, 8, 1
    box_key = hashlib.scrypt(passphrase, salt=salt, n=n, r=r, p=p, maxmem=SCRYPT_MAXMEM, dklen=32)
    sealed = nacl.secret.SecretBox(box_key).encrypt(der, nonce).ciphertext
    doc = {
        "kdf": {"name": "scrypt", "params": {"N": n, "r": r, "p": p}, "salt": base64.b64encode(salt).decode()},
        "cipher": {"name": "nacl/secretbox", "nonce": base64.b64encode(nonce).decode()},
        "ciphertext": base64.b64encode(sealed).decode(),
    }
    b64 = base64.b64encode(json.dumps(doc, separators=(",", ":")).encode()).decode()
    label = PEM_LABELS[0]
    pem = f"-----BEGIN {label}-----\n" + "\n".join(b64[i : i + 64] for i in range(0, len(b64), 64))
    pem += f"\n-----END {label}-----\n"
    private, public = prefix + ".key", prefix + ".pub"
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(pem)
    with open(public, "wb") as f:
        f.write(public_pem(key))
    return private, public


def public_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def public_key_sha256(key: ec.EllipticCurvePrivateKey) -> str:
    """The SHA-256 of the public key's DER (SubjectPublicKeyInfo): its fingerprint."""
    der = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def _sign(key: ec.EllipticCurvePrivateKey, data: bytes) -> str:
    return base64.b64encode(key.sign(data, ec.ECDSA(hashes.SHA256()))).decode()


def tag_for(digest: str, suffix: str) -> str:
    algorithm, _, hex_ = digest.partition(":")
    return f"{algorithm}-{hex_}.{suffix}"


def _compact(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _attachment_manifest(registry: Registry, repo: str, layers: list[tuple[bytes, str, dict]]) -> bytes:
    """An image manifest whose layers are the given blobs, as cosign writes
    its `.sig` and `.att` images (an image config listing them as diff IDs)."""
    descriptors = []
    for data, media_type, annotations in layers:
        digest = registry.push_blob(repo, data)
        descriptors.append({"mediaType": media_type, "size": len(data), "digest": digest, "annotations": annotations})
    config = _compact(
        {
            "architecture": "",
            "created": "0001-01-01T00:00:00Z",
            "history": [{"created": "0001-01-01T00:00:00Z"}],
            "os": "",
            "rootfs": {"type": "layers", "diff_ids": [d["digest"] for d in descriptors]},
            "config": {},
        }
    )
    config_digest = registry.push_blob(repo, config)
    return _compact(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "size": len(config), "digest": config_digest},
            "layers": descriptors,
        }
    )


def simple_signing_payload(repository: str, digest: str, optional: dict | None = None) -> bytes:
    return _compact(
        {
            "critical": {
                "identity": {"docker-reference": repository},
                "image": {"docker-manifest-digest": digest},
                "type": "cosign container image signature",
            },
            "optional": optional,
        }
    )


def sign(registry: Registry, repo: str, digest: str, key, *, identity: str, optional: dict | None = None) -> str:
    """Signs the manifest `digest` of `repo` and pushes the signature under
    cosign's tag; returns the signature manifest's digest. `identity` is the
    repository as users pull it (`HOST/PATH`), the signed docker-reference."""
    payload = simple_signing_payload(identity, digest, optional)
    manifest = _attachment_manifest(
        registry, repo, [(payload, SIMPLESIGNING, {SIGNATURE_ANNOTATION: _sign(key, payload)})]
    )
    return registry.push_manifest(repo, tag_for(digest, "sig"), manifest, OCI_MANIFEST)


def pae(payload_type: str, payload: bytes) -> bytes:
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def envelope(statement: dict, key) -> bytes:
    payload = _compact(statement)
    return _compact(
        {
            "payloadType": IN_TOTO,
            "payload": base64.b64encode(payload).decode(),
            "signatures": [{"keyid": "", "sig": _sign(key, pae(IN_TOTO, payload))}],
        }
    )


def attest(registry: Registry, repo: str, digest: str, statements: list[dict], key) -> str:
    """Pushes the statements, each in a signed DSSE envelope, as the layers
    of `repo`'s `sha256-<hex>.att`; returns that manifest's digest."""
    layers = [
        (envelope(s, key), DSSE_ENVELOPE, {SIGNATURE_ANNOTATION: "", "predicateType": s["predicateType"]})
        for s in statements
    ]
    manifest = _attachment_manifest(registry, repo, layers)
    return registry.push_manifest(repo, tag_for(digest, "att"), manifest, OCI_MANIFEST)
