//! From the SDK's errors to `idem_core::Error`, with messages that say what
//! to do. The typed cause ([`DynamoError`]) stays reachable through
//! `source()`.

use aws_sdk_dynamodb::config::http::HttpResponse;
use aws_sdk_dynamodb::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use idem_core::Error;

/// What went wrong talking to DynamoDB, as the `source()` of the
/// [`idem_core::Error`] a store call returns: downcast to match on it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DynamoError {
    /// The table does not exist (or is not `ACTIVE` yet) in this account
    /// and region.
    #[error(
        "DynamoDB table `{table}` does not exist in this account and region (or is not ACTIVE \
         yet): create it with `DynamoStore::create_table` (tests, development) or with your \
         infrastructure code, with the schema in idem-dynamodb's crate docs (a string partition \
         key `{key_attribute}`, no sort key, TTL on `expires_at`)"
    )]
    TableMissing {
        /// The table name.
        table: String,
        /// The partition key attribute the store was configured with.
        key_attribute: String,
    },

    /// The credentials may not call the operation on the table.
    #[error(
        "access denied to DynamoDB table `{table}` ({code}: {message}): the store's role needs \
         dynamodb:PutItem, dynamodb:UpdateItem, dynamodb:DeleteItem and dynamodb:GetItem on the \
         table, and dynamodb:Scan for operator calls (`idem scan`); dynamodb:CreateTable, \
         DescribeTable and UpdateTimeToLive only for `DynamoStore::create_table`"
    )]
    AccessDenied {
        /// The table name.
        table: String,
        /// DynamoDB's error code.
        code: String,
        /// DynamoDB's message.
        message: String,
    },

    /// DynamoDB throttled the request (provisioned capacity, or a hot
    /// partition).
    #[error(
        "DynamoDB throttled the request on table `{table}` ({code}: {message}); raise the \
         table's capacity or use on-demand billing, and spread keys (a hot key throttles alone)"
    )]
    Throttled {
        /// The table name.
        table: String,
        /// DynamoDB's error code.
        code: String,
        /// DynamoDB's message.
        message: String,
    },

    /// An item would exceed DynamoDB's 400 KB item size.
    #[error(
        "the record of this key would be {size} bytes, over DynamoDB's {limit}-byte item limit, \
         so it was not written: lower `max_value_size` (the runtime does so from the store's \
         capabilities), return something smaller, or use RedisStore or PgStore for large results"
    )]
    ItemTooLarge {
        /// The size the item would have had, in bytes (estimated as
        /// DynamoDB counts it: attribute names and values).
        size: usize,
        /// DynamoDB's item limit, in bytes.
        limit: usize,
    },

    /// The request did not reach DynamoDB or got no answer.
    #[error(
        "no answer from DynamoDB for table `{table}`: {detail}; check the network, the region \
         and the endpoint (AWS_REGION, AWS_ENDPOINT_URL_DYNAMODB), and the credentials"
    )]
    Unreachable {
        /// The table name.
        table: String,
        /// The SDK's description.
        detail: String,
    },

    /// DynamoDB refused the request for another reason.
    #[error(
        "DynamoDB refused the request on table `{table}` ({code}: {message}); check that the \
         table was created with idem-dynamodb's schema and the store's key attribute"
    )]
    Refused {
        /// The table name.
        table: String,
        /// DynamoDB's error code.
        code: String,
        /// DynamoDB's message.
        message: String,
    },
}

/// Maps an SDK error met during `op` on `table`. A missing table or a
/// refused permission is [`Error::InvalidConfig`] (a retry cannot fix it);
/// the rest is [`Error::Unavailable`], so `FailMode` applies.
pub(crate) fn map<E>(
    op: &'static str,
    table: &str,
    key_attribute: &str,
    e: SdkError<E, HttpResponse>,
) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let mut code = e.code().unwrap_or_default().to_owned();
    // A refusal without DynamoDB's own error body (a proxy's, a VPC
    // endpoint policy's, an emulator's XML) is still a refusal: a `403`
    // is credentials or a policy, which no retry fixes.
    let status = e.raw_response().map(|r| r.status().as_u16());
    if code.is_empty() && status == Some(403) {
        code = "HTTP 403".to_owned();
    }
    let mut message = e.message().unwrap_or_default().to_owned();
    if message.is_empty() && status == Some(403) {
        message = body_text(&e);
    }
    let table = table.to_owned();
    let typed = match &e {
        SdkError::DispatchFailure(_) | SdkError::TimeoutError(_) => DynamoError::Unreachable {
            table,
            detail: DisplayErrorContext(&e).to_string(),
        },
        SdkError::ResponseError(_) if status != Some(403) => DynamoError::Unreachable {
            table,
            detail: DisplayErrorContext(&e).to_string(),
        },
        _ => match code.as_str() {
            "ResourceNotFoundException" => DynamoError::TableMissing {
                table,
                key_attribute: key_attribute.to_owned(),
            },
            "AccessDeniedException"
            | "UnrecognizedClientException"
            | "InvalidSignatureException"
            | "MissingAuthenticationTokenException"
            | "ExpiredTokenException"
            | "HTTP 403" => DynamoError::AccessDenied {
                table,
                code,
                message,
            },
            "ProvisionedThroughputExceededException"
            | "ThrottlingException"
            | "RequestLimitExceeded" => DynamoError::Throttled {
                table,
                code,
                message,
            },
            "" => DynamoError::Unreachable {
                table,
                detail: DisplayErrorContext(&e).to_string(),
            },
            _ => DynamoError::Refused {
                table,
                code,
                message,
            },
        },
    };
    tracing::debug!(op, error = %DisplayErrorContext(&e), "DynamoDB request failed");
    from_typed(op, typed)
}

/// The start of a response body that is not DynamoDB's own error, on one
/// line: what the refusing party said.
fn body_text<E>(e: &SdkError<E, HttpResponse>) -> String {
    let bytes = e
        .raw_response()
        .and_then(|r| r.body().bytes())
        .unwrap_or_default();
    let text = String::from_utf8_lossy(bytes.get(..300).unwrap_or(bytes));
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A typed error as the `idem_core::Error` a store call returns.
pub(crate) fn from_typed(op: &'static str, typed: DynamoError) -> Error {
    let reason = typed.to_string();
    match typed {
        DynamoError::TableMissing { .. } | DynamoError::AccessDenied { .. } => {
            Error::InvalidConfig(reason).with_source(typed)
        }
        _ => Error::unavailable(op, reason).with_source(typed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_dynamodb::error::ErrorMetadata;
    use aws_sdk_dynamodb::operation::put_item::PutItemError;
    use aws_smithy_types::body::SdkBody;

    /// DynamoDB's answer `status` with error `code` (none: a body that is
    /// not DynamoDB's), as the SDK hands it over.
    fn answer(status: u16, code: Option<&str>) -> Error {
        let mut meta = ErrorMetadata::builder().message("said DynamoDB");
        if let Some(code) = code {
            meta = meta.code(code);
        }
        let response = HttpResponse::new(status.try_into().unwrap(), SdkBody::from("<Error/>"));
        let e = SdkError::service_error(PutItemError::generic(meta.build()), response);
        map("claim", "t", "pk", e)
    }

    fn cause(e: &Error) -> Option<&DynamoError> {
        std::error::Error::source(e).and_then(|s| s.downcast_ref::<DynamoError>())
    }

    #[test]
    fn throttling_is_unavailable_and_says_to_raise_capacity() {
        for code in [
            "ThrottlingException",
            "ProvisionedThroughputExceededException",
            "RequestLimitExceeded",
        ] {
            let e = answer(400, Some(code));
            assert!(matches!(e, Error::Unavailable { .. }), "{code}: {e:?}");
            assert!(e.is_retryable(), "{code}");
            assert!(
                matches!(cause(&e), Some(DynamoError::Throttled { .. })),
                "{code}: {e:?}"
            );
            assert!(e.to_string().contains("on-demand"), "{e}");
        }
    }

    #[test]
    fn refused_credentials_are_invalid_config_naming_the_actions() {
        for (status, code) in [
            (400, Some("AccessDeniedException")),
            (400, Some("UnrecognizedClientException")),
            (403, None),
        ] {
            let e = answer(status, code);
            let Error::InvalidConfig(msg) = &e else {
                panic!("{status} {code:?}: {e:?}");
            };
            assert!(
                msg.contains("access denied") && msg.contains("dynamodb:PutItem"),
                "{msg}"
            );
            assert!(!e.is_retryable());
        }
    }

    #[test]
    fn an_answer_without_a_code_is_unavailable() {
        let e = answer(500, None);
        assert!(
            matches!(cause(&e), Some(DynamoError::Unreachable { .. })),
            "{e:?}"
        );
        let e = answer(400, Some("ValidationException"));
        assert!(
            matches!(cause(&e), Some(DynamoError::Refused { .. })),
            "{e:?}"
        );
    }
}
