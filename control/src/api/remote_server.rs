//! The remote API server: the mutual-TLS listener ([`remote`](super::remote)), the
//! role check and proxy ([`gate`](super::gate)) and the resource service, with the
//! node's certificate renewed in the background.

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use tokio::{net::TcpListener, sync::mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use super::{
    gate::{GateLayer, Proxy},
    proto,
    remote::{accept_loop, refresh, SharedMaterial},
    server::{ResourceApi, ServeError},
};
use crate::runtime::Store;

/// How often the node checks whether its certificate needs renewing or its names
/// changed (the mesh address appears some seconds after start; other nodes' proxies
/// need it). Cheap: a few store reads and the interface list.
const RENEW_CHECK: Duration = Duration::from_secs(5);

/// Serves `api` on `listener` with mutual TLS until `shutdown`; the node's
/// certificate is kept current from the config in `store`.
///
/// # Errors
/// Transport errors.
pub async fn serve(
    listener: TcpListener,
    store: Store,
    api: ResourceApi,
    shutdown: CancellationToken,
) -> Result<(), ServeError> {
    let material: SharedMaterial = Arc::default();
    let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
    tokio::spawn({
        let (material, store, shutdown) = (Arc::clone(&material), store.clone(), shutdown.clone());
        async move {
            let mut tick = tokio::time::interval(RENEW_CHECK);
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    _ = tick.tick() => refresh(&material, &store, SystemTime::now()),
                }
            }
        }
    });
    // The first certificate before the first connection, when the config has a CA.
    refresh(&material, &store, SystemTime::now());
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(accept_loop(
        listener,
        Arc::clone(&material),
        tx,
        shutdown.clone(),
    ));
    let proxy = Arc::new(Proxy::new(store, port, material));
    tonic::transport::Server::builder()
        .layer(GateLayer::new(proxy))
        .add_service(
            proto::resource_service_server::ResourceServiceServer::new(api)
                .max_decoding_message_size(super::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(super::MAX_MESSAGE_BYTES),
        )
        .serve_with_incoming_shutdown(ReceiverStream::new(rx), shutdown.cancelled_owned())
        .await
        .map_err(Into::into)
}
