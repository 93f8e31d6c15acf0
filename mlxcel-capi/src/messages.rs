//! Chat messages whose content is a list of parts (text and images): a
//! translation into the engine's `Message` / `ContentPart`. Since ABI 7.1.

use std::ffi::{c_char, c_void};

use mlxcel_engine::{Content, ContentPart, Message, Prompt};

use crate::status::*;
use crate::transcribe::c_array;
use crate::{c_str, generate_with, mlxcel_context, mlxcel_generate_params, mlxcel_generation_result, mlxcel_piece_callback, path_from_c};

/// The values of `mlxcel_content_part.type` (an `int32_t`). Since ABI 7.1.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum mlxcel_content_type {
    /// `text`: NUL-terminated UTF-8.
    MLXCEL_CONTENT_TEXT = 0,
    /// `path`: an image file (PNG, JPEG, WebP, GIF or BMP), read when the prompt is built.
    MLXCEL_CONTENT_IMAGE_PATH = 1,
    /// `data`, `n_bytes`: a whole image file in memory (copied during the call).
    MLXCEL_CONTENT_IMAGE_BYTES = 2,
}

/// One part of a message's content. Only the fields of its `type` are read;
/// set the others to NULL / 0. Since ABI 7.1.
/// cbindgen:field-names=[type, text, path, data, n_bytes]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct mlxcel_content_part {
    /// An `mlxcel_content_type`.
    pub type_: i32,
    pub text: *const c_char,
    pub path: *const c_char,
    pub data: *const u8,
    pub n_bytes: usize,
}

/// One chat message: a role and either `content` (text) or `n_parts` parts
/// (text and images, in order); exactly one of the two. Since ABI 7.1.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct mlxcel_message {
    /// "system", "user", "assistant", ...: NUL-terminated UTF-8.
    pub role: *const c_char,
    /// The text content, NUL-terminated UTF-8; NULL when `parts` is used.
    pub content: *const c_char,
    pub parts: *const mlxcel_content_part,
    pub n_parts: usize,
}

const TEXT: i32 = mlxcel_content_type::MLXCEL_CONTENT_TEXT as i32;
const IMAGE_PATH: i32 = mlxcel_content_type::MLXCEL_CONTENT_IMAGE_PATH as i32;
const IMAGE_BYTES: i32 = mlxcel_content_type::MLXCEL_CONTENT_IMAGE_BYTES as i32;

unsafe fn part(p: &mlxcel_content_part, name: &str) -> CResult<ContentPart> {
    Ok(match p.type_ {
        TEXT => ContentPart::text(c_str(p.text, &format!("{name}.text"))?),
        IMAGE_PATH => {
            if p.path.is_null() {
                return Err(CError::null(&format!("{name}.path")));
            }
            ContentPart::image_path(path_from_c(p.path))
        }
        IMAGE_BYTES => ContentPart::image_bytes(c_array(p.data, p.n_bytes, &format!("{name}.data"))?.to_vec()),
        other => {
            return Err(CError::new(
                MLXCEL_ERR_INVALID_ARGUMENT,
                format!("`{name}.type` is {other}: expected MLXCEL_CONTENT_TEXT (0), _IMAGE_PATH (1) or _IMAGE_BYTES (2)"),
            ))
        }
    })
}

unsafe fn messages(list: *const mlxcel_message, n: usize) -> CResult<Vec<Message>> {
    let list = c_array(list, n, "messages")?;
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let name = format!("messages[{i}]");
            let role = c_str(m.role, &format!("{name}.role"))?;
            let content = match (m.content.is_null(), m.n_parts) {
                (false, 0) => Content::Text(c_str(m.content, &format!("{name}.content"))?.to_owned()),
                (true, _) => Content::Parts(
                    c_array(m.parts, m.n_parts, &format!("{name}.parts"))?
                        .iter()
                        .enumerate()
                        .map(|(j, p)| part(p, &format!("{name}.parts[{j}]")))
                        .collect::<CResult<_>>()?,
                ),
                (false, _) => {
                    return Err(CError::new(MLXCEL_ERR_INVALID_ARGUMENT, format!("`{name}` has both `content` and `parts`: set one")))
                }
            };
            Ok(Message::new(role, content))
        })
        .collect()
}

/// Like `mlxcel_generate_chat`, with `n_messages` messages whose content may
/// hold images (for a vision-language model; `mlxcel_model_supports_images`).
/// NULL `messages` is allowed when `n_messages` is 0. Beyond
/// `mlxcel_generate`'s statuses: NULL_POINTER for a NULL `role`, text,
/// `path`, or `data` with `n_bytes > 0` (the message names it, e.g.
/// `messages[0].parts[1].data`); INVALID_ARGUMENT for an unknown part type,
/// a message with both `content` and `parts`, and the engine's image errors,
/// which name `images`: an image that cannot be read or decoded (the
/// message names its path, or `image N`), or any image for a text-only
/// model (the message names its architecture). Images are decoded when the
/// run starts, on the calling thread. Since ABI 7.1.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_generate_messages(
    ctx: *mut mlxcel_context,
    messages: *const mlxcel_message,
    n_messages: usize,
    params: mlxcel_generate_params,
    callback: mlxcel_piece_callback,
    user_data: *mut c_void,
    out: *mut c_char,
    out_cap: usize,
    result: *mut mlxcel_generation_result,
) -> mlxcel_status {
    generate_with(ctx, |_| Ok(Prompt::Chat(self::messages(messages, n_messages)?)), &params, callback, user_data, out, out_cap, result)
}

/// Writes whether the model takes images (a vision-language model) to
/// `*out`. NULL_POINTER, INVALID_HANDLE. Thread-safe. Since ABI 7.1.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_model_supports_images(model: *const crate::mlxcel_model, out: *mut bool) -> mlxcel_status {
    guard(|_| {
        let engine = crate::MODELS.get(model as usize)?;
        if out.is_null() {
            return Err(CError::null("out"));
        }
        *out = engine.supports_images();
        Ok(MLXCEL_OK)
    })
}
