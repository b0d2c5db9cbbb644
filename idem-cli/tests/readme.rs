//! The README's failure table names a test on every row, and every test it names exists
//! as a `fn` in the workspace: a renamed or deleted test fails here, not silently in the
//! docs.

use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// Every `.rs` file of the workspace's crates (not `target`).
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read_dir") {
        let path = entry.expect("entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if !name.starts_with('.') && name != "target" {
                sources(&path, out);
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

/// The backticked snake_case names in `cell` (test names; commands have spaces).
fn test_names(cell: &str) -> Vec<&str> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .filter(|s| {
            s.contains('_')
                && s.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        })
        .collect()
}

#[test]
fn every_row_of_the_failure_table_names_tests_that_exist() {
    let readme = std::fs::read_to_string(repo().join("README.md")).expect("README.md");
    let section = readme
        .split("## Every failure, its outcome, its test")
        .nth(1)
        .expect("the README has the failure table");
    let section = section.split("\n## ").next().unwrap_or(section);
    let rows: Vec<&str> = section
        .lines()
        .filter(|l| l.starts_with('|') && !l.starts_with("|---") && !l.starts_with("| failure"))
        .collect();
    assert!(rows.len() >= 15, "the table has its rows: {}", rows.len());

    let mut files = Vec::new();
    sources(&repo(), &mut files);
    let code: String = files
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .collect::<Vec<_>>()
        .join("\n");

    let mut missing = Vec::new();
    for row in rows {
        let cells: Vec<&str> = row.split(" | ").collect();
        let last = cells.last().expect("a test cell");
        let names = test_names(last);
        let explorer = last.contains("--example explore");
        assert!(
            !names.is_empty() || explorer,
            "this row names no test: {row}"
        );
        for name in names {
            if !code.contains(&format!("fn {name}(")) {
                missing.push(name.to_owned());
            }
        }
    }
    assert!(
        missing.is_empty(),
        "named in the README, not found: {missing:?}"
    );
}

#[test]
fn the_name_extractor_skips_commands_and_keeps_test_names() {
    assert_eq!(
        test_names("`a_b_c`, `cargo run -p x`, `Gate`, `x_1`"),
        vec!["a_b_c", "x_1"]
    );
}
