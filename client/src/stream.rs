//! One shape for the SDK's streams. Each keeps its state in a plain struct with an
//! `async fn` that yields the next item; [`Steps`] runs that function as a [`Stream`],
//! keeping the state inside the running step between polls. A step dropped half-way
//! (its caller's `next()` cancelled in a `select!`) is not lost: the next poll goes on
//! with the same step, so the cancel-safety of the `async fn` carries over.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

pub(crate) use tokio_stream::Stream;

/// A running step: the state goes in, comes back out with the item (`None`: the end).
type Step<S, T> = Pin<Box<dyn Future<Output = (S, Option<T>)> + Send>>;

/// The state `S` of a stream of `T`, and the function that takes one step.
pub(crate) struct Steps<S, T> {
    /// The state between steps (`None` while a step runs).
    idle: Option<S>,
    running: Option<Step<S, T>>,
    step: fn(S) -> Step<S, T>,
    /// Set once a step said the stream ended: every later poll says so too.
    ended: bool,
}

impl<S: Send + 'static, T> Steps<S, T> {
    /// A stream starting from `state`, stepped by `step`.
    pub(crate) fn new(state: S, step: fn(S) -> Step<S, T>) -> Self {
        Steps {
            idle: Some(state),
            running: None,
            step,
            ended: false,
        }
    }

    /// The state, when no step is running (between items).
    pub(crate) fn idle(&self) -> Option<&S> {
        self.idle.as_ref()
    }

    pub(crate) fn poll_step(&mut self, cx: &mut Context<'_>) -> Poll<Option<T>> {
        if self.ended {
            return Poll::Ready(None);
        }
        let running = match &mut self.running {
            Some(running) => running,
            None => {
                let state = self
                    .idle
                    .take()
                    .expect("a stream's state is idle or running");
                self.running.insert((self.step)(state))
            }
        };
        let (state, item) = std::task::ready!(running.as_mut().poll(cx));
        self.running = None;
        self.idle = Some(state);
        self.ended = item.is_none();
        Poll::Ready(item)
    }
}

impl<S, T> std::fmt::Debug for Steps<S, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Steps")
            .field("running", &self.running.is_some())
            .field("ended", &self.ended)
            .finish()
    }
}

/// The next item of `stream`: the inherent `next` of each of the SDK's streams, so that
/// it reads the same with or without a `StreamExt` in scope.
pub(crate) async fn next<S: Stream + Unpin + ?Sized>(stream: &mut S) -> Option<S::Item> {
    std::future::poll_fn(|cx| Pin::new(&mut *stream).poll_next(cx)).await
}
