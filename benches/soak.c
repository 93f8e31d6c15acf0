/*
 * soak.c: many requests through the C ABI on one model: generated to the
 * end, stopped by the callback after their first piece, cancelled from
 * another thread, on fresh and reused contexts, with the process's RSS and
 * thread count at checkpoints. Memory and threads must plateau.
 *
 *   cargo build --release -p mlxcel-capi
 *   cc -std=c11 -O2 -I include benches/soak.c -L target/release -lmlxcel -lpthread \
 *      -Wl,-rpath,$PWD/target/release -o /tmp/soak && /tmp/soak [requests=5000] [every=500]
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mlxcel.h"

static long status_kib(const char *key) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long value = 0;
    size_t n = strlen(key);
    while (f && fgets(line, sizeof line, f)) {
        if (strncmp(line, key, n) == 0) value = atol(line + n);
    }
    if (f) fclose(f);
    return value;
}

static bool stop_after_first(const char *text, size_t len, int32_t token, void *user_data) {
    (void)text, (void)len, (void)token, (void)user_data;
    return false;
}

static void *cancel_soon(void *ctx) {
    struct timespec ts = {0, 3 * 1000 * 1000};
    nanosleep(&ts, NULL);
    mlxcel_cancel(ctx);
    return NULL;
}

int main(int argc, char **argv) {
    int requests = argc > 1 ? atoi(argv[1]) : 5000, every = argc > 2 ? atoi(argv[2]) : 500;
    mlxcel_model *model = NULL;
    if (mlxcel_model_load(mlxcel_model_default_params(), &model) != MLXCEL_OK) {
        fprintf(stderr, "load: %s\n", mlxcel_last_error());
        return 1;
    }
    const char *prompts[4] = {"The capital of France is", "def add(a, b):", "Once upon a time", "Water boils at"};
    mlxcel_context *reused = NULL;
    mlxcel_context_new(model, &reused);
    double first_rss = 0, half_rss = 0, last_rss = 0;
    long first_threads = 0, last_threads = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 1; i <= requests; i++) {
        mlxcel_generate_params params = mlxcel_generate_default_params();
        params.max_tokens = i % 4 == 0 ? 4 : 64;
        char prompt[128];
        snprintf(prompt, sizeof prompt, "%s (%d)", prompts[i % 4], i);
        mlxcel_context *ctx = reused;
        if (i % 2) mlxcel_context_new(model, &ctx); /* half on fresh contexts */
        mlxcel_status status;
        if (i % 4 == 0) {
            status = mlxcel_generate(ctx, prompt, params, NULL, NULL, NULL, 0, NULL);
        } else if (i % 4 == 1 || i % 4 == 2) {
            status = mlxcel_generate(ctx, prompt, params, stop_after_first, NULL, NULL, 0, NULL);
        } else {
            pthread_t canceller;
            pthread_create(&canceller, NULL, cancel_soon, ctx);
            status = mlxcel_generate(ctx, prompt, params, NULL, NULL, NULL, 0, NULL);
            pthread_join(canceller, NULL);
        }
        if (status != MLXCEL_OK && status != MLXCEL_CANCELLED) {
            fprintf(stderr, "request %d: %s: %s\n", i, mlxcel_status_string(status), mlxcel_last_error());
            return 1;
        }
        if (ctx != reused) mlxcel_context_free(ctx);
        if (i % every == 0) {
            clock_gettime(CLOCK_MONOTONIC, &t1);
            double rss = status_kib("VmRSS:") / 1024.0;
            long threads = status_kib("Threads:");
            if (i == every) first_rss = rss, first_threads = threads;
            if (i == requests / 2 / every * every) half_rss = rss;
            last_rss = rss, last_threads = threads;
            printf("{\"requests\": %d, \"rss_mib\": %.1f, \"threads\": %ld, \"seconds\": %.1f}\n", i, rss, threads,
                   (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9);
            fflush(stdout);
        }
    }
    printf("{\"binding\": \"c\", \"requests\": %d, \"rss_first_mib\": %.1f, \"rss_growth_last_half_mib\": %.1f, "
           "\"threads_first_last\": [%ld, %ld]}\n",
           requests, first_rss, last_rss - half_rss, first_threads, last_threads);
    mlxcel_context_free(reused);
    mlxcel_model_free(model);
    return 0;
}
