//! Network namespaces: a handle naming one, a guard that owns a throwaway one, and a
//! dedicated thread bound to one.
//!
//! Netlink sockets stay bound to the namespace they were opened in, and `setns`
//! changes the namespace of the calling *thread* only. So nothing here ever switches
//! the caller's thread: code that must open sockets inside a namespace runs on a
//! [`NetnsThread`], a thread that enters the namespace once and then serves jobs on a
//! current-thread tokio runtime. Programs are started inside a namespace through
//! `nsenter --net=…`, which `exec`s the program, so the child's pid is the program's.

use std::{
    fs::File,
    future::Future,
    io,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{
        atomic::{AtomicU32, Ordering},
        mpsc, Mutex,
    },
    thread::JoinHandle,
};

use nix::sched::CloneFlags;

/// Where `ip netns add` puts its bind mounts.
const NETNS_RUN_DIR: &str = "/run/netns";

/// A network namespace the adapters work in: the caller's own, or a named one
/// (`/run/netns/NAME`, as created by `ip netns add`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Netns {
    name: Option<String>,
}

impl Netns {
    /// The namespace of the calling process.
    #[must_use]
    pub fn current() -> Self {
        Self { name: None }
    }

    /// A namespace created with `ip netns add NAME`.
    #[must_use]
    pub fn named(name: impl Into<String>) -> Self {
        Self {
            name: Some(name.into()),
        }
    }

    /// The namespace name, `None` for the process's own namespace.
    #[must_use]
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The bind-mount path of a named namespace.
    #[must_use]
    pub fn path(&self) -> Option<PathBuf> {
        self.name.as_ref().map(|n| Path::new(NETNS_RUN_DIR).join(n))
    }

    /// A command that runs `program` inside this namespace (through `nsenter`, which
    /// `exec`s it: the child pid is the program's own).
    #[must_use]
    pub fn command(&self, program: &str) -> Command {
        match self.path() {
            None => Command::new(program),
            Some(path) => {
                let mut cmd = Command::new("nsenter");
                cmd.arg(format!("--net={}", path.display())).arg(program);
                cmd
            }
        }
    }

    /// Runs `program args…` in this namespace and returns its output; a non-zero exit
    /// is an error carrying stderr.
    ///
    /// # Errors
    /// The program could not start or exited unsuccessfully.
    pub fn run(&self, program: &str, args: &[&str]) -> io::Result<Output> {
        let out = self
            .command(program)
            .args(args)
            .stdin(Stdio::null())
            .output()?;
        if out.status.success() {
            Ok(out)
        } else {
            Err(io::Error::other(format!(
                "{program} {}: {}: {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )))
        }
    }

    /// Runs `program args…` in this namespace and returns its stdout as text.
    ///
    /// # Errors
    /// As [`Netns::run`].
    pub fn run_stdout(&self, program: &str, args: &[&str]) -> io::Result<String> {
        let out = self.run(program, args)?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Opens the namespace file, for `setns`.
    fn open(&self) -> io::Result<Option<File>> {
        self.path().map(File::open).transpose()
    }

    /// Runs `f` on a fresh thread inside this namespace with a current-thread tokio
    /// runtime, and waits for its result. Sockets opened inside stay in the namespace.
    ///
    /// # Errors
    /// The namespace could not be entered or the runtime not built.
    pub fn block_on<T, Fut, F>(&self, f: F) -> io::Result<T>
    where
        T: Send + 'static,
        Fut: Future<Output = T>,
        F: FnOnce() -> Fut + Send + 'static,
    {
        let thread = NetnsThread::spawn(self)?;
        thread.block_on(f)
    }
}

type Job = Box<dyn FnOnce(&tokio::runtime::Runtime) + Send>;

/// A thread that entered a namespace and serves jobs there on a current-thread tokio
/// runtime. Tasks spawned by one job (such as an rtnetlink connection) keep running
/// while later jobs are being served. Dropping it stops the thread.
#[derive(Debug)]
pub struct NetnsThread {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl NetnsThread {
    /// Starts the thread and enters `netns` on it.
    ///
    /// # Errors
    /// The namespace does not exist, `setns` failed, or the runtime could not be built.
    pub fn spawn(netns: &Netns) -> io::Result<Self> {
        let file = netns.open()?;
        let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel::<io::Result<()>>();
        let thread = std::thread::Builder::new()
            .name(format!("netns-{}", netns.name().unwrap_or("self")))
            .spawn(move || {
                let setup = (|| {
                    if let Some(file) = &file {
                        nix::sched::setns(file, CloneFlags::CLONE_NEWNET)
                            .map_err(io::Error::from)?;
                    }
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                })();
                let rt = match setup {
                    Ok(rt) => {
                        let _ = ready_tx.send(Ok(()));
                        rt
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                while let Ok(job) = jobs_rx.recv() {
                    job(&rt);
                }
            })?;
        ready_rx
            .recv()
            .map_err(|_| io::Error::other("netns thread died during setup"))??;
        Ok(Self {
            jobs: Some(jobs_tx),
            thread: Some(thread),
        })
    }

    /// Runs the future made by `f` to completion on the namespace thread.
    ///
    /// # Errors
    /// The thread is gone (a previous job panicked).
    pub fn block_on<T, Fut, F>(&self, f: F) -> io::Result<T>
    where
        T: Send + 'static,
        Fut: Future<Output = T>,
        F: FnOnce() -> Fut + Send + 'static,
    {
        let (tx, rx) = mpsc::channel();
        let job: Job = Box::new(move |rt| {
            let _ = tx.send(rt.block_on(f()));
        });
        self.jobs
            .as_ref()
            .ok_or_else(|| io::Error::other("netns thread stopped"))?
            .send(job)
            .map_err(|_| io::Error::other("netns thread stopped"))?;
        rx.recv()
            .map_err(|_| io::Error::other("netns job panicked"))
    }

    /// Runs blocking code on the namespace thread (sockets it opens stay in the
    /// namespace).
    ///
    /// # Errors
    /// The thread is gone.
    pub fn run<T, F>(&self, f: F) -> io::Result<T>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        self.block_on(move || async move { f() })
    }
}

impl Drop for NetnsThread {
    fn drop(&mut self) {
        // Closing the channel ends the job loop; the runtime and its tasks go with it.
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A name unique on this host for the life of the process: `PREFIX` + pid + counter,
/// such as an interface name when several test processes share the UAPI socket
/// directory. Keep `prefix` to 4 bytes so the result fits an interface name (15).
#[must_use]
pub fn unique_name(prefix: &str) -> String {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}{}x{n}", std::process::id())
}

/// The pid in a guard's namespace name (`ws…-PID-N`, see [`NetnsGuard::new`]).
fn guard_owner(name: &str) -> Option<i32> {
    let mut parts = name.rsplitn(3, '-');
    let n = parts.next()?;
    let pid = parts.next()?;
    let prefix = parts.next()?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (prefix.starts_with("ws") && prefix.bytes().all(|b| b.is_ascii_lowercase()) && digits(n))
        .then(|| pid.parse().ok())
        .flatten()
}

/// Deletes the namespaces of guards whose process is gone (killed before its guards
/// dropped): they would hold tun devices, sockets and wireguard-go processes forever.
/// A namespace whose pid now belongs to a live process is left alone.
fn sweep_dead_guards() {
    let Ok(list) = Netns::current().run_stdout("ip", &["netns", "list"]) else {
        return;
    };
    for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
        let Some(pid) = guard_owner(name) else {
            continue;
        };
        if std::path::Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        tracing::info!(
            netns = name,
            pid,
            "removing the namespace of a dead test process"
        );
        kill_all_in(name);
        let _ = Netns::current().run("ip", &["netns", "del", name]);
    }
}

/// SIGKILL to every process in namespace `name`.
fn kill_all_in(name: &str) {
    if let Ok(out) = Netns::current().run_stdout("ip", &["netns", "pids", name]) {
        for pid in out.split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// Owns a throwaway named namespace: created on [`NetnsGuard::new`], deleted on drop
/// (also on panic), after killing every process still running in it.
#[derive(Debug)]
pub struct NetnsGuard {
    netns: Netns,
    children: Mutex<Vec<Child>>,
}

impl NetnsGuard {
    /// Creates `PREFIX-PID-COUNTER` with `ip netns add` and brings its `lo` up. The
    /// first guard of a process also removes the namespaces left by guards of dead
    /// processes (`ws…` prefixes only).
    ///
    /// # Errors
    /// `ip netns add` failed (not root, name clash).
    pub fn new(prefix: &str) -> io::Result<Self> {
        static SWEEP: std::sync::Once = std::sync::Once::new();
        SWEEP.call_once(sweep_dead_guards);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("{prefix}-{}-{n}", std::process::id());
        Netns::current().run("ip", &["netns", "add", &name])?;
        let guard = Self {
            netns: Netns::named(name),
            children: Mutex::new(Vec::new()),
        };
        guard.netns.run("ip", &["link", "set", "lo", "up"])?;
        Ok(guard)
    }

    /// The namespace.
    #[must_use]
    pub fn netns(&self) -> &Netns {
        &self.netns
    }

    /// The namespace name.
    #[must_use]
    pub fn name(&self) -> &str {
        self.netns.name().unwrap_or_default()
    }

    /// Runs a command inside the namespace, see [`Netns::run`].
    ///
    /// # Errors
    /// As [`Netns::run`].
    pub fn run(&self, program: &str, args: &[&str]) -> io::Result<Output> {
        self.netns.run(program, args)
    }

    /// Runs a command inside the namespace and returns stdout.
    ///
    /// # Errors
    /// As [`Netns::run`].
    pub fn run_stdout(&self, program: &str, args: &[&str]) -> io::Result<String> {
        self.netns.run_stdout(program, args)
    }

    /// Starts a long-running program inside the namespace; it is killed when the
    /// guard drops. Returns its pid.
    ///
    /// # Errors
    /// The program could not start.
    pub fn spawn(&self, program: &str, args: &[&str]) -> io::Result<u32> {
        let child = self
            .netns
            .command(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let pid = child.id();
        self.children
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(child);
        Ok(pid)
    }
}

impl Drop for NetnsGuard {
    fn drop(&mut self) {
        let mut children = std::mem::take(
            self.children
                .get_mut()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for child in &mut children {
            let _ = child.kill();
            let _ = child.wait();
        }
        let name = self.name().to_owned();
        // Anything else still in the namespace (started by code under test) would keep
        // sockets or tun devices alive: kill it by pid.
        kill_all_in(&name);
        if let Err(e) = Netns::current().run("ip", &["netns", "del", &name]) {
            tracing::warn!(netns = %name, error = %e, "could not delete network namespace");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::guard_owner;

    #[test]
    fn guard_names_give_their_owner() {
        assert_eq!(guard_owner("wspar-1234-0"), Some(1234));
        assert_eq!(guard_owner("wsdrift-99-17"), Some(99));
        // Not ours: another prefix, a lab's namespace, no counter.
        assert_eq!(guard_owner("cni-1234-0"), None);
        assert_eq!(guard_owner("wsl-t12x0-node1"), None);
        assert_eq!(guard_owner("wspar-1234"), None);
        assert_eq!(guard_owner("ws-par-1234-0"), None);
    }
}
