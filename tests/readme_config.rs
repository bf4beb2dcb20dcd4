//! The README's configuration table is generated from `config::KEYS`, the one list of accepted
//! keys that `cargo run --example config_help` prints, and must stay equal to it: a key added,
//! removed or reworded without the README fails here.
//!
//! To regenerate the table after changing a key: `STEPALLOC_WRITE_README=1 cargo test --test
//! readme_config` (it rewrites the lines between the two markers and nothing else).

use std::path::PathBuf;

use stepalloc::config::KEYS;

const BEGIN: &str = "<!-- config table: generated from config::KEYS by tests/readme_config.rs -->";
const END: &str = "<!-- end of config table -->";

/// The table as it belongs in the README: one row per key, in `KEYS` order, the cells of
/// `Config::describe()` (name, default, doc and accepted form).
fn table() -> String {
    let cell = |s: &str| s.replace('|', "\\|");
    let mut out = String::from("| key | default | meaning (accepted values) |\n|---|---|---|\n");
    for k in KEYS {
        out.push_str(&format!("| `{}` | {} | {} ({}) |\n", k.name, cell(k.default), cell(k.doc), cell(k.form)));
    }
    out
}

#[test]
fn readme_configuration_table_is_the_one_keys_describe() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let readme = std::fs::read_to_string(&path).expect("README.md at the workspace root");
    let start = readme.find(BEGIN).expect("the README has the config table's begin marker") + BEGIN.len() + 1;
    let end = readme[start..].find(END).expect("the README has the config table's end marker") + start;
    let expected = table();
    if std::env::var_os("STEPALLOC_WRITE_README").is_some() {
        let updated = format!("{}{}{}", &readme[..start], expected, &readme[end..]);
        std::fs::write(&path, updated).expect("README.md is writable");
        return;
    }
    assert!(
        readme[start..end] == expected,
        "README.md's configuration table differs from config::KEYS; regenerate it with \
         `STEPALLOC_WRITE_README=1 cargo test --test readme_config`. Expected:\n{expected}"
    );
}

#[test]
fn every_described_key_has_a_row() {
    // describe() (what config_help prints) and the table come from the same list; this keeps
    // them from parting if describe() ever gains a source of its own.
    let described = stepalloc::Config::describe();
    let rows = table();
    for line in described.lines() {
        let name = line.split_whitespace().next().expect("a key name on each line");
        assert!(rows.contains(&format!("| `{name}` |")), "{name} is described but has no row");
    }
    assert_eq!(rows.lines().count(), described.lines().count() + 2);
}
