//! The docs hold up: in `README.md`, `CHANGELOG.md`, `docs/*.md` and every `README.md` of
//! the workspace, every relative link points at a file or directory that exists (and, with
//! a `#anchor` into a markdown file, at one of its headings); no doc names a path outside
//! the repository; and every test the failure table names exists. (Every documented
//! `idem …` command line is parsed by the real parser in the `idem` binary's own unit
//! tests, from `common/doc_commands.rs`.)

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

#[path = "common/doc_commands.rs"]
mod doc_commands;

use doc_commands::*;

/// `line` with its inline code spans taken out (a link inside backticks is not a link).
fn without_code_spans(line: &str) -> String {
    let mut out = String::new();
    let mut rest = line;
    while let Some(start) = rest.find('`') {
        out.push_str(&rest[..start]);
        let run = rest[start..].chars().take_while(|&c| c == '`').count();
        let after = &rest[start + run..];
        let marker = "`".repeat(run);
        match after.find(&marker) {
            Some(end) => rest = &after[end + run..],
            None => {
                out.push_str(&rest[start..]);
                return out;
            }
        }
    }
    out.push_str(rest);
    out
}

/// The targets of the inline links `[text](target)` and reference definitions
/// `[label]: target` of one prose line.
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code_spans(line);
    let mut targets = Vec::new();
    let trimmed = line.trim_start();
    if trimmed.starts_with('[') {
        if let Some(end) = trimmed.find("]:") {
            if let Some(target) = trimmed[end + 2..].split_whitespace().next() {
                targets.push(target.to_owned());
            }
        }
    }
    let mut rest = line.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let mut depth = 0usize;
        let mut end = after.len();
        for (i, c) in after.char_indices() {
            match c {
                '(' => depth += 1,
                ')' if depth == 0 => {
                    end = i;
                    break;
                }
                ')' => depth -= 1,
                _ => {}
            }
        }
        let inner = after[..end].trim();
        let target = inner.split_whitespace().next().unwrap_or("");
        let target = target.trim_start_matches('<').trim_end_matches('>');
        targets.push(target.to_owned());
        rest = &after[end.min(after.len())..];
    }
    targets
}

/// The anchor a heading gets, as GitHub makes it: lower case, letters, digits, `-` and `_`
/// kept, spaces turned into `-`, everything else dropped.
fn slug(heading: &str) -> String {
    let text = without_code_spans_keeping_text(heading);
    let mut out = String::new();
    for c in text.trim().to_lowercase().chars() {
        if c.is_alphanumeric() || c == '-' || c == '_' {
            out.push(c);
        } else if c == ' ' {
            out.push('-');
        }
    }
    out
}

/// A heading's text as rendered: code spans keep their text, links their label.
fn without_code_spans_keeping_text(heading: &str) -> String {
    let mut text = heading.replace('`', "");
    while let (Some(open), Some(mid)) = (text.find('['), text.find("](")) {
        let Some(close) = text[mid..].find(')').map(|c| mid + c) else {
            break;
        };
        if open > mid {
            break;
        }
        text = format!(
            "{}{}{}",
            &text[..open],
            &text[open + 1..mid],
            &text[close + 1..]
        );
    }
    text
}

/// The anchors of a markdown text's headings (a repeated heading gets `-1`, `-2`, …).
fn anchors(text: &str) -> HashSet<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = HashSet::new();
    for (_, line) in prose(text) {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = slug(line[hashes..].trim().trim_end_matches('#'));
        let n = seen.entry(base.clone()).or_insert(0);
        out.insert(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}

fn external(target: &str) -> bool {
    ["http://", "https://", "mailto:"]
        .iter()
        .any(|p| target.starts_with(p))
}

/// What is wrong with one link target of `doc`, if anything.
fn check_link(doc: &Path, doc_text: &str, target: &str) -> Option<String> {
    if target.is_empty() || external(target) {
        return None;
    }
    let (path, anchor) = match target.split_once('#') {
        Some((p, a)) => (p, Some(a)),
        None => (target, None),
    };
    let resolved = if path.is_empty() {
        doc.to_path_buf()
    } else if let Some(from_root) = path.strip_prefix('/') {
        repo().join(from_root)
    } else {
        doc.parent().expect("a doc's directory").join(path)
    };
    if !resolved.exists() {
        return Some(format!("{target}: {} does not exist", resolved.display()));
    }
    let root = repo().canonicalize().expect("repo");
    let canonical = resolved.canonicalize().expect("an existing path");
    if !canonical.starts_with(&root) {
        return Some(format!("{target}: outside the repository"));
    }
    let anchor = anchor.filter(|a| !a.is_empty())?;
    if canonical.extension().is_none_or(|e| e != "md") {
        return None;
    }
    let text = if path.is_empty() {
        doc_text.to_owned()
    } else {
        std::fs::read_to_string(&canonical).expect("a markdown file")
    };
    if anchors(&text).contains(anchor) {
        None
    } else {
        Some(format!(
            "{target}: no heading #{anchor} in {}",
            shown(&canonical)
        ))
    }
}

#[test]
fn every_relative_link_of_the_docs_points_at_something_that_exists() {
    let mut broken = Vec::new();
    let mut links = 0;
    for (doc, text) in docs() {
        for (n, line) in prose(&text) {
            for target in link_targets(line) {
                links += 1;
                if let Some(problem) = check_link(&doc, &text, &target) {
                    broken.push(format!("{}:{n}: {problem}", shown(&doc)));
                }
            }
        }
    }
    assert!(links > 20, "the docs have their links: {links}");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn no_doc_names_a_path_outside_the_repository() {
    let outside = ["..", "shared"].join("/");
    let mut found = Vec::new();
    for (doc, text) in docs() {
        for (i, line) in text.lines().enumerate() {
            if line.contains(&outside) {
                found.push(format!("{}:{}: {line}", shown(&doc), i + 1));
            }
        }
    }
    assert!(
        found.is_empty(),
        "paths outside the repository:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_readme_starts_with_the_demo_and_the_test_command() {
    let readme = std::fs::read_to_string(repo().join("README.md")).expect("README.md");
    let (lang, lines) = code_blocks(&readme)
        .into_iter()
        .next()
        .expect("a code block");
    assert_eq!(lang, "sh");
    let commands: Vec<&str> = lines
        .iter()
        .map(|(_, l)| l.split('#').next().unwrap_or("").trim())
        .collect();
    assert_eq!(
        commands,
        [
            "cargo run --release -p idem-cli --no-default-features -- demo",
            "scripts/test"
        ]
    );
}

/// Every `.rs` file of the workspace (not build output).
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read_dir") {
        let path = entry.expect("entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if !skipped_dir(name) {
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
    let doc = std::fs::read_to_string(repo().join("docs/operations.md")).expect("operations");
    let section = doc
        .split("## Every failure, its outcome, its test")
        .nth(1)
        .expect("docs/operations.md has the failure table");
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
        assert!(
            !names.is_empty() || last.contains("--example explore"),
            "this row names no test: {row}"
        );
        for name in names {
            if !code.contains(&format!("fn {name}(")) && !code.contains(&format!("fn {name}<")) {
                missing.push(name.to_owned());
            }
        }
    }
    assert!(
        missing.is_empty(),
        "named in docs/operations.md, not found: {missing:?}"
    );
}

#[test]
fn the_helpers_split_words_find_links_and_make_anchors() {
    let words = |l| match shell_words(l) {
        Some(p) => p
            .into_iter()
            .map(|p| match p {
                Piece::Word(w) => w,
                Piece::Operator => "|op|".into(),
            })
            .collect::<Vec<_>>(),
        None => vec!["|none|".into()],
    };
    assert_eq!(
        words(r#"idem a 'b c' "d \"e\"" f\ g # note"#),
        ["idem", "a", "b c", "d \"e\"", "f g"]
    );
    assert_eq!(words("idem a | head"), ["idem", "a", "|op|", "head"]);
    assert_eq!(words("idem a $(cat x)"), ["|none|"]);
    assert_eq!(
        idem_invocation("A=1 idem key --award-id x"),
        Some((
            vec!["key".into(), "--award-id".into(), "x".into()],
            vec![("A".into(), "1".into())]
        ))
    );
    assert_eq!(
        idem_invocation("cargo run --release -p idem-cli -- demo   # ok"),
        Some((vec!["demo".into()], vec![]))
    );
    assert_eq!(idem_invocation("cargo run -p grant-pipeline -- x"), None);
    assert_eq!(idem_invocation("idem demo > out.txt"), None);
    assert_eq!(
        command_lines("sh", &[(1, "idem a \\"), (2, "  --b c"), (3, "idem d")]),
        [(1, "idem a  --b c".to_owned()), (3, "idem d".to_owned())]
    );
    assert_eq!(
        command_lines("console", &[(1, "$ idem a"), (2, "output")]),
        [(1, "idem a".to_owned())]
    );
    assert_eq!(
        link_targets("see [a](docs/x.md#y) and `[b](no)` and [c](z.md \"t\")"),
        ["docs/x.md#y", "z.md"]
    );
    assert_eq!(
        slug("Watching it run: `--metrics-addr`"),
        "watching-it-run---metrics-addr"
    );
    assert_eq!(slug("Crates à la carte"), "crates-à-la-carte");
    assert!(check_link(&repo().join("README.md"), "", "docs/nowhere.md").is_some());
    assert!(check_link(&repo().join("README.md"), "", "docs/operations.md#nowhere").is_some());
    assert!(check_link(&repo().join("README.md"), "", "docs/operations.md").is_none());
}
