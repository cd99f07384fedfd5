//! The HTTP exporter's transport: batches of records POSTed to a collector
//! as one gzip-compressed JSON array.
//!
//! A batch counts as delivered on a 2xx answer only. Anything else (a 5xx,
//! a 429, a timeout, a connection closed in the middle) leaves the cursor
//! where it was and the batch is sent again after a backoff, so a
//! collector sees every record at least once and drops repeats by their
//! `id`. A `Retry-After` on 429 or 503 is honoured (up to a minute).

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use super::export::Shipper;

/// Where and how to POST.
#[derive(Debug, Clone)]
pub struct HttpTarget {
    /// The collector's URL (https, or http to a loopback host).
    pub url: url::Url,
    /// A file holding a bearer token for the collector, re-read for every
    /// batch (a mounted Secret rotates); `None`: no `Authorization`.
    pub token_file: Option<PathBuf>,
}

/// Longest `Retry-After` honoured.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// POSTs batches to a collector.
pub struct HttpShipper {
    target: HttpTarget,
    client: reqwest::Client,
}

impl HttpShipper {
    /// A shipper to `target` with `client` (timeouts, no redirects).
    pub fn new(target: HttpTarget, client: reqwest::Client) -> Self {
        HttpShipper { target, client }
    }
}

/// The body of a batch: `[record,record,…]`, gzip-compressed.
pub fn body(records: &[Vec<u8>]) -> std::io::Result<Vec<u8>> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(b"[")?;
    for (i, r) in records.iter().enumerate() {
        if i > 0 {
            gz.write_all(b",")?;
        }
        gz.write_all(r)?;
    }
    gz.write_all(b"]")?;
    gz.finish()
}

#[async_trait::async_trait]
impl Shipper for HttpShipper {
    fn name(&self) -> &'static str {
        "http"
    }

    async fn ship(&mut self, records: &[Vec<u8>]) -> std::io::Result<()> {
        let body = body(records)?;
        let mut request = self
            .client
            .post(self.target.url.clone())
            .header("content-type", "application/json")
            .header("content-encoding", "gzip")
            .header("x-lanyard-records", records.len().to_string())
            .body(body);
        if let Some(file) = &self.target.token_file {
            let token = std::fs::read_to_string(file)?;
            request = request.bearer_auth(token.trim());
        }
        let response = request.send().await.map_err(|e| {
            // reqwest's error names the URL; nothing secret is in it.
            std::io::Error::other(format!("POST to the audit collector failed: {e}"))
        })?;
        let status = response.status();
        if status.is_success() {
            // Delivered only once the whole answer arrived: a collector
            // whose connection drops mid-answer may not have kept the batch.
            return response.bytes().await.map(drop).map_err(|e| {
                std::io::Error::other(format!("the audit collector's answer was cut off: {e}"))
            });
        }
        if status.as_u16() == 429 || status.as_u16() == 503 {
            let wait = response
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(Duration::from_secs);
            if let Some(wait) = wait {
                tokio::time::sleep(wait.min(MAX_RETRY_AFTER)).await;
            }
        }
        Err(std::io::Error::other(format!(
            "the audit collector answered {status}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_a_gzipped_json_array_of_the_records() {
        let records = vec![b"{\"id\":\"a\"}".to_vec(), b"{\"id\":\"b\"}".to_vec()];
        let gz = body(&records).unwrap();
        let mut text = String::new();
        std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(&gz[..]), &mut text)
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v[1]["id"], "b");
    }
}
