//! The resource API server.

use std::{
    os::unix::fs::{FileTypeExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime},
};

use tokio::{net::UnixListener, sync::mpsc};
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::{proto, resolve};
use crate::{
    config_loader::{self as loader, ConfigLoader},
    resources::meta,
    runtime::{
        graph::{to_dot, to_dot_with_resources, EdgeKind},
        AnyResource, Definition, Event, Filter, GraphSource, Kind, Pointer, Store, WatchOptions,
    },
};

/// The service implementation over a store (and the runtime's graph, if any).
#[derive(Debug, Clone)]
pub struct ResourceApi {
    store: Store,
    graph: Option<GraphSource>,
    config_apply: Option<ConfigApply>,
}

/// How `ApplyConfig` takes a config, and the config file it also rewrites.
#[derive(Debug, Clone)]
struct ConfigApply {
    loader: ConfigLoader,
    file: Option<PathBuf>,
}

impl ConfigApply {
    /// `ApplyConfig`'s work, blocking (parsing, the store, file writes).
    fn apply(&self, req: &proto::ApplyConfigRequest) -> Result<proto::ApplyConfigResponse, Status> {
        let rejected = |e: &loader::LoadError| proto::ApplyConfigResponse {
            changed: false,
            errors: e.problems(),
            accepted_version: self.loader.accepted_version(),
            documents: 0,
            trial_deadline: String::new(),
        };
        if req.dry_run {
            return Ok(match loader::validate(&req.config) {
                Ok(_) => proto::ApplyConfigResponse {
                    accepted_version: self.loader.accepted_version(),
                    ..Default::default()
                },
                Err(e) => rejected(&e),
            });
        }
        let base = Some(req.base_version.as_str()).filter(|b| !b.is_empty());
        let trial = req.mode == proto::ApplyMode::Try as i32;
        let res = if trial {
            let opts = trial_options(req)?;
            self.loader
                .accept_trial(&req.config, "api (trial)", opts, base, SystemTime::now())
        } else {
            self.loader
                .accept_based_on(&req.config, "api", base)
                .map(|a| (a, None))
        };
        let (accepted, deadline) = match res {
            Ok(a) => a,
            Err(e) => return Ok(rejected(&e)),
        };
        // A trial config is not written to the file: a restart must find the earlier
        // one there. Confirming writes it.
        if !trial {
            self.write_file(&req.config, &accepted.version)?;
        }
        Ok(proto::ApplyConfigResponse {
            changed: accepted.changed,
            errors: Vec::new(),
            accepted_version: accepted.version,
            documents: u32::try_from(accepted.documents).unwrap_or(u32::MAX),
            trial_deadline: deadline
                .map(|d| humantime::format_rfc3339_millis(d).to_string())
                .unwrap_or_default(),
        })
    }

    /// `ConfirmConfig`'s work, blocking.
    fn confirm(&self) -> Result<proto::ConfirmConfigResponse, Status> {
        let confirmed = self.loader.confirm().map_err(|e| match e {
            loader::LoadError::NoTrial => Status::failed_precondition(e.to_string()),
            e => Status::internal(e.to_string()),
        })?;
        self.write_file(&confirmed.config, &confirmed.version)?;
        Ok(proto::ConfirmConfigResponse {
            version: confirmed.version,
        })
    }

    /// Writes the accepted `config` to the node's config file, so that the file and
    /// the node agree.
    fn write_file(&self, config: &str, version: &str) -> Result<(), Status> {
        let Some(file) = &self.file else {
            return Ok(());
        };
        // Skipped when the file already holds it: no rewrite, no reload event.
        if std::fs::read(file).ok().as_deref() == Some(config.as_bytes()) {
            return Ok(());
        }
        crate::files::write_atomic(file, config.as_bytes()).map_err(|e| {
            Status::internal(format!(
                "config accepted (version {version}), but writing {} failed: {e}; the file still holds the previous config",
                file.display()
            ))
        })
    }
}

/// The trial options of an `ApplyConfig` in try mode.
fn trial_options(req: &proto::ApplyConfigRequest) -> Result<loader::TrialOptions, Status> {
    let timeout = match req.trial_timeout_ms {
        0 => loader::trial::DEFAULT_TIMEOUT,
        ms => Duration::from_millis(ms),
    };
    let probe = match req.rollback_unless_reachable.as_str() {
        "" => None,
        endpoint => {
            if endpoint.rsplit_once(':').is_none() {
                return Err(Status::invalid_argument(format!(
                    "rollback_unless_reachable {endpoint:?} is not host:port"
                )));
            }
            Some(loader::ReachabilityProbe {
                endpoint: endpoint.to_owned(),
                interval: loader::trial::PROBE_INTERVAL,
                timeout: loader::trial::PROBE_TIMEOUT,
                failure_threshold: match req.reachability_failure_threshold {
                    0 => loader::trial::DEFAULT_FAILURE_THRESHOLD,
                    n => n,
                },
            })
        }
    };
    Ok(loader::TrialOptions { timeout, probe })
}

impl ResourceApi {
    /// Serves `store`; `graph` feeds `DependencyGraph`.
    #[must_use]
    pub fn new(store: Store, graph: Option<GraphSource>) -> Self {
        Self {
            store,
            graph,
            config_apply: None,
        }
    }

    /// Enables `ApplyConfig` through `loader` (which persists accepted configs and
    /// records rejections); accepted configs are also written to `file` (atomically,
    /// 0600) so that the file and the node agree.
    #[must_use]
    pub fn with_config_apply(mut self, loader: ConfigLoader, file: Option<PathBuf>) -> Self {
        self.config_apply = Some(ConfigApply { loader, file });
        self
    }

    fn resolve(&self, name: &str) -> Result<Definition, Status> {
        let defs = meta::list(&self.store);
        resolve(&defs, name)
            .cloned()
            .map_err(|e| Status::not_found(e.to_string()))
    }
}

impl ResourceApi {
    /// `(type, namespace, id)` of every stored resource of the graph's types, in the
    /// namespaces its input edges name and the type's default one.
    fn graph_resources(
        &self,
        edges: &[crate::runtime::graph::Edge],
    ) -> Vec<(String, String, String)> {
        let mut kinds: Vec<(String, String)> = edges
            .iter()
            .filter(|e| !e.namespace.is_empty())
            .map(|e| (e.r#type.clone(), e.namespace.clone()))
            .collect();
        let defs = meta::list(&self.store);
        for e in edges {
            if let Ok(def) = resolve(&defs, &e.r#type) {
                kinds.push((e.r#type.clone(), def.default_namespace.clone()));
            }
        }
        kinds.sort();
        kinds.dedup();
        let mut out = Vec::new();
        for (ty, ns) in kinds {
            for r in self
                .store
                .list_dyn(&Kind::new(ns.clone(), ty.clone()), &Filter::all())
            {
                out.push((ty.clone(), ns.clone(), r.metadata().id.clone()));
            }
        }
        out
    }
}

fn namespace<'a>(requested: &'a str, def: &'a Definition) -> &'a str {
    if requested.is_empty() {
        &def.default_namespace
    } else {
        requested
    }
}

fn rfc3339(t: std::time::SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

/// Encodes a stored resource; sensitive specs only when explicitly asked for.
fn encode(
    r: &dyn AnyResource,
    def: &Definition,
    format: i32,
    include_sensitive: bool,
) -> Result<proto::Resource, Status> {
    let md = r.metadata();
    let redacted = def.sensitive && !include_sensitive;
    let spec = if redacted {
        String::new()
    } else if format == proto::SpecFormat::Json as i32 {
        r.spec_json()
            .map_err(|e| Status::internal(e.to_string()))?
            .to_string()
    } else {
        r.spec_yaml().map_err(|e| Status::internal(e.to_string()))?
    };
    Ok(proto::Resource {
        metadata: Some(proto::Metadata {
            namespace: md.namespace.clone(),
            r#type: md.r#type.clone(),
            id: md.id.clone(),
            version: md.version,
            owner: md.owner.clone(),
            phase: md.phase.as_str().to_owned(),
            finalizers: md.finalizers.to_vec(),
            labels: md.labels.clone().into_iter().collect(),
            annotations: md.annotations.clone().into_iter().collect(),
            created: rfc3339(md.created),
            updated: rfc3339(md.updated),
        }),
        spec,
        spec_redacted: redacted,
    })
}

type WatchStream = ReceiverStream<Result<proto::WatchResponse, Status>>;

#[tonic::async_trait]
impl proto::resource_service_server::ResourceService for ResourceApi {
    async fn get(
        &self,
        request: Request<proto::GetRequest>,
    ) -> Result<Response<proto::GetResponse>, Status> {
        let req = request.into_inner();
        let def = self.resolve(&req.r#type)?;
        let ptr = Pointer::new(namespace(&req.namespace, &def), def.r#type.clone(), req.id);
        let r = self
            .store
            .get_dyn(&ptr)
            .map_err(|e| Status::not_found(e.to_string()))?;
        Ok(Response::new(proto::GetResponse {
            resource: Some(encode(&*r, &def, req.format, req.include_sensitive)?),
            definition: Some((&def).into()),
        }))
    }

    async fn list(
        &self,
        request: Request<proto::ListRequest>,
    ) -> Result<Response<proto::ListResponse>, Status> {
        let req = request.into_inner();
        let def = self.resolve(&req.r#type)?;
        let kind = Kind::new(namespace(&req.namespace, &def), def.r#type.clone());
        let resources = self
            .store
            .list_dyn(&kind, &Filter::all())
            .iter()
            .map(|r| encode(&**r, &def, req.format, req.include_sensitive))
            .collect::<Result<_, _>>()?;
        Ok(Response::new(proto::ListResponse {
            definition: Some((&def).into()),
            resources,
        }))
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: Request<proto::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let req = request.into_inner();
        let def = self.resolve(&req.r#type)?;
        let kind = Kind::new(namespace(&req.namespace, &def), def.r#type.clone());
        let mut watch = if req.id.is_empty() {
            self.store.watch_kind(&kind, WatchOptions::bootstrapped())
        } else {
            self.store.watch(&kind.pointer(req.id.clone()))
        };
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            let mut first = Some(proto::Definition::from(&def));
            loop {
                let ev = tokio::select! {
                    () = tx.closed() => return,
                    ev = watch.recv() => ev,
                };
                let Some(ev) = ev else { return };
                let (event, res, error) = match &ev {
                    Event::Created(r) => (proto::EventType::Created, Some(r), String::new()),
                    Event::Updated { new, .. } => {
                        (proto::EventType::Updated, Some(new), String::new())
                    }
                    // A single-id watch starts with a tombstone when the id is absent.
                    Event::Destroyed(r) => (proto::EventType::Destroyed, Some(r), String::new()),
                    Event::Bootstrapped => (proto::EventType::Bootstrapped, None, String::new()),
                    Event::Errored(e) => (proto::EventType::Errored, None, e.to_string()),
                };
                let resource = match res {
                    Some(r) => match encode(&**r, &def, req.format, req.include_sensitive) {
                        Ok(r) => Some(r),
                        Err(s) => {
                            let _ = tx.send(Err(s)).await;
                            return;
                        }
                    },
                    None => None,
                };
                let msg = proto::WatchResponse {
                    event: event as i32,
                    resource,
                    error,
                    definition: first.take(),
                };
                if tx.send(Ok(msg)).await.is_err() || matches!(ev, Event::Errored(_)) {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn definitions(
        &self,
        _request: Request<proto::DefinitionsRequest>,
    ) -> Result<Response<proto::DefinitionsResponse>, Status> {
        Ok(Response::new(proto::DefinitionsResponse {
            definitions: meta::list(&self.store).iter().map(Into::into).collect(),
        }))
    }

    async fn apply_config(
        &self,
        request: Request<proto::ApplyConfigRequest>,
    ) -> Result<Response<proto::ApplyConfigResponse>, Status> {
        let Some(apply) = &self.config_apply else {
            return Err(Status::unimplemented("this server does not take configs"));
        };
        let apply = apply.clone();
        let req = request.into_inner();
        // Parsing a config is CPU work of up to a few MiB of YAML: on a blocking
        // thread, so the async workers keep serving every other call meanwhile.
        tokio::task::spawn_blocking(move || apply.apply(&req))
            .await
            .map_err(|e| Status::internal(format!("config apply task failed: {e}")))?
            .map(Response::new)
    }

    async fn confirm_config(
        &self,
        _request: Request<proto::ConfirmConfigRequest>,
    ) -> Result<Response<proto::ConfirmConfigResponse>, Status> {
        let Some(apply) = self.config_apply.clone() else {
            return Err(Status::unimplemented("this server does not take configs"));
        };
        tokio::task::spawn_blocking(move || apply.confirm())
            .await
            .map_err(|e| Status::internal(format!("config confirm task failed: {e}")))?
            .map(Response::new)
    }

    async fn get_config(
        &self,
        _request: Request<proto::GetConfigRequest>,
    ) -> Result<Response<proto::GetConfigResponse>, Status> {
        let Some(apply) = &self.config_apply else {
            return Err(Status::unimplemented("this server does not take configs"));
        };
        let loader = &apply.loader;
        Ok(Response::new(proto::GetConfigResponse {
            config: loader.in_force_text().unwrap_or_default(),
            version: loader.accepted_version(),
            trial_deadline: loader
                .trial()
                .map(|t| humantime::format_rfc3339_millis(t.deadline).to_string())
                .unwrap_or_default(),
        }))
    }

    async fn dependency_graph(
        &self,
        request: Request<proto::DependencyGraphRequest>,
    ) -> Result<Response<proto::DependencyGraphResponse>, Status> {
        let Some(graph) = &self.graph else {
            return Err(Status::unavailable("this server runs no controllers"));
        };
        let req = request.into_inner();
        let edges = graph.edges();
        let dot = if req.with_resources {
            to_dot_with_resources(
                &edges,
                req.with_destroy_ready,
                &self.graph_resources(&edges),
            )
        } else {
            to_dot(&edges, req.with_destroy_ready)
        };
        Ok(Response::new(proto::DependencyGraphResponse {
            dot,
            edges: edges
                .into_iter()
                .map(|e| proto::Edge {
                    controller: e.controller,
                    namespace: e.namespace,
                    r#type: e.r#type,
                    id: e.id.unwrap_or_default(),
                    kind: match e.kind {
                        EdgeKind::OutputExclusive => "OutputExclusive",
                        EdgeKind::OutputShared => "OutputShared",
                        EdgeKind::InputStrong => "InputStrong",
                        EdgeKind::InputWeak => "InputWeak",
                        EdgeKind::InputDestroyReady => "InputDestroyReady",
                    }
                    .to_owned(),
                })
                .collect(),
        }))
    }
}

/// Errors of serving the API.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Socket setup failed.
    #[error("API socket {path}: {source}")]
    Socket {
        /// The socket path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Another process serves on the socket.
    #[error("API socket {path} is in use by another process (is a node already running?)")]
    InUse {
        /// The socket path.
        path: PathBuf,
    },
    /// The gRPC server failed.
    #[error("API server: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// How long a socket that still accepts may take to go away before it counts as
/// another live node: a predecessor killed with SIGKILL keeps its listener open until
/// its last thread has exited, and a restart right after it must not fail on that.
const IN_USE_GRACE: std::time::Duration = std::time::Duration::from_secs(3);

/// Binds the socket: parent dir created 0700 if missing, a stale socket replaced,
/// mode 0600 (root only).
///
/// # Errors
/// I/O errors, or a socket at `path` that still accepts connections after 3 s.
pub fn bind(path: &Path) -> Result<UnixListener, ServeError> {
    bind_with_grace(path, IN_USE_GRACE)
}

fn bind_with_grace(path: &Path, grace: std::time::Duration) -> Result<UnixListener, ServeError> {
    let err = |source| ServeError::Socket {
        path: path.to_owned(),
        source,
    };
    crate::files::create_private_parent(path).map_err(err)?;
    if let Ok(md) = std::fs::symlink_metadata(path) {
        if !md.file_type().is_socket() {
            return Err(err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "exists and is not a socket",
            )));
        }
        let deadline = std::time::Instant::now() + grace;
        while std::os::unix::net::UnixStream::connect(path).is_ok() {
            if std::time::Instant::now() >= deadline {
                return Err(ServeError::InUse {
                    path: path.to_owned(),
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        std::fs::remove_file(path).map_err(err)?;
    }
    let listener = UnixListener::bind(path).map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    Ok(listener)
}

/// Serves the API on `listener` (bound at `path`) until `shutdown`, then removes the
/// socket file.
///
/// # Errors
/// Transport errors.
pub async fn serve(
    listener: UnixListener,
    path: &Path,
    api: ResourceApi,
    shutdown: CancellationToken,
) -> Result<(), ServeError> {
    let api = Arc::new(api);
    let res = tonic::transport::Server::builder()
        .add_service(
            proto::resource_service_server::ResourceServiceServer::from_arc(api)
                .max_decoding_message_size(super::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(super::MAX_MESSAGE_BYTES),
        )
        .serve_with_incoming_shutdown(
            UnixListenerStream::new(listener),
            shutdown.cancelled_owned(),
        )
        .await;
    let _ = std::fs::remove_file(path);
    res.map_err(Into::into)
}

#[cfg(test)]
mod tests {
    use proto::resource_service_server::ResourceService as _;

    use super::*;
    use crate::{config::MAX_CONFIG_BYTES, config_loader::version_of, runtime::StoreOptions};

    const GOOD: &str = "apiVersion: v1alpha1\nkind: LinkConfig\nname: eth0\nmtu: 1400\n";

    #[tokio::test]
    async fn a_socket_whose_owner_goes_away_within_the_grace_is_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.sock");
        let old = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let closer = {
            let closed = Arc::clone(&closed);
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(300));
                closed.store(true, std::sync::atomic::Ordering::SeqCst);
                drop(old);
            })
        };
        let listener = bind_with_grace(&path, std::time::Duration::from_secs(10));
        closer.join().unwrap();
        assert!(listener.is_ok(), "{:?}", listener.err());
        assert!(
            closed.load(std::sync::atomic::Ordering::SeqCst),
            "bound while the old listener still accepted"
        );
    }

    #[tokio::test]
    async fn a_socket_that_keeps_accepting_is_in_use() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.sock");
        let _live = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let err = bind_with_grace(&path, std::time::Duration::from_millis(200)).unwrap_err();
        assert!(matches!(err, ServeError::InUse { .. }), "{err}");
    }

    async fn apply(api: &ResourceApi, config: &str, dry_run: bool) -> proto::ApplyConfigResponse {
        api.apply_config(Request::new(proto::ApplyConfigRequest {
            config: config.to_owned(),
            dry_run,
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner()
    }

    #[tokio::test]
    async fn apply_reports_the_version_in_force_or_every_error() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.yaml");
        let store = Store::new(StoreOptions::default());
        let loader = ConfigLoader::in_state_dir(store.clone(), &dir.path().join("state"));
        let api = ResourceApi::new(store, None).with_config_apply(loader, Some(file.clone()));

        let r = apply(&api, GOOD, true).await;
        assert!(r.errors.is_empty() && !r.changed && r.accepted_version.is_empty());
        assert!(!file.exists(), "a dry run writes nothing");

        let r = apply(&api, GOOD, false).await;
        assert_eq!(
            (r.changed, r.accepted_version.as_str(), r.documents),
            (true, version_of(GOOD).as_str(), 1)
        );
        assert_eq!(std::fs::read_to_string(&file).unwrap(), GOOD);
        assert!(!apply(&api, GOOD, false).await.changed);

        let bad = format!(
            "{GOOD}---\napiVersion: v1alpha1\nkind: LinkConfig\nname: eth0\nmtu: 1\n---\nkind: X\n"
        );
        let r = apply(&api, &bad, false).await;
        assert!(!r.changed);
        assert_eq!(r.accepted_version, version_of(GOOD), "the kept version");
        assert_eq!(r.errors.len(), 2, "{:?}", r.errors);
        assert!(
            r.errors[0].starts_with("document 2 (LinkConfig \"eth0\"): mtu: 1 is outside"),
            "{:?}",
            r.errors
        );
        assert!(
            r.errors[1].starts_with("document 3 (X): apiVersion"),
            "{:?}",
            r.errors
        );
        assert_eq!(std::fs::read_to_string(&file).unwrap(), GOOD);

        let r = apply(&api, "", false).await;
        assert_eq!(
            r.errors,
            ["config file is empty; to turn the mesh off set enabled: false"]
        );
        let big = format!("{GOOD}#{}", "x".repeat(MAX_CONFIG_BYTES));
        let r = apply(&api, &big, true).await;
        assert_eq!(
            r.errors,
            [format!(
                "config is {} bytes, over the 4194304-byte (4 MiB) limit",
                big.len()
            )]
        );
    }

    #[tokio::test]
    async fn a_trial_leaves_the_file_alone_until_confirmed_and_get_config_shows_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.yaml");
        let store = Store::new(StoreOptions::default());
        let loader = ConfigLoader::in_state_dir(store.clone(), &dir.path().join("state"));
        let api = ResourceApi::new(store, None).with_config_apply(loader, Some(file.clone()));
        apply(&api, GOOD, false).await;
        let trial = GOOD.replace("1400", "1300");
        let try_req = |base: &str| proto::ApplyConfigRequest {
            config: trial.clone(),
            mode: proto::ApplyMode::Try as i32,
            trial_timeout_ms: 60_000,
            base_version: base.to_owned(),
            ..Default::default()
        };
        let stale = api
            .apply_config(Request::new(try_req("0123")))
            .await
            .unwrap()
            .into_inner();
        assert!(
            stale.errors[0].starts_with("the config in force is version"),
            "{:?}",
            stale.errors
        );
        let r = api
            .apply_config(Request::new(try_req(&version_of(GOOD))))
            .await
            .unwrap()
            .into_inner();
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        assert_eq!(r.accepted_version, version_of(&trial));
        assert!(r.trial_deadline.ends_with('Z'), "{}", r.trial_deadline);
        assert_eq!(std::fs::read_to_string(&file).unwrap(), GOOD);
        let got = api
            .get_config(Request::new(proto::GetConfigRequest {}))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (got.config.as_str(), got.version.as_str()),
            (trial.as_str(), version_of(&trial).as_str())
        );
        assert_eq!(got.trial_deadline, r.trial_deadline);

        let c = api
            .confirm_config(Request::new(proto::ConfirmConfigRequest {}))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(c.version, version_of(&trial));
        assert_eq!(std::fs::read_to_string(&file).unwrap(), trial);
        let again = api
            .confirm_config(Request::new(proto::ConfirmConfigRequest {}))
            .await
            .unwrap_err();
        assert_eq!(again.code(), tonic::Code::FailedPrecondition);
    }

    /// The one worker of a current-thread runtime runs the spawned apply as soon as
    /// this test yields: a parse on the worker would be finished by the time the test
    /// runs again; a parse on a blocking thread is still going.
    #[tokio::test(flavor = "current_thread")]
    async fn apply_parses_off_the_async_worker_and_lists_at_most_50_problems() {
        let store = Store::new(StoreOptions::default());
        let loader = ConfigLoader::new(store.clone(), None);
        let api = ResourceApi::new(store, None).with_config_apply(loader, None);
        let text = "apiVersion: v1alpha1\nkind: Bogus\n---\n".repeat(30_000);
        let task = tokio::spawn(async move { apply(&api, &text, true).await });
        tokio::task::yield_now().await;
        assert!(
            !task.is_finished(),
            "the config was parsed on the async worker"
        );
        let r = task.await.unwrap();
        assert_eq!(r.errors.len(), 51, "{:?}", &r.errors[..3]);
        assert_eq!(r.errors[50], "and 29950 more problems");
        let bytes: usize = r.errors.iter().map(String::len).sum();
        assert!(bytes < 16 * 1024, "{bytes} bytes of errors");
    }
}
