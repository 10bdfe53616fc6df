//! The worker's layers as lib.rs lists them, kept true: every `crate::NAME` path in the
//! worker's code (comments aside) names a module of its own layer or of one below it.

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

/// `(module named, line)` of every `crate::NAME` outside comments in `source`.
fn paths(source: &str) -> Vec<(String, usize)> {
    let mut found = Vec::new();
    for (n, line) in source.lines().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        for rest in code.split("crate::").skip(1) {
            let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            found.push((name, n + 1));
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

#[test]
fn no_module_uses_a_layer_above_its_own() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let layers = layers(&std::fs::read_to_string(src.join("lib.rs")).unwrap());
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut upward = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(&src).unwrap();
        let top = relative.iter().next().unwrap().to_string_lossy().trim_end_matches(".rs").to_string();
        if top == "lib" || top == "layers" {
            continue;
        }
        let own = *layers.get(&top).unwrap_or_else(|| panic!("module {top} is not in lib.rs's layout list"));
        for (name, line) in paths(&std::fs::read_to_string(file).unwrap()) {
            match layers.get(&name) {
                Some(&layer) if layer < own => upward.push(format!("{}:{line}: {top} uses {name}", relative.display())),
                Some(_) => {}
                None => panic!("{}:{line}: crate::{name} is not in lib.rs's layout list", relative.display()),
            }
        }
    }
    assert!(upward.is_empty(), "uses that go up lib.rs's layers: {upward:#?}");
    assert!(layers.len() >= 9, "{layers:?}");
}

#[test]
fn the_list_is_read_as_written() {
    let lib = "//! Layout, by layer [`z`]\n//! and more:\n//! - [`a`]: x [`a::b`];\n//!   more [`c`]\n//! - [`d`]: y\n//!\n//! - [`e`]";
    let layers = layers(lib);
    assert_eq!(layers.into_iter().collect::<Vec<_>>(), [("a".into(), 0), ("c".into(), 0), ("d".into(), 1)]);
    let uses = paths("use crate::a::b; // crate::d\nlet x = crate::c::f();");
    assert_eq!(uses, [("a".to_string(), 1), ("c".to_string(), 2)]);
}
