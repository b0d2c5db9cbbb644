//! What a store provides so the conformance suite and the property tests can run on it.

use async_trait::async_trait;
use idem_engine::{
    ClaimMeta, ClaimStore, Handler, HandlerError, Headers, IdempotencyKey, OutboxEvent,
    RejectReason, StoreError, Submission,
};

use crate::memory::{MemoryStore, MemoryTx, Row};

/// One committed business effect: the row whose count proves exactly-once.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Effect {
    /// The submission's key.
    pub key: IdempotencyKey,
    /// The submission's subject.
    pub subject: String,
    /// The amount written.
    pub amount: i64,
}

/// A store under test: a [`ClaimStore`] plus the few store-specific operations the
/// suite needs (a business write, an outbox write, reading back what was committed).
///
/// Each test gets a fresh, isolated instance (its own schema, database file or key
/// prefix), so tests run in parallel.
#[async_trait]
pub trait TestStore: ClaimStore + Clone + 'static {
    /// Writes one effect row through `tx` (in the claim's transaction where the store
    /// can).
    async fn write_effect(
        tx: &mut Self::Tx,
        key: &IdempotencyKey,
        subject: &str,
        amount: i64,
    ) -> Result<(), StoreError>;

    /// Writes an outbox event through `tx`.
    async fn enqueue(tx: &mut Self::Tx, event: &OutboxEvent) -> Result<(), StoreError>;

    /// Performs an outbox insert that the store itself refuses (for example a payload
    /// that violates the outbox table's constraints). Must return `Err`.
    async fn enqueue_refused(tx: &mut Self::Tx, key: &IdempotencyKey) -> Result<(), StoreError>;

    /// Every committed effect.
    async fn effects(&self) -> Result<Vec<Effect>, StoreError>;

    /// How many committed claims `key` has (0 or 1).
    async fn claim_count(&self, key: &IdempotencyKey) -> Result<u64, StoreError>;
}

const EFFECTS: &str = "effects";

#[async_trait]
impl TestStore for MemoryStore {
    async fn write_effect(
        tx: &mut MemoryTx,
        key: &IdempotencyKey,
        subject: &str,
        amount: i64,
    ) -> Result<(), StoreError> {
        let mut row = Row::new();
        row.insert("key".into(), key.to_hex());
        row.insert("subject".into(), subject.to_owned());
        row.insert("amount".into(), amount.to_string());
        tx.insert(EFFECTS, row);
        Ok(())
    }

    async fn enqueue(tx: &mut MemoryTx, event: &OutboxEvent) -> Result<(), StoreError> {
        idem_engine::OutboxWriter::enqueue(tx, event).await
    }

    async fn enqueue_refused(tx: &mut MemoryTx, _key: &IdempotencyKey) -> Result<(), StoreError> {
        let _ = tx;
        Err(StoreError::Rejected {
            message: "outbox payload refused".into(),
            source: None,
        })
    }

    async fn effects(&self) -> Result<Vec<Effect>, StoreError> {
        Ok(self
            .rows(EFFECTS)
            .into_iter()
            .filter_map(|r| {
                Some(Effect {
                    key: r.get("key")?.parse().ok()?,
                    subject: r.get("subject")?.clone(),
                    amount: r.get("amount")?.parse().ok()?,
                })
            })
            .collect())
    }

    async fn claim_count(&self, key: &IdempotencyKey) -> Result<u64, StoreError> {
        Ok(u64::from(self.claim_record(key).is_some()))
    }
}

/// A test submission's wire form: `subject|timestamp|amount[|anything]`, or `poison…`
/// for input the handler rejects.
pub fn encode_submission(subject: &str, timestamp: &str, amount: i64) -> Vec<u8> {
    format!("{subject}|{timestamp}|{amount}").into_bytes()
}

/// The input of [`EffectHandler`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EffectInput {
    /// The amount to write.
    pub amount: i64,
    /// Whether to make the outbox insert fail (the store refuses it).
    pub refuse_outbox: bool,
    /// The submission timestamp, as written (passed to the claim as
    /// [`ClaimMeta::submission_timestamp`](idem_engine::ClaimMeta)).
    pub timestamp: String,
}

/// A handler for any [`TestStore`]: writes one effect row and one outbox event per
/// submission. Payloads are `subject|timestamp|amount` (see [`encode_submission`]);
/// anything else is rejected. A payload with a fourth field `refuse-outbox` makes the
/// outbox insert fail.
#[derive(Debug, Clone, Copy, Default)]
pub struct EffectHandler;

impl EffectHandler {
    /// Parses a test payload.
    pub fn parse(payload: &[u8]) -> Result<Submission<EffectInput>, RejectReason> {
        let text = std::str::from_utf8(payload)
            .map_err(|_| RejectReason::new("not_utf8", "payload is not UTF-8"))?;
        let parts: Vec<&str> = text.split('|').collect();
        if parts.len() < 3 {
            return Err(RejectReason::new(
                "malformed",
                "expected subject|timestamp|amount",
            ));
        }
        let amount: i64 = parts[2]
            .parse()
            .map_err(|_| RejectReason::new("bad_amount", "amount is not an integer"))?;
        if amount < 0 {
            return Err(RejectReason::new("bad_amount", "amount is negative"));
        }
        let key = IdempotencyKey::derive(parts[0], parts[1], payload)?;
        Ok(Submission {
            key,
            subject: parts[0].to_owned(),
            input: EffectInput {
                amount,
                refuse_outbox: parts.get(3) == Some(&"refuse-outbox"),
                timestamp: parts[1].to_owned(),
            },
        })
    }
}

#[async_trait]
impl<S: TestStore> Handler<S::Tx> for EffectHandlerFor<S> {
    type Input = EffectInput;

    fn identify(
        &self,
        payload: &[u8],
        _headers: &Headers,
    ) -> Result<Submission<EffectInput>, RejectReason> {
        EffectHandler::parse(payload)
    }

    fn claim_meta(&self, sub: &Submission<EffectInput>) -> ClaimMeta {
        ClaimMeta::new(sub.subject.clone()).with_submission_timestamp(sub.input.timestamp.clone())
    }

    async fn handle(
        &self,
        tx: &mut S::Tx,
        sub: &Submission<EffectInput>,
    ) -> Result<(), HandlerError> {
        S::write_effect(tx, &sub.key, &sub.subject, sub.input.amount).await?;
        if sub.input.refuse_outbox {
            S::enqueue_refused(tx, &sub.key).await?;
        } else {
            let ev = OutboxEvent::new(
                sub.key,
                "effect.recorded",
                sub.subject.clone(),
                effect_event_body(&sub.subject),
            );
            S::enqueue(tx, &ev).await?;
        }
        Ok(())
    }
}

/// The body of the event [`EffectHandler`] writes: `{"subject": …}`, JSON whatever the
/// subject holds (quotes, backslashes, non-ASCII).
pub fn effect_event_body(subject: &str) -> String {
    serde_json::json!({ "subject": subject }).to_string()
}

/// [`EffectHandler`] bound to one store type (the handler trait is generic over the
/// transaction type).
#[derive(Debug)]
pub struct EffectHandlerFor<S>(std::marker::PhantomData<fn() -> S>);

impl<S> EffectHandlerFor<S> {
    /// The handler.
    pub fn new() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<S> Default for EffectHandlerFor<S> {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> Clone for EffectHandlerFor<S> {
    fn clone(&self) -> Self {
        Self::new()
    }
}

#[async_trait]
impl<S, F> TestStore for idem_engine::Filtered<S, F>
where
    S: TestStore,
    F: idem_engine::DoneFilter + 'static,
{
    async fn write_effect(
        tx: &mut Self::Tx,
        key: &IdempotencyKey,
        subject: &str,
        amount: i64,
    ) -> Result<(), StoreError> {
        S::write_effect(tx.inner_mut(), key, subject, amount).await
    }

    async fn enqueue(tx: &mut Self::Tx, event: &OutboxEvent) -> Result<(), StoreError> {
        S::enqueue(tx.inner_mut(), event).await
    }

    async fn enqueue_refused(tx: &mut Self::Tx, key: &IdempotencyKey) -> Result<(), StoreError> {
        S::enqueue_refused(tx.inner_mut(), key).await
    }

    async fn effects(&self) -> Result<Vec<Effect>, StoreError> {
        self.inner().effects().await
    }

    async fn claim_count(&self, key: &IdempotencyKey) -> Result<u64, StoreError> {
        self.inner().claim_count(key).await
    }
}

#[cfg(test)]
mod tests {
    use super::effect_event_body;

    #[test]
    fn event_bodies_are_json_for_any_subject() {
        for subject in ["A-1", "say \"hi\"", "back\\slash", "Zoë 名", "tab\there\n"] {
            let body = effect_event_body(subject);
            let v: serde_json::Value = serde_json::from_str(&body).expect(&body);
            assert_eq!(v["subject"], subject, "{body}");
        }
    }
}
