//! A recording of everything a driver fed the core: ring-buffer records, the release timer,
//! the ends of steps, processes attached and forgotten, routes harvested, peers named. Fed to
//! a fresh core again ([`Recording::feed`]), it gives the same spans: a run of the real Gym
//! servers becomes a unit test that checks its trees and the workload `pipeline_cost`
//! measures, without a kernel.
//!
//! Written by `gym-tracer run --record FILE`. The file holds the traced processes' bytes as
//! the kernel captured them, bodies included: it is for tests and bug reports, kept on the
//! host, never exported.
//!
//! Format: [`MAGIC`], the record layout's [`fingerprint`], the [`RecordedConfig`], then
//! entries, each `kind: u8, at_ns: u64, length: u32, payload` (little-endian), `at_ns` counted
//! from the recording's start on the driver's clock.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::gym::routes::RouteTemplate;
use crate::gym::span_groups::SpanGroups;
use crate::gym::{ServerKind, ServerType};
use crate::model::ids::MintKey;
use crate::model::service::{AgentResource, GymLabels};
use crate::pipeline::{Observer, Pipeline, PipelineConfig, PipelineOutput};
use crate::signals::clock::WallClock;
use crate::signals::metrics::RequestMetrics;
use crate::stitch::{Injection, StitchConfig};

pub const MAGIC: &[u8; 24] = b"gym-tracer recording 1\n\0";

/// A recording stops growing here; what came after is counted (`inputs_not_recorded`).
pub const MAX_RECORDING_BYTES: u64 = 1 << 30;

/// The kernel records' layout as this build reads them: a recording made by a build with
/// another layout is refused rather than misread.
pub fn fingerprint() -> u64 {
    use tracer_abi::*;
    let sizes = [
        size_of::<EventHeader>(),
        size_of::<ConnOpenEvent>(),
        size_of::<DataEventHeader>(),
        size_of::<ProcessForkEvent>(),
        size_of::<ProcessExecEvent>(),
        size_of::<TaskContextEvent>(),
        size_of::<TlsDataHeader>(),
        MAX_CAPTURE_BYTES,
        TAIL_BYTES,
    ];
    // FNV-1a over the sizes: stable across builds and platforms of one layout.
    sizes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &size| {
        (hash ^ size as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The configuration the recorded core ran with that decides what it makes of the records:
/// its clock, `--route` templates, service name and resource attributes, span groups, and
/// `--inject-traceparent` with the key the kernel minted traces with (the stitcher must mint
/// the same ones). Not its memory bounds: a replay runs with the defaults.
#[derive(Clone, Debug)]
pub struct RecordedConfig {
    /// Kernel timestamps to wall time as the recording host had them.
    pub clock: WallClock,
    pub routes: Vec<String>,
    pub service_name: Option<String>,
    pub resource_attributes: Vec<(String, String)>,
    pub groups: SpanGroups,
    pub injection: Option<Injection>,
}

impl RecordedConfig {
    pub fn of(config: &PipelineConfig) -> Self {
        let agent = &config.agent_resource;
        Self {
            clock: config.clock,
            routes: config
                .routes
                .iter()
                .map(|route| route.as_str().to_owned())
                .collect(),
            service_name: agent.service_name.clone(),
            resource_attributes: agent
                .extra
                .iter()
                .map(|(key, value)| (key.to_string(), value.clone()))
                .collect(),
            groups: config.groups,
            injection: config.stitch.injection,
        }
    }

    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.clock.offset_ns().to_le_bytes());
        out.extend_from_slice(&(self.routes.len() as u32).to_le_bytes());
        for route in &self.routes {
            put_str(out, route);
        }
        put_optional(out, self.service_name.as_deref());
        out.extend_from_slice(&(self.resource_attributes.len() as u32).to_le_bytes());
        for (key, value) in &self.resource_attributes {
            put_str(out, key);
            put_str(out, value);
        }
        put_str(out, &self.groups.to_string());
        match self.injection {
            None => out.push(0),
            Some(injection) => {
                out.push(1 + u8::from(injection.every_call));
                for half in injection.mint_key.0 {
                    out.extend_from_slice(&half.to_le_bytes());
                }
            }
        }
    }

    fn decode(reader: &mut Reader<'_>) -> Result<Self, RecordingError> {
        let clock = WallClock::from_offset_ns(reader.array().map(i128::from_le_bytes)?);
        let routes = (0..reader.u32()?)
            .map(|_| reader.str().map(str::to_owned))
            .collect::<Result<_, _>>()?;
        let service_name = reader.optional()?.map(str::to_owned);
        let resource_attributes = (0..reader.u32()?)
            .map(|_| Ok((reader.str()?.to_owned(), reader.str()?.to_owned())))
            .collect::<Result<_, RecordingError>>()?;
        let groups = reader
            .str()?
            .parse()
            .map_err(|_| RecordingError::Malformed("the span groups"))?;
        let injection = match reader.take(1)?[0] {
            0 => None,
            mode @ (1 | 2) => Some(Injection {
                every_call: mode == 2,
                mint_key: MintKey([reader.u64()?, reader.u64()?]),
            }),
            _ => return Err(RecordingError::Malformed("the injection mode")),
        };
        Ok(Self {
            clock,
            routes,
            service_name,
            resource_attributes,
            groups,
            injection,
        })
    }

    /// A core configured as the recorded one, with the agent's default bounds.
    pub fn pipeline_config(&self) -> PipelineConfig {
        PipelineConfig {
            clock: self.clock,
            max_connections: 65_536,
            routes: self
                .routes
                .iter()
                .filter_map(|route| RouteTemplate::parse(route).ok())
                .collect(),
            agent_resource: AgentResource {
                replayed: true,
                ..AgentResource::new(self.service_name.clone(), self.resource_attributes.clone())
            },
            groups: self.groups,
            stitch: StitchConfig {
                max_pending: 100_000,
                max_nodes: 400_000,
                injection: self.injection,
            },
        }
    }
}

/// What a driver did to the core, in the order it did it.
#[derive(Clone, Debug, PartialEq)]
pub enum Input<'a> {
    /// A ring-buffer record ([`Pipeline::handle_record`]).
    Record(&'a [u8]),
    /// [`Pipeline::release`].
    Release,
    /// [`Pipeline::release_all`].
    ReleaseAll,
    /// [`Pipeline::deliver`]: the end of a step.
    Deliver,
    Attach {
        pid: u32,
        labels: GymLabels,
    },
    Forget {
        pid: u32,
    },
    Routes {
        root: u32,
        templates: Vec<&'a str>,
    },
    NamePeer {
        address: SocketAddr,
        name: &'a str,
        server_type: Option<ServerType>,
    },
    /// The route harvest marked its connection as the agent's own (written before the record
    /// that used the mark up).
    OwnRequest {
        client_port: u16,
        server_port: u16,
    },
}

impl Input<'_> {
    fn kind(&self) -> u8 {
        match self {
            Input::Record(_) => 1,
            Input::Release => 2,
            Input::ReleaseAll => 3,
            Input::Deliver => 4,
            Input::Attach { .. } => 5,
            Input::Forget { .. } => 6,
            Input::Routes { .. } => 7,
            Input::NamePeer { .. } => 8,
            Input::OwnRequest { .. } => 9,
        }
    }

    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Input::Record(bytes) => out.extend_from_slice(bytes),
            Input::Release | Input::ReleaseAll | Input::Deliver => {}
            Input::Attach { pid, labels } => {
                out.extend_from_slice(&pid.to_le_bytes());
                for text in [
                    labels.server_name.as_deref(),
                    labels.server_kind.as_ref().map(ServerKind::config_key),
                    labels.service_group.as_deref(),
                ] {
                    put_optional(out, text);
                }
            }
            Input::Forget { pid } => out.extend_from_slice(&pid.to_le_bytes()),
            Input::Routes { root, templates } => {
                out.extend_from_slice(&root.to_le_bytes());
                out.extend_from_slice(&(templates.len() as u32).to_le_bytes());
                for template in templates {
                    put_str(out, template);
                }
            }
            Input::NamePeer {
                address,
                name,
                server_type,
            } => {
                put_str(out, &address.to_string());
                put_str(out, name);
                put_optional(out, server_type.map(ServerType::config_key));
            }
            Input::OwnRequest {
                client_port,
                server_port,
            } => {
                out.extend_from_slice(&client_port.to_le_bytes());
                out.extend_from_slice(&server_port.to_le_bytes());
            }
        }
    }

    fn decode(kind: u8, payload: &[u8]) -> Result<Input<'_>, RecordingError> {
        let mut reader = Reader(payload);
        let input = match kind {
            1 => return Ok(Input::Record(payload)),
            2 => Input::Release,
            3 => Input::ReleaseAll,
            4 => Input::Deliver,
            5 => Input::Attach {
                pid: reader.u32()?,
                labels: GymLabels {
                    server_name: reader.optional()?.map(str::to_owned),
                    server_kind: reader.optional()?.map(ServerKind::from_config_key),
                    service_group: reader.optional()?.map(str::to_owned),
                },
            },
            6 => Input::Forget { pid: reader.u32()? },
            7 => {
                let root = reader.u32()?;
                let count = reader.u32()?;
                let templates = (0..count).map(|_| reader.str()).collect::<Result<_, _>>()?;
                Input::Routes { root, templates }
            }
            8 => Input::NamePeer {
                address: reader
                    .str()?
                    .parse()
                    .map_err(|_| RecordingError::Malformed("a peer's address"))?,
                name: reader.str()?,
                server_type: match reader.optional()? {
                    Some(key) => Some(
                        ServerType::from_config_key(key)
                            .ok_or(RecordingError::Malformed("a peer's server type"))?,
                    ),
                    None => None,
                },
            },
            9 => Input::OwnRequest {
                client_port: reader.array().map(u16::from_le_bytes)?,
                server_port: reader.array().map(u16::from_le_bytes)?,
            },
            _ => return Err(RecordingError::Malformed("an entry's kind")),
        };
        if !reader.0.is_empty() {
            return Err(RecordingError::Malformed("an entry's length"));
        }
        Ok(input)
    }
}

fn put_str(out: &mut Vec<u8>, text: &str) {
    out.extend_from_slice(&(text.len() as u32).to_le_bytes());
    out.extend_from_slice(text.as_bytes());
}

fn put_optional(out: &mut Vec<u8>, text: Option<&str>) {
    match text {
        Some(text) => {
            out.push(1);
            put_str(out, text);
        }
        None => out.push(0),
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], RecordingError> {
        if self.0.len() < n {
            return Err(RecordingError::Truncated);
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], RecordingError> {
        let mut array = [0; N];
        array.copy_from_slice(self.take(N)?);
        Ok(array)
    }

    fn u32(&mut self) -> Result<u32, RecordingError> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, RecordingError> {
        self.array().map(u64::from_le_bytes)
    }

    fn str(&mut self) -> Result<&'a str, RecordingError> {
        let length = self.u32()? as usize;
        std::str::from_utf8(self.take(length)?).map_err(|_| RecordingError::Malformed("a text"))
    }

    fn optional(&mut self) -> Result<Option<&'a str>, RecordingError> {
        match self.take(1)?[0] {
            0 => Ok(None),
            1 => self.str().map(Some),
            _ => Err(RecordingError::Malformed("an optional text")),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RecordingError {
    #[error("not a gym-tracer recording (it does not start with {MAGIC:?})")]
    NotARecording,
    #[error(
        "the recording was made by a gym-tracer whose kernel records are laid out differently: \
         record it again with this build (`gym-tracer run --record FILE`)"
    )]
    OtherLayout,
    #[error("the recording is cut short inside an entry")]
    Truncated,
    #[error("the recording holds a malformed entry: {0}")]
    Malformed(&'static str),
}

/// Writes the inputs of a running core to a file (`--record FILE`).
pub struct Recorder {
    out: BufWriter<File>,
    started: Instant,
    written: u64,
    /// Set once a write failed or the size limit was reached: nothing more is written.
    stopped: bool,
    entry: Vec<u8>,
}

impl Recorder {
    pub fn create(path: &Path, config: RecordedConfig) -> std::io::Result<Self> {
        let mut out = BufWriter::with_capacity(1 << 20, File::create(path)?);
        let mut head = MAGIC.to_vec();
        head.extend_from_slice(&fingerprint().to_le_bytes());
        config.encode(&mut head);
        out.write_all(&head)?;
        Ok(Self {
            out,
            started: Instant::now(),
            written: head.len() as u64,
            stopped: false,
            entry: Vec::new(),
        })
    }

    /// Appends `input`, made at `at`; false once the recording has stopped (the caller counts).
    pub fn write(&mut self, input: &Input<'_>, at: Instant) -> bool {
        if self.stopped {
            return false;
        }
        self.entry.clear();
        input.encode(&mut self.entry);
        let at_ns = at.saturating_duration_since(self.started).as_nanos() as u64;
        let size = 13 + self.entry.len() as u64;
        if self.written + size > MAX_RECORDING_BYTES {
            tracing::warn!(
                "the recording reached {MAX_RECORDING_BYTES} bytes: it stops here (the agent \
                 goes on; inputs_not_recorded counts what was left out)"
            );
            return self.stop();
        }
        let result = (|| {
            self.out.write_all(&[input.kind()])?;
            self.out.write_all(&at_ns.to_le_bytes())?;
            self.out
                .write_all(&(self.entry.len() as u32).to_le_bytes())?;
            self.out.write_all(&self.entry)
        })();
        if let Err(error) = result {
            tracing::warn!("the recording stops: {error}");
            return self.stop();
        }
        self.written += size;
        true
    }

    fn stop(&mut self) -> bool {
        self.stopped = true;
        let _ = self.out.flush();
        false
    }

    pub fn flush(&mut self) {
        if let Err(error) = self.out.flush() {
            tracing::warn!("the recording could not be written out: {error}");
        }
    }
}

/// A recording read back: its entries, in order, with their offsets from its start.
pub struct Recording<'a> {
    pub config: RecordedConfig,
    pub entries: Vec<(Duration, Input<'a>)>,
}

impl<'a> Recording<'a> {
    pub fn parse(bytes: &'a [u8]) -> Result<Self, RecordingError> {
        let mut reader = Reader(bytes);
        if reader.take(MAGIC.len()).ok() != Some(MAGIC.as_slice()) {
            return Err(RecordingError::NotARecording);
        }
        if reader.u64()? != fingerprint() {
            return Err(RecordingError::OtherLayout);
        }
        let config = RecordedConfig::decode(&mut reader)?;
        let mut entries = Vec::new();
        while !reader.0.is_empty() {
            let kind = reader.take(1)?[0];
            let at = Duration::from_nanos(reader.u64()?);
            let length = reader.u32()? as usize;
            entries.push((at, Input::decode(kind, reader.take(length)?)?));
        }
        Ok(Self { config, entries })
    }

    /// Feeds every entry to `pipeline` as the recorded driver did, the recording's start at
    /// `epoch`; `delivered` gets each step's output (then cleared).
    pub fn feed<M: RequestMetrics>(
        &self,
        pipeline: &mut Pipeline<M>,
        epoch: Instant,
        observer: &mut impl Observer,
        mut delivered: impl FnMut(&mut PipelineOutput),
    ) {
        let mut output = PipelineOutput::default();
        for (at, input) in &self.entries {
            let now = epoch + *at;
            match input {
                Input::Record(bytes) => pipeline.handle_record(bytes, now, observer),
                Input::Release => pipeline.release(now),
                Input::ReleaseAll => pipeline.release_all(),
                Input::Deliver => {
                    pipeline.deliver(&mut output);
                    delivered(&mut output);
                    output.clear();
                }
                Input::Attach { pid, labels } => {
                    pipeline.attach(*pid, labels.clone());
                }
                Input::Forget { pid } => {
                    pipeline.forget(*pid);
                }
                Input::Routes { root, templates } => {
                    let parsed: Vec<RouteTemplate> = templates
                        .iter()
                        .filter_map(|template| RouteTemplate::parse(template).ok())
                        .collect();
                    pipeline.set_harvested_routes(*root, &parsed);
                }
                Input::NamePeer {
                    address,
                    name,
                    server_type,
                } => pipeline.name_peer(*address, name, *server_type),
                Input::OwnRequest {
                    client_port,
                    server_port,
                } => pipeline.self_ports().insert(*client_port, *server_port),
            }
        }
        // A recording cut short (the agent killed) still lets every span go.
        pipeline.release_all();
        pipeline.deliver(&mut output);
        delivered(&mut output);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::attributes::{
        GYM_ROLLOUT_ID, GYM_ROLLOUT_MODEL_CALLS, GYM_ROLLOUT_TOOL_CALLS,
    };
    use crate::model::span::{AttributeValue, SpanRecord};
    use std::collections::BTreeMap;

    /// `tests/support/real_gym/record.py`: four rollouts at once through the real nemo-gym
    /// servers (simple_agent, example_single_tool_call, openai_model; ~11 KB bodies whose
    /// `_ng_*` ids are in their tails), recorded by the agent with its defaults.
    const REAL_GYM: &[u8] = include_bytes!("../../testdata/real_gym_rollouts.rec");
    const AGENT: &str = "example_single_tool_call_simple_agent";
    const MODEL: &str = "policy_model";
    const RESOURCES: &str = "example_single_tool_call";

    /// A tree as `name@server(children…)`, children sorted: order-free and comparable.
    fn canonical(name: &str, server: &str, mut children: Vec<String>) -> String {
        children.sort();
        format!("{name}@{server}({})", children.join(","))
    }

    /// One rollout as Gym's own telemetry draws it (`tests/test_real_gym.py`'s EXPECTED_TREE,
    /// from GYM_TELEMETRY.md): the run, its rollout span, and the agent's calls under it.
    fn gym_rollout_tree() -> String {
        let node =
            |name: &str, server: &str, children: Vec<String>| canonical(name, server, children);
        let model_call = || {
            let upstream = node("HTTP POST", MODEL, vec![]);
            let model = node("gym.model.responses", MODEL, vec![upstream]);
            let served = node("POST /v1/responses", MODEL, vec![model]);
            node("HTTP POST", AGENT, vec![served])
        };
        let call = |served: String| node("HTTP POST", AGENT, vec![served]);
        let responses = node(
            "gym.agent.responses",
            AGENT,
            vec![
                model_call(),
                call(node("POST /get_weather", RESOURCES, vec![])),
                model_call(),
            ],
        );
        let verify = node("gym.verify", RESOURCES, vec![]);
        let rollout = node(
            "gym.rollout",
            AGENT,
            vec![
                call(node("POST /seed_session", RESOURCES, vec![])),
                call(node("POST /v1/responses", AGENT, vec![responses])),
                call(node("POST /verify", RESOURCES, vec![verify])),
            ],
        );
        node("POST /run", AGENT, vec![rollout])
    }

    /// The trees of `spans` (roots: spans whose parent is not among them).
    fn trees(spans: &[&SpanRecord]) -> Vec<String> {
        fn tree(span: &SpanRecord, spans: &[&SpanRecord]) -> String {
            let children = spans
                .iter()
                .filter(|child| child.parent_span_id == Some(span.span_id))
                .map(|child| tree(child, spans))
                .collect();
            let server = span.service.labels.server_name.as_deref().unwrap_or("?");
            canonical(&span.name, server, children)
        }
        let ids: Vec<_> = spans.iter().map(|span| span.span_id).collect();
        let mut roots: Vec<String> = spans
            .iter()
            .filter(|span| {
                span.parent_span_id
                    .is_none_or(|parent| !ids.contains(&parent))
            })
            .map(|span| tree(span, spans))
            .collect();
        roots.sort();
        roots
    }

    /// Issue #48: real Gym traffic, fed to the core again, comes out as it did live: every
    /// rollout one trace holding exactly Gym's tree for one rollout, no span besides.
    #[test]
    fn real_gym_rollouts_replay_into_one_trace_each_of_gyms_tree() {
        let recording = Recording::parse(REAL_GYM).expect(
            "tracer-userspace/testdata/real_gym_rollouts.rec: record it again with \
             tests/support/real_gym/record.py",
        );
        let mut pipeline = Pipeline::new(recording.config.pipeline_config(), ());
        let mut spans = Vec::new();
        recording.feed(&mut pipeline, Instant::now(), &mut (), |output| {
            spans.append(&mut output.released)
        });
        let mut traces: BTreeMap<_, Vec<&SpanRecord>> = BTreeMap::new();
        for span in &spans {
            traces.entry(span.trace_id.0).or_default().push(span);
        }
        let mut rollouts = Vec::new();
        for spans in traces.values() {
            assert_eq!(trees(spans), vec![gym_rollout_tree()]);
            let ids: std::collections::BTreeSet<_> = spans
                .iter()
                .flat_map(|span| &span.attributes)
                .filter(|(key, _)| *key == GYM_ROLLOUT_ID)
                .map(|(_, value)| match value {
                    AttributeValue::Str(id) => id.to_string(),
                    other => panic!("{GYM_ROLLOUT_ID} = {other:?}"),
                })
                .collect();
            assert_eq!(ids.len(), 1, "one rollout per trace: {ids:?}");
            rollouts.extend(ids);
        }
        rollouts.sort();
        rollouts.dedup();
        assert_eq!(
            rollouts.len(),
            4,
            "four rollouts, four traces: {rollouts:?}"
        );
        assert_eq!(traces.len(), 4);
        assert_eq!(spans.len(), 4 * 20);
        // The insight stage read each rollout whole: its two model calls and one tool call.
        let int = |span: &SpanRecord, key: &str| {
            span.attributes.iter().find_map(|(k, v)| match v {
                AttributeValue::Int(n) if *k == key => Some(*n),
                _ => None,
            })
        };
        let rollout_spans: Vec<_> = spans.iter().filter(|s| s.name == "gym.rollout").collect();
        assert_eq!(rollout_spans.len(), 4);
        for span in rollout_spans {
            assert_eq!(int(span, GYM_ROLLOUT_MODEL_CALLS), Some(2), "{span:?}");
            assert_eq!(int(span, GYM_ROLLOUT_TOOL_CALLS), Some(1), "{span:?}");
        }
        let counters = pipeline.counters();
        assert_eq!(counters.pipeline.events_undecodable, 0);
        assert_eq!(counters.stitch.parents_no_evidence, 0);
    }

    /// Every kind of entry reads back as it was written, and a damaged file is refused with
    /// the reason.
    #[test]
    fn a_recording_reads_back_what_was_written() {
        let inputs = vec![
            Input::Attach {
                pid: 41,
                labels: GymLabels::example_server(ServerType::Agent),
            },
            Input::Attach {
                pid: 42,
                labels: GymLabels {
                    server_name: None,
                    server_kind: Some(ServerKind::Other("environment_servers".into())),
                    service_group: Some("gym".into()),
                },
            },
            Input::NamePeer {
                address: "127.0.0.1:8000".parse().unwrap(),
                name: "policy_model",
                server_type: Some(ServerType::Model),
            },
            Input::NamePeer {
                address: "[::1]:9000".parse().unwrap(),
                name: "other",
                server_type: None,
            },
            Input::Routes {
                root: 41,
                templates: vec!["/run", "/items/{id}"],
            },
            Input::OwnRequest {
                client_port: 50_123,
                server_port: 8000,
            },
            Input::Record(b"\x01\x02\x03"),
            Input::Release,
            Input::Deliver,
            Input::Forget { pid: 42 },
            Input::ReleaseAll,
        ];
        let path = std::env::temp_dir().join(format!("recording-{}", std::process::id()));
        let config = RecordedConfig {
            clock: WallClock::from_offset_ns(1_765_000_000_000_000_000),
            routes: vec!["/items/{id}".into()],
            service_name: Some("rl-job".into()),
            resource_attributes: vec![("deployment.environment".into(), "test".into())],
            groups: SpanGroups::ALL,
            injection: Some(Injection {
                every_call: true,
                mint_key: MintKey([3, u64::MAX]),
            }),
        };
        let mut recorder = Recorder::create(&path, config).unwrap();
        let start = recorder.started;
        for (i, input) in inputs.iter().enumerate() {
            assert!(recorder.write(input, start + Duration::from_millis(i as u64)));
        }
        recorder.flush();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let recording = Recording::parse(&bytes).unwrap();
        assert_eq!(recording.config.groups, SpanGroups::ALL);
        assert_eq!(recording.config.routes, ["/items/{id}"]);
        assert_eq!(recording.config.service_name.as_deref(), Some("rl-job"));
        assert_eq!(
            recording.config.resource_attributes,
            [("deployment.environment".to_string(), "test".to_string())]
        );
        assert_eq!(
            recording.config.clock.offset_ns(),
            1_765_000_000_000_000_000
        );
        let injection = recording.config.injection.unwrap();
        assert!(injection.every_call);
        assert_eq!(injection.mint_key.0, [3, u64::MAX]);
        let read: Vec<_> = recording.entries.iter().map(|(_, i)| i.clone()).collect();
        assert_eq!(read, inputs);
        let offsets: Vec<_> = recording.entries.iter().map(|(at, _)| *at).collect();
        assert_eq!(offsets[3], Duration::from_millis(3));

        assert_eq!(
            Recording::parse(b"GET / HTTP/1.1\r\n\r\n").err(),
            Some(RecordingError::NotARecording)
        );
        let mut other = bytes.clone();
        other[MAGIC.len()] ^= 1;
        assert_eq!(
            Recording::parse(&other).err(),
            Some(RecordingError::OtherLayout)
        );
        assert_eq!(
            Recording::parse(&bytes[..bytes.len() - 1]).err(),
            Some(RecordingError::Truncated)
        );
    }
}
