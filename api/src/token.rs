//! What a bearer token must look like, for every process that reads one (coordinator,
//! worker agent, cumulusctl): long enough not to be guessed, short enough to bound what a
//! reader holds, and printable so that it fits an HTTP header and a gRPC metadata value.

/// Shortest token accepted, in bytes (128 bits of hex).
pub const MIN_TOKEN_BYTES: usize = 16;
/// Longest token accepted, in bytes.
pub const MAX_TOKEN_BYTES: usize = 4096;

/// Why a token (after trimming surrounding whitespace) is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Shorter than [`MIN_TOKEN_BYTES`] (the length in bytes).
    #[error("the token is {0} bytes; it must be at least {MIN_TOKEN_BYTES}")]
    TooShort(usize),
    /// Longer than [`MAX_TOKEN_BYTES`] (the length in bytes).
    #[error("the token is {0} bytes; it must be at most {MAX_TOKEN_BYTES}")]
    TooLong(usize),
    /// A byte that is not visible ASCII (whitespace, a control character, non-ASCII).
    #[error("the token must be visible ASCII only (no whitespace or control characters)")]
    NotPrintable,
}

/// Checks a token that has already been trimmed.
///
/// # Errors
/// [`TokenError`] saying which rule it breaks.
pub fn check(token: &str) -> Result<(), TokenError> {
    if token.len() < MIN_TOKEN_BYTES {
        return Err(TokenError::TooShort(token.len()));
    }
    if token.len() > MAX_TOKEN_BYTES {
        return Err(TokenError::TooLong(token.len()));
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(TokenError::NotPrintable);
    }
    Ok(())
}

/// The credential of an `Authorization: Bearer <token>` header value. The scheme is
/// matched case-insensitively and spaces around the token are skipped (RFC 7235 §2.1:
/// `auth-scheme 1*SP token68`); `None` for another scheme or an empty credential.
pub fn bearer_token(header: &str) -> Option<&str> {
    let (scheme, rest) = header.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let token = rest.trim_matches(' ');
    (!token.is_empty()).then_some(token)
}

/// Whether an `Authorization` header value presents `token` as its bearer credential
/// ([`bearer_token`]), compared in constant time (the length is not secret).
pub fn bearer_matches(header: Option<&str>, token: &str) -> bool {
    header
        .and_then(bearer_token)
        .is_some_and(|presented| constant_time_eq(presented.as_bytes(), token.as_bytes()))
}

/// Whether a token that the command-line parser produced came from the command line
/// (where `ps` shows it to every local user) rather than from `env_var`: clap takes a
/// flag over the variable, so a value that differs from the variable's (or no variable)
/// was given as a flag.
pub fn given_on_command_line(value: &str, env_var: &str) -> bool {
    std::env::var(env_var).map_or(true, |v| v != value)
}

/// The refusal of a token given on the command line, naming the flag and its safe
/// alternatives.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{flag} on the command line is visible to every local user in `ps`: put the token in a \
     file readable only by you and give {flag}-file FILE, or set {env_var}"
)]
pub struct TokenOnCommandLine {
    /// The flag, e.g. `--token`.
    pub flag: &'static str,
    /// The environment variable that may hold it instead.
    pub env_var: &'static str,
}

/// Refuses `value` of `flag` when it came from the command line
/// ([`given_on_command_line`]).
///
/// # Errors
/// [`TokenOnCommandLine`].
pub fn refuse_command_line(
    value: &str,
    flag: &'static str,
    env_var: &'static str,
) -> Result<(), TokenOnCommandLine> {
    if given_on_command_line(value, env_var) {
        Err(TokenOnCommandLine { flag, env_var })
    } else {
        Ok(())
    }
}

/// Compares two byte strings in time that depends only on their lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_bounded_and_printable() {
        check(&"a".repeat(MIN_TOKEN_BYTES)).expect("shortest");
        check(&"Z".repeat(MAX_TOKEN_BYTES)).expect("longest");
        assert_eq!(check("short"), Err(TokenError::TooShort(5)));
        assert_eq!(
            check(&"a".repeat(MAX_TOKEN_BYTES + 1)),
            Err(TokenError::TooLong(MAX_TOKEN_BYTES + 1))
        );
        assert_eq!(check("0123456789abcdef\n"), Err(TokenError::NotPrintable));
        assert_eq!(check("0123456789 abcdef"), Err(TokenError::NotPrintable));
        assert_eq!(check("0123456789abcdé"), Err(TokenError::NotPrintable));
    }

    #[test]
    fn bearer_scheme_is_case_insensitive_and_the_token_exact() {
        let t = "0123456789abcdef";
        assert!(bearer_matches(Some("Bearer 0123456789abcdef"), t));
        assert!(bearer_matches(Some("bearer 0123456789abcdef"), t));
        assert!(bearer_matches(Some("BEARER 0123456789abcdef"), t));
        assert!(!bearer_matches(Some("Basic 0123456789abcdef"), t));
        assert!(!bearer_matches(Some("Bearer 0123456789abcdeF"), t));
        assert!(bearer_matches(Some("Bearer  0123456789abcdef "), t));
        assert!(!bearer_matches(Some("Bearer "), t));
        assert!(!bearer_matches(Some("Bearer"), t));
        assert!(!bearer_matches(Some("0123456789abcdef"), t));
        assert!(!bearer_matches(None, t));
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
