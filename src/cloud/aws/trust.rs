//! What IAM must hold for a ServiceAccount's AWS bindings, as `aws`
//! commands and the role's trust policy (`lanyard doctor`).
//!
//! As docs/setup-aws.md sets it up (and EKS's IRSA documents it): an IAM
//! OIDC identity provider for the cluster's issuer, whose ARN is
//! `arn:PARTITION:iam::ACCOUNT:oidc-provider/HOST/PATH` (the issuer
//! without `https://`), and on each role a trust policy allowing
//! `sts:AssumeRoleWithWebIdentity` from that provider when
//! `HOST/PATH:sub` is the ServiceAccount's subject and `HOST/PATH:aud`
//! the audience (`aws.audience`). STS refuses a token with no such
//! provider with `InvalidIdentityToken: No OpenIDConnect provider found in
//! your account for …` (the text as namespacelabs/foundation#801 and
//! aws-samples/aws-secret-sidecar-injector#30 quote it), and a policy that does not match with
//! `AccessDenied: Not authorized to perform sts:AssumeRoleWithWebIdentity`.
//! A chained target role trusts the first role with `sts:AssumeRole` (and
//! `sts:TagSession` when session tags are on, as EKS Pod Identity's
//! target roles do), with `sts:ExternalId` when one is set.

use serde_json::json;

use super::{Binding, RoleArn, Settings};
use crate::cloud::trust::{command, issuer_note, Trust, Workload};
use crate::cloud::Cloud;

/// The trusts `bindings` need for `workload`: each role's, and each
/// chained target role's.
pub fn trust(settings: &Settings, bindings: &[Binding], workload: &Workload) -> Vec<Trust> {
    let provider = workload
        .issuer
        .strip_prefix("https://")
        .unwrap_or(workload.issuer)
        .trim_end_matches('/')
        .to_string();
    let mut out = Vec::new();
    for b in bindings {
        let Ok(role) = RoleArn::parse(b.role_arn.clone()) else {
            continue;
        };
        let provider_arn = format!(
            "arn:{}:iam::{}:oidc-provider/{provider}",
            role.partition(),
            role.account()
        );
        let mut t = Trust::new(
            Cloud::Aws,
            role.as_str(),
            "role trust policy (web identity)",
        );
        t.issuer = workload.issuer.to_string();
        t.subject = workload.subject();
        t.audience = settings.audience.clone();
        let policy = json!({
            "Version": "2012-10-17",
            "Statement": [{
                "Effect": "Allow",
                "Principal": {"Federated": provider_arn},
                "Action": "sts:AssumeRoleWithWebIdentity",
                "Condition": {"StringEquals": {
                    format!("{provider}:sub"): t.subject,
                    format!("{provider}:aud"): t.audience,
                }},
            }],
        });
        t.commands.push(command(&[
            "aws",
            "iam",
            "list-open-id-connect-providers",
            "--output",
            "text",
        ]));
        t.commands.push(command(&[
            "aws",
            "iam",
            "create-open-id-connect-provider",
            "--url",
            &format!("https://{provider}"),
            "--client-id-list",
            &t.audience,
        ]));
        t.commands.push(command(&[
            "aws",
            "iam",
            "update-assume-role-policy",
            "--role-name",
            role.name(),
            "--policy-document",
            &policy.to_string(),
        ]));
        t.document = Some(policy);
        if !workload.issuer.ends_with('/') {
            t.notes.push(issuer_note(workload.issuer));
        }
        t.notes.push(format!(
            "the provider's ARN must be {provider_arn}; without it STS answers InvalidIdentityToken (no OpenIDConnect provider found)"
        ));
        if workload.issuer.ends_with('/') {
            t.notes.push(format!(
                "the issuer ends with '/' while IAM names providers by host and path: check that `aws iam list-open-id-connect-providers` shows {provider_arn} and that STS accepts this cluster's tokens for it"
            ));
        }
        t.notes.push(
            "the role must also exist; its name is the ARN's last segment and `aws iam update-assume-role-policy` replaces its whole trust policy".into(),
        );
        out.push(t);
        if let Some(chain) = &b.chain {
            out.push(chained(&role, chain));
        }
    }
    out
}

/// What STS's refusal in `message` means and what to do; `None` when not
/// recognised.
pub fn explain(message: &str) -> Option<&'static str> {
    if message.contains("InvalidIdentityToken") {
        return Some("no IAM OIDC provider for the token's issuer in the role's account (or its keys do not verify): create the one the doctor prints");
    }
    if message.contains("AccessDenied") && message.contains("AssumeRoleWithWebIdentity") {
        return Some("the role's trust policy does not let this ServiceAccount in: its provider, :sub or :aud differ from the doctor's policy");
    }
    if message.contains("AccessDenied") && message.contains("AssumeRole") {
        return Some("the target role does not trust the first role (or its external id differs): apply the doctor's target role policy");
    }
    None
}

fn chained(source: &RoleArn, chain: &super::Chain) -> Trust {
    let target = RoleArn::parse(chain.target_role_arn.clone());
    let name = target
        .as_ref()
        .map(|r| r.name().to_string())
        .unwrap_or_else(|_| "<TARGET_ROLE_NAME>".into());
    let mut t = Trust::new(
        Cloud::Aws,
        &chain.target_role_arn,
        "target role trust policy (role chaining)",
    );
    t.issuer = "(none: the first role's session assumes it)".into();
    t.subject = source.as_str().to_string();
    t.audience = String::new();
    let actions = if chain.session_tags {
        json!(["sts:AssumeRole", "sts:TagSession"])
    } else {
        json!("sts:AssumeRole")
    };
    let mut statement = json!({
        "Effect": "Allow",
        "Principal": {"AWS": source.as_str()},
        "Action": actions,
    });
    if let Some(id) = &chain.external_id {
        statement["Condition"] = json!({"StringEquals": {"sts:ExternalId": id}});
    }
    let policy = json!({"Version": "2012-10-17", "Statement": [statement]});
    t.commands.push(command(&[
        "aws",
        "iam",
        "update-assume-role-policy",
        "--role-name",
        &name,
        "--policy-document",
        &policy.to_string(),
    ]));
    t.document = Some(policy);
    t.notes.push(format!(
        "run it with the credentials of the target role's account; the first role ({}) also needs sts:AssumeRole{} on it in its permissions",
        source.as_str(),
        if chain.session_tags { " and sts:TagSession" } else { "" }
    ));
    t
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::cloud::aws::Chain;

    fn workload<'a>(
        issuer: &'a str,
        sharing: &'a dyn Fn(Cloud, &str) -> Option<usize>,
    ) -> Workload<'a> {
        Workload {
            issuer,
            namespace: "ray",
            service_account: "worker",
            sharing,
        }
    }

    #[test]
    fn the_trust_policy_names_the_provider_subject_and_audience() {
        let none = |_: Cloud, _: &str| None;
        let b = Binding {
            role_arn: "arn:aws:iam::111122223333:role/ray/reader".into(),
            chain: None,
        };
        let w = workload("https://oidc.eks.eu-west-1.amazonaws.com/id/ABC", &none);
        let t = &trust(&Settings::default(), &[b], &w)[0];
        let policy = t.document.as_ref().unwrap();
        let statement = &policy["Statement"][0];
        assert_eq!(
            statement["Principal"]["Federated"],
            "arn:aws:iam::111122223333:oidc-provider/oidc.eks.eu-west-1.amazonaws.com/id/ABC"
        );
        let cond = &statement["Condition"]["StringEquals"];
        assert_eq!(
            cond["oidc.eks.eu-west-1.amazonaws.com/id/ABC:sub"],
            "system:serviceaccount:ray:worker"
        );
        assert_eq!(
            cond["oidc.eks.eu-west-1.amazonaws.com/id/ABC:aud"],
            "sts.amazonaws.com"
        );
        assert!(t.commands[2].starts_with(
            "aws iam update-assume-role-policy --role-name reader --policy-document '{"
        ));
    }

    #[test]
    fn a_target_role_trusts_the_first_one() {
        let none = |_: Cloud, _: &str| None;
        let b = Binding {
            role_arn: "arn:aws:iam::111122223333:role/reader".into(),
            chain: Some(Arc::new(Chain::new(
                "arn:aws:iam::111122223333:role/reader",
                "arn:aws:iam::444455556666:role/data".into(),
                Some("ext-1".into()),
                true,
                None,
            ))),
        };
        let w = workload("https://issuer.example/", &none);
        let ts = trust(&Settings::default(), &[b], &w);
        assert_eq!(ts.len(), 2);
        assert!(ts[0].notes.iter().any(|n| n.contains("ends with '/'")));
        let policy = ts[1].document.as_ref().unwrap();
        assert_eq!(
            policy["Statement"][0]["Principal"]["AWS"],
            "arn:aws:iam::111122223333:role/reader"
        );
        assert_eq!(
            policy["Statement"][0]["Action"],
            json!(["sts:AssumeRole", "sts:TagSession"])
        );
        assert_eq!(
            policy["Statement"][0]["Condition"]["StringEquals"]["sts:ExternalId"],
            "ext-1"
        );
        assert!(ts[1].commands[0].contains("--role-name data"));
    }

    #[test]
    fn refusals_are_explained_by_their_codes() {
        assert!(explain(
            "InvalidIdentityToken: No OpenIDConnect provider found in your account for https://x"
        )
        .unwrap()
        .contains("OIDC provider"));
        assert!(
            explain("AccessDenied: Not authorized to perform sts:AssumeRoleWithWebIdentity")
                .unwrap()
                .contains("trust policy")
        );
        assert_eq!(explain("something else"), None);
    }
}
