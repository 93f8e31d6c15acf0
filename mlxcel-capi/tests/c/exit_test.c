/*
 * A C program that ends while another thread is generating must still exit
 * cleanly (status 0, no signal):
 *   exit_test exit|return prefill|decode
 * Main starts a generation on a second pthread, waits until it is inside the
 * prompt (a 4,000-token prompt in one chunk) or decoding, then calls exit(0)
 * or returns from main. The generating thread, once its call returns, frees
 * its handles like any program would. Exit status 3 means the generation
 * ended before main did, so the run proved nothing.
 * Run by mlxcel-capi/tests/c_api.rs.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mlxcel.h"

static atomic_int pieces;
static atomic_int started;
static atomic_int finished;

typedef struct {
    mlxcel_model *model;
    mlxcel_context *ctx;
    const char *prompt;
    mlxcel_generate_params params;
} Run;

static bool on_piece(const char *text, size_t len, int32_t token, void *user_data) {
    (void)text, (void)len, (void)token, (void)user_data;
    atomic_fetch_add(&pieces, 1);
    return true;
}

static void *generate(void *arg) {
    Run *run = arg;
    atomic_store(&started, 1);
    mlxcel_status s = mlxcel_generate(run->ctx, run->prompt, run->params, on_piece, NULL, NULL, 0, NULL);
    atomic_store(&finished, 1);
    fprintf(stderr, "generation returned %s\n", mlxcel_status_string(s));
    mlxcel_context_free(run->ctx);
    mlxcel_model_free(run->model);
    return NULL;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

int main(int argc, char **argv) {
    if (argc != 3 || (strcmp(argv[1], "exit") != 0 && strcmp(argv[1], "return") != 0) ||
        (strcmp(argv[2], "prefill") != 0 && strcmp(argv[2], "decode") != 0)) {
        fprintf(stderr, "usage: %s exit|return prefill|decode\n", argv[0]);
        return 2;
    }
    bool in_prefill = strcmp(argv[2], "prefill") == 0;
    static Run run;
    if (mlxcel_model_load(mlxcel_model_default_params(), &run.model) != MLXCEL_OK ||
        mlxcel_context_new(run.model, &run.ctx) != MLXCEL_OK) {
        fprintf(stderr, "setup failed: %s\n", mlxcel_last_error());
        return 1;
    }
    run.params = mlxcel_generate_default_params();
    static char long_prompt[32 * 1024];
    if (in_prefill) {
        /* ~4,000 tokens evaluated as one chunk: seconds inside MLX. */
        for (int i = 0; i < 500; i++) strcat(long_prompt, "the quick brown fox ");
        run.prompt = long_prompt;
        run.params.prefill_chunk = 4096;
        run.params.max_tokens = 8;
    } else {
        run.prompt = "1, 2, 3, 4, 5, 6, 7, 8,";
        run.params.max_tokens = 4096;
    }
    pthread_t thread;
    if (pthread_create(&thread, NULL, generate, &run) != 0) return 1;
    while (!atomic_load(&started)) sleep_ms(1);
    if (in_prefill) {
        sleep_ms(300);
    } else {
        while (atomic_load(&pieces) < 3 && !atomic_load(&finished)) sleep_ms(1);
    }
    if (atomic_load(&finished) || (in_prefill && atomic_load(&pieces) > 0)) {
        fprintf(stderr, "the generation left the %s before main ended\n", argv[2]);
        return 3;
    }
    printf("ending main by %s during %s (%d pieces so far)\n", argv[1], argv[2], atomic_load(&pieces));
    fflush(stdout);
    if (strcmp(argv[1], "exit") == 0) exit(0);
    return 0;
}
