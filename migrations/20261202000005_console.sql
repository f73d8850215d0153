-- The console's "last minutes" figures read the newest events by time. The
-- log is append-only, so recorded_at follows the physical order and a BRIN
-- index (a few pages for millions of rows, nearly free to maintain) finds
-- the last minutes without a sequential scan.
CREATE INDEX events_recorded_brin ON jobledger.events USING brin (recorded_at);
CREATE INDEX rejections_recorded ON jobledger.rejections (recorded_at);
