//! A panicking RPC handler answers `INTERNAL` and the server keeps serving (upstream's
//! panic-recovery interceptor). Shared state survives: its mutexes are taken through
//! `PoisonError::into_inner`, and no handler leaves it half-updated across an await.

use std::{
    panic::AssertUnwindSafe,
    task::{Context, Poll},
};

use futures::{future::BoxFuture, FutureExt};
use tonic::body::Body;

/// Wraps a gRPC service so that panics become `INTERNAL` responses.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CatchPanicLayer;

impl<S> tower::Layer<S> for CatchPanicLayer {
    type Service = CatchPanic<S>;

    fn layer(&self, inner: S) -> Self::Service {
        CatchPanic { inner }
    }
}

/// See [`CatchPanicLayer`].
#[derive(Debug, Clone)]
pub(crate) struct CatchPanic<S> {
    inner: S,
}

fn internal(panic: &(dyn std::any::Any + Send)) -> http::Response<Body> {
    let what = panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("unknown panic");
    // Debug: a panic message may quote request data; escaped, it cannot forge a line.
    tracing::error!(panic = ?what, "RPC handler panicked; answered INTERNAL");
    tonic::Status::internal("internal error").into_http()
}

impl<S, B> tower::Service<http::Request<B>> for CatchPanic<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let inner = &mut self.inner;
        match std::panic::catch_unwind(AssertUnwindSafe(move || inner.call(req))) {
            Ok(fut) => Box::pin(async move {
                match AssertUnwindSafe(fut).catch_unwind().await {
                    Ok(r) => r,
                    Err(panic) => Ok(internal(&*panic)),
                }
            }),
            Err(panic) => {
                let resp = internal(&*panic);
                Box::pin(async move { Ok(resp) })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tower::{Layer, ServiceExt};

    use super::*;

    #[tokio::test]
    async fn panic_becomes_internal_and_service_keeps_working() {
        let svc = tower::service_fn(|req: http::Request<()>| async move {
            if req.uri().path() == "/boom" {
                panic!("handler bug");
            }
            Ok::<_, std::convert::Infallible>(http::Response::new(Body::empty()))
        });
        let svc = CatchPanicLayer.layer(svc);
        let req = |p: &str| http::Request::builder().uri(p).body(()).unwrap();
        let resp = svc.clone().oneshot(req("/boom")).await.unwrap();
        let status = tonic::Status::from_header_map(resp.headers()).unwrap();
        assert_eq!(status.code(), tonic::Code::Internal);
        assert_eq!(status.message(), "internal error");
        let ok = svc.oneshot(req("/fine")).await.unwrap();
        assert!(tonic::Status::from_header_map(ok.headers()).is_none());
    }
}
