//! `wirespan inspect …`: introspection of a running node.

use std::path::Path;

use wirespan_control::api::{client::ApiClient, proto};

use super::fleet::FleetArgs;

/// What to inspect.
#[derive(Debug, clap::Subcommand)]
pub enum Inspect {
    /// Print the controller–resource dependency graph as Graphviz DOT.
    Dependencies {
        /// Also draw DestroyReady inputs.
        #[arg(long)]
        with_destroy_ready: bool,
        /// Also draw every resource of each type, linked to its type.
        #[arg(long)]
        with_resources: bool,
    },
}

pub fn run(cmd: &Inspect, fleet: &FleetArgs, socket: Option<&Path>) -> anyhow::Result<()> {
    let Inspect::Dependencies {
        with_destroy_ready,
        with_resources,
    } = cmd;
    let (with_destroy_ready, with_resources) = (*with_destroy_ready, *with_resources);
    super::block_on(async {
        let targets = super::fleet::targets(fleet, socket).await?;
        let results = super::fleet::each(&targets, |mut client: ApiClient| async move {
            Ok(client
                .dependency_graph(proto::DependencyGraphRequest {
                    with_destroy_ready,
                    with_resources,
                })
                .await
                .map_err(|s| anyhow::anyhow!("{}", s.message()))?
                .into_inner()
                .dot)
        })
        .await;
        let (ok, failed) = super::fleet::split(results)?;
        for (node, dot) in ok {
            if let Some(n) = node {
                // A DOT comment: each node's graph stays a valid document.
                println!("// node: {n}");
            }
            print!("{dot}");
        }
        failed.into_result()
    })
}
