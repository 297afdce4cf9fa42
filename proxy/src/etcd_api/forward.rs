//! Calls on a lease that lives at another proxy of the cell, forwarded there.
//!
//! Go's clientv3 spreads its calls over all its endpoints: a grant lands on proxy A,
//! the lease's keepalives on B, a put with it on C. A lease lives at one proxy at a
//! time, the one that holds its session, so every other proxy finds that one and
//! forwards the call to its etcd API, which runs it as if the client had called it:
//!
//! - A hand-off record of the lease (see [`super::handoff`]) means it is up for
//!   taking: the proxy the call reached takes it over itself.
//! - Else the lease's session fence names the proxy a lease moved to (a take-over
//!   writes it, on that proxy's etcd lease).
//! - Else the claim of a lease ID the client chose names the proxy that claimed it.
//! - Else the ID's block ([`super::ids`]) is named in the presence record of the proxy
//!   that took it.
//!
//! A lease found nowhere is answered as unknown, here. The answer is remembered per
//! lease until a forwarded call finds the lease gone or moved there, which looks again.
//!
//! The forwarded call names its caller in its metadata, signed with the cell's
//! forwarding key (an HMAC key the first proxy that needs it writes in etcd, at
//! [`keyspace::etcd_forward_key`], where only proxies read) and the time it was signed,
//! so no client can claim another's identity through it; a forwarded call is never
//! forwarded again.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dashmap::DashMap;
use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};
use lockcell_cell::error::with_timeout;
use lockcell_cell::keyspace;
use lockcell_cell::presence::{self, Presence};
use ring::hmac;
use tokio::time::Instant;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Request, Response, Status, Streaming};

use etcd_client::proto::{
    PbLeaseLeasesRequest, PbLeaseLeasesResponse, PbLeaseStatus, PbLeaseTimeToLiveRequest,
    PbLeaseTimeToLiveResponse,
};

use super::ids::session_of;
use super::{ids, EtcdApi};
use crate::errors::ProxyError;
use crate::metrics as m;

mod gather;
mod signed;
mod unary;

use self::signed::*;

/// Metadata of a forwarded call: its caller's identity, in hex (empty for none).
pub const FORWARDED_FOR: &str = "lockcell-forwarded-for";
/// Metadata of a forwarded LeaseTimeToLive that asks the proxy holding the lease to
/// hand it over to the asking proxy ([`EtcdApi::gather`]).
pub const HAND_OVER: &str = "lockcell-hand-over";
/// The Lease call a proxy asks another with, to find a lease or have it handed over.
pub(super) const TIME_TO_LIVE: &str = "/etcdserverpb.Lease/LeaseTimeToLive";

/// When the forwarding proxy signed it: Unix seconds.
const FORWARDED_AT: &str = "lockcell-forwarded-at";
/// The signature of the two, in hex.
const FORWARDED_MAC: &str = "lockcell-forwarded-mac";

/// How far a forwarded call's signing time may be from this proxy's clock.
const SIGNED_WITHIN: Duration = Duration::from_secs(60);

/// How a forwarded call that never reached its proxy fails.
const UNREACHABLE: &str =
    "etcdserver: the lease lives at another proxy, which this proxy cannot reach:";

/// How often a channel to another proxy is pinged, and how long a ping may go
/// unanswered before the proxy counts as hung and its calls fail.
const PEER_PING: Duration = Duration::from_secs(2);
const PEER_PING_TIMEOUT: Duration = Duration::from_secs(3);

/// How many times a call on a lease (a unary call, or a keepalive's renewal) is sent
/// on while the proxies it reaches say the lease is not there: it may be moving
/// between proxies, Txns gathering it. Then it ends as etcd answers an unknown lease.
pub(in crate::etcd_api) const MOVED_LOOKS: u32 = 8;

/// The pause before a call is sent again to the proxy that has just said its lease is
/// not there (the lease may have moved away and back).
const MOVED_PAUSE: Duration = Duration::from_millis(50);

/// Pauses before a call on a lease goes to `proxy` when `proxy` is the one that has
/// just `denied` having the lease.
pub(in crate::etcd_api) async fn pause_if_denied_by(denied: Option<&str>, proxy: &str) {
    if denied == Some(proxy) {
        lockcell_cell::timing::waiting(tokio::time::sleep(MOVED_PAUSE)).await;
    }
}

/// How long the presence records read are used before they are read again.
const PRESENCE_FRESH: Duration = Duration::from_secs(1);

/// Metadata a forwarded call carries on, as the client sent it.
const CARRIED: [&str; 2] = ["hasleader", "grpc-timeout"];

/// The other proxies of the cell, as far as forwarding is concerned.
#[derive(Default)]
pub struct Peers {
    /// By lease: the proxy it was last found at.
    owners: DashMap<i64, String>,
    /// By proxy id: its etcd API address and a channel to it.
    channels: DashMap<String, (String, Channel)>,
    /// The presence records last read, and when.
    presence: tokio::sync::Mutex<Option<(Instant, Arc<Vec<Presence>>)>>,
    /// The cell's forwarding key, once read.
    key: OnceLock<hmac::Key>,
}

/// A proxy a call is forwarded to.
#[derive(Clone)]
pub struct Peer {
    pub proxy: String,
    channel: Channel,
}

impl Peers {
    /// Forgets where the leases at `proxy` were found: a call there failed.
    pub fn forget_proxy(&self, proxy: &str) {
        self.owners.retain(|_, at| at != proxy);
    }

    /// Forgets where lease `id` was found.
    pub fn forget(&self, id: i64) {
        self.owners.remove(&id);
    }
}

impl EtcdApi {
    /// Where a call on lease `id` runs: `None` here (the lease is here, up for taking,
    /// or nowhere), else the proxy it lives at. `fresh` looks again rather than use what
    /// was found before. A forwarded call always runs here.
    pub(super) async fn route(
        &self,
        id: i64,
        metadata: &MetadataMap,
        caller: Option<&str>,
        fresh: bool,
    ) -> Result<Option<Peer>, Status> {
        if id == 0 {
            return Ok(None);
        }
        self.hand_over_settled(id).await;
        if metadata.contains_key(FORWARDED_FOR)
            || self.state.sessions.peek(&session_of(id)).is_some()
        {
            return Ok(None);
        }
        let mut fresh = fresh;
        loop {
            let known = if fresh {
                None
            } else {
                self.peers.owners.get(&id).map(|o| o.clone())
            };
            let owner = match known {
                Some(owner) => owner,
                None => match self.find_owner(id, caller).await? {
                    Some(owner) => owner,
                    None => return Ok(None),
                },
            };
            if owner == self.state.proxy_id {
                self.peers.forget(id);
                return Ok(None);
            }
            if let Some(peer) = self.peer(&owner, id).await? {
                self.peers.owners.insert(id, owner);
                return Ok(Some(peer));
            }
            // The proxy it was found at is gone: it may have moved since.
            self.peers.forget(id);
            if fresh {
                return Ok(None);
            }
            fresh = true;
        }
    }

    /// The proxy lease `id` lives at, from etcd, for `caller`: `None` when it is here
    /// (a hand-off record of it is taken over here first) or found nowhere. A take-over
    /// that another proxy won looks again, and finds the winner.
    async fn find_owner(&self, id: i64, caller: Option<&str>) -> Result<Option<String>, Status> {
        let state = &self.state;
        for first in [true, false] {
            let txn = Txn::new().and_then([
                TxnOp::get(keyspace::etcd_lease_handoff_key(id), None),
                TxnOp::get(keyspace::session_fence_key(&session_of(id)), None),
                TxnOp::get(keyspace::etcd_lease_claim_key(id), None),
            ]);
            let done = with_timeout(
                "find a lease's proxy",
                state.config.etcd_timeout,
                state.etcd.kv_client().txn(txn),
            )
            .await
            .map_err(ProxyError::from)?;
            let ops = done.op_responses();
            if first && first_value(&ops, 0).is_some() {
                match self.take_over(id, caller).await? {
                    super::handoff::TakeOver::Taken(_) => return Ok(None),
                    super::handoff::TakeOver::NoRecord => continue,
                }
            }
            if let Some(proxy) = first_value(&ops, 1).or_else(|| first_value(&ops, 2)) {
                return Ok(Some(String::from_utf8_lossy(&proxy).into_owned()));
            }
            break;
        }
        if !ids::is_ours(id) {
            return Ok(None);
        }
        // Read again if the records read lately do not name the block: its proxy may
        // have taken it since.
        let block = ids::block_of(id);
        for again in [false, true] {
            let proxies = self.presence(again).await?;
            let found = proxies
                .iter()
                .find(|p| p.etcd_lease_blocks.contains(&block));
            if let Some(found) = found {
                return Ok(Some(found.proxy_id.clone()));
            }
        }
        Ok(None)
    }

    /// The presence records of the cell's proxies, read again when older than
    /// [`PRESENCE_FRESH`] or when `again`.
    pub(super) async fn presence(&self, again: bool) -> Result<Arc<Vec<Presence>>, Status> {
        let mut kept = self.peers.presence.lock().await;
        if let Some((read, proxies)) = kept.as_ref() {
            if !again && read.elapsed() < PRESENCE_FRESH {
                return Ok(proxies.clone());
            }
        }
        let mut kv = self.state.etcd.kv_client();
        let read = presence::recorded(&mut kv, self.state.config.etcd_timeout)
            .await
            .map_err(ProxyError::from)?;
        let proxies = Arc::new(read.into_iter().map(|r| r.presence).collect::<Vec<_>>());
        *kept = Some((Instant::now(), proxies.clone()));
        Ok(proxies)
    }

    /// A channel to proxy `proxy`'s etcd API, where a call on lease `id` goes: `None`
    /// when the proxy is not running (its presence record is gone with its leases).
    async fn peer(&self, proxy: &str, id: i64) -> Result<Option<Peer>, Status> {
        let mut found = None;
        for again in [false, true] {
            found = self
                .presence(again)
                .await?
                .iter()
                .find(|p| p.proxy_id == proxy)
                .cloned();
            if found.is_some() {
                break;
            }
        }
        let Some(found) = found else {
            return Ok(None);
        };
        let Some(address) = found.etcd else {
            return Err(Status::unavailable(format!(
                "etcdserver: lease {id:x} lives at proxy {proxy}, which serves no etcd API; call that proxy's lockcell API"
            )));
        };
        if let Some(known) = self.peers.channels.get(proxy) {
            if known.0 == address {
                return Ok(Some(Peer {
                    proxy: proxy.to_owned(),
                    channel: known.1.clone(),
                }));
            }
        }
        let channel = self.channel(&address, proxy, id)?;
        self.peers
            .channels
            .insert(proxy.to_owned(), (address, channel.clone()));
        Ok(Some(Peer {
            proxy: proxy.to_owned(),
            channel,
        }))
    }

    /// A lazily connected channel to `address`, with this proxy's TLS.
    fn channel(&self, address: &str, proxy: &str, id: i64) -> Result<Channel, Status> {
        let config = &self.state.config;
        let unavailable = |why: String| {
            Status::unavailable(format!(
                "etcdserver: lease {id:x} lives at proxy {proxy} ({address}), and this proxy cannot forward there: {why}"
            ))
        };
        let tls = crate::listen::tls_files(config).is_some();
        let scheme = if tls { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{address}"))
            .map_err(|e| unavailable(e.to_string()))?
            .connect_timeout(config.etcd_timeout)
            .http2_keep_alive_interval(PEER_PING)
            .keep_alive_timeout(PEER_PING_TIMEOUT)
            .keep_alive_while_idle(true)
            .tcp_nodelay(true);
        if tls {
            let Some(ca) = &config.etcd_peer_ca else {
                return Err(unavailable(
                    "this proxy serves TLS and has no --etcd-peer-ca to check the other proxies' certificates with".into(),
                ));
            };
            let read = |path: &std::path::Path| {
                std::fs::read(path).map_err(|e| unavailable(format!("{}: {e}", path.display())))
            };
            let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(ca)?));
            if let (Some(_), Some(cert), Some(key)) =
                (&config.tls_client_ca, &config.tls_cert, &config.tls_key)
            {
                tls = tls.identity(Identity::from_pem(read(cert)?, read(key)?));
            }
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| unavailable(e.to_string()))?;
        }
        Ok(endpoint.connect_lazy())
    }

    /// The caller's leases at every other proxy that serves the etcd API. A proxy that
    /// does not answer is left out (logged): its leases end with it, within its etcd
    /// lease TTL.
    pub(super) async fn leases_elsewhere(
        &self,
        request: &Request<PbLeaseLeasesRequest>,
        caller: Option<&str>,
    ) -> Result<Vec<PbLeaseStatus>, Status> {
        let mut leases = Vec::new();
        for other in self.presence(true).await?.iter() {
            if other.proxy_id == self.state.proxy_id || other.etcd.is_none() {
                continue;
            }
            let Some(peer) = self.peer(&other.proxy_id, 0).await? else {
                continue;
            };
            let call = self.forwarded(request.metadata(), PbLeaseLeasesRequest {}, caller)?;
            let listed: Result<Response<PbLeaseLeasesResponse>, _> =
                peer.unary("/etcdserverpb.Lease/LeaseLeases", call).await;
            match listed {
                Ok(listed) => leases.extend(listed.into_inner().leases),
                Err(error) => tracing::warn!(
                    proxy = %peer.proxy,
                    error = %error.message(),
                    "could not list the leases at another proxy; left out"
                ),
            }
        }
        Ok(leases)
    }

    /// A copy of `request` to forward for `caller`: signed, with the metadata the
    /// client's call carries on.
    pub(super) fn forwarded<U>(
        &self,
        metadata: &MetadataMap,
        message: U,
        caller: Option<&str>,
    ) -> Result<Request<U>, Status> {
        let mut out = Request::new(message);
        for name in CARRIED {
            if let Some(value) = metadata.get(name) {
                out.metadata_mut().insert(name, value.clone());
            }
        }
        let key = self.peers.key.get().ok_or_else(|| {
            Status::unavailable(
                "etcdserver: this proxy has not read the cell's forwarding key yet; try again",
            )
        })?;
        let who = to_hex(caller.unwrap_or_default().as_bytes());
        let at = now_secs().to_string();
        let mac = to_hex(hmac::sign(key, signed_text(&who, &at).as_bytes()).as_ref());
        let md = out.metadata_mut();
        for (name, value) in [
            (FORWARDED_FOR, who),
            (FORWARDED_AT, at),
            (FORWARDED_MAC, mac),
        ] {
            let value = MetadataValue::try_from(value.as_str()).expect("hex and digits");
            md.insert(name, value);
        }
        Ok(out)
    }
}

impl Peer {
    /// Calls unary `path` at this proxy. The round trip counts as time the call spent
    /// outside this proxy ([`lockcell_cell::timing`]).
    pub async fn unary<Req, Resp>(
        &self,
        path: &'static str,
        request: Request<Req>,
    ) -> Result<Response<Resp>, Status>
    where
        Req: prost::Message + Send + 'static,
        Resp: prost::Message + Default + Send + 'static,
    {
        lockcell_cell::timing::waiting(async {
            let mut grpc = self.ready().await?;
            let codec = tonic_prost::ProstCodec::<Req, Resp>::default();
            grpc.unary(request, PathAndQuery::from_static(path), codec)
                .await
        })
        .await
    }

    /// Opens streaming call `path` at this proxy.
    pub async fn streaming<S, Req, Resp>(
        &self,
        path: &'static str,
        request: Request<S>,
    ) -> Result<Response<Streaming<Resp>>, Status>
    where
        S: tokio_stream::Stream<Item = Req> + Send + 'static,
        Req: prost::Message + Send + 'static,
        Resp: prost::Message + Default + Send + 'static,
    {
        let mut grpc = self.ready().await?;
        let codec = tonic_prost::ProstCodec::<Req, Resp>::default();
        grpc.streaming(request, PathAndQuery::from_static(path), codec)
            .await
    }

    async fn ready(&self) -> Result<tonic::client::Grpc<Channel>, Status> {
        let mut grpc = tonic::client::Grpc::new(self.channel.clone());
        grpc.ready()
            .await
            .map_err(|e| Status::unavailable(format!("{UNREACHABLE} {}: {e}", self.proxy)))?;
        Ok(grpc)
    }
}

/// The value of the first key of Get operation `index` in a transaction's answers.
fn first_value(ops: &[TxnOpResponse], index: usize) -> Option<Vec<u8>> {
    match ops.get(index)? {
        TxnOpResponse::Get(got) => got.kvs().first().map(|kv| kv.value().to_vec()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_goes_there_and_back() {
        let bytes = b"batch \xff\x00".to_vec();
        assert_eq!(from_hex(&to_hex(&bytes)), Some(bytes));
        assert_eq!(from_hex("abc"), None);
        assert_eq!(from_hex("zz"), None);
        assert_eq!(to_hex(b""), "");
    }

    #[test]
    fn a_signature_covers_the_caller_and_the_time() {
        let key = hmac::Key::new(hmac::HMAC_SHA256, b"0123456789abcdef");
        let mac = hmac::sign(&key, signed_text("6261", "100").as_bytes());
        assert!(hmac::verify(&key, signed_text("6261", "100").as_bytes(), mac.as_ref()).is_ok());
        assert!(hmac::verify(&key, signed_text("6262", "100").as_bytes(), mac.as_ref()).is_err());
        assert!(hmac::verify(&key, signed_text("6261", "101").as_bytes(), mac.as_ref()).is_err());
    }
}
