//! Harvesting a server's route table from its own `/openapi.json` (FastAPI serves it), once
//! per server, so spans are named by the server's real route templates.
//!
//! The tracer traces the very server it asks, so each harvest connection goes into
//! [`SelfPorts`], and the SERVER span of that request is dropped.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::net::TcpStream;
use tokio::time::timeout;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);
/// Gym's route tables are a few hundred KiB at most; the cap bounds a misbehaving server.
const MAX_RESPONSE_BYTES: usize = 8 << 20;
const MAX_HEADERS: usize = 64;

/// How long a harvest connection stays marked if its request is never seen (the server
/// closed it first): it must outlive the request (5 s at most) plus the lag of the event
/// pipeline; expiry keeps the set bounded however long the tracer runs.
const SELF_PORT_TTL: Duration = Duration::from_secs(120);

/// The tracer's own connections to traced servers, as (client port, server port). Each
/// carries exactly one request, so an entry is taken when that request is seen: the same
/// port pair may be reused by a real client right after, and its spans must not be dropped.
#[derive(Clone, Debug)]
pub struct SelfPorts {
    ports: Arc<Mutex<HashMap<(u16, u16), Instant>>>,
    ttl: Duration,
}

impl Default for SelfPorts {
    fn default() -> Self {
        Self::with_ttl(SELF_PORT_TTL)
    }
}

impl SelfPorts {
    pub fn new() -> Self {
        Self::default()
    }

    fn with_ttl(ttl: Duration) -> Self {
        Self {
            ports: Arc::default(),
            ttl,
        }
    }

    /// Marks a connection, and forgets the expired ones (harvests are rare: this stays tiny).
    pub fn insert(&self, client_port: u16, server_port: u16) {
        let now = Instant::now();
        let mut ports = self.ports.lock().unwrap_or_else(PoisonError::into_inner);
        ports.retain(|_, expires| *expires > now);
        ports.insert((client_port, server_port), now + self.ttl);
    }

    /// Whether the connection is one of the tracer's; the mark is used up.
    pub fn take(&self, client_port: u16, server_port: u16) -> bool {
        let mut ports = self.ports.lock().unwrap_or_else(PoisonError::into_inner);
        ports
            .remove(&(client_port, server_port))
            .is_some_and(|expires| expires > Instant::now())
    }
}

/// Why a route harvest failed. Never carries response bytes.
#[derive(Debug, thiserror::Error)]
pub enum HarvestError {
    #[error("connecting: {0}")]
    Connect(#[source] io::Error),
    #[error("no connection within {} s", CONNECT_TIMEOUT.as_secs())]
    ConnectTimeout,
    #[error("no complete response within {} s", RESPONSE_TIMEOUT.as_secs())]
    Timeout,
    #[error("exchanging the request: {0}")]
    Io(#[source] io::Error),
    #[error("GET /openapi.json answered HTTP {0}")]
    Status(u16),
    #[error("malformed response: {0}")]
    Malformed(&'static str),
    #[error("response larger than {} MiB", MAX_RESPONSE_BYTES >> 20)]
    TooLarge,
    #[error("the server closed the connection before the response was complete")]
    Truncated,
}

/// Bounds of one harvest; tests shrink them.
#[derive(Clone, Copy, Debug)]
struct Limits {
    connect: Duration,
    response: Duration,
    max_bytes: usize,
}

const LIMITS: Limits = Limits {
    connect: CONNECT_TIMEOUT,
    response: RESPONSE_TIMEOUT,
    max_bytes: MAX_RESPONSE_BYTES,
};

/// `GET /openapi.json` from the server at `addr` over plain HTTP/1.1; the body on 200.
pub async fn fetch_openapi(
    addr: SocketAddr,
    self_ports: &SelfPorts,
) -> Result<Vec<u8>, HarvestError> {
    fetch(addr, self_ports, LIMITS).await
}

async fn fetch(
    addr: SocketAddr,
    self_ports: &SelfPorts,
    limits: Limits,
) -> Result<Vec<u8>, HarvestError> {
    let stream = timeout(limits.connect, TcpStream::connect(addr))
        .await
        .map_err(|_| HarvestError::ConnectTimeout)?
        .map_err(HarvestError::Connect)?;
    // Marked before the request leaves: the server's span starts with its first byte.
    self_ports.insert(
        stream.local_addr().map_err(HarvestError::Io)?.port(),
        addr.port(),
    );
    timeout(limits.response, exchange(&stream, addr, limits.max_bytes))
        .await
        .map_err(|_| HarvestError::Timeout)?
}

async fn exchange(
    stream: &TcpStream,
    addr: SocketAddr,
    max_bytes: usize,
) -> Result<Vec<u8>, HarvestError> {
    let request = format!(
        "GET /openapi.json HTTP/1.1\r\nHost: {addr}\r\nAccept: application/json\r\n\
         Connection: close\r\nUser-Agent: gym-tracer/{}\r\n\r\n",
        env!("CARGO_PKG_VERSION")
    );
    write_all(stream, request.as_bytes())
        .await
        .map_err(HarvestError::Io)?;
    let mut reader = ResponseReader {
        stream,
        buf: Vec::with_capacity(16 << 10),
        max_bytes,
    };
    let (head_len, framing) = loop {
        if let Some(head) = parse_head(&reader.buf)? {
            break head;
        }
        if !reader.read_more().await? {
            return Err(HarvestError::Truncated);
        }
    };
    let body = match framing {
        Framing::Length(len) => {
            if len > max_bytes {
                return Err(HarvestError::TooLarge);
            }
            while reader.buf.len() - head_len < len {
                if !reader.read_more().await? {
                    return Err(HarvestError::Truncated);
                }
            }
            let mut body = reader.buf.split_off(head_len);
            body.truncate(len);
            body
        }
        Framing::Chunked => {
            let mut chunked = Chunked {
                pos: head_len,
                body: Vec::new(),
            };
            loop {
                if chunked.advance(&reader.buf)? {
                    break chunked.body;
                }
                if !reader.read_more().await? {
                    return Err(HarvestError::Truncated);
                }
            }
        }
        Framing::UntilClose => {
            while reader.read_more().await? {}
            reader.buf.split_off(head_len)
        }
    };
    Ok(body)
}

// Readiness + `try_*` instead of `AsyncReadExt`/`AsyncWriteExt`: those need tokio's
// `io-util` feature, which the workspace's tokio features do not name (only other crates
// turn it on today).
async fn write_all(stream: &TcpStream, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        stream.writable().await?;
        match stream.try_write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

async fn read(stream: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        stream.readable().await?;
        match stream.try_read(buf) {
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
            result => return result,
        }
    }
}

struct ResponseReader<'a> {
    stream: &'a TcpStream,
    buf: Vec<u8>,
    max_bytes: usize,
}

impl ResponseReader<'_> {
    /// Appends what the server sent next; `false` at end of stream.
    async fn read_more(&mut self) -> Result<bool, HarvestError> {
        let mut chunk = [0u8; 16 << 10];
        let n = read(self.stream, &mut chunk)
            .await
            .map_err(HarvestError::Io)?;
        if self.buf.len() + n > self.max_bytes {
            return Err(HarvestError::TooLarge);
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(n > 0)
    }
}

/// How the body of a response is delimited (RFC 9112 §6.3).
#[derive(Debug, PartialEq, Eq)]
enum Framing {
    Length(usize),
    Chunked,
    UntilClose,
}

/// The head's length and the body's framing once the head is complete; an error for any
/// status but 200.
fn parse_head(buf: &[u8]) -> Result<Option<(usize, Framing)>, HarvestError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut headers);
    let head_len = match response.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(HarvestError::Malformed("too many headers"));
        }
        Err(_) => return Err(HarvestError::Malformed("invalid status line or headers")),
    };
    match response.code {
        Some(200) => {}
        Some(code) => return Err(HarvestError::Status(code)),
        None => return Err(HarvestError::Malformed("no status code")),
    }
    let mut length = None;
    let mut chunked = false;
    for header in response.headers.iter() {
        if header.name.eq_ignore_ascii_case("transfer-encoding") {
            // Chunked is always the last coding when present.
            chunked = header
                .value
                .rsplit(|&b| b == b',')
                .next()
                .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if header.name.eq_ignore_ascii_case("content-length") {
            let value = std::str::from_utf8(header.value)
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .ok_or(HarvestError::Malformed("invalid Content-Length"))?;
            if length.is_some_and(|previous| previous != value) {
                return Err(HarvestError::Malformed("conflicting Content-Length"));
            }
            length = Some(value);
        }
    }
    // Transfer-Encoding wins over Content-Length.
    let framing = match (chunked, length) {
        (true, _) => Framing::Chunked,
        (false, Some(len)) => Framing::Length(len),
        (false, None) => Framing::UntilClose,
    };
    Ok(Some((head_len, framing)))
}

/// Incremental chunked-body decoder over the growing response buffer: each chunk is copied
/// once, when all of it has arrived.
struct Chunked {
    /// Start of the next unparsed chunk in the buffer.
    pos: usize,
    body: Vec<u8>,
}

impl Chunked {
    /// Consumes the complete chunks in `buf`; `true` once the last chunk and the trailer
    /// section have been read.
    fn advance(&mut self, buf: &[u8]) -> Result<bool, HarvestError> {
        loop {
            let rest = &buf[self.pos..];
            let (size_len, size) = match httparse::parse_chunk_size(rest) {
                Ok(httparse::Status::Complete(parsed)) => parsed,
                Ok(httparse::Status::Partial) => return Ok(false),
                Err(_) => return Err(HarvestError::Malformed("invalid chunk size")),
            };
            let data = &rest[size_len..];
            if size == 0 {
                // No trailers: an empty line. Trailers: lines ending in an empty one.
                return Ok(data.starts_with(b"\r\n")
                    || data.windows(4).any(|window| window == b"\r\n\r\n"));
            }
            let size = usize::try_from(size).map_err(|_| HarvestError::TooLarge)?;
            let Some(end) = size.checked_add(2).filter(|&end| end <= data.len()) else {
                return Ok(false);
            };
            if &data[size..end] != b"\r\n" {
                return Err(HarvestError::Malformed("chunk not followed by CRLF"));
            }
            self.body.extend_from_slice(&data[..size]);
            self.pos += size_len + end;
        }
    }
}

/// Where to reach a server that listens on `host:port`: wildcard, missing and `localhost`
/// hosts are reached on 127.0.0.1, literal addresses as they are, other names through the
/// system resolver (blocking: call it off the async workers, e.g. in `spawn_blocking`),
/// falling back to 127.0.0.1 — the server runs on this host.
pub fn connect_address(host: Option<&str>, port: u16) -> SocketAddr {
    let loopback = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port);
    let Some(host) = host
        .map(|host| host.trim_start_matches('[').trim_end_matches(']'))
        .filter(|host| !host.is_empty() && !host.eq_ignore_ascii_case("localhost"))
    else {
        return loopback;
    };
    if let Ok(ip) = host.parse::<IpAddr>() {
        return if ip.is_unspecified() {
            loopback
        } else {
            SocketAddr::new(ip, port)
        };
    }
    (host, port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut addrs| addrs.next())
        .unwrap_or(loopback)
}

/// TCP sockets in LISTEN state that `pid` holds open: the inodes behind its
/// `/proc/<pid>/fd/*` links (`socket:[inode]`) looked up in its network namespace's
/// `/proc/<pid>/net/tcp{,6}`. For `--pid` servers without a Gym config.
pub fn listening_ports(pid: u32) -> io::Result<Vec<SocketAddr>> {
    let mut inodes = Vec::new();
    for entry in fs::read_dir(format!("/proc/{pid}/fd"))?.flatten() {
        // Fds closed since the listing are skipped.
        let Ok(target) = fs::read_link(entry.path()) else {
            continue;
        };
        if let Some(inode) = target
            .to_str()
            .and_then(|t| t.strip_prefix("socket:["))
            .and_then(|t| t.strip_suffix(']'))
            .and_then(|t| t.parse::<u64>().ok())
        {
            inodes.push(inode);
        }
    }
    let mut listening = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = match fs::read_to_string(format!("/proc/{pid}/net/{table}")) {
            Ok(text) => text,
            // No tcp6 where IPv6 is disabled.
            Err(error) if error.kind() == io::ErrorKind::NotFound => continue,
            Err(error) => return Err(error),
        };
        listening.extend(
            text.lines()
                .skip(1)
                .filter_map(parse_tcp_line)
                .filter(|socket| socket.state == TCP_LISTEN && inodes.contains(&socket.inode))
                .map(|socket| socket.local),
        );
    }
    listening.sort();
    listening.dedup();
    Ok(listening)
}

/// `TCP_LISTEN` in include/net/tcp_states.h, as `st` shows it.
const TCP_LISTEN: u8 = 0x0A;

#[derive(Debug, PartialEq, Eq)]
struct TcpSocket {
    local: SocketAddr,
    state: u8,
    inode: u64,
}

/// One line of `/proc/net/tcp` or `tcp6`:
/// `sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode …`.
fn parse_tcp_line(line: &str) -> Option<TcpSocket> {
    let fields: Vec<&str> = line.split_ascii_whitespace().take(10).collect();
    let (addr, port) = fields.get(1)?.split_once(':')?;
    Some(TcpSocket {
        local: SocketAddr::new(parse_hex_ip(addr)?, u16::from_str_radix(port, 16).ok()?),
        state: u8::from_str_radix(fields.get(3)?, 16).ok()?,
        inode: fields.get(9)?.parse().ok()?,
    })
}

/// The kernel prints an address as 32-bit words in host byte order (`%08X` of each
/// `__be32`), so each word's native bytes are the address bytes.
fn parse_hex_ip(hex: &str) -> Option<IpAddr> {
    let word = |i: usize| -> Option<[u8; 4]> {
        let text = hex.get(i * 8..i * 8 + 8)?;
        Some(u32::from_str_radix(text, 16).ok()?.to_ne_bytes())
    };
    match hex.len() {
        8 => Some(IpAddr::V4(Ipv4Addr::from(word(0)?))),
        32 => {
            let mut bytes = [0u8; 16];
            for i in 0..4 {
                bytes[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
            }
            Some(IpAddr::V6(Ipv6Addr::from(bytes)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;
    use tokio::task::JoinHandle;

    /// Serves one connection: reads the request head, then writes `parts` with a short
    /// pause between them, then closes (or, with `hold`, keeps the socket open). Yields
    /// the request and the client's port.
    async fn serve(parts: Vec<Vec<u8>>, hold: bool) -> (SocketAddr, JoinHandle<(String, u16)>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let (socket, peer) = listener.accept().await.unwrap();
            let mut request = Vec::new();
            let mut byte = [0u8; 1];
            while !request.ends_with(b"\r\n\r\n") && read(&socket, &mut byte).await.unwrap() == 1 {
                request.push(byte[0]);
            }
            for part in parts {
                if write_all(&socket, &part).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if hold {
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
            (String::from_utf8(request).unwrap(), peer.port())
        });
        (addr, task)
    }

    fn fast(max_bytes: usize) -> Limits {
        Limits {
            connect: Duration::from_secs(2),
            response: Duration::from_millis(300),
            max_bytes,
        }
    }

    const SPEC: &[u8] = br#"{"openapi":"3.1.0","paths":{"/verify":{"post":{}}}}"#;

    #[tokio::test]
    async fn content_length_body_and_self_port() {
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            SPEC.len()
        );
        let (addr, server) = serve(vec![head.into_bytes(), SPEC.to_vec()], false).await;
        let self_ports = SelfPorts::new();
        let body = fetch_openapi(addr, &self_ports).await.unwrap();
        assert_eq!(body, SPEC);
        let (request, client_port) = server.await.unwrap();
        assert!(
            request.starts_with("GET /openapi.json HTTP/1.1\r\n"),
            "{request}"
        );
        assert!(request.contains(&format!("\r\nHost: {addr}\r\n")));
        assert!(request.contains("\r\nConnection: close\r\n"));
        assert!(request.contains(&format!(
            "User-Agent: gym-tracer/{}",
            env!("CARGO_PKG_VERSION")
        )));
        assert!(self_ports.take(client_port, addr.port()));
        assert!(!self_ports.take(client_port, addr.port()), "used up");
    }

    #[tokio::test]
    async fn chunked_body_split_across_reads() {
        let parts = [
            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"[..],
            b"\r\n1c;ext=1\r\n{\"openapi\":\"3.1.0\",\"paths\"",
            b":{\r",
            b"\n2\r\n}}\r\n0\r\n",
            b"\r\n",
        ];
        let (addr, _server) = serve(parts.iter().map(|p| p.to_vec()).collect(), true).await;
        let body = fetch(addr, &SelfPorts::new(), fast(1 << 20)).await.unwrap();
        assert_eq!(body, br#"{"openapi":"3.1.0","paths":{}}"#);
    }

    #[tokio::test]
    async fn body_until_close() {
        let parts = vec![b"HTTP/1.0 200 OK\r\n\r\n".to_vec(), SPEC.to_vec()];
        let (addr, _server) = serve(parts, false).await;
        assert_eq!(fetch_openapi(addr, &SelfPorts::new()).await.unwrap(), SPEC);
    }

    #[tokio::test]
    async fn not_found_is_an_error_without_body() {
        let parts = vec![
            b"HTTP/1.1 404 Not Found\r\ncontent-length: 22\r\n\r\n{\"detail\":\"Not Found\"}"
                .to_vec(),
        ];
        let (addr, _server) = serve(parts, false).await;
        let error = fetch_openapi(addr, &SelfPorts::new()).await.unwrap_err();
        assert!(matches!(error, HarvestError::Status(404)));
        assert_eq!(error.to_string(), "GET /openapi.json answered HTTP 404");
    }

    #[tokio::test]
    async fn oversize_responses_are_refused() {
        let claim = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n",
            MAX_RESPONSE_BYTES + 1
        );
        let (addr, _server) = serve(vec![claim.into_bytes()], true).await;
        let error = fetch_openapi(addr, &SelfPorts::new()).await.unwrap_err();
        assert!(matches!(error, HarvestError::TooLarge), "{error}");

        let parts = vec![b"HTTP/1.1 200 OK\r\n\r\n".to_vec(), vec![b'x'; 4096]];
        let (addr, _server) = serve(parts, true).await;
        let error = fetch(addr, &SelfPorts::new(), fast(1024))
            .await
            .unwrap_err();
        assert!(matches!(error, HarvestError::TooLarge), "{error}");
    }

    #[tokio::test]
    async fn slow_and_truncated_responses_fail() {
        let parts = vec![b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n12345".to_vec()];
        let (addr, _server) = serve(parts.clone(), true).await;
        let error = fetch(addr, &SelfPorts::new(), fast(1 << 20))
            .await
            .unwrap_err();
        assert!(matches!(error, HarvestError::Timeout), "{error}");

        let (addr, _server) = serve(parts, false).await;
        let error = fetch_openapi(addr, &SelfPorts::new()).await.unwrap_err();
        assert!(matches!(error, HarvestError::Truncated), "{error}");

        let (addr, _server) = serve(vec![b"SSH-2.0-OpenSSH_9.2\r\n\r\n".to_vec()], false).await;
        let error = fetch_openapi(addr, &SelfPorts::new()).await.unwrap_err();
        assert!(matches!(error, HarvestError::Malformed(_)), "{error}");
        assert!(!error.to_string().contains("SSH"));
    }

    #[tokio::test]
    async fn refused_connections_mark_no_port() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let self_ports = SelfPorts::new();
        let error = fetch_openapi(addr, &self_ports).await.unwrap_err();
        assert!(matches!(error, HarvestError::Connect(_)), "{error}");
        assert!(self_ports.ports.lock().unwrap().is_empty());
    }

    #[test]
    fn chunked_decoding_byte_by_byte() {
        let wire = b"5\r\nhello\r\n6;name=v\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\n";
        let mut chunked = Chunked {
            pos: 0,
            body: Vec::new(),
        };
        for end in 0..wire.len() {
            assert!(
                !chunked.advance(&wire[..end]).unwrap(),
                "done early at {end}"
            );
        }
        assert!(chunked.advance(wire).unwrap());
        assert_eq!(chunked.body, b"hello world");

        let mut bad = Chunked {
            pos: 0,
            body: Vec::new(),
        };
        assert!(bad.advance(b"zz\r\n").is_err());
        assert!(
            bad.advance(b"2\r\nabc\r\n").is_err(),
            "data longer than its size"
        );
    }

    #[test]
    fn self_ports_expire() {
        let ports = SelfPorts::with_ttl(Duration::ZERO);
        ports.insert(40000, 8000);
        ports.insert(40001, 8000);
        assert_eq!(
            ports.ports.lock().unwrap().len(),
            1,
            "expired entries are dropped"
        );
        assert!(!ports.take(40001, 8000), "expired");
        let ports = SelfPorts::new();
        let clone = ports.clone();
        clone.insert(40002, 8000);
        assert!(!ports.take(40002, 8001), "another server");
        assert!(ports.take(40002, 8000));
    }

    #[test]
    fn connect_addresses() {
        let v4 = |s: &str| -> SocketAddr { s.parse().unwrap() };
        assert_eq!(connect_address(None, 8000), v4("127.0.0.1:8000"));
        assert_eq!(connect_address(Some(""), 8000), v4("127.0.0.1:8000"));
        assert_eq!(connect_address(Some("0.0.0.0"), 8000), v4("127.0.0.1:8000"));
        assert_eq!(connect_address(Some("::"), 8000), v4("127.0.0.1:8000"));
        assert_eq!(connect_address(Some("[::]"), 8000), v4("127.0.0.1:8000"));
        assert_eq!(
            connect_address(Some("LocalHost"), 8000),
            v4("127.0.0.1:8000")
        );
        assert_eq!(connect_address(Some("127.0.0.2"), 1), v4("127.0.0.2:1"));
        assert_eq!(connect_address(Some("::1"), 9), v4("[::1]:9"));
        assert_eq!(connect_address(Some("[::1]"), 9), v4("[::1]:9"));
        assert_eq!(
            connect_address(Some("no-such-host.invalid"), 7),
            v4("127.0.0.1:7")
        );
    }

    #[test]
    fn tcp_lines_ipv4_and_ipv6() {
        let v4 = "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  \
                  1000        0 123456 1 0000000000000000 100 0 0 10 0";
        assert_eq!(
            parse_tcp_line(v4),
            Some(TcpSocket {
                local: "127.0.0.1:8080".parse().unwrap(),
                state: TCP_LISTEN,
                inode: 123456,
            })
        );
        let established = "   1: 0100007F:4653 0100007F:A4A6 01 00000000:00000000 03:0000136F \
                           00000000     0        0 0 3 000000000ffee417";
        assert_eq!(parse_tcp_line(established).unwrap().state, 0x01);
        let v6_loopback = "   0: 00000000000000000000000001000000:0BB8 \
                           00000000000000000000000000000000:0000 0A 00000000:00000000 \
                           00:00000000 00000000     0        0 777 1 0000000000000000 100 0 0 10 0";
        assert_eq!(
            parse_tcp_line(v6_loopback).unwrap().local,
            "[::1]:3000".parse().unwrap()
        );
        let v6_mapped = "   1: 0000000000000000FFFF00000100007F:0050 \
                         00000000000000000000000000000000:0000 0A 00000000:00000000 \
                         00:00000000 00000000     0        0 778 1 0000000000000000 100 0 0 10 0";
        assert_eq!(
            parse_tcp_line(v6_mapped).unwrap().local,
            "[::ffff:127.0.0.1]:80".parse().unwrap()
        );
        let header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when";
        assert_eq!(parse_tcp_line(header), None);
        assert_eq!(parse_tcp_line(""), None);
    }

    #[test]
    fn listening_ports_of_this_process() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let connected = std::net::TcpStream::connect(addr).unwrap();
        let ports = listening_ports(std::process::id()).unwrap();
        assert!(ports.contains(&addr), "{ports:?} lacks {addr}");
        let client = connected.local_addr().unwrap();
        assert!(
            !ports.contains(&client),
            "a connected socket is not listening"
        );
    }
}
