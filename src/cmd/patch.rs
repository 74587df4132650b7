//! `wirespan patch` and `wirespan edit`: change the config in force rather than
//! replace it. Both fetch it from the node, make the new config (a strategic merge of
//! documents, `wirespan_control::config::patch`, or `$EDITOR`), validate it whole,
//! print a diff (secrets redacted), ask before applying when stdin is a terminal, and
//! apply it in the given mode, only if the node's config is still the one they
//! started from.

use std::{
    io::{BufRead as _, IsTerminal as _, Write as _},
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use wirespan_control::{
    api::{client::ApiClient, proto},
    config::patch,
    config_loader as loader,
};

use super::{
    apply::{send, ModeArgs},
    fleet::{self, FleetArgs},
};

/// Options of `wirespan patch`.
#[derive(Debug, clap::Args)]
pub struct PatchArgs {
    /// A file of patch documents (multi-document YAML).
    #[arg(required_unless_present = "patch", conflicts_with = "patch")]
    pub file: Option<PathBuf>,
    /// The patch documents inline.
    #[arg(long, value_name = "YAML")]
    pub patch: Option<String>,
    #[command(flatten)]
    pub mode: ModeArgs,
}

/// Options of `wirespan edit`.
#[derive(Debug, clap::Args)]
pub struct EditArgs {
    #[command(flatten)]
    pub mode: ModeArgs,
}

/// The one node a patch or an edit changes (each node has its own config, and the
/// change is made from the version it read).
async fn one_node(args: &FleetArgs, socket: Option<&Path>) -> anyhow::Result<ApiClient> {
    let mut targets = fleet::targets(args, socket).await?;
    anyhow::ensure!(
        targets.len() == 1,
        "patch and edit change one node at a time, and {} are named: pick one with -n NODE",
        targets.len()
    );
    Ok(targets.remove(0).client)
}

/// The config in force and its version.
async fn in_force(client: &mut ApiClient) -> anyhow::Result<(String, String)> {
    let resp = client
        .get_config(proto::GetConfigRequest {})
        .await
        .map_err(|s| anyhow::anyhow!("{}", s.message()))
        .context("reading the config in force")?
        .into_inner();
    if resp.config.is_empty() {
        anyhow::bail!("the node has no config in force; give it one with `wirespan apply FILE`");
    }
    Ok((resp.config, resp.version))
}

pub fn run_patch(args: &PatchArgs, fleet: &FleetArgs, socket: Option<&Path>) -> anyhow::Result<()> {
    args.mode.check()?;
    let text = match (&args.file, &args.patch) {
        (Some(f), _) => loader::read_file(f).with_context(|| format!("reading {}", f.display()))?,
        (None, Some(p)) => p.clone(),
        (None, None) => anyhow::bail!("a patch file or --patch YAML is needed"),
    };
    super::block_on(async {
        let mut client = one_node(fleet, socket).await?;
        let (config, version) = in_force(&mut client).await?;
        let patched = patch::merge(&config, &text)?;
        for c in &patched.changes {
            println!("{c}");
        }
        change(&mut client, &args.mode, &config, patched.text, &version).await
    })
}

pub fn run_edit(args: &EditArgs, fleet: &FleetArgs, socket: Option<&Path>) -> anyhow::Result<()> {
    args.mode.check()?;
    super::block_on(async {
        let mut client = one_node(fleet, socket).await?;
        let (config, version) = in_force(&mut client).await?;
        let dir = PrivateDir::new()?;
        let path = dir.0.join("config.yaml");
        wirespan_control::files::write_atomic(&path, config.as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
        let edited = loop {
            run_editor(&path)?;
            let edited = loader::read_file(&path)?;
            if edited == config {
                break edited;
            }
            let Err(e) = loader::validate(&edited) else {
                break edited;
            };
            for p in e.problems() {
                eprintln!("{p}");
            }
            if !ask("the edited config is invalid; edit it again? [Y/n] ", true)? {
                anyhow::bail!("the edited config is invalid; nothing applied");
            }
        };
        change(&mut client, &args.mode, &config, edited, &version).await
    })
}

/// A fresh directory of our own (0700: the config may hold the cluster secret),
/// removed with what is in it on drop.
struct PrivateDir(PathBuf);

impl PrivateDir {
    fn new() -> anyhow::Result<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let dir =
            std::env::temp_dir().join(format!("wirespan-edit-{}-{nanos}", std::process::id()));
        // Not recursive: an existing path fails, never someone else's directory.
        std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
            .create(&dir)
            .with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self(dir))
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `$VISUAL`, else `$EDITOR`, else `vi` on `path` (through `sh`, so that the
/// variable may carry arguments).
fn run_editor(path: &Path) -> anyhow::Result<()> {
    let editor = std::env::var("VISUAL")
        .ok()
        .filter(|e| !e.is_empty())
        .or_else(|| std::env::var("EDITOR").ok().filter(|e| !e.is_empty()))
        .unwrap_or_else(|| "vi".to_owned());
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{editor} \"$1\""))
        .arg("sh")
        .arg(path)
        .status()
        .with_context(|| format!("running the editor {editor:?}"))?;
    if !status.success() {
        anyhow::bail!("the editor {editor:?} failed ({status}); nothing applied");
    }
    Ok(())
}

/// Asks a yes/no question on the terminal; `default` on an empty answer. Without a
/// terminal on stdin nothing is asked and the answer is no.
fn ask(question: &str, default: bool) -> anyhow::Result<bool> {
    if !std::io::stdin().is_terminal() {
        return Ok(false);
    }
    eprint!("{question}");
    std::io::stderr().flush()?;
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    Ok(match line.trim().to_lowercase().as_str() {
        "" => default,
        a => a == "y" || a == "yes",
    })
}

/// Validates `new`, shows what changes, asks when on a terminal, and applies it made
/// from version `base`.
async fn change(
    client: &mut ApiClient,
    mode: &ModeArgs,
    old: &str,
    new: String,
    base: &str,
) -> anyhow::Result<()> {
    if new == old {
        println!("no changes; nothing applied");
        return Ok(());
    }
    if let Err(e) = loader::validate(&new) {
        for p in e.problems() {
            eprintln!("{p}");
        }
        anyhow::bail!("the new config is invalid; nothing applied");
    }
    print!("{}", diff(old, &new));
    if std::io::stdin().is_terminal() && !ask("apply this change? [y/N] ", false)? {
        println!("nothing applied");
        return Ok(());
    }
    println!("{}", send(client, mode.request(new, base)).await?);
    Ok(())
}

/// Lines of context around a change.
const CONTEXT: usize = 2;

/// Largest diff table (lines × lines); beyond it only the line counts are shown.
const MAX_DIFF_CELLS: usize = 16 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Same,
    Removed,
    Added,
}

/// The edit script from `a` to `b` (a longest common subsequence of lines).
fn edits<'a>(a: &[&'a str], b: &[&'a str]) -> Vec<(Op, &'a str)> {
    let (n, m) = (a.len(), b.len());
    // lcs[i][j]: the LCS length of a[i..] and b[j..].
    let mut lcs = vec![0u32; (n + 1) * (m + 1)];
    let at = |i: usize, j: usize| i * (m + 1) + j;
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[at(i, j)] = if a[i] == b[j] {
                lcs[at(i + 1, j + 1)] + 1
            } else {
                lcs[at(i + 1, j)].max(lcs[at(i, j + 1)])
            };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while i < n || j < m {
        if i < n && j < m && a[i] == b[j] {
            out.push((Op::Same, a[i]));
            (i, j) = (i + 1, j + 1);
        } else if i < n && (j == m || lcs[at(i + 1, j)] >= lcs[at(i, j + 1)]) {
            out.push((Op::Removed, a[i]));
            i += 1;
        } else {
            out.push((Op::Added, b[j]));
            j += 1;
        }
    }
    out
}

/// A unified-style diff of two configs, secrets redacted ([`redact`]).
#[must_use]
pub fn diff(old: &str, new: &str) -> String {
    let a: Vec<&str> = old.lines().collect();
    let b: Vec<&str> = new.lines().collect();
    if (a.len() + 1).saturating_mul(b.len() + 1) > MAX_DIFF_CELLS {
        return format!(
            "(too large to diff: {} lines in force, {} lines new)\n",
            a.len(),
            b.len()
        );
    }
    let script = edits(&a, &b);
    let near_change = |k: usize| {
        let lo = k.saturating_sub(CONTEXT);
        let hi = (k + CONTEXT + 1).min(script.len());
        script[lo..hi].iter().any(|(op, _)| *op != Op::Same)
    };
    let mut out = String::from("--- in force\n+++ new\n");
    let mut last_shown: Option<usize> = None;
    for (k, (op, line)) in script.iter().enumerate() {
        if !near_change(k) {
            continue;
        }
        if last_shown.is_none_or(|l| l + 1 != k) {
            out.push_str("@@\n");
        }
        last_shown = Some(k);
        let mark = match op {
            Op::Same => ' ',
            Op::Removed => '-',
            Op::Added => '+',
        };
        out.push(mark);
        out.push_str(&redact(line));
        out.push('\n');
    }
    out
}

/// A config line fit to print: the value of a `secret:` key and the credentials of a
/// URL replaced by `<redacted>`.
#[must_use]
pub fn redact(line: &str) -> String {
    let body = line.trim_start().trim_start_matches("- ").trim_start();
    if let Some(rest) = body.strip_prefix("secret:") {
        if !rest.trim().is_empty() {
            let key_end = line.len() - rest.len();
            return format!("{} <redacted>", &line[..key_end]);
        }
    }
    let Some(scheme_end) = line.find("://") else {
        return line.to_owned();
    };
    let auth_start = scheme_end + 3;
    let auth_end = line[auth_start..]
        .find(['/', '?', '#', ' ', '"', '\''])
        .map_or(line.len(), |e| auth_start + e);
    match line[auth_start..auth_end].rfind('@') {
        Some(at) => format!(
            "{}<redacted>{}",
            &line[..auth_start],
            &line[auth_start + at..]
        ),
        None => line.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_diff_shows_changed_lines_with_context() {
        let old = "a\nb\nc\nd\ne\nf\ng\nh\n";
        let new = "a\nb\nc\nD\ne\nf\ng\nh\ni\n";
        assert_eq!(
            diff(old, new),
            "--- in force\n+++ new\n@@\n b\n c\n-d\n+D\n e\n f\n g\n h\n+i\n"
        );
        assert_eq!(diff(old, old), "--- in force\n+++ new\n");
    }

    #[test]
    fn secrets_and_url_credentials_are_redacted() {
        assert_eq!(redact("secret: c2VjcmV0"), "secret: <redacted>");
        assert_eq!(redact("  secret:   abc"), "  secret: <redacted>");
        assert_eq!(redact("secret:"), "secret:");
        assert_eq!(
            redact("url: http://user:pw@10.0.0.1:80/health"),
            "url: http://<redacted>@10.0.0.1:80/health"
        );
        assert_eq!(
            redact("url: http://10.0.0.1/x@y"),
            "url: http://10.0.0.1/x@y"
        );
        let d = diff("secret: one\n", "secret: two\n");
        assert!(!d.contains("one") && !d.contains("two"), "{d}");
        assert!(
            d.contains("-secret: <redacted>\n+secret: <redacted>\n"),
            "{d}"
        );
    }
}
