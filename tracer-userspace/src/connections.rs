//! The connection table: kernel events in, finished HTTP exchanges out.
//!
//! A connection is keyed by process and fd and carries the kernel's `conn_id` (its open
//! time), so a data record for a reused fd can never be mixed into an older connection.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;

use crate::events::{ConnOpen, DataTransfer, Direction, KernelEvent, Role};
use crate::gym::rollout_id::{RolloutId, rollout_id_from_run_body};
use crate::http::{
    Head, MessageEvent, MessageStream, ParseError, RequestContext, RequestHead, ResponseHead,
    StreamKind, Transfer, WantsBody,
};
use crate::spans::SpanId;
use crate::stats::Stats;

/// Requests a single connection may have in flight (pipelining depth) before the oldest is
/// given up as lost.
pub(crate) const MAX_IN_FLIGHT_PER_CONNECTION: usize = 64;

/// A connection in one traced process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SocketId {
    pub pid: u32,
    pub fd: i32,
}

/// Why an exchange ended without a response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AbortReason {
    /// The connection closed before the response was complete.
    ConnectionClosed,
    /// The traced process exited.
    ProcessExited,
    /// Too many requests were in flight on the connection.
    Overflow,
}

impl AbortReason {
    /// The `error.type` value exported for it.
    pub fn as_error_type(self) -> &'static str {
        match self {
            AbortReason::ConnectionClosed => "connection_closed",
            AbortReason::ProcessExited => "process_exited",
            AbortReason::Overflow => "tracer_overflow",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Response(ResponseHead),
    Aborted(AbortReason),
}

/// One request and what became of it: the unit from which spans and metrics are built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpExchange {
    pub pid: u32,
    pub role: Role,
    pub local: Option<SocketAddr>,
    pub peer: Option<SocketAddr>,
    pub request: RequestHead,
    pub outcome: Outcome,
    /// Monotonic ns when the request's first byte moved.
    pub start_ns: u64,
    /// Monotonic ns when the response's last byte moved (or the abort was seen).
    pub end_ns: u64,
    /// The rollout id named by the request body, for requests whose body was kept (see
    /// [`ConnectionTable::new`]).
    pub run_rollout_id: Option<RolloutId>,
    /// Given when the request started (see [`TableAction::Started`]).
    pub span_id: SpanId,
}

/// A request whose head was just seen. Its span id exists from now on, so that the calls it
/// makes and the server that receives it can refer to it before it ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestStart {
    pub pid: u32,
    pub role: Role,
    pub local: Option<SocketAddr>,
    pub peer: Option<SocketAddr>,
    /// Which request of its connection this is (0 for the first): the client and the server
    /// of one connection count the same requests in the same order.
    pub sequence: u64,
    pub span_id: SpanId,
    pub method: String,
    pub path: String,
    pub traceparent: Option<String>,
}

#[derive(Debug)]
struct InFlight {
    head: RequestHead,
    start_ns: u64,
    run_rollout_id: Option<RolloutId>,
    span_id: SpanId,
}

#[derive(Debug)]
struct Connection {
    conn_id: u64,
    role: Role,
    local: Option<SocketAddr>,
    peer: Option<SocketAddr>,
    requests: MessageStream,
    responses: MessageStream,
    in_flight: VecDeque<InFlight>,
    /// Requests seen on this connection so far.
    requests_seen: u64,
    /// The response head being received, if it is a final (non-1xx) one.
    current_response: Option<ResponseHead>,
    parse_errors: u32,
}

/// A connection that keeps failing to parse is not HTTP (a database client, TLS); after this
/// many errors it is dropped and the kernel is told to stop reporting it.
const MAX_PARSE_ERRORS: u32 = 3;

pub struct ConnectionTable {
    connections: HashMap<SocketId, Connection>,
    max_connections: usize,
    /// Inbound requests whose body is read for a rollout id.
    wants_body: Option<WantsBody>,
    scratch_events: Vec<MessageEvent>,
    scratch_errors: Vec<ParseError>,
}

/// What the table asks of the caller besides exchanges.
#[derive(Debug, PartialEq, Eq)]
pub enum TableAction {
    /// Stop capturing this socket in the kernel: it is not HTTP/1.x.
    Untrack { id: SocketId, conn_id: u64 },
    /// A request started; reported before anything that depends on it.
    Started(RequestStart),
    /// A started request's body named its rollout.
    RolloutFromBody {
        span_id: SpanId,
        rollout_id: RolloutId,
    },
}

impl ConnectionTable {
    pub fn new(max_connections: usize) -> Self {
        Self {
            connections: HashMap::new(),
            max_connections,
            wants_body: None,
            scratch_events: Vec::new(),
            scratch_errors: Vec::new(),
        }
    }

    /// Inbound requests that `wants_body` accepts get `run_rollout_id` read from their body.
    pub fn reading_run_bodies(mut self, wants_body: WantsBody) -> Self {
        self.wants_body = Some(wants_body);
        self
    }

    pub fn open_connections(&self) -> usize {
        self.connections.len()
    }

    /// Applies one kernel event; finished exchanges are appended to `exchanges`.
    pub fn apply(
        &mut self,
        event: &KernelEvent<'_>,
        stats: &mut Stats,
        exchanges: &mut Vec<HttpExchange>,
        actions: &mut Vec<TableAction>,
    ) {
        match event {
            KernelEvent::Open(open) => self.open(open, stats, exchanges),
            KernelEvent::Data(data) => self.data(data, stats, exchanges, actions),
            KernelEvent::Close {
                pid,
                fd,
                conn_id,
                timestamp_ns,
            } => {
                let id = SocketId { pid: *pid, fd: *fd };
                if self
                    .connections
                    .get(&id)
                    .is_some_and(|c| c.conn_id == *conn_id)
                {
                    let connection = self.connections.remove(&id).expect("checked above");
                    finish(
                        id.pid,
                        connection,
                        *timestamp_ns,
                        AbortReason::ConnectionClosed,
                        stats,
                        exchanges,
                    );
                }
            }
            KernelEvent::ProcessFork { .. } => {}
            KernelEvent::ProcessExit { pid, timestamp_ns } => {
                let ids: Vec<SocketId> = self
                    .connections
                    .keys()
                    .filter(|id| id.pid == *pid)
                    .copied()
                    .collect();
                for id in ids {
                    if let Some(connection) = self.connections.remove(&id) {
                        finish(
                            id.pid,
                            connection,
                            *timestamp_ns,
                            AbortReason::ProcessExited,
                            stats,
                            exchanges,
                        );
                    }
                }
            }
        }
    }

    fn open(&mut self, open: &ConnOpen, stats: &mut Stats, exchanges: &mut Vec<HttpExchange>) {
        let id = SocketId {
            pid: open.pid,
            fd: open.fd,
        };
        if let Some(stale) = self.connections.remove(&id) {
            // The close of the previous connection on this fd was not seen.
            finish(
                id.pid,
                stale,
                open.timestamp_ns,
                AbortReason::ConnectionClosed,
                stats,
                exchanges,
            );
        }
        if self.connections.len() >= self.max_connections {
            stats.connections_dropped += 1;
            return;
        }
        self.connections.insert(
            id,
            Connection {
                conn_id: open.conn_id,
                role: open.role,
                local: open.local,
                peer: open.peer,
                requests: match (open.role, self.wants_body) {
                    (Role::Server, Some(wants)) => MessageStream::keeping_bodies(wants),
                    _ => MessageStream::new(StreamKind::Requests),
                },
                responses: MessageStream::new(StreamKind::Responses),
                in_flight: VecDeque::new(),
                requests_seen: 0,
                current_response: None,
                parse_errors: 0,
            },
        );
    }

    fn data(
        &mut self,
        data: &DataTransfer<'_>,
        stats: &mut Stats,
        exchanges: &mut Vec<HttpExchange>,
        actions: &mut Vec<TableAction>,
    ) {
        let id = SocketId {
            pid: data.pid,
            fd: data.fd,
        };
        let Some(connection) = self.connections.get_mut(&id) else {
            stats.data_without_connection += 1;
            return;
        };
        if connection.conn_id != data.conn_id {
            stats.data_without_connection += 1;
            return;
        }
        // Server: reads are requests. Client: writes are requests.
        let is_request = (connection.role == Role::Server) == (data.direction == Direction::Read);
        let transfer = Transfer {
            captured: data.captured,
            total_len: data.total_len,
            tail: data.tail,
            timestamp_ns: data.timestamp_ns,
        };
        let events = &mut self.scratch_events;
        let errors = &mut self.scratch_errors;
        events.clear();
        errors.clear();
        if is_request {
            connection
                .requests
                .feed(transfer, |_| RequestContext::default(), events, errors);
        } else {
            // One write can answer several pipelined requests: each response head is
            // matched with its own request (a HEAD's response has no body).
            let in_flight = &connection.in_flight;
            connection.responses.feed(
                transfer,
                |answered| RequestContext {
                    is_head: in_flight
                        .get(answered)
                        .is_some_and(|r| r.head.method == "HEAD"),
                },
                events,
                errors,
            );
        }
        for error in errors.iter() {
            stats.count_parse_error(*error);
        }
        connection.parse_errors += errors.len() as u32;
        for event in events.drain(..) {
            on_message_event(
                id.pid, connection, is_request, event, stats, exchanges, actions,
            );
        }
        if connection.parse_errors >= MAX_PARSE_ERRORS && connection.in_flight.is_empty() {
            actions.push(TableAction::Untrack {
                id,
                conn_id: connection.conn_id,
            });
            self.connections.remove(&id);
            stats.connections_not_http += 1;
        }
    }

    /// Ends every connection (at shutdown). In-flight requests are not exported: they are
    /// not finished.
    pub fn in_flight_requests(&self) -> usize {
        self.connections.values().map(|c| c.in_flight.len()).sum()
    }
}

fn on_message_event(
    pid: u32,
    connection: &mut Connection,
    is_request: bool,
    event: MessageEvent,
    stats: &mut Stats,
    exchanges: &mut Vec<HttpExchange>,
    actions: &mut Vec<TableAction>,
) {
    match (is_request, event) {
        (
            true,
            MessageEvent::Head {
                head: Head::Request(head),
                first_byte_ns,
            },
        ) => {
            if connection.in_flight.len() >= MAX_IN_FLIGHT_PER_CONNECTION
                && let Some(oldest) = connection.in_flight.pop_front()
            {
                {
                    stats.requests_dropped_overflow += 1;
                    exchanges.push(exchange(
                        pid,
                        connection,
                        oldest,
                        Outcome::Aborted(AbortReason::Overflow),
                        first_byte_ns,
                    ));
                }
            }
            let span_id = SpanId::random();
            actions.push(TableAction::Started(RequestStart {
                pid,
                role: connection.role,
                local: connection.local,
                peer: connection.peer,
                sequence: connection.requests_seen,
                span_id,
                method: head.method.clone(),
                path: head.path.clone(),
                traceparent: head.traceparent.clone(),
            }));
            connection.requests_seen += 1;
            connection.in_flight.push_back(InFlight {
                head,
                start_ns: first_byte_ns,
                run_rollout_id: None,
                span_id,
            });
        }
        (
            false,
            MessageEvent::Head {
                head: Head::Response(head),
                ..
            },
        ) => {
            connection.current_response = (head.status >= 200).then_some(head);
        }
        (false, MessageEvent::End { last_byte_ns, .. }) => {
            let Some(response) = connection.current_response.take() else {
                return; // the end of an interim (1xx) response
            };
            match connection.in_flight.pop_front() {
                Some(request) => exchanges.push(exchange(
                    pid,
                    connection,
                    request,
                    Outcome::Response(response),
                    last_byte_ns,
                )),
                // The request was sent before the connection was traced.
                None => stats.responses_without_request += 1,
            }
        }
        (true, MessageEvent::BodyPrefix(prefix)) => {
            // The body is read for the few fields that name the rollout, then let go.
            if let Some(request) = connection.in_flight.back_mut() {
                request.run_rollout_id = rollout_id_from_run_body(&prefix.bytes, prefix.complete);
                if let Some(rollout_id) = &request.run_rollout_id {
                    actions.push(TableAction::RolloutFromBody {
                        span_id: request.span_id,
                        rollout_id: rollout_id.clone(),
                    });
                }
            }
        }
        // The end of a request body changes nothing: the exchange ends with its response.
        (true, MessageEvent::End { .. }) => {}
        (false, MessageEvent::BodyPrefix(_)) => {}
        (_, MessageEvent::Head { .. }) => {}
    }
}

fn exchange(
    pid: u32,
    connection: &Connection,
    request: InFlight,
    outcome: Outcome,
    end_ns: u64,
) -> HttpExchange {
    HttpExchange {
        pid,
        role: connection.role,
        local: connection.local,
        peer: connection.peer,
        request: request.head,
        outcome,
        start_ns: request.start_ns,
        end_ns: end_ns.max(request.start_ns),
        run_rollout_id: request.run_rollout_id,
        span_id: request.span_id,
    }
}

/// A connection ended: a response that runs until close completes, the rest is aborted.
fn finish(
    pid: u32,
    mut connection: Connection,
    timestamp_ns: u64,
    reason: AbortReason,
    stats: &mut Stats,
    exchanges: &mut Vec<HttpExchange>,
) {
    let mut events = Vec::new();
    connection.responses.close(timestamp_ns, &mut events);
    for event in events {
        // A response end cannot start a request: nothing is pushed.
        on_message_event(
            pid,
            &mut connection,
            false,
            event,
            stats,
            exchanges,
            &mut Vec::new(),
        );
    }
    // A response whose head arrived was answered, even if the rest of its body never was
    // read: a client that gives up on a 5xx body (aiohttp's raise_for_status) closes here.
    if let Some(response) = connection.current_response.take()
        && let Some(request) = connection.in_flight.pop_front()
    {
        exchanges.push(exchange(
            pid,
            &connection,
            request,
            Outcome::Response(response),
            timestamp_ns,
        ));
    }
    while let Some(request) = connection.in_flight.pop_front() {
        exchanges.push(exchange(
            pid,
            &connection,
            request,
            Outcome::Aborted(reason),
            timestamp_ns,
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, Ipv4Addr};

    fn open(fd: i32, conn_id: u64, role: Role) -> KernelEvent<'static> {
        KernelEvent::Open(ConnOpen {
            pid: 7,
            fd,
            conn_id,
            timestamp_ns: conn_id,
            role,
            local: Some(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8000)),
            peer: Some(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 40000)),
        })
    }

    fn data(
        fd: i32,
        conn_id: u64,
        direction: Direction,
        ts: u64,
        bytes: &'static [u8],
    ) -> KernelEvent<'static> {
        KernelEvent::Data(DataTransfer {
            pid: 7,
            tid: 7,
            fd,
            conn_id,
            timestamp_ns: ts,
            direction,
            captured: bytes,
            total_len: bytes.len() as u64,
            tail: &[],
        })
    }

    fn run(events: &[KernelEvent<'static>]) -> (Vec<HttpExchange>, Stats, Vec<TableAction>) {
        let mut table = ConnectionTable::new(16);
        let mut stats = Stats::default();
        let mut exchanges = Vec::new();
        let mut actions = Vec::new();
        for event in events {
            table.apply(event, &mut stats, &mut exchanges, &mut actions);
        }
        (exchanges, stats, actions)
    }

    const GET: &[u8] = b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n";
    const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
    const FAIL: &[u8] = b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n";

    #[test]
    fn keep_alive_requests_pair_with_their_responses_in_order() {
        let (exchanges, stats, _) = run(&[
            open(5, 100, Role::Server),
            data(5, 100, Direction::Read, 110, GET),
            data(5, 100, Direction::Write, 120, OK),
            data(5, 100, Direction::Read, 130, GET),
            data(5, 100, Direction::Write, 150, FAIL),
        ]);
        assert_eq!(exchanges.len(), 2);
        assert_eq!((exchanges[0].start_ns, exchanges[0].end_ns), (110, 120));
        assert_eq!((exchanges[1].start_ns, exchanges[1].end_ns), (130, 150));
        let Outcome::Response(second) = &exchanges[1].outcome else {
            panic!()
        };
        assert_eq!(second.status, 500);
        assert_eq!(stats.responses_without_request, 0);
    }

    #[test]
    fn pipelined_requests_answer_in_order() {
        const TWO: &[u8] = b"GET /a HTTP/1.1\r\n\r\nGET /b HTTP/1.1\r\n\r\n";
        let (exchanges, _, _) = run(&[
            open(5, 100, Role::Server),
            data(5, 100, Direction::Read, 110, TWO),
            data(5, 100, Direction::Write, 120, OK),
            data(5, 100, Direction::Write, 130, FAIL),
        ]);
        let paths: Vec<_> = exchanges.iter().map(|e| e.request.path.as_str()).collect();
        assert_eq!(paths, ["/a", "/b"]);
        assert_eq!(exchanges[1].end_ns, 130);
    }

    #[test]
    fn fd_reuse_does_not_mix_connections() {
        let (exchanges, stats, _) = run(&[
            open(5, 100, Role::Server),
            data(5, 100, Direction::Read, 110, GET),
            KernelEvent::Close {
                pid: 7,
                fd: 5,
                conn_id: 100,
                timestamp_ns: 115,
            },
            open(5, 200, Role::Server),
            // A late record of the old connection must not land in the new one.
            data(5, 100, Direction::Write, 116, OK),
            data(5, 200, Direction::Read, 210, GET),
            data(5, 200, Direction::Write, 220, OK),
        ]);
        assert_eq!(exchanges.len(), 2);
        assert_eq!(
            exchanges[0].outcome,
            Outcome::Aborted(AbortReason::ConnectionClosed)
        );
        assert_eq!(exchanges[0].end_ns, 115);
        assert!(matches!(exchanges[1].outcome, Outcome::Response(_)));
        assert_eq!(stats.data_without_connection, 1);
    }

    #[test]
    fn client_connections_pair_writes_with_reads() {
        let (exchanges, _, _) = run(&[
            open(9, 300, Role::Client),
            data(9, 300, Direction::Write, 310, GET),
            data(9, 300, Direction::Read, 330, OK),
        ]);
        assert_eq!(exchanges.len(), 1);
        assert_eq!(exchanges[0].role, Role::Client);
        assert_eq!((exchanges[0].start_ns, exchanges[0].end_ns), (310, 330));
    }

    #[test]
    fn process_exit_aborts_in_flight_requests() {
        let (exchanges, _, _) = run(&[
            open(5, 100, Role::Server),
            data(5, 100, Direction::Read, 110, GET),
            KernelEvent::ProcessExit {
                pid: 7,
                timestamp_ns: 500,
            },
        ]);
        assert_eq!(exchanges.len(), 1);
        assert_eq!(
            exchanges[0].outcome,
            Outcome::Aborted(AbortReason::ProcessExited)
        );
    }

    #[test]
    fn non_http_connections_are_untracked() {
        let (exchanges, stats, actions) = run(&[
            open(5, 100, Role::Server),
            data(5, 100, Direction::Read, 110, b"\x00\x01binary"),
            data(5, 100, Direction::Write, 111, b"\x00\x02binary"),
            data(5, 100, Direction::Read, 112, b"*1\r\n$4\r\nPING\r\n"),
            data(5, 100, Direction::Read, 113, b"GETX nonsense"),
            // A desynchronised stream only errs again once something looks like a start.
            data(5, 100, Direction::Read, 114, b"GET \x00\x00\x00\r\n\r\n"),
        ]);
        assert!(exchanges.is_empty());
        assert_eq!(stats.connections_not_http, 1);
        assert_eq!(
            actions,
            vec![TableAction::Untrack {
                id: SocketId { pid: 7, fd: 5 },
                conn_id: 100
            }]
        );
    }

    #[test]
    fn table_is_bounded() {
        let mut events = Vec::new();
        for fd in 0..20 {
            events.push(open(fd, 1000 + fd as u64, Role::Server));
        }
        let (_, stats, _) = run(&events);
        assert_eq!(stats.connections_dropped, 4);
    }

    #[test]
    fn a_response_cut_off_in_its_body_keeps_its_status() {
        const PARTIAL: &[u8] =
            b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 100\r\n\r\n{\"detail\"";
        let (exchanges, _, _) = run(&[
            open(5, 100, Role::Client),
            data(
                5,
                100,
                Direction::Write,
                10,
                b"POST /verify HTTP/1.1\r\ncontent-length: 0\r\n\r\n",
            ),
            data(5, 100, Direction::Read, 20, PARTIAL),
            KernelEvent::Close {
                pid: 7,
                fd: 5,
                conn_id: 100,
                timestamp_ns: 30,
            },
        ]);
        assert_eq!(exchanges.len(), 1);
        assert!(matches!(
            &exchanges[0].outcome,
            Outcome::Response(response) if response.status == 500
        ));
        assert_eq!(exchanges[0].end_ns, 30);
    }

    #[test]
    fn responses_in_one_write_each_answer_their_own_request() {
        // Pipelined GET, HEAD, GET answered in one write: the HEAD's response has a
        // content-length but no body, which only the request it answers can tell.
        const TWO_GETS_AND_A_HEAD: &[u8] =
            b"GET /a HTTP/1.1\r\n\r\nHEAD /b HTTP/1.1\r\n\r\nGET /c HTTP/1.1\r\n\r\n";
        const THREE_RESPONSES: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok\
            HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n\
            HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n";
        let (exchanges, stats, _) = run(&[
            open(5, 100, Role::Server),
            data(5, 100, Direction::Read, 110, TWO_GETS_AND_A_HEAD),
            data(5, 100, Direction::Write, 120, THREE_RESPONSES),
        ]);
        let statuses: Vec<_> = exchanges
            .iter()
            .map(|e| match &e.outcome {
                Outcome::Response(response) => (e.request.path.as_str(), response.status),
                Outcome::Aborted(_) => (e.request.path.as_str(), 0),
            })
            .collect();
        assert_eq!(statuses, [("/a", 200), ("/b", 200), ("/c", 404)]);
        assert_eq!(stats.parse_not_http, 0);
    }
}
