//! The Watch RPC's transport: its events are encoded once per cluster event and the
//! same bytes go to every watcher, so it is routed past the generated service (whose
//! codec would clone and re-encode the message for each watcher). tonic decodes the
//! request; the response body is this module's own: the gRPC-framed messages in
//! pieces of at most [`FRAME`](super::state::encode::FRAME) bytes, taken from the watcher's queue only as the
//! transport asks for them. tonic's encoder would copy each whole message into a
//! buffer per stream, which HTTP/2 then keeps for as long as the peer does not read:
//! a full snapshot per watcher that stopped reading, beyond reach of any abort. Here
//! such a watcher pins at most one piece in the transport; the rest stays in its
//! queue, where the stall check and the byte budget can free it. Every other method
//! goes to the generated `ClusterServer`.

use std::{
    convert::Infallible,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::Instant,
};

use bytes::{BufMut as _, Bytes};
use futures::{future::BoxFuture, StreamExt as _};
use hyper::body::Frame;
use tonic::{
    body::Body,
    codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder},
    server::{NamedService, ServerStreamingService},
    Request, Response, Status,
};

use super::{service::ClusterService, watch_frames::WatchFrames};
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
    /// Largest request message decoded.
    pub(crate) max_request_bytes: usize,
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
            let slot = Arc::new(Mutex::new(None));
            let svc = WatchSvc {
                service: self.service.clone(),
                slot: Arc::clone(&slot),
            };
            let max = self.max_request_bytes;
            Box::pin(async move {
                let mut grpc =
                    tonic::server::Grpc::new(EncodedCodec).max_decoding_message_size(max);
                let response = grpc.server_streaming(svc, req).await;
                // tonic decoded the request and made the headers; the body is ours.
                // No stream in the slot: tonic answered with an error status.
                let frames = slot
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .take();
                Ok(match frames {
                    Some(frames) => {
                        let (parts, _) = response.into_parts();
                        http::Response::from_parts(
                            parts,
                            Body::new(FrameBody {
                                frames,
                                done: false,
                            }),
                        )
                    }
                    None => response,
                })
            })
        } else {
            tower::Service::call(&mut self.cluster, req)
        }
    }
}

/// Hands the body's frames to [`Routes`] through `slot`; tonic gets an empty
/// stream, whose encoded body is dropped.
struct WatchSvc {
    service: ClusterService,
    slot: Arc<Mutex<Option<Frames>>>,
}

type NoMessages = futures::stream::Empty<Result<Bytes, Status>>;

impl ServerStreamingService<pb::WatchRequest> for WatchSvc {
    type Response = Bytes;
    type ResponseStream = NoMessages;
    type Future = BoxFuture<'static, Result<Response<NoMessages>, Status>>;

    fn call(&mut self, req: Request<pb::WatchRequest>) -> Self::Future {
        let svc = self.service.clone();
        let slot = Arc::clone(&self.slot);
        Box::pin(async move {
            let start = Instant::now();
            let result = svc.watch_inner(req).await;
            svc.record("Watch", start, &result);
            // Errors become the stream's final status after the call opened, so every
            // client (Go and tonic alike) sees them on its first receive.
            let frames = match result {
                Ok(sub) => Frames::Watch(WatchFrames::new(Arc::clone(&svc.shared), sub, true)),
                Err(status) => Frames::Failed(Some(status)),
            };
            *slot
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(frames);
            Ok(Response::new(futures::stream::empty()))
        })
    }
}

/// What a Watch response body carries: the watcher's frames, or the status the
/// call failed with.
enum Frames {
    Watch(WatchFrames),
    Failed(Option<Status>),
}

/// The Watch response body: the frames as data, then the status as trailers (OK
/// when the stream ends, the error otherwise).
struct FrameBody {
    frames: Frames,
    done: bool,
}

fn trailers(status: &Status) -> http::HeaderMap {
    let mut map = http::HeaderMap::new();
    if status.add_header(&mut map).is_err() {
        // Only a message that is no valid header value fails; the code still goes.
        map.clear();
        map.insert(Status::GRPC_STATUS, (status.code() as i32).into());
    }
    map
}

impl hyper::body::Body for FrameBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let status = match &mut self.frames {
            Frames::Watch(frames) => match futures::ready!(frames.poll_next_unpin(cx)) {
                Some(Ok(data)) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                Some(Err(status)) => status,
                None => Status::ok(""),
            },
            Frames::Failed(status) => status.take().unwrap_or_else(|| Status::ok("")),
        };
        self.done = true;
        Poll::Ready(Some(Ok(Frame::trailers(trailers(&status)))))
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}
