//! The proxy's decisions as plain state machines (docs/design.md §5): no I/O, no clock,
//! no task. Each takes what happened as an event and answers with the step its driver
//! must take next; the driver does the I/O (etcd, the queue, the clock) and feeds the
//! result back. So every rule a decision follows can be tested by driving it with
//! events, without etcd and without sleeping.
//!
//! - [`waiter`]: an acquire waiting in the proxy's queue (arbitrated classes);
//! - [`fair`]: an acquire standing in line in etcd (fair classes);
//! - [`life`]: a session's life here: renewals, validity, expiry, an end, a hand-over;
//! - [`moving`]: a session's keys moving onto this proxy (Resume).

pub mod fair;
pub mod life;
pub mod moving;
pub mod waiter;

/// An error a decision was told of, as its driver judged it: one to ride out (etcd
/// slow or away for a moment: try again on the next turn) or one that ends the call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault<E> {
    Transient(E),
    Fatal(E),
}
