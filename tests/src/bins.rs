//! Finds the workspace's binaries (`lockcell-proxy`, `lockctl`) and etcd's.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

/// The directory cargo put this workspace's binaries in: `LOCKCELL_BIN_DIR` when set,
/// otherwise the profile directory the running executable lives in (tests run from
/// `target/<profile>/deps`).
pub fn bin_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("LOCKCELL_BIN_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let exe = std::env::current_exe().context("locating the running executable")?;
    let mut dir = exe
        .parent()
        .context("executable has no directory")?
        .to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    Ok(dir)
}

/// Path of a workspace binary, checked to exist.
pub fn workspace_bin(name: &str) -> anyhow::Result<PathBuf> {
    let path = bin_dir()?.join(name);
    if !path.is_file() {
        bail!(
            "{} is not built; run `cargo build --workspace --bins` first (`make test` does)",
            path.display()
        );
    }
    Ok(path)
}

/// Where Debian's `faketime` package puts libfaketime, the library that runs a process's
/// clocks fast or slow when preloaded (`LD_PRELOAD`, `FAKETIME="+0 x0.99"`).
const LIBFAKETIME: [&str; 2] = [
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
];

/// The environment that runs a process's clocks at `rate` times the machine's (every
/// clock the C library reads, monotonic and boot time alike, from the moment it
/// starts), or `None` without libfaketime (`make setup` installs it).
pub fn faketime_env(rate: f64) -> Option<Vec<(String, String)>> {
    let library = LIBFAKETIME.iter().find(|p| Path::new(p).is_file())?;
    Some(vec![
        ("LD_PRELOAD".to_owned(), (*library).to_owned()),
        ("FAKETIME".to_owned(), format!("+0 x{rate}")),
    ])
}

/// Path of a program on PATH, if there is one.
pub fn on_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}
