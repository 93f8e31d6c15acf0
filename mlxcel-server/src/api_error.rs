//! The one error shape of every route: OpenAI's error object, with
//! llama-server's numeric `code` (its HTTP status) beside `type`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use mlxcel_engine::{Error as EngineError, ErrorKind};
use serde_json::json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, ...
    pub kind: &'static str,
    pub message: String,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
}

pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, kind, message: message.into(), param: None }
    }

    /// A 400 naming the field at fault.
    pub fn field(param: &str, message: impl std::fmt::Display) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: format!("invalid parameter `{param}`: {message}"),
            param: Some(param.to_string()),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn not_supported(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::NOT_IMPLEMENTED, "not_supported_error", message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable_error", message)
    }

    pub fn unauthorized() -> Self {
        ApiError::new(StatusCode::UNAUTHORIZED, "authentication_error", "invalid or missing API key (send `Authorization: Bearer KEY`)")
    }

    pub fn not_found(path: &str) -> Self {
        ApiError::new(StatusCode::NOT_FOUND, "not_found_error", format!("no route for {path}"))
    }

    pub fn context(prompt: usize, n_ctx: usize) -> Self {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "exceed_context_size_error",
            format!("the request has {prompt} prompt tokens, which does not leave room to generate in a slot's context of {n_ctx} (raise -c/--ctx-size or shorten the prompt)"),
        )
    }

    /// An engine error, with engine option names rewritten by `rename` into
    /// the names the route's request uses (`max_tokens` → `n_predict`).
    pub fn from_engine(error: &EngineError, rename: impl Fn(&str) -> &str) -> Self {
        let (status, kind) = match error.code() {
            ErrorKind::InvalidParameter | ErrorKind::EmptyPrompt | ErrorKind::Tokenizer => (StatusCode::BAD_REQUEST, "invalid_request_error"),
            ErrorKind::PromptTooLong | ErrorKind::KvPoolTooSmall => (StatusCode::BAD_REQUEST, "exceed_context_size_error"),
            ErrorKind::ShuttingDown => (StatusCode::SERVICE_UNAVAILABLE, "unavailable_error"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "server_error"),
        };
        let mut message = error.to_string();
        let param = error.parameter().map(|engine_name| {
            let name = rename(engine_name);
            if name != engine_name {
                message = message.replacen(&format!("`{engine_name}`"), &format!("`{name}`"), 1);
            }
            name.to_string()
        });
        ApiError { status, kind, message, param }
    }

    pub fn body(&self) -> serde_json::Value {
        json!({ "error": { "code": self.status.as_u16(), "message": self.message, "type": self.kind, "param": self.param } })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}
