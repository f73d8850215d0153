//! OpenAPI schemas of the wire enums, built from the same names the log and
//! Kafka carry (`ALL` and `as_str`), so the HTTP API's document can never
//! list a state, outcome or reason the code does not have. Kept out of
//! `domain/` so the state machine depends on nothing but serde.

use std::borrow::Cow;
use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};
use utoipa::openapi::RefOr;

use crate::domain::model::{ErrorClass, JobState, NextAction, ReceiptStatus};
use crate::domain::{Outcome, Reason};

macro_rules! wire_schema {
    ($($ty:ty => $name:literal),+ $(,)?) => {$(
        impl utoipa::PartialSchema for $ty {
            fn schema() -> RefOr<Schema> {
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .enum_values(Some(<$ty>::ALL.iter().map(|v| v.as_str())))
                    .into()
            }
        }
        impl utoipa::ToSchema for $ty {
            fn name() -> Cow<'static, str> {
                Cow::Borrowed($name)
            }
        }
    )+};
}

wire_schema!(
    JobState => "JobState",
    Outcome => "Outcome",
    Reason => "Reason",
    NextAction => "NextAction",
    ErrorClass => "ErrorClass",
    ReceiptStatus => "ReceiptStatus",
);
