//! Files the node keeps in its state dir (keys, the node ID, the last good config, the
//! API socket): written atomically with mode 0600, in directories only root can enter.

use std::{
    fs,
    io::Write as _,
    os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _},
    path::Path,
};

/// Creates the directory `path` is in (and its parents) with mode 0700 when missing:
/// where keys, the last good config and the API socket live, root only.
///
/// # Errors
/// I/O errors.
pub fn create_private_parent(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    match path.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(dir) => std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir),
        None => Ok(()),
    }
}

/// Creates the directory `dir` (and missing parents, 0700) and forces its own mode to
/// 0700 whatever the umask: the node's state dir holds its keys and the cluster
/// secret. An existing directory open to group or others is tightened, with a warning.
///
/// # Errors
/// I/O errors.
pub fn ensure_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let mode = fs::metadata(dir)?.permissions().mode() & 0o7777;
    if mode != 0o700 {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
        if mode & 0o077 != 0 {
            tracing::warn!(dir = %dir.display(), was = %format!("{mode:04o}"),
                "state dir was open to other users; set it to 0700");
        }
    }
    Ok(())
}

/// Writes `contents` to `path` atomically with mode 0600 (temp file, fsync, rename,
/// fsync of the directory). The temp file has an unpredictable name and is created
/// with `O_EXCL|O_NOFOLLOW`: in a directory others can write to, a file or symlink
/// planted under that name makes the write fail instead of being followed.
///
/// # Errors
/// I/O errors.
pub fn write_atomic(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    // `Path::new("f").parent()` is `Some("")`: that is the current directory too.
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp.{:016x}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("file"),
        rand::random::<u64>()
    ));
    let mut created = false;
    let res = (|| {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .mode(0o600)
            .open(&tmp)?;
        created = true;
        f.set_permissions(fs::Permissions::from_mode(0o600))?;
        f.write_all(contents)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        fs::File::open(dir)?.sync_all()
    })();
    // Only our own temp file is removed, never one that was there before.
    if res.is_err() && created {
        let _ = fs::remove_file(&tmp);
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concurrent_atomic_writes_leave_one_whole_file_and_no_temp_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::thread::scope(|s| {
            for i in 0..8u8 {
                let path = &path;
                s.spawn(move || {
                    for _ in 0..50 {
                        write_atomic(path, &[b'a' + i; 4096]).unwrap();
                    }
                });
            }
        });
        let data = fs::read(&path).unwrap();
        assert_eq!(data.len(), 4096);
        assert!(data.iter().all(|b| *b == data[0]), "interleaved writes");
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("secret")]);
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }

    #[test]
    fn a_symlink_onto_the_target_is_replaced_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        fs::write(&victim, "root-owned").unwrap();
        let path = dir.path().join("secret");
        std::os::unix::fs::symlink(&victim, &path).unwrap();
        write_atomic(&path, b"new").unwrap();
        assert_eq!(fs::read_to_string(&victim).unwrap(), "root-owned");
        assert!(!fs::symlink_metadata(&path).unwrap().is_symlink());
        assert_eq!(fs::read_to_string(&path).unwrap(), "new");
    }

    #[test]
    fn the_private_dir_is_0700_whatever_it_was() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("a/state");
        ensure_private_dir(&state).unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&state), 0o700);
        fs::set_permissions(&state, fs::Permissions::from_mode(0o777)).unwrap();
        ensure_private_dir(&state).unwrap();
        assert_eq!(mode(&state), 0o700, "an open dir is tightened");
    }
}
