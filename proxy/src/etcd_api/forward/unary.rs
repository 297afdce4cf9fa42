//! Unary calls on a lease: run where the lease lives, followed while it moves.

use super::*;

impl EtcdApi {
    /// Runs unary call `path` on lease `id` where the lease lives: forwarded there
    /// ([`Self::forward_unary`]), or `here`. A lease that `here` finds on its way to a
    /// proxy that asked for it (it answers [`refused_handed_off`] before doing anything)
    /// is followed there, a few times.
    ///
    /// [`refused_handed_off`]: crate::etcd_api::refused_handed_off
    pub(in crate::etcd_api) async fn on_lease<Req, Resp, Here>(
        &self,
        (id, path): (i64, &'static str),
        request: &Request<Req>,
        caller: Option<&str>,
        moved: impl Fn(&Resp) -> bool,
        here: impl Fn() -> Here,
    ) -> Result<Response<Resp>, Status>
    where
        Req: prost::Message + Clone + Send + 'static,
        Resp: prost::Message + Default + Send + 'static,
        Here: std::future::Future<Output = Result<Response<Resp>, Status>>,
    {
        for look in 1..=MOVED_LOOKS {
            if let Some(there) = self
                .forward_unary(id, path, request, caller, &moved)
                .await?
            {
                return Ok(there);
            }
            match here().await {
                // (A forwarded call runs here only: its forwarding proxy looks again.)
                Err(refused)
                    if look < MOVED_LOOKS
                        && !request.metadata().contains_key(FORWARDED_FOR)
                        && self.moved_on(&refused) =>
                {
                    continue
                }
                done => return done,
            }
        }
        unreachable!("the last look returns")
    }

    /// Whether a call that ran here found its lease handed to a proxy that asked for
    /// it: nothing was done, and the call goes on where the lease is now.
    fn moved_on(&self, refused: &Status) -> bool {
        !self.state.is_draining()
            && refused.code() == tonic::Code::Unavailable
            && refused.message() == crate::etcd_api::refused_handed_off().message()
    }

    /// Runs unary call `path` on lease `id` at the proxy the lease lives at: `None`
    /// when it runs here. A lease the proxy no longer has there (its answer is
    /// NOT_FOUND or UNAVAILABLE, or `moved` says so) is looked for again, up to
    /// [`MOVED_LOOKS`] times: a lease moving between proxies (Txns gathering it) is
    /// followed. Found again at the proxy that said it was not there, it is asked again
    /// after a pause (it may have moved away and back).
    pub(in crate::etcd_api) async fn forward_unary<Req, Resp>(
        &self,
        id: i64,
        path: &'static str,
        request: &Request<Req>,
        caller: Option<&str>,
        moved: impl Fn(&Resp) -> bool,
    ) -> Result<Option<Response<Resp>>, Status>
    where
        Req: prost::Message + Clone + Send + 'static,
        Resp: prost::Message + Default + Send + 'static,
    {
        let mut denied: Option<String> = None;
        for look in 1..=MOVED_LOOKS {
            let fresh = denied.is_some();
            let Some(peer) = self.route(id, request.metadata(), caller, fresh).await? else {
                return Ok(None);
            };
            pause_if_denied_by(denied.as_deref(), &peer.proxy).await;
            metrics::counter!(m::ETCD_API_FORWARDED).increment(1);
            let call = self.forwarded(request.metadata(), request.get_ref().clone(), caller)?;
            let got = peer.unary(path, call).await;
            // Looked for again only when the peer did nothing: it does not have the
            // lease (NOT_FOUND is answered before any write), it handed the lease over,
            // or it could not be reached. Any other failure may have come after a
            // write landed: the client hears it as it is.
            let gone = match &got {
                Ok(reply) => moved(reply.get_ref()),
                Err(status) => {
                    status.code() == tonic::Code::NotFound
                        || status.message() == crate::etcd_api::refused_handed_off().message()
                        || status.message().starts_with(UNREACHABLE)
                }
            };
            if gone && look < MOVED_LOOKS {
                self.peers.forget(id);
                denied = Some(peer.proxy);
                continue;
            }
            return got.map(Some);
        }
        unreachable!("the last look returns")
    }
}
