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

use super::shared::Shared;

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

/// Inline style of every page: no external resources, so the pages work offline and
/// behind any proxy.
const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:2em auto;max-width:60em;\
padding:0 1em;color:#222}h1{font-size:1.5em}code{background:#f3f3f3;padding:0 .2em}\
table{border-collapse:collapse}th,td{border:1px solid #ccc;padding:.3em .6em;text-align:left}\
th{background:#f3f3f3}tr.affiliate td+td{text-align:right}.stats td{text-align:right}\
footer{margin-top:2em;color:#666;font-size:.9em}";

/// One HTML page around `body`; `title` is already escaped.
fn page(title: &str, body: &str) -> String {
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width\">\
         <title>{title}</title><style>{STYLE}</style></head><body>{body}\
         <footer><a href=\"/\">home</a> · <a href=\"/metrics\">metrics</a></footer>\
         </body></html>"
    )
}

async fn landing(State(shared): State<Arc<Shared>>) -> Html<String> {
    let counts = shared.state().counts();
    // Counts only: cluster IDs are not listed, since knowing one is what lets a client
    // read (encrypted) affiliate data from the service.
    Html(page(
        "wirespan discovery",
        &format!(
            "<h1>wirespan discovery service</h1>\
             <p>Compatible with the <code>sidero.discovery.server.Cluster</code> gRPC API.</p>\
             <table class=\"stats\"><tr><th>clusters</th><td id=\"clusters\">{c}</td></tr>\
             <tr><th>affiliates</th><td id=\"affiliates\">{a}</td></tr>\
             <tr><th>endpoints</th><td id=\"endpoints\">{e}</td></tr>\
             <tr><th>watchers</th><td id=\"watchers\">{w}</td></tr></table>\
             <h2>Inspect a cluster</h2>\
             <form action=\"/inspect\"><label>Cluster ID \
             <input name=\"clusterID\" size=\"50\"></label> <button>Inspect</button></form>",
            c = counts.clusters,
            a = counts.affiliates,
            e = counts.endpoints,
            w = counts.subscriptions
        ),
    ))
}

#[derive(serde::Deserialize)]
struct InspectQuery {
    #[serde(rename = "clusterID", default)]
    cluster_id: String,
}

async fn inspect(State(shared): State<Arc<Shared>>, Query(q): Query<InspectQuery>) -> Response {
    let info = shared.state().inspect(&q.cluster_id, Instant::now());
    let id = escape(&q.cluster_id);
    let Some(info) = info else {
        return (
            StatusCode::NOT_FOUND,
            Html(page(
                "no such cluster",
                &format!(
                    "<h1>No cluster <code>{id}</code></h1><p>No affiliate of it is known here.</p>"
                ),
            )),
        )
            .into_response();
    };
    // IDs, sizes and expiry only: affiliate data and endpoints are the cluster's
    // encrypted blobs and are never shown.
    let mut body = format!(
        "<h1>Cluster <code id=\"cluster-id\">{id}</code></h1><p id=\"summary\">{} affiliates</p>\
         <table><tr><th>affiliate ID</th><th>data bytes</th>\
         <th>endpoints</th><th>expires in (s)</th></tr>",
        info.len()
    );
    for a in &info {
        let _ = write!(
            body,
            "<tr class=\"affiliate\"><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&a.id),
            a.data_len,
            a.endpoints,
            a.expires_in_secs
        );
    }
    body.push_str("</table>");
    Html(page(&format!("cluster {id}"), &body)).into_response()
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
