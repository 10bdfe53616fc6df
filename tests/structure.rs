//! The sources' shape, kept true: no circle between sibling files of the worker, the
//! supervisor or the configuration crate. Files in one folder are siblings; a folder's
//! `mod.rs` stands for the folder as seen from its parent folder (everything under it counts
//! as its code there), and for the folder's own parent file among its children. A file uses a
//! sibling when its code names it through `crate::`, `super::` or `self::` paths, or (a
//! parent file naming its children) through a child module's name, `use` trees included
//! (`use super::{a::X, b};`). Two siblings that use each other are one concept in two files,
//! or a third one hidden in both: move what they share into a file of its own.
//!
//! Read as written, without a parser: comments, string and character literals are blanked
//! first, and `#[cfg(test)]` items (the `mod tests` of a file, a test-only file) are left out,
//! so that a test borrowing a sibling's helper is no circle: tests run beside the code, they
//! are not part of what it is built from. Declaring a child (`mod x;`) is not using it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// `source` with comments, string and character literals blanked (newlines kept, so that
/// positions stay on their lines).
fn blank(source: &str) -> String {
    let chars: Vec<char> = source.chars().collect();
    let mut out = String::with_capacity(source.len());
    let blank = |out: &mut String, c: char| out.push(if c == '\n' { '\n' } else { ' ' });
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let ident_before = i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_');
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                blank(&mut out, chars[i]);
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, chars[i]);
                    i += 1;
                }
            }
        } else if !ident_before && (c == 'r' || (c == 'b' && next == Some('r'))) && raw_string(&chars[i..]).is_some() {
            let end = i + raw_string(&chars[i..]).unwrap();
            while i < end {
                blank(&mut out, chars[i]);
                i += 1;
            }
        } else if c == '"' {
            blank(&mut out, c);
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    blank(&mut out, chars[i]);
                    i += 1;
                }
                if i < chars.len() {
                    blank(&mut out, chars[i]);
                    i += 1;
                }
            }
            if i < chars.len() {
                blank(&mut out, chars[i]);
                i += 1;
            }
        } else if c == '\'' && char_literal(&chars[i..]).is_some() {
            let end = i + char_literal(&chars[i..]).unwrap();
            while i < end {
                blank(&mut out, chars[i]);
                i += 1;
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// The length of the raw string (`r"…"`, `r#"…"#`, `br"…"`) that `chars` opens with, if it does.
fn raw_string(chars: &[char]) -> Option<usize> {
    let mut i = if chars.first() == Some(&'b') { 2 } else { 1 };
    let hashes = chars[i..].iter().take_while(|&&c| c == '#').count();
    i += hashes;
    if chars.get(i) != Some(&'"') {
        return None;
    }
    i += 1;
    while i < chars.len() {
        if chars[i] == '"' && chars[i + 1..].iter().take(hashes).filter(|&&c| c == '#').count() == hashes {
            return Some(i + 1 + hashes);
        }
        i += 1;
    }
    Some(chars.len())
}

/// The length of the character literal that `chars` opens with (`'x'`, `'\n'`, `'\u{1F600}'`);
/// None for a lifetime or a label (`'a`, `'static`).
fn char_literal(chars: &[char]) -> Option<usize> {
    match chars.get(1)? {
        '\\' => chars.iter().skip(3).position(|&c| c == '\'').map(|n| n + 4),
        _ => (chars.get(2) == Some(&'\'')).then_some(3),
    }
}

/// A token of blanked code: a word (identifier or keyword) or one punctuation character, `::`
/// kept whole.
fn tokens(code: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    let chars: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_alphanumeric() || c == '_' {
            let word: String = chars[i..].iter().take_while(|c| c.is_alphanumeric() || **c == '_').collect();
            i += word.chars().count();
            tokens.push(word);
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            tokens.push("::".into());
            i += 2;
        } else {
            if !c.is_whitespace() {
                tokens.push(c.to_string());
            }
            i += 1;
        }
    }
    tokens
}

/// `tokens` without the items under a `#[cfg(test)]` attribute (a `mod tests { … }`, a
/// `mod tests;`, a test-only `use` or function); the names of the test-only child files
/// (`#[cfg(test)] mod layers;`) go to `test_files`.
fn without_tests(tokens: Vec<String>, test_files: &mut Vec<String>) -> Vec<String> {
    const ATTRIBUTE: [&str; 7] = ["#", "[", "cfg", "(", "test", ")", "]"];
    let mut kept = Vec::with_capacity(tokens.len());
    let mut i = 0;
    while i < tokens.len() {
        if !tokens[i..].starts_with(&ATTRIBUTE.map(String::from)) {
            kept.push(tokens[i].clone());
            i += 1;
            continue;
        }
        // The item ends at its first `;` or at the `}` that closes its first `{`, outside
        // brackets and parentheses (`fn f() -> [u8; 4] { … }`).
        i += ATTRIBUTE.len();
        let start = i;
        let mut nesting = 0usize;
        while i < tokens.len() {
            match tokens[i].as_str() {
                "(" | "[" => nesting += 1,
                ")" | "]" => nesting = nesting.saturating_sub(1),
                ";" if nesting == 0 => break,
                "{" if nesting == 0 => {
                    let mut depth = 0usize;
                    while i < tokens.len() {
                        match tokens[i].as_str() {
                            "{" => depth += 1,
                            "}" => depth -= 1,
                            _ => {}
                        }
                        if depth == 0 {
                            break;
                        }
                        i += 1;
                    }
                    break;
                }
                _ => {}
            }
            i += 1;
        }
        let item = &tokens[start..i.min(tokens.len())];
        if let Some(n) = item.iter().position(|t| t == "mod") {
            if i < tokens.len() && tokens[i] == ";" {
                test_files.extend(item.get(n + 1).cloned());
            }
        }
        i += 1;
    }
    kept
}

/// A path that a file names from a module of its own crate, as written.
#[derive(Debug, PartialEq)]
struct Named {
    /// `["super", "a", "X"]`, prefixed with the inline modules (`mod x { … }`) it sits in, as
    /// `self` segments would be: `["x", "super", "y"]`.
    path: Vec<String>,
    /// For a file's own `use` (not an inline module's), the name it brings in: `X`, or `Y`
    /// for `X as Y`; None for a glob (`*`) or a path outside a `use`.
    brings: Option<String>,
}

/// Every path that `tokens` names from a module of its own crate: from `crate`, `super` or
/// `self`, or from one of `children` (the file's child modules); `use` trees are expanded
/// (`use super::{a::X, b}` names `super::a::X` and `super::b`).
fn paths(tokens: &[String], children: &BTreeSet<String>) -> Vec<Named> {
    let mut found = Vec::new();
    let mut inline: Vec<(String, usize)> = Vec::new(); // (name, the brace depth inside it)
    let mut depth = 0usize;
    let mut i = 0;
    while i < tokens.len() {
        let token = tokens[i].as_str();
        match token {
            "{" => depth += 1,
            "}" => {
                depth = depth.saturating_sub(1);
                if inline.last().is_some_and(|(_, inside)| *inside > depth) {
                    inline.pop();
                }
            }
            "mod" if tokens.get(i + 2).is_some_and(|t| t == "{") => {
                inline.push((tokens[i + 1].clone(), depth + 1));
                depth += 1;
                i += 3;
                continue;
            }
            _ => {}
        }
        let before = if i == 0 { "" } else { tokens[i - 1].as_str() };
        // `foo::crate` is not a path start; neither is `pub(in crate::x)`, `mod x;` nor a method's
        // turbofish (`x.child::<T>()`).
        let starts = matches!(token, "crate" | "super" | "self") || children.contains(token);
        if starts && !matches!(before, "::" | "." | "in" | "mod") && tokens.get(i + 1).is_some_and(|t| t == "::") {
            let prefix: Vec<String> = inline.iter().map(|(name, _)| name.clone()).collect();
            let import = before == "use" && inline.is_empty();
            let mut trees = Vec::new();
            i = tree(tokens, i, Vec::new(), &mut trees);
            found.extend(trees.into_iter().map(|(path, brings)| Named {
                path: [prefix.clone(), path].concat(),
                brings: brings.filter(|_| import),
            }));
            continue;
        }
        i += 1;
    }
    found
}

/// Reads the path or `use` tree at `tokens[i]` onto `prefix`, its leaves into `out` with the
/// name each brings in (None for a glob); returns the index after it.
fn tree(
    tokens: &[String],
    mut i: usize,
    mut prefix: Vec<String>,
    out: &mut Vec<(Vec<String>, Option<String>)>,
) -> usize {
    loop {
        match tokens.get(i).map(String::as_str) {
            Some("{") => {
                i += 1;
                while i < tokens.len() && tokens[i] != "}" {
                    i = tree(tokens, i, prefix.clone(), out);
                    // Anything else up to the next `,` of this group.
                    let mut nesting = 0usize;
                    while i < tokens.len() {
                        match tokens[i].as_str() {
                            "{" => nesting += 1,
                            "}" if nesting == 0 => break,
                            "}" => nesting -= 1,
                            "," if nesting == 0 => {
                                i += 1;
                                break;
                            }
                            _ => {}
                        }
                        i += 1;
                    }
                }
                return i + 1;
            }
            Some(word) if word.chars().all(|c| c.is_alphanumeric() || c == '_') => {
                // `self` inside a group names the group's prefix.
                if word != "self" || prefix.is_empty() {
                    prefix.push(word.to_string());
                }
                i += 1;
                if tokens.get(i).is_some_and(|t| t == "::") {
                    i += 1;
                    continue;
                }
                let mut brings = prefix.last().cloned();
                if tokens.get(i).is_some_and(|t| t == "as") {
                    brings = tokens.get(i + 1).filter(|name| *name != "_").cloned();
                    i += 2;
                }
                out.push((prefix, brings));
                return i;
            }
            _ => {
                // `x::*`, `x::<T>`: the prefix so far.
                if !prefix.is_empty() {
                    out.push((prefix, None));
                }
                return i;
            }
        }
    }
}

/// A crate's source files, read: module path (`["http", "forward"]`; `[]` for lib.rs or
/// main.rs) -> file, and what each file's code names.
struct Crate {
    files: BTreeMap<Vec<String>, PathBuf>,
    /// The paths each file's code (tests aside) names; none for a test-only file.
    named: BTreeMap<Vec<String>, Vec<Named>>,
    /// Each file's `use`s: the name brought in -> the path it comes from.
    imports: BTreeMap<Vec<String>, BTreeMap<String, Vec<String>>>,
}

impl Crate {
    fn read(src: &Path) -> Crate {
        fn walk(dir: &Path, module: &[String], files: &mut BTreeMap<Vec<String>, PathBuf>) {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                let name = path.file_stem().unwrap().to_string_lossy().to_string();
                if path.is_dir() {
                    walk(&path, &[module, &[name]].concat(), files);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let at_root = module.is_empty() && (name == "lib" || name == "main");
                    let own = match name == "mod" || at_root {
                        true => module.to_vec(),
                        false => [module, &[name]].concat(),
                    };
                    files.insert(own, path);
                }
            }
        }
        let mut files = BTreeMap::new();
        walk(src, &[], &mut files);
        let mut test_only: Vec<Vec<String>> = Vec::new();
        let mut named = BTreeMap::new();
        for (module, file) in &files {
            let mut test_files = Vec::new();
            let tokens = without_tests(tokens(&blank(&std::fs::read_to_string(file).unwrap())), &mut test_files);
            test_only.extend(test_files.into_iter().map(|name| [module.as_slice(), &[name]].concat()));
            let children: BTreeSet<String> = files
                .keys()
                .filter(|k| k.len() == module.len() + 1 && k.starts_with(module))
                .map(|k| k[module.len()].clone())
                .collect();
            named.insert(module.clone(), paths(&tokens, &children));
        }
        named.retain(|module, _| !test_only.iter().any(|t| module.starts_with(t)));
        let imports = named
            .iter()
            .map(|(module, named)| {
                let brought = named.iter().filter_map(|n| Some((n.brings.clone()?, n.path.clone())));
                (module.clone(), brought.collect())
            })
            .collect();
        Crate { files, named, imports }
    }

    /// The module a path names from `module`: the deepest module with a file of its own along
    /// it (an item's path names the file that holds the item), where a name that a `use`
    /// brought in leads on to the file it comes from (`pub use file::Config` in lib.rs:
    /// `crate::Config` names file.rs).
    fn resolve(&self, module: &[String], path: &[String], hops: usize) -> Option<Vec<String>> {
        let mut at: Vec<String> = module.to_vec();
        let mut segments = path.iter().enumerate().peekable();
        match segments.peek().map(|(_, s)| s.as_str()) {
            Some("crate") => {
                at.clear();
                segments.next();
            }
            Some("self") => {
                segments.next();
            }
            _ => {}
        }
        for (n, segment) in segments {
            if segment == "super" {
                at.pop()?;
                continue;
            }
            let deeper = [at.as_slice(), std::slice::from_ref(segment)].concat();
            if self.files.contains_key(&deeper) || self.files.keys().any(|k| k.starts_with(&deeper)) {
                at = deeper;
                continue;
            }
            if let Some(import) = self.imports.get(&at).and_then(|names| names.get(segment)) {
                if hops < 8 {
                    return self.resolve(&at, &[import.as_slice(), &path[n + 1..]].concat(), hops + 1);
                }
            }
            break;
        }
        Some(at)
    }
}

/// A use of one sibling by another: `(folder, from, to)`, each a module path; the folder's
/// own path stands for its parent file (mod.rs).
type Edges = BTreeSet<(Vec<String>, Vec<String>, Vec<String>)>;

/// The sibling uses of `krate`, test code left out.
fn edges(krate: &Crate) -> Edges {
    let mut edges = Edges::new();
    for (module, named) in &krate.named {
        for Named { path, .. } in named {
            let Some(target) = krate.resolve(module, path, 0) else { continue };
            // Every folder that holds both: the two as its children (or its parent file) see them.
            let common = module.iter().zip(&target).take_while(|(a, b)| a == b).count();
            for depth in 0..=common {
                let node = |m: &Vec<String>| m[..m.len().min(depth + 1)].to_vec();
                let (from, to) = (node(module), node(&target));
                if from != to {
                    edges.insert((module[..depth].to_vec(), from, to));
                }
            }
        }
    }
    edges
}

/// Every circle of sibling uses, each once, as the chain of its files, starting from its
/// smallest; at most `limit` of them.
fn circles(edges: &Edges, limit: usize) -> Vec<Vec<Vec<String>>> {
    let mut next: BTreeMap<&Vec<String>, Vec<&Vec<String>>> = BTreeMap::new();
    for (_, from, to) in edges {
        next.entry(from).or_default().push(to);
    }
    fn walk<'a>(
        start: &'a Vec<String>,
        path: &mut Vec<&'a Vec<String>>,
        next: &BTreeMap<&'a Vec<String>, Vec<&'a Vec<String>>>,
        out: &mut Vec<Vec<Vec<String>>>,
        limit: usize,
    ) {
        for &to in next.get(path.last().unwrap()).into_iter().flatten() {
            if out.len() >= limit {
                return;
            }
            if to == start {
                out.push(path.iter().map(|m| (*m).clone()).chain([start.clone()]).collect());
            } else if to > start && !path.contains(&to) {
                path.push(to);
                walk(start, path, next, out, limit);
                path.pop();
            }
        }
    }
    let mut out = Vec::new();
    for &start in next.keys() {
        walk(start, &mut vec![start], &next, &mut out, limit);
    }
    out
}

/// The file that stands for `module` among its siblings: `a/b.rs`, or `a/b/mod.rs` for a
/// folder (`lib.rs` for the crate).
fn file_name(krate: &Crate, src: &Path, module: &[String]) -> String {
    let file = &krate.files[module];
    file.strip_prefix(src).unwrap_or(file).display().to_string()
}

#[test]
fn no_sibling_files_use_each_other() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    for name in ["worker", "supervisor", "config"] {
        let src = root.join(name).join("src");
        let krate = Crate::read(&src);
        assert!(krate.files.len() > 5, "{} holds {} files", src.display(), krate.files.len());
        for circle in circles(&edges(&krate), 1000) {
            let chain: Vec<String> = circle.iter().map(|m| file_name(&krate, &src, m)).collect();
            found.push(format!("{name}/src: {}", chain.join(" -> ")));
        }
    }
    assert!(found.is_empty(), "{} circles between sibling files:\n{}", found.len(), found.join("\n"));
}

/// The check's own tests, on made-up sources.
mod check {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn comments_and_literals_are_blanked_lifetimes_are_not() {
        let code =
            blank("a // crate::x\nb /* super::y /* nested */ */ c \"self::z \\\" d\" r#\"crate::w\"# 'e' '\\'' &'a f");
        assert_eq!(code.lines().count(), 2);
        assert_eq!(tokens(&code), strings(&["a", "b", "c", "&", "'", "a", "f"]));
        assert!(!code.contains("crate") && !code.contains("super") && !code.contains("self"));
    }

    #[test]
    fn test_items_are_left_out_and_test_files_named() {
        let source = "use crate::a;\n#[cfg(test)]\nmod layers;\n#[cfg(test)]\nmod tests {\n use crate::b;\n fn f() -> [u8; 2] { [0; 2] }\n}\n#[cfg(test)]\nfn g() -> [u8; 2] { crate::c::h() }\nuse crate::d;";
        let mut test_files = Vec::new();
        let kept = without_tests(tokens(source), &mut test_files);
        assert_eq!(test_files, ["layers"]);
        let found: Vec<Vec<String>> = paths(&kept, &BTreeSet::new()).into_iter().map(|n| n.path).collect();
        assert_eq!(found, [strings(&["crate", "a"]), strings(&["crate", "d"])]);
    }

    #[test]
    fn use_trees_and_paths_are_read_whole() {
        let children: BTreeSet<String> = ["child".to_string()].into();
        let source = "use super::{a::X, b, c::{self, D as E}};\nuse crate::http::{kserve, tei::Y};\n\
                      pub(super) fn f() { child::g(); self::h(); other::i(); x.child::<T>(); }\n\
                      pub(in crate::p) struct S;\nmod child;\nuse super::*;\nlet v = Vec::<crate::q::Z>::new();";
        let found = paths(&tokens(source), &children);
        let expected = [
            (&["super", "a", "X"][..], Some("X")),
            (&["super", "b"], Some("b")),
            (&["super", "c"], Some("c")),
            (&["super", "c", "D"], Some("E")),
            (&["crate", "http", "kserve"], Some("kserve")),
            (&["crate", "http", "tei", "Y"], Some("Y")),
            (&["child", "g"], None),
            (&["self", "h"], None),
            (&["super"], None),
            (&["crate", "q", "Z"], None),
        ]
        .map(|(path, brings)| Named { path: strings(path), brings: brings.map(String::from) });
        assert_eq!(found, expected);
    }

    #[test]
    fn inline_modules_prefix_their_paths() {
        let found = paths(&tokens("mod inner { use super::a; }\nuse super::b;"), &BTreeSet::new());
        let expected = [
            Named { path: strings(&["inner", "super", "a"]), brings: None },
            Named { path: strings(&["super", "b"]), brings: Some("b".into()) },
        ];
        assert_eq!(found, expected);
    }

    /// A made-up crate in a temp folder: `(path, source)` for each file.
    fn made_up(tag: &str, files: &[(&str, &str)]) -> (PathBuf, Crate) {
        let src = std::env::temp_dir().join(format!("inferd-structure-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&src);
        for (path, source) in files {
            let file = src.join(path);
            std::fs::create_dir_all(file.parent().unwrap()).unwrap();
            std::fs::write(file, source).unwrap();
        }
        let krate = Crate::read(&src);
        (src, krate)
    }

    fn chains(src: &Path, krate: &Crate) -> Vec<String> {
        let chains = circles(&edges(krate), 100)
            .iter()
            .map(|c| c.iter().map(|m| file_name(krate, src, m)).collect::<Vec<_>>().join(" -> "))
            .collect();
        std::fs::remove_dir_all(src).unwrap();
        chains
    }

    #[test]
    fn circles_between_siblings_are_found_and_told_as_chains() {
        let (src, krate) = made_up(
            "circles",
            &[
                ("lib.rs", "pub mod http;\npub mod request;\nuse request::app::State;"),
                ("http/mod.rs", "mod forward;\npub use forward::Forward;\npub struct ApiError;"),
                ("http/forward.rs", "use super::ApiError;\npub struct Forward;"),
                ("request/mod.rs", "pub mod app;\npub mod cache;\npub mod tasks;"),
                ("request/app.rs", "use super::{cache::Cache, tasks};\nuse crate::http::ApiError;"),
                ("request/cache.rs", "pub struct Cache(crate::request::app::State);"),
                (
                    "request/tasks.rs",
                    "use crate::request::app::State;\n#[cfg(test)]\nmod tests { use super::super::cache::Cache; }",
                ),
            ],
        );
        assert_eq!(
            chains(&src, &krate),
            [
                "http/mod.rs -> http/forward.rs -> http/mod.rs",
                "request/app.rs -> request/cache.rs -> request/app.rs",
                "request/app.rs -> request/tasks.rs -> request/app.rs",
            ]
        );
    }

    #[test]
    fn a_name_brought_in_by_use_leads_to_its_file() {
        let (src, krate) = made_up(
            "imports",
            &[
                (
                    "lib.rs",
                    "pub mod file;\npub mod tls;\npub mod model;\npub use file::{Config as Settings, ConfigError};",
                ),
                ("file.rs", "pub struct ConfigError;\nfn f() { crate::tls::load() }"),
                ("tls.rs", "use crate::ConfigError;"),
                ("model/mod.rs", "mod schema;\nuse crate::Settings;\npub use schema::Entry;"),
                ("model/schema.rs", "use super::Settings;\npub struct Entry;"),
            ],
        );
        assert_eq!(chains(&src, &krate), ["file.rs -> tls.rs -> file.rs"]);
    }

    #[test]
    fn a_folder_is_one_sibling_and_a_longer_circle_is_one_chain() {
        let (src, krate) = made_up(
            "folders",
            &[
                ("lib.rs", "mod a;\nmod b;\nmod pool;"),
                ("a.rs", "use crate::pool::slot::Slot;"),
                ("b.rs", "fn f() { crate::a::g() }"),
                ("pool/mod.rs", "mod guards;\nmod slot;\nmod spawn;"),
                ("pool/guards.rs", "use super::slot::Slot;"),
                ("pool/slot.rs", "use super::spawn;\npub struct Slot;"),
                ("pool/spawn.rs", "use super::guards::Guard;\nuse crate::b;"),
            ],
        );
        assert_eq!(
            chains(&src, &krate),
            [
                "a.rs -> pool/mod.rs -> b.rs -> a.rs",
                "pool/guards.rs -> pool/slot.rs -> pool/spawn.rs -> pool/guards.rs"
            ]
        );
    }
}
