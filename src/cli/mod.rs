pub mod args;
pub mod bench;
pub mod demo;
pub mod output;
pub mod parse;
pub mod private_pg;
pub mod run;
pub mod timeline;
