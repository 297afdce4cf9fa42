//! No module of the proxy imports one that imports it back (a module and the modules
//! declared inside it excepted: `mod.rs` declares them, they use what it defines). A
//! cycle is where a module stops having one job: see docs/design.md.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Every module of `src`, by path (`etcd_api::lease`), with its code outside tests and
/// comments.
fn modules(src: &Path) -> BTreeMap<String, String> {
    let mut found = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("a source folder") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let relative = path
                .strip_prefix(src)
                .expect("under src")
                .with_extension("");
            let mut name = relative.to_string_lossy().replace('/', "::");
            if let Some(parent) = name.strip_suffix("::mod") {
                name = parent.to_owned();
            }
            if name == "lib" || name == "main" {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("a source file");
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            let code: String = code
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            found.insert(name, code);
        }
    }
    found
}

/// The modules `code` (of module `module`) names through `crate::` or `super::` paths.
fn uses(module: &str, code: &str, all: &BTreeMap<String, String>) -> BTreeSet<String> {
    let mut named = BTreeSet::new();
    for start in ["crate::", "super::"] {
        for (at, _) in code.match_indices(start) {
            if code[..at]
                .chars()
                .last()
                .is_some_and(|c| c.is_alphanumeric() || c == '_')
            {
                continue;
            }
            let path: String = code[at..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            let mut parts: Vec<&str> = path.split("::").filter(|p| !p.is_empty()).collect();
            let mut base: Vec<&str> = Vec::new();
            if parts.first() == Some(&"crate") {
                parts.remove(0);
            } else {
                base = module.split("::").collect();
                base.pop();
                while parts.first() == Some(&"super") {
                    parts.remove(0);
                    if parts.first() == Some(&"super") {
                        base.pop();
                    }
                }
            }
            let mut best = None;
            let mut current = base.clone();
            for part in parts {
                current.push(part);
                let name = current.join("::");
                if all.contains_key(&name) {
                    best = Some(name);
                }
            }
            if let Some(target) = best {
                let inside = module.starts_with(&format!("{target}::"));
                if target != module && !inside {
                    named.insert(target);
                }
            }
        }
    }
    named
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let all = modules(&src);
    assert!(
        all.contains_key("etcd_api::lease"),
        "the proxy's modules were read"
    );
    let edges: BTreeMap<&String, BTreeSet<String>> = all
        .iter()
        .map(|(m, code)| (m, uses(m, code, &all)))
        .collect();
    let mut cycles = Vec::new();
    for (a, targets) in &edges {
        for b in targets {
            if edges.get(b).is_some_and(|back| back.contains(*a)) && *a < b {
                cycles.push(format!("{a} <-> {b}"));
            }
        }
    }
    assert!(
        cycles.is_empty(),
        "modules that import each other: {cycles:?}"
    );
}

#[test]
fn a_cycle_is_seen() {
    let mut all = BTreeMap::new();
    all.insert("a".to_owned(), "use crate::b::Thing;".to_owned());
    all.insert("b".to_owned(), "fn f() { crate::a::go() }".to_owned());
    all.insert("c::d".to_owned(), "use super::e::X; // crate::a".to_owned());
    all.insert("c::e".to_owned(), String::new());
    assert_eq!(uses("a", &all["a"], &all), BTreeSet::from(["b".to_owned()]));
    assert_eq!(uses("b", &all["b"], &all), BTreeSet::from(["a".to_owned()]));
    assert!(uses("c::d", &all["c::d"], &all).contains("c::e"));
}
