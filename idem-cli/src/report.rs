//! The HTML page of `idem audit report`: one self-contained file (no network: styles
//! inline, charts as inline SVG) that prints cleanly to PDF (print CSS, A4).
//!
//! Every figure is also in a `data-value` attribute on an element with a stable `id`, so
//! a test (or a script) can read the rendered page back.
//!
//! Claims, business rows and outbox events are the store's exact evidence; duplicates
//! suppressed, conflicts and dead letters (by reason) come from the outcome tally the
//! consumers keep in `idem_outcome_counts` (`idem_engine::tally`), which the page labels as
//! operational counts and explains; a store without that table gets a note instead.

use std::fmt::Write as _;

use idem_broker::horizon::human;
use std::collections::BTreeMap;

use idem_engine::record::{AuditStats, BusinessTable, OutcomeCount, Timestamp};
use idem_engine::retention::RetentionFloor;

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
    pub(crate) floor: idem_engine::retention::RetentionFloor,
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

/// One day of the page: what the store holds of it (claims, outbox events) and what the
/// consumers tallied (duplicates, conflicts, dead letters).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Day {
    day: String,
    claims: u64,
    events: u64,
    published: u64,
    duplicates: u64,
    conflicts: u64,
    dead_letters: u64,
}

impl Day {
    fn named(day: String) -> Self {
        Self {
            day,
            ..Self::default()
        }
    }

    fn active(&self) -> bool {
        self.claims + self.events + self.published + self.duplicates + self.dead_letters > 0
    }
}

/// The tallied outcomes of the window, summed.
#[derive(Debug, Default)]
struct Tallied {
    processed: u64,
    duplicates: u64,
    conflicts: u64,
    dead_letters: u64,
    /// Dead letters by reason code.
    reasons: BTreeMap<String, u64>,
}

fn tallied(counts: &[OutcomeCount]) -> Tallied {
    let mut t = Tallied::default();
    for c in counts {
        match c.outcome.as_str() {
            "processed" => t.processed += c.count,
            "duplicate" => t.duplicates += c.count,
            _ => {}
        }
        if c.outcome == "conflict" {
            t.conflicts += c.count;
        }
        if c.is_dead_letter() {
            t.dead_letters += c.count;
            let reason = if c.reason.is_empty() {
                "(none)".to_owned()
            } else {
                c.reason.clone()
            };
            *t.reasons.entry(reason).or_insert(0) += c.count;
        }
    }
    t
}

/// Every day of the window with its counts (days without activity as zeros), or only
/// the active days when the window is longer than `max_days`.
fn all_days(r: &Report<'_>, max_days: i64) -> Vec<Day> {
    let mut by_day: BTreeMap<String, Day> = BTreeMap::new();
    for d in &r.stats.days {
        let e = by_day
            .entry(d.day.clone())
            .or_insert_with(|| Day::named(d.day.clone()));
        e.claims = d.claims;
        e.events = d.events;
        e.published = d.published;
    }
    for c in r.stats.outcomes.iter().flatten() {
        let e = by_day
            .entry(c.day.clone())
            .or_insert_with(|| Day::named(c.day.clone()));
        match c.outcome.as_str() {
            "duplicate" => e.duplicates += c.count,
            "conflict" => e.conflicts += c.count,
            _ => {}
        }
        if c.is_dead_letter() {
            e.dead_letters += c.count;
        }
    }
    let day = 86_400_000_000i64;
    let first = r.since.start_of_day().unix_micros();
    let last = r.until.unix_micros() - 1;
    let n = (last.div_euclid(day) - first.div_euclid(day) + 1).max(0);
    if n > max_days || n == 0 {
        return by_day.into_values().collect();
    }
    (0..n)
        .map(|i| {
            let name = Timestamp::from_unix_micros(first + i * day).day();
            by_day.remove(&name).unwrap_or_else(|| Day::named(name))
        })
        .collect()
}

/// One series of a bar chart: its `data-series` name, its legend and colour, and its
/// value on a day.
struct Series {
    name: &'static str,
    legend: &'static str,
    colour: &'static str,
    value: fn(&Day) -> u64,
}

/// Bars per day, one per series, with a round scale and a legend.
fn chart(id: &str, label: &str, days: &[Day], series: &[Series]) -> String {
    let (w, h, left, bottom, top) = (900.0f64, 280.0f64, 56.0f64, 40.0f64, 16.0f64);
    let max = days
        .iter()
        .flat_map(|d| series.iter().map(move |s| (s.value)(d)))
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
        r#"<svg id="{id}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="100%" role="img" aria-label="{}">"#,
        esc(label)
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
    let k = series.len().max(1) as f64;
    let slot = plot_w / n;
    let bar = (slot * 0.8 / k).max(0.5);
    let label_every = ((n / 12.0).ceil() as usize).max(1);
    for (i, d) in days.iter().enumerate() {
        let x0 = left + slot * i as f64 + slot * 0.1;
        for (j, se) in series.iter().enumerate() {
            let v = (se.value)(d);
            let top_y = y(v);
            let _ = write!(
                s,
                r#"<rect class="bar" data-day="{}" data-series="{}" data-value="{v}" x="{:.2}" y="{top_y:.2}" width="{bar:.2}" height="{:.2}" fill="{}"><title>{} {}: {v}</title></rect>"#,
                esc(&d.day),
                se.name,
                x0 + bar * j as f64,
                (top + plot_h - top_y).max(0.0),
                se.colour,
                esc(&d.day),
                se.legend,
            );
        }
        if i % label_every == 0 {
            let _ = write!(
                s,
                r##"<text x="{:.1}" y="{:.1}" font-size="10" text-anchor="middle" fill="#444">{}</text>"##,
                x0 + bar * k / 2.0,
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
    for (j, se) in series.iter().enumerate() {
        let lx = left + 200.0 * j as f64;
        let _ = write!(
            s,
            r#"<rect x="{lx}" y="{:.1}" width="10" height="10" fill="{}"/><text x="{}" y="{:.1}" font-size="11">{}</text>"#,
            h - 14.0,
            se.colour,
            lx + 14.0,
            h - 5.0,
            se.legend
        );
    }
    s.push_str("</svg>");
    s
}

/// The chart of what happened to deliveries: processed (claims, from the store) and what
/// the consumers tallied.
static OUTCOME_SERIES: [Series; 4] = [
    Series {
        name: "claims",
        legend: "processed (claims)",
        colour: "#1f5fa8",
        value: |d| d.claims,
    },
    Series {
        name: "duplicates",
        legend: "duplicates suppressed",
        colour: "#8c8c8c",
        value: |d| d.duplicates,
    },
    Series {
        name: "conflicts",
        legend: "conflicts",
        colour: "#e08a1e",
        value: |d| d.conflicts,
    },
    Series {
        name: "dead-letters",
        legend: "dead letters",
        colour: "#b3261e",
        value: |d| d.dead_letters,
    },
];

/// The chart of the outbox: events written and published.
static OUTBOX_SERIES: [Series; 2] = [
    Series {
        name: "events",
        legend: "outbox events written",
        colour: "#6a4fb3",
        value: |d| d.events,
    },
    Series {
        name: "published",
        legend: "published",
        colour: "#3a9a5b",
        value: |d| d.published,
    },
];

/// The totals the consumers tallied (`idem_outcome_counts`), with what they are and
/// their limits; or, for a store without the table, a note saying so.
fn outcome_totals(outcomes: Option<&[OutcomeCount]>, claims: u64) -> String {
    let Some(counts) = outcomes else {
        return r#"<table id="outcomes"><tr><th>What</th><th>Count</th><th>Where it comes from</th></tr>
<tr><td>Duplicates suppressed</td><td class="num" id="duplicates" data-value="">not recorded</td><td rowspan="3">this store has no outcome table</td></tr>
<tr><td>Conflicts (dead-lettered)</td><td class="num" id="conflicts" data-value="">not recorded</td></tr>
<tr><td>Dead letters</td><td class="num" id="dead-letters" data-value="">not recorded</td></tr>
</table>
<div class="note" id="outcomes-missing">This store has no <code>idem_outcome_counts</code> table: it was not migrated since the
outcome tally was added, so duplicates suppressed, conflicts and dead letters are not recorded in it (a duplicate rolls back and
leaves no row; a dead letter goes to the broker's <code>NAME.dead-letter</code>). Run <code>idem migrate</code> (or restart
<code>idem consume</code> without <code>--no-migrate</code>) to create it; counting starts then. Meanwhile the running consumers
count them in <code>idem_deliveries_total</code> (see ops/grafana) and log them as <code>idem::audit</code> events.</div>
"#
        .to_owned();
    };
    let t = tallied(counts);
    let n = |v: u64| thousands(i128::from(v));
    let gap = if t.processed == claims {
        "equal to the claims".to_owned()
    } else if t.processed < claims {
        format!("{} fewer than the claims", n(claims - t.processed))
    } else {
        format!("{} more than the claims", n(t.processed - claims))
    };
    format!(
        r#"<table id="outcomes"><tr><th>What</th><th>Count</th><th>Where it comes from</th></tr>
<tr><td>Duplicates suppressed (redeliveries rolled back and acked)</td>{}<td>idem_outcome_counts, outcome duplicate</td></tr>
<tr><td>Conflicts (the same submission with another payload, dead-lettered)</td>{}<td>idem_outcome_counts, outcome conflict</td></tr>
<tr><td>Dead letters (bad input, conflicts, attempts exhausted, refused by the store)</td>{}<td>idem_outcome_counts, outcomes rejected and conflict; by reason below</td></tr>
<tr><td>Processed, as the consumers counted (<span id="processed-tallied-gap">{gap}</span>)</td>{}<td>idem_outcome_counts, outcome processed</td></tr>
</table>
<div class="note" id="outcomes-note">Duplicates, conflicts and dead letters leave no claim or business row, so the consumers count them:
each <code>idem consume</code> (and <code>idem demo</code>) tallies what happened to its deliveries per UTC day and adds the counts to
<code>idem_outcome_counts</code> every second and at exit. They are operational figures, not the exact evidence the claims and
business rows above are: a consumer that dies loses at most its last second's counts; a delivery whose worker died after its commit
is a claim but not counted, and its redelivery is counted as a duplicate; a flush whose answer was lost is retried and may count
twice; a consumer that does not tally (the reference consumer) adds nothing. Counts are by whole UTC days, so the first and last
day of the window count in full. The dead letters themselves, with their reasons and bodies, are in the broker's
<code>NAME.dead-letter</code> queue.</div>
"#,
        figure("duplicates", i128::from(t.duplicates), &n(t.duplicates)),
        figure("conflicts", i128::from(t.conflicts), &n(t.conflicts)),
        figure(
            "dead-letters",
            i128::from(t.dead_letters),
            &n(t.dead_letters)
        ),
        figure(
            "processed-tallied",
            i128::from(t.processed),
            &n(t.processed)
        ),
    )
}

/// The dead letters of the window by reason code.
fn reasons_table(outcomes: Option<&[OutcomeCount]>) -> String {
    let Some(counts) = outcomes else {
        return String::new();
    };
    let t = tallied(counts);
    let mut h = String::from(
        r#"<h3>Dead-letter reasons</h3>
<table id="reasons"><tr><th>Reason code</th><th>Dead letters</th><th>Meaning</th></tr>
"#,
    );
    for (reason, count) in &t.reasons {
        let _ = writeln!(
            h,
            r#"<tr class="reason" data-reason="{r}" data-value="{count}"><td class="mono">{r}</td><td class="num">{}</td><td>{}</td></tr>"#,
            thousands(i128::from(*count)),
            esc(reason_meaning(reason)),
            r = esc(reason),
        );
    }
    if t.reasons.is_empty() {
        h.push_str(r#"<tr><td colspan="3">no dead letters in the window</td></tr>"#);
        h.push('\n');
    }
    let _ = writeln!(
        h,
        r#"<tr><th>Total</th>{}<td></td></tr></table>"#,
        figure(
            "dead-letters-by-reason",
            i128::from(t.dead_letters),
            &thousands(i128::from(t.dead_letters))
        )
    );
    h
}

/// What a dead-letter reason code means, for the codes idem itself gives.
fn reason_meaning(code: &str) -> &'static str {
    match code {
        idem_engine::gate::CONFLICT => {
            "the same identity (subject and second part) as a processed submission, another payload"
        }
        idem_engine::gate::ATTEMPTS_EXHAUSTED => {
            "failed on every attempt (a handler error or panic)"
        }
        idem_engine::gate::STORE_REJECTED => "the store refused the message for good",
        idem_engine::gate::PERMANENT_FAILURE => "another permanent failure",
        "not_json" => "the body is not JSON",
        "not_utf8" => "the body is not UTF-8",
        "empty_body" => "the body is empty",
        "too_large" => "the body is larger than the limit",
        "not_object" => "the body is not a JSON object",
        "missing_field" => "a required field is missing",
        "wrong_type" => "a field has the wrong type",
        "not_integer" => "the amount is not an integer",
        "negative_amount" => "the amount is negative",
        "control_character" => "a field holds a control character",
        "too_long" => "a field is too long",
        "invalid_identity" => "the subject or the second part cannot form a key",
        _ => "bad input (see the dead letter's reason header)",
    }
}

const STYLE: &str = r#"
:root { color-scheme: light; }
body { font: 14px/1.45 "DejaVu Sans", system-ui, sans-serif; color: #111; margin: 24px auto; max-width: 1000px; padding: 0 16px; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; border-bottom: 1px solid #ccc; padding-bottom: 3px; margin-top: 26px; }
h3 { font-size: 15px; margin: 16px 0 4px; }
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
    let table = esc(r.business.table.as_str());
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
<tr><td>Subjects ({subject}) with more than one {table} row</td>{}<td>resubmissions of one subject with a different payload each have their own key</td></tr>
<tr><td>Outbox events written</td>{}<td>outbox, by created_at</td></tr>
<tr><td>Outbox events published</td>{}<td>outbox, by published_at</td></tr>
<tr><td>Outbox events written and not yet published</td>{}<td>outbox, published_at empty</td></tr>
</table>
{outcomes}</section>
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
        amount = esc(r.business.amount_column.as_str()),
        subject = esc(r.business.subject_column.as_str()),
        outcomes = outcome_totals(r.stats.outcomes.as_deref(), rec.claims),
    );

    // Per day.
    let recorded = st.outcomes.is_some();
    let series: &[Series] = if recorded {
        &OUTCOME_SERIES
    } else {
        &OUTCOME_SERIES[..1]
    };
    let _ = write!(
        h,
        r#"<section><h2>Per day</h2>
{}
{}
<table id="days"><tr><th>Day (UTC)</th><th>Processed</th><th>Duplicates suppressed</th><th>Conflicts</th><th>Dead letters</th><th>Outbox events</th><th>Published</th></tr>
"#,
        chart(
            "chart",
            "Processed, duplicates suppressed, conflicts and dead letters per day",
            &days,
            series
        ),
        chart(
            "outbox-chart",
            "Outbox events written and published per day",
            &days,
            &OUTBOX_SERIES
        ),
    );
    // A tallied figure, or a dash when the store keeps no tally.
    let tally_cell = |v: u64| {
        if recorded {
            format!(r#"<td class="num">{}</td>"#, thousands(i128::from(v)))
        } else {
            r#"<td class="num">-</td>"#.to_owned()
        }
    };
    let mut sum = Day::default();
    for d in days.iter().filter(|d| d.active()) {
        sum.duplicates += d.duplicates;
        sum.conflicts += d.conflicts;
        sum.dead_letters += d.dead_letters;
        let _ = writeln!(
            h,
            r#"<tr class="day" data-day="{day}" data-claims="{}" data-duplicates="{}" data-conflicts="{}" data-dead-letters="{}" data-events="{}" data-published="{}"><td>{day}</td><td class="num">{}</td>{}{}{}<td class="num">{}</td><td class="num">{}</td></tr>"#,
            d.claims,
            d.duplicates,
            d.conflicts,
            d.dead_letters,
            d.events,
            d.published,
            thousands(i128::from(d.claims)),
            tally_cell(d.duplicates),
            tally_cell(d.conflicts),
            tally_cell(d.dead_letters),
            thousands(i128::from(d.events)),
            thousands(i128::from(d.published)),
            day = esc(&d.day),
        );
    }
    let tally_total = |id: &str, v: u64| {
        if recorded {
            figure(id, i128::from(v), &thousands(i128::from(v)))
        } else {
            format!(r#"<td class="num" id="{id}" data-value="">-</td>"#)
        }
    };
    let _ = writeln!(
        h,
        r#"<tr><th>Total</th>{}{}{}{}<td class="num">{}</td><td class="num">{}</td></tr></table>"#,
        figure(
            "processed-by-day",
            i128::from(claims_by_day),
            &thousands(i128::from(claims_by_day))
        ),
        tally_total("duplicates-by-day", sum.duplicates),
        tally_total("conflicts-by-day", sum.conflicts),
        tally_total("dead-letters-by-day", sum.dead_letters),
        thousands(i128::from(events)),
        thousands(i128::from(published)),
    );
    h.push_str(&reasons_table(st.outcomes.as_deref()));
    h.push_str("</section>\n");

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
        floor_secs(r.floor, r.generated),
        floor_words(r.floor),
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
<p>An idempotency key is <code>sha256_hex(subject | second part | sha256_hex(message body))</code>: for a grant submission the
subject is its award id and the second part its submission timestamp; under a SQL handler's one-part identity the second part is
<code>-</code>. The store keeps the subject and the key, not the message body nor the second part: re-derive a key from the message as it was delivered
(from the archive of the source or of its producer) with the command shown; it must print the key in the first column.</p>
<table id="sample"><tr><th>Key</th><th>Subject</th><th>Claimed at</th><th>Events</th><th>Re-derive with</th></tr>
"#
    );
    for c in &st.sample {
        let award = c.award_id.as_deref().unwrap_or("");
        let cmd = format!(
            "idem key --subject {} --timestamp <second part> --payload <message body file>",
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

/// The floor in seconds back from `now` (for calendar years, the days those years have).
fn floor_secs(floor: RetentionFloor, now: Timestamp) -> i64 {
    (now.unix_micros() - floor.cutoff(now).unix_micros()) / 1_000_000
}

/// The floor in words: calendar years as such, an exact duration as `idem` writes one.
fn floor_words(floor: RetentionFloor) -> String {
    match floor {
        RetentionFloor::Exactly(d) => human(d),
        years => years.describe(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(outcomes: Option<Vec<OutcomeCount>>) -> String {
        let business = BusinessTable::disbursements();
        let mut stats = AuditStats::default();
        stats.days = vec![idem_engine::record::DayCounts::new(
            "2026-07-01".into(),
            5,
            5,
            4,
        )];
        stats.outcomes = outcomes;
        let t = |s| Timestamp::parse_rfc3339(s).expect("timestamp");
        render(&Report {
            store: "sqlite://x".into(),
            schema: None,
            store_kind: "SQLite",
            since: t("2026-07-01"),
            until: t("2026-07-03"),
            generated: t("2026-07-03"),
            floor: std::time::Duration::from_secs(86_400).into(),
            business: &business,
            stats: &stats,
        })
    }

    #[test]
    fn tallied_outcomes_are_shown_per_day_and_by_reason() {
        let c = |day: &str, o: &str, r: &str, n| OutcomeCount::new(day, o, r, n);
        let html = page(Some(vec![
            c("2026-07-01", "processed", "", 5),
            c("2026-07-01", "duplicate", "", 3),
            c("2026-07-01", "rejected", "not_json", 2),
            // A day with no claims at all still shows.
            c("2026-07-02", "conflict", "conflict", 1),
            c("2026-07-02", "rejected", "not_json", 1),
            c("2026-07-02", "failed", "", 9),
        ]));
        for (id, v) in [
            ("duplicates", 3),
            ("conflicts", 1),
            ("dead-letters", 4),
            ("processed-tallied", 5),
            ("duplicates-by-day", 3),
            ("conflicts-by-day", 1),
            ("dead-letters-by-day", 4),
            ("dead-letters-by-reason", 4),
        ] {
            assert!(
                html.contains(&format!(r#"id="{id}" data-value="{v}""#)),
                "#{id} = {v}"
            );
        }
        assert!(html.contains(r#"data-reason="not_json" data-value="3""#));
        assert!(html.contains(r#"data-reason="conflict" data-value="1""#));
        assert!(html.contains(r#"data-day="2026-07-02" data-claims="0" data-duplicates="0" data-conflicts="1" data-dead-letters="2""#));
        assert!(html.contains(r#"data-series="dead-letters" data-value="2""#));
        assert!(html.contains(r#"id="outcomes-note""#));
        assert!(!html.contains("outcomes-missing"));
    }

    #[test]
    fn a_store_without_the_outcome_table_says_so() {
        let html = page(None);
        assert!(html.contains(r#"id="outcomes-missing""#));
        assert!(html.contains(r#"id="duplicates" data-value="">not recorded"#));
        assert!(!html.contains(r#"data-series="duplicates""#));
        assert!(!html.contains(r#"id="reasons""#));
    }

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
