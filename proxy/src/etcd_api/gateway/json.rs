//! etcd's JSON gateway's encoding: JSON to protobuf frames and back, and errors as
//! etcd's gateway writes them.

use super::*;

/// One JSON request as a gRPC frame of its method's input message.
pub(super) fn frame(input: &MessageDescriptor, value: serde_json::Value) -> Result<Bytes, Status> {
    let message = read(input, value.clone()).map_err(|e| {
        let field = match bad_field(input, &value) {
            Some(field) => format!(" (field {field:?})"),
            None => String::new(),
        };
        Status::invalid_argument(format!(
            "the request does not read as {}{field}: {e}",
            input.full_name()
        ))
    })?;
    let encoded = message.encode_to_vec();
    let mut frame = Vec::with_capacity(encoded.len() + 5);
    frame.push(0);
    frame.extend_from_slice(&(encoded.len() as u32).to_be_bytes());
    frame.extend_from_slice(&encoded);
    Ok(Bytes::from(frame))
}

/// A JSON message as `input`. Fields etcd does not declare are left out, as etcd's
/// gateway leaves them (a client of a newer etcd may send some).
pub(super) fn read(
    input: &MessageDescriptor,
    value: serde_json::Value,
) -> Result<DynamicMessage, String> {
    DynamicMessage::deserialize_with_options(
        input.clone(),
        value,
        &DeserializeOptions::new().deny_unknown_fields(false),
    )
    .map_err(|e| e.to_string())
}

/// The first field of a JSON object that does not read as its field of `input`.
pub(super) fn bad_field(input: &MessageDescriptor, value: &serde_json::Value) -> Option<String> {
    value.as_object()?.iter().find_map(|(name, field)| {
        let alone: serde_json::Map<_, _> = [(name.clone(), field.clone())].into_iter().collect();
        read(input, serde_json::Value::Object(alone))
            .is_err()
            .then(|| name.clone())
    })
}

/// The messages of a gRPC response body, each as JSON, then its status if not OK.
pub(super) fn replies(
    body: tonic::body::Body,
    output: MessageDescriptor,
) -> impl Stream<Item = Result<String, Status>> + Send + 'static {
    async_stream_of(move |tx| async move {
        let mut body = body;
        let mut pending: Vec<u8> = Vec::new();
        loop {
            // The caller hung up: the call ends with it.
            let frame = tokio::select! {
                frame = body.frame() => frame,
                _ = tx.closed() => return,
            };
            let Some(frame) = frame else { return };
            let frame = match frame {
                Ok(frame) => frame,
                Err(e) => {
                    let _ = tx
                        .send(Err(Status::unavailable(format!("the call ended: {e}"))))
                        .await;
                    return;
                }
            };
            let frame = match frame.into_data() {
                Ok(data) => {
                    pending.extend_from_slice(&data);
                    while let Some((message, rest)) = split_frame(&pending) {
                        let json = to_json(&output, message);
                        pending = rest.to_vec();
                        if tx.send(json).await.is_err() {
                            return;
                        }
                    }
                    continue;
                }
                Err(frame) => frame,
            };
            if let Ok(trailers) = frame.into_trailers() {
                if let Some(status) = status_in(&trailers) {
                    let _ = tx.send(Err(status)).await;
                }
                return;
            }
        }
    })
}

/// A stream fed by a task, ending when the task does.
pub(super) fn async_stream_of<T, F, Fut>(task: F) -> impl Stream<Item = T> + Send + 'static
where
    T: Send + 'static,
    F: FnOnce(tokio::sync::mpsc::Sender<T>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(task(tx));
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// The first whole gRPC message in `buffer` and what follows it.
pub(super) fn split_frame(buffer: &[u8]) -> Option<(&[u8], &[u8])> {
    let header = buffer.get(..5)?;
    let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    let message = buffer.get(5..5 + len)?;
    Some((message, &buffer[5 + len..]))
}

pub(super) fn to_json(output: &MessageDescriptor, message: &[u8]) -> Result<String, Status> {
    let message = DynamicMessage::decode(output.clone(), message)
        .map_err(|e| Status::internal(format!("an answer did not decode: {e}")))?;
    let mut json = Vec::new();
    let mut serializer = serde_json::Serializer::new(&mut json);
    message
        .serialize_with_options(
            &mut serializer,
            &SerializeOptions::new()
                .use_proto_field_name(true)
                .skip_default_fields(true),
        )
        .map_err(|e| Status::internal(format!("an answer did not encode as JSON: {e}")))?;
    String::from_utf8(json).map_err(|e| Status::internal(e.to_string()))
}

/// The gRPC status a header or trailer map carries, unless it is OK or absent.
pub(super) fn status_in(headers: &HeaderMap) -> Option<Status> {
    let status = Status::from_header_map(headers)?;
    (status.code() != Code::Ok).then_some(status)
}

pub(super) fn too_large(max_bytes: usize) -> Status {
    Status::resource_exhausted(format!(
        "etcdserver: request is too large: a JSON request of the gateway is at most {max_bytes} bytes"
    ))
}

/// A body that could not be read: over the limit (the error `to_bytes` gives for
/// one), or cut short.
pub(super) fn too_large_or(e: axum::Error, max_bytes: usize) -> Status {
    let e = e.into_inner();
    if e.is::<http_body_util::LengthLimitError>() {
        too_large(max_bytes)
    } else {
        Status::invalid_argument(format!("the request body could not be read: {e}"))
    }
}

/// The HTTP status etcd's gateway answers a gRPC code with.
pub(super) fn http_status(code: Code) -> StatusCode {
    match code {
        Code::Ok => StatusCode::OK,
        Code::Cancelled => StatusCode::REQUEST_TIMEOUT,
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
            StatusCode::BAD_REQUEST
        }
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

pub(super) fn refused(status: Status) -> (Response, Code) {
    (error_response(&status), status.code())
}

/// A refused call, as etcd's gateway answers one: `{"error", "code", "message"}`.
pub(super) fn error_response(status: &Status) -> Response {
    json_response(
        http_status(status.code()),
        serde_json::json!({
            "error": status.message(),
            "code": status.code() as i32,
            "message": status.message(),
        })
        .to_string(),
    )
}

/// A stream's last line when it ends in an error, as etcd's gateway writes it.
pub(super) fn stream_error(status: &Status) -> String {
    let http = http_status(status.code());
    serde_json::json!({
        "error": {
            "grpc_code": status.code() as i32,
            "http_code": http.as_u16(),
            "message": status.message(),
            "http_status": http.canonical_reason().unwrap_or_default(),
        }
    })
    .to_string()
}

pub(super) fn json_response(status: StatusCode, json: String) -> Response {
    (
        status,
        [(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        json,
    )
        .into_response()
}
