//! What `lockcell-cell shardmap set` and `move` decide, from the copies of the map they
//! read in the cells: pure functions, no etcd. The binary carries the decisions out
//! through [`super::store`].
//!
//! The map in force is the copy with the highest version. A `move` writes the copies in
//! an order that leaves at most one cell serving a name at any time, also against a
//! concurrent `move` or `move --abort` ([`switch_order`], [`plan_abort`] say why), so the
//! copies it leaves behind say how far it got, and [`move_state`] reads that back to
//! continue.

use std::collections::{BTreeMap, BTreeSet};

use super::{check_prefix, Route, ShardMap, ShardMapError};
use crate::epoch::next_epoch;
use crate::keyspace::{self, KeyKind};

/// Each cell's copy of the map, by cell name (`None`: the cell has none).
pub type Copies = BTreeMap<String, Option<ShardMap>>;

/// How many names a refusal lists before it only counts the rest.
const SHOWN_NAMES: usize = 5;

/// A cell as `set` read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CellView {
    /// From the cell's epoch record.
    pub cluster_id: String,
    /// The cell's epoch.
    pub epoch: u64,
    pub copy: Option<ShardMap>,
}

/// Why `set` or `move` refused. Each message names the prefix and cells concerned and
/// what to do instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Map(#[from] ShardMapError),
    #[error("cell {cell:?} of the new map was not reached")]
    NotReached { cell: String },
    #[error("cell {cell:?} is cluster {was} in the current map, but its endpoints now reach cluster {now}; a cell stays one cluster (give the other cluster a cell name of its own)")]
    ClusterChanged {
        cell: String,
        was: String,
        now: String,
    },
    #[error("this would move the names under {prefix:?} from cell {old:?} to {}; use `lockcell-cell shardmap move {prefix:?} --to CELL`, which moves them without a lock held in two cells", new.as_deref().map_or("no cell at all".to_owned(), |c| format!("cell {c:?}")))]
    ChangesCell {
        prefix: String,
        old: String,
        new: Option<String>,
    },
    #[error("this would change the route epoch (the floor of their tokens' epoch) of the names under {prefix:?} in cell {cell:?} from {old} (route {old_route:?}) to {new} (route {new_route:?}): a held lock's token would change under its holder, and a lower epoch lets tokens go back; keep the route {old_route:?} as it is, and use `lockcell-cell shardmap move` to change where or how names are served")]
    ChangesEpoch {
        prefix: String,
        cell: String,
        old: u64,
        old_route: String,
        new: u64,
        new_route: String,
    },
    #[error("a move of {prefix:?} out of cell {cell:?} is unfinished (its route is paused there, and the copies disagree: {versions}); run the same `lockcell-cell shardmap move` again to finish it, or add --abort to undo it")]
    UnfinishedMove {
        prefix: String,
        cell: String,
        versions: String,
    },
    #[error("no cell has a shard map yet, so the --etcd cell (cluster {cluster_id}) serves every name; it must be one of the new map's cells (point --etcd at a cell of the map)")]
    StartNotInMap { cluster_id: String },
    #[error("the --etcd cell (cluster {cluster_id}) is in neither the current shard map nor the new one; point --etcd at a cell of the map")]
    StartElsewhere { cluster_id: String },
    #[error("cell {cell:?} has no shard map yet, so it has served every name, and it holds keys of names the new map does not route to it: {names} ({count} in all); route them to {cell:?} or empty them first")]
    Misrouted {
        cell: String,
        names: String,
        count: usize,
    },
    #[error("no cell has a shard map; write one with `lockcell-cell shardmap set FILE`")]
    NoMap,
    #[error("cell {cell:?} is not in the shard map (its cells: {known}); add it with `lockcell-cell shardmap set FILE` first")]
    UnknownTarget { cell: String, known: String },
    #[error("no route serves {prefix:?}, so no cell holds its names; route it with `lockcell-cell shardmap set FILE`")]
    NoRoute { prefix: String },
    #[error("the names under {prefix:?} are already served by cell {cell:?} (route {route:?}): nothing to move")]
    AlreadyThere {
        prefix: String,
        cell: String,
        route: String,
    },
    #[error("the route {prefix:?} is paused in cell {cell:?} for a move out of it, and --to {cell} cannot finish that move: run it with its target, or add --abort to undo it")]
    SourceIsTarget { prefix: String, cell: String },
    #[error("the names under {prefix:?} are served by the route {route:?}, which is paused: a move of it out of cell {cell:?} is unfinished; finish it (run it again) or undo it (--abort) first")]
    RoutePaused {
        prefix: String,
        route: String,
        cell: String,
    },
    #[error("the route {prefix:?} is not paused: there is no move of it to abort")]
    NothingToAbort { prefix: String },
    #[error("the names under {prefix:?} have already switched to cell {cell:?}, so the move can no longer be aborted: run it again without --abort to finish it (and move them back with another move if need be)")]
    AlreadySwitched { prefix: String, cell: String },
    #[error("the move of {prefix:?} is out of cell {cell:?}; --to names the cell it was moving to (whose keys copied by the move are deleted), not {cell:?}")]
    AbortToSource { prefix: String, cell: String },
}

/// The map in force: the copy with the highest version.
pub fn current(copies: &Copies) -> Option<&ShardMap> {
    copies.values().flatten().max_by_key(|map| map.version)
}

/// The version of the next write: above every copy's.
pub fn next_version(copies: &Copies) -> u64 {
    current(copies).map_or(0, |map| map.version) + 1
}

/// Which cell holds which version, e.g. `a: version 5, b: version 6, c: none`.
pub fn versions(copies: &Copies) -> String {
    let each: Vec<String> = copies
        .iter()
        .map(|(cell, copy)| match copy {
            Some(map) => format!("{cell}: version {}", map.version),
            None => format!("{cell}: none"),
        })
        .collect();
    each.join(", ")
}

/// Whether every cell holds the same copy.
pub fn agree(copies: &Copies) -> bool {
    let mut all = copies.values();
    let first = all.next();
    all.all(|copy| Some(copy) == first)
}

/// What `set` does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SetPlan {
    /// Every cell already holds this map: nothing to write.
    Unchanged(ShardMap),
    /// Write this map to every cell read.
    Write(ShardMap),
}

/// Plans `set`: the operator's map (`file`, see [`ShardMap::from_toml`]) with the
/// cluster ids read from the cells, and the epochs and pauses of routes that stay where
/// they were. `cells` are those of the new map and of every copy found; `start` is the
/// cluster id of the --etcd cell.
///
/// Refuses any change of the cell that serves a name already served (that is a
/// `move`), a cell name that now reaches another cluster, and a set in the middle of a
/// move. The first map of a deployment is refused unless it names the --etcd cell, which
/// served every name until then; its routes to other cells start above that cell's
/// epoch, so the tokens of names it granted keep rising wherever they go.
pub fn plan_set(
    file: &ShardMap,
    cells: &BTreeMap<String, CellView>,
    start: &str,
) -> Result<SetPlan, PlanError> {
    let mut new = file.clone();
    for (name, spec) in &mut new.cells {
        let view = cells
            .get(name)
            .ok_or_else(|| PlanError::NotReached { cell: name.clone() })?;
        spec.cluster_id = view.cluster_id.clone();
    }
    new.validate()?;
    let copies: Copies = cells
        .iter()
        .map(|(name, view)| (name.clone(), view.copy.clone()))
        .collect();
    let Some(old) = current(&copies) else {
        return first_map(new, cells, start).map(SetPlan::Write);
    };
    for (name, spec) in &new.cells {
        match old.cells.get(name) {
            Some(was) if !was.cluster_id.is_empty() && was.cluster_id != spec.cluster_id => {
                return Err(PlanError::ClusterChanged {
                    cell: name.clone(),
                    was: was.cluster_id.clone(),
                    now: spec.cluster_id.clone(),
                });
            }
            _ => {}
        }
    }
    if !cells.values().any(|view| view.cluster_id == start) {
        return Err(PlanError::StartElsewhere {
            cluster_id: start.to_owned(),
        });
    }
    if let Some(refusal) = unfinished_move(&copies, old) {
        return Err(refusal);
    }
    carry_over(old, &mut new, cells);
    check_serving(old, &new)?;
    new.version = old.version;
    if copies.values().all(|copy| copy.as_ref() == Some(&new)) {
        return Ok(SetPlan::Unchanged(new));
    }
    new.version = next_version(&copies);
    Ok(SetPlan::Write(new))
}

/// The first map of a deployment, whose --etcd cell (`start`) served every name so far.
fn first_map(
    mut new: ShardMap,
    cells: &BTreeMap<String, CellView>,
    start: &str,
) -> Result<ShardMap, PlanError> {
    let Some((start_name, _)) = new.cells.iter().find(|(_, c)| c.cluster_id == start) else {
        return Err(PlanError::StartNotInMap {
            cluster_id: start.to_owned(),
        });
    };
    let start_name = start_name.clone();
    let epoch_of = |cell: &str| cells.get(cell).map_or(0, |view| view.epoch);
    let start_epoch = epoch_of(&start_name);
    for route in &mut new.routes {
        if route.cell != start_name {
            route.epoch = next_epoch(start_epoch.max(epoch_of(&route.cell)));
        }
    }
    new.version = 1;
    Ok(new)
}

/// A move left half done: a paused route while the copies of the cells of the map in
/// force (`current`) disagree. A cell new to the map has no copy yet, and that is no
/// sign of a move.
fn unfinished_move(copies: &Copies, current: &ShardMap) -> Option<PlanError> {
    let mapped: Copies = copies
        .iter()
        .filter(|(cell, copy)| copy.is_some() || current.cells.contains_key(*cell))
        .map(|(cell, copy)| (cell.clone(), copy.clone()))
        .collect();
    if agree(&mapped) {
        return None;
    }
    copies.values().flatten().find_map(|map| {
        let route = map.routes.iter().find(|r| r.paused)?;
        Some(PlanError::UnfinishedMove {
            prefix: route.prefix.clone(),
            cell: route.cell.clone(),
            versions: versions(copies),
        })
    })
}

/// Refuses a new map (its epochs filled in by [`carry_over`]) that changes the cell of
/// a name `old` serves, or the epoch of its tokens: dropping a route a move raised would
/// lower them, a route added over served names could raise them while held (the
/// holder's release or renewal would no longer match). Checking the union of both
/// maps' prefixes is enough: for any name, the longer of its two routes' prefixes is
/// in the union, and old and new map route that prefix as they route the name.
pub fn check_serving(old: &ShardMap, new: &ShardMap) -> Result<(), PlanError> {
    let prefixes: BTreeSet<&str> = old
        .routes
        .iter()
        .chain(&new.routes)
        .map(|r| r.prefix.as_str())
        .collect();
    for prefix in prefixes {
        let Some(was) = old.route(prefix) else {
            continue;
        };
        let now = match new.route(prefix) {
            Some(now) if now.cell == was.cell => now,
            now => {
                return Err(PlanError::ChangesCell {
                    prefix: prefix.to_owned(),
                    old: was.cell.clone(),
                    new: now.map(|r| r.cell.clone()),
                })
            }
        };
        if now.epoch != was.epoch {
            return Err(PlanError::ChangesEpoch {
                prefix: prefix.to_owned(),
                cell: was.cell.clone(),
                old: was.epoch,
                old_route: was.prefix.clone(),
                new: now.epoch,
                new_route: now.prefix.clone(),
            });
        }
    }
    Ok(())
}

/// Fills in the pause and epoch of each route of `new`. A route that stays (same prefix,
/// same cell) keeps both. A new route takes the epoch of the route that served its
/// prefix in `old`, so that the names it takes over keep their tokens' epoch. A route of
/// names no route served starts above every epoch any cell (`cells`) or route has used:
/// those names were granted somewhere before (by the first cell, before there was a
/// map), and their next tokens must be above every token they ever had.
fn carry_over(old: &ShardMap, new: &mut ShardMap, cells: &BTreeMap<String, CellView>) {
    let highest = cells
        .values()
        .map(|view| view.epoch)
        .chain(old.routes.iter().map(|r| r.epoch))
        .max()
        .unwrap_or(0);
    for route in &mut new.routes {
        let same = old
            .routes
            .iter()
            .find(|r| r.prefix == route.prefix && r.cell == route.cell);
        if let Some(was) = same {
            route.paused = was.paused;
            route.epoch = was.epoch;
            continue;
        }
        if let Some(served) = old.route(&route.prefix) {
            route.epoch = served.epoch;
            continue;
        }
        route.epoch = next_epoch(highest);
    }
}

/// The order in which `set` writes the copies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetOrder {
    /// The cells without a copy, the --etcd cell first. Each serves every name until its
    /// copy is written, and grants only what its copy routes to it from then on (every
    /// grant compares the copy's revision): so each is written, then scanned for keys of
    /// names the map sends elsewhere, and a find deletes the copy just written. The
    /// --etcd cell comes first because with no map anywhere it is the cell that has
    /// served every name to the proxies started on it.
    pub claim: Vec<String>,
    /// The cells with a copy, once every claim was clean. Their order does not matter:
    /// [`check_serving`] keeps the cell and the epoch of every name their copies serve,
    /// so old and new copies side by side serve each name in one cell, at one epoch.
    pub rest: Vec<String>,
}

/// The order of `set`'s writes to `cells` (see [`SetOrder`]); `start` is the cluster id
/// of the --etcd cell.
pub fn set_order(cells: &BTreeMap<String, CellView>, start: &str) -> SetOrder {
    let mut claim: Vec<(bool, String)> = cells
        .iter()
        .filter(|(_, view)| view.copy.is_none())
        .map(|(name, view)| (view.cluster_id != start, name.clone()))
        .collect();
    claim.sort();
    let rest = cells
        .iter()
        .filter(|(_, view)| view.copy.is_some())
        .map(|(name, _)| name.clone())
        .collect();
    SetOrder {
        claim: claim.into_iter().map(|(_, name)| name).collect(),
        rest,
    }
}

/// The names among `names` (of keys in `cell`) that `map` does not route to `cell`: a
/// few of them, and how many.
pub fn misrouted<'a>(
    map: &ShardMap,
    cell: &str,
    names: impl IntoIterator<Item = &'a str>,
) -> (Vec<String>, usize) {
    let mut shown = Vec::new();
    let mut count = 0;
    let mut seen = BTreeSet::new();
    for name in names {
        if map.route(name).is_some_and(|r| r.cell == cell) || !seen.insert(name) {
            continue;
        }
        count += 1;
        if shown.len() < SHOWN_NAMES {
            shown.push(name.to_owned());
        }
    }
    (shown, count)
}

/// The refusal of `set` for a cell without a copy that holds keys `map` routes elsewhere.
pub fn check_misrouted<'a>(
    map: &ShardMap,
    cell: &str,
    names: impl IntoIterator<Item = &'a str>,
) -> Result<(), PlanError> {
    let (shown, count) = misrouted(map, cell, names);
    if count == 0 {
        return Ok(());
    }
    let names: Vec<String> = shown.iter().map(|n| format!("{n:?}")).collect();
    Err(PlanError::Misrouted {
        cell: cell.to_owned(),
        names: names.join(", "),
        count,
    })
}

/// Where a move of a route stands, as its copies tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MoveState {
    /// Nothing done yet. `paused` (the map with the route paused, added when the prefix
    /// is carved out of a shorter route) goes to the source's copy only.
    Start { source: String, paused: ShardMap },
    /// The source's copy has the route paused: wait for it to hold nothing of the
    /// route, copy its persistent keys, switch.
    Paused { source: String, paused: ShardMap },
    /// The map in force routes the prefix to the target, but some copies still say the
    /// source: write `switched` to them and delete what the source still holds.
    Switched { source: String, switched: ShardMap },
    /// Every copy routes the prefix to the target.
    Done { switched: ShardMap },
}

/// The map in force, for a move (or its abort) of `prefix` to `target`: the prefix
/// follows the rules and `target` is a cell of the map.
fn map_for<'c>(copies: &'c Copies, prefix: &str, target: &str) -> Result<&'c ShardMap, PlanError> {
    check_prefix(prefix)?;
    let map = current(copies).ok_or(PlanError::NoMap)?;
    if !map.cells.contains_key(target) {
        let known: Vec<&str> = map.cells.keys().map(String::as_str).collect();
        return Err(PlanError::UnknownTarget {
            cell: target.to_owned(),
            known: known.join(", "),
        });
    }
    Ok(map)
}

/// Where a move of `prefix` to `target` stands.
pub fn move_state(copies: &Copies, prefix: &str, target: &str) -> Result<MoveState, PlanError> {
    let map = map_for(copies, prefix, target)?;
    let exact = map.routes.iter().find(|r| r.prefix == prefix);
    match exact {
        Some(route) if route.cell == target && !route.paused => {
            let switched = map.clone();
            Ok(match switched_from(copies, map, prefix, target) {
                Some(source) => MoveState::Switched { source, switched },
                None => MoveState::Done { switched },
            })
        }
        Some(route) if route.paused && route.cell == target => Err(PlanError::SourceIsTarget {
            prefix: prefix.to_owned(),
            cell: target.to_owned(),
        }),
        Some(route) if route.paused => {
            let source = route.cell.clone();
            let own = copies.get(&source).and_then(Option::as_ref);
            let source_paused = own
                .and_then(|copy| copy.routes.iter().find(|r| r.prefix == prefix))
                .is_some_and(|r| r.paused && r.cell == source);
            let mut paused = map.clone();
            if source_paused {
                return Ok(MoveState::Paused { source, paused });
            }
            paused.version = next_version(copies);
            Ok(MoveState::Start { source, paused })
        }
        _ => {
            let serving = map.route(prefix).ok_or_else(|| PlanError::NoRoute {
                prefix: prefix.to_owned(),
            })?;
            if serving.paused {
                return Err(PlanError::RoutePaused {
                    prefix: prefix.to_owned(),
                    route: serving.prefix.clone(),
                    cell: serving.cell.clone(),
                });
            }
            if serving.cell == target {
                return Err(PlanError::AlreadyThere {
                    prefix: prefix.to_owned(),
                    cell: target.to_owned(),
                    route: serving.prefix.clone(),
                });
            }
            let source = serving.cell.clone();
            let carved = Route {
                prefix: prefix.to_owned(),
                cell: source.clone(),
                paused: true,
                epoch: serving.epoch,
            };
            let mut paused = map.clone();
            match paused.routes.iter_mut().find(|r| r.prefix == prefix) {
                Some(route) => route.paused = true,
                None => paused.routes.push(carved),
            }
            paused.version = next_version(copies);
            Ok(MoveState::Start { source, paused })
        }
    }
}

/// The cell a switched route came from, while some older copy still says so: the one
/// whose copy has it paused, else the one an older copy routes it to.
fn switched_from(copies: &Copies, map: &ShardMap, prefix: &str, target: &str) -> Option<String> {
    let mut older: Vec<&ShardMap> = copies
        .values()
        .flatten()
        .filter(|copy| copy.version < map.version)
        .collect();
    older.sort_by_key(|copy| std::cmp::Reverse(copy.version));
    let paused = older.iter().find_map(|copy| {
        copy.routes
            .iter()
            .find(|r| r.prefix == prefix && r.paused && r.cell != target)
    });
    let routed = || {
        older
            .iter()
            .filter_map(|copy| copy.route(prefix))
            .find(|r| r.cell != target && map.cells.contains_key(&r.cell))
    };
    paused.or_else(routed).map(|r| r.cell.clone())
}

/// The map after the switch: the route served by `target`, unpaused, at an epoch above
/// both cells' and its own, so that the target's tokens for its names rise above every
/// token the source gave them.
pub fn switched(
    paused: &ShardMap,
    prefix: &str,
    target: &str,
    source_epoch: u64,
    target_epoch: u64,
    version: u64,
) -> ShardMap {
    let mut map = paused.clone();
    if let Some(route) = map.routes.iter_mut().find(|r| r.prefix == prefix) {
        route.epoch = next_epoch(source_epoch.max(target_epoch).max(route.epoch));
        route.cell = target.to_owned();
        route.paused = false;
    }
    map.version = version;
    map
}

/// The cells of `copies` in the order a move writes the switched map: the source, then
/// the target, then the others. Every write compares the copy's mod revision with the
/// one this run read (or wrote), and the run stops at the first that differs.
///
/// Why each step is safe, against a concurrent move of the same route (to the same or
/// another target) and a concurrent `--abort` (which writes the target first and the
/// source last, see [`plan_abort`]):
/// - The source first. Its copy, which this move paused, stops routing the names to it,
///   and no other cell serves them yet. Its compare makes the switch one decision: two
///   moves of the route both write the source, so at most one of them goes on to write
///   a target (written first, two targets could both serve the names); and a move and
///   an abort both write the source, so at most one of them ends there.
/// - The target second: the names are served there only once the source's copy no
///   longer routes them to itself. An abort that wrote the target since this run read
///   it makes this write fail, and then the abort cannot write the source either (this
///   run changed it): the names are served by no cell until the move or the abort is
///   run again, never by two.
/// - The others last: they serve none of the names before or after; their copies tell
///   proxies where to route, and a proxy routes by the newest copy, the switched one.
pub fn switch_order(copies: &Copies, source: &str, target: &str) -> Vec<String> {
    order(copies, &[source, target], None)
}

/// The names of the cells of `copies`: those of `first` in that order, then the others,
/// then `last`.
fn order(copies: &Copies, first: &[&str], last: Option<&str>) -> Vec<String> {
    let mut cells: Vec<String> = first.iter().map(|c| (*c).to_owned()).collect();
    cells.extend(
        copies
            .keys()
            .filter(|c| !first.contains(&c.as_str()) && Some(c.as_str()) != last)
            .cloned(),
    );
    cells.extend(last.map(str::to_owned));
    cells
}

/// What `move --abort` does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Abort {
    /// The cell the move was out of: it serves the names again once its copy is written.
    pub source: String,
    /// The map with the route unpaused in the source: for every cell.
    pub unpaused: ShardMap,
    /// The cells to write it to, in this order: the target, the others, the source.
    pub order: Vec<String>,
}

/// Plans `move --abort` of the move of `prefix` to `target`: only before the target was
/// switched; and after an abort that stopped before the source, the rest of it.
///
/// Why the source comes last: every write compares the copy's mod revision as read, and
/// the abort stops at the first that fails, so the source serves the names again only
/// once every other copy, the target's first, is the abort's. A move running on writes
/// the source, then the target ([`switch_order`]), comparing both: if the move's source
/// write went first, the abort's fails there; if the move's target write went first,
/// the abort's fails there and the source stays paused; if the abort's target write
/// went first, the move's fails. So the target never serves while the source does.
///
/// Before the source, the abort deletes from the target the keys the move copied there,
/// each only while the target's copy is still the abort's: a move started meanwhile
/// writes the target's copy before it copies keys, so none of the keys it counts as
/// copied can go.
pub fn plan_abort(copies: &Copies, prefix: &str, target: &str) -> Result<Abort, PlanError> {
    let map = map_for(copies, prefix, target)?;
    let Some(route) = map.routes.iter().find(|r| r.prefix == prefix) else {
        return Err(PlanError::NothingToAbort {
            prefix: prefix.to_owned(),
        });
    };
    let source = route.cell.clone();
    // Unpaused in the map in force: an abort that stopped before the source, if the
    // source's own (older) copy still has the route paused; else nothing to abort.
    let own = copies.get(&source).and_then(Option::as_ref);
    let aborting = own
        .and_then(|copy| copy.routes.iter().find(|r| r.prefix == prefix))
        .is_some_and(|r| r.paused && r.cell == source);
    if !route.paused && !aborting {
        return Err(match switched_from(copies, map, prefix, &source) {
            Some(_) => PlanError::AlreadySwitched {
                prefix: prefix.to_owned(),
                cell: source,
            },
            None => PlanError::NothingToAbort {
                prefix: prefix.to_owned(),
            },
        });
    }
    if source == target {
        return Err(PlanError::AbortToSource {
            prefix: prefix.to_owned(),
            cell: source,
        });
    }
    let mut unpaused = map.clone();
    if route.paused {
        for r in unpaused.routes.iter_mut().filter(|r| r.prefix == prefix) {
            r.paused = false;
        }
        unpaused.version = next_version(copies);
    }
    let order = order(copies, &[target], Some(&source));
    Ok(Abort {
        source,
        unpaused,
        order,
    })
}

/// What a key of a cell is to a move of the route `prefix` (in `map`, the moving map).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moving {
    /// A holder, a waiter or an ephemeral small key of a moving name: the source must
    /// hold none before the switch.
    Held,
    /// A persistent small key (no lease) of a moving name: copied to the target, then
    /// deleted from the source.
    Persistent,
    /// Not the move's: a name under a longer route, a release marker (a clean release's
    /// trace, which lives on its proxy's lease and holds nothing; it stays in the source
    /// until that lease ends), another key.
    Other,
}

/// Sorts a key of the source: a name moves when its longest route in `map` is the route
/// `prefix` itself.
pub fn classify(map: &ShardMap, prefix: &str, key: &[u8], lease: i64) -> Moving {
    let moves = |name: &str| map.route(name).is_some_and(|r| r.prefix == prefix);
    if let Some(name) = keyspace::kv_name(key) {
        return match (moves(name), lease) {
            (false, _) => Moving::Other,
            (true, 0) => Moving::Persistent,
            (true, _) => Moving::Held,
        };
    }
    match keyspace::parse_key(key) {
        Some((_, KeyKind::Released)) => Moving::Other,
        Some((lock, _)) if moves(lock.as_str()) => Moving::Held,
        _ => Moving::Other,
    }
}

/// The name a key under `/l/`, `/q/` or `/k/` belongs to.
pub fn name_of(key: &[u8]) -> Option<String> {
    if let Some(name) = keyspace::kv_name(key) {
        return Some(name.to_owned());
    }
    keyspace::parse_key(key).map(|(lock, _)| lock.as_str().to_owned())
}

/// The etcd key prefixes holding every key of the names starting with `prefix`: under
/// `/l/`, `/q/` and `/k/` the name comes first.
pub fn key_prefixes(prefix: &str) -> [String; 3] {
    [
        keyspace::locks_root(),
        keyspace::queues_root(),
        keyspace::kv_root(),
    ]
    .map(|root| format!("{root}{prefix}"))
}

#[cfg(test)]
mod tests;
