//! Builds the C++ part of libstepalloc.so (`src/trampoline.cpp`) with the system C++ compiler
//! and makes its symbols visible in the cdylib (see `exports.map`).

fn main() {
    println!("cargo:rerun-if-changed=src/trampoline.cpp");
    println!("cargo:rerun-if-changed=include/stepalloc.h");
    println!("cargo:rerun-if-changed=exports.map");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file("src/trampoline.cpp")
        .include("include")
        .warnings(true)
        .extra_warnings(true)
        .compile("stepalloc_trampoline");
    let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={dir}/exports.map");
    }
}
