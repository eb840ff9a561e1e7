//! Span exports over OTLP/HTTP without the SDK's span exporter: the request is encoded from
//! the records ([`super::encode`]) and posted over the same client, headers and compression
//! the metric exporter uses. Errors read as the SDK's do, so that
//! [`classify`](super::retry::classify) and the logs treat both protocols alike.

use std::io::Write;

use opentelemetry_http::{Bytes, HttpClient};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse;
use prost::Message;

use super::encode::encode_trace_request;
use super::transport::ExplainedHttpClient;
use crate::model::service::ServiceIdentity;
use crate::model::span::SpanRecord;

/// A request body that is ready to be posted.
pub struct EncodedSpans(Bytes);

/// What the collector said to a request it took.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Accepted {
    /// Spans the collector said it rejected (OTLP partial success).
    pub rejected: u64,
    /// Its reason, if it gave one.
    pub message: String,
}

pub struct HttpSpanPoster {
    client: ExplainedHttpClient,
    url: http::Uri,
    headers: http::HeaderMap,
    gzip: bool,
    /// The last body's size: the next one is likely similar, so it starts at that capacity.
    last_len: usize,
}

impl HttpSpanPoster {
    pub(super) fn new(
        client: ExplainedHttpClient,
        url: http::Uri,
        headers: http::HeaderMap,
        gzip: bool,
    ) -> Self {
        Self {
            client,
            url,
            headers,
            gzip,
            last_len: 0,
        }
    }

    /// The body for `spans` of one process.
    pub fn encode(&mut self, service: &ServiceIdentity, spans: &[SpanRecord]) -> EncodedSpans {
        let mut body = Vec::with_capacity(self.last_len);
        encode_trace_request(&service.resource, spans, &mut body);
        self.last_len = body.len();
        if self.gzip {
            let mut encoder = flate2::write::GzEncoder::new(
                Vec::with_capacity(body.len() / 4),
                flate2::Compression::default(),
            );
            encoder.write_all(&body).expect("writing to a Vec");
            body = encoder.finish().expect("writing to a Vec");
        }
        EncodedSpans(Bytes::from(body))
    }

    /// One attempt. On failure, the error is worded as the SDK's HTTP exporter words it
    /// (`... status code: 503`; a transport failure's cause is logged by the client).
    pub async fn post(&self, body: EncodedSpans) -> Result<Accepted, String> {
        let mut request = http::Request::builder()
            .method(http::Method::POST)
            .uri(self.url.clone())
            .header(http::header::CONTENT_TYPE, "application/x-protobuf");
        if self.gzip {
            request = request.header(http::header::CONTENT_ENCODING, "gzip");
        }
        let mut request = request
            .body(body.0)
            .map_err(|error| format!("HTTP export failed: building the request: {error}"))?;
        for (name, value) in &self.headers {
            request.headers_mut().insert(name, value.clone());
        }
        let response = self
            .client
            .send_bytes(request)
            .await
            .map_err(|_| "HTTP export failed: network error".to_string())?;
        if !response.status().is_success() {
            return Err(format!(
                "HTTP export failed with status code: {}",
                response.status().as_u16()
            ));
        }
        Ok(accepted(response.body()))
    }
}

/// The partial success in a 2xx answer; a body that is not an `ExportTraceServiceResponse`
/// (empty, or not protobuf) took everything.
fn accepted(body: &[u8]) -> Accepted {
    let partial = ExportTraceServiceResponse::decode(body)
        .ok()
        .and_then(|response| response.partial_success);
    match partial {
        Some(partial) => Accepted {
            rejected: u64::try_from(partial.rejected_spans).unwrap_or(0),
            message: partial.error_message,
        },
        None => Accepted::default(),
    }
}

#[cfg(test)]
mod tests {
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTracePartialSuccess;

    use super::*;

    #[test]
    fn a_partial_success_is_read_and_anything_else_took_everything() {
        let answer = ExportTraceServiceResponse {
            partial_success: Some(ExportTracePartialSuccess {
                rejected_spans: 3,
                error_message: "too old".into(),
            }),
        };
        assert_eq!(
            accepted(&answer.encode_to_vec()),
            Accepted {
                rejected: 3,
                message: "too old".into()
            }
        );
        assert_eq!(accepted(b""), Accepted::default());
        assert_eq!(accepted(b"{\"partialSuccess\":{}}"), Accepted::default());
        let negative = ExportTraceServiceResponse {
            partial_success: Some(ExportTracePartialSuccess {
                rejected_spans: -1,
                error_message: String::new(),
            }),
        };
        assert_eq!(accepted(&negative.encode_to_vec()).rejected, 0);
    }
}
