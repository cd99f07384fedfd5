//! The text log's fields, written byte for byte as `tracing-subscriber`'s
//! default field formatter writes them, in less time.
//!
//! Every request that reaches the broker logs its audit line, cache hits
//! included, and the line is mostly string fields. The default formatter
//! writes each one through `{:?}` (a character-by-character escape) after
//! two ANSI styles that are no-ops without colours: under load that was 7 %
//! of `lanyard dev`'s CPU, more than the rest of the line. Here a string
//! that needs no escaping (printable ASCII without quotes or `\`, which is
//! what names, namespaces, resources and fingerprints are) is copied as is
//! between quotes; anything else takes the standard library's escape, so
//! the bytes are the same either way. With colours (a terminal), the
//! default formatter writes the fields.
//!
//! Measured together with the other formatting modules (`text_fields`,
//! `timestamp`, `direct_line`) against `tracing-subscriber`'s formatter and
//! timer: 1.18 and 1.23 times the cached-hit requests/s, 0.80 and 0.76
//! times the CPU per request (`bench/compare`, A B B A; `telemetry.rs`).

use std::fmt::{self, Write as _};

use super::ascii_words::{above_tilde_in, any_word, byte_in, control_in};
use tracing::field::{Field, Visit};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::format::{DefaultFields, Writer};
use tracing_subscriber::fmt::FormatFields;

/// The text log's field formatter (see the module documentation).
#[derive(Debug, Default, Clone, Copy)]
pub struct TextFields;

impl<'writer> FormatFields<'writer> for TextFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'writer>, fields: R) -> fmt::Result {
        if writer.has_ansi_escapes() {
            return DefaultFields::new().format_fields(writer, fields);
        }
        let mut visitor = Visitor {
            writer,
            is_empty: true,
            result: Ok(()),
        };
        fields.record(&mut visitor);
        visitor.result
    }
}

/// Writes fields as `tracing-subscriber`'s `DefaultVisitor` does without
/// colours: the message first as text, then `name=value` pairs separated
/// by spaces, values in their `Debug` form.
struct Visitor<'a> {
    writer: Writer<'a>,
    is_empty: bool,
    result: fmt::Result,
}

impl Visitor<'_> {
    /// Whether `name` is written at all: `log.*` fields carry a `log`
    /// record's metadata, which the line's prefix has shown already.
    fn skipped(name: &str) -> bool {
        name.starts_with("log.")
    }

    /// Writes the separator: none before the first field, else a space.
    fn separate(&mut self) -> fmt::Result {
        if self.is_empty {
            self.is_empty = false;
            Ok(())
        } else {
            self.writer.write_str(" ")
        }
    }

    /// Writes the separator, `name` and `=`.
    fn start(&mut self, name: &str) -> fmt::Result {
        self.separate()?;
        self.writer.write_str(Self::name(name))?;
        self.writer.write_str("=")
    }

    /// A field written as `name=` and `value`'s decimal digits, which is
    /// what an integer's `Debug` writes.
    fn record_integer<T: itoa::Integer + fmt::Debug>(&mut self, field: &Field, value: T) {
        if self.result.is_err() {
            return;
        }
        let name = field.name();
        if name == "message" || Self::skipped(name) {
            return self.record_debug(field, &value);
        }
        self.result = self
            .start(name)
            .and_then(|()| self.writer.write_str(itoa::Buffer::new().format(value)));
    }

    fn name(name: &str) -> &str {
        name.strip_prefix("r#").unwrap_or(name)
    }
}

impl Visit for Visitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if self.result.is_err() {
            return;
        }
        let name = field.name();
        if name == "message" {
            return self.record_debug(field, &format_args!("{value}"));
        }
        if Self::skipped(name) {
            return;
        }
        self.result = self
            .start(name)
            .and_then(|()| write_debug_str(&mut self.writer, value));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.record_integer(field, value);
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.record_integer(field, value);
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        let sanitize = self.writer.sanitizes_ansi_escapes();
        match value.source() {
            Some(source) => self.record_debug(
                field,
                &format_args!(
                    "{:?} {}.sources={}",
                    Sanitized::new(format_args!("{value}"), sanitize),
                    field.name(),
                    SourceList { source, sanitize }
                ),
            ),
            None => self.record_debug(
                field,
                &format_args!("{:?}", Sanitized::new(format_args!("{value}"), sanitize)),
            ),
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if self.result.is_err() {
            return;
        }
        let name = field.name();
        if Self::skipped(name) {
            return;
        }
        let sanitize = self.writer.sanitizes_ansi_escapes();
        self.result = match name {
            "message" => self
                .separate()
                .and_then(|()| write!(self.writer, "{:?}", Sanitized::new(value, sanitize))),
            name => self
                .start(name)
                .and_then(|()| write!(self.writer, "{value:?}")),
        };
    }
}

/// Whether both `str`'s `Debug` and `str::escape_debug` write `text`
/// unchanged: printable ASCII without `"`, `\` or `'`. Names, namespaces,
/// resources and fingerprints are; the check lets them be copied whole.
pub fn needs_no_escape(text: &str) -> bool {
    !any_word(text, escaped_in)
}

/// Nonzero when a byte of `word` is one `Debug` or `escape_debug` writes
/// as anything but itself: below `0x20`, above `0x7e`, or `"`, `\` or
/// `'`. The usual word-at-a-time tests (each exact about whether such a
/// byte exists, not about which byte it is).
fn escaped_in(word: u64) -> u64 {
    control_in(word)
        | above_tilde_in(word)
        | byte_in(word, b'"')
        | byte_in(word, b'\\')
        | byte_in(word, b'\'')
}

/// Whether `text` may hold a control character a terminal acts on: ESC,
/// BEL, BS, FF, DEL, or a C1 control (U+0080..U+009F: in UTF-8, 0xC2 then
/// 0x80..0x9F; any 0xC2 counts). A whole audit line passes through this
/// check: two vectorized scans (`memchr3`) instead of six compares a byte.
pub fn has_terminal_controls(text: &str) -> bool {
    let bytes = text.as_bytes();
    memchr::memchr3(0x1b, 0x07, 0x08, bytes).is_some()
        || memchr::memchr3(0x0c, 0x7f, 0xc2, bytes).is_some()
}

/// `value` as `<str as Debug>` writes it: copied between quotes when no
/// character needs an escape, else the standard library's own escape.
pub fn write_debug_str(w: &mut impl fmt::Write, value: &str) -> fmt::Result {
    if needs_no_escape(value) {
        w.write_str("\"")?;
        w.write_str(value)?;
        w.write_str("\"")
    } else {
        write!(w, "{value:?}")
    }
}

/// Formats its value (`Debug`; of `format_args!` that is its text) with
/// terminal control characters escaped (when `sanitize`), as
/// `tracing-subscriber` does for messages and errors, so a caller's text
/// cannot drive a terminal that shows the log.
struct Sanitized<T> {
    value: T,
    sanitize: bool,
}

impl<T> Sanitized<T> {
    fn new(value: T, sanitize: bool) -> Self {
        Sanitized { value, sanitize }
    }
}

impl<T: fmt::Debug> fmt::Debug for Sanitized<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.sanitize {
            write!(Escaping(f), "{:?}", self.value)
        } else {
            write!(f, "{:?}", self.value)
        }
    }
}

/// An error's sources as a list: `[first, second]`.
struct SourceList<'a> {
    source: &'a (dyn std::error::Error + 'static),
    sanitize: bool,
}

impl fmt::Display for SourceList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut list = f.debug_list();
        let mut next = Some(self.source);
        while let Some(error) = next {
            list.entry(&Sanitized::new(format_args!("{error}"), self.sanitize));
            next = error.source();
        }
        list.finish()
    }
}

/// Passes text through, escaping the C0 controls terminals act on (ESC,
/// BEL, BS, FF), DEL and the C1 controls, as `tracing-subscriber` does.
struct Escaping<'a, 'b>(&'a mut fmt::Formatter<'b>);

impl fmt::Write for Escaping<'_, '_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        if !has_terminal_controls(s) {
            return self.0.write_str(s);
        }
        for ch in s.chars() {
            match ch {
                '\x1b' => self.0.write_str("\\x1b")?,
                '\x07' => self.0.write_str("\\x07")?,
                '\x08' => self.0.write_str("\\x08")?,
                '\x0c' => self.0.write_str("\\x0c")?,
                '\x7f' => self.0.write_str("\\x7f")?,
                '\u{80}'..='\u{9f}' => write!(self.0, "\\u{{{:x}}}", ch as u32)?,
                _ => self.0.write_char(ch)?,
            }
        }
        Ok(())
    }
}

/// What a text log writes, captured for tests (feature `capture`: the
/// tests of this crate and of the product, never a shipped binary).
#[cfg(any(test, feature = "capture"))]
pub mod capture {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::fmt::{FormatFields, MakeWriter};

    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Buffer {
        type Writer = Buffer;
        fn make_writer(&'a self) -> Buffer {
            self.clone()
        }
    }

    /// The lines `emit` logs (debug and up, no time) through a text
    /// subscriber with `fields` as its field formatter.
    pub fn text_log<N>(fields: N, ansi: bool, emit: impl FnOnce()) -> String
    where
        N: for<'w> FormatFields<'w> + Send + Sync + 'static,
    {
        let out = Buffer::default();
        let subscriber = tracing_subscriber::fmt()
            .without_time()
            .with_ansi(ansi)
            .with_max_level(tracing::Level::DEBUG)
            .fmt_fields(fields)
            .with_writer(out.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, emit);
        let bytes = out
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logging::ascii_words::texts_with_each_odd_char;

    #[derive(Debug)]
    struct Outer(Inner);
    #[derive(Debug)]
    struct Inner;
    impl fmt::Display for Outer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("outer \x1b[31mred")
        }
    }
    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }
    impl fmt::Display for Inner {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("inner \u{85}cause")
        }
    }
    impl std::error::Error for Inner {}

    /// Events with every kind of field and awkward text: what the audit
    /// line holds (names, resources, fingerprints, numbers) and what a
    /// caller might send (quotes, controls, non-ASCII, escape sequences).
    fn emit() {
        let texts = [
            "",
            "ray-worker",
            "https://storage.azure.com/",
            "sha256:6933b20fe771",
            "a \"quoted\" word",
            "back\\slash",
            "tab\tnew\nline\r",
            "\x1b[2J\x07bell\x08\x0c\x7f",
            "caf\u{e9} \u{1f512} e\u{301} zero\u{200b}width \u{85}c1 \u{9f}",
            "nul\0end",
            "~ !#$%&'()*+,-./:;<=>?@[]^_`{|}",
        ];
        let error = Outer(Inner);
        let span = tracing::info_span!("request", surface = "azure_imds", n = 3_u64);
        let _entered = span.enter();
        for text in texts {
            tracing::info!(
                target: "lanyard::audit",
                decision = "allow",
                resource = text,
                r#type = text,
                shown = %text,
                debugged = ?text,
                expires_at = 1_796_376_919_u64,
                delta = -4_i64,
                latency_ms = 3.694_522_f64,
                cached = true,
                "credential issued {}",
                text
            );
            tracing::warn!(message = text, code = text);
            tracing::error!(error = &error as &dyn std::error::Error, "failed");
            tracing::error!(error = &Inner as &dyn std::error::Error);
            tracing::debug!(text);
        }
        tracing::info!(
            message = 7_u64,
            big = u64::MAX,
            small = i64::MIN,
            zero = 0_i64,
            r#loop = 5_u64
        );
        tracing::info!(count = 12_u64, "{}", 3_i64);
    }

    fn output<N>(fields: N, ansi: bool) -> String
    where
        N: for<'w> FormatFields<'w> + Send + Sync + 'static,
    {
        capture::text_log(fields, ansi, emit)
    }

    #[test]
    fn lines_are_the_default_formatters_byte_for_byte() {
        for ansi in [false, true] {
            let ours = output(TextFields, ansi);
            let default = output(DefaultFields::new(), ansi);
            // Every event written (texts with a newline span two lines).
            assert_eq!(ours.matches("credential issued").count(), 11, "{ours}");
            assert_eq!(ours.matches("inner").count(), 22, "{ours}");
            for (a, b) in ours.lines().zip(default.lines()) {
                assert_eq!(a, b, "ansi {ansi}");
            }
            assert_eq!(ours, default, "ansi {ansi}");
        }
    }

    #[test]
    fn the_block_check_agrees_with_the_byte_check_everywhere() {
        // Every ASCII byte and a multi-byte character at every position of
        // strings around the word size.
        let lens = [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 40];
        for text in texts_with_each_odd_char(&lens, "\u{a2}") {
            let bytewise = text
                .bytes()
                .all(|b| (0x20..0x7f).contains(&b) && !matches!(b, b'"' | b'\\' | b'\''));
            assert_eq!(needs_no_escape(&text), bytewise, "{text:?}");
            let controls = text
                .bytes()
                .any(|b| matches!(b, 0x1b | 0x07 | 0x08 | 0x0c | 0x7f | 0xc2));
            assert_eq!(has_terminal_controls(&text), controls, "{text:?}");
            if needs_no_escape(&text) {
                assert_eq!(text.escape_debug().to_string(), text);
                assert_eq!(format!("{text:?}"), format!("\"{text}\""));
            }
        }
    }

    #[test]
    fn plain_strings_are_copied_and_others_escaped() {
        let mut s = String::new();
        write_debug_str(&mut s, "default").unwrap();
        write_debug_str(&mut s, " a\"b").unwrap();
        write_debug_str(&mut s, "é\n").unwrap();
        assert_eq!(s, r#""default"" a\"b""é\n""#);
    }
}
