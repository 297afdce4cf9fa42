//! The `lockcell.v1` wire protocol shared by the proxy, the SDK and the tests, the
//! fencing token type that every grant carries, and the one timing fact both sides
//! must notice alike: that the machine was suspended ([`suspend`]).
//!
//! The messages are generated from `proto/lockcell/v1/lockcell.proto`; read that file, or
//! `docs/api.md` rendered from its comments by [`api_doc`], for the meaning of each field.
#![forbid(unsafe_code)]

pub mod api_doc;
pub mod suspend;
pub mod token;

pub use token::{FencingToken, TokenParseError};

/// Generated messages and services of package `lockcell.v1`.
pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("lockcell.v1");
}

/// The part of etcd's `etcdserverpb` package the proxies serve themselves
/// (`proto/etcd/auth.proto`): Authenticate, and the rest of Auth refused by name.
pub mod etcd_auth {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("etcdserverpb");
}

/// etcd's `v3lockpb` Lock service as the proxies serve it (`proto/etcd/lock.proto`).
pub mod etcd_lock {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("v3lockpb");
}

/// etcd's `v3electionpb` Election service as the proxies serve it
/// (`proto/etcd/election.proto`).
pub mod etcd_election {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("v3electionpb");
}

/// The protoc descriptor set of `lockcell.v1` with its source info, so the comments of the
/// `.proto` reach `api_doc` (and anything else that wants the schema at run time).
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/lockcell_descriptor_set.bin"));

/// etcd's v3 API as etcd declares it (`proto/etcd-v3`), with the HTTP paths of its JSON
/// gateway, for the proxy's etcd listener to answer that gateway.
pub const ETCD_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/etcd_descriptor_set.bin"));

impl From<FencingToken> for v1::FencingToken {
    fn from(t: FencingToken) -> Self {
        v1::FencingToken {
            epoch: t.epoch,
            revision: t.revision,
        }
    }
}

impl From<v1::FencingToken> for FencingToken {
    fn from(t: v1::FencingToken) -> Self {
        FencingToken {
            epoch: t.epoch,
            revision: t.revision,
        }
    }
}
