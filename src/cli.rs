//! Command-line pieces of the `lanyard` binary: the global flags and
//! start-up are `lanyard-startup`'s, the sidecar's flags and subcommands
//! `lanyard-sidecar`'s (the slim binary shares both), re-exported here;
//! this module binds start-up to the full configuration.

use std::future::Future;
use std::process::ExitCode;

pub use lanyard_sidecar::args::{RedirectArgs, SidecarArgs, SidecarCommand, WaitReadyArgs};
pub use lanyard_startup::{GlobalArgs, Overrides, UsageError};

use crate::config::Config;
use crate::telemetry::{LogFormat, LogWrites};

impl lanyard_startup::Logging for Config {
    fn log_format(&self) -> LogFormat {
        self.log_format
    }
    fn log_level(&self) -> &str {
        &self.log_level
    }
}

/// Loads the configuration (file < environment < `overrides`), starts
/// logging and the runtime, and runs `role` to completion. A bad
/// configuration exits 2 with its key and source; a failed role exits 1.
pub fn run<F, Fut>(global: &GlobalArgs, overrides: Overrides, role: F) -> ExitCode
where
    F: FnOnce(Config) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    lanyard_startup::run_with(global, overrides, LogWrites::Batched, Config::load, role)
}
