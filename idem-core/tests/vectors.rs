//! The reference vectors: every key must match byte for byte.

use base64::Engine as _;
use idem_core::IdempotencyKey;

fn vectors_path() -> std::path::PathBuf {
    if let Ok(p) = std::env::var("IDEM_SEED_VECTORS") {
        return p.into();
    }
    // The workspace sits beside `shared/` (../shared from the repository root).
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/vectors/seed-keys.json")
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
