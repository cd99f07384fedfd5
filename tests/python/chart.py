"""Rendering charts/lanyard with Helm's own engine, and running a rendered
container the way the kubelet would, for the chart tests.

Helm comes from PyPI's helm-python-sdk, which binds Helm's Go SDK (no helm
binary). A container is run from its rendered spec: its args and env as
rendered, downward-API values filled in, and each volume materialised from
the rendered ConfigMaps and Secrets (or an empty directory) in a temporary
directory. Without a mount namespace those directories cannot sit at the
container's mount paths, so every mount path is rewritten to its directory
in args, env values and the mounted files themselves; nothing else is
changed. The in-cluster ServiceAccount mount is replaced by KUBECONFIG
pointing at the fake API server.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import ssl
import subprocess
import time
from pathlib import Path

import yaml

from conftest import stop_process

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "lanyard"
RELEASE = "lanyard"
NAMESPACE = "lanyard-system"


def render(values: dict | None = None, *, namespace: str = NAMESPACE) -> list[dict]:
    """Every object the chart renders for `values` (NOTES.txt aside)."""
    import helm_python as helm

    chart = helm.Chart.load(str(CHART))
    out = chart.render(values or {}, name=RELEASE, namespace=namespace, is_install=True)
    objects = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(d for d in yaml.safe_load_all(text) if d)
    return objects


def find(objects: list[dict], kind: str, name: str | None = None) -> dict:
    hits = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def pod_spec(objects: list[dict], kind: str) -> dict:
    return find(objects, kind)["spec"]["template"]["spec"]


class Container:
    """A rendered container run as a local process."""

    def __init__(self, objects: list[dict], kind: str, binary: str, workdir: Path,
                 downward: dict[str, str], kubeconfig: str, prefix: list[str] | None = None,
                 extra_env: dict[str, str] | None = None):
        """`prefix` runs the process through another command (a network
        namespace, a mount of the node's trust store) that ends by exec'ing
        the container's own argv; `extra_env` adds to the container's env."""
        workdir.mkdir(parents=True, exist_ok=True)
        spec = pod_spec(objects, kind)
        (container,) = spec["containers"]
        self.spec = container
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        remap: dict[str, str] = {}
        files: list[Path] = []
        for mount in container.get("volumeMounts", []):
            target = workdir / "volumes" / mount["name"]
            target.mkdir(parents=True, exist_ok=True)
            files.extend(materialise(objects, volumes[mount["name"]], target))
            remap[mount["mountPath"]] = str(target)

        def rewrite(text: str) -> str:
            for path, local in sorted(remap.items(), key=lambda kv: -len(kv[0])):
                text = text.replace(path, local)
            return text

        for f in files:
            f.write_text(rewrite(f.read_text()))
        # The root filesystem is read-only and holds only the binaries:
        # whatever the container is told to read or write must be mounted.
        leftovers = [t for t in [*(f.read_text() for f in files), *container.get("args", []),
                                 *(v.get("value", "") for v in container.get("env", []))]
                     for prefix in ("/etc/lanyard", "/var/lib/lanyard") if prefix in rewrite(t)]
        assert not leftovers, f"{kind} refers to paths it does not mount: {leftovers}"
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "KUBECONFIG": kubeconfig}
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = rewrite(var["value"])
            else:
                field = var["valueFrom"]["fieldRef"]["fieldPath"]
                env[var["name"]] = downward[field]
        env.update(extra_env or {})
        # The image's entrypoint is `lanyard`; `command` would replace it.
        assert "command" not in container, container.get("command")
        self.argv = [binary] + [rewrite(a) for a in container.get("args", [])]
        self.env = env
        self.log_path = workdir / f"{kind.lower()}.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([*(prefix or []), *self.argv], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        code = stop_process(self.proc)
        self.log.close()
        return code


def materialise(objects: list[dict], volume: dict, target: Path) -> list[Path]:
    """Writes a volume's files into `target`, as the kubelet would."""
    written = []
    if "configMap" in volume:
        data = find(objects, "ConfigMap", volume["configMap"]["name"])["data"]
        items = volume["configMap"].get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            (target / item["path"]).write_text(data[item["key"]])
            written.append(target / item["path"])
    elif "secret" in volume:
        data = find(objects, "Secret", volume["secret"]["secretName"])["data"]
        items = volume["secret"].get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            (target / item["path"]).write_bytes(base64.b64decode(data[item["key"]]))
    elif "emptyDir" in volume:
        pass
    else:
        raise AssertionError(f"volume kind not emulated: {sorted(volume)}")
    return written


class FakeKube:
    """`lanyard-fake-kube`: the fake API server and its control port."""

    def __init__(self, workdir: Path, clouds: Path | None = None):
        """`clouds`: a `--clouds` file; the emulators' URLs are then in
        `info` (`azure`, `gcp`, `aws`)."""
        workdir.mkdir(parents=True, exist_ok=True)
        target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
        binary = Path(os.environ.get("LANYARD_FAKE_KUBE_BIN") or target / "debug" / "lanyard-fake-kube")
        if not binary.exists():
            raise RuntimeError(f"{binary} not found: cargo build -p lanyard-fake-kube --features server")
        self.proc = subprocess.Popen([str(binary), "--dir", str(workdir), *(["--clouds", str(clouds)] if clouds else [])],
                                     stdout=subprocess.PIPE, stderr=open(workdir / "fake-kube.log", "wb"))
        line = self.proc.stdout.readline()
        self.info = info = json.loads(line)
        self.api, self.control, self.kubeconfig = info["api"], info["control"], info["kubeconfig"]

    def apply(self, obj: dict) -> dict:
        import requests

        r = requests.post(f"{self.control}/apply", json=obj, timeout=5)
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def wait_for(check, what: str, timeout: float = 30.0, proc: subprocess.Popen | None = None,
             interval: float = 0.2):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited with {proc.returncode} (its log is in the test's tmp_path)")
        try:
            result = check()
            if result:
                return result
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            last = e
        time.sleep(interval)
    raise AssertionError(f"{what} did not happen in {timeout} s (last error: {last})")


def apply_json_patch(doc, patch: list[dict]):
    """RFC 6902 add/replace/remove, as the API server applies a webhook's
    patch (the webhook emits no other operations)."""
    import copy

    doc = copy.deepcopy(doc)
    for op in patch:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1]
        if op["op"] == "add":
            if isinstance(parent, list):
                parent.insert(len(parent) if last == "-" else int(last), op["value"])
            else:
                parent[last] = op["value"]
        elif op["op"] == "replace":
            if isinstance(parent, list):
                parent[int(last)] = op["value"]
            else:
                assert last in parent, op["path"]
                parent[last] = op["value"]
        elif op["op"] == "remove":
            del parent[int(last) if isinstance(parent, list) else last]
        else:
            raise AssertionError(f"unexpected patch operation {op['op']}")
    return doc


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def post_review(port: int, ca: ssl.SSLContext, path: str, review: dict) -> dict:
    """An AdmissionReview POSTed to the webhook on 127.0.0.1:`port` over
    the chart's TLS, by the name the API server calls it; its `response`."""
    body = json.dumps(review).encode()
    conn = socket.create_connection(("127.0.0.1", port), timeout=5)
    tls = ca.wrap_socket(conn, server_hostname=f"lanyard-webhook.{NAMESPACE}.svc")
    tls.sendall(f"POST {path} HTTP/1.1\r\nHost: lanyard-webhook\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    raw = b""
    while chunk := tls.recv(65536):
        raw += chunk
    tls.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return json.loads(payload)["response"]
