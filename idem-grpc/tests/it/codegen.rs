//! The committed generated code is what the .proto gives: regenerated with
//! protox (pure Rust, no protoc) and tonic-prost-build, compared.

use std::path::Path;

fn regenerate(proto: &Path, includes: &Path, committed: &Path) {
    let fds = protox::compile([proto], [includes]).unwrap();
    let out = tempfile_dir();
    tonic_prost_build::configure()
        .out_dir(&out)
        .compile_fds(fds)
        .unwrap();
    let name = committed.file_name().unwrap();
    let fresh = std::fs::read_to_string(out.join(name)).unwrap();
    let kept = std::fs::read_to_string(committed).unwrap();
    let _ = std::fs::remove_dir_all(&out);
    assert!(
        fresh == kept,
        "{} is stale: regenerate it from {} (copy the fresh output over it)",
        committed.display(),
        proto.display()
    );
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("idem-grpc-codegen-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn the_test_service_code_is_generated_from_its_proto() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    regenerate(
        &root.join("proto/idem_test.proto"),
        &root.join("proto"),
        &root.join("tests/it/pb/idem.test.v1.rs"),
    );
}
