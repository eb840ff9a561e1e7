//! How an exchange ended, as the HTTP semantic conventions record it: the one rule spans and
//! metrics share. A response's status is its `http.response.status_code`; a 5xx or an
//! exchange cut off before its response is an error, with `error.type` the status code or
//! the abort's reason.

use std::borrow::Cow;

use crate::model::exchange::{AbortReason, Outcome};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorType {
    Status(u16),
    Aborted(AbortReason),
}

impl ErrorType {
    /// The `error.type` value.
    pub fn value(self) -> Cow<'static, str> {
        match self {
            Self::Status(status) => Cow::Owned(status.to_string()),
            Self::Aborted(reason) => Cow::Borrowed(reason.as_error_type()),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpOutcome {
    pub status_code: Option<u16>,
    /// Set exactly when the span's status is ERROR.
    pub error_type: Option<ErrorType>,
}

pub fn http_outcome(outcome: &Outcome) -> HttpOutcome {
    match outcome {
        Outcome::Response(response) => HttpOutcome {
            status_code: Some(response.status),
            error_type: (response.status >= 500).then_some(ErrorType::Status(response.status)),
        },
        Outcome::Aborted(reason) => HttpOutcome {
            status_code: None,
            error_type: Some(ErrorType::Aborted(*reason)),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::testing;

    #[test]
    fn server_errors_and_aborts_are_errors_other_statuses_are_not() {
        let ok = http_outcome(&testing::response(404));
        assert_eq!((ok.status_code, ok.error_type), (Some(404), None));
        let failed = http_outcome(&testing::response(503));
        assert_eq!(failed.error_type.map(ErrorType::value), Some("503".into()));
        let cut = http_outcome(&Outcome::Aborted(AbortReason::ConnectionClosed));
        assert_eq!(cut.status_code, None);
        assert_eq!(
            cut.error_type.map(ErrorType::value).as_deref(),
            Some(AbortReason::ConnectionClosed.as_error_type())
        );
    }
}
