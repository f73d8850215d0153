//! `GET /v1/openapi.json`: the document is generated from the handlers, is a
//! valid OpenAPI 3 document (checked by openapi-spec-validator, installed
//! by scripts/py-tools), and lists every route the server answers.

mod common;

use common::fresh;
use common::serve::{call, Server};
use std::process::Command;

#[tokio::test]
async fn the_document_validates_and_names_every_route() {
    let db = fresh().await;
    let s = Server::start(&db.url);
    let (st, doc) = call("GET", &format!("{}/v1/openapi.json", s.base), None, None).await;
    assert_eq!(st, 200, "the document needs no token");
    assert!(
        doc["openapi"].as_str().unwrap().starts_with("3."),
        "{}",
        doc["openapi"]
    );
    let file = std::env::temp_dir().join(format!("jobledger-openapi-{}.json", std::process::id()));
    std::fs::write(&file, doc.to_string()).unwrap();
    let validator = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/target/pytools/bin/openapi-spec-validator"
    );
    assert!(
        std::path::Path::new(validator).exists(),
        "run scripts/py-tools first (scripts/test does)"
    );
    let out = Command::new(validator).arg(&file).output().unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_file(&file);

    let paths = doc["paths"].as_object().unwrap();
    for (path, method) in [
        ("/v1/jobs", "post"),
        ("/v1/jobs", "get"),
        ("/v1/jobs/{id}", "get"),
        ("/v1/jobs/{id}/history", "get"),
        ("/v1/jobs/{id}/cancel", "post"),
        ("/v1/jobs/{id}/replay", "post"),
        ("/v1/jobs/{id}/resolve", "post"),
        ("/v1/jobs/{id}/annotate", "post"),
        ("/v1/queues/{queue}/claim", "post"),
        ("/v1/jobs/{id}/heartbeat", "post"),
        ("/v1/jobs/{id}/progress", "post"),
        ("/v1/jobs/{id}/complete", "post"),
        ("/v1/jobs/{id}/fail", "post"),
        ("/v1/jobs/{id}/submit", "post"),
        ("/v1/jobs/{id}/confirm-cancel", "post"),
        ("/v1/jobs/{id}/release", "post"),
        ("/v1/jobs/{id}/snooze", "post"),
        ("/v1/jobs/{id}/observe", "post"),
        ("/v1/jobs/{id}/receipt", "post"),
        ("/v1/leases/complete", "post"),
        ("/v1/leases/heartbeat", "post"),
        ("/v1/jobs/batch", "post"),
        ("/v1/workflows", "post"),
        ("/v1/workflows/{id}", "get"),
        ("/v1/workflows/{id}/cancel", "post"),
        ("/v1/replays", "post"),
        ("/v1/queues", "get"),
        ("/v1/queues/{queue}/pause", "post"),
        ("/v1/queues/{queue}/resume", "post"),
        ("/v1/readers", "get"),
        ("/v1/projections", "get"),
        ("/v1/projections/{name}/rebuild", "post"),
    ] {
        let op = &paths.get(path).unwrap_or_else(|| panic!("{path} missing"))[method];
        assert!(op.is_object(), "{method} {path} missing");
        assert!(op["security"].is_array(), "{method} {path} names its auth");
        assert!(
            op["responses"]["401"].is_object(),
            "{method} {path} documents 401"
        );
    }
    // The wire enums are the code's own names.
    let outcome = &doc["components"]["schemas"]["Outcome"]["enum"];
    assert_eq!(
        outcome,
        &serde_json::json!([
            "committed",
            "already_committed",
            "conflict",
            "stale",
            "invalid_transition"
        ])
    );
}
