//! The collector's transports: the gRPC (tonic) and HTTP (reqwest) clients the SDK's
//! exporters send over, with the `--otlp-*` headers, compression and TLS files applied the
//! same way to the span and the metric exporter.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig, WithTonicConfig};

use super::Signal;
use super::environment::check_sdk_environment;
use super::failure::{error_chain, failure_hint};
use super::http_spans::HttpSpanPoster;
use super::options::{
    HeaderList, OtlpCompression, OtlpEndpoint, OtlpOptions, OtlpProtocol, printable_endpoint,
};

/// The `--otlp-*` options made ready for the SDK's exporter builders: headers validated, the
/// certificate files read and checked. The span and the metric exporter are both configured
/// by [`OtlpTransport::grpc`] or [`OtlpTransport::http`], so the two cannot drift.
struct OtlpTransport {
    endpoint: OtlpEndpoint,
    timeout: Duration,
    compression: Option<opentelemetry_otlp::Compression>,
    headers: http::HeaderMap,
    /// PEM bundle of the CAs that replace the system roots.
    ca_pem: Option<Vec<u8>>,
    /// PEM client certificate and key.
    identity_pem: Option<(Vec<u8>, Vec<u8>)>,
}

/// Everything [`OtlpTransport::load`] checks before an exporter is built (`check-config`
/// and `run` call this before loading anything into the kernel).
pub fn check_otlp_options(options: &OtlpOptions) -> Result<()> {
    OtlpTransport::load(options).map(drop)
}

impl OtlpTransport {
    fn load(options: &OtlpOptions) -> Result<Self> {
        install_crypto_provider();
        let headers = header_map(&options.headers)?;
        check_sdk_environment(options.signal, &headers, options.compression, |name| {
            std::env::var(name).ok()
        })?;
        let ca_pem = options
            .ca_file
            .as_deref()
            .map(|path| read_pem("--otlp-ca-file", path, PemContent::Certificates))
            .transpose()?;
        let identity_pem = options
            .client_identity
            .as_ref()
            .map(|(cert, key)| {
                Ok::<_, anyhow::Error>((
                    read_pem("--otlp-client-cert", cert, PemContent::Certificates)?,
                    read_pem("--otlp-client-key", key, PemContent::PrivateKey)?,
                ))
            })
            .transpose()?;
        Ok(Self {
            endpoint: options.endpoint.clone(),
            timeout: options.timeout,
            compression: match options.compression {
                OtlpCompression::None => None,
                OtlpCompression::Gzip => Some(opentelemetry_otlp::Compression::Gzip),
            },
            headers,
            ca_pem,
            identity_pem,
        })
    }

    fn is_https(&self) -> bool {
        self.endpoint.url().starts_with("https://")
    }

    fn grpc<B: WithExportConfig + WithTonicConfig>(&self, builder: B) -> B {
        use opentelemetry_otlp::tonic_types::metadata::MetadataMap;
        use opentelemetry_otlp::tonic_types::transport::{Certificate, ClientTlsConfig, Identity};
        let mut builder = builder
            .with_endpoint(self.endpoint.url())
            .with_protocol(Protocol::Grpc)
            .with_timeout(self.timeout)
            .with_metadata(MetadataMap::from_headers(self.headers.clone()));
        if let Some(compression) = self.compression {
            builder = builder.with_compression(compression);
        }
        if self.is_https() {
            // tonic trusts no roots unless told to.
            let tls = match &self.ca_pem {
                Some(pem) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)),
                None => ClientTlsConfig::new().with_native_roots(),
            };
            builder = builder.with_tls_config(match &self.identity_pem {
                Some((cert, key)) => tls.identity(Identity::from_pem(cert, key)),
                None => tls,
            });
        }
        builder
    }

    fn http<B: WithExportConfig + WithHttpConfig>(&self, builder: B, signal: Signal) -> Result<B> {
        let mut builder = builder
            .with_endpoint(self.endpoint.http_url(signal))
            .with_protocol(Protocol::HttpBinary)
            .with_timeout(self.timeout)
            .with_headers(http_builder_headers(&self.headers))
            .with_http_client(self.http_client()?);
        if let Some(compression) = self.compression {
            builder = builder.with_compression(compression);
        }
        Ok(builder)
    }

    /// The reqwest client for OTLP/HTTP, with the TLS files applied.
    fn http_client(&self) -> Result<ExplainedHttpClient> {
        let mut client = reqwest::Client::builder().timeout(self.timeout);
        if let Some(pem) = &self.ca_pem {
            let roots = reqwest::Certificate::from_pem_bundle(pem)
                .context("--otlp-ca-file: the certificates do not parse")?;
            client = client.tls_certs_only(roots);
        }
        if let Some((cert, key)) = &self.identity_pem {
            let identity = reqwest::Identity::from_pem(&[cert.as_slice(), b"\n", key].concat())
                .context("--otlp-client-cert / --otlp-client-key do not parse as a PEM identity")?;
            client = client.identity(identity);
        }
        Ok(ExplainedHttpClient {
            client: client.build().context("building the HTTP client")?,
            failing: AtomicBool::new(false),
        })
    }
}

/// The reqwest client for the collector, logging why a request failed: the SDK reports every
/// transport failure as "network error" (the cause goes to its debug log), which hides, say,
/// a collector certificate that is not trusted. Logged once per run of failures.
#[derive(Debug)]
pub(super) struct ExplainedHttpClient {
    client: reqwest::Client,
    failing: AtomicBool,
}

impl opentelemetry_http::HttpClient for ExplainedHttpClient {
    fn send_bytes<'life0, 'async_trait>(
        &'life0 self,
        request: http::Request<opentelemetry_http::Bytes>,
    ) -> Pin<Box<dyn Future<Output = HttpResult> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(async move {
            let result = self.client.send_bytes(request).await;
            match &result {
                Ok(_) => self.failing.store(false, Ordering::Relaxed),
                Err(error) if !self.failing.swap(true, Ordering::Relaxed) => {
                    let cause = error_chain(error.as_ref());
                    tracing::warn!("OTLP/HTTP export: {cause}{}", failure_hint(&cause));
                }
                Err(_) => {}
            }
            result
        })
    }
}

type HttpResult = Result<http::Response<opentelemetry_http::Bytes>, opentelemetry_http::HttpError>;

/// reqwest is built with `rustls-no-provider` (aws-lc-rs is slow to build and needs cmake), so
/// rustls needs a process-wide provider before the first client is built; tonic uses it too.
fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Err only when another thread installed one first, which serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// Headers for the HTTP builder, which percent-decodes every value it is given (the gRPC one
/// does not): `%` is escaped so that the decoded values arrive as they are.
fn http_builder_headers(headers: &http::HeaderMap) -> HashMap<String, String> {
    headers
        .iter()
        .filter_map(|(name, value)| {
            Some((name.to_string(), value.to_str().ok()?.replace('%', "%25")))
        })
        .collect()
}

/// `--otlp-headers` as HTTP headers; a later duplicate replaces an earlier one. Errors name
/// the header, never its value (it is usually a credential).
pub(super) fn header_map(headers: &HeaderList) -> Result<http::HeaderMap> {
    let mut map = http::HeaderMap::new();
    for (key, value) in &headers.0 {
        let name = http::HeaderName::from_bytes(key.as_bytes()).map_err(|_| {
            anyhow::anyhow!("--otlp-headers: `{key}` is not a valid HTTP header name")
        })?;
        // The HTTP builder passes on only values that are printable ASCII.
        let value = http::HeaderValue::from_str(value)
            .ok()
            .filter(|value| value.to_str().is_ok())
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "--otlp-headers: the value of `{key}` must be printable ASCII (a header \
                     cannot carry anything else); fix the value"
                )
            })?;
        map.insert(name, value);
    }
    Ok(map)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PemContent {
    Certificates,
    PrivateKey,
}

/// Reads `path` (given as `flag`) and checks it holds `content`: the TLS libraries skip PEM
/// sections they cannot use, which would turn a wrong file into a failed handshake later.
fn read_pem(flag: &str, path: &std::path::Path, content: PemContent) -> Result<Vec<u8>> {
    let pem = std::fs::read(path)
        .with_context(|| format!("{flag} {}: cannot be read", path.display()))?;
    check_pem(&pem, content).map_err(|why| anyhow::anyhow!("{flag} {}: {why}", path.display()))?;
    Ok(pem)
}

fn check_pem(pem: &[u8], content: PemContent) -> Result<(), String> {
    use rustls_pki_types::pem::{Error, PemObject};
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let found = match content {
        PemContent::Certificates => CertificateDer::pem_slice_iter(pem)
            .collect::<Result<Vec<_>, _>>()
            .map(|certs| !certs.is_empty()),
        PemContent::PrivateKey => match PrivateKeyDer::from_pem_slice(pem) {
            Ok(_) => Ok(true),
            Err(Error::NoItemsFound) => Ok(false),
            Err(error) => Err(error),
        },
    }
    .map_err(|error| format!("not valid PEM ({error}); is the file truncated?"))?;
    match (found, content) {
        (true, _) => Ok(()),
        (false, PemContent::Certificates) => Err("no PEM certificate in it: it must hold \
             `-----BEGIN CERTIFICATE-----` blocks (convert a DER file with \
             `openssl x509 -inform der -in FILE -out FILE.pem`)"
            .into()),
        (false, PemContent::PrivateKey) => Err("no unencrypted PEM private key in it: it must \
             hold a `-----BEGIN PRIVATE KEY-----` (or RSA / EC PRIVATE KEY) block; decrypt an \
             encrypted key with `openssl pkey -in KEY -out KEY.pem`"
            .into()),
    }
}

/// The SDK's span and metric exporter builders are different types with the same methods
/// (and no trait for `with_tonic`, `with_http`, `build`): this builds either one from an
/// [`OtlpTransport`], over the protocol `options` name.
macro_rules! build_otlp_exporter {
    ($exporter:ident, $signal:expr, $options:expr, $retry:expr) => {{
        use opentelemetry_otlp::$exporter;
        let options: &OtlpOptions = $options;
        let transport = OtlpTransport::load(options)?;
        let exporter = match options.protocol {
            OtlpProtocol::Grpc => transport
                .grpc($exporter::builder().with_tonic().with_retry_policy($retry))
                .build(),
            OtlpProtocol::HttpProtobuf => transport
                .http(
                    $exporter::builder().with_http().with_retry_policy($retry),
                    $signal,
                )
                .map_err(|error| build_error(&error, $signal, options.endpoint.url()))?
                .build(),
        };
        exporter.map_err(|error| build_error(&error.into(), $signal, options.endpoint.url()))
    }};
}

/// The SDK's span exporter, without its retries (see [`otlp_span_transport`]).
pub fn otlp_span_exporter(options: &OtlpOptions) -> Result<opentelemetry_otlp::SpanExporter> {
    build_otlp_exporter!(
        SpanExporter,
        Signal::Traces,
        options,
        opentelemetry_otlp::RetryPolicy::disabled()
    )
}

/// Where spans go: over gRPC the SDK's exporter; over OTLP/HTTP a request encoded from the
/// records and posted over the client the metric exporter is built with.
pub enum SpanTransport {
    Grpc(opentelemetry_otlp::SpanExporter),
    Http(HttpSpanPoster),
}

/// One attempt per export: the span pipeline retries itself, with a buffer and backoff
/// that outlast an outage (the SDK's retries give up within the export timeout).
pub fn otlp_span_transport(options: &OtlpOptions) -> Result<SpanTransport> {
    match options.protocol {
        OtlpProtocol::Grpc => otlp_span_exporter(options).map(SpanTransport::Grpc),
        OtlpProtocol::HttpProtobuf => {
            let build = || -> Result<HttpSpanPoster> {
                let transport = OtlpTransport::load(options)?;
                let url = transport.endpoint.http_url(Signal::Traces);
                let url = url
                    .parse::<http::Uri>()
                    .with_context(|| format!("the endpoint `{url}` is not a valid URL"))?;
                Ok(HttpSpanPoster::new(
                    transport.http_client()?,
                    url,
                    transport.headers.clone(),
                    transport.compression.is_some(),
                ))
            };
            build()
                .map(SpanTransport::Http)
                .map_err(|error| build_error(&error, Signal::Traces, options.endpoint.url()))
        }
    }
}

/// The SDK's recommended retries, within the export timeout: metrics are cumulative, so an
/// export that fails loses nothing the next one does not carry.
pub fn otlp_metric_exporter(options: &OtlpOptions) -> Result<opentelemetry_otlp::MetricExporter> {
    build_otlp_exporter!(
        MetricExporter,
        Signal::Metrics,
        options,
        opentelemetry_otlp::RetryPolicy::recommended()
    )
}

/// An exporter that could not be built, with what to check.
fn build_error(error: &anyhow::Error, signal: Signal, endpoint: &str) -> anyhow::Error {
    let text = format!("{error:#}");
    anyhow::anyhow!(
        "creating the OTLP {} exporter for {}: {text}{}",
        signal.name(),
        printable_endpoint(endpoint),
        failure_hint(&text)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_endpoints_get_signal_paths_unless_given_per_signal() {
        let base = |url: &str| OtlpEndpoint::Base(url.into());
        assert_eq!(
            base("http://c:4318/").http_url(Signal::Traces),
            "http://c:4318/v1/traces"
        );
        assert_eq!(
            base("http://c:4318").http_url(Signal::Metrics),
            "http://c:4318/v1/metrics"
        );
        let exact = OtlpEndpoint::Signal("http://p:6006/v1/traces".into());
        assert_eq!(exact.http_url(Signal::Traces), "http://p:6006/v1/traces");
        assert_eq!(exact.url(), "http://p:6006/v1/traces");
    }
    const CERT_PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
    const KEY_PEM: &str = "-----BEGIN PRIVATE KEY-----\nMIIB\n-----END PRIVATE KEY-----\n";

    fn headers(list: &str) -> http::HeaderMap {
        header_map(&list.parse::<HeaderList>().unwrap()).unwrap()
    }

    fn otlp_options(endpoint: &str, protocol: OtlpProtocol) -> OtlpOptions {
        OtlpOptions {
            signal: Signal::Traces,
            endpoint: OtlpEndpoint::Base(endpoint.into()),
            protocol,
            headers: "authorization=Bearer%20x".parse().unwrap(),
            timeout: Duration::from_secs(2),
            compression: OtlpCompression::Gzip,
            ca_file: None,
            client_identity: None,
        }
    }

    #[test]
    fn pem_files_are_checked_for_what_they_must_hold() {
        assert_eq!(
            check_pem(CERT_PEM.as_bytes(), PemContent::Certificates),
            Ok(())
        );
        assert_eq!(
            check_pem(KEY_PEM.as_bytes(), PemContent::PrivateKey),
            Ok(())
        );
        let no_cert = check_pem(KEY_PEM.as_bytes(), PemContent::Certificates).unwrap_err();
        assert!(no_cert.starts_with("no PEM certificate in it"), "{no_cert}");
        let not_pem = check_pem(b"hello\n", PemContent::Certificates).unwrap_err();
        assert!(not_pem.starts_with("no PEM certificate in it"), "{not_pem}");
        let encrypted =
            "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY-----\n";
        let no_key = check_pem(encrypted.as_bytes(), PemContent::PrivateKey).unwrap_err();
        assert!(no_key.contains("openssl pkey"), "{no_key}");
        let truncated = "-----BEGIN CERTIFICATE-----\nMIIB\n";
        let broken = check_pem(truncated.as_bytes(), PemContent::Certificates).unwrap_err();
        assert!(broken.starts_with("not valid PEM"), "{broken}");
    }

    #[test]
    fn read_pem_names_the_flag_and_the_file() {
        let path = std::env::temp_dir().join(format!("gym-tracer-test-{}.pem", std::process::id()));
        std::fs::write(&path, KEY_PEM).unwrap();
        let error = read_pem("--otlp-ca-file", &path, PemContent::Certificates).unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            error.to_string().split(": no PEM").next().unwrap(),
            format!("--otlp-ca-file {}", path.display())
        );
    }

    #[test]
    fn header_errors_name_the_header_never_the_value() {
        let list = HeaderList(vec![("authorization".into(), "Bearer \u{e9}secret".into())]);
        let error = header_map(&list).unwrap_err().to_string();
        assert!(error.contains("`authorization`"), "{error}");
        assert!(!error.contains("secret"), "{error}");
        let map = headers("Authorization=a,x-tenant=t,x-tenant=u");
        assert_eq!(map.get("authorization").unwrap(), "a");
        assert_eq!(map.get_all("x-tenant").iter().collect::<Vec<_>>(), ["u"]);
    }

    #[test]
    fn http_builder_headers_survive_its_percent_decoding() {
        let map = headers("authorization=Bearer%20x,discount=50%2525");
        let given = http_builder_headers(&map);
        assert_eq!(given["authorization"], "Bearer x");
        // The builder decodes %25 back to %, so it sends `50%25` as given.
        assert_eq!(given["discount"], "50%2525");
    }

    /// Gzip, headers and TLS need cargo features of opentelemetry-otlp; a missing one only
    /// shows when the exporter is built.
    #[tokio::test]
    async fn exporters_build_for_every_protocol_with_gzip_headers_and_tls() {
        for endpoint in ["http://127.0.0.1:1", "https://127.0.0.1:1"] {
            for protocol in [OtlpProtocol::Grpc, OtlpProtocol::HttpProtobuf] {
                let options = otlp_options(endpoint, protocol);
                otlp_span_exporter(&options).unwrap();
                otlp_span_transport(&options).unwrap();
                otlp_metric_exporter(&options).unwrap();
            }
        }
    }
}
