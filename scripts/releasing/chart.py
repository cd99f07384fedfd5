"""The chart as released: `charts/lanyard` with the release's version and
its image pinned by digest, packaged and pushed by Helm's own engine
(PyPI's helm-python-sdk binds Helm's Go SDK: `helm package`, `helm
push`).

What changes from the tree's chart, and only that:
- `Chart.yaml`: `version` and `appVersion` are the release's;
  `artifacthub.io/images` names the image by digest, and
  `artifacthub.io/signKey` points at the public key the release was
  signed with (its SHA-256 fingerprint and where it is published; a
  keyless release has no key, and no such annotation).
- `values.yaml`: `image.repository` is the registry's, `image.tag` the
  version and `image.digest` the pushed image's digest, so the chart
  installs exactly the signed image (the digest wins over the tag,
  `_helpers.tpl`'s `lanyard.image`).
Comments and the order of keys stay as they are: the lines are edited,
not the YAML re-serialised.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import yaml


class ChartError(Exception):
    """The tree's chart is not in the shape the release edits."""


def _replace_once(text: str, pattern: str, repl: str, what: str) -> str:
    new, n = re.subn(pattern, repl, text, count=1, flags=re.MULTILINE)
    if n != 1:
        raise ChartError(f"cannot find {what} to set")
    return new


def prepare(
    source: Path,
    dest: Path,
    *,
    version: str,
    repository: str,
    digest: str,
    key_fingerprint: str | None,
    key_url: str | None,
) -> Path:
    """Copies the chart to `dest/lanyard`, edited for the release."""
    chart = dest / "lanyard"
    shutil.copytree(source, chart)
    meta_path = chart / "Chart.yaml"
    meta = meta_path.read_text()
    meta = _replace_once(meta, r"^version: .*$", f"version: {version}", "Chart.yaml's version")
    meta = _replace_once(meta, r"^appVersion: .*$", f'appVersion: "{version}"', "Chart.yaml's appVersion")
    images = yaml.safe_dump([{"name": "lanyard", "image": f"{repository}@{digest}"}], sort_keys=False)
    sign_key = yaml.safe_dump({"fingerprint": key_fingerprint, "url": key_url}, sort_keys=False)
    meta = _replace_once(
        meta,
        r"^  artifacthub\.io/images: \|\n(?:    .*\n)+",
        "  artifacthub.io/images: |\n" + "".join("    " + line + "\n" for line in images.splitlines()),
        "Chart.yaml's artifacthub.io/images",
    )
    if key_fingerprint and key_url:
        meta += "  artifacthub.io/signKey: |\n" + "".join("    " + line + "\n" for line in sign_key.splitlines())
    meta_path.write_text(meta)
    # The edited file must still be the chart Helm reads.
    parsed = yaml.safe_load(meta)
    if parsed["version"] != version or digest not in parsed["annotations"]["artifacthub.io/images"]:
        raise ChartError("the edited Chart.yaml does not say what the release set")

    values_path = chart / "values.yaml"
    values = values_path.read_text()
    values = _replace_once(values, r"^  repository: lanyard$", f"  repository: {repository}", "image.repository")
    values = _replace_once(values, r'^  tag: ""$', f'  tag: "{version}"', "image.tag")
    values = _replace_once(values, r'^  digest: ""$', f'  digest: "{digest}"', "image.digest")
    values_path.write_text(values)
    image = yaml.safe_load(values)["image"]
    if (image["repository"], image["tag"], image["digest"]) != (repository, version, digest):
        raise ChartError("the edited values.yaml does not say what the release set")
    return chart


def package(chart: Path, dest: Path) -> Path:
    import helm_python as helm

    return Path(helm.package(chart, destination=dest))


def push(archive: Path, remote: str, *, plain_http: bool, credentials: tuple[str, str] | None) -> dict:
    """`helm push ARCHIVE oci://…` (after `helm registry login` when given
    credentials); Helm's answer (its `ref` and `digest`)."""
    import tempfile

    import helm_python.registry as registry

    if credentials is None:
        return registry.push(archive, remote, plain_http=plain_http)
    host = remote.removeprefix("oci://").split("/", 1)[0]
    # A credentials file of its own, removed after: the user's Helm
    # configuration is neither read nor changed.
    with tempfile.TemporaryDirectory(prefix="lanyard-helm-") as tmp:
        with registry.RegistryClient(plain_http=plain_http, credentials_file=f"{tmp}/config.json") as client:
            client.login(host, credentials[0], credentials[1], plain_http=plain_http)
            return client.push(archive, remote, plain_http=plain_http)
