//! Transparent mode's redirect installed for real, by the built
//! `lanyard-sidecar redirect`, in a network namespace of its own set up like
//! a pod's (loopback up, a default route out of an interface), and proven
//! the way a client meets it: a connection to `169.254.169.254:80` reaches
//! a listener on `127.0.0.1:PORT`.
//!
//! Needs root (to create network namespaces), `ip` (iproute2), `python3`
//! and `setpriv` (util-linux); `nft` (nftables) too for the ruleset
//! checks, which are skipped without it. Where `ip netns add` is not
//! permitted (not root, no `/run/netns`), the tests say so and pass
//! without running.

use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use serde_json::Value;

const SIDECAR: &str = env!("CARGO_BIN_EXE_lanyard-sidecar");

/// A network namespace, removed on drop (failing tests included).
struct Netns {
    name: String,
}

impl Netns {
    /// A fresh namespace named `lntr-<pid>-<n>`, or `None` (after saying
    /// why) when this machine does not let the test create one.
    fn create() -> Option<Netns> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "lntr-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let out = Command::new("ip")
            .args(["netns", "add", &name])
            .output()
            .expect("ip (iproute2) is needed to create network namespaces");
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            if stderr.contains("not permitted") || stderr.contains("Permission denied") {
                println!(
                    "skipped: `ip netns add` is not permitted here (run as root): {}",
                    stderr.trim()
                );
                return None;
            }
            panic!("ip netns add {name}: {}", stderr.trim());
        }
        Some(Netns { name })
    }

    /// A fresh namespace with `lo` up and a default route out of a second
    /// interface, as a pod has, so that `169.254.169.254` is routable.
    fn pod_like() -> Option<Netns> {
        let ns = Netns::create()?;
        ns.ok(&["ip", "link", "set", "lo", "up"]);
        // A dummy interface where the kernel has the module, else a veth
        // pair with both ends in the namespace: either has a carrier.
        if !ns
            .run(&["ip", "link", "add", "d0", "type", "dummy"])
            .status
            .success()
        {
            ns.ok(&[
                "ip", "link", "add", "d0", "type", "veth", "peer", "name", "d0p",
            ]);
            ns.ok(&["ip", "link", "set", "d0p", "up"]);
        }
        ns.ok(&["ip", "addr", "add", "10.254.0.2/24", "dev", "d0"]);
        ns.ok(&["ip", "link", "set", "d0", "up"]);
        ns.ok(&["ip", "route", "add", "default", "via", "10.254.0.1"]);
        Some(ns)
    }

    /// Runs `argv` inside the namespace (with the default log filter, so
    /// that its log lines are the ones the tests count).
    fn run(&self, argv: &[&str]) -> Output {
        Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args(argv)
            .env_remove("RUST_LOG")
            .output()
            .unwrap_or_else(|e| panic!("ip netns exec {} {argv:?}: {e}", self.name))
    }

    /// Runs `argv` inside the namespace; it must succeed.
    fn ok(&self, argv: &[&str]) -> Output {
        let out = self.run(argv);
        assert!(
            out.status.success(),
            "{argv:?} in {} failed: {}{}",
            self.name,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// `lanyard-sidecar redirect --port PORT` inside the namespace, with
    /// `prefix` (e.g. `setpriv …`) before it.
    fn redirect(&self, prefix: &[&str], port: u16) -> Output {
        let port = port.to_string();
        let mut argv: Vec<&str> = prefix.to_vec();
        argv.extend([SIDECAR, "redirect", "--port", &port]);
        self.run(&argv)
    }

    /// `nft -j list ruleset` inside the namespace, or `None` without nft.
    fn ruleset(&self) -> Option<Vec<Value>> {
        if Command::new("nft").arg("--version").output().is_err() {
            println!("nft (nftables) is not installed: ruleset checks skipped");
            return None;
        }
        let out = self.ok(&["nft", "-j", "list", "ruleset"]);
        let json: Value = serde_json::from_slice(&out.stdout).expect("nft -j prints JSON");
        Some(json["nftables"].as_array().cloned().unwrap_or_default())
    }

    /// Inside the namespace: listen on 127.0.0.1:PORT, connect to
    /// 169.254.169.254:80, and exchange a line. `Ok(peers)` when they meet,
    /// `Err(why)` when the connection fails.
    fn meet(&self, port: u16) -> Result<String, String> {
        let script = r#"
import socket, sys
port = int(sys.argv[1])
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", port))
listener.listen(1)
listener.settimeout(3)
try:
    client = socket.create_connection(("169.254.169.254", 80), timeout=2)
except OSError as e:
    print("connect failed:", e)
    sys.exit(3)
server, peer = listener.accept()
server.sendall(b"lanyard\n")
got = client.recv(64)
print("client sees", client.getpeername(), "server sees", peer[0], "got", got)
"#;
        let out = self.run(&["python3", "-c", script, &port.to_string()]);
        let stdout = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if out.status.success() {
            Ok(stdout)
        } else {
            Err(format!("{stdout} {}", String::from_utf8_lossy(&out.stderr)))
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let out = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
        if !matches!(&out, Ok(o) if o.status.success()) {
            eprintln!("could not remove network namespace {}: {out:?}", self.name);
        }
    }
}

fn text(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The objects of `kind` (`table`, `chain`, `rule`) in `ruleset`.
fn objects<'a>(ruleset: &'a [Value], kind: &str) -> Vec<&'a Value> {
    ruleset.iter().filter_map(|o| o.get(kind)).collect()
}

/// Checks the table, chain and the one rule, redirecting to `port`.
fn assert_ruleset(ruleset: &[Value], port: u16) {
    let tables = objects(ruleset, "table");
    assert_eq!(tables.len(), 1, "{ruleset:#?}");
    assert_eq!(tables[0]["family"], "ip");
    assert_eq!(tables[0]["name"], "lanyard_transparent");
    let chains = objects(ruleset, "chain");
    assert_eq!(chains.len(), 1, "{ruleset:#?}");
    let chain = chains[0];
    assert_eq!(
        (
            &chain["name"],
            &chain["type"],
            &chain["hook"],
            &chain["prio"]
        ),
        (
            &Value::from("output"),
            &Value::from("nat"),
            &Value::from("output"),
            &Value::from(-100)
        ),
        "{chain:#}"
    );
    let rules = objects(ruleset, "rule");
    assert_eq!(rules.len(), 1, "exactly one rule: {ruleset:#?}");
    let expr = rules[0]["expr"].as_array().expect("rule expressions");
    let matches: Vec<(&Value, &Value, &Value)> = expr
        .iter()
        .filter_map(|e| e.get("match"))
        .map(|m| {
            (
                &m["left"]["payload"]["protocol"],
                &m["left"]["payload"]["field"],
                &m["right"],
            )
        })
        .collect();
    assert_eq!(
        matches,
        [
            (
                &Value::from("ip"),
                &Value::from("daddr"),
                &Value::from("169.254.169.254")
            ),
            (&Value::from("tcp"), &Value::from("dport"), &Value::from(80)),
        ],
        "{expr:#?}"
    );
    assert_eq!(
        expr.last().map(|e| &e["redirect"]["port"]),
        Some(&Value::from(port)),
        "{expr:#?}"
    );
}

#[test]
fn connections_to_the_metadata_address_reach_the_loopback_port() {
    let Some(ns) = Netns::pod_like() else { return };
    let port = 8642;

    // Without the rule, nothing answers at 169.254.169.254: the check below
    // can fail.
    let before = ns.meet(port);
    assert!(before.is_err(), "met without the redirect: {before:?}");

    let out = ns.redirect(&[], port);
    assert!(out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "one log line: {stderr}");
    assert!(
        stderr.contains("169.254.169.254:80") && stderr.contains("127.0.0.1:8642"),
        "{stderr}"
    );
    if let Some(ruleset) = ns.ruleset() {
        assert_ruleset(&ruleset, port);
    }

    let met = ns.meet(port).expect("the redirect reaches the listener");
    assert!(
        met.contains("client sees ('169.254.169.254', 80)"),
        "the client believes it talks to the metadata address: {met}"
    );
    assert!(met.contains("got b'lanyard\\n'"), "{met}");
}

#[test]
fn running_again_replaces_the_rule_rather_than_adding_one() {
    let Some(ns) = Netns::pod_like() else { return };
    for port in [9000, 9000, 9001] {
        let out = ns.redirect(&[], port);
        assert!(out.status.success(), "run for {port}: {}", text(&out));
        if let Some(ruleset) = ns.ruleset() {
            assert_ruleset(&ruleset, port);
        }
    }
    // The last run's port is the one that answers.
    ns.meet(9001).expect("the latest redirect is in force");
    assert!(ns.meet(9000).is_err(), "the earlier rule is gone");
}

#[test]
fn without_net_admin_it_fails_and_says_what_is_missing() {
    let Some(ns) = Netns::pod_like() else { return };
    for prefix in [
        // An unprivileged user, as the sidecar runs.
        &[
            "setpriv",
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
        ][..],
        // Root without CAP_NET_ADMIN.
        &["setpriv", "--inh-caps=-all", "--bounding-set=-net_admin"][..],
    ] {
        let out = ns.redirect(prefix, 8642);
        assert!(!out.status.success(), "{prefix:?}: {}", text(&out));
        assert_eq!(out.status.code(), Some(1), "{prefix:?}: {}", text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("CAP_NET_ADMIN") && stderr.contains("network namespace"),
            "{prefix:?}: {stderr}"
        );
        if let Some(ruleset) = ns.ruleset() {
            assert!(
                objects(&ruleset, "table").is_empty(),
                "{prefix:?}: {ruleset:#?}"
            );
        }
    }
    assert!(ns.meet(8642).is_err(), "nothing was installed");
}

#[test]
fn a_zero_port_is_a_usage_error() {
    // Refused by the flag parser before any netlink: safe outside a
    // namespace, and needs none.
    let out = Command::new(SIDECAR)
        .args(["redirect", "--port", "0"])
        .output()
        .expect("run lanyard-sidecar");
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}
