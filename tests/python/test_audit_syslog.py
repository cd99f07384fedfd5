"""Audit records shipped to a real rsyslog on loopback: over RELP (every
record acknowledged, nothing lost while rsyslog restarts), over TLS
(RFC 5425) and over plain TCP. The tests read what rsyslog wrote."""

import json
import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from azure.identity import ManagedIdentityCredential

from conftest import Dev, lanyard_binary, stop_process

RSYSLOGD = shutil.which("rsyslogd") or ("/usr/sbin/rsyslogd" if os.path.exists("/usr/sbin/rsyslogd") else None)
MODULES = Path("/usr/lib/x86_64-linux-gnu/rsyslog")

pytestmark = pytest.mark.skipif(
    RSYSLOGD is None or not (MODULES / "imrelp.so").exists() or not (MODULES / "lmnsd_ossl.so").exists(),
    reason="rsyslog with rsyslog-relp and rsyslog-openssl is not installed (scripts/test installs them as root)",
)


class Rsyslog:
    """An rsyslogd of the test's own: RELP, TCP and TLS inputs on loopback,
    every message's text appended to one file."""

    def __init__(self, work: Path, relp_port: int):
        self.work = work
        self.relp_port = relp_port
        self.out = work / "received.log"
        self.records = work / "all-nodes.jsonl"
        self.proc = None

    def start(self):
        w = self.work
        for name in ("tcp.port", "tls.port", "rsyslogd.pid"):
            (w / name).unlink(missing_ok=True)
        conf = w / "rsyslog.conf"
        conf.write_text(f"""
global(workDirectory="{w}"
       defaultNetstreamDriverCAFile="{w}/ca.pem"
       defaultNetstreamDriverCertFile="{w}/server.pem"
       defaultNetstreamDriverKeyFile="{w}/server.key")
module(load="imrelp")
module(load="imtcp")
input(type="imrelp" address="127.0.0.1" port="{self.relp_port}")
input(type="imtcp" address="127.0.0.1" port="0" listenPortFileName="{w}/tcp.port")
input(type="imtcp" address="127.0.0.1" port="0" listenPortFileName="{w}/tls.port"
      streamDriver.name="ossl" streamDriver.mode="1" streamDriver.authMode="anon")
template(name="text" type="string" string="%msgid% %msg%\\n")
action(type="omfile" file="{self.out}" template="text")
# docs/audit.md's receiver: each record as one line, what
# `lanyard audit verify-collected` reads.
template(name="lanyard-record" type="string" string="%msg%\\n")
action(type="omfile" file="{self.records}" template="lanyard-record")
""")
        self.log = open(w / "rsyslogd.log", "ab")
        # What this start wrote: an earlier attempt's refusal of its port
        # stays in the log above it.
        since = self.log.tell()
        self.proc = subprocess.Popen(
            [RSYSLOGD, "-n", "-f", str(conf), "-i", str(w / "rsyslogd.pid")],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 20
        while time.time() < deadline:
            if (w / "tcp.port").exists() and (w / "tls.port").exists() and self.proc.poll() is None:
                text = (w / "rsyslogd.log").read_bytes()[since:].decode(errors="replace")
                if "could not" in text:
                    raise RuntimeError(text)
                return self
            time.sleep(0.05)
        raise RuntimeError("rsyslogd did not start:\n" + (w / "rsyslogd.log").read_text(errors="replace"))

    def port(self, name):
        return int((self.work / f"{name}.port").read_text().strip())

    def stop(self):
        if self.proc:
            stop_process(self.proc)
        self.log.close()

    def received(self):
        """Records rsyslog wrote, by id (duplicates allowed: delivery is at
        least once)."""
        if not self.out.exists():
            return {}
        got = {}
        for line in self.out.read_text(errors="replace").splitlines():
            msgid, _, text = line.partition(" ")
            try:
                record = json.loads(text)
            except ValueError:
                continue
            assert record["type"] == msgid
            got[record["id"]] = record
        return got


def certificates(work: Path):
    def openssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=work, timeout=60)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
            "-days", "2", "-subj", "/CN=lanyard-test-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=localhost")
    (work / "ext").write_text("subjectAltName=DNS:localhost\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.pem", "-days", "2", "-extfile", "ext")


@pytest.fixture
def rsyslog(tmp_path):
    work = tmp_path / "rsyslog"
    work.mkdir()
    certificates(work)
    # imrelp cannot bind port 0 and report it: a random port below Linux's
    # ephemeral range (32768 and up, where the other tests' connections
    # take theirs), another if that one is taken.
    for _ in range(5):
        r = Rsyslog(work, random.randint(20000, 32767))
        try:
            yield r.start()
            r.stop()
            return
        except RuntimeError:
            r.stop()
    raise RuntimeError("no port for rsyslog's RELP input")


def ids_in(audit_file: Path):
    return {json.loads(line)["id"] for line in audit_file.read_text().splitlines()}


def wait_delivered(rsyslog, audit_file, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        missing = ids_in(audit_file) - set(rsyslog.received())
        if not missing:
            return
        time.sleep(0.1)
    raise AssertionError(f"{len(missing)} records never reached rsyslog")


def ask(dev, monkeypatch, prefix, n):
    monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", dev.exports["AZURE_POD_IDENTITY_AUTHORITY_HOST"])
    for i in range(n):
        token = ManagedIdentityCredential().get_token(f"api://{prefix}-{i}/.default").token
        dev.issued.append(token)


def start_dev(tmp_path, audit_file, syslog, **extra):
    env = {"LANYARD_AUDIT_FILE": str(audit_file), "LANYARD_AUDIT_SYSLOG": syslog,
           "LANYARD_AUDIT_CLUSTER": "syslog-test", **extra}
    return Dev([], tmp_path / "lanyard.log", extra_env=env)


def stop_dev(dev):
    assert dev.stop() == 0
    log = dev.log_path.read_text(errors="replace")
    for token in dev.issued:
        assert token not in log


@pytest.fixture
def clean(monkeypatch):
    for name in ("IDENTITY_ENDPOINT", "IDENTITY_HEADER", "MSI_ENDPOINT", "MSI_SECRET"):
        monkeypatch.delenv(name, raising=False)


def test_relp_delivers_every_record_across_an_rsyslog_restart(tmp_path, rsyslog, monkeypatch, clean):
    audit_file = tmp_path / "audit.jsonl"
    dev = start_dev(tmp_path, audit_file, f"relp://127.0.0.1:{rsyslog.relp_port}")
    try:
        ask(dev, monkeypatch, "before", 10)
        wait_delivered(rsyslog, audit_file)
        # rsyslog goes away while requests go on: they are answered (the
        # file is the durable copy) and shipped once it is back.
        rsyslog.stop()
        ask(dev, monkeypatch, "during", 10)
        rsyslog.start()
        ask(dev, monkeypatch, "after", 5)
        wait_delivered(rsyslog, audit_file)
    finally:
        stop_dev(dev)
    received = rsyslog.received()
    record = next(r for r in received.values() if r["type"] == "credential")
    assert record["cluster"] == "syslog-test"
    assert record["schema"] == "lanyard.audit/v1"
    text = rsyslog.out.read_text()
    for token in dev.issued:
        assert token not in text, "a token reached syslog"
    # What rsyslog holds verifies as one whole chain, repeats and all; with
    # a line taken out, the gap is named.
    verified = collected_verify(rsyslog.records)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert ", 1 chain\n" in verified.stdout and "ok: syslog-test/lanyard-dev-node/dev chain" in verified.stdout, verified.stdout
    lines = rsyslog.records.read_text().splitlines()
    seq = json.loads(lines[5])["seq"]
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(line for line in lines if json.loads(line)["seq"] != seq) + "\n")
    verified = collected_verify(cut)
    assert verified.returncode == 1 and f"missing {seq}" in verified.stdout, verified.stdout


def collected_verify(*files):
    return subprocess.run([lanyard_binary(), "audit", "verify-collected", *map(str, files)],
                          capture_output=True, text=True, timeout=60)


def test_the_exporter_resumes_from_its_cursor_after_lanyard_restarts(tmp_path, rsyslog, monkeypatch, clean):
    audit_file = tmp_path / "audit.jsonl"
    url = f"relp://127.0.0.1:{rsyslog.relp_port}"
    dev = start_dev(tmp_path, audit_file, url)
    ask(dev, monkeypatch, "first", 5)
    wait_delivered(rsyslog, audit_file)
    stop_dev(dev)
    rsyslog.stop()
    # Records written while rsyslog is down, by a Lanyard that then stops.
    dev = start_dev(tmp_path, audit_file, url)
    ask(dev, monkeypatch, "second", 5)
    stop_dev(dev)
    rsyslog.start()
    dev = start_dev(tmp_path, audit_file, url)
    try:
        wait_delivered(rsyslog, audit_file)
    finally:
        stop_dev(dev)


@pytest.mark.parametrize("protocol", ["tls", "tcp"])
def test_tls_and_tcp_deliver(tmp_path, rsyslog, monkeypatch, clean, protocol):
    audit_file = tmp_path / "audit.jsonl"
    port = rsyslog.port(protocol)
    extra = {"LANYARD_AUDIT_SYSLOG_CA": str(rsyslog.work / "ca.pem")} if protocol == "tls" else {}
    dev = start_dev(tmp_path, audit_file, f"{protocol}://localhost:{port}", **extra)
    try:
        ask(dev, monkeypatch, protocol, 5)
        wait_delivered(rsyslog, audit_file)
    finally:
        stop_dev(dev)


def test_tls_refuses_a_receiver_it_does_not_trust(tmp_path, rsyslog, monkeypatch, clean):
    audit_file = tmp_path / "audit.jsonl"
    other = tmp_path / "other"
    other.mkdir()
    certificates(other)  # another CA: rsyslog's certificate is not from it
    dev = start_dev(tmp_path, audit_file, f"tls://localhost:{rsyslog.port('tls')}",
                    LANYARD_AUDIT_SYSLOG_CA=str(other / "ca.pem"))
    try:
        ask(dev, monkeypatch, "untrusted", 3)  # credentials still flow
        time.sleep(2)
        assert not rsyslog.received(), "records went to an untrusted receiver"
        assert "audit exporter cannot deliver" in dev.read_log()
    finally:
        stop_dev(dev)
