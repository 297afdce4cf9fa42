//! The proxy's own time on each call (`lockcell_proxy_overhead_seconds{call}`): from the
//! request reaching the service to its answer, less the time the call spent outside the
//! process, in its etcd round trips and its waits for a turn, a holder, the proxy's copy
//! of the cell or another proxy it was forwarded to ([`lockcell_cell::timing`]). What is left is what a proxy adds to a
//! call: decoding, checks, bookkeeping, scheduling on a busy runtime.
//!
//! Measured for the calls named in [`call_name`], each on the API that serves it, so a
//! client that sends unknown paths, or one API's paths to the other's listener, cannot
//! grow the metric's label set or add to a call that listener never ran.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::time::Instant;
use tonic::codegen::http::Request;
use tonic::codegen::Service;

use crate::metrics as m;

/// The client API a listener serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Api {
    /// lockcell's own (`lockcell.v1`).
    Lockcell,
    /// etcd's v3 API and its Lock and Election services.
    Etcd,
}

/// Wraps a server's routes so each named call of `Api`'s own time is recorded.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OverheadLayer(pub(crate) Api);

impl<S> tower::Layer<S> for OverheadLayer {
    type Service = Overhead<S>;

    fn layer(&self, inner: S) -> Overhead<S> {
        Overhead(inner, self.0)
    }
}

/// A service that records [`m::OVERHEAD_SECONDS`] for every call of its API that
/// [`call_name`] knows.
#[derive(Clone, Debug)]
pub(crate) struct Overhead<S>(S, Api);

impl<S, B> Service<Request<B>> for Overhead<S>
where
    S: Service<Request<B>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let name = call_name(request.uri().path()).filter(|(api, _)| *api == self.1);
        let call = self.0.call(request);
        let Some((_, name)) = name else {
            return Box::pin(call);
        };
        Box::pin(async move {
            let started = Instant::now();
            let (answer, outside) = lockcell_cell::timing::measured(call).await;
            let own = started.elapsed().saturating_sub(outside);
            metrics::histogram!(m::OVERHEAD_SECONDS, "call" => name).record(own.as_secs_f64());
            answer
        })
    }
}

/// The API and label of a call whose own time is measured, by its gRPC path; `None`
/// for streams (their time is their life) and for paths no service serves.
pub(crate) fn call_name(path: &str) -> Option<(Api, &'static str)> {
    let api = if path.starts_with("/lockcell.v1.") {
        Api::Lockcell
    } else {
        Api::Etcd
    };
    let name = match path {
        "/lockcell.v1.Session/Open" => "open",
        "/lockcell.v1.Session/Close" => "close",
        "/lockcell.v1.Session/Resume" => "resume",
        "/lockcell.v1.Lock/Acquire" => "acquire",
        "/lockcell.v1.Lock/Release" => "release",
        "/lockcell.v1.Lock/CheckSequencer" => "check_sequencer",
        "/lockcell.v1.Lock/Describe" => "describe",
        "/lockcell.v1.Election/Campaign" => "campaign",
        "/lockcell.v1.Election/Proclaim" => "proclaim",
        "/lockcell.v1.Election/Leader" => "leader",
        "/lockcell.v1.Election/Resign" => "resign",
        "/lockcell.v1.Kv/Get" => "get",
        "/lockcell.v1.Kv/Put" => "put",
        "/lockcell.v1.Kv/Delete" => "delete",
        "/lockcell.v1.Kv/Txn" => "txn",
        "/etcdserverpb.KV/Range" => "etcd_range",
        "/etcdserverpb.KV/Put" => "etcd_put",
        "/etcdserverpb.KV/DeleteRange" => "etcd_delete_range",
        "/etcdserverpb.KV/Txn" => "etcd_txn",
        "/etcdserverpb.Lease/LeaseGrant" => "etcd_lease_grant",
        "/etcdserverpb.Lease/LeaseRevoke" => "etcd_lease_revoke",
        "/etcdserverpb.Lease/LeaseTimeToLive" => "etcd_lease_time_to_live",
        "/v3lockpb.Lock/Lock" => "etcd_lock",
        "/v3lockpb.Lock/Unlock" => "etcd_unlock",
        "/v3electionpb.Election/Campaign" => "etcd_campaign",
        "/v3electionpb.Election/Proclaim" => "etcd_proclaim",
        "/v3electionpb.Election/Resign" => "etcd_resign",
        "/v3electionpb.Election/Leader" => "etcd_leader",
        _ => return None,
    };
    Some((api, name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_unary_call_of_the_lockcell_api_is_named_and_streams_are_not() {
        let proto = include_str!("../../proto/proto/lockcell/v1/lockcell.proto");
        let mut service = "";
        for line in proto.lines().map(str::trim) {
            if let Some(rest) = line.strip_prefix("service ") {
                service = rest.split_whitespace().next().expect("a service's name");
            }
            let Some(rest) = line.strip_prefix("rpc ") else {
                continue;
            };
            let method = rest.split('(').next().expect("a method's name");
            let path = format!("/lockcell.v1.{service}/{method}");
            let streams = line.contains("stream ");
            assert_eq!(
                call_name(&path).is_some(),
                !streams,
                "{path}: unary calls are measured, streams are not"
            );
        }
        assert_eq!(call_name("/lockcell.v1.Lock/Nonsense"), None);
        assert_eq!(
            call_name("/etcdserverpb.KV/Txn"),
            Some((Api::Etcd, "etcd_txn"))
        );
        assert_eq!(
            call_name("/lockcell.v1.Lock/Acquire"),
            Some((Api::Lockcell, "acquire"))
        );
    }
}
