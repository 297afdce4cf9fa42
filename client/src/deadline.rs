//! Every call that carries a deadline (`grpc-timeout`, set with
//! `tonic::Request::set_timeout`) is held to it from the moment it is made, the wait for
//! a connection included. tonic counts the deadline only once the call is on a
//! connection, and a proxy that accepts connections but never answers (a frozen
//! process: the kernel still completes the TCP handshake) would otherwise keep a call
//! waiting for its TLS or HTTP/2 handshake forever.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tonic::codegen::http::{HeaderMap, Request};
use tonic::codegen::{Service, StdError};

/// How much longer than its deadline a call is given here: the proxy's own answer at
/// the deadline (DEADLINE_EXCEEDED, with its message) should come first.
const SLACK: Duration = Duration::from_secs(1);

/// A service that ends each call with a deadline once the deadline (plus [`SLACK`]) has
/// passed, with an error saying the proxy did not answer.
#[derive(Clone, Debug)]
pub(crate) struct Deadline<S>(pub(crate) S);

impl<S, B> Service<Request<B>> for Deadline<S>
where
    S: Service<Request<B>>,
    S::Error: Into<StdError>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = StdError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, StdError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), StdError>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let deadline = grpc_timeout(request.headers());
        let call = self.0.call(request);
        Box::pin(async move {
            let Some(deadline) = deadline else {
                return call.await.map_err(Into::into);
            };
            match tokio::time::timeout(deadline + SLACK, call).await {
                Ok(answered) => answered.map_err(Into::into),
                Err(_) => Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "no answer within {} (the proxy accepts connections but does not answer: frozen or overloaded?)",
                        humantime::format_duration(deadline)
                    ),
                )
                .into()),
            }
        })
    }
}

/// The deadline a `grpc-timeout` header says: digits and a unit (`H`, `M`, `S`, `m`,
/// `u`, `n`), as gRPC writes it.
fn grpc_timeout(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount.saturating_mul(3600)),
        "M" => Duration::from_secs(amount.saturating_mul(60)),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_grpc_timeouts_as_grpc_writes_them() {
        let timeout = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert("grpc-timeout", value.parse().unwrap());
            grpc_timeout(&headers)
        };
        assert_eq!(timeout("10000000u"), Some(Duration::from_secs(10)));
        assert_eq!(timeout("1500m"), Some(Duration::from_millis(1500)));
        assert_eq!(timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(timeout("7n"), Some(Duration::from_nanos(7)));
        for bad in ["", "S", "10x", "-1S", "1.5S"] {
            assert_eq!(timeout(bad), None, "{bad:?}");
        }
        assert_eq!(grpc_timeout(&HeaderMap::new()), None);
    }

    /// A call that never gets a connection ends at its deadline, with an error that
    /// says so; a call without one waits.
    #[tokio::test(start_paused = true)]
    async fn a_call_waiting_for_a_connection_ends_at_its_deadline() {
        let never = tower_never();
        let mut with_deadline = Deadline(never.clone());
        let mut request = Request::new(());
        request
            .headers_mut()
            .insert("grpc-timeout", "2S".parse().unwrap());
        let started = tokio::time::Instant::now();
        let error = with_deadline.call(request).await.unwrap_err();
        assert_eq!(started.elapsed(), Duration::from_secs(2) + SLACK);
        assert!(error.to_string().contains("no answer within 2s"), "{error}");

        let mut without = Deadline(never);
        let waiting = without.call(Request::new(()));
        assert!(
            tokio::time::timeout(Duration::from_secs(3600), waiting)
                .await
                .is_err(),
            "a call without a deadline was ended"
        );
    }

    /// A service whose calls never end, as a call waiting for a frozen proxy's
    /// handshake.
    fn tower_never() -> impl Service<
        Request<()>,
        Response = (),
        Error = std::io::Error,
        Future = std::future::Pending<Result<(), std::io::Error>>,
    > + Clone {
        #[derive(Clone)]
        struct Never;
        impl Service<Request<()>> for Never {
            type Response = ();
            type Error = std::io::Error;
            type Future = std::future::Pending<Result<(), std::io::Error>>;
            fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
                Poll::Ready(Ok(()))
            }
            fn call(&mut self, _: Request<()>) -> Self::Future {
                std::future::pending()
            }
        }
        Never
    }
}
