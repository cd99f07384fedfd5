//! Caller-supplied text, bounded where it is kept or echoed (audit
//! records, logs, answers): a caller cannot make a record large, and two
//! long texts that differ after the cut still differ by their hash.

use std::borrow::Cow;

/// Longest caller-supplied text kept in a record; longer text keeps its
/// head, its length and a hash of the whole.
pub const MAX_FIELD_CHARS: usize = 256;

/// Caller-supplied text as it may appear in a record: at most
/// [`MAX_FIELD_CHARS`] characters, then its length and a hash of the rest.
pub fn bounded(text: &str) -> Cow<'_, str> {
    match text.char_indices().nth(MAX_FIELD_CHARS) {
        None => Cow::Borrowed(text),
        Some((cut, _)) => Cow::Owned(format!(
            "{}…[{} bytes, {}]",
            &text[..cut],
            text.len(),
            crate::secret::fingerprint(text)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_caller_text_is_bounded_with_length_and_hash() {
        let long = "r".repeat(60_000);
        let b = bounded(&long);
        assert!(b.chars().count() < MAX_FIELD_CHARS + 64, "{}", b.len());
        assert!(b.contains("60000 bytes"));
        assert!(b.contains("sha256:"));
        assert_eq!(
            bounded("https://storage.azure.com/"),
            "https://storage.azure.com/"
        );
        // Multibyte text is cut on a character boundary.
        let wide = "é".repeat(1000);
        assert!(bounded(&wide).starts_with(&"é".repeat(MAX_FIELD_CHARS)));
    }
}
