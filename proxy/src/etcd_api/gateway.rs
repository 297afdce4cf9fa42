//! etcd's JSON gateway on the etcd listener: `POST /v3/kv/range` with `{"key": "Zm9v"}`
//! and every other path etcd's own declarations give its RPCs (the `google.api.http`
//! annotations of `proto/etcd-v3`), over HTTP/1.1 or HTTP/2, as etcd serves them to
//! curl, Patroni and the other HTTP clients of etcd.
//!
//! A call is turned into the gRPC call of the same method and sent to this listener's
//! own gRPC services, in the process: it is checked, served and refused exactly as that
//! gRPC call, and only the encoding differs. JSON is read and written by etcd's
//! descriptors (field names as declared, 64-bit integers as strings, bytes in base64),
//! as etcd's gateway writes them. A streaming RPC (Watch, LeaseKeepAlive, Observe)
//! answers one `{"result": …}` line per message, and `{"error": …}` if it ends in one.

use std::collections::BTreeMap;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{self, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use prost::Message;
use prost_reflect::{
    DescriptorPool, DeserializeOptions, DynamicMessage, MessageDescriptor, SerializeOptions, Value,
};
use tokio_stream::{Stream, StreamExt};
use tonic::codegen::Service;
use tonic::service::Routes;
use tonic::{Code, Status};

mod json;

use self::json::*;

/// etcd's v3 API, as etcd declares it.
static POOL: LazyLock<DescriptorPool> = LazyLock::new(|| {
    DescriptorPool::decode(lockcell_proto::ETCD_DESCRIPTOR_SET)
        .expect("the build's descriptor set of etcd's API decodes")
});

/// The API version the gateway answers `GET /version` with: the etcd release whose
/// declarations the listener serves, which clients read to pick their paths.
const ETCD_VERSION: &str = "3.5.0";

/// One RPC as the gateway serves it.
#[derive(Debug, Clone)]
pub struct Rpc {
    /// Its gRPC path, `/etcdserverpb.KV/Range`.
    pub grpc_path: String,
    input: MessageDescriptor,
    output: MessageDescriptor,
    client_streaming: bool,
    server_streaming: bool,
}

/// Every RPC with an HTTP path in etcd's declarations, by that path.
pub fn rpcs() -> BTreeMap<String, Rpc> {
    let pool = &*POOL;
    let http = pool
        .get_extension_by_name("google.api.http")
        .expect("etcd's declarations import google.api.http");
    let mut rpcs = BTreeMap::new();
    for service in pool.services() {
        for method in service.methods() {
            let options = method.options();
            if !options.has_extension(&http) {
                continue;
            }
            let rpc = Rpc {
                grpc_path: format!("/{}/{}", service.full_name(), method.name()),
                input: method.input(),
                output: method.output(),
                client_streaming: method.is_client_streaming(),
                server_streaming: method.is_server_streaming(),
            };
            let rule = options.get_extension(&http);
            let mut rules = vec![rule.into_owned()];
            while let Some(rule) = rules.pop() {
                let Value::Message(rule) = rule else { continue };
                if let Some(Value::String(path)) = rule.get_field_by_name("post").as_deref() {
                    rpcs.insert(path.clone(), rpc.clone());
                }
                if let Some(Value::List(more)) =
                    rule.get_field_by_name("additional_bindings").as_deref()
                {
                    rules.extend(more.iter().cloned());
                }
            }
        }
    }
    rpcs
}

/// The etcd listener's routes: the gateway's, each calling `grpc` (the listener's gRPC
/// services) for `api`, with requests read up to `max_bytes` of JSON each; gRPC calls
/// go on to `grpc`; any other path is not found.
pub fn router(api: super::EtcdApi, grpc: Routes, max_bytes: usize) -> axum::Router {
    let health = api.clone();
    let mut router = axum::Router::new()
        .route("/version", axum::routing::get(version))
        .route(
            "/health",
            axum::routing::get(move || {
                let api = health.clone();
                async move { self::health(&api) }
            }),
        );
    for (path, rpc) in rpcs() {
        let call = Arc::new(Call {
            rpc,
            grpc: grpc.clone(),
            api: api.clone(),
            max_bytes,
        });
        let label = path.clone();
        router = router.route(
            &path,
            axum::routing::post(move |request: http::Request<Body>| {
                let call = call.clone();
                let path = label.clone();
                async move {
                    let (response, code) = call.serve(request).await;
                    metrics::counter!(
                        crate::metrics::ETCD_API_GATEWAY_CALLS,
                        "path" => path,
                        "code" => format!("{code:?}"),
                    )
                    .increment(1);
                    response
                }
            }),
        );
    }
    router.fallback(move |request: http::Request<Body>| {
        let grpc = grpc.clone();
        async move { elsewhere(grpc, request).await }
    })
}

/// A request for no path of the gateway: a gRPC call goes to the gRPC services; anything
/// else is not found, as etcd answers.
async fn elsewhere(mut grpc: Routes, request: http::Request<Body>) -> Response {
    let is_grpc = request
        .headers()
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|t| t.as_bytes().starts_with(b"application/grpc"));
    if !is_grpc {
        return json_response(
            StatusCode::NOT_FOUND,
            serde_json::json!({
                "error": format!("{} is not a path of etcd's API", request.uri().path()),
                "code": Code::NotFound as i32,
                "message": "Not Found",
            })
            .to_string(),
        );
    }
    match grpc.call(request).await {
        Ok(response) => response.map(Body::new),
        Err(never) => match never {},
    }
}

/// `GET /health`, as etcd answers it: healthy while the proxy holds all its etcd leases
/// and has renewed them in time (what "no leader" means on this API).
fn health(api: &super::EtcdApi) -> Response {
    if api.without_leader() {
        return json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({"health": "false", "reason": super::NO_LEADER}).to_string(),
        );
    }
    json_response(
        StatusCode::OK,
        serde_json::json!({"health": "true", "reason": ""}).to_string(),
    )
}

async fn version() -> Response {
    json_response(
        StatusCode::OK,
        serde_json::json!({
            "etcdserver": ETCD_VERSION,
            "etcdcluster": ETCD_VERSION,
            "lockcell": env!("CARGO_PKG_VERSION"),
        })
        .to_string(),
    )
}

/// A call's request messages, as gRPC frames.
type Frames = std::pin::Pin<Box<dyn Stream<Item = Result<Bytes, Status>> + Send>>;

struct Call {
    rpc: Rpc,
    grpc: Routes,
    api: super::EtcdApi,
    max_bytes: usize,
}

/// How long a unary call's request body may take to arrive.
const BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// What a login's request may weigh: it is read before its caller is known.
const LOGIN_BYTES: usize = 64 * 1024;

/// The metadata a gateway call carries: etcd's gateway takes the auth token in
/// `Authorization`; gRPC carries it as `token`. Nothing else a caller sends in
/// headers reaches the call.
fn token_metadata(headers: &HeaderMap) -> HeaderMap {
    let mut metadata = HeaderMap::new();
    if let Some(token) = headers.get(http::header::AUTHORIZATION) {
        // The raw token, as etcd takes it; `Bearer TOKEN` too, as the lockcell API.
        let token = token.as_bytes();
        let token = token.strip_prefix(b"Bearer ").unwrap_or(token);
        if let Ok(token) = HeaderValue::from_bytes(token) {
            metadata.insert("token", token);
        }
    }
    metadata
}

impl Call {
    /// Serves one call; answers the response and the gRPC code it carries.
    async fn serve(&self, request: http::Request<Body>) -> (Response, Code) {
        let (parts, body) = request.into_parts();
        let metadata = token_metadata(&parts.headers);
        // The caller is known before its body is read, so no one unknown makes the
        // proxy hold a large body; a login is read first, and small.
        let login = self.rpc.grpc_path.ends_with("/Authenticate");
        if !login {
            let probe = tonic::Request::from_parts(
                tonic::metadata::MetadataMap::from_headers(metadata.clone()),
                parts.extensions.clone(),
                (),
            );
            if let Err(status) = self.api.caller(&probe) {
                return refused(status);
            }
        }
        let max_bytes = if login { LOGIN_BYTES } else { self.max_bytes };
        let frames = match self.requests(body, max_bytes).await {
            Ok(frames) => frames,
            Err(status) => return refused(status),
        };
        let grpc_request = match self.grpc_request(parts.extensions, metadata, frames) {
            Ok(request) => request,
            Err(status) => return refused(status),
        };
        let mut grpc = self.grpc.clone();
        if let Err(e) = std::future::poll_fn(|cx| {
            Service::<http::Request<tonic::body::Body>>::poll_ready(&mut grpc, cx)
        })
        .await
        {
            return refused(Status::internal(format!("the gateway could not call: {e}")));
        }
        let response = match grpc.call(grpc_request).await {
            Ok(response) => response,
            Err(e) => return refused(Status::internal(format!("the gateway's call failed: {e}"))),
        };
        self.answer(response).await
    }

    /// The gRPC call a gateway request makes: its messages (`frames`), its caller's
    /// token (`metadata`) and its connection's facts (`extensions`).
    fn grpc_request(
        &self,
        extensions: http::Extensions,
        metadata: HeaderMap,
        frames: Frames,
    ) -> Result<http::Request<tonic::body::Body>, Status> {
        let mut grpc_request =
            http::Request::new(tonic::body::Body::new(Body::from_stream(frames)));
        *grpc_request.method_mut() = http::Method::POST;
        *grpc_request.uri_mut() = self
            .rpc
            .grpc_path
            .parse()
            .map_err(|_| Status::internal("a gateway path did not parse"))?;
        *grpc_request.version_mut() = http::Version::HTTP_2;
        // The connection's own facts (its address, its TLS client certificate) go with
        // the call, so a certificate identifies its caller here as on gRPC.
        *grpc_request.extensions_mut() = extensions;
        let headers = grpc_request.headers_mut();
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        headers.insert(http::header::TE, HeaderValue::from_static("trailers"));
        headers.extend(metadata);
        Ok(grpc_request)
    }

    /// The gateway's answer to a gRPC call's `response`: its one message as JSON, or,
    /// for a stream, one JSON line per message.
    async fn answer(&self, response: http::Response<tonic::body::Body>) -> (Response, Code) {
        if let Some(status) = status_in(response.headers()) {
            // A trailers-only answer: refused before any message.
            return refused(status);
        }
        let mut replies = Box::pin(replies(response.into_body(), self.rpc.output.clone()));
        if !self.rpc.server_streaming {
            return match replies.next().await {
                Some(Ok(json)) => (json_response(StatusCode::OK, json), Code::Ok),
                Some(Err(status)) => refused(status),
                None => refused(Status::internal("the call ended without an answer")),
            };
        }
        // As etcd's gateway: an error before the first message is the response's
        // status; after it, a last `{"error": …}` line.
        let first = match replies.next().await {
            Some(Err(status)) => return refused(status),
            first => first,
        };
        let lines = tokio_stream::iter(first).chain(replies).map(|reply| {
            Ok::<_, std::convert::Infallible>(Bytes::from(match reply {
                Ok(json) => format!("{{\"result\":{json}}}\n"),
                Err(status) => format!("{}\n", stream_error(&status)),
            }))
        });
        let mut response = Response::new(Body::from_stream(lines));
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        (response, Code::Ok)
    }

    /// The request body as gRPC frames: one JSON message for a unary call; for a
    /// streaming one, each JSON message as it arrives, the stream ending with the body
    /// (a half-close, after which etcd still answers what was asked).
    async fn requests(&self, body: Body, max_bytes: usize) -> Result<Frames, Status> {
        let input = self.rpc.input.clone();
        if !self.rpc.client_streaming {
            let read = axum::body::to_bytes(body, max_bytes);
            let bytes = tokio::time::timeout(BODY_TIMEOUT, read)
                .await
                .map_err(|_| {
                    Status::deadline_exceeded(format!(
                        "the request body did not arrive within {} s",
                        BODY_TIMEOUT.as_secs()
                    ))
                })?
                .map_err(|e| too_large_or(e, max_bytes))?;
            let text: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
                b"{}"
            } else {
                &bytes
            };
            let value: serde_json::Value = serde_json::from_slice(text)
                .map_err(|e| Status::invalid_argument(format!("the request is not JSON: {e}")))?;
            let frame = frame(&input, value)?;
            return Ok(Box::pin(tokio_stream::iter(vec![Ok(frame)])));
        }
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tokio::spawn(async move {
            let mut body = body.into_data_stream();
            let mut pending: Vec<u8> = Vec::new();
            while let Some(chunk) = body.next().await {
                let Ok(chunk) = chunk else { return };
                pending.extend_from_slice(&chunk);
                let mut values =
                    serde_json::Deserializer::from_slice(&pending).into_iter::<serde_json::Value>();
                let mut used = 0;
                loop {
                    match values.next() {
                        Some(Ok(value)) => {
                            used = values.byte_offset();
                            if tx.send(frame(&input, value)).await.is_err() {
                                return;
                            }
                        }
                        Some(Err(e)) if e.is_eof() => break,
                        None => break,
                        Some(Err(e)) => {
                            let _ = tx
                                .send(Err(Status::invalid_argument(format!(
                                    "the request is not JSON: {e}"
                                ))))
                                .await;
                            return;
                        }
                    }
                }
                pending.drain(..used);
                if pending.len() > max_bytes {
                    let _ = tx.send(Err(too_large(max_bytes))).await;
                    return;
                }
            }
            if !pending.iter().all(u8::is_ascii_whitespace) {
                let _ = tx
                    .send(Err(Status::invalid_argument(
                        "the request body ends inside a JSON message",
                    )))
                    .await;
            }
        });
        // A message that does not read ends the call's request stream with an error,
        // which the call sees as the client's failure.
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_body_over_the_limit_is_refused_with_the_limit() {
        let e = axum::body::to_bytes(Body::from(vec![b' '; 100]), 10)
            .await
            .unwrap_err();
        let status = too_large_or(e, 10);
        assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
        assert!(status.message().contains("at most 10 bytes"), "{status:?}");
    }

    #[test]
    fn every_path_of_etcds_declarations_names_its_rpc() {
        let rpcs = rpcs();
        let path = |p: &str| rpcs.get(p).map(|r| r.grpc_path.as_str());
        assert_eq!(path("/v3/kv/range"), Some("/etcdserverpb.KV/Range"));
        assert_eq!(path("/v3/kv/txn"), Some("/etcdserverpb.KV/Txn"));
        assert_eq!(path("/v3/watch"), Some("/etcdserverpb.Watch/Watch"));
        assert_eq!(
            path("/v3/lease/keepalive"),
            Some("/etcdserverpb.Lease/LeaseKeepAlive")
        );
        // An additional binding.
        assert_eq!(
            path("/v3/kv/lease/revoke"),
            Some("/etcdserverpb.Lease/LeaseRevoke")
        );
        assert_eq!(
            path("/v3/auth/authenticate"),
            Some("/etcdserverpb.Auth/Authenticate")
        );
        assert_eq!(path("/v3/lock/lock"), Some("/v3lockpb.Lock/Lock"));
        assert_eq!(
            path("/v3/election/observe"),
            Some("/v3electionpb.Election/Observe")
        );
        assert!(rpcs["/v3/watch"].client_streaming && rpcs["/v3/watch"].server_streaming);
        assert!(!rpcs["/v3/kv/put"].client_streaming && !rpcs["/v3/kv/put"].server_streaming);
    }

    #[test]
    fn json_goes_to_protobuf_and_back_as_etcds_gateway_writes_it() {
        let rpcs = rpcs();
        let range = &rpcs["/v3/kv/range"];
        let frame = frame(
            &range.input,
            serde_json::json!({"key": "Zm9v", "limit": "2"}),
        )
        .unwrap();
        let (message, rest) = split_frame(&frame).unwrap();
        assert!(rest.is_empty());
        let request = etcd_client::proto::PbRangeRequest::decode(message).unwrap();
        assert_eq!(request.key, b"foo");
        assert_eq!(request.limit, 2);

        let reply = etcd_client::proto::PbRangeResponse {
            header: Some(etcd_client::proto::PbResponseHeader {
                revision: 7,
                ..Default::default()
            }),
            kvs: vec![etcd_client::proto::PbKeyValue {
                key: b"foo".to_vec(),
                value: b"bar".to_vec(),
                create_revision: 5,
                ..Default::default()
            }],
            count: 1,
            more: false,
        };
        let json: serde_json::Value =
            serde_json::from_str(&to_json(&range.output, &reply.encode_to_vec()).unwrap()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "header": {"revision": "7"},
                "kvs": [{"key": "Zm9v", "value": "YmFy", "create_revision": "5"}],
                "count": "1",
            })
        );
    }

    #[test]
    fn a_field_that_does_not_read_is_refused_by_name_and_one_etcd_does_not_declare_is_left_out() {
        let rpcs = rpcs();
        let put = &rpcs["/v3/kv/put"].input;
        let e = frame(put, serde_json::json!({"key": "Zm9v", "lease": "x"})).unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(e.message().contains("(field \"lease\")"), "{}", e.message());
        assert!(
            e.message().contains("etcdserverpb.PutRequest"),
            "{}",
            e.message()
        );
        let frame = frame(put, serde_json::json!({"key": "Zm9v", "newer_field": 1})).unwrap();
        let (message, _) = split_frame(&frame).unwrap();
        assert_eq!(
            etcd_client::proto::PbPutRequest::decode(message)
                .unwrap()
                .key,
            b"foo"
        );
    }
}
