use super::*;
use crate::shardmap::CellSpec;

/// A map of the cells a, b and c (clusters ca, cb, cc) with `routes` (prefix, cell).
fn map(version: u64, routes: &[(&str, &str)]) -> ShardMap {
    let cell = |id: &str| CellSpec {
        endpoints: vec![format!("http://{id}:2379")],
        cluster_id: id.to_owned(),
    };
    ShardMap {
        version,
        cells: ["a", "b", "c"]
            .map(|name| (name.to_owned(), cell(&format!("c{name}"))))
            .into(),
        routes: routes
            .iter()
            .map(|(prefix, cell)| Route {
                prefix: (*prefix).to_owned(),
                cell: (*cell).to_owned(),
                paused: false,
                epoch: 0,
            })
            .collect(),
    }
}

/// The operator's form of `map`: no version, no cluster ids.
fn file(routes: &[(&str, &str)]) -> ShardMap {
    let mut map = map(0, routes);
    for cell in map.cells.values_mut() {
        cell.cluster_id.clear();
    }
    map
}

fn copies(each: &[(&str, Option<&ShardMap>)]) -> Copies {
    each.iter()
        .map(|(cell, copy)| ((*cell).to_owned(), copy.cloned()))
        .collect()
}

/// Cells a, b, c as `set` reads them, each with `copy`.
fn views(copy: Option<&ShardMap>) -> BTreeMap<String, CellView> {
    ["a", "b", "c"]
        .map(|name| {
            let view = CellView {
                cluster_id: format!("c{name}"),
                epoch: 100,
                copy: copy.cloned(),
            };
            (name.to_owned(), view)
        })
        .into()
}

fn route_of<'m>(map: &'m ShardMap, prefix: &str) -> &'m Route {
    map.routes.iter().find(|r| r.prefix == prefix).unwrap()
}

#[test]
fn new_routes_for_unserved_names_and_the_same_map_are_allowed() {
    let old = map(1, &[("billing/", "b")]);
    check_serving(&old, &old).unwrap();
    let grown = map(2, &[("billing/", "b"), ("", "a"), ("hr/", "c")]);
    check_serving(&old, &grown).unwrap();
    let carved_in_place = map(2, &[("billing/", "b"), ("billing/eu/", "b")]);
    check_serving(&old, &carved_in_place).unwrap();
}

#[test]
fn changing_the_cell_of_a_served_name_is_refused_by_prefix_and_cells() {
    let old = map(1, &[("", "a"), ("billing/", "b")]);
    let cases = [
        (
            map(2, &[("", "a"), ("billing/", "c")]),
            "billing/",
            "\"b\"",
            "\"c\"",
        ),
        (map(2, &[("", "a")]), "billing/", "\"b\"", "\"a\""),
        (map(2, &[("billing/", "b")]), "", "\"a\"", "no cell"),
        (
            map(2, &[("", "a"), ("billing/", "b"), ("billing/eu/", "a")]),
            "billing/eu/",
            "\"b\"",
            "\"a\"",
        ),
    ];
    for (new, prefix, from, to) in cases {
        let err = check_serving(&old, &new).unwrap_err();
        match &err {
            PlanError::ChangesCell { prefix: p, .. } => assert_eq!(p, prefix),
            other => panic!("{other:?}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("{prefix:?}"))
                && msg.contains(from)
                && msg.contains(to)
                && msg.contains("lockcell-cell shardmap move"),
            "{msg}"
        );
    }
}

#[test]
fn set_fills_cluster_ids_carries_epochs_and_pauses_and_raises_the_version() {
    let mut old = map(4, &[("", "a"), ("billing/", "b"), ("hr/", "c")]);
    route_of_mut(&mut old, "billing/").epoch = 700;
    route_of_mut(&mut old, "hr/").paused = true;
    let wanted = file(&[
        ("", "a"),
        ("billing/", "b"),
        ("billing/eu/", "b"),
        ("hr/", "c"),
    ]);
    let SetPlan::Write(new) = plan_set(&wanted, &views(Some(&old)), "ca").unwrap() else {
        panic!("the same map")
    };
    assert_eq!(new.version, 5);
    assert_eq!(new.cells["b"].cluster_id, "cb");
    assert_eq!(route_of(&new, "billing/").epoch, 700);
    assert_eq!(
        route_of(&new, "billing/eu/").epoch,
        700,
        "carved out of billing/: its tokens may not go down"
    );
    assert!(route_of(&new, "hr/").paused);
    assert!(!route_of(&new, "").paused);

    // Again: every copy already is that map.
    let again = plan_set(&wanted, &views(Some(&new)), "ca").unwrap();
    assert_eq!(again, SetPlan::Unchanged(new.clone()));
    // A copy behind (a cell restored from a backup) is written, above every version.
    let mut cells = views(Some(&map(7, &[("", "a")])));
    cells.get_mut("c").unwrap().copy = Some(map(2, &[("", "a")]));
    match plan_set(&file(&[("", "a")]), &cells, "ca").unwrap() {
        SetPlan::Write(map) => assert_eq!(map.version, 8),
        other => panic!("{other:?}"),
    }
}

fn route_of_mut<'m>(map: &'m mut ShardMap, prefix: &str) -> &'m mut Route {
    map.routes.iter_mut().find(|r| r.prefix == prefix).unwrap()
}

#[test]
fn set_refuses_another_cluster_under_a_cell_name_and_a_half_done_move() {
    let old = map(4, &[("", "a"), ("billing/", "b")]);
    let mut cells = views(Some(&old));
    cells.get_mut("b").unwrap().cluster_id = "elsewhere".into();
    let msg = plan_set(&file(&[("", "a"), ("billing/", "b")]), &cells, "ca")
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("\"b\"") && msg.contains("cb") && msg.contains("elsewhere"),
        "{msg}"
    );

    let mut paused = old.clone();
    paused.version = 5;
    route_of_mut(&mut paused, "billing/").paused = true;
    let mut cells = views(Some(&old));
    cells.get_mut("b").unwrap().copy = Some(paused.clone());
    let msg = plan_set(&file(&[("", "a"), ("billing/", "b")]), &cells, "ca")
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("\"billing/\"") && msg.contains("\"b\"") && msg.contains("b: version 5"),
        "{msg}"
    );
    // Once every copy agrees (a set carried the pause), it goes on, also with a new
    // cell that has no copy yet.
    let wanted = file(&[("", "a"), ("billing/", "b")]);
    assert!(plan_set(&wanted, &views(Some(&paused)), "ca").is_ok());
    let mut two_cells = paused.clone();
    two_cells.cells.remove("c");
    let mut cells = views(Some(&two_cells));
    cells.get_mut("c").unwrap().copy = None;
    assert!(plan_set(&wanted, &cells, "ca").is_ok());
}

#[test]
fn set_keeps_the_cell_and_token_epoch_of_every_name_served() {
    // billing/ moved from a to b and back: a's again, at the epoch the move raised.
    let mut old = map(6, &[("", "a"), ("billing/", "a")]);
    route_of_mut(&mut old, "").epoch = 100;
    route_of_mut(&mut old, "billing/").epoch = 900;
    let cells = views(Some(&old));

    // Without the route, billing/x would fall back to "" and its tokens to epoch 100.
    let err = plan_set(&file(&[("", "a")]), &cells, "ca").unwrap_err();
    assert!(
        matches!(&err, PlanError::ChangesEpoch { prefix, old: 900, new: 100, .. } if prefix == "billing/"),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("\"billing/\"")
            && msg.contains("900")
            && msg.contains("100")
            && msg.contains("lockcell-cell shardmap move"),
        "{msg}"
    );

    // A route over names that "" served takes ""'s epoch, not the overlapping billing/'s:
    // billy keeps its tokens' epoch (its holder's release still matches).
    let wanted = file(&[("", "a"), ("billing/", "a"), ("bill", "a")]);
    let SetPlan::Write(new) = plan_set(&wanted, &cells, "ca").unwrap() else {
        panic!("the same map")
    };
    assert_eq!(route_of(&new, "bill").epoch, 100);
    for name in ["billy", "billing/x", "orders/1"] {
        assert_eq!(
            new.token_epoch(50, name),
            old.token_epoch(50, name),
            "{name}"
        );
    }
    let mut raised = new.clone();
    route_of_mut(&mut raised, "bill").epoch = 900;
    let msg = check_serving(&old, &raised).unwrap_err().to_string();
    assert!(
        msg.contains("\"bill\"") && msg.contains("from 100") && msg.contains("to 900"),
        "{msg}"
    );
    // Names no route served before: the overlap rule still applies.
    let grown = plan_set(
        &file(&[("billing/", "a"), ("", "a")]),
        &views(Some(&map(1, &[("billing/", "a")]))),
        "ca",
    );
    assert!(grown.is_ok(), "{grown:?}");
}

#[test]
fn set_claims_the_start_cell_first_then_the_other_cells_without_a_copy() {
    // The first map, set from cell b: b has served every name, so its copy goes first.
    let order = set_order(&views(None), "cb");
    assert_eq!(order.claim, ["b", "a", "c"]);
    assert!(order.rest.is_empty());
    // A later map with a new cell c: c is claimed, then a and b written.
    let mut cells = views(Some(&map(3, &[("", "a")])));
    cells.get_mut("c").unwrap().copy = None;
    let order = set_order(&cells, "ca");
    assert_eq!(
        (order.claim, order.rest),
        (vec!["c".into()], vec!["a".into(), "b".into()])
    );
}

#[test]
fn the_first_map_must_name_the_start_cell_and_lifts_other_routes_above_its_epoch() {
    let wanted = file(&[("", "a"), ("billing/", "b")]);
    let first = match plan_set(&wanted, &views(None), "ca").unwrap() {
        SetPlan::Write(map) => map,
        other => panic!("{other:?}"),
    };
    assert_eq!(first.version, 1);
    assert_eq!(
        route_of(&first, "").epoch,
        0,
        "the start cell's own tokens go on"
    );
    assert!(route_of(&first, "billing/").epoch > 100);
    let msg = plan_set(&wanted, &views(None), "cz")
        .unwrap_err()
        .to_string();
    assert!(msg.contains("cz") && msg.contains("--etcd"), "{msg}");
}

#[test]
fn keys_of_a_cell_without_a_copy_must_stay_with_it() {
    let new = map(1, &[("", "a"), ("billing/", "b")]);
    check_misrouted(&new, "a", ["orders/1", "billing-x"]).unwrap();
    let names = ["orders/1", "billing/1", "billing/1", "billing/2"];
    let msg = check_misrouted(&new, "a", names).unwrap_err().to_string();
    assert!(
        msg.contains("\"billing/1\"") && msg.contains("(2 in all)"),
        "{msg}"
    );
    let (shown, count) = misrouted(&new, "a", (0..9).map(|_| "x").chain(["billing/9"]));
    assert_eq!((shown, count), (vec!["billing/9".to_owned()], 1));
    let only_billing = map(1, &[("billing/", "a")]);
    let (_, count) = misrouted(&only_billing, "a", ["orders/1"]);
    assert_eq!(count, 1, "a name routed nowhere");
}

#[test]
fn a_move_starts_by_pausing_the_route_in_the_source() {
    let mut m = map(3, &[("", "a"), ("billing/", "b")]);
    route_of_mut(&mut m, "").epoch = 40;
    let all = copies(&[("a", Some(&m)), ("b", Some(&m)), ("c", Some(&m))]);
    let MoveState::Start { source, paused } = move_state(&all, "billing/", "c").unwrap() else {
        panic!()
    };
    assert_eq!(source, "b");
    assert_eq!(paused.version, 4);
    assert!(route_of(&paused, "billing/").paused);
    // Carving a longer prefix out of the route that serves it: same cell, its epoch.
    let MoveState::Start { source, paused } = move_state(&all, "orders/", "c").unwrap() else {
        panic!()
    };
    assert_eq!(source, "a");
    let carved = route_of(&paused, "orders/");
    assert_eq!(
        (carved.cell.as_str(), carved.paused, carved.epoch),
        ("a", true, 40)
    );
    assert!(
        !route_of(&paused, "").paused,
        "the shorter route keeps serving"
    );
}

#[test]
fn a_move_is_refused_when_there_is_nothing_to_do_or_no_way_to_do_it() {
    let mut m = map(3, &[("", "a"), ("billing/", "b")]);
    let all = copies(&[("a", Some(&m)), ("b", Some(&m))]);
    let refusal =
        |prefix: &str, to: &str, all: &Copies| move_state(all, prefix, to).unwrap_err().to_string();
    let msg = refusal("billing/eu/", "b", &all);
    assert!(
        msg.contains("already served by cell \"b\"") && msg.contains("\"billing/\""),
        "{msg}"
    );
    assert!(refusal("billing/", "z", &all).contains("\"z\""));
    assert!(refusal("bad//", "c", &all).contains("\"bad//\""));
    let nowhere = copies(&[("a", Some(&map(1, &[("billing/", "b")])))]);
    assert!(refusal("hr/", "a", &nowhere).contains("no route serves \"hr/\""));
    assert!(matches!(
        move_state(&Copies::new(), "x", "a"),
        Err(PlanError::NoMap)
    ));
    route_of_mut(&mut m, "").paused = true;
    let paused = copies(&[("a", Some(&m))]);
    let msg = refusal("", "a", &paused);
    assert!(msg.contains("\"\"") && msg.contains("--to a"), "{msg}");
    let msg = refusal("orders/", "c", &paused);
    assert!(
        msg.contains("\"orders/\"") && msg.contains("paused"),
        "{msg}"
    );
}

/// The copies of a move of billing/ from b to c, as each step leaves them.
fn moving() -> (ShardMap, ShardMap, ShardMap) {
    let m = map(3, &[("", "a"), ("billing/", "b")]);
    let all = copies(&[("a", Some(&m)), ("b", Some(&m)), ("c", Some(&m))]);
    let MoveState::Start { paused, .. } = move_state(&all, "billing/", "c").unwrap() else {
        panic!()
    };
    let m2 = switched(&paused, "billing/", "c", 100, 200, 5);
    (m, paused, m2)
}

#[test]
fn a_rerun_move_continues_where_the_copies_say_it_stopped() {
    let (m, m1, m2) = moving();
    let after_pause = copies(&[("a", Some(&m)), ("b", Some(&m1)), ("c", Some(&m))]);
    assert_eq!(
        move_state(&after_pause, "billing/", "c").unwrap(),
        MoveState::Paused {
            source: "b".into(),
            paused: m1.clone()
        }
    );
    for half in [
        copies(&[("a", Some(&m)), ("b", Some(&m1)), ("c", Some(&m2))]),
        copies(&[("a", Some(&m)), ("b", Some(&m2)), ("c", Some(&m2))]),
    ] {
        assert_eq!(
            move_state(&half, "billing/", "c").unwrap(),
            MoveState::Switched {
                source: "b".into(),
                switched: m2.clone()
            }
        );
    }
    let done = copies(&[("a", Some(&m2)), ("b", Some(&m2)), ("c", Some(&m2))]);
    assert_eq!(
        move_state(&done, "billing/", "c").unwrap(),
        MoveState::Done { switched: m2 }
    );
}

#[test]
fn the_switch_raises_the_route_epoch_above_both_cells_and_its_own() {
    let (_, m1, m2) = moving();
    let route = route_of(&m2, "billing/");
    assert_eq!((route.cell.as_str(), route.paused), ("c", false));
    assert!(route.epoch > 200);
    assert_eq!(m2.version, 5);
    let mut high = m1.clone();
    route_of_mut(&mut high, "billing/").epoch = u64::MAX / 2;
    let raised = switched(&high, "billing/", "c", 1, 2, 6);
    assert_eq!(route_of(&raised, "billing/").epoch, u64::MAX / 2 + 1);
    assert!(m2.token_epoch(300, "billing/x") > route_of(&m1, "billing/").epoch);
}

#[test]
fn abort_unpauses_only_before_the_switch() {
    let (m, m1, m2) = moving();
    let paused = copies(&[("a", Some(&m)), ("b", Some(&m1)), ("c", Some(&m))]);
    let abort = plan_abort(&paused, "billing/", "c").unwrap();
    assert_eq!(abort.source, "b");
    assert_eq!(abort.unpaused.version, 5);
    assert!(!route_of(&abort.unpaused, "billing/").paused);
    assert_eq!(route_of(&abort.unpaused, "billing/").cell, "b");
    assert_eq!(
        abort.order,
        ["c", "a", "b"],
        "the target first, the source last"
    );
    let switched = copies(&[("a", Some(&m)), ("b", Some(&m1)), ("c", Some(&m2))]);
    let msg = plan_abort(&switched, "billing/", "c")
        .unwrap_err()
        .to_string();
    assert!(msg.contains("already switched to cell \"c\""), "{msg}");
    let idle = copies(&[("a", Some(&m)), ("b", Some(&m))]);
    assert!(matches!(
        plan_abort(&idle, "billing/", "c"),
        Err(PlanError::NothingToAbort { .. })
    ));
    let msg = plan_abort(&paused, "billing/", "b")
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("out of cell \"b\"") && msg.contains("--to"),
        "{msg}"
    );
    assert!(matches!(
        plan_abort(&paused, "billing/", "z"),
        Err(PlanError::UnknownTarget { .. })
    ));

    // An abort that stopped before the source: run again, it writes the rest of it.
    let u = abort.unpaused;
    let stopped = copies(&[("a", Some(&u)), ("b", Some(&m1)), ("c", Some(&u))]);
    let rest = plan_abort(&stopped, "billing/", "c").unwrap();
    assert_eq!((rest.source.as_str(), &rest.unpaused), ("b", &u));
    assert_eq!(rest.order, ["c", "a", "b"]);
}

/// The race tests' model of the cells' etcd: each cell's copy of the map and the
/// revision it was written at, and the one persistent small key of `billing/` that a
/// move copies to cell c.
#[derive(Clone, Debug)]
struct Cluster {
    copies: BTreeMap<String, (ShardMap, i64)>,
    revision: i64,
    /// The key in cell c, by its mod revision.
    key_in_c: Option<i64>,
}

impl Cluster {
    fn new(each: &[(&str, &ShardMap)]) -> Cluster {
        let copies: BTreeMap<String, (ShardMap, i64)> = each
            .iter()
            .zip(1..)
            .map(|((cell, map), revision)| ((*cell).to_owned(), ((*map).clone(), revision)))
            .collect();
        let revision = copies.len() as i64 + 1;
        Cluster {
            copies,
            revision,
            key_in_c: Some(revision),
        }
    }

    fn copies(&self) -> Copies {
        self.copies
            .iter()
            .map(|(cell, (map, _))| (cell.clone(), Some(map.clone())))
            .collect()
    }

    /// Two cells serving `billing/x`, or c serving it without its key.
    fn broken(&self) -> Option<String> {
        let serving: Vec<&str> = self
            .copies
            .iter()
            .filter(|(cell, (map, _))| {
                map.route("billing/x")
                    .is_some_and(|r| &r.cell == *cell && !r.paused)
            })
            .map(|(cell, _)| cell.as_str())
            .collect();
        match serving[..] {
            [_, _, ..] => Some(format!("cells {serving:?} both serve billing/x")),
            ["c"] if self.key_in_c.is_none() => Some("c serves billing/ without its key".into()),
            _ => None,
        }
    }
}

#[derive(Clone, Debug)]
enum Step {
    /// Writes the cell's copy if it is as the run last saw it; else the run stops.
    Write(String, ShardMap),
    /// A move's step 4: the key into c if absent; either way the move counts it copied.
    CopyKey,
    /// An abort finds the key in c (its mod revision)...
    ScanKey,
    /// ...and deletes it while unchanged and while c's copy is the one the abort wrote.
    DeleteKey,
}

/// One `move` or `move --abort`, from what it read.
#[derive(Clone, Debug)]
struct Run {
    steps: Vec<Step>,
    next: usize,
    stopped: bool,
    /// Each cell's copy's revision as the run read or wrote it.
    seen: BTreeMap<String, i64>,
    scanned: Option<i64>,
}

impl Run {
    fn new(read: &Cluster, steps: Vec<Step>) -> Run {
        let seen = read
            .copies
            .iter()
            .map(|(cell, (_, revision))| (cell.clone(), *revision))
            .collect();
        Run {
            steps,
            next: 0,
            stopped: false,
            seen,
            scanned: None,
        }
    }

    fn done(&self) -> bool {
        self.stopped || self.next == self.steps.len()
    }

    fn step(&mut self, etcd: &mut Cluster) {
        match self.steps[self.next].clone() {
            Step::Write(cell, map) => {
                if etcd.copies[&cell].1 != self.seen[&cell] {
                    self.stopped = true;
                    return;
                }
                etcd.revision += 1;
                etcd.copies.insert(cell.clone(), (map, etcd.revision));
                self.seen.insert(cell, etcd.revision);
            }
            Step::CopyKey if etcd.key_in_c.is_none() => {
                etcd.revision += 1;
                etcd.key_in_c = Some(etcd.revision);
            }
            Step::CopyKey => {}
            Step::ScanKey => self.scanned = etcd.key_in_c,
            Step::DeleteKey => {
                if self.scanned.is_some()
                    && etcd.key_in_c == self.scanned
                    && etcd.copies["c"].1 == self.seen["c"]
                {
                    etcd.key_in_c = None;
                }
            }
        }
        self.next += 1;
    }
}

/// Runs every interleaving of the runs' steps; the first that breaks the cells.
fn race(etcd: &Cluster, runs: &[Run], trace: &mut Vec<usize>) -> Result<(), String> {
    if let Some(broken) = etcd.broken() {
        return Err(format!("{broken}, after the steps of runs {trace:?}"));
    }
    for i in 0..runs.len() {
        if runs[i].done() {
            continue;
        }
        let (mut etcd, mut runs) = (etcd.clone(), runs.to_vec());
        runs[i].step(&mut etcd);
        trace.push(i);
        race(&etcd, &runs, trace)?;
        trace.pop();
    }
    Ok(())
}

/// The orders of writes under test: this version's, or the earlier ones.
#[derive(Clone, Copy)]
struct Orders {
    /// The switch writes the source first (else the target first).
    switch_source_first: bool,
    /// The abort writes the source last (else first).
    abort_source_last: bool,
    /// A move writes the moving map to the target's copy before it copies keys there.
    touch_target: bool,
}

const NOW: Orders = Orders {
    switch_source_first: true,
    abort_source_last: true,
    touch_target: true,
};

/// Writes of `map` to the cells of `order` whose copy (as read) is not it, as
/// `Cells::write_all` does.
fn writes(read: &Cluster, map: &ShardMap, order: &[String]) -> Vec<Step> {
    order
        .iter()
        .filter(|cell| read.copies[*cell].0 != *map)
        .map(|cell| Step::Write(cell.clone(), map.clone()))
        .collect()
}

/// A move of billing/ to `target` from what it read in `read`: from its pause (or the
/// rest of it) to the end of the switch.
fn move_run(read: &Cluster, target: &str, orders: Orders) -> Run {
    let copies = read.copies();
    let (source, paused, mut steps) = match move_state(&copies, "billing/", target).unwrap() {
        MoveState::Start { source, paused } => {
            let pause = vec![Step::Write(source.clone(), paused.clone())];
            (source, paused, pause)
        }
        MoveState::Paused { source, paused } => (source, paused, vec![]),
        other => panic!("{other:?}"),
    };
    if orders.touch_target {
        steps.push(Step::Write(target.to_owned(), paused.clone()));
    }
    if target == "c" {
        steps.push(Step::CopyKey);
    }
    let to = switched(&paused, "billing/", target, 100, 200, paused.version + 1);
    let order = match orders.switch_source_first {
        true => switch_order(&copies, &source, target),
        false => order(&copies, &[target, &source], None),
    };
    steps.extend(order.into_iter().map(|cell| Step::Write(cell, to.clone())));
    Run::new(read, steps)
}

/// `move billing/ --to c --abort` from what it read in `read`.
fn abort_run(read: &Cluster, orders: Orders) -> Run {
    let abort = plan_abort(&read.copies(), "billing/", "c").unwrap();
    let source = std::slice::from_ref(&abort.source);
    let mut steps = if orders.abort_source_last {
        writes(read, &abort.unpaused, &abort.order[..abort.order.len() - 1])
    } else {
        writes(read, &abort.unpaused, source)
    };
    steps.extend([Step::ScanKey, Step::DeleteKey]);
    if orders.abort_source_last {
        steps.extend(writes(read, &abort.unpaused, source));
    } else {
        let others = order(&read.copies(), &[], Some(&abort.source));
        steps.extend(writes(read, &abort.unpaused, &others[..others.len() - 1]));
    }
    Run::new(read, steps)
}

/// The copies when billing/ is paused in b for a move to c: before the target is
/// touched, and after an abort that stopped before the source.
fn before_the_race() -> (Cluster, Cluster) {
    let (m, m1, _) = moving();
    let paused = Cluster::new(&[("a", &m), ("b", &m1), ("c", &m)]);
    let u = plan_abort(&paused.copies(), "billing/", "c")
        .unwrap()
        .unpaused;
    let stopped = Cluster::new(&[("a", &u), ("b", &m1), ("c", &u)]);
    (paused, stopped)
}

#[test]
fn a_move_and_an_abort_racing_never_leave_two_cells_serving() {
    let (paused, _) = before_the_race();
    let runs = [move_run(&paused, "c", NOW), abort_run(&paused, NOW)];
    race(&paused, &runs, &mut vec![]).unwrap();

    // The model sees the race of the earlier orders: the abort unpauses the source
    // after the move checked it, and the move switches the target.
    let earlier = Orders {
        switch_source_first: false,
        abort_source_last: false,
        ..NOW
    };
    let runs = [move_run(&paused, "c", earlier), abort_run(&paused, earlier)];
    let broken = race(&paused, &runs, &mut vec![]).unwrap_err();
    assert!(broken.contains("both serve"), "{broken}");
    // Also with only the abort's order as it was.
    let abort_first = Orders {
        abort_source_last: false,
        ..NOW
    };
    let runs = [
        move_run(&paused, "c", earlier),
        abort_run(&paused, abort_first),
    ];
    assert!(race(&paused, &runs, &mut vec![]).is_err());
}

#[test]
fn two_moves_of_one_route_to_two_cells_never_both_switch() {
    let (paused, _) = before_the_race();
    let runs = [move_run(&paused, "c", NOW), move_run(&paused, "a", NOW)];
    race(&paused, &runs, &mut vec![]).unwrap();
    let target_first = Orders {
        switch_source_first: false,
        ..NOW
    };
    let runs = [
        move_run(&paused, "c", target_first),
        move_run(&paused, "a", target_first),
    ];
    let broken = race(&paused, &runs, &mut vec![]).unwrap_err();
    assert!(broken.contains("both serve"), "{broken}");
}

#[test]
fn an_abort_deletes_no_key_a_new_move_counts_as_copied() {
    // The abort wrote every cell but the source; a new move starts (and pauses b
    // again) while the abort deletes its copied keys from c.
    let (_, stopped) = before_the_race();
    let runs = [move_run(&stopped, "c", NOW), abort_run(&stopped, NOW)];
    race(&stopped, &runs, &mut vec![]).unwrap();
    let untouched = Orders {
        touch_target: false,
        ..NOW
    };
    let runs = [move_run(&stopped, "c", untouched), abort_run(&stopped, NOW)];
    let broken = race(&stopped, &runs, &mut vec![]).unwrap_err();
    assert!(broken.contains("without its key"), "{broken}");
}

#[test]
fn a_move_concerns_only_the_names_whose_longest_route_is_its_own() {
    let m = map(1, &[("", "a"), ("billing/", "b"), ("billing/eu/", "c")]);
    let of = |key: &str, lease: i64| classify(&m, "billing/", key.as_bytes(), lease);
    assert_eq!(of("/l/billing/x/!x", 7), Moving::Held);
    assert_eq!(of("/l/billing/x/!s/s1", 7), Moving::Held);
    assert_eq!(of("/q/billing/x/!x/w1", 7), Moving::Held);
    assert_eq!(of("/k/billing/x", 7), Moving::Held, "an ephemeral key");
    assert_eq!(of("/k/billing/x", 0), Moving::Persistent);
    assert_eq!(
        of("/l/billing/x/!r", 7),
        Moving::Other,
        "a release marker holds nothing"
    );
    assert_eq!(
        of("/l/billing/eu/x/!x", 7),
        Moving::Other,
        "under a longer route"
    );
    assert_eq!(of("/k/billing/eu/x", 0), Moving::Other);
    assert_eq!(of("/l/orders/!x", 7), Moving::Other);
    assert_eq!(of("/sys/epoch", 0), Moving::Other);
    for key in ["/l/billing/x/!x", "/q/billing/x/!x/w1", "/k/billing/x"] {
        assert!(key_prefixes("billing/")
            .iter()
            .any(|p| key.starts_with(p.as_str())));
    }
    assert_eq!(key_prefixes(""), ["/l/", "/q/", "/k/"]);
    assert_eq!(name_of(b"/q/a/b/!s/w").as_deref(), Some("a/b"));
    assert_eq!(name_of(b"/k/a/b").as_deref(), Some("a/b"));
}

#[test]
fn a_route_of_names_no_route_served_starts_above_every_epoch_used() {
    // The first map routed only billing/ (to b): every other name a served before any
    // map had its tokens at a's epoch, and is unrouted now.
    let mut old = map(1, &[("billing/", "b")]);
    route_of_mut(&mut old, "billing/").epoch = 300;
    let mut cells = views(Some(&old));
    cells.get_mut("a").unwrap().epoch = 900;
    cells.get_mut("c").unwrap().epoch = 5;
    // Routing them to c, whose epoch is far lower, must not send their tokens back.
    let wanted = file(&[("billing/", "b"), ("jobs/", "c"), ("", "c")]);
    let SetPlan::Write(new) = plan_set(&wanted, &cells, "ca").unwrap() else {
        panic!("the same map")
    };
    for prefix in ["jobs/", ""] {
        let epoch = route_of(&new, prefix).epoch;
        assert!(
            epoch > 900,
            "route {prefix:?} starts at epoch {epoch}, not above the 900 names of a had"
        );
        assert!(new.token_epoch(5, &format!("{prefix}x")) > 900);
    }
    assert_eq!(
        route_of(&new, "billing/").epoch,
        300,
        "served names keep theirs"
    );
    // Set again: the routes it added keep the epoch they were given.
    let again = plan_set(&wanted, &views(Some(&new)), "ca").unwrap();
    assert_eq!(again, SetPlan::Unchanged(new));
}
