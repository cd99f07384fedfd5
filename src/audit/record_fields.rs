//! The parts every audit record shares, whichever way it is written: the
//! schema, the origin, and the times, latencies and outcome as the record
//! puts them. [`super::record`] (the derived record types) and
//! [`super::credential_record`] (the credential record) both use them, and
//! neither imports the other for them.

use std::time::SystemTime;

use serde::Serialize;

use super::{AuditEvent, Verdict};
use crate::cache::CacheOutcome;

/// The schema every record names; a change that removes or retypes a field
/// gets a new one.
pub const SCHEMA: &str = "lanyard.audit/v1";

/// Where records come from: named in each.
#[derive(Debug, Clone, Serialize)]
pub struct Origin {
    /// The cluster (`audit.cluster`): many clusters can share a collector.
    pub cluster: String,
    /// The node this process runs on ("" when unknown).
    pub node: String,
    /// The role writing: `agent`, `sidecar`, `webhook` or `dev`.
    pub role: &'static str,
    /// Lanyard's version.
    pub version: &'static str,
}

impl Origin {
    /// An origin for `role` of this build.
    pub fn new(cluster: impl Into<String>, node: impl Into<String>, role: &'static str) -> Self {
        Origin {
            cluster: cluster.into(),
            node: node.into(),
            role,
            version: env!("CARGO_PKG_VERSION"),
        }
    }
}

/// RFC 3339, UTC, with microseconds (the precision RFC 5424 syslog
/// timestamps allow, so every sink shows the same time).
pub fn rfc3339(t: SystemTime) -> String {
    with_rfc3339(t, str::to_owned)
}

/// Calls `f` with `t` as [`rfc3339`] puts it, formatted on the stack: a
/// record's times cost no heap string.
pub(crate) fn with_rfc3339<R>(t: SystemTime, f: impl FnOnce(&str) -> R) -> R {
    // The log's timer writes the same text, with the date and time of day
    // worked out once per second (the `time` crate's formatting cost about
    // 750 instructions a time, two times a record).
    if let Some(stamp) = crate::telemetry::timestamp::rfc3339_micros(t) {
        return f(stamp.as_str());
    }
    with_formatted_rfc3339(t, f)
}

/// As [`with_rfc3339`], by the `time` crate's formatting: for times the
/// log's timer does not write (before 1970, past 9999).
fn with_formatted_rfc3339<R>(t: SystemTime, f: impl FnOnce(&str) -> R) -> R {
    const FORMAT: &[time::format_description::BorrowedFormatItem<'_>] = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:6]Z"
    );
    // `2026-12-04T23:30:27.426941Z` is 27 bytes; years past 9999 do not
    // format (as before, an empty time).
    // `OffsetDateTime::from(SystemTime)` panics outside the `time` crate's
    // range (an upstream's absurd expiry): converted fallibly, such a time
    // is written empty too.
    let nanos = match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(after) => i128::try_from(after.as_nanos()).ok(),
        Err(before) => i128::try_from(before.duration().as_nanos())
            .ok()
            .map(|n| -n),
    };
    let mut buf = [0u8; 32];
    let mut rest = &mut buf[..];
    let len = nanos
        .and_then(|n| time::OffsetDateTime::from_unix_timestamp_nanos(n).ok())
        .and_then(|at| at.format_into(&mut rest, FORMAT).ok())
        .unwrap_or(0);
    f(std::str::from_utf8(&buf[..len]).unwrap_or_default())
}

/// Every record: the members all types begin with, in this order (the
/// format and the hash chain depend on it), then the type's own (`body`).
#[derive(Serialize)]
pub(super) struct Envelope<'a, B> {
    schema: &'static str,
    id: uuid::Uuid,
    time: Rfc3339,
    #[serde(rename = "type")]
    kind: &'static str,
    #[serde(flatten)]
    origin: &'a Origin,
    #[serde(flatten)]
    body: B,
}

impl<'a, B: Serialize> Envelope<'a, B> {
    /// Record `id` of type `kind`, made at `time` by `origin`.
    pub(super) fn new(
        id: uuid::Uuid,
        time: SystemTime,
        kind: &'static str,
        origin: &'a Origin,
        body: B,
    ) -> Self {
        Envelope {
            schema: SCHEMA,
            id,
            time: Rfc3339(time),
            kind,
            origin,
            body,
        }
    }
}

/// A record's time, serialized as [`rfc3339`] without a heap string.
pub(super) struct Rfc3339(pub(super) SystemTime);

impl Serialize for Rfc3339 {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        with_rfc3339(self.0, |s| serializer.serialize_str(s))
    }
}

/// `unix` seconds as a time.
pub(crate) fn unix_time(unix: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(unix)
}

/// Milliseconds with microsecond precision, as the record and the log
/// line write latencies.
pub(crate) fn millis(d: std::time::Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// Calls `f` with [`millis`]`(d)` as its `Debug` (and JSON) text writes it,
/// formatted from its integer microseconds: every audit line has a latency,
/// and float formatting cost more than the rest of the number's field.
pub(crate) fn with_millis<R>(d: std::time::Duration, f: impl FnOnce(&str) -> R) -> R {
    let micros = (d.as_secs_f64() * 1e6).round();
    // Beyond 2^53 µs (285 years) a value is no longer a whole number of
    // microseconds: the float's own text then.
    if !(0.0..9.0e15).contains(&micros) {
        return f(&format!("{:?}", millis(d)));
    }
    // INVARIANT: `micros / 1e3` is the double nearest to the decimal
    // `whole.frac`, and no shorter decimal is nearer to it, so the shortest
    // text that reads back as that double (what `Debug` writes) is that
    // decimal, trailing zeros dropped, ".0" when whole.
    let micros = micros as u64;
    let (whole, frac) = (micros / 1000, micros % 1000);
    let mut itoa = itoa::Buffer::new();
    let whole = itoa.format(whole).as_bytes();
    let fraction = [frac / 100, frac / 10 % 10, frac % 10].map(|d| b'0' + d as u8);
    let kept = match fraction {
        [_, b'0', b'0'] => 1,
        [_, _, b'0'] => 2,
        _ => 3,
    };
    // At most 16 digits, a point and 3 digits.
    let mut buf = [0u8; 24];
    let len = whole.len() + 1 + kept;
    buf[..whole.len()].copy_from_slice(whole);
    buf[whole.len()] = b'.';
    buf[whole.len() + 1..len].copy_from_slice(&fraction[..kept]);
    f(std::str::from_utf8(&buf[..len]).unwrap_or_default())
}

/// The record's `outcome.result`: what became of the request.
pub(crate) fn outcome_of(e: &AuditEvent<'_>) -> &'static str {
    match (e.verdict, e.cache) {
        (Verdict::Allow, Some(CacheOutcome::Hit)) => "cached",
        (Verdict::Allow, _) => "issued",
        (Verdict::Deny, Some(CacheOutcome::Negative)) => "upstream_error",
        (Verdict::Deny, _) => match e.reason {
            Some("upstream_rejected" | "upstream_unavailable" | "upstream_throttled") => {
                "upstream_error"
            }
            _ => "refused",
        },
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use super::{millis, rfc3339, with_formatted_rfc3339, with_millis};

    #[test]
    fn times_are_written_as_the_time_crate_formats_them() {
        let mut instants = vec![
            SystemTime::UNIX_EPOCH - Duration::from_micros(1_500_000),
            // Past 9999: neither writes it.
            SystemTime::UNIX_EPOCH + Duration::from_secs(253_402_300_800),
        ];
        for second in [
            0,
            59,
            951_782_400,
            1_735_689_599,
            1_796_280_456,
            253_402_300_799,
        ] {
            for micros in [0, 1, 999_999, 123_456] {
                instants.push(SystemTime::UNIX_EPOCH + Duration::new(second, micros * 1_000 + 789));
            }
        }
        for t in instants {
            assert_eq!(
                rfc3339(t),
                with_formatted_rfc3339(t, str::to_owned),
                "{t:?}"
            );
        }
        // Far outside any calendar the `time` crate knows: empty, no panic.
        let far = SystemTime::UNIX_EPOCH + Duration::from_secs(1 << 50);
        assert_eq!(rfc3339(far), "");
        assert_eq!(
            rfc3339(SystemTime::UNIX_EPOCH + Duration::new(1_796_280_456, 123_456_789)),
            "2026-12-03T06:47:36.123456Z"
        );
    }

    #[test]
    fn millis_text_is_the_floats_debug_text() {
        let mut cases: Vec<Duration> = [
            0,
            1,
            9,
            10,
            99,
            100,
            204,
            999,
            1_000,
            1_001,
            1_010,
            1_500,
            12_345,
            999_999,
            1_000_000,
            86_400_000_000,
            4_503_599_627_370_495,
        ]
        .map(Duration::from_micros)
        .into();
        cases.extend([
            Duration::from_nanos(499),
            Duration::from_nanos(500),
            Duration::from_nanos(1_499_501),
        ]);
        // A spread of latencies, nanoseconds included (rounded to µs).
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            cases.push(Duration::from_nanos(x % 100_000_000_000));
        }
        for d in cases {
            let expected = format!("{:?}", millis(d));
            with_millis(d, |text| assert_eq!(text, expected, "{d:?}"));
            // And as JSON writes the number (the durable record's form).
            assert_eq!(
                serde_json::to_string(&millis(d)).unwrap(),
                expected,
                "{d:?}"
            );
        }
    }
}
