//! The hash chain of the file sink: how a record line carries its place
//! (`seq`), the hash of the record before it (`prev`) and its own hash
//! (`hash`), and how a line is read back.
//!
//! A record `{...}` becomes, in the file,
//! `{...,"seq":N,"prev":"P"` + `,"hash":"H"}` where `H` is the SHA-256 of
//! the bytes `{...,"seq":N,"prev":"P"}`: the hash covers exactly the bytes
//! written before it, so checking a line needs no canonical JSON, only the
//! line. Editing any byte of a record breaks its own hash; replacing a
//! record with one whose hash is recomputed breaks the next record's
//! `prev`; deleting, inserting or reordering records breaks `seq`.

use sha2::{Digest, Sha256};

/// The `prev` of a chain's first record.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

const HASH_KEY: &[u8] = b",\"hash\":\"";

/// Where a record stands in its chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    /// Its sequence number: one more than the record before it.
    pub seq: u64,
    /// Its own hash, hex.
    pub hash: String,
}

/// Appends to `out` the line (newline included) of `record` (one JSON
/// object) as the successor of `prev` (`None`: the chain's first), and
/// returns its link.
pub fn append(record: &[u8], prev: Option<&Link>, out: &mut Vec<u8>) -> Link {
    let seq = prev.map_or(0, |p| p.seq + 1);
    let prev_hash = prev.map_or(GENESIS, |p| p.hash.as_str());
    let start = out.len();
    // INVARIANT: `record` is one JSON object: it ends in `}`.
    let body = record.strip_suffix(b"}").unwrap_or(record);
    out.extend_from_slice(body);
    if body.len() > 1 {
        out.push(b',');
    }
    out.extend_from_slice(b"\"seq\":");
    out.extend_from_slice(itoa::Buffer::new().format(seq).as_bytes());
    out.extend_from_slice(b",\"prev\":\"");
    out.extend_from_slice(prev_hash.as_bytes());
    out.extend_from_slice(b"\"}");
    let hash = hex_digest(Sha256::digest(&out[start..]));
    out.pop();
    out.extend_from_slice(HASH_KEY);
    out.extend_from_slice(&hash);
    out.extend_from_slice(b"\"}\n");
    Link {
        seq,
        hash: String::from_utf8_lossy(&hash).into_owned(),
    }
}

/// What is wrong with a line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LineError {
    /// It does not end in a `hash` field.
    #[error("not a chained audit record (no hash at its end)")]
    NoHash,
    /// Its bytes do not hash to its `hash`: it was edited.
    #[error("its content does not match its hash: the record was altered")]
    Altered,
    /// Its JSON is broken, or it lacks `seq` or `prev`.
    #[error("not a chained audit record: {0}")]
    Malformed(String),
}

/// A line read back: its link and the hash it names as its predecessor's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    /// Its place and hash.
    pub link: Link,
    /// The hash of the record it follows.
    pub prev: String,
    /// Its `type`.
    pub kind: String,
    /// `previous_file` of a rotation record.
    pub previous_file: Option<String>,
}

/// Reads one line (without its newline) and checks its own hash.
pub fn read(line: &[u8]) -> Result<Read, LineError> {
    let suffix_len = HASH_KEY.len() + 64 + 2; // `,"hash":"` + 64 hex + `"}`
    if line.len() < suffix_len + 2 || !line.ends_with(b"\"}") {
        return Err(LineError::NoHash);
    }
    let cut = line.len() - suffix_len;
    if &line[cut..cut + HASH_KEY.len()] != HASH_KEY {
        return Err(LineError::NoHash);
    }
    let hash = &line[cut + HASH_KEY.len()..line.len() - 2];
    if !hash.iter().all(|b| b.is_ascii_hexdigit()) {
        return Err(LineError::NoHash);
    }
    let mut hasher = Sha256::new();
    hasher.update(&line[..cut]);
    hasher.update(b"}");
    let computed = hex_digest(hasher.finalize());
    if computed != hash {
        return Err(LineError::Altered);
    }
    #[derive(serde::Deserialize)]
    struct Fields {
        seq: u64,
        prev: String,
        #[serde(rename = "type", default)]
        kind: String,
        #[serde(default)]
        previous_file: Option<String>,
    }
    let fields: Fields =
        serde_json::from_slice(line).map_err(|e| LineError::Malformed(e.to_string()))?;
    Ok(Read {
        link: Link {
            seq: fields.seq,
            hash: String::from_utf8_lossy(&computed).into_owned(),
        },
        prev: fields.prev,
        kind: fields.kind,
        previous_file: fields.previous_file,
    })
}

/// A SHA-256 in lowercase hex, on the stack.
fn hex_digest(digest: impl AsRef<[u8]>) -> [u8; 64] {
    let mut hex = [0u8; 64];
    // A SHA-256 is 32 bytes: its 64 digits fill the buffer exactly.
    let _ = hex::encode_to_slice(digest, &mut hex);
    hex
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_chain_and_read_back() {
        let mut out = Vec::new();
        let a = append(br#"{"type":"x","n":1}"#, None, &mut out);
        let b = append(br#"{"type":"y"}"#, Some(&a), &mut out);
        assert_eq!((a.seq, b.seq), (0, 1));
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2);
        let ra = read(lines[0].as_bytes()).unwrap();
        assert_eq!(ra.link, a);
        assert_eq!(ra.prev, GENESIS);
        assert_eq!(ra.kind, "x");
        let rb = read(lines[1].as_bytes()).unwrap();
        assert_eq!(rb.prev, a.hash);
        assert_eq!(rb.link, b);
        // Every line is still plain JSON.
        let v: serde_json::Value = serde_json::from_str(lines[1]).unwrap();
        assert_eq!(v["seq"], 1);
        assert_eq!(v["hash"], b.hash.as_str());
    }

    #[test]
    fn an_edited_byte_is_found() {
        let mut out = Vec::new();
        append(br#"{"type":"x","identity":"a"}"#, None, &mut out);
        let line = String::from_utf8(out).unwrap();
        let edited = line.trim_end().replace("\"a\"", "\"b\"");
        assert_eq!(read(edited.as_bytes()), Err(LineError::Altered));
        assert_eq!(read(b"{\"type\":\"x\"}"), Err(LineError::NoHash));
        assert_eq!(read(b""), Err(LineError::NoHash));
        assert!(matches!(
            read(&line.trim_end().as_bytes()[..line.len() / 2]),
            Err(LineError::NoHash)
        ));
    }

    #[test]
    fn an_empty_object_chains_too() {
        let mut out = Vec::new();
        append(b"{}", None, &mut out);
        let line = String::from_utf8(out).unwrap();
        assert!(read(line.trim_end().as_bytes()).is_ok(), "{line}");
    }
}
