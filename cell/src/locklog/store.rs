//! What the lock log needs of a store ([`LockStore`]): etcd's transactions, reads and
//! puts. etcd's own client is one; [`super::memory::MemoryStore`] is the other, for
//! tests that run the lock log, and the proxy's runtime above it, without etcd.

use std::future::Future;
use std::pin::Pin;

use etcd_client::{GetOptions, GetResponse, KvClient, PutOptions, PutResponse, Txn, TxnResponse};

/// An answer of a [`LockStore`], on its way.
pub type StoreFuture<'a, T> =
    Pin<Box<dyn Future<Output = Result<T, etcd_client::Error>> + Send + 'a>>;

/// The calls the lock log makes: each is one etcd request, answered as etcd answers it.
pub trait LockStore: Send + Sync + 'static {
    fn txn(&self, txn: Txn) -> StoreFuture<'_, TxnResponse>;
    fn get(&self, key: Vec<u8>, options: Option<GetOptions>) -> StoreFuture<'_, GetResponse>;
    fn put(
        &self,
        key: Vec<u8>,
        value: Vec<u8>,
        options: Option<PutOptions>,
    ) -> StoreFuture<'_, PutResponse>;
}

// The calls name etcd's own methods: this trait's, of the same names, take `&self`
// and would be found first.
impl LockStore for KvClient {
    fn txn(&self, txn: Txn) -> StoreFuture<'_, TxnResponse> {
        let mut kv = self.clone();
        Box::pin(async move { KvClient::txn(&mut kv, txn).await })
    }

    fn get(&self, key: Vec<u8>, options: Option<GetOptions>) -> StoreFuture<'_, GetResponse> {
        let mut kv = self.clone();
        Box::pin(async move { KvClient::get(&mut kv, key, options).await })
    }

    fn put(
        &self,
        key: Vec<u8>,
        value: Vec<u8>,
        options: Option<PutOptions>,
    ) -> StoreFuture<'_, PutResponse> {
        let mut kv = self.clone();
        Box::pin(async move { KvClient::put(&mut kv, key, value, options).await })
    }
}
