//! One snapshot of every stage's counters: what came in, what was exported, and everything
//! dropped, by reason. `/metrics`, the self-telemetry, the `stopped.` line and the summary
//! file all read it, so that no loss is silent and no two places name a counter differently.

use std::fmt;

use crate::insight::InsightCounters;
use crate::model::counters::{Counters, counters};
use crate::pipeline::PipelineCounters;
use crate::processes::tls_library::TlsProbeCounters;
use crate::reassembly::connections::ReassemblyCounters;
use crate::reassembly::tls::TlsCounters;
use crate::stitch::StitchCounters;

counters! {
    /// What the agent itself counts around the pipeline: processes it attached and lost,
    /// route harvests, and the hand-off of spans to the exporters.
    pub struct AgentCounters {
        processes_attached,
        processes_exited,
        /// Discovered servers that could not be added to the kernel's PID filter (full).
        processes_not_traced,
        route_tables_harvested,
        route_harvests_failed,
        spans_queued,
        spans_dropped_queue_full,
        /// `--inject-traceparent`: handler traces the kernel's map had no room for (their
        /// calls leave unchanged).
        traces_not_published,
    }
}

counters! {
    /// What the kernel and /proc report.
    pub struct HostCounters {
        /// Records the kernel could not put on the full ring buffer (summed over CPUs).
        events_lost_in_kernel,
        /// Threads a traced process started: the kernel keeps them out of the PID filter
        /// (only new processes are followed).
        fork_threads_ignored,
        /// Processes whose environment discovery could not read.
        environ_unreadable,
        /// Connections the kernel did not follow: its socket map (`--max-connections`) was
        /// full.
        sockets_untracked_map_full,
        /// Transfers of traced processes on TCP sockets the kernel did not know (opened
        /// before tracing began, or not followed as above): requests on them are not traced.
        transfers_on_unknown_sockets,
        /// Socket calls the kernel did not follow: its pending-call map was full.
        socket_calls_untracked_map_full,
        /// Kernel map entries deleted for processes and threads that ended without closing
        /// them (not a loss).
        kernel_entries_swept,
        /// Traced CPython processes whose running task's context the kernel reads.
        python_runtimes_read,
        /// Traced CPython processes whose runtime this build could not use (unknown version,
        /// free-threaded, stripped, ...): no context reads there. The log names the reason.
        python_runtimes_off,
        /// Traced processes that are not CPython (no context reads; not a loss).
        python_processes_not_python,
        /// CPython threads handed to the kernel's context-read map.
        python_threads_registered,
        /// CPython threads the kernel's context-read map had no room for.
        python_threads_not_registered,
        /// Message-start writes at which the kernel read a task-context chain.
        context_chains_read,
        /// Message-start writes of registered threads with no current context (or an
        /// unreadable one): reported with no chain.
        context_chains_empty,
        /// Message-start writes of threads without an entry (not CPython, runtime off, or
        /// started since the last rescan): nothing read.
        context_thread_unknown,
        /// Chain walks stopped at an object that was not a `Context`.
        context_not_a_context,
        /// Chain walks stopped by a failed read.
        context_reads_failed,
        /// Context records the full ring buffer refused (also in events_lost_in_kernel).
        context_records_lost,
        /// `--inject-traceparent`: requests that left with a `traceparent` line inserted.
        traceparents_injected,
        /// Requests written before their handler's request (and so its trace) was known:
        /// sent unchanged.
        traceparents_not_known,
        /// Requests that carried a `traceparent` of their own: left as they were.
        traceparents_carried,
        /// Requests whose request line or head end was not within the write's first
        /// 1,024 bytes: sent unchanged (a `traceparent` could hide past them).
        traceparents_head_unscanned,
        /// Requests from a task whose published request had already been answered (its
        /// context's address now another request's): sent unchanged.
        traceparents_owner_answered,
        /// Requests armed on sockets outside the injection map (connected before the agent
        /// started): sent unchanged.
        traceparents_not_delivered,
        /// Requests the `sk_msg` program found changed or could not insert into: unchanged.
        traceparents_failed,
        /// Traced client sockets the injection map had no room for.
        inject_sockets_map_full,
        /// `--task-lineage`: processes whose task creations are probed.
        lineage_processes,
        /// Processes that want lineage but whose interpreter the probe cannot serve (unknown
        /// version, no symbols, layout not confirmed, ...): the log names the reason.
        lineage_processes_off,
        /// Tasks the probe saw created, in all (the trap each one cost its server).
        lineage_tasks_probed,
        /// Of those: request roots born for a known inbound request,
        lineage_request_roots,
        /// request roots created where no inbound request was being read (a pipelined
        /// request; a read on a socket the kernel does not follow),
        lineage_roots_without_request,
        /// tasks created outside any task that are no request's root (timers, background),
        lineage_other_roots,
        /// tasks that took their creator's lineage,
        lineage_inherited,
        /// tasks whose creator had no recorded lineage (created before the probe, or
        /// forgotten to --max-tasks),
        lineage_creator_unseen,
        /// tasks whose creator could not be read.
        lineage_creator_unreadable,
        /// Lineages deleted from the kernel for processes that are gone (not a loss).
        lineage_tasks_forgotten,
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    pub host: HostCounters,
    pub pipeline: PipelineCounters,
    pub reassembly: ReassemblyCounters,
    pub tls: TlsCounters,
    pub tls_probes: TlsProbeCounters,
    pub stitch: StitchCounters,
    pub insight: InsightCounters,
    pub agent: AgentCounters,
    /// Records lost per CPU (index = CPU number): a CPU that loses alone points at a hot core.
    pub events_lost_by_cpu: Vec<u64>,
}

impl Counters for CounterSnapshot {
    fn for_each(&self, visit: &mut dyn FnMut(&'static str, u64)) {
        self.host.for_each(visit);
        self.pipeline.for_each(visit);
        self.reassembly.for_each(visit);
        self.tls.for_each(visit);
        self.tls_probes.for_each(visit);
        self.stitch.for_each(visit);
        self.insight.for_each(visit);
        self.agent.for_each(visit);
    }
}

impl CounterSnapshot {
    /// Every counter by name, in the order they are printed. The names are the keys of the
    /// shutdown line and the summary file and, prefixed `gym_tracer_` with `_total`, the
    /// Prometheus counters.
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        let mut all = Vec::with_capacity(48);
        self.for_each(&mut |name, value| all.push((name, value)));
        all
    }
}

impl fmt::Display for CounterSnapshot {
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

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn every_counter_has_one_name() {
        let names: Vec<_> = CounterSnapshot::default()
            .counters()
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        let unique: HashSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "a name twice: {names:?}");
        for name in [
            "events_in",
            "parse_not_http",
            "parents_ambiguous",
            "spans_queued",
            "sockets_untracked_map_full",
            "transfers_on_unknown_sockets",
            "socket_calls_untracked_map_full",
        ] {
            assert!(names.contains(&name), "{name} missing");
        }
    }
}
