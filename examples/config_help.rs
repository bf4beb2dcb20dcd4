//! Prints every configuration key with its default, accepted form and meaning.
//! `cargo run --example config_help`
fn main() {
    print!("{}", stepalloc::Config::describe());
}
