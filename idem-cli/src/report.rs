//! The HTML page of `idem audit report`: one self-contained file (no network: styles
//! inline, charts as inline SVG) that prints cleanly to PDF (print CSS, A4).
//!
//! Every figure is also in a `data-value` attribute on an element with a stable `id`, so
//! a test (or a script) can read the rendered page back.

use std::fmt::Write as _;
use std::time::Duration;

use idem_broker::horizon::human;
use idem_core::record::{AuditStats, BusinessTable, DayCounts, Timestamp};

/// What the page is made from.
pub(crate) struct Report<'a> {
    /// The store URL, password masked.
    pub(crate) store: String,
    /// The Postgres schema, if any.
    pub(crate) schema: Option<String>,
    /// `PostgreSQL` or `SQLite`.
    pub(crate) store_kind: &'static str,
    /// The window's start (inclusive).
    pub(crate) since: Timestamp,
    /// The window's end (exclusive).
    pub(crate) until: Timestamp,
    /// When the report was made.
    pub(crate) generated: Timestamp,
    /// The retention floor measured against.
    pub(crate) floor: Duration,
    /// The business table recounted.
    pub(crate) business: &'a BusinessTable,
    /// What the store said.
    pub(crate) stats: &'a AuditStats,
}

/// HTML-escapes `s`.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `12345678` as `12,345,678`.
fn thousands(n: i128) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

/// Cents as `1,234.56`.
fn money(cents: i64) -> String {
    let c = i128::from(cents);
    let sign = if c < 0 { "-" } else { "" };
    format!("{sign}{}.{:02}", thousands(c.abs() / 100), c.abs() % 100)
}

/// Single-quotes `s` for a POSIX shell.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// A `<td>` with an id and its raw value.
fn figure(id: &str, value: i128, shown: &str) -> String {
    format!(
        r#"<td class="num" id="{id}" data-value="{value}">{}</td>"#,
        esc(shown)
    )
}

/// Every day of the window with its counts (days without activity as zeros), or only
/// the active days when the window is longer than `max_days`.
fn all_days(r: &Report<'_>, max_days: i64) -> Vec<DayCounts> {
    let day = 86_400_000_000i64;
    let first = r.since.start_of_day().unix_micros();
    let last = r.until.unix_micros() - 1;
    let n = (last.div_euclid(day) - first.div_euclid(day) + 1).max(0);
    if n > max_days || n == 0 {
        return r.stats.days.clone();
    }
    (0..n)
        .map(|i| {
            let (y, m, d) = Timestamp::from_unix_micros(first + i * day).date();
            let name = format!("{y:04}-{m:02}-{d:02}");
            r.stats
                .days
                .iter()
                .find(|c| c.day == name)
                .cloned()
                .unwrap_or_else(|| DayCounts::new(name, 0, 0, 0))
        })
        .collect()
}

/// Bars per day: claims, outbox events written, published.
fn chart(days: &[DayCounts]) -> String {
    let (w, h, left, bottom, top) = (900.0f64, 280.0f64, 56.0f64, 40.0f64, 16.0f64);
    let max = days
        .iter()
        .flat_map(|d| [d.claims, d.events, d.published])
        .max()
        .unwrap_or(0)
        .max(1);
    // A round scale: 1, 2 or 5 times a power of ten.
    let mut step = 1u64;
    while max / step > 5 {
        step = match step.to_string().as_bytes()[0] {
            b'1' => step * 2,
            b'2' => step * 5 / 2,
            _ => step * 2,
        };
    }
    let ymax = max.div_ceil(step) * step;
    let plot_w = w - left - 10.0;
    let plot_h = h - top - bottom;
    let y = |v: u64| top + plot_h - plot_h * (v as f64) / (ymax as f64);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg id="chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="100%" role="img" aria-label="Claims, outbox events and published events per day">"#
    );
    let mut tick = 0;
    while tick <= ymax {
        let ty = y(tick);
        let _ = write!(
            s,
            r##"<line x1="{left}" x2="{}" y1="{ty:.1}" y2="{ty:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" font-size="11" text-anchor="end" fill="#444">{}</text>"##,
            w - 10.0,
            left - 6.0,
            ty + 4.0,
            thousands(i128::from(tick))
        );
        tick += step;
    }
    let n = days.len().max(1) as f64;
    let slot = plot_w / n;
    let bar = (slot * 0.8 / 3.0).max(0.5);
    let colours = ["#1f5fa8", "#e08a1e", "#3a9a5b"];
    let label_every = ((n / 12.0).ceil() as usize).max(1);
    for (i, d) in days.iter().enumerate() {
        let x0 = left + slot * i as f64 + slot * 0.1;
        for (j, (v, c)) in [d.claims, d.events, d.published]
            .iter()
            .zip(colours)
            .enumerate()
        {
            let top_y = y(*v);
            let _ = write!(
                s,
                r#"<rect class="bar" data-day="{}" data-series="{}" data-value="{v}" x="{:.2}" y="{top_y:.2}" width="{bar:.2}" height="{:.2}" fill="{c}"><title>{} {}: {v}</title></rect>"#,
                esc(&d.day),
                ["claims", "events", "published"][j],
                x0 + bar * j as f64,
                (top + plot_h - top_y).max(0.0),
                esc(&d.day),
                ["processed", "outbox events", "published"][j],
            );
        }
        if i % label_every == 0 {
            let _ = write!(
                s,
                r##"<text x="{:.1}" y="{:.1}" font-size="10" text-anchor="middle" fill="#444">{}</text>"##,
                x0 + bar * 1.5,
                top + plot_h + 14.0,
                esc(d.day.get(5..).unwrap_or(&d.day))
            );
        }
    }
    let _ = write!(
        s,
        r##"<line x1="{left}" x2="{}" y1="{:.1}" y2="{:.1}" stroke="#333"/>"##,
        w - 10.0,
        top + plot_h,
        top + plot_h
    );
    for (j, (name, c)) in ["processed (claims)", "outbox events written", "published"]
        .iter()
        .zip(colours)
        .enumerate()
    {
        let lx = left + 200.0 * j as f64;
        let _ = write!(
            s,
            r#"<rect x="{lx}" y="{:.1}" width="10" height="10" fill="{c}"/><text x="{}" y="{:.1}" font-size="11">{name}</text>"#,
            h - 14.0,
            lx + 14.0,
            h - 5.0
        );
    }
    s.push_str("</svg>");
    s
}

const STYLE: &str = r#"
:root { color-scheme: light; }
body { font: 14px/1.45 "DejaVu Sans", system-ui, sans-serif; color: #111; margin: 24px auto; max-width: 1000px; padding: 0 16px; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; border-bottom: 1px solid #ccc; padding-bottom: 3px; margin-top: 26px; }
.meta { color: #444; font-size: 12px; }
table { border-collapse: collapse; width: 100%; margin: 8px 0; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f2f2f2; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
code, .mono { font-family: "DejaVu Sans Mono", monospace; font-size: 12px; word-break: break-all; }
.verdict { padding: 10px 14px; border-radius: 4px; font-weight: 600; margin: 12px 0; }
.agree { background: #e5f4ea; border: 1px solid #3a9a5b; }
.disagree { background: #fbe4e4; border: 1px solid #b3261e; }
.note { background: #fff8e1; border: 1px solid #e0c060; padding: 8px 12px; margin: 8px 0; font-size: 13px; }
svg { display: block; margin: 8px 0; }
@page { size: A4; margin: 14mm; }
@media print {
  body { margin: 0; max-width: none; font-size: 11px; }
  h2 { break-after: avoid; }
  section, table, svg, .verdict, .note { break-inside: avoid; }
  tr { break-inside: avoid; }
  a { color: inherit; text-decoration: none; }
  .verdict, .agree, .disagree, .note, th { -webkit-print-color-adjust: exact; print-color-adjust: exact; }
}
"#;

/// The whole page.
pub(crate) fn render(r: &Report<'_>) -> String {
    let st = r.stats;
    let rec = &st.reconciliation;
    let ret = &st.retention;
    let days = all_days(r, 400);
    let (events, published): (u64, u64) = st
        .days
        .iter()
        .fold((0, 0), |(e, p), d| (e + d.events, p + d.published));
    let claims_by_day: u64 = st.days.iter().map(|d| d.claims).sum();
    let table = esc(&r.business.table);
    let mut h = String::new();
    let _ = write!(
        h,
        r#"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>idem audit report {since} to {until}</title>
<style>{STYLE}</style></head>
<body>
<header><h1>Exactly-once audit report</h1>
<div class="meta">Store: <span class="mono" id="store">{store}</span> ({kind}{schema}) ·
window <span id="since" data-value="{since}">{since}</span> (inclusive) to <span id="until" data-value="{until}">{until}</span> (exclusive) ·
generated <span id="generated">{generated}</span> by idem {version}. Times are UTC.</div></header>
"#,
        since = r.since,
        until = r.until,
        store = esc(&r.store),
        kind = r.store_kind,
        schema = r
            .schema
            .as_deref()
            .map(|s| format!(", schema <span class=\"mono\">{}</span>", esc(s)))
            .unwrap_or_default(),
        generated = r.generated,
        version = env!("CARGO_PKG_VERSION"),
    );

    // The verdict.
    let (class, verdict) = if rec.agrees() {
        (
            "agree",
            format!(
                "Totals agree: {} submissions processed in the window, {} {table} rows carrying their keys (one per claim), no {table} row without a claim.",
                thousands(i128::from(rec.claims)),
                thousands(i128::from(rec.rows)),
            ),
        )
    } else {
        (
            "disagree",
            format!(
                "Totals DISAGREE: {} claims in the window but {} {table} rows carry their keys; {} claims without a row, {} claims with several rows, {} {table} rows without a claim.",
                thousands(i128::from(rec.claims)),
                thousands(i128::from(rec.rows)),
                rec.claims_without_row,
                rec.claims_with_several_rows,
                rec.rows_without_claim,
            ),
        )
    };
    let _ = writeln!(
        h,
        r#"<div class="verdict {class}" id="verdict" data-agree="{}">{}</div>"#,
        rec.agrees(),
        esc(&verdict)
    );

    // Totals.
    let _ = write!(
        h,
        r#"<section><h2>Totals for the window</h2>
<table><tr><th>What</th><th>Count</th><th>Where it comes from</th></tr>
<tr><td>Submissions processed (dedup records claimed)</td>{}<td>processed_messages, by claimed_at</td></tr>
<tr><td>Recounted: {table} rows whose key is one of those claims</td>{}<td>{table} joined to processed_messages on idempotency_key</td></tr>
<tr><td>Recounted: total amount of those rows</td>{}<td>sum of {table}.{amount}</td></tr>
<tr><td>Claims with no {table} row</td>{}<td>should be 0</td></tr>
<tr><td>Claims with more than one {table} row</td>{}<td>should be 0 (a double effect)</td></tr>
<tr><td>{table} rows (any time) without a dedup record</td>{}<td>should be 0 (a row without evidence, or evidence purged)</td></tr>
<tr><td>Subjects ({subject}) with more than one {table} row</td>{}<td>resubmissions of one award with a different payload each have their own key</td></tr>
<tr><td>Outbox events written</td>{}<td>outbox, by created_at</td></tr>
<tr><td>Outbox events published</td>{}<td>outbox, by published_at</td></tr>
<tr><td>Outbox events written and not yet published</td>{}<td>outbox, published_at empty</td></tr>
<tr><td>Duplicates suppressed</td><td class="num" id="duplicates" data-value="">not recorded</td><td>a duplicate's transaction rolls back and leaves no row in the store</td></tr>
<tr><td>Dead letters</td><td class="num" id="dead-letters" data-value="">not recorded</td><td>dead letters go to the broker's NAME.dead-letter, not to the store</td></tr>
</table>
<div class="note" id="not-recorded">Duplicates suppressed and dead letters are not recorded in the store today: a duplicate delivery rolls back
(nothing is written), and a rejected one goes to the source's <code>NAME.dead-letter</code> with its reason. They are counted
by the running consumer (<code>idem_deliveries_total{{outcome="duplicate"}}</code> and <code>{{outcome="rejected"}}</code>,
see ops/grafana) and logged as <code>idem::audit</code> events. This page shows what the store records: claims, business rows
and outbox events.</div>
</section>
"#,
        figure(
            "processed",
            i128::from(rec.claims),
            &thousands(i128::from(rec.claims))
        ),
        figure(
            "business-rows",
            i128::from(rec.rows),
            &thousands(i128::from(rec.rows))
        ),
        figure(
            "amount-total",
            i128::from(rec.amount_total),
            &money(rec.amount_total)
        ),
        figure(
            "claims-without-row",
            i128::from(rec.claims_without_row),
            &thousands(i128::from(rec.claims_without_row))
        ),
        figure(
            "claims-with-several-rows",
            i128::from(rec.claims_with_several_rows),
            &thousands(i128::from(rec.claims_with_several_rows))
        ),
        figure(
            "rows-without-claim",
            i128::from(rec.rows_without_claim),
            &thousands(i128::from(rec.rows_without_claim))
        ),
        figure(
            "subjects-with-several-rows",
            i128::from(rec.subjects_with_several_rows),
            &thousands(i128::from(rec.subjects_with_several_rows))
        ),
        figure("events", i128::from(events), &thousands(i128::from(events))),
        figure(
            "published",
            i128::from(published),
            &thousands(i128::from(published))
        ),
        figure(
            "unpublished",
            i128::from(st.unpublished),
            &thousands(i128::from(st.unpublished))
        ),
        amount = esc(&r.business.amount_column),
        subject = esc(&r.business.subject_column),
    );

    // Per day.
    let _ = write!(
        h,
        r#"<section><h2>Per day</h2>
{}
<table id="days"><tr><th>Day (UTC)</th><th>Processed</th><th>Outbox events</th><th>Published</th></tr>
"#,
        chart(&days)
    );
    for d in days
        .iter()
        .filter(|d| d.claims + d.events + d.published > 0)
    {
        let _ = writeln!(
            h,
            r#"<tr class="day" data-day="{day}" data-claims="{}" data-events="{}" data-published="{}"><td>{day}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td></tr>"#,
            d.claims,
            d.events,
            d.published,
            thousands(i128::from(d.claims)),
            thousands(i128::from(d.events)),
            thousands(i128::from(d.published)),
            day = esc(&d.day),
        );
    }
    let _ = writeln!(
        h,
        r#"<tr><th>Total</th>{}<td class="num">{}</td><td class="num">{}</td></tr></table></section>"#,
        figure(
            "processed-by-day",
            i128::from(claims_by_day),
            &thousands(i128::from(claims_by_day))
        ),
        thousands(i128::from(events)),
        thousands(i128::from(published)),
    );

    // Retention.
    let _ = write!(
        h,
        r#"<section><h2>Retention</h2>
<table>
<tr><td>Oldest evidence (earliest dedup record)</td><td id="oldest-claim">{}</td></tr>
<tr><td>Dedup records in the store (all time)</td>{}</tr>
<tr><td>Retention floor</td><td id="floor" data-value="{}">{} — records younger than this are never purged without an explicit override</td></tr>
<tr><td>Floor cutoff (now minus the floor)</td><td id="cutoff">{}</td></tr>
<tr><td>Dedup records a purge at the floor could remove</td>{}</tr>
<tr><td>Published outbox events a purge at the floor could remove</td>{}</tr>
</table>
<div class="note">A purge also refuses any cutoff inside a broker's redelivery horizon (<code>idem purge --broker URL --source NAME</code>;
<code>idem inspect --broker URL --source NAME</code> shows it): no record goes while its message could still be redelivered.</div>
</section>
"#,
        ret.oldest_claim
            .map_or_else(|| "none".to_owned(), |t| t.to_string()),
        figure(
            "all-claims",
            i128::from(ret.all_claims),
            &thousands(i128::from(ret.all_claims))
        ),
        r.floor.as_secs(),
        human(r.floor),
        ret.cutoff.map_or_else(|| "-".to_owned(), |t| t.to_string()),
        figure(
            "purgeable-claims",
            i128::from(ret.purgeable_claims),
            &thousands(i128::from(ret.purgeable_claims))
        ),
        figure(
            "purgeable-events",
            i128::from(ret.purgeable_events),
            &thousands(i128::from(ret.purgeable_events))
        ),
    );

    // Sample.
    let _ = write!(
        h,
        r#"<section><h2>A sample of keys, and how to re-derive each</h2>
<p>An idempotency key is <code>sha256_hex(award_id | submission_timestamp | sha256_hex(message body))</code>. The store keeps the
award id and the key, not the message body nor its submission timestamp: re-derive a key from the message as it was delivered
(from the archive of the source or of its producer) with the command shown; it must print the key in the first column.</p>
<table id="sample"><tr><th>Key</th><th>Award</th><th>Claimed at</th><th>Events</th><th>Re-derive with</th></tr>
"#
    );
    for c in &st.sample {
        let award = c.award_id.as_deref().unwrap_or("");
        let cmd = format!(
            "idem key --award-id {} --timestamp <submission_timestamp> --payload <message body file>",
            shell_quote(award)
        );
        let _ = writeln!(
            h,
            r#"<tr class="sample" data-key="{key}"><td class="mono">{key}</td><td>{}</td><td>{}</td><td class="num">{}</td><td><code>{}</code></td></tr>"#,
            esc(award),
            c.claimed_at
                .map_or_else(|| "-".to_owned(), |t| t.to_string()),
            c.events.len(),
            esc(&cmd),
            key = esc(&c.key),
        );
    }
    h.push_str("</table></section>\n</body></html>\n");
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped_and_numbers_grouped() {
        assert_eq!(
            esc(r#"<a href="x">'&'</a>"#),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(1234567), "1,234,567");
        assert_eq!(thousands(-1000), "-1,000");
        assert_eq!(money(123456), "1,234.56");
        assert_eq!(money(-5), "-0.05");
        assert_eq!(shell_quote("A'1"), r"'A'\''1'");
    }
}
