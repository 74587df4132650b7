//! One module per subcommand.

pub mod apply;
pub mod bench;
pub mod completions;
pub mod discovery;
pub mod docs;
pub mod doctor;
pub mod fleet;
pub mod gen;
pub mod get;
pub mod inspect;
pub mod install;
pub mod lab;
pub mod man;
pub mod node;
pub mod patch;
pub mod status;
pub mod wireguard;

/// Runs a CLI future on a small current-thread runtime.
pub fn block_on<T>(f: impl std::future::Future<Output = anyhow::Result<T>>) -> anyhow::Result<T> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(f)
}
