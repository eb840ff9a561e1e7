//! The agent's own counters: what came in, what was exported, and everything dropped, by
//! reason. Printed on shutdown so that no loss is silent.

use std::fmt;

use crate::http::ParseError;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub events_in: u64,
    pub events_undecodable: u64,
    /// Records the kernel could not put on the full ring buffer (summed over CPUs).
    pub events_lost_in_kernel: u64,
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
    pub connections_dropped: u64,
    pub connections_not_http: u64,
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

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "events_in={} events_lost_in_kernel={} events_undecodable={} exchanges={} \
             spans_queued={} spans_dropped_queue_full={} parse_errors(not_http={} head_too_large={} \
             uncaptured_start={} lost_chunk_framing={}) data_without_connection={} \
             responses_without_request={} requests_dropped_overflow={} connections_dropped={} \
             connections_not_http={}",
            self.events_in,
            self.events_lost_in_kernel,
            self.events_undecodable,
            self.exchanges,
            self.spans_queued,
            self.spans_dropped_queue_full,
            self.parse_not_http,
            self.parse_head_too_large,
            self.parse_uncaptured_start,
            self.parse_lost_chunk_framing,
            self.data_without_connection,
            self.responses_without_request,
            self.requests_dropped_overflow,
            self.connections_dropped,
            self.connections_not_http,
        )
    }
}
