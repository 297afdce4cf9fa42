//! The proxy's code stays in pieces a reader can hold: no source file over 500 lines
//! outside its tests, no function over 80 lines, in the proxy and in the cell's lock
//! log. A file or function past the line is where one job became two: split it by
//! what it does (docs/design.md names the parts).

use std::path::{Path, PathBuf};

const MAX_FILE_LINES: usize = 500;
const MAX_FN_LINES: usize = 80;

/// Every `.rs` file under `dir`.
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("a source folder") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// The lines of `text` before its unit tests.
fn code_lines(text: &str) -> Vec<&str> {
    let lines: Vec<&str> = text.lines().collect();
    let end = lines
        .windows(2)
        .position(|w| w[0].starts_with("#[cfg(test)]") && w[1].starts_with("mod tests"))
        .unwrap_or(lines.len());
    lines[..end].to_vec()
}

/// Each function of `lines` with its length: from its `fn` line to the closing brace
/// at the same indentation.
fn functions<'a>(lines: &[&'a str]) -> Vec<(&'a str, usize)> {
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let body = line.trim_start();
        let indent = &line[..line.len() - body.len()];
        let signature = [
            "pub ",
            "pub(crate) ",
            "pub(super) ",
            "async ",
            "const ",
            "unsafe ",
        ]
        .iter()
        .fold(body, |rest, prefix| {
            rest.strip_prefix(prefix).unwrap_or(rest)
        });
        let signature = signature
            .strip_prefix("pub(in ")
            .and_then(|rest| rest.split_once(") "))
            .map_or(signature, |(_, rest)| rest);
        let signature = signature.strip_prefix("async ").unwrap_or(signature);
        let Some(name) = signature.strip_prefix("fn ") else {
            continue;
        };
        let name = name.split(['(', '<']).next().unwrap_or_default();
        let close = format!("{indent}}}");
        if let Some(end) = lines[i + 1..].iter().position(|l| *l == close) {
            found.push((name, end + 2));
        }
    }
    found
}

#[test]
fn no_file_or_function_is_past_its_size() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = sources(&root.join("src"));
    files.extend(sources(&root.join("../cell/src/locklog")));
    let mut past = Vec::new();
    for path in &files {
        let text = std::fs::read_to_string(path).expect("a source file");
        let lines = code_lines(&text);
        let shown = path
            .strip_prefix(root)
            .unwrap_or(path)
            .display()
            .to_string();
        if lines.len() > MAX_FILE_LINES {
            past.push(format!("{shown}: {} lines", lines.len()));
        }
        for (name, length) in functions(&lines) {
            if length > MAX_FN_LINES {
                past.push(format!("{shown}: fn {name} is {length} lines"));
            }
        }
    }
    assert!(files.len() > 50, "found only {} source files", files.len());
    assert!(
        past.is_empty(),
        "over {MAX_FILE_LINES} lines a file or {MAX_FN_LINES} a function:\n{}",
        past.join("\n")
    );
}

#[test]
fn the_size_check_sees_a_long_function_and_a_test_module() {
    let mut text = String::from("fn short() {\n}\n\n    pub(super) async fn long() {\n");
    text.push_str(&"        step();\n".repeat(90));
    text.push_str("    }\n#[cfg(test)]\nmod tests {\n");
    text.push_str(&"    x();\n".repeat(600));
    let lines = code_lines(&text);
    assert_eq!(lines.len(), 95);
    assert_eq!(functions(&lines), vec![("short", 2), ("long", 92)]);
}
