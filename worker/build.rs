//! Generates the gRPC service (worker/proto/grpc_predict_v2.proto) with the protoc binary that
//! the protoc-bin-vendored crate ships, so no system protoc is needed.

fn main() {
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("protoc-bin-vendored has a protoc for this host");
    // prost-build runs the protoc named by PROTOC.
    std::env::set_var("PROTOC", protoc);
    println!("cargo:rerun-if-changed=proto/grpc_predict_v2.proto");
    // Server and client (bench/ drives the server with the client over tonic's channel); no
    // `connect` helper, which would tie this crate to tonic's transport.
    tonic_prost_build::configure()
        .build_transport(false)
        .compile_protos(&["proto/grpc_predict_v2.proto"], &["proto"])
        .expect("proto/grpc_predict_v2.proto compiles");
}
