//! `lockcell-cell shardmap move`: the six steps of a move, or the rest of them after an
//! interruption, and `--abort`. Which steps remain is `plan::move_state`'s answer.

use std::time::Duration;

use anyhow::bail;
use lockcell_cell::epoch;
use lockcell_cell::shardmap::plan::{self, MoveState, Moving};
use lockcell_cell::shardmap::store::{self, Copied, Found};
use lockcell_cell::shardmap::ShardMap;
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
                println!("steps 2-4 done before, and the switch begun: version {} routes {prefix:?} to cell {target}", switched.version);
                println!("step 5/6: writing it to every cell still behind");
                let order = plan::switch_order(&copies, &source, target);
                self.write_all(&switched, &order).await?;
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
        // First the moving map (which routes the names to the source, paused) to the
        // target's copy: an abort deletes its keys only while that copy is the abort's,
        // so none of the keys this move finds there can go before the switch.
        self.write_all(paused, &[target.to_owned()]).await?;
        self.delete_stale(target, source, prefix, paused, &keys)
            .await?;
        let timeout = self.timeout;
        for key in &keys {
            let kv = &mut self.cell(target)?.kv;
            let why = moving(format!(
                "a shard map move of {prefix:?} from cell {source}: the copy"
            ));
            if let Copied::Differs(there) =
                store::copy_key(kv, &key.key, &key.value, &why, timeout).await?
            {
                bail!(
                    "cell {target} already has the small key {} with another value ({:?}, here {:?}); {prefix:?} stays paused. Delete or correct it in {target} and run the move again, or undo the move with --abort",
                    key.shown(),
                    String::from_utf8_lossy(&there),
                    String::from_utf8_lossy(&key.value)
                );
            }
        }
        let source_epoch = self.epoch(source).await?;
        let target_epoch = self.epoch(target).await?;
        let version = plan::next_version(&self.copies());
        let switched = plan::switched(paused, prefix, target, source_epoch, target_epoch, version);
        let epoch = switched.route(prefix).map_or(0, |r| r.epoch);
        println!("step 5/6: switching {prefix:?} to cell {target} at epoch {epoch} (version {version}): {source} first, then {target}, then the others");
        // The source's write compares its copy with this move's pause: a set, another
        // move or an abort since then stops the switch before any target serves.
        let order = plan::switch_order(&self.copies(), source, target);
        self.write_all(&switched, &order).await?;
        self.delete(source, prefix, &keys).await?;
        println!("moved {prefix:?} from cell {source} to cell {target}");
        Ok(())
    }

    /// Step 4, first: deletes the persistent small keys of the route that `target` holds
    /// and `source` (whose `keys` are the route's now) does not hold with that value.
    /// `target` does not serve the route; such a key is left from a time it did (a move
    /// away whose last step was interrupted), and was deleted or changed since in the
    /// cell that served it: left in place, it would be served again once the route is
    /// switched here.
    async fn delete_stale(
        &mut self,
        target: &str,
        source: &str,
        prefix: &str,
        paused: &ShardMap,
        keys: &[Found],
    ) -> anyhow::Result<()> {
        let timeout = self.timeout;
        let there = self.persistent(target, paused, prefix).await?;
        let kv = &mut self.cell(target)?.kv;
        let current = |t: &&Found| keys.iter().any(|k| k.key == t.key && k.value == t.value);
        let why = moving(format!(
            "a shard map move of {prefix:?} from cell {source}: a stale copy deleted before copying"
        ));
        for stale in there.iter().filter(|t| !current(t)) {
            if store::delete_key(kv, &stale.key, stale.mod_revision, &why, timeout).await? {
                println!(
                    "  deleted {} from cell {target}: left there from before, and cell {source}, which serves it, has it with another value or not at all",
                    stale.shown()
                );
            }
        }
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
        let why = moving(format!(
            "a shard map move of {prefix:?}: the clean-up; the key lives on in the cell it moved to"
        ));
        for key in keys {
            if !store::delete_key(kv, &key.key, key.mod_revision, &why, timeout).await? {
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
        println!("{}", rerun_done(prefix, target, found));
        Ok(())
    }

    /// Step 6 of a move continued after an interruption: deletes from `cell`, which no
    /// longer serves the route, every persistent small key of it: those `target` holds
    /// with the same value (copied), and those it holds with another value or not at all
    /// (changed or deleted in `target` since the switch: stale here, and served again if
    /// the route ever came back). How many keys `cell` held.
    async fn delete_copied(
        &mut self,
        cell: &str,
        target: &str,
        prefix: &str,
        switched: &ShardMap,
    ) -> anyhow::Result<usize> {
        let timeout = self.timeout;
        let keys = self.persistent(cell, switched, prefix).await?;
        for key in &keys {
            let there = store::value(&mut self.cell(target)?.kv, &key.key, timeout).await?;
            if there.as_deref() != Some(key.value.as_slice()) {
                println!(
                    "  cell {cell} holds {}, which cell {target} holds with another value or not at all: stale (no cell serves it in {cell}), deleted",
                    key.shown()
                );
            }
        }
        if !keys.is_empty() {
            self.delete(cell, prefix, &keys).await?;
        }
        Ok(keys.len())
    }

    /// `move --abort`: the route unpaused in every cell, the target first and the source
    /// last (`plan::plan_abort` says why); before the source, the keys the move copied to
    /// the target are deleted there.
    pub(super) async fn abort(&mut self, prefix: &str, target: &str) -> anyhow::Result<()> {
        let copies = self.copies();
        let plan::Abort {
            source,
            unpaused,
            order,
        } = plan::plan_abort(&copies, prefix, target)?;
        println!(
            "aborting the move of {prefix:?} out of cell {source}: version {} with it unpaused, to cell {target} first, cell {source} last",
            unpaused.version
        );
        let (before_source, source_only) = order.split_at(order.len() - 1);
        if let Err(e) = self
            .unpause_elsewhere(prefix, target, &source, &unpaused, before_source)
            .await
        {
            bail!("{e:#}\n{prefix:?} stays paused in cell {source}: nothing is granted or written under it. Run the move again to finish it, or the abort again to undo it");
        }
        if let Err(e) = self.write_all(&unpaused, source_only).await {
            bail!("{e:#}\nthe other cells hold the map with {prefix:?} unpaused in cell {source}, but {source} itself was not written: it may have been switched by a move meanwhile. Look with `lockcell-cell shardmap show`, and run the move again to finish it, or the abort again to undo it");
        }
        println!("cell {source} serves {prefix:?} again");
        Ok(())
    }

    /// The abort up to the source: `unpaused` to the cells of `order`, then the deletion
    /// from `target` of the persistent small keys that step 4 copied there and that
    /// still hold the source's value (`target` no longer serves them in any copy).
    async fn unpause_elsewhere(
        &mut self,
        prefix: &str,
        target: &str,
        source: &str,
        unpaused: &ShardMap,
        order: &[String],
    ) -> anyhow::Result<()> {
        self.write_all(unpaused, order).await?;
        let timeout = self.timeout;
        let originals = self.persistent(source, unpaused, prefix).await?;
        let there = self.persistent(target, unpaused, prefix).await?;
        let (copied, others) = store::same_in(there, &originals);
        let target_cell = self.cell(target)?;
        let Some(map_revision) = target_cell.copy.as_ref().map(|c| c.mod_revision) else {
            bail!("cell {target} has no copy of the shard map after it was written");
        };
        let mut deleted = 0;
        let why = moving(format!(
            "an aborted shard map move of {prefix:?}: its copy deleted; the key lives on in cell {source}"
        ));
        for key in &copied {
            let kv = &mut target_cell.kv;
            if store::delete_key_under_map(
                kv,
                &key.key,
                key.mod_revision,
                map_revision,
                &why,
                timeout,
            )
            .await?
            {
                deleted += 1;
            }
        }
        println!(
            "  deleted {deleted} of the {} persistent small keys under {prefix:?} that the move had copied to cell {target}{}",
            copied.len(),
            match (copied.len() - deleted, others) {
                (0, 0) => String::new(),
                (changed, others) => format!(
                    " (left there: {changed} changed meanwhile, {others} with another value than cell {source}'s)"
                ),
            }
        );
        Ok(())
    }
}

/// What a rerun of a move that every copy has switched says, after it deleted what an
/// interrupted step 6 left: `left` keys of the route found in other cells.
fn rerun_done(prefix: &str, target: &str, left: usize) -> String {
    match left {
        0 => format!("{prefix:?} is in cell {target} in every copy of the shard map and no other cell holds its small keys: already moved; nothing to do"),
        left => format!("moved {prefix:?} to cell {target}: {left} of its small keys were left in other cells, deleted where cell {target} holds the same value"),
    }
}

/// How a move's writes show in the audit trail: as `lockcell-cell shardmap move`,
/// with `detail` saying which part of the move they are.
fn moving(detail: String) -> lockcell_cell::kv::Writer {
    lockcell_cell::kv::Writer {
        identity: format!(
            "lockcell-cell shardmap move (run by {})",
            crate::operate::default_operator()
        ),
        detail,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::rerun_done;

    #[test]
    fn a_rerun_of_a_finished_move_has_nothing_to_do() {
        let done = rerun_done("billing/", "a", 0);
        assert!(done.ends_with("already moved; nothing to do"), "{done}");
        let leftovers = rerun_done("billing/", "a", 3);
        assert!(leftovers.contains("3 of its small keys"), "{leftovers}");
    }
}
