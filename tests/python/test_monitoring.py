"""The alert rules and the Grafana dashboard the chart ships
(charts/lanyard/files/), proven with a real Prometheus.

promtool checks the rules and runs their unit tests
(tests/monitoring/alerts.test.yaml), in which every alert fires and is
resolved; the chart renders the PrometheusRule and the dashboard's ConfigMap
only when asked; docs/operations.md lists exactly the shipped alerts, each
with a troubleshooting section; and a Prometheus on loopback scrapes a
loaded `lanyard dev`, a `lanyard agent` with a pod's `lanyard-sidecar`
(against the fake API server and its clouds) and the chart's webhook until
every dashboard query returns data and every metric the rules and the
dashboard name has been scraped.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import re
import secrets
import shutil
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from chart import CHART, NAMESPACE, ROOT, Container, FakeKube, apply_json_patch, find, free_ports, post_review, render, wait_for
from conftest import Dev, lanyard_binary, sidecar_binary, stop_process

ALERTS = CHART / "files" / "alerts.yaml"
ALERT_TESTS = ROOT / "tests" / "monitoring" / "alerts.test.yaml"
DASHBOARD = CHART / "files" / "dashboard.json"
OPERATIONS = ROOT / "docs" / "operations.md"
LAYOUT = ROOT / "docs" / "dashboard-layout.svg"
METRICS_RS = ROOT / "src" / "telemetry" / "metrics.rs"
SEVERITIES = {"critical", "warning", "info"}


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panel_queries(board: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of every panel."""
    return [(p["title"], t["expr"]) for p in board["panels"] if p["type"] != "row" for t in p["targets"]]


def names_in(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    names = set(re.findall(r"\blanyard_[a-z0-9_]+", expr))
    if re.search(r"\bup\s*\{", expr):
        names.add("up")
    return names


def promtool() -> str:
    found = shutil.which("promtool")
    if not found:
        pytest.skip("promtool is not installed (Debian's prometheus package; scripts/test installs it)")
    return found


# -- the rules ----------------------------------------------------------------


def test_promtool_checks_the_rules_and_every_alert_fires_and_resolves_in_its_unit_test():
    tool = promtool()
    check = subprocess.run([tool, "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(rules())} rules found" in check.stdout
    test = subprocess.run([tool, "test", "rules", str(ALERT_TESTS)], capture_output=True, text=True)
    assert test.returncode == 0, test.stdout + test.stderr
    # Each alert has a test of its own, in which it is first not firing,
    # then firing, then resolved.
    suite = yaml.safe_load(ALERT_TESTS.read_text())
    by_name = {t["name"]: t for t in suite["tests"]}
    for rule in rules():
        name = rule["alert"]
        assert name in by_name, f"{name} has no test in {ALERT_TESTS.name}"
        checks = sorted(((parse_duration(c["eval_time"]), bool(c.get("exp_alerts")))
                         for c in by_name[name]["alert_rule_test"] if c["alertname"] == name))
        states = [firing for _, firing in checks]
        assert True in states, f"{name} never fires in its test"
        first = states.index(True)
        assert False in states[:first] and False in states[first:], f"{name}: not firing, firing, resolved: {checks}"
        for c in by_name[name]["alert_rule_test"]:
            for expected in c.get("exp_alerts") or []:
                assert expected["exp_labels"]["severity"] == rule["labels"]["severity"], name


def parse_duration(text: str) -> int:
    return sum(int(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in re.findall(r"(\d+)([hms])", text))


def test_every_alert_has_a_severity_and_a_troubleshooting_section():
    anchors = {github_anchor(h) for h in re.findall(r"^#{2,6} (.+)$", OPERATIONS.read_text(), re.M)}
    names = [r["alert"] for r in rules()]
    assert len(names) == len(set(names)), names
    for rule in rules():
        assert re.fullmatch(r"Lanyard[A-Z][A-Za-z]+", rule["alert"]), rule["alert"]
        assert rule["labels"]["severity"] in SEVERITIES, rule
        assert {"summary", "description", "runbook"} <= set(rule["annotations"]), rule["alert"]
        page, _, anchor = rule["annotations"]["runbook"].partition("#")
        assert page == "docs/operations.md" and anchor == rule["alert"].lower(), rule["annotations"]["runbook"]
        assert anchor in anchors, f"docs/operations.md has no section #{anchor}"


def github_anchor(heading: str) -> str:
    text = re.sub(r"[`*]", "", heading.strip()).lower()
    return re.sub(r"[^a-z0-9 _-]", "", text).replace(" ", "-")


def documented_alerts() -> list[dict]:
    """The rows of docs/operations.md's alert table."""
    text = OPERATIONS.read_text()
    section = text.split("\n### Alerts\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) != 5 or not cells[0].startswith("[`"):
            continue
        name = re.fullmatch(r"\[`(\w+)`\]\(#(\w+)\)", cells[0])
        assert name and name.group(2) == name.group(1).lower(), cells[0]
        expr = re.fullmatch(r"`(.+)`", cells[3])
        assert expr, cells[3]
        rows.append({"alert": name.group(1), "severity": cells[1], "for": cells[2],
                     "expr": expr.group(1).replace("\\|", "|")})
    return rows


def test_the_docs_list_exactly_the_shipped_alerts():
    shipped = [{"alert": r["alert"], "severity": r["labels"]["severity"], "for": r.get("for", "–"),
                "expr": " ".join(r["expr"].split())} for r in rules()]
    assert documented_alerts() == shipped
    # And one troubleshooting section per alert, no more.
    runbooks = OPERATIONS.read_text().split("\n### When an alert fires\n", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^#### (\w+)$", runbooks, re.M) == [r["alert"] for r in rules()]


# -- the dashboard --------------------------------------------------------------


def exported_metrics() -> set[str]:
    """Every series name Lanyard's registry can export, from metrics.rs:
    `lanyard_` and the registered name, `_total` for counters, the three
    series of histograms."""
    source = METRICS_RS.read_text()
    kinds = {field: ty for field, ty in re.findall(r"pub (\w+): (?:Family<\w+, )?(Counter|Gauge|Histogram)", source)}
    names = set()
    for name, field in re.findall(r'registry\.register\(\s*"(\w+)",\s*"[^"]*",\s*m\.(\w+)\.clone\(\)', source, re.S):
        base = f"lanyard_{name}"
        kind = kinds[field]
        names |= {base + "_total"} if kind == "Counter" else {base} if kind == "Gauge" else {
            base + s for s in ("_bucket", "_sum", "_count")}
    assert len(names) > 20, names
    return names


def test_rules_and_dashboard_use_only_metrics_lanyard_exports():
    exported = exported_metrics() | {"up"}
    used = set()
    for rule in rules():
        used |= names_in(rule["expr"])
    for _, expr in panel_queries(dashboard()):
        used |= names_in(expr)
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            used |= names_in(var["query"]["query"])
    assert used - exported == set()
    # And each is in the metrics table of docs/operations.md.
    table = OPERATIONS.read_text().split("\n## Metrics\n", 1)[1].split("\n### ", 1)[0]
    documented = set(re.findall(r"^\| `(lanyard_\w+)`", table, re.M))
    assert {re.sub(r"_(bucket|sum|count)$", "", n) for n in used - {"up"}} - documented == set()


def test_the_dashboard_is_well_formed():
    board = dashboard()
    assert board["uid"] == "lanyard" and board["title"] == "Lanyard"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    # Panels tile the 24-column grid without overlapping.
    taken = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"{p['title']} overlaps another panel"
        taken |= cells
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["description"] and p["targets"], p["title"]
        for t in p["targets"]:
            used = set(re.findall(r"\$(\w+)", t["expr"])) - {"__rate_interval"}
            assert used <= set(variables), (p["title"], used)


def test_the_layout_picture_is_drawn_from_the_dashboard():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "dashboard-layout")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert LAYOUT.read_text() == out.stdout, "docs/dashboard-layout.svg is stale: scripts/dashboard-layout > docs/dashboard-layout.svg"
    for title, _ in panel_queries(dashboard()):
        assert f">{escape_xml(title)}<" in out.stdout, title


def escape_xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# -- the chart ------------------------------------------------------------------


def test_the_chart_renders_the_rules_and_the_dashboard_only_when_enabled(tmp_path):
    pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (tests/python/requirements.txt)")
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    defaults = render({"serviceMonitor": {"enabled": True}})
    assert not [o for o in defaults if o["kind"] == "PrometheusRule"]
    assert not [o for o in defaults if o["kind"] == "ConfigMap" and "grafana_dashboard" in o["metadata"].get("labels", {})]

    objects = render({"cache": {"maxEntries": 2500},
                      "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"},
                                         "additionalLabels": {"team": "platform", "severity": "page"},
                                         "runbookBaseUrl": "https://git.example.com/lanyard/blob/main/docs/operations.md"},
                      "grafanaDashboard": {"enabled": True, "namespace": "monitoring",
                                           "annotations": {"grafana_folder": "Lanyard"}}})
    rule = find(objects, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == NAMESPACE and rule["metadata"]["labels"]["release"] == "prometheus"
    # The fields of the CRD's schema (monitoring.coreos.com_prometheusrules).
    assert set(rule["spec"]) == {"groups"}
    for group in rule["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "labels", "limit", "partial_response_strategy", "query_offset", "rules"}
        for r in group["rules"]:
            assert set(r) <= {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}, r
            assert all(isinstance(v, str) for v in [*r["labels"].values(), *r["annotations"].values()]), r
            assert re.fullmatch(r"(\d+[smhdwy])+", r.get("for", "0s")), r
    rendered = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert [r["alert"] for r in rendered] == [r["alert"] for r in rules()]
    for shipped, r in zip(rules(), rendered):
        # The rule's own severity wins over additionalLabels.
        assert r["labels"] == {"severity": shipped["labels"]["severity"], "team": "platform"}
        anchor = shipped["annotations"]["runbook"].split("#")[1]
        assert r["annotations"]["runbook_url"] == f"https://git.example.com/lanyard/blob/main/docs/operations.md#{anchor}"
    exprs = {r["alert"]: r["expr"] for r in rendered}
    # The ServiceMonitor's jobs (its Services' names) in the release's namespace.
    assert exprs["LanyardAgentDown"] == f'up{{job="lanyard-agent-metrics",namespace="{NAMESPACE}"}} == 0'
    assert exprs["LanyardWebhookUnavailable"] == f'absent(up{{job="lanyard-webhook",namespace="{NAMESPACE}"}} == 1)'
    assert exprs["LanyardCacheNearFull"] == "lanyard_cache_entries > 0.9 * 2500"
    assert not any("lanyard-agent\"" in e for e in exprs.values())
    # Prometheus takes the rendered groups as they are.
    (tmp_path / "rendered.yaml").write_text(yaml.safe_dump(rule["spec"]))
    tool = shutil.which("promtool")
    if tool:
        check = subprocess.run([tool, "check", "rules", str(tmp_path / "rendered.yaml")], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr

    (configmap,) = [o for o in objects if o["kind"] == "ConfigMap" and "grafana_dashboard" in o["metadata"]["labels"]]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "Lanyard"}
    assert json.loads(configmap["data"]["lanyard.json"]) == dashboard()
    for version in ("1.29.0", "1.35.0"):
        kubernetes_validate.validate(configmap, version, strict=True)
    # The ServiceMonitor labels each target with its node (the dashboard's $node).
    monitor = find(defaults, "ServiceMonitor")
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in monitor["spec"]["endpoints"][0]["relabelings"]
    import helm_python as helm

    for bad in [{"prometheusRule": {"runbookBaseUrl": "docs/operations.md"}}, {"prometheusRule": {"enable": True}},
                {"grafanaDashboard": {"namespace": "Monitoring_NS"}}, {"grafanaDashboard": {"labels": {"grafana_dashboard": 1}}}]:
        with pytest.raises(helm.HelmError):
            render(bad)


# -- a real Prometheus ----------------------------------------------------------

TENANT = "5f0c8b0e-6a3b-4c1e-9a51-3d2f1e0c7b21"
PROVIDER = "//iam.googleapis.com/projects/123456789012/locations/global/workloadIdentityPools/mon/providers/cluster"
CLIENT_ID = "8c1e7a52-4b3f-4d8e-9f0a-2b6c5d4e3f21"
GSA = "trainer@ml-data.iam.gserviceaccount.com"
ROLE = "arn:aws:iam::111122223333:role/trainer"
NODE = "node-a"
# Lifetime of what the clouds issue to the agent: the cache serves an Entra
# or Google token while more than 5 minutes remain, and refreshes it at the
# latest when 30 s of that are left (lanyard::cache::refresh_at), so 332 s
# makes the first refresh come 31 s after the first exchange.
LIFETIME = 332
STORAGE = "https://storage.azure.com/"
CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
POLICY = """
@id("allow-bound")
permit (principal, action in Action::"credential", resource);

@id("no-management")
forbid (principal, action, resource)
when { context.scopes.contains("https://management.azure.com/") };
"""


def http_get(url: str, headers: dict[str, str]) -> int:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


class Surfaces:
    """The SDK endpoints as a pod calls them, at `base`."""

    def __init__(self, base: str, aws_token_file: Path):
        self.base, self.aws_token_file = base, aws_token_file

    def azure(self, resource: str = STORAGE, client_id: str | None = None) -> int:
        query = {"api-version": "2018-02-01", "resource": resource, **({"client_id": client_id} if client_id else {})}
        return http_get(f"{self.base}/metadata/identity/oauth2/token?{urllib.parse.urlencode(query)}", {"Metadata": "true"})

    def gcp(self, scopes: str = CLOUD_PLATFORM) -> int:
        return http_get(f"{self.base}/computeMetadata/v1/instance/service-accounts/default/token?"
                        f"{urllib.parse.urlencode({'scopes': scopes})}", {"Metadata-Flavor": "Google"})

    def aws(self) -> int:
        return http_get(f"{self.base}/v1/credentials", {"Authorization": self.aws_token_file.read_text().strip()})

    def herd(self, n: int, resource: str) -> list[int]:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            return list(pool.map(lambda _: self.azure(resource), range(n)))


class Prometheus:
    """A `prometheus` on loopback and its HTTP API."""

    def __init__(self, binary: str, workdir: Path, config: dict):
        workdir.mkdir(parents=True, exist_ok=True)
        (port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{port}"
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen([binary, f"--config.file={workdir / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                                      "--log.level=warn"], stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(lambda: urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).status == 200,
                 "prometheus ready", proc=self.proc)

    def api(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
                answer = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{path} {params}: {e.code} {e.read()[:500]!r}") from None
        assert answer["status"] == "success", answer
        return answer["data"]

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def scraped_names(admin: str) -> set[str]:
    text = urllib.request.urlopen(f"{admin}/metrics", timeout=5).read().decode()
    return {m.group(1) for m in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.M)}


def metric_value(admin: str, name: str) -> float:
    text = urllib.request.urlopen(f"{admin}/metrics", timeout=5).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


class Collector:
    """An audit HTTP collector on loopback: 503 (Retry-After: 1) while
    `failing`, then 200, counting the records of each batch it took."""

    def __init__(self):
        import gzip
        import http.server

        collector = self
        self.failing = True
        self.records = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if collector.failing:
                    self.send_response(503)
                    self.send_header("Retry-After", "1")
                else:
                    if self.headers.get("Content-Encoding") == "gzip":
                        body = gzip.decompress(body)
                    collector.records += len(json.loads(body))
                    self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/audit"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def fault(kube: FakeKube, cloud: str, **query) -> None:
    qs = urllib.parse.urlencode({"cloud": cloud, **query})
    request = urllib.request.Request(f"{kube.control}/clouds/faults?{qs}", method="POST", data=b"")
    with urllib.request.urlopen(request, timeout=5) as r:
        assert r.status == 200


def mint(kube: FakeKube, audience: str) -> str:
    body = json.dumps({"namespace": "ml", "pod": "trainer-0", "audiences": [audience], "expiration_seconds": 3600}).encode()
    request = urllib.request.Request(f"{kube.control}/token", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as r:
        return json.loads(r.read())["token"]


def admission(pod: dict, operation: str = "CREATE") -> dict:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"}, "namespace": "ml",
        "operation": operation, "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
        "object": pod, "oldObject": None, "dryRun": False}}


def resolve_variables(prom: Prometheus, board: dict) -> dict[str, str]:
    """Each query variable's values through Prometheus, as Grafana resolves
    them, and what Grafana puts in the queries for "All": the variable's
    allValue, or the values as a regex alternation."""
    substitution: dict[str, str] = {}
    for var in board["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = substitute(var["query"]["query"], substitution)
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", query)
        assert m, query
        values = prom.api(f"label/{m.group(2)}/values", **{"match[]": m.group(1)})
        assert values, f"variable ${var['name']} ({query}) has no values"
        substitution[var["name"]] = var.get("allValue") or "(" + "|".join(map(regex_escape, values)) + ")"
        substitution[f"{var['name']}:values"] = values
    return substitution


def regex_escape(value: str) -> str:
    """A value as a regex inside a PromQL string, as Grafana escapes it."""
    return re.sub(r"([\\^$*+?.()|{}\[\]])", r"\\\\\1", value)


def substitute(expr: str, variables: dict) -> str:
    for name, value in variables.items():
        if isinstance(value, str):
            expr = expr.replace(f"${name}", value)
    return expr.replace("$__rate_interval", "1m")


def test_a_real_prometheus_scrapes_every_metric_and_every_panel_has_data(tmp_path):
    prometheus = shutil.which("prometheus")
    if not prometheus:
        pytest.skip("prometheus is not installed (Debian's prometheus package; scripts/test installs it)")
    pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (tests/python/requirements.txt)")
    agent_port, agent_admin, sidecar_port, hook_port, hook_admin = free_ports(5)
    clouds = tmp_path / "clouds.json"
    clouds.write_text(json.dumps({"azure_tenant_id": TENANT, "gcp_provider": PROVIDER, "lifetime_seconds": LIFETIME,
                                  "identities": [{"namespace": "ml", "service_account": "trainer",
                                                  "azure_client_id": CLIENT_ID, "gcp_service_account": GSA,
                                                  "aws_role_arn": ROLE}]}))
    started = []  # what to stop, last started first
    kube = FakeKube(tmp_path / "kube", clouds=clouds)
    try:
        kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}})
        kube.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "trainer", "namespace": "ml", "annotations": {
            "azure.workload.identity/client-id": CLIENT_ID, "iam.gke.io/gcp-service-account": GSA,
            "eks.amazonaws.com/role-arn": ROLE}}})
        kube.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "trainer-0", "namespace": "ml"},
                    "spec": {"nodeName": NODE, "serviceAccountName": "trainer", "containers": [{"name": "app"}]}})

        # The agent of node-a, with a policy set and the audit file, which
        # it exports to a collector that refuses batches at first.
        collector = Collector()
        started.append(collector.stop)
        for role in ("agent", "dev"):
            (tmp_path / role / "policies").mkdir(parents=True)
            (tmp_path / role / "policies" / "policy.cedar").write_text(POLICY)
        info = kube.info
        (tmp_path / "agent" / "agent.yaml").write_text(yaml.safe_dump({
            "azure": {"authority_host": info["azure"], "tenant_id": TENANT},
            "gcp": {"workload_identity_provider": PROVIDER, "project_id": "ml-data", "sts_endpoint": info["gcp"],
                    "iamcredentials_endpoint": info["gcp"], "token_lifetime": LIFETIME},
            "aws": {"region": "us-east-1", "sts_endpoint": info["aws"]},
            "policy": {"dir": str(tmp_path / "agent" / "policies"), "reload_seconds": 1},
            "audit": {"file": str(tmp_path / "agent" / "audit.jsonl"), "http": collector.url,
                      "export_max_backlog": 100000}}))
        env = {"PATH": "/usr/bin:/bin", "KUBECONFIG": kube.kubeconfig, "RUST_LOG": "info"}
        agent = subprocess.Popen([lanyard_binary(), "--config", str(tmp_path / "agent" / "agent.yaml"), "agent",
                                  "--listen", f"127.0.0.1:{agent_port}", "--admin-listen", f"127.0.0.1:{agent_admin}",
                                  "--node-name", NODE], env=env, stdout=subprocess.DEVNULL,
                                 stderr=open(tmp_path / "agent" / "agent.log", "wb"))
        started.append(lambda: stop_process(agent))
        # The pod's sidecar, with its projected tokens.
        tokens = tmp_path / "pod" / "tokens"
        tokens.mkdir(parents=True)
        for name, audience in {"azure": "api://AzureADTokenExchange", "gcp": PROVIDER, "aws": "sts.amazonaws.com",
                               "app": "lanyard"}.items():
            (tokens / name).write_text(mint(kube, audience))
        sidecar = subprocess.Popen([sidecar_binary(), "--listen", f"127.0.0.1:{sidecar_port}", "--agent",
                                    f"http://127.0.0.1:{agent_port}", "--token-dir", str(tokens)],
                                   env={"PATH": "/usr/bin:/bin", "RUST_LOG": "info", "IDENTITY_HEADER": secrets.token_hex(16),
                                        "LANYARD_AWS_REGION": "us-east-1", "LANYARD_SIDECAR_GRANT_REUSE_SECONDS": "0"},
                                   stdout=subprocess.DEVNULL, stderr=open(tmp_path / "pod" / "sidecar.log", "wb"))
        started.append(lambda: stop_process(sidecar))
        for url, proc in ((f"http://127.0.0.1:{agent_admin}/readyz", agent), (f"http://127.0.0.1:{sidecar_port}/readyz", sidecar)):
            wait_for(lambda: urllib.request.urlopen(url, timeout=2).status == 200, url, proc=proc)
        # The first exchanges: their refresh is due LIFETIME - 300 s later.
        pod = Surfaces(f"http://127.0.0.1:{sidecar_port}", tokens / "app")
        first_exchange = time.monotonic()
        assert pod.azure() == 200 and pod.gcp() == 200
        # `lanyard dev`, as another node: a small cache and tight fairness
        # bounds, so that the load reaches them.
        dev = Dev([], tmp_path / "dev" / "dev.log", extra_env={
            "RUST_LOG": "info", "LANYARD_POLICY_DIR": str(tmp_path / "dev" / "policies"), "LANYARD_POLICY_RELOAD_SECONDS": "1",
            "LANYARD_AUDIT_FILE": str(tmp_path / "dev" / "audit.jsonl"), "LANYARD_CACHE_MAX_ENTRIES": "6",
            "LANYARD_CACHE_CALLER_NEW_KEYS_BURST": "8", "LANYARD_CACHE_CALLER_NEW_KEYS_PER_SECOND": "0.2",
            "LANYARD_DEV_UPSTREAM_LATENCY_MS": "200"})
        started.append(dev.stop)
        # The chart's webhook, with the guard.
        objects = render({"azure": {"tenantId": TENANT}, "aws": {"region": "us-east-1"},
                          "gcp": {"workloadIdentityProvider": PROVIDER, "projectId": "ml-data", "projectNumber": "123456789012"},
                          "webhook": {"port": hook_port, "adminPort": hook_admin}, "guard": {"enabled": True}})
        webhook = Container(objects, "Deployment", lanyard_binary(), tmp_path / "webhook",
                            {"spec.nodeName": NODE, "status.hostIP": "127.0.0.1"}, kube.kubeconfig)
        started.append(webhook.stop)
        wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{hook_admin}/readyz", timeout=2).status == 200,
                 "the webhook is ready", proc=webhook.proc)

        agent_url, dev_url, hook_url = f"http://127.0.0.1:{agent_admin}", dev.admin, f"http://127.0.0.1:{hook_admin}"
        prom = Prometheus(prometheus, tmp_path / "prometheus", {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [
                {"job_name": "lanyard-agent", "static_configs": [
                    {"targets": [agent_url.removeprefix("http://")], "labels": {"node": NODE}},
                    {"targets": [dev_url.removeprefix("http://")], "labels": {"node": "lanyard-dev-node"}}]},
                {"job_name": "lanyard-webhook", "static_configs": [
                    {"targets": [hook_url.removeprefix("http://")], "labels": {"node": NODE}}]}]})
        started.append(prom.stop)
        wait_for(lambda: len([t for t in prom.api("targets")["activeTargets"] if t["health"] == "up"]) == 3,
                 "prometheus scrapes the agent, dev and the webhook", proc=prom.proc)

        laptop = Surfaces(dev.exports["AZURE_POD_IDENTITY_AUTHORITY_HOST"], Path(dev.exports["AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"]))
        for surfaces in (pod, laptop):
            assert surfaces.azure() == 200 and surfaces.azure() == 200
            assert surfaces.gcp() == 200 and surfaces.gcp() == 200
            assert surfaces.aws() == 200
            # Identities the ServiceAccount is not bound to, and a policy denial.
            assert surfaces.azure(client_id="00000000-0000-0000-0000-000000000001") == 400
            assert surfaces.azure("https://management.azure.com/") == 403
        # The exporter is behind by what the refused batches held; then the
        # collector takes them.
        assert metric_value(agent_url, "lanyard_audit_export_backlog_records") > 0
        assert metric_value(agent_url, "lanyard_audit_export_max_backlog_records") == 100000
        collector.failing = False
        # A herd for a new scope shares one exchange (the dev emulators and,
        # here, a slow Entra answer keep the first in flight).
        fault(kube, "azure", fault="latency", ms=300, count=1)
        assert pod.herd(8, "https://vault.azure.net") == [200] * 8
        assert laptop.herd(8, "https://vault.azure.net") == [200] * 8
        # Google throttles, then fails, for a new scope each; the retry is
        # answered from the remembered failure.
        fault(kube, "gcp", fault="status", status=429, retry_after=2, count=1)
        assert pod.gcp("https://www.googleapis.com/auth/devstorage.read_only") == 429
        assert pod.gcp("https://www.googleapis.com/auth/devstorage.read_only") == 429
        time.sleep(1.5)  # scraped once, so that the next one is an increase
        fault(kube, "gcp", fault="status", status=429, retry_after=2, count=1)
        assert pod.gcp("https://www.googleapis.com/auth/pubsub") == 429
        fault(kube, "gcp", fault="status", status=503, count=4)
        assert pod.gcp("https://www.googleapis.com/auth/bigquery") == 503
        assert pod.gcp("https://www.googleapis.com/auth/bigquery") == 503
        # New scopes beyond the ServiceAccount's burst are refused (429), and
        # the small cache evicts its least recently used entries.
        answers = [laptop.azure(f"https://app{i}.example.net") for i in range(12)]
        assert 200 in answers and 429 in answers, answers
        # A policy change that does not validate is rejected.
        (tmp_path / "dev" / "policies" / "broken.cedar").write_text("permit (principal, action, resource")
        # Admissions: injected, unchanged, denied; the guard's allow and deny.
        ca = ssl.create_default_context(cadata=base64.b64decode(find(objects, "Secret", "lanyard-webhook-tls")["data"]["ca.crt"]).decode())
        opted_in = {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "trainer-", "namespace": "ml",
                    "labels": {"lanyard.dev/inject": "true"}},
                    "spec": {"serviceAccountName": "trainer", "containers": [{"name": "app", "image": "python:3.12"}]}}
        plain = {**opted_in, "metadata": {"generateName": "web-", "namespace": "ml"}}
        host_network = {**opted_in, "spec": {**opted_in["spec"], "hostNetwork": True}}
        decisions = [post_review(hook_port, ca, "/mutate", admission(p)) for p in (opted_in, plain, host_network)]
        assert [d["allowed"] for d in decisions] == [True, True, False] and "patch" in decisions[0], decisions
        cases = json.loads((ROOT / "tests" / "fixtures" / "guard" / "cases.json").read_text())
        for name in ("a plain pod", "the app projects its own sts.amazonaws.com token"):
            (case,) = [c for c in cases["cases"] if c["name"] == name]
            answer = post_review(hook_port, ca, "/validate", admission(apply_json_patch(cases["bases"][case["base"]], case["patch"])))
            assert answer["allowed"] is case["allowed"], answer

        # Steady load until the agent's first refresh, which Entra fails.
        refresh_due = first_exchange + LIFETIME - 300
        failing = False
        while metric_value(agent_url, "lanyard_cache_refresh_failures_total") == 0:
            assert time.monotonic() < refresh_due + 15, "the agent did not refresh (and fail to) in time"
            if not failing and time.monotonic() > refresh_due - 5:
                fault(kube, "azure", fault="status", status=503)
                failing = True
            for surfaces in (pod, laptop):
                surfaces.azure(), surfaces.gcp()
            laptop.aws()
            time.sleep(0.5)
        # Google's refresh, due at the same time, succeeds.
        wait_for(lambda: metric_value(agent_url, "lanyard_cache_refreshes_total") >= 2, "the agent refreshes Google's token")
        time.sleep(3)  # a few more scrapes

        # The exporter caught up and the gauge says so.
        wait_for(lambda: metric_value(agent_url, "lanyard_audit_export_backlog_records") == 0
                 and collector.records > 0, "the exporter delivers its backlog")

        # Every metric the rules and the dashboard read was scraped.
        board = dashboard()
        used = set()
        for rule in rules():
            used |= names_in(rule["expr"])
        for _, expr in panel_queries(board):
            used |= names_in(expr)
        scraped = scraped_names(agent_url) | scraped_names(dev_url) | scraped_names(hook_url)
        assert used - {"up"} - scraped == set()
        assert used - set(prom.api("label/__name__/values")) == set()
        # Prometheus evaluates every rule without error, and those the load
        # made true are pending or firing.
        evaluated = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
        assert sorted(r["name"] for r in evaluated) == sorted(r["alert"] for r in rules())
        assert [(r["name"], r["lastError"]) for r in evaluated if r["health"] != "ok"] == []
        # An alert becomes pending at the first evaluation after the scrape
        # that makes its expression true: up to a few seconds after the
        # event, on a loaded machine more.
        pending = ("LanyardUpstreamThrottled", "LanyardCallerThrottled", "LanyardCacheEvicting", "LanyardRefreshFailing")
        deadline = time.monotonic() + 30
        while True:
            active = {a["labels"]["alertname"]: a["state"] for a in prom.api("alerts")["alerts"]}
            if all(active.get(n) in ("pending", "firing") for n in pending) or time.monotonic() > deadline:
                break
            time.sleep(1)
        for name in ("LanyardPolicyReloadRejected", "LanyardWebhookDenying", "LanyardGuardRefusing"):
            assert active.get(name) == "firing", (name, active)
        for name in pending:
            assert active.get(name) in ("pending", "firing"), (name, sorted(active.items()))
        # The variables resolve, and every panel's every query returns data.
        variables = resolve_variables(prom, board)
        assert set(variables["node:values"]) == {NODE, "lanyard-dev-node"}
        assert set(variables["cloud:values"]) == {"azure", "gcp", "aws"}
        assert set(variables["job:values"]) == {"lanyard-agent", "lanyard-webhook"}
        empty = []
        for title, expr in panel_queries(board):
            query = substitute(expr, variables)
            assert "$" not in query, query
            if not prom.api("query", query=query)["result"]:
                empty.append((title, query))
        assert empty == []
    finally:
        for stop in reversed(started):
            stop()
        kube.stop()
