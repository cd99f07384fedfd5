"""Read objects from Azure Blob Storage, Google Cloud Storage and Amazon S3
in Ray tasks on the workers, with the credentials Lanyard's sidecar serves
there (docs/ray.md). No credential is in this file or in its environment:
each task builds its SDK client the ordinary way, and the SDK finds the
sidecar through the variables the webhook injected into the worker pod.

    ray job submit --working-dir . -- python ray_job.py

What to read comes from the driver's environment; a cloud whose variables
are unset is skipped. Set them in the head pod, or per job:

    ray job submit --working-dir . --runtime-env-json \\
      '{"env_vars": {"S3_BUCKET": "my-bucket", "S3_KEY": "data/part-0.parquet"}}' \\
      -- python ray_job.py

    BLOB_ACCOUNT_URL  https://ACCOUNT.blob.core.windows.net
    BLOB_CONTAINER    container name
    BLOB_NAME         blob name
    GCS_BUCKET        bucket name
    GCS_OBJECT        object name
    S3_BUCKET         bucket name
    S3_KEY            object key
    TASKS             tasks per cloud, each with its own client (default 1)
    RAY_JOB_REPORT    a file to write the summary to, as JSON (optional)

Each task times how long its SDK took to get a credential (from the
sidecar, which answers from the node's cache after the first exchange), and
the job prints, per cloud, the tasks run, the bytes read and the median and
99th percentile of that time.
"""

import hashlib
import json
import os
import time

import ray

STORAGE_SCOPE = "https://storage.azure.com/.default"


def _digest(data: bytes) -> dict:
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@ray.remote
def read_blob(account_url: str, container: str, name: str) -> dict:
    from azure.identity import ManagedIdentityCredential
    from azure.storage.blob import BlobServiceClient

    # IDENTITY_ENDPOINT and IDENTITY_HEADER point it at the sidecar.
    credential = ManagedIdentityCredential()
    start = time.perf_counter()
    credential.get_token(STORAGE_SCOPE)  # kept by the credential for the read
    took = time.perf_counter() - start
    service = BlobServiceClient(account_url, credential=credential)
    data = service.get_blob_client(container, name).download_blob().readall()
    return {"credential_seconds": took, **_digest(data)}


@ray.remote
def read_gcs(bucket: str, name: str) -> dict:
    import google.auth
    import google.auth.transport.requests
    from google.cloud import storage

    # GCE_METADATA_HOST points google-auth at the sidecar.
    start = time.perf_counter()
    credentials, project = google.auth.default()
    credentials.refresh(google.auth.transport.requests.Request())
    took = time.perf_counter() - start
    client = storage.Client(project=project, credentials=credentials)
    data = client.bucket(bucket).blob(name).download_as_bytes()
    return {"credential_seconds": took, **_digest(data)}


@ray.remote
def read_s3(bucket: str, key: str) -> dict:
    import boto3

    # AWS_CONTAINER_CREDENTIALS_FULL_URI and
    # AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE point boto3 at the sidecar.
    session = boto3.session.Session()
    start = time.perf_counter()
    session.get_credentials().get_frozen_credentials()
    took = time.perf_counter() - start
    body = session.client("s3").get_object(Bucket=bucket, Key=key)["Body"]
    return {"credential_seconds": took, **_digest(body.read())}


def _percentile(values: list, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> dict:
    env = os.environ.get
    tasks = int(env("TASKS", "1"))
    if tasks < 1:
        raise SystemExit("TASKS must be at least 1")
    reads = {}
    if env("BLOB_ACCOUNT_URL") and env("BLOB_CONTAINER") and env("BLOB_NAME"):
        args = (env("BLOB_ACCOUNT_URL"), env("BLOB_CONTAINER"), env("BLOB_NAME"))
        reads["azure blob"] = [read_blob.remote(*args) for _ in range(tasks)]
    if env("GCS_BUCKET") and env("GCS_OBJECT"):
        args = (env("GCS_BUCKET"), env("GCS_OBJECT"))
        reads["gcs"] = [read_gcs.remote(*args) for _ in range(tasks)]
    if env("S3_BUCKET") and env("S3_KEY"):
        args = (env("S3_BUCKET"), env("S3_KEY"))
        reads["s3"] = [read_s3.remote(*args) for _ in range(tasks)]
    if not reads:
        raise SystemExit("nothing to read: set the variables listed in ray_job.py")
    summary = {}
    for cloud, refs in reads.items():
        results = ray.get(refs)
        seconds = [r["credential_seconds"] for r in results]
        summary[cloud] = {
            "tasks": len(results),
            "bytes": sorted({r["bytes"] for r in results}),
            "sha256": sorted({r["sha256"] for r in results}),
            "credential_p50_ms": round(_percentile(seconds, 0.50) * 1000, 2),
            "credential_p99_ms": round(_percentile(seconds, 0.99) * 1000, 2),
        }
        s = summary[cloud]
        print(
            f"{cloud}: {s['tasks']} tasks read {', '.join(map(str, s['bytes']))} bytes; "
            f"credential p50 {s['credential_p50_ms']} ms, p99 {s['credential_p99_ms']} ms"
        )
    return summary


if __name__ == "__main__":
    ray.init()
    summary = main()
    if os.environ.get("RAY_JOB_REPORT"):
        with open(os.environ["RAY_JOB_REPORT"], "w") as f:
            json.dump(summary, f, indent=2)
