//! The forwarding key, and the caller a forwarded call names, signed with it.

use super::*;

impl EtcdApi {
    /// Reads the cell's forwarding key, writing it first if no proxy has: until then,
    /// forwarded calls are refused. Tries until it has it or the proxy stops.
    pub(in crate::etcd_api) async fn load_forward_key(self) {
        let mut pauses =
            crate::pause::Pauses::new(Duration::from_millis(100), Duration::from_secs(5));
        while !*self.state.shutdown.borrow() {
            match self.read_forward_key().await {
                Ok(key) => {
                    let _ = self.peers.key.set(key);
                    return;
                }
                Err(error) => {
                    tracing::warn!(%error, "reading the cell's forwarding key failed; retrying")
                }
            }
            tokio::time::sleep(pauses.next_pause()).await;
        }
    }

    async fn read_forward_key(&self) -> Result<hmac::Key, ProxyError> {
        let key = keyspace::etcd_forward_key();
        let fresh: [u8; 32] = rand::random();
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key, to_hex(&fresh), None)])
            .or_else([TxnOp::get(key, None)]);
        let done = with_timeout(
            "read the forwarding key",
            self.state.config.etcd_timeout,
            self.state.etcd.kv_client().txn(txn),
        )
        .await?;
        let text = if done.succeeded() {
            to_hex(&fresh)
        } else {
            first_value(&done.op_responses(), 0)
                .map(|v| String::from_utf8_lossy(&v).into_owned())
                .unwrap_or_default()
        };
        let bytes = from_hex(text.trim()).filter(|b| b.len() >= 16).ok_or_else(|| {
            ProxyError::Refused(format!(
                "the cell's forwarding key at {key} is not 16 or more bytes in hex; an operator must delete it (the proxies write a new one)"
            ))
        })?;
        Ok(hmac::Key::new(hmac::HMAC_SHA256, &bytes))
    }

    /// The caller a forwarded call names, when `metadata` is a forwarded call's:
    /// checked against the cell's forwarding key.
    pub(in crate::etcd_api) fn forwarded_caller(
        &self,
        metadata: &MetadataMap,
    ) -> Option<Result<Option<String>, Status>> {
        let who = metadata.get(FORWARDED_FOR)?;
        let refused = |why: &str| {
            Err(Status::unauthenticated(format!(
                "etcdserver: a call forwarded by another proxy {why}"
            )))
        };
        let Some(key) = self.peers.key.get() else {
            return Some(Err(Status::unavailable(
                "etcdserver: this proxy has not read the cell's forwarding key yet; try again",
            )));
        };
        let (Ok(who), Some(Ok(at)), Some(Ok(mac))) = (
            who.to_str(),
            metadata.get(FORWARDED_AT).map(|v| v.to_str()),
            metadata.get(FORWARDED_MAC).map(|v| v.to_str()),
        ) else {
            return Some(refused("lacks its signature"));
        };
        let signed = from_hex(mac)
            .is_some_and(|mac| hmac::verify(key, signed_text(who, at).as_bytes(), &mac).is_ok());
        if !signed {
            return Some(refused("is not signed with the cell's forwarding key"));
        }
        let at: u64 = at.parse().unwrap_or_default();
        if now_secs().abs_diff(at) > SIGNED_WITHIN.as_secs() {
            return Some(refused(&format!(
                "was signed {} s away from this proxy's clock (more than {} s): are the proxies' clocks set?",
                now_secs().abs_diff(at),
                SIGNED_WITHIN.as_secs()
            )));
        }
        let identity = from_hex(who).and_then(|b| String::from_utf8(b).ok());
        match identity {
            Some(identity) if !identity.is_empty() => Some(Ok(Some(identity))),
            Some(_) => Some(Ok(None)),
            None => Some(refused("names no identity")),
        }
    }
}

/// What a forwarded call's signature covers.
pub(super) fn signed_text(who: &str, at: &str) -> String {
    format!("lockcell-forwarded\n{who}\n{at}")
}

pub(super) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(super) fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(super) fn from_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}
