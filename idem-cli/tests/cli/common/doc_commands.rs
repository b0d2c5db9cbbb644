//! The documented `idem` command lines: every `idem …` or `cargo run … -p idem-cli -- …`
//! line of a `sh`, `bash`, `console` or `shell` block in `README.md`, `CHANGELOG.md`,
//! `docs/*.md` and every `README.md` of the workspace. Shared by `tests/cli/docs.rs` (links,
//! paths) and the `idem` binary's own unit test, which parses each line with the real
//! command-line parser.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub(crate) fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// Directories never searched: build output and hidden directories.
pub(crate) fn skipped_dir(name: &str) -> bool {
    name.starts_with('.') || name == "target" || name == "node_modules"
}

/// Every `README.md` under `dir`.
pub(crate) fn readmes(dir: &Path, out: &mut Vec<PathBuf>) {
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
pub(crate) fn docs() -> Vec<(PathBuf, String)> {
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
pub(crate) fn shown(path: &Path) -> String {
    path.strip_prefix(repo())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// A fence line's marker (```` ``` ```` or `~~~`) and its info string, if it is one.
pub(crate) fn fence(line: &str) -> Option<&str> {
    let t = line.trim_start();
    t.strip_prefix("```")
        .or_else(|| t.strip_prefix("~~~"))
        .map(str::trim)
}

/// The lines outside fenced code blocks, numbered from 1.
pub(crate) fn prose(text: &str) -> Vec<(usize, &str)> {
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
pub(crate) fn code_blocks(text: &str) -> Vec<(String, Vec<(usize, &str)>)> {
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

/// One piece of a shell line: a word (quotes and backslashes resolved) or an operator
/// (`|`, `>`, `<`, `;`, `&`) that makes the line more than one plain command.
#[derive(Debug, PartialEq)]
pub(crate) enum Piece {
    Word(String),
    Operator,
}

/// Splits a shell line into words: single and double quotes, backslash escapes, a `#`
/// comment at the start of a word. `None` for a command substitution (`$(`, a backtick).
pub(crate) fn shell_words(line: &str) -> Option<Vec<Piece>> {
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
pub(crate) fn assignment(word: &str) -> Option<(&str, &str)> {
    let (name, value) = word.split_once('=')?;
    let mut chars = name.chars();
    let first = chars.next()?;
    ((first.is_ascii_alphabetic() || first == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_'))
    .then_some((name, value))
}

/// What one documented command line runs: the `idem` arguments, and the variables the
/// line assigns before the command.
pub(crate) type Invocation = (Vec<String>, Vec<(String, String)>);

/// The `idem` arguments (and the environment it is given) of one documented command line,
/// or `None` when the line does not run the `idem` command.
pub(crate) fn idem_invocation(line: &str) -> Option<Invocation> {
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
pub(crate) fn command_lines(lang: &str, lines: &[(usize, &str)]) -> Vec<(usize, String)> {
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

/// Every documented `idem` invocation: where it is (`doc:line`), the line, and what it runs.
pub(crate) fn documented_invocations() -> Vec<(String, String, Invocation)> {
    let mut out = Vec::new();
    for (doc, text) in docs() {
        for (lang, lines) in code_blocks(&text) {
            if !["sh", "bash", "console", "shell"].contains(&lang.as_str()) {
                continue;
            }
            for (n, line) in command_lines(&lang, &lines) {
                if let Some(invocation) = idem_invocation(&line) {
                    out.push((format!("{}:{n}", shown(&doc)), line, invocation));
                }
            }
        }
    }
    out
}
