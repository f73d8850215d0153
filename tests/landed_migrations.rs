//! A migration that has landed never changes: sqlx refuses a database that
//! applied the old file ("previously applied but has been modified"). Twice
//! a landed migration was edited in place; this compares every landed one
//! with the checksum it landed with (tests/landed_migrations.txt).

use jobledger::store::schema::MIGRATOR;

#[test]
fn landed_migrations_are_unchanged() {
    let landed = include_str!("landed_migrations.txt");
    let mut checked = 0;
    for line in landed
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
    {
        let mut parts = line.split_whitespace();
        let (version, sum, file) = (
            parts.next().unwrap(),
            parts.next().unwrap(),
            parts.next().unwrap(),
        );
        let version: i64 = version.parse().unwrap();
        let m = MIGRATOR
            .iter()
            .find(|m| m.version == version)
            .unwrap_or_else(|| panic!("landed migration {file} is gone"));
        assert_eq!(
            hex::encode(&*m.checksum),
            sum,
            "landed migration {file} was modified"
        );
        let described = file
            .trim_end_matches(".sql")
            .split_once('_')
            .map(|(_, d)| d.replace('_', " "));
        assert_eq!(described.as_deref(), Some(&*m.description), "{file} was renamed");
        checked += 1;
    }
    assert!(checked > 20, "the list names the landed migrations ({checked})");
}
