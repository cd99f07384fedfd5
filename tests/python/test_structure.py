"""The source tree's shape: no module of the workspace's crates (the
product in src/ and crates/, the emulators, the fake API server) grows past 1,000
lines before its tests (issue 42's bound; a longer one is split by
concern)."""

from __future__ import annotations

import shutil
import subprocess
import sys

from conftest import ROOT

MAX_LINES = 1000


def lines_before_tests(text: str) -> int:
    """Lines up to a module's `#[cfg(test)]` test module (all of them when
    it has none in the file)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "#[cfg(test)]" and i + 1 < len(lines) and lines[i + 1].startswith("mod tests"):
            return i
    return len(lines)


# The product, every layer crate under crates/, the emulators and the fake.
CRATES = ["src", *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("crates/*/src")), "emulators/src", "tests/fake-kube/src"]


def test_no_module_of_a_crate_is_over_1000_lines_before_its_tests():
    sizes = {str(p.relative_to(ROOT)): lines_before_tests(p.read_text())
             for crate in CRATES for p in (ROOT / crate).rglob("*.rs")}
    assert len(sizes) > 70, sizes
    # Test modules in files of their own (`mod tests;`) are tests entirely.
    over = {path: n for path, n in sizes.items() if n > MAX_LINES and not path.endswith("/tests.rs")}
    assert over == {}, f"split these by concern: {over}"


def test_the_measure_counts_up_to_the_test_module():
    text = "fn a() {}\n\n#[cfg(test)]\nmod tests {\n    #[test]\n    fn t() {}\n}\n"
    assert lines_before_tests(text) == 2
    assert lines_before_tests("fn a() {}\n#[cfg(test)]\nfn helper() {}\n") == 3


def test_the_files_a_new_cloud_touches_are_the_ones_docs_list():
    """scripts/cloud-files: every file of the repository that names a
    cloud (code, strings, tests, the chart) is an existing cloud's own,
    a file of cases, or on docs/adding-a-cloud.md's list, and the list
    stays within its bound."""
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "cloud-files"), "-v"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "19 files:" in run.stdout, run.stdout


def _tree_copy(tmp_path):
    """The tracked tree, as a plain directory (no git)."""
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True,
                           text=True, check=True).stdout.split("\n")
    for rel in filter(None, files):
        source = ROOT / rel
        if source.is_file():
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, tmp_path / rel)
    return tmp_path


def _check(root):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "cloud-files"), "--root", str(root)],
                          capture_output=True, text=True)


def test_the_cloud_files_check_fails_on_each_file_that_names_a_cloud(tmp_path):
    """The control: in a copy of the tree, each file that names a cloud
    and is on no list fails the check: product code that special-cases
    one, a string naming one, a test's list of the clouds, the chart; and
    a product file whose shipped code names a cloud cannot pass as
    `cases`."""
    root = _tree_copy(tmp_path / "tree")
    run = _check(root)
    assert run.returncode == 0, run.stdout
    strays = {
        "src/stray.rs": ("fn f(c: Cloud) -> bool { c == Cloud::Aws }\n",
                         "src/stray.rs names a cloud (Aws)"),
        "crates/core/src/stray.rs": ('pub const SECTION: &str = "gcp";\n',
                                     "crates/core/src/stray.rs names a cloud (gcp)"),
        "tests/python/test_stray.py": ('CLOUDS = ["azure", "gcp", "aws"]  # every cloud\n',
                                       "tests/python/test_stray.py names a cloud in its tests (aws, azure, gcp)"),
        "charts/lanyard/templates/stray.yaml": ("region: {{ .Values.aws.region }}\n",
                                                "charts/lanyard/templates/stray.yaml names a cloud (aws)"),
        # A template action in a YAML comment still runs.
        "charts/lanyard/templates/commented.yaml": ("# {{ .Values.gcp.projectId }}\n",
                                                   "charts/lanyard/templates/commented.yaml names a cloud (gcp)"),
        # A quote in a comment opens no string that would hide the code.
        "src/quoted.rs": ('// the base64url of `{"`\nfn f(c: Cloud) -> bool { c == Cloud::Aws }\n',
                          "src/quoted.rs names a cloud (Aws)"),
        # Code after a test module is code; the test module's names are
        # its tests'.
        "src/after_tests.rs": ("#[cfg(test)]\nmod tests { fn t() { let _ = Cloud::Gcp; } }\n"
                               "fn f(c: Cloud) -> bool { c == Cloud::Azure }\n",
                               "src/after_tests.rs names a cloud (Azure)"),
        "src/tested.rs": ("fn f() {}\n#[cfg(test)]\nmod tests { fn t() { let _ = Cloud::Gcp; } }\n",
                          "src/tested.rs names a cloud in its tests (Gcp)"),
    }
    for rel, (text, message) in strays.items():
        (root / rel).write_text(text)
        run = _check(root)
        assert run.returncode == 1, (rel, run.stdout)
        assert message in run.stdout, run.stdout
        (root / rel).unlink()
    # Comments name no cloud.
    (root / "src" / "quiet.rs").write_text("// Azure, GCP and AWS alike.\nfn f() {}\n")
    (root / "tests" / "python" / "quiet.py").write_text("# Azure, GCP and AWS alike.\nx = 1  # aws\n")
    assert _check(root).returncode == 0, _check(root).stdout
    doc = root / "docs" / "adding-a-cloud.md"
    text = doc.read_text()

    def with_list(old, new):
        doc.write_text(text.replace(old, new))
        return _check(root)

    # A file whose tests alone name a cloud may be a file of cases.
    (root / "src" / "tested.rs").write_text(strays["src/tested.rs"][0])
    assert with_list("\ncases tests/upstream_faults.rs\n",
                     "\ncases tests/upstream_faults.rs src/tested.rs\n").returncode == 0
    (root / "src" / "tested.rs").unlink()
    # A product file whose code names a cloud is not a file of cases.
    run = with_list("\nshared src/dev.rs\n", "\ncases src/dev.rs\n")
    assert run.returncode == 1 and "src/dev.rs names a cloud" in run.stdout, run.stdout
    # A shared file that names no cloud any more is stale.
    run = with_list("\nshared src/dev.rs\n", "\nshared src/dev.rs\nshared src/quiet.rs\n")
    assert "src/quiet.rs is listed but names no cloud any more" in run.stdout, run.stdout
    # The bound holds.
    run = with_list("\nshared src/dev.rs\n", "\nshared src/dev.rs\nnew src/NEW/extra.rs\n")
    assert run.returncode == 1 and "a new cloud touches 20 files, more than 19" in run.stdout, run.stdout
    doc.write_text(text)
