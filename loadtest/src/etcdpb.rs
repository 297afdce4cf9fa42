//! Generated client of the slice of etcd's Lease service in `proto/etcd_lease.proto`.
#![allow(clippy::all, missing_docs)]

tonic::include_proto!("etcdserverpb");
