//! Serving a request: authentication, RBAC, routing to the verbs, and
//! the non-resource paths (discovery, version, the issuer's documents).

use super::*;

impl FakeKube {
    pub(crate) fn note(&self, method: &Method, uri: &Uri, status: StatusCode) {
        tracing::debug!(
            %method, uri = %uri, status = status.as_u16(), "fake kube-apiserver request"
        );
        {
            let mut counts = self.path_counts.lock().unwrap_or_else(|p| p.into_inner());
            if counts.len() < MAX_COUNTED_PATHS || counts.contains_key(uri.path()) {
                *counts.entry(uri.path().to_string()).or_default() += 1;
            }
        }
        let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        if log.len() >= MAX_LOGGED_REQUESTS {
            log.pop_front();
        }
        log.push_back(format!("{method} {uri} -> {}", status.as_u16()));
    }

    /// Who the bearer token authenticates: Lanyard's least-privilege
    /// ServiceAccount, or the cluster administrator when an admin token is
    /// set ([`FakeKube::set_admin_token`]).
    pub(crate) fn user(&self, headers: &HeaderMap) -> Option<User> {
        let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
        let (scheme, token) = value.trim().split_once(' ')?;
        let token = token.trim();
        if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() {
            return None;
        }
        if constant_time_eq(token.as_bytes(), self.token.expose_secret().as_bytes()) {
            return Some(User {
                name: FAKE_USER.into(),
                groups: vec![
                    "system:serviceaccounts".into(),
                    "system:serviceaccounts:kube-system".into(),
                    "system:authenticated".into(),
                ],
            });
        }
        let admin = self.admin_token.read().unwrap_or_else(|p| p.into_inner());
        match admin.as_ref() {
            Some(admin) if constant_time_eq(token.as_bytes(), admin.expose_secret().as_bytes()) => {
                Some(User {
                    name: ADMIN_USER.into(),
                    groups: vec!["system:masters".into(), "system:authenticated".into()],
                })
            }
            _ => None,
        }
    }

    pub(crate) fn serve(
        self: &Arc<Self>,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Response {
        let Some(user) = self.user(headers) else {
            self.stats.unauthorized.fetch_add(1, Ordering::Relaxed);
            return status_error(
                StatusCode::UNAUTHORIZED,
                "Unauthorized",
                "Unauthorized".into(),
                None,
            );
        };
        if headers
            .keys()
            .any(|name| name.as_str().starts_with("impersonate-"))
        {
            self.stats.forbidden.fetch_add(1, Ordering::Relaxed);
            return status_error(
                StatusCode::FORBIDDEN,
                "Forbidden",
                format!("users is forbidden: User \"{}\" cannot impersonate resource \"users\" in API group \"\" at the cluster scope", user.name),
                Some(json!({"kind": "users"})),
            );
        }
        let query = Query::parse(uri);
        let info = RequestInfo::parse(method, uri.path(), &query);
        let Some(res) = info else {
            return self.serve_non_resource(&user, method, uri.path(), headers);
        };
        if !res.allowed(&user) {
            self.stats.forbidden.fetch_add(1, Ordering::Relaxed);
            return forbidden(&res, &user);
        }
        match (
            res.group.as_str(),
            res.version.as_str(),
            res.resource.as_str(),
        ) {
            ("", "v1", plural) => {
                let Some(kind) = Kind::from_plural(plural) else {
                    return not_found_path();
                };
                // A cluster-scoped resource is stored under "": its URL's
                // `namespaces/NAME` is the object itself, not a scope.
                let namespace = match kind.cluster_scoped() {
                    true => res.name.as_deref().map(|_| ""),
                    false => res.namespace.as_deref(),
                };
                match (res.verb, namespace, res.name.as_deref()) {
                    (Verb::Get, Some(ns), Some(name)) => self.get(kind, ns, name),
                    (Verb::List, _, None) if kind.cluster_scoped() => self.list(kind, None, &query),
                    (Verb::Watch, _, name) if kind.cluster_scoped() => {
                        self.watch(kind, None, name, &query)
                    }
                    (Verb::List, ns, None) => self.list(kind, ns, &query),
                    (Verb::Watch, ns, name) => self.watch(kind, ns, name, &query),
                    _ => not_found_path(),
                }
            }
            ("events.k8s.io", "v1", "events") => {
                match (res.verb, res.namespace.as_deref(), res.name.as_deref()) {
                    (Verb::Create, Some(ns), None) => self.create_event(ns, body),
                    (Verb::List, Some(ns), None) => self.list_events(ns),
                    (Verb::Patch, Some(ns), Some(name)) => {
                        self.patch_event(ns, name, headers, body)
                    }
                    _ => not_found_path(),
                }
            }
            ("authentication.k8s.io", "v1", "tokenreviews")
                if res.verb == Verb::Create && res.namespace.is_none() && res.name.is_none() =>
            {
                self.token_review(body)
            }
            _ => not_found_path(),
        }
    }

    pub(crate) fn serve_non_resource(
        &self,
        user: &User,
        method: &Method,
        path: &str,
        headers: &HeaderMap,
    ) -> Response {
        if method != Method::GET && method != Method::HEAD {
            self.stats.forbidden.fetch_add(1, Ordering::Relaxed);
            return status_error(
                StatusCode::FORBIDDEN,
                "Forbidden",
                format!(
                    "forbidden: User \"{}\" cannot {} path \"{path}\"",
                    user.name,
                    method.as_str().to_ascii_lowercase()
                ),
                None,
            );
        }
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("127.0.0.1");
        let addresses = json!([{"clientCIDR": "0.0.0.0/0", "serverAddress": host}]);
        match path.trim_end_matches('/') {
            "/version" => json_response(StatusCode::OK, &version_info()),
            "/api" => json_response(
                StatusCode::OK,
                &json!({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": addresses}),
            ),
            "/apis" => json_response(
                StatusCode::OK,
                &json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [authentication_group()]}),
            ),
            "/apis/authentication.k8s.io" => {
                let mut group = authentication_group();
                if let Some(obj) = group.as_object_mut() {
                    obj.insert("kind".into(), "APIGroup".into());
                    obj.insert("apiVersion".into(), "v1".into());
                }
                json_response(StatusCode::OK, &group)
            }
            "/api/v1" => json_response(StatusCode::OK, &core_v1_resources()),
            "/apis/authentication.k8s.io/v1" => {
                json_response(StatusCode::OK, &authentication_v1_resources())
            }
            "/.well-known/openid-configuration" | "/openid/v1/jwks"
                if self.keys_unavailable.load(Ordering::SeqCst) =>
            {
                status_error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "ServiceUnavailable",
                    "the server is currently unable to handle the request".into(),
                    None,
                )
            }
            "/.well-known/openid-configuration" => json_response(
                StatusCode::OK,
                &json!({
                    "issuer": self.issuer_url.as_str(),
                    "jwks_uri": format!("{}/openid/v1/jwks", self.issuer_url),
                    "response_types_supported": ["id_token"],
                    "subject_types_supported": ["public"],
                    "id_token_signing_alg_values_supported": ["RS256", "ES256"],
                }),
            ),
            "/openid/v1/jwks" => {
                let jwks = self
                    .issuer_keys
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .jwks
                    .clone();
                (
                    StatusCode::OK,
                    [(header::CONTENT_TYPE, "application/jwk-set+json")],
                    jwks.to_string(),
                )
                    .into_response()
            }
            "/healthz" | "/livez" | "/readyz" => (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                "ok",
            )
                .into_response(),
            _ => not_found_path(),
        }
    }

    pub(crate) fn get(&self, kind: Kind, namespace: &str, name: &str) -> Response {
        self.stats.gets.fetch_add(1, Ordering::Relaxed);
        let store = self.lock();
        match store.objects[kind.index()].get(&(namespace.to_string(), name.to_string())) {
            Some(obj) => json_response(StatusCode::OK, obj),
            None => not_found(kind, name),
        }
    }

    pub(crate) fn list(&self, kind: Kind, namespace: Option<&str>, query: &Query) -> Response {
        self.stats.lists.fetch_add(1, Ordering::Relaxed);
        let filter = match Filter::new(kind, namespace, None, query) {
            Ok(filter) => filter,
            Err(message) => return bad_request(message),
        };
        let limit = match query.get("limit").map(str::parse::<usize>) {
            None => 0,
            Some(Ok(limit)) => limit,
            Some(Err(_)) => {
                return bad_request("limit: Invalid value: must be a non-negative integer".into())
            }
        };
        let store = self.lock();
        let (at, after) = match query.get("continue").filter(|c| !c.is_empty()) {
            Some(token) => match decode_continue(token) {
                Some(position) => position,
                None => {
                    return bad_request("continue key is not valid: illegal base64 data".into())
                }
            },
            None => {
                let exact = query.get("resourceVersionMatch") == Some("Exact");
                match query.get("resourceVersion").filter(|rv| !rv.is_empty()) {
                    Some(rv) if exact => match rv.parse::<u64>() {
                        Ok(rv) => (rv.min(store.rv), None),
                        Err(_) => {
                            return bad_request(format!("resourceVersion: Invalid value: \"{rv}\""))
                        }
                    },
                    // Unset, "0" (any) and NotOlderThan: the latest state satisfies all.
                    _ => (store.rv, None),
                }
            }
        };
        let Some(objects) = store.snapshot(kind, at) else {
            return status_error(
                StatusCode::GONE,
                "Expired",
                format!(
                    "The resourceVersion for the provided list is too old: {at} (current floor {})",
                    store.floor
                ),
                None,
            );
        };
        drop(store);

        let matching: Vec<(&Key, &Value)> = objects
            .iter()
            .filter(|(key, _)| after.as_ref().is_none_or(|after| *key > after))
            .filter(|(_, obj)| filter.matches(kind, obj))
            .collect();
        let page = if limit > 0 {
            &matching[..limit.min(matching.len())]
        } else {
            &matching[..]
        };
        let remaining = matching.len() - page.len();
        let items: Vec<Value> = page.iter().map(|(_, obj)| without_type_meta(obj)).collect();
        let last = page.last().map(|(key, _)| (*key).clone());
        let mut metadata = json!({"resourceVersion": at.to_string()});
        if let (true, Some(last)) = (remaining > 0, last) {
            metadata["continue"] = Value::String(encode_continue(at, &last));
            if filter.is_unselective() {
                metadata["remainingItemCount"] = json!(remaining);
            }
        }
        json_response(
            StatusCode::OK,
            &json!({
                "kind": format!("{}List", kind.kind()),
                "apiVersion": "v1",
                "metadata": metadata,
                "items": items,
            }),
        )
    }
}

pub(crate) async fn handle(
    State(fake): State<Arc<FakeKube>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if fake.unavailable.load(Ordering::SeqCst) {
        fake.note(&method, &uri, StatusCode::SERVICE_UNAVAILABLE);
        let body = status_body(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the server is currently unable to handle the request".into(),
            None,
        );
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response();
    }
    let is_list = RequestInfo::parse(&method, uri.path(), &Query::parse(&uri))
        .is_some_and(|r| r.verb == Verb::List);
    if is_list {
        // Never fails: `fake` owns the sender.
        let _ = fake.lists_held.subscribe().wait_for(|held| !*held).await;
    }
    let query = Query::parse(&uri);
    let write = RequestInfo::parse(&method, uri.path(), &query).filter(RequestInfo::is_pod_write);
    if let Some(res) = write {
        let response = match fake.user(&headers) {
            None => {
                fake.stats.unauthorized.fetch_add(1, Ordering::Relaxed);
                status_error(
                    StatusCode::UNAUTHORIZED,
                    "Unauthorized",
                    "Unauthorized".into(),
                    None,
                )
            }
            Some(user) if !res.allowed(&user) => {
                fake.stats.forbidden.fetch_add(1, Ordering::Relaxed);
                forbidden(&res, &user)
            }
            Some(user) => {
                fake.write_pod(user, &method, &res, &query, &headers, &body)
                    .await
            }
        };
        fake.note(&method, &uri, response.status());
        return response;
    }
    let response = fake.serve(&method, &uri, &headers, &body);
    fake.note(&method, &uri, response.status());
    response
}
