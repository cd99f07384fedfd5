//! The clouds' side of workload identity federation, for the server binary:
//! Entra ID, Google (STS and IAM Credentials) and AWS STS emulators that
//! trust this fake cluster's issuer, set up from one JSON file the way an
//! administrator sets them up in each cloud (a federated credential per
//! app, an IAM binding per Google service account, a trust policy per
//! role).
//!
//! Each emulator fetches the issuer's discovery document and keys over
//! HTTP, as the real services do, so the issuer must be served at a URL
//! the emulators can reach: the server then serves it on a listener of its
//! own and names that URL as the issuer.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use serde::Deserialize;
use serde_json::{json, Value};

use lanyard_emulators::faults::{Fault, Faults};
use lanyard_emulators::{Binding, EmulatorSet, Lifetimes};

/// The `--clouds` file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CloudsConfig {
    /// Entra tenant of every app.
    pub azure_tenant_id: String,
    #[serde(default = "azure_audience")]
    pub azure_audience: String,
    /// The workload identity provider's full name; also the default
    /// audience, as in Google's own configuration.
    pub gcp_provider: String,
    /// GKE's pool instead of the provider: the cluster
    /// (`projects/P/locations/L/clusters/C`); its grants then name GKE's
    /// members (`serviceAccount:P.svc.id.goog[NS/KSA]`).
    #[serde(default)]
    pub gcp_gke_cluster: Option<String>,
    /// The GKE cluster project's number.
    #[serde(default)]
    pub gcp_project_number: Option<String>,
    #[serde(default = "aws_audience")]
    pub aws_audience: String,
    /// Lifetime of access tokens the emulators issue (seconds).
    #[serde(default = "lifetime")]
    pub lifetime_seconds: u64,
    /// Who may federate, one entry per Kubernetes ServiceAccount.
    pub identities: Vec<Identity>,
    /// The managed identities assigned to the node pool.
    #[serde(default)]
    pub azure_node_identities: Vec<NodeIdentityConfig>,
    /// AKS identity bindings: the proxy's TLS server name
    /// (`<label>.ests.aks`). Every identity's Azure client id is then bound
    /// to the cluster (the one `aks-identity-binding` credential AKS
    /// creates, no per-ServiceAccount credential), and who may use it is
    /// what the ClusterRoles and ClusterRoleBindings applied to the API
    /// server grant.
    #[serde(default)]
    pub azure_identity_binding: Option<String>,
    /// Serve the clouds over TLS at these addresses, under their real
    /// names; without it each is plain HTTP on any free port of `--host`.
    pub tls: Option<TlsServing>,
}

/// Where the clouds listen with TLS, and the names their certificate
/// carries (`login.microsoftonline.com`, `sts.googleapis.com`, ...): a
/// resolver that maps those names to these addresses (a network
/// namespace's hosts file) and a trust store holding `ca.crt` make
/// unmodified clients reach the emulators as they would the clouds.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsServing {
    pub names: Vec<String>,
    pub azure: std::net::SocketAddr,
    pub gcp: std::net::SocketAddr,
    pub aws: std::net::SocketAddr,
}

pub use lanyard_emulators::pki::Pki;

impl TlsServing {
    pub fn pki(&self) -> anyhow::Result<Pki> {
        let mut names = self.names.clone();
        names.extend([self.azure, self.gcp, self.aws].map(|a| a.ip().to_string()));
        Pki::generate("lanyard-fake-kube clouds CA", names)
    }

    pub fn address(&self, cloud: &str) -> Option<std::net::SocketAddr> {
        match cloud {
            "azure" => Some(self.azure),
            "gcp" => Some(self.gcp),
            "aws" => Some(self.aws),
            _ => None,
        }
    }
}

fn azure_audience() -> String {
    "api://AzureADTokenExchange".into()
}

fn aws_audience() -> String {
    "sts.amazonaws.com".into()
}

fn lifetime() -> u64 {
    3600
}

/// A managed identity assigned to the node pool, which the node's IMDS
/// serves, and the multi-tenant app that trusts it, if any.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeIdentityConfig {
    pub client_id: String,
    #[serde(default)]
    pub app_client_id: Option<String>,
    /// The tenant the app is provisioned in (default: the identity's).
    #[serde(default)]
    pub app_tenant_id: Option<String>,
}

/// One ServiceAccount and the cloud identities it is trusted as.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Identity {
    pub namespace: String,
    pub service_account: String,
    pub azure_client_id: Option<String>,
    pub gcp_service_account: Option<String>,
    pub aws_role_arn: Option<String>,
    /// A target role `aws_role_arn` chains into, trusting its sessions
    /// (with `sts:TagSession`).
    #[serde(default)]
    pub aws_target_role_arn: Option<String>,
    /// The `sts:ExternalId` the target role's trust policy asks for.
    #[serde(default)]
    pub aws_external_id: Option<String>,
    /// A multi-tenant app whose federated credential trusts the managed
    /// identity `azure_client_id`.
    #[serde(default)]
    pub azure_app_client_id: Option<String>,
    /// The tenant that app is provisioned in (default: the identity's).
    #[serde(default)]
    pub azure_app_tenant_id: Option<String>,
}

impl Identity {
    fn subject(&self) -> String {
        format!(
            "system:serviceaccount:{}:{}",
            self.namespace, self.service_account
        )
    }
}

/// The three emulators, started.
pub struct Clouds(EmulatorSet);

impl Clouds {
    /// Emulators trusting `issuer` for the identities in `config`.
    pub fn new(config: &CloudsConfig, issuer: &str) -> anyhow::Result<Clouds> {
        let set = EmulatorSet::new(
            &lanyard_emulators::CloudsConfig {
                issuer: issuer.to_string(),
                azure_tenant_id: config.azure_tenant_id.clone(),
                azure_audience: config.azure_audience.clone(),
                gcp_provider: config.gcp_provider.clone(),
                gcp_allowed_audiences: vec![config.gcp_provider.clone()],
                gcp_gke: config.gcp_gke_cluster.as_ref().map(|cluster| {
                    lanyard_emulators::GkePool {
                        cluster: cluster.clone(),
                        project_number: config.gcp_project_number.clone().unwrap_or_default(),
                    }
                }),
                aws_audience: config.aws_audience.clone(),
                lifetimes: Lifetimes::all(Duration::from_secs(config.lifetime_seconds)),
                bindings: config
                    .identities
                    .iter()
                    .map(|i| Binding {
                        subject: i.subject(),
                        azure_client_id: i.azure_client_id.clone(),
                        gcp_service_account: i.gcp_service_account.clone(),
                        aws_role_arn: i.aws_role_arn.clone(),
                        aws_target: i.aws_target_role_arn.as_ref().map(|arn| {
                            lanyard_emulators::AwsTarget {
                                role_arn: arn.clone(),
                                external_id: i.aws_external_id.clone(),
                            }
                        }),
                        azure_app: i.azure_app_client_id.as_ref().map(|client_id| {
                            lanyard_emulators::AzureApp {
                                client_id: client_id.clone(),
                                tenant_id: i
                                    .azure_app_tenant_id
                                    .clone()
                                    .unwrap_or_else(|| config.azure_tenant_id.clone()),
                            }
                        }),
                    })
                    .collect(),
                azure_identity_binding: config.azure_identity_binding.is_some(),
                azure_node_identities: config
                    .azure_node_identities
                    .iter()
                    .map(|n| lanyard_emulators::NodeIdentity {
                        client_id: n.client_id.clone(),
                        app: n.app_client_id.as_ref().map(|client_id| {
                            lanyard_emulators::AzureApp {
                                client_id: client_id.clone(),
                                tenant_id: n
                                    .app_tenant_id
                                    .clone()
                                    .unwrap_or_else(|| config.azure_tenant_id.clone()),
                            }
                        }),
                    })
                    .collect(),
            },
            lanyard::http::client(),
        )?;
        Ok(Clouds(set))
    }

    /// The routers to serve: Entra's authority host, Google's STS and IAM
    /// Credentials (one host), AWS STS.
    pub fn routers(&self) -> [(&'static str, Router); 3] {
        self.0.routers()
    }

    /// The identities bound to the cluster through AKS identity bindings.
    pub fn identity_bindings(&self) -> &[lanyard_emulators::identity_binding::IdentityBinding] {
        &self.0.identity_bindings
    }

    /// Entra's emulator.
    pub fn entra(&self) -> &Arc<lanyard_emulators::entra::Entra> {
        &self.0.entra
    }

    /// The node's IMDS, serving the managed identities assigned to the
    /// node pool (`azure_node_identities`).
    pub fn imds_router(&self) -> Router {
        lanyard_emulators::imds::router(self.0.entra.clone())
    }

    /// Which cloud issued `credential` and to whom, as JSON.
    pub fn whois(&self, credential: &str) -> Option<Value> {
        self.0
            .whois(credential)
            .map(|(cloud, principal)| json!({"cloud": cloud, "principal": principal}))
    }

    /// The faults scheduled on `cloud` (`azure`, `gcp` or `aws`).
    pub fn faults(&self, cloud: &str) -> Option<&Arc<Faults>> {
        self.0.faults(cloud)
    }

    /// Schedules (or, for `fault=clear`, removes) faults on one cloud from
    /// the control port's query: `fault` is `latency` (`ms`), `status`
    /// (`status`, optional `retry_after`; 429 is the service's throttling
    /// answer, STS's `Throttling`), `drop`, `hang`, `truncated` or `clear`;
    /// `count` requests are affected (absent: until cleared). Answers what
    /// was scheduled, or why the query is unusable.
    pub fn schedule(&self, q: &FaultQuery) -> Result<Value, String> {
        let faults = self
            .faults(&q.cloud)
            .ok_or_else(|| format!("cloud must be azure, gcp or aws (got {:?})", q.cloud))?;
        let fault = match q.fault.as_str() {
            "clear" => {
                faults.clear();
                return Ok(json!({"cloud": q.cloud, "cleared": true}));
            }
            "latency" => Fault::Latency {
                ms: q.ms.ok_or("fault=latency needs ms")?,
            },
            "status" => {
                let status = q.status.ok_or("fault=status needs status")?;
                if !(400..=599).contains(&status) {
                    return Err(format!("status must be 400-599 (got {status})"));
                }
                Fault::Status {
                    status,
                    retry_after: q.retry_after,
                }
            }
            "drop" => Fault::Drop,
            "hang" => Fault::Hang,
            "truncated" => Fault::Truncated,
            other => {
                return Err(format!(
                    "fault must be latency, status, drop, hang, truncated or clear (got {other:?})"
                ))
            }
        };
        if q.count == Some(0) {
            return Err("count must be at least 1 (leave it out: until cleared)".into());
        }
        let described = json!({"cloud": q.cloud, "fault": format!("{fault:?}"), "count": q.count});
        faults.push(fault, q.count);
        Ok(described)
    }

    /// Credentials issued per principal, per cloud.
    pub fn counts(&self) -> Value {
        json!({
            "azure": self.0.entra.ledger.counts(),
            "gcp": self.0.gcp.ledger.counts(),
            "aws": self.0.aws.ledger.counts(),
        })
    }

    /// Every session AWS STS issued, oldest first: the operation, the
    /// role, the calling role of a chained one, its session tags (passed
    /// and inherited), transitive keys and external id. No secrets.
    pub fn aws_sessions(&self) -> Value {
        let sessions: Vec<Value> = self
            .0
            .aws
            .sessions()
            .into_iter()
            .map(|s| {
                json!({
                    "action": format!("{:?}", s.action),
                    "role_arn": s.role_arn,
                    "assumed_role_arn": s.assumed_role_arn,
                    "source_role_arn": s.source_role_arn,
                    "tags": s.tags,
                    "transitive_tag_keys": s.transitive_tag_keys,
                    "external_id": s.external_id,
                    "session_policy": s.session_policy,
                    "duration_seconds": s.duration_seconds,
                    "access_key_id": s.access_key_id,
                })
            })
            .collect();
        Value::Array(sessions)
    }
}

/// The query of `POST /clouds/faults`.
#[derive(Debug, Deserialize)]
pub struct FaultQuery {
    pub cloud: String,
    pub fault: String,
    pub status: Option<u16>,
    pub retry_after: Option<u64>,
    pub ms: Option<u64>,
    pub count: Option<u32>,
}
