//! Every route of the OpenAPI document, every role: no token is 401, a role
//! without the right is 403 (before the body is even read), a role with it
//! gets past the guard. The table of what each route needs is written here
//! by hand, so a route added to the server without a line here fails.

mod common;

use common::fresh;
use common::serve::{call, Server};
use jobledger::ledger::tokens::{Action, Role};

fn needs(method: &str, path: &str) -> Action {
    use Action::*;
    match (method, path) {
        ("get", _) => Read,
        ("post", "/v1/jobs" | "/v1/jobs/batch" | "/v1/workflows") => Enqueue,
        ("post", "/v1/projections/{name}/rebuild") => Administer,
        ("post", p) if p.starts_with("/v1/leases/") || p == "/v1/queues/{queue}/claim" => Work,
        ("post", p)
            if [
                "heartbeat",
                "progress",
                "complete",
                "fail",
                "submit",
                "confirm-cancel",
                "release",
                "snooze",
                "observe",
                "receipt",
            ]
            .iter()
            .any(|w| p.ends_with(&format!("/{w}"))) =>
        {
            Work
        }
        ("post", _) => Operate,
        other => panic!("no rule for {other:?}"),
    }
}

#[tokio::test]
async fn every_route_checks_its_token_and_role() {
    let db = fresh().await;
    let roles = [Role::Reader, Role::Worker, Role::Operator, Role::Admin];
    let mut tokens = vec![];
    for r in roles {
        tokens.push((
            r,
            db.ledger
                .create_token(&format!("t-{}", r.as_str()), r)
                .await
                .unwrap(),
        ));
    }
    let s = Server::start(&db.url);
    let (_, doc) = call("GET", &format!("{}/v1/openapi.json", s.base), None, None).await;
    let id = uuid::Uuid::now_v7().to_string();
    let mut checked = 0;
    for (path, ops) in doc["paths"].as_object().unwrap() {
        let url = format!("{}{}", s.base, path)
            .replace("{id}", &id)
            .replace("{queue}", "q")
            .replace("{name}", "queue_stats");
        for method in ops.as_object().unwrap().keys() {
            let action = needs(method, path);
            let m = method.to_uppercase();
            let (st, v) = call(&m, &url, None, Some("{}".into())).await;
            assert_eq!(st, 401, "{m} {path} without a token: {v}");
            for (role, token) in &tokens {
                let (st, v) = call(&m, &url, Some(token), Some("{}".into())).await;
                if role.may(action) {
                    assert!(
                        st != 401 && st != 403,
                        "{m} {path} as {}: {st} {v}",
                        role.as_str()
                    );
                    assert!(st < 500, "{m} {path} as {}: {st} {v}", role.as_str());
                } else {
                    assert_eq!(st, 403, "{m} {path} as {}: {v}", role.as_str());
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 4 * 30, "{checked} checks: every route was seen");
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.events").await,
        0,
        "no request wrote an event"
    );
}
