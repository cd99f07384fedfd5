//! `lanyard audit verify FILES…`: checks the file sink's hash chain and
//! names the first record that is altered, missing, inserted, out of order
//! or torn, by file and line.
//!
//! Files are read in the order given, oldest first (rotated files sort by
//! their names: `lanyard audit verify audit-*.jsonl audit.jsonl`). A chain
//! whose oldest files were removed by retention is verified from its first
//! surviving record.

use std::path::{Path, PathBuf};

use super::chain::{self, LineError, Link, GENESIS};

/// The first problem found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    /// A file cannot be read.
    #[error("{file}: cannot be read: {error}")]
    Unreadable {
        /// The file.
        file: PathBuf,
        /// Why.
        error: String,
    },
    /// A line is not a chained record, or its bytes do not match its hash.
    #[error("{file}:{line}: {error}")]
    Bad {
        /// The file.
        file: PathBuf,
        /// The line (from 1).
        line: usize,
        /// What is wrong.
        error: LineError,
    },
    /// The last line has no newline: the file was cut short.
    #[error("{file}:{line}: the record is cut short (the file was truncated)")]
    Truncated {
        /// The file.
        file: PathBuf,
        /// The line (from 1).
        line: usize,
    },
    /// Records are missing before this one.
    #[error("{file}:{line}: {} missing before this one", missing(*from, *to))]
    Missing {
        /// The file.
        file: PathBuf,
        /// The line (from 1).
        line: usize,
        /// The first missing sequence number.
        from: u64,
        /// The last missing sequence number.
        to: u64,
    },
    /// A record repeats or goes back in sequence: inserted or reordered.
    #[error("{file}:{line}: record {seq} is out of order after record {after}: a record was inserted or records were reordered")]
    OutOfOrder {
        /// The file.
        file: PathBuf,
        /// The line (from 1).
        line: usize,
        /// Its sequence number.
        seq: u64,
        /// The sequence number of the record before it.
        after: u64,
    },
    /// The record does not name the hash of the one before it: that one was
    /// replaced (with a recomputed hash) or this one was inserted.
    #[error("{file}:{line}: the record does not follow the one before it (that record was replaced, or this one inserted)")]
    Unlinked {
        /// The file.
        file: PathBuf,
        /// The line (from 1).
        line: usize,
    },
}

fn missing(from: u64, to: u64) -> String {
    match from == to {
        true => format!("record {from} is"),
        false => format!("records {from} to {to} are"),
    }
}

/// What a successful verification covered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// Records checked.
    pub records: u64,
    /// Files checked.
    pub files: usize,
    /// The sequence number of the first record.
    pub first_seq: Option<u64>,
    /// Whether the first record begins the chain (else earlier records were
    /// removed, as retention does).
    pub from_genesis: bool,
}

/// `lanyard audit verify`: prints what was verified (exit 0) or the first
/// problem (exit 1).
pub fn command(files: &[PathBuf]) -> std::process::ExitCode {
    match verify(files) {
        Ok(v) => {
            let from = match (v.first_seq, v.from_genesis) {
                (None, _) => "no records".to_string(),
                (Some(_), true) => "from the start of the chain".to_string(),
                (Some(seq), false) => format!(
                    "from record {seq} (earlier records are not in these files, as after retention)"
                ),
            };
            let plural = |n: u64, one: &str, many: &str| match n {
                1 => format!("1 {one}"),
                n => format!("{n} {many}"),
            };
            println!(
                "ok: {} in {} verified, {from}",
                plural(v.records, "record", "records"),
                plural(v.files as u64, "file", "files")
            );
            std::process::ExitCode::SUCCESS
        }
        Err(problem) => {
            eprintln!("audit verify: {problem}");
            std::process::ExitCode::from(1)
        }
    }
}

/// Verifies `files`, in order, as one chain.
pub fn verify(files: &[PathBuf]) -> Result<Verified, Problem> {
    let mut last: Option<Link> = None;
    let mut verified = Verified {
        records: 0,
        files: 0,
        first_seq: None,
        from_genesis: false,
    };
    for file in files {
        let bytes = std::fs::read(file).map_err(|e| Problem::Unreadable {
            file: file.clone(),
            error: e.to_string(),
        })?;
        verify_file(file, &bytes, &mut last, &mut verified)?;
        verified.files += 1;
    }
    Ok(verified)
}

fn verify_file(
    file: &Path,
    bytes: &[u8],
    last: &mut Option<Link>,
    verified: &mut Verified,
) -> Result<(), Problem> {
    let lines: Vec<&[u8]> = bytes.split(|&b| b == b'\n').collect();
    // `split` leaves an empty piece after a final newline; anything else
    // there is a torn line.
    let (body, torn) = lines.split_at(lines.len() - 1);
    if !torn[0].is_empty() {
        let line = lines.len();
        // A torn line is reported as such, unless an earlier one is bad.
        let mut scratch_last = last.clone();
        let mut scratch = verified.clone();
        check_lines(file, body, &mut scratch_last, &mut scratch)?;
        return Err(Problem::Truncated {
            file: file.to_path_buf(),
            line,
        });
    }
    check_lines(file, body, last, verified)
}

fn check_lines(
    file: &Path,
    lines: &[&[u8]],
    last: &mut Option<Link>,
    verified: &mut Verified,
) -> Result<(), Problem> {
    let at = |i: usize| (file.to_path_buf(), i + 1);
    for (i, line) in lines.iter().enumerate() {
        let read = chain::read(line).map_err(|error| {
            let (file, line) = at(i);
            Problem::Bad { file, line, error }
        })?;
        match last {
            None => {
                verified.first_seq = Some(read.link.seq);
                verified.from_genesis = read.prev == GENESIS && read.link.seq == 0;
            }
            Some(prev) => {
                let expected = prev.seq + 1;
                let (file, line) = at(i);
                if read.link.seq <= prev.seq {
                    return Err(Problem::OutOfOrder {
                        file,
                        line,
                        seq: read.link.seq,
                        after: prev.seq,
                    });
                }
                if read.link.seq > expected {
                    // The record that belongs here may come next: two
                    // records swapped, not lost.
                    let next_fits = lines
                        .get(i + 1)
                        .and_then(|l| chain::read(l).ok())
                        .is_some_and(|n| n.link.seq == expected);
                    if next_fits {
                        return Err(Problem::OutOfOrder {
                            file,
                            line,
                            seq: read.link.seq,
                            after: prev.seq,
                        });
                    }
                    return Err(Problem::Missing {
                        file,
                        line,
                        from: expected,
                        to: read.link.seq - 1,
                    });
                }
                if read.prev != prev.hash {
                    return Err(Problem::Unlinked { file, line });
                }
            }
        }
        verified.records += 1;
        *last = Some(read.link);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chain of `n` records, one per line.
    fn chain_lines(n: usize) -> Vec<String> {
        let mut out = Vec::new();
        let mut link = None;
        for i in 0..n {
            let rec = format!("{{\"type\":\"credential\",\"n\":{i}}}");
            link = Some(chain::append(rec.as_bytes(), link.as_ref(), &mut out));
        }
        String::from_utf8(out)
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn check(lines: &[String]) -> Result<Verified, Problem> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        verify(&[path]).map_err(|p| match p {
            // Tests compare lines, not temporary paths.
            Problem::Bad { line, error, .. } => Problem::Bad {
                file: "f".into(),
                line,
                error,
            },
            Problem::Missing { line, from, to, .. } => Problem::Missing {
                file: "f".into(),
                line,
                from,
                to,
            },
            Problem::OutOfOrder {
                line, seq, after, ..
            } => Problem::OutOfOrder {
                file: "f".into(),
                line,
                seq,
                after,
            },
            Problem::Unlinked { line, .. } => Problem::Unlinked {
                file: "f".into(),
                line,
            },
            other => other,
        })
    }

    #[test]
    fn an_intact_chain_verifies() {
        let v = check(&chain_lines(5)).unwrap();
        assert_eq!(v.records, 5);
        assert!(v.from_genesis);
    }

    #[test]
    fn each_kind_of_tampering_is_named_where_it_is() {
        let lines = chain_lines(6);
        let f = || PathBuf::from("f");

        let mut edited = lines.clone();
        edited[2] = edited[2].replace("\"n\":2", "\"n\":9");
        assert_eq!(
            check(&edited),
            Err(Problem::Bad {
                file: f(),
                line: 3,
                error: LineError::Altered
            })
        );

        let mut deleted = lines.clone();
        deleted.remove(3);
        assert_eq!(
            check(&deleted),
            Err(Problem::Missing {
                file: f(),
                line: 4,
                from: 3,
                to: 3
            })
        );

        let mut inserted = lines.clone();
        inserted.insert(4, lines[1].clone());
        assert_eq!(
            check(&inserted),
            Err(Problem::OutOfOrder {
                file: f(),
                line: 5,
                seq: 1,
                after: 3
            })
        );

        let mut swapped = lines.clone();
        swapped.swap(2, 3);
        assert_eq!(
            check(&swapped),
            Err(Problem::OutOfOrder {
                file: f(),
                line: 3,
                seq: 3,
                after: 1
            })
        );

        // A record replaced by a forged one with a correct hash of its own
        // breaks the link to its successor.
        let mut forged = lines.clone();
        let mut out = Vec::new();
        let prev = chain::read(lines[1].as_bytes()).unwrap().link;
        chain::append(
            b"{\"type\":\"credential\",\"n\":\"forged\"}",
            Some(&prev),
            &mut out,
        );
        forged[2] = String::from_utf8(out).unwrap().trim_end().to_string();
        assert_eq!(
            check(&forged),
            Err(Problem::Unlinked { file: f(), line: 4 })
        );
    }

    #[test]
    fn a_truncated_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let text = chain_lines(3).join("\n") + "\n";
        std::fs::write(&path, &text[..text.len() - 20]).unwrap();
        assert!(matches!(
            verify(std::slice::from_ref(&path)),
            Err(Problem::Truncated { line: 3, .. })
        ));
    }

    #[test]
    fn a_chain_without_its_oldest_files_verifies_from_the_first_survivor() {
        let lines = chain_lines(10);
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
        std::fs::write(&a, lines[4..7].join("\n") + "\n").unwrap();
        std::fs::write(&b, lines[7..].join("\n") + "\n").unwrap();
        let v = verify(&[a.clone(), b.clone()]).unwrap();
        assert_eq!(v.records, 6);
        assert_eq!(v.first_seq, Some(4));
        assert!(!v.from_genesis);
        // Given in the wrong order, the files do not chain.
        assert!(verify(&[b, a]).is_err());
    }
}
