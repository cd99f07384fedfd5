"""Read one object from Azure Blob Storage, one from Google Cloud Storage and
one from Amazon S3, each in a Ray task on a worker, with the credentials
Lanyard's sidecar serves there (docs/ray.md). No credential is in this file
or in its environment: the SDKs find the sidecar through the variables the
webhook injected into the worker pods.

    ray job submit --working-dir . -- python ray_job.py

What to read comes from the driver's environment; a cloud whose variables
are unset is skipped. Set them in the head pod, or per job:

    ray job submit --working-dir . --runtime-env-json \
      '{"env_vars": {"S3_BUCKET": "my-bucket", "S3_KEY": "data/part-0.parquet"}}' \
      -- python ray_job.py

    BLOB_ACCOUNT_URL  https://ACCOUNT.blob.core.windows.net
    BLOB_CONTAINER    container name
    BLOB_NAME         blob name
    GCS_BUCKET        bucket name
    GCS_OBJECT        object name
    S3_BUCKET         bucket name
    S3_KEY            object key
"""

import os

import ray

# Installed on the workers for these tasks only (needs PyPI from the pods).
SDKS = {
    "pip": [
        "azure-identity",
        "azure-storage-blob",
        "google-cloud-storage",
        "boto3",
    ]
}


@ray.remote(runtime_env=SDKS)
def read_blob(account_url: str, container: str, name: str) -> int:
    from azure.identity import ManagedIdentityCredential
    from azure.storage.blob import BlobServiceClient

    # IDENTITY_ENDPOINT and IDENTITY_HEADER point it at the sidecar.
    service = BlobServiceClient(account_url, credential=ManagedIdentityCredential())
    return len(service.get_blob_client(container, name).download_blob().readall())


@ray.remote(runtime_env=SDKS)
def read_gcs(bucket: str, name: str) -> int:
    from google.cloud import storage

    # GCE_METADATA_HOST points google-auth at the sidecar.
    return len(storage.Client().bucket(bucket).blob(name).download_as_bytes())


@ray.remote(runtime_env=SDKS)
def read_s3(bucket: str, key: str) -> int:
    import boto3

    # AWS_CONTAINER_CREDENTIALS_FULL_URI and
    # AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE point boto3 at the sidecar.
    body = boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"]
    return len(body.read())


def main() -> None:
    env = os.environ.get
    reads = {}
    if env("BLOB_ACCOUNT_URL") and env("BLOB_CONTAINER") and env("BLOB_NAME"):
        reads["azure blob"] = read_blob.remote(
            env("BLOB_ACCOUNT_URL"), env("BLOB_CONTAINER"), env("BLOB_NAME")
        )
    if env("GCS_BUCKET") and env("GCS_OBJECT"):
        reads["gcs"] = read_gcs.remote(env("GCS_BUCKET"), env("GCS_OBJECT"))
    if env("S3_BUCKET") and env("S3_KEY"):
        reads["s3"] = read_s3.remote(env("S3_BUCKET"), env("S3_KEY"))
    if not reads:
        raise SystemExit("nothing to read: set the variables listed in ray_job.py")
    for cloud, size in zip(reads, ray.get(list(reads.values()))):
        print(f"{cloud}: read {size} bytes")


if __name__ == "__main__":
    ray.init()
    main()
