//! What a rebuild needs besides the runner's step: which projection names
//! can have tables at all, and driving one rebuild until its table serves.

use crate::registry::Entry;
use crate::runner::{Backoff, Runner};
use crate::{Projection, ProjectionError};

/// The longest projection name. A name's tables are `<name>_v<version>`,
/// a rebuild's `<name>_v<version>_r<13-digit millis>`, and their side tables
/// add `__<suffix>` (queue_stats: `__jobs`); with a 10-digit version that is
/// the name plus 33 bytes, and PostgreSQL cuts identifiers past 63 bytes
/// without an error, so two names could meet in one table.
pub const MAX_NAME: usize = 30;

/// Refuses a projection whose tables could be another projection's, or be
/// cut by PostgreSQL. A name is lower-case ASCII letters, digits and single
/// underscores, starting with a letter and not ending with an underscore:
/// `drop_table("x_v2")` drops `x_v2` and its side tables `x_v2__*`, so a
/// projection named `x_v2_` (tables `x_v2__v1`, …) would lose its table to
/// the first one's switch. Nor may it look like a table name itself
/// (`x_v2`, `x_v2_r123`): its view `jobledger_proj.<name>` shares their
/// namespace, and `x` could then never build its version 2. (A name some
/// other relation of the schema has, such as the `registry` table or an
/// index, is refused by `Runner::ensure`, which looks.) A version is at
/// least 1 (a sign would pass the 63-byte budget).
pub fn check_projection(name: &str, version: i32) -> Result<(), ProjectionError> {
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
    if looks_like_a_table(name) {
        return bad("it is, or could be, the name of a projection's table (<name>_v<N>, <name>_v<N>_r<M>)");
    }
    if version < 1 {
        return bad("its version must be at least 1");
    }
    Ok(())
}

/// Refuses `p`'s code when a newer version serves: it may neither rebuild
/// the projection (the switch would serve an older version again) nor read
/// the view as its own.
pub(crate) fn not_older_than_serving(e: &Entry, p: &dyn Projection) -> Result<(), ProjectionError> {
    if e.version > p.version() {
        return Err(ProjectionError::OlderThanServing {
            name: p.name().into(),
            serving: e.version,
            ours: p.version(),
        });
    }
    Ok(())
}

/// `x_v2` or `x_v2_r1733400000000`: what `table_name` and a rebuild make.
fn looks_like_a_table(name: &str) -> bool {
    // Where `tag` followed by digits ends `s`, after something.
    let digits_after = |s: &str, tag: &str| -> Option<usize> {
        let i = s.rfind(tag)?;
        let tail = &s[i + tag.len()..];
        (i > 0 && !tail.is_empty() && tail.bytes().all(|b| b.is_ascii_digit())).then_some(i)
    };
    let base = digits_after(name, "_r").map_or(name, |i| &name[..i]);
    digits_after(base, "_v").is_some()
}

impl Runner<'_> {
    /// Refuses when the view serves another version than `p`'s code: in a
    /// rolling upgrade older code's `catch_up` leaves a newer version alone
    /// and returns Ok, so a caller about to read the view through `p`'s
    /// idea of its table (`verify --rebuilt`) asks this first instead of
    /// misreading a table of another shape.
    pub async fn check_serving(&self, p: &dyn Projection) -> Result<(), ProjectionError> {
        let e = self.entry(p.name()).await?;
        not_older_than_serving(&e, p)?;
        // Older than ours: `catch_up` would have built ours and switched it
        // in, unless a newer version's build is under way (a version-skipping
        // upgrade), which ours leaves alone.
        if e.version < p.version() {
            return Err(ProjectionError::NotServing {
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
    /// wait for a switch that will never come here. The registry is read
    /// before every step, so no step carries on a rebuild other than this
    /// one for long: once `table` is neither being built nor serving (a
    /// newer version's build replaced it, or it served and a later rebuild
    /// followed it between two looks) this ends in
    /// `ProjectionError::RebuildReplaced`. Like `catch_up`, it gives up
    /// with `ProjectionError::Stalled` after the runner's patience without
    /// a step that moved anything (an open transaction holds the horizon,
    /// or the switch keeps timing out), instead of waiting for good.
    pub async fn finish_rebuild(
        &self,
        p: &dyn Projection,
        table: &str,
        mut progress: impl FnMut(usize),
    ) -> Result<i32, ProjectionError> {
        // A step that moved nothing (the horizon is held, or the switch
        // must wait) backs off instead of spinning.
        let mut idle = Backoff::new();
        let mut moved = std::time::Instant::now();
        loop {
            let e = self.entry(p.name()).await?;
            if e.active_table == table {
                return Ok(e.version);
            }
            if e.building_table.as_deref() != Some(table) {
                return Err(ProjectionError::RebuildReplaced {
                    name: p.name().to_string(),
                    table: table.to_string(),
                });
            }
            let s = self.step_only(&[p], Some(table)).await?;
            progress(s.rebuilt);
            if s.rebuilt == 0 && s.applied == 0 && s.switched_to.is_none() && !s.raced {
                if moved.elapsed() >= self.patience {
                    return Err(ProjectionError::Stalled {
                        name: p.name().to_string(),
                        waited: moved.elapsed(),
                    });
                }
                idle.wait().await;
            } else {
                idle.reset();
                moved = std::time::Instant::now();
            }
        }
    }
}
