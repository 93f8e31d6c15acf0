//! Status codes, the thread-local last error, and the panic guard every entry
//! point runs its body in.

use std::any::Any;
use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use mlxcel_engine::ErrorKind;

use crate::shutdown::{self, Inside};

/// The status every fallible function returns: `MLXCEL_OK` (0), a positive
/// non-error outcome (`MLXCEL_CANCELLED`), or a negative error code. The
/// values below are part of the ABI and never change meaning.
pub type mlxcel_status = i32;

/// The named values of `mlxcel_status`. Functions return `mlxcel_status`
/// (an `int32_t`), not this enum, so that the ABI does not depend on the
/// size of a C enum.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum mlxcel_status_code {
    /// Success.
    MLXCEL_OK = 0,
    /// Not an error: the generation was stopped early by `mlxcel_cancel` or by
    /// the streaming callback returning false. The partial output is valid.
    MLXCEL_CANCELLED = 1,
    /// An argument is out of range (e.g. temperature < 0); the message names it.
    MLXCEL_ERR_INVALID_ARGUMENT = -1,
    /// A pointer argument that must not be NULL was NULL.
    MLXCEL_ERR_NULL_POINTER = -2,
    /// A string argument is not valid UTF-8.
    MLXCEL_ERR_INVALID_UTF8 = -3,
    /// A handle is not live: never created by this library, already freed, or
    /// of the wrong kind (a context passed as a model).
    MLXCEL_ERR_INVALID_HANDLE = -4,
    /// The caller's buffer is too small; the needed size was stored through the
    /// `needed` out-parameter (for `mlxcel_embed`, it is in the message).
    MLXCEL_ERR_BUFFER_TOO_SMALL = -5,
    /// The checkpoint could not be loaded (missing files, bad config, unknown
    /// architecture, failed download of the default model).
    MLXCEL_ERR_MODEL_LOAD = -6,
    /// MLX reported an error while computing.
    MLXCEL_ERR_MLX = -7,
    /// The tokenizer or the chat template failed (e.g. the model has no chat template).
    MLXCEL_ERR_TOKENIZER = -8,
    /// The prompt is empty after tokenization.
    MLXCEL_ERR_EMPTY_PROMPT = -9,
    /// The prompt has more tokens than the model's context.
    MLXCEL_ERR_PROMPT_TOO_LONG = -10,
    /// The context is already running a generation on another thread.
    MLXCEL_ERR_BUSY = -11,
    /// A bug in mlxcel (an internal panic was caught). The handles involved stay
    /// valid, but their state is unspecified; freeing them is safe.
    MLXCEL_ERR_INTERNAL = -12,
    /// The process is exiting (`exit()` was called or `main` returned): no new
    /// work starts. Freeing handles still succeeds. Since ABI 1.1.
    MLXCEL_ERR_EXITING = -13,
    /// The request (its prompt plus max_tokens) needs more KV cache than the
    /// model's whole KV pool; the message gives both sizes. Since ABI 2.0.
    MLXCEL_ERR_KV_POOL_TOO_SMALL = -14,
}

pub(crate) const MLXCEL_OK: mlxcel_status = mlxcel_status_code::MLXCEL_OK as mlxcel_status;
pub(crate) const MLXCEL_CANCELLED: mlxcel_status =
    mlxcel_status_code::MLXCEL_CANCELLED as mlxcel_status;
pub(crate) const MLXCEL_ERR_INVALID_ARGUMENT: mlxcel_status =
    mlxcel_status_code::MLXCEL_ERR_INVALID_ARGUMENT as mlxcel_status;
pub(crate) const MLXCEL_ERR_NULL_POINTER: mlxcel_status =
    mlxcel_status_code::MLXCEL_ERR_NULL_POINTER as mlxcel_status;
pub(crate) const MLXCEL_ERR_INVALID_UTF8: mlxcel_status =
    mlxcel_status_code::MLXCEL_ERR_INVALID_UTF8 as mlxcel_status;
pub(crate) const MLXCEL_ERR_INVALID_HANDLE: mlxcel_status =
    mlxcel_status_code::MLXCEL_ERR_INVALID_HANDLE as mlxcel_status;
pub(crate) const MLXCEL_ERR_BUFFER_TOO_SMALL: mlxcel_status =
    mlxcel_status_code::MLXCEL_ERR_BUFFER_TOO_SMALL as mlxcel_status;
pub(crate) const MLXCEL_ERR_MODEL_LOAD: mlxcel_status =
    mlxcel_status_code::MLXCEL_ERR_MODEL_LOAD as mlxcel_status;
pub(crate) const MLXCEL_ERR_MLX: mlxcel_status =
    mlxcel_status_code::MLXCEL_ERR_MLX as mlxcel_status;
pub(crate) const MLXCEL_ERR_TOKENIZER: mlxcel_status =
    mlxcel_status_code::MLXCEL_ERR_TOKENIZER as mlxcel_status;
pub(crate) const MLXCEL_ERR_EMPTY_PROMPT: mlxcel_status =
    mlxcel_status_code::MLXCEL_ERR_EMPTY_PROMPT as mlxcel_status;
pub(crate) const MLXCEL_ERR_PROMPT_TOO_LONG: mlxcel_status =
    mlxcel_status_code::MLXCEL_ERR_PROMPT_TOO_LONG as mlxcel_status;
pub(crate) const MLXCEL_ERR_BUSY: mlxcel_status =
    mlxcel_status_code::MLXCEL_ERR_BUSY as mlxcel_status;
pub(crate) const MLXCEL_ERR_INTERNAL: mlxcel_status =
    mlxcel_status_code::MLXCEL_ERR_INTERNAL as mlxcel_status;
pub(crate) const MLXCEL_ERR_EXITING: mlxcel_status =
    mlxcel_status_code::MLXCEL_ERR_EXITING as mlxcel_status;
pub(crate) const MLXCEL_ERR_KV_POOL_TOO_SMALL: mlxcel_status =
    mlxcel_status_code::MLXCEL_ERR_KV_POOL_TOO_SMALL as mlxcel_status;

/// An error on its way to the caller: a status and a message for `mlxcel_last_error`.
#[derive(Debug)]
pub(crate) struct CError {
    pub status: mlxcel_status,
    pub message: String,
}

impl CError {
    pub fn new(status: mlxcel_status, message: impl Into<String>) -> Self {
        CError {
            status,
            message: message.into(),
        }
    }
    pub fn null(name: &str) -> Self {
        CError::new(MLXCEL_ERR_NULL_POINTER, format!("`{name}` is NULL"))
    }
}

/// The status of each engine error kind: the C ABI's one error table.
fn status_of(kind: ErrorKind) -> mlxcel_status {
    match kind {
        ErrorKind::InvalidParameter => MLXCEL_ERR_INVALID_ARGUMENT,
        ErrorKind::EmptyPrompt => MLXCEL_ERR_EMPTY_PROMPT,
        ErrorKind::PromptTooLong => MLXCEL_ERR_PROMPT_TOO_LONG,
        ErrorKind::ModelLoad => MLXCEL_ERR_MODEL_LOAD,
        ErrorKind::Tokenizer => MLXCEL_ERR_TOKENIZER,
        ErrorKind::Mlx => MLXCEL_ERR_MLX,
        ErrorKind::ShuttingDown => MLXCEL_ERR_EXITING,
        ErrorKind::KvPoolTooSmall => MLXCEL_ERR_KV_POOL_TOO_SMALL,
        _ => MLXCEL_ERR_INTERNAL,
    }
}

impl From<mlxcel_engine::Error> for CError {
    fn from(e: mlxcel_engine::Error) -> Self {
        CError::new(status_of(e.code()), e.to_string())
    }
}

pub(crate) type CResult<T> = Result<T, CError>;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

pub(crate) fn set_last_error(message: &str) {
    let message = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|slot| *slot.borrow_mut() = message);
}

pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR.with(|slot| slot.borrow().as_ptr())
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

/// Runs an entry point's body: maps its error (recording the message) and
/// catches panics, so nothing unwinds into C.
pub(crate) fn guard(body: impl FnOnce(&Inside) -> CResult<mlxcel_status>) -> mlxcel_status {
    guard_or(body, || {
        Err(CError::new(
            MLXCEL_ERR_EXITING,
            "the process is exiting (exit() was called or main returned); no new work starts",
        ))
    })
}

/// Like [`guard`], with `when_exiting` run instead of `body` once the process
/// has begun exiting (see `shutdown`).
pub(crate) fn guard_or(
    body: impl FnOnce(&Inside) -> CResult<mlxcel_status>,
    when_exiting: impl FnOnce() -> CResult<mlxcel_status>,
) -> mlxcel_status {
    let outcome = match shutdown::enter() {
        Some(inside) => catch_unwind(AssertUnwindSafe(|| body(&inside))),
        None => catch_unwind(AssertUnwindSafe(when_exiting)),
    };
    match outcome {
        Ok(Ok(status)) => status,
        Ok(Err(e)) => {
            set_last_error(&e.message);
            e.status
        }
        Err(payload) => {
            set_last_error(&format!(
                "internal error (panic): {}",
                panic_message(payload.as_ref())
            ));
            MLXCEL_ERR_INTERNAL
        }
    }
}

pub(crate) fn status_name(status: mlxcel_status) -> &'static str {
    match status {
        MLXCEL_OK => "ok\0",
        MLXCEL_CANCELLED => "cancelled\0",
        MLXCEL_ERR_INVALID_ARGUMENT => "invalid argument\0",
        MLXCEL_ERR_NULL_POINTER => "null pointer\0",
        MLXCEL_ERR_INVALID_UTF8 => "invalid UTF-8\0",
        MLXCEL_ERR_INVALID_HANDLE => "invalid handle\0",
        MLXCEL_ERR_BUFFER_TOO_SMALL => "buffer too small\0",
        MLXCEL_ERR_MODEL_LOAD => "model load error\0",
        MLXCEL_ERR_MLX => "MLX error\0",
        MLXCEL_ERR_TOKENIZER => "tokenizer or chat template error\0",
        MLXCEL_ERR_EMPTY_PROMPT => "empty prompt\0",
        MLXCEL_ERR_PROMPT_TOO_LONG => "prompt too long\0",
        MLXCEL_ERR_BUSY => "context busy\0",
        MLXCEL_ERR_INTERNAL => "internal error\0",
        MLXCEL_ERR_EXITING => "process exiting\0",
        MLXCEL_ERR_KV_POOL_TOO_SMALL => "KV pool too small\0",
        _ => "unknown status\0",
    }
}
