//! Finding Gym server processes on the host from their environment.
//!
//! Gym's launcher (`nemo_gym/cli/env.py`) starts each server with `NEMO_GYM_CONFIG_PATH` = the
//! server's name and `NEMO_GYM_CONFIG_DICT` = the whole run's config as YAML
//! (`OmegaConf.to_yaml`). That YAML holds API keys: only the server's type, host and port are
//! read from it, and none of its text reaches an error, a log line or a `Debug` output.

use std::collections::HashMap;
use std::fmt;
use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use yaml_rust2::{Yaml, YamlLoader};

use crate::gym::{ServerKind, ServerType};

const CONFIG_PATH_VAR: &[u8] = b"NEMO_GYM_CONFIG_PATH";
const CONFIG_DICT_VAR: &[u8] = b"NEMO_GYM_CONFIG_DICT";
const SERVICE_NAME_VAR: &[u8] = b"OTEL_SERVICE_NAME";

/// `PF_KTHREAD` in the `flags` field of `/proc/<pid>/stat` (include/linux/sched.h).
const PF_KTHREAD: u64 = 0x0020_0000;

/// Processes that carry a Gym server's environment without being the server: Gym runs
/// `/bin/bash -c "cd … && uv venv … && uv pip install … && <venv>/bin/python app.py"`,
/// piped through `tee` when a log dir is set (`cli/setup_command.py::run_command`), and bash
/// 5.2 forks the last command of an `&&` list instead of exec'ing it, so the shell lives on
/// as the server's parent. Matched on `comm`, which is known before `environ` is read.
const LAUNCHER_COMMS: [&[u8]; 5] = [b"bash", b"sh", b"dash", b"tee", b"uv"];

/// A Gym server as its launcher described it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GymServer {
    /// `NEMO_GYM_CONFIG_PATH`: the server's top-level key in the run's config.
    pub name: String,
    /// The config key under the name, e.g. `resources_servers`.
    pub server_type: Option<String>,
    pub host: Option<String>,
    pub port: Option<u16>,
    /// The process's own `OTEL_SERVICE_NAME` (non-empty), the group of its `service.name`.
    /// `None` leaves the fallback to the caller: the tracer's own group, then Gym's `nemo`.
    pub service_group: Option<String>,
    /// Its config names a model server (`{type: responses_api_models, name: ...}`, as a
    /// resources server's `judge_model_server` does): its handlers call one.
    pub names_model_server: bool,
}

impl GymServer {
    /// Whether `--task-lineage auto` probes it: a server whose calls to a model carry no
    /// rollout id, cookie or session of their own, so that only lineage places them under
    /// the request being served at any concurrency — every model server (its upstream calls
    /// are placed by an echoed response id only where the implementation echoes it, as
    /// `openai_model` does and `vllm_model`, `azure_openai_model` and the OpenAI SDK's
    /// clients do not), and every resources server whose config names a model server (an LLM
    /// judge called from `/verify`). Decided by the server's role in the run's config, not by
    /// its implementation's name. Agents' calls carry cookies, sessions and bodies' ids.
    pub fn wants_task_lineage(&self) -> bool {
        match self.server_type.as_deref().map(ServerKind::from_config_key) {
            Some(ServerKind::Known(ServerType::Model)) => true,
            Some(ServerKind::Known(ServerType::Resources)) => self.names_model_server,
            _ => false,
        }
    }
}

/// The only environment variables discovery keeps; a process's environment can hold
/// credentials, so the rest is dropped while parsing.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ProcessEnv {
    pub config_path: Option<String>,
    /// Secret-bearing: never printed (see the `Debug` impl).
    pub config_dict: Option<String>,
    pub otel_service_name: Option<String>,
}

impl fmt::Debug for ProcessEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessEnv")
            .field("config_path", &self.config_path)
            .field(
                "config_dict_bytes",
                &self.config_dict.as_ref().map(String::len),
            )
            .field("otel_service_name", &self.otel_service_name)
            .finish()
    }
}

/// Reads `NEMO_GYM_CONFIG_PATH`, `NEMO_GYM_CONFIG_DICT` and `OTEL_SERVICE_NAME` from the
/// NUL-separated `KEY=VALUE` list of `/proc/<pid>/environ`.
pub fn parse_environ(bytes: &[u8]) -> ProcessEnv {
    let mut env = ProcessEnv::default();
    for entry in bytes.split(|&b| b == 0) {
        let Some(eq) = entry.iter().position(|&b| b == b'=') else {
            continue;
        };
        let (key, value) = (&entry[..eq], &entry[eq + 1..]);
        let slot = match key {
            CONFIG_PATH_VAR => &mut env.config_path,
            CONFIG_DICT_VAR => &mut env.config_dict,
            SERVICE_NAME_VAR => &mut env.otel_service_name,
            _ => continue,
        };
        *slot = Some(String::from_utf8_lossy(value).into_owned());
    }
    env
}

/// What is wrong with a Gym server's config. Carries positions only, never config text.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigProblem {
    #[error("NEMO_GYM_CONFIG_DICT is not set")]
    MissingConfigDict,
    #[error("NEMO_GYM_CONFIG_DICT is not valid YAML (line {line}, column {column})")]
    InvalidYaml { line: usize, column: usize },
    #[error("NEMO_GYM_CONFIG_DICT is not a YAML mapping")]
    NotAMapping,
    #[error("NEMO_GYM_CONFIG_DICT has no top-level key for the server")]
    UnknownServer,
    #[error(
        "the server's NEMO_GYM_CONFIG_DICT entry is not {{<server type>: {{<impl name>: {{...}}}}}}"
    )]
    UnexpectedShape,
    #[error("the server's port in NEMO_GYM_CONFIG_DICT is not a number in 1..=65535")]
    InvalidPort,
}

/// A process that is a Gym server by its environment, but whose config could not be read
/// in full. Like `std::string::FromUtf8Error`, it hands back what was recovered: the
/// server, known at least by name.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("Gym server {:?}: {problem}; it is labelled with what could be read", server.name)]
pub struct DiscoveryError {
    /// Boxed: keeps the `Result` small for the common `Ok` path.
    server: Box<GymServer>,
    problem: ConfigProblem,
}

impl DiscoveryError {
    #[cfg(test)]
    pub fn problem(&self) -> &ConfigProblem {
        &self.problem
    }

    /// The server with the fields the config did give (at least its name).
    pub fn server(&self) -> &GymServer {
        &self.server
    }

    pub fn into_server(self) -> GymServer {
        *self.server
    }
}

/// The Gym server a process is, from its environment: `Ok(None)` for a process without
/// `NEMO_GYM_CONFIG_PATH`; `Err` (with the server inside) when its config is unusable.
pub fn gym_server_from_env(env: &ProcessEnv) -> Result<Option<GymServer>, DiscoveryError> {
    let Some(name) = env.config_path.as_deref().filter(|name| !name.is_empty()) else {
        return Ok(None);
    };
    let mut server = GymServer {
        name: name.to_string(),
        server_type: None,
        host: None,
        port: None,
        // OTel treats an empty variable as unset.
        service_group: env
            .otel_service_name
            .as_deref()
            .filter(|group| !group.is_empty())
            .map(str::to_string),
        names_model_server: false,
    };
    let result = match env.config_dict.as_deref() {
        Some(yaml) => read_server_config(yaml, &mut server),
        None => Err(ConfigProblem::MissingConfigDict),
    };
    match result {
        Ok(()) => Ok(Some(server)),
        Err(problem) => Err(DiscoveryError {
            server: Box::new(server),
            problem,
        }),
    }
}

/// Fills type, host and port from `<name>: {<type>: {<impl>: {host, port, ...}}}`, taking
/// the first key at each level as Gym's launcher does (`cli/env.py`,
/// `global_config.get_first_server_config_dict`).
fn read_server_config(yaml: &str, server: &mut GymServer) -> Result<(), ConfigProblem> {
    let docs = YamlLoader::load_from_str(yaml).map_err(|error| ConfigProblem::InvalidYaml {
        line: error.marker().line(),
        column: error.marker().col() + 1,
    })?;
    let Some(Yaml::Hash(root)) = docs.first() else {
        return Err(ConfigProblem::NotAMapping);
    };
    let entry = root
        .get(&Yaml::String(server.name.clone()))
        .ok_or(ConfigProblem::UnknownServer)?;
    let Some((Yaml::String(server_type), Yaml::Hash(impls))) = first_entry(entry) else {
        return Err(ConfigProblem::UnexpectedShape);
    };
    server.server_type = Some(server_type.clone());
    let Some((_, Yaml::Hash(config))) = impls.iter().next() else {
        return Err(ConfigProblem::UnexpectedShape);
    };
    server.host = match config.get(&Yaml::String("host".into())) {
        Some(Yaml::String(host)) if !host.is_empty() => Some(host.clone()),
        _ => None,
    };
    server.port = match config.get(&Yaml::String("port".into())) {
        None | Some(Yaml::Null) => None,
        Some(Yaml::Integer(port)) => Some(valid_port(u16::try_from(*port).ok())?),
        Some(Yaml::String(port)) => Some(valid_port(port.trim().parse().ok())?),
        Some(_) => return Err(ConfigProblem::InvalidPort),
    };
    server.names_model_server = config.values().any(names_model_server);
    Ok(())
}

/// Whether a config value is a reference to a model server, as Gym writes one
/// (`ModelServerRef`: `{type: responses_api_models, name: <server>}`), at any depth.
fn names_model_server(value: &Yaml) -> bool {
    const DEPTH: usize = 8;
    fn at(value: &Yaml, depth: usize) -> bool {
        match value {
            Yaml::Hash(hash) if depth < DEPTH => {
                hash.get(&Yaml::String("type".into()))
                    == Some(&Yaml::String("responses_api_models".into()))
                    || hash.values().any(|v| at(v, depth + 1))
            }
            Yaml::Array(items) if depth < DEPTH => items.iter().any(|v| at(v, depth + 1)),
            _ => false,
        }
    }
    at(value, 0)
}

fn first_entry(yaml: &Yaml) -> Option<(&Yaml, &Yaml)> {
    match yaml {
        Yaml::Hash(hash) => hash.iter().next(),
        _ => None,
    }
}

/// Port 0 and Gym's `-1` ("not allocated", offline resolution) are not listening ports.
fn valid_port(port: Option<u16>) -> Result<u16, ConfigProblem> {
    port.filter(|&port| port != 0)
        .ok_or(ConfigProblem::InvalidPort)
}

/// The environment of a running process, as [`parse_environ`] keeps it.
pub fn read_process_env(proc_root: &Path, pid: u32) -> io::Result<ProcessEnv> {
    fs::read(proc_root.join(pid.to_string()).join("environ")).map(|bytes| parse_environ(&bytes))
}

/// `/proc/<pid>/exe`; `None` for kernel threads, exited or inaccessible processes.
pub fn executable_path(pid: u32) -> Option<PathBuf> {
    fs::read_link(format!("/proc/{pid}/exe")).ok()
}

/// The fields of `/proc/<pid>/stat` the scanner needs.
#[derive(Debug, PartialEq, Eq)]
struct ProcStat {
    /// Raw bytes: a process can name itself anything, including invalid UTF-8.
    comm: Vec<u8>,
    state: u8,
    flags: u64,
    /// Clock ticks after boot: with the pid, it names one process across pid reuse.
    starttime: u64,
}

/// Parses `pid (comm) state ppid … flags … starttime …`. `comm` may hold spaces and
/// parentheses, so it ends at the LAST `)`.
fn parse_stat(text: &[u8]) -> Option<ProcStat> {
    let open = text.iter().position(|&b| b == b'(')?;
    let close = text.iter().rposition(|&b| b == b')')?;
    let comm = text.get(open + 1..close)?.to_vec();
    let rest = std::str::from_utf8(text.get(close + 1..)?).ok()?;
    // Fields from 3 (state) on; `flags` is field 9, `starttime` field 22.
    let fields: Vec<&str> = rest.split_ascii_whitespace().take(20).collect();
    Some(ProcStat {
        comm,
        state: *fields.first()?.as_bytes().first()?,
        flags: fields.get(6)?.parse().ok()?,
        starttime: fields.get(19)?.parse().ok()?,
    })
}

/// What one process image turned out to be.
#[derive(Debug)]
enum Class {
    NotGym,
    /// `environ` could not be read (EACCES, or ESRCH/ENOENT: the process is exiting).
    Unreadable,
    Gym(GymServer),
}

#[derive(Debug)]
struct Known {
    starttime: u64,
    comm: Vec<u8>,
    class: Class,
    /// The scan that last saw the pid.
    seen: u64,
    /// Not a server at the first look: looked at once more on the next scan (see
    /// [`ProcScanner`]).
    look_again: bool,
}

/// What changed since the previous scan. Apply `exited` before `started`: a pid can appear
/// in both when it was reused by a new process or re-exec'd as another server.
#[derive(Debug, Default)]
pub struct ScanResult {
    pub started: Vec<(u32, GymServer)>,
    pub exited: Vec<u32>,
    /// Servers in `started` whose config could not be read in full (log-worthy; the server
    /// is still in `started`, labelled with what could be read).
    pub config_errors: Vec<(u32, DiscoveryError)>,
}

/// Finds Gym server processes in `/proc`, cheaply enough to run every second.
///
/// Each scan reads `/proc/<pid>/stat` of every process, but `environ` only once per process
/// image, keyed by (pid, starttime, comm): `starttime` changes when a pid is reused, `comm`
/// when a process execs — a process classified between fork and exec (Gym's launcher
/// forks from `gym`/`ng_run` or `bash`, then execs `bash`/`python`) is re-read after the
/// exec. A fork whose parent has the server's name (a Python orchestrator starting
/// `python app.py`) keeps its `comm` through the exec, so a process that is not a server at
/// its first look is read once more on the next scan, by when its exec is long done. A later
/// exec that keeps the name is not noticed; Gym's launcher does not do that.
#[derive(Debug)]
pub struct ProcScanner {
    proc_root: PathBuf,
    self_pid: u32,
    known: HashMap<u32, Known>,
    scans: u64,
    unreadable: u64,
    stat_buf: Vec<u8>,
}

impl ProcScanner {
    pub fn new(proc_root: PathBuf) -> Self {
        Self {
            proc_root,
            self_pid: std::process::id(),
            known: HashMap::new(),
            scans: 0,
            unreadable: 0,
            stat_buf: Vec::with_capacity(512),
        }
    }

    /// Process images skipped because their `environ` could not be read; each counts once.
    pub fn unreadable(&self) -> u64 {
        self.unreadable
    }

    /// Compares `/proc` with the previous scan. If `/proc` itself cannot be listed, reports
    /// nothing and keeps what it knew.
    pub fn scan(&mut self) -> ScanResult {
        let mut result = ScanResult::default();
        let Ok(entries) = fs::read_dir(&self.proc_root) else {
            return result;
        };
        self.scans += 1;
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            if pid != self.self_pid {
                self.visit(pid, &mut result);
            }
        }
        let scans = self.scans;
        self.known.retain(|&pid, known| {
            let alive = known.seen == scans;
            if !alive && matches!(known.class, Class::Gym(_)) {
                result.exited.push(pid);
            }
            alive
        });
        result
    }

    fn visit(&mut self, pid: u32, result: &mut ScanResult) {
        // Gone between listing and reading: it is forgotten below, like any vanished pid.
        let Some(stat) = self.read_stat(pid) else {
            return;
        };
        let dead = matches!(stat.state, b'Z' | b'X');
        let mut first_look = true;
        if let Some(known) = self.known.get_mut(&pid)
            && known.starttime == stat.starttime
            && known.comm == stat.comm
        {
            known.seen = self.scans;
            // A zombie serves nothing; its environ reads empty, so it is not re-read.
            if dead && matches!(known.class, Class::Gym(_)) {
                known.class = Class::NotGym;
                result.exited.push(pid);
            }
            if !known.look_again || dead {
                return;
            }
            first_look = false;
        }
        let kernel_thread = stat.flags & PF_KTHREAD != 0;
        let (class, problem) = if dead || kernel_thread {
            (Class::NotGym, None)
        } else {
            self.classify(pid, &stat.comm)
        };
        // Launchers are told by `comm` alone, which an exec changes; kernel threads never exec.
        let look_again = first_look
            && matches!(class, Class::NotGym)
            && !dead
            && !kernel_thread
            && !LAUNCHER_COMMS.contains(&stat.comm.as_slice());
        let current = match &class {
            Class::Gym(server) => Some(server.clone()),
            _ => None,
        };
        let starttime = stat.starttime;
        let previous = self.known.insert(
            pid,
            Known {
                starttime,
                comm: stat.comm,
                class,
                seen: self.scans,
                look_again,
            },
        );
        let was = previous.and_then(|known| match known.class {
            Class::Gym(server) => Some((known.starttime, server)),
            _ => None,
        });
        // The same process renamed itself (prctl) or re-exec'd as the same server: no news.
        if let (Some((old_starttime, old)), Some(new)) = (&was, &current)
            && *old_starttime == starttime
            && old == new
        {
            return;
        }
        if was.is_some() {
            result.exited.push(pid);
        }
        if let Some(server) = current {
            result.started.push((pid, server));
            result
                .config_errors
                .extend(problem.map(|error| (pid, error)));
        }
    }

    fn classify(&mut self, pid: u32, comm: &[u8]) -> (Class, Option<DiscoveryError>) {
        if LAUNCHER_COMMS.contains(&comm) {
            return (Class::NotGym, None);
        }
        let env = match read_process_env(&self.proc_root, pid) {
            Ok(env) => env,
            Err(_) => {
                self.unreadable += 1;
                return (Class::Unreadable, None);
            }
        };
        match gym_server_from_env(&env) {
            Ok(None) => (Class::NotGym, None),
            Ok(Some(server)) => (Class::Gym(server), None),
            Err(error) => (Class::Gym(error.server().clone()), Some(error)),
        }
    }

    fn read_stat(&mut self, pid: u32) -> Option<ProcStat> {
        self.stat_buf.clear();
        File::open(self.proc_root.join(pid.to_string()).join("stat"))
            .and_then(|mut file| file.read_to_end(&mut self.stat_buf))
            .ok()?;
        parse_stat(&self.stat_buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    const SECRET: &str = "sk-proj-DO-NOT-LEAK-4242";

    /// As `OmegaConf.to_yaml` writes a run's config (PyYAML block style, insertion order,
    /// lists flush with their key, interpolations left unresolved).
    fn config_yaml() -> String {
        format!(
            "\
policy_base_url: https://api.openai.com/v1
policy_api_key: {SECRET}
policy_model_name: gpt-4.1-2025-04-14
config_paths:
- resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml
- responses_api_models/openai_model/configs/openai_model.yaml
head_server:
  host: 127.0.0.1
  port: 11000
example_single_tool_call:
  resources_servers:
    example_single_tool_call:
      entrypoint: app.py
      domain: agent
      verified: false
      description: 'it''s: a ''quoted''

        two-line string'
      'on': 'true'
      extra: null
      host: 127.0.0.1
      port: 41235
example_single_tool_call_simple_agent:
  responses_api_agents:
    simple_agent:
      entrypoint: app.py
      resources_server:
        type: resources_servers
        name: example_single_tool_call
      model_server:
        type: responses_api_models
        name: policy_model
      datasets:
      - name: example
        type: example
        jsonl_fpath: resources_servers/example_single_tool_call/data/example.jsonl
      host: 0.0.0.0
      port: '52001'
policy_model:
  responses_api_models:
    openai_model:
      entrypoint: app.py
      openai_base_url: ${{policy_base_url}}
      openai_api_key: ${{policy_api_key}}
      openai_model: ${{policy_model_name}}
      port: 52002
"
        )
    }

    fn env_of(name: &str, yaml: &str) -> ProcessEnv {
        ProcessEnv {
            config_path: Some(name.into()),
            config_dict: Some(yaml.into()),
            otel_service_name: None,
        }
    }

    fn assert_no_secret(text: &str) {
        assert!(!text.contains(SECRET), "secret leaked: {text}");
        assert!(!text.contains("sk-proj"), "secret leaked: {text}");
    }

    #[test]
    fn environ_keeps_only_the_three_variables() {
        let raw = format!(
            "PATH=/usr/bin\0OPENAI_API_KEY={SECRET}\0NEMO_GYM_CONFIG_PATH=policy_model\0\
             NEMO_GYM_CONFIG_DICT=a: b=c\0OTEL_SERVICE_NAME=grpo\0NOEQUALS\0\0"
        );
        let env = parse_environ(raw.as_bytes());
        assert_eq!(env.config_path.as_deref(), Some("policy_model"));
        assert_eq!(env.config_dict.as_deref(), Some("a: b=c"));
        assert_eq!(env.otel_service_name.as_deref(), Some("grpo"));
        assert_no_secret(&format!("{env:?}"));
        assert_eq!(parse_environ(b""), ProcessEnv::default());
    }

    #[test]
    fn debug_of_env_hides_the_config() {
        let env = env_of("policy_model", &config_yaml());
        let debug = format!("{env:?}");
        assert_no_secret(&debug);
        assert!(debug.contains("config_dict_bytes"));
    }

    #[test]
    fn servers_of_each_type_are_read() {
        let yaml = config_yaml();
        let resources = gym_server_from_env(&env_of("example_single_tool_call", &yaml))
            .unwrap()
            .unwrap();
        assert_eq!(
            resources,
            GymServer {
                name: "example_single_tool_call".into(),
                server_type: Some("resources_servers".into()),
                host: Some("127.0.0.1".into()),
                port: Some(41235),
                service_group: None,
                names_model_server: false,
            }
        );
        let agent = gym_server_from_env(&env_of("example_single_tool_call_simple_agent", &yaml))
            .unwrap()
            .unwrap();
        assert_eq!(agent.server_type.as_deref(), Some("responses_api_agents"));
        assert_eq!(agent.host.as_deref(), Some("0.0.0.0"));
        assert_eq!(agent.port, Some(52001), "a quoted port is a port");
        assert!(agent.names_model_server, "its model_server");
        let mut env = env_of("policy_model", &yaml);
        env.otel_service_name = Some("grpo-run".into());
        let model = gym_server_from_env(&env).unwrap().unwrap();
        assert_eq!(model.server_type.as_deref(), Some("responses_api_models"));
        assert_eq!((model.host, model.port), (None, Some(52002)));
        assert_eq!(model.service_group.as_deref(), Some("grpo-run"));
        assert!(!model.names_model_server);
        assert_no_secret(&format!("{agent:?}"));
    }

    /// nemo-gym 0.7.0's `equivalence_llm_judge.yaml`: the judge is a `ModelServerRef`.
    #[test]
    fn a_judges_model_server_is_seen_in_its_config() {
        let yaml = "\
equivalence_llm_judge:
  resources_servers:
    equivalence_llm_judge:
      entrypoint: app.py
      judge_model_server:
        type: responses_api_models
        name: policy_model
      judge_responses_create_params:
        input: []
      port: 41236
";
        let judge = gym_server_from_env(&env_of("equivalence_llm_judge", yaml))
            .unwrap()
            .unwrap();
        assert!(judge.names_model_server);
        let plain = gym_server_from_env(&env_of("example_single_tool_call", &config_yaml()))
            .unwrap()
            .unwrap();
        assert!(!plain.names_model_server);
    }

    #[test]
    fn processes_without_a_server_name_are_not_gym() {
        assert_eq!(gym_server_from_env(&ProcessEnv::default()), Ok(None));
        let env = ProcessEnv {
            config_path: Some(String::new()),
            config_dict: Some(config_yaml()),
            otel_service_name: None,
        };
        assert_eq!(gym_server_from_env(&env), Ok(None));
    }

    #[test]
    fn a_bad_config_still_names_the_server_and_never_leaks() {
        let broken = format!("policy_api_key: {SECRET}\nx: [unclosed\n  y: {SECRET}\n");
        let cases = [
            (env_of("policy_model", &broken), "is not valid YAML (line"),
            (
                env_of("missing_server", &config_yaml()),
                "has no top-level key",
            ),
            (
                env_of("policy_api_key", &config_yaml()),
                "is not {<server type>",
            ),
            (
                env_of(
                    "s",
                    &format!("k: {SECRET}\ns:\n  resources_servers:\n    i:\n      port: -1\n"),
                ),
                "port",
            ),
            (env_of("s", &format!("- {SECRET}\n")), "not a YAML mapping"),
            (
                ProcessEnv {
                    config_path: Some("s".into()),
                    ..ProcessEnv::default()
                },
                "is not set",
            ),
        ];
        for (env, expected) in cases {
            let error = gym_server_from_env(&env).unwrap_err();
            let shown = format!("{error} / {error:?} / {:?}", error.problem());
            assert!(shown.contains(expected), "{shown}");
            assert_no_secret(&shown);
            assert_eq!(error.server().name, env.config_path.clone().unwrap());
            assert_eq!(error.into_server().service_group, None);
        }
    }

    #[test]
    fn yaml_error_position_is_reported() {
        let error = gym_server_from_env(&env_of("s", "a: 1\nb: 2\n  c: [\n")).unwrap_err();
        let ConfigProblem::InvalidYaml { line, column } = *error.problem() else {
            panic!("{error}");
        };
        assert_eq!((line, column), (3, 4), "1-based, as editors count");
    }

    #[test]
    fn a_bad_port_keeps_type_and_host() {
        let yaml = "s:\n  resources_servers:\n    i:\n      host: h\n      port: ${oc.env:PORT}\n";
        let error = gym_server_from_env(&env_of("s", yaml)).unwrap_err();
        assert_eq!(error.problem(), &ConfigProblem::InvalidPort);
        let server = error.into_server();
        assert_eq!(server.server_type.as_deref(), Some("resources_servers"));
        assert_eq!((server.host.as_deref(), server.port), (Some("h"), None));
    }

    #[test]
    fn stat_comm_may_hold_spaces_and_parens() {
        let line = b"4242 (we (ird) n) S 1 4242 4242 0 -1 4194560 9 0 0 0 1 2 0 0 20 0 1 0 \
                     123456 1000 200 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 1 0\n";
        let stat = parse_stat(line).unwrap();
        assert_eq!(stat.comm, b"we (ird) n");
        assert_eq!(stat.state, b'S');
        assert_eq!(stat.flags, 4194560);
        assert_eq!(stat.starttime, 123456);
        assert_eq!(parse_stat(b"12 (short) S 1"), None);
        let own = fs::read(format!("/proc/{}/stat", std::process::id())).unwrap();
        assert!(parse_stat(&own).is_some());
    }

    /// A throwaway `/proc` lookalike, removed on drop.
    struct FakeProc(PathBuf);

    impl FakeProc {
        fn new() -> Self {
            static NEXT: AtomicU32 = AtomicU32::new(0);
            let dir = std::env::temp_dir().join(format!(
                "gym-tracer-discovery-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }

        /// Writes `stat` and `environ` (NUL-separated `vars`); `None` makes `environ`
        /// unreadable (a directory, as root can read any file).
        fn process(&self, pid: u32, comm: &str, starttime: u64, flags: u64, vars: Option<&[&str]>) {
            let dir = self.0.join(pid.to_string());
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            let stat = format!(
                "{pid} ({comm}) S 1 {pid} {pid} 0 -1 {flags} 0 0 0 0 0 0 0 0 20 0 1 0 {starttime} \
                 1000 100 0\n"
            );
            fs::write(dir.join("stat"), stat).unwrap();
            match vars {
                Some(vars) => fs::write(dir.join("environ"), vars.join("\0")).unwrap(),
                None => fs::create_dir(dir.join("environ")).unwrap(),
            }
        }

        fn remove(&self, pid: u32) {
            fs::remove_dir_all(self.0.join(pid.to_string())).unwrap();
        }
    }

    impl Drop for FakeProc {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    const GYM_PID: u32 = 5_000_001;
    const OTHER_PID: u32 = 5_000_002;

    fn gym_vars(yaml: &str) -> Vec<String> {
        vec![
            "PATH=/usr/bin".into(),
            "NEMO_GYM_CONFIG_PATH=example_single_tool_call".into(),
            format!("NEMO_GYM_CONFIG_DICT={yaml}"),
        ]
    }

    fn gym_process(proc: &FakeProc, pid: u32, comm: &str, starttime: u64) {
        let vars = gym_vars(&config_yaml());
        let vars: Vec<&str> = vars.iter().map(String::as_str).collect();
        proc.process(pid, comm, starttime, 0, Some(&vars));
    }

    fn started_pids(result: &ScanResult) -> Vec<u32> {
        result.started.iter().map(|(pid, _)| *pid).collect()
    }

    #[test]
    fn scan_finds_gym_servers_and_ignores_the_rest() {
        let proc = FakeProc::new();
        gym_process(&proc, GYM_PID, "python3.13", 100);
        proc.process(
            OTHER_PID,
            "sshd",
            50,
            0,
            Some(&["PATH=/usr/bin", "HOME=/root"]),
        );
        gym_process(&proc, 5_000_003, "bash", 90);
        let vars = gym_vars("");
        let vars: Vec<&str> = vars.iter().map(String::as_str).collect();
        proc.process(5_000_004, "kworker/0:1", 1, PF_KTHREAD, Some(&vars));
        proc.process(5_000_005, "secret", 60, 0, None);
        gym_process(&proc, std::process::id(), "gym-tracer", 10);
        fs::create_dir(proc.0.join("self")).unwrap();
        fs::write(proc.0.join("uptime"), "1 2").unwrap();

        let mut scanner = ProcScanner::new(proc.0.clone());
        let result = scanner.scan();
        assert_eq!(started_pids(&result), [GYM_PID]);
        assert_eq!(
            result.started[0].1.server_type.as_deref(),
            Some("resources_servers")
        );
        assert!(result.exited.is_empty() && result.config_errors.is_empty());
        assert_eq!(scanner.unreadable(), 1);

        let again = scanner.scan();
        assert!(again.started.is_empty() && again.exited.is_empty());
        assert_eq!(scanner.unreadable(), 1, "an unreadable process counts once");
    }

    #[test]
    fn exited_servers_are_reported_once() {
        let proc = FakeProc::new();
        gym_process(&proc, GYM_PID, "python", 100);
        proc.process(OTHER_PID, "sleep", 100, 0, Some(&["A=b"]));
        let mut scanner = ProcScanner::new(proc.0.clone());
        assert_eq!(started_pids(&scanner.scan()), [GYM_PID]);
        proc.remove(GYM_PID);
        proc.remove(OTHER_PID);
        let result = scanner.scan();
        assert_eq!(result.exited, [GYM_PID], "non-Gym exits are not reported");
        assert!(scanner.scan().exited.is_empty());
        assert!(scanner.known.is_empty());
    }

    #[test]
    fn zombie_servers_have_exited() {
        let proc = FakeProc::new();
        gym_process(&proc, GYM_PID, "python", 100);
        let mut scanner = ProcScanner::new(proc.0.clone());
        assert_eq!(started_pids(&scanner.scan()), [GYM_PID]);
        let stat = proc.0.join(format!("{GYM_PID}/stat"));
        let zombie = fs::read_to_string(&stat).unwrap().replace(") S ", ") Z ");
        fs::write(&stat, zombie).unwrap();
        assert_eq!(scanner.scan().exited, [GYM_PID]);
        assert!(scanner.scan().exited.is_empty());
    }

    #[test]
    fn a_reused_pid_is_read_again() {
        let proc = FakeProc::new();
        proc.process(GYM_PID, "python", 100, 0, Some(&["A=b"]));
        let mut scanner = ProcScanner::new(proc.0.clone());
        assert!(scanner.scan().started.is_empty());
        gym_process(&proc, GYM_PID, "python", 200);
        assert_eq!(started_pids(&scanner.scan()), [GYM_PID]);
        // Reused again, by another Gym server: the old one exited, a new one started.
        gym_process(&proc, GYM_PID, "python", 300);
        let result = scanner.scan();
        assert_eq!(
            (started_pids(&result), result.exited),
            (vec![GYM_PID], vec![GYM_PID])
        );
    }

    #[test]
    fn an_exec_after_the_first_look_is_read_again() {
        let proc = FakeProc::new();
        // Forked from the orchestrator, not yet exec'd: its environment lacks the server.
        proc.process(GYM_PID, "gym", 100, 0, Some(&["PATH=/usr/bin"]));
        let mut scanner = ProcScanner::new(proc.0.clone());
        assert!(scanner.scan().started.is_empty());
        // Exec'd the launcher shell: a Gym environment, but not the server.
        gym_process(&proc, GYM_PID, "bash", 100);
        assert!(scanner.scan().started.is_empty());
        // The shell's child exec'd the server (shown here on the same pid).
        gym_process(&proc, GYM_PID, "python", 100);
        assert_eq!(started_pids(&scanner.scan()), [GYM_PID]);
        // Renaming itself (prctl) is not news.
        gym_process(&proc, GYM_PID, "uvicorn worker", 100);
        let result = scanner.scan();
        assert!(result.started.is_empty() && result.exited.is_empty());
        // Exec'ing something that is not a server is an exit.
        proc.process(GYM_PID, "sleep", 100, 0, Some(&["PATH=/usr/bin"]));
        assert_eq!(scanner.scan().exited, [GYM_PID]);
    }

    #[test]
    fn a_fork_that_keeps_its_parents_name_through_the_exec_is_read_again_once() {
        let proc = FakeProc::new();
        // Forked from a Python orchestrator, not yet exec'd: its parent's name and environment.
        proc.process(GYM_PID, "python", 100, 0, Some(&["PATH=/usr/bin"]));
        proc.process(OTHER_PID, "python", 100, 0, Some(&["PATH=/usr/bin"]));
        let mut scanner = ProcScanner::new(proc.0.clone());
        assert!(scanner.scan().started.is_empty());
        // Exec'd `python app.py` with the server's environment: the same name.
        gym_process(&proc, GYM_PID, "python", 100);
        assert_eq!(started_pids(&scanner.scan()), [GYM_PID]);
        // A process that is still not a server is not read a third time: an environ that
        // became unreadable is never looked at, so never counted.
        proc.process(OTHER_PID, "python", 100, 0, None);
        let result = scanner.scan();
        assert!(result.started.is_empty() && result.exited.is_empty());
        assert_eq!(scanner.unreadable(), 0);
    }

    #[test]
    fn a_server_with_a_broken_config_is_still_found() {
        let proc = FakeProc::new();
        let vars = gym_vars(&format!("key: {SECRET}\n  bad: [\n"));
        let vars: Vec<&str> = vars.iter().map(String::as_str).collect();
        proc.process(GYM_PID, "python", 100, 0, Some(&vars));
        let mut scanner = ProcScanner::new(proc.0.clone());
        let result = scanner.scan();
        assert_eq!(started_pids(&result), [GYM_PID]);
        assert_eq!(result.started[0].1.name, "example_single_tool_call");
        assert_eq!(result.started[0].1.server_type, None);
        assert_eq!(result.config_errors.len(), 1);
        assert_no_secret(&format!("{result:?} {}", result.config_errors[0].1));
    }

    #[test]
    fn read_process_env_reads_a_real_process() {
        let env = read_process_env(Path::new("/proc"), std::process::id()).unwrap();
        assert_eq!(env.config_dict, std::env::var("NEMO_GYM_CONFIG_DICT").ok());
        assert!(executable_path(std::process::id()).is_some());
        assert!(executable_path(u32::MAX).is_none());
    }
}
