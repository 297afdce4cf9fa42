//! The Kv service: small keys under `/k/` with conditional writes; a write with a
//! session is ephemeral (on the session's proxy lease, deleted when the session ends).

use std::sync::Arc;

use lockcell_cell::kv::{Condition, Entry};
use lockcell_cell::locklog::Grant;
use lockcell_cell::LockName;
use lockcell_proto::v1::condition::When;
use lockcell_proto::v1::kv_server::Kv as KvApi;
use lockcell_proto::v1::{
    DeleteRequest, DeleteResponse, GetRequest, GetResponse, KeyValue, PutRequest, PutResponse,
};
use tokio::time::Instant;
use tonic::{Request, Response, Status};

use crate::errors::ProxyError;
use crate::state::ProxyState;

pub struct KvService {
    pub state: Arc<ProxyState>,
}

#[tonic::async_trait]
impl KvApi for KvService {
    #[tracing::instrument(skip_all, fields(kv.key = %request.get_ref().key))]
    async fn get(&self, request: Request<GetRequest>) -> Result<Response<GetResponse>, Status> {
        let req = request.into_inner();
        if req.limit < 0 || req.revision < 0 {
            return Err(ProxyError::BadArgument(format!(
                "read of {:?}: limit and revision may not be negative",
                req.key
            ))
            .into());
        }
        let read = self
            .state
            .kv
            .get(
                &req.key,
                req.prefix,
                req.limit,
                req.revision,
                req.serializable,
            )
            .await
            .map_err(ProxyError::from)?;
        Ok(Response::new(GetResponse {
            kvs: read.entries.into_iter().map(wire).collect(),
            revision: read.revision,
            more: read.more,
        }))
    }

    #[tracing::instrument(skip_all, fields(kv.key = %request.get_ref().key))]
    async fn put(&self, request: Request<PutRequest>) -> Result<Response<PutResponse>, Status> {
        let req = request.into_inner();
        let state = &self.state;
        let name = key_name(&req.key)?;
        let limit = state.config.max_value_bytes;
        if req.value.len() > limit {
            return Err(ProxyError::BadArgument(format!(
                "the value for key {:?} is {} bytes, over the limit of {limit} bytes",
                req.key,
                req.value.len()
            ))
            .into());
        }
        let condition = condition(&req.key, req.condition)?;
        let session = if req.session_id.is_empty() {
            None
        } else {
            let s = state
                .sessions
                .get(&req.session_id, Instant::now())
                .map_err(|gone| ProxyError::session(&req.session_id, gone))?;
            Some(s)
        };
        let written = state
            .kv
            .put(
                &name,
                req.value,
                session.as_ref().map(|s| s.lease),
                condition,
            )
            .await
            .map_err(ProxyError::from)?;
        if let (true, Some(session), Some(current)) =
            (written.succeeded, &session, &written.current)
        {
            // The key goes with the session: record it for the session's clean-up.
            let grant = Grant::ephemeral(&name, current.create_revision);
            if !state
                .sessions
                .record_grant(&session.id, grant.clone(), None)
            {
                state.cleanup.push(session.lease, vec![grant]);
                return Err(
                    ProxyError::session(&req.session_id, crate::sessions::Gone::Unknown).into(),
                );
            }
        }
        Ok(Response::new(PutResponse {
            succeeded: written.succeeded,
            revision: written.revision,
            current: written.current.map(wire),
        }))
    }

    #[tracing::instrument(skip_all, fields(kv.key = %request.get_ref().key))]
    async fn delete(
        &self,
        request: Request<DeleteRequest>,
    ) -> Result<Response<DeleteResponse>, Status> {
        let req = request.into_inner();
        let name = key_name(&req.key)?;
        let condition = condition(&req.key, req.condition)?;
        let (written, deleted) = self
            .state
            .kv
            .delete(&name, condition)
            .await
            .map_err(ProxyError::from)?;
        Ok(Response::new(DeleteResponse {
            succeeded: written.succeeded,
            deleted,
            revision: written.revision,
        }))
    }
}

/// A small key's name: the lock-name rules, with errors that say "key".
fn key_name(key: &str) -> Result<LockName, ProxyError> {
    LockName::parse(key)
        .map_err(|e| ProxyError::BadArgument(e.to_string().replacen("lock name", "key", 1)))
}

fn condition(
    key: &str,
    wire: Option<lockcell_proto::v1::Condition>,
) -> Result<Condition, ProxyError> {
    let bad = |what: &str, n: i64| {
        ProxyError::BadArgument(format!(
            "condition on key {key:?}: {what} {n} is not a revision or version (must be positive)"
        ))
    };
    Ok(match wire.and_then(|c| c.when) {
        None | Some(When::Absent(false)) => Condition::Always,
        Some(When::Absent(true)) => Condition::Absent,
        Some(When::ModRevision(r)) if r > 0 => Condition::ModRevision(r),
        Some(When::ModRevision(r)) => return Err(bad("mod_revision", r)),
        Some(When::Version(v)) if v > 0 => Condition::Version(v),
        Some(When::Version(v)) => return Err(bad("version", v)),
    })
}

fn wire(e: Entry) -> KeyValue {
    KeyValue {
        key: e.name,
        value: e.value,
        create_revision: e.create_revision,
        mod_revision: e.mod_revision,
        version: e.version,
        lease: e.lease,
    }
}
