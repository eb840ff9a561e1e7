//! GenAI semantic-convention facts (operation, model, token usage) of a call to an
//! OpenAI-compatible endpoint, read from the tracer's *samples* of its bodies: a prefix from
//! the first byte and a tail ending at the last byte. A fact is given only where the sample
//! decides it; whatever a cut hides is `None`, never a guess. Only a `model` string and
//! `usage` counts are ever read out: prompts, completions, tool arguments and keys are
//! skipped over, never copied.

/// Which OpenAI-compatible operation a request path names (matched on the path's end, any
/// prefix allowed, e.g. "/openai/v1/chat/completions"; the path has no query string).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GenAiOperation {
    Responses,
    ChatCompletions,
    Completions,
    Messages,
}

impl GenAiOperation {
    /// Whole trailing segments only: "/v1/responses/abc" (a stored response) is no call, and
    /// "/v1/chat/completions" is not "/v1/completions".
    pub fn from_path(path: &str) -> Option<Self> {
        const ENDPOINTS: [(&str, GenAiOperation); 4] = [
            ("/v1/responses", GenAiOperation::Responses),
            ("/v1/chat/completions", GenAiOperation::ChatCompletions),
            ("/v1/completions", GenAiOperation::Completions),
            ("/v1/messages", GenAiOperation::Messages),
        ];
        ENDPOINTS
            .iter()
            .find(|(endpoint, _)| path.ends_with(endpoint))
            .map(|&(_, operation)| operation)
    }

    /// The `gen_ai.operation.name` value, one of the semantic conventions' well-known values:
    /// the Responses and Messages APIs are chats too.
    pub fn operation_name(self) -> &'static str {
        match self {
            Self::Responses | Self::ChatCompletions | Self::Messages => "chat",
            Self::Completions => "text_completion",
        }
    }
}

/// Token counts from a response's `usage` object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct TokenUsage {
    pub input_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
}

impl TokenUsage {
    /// A newer report's counts replace the older ones; a count it lacks keeps the older one.
    fn overlay(&mut self, newer: TokenUsage) {
        self.input_tokens = newer.input_tokens.or(self.input_tokens);
        self.output_tokens = newer.output_tokens.or(self.output_tokens);
    }
}

/// A body sample as the tracer holds it.
pub struct BodyView<'a> {
    /// The body's first bytes.
    pub prefix: &'a [u8],
    /// The prefix is the whole body.
    pub complete: bool,
    /// The body's last bytes; may overlap the prefix.
    pub tail: Option<&'a [u8]>,
}

impl<'a> BodyView<'a> {
    /// The tail, when it can add to what the prefix shows.
    fn tail_beyond_prefix(&self) -> Option<&'a [u8]> {
        self.tail.filter(|_| !self.complete)
    }
}

/// `gen_ai.provider.name` for the hosted APIs a `Host` header names; `None` for any other
/// host (a self-hosted vLLM, a proxy): the provider is then not known.
pub fn provider_name(host: &str) -> Option<&'static str> {
    let host = host.rsplit_once(':').map_or(host, |(name, port)| {
        if port.bytes().all(|b| b.is_ascii_digit()) {
            name
        } else {
            host
        }
    });
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    const EXACT: [(&str, &str); 8] = [
        ("api.openai.com", "openai"),
        ("api.anthropic.com", "anthropic"),
        ("generativelanguage.googleapis.com", "gcp.gemini"),
        ("api.mistral.ai", "mistral_ai"),
        ("api.groq.com", "groq"),
        ("api.deepseek.com", "deepseek"),
        ("api.x.ai", "x_ai"),
        ("api.perplexity.ai", "perplexity"),
    ];
    if let Some((_, provider)) = EXACT.iter().find(|(name, _)| *name == host) {
        return Some(provider);
    }
    host.ends_with(".openai.azure.com")
        .then_some("azure.ai.openai")
}

/// Longer "model" values are no model names worth an attribute.
const MODEL_NAME_CAP: usize = 256;

/// The top-level "model" string of a JSON request or response body, if the sample decides
/// it; for a server-sent-events body, the model of the first whole `data:` event of its
/// prefix that names one (see [`event_model`]). An empty or over-long name (more than 256
/// bytes) is `None`.
pub fn top_level_model(body: &BodyView<'_>) -> Option<String> {
    if is_event_stream(body.prefix) {
        return whole_lines(body.prefix, true, body.complete)
            .find_map(event_model)
            .and_then(decode_model_name);
    }
    if !is_json_object(body.prefix) {
        return None;
    }
    let in_tail = body
        .tail_beyond_prefix()
        .and_then(|tail| read_last_top_level_member(tail, b"model", Reader::string_value));
    let raw = match in_tail {
        Some(decided) => decided,
        None => prefix_model(body.prefix),
    }?;
    decode_model_name(raw)
}

/// The usage of a response: for a JSON body its top-level `usage` object; for a
/// server-sent-events body the latest counts in the events the sample shows whole.
pub fn usage(body: &BodyView<'_>) -> TokenUsage {
    if is_event_stream(body.prefix) {
        return event_stream_usage(body);
    }
    if !is_json_object(body.prefix) {
        return TokenUsage::default();
    }
    let in_tail = body.tail_beyond_prefix().and_then(|tail| {
        read_last_top_level_member(tail, b"usage", |reader| {
            let mut usage = TokenUsage::default();
            read_usage(reader, &mut usage).map(|()| usage)
        })
    });
    in_tail.unwrap_or_else(|| prefix_usage(body.prefix))
}

fn is_json_object(prefix: &[u8]) -> bool {
    prefix.trim_ascii_start().starts_with(b"{")
}

/// A body of `text/event-stream` lines; a leading `:` comment line (some proxies send one
/// before the first event) counts too, since no JSON body can start with it.
fn is_event_stream(prefix: &[u8]) -> bool {
    let start = prefix.trim_ascii_start();
    start.starts_with(b"data:") || start.starts_with(b"event:") || start.starts_with(b":")
}

/// The raw content of the last top-level "model" the prefix shows whole; a later one the
/// prefix cuts, or one that is no string, leaves `None`.
fn prefix_model(prefix: &[u8]) -> Option<&[u8]> {
    let mut model = None;
    let _cut_or_end = Reader::new(prefix).members(|key, value| {
        if key != b"model" {
            return Some(false);
        }
        let read = value.string_value();
        model = read.flatten();
        read.map(|_| true)
    });
    model
}

/// The last top-level "usage" the prefix shows; counts the prefix shows whole before a cut
/// inside it are kept, since each is final once its number has ended.
fn prefix_usage(prefix: &[u8]) -> TokenUsage {
    let mut usage = TokenUsage::default();
    let _cut_or_end = Reader::new(prefix).members(|key, value| {
        if key != b"usage" {
            return Some(false);
        }
        read_usage(value, &mut usage)?;
        Some(true)
    });
    usage
}

/// Reads a `usage` value into `usage` (replacing what it held): an object's token counts, or
/// none for `null` or any other non-object. `None` where the value is cut or is no JSON, with
/// the counts read before that point kept.
fn read_usage(reader: &mut Reader<'_>, usage: &mut TokenUsage) -> Option<()> {
    *usage = TokenUsage::default();
    if reader.peek()? != b'{' {
        return reader.skip_value();
    }
    reader.members(|key, value| {
        let count = match key {
            b"input_tokens" | b"prompt_tokens" => &mut usage.input_tokens,
            b"output_tokens" | b"completion_tokens" => &mut usage.output_tokens,
            _ => return Some(false),
        };
        *count = value.count()?;
        Some(true)
    })
}

/// Finds the body's last top-level member named `name` in the tail and reads its value with
/// `read`; `None` if the tail doesn't show one whole.
///
/// The tail starts at an unknown point, maybe inside a string, so it is read backward from the
/// body's final `}`: from there depth and string state are exact, a quote being raw iff an even
/// number of backslashes precedes it. Where that count is cut by the tail's start, nothing
/// before is decided. The first key met at depth 1 is the last top-level one, and the key's
/// value, read forward from a point known to be outside any string, is whole in the tail.
fn read_last_top_level_member<'a, T>(
    tail: &'a [u8],
    name: &[u8],
    read: impl FnOnce(&mut Reader<'a>) -> Option<T>,
) -> Option<T> {
    let end = tail.iter().rposition(|byte| !byte.is_ascii_whitespace())?;
    if tail[end] != b'}' {
        return None;
    }
    let mut depth = 1usize;
    let mut at = end;
    while at > 0 {
        at -= 1;
        match tail[at] {
            b'}' | b']' => depth += 1,
            b'{' | b'[' => {
                depth -= 1;
                if depth == 0 {
                    return None;
                }
            }
            b'"' => {
                let open = opening_quote(tail, at)?;
                if depth == 1 && &tail[open + 1..at] == name {
                    let mut reader = Reader::at(tail, at + 1);
                    if reader.eat(b':').is_some() {
                        return read(&mut reader);
                    }
                }
                at = open;
            }
            _ => {}
        }
    }
    None
}

/// The opening quote of the string whose closing quote is at `close`, or `None` if the sample
/// cannot tell where it is.
fn opening_quote(bytes: &[u8], close: usize) -> Option<usize> {
    let mut search_end = close;
    loop {
        let quote = bytes[..search_end].iter().rposition(|&byte| byte == b'"')?;
        let backslashes = bytes[..quote]
            .iter()
            .rev()
            .take_while(|&&byte| byte == b'\\')
            .count();
        if backslashes == quote {
            // The run of backslashes may go on before the sample: escaped or not is unknown.
            return None;
        }
        if backslashes % 2 == 0 {
            return Some(quote);
        }
        search_end = quote;
    }
}

/// Counts from the `data:` events the sample shows whole, in body order: the prefix's whole
/// lines, then the tail's (all but its first, which may start mid-line). The prefix and tail
/// may overlap; an event seen twice only repeats its counts.
///
/// The Responses API's last event, `response.completed`, carries the whole response, so its
/// line is nearly always longer than the tail: when no whole line reports usage, the tail's
/// cut first line is read backward for a `usage` in the object that ends the event (the
/// `response`: the only object-valued last member of a Responses event that holds one).
fn event_stream_usage(body: &BodyView<'_>) -> TokenUsage {
    let mut latest = TokenUsage::default();
    for line in whole_lines(body.prefix, true, body.complete) {
        latest.overlay(event_usage(line));
    }
    if let Some(tail) = body.tail_beyond_prefix() {
        let mut from_whole = TokenUsage::default();
        for line in whole_lines(tail, false, true) {
            from_whole.overlay(event_usage(line));
        }
        if from_whole == TokenUsage::default()
            && let Some(cut) = whole_lines(tail, true, true).next()
            && let Some(usage) = usage_ending_cut_event(cut)
        {
            latest.overlay(usage);
        }
        latest.overlay(from_whole);
    }
    latest
}

/// In an event line cut at its start, the `usage` member of the object that is the event's
/// last member (`{..., "response": {..., "usage": {...}, ...}}`), read backward as
/// [`read_last_top_level_member`] reads a body.
fn usage_ending_cut_event(line: &[u8]) -> Option<TokenUsage> {
    let end = line.iter().rposition(|byte| !byte.is_ascii_whitespace())?;
    if line[end] != b'}' {
        return None;
    }
    let inner_end = line[..end]
        .iter()
        .rposition(|byte| !byte.is_ascii_whitespace())?;
    if line[inner_end] != b'}' {
        return None;
    }
    read_last_top_level_member(&line[..=inner_end], b"usage", |reader| {
        let mut usage = TokenUsage::default();
        read_usage(reader, &mut usage).map(|()| usage)
    })
    .filter(|usage| *usage != TokenUsage::default())
}

/// The lines of `sample`, leaving out a first line that may have started before it and a
/// last line that may go on after it. A raw newline is always a line break in an event
/// stream: JSON data escapes its newlines.
fn whole_lines(
    sample: &[u8],
    starts_at_line_start: bool,
    ends_at_body_end: bool,
) -> impl Iterator<Item = &[u8]> {
    let last = sample.iter().filter(|&&byte| byte == b'\n').count();
    sample
        .split(|&byte| byte == b'\n')
        .enumerate()
        .filter(move |&(index, _)| {
            (index > 0 || starts_at_line_start) && (index < last || ends_at_body_end)
        })
        .map(|(_, line)| line.strip_suffix(b"\r").unwrap_or(line))
}

/// The counts one whole `data:` line reports: a top-level `usage` (chat completion chunks,
/// Anthropic's `message_delta`), `response.usage` (the Responses API's `response.completed`)
/// or `message.usage` (Anthropic's `message_start`). From `message.usage` only the input count
/// is taken: its output count is a placeholder that `message_delta` later replaces, and a
/// sample cut before that must not report it.
fn event_usage(line: &[u8]) -> TokenUsage {
    let Some(data) = line.strip_prefix(b"data:") else {
        return TokenUsage::default();
    };
    let mut found = TokenUsage::default();
    let read = Reader::new(data).members(|key, value| {
        let is_anthropic_message = match key {
            b"usage" => return read_usage(value, &mut found).map(|()| true),
            b"response" => false,
            b"message" => true,
            _ => return Some(false),
        };
        if value.peek()? != b'{' {
            return Some(false);
        }
        value.members(|key, value| {
            if key != b"usage" {
                return Some(false);
            }
            read_usage(value, &mut found)?;
            if is_anthropic_message {
                found.output_tokens = None;
            }
            Some(true)
        })?;
        Some(true)
    });
    read.map_or_else(TokenUsage::default, |()| found)
}

/// The model one whole `data:` line names: a top-level `model` (chat completion chunks), or
/// the `model` of its `response` (the Responses API's `response.created`) or `message`
/// (Anthropic's `message_start`).
fn event_model(line: &[u8]) -> Option<&[u8]> {
    let data = line.strip_prefix(b"data:")?;
    let mut model = None;
    Reader::new(data).members(|key, value| {
        match key {
            b"model" => model = value.string_value()?,
            b"response" | b"message" if value.peek()? == b'{' => {
                value.members(|key, value| {
                    if key != b"model" {
                        return Some(false);
                    }
                    model = value.string_value()?;
                    Some(true)
                })?;
            }
            _ => return Some(false),
        }
        Some(true)
    })?;
    model
}

/// A model name from a JSON string's raw content; escapes other than `\"`, `\\`, `\/` and a
/// non-surrogate `\uXXXX` have no place in one and give `None`.
fn decode_model_name(raw: &[u8]) -> Option<String> {
    // An escape is at most 6 raw bytes for at least 1 decoded byte.
    if raw.is_empty() || raw.len() > 6 * MODEL_NAME_CAP {
        return None;
    }
    let mut name = String::with_capacity(raw.len().min(MODEL_NAME_CAP));
    let mut rest = raw;
    while let Some(backslash) = rest.iter().position(|&byte| byte == b'\\') {
        name.push_str(std::str::from_utf8(&rest[..backslash]).ok()?);
        let (unescaped, escape_len) = match rest.get(backslash + 1)? {
            b'"' => ('"', 2),
            b'\\' => ('\\', 2),
            b'/' => ('/', 2),
            b'u' => (hex_char(rest.get(backslash + 2..backslash + 6)?)?, 6),
            _ => return None,
        };
        name.push(unescaped);
        rest = &rest[backslash + escape_len..];
    }
    name.push_str(std::str::from_utf8(rest).ok()?);
    (name.len() <= MODEL_NAME_CAP).then_some(name)
}

fn hex_char(digits: &[u8]) -> Option<char> {
    if !digits.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    let code = u32::from_str_radix(std::str::from_utf8(digits).ok()?, 16).ok()?;
    char::from_u32(code)
}

/// A forward reader over JSON from a point known to be outside any string. Every read is
/// `None` where the sample ends (a cut) or the bytes are no JSON: either way nothing from
/// that point on is decided. Skipping counts brackets without recursion, so any nesting
/// depth costs no stack, and every byte is looked at a bounded number of times.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self::at(bytes, 0)
    }

    fn at(bytes: &'a [u8], pos: usize) -> Self {
        Self { bytes, pos }
    }

    /// The next byte that is not whitespace, without taking it.
    fn peek(&mut self) -> Option<u8> {
        while let Some(&byte) = self.bytes.get(self.pos) {
            if !byte.is_ascii_whitespace() {
                return Some(byte);
            }
            self.pos += 1;
        }
        None
    }

    fn eat(&mut self, expected: u8) -> Option<()> {
        if self.peek()? != expected {
            return None;
        }
        self.pos += 1;
        Some(())
    }

    /// Hands each member of the object here to `on_member` as its raw key and this reader at
    /// its value; `on_member` says whether it read the value, and an unread one is skipped.
    fn members(
        &mut self,
        mut on_member: impl FnMut(&'a [u8], &mut Self) -> Option<bool>,
    ) -> Option<()> {
        self.eat(b'{')?;
        if self.eat(b'}').is_some() {
            return Some(());
        }
        loop {
            let key = self.string()?;
            self.eat(b':')?;
            self.peek()?;
            if !on_member(key, self)? {
                self.skip_value()?;
            }
            match self.peek()? {
                b',' => self.pos += 1,
                b'}' => {
                    self.pos += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// The raw content of the string here, escapes undecoded.
    fn string(&mut self) -> Option<&'a [u8]> {
        if self.peek()? != b'"' {
            return None;
        }
        let start = self.pos + 1;
        let mut at = start;
        // Most of a Gym body is string content: it is searched, not stepped through.
        while let Some(found) = memchr::memchr2(b'"', b'\\', self.bytes.get(at..)?) {
            at += found;
            if self.bytes[at] == b'"' {
                self.pos = at + 1;
                return Some(&self.bytes[start..at]);
            }
            at += 2;
        }
        None
    }

    /// The raw content of the value here if it is a string, `Some(None)` if it is another
    /// value.
    fn string_value(&mut self) -> Option<Option<&'a [u8]>> {
        if self.peek()? == b'"' {
            return self.string().map(Some);
        }
        self.skip_value().map(|()| None)
    }

    /// A token count: `Some(None)` for any value that is not a non-negative integer fitting
    /// a u64 (a float, a string, an overflow).
    fn count(&mut self) -> Option<Option<u64>> {
        if !matches!(self.peek()?, b'0'..=b'9' | b'-') {
            return self.skip_value().map(|()| None);
        }
        let token = self.scalar()?;
        let is_integer =
            token.iter().all(u8::is_ascii_digit) && (token == b"0" || !token.starts_with(b"0"));
        Some(
            is_integer
                .then(|| std::str::from_utf8(token).ok()?.parse().ok())
                .flatten(),
        )
    }

    /// A number, `true`, `false` or `null`, up to the byte that ends it; one the sample cuts
    /// is `None`.
    fn scalar(&mut self) -> Option<&'a [u8]> {
        let start = self.pos;
        let len = self.bytes.get(start..)?.iter().position(|&byte| {
            matches!(byte, b',' | b'}' | b']' | b':') || byte.is_ascii_whitespace()
        })?;
        if len == 0 {
            return None;
        }
        self.pos += len;
        Some(&self.bytes[start..start + len])
    }

    fn skip_value(&mut self) -> Option<()> {
        match self.peek()? {
            b'"' => self.string().map(|_| ()),
            b'{' | b'[' => self.skip_container(),
            _ => self.scalar().map(|_| ()),
        }
    }

    fn skip_container(&mut self) -> Option<()> {
        let mut depth = 0usize;
        loop {
            match *self.bytes.get(self.pos)? {
                b'"' => {
                    self.string()?;
                    continue;
                }
                b'{' | b'[' => depth += 1,
                b'}' | b']' => {
                    depth = depth.checked_sub(1)?;
                    if depth == 0 {
                        self.pos += 1;
                        return Some(());
                    }
                }
                _ => {}
            }
            self.pos += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The real shape of a Responses API body, with a fake `usage` inside an output text and
    /// `input_tokens_details` that must not count.
    const RESPONSES_JSON: &str = concat!(
        r#"{"id":"resp_1","object":"response","created_at":1,"status":"completed","#,
        r#""model":"gpt-x","output":[{"type":"message","id":"msg_1","status":"completed","#,
        r#""role":"assistant","content":[{"type":"output_text","#,
        r#""text":"Hi \"usage\":{\"input_tokens\":999} \\","annotations":[]}]}],"#,
        r#""parallel_tool_calls":true,"tools":[],"#,
        r#""usage":{"input_tokens":123,"input_tokens_details":{"cached_tokens":7},"#,
        r#""output_tokens":45,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":168},"#,
        r#""user":null,"metadata":{}}"#,
    );

    const CHAT_JSON: &str = concat!(
        r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"gpt-4o-mini","#,
        r#""choices":[{"index":0,"message":{"role":"assistant","content":"hello"},"#,
        r#""finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":12,"#,
        r#""total_tokens":21,"prompt_tokens_details":{"cached_tokens":0}}}"#,
    );

    /// A request whose tools' schema holds "model" keys deeper than the top-level one.
    const REQUEST_WITH_TOOLS: &str = concat!(
        r#"{"tools":[{"type":"function","model":"nested-3","function":{"name":"pick","#,
        r#""parameters":{"type":"object","properties":{"model":{"type":"string"}}}}}],"#,
        r#""model":"gpt-req","input":"hi \"model\":\"fake\"","stream":false}"#,
    );

    /// Output items with their own `usage` before the top-level one.
    const NESTED_USAGE_JSON: &str = concat!(
        r#"{"id":"r","output":[{"type":"x","usage":{"input_tokens":999,"output_tokens":998}},"#,
        r#"{"text":"\"usage\":{\"input_tokens\":997}\\"}],"#,
        r#""usage":{"input_tokens":1,"output_tokens":2},"model":"m-last"}"#,
    );

    const RESPONSES_SSE: &str = concat!(
        "event: response.created\n",
        r#"data: {"type":"response.created","sequence_number":0,"response":{"id":"resp_1","#,
        r#""object":"response","status":"in_progress","model":"gpt-x","output":[],"usage":null}}"#,
        "\n\nevent: response.output_text.delta\n",
        r#"data: {"type":"response.output_text.delta","sequence_number":1,"item_id":"msg_1","#,
        r#""output_index":0,"content_index":0,"delta":"Hi \"usage\":{\"input_tokens\":999}"}"#,
        "\n\nevent: response.completed\n",
        r#"data: {"type":"response.completed","sequence_number":9,"response":{"id":"resp_1","#,
        r#""object":"response","status":"completed","model":"gpt-x","output":[{"type":"message","#,
        r#""content":[{"type":"output_text","text":"Hi"}]}],"usage":{"input_tokens":11,"#,
        r#""input_tokens_details":{"cached_tokens":3},"output_tokens":22,"#,
        r#""output_tokens_details":{"reasoning_tokens":0},"total_tokens":33},"user":null,"#,
        r#""metadata":{}}}"#,
        "\n\n",
    );

    const CHAT_SSE: &str = concat!(
        r#"data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","#,
        r#""choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}],"usage":null}"#,
        "\n\n",
        r#"data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","#,
        r#""choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":null}"#,
        "\n\n",
        r#"data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","#,
        r#""choices":[],"usage":{"prompt_tokens":9,"completion_tokens":12,"total_tokens":21}}"#,
        "\n\ndata: [DONE]\n\n",
    );

    const MESSAGES_SSE: &str = concat!(
        "event: message_start\n",
        r#"data: {"type":"message_start","message":{"id":"msg_1","type":"message","#,
        r#""role":"assistant","model":"claude-x","content":[],"stop_reason":null,"#,
        r#""usage":{"input_tokens":25,"output_tokens":1}}}"#,
        "\n\nevent: content_block_delta\n",
        r#"data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}"#,
        "\n\nevent: message_delta\n",
        r#"data: {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":15}}"#,
        "\n\nevent: message_stop\n",
        r#"data: {"type":"message_stop"}"#,
        "\n\n",
    );

    fn whole(body: &str) -> BodyView<'_> {
        BodyView {
            prefix: body.as_bytes(),
            complete: true,
            tail: None,
        }
    }

    /// The view the tracer would hold with a prefix of `prefix_len` and a tail of `tail_len`.
    fn sampled(body: &str, prefix_len: usize, tail_len: usize) -> BodyView<'_> {
        let bytes = body.as_bytes();
        let prefix_len = prefix_len.min(bytes.len());
        BodyView {
            prefix: &bytes[..prefix_len],
            complete: prefix_len == bytes.len(),
            tail: Some(&bytes[bytes.len() - tail_len.min(bytes.len())..]),
        }
    }

    fn counts(input_tokens: Option<u64>, output_tokens: Option<u64>) -> TokenUsage {
        TokenUsage {
            input_tokens,
            output_tokens,
        }
    }

    /// A tail from `marker` on, with a prefix just long enough to tell JSON from events.
    fn tail_from<'a>(body: &'a str, marker: &str) -> BodyView<'a> {
        let at = body.find(marker).unwrap();
        sampled(body, 6, body.len() - at)
    }

    #[test]
    fn paths_name_operations_only_at_their_end() {
        use GenAiOperation::*;
        for (path, operation) in [
            ("/v1/responses", Some(Responses)),
            ("/openai/v1/chat/completions", Some(ChatCompletions)),
            ("/v1/chat/completions", Some(ChatCompletions)),
            ("/v1/completions", Some(Completions)),
            ("/proxy/v1/messages", Some(Messages)),
            ("/v1/responses/abc", None),
            ("/v1/responses/", None),
            ("/chat/completions", None),
            ("/apiv1/completions", None),
            ("/v1/embeddings", None),
            ("", None),
        ] {
            assert_eq!(GenAiOperation::from_path(path), operation, "{path}");
        }
    }

    #[test]
    fn operation_names_are_semconv_well_known_values() {
        use GenAiOperation::*;
        assert_eq!(ChatCompletions.operation_name(), "chat");
        assert_eq!(Responses.operation_name(), "chat");
        assert_eq!(Messages.operation_name(), "chat");
        assert_eq!(Completions.operation_name(), "text_completion");
    }

    #[test]
    fn a_responses_body_gives_its_model_and_top_level_usage_not_the_details() {
        let body = whole(RESPONSES_JSON);
        assert_eq!(top_level_model(&body).as_deref(), Some("gpt-x"));
        assert_eq!(usage(&body), counts(Some(123), Some(45)));
        // The same from the tail alone, with `"user":null,"metadata":{}` after the usage.
        let tail_only = tail_from(RESPONSES_JSON, r#""parallel_tool_calls""#);
        assert_eq!(usage(&tail_only), counts(Some(123), Some(45)));
        assert_eq!(top_level_model(&tail_only), None);
    }

    #[test]
    fn a_chat_completion_counts_prompt_and_completion_tokens() {
        let body = whole(CHAT_JSON);
        assert_eq!(top_level_model(&body).as_deref(), Some("gpt-4o-mini"));
        assert_eq!(usage(&body), counts(Some(9), Some(12)));
        let tail_only = tail_from(CHAT_JSON, r#","usage""#);
        assert_eq!(usage(&tail_only), counts(Some(9), Some(12)));
    }

    #[test]
    fn a_body_longer_than_its_sample_shows_its_usage_in_the_tail_only() {
        let text = "All work and no play. ".repeat(1000);
        let body = RESPONSES_JSON.replace(r#""text":"Hi"#, &format!(r#""text":"{text}"#));
        let view = sampled(&body, 8192, 512);
        assert!(!view.complete);
        assert_eq!(top_level_model(&view).as_deref(), Some("gpt-x"));
        assert_eq!(usage(&view), counts(Some(123), Some(45)));
        let prefix_only = BodyView { tail: None, ..view };
        assert_eq!(usage(&prefix_only), TokenUsage::default());
    }

    #[test]
    fn a_usage_nested_in_an_output_item_is_not_taken() {
        let padding = "x".repeat(600);
        let body = format!(
            r#"{{"id":"r","pad":"{padding}","output":[{{"usage":{{"input_tokens":999}}}}],"status":"done"}}"#
        );
        for tail_len in [40, 60, 100, 200] {
            assert_eq!(usage(&sampled(&body, 64, tail_len)), TokenUsage::default());
        }
        assert_eq!(usage(&whole(&body)), TokenUsage::default());
        // Followed by the top-level one, only the top-level one counts.
        assert_eq!(usage(&whole(NESTED_USAGE_JSON)), counts(Some(1), Some(2)));
        let tail_only = tail_from(NESTED_USAGE_JSON, r#"{"type":"x""#);
        assert_eq!(usage(&tail_only), counts(Some(1), Some(2)));
    }

    #[test]
    fn a_tail_starting_inside_a_string_decides_nothing_before_the_string_ends() {
        let fake = r#"\"usage\":{\"input_tokens\":5,\"output_tokens\":6}}"#;
        let body = format!(
            r#"{{"pad":"{}","note":"say {fake} done"}}"#,
            "y".repeat(300)
        );
        for tail_len in 1..=body.len() - 310 {
            assert_eq!(usage(&sampled(&body, 32, tail_len)), TokenUsage::default());
        }
        let body = format!(
            r#"{{"pad":"{}","note":"say {fake}","usage":{{"input_tokens":3,"output_tokens":4}}}}"#,
            "y".repeat(300)
        );
        // From the byte before the key: a quote at the tail's first byte may be escaped.
        let real = body.len() - body.find(r#","usage":{"input"#).unwrap();
        for tail_len in real..=body.len() - 310 {
            assert_eq!(
                usage(&sampled(&body, 32, tail_len)),
                counts(Some(3), Some(4))
            );
        }
    }

    #[test]
    fn escaped_quotes_and_backslashes_make_no_keys() {
        for body in [
            r#"{"x\"usage":{"input_tokens":9},"y":1}"#,
            r#"{"text":"a \"usage\":{\"input_tokens\":9} b"}"#,
            r#"{"text":"\\\"usage\\\":{\"input_tokens\":9}"}"#,
        ] {
            for prefix_len in 0..=body.len() {
                for tail_len in 0..=body.len() {
                    let view = sampled(body, prefix_len, tail_len);
                    assert_eq!(
                        usage(&view),
                        TokenUsage::default(),
                        "{body} {prefix_len} {tail_len}"
                    );
                }
            }
        }
        let body = r#"{"path":"C:\\dir\\","usage":{"input_tokens":1,"output_tokens":2}}"#;
        assert_eq!(usage(&whole(body)), counts(Some(1), Some(2)));
        assert_eq!(
            usage(&sampled(body, 1, body.len())),
            counts(Some(1), Some(2))
        );
    }

    #[test]
    fn the_model_is_the_top_level_one_not_one_in_a_tool_schema() {
        assert_eq!(
            top_level_model(&whole(REQUEST_WITH_TOOLS)).as_deref(),
            Some("gpt-req")
        );
        let top_level_end = REQUEST_WITH_TOOLS.find("gpt-req").unwrap() + "gpt-req\"".len();
        for prefix_len in 0..REQUEST_WITH_TOOLS.len() {
            let view = BodyView {
                prefix: &REQUEST_WITH_TOOLS.as_bytes()[..prefix_len],
                complete: false,
                tail: None,
            };
            let expected = (prefix_len >= top_level_end).then_some("gpt-req");
            assert_eq!(top_level_model(&view).as_deref(), expected, "{prefix_len}");
        }
    }

    #[test]
    fn a_model_only_the_tail_shows_is_decided_top_level() {
        let content = "tell me a story ".repeat(100);
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":"{content}"}}],"model":"gpt-tail","tools":[{{"model":"nested"}}],"stream":true}}"#
        );
        let model_at = body.find(r#""model":"gpt-tail""#).unwrap();
        let view = sampled(&body, 100, body.len() - model_at + 1);
        assert_eq!(top_level_model(&view).as_deref(), Some("gpt-tail"));
        // The tail showing only the nested one decides nothing.
        let nested_at = body.find(r#""model":"nested""#).unwrap();
        let view = sampled(&body, 100, body.len() - nested_at + 1);
        assert_eq!(top_level_model(&view), None);
    }

    #[test]
    fn model_names_are_decoded_and_capped() {
        let model_of = |value: &str| top_level_model(&whole(&format!(r#"{{"model":{value}}}"#)));
        assert_eq!(model_of(r#""gpt\/4""#).as_deref(), Some("gpt/4"));
        assert_eq!(model_of(r#""caf\u00e9""#).as_deref(), Some("café"));
        assert_eq!(model_of(r#""a\\b\"c""#).as_deref(), Some("a\\b\"c"));
        assert_eq!(model_of(r#""bad\nescape""#), None);
        assert_eq!(model_of(r#""\ud800""#), None);
        assert_eq!(model_of(r#""""#), None);
        assert_eq!(model_of("null"), None);
        assert_eq!(model_of("5"), None);
        let longest = "m".repeat(MODEL_NAME_CAP);
        assert_eq!(model_of(&format!(r#""{longest}""#)), Some(longest.clone()));
        assert_eq!(model_of(&format!(r#""{longest}m""#)), None);
        assert_eq!(top_level_model(&whole(&format!("[\"{longest}\"]"))), None);
    }

    #[test]
    fn counts_that_are_no_u64_integers_are_none() {
        let input_of = |value: &str| {
            usage(&whole(&format!(
                r#"{{"usage":{{"input_tokens":{value},"output_tokens":3}}}}"#
            )))
        };
        assert_eq!(input_of("0"), counts(Some(0), Some(3)));
        assert_eq!(
            input_of("18446744073709551615"),
            counts(Some(u64::MAX), Some(3))
        );
        for value in [
            "18446744073709551616",
            "1.0",
            "1e3",
            "-1",
            "012",
            r#""12""#,
            "null",
            "{}",
        ] {
            assert_eq!(input_of(value), counts(None, Some(3)), "{value}");
        }
    }

    #[test]
    fn a_prefix_cut_inside_the_usage_keeps_the_counts_it_shows_whole() {
        let body = r#"{"model":"m","usage":{"input_tokens":123,"output_tokens":45}}"#;
        let cut = |len: usize| BodyView {
            prefix: &body.as_bytes()[..len],
            complete: false,
            tail: None,
        };
        let after_input = body.find(",\"output").unwrap();
        // "123" might go on: only the comma ends it.
        assert_eq!(usage(&cut(after_input)), TokenUsage::default());
        assert_eq!(usage(&cut(after_input + 1)), counts(Some(123), None));
        assert_eq!(usage(&cut(body.len() - 2)), counts(Some(123), None));
        assert_eq!(usage(&cut(body.len() - 1)), counts(Some(123), Some(45)));
    }

    #[test]
    fn usage_null_gives_no_counts() {
        assert_eq!(usage(&whole(r#"{"usage":null}"#)), TokenUsage::default());
        let view = sampled(r#"{"id":"x","usage":null,"user":null}"#, 3, 30);
        assert_eq!(usage(&view), TokenUsage::default());
        let stream = "data: {\"choices\":[],\"usage\":null}\n\ndata: [DONE]\n\n";
        assert_eq!(usage(&whole(stream)), TokenUsage::default());
    }

    #[test]
    fn a_streams_model_is_the_one_its_first_events_name() {
        for (stream, model) in [
            (RESPONSES_SSE, "gpt-x"),
            (CHAT_SSE, "gpt-4o-mini"),
            (MESSAGES_SSE, "claude-x"),
        ] {
            assert_eq!(top_level_model(&whole(stream)).as_deref(), Some(model));
            // Only the prefix's whole lines count: one cut inside the first event decides
            // nothing.
            let cut = &stream.as_bytes()[..stream.find("model").unwrap() + 4];
            let view = BodyView {
                prefix: cut,
                complete: false,
                tail: None,
            };
            assert_eq!(top_level_model(&view), None, "{stream}");
        }
    }

    #[test]
    fn a_responses_stream_counts_the_usage_of_response_completed() {
        assert_eq!(usage(&whole(RESPONSES_SSE)), counts(Some(11), Some(22)));
        let tail_only = tail_from(RESPONSES_SSE, "\nevent: response.completed");
        assert_eq!(usage(&tail_only), counts(Some(11), Some(22)));
        // Its data line cut at the tail's start: the usage of the `response` that ends it is
        // still read, backward from the event's end.
        let cut_event = tail_from(RESPONSES_SSE, r#""sequence_number":9"#);
        assert_eq!(usage(&cut_event), counts(Some(11), Some(22)));
        assert_eq!(
            top_level_model(&whole(RESPONSES_SSE)).as_deref(),
            Some("gpt-x")
        );
    }

    #[test]
    fn a_chat_completions_stream_counts_its_final_usage_chunk() {
        assert_eq!(usage(&whole(CHAT_SSE)), counts(Some(9), Some(12)));
        let tail_only = tail_from(
            CHAT_SSE,
            "\ndata: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o-mini\",\"choices\":[],",
        );
        assert_eq!(usage(&tail_only), counts(Some(9), Some(12)));
        let crlf = CHAT_SSE.replace('\n', "\r\n");
        assert_eq!(usage(&whole(&crlf)), counts(Some(9), Some(12)));
    }

    #[test]
    fn a_messages_stream_takes_input_from_message_start_and_output_from_message_delta() {
        assert_eq!(usage(&whole(MESSAGES_SSE)), counts(Some(25), Some(15)));
        // Cut before `message_delta`: message_start's output count is a placeholder.
        let before_delta = MESSAGES_SSE.find("event: message_delta").unwrap();
        let view = BodyView {
            prefix: &MESSAGES_SSE.as_bytes()[..before_delta],
            complete: false,
            tail: None,
        };
        assert_eq!(usage(&view), counts(Some(25), None));
        let tail_only = tail_from(MESSAGES_SSE, "\nevent: message_delta");
        assert_eq!(usage(&tail_only), counts(None, Some(15)));
    }

    /// The property every sample must keep: each fact is the whole body's or `None`.
    fn assert_every_cut_is_right_or_undecided(body: &str) {
        let truth_model = top_level_model(&whole(body));
        let truth_usage = usage(&whole(body));
        // Every prefix with every 16th tail (or none) and every tail with every 16th prefix:
        // all pairs take a debug build half a minute.
        let every_16th = || (0..=body.len()).step_by(16).chain([body.len()]);
        let pairs = (0..=body.len()).flat_map(|len| {
            let with_tails = every_16th().map(Some).chain([None]);
            let with_prefixes = every_16th().map(move |prefix_len| (prefix_len, Some(len)));
            with_tails
                .map(move |tail_len| (len, tail_len))
                .chain(with_prefixes)
        });
        let mut decided_from_a_part = 0;
        for (prefix_len, tail_len) in pairs {
            let view = BodyView {
                tail: tail_len.and_then(|len| sampled(body, prefix_len, len).tail),
                ..sampled(body, prefix_len, 0)
            };
            let model = top_level_model(&view);
            assert!(
                model.is_none() || model == truth_model,
                "{prefix_len} {tail_len:?}"
            );
            let found = usage(&view);
            let decides = model.is_some() || found != TokenUsage::default();
            decided_from_a_part += usize::from(!view.complete && decides);
            for (count, truth) in [
                (found.input_tokens, truth_usage.input_tokens),
                (found.output_tokens, truth_usage.output_tokens),
            ] {
                let fine = count.is_none() || count == truth;
                assert!(fine, "{prefix_len} {tail_len:?}: {found:?}");
            }
        }
        // The cuts are no vacuous test: many of them still decide something.
        assert!(decided_from_a_part > body.len(), "{decided_from_a_part}");
    }

    #[test]
    fn every_cut_of_a_valid_body_gives_the_right_answer_or_none() {
        for body in [
            RESPONSES_JSON,
            CHAT_JSON,
            REQUEST_WITH_TOOLS,
            NESTED_USAGE_JSON,
            RESPONSES_SSE,
            CHAT_SSE,
            MESSAGES_SSE,
        ] {
            assert_ne!(
                (top_level_model(&whole(body)), usage(&whole(body))),
                (None, TokenUsage::default()),
                "{body}"
            );
            assert_every_cut_is_right_or_undecided(body);
        }
    }

    #[test]
    fn garbage_never_panics() {
        const ALPHABET: &[u8] = b"{}[]\":,\\ \n\r0123456789-.eunull:data:usage model input_tokens";
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..2000 {
            let len = (next() % 200) as usize;
            let mut bytes: Vec<u8> = (0..len)
                .map(|_| ALPHABET[(next() % ALPHABET.len() as u64) as usize])
                .collect();
            if next() % 2 == 0 {
                bytes.insert(0, b'{');
            }
            let split = (next() as usize) % (bytes.len() + 1);
            for view in [
                BodyView {
                    prefix: &bytes,
                    complete: true,
                    tail: None,
                },
                BodyView {
                    prefix: &bytes[..split],
                    complete: false,
                    tail: Some(&bytes[split..]),
                },
                BodyView {
                    prefix: &bytes[..split],
                    complete: false,
                    tail: Some(&bytes),
                },
            ] {
                let _ = top_level_model(&view);
                let _ = usage(&view);
            }
        }
    }
}
