pub mod args;
pub mod consume;
pub mod output;
pub mod parse;
pub mod projections;
pub mod run;
pub mod workflow;
