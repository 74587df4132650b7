//! The metrics listener: `/metrics` (Prometheus text), `/` (landing page) and
//! `/inspect?clusterID=…` (affiliate IDs, sizes and expiry, never blob contents).

use std::{fmt::Write as _, sync::Arc, time::Instant};

use axum::{
    extract::{Query, State},
    http::{header, StatusCode},
    response::{Html, IntoResponse, Response},
    routing::get,
    Router,
};

use super::service::Shared;

/// The router served on the metrics address.
pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/", get(landing))
        .route("/metrics", get(metrics))
        .route("/inspect", get(inspect))
        .with_state(shared)
}

async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    let counts = shared.state().counts();
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        shared.metrics.render(counts),
    )
        .into_response()
}

async fn landing(State(shared): State<Arc<Shared>>) -> Html<String> {
    let counts = shared.state().counts();
    Html(format!(
        "<!doctype html><html><head><title>wirespan discovery</title></head><body>\
         <h1>wirespan discovery service</h1>\
         <p>Compatible with the <code>sidero.discovery.server.Cluster</code> gRPC API.</p>\
         <p>{} clusters, {} affiliates, {} endpoints, {} watchers.</p>\
         <form action=\"/inspect\"><label>Cluster ID <input name=\"clusterID\" size=\"50\"></label> \
         <button>Inspect</button></form>\
         <p><a href=\"/metrics\">metrics</a></p></body></html>",
        counts.clusters, counts.affiliates, counts.endpoints, counts.subscriptions
    ))
}

#[derive(serde::Deserialize)]
struct InspectQuery {
    #[serde(rename = "clusterID", default)]
    cluster_id: String,
}

async fn inspect(State(shared): State<Arc<Shared>>, Query(q): Query<InspectQuery>) -> Response {
    let info = shared.state().inspect(&q.cluster_id, Instant::now());
    let Some(info) = info else {
        return (
            StatusCode::NOT_FOUND,
            Html(format!(
                "<!doctype html><p>No cluster <code>{}</code>.</p>",
                escape(&q.cluster_id)
            )),
        )
            .into_response();
    };
    let mut html = format!(
        "<!doctype html><html><head><title>cluster</title></head><body>\
         <h1>Cluster <code>{}</code></h1><p>{} affiliates</p>\
         <table border=\"1\"><tr><th>affiliate ID</th><th>data bytes</th>\
         <th>endpoints</th><th>expires in (s)</th></tr>",
        escape(&q.cluster_id),
        info.len()
    );
    for a in &info {
        let _ = write!(
            html,
            "<tr><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&a.id),
            a.data_len,
            a.endpoints,
            a.expires_in_secs
        );
    }
    html.push_str("</table></body></html>");
    Html(html).into_response()
}

/// HTML-escapes client-chosen text (IDs).
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}
