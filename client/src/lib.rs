//! The lockcell Rust SDK: sessions and exclusive locks served by a zone proxy.
//!
//! A [`Client`] holds one connection to a proxy and one keep-alive stream that renews
//! every [`Session`] opened through it. Locks are acquired through a session and held by
//! a [`LockGuard`], which carries the grant's [`FencingToken`].
//!
//! # The one rule
//!
//! Every grant says how long it is valid, counted from when the request was *sent*. The
//! session's [`deadline`](Session::deadline) is the latest of those; past it the session
//! is in [jeopardy](SessionState::Jeopardy) and the proxy may hand its locks to someone
//! else at any moment, so the application must stop acting as holder. Race work done
//! under a lock against [`Session::jeopardy`], and pass the token to every resource.
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
//!         _ = session.jeopardy() => eprintln!("lost the right to act; stopping"),
//!     }
//!     guard.release().await?;
//! }
//! session.close().await?;
//! # Ok(()) }
//! # async fn do_the_work(_token: lockcell_client::FencingToken) {}
//! ```
#![forbid(unsafe_code)]

mod client;
mod error;
mod keepalive;
mod lock;
mod renewals;
mod session;
mod shared;
mod validity;

pub use client::Client;
pub use error::Error;
pub use lock::{LockGuard, Wait};
pub use lockcell_proto::FencingToken;
pub use session::{Session, SessionOptions};
pub use validity::SessionState;
