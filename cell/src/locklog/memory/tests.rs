//! The store answers as etcd does, for what the lock log relies on.

use etcd_client::{
    Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse,
};

use super::*;

fn put(store: &MemoryStore, key: &str, value: &str, lease: i64) -> i64 {
    let options = (lease != 0).then(|| PutOptions::new().with_lease(lease));
    answered(store.put(key.into(), value.into(), options))
        .expect("put")
        .header()
        .expect("a header")
        .revision()
}

/// The store answers at once: its futures are ready when made.
fn answered<T>(future: StoreFuture<'_, T>) -> Result<T, etcd_client::Error> {
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    let mut future = future;
    match future.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(answer) => answer,
        std::task::Poll::Pending => unreachable!("the store answers at once"),
    }
}

fn txn(store: &MemoryStore, txn: Txn) -> Result<TxnResponse, etcd_client::Error> {
    answered(store.txn(txn))
}

fn refused_with(answer: Result<TxnResponse, etcd_client::Error>, words: &str) -> bool {
    matches!(answer, Err(etcd_client::Error::GRpcStatus(s)) if s.message() == words)
}

#[test]
fn one_revision_per_write_and_keys_keep_their_create_revision() {
    let store = MemoryStore::new();
    let first = put(&store, "k", "1", 0);
    let second = put(&store, "k", "2", 0);
    assert_eq!(second, first + 1);
    let kv = store.key("k").unwrap();
    assert_eq!(
        (kv.create_revision, kv.mod_revision, kv.version),
        (first, second, 2)
    );
    let both = txn(
        &store,
        Txn::new().and_then([TxnOp::put("a", "x", None), TxnOp::put("b", "y", None)]),
    )
    .unwrap();
    let at = both.header().unwrap().revision();
    assert_eq!(at, second + 1, "one transaction, one revision");
    assert_eq!(
        store.key("a").unwrap().mod_revision,
        store.key("b").unwrap().mod_revision
    );
    // A transaction that writes nothing takes no revision.
    let none = txn(&store, Txn::new().and_then([TxnOp::delete("absent", None)])).unwrap();
    assert_eq!(none.header().unwrap().revision(), at);
}

#[test]
fn compares_read_as_etcd_reads_them() {
    let store = MemoryStore::new();
    let created = put(&store, "k", "v", 0);
    let holds = |compare: Compare| txn(&store, Txn::new().when([compare])).unwrap().succeeded();
    assert!(holds(Compare::create_revision(
        "k",
        CompareOp::Equal,
        created
    )));
    assert!(holds(Compare::create_revision(
        "absent",
        CompareOp::Equal,
        0
    )));
    assert!(holds(Compare::version("absent", CompareOp::Equal, 0)));
    assert!(
        !holds(Compare::value("absent", CompareOp::NotEqual, "v")),
        "a value compare on no key fails"
    );
    assert!(holds(Compare::value("k", CompareOp::Equal, "v")));
    assert!(holds(Compare::mod_revision(
        "k",
        CompareOp::Less,
        created + 1
    )));
    assert!(holds(Compare::lease("k", CompareOp::Equal, 0)));
    put(&store, "k2", "v", 0);
    assert!(
        holds(Compare::version("k", CompareOp::Equal, 1).with_range("l")),
        "a compare over a range holds for every key in it"
    );
    put(&store, "k2", "w", 0);
    assert!(!holds(
        Compare::version("k", CompareOp::Equal, 1).with_range("l")
    ));
}

#[test]
fn nested_compares_see_the_state_before_the_transaction() {
    let store = MemoryStore::new();
    let nested = Txn::new()
        .when([Compare::version("k", CompareOp::Equal, 0)])
        .and_then([TxnOp::put("seen-absent", "1", None)]);
    let done = txn(
        &store,
        Txn::new().and_then([TxnOp::put("k", "v", None), TxnOp::txn(nested)]),
    )
    .unwrap();
    assert!(matches!(&done.op_responses()[1], TxnOpResponse::Txn(t) if t.succeeded()));
    assert!(store.key("seen-absent").is_some());
}

#[test]
fn a_request_writing_one_key_twice_or_on_no_lease_writes_nothing() {
    let store = MemoryStore::new();
    let twice = Txn::new().and_then([TxnOp::put("k", "1", None), TxnOp::delete("k", None)]);
    assert!(refused_with(txn(&store, twice), DUPLICATE_KEY));
    let nested = |key: &str| TxnOp::txn(Txn::new().and_then([TxnOp::put(key, "1", None)]));
    let across = Txn::new().and_then([nested("m"), nested("m")]);
    assert!(refused_with(txn(&store, across), DUPLICATE_KEY));
    let branches = Txn::new().and_then([TxnOp::txn(
        Txn::new()
            .when([Compare::version("k", CompareOp::Equal, 0)])
            .and_then([TxnOp::put("k", "then", None)])
            .or_else([TxnOp::put("k", "else", None)]),
    )]);
    assert!(
        txn(&store, branches).is_ok(),
        "only one branch of a nested Txn runs"
    );
    let leased = Txn::new().and_then([
        TxnOp::put("free", "1", None),
        TxnOp::put("leased", "1", Some(PutOptions::new().with_lease(7))),
    ]);
    assert!(refused_with(txn(&store, leased.clone()), LEASE_NOT_FOUND));
    assert!(store.key("free").is_none());
    store.grant_lease(7);
    txn(&store, leased).unwrap();
    assert_eq!(store.revoke_lease(7), 1);
    assert!(store.key("leased").is_none() && store.key("free").is_some());
}

#[test]
fn ranges_sort_limit_count_and_read_the_past() {
    let store = MemoryStore::new();
    let at_a = put(&store, "q/a", "1", 0);
    put(&store, "q/c", "2", 0);
    put(&store, "q/b", "3", 0);
    let get = |options: GetOptions| {
        answered(store.get(b"q/".to_vec(), Some(options.with_prefix()))).unwrap()
    };
    let newest = get(GetOptions::new()
        .with_sort(SortTarget::Create, SortOrder::Descend)
        .with_limit(2));
    let keys: Vec<&[u8]> = newest.kvs().iter().map(|kv| kv.key()).collect();
    assert_eq!(keys, [b"q/b".as_slice(), b"q/c"]);
    assert!(newest.more());
    assert_eq!(newest.count(), 3);
    let before = get(GetOptions::new().with_max_create_revision(at_a));
    assert_eq!(before.kvs().len(), 1);
    let past = get(GetOptions::new().with_revision(at_a));
    assert_eq!(
        past.kvs().len(),
        1,
        "a read at a past revision sees that revision"
    );
    let future = answered(store.get(b"q/".to_vec(), Some(GetOptions::new().with_revision(99))));
    assert!(
        matches!(future, Err(etcd_client::Error::GRpcStatus(s)) if s.message() == FUTURE_REVISION)
    );
}

#[test]
fn an_answer_lost_is_a_write_applied() {
    let store = MemoryStore::new();
    store.lose_answers(1);
    assert!(txn(&store, Txn::new().and_then([TxnOp::put("k", "v", None)])).is_err());
    assert!(store.key("k").is_some());
    assert!(txn(&store, Txn::new().and_then([TxnOp::put("k", "w", None)])).is_ok());
}

#[test]
fn etcds_own_checks_refuse_a_request_before_anything_is_written() {
    let store = MemoryStore::new();
    let empty = Txn::new().and_then([TxnOp::put("", "v", None)]);
    assert!(refused_with(txn(&store, empty), EMPTY_KEY));
    let keep = PutOptions::new().with_ignore_value();
    let missing = Txn::new().and_then([TxnOp::put("absent", "", Some(keep))]);
    assert!(refused_with(txn(&store, missing), KEY_NOT_FOUND));
    put(&store, "k", "v", 0);
    let given = Txn::new().and_then([TxnOp::put(
        "k",
        "w",
        Some(PutOptions::new().with_ignore_value()),
    )]);
    assert!(refused_with(txn(&store, given), VALUE_PROVIDED));
    let many: Vec<TxnOp> = (0..=MAX_TXN_OPS)
        .map(|i| TxnOp::get(format!("k{i}"), None))
        .collect();
    assert!(refused_with(
        txn(&store, Txn::new().and_then(many)),
        TOO_MANY_OPS
    ));
    let revision = store.revision();
    // A delete from a key onwards writes no key twice, as etcd reads it.
    let onwards = Txn::new().and_then([
        TxnOp::delete("a", Some(etcd_client::DeleteOptions::new().with_from_key())),
        TxnOp::put("z", "v", None),
    ]);
    assert!(txn(&store, onwards).is_ok());
    assert_eq!(store.revision(), revision + 1);
}
