/*
 * C tests of the mlxcel ABI, one scenario per command-line argument:
 *   api_test errors | buffers | generate | cancel_prefill | cancel_decode | concurrent | batch | pool | speculation
 *            | structured
 * Every scenario loads the default model (NULL path). Exit status 0 = pass.
 * Run by mlxcel-capi/tests/c_api.rs.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <time.h>

#include "mlxcel.h"

#define CHECK(cond)                                                                                        \
    do {                                                                                                   \
        if (!(cond)) {                                                                                     \
            fprintf(stderr, "%s:%d: CHECK failed: %s (last error: %s)\n", __FILE__, __LINE__, #cond,      \
                    mlxcel_last_error());                                                                  \
            exit(1);                                                                                       \
        }                                                                                                  \
    } while (0)

#define CHECK_STATUS(expr, expected)                                                                       \
    do {                                                                                                   \
        mlxcel_status s_ = (expr);                                                                         \
        if (s_ != (expected)) {                                                                            \
            fprintf(stderr, "%s:%d: %s returned %d (%s), expected %d (last error: %s)\n", __FILE__,         \
                    __LINE__, #expr, s_, mlxcel_status_string(s_), (int)(expected), mlxcel_last_error());   \
            exit(1);                                                                                       \
        }                                                                                                  \
    } while (0)

#define CHECK_ERROR_MENTIONS(needle)                                                                        \
    do {                                                                                                   \
        if (strstr(mlxcel_last_error(), (needle)) == NULL) {                                               \
            fprintf(stderr, "%s:%d: last error \"%s\" does not mention \"%s\"\n", __FILE__, __LINE__,       \
                    mlxcel_last_error(), (needle));                                                        \
            exit(1);                                                                                       \
        }                                                                                                  \
    } while (0)

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static mlxcel_model *load_default(void) {
    mlxcel_model *model = NULL;
    CHECK_STATUS(mlxcel_model_load(mlxcel_model_default_params(), &model), MLXCEL_OK);
    CHECK(model != NULL);
    return model;
}

static mlxcel_generate_params greedy(int max_tokens) {
    mlxcel_generate_params p = mlxcel_generate_default_params();
    p.max_tokens = max_tokens;
    return p;
}

/* ------------------------------------------------------------------------ */

static void test_errors(void) {
    /* Version and status strings. */
    CHECK(strlen(mlxcel_version()) > 0);
    CHECK(mlxcel_abi_version() == ((MLXCEL_ABI_VERSION_MAJOR << 16) | MLXCEL_ABI_VERSION_MINOR));
    CHECK(strcmp(mlxcel_status_string(MLXCEL_ERR_INVALID_HANDLE), "invalid handle") == 0);
    CHECK(strcmp(mlxcel_status_string(12345), "unknown status") == 0);
    CHECK(mlxcel_last_error() != NULL);

    /* Bad paths: a load error naming the path; *out is set to NULL. */
    mlxcel_model *model = (mlxcel_model *)0x1;
    mlxcel_model_params mp = mlxcel_model_default_params();
    mp.path = "/nonexistent/mlxcel-model";
    CHECK_STATUS(mlxcel_model_load(mp, &model), MLXCEL_ERR_MODEL_LOAD);
    CHECK(model == NULL);
    CHECK_ERROR_MENTIONS("/nonexistent/mlxcel-model");
    mp.path = "/tmp";
    CHECK_STATUS(mlxcel_model_load(mp, &model), MLXCEL_ERR_MODEL_LOAD);
    CHECK_ERROR_MENTIONS("/tmp/");
    CHECK_STATUS(mlxcel_model_load(mlxcel_model_default_params(), NULL), MLXCEL_ERR_NULL_POINTER);

    /* NULL handles. */
    mlxcel_model_info info;
    mlxcel_context *ctx = NULL;
    size_t n = 0;
    int32_t ids[8];
    char buf[64];
    mlxcel_generation_result result;
    CHECK_STATUS(mlxcel_model_get_info(NULL, &info), MLXCEL_ERR_NULL_POINTER);
    CHECK_STATUS(mlxcel_tokenize(NULL, "hi", true, ids, 8, &n), MLXCEL_ERR_NULL_POINTER);
    CHECK_STATUS(mlxcel_context_new(NULL, &ctx), MLXCEL_ERR_NULL_POINTER);
    CHECK(ctx == NULL);
    CHECK_STATUS(mlxcel_generate(NULL, "hi", greedy(4), NULL, NULL, buf, sizeof buf, &result), MLXCEL_ERR_NULL_POINTER);
    CHECK(result.finish_reason == MLXCEL_FINISH_ERROR && buf[0] == '\0');
    CHECK_STATUS(mlxcel_cancel(NULL), MLXCEL_ERR_NULL_POINTER);
    CHECK_STATUS(mlxcel_model_free(NULL), MLXCEL_OK);   /* like free(NULL) */
    CHECK_STATUS(mlxcel_context_free(NULL), MLXCEL_OK);

    /* Garbage handles. */
    CHECK_STATUS(mlxcel_model_get_info((mlxcel_model *)0x1234, &info), MLXCEL_ERR_INVALID_HANDLE);
    CHECK_STATUS(mlxcel_model_get_info((mlxcel_model *)(uintptr_t)0xdeadbeef1, &info), MLXCEL_ERR_INVALID_HANDLE);
    CHECK_STATUS(mlxcel_model_free((mlxcel_model *)0x4321), MLXCEL_ERR_INVALID_HANDLE);
    CHECK_STATUS(mlxcel_cancel((mlxcel_context *)buf), MLXCEL_ERR_INVALID_HANDLE);
    CHECK_ERROR_MENTIONS("not a live context handle");

    model = load_default();
    CHECK_STATUS(mlxcel_context_new(model, &ctx), MLXCEL_OK);

    /* A handle of the wrong kind. */
    CHECK_STATUS(mlxcel_model_get_info((mlxcel_model *)ctx, &info), MLXCEL_ERR_INVALID_HANDLE);
    CHECK_STATUS(mlxcel_cancel((mlxcel_context *)model), MLXCEL_ERR_INVALID_HANDLE);

    /* NULL out-parameters and arguments. */
    CHECK_STATUS(mlxcel_model_get_info(model, NULL), MLXCEL_ERR_NULL_POINTER);
    CHECK_STATUS(mlxcel_context_new(model, NULL), MLXCEL_ERR_NULL_POINTER);
    CHECK_STATUS(mlxcel_tokenize(model, NULL, true, ids, 8, &n), MLXCEL_ERR_NULL_POINTER);
    CHECK_STATUS(mlxcel_tokenize(model, "hi", true, ids, 8, NULL), MLXCEL_ERR_NULL_POINTER);
    CHECK_STATUS(mlxcel_tokenize(model, "hi", true, NULL, 8, &n), MLXCEL_ERR_NULL_POINTER);
    CHECK_STATUS(mlxcel_generate(ctx, NULL, greedy(4), NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_NULL_POINTER);
    CHECK_ERROR_MENTIONS("prompt");
    CHECK_STATUS(mlxcel_generate(ctx, "hi", greedy(4), NULL, NULL, NULL, 16, NULL), MLXCEL_ERR_NULL_POINTER);
    CHECK_STATUS(mlxcel_generate_chat(ctx, NULL, NULL, 1, greedy(4), NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_NULL_POINTER);
    CHECK_STATUS(mlxcel_generate_tokens(ctx, NULL, 3, greedy(4), NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_NULL_POINTER);

    /* Invalid parameters: each named in the message; the context is unchanged. */
    mlxcel_generate_params p = greedy(4);
    p.temperature = -1.0f;
    CHECK_STATUS(mlxcel_generate(ctx, "hi", p, NULL, NULL, buf, sizeof buf, &result), MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("temperature");
    CHECK(result.finish_reason == MLXCEL_FINISH_ERROR && result.generated_tokens == 0);
    p = greedy(4); p.top_p = 0.0f;
    CHECK_STATUS(mlxcel_generate(ctx, "hi", p, NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("top_p");
    p = greedy(0);
    CHECK_STATUS(mlxcel_generate(ctx, "hi", p, NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("max_tokens");
    p = greedy(4); p.top_k = -3;
    CHECK_STATUS(mlxcel_generate(ctx, "hi", p, NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("top_k");
    p = greedy(4); p.prefill_chunk = 0;
    CHECK_STATUS(mlxcel_generate(ctx, "hi", p, NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("prefill_chunk");
    p = greedy(4); p.min_p = 2.0f;
    CHECK_STATUS(mlxcel_generate(ctx, "hi", p, NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_INVALID_ARGUMENT);
    p = greedy(4); p.repetition_penalty = 0.0f;
    CHECK_STATUS(mlxcel_generate(ctx, "hi", p, NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_INVALID_ARGUMENT);
    p = greedy(4); p.n_stop = 2; p.stop = NULL;
    CHECK_STATUS(mlxcel_generate(ctx, "hi", p, NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_NULL_POINTER);
    CHECK_ERROR_MENTIONS("stop");
    const char *stops_with_null[] = {".", NULL};
    p.stop = stops_with_null;
    CHECK_STATUS(mlxcel_generate(ctx, "hi", p, NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_NULL_POINTER);
    CHECK_ERROR_MENTIONS("stop[1]");
    int32_t bad_tokens[] = {1, -5};
    CHECK_STATUS(mlxcel_generate_tokens(ctx, bad_tokens, 2, greedy(4), NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_INVALID_ARGUMENT);
    int32_t huge_token[] = {1 << 30};
    CHECK_STATUS(mlxcel_detokenize(model, huge_token, 1, true, buf, sizeof buf, &n), MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("vocabulary");

    /* Invalid UTF-8. */
    CHECK_STATUS(mlxcel_generate(ctx, "caf\xc3", greedy(4), NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_INVALID_UTF8);
    CHECK_ERROR_MENTIONS("prompt");
    CHECK_STATUS(mlxcel_tokenize(model, "\xff\xfe", true, ids, 8, &n), MLXCEL_ERR_INVALID_UTF8);
    const char *bad_roles[] = {"us\x80r"};
    const char *contents[] = {"hello"};
    CHECK_STATUS(mlxcel_apply_chat_template(model, bad_roles, contents, 1, true, buf, sizeof buf, &n), MLXCEL_ERR_INVALID_UTF8);
    CHECK_ERROR_MENTIONS("roles[0]");
    const char *bad_stop[] = {"\xc0"};
    p = greedy(4); p.stop = bad_stop; p.n_stop = 1;
    CHECK_STATUS(mlxcel_generate(ctx, "hi", p, NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_INVALID_UTF8);

    /* An empty prompt (no BOS for this tokenizer). */
    CHECK_STATUS(mlxcel_generate(ctx, "", greedy(4), NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_EMPTY_PROMPT);

    /* Double free and use after free are detected. */
    mlxcel_context *ctx2 = NULL;
    CHECK_STATUS(mlxcel_context_new(model, &ctx2), MLXCEL_OK);
    CHECK(ctx2 != ctx);
    CHECK_STATUS(mlxcel_context_free(ctx2), MLXCEL_OK);
    CHECK_STATUS(mlxcel_context_free(ctx2), MLXCEL_ERR_INVALID_HANDLE);
    CHECK_ERROR_MENTIONS("not a live context handle");
    CHECK_STATUS(mlxcel_generate(ctx2, "hi", greedy(4), NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_INVALID_HANDLE);
    CHECK_STATUS(mlxcel_cancel(ctx2), MLXCEL_ERR_INVALID_HANDLE);
    /* A new handle never reuses a freed one. */
    mlxcel_context *ctx3 = NULL;
    CHECK_STATUS(mlxcel_context_new(model, &ctx3), MLXCEL_OK);
    CHECK(ctx3 != ctx2);
    CHECK_STATUS(mlxcel_cancel(ctx2), MLXCEL_ERR_INVALID_HANDLE);
    CHECK_STATUS(mlxcel_context_free(ctx3), MLXCEL_OK);

    /* The model handle can be freed before its context: the context keeps it alive. */
    CHECK_STATUS(mlxcel_model_free(model), MLXCEL_OK);
    CHECK_STATUS(mlxcel_model_free(model), MLXCEL_ERR_INVALID_HANDLE);
    CHECK_STATUS(mlxcel_model_get_info(model, &info), MLXCEL_ERR_INVALID_HANDLE);
    CHECK_STATUS(mlxcel_tokenize(model, "hi", true, ids, 8, &n), MLXCEL_ERR_INVALID_HANDLE);
    CHECK_STATUS(mlxcel_generate(ctx, "The capital of France is", greedy(2), NULL, NULL, buf, sizeof buf, &result), MLXCEL_OK);
    CHECK(result.generated_tokens == 2 && result.finish_reason == MLXCEL_FINISH_LENGTH);
    CHECK(strncmp(buf, " Paris", 6) == 0);
    CHECK_STATUS(mlxcel_context_free(ctx), MLXCEL_OK);

    /* The last error is per thread and survives successful calls. */
    CHECK_STATUS(mlxcel_model_free((mlxcel_model *)0x77), MLXCEL_ERR_INVALID_HANDLE);
    CHECK_ERROR_MENTIONS("0x77");
    CHECK(strlen(mlxcel_version()) > 0);
    CHECK_ERROR_MENTIONS("0x77");
    printf("errors: ok\n");
}

/* ------------------------------------------------------------------------ */

static void test_buffers(void) {
    mlxcel_model *model = load_default();
    size_t n = 0, needed = 0;

    /* Model info. */
    mlxcel_model_info info;
    CHECK_STATUS(mlxcel_model_get_info(model, &info), MLXCEL_OK);
    CHECK(strcmp(info.architecture, "llama") == 0);
    CHECK(info.num_layers == 30 && info.hidden_size == 576 && info.vocab_size == 49152);
    CHECK(info.parameters > 100000000ull && info.parameters < 200000000ull);
    CHECK(info.weight_bytes > 0 && info.weight_bytes < info.parameters * 2);
    CHECK(info.context_length == 8192);
    CHECK(info.bits_per_weight > 3.0 && info.bits_per_weight < 16.0);
    CHECK(strlen(info.dtype) > 0 && strlen(info.tokenizer_kind) > 0);
    printf("info: %s %s, %llu params, %llu bytes, q%u/g%u, %.2f bpw, tokenizer %s\n", info.architecture, info.dtype,
           (unsigned long long)info.parameters, (unsigned long long)info.weight_bytes, info.quant_bits,
           info.quant_group_size, info.bits_per_weight, info.tokenizer_kind);

    /* JSON info: size query, then fill. */
    CHECK_STATUS(mlxcel_model_info_json(model, NULL, 0, &needed), MLXCEL_ERR_BUFFER_TOO_SMALL);
    CHECK(needed > 100);
    char *json = malloc(needed + 1);
    size_t needed2 = 0;
    CHECK_STATUS(mlxcel_model_info_json(model, json, needed + 1, &needed2), MLXCEL_OK);
    CHECK(needed2 == needed && strlen(json) == needed);
    CHECK(strstr(json, "\"architecture\":\"llama\"") != NULL);
    CHECK(strstr(json, "\"groups\":[") != NULL);
    /* One byte short: truncated, NUL-terminated, BUFFER_TOO_SMALL. */
    CHECK_STATUS(mlxcel_model_info_json(model, json, needed, &needed2), MLXCEL_ERR_BUFFER_TOO_SMALL);
    CHECK(strlen(json) == needed - 1);
    free(json);

    /* Tokenize: size query then fill, and a too-small buffer. */
    const char *text = "The capital of France is";
    CHECK_STATUS(mlxcel_tokenize(model, text, true, NULL, 0, &n), MLXCEL_ERR_BUFFER_TOO_SMALL);
    CHECK(n == 5);
    int32_t ids[16];
    for (int i = 0; i < 16; i++) ids[i] = -7;
    CHECK_STATUS(mlxcel_tokenize(model, text, true, ids, 2, &n), MLXCEL_ERR_BUFFER_TOO_SMALL);
    CHECK(n == 5 && ids[0] >= 0 && ids[1] >= 0 && ids[2] == -7);
    CHECK_STATUS(mlxcel_tokenize(model, text, true, ids, 16, &n), MLXCEL_OK);
    CHECK(n == 5);

    /* Detokenize round trip, with the snprintf contract. */
    char out[64];
    CHECK_STATUS(mlxcel_detokenize(model, ids, n, true, out, sizeof out, &needed), MLXCEL_OK);
    CHECK(strcmp(out, text) == 0 && needed == strlen(text));
    CHECK_STATUS(mlxcel_detokenize(model, ids, n, true, out, 8, &needed), MLXCEL_ERR_BUFFER_TOO_SMALL);
    CHECK(needed == strlen(text) && strcmp(out, "The cap") == 0);
    CHECK_STATUS(mlxcel_detokenize(model, ids, n, true, NULL, 0, &needed), MLXCEL_ERR_BUFFER_TOO_SMALL);
    CHECK_STATUS(mlxcel_detokenize(model, NULL, 0, true, out, sizeof out, &needed), MLXCEL_OK);
    CHECK(needed == 0 && out[0] == '\0');

    /* Truncation never splits a UTF-8 character. */
    const char *utf8 = "caf\xc3\xa9!";  /* café! */
    CHECK_STATUS(mlxcel_tokenize(model, utf8, false, ids, 16, &n), MLXCEL_OK);
    CHECK_STATUS(mlxcel_detokenize(model, ids, n, true, out, 5, &needed), MLXCEL_ERR_BUFFER_TOO_SMALL);
    CHECK(needed == 6 && strcmp(out, "caf") == 0);

    /* Chat template. */
    const char *roles[] = {"system", "user"};
    const char *contents[] = {"You are terse.", "Hi!"};
    CHECK_STATUS(mlxcel_apply_chat_template(model, roles, contents, 2, true, NULL, 0, &needed), MLXCEL_ERR_BUFFER_TOO_SMALL);
    char *rendered = malloc(needed + 1);
    CHECK_STATUS(mlxcel_apply_chat_template(model, roles, contents, 2, true, rendered, needed + 1, NULL), MLXCEL_OK);
    CHECK(strstr(rendered, "<|im_start|>system\nYou are terse.<|im_end|>") != NULL);
    CHECK(strstr(rendered, "<|im_start|>user\nHi!<|im_end|>") != NULL);
    size_t len = strlen(rendered);
    CHECK(len >= 22 && strcmp(rendered + len - 22, "<|im_start|>assistant\n") == 0);
    free(rendered);

    CHECK_STATUS(mlxcel_model_free(model), MLXCEL_OK);
    printf("buffers: ok\n");
}

/* ------------------------------------------------------------------------ */

typedef struct {
    char text[4096];
    size_t len;
    int pieces;
    int stop_after;   /* return false after this many pieces (0 = never) */
} Collector;

static bool collect(const char *text, size_t len, int32_t token, void *user_data) {
    Collector *c = user_data;
    CHECK(text[len] == '\0' && strlen(text) == len && token >= 0);
    if (c->len + len < sizeof c->text) {
        memcpy(c->text + c->len, text, len);
        c->len += len;
        c->text[c->len] = '\0';
    }
    c->pieces++;
    return c->stop_after == 0 || c->pieces < c->stop_after;
}

static void test_generate(void) {
    mlxcel_model *model = load_default();
    mlxcel_context *ctx = NULL;
    CHECK_STATUS(mlxcel_context_new(model, &ctx), MLXCEL_OK);
    mlxcel_generation_result r;

    /* Greedy text: streamed pieces == returned text == context text. */
    Collector c = {0};
    char out[256];
    CHECK_STATUS(mlxcel_generate(ctx, "The capital of France is", greedy(6), collect, &c, out, sizeof out, &r), MLXCEL_OK);
    printf("greedy: [%s]\n", out);
    CHECK(strncmp(out, " Paris", 6) == 0);
    CHECK(strcmp(out, c.text) == 0 && r.text_len == strlen(out));
    CHECK(r.finish_reason == MLXCEL_FINISH_LENGTH && r.generated_tokens == 6 && r.prompt_tokens == 5);
    CHECK(r.prompt_seconds > 0 && r.process_peak_memory_bytes > 0);
    char again[256];
    size_t needed = 0;
    CHECK_STATUS(mlxcel_context_text(ctx, again, sizeof again, &needed), MLXCEL_OK);
    CHECK(strcmp(again, out) == 0 && needed == strlen(out));
    int32_t toks[16];
    size_t n = 0;
    CHECK_STATUS(mlxcel_context_tokens(ctx, toks, 16, &n), MLXCEL_OK);
    CHECK(n == 6);
    CHECK_STATUS(mlxcel_detokenize(model, toks, n, true, again, sizeof again, &needed), MLXCEL_OK);
    CHECK(strcmp(again, out) == 0);

    /* The sampler chain: banning the greedy first token (" Paris" starts with
       toks[0]) changes the text; a seeded chain run twice is the same; a bad
       stage name and a NULL bias array are errors that say so. */
    mlxcel_generate_params chain = greedy(6);
    int32_t banned = toks[0];
    float ban = -INFINITY;
    chain.logit_bias_tokens = &banned;
    chain.logit_bias_values = &ban;
    chain.n_logit_bias = 1;
    CHECK_STATUS(mlxcel_generate(ctx, "The capital of France is", chain, NULL, NULL, again, sizeof again, &r), MLXCEL_OK);
    CHECK(strncmp(again, " Paris", 6) != 0);
    chain = greedy(12);
    chain.temperature = 0.9f;
    chain.top_k = 40;
    chain.dry_multiplier = 0.8f;
    chain.xtc_probability = 0.5f;
    chain.samplers = "penalties;dry;top_k;xtc;temperature";
    chain.has_seed = true;
    chain.seed = 11;
    char first[256];
    CHECK_STATUS(mlxcel_generate(ctx, "Once upon a time", chain, NULL, NULL, first, sizeof first, &r), MLXCEL_OK);
    CHECK_STATUS(mlxcel_generate(ctx, "Once upon a time", chain, NULL, NULL, again, sizeof again, &r), MLXCEL_OK);
    CHECK(strcmp(first, again) == 0 && r.generated_tokens == 12);
    chain.samplers = "top_k;mirostat";
    CHECK_STATUS(mlxcel_generate(ctx, "Once upon a time", chain, NULL, NULL, again, sizeof again, &r), MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("mirostat");
    chain = greedy(6);
    chain.n_logit_bias = 1;
    CHECK_STATUS(mlxcel_generate(ctx, "The capital of France is", chain, NULL, NULL, again, sizeof again, &r), MLXCEL_ERR_NULL_POINTER);
    CHECK_ERROR_MENTIONS("logit_bias_tokens");

    /* Logprobs: one per token, the chosen one first among 3 alternatives. */
    chain = greedy(6);
    chain.logprobs = 3;
    CHECK_STATUS(mlxcel_generate(ctx, "The capital of France is", chain, NULL, NULL, again, sizeof again, &r), MLXCEL_OK);
    mlxcel_token_logprob lps[8];
    size_t n_lp = 0;
    CHECK_STATUS(mlxcel_context_logprobs(ctx, lps, 8, &n_lp), MLXCEL_OK);
    CHECK(n_lp == 6 && lps[0].token == toks[0] && lps[0].n_top == 3 && lps[0].top_tokens[0] == toks[0]);
    CHECK(lps[0].logprob < 0 && lps[0].top_logprobs[0] >= lps[0].top_logprobs[1]);
    CHECK_STATUS(mlxcel_context_logprobs(ctx, lps, 2, &n_lp), MLXCEL_ERR_BUFFER_TOO_SMALL);
    CHECK(n_lp == 6);
    chain.logprobs = 21;
    CHECK_STATUS(mlxcel_generate(ctx, "The capital of France is", chain, NULL, NULL, again, sizeof again, &r), MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("logprobs");
    CHECK_STATUS(mlxcel_generate(ctx, "The capital of France is", greedy(2), NULL, NULL, again, sizeof again, &r), MLXCEL_OK);
    CHECK_STATUS(mlxcel_context_logprobs(ctx, NULL, 0, &n_lp), MLXCEL_OK);
    CHECK(n_lp == 0);

    /* A truncated output buffer is not an error; the context has the whole text. */
    char small[4];
    CHECK_STATUS(mlxcel_generate(ctx, "The capital of France is", greedy(6), NULL, NULL, small, sizeof small, &r), MLXCEL_OK);
    CHECK(strcmp(small, " Pa") == 0 && r.text_len == strlen(out));
    CHECK_STATUS(mlxcel_context_text(ctx, again, sizeof again, &needed), MLXCEL_OK);
    CHECK(strcmp(again, out) == 0);

    /* The same from token ids. */
    int32_t prompt_ids[16];
    CHECK_STATUS(mlxcel_tokenize(model, "The capital of France is", true, prompt_ids, 16, &n), MLXCEL_OK);
    CHECK_STATUS(mlxcel_generate_tokens(ctx, prompt_ids, n, greedy(6), NULL, NULL, again, sizeof again, &r), MLXCEL_OK);
    CHECK(strcmp(again, out) == 0);

    /* Stop strings end the text before the match. */
    const char *stops[] = {"."};
    mlxcel_generate_params p = greedy(12);
    p.stop = stops;
    p.n_stop = 1;
    CHECK_STATUS(mlxcel_generate(ctx, "The capital of France is", p, NULL, NULL, again, sizeof again, &r), MLXCEL_OK);
    CHECK(strcmp(again, " Paris") == 0 && r.finish_reason == MLXCEL_FINISH_STOP);

    /* The callback returning false stops the run. */
    Collector stopper = {0};
    stopper.stop_after = 2;
    CHECK_STATUS(mlxcel_generate(ctx, "Once upon a time", greedy(40), collect, &stopper, NULL, 0, &r), MLXCEL_CANCELLED);
    CHECK(r.finish_reason == MLXCEL_FINISH_CALLBACK && stopper.pieces == 2 && r.generated_tokens < 40);

    /* Seeded sampling is reproducible. */
    p = greedy(8);
    p.temperature = 0.9f;
    p.top_p = 0.95f;
    p.seed = 1234;
    p.has_seed = true;
    char s1[256], s2[256];
    CHECK_STATUS(mlxcel_generate(ctx, "Once upon a time", p, NULL, NULL, s1, sizeof s1, &r), MLXCEL_OK);
    CHECK_STATUS(mlxcel_generate(ctx, "Once upon a time", p, NULL, NULL, s2, sizeof s2, &r), MLXCEL_OK);
    CHECK(strcmp(s1, s2) == 0 && strlen(s1) > 0);

    /* Chat. */
    const char *roles[] = {"user"};
    const char *contents[] = {"What is the capital of France?"};
    CHECK_STATUS(mlxcel_generate_chat(ctx, roles, contents, 1, greedy(16), NULL, NULL, again, sizeof again, &r), MLXCEL_OK);
    printf("chat: [%s]\n", again);
    CHECK(strstr(again, "Paris") != NULL);
    CHECK(r.prompt_tokens > 10);

    /* A cancel requested while idle applies to the next run only. */
    CHECK_STATUS(mlxcel_cancel(ctx), MLXCEL_OK);
    CHECK_STATUS(mlxcel_generate(ctx, "Once upon a time", greedy(40), NULL, NULL, NULL, 0, &r), MLXCEL_CANCELLED);
    CHECK(r.finish_reason == MLXCEL_FINISH_CANCELLED && r.generated_tokens <= 1);
    CHECK_STATUS(mlxcel_generate(ctx, "The capital of France is", greedy(3), NULL, NULL, NULL, 0, &r), MLXCEL_OK);
    CHECK(r.generated_tokens == 3);

    CHECK_STATUS(mlxcel_context_free(ctx), MLXCEL_OK);
    CHECK_STATUS(mlxcel_model_free(model), MLXCEL_OK);
    printf("generate: ok\n");
}

/* ------------------------------------------------------------------------ */

typedef struct {
    mlxcel_context *ctx;
    const char *prompt;
    mlxcel_generate_params params;
    atomic_int started;
    atomic_int pieces;
    mlxcel_status status;
    mlxcel_generation_result result;
    double finished_at;
} Run;

static bool count_pieces(const char *text, size_t len, int32_t token, void *user_data) {
    (void)text;
    (void)len;
    (void)token;
    atomic_fetch_add(&((Run *)user_data)->pieces, 1);
    return true;
}

static void *run_thread(void *arg) {
    Run *run = arg;
    atomic_store(&run->started, 1);
    run->status = mlxcel_generate(run->ctx, run->prompt, run->params, count_pieces, run, NULL, 0, &run->result);
    run->finished_at = now();
    return NULL;
}

static char *long_prompt(int repeats) {
    const char *sentence = "The quick brown fox jumps over the lazy dog while the cat watches from the fence. ";
    size_t len = strlen(sentence);
    char *p = malloc(len * repeats + 1);
    for (int i = 0; i < repeats; i++) memcpy(p + i * len, sentence, len);
    p[len * repeats] = '\0';
    return p;
}

static void test_cancel_prefill(void) {
    mlxcel_model *model = load_default();
    mlxcel_context *ctx = NULL;
    CHECK_STATUS(mlxcel_context_new(model, &ctx), MLXCEL_OK);
    char *prompt = long_prompt(120);  /* about 2,000 tokens */
    size_t n = 0;
    CHECK_STATUS(mlxcel_tokenize(model, prompt, true, NULL, 0, &n), MLXCEL_ERR_BUFFER_TOO_SMALL);
    CHECK(n > 1500 && n < 8000);

    Run run = {.ctx = ctx, .prompt = prompt, .params = greedy(8)};
    run.params.prefill_chunk = 32;
    pthread_t thread;
    CHECK(pthread_create(&thread, NULL, run_thread, &run) == 0);
    while (!atomic_load(&run.started)) sleep_ms(1);
    sleep_ms(400);
    /* While it runs, the context is busy for other threads. */
    CHECK_STATUS(mlxcel_generate(ctx, "hi", greedy(2), NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_BUSY);
    double cancelled_at = now();
    CHECK_STATUS(mlxcel_cancel(ctx), MLXCEL_OK);
    CHECK(pthread_join(thread, NULL) == 0);
    double latency = run.finished_at - cancelled_at;
    printf("cancel during prefill of %zu tokens: returned %.3f s after mlxcel_cancel\n", n, latency);
    CHECK_STATUS(run.status, MLXCEL_CANCELLED);
    CHECK(run.result.finish_reason == MLXCEL_FINISH_CANCELLED);
    CHECK(run.result.generated_tokens == 0 && atomic_load(&run.pieces) == 0);  /* still in the prompt */
    CHECK(latency < 10.0);

    /* Freeing the context cancels its run, which returns normally. */
    Run run2 = {.ctx = ctx, .prompt = prompt, .params = greedy(8)};
    run2.params.prefill_chunk = 32;
    CHECK(pthread_create(&thread, NULL, run_thread, &run2) == 0);
    while (!atomic_load(&run2.started)) sleep_ms(1);
    sleep_ms(300);
    CHECK_STATUS(mlxcel_context_free(ctx), MLXCEL_OK);
    CHECK(pthread_join(thread, NULL) == 0);
    CHECK_STATUS(run2.status, MLXCEL_CANCELLED);
    CHECK(run2.result.generated_tokens == 0);
    CHECK_STATUS(mlxcel_cancel(ctx), MLXCEL_ERR_INVALID_HANDLE);

    free(prompt);
    CHECK_STATUS(mlxcel_model_free(model), MLXCEL_OK);
    printf("cancel_prefill: ok\n");
}

static void test_cancel_decode(void) {
    mlxcel_model *model = load_default();
    mlxcel_context *ctx = NULL;
    CHECK_STATUS(mlxcel_context_new(model, &ctx), MLXCEL_OK);
    Run run = {.ctx = ctx, .prompt = "Count from one to one thousand in words: one, two, three,", .params = greedy(400)};
    pthread_t thread;
    CHECK(pthread_create(&thread, NULL, run_thread, &run) == 0);
    while (atomic_load(&run.pieces) < 3) sleep_ms(2);
    CHECK_STATUS(mlxcel_generate(ctx, "hi", greedy(2), NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_BUSY);
    int at_cancel = atomic_load(&run.pieces);
    double cancelled_at = now();
    CHECK_STATUS(mlxcel_cancel(ctx), MLXCEL_OK);
    CHECK(pthread_join(thread, NULL) == 0);
    printf("cancel during decode after %d pieces: %zu tokens, returned %.3f s after mlxcel_cancel\n", at_cancel,
           run.result.generated_tokens, run.finished_at - cancelled_at);
    CHECK_STATUS(run.status, MLXCEL_CANCELLED);
    CHECK(run.result.finish_reason == MLXCEL_FINISH_CANCELLED);
    CHECK(run.result.generated_tokens >= 3 && run.result.generated_tokens < 400);
    CHECK((int)run.result.generated_tokens <= at_cancel + 4);
    size_t n = 0;
    CHECK_STATUS(mlxcel_context_tokens(ctx, NULL, 0, &n), n > 0 ? MLXCEL_ERR_BUFFER_TOO_SMALL : MLXCEL_OK);
    CHECK(n == run.result.generated_tokens);

    /* The cancel was spent on that run: the next one completes. */
    mlxcel_generation_result r;
    CHECK_STATUS(mlxcel_generate(ctx, "The capital of France is", greedy(2), NULL, NULL, NULL, 0, &r), MLXCEL_OK);
    CHECK(r.generated_tokens == 2);
    CHECK_STATUS(mlxcel_context_free(ctx), MLXCEL_OK);
    CHECK_STATUS(mlxcel_model_free(model), MLXCEL_OK);
    printf("cancel_decode: ok\n");
}

/* ------------------------------------------------------------------------ */

typedef struct {
    mlxcel_model *model;
    const char *prompt;
    char out[256];
    mlxcel_status status;
} Worker;

static void *worker(void *arg) {
    Worker *w = arg;
    mlxcel_context *ctx = NULL;
    w->status = mlxcel_context_new(w->model, &ctx);
    if (w->status != MLXCEL_OK) return NULL;
    w->status = mlxcel_generate(ctx, w->prompt, greedy(8), NULL, NULL, w->out, sizeof w->out, NULL);
    mlxcel_status freed = mlxcel_context_free(ctx);
    if (w->status == MLXCEL_OK) w->status = freed;
    return NULL;
}

static void test_concurrent(void) {
    mlxcel_model *model = load_default();
    const char *prompts[2] = {"The capital of France is", "Once upon a time"};
    char reference[2][256];
    for (int i = 0; i < 2; i++) {
        Worker w = {.model = model, .prompt = prompts[i]};
        worker(&w);
        CHECK_STATUS(w.status, MLXCEL_OK);
        strcpy(reference[i], w.out);
    }
    Worker workers[4];
    pthread_t threads[4];
    for (int i = 0; i < 4; i++) {
        workers[i] = (Worker){.model = model, .prompt = prompts[i % 2]};
        CHECK(pthread_create(&threads[i], NULL, worker, &workers[i]) == 0);
    }
    for (int i = 0; i < 4; i++) CHECK(pthread_join(threads[i], NULL) == 0);
    for (int i = 0; i < 4; i++) {
        CHECK_STATUS(workers[i].status, MLXCEL_OK);
        printf("thread %d: [%s]\n", i, workers[i].out);
        CHECK(strcmp(workers[i].out, reference[i % 2]) == 0);
    }
    CHECK(strncmp(reference[0], " Paris", 6) == 0);
    CHECK_STATUS(mlxcel_model_free(model), MLXCEL_OK);
    printf("concurrent: ok\n");
}

/* mlxcel_generate_batch: four prompts as one batch give each the text it
 * gets alone; a bad row fails alone, a repeated context is refused. */
static void test_batch(void) {
    mlxcel_model *model = load_default();
    const char *prompts[4] = {"The capital of France is", "Once upon a time", "def fibonacci(n):",
                              "The largest planet is"};
    mlxcel_context *ctx[4];
    char alone[4][512];
    for (int i = 0; i < 4; i++) {
        CHECK_STATUS(mlxcel_context_new(model, &ctx[i]), MLXCEL_OK);
        CHECK_STATUS(mlxcel_generate(ctx[i], prompts[i], greedy(16), NULL, NULL, alone[i], sizeof alone[i], NULL),
                     MLXCEL_OK);
    }
    mlxcel_status statuses[4];
    mlxcel_generation_result results[4];
    CHECK_STATUS(mlxcel_generate_batch(ctx, prompts, 4, greedy(16), statuses, results), MLXCEL_OK);
    for (int i = 0; i < 4; i++) {
        char text[512];
        size_t len = 0;
        CHECK_STATUS(statuses[i], MLXCEL_OK);
        CHECK(results[i].generated_tokens == 16 || results[i].finish_reason == MLXCEL_FINISH_STOP);
        CHECK_STATUS(mlxcel_context_text(ctx[i], text, sizeof text, &len), MLXCEL_OK);
        printf("row %d: [%s]\n", i, text);
        CHECK(strcmp(text, alone[i]) == 0);
    }
    /* A prompt too long for the model fails alone; the others succeed. */
    size_t long_len = 9000 * 4;
    char *long_prompt = malloc(long_len + 1);
    for (size_t i = 0; i < long_len; i += 4) memcpy(long_prompt + i, " ok ", 4);
    long_prompt[long_len] = '\0';
    const char *mixed[3] = {prompts[0], long_prompt, prompts[1]};
    CHECK_STATUS(mlxcel_generate_batch(ctx, mixed, 3, greedy(16), statuses, results), MLXCEL_ERR_PROMPT_TOO_LONG);
    CHECK_ERROR_MENTIONS("context");
    CHECK_STATUS(statuses[0], MLXCEL_OK);
    CHECK_STATUS(statuses[1], MLXCEL_ERR_PROMPT_TOO_LONG);
    CHECK_STATUS(statuses[2], MLXCEL_OK);
    free(long_prompt);
    mlxcel_context *twice[2] = {ctx[0], ctx[0]};
    CHECK_STATUS(mlxcel_generate_batch(twice, prompts, 2, greedy(4), NULL, NULL), MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("same context");
    CHECK_STATUS(mlxcel_generate_batch(NULL, prompts, 2, greedy(4), NULL, NULL), MLXCEL_ERR_NULL_POINTER);
    CHECK_STATUS(mlxcel_generate_batch(NULL, NULL, 0, greedy(4), NULL, NULL), MLXCEL_OK);
    for (int i = 0; i < 4; i++) CHECK_STATUS(mlxcel_context_free(ctx[i]), MLXCEL_OK);
    CHECK_STATUS(mlxcel_model_free(model), MLXCEL_OK);
    printf("batch: ok\n");
}

/* The KV pool's budget: too small a budget is refused at load; a request
 * larger than the whole pool fails alone with MLXCEL_ERR_KV_POOL_TOO_SMALL;
 * requests that fit only one at a time all complete, as alone. */
static void test_pool(void) {
    mlxcel_model_params mp = mlxcel_model_default_params();
    CHECK(mp.kv_pool_bytes == 0);
    mlxcel_model *model = NULL;
    mp.kv_pool_bytes = 1000;
    CHECK_STATUS(mlxcel_model_load(mp, &model), MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("kv_pool_bytes");
    CHECK(model == NULL);
    /* 8 MiB: 11 blocks of 16 positions for SmolLM2-135M (720 KiB each). */
    mp.kv_pool_bytes = 8u << 20;
    CHECK_STATUS(mlxcel_model_load(mp, &model), MLXCEL_OK);
    mlxcel_context *ctx[2];
    for (int i = 0; i < 2; i++) CHECK_STATUS(mlxcel_context_new(model, &ctx[i]), MLXCEL_OK);
    char text[2048];
    CHECK_STATUS(mlxcel_generate(ctx[0], "Once upon a time", greedy(400), NULL, NULL, text, sizeof text, NULL),
                 MLXCEL_ERR_KV_POOL_TOO_SMALL);
    CHECK_ERROR_MENTIONS("KV pool");
    CHECK(strcmp(mlxcel_status_string(MLXCEL_ERR_KV_POOL_TOO_SMALL), "KV pool too small") == 0);
    /* Each needs 6 blocks of 11: the second waits for the first. */
    const char *prompts[2] = {"Once upon a time", "The capital of France is"};
    char alone[2][2048];
    mlxcel_generate_params params = greedy(90);
    for (int i = 0; i < 2; i++) {
        CHECK_STATUS(mlxcel_generate(ctx[i], prompts[i], params, NULL, NULL, alone[i], sizeof alone[i], NULL), MLXCEL_OK);
    }
    mlxcel_status statuses[2];
    mlxcel_generation_result results[2];
    CHECK_STATUS(mlxcel_generate_batch(ctx, prompts, 2, params, statuses, results), MLXCEL_OK);
    for (int i = 0; i < 2; i++) {
        size_t len = 0;
        CHECK_STATUS(statuses[i], MLXCEL_OK);
        CHECK(results[i].generated_tokens == 90 || results[i].finish_reason == MLXCEL_FINISH_STOP);
        CHECK_STATUS(mlxcel_context_text(ctx[i], text, sizeof text, &len), MLXCEL_OK);
        CHECK(strcmp(text, alone[i]) == 0);
    }
    for (int i = 0; i < 2; i++) CHECK_STATUS(mlxcel_context_free(ctx[i]), MLXCEL_OK);
    CHECK_STATUS(mlxcel_model_free(model), MLXCEL_OK);

    /* A rotating cache: not larger than kv_keep is refused; 90 positions run. */
    mp = mlxcel_model_default_params();
    CHECK(mp.max_kv_size == 0 && mp.kv_keep == 4);
    mp.max_kv_size = 4;
    CHECK_STATUS(mlxcel_model_load(mp, &model), MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("max_kv_size");
    CHECK(model == NULL);
    mp.max_kv_size = 90;
    CHECK_STATUS(mlxcel_model_load(mp, &model), MLXCEL_OK);
    CHECK_STATUS(mlxcel_context_new(model, &ctx[0]), MLXCEL_OK);
    mlxcel_generation_result r;
    CHECK_STATUS(mlxcel_generate(ctx[0], "Once upon a time", greedy(150), NULL, NULL, text, sizeof text, &r), MLXCEL_OK);
    CHECK(r.generated_tokens == 150 || r.finish_reason == MLXCEL_FINISH_STOP);
    CHECK_STATUS(mlxcel_context_free(ctx[0]), MLXCEL_OK);
    CHECK_STATUS(mlxcel_model_free(model), MLXCEL_OK);

    /* 8-bit keys and values: other widths are refused; a 2 MiB pool holds 2
       f32 blocks (too few for 100 tokens) but 10 of 8 bits. */
    mp = mlxcel_model_default_params();
    CHECK(mp.kv_bits == 0);
    mp.kv_bits = 4;
    CHECK_STATUS(mlxcel_model_load(mp, &model), MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("kv_bits");
    CHECK(model == NULL);
    for (int bits = 0; bits <= 8; bits += 8) {
        mp.kv_bits = (uint32_t)bits;
        mp.kv_pool_bytes = 2u << 20;
        CHECK_STATUS(mlxcel_model_load(mp, &model), MLXCEL_OK);
        CHECK_STATUS(mlxcel_context_new(model, &ctx[0]), MLXCEL_OK);
        mlxcel_status st = mlxcel_generate(ctx[0], "Once upon a time", greedy(100), NULL, NULL, text, sizeof text, &r);
        if (bits == 0) {
            CHECK_STATUS(st, MLXCEL_ERR_KV_POOL_TOO_SMALL);
        } else {
            CHECK_STATUS(st, MLXCEL_OK);
            CHECK(r.generated_tokens == 100 || r.finish_reason == MLXCEL_FINISH_STOP);
        }
        CHECK_STATUS(mlxcel_context_free(ctx[0]), MLXCEL_OK);
        CHECK_STATUS(mlxcel_model_free(model), MLXCEL_OK);
    }

    /* Quantizing at load (ABI 7.0): off by default; bad bits or groups, or a
       group without bits, are refused by name; the default model is already
       quantized, which fails the load. */
    mp = mlxcel_model_default_params();
    CHECK(mp.q_bits == 0 && mp.q_group_size == 0);
    const struct { uint32_t bits, group; const char *name; } bad[] = {
        {7, 0, "q_bits"}, {1, 64, "q_bits"}, {4, 48, "q_group_size"}, {0, 64, "q_group_size"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        mp.q_bits = bad[i].bits;
        mp.q_group_size = bad[i].group;
        CHECK_STATUS(mlxcel_model_load(mp, &model), MLXCEL_ERR_INVALID_ARGUMENT);
        CHECK_ERROR_MENTIONS(bad[i].name);
        CHECK(model == NULL);
    }
    mp.q_bits = 4;
    mp.q_group_size = 32;
    CHECK_STATUS(mlxcel_model_load(mp, &model), MLXCEL_ERR_MODEL_LOAD);
    CHECK_ERROR_MENTIONS("already quantized");
    CHECK(model == NULL);
    printf("pool: ok\n");
}

/* Speculative decoding: greedy tokens with prompt lookup, and with a draft
 * model (the model itself, which has its tokenizer), are those of plain
 * decoding; bad methods, lengths and draft model paths are refused. */
static void test_speculation(void) {
    mlxcel_generate_params d = mlxcel_generate_default_params();
    CHECK(d.speculation == NULL && d.draft_max == 8 && d.draft_min == 0);
    CHECK(mlxcel_model_default_params().draft_model == NULL);
    mlxcel_model *model = load_default();
    mlxcel_context *ctx = NULL;
    CHECK_STATUS(mlxcel_context_new(model, &ctx), MLXCEL_OK);
    const char *prompt = "<ul><li>one</li><li>two</li><li>three</li><li>";  /* drafts from its own text */
    char plain[1024], spec[1024];
    int32_t plain_ids[64], spec_ids[64];
    size_t n_plain = 0, n_spec = 0;
    mlxcel_generation_result r;
    CHECK_STATUS(mlxcel_generate(ctx, prompt, greedy(32), NULL, NULL, plain, sizeof plain, &r), MLXCEL_OK);
    CHECK(r.draft_tokens == 0 && r.accepted_tokens == 0);
    CHECK_STATUS(mlxcel_context_tokens(ctx, plain_ids, 64, &n_plain), MLXCEL_OK);

    mlxcel_generate_params p = greedy(32);
    p.speculation = "prompt-lookup";
    CHECK_STATUS(mlxcel_generate(ctx, prompt, p, NULL, NULL, spec, sizeof spec, &r), MLXCEL_OK);
    CHECK_STATUS(mlxcel_context_tokens(ctx, spec_ids, 64, &n_spec), MLXCEL_OK);
    printf("prompt lookup: %zu of %zu draft tokens accepted: [%s]\n", r.accepted_tokens, r.draft_tokens, spec);
    CHECK(strcmp(spec, plain) == 0);
    CHECK(n_spec == n_plain && memcmp(spec_ids, plain_ids, n_plain * sizeof plain_ids[0]) == 0);
    CHECK(r.draft_tokens > 0 && r.accepted_tokens > 0 && r.accepted_tokens <= r.draft_tokens);
    p.speculation = "off";
    CHECK_STATUS(mlxcel_generate(ctx, prompt, p, NULL, NULL, spec, sizeof spec, &r), MLXCEL_OK);
    CHECK(strcmp(spec, plain) == 0 && r.draft_tokens == 0);

    p.speculation = "nonsense";
    CHECK_STATUS(mlxcel_generate(ctx, prompt, p, NULL, NULL, spec, sizeof spec, &r), MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("`speculation`");
    CHECK_ERROR_MENTIONS("nonsense");
    p.speculation = "draft";  /* no draft model loaded */
    CHECK_STATUS(mlxcel_generate(ctx, prompt, p, NULL, NULL, spec, sizeof spec, &r), MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("`speculation`");
    p.speculation = "prompt-lookup";
    p.draft_max = 15;
    CHECK_STATUS(mlxcel_generate(ctx, prompt, p, NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("draft_max");
    p.draft_max = 4;
    p.draft_min = 5;
    CHECK_STATUS(mlxcel_generate(ctx, prompt, p, NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("draft_min");

    /* The model's own directory (from its JSON info) as its draft model:
       it loads and "draft" runs, with the same text (the engine drafts
       little or nothing with a draft as large as the model). */
    char json[8192];
    size_t needed = 0;
    CHECK_STATUS(mlxcel_model_info_json(model, json, sizeof json, &needed), MLXCEL_OK);
    const char *key = strstr(json, "\"directory\":\"");
    CHECK(key != NULL);
    char dir[4096];
    const char *start = key + strlen("\"directory\":\"");
    size_t len = (size_t)(strchr(start, '"') - start);
    CHECK(len < sizeof dir);
    memcpy(dir, start, len);
    dir[len] = '\0';
    mlxcel_model_params mp = mlxcel_model_default_params();
    mlxcel_model *drafted = NULL;
    mp.draft_model = "/nonexistent/mlxcel-draft";
    CHECK_STATUS(mlxcel_model_load(mp, &drafted), MLXCEL_ERR_MODEL_LOAD);
    CHECK_ERROR_MENTIONS("/nonexistent/mlxcel-draft");
    CHECK(drafted == NULL);
    mp.draft_model = dir;
    CHECK_STATUS(mlxcel_model_load(mp, &drafted), MLXCEL_OK);
    mlxcel_context *dctx = NULL;
    CHECK_STATUS(mlxcel_context_new(drafted, &dctx), MLXCEL_OK);
    p = greedy(32);
    p.speculation = "draft";
    CHECK_STATUS(mlxcel_generate(dctx, prompt, p, NULL, NULL, spec, sizeof spec, &r), MLXCEL_OK);
    printf("draft model: %zu of %zu draft tokens accepted\n", r.accepted_tokens, r.draft_tokens);
    CHECK(strcmp(spec, plain) == 0 && r.accepted_tokens <= r.draft_tokens);
    CHECK_STATUS(mlxcel_context_free(dctx), MLXCEL_OK);
    CHECK_STATUS(mlxcel_model_free(drafted), MLXCEL_OK);

    CHECK_STATUS(mlxcel_context_free(ctx), MLXCEL_OK);
    CHECK_STATUS(mlxcel_model_free(model), MLXCEL_OK);
    printf("speculation: ok\n");
}

static bool is_colour_object(const char *text) {
    return strcmp(text, "{\"colour\":\"red\"}") == 0 || strcmp(text, "{\"colour\":\"green\"}") == 0 ||
           strcmp(text, "{\"colour\":\"blue\"}") == 0;
}

/* Structured output: a JSON schema, a regex and a Lark grammar hold, greedy
 * and sampled; a constraint that does not compile, two constraints at once
 * and invalid UTF-8 are refused naming the field. */
static void test_structured(void) {
    mlxcel_generate_params d = mlxcel_generate_default_params();
    CHECK(d.json_schema == NULL && d.regex == NULL && d.grammar == NULL);
    mlxcel_model *model = load_default();
    mlxcel_context *ctx = NULL;
    CHECK_STATUS(mlxcel_context_new(model, &ctx), MLXCEL_OK);
    const char *roles[] = {"user"};
    const char *contents[] = {"What colour is the sky? Answer in JSON."};
    char out[256];
    mlxcel_generation_result r;

    mlxcel_generate_params p = greedy(32);
    p.json_schema = "{\"type\":\"object\",\"properties\":{\"colour\":{\"enum\":[\"red\",\"green\",\"blue\"]}},"
                    "\"required\":[\"colour\"],\"additionalProperties\":false}";
    CHECK_STATUS(mlxcel_generate_chat(ctx, roles, contents, 1, p, NULL, NULL, out, sizeof out, &r), MLXCEL_OK);
    printf("json schema, greedy: [%s] (masks %.3f ms)\n", out, r.mask_seconds * 1e3);
    CHECK(is_colour_object(out) && r.finish_reason == MLXCEL_FINISH_STOP && r.mask_seconds > 0);
    p.temperature = 1.0f;
    p.has_seed = true;
    for (uint64_t seed = 0; seed < 4; seed++) {
        p.seed = seed;
        CHECK_STATUS(mlxcel_generate(ctx, "Pick a colour:", p, NULL, NULL, out, sizeof out, &r), MLXCEL_OK);
        CHECK(is_colour_object(out));
    }
    CHECK_STATUS(mlxcel_generate(ctx, "Pick a colour:", greedy(4), NULL, NULL, out, sizeof out, &r), MLXCEL_OK);
    CHECK(r.mask_seconds == 0);

    p = greedy(16);
    p.regex = "(yes|no)";
    CHECK_STATUS(mlxcel_generate_chat(ctx, roles, contents, 1, p, NULL, NULL, out, sizeof out, &r), MLXCEL_OK);
    CHECK(strcmp(out, "yes") == 0 || strcmp(out, "no") == 0);
    p = greedy(16);
    p.grammar = "start: \"The sky is \" colour \".\"\ncolour: \"red\" | \"green\" | \"blue\"";
    CHECK_STATUS(mlxcel_generate_chat(ctx, roles, contents, 1, p, NULL, NULL, out, sizeof out, &r), MLXCEL_OK);
    printf("grammar: [%s]\n", out);
    CHECK(strcmp(out, "The sky is red.") == 0 || strcmp(out, "The sky is green.") == 0 ||
          strcmp(out, "The sky is blue.") == 0);

    p = greedy(16);
    p.json_schema = "{\"type\": ";
    CHECK_STATUS(mlxcel_generate(ctx, "Hi", p, NULL, NULL, out, sizeof out, &r), MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("`json_schema`");
    CHECK(r.finish_reason == MLXCEL_FINISH_ERROR && out[0] == '\0');
    p = greedy(16);
    p.regex = "(unclosed";
    CHECK_STATUS(mlxcel_generate(ctx, "Hi", p, NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("`regex`");
    p = greedy(16);
    p.grammar = "start: undefined_rule";
    CHECK_STATUS(mlxcel_generate(ctx, "Hi", p, NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("`grammar`");
    p.regex = "a";
    CHECK_STATUS(mlxcel_generate(ctx, "Hi", p, NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK_ERROR_MENTIONS("at most one");
    p = greedy(16);
    p.json_schema = "{\"type\": \"\xff\"}";
    CHECK_STATUS(mlxcel_generate(ctx, "Hi", p, NULL, NULL, NULL, 0, NULL), MLXCEL_ERR_INVALID_UTF8);
    CHECK_ERROR_MENTIONS("`json_schema`");

    CHECK_STATUS(mlxcel_context_free(ctx), MLXCEL_OK);
    CHECK_STATUS(mlxcel_model_free(model), MLXCEL_OK);
    printf("structured: ok\n");
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr,
                "usage: %s errors|buffers|generate|cancel_prefill|cancel_decode|concurrent|batch|pool|speculation|structured\n",
                argv[0]);
        return 2;
    }
    const char *t = argv[1];
    if (strcmp(t, "errors") == 0) test_errors();
    else if (strcmp(t, "buffers") == 0) test_buffers();
    else if (strcmp(t, "generate") == 0) test_generate();
    else if (strcmp(t, "cancel_prefill") == 0) test_cancel_prefill();
    else if (strcmp(t, "cancel_decode") == 0) test_cancel_decode();
    else if (strcmp(t, "batch") == 0) test_batch();
    else if (strcmp(t, "pool") == 0) test_pool();
    else if (strcmp(t, "speculation") == 0) test_speculation();
    else if (strcmp(t, "structured") == 0) test_structured();
    else if (strcmp(t, "concurrent") == 0) test_concurrent();
    else {
        fprintf(stderr, "unknown test %s\n", t);
        return 2;
    }
    return 0;
}
