//! What a failing test prints of each process's log: errors and lifecycle events, colour
//! codes stripped, repeated lines folded.

/// `line` without ANSI escape sequences (`ESC [ ... letter`).
pub(crate) fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Whether a log line is worth showing in a failure dump: an error or panic, or a
/// lifecycle event of a job, rank, worker or leader.
pub(crate) fn is_notable(line: &str) -> bool {
    const WORDS: [&str; 12] = [
        "panicked",
        "ERROR",
        "WARN",
        "exited",
        "restart",
        "lost",
        "expired",
        "failed",
        "acting as leader",
        "starting rank attempt",
        "stopping",
        "job succeeded",
    ];
    line.starts_with("Error") || WORDS.iter().any(|w| line.contains(w))
}

/// `lines` with each run of lines that differ only in their timestamp (the first
/// whitespace-separated word) folded into its first line and a count.
pub(crate) fn fold_repeats(lines: &[String]) -> Vec<String> {
    let body = |l: &str| l.split_once(' ').map_or(l, |(_, rest)| rest).to_string();
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let b = body(&lines[i]);
        let mut j = i + 1;
        while j < lines.len() && body(&lines[j]) == b {
            j += 1;
        }
        out.push(lines[i].clone());
        if j - i > 1 {
            out.push(format!("  (the line above {} times in all)", j - i));
        }
        i = j;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dump_line_loses_its_colour_codes() {
        let line = "\u{1b}[2m2026-11-24T15:16:24Z\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m job succeeded";
        assert_eq!(strip_ansi(line), "2026-11-24T15:16:24Z  INFO job succeeded");
    }

    #[test]
    fn lines_that_differ_only_in_their_timestamp_are_folded() {
        let lines: Vec<String> = [
            "t1 ERROR x",
            "t2 ERROR x",
            "t3 ERROR x",
            "t4 INFO y",
            "t5 ERROR x",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(
            fold_repeats(&lines),
            vec![
                "t1 ERROR x".to_string(),
                "  (the line above 3 times in all)".to_string(),
                "t4 INFO y".to_string(),
                "t5 ERROR x".to_string(),
            ]
        );
    }
}
