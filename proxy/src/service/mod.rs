//! The lockcell.v1 gRPC services: one file per service.

pub mod election;
pub mod kv;
pub mod lock;
pub mod session;
pub mod watch;

pub(crate) use crate::wire::millis;
