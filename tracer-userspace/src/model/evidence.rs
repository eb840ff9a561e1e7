//! Values that tie a call to the request that made it, compared in memory only: a session
//! cookie's payload, a session token header, a response id the callee echoes. They are credentials or content, so
//! only a keyed hash of them is kept (the key random per agent run), never the value: nothing
//! here can be exported, logged or reversed, and nothing outlives the requests that carry it.

use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;

/// A keyed hash of one value of one kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Token(u64);

/// Most tokens one request head yields (its session cookies and headers); the rest are
/// ignored.
pub const MAX_TOKENS_PER_REQUEST: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenKind {
    /// `name=payload` of a cookie: Starlette's session cookie is `payload.timestamp.signature`
    /// and its signature changes with every response, so only the part before the first `.`
    /// names the session.
    Cookie,
    /// The value of a header that names a session ([`SESSION_TOKEN_HEADER`]).
    SessionHeader,
    /// The `"id"` a JSON response body starts with (an OpenAI-style response id).
    ResponseId,
}

impl Token {
    pub fn of(kind: TokenKind, value: &[u8]) -> Token {
        Token::of_parts(kind, value, &[])
    }

    /// The token of `first` followed by `second`: the same as of the two joined, without
    /// joining them (SipHash reads its input as one stream).
    fn of_parts(kind: TokenKind, first: &[u8], second: &[u8]) -> Token {
        static KEY: OnceLock<std::collections::hash_map::RandomState> = OnceLock::new();
        let mut hasher = KEY.get_or_init(Default::default).build_hasher();
        hasher.write_u8(kind as u8);
        hasher.write(first);
        hasher.write(second);
        Token(hasher.finish())
    }
}

/// The session tokens of a `Cookie` header, collected (what tests compare).
#[cfg(test)]
pub fn cookie_tokens(header: &[u8]) -> Vec<Token> {
    session_cookies(header).collect()
}

/// The session tokens of a `Cookie` header: one per cookie, `name=` plus the value up to its
/// first `.`, at most [`MAX_TOKENS_PER_REQUEST`]; read in place, as Gym sends a session
/// cookie on every request and sets one on every response.
pub fn session_cookies(header: &[u8]) -> impl Iterator<Item = Token> + '_ {
    let mut rest = Some(header);
    std::iter::from_fn(move || {
        let remaining = rest?;
        let end = memchr::memchr(b';', remaining);
        rest = end.map(|at| &remaining[at + 1..]);
        Some(&remaining[..end.unwrap_or(remaining.len())])
    })
    .filter_map(|pair| {
        let pair = pair.trim_ascii();
        let eq = memchr::memchr(b'=', pair)?;
        let value = &pair[eq + 1..];
        let payload = &value[..memchr::memchr(b'.', value).unwrap_or(value.len())];
        // A short value names no session (flags, empty cookies).
        (payload.len() >= 8).then(|| Token::of_parts(TokenKind::Cookie, &pair[..=eq], payload))
    })
    .take(MAX_TOKENS_PER_REQUEST)
}

/// Gym's MCP session token (`nemo_gym/base_resources_server.py`): a signed, rollout-scoped
/// token that a resources server with `expose_tools_over_mcp` hands out in `/seed_session`'s
/// answer. The agent's `/run` sends it on its self-call, and the handler of that call sends it
/// on every MCP request it makes — from whatever thread or event loop its MCP client runs
/// in — so it ties those calls to the request being served, as a session cookie does.
pub const SESSION_TOKEN_HEADER: &str = "x-nemo-gym-session-token";

/// The token of a [`SESSION_TOKEN_HEADER`] value; a value too short to name a session names
/// none.
pub fn session_header_token(value: &[u8]) -> Option<Token> {
    let value = value.trim_ascii();
    (value.len() >= 8).then(|| Token::of(TokenKind::SessionHeader, value))
}

/// The token of the response id a JSON body starts with (`{"id": "resp_…"`), from the first
/// bytes of the body. Only a first member named `id` with a string value of 8 to 256 bytes
/// counts: an id a server echoes, not a number or a flag.
pub fn response_id_token(body_prefix: &[u8]) -> Option<Token> {
    let rest = body_prefix.trim_ascii_start().strip_prefix(b"{")?;
    let rest = rest.trim_ascii_start().strip_prefix(b"\"id\"")?;
    let rest = rest.trim_ascii_start().strip_prefix(b":")?;
    let rest = rest.trim_ascii_start().strip_prefix(b"\"")?;
    let end = rest.iter().position(|&b| b == b'"' || b == b'\\')?;
    let id = &rest[..end];
    (rest[end] == b'"' && (8..=256).contains(&id.len()))
        .then(|| Token::of(TokenKind::ResponseId, id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_cookie_is_named_by_its_payload_not_its_signature() {
        let first = cookie_tokens(b"session=eyJzZXNzaW9u.Z1x2.sigA");
        let again = cookie_tokens(b"other=1; session=eyJzZXNzaW9u.Z1x3.sigB");
        assert_eq!(first.len(), 1);
        assert_eq!(again, first, "short cookies ignored, signature ignored");
        assert_ne!(cookie_tokens(b"session=eyJzZXNzaW9v.Z1x2.sigA"), first);
        assert_ne!(cookie_tokens(b"sessionx=eyJzZXNzaW9u.Z1x2.sigA"), first);
        assert!(cookie_tokens(b"a=1; b=; =x").is_empty());
        let many = vec![b"k=0123456789".as_slice(); 20].join(&b';');
        assert_eq!(cookie_tokens(&many).len(), MAX_TOKENS_PER_REQUEST);
    }

    #[test]
    fn a_response_id_is_the_first_member_of_a_json_body() {
        let token = response_id_token(br#"{"id":"resp_0123456789","object":"response""#);
        assert!(token.is_some());
        assert_eq!(
            response_id_token(br#" { "id" : "resp_0123456789" }"#),
            token
        );
        assert_eq!(
            response_id_token(br#"{"object":"x","id":"resp_0123456789"}"#),
            None
        );
        assert_eq!(response_id_token(br#"{"id":"short"}"#), None);
        assert_eq!(response_id_token(br#"{"id":12345678901}"#), None);
        assert_eq!(
            response_id_token(br#"{"id":"resp_0123456789"#),
            None,
            "cut off"
        );
        assert_ne!(response_id_token(br#"{"id":"resp_0123456780"}"#), token);
        // A cookie, a session header and a response id with the same bytes are different
        // tokens.
        assert_ne!(
            Token::of(TokenKind::Cookie, b"resp_0123456789"),
            Token::of(TokenKind::ResponseId, b"resp_0123456789")
        );
        assert_ne!(
            session_header_token(b"resp_0123456789"),
            Some(Token::of(TokenKind::ResponseId, b"resp_0123456789"))
        );
    }

    #[test]
    fn a_session_header_is_named_by_its_whole_value() {
        let token = session_header_token(b"eyJyb2xsb3V0IjoiMy0xIn0.c2lnbmF0dXJl");
        assert!(token.is_some());
        assert_eq!(
            session_header_token(b" eyJyb2xsb3V0IjoiMy0xIn0.c2lnbmF0dXJl "),
            token
        );
        assert_ne!(
            session_header_token(b"eyJyb2xsb3V0IjoiMy0yIn0.c2lnbmF0dXJl"),
            token
        );
        assert_eq!(session_header_token(b"short"), None);
    }
}
