// `sqlx::migrate!` embeds migrations/ at compile time, and cargo does not
// know it reads that directory: without this, a new migration file is left
// out of the binary until something else changes (sqlx's own advice).
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
