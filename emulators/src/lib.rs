//! Emulators that stand in for what `lanyard dev` and the tests cannot reach:
//! a Kubernetes service-account token issuer and the clouds' token services.
//! Each validates requests the way the real service does (signatures against
//! the issuer's published keys, issuer/subject/audience matching, expiry)
//! and answers in the real service's error format. An emulator that accepted
//! anything would prove nothing.
//!
//! Every error an emulator writes is listed in `docs/emulators.md` with the
//! public source that backs it (a capture of the real answer, the
//! service's documentation, or "ours" and why); `tests/emulator_sources.rs`
//! fails when a source file writes a code the page does not list.
//!
//! A crate of their own, not a module of `lanyard`: only `lanyard dev` (the
//! `dev` feature), the tests, the fake API server and the bench drivers
//! use them, and the compiler keeps it so. The product library does not
//! depend on this crate, so the agent, sidecar and webhook cannot reach for
//! an emulator; and this crate does not depend on the product, so it checks
//! the product's tokens and requests with code of its own (`jwks`, `claims`,
//! `arn`), not with the verifier it is there to test. The fake Kubernetes
//! API server is in the `lanyard-fake-kube` test-support crate.
//!
//! ## The set
//!
//! The three clouds as one set, configured the way an administrator
//! configures workload identity federation in each: per identity, an Entra
//! app with a federated credential for the ServiceAccount's subject, a
//! Google service account whose IAM policy lets the federated principal
//! impersonate it, an AWS role whose trust policy names the subject.
//!
//! `lanyard dev`, the fake API server's `--clouds`, the integration tests'
//! support and the bench drivers all start their emulators from here, so
//! an emulator gains a setting in one place, and every user sets it alike.

pub mod arn;
pub mod aws;
pub mod claims;
pub mod entra;
pub mod faults;
pub mod gcp;
pub mod identity_binding;
pub mod imds;
pub mod issuer;
pub mod issuer_keys;
pub mod jwks;
pub mod keys;
pub mod ledger;
pub mod pki;

pub use issuer::{Issuer, PodIdentity};
pub use issuer_keys::IssuerKeys;
pub use keys::SigningKey;
pub use ledger::Ledger;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;

use crate::aws::{AwsEmulatorConfig, AwsRole, AwsSts, OidcProvider};
use crate::entra::{App, Entra, FederatedCredential};
use crate::faults::Faults;
use crate::gcp::{Gcp, GcpEmulatorConfig, GcpServiceAccount, GkeCluster, WorkloadIdentityProvider};
use crate::identity_binding::IdentityBinding;
use crate::jwks::KeysError;

/// The longest AWS session the emulated roles allow (IAM's maximum).
const MAX_SESSION_SECONDS: u64 = 43_200;

/// One Kubernetes ServiceAccount and the cloud identities trusting it.
#[derive(Debug, Clone, Default)]
pub struct Binding {
    /// Its tokens' `sub`: `system:serviceaccount:NAMESPACE:NAME`.
    pub subject: String,
    /// The Entra app (client id) that federates it.
    pub azure_client_id: Option<String>,
    /// The Google service account its federated principal may impersonate.
    pub gcp_service_account: Option<String>,
    /// The AWS role that trusts it.
    pub aws_role_arn: Option<String>,
    /// A role that role chains into (EKS Pod Identity's target role),
    /// trusting its sessions.
    pub aws_target: Option<AwsTarget>,
    /// An app that trusts the managed identity `azure_client_id` names
    /// (Entra's managed identity as a federated credential).
    pub azure_app: Option<AzureApp>,
}

/// A multi-tenant app registration whose federated credential trusts a
/// managed identity: registered in the identity's tenant (as Entra
/// requires), provisioned in `tenant_id`, where its tokens are asked for.
#[derive(Debug, Clone, Default)]
pub struct AzureApp {
    /// The app's client id.
    pub client_id: String,
    /// The (resource) tenant it is provisioned in.
    pub tenant_id: String,
}

/// A user-assigned managed identity assigned to the node pool (the VM
/// scale set), which the node's IMDS (`imds`) serves without a federated
/// credential, and the app that trusts it, if any.
#[derive(Debug, Clone, Default)]
pub struct NodeIdentity {
    /// The managed identity's client id.
    pub client_id: String,
    /// A multi-tenant app whose federated credential trusts it.
    pub app: Option<AzureApp>,
}

/// A target role whose trust policy names another role's sessions, with
/// an `sts:ExternalId` condition and `sts:TagSession`, as EKS Pod
/// Identity's target roles are set up.
#[derive(Debug, Clone, Default)]
pub struct AwsTarget {
    /// The target role (often in another account).
    pub role_arn: String,
    /// The `sts:ExternalId` its trust policy asks for.
    pub external_id: Option<String>,
}

/// Each cloud's access-token lifetime.
#[derive(Debug, Clone, Copy)]
pub struct Lifetimes {
    /// Entra ID's tokens.
    pub azure: Duration,
    /// Google's access tokens (STS and IAM Credentials).
    pub gcp: Duration,
}

impl Lifetimes {
    /// The same lifetime for every cloud.
    pub fn all(lifetime: Duration) -> Self {
        Lifetimes {
            azure: lifetime,
            gcp: lifetime,
        }
    }
}

/// A GKE cluster's Workload Identity pool.
#[derive(Debug, Clone)]
pub struct GkePool {
    /// `projects/PROJECT/locations/LOCATION/clusters/CLUSTER`.
    pub cluster: String,
    /// The project's number.
    pub project_number: String,
}

/// How the clouds are configured to trust one issuer.
#[derive(Debug, Clone)]
pub struct CloudsConfig {
    /// The issuer the clouds trust (they fetch its keys by OIDC discovery).
    pub issuer: String,
    /// The Entra tenant of every app.
    pub azure_tenant_id: String,
    /// The audience Entra expects in the assertion.
    pub azure_audience: String,
    /// The workload identity provider's full name.
    pub gcp_provider: String,
    /// Audiences the provider accepts; empty: Google's default, the
    /// provider's own name.
    pub gcp_allowed_audiences: Vec<String>,
    /// GKE's pool instead: the cluster (`projects/P/locations/L/clusters/C`)
    /// and its project's number. Its pool accepts the issuer's tokens, and
    /// the service accounts are granted to its members
    /// (`serviceAccount:P.svc.id.goog[NS/KSA]`) as GKE Workload Identity
    /// grants are, instead of to the provider's principals.
    pub gcp_gke: Option<GkePool>,
    /// The audience the AWS OIDC provider lists.
    pub aws_audience: String,
    /// Access-token lifetimes (AWS sessions last what the caller asks).
    pub lifetimes: Lifetimes,
    /// Who may federate.
    pub bindings: Vec<Binding>,
    /// The managed identities assigned to the node pool (IMDS).
    pub azure_node_identities: Vec<NodeIdentity>,
    /// The bindings' Azure identities are bound to the cluster through AKS
    /// identity bindings: each has the one federated credential AKS
    /// creates (`identity_binding`), not one per ServiceAccount for the
    /// cluster's issuer, and the proxy lets the bindings' ServiceAccounts
    /// use it, as their RBAC grants would.
    pub azure_identity_binding: bool,
}

/// The three emulators, configured and not yet serving: serve each
/// [`EmulatorSet::routers`] entry where its cloud should be.
pub struct EmulatorSet {
    /// Entra ID.
    pub entra: Arc<Entra>,
    /// Google STS and IAM Credentials (one router).
    pub gcp: Arc<Gcp>,
    /// AWS STS.
    pub aws: Arc<AwsSts>,
    /// The identities bound through AKS identity bindings
    /// (`CloudsConfig::azure_identity_binding`), for
    /// [`identity_binding::Proxy`].
    pub identity_bindings: Vec<IdentityBinding>,
}

/// The managed identities of `config`'s bindings as AKS identity bindings
/// hold them, each with the ServiceAccounts that may use it.
fn identity_bindings(config: &CloudsConfig) -> Vec<IdentityBinding> {
    let mut out: Vec<IdentityBinding> = Vec::new();
    for b in &config.bindings {
        let Some(client_id) = &b.azure_client_id else {
            continue;
        };
        let ksa = b
            .subject
            .strip_prefix("system:serviceaccount:")
            .unwrap_or(&b.subject)
            .to_string();
        match out.iter_mut().find(|i| i.client_id == *client_id) {
            Some(existing) => existing.service_accounts.push(ksa),
            None => out.push(IdentityBinding {
                tenant_id: config.azure_tenant_id.clone(),
                client_id: client_id.clone(),
                resource_id: format!(
                    "/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/lanyard/providers/Microsoft.ManagedIdentity/userAssignedIdentities/{client_id}"
                ),
                service_accounts: vec![ksa],
            }),
        }
    }
    out
}

/// The managed identities and apps of `config`'s bindings, one entry per
/// client id with every federated credential it has.
fn entra_apps(config: &CloudsConfig) -> Vec<App> {
    let bound = identity_bindings(config);
    let mut apps: Vec<App> = Vec::new();
    let mut add = |app: App| match apps.iter_mut().find(|a| a.client_id == app.client_id) {
        Some(existing) => {
            existing.federated.extend(app.federated);
            existing.provisioned_in.extend(app.provisioned_in);
            existing.managed_identity |= app.managed_identity;
            existing.on_node |= app.on_node;
        }
        None => apps.push(app),
    };
    let tenant = &config.azure_tenant_id;
    for b in &config.bindings {
        let Some(client_id) = &b.azure_client_id else {
            continue;
        };
        let federated = match config.azure_identity_binding {
            // The one credential AKS creates for every cluster bound to
            // the identity; none for this cluster's issuer.
            true => bound
                .iter()
                .filter(|i| i.client_id == *client_id)
                .map(IdentityBinding::federated_credential)
                .collect(),
            false => vec![FederatedCredential {
                issuer: config.issuer.clone(),
                subject: b.subject.clone(),
                audience: config.azure_audience.clone(),
            }],
        };
        let identity = App {
            tenant_id: tenant.clone(),
            client_id: client_id.clone(),
            federated,
            // The identities bindings name stand for user-assigned managed
            // identities (which Entra federates as it does apps); the apps
            // that trust them are app registrations.
            managed_identity: true,
            ..App::default()
        };
        let principal = identity.object_id();
        add(identity);
        if let Some(app) = &b.azure_app {
            add(trusting(config, app, principal));
        }
    }
    for node in &config.azure_node_identities {
        let identity = App {
            tenant_id: tenant.clone(),
            client_id: node.client_id.clone(),
            managed_identity: true,
            on_node: true,
            ..App::default()
        };
        let principal = identity.object_id();
        add(identity);
        if let Some(app) = &node.app {
            add(trusting(config, app, principal));
        }
    }
    apps
}

/// The multi-tenant app registration `app`, whose federated credential
/// trusts the managed identity with object id `principal`: registered in
/// the identity's tenant, provisioned in the app's.
fn trusting(config: &CloudsConfig, app: &AzureApp, principal: String) -> App {
    let tenant = &config.azure_tenant_id;
    App {
        tenant_id: tenant.clone(),
        client_id: app.client_id.clone(),
        federated: vec![FederatedCredential {
            issuer: entra::v2_issuer(tenant),
            subject: principal,
            audience: config.azure_audience.clone(),
        }],
        provisioned_in: (app.tenant_id != *tenant)
            .then(|| app.tenant_id.clone())
            .into_iter()
            .collect(),
        managed_identity: false,
        on_node: false,
    }
}

impl EmulatorSet {
    /// The emulators `config` describes; each fetches the issuer's keys
    /// with `http`.
    pub fn new(config: &CloudsConfig, http: reqwest::Client) -> anyhow::Result<Self> {
        let entra = Entra::new(entra_apps(config), config.lifetimes.azure, http.clone())?;
        let clusters = match &config.gcp_gke {
            Some(pool) => vec![GkeCluster::named(
                &pool.cluster,
                &pool.project_number,
                &config.issuer,
            )?],
            None => vec![],
        };
        let member = |subject: &str| match clusters.first() {
            Some(cluster) => {
                let ksa = subject.strip_prefix("system:serviceaccount:").unwrap_or("");
                let (namespace, name) = ksa.split_once(':').unwrap_or(("", ""));
                cluster.member(namespace, name)
            }
            None => Gcp::principal_for(&config.gcp_provider, subject),
        };
        let service_accounts = config
            .bindings
            .iter()
            .filter_map(|b| {
                b.gcp_service_account
                    .as_ref()
                    .map(|email| GcpServiceAccount {
                        email: email.clone(),
                        members: vec![member(&b.subject)],
                    })
            })
            .collect();
        let gcp = Gcp::new(
            GcpEmulatorConfig {
                providers: vec![WorkloadIdentityProvider {
                    name: config.gcp_provider.clone(),
                    issuer: config.issuer.clone(),
                    allowed_audiences: config.gcp_allowed_audiences.clone(),
                }],
                service_accounts,
                clusters,
                lifetime: config.lifetimes.gcp,
            },
            http.clone(),
        )?;
        let mut roles: Vec<AwsRole> = Vec::new();
        for b in &config.bindings {
            let Some(arn) = &b.aws_role_arn else { continue };
            roles.push(AwsRole {
                arn: arn.clone(),
                trusted_subjects: vec![b.subject.clone()],
                max_session_duration: MAX_SESSION_SECONDS,
                trusted_roles: Vec::new(),
                external_id: None,
                allow_tag_session: false,
            });
            if let Some(target) = &b.aws_target {
                match roles.iter_mut().find(|r| r.arn == target.role_arn) {
                    Some(role) => role.trusted_roles.push(arn.clone()),
                    None => roles.push(AwsRole {
                        arn: target.role_arn.clone(),
                        trusted_subjects: Vec::new(),
                        max_session_duration: MAX_SESSION_SECONDS,
                        trusted_roles: vec![arn.clone()],
                        external_id: target.external_id.clone(),
                        allow_tag_session: true,
                    }),
                }
            }
        }
        let aws = AwsSts::new(
            AwsEmulatorConfig {
                providers: vec![OidcProvider {
                    issuer: config.issuer.clone(),
                    audiences: vec![config.aws_audience.clone()],
                }],
                roles,
                ..Default::default()
            },
            http,
        );
        Ok(EmulatorSet {
            entra: Arc::new(entra),
            gcp: Arc::new(gcp),
            aws: Arc::new(aws),
            identity_bindings: match config.azure_identity_binding {
                true => identity_bindings(config),
                false => Vec::new(),
            },
        })
    }

    /// Each cloud's name (`azure`, `gcp`, `aws`) and router: Entra's
    /// authority host, Google's STS and IAM Credentials (one host), STS.
    pub fn routers(&self) -> [(&'static str, Router); 3] {
        [
            ("azure", self.entra.router()),
            ("gcp", self.gcp.router()),
            ("aws", self.aws.router()),
        ]
    }

    /// Fetches the issuer's keys now, as clouds that have trusted it all
    /// along hold them already.
    pub async fn preload_keys(&self) -> Result<(), KeysError> {
        self.entra.preload_keys().await?;
        self.gcp.preload_keys().await?;
        self.aws.preload_keys().await
    }

    /// Which cloud issued `credential` and to whom (an Entra app as
    /// `TENANT/CLIENT_ID`, a Google principal or service-account email, an
    /// AWS role ARN for an access key id).
    pub fn whois(&self, credential: &str) -> Option<(&'static str, String)> {
        [
            ("azure", self.entra.ledger.owner(credential)),
            ("gcp", self.gcp.ledger.owner(credential)),
            ("aws", self.aws.ledger.owner(credential)),
        ]
        .into_iter()
        .find_map(|(cloud, owner)| owner.map(|p| (cloud, p)))
    }

    /// The faults to inject into `cloud` (`azure`, `gcp` or `aws`).
    pub fn faults(&self, cloud: &str) -> Option<&Arc<Faults>> {
        match cloud {
            "azure" => Some(&self.entra.faults),
            "gcp" => Some(&self.gcp.faults),
            "aws" => Some(&self.aws.faults),
            _ => None,
        }
    }
}
