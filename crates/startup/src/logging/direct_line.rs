//! Lines written straight to the log's writer, in the plain-text
//! subscriber's layout, without passing through a `tracing` event.
//!
//! Why: every cache hit writes its audit line. Put together as one message
//! (`audit::log_line`), the line still cost about 2,700 instructions in the
//! subscriber under callgrind, more than the rest of the audit record: the
//! dispatch, the event's formatter copying the message behind the
//! timestamp, level and target into the subscriber's buffer, a scan for
//! terminal controls, and a copy into the writer. Here the line is put
//! together behind its prefix in one per-thread buffer, and that buffer
//! goes to the writer.
//!
//! The layout is `tracing-subscriber`'s `Full` format without colours,
//! byte for byte (`audit::log_line`'s test compares the two):
//! `TIMESTAMP LEVEL TARGET: MESSAGE`, the level padded to five characters.
//! A line is written here only when the subscriber would write those bytes
//! too: the plain text log is installed ([`install`]), no span is entered
//! (the subscriber would write the spans' names and fields before the
//! target), and the message holds no terminal control (the subscriber
//! would escape it). Otherwise [`write`] writes nothing and answers false,
//! and the caller logs through `tracing`.
//!
//! Measured together with the other formatting modules (`text_fields`,
//! `timestamp`, `direct_line`) against `tracing-subscriber`'s formatter and
//! timer: 1.18 and 1.23 times the cached-hit requests/s, 0.80 and 0.76
//! times the CPU per request (`bench/compare`, A B B A; `telemetry.rs`).

use std::cell::RefCell;
use std::fmt;
use std::io::Write as _;
use std::sync::OnceLock;
use std::time::SystemTime;

use tracing::Level;

use super::text_fields::has_terminal_controls;
use super::timestamp;

/// The writer the installed plain-text subscriber writes to.
pub enum Lines {
    /// The writer thread ([`super::LogWrites::Batched`]).
    Thread(tracing_appender::non_blocking::NonBlocking),
    /// Each line as it comes ([`super::LogWrites::Direct`]).
    Stderr,
}

static LINES: OnceLock<Lines> = OnceLock::new();

thread_local! {
    /// Each thread's line, reused: writing a line allocates nothing once
    /// the thread has written its longest (caller text is bounded).
    static LINE: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Lines may be written here from now on, to `lines`: the writer of the
/// plain text log just installed as the global subscriber.
pub fn install(lines: Lines) {
    let _ = LINES.set(lines);
}

/// Whether the plain text log is installed (see [`install`]).
pub fn installed() -> bool {
    LINES.get().is_some()
}

/// Writes a line of `level` on `target` whose message `fill` writes, as
/// the installed subscriber would write the event; false, with nothing
/// written, when this cannot be done byte for byte (see the module
/// documentation): the caller then logs the event through `tracing`.
pub fn write(level: Level, target: &str, fill: impl FnOnce(&mut String) -> fmt::Result) -> bool {
    let Some(lines) = LINES.get() else {
        return false;
    };
    if in_span() {
        return false;
    }
    LINE.with(|line| {
        // Held only while this line is put together and handed over:
        // nothing below logs, so the borrow is never taken twice.
        let Ok(mut line) = line.try_borrow_mut() else {
            return false;
        };
        line.clear();
        let Some(stamp) = timestamp::rfc3339_micros(SystemTime::now()) else {
            return false;
        };
        line.push_str(stamp.as_str());
        line.push(' ');
        if lay_out(&mut line, level, target, fill).is_err() {
            return false;
        }
        match lines {
            Lines::Thread(writer) => {
                let _ = writer.clone().write_all(line.as_bytes());
            }
            // As the subscriber's writer: a broken stderr is ignored.
            Lines::Stderr => {
                let _ = std::io::stderr().write_all(line.as_bytes());
            }
        }
        true
    })
}

/// Whether this thread is in a span, whose names and fields the
/// subscriber writes before the target.
fn in_span() -> bool {
    tracing::dispatcher::get_default(|d| d.current_span().id().is_some())
}

/// Appends the line after its timestamp: level, target, message and the
/// newline. An error when `fill` fails or the message holds a terminal
/// control.
pub fn lay_out(
    out: &mut String,
    level: Level,
    target: &str,
    fill: impl FnOnce(&mut String) -> fmt::Result,
) -> fmt::Result {
    out.push_str(match level {
        Level::TRACE => "TRACE ",
        Level::DEBUG => "DEBUG ",
        Level::INFO => " INFO ",
        Level::WARN => " WARN ",
        Level::ERROR => "ERROR ",
    });
    out.push_str(target);
    out.push_str(": ");
    let message = out.len();
    fill(out)?;
    if out.get(message..).is_none_or(has_terminal_controls) {
        return Err(fmt::Error);
    }
    out.push('\n');
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_and_target_are_laid_out_as_the_subscriber_does() {
        let mut line = String::new();
        lay_out(&mut line, Level::WARN, "lanyard::audit", |out| {
            out.push_str("credential refused");
            Ok(())
        })
        .unwrap();
        assert_eq!(line, " WARN lanyard::audit: credential refused\n");
        let subscriber = super::super::text_fields::capture::text_log(
            super::super::text_fields::TextFields,
            false,
            || tracing::warn!(target: "lanyard::audit", "credential refused"),
        );
        assert_eq!(line, subscriber);
    }

    #[test]
    fn a_message_the_subscriber_would_escape_is_left_to_it() {
        for text in ["\x1b[2J", "bell\x07", "c1 \u{9b}", "del\x7f"] {
            let mut line = String::new();
            let laid_out = lay_out(&mut line, Level::INFO, "t", |out| {
                out.push_str(text);
                Ok(())
            });
            assert!(laid_out.is_err(), "{text:?}");
        }
        let failed = lay_out(&mut String::new(), Level::INFO, "t", |_| Err(fmt::Error));
        assert!(failed.is_err());
    }

    #[test]
    fn a_span_is_seen() {
        let subscriber = tracing_subscriber::fmt().finish();
        tracing::subscriber::with_default(subscriber, || {
            assert!(!in_span());
            let span = tracing::info_span!("request");
            let entered = span.enter();
            assert!(in_span());
            drop(entered);
            assert!(!in_span());
        });
    }

    #[test]
    fn nothing_is_written_before_the_log_is_installed() {
        // Tests never install the process's log.
        assert!(!installed());
        assert!(!write(Level::INFO, "t", |_| panic!("not laid out")));
    }

    #[test]
    fn the_timestamp_is_the_log_timers() {
        let line = timestamp::rfc3339_micros(SystemTime::now())
            .unwrap()
            .as_str()
            .to_string();
        let at = time::OffsetDateTime::parse(&line, &time::format_description::well_known::Rfc3339)
            .unwrap();
        let now = time::OffsetDateTime::now_utc();
        assert!((now - at).abs() < time::Duration::seconds(5), "{line}");
        assert_eq!(line.len(), "2026-12-04T12:31:54.317780Z".len(), "{line}");
    }
}
