/*
 * vision.c: chat messages with image parts through libmlxcel (ABI 7.1), on
 * the tiny random SmolVLM checkpoint (mlxcel-models/tests/data/tiny/smolvlm).
 *
 *   ./vision DIR TOKENS
 *
 * TOKENS is the reference's 16 greedy tokens, comma-separated (golden.json,
 * the same for both of its cases). Checks them from image paths and from
 * image bytes, then every error case, then an image for the text-only
 * default model. Prints "vision: ok". Run by mlxcel-capi/tests/c_api.rs.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mlxcel.h"

#define CHECK(cond)                                                                   \
    do {                                                                              \
        if (!(cond)) {                                                                \
            fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, \
                    __LINE__, #cond, mlxcel_last_error());                            \
            exit(1);                                                                  \
        }                                                                             \
    } while (0)

static int32_t want[16];
static size_t n_want;

static unsigned char *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    CHECK(f != NULL);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *data = malloc((size_t)size);
    CHECK(fread(data, 1, (size_t)size, f) == (size_t)size);
    fclose(f);
    *n = (size_t)size;
    return data;
}

static mlxcel_status run(mlxcel_context *ctx, const mlxcel_message *messages, size_t n) {
    mlxcel_generate_params p = mlxcel_generate_default_params();
    p.max_tokens = (int32_t)n_want;
    mlxcel_generation_result r;
    return mlxcel_generate_messages(ctx, messages, n, p, NULL, NULL, NULL, 0, &r);
}

/* The run's tokens are the reference's. */
static void check_tokens(mlxcel_context *ctx) {
    int32_t got[64];
    size_t n = 0;
    CHECK(mlxcel_context_tokens(ctx, got, 64, &n) == MLXCEL_OK);
    CHECK(n == n_want);
    for (size_t i = 0; i < n; i++) {
        CHECK(got[i] == want[i]);
    }
}

static mlxcel_content_part text_part(const char *text) {
    mlxcel_content_part p = {0};
    p.type = MLXCEL_CONTENT_TEXT;
    p.text = text;
    return p;
}

static mlxcel_content_part path_part(const char *path) {
    mlxcel_content_part p = {0};
    p.type = MLXCEL_CONTENT_IMAGE_PATH;
    p.path = path;
    return p;
}

static mlxcel_content_part bytes_part(const unsigned char *data, size_t n) {
    mlxcel_content_part p = {0};
    p.type = MLXCEL_CONTENT_IMAGE_BYTES;
    p.data = data;
    p.n_bytes = n;
    return p;
}

/* A failed run with `status` whose message contains `needle`. */
static void check_error(mlxcel_context *ctx, mlxcel_content_part image, mlxcel_status status, const char *needle) {
    mlxcel_content_part parts[2] = {image, text_part("Hi")};
    mlxcel_message m = {"user", NULL, parts, 2};
    mlxcel_status s = run(ctx, &m, 1);
    if (s != status || strstr(mlxcel_last_error(), needle) == NULL) {
        fprintf(stderr, "expected %s with \"%s\", got %s: %s\n", mlxcel_status_string(status), needle,
                mlxcel_status_string(s), mlxcel_last_error());
        exit(1);
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s SMOLVLM_DIR TOKENS\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    for (char *t = strtok(argv[2], ","); t && n_want < 16; t = strtok(NULL, ",")) {
        want[n_want++] = atoi(t);
    }
    char landscape[4096], portrait[4096], square[4096];
    snprintf(landscape, sizeof landscape, "%s/images/landscape.png", dir);
    snprintf(portrait, sizeof portrait, "%s/images/portrait.jpg", dir);
    snprintf(square, sizeof square, "%s/images/square_rgba.png", dir);

    mlxcel_model_params mp = mlxcel_model_default_params();
    mp.path = dir;
    mlxcel_model *model;
    CHECK(mlxcel_model_load(mp, &model) == MLXCEL_OK);
    bool images = false;
    CHECK(mlxcel_model_supports_images(model, &images) == MLXCEL_OK && images);
    CHECK(mlxcel_model_supports_images(model, NULL) == MLXCEL_ERR_NULL_POINTER);
    mlxcel_context *ctx;
    CHECK(mlxcel_context_new(model, &ctx) == MLXCEL_OK);

    /* golden.json's cases: one image, then two images within text. */
    mlxcel_content_part one[2] = {path_part(landscape), text_part("Describe this image.")};
    mlxcel_message m1 = {"user", NULL, one, 2};
    CHECK(run(ctx, &m1, 1) == MLXCEL_OK);
    check_tokens(ctx);
    mlxcel_content_part two[5] = {text_part("Compare "), path_part(portrait), text_part(" and "), path_part(square),
                                  text_part(".")};
    mlxcel_message m2 = {"user", NULL, two, 5};
    CHECK(run(ctx, &m2, 1) == MLXCEL_OK);
    check_tokens(ctx);
    /* The same image as bytes. */
    size_t n_png;
    unsigned char *png = read_file(landscape, &n_png);
    one[0] = bytes_part(png, n_png);
    CHECK(run(ctx, &m1, 1) == MLXCEL_OK);
    check_tokens(ctx);
    /* Text content and text parts still work. */
    mlxcel_message plain[2] = {{"system", "Be brief.", NULL, 0}, {"user", NULL, one + 1, 1}};
    CHECK(run(ctx, plain, 2) == MLXCEL_OK);

    /* Errors. */
    check_error(ctx, bytes_part(NULL, 10), MLXCEL_ERR_NULL_POINTER, "messages[0].parts[0].data");
    check_error(ctx, bytes_part((const unsigned char *)"not an image", 12), MLXCEL_ERR_INVALID_ARGUMENT,
                "invalid parameter `images`");
    check_error(ctx, bytes_part(png, n_png / 3), MLXCEL_ERR_INVALID_ARGUMENT, "`images`");
    check_error(ctx, bytes_part(NULL, 0), MLXCEL_ERR_INVALID_ARGUMENT, "empty");
    check_error(ctx, path_part("/no/such/file.png"), MLXCEL_ERR_INVALID_ARGUMENT, "/no/such/file.png");
    check_error(ctx, path_part(NULL), MLXCEL_ERR_NULL_POINTER, "messages[0].parts[0].path");
    mlxcel_content_part odd = {0};
    odd.type = 7;
    check_error(ctx, odd, MLXCEL_ERR_INVALID_ARGUMENT, "messages[0].parts[0].type");
    mlxcel_message both = {"user", "text", one, 2};
    CHECK(run(ctx, &both, 1) == MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(mlxcel_last_error(), "both") != NULL);
    mlxcel_message no_role = {NULL, "text", NULL, 0};
    CHECK(run(ctx, &no_role, 1) == MLXCEL_ERR_NULL_POINTER);
    CHECK(run(ctx, NULL, 1) == MLXCEL_ERR_NULL_POINTER);
    /* The context is still usable. */
    one[0] = bytes_part(png, n_png);
    CHECK(run(ctx, &m1, 1) == MLXCEL_OK);
    check_tokens(ctx);
    mlxcel_context_free(ctx);
    mlxcel_model_free(model);

    /* The text-only default model names its architecture. */
    CHECK(mlxcel_model_load(mlxcel_model_default_params(), &model) == MLXCEL_OK);
    CHECK(mlxcel_model_supports_images(model, &images) == MLXCEL_OK && !images);
    CHECK(mlxcel_context_new(model, &ctx) == MLXCEL_OK);
    check_error(ctx, bytes_part(png, n_png), MLXCEL_ERR_INVALID_ARGUMENT, "`llama`, a text-only architecture");
    mlxcel_context_free(ctx);
    mlxcel_model_free(model);
    free(png);
    printf("vision: ok\n");
    return 0;
}
