//! lockcell's test harness: real etcd clusters and real proxy processes on loopback,
//! each stopped when its handle drops (also when a test panics).
//!
//! Used by the end-to-end tests in `tests/e2e` and by the `lockcell-dev` local cell.
#![forbid(unsafe_code)]

pub mod audit;
pub mod bins;
pub mod certs;
pub mod chaos;
pub mod checker;
pub mod clickhouse;
pub mod client_suites;
pub mod etcd;
pub mod fenced;
pub mod fenced_server;
pub mod image;
pub mod kvcheck;
pub mod ports;
pub mod process;
pub mod proxy;
pub mod relay;
pub mod s3;
pub mod wait;

pub use etcd::EtcdCluster;
pub use fenced::FencedResource;
pub use proxy::{ProxyOptions, ProxyProcess};
pub use relay::Relay;
pub use wait::eventually;
