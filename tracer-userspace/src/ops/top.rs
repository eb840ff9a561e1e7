//! `gym-tracer top`: the live view of a running agent (`GET /rollouts` on its
//! `--health-listen`), as a terminal UI refreshed every second, or one plain snapshot when
//! stdout is not a terminal. A client of the listener only: it works the same against an
//! agent on another host, and never touches a pipeline.

use std::io::{IsTerminal, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Cell, Paragraph, Row, Table};

use crate::config::cli::TopArgs;
use crate::insight::view::{LiveRollout, RolloutsView, ServerLoad};

const REFRESH: Duration = Duration::from_secs(1);
/// How long one fetch may take before the screen says the agent does not answer.
const FETCH_TIMEOUT: Duration = Duration::from_secs(3);
/// The largest answer read (the view lists at most 1,000 rollouts: about 400 KB).
const MAX_BODY_BYTES: u64 = 16 << 20;
/// A server this busy, whose requests wait this long, needs more workers.
const SATURATED_UTILIZATION: f64 = 0.9;
const SATURATED_QUEUE_S: f64 = 1.0;

pub fn run(args: &TopArgs) -> Result<bool> {
    let agent = Agent::parse(&args.agent)?;
    if args.once || !std::io::stdout().is_terminal() {
        let view = agent.fetch()?;
        print!("{}", plain(&agent.url, &view));
        return Ok(true);
    }
    // Fail before the screen is taken over, with the error where the user can read it.
    let first = agent.fetch()?;
    let mut terminal = ratatui::init();
    let result = screen_loop(&mut terminal, &agent, first);
    ratatui::restore();
    result.map(|()| true)
}

fn screen_loop(
    terminal: &mut ratatui::DefaultTerminal,
    agent: &Agent,
    first: RolloutsView,
) -> Result<()> {
    let mut view = first;
    let mut error: Option<String> = None;
    let mut next_fetch = Instant::now() + REFRESH;
    loop {
        terminal.draw(|frame| draw(frame, &agent.url, &view, error.as_deref()))?;
        let wait = next_fetch.saturating_duration_since(Instant::now());
        if event::poll(wait)?
            && let Event::Key(key) = event::read()?
            && key.kind == KeyEventKind::Press
        {
            let ctrl_c =
                key.code == KeyCode::Char('c') && key.modifiers.contains(KeyModifiers::CONTROL);
            if matches!(key.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c {
                return Ok(());
            }
        }
        if Instant::now() >= next_fetch {
            match agent.fetch() {
                Ok(fresh) => {
                    view = fresh;
                    error = None;
                }
                Err(why) => error = Some(format!("{why:#}")),
            }
            next_fetch = Instant::now() + REFRESH;
        }
    }
}

/// The agent's listener: where `GET /rollouts` goes.
struct Agent {
    url: String,
    host_port: String,
}

impl Agent {
    fn parse(text: &str) -> Result<Agent> {
        let rest = text.strip_prefix("http://").unwrap_or(text);
        if text.starts_with("https://") {
            bail!("--agent {text}: the health listener speaks plain HTTP; use http://");
        }
        let host_port = rest.trim_end_matches('/');
        let host_port = if host_port.parse::<u16>().is_ok() {
            format!("127.0.0.1:{host_port}")
        } else {
            host_port.to_owned()
        };
        if host_port.contains('/') || !host_port.contains(':') {
            bail!("--agent {text}: expected http://HOST:PORT, HOST:PORT or a port");
        }
        Ok(Agent {
            url: format!("http://{host_port}"),
            host_port,
        })
    }

    fn fetch(&self) -> Result<RolloutsView> {
        let hint = || {
            format!(
                "no live view from the agent at {} (is `gym-tracer run --health-listen {}` running there?)",
                self.url, self.host_port
            )
        };
        let address = self
            .host_port
            .to_socket_addrs()
            .with_context(hint)?
            .next()
            .with_context(hint)?;
        let mut stream = TcpStream::connect_timeout(&address, FETCH_TIMEOUT).with_context(hint)?;
        stream.set_read_timeout(Some(FETCH_TIMEOUT))?;
        stream.set_write_timeout(Some(FETCH_TIMEOUT))?;
        write!(
            stream,
            "GET /rollouts HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            self.host_port
        )
        .with_context(hint)?;
        let mut answer = Vec::new();
        stream
            .take(MAX_BODY_BYTES)
            .read_to_end(&mut answer)
            .with_context(hint)?;
        let split = answer
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .with_context(|| format!("{}: the answer has no HTTP head", self.url))?;
        let head = String::from_utf8_lossy(&answer[..split]);
        let status = head.lines().next().unwrap_or_default();
        if !status.contains(" 200 ") {
            bail!(
                "{}/rollouts answered {status:?}: is this a gym-tracer agent (0.1 or later)?",
                self.url
            );
        }
        serde_json::from_slice(&answer[split + 4..])
            .with_context(|| format!("{}/rollouts: not the live view's JSON", self.url))
    }
}

fn seconds(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_owned(), |s| format!("{s:.1} s"))
}

fn summary_line(url: &str, view: &RolloutsView) -> String {
    printable(&summary_text(url, view))
}

fn summary_text(url: &str, view: &RolloutsView) -> String {
    let completed = &view.completed;
    let stragglers = view.rollouts.iter().filter(|r| r.straggler).count();
    format!(
        "gym-tracer top — {url} — {} rollouts in flight ({stragglers} straggling) · {} completed: p50 {}, p90 {}, max {}",
        view.in_flight,
        completed.count,
        seconds(completed.p50_s),
        seconds(completed.p90_s),
        seconds(completed.max_s),
    )
}

const ROLLOUT_HEADER: [&str; 8] = [
    "ROLLOUT", "AGENT", "ELAPSED", "PHASE", "NOW IN", "MODEL", "TOOLS", "",
];
const SERVER_HEADER: [&str; 7] = [
    "SERVER",
    "TYPE",
    "PID",
    "LOOP BUSY",
    "QUEUE p90",
    "IN FLIGHT",
    "",
];

/// Text from the wire and from other hosts' configs, made safe for a terminal: a control
/// character could move the cursor or recolour the screen.
fn printable(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

fn rollout_cells(rollout: &LiveRollout) -> [String; 8] {
    rollout_cells_raw(rollout).map(|cell| printable(&cell))
}

fn rollout_cells_raw(rollout: &LiveRollout) -> [String; 8] {
    let span = &rollout.span;
    let now_in = match &span.peer {
        Some(peer) => format!("{} {} → {}", span.name, span.server, peer),
        None => format!("{} @ {}", span.name, span.server),
    };
    [
        rollout.rollout_id.clone().unwrap_or_else(|| "?".to_owned()),
        rollout.agent.clone(),
        format!("{:.1} s", rollout.elapsed_s),
        rollout.phase.clone(),
        now_in,
        rollout.model_calls.to_string(),
        rollout.tool_calls.to_string(),
        if rollout.straggler {
            "STRAGGLER".to_owned()
        } else {
            String::new()
        },
    ]
}

fn saturated(server: &ServerLoad) -> bool {
    server.loop_utilization.unwrap_or(0.0) >= SATURATED_UTILIZATION
        && server.queue_delay_p90_s.unwrap_or(0.0) >= SATURATED_QUEUE_S
}

fn server_cells(server: &ServerLoad) -> [String; 7] {
    server_cells_raw(server).map(|cell| printable(&cell))
}

fn server_cells_raw(server: &ServerLoad) -> [String; 7] {
    [
        server.name.clone(),
        server.server_type.clone().unwrap_or_else(|| "?".to_owned()),
        server.pid.to_string(),
        server
            .loop_utilization
            .map_or_else(|| "-".to_owned(), |u| format!("{:.0} %", u * 100.0)),
        seconds(server.queue_delay_p90_s),
        server.requests_in_flight.to_string(),
        if saturated(server) {
            "SATURATED: add workers".to_owned()
        } else {
            String::new()
        },
    ]
}

/// One snapshot as plain text: what a non-terminal gets.
fn plain(url: &str, view: &RolloutsView) -> String {
    let mut text = summary_line(url, view);
    text.push_str("\n\n");
    text.push_str(&columns(
        &ROLLOUT_HEADER,
        view.rollouts.iter().map(rollout_cells).collect(),
    ));
    text.push('\n');
    text.push_str(&columns(
        &SERVER_HEADER,
        view.servers.iter().map(server_cells).collect(),
    ));
    text
}

/// Rows padded into columns, the header first.
fn columns<const N: usize>(header: &[&str; N], rows: Vec<[String; N]>) -> String {
    let mut widths = header.map(str::len);
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut text = String::new();
    let header = header.map(str::to_owned);
    for row in std::iter::once(&header).chain(&rows) {
        let line: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        text.push_str(line.join("  ").trim_end());
        text.push('\n');
    }
    text
}

/// The width of a column: its widest cell, or its header.
fn column_width<'a>(header: &str, cells: impl Iterator<Item = &'a str>) -> u16 {
    let widest = cells.map(|cell| cell.chars().count()).max().unwrap_or(0);
    u16::try_from(widest.max(header.len())).unwrap_or(u16::MAX)
}

fn draw(frame: &mut ratatui::Frame<'_>, url: &str, view: &RolloutsView, error: Option<&str>) {
    let server_rows = view.servers.len() as u16 + 3;
    let [top, rollouts, servers, bottom] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Min(4),
        Constraint::Length(server_rows),
        Constraint::Length(1),
    ])
    .areas(frame.area());
    frame.render_widget(Paragraph::new(summary_line(url, view)), top);
    let bold = Style::default().add_modifier(Modifier::BOLD);
    let rollout_rows: Vec<Row<'_>> = view
        .rollouts
        .iter()
        .map(|rollout| {
            let style = if rollout.straggler {
                Style::default().fg(Color::Red).add_modifier(Modifier::BOLD)
            } else {
                Style::default()
            };
            Row::new(rollout_cells(rollout).map(Cell::from)).style(style)
        })
        .collect();
    let agent_width = column_width(
        ROLLOUT_HEADER[1],
        view.rollouts.iter().map(|r| r.agent.as_str()),
    );
    let rollout_table = Table::new(
        rollout_rows,
        [
            Constraint::Length(14),
            Constraint::Length(agent_width.saturating_add(1)),
            Constraint::Length(9),
            Constraint::Length(9),
            Constraint::Min(30),
            Constraint::Length(6),
            Constraint::Length(6),
            Constraint::Length(10),
        ],
    )
    .header(Row::new(ROLLOUT_HEADER).style(bold))
    .block(Block::bordered().title(" rollouts in flight, slowest first "));
    frame.render_widget(rollout_table, rollouts);
    let server_table_rows: Vec<Row<'_>> = view
        .servers
        .iter()
        .map(|server| {
            let style = if saturated(server) {
                Style::default()
                    .fg(Color::Yellow)
                    .add_modifier(Modifier::BOLD)
            } else {
                Style::default()
            };
            Row::new(server_cells(server).map(Cell::from)).style(style)
        })
        .collect();
    let name_width = column_width(
        SERVER_HEADER[0],
        view.servers.iter().map(|s| s.name.as_str()),
    );
    let server_table = Table::new(
        server_table_rows,
        [
            Constraint::Length(name_width.saturating_add(1)),
            Constraint::Length(10),
            Constraint::Length(8),
            Constraint::Length(10),
            Constraint::Length(10),
            Constraint::Length(10),
            Constraint::Length(24),
        ],
    )
    .header(Row::new(SERVER_HEADER).style(bold))
    .block(Block::bordered().title(" servers "));
    frame.render_widget(server_table, servers);
    let status = match error {
        Some(error) => Line::styled(error.to_owned(), Style::default().fg(Color::Red)),
        None => Line::from("q quits · refreshed every second"),
    };
    frame.render_widget(Paragraph::new(status), bottom);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::insight::view::{Completed, LiveSpan};

    #[test]
    fn agent_addresses_are_read_in_every_spelling_the_help_names() {
        for (text, want) in [
            ("9464", "http://127.0.0.1:9464"),
            ("10.0.0.5:9464", "http://10.0.0.5:9464"),
            ("http://node-3:9464/", "http://node-3:9464"),
        ] {
            assert_eq!(Agent::parse(text).unwrap().url, want);
        }
        for bad in ["https://node:9464", "node", "http://node:9464/rollouts"] {
            assert!(Agent::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_plain_snapshot_lists_rollouts_and_marks_stragglers_and_saturation() {
        let view = RolloutsView {
            in_flight: 1,
            rollouts: vec![LiveRollout {
                rollout_id: Some("0-7".into()),
                trace_id: "ab".repeat(16),
                agent: "simple_agent".into(),
                elapsed_s: 12.34,
                phase: "model".into(),
                span: LiveSpan {
                    name: "HTTP POST".into(),
                    server: "policy_model".into(),
                    peer: Some("127.0.0.1:8000\u{1b}[2J".into()),
                },
                model_calls: 2,
                tool_calls: 1,
                straggler: true,
            }],
            completed: Completed {
                count: 40,
                p50_s: Some(3.0),
                p90_s: Some(4.0),
                max_s: Some(5.5),
            },
            servers: vec![ServerLoad {
                name: "simple_agent".into(),
                pid: 42,
                server_type: Some("agent".into()),
                loop_utilization: Some(0.97),
                queue_delay_p90_s: Some(2.5),
                requests_in_flight: 300,
            }],
        };
        let text = plain("http://127.0.0.1:9464", &view);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "gym-tracer top — http://127.0.0.1:9464 — 1 rollouts in flight (1 straggling) · 40 completed: p50 3.0 s, p90 4.0 s, max 5.5 s"
        );
        assert!(lines[2].starts_with("ROLLOUT  AGENT"), "{}", lines[2]);
        assert_eq!(
            lines[3],
            "0-7      simple_agent  12.3 s   model  HTTP POST policy_model → 127.0.0.1:8000?[2J  2      1      STRAGGLER"
        );
        assert_eq!(
            lines[6],
            "simple_agent  agent  42   97 %       2.5 s      300        SATURATED: add workers"
        );
    }
}
