//! Configuration layering: command-line flags > environment variables > the `--config` TOML
//! file > built-in defaults.
//!
//! clap already ranks flags over environment variables over defaults, so the file is merged
//! by turning its values into the defaults of the matching options before parsing. One
//! parser then decides everything, and `value_source` tells `check-config` where each
//! effective value came from.

pub mod cli;
pub mod export_plan;

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{Context, Result, bail};
use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, CommandFactory, FromArgMatches};

use crate::config::cli::{Cli, Command, RunArgs};
use crate::export::otlp::options::{HeaderList, printable_endpoint};

/// Where the health endpoint listens: loopback unless an address says otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HealthListen(pub SocketAddr);

impl FromStr for HealthListen {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if let Ok(port) = text.parse::<u16>() {
            return Ok(Self(SocketAddr::from((Ipv4Addr::LOCALHOST, port))));
        }
        text.parse().map(Self).map_err(|_| {
            format!("`{text}` is not PORT or ADDRESS:PORT (e.g. 127.0.0.1:9464 or [::1]:9464)")
        })
    }
}

impl fmt::Display for HealthListen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The parsed command line with every layer applied.
pub struct Loaded {
    pub cli: Cli,
    /// The file that was read, if any.
    pub file: Option<PathBuf>,
    /// Keys the file set (normalised to option ids), to tell file values from defaults.
    file_keys: Vec<String>,
    /// Options set by the old name of their environment variable ([`RENAMED_OPTIONS`]).
    env_alias_ids: Vec<String>,
    matches: ArgMatches,
}

/// Parses the process's arguments and environment, merging in the config file. Exits the
/// process for `--help`, `--version` and usage errors, as clap does.
pub fn load() -> Result<Loaded> {
    load_from(std::env::args_os().collect(), |name| std::env::var_os(name))
}

fn load_from(args: Vec<OsString>, env: impl Fn(&str) -> Option<OsString>) -> Result<Loaded> {
    let file = config_file_argument(&args).or_else(|| env("GYM_TRACER_CONFIG").map(PathBuf::from));
    let mut command = Cli::command();
    let mut file_keys = Vec::new();
    if let Some(path) = &file {
        let values = read_config_file(path)?;
        (command, file_keys) = apply_file_defaults(command, &values, path)?;
    }
    let mut env_alias_ids = Vec::new();
    for renamed in RENAMED_OPTIONS {
        let id = option_id(renamed.new);
        let new_env = command
            .find_subcommand("run")
            .and_then(|run| run.get_arguments().find(|arg| arg.get_id() == id.as_str()))
            .and_then(|arg| arg.get_env().map(|env| env.to_os_string()));
        let (Some(value), None) = (
            env(renamed.old_env),
            new_env.and_then(|name| env(&name.to_string_lossy())),
        ) else {
            continue;
        };
        // Above the file's value (it replaces that default), below the new variable and the
        // flag, as an environment variable ranks.
        let value = value.to_string_lossy().into_owned();
        for name in ["run", "check-config"] {
            command = command.mut_subcommand(name, |sub| {
                sub.mut_arg(&id, |arg| arg.default_value(value.clone()))
            });
        }
        env_alias_ids.push(id);
    }
    let matches = command.get_matches_from(args);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|error| error.exit());
    Ok(Loaded {
        cli,
        file,
        file_keys,
        env_alias_ids,
        matches,
    })
}

/// `--config` must be known before clap runs, because the file's values become defaults.
fn config_file_argument(args: &[OsString]) -> Option<PathBuf> {
    let mut args = args.iter().skip(1);
    while let Some(arg) = args.next() {
        let arg = arg.to_str()?;
        if arg == "--" {
            return None;
        }
        if arg == "--config" {
            return args.next().map(PathBuf::from);
        }
        if let Some(path) = arg.strip_prefix("--config=") {
            return Some(PathBuf::from(path));
        }
    }
    None
}

/// One value of the file, as the strings clap would have been given on the command line.
type FileValues = BTreeMap<String, Vec<String>>;

/// An option given a clearer name. The old flag is a clap alias; the old file key and the
/// old environment variable keep working here, ranked as the new ones are.
pub struct RenamedOption {
    pub old: &'static str,
    pub new: &'static str,
    pub old_env: &'static str,
    /// Why the old name misled.
    pub why: &'static str,
}

pub const RENAMED_OPTIONS: &[RenamedOption] = &[RenamedOption {
    old: "max-pending-spans",
    new: "max-stitching-spans",
    old_env: "GYM_TRACER_MAX_PENDING_SPANS",
    why: "\"pending\" read as waiting for export; these are the spans held for stitching \
          (the export queue is `--export-queue-size`)",
}];

/// The option id (clap's, `max_stitching_spans`) of a renamed option's new long name.
fn option_id(long: &str) -> String {
    long.replace('-', "_")
}

fn read_config_file(path: &Path) -> Result<FileValues> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the config file {}", path.display()))?;
    let table: toml::Table = text.parse().map_err(|error: toml::de::Error| {
        // The message quotes the offending line, which may hold a header token: give the
        // position only.
        let at = error
            .span()
            .map(|span| {
                let line = text[..span.start].matches('\n').count() + 1;
                format!(" at line {line}")
            })
            .unwrap_or_default();
        // The bare message names the problem without quoting the text.
        anyhow::anyhow!(
            "{} is not valid TOML{at}: {}",
            path.display(),
            error.message().trim()
        )
    })?;
    let mut values = FileValues::new();
    for (key, value) in table {
        let id = key.replace('-', "_");
        let strings = match value {
            toml::Value::Array(items) => items
                .into_iter()
                .map(|item| scalar_text(&key, item, path))
                .collect::<Result<Vec<_>>>()?,
            other => vec![scalar_text(&key, other, path)?],
        };
        values.insert(id, strings);
    }
    Ok(values)
}

fn scalar_text(key: &str, value: toml::Value, path: &Path) -> Result<String> {
    Ok(match value {
        toml::Value::String(text) => text,
        toml::Value::Integer(number) => number.to_string(),
        toml::Value::Boolean(flag) => flag.to_string(),
        toml::Value::Float(number) => number.to_string(),
        _ => bail!(
            "{}: `{key}` must be a string, number, boolean or a list of them",
            path.display()
        ),
    })
}

/// Options a file may not set: the file itself, and what only makes sense per invocation.
const NOT_IN_FILE: &[&str] = &["config", "help", "version"];

/// An option the file may set.
struct FileKey {
    /// The long name with `_` for `-`, as file keys are compared.
    key: String,
    long: String,
    id: String,
    /// Takes a list (repeatable flags).
    multiple: bool,
    /// A global option (on the top-level command, not on `run`).
    global: bool,
}

/// The options of `run` and the global ones, minus [`NOT_IN_FILE`].
fn file_keys(command: &clap::Command) -> Vec<FileKey> {
    let run = command
        .find_subcommand("run")
        .expect("the run subcommand exists");
    let options = run.get_arguments().map(|arg| (arg, false));
    let globals = command.get_arguments().map(|arg| (arg, true));
    options
        .chain(globals)
        .filter(|(arg, _)| !NOT_IN_FILE.contains(&arg.get_id().as_str()))
        .filter_map(|(arg, global)| {
            let long = arg.get_long()?;
            Some(FileKey {
                key: long.replace('-', "_"),
                long: long.to_owned(),
                id: arg.get_id().to_string(),
                multiple: matches!(arg.get_action(), ArgAction::Append),
                global,
            })
        })
        .collect()
}

/// Makes the file's values the defaults of their options; returns the ids it set.
fn apply_file_defaults(
    mut command: clap::Command,
    values: &FileValues,
    path: &Path,
) -> Result<(clap::Command, Vec<String>)> {
    let keys = file_keys(&command);
    let mut ids = Vec::new();
    for (key, strings) in values {
        let key = RENAMED_OPTIONS
            .iter()
            .find(|renamed| renamed.old.replace('-', "_") == *key)
            .map_or(key.clone(), |renamed| renamed.new.replace('-', "_"));
        let Some(option) = keys.iter().find(|option| option.key == key) else {
            let valid: Vec<&str> = keys.iter().map(|option| option.long.as_str()).collect();
            bail!(
                "{}: unknown key `{}`; the keys are the long options of `gym-tracer run`: {}",
                path.display(),
                key.replace('_', "-"),
                valid.join(", ")
            );
        };
        if !option.multiple && strings.len() > 1 {
            bail!(
                "{}: `{}` takes one value, not a list",
                path.display(),
                option.long
            );
        }
        let set_default = |arg: clap::Arg| {
            if option.multiple {
                arg.default_values(strings.clone())
            } else {
                arg.default_value(strings.first().cloned().unwrap_or_default())
            }
        };
        if option.global {
            command = command.mut_arg(&option.id, set_default);
        } else {
            for name in ["run", "check-config"] {
                command = command.mut_subcommand(name, |sub| sub.mut_arg(&option.id, set_default));
            }
        }
        ids.push(option.id.clone());
    }
    Ok((command, ids))
}

/// Where an effective value came from, for `check-config`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Flag,
    Env,
    File,
    Default,
    Unset,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Flag => "flag",
            Self::Env => "env",
            Self::File => "file",
            Self::Default => "default",
            Self::Unset => "unset",
        })
    }
}

impl Loaded {
    fn source(&self, id: &str) -> Source {
        let matches = match self.matches.subcommand() {
            Some((_, sub)) if sub.try_get_raw(id).is_ok() => sub,
            _ => &self.matches,
        };
        match matches.value_source(id) {
            Some(ValueSource::CommandLine) => Source::Flag,
            Some(ValueSource::EnvVariable) => Source::Env,
            Some(ValueSource::DefaultValue) if self.env_alias_ids.iter().any(|key| key == id) => {
                Source::Env
            }
            Some(ValueSource::DefaultValue) if self.file_keys.iter().any(|key| key == id) => {
                Source::File
            }
            Some(ValueSource::DefaultValue) => Source::Default,
            _ => Source::Unset,
        }
    }

    /// The effective configuration as TOML a config file could hold, one key a line, each
    /// annotated with its source. Header values are masked.
    pub fn effective_config(&self, args: &RunArgs) -> String {
        let mut out = String::new();
        if let Some(file) = &self.file {
            out.push_str(&format!("# config file: {}\n", file.display()));
        }
        let keys = file_keys(&Cli::command());
        for (id, value) in effective_values(&self.cli, args) {
            let source = self.source(id);
            let key = keys
                .iter()
                .find(|option| option.id == id)
                .map_or(id, |option| option.long.as_str());
            match value {
                Some(value) => out.push_str(&format!("{key} = {value}  # {source}\n")),
                None => out.push_str(&format!("# {key} (not set)\n")),
            }
        }
        out
    }
}

fn toml_string(text: &str) -> String {
    toml::Value::String(text.to_owned()).to_string()
}

fn toml_list<T: fmt::Display>(items: &[T]) -> Option<String> {
    (!items.is_empty()).then(|| {
        let items: Vec<String> = items
            .iter()
            .map(|item| toml_string(&item.to_string()))
            .collect();
        format!("[{}]", items.join(", "))
    })
}

fn value_name<T: clap::ValueEnum>(value: &T) -> String {
    let name = value.to_possible_value().expect("no skipped variants");
    toml_string(name.get_name())
}

/// Every `run` option with its effective value as TOML (None when unset). Secrets are masked
/// by their types' Display.
fn effective_values(cli: &Cli, args: &RunArgs) -> Vec<(&'static str, Option<String>)> {
    let path =
        |path: &Option<PathBuf>| path.as_ref().map(|p| toml_string(&p.display().to_string()));
    let shown = |value: &Option<String>| value.as_deref().map(toml_string);
    let mut values = vec![
        ("pids", toml_list(&args.pids).or_else(|| Some("[]".into()))),
        ("discover", args.discover.as_ref().map(value_name)),
        ("server_name", shown(&args.server_name)),
        (
            "server_type",
            args.server_type.map(|t| toml_string(&t.to_string())),
        ),
        (
            "span_groups",
            Some(toml_string(&args.span_groups.to_string())),
        ),
        (
            "routes",
            toml_list(&args.routes).or_else(|| Some("[]".into())),
        ),
        ("no_route_harvest", Some(args.no_route_harvest.to_string())),
        ("no_task_contexts", Some(args.no_task_contexts.to_string())),
        ("task_lineage", Some(value_name(&args.task_lineage))),
        ("max_tasks", Some(args.max_tasks.to_string())),
        ("no_tls", Some(args.no_tls.to_string())),
        (
            "inject_traceparent",
            Some(value_name(&args.inject_traceparent)),
        ),
        ("tls_probe_scope", Some(value_name(&args.tls_probe_scope))),
        ("ready_file", path(&args.ready_file)),
        ("summary_file", path(&args.summary_file)),
        ("report", path(&args.report)),
        ("report_trace_url", shown(&args.report_trace_url)),
        ("record", path(&args.record)),
        ("capture_bytes", Some(args.capture_bytes.to_string())),
        (
            "ring_buffer_bytes",
            Some(args.ring_buffer_bytes.to_string()),
        ),
        (
            "otlp_endpoint",
            args.otlp_endpoint
                .as_deref()
                .map(|e| toml_string(&printable_endpoint(e))),
        ),
        ("otlp_protocol", Some(value_name(&args.otlp_protocol))),
        (
            "otlp_headers",
            args.otlp_headers
                .as_ref()
                .map(|h| toml_string(&h.to_string())),
        ),
        ("otlp_timeout", Some(args.otlp_timeout.to_string())),
        ("otlp_compression", Some(value_name(&args.otlp_compression))),
        ("otlp_ca_file", path(&args.otlp_ca_file)),
        ("otlp_client_cert", path(&args.otlp_client_cert)),
        ("otlp_client_key", path(&args.otlp_client_key)),
        (
            "export_batch_size",
            Some(args.export_batch_size.to_string()),
        ),
        (
            "export_queue_size",
            Some(args.export_queue_size.to_string()),
        ),
        (
            "export_buffer_spans",
            Some(args.export_buffer_spans.to_string()),
        ),
        ("shutdown_timeout", Some(args.shutdown_timeout.to_string())),
        (
            "resource_attributes",
            args.resource_attributes
                .as_ref()
                .map(|r| toml_string(&r.to_string())),
        ),
        ("output", Some(value_name(&args.output))),
        ("service_name", shown(&args.service_name)),
        ("metric_interval", Some(args.metric_interval.to_string())),
        (
            "max_stitching_spans",
            Some(args.max_stitching_spans.to_string()),
        ),
        ("max_connections", Some(args.max_connections.to_string())),
        (
            "health_listen",
            args.health_listen.map(|h| toml_string(&h.to_string())),
        ),
        ("log_format", Some(value_name(&cli.log_format))),
    ];
    values.extend(signal_values(args));
    values
}

fn exporter_list(exporters: &[cli::SignalExporter]) -> Option<String> {
    let names: Vec<String> = exporters.iter().map(value_name).collect();
    (!names.is_empty()).then(|| format!("[{}]", names.join(", ")))
}

/// The per-signal export options, traces then metrics.
fn signal_values(args: &RunArgs) -> Vec<(&'static str, Option<String>)> {
    let path =
        |path: &Option<PathBuf>| path.as_ref().map(|p| toml_string(&p.display().to_string()));
    let endpoint =
        |url: &Option<String>| url.as_deref().map(|e| toml_string(&printable_endpoint(e)));
    let headers = |list: &Option<HeaderList>| list.as_ref().map(|h| toml_string(&h.to_string()));
    let (traces, metrics) = (&args.traces, &args.metrics);
    vec![
        ("traces_exporter", exporter_list(&traces.traces_exporter)),
        (
            "otlp_traces_endpoint",
            endpoint(&traces.otlp_traces_endpoint),
        ),
        (
            "otlp_traces_protocol",
            traces.otlp_traces_protocol.as_ref().map(value_name),
        ),
        ("otlp_traces_headers", headers(&traces.otlp_traces_headers)),
        (
            "otlp_traces_timeout",
            traces.otlp_traces_timeout.map(|ms| ms.to_string()),
        ),
        (
            "otlp_traces_compression",
            traces.otlp_traces_compression.as_ref().map(value_name),
        ),
        ("otlp_traces_ca_file", path(&traces.otlp_traces_ca_file)),
        (
            "otlp_traces_client_cert",
            path(&traces.otlp_traces_client_cert),
        ),
        (
            "otlp_traces_client_key",
            path(&traces.otlp_traces_client_key),
        ),
        ("metrics_exporter", exporter_list(&metrics.metrics_exporter)),
        (
            "otlp_metrics_endpoint",
            endpoint(&metrics.otlp_metrics_endpoint),
        ),
        (
            "otlp_metrics_protocol",
            metrics.otlp_metrics_protocol.as_ref().map(value_name),
        ),
        (
            "otlp_metrics_headers",
            headers(&metrics.otlp_metrics_headers),
        ),
        (
            "otlp_metrics_timeout",
            metrics.otlp_metrics_timeout.map(|ms| ms.to_string()),
        ),
        (
            "otlp_metrics_compression",
            metrics.otlp_metrics_compression.as_ref().map(value_name),
        ),
        ("otlp_metrics_ca_file", path(&metrics.otlp_metrics_ca_file)),
        (
            "otlp_metrics_client_cert",
            path(&metrics.otlp_metrics_client_cert),
        ),
        (
            "otlp_metrics_client_key",
            path(&metrics.otlp_metrics_client_key),
        ),
    ]
}

/// Checks what clap cannot: combinations, and files that must exist. Run by both `run` and
/// `check-config`, so a bad configuration fails before anything is loaded into the kernel.
pub fn validate(args: &RunArgs) -> Result<()> {
    if args.pids.is_empty() && args.discover.is_none() {
        bail!(
            "nothing to trace: give --pid PID or --discover gym (or `pid = [...]` / \
             `discover = \"gym\"` in the --config file, or GYM_TRACER_PID / GYM_TRACER_DISCOVER)"
        );
    }
    if args.pids.is_empty() && (args.server_name.is_some() || args.server_type.is_some()) {
        bail!("--server-name and --server-type label --pid processes; give --pid too");
    }
    match (&args.otlp_client_cert, &args.otlp_client_key) {
        (Some(_), None) => bail!("--otlp-client-cert needs --otlp-client-key"),
        (None, Some(_)) => bail!("--otlp-client-key needs --otlp-client-cert"),
        _ => {}
    }
    export_plan::export_plan(args).map(drop)
}

/// `gym-tracer check-config`.
pub fn check_config(loaded: &Loaded) -> Result<()> {
    let Command::CheckConfig(args) = &loaded.cli.command else {
        unreachable!("check_config is called for the check-config subcommand");
    };
    print!("{}", loaded.effective_config(args));
    validate(args)?;
    let plan = export_plan::export_plan(args)?;
    println!("# spans go to {}", plan.spans.describe());
    println!("# metrics go to {}", plan.metrics.describe());
    println!("# configuration is valid");
    Ok(())
}

/// Markdown table of every `run` option: flag, environment variable, file key, default.
pub fn options_reference() -> String {
    let command = Cli::command();
    let run = command.find_subcommand("run").expect("run exists");
    let mut out = String::from(
        "| flag | environment | file key | default | meaning |\n|---|---|---|---|---|\n",
    );
    for arg in run.get_arguments().chain(command.get_arguments()) {
        let Some(long) = arg.get_long() else { continue };
        if matches!(long, "help" | "version") {
            continue;
        }
        let env = arg
            .get_env()
            .map(|env| format!("`{}`", env.to_string_lossy()))
            .unwrap_or_default();
        let key = if NOT_IN_FILE.contains(&arg.get_id().as_str()) {
            String::new()
        } else {
            format!("`{long}`")
        };
        let default: Vec<String> = arg
            .get_default_values()
            .iter()
            .map(|value| value.to_string_lossy().into_owned())
            .collect();
        let default = if default.is_empty() {
            String::new()
        } else {
            format!("`{}`", default.join(","))
        };
        let help = arg
            .get_help()
            .map(|help| help.to_string())
            .unwrap_or_default()
            .replace('|', "\\|")
            .replace('\n', " ");
        out.push_str(&format!(
            "| `--{long}` | {env} | {key} | {default} | {help} |\n"
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Held by every test that sets or reads the process environment.
    static ENV_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn load_with(args: &[&str], env: &[(&str, &str)], file: Option<&str>) -> Result<Loaded> {
        let dir = std::env::temp_dir().join(format!(
            "gym-tracer-config-test-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("config.toml");
        let mut argv: Vec<OsString> = vec!["gym-tracer".into()];
        if let Some(text) = file {
            std::fs::write(&path, text).unwrap();
            argv.push("--config".into());
            argv.push(path.clone().into());
        }
        argv.extend(args.iter().map(OsString::from));
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        // clap reads env vars from the process, and the tests run in parallel threads: one
        // test's variables would leak into another's load. Every load holds this lock.
        let _serial = ENV_LOCK.lock().unwrap_or_else(|poison| poison.into_inner());
        for (key, value) in &env {
            // SAFETY: test-only; the config tests use variables nothing else reads.
            unsafe { std::env::set_var(key, value) };
        }
        let loaded = load_from(argv, |name| std::env::var_os(name));
        for (key, _) in &env {
            // SAFETY: as above.
            unsafe { std::env::remove_var(key) };
        }
        loaded
    }

    fn run_args(loaded: &Loaded) -> &RunArgs {
        match &loaded.cli.command {
            Command::Run(args) | Command::CheckConfig(args) => args,
            _ => panic!("not run"),
        }
    }

    #[test]
    fn file_values_are_used_when_nothing_else_sets_them() {
        let loaded = load_with(
            &["run"],
            &[],
            Some("discover = \"gym\"\nmetric-interval = 25\nroute = [\"/a/{x}\", \"/b\"]\nno_route_harvest = true\n"),
        )
        .unwrap();
        let args = run_args(&loaded);
        assert!(args.discover.is_some());
        assert_eq!(args.metric_interval, 25);
        assert_eq!(args.routes.len(), 2);
        assert!(args.no_route_harvest);
        assert_eq!(loaded.source("metric_interval"), Source::File);
        assert_eq!(loaded.source("max_connections"), Source::Default);
    }

    #[test]
    fn flag_beats_env_beats_file() {
        let file = Some(
            "discover = \"gym\"\nmax-stitching-spans = 10\nmax-connections = 20\nmetric-interval = 30\n",
        );
        let loaded = load_with(
            &["run", "--max-stitching-spans", "11"],
            &[
                ("GYM_TRACER_MAX_STITCHING_SPANS", "12"),
                ("GYM_TRACER_MAX_CONNECTIONS", "21"),
            ],
            file,
        )
        .unwrap();
        let args = run_args(&loaded);
        assert_eq!(args.max_stitching_spans, 11, "flag wins over env and file");
        assert_eq!(args.max_connections, 21, "env wins over file");
        assert_eq!(args.metric_interval, 30, "file wins over default");
        assert_eq!(loaded.source("max_stitching_spans"), Source::Flag);
        assert_eq!(loaded.source("max_connections"), Source::Env);
        assert_eq!(loaded.source("metric_interval"), Source::File);
    }

    #[test]
    fn a_renamed_option_keeps_its_old_flag_file_key_and_variable() {
        let loaded = load_with(&["run", "--max-pending-spans", "7"], &[], None).unwrap();
        assert_eq!(run_args(&loaded).max_stitching_spans, 7);
        let loaded = load_with(&["run"], &[], Some("max-pending-spans = 8\n")).unwrap();
        assert_eq!(run_args(&loaded).max_stitching_spans, 8);
        assert_eq!(loaded.source("max_stitching_spans"), Source::File);
        let file = Some("max-pending-spans = 8\n");
        let env = [("GYM_TRACER_MAX_PENDING_SPANS", "9")];
        let loaded = load_with(&["run"], &env, file).unwrap();
        assert_eq!(run_args(&loaded).max_stitching_spans, 9, "env beats file");
        assert_eq!(loaded.source("max_stitching_spans"), Source::Env);
        let both = [
            ("GYM_TRACER_MAX_PENDING_SPANS", "9"),
            ("GYM_TRACER_MAX_STITCHING_SPANS", "10"),
        ];
        let loaded = load_with(&["run"], &both, file).unwrap();
        assert_eq!(
            run_args(&loaded).max_stitching_spans,
            10,
            "the new name wins"
        );
        let loaded = load_with(&["run", "--max-stitching-spans", "11"], &both, file).unwrap();
        assert_eq!(run_args(&loaded).max_stitching_spans, 11, "the flag wins");
    }

    #[test]
    fn unknown_keys_and_bad_toml_are_errors_that_name_the_problem() {
        let error = load_with(&["run"], &[], Some("discovr = \"gym\"\n"))
            .err()
            .unwrap();
        assert!(
            error.to_string().contains("unknown key `discovr`"),
            "{error}"
        );
        assert!(
            error.to_string().contains("discover"),
            "lists the valid keys: {error}"
        );
        let error = load_with(
            &["run"],
            &[],
            Some("otlp-headers = \"authorization=Bearer sk-123\nx"),
        )
        .err()
        .unwrap();
        assert!(error.to_string().contains("at line 2"), "{error}");
        assert!(
            !format!("{error:#}").contains("sk-123"),
            "no secret in the error: {error:#}"
        );
        let error = load_with(&["run"], &[], Some("metric-interval = [1, 2]\n"))
            .err()
            .unwrap();
        assert!(error.to_string().contains("takes one value"), "{error}");
    }

    #[test]
    fn check_config_masks_header_values_and_names_sources() {
        let loaded = load_with(
            &["check-config", "--pid", "1"],
            &[(
                "OTEL_EXPORTER_OTLP_HEADERS",
                "authorization=Bearer%20sk-secret,x-tenant=a",
            )],
            None,
        )
        .unwrap();
        let args = run_args(&loaded);
        let headers = args.otlp_headers.as_ref().unwrap();
        assert_eq!(headers.0[0].1, "Bearer sk-secret", "percent-decoded");
        let text = loaded.effective_config(args);
        assert!(
            text.contains("otlp-headers = \"authorization=***,x-tenant=***\"  # env"),
            "{text}"
        );
        assert!(!text.contains("sk-secret"), "{text}");
        assert!(text.contains("pid = [\"1\"]  # flag"), "{text}");
        assert!(!format!("{args:?}").contains("sk-secret"));
        // `--help` prints environment values next to options; never this one's.
        let _serial = ENV_LOCK.lock().unwrap_or_else(|poison| poison.into_inner());
        // SAFETY: test-only; loads that read the environment hold ENV_LOCK too.
        unsafe { std::env::set_var("OTEL_EXPORTER_OTLP_HEADERS", "authorization=sk-secret") };
        let mut help = Vec::new();
        Cli::command()
            .find_subcommand_mut("run")
            .unwrap()
            .write_long_help(&mut help)
            .unwrap();
        // SAFETY: as above.
        unsafe { std::env::remove_var("OTEL_EXPORTER_OTLP_HEADERS") };
        let help = String::from_utf8(help).unwrap();
        assert!(help.contains("OTEL_EXPORTER_OTLP_HEADERS"), "{help}");
        assert!(
            !help.contains("sk-secret"),
            "--help shows the header values"
        );
    }

    /// The error `validate` gives for `run` with these arguments (`--discover gym` added).
    fn validation_error(args: &[&str]) -> String {
        let argv: Vec<&str> = ["run", "--discover", "gym"]
            .into_iter()
            .chain(args.iter().copied())
            .collect();
        let loaded = load_with(&argv, &[], None).unwrap();
        format!("{:#}", validate(run_args(&loaded)).unwrap_err())
    }

    #[test]
    fn validation_names_what_to_do() {
        let loaded = load_with(&["run"], &[], None).unwrap();
        let error = validate(run_args(&loaded)).unwrap_err().to_string();
        assert!(error.contains("--discover gym"), "{error}");
        let error = validation_error(&[
            "--otlp-endpoint",
            "http://c:4317",
            "--otlp-ca-file",
            "/etc/hostname",
        ]);
        assert!(error.contains("use https://"), "{error}");
        let error = validation_error(&["--otlp-endpoint", "collector:4317"]);
        assert!(error.contains("http:// or https://"), "{error}");
        let error = validation_error(&[
            "--otlp-endpoint",
            "https://c:4317",
            "--otlp-ca-file",
            "/nonexistent/ca.pem",
        ]);
        assert!(error.contains("/nonexistent/ca.pem"), "{error}");
        // check-config reads the files as the exporter will: a file that is not PEM fails now,
        // not at the first TLS handshake.
        let not_pem =
            std::env::temp_dir().join(format!("gym-tracer-not-pem-{}", std::process::id()));
        std::fs::write(&not_pem, "hostname\n").unwrap();
        let error = validation_error(&[
            "--otlp-endpoint",
            "https://c:4317",
            "--otlp-ca-file",
            &not_pem.display().to_string(),
        ]);
        std::fs::remove_file(&not_pem).unwrap();
        assert!(
            error.contains("--otlp-ca-file") && error.contains("no PEM"),
            "{error}"
        );
    }

    /// The export plan of `run --discover gym` with these flags and variables.
    fn plan_of(args: &[&str], env: &[(&str, &str)]) -> Result<export_plan::ExportPlan> {
        let argv: Vec<&str> = ["run", "--discover", "gym"]
            .into_iter()
            .chain(args.iter().copied())
            .collect();
        let loaded = load_with(&argv, env, None).unwrap();
        export_plan::export_plan(run_args(&loaded))
    }

    fn otlp(target: &crate::export::ExportTarget) -> &crate::export::otlp::options::OtlpOptions {
        target.otlp.as_ref().expect("exported over OTLP")
    }

    #[test]
    fn per_signal_settings_win_over_the_generic_ones_for_their_signal_only() {
        use crate::export::otlp::Signal;
        use crate::export::{ExportTarget, StdoutFormat};
        let json = ExportTarget::stdout(StdoutFormat::JsonLines);
        use crate::export::otlp::options::{OtlpCompression, OtlpProtocol};
        // Nothing set: both on stdout, as before.
        let plan = plan_of(&[], &[]).unwrap();
        assert_eq!((plan.spans, plan.metrics), (json.clone(), json.clone()));
        // The generic endpoint: both over OTLP, OTLP/HTTP appending each signal's path.
        let plan = plan_of(&["--otlp-endpoint", "http://c:4318/"], &[]).unwrap();
        assert_eq!(
            otlp(&plan.spans).endpoint.http_url(Signal::Traces),
            "http://c:4318/v1/traces"
        );
        assert_eq!(
            otlp(&plan.metrics).endpoint.http_url(Signal::Metrics),
            "http://c:4318/v1/metrics"
        );
        // Phoenix: traces to their own URL (used as it is), metrics nowhere.
        let plan = plan_of(
            &[],
            &[
                (
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                    "http://p:6006/v1/traces",
                ),
                ("OTEL_METRICS_EXPORTER", "none"),
            ],
        )
        .unwrap();
        assert_eq!(
            otlp(&plan.spans).endpoint.http_url(Signal::Traces),
            "http://p:6006/v1/traces"
        );
        assert_eq!(plan.metrics, ExportTarget::NOWHERE);
        // Protocol, timeout, compression and headers per signal; the rest from the generic.
        let plan = plan_of(
            &[
                "--otlp-endpoint",
                "http://c:4318",
                "--otlp-timeout",
                "700",
                "--otlp-headers",
                "authorization=a",
            ],
            &[
                ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http://m:4317"),
                ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "grpc"),
                ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "900"),
                ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip"),
                ("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "authorization=m"),
            ],
        )
        .unwrap();
        let (spans, metrics) = (otlp(&plan.spans), otlp(&plan.metrics));
        assert_eq!(
            (spans.protocol, metrics.protocol),
            (OtlpProtocol::HttpProtobuf, OtlpProtocol::Grpc)
        );
        assert_eq!(
            (spans.timeout.as_millis(), metrics.timeout.as_millis()),
            (700, 900)
        );
        assert_eq!(
            (spans.compression, metrics.compression),
            (OtlpCompression::Gzip, OtlpCompression::None)
        );
        assert_eq!(
            (
                spans.headers.0[0].1.as_str(),
                metrics.headers.0[0].1.as_str()
            ),
            ("a", "m")
        );
        assert_eq!(plan.metrics.describe(), "OTLP/gRPC http://m:4317");
        // console keeps a signal on stdout whatever the endpoint; an explicit otlp with no
        // endpoint goes to OpenTelemetry's default one.
        let plan = plan_of(
            &["--otlp-endpoint", "http://c:4318", "--output", "tree"],
            &[("OTEL_TRACES_EXPORTER", "console")],
        )
        .unwrap();
        assert_eq!(plan.spans, ExportTarget::stdout(StdoutFormat::Tree));
        assert_eq!(
            plan.metrics.describe(),
            "OTLP/HTTP http://c:4318/v1/metrics"
        );
        let plan = plan_of(
            &["--traces-exporter", "otlp", "--otlp-protocol", "grpc"],
            &[],
        )
        .unwrap();
        assert_eq!(plan.spans.describe(), "OTLP/gRPC http://localhost:4317");
        assert_eq!(plan.metrics, json);
        // Both: the same spans to the collector and to stdout.
        let plan = plan_of(
            &["--otlp-endpoint", "http://c:4318"],
            &[("OTEL_TRACES_EXPORTER", "otlp,console")],
        )
        .unwrap();
        assert_eq!(
            plan.spans.describe(),
            "OTLP/HTTP http://c:4318/v1/traces and JSON lines on stdout"
        );
        let error = plan_of(&["--traces-exporter", "none,console"], &[]).unwrap_err();
        assert!(
            error.to_string().contains("`none` cannot be combined"),
            "{error}"
        );
    }

    #[test]
    fn per_signal_errors_name_the_per_signal_option() {
        let error = validation_error(&["--otlp-metrics-endpoint", "m:4317"]);
        assert!(
            error.starts_with("--otlp-metrics-endpoint `m:4317` must start with http://"),
            "{error}"
        );
        let error = validation_error(&[
            "--otlp-endpoint",
            "https://c",
            "--otlp-traces-client-cert",
            "/etc/hostname",
        ]);
        assert_eq!(
            error,
            "--otlp-traces-client-cert needs --otlp-traces-client-key"
        );
        let error = validation_error(&[
            "--otlp-traces-endpoint",
            "http://c",
            "--otlp-traces-ca-file",
            "/etc/hostname",
        ]);
        assert!(error.contains("TLS files are set for traces"), "{error}");
        let error = <Cli as clap::Parser>::try_parse_from([
            "gym-tracer",
            "run",
            "--metrics-exporter",
            "prometheus",
        ])
        .unwrap_err()
        .to_string();
        assert!(
            error.contains("[possible values: otlp, console, none]"),
            "{error}"
        );
    }

    #[test]
    fn health_listen_values_parse() {
        assert_eq!(
            "9464".parse::<HealthListen>().unwrap().to_string(),
            "127.0.0.1:9464"
        );
        assert_eq!(
            "0.0.0.0:9464".parse::<HealthListen>().unwrap().to_string(),
            "0.0.0.0:9464"
        );
        assert!("localhost".parse::<HealthListen>().is_err());
    }

    #[test]
    fn every_run_option_is_in_the_reference_and_check_config() {
        let reference = options_reference();
        let command = Cli::command();
        let run = command.find_subcommand("run").unwrap();
        let loaded = load_with(&["check-config", "--discover", "gym"], &[], None).unwrap();
        let effective = effective_values(&loaded.cli, run_args(&loaded));
        for arg in run.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if long == "help" {
                continue;
            }
            assert!(
                reference.contains(&format!("`--{long}`")),
                "{long} missing from the reference"
            );
            assert!(
                arg.get_env().is_some(),
                "--{long} has no environment variable"
            );
            assert!(
                effective.iter().any(|(id, _)| *id == arg.get_id().as_str()),
                "--{long} missing from check-config"
            );
        }
    }
}
