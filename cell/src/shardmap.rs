//! The shard map: which cell (its own etcd cluster) serves which lock and small-key
//! names. Every cell of a map holds its own copy at `/sys/shardmap`, and a proxy grants
//! and writes in a cell only what that cell's copy routes to it, unpaused.
//!
//! A route's prefix matches a name by plain string prefix; the longest matching prefix
//! wins, and the prefix `""` matches every name. The fencing token of a grant of name N
//! in cell C starts with `max(C's epoch, route(N).epoch)`: a move raises the route's
//! epoch above both cells' epochs, so tokens keep rising although the target's
//! revisions have nothing to do with the source's.
//!
//! Operators write the map as a TOML file and hand it to `lockcell-cell shardmap set`,
//! which fills in what the file leaves out (the version, each cell's cluster id, and the
//! epochs and pauses of routes that stay where they are):
//!
//! ```toml
//! [cells.a]
//! endpoints = ["http://127.0.0.1:2379"]
//! [cells.b]
//! endpoints = ["http://10.0.0.2:2379", "http://10.0.0.3:2379"]
//! [[route]]
//! prefix = ""          # everything not routed elsewhere
//! cell = "a"
//! [[route]]
//! prefix = "billing/"
//! cell = "b"
//! ```
//!
//! Cell names use `a-z`, `0-9` and `-`. A non-empty prefix is a lock name, optionally
//! followed by `/` (`billing/` serves `billing/x` but not `billing-x`; `billing` serves
//! both and `billing` itself). Unknown fields are refused. [`plan`] decides what `set` and
//! `move` do; [`store`] carries it out in etcd.

use std::collections::BTreeMap;
use std::time::Duration;

use etcd_client::KvClient;
use serde::{Deserialize, Serialize};

use crate::error::{with_timeout, CellError};
use crate::keyspace::{self, LockName, NameError};

pub mod plan;
pub mod store;

/// The shard map as stored (JSON) in every cell it names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardMap {
    /// Raised by every write; the highest version among the cells' copies is the map in
    /// force, and copies at other versions show a change still under way.
    pub version: u64,
    /// The cells by name.
    pub cells: BTreeMap<String, CellSpec>,
    /// Which cell serves which names; prefixes are unique.
    pub routes: Vec<Route>,
}

/// One cell: an etcd cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CellSpec {
    /// Its etcd client endpoints.
    pub endpoints: Vec<String>,
    /// The cluster id of its epoch record: how a proxy finds its own cell in the map,
    /// and how `set` notices endpoints that reach another cluster.
    #[serde(default)]
    pub cluster_id: String,
}

/// The names starting with `prefix` (and under no longer route) are `cell`'s.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Route {
    pub prefix: String,
    pub cell: String,
    /// Set while the names move out of `cell`: nothing is granted or written under them.
    #[serde(default)]
    pub paused: bool,
    /// A floor for the epoch of its names' tokens, raised by each move so that tokens
    /// rise across cells.
    #[serde(default)]
    pub epoch: u64,
}

/// The copy of the map a cell holds, and the etcd mod revision it was written at (which
/// every grant and write in that cell compares).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMap {
    pub map: ShardMap,
    pub mod_revision: i64,
}

/// Why a shard map was refused. Each message names the cell, prefix or field at fault
/// and the rule it broke.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShardMapError {
    #[error("the shard map file is not valid: {0}")]
    File(String),
    #[error("the shard map has no cells: list at least one as [cells.NAME] with its endpoints")]
    NoCells,
    #[error("cell name {cell:?} is not allowed: a cell name is non-empty and uses only a-z, 0-9 and '-'")]
    BadCellName { cell: String },
    #[error("cell {cell:?} has no endpoints: give it endpoints = [\"http://HOST:2379\", ...]")]
    NoEndpoints { cell: String },
    #[error("cell {cell:?} has an empty endpoint in its endpoints")]
    EmptyEndpoint { cell: String },
    #[error("cells {first:?} and {second:?} are the same etcd cluster (cluster id {cluster_id}); each cell is a cluster of its own")]
    SameCluster {
        first: String,
        second: String,
        cluster_id: String,
    },
    #[error("the prefix {prefix:?} has more than one route; each prefix is routed once")]
    DuplicatePrefix { prefix: String },
    #[error("the route of prefix {prefix:?} names cell {cell:?}, which is not one of the map's cells ({known})")]
    UnknownCell {
        prefix: String,
        cell: String,
        known: String,
    },
    #[error("the route prefix {prefix:?} is not a name prefix: {reason} (a prefix is \"\" for every name, or a lock name optionally followed by '/')")]
    BadPrefix { prefix: String, reason: NameError },
}

/// The operator's file: no version, pause, epoch or cluster id (`set` fills them in).
#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct MapFile {
    #[serde(default)]
    cells: BTreeMap<String, CellFile>,
    #[serde(default, rename = "route")]
    routes: Vec<RouteFile>,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct CellFile {
    endpoints: Vec<String>,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RouteFile {
    prefix: String,
    cell: String,
}

impl ShardMap {
    /// The map as an operator's file, which [`ShardMap::from_toml`] (and so `shardmap
    /// set`) takes back: its cells' endpoints and its routes, without what `set` fills
    /// in (version, cluster ids, pauses, epochs).
    pub fn to_toml(&self) -> String {
        let file = MapFile {
            cells: self
                .cells
                .iter()
                .map(|(name, spec)| {
                    let cell = CellFile {
                        endpoints: spec.endpoints.clone(),
                    };
                    (name.clone(), cell)
                })
                .collect(),
            routes: self
                .routes
                .iter()
                .map(|r| RouteFile {
                    prefix: r.prefix.clone(),
                    cell: r.cell.clone(),
                })
                .collect(),
        };
        toml::to_string(&file).expect("a shard map file serializes")
    }

    /// Reads an operator's file (see the module doc) and validates it: version 0, no
    /// cluster ids, every route unpaused at epoch 0.
    pub fn from_toml(text: &str) -> Result<ShardMap, ShardMapError> {
        let file: MapFile = toml::from_str(text).map_err(|e| ShardMapError::File(e.to_string()))?;
        let map = ShardMap {
            version: 0,
            cells: file
                .cells
                .into_iter()
                .map(|(name, cell)| {
                    let spec = CellSpec {
                        endpoints: cell.endpoints,
                        cluster_id: String::new(),
                    };
                    (name, spec)
                })
                .collect(),
            routes: file
                .routes
                .into_iter()
                .map(|r| Route {
                    prefix: r.prefix,
                    cell: r.cell,
                    paused: false,
                    epoch: 0,
                })
                .collect(),
        };
        map.validate()?;
        Ok(map)
    }

    /// Checks the rules of the module doc, and that no two cells are one cluster.
    pub fn validate(&self) -> Result<(), ShardMapError> {
        if self.cells.is_empty() {
            return Err(ShardMapError::NoCells);
        }
        let mut clusters: BTreeMap<&str, &str> = BTreeMap::new();
        for (name, cell) in &self.cells {
            let allowed = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-';
            if name.is_empty() || !name.bytes().all(allowed) {
                return Err(ShardMapError::BadCellName { cell: name.clone() });
            }
            if cell.endpoints.is_empty() {
                return Err(ShardMapError::NoEndpoints { cell: name.clone() });
            }
            if cell.endpoints.iter().any(|e| e.trim().is_empty()) {
                return Err(ShardMapError::EmptyEndpoint { cell: name.clone() });
            }
            if cell.cluster_id.is_empty() {
                continue;
            }
            if let Some(first) = clusters.insert(&cell.cluster_id, name) {
                return Err(ShardMapError::SameCluster {
                    first: first.to_owned(),
                    second: name.clone(),
                    cluster_id: cell.cluster_id.clone(),
                });
            }
        }
        for (i, route) in self.routes.iter().enumerate() {
            check_prefix(&route.prefix)?;
            if self.routes[..i].iter().any(|r| r.prefix == route.prefix) {
                return Err(ShardMapError::DuplicatePrefix {
                    prefix: route.prefix.clone(),
                });
            }
            if !self.cells.contains_key(&route.cell) {
                let known: Vec<&str> = self.cells.keys().map(String::as_str).collect();
                return Err(ShardMapError::UnknownCell {
                    prefix: route.prefix.clone(),
                    cell: route.cell.clone(),
                    known: known.join(", "),
                });
            }
        }
        Ok(())
    }

    /// The route that serves `name`: the one with the longest prefix of it.
    pub fn route(&self, name: &str) -> Option<&Route> {
        self.routes
            .iter()
            .filter(|r| name.starts_with(&r.prefix))
            .max_by_key(|r| r.prefix.len())
    }

    /// The stored form (JSON) of the copies at `/sys/shardmap`.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("shard map serializes")
    }

    /// Reads a stored copy; a copy that is not JSON of a valid map is a
    /// [`CellError::CorruptRecord`] naming `/sys/shardmap`.
    pub fn decode(bytes: &[u8]) -> Result<ShardMap, CellError> {
        let corrupt = |reason: String| CellError::CorruptRecord {
            key: keyspace::shardmap_key().to_owned(),
            reason,
        };
        let map: ShardMap = serde_json::from_slice(bytes).map_err(|e| corrupt(e.to_string()))?;
        map.validate().map_err(|e| corrupt(e.to_string()))?;
        Ok(map)
    }

    /// The epoch of the tokens of `name` granted in a cell at `cell_epoch`.
    pub fn token_epoch(&self, cell_epoch: u64, name: &str) -> u64 {
        cell_epoch.max(self.route(name).map_or(0, |r| r.epoch))
    }
}

/// Checks a route prefix: `""`, or a lock name optionally followed by one `/`.
pub fn check_prefix(prefix: &str) -> Result<(), ShardMapError> {
    if prefix.is_empty() {
        return Ok(());
    }
    let name = prefix.strip_suffix('/').unwrap_or(prefix);
    LockName::parse(name)
        .map(drop)
        .map_err(|reason| ShardMapError::BadPrefix {
            prefix: prefix.to_owned(),
            reason,
        })
}

/// Reads the cell's copy of the shard map; `None` when the cell has none (it serves
/// every name).
pub async fn read(kv: &mut KvClient, timeout: Duration) -> Result<Option<StoredMap>, CellError> {
    let key = keyspace::shardmap_key();
    let resp = with_timeout("read shard map", timeout, kv.get(key, None)).await?;
    resp.kvs()
        .first()
        .map(|kv| {
            Ok(StoredMap {
                map: ShardMap::decode(kv.value())?,
                mod_revision: kv.mod_revision(),
            })
        })
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"
        [cells.a]
        endpoints = ["http://127.0.0.1:2379"]
        [cells.b]
        endpoints = ["http://10.0.0.2:2379", "http://10.0.0.3:2379"]
        [[route]]
        prefix = ""
        cell = "a"
        [[route]]
        prefix = "billing/"
        cell = "b"
        [[route]]
        prefix = "billing/eu/"
        cell = "a"
    "#;

    fn refused(text: &str) -> String {
        ShardMap::from_toml(text).unwrap_err().to_string()
    }

    #[test]
    fn the_longest_matching_prefix_wins() {
        let map = ShardMap::from_toml(FILE).unwrap();
        let cell = |name: &str| map.route(name).map(|r| r.cell.as_str());
        assert_eq!(cell("orders/1"), Some("a"), "\"\" matches every name");
        assert_eq!(cell("billing/invoice-7"), Some("b"));
        assert_eq!(cell("billing/eu/invoice-8"), Some("a"), "a carved prefix");
        assert_eq!(cell("billing-x"), Some("a"), "'billing/' is a plain prefix");
        assert_eq!(map.route("billing/eu/x").unwrap().prefix, "billing/eu/");
        let without_default = ShardMap {
            routes: map.routes[1..].to_vec(),
            ..map.clone()
        };
        assert_eq!(without_default.route("orders/1"), None);
        assert_eq!(map.version, 0);
        assert!(map.cells.values().all(|c| c.cluster_id.is_empty()));
        assert_eq!(map.cells["b"].endpoints.len(), 2);
    }

    #[test]
    fn each_rule_is_refused_by_name() {
        let unknown_cell = refused("[cells.a]\nendpoints=['x']\n[[route]]\nprefix='p/'\ncell='z'");
        assert!(
            unknown_cell.contains("\"z\"") && unknown_cell.contains("\"p/\""),
            "{unknown_cell}"
        );
        let twice = refused(
            "[cells.a]\nendpoints=['x']\n[[route]]\nprefix='p/'\ncell='a'\n[[route]]\nprefix='p/'\ncell='a'",
        );
        assert!(
            twice.contains("\"p/\"") && twice.contains("more than one"),
            "{twice}"
        );
        for (prefix, rule) in [("/p", "empty segment"), ("p!/", "'!'"), ("a/../b/", "'..'")] {
            let bad = refused(&format!(
                "[cells.a]\nendpoints=['x']\n[[route]]\nprefix='{prefix}'\ncell='a'"
            ));
            assert!(bad.contains(prefix) && bad.contains(rule), "{bad}");
        }
        let field = refused("[cells.a]\nendpoints=['x']\nweight=3");
        assert!(field.contains("weight"), "{field}");
        let top = refused("version=3\n[cells.a]\nendpoints=['x']");
        assert!(top.contains("version"), "{top}");
        let route_field =
            refused("[cells.a]\nendpoints=['x']\n[[route]]\nprefix=''\ncell='a'\nepoch=9");
        assert!(route_field.contains("epoch"), "{route_field}");
        let no_endpoints = refused("[cells.a]\nendpoints=[]");
        assert!(no_endpoints.contains("\"a\"") && no_endpoints.contains("no endpoints"));
        assert!(refused("").contains("no cells"));
        let name = refused("[cells.Big]\nendpoints=['x']");
        assert!(name.contains("\"Big\"") && name.contains("a-z"), "{name}");
    }

    #[test]
    fn two_cells_may_not_be_one_cluster() {
        let mut map = ShardMap::from_toml(FILE).unwrap();
        for cell in map.cells.values_mut() {
            cell.cluster_id = "c1".into();
        }
        let msg = map.validate().unwrap_err().to_string();
        assert!(
            msg.contains("\"a\"") && msg.contains("\"b\"") && msg.contains("c1"),
            "{msg}"
        );
    }

    #[test]
    fn a_copy_round_trips_and_a_bad_one_names_its_key() {
        let mut map = ShardMap::from_toml(FILE).unwrap();
        map.version = 4;
        map.routes[1].paused = true;
        map.routes[1].epoch = 1_700_000_000;
        map.cells.get_mut("a").unwrap().cluster_id = "c1".into();
        assert_eq!(ShardMap::decode(&map.encode()).unwrap(), map);
        for bad in [
            &b"{not json"[..],
            br#"{"version":1,"cells":{},"routes":[]}"#,
        ] {
            match ShardMap::decode(bad) {
                Err(CellError::CorruptRecord { key, .. }) => assert_eq!(key, "/sys/shardmap"),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn tokens_take_the_higher_of_the_cell_and_route_epochs() {
        let mut map = ShardMap::from_toml(FILE).unwrap();
        map.routes[1].epoch = 500;
        assert_eq!(map.token_epoch(100, "billing/x"), 500);
        assert_eq!(map.token_epoch(900, "billing/x"), 900);
        assert_eq!(map.token_epoch(100, "orders/x"), 100);
        map.routes.remove(0);
        assert_eq!(
            map.token_epoch(100, "orders/x"),
            100,
            "unrouted: the cell's"
        );
    }
}
