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
    let (source, unpaused) = plan_abort(&paused, "billing/").unwrap();
    assert_eq!(source, "b");
    assert_eq!(unpaused.version, 5);
    assert!(!route_of(&unpaused, "billing/").paused);
    assert_eq!(route_of(&unpaused, "billing/").cell, "b");
    let switched = copies(&[("a", Some(&m)), ("b", Some(&m1)), ("c", Some(&m2))]);
    let msg = plan_abort(&switched, "billing/").unwrap_err().to_string();
    assert!(msg.contains("already switched to cell \"c\""), "{msg}");
    let idle = copies(&[("a", Some(&m)), ("b", Some(&m))]);
    assert!(matches!(
        plan_abort(&idle, "billing/"),
        Err(PlanError::NothingToAbort { .. })
    ));
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
