//! Small keys: read, conditional write, delete, multi-key compare-and-swap ([`Txn`]);
//! and ephemeral keys that live as long as the session that wrote them (membership:
//! "this process is alive").

use lockcell_proto::v1::condition::When;
use lockcell_proto::v1::kv_client::KvClient;
use lockcell_proto::v1::txn_write::Op;
use lockcell_proto::v1::{
    Compare, Condition as WireCondition, DeleteRequest, GetRequest, KeyValue, PutRequest,
    TxnRequest, TxnWrite,
};

use crate::client::{Client, UNARY_TIMEOUT};
use crate::error::{Call, Error};
use crate::session::Session;

/// When a write applies.
///
/// ```no_run
/// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
/// use lockcell_client::Condition;
///
/// // The first deployment to get here sets the default rate; later ones leave it.
/// client
///     .put("config/rates/eu", b"100", Condition::Absent)
///     .await?;
/// // Raise it only if nobody changed it since it was read (compare-and-swap).
/// if let Some(rate) = client.get("config/rates/eu").await? {
///     let raise = Condition::ModRevision(rate.mod_revision);
///     let written = client.put("config/rates/eu", b"110", raise).await?;
///     if !written.succeeded {
///         // Someone else wrote it first: `written.current` is what they wrote.
///     }
/// }
/// # Ok(()) }
/// ```
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
///
/// ```no_run
/// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
/// if let Some(entry) = client.get("config/rates/eu").await? {
///     let rate = String::from_utf8_lossy(&entry.value);
///     println!(
///         "{} = {rate} (written {} times, last at revision {})",
///         entry.key, entry.version, entry.mod_revision
///     );
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The key's name.
    pub key: String,
    /// Its value.
    pub value: Vec<u8>,
    /// The store revision that created the key.
    pub create_revision: i64,
    /// The store revision of the key's last write: what [`Condition::ModRevision`]
    /// compares.
    pub mod_revision: i64,
    /// How many times the key has been written since it was created: what
    /// [`Condition::Version`] compares.
    pub version: i64,
    /// True for an ephemeral key.
    pub ephemeral: bool,
}

/// A revision and the cell it is a revision of: where a read stood, and where a watch
/// goes on from ([`WatchOptions::after`](crate::WatchOptions::after)). Revisions of two
/// cells are unrelated, and a prefix can move from one cell to another (or a cell be
/// restored from a backup) between a read and the watch that follows it; the cell makes
/// the watch end with [`Error::WatchMoved`] then, rather than read one cell's revision
/// in another.
///
/// Written as `REVISION@CELL` (`Display`, `FromStr`), for scripts and files; a bare
/// `REVISION` parses with no cell (not checked). A cell is `CLUSTER/EPOCH/ROUTE-EPOCH`.
///
/// ```
/// # fn main() -> Result<(), String> {
/// use lockcell_client::CellRevision;
///
/// // A position saved by an earlier run (`Watcher::at`, or `lockctl get --position`).
/// let at: CellRevision = "4521@6a1f/1796184997/0".parse()?;
/// assert_eq!(at.revision, 4521);
/// assert_eq!(at.cell, "6a1f/1796184997/0");
/// assert_eq!(at.to_string(), "4521@6a1f/1796184997/0");
/// // A bare revision has no cell: a watch after it cannot tell a move.
/// assert_eq!("4521".parse::<CellRevision>()?.cell, "");
/// assert!("4521@".parse::<CellRevision>().is_err());
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct CellRevision {
    /// A revision of the cell's store.
    pub revision: i64,
    /// The cell's position: its cluster id, epoch and route epoch (empty: unknown).
    pub cell: String,
}

impl std::fmt::Display for CellRevision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.cell.is_empty() {
            write!(f, "{}", self.revision)
        } else {
            write!(f, "{}@{}", self.revision, self.cell)
        }
    }
}

impl std::str::FromStr for CellRevision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (revision, cell) = s.split_once('@').unwrap_or((s, ""));
        let revision = revision
            .parse::<i64>()
            .ok()
            .filter(|r| *r >= 0)
            .ok_or_else(|| {
                format!("{s:?} is not a position: expected REVISION or REVISION@CELL, REVISION a number of 0 or more")
            })?;
        let parts: Vec<&str> = cell.split('/').collect();
        let well_formed = match &parts[..] {
            [""] => !s.contains('@'),
            [cluster, epoch, route] => {
                !cluster.is_empty()
                    && cluster
                        .bytes()
                        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
                    && epoch.parse::<u64>().is_ok()
                    && route.parse::<u64>().is_ok()
            }
            _ => false,
        };
        if !well_formed {
            return Err(format!(
                "{s:?} is not a position: after '@' comes a cell as reads give it, CLUSTER/EPOCH/ROUTE-EPOCH (lowercase hex, then two numbers)"
            ));
        }
        Ok(CellRevision {
            revision,
            cell: cell.to_owned(),
        })
    }
}

/// A linearizable read with the position it reflects: every key it found, and the
/// revision (of its cell) it was made at. Watch from [`Snapshot::at`] to follow on
/// with nothing missed and nothing twice.
///
/// ```no_run
/// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
/// let snapshot = client.snapshot_prefix("config/rates/").await?;
/// for entry in &snapshot.entries {
///     println!("{} = {}", entry.key, String::from_utf8_lossy(&entry.value));
/// }
/// // `REVISION@CELL`: saved, a later run watches on from here.
/// println!("as of {}", snapshot.at);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// Every key found (none: nothing there).
    pub entries: Vec<Entry>,
    /// The position the read reflects.
    pub at: CellRevision,
}

/// What a write did.
///
/// ```no_run
/// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
/// use lockcell_client::Condition;
///
/// let written = client
///     .put("config/rates/eu", b"100", Condition::Absent)
///     .await?;
/// if !written.succeeded {
///     if let Some(current) = &written.current {
///         println!("already set, at revision {}", current.mod_revision);
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Written {
    /// False when the condition did not hold; nothing was written.
    pub succeeded: bool,
    /// The store revision after the call.
    pub revision: i64,
    /// The key after the write, or as it was when the condition failed. To a caller
    /// who may write the key but not read it, without its value (empty) and never
    /// `ephemeral`: its revisions and version only.
    pub current: Option<Entry>,
}

/// A small multi-key compare-and-swap, sent with [`Client::commit`]: when every
/// condition holds, every write is done at one revision; otherwise nothing is written.
/// It moves a value between keys, or updates keys that must agree, with no lock.
///
/// The proxy refuses (as [`Error::InvalidArgument`], naming the key or the limit) a
/// transaction with no write, a key written twice, a condition of
/// [`Condition::Always`] (it compares nothing), a value over its size limit, or more
/// than 64 conditions and writes together.
///
/// ```no_run
/// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
/// use lockcell_client::{Condition, Txn};
///
/// let from = client.get("acct/a").await?.expect("acct/a exists");
/// let to = client.get("acct/b").await?.expect("acct/b exists");
/// let txn = Txn::new()
///     .when("acct/a", Condition::ModRevision(from.mod_revision))
///     .when("acct/b", Condition::ModRevision(to.mod_revision))
///     .put("acct/a", b"0")
///     .put("acct/b", b"100");
/// let outcome = client.commit(txn).await?;
/// if !outcome.succeeded {
///     // Someone else moved first: `outcome.current` is where things stand now.
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
#[must_use = "a transaction does nothing until it is committed"]
pub struct Txn {
    request: TxnRequest,
}

impl Txn {
    /// An empty transaction.
    ///
    /// ```
    /// use lockcell_client::Txn;
    ///
    /// // One rate per region, all written at one revision.
    /// let mut txn = Txn::new();
    /// for region in ["eu", "us", "ca"] {
    ///     txn = txn.put(&format!("config/rates/{region}"), b"100");
    /// }
    /// ```
    pub fn new() -> Self {
        Txn::default()
    }

    /// Makes the writes depend on `key` meeting `condition`.
    ///
    /// ```
    /// use lockcell_client::{Condition, Txn};
    ///
    /// // Publish the new rates only while the schema they follow is still version 3.
    /// let txn = Txn::new()
    ///     .when("config/rates/schema", Condition::Version(3))
    ///     .put("config/rates/eu", b"110")
    ///     .put("config/rates/us", b"120");
    /// ```
    pub fn when(mut self, key: &str, condition: Condition) -> Self {
        self.request.compares.push(Compare {
            key: key.to_owned(),
            condition: wire(condition),
        });
        self
    }

    /// Writes `value` to `key` (never ephemeral).
    ///
    /// ```
    /// use lockcell_client::{Condition, Txn};
    ///
    /// # let pool_revision = 41;
    /// // Switch the web backends to the green pool and drain the blue one together,
    /// // unless the pool changed since it was read.
    /// let txn = Txn::new()
    ///     .when("config/web/pool", Condition::ModRevision(pool_revision))
    ///     .put("config/web/pool", b"green")
    ///     .put("config/web/draining", b"blue");
    /// ```
    pub fn put(self, key: &str, value: &[u8]) -> Self {
        self.write(key, Op::Put(value.to_vec()))
    }

    /// Deletes `key` (nothing happens to a key that does not exist).
    ///
    /// ```
    /// use lockcell_client::{Condition, Txn};
    ///
    /// # let claim_revision = 57;
    /// // Record the job's result and drop its claim, only while the claim is this one.
    /// let txn = Txn::new()
    ///     .when("jobs/nightly/claim", Condition::ModRevision(claim_revision))
    ///     .put("jobs/nightly/result", b"ok")
    ///     .delete("jobs/nightly/claim");
    /// ```
    pub fn delete(self, key: &str) -> Self {
        self.write(key, Op::Delete(true))
    }

    fn write(mut self, key: &str, op: Op) -> Self {
        self.request.writes.push(TxnWrite {
            key: key.to_owned(),
            op: Some(op),
        });
        self
    }
}

/// What a [`Txn`] did.
///
/// ```no_run
/// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
/// use lockcell_client::{Condition, Txn};
///
/// // Count a billing run: read once, then go on from what a failed attempt shows.
/// let mut seen = client.get("billing/runs").await?;
/// loop {
///     let (condition, runs) = match &seen {
///         Some(entry) => {
///             let runs: u64 = String::from_utf8_lossy(&entry.value).parse().unwrap_or(0);
///             (Condition::ModRevision(entry.mod_revision), runs)
///         }
///         None => (Condition::Absent, 0),
///     };
///     let txn = Txn::new()
///         .when("billing/runs", condition)
///         .put("billing/runs", (runs + 1).to_string().as_bytes());
///     let outcome = client.commit(txn).await?;
///     if outcome.succeeded {
///         break;
///     }
///     seen = outcome.current.into_iter().next();
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TxnOutcome {
    /// False when a condition did not hold; nothing was written.
    pub succeeded: bool,
    /// The store revision after the call (every write of a transaction that succeeded
    /// has it as its `mod_revision`).
    pub revision: i64,
    /// When a condition failed: the compared keys that exist, as they are now, ready
    /// for the next attempt without another read. Empty on success.
    pub current: Vec<Entry>,
}

impl Client {
    /// Runs `txn`: all of its writes or none.
    ///
    /// After [`Error::Unavailable`] the transaction may or may not have been applied;
    /// with conditions on revisions, a retry that finds it applied fails its condition
    /// and shows the keys as they are.
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// use lockcell_client::{Condition, Txn};
    ///
    /// // Rename a rate key, unless someone touches either name meanwhile.
    /// let Some(old) = client.get("config/rates/eu").await? else {
    ///     return Ok(());
    /// };
    /// let txn = Txn::new()
    ///     .when("config/rates/eu", Condition::ModRevision(old.mod_revision))
    ///     .when("config/rates/emea", Condition::Absent)
    ///     .delete("config/rates/eu")
    ///     .put("config/rates/emea", &old.value);
    /// let outcome = client.commit(txn).await?;
    /// if outcome.succeeded {
    ///     println!("renamed at revision {}", outcome.revision);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn commit(&self, txn: Txn) -> Result<TxnOutcome, Error> {
        let mut request = tonic::Request::new(txn.request);
        request.set_timeout(UNARY_TIMEOUT);
        let reply = KvClient::new(self.channel())
            .txn(request)
            .await
            .map_err(|s| Error::from_status(s, Call::Unbound))?
            .into_inner();
        Ok(TxnOutcome {
            succeeded: reply.succeeded,
            revision: reply.revision,
            current: reply.current.into_iter().map(entry).collect(),
        })
    }

    /// One key, as of now (linearizable).
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// let rate = match client.get("config/rates/eu").await? {
    ///     Some(entry) => String::from_utf8_lossy(&entry.value).into_owned(),
    ///     None => "100".to_owned(), // not configured: the default
    /// };
    /// # Ok(()) }
    /// ```
    pub async fn get(&self, key: &str) -> Result<Option<Entry>, Error> {
        Ok(self.read(key, false).await?.entries.into_iter().next())
    }

    /// Every key under `prefix`, as of now (linearizable).
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// for entry in client.get_prefix("config/rates/").await? {
    ///     println!("{} = {}", entry.key, String::from_utf8_lossy(&entry.value));
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn get_prefix(&self, prefix: &str) -> Result<Vec<Entry>, Error> {
        Ok(self.read(prefix, true).await?.entries)
    }

    /// One key as of now (linearizable), with the position the read reflects: to watch
    /// the key from there, `client.watch(key, WatchOptions::default().after(&snapshot.at))`.
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// use lockcell_client::WatchOptions;
    ///
    /// let snapshot = client.snapshot("config/rates/eu").await?;
    /// let rate = snapshot.entries.first().map(|entry| entry.value.clone());
    /// // Every change after that read, none missed.
    /// let options = WatchOptions::default().after(&snapshot.at);
    /// let mut watcher = client.watch("config/rates/eu", options).await?;
    /// # Ok(()) }
    /// ```
    pub async fn snapshot(&self, key: &str) -> Result<Snapshot, Error> {
        self.read(key, false).await
    }

    /// Every key under `prefix` as of now (linearizable), with the position the read
    /// reflects.
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// use lockcell_client::WatchOptions;
    ///
    /// let snapshot = client.snapshot_prefix("config/api/").await?;
    /// let mut watcher = client
    ///     .watch("config/api/", WatchOptions::prefix().after(&snapshot.at))
    ///     .await?;
    /// // Every change after the snapshot, none missed, none twice; or
    /// // `Error::WatchMoved` if the prefix moved to another cell in between.
    /// if let Some(batch) = watcher.next().await {
    ///     println!("{} changes", batch?.events.len());
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn snapshot_prefix(&self, prefix: &str) -> Result<Snapshot, Error> {
        self.read(prefix, true).await
    }

    /// Writes `key` if `condition` holds.
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// use lockcell_client::Condition;
    ///
    /// let written = client
    ///     .put("config/rates/eu", b"110", Condition::Always)
    ///     .await?;
    /// println!("written at revision {}", written.revision);
    /// # Ok(()) }
    /// ```
    pub async fn put(
        &self,
        key: &str,
        value: &[u8],
        condition: Condition,
    ) -> Result<Written, Error> {
        self.write(key, value, condition, None, Call::Unbound).await
    }

    /// Deletes `key` if `condition` holds; returns whether it deleted it.
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// use lockcell_client::Condition;
    ///
    /// if !client.delete("config/rates/eu", Condition::Always).await? {
    ///     println!("config/rates/eu was not set");
    /// }
    /// # Ok(()) }
    /// ```
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

    async fn read(&self, key: &str, prefix: bool) -> Result<Snapshot, Error> {
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
        if reply.more {
            return Err(Error::Protocol(format!(
                "the read of {key:?} was cut short although it asked for no limit"
            )));
        }
        Ok(Snapshot {
            entries: reply.kvs.into_iter().map(entry).collect(),
            at: CellRevision {
                revision: reply.revision,
                cell: reply.cell,
            },
        })
    }

    async fn write(
        &self,
        key: &str,
        value: &[u8],
        condition: Condition,
        session: Option<(&str, &str)>,
        call: Call<'_>,
    ) -> Result<Written, Error> {
        let reply = KvClient::new(self.channel())
            .put(put_request(key, value, condition, session))
            .await
            .map_err(|s| Error::from_status(s, call))?
            .into_inner();
        Ok(written(reply))
    }
}

fn put_request(
    key: &str,
    value: &[u8],
    condition: Condition,
    session: Option<(&str, &str)>,
) -> tonic::Request<PutRequest> {
    let (session_id, session_secret) = session.unwrap_or_default();
    let mut request = tonic::Request::new(PutRequest {
        key: key.to_owned(),
        value: value.to_vec(),
        condition: wire(condition),
        session_id: session_id.to_owned(),
        session_secret: session_secret.to_owned(),
    });
    request.set_timeout(UNARY_TIMEOUT);
    request
}

fn written(reply: lockcell_proto::v1::PutResponse) -> Written {
    Written {
        succeeded: reply.succeeded,
        revision: reply.revision,
        current: reply.current.map(entry),
    }
}

impl Session {
    /// Writes an ephemeral `key`: it is deleted when this session ends (closed, or
    /// expired: no renewal reached any proxy for its TTL), as membership keys should
    /// be. It moves with the session when the session resumes on another proxy (its
    /// proxy died, drained or lost etcd).
    ///
    /// ```no_run
    /// # async fn example(session: lockcell_client::Session) -> Result<(), lockcell_client::Error> {
    /// use lockcell_client::Condition;
    ///
    /// // Claim shard 7 for as long as this worker's session lives.
    /// let claim = session
    ///     .put_ephemeral("jobs/shards/7", b"worker-3", Condition::Absent)
    ///     .await?;
    /// if !claim.succeeded {
    ///     // Another worker has it.
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn put_ephemeral(
        &self,
        key: &str,
        value: &[u8],
        condition: Condition,
    ) -> Result<Written, Error> {
        let request = put_request(key, value, condition, Some((self.id(), self.secret())));
        let (reply, sent) = self
            .grant_request(|channel| async move { KvClient::new(channel).put(request).await })
            .await?;
        let written = written(reply);
        if let (true, Some(entry)) = (written.succeeded, &written.current) {
            let held = crate::holdings::Held::Ephemeral {
                key: key.to_owned(),
                create_revision: entry.create_revision,
                mod_revision: entry.mod_revision,
            };
            self.accept_grant(&sent, None, held);
        }
        Ok(written)
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

/// A small key off the wire.
pub(crate) fn entry(kv: KeyValue) -> Entry {
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
    fn positions_parse_only_as_replies_write_them() {
        let at: CellRevision = "17@6a1f/1796184997/0".parse().unwrap();
        assert_eq!(
            at,
            CellRevision {
                revision: 17,
                cell: "6a1f/1796184997/0".into()
            }
        );
        assert_eq!(at.to_string(), "17@6a1f/1796184997/0");
        assert_eq!("17".parse::<CellRevision>().unwrap().cell, "");
        for bad in [
            "",
            "-1",
            "x@6a1f/1/0",
            "17@",
            "17@bogus",
            "17@6a1f/1/0/",
            "17@6A1F/1/0",
            "17@6a1f/1/0@x",
            "17@6a1f/one/0",
        ] {
            assert!(bad.parse::<CellRevision>().is_err(), "{bad:?}");
        }
    }

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

    #[test]
    fn a_txn_sends_its_compares_and_writes_in_order() {
        let txn = Txn::new()
            .when("acct/a", Condition::ModRevision(7))
            .put("acct/a", b"9")
            .when("acct/b", Condition::Absent)
            .delete("acct/c")
            .put("acct/b", b"1");
        let compares: Vec<(&str, Option<When>)> = txn
            .request
            .compares
            .iter()
            .map(|c| (c.key.as_str(), c.condition.and_then(|c| c.when)))
            .collect();
        assert_eq!(
            compares,
            [
                ("acct/a", Some(When::ModRevision(7))),
                ("acct/b", Some(When::Absent(true)))
            ]
        );
        let writes: Vec<(&str, Option<&Op>)> = txn
            .request
            .writes
            .iter()
            .map(|w| (w.key.as_str(), w.op.as_ref()))
            .collect();
        assert_eq!(
            writes,
            [
                ("acct/a", Some(&Op::Put(b"9".to_vec()))),
                ("acct/c", Some(&Op::Delete(true))),
                ("acct/b", Some(&Op::Put(b"1".to_vec()))),
            ]
        );
        // Always compares nothing: it goes out without a condition, for the proxy to
        // refuse with the key's name rather than be dropped here unseen.
        let txn = Txn::new().when("x", Condition::Always);
        assert_eq!(txn.request.compares[0].condition, None);
        assert_eq!(Txn::new(), Txn::default());
    }
}
