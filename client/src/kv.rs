//! Small keys: read, conditional write, delete; and ephemeral keys that live as long as
//! the session that wrote them (membership: "this process is alive").

use lockcell_proto::v1::condition::When;
use lockcell_proto::v1::kv_client::KvClient;
use lockcell_proto::v1::{
    Condition as WireCondition, DeleteRequest, GetRequest, KeyValue, PutRequest,
};

use crate::client::{Client, UNARY_TIMEOUT};
use crate::error::{Call, Error};
use crate::session::Session;

/// When a write applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Condition {
    /// Always.
    Always,
    /// Only if the key does not exist.
    Absent,
    /// Only if the key's last write was at this revision (compare-and-swap).
    ModRevision(i64),
    /// Only if the key has been written this many times since it was created.
    Version(i64),
}

/// A small key as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub key: String,
    pub value: Vec<u8>,
    pub create_revision: i64,
    pub mod_revision: i64,
    pub version: i64,
    /// True for an ephemeral key.
    pub ephemeral: bool,
}

/// What a write did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Written {
    /// False when the condition did not hold; nothing was written.
    pub succeeded: bool,
    /// The store revision after the call.
    pub revision: i64,
    /// The key after the write, or as it was when the condition failed.
    pub current: Option<Entry>,
}

impl Client {
    /// One key, as of now (linearizable).
    pub async fn get(&self, key: &str) -> Result<Option<Entry>, Error> {
        Ok(self.read(key, false).await?.into_iter().next())
    }

    /// Every key under `prefix`, as of now (linearizable).
    pub async fn get_prefix(&self, prefix: &str) -> Result<Vec<Entry>, Error> {
        self.read(prefix, true).await
    }

    /// Writes `key` if `condition` holds.
    pub async fn put(
        &self,
        key: &str,
        value: &[u8],
        condition: Condition,
    ) -> Result<Written, Error> {
        self.write(key, value, condition, String::new(), Call::Unbound)
            .await
    }

    /// Deletes `key` if `condition` holds; returns whether it deleted it.
    pub async fn delete(&self, key: &str, condition: Condition) -> Result<bool, Error> {
        let mut request = tonic::Request::new(DeleteRequest {
            key: key.to_owned(),
            condition: wire(condition),
        });
        request.set_timeout(UNARY_TIMEOUT);
        let reply = KvClient::new(self.channel())
            .delete(request)
            .await
            .map_err(|s| Error::from_status(s, Call::Unbound))?
            .into_inner();
        Ok(reply.succeeded && reply.deleted > 0)
    }

    async fn read(&self, key: &str, prefix: bool) -> Result<Vec<Entry>, Error> {
        let mut request = tonic::Request::new(GetRequest {
            key: key.to_owned(),
            prefix,
            ..Default::default()
        });
        request.set_timeout(UNARY_TIMEOUT);
        let reply = KvClient::new(self.channel())
            .get(request)
            .await
            .map_err(|s| Error::from_status(s, Call::Unbound))?
            .into_inner();
        Ok(reply.kvs.into_iter().map(entry).collect())
    }

    async fn write(
        &self,
        key: &str,
        value: &[u8],
        condition: Condition,
        session_id: String,
        call: Call<'_>,
    ) -> Result<Written, Error> {
        let mut request = tonic::Request::new(PutRequest {
            key: key.to_owned(),
            value: value.to_vec(),
            condition: wire(condition),
            session_id,
        });
        request.set_timeout(UNARY_TIMEOUT);
        let reply = KvClient::new(self.channel())
            .put(request)
            .await
            .map_err(|s| Error::from_status(s, call))?
            .into_inner();
        Ok(Written {
            succeeded: reply.succeeded,
            revision: reply.revision,
            current: reply.current.map(entry),
        })
    }
}

impl Session {
    /// Writes an ephemeral `key`: it is deleted when this session ends (closed, expired,
    /// or its proxy gone), as membership keys should be.
    pub async fn put_ephemeral(
        &self,
        key: &str,
        value: &[u8],
        condition: Condition,
    ) -> Result<Written, Error> {
        self.client()
            .write(
                key,
                value,
                condition,
                self.id().to_owned(),
                Call::Session(self.id()),
            )
            .await
    }
}

fn wire(condition: Condition) -> Option<WireCondition> {
    let when = match condition {
        Condition::Always => return None,
        Condition::Absent => When::Absent(true),
        Condition::ModRevision(r) => When::ModRevision(r),
        Condition::Version(v) => When::Version(v),
    };
    Some(WireCondition { when: Some(when) })
}

fn entry(kv: KeyValue) -> Entry {
    Entry {
        key: kv.key,
        value: kv.value,
        create_revision: kv.create_revision,
        mod_revision: kv.mod_revision,
        version: kv.version,
        ephemeral: kv.lease != 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conditions_map_to_the_wire() {
        assert_eq!(wire(Condition::Always), None);
        assert_eq!(
            wire(Condition::Absent).and_then(|c| c.when),
            Some(When::Absent(true))
        );
        assert_eq!(
            wire(Condition::ModRevision(7)).and_then(|c| c.when),
            Some(When::ModRevision(7))
        );
        assert_eq!(
            wire(Condition::Version(2)).and_then(|c| c.when),
            Some(When::Version(2))
        );
    }
}
