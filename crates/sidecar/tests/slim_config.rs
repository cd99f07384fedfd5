//! What the slim `lanyard-sidecar` reads of a configuration: the same file
//! every role reads, of which it checks its own keys and leaves the other
//! roles' sections unread; a key it does not know is still refused, naming
//! the key and where it came from.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const SIDECAR: &str = env!("CARGO_BIN_EXE_lanyard-sidecar");

/// A file every role could be given: the agent's sections included.
const FULL_FILE: &str = "\
log_level: debug
admin_listen: 127.0.0.1:0
cache:
  max_entries: 5000
cluster:
  issuer: https://issuer.example
  node_name: node-a
policy:
  dir: /etc/lanyard/policies
audit:
  cluster: prod-eu
webhook:
  sidecar_port: 8642
azure:
  tenant_id: 3b8e4f60-1c2d-4e5f-8a9b-7c6d5e4f3a2b
  audience: api://AzureADTokenExchange
gcp:
  project_number: '123456789012'
aws:
  region: eu-west-1
  session_duration: 3600
";

/// Runs the sidecar with `file` as its configuration until it says it
/// serves (`Ok`) or exits (`Err` with its status and stderr).
fn start_with(file: &str, extra_env: &[(&str, &str)]) -> Result<(), (Option<i32>, String)> {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("lanyard.yaml");
    std::fs::write(&config, file).unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::create_dir(&tokens).unwrap();
    let mut child = Command::new(SIDECAR)
        .args(["--config", config.to_str().unwrap()])
        .args(["--listen", "127.0.0.1:0", "--agent", "http://127.0.0.1:1"])
        .args(["--token-dir", tokens.to_str().unwrap()])
        .envs(extra_env.iter().copied())
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (lines, seen) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                return;
            }
        }
    });
    let mut said = String::new();
    while let Ok(line) = seen.recv_timeout(Duration::from_secs(20)) {
        if line.contains("lanyard sidecar serving") {
            child.kill().unwrap();
            child.wait().unwrap();
            return Ok(());
        }
        said.push_str(&line);
        said.push('\n');
    }
    let status = child.wait().unwrap();
    Err((status.code(), said))
}

#[test]
fn a_file_with_every_roles_sections_serves() {
    start_with(FULL_FILE, &[]).expect("the slim sidecar takes the whole file");
}

#[test]
fn unknown_keys_and_bad_values_it_reads_are_refused_naming_them() {
    /// A file, the environment beside it, and what the refusal names.
    type Case = (
        String,
        &'static [(&'static str, &'static str)],
        &'static [&'static str],
    );
    let cases: [Case; 4] = [
        (
            format!("{FULL_FILE}cahce:\n  max_entries: 1\n"),
            &[],
            &["cahce"],
        ),
        (
            format!("{FULL_FILE}sidecar:\n  agnet_url: http://127.0.0.1:8700\n"),
            &[],
            &["agnet_url"],
        ),
        (
            FULL_FILE.to_string(),
            &[("LANYARD_AWS_REGION", "not a region")],
            &["aws.region", "not a region"],
        ),
        (
            FULL_FILE.replace("tenant_id: 3b8e", "tenant_id: bad/tenant 3b8e"),
            &[],
            &["azure.tenant_id"],
        ),
    ];
    for (file, env, named) in cases {
        let (code, said) = start_with(&file, env).expect_err("refused");
        assert_eq!(code, Some(2), "a configuration error: {said}");
        for name in named {
            assert!(said.contains(name), "{name} not named in: {said}");
        }
    }
}
