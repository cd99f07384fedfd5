"""The app of a pod in the kubelet harness (tests/python/kubelet.py): asks
each cloud's real SDK for a credential, as docs/examples/ray_job.py's tasks
do, with nothing but the environment the pod was given.

    pod_sdk.py [--clouds azure,gcp,aws,gcloud] [--count N] [--interval S] [--stop-file F]
               [--azure-scope SCOPE]

Each attempt builds a fresh credential object, so that the SDKs' own caches
do not hide a failing call, and prints one JSON line: the cloud, whether it
worked, and the credential's handle (the Azure or Google access token, the
AWS access key id) for the harness to ask the emulated cloud whose it is,
or the error. It stops after N rounds or once the stop file exists.
"""

import argparse
import json
import os
import sys
import time


AZURE_SCOPE = ["https://storage.azure.com/.default"]


def azure() -> str:
    from azure.identity import ManagedIdentityCredential

    return ManagedIdentityCredential().get_token(AZURE_SCOPE[0]).token


def gcp() -> str:
    import google.auth
    import google.auth.transport.requests

    credentials, _ = google.auth.default()
    credentials.refresh(google.auth.transport.requests.Request())
    return credentials.token


def gcloud() -> str:
    """The gcloud CLI's token, with a configuration of its own as a fresh
    container has."""
    import shutil
    import subprocess
    import tempfile

    binary = shutil.which("gcloud")
    if binary is None:
        raise RuntimeError("gcloud is not installed")
    with tempfile.TemporaryDirectory() as config:
        env = {**os.environ, "CLOUDSDK_CONFIG": config, "CLOUDSDK_CORE_DISABLE_PROMPTS": "1",
               "CLOUDSDK_COMPONENT_MANAGER_DISABLE_UPDATE_CHECK": "1"}
        out = subprocess.run([binary, "auth", "print-access-token"], env=env, capture_output=True, text=True,
                             timeout=120)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip()[-400:])
    return out.stdout.strip()


def aws() -> str:
    import boto3

    credentials = boto3.Session().get_credentials()
    if credentials is None:
        raise RuntimeError("boto3 found no credentials")
    return credentials.get_frozen_credentials().access_key


CLOUDS = {"azure": azure, "gcp": gcp, "aws": aws, "gcloud": gcloud}
# The cloud each client's credential comes from, when not its own name.
CLOUD_OF = {"gcloud": "gcp"}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clouds", default="azure,gcp,aws")
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--interval", type=float, default=0.0)
    parser.add_argument("--stop-file")
    parser.add_argument("--azure-scope", default=AZURE_SCOPE[0])
    args = parser.parse_args()
    AZURE_SCOPE[0] = args.azure_scope
    clouds = args.clouds.split(",")
    done = 0
    while done < args.count and not (args.stop_file and os.path.exists(args.stop_file)):
        for cloud in clouds:
            started = time.time()
            try:
                line = {"cloud": CLOUD_OF.get(cloud, cloud), "client": cloud, "ok": True,
                        "credential": CLOUDS[cloud]()}
            except Exception as e:  # noqa: BLE001 - reported, the harness judges
                line = {"cloud": CLOUD_OF.get(cloud, cloud), "client": cloud, "ok": False,
                        "error": f"{type(e).__name__}: {str(e)[:400]}"}
            line.update(started=started, t=time.time())
            print(json.dumps(line), flush=True)
        done += 1
        time.sleep(args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
