//! lockcell's load test: the same scenarios driven against lockcell, bare etcd and
//! etcd's grpc-proxy, measured from sources that cannot be fooled (etcd's own
//! `/metrics`, `/proc`), and reported side by side.
#![forbid(unsafe_code)]

// Pure arithmetic and reporting.
pub mod expiry;
pub mod membership;
pub mod pacing;
pub mod plot;
pub mod procstat;
pub mod prom;
pub mod report;
pub mod stats;
