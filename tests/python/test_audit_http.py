"""Audit records POSTed to an HTTP collector that fails in the ways real
ones do (500, 429 with Retry-After, a connection closed mid-answer, down
altogether), with Lanyard killed in the middle: once the collector is
healthy every record arrives, repeats only by id."""

import gzip
import json
import os
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from azure.identity import ManagedIdentityCredential

from conftest import Dev, lanyard_binary


def raw_elements(array: str) -> list[str]:
    """The elements of a JSON array as the text they were sent as, which a
    collector keeps so that each record's hash still checks."""
    decoder = json.JSONDecoder()
    out, at = [], array.index("[") + 1
    while True:
        while array[at] in " \t\r\n,":
            at += 1
        if array[at] == "]":
            return out
        _, end = decoder.raw_decode(array, at)
        out.append(array[at:end])
        at = end


class Collector:
    """A collector on loopback whose answer the test sets."""

    def __init__(self):
        self.mode = "ok"
        self.received = []  # every record of every accepted batch, repeats included
        self.lines = []  # the same, each element's bytes as sent (docs/audit.md's layout)
        self.attempts = {}  # mode -> POSTs answered in it
        self.auth = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                mode = collector.mode
                collector.attempts[mode] = collector.attempts.get(mode, 0) + 1
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(length)
                collector.auth.append(self.headers.get("Authorization"))
                if mode == "close":
                    # Read it all, answer nothing: the connection drops.
                    self.close_connection = True
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"partial")
                    self.wfile.flush()
                    self.connection.shutdown(2)
                    return
                if mode == "500":
                    self.send_response(500)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if mode == "429":
                    self.send_response(429)
                    self.send_header("Retry-After", "1")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                assert self.headers.get("Content-Encoding") == "gzip"
                text = gzip.decompress(body).decode()
                records = json.loads(text)
                assert int(self.headers.get("X-Lanyard-Records")) == len(records)
                collector.received.extend(records)
                collector.lines.extend(raw_elements(text))
                self.send_response(204)
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/audit"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collector():
    c = Collector()
    yield c
    c.stop()


def start(tmp_path, audit_file, url, name, **extra):
    env = {"LANYARD_AUDIT_FILE": str(audit_file), "LANYARD_AUDIT_HTTP": url, **extra}
    return Dev([], tmp_path / f"{name}.log", extra_env=env)


def ask(dev, monkeypatch, prefix, n):
    monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", dev.exports["AZURE_POD_IDENTITY_AUTHORITY_HOST"])
    for i in range(n):
        dev.issued.append(ManagedIdentityCredential().get_token(f"api://{prefix}-{i}/.default").token)


def file_records(audit_file):
    return {r["id"]: r for r in map(json.loads, audit_file.read_text().splitlines())}


def wait_until(predicate, timeout=40):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_every_record_arrives_once_the_collector_recovers(tmp_path, collector, monkeypatch):
    for name in ("IDENTITY_ENDPOINT", "IDENTITY_HEADER", "MSI_ENDPOINT", "MSI_SECRET"):
        monkeypatch.delenv(name, raising=False)
    audit_file = tmp_path / "audit.jsonl"
    token_file = tmp_path / "collector-token"
    token_file.write_text("collector-secret-1\n")
    extra = {"LANYARD_AUDIT_HTTP_TOKEN_FILE": str(token_file)}
    dev = start(tmp_path, audit_file, collector.url, "first", **extra)
    issued = []
    try:
        for mode in ("500", "429", "close"):
            collector.mode = mode
            ask(dev, monkeypatch, mode, 3)  # credentials flow all the same
            assert wait_until(lambda: collector.attempts.get(mode, 0) >= 1), f"no POST while answering {mode}"
        assert collector.received == [], "nothing counts as delivered before a 2xx"
        # Killed while the collector is still failing.
        issued += dev.issued
        os.kill(dev.proc.pid, signal.SIGKILL)
        dev.proc.wait()
        dev.log.close()
    except BaseException:
        dev.stop()
        raise
    dev = start(tmp_path, audit_file, collector.url, "second", **extra)
    try:
        ask(dev, monkeypatch, "after-restart", 3)
        collector.mode = "ok"
        expected = file_records(audit_file)
        assert wait_until(lambda: set(expected) <= {r["id"] for r in collector.received}), (
            f"{len(set(expected) - {r['id'] for r in collector.received})} records never arrived"
        )
    finally:
        assert dev.stop() == 0
        issued += dev.issued
    # Repeats only of whole records, by id; each as it is in the file.
    expected = file_records(audit_file)
    for record in collector.received:
        kept = {k: v for k, v in expected[record["id"]].items() if k not in ("seq", "prev", "hash")}
        got = {k: v for k, v in record.items() if k not in ("seq", "prev", "hash")}
        assert got == kept
    assert set(collector.auth) == {"Bearer collector-secret-1"}
    text = json.dumps(collector.received)
    for token in issued:
        assert token not in text
    for log in ("first.log", "second.log"):
        assert "collector-secret-1" not in (tmp_path / log).read_text(errors="replace")
    # What the collector holds, kept as JSON Lines, verifies as one chain;
    # the SIGKILL's repeated deliveries are counted, not reported.
    held = tmp_path / "collector.jsonl"
    held.write_text("\n".join(collector.lines) + "\n")
    verified = subprocess.run([lanyard_binary(), "audit", "verify-collected", "--json", str(held)],
                              capture_output=True, text=True, timeout=60)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    report = json.loads(verified.stdout)
    assert report["problems"] == [] and len(report["chains"]) == 1, report
    chain = report["chains"][0]
    distinct = {r["id"] for r in collector.received}
    assert chain["records"] == len(distinct) and chain["gaps"] == [] and chain["first_seq"] == 0, chain
    assert report["repeats"] == len(collector.lines) - len(distinct)


def plain_env(monkeypatch):
    for name in ("IDENTITY_ENDPOINT", "IDENTITY_HEADER", "MSI_ENDPOINT", "MSI_SECRET"):
        monkeypatch.delenv(name, raising=False)


def imds(dev, resource):
    import requests
    return requests.get(
        dev.exports["AZURE_POD_IDENTITY_AUTHORITY_HOST"] + "/metadata/identity/oauth2/token",
        params={"api-version": "2018-02-01", "resource": resource},
        headers={"Metadata": "true"}, timeout=30,
    )


def test_an_exporter_too_far_behind_stops_issuance_until_it_catches_up(tmp_path, collector, monkeypatch):
    plain_env(monkeypatch)
    audit_file = tmp_path / "audit.jsonl"
    collector.mode = "500"
    dev = start(tmp_path, audit_file, collector.url, "dev", LANYARD_AUDIT_EXPORT_MAX_BACKLOG="5")
    try:
        statuses = [imds(dev, f"api://behind-{i}").status_code for i in range(10)]
        assert statuses[:5] == [200] * 5, statuses
        refused = imds(dev, "api://refused")
        assert refused.status_code == 503, refused.text
        assert "access_token" not in refused.text
        assert "audit record could not be written" in refused.json()["error_description"]
        assert "too far behind" in dev.read_log()
        collector.mode = "ok"
        assert wait_until(lambda: imds(dev, "api://again").status_code == 200), "issuance never resumed"
    finally:
        assert dev.stop() == 0
    incidents = [r for r in file_records(audit_file).values() if r["type"] == "export"]
    assert len(incidents) == 1, incidents
    assert incidents[0]["exporter"] == "http" and incidents[0]["incident"] == "backlog_full"
    assert incidents[0]["records"] >= 6


def test_with_drop_records_retention_removed_are_counted_and_recorded(tmp_path, collector, monkeypatch):
    plain_env(monkeypatch)
    audit_file = tmp_path / "audit.jsonl"
    collector.mode = "500"
    dev = start(tmp_path, audit_file, collector.url, "dev",
                LANYARD_AUDIT_EXPORT_WHEN_FULL="drop",
                LANYARD_AUDIT_FILE_MAX_BYTES="4096", LANYARD_AUDIT_FILE_KEEP="1")
    try:
        for i in range(40):
            assert imds(dev, f"api://dropped-{i}").status_code == 200
        collector.mode = "ok"
        def recorded():
            return [r for f in tmp_path.glob("audit*.jsonl") for r in map(json.loads, f.read_text().splitlines())
                    if r["type"] == "export"]
        assert wait_until(lambda: recorded()), "the loss was never recorded"
        for incident in recorded():
            assert incident["incident"] == "records_lost" and incident["records"] >= 1
            assert incident["last_seq"] - incident["first_seq"] + 1 == incident["records"]
        # What survived retention is delivered, the loss records included.
        assert wait_until(lambda: any(r["type"] == "export" for r in collector.received))
        # Every lost record is counted; a loss may be found in several
        # stretches while retention goes on, and with so small a file an
        # early loss record can itself be rotated away, so the records on
        # disk account for at most what was counted.
        lost = dev.metric("lanyard_audit_records_total", sink="http", result="lost")
        assert 0 < sum(i["records"] for i in recorded()) <= lost, (lost, recorded())
    finally:
        assert dev.stop() == 0
