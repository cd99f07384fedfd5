"""The in-toto statements a release attests: the image's SBOM and the
build's provenance.

- **SBOM**: an in-toto statement whose predicate is the CycloneDX
  document `scripts/sbom` writes, predicate type
  `https://cyclonedx.org/bom` (what `cosign attest --type cyclonedx`
  writes and Kyverno's `verifyImages` `attestations[].type` matches).
- **Provenance**: an in-toto statement with the SLSA v1.0 provenance
  predicate (`https://slsa.dev/provenance/v1`,
  https://slsa.dev/spec/v1.0/provenance): `buildDefinition` (the build
  type, the parameters the release command was given, and the resolved
  dependencies: the source commit, `Cargo.lock`, the `Containerfile`, the
  Rust toolchain) and `runDetails` (the builder and when it ran). Its
  subjects are the image and the chart, each by digest.

A statement made here on a workstation claims no SLSA level: the
builder is whoever ran the command. The release workflow
(.github/workflows/release.yml) makes its provenance on GitHub's hosted
runners, which is what SLSA build level 3 asks for.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import socket
import subprocess
from pathlib import Path

# The statement type cosign writes into its `.att` attestations, and so the
# one every reader of them accepts (cosign still writes v0.1: sigstore/cosign
# #4238; validators that took only v1 had to learn v0.1 for cosign's:
# in-toto/attestation #461). v0.1 and v1 share this shape: `_type`,
# `subject` (name and digest), `predicateType`, `predicate`.
STATEMENT = "https://in-toto.io/Statement/v0.1"
CYCLONEDX = "https://cyclonedx.org/bom"
SLSA_PROVENANCE_V1 = "https://slsa.dev/provenance/v1"
# docs/release.md ("Provenance") says what a build of this type does and
# what its parameters mean.
BUILD_TYPE = "urn:lanyard:build-type:scripts-release:v1"


def subject(name: str, digest: str) -> dict:
    algorithm, _, hex_ = digest.partition(":")
    return {"name": name, "digest": {algorithm: hex_}}


def sbom_statement(image: str, digest: str, sbom: dict) -> dict:
    return {"_type": STATEMENT, "subject": [subject(image, digest)], "predicateType": CYCLONEDX, "predicate": sbom}


def _git(root: Path, *args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _file_digest(path: Path) -> dict:
    return {"sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def _rfc3339(t: datetime.datetime) -> str:
    return t.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def builder_id() -> str:
    """GitHub Actions' workflow identity on a hosted runner, else this host."""
    server, repo, ref = (os.environ.get(k) for k in ("GITHUB_SERVER_URL", "GITHUB_REPOSITORY", "GITHUB_WORKFLOW_REF"))
    if server and repo and ref:
        return f"{server}/{ref}"
    return f"urn:lanyard:builder:host:{socket.gethostname()}"


def provenance_statement(
    root: Path,
    subjects: list[dict],
    parameters: dict,
    started: datetime.datetime,
    finished: datetime.datetime,
) -> dict:
    commit = _git(root, "rev-parse", "HEAD")
    origin = _git(root, "remote", "get-url", "origin") or root.resolve().as_uri()
    dirty = bool(_git(root, "status", "--porcelain", "--untracked-files=no"))
    rustc = subprocess.run(["rustc", "-V"], capture_output=True, text=True).stdout.strip()
    dependencies = []
    if commit:
        dependencies.append({"uri": f"git+{origin}", "digest": {"gitCommit": commit}})
    for name in ("Cargo.lock", "Containerfile"):
        dependencies.append({"name": name, "uri": f"git+{origin}#{name}", "digest": _file_digest(root / name)})
    dependencies.append({"name": "rustc", "annotations": {"version": rustc}})
    run_id = os.environ.get("GITHUB_RUN_ID")
    metadata = {"startedOn": _rfc3339(started), "finishedOn": _rfc3339(finished)}
    if run_id:
        metadata["invocationId"] = f"{os.environ.get('GITHUB_SERVER_URL')}/{os.environ.get('GITHUB_REPOSITORY')}/actions/runs/{run_id}"
    return {
        "_type": STATEMENT,
        "subject": subjects,
        "predicateType": SLSA_PROVENANCE_V1,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": parameters,
                "internalParameters": {
                    "machine": platform.machine(),
                    # A tree with uncommitted changes is not the commit above.
                    "sourceTreeDirty": dirty,
                },
                "resolvedDependencies": dependencies,
            },
            "runDetails": {"builder": {"id": builder_id()}, "metadata": metadata},
        },
    }
