//! The Watch RPC's transport: its events are encoded once per cluster event and the
//! same bytes go to every watcher, so it is routed past the generated service (whose
//! codec would clone and re-encode the message for each watcher) with a codec that
//! writes pre-encoded `WatchResponse` bytes. Every other method goes to the generated
//! `ClusterServer`.

use std::{
    convert::Infallible,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Instant,
};

use bytes::{BufMut as _, Bytes};
use futures::{future::BoxFuture, Stream};
use tokio_util::sync::CancellationToken;
use tonic::{
    body::Body,
    codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder},
    server::{NamedService, ServerStreamingService},
    Request, Response, Status,
};

use super::{
    error::RequestError,
    service::{ClusterService, Shared},
    state::{Next, Subscription, WatchQueue},
};
use crate::proto::server::{self as pb, cluster_server::ClusterServer};

const WATCH_PATH: &str = "/sidero.discovery.server.Cluster/Watch";

/// Decodes `WatchRequest`, writes pre-encoded `WatchResponse` bytes as they are.
#[derive(Debug, Clone, Copy, Default)]
struct EncodedCodec;

#[derive(Debug, Clone, Copy, Default)]
struct BytesEncoder;

#[derive(Debug, Clone, Copy, Default)]
struct RequestDecoder;

impl Codec for EncodedCodec {
    type Encode = Bytes;
    type Decode = pb::WatchRequest;
    type Encoder = BytesEncoder;
    type Decoder = RequestDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        BytesEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        RequestDecoder
    }
}

impl Encoder for BytesEncoder {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RequestDecoder {
    type Item = pb::WatchRequest;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<pb::WatchRequest>, Status> {
        prost::Message::decode(src)
            .map(Some)
            .map_err(|e| Status::internal(e.to_string()))
    }
}

/// The Cluster service with Watch routed to [`WatchSvc`].
#[derive(Clone)]
pub(crate) struct Routes {
    pub(crate) cluster: ClusterServer<ClusterService>,
    pub(crate) service: ClusterService,
}

impl NamedService for Routes {
    const NAME: &'static str = "sidero.discovery.server.Cluster";
}

impl tower::Service<http::Request<Body>> for Routes {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        if req.uri().path() == WATCH_PATH {
            let svc = WatchSvc(self.service.clone());
            Box::pin(async move {
                let mut grpc = tonic::server::Grpc::new(EncodedCodec);
                Ok(grpc.server_streaming(svc, req).await)
            })
        } else {
            tower::Service::call(&mut self.cluster, req)
        }
    }
}

struct WatchSvc(ClusterService);

impl ServerStreamingService<pb::WatchRequest> for WatchSvc {
    type Response = Bytes;
    type ResponseStream = EncodedStream;
    type Future = BoxFuture<'static, Result<Response<EncodedStream>, Status>>;

    fn call(&mut self, req: Request<pb::WatchRequest>) -> Self::Future {
        let svc = self.0.clone();
        Box::pin(async move {
            let start = Instant::now();
            let result = svc.watch_inner(req).await;
            svc.record("Watch", start, &result);
            // Errors become the stream's final status after the call opened, so every
            // client (Go and tonic alike) sees them on its first receive.
            let stream: EncodedStream = match result {
                Ok(sub) => watch_stream(Arc::clone(&svc.shared), sub),
                Err(status) => Box::pin(futures::stream::once(async move { Err(status) })),
            };
            Ok(Response::new(stream))
        })
    }
}

/// Encoded Watch messages.
pub(crate) type EncodedStream = Pin<Box<dyn Stream<Item = Result<Bytes, Status>> + Send>>;

/// Unsubscribes when the Watch stream is dropped (client went away or stream ended).
struct WatchGuard {
    shared: Arc<Shared>,
    cluster_id: String,
    id: u64,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.shared.state().unsubscribe(&self.cluster_id, self.id);
    }
}

struct WatchCtx {
    snapshot: Option<Bytes>,
    queue: Arc<WatchQueue>,
    shutdown: CancellationToken,
    done: bool,
    guard: WatchGuard,
}

/// The snapshot first, then the watcher's queue until it is closed or lost.
pub(crate) fn watch_stream(shared: Arc<Shared>, sub: Subscription) -> EncodedStream {
    let ctx = WatchCtx {
        snapshot: Some(sub.snapshot),
        queue: sub.queue,
        shutdown: shared.shutdown.clone(),
        done: false,
        guard: WatchGuard {
            shared,
            cluster_id: sub.cluster_id,
            id: sub.id,
        },
    };
    Box::pin(futures::stream::unfold(ctx, |mut ctx| async move {
        if ctx.done {
            return None;
        }
        // Always first, even when empty: clients know the snapshot by its position.
        if let Some(snapshot) = ctx.snapshot.take() {
            return Some((Ok(snapshot), ctx));
        }
        loop {
            match ctx.queue.next(Instant::now()) {
                Next::Send(event) => return Some((Ok(event), ctx)),
                Next::CatchUp => {
                    let g = &ctx.guard;
                    let found = g
                        .shared
                        .state()
                        .catch_up(Instant::now(), &g.cluster_id, g.id);
                    if !found {
                        return None;
                    }
                    g.shared.metrics.watch_catch_up();
                }
                Next::Lost => {
                    ctx.done = true;
                    ctx.guard.shared.metrics.watch_aborted();
                    return Some((Err(RequestError::LostUpdate.into()), ctx));
                }
                Next::Closed => return None,
                Next::Wait => {
                    // A push between `next` and here leaves a permit: no wake-up is lost.
                    let queue = Arc::clone(&ctx.queue);
                    tokio::select! {
                        biased;
                        () = ctx.shutdown.cancelled() => return None,
                        () = queue.notified() => {}
                    }
                }
            }
        }
    }))
}
