//! What the tools print: JSON lines on stdout, and the binary's exit codes
//! for "all good" and "a check failed".

use serde_json::Value;

pub const OK: i32 = 0;
pub const FAILURE: i32 = 1;

pub fn line(v: &Value) {
    println!("{v}");
}
