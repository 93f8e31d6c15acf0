/*
 * embed.c: embed two sentences with libmlxcel and print their cosine similarity.
 *
 *   cargo build --release -p mlxcel-capi
 *   cc -std=c11 -I include mlxcel-capi/tests/c/embed.c -L target/release -lmlxcel -lm \
 *      -Wl,-rpath,$PWD/target/release -o embed
 *   ./embed [--model DIR|NAME] "The quick brown fox jumps over the lazy dog." "A fast auburn fox leaps above a sleepy hound."
 *
 * Without --model it uses the packaged all-MiniLM-L6-v2, fetched on first
 * use. The cosine goes to stdout, the model's shape and token counts to
 * stderr. Run by mlxcel-capi/tests/c_api.rs.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mlxcel.h"

static int fail(const char *what, mlxcel_status status) {
    fprintf(stderr, "%s: %s (%d): %s\n", what, mlxcel_status_string(status), status, mlxcel_last_error());
    return 1;
}

int main(int argc, char **argv) {
    /* The embedding functions (new in ABI 6.1) are in every library of this header's major. */
    uint32_t abi = mlxcel_abi_version();
    if ((abi >> 16) != MLXCEL_ABI_VERSION_MAJOR) {
        fprintf(stderr, "libmlxcel ABI %u.%u does not match the header's %d.%d\n", abi >> 16, abi & 0xffff,
                MLXCEL_ABI_VERSION_MAJOR, MLXCEL_ABI_VERSION_MINOR);
        return 1;
    }
    const char *path = NULL; /* NULL: all-MiniLM-L6-v2 */
    const char *texts[2];
    size_t n_texts = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--model") == 0 && i + 1 < argc) {
            path = argv[++i];
        } else if (n_texts < 2) {
            texts[n_texts++] = argv[i];
        } else {
            n_texts = 3;
        }
    }
    if (n_texts != 2) {
        fprintf(stderr, "usage: %s [--model DIR|NAME] SENTENCE_A SENTENCE_B\n", argv[0]);
        return 2;
    }

    mlxcel_embedder *embedder = NULL;
    mlxcel_status status = mlxcel_embedder_load(path, &embedder);
    if (status != MLXCEL_OK) {
        return fail("loading the embedder", status);
    }
    size_t dims = 0, max_tokens = 0;
    mlxcel_embedder_dims(embedder, &dims);
    mlxcel_embedder_max_tokens(embedder, &max_tokens);

    float *vectors = malloc(2 * dims * sizeof *vectors);
    size_t tokens[2];
    if (vectors == NULL) {
        mlxcel_embedder_free(embedder);
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    status = mlxcel_embed(embedder, texts, 2, vectors, 2 * dims, tokens);
    if (status != MLXCEL_OK) {
        free(vectors);
        mlxcel_embedder_free(embedder);
        return fail("embedding", status);
    }
    fprintf(stderr, "%zu dims (at most %zu tokens a text); tokens: %zu and %zu\n", dims, max_tokens, tokens[0],
            tokens[1]);

    const float *a = vectors, *b = vectors + dims;
    double dot = 0, aa = 0, bb = 0;
    for (size_t i = 0; i < dims; i++) {
        dot += (double)a[i] * b[i];
        aa += (double)a[i] * a[i];
        bb += (double)b[i] * b[i];
    }
    printf("cosine: %.9f\n", dot / (sqrt(aa) * sqrt(bb)));

    free(vectors);
    mlxcel_embedder_free(embedder);
    return 0;
}
