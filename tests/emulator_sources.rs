//! `docs/emulators.md` lists every error each cloud emulator writes, with
//! the public source that backs it. These tests read the emulators'
//! sources and hold the page to them both ways: a code an emulator writes
//! that the page does not list fails, and so does a row for a code no
//! emulator writes any more.

use std::collections::BTreeSet;
use std::path::Path;

/// One emulator: its section of the page and the codes its sources write.
struct Emulator {
    heading: &'static str,
    codes: BTreeSet<String>,
}

fn read(relative: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    // Unit tests quote codes they expect; only what the emulator itself
    // writes counts. Test modules sit at the end of each file.
    let test_module = [
        "#[cfg(test)]\nmod tests",
        "#[cfg(test)]\npub(super) mod testing",
    ]
    .iter()
    .filter_map(|marker| text.find(marker))
    .min();
    match test_module {
        Some(at) => text[..at].to_string(),
        None => text,
    }
}

/// The string literal starting at `text[at..]` (at its opening quote).
fn literal(text: &str, at: usize) -> Option<String> {
    let rest = text[at..].strip_prefix('"')?;
    let end = rest.find('"')?;
    Some(rest[..end].to_string())
}

/// Every position just after `needle` in `text`, skipping definitions
/// (`fn needle`).
fn calls<'a>(text: &'a str, needle: &'a str) -> impl Iterator<Item = usize> + 'a {
    text.match_indices(needle)
        .filter(move |(at, _)| !text[..*at].ends_with("fn "))
        .map(move |(at, _)| at + needle.len())
}

fn skip_space(text: &str, at: usize) -> usize {
    at + text[at..].len() - text[at..].trim_start().len()
}

/// `aad(status, "error", CODE, …)`: the code is the first run of five or
/// more digits in the call.
fn entra_codes(text: &str) -> BTreeSet<String> {
    calls(text, "aad(")
        .filter_map(|at| {
            let call = &text[at..text.len().min(at + 300)];
            call.split(|c: char| !c.is_ascii_digit())
                .find(|run| run.len() >= 5)
                .map(|digits| format!("AADSTS{digits}"))
        })
        .collect()
}

/// `bad("description")`.
fn imds_descriptions(text: &str) -> BTreeSet<String> {
    calls(text, "bad(")
        .filter_map(|at| literal(text, at))
        .collect()
}

/// `oauth("error", …)` and `"error": "…"` in a JSON body.
fn oauth_errors(text: &str) -> BTreeSet<String> {
    calls(text, "oauth(")
        .chain(calls(text, "\"error\": "))
        .filter_map(|at| literal(text, skip_space(text, at)))
        .filter(|code| {
            !code.is_empty() && code.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
        })
        .collect()
}

/// Google API statuses: upper-case literals such as `"NOT_FOUND"`.
fn api_statuses(text: &str) -> BTreeSet<String> {
    text.split('"')
        .skip(1)
        .step_by(2)
        .filter(|s| {
            s.len() >= 4
                && s.bytes().all(|b| b.is_ascii_uppercase() || b == b'_')
                && !s.starts_with('_')
        })
        .map(str::to_string)
        .collect()
}

/// `sts_error(status, "Code", …)` with a literal code, and the codes of
/// SigV4 refusals (`SigV4Error::X => "Code"`).
fn sts_codes(text: &str) -> BTreeSet<String> {
    let called = calls(text, "sts_error(").filter_map(|at| {
        let comma = at + text[at..].find(',')?;
        literal(text, skip_space(text, comma + 1))
    });
    let sigv4 = text
        .lines()
        .filter(|line| line.trim_start().starts_with("SigV4Error::") && line.contains("=> \""))
        .filter_map(|line| {
            let at = line.find("=> \"")? + 3;
            literal(line, at)
        });
    called.chain(sigv4).collect()
}

/// `refuse(status, "error", …)`: the OAuth `error` of the identity-binding
/// proxy's own refusals.
fn proxy_errors(text: &str) -> BTreeSet<String> {
    calls(text, "refuse(")
        .filter_map(|at| {
            let comma = at + text[at..].find(',')?;
            literal(text, skip_space(text, comma + 1))
        })
        .collect()
}

fn emulators() -> Vec<Emulator> {
    let google = |files: &[&str]| -> BTreeSet<String> {
        files
            .iter()
            .map(|f| read(f))
            .flat_map(|t| {
                let mut codes = oauth_errors(&t);
                codes.extend(api_statuses(&t));
                codes
            })
            .collect()
    };
    // The fault renderers of gcp.rs write both STS's and IAM's formats:
    // the OAuth one to STS, the API one to IAM.
    let gcp_rs = read("emulators/src/gcp.rs");
    let mut sts = google(&["emulators/src/gcp/sts.rs"]);
    sts.extend(oauth_errors(&gcp_rs));
    let mut iam = google(&["emulators/src/gcp/iam.rs"]);
    iam.extend(api_statuses(&gcp_rs));
    let aws: BTreeSet<String> = [
        "emulators/src/aws.rs",
        "emulators/src/aws/assume_role.rs",
        "emulators/src/aws/validation.rs",
        "emulators/src/aws/sigv4.rs",
        "emulators/src/aws/sessions.rs",
    ]
    .iter()
    .flat_map(|f| sts_codes(&read(f)))
    .collect();
    vec![
        Emulator {
            heading: "## Entra ID token endpoint",
            codes: entra_codes(&read("emulators/src/entra.rs")),
        },
        Emulator {
            heading: "## The node's IMDS",
            codes: imds_descriptions(&read("emulators/src/imds.rs")),
        },
        Emulator {
            heading: "## AKS identity-binding proxy",
            codes: proxy_errors(&read("emulators/src/identity_binding.rs")),
        },
        Emulator {
            heading: "## Google STS",
            codes: sts,
        },
        Emulator {
            heading: "## Google IAM Credentials",
            codes: iam,
        },
        Emulator {
            heading: "## AWS STS",
            codes: aws,
        },
    ]
}

/// The page's section under `heading`, up to the next `## `.
fn section<'a>(page: &'a str, heading: &str) -> &'a str {
    let start = page
        .find(heading)
        .unwrap_or_else(|| panic!("docs/emulators.md has no section {heading:?}"));
    let body = &page[start + heading.len()..];
    match body.find("\n## ") {
        Some(end) => &body[..end],
        None => body,
    }
}

/// The body rows of a section's tables (not their headers).
fn body_rows(section: &str) -> Vec<&str> {
    let mut in_body = false;
    let mut rows = Vec::new();
    for line in section.lines() {
        if line.starts_with("|---") {
            in_body = true;
        } else if in_body && line.starts_with('|') {
            rows.push(line);
        } else {
            in_body = false;
        }
    }
    rows
}

/// The code each table row of a section is about: the first backticked
/// text of its first cell.
fn rows(section: &str) -> BTreeSet<String> {
    body_rows(section)
        .into_iter()
        .filter_map(|line| {
            let cell = line[1..].split(" |").next()?;
            let start = cell.find('`')? + 1;
            let end = start + cell[start..].find('`')?;
            Some(cell[start..end].to_string())
        })
        .collect()
}

#[test]
fn the_extractors_find_what_the_emulators_are_known_to_write() {
    // Guards the scanning itself: if a refactor renamed a helper, the
    // sets would empty and the other test would pass vacuously.
    let found = emulators();
    let known = [
        ("## Entra ID token endpoint", "AADSTS700231"),
        ("## Entra ID token endpoint", "AADSTS90033"),
        ("## The node's IMDS", "Identity not found"),
        ("## AKS identity-binding proxy", "unauthorized_client"),
        ("## Google STS", "invalid_target"),
        ("## Google STS", "quota_exceeded"),
        ("## Google IAM Credentials", "PERMISSION_DENIED"),
        ("## Google IAM Credentials", "RESOURCE_EXHAUSTED"),
        ("## AWS STS", "InvalidIdentityToken"),
        ("## AWS STS", "SignatureDoesNotMatch"),
        ("## AWS STS", "PackedPolicyTooLarge"),
    ];
    for (heading, code) in known {
        let emulator = found.iter().find(|e| e.heading == heading).unwrap();
        assert!(
            emulator.codes.contains(code),
            "{heading}: the scan of the sources misses {code}; found {:?}",
            emulator.codes
        );
    }
    for emulator in &found {
        assert!(
            emulator.codes.len() >= 5,
            "{}: {:?}",
            emulator.heading,
            emulator.codes
        );
    }
}

#[test]
fn every_code_an_emulator_writes_has_a_sourced_row_and_every_row_a_code() {
    let page =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/emulators.md"))
            .expect("docs/emulators.md");
    let mut problems = Vec::new();
    for emulator in emulators() {
        let section = section(&page, emulator.heading);
        let listed = rows(section);
        for code in &emulator.codes {
            // A code may be listed in a row of its own or named in another
            // row (an ErrorInfo reason, say), always in backticks.
            if !section.contains(&format!("`{code}`")) {
                problems.push(format!(
                    "{}: `{code}` is written but not listed",
                    emulator.heading
                ));
            }
        }
        for row in &listed {
            if !emulator.codes.contains(row) {
                problems.push(format!(
                    "{}: row `{row}` is written by no emulator source",
                    emulator.heading
                ));
            }
        }
        for line in body_rows(section) {
            let source = line
                .trim_end_matches('|')
                .rsplit(" | ")
                .next()
                .unwrap_or("");
            let sourced = ["exact", "code", "rule", "ours"]
                .iter()
                .any(|standing| source.trim_start().starts_with(standing));
            if !sourced {
                problems.push(format!(
                    "{}: row without a standing: {line}",
                    emulator.heading
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "docs/emulators.md:\n{}",
        problems.join("\n")
    );
}
