//! Compiles the slice of etcd's Lease service that the load test drives directly.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tonic_prost_build::configure()
        .build_server(false)
        .compile_protos(&["proto/etcd_lease.proto"], &["proto"])?;
    Ok(())
}
