//! The engine's top-level modules depend on each other one way: no module
//! names another that names it back, directly or through others (the
//! layering docs/architecture.md describes: `zarr` below `table`, the
//! writer below the array operations, `session` on top). Read from the
//! sources: every `crate::<module>` path in a module's files is an edge.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The modules named after `crate::` in the code of `text` (comment lines
/// left out: a doc link is not a dependency), a `crate::{a::x, b::{y}}`
/// group giving each of its first names.
fn crate_paths(text: &str) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let code: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        let Some(group) = rest.strip_prefix('{') else {
            out.push(ident(rest));
            continue;
        };
        // The group's top-level items: split at commas outside inner braces.
        let (mut depth, mut item) = (0usize, String::new());
        for c in group.chars() {
            match c {
                '}' if depth == 0 => break,
                ',' if depth == 0 => out.push(ident(&std::mem::take(&mut item))),
                '{' | '}' => {
                    depth = if c == '{' { depth + 1 } else { depth - 1 };
                    item.push(c);
                }
                _ => item.push(c),
            }
        }
        out.push(ident(&item));
    }
    out.retain(|name| !name.is_empty());
    out
}

/// Edges between the top-level modules of `src`, each with a file that
/// makes it.
fn module_graph(src: &Path) -> BTreeMap<(String, String), PathBuf> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let module_of = |file: &Path| -> String {
        let relative = file.strip_prefix(src).unwrap();
        let first = relative.components().next().unwrap().as_os_str();
        first.to_string_lossy().trim_end_matches(".rs").to_string()
    };
    let modules: BTreeSet<String> = files.iter().map(|f| module_of(f)).collect();
    let mut edges = BTreeMap::new();
    for file in &files {
        let from = module_of(file);
        for to in crate_paths(&std::fs::read_to_string(file).unwrap()) {
            if to != from && modules.contains(&to) {
                edges
                    .entry((from.clone(), to))
                    .or_insert_with(|| file.clone());
            }
        }
    }
    edges
}

/// A cycle of modules in `edges`, if any (depth-first search).
fn find_cycle(edges: &BTreeMap<(String, String), PathBuf>) -> Option<Vec<String>> {
    let mut next: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (from, to) in edges.keys() {
        next.entry(from).or_default().push(to);
    }
    fn visit<'a>(
        node: &'a str,
        next: &BTreeMap<&'a str, Vec<&'a str>>,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| *n == node) {
            let mut cycle: Vec<String> = path[at..].iter().map(|s| s.to_string()).collect();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if !done.insert(node) {
            return None;
        }
        path.push(node);
        for to in next.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(to, next, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    let nodes: Vec<&str> = next.keys().copied().collect();
    nodes
        .into_iter()
        .find_map(|node| visit(node, &next, &mut Vec::new(), &mut done))
}

#[test]
fn top_level_modules_depend_on_each_other_one_way() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let edges = module_graph(&src);
    assert!(
        edges.contains_key(&("array".to_string(), "table".to_string())),
        "the graph lost its edges: {edges:?}"
    );
    if let Some(cycle) = find_cycle(&edges) {
        let made_by: Vec<String> = cycle
            .windows(2)
            .map(|pair| {
                let file = &edges[&(pair[0].clone(), pair[1].clone())];
                format!("{} -> {} ({})", pair[0], pair[1], file.display())
            })
            .collect();
        panic!("modules in a cycle: {}", made_by.join(", "));
    }
}

#[test]
fn the_cycle_finder_finds_cycles() {
    let edge = |a: &str, b: &str| ((a.to_string(), b.to_string()), PathBuf::new());
    let acyclic: BTreeMap<_, _> = [edge("a", "b"), edge("b", "c"), edge("a", "c")].into();
    assert_eq!(find_cycle(&acyclic), None);
    let cyclic: BTreeMap<_, _> = [edge("a", "b"), edge("b", "c"), edge("c", "a")].into();
    assert_eq!(
        find_cycle(&cyclic),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    assert_eq!(
        crate_paths("use crate::{table::X, zarr::{A, B}}; crate::write::f()"),
        ["table", "zarr", "write"]
    );
}
