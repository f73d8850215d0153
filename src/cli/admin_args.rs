//! The administrators' subcommands: API tokens and queue controls.

use clap::{Args, Subcommand};

use crate::cli::parse;

#[derive(clap::Subcommand, Debug)]
pub enum TokenCmd {
    /// Creates a token; prints it once (only its hash is stored).
    Create {
        #[arg(long, value_parser = ["reader", "worker", "operator", "admin"])]
        role: String,
        #[arg(long)]
        name: String,
    },
    /// Revokes a token: from now on it is refused.
    Revoke {
        #[arg(long)]
        name: String,
    },
    /// Every token's name, role and dates (never the token).
    List,
}

#[derive(Subcommand, Debug)]
pub enum QueueCmd {
    Pause {
        queue: String,
        #[arg(long)]
        reason: String,
        #[arg(long)]
        operator: String,
    },
    Resume {
        queue: String,
        #[arg(long)]
        reason: String,
        #[arg(long)]
        operator: String,
    },
    /// Cap how many jobs with the same concurrency key are leased at once.
    Limit {
        queue: String,
        /// The limit's name (setting it again changes it).
        name: String,
        #[arg(long)]
        max: i32,
        /// Only jobs of this kind.
        #[arg(long)]
        kind: Option<String>,
        /// Only keys matching this glob (`*`, `?`).
        #[arg(long)]
        key: Option<String>,
        #[command(flatten)]
        who: Who,
    },
    Unlimit {
        queue: String,
        name: String,
        #[command(flatten)]
        who: Who,
    },
    /// At most --max claims per --per across every worker.
    Rate {
        queue: String,
        #[arg(long)]
        max: i32,
        #[arg(long, value_parser = parse::lease)]
        per: std::time::Duration,
        #[command(flatten)]
        who: Who,
    },
    Unrate {
        queue: String,
        #[command(flatten)]
        who: Who,
    },
    /// Every queue ever controlled, with its state.
    List,
    /// A queue's pauses and resumes, oldest first.
    History { queue: String },
}

/// Who changes a control and why (recorded in its stream).
#[derive(Args, Debug, Clone)]
pub struct Who {
    #[arg(long, env = "JOBLEDGER_OPERATOR")]
    pub operator: String,
    #[arg(long)]
    pub reason: String,
}
