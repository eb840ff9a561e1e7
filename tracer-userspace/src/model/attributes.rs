//! Attribute keys, spelled once: the OpenTelemetry semantic conventions (HTTP, URL, service,
//! process, host) and Gym's own `nemo.gym.*` keys as Gym's telemetry writes them.

// Resource.
pub const SERVICE_NAME: &str = "service.name";
pub const SERVICE_VERSION: &str = "service.version";
pub const SERVICE_INSTANCE_ID: &str = "service.instance.id";
pub const HOST_NAME: &str = "host.name";
pub const PROCESS_PID: &str = "process.pid";
pub const PROCESS_PARENT_PID: &str = "process.parent_pid";
pub const PROCESS_EXECUTABLE_PATH: &str = "process.executable.path";
pub const PROCESS_EXECUTABLE_NAME: &str = "process.executable.name";
pub const TELEMETRY_DISTRO_NAME: &str = "telemetry.distro.name";
pub const TELEMETRY_DISTRO_VERSION: &str = "telemetry.distro.version";

// HTTP spans and metrics.
/// The methods HTTP's semantic conventions register (`http.request.method`).
pub const REGISTERED_METHODS: [&str; 9] = [
    "GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "CONNECT", "TRACE",
];

/// `method` as a `'static` string when it is one of [`REGISTERED_METHODS`].
pub fn registered_method(method: &str) -> Option<&'static str> {
    REGISTERED_METHODS
        .into_iter()
        .find(|known| *known == method)
}
pub const HTTP_REQUEST_METHOD: &str = "http.request.method";
pub const HTTP_RESPONSE_STATUS_CODE: &str = "http.response.status_code";
pub const HTTP_ROUTE: &str = "http.route";
pub const URL_PATH: &str = "url.path";
pub const URL_SCHEME: &str = "url.scheme";
pub const URL_FULL: &str = "url.full";
pub const SERVER_ADDRESS: &str = "server.address";
pub const SERVER_PORT: &str = "server.port";
pub const CLIENT_ADDRESS: &str = "client.address";
pub const NETWORK_PROTOCOL_VERSION: &str = "network.protocol.version";
pub const NETWORK_PEER_PORT: &str = "network.peer.port";
pub const USER_AGENT_ORIGINAL: &str = "user_agent.original";
pub const ERROR_TYPE: &str = "error.type";
pub const PEER_SERVICE: &str = "peer.service";
pub const NETWORK_TRANSPORT: &str = "network.transport";
pub const TLS_PROTOCOL_NAME: &str = "tls.protocol.name";
/// Bytes of TLS records a connection whose requests could not be read sent and received (the
/// semantic conventions have no span attribute for them).
pub const GYM_TRACER_BYTES_SENT: &str = "gym_tracer.connection.bytes_sent";
pub const GYM_TRACER_BYTES_RECEIVED: &str = "gym_tracer.connection.bytes_received";
/// On a span of a streamed answer (server-sent events): seconds from the request's first
/// byte to the stream's first data, as this end of the connection saw them.
pub const GYM_TRACER_TIME_TO_FIRST_EVENT: &str = "gym_tracer.response.time_to_first_event";
/// On a SERVER span whose caller, a Gym server on another host, could not be joined to it.
pub const GYM_TRACER_PARENT_UNJOINED: &str = "gym_tracer.parent.unjoined";

// GenAI client spans and metrics (OpenTelemetry GenAI semantic conventions).
pub const GEN_AI_OPERATION_NAME: &str = "gen_ai.operation.name";
pub const GEN_AI_PROVIDER_NAME: &str = "gen_ai.provider.name";
pub const GEN_AI_REQUEST_MODEL: &str = "gen_ai.request.model";
pub const GEN_AI_RESPONSE_MODEL: &str = "gen_ai.response.model";
pub const GEN_AI_USAGE_INPUT_TOKENS: &str = "gen_ai.usage.input_tokens";
pub const GEN_AI_USAGE_OUTPUT_TOKENS: &str = "gen_ai.usage.output_tokens";
/// Seconds from a streamed call's request to its first chunk.
pub const GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK: &str = "gen_ai.response.time_to_first_chunk";
pub const GEN_AI_TOKEN_TYPE: &str = "gen_ai.token.type";

// OpenInference (Arize Phoenix and other LLM-trace UIs read these).
pub const OPENINFERENCE_SPAN_KIND: &str = "openinference.span.kind";
pub const LLM_MODEL_NAME: &str = "llm.model_name";
pub const LLM_TOKEN_COUNT_PROMPT: &str = "llm.token_count.prompt";
pub const LLM_TOKEN_COUNT_COMPLETION: &str = "llm.token_count.completion";
pub const LLM_TOKEN_COUNT_TOTAL: &str = "llm.token_count.total";
pub const TOOL_NAME: &str = "tool.name";

// Gym (`nemo_gym` / nemo-lens).
pub const GYM_ROLLOUT_ID: &str = "nemo.gym.rollout.id";
/// What the insight stage adds to a `gym.rollout` span (besides its phases).
pub const GYM_ROLLOUT_MODEL_CALLS: &str = "gym.rollout.model_calls";
pub const GYM_ROLLOUT_TOOL_CALLS: &str = "gym.rollout.tool_calls";
pub const GYM_ROLLOUT_STRAGGLER: &str = "gym.rollout.straggler";
pub const GYM_SERVER_NAME: &str = "nemo.gym.server.name";
pub const GYM_SERVER_TYPE: &str = "nemo.gym.server.type";
pub const GYM_SERVICE_GROUP: &str = "nemo.gym.service_group";
/// Keys under this prefix are Gym's: the agent's `--resource-attributes` cannot override them.
pub const GYM_PREFIX: &str = "nemo.gym.";
