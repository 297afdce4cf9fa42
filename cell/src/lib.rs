//! The authoritative side of lockcell: how the cell's state is laid out in etcd and the
//! transactions that change it.
//!
//! Only etcd answers "who holds what". This crate is the one place that knows the key
//! space ([`keyspace`]), the epoch record ([`epoch`]), the shard map that routes names
//! to cells ([`shardmap`]) and the lock log transactions
//! ([`locklog`]) that mint fencing tokens ([`FencingToken`], defined with the protocol),
//! and who may touch which part of the key space ([`rbac`]); proxies carry out its
//! decisions.
#![forbid(unsafe_code)]

pub mod access;
pub mod arbiter;
#[cfg(feature = "audit")]
pub mod audit;
pub mod epoch;
pub mod error;
pub mod etcd_tls;
pub mod forced;
pub mod grants;
pub mod keyspace;
pub mod kv;
pub mod locklog;
pub mod presence;
pub mod rbac;
pub mod shardmap;
pub mod timing;
pub mod tls;

pub use error::CellError;
pub use keyspace::{LockName, Mode, NameError};
pub use lockcell_proto::FencingToken;
