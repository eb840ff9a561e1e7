//! OpenInference span kinds (`openinference.span.kind`), which LLM-trace UIs such as Arize
//! Phoenix read to show a span as an agent, a model call, a tool or an evaluator (a span
//! without one is shown as UNKNOWN). Set only where Gym's meaning decides the kind:
//!
//! | span | kind |
//! | --- | --- |
//! | `gym.rollout`, `gym.agent.*`; a CLIENT span calling a Gym agent server's model API | AGENT |
//! | `gym.model.*`; a CLIENT span of a model API call (`gen_ai.operation.name` set) to anything else | LLM |
//! | `gym.verify` | EVALUATOR |
//! | the SERVER span of a tool route of a resources server | TOOL |
//!
//! A model call also gets OpenInference's `llm.model_name` and `llm.token_count.*`, from the
//! same fields as its `gen_ai.*` attributes, so the UI shows the model and the tokens; a
//! tool call gets `tool.name`, its route without the slash. Everything else (SERVER and
//! CLIENT spans of plain HTTP) has no kind: the evidence says no more than HTTP.

use crate::gym::span_groups::SpanGroup;
use crate::model::attributes as attr;
use crate::model::exchange::ModelCall;
use crate::model::span::{AttributeValue, Attributes};

/// The kinds this tracer can decide, of OpenInference's (CHAIN, RETRIEVER, EMBEDDING, ...
/// need what the bodies say, which is never read).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenInferenceKind {
    Agent,
    Llm,
    Tool,
    Evaluator,
}

impl OpenInferenceKind {
    pub fn as_str(self) -> &'static str {
        match self {
            OpenInferenceKind::Agent => "AGENT",
            OpenInferenceKind::Llm => "LLM",
            OpenInferenceKind::Tool => "TOOL",
            OpenInferenceKind::Evaluator => "EVALUATOR",
        }
    }

    /// The kind of a `gym.*` span, by the group that gates it.
    pub fn of_group(group: SpanGroup) -> Option<OpenInferenceKind> {
        match group {
            SpanGroup::Rollout | SpanGroup::Agent => Some(OpenInferenceKind::Agent),
            SpanGroup::ModelCall => Some(OpenInferenceKind::Llm),
            SpanGroup::Verify => Some(OpenInferenceKind::Evaluator),
            SpanGroup::Server | SpanGroup::HttpClient | SpanGroup::Job | SpanGroup::Sandbox => None,
        }
    }

    pub fn attribute(self) -> (&'static str, AttributeValue) {
        (
            attr::OPENINFERENCE_SPAN_KIND,
            AttributeValue::Str(self.as_str().into()),
        )
    }
}

/// The kind and `tool.name` of a tool call's SERVER span.
pub fn tool_attributes(route: &str, attributes: &mut Attributes) {
    attributes.push(OpenInferenceKind::Tool.attribute());
    attributes.push((
        attr::TOOL_NAME,
        AttributeValue::Str(route.trim_start_matches('/').to_owned().into()),
    ));
}

/// The kind, model and token counts of a model API call's CLIENT span.
pub fn llm_attributes(call: &ModelCall, attributes: &mut Attributes) {
    attributes.push(OpenInferenceKind::Llm.attribute());
    if let Some(model) = call.response_model.as_ref().or(call.request_model.as_ref()) {
        attributes.push((
            attr::LLM_MODEL_NAME,
            AttributeValue::Str(model.clone().into()),
        ));
    }
    let count = |tokens: u64| AttributeValue::Int(i64::try_from(tokens).unwrap_or(i64::MAX));
    let usage = &call.usage;
    if let Some(tokens) = usage.input_tokens {
        attributes.push((attr::LLM_TOKEN_COUNT_PROMPT, count(tokens)));
    }
    if let Some(tokens) = usage.output_tokens {
        attributes.push((attr::LLM_TOKEN_COUNT_COMPLETION, count(tokens)));
    }
    if let (Some(input), Some(output)) = (usage.input_tokens, usage.output_tokens) {
        attributes.push((
            attr::LLM_TOKEN_COUNT_TOTAL,
            count(input.saturating_add(output)),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::genai::{GenAiOperation, TokenUsage};

    fn value<'a>(attributes: &'a Attributes, key: &str) -> Option<&'a AttributeValue> {
        attributes.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    #[test]
    fn gym_spans_get_the_kind_their_group_decides() {
        let kind = |group| OpenInferenceKind::of_group(group).map(OpenInferenceKind::as_str);
        assert_eq!(kind(SpanGroup::Rollout), Some("AGENT"));
        assert_eq!(kind(SpanGroup::Agent), Some("AGENT"));
        assert_eq!(kind(SpanGroup::ModelCall), Some("LLM"));
        assert_eq!(kind(SpanGroup::Verify), Some("EVALUATOR"));
        assert_eq!(kind(SpanGroup::Server), None);
        assert_eq!(kind(SpanGroup::HttpClient), None);
    }

    #[test]
    fn a_model_call_names_its_model_and_tokens_and_totals_only_what_it_has() {
        let mut call = ModelCall::new(GenAiOperation::Responses);
        call.request_model = Some("asked".into());
        call.response_model = Some("answered".into());
        call.usage = TokenUsage {
            input_tokens: Some(1007),
            output_tokens: Some(2013),
        };
        let mut attributes = Attributes::new();
        llm_attributes(&call, &mut attributes);
        let str_of = |key| match value(&attributes, key) {
            Some(AttributeValue::Str(text)) => text.clone(),
            other => panic!("{key}: {other:?}"),
        };
        assert_eq!(str_of(attr::OPENINFERENCE_SPAN_KIND), "LLM");
        assert_eq!(str_of(attr::LLM_MODEL_NAME), "answered");
        assert_eq!(
            value(&attributes, attr::LLM_TOKEN_COUNT_TOTAL),
            Some(&AttributeValue::Int(3020))
        );
        call.usage.output_tokens = None;
        call.response_model = None;
        let mut cut = Attributes::new();
        llm_attributes(&call, &mut cut);
        assert_eq!(
            value(&cut, attr::LLM_MODEL_NAME),
            Some(&AttributeValue::Str("asked".into()))
        );
        assert_eq!(
            value(&cut, attr::LLM_TOKEN_COUNT_TOTAL),
            None,
            "no guessed total"
        );
    }
}
