"""docs/examples/ray_job.py on a real Ray runtime, against real storage
emulators that check the credentials Lanyard brokers.

Started here, on loopback:

- moto's server (S3, IAM, STS) with request authorization enforced once it
  is set up: S3 checks each request's SigV4 signature against the
  temporary credentials its STS issued, and the role's IAM policy. Its STS
  is Lanyard's AWS STS. After the set-up calls, moto lets exactly one more
  request through unauthenticated: the single `AssumeRoleWithWebIdentity`
  Lanyard should make for the pod's role. A second exchange would be
  refused (moto answers an unsigned call with an error once enforcement is
  on), and the job would fail.
- Azurite (Blob) in OAuth mode over HTTPS: it takes a bearer token only if
  it is a JWT whose issuer is Entra's (`https://sts.windows.net/…`), whose
  audience is Storage's and which is within its lifetime.
- `lanyard dev`, configured with moto as its AWS STS and moto's role as the
  pod's; Entra is its own emulator, whose access tokens are JWTs as Entra's
  are.

The job runs with the environment `lanyard dev` prints for a pod, plus where
the storage is (Azurite's account URL and CA certificate, moto's S3
endpoint) and what to read. Ray's local instance starts its workers from
the driver's environment, as a RayCluster's workers start from their pod's.

Checked: every task read the object that was put (length and SHA-256), per
cloud; one upstream exchange per identity (Lanyard's counters, and moto's
allowance); and that the emulators refuse what they should (an S3 write
the role's policy does not allow, a wrong secret, no signature, an extra
exchange, a token for another audience), so that their acceptance means
something. Google is not read: no GCS emulator here checks tokens
(fake-gcs-server takes any), so the Google path ends at the token, which
the client tests cover.

Markdown on stdout, progress on stderr; exit 1 on a failed check.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ACCOUNT = "devstoreaccount1"
# Azurite's well-known development key (its documentation publishes it):
# only the set-up uses it, to create the container and the blob.
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
MOTO_ACCOUNT = "123456789012"
ROLE = "ray-data"
BUCKET = "ray-data"
KEY = "part-0"
CONTAINER = "data"
BLOB = "part-0"


def say(msg: str) -> None:
    print(f"tests/ray: {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, what: str, timeout: float = 60.0, **kwargs) -> None:
    import ssl

    context = ssl.create_default_context(cafile=kwargs.get("cafile")) if kwargs.get("cafile") else None
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2, context=context)
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{what} did not answer at {url} within {timeout:.0f} s")


class Processes:
    def __init__(self, logs: Path):
        self.logs = logs
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], env: dict | None = None, stdout=None) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "wb")
        proc = subprocess.Popen(
            argv, env=env, stdout=stdout or log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
        )
        self.procs.append((name, proc))
        return proc

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for name, proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                # Azurite (node) may not exit on SIGTERM; nothing is kept.
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1: Azurite's (OAuth needs HTTPS)."""
    cert, key = directory / "azurite.pem", directory / "azurite-key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    return cert, key


def set_up_moto(endpoint: str, payload: bytes) -> None:
    """The role the pod's ServiceAccount names, its policy, and the object:
    what a platform team sets up before the job. Then enforcement, with one
    unauthenticated request left for Lanyard's exchange."""
    import boto3

    admin = dict(
        endpoint_url=endpoint, region_name="us-east-1",
        aws_access_key_id="AKIAIOSFODNN7EXAMPLE", aws_secret_access_key="set-up-only",
    )
    iam = boto3.client("iam", **admin)
    trust = {
        "Version": "2012-10-17",
        "Statement": [{
            "Effect": "Allow",
            "Principal": {"Federated": f"arn:aws:iam::{MOTO_ACCOUNT}:oidc-provider/lanyard-dev"},
            "Action": "sts:AssumeRoleWithWebIdentity",
        }],
    }
    iam.create_role(RoleName=ROLE, AssumeRolePolicyDocument=json.dumps(trust))
    read_only = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "s3:GetObject", "Resource": f"arn:aws:s3:::{BUCKET}/*"}],
    }
    iam.put_role_policy(RoleName=ROLE, PolicyName="read", PolicyDocument=json.dumps(read_only))
    s3 = boto3.client("s3", **admin)
    s3.create_bucket(Bucket=BUCKET)
    s3.put_object(Bucket=BUCKET, Key=KEY, Body=payload)
    # A text body: Flask would take a form-encoded one apart.
    req = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth", data=b"1", method="POST", headers={"Content-Type": "text/plain"}
    )
    answer = json.loads(urllib.request.urlopen(req, timeout=10).read())
    assert answer.get("status") == "ok", answer


def set_up_azurite(account_url: str, cert: Path, payload: bytes) -> None:
    from azure.storage.blob import BlobServiceClient

    service = BlobServiceClient(
        account_url, credential={"account_name": ACCOUNT, "account_key": ACCOUNT_KEY},
        connection_verify=str(cert),
    )
    service.create_container(CONTAINER)
    service.get_blob_client(CONTAINER, BLOB).upload_blob(payload)


def start_lanyard(procs: Processes, lanyard: str, moto: str, work: Path) -> dict:
    config = work / "lanyard.yaml"
    config.write_text(
        "aws:\n"
        f"  sts_endpoint: {moto}\n"
        "dev:\n"
        f"  aws_role_arn: arn:aws:iam::{MOTO_ACCOUNT}:role/{ROLE}\n"
    )
    proc = procs.start(
        "lanyard-dev",
        [lanyard, "dev", "--config", str(config), "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"],
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")},
        stdout=subprocess.PIPE,
    )
    exports, admin = {}, None
    deadline = time.time() + 60
    while time.time() < deadline:
        line = proc.stdout.readline().decode()
        if not line or line.strip() == "# lanyard dev ready":
            break
        if m := re.match(r"^# lanyard admin (\S+)$", line.strip()):
            admin = m.group(1)
        if m := re.match(r"^export ([A-Z0-9_]+)=(.*)$", line.strip()):
            exports[m.group(1)] = shlex.split(m.group(2))[0] if m.group(2) else ""
    if "IDENTITY_ENDPOINT" not in exports or not admin:
        raise SystemExit("lanyard dev did not print its exports:\n" + (procs.logs / "lanyard-dev.log").read_text())
    return {"exports": exports, "admin": admin}


def metric(admin: str, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(admin + "/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(4))
    return total


def pod_env(exports: dict, extra: dict) -> dict:
    """What a worker pod has: the basics of a process, the variables the
    webhook injects (here, what `lanyard dev` prints), and the job's own."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
    env.update(exports)
    env.update(extra)
    return env


def refusals(env: dict, account_url: str, moto: str) -> list[str]:
    """The emulators refuse what they should: otherwise their acceptance of
    the job's reads proves nothing. Runs in this process with the pod's
    environment. Returns the failures."""
    import boto3
    import botocore
    import botocore.parsers
    from azure.core.credentials import AccessToken
    from azure.core.exceptions import ClientAuthenticationError, HttpResponseError
    from azure.identity import ManagedIdentityCredential
    from azure.storage.blob import BlobClient
    from botocore.config import Config

    failures = []
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        session = boto3.session.Session()
        creds = session.get_credentials().get_frozen_credentials()
        s3 = session.client("s3")

        def s3_error(call) -> str:
            try:
                call()
            except botocore.exceptions.ClientError as e:
                return e.response["Error"]["Code"]
            return "no error"

        got = s3_error(lambda: s3.put_object(Bucket=BUCKET, Key="written-by-the-job", Body=b"x"))
        if got != "AccessDenied":
            failures.append(f"moto S3: a PutObject the role's policy does not allow got {got}, not AccessDenied")
        wrong = boto3.session.Session(
            aws_access_key_id=creds.access_key, aws_secret_access_key=creds.secret_key[:-4] + "AAAA",
            aws_session_token=creds.token,
        ).client("s3")
        got = s3_error(lambda: wrong.get_object(Bucket=BUCKET, Key=KEY))
        if got != "SignatureDoesNotMatch":
            failures.append(f"moto S3: a GetObject signed with a wrong secret got {got}, not SignatureDoesNotMatch")
        unsigned = session.client("s3", config=Config(signature_version=botocore.UNSIGNED))
        got = s3_error(lambda: unsigned.get_object(Bucket=BUCKET, Key=KEY))
        if got not in ("AccessDenied", "403"):  # moto sends no body to an anonymous GET
            failures.append(f"moto S3: an unsigned GetObject got {got}, not 403 AccessDenied")
        # A second exchange: the allowance is spent, so moto refuses it.
        sts = boto3.client("sts", endpoint_url=moto, region_name="us-east-1", config=Config(signature_version=botocore.UNSIGNED))
        try:
            sts.assume_role_with_web_identity(
                RoleArn=f"arn:aws:iam::{MOTO_ACCOUNT}:role/{ROLE}", RoleSessionName="extra", WebIdentityToken="x" * 64,
            )
            failures.append("moto STS: an exchange beyond the allowance was answered")
        except (botocore.exceptions.ClientError, botocore.parsers.ResponseParserError):
            pass  # moto 5.2 answers it with a 500 (an HTML page), botocore with an error

        # Azurite: a token Lanyard serves for another resource is refused.
        other = ManagedIdentityCredential().get_token("https://vault.azure.net/.default")

        class Fixed:
            def get_token(self, *scopes, **kwargs):
                return AccessToken(other.token, other.expires_on)

        blob = BlobClient(account_url, CONTAINER, BLOB, credential=Fixed(), connection_verify=env["REQUESTS_CA_BUNDLE"])
        try:
            blob.download_blob().readall()
            failures.append("Azurite: a token for https://vault.azure.net was accepted")
        except ClientAuthenticationError as e:
            if "Invalid token audience" not in str(e):
                failures.append(f"Azurite: the vault token was refused for another reason: {str(e)[:200]}")
        anonymous = BlobClient(account_url, CONTAINER, BLOB, connection_verify=env["REQUESTS_CA_BUNDLE"])
        try:
            anonymous.download_blob().readall()
            failures.append("Azurite: an anonymous read was accepted")
        except HttpResponseError as e:
            if e.status_code != 403:
                failures.append(f"Azurite: the anonymous read got {e.status_code}, not 403: {str(e)[:200]}")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lanyard", required=True, help="the lanyard binary (with `dev`)")
    parser.add_argument("--azurite", required=True, help="Azurite's blob server entry point (azurite-blob)")
    parser.add_argument("--tasks", type=int, default=600, help="Ray tasks per cloud")
    parser.add_argument("--build", default="release", help="the build, for the report")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="lanyard-ray-"))
    logs = work / "logs"
    logs.mkdir()
    procs = Processes(logs)
    failures: list[str] = []
    try:
        payload = os.urandom(64 * 1024)
        cert, key = certificate(work)

        moto_port = free_port()
        moto = f"http://127.0.0.1:{moto_port}"
        proc = procs.start("moto", [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(moto_port)])
        wait_http(f"{moto}/moto-api/", proc, "moto")
        set_up_moto(moto, payload)

        blob_port = free_port()
        account_url = f"https://127.0.0.1:{blob_port}/{ACCOUNT}"
        proc = procs.start("azurite", [
            args.azurite, "--blobHost", "127.0.0.1", "--blobPort", str(blob_port), "--oauth", "basic",
            "--cert", str(cert), "--key", str(key), "--skipApiVersionCheck", "--inMemoryPersistence", "--silent",
        ])
        wait_http(f"https://127.0.0.1:{blob_port}/", proc, "Azurite", cafile=str(cert))
        set_up_azurite(account_url, cert, payload)

        lanyard = start_lanyard(procs, args.lanyard, moto, work)
        admin = lanyard["admin"]
        report = work / "report.json"
        env = pod_env(lanyard["exports"], {
            # Where the storage is, as the job's configuration says.
            "BLOB_ACCOUNT_URL": account_url, "BLOB_CONTAINER": CONTAINER, "BLOB_NAME": BLOB,
            "S3_BUCKET": BUCKET, "S3_KEY": KEY,
            # The pod trusts its storage's certificate authority: here
            # Azurite's own; moto's S3 is where S3 is.
            "REQUESTS_CA_BUNDLE": str(cert), "AWS_ENDPOINT_URL_S3": moto,
            "TASKS": str(args.tasks), "RAY_JOB_REPORT": str(report),
            "RAY_USAGE_STATS_ENABLED": "0",
        })
        say(f"running docs/examples/ray_job.py: {args.tasks} tasks per cloud")
        started = time.time()
        # A session of its own: Ray's processes (GCS, raylet, workers) go
        # with the driver's group should the job hang past its time.
        job = subprocess.Popen(
            [sys.executable, str(REPO / "docs/examples/ray_job.py")], env=env, cwd=work,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        try:
            output, _ = job.communicate(timeout=1800)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            output, _ = job.communicate()
            output += "\n(killed after 1800 s)"
        wall = time.time() - started
        (logs / "job.out").write_text(output)
        if job.returncode != 0:
            say(f"the job failed ({job.returncode}); its output:\n" + output[-4000:])
            say(f"logs kept in {logs}")
            return 1
        summary = json.loads(report.read_text())
        expected = {"bytes": [len(payload)], "sha256": [__import__("hashlib").sha256(payload).hexdigest()]}
        for cloud in ("azure blob", "s3"):
            s = summary.get(cloud)
            if not s:
                failures.append(f"{cloud}: not read")
                continue
            if s["tasks"] != args.tasks:
                failures.append(f"{cloud}: {s['tasks']} tasks, not {args.tasks}")
            if s["bytes"] != expected["bytes"] or s["sha256"] != expected["sha256"]:
                failures.append(f"{cloud}: read {s['bytes']} bytes ({s['sha256']}), not the object put")
        exchanges = {
            cloud: metric(admin, "lanyard_upstream_requests_total", cloud=cloud)
            for cloud in ("azure", "aws")
        }
        for cloud, n in exchanges.items():
            if n != 1:
                failures.append(f"{cloud}: {n:.0f} upstream exchanges for the one identity, not 1")
        failures += refusals(env, account_url, moto)

        import ray

        print("| Ray | tasks | build | job wall time | cloud | tasks | object | upstream exchanges (one identity) | credential p50 | p99 |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for cloud, upstream in (("azure blob", "azure"), ("s3", "aws")):
            s = summary.get(cloud, {})
            print(f"| {ray.__version__} | {args.tasks * 2} | {args.build} | {wall:.1f} s | {cloud} | {s.get('tasks')} | "
                  f"{len(payload) // 1024} KiB | {exchanges[upstream]:.0f} | {s.get('credential_p50_ms')} ms | {s.get('credential_p99_ms')} ms |")
        print()
        print("Refusals checked: S3 PutObject outside the role's policy (AccessDenied), a wrong secret "
              "(SignatureDoesNotMatch), no signature (403), an exchange beyond moto's allowance; "
              "Azurite: a token for another audience (Invalid token audience), no token (403).")
    finally:
        procs.stop()
    for f in failures:
        say("FAIL: " + f)
    if failures:
        say(f"logs kept in {logs}")
        return 1
    shutil.rmtree(work, ignore_errors=True)
    say("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
