//! The agent's own counters: what came in, what was exported, and everything dropped, by
//! reason. Printed on shutdown so that no loss is silent.

use std::fmt;

use crate::http::ParseError;
use crate::stitch::StitchStats;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub events_in: u64,
    pub events_undecodable: u64,
    /// Records the kernel could not put on the full ring buffer (summed over CPUs).
    pub events_lost_in_kernel: u64,
    /// The same, per CPU (index = CPU number): a CPU that loses alone points at a hot core.
    pub events_lost_by_cpu: Vec<u64>,
    pub exchanges: u64,
    pub spans_queued: u64,
    pub spans_dropped_queue_full: u64,
    pub parse_not_http: u64,
    pub parse_head_too_large: u64,
    pub parse_uncaptured_start: u64,
    pub parse_lost_chunk_framing: u64,
    pub data_without_connection: u64,
    pub responses_without_request: u64,
    pub requests_dropped_overflow: u64,
    /// Connections not tracked because the table had nothing to evict (`--max-connections 0`).
    pub connections_dropped: u64,
    /// Connections evicted, least recently active first, to make room in a full table.
    pub connections_evicted: u64,
    /// Of those, evicted because all connections together buffered too many bytes (partial
    /// heads): `MAX_BUFFERED_BYTES` in connections.rs.
    pub connections_evicted_for_memory: u64,
    /// Requests in flight on evicted connections, exported as aborted (`tracer_evicted`).
    pub requests_evicted: u64,
    pub connections_not_http: u64,
    pub processes_attached: u64,
    pub processes_exited: u64,
    /// Traced processes that replaced their program (`execve`); their connections ended.
    pub processes_execd: u64,
    /// Discovered servers that could not be added to the kernel's PID filter (full).
    pub processes_not_traced: u64,
    pub forks_followed: u64,
    /// Fork events that were new threads of a traced process, not new processes.
    pub fork_threads_ignored: u64,
    /// The agent's own requests to the servers (route harvest), not exported.
    pub self_requests_ignored: u64,
    pub route_tables_harvested: u64,
    pub route_harvests_failed: u64,
    /// Requests named by their method alone: past the per-process cap on guessed routes.
    pub requests_unnamed: u64,
    /// Processes whose environment discovery could not read.
    pub environ_unreadable: u64,
    /// Server addresses not remembered for `peer.service`: past the cap of
    /// `MAX_PEER_NAMES` in agent.rs.
    pub peer_names_dropped: u64,
    pub stitch: StitchStats,
}

impl Stats {
    pub fn count_parse_error(&mut self, error: ParseError) {
        match error {
            ParseError::NotHttp => self.parse_not_http += 1,
            ParseError::HeadTooLarge => self.parse_head_too_large += 1,
            ParseError::UncapturedStart => self.parse_uncaptured_start += 1,
            ParseError::LostChunkFraming => self.parse_lost_chunk_framing += 1,
        }
    }
}

impl Stats {
    /// Every counter by name, in the order they are printed. The names are the keys of the
    /// shutdown line and, prefixed `gym_tracer_` with `_total`, the Prometheus counters.
    pub fn counters(&self) -> [(&'static str, u64); 38] {
        [
            ("events_in", self.events_in),
            ("events_lost_in_kernel", self.events_lost_in_kernel),
            ("events_undecodable", self.events_undecodable),
            ("exchanges", self.exchanges),
            ("spans_queued", self.spans_queued),
            ("spans_dropped_queue_full", self.spans_dropped_queue_full),
            ("parse_not_http", self.parse_not_http),
            ("parse_head_too_large", self.parse_head_too_large),
            ("parse_uncaptured_start", self.parse_uncaptured_start),
            ("parse_lost_chunk_framing", self.parse_lost_chunk_framing),
            ("data_without_connection", self.data_without_connection),
            ("responses_without_request", self.responses_without_request),
            ("requests_dropped_overflow", self.requests_dropped_overflow),
            ("connections_dropped", self.connections_dropped),
            ("connections_evicted", self.connections_evicted),
            (
                "connections_evicted_for_memory",
                self.connections_evicted_for_memory,
            ),
            ("requests_evicted", self.requests_evicted),
            ("connections_not_http", self.connections_not_http),
            ("processes_attached", self.processes_attached),
            ("processes_exited", self.processes_exited),
            ("processes_execd", self.processes_execd),
            ("processes_not_traced", self.processes_not_traced),
            ("forks_followed", self.forks_followed),
            ("fork_threads_ignored", self.fork_threads_ignored),
            ("self_requests_ignored", self.self_requests_ignored),
            ("route_tables_harvested", self.route_tables_harvested),
            ("route_harvests_failed", self.route_harvests_failed),
            ("requests_unnamed", self.requests_unnamed),
            ("environ_unreadable", self.environ_unreadable),
            ("cross_process_links", self.stitch.cross_process_links),
            ("parents_ambiguous", self.stitch.parents_ambiguous),
            ("parents_contradicted", self.stitch.parents_contradicted),
            ("parents_none", self.stitch.parents_none),
            (
                "spans_flushed_unmatched",
                self.stitch.spans_flushed_unmatched,
            ),
            ("spans_released_early", self.stitch.spans_released_early),
            ("stitch_nodes_evicted", self.stitch.nodes_evicted),
            ("stitch_keys_evicted", self.stitch.keys_evicted),
            ("peer_names_dropped", self.peer_names_dropped),
        ]
    }
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, (name, value)) in self.counters().iter().enumerate() {
            let separator = if index == 0 { "" } else { " " };
            write!(f, "{separator}{name}={value}")?;
        }
        // `cpu:lost` pairs, e.g. `events_lost_by_cpu=0:0,1:12`.
        f.write_str(" events_lost_by_cpu=")?;
        for (cpu, lost) in self.events_lost_by_cpu.iter().enumerate() {
            let separator = if cpu == 0 { "" } else { "," };
            write!(f, "{separator}{cpu}:{lost}")?;
        }
        Ok(())
    }
}
