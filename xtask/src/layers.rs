//! `cargo xtask layers`: reads the library's module imports (every path
//! through `crate::`, `super::`, `self::` or a child module, in `use` items
//! and in code; doc links, strings, re-exports (`pub use`) and
//! `#[cfg(test)]` modules are not imports), prints the module graph, and fails on any cycle and on any
//! import a layer may not make. It also fails on a type name (struct,
//! enum, union, alias, trait) defined in two modules outside test code:
//! two `Shared`s or two `State`s in one crate read as one.
//!
//! The layers, lowest first (a module may import only lower layers and its
//! own submodules; leaves may use each other, the cycle check keeps them
//! honest; the crate root is a facade of re-exports and does not count):
//!
//! 0. leaves: `error`, `completion`, `units`, `access`, `remote`, `deadline`
//!    (the one deadline type),
//!    `host_memory`, `poll`, `config` (what a domain is opened with),
//!    `launch` (ranks from the launcher's environment), `endpoint` (what a
//!    peer needs to connect, as data), `rendezvous` (where ranks find each
//!    other)
//! 1. `verbs`, `cuda`: the only users of rdma-sys and cudarc
//! 2. `topology` (pure functions over sysfs, procfs, nvidia-smi)
//! 3. `memory` (registration, the key table, regions), `bootstrap`
//! 4. `ops` (the queue core), `options` (what a connection is set up with)
//! 5. `transport`
//! 6. `protocol` (per GPU operation: direct or staged, and the staged pipeline)
//! 7. `domain` (a device, its memory, its staging pools)
//! 8. `connection` (the public API, options in use, establishment)
//! 9. `bench`, `world` (many peers: lazy connections through a rendezvous),
//!    `rails` (several NICs and queue pairs per connection, striped)

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use syn::visit::Visit;

use crate::{Result, root};

/// A module's layer, by its first path segment.
pub fn layer(module: &str) -> Option<u8> {
    let top = module.split("::").next().unwrap_or(module);
    Some(match top {
        "error" | "completion" | "units" | "access" | "remote" | "deadline" | "host_memory" | "poll" | "config"
        | "launch" | "endpoint" | "rendezvous" => 0,
        "verbs" | "cuda" => 1,
        "topology" => 2,
        "memory" | "bootstrap" => 3,
        "ops" | "options" => 4,
        "transport" => 5,
        "protocol" => 6,
        "domain" => 7,
        "connection" => 8,
        "bench" | "world" | "rails" => 9,
        _ => return None,
    })
}

/// The module path of a source file under `src/` (`transport::tcp`), or
/// `None` for the crate root and binaries.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if parts.first().is_some_and(|p| p == "bin") {
        return None;
    }
    let last = parts.pop()?;
    match last.as_str() {
        "lib.rs" if parts.is_empty() => return None,
        "mod.rs" => {}
        name => parts.push(name.strip_suffix(".rs")?.to_owned()),
    }
    Some(parts.join("::"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Collects the absolute paths (segments after `crate`) a file refers to.
struct Refs<'a> {
    /// The module the file is, then inline modules entered.
    scope: Vec<String>,
    /// Modules that exist, to tell a child-module path from an extern crate.
    modules: &'a BTreeSet<String>,
    /// What the crate root re-exports: `Domain` -> `domain`, so a path
    /// through the root counts against the module that defines the item.
    root: &'a BTreeMap<String, String>,
    found: BTreeSet<Vec<String>>,
}

impl Refs<'_> {
    fn resolve(&mut self, segs: &[String]) {
        let Some(first) = segs.first() else { return };
        let mut base: Vec<String> = self.scope.clone();
        let rest = match first.as_str() {
            "crate" => {
                base.clear();
                &segs[1..]
            }
            "self" => &segs[1..],
            "super" => {
                let mut i = 0;
                while segs.get(i).is_some_and(|s| s == "super") {
                    base.pop();
                    i += 1;
                }
                &segs[i..]
            }
            child => {
                // A path through a child module of the current one.
                let mut candidate = base.clone();
                candidate.push(child.to_owned());
                if !self.modules.contains(&candidate.join("::")) {
                    return;
                }
                segs
            }
        };
        let mut path = base;
        path.extend(rest.iter().cloned());
        // `crate::Name` for a root re-export: the module it comes from.
        if let Some(module) = path.first().and_then(|n| self.root.get(n)) {
            let mut through: Vec<String> = module.split("::").map(str::to_owned).collect();
            through.extend(path.into_iter().skip(1));
            path = through;
        }
        self.found.insert(path);
    }

    fn flatten(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.flatten(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                prefix.push(n.ident.to_string());
                let segs = prefix.clone();
                self.resolve(&segs);
                prefix.pop();
            }
            syn::UseTree::Rename(r) => {
                prefix.push(r.ident.to_string());
                let segs = prefix.clone();
                self.resolve(&segs);
                prefix.pop();
            }
            syn::UseTree::Glob(_) => {
                let segs = prefix.clone();
                self.resolve(&segs);
            }
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    self.flatten(prefix, t);
                }
            }
        }
    }
}

fn is_cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && a.parse_args::<syn::Meta>().is_ok_and(|m| matches!(&m, syn::Meta::Path(p) if p.is_ident("test")))
    })
}

impl<'ast> Visit<'ast> for Refs<'_> {
    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        // A re-export (`pub use`, `pub(crate) use`) is structure, not use:
        // a facade re-exporting its submodules does not depend on them.
        if matches!(u.vis, syn::Visibility::Inherited) {
            self.flatten(&mut Vec::new(), &u.tree);
        }
    }

    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        if is_cfg_test(&m.attrs) {
            return;
        }
        if m.content.is_some() {
            self.scope.push(m.ident.to_string());
            syn::visit::visit_item_mod(self, m);
            self.scope.pop();
        }
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        if p.leading_colon.is_none() {
            let segs: Vec<String> = p.segments.iter().map(|s| s.ident.to_string()).collect();
            if segs.len() > 1 {
                self.resolve(&segs);
            }
        }
        syn::visit::visit_path(self, p);
    }
}

/// The library's source files, parsed, each with its module path (`None`
/// for the crate root; binaries are not the library).
pub fn parse(src: &Path) -> Result<Vec<(Option<String>, syn::File)>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut out = Vec::new();
    for file in &files {
        let module = module_of(src, file);
        if module.is_none() && *file != src.join("lib.rs") {
            continue;
        }
        let text = fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
        let ast = syn::parse_file(&text).map_err(|e| format!("{}: {e}", file.display()))?;
        out.push((module, ast));
    }
    Ok(out)
}

/// The module graph: module -> the modules it refers to.
pub fn graph(sources: &[(Option<String>, syn::File)]) -> BTreeMap<String, BTreeSet<String>> {
    let modules: BTreeSet<String> = sources.iter().filter_map(|(m, _)| m.clone()).collect();
    let root = sources.iter().find(|(m, _)| m.is_none()).map(|(_, ast)| root_reexports(ast)).unwrap_or_default();
    let mut g = BTreeMap::new();
    for (module, ast) in sources {
        let Some(module) = module else { continue };
        let mut refs = Refs {
            scope: module.split("::").map(str::to_owned).collect(),
            modules: &modules,
            root: &root,
            found: BTreeSet::new(),
        };
        refs.visit_file(ast);
        let mut deps = BTreeSet::new();
        for path in refs.found {
            // The longest prefix that is a module; the crate root does not count.
            let target = (1..=path.len()).rev().map(|n| path[..n].join("::")).find(|m| modules.contains(m));
            if let Some(t) = target.filter(|t| t != module) {
                deps.insert(t);
            }
        }
        g.insert(module.clone(), deps);
    }
    g
}

/// Records where each type name is defined, outside test code.
struct Types<'a> {
    scope: Vec<String>,
    found: &'a mut BTreeMap<String, BTreeSet<String>>,
}

impl<'ast> Visit<'ast> for Types<'_> {
    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        if is_cfg_test(&m.attrs) {
            return;
        }
        self.scope.push(m.ident.to_string());
        syn::visit::visit_item_mod(self, m);
        self.scope.pop();
    }
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let defined = match item {
            syn::Item::Struct(i) => Some((&i.attrs, &i.ident)),
            syn::Item::Enum(i) => Some((&i.attrs, &i.ident)),
            syn::Item::Union(i) => Some((&i.attrs, &i.ident)),
            syn::Item::Type(i) => Some((&i.attrs, &i.ident)),
            syn::Item::Trait(i) => Some((&i.attrs, &i.ident)),
            _ => None,
        };
        if let Some((attrs, name)) = defined
            && !is_cfg_test(attrs)
        {
            self.found.entry(name.to_string()).or_default().insert(self.scope.join("::"));
        }
        syn::visit::visit_item(self, item);
    }
}

/// Type names defined in more than one module of the library (outside
/// test code), with those modules. One module defining a name twice under
/// opposite `cfg`s is one definition.
pub fn duplicate_types(sources: &[(Option<String>, syn::File)]) -> BTreeMap<String, BTreeSet<String>> {
    let mut found = BTreeMap::new();
    for (module, ast) in sources {
        let scope = vec![module.clone().unwrap_or_else(|| "crate".to_owned())];
        Types { scope, found: &mut found }.visit_file(ast);
    }
    found.retain(|_, modules| modules.len() > 1);
    found
}

/// The crate root's `pub use` items: the name each makes visible at the
/// root, and the module it comes from (its path without the item).
fn root_reexports(ast: &syn::File) -> BTreeMap<String, String> {
    fn walk(prefix: &mut Vec<String>, tree: &syn::UseTree, out: &mut BTreeMap<String, String>) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                walk(prefix, &p.tree, out);
                prefix.pop();
            }
            syn::UseTree::Name(n) if !prefix.is_empty() => {
                out.insert(n.ident.to_string(), prefix.join("::"));
            }
            syn::UseTree::Rename(r) if !prefix.is_empty() => {
                out.insert(r.rename.to_string(), prefix.join("::"));
            }
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    walk(prefix, t, out);
                }
            }
            _ => {}
        }
    }
    let mut out = BTreeMap::new();
    for item in &ast.items {
        if let syn::Item::Use(u) = item
            && !matches!(u.vis, syn::Visibility::Inherited)
        {
            walk(&mut Vec::new(), &u.tree, &mut out);
        }
    }
    out
}

/// The strongly connected components with more than one module (cycles).
pub fn cycles(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    // Tarjan's algorithm, iteration order fixed by the BTreeMap.
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    impl<'a> T<'a> {
        fn visit(&mut self, v: &'a str) {
            self.index.insert(v, self.next);
            self.low.insert(v, self.next);
            self.next += 1;
            self.stack.push(v);
            self.on.insert(v);
            for w in self.g.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.g.contains_key(w) {
                    continue;
                }
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let l = self.low[v].min(self.low[w]);
                    self.low.insert(v, l);
                } else if self.on.contains(w) {
                    let l = self.low[v].min(self.index[w]);
                    self.low.insert(v, l);
                }
            }
            if self.low[v] == self.index[v] {
                let mut comp = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on.remove(w);
                    comp.push(w.to_owned());
                    if w == v {
                        break;
                    }
                }
                if comp.len() > 1 {
                    comp.sort();
                    self.out.push(comp);
                }
            }
        }
    }
    let mut t = T {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in g.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.out
}

/// Imports a layer may not make: `(from, to, why)`.
pub fn violations(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for (from, deps) in g {
        for to in deps {
            // Its own submodules are part of a module.
            if to.starts_with(&format!("{from}::")) {
                continue;
            }
            match (layer(from), layer(to)) {
                (Some(a), Some(b)) if b >= a && a > 0 && from.split("::").next() != to.split("::").next() => {
                    out.push((from.clone(), to.clone(), format!("layer {a} imports layer {b}")));
                }
                (None, _) => out.push((from.clone(), to.clone(), format!("`{from}` has no layer"))),
                (_, None) => out.push((from.clone(), to.clone(), format!("`{to}` has no layer"))),
                _ => {}
            }
        }
    }
    out
}

/// `--cycles`: fail on a cycle only, and report imports against the layer
/// order without failing (what CI runs until the last of them is gone).
pub fn command(args: &[String]) -> Result<i32> {
    let cycles_only = args.iter().any(|a| a == "--cycles");
    let sources = parse(&root().join("src"))?;
    let g = graph(&sources);
    println!("xtask layers: {} modules", g.len());
    for (m, deps) in &g {
        let l = layer(m).map_or("-".to_owned(), |l| l.to_string());
        let deps: Vec<&str> = deps.iter().map(String::as_str).collect();
        println!("  [{l}] {m} -> {}", if deps.is_empty() { "(nothing)".to_owned() } else { deps.join(", ") });
    }
    let cyc = cycles(&g);
    for c in &cyc {
        println!("cycle: {}", c.join(" <-> "));
    }
    let bad = violations(&g);
    for (from, to, why) in &bad {
        println!("not allowed: {from} -> {to} ({why})");
    }
    let twice = duplicate_types(&sources);
    for (name, modules) in &twice {
        println!("type name defined twice: {name} (in {})", modules.iter().cloned().collect::<Vec<_>>().join(", "));
    }
    println!(
        "xtask layers: {} cycle(s), {} import(s) a layer may not make, {} type name(s) defined twice",
        cyc.len(),
        bad.len(),
        twice.len()
    );
    let failed = !cyc.is_empty() || (!cycles_only && (!bad.is_empty() || !twice.is_empty()));
    Ok(i32::from(failed))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(edges: &[(&str, &str)]) -> BTreeMap<String, BTreeSet<String>> {
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in edges {
            g.entry((*a).to_owned()).or_default().insert((*b).to_owned());
            g.entry((*b).to_owned()).or_default();
        }
        g
    }

    #[test]
    fn cycles_are_found_and_a_chain_is_not_one() {
        assert!(cycles(&g(&[("a", "b"), ("b", "c")])).is_empty());
        let c = cycles(&g(&[("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e"), ("e", "d")]));
        assert_eq!(c.len(), 2, "{c:?}");
        assert!(c.contains(&vec!["a".to_owned(), "b".to_owned(), "c".to_owned()]));
        assert!(c.contains(&vec!["d".to_owned(), "e".to_owned()]));
    }

    #[test]
    fn a_layer_may_import_only_lower_layers_and_its_own_submodules() {
        let v = violations(&g(&[("memory", "error"), ("memory", "transport"), ("transport", "transport::tcp")]));
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!((v[0].0.as_str(), v[0].1.as_str()), ("memory", "transport"));
        let v = violations(&g(&[("memory::gpu", "bootstrap")]));
        assert_eq!(v.len(), 1, "siblings of one layer do not import each other: {v:?}");
    }

    /// A fresh source tree in a temporary folder named after `name`:
    /// `files` as (path from the tree's root, text).
    fn source_tree(name: &str, files: &[(&str, &str)]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("xtask-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        for (path, text) in files {
            let file = dir.join(path);
            fs::create_dir_all(file.parent().unwrap()).unwrap();
            fs::write(file, text).unwrap();
        }
        dir
    }

    #[test]
    fn a_type_name_in_two_modules_is_found_and_test_code_and_cfg_alternatives_are_not() {
        let dir = source_tree(
            "types",
            &[
                ("lib.rs", "pub mod transport; pub mod region; struct Root;"),
                (
                    "transport/mod.rs",
                    "struct Shared; type Step = (); mod inner { enum State { A } }\n\
                     #[cfg(feature = \"x\")] struct Alt;\n#[cfg(not(feature = \"x\"))] struct Alt;\n\
                     #[cfg(test)] mod tests { struct Fake; }",
                ),
                (
                    "region.rs",
                    "pub struct Shared; fn f() { struct State; } trait Step {}\n#[cfg(test)] mod tests { struct Fake; }",
                ),
            ],
        );
        let twice = duplicate_types(&parse(&dir).unwrap());
        let names: Vec<&str> = twice.keys().map(String::as_str).collect();
        assert_eq!(names, ["Shared", "State", "Step"], "{twice:?}");
        assert_eq!(twice["State"].iter().cloned().collect::<Vec<_>>(), ["region", "transport::inner"]);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn paths_resolve_through_crate_super_self_and_child_modules() {
        let dir = source_tree(
            "layers",
            &[
                ("lib.rs", "pub mod error; pub mod transport; pub use transport::X;"),
                ("facade/mod.rs", "mod inner; pub use inner::Y;"),
                ("facade/inner.rs", "pub struct Y(super::super::error::E);"),
                ("error.rs", "/// See [`crate::transport::X`].\npub struct E;"),
                ("user.rs", "fn f(_: crate::X) {}"),
                (
                    "transport/mod.rs",
                    "mod tcp;\nuse crate::error::E;\npub struct X(tcp::T);\n#[cfg(test)] mod tests { use crate::bench; }",
                ),
                ("transport/tcp.rs", "use super::{X as Y};\npub struct T; fn f() { let _ = \"crate::error\"; }"),
            ],
        );
        let graph = graph(&parse(&dir).unwrap());
        let deps = |m: &str| graph[m].iter().cloned().collect::<Vec<_>>();
        assert_eq!(deps("error"), Vec::<String>::new(), "a doc link is not an import");
        assert_eq!(deps("user"), vec!["transport"], "a path through a root re-export counts against its module");
        assert_eq!(deps("transport"), vec!["error", "transport::tcp"], "use, a child module; not test code");
        assert_eq!(deps("transport::tcp"), vec!["transport"], "super; not a string");
        assert_eq!(deps("facade"), Vec::<String>::new(), "a re-export is not a use");
        assert_eq!(deps("facade::inner"), vec!["error"]);
        assert_eq!(cycles(&graph), vec![vec!["transport".to_owned(), "transport::tcp".to_owned()]]);
        let _ = fs::remove_dir_all(&dir);
    }
}
