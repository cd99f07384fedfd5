//! `lanyard-sidecar`: the pod sidecar alone, the same code and flags as
//! `lanyard sidecar`. It is a binary of its own so that the process in
//! every opted-in pod links (and pages in) only the sidecar's code.
//!
//! `lanyard-sidecar redirect --port PORT` is transparent mode's init
//! container: it installs the metadata redirect and exits (see
//! `lanyard_sidecar::transparent`). Without a subcommand it serves.

use std::process::ExitCode;

use clap::Parser;

use lanyard_sidecar::args::{SidecarArgs, SidecarCommand};
use lanyard_sidecar::config::Settings;
use lanyard_startup::logging::LogWrites;
use lanyard_startup::GlobalArgs;

#[derive(Parser)]
#[command(
    name = "lanyard-sidecar",
    version,
    about = "Lanyard's pod sidecar: every SDK endpoint on loopback, backed by the node agent (or, standalone, by the clouds directly).",
    args_conflicts_with_subcommands = true
)]
struct SidecarCli {
    #[command(flatten)]
    global: GlobalArgs,
    #[command(flatten)]
    sidecar: SidecarArgs,
    #[command(subcommand)]
    command: Option<SidecarCommand>,
}

fn main() -> ExitCode {
    let cli = SidecarCli::parse();
    if let Some(command) = &cli.command {
        return command.run(&cli.global);
    }
    let overrides = cli.sidecar.overrides(&cli.global);
    // Standalone mode is the full binary's: the slim one has no broker
    // to give and says so (`lanyard sidecar --standalone`).
    lanyard_startup::run_with(
        &cli.global,
        overrides,
        LogWrites::Direct,
        Settings::load,
        |settings| lanyard_sidecar::run(settings, None),
    )
}
