//! A keepalive stream's stream to another proxy: its replies relayed to the client.

use super::*;

/// Relays the replies of the keepalive stream to `peer` to the client: a lease the
/// peer no longer has is looked for again before the client hears TTL 0. A stream that
/// fails or ends with renewals unanswered ends the client's stream with why, so the
/// client opens another and renews again (looked for afresh). Holds the relays weakly,
/// so the stream ends with the client's.
pub(super) async fn relay(
    relays: std::sync::Weak<Relays>,
    detached: Arc<Relays>,
    peer: crate::etcd_api::forward::Peer,
    call: Request<ReceiverStream<PbLeaseKeepAliveRequest>>,
    waiting: Waiting,
) {
    let tx = detached.tx.clone();
    let opened = peer
        .streaming::<_, PbLeaseKeepAliveRequest, PbLeaseKeepAliveResponse>(KEEP_ALIVE, call)
        .await;
    let mut replies = opened.map(Response::into_inner);
    loop {
        let reply = match &mut replies {
            Ok(replies) => replies.message().await,
            Err(status) => Err(status.clone()),
        };
        let mut times = 0;
        if let Ok(Some(reply)) = &reply {
            let mut waiting = waiting.lock().expect("waiting lock");
            if let Some(at) = waiting.iter().position(|w| w.0 == reply.id) {
                times = waiting.remove(at).1;
            }
        }
        match reply {
            // Renewed there, or expired there (a lease that expired never lives again).
            Ok(Some(reply)) if reply.ttl >= 0 => {
                if reply.ttl == 0 {
                    if let Some(relays) = relays.upgrade() {
                        relays.api.peers.forget(reply.id);
                    }
                }
                if tx.send(Ok(reply)).await.is_err() {
                    return;
                }
            }
            // Not there: it moved.
            Ok(Some(reply)) => {
                // The client may have half-closed its stream since: it still hears.
                let relays = relays.upgrade().unwrap_or_else(|| detached.detached());
                relays.api.peers.forget(reply.id);
                let denied = Denied {
                    proxy: peer.proxy.clone(),
                    times: times + 1,
                };
                tokio::spawn(relays.unknown(reply.id, Some(denied)));
            }
            // The peer is gone, draining or refusing: its leases are looked for again
            // at their next renewal.
            ended => {
                if let Some(relays) = relays.upgrade() {
                    relays.open.lock().expect("relays lock").remove(&peer.proxy);
                    relays.api.peers.forget_proxy(&peer.proxy);
                }
                if !waiting.lock().expect("waiting lock").is_empty() {
                    let why = match ended {
                        // A refusal (the caller's rights or limits) as it is; a broken
                        // stream to the peer as UNAVAILABLE, which every client retries.
                        Err(status) if !broken(&status) => status,
                        Err(status) => Status::unavailable(format!(
                            "etcdserver: the stream to proxy {}, where a lease of this stream lives, failed ({}); renew again",
                            peer.proxy,
                            status.message()
                        )),
                        _ => Status::unavailable(format!(
                            "etcdserver: proxy {}, where a lease of this stream lives, ended its stream; renew again",
                            peer.proxy
                        )),
                    };
                    let _ = tx.send(Err(why)).await;
                }
                return;
            }
        }
    }
}

/// Whether `status` ended a stream to another proxy because the stream broke (the
/// proxy went away, hung, or the connection failed), not because the proxy refused.
fn broken(status: &Status) -> bool {
    use tonic::Code;
    matches!(
        status.code(),
        Code::Unknown
            | Code::Internal
            | Code::Cancelled
            | Code::DeadlineExceeded
            | Code::Unavailable
    )
}
