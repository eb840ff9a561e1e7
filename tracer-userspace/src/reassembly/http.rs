//! Incremental HTTP/1.x reassembly of one direction of one connection.
//!
//! The kernel sends the first bytes of each message (its head and the start of its body) and,
//! past the capture budget, only the length of each transfer and its last few bytes. So the
//! stream this module sees is made of *captured* bytes and *gaps* of known length. Heads are
//! parsed with `httparse`; bodies are followed by `Content-Length`, by chunked framing while it
//! is visible, and by the tail bytes (`0\r\n\r\n`) once it is not.

use thiserror::Error;

use crate::model::evidence::{
    MAX_TOKENS_PER_REQUEST, SESSION_TOKEN_HEADER, Token, session_cookies, session_header_token,
};
use crate::model::exchange::{RequestHead, ResponseHead, StreamTimes};

/// Longest message head the parser buffers per direction of a connection; a longer one is
/// reported as oversized (its captured lines still name the request). uvicorn's h11 refuses
/// heads past 16 KiB too, so nothing a Gym server answers is cut; it bounds what a peer that
/// sends a head a few bytes at a time can make the agent hold.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
const MAX_HEADERS: usize = 64;

/// Which kind of message a stream carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamKind {
    Requests,
    Responses,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Head {
    Request(RequestHead),
    Response(ResponseHead),
}

/// What the parser reports, in stream order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MessageEvent {
    /// A head was parsed; `first_byte_ns` is when the message's first byte moved, and
    /// `first_byte_seq` its TCP sequence number when known (both ends of the connection see
    /// the same one).
    Head {
        head: Head,
        first_byte_ns: u64,
        first_byte_seq: Option<u32>,
    },
    /// What was kept of the body of the message last reported by `Head` (see
    /// [`BodySample`]). Sent just before its `End`, for bodies with a `Content-Length`.
    Body(BodySample),
    /// The message that was last reported by `Head` ended; `last_byte_ns` is when its last
    /// byte moved. For a `text/event-stream` response that carried data, `stream` says when
    /// its data moved: a server writes the chunk that closes the stream after its last
    /// event, seconds later when its loop is saturated, and a client that has read the last
    /// event may close first, so the stream ends with its data (see [`MessageStream::close`]).
    End {
        last_byte_ns: u64,
        body_bytes: u64,
        stream: Option<StreamTimes>,
    },
}

/// Longest body prefix a stream keeps for a request it was asked about.
pub const MAX_BODY_PREFIX: usize = tracer_abi::MAX_CAPTURE_BYTES;

/// Bytes of every response body's start that are kept: room for the id a JSON response
/// starts with (see `model::evidence::response_id_token`).
pub const RESPONSE_PREFIX_BYTES: usize = 256;

/// Bytes of the start of a model call's response body that are kept: room for the `model`
/// among the fields before it (~230 bytes into an OpenAI Responses object).
pub const MODEL_RESPONSE_PREFIX_BYTES: usize = 1024;

/// Bytes of a body's end that are kept, for every request body and a model call's response:
/// Gym's `_ng_*` rollout fields are the last members of its bodies, past any head capture
/// (CAUSALITY.md: 11 KB `/run` bodies), and a model's `usage` ends its response.
pub const REQUEST_TAIL_BYTES: usize = tracer_abi::TAIL_BYTES;

/// The parts of one body the tracer reads, then lets go of: its start (for requests a stream
/// was asked about, and for responses), and for requests its last bytes. Never exported.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BodySample {
    pub prefix: Vec<u8>,
    /// `prefix` is the whole body, so a field absent from it is absent from the body.
    pub complete: bool,
    /// The body's last bytes (at most [`REQUEST_TAIL_BYTES`]) when they were seen: captured,
    /// or the tail of the transfer that ended the body exactly.
    pub tail: Option<Vec<u8>>,
    /// The body is chunked: `prefix` and `tail` hold its framing too (see
    /// [`BodySample::unframed`]).
    pub chunked: bool,
}

impl BodySample {
    /// `prefix` and `tail` without the chunk framing at their edges: the first chunk's size
    /// line and the last chunk (`\r\n0\r\n\r\n`). Framing between chunks stays: a reader
    /// of JSON or events finds it between whole values or lines, where servers cut chunks.
    pub fn unframed(&self) -> (&[u8], Option<&[u8]>) {
        if !self.chunked {
            return (&self.prefix, self.tail.as_deref());
        }
        let prefix = match self.prefix.iter().position(|&b| b == b'\n') {
            Some(end)
                if self.prefix[..end]
                    .first()
                    .is_some_and(u8::is_ascii_hexdigit) =>
            {
                &self.prefix[end + 1..]
            }
            _ => &self.prefix[..],
        };
        let tail = self.tail.as_deref().map(|tail| {
            tail.strip_suffix(b"\r\n0\r\n\r\n")
                .or_else(|| tail.strip_suffix(b"0\r\n\r\n"))
                .unwrap_or(tail)
        });
        (prefix, tail)
    }
}

/// Which requests' bodies a stream keeps a prefix of (most bodies are never looked at, and
/// keeping them would cost memory for nothing).
pub type WantsBody = fn(&RequestHead) -> bool;

/// A body sample being collected.
#[derive(Debug)]
struct BodyCollector {
    prefix: Vec<u8>,
    prefix_limit: usize,
    /// Body bytes that moved but are not in `prefix` (beyond the capture or the limit).
    missed: bool,
    /// The last bytes seen, while they are the body's last bytes so far; `None` after a gap
    /// (bytes that moved uncaptured) until a transfer's tail ends the body.
    tail: Option<Vec<u8>>,
    keeps_tail: bool,
    chunked: bool,
}

impl BodyCollector {
    fn new(prefix_limit: usize, keeps_tail: bool) -> Self {
        Self {
            prefix: Vec::new(),
            prefix_limit,
            missed: false,
            tail: keeps_tail.then(Vec::new),
            keeps_tail,
            chunked: false,
        }
    }

    fn framed_by(mut self, body: Option<Body>) -> Self {
        self.chunked = matches!(body, Some(Body::Chunked(_)));
        self
    }

    fn take(&mut self, bytes: &[u8]) {
        let room = self.prefix_limit - self.prefix.len();
        self.prefix
            .extend_from_slice(&bytes[..bytes.len().min(room)]);
        self.missed |= bytes.len() > room;
        if let Some(tail) = &mut self.tail {
            // Only the last bytes can stay: a whole capture copied in and cut down again was
            // most of a body's cost.
            tail.extend_from_slice(&bytes[bytes.len().saturating_sub(REQUEST_TAIL_BYTES)..]);
            let excess = tail.len().saturating_sub(REQUEST_TAIL_BYTES);
            tail.drain(..excess);
        }
    }

    /// `gap` body bytes moved uncaptured, in a transfer whose last bytes are `tail` (`None`
    /// when the body ended inside the transfer: its last bytes are another message's). A
    /// tail that covers the whole gap continues the bytes kept so far (a short last read
    /// after a long one still shows the body's end whole); a shorter one starts afresh.
    fn skip(&mut self, gap: u64, tail: Option<&[u8]>) {
        self.missed = true;
        if !self.keeps_tail {
            return;
        }
        self.tail = match (tail, self.tail.take()) {
            (Some(tail), Some(mut kept)) if tail.len() as u64 >= gap => {
                // `gap` fits in `tail.len()`, a usize.
                kept.extend_from_slice(&tail[tail.len() - gap as usize..]);
                let excess = kept.len().saturating_sub(REQUEST_TAIL_BYTES);
                kept.drain(..excess);
                Some(kept)
            }
            (Some(tail), _) if !tail.is_empty() => Some(tail.to_vec()),
            _ => None,
        };
    }

    fn heap_bytes(&self) -> usize {
        self.prefix.capacity() + self.tail.as_ref().map_or(0, Vec::capacity)
    }

    fn finish(self, body_bytes: u64) -> BodySample {
        BodySample {
            complete: !self.missed && self.prefix.len() as u64 == body_bytes,
            prefix: self.prefix,
            tail: self.tail.filter(|tail| !tail.is_empty()),
            chunked: self.chunked,
        }
    }
}

/// Why bytes could not be followed; each is counted by the caller.
#[derive(Clone, Copy, Debug, Error, PartialEq, Eq)]
pub enum ParseError {
    #[error("bytes that are not HTTP/1.x")]
    NotHttp,
    #[error("a message head larger than the parser's limit")]
    HeadTooLarge,
    #[error("a message start that was not captured")]
    UncapturedStart,
    #[error("a chunked body whose framing was lost")]
    LostChunkFraming,
}

/// How the body of the current message ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Body {
    Length(u64),
    Chunked(Chunked),
    /// Chunk framing was lost; the message ends at a transfer whose last bytes are
    /// `0\r\n\r\n`.
    ChunkedBlind,
    /// A response without length: it ends when the connection closes.
    UntilClose,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Chunked {
    /// Reading the hex size line; value so far and whether an extension (`;...`) started.
    Size {
        value: u64,
        digits: u8,
        in_extension: bool,
    },
    /// Reading chunk data; bytes left in this chunk.
    Data(u64),
    /// Expecting the CRLF after chunk data; `seen_cr`.
    DataEnd { seen_cr: bool },
    /// After the last chunk: trailer lines until an empty line. `line_len` of the current
    /// line, `seen_cr`.
    Trailer { line_len: u32, seen_cr: bool },
}

impl Chunked {
    const START: Chunked = Chunked::Size {
        value: 0,
        digits: 0,
        in_extension: false,
    };
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    /// Between messages.
    Idle,
    /// Collecting a head that started at `first_byte_ns`, at TCP sequence number
    /// `first_byte_seq` when known.
    Head {
        buffer: Vec<u8>,
        first_byte_ns: u64,
        first_byte_seq: Option<u32>,
    },
    /// Inside a body; `events` for a `text/event-stream` response.
    Body {
        body: Body,
        bytes: u64,
        events: Option<EventStream>,
    },
    /// Lost track of framing; waiting for a transfer that starts a new message.
    Desynced,
}

/// What the parser follows of an event stream's body: when its data (not its chunk framing)
/// moved, once some has.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct EventStream {
    data: Option<StreamTimes>,
}

impl EventStream {
    fn data_moved(&mut self, timestamp_ns: u64) {
        let first_data_ns = self.data.map_or(timestamp_ns, |data| data.first_data_ns);
        self.data = Some(StreamTimes {
            first_data_ns,
            last_data_ns: timestamp_ns,
        });
    }
}

/// Where in a stream some bytes are: when they moved, and their TCP sequence number.
#[derive(Clone, Copy, Debug)]
struct Position {
    timestamp_ns: u64,
    seq: Option<u32>,
}

/// What the response parser needs to know about the request it answers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestContext {
    /// HEAD requests get responses without bodies.
    pub is_head: bool,
    /// The request is a model call: its response's start and end are kept, whatever its
    /// framing (a streamed response is chunked or ends at close).
    pub keeps_body: bool,
}

/// One read or write as the parser sees it: `captured` is its first bytes, `total_len` what
/// the syscall moved, `tail` its last bytes when not all of it was captured.
#[derive(Clone, Copy, Debug)]
pub struct Transfer<'a> {
    pub captured: &'a [u8],
    pub total_len: u64,
    pub tail: &'a [u8],
    pub timestamp_ns: u64,
    /// The TCP sequence number of `captured`'s first byte, when the kernel read it.
    pub seq: Option<u32>,
}

/// One direction of one connection.
#[derive(Debug)]
pub struct MessageStream {
    kind: StreamKind,
    state: State,
    wants_body: Option<WantsBody>,
    /// Boxed: every connection holds two streams, few of them mid-body.
    sample: Option<Box<BodyCollector>>,
    /// The message being read is a final (non-1xx) response: its end answers a request.
    final_response: bool,
    /// Final responses ended during the current [`feed`](Self::feed): a head parsed now
    /// answers the request after the ones they answered.
    answered_in_feed: usize,
}

impl MessageStream {
    pub fn new(kind: StreamKind) -> Self {
        Self {
            kind,
            state: State::Idle,
            wants_body: None,
            sample: None,
            final_response: false,
            answered_in_feed: 0,
        }
    }

    /// A request stream that keeps the [`BodySample::prefix`] of requests `wants_body` accepts.
    pub fn keeping_bodies(wants_body: WantsBody) -> Self {
        Self {
            wants_body: Some(wants_body),
            ..Self::new(StreamKind::Requests)
        }
    }

    /// True when no message is partly seen: a close now loses nothing.
    #[cfg(test)]
    pub fn is_idle(&self) -> bool {
        matches!(self.state, State::Idle | State::Desynced)
    }

    /// Bytes it holds on the heap: a head being collected and a body prefix being kept.
    pub fn buffered_bytes(&self) -> usize {
        let head = match &self.state {
            State::Head { buffer, .. } => buffer.capacity(),
            _ => 0,
        };
        head + self.sample.as_ref().map_or(0, |sample| sample.heap_bytes())
    }

    /// Feeds one transfer. `request(n)` is consulted when a response head is parsed (HEAD
    /// requests have no response body): the head answers the `n`-th request (from 0) that was
    /// unanswered when this call began, as one write can carry several pipelined responses.
    pub fn feed(
        &mut self,
        transfer: Transfer<'_>,
        request: impl Fn(usize) -> RequestContext,
        out: &mut Vec<MessageEvent>,
        errors: &mut Vec<ParseError>,
    ) {
        let Transfer {
            captured,
            total_len,
            tail,
            timestamp_ns,
            seq,
        } = transfer;
        let captured = &captured[..captured.len().min(total_len as usize)];
        self.answered_in_feed = 0;
        if matches!(self.state, State::Desynced) {
            if captured.is_empty() || !looks_like_message_start(self.kind, captured) {
                return;
            }
            self.state = State::Idle;
        }
        let mut rest = captured;
        while !rest.is_empty() {
            // A message may start anywhere in a transfer (pipelined requests share a read).
            let at = (captured.len() - rest.len()) as u32;
            let position = Position {
                timestamp_ns,
                seq: seq.map(|seq| seq.wrapping_add(at)),
            };
            let used = self.consume(rest, position, &request, out, errors);
            rest = &rest[used..];
            if matches!(self.state, State::Desynced) {
                return;
            }
        }
        let gap = total_len - captured.len() as u64;
        if gap > 0 {
            self.skip(gap, tail, timestamp_ns, out, errors);
        }
    }

    /// The connection closed: a body that runs until close ends here, and so does an event
    /// stream that carried data, whatever its framing: a client closes once it has read the
    /// last event it wants (the Codex CLI, at `response.completed`), before the chunk that
    /// would close the stream.
    pub fn close(&mut self, timestamp_ns: u64, out: &mut Vec<MessageEvent>) {
        if let State::Body {
            body,
            bytes,
            events,
        } = self.state
        {
            let stream = events.and_then(|events| events.data);
            if body == Body::UntilClose || stream.is_some() {
                self.end_message(timestamp_ns, bytes, stream, out);
            }
        }
        self.state = State::Idle;
    }

    /// Reports the end of the current message, preceded by its body prefix if one was kept.
    fn end_message(
        &mut self,
        last_byte_ns: u64,
        body_bytes: u64,
        stream: Option<StreamTimes>,
        out: &mut Vec<MessageEvent>,
    ) {
        if std::mem::take(&mut self.final_response) {
            self.answered_in_feed += 1;
        }
        if let Some(sample) = self.sample.take() {
            out.push(MessageEvent::Body((*sample).finish(body_bytes)));
        }
        out.push(MessageEvent::End {
            last_byte_ns,
            body_bytes,
            stream,
        });
    }

    /// Consumes a prefix of `bytes`, which start at `position`; returns how many bytes were
    /// used (at least one).
    fn consume(
        &mut self,
        bytes: &[u8],
        position: Position,
        request: &impl Fn(usize) -> RequestContext,
        out: &mut Vec<MessageEvent>,
        errors: &mut Vec<ParseError>,
    ) -> usize {
        let timestamp_ns = position.timestamp_ns;
        match &mut self.state {
            State::Idle => {
                if !could_start_message(self.kind, bytes) {
                    errors.push(ParseError::NotHttp);
                    self.state = State::Desynced;
                    return bytes.len();
                }
                self.state = State::Head {
                    buffer: Vec::new(),
                    first_byte_ns: timestamp_ns,
                    first_byte_seq: position.seq,
                };
                0
            }
            State::Head {
                buffer,
                first_byte_ns,
                first_byte_seq,
            } => {
                let first_byte_ns = *first_byte_ns;
                let first_byte_seq = *first_byte_seq;
                let before = buffer.len();
                let take = bytes.len().min(MAX_HEAD_BYTES + 1 - before);
                buffer.extend_from_slice(&bytes[..take]);
                // A head ends at a line feed: a later piece without one cannot complete it,
                // and re-parsing the whole buffer for every small read of a long head would
                // cost time quadratic in its length (with at most MAX_HEADERS lines, the
                // parses per head are bounded). The first piece is always parsed, so that
                // garbage is recognised at once.
                let parse = if before == 0 || bytes[..take].contains(&b'\n') {
                    parse_head(self.kind, buffer)
                } else {
                    HeadParse::Partial
                };
                match parse {
                    HeadParse::Complete(head, head_len, framing) => {
                        let used = head_len - before;
                        let events = matches!(head, Head::Response(_)) && framing.event_stream;
                        let body = match &head {
                            Head::Request(request_head) => {
                                let body = framing.body();
                                let wanted =
                                    self.wants_body.is_some_and(|wants| wants(request_head));
                                let prefix_limit = if wanted { MAX_BODY_PREFIX } else { 0 };
                                self.sample =
                                    (sampled(body) || (wanted && body.is_some())).then(|| {
                                        Box::new(
                                            BodyCollector::new(prefix_limit, true).framed_by(body),
                                        )
                                    });
                                body
                            }
                            Head::Response(response_head) => {
                                self.final_response = response_head.status >= 200;
                                let answered = request(self.answered_in_feed);
                                let body = response_body(response_head, answered, framing);
                                let keeps = answered.keeps_body && self.final_response;
                                self.sample =
                                    (sampled(body) || (keeps && body.is_some())).then(|| {
                                        Box::new(
                                            if keeps {
                                                BodyCollector::new(
                                                    MODEL_RESPONSE_PREFIX_BYTES,
                                                    true,
                                                )
                                            } else {
                                                BodyCollector::new(RESPONSE_PREFIX_BYTES, false)
                                            }
                                            .framed_by(body),
                                        )
                                    });
                                body
                            }
                        };
                        out.push(MessageEvent::Head {
                            head,
                            first_byte_ns,
                            first_byte_seq,
                        });
                        self.start_body(body, events, timestamp_ns, out);
                        used
                    }
                    HeadParse::Partial if buffer.len() > MAX_HEAD_BYTES => {
                        // As for a head longer than the capture: its complete lines still
                        // name the request, and its response pairs with it.
                        report_truncated_head(
                            self.kind,
                            buffer,
                            first_byte_ns,
                            timestamp_ns,
                            out,
                            errors,
                        );
                        self.state = State::Desynced;
                        bytes.len()
                    }
                    HeadParse::Partial => take,
                    HeadParse::Invalid => {
                        errors.push(ParseError::NotHttp);
                        self.state = State::Desynced;
                        bytes.len()
                    }
                }
            }
            State::Body { .. } => self.consume_body(bytes, timestamp_ns, out, errors),
            State::Desynced => bytes.len(),
        }
    }

    /// Consumes body bytes, which moved at `timestamp_ns`; returns how many were used.
    fn consume_body(
        &mut self,
        bytes: &[u8],
        timestamp_ns: u64,
        out: &mut Vec<MessageEvent>,
        errors: &mut Vec<ParseError>,
    ) -> usize {
        let State::Body {
            body,
            bytes: count,
            events,
        } = &mut self.state
        else {
            unreachable!("called in a body")
        };
        let was_framed = matches!(body, Body::Chunked(_));
        let Advance {
            used,
            done,
            carried_data,
        } = advance_body(body, bytes);
        let blind = matches!(body, Body::ChunkedBlind);
        if was_framed && blind {
            // Bytes that are not chunk framing: the end is now a guess (the tail
            // of a transfer), so the loss of framing is counted.
            errors.push(ParseError::LostChunkFraming);
        }
        if let Some(events) = events
            && carried_data
        {
            events.data_moved(timestamp_ns);
        }
        *count += used as u64;
        if let Some(sample) = &mut self.sample {
            sample.take(&bytes[..used]);
        }
        let stream = events.and_then(|events| events.data);
        if done {
            let body_bytes = *count;
            self.state = State::Idle;
            self.end_message(timestamp_ns, body_bytes, stream, out);
        } else if blind {
            // Framing was lost earlier; whatever arrives is body until the tail
            // says otherwise.
            if bytes.ends_with(b"0\r\n\r\n") {
                let body_bytes = *count;
                self.state = State::Idle;
                self.end_message(timestamp_ns, body_bytes, stream, out);
            }
            return bytes.len();
        }
        used
    }

    fn start_body(
        &mut self,
        body: Option<Body>,
        event_stream: bool,
        timestamp_ns: u64,
        out: &mut Vec<MessageEvent>,
    ) {
        match body {
            None | Some(Body::Length(0)) => {
                self.state = State::Idle;
                self.end_message(timestamp_ns, 0, None, out);
            }
            Some(body) => {
                self.state = State::Body {
                    body,
                    bytes: 0,
                    events: event_stream.then(EventStream::default),
                }
            }
        }
    }

    /// Bytes that moved but were not captured.
    fn skip(
        &mut self,
        gap: u64,
        tail: &[u8],
        timestamp_ns: u64,
        out: &mut Vec<MessageEvent>,
        errors: &mut Vec<ParseError>,
    ) {
        match &mut self.state {
            State::Idle => {
                errors.push(ParseError::UncapturedStart);
                self.state = State::Desynced;
            }
            State::Head { .. } => {
                // The head is longer than the capture budget. Report what was captured: the
                // request line and the first headers are still worth a span.
                let State::Head {
                    buffer,
                    first_byte_ns,
                    ..
                } = std::mem::replace(&mut self.state, State::Desynced)
                else {
                    unreachable!()
                };
                report_truncated_head(self.kind, &buffer, first_byte_ns, timestamp_ns, out, errors);
            }
            State::Body {
                body,
                bytes,
                events,
            } => {
                *bytes += gap;
                // Uncaptured bytes are data unless the tail shows them all to be chunk
                // framing: past a message's capture budget, the chunk that closes a stream
                // comes as a gap of five bytes.
                let framing_alone = matches!(body, Body::Chunked(_) | Body::ChunkedBlind)
                    && usize::try_from(gap)
                        .ok()
                        .and_then(|gap| tail.get(tail.len().checked_sub(gap)?..))
                        .is_some_and(is_chunk_framing);
                if let Some(events) = events
                    && !framing_alone
                {
                    events.data_moved(timestamp_ns);
                }
                let stream = events.and_then(|events| events.data);
                if let Some(sample) = &mut self.sample {
                    // Without a length the gap is all body (a chunked body's end is known only
                    // from a transfer's tail), so the transfer's tail is the body's so far.
                    let within = match body {
                        Body::Length(remaining) => gap <= *remaining,
                        Body::Chunked(_) | Body::ChunkedBlind | Body::UntilClose => true,
                    };
                    sample.skip(gap, within.then_some(tail));
                }
                match body {
                    Body::Length(remaining) => {
                        if gap < *remaining {
                            *remaining -= gap;
                        } else {
                            let overshoot = gap - *remaining;
                            let body_bytes = *bytes - overshoot;
                            self.state = if overshoot > 0 {
                                errors.push(ParseError::UncapturedStart);
                                State::Desynced
                            } else {
                                State::Idle
                            };
                            self.end_message(timestamp_ns, body_bytes, stream, out);
                        }
                    }
                    Body::Chunked(_) | Body::ChunkedBlind => {
                        if tail.ends_with(b"0\r\n\r\n") {
                            let body_bytes = *bytes;
                            self.state = State::Idle;
                            self.end_message(timestamp_ns, body_bytes, stream, out);
                        } else {
                            if matches!(body, Body::Chunked(_)) && tail.is_empty() {
                                errors.push(ParseError::LostChunkFraming);
                            }
                            *body = Body::ChunkedBlind;
                        }
                    }
                    Body::UntilClose => {}
                }
            }
            State::Desynced => {}
        }
    }
}

/// The kernel resets its capture budget on the same tokens, so a transfer that begins with
/// one of them carries the new message's head.
fn looks_like_message_start(kind: StreamKind, bytes: &[u8]) -> bool {
    match kind {
        StreamKind::Responses => bytes.starts_with(b"HTTP/1."),
        StreamKind::Requests => {
            const METHODS: [&[u8]; 9] = [
                b"GET ",
                b"POST ",
                b"PUT ",
                b"HEAD ",
                b"DELETE ",
                b"PATCH ",
                b"OPTIONS ",
                b"CONNECT ",
                b"TRACE ",
            ];
            METHODS
                .iter()
                .any(|method| bytes.starts_with(method) || method.starts_with(bytes))
        }
    }
}

/// A cheaper test than a full parse, tolerant of a head split after a few bytes.
fn could_start_message(kind: StreamKind, bytes: &[u8]) -> bool {
    match kind {
        StreamKind::Responses => {
            let n = bytes.len().min(5);
            bytes[..n] == b"HTTP/"[..n]
        }
        StreamKind::Requests => bytes[0].is_ascii_uppercase(),
    }
}

/// Body framing a head declares (RFC 9112 §6.3), read in the same parse as the head.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Framing {
    content_length: Option<u64>,
    chunked: bool,
    /// `Content-Type: text/event-stream`: server-sent events.
    event_stream: bool,
}

impl Framing {
    fn of(headers: &[httparse::Header<'_>]) -> Self {
        let mut framing = Framing::default();
        // Names first: only three of a head's headers are read, so only theirs are decoded.
        for header in headers {
            if header.name.eq_ignore_ascii_case("transfer-encoding") {
                let value = header.value.trim_ascii_end();
                framing.chunked =
                    value.len() >= 7 && value[value.len() - 7..].eq_ignore_ascii_case(b"chunked");
            } else if header.name.eq_ignore_ascii_case("content-type") {
                const EVENT_STREAM: &[u8] = b"text/event-stream";
                framing.event_stream = header
                    .value
                    .trim_ascii_start()
                    .get(..EVENT_STREAM.len())
                    .is_some_and(|media| media.eq_ignore_ascii_case(EVENT_STREAM));
            } else if header.name.eq_ignore_ascii_case("content-length") {
                framing.content_length = std::str::from_utf8(header.value.trim_ascii())
                    .ok()
                    .and_then(|value| value.parse().ok());
            }
        }
        framing
    }

    /// The body this framing declares; `None` when it declares none.
    fn body(self) -> Option<Body> {
        match (self.content_length, self.chunked) {
            (_, true) => Some(Body::Chunked(Chunked::START)),
            (Some(length), false) => Some(Body::Length(length)),
            (None, false) => None,
        }
    }
}

enum HeadParse {
    Complete(Head, usize, Framing),
    Partial,
    Invalid,
}

fn parse_head(kind: StreamKind, buffer: &[u8]) -> HeadParse {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    match kind {
        StreamKind::Requests => {
            let mut request = httparse::Request::new(&mut headers);
            match request.parse(buffer) {
                Ok(httparse::Status::Complete(len)) => {
                    let head = request_head(
                        request.method.unwrap_or(""),
                        request.path.unwrap_or(""),
                        request.version.unwrap_or(1),
                        request.headers,
                        false,
                    );
                    HeadParse::Complete(Head::Request(head), len, Framing::of(request.headers))
                }
                Ok(httparse::Status::Partial) => HeadParse::Partial,
                Err(httparse::Error::TooManyHeaders) => HeadParse::Invalid,
                Err(_) => HeadParse::Invalid,
            }
        }
        StreamKind::Responses => {
            let mut response = httparse::Response::new(&mut headers);
            match response.parse(buffer) {
                Ok(httparse::Status::Complete(len)) => HeadParse::Complete(
                    Head::Response(ResponseHead {
                        status: response.code.unwrap_or(0),
                        version_minor: response.version.unwrap_or(1),
                        sessions_set: set_cookie_tokens(response.headers),
                    }),
                    len,
                    Framing::of(response.headers),
                ),
                Ok(httparse::Status::Partial) => HeadParse::Partial,
                Err(_) => HeadParse::Invalid,
            }
        }
    }
}

/// Parses the complete lines of a head that was cut off by the capture budget.
/// A head too long to keep (past the capture or past MAX_HEAD_BYTES) is counted, and its
/// complete lines are still reported: the request line and the first headers are worth a
/// span. The body framing is unknown, so the message ends where the next one starts.
fn report_truncated_head(
    kind: StreamKind,
    buffer: &[u8],
    first_byte_ns: u64,
    timestamp_ns: u64,
    out: &mut Vec<MessageEvent>,
    errors: &mut Vec<ParseError>,
) {
    errors.push(ParseError::HeadTooLarge);
    if let Some(head) = parse_truncated_head(kind, buffer) {
        out.push(MessageEvent::Head {
            head,
            first_byte_ns,
            first_byte_seq: None,
        });
        out.push(MessageEvent::End {
            last_byte_ns: timestamp_ns,
            body_bytes: 0,
            stream: None,
        });
    }
}

fn parse_truncated_head(kind: StreamKind, buffer: &[u8]) -> Option<Head> {
    let end = buffer.windows(2).rposition(|w| w == b"\r\n")?;
    let mut complete = buffer[..end + 2].to_vec();
    complete.extend_from_slice(b"\r\n");
    match parse_head(kind, &complete) {
        HeadParse::Complete(Head::Request(mut head), _, _) => {
            head.truncated = true;
            Some(Head::Request(head))
        }
        HeadParse::Complete(head, _, _) => Some(head),
        _ => None,
    }
}

fn request_head(
    method: &str,
    target: &str,
    version_minor: u8,
    headers: &[httparse::Header<'_>],
    truncated: bool,
) -> RequestHead {
    let path = target.split(['?', '#']).next().unwrap_or("").to_string();
    // One pass over the headers; the first of each name counts, as for any header read.
    let (mut host, mut user_agent, mut traceparent, mut expect) = (None, None, None, None);
    let mut session_tokens = Vec::new();
    for header in headers {
        let slot = match header.name.len() {
            4 if header.name.eq_ignore_ascii_case("host") => &mut host,
            10 if header.name.eq_ignore_ascii_case("user-agent") => &mut user_agent,
            11 if header.name.eq_ignore_ascii_case("traceparent") => &mut traceparent,
            6 if header.name.eq_ignore_ascii_case("expect") => &mut expect,
            6 if header.name.eq_ignore_ascii_case("cookie") => {
                let room = MAX_TOKENS_PER_REQUEST.saturating_sub(session_tokens.len());
                session_tokens.extend(session_cookies(header.value).take(room));
                continue;
            }
            24 if header.name.eq_ignore_ascii_case(SESSION_TOKEN_HEADER) => {
                if session_tokens.len() < MAX_TOKENS_PER_REQUEST {
                    session_tokens.extend(session_header_token(header.value));
                }
                continue;
            }
            _ => continue,
        };
        if slot.is_none() {
            *slot = Some(header.value);
        }
    }
    let text = |value: Option<&[u8]>| {
        value
            .and_then(|v| std::str::from_utf8(v).ok())
            .map(|v| v.trim().to_string())
    };
    let expects_continue = expect
        .and_then(|v| std::str::from_utf8(v).ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("100-continue"));
    RequestHead {
        method: method.to_string(),
        path,
        version_minor,
        host: text(host),
        user_agent: text(user_agent),
        traceparent: text(traceparent),
        expects_continue,
        session_tokens,
        truncated,
    }
}

/// The session token of each `Set-Cookie` header that sets a signed session cookie
/// (Starlette's `payload.timestamp.signature`, which Gym's servers use): its `name=value`
/// without the attributes after the first `;`, named as the same cookie is in a request
/// ([`cookie_tokens`]). An unsigned cookie (a flag, a constant) names no session.
fn set_cookie_tokens(headers: &[httparse::Header<'_>]) -> Vec<Token> {
    headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("set-cookie"))
        .filter_map(|h| h.value.split(|&b| b == b';').next())
        .filter(|pair| {
            let value = memchr::memchr(b'=', pair).map_or(&[][..], |eq| &pair[eq + 1..]);
            memchr::memchr_iter(b'.', value).nth(1).is_some()
        })
        .flat_map(session_cookies)
        .take(MAX_TOKENS_PER_REQUEST)
        .collect()
}

/// Only `Content-Length` bodies are sampled: a chunked body's bytes hold framing, not the
/// document.
fn sampled(body: Option<Body>) -> bool {
    matches!(body, Some(Body::Length(n)) if n > 0)
}

fn response_body(head: &ResponseHead, request: RequestContext, framing: Framing) -> Option<Body> {
    let bodiless = request.is_head
        || (100..200).contains(&head.status)
        || head.status == 204
        || head.status == 304;
    if bodiless {
        return None;
    }
    Some(framing.body().unwrap_or(Body::UntilClose))
}

/// What one step of a body over captured bytes did.
struct Advance {
    used: usize,
    /// The body ended within them.
    done: bool,
    /// Some of them were the body's data, not its chunk framing.
    carried_data: bool,
}

/// Advances a body over captured bytes.
fn advance_body(body: &mut Body, bytes: &[u8]) -> Advance {
    let all_data = |done| Advance {
        used: bytes.len(),
        done,
        carried_data: !bytes.is_empty(),
    };
    match body {
        Body::Length(remaining) => {
            let used = (*remaining).min(bytes.len() as u64);
            *remaining -= used;
            Advance {
                used: used as usize,
                done: *remaining == 0,
                carried_data: used > 0,
            }
        }
        Body::UntilClose => all_data(false),
        Body::ChunkedBlind => Advance {
            carried_data: !is_chunk_framing(bytes),
            ..all_data(false)
        },
        Body::Chunked(state) => {
            let mut used = 0;
            let mut carried_data = false;
            while used < bytes.len() {
                let byte = bytes[used];
                match state {
                    Chunked::Size {
                        value,
                        digits,
                        in_extension,
                    } => {
                        used += 1;
                        match byte {
                            b'\n' => {
                                *state = if *value == 0 {
                                    Chunked::Trailer {
                                        line_len: 0,
                                        seen_cr: false,
                                    }
                                } else {
                                    Chunked::Data(*value)
                                };
                            }
                            b'\r' => {}
                            b';' => *in_extension = true,
                            _ if *in_extension => {}
                            _ => match (byte as char).to_digit(16) {
                                Some(digit) if *digits < 16 => {
                                    *value = *value * 16 + digit as u64;
                                    *digits += 1;
                                }
                                // Not chunk framing: follow blind from here.
                                _ => {
                                    *body = Body::ChunkedBlind;
                                    return all_data(false);
                                }
                            },
                        }
                    }
                    Chunked::Data(remaining) => {
                        let take = (*remaining).min((bytes.len() - used) as u64);
                        *remaining -= take;
                        used += take as usize;
                        carried_data |= take > 0;
                        if *remaining == 0 {
                            *state = Chunked::DataEnd { seen_cr: false };
                        }
                    }
                    Chunked::DataEnd { seen_cr } => {
                        used += 1;
                        match byte {
                            b'\r' if !*seen_cr => *seen_cr = true,
                            b'\n' => *state = Chunked::START,
                            _ => {
                                *body = Body::ChunkedBlind;
                                return all_data(false);
                            }
                        }
                    }
                    Chunked::Trailer { line_len, seen_cr } => {
                        used += 1;
                        match byte {
                            b'\r' => *seen_cr = true,
                            b'\n' if *line_len == 0 => {
                                return Advance {
                                    used,
                                    done: true,
                                    carried_data,
                                };
                            }
                            b'\n' => {
                                *line_len = 0;
                                *seen_cr = false;
                            }
                            _ => *line_len += 1,
                        }
                    }
                }
            }
            Advance {
                used,
                done: false,
                carried_data,
            }
        }
    }
}

/// Bytes of a chunked body whose framing was lost that are framing alone, as a server writes
/// the end of a stream: the last chunk (`0\r\n\r\n`), after the line end of the chunk before.
fn is_chunk_framing(bytes: &[u8]) -> bool {
    let rest = bytes.strip_prefix(b"\r\n").unwrap_or(bytes);
    rest.is_empty() || rest == b"0\r\n\r\n"
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::evidence::cookie_tokens;

    /// The sessions a 200 response head with this `Set-Cookie` value opens.
    fn sessions_set_by(set_cookie: &str) -> Vec<Token> {
        let head =
            format!("HTTP/1.1 200 OK\r\nSet-Cookie: {set_cookie}\r\nContent-Length: 0\r\n\r\n");
        let HeadParse::Complete(Head::Response(response), _, _) =
            parse_head(StreamKind::Responses, head.as_bytes())
        else {
            panic!("a complete response head");
        };
        response.sessions_set
    }

    /// Starlette sets its session cookie with a new signature and attributes on every
    /// response; the request that sends it back names the same session.
    #[test]
    fn a_set_cookie_names_the_session_a_later_cookie_carries() {
        let signed = sessions_set_by(
            "session=eyJzZXNzaW9u.Z1x2.sigA; path=/; Max-Age=1209600; httponly; samesite=lax",
        );
        assert_eq!(signed, cookie_tokens(b"session=eyJzZXNzaW9u.Z1x3.sigB"));
        assert_eq!(signed.len(), 1);
        assert!(
            sessions_set_by("session=canary-5f1d7c-constant; Path=/").is_empty(),
            "an unsigned cookie names no session"
        );
    }

    /// A request's sessions: its session cookies and Gym's MCP session token header, in
    /// any case, as one list.
    #[test]
    fn a_request_names_its_cookies_and_its_session_token() {
        let head = b"POST /mcp HTTP/1.1\r\nCookie: session=eyJzZXNzaW9u.Z1x2.sigA\r\n\
            X-NeMo-Gym-Session-Token: eyJyb2xsb3V0IjoiMy0xIn0.c2ln\r\nContent-Length: 0\r\n\r\n";
        let HeadParse::Complete(Head::Request(request), _, _) =
            parse_head(StreamKind::Requests, head)
        else {
            panic!("a complete request head");
        };
        let mut want = cookie_tokens(b"session=eyJzZXNzaW9u.Z1x3.sigB");
        want.extend(session_header_token(b"eyJyb2xsb3V0IjoiMy0xIn0.c2ln"));
        assert_eq!(request.session_tokens, want);
    }

    fn t<'a>(
        captured: &'a [u8],
        total_len: u64,
        tail: &'a [u8],
        timestamp_ns: u64,
    ) -> Transfer<'a> {
        Transfer {
            captured,
            total_len,
            tail,
            timestamp_ns,
            seq: None,
        }
    }

    #[test]
    fn each_message_gets_the_sequence_number_of_its_first_byte() {
        let mut stream = MessageStream::new(StreamKind::Requests);
        let (mut out, mut errors) = (Vec::new(), Vec::new());
        let first = b"POST /a HTTP/1.1\r\nContent-Length: 2\r\n\r\nhiGET /b HTTP/1.1\r\nHo";
        let second = b"st: x\r\n\r\n";
        // Two pipelined requests in one read, the second's head cut by the read's end, at a
        // sequence number about to wrap.
        let start = u32::MAX - 10;
        for (bytes, seq) in [
            (&first[..], start),
            (&second[..], start.wrapping_add(first.len() as u32)),
        ] {
            let transfer = Transfer {
                seq: Some(seq),
                ..t(bytes, bytes.len() as u64, &[], 1)
            };
            stream.feed(
                transfer,
                |_| RequestContext::default(),
                &mut out,
                &mut errors,
            );
        }
        let seqs: Vec<Option<u32>> = out
            .iter()
            .filter_map(|event| match event {
                MessageEvent::Head { first_byte_seq, .. } => Some(*first_byte_seq),
                _ => None,
            })
            .collect();
        let second_start = first.iter().position(|&b| b == b'G').unwrap() as u32;
        assert_eq!(seqs, [Some(start), Some(start.wrapping_add(second_start))]);
        assert!(errors.is_empty(), "{errors:?}");
    }

    /// A stream plus what it reported, for tests that feed transfers one at a time.
    struct Recorder {
        stream: MessageStream,
        out: Vec<MessageEvent>,
        errors: Vec<ParseError>,
    }

    impl Recorder {
        fn new(kind: StreamKind) -> Self {
            Self {
                stream: MessageStream::new(kind),
                out: Vec::new(),
                errors: Vec::new(),
            }
        }

        fn feed(&mut self, captured: &[u8], total_len: u64, tail: &[u8], timestamp_ns: u64) {
            self.feed_answering(
                captured,
                total_len,
                tail,
                timestamp_ns,
                RequestContext::default(),
            );
        }

        fn feed_answering(
            &mut self,
            captured: &[u8],
            total_len: u64,
            tail: &[u8],
            timestamp_ns: u64,
            request: RequestContext,
        ) {
            let transfer = t(captured, total_len, tail, timestamp_ns);
            self.stream
                .feed(transfer, |_| request, &mut self.out, &mut self.errors);
        }
    }

    fn feed_all(
        stream: &mut MessageStream,
        chunks: &[&[u8]],
    ) -> (Vec<MessageEvent>, Vec<ParseError>) {
        let mut out = Vec::new();
        let mut errors = Vec::new();
        for (i, chunk) in chunks.iter().enumerate() {
            let transfer = t(chunk, chunk.len() as u64, &[], i as u64 + 1);
            stream.feed(
                transfer,
                |_| RequestContext::default(),
                &mut out,
                &mut errors,
            );
        }
        (out, errors)
    }

    fn heads(events: &[MessageEvent]) -> Vec<Head> {
        events
            .iter()
            .filter_map(|e| match e {
                MessageEvent::Head { head, .. } => Some(head.clone()),
                _ => None,
            })
            .collect()
    }

    fn ends(events: &[MessageEvent]) -> Vec<(u64, u64)> {
        events
            .iter()
            .filter_map(|e| match e {
                MessageEvent::End {
                    last_byte_ns,
                    body_bytes,
                    ..
                } => Some((*last_byte_ns, *body_bytes)),
                _ => None,
            })
            .collect()
    }

    const REQUEST: &[u8] = b"POST /verify?token=secret HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n\
User-Agent: test/1\r\ntraceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n\
Content-Length: 13\r\n\r\n{\"reward\": 1}";

    #[test]
    fn request_split_at_every_byte_boundary() {
        for split in 1..REQUEST.len() {
            let mut stream = MessageStream::new(StreamKind::Requests);
            let (events, errors) = feed_all(&mut stream, &[&REQUEST[..split], &REQUEST[split..]]);
            assert!(errors.is_empty(), "split {split}: {errors:?}");
            let heads = heads(&events);
            assert_eq!(heads.len(), 1, "split {split}");
            let Head::Request(head) = &heads[0] else {
                panic!("not a request")
            };
            assert_eq!(head.method, "POST");
            assert_eq!(head.path, "/verify", "query string must be dropped");
            assert_eq!(head.host.as_deref(), Some("127.0.0.1:8000"));
            assert_eq!(head.user_agent.as_deref(), Some("test/1"));
            assert!(head.traceparent.is_some());
            assert_eq!(ends(&events), vec![(2, 13)], "split {split}");
            assert!(stream.is_idle());
        }
    }

    #[test]
    fn request_read_one_byte_at_a_time() {
        // A head arriving in many small reads is parsed once per line, not once per read.
        let pieces: Vec<&[u8]> = REQUEST.chunks(1).collect();
        let mut stream = MessageStream::new(StreamKind::Requests);
        let (events, errors) = feed_all(&mut stream, &pieces);
        assert!(errors.is_empty(), "{errors:?}");
        let heads = heads(&events);
        assert_eq!(heads.len(), 1);
        let Head::Request(head) = &heads[0] else {
            panic!("not a request")
        };
        assert_eq!(
            (head.method.as_str(), head.path.as_str()),
            ("POST", "/verify")
        );
        assert!(head.traceparent.is_some());
        assert_eq!(ends(&events).len(), 1);
        // Garbage after a valid start is still caught at the end of its line.
        let mut stream = MessageStream::new(StreamKind::Requests);
        let (_, errors) = feed_all(&mut stream, &[b"GET", b" /\x00\x01", b"\r\n"]);
        assert_eq!(errors, [ParseError::NotHttp]);
    }

    #[test]
    fn pipelined_requests_in_one_read() {
        let mut both = REQUEST.to_vec();
        both.extend_from_slice(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
        let mut stream = MessageStream::new(StreamKind::Requests);
        let (events, errors) = feed_all(&mut stream, &[&both]);
        assert!(errors.is_empty());
        let heads = heads(&events);
        assert_eq!(heads.len(), 2);
        let Head::Request(second) = &heads[1] else {
            panic!()
        };
        assert_eq!(
            (second.method.as_str(), second.path.as_str()),
            ("GET", "/health")
        );
        assert_eq!(ends(&events).len(), 2);
    }

    #[test]
    fn keep_alive_sequence_of_requests() {
        let mut stream = MessageStream::new(StreamKind::Requests);
        let (events, errors) = feed_all(&mut stream, &[REQUEST, REQUEST, REQUEST]);
        assert!(errors.is_empty());
        assert_eq!(heads(&events).len(), 3);
        assert_eq!(ends(&events), vec![(1, 13), (2, 13), (3, 13)]);
    }

    const CHUNKED: &[u8] = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: 1\r\n\r\n";

    #[test]
    fn chunked_response_split_everywhere() {
        for split in 1..CHUNKED.len() {
            let mut stream = MessageStream::new(StreamKind::Responses);
            let (events, errors) = feed_all(&mut stream, &[&CHUNKED[..split], &CHUNKED[split..]]);
            assert!(errors.is_empty(), "split {split}: {errors:?}");
            assert_eq!(heads(&events).len(), 1);
            let end = ends(&events);
            assert_eq!(end.len(), 1, "split {split}");
            assert_eq!(end[0].0, 2, "split {split}: ends with the second transfer");
            assert!(stream.is_idle());
        }
    }

    #[test]
    fn chunked_body_beyond_the_capture_ends_at_its_tail() {
        let mut rec = Recorder::new(StreamKind::Responses);
        let head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1000\r\n";
        rec.feed(head, head.len() as u64 + 4096, b"aaaaaaaa", 1);
        assert!(ends(&rec.out).is_empty());
        rec.feed(b"", 4000, b"bbbbbbbb", 2);
        assert!(ends(&rec.out).is_empty());
        rec.feed(b"", 5, b"0\r\n\r\n", 3);
        assert_eq!(ends(&rec.out).len(), 1);
        assert_eq!(ends(&rec.out)[0].0, 3);
        assert!(rec.stream.is_idle());
    }

    const EVENT_STREAM_HEAD: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; \
charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n";

    /// One chunk of a chunked body.
    fn chunk(data: &str) -> Vec<u8> {
        format!("{:x}\r\n{data}\r\n", data.len()).into_bytes()
    }

    /// The streams reported with ends: (last_byte_ns, first data, last data).
    fn stream_ends(events: &[MessageEvent]) -> Vec<(u64, Option<(u64, u64)>)> {
        events
            .iter()
            .filter_map(|e| match e {
                MessageEvent::End {
                    last_byte_ns,
                    stream,
                    ..
                } => Some((
                    *last_byte_ns,
                    stream.map(|s| (s.first_data_ns, s.last_data_ns)),
                )),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn an_event_stream_reports_when_its_data_moved_apart_from_the_chunk_that_closes_it() {
        let mut rec = Recorder::new(StreamKind::Responses);
        rec.feed(EVENT_STREAM_HEAD, EVENT_STREAM_HEAD.len() as u64, b"", 1);
        let first = chunk("event: response.created\ndata: {}\n\n");
        rec.feed(&first, first.len() as u64, b"", 2);
        let last = chunk("event: response.completed\ndata: {}\n\n");
        rec.feed(&last, last.len() as u64, b"", 5);
        assert!(stream_ends(&rec.out).is_empty());
        rec.feed(b"0\r\n\r\n", 5, b"", 9);
        assert_eq!(stream_ends(&rec.out), [(9, Some((2, 5)))]);
        assert!(rec.errors.is_empty(), "{:?}", rec.errors);

        // Not an event stream: the same body reports no stream.
        let mut rec = Recorder::new(StreamKind::Responses);
        let head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n";
        rec.feed(head, head.len() as u64, b"", 1);
        rec.feed(&first, first.len() as u64, b"", 2);
        rec.feed(b"0\r\n\r\n", 5, b"", 9);
        assert_eq!(stream_ends(&rec.out), [(9, None)]);
    }

    #[test]
    fn an_event_stream_closed_after_its_data_ends_there_and_one_closed_before_does_not() {
        // The client read the last event and closed before the chunk that closes the stream.
        let mut rec = Recorder::new(StreamKind::Responses);
        let mut head_and_event = EVENT_STREAM_HEAD.to_vec();
        head_and_event.extend(chunk("data: {}\n\n"));
        rec.feed(&head_and_event, head_and_event.len() as u64, b"", 3);
        rec.stream.close(8, &mut rec.out);
        assert_eq!(stream_ends(&rec.out), [(8, Some((3, 3)))]);
        assert!(rec.stream.is_idle());

        // Closed before any data: nothing ended here (the connection table answers the
        // request with the head it saw, at the close).
        let mut rec = Recorder::new(StreamKind::Responses);
        rec.feed(EVENT_STREAM_HEAD, EVENT_STREAM_HEAD.len() as u64, b"", 1);
        rec.stream.close(8, &mut rec.out);
        assert!(stream_ends(&rec.out).is_empty());
    }

    #[test]
    fn an_event_stream_past_the_capture_tells_data_from_framing_by_the_tail() {
        let mut rec = Recorder::new(StreamKind::Responses);
        rec.feed(EVENT_STREAM_HEAD, EVENT_STREAM_HEAD.len() as u64, b"", 1);
        // A transfer beyond the capture budget: data, whatever its tail.
        rec.feed(b"", 4096, b"{}\n\n\r\n", 2);
        // Framing lost: a transfer of data, then the closing chunk alone, uncaptured.
        rec.feed(b"", 300, b"}\n\n\r\n", 4);
        rec.feed(b"", 5, b"0\r\n\r\n", 9);
        assert_eq!(stream_ends(&rec.out), [(9, Some((2, 4)))]);

        // The same with framing lost and the closing chunk captured after the line end of
        // the chunk before.
        let mut rec = Recorder::new(StreamKind::Responses);
        rec.feed(EVENT_STREAM_HEAD, EVENT_STREAM_HEAD.len() as u64, b"", 1);
        rec.feed(b"", 4096, b"{}\n\n", 2);
        rec.feed(b"\r\n0\r\n\r\n", 7, b"", 6);
        assert_eq!(stream_ends(&rec.out), [(6, Some((2, 2)))]);
    }

    #[test]
    fn content_length_body_beyond_the_capture() {
        let mut rec = Recorder::new(StreamKind::Requests);
        let head = b"POST /verify HTTP/1.1\r\ncontent-length: 100000\r\n\r\n{\"a\":";
        // First read: head plus the first 5 body bytes captured, 4000 more not captured.
        rec.feed(head, head.len() as u64 + 4000, b"", 1);
        rec.feed(b"", 95995, b"", 2);
        assert_eq!(ends(&rec.out), vec![(2, 100000)]);
        assert!(rec.errors.is_empty());
        // The next request on the connection is captured again.
        rec.feed(REQUEST, REQUEST.len() as u64, b"", 3);
        assert_eq!(heads(&rec.out).len(), 2);
    }

    #[test]
    fn head_larger_than_the_capture_still_names_the_request() {
        let mut rec = Recorder::new(StreamKind::Requests);
        let captured = b"GET /big HTTP/1.1\r\nHost: a\r\nX-Huge: aaaaaaaa";
        rec.feed(captured, 20000, b"", 1);
        assert_eq!(rec.errors, vec![ParseError::HeadTooLarge]);
        let Head::Request(head) = &heads(&rec.out)[0] else {
            panic!()
        };
        assert_eq!(head.path, "/big");
        assert!(head.truncated);
        // Resynchronises on the next request.
        rec.feed(REQUEST, REQUEST.len() as u64, b"", 2);
        assert_eq!(heads(&rec.out).len(), 2);
    }

    #[test]
    fn interim_and_head_responses_have_no_body() {
        let mut rec = Recorder::new(StreamKind::Responses);
        let continue_then_ok =
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
        rec.feed(continue_then_ok, continue_then_ok.len() as u64, b"", 1);
        assert_eq!(heads(&rec.out).len(), 2);
        assert_eq!(ends(&rec.out), vec![(1, 0), (1, 2)]);
        rec.out.clear();
        let head_response = b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n";
        rec.feed_answering(
            head_response,
            head_response.len() as u64,
            b"",
            2,
            RequestContext {
                is_head: true,
                ..RequestContext::default()
            },
        );
        assert_eq!(ends(&rec.out), vec![(2, 0)]);
        assert!(rec.errors.is_empty());
    }

    #[test]
    fn response_until_close() {
        let mut stream = MessageStream::new(StreamKind::Responses);
        let (mut events, _) = feed_all(&mut stream, &[b"HTTP/1.0 200 OK\r\n\r\nsome body"]);
        assert!(ends(&events).is_empty());
        stream.close(9, &mut events);
        assert_eq!(ends(&events), vec![(9, 9)]);
    }

    #[test]
    fn garbage_is_reported_and_resynchronised() {
        let mut stream = MessageStream::new(StreamKind::Requests);
        let (events, errors) = feed_all(
            &mut stream,
            &[b"\x16\x03\x01\x02\x00binary tls", b"more junk", REQUEST],
        );
        assert_eq!(errors, vec![ParseError::NotHttp]);
        assert_eq!(heads(&events).len(), 1);
    }

    #[test]
    fn uncaptured_message_start_is_reported() {
        let mut rec = Recorder::new(StreamKind::Requests);
        rec.feed(b"", 500, b"", 1);
        assert_eq!(rec.errors, vec![ParseError::UncapturedStart]);
        assert!(rec.out.is_empty());
    }

    fn wants_post(head: &RequestHead) -> bool {
        head.method == "POST"
    }

    fn prefixes(events: &[MessageEvent]) -> Vec<BodySample> {
        events
            .iter()
            .filter_map(|e| match e {
                MessageEvent::Body(sample) if !sample.prefix.is_empty() => Some(sample.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn keeps_the_body_prefix_only_of_requests_it_was_asked_about() {
        let mut stream = MessageStream::keeping_bodies(wants_post);
        let (events, errors) = feed_all(
            &mut stream,
            &[
                b"POST /run HTTP/1.1\r\nContent-Length: 10\r\n\r\n{\"a\":",
                b"1234}",
                b"PUT /x HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",
            ],
        );
        assert!(errors.is_empty());
        assert_eq!(
            prefixes(&events),
            [BodySample {
                prefix: b"{\"a\":1234}".to_vec(),
                complete: true,
                tail: Some(b"{\"a\":1234}".to_vec()),
                chunked: false,
            }]
        );
        // The prefix comes right before its message's end.
        let position = events
            .iter()
            .position(|e| matches!(e, MessageEvent::Body(_)))
            .unwrap();
        assert!(matches!(events[position + 1], MessageEvent::End { .. }));
    }

    #[test]
    fn a_body_beyond_the_capture_gives_an_incomplete_prefix() {
        let mut recorder = Recorder {
            stream: MessageStream::keeping_bodies(wants_post),
            out: Vec::new(),
            errors: Vec::new(),
        };
        let captured = b"POST /run HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"_ng_task_index\": 1";
        let total = captured.len() as u64 - 20 + 100;
        recorder.feed(captured, total, b"", 1);
        let kept = prefixes(&recorder.out);
        assert_eq!(kept.len(), 1);
        assert!(!kept[0].complete);
        assert_eq!(kept[0].prefix, b"{\"_ng_task_index\": 1");
        // A chunked body asked for is kept with its framing, which `unframed` takes off its
        // edges.
        let (events, _) = feed_all(
            &mut MessageStream::keeping_bodies(wants_post),
            &[b"POST /run HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"],
        );
        let kept = prefixes(&events);
        assert!(kept[0].chunked);
        let (prefix, tail) = kept[0].unframed();
        assert!(prefix.starts_with(b"{}\r\n"), "{prefix:?}");
        assert_eq!(tail, Some(&b"2\r\n{}"[..]));
    }
    /// The body's last bytes, however the transfers cut it: captured, a gap's tail, a short
    /// last read whose tail continues the one before; none when a gap's tail did not reach.
    #[test]
    fn a_request_body_keeps_its_last_bytes_across_transfers() {
        let body: Vec<u8> = (0..3000u32).map(|i| b'a' + (i % 26) as u8).collect();
        let head = format!("POST /x HTTP/1.1\r\nContent-Length: {}\r\n\r\n", body.len());
        let tail_of = |events: &[MessageEvent]| -> Option<Vec<u8>> {
            events.iter().find_map(|e| match e {
                MessageEvent::Body(sample) => Some(sample.tail.clone()),
                _ => None,
            })?
        };
        const T: usize = REQUEST_TAIL_BYTES;
        let end = &body[body.len() - T..];
        let recorder = |transfers: &[(usize, usize, usize)]| {
            // (bytes of the body in this transfer, of which captured, tail length)
            let mut recorder = Recorder {
                stream: MessageStream::new(StreamKind::Requests),
                out: Vec::new(),
                errors: Vec::new(),
            };
            recorder.feed(head.as_bytes(), head.len() as u64, b"", 1);
            let mut at = 0;
            for &(len, captured, tail) in transfers {
                let bytes = &body[at..at + len];
                recorder.feed(&bytes[..captured], len as u64, &bytes[len - tail..], 2);
                at += len;
            }
            assert!(recorder.errors.is_empty());
            tail_of(&recorder.out)
        };
        assert_eq!(
            recorder(&[(3000, 3000, 0)]).as_deref(),
            Some(end),
            "captured whole"
        );
        assert_eq!(
            recorder(&[(3000, 1000, T)]).as_deref(),
            Some(end),
            "one gap"
        );
        assert_eq!(
            recorder(&[(2950, 1000, T), (50, 0, 50)]).as_deref(),
            Some(end),
            "a short last read continues the tail before it"
        );
        assert_eq!(
            recorder(&[(2000, 1000, T), (900, 0, T), (100, 0, 100)]).as_deref(),
            Some(end),
            "two gaps, each tail reaching back to the one before"
        );
        assert_eq!(
            recorder(&[(2000, 1000, T), (900, 0, T), (100, 0, 50)]).as_deref(),
            Some(&body[body.len() - 50..]),
            "a tail that does not cover its gap: only its own bytes are known"
        );
        assert_eq!(recorder(&[(2000, 1000, 8), (1000, 0, 0)]), None);
    }

    #[test]
    fn a_head_sent_a_few_bytes_at_a_time_is_parsed_once_complete() {
        let head: &[u8] = b"GET /slow HTTP/1.1\r\nHost: a\r\nX-Pad: 0123456789\r\n\r\n";
        let chunks: Vec<&[u8]> = head.chunks(3).collect();
        let mut stream = MessageStream::new(StreamKind::Requests);
        let (out, errors) = feed_all(&mut stream, &chunks);
        assert!(errors.is_empty());
        assert_eq!(heads(&out).len(), 1);
        assert_eq!(ends(&out), [(chunks.len() as u64, 0)]);
    }

    #[test]
    fn a_head_past_the_limit_in_small_reads_is_cut_not_kept() {
        let mut stream = MessageStream::new(StreamKind::Requests);
        let mut chunks: Vec<Vec<u8>> = vec![b"GET /big HTTP/1.1\r\nHost: a\r\n".to_vec()];
        chunks.push(b"Cookie: ".to_vec());
        chunks.extend(std::iter::repeat_n(vec![b's'; 1000], 20));
        chunks.push(b"\r\n\r\n".to_vec());
        chunks.push(b"GET /next HTTP/1.1\r\n\r\n".to_vec());
        let slices: Vec<&[u8]> = chunks.iter().map(Vec::as_slice).collect();
        let (out, errors) = feed_all(&mut stream, &slices);
        assert_eq!(errors, [ParseError::HeadTooLarge]);
        let paths: Vec<String> = heads(&out)
            .into_iter()
            .map(|head| match head {
                Head::Request(request) => request.path,
                Head::Response(_) => unreachable!(),
            })
            .collect();
        assert_eq!(paths, ["/big", "/next"], "the cut head names its request");
        let State::Idle = stream.state else {
            panic!("back in step after the oversized head")
        };
    }
}
