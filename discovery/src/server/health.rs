//! `grpc.health.v1.Health` on the gRPC port, for load balancers and Kubernetes gRPC
//! probes: the server as a whole (`""`) and the `Cluster` service are `SERVING` until
//! shutdown begins, then `NOT_SERVING`. Not rate limited: probes must not be refused
//! by the limit meant for clients.

use std::pin::Pin;

use futures::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::proto::health::{
    health_check_response::ServingStatus, health_server::Health, HealthCheckRequest,
    HealthCheckResponse,
};

/// The service names this server answers for.
const SERVICES: &[&str] = &["", "sidero.discovery.server.Cluster"];

/// The health service.
#[derive(Debug, Clone)]
pub(crate) struct HealthService {
    pub(crate) shutdown: CancellationToken,
}

impl HealthService {
    fn status(&self) -> ServingStatus {
        if self.shutdown.is_cancelled() {
            ServingStatus::NotServing
        } else {
            ServingStatus::Serving
        }
    }
}

fn response(status: ServingStatus) -> HealthCheckResponse {
    HealthCheckResponse {
        status: status.into(),
    }
}

type HealthStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Health for HealthService {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        if !SERVICES.contains(&request.get_ref().service.as_str()) {
            return Err(Status::not_found("unknown service"));
        }
        Ok(Response::new(response(self.status())))
    }

    type WatchStream = HealthStream;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        if !SERVICES.contains(&request.get_ref().service.as_str()) {
            let once = futures::stream::iter([Ok(response(ServingStatus::ServiceUnknown))]);
            return Ok(Response::new(Box::pin(once)));
        }
        let first = self.status();
        let shutdown = self.shutdown.clone();
        let stream = futures::stream::once(async move { Ok(response(first)) }).chain(
            futures::stream::once(async move {
                shutdown.cancelled().await;
                Ok(response(ServingStatus::NotServing))
            })
            .filter(move |_| futures::future::ready(first == ServingStatus::Serving)),
        );
        Ok(Response::new(Box::pin(stream)))
    }
}
