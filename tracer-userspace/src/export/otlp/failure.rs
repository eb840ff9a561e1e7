//! Why an export failed, said so that a person knows what to check: the SDK and the TLS
//! libraries report the cause several errors deep, and in their own words.

/// An error and its sources, `outer: inner: innermost`, without the repeats of errors that
/// already print their source (`a: b` followed by its source `b` says `b` once).
pub fn error_chain(error: &dyn std::error::Error) -> String {
    join_causes(std::iter::successors(Some(error), |e| e.source()).map(ToString::to_string))
}

fn join_causes(causes: impl Iterator<Item = String>) -> String {
    let mut text = String::new();
    let mut previous = String::new();
    for cause in causes {
        if !previous.contains(&cause) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&cause);
        }
        previous = cause;
    }
    text
}

/// What to check, for the failures a misconfigured export runs into.
pub fn failure_hint(error: &str) -> &'static str {
    const HINTS: [(&str, &str); 12] = [
        (
            "without sending TLS close_notify",
            "; the collector hung up during TLS: does it want a client certificate \
             (--otlp-client-cert and --otlp-client-key)?",
        ),
        (
            "KeyMismatch",
            "; is --otlp-client-key the key of --otlp-client-cert?",
        ),
        (
            "no native certs",
            "; this system has no trusted CAs: give the collector's CA with --otlp-ca-file",
        ),
        (
            "UnknownIssuer",
            "; the collector's certificate is not signed by a trusted CA: give its CA with \
             --otlp-ca-file",
        ),
        (
            "NotValidForName",
            "; the collector's certificate is not for the host in --otlp-endpoint",
        ),
        (
            "CertificateRequired",
            "; the collector wants a client certificate: --otlp-client-cert and \
             --otlp-client-key",
        ),
        (
            "Connection refused",
            "; is the collector listening at --otlp-endpoint?",
        ),
        (
            "Unauthenticated",
            "; the collector refused the credentials: check --otlp-headers",
        ),
        (
            "Status Code: 401",
            "; the collector refused the credentials: check --otlp-headers",
        ),
        (
            "Status Code: 403",
            "; the collector refused the credentials: check --otlp-headers",
        ),
        (
            "status code: 401",
            "; the collector refused the credentials: check --otlp-headers",
        ),
        (
            "status code: 403",
            "; the collector refused the credentials: check --otlp-headers",
        ),
    ];
    HINTS
        .iter()
        .find(|(symptom, _)| error.contains(symptom))
        .map_or("", |(_, hint)| hint)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);

    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1
                .as_deref()
                .map(|layer| -> &(dyn std::error::Error + 'static) { layer })
        }
    }

    #[test]
    fn transport_errors_keep_their_cause_and_say_what_to_check() {
        let cause = Layer("invalid peer certificate: UnknownIssuer", None);
        let error = Layer(
            "error sending request",
            Some(Box::new(Layer(
                "client error (Connect)",
                Some(Box::new(cause)),
            ))),
        );
        let text = error_chain(&error);
        assert_eq!(
            text,
            "error sending request: client error (Connect): invalid peer certificate: UnknownIssuer"
        );
        assert!(failure_hint(&text).contains("--otlp-ca-file"));
        assert!(
            failure_hint("received fatal alert: CertificateRequired")
                .contains("--otlp-client-cert")
        );
        assert!(failure_hint("Status Code: 401, Response: no").contains("--otlp-headers"));
        assert_eq!(failure_hint("HTTP export failed: network error"), "");
        // A source that repeats its parent is said once.
        let repeated = Layer("timed out", Some(Box::new(Layer("timed out", None))));
        assert_eq!(error_chain(&repeated), "timed out");
    }

    #[test]
    fn error_chains_drop_causes_their_parent_already_printed() {
        let causes = [
            "loading the eBPF programs into the kernel",
            "map error: failed to create map `EVENTS`: Operation not permitted",
            "failed to create map `EVENTS`: Operation not permitted",
            "Operation not permitted",
        ];
        assert_eq!(
            join_causes(causes.iter().map(|c| c.to_string())),
            "loading the eBPF programs into the kernel: map error: failed to create map `EVENTS`: Operation not permitted"
        );
    }
}
