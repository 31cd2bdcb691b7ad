//! User-supplied text that reaches a terminal: job names, commands, paths, failure
//! messages. A job name is checked at submit ([`is_printable`]); everything else a user
//! or a rank wrote is escaped where it is printed ([`escape_control`]), so that no string
//! can move the cursor, rewrite a line (`\r`, `\b`), add a fake table row (`\n`), set a
//! window title or reorder text (ESC sequences, bidirectional overrides).

use std::borrow::Cow;
use std::fmt::Write as _;

/// Characters that are not control characters but still rearrange what a terminal
/// shows: the bidirectional embeddings, overrides and isolates (Unicode's "Trojan
/// Source" set, CVE-2021-42574), and the zero-width marks that hide text.
const INVISIBLE_OR_REORDERING: &[char] = &[
    '\u{200B}', '\u{200C}', '\u{200D}', '\u{200E}', '\u{200F}', '\u{202A}', '\u{202B}', '\u{202C}',
    '\u{202D}', '\u{202E}', '\u{2060}', '\u{2066}', '\u{2067}', '\u{2068}', '\u{2069}', '\u{FEFF}',
];

fn needs_escape(c: char) -> bool {
    c.is_control() || INVISIBLE_OR_REORDERING.contains(&c)
}

/// True when `s` holds no control character (C0, DEL, C1: `\n`, `\r`, `\t`, ESC, …)
/// and no bidirectional or zero-width mark.
pub fn is_printable(s: &str) -> bool {
    !s.chars().any(needs_escape)
}

/// `s` with every control character and bidirectional or zero-width mark replaced by a
/// visible escape (`\n`, `\r`, `\t`, else `\u{1b}`); `s` itself when there is none.
pub fn escape_control(s: &str) -> Cow<'_, str> {
    if is_printable(s) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if needs_escape(c) => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// `s` as one printable line of at most `max_bytes` bytes: control characters and
/// reordering marks escaped ([`escape_control`], so a newline becomes `\n`), surrounding
/// whitespace trimmed, and anything past the bound cut at a character boundary and
/// marked with `…` (which counts against the bound).
pub fn bounded_line(s: &str, max_bytes: usize) -> String {
    let escaped = escape_control(s.trim());
    if escaped.len() <= max_bytes {
        return escaped.into_owned();
    }
    let ellipsis = '…';
    let mut cut = max_bytes.saturating_sub(ellipsis.len_utf8());
    while !escaped.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut out = escaped[..cut].to_string();
    if max_bytes >= ellipsis.len_utf8() {
        out.push(ellipsis);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_and_reordering_characters_are_escaped() {
        assert!(is_printable("résumé 東京 job-1 (a/b)"));
        assert!(matches!(escape_control("plain"), Cow::Borrowed("plain")));
        for bad in [
            "a\nb",
            "a\rb",
            "a\u{8}b",
            "a\u{1b}[2Jb",
            "a\u{7f}b",
            "a\u{9b}b",
            "a\u{202e}b",
        ] {
            assert!(!is_printable(bad), "{bad:?}");
            let shown = escape_control(bad);
            assert!(is_printable(&shown), "{shown:?}");
            assert!(shown.starts_with('a') && shown.ends_with('b'), "{shown:?}");
        }
        assert_eq!(
            escape_control("x\u{1b}]0;pwned\u{7}"),
            "x\\u{1b}]0;pwned\\u{7}"
        );
        assert_eq!(escape_control("row\nfake"), "row\\nfake");
    }

    #[test]
    fn bounded_lines_are_printable_and_within_their_bound() {
        assert_eq!(bounded_line("  ValueError: x\n", 64), "ValueError: x");
        assert_eq!(bounded_line("a\nb", 64), "a\\nb");
        for max in [0, 1, 3, 4, 5, 10] {
            let line = bounded_line("ééééééééé\u{1b}[2J", max);
            assert!(line.len() <= max, "{max}: {line:?}");
            assert!(is_printable(&line), "{line:?}");
        }
        assert_eq!(bounded_line("abcdefgh", 7), "abcd…");
    }
}
