//! Group membership on ephemeral small keys: a process [announces](Session::announce)
//! itself in a group for as long as its session lives, and anyone can follow who is in
//! the group ([`Client::members`]).
//!
//! Key layout (the only place it is built): member `<member>` of group `<group>` is the
//! small key `members/<group>/<member>`, its value whatever the member announced (an
//! address, say). Group names follow the key-name rules (`/`-separated segments, checked
//! by the proxy), so groups nest: `svc` and `svc/web` are different groups. A member
//! name is one segment: not empty, no `/`.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::sync::watch;

use crate::client::Client;
use crate::error::{Error, ErrorKind, StatusCode};
use crate::kv::{Condition, Written};
use crate::session::Session;
use crate::stream::{Steps, Stream};
use crate::watch::{EventKind, WatchEvent, WatchOptions, Watcher};

/// Where every group's members live.
const MEMBERS_ROOT: &str = "members/";

/// The key of `member` in `group`, once `member` is known to be one segment.
fn member_key(group: &str, member: &str) -> Result<String, Error> {
    if member.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "member name in group {group:?} is empty"
        )));
    }
    if member.contains('/') {
        return Err(Error::InvalidArgument(format!(
            "member name {member:?} in group {group:?} contains '/'; a member name is one segment"
        )));
    }
    Ok(format!("{}{member}", group_prefix(group)))
}

/// The prefix under which `group`'s members live.
fn group_prefix(group: &str) -> String {
    format!("{MEMBERS_ROOT}{group}/")
}

/// The member a key of the group under `prefix` stands for; `None` for a key of a
/// nested group (`members/svc/web/a` is not a member of `svc`).
fn member_of<'k>(prefix: &str, key: &'k str) -> Option<&'k str> {
    key.strip_prefix(prefix)
        .filter(|m| !m.is_empty() && !m.contains('/'))
}

impl Session {
    /// Makes `member` a member of `group` with `value` for as long as this session
    /// lives: the key is ephemeral, so the member leaves when the session is closed or
    /// expires (a proxy that dies does not end it: the session and its member move to
    /// another proxy). Announcing again changes the value. The last session
    /// to announce a member name owns it.
    ///
    /// [`Error::InvalidArgument`]: `member` is empty or contains `/`, or the proxy
    /// refused the group name.
    ///
    /// ```no_run
    /// # async fn example(session: lockcell_client::Session) -> Result<(), lockcell_client::Error> {
    /// session.announce("web", "host-7", b"10.0.3.7:8080").await?;
    /// # Ok(()) }
    /// ```
    pub async fn announce(
        &self,
        group: &str,
        member: &str,
        value: impl AsRef<[u8]>,
    ) -> Result<Written, Error> {
        let key = member_key(group, member)?;
        self.put_ephemeral(&key, value.as_ref(), Condition::Always)
            .await
    }

    /// Takes `member` out of `group` before the session ends, if this session's
    /// announcement is still the member's: `false` when it is not (the session never
    /// announced it, or another session announced the same name since, which then keeps
    /// it). The session goes on; a later [`announce`](Session::announce) joins again.
    ///
    /// ```no_run
    /// # async fn example(session: lockcell_client::Session) -> Result<(), lockcell_client::Error> {
    /// session.announce("web", "host-7", b"10.0.3.7:8080").await?;
    /// // Draining: stop receiving traffic, keep the session's locks.
    /// assert!(session.leave("web", "host-7").await?);
    /// # Ok(()) }
    /// ```
    pub async fn leave(&self, group: &str, member: &str) -> Result<bool, Error> {
        let key = member_key(group, member)?;
        if self.shared().is_expired() {
            return Err(self.expired_error());
        }
        let holdings = &self.shared().holdings;
        let Some(holding) = holdings.ephemeral(&key) else {
            return Ok(false);
        };
        // Still named by a move meanwhile, so the delete finds the key wherever it went;
        // its loss in a move is no news.
        holding.let_go();
        // A move of the session rewrites the key (a new mod revision): a delete that
        // missed because of one is asked again with the revision the move wrote.
        for _ in 0..crate::lock::MOVES_FOLLOWED {
            let written = holding.written();
            let deleted = self
                .client()
                .delete(&key, Condition::ModRevision(written))
                .await?;
            if deleted || holding.written() == written {
                holdings.remove(&holding);
                return Ok(deleted);
            }
        }
        Err(Error::Unavailable(format!(
            "leaving group {group:?} kept racing moves of the session; ask again"
        )))
    }
}

/// A change in a group's membership.
///
/// ```no_run
/// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
/// use lockcell_client::MemberChange;
///
/// let mut web = client.members("web").await?;
/// while let Some(changes) = web.next().await {
///     for change in changes? {
///         match change {
///             MemberChange::Joined { member, value } | MemberChange::Updated { member, value } => {
///                 println!("backend {member} at {}", String::from_utf8_lossy(&value))
///             }
///             MemberChange::Left { member } => println!("backend {member} left"),
///         }
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemberChange {
    /// A member that was not in the group is now.
    Joined {
        /// The member's name.
        member: String,
        /// The value it announced (its address, say).
        value: Vec<u8>,
    },
    /// A member announced a new value.
    Updated {
        /// The member's name.
        member: String,
        /// The value it announced now.
        value: Vec<u8>,
    },
    /// A member left (its session ended, or it was deleted).
    Left {
        /// The member's name.
        member: String,
    },
}

/// A group's members as of a revision, and a [`Stream`](tokio_stream::Stream) of the
/// changes that keep them up to date ([`next`](Members::next), or
/// [`changed`](Members::changed), which never ends). From [`Client::members`].
///
/// ```no_run
/// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
/// let mut web = client.members("web").await?;
/// while let Some(changes) = web.next().await {
///     changes?;
///     println!("{} backends: {:?}", web.current().len(), web.current().keys());
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Members {
    steps: Steps<Following, Result<Vec<MemberChange>, Error>>,
    /// `members/<group>/`, for logs.
    prefix: String,
    /// The group as of `revision`: the changes handed out, applied.
    current: BTreeMap<String, Vec<u8>>,
    revision: i64,
}

/// What a [`Members`] keeps between changes.
#[derive(Debug)]
struct Following {
    client: Client,
    /// `members/<group>/`: events under it but for nested groups are ignored.
    prefix: String,
    current: BTreeMap<String, Vec<u8>>,
    watcher: Watcher,
    /// Set once an error that going on would not cure was handed out.
    ended: bool,
}

impl Client {
    /// The members of `group` now (a linearizable read), followed from there on with no
    /// change missed: the watch starts right after the read's revision.
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// use lockcell_client::MemberChange;
    ///
    /// let mut web = client.members("web").await?;
    /// println!("{} backends", web.current().len());
    /// loop {
    ///     for change in web.changed().await? {
    ///         if let MemberChange::Left { member } = change {
    ///             println!("{member} left");
    ///         }
    ///     }
    /// }
    /// # }
    /// ```
    pub async fn members(&self, group: &str) -> Result<Members, Error> {
        let prefix = group_prefix(group);
        let (current, watcher) = self.list_and_watch(&prefix).await?;
        Ok(Members {
            prefix: prefix.clone(),
            current: current.clone(),
            revision: watcher.revision(),
            steps: Steps::new(
                Following {
                    client: self.clone(),
                    prefix,
                    current,
                    watcher,
                    ended: false,
                },
                |mut following| {
                    Box::pin(async move {
                        if following.ended {
                            return (following, None);
                        }
                        let changes = following.changed().await;
                        following.ended =
                            matches!(&changes, Err(error) if error.kind() == ErrorKind::Fatal);
                        (following, Some(changes))
                    })
                },
            ),
        })
    }

    /// Reads the group under `prefix` and watches it from the read's revision + 1.
    async fn list_and_watch(
        &self,
        prefix: &str,
    ) -> Result<(BTreeMap<String, Vec<u8>>, Watcher), Error> {
        let snapshot = self.snapshot_prefix(prefix).await?;
        let current = snapshot
            .entries
            .into_iter()
            .filter_map(|e| Some((member_of(prefix, &e.key)?.to_owned(), e.value)))
            .collect();
        let watcher = self
            .watch(prefix, WatchOptions::prefix().after(&snapshot.at))
            .await?;
        Ok((current, watcher))
    }
}

impl Members {
    /// Who is in the group, with the values they announced, as of
    /// [`revision`](Members::revision).
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// let web = client.members("web").await?;
    /// for (member, address) in web.current() {
    ///     println!("{member} at {}", String::from_utf8_lossy(address));
    /// }
    /// # Ok(()) }
    /// ```
    pub fn current(&self) -> &BTreeMap<String, Vec<u8>> {
        &self.current
    }

    /// The revision [`current`](Members::current) reflects.
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// let web = client.members("web").await?;
    /// println!("{} members as of revision {}", web.current().len(), web.revision());
    /// # Ok(()) }
    /// ```
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// The next changes of membership, in order and never empty, already applied to
    /// [`current`](Members::current). The stream ends (`None`) only after an error that
    /// going on would not cure ([`ErrorKind::Fatal`], such as a refusal by the proxy's
    /// grants), handed out once.
    ///
    /// Going on needs no help from the application: a watch cut off for falling behind
    /// resumes where it was, and one whose revisions were compacted away (after a long
    /// outage) is replaced by a fresh read, whose difference from `current` is returned.
    /// [`Error::Unavailable`]: the proxy could not be reached for a while; calling
    /// again goes on from the same place. Cancel-safe.
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// let mut web = client.members("web").await?;
    /// while let Some(changes) = web.next().await {
    ///     println!("{:?}", changes?);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn next(&mut self) -> Option<Result<Vec<MemberChange>, Error>> {
        crate::stream::next(self).await
    }

    /// Waits for the next change of membership, applies it to
    /// [`current`](Members::current) and returns it: [`next`](Members::next) without the
    /// `Option`. Once the stream has ended, every call fails (a refusal: kind
    /// [`ErrorKind::Fatal`]).
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// use lockcell_client::MemberChange;
    ///
    /// let mut web = client.members("web").await?;
    /// loop {
    ///     for change in web.changed().await? {
    ///         if let MemberChange::Left { member } = change {
    ///             println!("{member} left");
    ///         }
    ///     }
    /// }
    /// # }
    /// ```
    pub async fn changed(&mut self) -> Result<Vec<MemberChange>, Error> {
        self.next().await.unwrap_or_else(|| {
            Err(Error::Status {
                code: StatusCode::FailedPrecondition,
                message: format!(
                    "the list of {:?} has ended after an error that going on would not cure",
                    self.prefix
                ),
            })
        })
    }

    /// Keeps the group current in a task of its own and returns a receiver of it, as a
    /// cache: `borrow()` it whenever, `changed().await` to wake on a change. The task
    /// ends when every receiver is dropped, or on an error that asking again would not
    /// cure (a refusal by the grants; the receivers then see the sender gone). A proxy
    /// out of reach only delays it. Needs a tokio runtime.
    ///
    /// ```no_run
    /// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
    /// let web = client.members("web").await?.watch();
    /// let backends: Vec<String> = web.borrow().keys().cloned().collect();
    /// # Ok(()) }
    /// ```
    pub fn watch(mut self) -> MemberCache {
        let (tx, rx) = watch::channel(Arc::new(self.current.clone()));
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tx.closed() => return,
                    changed = self.changed() => match changed {
                        Ok(_) => {
                            tx.send_replace(Arc::new(self.current.clone()));
                        }
                        Err(error) if error.kind() == ErrorKind::Retry => {
                            tracing::warn!(members.group = %self.prefix, %error, "membership cache waiting for the proxy");
                            tokio::time::sleep(CACHE_RETRY).await;
                        }
                        Err(error) => {
                            tracing::warn!(members.group = %self.prefix, %error, "membership cache stopped");
                            return;
                        }
                    },
                }
            }
        });
        rx
    }
}

impl Stream for Members {
    type Item = Result<Vec<MemberChange>, Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let item = std::task::ready!(self.steps.poll_step(cx));
        if let Some(Ok(changes)) = &item {
            let this = &mut *self;
            for change in changes {
                match change {
                    MemberChange::Joined { member, value }
                    | MemberChange::Updated { member, value } => {
                        this.current.insert(member.clone(), value.clone());
                    }
                    MemberChange::Left { member } => {
                        this.current.remove(member);
                    }
                }
            }
        }
        if let Some(following) = self.steps.idle() {
            self.revision = following.watcher.revision();
        }
        Poll::Ready(item)
    }
}

impl Following {
    /// The next changes of membership, applied to `current` ([`Members::next`]).
    async fn changed(&mut self) -> Result<Vec<MemberChange>, Error> {
        loop {
            let failed = match self.watcher.next().await {
                Some(Ok(batch)) => {
                    let changes = apply(&mut self.current, &self.prefix, &batch.events);
                    if !changes.is_empty() {
                        return Ok(changes);
                    }
                    continue;
                }
                Some(Err(Error::WatchCutOff { resume_from, .. })) => {
                    tracing::info!(members.group = %self.prefix, resume_from, "membership watch cut off; resuming");
                    continue;
                }
                Some(Err(error @ (Error::Compacted { .. } | Error::WatchMoved { .. }))) => error,
                Some(Err(error)) => return Err(error),
                None => Error::Protocol("the membership watch ended".to_owned()),
            };
            tracing::info!(members.group = %self.prefix, error = %failed, "membership watch cannot go on; reading the group again");
            let (fresh, watcher) = self.client.list_and_watch(&self.prefix).await?;
            let changes = diff(&self.current, &fresh);
            self.current = fresh;
            self.watcher = watcher;
            if !changes.is_empty() {
                return Ok(changes);
            }
        }
    }
}

/// A group's members kept current by a task of its own ([`Members::watch`]): `borrow()`
/// it whenever, `changed().await` to wake on a change. Each value is the whole group,
/// member name to announced value.
///
/// ```no_run
/// # async fn example(client: lockcell_client::Client) -> Result<(), lockcell_client::Error> {
/// let web: lockcell_client::MemberCache = client.members("web").await?.watch();
/// let backends: Vec<String> = web.borrow().keys().cloned().collect();
/// # Ok(()) }
/// ```
pub type MemberCache = watch::Receiver<Arc<BTreeMap<String, Vec<u8>>>>;

/// How long a membership cache waits before asking again after the proxy could not be
/// reached (the watch under it already waited a while before saying so).
const CACHE_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// Applies `events` to `current` and says what changed, in order. A write that leaves
/// a member's value as it was is no change.
fn apply(
    current: &mut BTreeMap<String, Vec<u8>>,
    prefix: &str,
    events: &[WatchEvent],
) -> Vec<MemberChange> {
    let mut changes = Vec::new();
    for event in events {
        let Some(member) = member_of(prefix, &event.entry.key) else {
            continue;
        };
        let member = member.to_owned();
        match event.kind {
            EventKind::Put => {
                let value = event.entry.value.clone();
                match current.insert(member.clone(), value.clone()) {
                    None => changes.push(MemberChange::Joined { member, value }),
                    Some(old) if old != value => {
                        changes.push(MemberChange::Updated { member, value })
                    }
                    Some(_) => {}
                }
            }
            EventKind::Delete => {
                if current.remove(&member).is_some() {
                    changes.push(MemberChange::Left { member });
                }
            }
        }
    }
    changes
}

/// What turns membership `old` into `new`: the members that left, then those that
/// joined or changed value, each in name order.
fn diff(old: &BTreeMap<String, Vec<u8>>, new: &BTreeMap<String, Vec<u8>>) -> Vec<MemberChange> {
    let left = old
        .keys()
        .filter(|m| !new.contains_key(*m))
        .map(|m| MemberChange::Left { member: m.clone() });
    let arrived = new
        .iter()
        .filter_map(|(member, value)| match old.get(member) {
            None => Some(MemberChange::Joined {
                member: member.clone(),
                value: value.clone(),
            }),
            Some(was) if was != value => Some(MemberChange::Updated {
                member: member.clone(),
                value: value.clone(),
            }),
            Some(_) => None,
        });
    left.chain(arrived).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::Entry;

    const WEB: &str = "members/web/";

    fn event(kind: EventKind, key: &str, value: &str, revision: i64) -> WatchEvent {
        WatchEvent {
            kind,
            entry: Entry {
                key: key.into(),
                value: value.into(),
                create_revision: revision,
                mod_revision: revision,
                version: 1,
                ephemeral: kind == EventKind::Put,
            },
            prev: None,
        }
    }

    fn joined(member: &str, value: &str) -> MemberChange {
        MemberChange::Joined {
            member: member.into(),
            value: value.into(),
        }
    }

    fn group(members: &[(&str, &str)]) -> BTreeMap<String, Vec<u8>> {
        members
            .iter()
            .map(|(m, v)| ((*m).to_owned(), v.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn keys_are_members_of_one_group() {
        assert_eq!(member_key("web", "a").unwrap(), "members/web/a");
        assert_eq!(
            member_key("svc/web", "host-1:80").unwrap(),
            "members/svc/web/host-1:80"
        );
        for bad in ["", "a/b", "/"] {
            let err = member_key("web", bad).unwrap_err();
            assert!(
                matches!(err, Error::InvalidArgument(ref m) if m.contains("\"web\"")),
                "{bad:?}: {err:?}"
            );
        }
        assert_eq!(member_of(WEB, "members/web/a"), Some("a"));
        assert_eq!(member_of(WEB, "members/web/api/a"), None, "a nested group");
        assert_eq!(member_of(WEB, "members/web/"), None);
        assert_eq!(member_of(WEB, "members/webx/a"), None);
    }

    #[test]
    fn events_become_joins_updates_and_departures() {
        let mut current = group(&[("a", "10.0.0.1")]);
        let events = [
            event(EventKind::Put, "members/web/b", "10.0.0.2", 5),
            event(EventKind::Put, "members/web/a", "10.0.0.9", 6),
            // Announced again with the same value: nothing changed.
            event(EventKind::Put, "members/web/a", "10.0.0.9", 7),
            event(EventKind::Delete, "members/web/b", "", 8),
            // Someone else's business: a nested group, an unknown member leaving.
            event(EventKind::Put, "members/web/api/x", "1", 9),
            event(EventKind::Delete, "members/web/zz", "", 10),
        ];
        let changes = apply(&mut current, WEB, &events);
        assert_eq!(
            changes,
            [
                joined("b", "10.0.0.2"),
                MemberChange::Updated {
                    member: "a".into(),
                    value: "10.0.0.9".into()
                },
                MemberChange::Left { member: "b".into() },
            ]
        );
        assert_eq!(current, group(&[("a", "10.0.0.9")]));
        assert!(apply(&mut current, WEB, &[]).is_empty());
    }

    #[test]
    fn a_fresh_read_is_told_as_the_difference() {
        let old = group(&[("a", "1"), ("b", "2"), ("c", "3")]);
        let new = group(&[("b", "2"), ("c", "30"), ("d", "4")]);
        assert_eq!(
            diff(&old, &new),
            [
                MemberChange::Left { member: "a".into() },
                MemberChange::Updated {
                    member: "c".into(),
                    value: "30".into()
                },
                joined("d", "4"),
            ]
        );
        assert!(diff(&new, &new).is_empty());
    }
}
