pub mod args;
pub mod demo;
pub mod output;
pub mod parse;
pub mod run;
pub mod timeline;
