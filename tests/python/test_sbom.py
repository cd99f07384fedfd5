"""The image's SBOM (`scripts/sbom`): valid CycloneDX 1.5 by the schema,
as CycloneDX's own Python library validates it; naming every crate linked
into the shipped binaries, as `cargo tree` (another reading of the graph
than the script's `cargo metadata`) lists them, each with its licence and
`Cargo.lock`'s checksum; and the Debian package the image takes its CA
bundle from, at the installed version."""

import json
import os
import pathlib
import re
import subprocess
import tomllib

import pytest
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator

ROOT = pathlib.Path(__file__).resolve().parents[2]
TARGET = "x86_64-unknown-linux-gnu"


def run(*argv):
    return subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def sbom_text():
    return run("scripts/sbom", "--target", TARGET, "--image-digest", "sha256:" + "ab" * 32)


@pytest.fixture(scope="module")
def sbom(sbom_text):
    return json.loads(sbom_text)


def test_it_is_valid_cyclonedx_1_5_and_a_broken_one_is_not(sbom_text, sbom):
    validator = JsonStrictValidator(SchemaVersion.V1_5)
    assert validator.validate_str(sbom_text) is None
    # The validator's control: a field the schema does not have is refused.
    broken = json.loads(sbom_text)
    broken["components"][0]["licenses"] = [{"expression": "MIT", "unknown": True}]
    assert validator.validate_str(json.dumps(broken)) is not None
    assert sbom["metadata"]["component"]["name"] == "lanyard"
    assert sbom["metadata"]["component"]["hashes"] == [{"alg": "SHA-256", "content": "ab" * 32}]


def cargo_tree():
    """`cargo tree`'s packages for the image's target: (name, version) ->
    (library name, whether it is a proc macro)."""
    out = run("cargo", "tree", "--locked", "-e", "normal", "--target", TARGET,
              "-p", "lanyard", "--prefix", "none", "--format", "{p}|{lib}")
    packages = {}
    for line in out.splitlines():
        # A package met again is marked ` (*)` at the line's end.
        package, lib = line.removesuffix(" (*)").split("|", 1)
        fields = package.split()
        packages[(fields[0], fields[1].lstrip("v"))] = (lib.strip(), "(proc-macro)" in package)
    return packages


def test_every_crate_is_named_with_its_licence_and_checksum(sbom):
    packages = cargo_tree()
    packages.pop(("lanyard", sbom["metadata"]["component"]["version"]))
    assert len(packages) > 300, len(packages)
    cargo = {(c["name"], c["version"]): c for c in sbom["components"] if c["purl"].startswith("pkg:cargo/")}
    assert set(cargo) == set(packages)
    assert cargo[("lanyard-sidecar", "0.1.0")].get("scope") is None
    for key, (_, proc_macro) in packages.items():
        if proc_macro:
            assert cargo[key]["scope"] == "excluded", key
    lock = tomllib.loads((ROOT / "Cargo.lock").read_text())
    checksums = {(p["name"], p["version"]): p["checksum"] for p in lock["package"] if "checksum" in p}
    for key, component in cargo.items():
        assert component["licenses"], key
        assert component["purl"] == f"pkg:cargo/{key[0]}@{key[1]}"
        if key in checksums:
            assert component["hashes"] == [{"alg": "SHA-256", "content": checksums[key]}], key
        else:
            assert key[0].startswith("lanyard"), f"{key} has no checksum and is not Lanyard's own"


def crates_with_code_in(binary):
    """The crates whose functions a binary holds, from its symbols."""
    out = subprocess.run(["nm", "-C", "--defined-only", str(binary)], check=True,
                         capture_output=True, text=True).stdout
    crates = set()
    for line in out.splitlines():
        symbol = line.split(" ", 2)[-1]
        crates.update(re.findall(r"(?:^|[ <(&*,])([a-z_][a-z0-9_]*)::", symbol))
    return crates


@pytest.mark.skipif(not os.environ.get("LANYARD_TEST_IMAGE"),
                    reason="the image's binaries are built by the test command's image stage (podman, root)")
def test_the_image_binaries_hold_code_of_shipped_crates_only(sbom):
    """Read from the binaries the image was built from (scripts/build-image,
    before it strips them): every crate with code in them is in the SBOM as
    shipped, and none it lists as excluded (proc macros) has code there."""
    built = ROOT / "target" / TARGET / "image-quick"
    binaries = [built / "lanyard", built / "lanyard-sidecar"]
    for binary in binaries:
        assert binary.is_file(), f"{binary}: the image stage builds it"
    libs = {key: lib for key, (lib, _) in cargo_tree().items()}
    shipped, excluded = set(), set()
    for c in sbom["components"]:
        if c["purl"].startswith("pkg:cargo/"):
            lib = libs[(c["name"], c["version"])]
            (excluded if c.get("scope") == "excluded" else shipped).add(lib)
    # The standard library's own crates (the toolchain's, not Cargo.lock's).
    sysroot = pathlib.Path(run("rustc", "--print", "sysroot").strip())
    std = {re.sub(r"^lib(.*?)-[0-9a-f]+\.rlib$", r"\1", p.name)
           for p in (sysroot / "lib" / "rustlib" / TARGET / "lib").glob("lib*.rlib")}
    std |= {"__rustc", "lanyard", "lanyard_sidecar"}
    for binary in binaries:
        found = crates_with_code_in(binary)
        assert len(found) > 20, found
        assert found - shipped - std == set(), binary
        assert found & (excluded - shipped) == set(), binary


def test_the_debian_packages_in_the_image_are_named_at_their_versions(sbom):
    """The CA bundle's package, and the static glibc's (scripts/build-image
    links `+crt-static` and ships both packages' copyright files)."""
    debian = {c["name"]: c for c in sbom["components"] if c["purl"].startswith("pkg:deb/")}
    assert set(debian) == {"ca-certificates", "libc6-dev"}
    for name, component in debian.items():
        assert component["version"] == run("dpkg-query", "-W", "-f=${Version}", name)
    assert debian["ca-certificates"]["licenses"] == [{"expression": "GPL-2.0-or-later AND MPL-2.0"}]
    assert debian["libc6-dev"]["licenses"] == [{"expression": "LGPL-2.1-or-later"}]


def test_the_graph_names_only_components(sbom):
    refs = {c["bom-ref"] for c in sbom["components"]} | {sbom["metadata"]["component"]["bom-ref"]}
    for entry in sbom["dependencies"]:
        assert entry["ref"] in refs
        assert set(entry["dependsOn"]) <= refs, entry["ref"]
    root = next(e for e in sbom["dependencies"] if e["ref"] == sbom["metadata"]["component"]["bom-ref"])
    assert any(d.startswith("pkg:deb/debian/ca-certificates@") for d in root["dependsOn"])


def test_the_same_tree_gives_the_same_document(sbom_text):
    again = run("scripts/sbom", "--target", TARGET, "--image-digest", "sha256:" + "ab" * 32)
    assert again == sbom_text


def test_a_malformed_digest_is_refused():
    out = subprocess.run(["scripts/sbom", "--image-digest", "md5:00"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert "expected sha256:<64 hex>" in out.stderr
