"""google-auth, unmodified, against `lanyard dev`'s GCE metadata surface.

google-auth reads GCE_METADATA_HOST/IP when it is imported, so each client
scenario runs in a fresh interpreter with the exports in its environment,
as an application would.
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import jwt_check
import requests


def run_client(dev, code: str) -> dict:
    env = dict(os.environ)
    for name in ("GCE_METADATA_HOST", "GCE_METADATA_IP"):
        env[name] = dev.exports[name]
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_default_detects_metadata_server_and_refreshes(dev):
    result = run_client(dev, """
        import json
        import google.auth, google.auth.transport.requests
        from google.auth import compute_engine
        from google.auth.compute_engine import _metadata
        request = google.auth.transport.requests.Request()
        pinged = _metadata.ping(request)
        creds, project = google.auth.default(scopes=["https://www.googleapis.com/auth/devstorage.read_only"])
        creds.refresh(request)
        print(json.dumps({
            "pinged": pinged,
            "project": project,
            "kind": type(creds).__name__,
            "module": type(creds).__module__,
            "token": creds.token,
            "email": creds.service_account_email,
            "expiry": creds.expiry.timestamp() if creds.expiry else None,
            "expired": creds.expired,
        }))
    """)
    assert result["pinged"] is True
    assert result["project"] == "lanyard-dev"
    assert result["module"].startswith("google.auth.compute_engine")
    assert result["kind"] == "Credentials"
    assert result["token"].startswith("ya29.")
    assert result["email"] == "ray-worker@lanyard-dev.iam.gserviceaccount.com"
    assert result["expired"] is False
    dev.issued.append(result["token"])


def test_id_token_has_requested_audience(dev):
    result = run_client(dev, """
        import json
        import google.auth.transport.requests
        from google.auth import compute_engine
        from google.oauth2 import id_token
        request = google.auth.transport.requests.Request()
        fetched = id_token.fetch_id_token(request, "https://service.example.com")
        creds = compute_engine.IDTokenCredentials(
            request, target_audience="https://other.example.com", use_metadata_identity_endpoint=True
        )
        creds.refresh(request)
        print(json.dumps({"fetched": fetched, "creds": creds.token}))
    """)
    claims = jwt_check.payload(result["fetched"])
    assert claims["aud"] == "https://service.example.com"
    assert claims["exp"] > time.time() + 600
    assert jwt_check.payload(result["creds"])["aud"] == "https://other.example.com"
    dev.issued += [result["fetched"], result["creds"]]


def test_missing_flavor_header_is_403_with_flavor_echoed(dev):
    host = dev.exports["GCE_METADATA_HOST"]
    url = f"http://{host}/computeMetadata/v1/instance/service-accounts/default/token"
    resp = requests.get(url, timeout=5)
    assert resp.status_code == 403
    assert resp.headers["Metadata-Flavor"] == "Google"
    resp = requests.get(url, headers={"Metadata-Flavor": "Google", "X-Forwarded-For": "1.2.3.4"}, timeout=5)
    assert resp.status_code == 403
    assert "access_token" not in resp.text


def test_other_service_account_is_not_found(dev):
    host = dev.exports["GCE_METADATA_HOST"]
    url = f"http://{host}/computeMetadata/v1/instance/service-accounts/admin@lanyard-dev.iam.gserviceaccount.com/token"
    resp = requests.get(url, headers={"Metadata-Flavor": "Google"}, timeout=5)
    assert resp.status_code == 404
    assert "access_token" not in resp.text


def test_universe_and_project_through_gkes_pool(tmp_path):
    from conftest import Dev
    dev = Dev([], tmp_path / "lanyard.log", extra_env={
        "LANYARD_GCP_GKE_CLUSTER": "projects/ray-prod-4821/locations/us-central1/clusters/ray",
        "LANYARD_GCP_PROJECT_NUMBER": "310987654321",
        "LANYARD_GCP_UNIVERSE_DOMAIN": "apis-tpczero.goog"})
    try:
        result = run_client(dev, """
            import json
            import google.auth, google.auth.transport.requests
            from google.auth.compute_engine import _metadata
            request = google.auth.transport.requests.Request()
            creds, project = google.auth.default()
            creds.refresh(request)
            print(json.dumps({"project": project, "universe": _metadata.get_universe_domain(request),
                              "token": creds.token, "email": creds.service_account_email}))
        """)
    finally:
        assert dev.stop() == 0, dev.read_log()
    assert result["project"] == "ray-prod-4821"
    assert result["universe"] == "apis-tpczero.goog"
    assert result["token"].startswith("ya29.")
    assert result["email"] == "ray-worker@lanyard-dev.iam.gserviceaccount.com"
