//! `lanyard sidecar`: the pod sidecar (the `lanyard-sidecar` crate,
//! re-exported here), plus standalone mode, which only the full binary
//! has: the sidecar then exchanges with the clouds itself through a broker
//! of its own (exchangers, cache, policy), for a node without an agent.

use std::sync::Arc;

pub use lanyard_sidecar::{probe_ready, token_file, FileTokens, Sidecar};

use crate::cloud::Cloud;
use crate::config::Config;

/// The standalone sidecar's broker: the pod's own bindings, its own token
/// files, direct exchanges with the clouds.
fn standalone_broker(config: &Config) -> anyhow::Result<crate::broker::Broker> {
    let bindings = crate::cloud::Bindings::from_annotations(&config.sidecar.annotations);
    let audiences = config.audiences();
    let implicit = Cloud::ALL
        .into_iter()
        .any(|c| c.implicit_identity() && audiences[c].is_some());
    if bindings.is_empty() && !implicit {
        anyhow::bail!(
            "standalone sidecar without bindings: pass --annotation {}",
            Cloud::binding_annotations("=...")
        );
    }
    let parts = crate::broker::assemble::Parts::new(
        config,
        "sidecar",
        crate::token::Verifier::local_files(),
        Arc::new(crate::directory::file::FixedDirectory(Arc::new(bindings))),
    )?;
    crate::broker::assemble::broker(config, parts, crate::http::client())
}

/// Checks the configuration, binds and serves; standalone (with a broker
/// built from `config`) when `sidecar.standalone` is set.
pub async fn start(config: &Config) -> anyhow::Result<Sidecar> {
    let standalone = standalone(config)?;
    Sidecar::start(&config.sidecar_settings(), standalone).await
}

/// Runs the sidecar until SIGINT/SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let standalone = standalone(&config)?;
    lanyard_sidecar::run(config.sidecar_settings(), standalone).await
}

/// The standalone broker, when the configuration asks for one.
fn standalone(config: &Config) -> anyhow::Result<Option<Arc<dyn crate::broker::TokenBroker>>> {
    if !config.sidecar.standalone {
        return Ok(None);
    }
    let broker: Arc<dyn crate::broker::TokenBroker> = Arc::new(standalone_broker(config)?);
    Ok(Some(broker))
}
