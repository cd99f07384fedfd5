//! Transparent mode: TCP to the metadata address `169.254.169.254:80`,
//! from the pod's own processes, goes to the sidecar on `127.0.0.1:PORT`.
//!
//! Why: some clients never read the variables the webhook sets
//! (`GCE_METADATA_HOST`, `AZURE_POD_IDENTITY_AUTHORITY_HOST`,
//! `AWS_CONTAINER_*`, …) and call `http://169.254.169.254` directly: older
//! SDKs, curl scripts, google-auth without `GCE_METADATA_*` (which pings
//! `169.254.169.254` and asks `metadata.google.internal`). For pods with
//! the annotation `lanyard.dev/transparent: "true"` the webhook adds an
//! init container, `lanyard-sidecar redirect --port PORT`, which calls
//! [`install`] once in the pod's network namespace and exits.
//!
//! What: one nf_tables table, `ip lanyard_transparent`, with a `nat` chain
//! on the output hook and one rule, `ip daddr 169.254.169.254 tcp dport 80
//! redirect to :PORT` (`nft.rs` has the exact messages). It affects only the
//! namespace it is installed in; nothing on the node changes. IPv6's
//! `fd00:ec2::254` is not redirected.
//!
//! Why by hand: the image is `FROM scratch` with two static binaries and no
//! `nft`; the Rust nftables crates are GPL (rustables) or bind the C
//! libnftnl. What the redirect needs is one netlink datagram of six
//! messages and their acknowledgements, which `netlink.rs` encodes and reads
//! in a few hundred lines, each byte checked against `nft --debug=mnl` in
//! the tests.

mod netlink;
mod nft;

use std::io;
use std::net::Ipv4Addr;
use std::time::Duration;

use rustix::io::Errno;
use rustix::net::{
    netlink::{SocketAddrNetlink, NETFILTER},
    recv, sendto, sockopt, AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType,
};

pub use netlink::MalformedAnswer;
pub use nft::Step;

/// The link-local metadata address every cloud serves its instance
/// metadata on (Azure IMDS, GCE, AWS IMDS).
pub const METADATA_ADDR: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
/// The metadata port.
pub const METADATA_PORT: u16 = 80;
/// The nf_tables table (family `ip`) that holds the redirect.
pub const TABLE: &str = "lanyard_transparent";
/// Its one chain: `type nat hook output priority -100`.
pub const CHAIN: &str = "output";

/// How long to wait for the kernel's answers. They come at once; a silent
/// kernel is a bug, and an init container must not hang the pod on it.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
/// Room for one answer: an error echoes the refused message (the rule,
/// under 500 bytes) after its header.
const ANSWER_BUFFER: usize = 16 * 1024;

/// Why the redirect could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum RedirectError {
    /// Port 0 cannot be a target.
    #[error("the redirect target port must be from 1 to 65535, not 0")]
    ZeroPort,
    /// The process lacks `CAP_NET_ADMIN` in the network namespace.
    #[error(
        "permission denied: installing the metadata redirect needs CAP_NET_ADMIN in the pod's network namespace (the kernel refused {step} with EPERM); run this init container as root (runAsUser: 0) with capabilities add [NET_ADMIN]"
    )]
    PermissionDenied {
        /// The message the kernel refused (the batch itself, usually).
        step: Step,
    },
    /// The kernel refused one message of the batch; nothing was installed.
    #[error("the kernel refused {step}: {source}{hint}")]
    Refused {
        /// The refused message.
        step: Step,
        /// The errno, as an I/O error (its text names it).
        source: io::Error,
        /// What the errno usually means here, or empty.
        hint: &'static str,
    },
    /// No `NETLINK_NETFILTER` socket (a kernel without netfilter netlink).
    #[error("cannot open a NETLINK_NETFILTER socket: {0}")]
    Socket(io::Error),
    /// The batch could not be sent.
    #[error("cannot send the nf_tables batch to the kernel: {0}")]
    Send(io::Error),
    /// The kernel's answer could not be read.
    #[error("cannot read the kernel's answer to the nf_tables batch: {0}")]
    Receive(io::Error),
    /// The kernel did not answer a message in time.
    #[error("the kernel did not acknowledge {step} within {} s", ANSWER_TIMEOUT.as_secs())]
    NoAnswer {
        /// The first message still unanswered.
        step: Step,
    },
    /// An answer that is not netlink as the kernel writes it.
    #[error("malformed netlink answer from the kernel: {0}")]
    Malformed(#[from] MalformedAnswer),
    /// The batch could not be encoded (a length over its field's range).
    #[error("the nf_tables batch does not fit netlink's length fields")]
    Oversized,
}

/// Installs (or, when an earlier run left one, replaces) the redirect of
/// TCP `169.254.169.254:80` to `127.0.0.1:port` in the calling process's
/// network namespace, as one nf_tables transaction. Needs `CAP_NET_ADMIN`
/// there.
pub fn install(port: u16) -> Result<(), RedirectError> {
    if port == 0 {
        return Err(RedirectError::ZeroPort);
    }
    let batch = nft::redirect_batch(port, 1).ok_or(RedirectError::Oversized)?;
    let socket = rustix::net::socket_with(
        AddressFamily::NETLINK,
        SocketType::RAW,
        SocketFlags::CLOEXEC,
        Some(NETFILTER),
    )
    .map_err(|e| RedirectError::Socket(e.into()))?;
    sockopt::set_socket_timeout(&socket, sockopt::Timeout::Recv, Some(ANSWER_TIMEOUT))
        .map_err(|e| RedirectError::Socket(e.into()))?;
    // To the kernel (port id 0), in one datagram: the kernel reads a batch
    // from one message buffer only.
    sendto(
        &socket,
        &batch.bytes,
        SendFlags::empty(),
        &SocketAddrNetlink::new(0, 0),
    )
    .map_err(|e| RedirectError::Send(e.into()))?;
    await_answers(&socket, &batch)
}

/// Reads answers until every acknowledged message has one, or one says the
/// batch failed as a whole.
///
/// The kernel answers errors on the batch itself (no `CAP_NET_ADMIN`, no
/// nf_tables, a failed commit) against `BATCH_BEGIN`, and with nothing
/// else to wait for. Errors on a message come after the whole batch was
/// read and aborted, together with the acknowledgements of the others; the
/// first is the cause (a later message usually fails because of it).
fn await_answers(socket: &impl rustix::fd::AsFd, batch: &nft::Batch) -> Result<(), RedirectError> {
    let mut pending = batch.acked();
    let mut first_error: Option<RedirectError> = None;
    let mut buffer = vec![0u8; ANSWER_BUFFER];
    while let Some(&waiting) = pending.first() {
        let received = match recv(socket, &mut buffer[..], RecvFlags::empty()) {
            Ok((n, _)) => n,
            Err(Errno::INTR) => continue,
            Err(Errno::AGAIN) => {
                return Err(first_error.unwrap_or(RedirectError::NoAnswer {
                    step: batch.step(waiting).unwrap_or(nft::Step::BatchEnd),
                }))
            }
            Err(e) => return Err(RedirectError::Receive(e.into())),
        };
        for ack in netlink::parse_acks(&buffer[..received])? {
            pending.retain(|seq| *seq != ack.seq);
            if ack.errno == 0 {
                continue;
            }
            let Some(step) = batch.step(ack.seq) else {
                continue; // not ours (none expected on a fresh socket)
            };
            let error = refusal(step, ack.errno);
            if step == nft::Step::BatchBegin {
                return Err(error);
            }
            first_error.get_or_insert(error);
        }
    }
    first_error.map_or(Ok(()), Err)
}

/// The error for the kernel refusing `step` with `errno`.
fn refusal(step: Step, errno: i32) -> RedirectError {
    if errno == Errno::PERM.raw_os_error() {
        return RedirectError::PermissionDenied { step };
    }
    let hint = if errno == Errno::NOENT.raw_os_error() || errno == Errno::OPNOTSUPP.raw_os_error() {
        " (does the node's kernel have nf_tables NAT: the nft_chain_nat and nft_redir modules?)"
    } else {
        ""
    };
    RedirectError::Refused {
        step,
        source: io::Error::from_raw_os_error(errno),
        hint,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_zero_is_refused_before_any_syscall() {
        assert!(matches!(install(0), Err(RedirectError::ZeroPort)));
    }

    #[test]
    fn eperm_says_what_capability_is_missing_and_where() {
        let e = refusal(Step::BatchBegin, 1).to_string();
        assert!(e.contains("CAP_NET_ADMIN"), "{e}");
        assert!(e.contains("network namespace"), "{e}");
        assert!(e.contains("NET_ADMIN]"), "{e}");
    }

    #[test]
    fn other_errors_name_the_refused_message_and_errno() {
        let e = refusal(Step::AddChain, 2).to_string();
        assert!(e.starts_with("the kernel refused NFT_MSG_NEWCHAIN"), "{e}");
        assert!(e.contains("No such file or directory"), "{e}");
        assert!(e.contains("nft_chain_nat"), "{e}");
        let e = refusal(Step::AddRule { port: 80 }, 22).to_string();
        assert!(e.contains("NFT_MSG_NEWRULE"), "{e}");
        assert!(e.contains("Invalid argument"), "{e}");
        assert!(!e.contains("nft_chain_nat"), "{e}");
    }
}
