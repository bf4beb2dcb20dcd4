//! The committed header `include/stepalloc.h` must be exactly what cbindgen generates from the
//! sources, so the C interface cannot drift from the Rust exports. To accept a change, run
//! `STEPALLOC_BLESS=1 cargo test -p stepalloc-cabi --test header` and commit the header.

use std::path::Path;

#[test]
fn committed_header_matches_cbindgen() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml parses");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen generates the header");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let path = dir.join("include/stepalloc.h");
    if std::env::var("STEPALLOC_BLESS").as_deref() == Ok("1") {
        std::fs::write(&path, &generated).expect("write include/stepalloc.h");
        return;
    }
    let committed = std::fs::read(&path).expect("include/stepalloc.h exists");
    if committed != generated {
        let committed = String::from_utf8_lossy(&committed);
        let generated = String::from_utf8_lossy(&generated);
        let first = committed.lines().zip(generated.lines()).position(|(a, b)| a != b);
        panic!(
            "include/stepalloc.h differs from what cbindgen generates (first differing line: {}).\n\
             Run `STEPALLOC_BLESS=1 cargo test -p stepalloc-cabi --test header` and commit the header.\n\
             --- generated ---\n{generated}",
            first.map_or("at the end".to_string(), |i| (i + 1).to_string())
        );
    }
}

#[test]
fn every_exported_symbol_is_declared() {
    // The hand-written C++ declarations (trailer) and the version script must name the same
    // functions as trampoline.cpp defines.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let header = std::fs::read_to_string(dir.join("include/stepalloc.h")).expect("header");
    let map = std::fs::read_to_string(dir.join("exports.map")).expect("exports.map");
    let cpp = std::fs::read_to_string(dir.join("src/trampoline.cpp")).expect("trampoline.cpp");
    for name in [
        "stepalloc_torch_malloc",
        "stepalloc_begin_allocate_to_pool",
        "stepalloc_end_allocate_to_pool",
        "stepalloc_release_pool",
    ] {
        assert!(header.contains(&format!("{name}(")), "{name} is not declared in the header");
        assert!(map.contains(&format!("{name};")), "{name} is not in exports.map");
        assert!(
            cpp.contains(&format!("extern \"C\" void {name}(")) || cpp.contains(&format!("extern \"C\" void *{name}("))
        );
    }
}
