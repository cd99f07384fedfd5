//! The environment that points each cloud's SDKs at Lanyard's surfaces:
//! one source for what `lanyard dev` prints and what the webhook injects,
//! so the two cannot drift apart.
//!
//! Variables that would make an SDK skip the surfaces
//! (`AZURE_FEDERATED_TOKEN_FILE`, `AWS_WEB_IDENTITY_TOKEN_FILE`,
//! `AWS_ROLE_ARN`) are never set here.

use super::{APP_SERVICE_PATH, AWS_CONTAINER_PATH};

/// What the pod is bound to, and the secrets its SDKs present.
pub struct SdkEnv<'a> {
    /// `HOST:PORT` of the surfaces (loopback inside the pod).
    pub host_port: &'a str,
    /// Azure's part; `None` when the pod has no Azure binding.
    pub azure: Option<AzureEnv<'a>>,
    /// Whether the pod has a Google identity.
    pub gcp: bool,
    /// AWS's part; `None` when the pod has no AWS binding.
    pub aws: Option<AwsEnv<'a>>,
}

/// Azure's part.
pub struct AzureEnv<'a> {
    /// The bound client id, as `AZURE_CLIENT_ID`.
    pub client_id: &'a str,
    /// The tenant, as `AZURE_TENANT_ID`; `None` leaves it unset.
    pub tenant_id: Option<&'a str>,
    /// The App Service secret (`IDENTITY_HEADER`, and `MSI_SECRET` for the
    /// older protocol).
    pub identity_header: &'a str,
}

/// AWS's part.
pub struct AwsEnv<'a> {
    /// The file holding the container endpoint's authorization token.
    pub token_file: &'a str,
    /// The region, as `AWS_REGION` and `AWS_DEFAULT_REGION`; `None` leaves
    /// both unset.
    pub region: Option<&'a str>,
}

impl SdkEnv<'_> {
    /// `NAME=VALUE` pairs, in a stable order.
    pub fn vars(&self) -> Vec<(&'static str, String)> {
        let base = format!("http://{}", self.host_port);
        let mut vars = Vec::new();
        if let Some(az) = &self.azure {
            // App Service for current SDKs (they take IDENTITY_ENDPOINT
            // first), IMDS for those that speak only IMDS, the older App
            // Service protocol (2017-09-01) for SDKs from before
            // 2019-08-01, which take it first (docs/compatibility.md).
            vars.push(("AZURE_POD_IDENTITY_AUTHORITY_HOST", base.clone()));
            vars.push(("IDENTITY_ENDPOINT", format!("{base}{APP_SERVICE_PATH}")));
            vars.push(("IDENTITY_HEADER", az.identity_header.to_string()));
            vars.push(("MSI_ENDPOINT", format!("{base}{APP_SERVICE_PATH}")));
            vars.push(("MSI_SECRET", az.identity_header.to_string()));
            vars.push(("AZURE_CLIENT_ID", az.client_id.to_string()));
            if let Some(tenant) = az.tenant_id {
                vars.push(("AZURE_TENANT_ID", tenant.to_string()));
            }
        }
        if self.gcp {
            // google-auth reads the first two, gcloud the third.
            for name in ["GCE_METADATA_HOST", "GCE_METADATA_IP", "GCE_METADATA_ROOT"] {
                vars.push((name, self.host_port.to_string()));
            }
        }
        if let Some(aws) = &self.aws {
            vars.push((
                "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                format!("{base}{AWS_CONTAINER_PATH}"),
            ));
            vars.push((
                "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
                aws.token_file.to_string(),
            ));
            // IMDS goes to the sidecar too, so an SDK that falls back to
            // instance metadata never reaches the node's own role.
            vars.push(("AWS_EC2_METADATA_SERVICE_ENDPOINT", format!("{base}/")));
            // The JS, Go and Java SDKs read AWS_REGION; botocore (boto3,
            // the aws CLI) reads only AWS_DEFAULT_REGION. Both, as the EKS
            // pod identity webhook sets them.
            if let Some(region) = aws.region {
                vars.push(("AWS_REGION", region.to_string()));
                vars.push(("AWS_DEFAULT_REGION", region.to_string()));
            }
        }
        vars
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_bound_clouds_get_variables() {
        let env = SdkEnv {
            host_port: "127.0.0.1:8642",
            azure: None,
            gcp: true,
            aws: None,
        };
        let names: Vec<_> = env.vars().into_iter().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            ["GCE_METADATA_HOST", "GCE_METADATA_IP", "GCE_METADATA_ROOT"]
        );
        let env = SdkEnv {
            host_port: "127.0.0.1:8642",
            azure: Some(AzureEnv {
                client_id: "c",
                tenant_id: None,
                identity_header: "h",
            }),
            gcp: false,
            aws: Some(AwsEnv {
                token_file: "/t",
                region: Some("eu-west-1"),
            }),
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
