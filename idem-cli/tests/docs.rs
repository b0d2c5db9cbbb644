//! The docs hold up: in `README.md`, `CHANGELOG.md`, `docs/*.md` and every `README.md` of
//! the workspace, every relative link points at a file or directory that exists (and, with
//! a `#anchor` into a markdown file, at one of its headings); no doc names a path outside
//! the repository; every test the failure table names exists; and every `idem …` or
//! `cargo run … -p idem-cli -- …` line of a `sh`, `bash` or `console` block parses with the
//! real command (the binary run with `IDEM_PARSE_ONLY=1`, which exits 0 once its arguments
//! parse, doing nothing).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// Directories never searched: build output and hidden directories.
fn skipped_dir(name: &str) -> bool {
    name.starts_with('.') || name == "target" || name == "node_modules"
}

/// Every `README.md` under `dir`.
fn readmes(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read_dir") {
        let path = entry.expect("entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if !skipped_dir(name) {
                readmes(&path, out);
            }
        } else if name == "README.md" {
            out.push(path);
        }
    }
}

/// The docs this test checks, with their text.
fn docs() -> Vec<(PathBuf, String)> {
    let root = repo();
    let mut paths = vec![root.join("README.md"), root.join("CHANGELOG.md")];
    for entry in std::fs::read_dir(root.join("docs")).expect("docs/") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "md") {
            paths.push(path);
        }
    }
    readmes(&root, &mut paths);
    paths.sort();
    paths.dedup();
    paths
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{p:?}: {e}"));
            (p, text)
        })
        .collect()
}

/// A doc's path as the messages show it.
fn shown(path: &Path) -> String {
    path.strip_prefix(repo())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// A fence line's marker (```` ``` ```` or `~~~`) and its info string, if it is one.
fn fence(line: &str) -> Option<&str> {
    let t = line.trim_start();
    t.strip_prefix("```")
        .or_else(|| t.strip_prefix("~~~"))
        .map(str::trim)
}

/// The lines outside fenced code blocks, numbered from 1.
fn prose(text: &str) -> Vec<(usize, &str)> {
    let mut inside = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if fence(line).is_some() {
            inside = !inside;
        } else if !inside {
            out.push((i + 1, line));
        }
    }
    out
}

/// The fenced code blocks: their language (the info string's first word) and numbered lines.
fn code_blocks(text: &str) -> Vec<(String, Vec<(usize, &str)>)> {
    let mut blocks = Vec::new();
    let mut open: Option<(String, Vec<(usize, &str)>)> = None;
    for (i, line) in text.lines().enumerate() {
        match (fence(line), open.take()) {
            (Some(info), None) => {
                let lang = info
                    .split(|c: char| c.is_whitespace() || c == ',')
                    .next()
                    .unwrap_or("")
                    .to_owned();
                open = Some((lang, Vec::new()));
            }
            (Some(_), Some(block)) => blocks.push(block),
            (None, Some(mut block)) => {
                block.1.push((i + 1, line));
                open = Some(block);
            }
            (None, None) => {}
        }
    }
    blocks
}

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
        ["cargo run --release -p idem-cli -- demo", "scripts/test"]
    );
}

/// One piece of a shell line: a word (quotes and backslashes resolved) or an operator
/// (`|`, `>`, `<`, `;`, `&`) that makes the line more than one plain command.
#[derive(Debug, PartialEq)]
enum Piece {
    Word(String),
    Operator,
}

/// Splits a shell line into words: single and double quotes, backslash escapes, a `#`
/// comment at the start of a word. `None` for a command substitution (`$(`, a backtick).
fn shell_words(line: &str) -> Option<Vec<Piece>> {
    let mut pieces = Vec::new();
    let mut word: Option<String> = None;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                let w = word.get_or_insert_with(String::new);
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => w.push(c),
                        None => return None,
                    }
                }
            }
            '"' => {
                let w = word.get_or_insert_with(String::new);
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(c @ ('"' | '\\' | '$' | '`')) => w.push(c),
                            Some(c) => {
                                w.push('\\');
                                w.push(c);
                            }
                            None => return None,
                        },
                        Some('$') if chars.peek() == Some(&'(') => return None,
                        Some('`') => return None,
                        Some(c) => w.push(c),
                        None => return None,
                    }
                }
            }
            '\\' => {
                if let Some(next) = chars.next() {
                    word.get_or_insert_with(String::new).push(next);
                }
            }
            '$' if chars.peek() == Some(&'(') => return None,
            '`' => return None,
            '#' if word.is_none() => break,
            c if c.is_whitespace() => {
                if let Some(w) = word.take() {
                    pieces.push(Piece::Word(w));
                }
            }
            '|' | '>' | '<' | ';' | '&' => {
                if let Some(w) = word.take() {
                    pieces.push(Piece::Word(w));
                }
                pieces.push(Piece::Operator);
            }
            c => word.get_or_insert_with(String::new).push(c),
        }
    }
    if let Some(w) = word {
        pieces.push(Piece::Word(w));
    }
    Some(pieces)
}

/// A variable assignment word, `NAME=value`.
fn assignment(word: &str) -> Option<(&str, &str)> {
    let (name, value) = word.split_once('=')?;
    let mut chars = name.chars();
    let first = chars.next()?;
    ((first.is_ascii_alphabetic() || first == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_'))
    .then_some((name, value))
}

/// What one documented command line runs: the `idem` arguments, and the variables the
/// line assigns before the command.
type Invocation = (Vec<String>, Vec<(String, String)>);

/// The `idem` arguments (and the environment it is given) of one documented command line,
/// or `None` when the line does not run the `idem` command.
fn idem_invocation(line: &str) -> Option<Invocation> {
    let pieces = shell_words(line)?;
    if pieces.contains(&Piece::Operator) {
        return None;
    }
    let mut words: Vec<String> = pieces
        .into_iter()
        .map(|p| match p {
            Piece::Word(w) => w,
            Piece::Operator => unreachable!("lines with operators are skipped"),
        })
        .collect();
    let mut env = Vec::new();
    while let Some((name, value)) = words.first().and_then(|w| assignment(w)) {
        env.push((name.to_owned(), value.to_owned()));
        words.remove(0);
    }
    match words.first().map(String::as_str) {
        Some("idem") => Some((words[1..].to_vec(), env)),
        Some("cargo") if words.get(1).is_some_and(|w| w == "run") => {
            let dashes = words.iter().position(|w| w == "--")?;
            let options = &words[..dashes];
            let cli = options
                .windows(2)
                .any(|w| (w[0] == "-p" || w[0] == "--package") && w[1] == "idem-cli")
                || options
                    .iter()
                    .any(|w| w == "-pidem-cli" || w == "--package=idem-cli");
            cli.then(|| (words[dashes + 1..].to_vec(), env))
        }
        _ => None,
    }
}

/// The command lines of a shell block: continuation lines joined, a console block's
/// prompts (`$ `) stripped and its output left out, each with its first line's number.
fn command_lines(lang: &str, lines: &[(usize, &str)]) -> Vec<(usize, String)> {
    let mut out: Vec<(usize, String)> = Vec::new();
    let mut pending: Option<(usize, String)> = None;
    for &(n, raw) in lines {
        let line = raw.trim();
        let (start, mut text) = match pending.take() {
            Some((start, text)) => (start, text + " " + line),
            None => {
                let line = match line.strip_prefix("$ ") {
                    Some(command) => command,
                    None if lang == "console" => continue,
                    None => line,
                };
                (n, line.to_owned())
            }
        };
        if text.ends_with('\\') {
            text.pop();
            pending = Some((start, text));
        } else {
            out.push((start, text));
        }
    }
    out.extend(pending);
    out
}

#[test]
fn every_documented_idem_command_parses() {
    let mut failures = Vec::new();
    let mut checked = 0;
    for (doc, text) in docs() {
        for (lang, lines) in code_blocks(&text) {
            if !["sh", "bash", "console", "shell"].contains(&lang.as_str()) {
                continue;
            }
            for (n, line) in command_lines(&lang, &lines) {
                let Some((args, env)) = idem_invocation(&line) else {
                    continue;
                };
                checked += 1;
                let out = Command::new(env!("CARGO_BIN_EXE_idem"))
                    .args(&args)
                    .env("IDEM_PARSE_ONLY", "1")
                    .env("NO_COLOR", "1")
                    .env_remove("IDEM_STORE")
                    .env_remove("DATABASE_URL")
                    .env_remove("IDEM_BROKER")
                    .env_remove("IDEM_FRONT_FILTER")
                    .envs(env)
                    .output()
                    .expect("run idem");
                if !out.status.success() {
                    failures.push(format!(
                        "{}:{n}: `{line}` does not parse ({}):\n{}",
                        shown(&doc),
                        out.status,
                        String::from_utf8_lossy(&out.stderr).trim_end()
                    ));
                }
            }
        }
    }
    assert!(checked > 20, "the docs show their commands: {checked}");
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
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
            if !code.contains(&format!("fn {name}(")) {
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
