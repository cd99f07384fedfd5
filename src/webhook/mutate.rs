//! The pod mutation: a Lanyard sidecar, the projected tokens it needs, and
//! the environment that points every SDK in the pod at it.
//!
//! Pure: a pod, its ServiceAccount's bindings and the webhook's settings in,
//! one JSON Patch (against the pod exactly as the API server sent it) out.
//! Every step first looks at what the pod already has, so that a second
//! invocation (`reinvocationPolicy: IfNeeded`) or a pod that already carries
//! the sidecar gets nothing twice, and nothing a user set is overwritten.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use k8s_openapi::api::core::v1::{Container, EnvVar, HostAlias, Pod, PodSpec};
use serde_json::value::RawValue;

use crate::cloud::{Bindings, Cloud};
use crate::serve::sdk_env::SdkEnv;
use crate::transparent::METADATA_ADDR;

use super::inject::{
    api_token_shield_volume, app_token_volume, mount, plain_env, redirect, sidecar, tokens_volume,
};
use super::own;
use super::patch::{Op, Operation, Patch};
use super::recognise::SidecarShape;
use super::vocabulary::*;

/// What a mutation did, for logs and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InjectedSummary {
    /// Clouds whose credentials the pod gets, in a fixed order.
    pub clouds: Vec<Cloud>,
    /// Containers (init or app, not the sidecar) this patch changes.
    pub containers: Vec<String>,
    /// Whether this patch adds the sidecar.
    pub sidecar_added: bool,
    /// Whether this patch adds transparent mode's init container.
    pub redirect_added: bool,
    /// Whether the pod already had the sidecar.
    pub already_injected: bool,
}

/// The outcome for an allowed pod: possibly empty patch, warnings for the
/// user.
#[derive(Debug, Clone)]
pub struct Mutation {
    /// The JSON Patch against the pod as the API server sent it; empty when
    /// nothing changes.
    pub patch: Patch,
    /// Admission warnings, which kubectl shows the user (conflicting
    /// credential variables, for one).
    pub warnings: Vec<String>,
    /// What the patch does, for logs and tests.
    pub summary: InjectedSummary,
}

impl Mutation {
    fn nothing(warnings: Vec<String>) -> Self {
        Mutation {
            patch: Patch(Vec::new()),
            warnings,
            summary: InjectedSummary::default(),
        }
    }

    /// Whether the patch changes nothing.
    pub fn is_empty(&self) -> bool {
        self.patch.0.is_empty()
    }
}

/// The pod's ServiceAccount name, as the API server will default it: the
/// integrator looks bindings up under this name.
pub fn service_account_name(pod: &Pod) -> &str {
    pod.spec
        .as_ref()
        .and_then(|s| s.service_account_name.as_deref())
        .filter(|s| !s.is_empty())
        .unwrap_or("default")
}

/// Decides and builds the injection for one pod being created in
/// `namespace` under a ServiceAccount with `bindings`.
///
/// `IDENTITY_HEADER` (the App Service endpoint's SSRF guard, shared by the
/// sidecar and the apps) is the sidecar's existing value when the pod
/// already has one, else the value an app container already sets, else a
/// fresh random one. Random rather than derived from the pod's name: a
/// value anyone can compute guards nothing. Stable across reinvocation
/// because the second call sees the first call's sidecar.
pub fn mutate(
    pod: &Pod,
    namespace: &str,
    bindings: &Bindings,
    config: &InjectionConfig,
) -> Result<Mutation, Denial> {
    mutate_with(pod, namespace, bindings, config, || {
        crate::secret::random_token(32)
    })
}

fn mutate_with(
    pod: &Pod,
    namespace: &str,
    bindings: &Bindings,
    config: &InjectionConfig,
    new_identity_header: impl FnOnce() -> String,
) -> Result<Mutation, Denial> {
    let meta = &pod.metadata;
    let opted_in = meta
        .labels
        .as_ref()
        .and_then(|l| l.get(INJECT_LABEL))
        .is_some_and(|v| v == "true");
    let Some(spec) = pod.spec.as_ref() else {
        return Ok(Mutation::nothing(Vec::new()));
    };
    if !opted_in {
        return Ok(Mutation::nothing(Vec::new()));
    }
    let pod_ref = pod_ref(pod, namespace);
    if spec.host_network == Some(true) {
        return Err(Denial {
            code: 403,
            message: format!(
                "pod {pod_ref} has {INJECT_LABEL}=true and hostNetwork: true; Lanyard's loopback endpoints would be the node's, shared with every host-network pod. Remove the label or hostNetwork"
            ),
        });
    }
    let annotations = meta.annotations.clone().unwrap_or_default();
    let expiration = token_expiration(&annotations)?;
    let transparent = transparent(&annotations)?;
    let sa = service_account_name(pod);
    let mut warnings = Vec::new();
    let mut clouds = Vec::new();
    for cloud in Cloud::ALL {
        let named = bindings.names(cloud);
        let configured = config.audiences[cloud].is_some();
        if named && !configured {
            warnings.push(format!(
                "lanyard: service account {namespace}/{sa} names a {} identity ({}) but this webhook has no {cloud} audience configured; {cloud} credentials not injected",
                cloud.upstream(),
                cloud.binding_annotation(),
            ));
        }
        for refusal in bindings.known_refusals(cloud, &config.node_identities) {
            warnings.push(format!(
                "lanyard: service account {namespace}/{sa}: {refusal}; the pod's requests for that identity will be refused"
            ));
        }
        // A cloud whose identity needs no annotation applies to a pod
        // bound to any cloud at all.
        let implicit = cloud.implicit_identity() && !bindings.is_empty();
        if configured && (named || implicit) {
            clouds.push(cloud);
        }
    }
    let app_token_needed = clouds.iter().any(|c| c.app_token());

    let init = spec.init_containers.as_deref().unwrap_or_default();
    let existing_sidecar = init.iter().find(|c| c.name == SIDECAR_NAME);
    // Lanyard's objects already in the pod must be exactly what it would
    // inject now (the sidecar's IDENTITY_HEADER, random per pod, is the one
    // free value); what is missing is added below.
    let injects = !clouds.is_empty();
    let tokens = injects.then(|| tokens_volume(config, &clouds, expiration));
    let app_token = app_token_needed.then(|| app_token_volume(config, expiration));
    let shield = injects.then(api_token_shield_volume);
    // Built only to compare with a sidecar the pod already has.
    let own_sidecar = existing_sidecar.filter(|_| injects).map(|c| {
        let header = literal_env(c, "IDENTITY_HEADER");
        let built = sidecar(
            config,
            header.as_deref().unwrap_or_default(),
            app_token_needed,
        );
        (SidecarShape::of(config), built)
    });
    let own_redirect = injects.then(|| redirect(config));
    let present = own::check(
        spec,
        &pod_ref,
        &own::Expected {
            sidecar: own_sidecar
                .as_ref()
                .map(|(shape, built)| own::OwnSidecar { shape, built }),
            redirect: own_redirect.as_ref(),
            tokens: tokens.as_ref(),
            app_token: app_token.as_ref(),
            shield: shield.as_ref(),
        },
    )?;
    if bindings.is_empty() {
        return Ok(Mutation::nothing(vec![format!(
            "lanyard: service account {namespace}/{sa} has no cloud binding ({}); no credentials injected",
            Cloud::binding_annotations(""),
        )]));
    }
    if !injects {
        warnings.push(format!(
            "lanyard: no cloud applies to pod {pod_ref}; no credentials injected"
        ));
        return Ok(Mutation::nothing(warnings));
    }
    if let Some(why) = super::guard::agent_host(&config.agent_url)
        .and_then(|host| super::guard::agent_redirect(spec, &host))
    {
        return Err(Denial {
            code: 403,
            message: format!(
                "pod {pod_ref} {why}, which decides where Lanyard's sidecar sends the pod's tokens; remove it"
            ),
        });
    }
    let targets = targets(
        init,
        &spec.containers,
        &annotations,
        &pod_ref,
        &mut warnings,
    );
    let identity_header = existing_sidecar
        .and_then(|c| literal_env(c, "IDENTITY_HEADER"))
        .or_else(|| {
            targets
                .iter()
                .find_map(|(_, _, c)| literal_env(c, "IDENTITY_HEADER"))
        })
        .unwrap_or_else(new_identity_header);

    // The variables every targeted container gets, unless it sets them.
    let host_port = format!("{LOOPBACK}:{}", config.port);
    let wanted = SdkEnv {
        host_port: &host_port,
        clouds: &clouds,
        bindings,
        defaults: &config.sdk,
        identity_header: &identity_header,
        app_token_file: APP_TOKEN_FILE,
    }
    .vars();
    let plan = ContainerPlan {
        wanted: &wanted,
        clouds: &clouds,
        app_token: app_token_needed,
        identity_header: &identity_header,
    };

    let mut ops = Vec::new();
    let mut touched = Vec::new();
    for target in &targets {
        if patch_container(*target, &plan, &mut ops, &mut warnings)? {
            touched.push(target.2.name.clone());
        }
    }
    port_conflicts(init.iter().chain(&spec.containers), config, &mut warnings);

    let volumes = spec.volumes.as_deref().unwrap_or_default();
    let mut new_volumes = Vec::new();
    for (volume, present) in [
        (tokens, present.tokens),
        (app_token, present.app_token),
        (shield, present.shield),
    ] {
        if let Some(volume) = volume.filter(|_| !present) {
            new_volumes.push(to_json(&volume)?);
        }
    }
    push_list_items(
        &mut ops,
        &["spec", "volumes"],
        volumes.is_empty(),
        new_volumes,
    )?;

    if transparent {
        host_aliases(spec, &mut ops, &mut warnings)?;
    }

    // INVARIANT: last, so that the init container indices used above
    // still hold.
    let sidecar_added = !present.sidecar;
    let redirect_added = transparent && !present.redirect;
    let new_sidecar = sidecar_added.then(|| sidecar(config, &identity_header, app_token_needed));
    add_init_containers(
        init,
        own_redirect.filter(|_| redirect_added).as_ref(),
        new_sidecar.as_ref(),
        &mut ops,
    )?;

    Ok(Mutation {
        patch: Patch(ops),
        warnings,
        summary: InjectedSummary {
            clouds,
            containers: touched,
            sidecar_added,
            redirect_added,
            already_injected: present.sidecar,
        },
    })
}

/// The containers that get the SDK environment, with the list each is in
/// and its index there: every container but Lanyard's own and those
/// [`SKIP_CONTAINERS_ANNOTATION`] names (each name that is no container of
/// the pod is a warning).
fn targets<'p>(
    init: &'p [Container],
    containers: &'p [Container],
    annotations: &BTreeMap<String, String>,
    pod_ref: &str,
    warnings: &mut Vec<String>,
) -> Vec<(&'static str, usize, &'p Container)> {
    let skip: BTreeSet<&str> = annotations
        .get(SKIP_CONTAINERS_ANNOTATION)
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .collect()
        })
        .unwrap_or_default();
    for name in &skip {
        if !init.iter().chain(containers).any(|c| c.name == *name) {
            warnings.push(format!(
                "lanyard: {SKIP_CONTAINERS_ANNOTATION} names {name:?}, which is not a container of pod {pod_ref}"
            ));
        }
    }
    init.iter()
        .enumerate()
        .map(|(i, c)| ("initContainers", i, c))
        .chain(
            containers
                .iter()
                .enumerate()
                .map(|(i, c)| ("containers", i, c)),
        )
        .filter(|(_, _, c)| {
            c.name != SIDECAR_NAME && c.name != REDIRECT_NAME && !skip.contains(c.name.as_str())
        })
        .collect()
}

/// What every targeted container is given, decided once per pod.
struct ContainerPlan<'a> {
    /// The SDK variables, by name.
    wanted: &'a [(&'static str, String)],
    /// The clouds injected.
    clouds: &'a [Cloud],
    /// Whether the apps get the app-facing token.
    app_token: bool,
    /// The sidecar's `IDENTITY_HEADER`.
    identity_header: &'a str,
}

/// Appends to `ops` what one container needs: the SDK variables it does
/// not set itself, `NO_PROXY` covering the loopback, and (with AWS) the app
/// token's mount; and warns of what it sets that will defeat them. Returns
/// whether any operation was added.
fn patch_container(
    (list, index, container): (&'static str, usize, &Container),
    plan: &ContainerPlan<'_>,
    ops: &mut Vec<Operation>,
    warnings: &mut Vec<String>,
) -> Result<bool, Denial> {
    let before = ops.len();
    let index = index.to_string();
    let env = container.env.as_deref().unwrap_or_default();
    let names: HashMap<&str, (usize, &EnvVar)> = env
        .iter()
        .enumerate()
        .map(|(i, e)| (e.name.as_str(), (i, e)))
        .collect();
    let mut additions: Vec<EnvVar> = Vec::new();
    for (name, value) in plan.wanted {
        if names.contains_key(name) {
            continue;
        }
        // A container that chose a value in one of two variables naming
        // the same setting (a cloud's `linked` pair, the AWS region) gets
        // that choice in the other too (a dependent variable, expanded by
        // the kubelet from the earlier entry), so its SDKs never disagree.
        let chosen = Cloud::ALL
            .iter()
            .flat_map(|&cloud| crate::serve::linked(cloud))
            .find(|(this, other)| this == name && names.contains_key(other));
        match chosen {
            Some((_, other)) => additions.push(plain_env(name, &format!("$({other})"))),
            None => additions.push(plain_env(name, value)),
        }
    }
    let secrets = Cloud::ALL
        .iter()
        .flat_map(|&cloud| crate::serve::secrets(cloud));
    for &(secret, endpoint) in secrets {
        let wanted = plan.wanted.iter().any(|(name, _)| *name == secret);
        let Some((_, var)) = names.get(secret).filter(|_| wanted) else {
            continue;
        };
        if var.value_from.is_some() || var.value.as_deref() != Some(plan.identity_header) {
            warnings.push(format!(
                "lanyard: container {:?} sets its own {secret}, which differs from the sidecar's; its {endpoint} credential requests will be refused",
                container.name
            ));
        }
    }
    let proxy = no_proxy_plan(
        &names,
        container.env_from.as_ref().is_some_and(|f| !f.is_empty()),
    );
    for (i, value) in proxy.replace {
        // An empty value is left out of the pod the API server sends
        // (`value` is omitempty), and `replace` needs the member to
        // exist: `add` sets it either way.
        let has_value = env.get(i).is_some_and(|var| var.value.is_some());
        let op = if has_value { Op::Replace } else { Op::Add };
        let at = i.to_string();
        ops.push(operation(
            op,
            &["spec", list, &index, "env", &at, "value"],
            &value,
        )?);
    }
    additions.extend(proxy.add);
    for name in proxy.cannot_extend {
        warnings.push(format!(
            "lanyard: container {:?} takes {name} from a reference that cannot be extended; make sure it excludes {LOOPBACK} or its SDKs may send credential requests to a proxy",
            container.name
        ));
    }
    let conflicts = plan.clouds.iter().flat_map(|&c| {
        let each = crate::serve::conflicts(c).iter();
        each.map(move |(name, why)| (c, name, why))
    });
    for (cloud, name, why) in conflicts {
        if names.contains_key(name) {
            warnings.push(format!(
                "lanyard: container {:?} sets {name}: {why}, so it will not use Lanyard's {cloud} credentials",
                container.name
            ));
        }
    }
    push_list_items(
        ops,
        &["spec", list, &index, "env"],
        env.is_empty(),
        additions.iter().map(to_json).collect::<Result<_, _>>()?,
    )?;
    if plan.app_token {
        let mounts = container.volume_mounts.as_deref().unwrap_or_default();
        if !mounts.iter().any(|m| m.name == APP_TOKEN_VOLUME) {
            if mounts
                .iter()
                .any(|m| m.mount_path.trim_end_matches('/') == APP_TOKEN_DIR)
            {
                let clouds: Vec<&str> = plan
                    .clouds
                    .iter()
                    .filter(|c| c.app_token())
                    .map(|c| c.upstream())
                    .collect();
                warnings.push(format!(
                    "lanyard: container {:?} already mounts something at {APP_TOKEN_DIR}; the app token is not mounted and its {} credential requests will be refused",
                    container.name,
                    clouds.join(", ")
                ));
            } else {
                push_list_items(
                    ops,
                    &["spec", list, &index, "volumeMounts"],
                    mounts.is_empty(),
                    vec![to_json(&mount(APP_TOKEN_VOLUME, APP_TOKEN_DIR))?],
                )?;
            }
        }
    }
    Ok(ops.len() > before)
}

/// Warns of every container port the sidecar's own ports would collide
/// with (the pod shares one network namespace).
fn port_conflicts<'p>(
    containers: impl Iterator<Item = &'p Container>,
    config: &InjectionConfig,
    warnings: &mut Vec<String>,
) {
    for container in containers {
        for port in container.ports.as_deref().unwrap_or_default() {
            let p = port.container_port;
            if p == i32::from(config.port) || p == i32::from(config.probe_port) {
                warnings.push(format!(
                    "lanyard: container {:?} declares port {p}, which Lanyard's sidecar listens on; one of them will fail to bind",
                    container.name
                ));
            }
        }
    }
}

/// Adds the redirect and the sidecar init containers (each when given).
/// The redirect goes first: it installs its rule and exits before the
/// sidecar starts, and so before anything that could call
/// 169.254.169.254. They go before the pod's own sidecar when it has one
/// (reinvocation), else at the front.
fn add_init_containers(
    init: &[Container],
    redirect: Option<&Container>,
    sidecar: Option<&Container>,
    ops: &mut Vec<Operation>,
) -> Result<(), Denial> {
    let new_init = redirect
        .into_iter()
        .chain(sidecar)
        .map(to_json)
        .collect::<Result<Vec<_>, _>>()?;
    if init.is_empty() {
        return push_list_items(ops, &["spec", "initContainers"], true, new_init);
    }
    let at = init
        .iter()
        .position(|c| c.name == SIDECAR_NAME)
        .unwrap_or(0);
    for (offset, container) in new_init.into_iter().enumerate() {
        let index = (at + offset).to_string();
        ops.push(operation(
            Op::Add,
            &["spec", "initContainers", &index],
            &container,
        )?);
    }
    Ok(())
}

/// Transparent mode's `hostAliases` entry: [`METADATA_HOSTNAMES`] to the
/// metadata address, unless the pod already maps
/// `metadata.google.internal` (its own choice, kept; reported when it is
/// another address). A name the pod already maps is not mapped twice.
fn host_aliases(
    spec: &PodSpec,
    ops: &mut Vec<Operation>,
    warnings: &mut Vec<String>,
) -> Result<(), Denial> {
    let aliases = spec.host_aliases.as_deref().unwrap_or_default();
    let mapped = |name: &str| {
        aliases.iter().find(|a| {
            a.hostnames
                .as_deref()
                .unwrap_or_default()
                .iter()
                .any(|h| h == name)
        })
    };
    let metadata_ip = METADATA_ADDR.to_string();
    if let Some(alias) = mapped(METADATA_HOSTNAMES[0]) {
        if alias.ip != metadata_ip {
            warnings.push(format!(
                "lanyard: the pod's hostAliases map {} to {}, not {metadata_ip}; left as is, so clients that call it bypass transparent mode",
                METADATA_HOSTNAMES[0], alias.ip
            ));
        }
        return Ok(());
    }
    let hostnames: Vec<String> = METADATA_HOSTNAMES
        .iter()
        .filter(|name| mapped(name).is_none())
        .map(|name| name.to_string())
        .collect();
    let entry = HostAlias {
        ip: metadata_ip,
        hostnames: Some(hostnames),
    };
    push_list_items(
        ops,
        &["spec", "hostAliases"],
        aliases.is_empty(),
        vec![to_json(&entry)?],
    )
}

/// `namespace/name` for messages; a pod created with `generateName` has no
/// name yet at admission.
fn pod_ref(pod: &Pod, namespace: &str) -> String {
    match (&pod.metadata.name, &pod.metadata.generate_name) {
        (Some(name), _) if !name.is_empty() => format!("{namespace}/{name}"),
        (_, Some(prefix)) if !prefix.is_empty() => format!("{namespace}/{prefix}*"),
        _ => format!("{namespace}/<unnamed>"),
    }
}

fn token_expiration(annotations: &BTreeMap<String, String>) -> Result<i64, Denial> {
    let Some(raw) = annotations.get(TOKEN_EXPIRATION_ANNOTATION) else {
        return Ok(DEFAULT_TOKEN_EXPIRATION);
    };
    match raw.trim().parse::<i64>() {
        Ok(s) if (MIN_TOKEN_EXPIRATION..=MAX_TOKEN_EXPIRATION).contains(&s) => Ok(s),
        _ => Err(Denial::bad_request(format!(
            "pod annotation {TOKEN_EXPIRATION_ANNOTATION} must be a whole number of seconds from {MIN_TOKEN_EXPIRATION} to {MAX_TOKEN_EXPIRATION}, got {raw:?}"
        ))),
    }
}

/// Whether the pod asks for transparent mode: `"true"` yes; `"false"` or
/// no annotation, no; anything else is refused rather than guessed at.
fn transparent(annotations: &BTreeMap<String, String>) -> Result<bool, Denial> {
    match annotations.get(TRANSPARENT_ANNOTATION).map(String::as_str) {
        None | Some("false") => Ok(false),
        Some("true") => Ok(true),
        Some(other) => Err(Denial::bad_request(format!(
            "pod annotation {TRANSPARENT_ANNOTATION} must be \"true\" or \"false\", got {other:?}"
        ))),
    }
}

/// The value of a variable the container sets literally (not from a
/// reference), when non-empty.
fn literal_env(container: &Container, name: &str) -> Option<String> {
    container
        .env
        .as_deref()?
        .iter()
        .rev()
        .find(|e| e.name == name && e.value_from.is_none())
        .and_then(|e| e.value.clone())
        .filter(|v| !v.is_empty())
}

/// Changes to NO_PROXY / no_proxy for one container.
#[derive(Debug, Default, PartialEq)]
struct NoProxyPlan {
    /// Existing entries (index into env) whose value is extended.
    replace: Vec<(usize, String)>,
    add: Vec<EnvVar>,
    /// Set from a ConfigMap/Secret/field: cannot be read, so not extended.
    cannot_extend: Vec<&'static str>,
}

/// Makes both spellings exclude 127.0.0.1 without losing what the pod
/// already excludes.
///
/// Python reads `no_proxy` before `NO_PROXY`, Go the reverse, so both must
/// agree. A spelling the container sets literally is extended in place
/// (`a,b` → `a,b,127.0.0.1`). A missing spelling becomes `$(OTHER)`, which
/// the kubelet expands to the other's final value. When neither is set in
/// `env` but the container has `envFrom`, either may come from there, and
/// an `env` entry would hide it; the kubelet expands `$(NAME)` from
/// `envFrom` too, so `$(NO_PROXY),$(no_proxy),127.0.0.1` keeps both (a
/// reference to an undefined variable stays literal, which no host matches).
fn no_proxy_plan(names: &HashMap<&str, (usize, &EnvVar)>, has_env_from: bool) -> NoProxyPlan {
    const UPPER: &str = "NO_PROXY";
    const LOWER: &str = "no_proxy";
    let mut plan = NoProxyPlan::default();
    let alias = |other: &str| format!("$({other})");
    for (name, other) in [(UPPER, LOWER), (LOWER, UPPER)] {
        if let Some((i, var)) = names.get(name) {
            if var.value_from.is_some() {
                plan.cannot_extend.push(name);
                continue;
            }
            let value = var.value.as_deref().unwrap_or("");
            let listed = value.split(',').any(|e| e.trim() == LOOPBACK);
            if !listed && value.trim() != alias(other) {
                let extended = if value.trim().is_empty() {
                    LOOPBACK.to_string()
                } else {
                    format!("{},{LOOPBACK}", value.trim_end_matches(','))
                };
                plan.replace.push((*i, extended));
            }
        }
    }
    match (names.get(UPPER), names.get(LOWER)) {
        (Some(_), Some(_)) => {}
        (None, None) if has_env_from => {
            plan.add.push(plain_env(
                UPPER,
                &format!("$({UPPER}),$({LOWER}),{LOOPBACK}"),
            ));
            plan.add.push(plain_env(LOWER, &alias(UPPER)));
        }
        (None, None) => {
            plan.add.push(plain_env(UPPER, LOOPBACK));
            plan.add.push(plain_env(LOWER, LOOPBACK));
        }
        (Some((_, present)), None) | (None, Some((_, present))) => {
            let (missing, other) = if names.contains_key(UPPER) {
                (LOWER, UPPER)
            } else {
                (UPPER, LOWER)
            };
            // A reference-set spelling was not extended above: extend here.
            let value = if present.value_from.is_some() {
                format!("$({other}),{LOOPBACK}")
            } else {
                alias(other)
            };
            plan.add.push(plain_env(missing, &value));
        }
    }
    plan
}

/// `value` as JSON text, for a patch operation.
fn to_json<T: serde::Serialize + ?Sized>(value: &T) -> Result<Box<RawValue>, Denial> {
    serde_json::value::to_raw_value(value).map_err(cannot_encode)
}

fn cannot_encode(e: serde_json::Error) -> Denial {
    Denial {
        code: 500,
        message: format!("lanyard webhook cannot encode its patch: {e}"),
    }
}

fn operation<T: serde::Serialize + ?Sized>(
    op: Op,
    tokens: &[&str],
    value: &T,
) -> Result<Operation, Denial> {
    Operation::new(op, tokens, value).map_err(cannot_encode)
}

/// Appends `items` to the array at `tokens`: one `add` of the whole array
/// when it is missing (or null, or empty: `add` replaces a member), one
/// `add .../-` per item otherwise.
fn push_list_items(
    ops: &mut Vec<Operation>,
    tokens: &[&str],
    missing: bool,
    items: Vec<Box<RawValue>>,
) -> Result<(), Denial> {
    if items.is_empty() {
        return Ok(());
    }
    if missing {
        ops.push(operation(Op::Add, tokens, &items)?);
        return Ok(());
    }
    let mut append: Vec<&str> = tokens.to_vec();
    append.push("-");
    for item in items {
        ops.push(Operation::raw(Op::Add, &append, item));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cloud::azure;
    use k8s_openapi::api::core::v1::EnvVarSource;
    use serde_json::{json, Value};

    fn pod(value: Value) -> Pod {
        serde_json::from_value(value).unwrap()
    }

    fn azure() -> Bindings {
        Bindings {
            azure: vec![azure::Binding {
                client_id: "client".into(),
                tenant_id: None,
                object_id: None,
                resource_id: None,
                app: None,
            }],
            ..Default::default()
        }
    }

    fn apply(pod: &Value, m: &Mutation) -> Value {
        let mut doc = pod.clone();
        let patch: json_patch::Patch =
            serde_json::from_slice(&serde_json::to_vec(&m.patch).unwrap()).unwrap();
        json_patch::patch(&mut doc, &patch).unwrap();
        doc
    }

    #[test]
    fn a_minimal_pod_gets_whole_arrays_and_the_sidecar() {
        let raw = json!({"metadata": {"generateName": "p-", "labels": {INJECT_LABEL: "true"}},
                         "spec": {"containers": [{"name": "app"}]}});
        let m = mutate_with(
            &pod(raw.clone()),
            "ns",
            &azure(),
            &InjectionConfig::default(),
            || "h".into(),
        )
        .unwrap();
        let out = apply(&raw, &m);
        assert_eq!(out["spec"]["initContainers"][0]["name"], SIDECAR_NAME);
        assert_eq!(out["spec"]["initContainers"][0]["restartPolicy"], "Always");
        let volumes: Vec<&str> = out["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["name"].as_str().unwrap())
            .collect();
        assert_eq!(
            volumes,
            [TOKENS_VOLUME, API_TOKEN_SHIELD_VOLUME],
            "no app token without AWS"
        );
        assert_eq!(out["spec"]["volumes"][1]["emptyDir"], json!({}));
        // The sidecar's own mount at the API token's path keeps the
        // ServiceAccount admission plugin's out of it.
        assert!(out["spec"]["initContainers"][0]["volumeMounts"]
            .as_array()
            .unwrap()
            .contains(&json!({"name": API_TOKEN_SHIELD_VOLUME, "mountPath": API_TOKEN_DIR, "readOnly": true})));
        assert!(
            !out["spec"]["containers"][0]["volumeMounts"].is_array(),
            "the apps keep the API server's mount"
        );
        let env = &out["spec"]["containers"][0]["env"];
        assert!(env
            .as_array()
            .unwrap()
            .contains(&json!({"name": "IDENTITY_HEADER", "value": "h"})));
        assert_eq!(m.summary.clouds, vec![Cloud::Azure]);
        assert!(m.summary.sidecar_added && !m.summary.already_injected);
        // Reinvocation: nothing more.
        let again = mutate_with(
            &pod(out),
            "ns",
            &azure(),
            &InjectionConfig::default(),
            || "other".into(),
        )
        .unwrap();
        assert!(again.is_empty(), "{:?}", again.patch);
        assert!(again.summary.already_injected);
    }

    /// A container whose own `IDENTITY_HEADER` (Azure's `secrets`) differs
    /// from the sidecar's (the first container's value, which the sidecar
    /// adopts) is left alone and warned of, naming the endpoint that will
    /// refuse it.
    #[test]
    fn a_containers_own_secret_is_warned_of_by_the_endpoint_that_refuses_it() {
        let raw = json!({"metadata": {"name": "p", "labels": {INJECT_LABEL: "true"}},
               "spec": {"containers": [
                   {"name": "first", "env": [{"name": "IDENTITY_HEADER", "value": "mine"}]},
                   {"name": "second", "env": [{"name": "IDENTITY_HEADER", "value": "other"}]}]}});
        let (m, out) = run(&raw);
        assert_eq!(m.warnings.len(), 1, "{:?}", m.warnings);
        assert!(
            m.warnings[0].contains("\"second\" sets its own IDENTITY_HEADER")
                && m.warnings[0].contains("App Service credential requests will be refused"),
            "{:?}",
            m.warnings
        );
        let env = out["spec"]["containers"][1]["env"].as_array().unwrap();
        assert!(env.contains(&json!({"name": "IDENTITY_HEADER", "value": "other"})));
    }

    fn transparent_pod(extra_spec: Value) -> Value {
        let mut raw = json!({"metadata": {"name": "p",
                                          "labels": {INJECT_LABEL: "true"},
                                          "annotations": {TRANSPARENT_ANNOTATION: "true"}},
                             "spec": {"securityContext": {"runAsNonRoot": true, "runAsUser": 1000},
                                      "containers": [{"name": "app"}]}});
        if let (Some(spec), Some(extra)) = (raw["spec"].as_object_mut(), extra_spec.as_object()) {
            spec.extend(extra.clone());
        }
        raw
    }

    fn init_names(pod: &Value) -> Vec<&str> {
        pod["spec"]["initContainers"]
            .as_array()
            .map(|a| a.iter().filter_map(|c| c["name"].as_str()).collect())
            .unwrap_or_default()
    }

    fn run(raw: &Value) -> (Mutation, Value) {
        let m = mutate_with(
            &pod(raw.clone()),
            "ns",
            &azure(),
            &InjectionConfig::default(),
            || "h".into(),
        )
        .unwrap();
        let out = apply(raw, &m);
        (m, out)
    }

    #[test]
    fn a_transparent_pod_gets_the_redirect_first_then_the_sidecar_and_host_aliases() {
        let raw = transparent_pod(json!({}));
        let (m, out) = run(&raw);
        assert_eq!(init_names(&out), [REDIRECT_NAME, SIDECAR_NAME]);
        let redirect = &out["spec"]["initContainers"][0];
        assert_eq!(
            redirect["command"],
            json!(["lanyard-sidecar", "redirect", "--port", "8642"])
        );
        assert_eq!(redirect["image"], out["spec"]["initContainers"][1]["image"]);
        assert!(
            redirect.get("restartPolicy").is_none(),
            "runs to completion"
        );
        assert!(redirect.get("env").is_none(), "gets no SDK variables");
        assert!(redirect.get("args").is_none());
        let sc = &redirect["securityContext"];
        assert_eq!(sc["runAsUser"], 0);
        assert_eq!(
            sc["runAsNonRoot"], false,
            "overrides the pod's runAsNonRoot"
        );
        assert_eq!(sc["allowPrivilegeEscalation"], false);
        assert_eq!(sc["privileged"], false);
        assert_eq!(sc["readOnlyRootFilesystem"], true);
        assert_eq!(
            sc["capabilities"],
            json!({"add": ["NET_ADMIN"], "drop": ["ALL"]})
        );
        assert_eq!(sc["seccompProfile"], json!({"type": "RuntimeDefault"}));
        assert_eq!(redirect["resources"]["requests"]["memory"], "16Mi");
        assert_eq!(
            out["spec"]["hostAliases"],
            json!([{"ip": "169.254.169.254", "hostnames": ["metadata.google.internal", "metadata"]}])
        );
        assert!(m.summary.redirect_added && m.summary.sidecar_added);
        assert!(m.warnings.is_empty(), "{:?}", m.warnings);
        // The pod as stored is still a valid Pod.
        let typed: Pod = serde_json::from_value(out.clone()).unwrap();
        assert_eq!(typed.spec.unwrap().host_aliases.unwrap().len(), 1);
        // Reinvocation: nothing more.
        let (again, _) = run(&out);
        assert!(again.is_empty(), "{:?}", again.patch);
        assert!(!again.summary.redirect_added);
    }

    #[test]
    fn existing_init_containers_and_host_aliases_are_kept_after_ours() {
        let raw = transparent_pod(json!({
            "initContainers": [{"name": "setup"}],
            "hostAliases": [{"ip": "10.0.0.1", "hostnames": ["db"]}],
        }));
        let (m, out) = run(&raw);
        assert_eq!(init_names(&out), [REDIRECT_NAME, SIDECAR_NAME, "setup"]);
        assert_eq!(
            out["spec"]["hostAliases"],
            json!([{"ip": "10.0.0.1", "hostnames": ["db"]},
                   {"ip": "169.254.169.254", "hostnames": ["metadata.google.internal", "metadata"]}])
        );
        assert!(
            out["spec"]["initContainers"][2]["env"].is_array(),
            "setup gets the variables"
        );
        assert_eq!(m.summary.containers, ["setup", "app"]);
        let (again, _) = run(&out);
        assert!(again.is_empty(), "{:?}", again.patch);
    }

    #[test]
    fn an_injected_pod_without_the_redirect_gets_it_just_before_its_sidecar() {
        let (_, plain) = run(
            &json!({"metadata": {"name": "p", "labels": {INJECT_LABEL: "true"}},
                                     "spec": {"initContainers": [{"name": "setup"}],
                                              "containers": [{"name": "app"}]}}),
        );
        assert_eq!(init_names(&plain), [SIDECAR_NAME, "setup"]);
        assert!(plain["spec"].get("hostAliases").is_none());
        // Moved behind another init container, the sidecar keeps its place.
        let mut raw = plain.clone();
        let inits = raw["spec"]["initContainers"].as_array_mut().unwrap();
        inits.swap(0, 1);
        raw["metadata"]["annotations"] = json!({TRANSPARENT_ANNOTATION: "true"});
        let (m, out) = run(&raw);
        assert_eq!(init_names(&out), ["setup", REDIRECT_NAME, SIDECAR_NAME]);
        assert!(m.summary.redirect_added && !m.summary.sidecar_added);
        assert!(m.summary.already_injected);
    }

    #[test]
    fn a_pod_that_maps_the_metadata_names_keeps_its_mapping() {
        let elsewhere = transparent_pod(json!({
            "hostAliases": [{"ip": "10.9.9.9", "hostnames": ["metadata.google.internal"]}],
        }));
        let (m, out) = run(&elsewhere);
        assert_eq!(out["spec"]["hostAliases"], elsewhere["spec"]["hostAliases"]);
        assert_eq!(m.warnings.len(), 1, "{:?}", m.warnings);
        assert!(m.warnings[0].contains("10.9.9.9"), "{}", m.warnings[0]);
        let same = transparent_pod(json!({
            "hostAliases": [{"ip": "169.254.169.254", "hostnames": ["metadata.google.internal"]}],
        }));
        let (m, out) = run(&same);
        assert_eq!(out["spec"]["hostAliases"], same["spec"]["hostAliases"]);
        assert!(m.warnings.is_empty(), "{:?}", m.warnings);
        let short_name = transparent_pod(json!({
            "hostAliases": [{"ip": "10.1.1.1", "hostnames": ["metadata"]}],
        }));
        let (_, out) = run(&short_name);
        assert_eq!(
            out["spec"]["hostAliases"][1],
            json!({"ip": "169.254.169.254", "hostnames": ["metadata.google.internal"]})
        );
    }

    #[test]
    fn the_transparent_annotation_is_true_false_or_refused() {
        for off in [None, Some("false")] {
            let mut raw = transparent_pod(json!({}));
            match off {
                Some(v) => raw["metadata"]["annotations"][TRANSPARENT_ANNOTATION] = json!(v),
                None => raw["metadata"]["annotations"] = json!({}),
            }
            let (m, out) = run(&raw);
            assert_eq!(init_names(&out), [SIDECAR_NAME], "{off:?}");
            assert!(out["spec"].get("hostAliases").is_none(), "{off:?}");
            assert!(!m.summary.redirect_added);
        }
        for bad in ["yes", "True", "", "1"] {
            let mut raw = transparent_pod(json!({}));
            raw["metadata"]["annotations"][TRANSPARENT_ANNOTATION] = json!(bad);
            let d = mutate_with(
                &pod(raw),
                "ns",
                &azure(),
                &InjectionConfig::default(),
                || "h".into(),
            )
            .unwrap_err();
            assert_eq!(d.code, 400, "{bad:?}");
            assert!(d.message.contains(TRANSPARENT_ANNOTATION), "{}", d.message);
            assert!(d.message.contains(&format!("{bad:?}")), "{}", d.message);
        }
    }

    #[test]
    fn an_app_container_named_like_the_redirect_is_refused_in_either_mode() {
        let raw = transparent_pod(json!({"containers": [{"name": REDIRECT_NAME}]}));
        let mut off = raw.clone();
        off["metadata"]["annotations"] = json!({});
        for raw in [raw, off] {
            let d = mutate_with(
                &pod(raw),
                "ns",
                &azure(),
                &InjectionConfig::default(),
                || "h".into(),
            )
            .unwrap_err();
            assert_eq!(d.code, 403);
            assert!(
                d.message
                    .contains(&format!("app container {REDIRECT_NAME:?}")),
                "{}",
                d.message
            );
        }
    }

    #[test]
    fn an_app_hop_through_an_identity_not_on_the_node_is_warned_of() {
        let mut bindings = azure();
        bindings.azure[0].app = Some(azure::AppHop {
            client_id: "app".into(),
            tenant_id: None,
        });
        let raw = json!({"metadata": {"name": "p", "labels": {INJECT_LABEL: "true"}},
                         "spec": {"containers": [{"name": "app"}]}});
        let mut config = InjectionConfig::default();
        let m = mutate_with(&pod(raw.clone()), "ns", &bindings, &config, || "h".into()).unwrap();
        assert!(!m.is_empty(), "the pod is still injected");
        assert!(
            m.warnings
                .iter()
                .any(|w| w.contains("AADSTS700231") && w.contains("azure.node_identities")),
            "{:?}",
            m.warnings
        );
        config.node_identities = vec!["CLIENT".into()];
        let m = mutate_with(&pod(raw), "ns", &bindings, &config, || "h".into()).unwrap();
        assert!(m.warnings.is_empty(), "{:?}", m.warnings);
    }

    #[test]
    fn config_validation() {
        assert_eq!(InjectionConfig::default().validate(), Ok(()));
        let same_ports = InjectionConfig {
            probe_port: 8642,
            ..InjectionConfig::default()
        };
        assert!(same_ports.validate().unwrap_err().contains("8642"));
        let mut empty_gcp = InjectionConfig::default();
        empty_gcp.audiences[Cloud::Gcp] = Some(" ".into());
        assert!(empty_gcp.validate().unwrap_err().contains("gcp"));
    }

    #[test]
    fn token_expiration_bounds() {
        let with = |v: &str| {
            token_expiration(&BTreeMap::from([(
                TOKEN_EXPIRATION_ANNOTATION.to_string(),
                v.to_string(),
            )]))
        };
        assert_eq!(token_expiration(&BTreeMap::new()), Ok(3600));
        assert_eq!(with(" 600 "), Ok(600));
        assert_eq!(with("86400"), Ok(86400));
        for bad in ["599", "86401", "1h", "", "-5"] {
            let d = with(bad).unwrap_err();
            assert_eq!(d.code, 400);
            assert!(
                d.message.contains(TOKEN_EXPIRATION_ANNOTATION),
                "{}",
                d.message
            );
        }
    }

    #[test]
    fn no_proxy_cases() {
        let var = |n: &str, v: Option<&str>, from: bool| EnvVar {
            name: n.into(),
            value: v.map(Into::into),
            value_from: from.then(EnvVarSource::default),
        };
        let plan = |vars: &[EnvVar], env_from: bool| {
            let names = vars
                .iter()
                .enumerate()
                .map(|(i, e)| (e.name.as_str(), (i, e)))
                .collect();
            no_proxy_plan(&names, env_from)
        };
        let p = plan(&[], false);
        assert_eq!(
            p.add,
            vec![
                plain_env("NO_PROXY", "127.0.0.1"),
                plain_env("no_proxy", "127.0.0.1")
            ]
        );
        let p = plan(&[], true);
        assert_eq!(
            p.add[0].value.as_deref(),
            Some("$(NO_PROXY),$(no_proxy),127.0.0.1")
        );
        assert_eq!(p.add[1].value.as_deref(), Some("$(NO_PROXY)"));
        let p = plan(
            &[
                var("X", Some("1"), false),
                var("NO_PROXY", Some("a,b"), false),
            ],
            false,
        );
        assert_eq!(p.replace, vec![(1, "a,b,127.0.0.1".to_string())]);
        assert_eq!(p.add, vec![plain_env("no_proxy", "$(NO_PROXY)")]);
        let p = plan(
            &[
                var("no_proxy", Some("a, 127.0.0.1"), false),
                var("NO_PROXY", Some("$(no_proxy)"), false),
            ],
            false,
        );
        assert_eq!(p, NoProxyPlan::default());
        let p = plan(&[var("NO_PROXY", None, true)], false);
        assert_eq!(p.cannot_extend, vec!["NO_PROXY"]);
        assert_eq!(p.add, vec![plain_env("no_proxy", "$(NO_PROXY),127.0.0.1")]);
    }
}
