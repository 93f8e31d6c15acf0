/*
 * A C program that ends while another thread is generating must still exit
 * cleanly (status 0, no signal):
 *   exit_test exit|return prefill|decode
 * Main starts a generation on a second pthread, waits until it is inside the
 * prompt (a 4,000-token prompt) or decoding, then calls exit(0)
 * or returns from main. The generating thread, once its call returns, frees
 * its handles like any program would. An exit handler of the program's own,
 * registered before the model is loaded and so run after mlxcel's, checks
 * what docs/c-api.md promises: the generation has returned MLXCEL_CANCELLED,
 * new calls get MLXCEL_ERR_EXITING, frees succeed. Exit status 3 means the
 * generation ended before main did, so the run proved nothing; 4 and up, a
 * broken promise.
 * Run by mlxcel-capi/tests/c_api.rs.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mlxcel.h"

static atomic_int pieces;
static atomic_int started;
static atomic_int finished;
static atomic_int freed;
static atomic_int generate_status;
static atomic_int free_status;

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
    atomic_store(&generate_status, mlxcel_generate(run->ctx, run->prompt, run->params, on_piece, NULL, NULL, 0, NULL));
    atomic_store(&finished, 1);
    mlxcel_status a = mlxcel_context_free(run->ctx);
    mlxcel_status b = mlxcel_model_free(run->model);
    atomic_store(&free_status, a != MLXCEL_OK ? a : b);
    atomic_store(&freed, 1);
    return NULL;
}

static void sleep_ms(int ms);
static Run run;

/* Waits up to 2 s for flag; the other thread may need a moment to be scheduled. */
static bool wait_for(atomic_int *flag) {
    for (int i = 0; i < 2000 && !atomic_load(flag); i++) sleep_ms(1);
    return atomic_load(flag);
}

static void check_at_exit(void) {
    if (!wait_for(&finished)) {
        fprintf(stderr, "at exit: the generation is still running\n");
        _exit(4);
    }
    if (atomic_load(&generate_status) != MLXCEL_CANCELLED) {
        fprintf(stderr, "at exit: the generation returned %s, not cancelled\n",
                mlxcel_status_string(atomic_load(&generate_status)));
        _exit(5);
    }
    mlxcel_status s = mlxcel_cancel(run.ctx);
    if (s != MLXCEL_ERR_EXITING || strstr(mlxcel_last_error(), "exiting") == NULL) {
        fprintf(stderr, "at exit: a new call returned %s (%s), not MLXCEL_ERR_EXITING\n", mlxcel_status_string(s),
                mlxcel_last_error());
        _exit(6);
    }
    if (!wait_for(&freed) || atomic_load(&free_status) != MLXCEL_OK) {
        fprintf(stderr, "at exit: freeing the handles failed\n");
        _exit(7);
    }
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
    atexit(check_at_exit);
    if (mlxcel_model_load(mlxcel_model_default_params(), &run.model) != MLXCEL_OK ||
        mlxcel_context_new(run.model, &run.ctx) != MLXCEL_OK) {
        fprintf(stderr, "setup failed: %s\n", mlxcel_last_error());
        return 1;
    }
    run.params = mlxcel_generate_default_params();
    static char long_prompt[32 * 1024];
    if (in_prefill) {
        /* ~4,000 tokens in chunks of 256: seconds inside MLX, cancellable between chunks. */
        for (int i = 0; i < 500; i++) strcat(long_prompt, "the quick brown fox ");
        run.prompt = long_prompt;
        run.params.prefill_chunk = 256;
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
