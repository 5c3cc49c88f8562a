//! Modules depend on each other one way, at every level: no module names a
//! sibling that names it back, directly or through other siblings (the
//! layering docs/architecture.md describes: `zarr` below `table`, the
//! writer below the array operations, `session` on top; inside a folder,
//! each operator's node below its operator below its rule). Read from the
//! sources: every `crate::...` and `super::...` path in a module's code is
//! an edge between the two children of the modules' nearest common parent.
//!
//! Paths are resolved as written: a name imported through a parent's
//! `pub use` counts as a use of the parent, not of the sibling defining
//! it, and a file's `#[cfg(test)] mod tests` (to the end of the file) is
//! left out.

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

/// The module path of `file` below `src` (`array/fft/table.rs` is
/// `["array", "fft", "table"]`, a `mod.rs` or `lib.rs` its folder's).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let relative = file.strip_prefix(src).unwrap().with_extension("");
    let mut path: Vec<String> = (relative.components())
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if path
        .last()
        .is_some_and(|last| last == "mod" || last == "lib" || last == "main")
    {
        path.pop();
    }
    path
}

/// The code of a file: comment lines left out (a doc link is not a
/// dependency), and its tests module.
fn code_of(text: &str) -> String {
    let mut code = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]")
            && lines
                .peek()
                .is_some_and(|next| next.trim_start().starts_with("mod tests"))
        {
            break;
        }
        if !trimmed.starts_with("//") {
            code.push(line);
        }
    }
    code.join("\n")
}

/// The paths after `crate::` and `super::` in `code`, each split into its
/// names and starting with `crate` or `super` (`super::super::x` keeps
/// both); a group `crate::{a::x, b::{y, z}}` gives one path per leaf.
fn module_paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for anchor in ["crate::", "super::"] {
        for (at, _) in code.match_indices(anchor) {
            let before = code[..at].chars().next_back();
            if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
                continue; // `super::` inside `super::super::`, or `xcrate::`
            }
            let root = anchor.trim_end_matches(':').to_string();
            expand(&code[at + anchor.len()..], vec![root], &mut out);
        }
    }
    out
}

/// Appends to `out` the paths of the use tree at the start of `rest`,
/// each after `prefix`.
fn expand(rest: &str, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
    let mut path = prefix;
    let mut rest = rest.trim_start();
    loop {
        if let Some(group) = rest.strip_prefix('{') {
            // The group's top-level items: split at commas outside braces.
            let (mut depth, mut item) = (0usize, String::new());
            for c in group.chars() {
                match c {
                    '}' if depth == 0 => break,
                    ',' if depth == 0 => expand(&std::mem::take(&mut item), path.clone(), out),
                    '{' | '}' => {
                        depth = if c == '{' { depth + 1 } else { depth - 1 };
                        item.push(c);
                    }
                    _ => item.push(c),
                }
            }
            expand(&item, path, out);
            return;
        }
        let name: String = (rest.chars())
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            break;
        }
        rest = &rest[name.len()..];
        path.push(name);
        match rest.strip_prefix("::") {
            Some(after) => rest = after.trim_start(),
            None => break,
        }
    }
    out.push(path);
}

/// Edges between sibling modules, keyed by their parent (`[]` for the
/// crate's top level), each with a file that makes it.
type Graphs = BTreeMap<Vec<String>, BTreeMap<(String, String), PathBuf>>;

/// Every module's sibling edges in the sources below `src`.
fn module_graphs(src: &Path) -> Graphs {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_of(src, f)).collect();
    let mut graphs = Graphs::new();
    for file in &files {
        let from = module_of(src, file);
        let code = code_of(&std::fs::read_to_string(file).unwrap());
        for path in module_paths(&code) {
            let mut target = match path[0].as_str() {
                "crate" => Vec::new(),
                _ => from.clone(),
            };
            let mut names = path.iter().skip(1).peekable();
            if path[0] == "super" {
                target.pop();
                while names.next_if(|n| *n == "super").is_some() {
                    target.pop();
                }
            }
            target.extend(names.filter(|n| *n != "self").cloned());
            // The longest prefix that is a module.
            while !target.is_empty() && !modules.contains(&target) {
                target.pop();
            }
            let common = (from.iter().zip(&target))
                .take_while(|(a, b)| a == b)
                .count();
            if common < from.len() && common < target.len() {
                let edge = (from[common].clone(), target[common].clone());
                (graphs.entry(from[..common].to_vec()).or_default())
                    .entry(edge)
                    .or_insert_with(|| file.clone());
            }
        }
    }
    graphs
}

/// The groups of two or more modules in `edges` that each reach all the
/// others (strongly connected components), each sorted.
fn cycles(edges: &BTreeMap<(String, String), PathBuf>) -> BTreeSet<Vec<String>> {
    let mut next: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (from, to) in edges.keys() {
        next.entry(from).or_default().push(to);
    }
    let reach = |start: &str| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut stack = vec![start];
        while let Some(node) = stack.pop() {
            for to in next.get(node).into_iter().flatten() {
                if seen.insert(to.to_string()) {
                    stack.push(to);
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&str, BTreeSet<String>> =
        next.keys().map(|node| (*node, reach(node))).collect();
    let mut groups = BTreeSet::new();
    for (node, from_node) in &reached {
        let group: Vec<String> = (from_node.iter())
            .filter(|other| {
                reached
                    .get(other.as_str())
                    .is_some_and(|r| r.contains(*node))
            })
            .cloned()
            .collect();
        if group.len() > 1 {
            groups.insert(group);
        }
    }
    groups
}

/// The cycles of `graphs`, keyed by parent, each edge inside them with the
/// file that makes it.
fn all_cycles(graphs: &Graphs) -> BTreeMap<String, Vec<String>> {
    let mut found = BTreeMap::new();
    for (parent, edges) in graphs {
        for group in cycles(edges) {
            let made_by: Vec<String> = (edges.iter())
                .filter(|((a, b), _)| group.contains(a) && group.contains(b))
                .map(|((a, b), file)| {
                    let file = file.strip_prefix(workspace()).unwrap_or(file);
                    format!("{a} -> {b} ({})", file.display())
                })
                .collect();
            let name = format!("{}: {}", parent.join("/"), group.join(" "));
            found.insert(name, made_by);
        }
    }
    found
}

/// The workspace's root folder.
fn workspace() -> &'static Path {
    let engine = Path::new(env!("CARGO_MANIFEST_DIR"));
    engine.parent().unwrap()
}

/// Fails on any cycle between the modules of `src` (below the
/// workspace's root), naming the files that make each edge of it.
fn check(src: &str) {
    let graphs = module_graphs(&workspace().join(src));
    let found: Vec<String> = (all_cycles(&graphs).into_iter())
        .map(|(name, edges)| format!("{src}/{name}: {}", edges.join(", ")))
        .collect();
    assert!(
        found.is_empty(),
        "modules in a cycle:\n{}",
        found.join("\n")
    );
}

#[test]
fn engine_modules_depend_on_each_other_one_way() {
    let graphs = module_graphs(&workspace().join("engine/src"));
    let top = &graphs[&Vec::new()];
    assert!(
        top.contains_key(&("array".to_string(), "table".to_string())),
        "the graph lost its edges: {top:?}"
    );
    assert!(
        graphs[&vec!["array".to_string()]].contains_key(&("copy".into(), "tasks".into())),
        "the graph lost its inner edges: {graphs:?}"
    );
    check("engine/src");
}

#[test]
fn the_other_crates_modules_depend_on_each_other_one_way() {
    for src in ["python/src", "cli/src", "udfs/src"] {
        check(src);
    }
}

#[test]
fn the_cycle_finder_finds_cycles() {
    let edge = |a: &str, b: &str| ((a.to_string(), b.to_string()), PathBuf::new());
    let acyclic: BTreeMap<_, _> = [edge("a", "b"), edge("b", "c"), edge("a", "c")].into();
    assert_eq!(cycles(&acyclic), BTreeSet::new());
    let cyclic: BTreeMap<_, _> = [
        edge("a", "b"),
        edge("b", "c"),
        edge("c", "a"),
        edge("c", "d"),
    ]
    .into_iter()
    .collect();
    assert_eq!(
        cycles(&cyclic),
        [vec!["a".to_string(), "b".into(), "c".into()]].into()
    );
    let strs = |paths: Vec<Vec<String>>| -> Vec<String> {
        paths.into_iter().map(|p| p.join("::")).collect()
    };
    assert_eq!(
        strs(module_paths(
            "use crate::{table::X, zarr::{A, b::B}}; crate::write::f(); use super::super::x::Y;"
        )),
        [
            "crate::table::X",
            "crate::zarr::A",
            "crate::zarr::b::B",
            "crate::write::f",
            "super::super::x::Y"
        ]
    );
    let code = code_of("use a;\n// use b;\n#[cfg(test)]\nmod tests {\n    use super::c;\n}\n");
    assert_eq!(code, "use a;");
}
