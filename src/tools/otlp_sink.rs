//! An OTLP/gRPC receiver on a loopback port that only counts the spans it
//! gets, by name: `bench --only traces` exports to it, so the cost measured
//! is the real exporter's (encoding, gRPC, the batch processor), and the
//! bench checks that every span it expected arrived.

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Spans received, by name.
#[derive(Clone, Default)]
pub struct Counts(Arc<Mutex<HashMap<String, u64>>>);

impl Counts {
    pub fn get(&self, name: &str) -> u64 {
        self.0.lock().expect("counts").get(name).copied().unwrap_or(0)
    }
}

#[tonic::async_trait]
impl TraceService for Counts {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut counts = self.0.lock().expect("counts");
        for rs in req.into_inner().resource_spans {
            for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                *counts.entry(span.name).or_default() += 1;
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// Starts the receiver on the runtime; its endpoint and its counts.
pub fn start() -> std::io::Result<(String, Counts)> {
    let incoming = tonic::transport::server::TcpIncoming::bind(([127, 0, 0, 1], 0).into())?;
    let addr = incoming.local_addr()?;
    let counts = Counts::default();
    let server = tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(counts.clone()))
        .serve_with_incoming(incoming);
    tokio::spawn(async move {
        if let Err(e) = server.await {
            eprintln!("otlp sink: {e}");
        }
    });
    Ok((format!("http://{addr}"), counts))
}
