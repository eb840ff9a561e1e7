//! The SDK's own environment variables: its exporter builders read
//! `OTEL_EXPORTER_OTLP_*_HEADERS` and `..._COMPRESSION` behind our back, so they are checked
//! against the options before anything is sent.

use anyhow::Result;

use super::Signal;
use super::options::{KeyValueList, OtlpCompression};

/// The SDK's builders also read `OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]HEADERS` and
/// `..._COMPRESSION` themselves, and let them win over what they are given: headers key by
/// key, compression when none is given. Where that would send something `signal`'s options
/// do not say, refuse. (Endpoint, protocol and timeout are given explicitly, which the SDK lets win;
/// `..._INSECURE` only applies to an endpoint without a scheme, which `config::validate`
/// refuses.)
pub fn check_sdk_environment(
    signal: Signal,
    headers: &http::HeaderMap,
    compression: OtlpCompression,
    env: impl Fn(&str) -> Option<String>,
) -> Result<()> {
    // As the SDK: the signal's variable if set (even empty), else the generic one.
    let variable = [
        signal.headers_var(),
        opentelemetry_otlp::OTEL_EXPORTER_OTLP_HEADERS,
    ]
    .into_iter()
    .find_map(|name| env(name).map(|value| (name, value)));
    if let Some((name, value)) = variable {
        for (key, value) in sdk_header_pairs(&value) {
            if headers.get(key.as_str()).and_then(|v| v.to_str().ok()) != Some(value.as_str()) {
                anyhow::bail!(
                    "{name} is set and the OTLP {} exporter would send its `{key}` header, \
                     which the {} headers option does not say; unset {name}, or give the same \
                     headers with --otlp-headers / --otlp-{}-headers",
                    signal.name(),
                    signal.name(),
                    signal.name()
                );
            }
        }
    }
    if compression == OtlpCompression::None {
        for name in [
            signal.compression_var(),
            opentelemetry_otlp::OTEL_EXPORTER_OTLP_COMPRESSION,
        ] {
            let Some(value) = env(name).filter(|value| !value.is_empty()) else {
                continue;
            };
            if value.eq_ignore_ascii_case("none") {
                break;
            }
            if value.eq_ignore_ascii_case("gzip") {
                anyhow::bail!(
                    "{name}={value} would make the OTLP exporter compress {} although the \
                     compression option for them is none; unset {name}, or pass \
                     --otlp-compression gzip (or --otlp-{}-compression gzip)",
                    signal.name(),
                    signal.name()
                );
            }
            // The SDK ignores what it cannot use (zstd is not built in) and reads on.
        }
    }
    Ok(())
}

/// A headers variable as the SDK reads it: `key=value` pairs, percent-decoded where that
/// works, pairs with an empty key or value or an invalid name or value skipped.
fn sdk_header_pairs(text: &str) -> Vec<(String, String)> {
    text.split_terminator(',')
        .filter_map(|item| {
            let (key, raw) = item.trim().split_once('=')?;
            let key = key.trim();
            let raw = raw.trim();
            let value = match format!("k={raw}").parse::<KeyValueList>() {
                Ok(pairs) => pairs
                    .0
                    .into_iter()
                    .next()
                    .map_or_else(String::new, |(_, v)| v),
                Err(_) => raw.to_owned(),
            };
            let valid = http::HeaderName::from_bytes(key.as_bytes()).is_ok()
                && http::HeaderValue::from_str(&value).is_ok();
            (valid && !value.is_empty()).then(|| (key.to_ascii_lowercase(), value))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::export::otlp::options::HeaderList;
    use crate::export::otlp::transport::header_map;

    fn headers(list: &str) -> http::HeaderMap {
        header_map(&list.parse::<HeaderList>().unwrap()).unwrap()
    }

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| vars.get(name).cloned()
    }

    /// Both signals, traces first, as the exporters are built.
    fn check_both(
        ours: &http::HeaderMap,
        compression: OtlpCompression,
        env: &impl Fn(&str) -> Option<String>,
    ) -> Result<()> {
        for signal in Signal::ALL {
            check_sdk_environment(signal, ours, compression, env)?;
        }
        Ok(())
    }

    #[test]
    fn a_signal_variable_is_checked_against_that_signal_only() {
        let ours = headers("authorization=a");
        let env = env_of(&[("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "authorization=b")]);
        assert!(check_sdk_environment(Signal::Traces, &ours, OtlpCompression::None, &env).is_ok());
        assert!(
            check_sdk_environment(Signal::Metrics, &ours, OtlpCompression::None, &env).is_err()
        );
    }

    #[test]
    fn sdk_header_variables_are_read_as_the_sdk_reads_them() {
        assert_eq!(
            sdk_header_pairs(" Authorization = Bearer%20x ,empty=,=v,bad key=1,raw=%zz,"),
            [
                ("authorization".to_string(), "Bearer x".to_string()),
                ("raw".to_string(), "%zz".to_string()),
            ]
        );
    }

    #[test]
    fn sdk_environment_that_agrees_with_the_options_is_accepted() {
        let ours = headers("authorization=Bearer%20x");
        let env = env_of(&[
            ("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20x"),
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "none"),
            ("OTEL_EXPORTER_OTLP_METRICS_COMPRESSION", "zstd"),
        ]);
        assert!(check_both(&ours, OtlpCompression::None, &env).is_ok());
        // Given compression wins in the SDK.
        let gzip_env = env_of(&[("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")]);
        assert!(check_both(&ours, OtlpCompression::Gzip, &gzip_env).is_ok());
        // A signal variable set empty hides the generic one, in the SDK too.
        let masked = env_of(&[
            ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", ""),
            ("OTEL_EXPORTER_OTLP_METRICS_HEADERS", ""),
            ("OTEL_EXPORTER_OTLP_HEADERS", "authorization=old"),
        ]);
        assert!(check_both(&ours, OtlpCompression::None, &masked).is_ok());
    }

    #[test]
    fn sdk_environment_that_would_override_the_options_is_refused() {
        let ours = headers("authorization=Bearer%20new");
        let refusal = |vars: &[(&str, &str)]| {
            check_both(&ours, OtlpCompression::None, &env_of(vars))
                .unwrap_err()
                .to_string()
        };
        let stale = refusal(&[("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20old")]);
        assert!(
            stale.starts_with("OTEL_EXPORTER_OTLP_HEADERS is set"),
            "{stale}"
        );
        assert!(
            stale.contains("`authorization`") && !stale.contains("old"),
            "{stale}"
        );

        let extra = refusal(&[("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "x-tenant=a")]);
        assert!(
            extra.starts_with("OTEL_EXPORTER_OTLP_METRICS_HEADERS"),
            "{extra}"
        );

        let gzip = refusal(&[
            ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "zstd"),
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "GZIP"),
        ]);
        assert!(
            gzip.starts_with("OTEL_EXPORTER_OTLP_COMPRESSION=GZIP"),
            "{gzip}"
        );
        assert!(gzip.contains("--otlp-compression gzip"), "{gzip}");
    }
}
