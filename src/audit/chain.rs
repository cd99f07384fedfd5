//! The hash chain of the file sink: how a record line carries its place
//! (`seq`), the hash of the record before it (`prev`) and its own hash
//! (`hash`), and how a line is read back.
//!
//! A record `{...}` becomes, in the file,
//! `{...,"seq":N,"prev":"P","chain":"C"` + `,"hash":"H"}` where `H` is the
//! SHA-256 of the bytes `{...,"seq":N,"prev":"P","chain":"C"}`: the hash
//! covers exactly the bytes written before it, so checking a line needs no
//! canonical JSON, only the line.
//!
//! `chain` names the chain: the hash of its first record (which, having
//! no hash before it, carries no `chain` itself). A collector holding the
//! records of many nodes and many chains (a node's agent begins a new one
//! on a new volume) groups them by it. A chain begun by a version that
//! wrote no `chain` is named, from the first record written after it, by
//! the hash of the last record before it. Editing any byte of a record breaks its own hash; replacing a
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
    /// The chain's name: its first record's hash (empty for a record of a
    /// chain that names none, written before chains were named).
    pub chain: String,
}

impl Link {
    /// The name the next record carries: this chain's, or (after a record
    /// of an unnamed chain) this record's hash.
    fn chain_for_next(&self) -> &str {
        if self.chain.is_empty() {
            &self.hash
        } else {
            &self.chain
        }
    }
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
    let chain = prev.map(Link::chain_for_next);
    if let Some(chain) = chain {
        out.extend_from_slice(b"\",\"chain\":\"");
        out.extend_from_slice(chain.as_bytes());
    }
    out.extend_from_slice(b"\"}");
    let hash = hex_digest(Sha256::digest(&out[start..]));
    out.pop();
    out.extend_from_slice(HASH_KEY);
    out.extend_from_slice(&hash);
    out.extend_from_slice(b"\"}\n");
    let hash = String::from_utf8_lossy(&hash).into_owned();
    Link {
        seq,
        chain: chain.map_or_else(|| hash.clone(), str::to_string),
        hash,
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
        #[serde(default)]
        chain: Option<String>,
    }
    let fields: Fields =
        serde_json::from_slice(line).map_err(|e| LineError::Malformed(e.to_string()))?;
    let hash = String::from_utf8_lossy(&computed).into_owned();
    let chain = match fields.chain {
        Some(chain) => chain,
        // A chain's first record names the chain by its own hash.
        None if fields.seq == 0 && fields.prev == GENESIS => hash.clone(),
        None => String::new(),
    };
    Ok(Read {
        link: Link {
            seq: fields.seq,
            hash,
            chain,
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
    fn records_name_their_chain_by_its_first_record() {
        let mut out = Vec::new();
        let a = append(br#"{"type":"x"}"#, None, &mut out);
        let b = append(br#"{"type":"y"}"#, Some(&a), &mut out);
        let c = append(br#"{"type":"z"}"#, Some(&b), &mut out);
        assert_eq!(a.chain, a.hash);
        assert_eq!(
            (b.chain.as_str(), c.chain.as_str()),
            (a.hash.as_str(), a.hash.as_str())
        );
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(!lines[0].contains("\"chain\""), "{}", lines[0]);
        for (line, link) in lines.iter().zip([&a, &b, &c]) {
            assert_eq!(&read(line.as_bytes()).unwrap().link, link);
        }
        // A chain written before chains were named (no `chain`): the next
        // record names it by the last unnamed record's hash, and so on.
        let mut legacy = b"{\"type\":\"x\",\"seq\":7,\"prev\":\"".to_vec();
        legacy.extend_from_slice(GENESIS.replace('0', "1").as_bytes());
        legacy.extend_from_slice(b"\"}");
        let hash = hex_digest(Sha256::digest(&legacy));
        legacy.pop();
        legacy.extend_from_slice(HASH_KEY);
        legacy.extend_from_slice(&hash);
        legacy.extend_from_slice(b"\"}");
        let old = read(&legacy).unwrap().link;
        assert_eq!(old.chain, "");
        let mut out = Vec::new();
        let next = append(br#"{"type":"y"}"#, Some(&old), &mut out);
        let after = append(br#"{"type":"y"}"#, Some(&next), &mut out);
        assert_eq!(
            (next.chain.as_str(), after.chain.as_str()),
            (old.hash.as_str(), old.hash.as_str())
        );
    }

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
