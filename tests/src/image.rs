//! The container image (Containerfile, `deploy/image/image.sh`), for the test that runs
//! it: whether podman can run containers here, and the image built from this build's
//! binaries.

use std::path::PathBuf;
use std::process::{Command, Output};

use anyhow::{bail, Context};

/// The tag the tests build the image under, apart from `make image`'s.
pub const TEST_TAG: &str = "localhost/lockcell:e2e";

fn script() -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the workspace")
        .join("deploy/image/image.sh")
}

fn image_sh(args: &[&str]) -> anyhow::Result<Output> {
    Command::new("sh")
        .arg(script())
        .args(args)
        .output()
        .context("running deploy/image/image.sh")
}

/// What `podman run` needs on this machine besides its arguments, or why podman
/// cannot run containers here.
pub fn run_flags() -> Result<Vec<String>, String> {
    if which("podman").is_none() {
        return Err("no podman; install the podman package (`make setup` does)".into());
    }
    let out = image_sh(&["run-flags"]).map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_owned());
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_owned)
        .collect())
}

/// Whether podman can run the image's base here (`make setup` builds the base).
pub fn available() -> bool {
    run_flags().is_ok()
}

/// Builds the image from the binaries this build made, as [`TEST_TAG`].
pub fn build() -> anyhow::Result<&'static str> {
    let bins = crate::bins::bin_dir()?;
    let out = image_sh(&["build", &bins.to_string_lossy(), TEST_TAG])?;
    if !out.status.success() {
        bail!(
            "image.sh build failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(TEST_TAG)
}

/// `podman` with `args`; its output, or an error that shows it.
pub fn podman(args: &[&str]) -> anyhow::Result<Output> {
    let out = Command::new("podman")
        .args(args)
        .output()
        .context("running podman")?;
    Ok(out)
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(program))
            .find(|path| path.is_file())
    })
}
