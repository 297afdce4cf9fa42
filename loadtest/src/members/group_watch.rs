//! One process's group watch: opened over either protocol, followed, and resumed from
//! the last revision seen when it breaks, as a careful client does.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use etcd_client::{EventType, WatchOptions};
use lockcell_loadtest::membership::{self, Departures};
use lockcell_proto::v1::watch_event::Kind;
use lockcell_proto::v1::{WatchRequest, WatchResponse};
use tonic::codec::{BufferSettings, Codec};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;
use tonic::Code;
use tonic_prost::{ProstDecoder, ProstEncoder};

use super::{Client, Process, Shared};

/// Times one survivor's watch is resumed after breaking before it is given up.
const MAX_RESUMES: u32 = 10;
/// Failed attempts in a row to reopen a broken watch before it is given up.
const MAX_REOPEN_ATTEMPTS: u32 = 3;
/// Metadata of lockcell's RESOURCE_EXHAUSTED: where to resume without gap or duplicate.
const RESUME_REVISION: &str = "lockcell-resume-revision";
/// lockcell's `Watch.Watch` method, called through [`SmallBuffers`].
const WATCH_METHOD: &str = "/lockcell.v1.Watch/Watch";

/// prost with small starting buffers: a membership watch idles most of its life, and
/// tonic's default 8 KiB decode buffer per stream would be most of the load
/// generator's memory per process (buffers still grow for a large response).
#[derive(Debug, Clone, Copy, Default)]
struct SmallBuffers;

impl Codec for SmallBuffers {
    type Encode = WatchRequest;
    type Decode = WatchResponse;
    type Encoder = ProstEncoder<WatchRequest>;
    type Decoder = ProstDecoder<WatchResponse>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::new(256, 32 * 1024))
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::new(BufferSettings::new(256, 32 * 1024))
    }
}

/// Calls lockcell's `Watch.Watch` on `channel`.
async fn lockcell_watch(
    channel: &Channel,
    request: WatchRequest,
) -> Result<tonic::Streaming<WatchResponse>, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(format!("connection not ready: {e}")))?;
    let path = PathAndQuery::from_static(WATCH_METHOD);
    let response = grpc
        .server_streaming(tonic::Request::new(request), path, SmallBuffers)
        .await?;
    Ok(response.into_inner())
}

/// A watch stream of either protocol.
pub(super) enum Stream {
    Lockcell(tonic::Streaming<WatchResponse>),
    Etcd(etcd_client::WatchStream),
}

/// Why a watch stream stopped.
enum Stop {
    /// It may be opened again from this revision on, with no gap.
    Resume(i64),
    /// It cannot be resumed (its history was compacted, or the target refused).
    Lost(String),
}

/// Opens the group watch of `p` from `start` (0: from now) and waits for its creation;
/// returns the stream and the revision it was created at.
pub(super) async fn open(
    client: &Client,
    p: &Process,
    start: i64,
) -> anyhow::Result<(Stream, i64)> {
    let prefix = membership::group_prefix(p.service as usize);
    match client {
        Client::Lockcell(channel) => {
            let request = WatchRequest {
                key: prefix.clone(),
                prefix: true,
                start_revision: start,
                ..Default::default()
            };
            let mut stream = lockcell_watch(channel, request)
                .await
                .with_context(|| format!("watching {prefix}"))?;
            let first = stream
                .message()
                .await
                .with_context(|| format!("watching {prefix}"))?
                .with_context(|| format!("the watch of {prefix} ended before its creation"))?;
            anyhow::ensure!(
                first.created,
                "the watch of {prefix} did not start with `created`"
            );
            Ok((Stream::Lockcell(stream), first.revision))
        }
        Client::Etcd(client) => {
            let key = membership::etcd_key(&prefix);
            let options = WatchOptions::new().with_prefix().with_start_revision(start);
            let mut stream = client
                .watch_client()
                .watch(key.as_bytes(), Some(options))
                .await
                .with_context(|| format!("watching {key}"))?;
            let first = stream
                .message()
                .await
                .with_context(|| format!("watching {key}"))?
                .with_context(|| format!("the watch of {key} ended before its creation"))?;
            anyhow::ensure!(
                first.created(),
                "the watch of {key} did not start with `created`"
            );
            let revision = first.header().map_or(0, |h| h.revision());
            Ok((Stream::Etcd(stream), revision))
        }
    }
}

impl Stream {
    /// Hands every delete to `tally` (when there is one) until the stream stops;
    /// `resume` is where to resume if it stops before telling anything newer.
    async fn follow(
        &mut self,
        mut resume: i64,
        mut tally: Option<&mut Departures>,
        shared: &Shared,
    ) -> Stop {
        let mut deleted = |key: &[u8]| {
            if let Some(tally) = tally.as_deref_mut() {
                shared.on_delete(key, tally);
            }
        };
        match self {
            Stream::Lockcell(stream) => loop {
                match stream.message().await {
                    Ok(Some(resp)) => {
                        for event in &resp.events {
                            if let Some(kv) = &event.kv {
                                resume = resume.max(kv.mod_revision + 1);
                                if event.kind == Kind::Delete as i32 {
                                    deleted(kv.key.as_bytes());
                                }
                            }
                        }
                        resume = resume.max(resp.revision + 1);
                    }
                    Ok(None) => return Stop::Resume(resume),
                    Err(status) => {
                        return match status.code() {
                            Code::ResourceExhausted => Stop::Resume(
                                status
                                    .metadata()
                                    .get(RESUME_REVISION)
                                    .and_then(|v| v.to_str().ok()?.parse().ok())
                                    .unwrap_or(resume),
                            ),
                            Code::Unavailable => Stop::Resume(resume),
                            _ => Stop::Lost(status.to_string()),
                        }
                    }
                }
            },
            Stream::Etcd(stream) => loop {
                match stream.message().await {
                    Ok(Some(resp)) => {
                        for event in resp.events() {
                            if let Some(kv) = event.kv() {
                                resume = resume.max(kv.mod_revision() + 1);
                                if event.event_type() == EventType::Delete {
                                    deleted(kv.key());
                                }
                            }
                        }
                        if resp.events().is_empty() {
                            // Progress: every event up to the header's revision is sent.
                            if let Some(h) = resp.header() {
                                resume = resume.max(h.revision() + 1);
                            }
                        }
                        if resp.canceled() {
                            return if resp.compact_revision() > 0 {
                                Stop::Lost(format!(
                                    "compacted at {}: {}",
                                    resp.compact_revision(),
                                    resp.cancel_reason()
                                ))
                            } else {
                                Stop::Resume(resume)
                            };
                        }
                    }
                    Ok(None) | Err(_) => return Stop::Resume(resume),
                }
            },
        }
    }
}

/// One process's watch: a survivor tallies its group's departures, a process of the
/// dying zone only reads its stream until it dies.
pub(super) struct Watcher {
    pub process: Process,
    pub client: Client,
    /// The survivor's tally; `None` in the dying zone.
    pub tally: Option<Departures>,
    pub shared: Arc<Shared>,
}

impl Watcher {
    pub async fn run(mut self, first: anyhow::Result<(Stream, i64)>) {
        let survivor = self.tally.is_some();
        let (mut stream, created) = match first {
            Ok(opened) => opened,
            Err(_) => {
                if survivor {
                    self.shared.watch_errors.fetch_add(1, Ordering::Relaxed);
                }
                return;
            }
        };
        let mut resume = created + 1;
        let mut resumes = 0;
        loop {
            let stop = stream
                .follow(resume, self.tally.as_mut(), &self.shared)
                .await;
            let from = match stop {
                Stop::Resume(from) => from,
                Stop::Lost(why) => {
                    tracing::debug!(%why, "a membership watch was lost");
                    break;
                }
            };
            if !survivor || resumes == MAX_RESUMES {
                break;
            }
            resumes += 1;
            resume = from;
            self.shared.resumes.fetch_add(1, Ordering::Relaxed);
            match self.reopen(resume).await {
                Some(s) => stream = s,
                None => break,
            }
        }
        if survivor {
            self.shared.watch_errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Opens the watch again from `from`, with a short backoff between failed attempts.
    async fn reopen(&self, from: i64) -> Option<Stream> {
        for attempt in 1..=MAX_REOPEN_ATTEMPTS {
            // Boxed: the task keeps only a pointer to an opening's state while it lasts.
            match Box::pin(open(&self.client, &self.process, from)).await {
                Ok((stream, _)) => return Some(stream),
                Err(e) => {
                    let error = format!("{e:#}");
                    tracing::debug!(%error, attempt, "reopening a membership watch");
                    tokio::time::sleep(Duration::from_millis(100) * attempt).await;
                }
            }
        }
        None
    }
}
