use super::plan::{plan, Frame, Plan, Room, Settle};
use super::*;

fn room() -> Room {
    Room {
        can_hold: true,
        open: true,
        unacked_for: Duration::ZERO,
    }
}

/// The frames each settlement is carried out with: a failure is a counted
/// `basic.reject`, a deferral is held and handed back without any frame, and
/// `basic.nack` (not counted by RabbitMQ 4.3+) is kept for requeues that are nobody's
/// failure.
#[test]
fn each_settlement_has_its_frames() {
    let s = Duration::from_secs;
    let full = Room {
        can_hold: false,
        ..room()
    };
    let closing = Room {
        open: false,
        ..room()
    };
    for (settle, room, want) in [
        (Settle::Ack, room(), Plan::Send(Frame::Ack)),
        (Settle::Fail(None), room(), Plan::Send(Frame::Reject)),
        (
            Settle::Fail(Some(Duration::ZERO)),
            room(),
            Plan::Send(Frame::Reject),
        ),
        (
            Settle::Fail(Some(s(3))),
            room(),
            Plan::HoldThen(s(3), Frame::Reject),
        ),
        (
            Settle::Fail(Some(s(600))),
            room(),
            Plan::HoldThen(MAX_HOLD, Frame::Reject),
        ),
        (Settle::Fail(Some(s(3))), full, Plan::Send(Frame::Reject)),
        (Settle::Fail(Some(s(3))), closing, Plan::Send(Frame::Reject)),
        (Settle::Defer(s(1)), room(), Plan::HoldThenHandBack(s(1))),
        (
            Settle::Defer(Duration::ZERO),
            room(),
            Plan::HoldThenHandBack(Duration::ZERO),
        ),
        (
            Settle::Defer(s(600)),
            room(),
            Plan::HoldThenHandBack(MAX_HOLD),
        ),
        // Deferrals that fill the prefetch stop the broker's sending; no requeue.
        (Settle::Defer(s(1)), full, Plan::HoldThenHandBack(s(1))),
        (Settle::Defer(s(1)), closing, Plan::Send(Frame::Nack)),
        (
            Settle::Defer(s(1)),
            Room {
                unacked_for: MAX_UNACKED,
                ..room()
            },
            Plan::Send(Frame::Nack),
        ),
        (
            Settle::Defer(s(1)),
            Room {
                unacked_for: MAX_UNACKED - s(1),
                ..room()
            },
            Plan::HoldThenHandBack(s(1)),
        ),
        (
            Settle::DeadLettered { confirmed: true },
            room(),
            Plan::Send(Frame::Ack),
        ),
        (
            Settle::DeadLettered { confirmed: false },
            room(),
            Plan::HoldThen(DEAD_LETTER_RETRY, Frame::Reject),
        ),
        // A dead letter that failed is held even at the hold limit: no hot loop.
        (
            Settle::DeadLettered { confirmed: false },
            full,
            Plan::HoldThen(DEAD_LETTER_RETRY, Frame::Reject),
        ),
        (
            Settle::DeadLettered { confirmed: false },
            closing,
            Plan::Send(Frame::Reject),
        ),
        (Settle::Dropped, room(), Plan::Send(Frame::Nack)),
    ] {
        assert_eq!(plan(settle, room), want, "{settle:?} with {room:?}");
    }
}
