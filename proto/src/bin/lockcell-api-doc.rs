//! Writes the API reference rendered from the proto comments (`make api-doc`) to the
//! path given, or to `docs/api.md` of the workspace.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let path = match (args.next(), args.next()) {
        (Some(path), None) if path != "-h" && path != "--help" => PathBuf::from(path),
        (None, _) => workspace_root().join("docs/api.md"),
        _ => {
            eprintln!("usage: lockcell-api-doc [PATH]   (default: docs/api.md of the workspace)");
            return ExitCode::from(2);
        }
    };
    match std::fs::write(&path, lockcell_proto::api_doc::render()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lockcell-api-doc: cannot write {}: {e}", path.display());
            ExitCode::FAILURE
        }
    }
}

/// The workspace root: the parent of this crate's directory.
fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("lockcell-proto sits in the workspace")
}
