//! A client process of fault runs: it takes locks through the SDK, acts as holder (writes
//! to the fenced resource) only while its session's deadline has not passed, and records
//! every grant, act and end of belief for the safety checker (`lockcell_tests::checker`).
//!
//! It knows every proxy (its own first): when its proxy dies, stops answering, cannot
//! reach etcd or drains, the SDK resumes its session on another one, locks and tokens
//! unchanged. When its session expires it opens a new one.
//!
//! It uses the SDK as real programs do, in a mix its seed picks: a hold ends with an
//! explicit release or with the guard dropped and the same lock asked for again at
//! once; a holder asks again for the lock it holds (which must be refused); an acquire
//! is given up (its future dropped) at a random point; its membership key is written
//! and written again as an ephemeral key.
//!
//! It also reads every client's small key (linearizably, after each of its own writes)
//! and follows them and the membership keys with a watch each, recording what it read
//! and every batch each watch delivered, with the cell their revisions are of, for the
//! checks against each cell's history (`kvcheck`). The small keys' prefix moves between
//! cells during a run: writes are refused while it moves, and a watch of it ends when
//! it has moved and starts again from now.

use std::fs::File;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use backon::{BackoffBuilder, ExponentialBuilder, Retryable};
use clap::Parser;
use lockcell_client::{
    Client, ClientOptions, Condition, Error, EventKind, Session, SessionOptions, SessionState,
    Wait, WatchOptions,
};
use lockcell_tests::checker::Record;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// How often a holder acts (writes to the fenced resource).
const ACT_EVERY: Duration = Duration::from_millis(20);
/// How often the client writes its small key (acknowledged writes are checked against
/// the store's history after the run).
const WRITE_EVERY: Duration = Duration::from_millis(250);
/// Retries of failed calls back off from 50 ms to this.
const RETRY_MAX: Duration = Duration::from_secs(1);

/// How a failed connect, open or acquire is tried again: backing off, without end (the
/// run ends the process).
fn retries() -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(50))
        .with_max_delay(RETRY_MAX)
        .with_jitter()
        .without_max_times()
}

/// Why a hold ended when the client let go of it itself.
const RELEASED: &str = "released";

#[derive(Parser)]
#[command(
    about = "A lockcell client for fault runs: takes locks, acts while valid, records everything"
)]
struct Args {
    /// Proxies to use, in order of preference.
    #[arg(long, value_delimiter = ',', required = true)]
    proxies: Vec<String>,
    /// Locks to contend for.
    #[arg(long, value_delimiter = ',', required = true)]
    locks: Vec<String>,
    /// Where to append the JSON-lines record.
    #[arg(long)]
    log: std::path::PathBuf,
    /// The fenced resource server (`127.0.0.1:PORT`).
    #[arg(long)]
    fenced: String,
    /// This client's name in the records.
    #[arg(long)]
    name: String,
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    ttl: Duration,
    /// How long a session may stay in jeopardy with no proxy reached before it expires.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    grace: Duration,
    /// Seed of the client's choices.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Hold every lock this long before letting go (default: a random 50 to 300 ms).
    #[arg(long, value_parser = humantime::parse_duration)]
    hold_for: Option<Duration>,
}

/// Converts instants to nanoseconds of the machine's CLOCK_MONOTONIC, comparable across
/// processes, even when a fault runs this process's clock fast or slow.
///
/// Under libfaketime the C library's `clock_gettime` (which `Instant` reads) is faked,
/// so the machine's clock is read with the system call itself, and an instant is placed
/// on it at the rate the two clocks have run since the start: a deadline the faked clock
/// reaches in 2 s, running at 0.8, is 2.5 s away on the machine's.
struct Clock {
    base: Instant,
    base_ns: u64,
}

impl Clock {
    fn new() -> anyhow::Result<Clock> {
        let base = Instant::now();
        let base_ns = machine_ns()?;
        Ok(Clock { base, base_ns })
    }

    fn ns(&self, at: Instant) -> u64 {
        let now = Instant::now();
        let Ok(now_ns) = machine_ns() else {
            return 0;
        };
        let faked = (now - self.base).as_nanos() as f64;
        let machine = now_ns.saturating_sub(self.base_ns) as f64;
        let rate = if faked > 0.0 && machine > 0.0 {
            faked / machine
        } else {
            1.0
        };
        let ahead = if at >= now {
            (at - now).as_nanos() as f64
        } else {
            -((now - at).as_nanos() as f64)
        };
        (now_ns as f64 + ahead / rate).max(0.0) as u64
    }
}

/// The machine's CLOCK_MONOTONIC in nanoseconds, by the system call (never faked).
fn machine_ns() -> anyhow::Result<u64> {
    use nix::libc;
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a pointer to a live, writable
    // one of the right type, and reads nothing else.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_clock_gettime,
            libc::CLOCK_MONOTONIC,
            &mut ts as *mut libc::timespec,
        )
    };
    anyhow::ensure!(
        rc == 0,
        "clock_gettime: {}",
        std::io::Error::last_os_error()
    );
    Ok(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}

/// The client's record, shared by its tasks (each line written whole).
#[derive(Clone)]
struct Recorder {
    file: Arc<Mutex<File>>,
}

impl Recorder {
    fn write(&self, record: &Record) -> anyhow::Result<()> {
        let mut line = serde_json::to_string(record)?;
        line.push('\n');
        self.file
            .lock()
            .expect("record file")
            .write_all(line.as_bytes())?;
        Ok(())
    }
}

struct Fenced {
    lines: Lines<BufReader<OwnedReadHalf>>,
    write: OwnedWriteHalf,
}

impl Fenced {
    async fn connect(addr: &str) -> anyhow::Result<Fenced> {
        let (read, write) = TcpStream::connect(addr).await?.into_split();
        Ok(Fenced {
            lines: BufReader::new(read).lines(),
            write,
        })
    }

    async fn write(&mut self, lock: &str, token: &str, writer: &str) -> anyhow::Result<bool> {
        self.write
            .write_all(format!("{lock} {token} {writer}\n").as_bytes())
            .await?;
        let reply = self
            .lines
            .next_line()
            .await?
            .context("fenced server hung up")?;
        Ok(reply == "ok")
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let clock = Clock::new()?;
    let recorder = Recorder {
        file: Arc::new(Mutex::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&args.log)
                .with_context(|| format!("opening {}", args.log.display()))?,
        )),
    };
    let mut fenced = Fenced::connect(&args.fenced).await?;
    let mut rng = StdRng::seed_from_u64(args.seed);
    let options = ClientOptions::new(args.proxies.clone()).grace(args.grace);
    let client = (|| Client::connect_with(options.clone()))
        .retry(retries())
        .notify(|e, _| eprintln!("{}: connect: {e}", args.name))
        .await?;
    for prefix in WATCHED {
        tokio::spawn(follow_keys(
            client.clone(),
            args.name.clone(),
            prefix,
            recorder.clone(),
        ));
    }
    loop {
        let session = (|| open(&client, args.ttl, &args.name))
            .retry(retries())
            .notify(|e, _| eprintln!("{}: open: {e}", args.name))
            .await?;
        hold_locks(
            &args,
            &client,
            &session,
            &clock,
            &recorder,
            &mut fenced,
            &mut rng,
        )
        .await?;
    }
}

/// The prefixes each client watches: the small keys' (which a fault moves to another
/// cell and back) and the membership keys'.
const WATCHED: [&str; 2] = [KV, "chaos/members/"];
/// The prefix of the persistent small keys, which each client reads.
const KV: &str = "chaos/kv/";

/// Follows every client's keys under `prefix` with a watch for as long as the client
/// runs, and records each batch delivered. A watch that cannot go on (compacted, or its
/// names served by another cell) starts again from now, recorded as a new start.
async fn follow_keys(client: Client, name: String, prefix: &'static str, recorder: Recorder) {
    loop {
        let options = WatchOptions::prefix().reconnecting_for(Duration::from_secs(30));
        let mut watch = match client.watch(prefix, options).await {
            Ok(watch) => watch,
            Err(e) => {
                eprintln!("{name}: watch {prefix}: {e}");
                tokio::time::sleep(RETRY_MAX).await;
                continue;
            }
        };
        let at = watch.at();
        if recorder
            .write(&Record::WatchFrom {
                client: name.clone(),
                prefix: prefix.to_owned(),
                from: at.revision + 1,
                cell: at.cell,
            })
            .is_err()
        {
            return;
        }
        loop {
            match watch.next().await {
                Some(Ok(batch)) => {
                    let events = batch
                        .events
                        .iter()
                        .map(|e| {
                            (
                                e.entry.mod_revision,
                                e.entry.key.clone(),
                                e.kind == EventKind::Put,
                            )
                        })
                        .collect();
                    let written = recorder.write(&Record::Watched {
                        client: name.clone(),
                        prefix: prefix.to_owned(),
                        through: batch.revision,
                        events,
                    });
                    if written.is_err() {
                        return;
                    }
                }
                // Goes on where it was, with no gap.
                Some(Err(Error::WatchCutOff { .. } | Error::Unavailable(_))) => {}
                Some(Err(e)) => {
                    eprintln!("{name}: watch {prefix}: {e}; watching again from now");
                    break;
                }
                None => break,
            }
        }
    }
}

/// Writes the client's small key (`chaos/kv/<name>`) and its ephemeral membership key
/// (`chaos/members/<name>`, through `session`), each with a value no write before it
/// had, and records each write the service acknowledged; then reads every client's
/// small key, linearizably, and records what it saw.
async fn write_keys(
    args: &Args,
    client: &Client,
    session: &Session,
    clock: &Clock,
    recorder: &Recorder,
) -> anyhow::Result<()> {
    for ephemeral in [false, true] {
        let key = if ephemeral {
            format!("chaos/members/{}", args.name)
        } else {
            format!("chaos/kv/{}", args.name)
        };
        let at_ns = clock.ns(Instant::now());
        let value = format!("{}@{at_ns}", args.name);
        let written = if ephemeral {
            session
                .put_ephemeral(&key, value.as_bytes(), Condition::Always)
                .await
        } else {
            client.put(&key, value.as_bytes(), Condition::Always).await
        };
        match written {
            Ok(written) if written.succeeded => recorder.write(&Record::KvWrite {
                client: args.name.clone(),
                key,
                value,
                revision: written.revision,
                at_ns,
                acked_ns: clock.ns(Instant::now()),
                deadline_ns: if ephemeral {
                    clock.ns(session.deadline())
                } else {
                    0
                },
            })?,
            Ok(_) => {}
            Err(e) => eprintln!("{}: put {key}: {e}", args.name),
        }
    }
    let began_ns = clock.ns(Instant::now());
    match client.snapshot_prefix(KV).await {
        Ok(snapshot) => recorder.write(&Record::Read {
            client: args.name.clone(),
            prefix: KV.to_owned(),
            began_ns,
            entries: snapshot
                .entries
                .into_iter()
                .map(|e| {
                    let value = String::from_utf8_lossy(&e.value).into_owned();
                    (e.key, e.mod_revision, value)
                })
                .collect(),
            cell: snapshot.at.cell,
        })?,
        Err(e) => eprintln!("{}: read {KV}: {e}", args.name),
    }
    Ok(())
}

async fn open(client: &Client, ttl: Duration, name: &str) -> Result<Session, Error> {
    client
        .open_session(SessionOptions {
            ttl,
            identity: name.to_owned(),
        })
        .await
}

/// Takes locks in turn until the session is lost (or must be closed: see below).
async fn hold_locks(
    args: &Args,
    client: &Client,
    session: &Session,
    clock: &Clock,
    recorder: &Recorder,
    fenced: &mut Fenced,
    rng: &mut StdRng,
) -> anyhow::Result<()> {
    let mut next_write = Instant::now();
    let mut after_error = retries().build();
    // The lock to ask for at once: the one whose guard was just dropped.
    let mut again: Option<String> = None;
    loop {
        if session.state() == SessionState::Expired {
            return Ok(());
        }
        if Instant::now() >= next_write {
            next_write = Instant::now() + WRITE_EVERY;
            write_keys(args, client, session, clock, recorder).await?;
        }
        let lock = again
            .take()
            .unwrap_or_else(|| args.locks[rng.random_range(0..args.locks.len())].clone());
        let lock = &lock;
        let asked = session.acquire(lock, Wait::Timeout(Duration::from_secs(1)));
        let outcome = if rng.random_ratio(1, 8) {
            // Given up at a random point: a grant that raced in belongs to the session,
            // which no longer knows of it (released when the session closes).
            let patience = Duration::from_millis(rng.random_range(1..300));
            match tokio::time::timeout(patience, asked).await {
                Ok(outcome) => outcome,
                Err(_) => continue,
            }
        } else {
            asked.await
        };
        let guard = match outcome {
            Ok(Some(guard)) => {
                after_error = retries().build();
                guard
            }
            Ok(None) => continue,
            Err(Error::SessionExpired { .. }) => return Ok(()),
            Err(Error::AlreadyHeld(why)) => {
                // A given-up acquire was granted after all: the session holds the lock
                // with no guard, and only its close lets go of it.
                eprintln!("{}: acquire {lock}: {why}; closing the session", args.name);
                recorder.write(&Record::Closed {
                    client: args.name.clone(),
                    at_ns: clock.ns(Instant::now()),
                })?;
                let _ = session.clone().close().await;
                return Ok(());
            }
            Err(e) => {
                // etcd away for a moment, say: try again, backing off.
                eprintln!("{}: acquire {lock}: {e}", args.name);
                tokio::time::sleep(after_error.next().unwrap_or(RETRY_MAX)).await;
                continue;
            }
        };
        let token = guard.token().to_string();
        let name = args.name.clone();
        recorder.write(&Record::Grant {
            client: name.clone(),
            lock: lock.clone(),
            token: token.clone(),
            at_ns: clock.ns(Instant::now()),
            deadline_ns: clock.ns(session.deadline()),
        })?;
        if rng.random_ratio(1, 4) {
            // Asked again while held: never a second grant, never "busy".
            match session.acquire(lock, Wait::Try).await {
                Err(Error::AlreadyHeld(_)) => {}
                Err(_) => {}
                Ok(granted) => recorder.write(&Record::Broken {
                    client: name.clone(),
                    lock: lock.clone(),
                    what: format!(
                        "a second acquire of a lock the session holds (token {token}) gave {}",
                        granted.map_or("no grant".to_owned(), |g| format!("token {}", g.token()))
                    ),
                    at_ns: clock.ns(Instant::now()),
                })?,
            }
        }
        let hold = args
            .hold_for
            .unwrap_or_else(|| Duration::from_millis(rng.random_range(50..300)));
        let until = Instant::now() + hold;
        let mut pace = tokio::time::interval(ACT_EVERY);
        let why = loop {
            pace.tick().await;
            let now = Instant::now();
            if now >= until {
                break RELEASED;
            }
            let deadline = session.deadline();
            if now >= deadline {
                break "the session's deadline passed";
            }
            if !guard.is_valid() {
                break "the lock was lost when the session moved";
            }
            let accepted = fenced.write(lock, &token, &name).await?;
            recorder.write(&Record::Act {
                client: name.clone(),
                lock: lock.clone(),
                token: token.clone(),
                at_ns: clock.ns(now),
                deadline_ns: clock.ns(deadline),
                accepted,
            })?;
        };
        // Belief ends before the release is sent.
        recorder.write(&Record::End {
            client: name,
            lock: lock.clone(),
            token,
            at_ns: clock.ns(Instant::now()),
            why: why.into(),
        })?;
        if why == RELEASED {
            if rng.random_bool(0.5) {
                let _ = guard.release().await;
            } else {
                // Dropped: released in the background, and the same lock asked for at
                // once, as a loop around `acquire` does.
                drop(guard);
                again = Some(lock.clone());
            }
        }
    }
}
