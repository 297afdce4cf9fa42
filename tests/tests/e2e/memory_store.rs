//! The in-memory store (`MemoryStore`) against a real etcd: one seeded run of requests,
//! each sent to both through the lock log's store trait, every answer compared. After
//! each, both are read whole (they must not drift apart unseen) and read whole again
//! with the run's read options. Now and then a lease is revoked in both and granted
//! again.
//!
//! etcd starts with the cell's own records, so its revisions run ahead of the store's
//! by a constant: requests carry revisions relative to each store's revision at the
//! start, and answers are read back the same way. Both stores have the same leases.
//! `LOCKCELL_MEMORY_STORE_SEED` and `LOCKCELL_MEMORY_STORE_STEPS` change the run.
//!
//! Left out of the requests, as out of the store's scope (its module doc says why): a
//! delete whose range ends before its key, and a put keeping its value or lease after
//! a delete of every key from one onwards in the same transaction.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::ensure;
use etcd_client::{
    Compare, CompareOp, DeleteOptions, GetOptions, KeyValue, LeaseGrantOptions, PutOptions,
    SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse, TxnResponse,
};
use lockcell_cell::locklog::memory::{
    MemoryStore, DUPLICATE_KEY, EMPTY_KEY, FUTURE_REVISION, KEY_NOT_FOUND, LEASE_NOT_FOUND,
    LEASE_PROVIDED, MAX_TXN_OPS, TOO_MANY_OPS, VALUE_PROVIDED,
};
use lockcell_cell::locklog::LockStore;
use lockcell_tests::EtcdCluster;
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};

/// The run's seed and length, unless the environment names others.
const SEED: u64 = 0x6c6f_636b;
const STEPS: usize = 500;
/// Mismatches reported at most; the run stops at the first that leaves the stores apart.
const MOST_MISMATCHES: usize = 5;

/// The keys: one prefix, sorting after the cell's own records, two keys under a longer
/// prefix.
const PREFIX: &str = "~m/";
const KEYS: [&str; 6] = ["~m/a", "~m/b", "~m/ba", "~m/bb", "~m/c", "~m/d"];
const PREFIXES: [&str; 3] = ["~m/", "~m/b", "~m/c"];
const ENDS: [&str; 5] = ["~m/a", "~m/b", "~m/bb", "~m/c", "~m/z"];
const VALUES: [&str; 4] = ["", "v1", "v2", "w"];
/// Leases granted in both stores, and one granted in neither.
const LEASES: [i64; 2] = [0x6d01, 0x6d02];
const NO_SUCH_LEASE: i64 = 0x6dff;

pub async fn the_memory_store_answers_every_request_as_etcd_does() -> anyhow::Result<()> {
    let etcd = EtcdCluster::start_without_auth(1).await?;
    let client = etcd.client().await?;
    let kv = client.kv_client();
    let memory = MemoryStore::new();
    let mut leases = client.lease_client();
    for id in LEASES {
        leases
            .grant(600, Some(LeaseGrantOptions::new().with_id(id)))
            .await?;
        memory.grant_lease(id);
    }
    // Each store with its revision at the start.
    let stores: [(&dyn LockStore, i64); 2] =
        [(&kv, etcd.revision().await?), (&memory, memory.revision())];
    let seed = from_env("LOCKCELL_MEMORY_STORE_SEED")?.unwrap_or(SEED);
    let steps = from_env("LOCKCELL_MEMORY_STORE_STEPS")?.map_or(STEPS, |n| n as usize);
    let mut make = Maker::new(seed);
    let mut mismatches = Vec::new();
    let mut tally = Tally::default();
    let everything = Request::Get(PREFIX.into(), Read::of(Span::Prefix));
    for step in 0..steps {
        // Now and then a lease revoked, its keys gone in one revision, and granted
        // again.
        let step = match make.revoke() {
            Some(id) => {
                leases.revoke(id).await?;
                leases
                    .grant(600, Some(LeaseGrantOptions::new().with_id(id)))
                    .await?;
                memory.revoke_lease(id);
                memory.grant_lease(id);
                format!("{step} (after lease {id} was revoked and granted again)")
            }
            None => step.to_string(),
        };
        let request = make.request();
        let [on_etcd, in_memory] = answers(&stores, &request).await;
        tally.note(&on_etcd);
        if on_etcd != in_memory {
            mismatches.push(mismatch(&step, &request, &on_etcd, &in_memory));
        }
        // Every key after every step: the stores must not drift apart unseen.
        let [on_etcd, in_memory] = answers(&stores, &everything).await;
        if on_etcd != in_memory {
            mismatches.push(mismatch(&step, &everything, &on_etcd, &in_memory));
            break;
        }
        make.learn(on_etcd.map_err(anyhow::Error::msg)?);
        // And a read of every key as the run asks one: sorts, limits and filters see
        // all the keys there are.
        let probe = make.probe();
        let [on_etcd, in_memory] = answers(&stores, &probe).await;
        if on_etcd != in_memory {
            mismatches.push(mismatch(&step, &probe, &on_etcd, &in_memory));
        }
        if mismatches.len() >= MOST_MISMATCHES {
            break;
        }
    }
    ensure!(
        mismatches.is_empty(),
        "the memory store answered unlike etcd (seed {seed}; revisions are counted from \
         each store's at the start):\n\n{}",
        mismatches.join("\n\n")
    );
    eprintln!(
        "memory_store: etcd's answers over {steps} steps: {:?}",
        tally.0
    );
    tally.covers(&[
        "get",
        "put",
        "txn succeeded",
        "txn failed",
        "nested txn",
        DUPLICATE_KEY,
        LEASE_NOT_FOUND,
        KEY_NOT_FOUND,
        FUTURE_REVISION,
        EMPTY_KEY,
        VALUE_PROVIDED,
        LEASE_PROVIDED,
        TOO_MANY_OPS,
    ])
}

/// etcd's answers by kind: a refusal by its words, else the call and how it went.
#[derive(Default)]
struct Tally(BTreeMap<String, usize>);

impl Tally {
    fn note(&mut self, outcome: &Outcome) {
        let mut kinds = vec![match outcome {
            Err(words) => words.clone(),
            Ok(answer) => match &answer.reply {
                Reply::Range { .. } => "get".to_owned(),
                Reply::Put { .. } | Reply::Delete { .. } => "put".to_owned(),
                Reply::Txn { succeeded, .. } => match succeeded {
                    true => "txn succeeded".to_owned(),
                    false => "txn failed".to_owned(),
                },
            },
        }];
        if let Ok(Answer {
            reply: Reply::Txn { responses, .. },
            ..
        }) = outcome
        {
            if responses.iter().any(|r| matches!(r, Reply::Txn { .. })) {
                kinds.push("nested txn".to_owned());
            }
        }
        for kind in kinds {
            *self.0.entry(kind).or_default() += 1;
        }
    }

    /// Fails unless the run saw each of `kinds` (a refusal's words end its kind).
    fn covers(&self, kinds: &[&str]) -> anyhow::Result<()> {
        let missing: Vec<&&str> = kinds
            .iter()
            .filter(|kind| !self.0.keys().any(|k| k.ends_with(**kind)))
            .collect();
        ensure!(
            missing.is_empty(),
            "the run never had etcd answer {missing:?}; change its mix of requests"
        );
        Ok(())
    }
}

fn from_env(name: &str) -> anyhow::Result<Option<u64>> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(v.parse()?)),
        Err(_) => Ok(None),
    }
}

fn mismatch(step: &str, request: &Request, on_etcd: &Outcome, in_memory: &Outcome) -> String {
    format!("step {step}: {request:?}\n  etcd:   {on_etcd:?}\n  memory: {in_memory:?}")
}

async fn answers(stores: &[(&dyn LockStore, i64); 2], request: &Request) -> [Outcome; 2] {
    let [(etcd, etcd_base), (memory, memory_base)] = *stores;
    [
        ask(etcd, request, etcd_base).await,
        ask(memory, request, memory_base).await,
    ]
}

// ---- Requests, with revisions relative to a store's start ----

#[derive(Debug, Clone)]
enum Request {
    Get(String, Read),
    Put(String, String, Write),
    Txn(Tx),
    /// A transaction of `ops` reads, one level down when `nested`: etcd's limit on the
    /// operations of a transaction.
    Wide {
        ops: usize,
        nested: bool,
    },
}

#[derive(Debug, Clone, Copy, Default, PartialEq)]
enum Span {
    #[default]
    One,
    Prefix,
    FromKey,
    To(&'static str),
}

#[derive(Debug, Clone, Default)]
struct Read {
    span: Span,
    limit: i64,
    revision: i64,
    sort: Option<(SortTarget, SortOrder)>,
    keys_only: bool,
    count_only: bool,
    mod_revisions: (i64, i64),
    create_revisions: (i64, i64),
}

impl Read {
    fn of(span: Span) -> Self {
        Read {
            span,
            ..Read::default()
        }
    }
}

#[derive(Debug, Clone, Default)]
struct Write {
    lease: i64,
    prev_kv: bool,
    ignore_value: bool,
    ignore_lease: bool,
}

#[derive(Debug, Clone, Default)]
struct Tx {
    when: Vec<Cmp>,
    then: Vec<Op>,
    otherwise: Vec<Op>,
}

#[derive(Debug, Clone)]
enum Op {
    Get(String, Read),
    Put(String, String, Write),
    /// Key, range, prev_kv.
    Delete(String, Span, bool),
    Txn(Tx),
}

#[derive(Debug, Clone)]
struct Cmp {
    key: String,
    span: Span,
    target: Target,
    op: CompareOp,
}

#[derive(Debug, Clone)]
enum Target {
    Version(i64),
    Create(i64),
    Mod(i64),
    Value(String),
    Lease(i64),
}

/// Builds requests for one store, whose revision at the start was `base`.
struct Build {
    base: i64,
}

impl Build {
    /// A relative revision as the store's; 0 (none) stays 0.
    fn rev(&self, relative: i64) -> i64 {
        if relative > 0 {
            self.base + relative
        } else {
            relative
        }
    }

    fn get(&self, read: &Read) -> GetOptions {
        let mut o = match read.span {
            Span::One => GetOptions::new(),
            Span::Prefix => GetOptions::new().with_prefix(),
            Span::FromKey => GetOptions::new().with_from_key(),
            Span::To(end) => GetOptions::new().with_range(end),
        };
        o = o
            .with_limit(read.limit)
            .with_revision(self.rev(read.revision));
        if let Some((target, order)) = read.sort {
            o = o.with_sort(target, order);
        }
        if read.keys_only {
            o = o.with_keys_only();
        }
        if read.count_only {
            o = o.with_count_only();
        }
        o.with_min_mod_revision(self.rev(read.mod_revisions.0))
            .with_max_mod_revision(self.rev(read.mod_revisions.1))
            .with_min_create_revision(self.rev(read.create_revisions.0))
            .with_max_create_revision(self.rev(read.create_revisions.1))
    }

    fn put(write: &Write) -> PutOptions {
        let mut o = PutOptions::new().with_lease(write.lease);
        if write.prev_kv {
            o = o.with_prev_key();
        }
        if write.ignore_value {
            o = o.with_ignore_value();
        }
        if write.ignore_lease {
            o = o.with_ignore_lease();
        }
        o
    }

    fn txn(&self, tx: &Tx) -> Txn {
        let when: Vec<Compare> = tx.when.iter().map(|c| self.compare(c)).collect();
        let ops = |ops: &[Op]| -> Vec<TxnOp> { ops.iter().map(|op| self.op(op)).collect() };
        Txn::new()
            .when(when)
            .and_then(ops(&tx.then))
            .or_else(ops(&tx.otherwise))
    }

    fn op(&self, op: &Op) -> TxnOp {
        match op {
            Op::Get(key, read) => TxnOp::get(key.as_str(), Some(self.get(read))),
            Op::Put(key, value, write) => {
                TxnOp::put(key.as_str(), value.as_str(), Some(Self::put(write)))
            }
            Op::Delete(key, span, prev_kv) => {
                let mut o = match span {
                    Span::One => DeleteOptions::new(),
                    Span::Prefix => DeleteOptions::new().with_prefix(),
                    Span::FromKey => DeleteOptions::new().with_from_key(),
                    Span::To(end) => DeleteOptions::new().with_range(*end),
                };
                if *prev_kv {
                    o = o.with_prev_key();
                }
                TxnOp::delete(key.as_str(), Some(o))
            }
            Op::Txn(tx) => TxnOp::txn(self.txn(tx)),
        }
    }

    fn compare(&self, c: &Cmp) -> Compare {
        let key = c.key.as_str();
        let compare = match &c.target {
            Target::Version(v) => Compare::version(key, c.op, *v),
            Target::Create(r) => Compare::create_revision(key, c.op, self.rev(*r)),
            Target::Mod(r) => Compare::mod_revision(key, c.op, self.rev(*r)),
            Target::Value(v) => Compare::value(key, c.op, v.as_str()),
            Target::Lease(l) => Compare::lease(key, c.op, *l),
        };
        match c.span {
            Span::One => compare,
            Span::Prefix => compare.with_prefix(),
            Span::FromKey => compare.with_range("\0"),
            Span::To(end) => compare.with_range(end),
        }
    }

    fn wide(ops: usize, nested: bool) -> Txn {
        let reads: Vec<TxnOp> = (0..ops).map(|_| TxnOp::get(KEYS[0], None)).collect();
        match nested {
            false => Txn::new().and_then(reads),
            true => Txn::new().and_then([TxnOp::txn(Txn::new().and_then(reads))]),
        }
    }
}

// ---- Answers, with revisions relative to a store's start ----

/// An answer, or the refusal's code and words.
type Outcome = Result<Answer, String>;

#[derive(Debug, PartialEq)]
struct Answer {
    revision: Option<i64>,
    reply: Reply,
}

#[derive(Debug, PartialEq)]
enum Reply {
    Range {
        kvs: Vec<Kv>,
        count: i64,
        more: bool,
    },
    Put {
        prev_kv: Option<Kv>,
    },
    Delete {
        deleted: i64,
        prev_kvs: Vec<Kv>,
    },
    Txn {
        succeeded: bool,
        responses: Vec<Reply>,
    },
}

#[derive(Debug, Clone, PartialEq)]
struct Kv {
    key: String,
    value: String,
    create: i64,
    modified: i64,
    version: i64,
    lease: i64,
}

fn kv(kv: &KeyValue, base: i64) -> Kv {
    Kv {
        key: String::from_utf8_lossy(kv.key()).into_owned(),
        value: String::from_utf8_lossy(kv.value()).into_owned(),
        create: kv.create_revision() - base,
        modified: kv.mod_revision() - base,
        version: kv.version(),
        lease: kv.lease(),
    }
}

fn txn_reply(txn: &TxnResponse, base: i64) -> Reply {
    let responses = txn
        .op_responses()
        .iter()
        .map(|r| match r {
            TxnOpResponse::Get(g) => Reply::Range {
                kvs: g.kvs().iter().map(|k| kv(k, base)).collect(),
                count: g.count(),
                more: g.more(),
            },
            TxnOpResponse::Put(p) => Reply::Put {
                prev_kv: p.prev_key().map(|k| kv(k, base)),
            },
            TxnOpResponse::Delete(d) => Reply::Delete {
                deleted: d.deleted(),
                prev_kvs: d.prev_kvs().iter().map(|k| kv(k, base)).collect(),
            },
            TxnOpResponse::Txn(t) => txn_reply(t, base),
        })
        .collect();
    Reply::Txn {
        succeeded: txn.succeeded(),
        responses,
    }
}

async fn ask(store: &dyn LockStore, request: &Request, base: i64) -> Outcome {
    let build = Build { base };
    let revision = |h: Option<&etcd_client::ResponseHeader>| h.map(|h| h.revision() - base);
    let answer = match request {
        Request::Get(key, read) => {
            let options = Some(build.get(read));
            store
                .get(key.clone().into(), options)
                .await
                .map(|g| Answer {
                    revision: revision(g.header()),
                    reply: Reply::Range {
                        kvs: g.kvs().iter().map(|k| kv(k, base)).collect(),
                        count: g.count(),
                        more: g.more(),
                    },
                })
        }
        Request::Put(key, value, write) => {
            let options = Some(Build::put(write));
            let put = store.put(key.clone().into(), value.clone().into(), options);
            put.await.map(|p| Answer {
                revision: revision(p.header()),
                reply: Reply::Put {
                    prev_kv: p.prev_key().map(|k| kv(k, base)),
                },
            })
        }
        Request::Txn(tx) => store.txn(build.txn(tx)).await.map(|t| Answer {
            revision: revision(t.header()),
            reply: txn_reply(&t, base),
        }),
        Request::Wide { ops, nested } => {
            let txn = store.txn(Build::wide(*ops, *nested)).await;
            txn.map(|t| Answer {
                revision: revision(t.header()),
                reply: txn_reply(&t, base),
            })
        }
    };
    answer.map_err(|e| match e {
        etcd_client::Error::GRpcStatus(s) => format!("{:?}: {}", s.code(), s.message()),
        e => format!("not a refusal: {e}"),
    })
}

// ---- The seeded run ----

/// Makes requests from a seed, knowing the keys as they are now (from etcd's answers)
/// to aim compares and revisions where they tell something.
struct Maker {
    rng: StdRng,
    now: i64,
    kvs: Vec<Kv>,
}

/// What a transaction being made has written, and whether it may delete from a key
/// onwards (then none of its puts keeps a value or lease).
#[derive(Default)]
struct Writes {
    keys: BTreeSet<String>,
    from_key: bool,
}

impl Maker {
    fn new(seed: u64) -> Self {
        Maker {
            rng: StdRng::seed_from_u64(seed),
            now: 0,
            kvs: Vec::new(),
        }
    }

    /// Every key and the revision after a step.
    fn learn(&mut self, everything: Answer) {
        self.now = everything.revision.unwrap_or(self.now);
        if let Reply::Range { kvs, .. } = everything.reply {
            self.kvs = kvs;
        }
    }

    fn chance(&mut self, p: f64) -> bool {
        self.rng.random_bool(p)
    }

    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        *from.choose(&mut self.rng).expect("something to pick")
    }

    fn request(&mut self) -> Request {
        match self.rng.random_range(0..100) {
            0..18 => {
                let (key, read) = self.read();
                Request::Get(key, read)
            }
            18..40 => {
                let key = self.key(true);
                let (value, write) = self.write(true);
                Request::Put(key, value, write)
            }
            40..86 => {
                let mut writes = Writes {
                    from_key: self.chance(0.3),
                    ..Writes::default()
                };
                Request::Txn(self.tx(0, &mut writes))
            }
            86..95 => Request::Txn(self.twice()),
            95..97 => self.refused(),
            _ => Request::Wide {
                ops: self.rng.random_range(MAX_TXN_OPS - 1..=MAX_TXN_OPS + 1),
                nested: self.chance(0.5),
            },
        }
    }

    /// A lease to revoke (and grant again) before the next request, now and then.
    fn revoke(&mut self) -> Option<i64> {
        match self.chance(0.03) {
            true => Some(self.pick(&LEASES)),
            false => None,
        }
    }

    /// A key, now and then the empty one (etcd refuses it) when `empty` may be.
    fn key(&mut self, empty: bool) -> String {
        if empty && self.chance(0.015) {
            return String::new();
        }
        self.pick(&KEYS).to_owned()
    }

    fn span(&mut self) -> Span {
        match self.rng.random_range(0..100) {
            0..45 => Span::One,
            45..65 => Span::Prefix,
            65..80 => Span::FromKey,
            _ => Span::To(self.pick(&ENDS)),
        }
    }

    fn span_key(&mut self, span: Span) -> String {
        match span {
            Span::Prefix => self.pick(&PREFIXES).to_owned(),
            span => self.key(span == Span::One),
        }
    }

    /// A revision worth comparing with: a key's, one off it, or any up to the next.
    fn revision(&mut self) -> i64 {
        if !self.kvs.is_empty() && self.chance(0.6) {
            let kv = self.kvs.choose(&mut self.rng).expect("a key").clone();
            let r = if self.chance(0.5) {
                kv.create
            } else {
                kv.modified
            };
            return r + self.rng.random_range(-1..=1);
        }
        self.rng.random_range(0..=self.now + 1)
    }

    /// A read of every key, with the options the run picks.
    fn probe(&mut self) -> Request {
        let (_, read) = self.read();
        Request::Get(
            PREFIX.into(),
            Read {
                span: Span::Prefix,
                ..read
            },
        )
    }

    fn read(&mut self) -> (String, Read) {
        let span = self.span();
        let mut read = Read::of(span);
        if self.chance(0.4) {
            read.limit = self.rng.random_range(-1..=4);
        }
        if self.chance(0.3) {
            // A past revision, now and then one still to come.
            read.revision = match self.chance(0.1) {
                true => self.now + 1,
                false => self.rng.random_range(1..=self.now.max(1)),
            };
        }
        if self.chance(0.5) {
            let target = self.pick(&[
                SortTarget::Key,
                SortTarget::Version,
                SortTarget::Create,
                SortTarget::Mod,
                SortTarget::Value,
            ]);
            // No order named: etcd sorts by a target other than the key all the same.
            let order = self.pick(&[
                SortOrder::None,
                SortOrder::None,
                SortOrder::Ascend,
                SortOrder::Descend,
            ]);
            read.sort = Some((target, order));
        }
        read.keys_only = self.chance(0.15);
        read.count_only = self.chance(0.15);
        let bound = |m: &mut Self| {
            if m.chance(0.1) {
                m.revision().max(0)
            } else {
                0
            }
        };
        read.mod_revisions = (bound(self), bound(self));
        read.create_revisions = (bound(self), bound(self));
        (self.span_key(span), read)
    }

    /// A put's value and options; `ignore` lets it keep the key's value or lease.
    fn write(&mut self, ignore: bool) -> (String, Write) {
        let lease = match self.rng.random_range(0..100) {
            0..62 => 0,
            62..78 => LEASES[0],
            78..92 => LEASES[1],
            _ => NO_SUCH_LEASE,
        };
        let mut write = Write {
            lease,
            prev_kv: self.chance(0.5),
            ignore_value: ignore && self.chance(0.12),
            ignore_lease: ignore && self.chance(0.12),
        };
        // etcd refuses a value with ignore_value and a lease with ignore_lease.
        let value = match write.ignore_value && self.chance(0.8) {
            true => String::new(),
            false => self.pick(&VALUES).to_owned(),
        };
        if write.ignore_lease && self.chance(0.8) {
            write.lease = 0;
        }
        (value, write)
    }

    fn compare(&mut self) -> Cmp {
        let span = match self.rng.random_range(0..100) {
            0..70 => Span::One,
            70..80 => Span::Prefix,
            80..90 => Span::FromKey,
            _ => Span::To(self.pick(&ENDS)),
        };
        let key = self.span_key(span);
        let known = self.kvs.iter().find(|kv| kv.key == key).cloned();
        let near = |m: &mut Self, n: Option<i64>| match n {
            Some(n) if m.chance(0.7) => n + m.rng.random_range(-1..=1),
            _ => m.rng.random_range(0..=2),
        };
        let target = match self.rng.random_range(0..5) {
            0 => Target::Version(near(self, known.as_ref().map(|kv| kv.version))),
            1 => Target::Create(match known.as_ref() {
                Some(kv) if self.chance(0.7) => kv.create + self.rng.random_range(-1..=1),
                _ => self.revision(),
            }),
            2 => Target::Mod(match known.as_ref() {
                Some(kv) if self.chance(0.7) => kv.modified + self.rng.random_range(-1..=1),
                _ => self.revision(),
            }),
            3 => Target::Value(match known.as_ref() {
                Some(kv) if self.chance(0.5) => kv.value.clone(),
                _ => self.pick(&VALUES).to_owned(),
            }),
            _ => Target::Lease(self.pick(&[0, 0, LEASES[0], LEASES[1]])),
        };
        let op = self.pick(&[
            CompareOp::Equal,
            CompareOp::NotEqual,
            CompareOp::Greater,
            CompareOp::Less,
        ]);
        Cmp {
            key,
            span,
            target,
            op,
        }
    }

    fn tx(&mut self, depth: usize, writes: &mut Writes) -> Tx {
        let compares = self.pick(&[0, 1, 1, 1, 2, 2, 3]);
        let when = (0..compares).map(|_| self.compare()).collect();
        let then = self.rng.random_range(0..=4);
        let otherwise = self.rng.random_range(0..=3);
        Tx {
            when,
            then: (0..then).map(|_| self.op(depth, writes)).collect(),
            otherwise: (0..otherwise).map(|_| self.op(depth, writes)).collect(),
        }
    }

    fn op(&mut self, depth: usize, writes: &mut Writes) -> Op {
        match self.rng.random_range(0..100) {
            0..30 => {
                let (key, read) = self.read();
                Op::Get(key, read)
            }
            30..65 => {
                let key = self.write_key(writes);
                let (value, write) = self.write(!writes.from_key);
                Op::Put(key, value, write)
            }
            65..85 => self.delete(writes),
            _ if depth < 2 => Op::Txn(self.tx(depth + 1, writes)),
            _ => {
                let (key, read) = self.read();
                Op::Get(key, read)
            }
        }
    }

    /// A key to put: mostly one the transaction has not written yet (etcd refuses a
    /// transaction that writes a key twice; now and then it should).
    fn write_key(&mut self, writes: &mut Writes) -> String {
        let fresh: Vec<&str> = KEYS
            .into_iter()
            .filter(|k| !writes.keys.contains(*k))
            .collect();
        let key = match fresh.is_empty() || self.chance(0.2) {
            true => self.key(true),
            false => self.pick(&fresh).to_owned(),
        };
        writes.keys.insert(key.clone());
        key
    }

    fn delete(&mut self, writes: &mut Writes) -> Op {
        let span = match self.span() {
            Span::FromKey if !writes.from_key => Span::Prefix,
            span => span,
        };
        let prev_kv = self.chance(0.5);
        if span == Span::One {
            return Op::Delete(self.write_key(writes), span, prev_kv);
        }
        let key = self.span_key(span);
        // Never a range that ends before its key.
        let span = match span {
            Span::To(end) if end <= key.as_str() => Span::To("~m/z"),
            span => span,
        };
        for k in KEYS.into_iter().filter(|k| covers(&key, span, k)) {
            writes.keys.insert(k.to_owned());
        }
        Op::Delete(key, span, prev_kv)
    }

    /// A transaction that writes one key twice, in one of the ways etcd refuses or
    /// lets through.
    fn twice(&mut self) -> Tx {
        let key = self.pick(&KEYS).to_owned();
        let put = |m: &mut Self| {
            let (value, write) = m.write(false);
            Op::Put(key.clone(), value, write)
        };
        let delete = |m: &mut Self| Op::Delete(key.clone(), Span::One, m.chance(0.5));
        let nested = |m: &mut Self, op: Op| {
            let compares = m.rng.random_range(0..=1);
            Op::Txn(Tx {
                when: (0..compares).map(|_| m.compare()).collect(),
                then: vec![op],
                otherwise: Vec::new(),
            })
        };
        let (a, b) = (put(self), put(self));
        let (c, d) = (delete(self), delete(self));
        let mut ops = match self.rng.random_range(0..11) {
            0 => vec![a, b],
            1 => vec![a, c],
            2 => vec![c, d],
            3 => vec![Op::Txn(Tx {
                when: vec![self.compare()],
                then: vec![a],
                otherwise: vec![b],
            })],
            4 => vec![nested(self, a), nested(self, b)],
            5 => vec![nested(self, a), c],
            6 => vec![a, nested(self, c)],
            7 => vec![nested(self, a), nested(self, c)],
            8 => vec![nested(self, c), nested(self, a)],
            9 => {
                let upto = KEYS.iter().position(|k| *k == key).unwrap_or(0);
                let from = self.pick(&KEYS[..=upto]).to_owned();
                vec![Op::Delete(from, Span::FromKey, true), a]
            }
            _ => vec![Op::Delete(PREFIX.to_owned(), Span::Prefix, true), a],
        };
        if self.chance(0.3) {
            ops.reverse();
        }
        if self.chance(0.3) {
            let (key, read) = self.read();
            ops.insert(self.rng.random_range(0..=ops.len()), Op::Get(key, read));
        }
        let compares = self.rng.random_range(0..=1);
        Tx {
            when: (0..compares).map(|_| self.compare()).collect(),
            then: ops,
            otherwise: Vec::new(),
        }
    }

    /// A request etcd refuses on two counts: which one it names tells the order of its
    /// checks. A lone put keeping the value of a key not there on a lease not there, or
    /// a transaction reading a revision still to come and putting on such a lease or
    /// keeping such a value, in either order.
    fn refused(&mut self) -> Request {
        let absent: Vec<&str> = KEYS
            .into_iter()
            .filter(|k| !self.kvs.iter().any(|kv| kv.key == *k))
            .collect();
        let key = match absent.is_empty() {
            true => self.pick(&KEYS),
            false => self.pick(&absent),
        };
        let put = |lease: i64, ignore_value: bool| {
            let write = Write {
                lease,
                ignore_value,
                ..Write::default()
            };
            Op::Put(key.to_owned(), String::new(), write)
        };
        if self.chance(0.4) {
            let write = Write {
                lease: NO_SUCH_LEASE,
                ignore_value: true,
                ..Write::default()
            };
            return Request::Put(key.to_owned(), String::new(), write);
        }
        let put = match self.chance(0.5) {
            true => put(NO_SUCH_LEASE, false),
            false => put(0, true),
        };
        let read = Read {
            revision: self.now + 1,
            ..Read::of(Span::Prefix)
        };
        let mut then = vec![Op::Get(PREFIX.to_owned(), read), put];
        if self.chance(0.5) {
            then.reverse();
        }
        Request::Txn(Tx {
            then,
            ..Tx::default()
        })
    }
}

/// Whether a request over `key` and `span` takes in key `k`.
fn covers(key: &str, span: Span, k: &str) -> bool {
    match span {
        Span::One => k == key,
        Span::Prefix => k.starts_with(key),
        Span::FromKey => k >= key,
        Span::To(end) => k >= key && k < end,
    }
}
