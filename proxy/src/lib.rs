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
//!   [`mirror`] (the copy of the small keys), [`limits`], [`kvbudget`], [`space`].
//! - The runtime that carries decisions out against etcd: [`acquire`], [`handover`],
//!   [`lease_keeper`], [`reaper`], [`cleanup`], [`events`], [`feed`] and [`fanout`]
//!   (the cell watch and its watchers), [`reads`], [`catchup`].
//! - The lockcell API's services, one per proto service: [`service`]; errors become
//!   statuses in [`errors`].
#![forbid(unsafe_code)]

pub mod access;
pub mod acquire;
pub mod admin;
pub mod barrier;
pub mod catchup;
pub mod cell_part;
pub mod cellguard;
pub mod check;
pub mod classes;
pub mod cleanup;
pub mod config;
pub mod core;
pub mod credential;
pub mod declared;
pub mod errors;
pub mod etcd_api;
pub mod events;
pub mod fanout;
pub mod feed;
pub mod front;
pub mod handover;
pub mod kvbudget;
pub mod lease_keeper;
pub mod leases;
pub mod limits;
mod listen;
pub mod members;
pub mod memory;
pub mod metrics;
pub mod mirror;
pub mod pause;
mod process;
pub mod queues;
pub mod reads;
pub mod reaper;
pub mod routes;
pub mod service;
pub mod sessions;
pub mod settings;
pub mod space;
pub mod state;
pub mod sweep;
pub mod tls;
pub mod unsettled;
pub mod wire;

pub use config::ProxyConfig;
pub use process::{install_metrics, run, Stopped};
