"""A kubelet-like harness: Lanyard's roles and mutated pods run the way a
cluster runs them, each in network namespaces of its own.

Topology (every address lives only in namespaces this harness creates):

    api ns      br0 10.250.0.1/24: lanyard-fake-kube (the API server, the
                issuer, the clouds' token services at .11 Entra, .12 Google,
                .13 AWS, over TLS under their real names) and the webhook
    node ns i   eth0 10.250.0.(2+i) on br0: the agent, started from the
                rendered DaemonSet container (reachVia hostPort, so it owns
                the node's address); cbr0 10.251.i.1/24, the pods' gateway
    pod ns      eth0 10.251.i.(10+k): the pod's own loopback and address

A pod is what the API server stores after admission: the template is
created through the fake API server (`lanyard-fake-kube`), whose admission
chain runs as kube-apiserver's does (the built-in plugins, the chart's
webhooks and ValidatingAdmissionPolicy, the mesh injector registered beside
them, with reinvocation; see tests/fake-kube/src/admission). Then, as the
kubelet does: projected tokens minted by the fake API server
for that pod are written with the kubelet's atomic writer (a `..data`
symlink swapped per update) and rotated at 80% of their lifetime; init
containers run in order, the native sidecar is started, its postStart
hook run in it, and the app containers start only once that hook has
returned (and a startupProbe passed, for sidecars that have one, probed
from the node's namespace at the pod's IP); each container runs with its own env
(`$(VAR)` expanded, downward-API fields filled), its volumes bind-mounted at
their mount paths in a mount namespace of its own, its `hostAliases` in the
pod's hosts file, and its user, groups, capabilities and no-new-privs from
its security context. App containers run a real SDK script instead of
their image's command.

Nothing trusts an address given by hand: the agent finds the clouds under
their real names (the node's hosts file) and trusts them through its trust
store (the node's CA bundle, with the emulators' CA appended, bind-mounted
over the system bundle); SDKs see only the injected environment.
"""

from __future__ import annotations

import base64
import ctypes
import http.client
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from conftest import ROOT, stop_process

API_IP = "10.250.0.1"
IMDS_IP = "169.254.169.254"
CLOUD_IPS = {"azure": "10.250.0.11", "gcp": "10.250.0.12", "aws": "10.250.0.13"}
CLOUD_NAMES = {
    "azure": ["login.microsoftonline.com"],
    "gcp": ["sts.googleapis.com", "iamcredentials.googleapis.com"],
    "aws": ["sts.us-east-1.amazonaws.com"],
}
SYSTEM_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def can_create_namespaces() -> str | None:
    """None when this machine lets us create network namespaces, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("setpriv") is None:
        return "iproute2 (ip) and util-linux (setpriv) are needed"
    name = f"lkprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` is not permitted here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


@contextmanager
def entered(ns: str):
    """The calling thread in network namespace `ns`: sockets opened inside
    stay in it after the block ends."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
        try:
            yield
        finally:
            if _libc.setns(own, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(own)
        os.close(target)


class Response:
    def __init__(self, status: int, headers: dict, body: bytes):
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        return json.loads(self.body)


def request(ns: str, method: str, url: str, *, body=None, headers=None, timeout: float = 10.0,
            tls: ssl.SSLContext | None = None, server_hostname: str | None = None) -> Response:
    """One HTTP/1.1 request from inside network namespace `ns`."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    with entered(ns):
        sock = socket.create_connection((parts.hostname, port), timeout=timeout)
    if parts.scheme == "https":
        sock = (tls or ssl.create_default_context()).wrap_socket(
            sock, server_hostname=server_hostname or parts.hostname)
    conn = http.client.HTTPConnection(parts.hostname, port, timeout=timeout)
    conn.sock = sock
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    hdrs = {"Content-Type": "application/json"} if isinstance(body, (dict, list)) else {}
    hdrs.update(headers or {})
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    try:
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return Response(resp.status, dict(resp.getheaders()), resp.read())
    finally:
        conn.close()


class Process:
    """A process started in a namespace, its output in a log file."""

    def __init__(self, argv: list[str], log: Path, env: dict | None = None, stdout=None):
        self.log_path = log
        self.log = open(log, "ab")
        self.argv = argv
        self.proc = subprocess.Popen(argv, env=env, stdout=stdout or self.log, stderr=self.log,
                                     start_new_session=True)

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> int:
        code = stop_process(self.proc, timeout)
        self.log.close()
        return code

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


class Cluster:
    """The namespaces, links and processes of one harness run. `close()`
    stops every process and removes every namespace, also after a failure."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        # World-readable: containers run as their own users.
        os.chmod(workdir, 0o755)
        self.tag = f"lk{uuid.uuid4().hex[:5]}"
        self.namespaces: list[str] = []
        self.processes: list[Process] = []
        self.nodes: list[Node] = []
        self.api = self.netns("api")
        ip("-n", self.api, "link", "add", "br0", "type", "bridge")
        # INVARIANT: every bridge has a MAC address of its own. A bridge
        # without one takes the lowest of its ports' and changes it when a
        # port joins (a new pod, node or webhook replica); every neighbour's
        # ARP entry for the gateway then points at the old address, and the
        # path is dead until it expires (about 30 s: the agent unreachable
        # from a pod that had just reached it).
        ip("-n", self.api, "link", "set", "br0", "address", "02:00:0a:fa:00:01")
        ip("-n", self.api, "addr", "add", f"{API_IP}/24", "dev", "br0")
        for addr in CLOUD_IPS.values():
            ip("-n", self.api, "addr", "add", f"{addr}/24", "dev", "br0")
        ip("-n", self.api, "link", "set", "br0", "up")
        # The node pool's IMDS (lanyard-fake-kube --imds), which every node
        # routes to, as an Azure node reaches its own: reachable from the
        # nodes and from their pods alike, as on AKS.
        ip("-n", self.api, "addr", "add", f"{IMDS_IP}/32", "dev", "lo")
        # The NetworkPolicies the cluster enforces (set by the caller from
        # the rendered chart; see `Node.enforce`).
        self.network_policies: list[dict] = []

    def netns(self, role: str, hosts: str | None = None) -> str:
        name = f"{self.tag}-{role}"
        ip("netns", "add", name)
        self.namespaces.append(name)
        ip("-n", name, "link", "set", "lo", "up")
        etc = Path("/etc/netns") / name
        etc.mkdir(parents=True, exist_ok=True)
        # `ip netns exec` bind-mounts these over /etc/hosts (and resolv.conf).
        (etc / "hosts").write_text(hosts or "127.0.0.1\tlocalhost\n::1\tlocalhost\n")
        return name

    def start(self, ns: str, argv: list[str], log: str, env: dict | None = None, stdout=None) -> Process:
        proc = Process(["ip", "netns", "exec", ns, *argv], self.workdir / log, env, stdout)
        self.processes.append(proc)
        return proc

    def add_host(self, role: str, address: str) -> str:
        """A namespace of its own on br0 at `address`: another pod of the
        control plane (a second webhook replica)."""
        ns = self.netns(role)
        peer = f"h{len(self.namespaces)}"
        ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", peer, "netns", self.api)
        ip("-n", self.api, "link", "set", peer, "master", "br0", "up")
        ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        return ns

    def add_node(self, name: str) -> "Node":
        index = len(self.nodes)
        hosts = "127.0.0.1\tlocalhost\n" + "".join(
            f"{CLOUD_IPS[cloud]}\t{host}\n" for cloud, names in CLOUD_NAMES.items() for host in names)
        ns = self.netns(f"n{index}", hosts)
        address = f"10.250.0.{2 + index}"
        ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", f"n{index}", "netns", self.api)
        ip("-n", self.api, "link", "set", f"n{index}", "master", "br0", "up")
        ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "add", "cbr0", "type", "bridge")
        ip("-n", ns, "link", "set", "cbr0", "address", f"02:00:0a:fb:{index:02x}:01")
        ip("-n", ns, "addr", "add", f"10.251.{index}.1/24", "dev", "cbr0")
        ip("-n", ns, "link", "set", "cbr0", "up")
        subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"], check=True)
        # IMDS through the api namespace, and back to this node's pods.
        ip("-n", ns, "route", "add", f"{IMDS_IP}/32", "via", API_IP)
        ip("-n", self.api, "route", "add", f"10.251.{index}.0/24", "via", address)
        # Pod networks of the other nodes, through their nodes (one flat
        # cluster network: any pod can reach any node, as in most CNIs).
        for other in self.nodes:
            ip("-n", ns, "route", "add", f"10.251.{other.index}.0/24", "via", other.address)
            ip("-n", other.ns, "route", "add", f"10.251.{index}.0/24", "via", address)
        node = Node(self, name, index, ns, address)
        self.nodes.append(node)
        return node

    def close(self) -> list[str]:
        """Stops everything; returns the logs of processes that did not exit
        cleanly on SIGTERM (for the caller to report)."""
        problems = []
        for proc in reversed(self.processes):
            if proc.running():
                code = proc.stop()
                if code not in (0, -signal.SIGTERM):
                    problems.append(f"{proc.argv}: exit {code}")
        for ns in reversed(self.namespaces):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        return problems


def selector_matches(selector: dict | None, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (absent or empty: everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def egress_allowed(policies: list[dict], namespace: str, labels: dict[str, str], address: str) -> bool:
    """Whether NetworkPolicy lets a pod of `namespace` with `labels` send to
    `address`: a pod no Egress policy selects may; a selected one only when
    some rule of a selecting policy allows it (policies add up). Only
    `ipBlock` peers are modelled (anything else is refused here, loudly,
    rather than guessed at)."""
    target = ipaddress.ip_address(address)
    selecting = [p for p in policies if p["kind"] == "NetworkPolicy" and p["metadata"].get("namespace") == namespace
                 and "Egress" in p["spec"].get("policyTypes", []) and selector_matches(p["spec"]["podSelector"], labels)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("egress", []):
            peers = rule.get("to")
            if not peers:
                return True
            for peer in peers:
                assert set(peer) == {"ipBlock"}, f"NetworkPolicy peer not modelled by the harness: {peer}"
                block = peer["ipBlock"]
                net = ipaddress.ip_network(block["cidr"])
                if target.version == net.version and target in net and not any(
                        target in ipaddress.ip_network(e) for e in block.get("except", [])):
                    return True
    return False


class Node:
    def __init__(self, cluster: Cluster, name: str, index: int, ns: str, address: str):
        self.cluster, self.name, self.index, self.ns, self.address = cluster, name, index, ns, address
        self.pods = 0
        self.filter = False

    def enforce(self, namespace: str, labels: dict[str, str], pod_ip: str) -> None:
        """What a CNI that enforces egress NetworkPolicy does for a pod of
        this node: traffic the cluster's policies do not allow is dropped
        where it leaves the pod for the node (modelled for the node's IMDS,
        the one address the chart's policies name)."""
        if egress_allowed(self.cluster.network_policies, namespace, labels, IMDS_IP):
            return
        nft = ["ip", "netns", "exec", self.ns, "nft"]
        if not self.filter:
            subprocess.run([*nft, "add table inet harness"], check=True)
            subprocess.run([*nft, "add chain inet harness forward { type filter hook forward priority 0; policy accept; }"],
                           check=True)
            self.filter = True
        subprocess.run([*nft, f"add rule inet harness forward ip saddr {pod_ip} ip daddr {IMDS_IP} counter drop"],
                       check=True)

    def pod_network(self, hosts_extra: str) -> tuple[str, str]:
        """A pod's namespace on this node and its IP."""
        k = self.pods
        self.pods += 1
        pod_ip = f"10.251.{self.index}.{10 + k}"
        hosts = f"127.0.0.1\tlocalhost\n::1\tlocalhost\n{hosts_extra}"
        ns = self.cluster.netns(f"n{self.index}p{k}", hosts)
        ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", f"p{k}", "netns", self.ns)
        ip("-n", self.ns, "link", "set", f"p{k}", "master", "cbr0", "up")
        ip("-n", ns, "addr", "add", f"{pod_ip}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "route", "add", "default", "via", f"10.251.{self.index}.1")
        return ns, pod_ip


def trust_bundle(workdir: Path, extra_ca: Path) -> Path:
    """The node's CA bundle with the emulated clouds' CA appended, as an
    image or node would carry a private CA."""
    bundle = workdir / "ca-bundle.crt"
    bundle.write_text(SYSTEM_BUNDLE.read_text() + "\n" + extra_ca.read_text())
    bundle.chmod(0o644)
    return bundle


def with_trust_store(bundle: Path) -> list[str]:
    """A command prefix that bind-mounts `bundle` over the system bundle in
    the process's own mount namespace (`ip netns exec` makes one)."""
    return ["sh", "-c", 'mount --bind "$0" /etc/ssl/certs/ca-certificates.crt && exec "$@"', str(bundle)]


def with_service_account(directory: Path, ca_pem: str, namespace: str) -> list[str]:
    """A command prefix that mounts what the ServiceAccount admission
    plugin's `kube-api-access-*` volume gives a container at
    /var/run/secrets/kubernetes.io/serviceaccount (`ca.crt`, the cluster
    CA; `namespace`), read-only, on a /run of the process's own (the
    role's API token stays in its kubeconfig)."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o755)
    (directory / "ca.crt").write_text(ca_pem)
    (directory / "namespace").write_text(namespace)
    target = "/run/secrets/kubernetes.io/serviceaccount"
    script = "\n".join(["set -e", "mount -t tmpfs -o mode=0755 tmpfs /run", f"mkdir -p {target}",
                        f'mount --bind "$0" {target}', f"mount -o remount,bind,ro {target}", 'exec "$@"'])
    return ["sh", "-c", script, str(directory)]


class FakeKubeProcess:
    """`lanyard-fake-kube` with the clouds, in the api namespace."""

    def __init__(self, cluster: Cluster, binary: Path, clouds: dict):
        self.cluster = cluster
        d = cluster.workdir / "kube"
        d.mkdir()
        config = d / "clouds.json"
        config.write_text(json.dumps({
            **clouds,
            "tls": {"names": [n for names in CLOUD_NAMES.values() for n in names],
                    **{cloud: f"{addr}:443" for cloud, addr in CLOUD_IPS.items()}},
        }))
        self.proc = cluster.start(cluster.api, [str(binary), "--dir", str(d), "--host", API_IP,
                                                "--clouds", str(config), "--imds", f"{IMDS_IP}:80"],
                                  "fake-kube.log",
                                  stdout=subprocess.PIPE)
        line = self.proc.proc.stdout.readline()
        if not line:
            raise AssertionError(f"lanyard-fake-kube did not start: {self.proc.output()}")
        self.info = json.loads(line)
        self.kubeconfig = self.info["kubeconfig"]
        self.clouds_ca = Path(self.info["clouds_ca"])
        os.chmod(d, 0o755)
        # The API over HTTPS, as the administrator (pod writes go through
        # its admission chain), the cluster CA and the mesh injector.
        self.api_https = self.info["api_https"]
        self.admin_kubeconfig = self.info["admin_kubeconfig"]
        self.ca_pem = Path(self.info["ca"]).read_text()
        self.mesh_injector = self.info["mesh_injector"]
        self.issuer = self.info["issuer"]
        import yaml

        admin = yaml.safe_load(Path(self.admin_kubeconfig).read_text())
        self._admin_token = admin["users"][0]["user"]["token"]
        self._tls = ssl.create_default_context(cadata=self.ca_pem)

    def api(self, method: str, path: str, body=None, content_type: str = "application/json") -> Response:
        """A request to the API as the administrator."""
        data = json.dumps(body).encode() if body is not None else None
        return request(self.cluster.api, method, self.api_https + path, body=data, tls=self._tls, timeout=60,
                       headers={"Authorization": f"Bearer {self._admin_token}", "Content-Type": content_type,
                                "Accept": "application/json"})

    def create_pod(self, pod: dict) -> dict:
        """`POST pods` as a controller creates a pod: the stored pod after
        the API server's admission, or `Refused`."""
        r = self.api("POST", f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods", pod)
        if r.status != 201:
            raise Refused(r.json())
        return r.json()

    def kubectl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """kubectl as the administrator, from the API server's namespace."""
        home = self.cluster.workdir / "kubectl-home"
        home.mkdir(exist_ok=True)
        return subprocess.run(["ip", "netns", "exec", self.cluster.api, "kubectl", "--kubeconfig",
                               self.admin_kubeconfig, *args], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "HOME": str(home)})

    def set_endpoints(self, namespace: str, name: str, addresses: list[str]) -> None:
        r = self.control("POST", "/endpoints", {"namespace": namespace, "name": name, "addresses": addresses})
        assert r.status == 200, r.body

    def webhook_calls(self) -> list[str]:
        return self.control("GET", "/admission/calls").json()["calls"]

    def control(self, method: str, path: str, body=None) -> Response:
        return request(self.cluster.api, method, self.info["control"] + path, body=body)

    def apply(self, obj: dict) -> dict:
        r = self.control("POST", "/apply", obj)
        assert r.status == 200, r.body
        return r.json()

    def delete(self, kind: str, namespace: str, name: str) -> None:
        r = self.control("DELETE", f"/objects/{kind}/{namespace}/{name}")
        assert r.status == 200, r.body

    def token(self, namespace: str, pod: str, audience: str, expiration: int) -> str:
        r = self.control("POST", "/token", {"namespace": namespace, "pod": pod, "audiences": [audience],
                                            "expiration_seconds": expiration})
        assert r.status == 200, r.body
        return r.json()["token"]

    def whois(self, credential: str) -> dict | None:
        from urllib.parse import quote

        r = self.control("GET", "/clouds/whois?credential=" + quote(credential, safe=""))
        return r.json() if r.status == 200 else None

    def counts(self) -> dict:
        return self.control("GET", "/clouds/counts").json()

    def aws_sessions(self) -> list[dict]:
        return self.control("GET", "/clouds/aws/sessions").json()


def expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion: references to defined variables are
    replaced, `$$` escapes, anything else is left as written."""
    out, i = [], 0
    while i < len(value):
        if value.startswith("$$", i):
            out.append("$")
            i += 2
        elif value.startswith("$(", i) and (end := value.find(")", i)) != -1 and value[i + 2:end] in env:
            out.append(env[value[i + 2:end]])
            i = end + 1
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def atomic_write(directory: Path, files: dict[str, bytes], mode: int, gid: int | None) -> None:
    """The kubelet's AtomicWriter: the payload in a fresh timestamped
    directory, `..data` swapped to it by rename, each file a symlink through
    `..data`, the previous payload removed."""
    directory.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("..%Y_%m_%d_%H_%M_%S.") + uuid.uuid4().hex[:9]
    payload = directory / stamp
    payload.mkdir(mode=0o755)
    for name, data in files.items():
        path = payload / name
        path.write_bytes(data)
        if gid is not None:
            os.chown(path, 0, gid)
        path.chmod(mode)
    data_link = directory / "..data"
    old = os.readlink(data_link) if data_link.is_symlink() else None
    tmp = directory / "..data_tmp"
    if tmp.is_symlink():
        tmp.unlink()
    os.symlink(stamp, tmp)
    os.rename(tmp, data_link)
    for name in files:
        link = directory / name
        if not link.is_symlink():
            os.symlink(f"..data/{name}", link)
    if old:
        shutil.rmtree(directory / old, ignore_errors=True)


def sdk_python_env() -> dict[str, str]:
    """The "image" of an app container: Debian's Python with the SDKs the
    test environment installed (readable by any user, unlike the venv's
    interpreter under /root)."""
    import site

    packages = [p for p in site.getsitepackages() if "site-packages" in p]
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": ":".join(packages),
            "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/"}


SDK_PYTHON = "/usr/bin/python3"
SDK_SCRIPT = ROOT / "tests" / "python" / "pod_sdk.py"

# The capabilities container runtimes (containerd, CRI-O) grant by default.
DEFAULT_CAPS = ["chown", "dac_override", "fowner", "fsetid", "kill", "setgid", "setuid", "setpcap",
                "net_bind_service", "net_raw", "sys_chroot", "mknod", "audit_write", "setfcap"]


class Refused(Exception):
    """The API server refused a write: its Status. `webhook` names the
    webhook or ValidatingAdmissionPolicy that denied it, when one did."""

    def __init__(self, status: dict):
        message = status.get("message", "")
        named = (re.search(r'admission webhook "([^"]+)"', message)
                 or re.search(r"ValidatingAdmissionPolicy '([^']+)'", message))
        super().__init__(f"{status.get('code')} {status.get('reason')}: {message}")
        self.webhook = named.group(1) if named else None
        self.status = status


ADMISSION_KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
                   "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


def mesh_configuration(kube: "FakeKubeProcess", name: str = "mesh-injector") -> dict:
    """The mesh injector's MutatingWebhookConfiguration (someone else's
    webhook: every pod, `reinvocationPolicy: Never`). Named after
    Lanyard's (`lanyard-webhook`), it runs after Lanyard's, whose
    `IfNeeded` then has it called again."""
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [{"name": "inject.mesh.example", "admissionReviewVersions": ["v1"],
                          "clientConfig": {"url": kube.mesh_injector,
                                           "caBundle": base64.b64encode(kube.ca_pem.encode()).decode()},
                          "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                                     "resources": ["pods"]}],
                          "namespaceSelector": {"matchExpressions": [
                              {"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                               "values": ["kube-system", "lanyard-system"]}]},
                          "failurePolicy": "Fail", "sideEffects": "None", "reinvocationPolicy": "Never"}]}


def install_admission(kube: "FakeKubeProcess", objects: list[dict], endpoints: list[str]) -> None:
    """Registers the rendered chart's admission objects (its webhooks, and
    its ValidatingAdmissionPolicy and binding when rendered) with the fake
    API server, and the webhook Service's ready `endpoints` (`IP:PORT`), as
    `helm install` and the endpoints controller would."""
    for obj in objects:
        if obj["kind"] in ADMISSION_KINDS:
            kube.apply(obj)
    service = next(o for o in objects if o["kind"] == "MutatingWebhookConfiguration")
    ref = service["webhooks"][0]["clientConfig"]["service"]
    kube.set_endpoints(ref["namespace"], ref["name"], endpoints)


class Pod:
    """A stored pod run on `node` as the kubelet runs it."""

    def __init__(self, cluster: Cluster, kube: FakeKubeProcess, node: Node, stored: dict, bin_dir: Path,
                 rotate_every: float | None = None):
        self.cluster, self.kube, self.node, self.bin_dir = cluster, kube, node, bin_dir
        self.meta, self.spec = stored["metadata"], stored["spec"]
        self.name, self.namespace = self.meta["name"], self.meta["namespace"]
        hosts = "".join(f"{a['ip']}\t{' '.join(a['hostnames'])}\n" for a in self.spec.get("hostAliases", []))
        self.ns, self.ip = node.pod_network(hosts)
        node.enforce(self.namespace, self.meta.get("labels", {}), self.ip)
        self.dir = cluster.workdir / f"pod-{self.namespace}-{self.name}"
        self.dir.mkdir(mode=0o755)
        self.security = self.spec.get("securityContext", {})
        self.volumes: dict[str, Path] = {}
        self.tokens: dict[str, list[dict]] = {}
        self.projected: dict[str, list[dict]] = {}
        for volume in self.spec.get("volumes", []):
            path = self.dir / "volumes" / volume["name"]
            path.mkdir(parents=True)
            path.chmod(0o755)
            self.volumes[volume["name"]] = path
            if "projected" in volume:
                sources = volume["projected"]["sources"]
                unknown = [s for s in sources if not {"serviceAccountToken", "configMap", "downwardAPI"} & set(s)]
                assert not unknown, f"projected sources not emulated: {unknown}"
                self.projected[volume["name"]] = sources
                self.tokens[volume["name"]] = [s["serviceAccountToken"] for s in sources
                                               if "serviceAccountToken" in s]
            elif "emptyDir" in volume:
                path.chmod(0o777)
            else:
                raise AssertionError(f"volume kind not emulated: {sorted(volume)}")
        self.rotations = 0
        self.write_tokens()
        self.processes: dict[str, Process] = {}
        self.sidecar_started: float | None = None
        self.sidecar_ready: float | None = None
        self._stop = threading.Event()
        self._rotator = None
        if rotate_every is None:
            # The kubelet refreshes a token at 80% of its lifetime.
            lifetimes = [t.get("expirationSeconds", 3600) for ts in self.tokens.values() for t in ts]
            rotate_every = 0.8 * min(lifetimes) if lifetimes else None
        if rotate_every:
            self._rotator = threading.Thread(target=self._rotate_loop, args=(rotate_every,), daemon=True)
            self._rotator.start()

    def projected_file(self, source: dict) -> dict[str, bytes]:
        """The files one projected source gives: a token (without an
        audience, the API server's own, which is its issuer), the cluster's
        `kube-root-ca.crt` ConfigMap, downward-API fields."""
        if "serviceAccountToken" in source:
            t = source["serviceAccountToken"]
            token = self.kube.token(self.namespace, self.name, t.get("audience") or self.kube.issuer,
                                    t.get("expirationSeconds", 3600))
            return {t["path"]: token.encode()}
        if "configMap" in source:
            assert source["configMap"]["name"] == "kube-root-ca.crt", source
            return {i["path"]: self.kube.ca_pem.encode() for i in source["configMap"]["items"]}
        fields = {"metadata.namespace": self.namespace, "metadata.name": self.name}
        return {i["path"]: fields[i["fieldRef"]["fieldPath"]].encode() for i in source["downwardAPI"]["items"]}

    def write_tokens(self) -> None:
        gid = self.security.get("fsGroup")
        for volume, sources in self.projected.items():
            files = {path: data for s in sources for path, data in self.projected_file(s).items()}
            # Projected volumes default to 0644; with an fsGroup the kubelet
            # hands the files to that group.
            atomic_write(self.volumes[volume], files, 0o644 if gid is None else 0o640, gid)
        self.rotations += 1

    def _rotate_loop(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self.write_tokens()
            except Exception:  # noqa: BLE001 - a deleted pod gets no tokens, as with the kubelet
                pass

    def env(self, container: dict) -> dict[str, str]:
        fields = {"status.hostIP": self.node.address, "status.podIP": self.ip, "spec.nodeName": self.node.name,
                  "metadata.name": self.name, "metadata.namespace": self.namespace,
                  "metadata.uid": self.meta.get("uid", ""),
                  "spec.serviceAccountName": self.spec.get("serviceAccountName", "default")}
        values: dict[str, str] = {}
        for var in container.get("env", []):
            if "value" in var:
                values[var["name"]] = expand(var["value"], values)
            elif "fieldRef" in var.get("valueFrom", {}):
                values[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
            else:
                raise AssertionError(f"env source not emulated: {var}")
        return values

    def wrapper(self, container: dict) -> list[str]:
        """`sh -c` that mounts the container's volumes at their paths and
        execs the argv after it as the container's user."""
        sc = {**{k: v for k, v in self.security.items() if k in ("runAsUser", "runAsGroup")},
              **container.get("securityContext", {})}
        uid, gid = sc.get("runAsUser", 0), sc.get("runAsGroup", 0)
        groups = [g for g in [self.security.get("fsGroup"), *self.security.get("supplementalGroups", [])]
                  if g is not None]
        caps = sc.get("capabilities", {})
        granted = [] if "ALL" in caps.get("drop", []) else [c for c in DEFAULT_CAPS
                                                            if c.upper() not in caps.get("drop", [])]
        granted += [c.lower() for c in caps.get("add", [])]
        setpriv = ["setpriv", f"--reuid={uid}", f"--regid={gid}",
                   f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups",
                   "--inh-caps=-all", "--bounding-set=" + ",".join(["-all", *("+" + c for c in granted)])]
        if sc.get("allowPrivilegeEscalation") is False:
            setpriv.append("--no-new-privs")
        script = ["set -e", "mount -t tmpfs -o mode=0755 tmpfs /run"]
        for m in container.get("volumeMounts", []):
            source = self.volumes[m["name"]] / m.get("subPath", "")
            target = m["mountPath"]
            if target.startswith(("/run/", "/var/run/")):
                script.append(f"mkdir -p '{target}'")
            else:
                assert os.path.isdir(target), f"no mount point {target} on this machine"
            script.append(f"mount --bind '{source}' '{target}'")
            if m.get("readOnly"):
                script.append(f"mount -o remount,bind,ro '{target}'")
        script.append('exec "$@"')
        return ["sh", "-c", "\n".join(script), "container", *setpriv, "--"]

    def start(self, container: dict, argv: list[str], image_env: dict[str, str], stdout: Path | None = None
              ) -> Process:
        env = {**image_env, "HOSTNAME": self.name, **self.env(container)}
        argv = [expand(a, env) for a in argv]
        out = open(stdout, "wb") if stdout else None
        proc = self.cluster.start(self.ns, [*self.wrapper(container), *argv],
                                  f"pod-{self.namespace}-{self.name}-{container['name']}.log", env=env, stdout=out)
        self.processes[container["name"]] = proc
        return proc

    def image_command(self, container: dict) -> list[str]:
        command = container.get("command")
        assert command, f"{container['name']}: the image's entrypoint is not emulated; give a command"
        binary = command[0] if "/" in command[0] else str(self.bin_dir / command[0])
        assert os.path.exists(binary), binary
        return [binary, *command[1:], *container.get("args", [])]

    def start_init_containers(self, timeout: float = 60.0) -> float:
        """Runs init containers in order, as the kubelet does: plain ones to
        completion; a native sidecar is started, then its postStart hook
        runs inside that start (kuberuntime_container.go startContainer:
        StartContainer, then the PostStart handler, synchronously), and the
        next container starts only once the sidecar is running, its hook
        has returned and, if it has a startupProbe, that probe has passed
        (kuberuntime_manager.go computeInitContainerActions). The probe
        worker's first probe comes on its next tick after the container is
        seen running (prober/worker.go doProbe), one period in. Not
        modelled: the PLEG relist (up to 1 s with the generic PLEG) before
        the kubelet sees the container running, which delays the next
        container equally with and without Lanyard's sidecar's hook.
        Returns when the app containers may start."""
        image_env = {"PATH": f"{self.bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": "/"}
        for container in self.spec.get("initContainers", []):
            if container.get("restartPolicy") == "Always":
                self.sidecar_started = time.monotonic()
                proc = self.start(container, self.image_command(container), image_env)
                hook = container.get("lifecycle", {}).get("postStart", {}).get("exec")
                if hook:
                    argv = [a if "/" in a else str(self.bin_dir / a) for a in hook["command"][:1]]
                    done = self.exec(container, argv + hook["command"][1:], image_env, timeout=timeout)
                    assert done.returncode == 0, f"{container['name']}: postStart failed: {done.stderr}"
                    assert proc.running(), f"the sidecar exited: {proc.output()}"
                if "startupProbe" in container:
                    probe = container["startupProbe"]
                    time.sleep(probe.get("periodSeconds", 10))
                    self.wait_for_probe(proc, probe, timeout)
                self.sidecar_ready = time.monotonic()
            else:
                proc = self.start(container, self.image_command(container), image_env)
                code = proc.proc.wait(timeout=timeout)
                assert code == 0, f"init container {container['name']} exited {code}: {proc.output()}"
        return time.monotonic()

    def wait_for_probe(self, proc: Process, probe: dict, timeout: float) -> None:
        get = probe["httpGet"]
        period = probe.get("periodSeconds", 10)
        url = f"http://{self.ip}:{get['port']}{get.get('path', '/')}"
        deadline = time.monotonic() + min(timeout, period * probe.get("failureThreshold", 3))
        while time.monotonic() < deadline:
            assert proc.running(), f"the sidecar exited: {proc.output()}"
            try:
                # The kubelet probes from the node's network namespace.
                r = request(self.node.ns, "GET", url, timeout=probe.get("timeoutSeconds", 1))
                if 200 <= r.status < 400:
                    return
            except OSError:
                pass
            time.sleep(period)
        raise AssertionError(f"startupProbe {url} never passed: {proc.output()}")

    def app_containers(self) -> list[dict]:
        return self.spec["containers"]

    def start_app(self, container: dict, sdk_args: list[str]) -> tuple[Process, Path]:
        """Runs the SDK script in place of the container's image command."""
        out = self.dir / f"{container['name']}.out"
        proc = self.start(container, [SDK_PYTHON, str(SDK_SCRIPT), *sdk_args], sdk_python_env(), stdout=out)
        return proc, out

    def exec(self, container: dict, argv: list[str], image_env: dict | None = None, timeout: float = 60.0
             ) -> subprocess.CompletedProcess:
        """`kubectl exec`: a command in the container's namespaces and env."""
        env = {**(image_env or sdk_python_env()), "HOSTNAME": self.name, **self.env(container)}
        return subprocess.run(["ip", "netns", "exec", self.ns, *self.wrapper(container), *argv], env=env,
                              capture_output=True, text=True, timeout=timeout)

    def stop(self) -> None:
        self._stop.set()
        for proc in self.processes.values():
            if proc.running():
                proc.stop()


def results(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
