//! `lanyard audit verify-collected FILES…`: checks what a collector holds
//! rather than one node's file. Root on a node can rewrite that node's
//! whole chain, so the copy an auditor trusts is the collector's, and it
//! mixes every node's chains in arrival order, with the exporters'
//! at-least-once repeats.
//!
//! The files hold one record per line, as the exporters sent it: rsyslog's
//! files written with `template="lanyard-record"` (`%msg%\n`, docs/audit.md)
//! and an HTTP collector's JSON Lines (each element of a batch's array as
//! its own line, its bytes unchanged). Order does not matter. Records are
//! grouped by chain (`cluster`, `node`, `role`, `chain`); a line repeated
//! byte for byte is a delivery repeated, not a problem. Per chain the
//! report names the sequence range held, the gaps (missing ranges), the
//! forks (two different records with one `seq`), the records that do not
//! follow the one before them, and when it last wrote a checkpoint: a
//! chain whose last checkpoint (or, without checkpoints, last record) is
//! older than `--stale-after` is stale, unless a later chain of the same
//! node and role has replaced it.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use serde::Serialize;

use super::chain::{self, GENESIS};

/// A line that is not a record the chain can take.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LineProblem {
    /// The file.
    pub file: PathBuf,
    /// The line (from 1).
    pub line: usize,
    /// What is wrong: altered (its bytes do not match its hash), not a
    /// chained record, or an `id` held with other content.
    pub error: String,
}

/// One chain as the collector holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChainReport {
    /// The records' `cluster`.
    pub cluster: String,
    /// The records' `node`.
    pub node: String,
    /// The records' `role`.
    pub role: String,
    /// The chain's name (the hash of its first record; empty for records
    /// written before chains were named).
    pub chain: String,
    /// The lowest `seq` held.
    pub first_seq: u64,
    /// The highest `seq` held.
    pub last_seq: u64,
    /// Distinct records held.
    pub records: u64,
    /// Missing ranges, inclusive, before and between the records held.
    pub gaps: Vec<(u64, u64)>,
    /// Sequence numbers held with two or more different records.
    pub forks: Vec<u64>,
    /// Sequence numbers whose record does not name the hash of the record
    /// before it (that one was replaced with a recomputed hash).
    pub unlinked: Vec<u64>,
    /// The `time` of the last checkpoint held.
    pub last_checkpoint: Option<String>,
    /// The `time` of the last record held.
    pub last_record: String,
    /// A later chain of the same cluster, node and role began after this
    /// one's last record: this one ended (a new volume), it did not go silent.
    pub superseded: bool,
    /// Its last checkpoint (or, with none, its last record) is older than
    /// the threshold, and it was not superseded.
    pub stale: bool,
}

impl ChainReport {
    /// Whether the chain is whole, forked nowhere, linked throughout and
    /// not stale.
    pub fn intact(&self) -> bool {
        self.gaps.is_empty() && self.forks.is_empty() && self.unlinked.is_empty() && !self.stale
    }
}

/// What the collector holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    /// Lines read (empty lines not counted).
    pub lines: u64,
    /// Lines that repeat a record held already, byte for byte.
    pub repeats: u64,
    /// Every chain, ordered by cluster, node, role and first record time.
    pub chains: Vec<ChainReport>,
    /// Lines that are not records the chain can take.
    pub problems: Vec<LineProblem>,
}

impl Report {
    /// Whether every line read and every chain is intact.
    pub fn ok(&self) -> bool {
        self.problems.is_empty() && self.chains.iter().all(ChainReport::intact)
    }
}

/// Why the files could not be read at all.
#[derive(Debug, thiserror::Error)]
#[error("{file}: cannot be read: {error}")]
pub struct Unreadable {
    file: PathBuf,
    error: std::io::Error,
}

/// The fields a record is grouped and judged by.
#[derive(serde::Deserialize)]
struct Head {
    #[serde(default)]
    id: String,
    #[serde(default)]
    time: String,
    #[serde(rename = "type", default)]
    kind: String,
    #[serde(default)]
    cluster: String,
    #[serde(default)]
    node: String,
    #[serde(default)]
    role: String,
}

/// One distinct record held.
struct Held {
    hash: String,
    prev: String,
    time: String,
    checkpoint: bool,
}

type ChainKey = (String, String, String, String);

/// Reads `files` and reports on every chain in them; `stale_after` is the
/// longest a chain may go without a checkpoint, measured at `now`.
pub fn verify(
    files: &[PathBuf],
    stale_after: Duration,
    now: SystemTime,
) -> Result<Report, Unreadable> {
    let mut chains: HashMap<ChainKey, BTreeMap<u64, Vec<Held>>> = HashMap::new();
    // `id` → the hash first held under it.
    let mut ids: HashMap<String, String> = HashMap::new();
    let mut report = Report {
        lines: 0,
        repeats: 0,
        chains: Vec::new(),
        problems: Vec::new(),
    };
    for file in files {
        let bytes = std::fs::read(file).map_err(|error| Unreadable {
            file: file.clone(),
            error,
        })?;
        for (n, line) in bytes.split(|&b| b == b'\n').enumerate() {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if line.is_empty() {
                continue;
            }
            report.lines += 1;
            let problem = |error: String| LineProblem {
                file: file.clone(),
                line: n + 1,
                error,
            };
            let read = match chain::read(line) {
                Ok(read) => read,
                Err(e) => {
                    report.problems.push(problem(e.to_string()));
                    continue;
                }
            };
            let head: Head = match serde_json::from_slice(line) {
                Ok(head) => head,
                Err(e) => {
                    report
                        .problems
                        .push(problem(format!("not an audit record: {e}")));
                    continue;
                }
            };
            match ids.get(&head.id) {
                Some(hash) if *hash == read.link.hash => {
                    report.repeats += 1;
                    continue;
                }
                Some(_) => {
                    report.problems.push(problem(format!(
                        "record id {} is held already with other content: one of the two was altered",
                        head.id
                    )));
                    continue;
                }
                None => {
                    ids.insert(head.id.clone(), read.link.hash.clone());
                }
            }
            let key = (head.cluster, head.node, head.role, read.link.chain);
            let at = chains
                .entry(key)
                .or_default()
                .entry(read.link.seq)
                .or_default();
            at.push(Held {
                hash: read.link.hash,
                prev: read.prev,
                time: head.time,
                checkpoint: head.kind == "checkpoint",
            });
        }
    }
    let threshold = now.checked_sub(stale_after).map(super::record::rfc3339);
    // The records of chains written before chains were named: a named
    // chain that continues one begins at the record after it.
    let unnamed: std::collections::HashSet<String> = chains
        .iter()
        .filter(|((_, _, _, name), _)| name.is_empty())
        .flat_map(|(_, held)| held.values().flatten().map(|h| h.hash.clone()))
        .collect();
    for ((cluster, node, role, name), held) in chains {
        let continues = unnamed.contains(&name);
        report.chains.push(judge(
            cluster,
            node,
            role,
            name,
            &held,
            continues,
            threshold.as_deref(),
        ));
    }
    // A chain is superseded by a later one of the same origin.
    report.chains.sort_by(|a, b| {
        (&a.cluster, &a.node, &a.role, &a.last_record).cmp(&(
            &b.cluster,
            &b.node,
            &b.role,
            &b.last_record,
        ))
    });
    // Sorted so, a chain is superseded when the next one has its origin.
    for i in 1..report.chains.len() {
        let (before, after) = report.chains.split_at_mut(i);
        let (chain, next) = (&mut before[i - 1], &after[0]);
        if (&chain.cluster, &chain.node, &chain.role) == (&next.cluster, &next.node, &next.role) {
            chain.superseded = true;
            chain.stale = false;
        }
    }
    Ok(report)
}

/// One chain's report from the records held, by `seq`.
fn judge(
    cluster: String,
    node: String,
    role: String,
    name: String,
    held: &BTreeMap<u64, Vec<Held>>,
    continues: bool,
    threshold: Option<&str>,
) -> ChainReport {
    let (first_seq, last_seq) = match (held.keys().next(), held.keys().next_back()) {
        (Some(&first), Some(&last)) => (first, last),
        _ => (0, 0),
    };
    let mut gaps = Vec::new();
    // Records before the first held are missing unless it begins the chain:
    // the genesis record, or (`continues`) the first named record after a
    // held unnamed one, which names the chain by that record's hash. An
    // unnamed chain's beginning is unknown.
    if let Some(first) = held.get(&first_seq).and_then(|v| v.first()) {
        let begins = (first_seq == 0 && first.prev == GENESIS) || (continues && first.prev == name);
        if !begins && first_seq > 0 && !name.is_empty() {
            gaps.push((0, first_seq - 1));
        }
    }
    let mut forks = Vec::new();
    let mut unlinked = Vec::new();
    let mut before: Option<(u64, &Vec<Held>)> = None;
    for (&seq, records) in held {
        if records.len() > 1 {
            forks.push(seq);
        }
        if let Some((prev_seq, prev)) = before {
            if seq > prev_seq + 1 {
                gaps.push((prev_seq + 1, seq - 1));
            } else if records.len() == 1 && prev.len() == 1 && records[0].prev != prev[0].hash {
                unlinked.push(seq);
            }
        }
        before = Some((seq, records));
    }
    let all = || held.values().flatten();
    let last_checkpoint = all().filter(|h| h.checkpoint).map(|h| h.time.clone()).max();
    let last_record = all().map(|h| h.time.clone()).max().unwrap_or_default();
    // RFC 3339 UTC with fixed digits: text order is time order.
    let stale = threshold.is_some_and(|t| last_checkpoint.as_deref().unwrap_or(&last_record) < t);
    ChainReport {
        cluster,
        node,
        role,
        chain: name,
        first_seq,
        last_seq,
        records: all().count() as u64,
        gaps,
        forks,
        unlinked,
        last_checkpoint,
        last_record,
        superseded: false,
        stale,
    }
}

/// `lanyard audit verify-collected`: the report as text (or JSON) on
/// stdout; exit 0 when every chain is intact, 1 otherwise or when a file
/// cannot be read.
pub fn command(files: &[PathBuf], stale_after: Duration, json: bool) -> std::process::ExitCode {
    let report = match verify(files, stale_after, SystemTime::now()) {
        Ok(report) => report,
        Err(e) => {
            eprintln!("audit verify-collected: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    if json {
        match serde_json::to_string_pretty(&report) {
            Ok(text) => println!("{text}"),
            Err(e) => {
                eprintln!("audit verify-collected: {e}");
                return std::process::ExitCode::FAILURE;
            }
        }
    } else {
        print!("{}", render(&report, stale_after));
    }
    if report.ok() {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}

/// The report as lines of text: one per chain, then one per problem.
pub fn render(report: &Report, stale_after: Duration) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let count = |n: u64, one: &str, many: &str| match n {
        1 => format!("1 {one}"),
        n => format!("{n} {many}"),
    };
    let _ = writeln!(
        out,
        "{}, {}, {}",
        count(report.lines, "line", "lines"),
        count(report.repeats, "repeated delivery", "repeated deliveries"),
        count(report.chains.len() as u64, "chain", "chains")
    );
    for c in &report.chains {
        let short: String = c.chain.chars().take(12).collect();
        let mut notes = Vec::new();
        if !c.gaps.is_empty() {
            let ranges: Vec<String> = c
                .gaps
                .iter()
                .map(|&(a, b)| {
                    if a == b {
                        a.to_string()
                    } else {
                        format!("{a}-{b}")
                    }
                })
                .collect();
            notes.push(format!("missing {}", ranges.join(", ")));
        }
        if !c.forks.is_empty() {
            notes.push(format!("forked at {:?}", c.forks));
        }
        if !c.unlinked.is_empty() {
            notes.push(format!(
                "does not follow its predecessor at {:?}",
                c.unlinked
            ));
        }
        if c.stale {
            let last = match &c.last_checkpoint {
                Some(t) => format!("last checkpoint {t}"),
                None => format!("no checkpoint held, last record {}", c.last_record),
            };
            notes.push(format!(
                "stale: nothing for over {} s ({last})",
                stale_after.as_secs()
            ));
        }
        if c.superseded {
            notes.push("ended (a later chain of this node and role follows)".into());
        }
        let verdict = if c.intact() { "ok" } else { "PROBLEM" };
        let _ = writeln!(
            out,
            "{verdict}: {}/{}/{} chain {short}: seq {}-{}, {} records{}{}",
            c.cluster,
            c.node,
            c.role,
            c.first_seq,
            c.last_seq,
            c.records,
            if notes.is_empty() { "" } else { "; " },
            notes.join("; ")
        );
    }
    for p in &report.problems {
        let _ = writeln!(out, "PROBLEM: {}:{}: {}", p.file.display(), p.line, p.error);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::chain::Link;

    /// A node's chain of `n` records (every third a checkpoint), written
    /// `minutes_ago` minutes before now, one a second.
    fn chain_of(node: &str, n: u64, minutes_ago: u64) -> Vec<String> {
        let start = SystemTime::now() - Duration::from_secs(minutes_ago * 60);
        let mut link: Option<Link> = None;
        let mut lines = Vec::new();
        for i in 0..n {
            let kind = if i % 3 == 2 {
                "checkpoint"
            } else {
                "credential"
            };
            let time = super::super::record::rfc3339(start + Duration::from_secs(i));
            let record = format!(
                r#"{{"schema":"lanyard.audit/v1","id":"{node}-{i}-{minutes_ago}","time":"{time}","type":"{kind}","cluster":"c1","node":"{node}","role":"agent"}}"#
            );
            let mut out = Vec::new();
            link = Some(chain::append(record.as_bytes(), link.as_ref(), &mut out));
            lines.push(String::from_utf8(out).unwrap().trim_end().to_string());
        }
        lines
    }

    fn verify_lines(lines: &[String], stale_after: Duration) -> Report {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("all-nodes.jsonl");
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        verify(&[path], stale_after, SystemTime::now()).unwrap()
    }

    const HOUR: Duration = Duration::from_secs(3600);

    #[test]
    fn interleaved_nodes_with_repeated_deliveries_verify() {
        let (a, b) = (chain_of("node-a", 30, 1), chain_of("node-b", 20, 1));
        let mut mixed = Vec::new();
        for (i, line) in a.iter().enumerate() {
            mixed.push(line.clone());
            if let Some(line) = b.get(i) {
                mixed.push(line.clone());
            }
        }
        // An exporter restarted mid-batch sends part of it again.
        mixed.extend(a[10..15].iter().cloned());
        mixed.reverse();
        let report = verify_lines(&mixed, HOUR);
        assert!(report.ok(), "{}", render(&report, HOUR));
        assert_eq!((report.lines, report.repeats), (55, 5));
        assert_eq!(report.chains.len(), 2);
        let a = &report.chains[0];
        assert_eq!(
            (a.node.as_str(), a.first_seq, a.last_seq, a.records),
            ("node-a", 0, 29, 30)
        );
        assert!(a.last_checkpoint.is_some());
    }

    #[test]
    fn each_fault_is_named_in_its_chain() {
        let a = chain_of("node-a", 30, 1);
        // A record dropped between exporter and collector, and the tail
        // (25-29) never arrived: a gap; the tail shows only as the chain's
        // end (its checkpoints stop, below).
        let mut held: Vec<String> = a[..25].to_vec();
        held.remove(7);
        let report = verify_lines(&held, HOUR);
        assert_eq!(report.chains[0].gaps, vec![(7, 7)]);
        assert!(!report.ok());
        // The chain's first record not held: missing too.
        let report = verify_lines(&a[1..], HOUR);
        assert_eq!(report.chains[0].gaps, vec![(0, 0)]);
        // A record altered at the collector: its own hash fails.
        let mut altered = a.clone();
        altered[4] = altered[4].replace("credential", "Credential");
        let report = verify_lines(&altered, HOUR);
        assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
        assert_eq!(report.problems[0].line, 5);
        assert!(
            report.problems[0].error.contains("altered"),
            "{:?}",
            report.problems
        );
        assert_eq!(report.chains[0].gaps, vec![(4, 4)]);
        // Replaced with a recomputed hash: the next record does not follow.
        let forged_chain = {
            let mut link = None;
            let mut lines = Vec::new();
            for (i, line) in a.iter().enumerate() {
                let body = if i == 4 {
                    line.replace("credential", "forged")
                } else {
                    line.clone()
                };
                // Strip the chain fields and chain the body again.
                let cut = body.find(",\"seq\":").unwrap();
                let record = format!("{}}}", &body[..cut]);
                let mut out = Vec::new();
                let l = chain::append(record.as_bytes(), link.as_ref(), &mut out);
                link = Some(l);
                lines.push(String::from_utf8(out).unwrap().trim_end().to_string());
            }
            lines
        };
        // The forgery follows record 3 and names the same chain (records
        // 0-3 are the same bytes), but record 5 names the original 4.
        let mut replaced = a.clone();
        replaced[4] = forged_chain[4].clone();
        let report = verify_lines(&replaced, HOUR);
        assert_eq!(report.chains.len(), 1, "{}", render(&report, HOUR));
        assert_eq!(
            report.chains[0].unlinked,
            vec![5],
            "{}",
            render(&report, HOUR)
        );
        // Both the original and a forgery with the same id: named.
        let mut both = a.clone();
        both.push(forged_chain[4].clone());
        let report = verify_lines(&both, HOUR);
        assert!(report.problems[0]
            .error
            .contains("held already with other content"));
        // Two different records with one seq (ids differ): a fork.
        let other = chain_of("node-a", 30, 2);
        let mut forked = a.clone();
        let twin = other[6].replace("node-a-6-2", "node-a-6-x");
        let cut = twin.find(",\"seq\":").unwrap();
        let mut out = Vec::new();
        let prev = chain::read(a[5].as_bytes()).unwrap().link;
        chain::append(
            format!("{}}}", &twin[..cut]).as_bytes(),
            Some(&prev),
            &mut out,
        );
        forked.push(String::from_utf8(out).unwrap().trim_end().to_string());
        let report = verify_lines(&forked, HOUR);
        assert_eq!(report.chains[0].forks, vec![6], "{}", render(&report, HOUR));
    }

    #[test]
    fn a_silent_node_is_stale_and_a_replaced_chain_is_not() {
        // node-a went quiet 90 minutes ago; node-b's old chain ended when a
        // new one began (a new volume), which is current.
        let mut lines = chain_of("node-a", 9, 90);
        lines.extend(chain_of("node-b", 9, 120));
        lines.extend(chain_of("node-b", 9, 1));
        let report = verify_lines(&lines, HOUR);
        let text = render(&report, HOUR);
        let by = |node: &str| {
            report
                .chains
                .iter()
                .filter(|c| c.node == node)
                .collect::<Vec<_>>()
        };
        assert!(by("node-a")[0].stale, "{text}");
        let b = by("node-b");
        assert_eq!(b.len(), 2, "{text}");
        assert!(b[0].superseded && !b[0].stale, "{text}");
        assert!(!b[1].superseded && !b[1].stale, "{text}");
        assert!(
            text.contains("PROBLEM: c1/node-a/agent") && text.contains("stale"),
            "{text}"
        );
        // With a longer threshold, nothing is stale.
        assert!(verify_lines(&lines, 3 * HOUR).ok());
    }
}
