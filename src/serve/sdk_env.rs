//! The environment that points each cloud's SDKs at Lanyard's surfaces:
//! one source for what `lanyard dev` prints and what the webhook injects,
//! so the two cannot drift apart.
//!
//! Variables that would make an SDK skip the surfaces
//! (`AZURE_FEDERATED_TOKEN_FILE`, `AWS_WEB_IDENTITY_TOKEN_FILE`,
//! `AWS_ROLE_ARN`) are never set here.

use super::app_service::PATH as APP_SERVICE_PATH;
use super::aws_container::PATH as AWS_CONTAINER_PATH;
use crate::cloud::{Bindings, Cloud};

/// Variables that make an SDK take another credential source before it
/// reaches the sidecar. They are left alone (the user may mean them) and
/// reported.
pub const CONFLICTS: &[(Cloud, &str, &str)] = &[
    (
        Cloud::Azure,
        "AZURE_FEDERATED_TOKEN_FILE",
        "azure-identity uses workload identity federation before managed identity",
    ),
    (
        Cloud::Azure,
        "AZURE_CLIENT_SECRET",
        "azure-identity uses the client secret before managed identity",
    ),
    (
        Cloud::Azure,
        "AZURE_CLIENT_CERTIFICATE_PATH",
        "azure-identity uses the client certificate before managed identity",
    ),
    (
        Cloud::Gcp,
        "GOOGLE_APPLICATION_CREDENTIALS",
        "google-auth uses that file before the metadata server",
    ),
    (
        Cloud::Aws,
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "the AWS SDKs use web identity before container credentials",
    ),
    (
        Cloud::Aws,
        "AWS_ROLE_ARN",
        "the AWS SDKs assume this role by web identity (with AWS_WEB_IDENTITY_TOKEN_FILE) before container credentials",
    ),
    (
        Cloud::Aws,
        "AWS_ACCESS_KEY_ID",
        "the AWS SDKs use static keys before container credentials",
    ),
];

/// Settings the SDK environment takes from configuration when a binding
/// does not name them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SdkDefaults {
    /// Tenant for Azure bindings that name none (`AZURE_TENANT_ID`).
    pub azure_tenant_id: Option<String>,
    /// The AWS region (`AWS_REGION`, `AWS_DEFAULT_REGION`, and the
    /// sidecar's `LANYARD_AWS_REGION`); `None` sets none.
    pub aws_region: Option<String>,
}

impl SdkDefaults {
    /// The defaults `config` gives.
    pub fn from_config(config: &crate::config::Config) -> Self {
        SdkDefaults {
            azure_tenant_id: config.azure.tenant_id.clone(),
            aws_region: Some(config.aws.region.clone()),
        }
    }

    /// What the sidecar of a pod that presents its app-facing token is
    /// told of these defaults (the region its IMDS surface reports).
    pub fn sidecar_vars(&self) -> Vec<(&'static str, String)> {
        let region = self.aws_region.iter();
        region.map(|r| ("LANYARD_AWS_REGION", r.clone())).collect()
    }
}

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
        for cloud in self.clouds {
            match cloud {
                Cloud::Azure => self.azure(&base, &mut vars),
                Cloud::Gcp => {
                    // google-auth reads the first two, gcloud the third.
                    for name in ["GCE_METADATA_HOST", "GCE_METADATA_IP", "GCE_METADATA_ROOT"] {
                        vars.push((name, self.host_port.to_string()));
                    }
                }
                Cloud::Aws => self.aws(&base, &mut vars),
            }
        }
        vars
    }

    fn azure(&self, base: &str, vars: &mut Vec<(&'static str, String)>) {
        // App Service for current SDKs (they take IDENTITY_ENDPOINT first),
        // IMDS for those that speak only IMDS, the older App Service
        // protocol (2017-09-01) for SDKs from before 2019-08-01, which take
        // it first (docs/compatibility.md).
        vars.push(("AZURE_POD_IDENTITY_AUTHORITY_HOST", base.to_string()));
        vars.push(("IDENTITY_ENDPOINT", format!("{base}{APP_SERVICE_PATH}")));
        vars.push(("IDENTITY_HEADER", self.identity_header.to_string()));
        vars.push(("MSI_ENDPOINT", format!("{base}{APP_SERVICE_PATH}")));
        vars.push(("MSI_SECRET", self.identity_header.to_string()));
        if let Some(az) = &self.bindings.azure {
            vars.push(("AZURE_CLIENT_ID", az.client_id.clone()));
            let default = self.defaults.azure_tenant_id.as_ref();
            if let Some(tenant) = az.tenant_id.as_ref().or(default) {
                vars.push(("AZURE_TENANT_ID", tenant.clone()));
            }
        }
    }

    fn aws(&self, base: &str, vars: &mut Vec<(&'static str, String)>) {
        vars.push((
            "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            format!("{base}{AWS_CONTAINER_PATH}"),
        ));
        vars.push((
            "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
            self.app_token_file.to_string(),
        ));
        // IMDS goes to the sidecar too, so an SDK that falls back to
        // instance metadata never reaches the node's own role.
        vars.push(("AWS_EC2_METADATA_SERVICE_ENDPOINT", format!("{base}/")));
        // The JS, Go and Java SDKs read AWS_REGION; botocore (boto3, the aws
        // CLI) reads only AWS_DEFAULT_REGION. Both, as the EKS pod identity
        // webhook sets them.
        if let Some(region) = &self.defaults.aws_region {
            vars.push(("AWS_REGION", region.clone()));
            vars.push(("AWS_DEFAULT_REGION", region.clone()));
        }
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
            azure: Some(crate::cloud::azure::Binding {
                client_id: "c".into(),
                tenant_id: None,
                object_id: None,
                resource_id: None,
            }),
            gcp: None,
            aws: Some("arn:aws:iam::111122223333:role/r".into()),
        };
        let defaults = SdkDefaults {
            azure_tenant_id: None,
            aws_region: Some("eu-west-1".into()),
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
