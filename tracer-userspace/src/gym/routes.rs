//! Naming an inbound request by its route: strip Gym's `/ng-rollout/<id>` prefix, match
//! the rest against route templates (user, harvested from `/openapi.json`, Gym's own), and
//! otherwise name it by a bounded heuristic that keeps ids out of span names.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::Deserialize;
use serde::de::{IgnoredAny, MapAccess, Visitor};

use super::ServerType;
use super::rollout_id::RolloutId;

/// `ROLLOUT_PATH_PREFIX` (`nemo_gym/config_types.py:971`) as a path start.
const ROLLOUT_PREFIX: &str = "/ng-rollout/";
/// `TOKEN_CAPTURE_PATH_SEGMENT` (`nemo_gym/config_types.py:972`) as a path start.
const TOKEN_CAPTURE_SEGMENT: &str = "/training-token-capture";

/// A request path with Gym's rollout prefix taken off.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StrippedPath<'a> {
    /// What Gym's router matches: the path after the prefix, or all of it.
    pub route_path: &'a str,
    /// The prefix's segment, when it is a valid rollout id.
    pub rollout_id: Option<RolloutId>,
    pub prefixed: bool,
}

/// Strips `/ng-rollout/<segment>` when a `/...` rest follows, then `/training-token-capture`
/// when a `/...` rest follows it too.
///
/// Gym strips in two places with two rules: the resources servers' middleware only for a
/// valid id and never the capture segment (`nemo_gym/rollout_correlation.py:102-104`), the
/// model servers' for any non-empty segment and the capture segment
/// (`nemo_gym/base_responses_api_model.py:1059-1063`), and the agent registers both
/// prefixed forms of `/v1/responses` as routes (`nemo_gym/base_responses_api_agent.py:242`).
/// Here the prefix goes whenever the segment is non-empty, so the route is named the same
/// on every server, and an id is kept only when the segment is a valid [`RolloutId`].
///
/// `path` is the raw request-target path without its query; Gym matches the
/// percent-decoded path, and an encoded segment (`%2F`) is no valid id here.
pub fn strip_rollout_prefix(path: &str) -> StrippedPath<'_> {
    let unprefixed = StrippedPath {
        route_path: path,
        rollout_id: None,
        prefixed: false,
    };
    let Some(after) = path.strip_prefix(ROLLOUT_PREFIX) else {
        return unprefixed;
    };
    let Some(slash) = after.find('/') else {
        return unprefixed;
    };
    let (segment, mut rest) = after.split_at(slash);
    if segment.is_empty() {
        return unprefixed;
    }
    if let Some(after_capture) = rest.strip_prefix(TOKEN_CAPTURE_SEGMENT)
        && after_capture.starts_with('/')
    {
        rest = after_capture;
    }
    StrippedPath {
        route_path: rest,
        rollout_id: RolloutId::parse(segment),
        prefixed: true,
    }
}

// ---------------------------------------------------------------------------------------
// Route templates, in Starlette's path syntax.

/// A Starlette path converter (`starlette/convertors.py`, Starlette 1.10); the regex each
/// one compiles to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Converter {
    /// `[^/]+`, the default.
    Str,
    /// `.*`: the rest of the path, slashes included.
    Path,
    /// `[0-9]+`
    Int,
    /// `[0-9]+(\.[0-9]+)?`
    Float,
    /// `8-4-4-4-12` hex digits, either case, each dash optional.
    Uuid,
}

impl Converter {
    fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "str" => Converter::Str,
            "path" => Converter::Path,
            "int" => Converter::Int,
            "float" => Converter::Float,
            "uuid" => Converter::Uuid,
            _ => return None,
        })
    }

    fn accepts(self, text: &str) -> bool {
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        match self {
            Converter::Str => !text.is_empty() && !text.contains('/'),
            Converter::Path => true,
            Converter::Int => digits(text),
            Converter::Float => match text.split_once('.') {
                Some((int, frac)) => digits(int) && digits(frac),
                None => digits(text),
            },
            Converter::Uuid => {
                let mut rest = text.as_bytes();
                [8, 4, 4, 4, 12].into_iter().enumerate().all(|(i, n)| {
                    let group_ok = rest.len() >= n && rest[..n].iter().all(u8::is_ascii_hexdigit);
                    if group_ok {
                        rest = &rest[n..];
                        if i < 4 && rest.first() == Some(&b'-') {
                            rest = &rest[1..];
                        }
                    }
                    group_ok
                }) && rest.is_empty()
            }
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Part {
    Literal(Box<str>),
    Param(Converter),
}

/// A route template as FastAPI/Starlette write it: `/items/{item_id}`, `/files/{p:path}`,
/// `/n/{x:int}`. Matching follows Starlette's compiled regex, backtracking included.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteTemplate {
    /// As written: this is `http.route`, which OTel's FastAPI instrumentation also takes
    /// verbatim from the route.
    text: Arc<str>,
    parts: Vec<Part>,
    literal_segments: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteTemplateError {
    #[error(
        "route template `{0}` must start with `/`, as FastAPI paths do (e.g. /items/{{item_id}})"
    )]
    NoLeadingSlash(String),
    #[error(
        "route template `{template}` uses unknown converter `{converter}`: FastAPI knows \
         str, path, int, float and uuid (e.g. /files/{{name:path}})"
    )]
    UnknownConverter { template: String, converter: String },
    #[error("route template `{template}` names parameter `{name}` twice; give each a new name")]
    DuplicateParam { template: String, name: String },
    #[error(
        "route template `{0}` holds a query, fragment, whitespace or control character; \
         give the path only"
    )]
    BadCharacter(String),
}

impl RouteTemplate {
    pub fn parse(text: &str) -> Result<Self, RouteTemplateError> {
        if !text.starts_with('/') {
            return Err(RouteTemplateError::NoLeadingSlash(text.to_owned()));
        }
        if text
            .chars()
            .any(|c| c == '?' || c == '#' || c.is_whitespace() || c.is_control())
        {
            return Err(RouteTemplateError::BadCharacter(text.to_owned()));
        }
        let mut parts = Vec::new();
        let mut names = HashSet::new();
        let mut literal = String::new();
        // Segments with a parameter, marked by NUL (refused above as a control character).
        let mut shape = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(open) = rest.find('{') {
            literal.push_str(&rest[..open]);
            shape.push_str(&rest[..open]);
            rest = &rest[open..];
            // Starlette's PARAM_REGEX: `{name}` or `{name:converter}`, both identifiers.
            // Any other brace is literal text.
            let param = rest.find('}').map(|close| &rest[1..close]).filter(|inner| {
                let (name, converter) = inner.split_once(':').unwrap_or((inner, "str"));
                is_identifier(name) && is_identifier(converter)
            });
            let Some(inner) = param else {
                literal.push('{');
                shape.push('{');
                rest = &rest[1..];
                continue;
            };
            let (name, converter) = inner.split_once(':').unwrap_or((inner, "str"));
            let converter = Converter::from_name(converter).ok_or_else(|| {
                RouteTemplateError::UnknownConverter {
                    template: text.to_owned(),
                    converter: converter.to_owned(),
                }
            })?;
            if !names.insert(name) {
                return Err(RouteTemplateError::DuplicateParam {
                    template: text.to_owned(),
                    name: name.to_owned(),
                });
            }
            if !literal.is_empty() {
                parts.push(Part::Literal(std::mem::take(&mut literal).into()));
            }
            parts.push(Part::Param(converter));
            shape.push('\0');
            rest = &rest[inner.len() + 2..];
        }
        literal.push_str(rest);
        shape.push_str(rest);
        if !literal.is_empty() {
            parts.push(Part::Literal(literal.into()));
        }
        let literal_segments = shape
            .split('/')
            .skip(1)
            .filter(|s| !s.contains('\0'))
            .count();
        Ok(RouteTemplate {
            text: text.into(),
            parts,
            literal_segments,
        })
    }

    /// A template with no parameters; for Gym's fixed routes, which need no parsing.
    fn literal(path: &str) -> Self {
        RouteTemplate {
            text: path.into(),
            parts: vec![Part::Literal(path.into())],
            literal_segments: path.split('/').skip(1).count(),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    pub fn is_literal(&self) -> bool {
        !self.parts.iter().any(|p| matches!(p, Part::Param(_)))
    }

    /// Whether `path` (prefix stripped, no query) is one this route serves.
    pub fn matches(&self, path: &str) -> bool {
        match_parts(&self.parts, path)
    }

    /// Higher is more specific: a literal route, then more literal segments, then no
    /// `path` converter (which would swallow what a sibling route names).
    fn specificity(&self) -> (bool, usize, bool) {
        let swallows = self.parts.contains(&Part::Param(Converter::Path));
        (self.is_literal(), self.literal_segments, !swallows)
    }
}

impl FromStr for RouteTemplate {
    type Err = RouteTemplateError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        RouteTemplate::parse(text)
    }
}

impl fmt::Display for RouteTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

fn is_identifier(text: &str) -> bool {
    let mut bytes = text.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// Backtracking like Starlette's regex: each parameter tries its longest match first.
/// Only `path` crosses a `/`, so the work per parameter is bounded by one segment.
fn match_parts(parts: &[Part], text: &str) -> bool {
    match parts.split_first() {
        None => text.is_empty(),
        Some((Part::Literal(literal), rest)) => text
            .strip_prefix(literal.as_ref())
            .is_some_and(|after| match_parts(rest, after)),
        Some((Part::Param(converter), [])) => converter.accepts(text),
        Some((Part::Param(converter), rest)) => {
            let reach = match converter {
                Converter::Path => text.len(),
                _ => text.find('/').unwrap_or(text.len()),
            };
            (0..=reach).rev().any(|end| {
                text.is_char_boundary(end)
                    && converter.accepts(&text[..end])
                    && match_parts(rest, &text[end..])
            })
        }
    }
}

// ---------------------------------------------------------------------------------------
// Where templates come from.

/// On every Gym server: the liveness routes (`nemo_gym/server_utils.py:886-893`, hidden
/// from the OpenAPI schema, so no harvest finds them), `/stats` when profiling is on
/// (`server_utils.py:1270`), and FastAPI's own documentation routes.
const COMMON_ROUTES: &[&str] = &[
    "/",
    "/health",
    "/healthz",
    "/livez",
    "/readyz",
    "/stats",
    "/openapi.json",
    "/docs",
    "/docs/oauth2-redirect",
    "/redoc",
];
/// `nemo_gym/base_responses_api_agent.py:238-263`, prefixed forms stripped.
const AGENT_ROUTES: &[&str] = &[
    "/run",
    "/v1/responses",
    "/aggregate_metrics",
    "/v1/agent_sessions",
    "/v1/agent_sessions/close",
];
/// `nemo_gym/base_responses_api_model.py:251-268`.
const MODEL_ROUTES: &[&str] = &["/v1/chat/completions", "/v1/responses", "/v1/messages"];
/// `nemo_gym/base_resources_server.py:250-260`.
const RESOURCES_ROUTES: &[&str] = &[
    "/seed_session",
    "/close_session",
    "/verify",
    "/aggregate_metrics",
    "/reverify_mode",
];

/// The routes Gym itself registers on a server of this type. With no type, only those
/// every server has: a route of another type would be a false `http.route`.
pub fn known_routes(server_type: Option<ServerType>) -> Vec<RouteTemplate> {
    let own: &[&str] = match server_type {
        Some(ServerType::Agent) => AGENT_ROUTES,
        Some(ServerType::Model) => MODEL_ROUTES,
        Some(ServerType::Resources) => RESOURCES_ROUTES,
        None => &[],
    };
    own.iter()
        .chain(COMMON_ROUTES)
        .map(|path| RouteTemplate::literal(path))
        .collect()
}

/// Route templates by source, in priority order: the user's, the server's (harvested),
/// Gym's known ones. A path is named by the first source with a match.
#[derive(Clone, Debug)]
pub struct RouteTable {
    user: Vec<RouteTemplate>,
    harvested: Vec<RouteTemplate>,
    known: Vec<RouteTemplate>,
    server_type: Option<ServerType>,
}

impl RouteTable {
    pub fn new(user: Vec<RouteTemplate>) -> Self {
        RouteTable {
            user,
            harvested: Vec::new(),
            known: known_routes(None),
            server_type: None,
        }
    }

    pub fn set_harvested(&mut self, templates: Vec<RouteTemplate>) {
        self.harvested = templates;
    }

    pub fn set_server_type(&mut self, server_type: Option<ServerType>) {
        if self.server_type != server_type {
            self.server_type = server_type;
            self.known = known_routes(server_type);
        }
    }

    /// The template string naming `route_path` (prefix already stripped).
    #[cfg(test)]
    pub fn resolve(&self, route_path: &str) -> Option<&str> {
        self.resolve_template(route_path).map(RouteTemplate::as_str)
    }

    pub fn resolve_template(&self, route_path: &str) -> Option<&RouteTemplate> {
        [&self.user, &self.harvested, &self.known]
            .into_iter()
            .find_map(|source| best_match(source, route_path))
    }
}

/// The most specific match; the first listed among equals, as Starlette picks the first
/// registered.
fn best_match<'t>(templates: &'t [RouteTemplate], path: &str) -> Option<&'t RouteTemplate> {
    let mut best: Option<&RouteTemplate> = None;
    for template in templates.iter().filter(|t| t.matches(path)) {
        if best.is_none_or(|b| template.specificity() > b.specificity()) {
            best = Some(template);
        }
    }
    best
}

// ---------------------------------------------------------------------------------------
// OpenAPI harvest.

/// Larger documents are refused: FastAPI's for a Gym server is tens of KiB.
pub const MAX_OPENAPI_BYTES: usize = 8 << 20;

#[derive(Debug, thiserror::Error)]
pub enum OpenApiError {
    #[error(
        "the OpenAPI document is {bytes} bytes, over the {limit}-byte limit; name routes \
         with --route, or skip the harvest with --no-route-harvest"
    )]
    TooLarge { bytes: usize, limit: usize },
    #[error(
        "the OpenAPI document could not be read ({0}); name routes with --route, or skip \
         the harvest with --no-route-harvest"
    )]
    Json(#[from] serde_json::Error),
    #[error(
        "the document has no `paths` object, so it is no OpenAPI document; name routes \
         with --route, or skip the harvest with --no-route-harvest"
    )]
    NoPaths,
}

/// The route templates an OpenAPI document lists (the keys of `paths`), with Gym's rollout
/// prefix stripped as requests are, in document order, deduplicated. A key that is no
/// valid template is skipped. FastAPI writes `{name}` for every converter, so a `path`
/// parameter harvested this way matches one segment only.
pub fn templates_from_openapi(json: &[u8]) -> Result<Vec<RouteTemplate>, OpenApiError> {
    if json.len() > MAX_OPENAPI_BYTES {
        return Err(OpenApiError::TooLarge {
            bytes: json.len(),
            limit: MAX_OPENAPI_BYTES,
        });
    }
    let document: OpenApiDocument = serde_json::from_slice(json)?;
    let PathKeys(keys) = document.paths.ok_or(OpenApiError::NoPaths)?;
    let mut seen = HashSet::new();
    Ok(keys
        .iter()
        .map(|key| strip_rollout_prefix(key).route_path)
        .filter(|path| seen.insert(*path))
        .filter_map(|path| RouteTemplate::parse(path).ok())
        .collect())
}

#[derive(Deserialize)]
struct OpenApiDocument {
    paths: Option<PathKeys>,
}

/// The keys of the `paths` object in document order; the operations are skipped unread.
struct PathKeys(Vec<String>);

impl<'de> Deserialize<'de> for PathKeys {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeysVisitor;
        impl<'de> Visitor<'de> for KeysVisitor {
            type Value = PathKeys;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object of paths")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<PathKeys, A::Error> {
                let mut keys = Vec::new();
                while let Some((key, IgnoredAny)) = map.next_entry::<String, IgnoredAny>()? {
                    keys.push(key);
                }
                Ok(PathKeys(keys))
            }
        }
        deserializer.deserialize_map(KeysVisitor)
    }
}

// ---------------------------------------------------------------------------------------
// Naming.

/// How a request's route is named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouteName {
    /// A real route template: goes into `http.route` and the span name.
    Template(Arc<str>),
    /// The path with ids replaced by `{id}`: the span name only, never `http.route`.
    Heuristic(Arc<str>),
    /// Nothing safe to show: the span is named by its method alone.
    Unnamed,
}

impl RouteName {
    /// The `http.route` attribute, only ever a real template (shared: each span holds it).
    pub fn http_route(&self) -> Option<&Arc<str>> {
        match self {
            RouteName::Template(route) => Some(route),
            _ => None,
        }
    }

    /// `{METHOD} {route}`, or the method alone.
    pub fn span_name(&self, method: &str) -> String {
        match self {
            // Not `format!`: its machinery cost several times the copy, once per request.
            RouteName::Template(route) | RouteName::Heuristic(route) => {
                let mut name = String::with_capacity(method.len() + 1 + route.len());
                name.push_str(method);
                name.push(' ');
                name.push_str(route);
                name
            }
            RouteName::Unnamed => method.to_owned(),
        }
    }
}

/// Distinct heuristic routes one namer keeps. Past it, unmatched paths are unnamed: an
/// id the heuristic misses must not grow the span-name space without bound.
pub const HEURISTIC_ROUTE_CAP: usize = 256;
/// A longer heuristic route is unnamed: it is no name a person reads.
pub const MAX_HEURISTIC_ROUTE_BYTES: usize = 512;

/// Names the requests of one server: its [`RouteTable`], then the bounded heuristic.
#[derive(Clone, Debug)]
pub struct RouteNamer {
    table: RouteTable,
    heuristic: HashSet<Arc<str>>,
    cap: usize,
    over_cap: u64,
}

impl RouteNamer {
    pub fn new(table: RouteTable) -> Self {
        Self::with_cap(table, HEURISTIC_ROUTE_CAP)
    }

    pub fn with_cap(table: RouteTable, cap: usize) -> Self {
        RouteNamer {
            table,
            heuristic: HashSet::new(),
            cap,
            over_cap: 0,
        }
    }

    pub fn table_mut(&mut self) -> &mut RouteTable {
        &mut self.table
    }

    /// `route_path` is the path with the rollout prefix stripped. A path that is not
    /// origin-form (`*`, an absolute URL) is unnamed and not counted.
    pub fn name(&mut self, route_path: &str) -> RouteName {
        if let Some(template) = self.table.resolve_template(route_path) {
            return RouteName::Template(template.text.clone());
        }
        if !route_path.starts_with('/') {
            return RouteName::Unnamed;
        }
        let route = heuristic_route(route_path);
        if let Some(known) = self.heuristic.get(route.as_ref()) {
            return RouteName::Heuristic(known.clone());
        }
        if self.heuristic.len() >= self.cap || route.len() > MAX_HEURISTIC_ROUTE_BYTES {
            self.over_cap += 1;
            return RouteName::Unnamed;
        }
        let route: Arc<str> = route.as_ref().into();
        self.heuristic.insert(route.clone());
        RouteName::Heuristic(route)
    }

    /// Requests left unnamed because the heuristic routes were at the cap (or too long).
    #[cfg(test)]
    pub fn routes_over_cap(&self) -> u64 {
        self.over_cap
    }
}

/// `route_path` with each id-like segment replaced by `{id}`.
fn heuristic_route(route_path: &str) -> Cow<'_, str> {
    if !route_path.split('/').any(is_id_segment) {
        return Cow::Borrowed(route_path);
    }
    let segments: Vec<&str> = route_path
        .split('/')
        .map(|s| if is_id_segment(s) { "{id}" } else { s })
        .collect();
    Cow::Owned(segments.join("/"))
}

/// Numbers, UUIDs, hashes, tokens and Gym's index-derived rollout ids (`12-3`, `12-3-a1`):
/// segments whose values are many. Words and versions (`v1`, `chat`) stay.
fn is_id_segment(segment: &str) -> bool {
    let bytes = segment.as_bytes();
    if is_uuid(segment) {
        return true;
    }
    if !bytes.iter().any(u8::is_ascii_digit) {
        return false;
    }
    let all = |f: fn(&u8) -> bool| bytes.iter().all(f);
    let token_byte = |b: &u8| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.');
    // Digits joined by separators: dates, `{task}-{rollout}`, and that with `-a{attempt}`.
    let numeric = |s: &[u8]| {
        s.first().is_some_and(u8::is_ascii_digit)
            && s.iter()
                .all(|b| b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.'))
    };
    let without_attempt = segment
        .rsplit_once("-a")
        .filter(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        .map_or(segment, |(head, _)| head);
    numeric(bytes)
        || numeric(without_attempt.as_bytes())
        || (bytes.len() >= 8 && all(u8::is_ascii_hexdigit))
        || (bytes.len() >= 16 && bytes.iter().any(u8::is_ascii_alphabetic) && all(token_byte))
}

/// `8-4-4-4-12` hex digits, either case.
fn is_uuid(text: &str) -> bool {
    let bytes = text.as_bytes();
    bytes.len() == 36
        && bytes.iter().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => *b == b'-',
            _ => b.is_ascii_hexdigit(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(text: &str) -> RouteTemplate {
        text.parse().unwrap()
    }

    #[test]
    fn strips_the_rollout_prefix() {
        let s = strip_rollout_prefix("/ng-rollout/r-1/verify");
        assert_eq!(s.route_path, "/verify");
        assert_eq!(s.rollout_id.unwrap().as_str(), "r-1");
        assert!(s.prefixed);

        let s = strip_rollout_prefix("/ng-rollout/3-0-a1/training-token-capture/v1/responses");
        assert_eq!(s.route_path, "/v1/responses");
        assert_eq!(s.rollout_id.unwrap().as_str(), "3-0-a1");
    }

    #[test]
    fn invalid_segment_is_stripped_without_an_id() {
        for path in [
            "/ng-rollout/.x/verify",
            "/ng-rollout/a%2Fb/verify",
            "/ng-rollout/{rollout_id}/verify",
        ] {
            let s = strip_rollout_prefix(path);
            assert_eq!(
                (s.route_path, s.rollout_id, s.prefixed),
                ("/verify", None, true),
                "{path}"
            );
        }
    }

    #[test]
    fn prefix_needs_a_segment_and_a_rest() {
        for path in [
            "/ng-rollout/r-1",
            "/ng-rollout/",
            "/ng-rollout//verify",
            "/ng-rollout",
            "/ng-rolloutx/r/verify",
            "/verify",
            "",
            "*",
        ] {
            let s = strip_rollout_prefix(path);
            assert_eq!(
                (s.route_path, s.rollout_id, s.prefixed),
                (path, None, false),
                "{path}"
            );
        }
        // The rest may be just `/`.
        assert_eq!(strip_rollout_prefix("/ng-rollout/r/").route_path, "/");
    }

    #[test]
    fn capture_segment_needs_a_rest() {
        let s = strip_rollout_prefix("/ng-rollout/r/training-token-capture");
        assert_eq!(s.route_path, "/training-token-capture");
        let s = strip_rollout_prefix("/ng-rollout/r/training-token-captured/x");
        assert_eq!(s.route_path, "/training-token-captured/x");
        let s = strip_rollout_prefix("/ng-rollout/r/training-token-capture/");
        assert_eq!(s.route_path, "/");
        // Only one capture segment is Gym's.
        let s = strip_rollout_prefix(
            "/ng-rollout/r/training-token-capture/training-token-capture/v1/responses",
        );
        assert_eq!(s.route_path, "/training-token-capture/v1/responses");
    }

    #[test]
    fn template_matching() {
        let items = t("/items/{item_id}");
        assert!(items.matches("/items/42"));
        assert!(items.matches("/items/a.b"));
        assert!(!items.matches("/items/"));
        assert!(!items.matches("/items/1/2"));
        assert!(!items.matches("/items"));

        let files = t("/files/{p:path}");
        assert!(files.matches("/files/a/b/c"));
        assert!(files.matches("/files/"));
        assert!(!files.matches("/file"));

        let n = t("/n/{x:int}");
        assert!(n.matches("/n/12") && !n.matches("/n/-1") && !n.matches("/n/x"));
        let f = t("/f/{x:float}");
        assert!(
            f.matches("/f/1.5") && f.matches("/f/2") && !f.matches("/f/1.") && !f.matches("/f/.5")
        );
        let u = t("/u/{x:uuid}");
        assert!(u.matches("/u/123e4567-e89b-12d3-a456-426614174000"));
        assert!(u.matches("/u/123E4567-E89B-12D3-A456-426614174000"));
        assert!(u.matches("/u/123e4567e89b12d3a456-426614174000"));
        assert!(!u.matches("/u/123e4567-e89b-12d3-a456-42661417400"));
        assert!(!u.matches("/u/123e4567-e89b-12d3-a456-4266141740000"));
        assert!(!u.matches("/u/123e4567--e89b-12d3-a456-426614174000"));
        assert!(!u.matches("/u/g23e4567-e89b-12d3-a456-426614174000"));
        let s = t("/s/{x:str}");
        assert!(s.matches("/s/x") && !s.matches("/s/x/y"));
    }

    #[test]
    fn template_matching_backtracks_within_segments() {
        let report = t("/r/{name}.{ext}");
        assert!(report.matches("/r/a.b.json"));
        assert!(!report.matches("/r/ab"));
        let tail = t("/{p:path}/edit");
        assert!(tail.matches("/a/b/edit"));
        assert!(!tail.matches("/a/b/view"));
        let two = t("/x/{a}{b}");
        assert!(two.matches("/x/ab") && !two.matches("/x/a"));
    }

    #[test]
    fn template_parse_follows_starlette() {
        assert!(t("/").is_literal());
        assert!(t("/a/{b").is_literal(), "an unclosed brace is literal");
        assert!(t("/a/{b").matches("/a/{b"));
        assert!(t("/a/{1b}").is_literal(), "a non-identifier is literal");
        assert!(!t("/a/{b}").is_literal());
        assert_eq!(t("/x/{id:int}").to_string(), "/x/{id:int}");
    }

    #[test]
    fn template_parse_errors() {
        use RouteTemplateError as E;
        assert!(matches!(
            "items/{id}".parse::<RouteTemplate>(),
            Err(E::NoLeadingSlash(_))
        ));
        assert!(matches!(
            "".parse::<RouteTemplate>(),
            Err(E::NoLeadingSlash(_))
        ));
        assert!(matches!(
            "/a/{x:nope}".parse::<RouteTemplate>(),
            Err(E::UnknownConverter { .. })
        ));
        assert!(matches!(
            "/a/{x}/{x}".parse::<RouteTemplate>(),
            Err(E::DuplicateParam { .. })
        ));
        for bad in ["/a?b=1", "/a#f", "/a b", "/a\0"] {
            assert!(
                matches!(bad.parse::<RouteTemplate>(), Err(E::BadCharacter(_))),
                "{bad:?}"
            );
        }
        let message = "/a/{x:nope}"
            .parse::<RouteTemplate>()
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("nope") && message.contains("path"),
            "{message}"
        );
        let message = "items".parse::<RouteTemplate>().unwrap_err().to_string();
        assert!(message.contains("/items/{item_id}"), "{message}");
    }

    #[test]
    fn table_prefers_literals_then_literal_segments() {
        let table = RouteTable::new(vec![
            t("/{p:path}"),
            t("/items/{id}"),
            t("/items/{id}/{part}"),
            t("/items/{id}/raw"),
            t("/items/latest"),
        ]);
        assert_eq!(table.resolve("/items/latest"), Some("/items/latest"));
        assert_eq!(table.resolve("/items/7"), Some("/items/{id}"));
        assert_eq!(table.resolve("/items/7/raw"), Some("/items/{id}/raw"));
        assert_eq!(table.resolve("/items/7/x"), Some("/items/{id}/{part}"));
        assert_eq!(table.resolve("/other"), Some("/{p:path}"));
    }

    #[test]
    fn table_first_listed_wins_ties() {
        let table = RouteTable::new(vec![t("/a/{x}"), t("/a/{y}")]);
        assert_eq!(table.resolve("/a/1"), Some("/a/{x}"));
        let table = RouteTable::new(vec![t("/f/{p:path}"), t("/f/{name}")]);
        assert_eq!(table.resolve("/f/1"), Some("/f/{name}"));
    }

    #[test]
    fn table_sources_in_priority_order() {
        let mut table = RouteTable::new(vec![t("/verify/{x:path}")]);
        table.set_server_type(Some(ServerType::Resources));
        assert_eq!(table.resolve("/verify"), Some("/verify"));
        assert_eq!(table.resolve("/verify/"), Some("/verify/{x:path}"));
        table.set_harvested(vec![t("/{anything}")]);
        // A user route beats a harvested one beats Gym's known one.
        assert_eq!(table.resolve("/verify"), Some("/{anything}"));
        assert_eq!(table.resolve("/verify/a"), Some("/verify/{x:path}"));
        table.set_harvested(vec![]);
        assert_eq!(table.resolve("/verify"), Some("/verify"));
    }

    #[test]
    fn known_routes_by_server_type() {
        let mut table = RouteTable::new(vec![]);
        for path in [
            "/",
            "/health",
            "/healthz",
            "/livez",
            "/readyz",
            "/openapi.json",
            "/docs",
        ] {
            assert_eq!(table.resolve(path), Some(path));
        }
        assert_eq!(table.resolve("/verify"), None);
        table.set_server_type(Some(ServerType::Resources));
        assert_eq!(table.resolve("/verify"), Some("/verify"));
        assert_eq!(table.resolve("/reverify_mode"), Some("/reverify_mode"));
        assert_eq!(table.resolve("/run"), None);
        table.set_server_type(Some(ServerType::Agent));
        assert_eq!(table.resolve("/run"), Some("/run"));
        assert_eq!(
            table.resolve("/v1/agent_sessions/close"),
            Some("/v1/agent_sessions/close")
        );
        assert_eq!(table.resolve("/verify"), None);
        table.set_server_type(Some(ServerType::Model));
        for path in [
            "/v1/chat/completions",
            "/v1/responses",
            "/v1/messages",
            "/health",
        ] {
            assert_eq!(table.resolve(path), Some(path));
        }
        assert_eq!(table.server_type, Some(ServerType::Model));
    }

    #[test]
    fn openapi_paths_become_templates() {
        let doc = br##"{"openapi": "3.1.0", "info": {"title": "FastAPI"}, "paths": {
            "/run": {"post": {"requestBody": {"content": {"application/json": {"schema": {"$ref": "#/x"}}}}}},
            "/v1/responses": {"post": {}},
            "/ng-rollout/{rollout_id}/v1/responses": {"post": {}},
            "/ng-rollout/{rollout_id}/training-token-capture/v1/responses": {"post": {}},
            "/items/{item_id}": {"get": {}},
            "no-slash": {"get": {}},
            "/bad/{x:nope}": {"get": {}}
        }, "components": {}}"##;
        let templates = templates_from_openapi(doc).unwrap();
        let texts: Vec<&str> = templates.iter().map(RouteTemplate::as_str).collect();
        assert_eq!(texts, ["/run", "/v1/responses", "/items/{item_id}"]);
    }

    #[test]
    fn openapi_errors() {
        assert!(matches!(
            templates_from_openapi(b"{}"),
            Err(OpenApiError::NoPaths)
        ));
        assert!(matches!(
            templates_from_openapi(b"{\"paths\": null}"),
            Err(OpenApiError::NoPaths)
        ));
        assert!(matches!(
            templates_from_openapi(b"{\"paths\": []}"),
            Err(OpenApiError::Json(_))
        ));
        assert!(matches!(
            templates_from_openapi(b"not json"),
            Err(OpenApiError::Json(_))
        ));
        let big = vec![b' '; MAX_OPENAPI_BYTES + 1];
        let err = templates_from_openapi(&big).unwrap_err();
        assert!(matches!(err, OpenApiError::TooLarge { .. }));
        assert!(err.to_string().contains("--route"));
        assert_eq!(templates_from_openapi(b"{\"paths\": {}}").unwrap(), vec![]);
    }

    #[test]
    fn heuristic_segments() {
        let ids = [
            "42",
            "0",
            "123e4567-e89b-12d3-a456-426614174000",
            "123E4567-E89B-12D3-A456-426614174000",
            "deadbeef1",
            "0123abcd",
            "a1b2c3d4e5f6a7b8c9d0",
            "AbCdEfGhIjKlMnOp1",
            "12-3",
            "12-3-a1",
            "2024-01-02",
            "1.2.3",
        ];
        for segment in ids {
            assert!(is_id_segment(segment), "{segment}");
        }
        let words = [
            "",
            "v1",
            "chat",
            "completions",
            "deadbeef",
            "abc123",
            "aggregate_metrics",
            "run-a1",
            "a-1",
            "training-token-capture",
            "abcdefghijklmnopq",
        ];
        for segment in words {
            assert!(!is_id_segment(segment), "{segment}");
        }
    }

    #[test]
    fn namer_uses_templates_then_heuristic() {
        let mut table = RouteTable::new(vec![t("/items/{item_id}")]);
        table.set_server_type(Some(ServerType::Resources));
        let mut namer = RouteNamer::new(table);
        assert_eq!(namer.name("/verify"), RouteName::Template("/verify".into()));
        assert_eq!(
            namer.name("/items/9"),
            RouteName::Template("/items/{item_id}".into())
        );
        assert_eq!(
            namer.name("/users/42/files/0123abcd"),
            RouteName::Heuristic("/users/{id}/files/{id}".into())
        );
        assert_eq!(
            namer.name("/get_weather"),
            RouteName::Heuristic("/get_weather".into())
        );
        assert_eq!(namer.name("*"), RouteName::Unnamed);
        assert_eq!(namer.routes_over_cap(), 0);

        assert_eq!(
            RouteName::Template("/verify".into())
                .http_route()
                .map(|r| &**r),
            Some("/verify")
        );
        assert_eq!(RouteName::Heuristic("/x/{id}".into()).http_route(), None);
        assert_eq!(
            RouteName::Heuristic("/x/{id}".into()).span_name("GET"),
            "GET /x/{id}"
        );
        assert_eq!(RouteName::Unnamed.span_name("GET"), "GET");
    }

    #[test]
    fn namer_caps_heuristic_routes() {
        let mut namer = RouteNamer::with_cap(RouteTable::new(vec![]), 2);
        assert!(matches!(namer.name("/a"), RouteName::Heuristic(_)));
        assert!(matches!(namer.name("/b/1"), RouteName::Heuristic(_)));
        assert_eq!(namer.name("/c"), RouteName::Unnamed);
        assert_eq!(namer.name("/d"), RouteName::Unnamed);
        // Routes already seen keep their names; templates are never capped.
        assert_eq!(namer.name("/b/2"), RouteName::Heuristic("/b/{id}".into()));
        assert_eq!(namer.name("/health"), RouteName::Template("/health".into()));
        assert_eq!(namer.routes_over_cap(), 2);
        let long = format!("/{}", "x".repeat(MAX_HEURISTIC_ROUTE_BYTES));
        let mut namer = RouteNamer::new(RouteTable::new(vec![]));
        assert_eq!(namer.name(&long), RouteName::Unnamed);
        assert_eq!(namer.routes_over_cap(), 1);
    }

    #[test]
    fn namer_default_cap() {
        let mut namer = RouteNamer::new(RouteTable::new(vec![]));
        for i in 0..HEURISTIC_ROUTE_CAP {
            assert!(matches!(
                namer.name(&format!("/route{}x", "y".repeat(i))),
                RouteName::Heuristic(_)
            ));
        }
        assert_eq!(namer.name("/one-more"), RouteName::Unnamed);
        assert_eq!(namer.routes_over_cap(), 1);
    }

    #[test]
    fn namer_table_can_change() {
        let mut namer = RouteNamer::new(RouteTable::new(vec![]));
        assert_eq!(namer.name("/run"), RouteName::Heuristic("/run".into()));
        namer.table_mut().set_server_type(Some(ServerType::Agent));
        assert_eq!(namer.name("/run"), RouteName::Template("/run".into()));
        namer.table_mut().set_harvested(vec![t("/tools/{name}")]);
        assert_eq!(
            namer.name("/tools/search"),
            RouteName::Template("/tools/{name}".into())
        );
        assert_eq!(namer.table.resolve("/tools/x"), Some("/tools/{name}"));
    }
}
