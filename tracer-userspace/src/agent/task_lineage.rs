//! Which traced processes carry the task-creation probe (`--task-lineage`): a process that
//! wants it (see [`wanted`]) is probed once its CPython runtime is recognised (the context
//! reads, [`super::context_reads`]) and it has imported asyncio; its forked workers too. A
//! process whose interpreter the probe cannot serve is said once, by reason, and counted.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use anyhow::Result;
use tracer_abi::AsyncioProcess;

use super::context_reads::RuntimeView;
use crate::config::cli::TaskLineageMode;
use crate::kernel::loader::{LoadedProbes, uprobe_refusal_hint};
use crate::processes::discovery::GymServer;
use crate::processes::identity::parent_pid;
use crate::processes::python::PythonRuntime;
use crate::processes::python::asyncio::{LineageOff, TASK_INIT_SYMBOL, asyncio_site};
use crate::processes::tls_library::path_in_process;

/// Looks at a wanted process that has not imported asyncio yet, at most this many rescans
/// (a Gym server imports it before it listens).
const ATTEMPTS: u32 = 12;

/// Attaching the probe (a trait so the bookkeeping can be tested without a kernel).
pub trait TaskProbeAttacher {
    type Link;
    fn attach_task_probe(
        &mut self,
        pid: u32,
        layout: AsyncioProcess,
        file: &Path,
        symbol: &str,
    ) -> Result<Self::Link>;
    /// Takes the probe back and deletes the process's lineages; returns how many.
    fn forget_task_probe(&mut self, pid: u32, link: Option<Self::Link>) -> u64;
}

impl TaskProbeAttacher for LoadedProbes {
    type Link = aya::programs::uprobe::UProbeLinkId;

    fn attach_task_probe(
        &mut self,
        pid: u32,
        layout: AsyncioProcess,
        file: &Path,
        symbol: &str,
    ) -> Result<Self::Link> {
        LoadedProbes::attach_task_probe(self, pid, layout, file, symbol)
    }

    fn forget_task_probe(&mut self, pid: u32, link: Option<Self::Link>) -> u64 {
        LoadedProbes::forget_task_probe(self, pid, link)
    }
}

/// Whether `--task-lineage` wants a process probed: `on`, every one; `auto`, the Gym servers
/// [`GymServer::wants_task_lineage`] names.
pub fn wanted(mode: TaskLineageMode, server: Option<&GymServer>) -> bool {
    match mode {
        TaskLineageMode::On => true,
        TaskLineageMode::Off => false,
        TaskLineageMode::Auto => server.is_some_and(GymServer::wants_task_lineage),
    }
}

/// What the agent counts about the probe's processes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LineageCounters {
    /// Processes whose task creations are probed.
    pub lineage_processes: u64,
    /// Wanted processes the probe cannot serve (any reason; the log line and `doctor --pid`
    /// name it).
    pub lineage_processes_off: u64,
    /// Lineages deleted from the kernel for processes that are gone.
    pub lineage_tasks_forgotten: u64,
}

enum State<L> {
    Probed(L),
    /// Not probed yet: looked at `attempts` times.
    Waiting {
        attempts: u32,
    },
    Off,
}

pub struct TaskLineages<L> {
    mode: TaskLineageMode,
    processes: HashMap<u32, State<L>>,
    /// Processes that do not want it (so a rescan does not ask again).
    unwanted: HashSet<u32>,
    pub counters: LineageCounters,
}

impl<L> TaskLineages<L> {
    pub fn new(mode: TaskLineageMode) -> Self {
        Self {
            mode,
            processes: HashMap::new(),
            unwanted: HashSet::new(),
            counters: LineageCounters::default(),
        }
    }

    /// A process was attached: probe it now if it wants lineage and its runtime is known.
    pub fn attach(
        &mut self,
        pid: u32,
        server: Option<&GymServer>,
        runtime: RuntimeView<'_>,
        attacher: &mut impl TaskProbeAttacher<Link = L>,
    ) {
        if self.processes.contains_key(&pid) || self.unwanted.contains(&pid) {
            return;
        }
        if !wanted(self.mode, server) {
            self.unwanted.insert(pid);
            return;
        }
        self.processes.insert(pid, State::Waiting { attempts: 0 });
        self.look(pid, runtime, attacher);
    }

    /// Every rescan: wanted processes not probed yet are looked at again; traced processes
    /// not seen yet (forked workers) want it when their parent does.
    pub fn rescan<'r>(
        &mut self,
        traced: impl IntoIterator<Item = (u32, RuntimeView<'r>)>,
        attacher: &mut impl TaskProbeAttacher<Link = L>,
    ) {
        if self.mode == TaskLineageMode::Off {
            return;
        }
        for (pid, runtime) in traced {
            if self.unwanted.contains(&pid) {
                continue;
            }
            match self.processes.get(&pid) {
                Some(State::Waiting { .. }) => self.look(pid, runtime, attacher),
                Some(_) => {}
                None if self.mode == TaskLineageMode::On || self.parent_is_wanted(pid) => {
                    self.processes.insert(pid, State::Waiting { attempts: 0 });
                    self.look(pid, runtime, attacher);
                }
                None => {
                    self.unwanted.insert(pid);
                }
            }
        }
    }

    fn parent_is_wanted(&self, pid: u32) -> bool {
        parent_pid(pid).is_some_and(|parent| self.processes.contains_key(&parent))
    }

    /// The process exited, exec'd or is no longer traced: its probe and lineages go (an
    /// exec'd process is looked at afresh).
    pub fn forget(&mut self, pid: u32, attacher: &mut impl TaskProbeAttacher<Link = L>) {
        self.unwanted.remove(&pid);
        if let Some(State::Probed(link)) = self.processes.remove(&pid) {
            self.counters.lineage_tasks_forgotten += attacher.forget_task_probe(pid, Some(link));
        }
    }

    fn look(
        &mut self,
        pid: u32,
        runtime: RuntimeView<'_>,
        attacher: &mut impl TaskProbeAttacher<Link = L>,
    ) {
        let Some(State::Waiting { attempts }) = self.processes.get(&pid) else {
            return;
        };
        let attempts = attempts + 1;
        let found = match runtime {
            RuntimeView::On(runtime) => probe(pid, runtime, attacher),
            RuntimeView::Deciding => Err(LineageOff::NotImported),
            RuntimeView::Off => Err(LineageOff::RuntimeNotRead),
        };
        match found {
            Ok((link, site_path)) => {
                tracing::info!(
                    pid,
                    "pid {pid}: task lineage on (probing Task.__init__ in {})",
                    site_path
                );
                self.counters.lineage_processes += 1;
                self.processes.insert(pid, State::Probed(link));
            }
            Err(why) if !why.is_final() && attempts < ATTEMPTS => {
                self.processes.insert(pid, State::Waiting { attempts });
            }
            Err(why) => {
                tracing::warn!(
                    pid,
                    "pid {pid}: task lineage is off ({}): {why}; its calls are placed by the \
                     other evidence",
                    why.reason()
                );
                self.counters.lineage_processes_off += 1;
                self.processes.insert(pid, State::Off);
            }
        }
    }
}

/// Finds the probe site of `pid` and attaches there.
fn probe<L>(
    pid: u32,
    runtime: &PythonRuntime,
    attacher: &mut impl TaskProbeAttacher<Link = L>,
) -> Result<(L, String), LineageOff> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map_err(|_| LineageOff::NotImported)?;
    let site = asyncio_site(&maps, runtime, |path| {
        std::fs::read(path_in_process(pid, path)).ok()
    })?;
    let file = path_in_process(pid, &site.path);
    let link = attacher
        .attach_task_probe(pid, site.layout, &file, TASK_INIT_SYMBOL)
        .map_err(|error| {
            let error = format!("{error:#}");
            let hint = uprobe_refusal_hint(&error);
            LineageOff::Attach(format!("{error}{hint}"))
        })?;
    Ok((link, site.path.display().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(server_type: &str, names_model_server: bool) -> GymServer {
        GymServer {
            name: "s".into(),
            server_type: Some(server_type.into()),
            host: None,
            port: None,
            service_group: None,
            names_model_server,
        }
    }

    #[test]
    fn auto_wants_the_model_servers_and_the_judges() {
        let judge = server("resources_servers", true);
        let plain = server("resources_servers", false);
        let agent = server("responses_api_agents", true);
        let auto = TaskLineageMode::Auto;
        assert!(wanted(auto, Some(&judge)));
        assert!(wanted(auto, Some(&server("responses_api_models", false))));
        assert!(!wanted(auto, Some(&server("some_other_servers", true))));
        assert!(!wanted(auto, Some(&plain)));
        assert!(!wanted(auto, Some(&agent)));
        assert!(!wanted(auto, None), "not a Gym server");
        assert!(wanted(TaskLineageMode::On, None));
        assert!(!wanted(TaskLineageMode::Off, Some(&judge)));
    }

    #[derive(Default)]
    struct FakeProbes {
        attached: Vec<u32>,
        forgotten: Vec<u32>,
    }

    impl TaskProbeAttacher for FakeProbes {
        type Link = u32;
        fn attach_task_probe(
            &mut self,
            pid: u32,
            _: AsyncioProcess,
            _: &Path,
            _: &str,
        ) -> Result<u32> {
            self.attached.push(pid);
            Ok(pid)
        }
        fn forget_task_probe(&mut self, pid: u32, _: Option<u32>) -> u64 {
            self.forgotten.push(pid);
            3
        }
    }

    #[test]
    fn a_process_without_a_runtime_waits_then_is_said_off() {
        let mut probes = FakeProbes::default();
        let mut lineages = TaskLineages::new(TaskLineageMode::On);
        lineages.attach(10, None, RuntimeView::Deciding, &mut probes);
        for _ in 2..ATTEMPTS {
            lineages.rescan([(10, RuntimeView::Deciding)], &mut probes);
            assert!(matches!(
                lineages.processes.get(&10),
                Some(State::Waiting { .. })
            ));
        }
        lineages.rescan([(10, RuntimeView::Deciding)], &mut probes);
        assert!(matches!(lineages.processes.get(&10), Some(State::Off)));
        assert_eq!(lineages.counters.lineage_processes_off, 1);
        assert!(probes.attached.is_empty());
        lineages.forget(10, &mut probes);
        assert!(probes.forgotten.is_empty(), "nothing was attached");
    }

    #[test]
    fn a_process_whose_runtime_is_off_is_said_off_at_once() {
        let mut probes = FakeProbes::default();
        let mut lineages = TaskLineages::new(TaskLineageMode::On);
        lineages.attach(10, None, RuntimeView::Off, &mut probes);
        assert!(matches!(lineages.processes.get(&10), Some(State::Off)));
        assert_eq!(lineages.counters.lineage_processes_off, 1);
    }

    #[test]
    fn unwanted_processes_are_never_looked_at() {
        let mut probes = FakeProbes::default();
        let mut lineages = TaskLineages::new(TaskLineageMode::Auto);
        lineages.attach(
            10,
            Some(&server("resources_servers", false)),
            RuntimeView::Deciding,
            &mut probes,
        );
        lineages.rescan([(10, RuntimeView::Deciding)], &mut probes);
        assert!(lineages.processes.is_empty());
        let mut off = TaskLineages::new(TaskLineageMode::Off);
        off.rescan([(std::process::id(), RuntimeView::Deciding)], &mut probes);
        assert!(off.processes.is_empty() && off.unwanted.is_empty());
    }

    #[test]
    fn the_parent_is_read_from_proc() {
        assert_eq!(
            parent_pid(std::process::id()),
            Some(std::os::unix::process::parent_id())
        );
        assert_eq!(parent_pid(u32::MAX), None);
    }
}
