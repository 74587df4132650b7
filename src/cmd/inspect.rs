//! `wirespan inspect …`: introspection of a running node.

use std::path::Path;

use wirespan_control::api::{client::connect, proto};

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

pub fn run(cmd: &Inspect, socket: &Path) -> anyhow::Result<()> {
    let Inspect::Dependencies {
        with_destroy_ready,
        with_resources,
    } = cmd;
    super::block_on(async {
        let mut client = connect(socket).await?;
        let resp = client
            .dependency_graph(proto::DependencyGraphRequest {
                with_destroy_ready: *with_destroy_ready,
                with_resources: *with_resources,
            })
            .await
            .map_err(|s| anyhow::anyhow!("{}", s.message()))?
            .into_inner();
        print!("{}", resp.dot);
        Ok(())
    })
}
