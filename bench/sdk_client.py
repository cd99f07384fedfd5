"""The measured client of bench/sdk: one real SDK obtaining one credential.

    sdk_client.py measure SDK SOURCE     SDK: boto3 | azure-identity | google-auth
                                         SOURCE: lanyard | floor
    sdk_client.py floor-files DIR HOME   writes the floors' static credential files
    sdk_client.py report DIR QUICK       the Markdown section from DIR's samples

`measure` runs in a fresh interpreter per sample (google-auth reads
GCE_METADATA_HOST when it is imported), with only the environment the
wrapper gives it: `lanyard dev`'s exports (source lanyard) or the path of a
static credential file (source floor). It times (a) importing the SDK and
(b) obtaining the first credential, from constructing the SDK's default
credential object to holding a valid token, and prints one JSON line. No
token is printed: only a SHA-256 prefix, so that the wrapper can tell a
cached credential from a new one.

The floor is the same SDK reading a static credential file, with the network
closed: in floor mode every TCP/UDP connect and name lookup raises before
the SDK is imported, so a floor that silently went to the network fails
instead of being measured.

`floor-files` and `report` use nothing but the standard library.
"""

import time

_T_START = time.perf_counter()

import os  # noqa: E402  (already imported by the interpreter's start-up)
import socket  # noqa: E402  (every SDK imports it; imported here so the guard can patch it)
import sys  # noqa: E402

SDKS = ("boto3", "azure-identity", "google-auth")
AZURE_SCOPE = "https://storage.azure.com/.default"
GCP_SCOPES = ["https://www.googleapis.com/auth/devstorage.read_only"]


def close_network():
    """Makes every IP connect and name lookup fail (floor mode)."""

    def refuse(*_args, **_kwargs):
        raise OSError("bench/sdk: the floor must not use the network")

    real_connect = socket.socket.connect
    real_connect_ex = socket.socket.connect_ex

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            refuse()
        return real_connect(self, address)

    def connect_ex(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            refuse()
        return real_connect_ex(self, address)

    socket.socket.connect = connect
    socket.socket.connect_ex = connect_ex
    socket.getaddrinfo = refuse
    socket.gethostbyname = refuse
    socket.create_connection = refuse


# --------------------------------------------------------------- the SDKs
# Each SDK has an import step and a fetch step; the fetch is the same code
# for Lanyard and for the floor wherever the SDK allows it, so that the two
# differ only in where the credential comes from.


def import_sdk(sdk):
    if sdk == "boto3":
        import boto3

        return {"boto3": boto3}
    if sdk == "azure-identity":
        import azure.identity

        return {"identity": azure.identity}
    if sdk == "google-auth":
        import google.auth
        import google.auth.transport.requests

        return {"auth": google.auth, "Request": google.auth.transport.requests.Request}
    raise SystemExit(f"unknown SDK {sdk!r}")


def fetch(sdk, source, m):
    """Obtains one credential; returns (secret, expiry epoch, what answered)."""
    if sdk == "boto3":
        # The default chain in both cases: the container provider through
        # Lanyard, the shared credentials file for the floor.
        creds = m["boto3"].Session().get_credentials()
        if creds is None:
            raise RuntimeError("boto3 found no credentials")
        frozen = creds.get_frozen_credentials()
        if not frozen.access_key or not frozen.secret_key:
            raise RuntimeError("boto3 returned an empty credential")
        expiry = getattr(creds, "_expiry_time", None)
        return frozen.secret_key, expiry.timestamp() if expiry else None, creds.method
    if sdk == "azure-identity":
        identity = m["identity"]
        if source == "lanyard":
            # As tests/python/test_azure_identity.py: the default chain with
            # every export; ManagedIdentityCredential answers (App Service
            # flavour, since IDENTITY_ENDPOINT and IDENTITY_HEADER are set).
            cred = identity.DefaultAzureCredential(
                exclude_cli_credential=True,
                exclude_developer_cli_credential=True,
                exclude_powershell_credential=True,
                exclude_visual_studio_code_credential=True,
                exclude_shared_token_cache_credential=True,
                exclude_interactive_browser_credential=True,
            )
        else:
            # azure-identity has no static-file credential. The closest is
            # SharedTokenCacheCredential: it reads the MSAL token cache file
            # (~/.IdentityService/msal.cache.nocae, plaintext) that developer
            # tools leave behind and returns a cached access token that is
            # still valid without any network call.
            cred = identity.SharedTokenCacheCredential()
        token = cred.get_token(AZURE_SCOPE)
        if not token.token:
            raise RuntimeError("azure-identity returned an empty token")
        kind = type(cred).__name__
        answered = getattr(cred, "_successful_credential", None)  # ChainedTokenCredential's
        if answered is not None:
            kind += " > " + type(answered).__name__
            inner = getattr(answered, "_credential", None)  # ManagedIdentityCredential's flavour
            if inner is not None:
                kind += " > " + type(inner).__name__
        return token.token, token.expires_on, kind
    if sdk == "google-auth":
        request = m["Request"]()
        creds, _project = m["auth"].default(scopes=GCP_SCOPES)
        # What a client library does before each call (Credentials.before_request):
        # refresh only when the credential is not valid. The metadata-server
        # credential starts without a token, so through Lanyard this is
        # always credentials.refresh(Request()); the floor's file already
        # holds a valid token.
        if not creds.valid:
            creds.refresh(request)
        if not creds.valid or not creds.token:
            raise RuntimeError("google-auth holds no valid token after refresh")
        expiry = creds.expiry.replace(tzinfo=None) if creds.expiry else None
        if expiry is not None:
            # google-auth keeps naive UTC datetimes.
            import calendar

            expiry = calendar.timegm(expiry.timetuple())
        return creds.token, expiry, f"{type(creds).__module__}.{type(creds).__name__}"
    raise SystemExit(f"unknown SDK {sdk!r}")


def measure(sdk, source):
    if source == "floor":
        close_network()
    t0 = time.perf_counter()
    try:
        modules = import_sdk(sdk)
        t1 = time.perf_counter()
        secret, expiry, kind = fetch(sdk, source, modules)
        t2 = time.perf_counter()
    except Exception as exc:  # the SDK's own error, whole, for the report
        import json
        import traceback

        traceback.print_exc()
        print(json.dumps({"sdk": sdk, "source": source, "error": f"{type(exc).__name__}: {exc}"}))
        sys.exit(1)
    import hashlib
    import json

    print(json.dumps({
        "sdk": sdk,
        "source": source,
        "start_ms": round((t0 - _T_START) * 1000, 3),
        "import_ms": round((t1 - t0) * 1000, 3),
        "credential_ms": round((t2 - t1) * 1000, 3),
        "kind": kind,
        "fingerprint": hashlib.sha256(secret.encode()).hexdigest()[:12],
        "expires_in_s": round(expiry - time.time()) if expiry else None,
    }))


# --------------------------------------------------------------- the floors


def floor_files(directory, home):
    """The static credential files the floors read, valid for an hour."""
    import datetime
    import json

    now = int(time.time())
    with open(os.path.join(directory, "aws-credentials"), "w") as f:
        f.write(
            "[default]\n"
            "aws_access_key_id = AKIAIOSFODNN7EXAMPLE\n"
            "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY\n"
        )
    expiry = datetime.datetime.fromtimestamp(now + 3600, datetime.timezone.utc)
    with open(os.path.join(directory, "google-authorized-user.json"), "w") as f:
        json.dump({
            "type": "authorized_user",
            "client_id": "bench.apps.googleusercontent.com",
            "client_secret": "bench-floor",
            "refresh_token": "bench-floor-never-used",
            "token": "ya29.bench-floor-static-token",
            "expiry": expiry.strftime("%Y-%m-%dT%H:%M:%SZ"),
        }, f)
    # An MSAL token cache as a developer tool leaves it: one account with a
    # (family) refresh token, and an access token for the storage scope.
    tenant = "72f988bf-86f1-41af-91ab-2d7cd011db47"
    uid = "00000000-0000-0000-0000-00000000b0b0"
    home_account = f"{uid}.{tenant}"
    env = "login.microsoftonline.com"
    client = "04b07795-8ddb-461a-bbee-02f9e1bf7b46"
    target = AZURE_SCOPE
    cache = {
        "Account": {f"{home_account}-{env}-{tenant}": {
            "home_account_id": home_account, "environment": env, "realm": tenant,
            "local_account_id": uid, "username": "bench@example.com", "authority_type": "MSSTS",
        }},
        "RefreshToken": {f"{home_account}-{env}-refreshtoken-1--": {
            "credential_type": "RefreshToken", "secret": "bench-floor-never-used",
            "home_account_id": home_account, "environment": env, "client_id": client,
            "target": target, "family_id": "1",
        }},
        "AccessToken": {f"{home_account}-{env}-accesstoken-{client}-{tenant}-{target}": {
            "credential_type": "AccessToken", "secret": "bench-floor-static-token",
            "home_account_id": home_account, "environment": env, "client_id": client,
            "target": target, "realm": tenant, "token_type": "Bearer", "cached_at": str(now),
            "expires_on": str(now + 3600), "extended_expires_on": str(now + 3600),
        }},
        "IdToken": {},
        "AppMetadata": {},
    }
    os.makedirs(os.path.join(home, ".IdentityService"), exist_ok=True)
    with open(os.path.join(home, ".IdentityService", "msal.cache.nocae"), "w") as f:
        json.dump(cache, f)


# --------------------------------------------------------------- the report


def median(values):
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def fmt(values):
    if not values:
        return "n/a"
    return f"{median(values):.1f} (max {max(values):.1f})"


def versions():
    from importlib import metadata

    found = []
    for name in ("boto3", "botocore", "azure-identity", "azure-core", "msal", "google-auth", "requests", "urllib3"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(found)


def report(directory, quick):
    import glob
    import json

    samples = {}  # (run, sdk) -> list of dicts
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        run, sdk, _round = os.path.basename(path)[: -len(".json")].split("+")
        with open(path) as f:
            sample = json.loads(f.read())
        with open(path[: -len(".json")] + ".wall") as f:
            sample["process_ms"] = float(f.read())
        samples.setdefault((run, sdk), []).append(sample)
    exchanges = {}  # (round, sdk) -> dict
    ex_path = os.path.join(directory, "exchanges.tsv")
    if os.path.exists(ex_path):
        with open(ex_path) as f:
            for line in f:
                rnd, sdk, *counts = line.split()
                exchanges[(rnd, sdk)] = tuple(float(c) for c in counts)
    meta = {}
    with open(os.path.join(directory, "meta")) as f:
        for line in f:
            k, _, v = line.rstrip("\n").partition("=")
            meta[k] = v

    def col(run, sdk, key):
        return [s[key] for s in samples.get((run, sdk), [])]

    out = ["## Real SDK view", ""]
    out.append(
        f"Each figure is the median (and max) of {meta['samples']} samples, each a fresh Python process. "
        "*import*: importing the SDK; *first credential*: from the SDK's default credential object to holding "
        "a valid token (for boto3 this includes creating the Session). *Cold*: a freshly started `lanyard dev` "
        "whose cache is empty for that cloud, so the request causes the upstream exchange; *warm*: a new process "
        "asking the same `lanyard dev` again (a cache hit); *floor*: the same SDK reading a static credential "
        "file with the network closed. All times in ms."
    )
    out.append("")
    out.append("| SDK | import ms | cold first credential ms | warm ms | floor ms | warm/floor |")
    out.append("|---|---:|---:|---:|---:|---:|")
    for sdk in SDKS:
        imports = col("cold", sdk, "import_ms") + col("warm", sdk, "import_ms") + col("floor", sdk, "import_ms")
        warm = col("warm", sdk, "credential_ms")
        floor = col("floor", sdk, "credential_ms")
        ratio = f"{median(warm) / median(floor):.1f}" if warm and floor and median(floor) > 0 else "n/a"
        out.append(
            f"| {sdk} | {fmt(imports)} | {fmt(col('cold', sdk, 'credential_ms'))} | {fmt(warm)} | {fmt(floor)} | {ratio} |"
        )
    out.append("")
    out.append("Whole process, interpreter start to exit (what a pod's start-up pays), median ms:")
    out.append("")
    out.append("| SDK | cold | warm | floor | warm - floor |")
    out.append("|---|---:|---:|---:|---:|")
    for sdk in SDKS:
        c, w, fl = (col(run, sdk, "process_ms") for run in ("cold", "warm", "floor"))
        diff = f"{median(w) - median(fl):+.1f}" if w and fl else "n/a"
        out.append(
            f"| {sdk} | {median(c):.1f} | {median(w):.1f} | {median(fl):.1f} | {diff} |"
            if c and w and fl else f"| {sdk} | n/a | n/a | n/a | n/a |"
        )
    out.append("")

    notes = []
    notes.append(
        "What obtains the credential. Through Lanyard, each process gets only `lanyard dev`'s exports plus "
        "PATH, HOME (an empty directory) and LANG. "
        "boto3: `boto3.Session().get_credentials().get_frozen_credentials()` (the default chain reaches the "
        "container provider, AWS_CONTAINER_CREDENTIALS_FULL_URI). azure-identity: `DefaultAzureCredential` "
        "with the developer-tool credentials excluded, as in tests/python/test_azure_identity.py, "
        "`get_token(\"https://storage.azure.com/.default\")`; its ManagedIdentityCredential takes the App "
        "Service flavour (IDENTITY_ENDPOINT/IDENTITY_HEADER) through MSAL. google-auth: "
        "`google.auth.default()` (GCE metadata detection: a ping of GCE_METADATA_IP, then the project id) "
        "and `credentials.refresh(Request())` (the service account's info, then its token)."
    )
    notes.append(
        "The floors, each the SDK's own code reading a file, no network (every IP connect raises). "
        "boto3: AWS_SHARED_CREDENTIALS_FILE with static keys, the same `Session().get_credentials()` call. "
        "azure-identity has no static-file credential; the closest is `SharedTokenCacheCredential()`, which "
        "reads the MSAL token cache file (`~/.IdentityService/msal.cache.nocae`, plaintext, as developer tools "
        "leave it) and returns a still-valid cached access token for the scope. google-auth: "
        "`google.auth.default()` with GOOGLE_APPLICATION_CREDENTIALS naming an `authorized_user` JSON that "
        "holds a token and its expiry (`google.oauth2.credentials.Credentials`), plus GOOGLE_CLOUD_PROJECT; "
        "the credential is valid, so no refresh. The same check (`if not creds.valid: refresh`) runs on both "
        "paths."
    )
    notes.append(
        "warm/floor compares the credential step only; both are small next to the import, which is the same "
        "with or without Lanyard. The second table adds interpreter start-up and exit (measured by the "
        "wrapper around `env -i python`). The credential step is not only the request: it includes what the SDK does "
        "first on both paths (boto3 builds its botocore Session, registering its built-in event handlers; "
        "google-auth's `default()` imports `google.oauth2.credentials` and `compute_engine` lazily; "
        "azure-identity imports msal-extensions lazily for the floor's cache). Through Lanyard, boto3 and "
        "azure-identity make one HTTP request; google-auth makes four (`default()`: the detection ping "
        "and the project id, on a requests session of its own; `refresh()`: the service account's info, "
        "then its token), which is most of its warm/floor."
    )
    cold_minus_warm = []
    for sdk in SDKS:
        c, w = col("cold", sdk, "credential_ms"), col("warm", sdk, "credential_ms")
        if c and w:
            cold_minus_warm.append(f"{sdk} {median(c) - median(w):.1f}")
    if cold_minus_warm:
        latency = int(meta["upstream_latency_ms"])
        notes.append(
            f"cold minus warm (medians, ms): {', '.join(cold_minus_warm)}. Of this, the emulated upstream "
            f"latency accounts for {latency} ms for boto3 (STS AssumeRoleWithWebIdentity) and azure-identity "
            f"(the Entra token endpoint) and {2 * latency} ms for google-auth (two calls); the rest is "
            "Lanyard's exchange work (the projected service account token, the emulators' answers, filling "
            "the cache)."
        )
    # Cold and warm checks, from lanyard's own metrics.
    cold_bad, warm_bad, retried, per_sdk_cold = [], [], [], {}
    for (rnd, sdk), (cold_up, cold_asked, cold_hits, warm_up, warm_asked, warm_hits) in sorted(exchanges.items()):
        per_sdk_cold.setdefault(sdk, set()).add(int(cold_up))
        if cold_up < 1:
            cold_bad.append(f"{sdk} round {rnd}")
        if warm_up != 0 or warm_hits < 1:
            warm_bad.append(f"{sdk} round {rnd} ({warm_up:g} upstream exchanges, {warm_hits:g} cache hits)")
        if cold_asked != 1 or warm_asked != 1:
            retried.append(f"{sdk} round {rnd} (cold {cold_asked:g}, of which {cold_hits:g} cache hits; warm {warm_asked:g})")
    if exchanges:
        counts = ", ".join(f"{sdk} {'/'.join(str(c) for c in sorted(v))}" for sdk, v in sorted(per_sdk_cold.items()))
        notes.append(
            "Checked on `lanyard dev`'s /metrics in every round: each cold sample caused upstream exchanges "
            f"(`lanyard_upstream_requests_total` for its cloud: {counts}; google-auth's one exchange is two "
            "upstream calls, STS then IAM Credentials `generateAccessToken`) and each warm sample none, with a "
            "cache hit."
            + (" Each sample asked Lanyard for its credential exactly once (one of `lanyard_cache_{hits,misses,"
               "coalesced,negative_hits}_total`): no SDK retried." if not retried else "")
            + (f" **Not as expected**: cold without an exchange: {', '.join(cold_bad)}." if cold_bad else "")
            + (f" **Not as expected**: warm not served from the cache: {', '.join(warm_bad)}." if warm_bad else "")
            + (" **Not as expected**: an SDK asked for its credential more than once (it retried, e.g. after "
               f"its own timeout): {', '.join(retried)}." if retried else "")
        )
    same, differ = 0, []
    for sdk in SDKS:
        cold_by_round = {}
        for path in sorted(glob.glob(os.path.join(directory, f"cold+{sdk}+*.json"))):
            rnd = path.rsplit("+", 1)[1][: -len(".json")]
            with open(path) as f:
                cold_by_round[rnd] = json.loads(f.read())["fingerprint"]
        for path in sorted(glob.glob(os.path.join(directory, f"warm+{sdk}+*.json"))):
            rnd = path.rsplit("+", 1)[1][: -len(".json")]
            with open(path) as f:
                fp = json.loads(f.read())["fingerprint"]
            if cold_by_round.get(rnd) == fp:
                same += 1
            else:
                differ.append(f"{sdk} round {rnd}")
    notes.append(
        f"Every warm sample received the very credential its round's cold sample had caused ({same} of "
        f"{same + len(differ)})." if not differ else
        f"**Not as expected**: a warm sample received another credential than its cold sample: {', '.join(differ)}."
    )
    kinds = {}
    for (run, sdk), lst in samples.items():
        for s in lst:
            kinds.setdefault((sdk, run), set()).add(s["kind"])
    notes.append(
        "Credential sources reported by the SDKs: "
        + "; ".join(
            f"{sdk} {run}: {', '.join(sorted(kinds[(sdk, run)]))}"
            for sdk in SDKS for run in ("warm", "floor") if (sdk, run) in kinds
        )
        + "."
    )
    starts = [s["start_ms"] for lst in samples.values() for s in lst]
    notes.append(
        f"Upstream latency added by the emulators: {meta['upstream_latency_ms']} ms per upstream call "
        "(BENCH_UPSTREAM_LATENCY_MS, as bench/run's cold herds; real Entra ID and STS answer in tens to "
        "hundreds of ms). Lanyard runs as a user runs it: `lanyard dev` with its default configuration and "
        "log level (the audit record of each credential included). An unreported first pass loads the "
        "interpreter, the SDKs and their .pyc into the page cache: on a cold page cache the first import "
        "can take seconds, not hundreds of ms."
    )
    notes.append(
        f"Machine: {meta['cores']} cores, shared; {meta['lanyard_version']}; Python "
        f"{sys.version.split()[0]}; {versions()}. Absolute figures move by tens of percent between runs on this machine; "
        f"the samples run round-robin (cold, warm, floor for each SDK in each round) so that drift hits all "
        f"columns alike. The measured script's own start-up before the SDK import: median "
        f"{median(starts):.1f} ms."
    )
    if quick == "1":
        notes.append("`--quick`: 2 samples each, to check the script still runs; do not read the figures.")
    out.append("Notes:")
    out.append("")
    for n in notes:
        out.append(f"- {n}")
    failures = sorted(glob.glob(os.path.join(directory, "*.failed")))
    if failures:
        out += ["", "**Could not be measured** (bench/sdk exits 1); each SDK stops at its first failure:", ""]
        for path in failures:
            run, sdk, rnd = os.path.basename(path)[: -len(".failed")].split("+")
            with open(path) as f:
                text = f.read().strip()
            try:
                text = json.loads(text.splitlines()[-1])["error"]
            except (ValueError, KeyError, IndexError):
                pass  # not the client's JSON: the end of its stderr
            out += [f"- {sdk}, {run} sample (round {rnd}):", "", "  ```"]
            out += [f"  {line}" for line in text.splitlines()] + ["  ```"]
    print("\n".join(out))


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "measure" and sys.argv[2] in SDKS and sys.argv[3] in ("lanyard", "floor"):
        measure(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "floor-files":
        floor_files(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "report":
        report(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
