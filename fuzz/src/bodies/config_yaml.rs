//! Configuration loading: the input is the YAML file `--config` names,
//! loaded with [`Config::load`] (defaults, the file, the environment,
//! flags; then validation) as every role loads it at start.
//!
//! A configuration that loads is then handed to what each role builds
//! from it first: the webhook's injection settings (validated again) and
//! the cache's. Beside "never panics", a configuration that loads and is
//! written back as YAML loads again to the same configuration, so that what
//! `Config` serializes (defaults, documentation, Helm values) is always a
//! valid file.

use std::io::Write;

use lanyard::config::Config;
use lanyard::webhook::InjectionConfig;

/// Runs one input.
pub fn run(data: &[u8]) {
    let Some(config) = load(data) else {
        return;
    };
    let _ = InjectionConfig::from_config(&config).validate();
    let _ = config.cache.to_cache_config();
    let Ok(yaml) = serde_norway::to_string(&config) else {
        panic!("a loaded configuration does not serialize: {config:?}");
    };
    match load(yaml.as_bytes()) {
        Some(again) => assert_eq!(again, config, "written back as\n{yaml}"),
        None => panic!("a loaded configuration, written back, does not load:\n{yaml}"),
    }
}

/// Loads `data` as the configuration file.
fn load(data: &[u8]) -> Option<Config> {
    let mut file = tempfile::Builder::new()
        .prefix("lanyard-fuzz-")
        .suffix(".yaml")
        .tempfile()
        .ok()?;
    file.write_all(data).ok()?;
    file.flush().ok()?;
    Config::load(Some(file.path()), serde_json::json!({})).ok()
}
