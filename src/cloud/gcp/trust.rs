//! What Google must hold for a ServiceAccount's Google bindings, as
//! `gcloud` commands (`lanyard doctor`).
//!
//! Two pools, as docs/setup-google.md sets them up:
//! - **a pool of one's own**: the provider trusts the cluster's issuer
//!   (its `oidc.issuerUri`, compared exactly) and the tokens' audience
//!   (the provider's name by default); the ServiceAccount is the principal
//!   `principal://iam.googleapis.com/projects/NUMBER/locations/global/workloadIdentityPools/POOL/subject/system:serviceaccount:NS:NAME`;
//! - **GKE's pool** (`PROJECT.svc.id.goog`): GKE trusts its own issuer,
//!   and the ServiceAccount is `serviceAccount:PROJECT.svc.id.goog[NS/NAME]`
//!   (and, directly, `principal://…/workloadIdentityPools/PROJECT.svc.id.goog/subject/ns/NS/sa/NAME`,
//!   a subject of another form than a provider's).
//!
//! Impersonating a Google service account takes
//! `roles/iam.workloadIdentityUser` on it for that member; without one the
//! pod acts as the principal itself, and resources grant it their roles.
//! Google refuses a missing grant with `PERMISSION_DENIED` on
//! `generateAccessToken` (Google Cloud docs, "Troubleshoot Workload
//! Identity Federation").

use super::{Binding, Settings};
use crate::cloud::trust::{command, issuer_note, Trust, Workload};
use crate::cloud::Cloud;

/// The pool and number a provider's resource name holds:
/// `//iam.googleapis.com/projects/NUMBER/locations/global/workloadIdentityPools/POOL/providers/PROVIDER`.
struct Provider<'a> {
    number: &'a str,
    pool: &'a str,
    provider: &'a str,
}

fn provider(name: &str) -> Option<Provider<'_>> {
    let rest = name.strip_prefix("//iam.googleapis.com/projects/")?;
    let parts: Vec<&str> = rest.split('/').collect();
    match parts.as_slice() {
        [number, "locations", "global", "workloadIdentityPools", pool, "providers", provider] => {
            Some(Provider {
                number,
                pool,
                provider,
            })
        }
        _ => None,
    }
}

/// The trusts `bindings` need for `workload`: one per Google service
/// account, or one for the federated principal when none is named.
pub fn trust(settings: &Settings, bindings: &[Binding], workload: &Workload) -> Vec<Trust> {
    let Some(audience) = settings.token_audience() else {
        return Vec::new();
    };
    let (member, principal, issuer, mut notes, describe) = if let Some(gke) = settings.gke() {
        let pool = gke.pool();
        let number = settings
            .project_number
            .clone()
            .unwrap_or_else(|| "<PROJECT_NUMBER>".into());
        (
            format!(
                "serviceAccount:{pool}[{}/{}]",
                workload.namespace, workload.service_account
            ),
            format!(
                "principal://iam.googleapis.com/projects/{number}/locations/global/workloadIdentityPools/{pool}/subject/ns/{}/sa/{}",
                workload.namespace, workload.service_account
            ),
            workload.issuer.to_string(),
            vec![format!(
                "GKE's pool {pool}: its subjects are ns/NAMESPACE/sa/NAME, not system:serviceaccount:…, and it trusts only its own cluster's issuer"
            )],
            None,
        )
    } else {
        let Some(name) = settings.workload_identity_provider.as_deref() else {
            return Vec::new();
        };
        let Some(p) = provider(name) else {
            return Vec::new();
        };
        let subject = workload.subject();
        let project_id = settings.project_id.as_deref().unwrap_or("<PROJECT_ID>");
        (
            format!(
                "principal://iam.googleapis.com/projects/{}/locations/global/workloadIdentityPools/{}/subject/{subject}",
                p.number, p.pool
            ),
            String::new(),
            workload.issuer.to_string(),
            vec![
                issuer_note(workload.issuer),
                format!(
                    "the provider {} must allow the audience {audience} (its default allowed audience is its own name, with or without https:)",
                    p.provider
                ),
            ],
            Some(command(&[
                "gcloud",
                "iam",
                "workload-identity-pools",
                "providers",
                "describe",
                p.provider,
                "--workload-identity-pool",
                p.pool,
                "--location",
                "global",
                // gcloud takes the project's id here, not its number.
                "--project",
                project_id,
                "--format",
                "value(oidc.issuerUri,oidc.allowedAudiences)",
            ])),
        )
    };
    let base = |identity: &str, kind: &'static str| {
        let mut t = Trust::new(Cloud::Gcp, identity, kind);
        t.issuer = issuer.clone();
        t.audience = audience.clone();
        t.commands.extend(describe.clone());
        t
    };
    if bindings.is_empty() {
        let direct = if principal.is_empty() {
            &member
        } else {
            &principal
        };
        let mut t = base(direct, "federated principal (no service account)");
        t.subject = direct.clone();
        notes.push(
            "no Google service account is named: the pod acts as this principal, so grant it roles on the resources it uses; ID tokens need a service account (iam.gke.io/gcp-service-account)".into(),
        );
        t.notes = notes;
        return vec![t];
    }
    bindings
        .iter()
        .map(|email| {
            let mut t = base(
                email,
                "impersonation grant (roles/iam.workloadIdentityUser)",
            );
            t.subject = member.clone();
            // gcloud needs the service account's project to find it: the
            // one its email names (NAME@PROJECT.iam.gserviceaccount.com).
            let project = email
                .split_once('@')
                .and_then(|(_, domain)| domain.strip_suffix(".iam.gserviceaccount.com"))
                .unwrap_or("<SERVICE_ACCOUNT_PROJECT_ID>");
            t.commands.push(command(&[
                "gcloud",
                "iam",
                "service-accounts",
                "add-iam-policy-binding",
                email,
                "--project",
                project,
                "--role",
                "roles/iam.workloadIdentityUser",
                "--member",
                &member,
            ]));
            t.commands.push(command(&[
                "gcloud",
                "iam",
                "service-accounts",
                "get-iam-policy",
                email,
                "--project",
                project,
                "--format",
                "json",
            ]));
            t.notes = notes.clone();
            t
        })
        .collect()
}

/// What Google's refusal in `message` means and what to do (Google Cloud
/// docs, "Troubleshoot Workload Identity Federation"); `None` when not
/// recognised.
pub fn explain(message: &str) -> Option<&'static str> {
    if message.contains("getAccessToken") || message.contains("iam.serviceAccounts.getAccessToken")
    {
        return Some("the member may not impersonate the service account: grant it roles/iam.workloadIdentityUser there, as the doctor prints");
    }
    if message.contains("PERMISSION_DENIED") {
        return Some("the principal lacks a role: grant the doctor's member the roles it needs, or roles/iam.workloadIdentityUser on the service account it impersonates");
    }
    if message.contains("invalid_target") {
        return Some("STS does not know the pool or provider: check gcp.workload_identity_provider (or gcp.gke_cluster) and that the provider is enabled");
    }
    if message.contains("invalid_grant") {
        return Some("the provider refused the token: its issuer, its allowed audiences or its keys do not match the cluster's (see the doctor's describe command)");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROVIDER: &str = "//iam.googleapis.com/projects/123456789012/locations/global/workloadIdentityPools/fleet/providers/aks-weu";

    fn workload<'a>(sharing: &'a dyn Fn(Cloud, &str) -> Option<usize>) -> Workload<'a> {
        Workload {
            issuer: "https://issuer.example",
            namespace: "ray",
            service_account: "worker",
            sharing,
        }
    }

    #[test]
    fn a_providers_principal_is_the_kubernetes_subject() {
        let none = |_: Cloud, _: &str| None;
        let settings = Settings {
            workload_identity_provider: Some(PROVIDER.into()),
            project_id: Some("analytics".into()),
            ..Settings::default()
        };
        let sa = "reader@analytics.iam.gserviceaccount.com".to_string();
        let t = &trust(&settings, &[sa], &workload(&none))[0];
        assert_eq!(t.subject, "principal://iam.googleapis.com/projects/123456789012/locations/global/workloadIdentityPools/fleet/subject/system:serviceaccount:ray:worker");
        assert_eq!(t.audience, PROVIDER);
        assert!(t.commands[0].starts_with("gcloud iam workload-identity-pools providers describe aks-weu --workload-identity-pool fleet --location global --project analytics"));
        assert_eq!(t.commands[1], format!("gcloud iam service-accounts add-iam-policy-binding reader@analytics.iam.gserviceaccount.com --project analytics --role roles/iam.workloadIdentityUser --member {}", t.subject));
    }

    #[test]
    fn gkes_pool_names_its_members_its_own_way() {
        let none = |_: Cloud, _: &str| None;
        let settings = Settings {
            gke_cluster: Some("projects/analytics/locations/europe-west4/clusters/ray".into()),
            project_id: Some("analytics".into()),
            project_number: Some("123456789012".into()),
            ..Settings::default()
        };
        let t = &trust(
            &settings,
            &["r@analytics.iam.gserviceaccount.com".to_string()],
            &workload(&none),
        )[0];
        assert_eq!(
            t.subject,
            "serviceAccount:analytics.svc.id.goog[ray/worker]"
        );
        assert!(
            t.commands[0].ends_with("--member 'serviceAccount:analytics.svc.id.goog[ray/worker]'")
        );
        let direct = &trust(&settings, &[], &workload(&none))[0];
        assert_eq!(direct.subject, "principal://iam.googleapis.com/projects/123456789012/locations/global/workloadIdentityPools/analytics.svc.id.goog/subject/ns/ray/sa/worker");
    }

    #[test]
    fn without_google_configured_there_is_no_trust() {
        let none = |_: Cloud, _: &str| None;
        assert!(trust(
            &Settings::default(),
            &["a@b.iam.gserviceaccount.com".to_string()],
            &workload(&none)
        )
        .is_empty());
    }

    #[test]
    fn refusals_are_explained_by_their_codes() {
        assert!(explain(
            "PERMISSION_DENIED: Permission 'iam.serviceAccounts.getAccessToken' denied"
        )
        .unwrap()
        .contains("workloadIdentityUser"));
        assert!(
            explain("invalid_grant: The audience in ID Token does not match")
                .unwrap()
                .contains("allowed audiences")
        );
        assert_eq!(explain("something else"), None);
    }
}
