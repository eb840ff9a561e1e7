//! How to reach the collector: the `--otlp-*` option types, parsed by clap and the config
//! file and read by the exporters. They live with the exporter so that it needs neither the
//! CLI nor the config; those two build an [`OtlpOptions`] from these types.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use super::Signal;

/// OTLP transport, as `OTEL_EXPORTER_OTLP_PROTOCOL` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OtlpProtocol {
    #[value(name = "grpc")]
    Grpc,
    #[value(name = "http/protobuf")]
    HttpProtobuf,
}

/// Compression of OTLP export requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OtlpCompression {
    None,
    Gzip,
}

/// Where one signal's exports go. OpenTelemetry's configuration treats the two variables
/// differently: `OTEL_EXPORTER_OTLP_ENDPOINT` is a base to which OTLP/HTTP appends
/// `/v1/traces` or `/v1/metrics`, while `OTEL_EXPORTER_OTLP_{TRACES,METRICS}_ENDPOINT` is
/// the full URL, used as it is. gRPC uses either as it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OtlpEndpoint {
    Base(String),
    Signal(String),
}

impl OtlpEndpoint {
    /// The URL as configured.
    pub fn url(&self) -> &str {
        match self {
            Self::Base(url) | Self::Signal(url) => url,
        }
    }

    /// The URL an OTLP/HTTP export of `signal` is posted to.
    pub fn http_url(&self, signal: Signal) -> String {
        match self {
            Self::Base(url) => format!("{}/v1/{}", url.trim_end_matches('/'), signal.name()),
            Self::Signal(url) => url.clone(),
        }
    }
}

/// Everything about reaching the collector with one signal, from the `--otlp-*` options and
/// their per-signal forms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OtlpOptions {
    /// The signal these options are for: they may differ per signal.
    pub signal: Signal,
    pub endpoint: OtlpEndpoint,
    pub protocol: OtlpProtocol,
    /// Sent with every export; printing this type masks the values.
    pub headers: HeaderList,
    pub timeout: Duration,
    pub compression: OtlpCompression,
    /// CA bundle to verify the collector with (else the system roots, for https://).
    pub ca_file: Option<PathBuf>,
    /// Client certificate and key for mutual TLS.
    pub client_identity: Option<(PathBuf, PathBuf)>,
}

/// `key=value,key2=value2`, as OTEL_EXPORTER_OTLP_HEADERS and OTEL_RESOURCE_ATTRIBUTES
/// write them (values percent-decoded).
#[derive(Clone, PartialEq, Eq)]
pub struct KeyValueList(pub Vec<(String, String)>);

impl FromStr for KeyValueList {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let mut pairs = Vec::new();
        for item in text
            .split(',')
            .map(str::trim)
            .filter(|item| !item.is_empty())
        {
            let Some((key, value)) = item.split_once('=') else {
                return Err(format!(
                    "`{}` is not key=value (the list is key=value,key2=value2)",
                    item.split_once('=').map_or(item, |(key, _)| key)
                ));
            };
            let key = key.trim();
            if key.is_empty() {
                return Err("an entry has an empty key".into());
            }
            pairs.push((key.to_owned(), percent_decode(value.trim())?));
        }
        Ok(Self(pairs))
    }
}

impl fmt::Debug for KeyValueList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for KeyValueList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, (key, value)) in self.0.iter().enumerate() {
            let separator = if index == 0 { "" } else { "," };
            write!(f, "{separator}{key}={value}")?;
        }
        Ok(())
    }
}

fn percent_decode(text: &str) -> Result<String, String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        if bytes[index] == b'%' {
            let hex = bytes
                .get(index + 1..index + 3)
                .and_then(|hex| std::str::from_utf8(hex).ok())
                .and_then(|hex| u8::from_str_radix(hex, 16).ok())
                .ok_or("a value has a `%` that is not followed by two hex digits")?;
            out.push(hex);
            index += 3;
        } else {
            out.push(bytes[index]);
            index += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "a percent-encoded value is not UTF-8".to_owned())
}

/// OTLP export headers. Their values are credentials more often than not, so every way of
/// printing this type masks them.
#[derive(Clone, PartialEq, Eq)]
pub struct HeaderList(pub Vec<(String, String)>);

impl FromStr for HeaderList {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let KeyValueList(pairs) = text.parse()?;
        for (key, _) in &pairs {
            if !key
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            {
                return Err(format!("`{key}` is not a valid header name"));
            }
        }
        Ok(Self(pairs))
    }
}

impl fmt::Display for HeaderList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, (key, _)) in self.0.iter().enumerate() {
            let separator = if index == 0 { "" } else { "," };
            write!(f, "{separator}{key}=***")?;
        }
        Ok(())
    }
}

impl fmt::Debug for HeaderList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// An endpoint URL fit to print: `user:password@` (credentials some put in URLs) masked.
pub fn printable_endpoint(endpoint: &str) -> String {
    let Some((scheme, rest)) = endpoint.split_once("://") else {
        return endpoint.to_owned();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rsplit_once('@') {
        Some((_, host)) => format!("{scheme}://***@{host}{}", &rest[authority_end..]),
        None => endpoint.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_print_without_credentials() {
        assert_eq!(
            printable_endpoint("https://u:pw@c:4318/x"),
            "https://***@c:4318/x"
        );
        assert_eq!(printable_endpoint("http://c:4317"), "http://c:4317");
        assert_eq!(printable_endpoint("http://c:4317/a@b"), "http://c:4317/a@b");
    }

    #[test]
    fn list_values_parse() {
        let list: KeyValueList = "k8s.node.name=n1, team=rl%2Cgym".parse().unwrap();
        assert_eq!(
            list.0,
            vec![
                ("k8s.node.name".into(), "n1".into()),
                ("team".into(), "rl,gym".into())
            ]
        );
        assert!("novalue".parse::<KeyValueList>().is_err());
        assert!("a=%zz".parse::<KeyValueList>().is_err());
    }
}
