/*
 * generate.c: stream a continuation of a prompt with libmlxcel.
 *
 *   cargo build --release -p mlxcel-capi
 *   cc -std=c11 -I include examples/c/generate.c -L target/release -lmlxcel \
 *      -Wl,-rpath,$PWD/target/release -o generate
 *   ./generate [--model DIR] [--max-tokens N] [--temp T] [--seed S] [--chat] "The capital of France is"
 *
 * Without --model it uses the default model (SmolLM2-135M-Instruct), fetched
 * on first use. Text goes to stdout as it is generated, stats to stderr.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mlxcel.h"

static bool on_piece(const char *text, size_t len, int32_t token, void *user_data) {
    (void)token;
    (void)user_data;
    fwrite(text, 1, len, stdout);
    fflush(stdout);
    return true;
}

static int fail(const char *what, mlxcel_status status) {
    fprintf(stderr, "%s: %s (%d): %s\n", what, mlxcel_status_string(status), status, mlxcel_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if ((mlxcel_abi_version() >> 16) != MLXCEL_ABI_VERSION_MAJOR) {
        fprintf(stderr, "libmlxcel ABI %u.%u does not match the header's %d.%d\n", mlxcel_abi_version() >> 16,
                mlxcel_abi_version() & 0xffff, MLXCEL_ABI_VERSION_MAJOR, MLXCEL_ABI_VERSION_MINOR);
        return 1;
    }
    mlxcel_model_params model_params = mlxcel_model_default_params();
    mlxcel_generate_params params = mlxcel_generate_default_params();
    params.max_tokens = 64;
    bool chat = false;
    const char *prompt = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--model") == 0 && i + 1 < argc) {
            model_params.path = argv[++i];
        } else if (strcmp(argv[i], "--max-tokens") == 0 && i + 1 < argc) {
            params.max_tokens = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--temp") == 0 && i + 1 < argc) {
            params.temperature = (float)atof(argv[++i]);
        } else if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc) {
            params.seed = strtoull(argv[++i], NULL, 10);
            params.has_seed = true;
        } else if (strcmp(argv[i], "--chat") == 0) {
            chat = true;
        } else if (argv[i][0] != '-' && prompt == NULL) {
            prompt = argv[i];
        } else {
            fprintf(stderr, "usage: %s [--model DIR] [--max-tokens N] [--temp T] [--seed S] [--chat] PROMPT\n", argv[0]);
            return 2;
        }
    }
    if (prompt == NULL) {
        fprintf(stderr, "usage: %s [--model DIR] [--max-tokens N] [--temp T] [--seed S] [--chat] PROMPT\n", argv[0]);
        return 2;
    }

    mlxcel_model *model = NULL;
    mlxcel_status status = mlxcel_model_load(model_params, &model);
    if (status != MLXCEL_OK) {
        return fail("loading the model", status);
    }
    mlxcel_model_info info;
    if (mlxcel_model_get_info(model, &info) == MLXCEL_OK) {
        fprintf(stderr, "mlxcel %s: %s, %llu parameters, %.2f bits/weight\n", mlxcel_version(), info.architecture,
                (unsigned long long)info.parameters, info.bits_per_weight);
    }
    mlxcel_context *ctx = NULL;
    status = mlxcel_context_new(model, &ctx);
    if (status != MLXCEL_OK) {
        mlxcel_model_free(model);
        return fail("creating a context", status);
    }

    mlxcel_generation_result result;
    if (chat) {
        const char *roles[] = {"user"};
        const char *contents[] = {prompt};
        status = mlxcel_generate_chat(ctx, roles, contents, 1, params, on_piece, NULL, NULL, 0, &result);
    } else {
        status = mlxcel_generate(ctx, prompt, params, on_piece, NULL, NULL, 0, &result);
    }
    printf("\n");
    int rc = 0;
    if (status < 0) {
        rc = fail("generating", status);
    } else {
        static const char *reasons[] = {"stop", "length", "cancelled", "callback", "error"};
        fprintf(stderr, "prompt: %zu tokens | generated: %zu tokens in %.2f s | finish: %s\n", result.prompt_tokens,
                result.generated_tokens, result.prompt_seconds + result.decode_seconds,
                reasons[result.finish_reason]);
    }
    mlxcel_context_free(ctx);
    mlxcel_model_free(model);
    return rc;
}
