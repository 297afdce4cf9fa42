//! Membership the way each target's users keep it: every process announces itself with
//! an ephemeral key in its service's group and watches the group's prefix; after a zone
//! dies, every survivor counts the deletes of its group's departed members.
//!
//! lockcell: `Kv.Put` with the process's session and one `Watch.Watch` stream. Bare
//! etcd and grpc-proxy: a put on the session's lease and one etcd watch per process.
//! Both go over the connection the process renews its session on.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context;
use etcd_client::PutOptions;
use lockcell_loadtest::membership::{self, Arrivals, Deleted, Departures};
use lockcell_loadtest::report::Report;
use lockcell_proto::v1::kv_client::KvClient;
use lockcell_proto::v1::PutRequest;
use tokio::sync::{mpsc, watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tonic::transport::Channel;
use tonic::Code;

use crate::cluster::Cell;
use crate::fleet::{Fleet, SessionKey};
use crate::progress;

mod group_watch;

use group_watch::{open, Watcher};

/// Announcements and watch creations in flight at once, fleet-wide (the fleet opens
/// its sessions 256 at a time too).
const SETUP_CONCURRENCY: usize = 256;
/// Width of the buckets the departures series is counted in.
const ARRIVAL_BUCKET: Duration = Duration::from_millis(10);

/// How a process reaches its target: its fleet connection, as the target's client.
#[derive(Clone)]
enum Client {
    Lockcell(Channel),
    Etcd(Arc<etcd_client::Client>),
}

/// Process `process` of service `service`, played by fleet member `member`.
#[derive(Debug, Clone, Copy)]
struct Process {
    member: u32,
    service: u32,
    process: u8,
}

/// What the announcing and watching tasks need: every process, and its connection.
struct Plan {
    processes: Vec<Process>,
    /// One client per fleet connection.
    clients: Vec<Client>,
    /// The connection of every fleet member.
    connection_of: Vec<u32>,
    sessions: Vec<SessionKey>,
}

impl Plan {
    fn client(&self, p: &Process) -> Client {
        self.clients[self.connection_of[p.member as usize] as usize].clone()
    }

    /// Puts process `k`'s key, owned by its session.
    async fn announce(&self, k: usize) -> anyhow::Result<()> {
        let p = self.processes[k];
        let key = membership::member_key(p.service as usize, p.process as usize);
        let value = p.member.to_string();
        match (self.client(&p), &self.sessions[p.member as usize]) {
            (Client::Lockcell(channel), SessionKey::Lockcell { id, secret }) => {
                KvClient::new(channel)
                    .put(PutRequest {
                        key: key.clone(),
                        value: value.into_bytes(),
                        session_id: id.to_string(),
                        session_secret: secret.to_string(),
                        ..Default::default()
                    })
                    .await
                    .with_context(|| format!("announcing {key}"))?;
            }
            (Client::Etcd(client), SessionKey::Etcd(lease)) => {
                let key = membership::etcd_key(&key);
                client
                    .kv_client()
                    .put(
                        key.as_bytes(),
                        value,
                        Some(PutOptions::new().with_lease(*lease)),
                    )
                    .await
                    .with_context(|| format!("announcing {key}"))?;
            }
            _ => anyhow::bail!("session and client speak different protocols"),
        }
        Ok(())
    }
}

/// What the watch tasks share: the kill instant, the counters and the arrival times.
struct Shared {
    killed: OnceLock<Instant>,
    /// Deletes of departing members received by survivors after the kill.
    delivered: AtomicU64,
    /// Deletes of surviving members received by survivors.
    false_departures: AtomicU64,
    /// Survivors whose watch could not be opened, or broke and could not be resumed.
    watch_errors: AtomicU64,
    /// Times a survivor's broken watch was opened again.
    resumes: AtomicU64,
    /// Survivors yet to see every departure of their group.
    remaining: AtomicU64,
    /// The latest time a survivor saw its last departure, in ns since the kill.
    last_complete_ns: AtomicU64,
    arrivals: Arrivals,
    all_seen: watch::Sender<bool>,
}

impl Shared {
    fn on_delete(&self, key: &[u8], tally: &mut Departures) {
        let Some(process) = membership::process_of(key) else {
            return;
        };
        let since = self.killed.get().map(Instant::elapsed);
        match tally.deleted(process) {
            Deleted::Departure { last } => {
                if let Some(since) = since {
                    self.delivered.fetch_add(1, Ordering::Relaxed);
                    self.arrivals.record(since);
                }
                if last {
                    let ns = since.unwrap_or_default().as_nanos() as u64;
                    self.last_complete_ns.fetch_max(ns, Ordering::Relaxed);
                    if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
                        let _ = self.all_seen.send(true);
                    }
                }
            }
            Deleted::Again if since.is_some() => {
                self.delivered.fetch_add(1, Ordering::Relaxed);
            }
            Deleted::Survivor => {
                self.false_departures.fetch_add(1, Ordering::Relaxed);
            }
            Deleted::Again | Deleted::Stranger => {}
        }
    }
}

/// The membership of a running zone-failure scenario.
pub struct Membership {
    shared: Arc<Shared>,
    /// Watches of the processes in the zone that dies: aborted at the kill, as their
    /// processes die with it.
    doomed: JoinSet<()>,
    /// Watches of the survivors, until [`Membership::finish`].
    survivors: JoinSet<()>,
    all_seen: watch::Receiver<bool>,
    /// Departures the survivors should see: survivors × departing members of their group.
    expected: u64,
    /// Survivors with at least one departing member in their group.
    waiting: u64,
    /// Processes whose announcement the target refused.
    not_announced: u64,
}

/// The outcome of setting membership up.
pub enum Setup {
    Ready(Membership),
    /// The target does not implement what membership needs (its message).
    Unsupported(String),
}

impl Membership {
    /// Announces every process of `groups` (fleet indices by service), then opens every
    /// process's watch, and returns once every watch is created. `dead_zone` is the
    /// zone that will die; `span` how long after the kill departures are counted.
    pub async fn start(
        cell: &Cell,
        fleet: &Fleet,
        groups: &[Vec<usize>],
        dead_zone: usize,
        span: Duration,
    ) -> anyhow::Result<Setup> {
        let plan = Arc::new(plan(cell, fleet, groups).await?);
        let n = plan.processes.len();
        let dies = |p: &Process| fleet.members[p.member as usize].zone == dead_zone;

        // A first process alone, so a target without Kv or Watch is told apart at once.
        let mut refused = Vec::new();
        if let Err(e) = plan.announce(0).await {
            if let Some(why) = unimplemented(&e) {
                return Ok(Setup::Unsupported(why));
            }
            refused.push((0, e));
        }
        if let Err(e) = open(&plan.client(&plan.processes[0]), &plan.processes[0], 0).await {
            if let Some(why) = unimplemented(&e) {
                return Ok(Setup::Unsupported(why));
            }
        }
        refused.extend(announce_all(&plan).await);
        if let Some((k, e)) = refused.first() {
            tracing::warn!(
                member = plan.processes[*k].member,
                error = %format!("{e:#}"),
                refused = refused.len(),
                "announcements refused"
            );
        }
        let mut announced = vec![true; n];
        for (k, _) in &refused {
            announced[*k] = false;
        }

        // What each group loses: its announced members in the dying zone.
        let mut departing = vec![0u64; groups.len()];
        for (k, p) in plan.processes.iter().enumerate() {
            if dies(p) && announced[k] {
                departing[p.service as usize] |= 1 << p.process;
            }
        }
        let (mut expected, mut waiting) = (0, 0);
        for p in plan.processes.iter().filter(|p| !dies(p)) {
            let d = departing[p.service as usize];
            expected += u64::from(d.count_ones());
            waiting += u64::from(d != 0);
        }

        let (all_seen_tx, all_seen) = watch::channel(waiting == 0);
        let shared = Arc::new(Shared {
            killed: OnceLock::new(),
            delivered: AtomicU64::new(0),
            false_departures: AtomicU64::new(0),
            watch_errors: AtomicU64::new(0),
            resumes: AtomicU64::new(0),
            remaining: AtomicU64::new(waiting),
            last_complete_ns: AtomicU64::new(0),
            arrivals: Arrivals::new(ARRIVAL_BUCKET, span),
            all_seen: all_seen_tx,
        });

        // One task per watch: open it (a few at a time), say so, then follow it.
        let bar = progress::count("opening watches", n as u64);
        let gate = Arc::new(Semaphore::new(SETUP_CONCURRENCY));
        let (opened_tx, mut opened) = mpsc::channel::<Result<(), String>>(1024);
        let (mut doomed, mut survivors) = (JoinSet::new(), JoinSet::new());
        for p in &plan.processes {
            let (gate, opened_tx) = (gate.clone(), opened_tx.clone());
            let task = Watcher {
                process: *p,
                client: plan.client(p),
                tally: (!dies(p)).then(|| Departures::new(departing[p.service as usize])),
                shared: shared.clone(),
            };
            let run = async move {
                let permit = gate.acquire().await.expect("gate open");
                // Boxed: once open, the task keeps nothing of the opening's state.
                let first = Box::pin(open(&task.client, &task.process, 0)).await;
                drop(permit);
                let _ = opened_tx
                    .send(first.as_ref().map(|_| ()).map_err(|e| format!("{e:#}")))
                    .await;
                drop(opened_tx);
                task.run(first).await
            };
            if dies(p) {
                doomed.spawn(run);
            } else {
                survivors.spawn(run);
            }
        }
        drop(opened_tx);
        let mut failed = 0;
        while let Some(result) = opened.recv().await {
            if let Err(e) = result {
                if failed == 0 {
                    tracing::warn!(error = %e, "a membership watch could not be opened");
                }
                failed += 1;
            }
            bar.inc(1);
        }
        bar.finish_and_clear();
        if failed > 0 {
            tracing::warn!(failed, "membership watches not opened");
        }
        Ok(Setup::Ready(Membership {
            shared,
            doomed,
            survivors,
            all_seen,
            expected,
            waiting,
            not_announced: refused.len() as u64,
        }))
    }

    /// The zone died at `at`: departures count from then on, and its processes' watches
    /// end with them.
    pub fn kill(&mut self, at: Instant) {
        let _ = self.shared.killed.set(at);
        self.doomed.abort_all();
    }

    /// Survivors with departures to see, and how many of them have seen them all.
    pub fn progress(&self) -> (u64, u64) {
        let remaining = self.shared.remaining.load(Ordering::Relaxed);
        (self.waiting, self.waiting - remaining)
    }

    /// Resolves once every survivor has seen every departure of its group.
    pub async fn all_seen(&mut self) {
        let _ = self.all_seen.wait_for(|done| *done).await;
    }

    /// Stops every watch and adds the membership figures and series to `report`.
    pub async fn finish(mut self, report: &mut Report) {
        self.survivors.shutdown().await;
        self.doomed.shutdown().await;
        let s = &self.shared;
        let remaining = s.remaining.load(Ordering::Relaxed);
        report.metric("membership_events_expected", self.expected as f64);
        report.metric(
            "membership_events_delivered",
            s.delivered.load(Ordering::Relaxed) as f64,
        );
        if remaining == 0 {
            let ns = s.last_complete_ns.load(Ordering::Relaxed);
            report.metric(
                "membership_all_seen_s",
                Duration::from_nanos(ns).as_secs_f64(),
            );
        }
        report.metric("membership_survivors_incomplete", remaining as f64);
        report.metric(
            "membership_false_departures",
            s.false_departures.load(Ordering::Relaxed) as f64,
        );
        report.metric(
            "membership_watch_errors",
            s.watch_errors.load(Ordering::Relaxed) as f64,
        );
        report.metric(
            "membership_watch_resumes",
            s.resumes.load(Ordering::Relaxed) as f64,
        );
        report.metric("membership_not_announced", self.not_announced as f64);
        report
            .series
            .insert("departures_seen_since_kill".into(), s.arrivals.cumulative());
    }
}

/// Every process and its connection's client (one etcd client per connection).
async fn plan(cell: &Cell, fleet: &Fleet, groups: &[Vec<usize>]) -> anyhow::Result<Plan> {
    let mut connection_of = vec![0u32; fleet.members.len()];
    let mut clients = Vec::new();
    for (c, (channel, members)) in fleet.connections().enumerate() {
        for i in members {
            connection_of[i] = c as u32;
        }
        clients.push(if cell.target.is_lockcell() {
            Client::Lockcell(channel.clone())
        } else {
            let channel = etcd_client::Channel::Tonic(channel.clone());
            Client::Etcd(Arc::new(
                etcd_client::Client::from_channel(channel, None).await?,
            ))
        });
    }
    let processes = groups
        .iter()
        .enumerate()
        .flat_map(|(s, group)| {
            group.iter().enumerate().map(move |(p, &m)| Process {
                member: m as u32,
                service: s as u32,
                process: p as u8,
            })
        })
        .collect();
    Ok(Plan {
        processes,
        clients,
        connection_of,
        sessions: fleet.members.iter().map(|m| m.key.clone()).collect(),
    })
}

/// Announces processes 1.. (process 0 went first, alone); returns the refusals.
async fn announce_all(plan: &Arc<Plan>) -> Vec<(usize, anyhow::Error)> {
    let bar = progress::count("announcing members", plan.processes.len() as u64);
    bar.inc(1);
    let next = Arc::new(AtomicUsize::new(1));
    let mut workers = JoinSet::new();
    for _ in 0..SETUP_CONCURRENCY {
        let (plan, next, bar) = (plan.clone(), next.clone(), bar.clone());
        workers.spawn(async move {
            let mut refused = Vec::new();
            loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                if k >= plan.processes.len() {
                    return refused;
                }
                if let Err(e) = plan.announce(k).await {
                    refused.push((k, e));
                }
                bar.inc(1);
            }
        });
    }
    let mut refused = Vec::new();
    while let Some(done) = workers.join_next().await {
        refused.extend(done.unwrap_or_default());
    }
    bar.finish_and_clear();
    refused
}

/// What was refused, if `e` is an UNIMPLEMENTED answer.
fn unimplemented(e: &anyhow::Error) -> Option<String> {
    let status = e.downcast_ref::<tonic::Status>().or_else(|| {
        match e.downcast_ref::<etcd_client::Error>() {
            Some(etcd_client::Error::GRpcStatus(s)) => Some(s),
            _ => None,
        }
    })?;
    (status.code() == Code::Unimplemented).then(|| format!("{e:#}"))
}
