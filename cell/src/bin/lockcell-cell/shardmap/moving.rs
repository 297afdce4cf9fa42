//! `lockcell-cell shardmap move`: the six steps of a move, or the rest of them after an
//! interruption, and `--abort`. Which steps remain is `plan::move_state`'s answer.

use std::time::Duration;

use anyhow::bail;
use lockcell_cell::epoch;
use lockcell_cell::shardmap::plan::{self, MoveState, Moving};
use lockcell_cell::shardmap::store::{self, Copied, Found};
use lockcell_cell::shardmap::{self, ShardMap};
use tokio::time::Instant;

use super::Cells;

/// How often `move` prints how many keys it still waits for.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);
/// How often `move` looks again.
const POLL_EVERY: Duration = Duration::from_secs(1);

impl Cells {
    pub(super) async fn move_prefix(
        &mut self,
        prefix: &str,
        target: &str,
        wait: Duration,
    ) -> anyhow::Result<()> {
        let copies = self.copies();
        let state = plan::move_state(&copies, prefix, target)?;
        if !matches!(state, MoveState::Done { .. }) {
            println!("step 1/6: read every copy ({})", plan::versions(&copies));
        }
        match state {
            MoveState::Start { source, paused } => {
                let carved = plan::current(&copies)
                    .is_some_and(|map| !map.routes.iter().any(|r| r.prefix == prefix));
                if carved {
                    println!("  no route of exactly {prefix:?} yet: carving one out of the route that serves it in cell {source}");
                }
                println!("  moving {prefix:?} from cell {source} to cell {target}");
                println!(
                    "step 2/6: pausing {prefix:?} in cell {source} (version {}): from now on {source} grants and writes nothing under it",
                    paused.version
                );
                self.write(&source, &paused).await?;
                self.finish(prefix, target, &source, &paused, wait).await
            }
            MoveState::Paused { source, paused } => {
                println!("step 2/6: {prefix:?} is already paused in cell {source}: going on");
                self.finish(prefix, target, &source, &paused, wait).await
            }
            MoveState::Switched { source, switched } => {
                println!("steps 2-4 done before: cell {target} already holds the switched map (version {})", switched.version);
                println!("step 5/6: writing it to every cell still behind");
                self.write_all(&switched, &[target, &source]).await?;
                self.delete_copied(&source, target, prefix, &switched)
                    .await?;
                println!("moved {prefix:?} from cell {source} to cell {target}");
                Ok(())
            }
            MoveState::Done { switched } => self.leftovers(prefix, target, &switched).await,
        }
    }

    /// Steps 3 to 6 of a move whose source has the route paused (`paused`).
    async fn finish(
        &mut self,
        prefix: &str,
        target: &str,
        source: &str,
        paused: &ShardMap,
        wait: Duration,
    ) -> anyhow::Result<()> {
        self.drain(prefix, target, source, paused, wait).await?;
        let keys = self.persistent(source, paused, prefix).await?;
        println!(
            "step 4/6: copying {} persistent small keys under {prefix:?} to cell {target}",
            keys.len()
        );
        let timeout = self.timeout;
        for key in &keys {
            let kv = &mut self.cell(target)?.kv;
            if let Copied::Differs(there) =
                store::copy_key(kv, &key.key, &key.value, timeout).await?
            {
                bail!(
                    "cell {target} already has the small key {} with another value ({:?}, here {:?}); {prefix:?} stays paused. Delete or correct it in {target} and run the move again, or undo the move with --abort",
                    key.shown(),
                    String::from_utf8_lossy(&there),
                    String::from_utf8_lossy(&key.value)
                );
            }
        }
        let source_cell = self.cell(source)?;
        let read_again = shardmap::read(&mut source_cell.kv, timeout).await?;
        if read_again != source_cell.copy {
            bail!("cell {source}'s copy of the shard map changed during the move (another set or move?); nothing was switched: run the move again");
        }
        let source_epoch = self.epoch(source).await?;
        let target_epoch = self.epoch(target).await?;
        let version = plan::next_version(&self.copies());
        let switched = plan::switched(paused, prefix, target, source_epoch, target_epoch, version);
        let epoch = switched.route(prefix).map_or(0, |r| r.epoch);
        println!("step 5/6: switching {prefix:?} to cell {target} at epoch {epoch} (version {version}): {target} first, then {source}, then the others");
        self.write_all(&switched, &[target, source]).await?;
        self.delete(source, prefix, &keys).await?;
        println!("moved {prefix:?} from cell {source} to cell {target}");
        Ok(())
    }

    /// Step 3: waits until `source` holds no lock, waiter or ephemeral key of the route.
    async fn drain(
        &mut self,
        prefix: &str,
        target: &str,
        source: &str,
        paused: &ShardMap,
        wait: Duration,
    ) -> anyhow::Result<()> {
        let timeout = self.timeout;
        let deadline = Instant::now() + wait;
        let mut shown = None::<Instant>;
        loop {
            let kv = &mut self.cell(source)?.kv;
            let held = store::moving_keys(kv, paused, prefix, Moving::Held, timeout).await?;
            let Some(first) = held.first() else {
                println!("step 3/6: cell {source} holds no lock, waiter or ephemeral key under {prefix:?}");
                return Ok(());
            };
            if Instant::now() >= deadline {
                bail!(
                    "after {2}, cell {source} still holds {0} keys under {prefix:?} (locks, waiters, ephemeral small keys; e.g. {1}); {prefix:?} stays paused (nothing is granted or written under it). Run the same move again to wait on, or undo it: `lockcell-cell shardmap move {prefix:?} --to {target} --abort`",
                    held.len(), first.shown(), humantime::format_duration(wait)
                );
            }
            if shown.is_none_or(|at| at.elapsed() >= PROGRESS_EVERY) {
                shown = Some(Instant::now());
                println!("step 3/6: waiting for cell {source} to let go of its keys under {prefix:?} (locks, waiters, ephemeral small keys): {} left, e.g. {}", held.len(), first.shown());
            }
            tokio::time::sleep(POLL_EVERY).await;
        }
    }

    /// The persistent small keys of the route `prefix` in `cell`.
    async fn persistent(
        &mut self,
        cell: &str,
        map: &ShardMap,
        prefix: &str,
    ) -> anyhow::Result<Vec<Found>> {
        let timeout = self.timeout;
        let kv = &mut self.cell(cell)?.kv;
        Ok(store::moving_keys(kv, map, prefix, Moving::Persistent, timeout).await?)
    }

    async fn epoch(&mut self, cell: &str) -> anyhow::Result<u64> {
        let timeout = self.timeout;
        match epoch::read(&mut self.cell(cell)?.kv, timeout).await? {
            Some(stored) => Ok(stored.record.epoch),
            None => {
                bail!("cell {cell:?} lost its epoch record during the move; nothing was switched")
            }
        }
    }

    /// Step 6: deletes the copied keys from `source`, each only as copied.
    async fn delete(&mut self, source: &str, prefix: &str, keys: &[Found]) -> anyhow::Result<()> {
        println!(
            "step 6/6: deleting {} copied small keys under {prefix:?} from cell {source}",
            keys.len()
        );
        let timeout = self.timeout;
        let kv = &mut self.cell(source)?.kv;
        for key in keys {
            if !store::delete_key(kv, &key.key, key.mod_revision, timeout).await? {
                println!(
                    "  left {} in cell {source}: it changed after it was copied",
                    key.shown()
                );
            }
        }
        Ok(())
    }

    /// A move every copy has switched: deletes what an interrupted step 6 left in the
    /// other cells, or says there is nothing to do.
    async fn leftovers(
        &mut self,
        prefix: &str,
        target: &str,
        switched: &ShardMap,
    ) -> anyhow::Result<()> {
        let others: Vec<String> = self
            .reached
            .keys()
            .filter(|n| *n != target)
            .cloned()
            .collect();
        let mut found = 0;
        for cell in others {
            found += self.delete_copied(&cell, target, prefix, switched).await?;
        }
        if found > 0 {
            return Ok(());
        }
        Err(plan::PlanError::AlreadyThere {
            prefix: prefix.to_owned(),
            cell: target.to_owned(),
            route: prefix.to_owned(),
        }
        .into())
    }

    /// Step 6 of a move continued after an interruption: deletes from `cell` the
    /// persistent small keys of the route that `target` holds with the same value, and
    /// names the others (their copies were changed or deleted in the target since the
    /// switch; `cell` no longer serves them). How many keys `cell` held.
    async fn delete_copied(
        &mut self,
        cell: &str,
        target: &str,
        prefix: &str,
        switched: &ShardMap,
    ) -> anyhow::Result<usize> {
        let timeout = self.timeout;
        let keys = self.persistent(cell, switched, prefix).await?;
        let mut copied = Vec::new();
        for key in &keys {
            let there = store::value(&mut self.cell(target)?.kv, &key.key, timeout).await?;
            if there.as_deref() == Some(key.value.as_slice()) {
                copied.push(key.clone());
            } else {
                println!(
                    "  cell {cell} holds {}, which cell {target} holds with another value or not at all: left for you to check (no cell serves it in {cell})",
                    key.shown()
                );
            }
        }
        if !copied.is_empty() {
            self.delete(cell, prefix, &copied).await?;
        }
        Ok(keys.len())
    }

    /// `move --abort`: the route unpaused, in the source first, then every other cell.
    pub(super) async fn abort(&mut self, prefix: &str) -> anyhow::Result<()> {
        let copies = self.copies();
        let (source, unpaused) = plan::plan_abort(&copies, prefix)?;
        println!(
            "aborting the move of {prefix:?} out of cell {source}: version {} with it unpaused, to {source} first, then every other cell",
            unpaused.version
        );
        self.write_all(&unpaused, &[&source]).await?;
        println!("cell {source} serves {prefix:?} again");
        Ok(())
    }
}
