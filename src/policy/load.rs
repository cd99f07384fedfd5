//! Reading a policy directory: every `*.cedar` file, parsed, named and
//! validated against the schema, or every problem found with its file,
//! line and column.
//!
//! The directory is read as Kubernetes mounts a ConfigMap: the visible
//! `NAME.cedar` entries are symlinks into a hidden, atomically swapped
//! `..data` directory, so symlinks are followed and dotfiles skipped. A
//! policy's id is its `@id("…")` annotation, or `FILE#N` (its position in
//! the file, from 0); an id used twice is an error naming both files.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use cedar_policy::{PolicyId, PolicySet, ValidationMode, Validator};
use miette::Diagnostic;
use sha2::{Digest, Sha256};

pub use super::index::Index;
use super::schema;

/// Most policy files read from one directory.
pub const MAX_FILES: usize = 1000;
/// Largest policy file read.
pub const MAX_FILE_BYTES: u64 = 4 << 20;
/// Most problems reported at once; the rest are counted.
const MAX_PROBLEMS: usize = 20;

/// One thing wrong in a policy file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The file, as named in the directory.
    pub file: String,
    /// 1-based line and column, when the problem has a place.
    pub at: Option<(usize, usize)>,
    /// What is wrong (Cedar's message and help).
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.at {
            Some((line, column)) => write!(f, "{}:{line}:{column}: {}", self.file, self.message),
            None => write!(f, "{}: {}", self.file, self.message),
        }
    }
}

/// Why a policy directory could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The directory cannot be listed (missing, not a directory, no access).
    #[error("policy directory {dir}: {reason}")]
    Directory {
        /// The directory.
        dir: String,
        /// Why.
        reason: String,
    },
    /// Policies that do not parse, do not fit the schema, or collide.
    #[error("{}", render(.problems, *.more))]
    Invalid {
        /// The problems, at most 20.
        problems: Vec<Problem>,
        /// How many more there were.
        more: usize,
    },
}

fn render(problems: &[Problem], more: usize) -> String {
    let mut out = problems
        .iter()
        .map(Problem::to_string)
        .collect::<Vec<_>>()
        .join("\n");
    if more > 0 {
        out.push_str(&format!("\n… and {more} more problems"));
    }
    out
}

/// A loaded, validated set.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The policies, with their ids.
    pub set: PolicySet,
    /// How many.
    pub count: usize,
    /// SHA-256 of the files' names and contents: equal sets have equal
    /// digests, whatever their mtimes.
    pub digest: String,
    /// The policies that can apply to a request, by its caller's
    /// namespace and the identity it is for.
    pub index: Index,
}

/// The `*.cedar` files of `dir` with their contents, sorted by name.
pub fn read_files(dir: &Path) -> Result<Vec<(String, Vec<u8>)>, LoadError> {
    let unreadable = |reason: String| LoadError::Directory {
        dir: dir.display().to_string(),
        reason,
    };
    let entries = std::fs::read_dir(dir).map_err(|e| unreadable(e.to_string()))?;
    let mut paths: Vec<(String, PathBuf)> = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| unreadable(e.to_string()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || !name.ends_with(".cedar") {
            continue;
        }
        paths.push((name, entry.path()));
        if paths.len() > MAX_FILES {
            return Err(unreadable(format!("more than {MAX_FILES} policy files")));
        }
    }
    paths.sort();
    let mut files = Vec::with_capacity(paths.len());
    for (name, path) in paths {
        // Follows the ConfigMap's symlinks.
        let meta = std::fs::metadata(&path).map_err(|e| unreadable(format!("{name}: {e}")))?;
        if !meta.is_file() {
            continue;
        }
        if meta.len() > MAX_FILE_BYTES {
            return Err(unreadable(format!(
                "{name}: larger than {MAX_FILE_BYTES} bytes"
            )));
        }
        let bytes = std::fs::read(&path).map_err(|e| unreadable(format!("{name}: {e}")))?;
        files.push((name, bytes));
    }
    Ok(files)
}

/// The digest of `files` (names and contents).
pub fn digest(files: &[(String, Vec<u8>)]) -> String {
    let mut h = Sha256::new();
    for (name, bytes) in files {
        h.update((name.len() as u64).to_be_bytes());
        h.update(name.as_bytes());
        h.update((bytes.len() as u64).to_be_bytes());
        h.update(bytes);
    }
    let d = h.finalize();
    d.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// Reads, parses and validates the policies of `dir`.
pub fn load(dir: &Path) -> Result<Loaded, LoadError> {
    let files = read_files(dir)?;
    parse(&files)
}

/// Parses and validates `files` (name, contents) as one set.
pub fn parse(files: &[(String, Vec<u8>)]) -> Result<Loaded, LoadError> {
    let mut problems = Problems::default();
    let mut set = PolicySet::new();
    // policy id → (file, text), for placing validation errors.
    let mut origin: HashMap<PolicyId, (usize, String)> = HashMap::new();
    let mut texts: Vec<&str> = Vec::with_capacity(files.len());
    for (index, (name, bytes)) in files.iter().enumerate() {
        let text = match std::str::from_utf8(bytes) {
            Ok(text) => text,
            Err(e) => {
                let at = line_column(
                    &String::from_utf8_lossy(&bytes[..e.valid_up_to()]),
                    e.valid_up_to(),
                );
                problems.push(Problem {
                    file: name.clone(),
                    at: Some(at),
                    message: "not valid UTF-8".into(),
                });
                texts.push("");
                continue;
            }
        };
        texts.push(text);
        let parsed: PolicySet = match text.parse() {
            Ok(p) => p,
            Err(errors) => {
                let errors: cedar_policy::ParseErrors = errors;
                for e in errors.iter() {
                    problems.push(diagnosed(name, text, e));
                }
                continue;
            }
        };
        if parsed.templates().next().is_some() {
            problems.push(Problem {
                file: name.clone(),
                at: None,
                message: "templates (policies with ?principal or ?resource) are not supported"
                    .into(),
            });
            continue;
        }
        for (n, policy) in parsed.policies().enumerate() {
            let id = match policy.annotation("id") {
                Some(id) => PolicyId::new(id),
                None => PolicyId::new(format!("{name}#{n}")),
            };
            if let Some((first, _)) = origin.get(&id) {
                problems.push(Problem {
                    file: name.clone(),
                    at: None,
                    message: format!("policy id \"{id}\" is already used in {}", files[*first].0),
                });
                continue;
            }
            let renamed = policy.new_id(id.clone());
            if let Err(e) = set.add(renamed) {
                problems.push(Problem {
                    file: name.clone(),
                    at: None,
                    message: e.to_string(),
                });
                continue;
            }
            origin.insert(id, (index, name.clone()));
        }
    }
    if problems.is_empty() {
        let result =
            Validator::new(schema::schema().clone()).validate(&set, ValidationMode::Strict);
        for e in result.validation_errors() {
            let (file, text) = match origin.get(e.policy_id()) {
                Some((index, name)) => (name.as_str(), texts[*index]),
                None => ("(unknown file)", ""),
            };
            let mut p = diagnosed(file, text, e);
            p.message = format!("policy \"{}\": {}", e.policy_id(), p.message);
            problems.push(p);
        }
    }
    problems.into_result()?;
    let index = Index::build(&set).map_err(|e| LoadError::Invalid {
        problems: vec![Problem {
            file: "(policy set)".into(),
            at: None,
            message: e,
        }],
        more: 0,
    })?;
    Ok(Loaded {
        count: set.policies().count(),
        set,
        digest: digest(files),
        index,
    })
}

/// A problem from a Cedar diagnostic: its message and help, placed at its
/// first label.
fn diagnosed(file: &str, text: &str, d: &(impl Diagnostic + ?Sized)) -> Problem {
    let mut message = d.to_string();
    if let Some(help) = d.help() {
        message.push_str(&format!(" ({help})"));
    }
    let at = d
        .labels()
        .and_then(|mut labels| labels.next())
        .map(|label| line_column(text, label.offset()));
    Problem {
        file: file.to_string(),
        at,
        message,
    }
}

/// 1-based line and column of byte `offset` in `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..text.floor_char_boundary(offset)];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

#[derive(Default)]
struct Problems {
    list: Vec<Problem>,
    more: usize,
}

impl Problems {
    fn push(&mut self, p: Problem) {
        if self.list.len() < MAX_PROBLEMS {
            self.list.push(p);
        } else {
            self.more += 1;
        }
    }

    fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    fn into_result(self) -> Result<(), LoadError> {
        match self.list.is_empty() {
            true => Ok(()),
            false => Err(LoadError::Invalid {
                problems: self.list,
                more: self.more,
            }),
        }
    }
}
