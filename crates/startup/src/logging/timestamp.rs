//! The log's timestamp: the text `tracing-subscriber`'s default timer
//! writes (RFC 3339 in UTC with microseconds, `2026-12-04T12:31:54.317780Z`),
//! with the part up to the second formatted once per second per thread.
//!
//! Why: the default timer formats seven numbers through `core::fmt` on
//! every line, about 2,000 instructions, and every cache hit writes an
//! audit line. Here a line within the same second as the thread's last
//! copies 20 cached bytes and writes six digits.
//!
//! Measured together with the other formatting modules (`text_fields`,
//! `timestamp`, `direct_line`) against `tracing-subscriber`'s formatter and
//! timer: 1.18 and 1.23 times the cached-hit requests/s, 0.80 and 0.76
//! times the CPU per request (`bench/compare`, A B B A; `telemetry.rs`).

use std::cell::Cell;
use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use time::OffsetDateTime;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::FormatTime;

/// `YYYY-MM-DDTHH:MM:SS.`
const PREFIX: usize = 20;
/// The prefix, six digits of microseconds and `Z`.
const LENGTH: usize = PREFIX + 7;

/// The timer the log is installed with.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timestamp;

thread_local! {
    /// The Unix second last formatted on this thread, and its prefix.
    static SECOND: Cell<Option<(u64, [u8; PREFIX])>> = const { Cell::new(None) };
}

impl FormatTime for Timestamp {
    fn format_time(&self, w: &mut Writer<'_>) -> fmt::Result {
        match rfc3339_micros(SystemTime::now()) {
            Some(stamp) => w.write_str(stamp.as_str()),
            // Before 1970 or past 9999: as the default timer writes it.
            None => tracing_subscriber::fmt::time::SystemTime.format_time(w),
        }
    }
}

/// A time as the log writes it, on the stack.
pub struct Stamp([u8; LENGTH]);

impl Stamp {
    /// The text (ASCII digits and punctuation).
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

/// `t` as the log writes times (`2026-12-04T12:31:54.317780Z`); `None`
/// before 1970 or past 9999, which the default timer writes in other
/// shapes.
pub fn rfc3339_micros(t: SystemTime) -> Option<Stamp> {
    let since_epoch = t.duration_since(UNIX_EPOCH).ok()?;
    let mut line = [0; LENGTH];
    render(since_epoch, &mut line).then_some(Stamp(line))
}

/// Writes `since_epoch` into `line`; false for a year past 9999, which
/// the default timer writes in another shape.
fn render(since_epoch: Duration, line: &mut [u8; LENGTH]) -> bool {
    let second = since_epoch.as_secs();
    let prefix = match SECOND.get() {
        Some((cached, prefix)) if cached == second => prefix,
        _ => {
            let Some(prefix) = prefix(second) else {
                return false;
            };
            SECOND.set(Some((second, prefix)));
            prefix
        }
    };
    line[..PREFIX].copy_from_slice(&prefix);
    digits(&mut line[PREFIX..PREFIX + 6], since_epoch.subsec_micros());
    line[LENGTH - 1] = b'Z';
    true
}

/// `YYYY-MM-DDTHH:MM:SS.` of the Unix second `second`, UTC.
fn prefix(second: u64) -> Option<[u8; PREFIX]> {
    let at = OffsetDateTime::from_unix_timestamp(i64::try_from(second).ok()?).ok()?;
    let year = u32::try_from(at.year()).ok().filter(|y| *y <= 9999)?;
    let mut out = *b"0000-00-00T00:00:00.";
    digits(&mut out[0..4], year);
    digits(&mut out[5..7], u8::from(at.month()).into());
    digits(&mut out[8..10], at.day().into());
    digits(&mut out[11..13], at.hour().into());
    digits(&mut out[14..16], at.minute().into());
    digits(&mut out[17..19], at.second().into());
    Some(out)
}

/// `value` in decimal, zero-padded to fill `out` (its lowest digits).
fn digits(out: &mut [u8], mut value: u32) {
    for slot in out.iter_mut().rev() {
        // INVARIANT: value % 10 < 10, so the byte is an ASCII digit.
        *slot = b'0' + (value % 10) as u8;
        value /= 10;
    }
}

#[cfg(test)]
mod tests {
    use time::format_description::well_known::Rfc3339;

    use super::*;

    fn rendered(since_epoch: Duration) -> String {
        let mut line = [0; LENGTH];
        assert!(render(since_epoch, &mut line));
        String::from_utf8(line.to_vec()).unwrap()
    }

    /// The `time` crate's RFC 3339 of the same instant, cut to microseconds.
    fn expected(since_epoch: Duration) -> String {
        let nanos = since_epoch.as_nanos() / 1_000 * 1_000;
        let at = OffsetDateTime::from_unix_timestamp_nanos(nanos as i128).unwrap();
        let text = at.format(&Rfc3339).unwrap();
        // `time` writes the fraction without trailing zeros (or none).
        let (whole, fraction) = text
            .trim_end_matches('Z')
            .split_once('.')
            .map_or((text.trim_end_matches('Z'), ""), |(w, f)| (w, f));
        format!("{whole}.{fraction:0<6}Z")
    }

    #[test]
    fn writes_what_rfc_3339_says_for_awkward_instants() {
        let instants = [
            0,
            1,
            59,
            86_399,
            951_782_400,   // 2000-02-29
            1_709_164_800, // 2024-02-29
            1_735_689_599, // 2024-12-31T23:59:59
            1_735_689_600, // 2025-01-01
            1_796_387_515,
            4_102_444_800,   // 2100-01-01
            253_402_300_799, // 9999-12-31T23:59:59
        ];
        for second in instants {
            for micros in [0, 1, 999_999, 317_780] {
                let at = Duration::new(second, micros * 1_000 + 999);
                assert_eq!(rendered(at), expected(at), "{at:?}");
            }
        }
        // Every second of a day, in order and out of order (the per-thread
        // cache must never answer for another second).
        for second in (1_735_603_200..1_735_603_200 + 86_400).step_by(7) {
            let at = Duration::new(second, 5_000);
            assert_eq!(rendered(at), expected(at));
            let back = Duration::new(second - 1, 5_000);
            assert_eq!(rendered(back), expected(back));
        }
        // Past 9999 the default timer's own shape is used.
        let mut line = [0; LENGTH];
        assert!(!render(Duration::from_secs(253_402_300_800), &mut line));
    }

    #[test]
    fn matches_the_default_timer() {
        // Taken one after the other, the two agree to the minute (retried
        // should a minute end between them).
        for _ in 0..3 {
            let mut ours = String::new();
            let mut theirs = String::new();
            Timestamp.format_time(&mut Writer::new(&mut ours)).unwrap();
            tracing_subscriber::fmt::time::SystemTime
                .format_time(&mut Writer::new(&mut theirs))
                .unwrap();
            assert_eq!(ours.len(), theirs.len(), "{ours} {theirs}");
            assert_eq!(ours.len(), LENGTH);
            if ours[..16] == theirs[..16] {
                assert!(ours.ends_with('Z') && ours.as_bytes()[PREFIX - 1] == b'.');
                return;
            }
        }
        panic!("the timestamps never agreed to the minute");
    }
}
