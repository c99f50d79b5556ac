//! A rule set published to a watched file: written over it at once,
//! never readable by more than the file's readers: its mode, and its owner
//! and group when the process may give them (else the group's bits are
//! dropped, as the process's own group is another).

use std::fs::{File, OpenOptions, Permissions};
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Replace the file's text at once: written beside it (beside the file a
/// symbolic link points to), then renamed over it, so the watch never reads
/// half a file. The copy has the file's permissions, group and (as root)
/// owner before its first byte (it may hold allow-listed keys that only the
/// file's readers may read); when it cannot be given the file's group, it
/// has no group permission at all, never those of the process's group.
/// Publications are written one at a time.
pub(crate) async fn write(path: &Path, text: &str) -> io::Result<()> {
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _alone = ONE_AT_A_TIME.lock().await;
    let (path, text) = (path.to_owned(), text.to_owned());
    tokio::task::spawn_blocking(move || replace(&path, &text))
        .await
        .map_err(io::Error::other)?
}

/// [`write`]'s work, blocking.
fn replace(path: &Path, text: &str) -> io::Result<()> {
    let target = std::fs::canonicalize(path)?;
    let metadata = std::fs::metadata(&target)?;
    let permissions = metadata.permissions();
    let (temporary, mut file) = create_beside(&target, &permissions)?;
    let written = same_owners(&file, &metadata)
        .and_then(|()| file.write_all(text.as_bytes()))
        .and_then(|()| file.sync_all())
        .and_then(|()| std::fs::rename(&temporary, &target));
    if written.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    written
}

/// Give `file` (a new copy of the target, readable by its owner only) the
/// target's group, its owner if the process may (as root), and its mode;
/// without the group's bits if the group could not be given (the process
/// is not one of its members): the copy's group is then the process's.
fn same_owners(file: &File, target: &std::fs::Metadata) -> io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _, fchown};
        // Only root may give a file away; the owner's bits are then the
        // process's, which reads the file anyway.
        let _ = fchown(file, Some(target.uid()), None);
        let grouped = fchown(file, None, Some(target.gid())).is_ok();
        file.set_permissions(Permissions::from_mode(copy_mode(
            target.permissions().mode(),
            grouped,
        )))
    }
    #[cfg(not(unix))]
    file.set_permissions(target.permissions())
}

/// The mode of the copy of a file of mode `target`: the same, without the
/// group's bits unless the copy has the file's group.
#[cfg(unix)]
fn copy_mode(target: u32, grouped: bool) -> u32 {
    if grouped { target } else { target & !0o070 }
}

/// A new file beside `target`, of a name no other file has, readable by
/// nobody whom `permissions` do not let read (on Unix: created with at
/// most the target's owner bits, whatever the umask).
fn create_beside(target: &Path, permissions: &Permissions) -> io::Result<(PathBuf, File)> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let mut options = OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
        options.mode(permissions.mode() & 0o600);
    }
    #[cfg(not(unix))]
    let _ = permissions;
    let mut attempts = 0;
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let mut name = target.as_os_str().to_owned();
        name.push(format!(".admin-{}-{n}", std::process::id()));
        let temporary = PathBuf::from(name);
        match options.open(&temporary) {
            Ok(file) => return Ok((temporary, file)),
            // Left by a process of the same id that died mid-write.
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists && attempts < 16 => {
                attempts += 1;
            }
            Err(error) => return Err(error),
        }
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::copy_mode;

    #[test]
    fn a_copy_not_given_the_files_group_has_no_group_bits() {
        assert_eq!(copy_mode(0o640, true), 0o640);
        assert_eq!(copy_mode(0o640, false), 0o600);
        assert_eq!(copy_mode(0o664, false), 0o604);
        assert_eq!(copy_mode(0o600, false), 0o600);
    }
}
