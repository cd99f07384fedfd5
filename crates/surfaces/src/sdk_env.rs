//! The environment that points each cloud's SDKs at Lanyard's surfaces:
//! one source for what `lanyard dev` prints and what the webhook injects,
//! so the two cannot drift apart.
//!
//! Variables that would make an SDK skip the surfaces
//! (`AZURE_FEDERATED_TOKEN_FILE`, `AWS_WEB_IDENTITY_TOKEN_FILE`,
//! `AWS_ROLE_ARN`) are never set here.

pub use lanyard_core::cloud::SdkDefaults;
use lanyard_core::cloud::{Bindings, Cloud};

/// What the pod is bound to, and the secrets its SDKs present.
pub struct SdkEnv<'a> {
    /// `HOST:PORT` of the surfaces (loopback inside the pod).
    pub host_port: &'a str,
    /// The clouds the pod gets credentials of, in [`Cloud::ALL`] order.
    pub clouds: &'a [Cloud],
    /// The identities its ServiceAccount names.
    pub bindings: &'a Bindings,
    /// What configuration supplies where a binding names nothing.
    pub defaults: &'a SdkDefaults,
    /// The App Service secret (`IDENTITY_HEADER`, and `MSI_SECRET` for the
    /// older protocol).
    pub identity_header: &'a str,
    /// The file holding the pod's app-facing token.
    pub app_token_file: &'a str,
}

impl SdkEnv<'_> {
    /// `NAME=VALUE` pairs, in a stable order.
    pub fn vars(&self) -> Vec<(&'static str, String)> {
        let base = format!("http://{}", self.host_port);
        let mut vars = Vec::new();
        for &cloud in self.clouds {
            super::sdk_vars(cloud, self, &base, &mut vars);
        }
        vars
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_bound_clouds_get_variables() {
        let none = Bindings::default();
        let defaults = SdkDefaults::default();
        let env = SdkEnv {
            host_port: "127.0.0.1:8642",
            clouds: &[Cloud::Gcp],
            bindings: &none,
            defaults: &defaults,
            identity_header: "h",
            app_token_file: "/t",
        };
        let names: Vec<_> = env.vars().into_iter().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            ["GCE_METADATA_HOST", "GCE_METADATA_IP", "GCE_METADATA_ROOT"]
        );
        let bindings = Bindings {
            azure: vec![lanyard_core::cloud::azure::Binding {
                client_id: "c".into(),
                tenant_id: None,
                object_id: None,
                resource_id: None,
                app: None,
            }],
            gcp: Vec::new(),
            aws: vec!["arn:aws:iam::111122223333:role/r".into()],
        };
        let defaults = SdkDefaults {
            azure_tenant_id: None,
            aws_region: Some("eu-west-1".into()),
            gcp_universe_domain: None,
        };
        let env = SdkEnv {
            host_port: "127.0.0.1:8642",
            clouds: &[Cloud::Azure, Cloud::Aws],
            bindings: &bindings,
            defaults: &defaults,
            identity_header: "h",
            app_token_file: "/t",
        };
        let vars = env.vars();
        let get = |n: &str| vars.iter().find(|(k, _)| *k == n).map(|(_, v)| v.as_str());
        assert_eq!(
            get("IDENTITY_ENDPOINT"),
            Some("http://127.0.0.1:8642/msi/token")
        );
        assert_eq!(get("AZURE_TENANT_ID"), None);
        assert_eq!(get("MSI_ENDPOINT"), get("IDENTITY_ENDPOINT"));
        assert_eq!(get("MSI_SECRET"), Some("h"));
        assert_eq!(
            get("AWS_CONTAINER_CREDENTIALS_FULL_URI"),
            Some("http://127.0.0.1:8642/v1/credentials")
        );
        assert_eq!(get("AWS_REGION"), Some("eu-west-1"));
        assert_eq!(get("AWS_DEFAULT_REGION"), Some("eu-west-1"));
        for skipper in [
            "AZURE_FEDERATED_TOKEN_FILE",
            "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AWS_ROLE_ARN",
        ] {
            assert_eq!(get(skipper), None);
        }
    }
}
