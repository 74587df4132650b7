//! `wirespan status`: one screen on a running node, read from its resource API — mesh
//! on/off, fast path, WireGuard backend, peers up/total, discovery services, config in
//! force and its last error, probes. A resource kind the node does not have shows as
//! "n/a" (an older node, or a kind that does not exist yet).
//!
//! [`fetch`] reads the resources; [`lines`] turns them into the screen without I/O.

use std::{collections::BTreeMap, fmt::Write as _, path::Path};

use serde_json::Value;
use tonic::Code;
use wirespan_control::{
    api::{client::ApiClient, proto},
    resources::{
        cluster::DiscoveryServiceStatus,
        config::MachineConfig,
        identity::NodeIdentity,
        kubespan::{KubeSpanConfig, KubeSpanIdentity, KubeSpanManagerStatus, KubeSpanPeerStatus},
        network::{LinkStatus, ProbeStatus},
    },
    runtime::ResourceKind,
};
use wirespan_discovery::text::escape_terminal;

use super::fleet::FleetArgs;

/// The config's status kind; looked up by name, so that a node without it shows "n/a".
const CONFIG_STATUS: &str = "ConfigStatus";

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Aligned `label  value` lines.
    Text,
    /// One JSON object, label → value.
    Json,
}

/// Options of `wirespan status`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Format::Text)]
    pub output: Format,
}

/// One resource as the API returned it.
#[derive(Debug, Clone, Default)]
pub struct Res {
    /// Resource id.
    pub id: String,
    /// Resource version.
    pub version: u64,
    /// Spec (JSON; `Null` when redacted).
    pub spec: Value,
}

/// The resources of one kind, or `None` when the node has no such kind.
pub type Kind = Option<Vec<Res>>;

/// Everything the screen is made from.
#[derive(Debug, Clone, Default)]
pub struct Facts {
    pub node_identity: Kind,
    pub kubespan_config: Kind,
    pub kubespan_identity: Kind,
    pub manager: Kind,
    pub links: Kind,
    pub peers: Kind,
    pub discovery: Kind,
    pub machine_config: Kind,
    pub config_status: Kind,
    pub probes: Kind,
}

const NA: &str = "n/a";

fn text<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or("")
}

/// "a, b, c" of the first `max` names, "…" after.
fn names(all: &[String], max: usize) -> String {
    let mut s = all.iter().take(max).cloned().collect::<Vec<_>>().join(", ");
    if all.len() > max {
        let _ = write!(s, ", … ({} more)", all.len() - max);
    }
    s
}

fn mesh(f: &Facts) -> (String, Option<&Value>) {
    let Some(cfgs) = &f.kubespan_config else {
        return (NA.into(), None);
    };
    let Some(cfg) = cfgs.first().map(|r| &r.spec["config"]) else {
        return ("off (no KubeSpanConfig document)".into(), None);
    };
    if cfg["enabled"] != Value::Bool(true) {
        return ("off (enabled: false)".into(), None);
    }
    let mut s = format!("on, link {}", text(cfg, "linkName"));
    if let Some(addr) = f
        .kubespan_identity
        .iter()
        .flatten()
        .next()
        .map(|r| text(&r.spec, "address"))
        .filter(|a| !a.is_empty())
    {
        let _ = write!(s, ", address {addr}");
    }
    (s, Some(cfg))
}

fn fast_path(f: &Facts, cfg: Option<&Value>) -> String {
    let Some(cfg) = cfg else {
        return if f.kubespan_config.is_none() {
            NA.into()
        } else {
            "- (mesh off)".into()
        };
    };
    let configured = text(cfg, "fastPath");
    match f.manager.as_ref().map(|m| m.first()) {
        None => NA.into(),
        Some(None) => format!("{configured} (configured; not programmed yet)"),
        Some(Some(m)) => {
            let in_use = text(&m.spec, "fastPath");
            let note = text(&m.spec, "note");
            if note.is_empty() {
                in_use.to_owned()
            } else {
                format!("{in_use} (configured {configured}: {note})")
            }
        }
    }
}

fn wireguard(f: &Facts, cfg: Option<&Value>) -> String {
    let Some(cfg) = cfg else {
        return if f.kubespan_config.is_none() {
            NA.into()
        } else {
            "- (mesh off)".into()
        };
    };
    let link = text(cfg, "linkName");
    let Some(links) = &f.links else {
        return NA.into();
    };
    let Some(l) = links.iter().find(|r| text(&r.spec, "name") == link) else {
        return format!("- (no link {link} yet)");
    };
    let port = cfg.get("listenPort").and_then(Value::as_u64);
    // The manager says which implementation it runs; the link's kind is the fallback
    // (a daemon that has not written it yet, or an older one).
    let reported = f
        .manager
        .iter()
        .flatten()
        .next()
        .map_or("", |m| text(&m.spec, "wireguard"));
    let backend = match (reported, text(&l.spec, "kind")) {
        ("kernel", _) | ("", "wireguard") => "kernel".to_owned(),
        ("userspace", _) => "userspace (wirespan wireguard)".to_owned(),
        ("userspace-go", _) => "userspace-go (wireguard-go)".to_owned(),
        ("", "tun") => "userspace".to_owned(),
        ("", other) => format!("unknown (link kind {other:?})"),
        (other, _) => other.to_owned(),
    };
    match port {
        Some(p) => format!("{backend}, {link} on UDP {p}"),
        None => backend,
    }
}

fn peers(f: &Facts) -> String {
    let Some(peers) = &f.peers else {
        return NA.into();
    };
    if peers.is_empty() {
        return "0".into();
    }
    let label = |r: &Res| {
        let l = text(&r.spec, "label");
        if l.is_empty() {
            r.id.clone()
        } else {
            l.to_owned()
        }
    };
    let not_up: Vec<String> = peers
        .iter()
        .filter(|r| text(&r.spec, "state") != "up")
        .map(|r| format!("{} {}", label(r), text(&r.spec, "state")))
        .collect();
    let up = peers.len() - not_up.len();
    let mut s = format!("{up}/{} up", peers.len());
    if !not_up.is_empty() {
        let _ = write!(s, " (not up: {})", names(&not_up, 5));
    }
    s
}

fn discovery(f: &Facts) -> String {
    let Some(services) = &f.discovery else {
        return NA.into();
    };
    if services.is_empty() {
        return "none configured".into();
    }
    let connected = services
        .iter()
        .filter(|r| r.spec["connected"] == Value::Bool(true))
        .count();
    let mut s = format!("{connected}/{} connected", services.len());
    let trouble: Vec<String> = services
        .iter()
        .filter(|r| r.spec["connected"] != Value::Bool(true))
        .map(|r| match r.spec.get("lastError").and_then(Value::as_str) {
            Some(e) => format!("{}: {e}", r.id),
            None => format!("{}: {}", r.id, text(&r.spec, "connection")),
        })
        .collect();
    if !trouble.is_empty() {
        let _ = write!(s, " ({})", names(&trouble, 3));
    }
    let affiliates: u64 = services
        .iter()
        .filter_map(|r| r.spec.get("affiliateCount").and_then(Value::as_u64))
        .max()
        .unwrap_or(0);
    let _ = write!(s, ", {affiliates} affiliates");
    s
}

fn config(f: &Facts) -> String {
    // The config's version is the hash in ConfigStatus (what `get configstatus` and
    // `apply` print); the resource version is only a fallback for nodes without it.
    let hash = f
        .config_status
        .as_ref()
        .and_then(|v| v.first())
        .and_then(|r| r.spec.get("acceptedVersion"))
        .and_then(Value::as_str)
        .filter(|h| !h.is_empty());
    let accepted = match &f.machine_config {
        None => NA.into(),
        Some(v) => match (v.first(), hash) {
            (None, _) => "none (no config loaded)".to_owned(),
            (Some(_), Some(h)) => format!("accepted version {h}"),
            (Some(r), None) => format!("accepted version {}", r.version),
        },
    };
    // ConfigStatus (when the node has it) names the last rejected config's error.
    let last_error = match f.config_status.as_ref().map(|v| v.first()) {
        None => NA.to_owned(),
        Some(None) => "none".to_owned(),
        Some(Some(r)) => match r.spec.get("lastError") {
            None | Some(Value::Null) => "none".to_owned(),
            Some(Value::String(e)) if e.is_empty() => "none".to_owned(),
            Some(Value::String(e)) => e.clone(),
            Some(other) => other.to_string(),
        },
    };
    format!("{accepted}{}; last error: {last_error}", trial(f))
}

/// The trial in progress (`apply --mode try`), or how the latest one ended.
fn trial(f: &Facts) -> String {
    let Some(st) = f
        .config_status
        .as_ref()
        .and_then(|v| v.first())
        .map(|r| &r.spec)
    else {
        return String::new();
    };
    match (text(st, "trialDeadline"), text(st, "lastTrial")) {
        ("", "") => String::new(),
        ("", last) => format!("; last trial: {last}"),
        (deadline, _) => format!(
            ", ON TRIAL until {deadline} (then back to {} unless `wirespan apply --confirm`)",
            text(st, "trialPreviousVersion")
        ),
    }
}

fn probes(f: &Facts) -> String {
    let Some(probes) = &f.probes else {
        return NA.into();
    };
    if probes.is_empty() {
        return "none configured".into();
    }
    let failing: Vec<String> = probes
        .iter()
        .filter(|r| r.spec["success"] != Value::Bool(true))
        .map(|r| match text(&r.spec, "lastError") {
            "" => r.id.clone(),
            e => format!("{}: {e}", r.id),
        })
        .collect();
    let mut s = format!("{}/{} ok", probes.len() - failing.len(), probes.len());
    if !failing.is_empty() {
        let _ = write!(s, " (failing: {})", names(&failing, 3));
    }
    s
}

/// The screen, as `(label, value)` lines.
#[must_use]
pub fn lines(f: &Facts) -> Vec<(&'static str, String)> {
    let node = match f.node_identity.as_ref().map(|v| v.first()) {
        None => NA.to_owned(),
        Some(None) => "- (no identity yet)".to_owned(),
        Some(Some(r)) => text(&r.spec, "nodeId").to_owned(),
    };
    let (mesh, cfg) = mesh(f);
    vec![
        ("node", node),
        ("mesh", mesh),
        ("fast path", fast_path(f, cfg)),
        ("wireguard", wireguard(f, cfg)),
        ("peers", peers(f)),
        ("discovery", discovery(f)),
        ("config", config(f)),
        ("probes", probes(f)),
    ]
}

/// `label  value` lines, labels padded to one width.
#[must_use]
pub fn render_text(lines: &[(&str, String)]) -> String {
    let w = lines.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    let mut out = String::new();
    for (k, v) in lines {
        // Values hold names other nodes chose: an escape sequence is printed as text.
        let _ = writeln!(out, "{k:w$}  {}", escape_terminal(v));
    }
    out
}

/// All resources of `ty` (default namespace), `None` when the node has no such kind.
async fn fetch_kind(client: &mut ApiClient, ty: &str) -> anyhow::Result<Kind> {
    let resp = match client
        .list(proto::ListRequest {
            r#type: ty.to_owned(),
            namespace: String::new(),
            format: proto::SpecFormat::Json as i32,
            include_sensitive: false,
        })
        .await
    {
        Ok(r) => r.into_inner(),
        Err(s) if s.code() == Code::NotFound => return Ok(None),
        Err(s) => anyhow::bail!("listing {ty}: {}", s.message()),
    };
    let mut out = Vec::new();
    for r in resp.resources {
        let md = r.metadata.unwrap_or_default();
        let spec = if r.spec_redacted || r.spec.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&r.spec)?
        };
        out.push(Res {
            id: md.id,
            version: md.version,
            spec,
        });
    }
    Ok(Some(out))
}

/// Reads every kind the screen needs through `c`.
///
/// # Errors
/// A list failed for another reason than an unknown kind.
pub async fn fetch_from(mut c: ApiClient) -> anyhow::Result<Facts> {
    Ok(Facts {
        node_identity: fetch_kind(&mut c, NodeIdentity::TYPE).await?,
        kubespan_config: fetch_kind(&mut c, KubeSpanConfig::TYPE).await?,
        kubespan_identity: fetch_kind(&mut c, KubeSpanIdentity::TYPE).await?,
        manager: fetch_kind(&mut c, KubeSpanManagerStatus::TYPE).await?,
        links: fetch_kind(&mut c, LinkStatus::TYPE).await?,
        peers: fetch_kind(&mut c, KubeSpanPeerStatus::TYPE).await?,
        discovery: fetch_kind(&mut c, DiscoveryServiceStatus::TYPE).await?,
        machine_config: fetch_kind(&mut c, MachineConfig::TYPE).await?,
        config_status: fetch_kind(&mut c, CONFIG_STATUS).await?,
        probes: fetch_kind(&mut c, ProbeStatus::TYPE).await?,
    })
}

pub fn run(args: &Args, fleet: &FleetArgs, socket: Option<&Path>) -> anyhow::Result<()> {
    let (ok, failed) = super::block_on(async {
        let targets = super::fleet::targets(fleet, socket).await?;
        super::fleet::split(super::fleet::each(&targets, fetch_from).await)
    })?;
    let mut json = BTreeMap::new();
    for (node, facts) in &ok {
        let lines = lines(facts);
        match args.output {
            Format::Text => {
                if let Some(n) = node {
                    println!("NODE  {}", escape_terminal(n));
                }
                print!("{}", render_text(&lines));
            }
            Format::Json => {
                let m: BTreeMap<&str, &String> = lines.iter().map(|(k, v)| (*k, v)).collect();
                json.insert(node.clone().unwrap_or_default(), serde_json::to_value(m)?);
            }
        }
    }
    if args.output == Format::Json {
        // One node asked: its object as before; several: node → object.
        let doc = if ok.len() == 1 && failed.total() == 1 {
            json.into_values().next().unwrap_or_default()
        } else {
            serde_json::to_value(json)?
        };
        let text = serde_json::to_string_pretty(&doc)?;
        println!(
            "{}",
            super::get::escape_document(&text, super::get::Format::Json)
        );
    }
    failed.into_result()
}

#[cfg(test)]
mod tests;
