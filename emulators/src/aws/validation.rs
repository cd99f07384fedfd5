//! STS's declarative request checks (the constraints of its API model:
//! lengths, patterns, ranges, required members), collected into one
//! `ValidationError` the way AWS's front end reports them:
//! "2 validation errors detected: Value 'x' at 'roleSessionName' failed to
//! satisfy constraint: …; Value …".

use axum::http::StatusCode;

use super::{sts_error, StsError};

/// How a violating value appears in the message.
#[derive(Debug, Clone, Copy)]
pub(super) enum Shown<'a> {
    /// `Value null at …` (the member is missing).
    Null,
    /// `Value 'x' at …`.
    Value(&'a str),
    /// `Value '*** Sensitive Data Redacted ***' at …` (AWS hides sensitive
    /// members, such as tokens).
    Redacted,
    /// `Value at …` (lists, which the emulator does not render).
    Hidden,
}

/// The violations found so far.
#[derive(Debug, Default)]
pub(super) struct Violations {
    errors: Vec<String>,
}

impl Violations {
    /// Records that `member` failed `constraint`.
    pub(super) fn fail(&mut self, shown: Shown<'_>, member: &str, constraint: &str) {
        let value = match shown {
            Shown::Null => " null".to_string(),
            Shown::Value(v) => format!(" '{v}'"),
            Shown::Redacted => " '*** Sensitive Data Redacted ***'".to_string(),
            Shown::Hidden => String::new(),
        };
        self.errors.push(format!(
            "Value{value} at '{member}' failed to satisfy constraint: {constraint}"
        ));
    }

    /// Checks a string member's length, in characters, against `min..=max`.
    pub(super) fn length(
        &mut self,
        value: &str,
        shown: Shown<'_>,
        member: &str,
        min: usize,
        max: usize,
    ) {
        let len = value.chars().count();
        if len < min {
            self.fail(
                shown,
                member,
                &format!("Member must have length greater than or equal to {min}"),
            );
        } else if len > max {
            self.fail(
                shown,
                member,
                &format!("Member must have length less than or equal to {max}"),
            );
        }
    }

    /// Checks a string member against a pattern, given as `allowed` per
    /// character and AWS's spelling of the regular expression.
    pub(super) fn pattern(
        &mut self,
        value: &str,
        shown: Shown<'_>,
        member: &str,
        allowed: impl Fn(char) -> bool,
        regex: &str,
    ) {
        if !value.chars().all(allowed) {
            self.fail(
                shown,
                member,
                &format!("Member must satisfy regular expression pattern: {regex}"),
            );
        }
    }

    /// Whether nothing failed.
    /// `RoleArn` and `RoleSessionName`, constrained alike by both
    /// `AssumeRole` operations.
    pub(super) fn role_and_session(&mut self, role_arn: Option<&str>, session_name: Option<&str>) {
        match role_arn {
            None => self.fail(Shown::Null, "roleArn", "Member must not be null"),
            Some(arn) => self.length(arn, Shown::Value(arn), "roleArn", 20, 2048),
        }
        match session_name {
            None => self.fail(Shown::Null, "roleSessionName", "Member must not be null"),
            Some(name) => {
                self.pattern(
                    name,
                    Shown::Value(name),
                    "roleSessionName",
                    session_name_char,
                    r"[\w+=,.@-]*",
                );
                self.length(name, Shown::Value(name), "roleSessionName", 2, 64);
            }
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.errors.is_empty()
    }

    /// `Ok` when nothing failed, else the one `ValidationError` naming all.
    pub(super) fn finish(self) -> Result<(), StsError> {
        if self.errors.is_empty() {
            return Ok(());
        }
        let n = self.errors.len();
        let plural = if n == 1 { "" } else { "s" };
        Err(sts_error(
            StatusCode::BAD_REQUEST,
            "ValidationError",
            format!(
                "{n} validation error{plural} detected: {}",
                self.errors.join("; ")
            ),
        ))
    }
}

/// `[\w+=,.@-]`: role session names (and role names).
pub(super) use crate::arn::session_name_char;

/// `[\w+=,.@:\/-]`: external ids.
pub(super) fn external_id_char(c: char) -> bool {
    session_name_char(c) || c == ':' || c == '/'
}

/// `[\p{L}\p{Z}\p{N}_.:/=+\-@]`: tag keys and values. Letters, separators
/// (`Zs`, `Zl`, `Zp`: whitespace that is not a control character) and
/// numbers, of any script.
pub(super) fn tag_char(c: char) -> bool {
    c.is_alphabetic()
        || c.is_numeric()
        || (c.is_whitespace() && !c.is_control())
        || matches!(c, '_' | '.' | ':' | '/' | '=' | '+' | '-' | '@')
}

/// `[\u0009\u000A\u000D\u0020-\u00FF]`: session policy documents.
pub(super) fn policy_char(c: char) -> bool {
    matches!(c, '\u{9}' | '\u{a}' | '\u{d}' | '\u{20}'..='\u{ff}')
}

/// The `DurationSeconds` member: an integer within `min..=max`, `default`
/// when absent.
pub(super) fn duration(
    violations: &mut Violations,
    raw: Option<&str>,
    min: u64,
    max: u64,
    default: u64,
) -> u64 {
    let Some(raw) = raw else {
        return default;
    };
    match raw.trim().parse::<i64>() {
        Ok(n) if n < i64::try_from(min).unwrap_or(i64::MAX) => {
            violations.fail(
                Shown::Value(raw),
                "durationSeconds",
                &format!("Member must have value greater than or equal to {min}"),
            );
            default
        }
        Ok(n) if n > i64::try_from(max).unwrap_or(i64::MAX) => {
            violations.fail(
                Shown::Value(raw),
                "durationSeconds",
                &format!("Member must have value less than or equal to {max}"),
            );
            default
        }
        Ok(n) => n.unsigned_abs(),
        Err(_) => {
            violations.fail(
                Shown::Value(raw),
                "durationSeconds",
                "Member must be a valid integer",
            );
            default
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aws_tag_characters_follow_the_model() {
        for ok in [
            "Project",
            "kubernetes-pod-name",
            "a b",
            "ü_ñ:日本/=+-@.",
            "١٢",
        ] {
            assert!(ok.chars().all(tag_char), "{ok}");
        }
        for bad in ["a\tb", "a,b", "a*b", "a#b", "a\u{0}b"] {
            assert!(!bad.chars().all(tag_char), "{bad:?}");
        }
        assert!("arn:aws:iam::1:role/x".chars().all(external_id_char));
        assert!(!"a b".chars().all(external_id_char));
        assert!("{\"a\":\t1}\n".chars().all(policy_char));
        assert!(!"€".chars().all(policy_char));
    }

    #[test]
    fn aws_violations_render_like_aws() {
        let mut v = Violations::default();
        v.fail(Shown::Null, "roleArn", "Member must not be null");
        v.fail(
            Shown::Hidden,
            "tags",
            "Member must have length less than or equal to 50",
        );
        v.length("x", Shown::Value("x"), "roleSessionName", 2, 64);
        let e = v.finish().unwrap_err();
        assert_eq!(e.code, "ValidationError");
        assert_eq!(
            e.message,
            "3 validation errors detected: Value null at 'roleArn' failed to satisfy constraint: Member must not be null; Value at 'tags' failed to satisfy constraint: Member must have length less than or equal to 50; Value 'x' at 'roleSessionName' failed to satisfy constraint: Member must have length greater than or equal to 2"
        );
        assert!(Violations::default().finish().is_ok());
    }
}
