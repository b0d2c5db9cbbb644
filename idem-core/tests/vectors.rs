//! The reference vectors: every key must match byte for byte.

use base64::Engine as _;
use std::path::{Path, PathBuf};

use idem_core::IdempotencyKey;

/// The copy kept in this crate (`tests/vectors/seed-keys.json`), so the test runs in any
/// clone; `IDEM_SEED_VECTORS` points it at another file.
fn vectors_path() -> PathBuf {
    if let Ok(p) = std::env::var("IDEM_SEED_VECTORS") {
        return p.into();
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vectors/seed-keys.json")
}

/// The reference derivation's vector file, kept in the repository beside this test
/// (`tests/vectors/seed-keys.json`): the copy above must be byte-identical to it.
fn reference_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vectors/seed-keys.json")
}

#[test]
fn the_kept_copy_is_the_reference_file() {
    let reference = reference_path();
    let Ok(want) = std::fs::read(&reference) else {
        // A clone away from the reference design: the copy is all there is. Say so in
        // the output rather than pass silently.
        eprintln!(
            "{} not found: the kept copy is checked against the keys only",
            reference.display()
        );
        return;
    };
    let kept = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vectors/seed-keys.json");
    let got = std::fs::read(&kept).expect("the kept copy");
    assert!(
        got == want,
        "{} differs from {}: copy the reference file again",
        kept.display(),
        reference.display()
    );
}

#[test]
fn every_seed_vector_matches() {
    let path = vectors_path();
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e} (set IDEM_SEED_VECTORS)", path.display()));
    let vectors: Vec<serde_json::Value> = serde_json::from_str(&text).expect("vectors are JSON");
    assert!(
        vectors.len() >= 10,
        "expected the full vector file, got {}",
        vectors.len()
    );
    for v in &vectors {
        let award = v["award_id"].as_str().expect("award_id");
        let ts = v["submission_timestamp"]
            .as_str()
            .expect("submission_timestamp");
        let payload = base64::engine::general_purpose::STANDARD
            .decode(v["payload_b64"].as_str().expect("payload_b64"))
            .expect("base64");
        let want = v["key"].as_str().expect("key");
        let got = IdempotencyKey::derive(award, ts, &payload).expect("derivable");
        assert_eq!(got.to_string(), want, "vector for award {award:?}");
    }
}
