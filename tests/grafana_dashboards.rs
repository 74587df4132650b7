//! The Grafana dashboards in `deploy/grafana/` reference only metrics the binaries
//! export: both real binaries are scraped (`wirespan discovery --metrics-listen` on
//! loopback, `wirespan node --metrics-listen` inside a lab node's namespace), each
//! scrape is parsed as a Prometheus/OpenMetrics text exposition, and every metric
//! name in the dashboards' PromQL must be one of the scraped families' sample names.

mod common;

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use common::{discovery::Discovery, lab::Lab};
use serde_json::{json, Value};
use tonic::transport::Endpoint;
use wirespan_discovery::proto::server::{
    cluster_client::ClusterClient, AffiliateUpdateRequest, HelloRequest, WatchRequest,
};

const NODE_DASHBOARD: &str = include_str!("../deploy/grafana/wirespan-node.json");
const DISCOVERY_DASHBOARD: &str = include_str!("../deploy/grafana/wirespan-discovery.json");

// ---- the text exposition ----

/// A parsed scrape: family name → type, and every sample's name.
#[derive(Debug, Default)]
struct Exposition {
    families: BTreeMap<String, String>,
    samples: BTreeMap<String, usize>,
}

/// Sample-name suffixes a family of each type may have (OpenMetrics; `_created` is
/// optional).
fn suffixes(kind: &str) -> &'static [&'static str] {
    match kind {
        "counter" => &["_total", "_created"],
        "histogram" => &["_bucket", "_sum", "_count", "_created"],
        "gaugehistogram" => &["_bucket", "_gsum", "_gcount"],
        "summary" => &["", "_sum", "_count", "_created"],
        "info" => &["_info"],
        _ => &[""],
    }
}

impl Exposition {
    /// The family a sample or series name belongs to: `name` itself, or `name`
    /// without a suffix its family's type allows (so `x_bucket` is `x` only when `x`
    /// is a histogram, and a gauge called `y_count` stays `y_count`).
    fn family_of(&self, name: &str) -> Option<&str> {
        self.families.iter().find_map(|(fam, kind)| {
            suffixes(kind)
                .iter()
                .any(|s| name.strip_suffix(s) == Some(fam.as_str()))
                .then_some(fam.as_str())
        })
    }

    fn exports(&self, name: &str) -> bool {
        self.family_of(name).is_some()
    }
}

/// Parses a text exposition strictly enough that a malformed scrape fails: metadata
/// lines, sample lines with label sets and values, and `# EOF` last.
fn parse_exposition(text: &str) -> Result<Exposition, String> {
    let mut e = Exposition::default();
    let lines: Vec<&str> = text.lines().collect();
    if lines.last() != Some(&"# EOF") {
        return Err("the exposition does not end with `# EOF`".into());
    }
    for (i, line) in lines[..lines.len() - 1].iter().enumerate() {
        let at = |msg: String| format!("line {}: {msg}: {line:?}", i + 1);
        if let Some(meta) = line.strip_prefix("# ") {
            let mut parts = meta.splitn(3, ' ');
            let (what, name, rest) = (parts.next(), parts.next(), parts.next());
            let (Some(what), Some(name)) = (what, name) else {
                return Err(at("short metadata line".into()));
            };
            check_name(name).map_err(at)?;
            match what {
                "TYPE" => {
                    let kind = rest.unwrap_or("");
                    if !matches!(
                        kind,
                        "counter"
                            | "gauge"
                            | "histogram"
                            | "gaugehistogram"
                            | "summary"
                            | "info"
                            | "stateset"
                            | "unknown"
                    ) {
                        return Err(at(format!("unknown type {kind:?}")));
                    }
                    if e.families.insert(name.into(), kind.into()).is_some() {
                        return Err(at(format!("family {name} declared twice")));
                    }
                }
                "HELP" | "UNIT" => {}
                _ => return Err(at(format!("unknown metadata {what:?}"))),
            }
            continue;
        }
        let name_end = line.find(['{', ' ']).ok_or_else(|| at("no value".into()))?;
        let name = &line[..name_end];
        check_name(name).map_err(at)?;
        let mut rest = &line[name_end..];
        if rest.starts_with('{') {
            rest = parse_labels(rest).map_err(at)?;
        }
        let mut fields = rest.trim_start_matches(' ').split(' ');
        let value = fields.next().unwrap_or("");
        if !matches!(value, "+Inf" | "-Inf" | "NaN") && value.parse::<f64>().is_err() {
            return Err(at(format!("bad value {value:?}")));
        }
        if let Some(ts) = fields.next() {
            ts.parse::<f64>()
                .map_err(|_| at(format!("bad timestamp {ts:?}")))?;
        }
        if fields.next().is_some() {
            return Err(at("trailing fields".into()));
        }
        if e.family_of(name).is_none() {
            return Err(at(format!("sample {name} of no declared family")));
        }
        *e.samples.entry(name.into()).or_default() += 1;
    }
    Ok(e)
}

fn check_name(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
    if ok {
        Ok(())
    } else {
        Err(format!("bad metric name {name:?}"))
    }
}

/// Parses `{a="x",b="y"}` at the start of `s`; returns what follows.
fn parse_labels(s: &str) -> Result<&str, String> {
    let mut rest = &s[1..];
    loop {
        if let Some(r) = rest.strip_prefix('}') {
            return Ok(r);
        }
        let eq = rest.find('=').ok_or("label without `=`")?;
        check_name(&rest[..eq])?;
        rest = rest[eq + 1..]
            .strip_prefix('"')
            .ok_or("label value not quoted")?;
        let mut escaped = false;
        let close = rest
            .char_indices()
            .find(|&(_, c)| {
                let end = c == '"' && !escaped;
                escaped = c == '\\' && !escaped;
                end
            })
            .ok_or("unterminated label value")?
            .0;
        rest = &rest[close + 1..];
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
}

// ---- PromQL ----

/// Metric names referenced by a PromQL expression: identifiers that are not
/// functions, aggregations or keywords, outside strings, label matchers (`{…}`),
/// ranges (`[…]`) and grouping label lists (`by (…)`, `on (…)`, …).
fn metric_names(expr: &str) -> BTreeSet<String> {
    // Operators and the aggregations, which may be followed by `by (…)` instead of
    // their argument.
    const KEYWORDS: &[&str] = &[
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "inf",
        "nan",
        "Inf",
        "NaN",
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
    ];
    const GROUPING: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    let chars: Vec<char> = expr.chars().collect();
    let mut out = BTreeSet::new();
    let mut i = 0;
    // Skips from an opening bracket to just past its match, over strings.
    let skip_block = |mut i: usize, open: char, close: char| {
        let mut depth = 0;
        let mut quote: Option<char> = None;
        while i < chars.len() {
            let c = chars[i];
            match quote {
                Some(_) if c == '\\' => i += 1,
                Some(q) if c == q => quote = None,
                Some(_) => {}
                None if matches!(c, '"' | '\'' | '`') => quote = Some(c),
                None if c == open => depth += 1,
                None if c == close => {
                    depth -= 1;
                    if depth == 0 {
                        return i + 1;
                    }
                }
                None => {}
            }
            i += 1;
        }
        i
    };
    while i < chars.len() {
        let c = chars[i];
        match c {
            '{' => i = skip_block(i, '{', '}'),
            '[' => i = skip_block(i, '[', ']'),
            '"' | '\'' | '`' => {
                i += 1;
                while i < chars.len() && chars[i] != c {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
            }
            // A Grafana variable ($x, ${x}) or a number (0.99, 1e3, 0x1f).
            '$' | '0'..='9' | '.' => {
                i += 1;
                if chars.get(i) == Some(&'{') {
                    i = skip_block(i, '{', '}');
                }
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || "_.".contains(chars[i]))
                {
                    i += 1;
                }
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || "_:".contains(chars[i]))
                {
                    i += 1;
                }
                let ident: String = chars[start..i].iter().collect();
                let mut j = i;
                while j < chars.len() && chars[j].is_whitespace() {
                    j += 1;
                }
                let call = chars.get(j) == Some(&'(');
                if GROUPING.contains(&ident.as_str()) {
                    if call {
                        i = skip_block(j, '(', ')');
                    }
                } else if !call && !KEYWORDS.contains(&ident.as_str()) {
                    out.insert(ident);
                }
            }
            _ => i += 1,
        }
    }
    out
}

/// Every PromQL expression of a dashboard (panel targets, rows' nested panels) and
/// the metrics of its `label_values(metric, label)` variables.
fn dashboard_metrics(d: &Value) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    fn panels<'a>(ps: &'a [Value], acc: &mut Vec<&'a Value>) {
        for p in ps {
            acc.push(p);
            if let Some(inner) = p["panels"].as_array() {
                panels(inner, acc);
            }
        }
    }
    let mut all = Vec::new();
    panels(d["panels"].as_array().expect("panels"), &mut all);
    for p in all {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().expect("every target has an expr");
            for m in metric_names(expr) {
                out.entry(m)
                    .or_default()
                    .push(format!("panel {:?}", p["title"].as_str().unwrap_or("?")));
            }
        }
    }
    for v in d["templating"]["list"].as_array().into_iter().flatten() {
        let def = v["definition"].as_str().unwrap_or("");
        if let Some(arg) = def.strip_prefix("label_values(") {
            let metric = arg.split([',', '{', ')']).next().unwrap().trim();
            out.entry(metric.to_owned())
                .or_default()
                .push(format!("variable {:?}", v["name"].as_str().unwrap_or("?")));
        }
    }
    out
}

/// The dashboard's metric names the exposition does not export, with where each is used.
fn missing(d: &Value, e: &Exposition) -> Vec<String> {
    dashboard_metrics(d)
        .into_iter()
        .filter(|(m, _)| !e.exports(m))
        .map(|(m, used)| format!("{m} (in {})", used.join(", ")))
        .collect()
}

/// Checks the structure Grafana needs to import the dashboard with a data source of
/// the user's choice: a Prometheus `datasource` variable that every panel and query
/// uses, unique panel ids, a grid position for each panel.
fn check_structure(name: &str, d: &Value) {
    assert!(
        d["title"].is_string() && d["uid"].is_string(),
        "{name}: title, uid"
    );
    assert!(
        d["schemaVersion"].as_u64().unwrap() >= 30,
        "{name}: schemaVersion"
    );
    let vars = d["templating"]["list"].as_array().expect("templating");
    let ds = vars
        .iter()
        .find(|v| v["type"] == "datasource")
        .unwrap_or_else(|| panic!("{name}: no datasource variable"));
    assert_eq!(ds["query"], "prometheus", "{name}: datasource variable");
    let var = format!("${{{}}}", ds["name"].as_str().unwrap());
    let want = json!({"type": "prometheus", "uid": var});
    let mut ids = BTreeSet::new();
    let mut queries = 0;
    let mut stack: Vec<&Value> = d["panels"].as_array().unwrap().iter().collect();
    while let Some(p) = stack.pop() {
        let title = &p["title"];
        assert!(
            ids.insert(p["id"].as_u64().unwrap()),
            "{name}: duplicate id at {title}"
        );
        for k in ["h", "w", "x", "y"] {
            assert!(p["gridPos"][k].is_u64(), "{name}: {title} gridPos.{k}");
        }
        assert!(p["gridPos"]["x"].as_u64().unwrap() + p["gridPos"]["w"].as_u64().unwrap() <= 24);
        if p["type"] == "row" {
            stack.extend(p["panels"].as_array().into_iter().flatten());
            continue;
        }
        assert_eq!(p["datasource"], want, "{name}: {title} data source");
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{name}: {title} has no query");
        let mut refs = BTreeSet::new();
        for t in targets {
            assert_eq!(t["datasource"], want, "{name}: {title} query data source");
            assert!(
                refs.insert(t["refId"].as_str().unwrap()),
                "{name}: {title} refIds"
            );
            queries += 1;
        }
    }
    assert!(queries >= 10, "{name}: only {queries} queries");
}

// ---- the scrapes ----

fn scrape_discovery() -> (Discovery, String) {
    let server = Discovery::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let channel = Endpoint::from_shared(format!("http://{}", server.grpc))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut c = ClusterClient::new(channel);
        c.hello(HelloRequest {
            cluster_id: "c".into(),
            client_version: "v1.8.3".into(),
        })
        .await
        .unwrap();
        c.affiliate_update(AffiliateUpdateRequest {
            cluster_id: "c".into(),
            affiliate_id: "a".into(),
            affiliate_data: Some(b"d".to_vec()),
            affiliate_endpoints: vec![b"e".to_vec()],
            ttl: Some(prost_types::Duration {
                seconds: 60,
                nanos: 0,
            }),
        })
        .await
        .unwrap();
        let mut w = c
            .watch(WatchRequest {
                cluster_id: "c".into(),
            })
            .await
            .unwrap()
            .into_inner();
        w.message().await.unwrap().unwrap();
    });
    let (status, text) = server.get("/metrics");
    assert_eq!(status, 200, "{text}");
    (server, text)
}

/// A 2-node lab; node1's `/metrics` once its peer is up.
fn scrape_node(lab: &Lab) -> String {
    lab.ok(&["up", "--nodes", "2", "--timeout", "45s", "--no-hints"]);
    let st = lab.status();
    let addr = st["nodes"][0]["metricsAddress"]
        .as_str()
        .expect("lab status names the node's metrics address")
        .to_owned();
    let url = format!("http://{addr}/metrics");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let o = lab.exec("node1", &["curl", "-sSf", "--max-time", "5", &url]);
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        if o.status.success() && text.contains("wirespan_kubespan_peers{state=\"up\"} 1\n") {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "node1's metrics never showed its peer up: {}\n{text}\n{}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn dashboards_reference_only_metrics_the_binaries_export() {
    let node_dash: Value = serde_json::from_str(NODE_DASHBOARD).expect("node dashboard JSON");
    let disco_dash: Value =
        serde_json::from_str(DISCOVERY_DASHBOARD).expect("discovery dashboard JSON");
    check_structure("wirespan-node.json", &node_dash);
    check_structure("wirespan-discovery.json", &disco_dash);

    let (_server, text) = scrape_discovery();
    let disco = parse_exposition(&text).unwrap_or_else(|e| panic!("discovery scrape: {e}\n{text}"));
    assert_eq!(
        disco.samples.get("discovery_state_clusters"),
        Some(&1),
        "{text}"
    );
    assert!(text.contains("discovery_state_subscriptions 1\n"), "{text}");
    assert!(
        text.contains(
            "discovery_storage_operations_total{operation=\"save\",status=\"error\"} 0\n"
        ),
        "counters start at zero: {text}"
    );

    let lab = Lab::new();
    let text = scrape_node(&lab);
    let node = parse_exposition(&text).unwrap_or_else(|e| panic!("node scrape: {e}\n{text}"));
    for line in [
        "wirespan_kubespan_fast_path{fast_path=\"nftables\"} 1\n",
        "wirespan_config_last_attempt_accepted 1\n",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    assert!(
        node.samples
            .contains_key("wirespan_controller_reconcile_seconds_bucket"),
        "{text}"
    );
    assert!(
        node.samples
            .contains_key("wirespan_controller_restarts_total"),
        "counters start at zero: {text}"
    );

    let node_missing = missing(&node_dash, &node);
    let disco_missing = missing(&disco_dash, &disco);
    assert!(
        node_missing.is_empty() && disco_missing.is_empty(),
        "metrics the dashboards use but the binaries do not export:\n\
         wirespan-node.json: {node_missing:#?}\nwirespan-discovery.json: {disco_missing:#?}"
    );
    // Each dashboard uses a good share of what its binary exports.
    assert!(dashboard_metrics(&node_dash).len() >= 12);
    assert!(dashboard_metrics(&disco_dash).len() >= 10);

    // The check itself: a bogus name, a histogram suffix on a gauge, and a counter
    // without its `_total` are all named.
    let mut bad = node_dash;
    bad["panels"][1]["targets"]
        .as_array_mut()
        .unwrap()
        .push(json!({
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "refId": "Z",
            "expr": "rate(wirespan_bogus_total[5m]) + on(instance) wirespan_kubespan_peers_bucket \
                     + wirespan_controller_restarts",
        }));
    let named = missing(&bad, &node);
    assert_eq!(named.len(), 3, "{named:#?}");
    for m in [
        "wirespan_bogus_total",
        "wirespan_kubespan_peers_bucket",
        "wirespan_controller_restarts ",
    ] {
        assert!(
            named.iter().any(|n| n.starts_with(m)),
            "{m} not named: {named:#?}"
        );
    }
}

#[test]
fn promql_metric_names_skip_functions_labels_and_variables() {
    let got = metric_names(
        "histogram_quantile(0.99, sum by (le, controller) (rate(foo_seconds_bucket{a=\"b{\", \
         c=~\"$x\"}[$__rate_interval]))) / on(instance) group_left(version) bar:rec offset 5m \
         and count(baz == 1) or vector(0) > bool 1e3 unless sum(qux) without (job) + sum by (x) (quux)",
    );
    let want: BTreeSet<String> = ["foo_seconds_bucket", "bar:rec", "baz", "qux", "quux"]
        .map(String::from)
        .into();
    assert_eq!(got, want);
}

#[test]
fn the_exposition_parser_rejects_malformed_scrapes() {
    let good = "# HELP x_seconds h\n# TYPE x_seconds histogram\n\
                x_seconds_bucket{le=\"+Inf\",m=\"a\\\"b\"} 1\nx_seconds_sum 0.5\nx_seconds_count 1\n\
                # TYPE y_count gauge\ny_count 3\n# EOF\n";
    let e = parse_exposition(good).unwrap();
    assert!(e.exports("x_seconds_bucket") && e.exports("x_seconds_count"));
    assert!(
        e.exports("y_count") && !e.exports("y"),
        "a gauge keeps its suffix"
    );
    assert!(!e.exports("x_seconds") && !e.exports("x_seconds_total"));
    for bad in [
        good.replace("# EOF\n", ""),
        good.replace("y_count 3", "y_count three"),
        good.replace("y_count 3", "z 3"),
        good.replace("le=\"+Inf\"", "le=+Inf"),
        good.replace("gauge", "gauges"),
    ] {
        assert!(parse_exposition(&bad).is_err(), "accepted:\n{bad}");
    }
}
