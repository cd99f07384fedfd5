//! Lanyard's sidecar, recognised: the one function the mutation and the
//! guard both ask.
//!
//! Why one: they ask two questions about the same container. The guard
//! asks whether an init container that holds cloud-audience tokens is
//! Lanyard's sidecar, whichever version of the webhook injected it; the
//! mutation, reinvoked, asks whether the `lanyard` init container is
//! exactly the one it would inject now. Answered by two functions, they
//! could disagree: the mutation could keep a sidecar the guard then
//! refuses, or the other way round. Here the exact answer is the shape's
//! answer and then more, so it never contradicts it.
//!
//! The shape is what decides what runs and where the tokens go: named
//! `lanyard`, `restartPolicy: Always`, the configured image, command and
//! arguments, no `envFrom`, only the sidecar's own variables with their
//! values (its `IDENTITY_HEADER` is the pod's own, its
//! `LANYARD_HOST_IP` the node's), only the two token mounts at their paths
//! and the empty volume over the API token's path, no lifecycle hook but its
//! own `wait-ready` (or none, as injected before it existed) and no exec
//! probes. The chart's ValidatingAdmissionPolicy checks the same fields in
//! CEL, tested to agree with the guard on the same fixtures.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Lifecycle, Probe};

use super::defaults::{defaulted_container, differing_fields};
use super::vocabulary::{
    InjectionConfig, API_TOKEN_DIR, API_TOKEN_SHIELD_VOLUME, APP_TOKEN_DIR, APP_TOKEN_VOLUME,
    SIDECAR_NAME, TOKENS_VOLUME, TOKEN_DIR,
};

const HOST_IP: &str = "LANYARD_HOST_IP";
const IDENTITY_HEADER: &str = "IDENTITY_HEADER";

/// What Lanyard's sidecar is, field by field (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SidecarShape {
    /// The configured sidecar image.
    pub image: String,
    /// `command`.
    pub command: Vec<String>,
    /// `args`.
    pub args: Vec<String>,
    /// Variables with a fixed literal value.
    pub fixed_env: BTreeMap<String, String>,
    /// The postStart hook's command (`lanyard-sidecar wait-ready`).
    pub post_start: Vec<String>,
}

/// How a container stands against Lanyard's sidecar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recognised {
    /// Exactly the sidecar asked for, once both have the API server's
    /// defaults.
    Exact,
    /// Lanyard's sidecar by its shape; when an exact sidecar was asked for,
    /// the fields in which it differs from it.
    Shape(Vec<String>),
    /// Not Lanyard's sidecar: the fields of the shape it breaks, then,
    /// when an exact sidecar was asked for, the others that differ from it.
    Foreign(Vec<String>),
}

impl Recognised {
    /// Whether the container is Lanyard's sidecar, exactly or by shape.
    pub fn is_lanyards(&self) -> bool {
        !matches!(self, Recognised::Foreign(_))
    }
}

impl SidecarShape {
    /// The shape of the sidecar [`InjectionConfig`] injects, read off the
    /// container the mutation builds (with an AWS binding, so that every
    /// variable it may carry is listed).
    pub fn of(config: &InjectionConfig) -> SidecarShape {
        let built = super::inject::sidecar(config, "", true);
        let fixed_env = built
            .env
            .unwrap_or_default()
            .into_iter()
            .filter(|e| e.value_from.is_none() && e.name != IDENTITY_HEADER)
            .filter_map(|e| Some((e.name, e.value?)))
            .collect();
        SidecarShape {
            image: config.sidecar_image.clone(),
            command: built.command.unwrap_or_default(),
            args: built.args.unwrap_or_default(),
            fixed_env,
            post_start: super::inject::wait_ready_command(config),
        }
    }

    /// How `c`, an init container, stands against Lanyard's sidecar: by
    /// its shape, then, when `exact` is given, against that container.
    ///
    /// INVARIANT: [`Recognised::Exact`] only for a container whose shape
    /// is Lanyard's: the exact comparison runs after the shape's, never
    /// instead of it.
    pub fn recognise(&self, c: &Container, exact: Option<&Container>) -> Recognised {
        let broken: Vec<String> = self
            .broken_fields(c)
            .into_iter()
            .map(String::from)
            .collect();
        let differ = exact
            .map(|exact| {
                differing_fields(
                    &defaulted_container(c.clone()),
                    &defaulted_container(exact.clone()),
                )
            })
            .unwrap_or_default();
        if !broken.is_empty() {
            let mut fields = broken;
            for field in differ {
                if !fields.contains(&field) {
                    fields.push(field);
                }
            }
            Recognised::Foreign(fields)
        } else if exact.is_some() && differ.is_empty() {
            Recognised::Exact
        } else {
            Recognised::Shape(differ)
        }
    }

    /// The fields of `c` that break the shape, in the pod spec's names.
    fn broken_fields(&self, c: &Container) -> Vec<&'static str> {
        let env_ok = c.env.as_deref().unwrap_or_default().iter().all(|e| {
            let from = e.value_from.as_ref();
            match e.name.as_str() {
                HOST_IP => from
                    .and_then(|f| f.field_ref.as_ref())
                    .is_some_and(|f| f.field_path == "status.hostIP"),
                IDENTITY_HEADER => from.is_none(),
                name => {
                    from.is_none()
                        && e.value.is_some()
                        && self.fixed_env.get(name).map(String::as_str) == e.value.as_deref()
                }
            }
        });
        let mounts_ok = c
            .volume_mounts
            .as_deref()
            .unwrap_or_default()
            .iter()
            .all(|m| {
                (m.name == TOKENS_VOLUME && m.mount_path == TOKEN_DIR)
                    || (m.name == APP_TOKEN_VOLUME && m.mount_path == APP_TOKEN_DIR)
                    || (m.name == API_TOKEN_SHIELD_VOLUME && m.mount_path == API_TOKEN_DIR)
            });
        let no_exec = |p: &Option<Probe>| p.as_ref().is_none_or(|p| p.exec.is_none());
        [
            ("name", c.name == SIDECAR_NAME),
            (
                "restartPolicy",
                c.restart_policy.as_deref() == Some("Always"),
            ),
            ("image", c.image.as_deref() == Some(self.image.as_str())),
            (
                "command",
                c.command.as_deref().unwrap_or_default() == self.command.as_slice(),
            ),
            (
                "args",
                c.args.as_deref().unwrap_or_default() == self.args.as_slice(),
            ),
            (
                "envFrom",
                c.env_from.as_deref().unwrap_or_default().is_empty(),
            ),
            ("env", env_ok),
            ("volumeMounts", mounts_ok),
            (
                "lifecycle",
                c.lifecycle.as_ref().is_none_or(|l| self.own_hook(l)),
            ),
            ("startupProbe", no_exec(&c.startup_probe)),
            ("livenessProbe", no_exec(&c.liveness_probe)),
            ("readinessProbe", no_exec(&c.readiness_probe)),
        ]
        .into_iter()
        .filter(|(_, ok)| !ok)
        .map(|(field, _)| field)
        .collect()
    }

    /// Whether `lifecycle` is the sidecar's own: a postStart exec of
    /// `wait-ready` and nothing else. Sidecars injected before the hook
    /// existed have no lifecycle, and are Lanyard's too.
    fn own_hook(&self, lifecycle: &Lifecycle) -> bool {
        lifecycle.pre_stop.is_none()
            && lifecycle.post_start.as_ref().is_some_and(|h| {
                h.http_get.is_none()
                    && h.sleep.is_none()
                    && h.tcp_socket.is_none()
                    && h.exec
                        .as_ref()
                        .and_then(|e| e.command.as_deref())
                        .is_some_and(|c| c == self.post_start.as_slice())
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn built(config: &InjectionConfig) -> Container {
        super::super::inject::sidecar(config, "0123abcd", true)
    }

    #[test]
    fn the_built_sidecar_is_exact_and_one_field_off_is_shape_or_foreign() {
        let config = InjectionConfig::default();
        let shape = SidecarShape::of(&config);
        let own = built(&config);
        assert_eq!(shape.recognise(&own, Some(&own)), Recognised::Exact);
        assert_eq!(shape.recognise(&own, None), Recognised::Shape(vec![]));
        // Without an AWS binding the sidecar carries fewer variables, each
        // with the shape's value.
        let plain = super::super::inject::sidecar(&config, "0123abcd", false);
        assert_eq!(shape.recognise(&plain, Some(&plain)), Recognised::Exact);

        // Another pod's identity header: still Lanyard's shape, not exact.
        let other = super::super::inject::sidecar(&config, "ffff0000", true);
        assert_eq!(
            shape.recognise(&other, Some(&own)),
            Recognised::Shape(vec!["env".into()])
        );

        let mut swapped = own.clone();
        swapped.image = Some("attacker.example/lanyard:1".into());
        swapped.env_from = Some(vec![Default::default()]);
        assert_eq!(
            shape.recognise(&swapped, None),
            Recognised::Foreign(vec!["image".into(), "envFrom".into()])
        );
    }

    #[test]
    fn exact_never_holds_without_the_shape() {
        // A container equal to the one asked for, but both off the shape
        // (as a stale `exact` built from other settings would be): the
        // shape decides.
        let config = InjectionConfig::default();
        let shape = SidecarShape::of(&config);
        let mut stale = built(&config);
        stale.command = Some(vec!["/bin/sh".into(), "-c".into()]);
        assert_eq!(
            shape.recognise(&stale, Some(&stale)),
            Recognised::Foreign(vec!["command".into()])
        );
        assert!(!shape.recognise(&stale, Some(&stale)).is_lanyards());
    }
}
