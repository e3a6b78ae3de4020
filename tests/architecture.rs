//! The crate graph is one-way and matches the design (docs/architecture.md): policy and ring at the bottom,
//! hookpoint above ring, exporter above ring and policy without hookpoint, the facade wiring them, ffi and inspect on
//! top (inspect also uses the probe crate, for `inspect retention`, and the exporter's check of the Arrow IPC footer
//! checksum the exporter writes and its object storage, for runs there). A dependency outside this table — a new edge
//! between member crates — fails here, with `cargo metadata` as the source of truth.

use std::collections::{BTreeMap, BTreeSet};

/// Member crate → the member crates it may depend on (normal and build dependencies).
const ALLOWED: &[(&str, &[&str])] = &[
    ("ringscope-policy", &[]),
    ("ringscope-ring", &[]),
    ("ringscope-hookpoint", &["ringscope-ring", "ringscope-policy"]),
    ("ringscope-exporter", &["ringscope-ring", "ringscope-policy"]),
    ("ringscope-probe", &["ringscope-ring"]),
    (
        "ringscope",
        &["ringscope-ring", "ringscope-policy", "ringscope-hookpoint", "ringscope-exporter", "ringscope-probe"],
    ),
    ("ringscope-ffi", &["ringscope"]),
    ("ringscope-inspect", &["ringscope-ring", "ringscope-probe", "ringscope-exporter"]),
];

/// Dependencies that no kind of dependency may add (not even a dev-dependency): producer and consumer meet only
/// through the ring's record format and the catalog the facade hands over.
const NEVER: &[(&str, &str)] =
    &[("ringscope-exporter", "ringscope-hookpoint"), ("ringscope-hookpoint", "ringscope-exporter")];

fn metadata() -> serde_json::Value {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(out.status.success(), "cargo metadata failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("cargo metadata prints JSON")
}

/// Member crate → (dependency, kind) for dependencies on other member crates.
fn member_edges() -> BTreeMap<String, BTreeSet<(String, String)>> {
    let meta = metadata();
    let packages = meta["packages"].as_array().expect("packages");
    let members: BTreeSet<&str> = packages.iter().map(|p| p["name"].as_str().expect("name")).collect();
    let mut edges = BTreeMap::new();
    for p in packages {
        let name = p["name"].as_str().expect("name").to_owned();
        let deps: &mut BTreeSet<(String, String)> = edges.entry(name.clone()).or_default();
        for d in p["dependencies"].as_array().expect("dependencies") {
            let dep = d["name"].as_str().expect("dependency name");
            // The facade lists itself as a dev-dependency (to turn on its `synthetic` feature for its own tests).
            if members.contains(dep) && dep != name {
                let kind = d["kind"].as_str().unwrap_or("normal").to_owned();
                deps.insert((dep.to_owned(), kind));
            }
        }
    }
    edges
}

#[test]
fn the_crate_graph_is_the_designed_one() {
    let edges = member_edges();
    let allowed: BTreeMap<&str, &[&str]> = ALLOWED.iter().copied().collect();
    let mut problems = Vec::new();
    for (krate, deps) in &edges {
        let Some(ok) = allowed.get(krate.as_str()) else {
            problems.push(format!("member crate `{krate}` is not in the design's table (tests/architecture.rs)"));
            continue;
        };
        for (dep, kind) in deps {
            if kind != "dev" && !ok.contains(&dep.as_str()) {
                problems.push(format!("`{krate}` depends on `{dep}` ({kind}); it may depend on {ok:?}"));
            }
            if NEVER.contains(&(krate.as_str(), dep.as_str())) {
                problems.push(format!("`{krate}` must never depend on `{dep}`, not even as a {kind} dependency"));
            }
        }
    }
    for (krate, _) in ALLOWED {
        if !edges.contains_key(*krate) {
            problems.push(format!("`{krate}` is in the design's table but not in the workspace"));
        }
    }
    assert!(problems.is_empty(), "the crate graph drifted from the design:\n{}", problems.join("\n"));
}

/// The check above must be able to fail: the exporter's real dependencies, plus the edge the design forbids.
#[test]
fn a_forbidden_edge_would_be_caught() {
    let mut edges = member_edges();
    let exporter = edges.get_mut("ringscope-exporter").expect("the exporter is a member");
    assert!(!exporter.iter().any(|(d, _)| d == "ringscope-hookpoint"), "{exporter:?}");
    exporter.insert(("ringscope-hookpoint".into(), "normal".into()));
    let allowed: BTreeMap<&str, &[&str]> = ALLOWED.iter().copied().collect();
    let caught = edges
        .iter()
        .any(|(k, deps)| deps.iter().any(|(d, kind)| kind != "dev" && !allowed[k.as_str()].contains(&d.as_str())));
    assert!(caught);
}
