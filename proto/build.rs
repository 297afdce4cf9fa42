//! Compiles `proto/lockcell/v1/lockcell.proto` into Rust with tonic's prost generator,
//! and keeps the descriptor set (with its comments) that `api_doc` renders.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Named here because `etcd_descriptor_set` names its own folder: once a build script
    // names one path, cargo reruns it only for the paths it names.
    println!("cargo:rerun-if-changed=proto/lockcell");
    println!("cargo:rerun-if-changed=proto/etcd");
    println!("cargo:rerun-if-changed=build.rs");
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // prost-build runs protoc with `--include_source_info` unless told to skip it, so
        // the set keeps every comment by its location; `lib.rs` embeds it.
        .file_descriptor_set_path(out_dir.join("lockcell_descriptor_set.bin"))
        .compile_protos(&["proto/lockcell/v1/lockcell.proto"], &["proto"])?;
    // The part of etcd's own API the proxies' etcd listener serves beyond what the
    // etcd-client crate generates servers for (see the file's header).
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        .compile_protos(
            &[
                "proto/etcd/auth.proto",
                "proto/etcd/lock.proto",
                "proto/etcd/election.proto",
            ],
            &["proto"],
        )?;
    etcd_descriptor_set(&out_dir)?;
    Ok(())
}

/// etcd's whole v3 API (`proto/etcd-v3`, etcd's own files) as one descriptor set with
/// its HTTP annotations, for the proxy's JSON gateway; no code is generated from it.
fn etcd_descriptor_set(out_dir: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    let root = "proto/etcd-v3";
    println!("cargo:rerun-if-changed={root}");
    let protoc = std::env::var_os("PROTOC").unwrap_or_else(|| "protoc".into());
    let status = std::process::Command::new(&protoc)
        .arg("--include_imports")
        .arg(format!(
            "--descriptor_set_out={}",
            out_dir.join("etcd_descriptor_set.bin").display()
        ))
        .args(["-I", root])
        .args([
            "etcd/api/etcdserverpb/rpc.proto",
            "etcd/server/etcdserver/api/v3lock/v3lockpb/v3lock.proto",
            "etcd/server/etcdserver/api/v3election/v3electionpb/v3election.proto",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .map_err(|e| format!("running {}: {e}", protoc.to_string_lossy()))?;
    if !status.success() {
        return Err(format!("protoc failed on {root} ({status})").into());
    }
    Ok(())
}
