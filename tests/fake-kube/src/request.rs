//! What a request asks: its verb, resource and query, list continue
//! tokens, and the RBAC refusal.

use super::*;

/// Continue tokens carry the list's revision and the last key served, like
/// the real server's (`{"v":"meta.k8s.io/v1","rv":N,"start":"ns/name\0"}`);
/// later pages are served from that revision.
pub(crate) fn encode_continue(rv: u64, last: &Key) -> String {
    let token =
        json!({"v": "meta.k8s.io/v1", "rv": rv, "start": format!("{}/{}\u{0}", last.0, last.1)});
    URL_SAFE_NO_PAD.encode(token.to_string())
}

pub(crate) fn decode_continue(token: &str) -> Option<(u64, Option<Key>)> {
    let bytes = URL_SAFE_NO_PAD.decode(token.trim_end_matches('=')).ok()?;
    let value: Value = serde_json::from_slice(&bytes).ok()?;
    if value.get("v")?.as_str()? != "meta.k8s.io/v1" {
        return None;
    }
    let rv = value.get("rv")?.as_u64()?;
    let start = value.get("start")?.as_str()?.strip_suffix('\u{0}')?;
    let (ns, name) = start.split_once('/')?;
    Some((rv, Some((ns.to_string(), name.to_string()))))
}

/// List items go out without `kind`/`apiVersion`, as kube-apiserver sends
/// them for built-in types.
pub(crate) fn without_type_meta(obj: &Value) -> Value {
    let mut obj = obj.clone();
    if let Some(map) = obj.as_object_mut() {
        map.remove("kind");
        map.remove("apiVersion");
    }
    obj
}

/// Query parameters, percent-decoded.
pub(crate) struct Query(HashMap<String, String>);

impl Query {
    pub(crate) fn parse(uri: &Uri) -> Query {
        Query(
            url::form_urlencoded::parse(uri.query().unwrap_or_default().as_bytes())
                .into_owned()
                .collect(),
        )
    }

    pub(crate) fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    /// A boolean parameter as Go's strconv.ParseBool reads it.
    pub(crate) fn flag(&self, key: &str) -> bool {
        matches!(
            self.get(key),
            Some("1" | "t" | "T" | "true" | "TRUE" | "True")
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verb {
    Get,
    List,
    Watch,
    Create,
    Update,
    Patch,
    Delete,
    DeleteCollection,
    Other,
}

impl Verb {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Verb::Get => "get",
            Verb::List => "list",
            Verb::Watch => "watch",
            Verb::Create => "create",
            Verb::Update => "update",
            Verb::Patch => "patch",
            Verb::Delete => "delete",
            Verb::DeleteCollection => "deletecollection",
            Verb::Other => "proxy",
        }
    }
}

/// A resource request, classified as kube-apiserver's RequestInfoFactory
/// does (`/api/v1/...`, `/apis/GROUP/VERSION/...`, `namespaces/NS/...`,
/// `watch/...`), which is what RBAC decides on.
#[derive(Debug, PartialEq)]
pub(crate) struct RequestInfo {
    pub(crate) verb: Verb,
    pub(crate) group: String,
    pub(crate) version: String,
    pub(crate) namespace: Option<String>,
    pub(crate) resource: String,
    pub(crate) name: Option<String>,
    pub(crate) subresource: Option<String>,
}

impl RequestInfo {
    /// `None` for non-resource URLs (discovery, `/version`, OIDC, ...).
    pub(crate) fn parse(method: &Method, path: &str, query: &Query) -> Option<RequestInfo> {
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        let (group, version, mut rest) = match parts.as_slice() {
            ["api", version, rest @ ..] if !rest.is_empty() => ("", *version, rest),
            ["apis", group, version, rest @ ..] if !rest.is_empty() => (*group, *version, rest),
            _ => return None,
        };
        let mut watch_prefix = false;
        if rest.first() == Some(&"watch") {
            watch_prefix = true;
            rest = &rest[1..];
        }
        let mut namespace = None;
        if rest.first() == Some(&"namespaces") && rest.len() > 1 {
            namespace = Some(rest[1].to_string());
            if rest.len() > 2 && !matches!(rest[2], "status" | "finalize") {
                rest = &rest[2..];
            }
        }
        let resource = rest.first().filter(|r| !r.is_empty())?.to_string();
        let name = rest.get(1).map(|n| n.to_string());
        let subresource = rest.get(2).map(|s| s.to_string());
        let verb = if watch_prefix {
            Verb::Watch
        } else {
            match *method {
                Method::GET | Method::HEAD if name.is_some() => Verb::Get,
                Method::GET | Method::HEAD if query.flag("watch") => Verb::Watch,
                Method::GET | Method::HEAD => Verb::List,
                Method::POST => Verb::Create,
                Method::PUT => Verb::Update,
                Method::PATCH => Verb::Patch,
                Method::DELETE if name.is_some() => Verb::Delete,
                Method::DELETE => Verb::DeleteCollection,
                _ => Verb::Other,
            }
        };
        Some(RequestInfo {
            verb,
            group: group.to_string(),
            version: version.to_string(),
            namespace,
            resource,
            name,
            subresource,
        })
    }

    /// A write of a pod (create, update, patch, delete) or of its
    /// `ephemeralcontainers`, which goes through admission.
    pub(crate) fn is_pod_write(&self) -> bool {
        self.group.is_empty()
            && self.resource == "pods"
            && match self.subresource.as_deref() {
                None => matches!(
                    self.verb,
                    Verb::Create | Verb::Update | Verb::Patch | Verb::Delete
                ),
                Some("ephemeralcontainers") => true,
                Some(_) => false,
            }
    }

    /// RBAC: the administrator (`system:masters`) may do anything; Lanyard's
    /// token may get/list/watch ServiceAccounts, Pods and Namespaces (no
    /// subresources), create and patch Events and create TokenReviews.
    /// Nothing else.
    pub(crate) fn allowed(&self, user: &User) -> bool {
        if user.groups.iter().any(|g| g == "system:masters") {
            return true;
        }
        if self.subresource.is_some() {
            return false;
        }
        match (self.group.as_str(), self.resource.as_str()) {
            ("", "serviceaccounts" | "pods" | "namespaces") => {
                matches!(self.verb, Verb::Get | Verb::List | Verb::Watch)
            }
            ("events.k8s.io", "events") => matches!(self.verb, Verb::Create | Verb::Patch),
            ("authentication.k8s.io", "tokenreviews") => self.verb == Verb::Create,
            _ => false,
        }
    }
}

pub(crate) fn forbidden(res: &RequestInfo, user: &User) -> Response {
    let resource = match &res.subresource {
        Some(sub) => format!("{}/{sub}", res.resource),
        None => res.resource.clone(),
    };
    let subject = match &res.name {
        Some(name) => format!("{} \"{name}\"", res.resource),
        None => res.resource.clone(),
    };
    let scope = match &res.namespace {
        Some(ns) => format!("in the namespace \"{ns}\""),
        None => "at the cluster scope".to_string(),
    };
    let message = format!(
        "{subject} is forbidden: User \"{}\" cannot {} resource \"{resource}\" in API group \"{}\" {scope}",
        user.name,
        res.verb.as_str(),
        res.group
    );
    let mut details = json!({"kind": res.resource});
    if let Some(name) = &res.name {
        details["name"] = json!(name);
    }
    if !res.group.is_empty() {
        details["group"] = json!(res.group);
    }
    status_error(StatusCode::FORBIDDEN, "Forbidden", message, Some(details))
}
