//! The document's frame: title, version and the bearer scheme. The paths
//! and schemas come from the handlers themselves (`#[utoipa::path]`).

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ComponentsBuilder, InfoBuilder, OpenApi, OpenApiBuilder};

pub fn info() -> OpenApi {
    OpenApiBuilder::new()
        .info(
            InfoBuilder::new()
                .title("jobledger")
                .version(env!("CARGO_PKG_VERSION"))
                .description(Some(
                    "An event-sourced ledger for background jobs with fenced leases. \
                     Every write answers one of five outcomes; see docs/http.md.",
                ))
                .build(),
        )
        .components(Some(
            ComponentsBuilder::new()
                .security_scheme(
                    "bearer",
                    SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
                )
                .build(),
        ))
        .build()
}
