//! TokenReview: the signature against the issuer's key, and the bound
//! ServiceAccount and Pod still there with the token's uids.

use super::*;

impl FakeKube {
    pub(crate) fn token_review(&self, body: &[u8]) -> Response {
        self.stats.token_reviews.fetch_add(1, Ordering::Relaxed);
        let mut review: TokenReview = match serde_json::from_slice(body) {
            Ok(review) => review,
            Err(e) => {
                return bad_request(format!(
                    "the body of the request was in an unknown format: {e}"
                ))
            }
        };
        let token = review.spec.token.clone().unwrap_or_default();
        if token.is_empty() {
            return bad_request("token is required for TokenReview in authentication".into());
        }
        let audiences = match review.spec.audiences.clone().filter(|a| !a.is_empty()) {
            Some(audiences) => audiences,
            // kube-apiserver's --api-audiences default to the issuer.
            None => vec![self.issuer_url.clone()],
        };
        review.status = Some(match self.authenticate(&token, &audiences) {
            Ok((user, audiences)) => TokenReviewStatus {
                authenticated: Some(true),
                user: Some(user),
                audiences: Some(audiences),
                error: None,
            },
            Err(reason) => TokenReviewStatus {
                authenticated: None,
                user: Some(UserInfo::default()),
                audiences: None,
                error: Some(format!("[invalid bearer token, {reason}]")),
            },
        });
        review.metadata = ObjectMeta::default();
        match serde_json::to_value(&review) {
            Ok(value) => json_response(StatusCode::CREATED, &value),
            Err(e) => status_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                e.to_string(),
                None,
            ),
        }
    }

    /// Authenticates a service-account token as kube-apiserver's
    /// service-account authenticator does: this issuer, its key, the
    /// requested audiences, validity window, and bound objects that still
    /// exist with the uids the token names.
    pub(crate) fn authenticate(
        &self,
        token: &str,
        audiences: &[String],
    ) -> Result<(UserInfo, Vec<String>), String> {
        let kid = jsonwebtoken::decode_header(token)
            .map_err(|e| format!("service account token is malformed: {e}"))?
            .kid;
        let (key, alg) = {
            let keys = self.issuer_keys.read().unwrap_or_else(|e| e.into_inner());
            match keys
                .decoding
                .iter()
                .find(|(k, _, _)| kid.is_none() || *k == kid)
            {
                Some((_, key, alg)) => (key.clone(), *alg),
                // kube-apiserver tries every key; none verifies.
                None => return Err("go-jose/go-jose: error in cryptographic primitive".into()),
            }
        };
        let (key, alg) = (&key, &alg);
        if lanyard::token::unverified_issuer(token).as_deref() != Some(self.issuer_url.as_str()) {
            return Err("token is not a service account token of this cluster's issuer".into());
        }
        let mut validation = Validation::new(*alg);
        validation.leeway = TOKEN_LEEWAY_SECS;
        validation.validate_nbf = true;
        validation.validate_aud = false;
        validation.set_issuer(&[self.issuer_url.as_str()]);
        validation.set_required_spec_claims(&["exp", "iss", "sub"]);
        let claims = jsonwebtoken::decode::<ServiceAccountClaims>(token, key, &validation)
            .map_err(|e| {
                use jsonwebtoken::errors::ErrorKind;
                match e.kind() {
                    ErrorKind::InvalidSignature | ErrorKind::InvalidAlgorithm => {
                        "go-jose/go-jose: error in cryptographic primitive".to_string()
                    }
                    ErrorKind::ExpiredSignature => "service account token has expired".into(),
                    ErrorKind::ImmatureSignature => "service account token is not valid yet".into(),
                    _ => format!("service account token is malformed: {e}"),
                }
            })?
            .claims;
        let granted: Vec<String> = audiences
            .iter()
            .filter(|a| claims.aud.contains(a))
            .cloned()
            .collect();
        if granted.is_empty() {
            let token_auds: Vec<&str> = claims.aud.iter().collect();
            return Err(format!(
                "token audiences {token_auds:?} is invalid for the target audiences {audiences:?}"
            ));
        }
        let k8s = &claims.kubernetes;
        match parse_subject(&claims.sub) {
            Some((ns, sa)) if ns == k8s.namespace && sa == k8s.serviceaccount.name => {}
            _ => return Err("service account token claims are invalid".into()),
        }
        if k8s.secret.is_some() {
            // No Secrets exist in this fake: a secret-bound token is void.
            return Err("service account token has been invalidated".into());
        }
        {
            let store = self.lock();
            let uid_of = |kind: Kind, name: &str| {
                store.objects[kind.index()]
                    .get(&(k8s.namespace.clone(), name.to_string()))
                    .map(|obj| {
                        obj.pointer("/metadata/uid")
                            .and_then(Value::as_str)
                            .unwrap_or_default()
                            .to_string()
                    })
            };
            match uid_of(Kind::ServiceAccount, &k8s.serviceaccount.name) {
                None => return Err("service account token has been invalidated".into()),
                Some(uid) if uid != k8s.serviceaccount.uid => {
                    return Err(format!(
                        "service account UID ({uid}) does not match claim ({})",
                        k8s.serviceaccount.uid
                    ))
                }
                Some(_) => {}
            }
            if let Some(pod) = &k8s.pod {
                match uid_of(Kind::Pod, &pod.name) {
                    None => return Err("service account token has been invalidated".into()),
                    Some(uid) if uid != pod.uid => {
                        return Err(format!(
                            "pod UID ({uid}) does not match claim ({})",
                            pod.uid
                        ))
                    }
                    Some(_) => {}
                }
            }
        }
        let mut extra = BTreeMap::new();
        if let Some(jti) = &claims.jti {
            extra.insert(
                "authentication.kubernetes.io/credential-id".to_string(),
                vec![format!("JTI={jti}")],
            );
        }
        if let Some(pod) = &k8s.pod {
            extra.insert(
                "authentication.kubernetes.io/pod-name".to_string(),
                vec![pod.name.clone()],
            );
            extra.insert(
                "authentication.kubernetes.io/pod-uid".to_string(),
                vec![pod.uid.clone()],
            );
        }
        if let Some(node) = &k8s.node {
            extra.insert(
                "authentication.kubernetes.io/node-name".to_string(),
                vec![node.name.clone()],
            );
            extra.insert(
                "authentication.kubernetes.io/node-uid".to_string(),
                vec![node.uid.clone()],
            );
        }
        let user = UserInfo {
            username: Some(claims.sub.clone()),
            uid: Some(k8s.serviceaccount.uid.clone()),
            groups: Some(vec![
                "system:serviceaccounts".to_string(),
                format!("system:serviceaccounts:{}", k8s.namespace),
                "system:authenticated".to_string(),
            ]),
            extra: Some(extra),
        };
        Ok((user, granted))
    }
}
