"""A fleet's audit trail, verified where the auditor keeps it: two clusters'
nodes export to one rsyslog (RELP and TLS) and one HTTP collector, and
`lanyard audit verify-collected` reads what those two hold. A clean run
verifies with no gap in any chain; then each fault is named in the chain it
hit: a record lost between exporter and collector, a file's tail removed
before its exporter shipped it, a record altered at the collector, a node
gone silent, an exporter killed and restarted (repeats only, no gap).

Each cluster is a fake API server with its own issuer and an emulated
Entra ID; each node runs `lanyard agent` with the cluster's name in
`audit.cluster`, checkpoints every 10 s, and answers its pod's token
requests on the agent API."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import yaml

from chart import FakeKube, free_ports
from conftest import lanyard_binary, stop_process
from test_audit_http import raw_elements
from test_audit_syslog import RSYSLOGD, rsyslog  # noqa: F401  (a pytest fixture)

pytestmark = pytest.mark.skipif(RSYSLOGD is None, reason="rsyslogd is not installed (scripts/test installs it)")

CHECKPOINT_SECONDS = 10
STALE_AFTER = 16


class Collector:
    """An HTTP collector keeping each record's text as one line. Per node
    (the URL's last segment) it can refuse batches (503), and it can lose
    one record of the next batch it takes, as a lossy path between
    exporter and store would."""

    def __init__(self, path: Path):
        self.path = path
        self.refusing: set[str] = set()
        self.lose_one_of: str | None = None
        self.lost: list[dict] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                node = self.path.rsplit("/", 1)[-1]
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if node in collector.refusing:
                    self.send_response(503)
                    self.send_header("Retry-After", "1")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                lines = raw_elements(gzip.decompress(body).decode())
                with collector.lock:
                    if collector.lose_one_of == node and len(lines) >= 1:
                        collector.lost.append(json.loads(lines.pop(len(lines) // 2)))
                        collector.lose_one_of = None
                    with open(collector.path, "a") as out:
                        out.writelines(line + "\n" for line in lines)
                self.send_response(204)
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}/audit"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


TENANT = "5f0c8b0e-6a3b-4c1e-9a51-3d2f1e0c7b21"
PROVIDER = "//iam.googleapis.com/projects/123456789012/locations/global/workloadIdentityPools/fleet/providers/cluster"
CLIENT_ID = "8c1e7a52-4b3f-4d8e-9f0a-2b6c5d4e3f21"


class Cluster:
    """A fake API server with its own issuer and an emulated Entra ID, one
    ServiceAccount bound to an Azure identity, and a pod on each node."""

    def __init__(self, work: Path, name: str, nodes: list[str]):
        self.name = name
        clouds = work / f"{name}-clouds.json"
        clouds.write_text(json.dumps({
            "azure_tenant_id": TENANT, "gcp_provider": PROVIDER,
            "identities": [{"namespace": "ray", "service_account": "ray-worker", "azure_client_id": CLIENT_ID,
                            "gcp_service_account": "ray@fleet.iam.gserviceaccount.com",
                            "aws_role_arn": "arn:aws:iam::111122223333:role/ray"}]}))
        self.kube = FakeKube(work / f"{name}-kube", clouds=clouds)
        self.kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ray"}})
        self.kube.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {
            "name": "ray-worker", "namespace": "ray", "annotations": {"azure.workload.identity/client-id": CLIENT_ID}}})
        for node in nodes:
            self.kube.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"worker-{node}", "namespace": "ray"},
                             "spec": {"nodeName": node, "serviceAccountName": "ray-worker",
                                      "containers": [{"name": "ray"}]}})

    def token(self, node: str) -> str:
        body = json.dumps({"namespace": "ray", "pod": f"worker-{node}", "audiences": ["api://AzureADTokenExchange"],
                           "expiration_seconds": 3600}).encode()
        request = urllib.request.Request(f"{self.kube.control}/token", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=5) as r:
            return json.loads(r.read())["token"]

    def stop(self):
        self.kube.stop()


class Node:
    """A node of a cluster: its agent (`lanyard agent`), the node's audit
    file, and an exporter to the fleet's collector."""

    def __init__(self, work: Path, cluster: Cluster, name: str, export: dict):
        self.cluster, self.name = cluster, name
        self.work = work / f"{cluster.name}-{name}"
        self.work.mkdir(parents=True, exist_ok=True)
        self.audit = self.work / "audit.jsonl"
        self.config = self.work / "agent.yaml"
        self.config.write_text(yaml.safe_dump({
            "azure": {"authority_host": cluster.kube.info["azure"], "tenant_id": TENANT},
            "audit": {"file": str(self.audit), "cluster": cluster.name, "checkpoint_seconds": CHECKPOINT_SECONDS,
                      **export}}))
        self.port, self.admin = free_ports(2)
        self.starts = 0
        self.proc = None
        self.start()

    def start(self):
        self.starts += 1
        env = {"PATH": "/usr/bin:/bin", "KUBECONFIG": self.cluster.kube.kubeconfig, "RUST_LOG": "info"}
        self.proc = subprocess.Popen([lanyard_binary(), "--config", str(self.config), "agent",
                                      "--listen", f"127.0.0.1:{self.port}", "--admin-listen", f"127.0.0.1:{self.admin}",
                                      "--node-name", self.name], env=env, stdout=subprocess.DEVNULL,
                                     stderr=open(self.work / f"agent-{self.starts}.log", "wb"))
        wait_for(lambda: self.proc.poll() is None and ready(f"http://127.0.0.1:{self.admin}/readyz"),
                 f"the agent of {self.name} is ready")

    def ask(self, n: int, prefix: str = "app"):
        """`n` credential requests from the node's pod, each for a new scope."""
        token = self.cluster.token(self.name)
        for i in range(n):
            body = json.dumps({"cloud": "azure", "kind": "access_token",
                               "scopes": [f"api://{prefix}-{self.starts}-{i}/.default"],
                               "surface": "azure_imds"}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/token", data=body, headers={
                "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as r:
                assert r.status == 200

    def ids(self) -> set[str]:
        return {json.loads(line)["id"] for line in self.audit.read_text().splitlines()}

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self):
        if self.proc.poll() is None:
            stop_process(self.proc)


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def held_ids(*files: Path) -> set[str]:
    ids = set()
    for f in files:
        if f.exists():
            ids |= {json.loads(line)["id"] for line in f.read_text().splitlines() if line.strip()}
    return ids


def wait_for(predicate, what: str, timeout: float = 40):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out: {what}")


def verify_collected(*files: Path) -> tuple[int, dict]:
    run = subprocess.run([lanyard_binary(), "audit", "verify-collected", "--json", "--stale-after",
                          str(STALE_AFTER), *map(str, files)], capture_output=True, text=True, timeout=60)
    assert run.returncode in (0, 1), run.stderr
    return run.returncode, json.loads(run.stdout)


def by_node(report: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for chain in report["chains"]:
        out.setdefault(f"{chain['cluster']}/{chain['node']}", []).append(chain)
    return out


def test_two_clusters_one_collector_clean_then_every_fault_named(tmp_path, rsyslog):  # noqa: F811
    collector = Collector(tmp_path / "collector.jsonl")
    ca = str(rsyslog.work / "ca.pem")
    clusters, nodes = [], []
    try:
        east = Cluster(tmp_path, "east", ["east-1", "east-2"])
        clusters.append(east)
        west = Cluster(tmp_path, "west", ["west-1", "west-2"])
        clusters.append(west)
        assert east.kube.api != west.kube.api
        nodes = [
            Node(tmp_path, east, "east-1", {"syslog": f"relp://127.0.0.1:{rsyslog.relp_port}"}),
            Node(tmp_path, east, "east-2", {"syslog": f"tls://localhost:{rsyslog.port('tls')}", "syslog_ca": ca}),
            Node(tmp_path, west, "west-1", {"http": f"{collector.base}/west-1"}),
            Node(tmp_path, west, "west-2", {"http": f"{collector.base}/west-2"}),
        ]
        east1, east2, west1, west2 = nodes
        held = (rsyslog.records, collector.path)
        for node in nodes:
            node.ask(6)

        def all_shipped():
            return set().union(*(n.ids() for n in nodes)) <= held_ids(*held)

        wait_for(all_shipped, "every record reaches the collectors")
        code, report = verify_collected(*held)
        assert code == 0, report
        assert sorted(by_node(report)) == ["east/east-1", "east/east-2", "west/west-1", "west/west-2"]
        assert all(c["gaps"] == [] and c["first_seq"] == 0 for c in report["chains"]), report

        # Lost between exporter and collector: one record of west-1's next batch.
        collector.lose_one_of = "west-1"
        west1.ask(4, "lossy")
        wait_for(lambda: collector.lost, "the collector loses a record")
        lost_seq = collector.lost[0]["seq"]

        # west-2's tail is cut before its exporter ships it: the collector
        # refuses west-2's batches, three records are written, the last two
        # are cut from the file, then more come and the collector takes them.
        collector.refusing.add("west-2")
        west2.ask(3, "unshipped")
        lines = west2.audit.read_text().splitlines(keepends=True)
        cut = [json.loads(line)["seq"] for line in lines[-2:]]
        west2.audit.write_text("".join(lines[:-2]))
        west2.ask(3, "after-cut")
        collector.refusing.discard("west-2")

        # east-1's exporter is killed and the node restarted: repeats only.
        east1.ask(3, "before-kill")
        east1.kill()
        east1.start()
        east1.ask(3, "after-restart")

        # east-2 goes silent: its process is stopped for good.
        east2.kill()
        silent_since = time.time()

        wait_for(lambda: (west1.ids() | east1.ids()) <= held_ids(*held) | {r["id"] for r in collector.lost},
                 "the live nodes' records are shipped")
        wait_for(lambda: west2.ids() <= held_ids(*held), "west-2's remaining records are shipped")
        # Past the staleness threshold for the silent node, with the live
        # nodes' checkpoints (every 10 s) still fresh.
        time.sleep(max(0.0, STALE_AFTER + 1 - (time.time() - silent_since)))
        for node in (east1, west1, west2):
            node.ask(1, "late")
        wait_for(lambda: (east1.ids() | west1.ids() | west2.ids()) <= held_ids(*held)
                 | {r["id"] for r in collector.lost}, "the late records are shipped")

        # A record altered at the collector, in a copy of its file.
        altered = tmp_path / "collector-altered.jsonl"
        text = collector.path.read_text().splitlines()
        victim = next(i for i, line in enumerate(text) if '"node":"west-1"' in line and '"type":"credential"' in line)
        text[victim] = text[victim].replace('"type":"credential"', '"type":"Credential"', 1)
        altered.write_text("\n".join(text) + "\n")

        code, report = verify_collected(rsyslog.records, altered)
        assert code == 1
        chains = by_node(report)
        (e1,), (e2,), (w1,), (w2,) = (chains[k] for k in ("east/east-1", "east/east-2", "west/west-1", "west/west-2"))
        # east-1: restarted mid-export, one chain, nothing missing, repeats counted.
        assert e1["gaps"] == [] and e1["forks"] == [] and not e1["stale"], e1
        # east-2: silent.
        assert e2["stale"] and e2["gaps"] == [], e2
        # west-1: the record lost on the way, and the one altered at the collector.
        altered_seq = json.loads(text[victim])["seq"]
        assert sorted(g[0] for g in w1["gaps"]) == sorted({lost_seq, altered_seq}), (w1, lost_seq, altered_seq)
        assert [p["line"] for p in report["problems"]] == [victim + 1], report["problems"]
        assert "altered" in report["problems"][0]["error"]
        # west-2: the records cut from its file before export.
        assert w2["gaps"] == [[cut[0], cut[-1]]], (w2, cut)
        assert not w2["stale"], w2
        assert report["repeats"] >= 0 and all(c["forks"] == [] for c in report["chains"]), report
    finally:
        for node in nodes:
            node.stop()
        for cluster in clusters:
            cluster.stop()
        collector.stop()
