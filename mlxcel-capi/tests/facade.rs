//! The C ABI is a translation of the engine facade: its defaults, messages
//! and error kinds are the engine's (the Python and Node tests check the same
//! messages and codes).

use std::ffi::{c_char, CStr, CString};
use std::path::{Path, PathBuf};

use mlxcel::*;
use mlxcel_engine::GenerationOptions;

const MLXCEL_ERR_INVALID_ARGUMENT: mlxcel_status = mlxcel_status_code::MLXCEL_ERR_INVALID_ARGUMENT as mlxcel_status;
const MLXCEL_ERR_TOKENIZER: mlxcel_status = mlxcel_status_code::MLXCEL_ERR_TOKENIZER as mlxcel_status;

fn last_error() -> String {
    unsafe { CStr::from_ptr(mlxcel_last_error()) }.to_string_lossy().into_owned()
}

fn load(dir: &Path) -> *mut mlxcel_model {
    let path = CString::new(dir.to_str().unwrap()).unwrap();
    let mut model = std::ptr::null_mut();
    let params = mlxcel_model_params { path: path.as_ptr(), ..mlxcel_model_default_params() };
    assert_eq!(unsafe { mlxcel_model_load(params, &mut model) }, 0, "{}", last_error());
    model
}

fn context(model: *mut mlxcel_model) -> *mut mlxcel_context {
    let mut ctx = std::ptr::null_mut();
    assert_eq!(unsafe { mlxcel_context_new(model, &mut ctx) }, 0, "{}", last_error());
    ctx
}

fn generate(ctx: *mut mlxcel_context, prompt: &str, params: mlxcel_generate_params) -> (mlxcel_status, mlxcel_generation_result) {
    let prompt = CString::new(prompt).unwrap();
    let mut result = unsafe { std::mem::zeroed::<mlxcel_generation_result>() };
    let status = unsafe {
        mlxcel_generate(ctx, prompt.as_ptr(), params, None, std::ptr::null_mut(), std::ptr::null_mut(), 0, &mut result)
    };
    (status, result)
}

/// The default model with its chat template left out (everything else linked).
fn model_without_chat_template() -> PathBuf {
    let source = mlxcel_hub::default_model_dir().unwrap();
    let dir = std::env::temp_dir().join(format!("mlxcel-capi-no-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"] {
        let _ = std::fs::remove_file(dir.join(name));
        std::os::unix::fs::symlink(source.join(name), dir.join(name)).unwrap();
    }
    let config = std::fs::read_to_string(source.join("tokenizer_config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&config).unwrap();
    config.as_object_mut().unwrap().remove("chat_template");
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}

#[test]
fn default_params_are_the_engines() {
    let c = mlxcel_generate_default_params();
    let d = GenerationOptions::default();
    assert_eq!(c.max_tokens as i64, d.max_tokens);
    assert_eq!((c.temperature as f64, c.top_p as f64, c.min_p as f64), (d.temperature, d.top_p, d.min_p));
    assert_eq!((c.top_k as i64, c.repetition_context_size as i64), (d.top_k, d.repetition_context_size));
    assert_eq!(c.repetition_penalty as f64, d.repetition_penalty);
    assert_eq!(c.prefill_chunk as i64, d.prefill_chunk);
    assert_eq!(c.prefill_chunk as usize, mlxcel_engine::DEFAULT_PREFILL_CHUNK);
    assert_eq!(c.has_seed, d.seed.is_some());
    assert_eq!(c.n_stop, d.stop.len());
    assert_eq!((c.speculation.is_null(), d.speculation), (true, None));
    assert_eq!((c.draft_max as i64, c.draft_min as i64), (d.draft_max, d.draft_min));
    assert!(c.json_schema.is_null() && c.regex.is_null() && c.grammar.is_null());
    assert_eq!((&d.json_schema, &d.regex, &d.grammar), (&None, &None, &None));
}

#[test]
fn bad_parameters_give_the_engines_messages_and_cached_tokens_are_reported() {
    let model = load(&mlxcel_hub::default_model_dir().unwrap());
    let ctx = context(model);
    let mut params = mlxcel_generate_default_params();
    params.top_k = -1;
    assert_eq!(generate(ctx, "Hi", params).0, MLXCEL_ERR_INVALID_ARGUMENT);
    assert_eq!(last_error(), "invalid parameter `top_k`: must be an integer in [0, 2**32) (0 = off), got -1");
    params = mlxcel_generate_default_params();
    params.temperature = -1.0;
    assert_eq!(generate(ctx, "Hi", params).0, MLXCEL_ERR_INVALID_ARGUMENT);
    assert_eq!(last_error(), "invalid parameter `temperature`: must be a finite number >= 0, got -1");

    // The same long prompt twice: the second run's prompt comes from the prefix cache.
    let prompt = "The history of the printing press begins in the fifteenth century, when ".repeat(4);
    params = mlxcel_generate_default_params();
    params.max_tokens = 2;
    let (status, first) = generate(ctx, &prompt, params);
    assert_eq!(status, 0, "{}", last_error());
    let (_, second) = generate(ctx, &prompt, params);
    assert_eq!(first.prompt_tokens, second.prompt_tokens);
    assert!(second.cached_tokens > 0 && second.cached_tokens < second.prompt_tokens, "{second:?}");
    assert!(second.cached_tokens >= first.cached_tokens);
    mlxcel_context_free(ctx);
    mlxcel_model_free(model);
}

#[test]
fn a_missing_chat_template_is_a_tokenizer_error_everywhere() {
    let model = load(&model_without_chat_template());
    let ctx = context(model);
    let roles = [c"user".as_ptr()];
    let contents = [c"Hi".as_ptr()];
    let mut buf = [0 as c_char; 64];
    let status = unsafe {
        mlxcel_apply_chat_template(model, roles.as_ptr(), contents.as_ptr(), 1, true, buf.as_mut_ptr(), buf.len(), std::ptr::null_mut())
    };
    assert_eq!(status, MLXCEL_ERR_TOKENIZER, "{}", last_error());
    let message = last_error();
    let status = unsafe {
        mlxcel_generate_chat(
            ctx,
            roles.as_ptr(),
            contents.as_ptr(),
            1,
            mlxcel_generate_default_params(),
            None,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(status, MLXCEL_ERR_TOKENIZER);
    assert_eq!(last_error(), message);
    mlxcel_context_free(ctx);
    mlxcel_model_free(model);
}
