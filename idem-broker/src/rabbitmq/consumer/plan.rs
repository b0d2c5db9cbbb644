//! Which frame, or hold, each settlement becomes: [`plan`].

use std::time::Duration;

use super::{DEAD_LETTER_RETRY, MAX_HOLD, MAX_UNACKED};

/// A frame that settles one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Frame {
    /// `basic.ack`: done, removed from the queue.
    Ack,
    /// `basic.reject` with `requeue = true`: a failed attempt. Every quorum queue counts
    /// it in `x-delivery-count` (3.x, and 4.x, where it is a `modify` with
    /// `delivery-failed`), so it counts towards the delivery limit.
    Reject,
    /// `basic.nack` with `requeue = true`: handed back, nobody's failure. RabbitMQ 4.3+
    /// counts no delivery for it; 3.x and 4.0–4.2 count every requeue.
    Nack,
}

/// How a delivery is settled, as the core (or a drop) asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Settle {
    /// [`Acker::ack`].
    Ack,
    /// [`Acker::nack`]: a failed attempt, to run again after the delay if any.
    Fail(Option<Duration>),
    /// [`Acker::defer`]: its key is held by another transaction; not the message's fault.
    Defer(Duration),
    /// [`Acker::dead_letter`], once the publish to `NAME.dead-letter` is confirmed or
    /// has failed.
    DeadLettered {
        /// The broker confirmed the dead letter.
        confirmed: bool,
    },
    /// The acker was dropped unsettled (its task cancelled).
    Dropped,
}

/// What the consumer can do for a delivery besides sending a frame at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Room {
    /// Fewer deliveries than the hold limit are held.
    pub(super) can_hold: bool,
    /// The consumer is open: a held delivery can come back through its stream.
    pub(super) open: bool,
    /// How long the delivery has been unacked here.
    pub(super) unacked_for: Duration,
}

/// The frames and holds a settlement is carried out with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Plan {
    /// The frame, at once.
    Send(Frame),
    /// Held unacked (its prefetch slot kept, no one else gets it) for the delay, then the
    /// frame; at once when the consumer closes.
    HoldThen(Duration, Frame),
    /// Held unacked for the delay, then handed back through the consumer's stream with
    /// the same attempt and headers: no frame, so the broker counts nothing. When the
    /// consumer closes first, [`Frame::Nack`].
    HoldThenHandBack(Duration),
}

/// The settlement plan: the one place that chooses frames.
///
/// - `Ack` → `basic.ack`.
/// - `Fail` → `basic.reject` (requeue) — after holding for the delay when there is one
///   and room to hold it.
/// - `Defer` → held and handed back through the stream, even past the hold limit (the
///   prefetch bounds what is held: deferrals that fill it stop the broker's sending);
///   `basic.nack` (requeue) only when the consumer is closing, or the delivery would stay
///   unacked past [`MAX_UNACKED`].
/// - `DeadLettered` → `basic.ack` once the dead letter is confirmed; otherwise held
///   [`DEAD_LETTER_RETRY`] and then `basic.reject` (a failed attempt: a dead-letter queue
///   that stays broken ends in the broker's own dead-lettering at the delivery limit).
/// - `Dropped` → `basic.nack` (requeue).
pub(super) fn plan(settle: Settle, room: Room) -> Plan {
    match settle {
        Settle::Ack | Settle::DeadLettered { confirmed: true } => Plan::Send(Frame::Ack),
        Settle::Fail(Some(delay)) if !delay.is_zero() && room.can_hold && room.open => {
            Plan::HoldThen(delay.min(MAX_HOLD), Frame::Reject)
        }
        Settle::Fail(_) => Plan::Send(Frame::Reject),
        // Whatever is held already: a deferral keeps its prefetch slot, so once deferrals
        // fill the prefetch the broker sends nothing more (fetching stops, memory stays
        // bounded by the prefetch) and no requeue is counted against a message.
        Settle::Defer(delay)
            if room.open && room.unacked_for.saturating_add(delay.min(MAX_HOLD)) <= MAX_UNACKED =>
        {
            Plan::HoldThenHandBack(delay.min(MAX_HOLD))
        }
        Settle::Defer(_) | Settle::Dropped => Plan::Send(Frame::Nack),
        Settle::DeadLettered { confirmed: false } if room.open => {
            Plan::HoldThen(DEAD_LETTER_RETRY, Frame::Reject)
        }
        Settle::DeadLettered { confirmed: false } => Plan::Send(Frame::Reject),
    }
}
