//! The `wirespan` binary: mesh daemon, discovery server and operator CLI in one.

mod cmd;
mod notify;

use clap::{CommandFactory as _, Parser, Subcommand};

/// `--version`: the package version and the git commit it was built from.
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("WIRESPAN_GIT_COMMIT"),
    ")"
);

/// WireGuard mesh daemon, discovery server and operator CLI.
#[derive(Debug, Parser)]
#[command(name = "wirespan", version = VERSION, about, propagate_version = true)]
struct Cli {
    /// Log filter (tracing EnvFilter syntax), e.g. `info` or `wirespan_control=debug`.
    /// Default: `info` for the daemons, `warn` for the CLI and benchmarks.
    #[arg(long, global = true, env = "WIRESPAN_LOG")]
    log: Option<String>,

    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,

    /// Path of the node's API socket [default: /run/wirespan/node.sock]. Given
    /// explicitly, it wins over a client config (not over -e/-n/--context).
    #[arg(long, global = true, env = "WIRESPAN_SOCKET")]
    socket: Option<std::path::PathBuf>,

    /// Remote API flags: `wirespan -n node2,node3 get peers`.
    #[command(flatten)]
    fleet: cmd::fleet::FleetArgs,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the discovery server.
    Discovery(Box<cmd::discovery::Args>),
    /// Run the mesh daemon.
    Node(cmd::node::Args),
    /// Run a userspace WireGuard device (a drop-in for wireguard-go).
    Wireguard(cmd::wireguard::Args),
    /// Replace a running node's config (validated whole; rejected configs change nothing;
    /// `--mode try` rolls back unless `apply --confirm` follows in time).
    Apply(cmd::apply::Args),
    /// Change a running node's config by a strategic merge of documents (by kind and
    /// name; `$patch: delete` removes one), validated whole, with a diff.
    Patch(cmd::patch::PatchArgs),
    /// Edit a running node's config in force in `$EDITOR`; validated whole, with a diff.
    Edit(cmd::patch::EditArgs),
    /// Show resources of a running node (`wirespan get rd`, `wirespan get nodeidentity -o yaml`).
    Get(cmd::get::Args),
    /// Watch resources of a running node (shorthand for `get --watch`).
    Watch(cmd::get::Args),
    /// Inspect a running node.
    #[command(subcommand)]
    Inspect(cmd::inspect::Inspect),
    /// The client config (`~/.wirespan/config`): contexts, use-context, add, merge.
    #[command(subcommand)]
    Config(cmd::fleet::ConfigCmd),
    /// Generate cluster secrets, WireGuard keys and node IDs.
    #[command(subcommand)]
    Gen(cmd::gen::Gen),
    /// Run benchmarks.
    #[command(subcommand)]
    Bench(cmd::bench::Bench),
    /// A local mesh of namespaced nodes: up, status, exec, down.
    Lab(cmd::lab::Args),
    /// One screen on a running node: mesh, fast path, WireGuard, peers, discovery,
    /// config, probes.
    Status(cmd::status::Args),
    /// Check this host's prerequisites for `wirespan node` (exit status 1 on a failure).
    Doctor(cmd::doctor::Args),
    /// Install wirespan into the system.
    #[command(subcommand)]
    Install(cmd::install::Install),
    /// Print a shell completion script (`source <(wirespan completions bash)`).
    Completions(cmd::completions::Args),
    /// Write man pages for every command.
    Man(cmd::man::Args),
    /// Print documentation generated from the code (`wirespan docs config`).
    #[command(subcommand)]
    Docs(cmd::docs::Docs),
}

fn init_tracing(cli: &Cli) -> anyhow::Result<()> {
    let default = match cli.command {
        Command::Discovery(_) | Command::Node(_) | Command::Wireguard(_) => "info",
        // Reports and tables on stdout; only trouble on stderr.
        _ => "warn",
    };
    let text = cli.log.as_deref().unwrap_or(default);
    let filter = tracing_subscriber::EnvFilter::try_new(text)
        .map_err(|e| anyhow::anyhow!("--log {text:?} is not a valid log filter: {e}"))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
    Ok(())
}

fn run(cli: Cli) -> anyhow::Result<()> {
    init_tracing(&cli)?;
    let socket = cli.socket.as_deref();
    let fleet = &cli.fleet;
    match cli.command {
        Command::Discovery(args) => cmd::discovery::run(*args),
        Command::Bench(bench) => cmd::bench::run(&bench),
        Command::Gen(g) => cmd::gen::run(&g),
        Command::Node(args) => cmd::node::run(
            &args,
            socket.unwrap_or(std::path::Path::new(wirespan_control::api::DEFAULT_SOCKET)),
        ),
        Command::Wireguard(args) => cmd::wireguard::run(&args),
        Command::Apply(args) => cmd::apply::run(&args, fleet, socket),
        Command::Patch(args) => cmd::patch::run_patch(&args, fleet, socket),
        Command::Edit(args) => cmd::patch::run_edit(&args, fleet, socket),
        Command::Get(args) => cmd::get::run(&args, fleet, socket, false),
        Command::Watch(args) => cmd::get::run(&args, fleet, socket, true),
        Command::Inspect(c) => cmd::inspect::run(&c, fleet, socket),
        Command::Config(c) => cmd::fleet::run_config(&c, fleet),
        Command::Lab(args) => cmd::lab::run(&args),
        Command::Status(args) => cmd::status::run(&args, fleet, socket),
        Command::Doctor(args) => cmd::doctor::run(&args),
        Command::Install(i) => cmd::install::run(&i),
        Command::Completions(args) => cmd::completions::run(&args, Cli::command()),
        Command::Man(args) => cmd::man::run(&args, Cli::command()),
        Command::Docs(d) => cmd::docs::run(&d),
    }
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // The cause chain on one line; no stack trace for operators.
            eprintln!("Error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
