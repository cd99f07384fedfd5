//! The syslog exporter's transports: RFC 5424 messages over TCP (RFC 6587
//! octet counting), over TLS (RFC 5425), and over RELP, rsyslog's reliable
//! protocol, whose per-message acknowledgements let the exporter advance
//! its cursor only past what the receiver took.
//!
//! Each audit record is one message: facility `authpriv`, severity
//! `warning` for a refusal and `info` otherwise, APP-NAME `lanyard`,
//! MSGID the record's type, and the record's JSON as the message.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use super::export::Shipper;

/// How records travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// Plain TCP: no acknowledgement (a dropped connection may lose what
    /// was in flight).
    Tcp,
    /// TLS: as TCP, encrypted and the receiver authenticated.
    Tls,
    /// RELP: every message acknowledged.
    Relp,
}

/// Where and how to send.
#[derive(Debug, Clone)]
pub struct SyslogTarget {
    /// The protocol.
    pub protocol: Protocol,
    /// Host name (for TLS, the name the certificate must carry).
    pub host: String,
    /// Port.
    pub port: u16,
    /// CA certificates (PEM) trusted for TLS; `None`: the system's.
    pub ca: Option<PathBuf>,
    /// HOSTNAME of each message (the node).
    pub hostname: String,
}

/// Why a target is refused.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    /// Not `tcp://`, `tls://` or `relp://` with a host and port.
    #[error("{0}: expected tcp://HOST:PORT, tls://HOST:PORT or relp://HOST:PORT")]
    Url(String),
    /// The CA file cannot be used.
    #[error("syslog CA file {path}: {error}")]
    Ca {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        error: String,
    },
}

impl SyslogTarget {
    /// Parses `tcp://HOST:PORT`, `tls://HOST:PORT` or `relp://HOST:PORT`.
    pub fn parse(url: &str, ca: Option<PathBuf>, hostname: &str) -> Result<Self, TargetError> {
        let bad = || TargetError::Url(url.to_string());
        let parsed = url::Url::parse(url).map_err(|_| bad())?;
        let protocol = match parsed.scheme() {
            "tcp" => Protocol::Tcp,
            "tls" => Protocol::Tls,
            "relp" => Protocol::Relp,
            _ => return Err(bad()),
        };
        let host = parsed.host_str().ok_or_else(bad)?;
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let port = parsed.port().ok_or_else(bad)?;
        if parsed.path().len() > 1 || parsed.query().is_some() {
            return Err(bad());
        }
        Ok(SyslogTarget {
            protocol,
            host,
            port,
            ca,
            hostname: if hostname.is_empty() {
                "-".into()
            } else {
                hostname
                    .chars()
                    .filter(|c| c.is_ascii_graphic())
                    .take(255)
                    .collect()
            },
        })
    }
}

const FACILITY_AUTHPRIV: u8 = 10;
const SEVERITY_WARNING: u8 = 4;
const SEVERITY_INFO: u8 = 6;
/// How long a connect, a write or an acknowledgement may take.
const TIMEOUT: Duration = Duration::from_secs(10);

/// One RFC 5424 message for a record line.
pub fn message(record: &[u8], hostname: &str) -> Vec<u8> {
    #[derive(serde::Deserialize)]
    struct Head<'a> {
        #[serde(default)]
        time: &'a str,
        #[serde(rename = "type", default)]
        kind: &'a str,
        #[serde(default)]
        decision: Option<Verdict<'a>>,
    }
    #[derive(serde::Deserialize)]
    struct Verdict<'a> {
        #[serde(default)]
        verdict: &'a str,
    }
    let head: Option<Head<'_>> = serde_json::from_slice(record).ok();
    let time = head.as_ref().map_or("", |h| h.time);
    let kind = head.as_ref().map_or("", |h| h.kind);
    let severity = match head.as_ref().and_then(|h| h.decision.as_ref()) {
        Some(d) if d.verdict == "deny" => SEVERITY_WARNING,
        _ => SEVERITY_INFO,
    };
    let nil = |s: &str| -> String {
        let s: String = s
            .chars()
            .filter(|c| c.is_ascii_graphic())
            .take(32)
            .collect();
        if s.is_empty() {
            "-".into()
        } else {
            s
        }
    };
    let mut m = format!(
        "<{}>1 {} {hostname} lanyard {} {} - ",
        FACILITY_AUTHPRIV * 8 + severity,
        if time.is_empty() { "-" } else { time },
        std::process::id(),
        nil(kind),
    )
    .into_bytes();
    m.extend_from_slice(record);
    m
}

trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// Sends records to a syslog receiver, connecting (again) when needed.
pub struct SyslogShipper {
    target: SyslogTarget,
    tls: Option<tokio_rustls::TlsConnector>,
    conn: Option<BufReader<Box<dyn Stream>>>,
    txnr: u64,
}

impl SyslogShipper {
    /// A shipper to `target` (TLS roots loaded now: a bad CA file is a
    /// start-up error).
    pub fn new(target: SyslogTarget) -> Result<Self, TargetError> {
        let tls = match target.protocol {
            Protocol::Tls => Some(connector(target.ca.as_deref())?),
            _ => None,
        };
        Ok(SyslogShipper {
            target,
            tls,
            conn: None,
            txnr: 0,
        })
    }

    async fn connect(&mut self) -> std::io::Result<()> {
        let addr = (self.target.host.as_str(), self.target.port);
        let tcp = tokio::time::timeout(TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out")
            })??;
        tcp.set_nodelay(true)?;
        let stream: Box<dyn Stream> = match &self.tls {
            Some(tls) => {
                let name = rustls_pki_types::ServerName::try_from(self.target.host.clone())
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
                Box::new(
                    tokio::time::timeout(TIMEOUT, tls.connect(name, tcp))
                        .await
                        .map_err(|_| {
                            std::io::Error::new(
                                std::io::ErrorKind::TimedOut,
                                "TLS handshake timed out",
                            )
                        })??,
                )
            }
            None => Box::new(tcp),
        };
        let mut conn = BufReader::new(stream);
        if self.target.protocol == Protocol::Relp {
            self.txnr = 1;
            let offer = format!(
                "relp_version=0\nrelp_software=lanyard,{},https://lanyard.dev\ncommands=syslog",
                env!("CARGO_PKG_VERSION")
            );
            let frame = format!("1 open {} {offer}\n", offer.len());
            conn.get_mut().write_all(frame.as_bytes()).await?;
            let (txnr, data) = read_rsp(&mut conn).await?;
            if txnr != 1 || !data.starts_with(b"200") {
                return Err(std::io::Error::other(format!(
                    "RELP open refused: {}",
                    String::from_utf8_lossy(&data)
                )));
            }
        }
        self.conn = Some(conn);
        Ok(())
    }

    async fn send(&mut self, records: &[Vec<u8>]) -> std::io::Result<()> {
        if self.conn.is_none() {
            self.connect().await?;
        }
        let protocol = self.target.protocol;
        let mut out = Vec::with_capacity(records.len() * 900);
        let first = self.txnr + 1;
        for r in records {
            let m = message(r, &self.target.hostname);
            match protocol {
                Protocol::Relp => {
                    self.txnr += 1;
                    out.extend_from_slice(format!("{} syslog {} ", self.txnr, m.len()).as_bytes());
                    out.extend_from_slice(&m);
                    out.push(b'\n');
                }
                Protocol::Tcp | Protocol::Tls => {
                    out.extend_from_slice(format!("{} ", m.len()).as_bytes());
                    out.extend_from_slice(&m);
                }
            }
        }
        let Some(conn) = self.conn.as_mut() else {
            return Err(std::io::Error::other("not connected"));
        };
        tokio::time::timeout(TIMEOUT, async {
            conn.get_mut().write_all(&out).await?;
            conn.get_mut().flush().await
        })
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "write timed out"))??;
        if protocol == Protocol::Relp {
            // INVARIANT: RELP answers in order; each message counts as
            // delivered only once its own `200` has arrived.
            for expected in first..=self.txnr {
                let (txnr, data) = tokio::time::timeout(TIMEOUT, read_rsp(conn))
                    .await
                    .map_err(|_| {
                        std::io::Error::new(std::io::ErrorKind::TimedOut, "no RELP acknowledgement")
                    })??;
                if txnr != expected || !data.starts_with(b"200") {
                    return Err(std::io::Error::other(format!(
                        "RELP message {expected} not acknowledged: {}",
                        String::from_utf8_lossy(&data)
                    )));
                }
            }
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl Shipper for SyslogShipper {
    fn name(&self) -> &'static str {
        "syslog"
    }

    async fn ship(&mut self, records: &[Vec<u8>]) -> std::io::Result<()> {
        let result = self.send(records).await;
        if result.is_err() {
            self.conn = None;
        }
        result
    }
}

/// Longest RELP response data accepted.
const MAX_RSP: usize = 64 * 1024;

/// Reads one RELP frame and expects `rsp`: its transaction number and data.
async fn read_rsp<R: AsyncBufReadExt + Unpin>(r: &mut R) -> std::io::Result<(u64, Vec<u8>)> {
    let bad =
        |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("RELP: {what}"));
    let mut header = Vec::new();
    // TXNR SP COMMAND SP DATALEN, then SP DATA or LF.
    loop {
        let mut byte = [0u8; 1];
        if r.read(&mut byte).await? == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "RELP: connection closed",
            ));
        }
        match byte[0] {
            b' ' if header.iter().filter(|&&b| b == b' ').count() == 2 => break,
            b'\n' => break,
            b => header.push(b),
        }
        if header.len() > 64 {
            return Err(bad("header too long"));
        }
    }
    let text = String::from_utf8(header).map_err(|_| bad("header not UTF-8"))?;
    let mut parts = text.split(' ');
    let txnr: u64 = parts
        .next()
        .and_then(|t| t.parse().ok())
        .ok_or_else(|| bad("txnr"))?;
    let command = parts.next().ok_or_else(|| bad("command"))?.to_string();
    let len: usize = parts
        .next()
        .and_then(|l| l.parse().ok())
        .ok_or_else(|| bad("datalen"))?;
    if len > MAX_RSP {
        return Err(bad("response too long"));
    }
    let mut data = vec![0u8; len];
    r.read_exact(&mut data).await?;
    if len > 0 {
        let mut trailer = [0u8; 1];
        r.read_exact(&mut trailer).await?;
    }
    match command.as_str() {
        "rsp" => Ok((txnr, data)),
        "serverclose" => Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            "RELP: the server closed the session",
        )),
        other => Err(bad(&format!("unexpected command {other}"))),
    }
}

fn connector(ca: Option<&std::path::Path>) -> Result<tokio_rustls::TlsConnector, TargetError> {
    use rustls_pki_types::pem::PemObject;
    let mut roots = tokio_rustls::rustls::RootCertStore::empty();
    match ca {
        Some(path) => {
            let ca_error = |error: String| TargetError::Ca {
                path: path.to_path_buf(),
                error,
            };
            let certs = rustls_pki_types::CertificateDer::pem_file_iter(path)
                .map_err(|e| ca_error(e.to_string()))?;
            for cert in certs {
                roots
                    .add(cert.map_err(|e| ca_error(e.to_string()))?)
                    .map_err(|e| ca_error(e.to_string()))?;
            }
            if roots.is_empty() {
                return Err(ca_error("no certificate in it".into()));
            }
        }
        None => {
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
        }
    }
    let provider = Arc::new(tokio_rustls::rustls::crypto::aws_lc_rs::default_provider());
    let config = tokio_rustls::rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TargetError::Ca {
            path: PathBuf::new(),
            error: e.to_string(),
        })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_and_bad_ones_are_named() {
        let t = SyslogTarget::parse("relp://127.0.0.1:20514", None, "node-1").unwrap();
        assert_eq!(
            (t.protocol, t.host.as_str(), t.port),
            (Protocol::Relp, "127.0.0.1", 20514)
        );
        let t = SyslogTarget::parse("tls://[::1]:6514", None, "").unwrap();
        assert_eq!(
            (t.protocol, t.host.as_str(), t.hostname.as_str()),
            (Protocol::Tls, "::1", "-")
        );
        for bad in ["udp://h:514", "relp://h", "h:514", "tcp://h:1/path"] {
            assert!(SyslogTarget::parse(bad, None, "n").is_err(), "{bad}");
        }
    }

    #[test]
    fn a_message_is_rfc5424_with_the_record_as_its_text() {
        let rec = br#"{"time":"2026-12-03T06:42:44.752315Z","type":"credential","decision":{"verdict":"deny"}}"#;
        let m = String::from_utf8(message(rec, "node-1")).unwrap();
        let pid = std::process::id();
        assert_eq!(
            m,
            format!(
                "<84>1 2026-12-03T06:42:44.752315Z node-1 lanyard {pid} credential - {}",
                std::str::from_utf8(rec).unwrap()
            )
        );
        let m = String::from_utf8(message(b"{\"type\":\"rotation\"}", "n")).unwrap();
        assert!(m.starts_with("<86>1 - n lanyard "), "{m}");
    }
}
