//! What a rebuild needs besides the runner's step: which projection names
//! can have tables at all, and driving one rebuild until its table serves.

use crate::runner::Runner;
use crate::{Projection, ProjectionError};

/// The longest projection name. A name's tables are `<name>_v<version>`,
/// a rebuild's `<name>_v<version>_r<13-digit millis>`, and their side tables
/// add `__<suffix>` (queue_stats: `__jobs`); with a 10-digit version that is
/// the name plus 33 bytes, and PostgreSQL cuts identifiers past 63 bytes
/// without an error, so two names could meet in one table.
pub const MAX_NAME: usize = 30;

/// Refuses a projection name whose tables could be another name's, or be
/// cut by PostgreSQL. Lower-case ASCII letters, digits and single
/// underscores, starting with a letter and not ending with an underscore:
/// `drop_table("x_v2")` drops `x_v2` and its side tables `x_v2__*`, so a
/// projection named `x_v2_` (tables `x_v2__v1`, …) would lose its table to
/// the first one's switch.
pub fn check_name(name: &str) -> Result<(), ProjectionError> {
    let bad = |reason: &'static str| {
        Err(ProjectionError::BadName {
            name: name.to_string(),
            reason,
        })
    };
    if name.is_empty() || name.len() > MAX_NAME {
        return bad("it must be 1 to 30 bytes long");
    }
    if !name.starts_with(|c: char| c.is_ascii_lowercase()) {
        return bad("it must start with a lower-case letter");
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        return bad("it may hold only lower-case letters, digits and underscores");
    }
    if name.contains("__") || name.ends_with('_') {
        return bad("it may not hold two underscores in a row or end with one (side tables are <table>__*)");
    }
    Ok(())
}

impl Runner<'_> {
    /// Refuses when the view serves a newer version than `p`'s code: in a
    /// rolling upgrade older code's `catch_up` leaves a newer version alone
    /// and returns Ok, so a caller about to read the view through `p`'s
    /// idea of its table (`verify --rebuilt`) asks this first instead of
    /// misreading a table of another shape.
    pub async fn check_serving(&self, p: &dyn Projection) -> Result<(), ProjectionError> {
        let e = self.entry(p.name()).await?;
        if e.version > p.version() {
            return Err(ProjectionError::OlderThanServing {
                name: p.name().to_string(),
                serving: e.version,
                ours: p.version(),
            });
        }
        Ok(())
    }

    /// Steps `p` until its rebuild into `table` (from `start_rebuild`)
    /// serves, and returns the version serving. `progress` gets each step's
    /// count of rebuilt events. Another runner (the `projections run`
    /// service) may switch the table in first: that is success too, not a
    /// wait for a switch that will never come here. A rebuild that neither
    /// goes on nor serves (a newer version's build replaced it) ends in
    /// `ProjectionError::RebuildReplaced`.
    pub async fn finish_rebuild(
        &self,
        p: &dyn Projection,
        table: &str,
        mut progress: impl FnMut(usize),
    ) -> Result<i32, ProjectionError> {
        // A step that moved nothing (the horizon is held, or the switch
        // must wait) backs off instead of spinning.
        let mut idle = std::time::Duration::from_millis(5);
        loop {
            let s = self.step(&[p]).await?;
            progress(s.rebuilt);
            if let Some(v) = s.switched_to {
                return Ok(v);
            }
            if s.rebuilt > 0 {
                idle = std::time::Duration::from_millis(5);
                continue;
            }
            let e = self.entry(p.name()).await?;
            if e.building_table.as_deref() == Some(table) {
                tokio::time::sleep(idle).await;
                idle = (idle * 2).min(std::time::Duration::from_millis(250));
            } else if e.active_table == table {
                return Ok(e.version);
            } else {
                return Err(ProjectionError::RebuildReplaced {
                    name: p.name().to_string(),
                    table: table.to_string(),
                });
            }
        }
    }
}
