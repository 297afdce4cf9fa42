//! `lockcell-cell shardmap show | set | move`: reads every cell's copy of the shard map,
//! asks `lockcell_cell::shardmap::plan` what to do, prints each step and carries it out
//! through `lockcell_cell::shardmap::store`. The steps of `move` are in [`moving`].

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use etcd_client::KvClient;
use lockcell_cell::epoch;
use lockcell_cell::keyspace;
use lockcell_cell::shardmap::plan::{self, CellView, Copies, SetPlan};
use lockcell_cell::shardmap::store;
use lockcell_cell::shardmap::{self, ShardMap, StoredMap};

use crate::EtcdArgs;

mod moving;

#[derive(Debug, Args)]
pub struct ShardmapArgs {
    #[command(subcommand)]
    command: ShardmapCommand,
}

#[derive(Debug, Subcommand)]
enum ShardmapCommand {
    /// Shows the map in force, and whether every cell holds it.
    ///
    /// The map in force is the highest version among the cells' copies: its cells with
    /// endpoints and cluster ids, its routes with their cell, pause and epoch. When the
    /// copies disagree (an interrupted move, a cell restored from a backup) it says
    /// which cell holds which version. --etcd is a cell of the map; its user and TLS
    /// settings are used for every cell.
    Show {
        /// Print the --etcd cell's copy as stored (JSON; `null` when it has none).
        #[arg(long, conflicts_with = "toml")]
        json: bool,
        /// Print the --etcd cell's copy as a file `shardmap set` takes (its cells and
        /// routes): to write the map in force to a cell restored from a backup, run it
        /// on a cell that holds the map in force, and `set` that file.
        #[arg(long)]
        toml: bool,
        #[command(flatten)]
        etcd: EtcdArgs,
    },
    /// Writes the map of FILE to every cell of it (and of the map it replaces).
    ///
    /// FILE (TOML) names the cells and routes; everything else is filled in: the
    /// version (above every copy's), each cell's cluster id (from its epoch record;
    /// every cell must have one: `lockcell-cell init`), the epoch and pause of each
    /// route that keeps its prefix and cell, and the epoch of a new route (that of the
    /// route that served its prefix before).
    ///
    ///     [cells.a]
    ///     endpoints = ["http://127.0.0.1:2379"]
    ///     [cells.b]
    ///     endpoints = ["http://10.0.0.2:2379", "http://10.0.0.3:2379"]
    ///     [[route]]
    ///     prefix = ""          # everything not routed elsewhere
    ///     cell = "a"
    ///     [[route]]
    ///     prefix = "billing/"
    ///     cell = "b"
    ///
    /// A name goes to the route with the longest prefix of it ("" matches every name).
    /// Cell names use a-z, 0-9 and '-'; a prefix is "" or a lock name, optionally
    /// followed by '/'; unknown fields are refused.
    ///
    /// Refused: any change of the cell that serves a name already served, or of the
    /// epoch of its tokens (use `shardmap move`), a cell name whose endpoints reach
    /// another cluster, and a set while a move is unfinished. With no map anywhere yet,
    /// the --etcd cell has served every name: it must be in the map. A cell without a
    /// copy must hold keys only of names the map routes to it: each (the --etcd cell
    /// first) is checked, written, and checked again, and its copy deleted if keys of
    /// other names turned up meanwhile. Setting the same file again writes nothing.
    ///
    /// --etcd is a cell of the map; its user and TLS settings are used for every cell.
    #[command(verbatim_doc_comment)]
    Set {
        /// The map, as TOML.
        file: PathBuf,
        #[command(flatten)]
        etcd: EtcdArgs,
    },
    /// Moves the names a route serves to another cell, never held in both at once.
    ///
    /// 1. Reads every copy; without a route of exactly PREFIX, carves one out of the
    ///    route that serves it. 2. Pauses it in the source cell's copy: the source grants
    ///    and writes nothing under it from then on. 3. Waits until the source holds no
    ///    lock, waiter or ephemeral key of its names (at most --wait; the prefix stays
    ///    paused after that). 4. Copies its persistent small keys to the target (refused
    ///    when the target has one with another value), after writing the paused map to
    ///    the target's copy. 5. Switches: the source's copy first, then the target's,
    ///    then the other cells', with the route's epoch raised above both cells' so
    ///    tokens keep rising. 6. Deletes the copied keys from the source.
    ///
    /// Run again after an interruption, it goes on from where the copies say it
    /// stopped; run again once it is done, it says so. --abort undoes a move that has
    /// not switched yet. --etcd is a cell of the map; its user and TLS settings are
    /// used for every cell.
    Move {
        /// The route's prefix ("" for every name not routed elsewhere).
        prefix: String,
        /// The cell to move to.
        #[arg(long)]
        to: String,
        /// Undo the move of PREFIX to --to instead: PREFIX unpaused in every cell, the
        /// --to cell first and the source last, and the keys the move copied to --to
        /// deleted there; the source serves it again.
        #[arg(long)]
        abort: bool,
        /// How long to wait for the source to let go of the names' locks, waiters and
        /// ephemeral keys.
        #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
        wait: Duration,
        #[command(flatten)]
        etcd: EtcdArgs,
    },
}

pub async fn run(args: ShardmapArgs) -> anyhow::Result<()> {
    match args.command {
        ShardmapCommand::Show {
            json: true, etcd, ..
        } => show_json(&etcd).await,
        ShardmapCommand::Show {
            toml: true, etcd, ..
        } => show_toml(&etcd).await,
        ShardmapCommand::Show { etcd, .. } => show(&etcd).await,
        ShardmapCommand::Set { file, etcd } => set(&etcd, &file).await,
        ShardmapCommand::Move {
            prefix,
            to,
            abort,
            wait,
            etcd,
        } => {
            let mut cells = Cells::of_map(&etcd).await?;
            if abort {
                cells.abort(&prefix, &to).await
            } else {
                cells.move_prefix(&prefix, &to, wait).await
            }
        }
    }
}

/// One cell, connected, as read.
struct Cell {
    endpoints: Vec<String>,
    kv: KvClient,
    /// Its epoch record's: who it really is.
    cluster_id: String,
    epoch: u64,
    copy: Option<StoredMap>,
}

async fn read_cell(etcd: &EtcdArgs, endpoints: &[String]) -> anyhow::Result<Cell> {
    let timeout = etcd.address.etcd_timeout;
    let mut kv = etcd.connect_to(endpoints).await?.kv_client();
    let Some(record) = epoch::read(&mut kv, timeout).await? else {
        bail!(
            "it has no epoch record; set it up with `lockcell-cell init --etcd {}`",
            endpoints.join(",")
        );
    };
    let copy = shardmap::read(&mut kv, timeout).await?;
    Ok(Cell {
        endpoints: endpoints.to_vec(),
        kv,
        cluster_id: record.record.cluster_id,
        epoch: record.record.epoch,
        copy,
    })
}

/// The cells of a map, as read.
struct Cells {
    reached: BTreeMap<String, Cell>,
    /// Those that could not be read, and why.
    unreached: BTreeMap<String, anyhow::Error>,
    /// The --etcd cell, where it all starts.
    start: Cell,
    timeout: Duration,
}

impl Cells {
    /// The --etcd cell, and every cell named in `named` (name and endpoints) or in any
    /// copy found, until the copies name no cell more.
    async fn read(
        etcd: &EtcdArgs,
        mut named: BTreeMap<String, Vec<String>>,
    ) -> anyhow::Result<Self> {
        let start = read_cell(etcd, &etcd.address.etcd_endpoints)
            .await
            .with_context(|| format!("the --etcd cell at {}", etcd.address.endpoints()))?;
        if let Some(copy) = &start.copy {
            for (name, cell) in &copy.map.cells {
                named
                    .entry(name.clone())
                    .or_insert_with(|| cell.endpoints.clone());
            }
        }
        let mut cells = Cells {
            reached: BTreeMap::new(),
            unreached: BTreeMap::new(),
            start,
            timeout: etcd.address.etcd_timeout,
        };
        loop {
            let todo: Vec<(String, Vec<String>)> = named
                .iter()
                .filter(|(name, _)| {
                    !cells.reached.contains_key(*name) && !cells.unreached.contains_key(*name)
                })
                .map(|(name, endpoints)| (name.clone(), endpoints.clone()))
                .collect();
            if todo.is_empty() {
                return Ok(cells);
            }
            for (name, endpoints) in todo {
                match read_cell(etcd, &endpoints).await {
                    Ok(cell) => {
                        for (other, spec) in cell.copy.iter().flat_map(|c| &c.map.cells) {
                            named
                                .entry(other.clone())
                                .or_insert_with(|| spec.endpoints.clone());
                        }
                        cells.reached.insert(name, cell);
                    }
                    Err(e) => {
                        cells.unreached.insert(name, e);
                    }
                }
            }
        }
    }

    /// The cells of the --etcd cell's map, every one reached, each the cluster the map
    /// in force says it is.
    async fn of_map(etcd: &EtcdArgs) -> anyhow::Result<Self> {
        let cells = Cells::read(etcd, BTreeMap::new()).await?;
        if cells.start.copy.is_none() {
            bail!(
                "the cell at {} has no shard map (it serves every name); write one with `lockcell-cell shardmap set FILE`",
                etcd.address.endpoints()
            );
        }
        cells.all_reached()?;
        let copies = cells.copies();
        let Some(map) = plan::current(&copies) else {
            bail!("no cell of the --etcd cell's shard map holds a copy of it; write it again with `lockcell-cell shardmap set FILE`");
        };
        for (name, cell) in &cells.reached {
            match map.cells.get(name) {
                Some(spec) if !spec.cluster_id.is_empty() && spec.cluster_id != cell.cluster_id => bail!(
                    "cell {name:?} at {} is cluster {}, but the shard map (version {}) says cluster {}; correct its endpoints with `lockcell-cell shardmap set FILE` first",
                    cell.endpoints.join(","), cell.cluster_id, map.version, spec.cluster_id
                ),
                _ => {}
            }
        }
        Ok(cells)
    }

    fn all_reached(&self) -> anyhow::Result<()> {
        match self.unreached.iter().next() {
            Some((name, e)) => bail!("cell {name:?} of the shard map could not be read: {e:#}"),
            None => Ok(()),
        }
    }

    fn copies(&self) -> Copies {
        self.reached
            .iter()
            .map(|(name, cell)| (name.clone(), cell.copy.as_ref().map(|c| c.map.clone())))
            .collect()
    }

    fn cell(&mut self, name: &str) -> anyhow::Result<&mut Cell> {
        self.reached
            .get_mut(name)
            .with_context(|| format!("cell {name:?} was not read"))
    }

    /// Writes `map` as `name`'s copy over the copy read, and remembers it.
    async fn write(&mut self, name: &str, map: &ShardMap) -> anyhow::Result<()> {
        let timeout = self.timeout;
        let cell = self.cell(name)?;
        let read = cell.copy.as_ref().map(|c| c.mod_revision);
        let Some(mod_revision) = store::write(&mut cell.kv, map, read, timeout).await? else {
            bail!(
                "cell {name:?}'s copy of the shard map changed while this ran (another set or move?); nothing more was written: look with `lockcell-cell shardmap show` and run it again"
            );
        };
        cell.copy = Some(StoredMap {
            map: map.clone(),
            mod_revision,
        });
        println!(
            "  cell {name}: version {} written (revision {mod_revision})",
            map.version
        );
        Ok(())
    }

    /// Writes `map` to each cell of `order` whose copy is not it, in that order (which
    /// `plan` gives, with why it is safe); stops at the first write that fails.
    async fn write_all(&mut self, map: &ShardMap, order: &[String]) -> anyhow::Result<()> {
        for name in order {
            if self.cell(name)?.copy.as_ref().map(|c| &c.map) != Some(map) {
                self.write(name, map).await?;
            }
        }
        Ok(())
    }

    /// Deletes `name`'s copy if it is still the one this run wrote: the cell serves every
    /// name again, as it did before.
    async fn remove(&mut self, name: &str) -> anyhow::Result<()> {
        let timeout = self.timeout;
        let cell = self.cell(name)?;
        let Some(copy) = cell.copy.as_ref() else {
            return Ok(());
        };
        if !store::remove(&mut cell.kv, copy.mod_revision, timeout).await? {
            bail!("cell {name:?}'s copy of the shard map changed while this ran (another set or move?), so it was left as it is: look with `lockcell-cell shardmap show`");
        }
        cell.copy = None;
        println!("  cell {name}: its copy deleted again");
        Ok(())
    }

    /// The refusal of `map` if cell `name` holds keys of names the map does not route to
    /// it (the outer error: the cell could not be scanned).
    async fn check_own(
        &mut self,
        name: &str,
        map: &ShardMap,
    ) -> anyhow::Result<Result<(), plan::PlanError>> {
        let timeout = self.timeout;
        let names = store::names(&mut self.cell(name)?.kv, timeout).await?;
        Ok(plan::check_misrouted(
            map,
            name,
            names.iter().map(String::as_str),
        ))
    }
}

async fn show_json(etcd: &EtcdArgs) -> anyhow::Result<()> {
    let mut kv = etcd.connect().await?.kv_client();
    let key = keyspace::shardmap_key();
    let resp = lockcell_cell::error::with_timeout(
        "read shard map",
        etcd.address.etcd_timeout,
        kv.get(key, None),
    )
    .await?;
    match resp.kvs().first() {
        Some(kv) => println!("{}", String::from_utf8_lossy(kv.value())),
        None => println!("null"),
    }
    Ok(())
}

async fn show_toml(etcd: &EtcdArgs) -> anyhow::Result<()> {
    let mut kv = etcd.connect().await?.kv_client();
    match lockcell_cell::shardmap::read(&mut kv, etcd.address.etcd_timeout).await? {
        Some(stored) => print!("{}", stored.map.to_toml()),
        None => anyhow::bail!(
            "the cell at {} holds no shard map; run `shardmap show` there to see which cells do",
            etcd.address.endpoints()
        ),
    }
    Ok(())
}

async fn show(etcd: &EtcdArgs) -> anyhow::Result<()> {
    let cells = Cells::read(etcd, BTreeMap::new()).await?;
    if cells.start.copy.is_none() {
        println!(
            "the cell at {} has no shard map: it serves every name (write one with `lockcell-cell shardmap set FILE`)",
            etcd.address.endpoints()
        );
        return Ok(());
    }
    let copies = cells.copies();
    let mut all = copies.clone();
    if !cells
        .reached
        .values()
        .any(|c| c.cluster_id == cells.start.cluster_id)
    {
        let start = cells.start.copy.as_ref().map(|c| c.map.clone());
        all.insert("(the --etcd cell, not in the map)".into(), start);
    }
    let Some(map) = plan::current(&all) else {
        bail!("the --etcd cell's copy of the shard map vanished while it was read; run show again");
    };
    let holders: Vec<&str> = all
        .iter()
        .filter(|(_, c)| c.as_ref() == Some(map))
        .map(|(n, _)| n.as_str())
        .collect();
    println!(
        "shard map version {} (held by {})",
        map.version,
        holders.join(", ")
    );
    println!("cells:");
    for (name, spec) in &map.cells {
        println!(
            "  {name}  cluster {}  {}",
            spec.cluster_id,
            spec.endpoints.join(", ")
        );
        match (cells.reached.get(name), cells.unreached.get(name)) {
            (Some(cell), _) if cell.cluster_id != spec.cluster_id => println!(
                "    warning: these endpoints reach cluster {}, not {}",
                cell.cluster_id, spec.cluster_id
            ),
            (_, Some(e)) => println!("    warning: not reachable: {e:#}"),
            _ => {}
        }
    }
    println!("routes (a name goes to the longest prefix of it):");
    for route in &map.routes {
        let paused = if route.paused {
            "  PAUSED (moving out)"
        } else {
            ""
        };
        println!(
            "  {:?} -> {}  epoch {}{paused}",
            route.prefix, route.cell, route.epoch
        );
    }
    if plan::agree(&copies) {
        println!("every cell holds version {}", map.version);
        return Ok(());
    }
    println!("the copies disagree: {}", plan::versions(&copies));
    let mut moving = false;
    for (name, copy) in copies.iter().filter_map(|(n, c)| Some((n, c.as_ref()?))) {
        for route in copy.routes.iter().filter(|r| r.paused) {
            moving = true;
            println!(
                "  cell {name}'s copy (version {}) has {:?} paused: a move of it out of {} is unfinished; run the same `lockcell-cell shardmap move` again to finish it, or add --abort to undo it",
                copy.version, route.prefix, route.cell
            );
        }
    }
    if !moving {
        println!("  a move that switched but did not write every cell (run it again to finish it), or a cell restored from a backup (`lockcell-cell shardmap set FILE` writes every copy again)");
    }
    Ok(())
}

async fn set(etcd: &EtcdArgs, path: &std::path::Path) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let file = ShardMap::from_toml(&text).with_context(|| format!("in {}", path.display()))?;
    let named = file
        .cells
        .iter()
        .map(|(name, spec)| (name.clone(), spec.endpoints.clone()))
        .collect();
    let mut cells = Cells::read(etcd, named).await?;
    cells.all_reached()?;
    let views: BTreeMap<String, CellView> = cells
        .reached
        .iter()
        .map(|(name, cell)| {
            let view = CellView {
                cluster_id: cell.cluster_id.clone(),
                epoch: cell.epoch,
                copy: cell.copy.as_ref().map(|c| c.map.clone()),
            };
            (name.clone(), view)
        })
        .collect();
    let map = match plan::plan_set(&file, &views, &cells.start.cluster_id)? {
        SetPlan::Unchanged(map) => {
            println!(
                "every cell already holds this shard map (version {}): nothing written",
                map.version
            );
            return Ok(());
        }
        SetPlan::Write(map) => map,
    };
    // A cell without a copy has served every name: what it holds must stay its own. A
    // first look, before anything is written, refuses a plain mistake.
    let order = plan::set_order(&views, &cells.start.cluster_id);
    for name in &order.claim {
        cells.check_own(name, &map).await??;
    }
    println!(
        "writing shard map version {} to {} cells",
        map.version,
        views.len()
    );
    // The look that counts: once a cell's copy is written it grants only what the copy
    // routes to it (every grant compares the copy), so a key of a name routed elsewhere
    // found now was granted before, perhaps after the first look.
    let mut claimed: Vec<&str> = Vec::new();
    for name in &order.claim {
        if let Err(e) = cells.write(name, &map).await {
            if e.downcast_ref::<lockcell_cell::error::CellError>()
                .is_some()
            {
                bail!("{e:#}. Cell {name}'s copy may have been written all the same, and a rerun would not check a cell with a copy: look with `lockcell-cell shardmap show`, and if {name} holds version {}, delete its key /sys/shardmap before running the same set again", map.version);
            }
            return Err(e);
        }
        let scanned = match cells.check_own(name, &map).await {
            Ok(scanned) => scanned,
            // A rerun would find the copy and not look again: undo it.
            Err(e) => match cells.remove(name).await {
                Ok(()) => bail!("cell {name} could not be checked for keys of names routed elsewhere once its copy was written ({e:#}); the copy was deleted again: run the same set again"),
                Err(undo) => bail!("cell {name} holds version {} but could not be checked for keys of names routed elsewhere ({e:#}), nor its copy deleted again ({undo:#}): delete its key /sys/shardmap and run the same set again, which checks it", map.version),
            },
        };
        if let Err(refusal) = scanned {
            cells
                .remove(name)
                .await
                .with_context(|| refusal.to_string())?;
            let written = match &claimed[..] {
                [] => String::new(),
                some => format!(
                    "; cells {} keep version {} (they hold only keys of their own names)",
                    some.join(", "),
                    map.version
                ),
            };
            bail!("{refusal}. The keys appeared while this ran; cell {name}'s copy was deleted again, so it serves every name as before{written}");
        }
        claimed.push(name);
    }
    cells.write_all(&map, &order.rest).await?;
    println!("every cell holds shard map version {}", map.version);
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    #[test]
    fn the_command_line_is_well_formed() {
        crate::Cli::command().debug_assert();
        let cli = crate::Cli::try_parse_from([
            "lockcell-cell",
            "shardmap",
            "move",
            "",
            "--to",
            "b",
            "--wait",
            "30s",
            "--etcd",
            "h:1",
        ])
        .unwrap();
        let crate::Command::Shardmap(args) = cli.command else {
            panic!("{cli:?}")
        };
        match args.command {
            super::ShardmapCommand::Move {
                prefix,
                to,
                wait,
                abort,
                ..
            } => {
                assert_eq!((prefix.as_str(), to.as_str(), abort), ("", "b", false));
                assert_eq!(wait, std::time::Duration::from_secs(30));
            }
            other => panic!("{other:?}"),
        }
    }
}
