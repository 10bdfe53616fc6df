//! The supervisor's layers as lib.rs lists them, kept true: every `crate::NAME` path in the
//! supervisor's code (comments aside) names a module of its own layer or of one below it, or
//! one of lib.rs's own items. (The worker has the same check, worker/src/layers.rs.)

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Each top-level module's layer, 0 at the top: one per bullet of lib.rs's layout list, the
/// modules a bullet links to (`[`name`]`, not `[`name::sub`]` or an item's `[`Name`]`).
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
            if !link.contains("::") && link.starts_with(|c: char| c.is_ascii_lowercase()) {
                layers.entry(link.to_string()).or_insert(layer.expect("a bullet"));
            }
        }
    }
    layers
}

/// The modules lib.rs declares (`mod name;`, `pub mod name;`, after any attribute line).
fn modules(lib: &str) -> Vec<String> {
    lib.lines()
        .filter_map(|l| l.trim().trim_start_matches("pub ").trim_start_matches("pub(crate) ").strip_prefix("mod "))
        .filter_map(|rest| rest.strip_suffix(';'))
        .map(str::to_string)
        .collect()
}

/// `(name, line)` of every `crate::NAME` outside comments in `source`.
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

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every `crate::` path of the files under `src` that goes up `lib`'s list, as
/// `file:line: module uses other`.
fn upward(src: &Path, lib: &str) -> Vec<String> {
    let layers = layers(lib);
    let modules = modules(lib);
    for module in modules.iter().filter(|m| *m != "layers") {
        assert!(layers.contains_key(module), "module {module} is not in lib.rs's layout list");
    }
    let mut files = Vec::new();
    sources(src, &mut files);
    let mut upward = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(src).unwrap();
        let top = relative.iter().next().unwrap().to_string_lossy().trim_end_matches(".rs").to_string();
        if top == "lib" || top == "layers" {
            continue;
        }
        let own = layers[&top];
        for (name, line) in paths(&std::fs::read_to_string(file).unwrap()) {
            match layers.get(&name) {
                Some(&layer) if layer < own => upward.push(format!("{}:{line}: {top} uses {name}", relative.display())),
                Some(_) => {}
                // lib.rs's own items: the root, which every layer may name.
                None if !modules.contains(&name) => {}
                None => panic!("{}:{line}: crate::{name} is not in lib.rs's layout list", relative.display()),
            }
        }
    }
    upward
}

#[test]
fn no_module_uses_a_layer_above_its_own() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    assert!(layers(&lib).len() >= 11, "{:?}", layers(&lib));
    let upward = upward(&src, &lib);
    assert!(upward.is_empty(), "uses that go up lib.rs's layers: {upward:#?}");
}

#[test]
fn the_list_is_read_as_written() {
    let lib = "//! Layout, by layer [`z`]\n//! and more:\n//! - [`a`]: x [`a::b`], [`Event`];\n//!   more [`c`]\n//! - [`d`]: y\n//!\n//! - [`e`]\nmod a;\n#[cfg(test)]\nmod layers;\npub mod c;\npub(crate) mod d;";
    let layers = layers(lib);
    assert_eq!(layers.into_iter().collect::<Vec<_>>(), [("a".into(), 0), ("c".into(), 0), ("d".into(), 1)]);
    assert_eq!(modules(lib), ["a", "layers", "c", "d"]);
    let uses = paths("use crate::a::b; // crate::d\nlet x = crate::c::f();");
    assert_eq!(uses, [("a".to_string(), 1), ("c".to_string(), 2)]);
}

#[test]
fn a_path_that_goes_up_is_found() {
    let src = std::env::temp_dir().join(format!("inferd-layers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&src);
    std::fs::create_dir_all(src.join("top")).unwrap();
    let lib = "//! Layout, by layer:\n//! - [`top`]\n//! - [`low`]\nmod low;\nmod top;\n";
    std::fs::write(src.join("top/mod.rs"), "use crate::low::X;\nuse crate::Event;\n").unwrap();
    std::fs::write(src.join("low.rs"), "fn f() { crate::Event::go(); }\n// crate::top in a comment\n").unwrap();
    assert!(upward(&src, lib).is_empty());
    std::fs::write(src.join("low.rs"), "use crate::top::Y;\n").unwrap();
    assert_eq!(upward(&src, lib), ["low.rs:1: low uses top"]);
    let _ = std::fs::remove_dir_all(&src);
}
