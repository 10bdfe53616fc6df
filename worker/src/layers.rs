//! The worker's layers as lib.rs lists them, kept true: every `crate::NAME` path in the
//! worker's code (comments aside), each name of a `crate::{a, b::c}` group and each
//! `super::` path that climbs to the crate's root names a module of its own layer or of one
//! below it.

use std::collections::BTreeMap;
use std::path::Path;

/// Each top-level module's layer, 0 at the top: one per bullet of lib.rs's layout list, the
/// modules a bullet links to (`[`name`]`, not `[`name::sub`]`).
fn layers(lib: &str) -> BTreeMap<String, usize> {
    let mut layers = BTreeMap::new();
    let list = lib.lines().map(|l| l.trim_start_matches("//!")).skip_while(|l| !l.starts_with(" Layout"));
    let mut layer = None;
    for line in list.skip(1) {
        if line.starts_with(" - ") {
            layer = Some(layer.map_or(0, |n| n + 1));
        } else if layer.is_none() {
            continue; // the rest of the paragraph that introduces the list
        } else if !line.starts_with("   ") {
            break;
        }
        for link in line.split("[`").skip(1).filter_map(|l| l.split_once("`]")).map(|(name, _)| name) {
            if !link.contains("::") {
                layers.entry(link.to_string()).or_insert(layer.expect("a bullet"));
            }
        }
    }
    layers
}

/// `(module named, line)` of every `crate::NAME` outside comments in `source`, every name of a
/// `crate::{…}` group, and every `super::…::NAME` that climbs `depth` folders (the file's
/// depth under src/: 1 for `load/mod.rs` and `load/model.rs`, 2 for `load/int8/guard.rs`)
/// to the crate's root and names one of `modules` (in a file's inline `mod tests`, the same
/// `super`s stop a folder lower, at an item of the folder's own).
fn paths(source: &str, depth: usize, modules: &BTreeMap<String, usize>) -> Vec<(String, usize)> {
    let mut found = Vec::new();
    let word = |rest: &str| -> String { rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect() };
    let climb = format!("{}super::", "super::".repeat(depth));
    for (n, line) in source.lines().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        let climbs = code.split(climb.as_str()).skip(1).filter(|rest| modules.contains_key(&word(rest)));
        for rest in code.split("crate::").skip(1).chain(climbs) {
            match rest.strip_prefix('{') {
                // The names at the group's top level: `{a::x, b::{y, z}}` names a and b.
                Some(group) => {
                    let mut nesting = 0usize;
                    let mut at_start = true;
                    for (i, c) in group.char_indices() {
                        match c {
                            '{' => nesting += 1,
                            '}' if nesting == 0 => break,
                            '}' => nesting -= 1,
                            ',' if nesting == 0 => at_start = true,
                            c if at_start && !c.is_whitespace() => {
                                at_start = false;
                                found.push((word(&group[i..]), n + 1));
                            }
                            _ => {}
                        }
                    }
                }
                None => found.push((word(rest), n + 1)),
            }
        }
    }
    found
}

fn sources(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every use in the worker's sources that goes up `layers`: "file:line: top uses name".
fn upward(layers: &BTreeMap<String, usize>) -> Vec<String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    let mut upward = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(&src).unwrap();
        let top = relative.iter().next().unwrap().to_string_lossy().trim_end_matches(".rs").to_string();
        if top == "lib" || top == "layers" {
            continue;
        }
        let own = *layers.get(&top).unwrap_or_else(|| panic!("module {top} is not in lib.rs's layout list"));
        // load/int8/guard.rs is 2 folders down; load/mod.rs, as the folder itself, 0 (its
        // `super` is the root), like load.rs would be.
        let depth = relative.iter().count() - 1 - usize::from(file.ends_with("mod.rs"));
        for (name, line) in paths(&std::fs::read_to_string(file).unwrap(), depth, layers) {
            match layers.get(&name) {
                Some(&layer) if layer < own => upward.push(format!("{}:{line}: {top} uses {name}", relative.display())),
                Some(_) => {}
                None => panic!("{}:{line}: crate::{name} is not in lib.rs's layout list", relative.display()),
            }
        }
    }
    upward
}

fn lib_layers() -> BTreeMap<String, usize> {
    let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs");
    layers(&std::fs::read_to_string(lib).unwrap())
}

#[test]
fn no_module_uses_a_layer_above_its_own() {
    let layers = lib_layers();
    let upward = upward(&layers);
    assert!(upward.is_empty(), "uses that go up lib.rs's layers: {upward:#?}");
    assert!(layers.len() >= 9, "{layers:?}");
}

/// Where `load` belongs: above the runtime and the pipelines it builds, below what serves
/// requests (lib.rs's list puts it there): no file of `load/` uses a module above that place,
/// wherever the list moves it.
#[test]
fn load_fits_just_above_pipeline() {
    let mut layers = lib_layers();
    let (load, pipeline) = (layers["load"], layers["pipeline"]);
    for layer in layers.values_mut() {
        if *layer > load && *layer < pipeline {
            *layer -= 1;
        }
    }
    layers.insert("load".into(), pipeline - 1);
    let upward: Vec<String> = upward(&layers).into_iter().filter(|u| u.starts_with("load/")).collect();
    assert!(upward.is_empty(), "uses that would go up with load just above pipeline: {upward:#?}");
}

#[test]
fn the_list_is_read_as_written() {
    let lib = "//! Layout, by layer [`z`]\n//! and more:\n//! - [`a`]: x [`a::b`];\n//!   more [`c`]\n//! - [`d`]: y\n//!\n//! - [`e`]";
    let layers = layers(lib);
    assert_eq!(layers.clone().into_iter().collect::<Vec<_>>(), [("a".into(), 0), ("c".into(), 0), ("d".into(), 1)]);
    let uses = paths("use crate::a::b; // crate::d\nlet x = crate::c::f();", 0, &layers);
    assert_eq!(uses, [("a".to_string(), 1), ("c".to_string(), 2)]);
    let source = "use crate::{a::b, c::{d, e}, f};\nuse super::super::d::h;\nuse super::super::x;\nuse super::a;";
    let names: Vec<String> = paths(source, 1, &layers).into_iter().map(|(name, _)| name).collect();
    assert_eq!(names, ["a", "c", "f", "d"]);
}
