//! `idem consume --handler sql:FILE`: the team's own statements in the claim's
//! transaction.
//!
//! The file holds one or more statements separated by `;` (a `;` inside a quoted string,
//! a quoted name, a `--` or `/* */` comment or a `$tag$` dollar-quoted body does not
//! separate). Each statement runs in order, in the claim's transaction, with the message
//! bound as parameters — never spliced into the text:
//!
//! | parameter | Postgres | SQLite |
//! |---|---|---|
//! | `$1` | the body, `jsonb` | the body, JSON text (use `json_extract($1, '$.amount')`) |
//! | `$2` | the idempotency key, 64 lowercase hex (`text`) | the same |
//! | `$3` | the subject (`--identity`'s first part, `text`) | the same |
//! | `$4` | the headers, a JSON object of name → text (`jsonb`; the first of a repeated name) | the same as JSON text |
//!
//! A statement may use any of them, or none. With `--event-type NAME`, the rows the
//! *last* statement returns (`RETURNING …` or a `SELECT`) become the outbox event: one row
//! is one event of type `NAME` whose payload is the row as a JSON object (column name →
//! value); no row writes no event; more than one row refuses the message (`sql_rows`).
//!
//! Failures keep the gate's table: a statement the server refuses for this message's
//! values (Postgres SQLSTATE class 22, a data exception such as `22P02` for a cast the
//! payload fails, class 23, an integrity constraint, and the rest of
//! `idem_store_postgres::error::classify_sqlstate`'s `Rejected` class; SQLite
//! `CONSTRAINT`, `MISMATCH`, `TOOBIG`, `RANGE`) dead-letters it with reason
//! `store_rejected`, the SQLSTATE (SQLite: the result code) and the server's message;
//! everything else is the store's, as the store classifies it (a lock wait or a read-only
//! server defers, an outage retries, a missing table stops the consumer). The statements
//! are prepared once at start, so a typo is a usage error (exit 2), never a dead letter.

use std::sync::Arc;

use async_trait::async_trait;
use idem_engine::gate::STORE_REJECTED;
use idem_engine::{
    ClaimMeta, ClaimTx, Handler, HandlerError, Headers, OutboxEvent, OutboxWriter, RejectReason,
    StoreError, Submission,
};
use idem_grant::KeyDerivation;
use sqlx::{AssertSqlSafe, SqlSafeStr as _, SqlStr};

use crate::identity::IdentitySpec;

/// The longest part of a server's message kept in a dead-letter reason, in characters.
const MAX_SERVER_MESSAGE: usize = 300;

/// The statements of a `--handler sql:FILE`, split and ready to run.
#[derive(Debug)]
pub(crate) struct SqlScript {
    /// The file's name, for messages.
    name: String,
    /// Each statement, in order.
    statements: Vec<SqlStr>,
    /// With an event type: the last statement as Postgres runs it to read its rows as
    /// JSON (`WITH idem_row AS (…) SELECT to_jsonb(idem_row)::text FROM idem_row`).
    /// Read by the Postgres side only.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pg_rows: Option<SqlStr>,
    /// The outbox event type (`--event-type`), if any.
    event_type: Option<String>,
}

impl SqlScript {
    /// Splits `text` (read from the file `name`) into statements.
    ///
    /// # Errors
    /// A message for a file with no statement, an unterminated quote or comment, or a
    /// statement that would end the claim's transaction (`BEGIN`, `COMMIT`, `ROLLBACK`,
    /// `END`, `START`, `ABORT`).
    pub(crate) fn parse(
        name: &str,
        text: &str,
        event_type: Option<String>,
    ) -> Result<Self, String> {
        let statements = split_statements(text).map_err(|e| format!("{name}: {e}"))?;
        if statements.is_empty() {
            return Err(format!("{name} holds no SQL statement"));
        }
        for (i, s) in statements.iter().enumerate() {
            let first = s
                .split(|c: char| !c.is_ascii_alphabetic())
                .find(|w| !w.is_empty())
                .unwrap_or("")
                .to_ascii_uppercase();
            if ["BEGIN", "COMMIT", "ROLLBACK", "END", "START", "ABORT"].contains(&first.as_str()) {
                return Err(format!(
                    "statement {} of {name} is {first}: the statements run inside the claim's \
                     transaction, which idem begins and commits",
                    i + 1
                ));
            }
        }
        if let Some(t) = &event_type {
            if t.is_empty() || t.len() > 128 || t.chars().any(char::is_control) {
                return Err("--event-type takes a name of 1 to 128 characters".into());
            }
        }
        let pg_rows = event_type.as_ref().map(|_| {
            let last = statements.last().map(String::as_str).unwrap_or_default();
            sql_str(format!(
                "WITH idem_row AS (\n{last}\n) SELECT to_jsonb(idem_row)::text FROM idem_row"
            ))
        });
        Ok(Self {
            name: name.to_owned(),
            statements: statements.into_iter().map(sql_str).collect(),
            pg_rows,
            event_type,
        })
    }

    /// `statement N of FILE`, for messages.
    fn what(&self, i: usize) -> String {
        format!("statement {} of {}", i + 1, self.name)
    }
}

/// The operator's SQL file as sqlx's query string: program text from configuration (the
/// message's values are bound as parameters, never spliced in).
fn sql_str(text: String) -> SqlStr {
    AssertSqlSafe(Arc::<str>::from(text)).into_sql_str()
}

/// One message's parameters: `$1` to `$4`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SqlParams<'a> {
    /// `$1`: the body (JSON text).
    pub(crate) payload: &'a str,
    /// `$2`: the key, 64 hex.
    pub(crate) key: &'a str,
    /// `$3`: the subject.
    pub(crate) subject: &'a str,
    /// `$4`: the headers as a JSON object.
    pub(crate) headers: &'a str,
}

/// A store transaction the SQL handler runs its statements in: the claim's own.
///
/// # Contract
/// The statements run on the transaction's connection, so they commit and roll back with
/// the claim; an error is mapped by the store's own classification ([`StoreError`]),
/// except one the store classifies as the message's (`Rejected`), which is
/// [`HandlerError::Reject`] with [`STORE_REJECTED`] and the server's code and message.
#[async_trait]
pub(crate) trait SqlTx: ClaimTx + OutboxWriter {
    /// Prepares every statement without running it: a statement the server cannot parse
    /// or plan is reported, with the server's message.
    async fn prepare_script(&mut self, script: &SqlScript) -> Result<(), String>;

    /// Runs the statements with `params`; with an event type, returns the rows of the
    /// last one as JSON objects.
    async fn run_script(
        &mut self,
        script: &SqlScript,
        params: SqlParams<'_>,
    ) -> Result<Vec<String>, HandlerError>;

    /// Stages several outbox events in this transaction, in as few round trips as the
    /// store can (a batch's events in one statement).
    async fn enqueue_events(&mut self, events: &[OutboxEvent]) -> Result<(), StoreError>;
}

/// The server's refusal of this message's values, as a dead-letter reason: the code and
/// the message (cut to [`MAX_SERVER_MESSAGE`] characters). It goes to the dead letter
/// only, beside the payload: the gate logs a rejection's code, never its detail.
fn store_rejected(what: &str, code_name: &str, code: &str, message: &str) -> HandlerError {
    let mut cut: String = message.chars().take(MAX_SERVER_MESSAGE).collect();
    if cut.len() < message.len() {
        cut.push('…');
    }
    HandlerError::Reject(RejectReason::new(
        STORE_REJECTED,
        format!("{code_name} {code} in {what}: {cut}"),
    ))
}

/// The code and message of a database error, if it is one.
fn db_parts(e: &sqlx::Error) -> Option<(String, String)> {
    e.as_database_error().map(|db| {
        (
            db.code().map(|c| c.into_owned()).unwrap_or_default(),
            db.message().to_owned(),
        )
    })
}

#[cfg(feature = "postgres")]
mod pg {
    use super::*;
    use idem_store_postgres::PgTx;
    use sqlx::postgres::types::Oid;
    use sqlx::postgres::{PgArgumentBuffer, PgTypeInfo};
    use sqlx::{Encode, Postgres, Type};

    /// JSON text bound as `jsonb` (sqlx's `Json` needs its `json` feature and re-serialises).
    struct Jsonb<'a>(&'a str);

    /// The OID of `jsonb`, fixed in every Postgres.
    const JSONB_OID: u32 = 3802;

    impl Type<Postgres> for Jsonb<'_> {
        fn type_info() -> PgTypeInfo {
            PgTypeInfo::with_oid(Oid(JSONB_OID))
        }
    }

    impl Encode<'_, Postgres> for Jsonb<'_> {
        fn encode_by_ref(
            &self,
            buf: &mut PgArgumentBuffer,
        ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
            // jsonb's binary input: a version byte (1) and the JSON text.
            buf.push(1);
            buf.extend_from_slice(self.0.as_bytes());
            Ok(sqlx::encode::IsNull::No)
        }
    }

    /// The parameter types every statement is prepared with.
    fn types() -> [PgTypeInfo; 4] {
        [
            PgTypeInfo::with_oid(Oid(JSONB_OID)),
            <&str as Type<Postgres>>::type_info(),
            <&str as Type<Postgres>>::type_info(),
            PgTypeInfo::with_oid(Oid(JSONB_OID)),
        ]
    }

    fn query(
        sql: SqlStr,
        p: SqlParams<'_>,
    ) -> sqlx::query::Query<'_, Postgres, sqlx::postgres::PgArguments> {
        sqlx::query(sql)
            .bind(Jsonb(p.payload))
            .bind(p.key)
            .bind(p.subject)
            .bind(Jsonb(p.headers))
    }

    fn error(e: sqlx::Error, what: &str) -> HandlerError {
        let parts = db_parts(&e);
        match (idem_store_postgres::error::map_sqlx(e, what), parts) {
            (StoreError::Rejected { .. }, Some((code, message))) => {
                store_rejected(what, "SQLSTATE", &code, &message)
            }
            (other, _) => HandlerError::Store(other),
        }
    }

    #[async_trait]
    impl SqlTx for PgTx {
        async fn prepare_script(&mut self, script: &SqlScript) -> Result<(), String> {
            use sqlx::Executor as _;
            let types = types();
            let last = script.statements.len() - 1;
            for (i, s) in script.statements.iter().enumerate() {
                let sql = match (&script.pg_rows, i == last) {
                    (Some(rows), true) => rows.clone(),
                    _ => s.clone(),
                };
                if let Err(e) = self.conn().prepare_with(sql, &types).await {
                    let mut m = format!("{}: {}", script.what(i), crate::error::error_chain(&e));
                    if i == last && script.pg_rows.is_some() {
                        m.push_str(
                            " (with --event-type, the last statement returns the event's row: \
                             INSERT … RETURNING …, or a SELECT)",
                        );
                    }
                    return Err(m);
                }
            }
            Ok(())
        }

        async fn run_script(
            &mut self,
            script: &SqlScript,
            params: SqlParams<'_>,
        ) -> Result<Vec<String>, HandlerError> {
            let last = script.statements.len() - 1;
            for (i, s) in script.statements.iter().enumerate() {
                match (&script.pg_rows, i == last) {
                    (Some(rows), true) => {
                        use sqlx::Row as _;
                        let rows = query(rows.clone(), params)
                            .fetch_all(self.conn())
                            .await
                            .map_err(|e| error(e, &script.what(i)))?;
                        return rows
                            .iter()
                            .map(|r| r.try_get::<String, _>(0))
                            .collect::<Result<Vec<_>, _>>()
                            .map_err(|e| error(e, &script.what(i)));
                    }
                    _ => {
                        query(s.clone(), params)
                            .execute(self.conn())
                            .await
                            .map_err(|e| error(e, &script.what(i)))?;
                    }
                }
            }
            Ok(Vec::new())
        }

        async fn enqueue_events(&mut self, events: &[OutboxEvent]) -> Result<(), StoreError> {
            self.enqueue_many(events).await
        }
    }
}

mod sqlite {
    use super::*;
    use idem_store_sqlite::SqliteTx;
    use sqlx::sqlite::{SqliteArguments, SqliteRow};
    use sqlx::{Column as _, Row as _, Sqlite, TypeInfo as _, ValueRef as _};

    fn query(sql: SqlStr, p: SqlParams<'_>) -> sqlx::query::Query<'_, Sqlite, SqliteArguments> {
        sqlx::query(sql)
            .bind(p.payload)
            .bind(p.key)
            .bind(p.subject)
            .bind(p.headers)
    }

    fn error(e: sqlx::Error, what: &str) -> HandlerError {
        let parts = db_parts(&e);
        match (idem_store_sqlite::map_sqlx(e, what), parts) {
            (StoreError::Rejected { .. }, Some((code, message))) => {
                store_rejected(what, "SQLite result code", &code, &message)
            }
            (other, _) => HandlerError::Store(other),
        }
    }

    /// A row as a JSON object: each column by the type of its value (SQLite's are
    /// dynamic): INTEGER a number, REAL a number (`null` when not finite), TEXT a string,
    /// BLOB lowercase hex, NULL `null`.
    fn row_json(row: &SqliteRow) -> Result<String, sqlx::Error> {
        let mut object = serde_json::Map::new();
        for (i, column) in row.columns().iter().enumerate() {
            let raw = row.try_get_raw(i)?;
            let value = if raw.is_null() {
                serde_json::Value::Null
            } else {
                match raw.type_info().name() {
                    "INTEGER" => row.try_get_unchecked::<i64, _>(i)?.into(),
                    "REAL" => serde_json::Number::from_f64(row.try_get_unchecked::<f64, _>(i)?)
                        .map_or(serde_json::Value::Null, serde_json::Value::Number),
                    "BLOB" => {
                        let bytes = row.try_get_unchecked::<Vec<u8>, _>(i)?;
                        bytes
                            .iter()
                            .map(|b| format!("{b:02x}"))
                            .collect::<String>()
                            .into()
                    }
                    _ => row.try_get_unchecked::<String, _>(i)?.into(),
                }
            };
            object.insert(column.name().to_owned(), value);
        }
        Ok(serde_json::Value::Object(object).to_string())
    }

    #[async_trait]
    impl SqlTx for SqliteTx {
        async fn prepare_script(&mut self, script: &SqlScript) -> Result<(), String> {
            use sqlx::{Executor as _, Statement as _};
            let last = script.statements.len() - 1;
            for (i, s) in script.statements.iter().enumerate() {
                let statement = self.conn().prepare(s.clone()).await.map_err(|e| {
                    format!("{}: {}", script.what(i), crate::error::error_chain(&e))
                })?;
                if i == last && script.event_type.is_some() && statement.columns().is_empty() {
                    return Err(format!(
                        "{} returns no row: with --event-type, the last statement returns \
                         the event's row (INSERT … RETURNING …, or a SELECT)",
                        script.what(i)
                    ));
                }
            }
            Ok(())
        }

        async fn run_script(
            &mut self,
            script: &SqlScript,
            params: SqlParams<'_>,
        ) -> Result<Vec<String>, HandlerError> {
            let last = script.statements.len() - 1;
            for (i, s) in script.statements.iter().enumerate() {
                if i == last && script.event_type.is_some() {
                    let rows = query(s.clone(), params)
                        .fetch_all(self.conn())
                        .await
                        .map_err(|e| error(e, &script.what(i)))?;
                    return rows
                        .iter()
                        .map(row_json)
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| error(e, &script.what(i)));
                }
                query(s.clone(), params)
                    .execute(self.conn())
                    .await
                    .map_err(|e| error(e, &script.what(i)))?;
            }
            Ok(Vec::new())
        }

        async fn enqueue_events(&mut self, events: &[OutboxEvent]) -> Result<(), StoreError> {
            self.enqueue_many(events).await
        }
    }
}

/// Through the front filter: the statements run in the durable store's transaction.
#[async_trait]
impl<T, F> SqlTx for idem_engine::FilteredTx<T, F>
where
    T: SqlTx,
    F: idem_engine::DoneFilter + 'static,
{
    async fn prepare_script(&mut self, script: &SqlScript) -> Result<(), String> {
        self.inner_mut().prepare_script(script).await
    }

    async fn run_script(
        &mut self,
        script: &SqlScript,
        params: SqlParams<'_>,
    ) -> Result<Vec<String>, HandlerError> {
        self.inner_mut().run_script(script, params).await
    }

    async fn enqueue_events(&mut self, events: &[OutboxEvent]) -> Result<(), StoreError> {
        self.inner_mut().enqueue_events(events).await
    }
}

/// The in-memory store has no SQL: `idem consume` refuses `--handler sql:` with
/// `memory://` before it opens anything; this answers a configuration error otherwise.
#[async_trait]
impl SqlTx for idem_sim::MemoryTx {
    async fn prepare_script(&mut self, _script: &SqlScript) -> Result<(), String> {
        Err("memory:// has no SQL: --handler sql: needs a postgres:// or sqlite:// store".into())
    }

    async fn run_script(
        &mut self,
        _script: &SqlScript,
        _params: SqlParams<'_>,
    ) -> Result<Vec<String>, HandlerError> {
        Err(HandlerError::Store(StoreError::Config(
            "memory:// has no SQL: --handler sql: needs a postgres:// or sqlite:// store".into(),
        )))
    }

    async fn enqueue_events(&mut self, events: &[OutboxEvent]) -> Result<(), StoreError> {
        for e in events {
            self.enqueue(e).await?;
        }
        Ok(())
    }
}

/// What the SQL handler keeps of a message between `identify` and `handle`.
#[derive(Debug, Clone)]
pub(crate) struct SqlMessage {
    /// The body: JSON text.
    payload: String,
    /// The headers as a JSON object.
    headers: String,
    /// The identity's second part (the claim records it with the subject).
    second: String,
}

/// The SQL handler: the statements of a [`SqlScript`], with the key derived by an
/// [`IdentitySpec`].
#[derive(Debug, Clone)]
pub(crate) struct SqlHandler {
    script: Arc<SqlScript>,
    identity: IdentitySpec,
    derivation: KeyDerivation,
    max_body: usize,
}

impl SqlHandler {
    /// A handler running `script`, identifying messages by `identity`, with keys derived
    /// as `derivation` says (the body's bytes, or its canonical JSON form).
    pub(crate) fn new(
        script: SqlScript,
        identity: IdentitySpec,
        derivation: KeyDerivation,
    ) -> Self {
        Self {
            script: Arc::new(script),
            identity,
            derivation,
            max_body: idem_grant::DEFAULT_MAX_BODY,
        }
    }

    /// The statements.
    pub(crate) fn script(&self) -> &SqlScript {
        &self.script
    }

    /// Runs the statements for `sub`; its outbox event, if it has one.
    async fn run<T: SqlTx>(
        &self,
        tx: &mut T,
        sub: &Submission<SqlMessage>,
    ) -> Result<Option<OutboxEvent>, HandlerError> {
        let key = sub.key.to_hex();
        let params = SqlParams {
            payload: &sub.input.payload,
            key: &key,
            subject: &sub.subject,
            headers: &sub.input.headers,
        };
        let rows = tx.run_script(&self.script, params).await?;
        self.event(sub, rows)
    }

    /// The outbox event of one message, from the rows its last statement returned.
    fn event(
        &self,
        sub: &Submission<SqlMessage>,
        rows: Vec<String>,
    ) -> Result<Option<OutboxEvent>, HandlerError> {
        let Some(event_type) = &self.script.event_type else {
            return Ok(None);
        };
        let mut rows = rows.into_iter();
        match (rows.next(), rows.len()) {
            (None, _) => Ok(None),
            (Some(row), 0) => Ok(Some(OutboxEvent::new(
                sub.key,
                event_type.as_str(),
                sub.subject.as_str(),
                row,
            ))),
            (Some(_), more) => Err(HandlerError::Reject(RejectReason::new(
                "sql_rows",
                format!(
                    "the last statement of {} returned {} rows: --event-type writes one \
                     event per message",
                    self.script.name,
                    more + 1
                ),
            ))),
        }
    }
}

/// The headers as a JSON object (the first of a repeated name).
fn headers_json(headers: &Headers) -> String {
    let mut object = serde_json::Map::new();
    for (k, v) in headers {
        object
            .entry(k.clone())
            .or_insert_with(|| serde_json::Value::String(v.clone()));
    }
    serde_json::Value::Object(object).to_string()
}

#[async_trait]
impl<T: SqlTx> Handler<T> for SqlHandler {
    type Input = SqlMessage;

    /// The body must be JSON (it is bound as `jsonb`); the key is `--identity`'s.
    fn identify(
        &self,
        payload: &[u8],
        headers: &Headers,
    ) -> Result<Submission<SqlMessage>, RejectReason> {
        let (text, value) = idem_grant::json_body(payload, self.max_body)?;
        let canonical;
        let hashed = match self.derivation {
            KeyDerivation::Reference => payload,
            KeyDerivation::CanonicalJson => {
                canonical = idem_grant::canonical_json(text).ok_or_else(|| {
                    RejectReason::new("not_json", "the body has no RFC 8785 canonical form")
                })?;
                canonical.as_bytes()
            }
        };
        let id = self.identity.identify(hashed, Some(&value), headers)?;
        Ok(Submission {
            key: id.key,
            subject: id.subject,
            input: SqlMessage {
                payload: text.to_owned(),
                headers: headers_json(headers),
                second: id.second,
            },
        })
    }

    /// The subject and the second part are the message's identity: another body under
    /// the same identity is a conflicting resubmission (`--on-conflict`).
    fn claim_meta(&self, sub: &Submission<SqlMessage>) -> ClaimMeta {
        ClaimMeta::new(sub.subject.clone()).with_submission_timestamp(sub.input.second.clone())
    }

    async fn handle(&self, tx: &mut T, sub: &Submission<SqlMessage>) -> Result<(), HandlerError> {
        if let Some(event) = self.run(tx, sub).await? {
            tx.enqueue(&event).await?;
        }
        Ok(())
    }

    /// The statements of each message in turn, then every event in one go.
    async fn handle_batch(
        &self,
        tx: &mut T,
        subs: &[&Submission<SqlMessage>],
    ) -> Result<(), HandlerError> {
        let mut events = Vec::with_capacity(subs.len());
        for sub in subs {
            events.extend(self.run(tx, sub).await?);
        }
        if !events.is_empty() {
            tx.enqueue_events(&events).await?;
        }
        Ok(())
    }
}

/// Splits SQL text into statements at each `;` outside quotes (`'…'`, `"…"`), comments
/// (`-- …`, `/* … */`) and dollar-quoted bodies (`$tag$…$tag$`); statements holding only
/// whitespace and comments are dropped.
fn split_statements(text: &str) -> Result<Vec<String>, String> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let (mut start, mut i, mut content) = (0, 0, false);
    let push = |from: usize, to: usize, content: bool, out: &mut Vec<String>| {
        if content {
            out.push(text[from..to].trim().to_owned());
        }
    };
    while i < bytes.len() {
        match bytes[i] {
            b'\'' | b'"' => {
                let quote = bytes[i];
                i += 1;
                loop {
                    match bytes.get(i) {
                        None => return Err("a quote is never closed".into()),
                        Some(&c) if c == quote && bytes.get(i + 1) == Some(&quote) => i += 2,
                        Some(&c) if c == quote => break,
                        Some(_) => i += 1,
                    }
                }
                i += 1;
                content = true;
            }
            b'-' if bytes.get(i + 1) == Some(&b'-') => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                let end = text[i + 2..]
                    .find("*/")
                    .ok_or_else(|| "a /* comment is never closed".to_owned())?;
                i += 2 + end + 2;
            }
            b'$' => {
                // `$tag$` or `$$` opens a dollar-quoted body; `$1` is a parameter.
                let tag_end = text[i + 1..]
                    .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .map(|n| i + 1 + n);
                match tag_end {
                    Some(e)
                        if bytes[e] == b'$'
                            && !bytes.get(i + 1).is_some_and(|c| c.is_ascii_digit()) =>
                    {
                        let tag = &text[i..=e];
                        let body = e + 1;
                        let close = text[body..]
                            .find(tag)
                            .ok_or_else(|| format!("a {tag} body is never closed"))?;
                        i = body + close + tag.len();
                    }
                    _ => i += 1,
                }
                content = true;
            }
            b';' => {
                push(start, i, content, &mut out);
                i += 1;
                start = i;
                content = false;
            }
            c => {
                if !c.is_ascii_whitespace() {
                    content = true;
                }
                i += 1;
            }
        }
    }
    push(start, bytes.len(), content, &mut out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_split_at_semicolons_outside_quotes_and_comments() {
        let text = "INSERT INTO t VALUES ('a;b', \"c;d\"); -- one; two\n\
                    /* three; */ UPDATE t SET x = $$;$$ WHERE y = $1;\n\
                    DO $f$ BEGIN PERFORM 1; END $f$;\n  -- only a comment;\n ; \n\
                    SELECT 'it''s;' ";
        let got = split_statements(text).expect("split");
        assert_eq!(
            got,
            [
                "INSERT INTO t VALUES ('a;b', \"c;d\")",
                "-- one; two\n/* three; */ UPDATE t SET x = $$;$$ WHERE y = $1",
                "DO $f$ BEGIN PERFORM 1; END $f$",
                "SELECT 'it''s;'",
            ]
        );
        assert!(split_statements("SELECT 'open").is_err());
        assert!(split_statements("/* open").is_err());
        assert_eq!(split_statements("-- nothing\n;;").expect("split").len(), 0);
    }

    #[test]
    fn scripts_refuse_what_cannot_run_in_the_claims_transaction() {
        assert!(SqlScript::parse("f.sql", "-- nothing", None).is_err());
        let e = SqlScript::parse("f.sql", "INSERT INTO t VALUES (1); COMMIT", None).unwrap_err();
        assert!(e.contains("statement 2 of f.sql is COMMIT"), "{e}");
        assert!(SqlScript::parse("f.sql", "SELECT 1", Some(String::new())).is_err());
        let s = SqlScript::parse(
            "f.sql",
            "INSERT INTO t VALUES ($2) RETURNING *;",
            Some("e".into()),
        )
        .expect("parsed");
        assert_eq!(s.statements.len(), 1);
        assert!(s.pg_rows.as_ref().is_some_and(|r| r
            .as_str()
            .contains("(\nINSERT INTO t VALUES ($2) RETURNING *\n)")));
    }

    #[test]
    fn headers_become_one_object_and_the_first_of_a_name_wins() {
        let h: Headers = vec![
            ("a".into(), "1".into()),
            ("b".into(), "x\"y".into()),
            ("a".into(), "2".into()),
        ];
        assert_eq!(headers_json(&h), r#"{"a":"1","b":"x\"y"}"#);
    }

    /// The crash suites' handler: `script` per order, identified by its id and creation
    /// time, keyed as the reference does.
    fn orders_handler(script: &str) -> Result<SqlHandler, Box<dyn std::error::Error>> {
        let script = SqlScript::parse("orders.sql", script, Some("order.recorded".into()))?;
        let identity: IdentitySpec = "/order_id,/created_at".parse()?;
        Ok(SqlHandler::new(script, identity, KeyDerivation::Reference))
    }

    /// The `orders` rows `(key, order id, amount)` a crash suite read, as its effects.
    fn order_effects(
        rows: Vec<(String, String, i64)>,
    ) -> Result<Vec<idem_sim::Effect>, Box<dyn std::error::Error>> {
        rows.into_iter()
            .map(|(key, subject, amount)| {
                Ok(idem_sim::Effect {
                    key: key.parse()?,
                    subject,
                    amount,
                })
            })
            .collect()
    }

    /// The crash suite's messages: eight orders, every other one sent twice, one whose
    /// amount the table refuses, one without an identity.
    fn crash_orders() -> Vec<idem_sim::sim::Message> {
        use idem_sim::sim::Message;
        let order = |id: &str, amount: &str| {
            format!(
                r#"{{"order_id":"{id}","created_at":"2026-07-01T09:00:00Z","amount":{amount}}}"#
            )
            .into_bytes()
        };
        let mut messages = Vec::new();
        for i in 0..8_i64 {
            let amount = 1_000 + i;
            let body = order(&format!("O-{i}"), &amount.to_string());
            messages.push(Message::effect(body.clone(), amount));
            if i % 2 == 0 {
                messages.push(Message::effect(body, amount));
            }
        }
        messages.push(Message::dead_letter(order("O-bad", r#""twelve""#)));
        messages.push(Message::dead_letter(br#"{"amount":1}"#.to_vec()));
        messages
    }

    /// The test kit's crash-at-every-step suite on the SQL handler, on SQLite (a fresh
    /// file per schedule): orders sent twice, an amount a `STRICT` table refuses and a
    /// body without an identity, under a crash at every step, injected errors,
    /// redeliveries and expired leases, one at a time and in concurrent batches. Each
    /// schedule must leave one `orders` row per order (its amount, its key) and
    /// dead-letter the two others.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_crash_suite_leaves_one_order_each_on_sqlite() {
        use idem_sim::sim::crash_suite;
        use idem_store_sqlite::{SqliteConfig, SqliteStore};
        type Error = Box<dyn std::error::Error>;
        const SCRIPT: &str = "INSERT INTO orders (order_id, amount, idempotency_key) \
            VALUES (json_extract($1, '$.order_id'), json_extract($1, '$.amount'), $2) \
            RETURNING order_id, amount";
        let messages = crash_orders();
        let dir = tempfile::tempdir().expect("tempdir");
        let mut n = 0;
        let fresh = || {
            n += 1;
            let path = dir.path().join(format!("orders-{n}.db"));
            async move {
                let path = path.to_str().ok_or("a non UTF-8 path")?.to_owned();
                let store = SqliteStore::connect(&path, SqliteConfig::default()).await?;
                store.migrate().await?;
                sqlx::raw_sql(
                    "CREATE TABLE orders (order_id TEXT PRIMARY KEY, amount INTEGER NOT NULL, \
                     idempotency_key TEXT NOT NULL) STRICT",
                )
                .execute(store.pool())
                .await?;
                Ok::<_, Error>((store, orders_handler(SCRIPT)?))
            }
        };
        let read = |store: SqliteStore| async move {
            let rows: Vec<(String, String, i64)> =
                sqlx::query_as("SELECT idempotency_key, order_id, amount FROM orders")
                    .fetch_all(store.pool())
                    .await?;
            store.pool().close().await;
            order_effects(rows)
        };
        let report = crash_suite(&messages, fresh, read)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(report.schedules > 0, "{report:?}");
    }

    /// The same suite on Postgres, a schema of its own per schedule (dropped after): the
    /// amount a `bigint` cast refuses (SQLSTATE 22P02) is dead-lettered.
    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_crash_suite_leaves_one_order_each_on_postgres() {
        use idem_sim::sim::crash_suite;
        use idem_store_postgres::{PgConfig, PgStore};
        type Error = Box<dyn std::error::Error>;
        let url = std::env::var("IDEM_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        let messages = crash_orders();
        let fresh = || {
            let url = url.clone();
            async move {
                let schema = format!("sqlcrash_{:08x}", rand::random::<u32>());
                let config = PgConfig::new(schema.clone())?.with_max_connections(4);
                let store = PgStore::connect(&url, config).await?;
                store.migrate().await?;
                // The test's own generated name.
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "CREATE TABLE \"{schema}\".orders (order_id text PRIMARY KEY, \
                     amount bigint NOT NULL, idempotency_key text NOT NULL)"
                )))
                .execute(store.pool())
                .await?;
                let text = format!(
                    "INSERT INTO \"{schema}\".orders (order_id, amount, idempotency_key) \
                     VALUES ($1->>'order_id', ($1->>'amount')::bigint, $2) \
                     RETURNING order_id, amount"
                );
                Ok::<_, Error>((store, orders_handler(&text)?))
            }
        };
        let read = |store: PgStore| async move {
            let schema = store.schema_ident().to_string();
            let rows: Vec<(String, String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT idempotency_key, order_id, amount FROM {schema}.orders"
            )))
            .fetch_all(store.pool())
            .await?;
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "DROP SCHEMA IF EXISTS {schema} CASCADE"
            )))
            .execute(store.pool())
            .await?;
            store.pool().close().await;
            order_effects(rows)
        };
        let report = crash_suite(&messages, fresh, read)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(report.schedules > 0, "{report:?}");
    }
}
