//! The webhook's shared vocabulary: the names, paths and limits of what
//! Lanyard puts into a pod, what the webhook injects
//! ([`InjectionConfig`]) and its refusal ([`Denial`]). A leaf: every
//! other webhook module (the mutation, what it builds, the check of what a
//! pod already carries, the guard) imports from here, and nothing here
//! imports them, so the modules import one way.

use crate::cloud::PerCloud;
use crate::config::Config;
use crate::serve::sdk_env::SdkDefaults;

/// Pod label that opts a pod in; only the value `"true"` counts. The chart's
/// objectSelector filters on it too, but the webhook must not depend on the
/// chart being right.
pub const INJECT_LABEL: &str = "lanyard.dev/inject";
/// Pod annotation: lifetime in seconds of the projected tokens (600-86400).
pub const TOKEN_EXPIRATION_ANNOTATION: &str = "lanyard.dev/token-expiration";
/// Pod annotation: comma-separated names of containers to leave alone.
pub const SKIP_CONTAINERS_ANNOTATION: &str = "lanyard.dev/skip-containers";
/// Pod annotation: `"true"` turns on transparent mode (TCP to
/// `169.254.169.254:80` goes to the sidecar, see `docs/transparent-mode.md`);
/// `"false"` or no annotation leaves it off; any other value denies the pod.
pub const TRANSPARENT_ANNOTATION: &str = "lanyard.dev/transparent";

/// Name of the injected init container; its presence marks an injected pod.
pub const SIDECAR_NAME: &str = "lanyard";
/// The sidecar's entrypoint in the image: the slim `lanyard-sidecar`
/// binary, which takes the flags of `lanyard sidecar`.
pub const SIDECAR_COMMAND: &str = "lanyard-sidecar";
/// Name of transparent mode's init container, which installs the redirect
/// (`lanyard-sidecar redirect`) and exits, before the sidecar starts.
pub const REDIRECT_NAME: &str = "lanyard-redirect";
/// The names transparent mode maps to the metadata address in the pod's
/// `/etc/hosts` (`hostAliases`): what google-auth and scripts call when no
/// variable points them elsewhere, and what GKE's DNS would answer.
pub const METADATA_HOSTNAMES: [&str; 2] = ["metadata.google.internal", "metadata"];
/// Projected volume of the cloud-audience tokens, mounted in the sidecar only.
pub const TOKENS_VOLUME: &str = "lanyard-tokens";
/// Projected volume of the app-facing token, mounted in the sidecar and the
/// app containers (it authorizes the AWS container endpoint).
pub const APP_TOKEN_VOLUME: &str = "lanyard-app-token";
/// Where the sidecar reads `azure`, `gcp` and `aws` (`LANYARD_TOKEN_DIR`).
pub const TOKEN_DIR: &str = "/var/run/lanyard/tokens";
/// Where the app token volume is mounted, in the sidecar and the apps. Not
/// inside [`TOKEN_DIR`]: a second volume cannot be mounted over a file of
/// the first, and the apps must not see the cloud tokens.
pub const APP_TOKEN_DIR: &str = "/var/run/lanyard/app";
/// An empty volume the sidecar mounts, read-only, at
/// [`API_TOKEN_DIR`], so that the sidecar holds no Kubernetes API token.
///
/// Why: kube-apiserver runs its built-in admission plugins again after a
/// mutating webhook changed the pod (`k8s.io/apiserver/pkg/admission`
/// `reinvocation.go`), and the ServiceAccount plugin then mounts the
/// `kube-api-access-*` volume into every container that has no mount at
/// [`API_TOKEN_DIR`] (`plugin/pkg/admission/serviceaccount/admission.go`
/// `mountServiceAccountToken`), the sidecar this webhook just added
/// included. The sidecar never calls the API, so it should not carry the
/// pod's API credential; and with a mount of its own there, the pod is
/// stored with exactly the sidecar the webhook built, which the guard and
/// a reinvoked `/mutate` recognise.
pub const API_TOKEN_SHIELD_VOLUME: &str = "lanyard-no-api-token";
/// Where the ServiceAccount admission plugin mounts the Kubernetes API
/// token (`DefaultAPITokenMountPath`), unless a mount is already there.
pub const API_TOKEN_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// The app token file (`LANYARD_APP_TOKEN_FILE` for the sidecar,
/// `AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE` for the apps).
pub const APP_TOKEN_FILE: &str = "/var/run/lanyard/app/app";

/// `expirationSeconds` of the projected tokens when the pod does not set
/// [`TOKEN_EXPIRATION_ANNOTATION`].
pub const DEFAULT_TOKEN_EXPIRATION: i64 = 3600;
/// The API server's own floor for projected tokens is 600 s.
pub const MIN_TOKEN_EXPIRATION: i64 = 600;
/// The longest `expirationSeconds` a pod may ask for: one day.
pub const MAX_TOKEN_EXPIRATION: i64 = 86400;

pub(super) const LOOPBACK: &str = "127.0.0.1";
/// UID of the sidecar process: the distroless `nonroot` user.
pub(super) const SIDECAR_UID: i64 = 65532;

/// CPU and memory for the sidecar, as Kubernetes quantities.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SidecarResources {
    /// `requests.cpu`; `None` sets none.
    pub cpu_request: Option<String>,
    /// `requests.memory`; `None` sets none.
    pub memory_request: Option<String>,
    /// `limits.cpu`; `None` sets none (the default: a burst of SDK calls is
    /// not throttled).
    pub cpu_limit: Option<String>,
    /// `limits.memory`; `None` sets none.
    pub memory_limit: Option<String>,
}

impl Default for SidecarResources {
    /// The configuration's defaults (`webhook.sidecar_*`).
    fn default() -> Self {
        InjectionConfig::default().resources
    }
}

/// What the webhook injects; set from its command line or configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InjectionConfig {
    /// The image of the injected sidecar.
    pub sidecar_image: String,
    /// The sidecar's `imagePullPolicy`; `None` leaves Kubernetes' default.
    pub image_pull_policy: Option<String>,
    /// Node agent URL as the sidecar sees it; `$(LANYARD_HOST_IP)` is
    /// expanded by the kubelet from the sidecar's env (the node's IP).
    pub agent_url: String,
    /// Loopback port of the SDK endpoints.
    pub port: u16,
    /// Port of the sidecar's probe-only listener (`--probe-listen
    /// 0.0.0.0:PORT`, `/readyz` and `/healthz` only). The kubelet probes the
    /// pod IP, and the SDK endpoints must stay on loopback.
    pub probe_port: u16,
    /// Audience of the projected token the sidecar presents for each
    /// cloud; `None` where the cloud is not configured (Google without a
    /// provider), which then never applies.
    pub audiences: PerCloud<Option<String>>,
    /// Audience of the app-facing token.
    pub app_audience: String,
    /// What the SDK environment takes from configuration (the default
    /// Azure tenant, the AWS region).
    pub sdk: SdkDefaults,
    /// The sidecar's resource requests and limits.
    pub resources: SidecarResources,
    /// The identities assigned to the node (Azure's
    /// `node_identities`): what decides which bindings the agent will
    /// refuse ([`crate::cloud::Bindings::known_refusals`]), warned of at
    /// admission.
    pub node_identities: Vec<String>,
}

impl Default for InjectionConfig {
    fn default() -> Self {
        InjectionConfig::from_config(&Config::default())
    }
}

impl InjectionConfig {
    /// What the webhook injects, from the webhook and cloud sections.
    pub fn from_config(config: &Config) -> Self {
        let w = &config.webhook;
        InjectionConfig {
            sidecar_image: w.sidecar_image.clone(),
            image_pull_policy: w.image_pull_policy.clone(),
            agent_url: w.agent_url.clone(),
            port: w.sidecar_port,
            probe_port: w.probe_port,
            audiences: config.audiences(),
            app_audience: w.app_audience.clone(),
            sdk: config.clouds().sdk_defaults(),
            resources: SidecarResources {
                cpu_request: w.sidecar_cpu_request.clone(),
                memory_request: w.sidecar_memory_request.clone(),
                cpu_limit: w.sidecar_cpu_limit.clone(),
                memory_limit: w.sidecar_memory_limit.clone(),
            },
            node_identities: config.clouds().node_identities(),
        }
    }
}

impl InjectionConfig {
    /// Checks what would otherwise only fail when a pod starts.
    pub fn validate(&self) -> Result<(), String> {
        if self.sidecar_image.trim().is_empty() {
            return Err("sidecar image is empty".into());
        }
        if self.agent_url.trim().is_empty() {
            return Err("agent URL is empty".into());
        }
        if self.port == 0 || self.probe_port == 0 || self.port == self.probe_port {
            return Err(format!(
                "sidecar port {} and probe port {} must be distinct and non-zero",
                self.port, self.probe_port
            ));
        }
        let clouds = self.audiences.iter().map(|(c, a)| (c.name(), a.as_ref()));
        for (name, audience) in clouds.chain([("app", Some(&self.app_audience))]) {
            if audience.is_some_and(|a| a.trim().is_empty()) {
                return Err(format!("{name} token audience is empty"));
            }
        }
        Ok(())
    }
}

/// A refusal of the pod, with the HTTP-like code for the review's status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Denial {
    /// The status code of the review's refusal: 400 for a malformed pod or
    /// annotation, 403 for a pod that must not be injected (`hostNetwork`),
    /// 500 when the webhook itself fails.
    pub code: u16,
    /// What the user is told, naming the pod and what to change.
    pub message: String,
}

impl Denial {
    pub(super) fn bad_request(message: String) -> Self {
        Denial { code: 400, message }
    }
}
