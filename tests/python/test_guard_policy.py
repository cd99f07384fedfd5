"""The guard's two forms agree: on every case of the shared fixtures
(tests/fixtures/guard/cases.json, also run by tests/webhook_guard.rs), the
chart's ValidatingAdmissionPolicy, evaluated by a real CEL implementation
(cel-expr-python, the official C++ runtime), and `lanyard webhook`'s
`POST /validate`, started from the same rendered chart, give the decision
the case expects, and the webhook's rule is among those the policy's
failing validations name.

The fake API server's own evaluation of the policy (the `cel` crate with
kube-cel, which it runs for every pod the pod harness creates) must decide
every case alike, with the same first message.

The policy is evaluated as the API server does: its variables in order,
each seeing `object`, `oldObject`, `request` and the variables before it;
then every validation, `messageExpression` for a failing one. One
difference is unavoidable: the API server type-checks against the Pod
schema, this environment takes `object` as dynamic JSON.
"""

from __future__ import annotations

import base64
import json
import re
import ssl
import uuid

import pytest

from chart import ROOT, Container, FakeKube, apply_json_patch, find, free_ports, post_review, render, wait_for
from conftest import lanyard_binary

cel = pytest.importorskip("cel_expr_python.cel", reason="cel-expr-python is not installed (tests/python/requirements.txt)")
pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (tests/python/requirements.txt)")
from cel_expr_python.ext import ext_strings  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "guard"
CASES = json.loads((FIXTURES / "cases.json").read_text())
BASES = {**CASES["bases"], "injected": json.loads((FIXTURES / "injected.json").read_text()),
         "stored": json.loads((FIXTURES / "stored.json").read_text())}


def runs() -> list[dict]:
    """Every case, and each on the injected base once more on the stored
    one (the pod as the API server stores it; tests/support/guard.rs
    `runs`)."""
    out = []
    for case in CASES["cases"]:
        out.append(case)
        if case["base"] == "injected":
            out.append({**case, "base": "stored", "name": f"{case['name']} (as stored)"})
    return out
RULE = re.compile(r"lanyard guard \(([a-z-]+)\)")


def values(hook_port: int = 8443, hook_admin: int = 8444) -> dict:
    """Chart values that make the webhook inject what the fixtures hold."""
    s = CASES["settings"]
    repository, tag = s["sidecar_image"].rsplit(":", 1)
    return {"image": {"repository": repository, "tag": tag},
            "azure": {"tenantId": s["azure_tenant_id"]},
            "gcp": {"workloadIdentityProvider": s["gcp_audience"], "projectId": "ml-data",
                    "projectNumber": "123456789012"},
            "aws": {"region": s["aws_region"]},
            "webhook": {"port": hook_port, "adminPort": hook_admin},
            "guard": {"enabled": True, "admissionPolicy": True, "extraAudiences": s["extra_audiences"]}}


def review(case: dict) -> dict:
    base = BASES[case["base"]]
    update = case["operation"] == "UPDATE"
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"}, "subResource": case["subResource"],
        "namespace": "ml", "operation": case["operation"], "userInfo": {"username": "jane@example.com"},
        "object": apply_json_patch(base, case["patch"]), "oldObject": base if update else None, "dryRun": False}}


class Policy:
    """A ValidatingAdmissionPolicy's expressions, compiled once."""

    def __init__(self, policy: dict):
        self.env = cel.NewEnv(variables={k: cel.Type.DYN for k in ("object", "oldObject", "request", "variables")},
                              extensions=[ext_strings.ExtStrings()])
        spec = policy["spec"]
        self.variables = [(v["name"], self.env.compile(v["expression"])) for v in spec["variables"]]
        self.validations = [(self.env.compile(v["expression"]),
                             self.env.compile(v["messageExpression"]) if "messageExpression" in v else None,
                             v.get("message", "")) for v in spec["validations"]]

    def evaluate(self, request: dict) -> list[str]:
        """The messages of the validations that fail (empty: admitted)."""
        data = {"object": request["object"], "oldObject": request["oldObject"],
                "request": {k: v for k, v in request.items() if k not in ("object", "oldObject")}, "variables": {}}
        for name, expression in self.variables:
            data["variables"] = {**data["variables"], name: expression.eval(data=data).plain_value()}
        failed = []
        for expression, message_expression, message in self.validations:
            result = expression.eval(data=data).plain_value()
            assert isinstance(result, bool), result
            if not result:
                failed.append(message_expression.eval(data=data).plain_value() if message_expression else message)
        return failed


def test_the_policy_and_the_webhook_agree_on_every_case(tmp_path):
    hook_port, hook_admin = free_ports(2)
    objects = render(values(hook_port, hook_admin))
    policy = Policy(find(objects, "ValidatingAdmissionPolicy"))
    kube = FakeKube(tmp_path / "kube")
    webhook = Container(objects, "Deployment", lanyard_binary(), tmp_path / "webhook",
                        {"spec.nodeName": "node-a", "status.hostIP": "127.0.0.1"}, kube.kubeconfig)
    try:
        import urllib.request

        wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{hook_admin}/readyz", timeout=2).status == 200,
                 "the webhook is ready", proc=webhook.proc)
        secret = find(objects, "Secret", "lanyard-webhook-tls")
        ca = ssl.create_default_context(cadata=base64.b64decode(secret["data"]["ca.crt"]).decode())
        # The fake API server evaluates the same policy with another CEL
        # runtime (the cel crate and kube-cel): it must decide alike.
        import requests

        for obj in objects:
            if obj["kind"] in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
                kube.apply(obj)
        kube.apply({"apiVersion": "v1", "kind": "Namespace",
                    "metadata": {"name": "ml", "labels": {"lanyard.dev/guard": "enforce"}}})
        refused = 0
        for case in runs():
            name = case["name"]
            request = review(case)
            failed = policy.evaluate(request["request"])
            fake = requests.post(f"{kube.control}/admission/policies", json=request, timeout=10).json()
            assert fake["allowed"] is case["allowed"], (name, fake, failed)
            if failed:
                assert fake["message"].endswith("denied request: " + failed[0]), (name, fake, failed)
            policy_rules = {m.group(1) for m in map(RULE.search, failed) if m}
            assert len(policy_rules) == len(failed), (name, failed)
            answer = post_review(hook_port, ca, "/validate", request)
            assert answer["uid"] == request["request"]["uid"]
            assert answer["allowed"] is case["allowed"], (name, answer)
            assert (not failed) is case["allowed"], (name, failed)
            if not case["allowed"]:
                refused += 1
                assert answer["status"]["code"] == 403, (name, answer)
                (rule,) = RULE.findall(answer["status"]["message"])
                assert rule == case["rule"], (name, answer)
                assert rule in policy_rules, (name, rule, failed)
        assert refused >= 40
        # Every refusal is an admission record naming its rule.
        records = [json.loads(line) for line in
                   (tmp_path / "webhook" / "volumes" / "audit" / "audit.jsonl").read_text().splitlines()]
        guard = [r for r in records if r["type"] == "admission" and r.get("rule")]
        assert len(guard) == refused, records
        assert {r["rule"] for r in guard} == {c["rule"] for c in CASES["cases"] if not c["allowed"]}
        assert all(r["decision"] == "deny" and "lanyard guard" in r["reason"] for r in guard)
        text = urllib.request.urlopen(f"http://127.0.0.1:{hook_admin}/metrics", timeout=2).read().decode()
        counted = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("lanyard_guard_reviews_total{") and 'decision="deny"' in line)
        assert counted == refused, text
    finally:
        code = webhook.stop()
        kube.stop()
    assert code == 0, webhook.output()[-3000:]


def test_the_policy_has_the_webhooks_audiences():
    """The audience list the chart computes is the one the webhook computes
    from the same values (as its refusals of each audience show)."""
    objects = render(values())
    (audiences,) = [v for v in find(objects, "ValidatingAdmissionPolicy")["spec"]["variables"]
                    if v["name"] == "audiences"]
    listed = json.loads(audiences["expression"])
    s = CASES["settings"]
    assert "sts.amazonaws.com" in listed and "api://azureadtokenexchangeusnat" in listed
    assert s["gcp_audience"].lower() in listed and "https:" + s["gcp_audience"].lower() in listed
    assert s["extra_audiences"][0] in listed
    assert listed == sorted(set(listed)) and all(a == a.lower() for a in listed)
