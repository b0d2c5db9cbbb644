//! The HTML page of `idem audit report`: one self-contained file (no network: styles
//! inline, charts as inline SVG) that prints cleanly to PDF (print CSS, A4).
//!
//! Every figure is also in a `data-value` attribute on an element with a stable `id`, so
//! a test (or a script) can read the rendered page back.
//!
//! The markup is in `templates/report.html` and `templates/chart.svg` (askama, compiled
//! in): this module counts and lays out, the templates only show, and the engine escapes
//! every value it writes, in text and attributes alike.
//!
//! Claims, business rows and outbox events are the store's exact evidence; duplicates
//! suppressed, conflicts and dead letters (by reason) come from the outcome tally the
//! consumers keep in `idem_outcome_counts` (`idem_engine::tally`), which the page labels as
//! operational counts and explains; a store without that table gets a note instead.

use std::collections::BTreeMap;
use std::fmt;

use askama::Template;
use idem_broker::horizon::human;

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

/// A count as the page shows it, digits grouped by thousands (`12,345`); `.0` is the
/// plain number, for `data-` attributes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Count(u64);

impl fmt::Display for Count {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&thousands(i128::from(self.0)))
    }
}

/// A figure of a table: a `<td>` with a stable `id`, the raw value in its `data-value`
/// (empty when the store does not record it) and the value as shown.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Figure {
    id: &'static str,
    value: Option<i128>,
    shown: String,
}

impl Figure {
    /// A count, grouped by thousands.
    fn count(id: &'static str, n: u64) -> Self {
        Self {
            id,
            value: Some(i128::from(n)),
            shown: Count(n).to_string(),
        }
    }

    /// An amount in cents, shown as `1,234.56`.
    fn money(id: &'static str, cents: i64) -> Self {
        Self {
            id,
            value: Some(i128::from(cents)),
            shown: money(cents),
        }
    }

    /// A figure the store does not record: no value, `shown` instead.
    fn absent(id: &'static str, shown: &'static str) -> Self {
        Self {
            id,
            value: None,
            shown: shown.to_owned(),
        }
    }
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

/// A bar chart as `templates/chart.svg` draws it: the geometry, computed here.
#[derive(Debug)]
struct Chart {
    id: &'static str,
    /// Its accessible name (`aria-label`).
    label: &'static str,
    width: f64,
    height: f64,
    /// Where the plot starts and ends, left to right.
    left: f64,
    right: f64,
    /// Where the scale's labels end (right-aligned).
    tick_label_x: f64,
    /// The horizontal axis.
    baseline: f64,
    ticks: Vec<Tick>,
    days: Vec<ChartDay>,
    legend: Vec<Legend>,
}

/// A line of the scale and its label.
#[derive(Debug)]
struct Tick {
    y: f64,
    label_y: f64,
    value: Count,
}

/// One day of a chart: a bar per series, and the day's label under some days.
#[derive(Debug)]
struct ChartDay {
    bars: Vec<Bar>,
    label: Option<AxisLabel>,
}

/// One bar: a series' value on a day.
#[derive(Debug)]
struct Bar {
    day: String,
    series: &'static str,
    legend: &'static str,
    colour: &'static str,
    value: u64,
    x: f64,
    y: f64,
    width: f64,
    height: f64,
}

/// A day's label under the axis.
#[derive(Debug)]
struct AxisLabel {
    x: f64,
    y: f64,
    text: String,
}

/// A series' entry in the legend: its swatch and its text.
#[derive(Debug)]
struct Legend {
    x: f64,
    y: f64,
    colour: &'static str,
    text_x: f64,
    text_y: f64,
    text: &'static str,
}

/// Bars per day, one per series, with a round scale and a legend.
fn chart(id: &'static str, label: &'static str, days: &[Day], series: &[Series]) -> Chart {
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
    let mut ticks = Vec::new();
    let mut tick = 0;
    while tick <= ymax {
        let ty = y(tick);
        ticks.push(Tick {
            y: ty,
            label_y: ty + 4.0,
            value: Count(tick),
        });
        tick += step;
    }
    let n = days.len().max(1) as f64;
    let k = series.len().max(1) as f64;
    let slot = plot_w / n;
    let bar = (slot * 0.8 / k).max(0.5);
    let label_every = ((n / 12.0).ceil() as usize).max(1);
    let chart_days = days
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let x0 = left + slot * i as f64 + slot * 0.1;
            let bars = series
                .iter()
                .enumerate()
                .map(|(j, se)| {
                    let v = (se.value)(d);
                    let top_y = y(v);
                    Bar {
                        day: d.day.clone(),
                        series: se.name,
                        legend: se.legend,
                        colour: se.colour,
                        value: v,
                        x: x0 + bar * j as f64,
                        y: top_y,
                        width: bar,
                        height: (top + plot_h - top_y).max(0.0),
                    }
                })
                .collect();
            let label = (i % label_every == 0).then(|| AxisLabel {
                x: x0 + bar * k / 2.0,
                y: top + plot_h + 14.0,
                text: d.day.get(5..).unwrap_or(&d.day).to_owned(),
            });
            ChartDay { bars, label }
        })
        .collect();
    let legend = series
        .iter()
        .enumerate()
        .map(|(j, se)| {
            let lx = left + 200.0 * j as f64;
            Legend {
                x: lx,
                y: h - 14.0,
                colour: se.colour,
                text_x: lx + 14.0,
                text_y: h - 5.0,
                text: se.legend,
            }
        })
        .collect();
    Chart {
        id,
        label,
        width: w,
        height: h,
        left,
        right: w - 10.0,
        tick_label_x: left - 6.0,
        baseline: top + plot_h,
        ticks,
        days: chart_days,
        legend,
    }
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

/// The totals the consumers tallied (`idem_outcome_counts`); the page says what they are
/// and their limits.
#[derive(Debug)]
struct Outcomes {
    duplicates: Figure,
    conflicts: Figure,
    dead_letters: Figure,
    processed_tallied: Figure,
    /// The processed count the consumers tallied, against the claims.
    gap: Gap,
}

/// How the tallied processed count compares with the claims.
#[derive(Debug, PartialEq, Eq)]
enum Gap {
    Equal,
    Fewer(Count),
    More(Count),
}

/// The totals of the tally, or `None` for a store without the table (the page says so).
fn outcome_totals(outcomes: Option<&[OutcomeCount]>, claims: u64) -> Option<Outcomes> {
    let t = tallied(outcomes?);
    let gap = match t.processed.cmp(&claims) {
        std::cmp::Ordering::Equal => Gap::Equal,
        std::cmp::Ordering::Less => Gap::Fewer(Count(claims - t.processed)),
        std::cmp::Ordering::Greater => Gap::More(Count(t.processed - claims)),
    };
    Some(Outcomes {
        duplicates: Figure::count("duplicates", t.duplicates),
        conflicts: Figure::count("conflicts", t.conflicts),
        dead_letters: Figure::count("dead-letters", t.dead_letters),
        processed_tallied: Figure::count("processed-tallied", t.processed),
        gap,
    })
}

/// The dead letters of the window by reason code.
#[derive(Debug)]
struct Reasons {
    rows: Vec<Reason>,
    total: Figure,
}

/// A reason code, its dead letters and what it means.
#[derive(Debug)]
struct Reason {
    code: String,
    count: Count,
    meaning: &'static str,
}

/// The dead letters by reason, or `None` for a store without the tally.
fn reasons_table(outcomes: Option<&[OutcomeCount]>) -> Option<Reasons> {
    let t = tallied(outcomes?);
    let rows = t
        .reasons
        .iter()
        .map(|(code, count)| Reason {
            code: code.clone(),
            count: Count(*count),
            meaning: reason_meaning(code),
        })
        .collect();
    Some(Reasons {
        rows,
        total: Figure::count("dead-letters-by-reason", t.dead_letters),
    })
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

/// The page (`templates/report.html`): everything it shows, counted and formatted here.
#[derive(Template)]
#[template(path = "report.html")]
struct Page<'a> {
    store: &'a str,
    store_kind: &'static str,
    schema: Option<&'a str>,
    since: Timestamp,
    until: Timestamp,
    generated: Timestamp,
    version: &'static str,
    /// The business table and its columns (plain identifiers).
    table: &'a str,
    amount_column: &'a str,
    subject_column: &'a str,
    verdict: Verdict,
    totals: Totals,
    outcomes: Option<Outcomes>,
    charts: [Chart; 2],
    /// Whether the store keeps the outcome tally (otherwise its columns show `-`).
    recorded: bool,
    /// The days with any activity.
    days: Vec<DayRow>,
    day_totals: DayTotals,
    reasons: Option<Reasons>,
    retention: Retention,
    sample: Vec<SampleRow<'a>>,
}

/// The recount's verdict.
#[derive(Debug)]
struct Verdict {
    agrees: bool,
    claims: Count,
    rows: Count,
    claims_without_row: u64,
    claims_with_several_rows: u64,
    rows_without_claim: u64,
}

/// The totals for the window, from the store.
#[derive(Debug)]
struct Totals {
    processed: Figure,
    business_rows: Figure,
    amount_total: Figure,
    claims_without_row: Figure,
    claims_with_several_rows: Figure,
    rows_without_claim: Figure,
    subjects_with_several_rows: Figure,
    events: Figure,
    published: Figure,
    unpublished: Figure,
}

/// A row of the per-day table.
#[derive(Debug)]
struct DayRow {
    day: String,
    claims: Count,
    duplicates: Count,
    conflicts: Count,
    dead_letters: Count,
    events: Count,
    published: Count,
}

/// The last row of the per-day table.
#[derive(Debug)]
struct DayTotals {
    claims: Figure,
    duplicates: Figure,
    conflicts: Figure,
    dead_letters: Figure,
    events: Count,
    published: Count,
}

/// The retention section.
#[derive(Debug)]
struct Retention {
    oldest_claim: Option<Timestamp>,
    all_claims: Figure,
    /// The floor in seconds, for `data-value`.
    floor_secs: i64,
    floor_words: String,
    cutoff: Option<Timestamp>,
    purgeable_claims: Figure,
    purgeable_events: Figure,
}

/// A sampled claim and the command that re-derives its key.
#[derive(Debug)]
struct SampleRow<'a> {
    key: &'a str,
    subject: &'a str,
    /// The subject single-quoted for a POSIX shell, as the command takes it.
    quoted_subject: String,
    claimed_at: Option<Timestamp>,
    events: usize,
}

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
    let recorded = st.outcomes.is_some();
    let series: &[Series] = if recorded {
        &OUTCOME_SERIES
    } else {
        &OUTCOME_SERIES[..1]
    };
    let charts = [
        chart(
            "chart",
            "Processed, duplicates suppressed, conflicts and dead letters per day",
            &days,
            series,
        ),
        chart(
            "outbox-chart",
            "Outbox events written and published per day",
            &days,
            &OUTBOX_SERIES,
        ),
    ];
    let mut sum = Day::default();
    let rows = days
        .iter()
        .filter(|d| d.active())
        .map(|d| {
            sum.duplicates += d.duplicates;
            sum.conflicts += d.conflicts;
            sum.dead_letters += d.dead_letters;
            DayRow {
                day: d.day.clone(),
                claims: Count(d.claims),
                duplicates: Count(d.duplicates),
                conflicts: Count(d.conflicts),
                dead_letters: Count(d.dead_letters),
                events: Count(d.events),
                published: Count(d.published),
            }
        })
        .collect();
    // A tallied total, or a dash when the store keeps no tally.
    let tally_total = |id: &'static str, v: u64| {
        if recorded {
            Figure::count(id, v)
        } else {
            Figure::absent(id, "-")
        }
    };
    let page = Page {
        store: &r.store,
        store_kind: r.store_kind,
        schema: r.schema.as_deref(),
        since: r.since,
        until: r.until,
        generated: r.generated,
        version: env!("CARGO_PKG_VERSION"),
        table: r.business.table.as_str(),
        amount_column: r.business.amount_column.as_str(),
        subject_column: r.business.subject_column.as_str(),
        verdict: Verdict {
            agrees: rec.agrees(),
            claims: Count(rec.claims),
            rows: Count(rec.rows),
            claims_without_row: rec.claims_without_row,
            claims_with_several_rows: rec.claims_with_several_rows,
            rows_without_claim: rec.rows_without_claim,
        },
        totals: Totals {
            processed: Figure::count("processed", rec.claims),
            business_rows: Figure::count("business-rows", rec.rows),
            amount_total: Figure::money("amount-total", rec.amount_total),
            claims_without_row: Figure::count("claims-without-row", rec.claims_without_row),
            claims_with_several_rows: Figure::count(
                "claims-with-several-rows",
                rec.claims_with_several_rows,
            ),
            rows_without_claim: Figure::count("rows-without-claim", rec.rows_without_claim),
            subjects_with_several_rows: Figure::count(
                "subjects-with-several-rows",
                rec.subjects_with_several_rows,
            ),
            events: Figure::count("events", events),
            published: Figure::count("published", published),
            unpublished: Figure::count("unpublished", st.unpublished),
        },
        outcomes: outcome_totals(st.outcomes.as_deref(), rec.claims),
        charts,
        recorded,
        days: rows,
        day_totals: DayTotals {
            claims: Figure::count("processed-by-day", claims_by_day),
            duplicates: tally_total("duplicates-by-day", sum.duplicates),
            conflicts: tally_total("conflicts-by-day", sum.conflicts),
            dead_letters: tally_total("dead-letters-by-day", sum.dead_letters),
            events: Count(events),
            published: Count(published),
        },
        reasons: reasons_table(st.outcomes.as_deref()),
        retention: Retention {
            oldest_claim: ret.oldest_claim,
            all_claims: Figure::count("all-claims", ret.all_claims),
            floor_secs: floor_secs(r.floor, r.generated),
            floor_words: floor_words(r.floor),
            cutoff: ret.cutoff,
            purgeable_claims: Figure::count("purgeable-claims", ret.purgeable_claims),
            purgeable_events: Figure::count("purgeable-events", ret.purgeable_events),
        },
        sample: st
            .sample
            .iter()
            .map(|c| {
                let subject = c.award_id.as_deref().unwrap_or("");
                SampleRow {
                    key: &c.key,
                    subject,
                    quoted_subject: shell_quote(subject),
                    claimed_at: c.claimed_at,
                    events: c.events.len(),
                }
            })
            .collect(),
    };
    // Rendering into a `String` fails only if a value's `Display` fails, and none does.
    page.render()
        .expect("the report's values display without error")
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
        let mut stats = AuditStats::default();
        stats.days = vec![idem_engine::record::DayCounts::new(
            "2026-07-01".into(),
            5,
            5,
            4,
        )];
        stats.outcomes = outcomes;
        page_of(&stats, "sqlite://x", None)
    }

    fn page_of(stats: &AuditStats, store: &str, schema: Option<&str>) -> String {
        let business = BusinessTable::disbursements();
        let t = |s| Timestamp::parse_rfc3339(s).expect("timestamp");
        render(&Report {
            store: store.into(),
            schema: schema.map(str::to_owned),
            store_kind: "SQLite",
            since: t("2026-07-01"),
            until: t("2026-07-03"),
            generated: t("2026-07-03"),
            floor: std::time::Duration::from_secs(86_400).into(),
            business: &business,
            stats,
        })
    }

    /// The text an HTML attribute value or text node stands for: character references
    /// decoded, whichever spelling the engine chose.
    fn unescape(s: &str) -> String {
        let mut out = String::new();
        let mut rest = s;
        while let Some(at) = rest.find('&') {
            out.push_str(&rest[..at]);
            let end = rest[at..]
                .find(';')
                .expect("a character reference ends with ;")
                + at;
            let name = &rest[at + 1..end];
            let c = match name {
                "amp" => '&',
                "lt" => '<',
                "gt" => '>',
                "quot" => '"',
                "apos" => '\'',
                _ => {
                    let n = if let Some(hex) = name.strip_prefix("#x") {
                        u32::from_str_radix(hex, 16)
                    } else {
                        name.strip_prefix('#').expect("a numeric reference").parse()
                    };
                    char::from_u32(n.expect("a number")).expect("a character")
                }
            };
            out.push(c);
            rest = &rest[end + 1..];
        }
        out.push_str(rest);
        out
    }

    /// The value of attribute `name` in the tag that starts with `tag`, decoded.
    fn attr(html: &str, tag: &str, name: &str) -> String {
        let at = html
            .find(tag)
            .unwrap_or_else(|| panic!("{tag} in the page"));
        let html = &html[at..html[at..].find('>').expect("the tag's end") + at];
        let v = html
            .split(&format!(" {name}=\""))
            .nth(1)
            .unwrap_or_else(|| panic!("{name} in {html}"));
        unescape(&v[..v.find('"').expect("the attribute's closing quote")])
    }

    /// The text between `open` and the next tag, after the first `after` in the page,
    /// decoded.
    fn text(html: &str, after: &str, open: &str) -> String {
        let html = &html[html
            .find(after)
            .unwrap_or_else(|| panic!("{after} in the page"))..];
        let t = &html[html
            .find(open)
            .unwrap_or_else(|| panic!("{open} after {after}"))
            + open.len()..];
        unescape(&t[..t.find('<').expect("the next tag")])
    }

    #[test]
    fn text_and_attributes_from_the_store_are_escaped() {
        let award = r#"A'1 <script>alert("x")</script> & co"#;
        let key = r#"k"><script>alert(1)</script>"#;
        let reason = r#"r" onmouseover="alert(2)<script>"#;
        let store = r#"sqlite://<script>"x".db"#;
        let schema = r#"s<script>"'"#;
        let mut stats = AuditStats::default();
        stats.sample = vec![idem_engine::record::ClaimRecord::new(
            key.into(),
            Some(award.into()),
            None,
        )];
        stats.outcomes = Some(vec![OutcomeCount::new("2026-07-01", "rejected", reason, 1)]);
        let html = page_of(&stats, store, Some(schema));
        assert!(
            !html.to_ascii_lowercase().contains("<script"),
            "a script element from the store's text"
        );
        // An attribute holds the whole value (an unescaped `"` would end it early and
        // start another attribute), and so does the text (an unescaped `<` would start
        // a tag).
        let sample = r#"<tr class="sample""#;
        assert_eq!(attr(&html, sample, "data-key"), key);
        assert_eq!(text(&html, sample, r#"<td class="mono">"#), key);
        assert_eq!(text(&html, sample, "</td><td>"), award);
        assert_eq!(
            text(&html, sample, "<code>"),
            format!(
                "idem key --subject {} --timestamp <second part> --payload <message body file>",
                shell_quote(award)
            )
        );
        let row = r#"<tr class="reason""#;
        assert_eq!(attr(&html, row, "data-reason"), reason);
        assert_eq!(text(&html, row, r#"<td class="mono">"#), reason);
        assert_eq!(text(&html, "<header>", r#"id="store">"#), store);
        assert_eq!(
            text(&html, "<header>", r#"schema <span class="mono">"#),
            schema
        );
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
    fn numbers_are_grouped_and_subjects_quoted() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(1234567), "1,234,567");
        assert_eq!(thousands(-1000), "-1,000");
        assert_eq!(money(123456), "1,234.56");
        assert_eq!(money(-5), "-0.05");
        assert_eq!(shell_quote("A'1"), r"'A'\''1'");
    }
}
