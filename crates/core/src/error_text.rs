//! An error as one line of text with all its causes: the outermost
//! message, then each `source()` in turn, joined by `": "` (how Go's `%v`
//! of a wrapped error reads). hyper's own message names only the kind
//! ("client error (Connect)"); the cause says what happened ("tcp connect
//! error: Connection refused").

/// `e` and its causes, one line.
pub fn with_causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn every_cause_follows_its_error() {
        let inner = std::io::Error::other("inner");
        assert_eq!(with_causes(&Outer(inner)), "outer: inner");
        assert_eq!(with_causes(&std::io::Error::other("alone")), "alone");
    }
}
