//! The lockcell Rust SDK: sessions, locks, leader elections, small keys, watches and
//! group membership, served by a zone proxy.
//!
//! A [`Client`] knows the proxies in order of preference ([`ClientOptions`]; its own
//! zone's first) and holds one connection to the one in use and one keep-alive stream
//! that renews every [`Session`] opened through it. When that proxy dies, stops
//! answering, loses etcd or drains, the client resumes every session on another one:
//! locks, leaderships and ephemeral keys move with their tokens unchanged (what was lost
//! meanwhile is reported on its guard and in [`Session::events`]). Locks ([exclusive](Session::acquire) or
//! [shared](Session::acquire_shared)) are acquired through a session and held by a
//! [`LockGuard`], which carries the grant's [`FencingToken`]. Leadership of an election
//! is won the same way ([`Session::campaign`]) and held by a [`Leadership`]; anyone can
//! ask who leads ([`Client::leader`]) or follow the changes ([`Client::observe`]).
//!
//! Small keys (configuration) are read and written through the client
//! ([`Client::get`], [`Client::put`]) and followed with a [`Watcher`]
//! ([`Client::watch`]), which resumes across a restarted proxy or a broken connection
//! with no event missed or repeated. Membership builds on them: a process
//! [announces](Session::announce) itself in a group for as long as its session lives, and
//! anyone can list the group and follow who joins and leaves ([`Client::members`]).
//!
//! # The one rule
//!
//! Every grant says how long it is valid, counted from when the request was *sent*. The
//! session's [`deadline`](Session::deadline) is the latest of those (renewals, lock
//! grants and election wins alike); past it the session is in
//! [jeopardy](SessionState::Jeopardy) and the proxy may hand its locks and leaderships
//! to someone else at any moment, so the application must stop acting as holder or
//! leader. Race work done under a lock against [`LockGuard::revoked`] (or hand worker
//! tasks its [`cancellation`](LockGuard::cancellation) token), and pass the token to
//! every resource. Acquires and campaigns are cancel-safe, and
//! [`Client::shutdown`] lets go of everything before the program ends.
//!
//! ```no_run
//! # async fn example() -> Result<(), lockcell_client::Error> {
//! use lockcell_client::{Client, SessionOptions, Wait};
//!
//! let client = Client::connect("127.0.0.1:7420").await?;
//! let session = client.open_session(SessionOptions::default()).await?;
//! if let Some(guard) = session.acquire("billing/nightly-run", Wait::Forever).await? {
//!     tokio::select! {
//!         _ = do_the_work(guard.token()) => {}
//!         revoked = guard.revoked() => eprintln!("stopping: {revoked}"),
//!     }
//! }
//! client.shutdown().await?;
//! # Ok(()) }
//! # async fn do_the_work(_token: lockcell_client::FencingToken) {}
//! ```
#![forbid(unsafe_code)]

mod client;
mod deadline;
mod election;
mod env;
mod error;
mod holdings;
mod keepalive;
mod kv;
mod lead;
mod lock;
mod members;
mod proxies;
mod renewals;
mod revoked;
mod session;
mod shared;
mod stream;
mod validity;
mod watch;
mod withdraw;

pub use client::{Client, ClientOptions};
pub use election::{LeaderInfo, LeaderStream, Leadership};
pub use env::{ConnectSettings, DEFAULT_PROXY};
pub use error::{Error, ErrorKind, StatusCode};
pub use holdings::{Held, SessionEvent, SessionEvents};
pub use kv::{CellRevision, Condition, Entry, Snapshot, Txn, TxnOutcome, Written};
pub use lead::Term;
pub use lock::{LockGuard, LockHolder, LockState, LockWaiter, Mode, Sequencer, Wait};
pub use lockcell_proto::FencingToken;
pub use members::{MemberCache, MemberChange, Members};
pub use proxies::ClientTls;
pub use revoked::Revoked;
pub use session::{Session, SessionOptions};
pub use validity::SessionState;
pub use watch::{EventKind, WatchBatch, WatchEvent, WatchOptions, Watcher};
