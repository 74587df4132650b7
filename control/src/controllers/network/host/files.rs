//! Files wirespan writes on the host (`/etc/hostname`, `/etc/resolv.conf`, the
//! systemd-resolved, systemd-timesyncd and chrony drop-ins), and the one rule they all
//! follow: never clobber a file wirespan did not write. A foreign file is moved to
//! `<file>.wirespan-orig` before the first write and moved back when the document goes
//! away (a rename: the bytes, mode and a symlink stay as they were).
//!
//! What to do is decided by [`plan_write`] and [`plan_remove`] from what is on disk
//! ([`FileState`]); [`HostFiles`] is the edge that reads and changes the files.

use std::{
    io,
    path::{Path, PathBuf},
};

/// First line of every file wirespan writes: how it knows the file is its own.
pub const MARKER: &str =
    "# Written by wirespan from its config; the original is restored when the document is removed.";

/// Suffix of the kept original.
pub const ORIGINAL_SUFFIX: &str = ".wirespan-orig";

/// What is at a managed path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileState {
    /// Nothing.
    Missing,
    /// A regular file wirespan wrote (first line [`MARKER`]), with its content.
    Ours(Vec<u8>),
    /// Anything else: someone else's file or symlink.
    Foreign,
}

/// One step on one managed path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Already as wanted.
    Nothing,
    /// Write the content (the path is missing or ours).
    Write,
    /// Move the foreign file to the original's place, then write.
    KeepOriginalThenWrite,
    /// Move the kept original back.
    RestoreOriginal,
    /// Delete our file (there was no original).
    Delete,
    /// Refuse: the file is someone else's and an original is already kept, so the
    /// file was replaced after wirespan wrote it; writing would lose it.
    Refuse(String),
}

/// What to do to make `path` hold `desired`.
#[must_use]
pub fn plan_write(path: &Path, current: &FileState, original_kept: bool, desired: &[u8]) -> Plan {
    match current {
        FileState::Ours(c) if c == desired => Plan::Nothing,
        FileState::Missing | FileState::Ours(_) => Plan::Write,
        FileState::Foreign if !original_kept => Plan::KeepOriginalThenWrite,
        FileState::Foreign => Plan::Refuse(format!(
            "{} was replaced by someone else after wirespan wrote it (the original is kept as {}); \
             not overwriting it",
            path.display(),
            original_of(path).display()
        )),
    }
}

/// What to do when the document goes away.
#[must_use]
pub fn plan_remove(current: &FileState, original_kept: bool) -> Plan {
    match (current, original_kept) {
        (FileState::Ours(_) | FileState::Missing, true) => Plan::RestoreOriginal,
        (FileState::Ours(_), false) => Plan::Delete,
        // Missing with nothing kept: nothing to do. Foreign: someone else's file now;
        // it (and any kept original) is left alone.
        (FileState::Missing | FileState::Foreign, _) => Plan::Nothing,
    }
}

/// Where the original of `path` is kept.
#[must_use]
pub fn original_of(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(ORIGINAL_SUFFIX);
    PathBuf::from(s)
}

/// `body` as wirespan writes it: the marker line, then the body.
#[must_use]
pub fn with_marker(body: &str) -> Vec<u8> {
    format!("{MARKER}\n{body}").into_bytes()
}

/// The file edge.
pub trait HostFiles: Send + Sync {
    /// What is at `path` (a symlink is [`FileState::Foreign`], never followed).
    ///
    /// # Errors
    /// Reading failed for another reason than the path being absent.
    fn state(&self, path: &Path) -> io::Result<FileState>;
    /// Whether anything (file, symlink, dir) is at `path`.
    fn exists(&self, path: &Path) -> bool;
    /// Reads a file (a symlink is followed); `None` when absent.
    ///
    /// # Errors
    /// Other read failures.
    fn read(&self, path: &Path) -> io::Result<Option<Vec<u8>>>;
    /// Regular files in `dir` whose name ends with `suffix`, sorted by name.
    fn list(&self, dir: &Path, suffix: &str) -> Vec<PathBuf>;
    /// Replaces `path` atomically with `content` (mode 0644), creating its directory.
    ///
    /// # Errors
    /// The write or rename failed.
    fn write(&self, path: &Path, content: &[u8]) -> io::Result<()>;
    /// Renames `from` to `to`.
    ///
    /// # Errors
    /// The rename failed.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Deletes `path`.
    ///
    /// # Errors
    /// The delete failed.
    fn remove(&self, path: &Path) -> io::Result<()>;
}

/// [`HostFiles`] on the real file system.
#[derive(Debug, Default, Clone, Copy)]
pub struct RealFiles;

impl HostFiles for RealFiles {
    fn state(&self, path: &Path) -> io::Result<FileState> {
        let md = match std::fs::symlink_metadata(path) {
            Ok(md) => md,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(FileState::Missing),
            Err(e) => return Err(e),
        };
        if !md.is_file() {
            return Ok(FileState::Foreign);
        }
        let content = std::fs::read(path)?;
        let first = content.split(|b| *b == b'\n').next().unwrap_or_default();
        Ok(if first == MARKER.as_bytes() {
            FileState::Ours(content)
        } else {
            FileState::Foreign
        })
    }

    fn exists(&self, path: &Path) -> bool {
        std::fs::symlink_metadata(path).is_ok()
    }

    fn read(&self, path: &Path) -> io::Result<Option<Vec<u8>>> {
        match std::fs::read(path) {
            Ok(c) => Ok(Some(c)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn list(&self, dir: &Path, suffix: &str) -> Vec<PathBuf> {
        let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.is_file()
                    && p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.ends_with(suffix))
            })
            .collect();
        out.sort();
        out
    }

    fn write(&self, path: &Path, content: &[u8]) -> io::Result<()> {
        use std::{io::Write as _, os::unix::fs::OpenOptionsExt as _};
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".wirespan-tmp");
        let tmp = PathBuf::from(tmp);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .open(&tmp)?;
        f.write_all(content)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
}

/// Makes `path` hold `body` (with the marker), keeping a foreign original. Returns
/// whether anything changed.
///
/// # Errors
/// A refused overwrite ([`Plan::Refuse`]) or a file operation that failed.
pub fn put(files: &dyn HostFiles, path: &Path, body: &str) -> io::Result<bool> {
    let desired = with_marker(body);
    let original = original_of(path);
    let plan = plan_write(path, &files.state(path)?, files.exists(&original), &desired);
    match plan {
        Plan::Nothing => Ok(false),
        Plan::Write => files.write(path, &desired).map(|()| true),
        Plan::KeepOriginalThenWrite => {
            files.rename(path, &original)?;
            files.write(path, &desired).map(|()| true)
        }
        Plan::Refuse(why) => Err(io::Error::new(io::ErrorKind::AlreadyExists, why)),
        Plan::RestoreOriginal | Plan::Delete => unreachable!("not a write plan"),
    }
}

/// Undoes [`put`]: the original back, or our file gone. Returns whether anything
/// changed.
///
/// # Errors
/// A file operation that failed.
pub fn restore(files: &dyn HostFiles, path: &Path) -> io::Result<bool> {
    let original = original_of(path);
    match plan_remove(&files.state(path)?, files.exists(&original)) {
        Plan::RestoreOriginal => files.rename(&original, path).map(|()| true),
        Plan::Delete => files.remove(path).map(|()| true),
        _ => Ok(false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_keep_foreign_files_and_never_overwrite_a_replaced_one() {
        let p = Path::new("/etc/resolv.conf");
        let want = with_marker("nameserver 10.0.0.2\n");
        assert_eq!(
            plan_write(p, &FileState::Missing, false, &want),
            Plan::Write
        );
        assert_eq!(
            plan_write(p, &FileState::Foreign, false, &want),
            Plan::KeepOriginalThenWrite
        );
        assert_eq!(
            plan_write(p, &FileState::Ours(want.clone()), true, &want),
            Plan::Nothing
        );
        assert_eq!(
            plan_write(p, &FileState::Ours(with_marker("old\n")), true, &want),
            Plan::Write
        );
        let Plan::Refuse(why) = plan_write(p, &FileState::Foreign, true, &want) else {
            panic!("a foreign file with a kept original must not be overwritten");
        };
        assert!(why.contains("/etc/resolv.conf.wirespan-orig"), "{why}");
    }

    #[test]
    fn removal_restores_the_original_or_deletes_only_our_file() {
        let ours = FileState::Ours(with_marker(""));
        assert_eq!(plan_remove(&ours, true), Plan::RestoreOriginal);
        assert_eq!(
            plan_remove(&FileState::Missing, true),
            Plan::RestoreOriginal
        );
        assert_eq!(plan_remove(&ours, false), Plan::Delete);
        assert_eq!(plan_remove(&FileState::Foreign, true), Plan::Nothing);
        assert_eq!(plan_remove(&FileState::Foreign, false), Plan::Nothing);
        assert_eq!(plan_remove(&FileState::Missing, false), Plan::Nothing);
    }

    #[test]
    fn put_and_restore_round_trip_a_symlink_and_a_file_byte_for_byte() {
        let dir = tempfile::tempdir().unwrap();
        let f = RealFiles;
        let file = dir.path().join("hostname");
        std::fs::write(&file, b"old-name\n# odd bytes \xff\n").unwrap();
        assert!(put(&f, &file, "new-name\n").unwrap());
        assert!(
            !put(&f, &file, "new-name\n").unwrap(),
            "second put is a no-op"
        );
        assert_eq!(
            std::fs::read_to_string(&file).unwrap(),
            format!("{MARKER}\nnew-name\n")
        );
        assert!(restore(&f, &file).unwrap());
        assert_eq!(
            std::fs::read(&file).unwrap(),
            b"old-name\n# odd bytes \xff\n"
        );
        assert!(!original_of(&file).exists());

        let link = dir.path().join("resolv.conf");
        std::os::unix::fs::symlink("../run/stub-resolv.conf", &link).unwrap();
        put(&f, &link, "nameserver 10.0.0.2\n").unwrap();
        assert!(!std::fs::symlink_metadata(&link).unwrap().is_symlink());
        restore(&f, &link).unwrap();
        assert_eq!(
            std::fs::read_link(&link).unwrap(),
            Path::new("../run/stub-resolv.conf")
        );

        let fresh = dir.path().join("conf.d/wirespan.conf");
        put(&f, &fresh, "[Time]\n").unwrap();
        restore(&f, &fresh).unwrap();
        assert!(!fresh.exists(), "a file wirespan created is deleted");
    }
}
