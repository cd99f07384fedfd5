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
    """scripts/cloud-files: every file whose code names a cloud is an
    existing cloud's own or on docs/adding-a-cloud.md's list, and the list
    stays within its bound."""
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "cloud-files"), "-v"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "10 files:" in run.stdout, run.stdout


def test_the_cloud_files_check_fails_on_a_file_that_names_a_cloud(tmp_path):
    """The control: in a copy of the tree, a product file that
    special-cases a cloud, and is on no list, fails the check."""
    for part in ["src", "crates", "emulators/src", "docs"]:
        shutil.copytree(ROOT / part, tmp_path / part)
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "cloud-files"), "--root", str(tmp_path)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout
    (tmp_path / "src" / "stray.rs").write_text("fn f(c: Cloud) -> bool { c == Cloud::Aws }\n")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "cloud-files"), "--root", str(tmp_path)],
                         capture_output=True, text=True)
    assert run.returncode == 1
    assert "src/stray.rs names a cloud (Aws)" in run.stdout, run.stdout
