//! Logging set-up, the same for every Lanyard binary.
//!
//! Logs go to stderr (stdout is reserved for `lanyard dev`'s exports), as
//! text for people or JSON for collectors.
//!
//! The agent logs a line per request (every cache hit logs its audit
//! line). Lines are written by a thread of their own (`tracing-appender`'s
//! non-blocking writer, lossless: a full queue waits rather than drops),
//! so a request does not wait for `write(2)`; text lines' fields,
//! timestamps and audit lines are put together by [`text_fields`],
//! [`timestamp`] and [`direct_line`], the same bytes as
//! `tracing-subscriber`'s formatter, in less time.
//!
//! Measured (`bench/compare`, cached hits, release, 2 cores, A B B A):
//! these formatting modules against `tracing-subscriber`'s own formatter
//! and timer, both writing through `tracing-appender`: 1.18 and 1.23 times
//! the requests/s at 0.80 and 0.76 times the CPU per request. A batching
//! writer of Lanyard's own (`log_writer`, removed) against
//! `tracing-appender`: 0.92 and 1.01 times the requests/s at 1.03 and 0.95
//! times the CPU, within noise, so the library's writes the lines.

mod ascii_words;
pub mod direct_line;
pub mod text_fields;
pub mod timestamp;

use tracing_subscriber::{fmt, EnvFilter};

/// Log line format.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines (`tracing`'s default format).
    Text,
    /// One JSON object per line, event fields flattened to the top level.
    Json,
}

/// Keeps the log's flusher: dropping it writes every line still in
/// memory. Hold it until the process exits.
#[must_use = "dropping the guard stops the log's flusher; hold it until exit"]
pub struct LogGuard {
    _flusher: Option<tracing_appender::non_blocking::WorkerGuard>,
}

/// How log lines reach stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogWrites {
    /// By a writer thread (`tracing-appender`): for processes that log a
    /// line per request (the agent, `lanyard dev`, the webhook).
    Batched,
    /// Each line as it comes: `lanyard-sidecar`, which logs no line per
    /// forwarded request, and whose resident memory is a target (the
    /// flusher thread costs about 0.3 MiB).
    Direct,
}

/// Installs the global subscriber. `RUST_LOG` overrides `level`.
pub fn init(format: LogFormat, level: &str, writes: LogWrites) -> LogGuard {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    // Colours only for a person at a terminal: log collectors and files
    // get plain text, and no time is spent on escape codes.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let (writer, guard) = match writes {
        LogWrites::Batched => {
            let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
                .lossy(false)
                .thread_name("lanyard-log")
                .finish(std::io::stderr());
            (Some(writer), Some(guard))
        }
        LogWrites::Direct => (None, None),
    };
    let installed = match &writer {
        Some(writer) => install(format, filter, ansi, writer.clone()),
        None => install(format, filter, ansi, std::io::stderr),
    };
    if installed && format == LogFormat::Text && !ansi {
        direct_line::install(match writer {
            Some(writer) => direct_line::Lines::Thread(writer),
            None => direct_line::Lines::Stderr,
        });
    }
    // A subscriber installed already (a second call, in tests) keeps its
    // own writer: this one has nothing to write.
    LogGuard {
        _flusher: guard.filter(|_| installed),
    }
}

/// Installs the global subscriber writing to `writer`; false when one was
/// installed already.
fn install<W>(format: LogFormat, filter: EnvFilter, ansi: bool, writer: W) -> bool
where
    W: for<'w> fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    let builder = fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_timer(timestamp::Timestamp)
        .with_writer(writer);
    match format {
        LogFormat::Text => builder.fmt_fields(text_fields::TextFields).try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    }
    .is_ok()
}

/// Whether the process logs plain text without colours, the text whose
/// lines the audit record may put together itself (`audit::log_line`);
/// false before [`init`] and under another subscriber (tests).
pub fn plain_text_log() -> bool {
    direct_line::installed()
}
