//! lockcell-proxy: the zone proxy. It holds client sessions in memory, answers their
//! keepalives itself, and attaches every key its clients create to one of K etcd leases
//! of its own (docs/design.md).
//!
//! # Layout
//!
//! - The process: [`process`] starts the proxy's part in each cell ([`cell_part`]),
//!   serves the lockcell API through [`front`] (which routes each call to the cell that
//!   serves its name) and etcd's own API ([`etcd_api`]), and drains and stops;
//!   [`listen`] holds what every client connection is bounded by.
//! - Decisions, with no I/O: [`core`] (a waiter's turns, a session's life and move).
//! - Bookkeeping, in memory: [`sessions`], [`leases`], [`classes`], [`queues`],
//!   [`calls`] (acquires under way, for their withdrawal), [`mirror`] (the copy of the
//!   small keys), [`limits`], [`kvbudget`], [`space`].
//! - The runtime that carries decisions out against etcd: [`acquire`], [`handover`],
//!   [`lease_keeper`], [`reaper`], [`cleanup`], [`events`], [`feed`] and [`fanout`]
//!   (the cell watch and its watchers), [`reads`], [`catchup`].
//! - The lockcell API's services, one per proto service: [`service`]; errors become
//!   statuses in [`errors`].
//! - Tests only: `testing`, a proxy's state over the in-memory store, for tests of the
//!   runtime with paused time and no etcd.
#![forbid(unsafe_code)]

mod access;
mod acquire;
pub mod admin;
mod barrier;
mod calls;
mod catchup;
mod cell_part;
mod cellguard;
pub mod check;
mod classes;
mod cleanup;
pub mod config;
mod core;
mod credential;
mod declared;
mod errors;
mod etcd_api;
mod events;
mod fanout;
mod feed;
mod front;
mod handover;
mod kvbudget;
mod lease_keeper;
mod leases;
mod limits;
mod listen;
mod members;
mod memory;
mod metrics;
mod mirror;
mod overhead;
mod pause;
mod process;
mod queues;
mod reads;
mod reaper;
mod routes;
mod service;
mod sessions;
pub mod settings;
mod space;
mod state;
mod sweep;
#[cfg(test)]
mod testing;
mod tls;
mod unsettled;
mod wire;

pub use config::ProxyConfig;
pub use process::{install_metrics, run, Stopped};
