//! Lanyard's own objects in a pod, recognised by their content, never by
//! their names.
//!
//! Why: the pod spec is the author's. A container named `lanyard` may be
//! the sidecar a first pass of the webhook added (reinvocation), one a
//! controller copied from a mutated pod, or the author's own image waiting
//! for the cloud-token volume; a volume named `lanyard-tokens` may be
//! Lanyard's projection or an `emptyDir` whose contents the author
//! chooses. Only the first two may stand. So each of Lanyard's names in the
//! pod must carry exactly what the webhook would inject for this pod now,
//! after the defaults the API server fills in ([`super::defaults`]);
//! anything else denies the pod with a message naming the object and the
//! fields that differ. And the cloud-token volume is mounted by the sidecar
//! alone.
//!
//! The sidecar is recognised by [`SidecarShape::recognise`], the function
//! the guard uses too: here it must be exactly the one built now, which it
//! can only be if it has the shape the guard lets hold tokens.

use k8s_openapi::api::core::v1::{Container, PodSpec, Volume};

use super::defaults::{defaulted_container, defaulted_volume, differing_fields};
use super::recognise::{Recognised, SidecarShape};
use super::vocabulary::{
    Denial, API_TOKEN_SHIELD_VOLUME, APP_TOKEN_VOLUME, REDIRECT_NAME, SIDECAR_NAME, TOKENS_VOLUME,
};

/// What the webhook would inject into this pod now.
pub(super) struct Expected<'a> {
    /// The sidecar; `None` when Lanyard injects none (or, since it is then
    /// never consulted, when the pod has no `lanyard` init container).
    pub sidecar: Option<OwnSidecar<'a>>,
    /// The transparent-mode init container (whether or not the pod asks
    /// for transparent mode: the exact container is harmless either way).
    pub redirect: Option<&'a Container>,
    /// The cloud-token volume; `None` when no cloud applies.
    pub tokens: Option<&'a Volume>,
    /// The app-token volume; `None` without an AWS binding.
    pub app_token: Option<&'a Volume>,
    /// The empty volume over the sidecar's API token path; `None` when no
    /// cloud applies.
    pub shield: Option<&'a Volume>,
}

/// Lanyard's sidecar for this pod, as [`SidecarShape::recognise`] needs it.
#[derive(Clone, Copy)]
pub(super) struct OwnSidecar<'a> {
    /// The shape of Lanyard's sidecar under the running configuration.
    pub shape: &'a SidecarShape,
    /// The sidecar built now, with the pod's existing `IDENTITY_HEADER`
    /// (the one free value in it).
    pub built: &'a Container,
}

/// Which of Lanyard's objects the pod already carries, each one checked.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Present {
    pub sidecar: bool,
    pub redirect: bool,
    pub tokens: bool,
    pub app_token: bool,
    pub shield: bool,
}

/// Checks every object of the pod that bears one of Lanyard's names, and
/// every mount of the cloud-token volume.
///
/// INVARIANT: on `Ok`, each of Lanyard's names in the pod is exactly
/// Lanyard's object, and no container but the sidecar mounts
/// [`TOKENS_VOLUME`]: the mutation may then leave what is present alone
/// and add only what is missing.
pub(super) fn check(spec: &PodSpec, pod_ref: &str, expected: &Expected) -> Result<Present, Denial> {
    let mut present = Present::default();
    let init = spec.init_containers.as_deref().unwrap_or_default();
    let ephemeral = spec.ephemeral_containers.as_deref().unwrap_or_default();
    let deny = |what: String, why: String| {
        Err(Denial {
            code: 403,
            message: format!(
                "pod {pod_ref}: {what} {why}; Lanyard injects its own objects, so remove it from the pod spec (or rename it)"
            ),
        })
    };
    let mut sidecar_index = None;
    for (index, container) in init.iter().enumerate() {
        let claimed = match container.name.as_str() {
            SIDECAR_NAME => claim(&mut present.sidecar, expected.sidecar, |own| {
                match own.shape.recognise(container, Some(own.built)) {
                    Recognised::Exact => Ok(()),
                    Recognised::Shape(differ) | Recognised::Foreign(differ) => Err(differ),
                }
            }),
            REDIRECT_NAME => claim(&mut present.redirect, expected.redirect, |want| {
                equal(container, want, defaulted_container)
            }),
            _ => continue,
        };
        if let Err(why) = claimed {
            return deny(format!("init container {:?}", container.name), why);
        }
        if container.name == SIDECAR_NAME {
            sidecar_index = Some(index);
        }
    }
    let named = spec
        .containers
        .iter()
        .map(|c| ("app container", &c.name))
        .chain(ephemeral.iter().map(|c| ("ephemeral container", &c.name)));
    for (list, name) in named {
        if name == SIDECAR_NAME || name == REDIRECT_NAME {
            return deny(
                format!("{list} {name:?}"),
                "bears the name of a container Lanyard injects as an init container".into(),
            );
        }
    }
    for volume in spec.volumes.as_deref().unwrap_or_default() {
        let (want, slot) = match volume.name.as_str() {
            TOKENS_VOLUME => (expected.tokens, &mut present.tokens),
            APP_TOKEN_VOLUME => (expected.app_token, &mut present.app_token),
            API_TOKEN_SHIELD_VOLUME => (expected.shield, &mut present.shield),
            _ => continue,
        };
        if let Err(why) = claim(slot, want, |want| equal(volume, want, defaulted_volume)) {
            return deny(format!("volume {:?}", volume.name), why);
        }
    }
    let mounts = |mounts: Option<&Vec<k8s_openapi::api::core::v1::VolumeMount>>| {
        mounts.is_some_and(|m| m.iter().any(|m| m.name == TOKENS_VOLUME))
    };
    let others = init
        .iter()
        .enumerate()
        .filter(|(i, _)| Some(*i) != sidecar_index)
        .map(|(_, c)| ("init container", &c.name, mounts(c.volume_mounts.as_ref())))
        .chain(
            spec.containers
                .iter()
                .map(|c| ("app container", &c.name, mounts(c.volume_mounts.as_ref()))),
        )
        .chain(ephemeral.iter().map(|c| {
            (
                "ephemeral container",
                &c.name,
                mounts(c.volume_mounts.as_ref()),
            )
        }));
    for (list, name, mounted) in others {
        if mounted {
            return deny(
                format!("{list} {name:?} mounts volume {TOKENS_VOLUME:?}, which"),
                "holds the cloud-audience tokens and is for Lanyard's sidecar alone".into(),
            );
        }
    }
    Ok(present)
}

/// Takes an object as Lanyard's for its name (`slot`), or says why it is
/// not: the name appears twice, Lanyard injects no such object here, or it
/// is not the one Lanyard would inject (`same` names the fields that
/// differ).
fn claim<W>(
    slot: &mut bool,
    want: Option<W>,
    same: impl FnOnce(W) -> Result<(), Vec<String>>,
) -> Result<(), String> {
    if *slot {
        return Err("appears twice".into());
    }
    let Some(want) = want else {
        return Err("is not Lanyard's: Lanyard injects no such object into this pod".into());
    };
    same(want)
        .map_err(|differ| format!("is not Lanyard's (it differs in {})", differ.join(", ")))?;
    *slot = true;
    Ok(())
}

/// Whether `actual` equals `want` once both have the API server's
/// `defaults`; else the fields that differ.
fn equal<T: Clone + serde::Serialize>(
    actual: &T,
    want: &T,
    defaults: fn(T) -> T,
) -> Result<(), Vec<String>> {
    let differ = differing_fields(&defaults(actual.clone()), &defaults(want.clone()));
    if differ.is_empty() {
        Ok(())
    } else {
        Err(differ)
    }
}
