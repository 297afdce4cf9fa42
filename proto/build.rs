//! Compiles `proto/lockcell/v1/lockcell.proto` into Rust with tonic's prost generator.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_protos(&["proto/lockcell/v1/lockcell.proto"], &["proto"])?;
    Ok(())
}
