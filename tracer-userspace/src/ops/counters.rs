//! One snapshot of every stage's counters: what came in, what was exported, and everything
//! dropped, by reason. `/metrics`, the self-telemetry, the exit summary and the summary
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
        /// Processes attached: each `--pid`, and each server `--discover` found. Their forked
        /// children are counted in `forks_followed` instead.
        traced processes_attached,
        /// Traced processes that exited. Not a loss: expected whenever servers stop or restart;
        /// requests they still had in flight are exported as aborted.
        note processes_exited,
        /// Discovered servers that could not be added to the kernel's PID filter. Usually the
        /// filter is full: it holds 8,192 processes (`MAX_TRACED_PIDS`), forked children included.
        /// The log names each server and the error.
        lost processes_not_traced,
        /// Servers whose route table (`/openapi.json`) named their spans.
        traced route_tables_harvested,
        /// Servers whose route table (`/openapi.json`) could not be read. Their spans are named
        /// from `--route` and Gym's known routes. The log says why (not a FastAPI server, no
        /// answer, or a port the agent cannot reach from its network namespace); give templates
        /// with `--route`, or skip the fetch with `--no-route-harvest`.
        note route_harvests_failed,
        /// Spans handed to the exporter's queue.
        traced spans_queued,
        /// Spans dropped because the export queue (`--export-queue-size`) was full. The export task
        /// fell behind (stdout read too slowly, or a collector slow to answer): raise
        /// `--export-queue-size`, or speed up what reads the output.
        lost spans_dropped_queue_full,
        /// Handler traces the kernel's injection map had no room for. With `--inject-traceparent`,
        /// the map holds 16,384 traces; those handlers' calls leave without a `traceparent`, so a
        /// callee on another host does not join their trace.
        lost traces_not_published,
    }
}

counters! {
    /// What the kernel and /proc report.
    pub struct HostCounters {
        /// Records the kernel could not put on the full ring buffer, summed over CPUs. The requests
        /// and connections they carried are missing or cut short: raise `--ring-buffer-bytes`
        /// (`events_lost_by_cpu` shows whether one CPU loses alone).
        lost events_lost_in_kernel,
        /// Threads started by traced processes (followed through their process). Not a loss: only
        /// new processes take an entry in the PID filter.
        note fork_threads_ignored,
        /// Children of traced processes the full PID filter could not take. They and their
        /// children are not traced: their calls are missing. The filter holds 8,192 processes
        /// (`MAX_TRACED_PIDS`), children included; a child leaves it at its exit.
        lost forks_unfollowed_filter_full,
        /// Processes `--discover` skipped because it could not read their environment. A Gym server
        /// among them is not traced: grant `CAP_SYS_PTRACE` and `CAP_DAC_READ_SEARCH` and run the
        /// agent in the host's PID namespace (`gym-tracer doctor` checks both). Other processes
        /// count too, so a small number with every server traced is harmless.
        note environ_unreadable,
        /// Connections the kernel did not follow because its socket map was full. Their requests
        /// are not traced: raise `--max-connections` (the kernel's map holds twice as many
        /// sockets).
        lost sockets_untracked_map_full,
        /// Reads and writes on TCP sockets the kernel does not follow. Their requests are not
        /// traced. Expected for connections a traced process opened before the agent attached
        /// (keep-alive pools), which are never followed: start the agent before the Gym servers;
        /// otherwise see `sockets_untracked_map_full`.
        lost transfers_on_unknown_sockets,
        /// Socket calls the kernel did not follow: its pending-call map was full. The map holds one
        /// entry per thread of the traced processes (16,384, `MAX_PENDING_CALLS`); the calls missed
        /// are not traced. If it moves with fewer threads than that, report a bug with the agent's
        /// log.
        lost socket_calls_untracked_map_full,
        /// Kernel map entries deleted for processes and threads that ended. Not a loss:
        /// housekeeping for what they left open.
        note kernel_entries_swept,
        /// Traced CPython processes whose running task's context the kernel reads.
        traced python_runtimes_read,
        /// Traced CPython processes whose runtime this build cannot read. No task contexts there:
        /// the log and `gym-tracer doctor --pid PID` name the reason (a version other than 3.12 to
        /// 3.14, free-threaded, stripped, or `CAP_SYS_PTRACE` missing). Their calls are placed by
        /// rollout id, the only request in flight or nesting alone, so more are left undecided.
        note python_runtimes_off,
        /// Traced processes that are not CPython: no task contexts read there. Not a loss; their
        /// calls are placed by rollout id, the only request in flight or nesting.
        note python_processes_not_python,
        /// CPython threads handed to the kernel for task-context reads.
        traced python_threads_registered,
        /// CPython threads the kernel's context-read map had no room for. The map holds 16,384
        /// threads (`MAX_PYTHON_THREADS`) and a thread is counted again at each rescan (every 5 s);
        /// its writes carry no task context, so more calls are left undecided.
        note python_threads_not_registered,
        /// Message-start writes at which the kernel read the writing task's context.
        traced context_chains_read,
        /// Message-start writes by registered threads with no readable context. Reported with no
        /// chain: that write gives no task-context evidence. Not a loss; the call is placed by
        /// other evidence.
        note context_chains_empty,
        /// Message-start writes by threads the kernel has no context-read entry for. Nothing read.
        /// Expected in processes that are not CPython or whose runtime is off, and for threads
        /// started since the last rescan (every 5 s).
        note context_thread_unknown,
        /// Context-chain walks stopped at an object that was not a `Context`. The chain keeps the
        /// links read before it. Rare: a count that grows with traffic points at a runtime layout
        /// this build misreads; report a bug with the agent's log.
        note context_not_a_context,
        /// Context-chain walks stopped by a failed memory read. The chain keeps the links read
        /// before it. Rare (memory paged out); the call is placed by other evidence.
        note context_reads_failed,
        /// Task-context records the full ring buffer refused. Also in `events_lost_in_kernel`;
        /// their writes carry no task context: raise `--ring-buffer-bytes`.
        lost context_records_lost,
        /// Requests that left with a `traceparent` inserted (`--inject-traceparent`).
        traced traceparents_injected,
        /// Calls on this host sent unchanged under `--inject-traceparent remote`. Their trace is
        /// handed to the callee's first read in the kernel instead, so that the callee's own calls
        /// to another host carry it.
        traced traceparents_handed_over,
        /// Requests sent without a `traceparent`: their handler's trace was not known. Its task
        /// descends from no request the kernel saw: a background task, a worker thread, a process
        /// without task lineage.
        note traceparents_not_known,
        /// Requests that already carried a `traceparent`: left as they were. Not a loss: the
        /// caller's own instrumentation names the parent.
        note traceparents_carried,
        /// Requests sent unchanged: their head did not end in the first 1,024 bytes. A
        /// `traceparent` could hide past them, so none is inserted; expected for very large heads
        /// or heads written in pieces.
        note traceparents_head_unscanned,
        /// Requests sent unchanged: their handler's request was already answered. The handler's
        /// context may belong to another request by then, so its trace is withdrawn; expected for
        /// calls made after the response (background work).
        note traceparents_owner_answered,
        /// Requests sent unchanged: their socket was not in the injection map. Expected for
        /// connections opened before the agent started (keep-alive pools); otherwise see
        /// `inject_sockets_map_full`.
        note traceparents_not_delivered,
        /// Requests sent unchanged: the `sk_msg` program could not insert the line. It found the
        /// bytes changed, or the insert failed. Should stay near 0; if it grows, report a bug with
        /// the agent's log.
        lost traceparents_failed,
        /// Traced client sockets the injection map had no room for (65,536 sockets). Their requests
        /// go out without a `traceparent` (counted in `traceparents_not_delivered`).
        lost inject_sockets_map_full,
        /// Processes whose task creations are probed (`--task-lineage`).
        traced lineage_processes,
        /// Processes wanting task lineage whose interpreter the probe cannot serve. The log and
        /// `gym-tracer doctor --pid PID` name the reason (CPython other than 3.12 or 3.13, no
        /// symbols, layout not confirmed, task-context reads off); their calls are placed by the
        /// other evidence.
        note lineage_processes_off,
        /// Tasks the lineage probe saw created, in all. Each cost its server one uprobe trap; the
        /// next six counters split them by what the probe found.
        traced lineage_tasks_probed,
        /// Request tasks created for the inbound request their thread was reading. The normal case:
        /// their calls hang under that request (`parents_by_lineage`).
        note lineage_request_roots,
        /// Request tasks created while no inbound request was being read. A pipelined request, or a
        /// read on a socket the kernel does not follow; their calls wait for a response one of
        /// their tasks writes to name the request.
        note lineage_roots_without_request,
        /// Tasks created outside any task that are no request's root. Timers and background loops:
        /// not a loss, their calls belong to no request (`lineage_calls_background`).
        note lineage_other_roots,
        /// Tasks that took their creator's lineage. The normal case: a handler's child tasks
        /// (`asyncio.gather`, `TaskGroup`, middleware).
        note lineage_inherited,
        /// Tasks whose creator had no recorded lineage, so neither do they. Expected for tasks of
        /// creators started before the probe; otherwise the creator was forgotten: raise
        /// `--max-tasks`.
        note lineage_creator_unseen,
        /// Tasks whose creator could not be read, so they have no lineage. Rare; their calls are
        /// placed by the other evidence.
        note lineage_creator_unreadable,
        /// Task lineages deleted from the kernel for processes that are gone. They exited or
        /// replaced their program. Not a loss: housekeeping.
        note lineage_tasks_forgotten,
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
    /// exit summary and the summary file and, prefixed `gym_tracer_` with `_total`, the
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
