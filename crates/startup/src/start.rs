//! The start-up every role shares: configuration, logging, process
//! hardening, the runtime and the exit code.

use std::future::Future;
use std::path::Path;
use std::process::ExitCode;

use serde_json::Value;

use crate::flags::{GlobalArgs, Overrides};
use crate::logging::{LogFormat, LogWrites};

/// Start-up's lines keep the target they had in the product, so that
/// operators' filters (`lanyard=debug`) still match them.
const TARGET: &str = "lanyard::cli";

/// Makes the process not dumpable: no core file, and no other process of
/// the same user may read its memory, environment or files through
/// `/proc/PID` (`mem`, `environ`, `root`, `fd`). Every role holds tokens or
/// credentials, and a container that shares the sidecar's process namespace
/// (`shareProcessNamespace`, `hostPID`) under the same uid could otherwise
/// read the sidecar's token volume through `/proc/PID/root`. A failure is
/// logged and start-up goes on: it hardens, it does not gate.
fn not_dumpable() {
    #[cfg(target_os = "linux")]
    if let Err(e) =
        rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
    {
        tracing::warn!(target: TARGET, error = %e, "cannot make the process non-dumpable");
    }
}

/// What start-up reads from a loaded configuration.
pub trait Logging {
    /// The log line format.
    fn log_format(&self) -> LogFormat;
    /// The default log filter (`RUST_LOG` overrides).
    fn log_level(&self) -> &str;
}

/// Loads the configuration with `load` (file < environment <
/// `overrides`), starts logging as `writes` says and the runtime, and runs
/// `role` to completion. A bad configuration exits 2 with its key and
/// source; a failed role exits 1.
pub fn run_with<C, E, L, F, Fut>(
    global: &GlobalArgs,
    overrides: Overrides,
    writes: LogWrites,
    load: L,
    role: F,
) -> ExitCode
where
    C: Logging,
    E: std::fmt::Display,
    L: FnOnce(Option<&Path>, Value) -> Result<C, E>,
    F: FnOnce(C) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let loaded = overrides
        .into_value()
        .map_err(|e| e.to_string())
        .and_then(|o| load(global.config.as_deref(), o).map_err(|e| e.to_string()));
    let config = match loaded {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lanyard: {e}");
            return ExitCode::from(2);
        }
    };
    // INVARIANT: declared before the runtime, so it is dropped after it:
    // every line logged until the runtime stops is written.
    let _log = crate::logging::init(config.log_format(), config.log_level(), writes);
    raise_open_files_limit();
    not_dumpable();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lanyard: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(role(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(target: TARGET, error = %e, "lanyard failed");
            eprintln!("lanyard: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Raises the soft limit on open files to the hard limit. Container
/// runtimes start processes with a soft limit of 1,024, which a node's worth
/// of held connections exhausts; each listener bounds its own connections
/// (`http::Limits`) well below the hard limit instead.
fn raise_open_files_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    let (Some(soft), hard) = (limit.current, limit.maximum) else {
        return; // already unlimited
    };
    let target = hard.unwrap_or(u64::MAX);
    if soft >= target {
        return;
    }
    match setrlimit(
        Resource::Nofile,
        Rlimit {
            current: hard,
            maximum: hard,
        },
    ) {
        Ok(()) => {
            tracing::info!(target: TARGET, from = soft, to = target, "raised the open-files limit")
        }
        Err(e) => {
            tracing::warn!(target: TARGET, error = %e, soft, "cannot raise the open-files limit")
        }
    }
}
