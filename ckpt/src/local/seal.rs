//! Sealing, for ranks that run as another user ([`RankAccess`]): owners and modes set
//! through descriptors opened without following symlinks; a staging directory given to
//! the rank, a committed part's entries taken from it.

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use super::{RANK_STAGING_MODE, RankAccess, SEALED_DIR_MODE, SEALED_FILE_MODE, io_err};
use crate::CkptError;

/// Sets the owner (`None`: unchanged), group and mode of `path`, never through a
/// symlink: opened with `O_NOFOLLOW`, changed through the descriptor.
pub(super) fn set_owner_and_mode(
    path: &Path,
    uid: Option<u32>,
    gid: Option<u32>,
    mode: u32,
) -> Result<(), CkptError> {
    use std::os::unix::fs::PermissionsExt;
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_DIRECTORY)
        .open(path)
        .map_err(io_err("open dir", path))?;
    std::os::unix::fs::fchown(&file, uid, gid).map_err(io_err("chown", path))?;
    file.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(io_err("chmod", path))
}

/// The agent's effective user id: the owner of sealed entries.
fn agent_uid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Seals a staged directory: the agent's, group `gid`, [`SEALED_DIR_MODE`].
pub(super) fn seal_dir(dir: &Path, gid: u32) -> Result<(), CkptError> {
    set_owner_and_mode(dir, Some(agent_uid()), Some(gid), SEALED_DIR_MODE)
}

/// Seals a staged regular file opened without following symlinks: the agent's, group
/// `gid`, [`SEALED_FILE_MODE`]. A file with another hard link is refused: the link
/// could be a file of someone else's that the seal would hand to the job's group.
pub(super) fn seal_file(file: &File, path: &Path, gid: u32) -> Result<(), CkptError> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let metadata = file.metadata().map_err(io_err("stat", path))?;
    if metadata.nlink() != 1 {
        return Err(CkptError::Invalid(format!(
            "staged file {} has {} hard links; a part holds files of its own only",
            path.display(),
            metadata.nlink()
        )));
    }
    std::os::unix::fs::fchown(file, Some(agent_uid()), Some(gid)).map_err(io_err("chown", path))?;
    file.set_permissions(fs::Permissions::from_mode(SEALED_FILE_MODE))
        .map_err(io_err("chmod", path))
}

/// Gives an (empty) staging directory to the rank: `uid:gid`, [`RANK_STAGING_MODE`].
pub(super) fn give_staging_to_rank(staging: &Path, access: RankAccess) -> Result<(), CkptError> {
    set_owner_and_mode(
        staging,
        Some(access.uid),
        Some(access.gid),
        RANK_STAGING_MODE,
    )
}
