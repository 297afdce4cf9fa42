//! The systemd units: systemd-analyze verify finds nothing to say about them, and
//! their hardening keeps the exposure score "OK".

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};

use crate::files;

/// A unit's ExecStart, its continuation lines joined, split into words.
pub(crate) fn exec_start(unit: &str) -> Vec<String> {
    let joined = unit.replace("\\\n", " ");
    setting(&joined, "ExecStart")
        .map(|l| l.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default()
}

pub(crate) fn setting(unit: &str, key: &str) -> Option<String> {
    unit.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .map(str::to_owned)
}

pub(crate) fn units_pass_systemd_analyze(analyze: PathBuf) -> Result<()> {
    // verify wants the programs to exist: stand-ins in a folder of our own.
    let dir = tempfile::tempdir()?;
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin)?;
    let mut units = Vec::new();
    for unit in files("deploy/systemd", "service")? {
        let text = std::fs::read_to_string(&unit)?;
        let program = exec_start(&text).first().cloned().context("no ExecStart")?;
        let stand_in = bin.join(Path::new(&program).file_name().unwrap());
        std::fs::write(&stand_in, "#!/bin/sh\n")?;
        std::fs::set_permissions(&stand_in, std::fs::Permissions::from_mode(0o755))?;
        let copy = dir.path().join(unit.file_name().unwrap());
        std::fs::write(&copy, text.replace(&program, &stand_in.to_string_lossy()))?;
        units.push(copy);
    }
    let out = Command::new(&analyze).arg("verify").args(&units).output()?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Unknown keys and bad values are only warnings to verify: any line about our units fails.
    let ours: Vec<&str> = said
        .lines()
        .filter(|l| {
            units
                .iter()
                .any(|u| l.contains(&*u.file_name().unwrap().to_string_lossy()))
        })
        .collect();
    ensure!(
        out.status.success() && ours.is_empty(),
        "systemd-analyze verify:\n{said}"
    );
    for unit in &units {
        // Exposure 2.0 or less: "OK" in systemd-analyze security's words.
        let out = Command::new(&analyze)
            .args(["security", "--offline=yes", "--threshold=20"])
            .arg(unit)
            .output()?;
        if !out.status.success() {
            bail!(
                "systemd-analyze security {}: exposure above 2.0:\n{}",
                unit.display(),
                String::from_utf8_lossy(&out.stdout)
            );
        }
    }
    Ok(())
}
