//! `lanyard-sidecar`: the pod sidecar alone, the same code and flags as
//! `lanyard sidecar`. It is a binary of its own so that the process in
//! every opted-in pod links (and pages in) only the sidecar's code.

use std::process::ExitCode;

use clap::Parser;

use lanyard::cli::{self, GlobalArgs, SidecarArgs};

#[derive(Parser)]
#[command(
    name = "lanyard-sidecar",
    version,
    about = "Lanyard's pod sidecar: every SDK endpoint on loopback, backed by the node agent (or, standalone, by the clouds directly)."
)]
struct SidecarCli {
    #[command(flatten)]
    global: GlobalArgs,
    #[command(flatten)]
    sidecar: SidecarArgs,
}

fn main() -> ExitCode {
    let cli = SidecarCli::parse();
    let overrides = cli.sidecar.overrides(&cli.global);
    cli::run(&cli.global, overrides, lanyard::sidecar::run)
}
