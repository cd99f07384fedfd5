//! Word-at-a-time tests over ASCII text: eight bytes checked as one
//! `u64`. The audit line and record check a dozen short fields per
//! request for bytes that need escaping, where a byte loop cost about five
//! instructions a byte.
//!
//! Each `*_in` test is the usual bit trick: nonzero exactly when some byte
//! of the word matches (it may flag another byte of the word as well, so
//! it says whether, not which).
//!
//! Measured together with the other formatting modules (`text_fields`,
//! `timestamp`, `direct_line`) against `tracing-subscriber`'s formatter and
//! timer: 1.18 and 1.23 times the cached-hit requests/s, 0.80 and 0.76
//! times the CPU per request (`bench/compare`, A B B A; `telemetry.rs`).

/// Each byte of a word.
const ONES: u64 = 0x0101_0101_0101_0101;
/// Each byte's high bit.
const HIGH: u64 = 0x8080_8080_8080_8080;

/// Whether `test` is nonzero for a word of `text`: eight bytes at a time
/// as one little-endian word, the tail padded with `a` (which no test
/// flags).
pub(crate) fn any_word(text: &str, test: impl Fn(u64) -> u64) -> bool {
    let mut words = text.as_bytes().chunks_exact(8);
    let mut found = 0;
    for word in &mut words {
        let mut bytes = [0; 8];
        bytes.copy_from_slice(word);
        found |= test(u64::from_le_bytes(bytes));
    }
    let tail = words.remainder();
    if !tail.is_empty() {
        let mut bytes = [b'a'; 8];
        bytes[..tail.len()].copy_from_slice(tail);
        found |= test(u64::from_le_bytes(bytes));
    }
    found != 0
}

/// Nonzero when a byte of `word` is `byte`.
pub(crate) fn byte_in(word: u64, byte: u8) -> u64 {
    let zeroed = word ^ (ONES * u64::from(byte));
    zeroed.wrapping_sub(ONES) & !zeroed & HIGH
}

/// Nonzero when a byte of `word` is below `0x20`.
pub(crate) fn control_in(word: u64) -> u64 {
    word.wrapping_sub(ONES * 0x20) & !word & HIGH
}

/// Nonzero when a byte of `word` is above `0x7e`: 0x7f carries into its
/// high bit when 1 is added, and the others have it set already.
pub(crate) fn above_tilde_in(word: u64) -> u64 {
    (word.wrapping_add(ONES) | word) & HIGH
}

/// Texts for the word-at-a-time checks' tests: of each length in `lens`,
/// `a`s with every ASCII byte and a few multi-byte characters (among them
/// `extra`) at every position, so each byte lands in every lane of a word
/// and in the padded tail.
#[cfg(test)]
pub(crate) fn texts_with_each_odd_char(lens: &[usize], extra: &str) -> Vec<String> {
    let odd: Vec<String> = (0u8..0x80)
        .map(|b| char::from(b).to_string())
        .chain(["\u{e9}", "\u{1f512}", "\u{85}", extra].map(String::from))
        .collect();
    let mut texts = Vec::new();
    for &len in lens {
        for at in 0..len.max(1) {
            for c in &odd {
                let mut text = "a".repeat(len);
                if len > 0 {
                    text.replace_range(at..=at, c);
                }
                texts.push(text);
            }
        }
    }
    texts
}
