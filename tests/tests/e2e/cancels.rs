//! Acquires and campaigns given up on (their futures dropped, as `tokio::time::timeout`
//! and `select!` do) at random moments around the holder's release: none may leave the
//! session holding a grant the application has no guard for. Locks of an arbitrated
//! class and of a fair one (whose waiters are keys in etcd), and elections.

use std::time::Duration;

use anyhow::{bail, ensure, Context};
use lockcell_client::{Client, Session, Wait};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::support::short_session;

/// Rounds of one run: a third each of arbitrated locks, elections and fair locks.
const ROUNDS: usize = 36;

const CLASSES: &str = r#"
[[class]]
name = "fair"
prefix = "cancels/fair/"
fair = true
"#;
/// Long enough that a grant left behind would outlive the check by far.
const TTL: Duration = Duration::from_secs(30);

pub async fn a_cancelled_acquire_or_campaign_never_leaves_a_grant_without_a_guard(
) -> anyhow::Result<()> {
    let (_etcd, proxies, _) = crate::contention::classed_cell(CLASSES).await?;
    let client = Client::connect(&proxies[0].url()).await?;
    let seed: u64 = rand::random();
    println!("seed {seed}");
    // Lanes side by side, for the load under which a late grant shows.
    let lanes: Vec<_> = (0..LANES)
        .map(|lane| {
            tokio::spawn(lane_of_rounds(
                client.clone(),
                lane,
                seed.wrapping_add(lane),
            ))
        })
        .collect();
    let mut cancelled = 0;
    for lane in lanes {
        cancelled += lane.await??;
    }
    println!(
        "{cancelled} of {} waits given up on; every lock and election was free after",
        LANES as usize * ROUNDS
    );
    Ok(())
}

/// Lanes run at once.
const LANES: u64 = 4;

/// [`ROUNDS`] rounds on names of lane `lane`; how many waits were given up on.
async fn lane_of_rounds(client: Client, lane: u64, seed: u64) -> anyhow::Result<usize> {
    let holder = client.open_session(short_session(TTL)).await?;
    let waiter = client.open_session(short_session(TTL)).await?;
    let prober = client.open_session(short_session(TTL)).await?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut cancelled = 0;
    for round in 0..ROUNDS {
        let election = round % 3 == 1;
        let name = match round % 3 {
            2 => format!("cancels/fair/{lane}/{round}"),
            _ => format!("cancels/{lane}/{round}"),
        };
        let release_in = Duration::from_millis(rng.random_range(20..60));
        // The waiter gives up within 15 ms either side of the release.
        let give_up_in =
            release_in + Duration::from_millis(rng.random_range(0..30)) - Duration::from_millis(15);
        let waited = if election {
            let led = holder
                .campaign(&name, "holder", Wait::Try)
                .await?
                .context("an election with no leader was not won")?;
            let resign = tokio::spawn(async move {
                tokio::time::sleep(release_in).await;
                led.resign().await
            });
            let waited =
                tokio::time::timeout(give_up_in, waiter.campaign(&name, "waiter", Wait::Forever))
                    .await;
            resign.await??;
            match waited {
                Ok(Ok(Some(led))) => led.resign().await.map(|_| false)?,
                Ok(other) => bail!("round {round}: the campaign ended with {other:?}"),
                Err(_) => true,
            }
        } else {
            let held = holder
                .acquire(&name, Wait::Try)
                .await?
                .context("a free lock was not granted")?;
            let release = tokio::spawn(async move {
                tokio::time::sleep(release_in).await;
                held.release().await
            });
            let waited =
                tokio::time::timeout(give_up_in, waiter.acquire(&name, Wait::Forever)).await;
            release.await??;
            match waited {
                Ok(Ok(Some(guard))) => guard.release().await.map(|_| false)?,
                Ok(other) => bail!("round {round}: the acquire ended with {other:?}"),
                Err(_) => true,
            }
        };
        cancelled += usize::from(waited);
        // The session that gave up takes the name again at once (its next acquire waits
        // for the withdrawal), then another session does.
        for session in [&waiter, &prober] {
            free_soon(session, &name, election)
                .await
                .with_context(|| format!("{name} (seed {seed}, given up on: {waited})"))?;
        }
    }
    Ok(cancelled)
}

/// Waits until `prober` can take `name` (a lock, or an election), and lets go of it:
/// no one holds it, and no grant is left with no guard.
async fn free_soon(prober: &Session, name: &str, election: bool) -> anyhow::Result<()> {
    let what = format!("{name} free after the wait on it was given up (no grant without a guard)");
    lockcell_tests::eventually(&what, Duration::from_secs(5), || async {
        let taken = if election {
            match prober.campaign(name, "prober", Wait::Try).await? {
                Some(led) => led.resign().await.map(|_| true)?,
                None => false,
            }
        } else {
            match prober.acquire(name, Wait::Try).await? {
                Some(guard) => guard.release().await.map(|_| true)?,
                None => false,
            }
        };
        Ok(taken.then_some(()))
    })
    .await
}

/// Two tasks of one session wait for one lock; one gives up just as the holder lets go.
/// The withdrawal is keyed by its call: whichever way the race goes, the other task's
/// wait ends granted with a valid guard (a withdrawal never takes another call's grant),
/// and once that guard is released the lock is free.
pub async fn a_given_up_call_never_takes_the_grant_of_another_call_of_its_session(
) -> anyhow::Result<()> {
    let (_etcd, proxies) = crate::support::cell(&["a"]).await?;
    let client = Client::connect(&proxies[0].url()).await?;
    let holder = client.open_session(short_session(TTL)).await?;
    let waiter = client.open_session(short_session(TTL)).await?;
    let prober = client.open_session(short_session(TTL)).await?;
    for round in 0..12u64 {
        let name = format!("cancels/two/{round}");
        let held = holder
            .acquire(&name, Wait::Try)
            .await?
            .context("a free lock was not granted")?;
        let staying = tokio::spawn({
            let (waiter, name) = (waiter.clone(), name.clone());
            async move {
                waiter
                    .acquire(&name, Wait::Timeout(Duration::from_secs(20)))
                    .await
            }
        });
        let release_in = Duration::from_millis(20 + round * 3);
        let release = tokio::spawn(async move {
            tokio::time::sleep(release_in).await;
            held.release().await
        });
        let gave_up = tokio::time::timeout(
            Duration::from_millis(20 + round * 2),
            waiter.acquire(&name, Wait::Forever),
        )
        .await;
        release.await??;
        let staying = tokio::time::timeout(Duration::from_secs(20), staying)
            .await
            .context("the other task's wait did not end")??;
        // The given-up call lost the race (or the session's second call was refused as
        // a second hold); the staying task holds the lock, or the given-up one does.
        let guard = match (gave_up, staying) {
            (Ok(Ok(Some(_))), Ok(Some(_))) => bail!("round {round}: both calls were granted"),
            (Ok(Ok(Some(guard))), _) => guard,
            // Given up, or refused as a second hold of the lock by the session.
            (_, Ok(Some(guard))) => guard,
            (gave_up, staying) => bail!("round {round}: given up {gave_up:?}, staying {staying:?}"),
        };
        ensure!(guard.is_valid(), "round {round}: the guard is valid");
        guard.release().await?;
        free_soon(&prober, &name, false)
            .await
            .with_context(|| format!("round {round}"))?;
    }
    Ok(())
}
