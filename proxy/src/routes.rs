//! Which names a proxy may grant and write in one cell: those the cell's own copy of the
//! shard map routes to it, unpaused (docs/operations.md, "Adding a cell and moving a
//! prefix").
//!
//! Every cell of a shard map holds a copy at `/sys/shardmap`. A grant or write in a cell
//! is checked against that cell's copy and compares the copy's mod revision in its
//! transaction, so `lockcell-cell shardmap move`, which pauses a prefix by writing the
//! source cell's copy first, stops every grant in flight there; and the target grants
//! the prefix only once its own copy says so, after the source holds nothing under it.
//! A cell without a copy serves every name (a deployment of one cell).
//!
//! The fencing token of a grant is (the larger of the cell's epoch and its route's
//! epoch, revision): a move raises the route's epoch above both cells' epochs, so tokens
//! keep rising across it although the target's revisions are unrelated to the source's.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::WatchOptions;
use lockcell_cell::shardmap::{ShardMap, StoredMap};
use tokio::sync::watch;

use crate::errors::ProxyError;

/// What a grant or write of one name is made under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    /// The mod revision of the cell's shard map copy it was checked against (0: none);
    /// the transaction compares it.
    pub map_revision: i64,
    /// The epoch of the tokens it mints.
    pub epoch: u64,
}

/// One cell's copy of the shard map, as this proxy last read it.
pub struct Routes {
    cluster_id: String,
    cell_epoch: u64,
    /// The proxy serves this cell as one of a shard map's: without a copy it serves
    /// nothing (a cell of one proxy's own serves everything without one).
    in_map: bool,
    copy: watch::Sender<Option<Arc<StoredMap>>>,
    /// The revision of this cell's copy that first showed each route (prefix, epoch)
    /// here: where positions with that route epoch begin. For the copy loaded at start
    /// no earlier one is known, so its own revision.
    first_seen: std::sync::Mutex<std::collections::HashMap<(String, u64), i64>>,
    /// The mod revision of the cell's epoch record: where positions of this epoch begin.
    epoch_revision: i64,
    /// Counts the copies taken in (see [`Routes::copy_changes`]).
    changes: std::sync::atomic::AtomicI64,
}

/// Where reads and watches of some names stand in this cell: the position their
/// revisions are of (see [`Routes::position`]), and the first revision of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    pub position: String,
    /// Revisions before it are of an earlier position: before the names' routes took
    /// their epochs here, or before the cell's epoch.
    pub since: i64,
}

impl Routes {
    pub fn new(cluster_id: &str, cell_epoch: u64, copy: Option<StoredMap>) -> Self {
        let first_seen = copy
            .iter()
            .flat_map(|c| {
                c.map
                    .routes
                    .iter()
                    .map(|r| ((r.prefix.clone(), r.epoch), c.mod_revision))
            })
            .collect();
        Routes {
            cluster_id: cluster_id.to_owned(),
            cell_epoch,
            in_map: false,
            copy: watch::Sender::new(copy.map(Arc::new)),
            first_seen: std::sync::Mutex::new(first_seen),
            epoch_revision: 0,
            changes: std::sync::atomic::AtomicI64::new(0),
        }
    }

    /// Positions of this cell's epoch begin at `revision` (its epoch record's).
    pub fn epoch_since(mut self, revision: i64) -> Self {
        self.epoch_revision = revision;
        self
    }

    /// Marks the cell as one of the shard map's many: it serves nothing while it has no
    /// copy (deleted, or a restore from before the map).
    pub fn in_map(mut self) -> Self {
        self.in_map = true;
        self
    }

    /// The copy in force (`None`: the cell has no shard map).
    pub fn copy(&self) -> Option<Arc<StoredMap>> {
        self.copy.borrow().clone()
    }

    /// How many copies this proxy has taken in: it changes with every change of the
    /// copy, and costs one atomic load to look at (the watch path looks per batch).
    pub fn copy_changes(&self) -> i64 {
        self.changes.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Follows the copy: a receiver that sees every change.
    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<StoredMap>>> {
        self.copy.subscribe()
    }

    /// Takes in the copy read at some revision; an older read than the one in force is
    /// ignored (a watch and a read may cross).
    pub fn update(&self, copy: Option<StoredMap>, read_at: i64) {
        self.copy.send_if_modified(|now| {
            let current = now.as_ref().map_or(0, |c| c.mod_revision);
            let newer = match &copy {
                Some(c) => c.mod_revision > current,
                // Deleted: the delete is newer than every write seen before it.
                None => now.is_some() && read_at > current,
            };
            if newer {
                if let Some(c) = &copy {
                    let mut seen = self.first_seen.lock().expect("first-seen lock");
                    for route in &c.map.routes {
                        seen.entry((route.prefix.clone(), route.epoch))
                            .or_insert(c.mod_revision);
                    }
                }
                *now = copy.map(Arc::new);
                self.changes
                    .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            }
            newer
        });
    }

    /// What a grant or write of `name` in this cell is made under, or why this cell may
    /// not make it now.
    pub fn serve(&self, name: &str) -> Result<Served, ProxyError> {
        self.serve_in(self.copy().as_deref(), name)
    }

    /// The map revision a transaction over all of `names` is made under: each checked
    /// against one copy (the one its transaction compares).
    pub fn serve_all<'n>(
        &self,
        names: impl IntoIterator<Item = &'n str>,
    ) -> Result<i64, ProxyError> {
        let copy = self.copy();
        for name in names {
            self.serve_in(copy.as_deref(), name)?;
        }
        Ok(copy.as_ref().map_or(0, |c| c.mod_revision))
    }

    fn serve_in(&self, copy: Option<&StoredMap>, name: &str) -> Result<Served, ProxyError> {
        let Some(copy) = copy else {
            if self.in_map {
                return Err(ProxyError::NotServed(format!(
                    "this cell (cluster id {}) has no copy of the shard map, so it serves nothing (not {name:?}): write the map in force again with `lockcell-cell shardmap set`",
                    self.cluster_id
                )));
            }
            return Ok(Served {
                map_revision: 0,
                epoch: self.cell_epoch,
            });
        };
        let map = &copy.map;
        let version = map.version;
        let Some(me) = own_cell(map, &self.cluster_id) else {
            return Err(ProxyError::NotServed(format!(
                "this cell (cluster id {}) is not in its own copy of the shard map (version {version}); nothing is served here",
                self.cluster_id
            )));
        };
        let Some(route) = map.route(name) else {
            return Err(ProxyError::NotServed(format!(
                "no cell serves {name:?}: no route of the shard map (version {version}) matches it"
            )));
        };
        if route.cell != me {
            return Err(ProxyError::Moving(format!(
                "{name:?} is served by cell {:?} (route {:?}, shard map version {version}), which this proxy does not serve: it is moving there, or the proxy must be restarted to connect to that cell",
                route.cell, route.prefix
            )));
        }
        if route.paused {
            return Err(ProxyError::Moving(format!(
                "the names under {:?} are moving to another cell; {name:?} is served again when the move ends (try again shortly)",
                route.prefix
            )));
        }
        Ok(Served {
            map_revision: copy.mod_revision,
            epoch: map.token_epoch(self.cell_epoch, name),
        })
    }

    /// Whether a read of `name` (with `prefix`, of every name under it) may be answered
    /// from this cell: its copy routes the name (every route under the prefix) here,
    /// paused or not (a paused prefix takes no writes anywhere). Checked after a read
    /// barrier against the copy as of that barrier, so a read never answers from a
    /// cell a prefix left before the read began. Returns the read's position (see
    /// [`Routes::position`]) as of that same copy.
    pub fn read_here(&self, name: &str, prefix: bool) -> Result<String, ProxyError> {
        let Some(copy) = self.copy() else {
            return self
                .serve_in(None, name)
                .map(|_| self.position_in(None, name, prefix));
        };
        let map = &copy.map;
        let version = map.version;
        let Some(me) = own_cell(map, &self.cluster_id) else {
            return Err(ProxyError::NotServed(format!(
                "this cell (cluster id {}) is not in its own copy of the shard map (version {version}); nothing is read here",
                self.cluster_id
            )));
        };
        let cells = if prefix {
            crate::front::cells_under(map, name)
        } else {
            map.route(name)
                .map(|r| r.cell.clone())
                .into_iter()
                .collect()
        };
        match &cells[..] {
            [] => Err(ProxyError::NotServed(format!(
                "no cell serves {name:?}: no route of the shard map (version {version}) matches it"
            ))),
            [cell] if cell == me => Ok(self.position_in(Some(&copy), name, prefix)),
            _ => Err(ProxyError::Moving(format!(
                "{name:?} is served by cell {} now (shard map version {version}), not by the cell this read reached: it moved; read again",
                cells.join(", ")
            ))),
        }
    }

    /// Whose revisions a read or watch of `name` (with `prefix`, of every name under
    /// it) speaks of, as the copy in force says: the cell's cluster id and epoch (a
    /// restore from backup raises the epoch, and may take revisions back), and the
    /// highest epoch of the names' routes (every move of them raises it; 0 without a
    /// copy). A prefix moved away and back is in the same cell again, but the cell's
    /// history lacks what was written elsewhere meanwhile, so its position differs.
    pub fn position(&self, name: &str, prefix: bool) -> String {
        self.position_in(self.copy().as_deref(), name, prefix)
    }

    /// The names' position and its first revision, from one copy.
    pub fn place(&self, name: &str, prefix: bool) -> Place {
        let copy = self.copy();
        let copy = copy.as_deref();
        let routes = copy
            .map(|c| routes_of(&c.map, name, prefix))
            .unwrap_or_default();
        let seen = self.first_seen.lock().expect("first-seen lock");
        let since = routes
            .iter()
            .map(|r| {
                let known = seen.get(&(r.prefix.clone(), r.epoch)).copied();
                known.unwrap_or_else(|| copy.map_or(0, |c| c.mod_revision))
            })
            .fold(self.epoch_revision, i64::max);
        Place {
            position: self.position_in(copy, name, prefix),
            since,
        }
    }

    fn position_in(&self, copy: Option<&StoredMap>, name: &str, prefix: bool) -> String {
        let route_epoch = copy.map_or(0, |copy| {
            routes_of(&copy.map, name, prefix)
                .iter()
                .map(|r| r.epoch)
                .fold(0, u64::max)
        });
        format!("{}/{}/{route_epoch}", self.cluster_id, self.cell_epoch)
    }

    /// When this cell's own copy routes `name` here but paused (a move of its prefix has
    /// begun), the epoch of the holds it granted before: they are still this cell's,
    /// though it grants nothing new.
    pub fn paused_here(&self, name: &str) -> Option<u64> {
        let copy = self.copy()?;
        let route = copy.map.route(name)?;
        let mine = own_cell(&copy.map, &self.cluster_id)? == route.cell;
        (mine && route.paused).then(|| copy.map.token_epoch(self.cell_epoch, name))
    }

    /// The epoch of tokens of `name` granted under the copy in force (for the tokens of
    /// holders already there).
    pub fn token_epoch(&self, name: &str) -> u64 {
        match self.copy() {
            Some(copy) => copy.map.token_epoch(self.cell_epoch, name),
            None => self.cell_epoch,
        }
    }
}

impl Routes {
    /// Reads the cell's copy now and takes it in; returns the revision it was read at.
    pub async fn refresh(
        &self,
        kv: &mut etcd_client::KvClient,
        timeout: Duration,
    ) -> Result<i64, lockcell_cell::CellError> {
        let key = lockcell_cell::keyspace::shardmap_key();
        let resp = lockcell_cell::error::with_timeout("read shard map", timeout, kv.get(key, None))
            .await?;
        let at = lockcell_cell::error::header_revision(resp.header(), "read shard map")?;
        let copy = match resp.kvs().first() {
            Some(kv) => Some(StoredMap {
                map: ShardMap::decode(kv.value())?,
                mod_revision: kv.mod_revision(),
            }),
            None => None,
        };
        self.update(copy, at);
        Ok(at)
    }

    /// Takes in a change of the copy seen in the cell's log at `revision` (`value`
    /// `None`: deleted).
    pub fn changed(&self, value: Option<&[u8]>, revision: i64) {
        let copy = match value.map(ShardMap::decode) {
            Some(Ok(map)) => Some(StoredMap {
                map,
                mod_revision: revision,
            }),
            Some(Err(e)) => {
                tracing::warn!(error = %e, revision, "the cell's shard map copy does not decode; keeping the last one");
                return;
            }
            None => None,
        };
        self.update(copy, revision);
    }
}

/// Refuses a position a client sent that is not of the form replies give
/// (`CLUSTER/EPOCH/ROUTE-EPOCH`: hex, then two numbers).
pub fn check_position_syntax(cell: &str) -> Result<(), ProxyError> {
    let parts: Vec<&str> = cell.split('/').collect();
    let well_formed = matches!(&parts[..], [cluster, epoch, route]
        if !cluster.is_empty()
            && cluster.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
            && epoch.parse::<u64>().is_ok()
            && route.parse::<u64>().is_ok());
    if well_formed {
        Ok(())
    } else {
        Err(ProxyError::BadArgument(format!(
            "cell {cell:?} is not a cell position: expected CLUSTER/EPOCH/ROUTE-EPOCH as a read's or watch's reply gives it (lowercase hex, then two numbers)"
        )))
    }
}

/// The routes that serve `name` (with `prefix`, any name under it): the one that
/// matches it, and every longer one under it.
fn routes_of<'m>(
    map: &'m ShardMap,
    name: &str,
    prefix: bool,
) -> Vec<&'m lockcell_cell::shardmap::Route> {
    let mut routes: Vec<_> = map.route(name).into_iter().collect();
    if prefix {
        routes.extend(
            map.routes
                .iter()
                .filter(|r| r.prefix.starts_with(name) && r.prefix.len() > name.len()),
        );
    }
    routes
}

/// The cell of `map` whose cluster id is `cluster_id`.
pub fn own_cell<'m>(map: &'m ShardMap, cluster_id: &str) -> Option<&'m str> {
    map.cells
        .iter()
        .find(|(_, spec)| spec.cluster_id == cluster_id)
        .map(|(name, _)| name.as_str())
}

/// Follows the cell's copy of the shard map until `stop`: a read, then a watch from
/// there; again after any break.
pub async fn follow(
    routes: Arc<Routes>,
    etcd: etcd_client::Client,
    timeout: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let key = lockcell_cell::keyspace::shardmap_key();
    let mut pauses = crate::pause::Pauses::new(Duration::from_millis(200), Duration::from_secs(5));
    loop {
        let follow_once = async {
            let at = routes.refresh(&mut etcd.kv_client(), timeout).await?;
            let mut client = etcd.watch_client();
            let options = WatchOptions::new().with_start_revision(at + 1);
            let mut stream = client.watch(key, Some(options)).await.map_err(|source| {
                lockcell_cell::CellError::Etcd {
                    op: "watch shard map",
                    source,
                }
            })?;
            let _counted = crate::metrics::Counted::in_gauge(crate::metrics::ETCD_WATCHES);
            while let Ok(Some(resp)) = stream.message().await {
                for event in resp.events() {
                    let Some(kv) = event.kv() else { continue };
                    let copy = match event.event_type() {
                        etcd_client::EventType::Put => Some(StoredMap {
                            map: ShardMap::decode(kv.value())?,
                            mod_revision: kv.mod_revision(),
                        }),
                        etcd_client::EventType::Delete => None,
                    };
                    tracing::info!(
                        version = copy.as_ref().map(|c| c.map.version),
                        revision = kv.mod_revision(),
                        "the cell's shard map copy changed"
                    );
                    routes.update(copy, kv.mod_revision());
                }
                if resp.compact_revision() > 0 || resp.canceled() {
                    break;
                }
            }
            Ok::<_, lockcell_cell::CellError>(())
        };
        tokio::select! {
            result = follow_once => match result {
                Ok(()) => pauses.reset(),
                Err(e) => tracing::warn!(error = %e, "following the cell's shard map failed; retrying"),
            },
            _ = stop.wait_for(|s| *s) => return,
        }
        tokio::select! {
            _ = tokio::time::sleep(pauses.next_pause()) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockcell_cell::shardmap::{CellSpec, Route};

    fn map(version: u64, routes: &[(&str, &str, bool, u64)]) -> ShardMap {
        let cell = |id: &str| CellSpec {
            endpoints: vec!["http://127.0.0.1:2379".into()],
            cluster_id: id.into(),
        };
        ShardMap {
            version,
            cells: [("a".to_owned(), cell("ca")), ("b".to_owned(), cell("cb"))].into(),
            routes: routes
                .iter()
                .map(|(prefix, cell, paused, epoch)| Route {
                    prefix: (*prefix).into(),
                    cell: (*cell).into(),
                    paused: *paused,
                    epoch: *epoch,
                })
                .collect(),
        }
    }

    /// Cell a's view: everything but billing/ here, hr/ paused.
    fn cell_a() -> Routes {
        Routes::new(
            "ca",
            100,
            Some(StoredMap {
                map: map(
                    3,
                    &[
                        ("", "a", false, 0),
                        ("billing/", "b", false, 0),
                        ("hr/", "a", true, 0),
                    ],
                ),
                mod_revision: 42,
            }),
        )
    }

    #[test]
    fn a_cell_serves_what_its_own_copy_routes_to_it_unpaused() {
        let routes = cell_a();
        assert_eq!(own_cell(&routes.copy().unwrap().map, "ca"), Some("a"));
        assert_eq!(
            routes.serve("orders/1").unwrap(),
            Served {
                map_revision: 42,
                epoch: 100
            }
        );
        let elsewhere = routes.serve("billing/7").unwrap_err().to_string();
        assert!(elsewhere.contains("\"b\""), "{elsewhere}");
        let moving = routes.serve("hr/x").unwrap_err().to_string();
        assert!(
            moving.contains("moving") && moving.contains("hr/"),
            "{moving}"
        );
        assert_eq!(routes.paused_here("hr/x"), Some(100));
        assert_eq!(routes.paused_here("orders/1"), None, "not paused");
        assert_eq!(routes.paused_here("billing/7"), None, "not this cell's");
        // Not in its own copy: serves nothing.
        let stranger = Routes::new("cz", 1, routes.copy().map(|c| (*c).clone()));
        assert!(stranger.serve("orders/1").is_err());
        // No copy: everything, under mod revision 0; but nothing in a cell of a map.
        let alone = Routes::new("ca", 7, None);
        assert_eq!(alone.serve("x").unwrap().map_revision, 0);
        let lost = Routes::new("ca", 7, None).in_map().serve("x").unwrap_err();
        assert!(lost.to_string().contains("no copy"), "{lost}");
        // One copy for every name of a transaction.
        assert!(routes.serve_all(["orders/1", "orders/2"]).is_ok());
        assert!(routes.serve_all(["orders/1", "billing/7"]).is_err());
    }

    #[test]
    fn a_position_begins_where_its_routes_took_their_epochs_here() {
        let routes = cell_a().epoch_since(5);
        // At start only the loaded copy is known: positions begin at its revision.
        let start = routes.place("orders/", true);
        assert_eq!(
            start,
            Place {
                position: "ca/100/0".into(),
                since: 42
            }
        );
        // billing/sub/ moves here at revision 50 (epoch 7): positions of billing/sub/
        // and of prefixes over it begin there; orders/ keeps its beginning.
        let moved = map(
            4,
            &[
                ("", "a", false, 0),
                ("billing/", "b", false, 0),
                ("billing/sub/", "a", false, 7),
                ("hr/", "a", true, 0),
            ],
        );
        routes.update(
            Some(StoredMap {
                map: moved.clone(),
                mod_revision: 50,
            }),
            50,
        );
        assert_eq!(routes.place("orders/", true), start);
        assert_eq!(
            routes.place("billing/sub/x", false),
            Place {
                position: "ca/100/7".into(),
                since: 50
            }
        );
        assert_eq!(routes.place("billing/", true).since, 50);
        // A later copy (another prefix paused) keeps where each epoch began.
        let mut later = moved;
        later.version = 5;
        later.routes[3].paused = false;
        routes.update(
            Some(StoredMap {
                map: later,
                mod_revision: 60,
            }),
            60,
        );
        assert_eq!(routes.place("billing/sub/", true).since, 50);
        // Without a copy, the cell's epoch is where positions begin.
        assert_eq!(
            Routes::new("ca", 7, None)
                .epoch_since(9)
                .place("x", false)
                .since,
            9
        );
        assert!(check_position_syntax("ca/100/7").is_ok());
        for bad in [
            "",
            "ca",
            "ca/100",
            "CA/100/7",
            "ca/x/7",
            "ca/100/7/",
            "bogus",
        ] {
            assert!(check_position_syntax(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_moved_route_mints_tokens_in_its_raised_epoch_and_older_reads_do_not_win() {
        let routes = Routes::new(
            "cb",
            100,
            Some(StoredMap {
                map: map(1, &[("", "a", false, 0)]),
                mod_revision: 10,
            }),
        );
        assert!(routes.serve("billing/7").is_err());
        routes.update(
            Some(StoredMap {
                map: map(3, &[("", "a", false, 0), ("billing/", "b", false, 500)]),
                mod_revision: 20,
            }),
            20,
        );
        assert_eq!(routes.serve("billing/7").unwrap().epoch, 500);
        assert_eq!(routes.token_epoch("billing/7"), 500);
        // A read from before the watch's event changes nothing.
        routes.update(
            Some(StoredMap {
                map: map(2, &[("", "a", false, 0)]),
                mod_revision: 15,
            }),
            15,
        );
        assert_eq!(routes.copy().unwrap().mod_revision, 20);
        routes.update(None, 25);
        assert!(routes.copy().is_none());
    }

    #[test]
    fn reads_are_answered_only_where_the_copy_routes_every_name_read() {
        let routes = cell_a().in_map();
        assert!(routes.read_here("orders/1", false).is_ok());
        assert!(
            routes.read_here("hr/x", false).is_ok(),
            "a paused prefix takes no writes anywhere: its data is here"
        );
        let moved = routes.read_here("billing/7", false).unwrap_err();
        assert!(
            matches!(moved, ProxyError::Moving(ref m) if m.contains("moved")),
            "{moved}"
        );
        assert!(routes.read_here("orders/", true).is_ok());
        assert!(
            routes.read_here("", true).is_err(),
            "part of every name is in cell b"
        );
        // The change the feed sees in the cell's log moves billing/ out of b here.
        let moved_back = map(4, &[("", "a", false, 0)]);
        routes.changed(Some(&moved_back.encode()), 50);
        assert!(routes.read_here("billing/7", false).is_ok());
        assert!(routes.read_here("", true).is_ok());
        routes.changed(Some(b"not a map"), 60);
        assert_eq!(routes.copy().unwrap().mod_revision, 50, "kept the last one");
    }
}
