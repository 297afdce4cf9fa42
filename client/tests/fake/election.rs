//! The fake proxy's `Election` service: one leader per election in a watch channel,
//! so waiting campaigns and observers wake on every change.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::time::Duration;

use lockcell_proto::v1::election_server::Election;
use lockcell_proto::v1::{
    CampaignRequest, CampaignResponse, FencingToken, Leader, LeaderRequest, LeaderResponse,
    ProclaimRequest, ProclaimResponse, ResignRequest, ResignResponse,
};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::{Cut, Fake, FakeProxy};

/// How the test cut the observers, once it has.
async fn wait_for_cut(cut: &mut tokio::sync::watch::Receiver<Cut>) -> Cut {
    match cut.wait_for(|c| *c != Cut::Not).await {
        Ok(how) => *how,
        Err(_) => Cut::Cleanly,
    }
}

fn holds(leader: &Leader, session: &str, token: Option<FencingToken>) -> bool {
    leader.session_id == session && leader.token == token
}

#[tonic::async_trait]
impl Election for FakeProxy {
    async fn campaign(
        &self,
        request: Request<CampaignRequest>,
    ) -> Result<Response<CampaignResponse>, Status> {
        let req = request.into_inner();
        if req.election.is_empty() || req.election.contains(' ') {
            return Err(Status::invalid_argument(format!(
                "election name {:?} is not allowed",
                req.election
            )));
        }
        if self.0.is_killed(&req.session_id) {
            return Err(Fake::expired(&req.session_id));
        }
        let deadline = req
            .wait_timeout_ms
            .map(|ms| Instant::now() + Duration::from_millis(ms));
        let mut rx = self.0.leaders.subscribe();
        let free = |leaders: &HashMap<String, Leader>| {
            leaders
                .get(&req.election)
                .is_none_or(|l| l.session_id == req.session_id)
        };
        loop {
            let waited = match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, rx.wait_for(free))
                    .await
                    .is_ok_and(|r| r.is_ok()),
                None => rx.wait_for(free).await.is_ok(),
            };
            if !waited {
                return Ok(Response::new(CampaignResponse {
                    elected: false,
                    token: None,
                    valid_for_ms: 0,
                }));
            }
            let mut token = None;
            self.0.leaders.send_if_modified(|leaders| {
                match leaders.get_mut(&req.election) {
                    // Taken between the wait and now: wait again.
                    Some(l) if l.session_id != req.session_id => false,
                    Some(l) => {
                        token = l.token;
                        let changed = l.value != req.value;
                        l.value.clone_from(&req.value);
                        changed
                    }
                    None => {
                        let t = FencingToken {
                            epoch: 1,
                            revision: self.0.next_revision(),
                        };
                        token = Some(t);
                        let identity = self.0.identities.lock().unwrap()[&req.session_id].clone();
                        leaders.insert(
                            req.election.clone(),
                            Leader {
                                session_id: req.session_id.clone(),
                                identity,
                                proxy_id: "fake".into(),
                                value: req.value.clone(),
                                token: Some(t),
                            },
                        );
                        true
                    }
                }
            });
            if token.is_some() {
                return Ok(Response::new(CampaignResponse {
                    elected: true,
                    token,
                    valid_for_ms: self.0.valid_for_ms.load(Ordering::Relaxed),
                }));
            }
        }
    }

    async fn proclaim(
        &self,
        request: Request<ProclaimRequest>,
    ) -> Result<Response<ProclaimResponse>, Status> {
        let req = request.into_inner();
        if self.0.is_killed(&req.session_id) {
            return Err(Fake::expired(&req.session_id));
        }
        let mut leads = false;
        self.0
            .leaders
            .send_if_modified(|leaders| match leaders.get_mut(&req.election) {
                Some(l) if holds(l, &req.session_id, req.token) => {
                    leads = true;
                    let changed = l.value != req.value;
                    l.value.clone_from(&req.value);
                    changed
                }
                _ => false,
            });
        if !leads {
            let token = req.token.map(|t| format!("{}:{}", t.epoch, t.revision));
            return Err(Status::failed_precondition(format!(
                "not the leader of election {:?}: token {} is not the current grant",
                req.election,
                token.unwrap_or_default()
            )));
        }
        Ok(Response::new(ProclaimResponse {}))
    }

    async fn leader(
        &self,
        request: Request<LeaderRequest>,
    ) -> Result<Response<LeaderResponse>, Status> {
        let election = request.into_inner().election;
        let leader = self.0.leaders.borrow().get(&election).cloned();
        Ok(Response::new(LeaderResponse {
            leader,
            revision: 0,
        }))
    }

    type ObserveStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<LeaderResponse, Status>> + Send>>;

    async fn observe(
        &self,
        request: Request<LeaderRequest>,
    ) -> Result<Response<Self::ObserveStream>, Status> {
        let election = request.into_inner().election;
        let mut leaders = self.0.leaders.subscribe();
        let mut cut = self.0.cut_observers.subscribe();
        let fake = self.0.clone();
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            let mut last: Option<Option<Leader>> = None;
            loop {
                let current = leaders.borrow_and_update().get(&election).cloned();
                if last.as_ref() != Some(&current) {
                    let reply = LeaderResponse {
                        leader: current.clone(),
                        revision: 0,
                    };
                    if tx.send(Ok(reply)).await.is_err() {
                        return;
                    }
                    last = Some(current);
                }
                tokio::select! {
                    changed = leaders.changed() => {
                        if changed.is_err() {
                            return;
                        }
                    }
                    how = wait_for_cut(&mut cut) => {
                        if how == Cut::WithError {
                            let _ = tx.send(Err(Status::unavailable("observation cut by the test"))).await;
                        }
                        // One cut: a client that observes again is served.
                        fake.cut_observers.send_replace(Cut::Not);
                        return;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn resign(
        &self,
        request: Request<ResignRequest>,
    ) -> Result<Response<ResignResponse>, Status> {
        let req = request.into_inner();
        if self.0.is_killed(&req.session_id) {
            return Err(Fake::expired(&req.session_id));
        }
        let resigned = self.0.leaders.send_if_modified(|leaders| {
            let leads = leaders
                .get(&req.election)
                .is_some_and(|l| holds(l, &req.session_id, req.token));
            if leads {
                leaders.remove(&req.election);
            }
            leads
        });
        if resigned {
            self.0.resigned.send_modify(|r| r.push(req.election));
        }
        Ok(Response::new(ResignResponse { resigned }))
    }
}
