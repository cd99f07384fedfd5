"""The driver of bench/soak (run it through bench/soak, which builds the
binaries and prepares the SDKs' virtual environment).

    soak.py run --duration S --profile P --lanyard BIN --sidecar BIN
                --fake-kube BIN --herd BIN [--quick]
    soak.py worker --sdk azure|gcp|aws --pod NAME --out FILE --stop FILE
                   [--interval S] [--churn-every N]

`run` starts, all on 127.0.0.1: `lanyard-fake-kube --clouds` (the API
server, the issuer, Entra / Google STS + IAM / AWS STS emulators), three
ServiceAccounts bound to all three clouds with one pod each, the pods'
projected tokens (minted by the fake API server, written with the
kubelet's atomic writer and rotated during the run), one `lanyard agent`
(with the durable audit file) and one `lanyard-sidecar` per pod. Then, for
the duration: per pod one long-lived worker per SDK (`worker`, a separate
interpreter with only the pod's environment) that asks its SDK for a
credential every half second with a fresh credential object, herd bursts
of 200 at a sidecar, and faults on a schedule scaled to the duration. It
prints the `## Soak` Markdown section on stdout (progress on stderr) and
exits 1 when the run failed: an SDK or herd failure that no fault
explains or that is not retryable, a credential of another pod's identity
(or of no one's), a process that crashed, or an audit trail that misses a
decision or a credential that was answered.

Everything it starts is stopped on exit, Ctrl-C and TERM; every wait is
bounded. The audit directory is a tmpfs of its own, mounted for the run
(root only; otherwise the disk-full event is skipped with a note) and
unmounted at the end.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

TENANT = "5f0c8b0e-6a3b-4c1e-9a51-3d2f1e0c7b21"
PROVIDER = ("//iam.googleapis.com/projects/123456789012/locations/global/"
            "workloadIdentityPools/soak/providers/cluster")
PROJECT_ID = "lanyard-soak"
NODE = "soak-node"
REGION = "us-east-1"
AUDIENCES = {"azure": "api://AzureADTokenExchange", "gcp": PROVIDER, "aws": "sts.amazonaws.com",
             "app": "lanyard"}
PROJECTED_TOKEN_SECONDS = 3600
# Lifetimes of what the emulators issue. The agent serves a cached
# credential only while it keeps the cloud's minimum (Azure and Google 5
# min, AWS 15 min) and refreshes it at half its lifetime, no later than
# 10 min (AWS 20 min) before expiry, no sooner than a quarter of it
# (`lanyard::cache::refresh_at`). Azure and Google at 12 min: refreshed 3
# min after each exchange, servable for 7 min, so 3 refreshes in 10 min
# with 4 min of slack for a failing refresh. AWS at 25 min: refreshed
# after 6 min 15 s, servable for 10 min (at 20 min the refresh would fall
# exactly where it stops being servable: no slack at all).
CLOUD_LIFETIME = 720
# The audit file's own file system (tmpfs), filled by the disk-full event.
AUDIT_FS_MIB = 256
AWS_SESSION = 1500
SDKS = ("azure", "gcp", "aws")
# How soon after an upstream recovers the agent asks it again for a key with
# nothing to serve (the cache's `retry_bound`, README "Cache"): a throttling
# or outage window's failures may last this much longer, and no more (the
# cloud's own Retry-After, where it sends one, is shorter here).
RETRY_BOUND = 5.0
SDK_NAME = {"azure": "azure-identity", "gcp": "google-auth", "aws": "boto3"}
RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}
HERD_CONCURRENCY = 200
# Runs of at least two of these also report the footprint per window.
WINDOW = 600
IMDS_PATH = "/metadata/identity/oauth2/token?api-version=2018-02-01&resource=https%3A%2F%2Fstorage.azure.com%2F"

# The three identities: pods a and c ask the agent on every call
# (LANYARD_SIDECAR_GRANT_REUSE_SECONDS=0), pod b keeps the default reuse
# window (10 s). Pods a and b get the webhook's whole environment (current
# azure-identity takes App Service first); pod c the same without the App
# Service variables, as an SDK that speaks only IMDS, so both Azure surfaces
# carry load.
PODS = [
    {"key": "a", "namespace": "ray", "sa": "ray-worker", "pod": "ray-worker-0",
     "client_id": "8c1e7a52-4b3f-4d8e-9f0a-2b6c5d4e3f21",
     "gcp_sa": "ray-worker@lanyard-soak.iam.gserviceaccount.com",
     "role": "arn:aws:iam::111122223333:role/ray-worker", "reuse": 0, "azure_surface": "app_service"},
    {"key": "b", "namespace": "etl", "sa": "etl-runner", "pod": "etl-runner-0",
     "client_id": "11111111-2222-3333-4444-555555555555",
     "gcp_sa": "etl@lanyard-soak.iam.gserviceaccount.com",
     "role": "arn:aws:iam::111122223333:role/etl", "reuse": None, "azure_surface": "app_service"},
    {"key": "c", "namespace": "legacy", "sa": "scripts", "pod": "scripts-0",
     "client_id": "66666666-7777-8888-9999-000000000000",
     "gcp_sa": "scripts@lanyard-soak.iam.gserviceaccount.com",
     "role": "arn:aws:iam::111122223333:role/scripts", "reuse": 0, "azure_surface": "azure_imds"},
]

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def say(msg: str) -> None:
    print(f"bench/soak: {msg}", file=sys.stderr, flush=True)


def fingerprint(token: str) -> str:
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()[:12]


# =================================================================== worker
# One SDK in a loop, in its own interpreter, with the pod's environment
# only. Each call builds a fresh credential object, so that the SDK's own
# cache never hides a failing call; every fourth call (the churn) asks for
# something never asked before (an Azure resource, a Google ID token
# audience), which the agent must exchange upstream, so that upstream
# faults reach the SDKs and not only the agent's refreshes.


def sdk_status(sdk: str, exc: BaseException) -> int | None:
    """The HTTP status an SDK's exception reports, if it names one."""
    seen = set()
    e = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for attr in ("status_code", "status"):
            v = getattr(e, attr, None)
            if isinstance(v, int) and 100 <= v <= 599:
                return v
        resp = getattr(e, "response", None)
        v = getattr(resp, "status_code", None) or getattr(resp, "status", None)
        if isinstance(v, int) and 100 <= v <= 599:
            return v
        e = e.__cause__ or e.__context__
    text = str(exc)
    for pattern in (r"non 200 response \(?(\d{3})\b", r"[Ss]tatus:? (\d{3})", r"\(status (\d{3})\)",
                    r"\bHTTP (\d{3})\b", r"\) (\d{3}), ", r"\b(\d{3}) (?:Service Unavailable|Too Many Requests|Bad Gateway)"):
        m = re.search(pattern, text)
        if m:
            return int(m.group(1))
    return None


TRANSPORT = re.compile(r"time[d ]?out|timeout|connect|reset|refused|remote end closed|no response|"
                       r"unavailable|temporarily|broken pipe|incomplete|aborted", re.I)


def worker(args: argparse.Namespace) -> int:
    sdk, pod = args.sdk, args.pod
    if sdk == "azure":
        from azure.identity import ManagedIdentityCredential

        def call(n: int, churn: bool):
            resource = f"api://soak-{pod}-{n}" if churn else "https://storage.azure.com"
            with ManagedIdentityCredential() as credential:
                token = credential.get_token(resource + "/.default").token
            return token, token
    elif sdk == "gcp":
        import google.auth
        import google.auth.compute_engine
        import google.auth.transport.requests
        import requests

        def call(n: int, churn: bool):
            with requests.Session() as session:
                request = google.auth.transport.requests.Request(session)
                if churn:
                    credentials = google.auth.compute_engine.IDTokenCredentials(
                        request, target_audience=f"https://soak.example/{pod}/{n}",
                        use_metadata_identity_endpoint=True)
                else:
                    credentials, _ = google.auth.default(request=request)
                credentials.refresh(request)
                return credentials.token, credentials.token
    else:
        import boto3

        def call(n: int, churn: bool):
            credentials = boto3.Session().get_credentials()
            if credentials is None:
                raise RuntimeError("boto3 found no credentials")
            frozen = credentials.get_frozen_credentials()
            return frozen.access_key, frozen.token

    n = 0
    with open(args.out, "a", buffering=1) as out:
        while not os.path.exists(args.stop):
            n += 1
            churn = args.churn_every > 0 and n % args.churn_every == 0 and sdk != "aws"
            t0 = time.time()
            line = {"sdk": sdk, "pod": pod, "n": n, "kind": "churn" if churn else "steady"}
            try:
                handle, secret = call(n, churn)
                line.update(ok=True, handle=handle, fp=fingerprint(secret))
            except Exception as e:  # noqa: BLE001 - reported; the driver judges
                status = sdk_status(sdk, e)
                text = f"{type(e).__name__}: {e}"
                retryable = status in RETRYABLE_STATUS if status is not None else bool(TRANSPORT.search(text))
                line.update(ok=False, status=status, retryable=retryable, error=text[:600])
            line.update(t0=t0, t1=time.time())
            out.write(json.dumps(line) + "\n")
            time.sleep(args.interval)
    return 0


# =================================================================== driver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body=None, timeout: float = 5.0, headers=None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def rss_fds(pid: int) -> tuple[int, int, int] | None:
    """VmRSS KiB, open descriptors, RssAnon KiB (RSS less the pages of
    files, the executable's code among them, which fault in as code paths
    are first taken and are not the heap)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS:", "RssAnon:")))
        rss, anon = int(fields["VmRSS"].split()[0]), int(fields["RssAnon"].split()[0])
        return rss, len(os.listdir(f"/proc/{pid}/fd")), anon
    except (OSError, KeyError, IndexError, ValueError):
        return None


def parse_metrics(text: str) -> dict[str, float]:
    """`name{labels}` -> value, for the series the report uses."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith("lanyard_"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            pass
    return out


def metric_sum(metrics: dict[str, float], name: str, **labels: str) -> float:
    total = 0.0
    for key, value in metrics.items():
        series, _, rest = key.partition("{")
        if series != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (t seconds, y) points, per minute."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 60.0 * sum((t - mt) * (y - my) for t, y in points) / var


def atomic_write(directory: Path, files: dict[str, bytes]) -> None:
    """The kubelet's AtomicWriter, as the pod end-to-end tests' harness
    (tests/python/kubelet.py) writes projected volumes: world-readable files,
    no group."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "python"))
    from kubelet import atomic_write as kubelet_atomic_write

    kubelet_atomic_write(directory, files, 0o644, None)


def heaptrack_tools() -> tuple[Path, Path]:
    """heaptrack's preload library and interpreter, found as the `heaptrack`
    script finds them (relative to it)."""
    script = shutil.which("heaptrack")
    if script is None:
        raise RuntimeError("BENCH_HEAPTRACK is set but heaptrack is not installed (apt-get install heaptrack)")
    lib = Path(script).resolve().parent.parent / "lib" / "heaptrack"
    preload, interpret = lib / "libheaptrack_preload.so", lib / "libexec" / "heaptrack_interpret"
    for f in (preload, interpret):
        if not f.exists():
            raise RuntimeError(f"heaptrack: {f} is missing")
    return preload, interpret


class Heaptrack:
    """What the `heaptrack` script does, without the script between the
    driver and the profiled process: the script runs the program as a child
    and outlives it, so the pid the sampler reads and the signals the
    schedule sends (SIGTERM at the end, the agent's SIGKILL) would reach the
    script, not Lanyard. Here the process itself gets heaptrack's preload
    library, which streams its events into a FIFO read by
    `heaptrack_interpret | zstd` writing `OUT.zst`. The interpreter finishes
    the file when the process's end of the FIFO closes, so a SIGKILLed
    process leaves a complete profile up to the kill (what was still
    allocated then counts as leaked)."""

    def __init__(self, out: Path, log):
        preload, interpret = heaptrack_tools()
        out.parent.mkdir(parents=True, exist_ok=True)
        self.fifo = out.with_name(out.name + ".fifo")
        if self.fifo.exists():
            self.fifo.unlink()
        os.mkfifo(self.fifo)
        self.path = out.with_name(out.name + ".zst")
        # INVARIANT: the reader opens the FIFO before the profiled process
        # starts; the preload library blocks in open() until a reader is there.
        self.reader = subprocess.Popen(
            ["sh", "-c", 'exec "$1" < "$2" | zstd -q -c > "$3"', "sh", str(interpret), str(self.fifo),
             str(self.path)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
            start_new_session=True)
        self.env = {"LD_PRELOAD": str(preload), "DUMP_HEAPTRACK_OUTPUT": str(self.fifo)}

    def finish(self, timeout: float = 300.0) -> None:
        """Waits for the interpreter to write the whole file (after the
        profiled process has exited)."""
        try:
            self.reader.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            say(f"heaptrack: {self.path} not finished within {timeout:.0f} s; stopping its interpreter")
            os.killpg(self.reader.pid, signal.SIGTERM)
            self.reader.wait(timeout=10)
        self.fifo.unlink(missing_ok=True)


class Proc:
    """A child process with its stderr in a log file; with `heaptrack`, a
    path without suffix, profiled by heaptrack into `heaptrack.zst`."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str], stdout=subprocess.DEVNULL,
                 heaptrack: Path | None = None):
        self.name, self.argv, self.log_path = name, argv, log
        self.log = open(log, "ab")
        self.heaptrack = Heaptrack(heaptrack, self.log) if heaptrack is not None else None
        if self.heaptrack is not None:
            env = {**env, **self.heaptrack.env}
        self.proc = subprocess.Popen(argv, stdout=stdout, stderr=self.log, env=env, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        self.pid = self.proc.pid
        self.expected_exit = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> int | None:
        """TERM, up to `timeout`, then KILL. The exit code."""
        self.expected_exit = True
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        if self.heaptrack is not None:
            self.heaptrack.finish()
        self.log.close()
        return self.proc.returncode

    def kill(self) -> None:
        self.expected_exit = True
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        if self.heaptrack is not None:
            # The interpreter may still be behind: let it finish in the
            # background, the run goes on (close() waits for it).
            threading.Thread(target=self.heaptrack.finish, daemon=True).start()
        self.log.close()

    def tail(self, n: int = 15) -> str:
        try:
            lines = ANSI.sub("", self.log_path.read_text(errors="replace")).splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


def reported(proc: Proc, message: str, key: str, timeout: float = 30.0) -> str:
    field = re.compile(rf"(?:^|\s){re.escape(key)}=(\S+)")
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = ANSI.sub("", proc.log_path.read_text(errors="replace"))
        for line in text.splitlines():
            if message in line and (m := field.search(line)):
                return m.group(1)
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited ({proc.proc.returncode}) during start-up:\n{proc.tail()}")
        time.sleep(0.05)
    raise RuntimeError(f"{proc.name} never logged {message!r}:\n{proc.tail()}")


def wait_ready(url: str, proc: Proc, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited ({proc.proc.returncode}):\n{proc.tail()}")
        try:
            if http("GET", url, timeout=1)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} ({proc.name}) was not ready within {timeout:.0f} s:\n{proc.tail()}")


def role_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LANYARD_", "AWS_", "AZURE_", "GCE_", "GOOGLE_", "IDENTITY_", "MSI_"))
           and k not in ("RUST_LOG", "KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT",
                         "NODE_NAME")}
    return {**env, **extra}


class Window:
    """When a fault can explain a failure: clouds it touches, its interval
    widened by the time its effect can outlast it."""

    def __init__(self, name: str, clouds: tuple[str, ...], start: float, end: float, grace: float,
                 any_429: bool = False):
        self.name, self.clouds, self.start, self.end, self.grace = name, clouds, start, end, grace
        self.any_429 = any_429  # also explains 429s of other clouds (per-caller in-flight bound)
        self.failures = 0

    def covers(self, cloud: str, t0: float, t1: float, status: int | None) -> bool:
        if cloud not in self.clouds and not (self.any_429 and status == 429):
            return False
        return t0 <= self.end + self.grace and t1 >= self.start - 1.0


class Soak:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.duration = float(args.duration)
        self.scale = self.duration / 600.0
        self.work = Path(tempfile.mkdtemp(prefix="lanyard-soak."))
        self.procs: list[Proc] = []
        self.workers: list[Proc] = []
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.agent: Proc | None = None
        self.incarnation = 0
        self.incarnations: list[dict] = []  # per agent: started, ended, how, audit lines at start/end, metrics
        # (t, name, incarnation, rss KiB, fds, anonymous rss KiB)
        self.samples: list[tuple[float, str, int, int, int, int]] = []
        self.windows: list[Window] = []
        self.events: list[dict] = []  # what the schedule did, for the report
        self.herds: list[dict] = []
        self.crashes: list[str] = []
        self.problems: list[str] = []
        self.t_start = 0.0
        self.threads: list[threading.Thread] = []
        # BENCH_HEAPTRACK=DIR: the agent (each run to DIR/agent-N.zst) and
        # the sidecars named in BENCH_HEAPTRACK_SIDECARS (default b, which
        # serves herd bursts; "" for none) run under heaptrack.
        ht = os.environ.get("BENCH_HEAPTRACK")
        self.heaptrack_dir = Path(ht).resolve() if ht else None
        self.heaptrack_sidecars = set(os.environ.get("BENCH_HEAPTRACK_SIDECARS", "b").replace(",", " ").split())
        if self.heaptrack_dir is not None:
            heaptrack_tools()

    # ------------------------------------------------------------ set-up

    def start(self, name: str, argv: list[str], env: dict[str, str], stdout=subprocess.DEVNULL,
              profile: bool = False) -> Proc:
        """`profile`: under heaptrack when BENCH_HEAPTRACK names a directory
        (the profile is DIR/NAME.zst)."""
        heaptrack = self.heaptrack_dir / name if profile and self.heaptrack_dir is not None else None
        p = Proc(name, argv, self.work / "logs" / f"{name}.log", env, stdout, heaptrack)
        self.procs.append(p)
        return p

    def control(self, method: str, path: str, body=None) -> dict:
        status, data = http(method, self.info["control"] + path, body)
        if status != 200:
            raise RuntimeError(f"{method} {path}: {status} {data[:300]!r}")
        return json.loads(data)

    def set_up(self) -> None:
        a = self.args
        (self.work / "logs").mkdir()
        identities = [{"namespace": p["namespace"], "service_account": p["sa"], "azure_client_id": p["client_id"],
                       "gcp_service_account": p["gcp_sa"], "aws_role_arn": p["role"]} for p in PODS]
        clouds = self.work / "clouds.json"
        clouds.write_text(json.dumps({"azure_tenant_id": TENANT, "gcp_provider": PROVIDER,
                                      "lifetime_seconds": CLOUD_LIFETIME, "identities": identities}))
        say("starting lanyard-fake-kube (API server, issuer, clouds)")
        self.kube = self.start("fake-kube", [a.fake_kube, "--dir", str(self.work / "kube"), "--clouds", str(clouds)],
                               role_env(), stdout=subprocess.PIPE)
        line = self.read_line(self.kube, 30)
        self.info = json.loads(line)
        for ns in sorted({p["namespace"] for p in PODS}):
            self.control("POST", "/apply", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        for p in PODS:
            self.control("POST", "/apply", {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {
                "name": p["sa"], "namespace": p["namespace"], "annotations": {
                    "azure.workload.identity/client-id": p["client_id"],
                    "iam.gke.io/gcp-service-account": p["gcp_sa"],
                    "eks.amazonaws.com/role-arn": p["role"]}}})
            stored = self.control("POST", "/apply", {"apiVersion": "v1", "kind": "Pod", "metadata": {
                "name": p["pod"], "namespace": p["namespace"]},
                "spec": {"nodeName": NODE, "serviceAccountName": p["sa"], "containers": [{"name": "app"}]}})
            p["uid"] = stored["metadata"]["uid"]
            p["token_dir"] = self.work / "pods" / p["key"] / "tokens"
        self.rotations = 0
        self.write_tokens()

        self.audit_file = self.work / "audit" / "audit.jsonl"
        self.audit_file.parent.mkdir()
        # The audit directory on a file system of its own, which the
        # "audit disk full" event fills (a tmpfs: mounting needs root).
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={AUDIT_FS_MIB}m,mode=0700", "lanyard-soak-audit",
                                str(self.audit_file.parent)], capture_output=True, text=True)
        self.audit_fs = mount.returncode == 0
        if not self.audit_fs:
            say(f"cannot mount a tmpfs for the audit file ({(mount.stderr or '').strip()[:200]}); "
                "the audit-disk-full event is skipped")
        self.agent_port, self.admin_port = free_port(), free_port()
        self.agent_config = self.work / "agent.yaml"
        self.agent_config.write_text(f"""\
azure:
  authority_host: {self.info['azure']}
  tenant_id: {TENANT}
gcp:
  workload_identity_provider: "{PROVIDER}"
  project_id: {PROJECT_ID}
  sts_endpoint: {self.info['gcp']}
  iamcredentials_endpoint: {self.info['gcp']}
  token_lifetime: {CLOUD_LIFETIME}
aws:
  region: {REGION}
  sts_endpoint: {self.info['aws']}
  session_duration: {AWS_SESSION}
cache:
  idle_ttl: 60
audit:
  cluster: soak
  file: {self.audit_file}
  fsync: true
""")
        self.start_agent()

        self.sidecars: dict[str, Proc] = {}
        for p in PODS:
            p["identity_header"] = secrets.token_hex(16)
            extra = {"IDENTITY_HEADER": p["identity_header"], "LANYARD_AWS_REGION": REGION, "RUST_LOG": "info"}
            if p["reuse"] is not None:
                extra["LANYARD_SIDECAR_GRANT_REUSE_SECONDS"] = str(p["reuse"])
            sc = self.start(f"sidecar-{p['key']}", [a.sidecar, "--listen", "127.0.0.1:0", "--agent",
                                                    f"http://127.0.0.1:{self.agent_port}",
                                                    "--token-dir", str(p["token_dir"])], role_env(**extra),
                            profile=p["key"] in self.heaptrack_sidecars)
            addr = reported(sc, "lanyard sidecar serving", "addr")
            p["base"] = f"http://{addr}"
            wait_ready(p["base"] + "/readyz", sc)
            self.sidecars[p["key"]] = sc
        say(f"fake-kube, agent (:{self.agent_port}) and {len(self.sidecars)} sidecars are up; work dir {self.work}")

    def read_line(self, proc: Proc, timeout: float) -> str:
        got: list[str] = []
        t = threading.Thread(target=lambda: got.append(proc.proc.stdout.readline().decode()), daemon=True)
        t.start()
        t.join(timeout)
        if not got or not got[0].strip():
            raise RuntimeError(f"{proc.name} printed nothing within {timeout:.0f} s:\n{proc.tail()}")
        return got[0]

    def write_tokens(self) -> None:
        for p in PODS:
            files = {}
            for name, audience in AUDIENCES.items():
                r = self.control("POST", "/token", {"namespace": p["namespace"], "pod": p["pod"],
                                                    "audiences": [audience],
                                                    "expiration_seconds": PROJECTED_TOKEN_SECONDS})
                files[name] = r["token"].encode()
            atomic_write(p["token_dir"], files)
        self.rotations += 1

    def audit_lines(self) -> int:
        try:
            with open(self.audit_file, "rb") as f:
                return f.read().count(b"\n")
        except FileNotFoundError:
            return 0

    def start_agent(self) -> None:
        self.incarnation += 1
        env = role_env(KUBECONFIG=str(self.info["kubeconfig"]), RUST_LOG="info")
        lines = self.audit_lines()
        agent = self.start(f"agent-{self.incarnation}",
                           [self.args.lanyard, "--config", str(self.agent_config), "agent",
                            "--listen", f"127.0.0.1:{self.agent_port}",
                            "--admin-listen", f"127.0.0.1:{self.admin_port}", "--node-name", NODE], env,
                           profile=True)
        wait_ready(f"http://127.0.0.1:{self.admin_port}/readyz", agent)
        with self.lock:
            self.agent = agent
            self.incarnations.append({"n": self.incarnation, "pid": agent.pid, "started": time.time(),
                                      "lines_at_start": lines, "metrics": None, "metrics_at": None,
                                      "ended": None, "how": "running"})

    def now(self) -> float:
        return time.time() - self.t_start

    # ------------------------------------------------------------ load

    def start_workers(self) -> None:
        home = self.work / "home"
        home.mkdir()
        for p in PODS:
            host = p["base"].removeprefix("http://")
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
                   # what the webhook injects (crates/surfaces/src/sdk_env.rs)
                   "AZURE_POD_IDENTITY_AUTHORITY_HOST": p["base"],
                   "IDENTITY_ENDPOINT": p["base"] + "/msi/token", "IDENTITY_HEADER": p["identity_header"],
                   "MSI_ENDPOINT": p["base"] + "/msi/token", "MSI_SECRET": p["identity_header"],
                   "AZURE_CLIENT_ID": p["client_id"], "AZURE_TENANT_ID": TENANT,
                   "GCE_METADATA_HOST": host, "GCE_METADATA_IP": host, "GCE_METADATA_ROOT": host,
                   "AWS_CONTAINER_CREDENTIALS_FULL_URI": p["base"] + "/v1/credentials",
                   "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE": str(p["token_dir"] / "app"),
                   "AWS_EC2_METADATA_SERVICE_ENDPOINT": p["base"] + "/",
                   "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION}
            if p["azure_surface"] == "azure_imds":
                for k in ("IDENTITY_ENDPOINT", "IDENTITY_HEADER", "MSI_ENDPOINT", "MSI_SECRET"):
                    env.pop(k)
            for sdk in SDKS:
                out = self.work / "out" / f"{p['key']}-{sdk}.jsonl"
                out.parent.mkdir(exist_ok=True)
                w = self.start(f"worker-{p['key']}-{sdk}",
                               [sys.executable, str(Path(__file__).resolve()), "worker", "--sdk", sdk,
                                "--pod", p["key"], "--out", str(out), "--stop", str(self.work / "stop"),
                                "--interval", "0.5", "--churn-every", "4"], env)
                self.workers.append(w)

    def herd(self, pod: dict) -> None:
        t0 = time.time()
        say(f"t={t0 - self.t_start:6.1f}s herd burst of {HERD_CONCURRENCY} at pod {pod['key']}")
        argv = [self.args.herd, "--concurrency", str(HERD_CONCURRENCY), "--url", pod["base"] + IMDS_PATH,
                "--header", "Metadata: true", "--timeout-ms", "30000"]
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            result = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() \
                else {"failed": f"herd exited {r.returncode}: {r.stderr[-400:]}"}
        except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
            result = {"failed": f"herd: {e}"}
        with self.lock:
            self.herds.append({"pod": pod["key"], "t0": t0, "t1": time.time(), **result})

    # ------------------------------------------------------------ sampling

    def sampler(self) -> None:
        metrics_url = f"http://127.0.0.1:{self.admin_port}/metrics"
        while not self.stop_event.wait(1.0):
            t = time.time()
            with self.lock:
                agent, inc = self.agent, self.incarnation
            procs = [(f"sidecar-{k}", 0, sc) for k, sc in self.sidecars.items()]
            if agent is not None:
                procs.insert(0, ("agent", inc, agent))
            for name, n, proc in procs:
                v = rss_fds(proc.pid)
                if v is not None and proc.alive():
                    self.samples.append((t, name, n, v[0], v[1], v[2]))
            if agent is not None:
                try:
                    status, body = http("GET", metrics_url, timeout=1)
                    if status == 200:
                        with self.lock:
                            if self.agent is agent:
                                self.incarnations[-1]["metrics"] = parse_metrics(body.decode())
                                self.incarnations[-1]["metrics_at"] = time.time()
                except OSError:
                    pass
            self.check_alive()

    def check_alive(self) -> None:
        with self.lock:
            agent = self.agent
        for p in [self.kube, *self.sidecars.values(), *self.workers, *([agent] if agent else [])]:
            if not p.alive() and not p.expected_exit and not getattr(p, "reported_crash", False):
                p.reported_crash = True
                msg = f"{p.name} exited with {p.proc.returncode} at t={self.now():.1f}s"
                self.crashes.append(msg)
                say(f"CRASH: {msg}:\n{p.tail()}")
                self.stop_event.set()

    # ------------------------------------------------------------ faults

    def d(self, seconds: float, minimum: float) -> float:
        """A duration of the 600-s schedule, scaled to this run."""
        return max(minimum, seconds * self.scale)

    def schedule(self) -> list[tuple[float, str, object]]:
        """(fraction of the run, label, action). Actions that last start a
        thread that ends them."""
        up = self.upstream_fault
        return [
            (0.04, "Entra 503 (standing)", lambda: up("azure", "503", {"fault": "status", "status": 503},
                                                      self.d(10, 2))),
            (0.08, "herd burst at pod a", lambda: self.herd_burst("a")),
            (0.12, "Google latency 2 s per call", lambda: up("gcp", "latency 2000 ms",
                                                             {"fault": "latency", "ms": 2000}, self.d(30, 3),
                                                             grace=8)),
            (0.20, "projected tokens rotated", self.rotate),
            (0.22, "API watches expired (410 Gone, relist)", self.expire_watches),
            (0.27, "STS Throttling (429 → 400 Throttling, Retry-After 1)",
             lambda: up("aws", "Throttling", {"fault": "status", "status": 429, "retry_after": 1},
                        self.d(15, 3))),
            (0.27, "Google 503 × 4", lambda: up("gcp", "503 ×4", {"fault": "status", "status": 503, "count": 4},
                                                self.d(15, 3))),
            (0.28, "agent SIGKILL + restart under load (cache empty)", self.kill_agent),
            (0.40, "herd burst at pod b", lambda: self.herd_burst("b")),
            (0.45, "API server unavailable", lambda: self.api_down(self.d(5, 2))),
            (0.50, "projected tokens rotated", self.rotate),
            (0.55, "Entra hang (no answer; the agent's 15 s timeout ends it)",
             lambda: up("azure", "hang", {"fault": "hang"}, self.d(5, 2), grace=17, any_429=True)),
            (0.62, "herd burst at pod a", lambda: self.herd_burst("a")),
            (0.64, "issuer keys unavailable (API server's JWKS 503)", lambda: self.keys_down(self.d(40, 3))),
            (0.645, "issuer key rotated during the key outage", self.rotate_key),
            (0.67, "audit disk full", lambda: self.audit_disk_full(self.d(10, 2))),
            (0.70, "Google connection reset mid-answer", lambda: up("gcp", "drop", {"fault": "drop"},
                                                                    self.d(6, 2))),
            (0.75, "projected tokens rotated", self.rotate),
            (0.76, "Entra 429 Retry-After 2", lambda: up("azure", "429", {"fault": "status", "status": 429,
                                                                         "retry_after": 2}, self.d(8, 2))),
            (0.80, "herd burst at pod b", lambda: self.herd_burst("b")),
            (0.84, "Google truncated bodies", lambda: up("gcp", "truncated", {"fault": "truncated"},
                                                         self.d(6, 2))),
            (0.90, "STS latency 3 s per call", lambda: up("aws", "latency 3000 ms",
                                                          {"fault": "latency", "ms": 3000}, self.d(30, 3),
                                                          grace=8)),
        ]

    def note(self, label: str, t0: float, t1: float | None = None, **extra) -> dict:
        e = {"label": label, "t0": t0 - self.t_start, "t1": (t1 or t0) - self.t_start, **extra}
        with self.lock:
            self.events.append(e)
        say(f"t={e['t0']:6.1f}s {label}")
        return e

    def upstream_fault(self, cloud: str, label: str, query: dict, lasting: float, grace: float = RETRY_BOUND,
                       any_429: bool = False) -> None:
        qs = urllib.parse.urlencode({"cloud": cloud, **query})
        t0 = time.time()
        self.control("POST", f"/clouds/faults?{qs}")
        win = Window(f"{cloud} {label}", (cloud,), t0, t0 + lasting, grace, any_429)
        with self.lock:
            self.windows.append(win)
        ev = self.note(f"{cloud} {label} for {lasting:.0f} s", t0, t0 + lasting, window=win)

        def end():
            self.stop_event.wait(lasting)
            self.control("POST", f"/clouds/faults?cloud={cloud}&fault=clear")
            win.end = time.time()
            ev["t1"] = win.end - self.t_start
        self.spawn(end)

    def api_down(self, lasting: float) -> None:
        t0 = time.time()
        self.control("POST", "/control/unavailable?on=true")
        win = Window("API server down", SDKS, t0, t0 + lasting, 10.0)
        with self.lock:
            self.windows.append(win)
        ev = self.note(f"API server unavailable for {lasting:.0f} s", t0, t0 + lasting, window=win)

        def end():
            self.stop_event.wait(lasting)
            self.control("POST", "/control/unavailable?on=false")
            win.end = time.time()
            ev["t1"] = win.end - self.t_start
        self.spawn(end)

    def keys_down(self, lasting: float) -> None:
        """The API server answers its discovery document and JWKS 503, the
        rest of the API works. No window: the agent verifies with the keys
        it has, so no call may fail for this alone."""
        t0 = time.time()
        self.control("POST", "/control/keys?unavailable=true")
        ev = self.note(f"issuer keys (discovery, JWKS) unavailable for {lasting:.0f} s", t0, t0 + lasting)
        self.keys_outage_end = t0 + lasting

        def end():
            self.stop_event.wait(lasting)
            self.control("POST", "/control/keys?unavailable=false")
            ev["t1"] = time.time() - self.t_start
        self.spawn(end)

    def rotate_key(self) -> None:
        """The cluster's signing key is rotated (its JWKS, when it can be
        read, publishes the new and the old key) and the kubelet gets every
        pod new tokens of the new key. The agent cannot fetch the new key
        until the outage ends, and then at most once per refetch interval
        (10 s): until then those tokens are answered a retryable 503."""
        t0 = time.time()
        kids = self.control("POST", "/control/keys?rotate=true")
        self.write_tokens()
        end = max(time.time(), getattr(self, "keys_outage_end", t0))
        win = Window("issuer key rotated", SDKS, t0, end, 12.0)
        with self.lock:
            self.windows.append(win)
        self.note(f"issuer key rotated to {kids['signing'][:12]}…, new tokens written", t0, end, window=win)

    def audit_disk_full(self, lasting: float) -> None:
        """Fills the audit file's file system (ENOSPC on the next write):
        with `on_failure: deny` the agent refuses to issue what it cannot
        record, a retryable 503, and records the outage when it can write
        again. The filler is removed after `lasting`."""
        if not self.audit_fs:
            self.note("audit disk full: skipped (no tmpfs could be mounted for the audit file)", time.time())
            return
        t0 = time.time()
        filler = self.audit_file.parent / "filler"
        chunk = b"\0" * (1 << 20)
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(chunk)
                    f.flush()
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
        win = Window("audit disk full", SDKS, t0, t0 + lasting, 5.0)
        with self.lock:
            self.windows.append(win)
        ev = self.note(f"audit file system full (ENOSPC) for {lasting:.0f} s", t0, t0 + lasting, window=win)

        def end():
            self.stop_event.wait(lasting)
            filler.unlink()
            win.end = time.time()
            ev["t1"] = win.end - self.t_start
        self.spawn(end)

    def expire_watches(self) -> None:
        t0 = time.time()
        self.control("POST", "/control/watches?expire=true")
        win = Window("watches expired", SDKS, t0, t0, 10.0)
        with self.lock:
            self.windows.append(win)
        self.note("API watches expired (410, the agent relists)", t0, window=win)

    def rotate(self) -> None:
        t0 = time.time()
        self.write_tokens()
        self.note("projected tokens rotated (kubelet's atomic writer)", t0, time.time())

    def herd_burst(self, key: str) -> None:
        pod = next(p for p in PODS if p["key"] == key)
        self.spawn(lambda: self.herd(pod))

    def kill_agent(self) -> None:
        t0 = time.time()
        with self.lock:
            agent = self.agent
            self.agent = None
        win = Window("agent killed", SDKS, t0, t0, 5.0)
        with self.lock:
            self.windows.append(win)
        kill_sent = time.time()
        agent.kill()
        killed = time.time()
        lines = self.audit_lines()
        inc = self.incarnations[-1]
        inc.update(ended=killed, kill_sent=kill_sent, how="SIGKILL", lines_at_end=lines)
        self.start_agent()
        win.end = time.time()
        self.note(f"agent SIGKILLed, restarted on :{self.agent_port} in {win.end - t0:.1f} s", t0, win.end,
                  window=win)

    def spawn(self, fn) -> None:
        t = threading.Thread(target=self.guard(fn), daemon=True)
        t.start()
        self.threads.append(t)

    def guard(self, fn):
        def run():
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - a harness failure fails the run
                self.problems.append(f"harness: {type(e).__name__}: {e}")
                say(f"harness error: {e}")
        return run

    # ------------------------------------------------------------ the run

    def run(self) -> int:
        self.set_up()
        self.t_start = time.time()
        self.start_workers()
        sampler = threading.Thread(target=self.sampler, daemon=True)
        sampler.start()
        plan = sorted(self.schedule(), key=lambda e: e[0])
        say(f"load for {self.duration:.0f} s: 9 SDK workers, {sum(1 for e in plan if 'herd' in e[1])} herd bursts, "
            f"{len(plan)} scheduled events")
        next_progress = 0.1
        for fraction, label, action in plan + [(1.0, "end", None)]:
            at = self.t_start + fraction * self.duration
            while not self.stop_event.is_set() and time.time() < at:
                if self.now() >= next_progress * self.duration:
                    self.progress()
                    next_progress += 0.1
                self.stop_event.wait(min(0.2, max(0.0, at - time.time())))
            if self.stop_event.is_set() or action is None:
                break
            self.guard(action)()
        self.t_end = time.time()
        say(f"t={self.now():.1f}s load ends; stopping the workers")
        for w in self.workers:
            w.expected_exit = True
        (self.work / "stop").write_text("")
        deadline = time.time() + 90
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self.problems.append(f"{w.name} did not finish its last call within 90 s")
            if w.proc.returncode not in (0, None):
                self.crashes.append(f"{w.name} exited {w.proc.returncode}: {w.tail(5)}")
        for t in self.threads:
            t.join(timeout=60)
        for cloud in SDKS:
            self.control("POST", f"/clouds/faults?cloud={cloud}&fault=clear")
        self.control("POST", "/control/unavailable?on=false")
        self.stop_event.set()
        sampler.join(timeout=10)
        # Nothing asks any more: the agent's counters are final.
        time.sleep(1.0)
        with self.lock:
            agent = self.agent
        status, body = http("GET", f"http://127.0.0.1:{self.admin_port}/metrics", timeout=5)
        if status == 200:
            self.incarnations[-1]["metrics"] = parse_metrics(body.decode())
            self.incarnations[-1]["metrics_at"] = time.time()
            self.incarnations[-1]["final_scrape"] = True
        (self.work / "metrics-final.txt").write_bytes(body if status == 200 else b"")
        self.counts = self.control("GET", "/clouds/counts")
        self.identity_checks()
        codes = {}
        for name, sc in self.sidecars.items():
            codes[f"sidecar-{name}"] = sc.stop()
        codes["agent"] = agent.stop() if agent else None
        self.incarnations[-1].update(ended=time.time(), how="SIGTERM (end of run)",
                                     lines_at_end=self.audit_lines())
        for name, code in codes.items():
            if code not in (0, None):
                self.crashes.append(f"{name} exited {code} on SIGTERM")
        return self.report()

    def progress(self) -> None:
        calls = fails = 0
        for f in (self.work / "out").glob("*.jsonl"):
            for line in f.read_text().splitlines():
                calls += 1
                fails += '"ok": false' in line
        with self.lock:
            agent = [s for s in self.samples if s[1] == "agent"][-1:]
        a = f"agent RSS {agent[0][3] / 1024:.1f} MiB, {agent[0][4]} fds" if agent else "agent restarting"
        say(f"t={self.now():6.1f}s {calls} SDK calls, {fails} failed; {a}")

    # ------------------------------------------------------------ checks

    def results(self) -> list[dict]:
        out = []
        for f in sorted((self.work / "out").glob("*.jsonl")):
            for line in f.read_text().splitlines():
                if line.strip():
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass  # a line cut by the worker's end
        return out

    def identity_checks(self) -> None:
        """Every distinct credential the SDKs received: issued by the cloud
        the pod asked, to the pod's own identity."""
        self.whois_checked = 0
        self.wrong_owner: list[str] = []
        seen = set()
        for r in self.results():
            if not r.get("ok"):
                continue
            key = (r["pod"], r["sdk"], r["handle"])
            if key in seen:
                continue
            seen.add(key)
            pod = next(p for p in PODS if p["key"] == r["pod"])
            want = {"azure": f"{TENANT}/{pod['client_id']}",
                    "gcp": pod["gcp_sa"] + (" (id token)" if r["kind"] == "churn" else ""),
                    "aws": pod["role"]}[r["sdk"]]
            status, body = http("GET", self.info["control"] + "/clouds/whois?credential=" +
                                urllib.parse.quote(r["handle"], safe=""))
            self.whois_checked += 1
            got = json.loads(body) if status == 200 else None
            if got is None or got.get("cloud") != r["sdk"] or got.get("principal") != want:
                self.wrong_owner.append(f"pod {r['pod']} {SDK_NAME[r['sdk']]} at t={r['t0'] - self.t_start:.1f}s "
                                        f"got a credential of {got} (expected {r['sdk']} {want})")

    def log_checks(self, results: list[dict]) -> list[str]:
        """No panic in any of Lanyard's logs, and no projected token (a
        JWT) or credential an SDK received written to one."""
        handles = {r["handle"] for r in results if r.get("ok") and len(r["handle"]) >= 16}
        found = []
        for log in sorted((self.work / "logs").glob("*.log")):
            if not log.name.startswith(("agent-", "sidecar-")):
                continue
            text = log.read_text(errors="replace")
            if "panicked" in text:
                found.append(f"a panic in {log.name}: " + next(line for line in text.splitlines()
                                                                   if "panicked" in line)[:300])
            if "eyJ" in text or any(h in text for h in handles):
                found.append(f"a token or credential in {log.name}")
        return found

    def classify(self, cloud: str, t0: float, t1: float, status: int | None, retryable: bool) -> Window | None:
        """The fault window that explains a retryable failure of `cloud`
        during [t0, t1], if any: one on that cloud before one on every
        cloud, then the one that began last before the call ended."""
        if not retryable:
            return None
        candidates = [w for w in self.windows if w.covers(cloud, t0, t1, status)]
        if not candidates:
            return None
        return min(candidates, key=lambda w: (cloud not in w.clouds, len(w.clouds) > 1,
                                              abs(t1 - w.start) if w.start <= t1 else 1e9 + w.start - t1))

    def audit(self, results: list[dict]) -> dict:
        """The audit file against the agent's counters and the credentials
        the SDKs were answered."""
        raw = self.audit_file.read_bytes().split(b"\n") if self.audit_file.exists() else []
        records = []
        for line in raw:
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    records.append({"type": "unparsable"})
        out = {"lines": len(records), "unparsable": sum(r.get("type") == "unparsable" for r in records),
               "incarnations": []}
        for inc in self.incarnations:
            part = records[inc["lines_at_start"]:inc.get("lines_at_end", len(records))]
            cred = [r for r in part if r.get("type") == "credential"]
            m = inc["metrics"] or {}
            decisions = metric_sum(m, "lanyard_decisions_total")
            written = metric_sum(m, "lanyard_audit_records_total", sink="file", result="written")
            # Refused because the file could not be written (disk full):
            # counted as decisions (denials), never logged nor on disk
            # except as the sink_failure record's count.
            unwritten = metric_sum(m, "lanyard_audit_records_total", sink="file", result="failed")
            log = self.work / "logs" / f"agent-{inc['n']}.log"
            logged = ANSI.sub("", log.read_text(errors="replace")).count("lanyard::audit: credential ") \
                if log.exists() else 0
            batches = metric_sum(m, "lanyard_audit_write_seconds_count")
            out["incarnations"].append({
                "n": inc["n"], "how": inc["how"], "records": len(cred), "logged": logged,
                "batches": batches,
                "write_mean_ms": 1000 * metric_sum(m, "lanyard_audit_write_seconds_sum") / batches if batches else None,
                "write_slow": batches - metric_sum(m, "lanyard_audit_write_seconds_bucket", le="0.5"),
                "allow": sum(r["decision"]["verdict"] == "allow" for r in cred),
                "deny": sum(r["decision"]["verdict"] == "deny" for r in cred),
                "decisions": decisions, "file_written": written, "file_failed": unwritten,
                "lost_recorded": sum(r.get("records", 0) for r in part if r.get("type") == "sink_failure"), "final": bool(inc.get("final_scrape")),
                "scraped_before_end": (inc["ended"] - inc["metrics_at"]) if inc["metrics_at"] and inc["ended"]
                else None,
                "refreshes": metric_sum(m, "lanyard_cache_refreshes_total"),
                "refresh_failures": metric_sum(m, "lanyard_cache_refresh_failures_total"),
                "upstream": {c: metric_sum(m, "lanyard_upstream_requests_total", cloud=c) for c in SDKS},
                "upstream_failed": sum(v for k, v in m.items() if k.startswith("lanyard_upstream_requests_total{")
                                       and 'outcome="ok"' not in k),
                "deny_reasons": sorted({r["decision"].get("reason", "") for r in cred
                                        if r["decision"]["verdict"] == "deny"}),
            })
        # Every credential an SDK was answered has an `allow` record of that
        # pod and cloud with its fingerprint.
        allowed: dict[tuple[str, str], set[str]] = {}
        allow_count: dict[tuple[str, str], int] = {}
        pod_of = {p["pod"]: p["key"] for p in PODS}
        for r in records:
            if r.get("type") != "credential" or r["decision"]["verdict"] != "allow":
                continue
            key = (pod_of.get(r.get("caller", {}).get("pod"), "?"), r["request"]["cloud"])
            allowed.setdefault(key, set()).add(r.get("credential", {}).get("fingerprint"))
            allow_count[key] = allow_count.get(key, 0) + 1
        missing = [r for r in results if r.get("ok") and r["fp"] not in allowed.get((r["pod"], r["sdk"]), set())]
        out["fingerprints_checked"] = len({(r["pod"], r["sdk"], r["fp"]) for r in results if r.get("ok")})
        out["fingerprints_missing"] = missing
        # Pods whose sidecar asks the agent on every call: at least one
        # `allow` record per answered call (SDK or herd).
        per_call = []
        for p in PODS:
            if p["reuse"] != 0:
                continue
            for cloud in SDKS:
                ok = sum(1 for r in results if r.get("ok") and r["pod"] == p["key"] and r["sdk"] == cloud)
                if cloud == "azure":
                    ok += sum(h.get("ok", 0) for h in self.herds if h["pod"] == p["key"])
                per_call.append((p["key"], cloud, ok, allow_count.get((p["key"], cloud), 0)))
        out["per_call"] = per_call
        # The guarantee across a SIGKILL: every call answered before the kill
        # signal was sent has its record on disk when the agent is gone.
        at_kill = []
        for inc in self.incarnations:
            if "kill_sent" not in inc:
                continue
            k, boundary = inc["kill_sent"], inc["lines_at_end"]
            on_disk: dict[tuple[str, str], int] = {}
            for r in records[:boundary]:
                if r.get("type") == "credential" and r["decision"]["verdict"] == "allow":
                    key = (pod_of.get(r.get("caller", {}).get("pod"), "?"), r["request"]["cloud"])
                    on_disk[key] = on_disk.get(key, 0) + 1
            answered = 0
            short = []
            for p in PODS:
                if p["reuse"] != 0:
                    continue
                for cloud in SDKS:
                    ok = sum(1 for r in results if r.get("ok") and r["pod"] == p["key"] and r["sdk"] == cloud
                             and r["t1"] <= k)
                    if cloud == "azure":
                        ok += sum(h.get("ok", 0) for h in self.herds if h["pod"] == p["key"] and h["t1"] <= k)
                    answered += ok
                    if on_disk.get((p["key"], cloud), 0) < ok:
                        short.append(f"pod {p['key']} {cloud}: {ok} answered, {on_disk.get((p['key'], cloud), 0)} "
                                     f"on disk")
            at_kill.append({"n": inc["n"], "answered": answered,
                            "on_disk": sum(v for (key, _), v in on_disk.items()
                                           if any(p["key"] == key and p["reuse"] == 0 for p in PODS)),
                            "short": short})
        out["at_kill"] = at_kill
        verify = subprocess.run([self.args.lanyard, "audit", "verify", str(self.audit_file)], capture_output=True,
                                text=True, timeout=120, env=role_env())
        out["verify"] = (verify.returncode, (verify.stdout + verify.stderr).strip()[-300:])
        return out

    # ------------------------------------------------------------ report

    def report(self) -> int:
        results = self.results()
        with open(self.work / "samples.csv", "w") as f:
            f.write("t,process,run,rss_kib,fds,rss_anon_kib\n")
            for t, name, n, rss, fds, anon in self.samples:
                f.write(f"{t - self.t_start:.1f},{name},{n},{rss},{fds},{anon}\n")
        fails = []  # why the run failed
        # SDK calls
        rows = {}
        unexpected = []
        for r in results:
            row = rows.setdefault((r["sdk"], r["pod"]), {"calls": 0, "ok": 0, "expected": 0, "unexpected": 0,
                                                         "lat": []})
            row["calls"] += 1
            if r.get("ok"):
                row["ok"] += 1
                row["lat"].append((r["t1"] - r["t0"]) * 1000)
                continue
            w = self.classify(r["sdk"], r["t0"], r["t1"], r.get("status"), r.get("retryable", False))
            if w is not None:
                row["expected"] += 1
                w.failures += 1
            else:
                row["unexpected"] += 1
                unexpected.append(r)
        herd_unexpected = []
        for h in self.herds:
            errors = h.get("errors", 0)
            h["expected"] = h["unexpected"] = 0
            if "failed" in h:
                herd_unexpected.append(h)
                continue
            if errors:
                kinds = h.get("error_kinds", {})
                # The sidecar is up throughout: connect or I/O errors are never expected.
                retryable = all(k.startswith(("status_5", "status_429", "timeout")) for k in kinds)
                w = self.classify("azure", h["t0"], h["t1"], None, retryable)
                if w is not None:
                    h["expected"] = errors
                    w.failures += errors
                else:
                    h["unexpected"] = errors
                    herd_unexpected.append(h)
        audit = self.audit(results)
        log_problems = self.log_checks(results)

        total_calls = len(results)
        if total_calls == 0:
            fails.append("no SDK call was made")
        if unexpected:
            fails.append(f"{len(unexpected)} unexpected SDK failures")
        if herd_unexpected:
            fails.append(f"{len(herd_unexpected)} herd bursts with unexpected errors")
        if self.wrong_owner:
            fails.append(f"{len(self.wrong_owner)} credentials not of the pod's own identity")
        if self.crashes:
            fails.append("crashed: " + "; ".join(self.crashes))
        fails += self.problems
        fails += log_problems
        for inc in audit["incarnations"]:
            # Requests refused because their record could not be written (the
            # disk full) are decisions without a line or a record of their
            # own; the sink_failure record written after the outage counts them.
            recorded = inc["decisions"] - inc["file_failed"]
            if inc["final"] and inc["logged"] != recorded:
                fails.append(f"audit: agent {inc['n']} counted {inc['decisions']:.0f} decisions "
                             f"({inc['file_failed']:.0f} refused unrecorded) but logged {inc['logged']} audit lines")
            if inc["final"] and inc["lost_recorded"] != inc["file_failed"]:
                fails.append(f"audit: agent {inc['n']} could not write {inc['file_failed']:.0f} records, its "
                             f"sink_failure records count {inc['lost_recorded']}")
            if inc["final"] and inc["records"] < recorded:
                fails.append(f"audit: agent {inc['n']} made {inc['decisions']:.0f} decisions "
                             f"({inc['file_failed']:.0f} refused unrecorded), "
                             f"its file has {inc['records']} credential records")
            elif not inc["final"] and inc["records"] < inc["decisions"]:
                fails.append(f"audit: agent {inc['n']} had counted {inc['decisions']:.0f} decisions before it was "
                             f"killed, the file has {inc['records']} of its records")
        if audit["fingerprints_missing"]:
            fails.append(f"audit: {len(audit['fingerprints_missing'])} answered calls whose credential has no "
                         f"allow record of that pod")
        for key, cloud, ok, allowed in audit["per_call"]:
            if allowed < ok:
                fails.append(f"audit: pod {key} {cloud}: {ok} calls answered through the agent, {allowed} allow records")
        for k in audit["at_kill"]:
            for short in k["short"]:
                fails.append(f"audit: answered before agent {k['n']} was killed but not on disk: {short}")
        if audit["verify"][0] != 0:
            fails.append(f"audit: lanyard audit verify failed: {audit['verify'][1]}")
        if audit["unparsable"]:
            fails.append(f"audit: {audit['unparsable']} unparsable lines")

        o = []
        p = o.append
        version = subprocess.run([self.args.lanyard, "--version"], capture_output=True, text=True).stdout.strip()
        p("## Soak")
        p("")
        p(f"`bench/soak{' --quick' if self.args.quick else ''}`: {self.duration:.0f} s of load "
          f"({self.t_end - self.t_start:.0f} s measured), {version}, profile `{self.args.profile}`, "
          f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
          f"**{'PASS' if not fails else 'FAIL'}**.")
        p("")
        p("One `lanyard agent` (Kubernetes API: `lanyard-fake-kube`; audit file with `fsync: true`), "
          "three slim `lanyard-sidecar`s, one pod each (`ray/ray-worker`, `etl/etl-runner`, `legacy/scripts`, "
          "each bound to Azure, Google and AWS). Pods a and c: `LANYARD_SIDECAR_GRANT_REUSE_SECONDS=0` (every "
          "call reaches the agent); pod b: the default 10 s reuse. Azure through App Service (a, b) and IMDS (c). "
          f"Emulated lifetimes: Entra and Google {CLOUD_LIFETIME // 60} min (refreshed after 3 min), AWS "
          f"`session_duration` {AWS_SESSION // 60} min (refreshed after 6¼ min); projected tokens "
          f"{PROJECTED_TOKEN_SECONDS // 60} min, rotated {self.rotations - 1} times; `cache.idle_ttl` 60 s. "
          "Per pod and SDK one worker process asks every 0.5 s with a fresh credential object; every 4th Azure "
          "and Google call asks for a resource or ID-token audience never asked before (an upstream exchange).")
        p("")
        p("| SDK | pod | calls | ok | failed, expected | failed, unexpected | ok p50 ms | ok p99 ms | ok max ms |")
        p("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for sdk in SDKS:
            agg = {"calls": 0, "ok": 0, "expected": 0, "unexpected": 0, "lat": []}
            for pod in PODS:
                row = rows.get((sdk, pod["key"]))
                if not row:
                    continue
                for k in ("calls", "ok", "expected", "unexpected"):
                    agg[k] += row[k]
                agg["lat"] += row["lat"]
                p(f"| {SDK_NAME[sdk]} | {pod['key']} | {row['calls']} | {row['ok']} | {row['expected']} | "
                  f"{bold(row['unexpected'])} | {pct(row['lat'], 50)} | {pct(row['lat'], 99)} | "
                  f"{pct(row['lat'], 100)} |")
            p(f"| **{SDK_NAME[sdk]}** | all | {agg['calls']} | {agg['ok']} | {agg['expected']} | "
              f"{bold(agg['unexpected'])} | {pct(agg['lat'], 50)} | {pct(agg['lat'], 99)} | "
              f"{pct(agg['lat'], 100)} |")
        p("")
        if self.herds:
            p(f"Herd bursts ({HERD_CONCURRENCY} connections at once, Azure IMDS at the pod's sidecar):")
            p("")
            p("| at s | pod | ok | errors (expected / unexpected) | distinct tokens | p50 ms | p99 ms | wall ms |")
            p("|---:|---|---:|---:|---:|---:|---:|---:|")
            for h in sorted(self.herds, key=lambda h: h["t0"]):
                if "failed" in h:
                    p(f"| {h['t0'] - self.t_start:.0f} | {h['pod']} | **{h['failed']}** | | | | | |")
                    continue
                p(f"| {h['t0'] - self.t_start:.0f} | {h['pod']} | {h.get('ok')} | {h['expected']} / "
                  f"{bold(h['unexpected'])} | {h.get('distinct_tokens')} | {h.get('p50_ms')} | {h.get('p99_ms')} | "
                  f"{h.get('wall_ms')} |")
            p("")
        p("Faults and events (a failure is *expected* when it is retryable — 408, 429, 5xx or a transport error — "
          "and its call overlaps the window of a fault on its cloud, or of one that touches every cloud; windows "
          "extend past the fault by the time its effect can last):")
        p("")
        p("| at s | until s | event | failures it explains |")
        p("|---:|---:|---|---:|")
        for e in sorted(self.events, key=lambda e: e["t0"]):
            w = e.get("window")
            p(f"| {e['t0']:.1f} | {e['t1']:.1f} | {e['label']} | {w.failures if w else ''} |")
        p("")
        p("Footprint, sampled every second (`VmRSS`; `RssAnon`, the part that is not pages of files such as the "
          "executable's code; entries of `/proc/PID/fd`); slope: least squares over the second half of the run")
        p("")
        p("| process | RSS start → half → end MiB | RSS slope KiB/min | anon RSS start → half → end MiB | "
          "anon slope KiB/min | fds start → half → end | fds slope /min |")
        p("|---|---|---:|---|---:|---|---:|")
        half = self.t_start + self.duration / 2
        last_agent = self.incarnations[-1]["n"]
        for name in ["agent", *[f"sidecar-{p_['key']}" for p_ in PODS]]:
            s = [x for x in self.samples if x[1] == name]
            if not s:
                continue
            s2 = [x for x in s if x[0] >= half and (name != "agent" or x[2] == last_agent)]
            mid = s2[0] if s2 else s[-1]
            rs = slope([(x[0], x[3]) for x in s2])
            fs = slope([(x[0], x[4]) for x in s2])
            an = slope([(x[0], x[5]) for x in s2])
            label = name + (f" (pid of run {last_agent})" if name == "agent" and last_agent > 1 else "")
            p(f"| {label} | {s[0][3] / 1024:.1f} → {mid[3] / 1024:.1f} → {s[-1][3] / 1024:.1f} | {fmt(rs)} | "
              f"{s[0][5] / 1024:.1f} → {mid[5] / 1024:.1f} → {s[-1][5] / 1024:.1f} | {fmt(an)} | "
              f"{s[0][4]} → {mid[4]} → {s[-1][4]} | {fmt(fs, 2)} |")
        p("")
        if self.duration >= 2 * WINDOW:
            self.window_slopes(p)
        if self.heaptrack_dir is not None:
            profiled = ", ".join(x.name for x in self.procs if x.heaptrack is not None)
            p(f"Under heaptrack (`BENCH_HEAPTRACK`, profiles in `{self.heaptrack_dir}`): {profiled}. Their RSS "
              f"includes heaptrack's own, and their latencies its cost per allocation.")
            p("")
        p("Audit (the file's `credential` records per agent run, against that agent's `lanyard_decisions_total`; "
          "a killed agent's counters are its last scrape, at most a second before the kill, so its file may hold "
          "more, never fewer):")
        p("")
        p("| agent run | ended by | credential records in the file (allow / deny) | decisions counted | "
          "file records counted (failed; counted by sink_failure) | audit log lines | file writes: batches, mean ms, over 0.5 s | "
          "refreshes (failed) | upstream calls azure / gcp / aws (failed) |")
        p("|---|---|---|---:|---:|---:|---|---:|---|")
        for inc in audit["incarnations"]:
            up = inc["upstream"]
            mean = f"{inc['write_mean_ms']:.2f}" if inc["write_mean_ms"] is not None else "–"
            p(f"| {inc['n']} | {inc['how']} | {inc['records']} ({inc['allow']} / {inc['deny']}) | "
              f"{inc['decisions']:.0f}{'' if inc['final'] else ' (last scrape)'} | {inc['file_written']:.0f} "
              f"({inc['file_failed']:.0f}; {inc['lost_recorded']}) | {inc['logged']} | {inc['batches']:.0f}, {mean}, {inc['write_slow']:.0f} | "
              f"{inc['refreshes']:.0f} ({inc['refresh_failures']:.0f}) | "
              f"{up['azure']:.0f} / {up['gcp']:.0f} / {up['aws']:.0f} ({inc['upstream_failed']:.0f}) |")
        p("")
        for inc in audit["incarnations"]:
            if inc["final"] and inc["records"] > inc["decisions"] - inc["file_failed"]:
                p(f"- Agent run {inc['n']}: {inc['records'] - inc['decisions'] + inc['file_failed']:.0f} records "
                  f"more than decisions recorded "
                  f"counted ({inc['logged']} audit log lines): requests whose caller went away while their record "
                  f"was being written (the file kept the record; the log line and the counter, which come after "
                  f"it, were never reached, and no answer left).")
        reasons = sorted({r for inc in audit["incarnations"] for r in inc["deny_reasons"]})
        p(f"- Refusal reasons recorded: {', '.join(reasons) if reasons else 'none'}.")
        p(f"- Every credential an SDK was answered has an `allow` record of that pod and cloud with its fingerprint: "
          f"{audit['fingerprints_checked']} distinct credentials, {len(audit['fingerprints_missing'])} missing.")
        pc = ", ".join(f"{k}/{c} {ok} ≤ {al}" for k, c, ok, al in audit["per_call"])
        p(f"- Pods without grant reuse, calls answered ≤ `allow` records: {pc}.")
        for k in audit["at_kill"]:
            p(f"- Agent run {k['n']} SIGKILLed: the calls of pods a and c answered before the signal ({k['answered']}) "
              f"against their `allow` records on disk when it was gone ({k['on_disk']}): "
              f"{'none missing' if not k['short'] else '; '.join(k['short'])}.")
        p(f"- `lanyard audit verify`: exit {audit['verify'][0]} ({audit['verify'][1].splitlines()[-1] if audit['verify'][1] else ''}).")
        p(f"- Identity: {self.whois_checked} distinct credentials asked of the clouds' ledgers "
          f"(`/clouds/whois`), {len(self.wrong_owner)} not of the pod's own identity.")
        issued = {c: sum(v.values()) for c, v in self.counts.items()}
        p(f"- Credentials the emulators issued: Entra {issued.get('azure', 0)}, Google {issued.get('gcp', 0)}, "
          f"AWS STS {issued.get('aws', 0)}.")
        p("")
        if fails:
            p("**Failed:**")
            p("")
            for f in fails:
                p(f"- {f}")
            for r in unexpected[:10]:
                p(f"  - {SDK_NAME[r['sdk']]} pod {r['pod']} ({r['kind']}) t={r['t0'] - self.t_start:.1f}–"
                  f"{r['t1'] - self.t_start:.1f}s status {r.get('status')}: `{r.get('error', '')[:300]}`")
            for h in herd_unexpected[:5]:
                p(f"  - herd at t={h['t0'] - self.t_start:.1f}s: {h.get('failed') or h.get('error_kinds')} "
                  f"{h.get('first_errors', '')}")
            for w in self.wrong_owner[:10]:
                p(f"  - {w}")
            for r in audit["fingerprints_missing"][:10]:
                p(f"  - no record for {SDK_NAME[r['sdk']]} pod {r['pod']} t={r['t0'] - self.t_start:.1f}s {r['fp']}")
            p("")
        print("\n".join(o), flush=True)
        return 1 if fails else 0

    def window_slopes(self, p) -> None:
        """RSS and descriptors per process over each WINDOW of the run (the
        last one may be shorter): start → end and the least-squares slope.
        The agent's window counts the samples of the agent run that has the
        most of them there (the SIGKILL starts a new process)."""
        p(f"Footprint per {WINDOW // 60}-minute window (least-squares slope within the window):")
        p("")
        p("| process | window s | RSS start → end MiB | RSS slope KiB/min | anon RSS start → end MiB | "
          "anon slope KiB/min | fds start → end | fds slope /min |")
        p("|---|---|---|---:|---|---:|---|---:|")
        for name in ["agent", *[f"sidecar-{p_['key']}" for p_ in PODS]]:
            w0 = 0
            while w0 < self.duration:
                w1 = min(self.duration, w0 + WINDOW)
                s = [x for x in self.samples if x[1] == name and w0 <= x[0] - self.t_start < w1]
                runs = {x[2] for x in s}
                label = name
                if len(runs) > 1:
                    run = max(runs, key=lambda n: sum(1 for x in s if x[2] == n))
                    s = [x for x in s if x[2] == run]
                    label = f"{name} (run {run})"
                if len(s) >= 3:
                    rs = slope([(x[0], x[3]) for x in s])
                    fs = slope([(x[0], x[4]) for x in s])
                    an = slope([(x[0], x[5]) for x in s])
                    p(f"| {label} | {w0}–{w1:.0f} | {s[0][3] / 1024:.1f} → {s[-1][3] / 1024:.1f} | {fmt(rs)} | "
                      f"{s[0][5] / 1024:.1f} → {s[-1][5] / 1024:.1f} | {fmt(an)} | "
                      f"{s[0][4]} → {s[-1][4]} | {fmt(fs, 2)} |")
                w0 += WINDOW
        p("")

    # ------------------------------------------------------------ teardown

    def close(self) -> None:
        self.stop_event.set()
        try:
            (self.work / "stop").write_text("")
        except OSError:
            pass
        for p in reversed(self.procs):
            if p.alive():
                try:
                    p.stop(timeout=5)
                except Exception:  # noqa: BLE001 - keep stopping the others
                    p.kill()
        for p in self.procs:
            if p.heaptrack is not None:
                p.heaptrack.finish()
                say(f"heaptrack profile of {p.name}: {p.heaptrack.path}")
        if getattr(self, "audit_fs", False):
            if os.environ.get("BENCH_SOAK_KEEP"):
                # Keep the audit file where it can be read after the unmount.
                shutil.copytree(self.audit_file.parent, self.work / "audit-kept", dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("filler"))
            subprocess.run(["umount", str(self.audit_file.parent)], capture_output=True)
        if os.environ.get("BENCH_SOAK_KEEP"):
            say(f"kept {self.work}")
        else:
            shutil.rmtree(self.work, ignore_errors=True)


def pct(values: list[float], q: float) -> str:
    if not values:
        return "–"
    v = sorted(values)
    i = min(len(v) - 1, max(0, int(round(q / 100 * (len(v) - 1)))))
    return f"{v[i]:.0f}"


def fmt(v: float | None, digits: int = 0) -> str:
    return "–" if v is None else f"{v:+.{digits}f}"


def bold(n: int) -> str:
    return f"**{n}**" if n else "0"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--duration", type=int, default=600)
    r.add_argument("--profile", default="release")
    r.add_argument("--quick", action="store_true")
    for b in ("lanyard", "sidecar", "fake-kube", "herd"):
        r.add_argument(f"--{b}", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--sdk", choices=SDKS, required=True)
    w.add_argument("--pod", required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--stop", required=True)
    w.add_argument("--interval", type=float, default=0.5)
    w.add_argument("--churn-every", type=int, default=4)
    args = parser.parse_args()
    if args.cmd == "worker":
        return worker(args)

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_signal)
    soak = Soak(args)
    try:
        return soak.run()
    except KeyboardInterrupt as e:
        say(f"interrupted ({e}); stopping everything")
        return 130
    except Exception as e:  # noqa: BLE001 - reported with the logs' tails
        say(f"FAILED: {type(e).__name__}: {e}")
        return 1
    finally:
        soak.close()


if __name__ == "__main__":
    sys.exit(main())
