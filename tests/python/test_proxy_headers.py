"""Every SDK surface refuses a request that a proxy relayed (an SSRF through
a proxy in the pod), whichever of the proxy-added headers it carries, and
answers the same request without it."""

import pytest
import requests

PROXY_HEADERS = {
    "Forwarded": "for=10.0.0.1", "X-Forwarded-For": "10.0.0.1", "X-Forwarded-Host": "x",
    "X-Forwarded-Proto": "http", "X-Forwarded-Port": "80", "X-Forwarded-Server": "x",
    "X-Real-IP": "10.0.0.1", "X-Client-IP": "10.0.0.1", "X-Cluster-Client-IP": "10.0.0.1",
    "X-Original-Forwarded-For": "10.0.0.1", "True-Client-IP": "10.0.0.1",
    "CF-Connecting-IP": "10.0.0.1", "Via": "1.1 proxy",
}


def surfaces(dev):
    """(name, method, url, headers, what a credential looks like)."""
    e = dev.exports
    host = e["GCE_METADATA_HOST"]
    imds_session = requests.put(f"http://{host}/latest/api/token",
                                headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}, timeout=10).text
    with open(e["AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"]) as f:
        app_token = f.read().strip()
    return [
        ("azure_imds", "GET", e["AZURE_POD_IDENTITY_AUTHORITY_HOST"]
         + "/metadata/identity/oauth2/token?api-version=2018-02-01&resource=https://storage.azure.com/",
         {"Metadata": "true"}, "access_token"),
        ("app_service", "GET", e["IDENTITY_ENDPOINT"] + "?api-version=2019-08-01&resource=https://storage.azure.com/",
         {"X-IDENTITY-HEADER": e["IDENTITY_HEADER"]}, "access_token"),
        ("app_service_2017", "GET", e["MSI_ENDPOINT"] + "?api-version=2017-09-01&resource=https://storage.azure.com/",
         {"secret": e["MSI_SECRET"]}, "access_token"),
        ("gce", "GET", f"http://{host}/computeMetadata/v1/instance/service-accounts/default/token",
         {"Metadata-Flavor": "Google"}, "access_token"),
        ("aws_container", "GET", e["AWS_CONTAINER_CREDENTIALS_FULL_URI"], {"Authorization": app_token}, "SecretAccessKey"),
        ("aws_imds_token", "PUT", f"http://{host}/latest/api/token",
         {"X-aws-ec2-metadata-token-ttl-seconds": "60"}, None),
        ("aws_imds", "GET", f"http://{host}/latest/meta-data/iam/security-credentials/ray-worker",
         {"X-aws-ec2-metadata-token": imds_session}, "SecretAccessKey"),
    ]


def test_every_surface_refuses_every_proxy_header(dev):
    for name, method, url, headers, credential in surfaces(dev):
        plain = requests.request(method, url, headers=headers, timeout=10)
        assert plain.status_code == 200, (name, plain.status_code, plain.text)
        if credential:
            assert credential in plain.text, name
        for header, value in PROXY_HEADERS.items():
            relayed = requests.request(method, url, headers={**headers, header: value}, timeout=10)
            assert relayed.status_code in (400, 403), (name, header, relayed.status_code, relayed.text)
            assert "access_token" not in relayed.text and "SecretAccessKey" not in relayed.text, (name, header)
            assert relayed.text.strip() != "" and relayed.text != plain.text, (name, header)
