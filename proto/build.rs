//! Compiles `proto/lockcell/v1/lockcell.proto` into Rust with tonic's prost generator,
//! and keeps the descriptor set (with its comments) that `api_doc` renders.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
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
    Ok(())
}
