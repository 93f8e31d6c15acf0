/*
 * transcribe.c: speech to text through libmlxcel's transcription functions
 * (ABI 7.1), run by mlxcel-capi/tests/c_api.rs on the packaged whisper-tiny.en.
 *
 *   cc -std=c11 -I include mlxcel-capi/tests/c/transcribe.c -L target/release -lmlxcel -lpthread \
 *      -Wl,-rpath,$PWD/target/release -o transcribe
 *   ./transcribe FILE                  print the transcription of FILE (text, then one line a segment)
 *   ./transcribe --test FIXTURE_DIR    the checks below; prints "transcribe: ok"
 *
 * The checks: tests/fixtures/audio/en_fox_us.flac from its path and from its
 * bytes in memory; en_mono_16k.wav's samples (parsed here, int16 / 32768)
 * from memory; the results' info, segments, text and tokens with the buffer
 * contract; two threads transcribing at once with one transcriber; and the
 * error cases (NULL pointers, invalid and freed handles, bad audio, invalid
 * UTF-8, out-of-range parameters, an English-only model asked to translate).
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mlxcel.h"

static const char *FOX = " The quick brown fox jump over the lazy nog.";
static const char *WAV = " This file is a plain 16 bit frame file.";

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
                    mlxcel_last_error());                                                          \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static unsigned char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        fprintf(stderr, "cannot open %s\n", path);
        exit(1);
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *data = malloc((size_t)n);
    CHECK(data != NULL && fread(data, 1, (size_t)n, f) == (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return data;
}

/* The samples of a 16-bit PCM mono WAV file, as int16 / 32768. */
static float *wav_samples(const char *path, size_t *n_samples) {
    size_t len;
    unsigned char *data = read_file(path, &len);
    CHECK(len > 12 && memcmp(data, "RIFF", 4) == 0 && memcmp(data + 8, "WAVE", 4) == 0);
    size_t at = 12;
    while (at + 8 <= len) {
        size_t size = data[at + 4] | data[at + 5] << 8 | data[at + 6] << 16 | (size_t)data[at + 7] << 24;
        if (memcmp(data + at, "data", 4) == 0) {
            CHECK(at + 8 + size <= len);
            *n_samples = size / 2;
            float *samples = malloc(*n_samples * sizeof *samples);
            CHECK(samples != NULL);
            for (size_t i = 0; i < *n_samples; i++) {
                const unsigned char *p = data + at + 8 + 2 * i;
                samples[i] = (float)(int16_t)(p[0] | p[1] << 8) / 32768.0f;
            }
            free(data);
            return samples;
        }
        at += 8 + size + (size & 1);
    }
    fprintf(stderr, "%s: no data chunk\n", path);
    exit(1);
}

static char *text_of(mlxcel_transcription *t) {
    size_t needed = 0;
    CHECK(mlxcel_transcription_text(t, NULL, 0, &needed) == MLXCEL_ERR_BUFFER_TOO_SMALL || needed == 0);
    char *text = malloc(needed + 1);
    CHECK(text != NULL);
    CHECK(mlxcel_transcription_text(t, text, needed + 1, NULL) == MLXCEL_OK);
    return text;
}

static void check_text(mlxcel_transcription *t, const char *want) {
    char *text = text_of(t);
    if (strcmp(text, want) != 0) {
        fprintf(stderr, "text %s, want %s\n", text, want);
        exit(1);
    }
    free(text);
}

static int print_transcription(const char *path) {
    mlxcel_transcriber *transcriber = NULL;
    mlxcel_status s = mlxcel_transcriber_load(NULL, &transcriber);
    if (s != MLXCEL_OK) {
        fprintf(stderr, "loading: %s (%d): %s\n", mlxcel_status_string(s), s, mlxcel_last_error());
        return 1;
    }
    mlxcel_transcription *t = NULL;
    s = mlxcel_transcribe_file(transcriber, path, mlxcel_transcribe_default_params(), &t);
    if (s != MLXCEL_OK) {
        fprintf(stderr, "transcribing: %s (%d): %s\n", mlxcel_status_string(s), s, mlxcel_last_error());
        mlxcel_transcriber_free(transcriber);
        return 1;
    }
    char *text = text_of(t);
    printf("%s\n", text);
    free(text);
    mlxcel_transcription_info info;
    mlxcel_transcription_get_info(t, &info);
    for (size_t i = 0; i < info.n_segments; i++) {
        mlxcel_segment seg;
        char piece[1024];
        mlxcel_transcription_segment(t, i, &seg);
        mlxcel_transcription_segment_text(t, i, piece, sizeof piece, NULL);
        printf("[%.2f -> %.2f]%s\n", seg.start, seg.end, piece);
    }
    mlxcel_transcription_free(t);
    mlxcel_transcriber_free(transcriber);
    return 0;
}

struct job {
    mlxcel_transcriber *transcriber;
    const char *path;
    mlxcel_status status;
    char *text;
};

static void *transcribe_job(void *arg) {
    struct job *job = arg;
    mlxcel_transcription *t = NULL;
    job->status = mlxcel_transcribe_file(job->transcriber, job->path, mlxcel_transcribe_default_params(), &t);
    if (job->status == MLXCEL_OK) {
        job->text = text_of(t);
        mlxcel_transcription_free(t);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "--test") != 0) {
        return print_transcription(argv[1]);
    }
    if (argc != 3 || strcmp(argv[1], "--test") != 0) {
        fprintf(stderr, "usage: %s FILE | --test FIXTURE_DIR\n", argv[0]);
        return 2;
    }
    CHECK((mlxcel_abi_version() >> 16) == MLXCEL_ABI_VERSION_MAJOR);
    CHECK((mlxcel_abi_version() & 0xffff) >= 1);
    char fox[4096], wav[4096];
    snprintf(fox, sizeof fox, "%s/en_fox_us.flac", argv[2]);
    snprintf(wav, sizeof wav, "%s/en_mono_16k.wav", argv[2]);
    mlxcel_transcribe_params p = mlxcel_transcribe_default_params();

    /* Loading: NULL is whisper-tiny.en; failures leave *out NULL. */
    mlxcel_transcriber *bad = (mlxcel_transcriber *)0x1;
    CHECK(mlxcel_transcriber_load("/no/such/whisper", &bad) == MLXCEL_ERR_MODEL_LOAD && bad == NULL);
    CHECK(strstr(mlxcel_last_error(), "/no/such/whisper") != NULL);
    CHECK(mlxcel_transcriber_load(NULL, NULL) == MLXCEL_ERR_NULL_POINTER);
    mlxcel_transcriber *tr = NULL;
    CHECK(mlxcel_transcriber_load(NULL, &tr) == MLXCEL_OK && tr != NULL);
    bool multilingual = true;
    CHECK(mlxcel_transcriber_is_multilingual(tr, &multilingual) == MLXCEL_OK && !multilingual);

    /* The defaults are the engine's (faster-whisper's with beam_size=1). */
    CHECK(p.language == NULL && p.task == MLXCEL_TASK_TRANSCRIBE && p.temperatures == NULL && p.n_temperatures == 0);
    CHECK(p.best_of == 5 && p.compression_ratio_threshold == 2.4f && p.log_prob_threshold == -1.0f);
    CHECK(p.no_speech_threshold == 0.6f && p.condition_on_previous_text && !p.without_timestamps && p.suppress_blank);

    /* A file by its path. */
    mlxcel_transcription *t = NULL;
    CHECK(mlxcel_transcribe_file(tr, fox, p, &t) == MLXCEL_OK && t != NULL);
    check_text(t, FOX);
    mlxcel_transcription_info info;
    CHECK(mlxcel_transcription_get_info(t, &info) == MLXCEL_OK);
    CHECK(strcmp(info.language, "en") == 0 && info.language_probability == 1.0f);
    CHECK(fabs(info.duration - 2.909) < 0.001 && info.n_segments == 1 && info.text_len == strlen(FOX));
    mlxcel_segment seg;
    CHECK(mlxcel_transcription_segment(t, 0, &seg) == MLXCEL_OK);
    CHECK(seg.id == 0 && seg.seek == 0 && seg.start == 0.0 && seg.end > 2.0 && seg.end <= 3.0);
    CHECK(seg.temperature == 0.0f && seg.avg_logprob < 0 && seg.compression_ratio > 0);
    CHECK(seg.no_speech_prob >= 0 && seg.no_speech_prob <= 1 && seg.text_len == strlen(FOX));
    /* Tokens: the buffer contract (count first, then fill). */
    size_t n_tokens = 0;
    CHECK(mlxcel_transcription_segment_tokens(t, 0, NULL, 0, &n_tokens) == MLXCEL_ERR_BUFFER_TOO_SMALL);
    CHECK(n_tokens == seg.n_tokens && n_tokens > 2);
    int32_t *tokens = malloc(n_tokens * sizeof *tokens);
    CHECK(mlxcel_transcription_segment_tokens(t, 0, tokens, n_tokens, &n_tokens) == MLXCEL_OK);
    CHECK(tokens[0] == 50363); /* <|0.00|> on tiny.en */
    free(tokens);
    char small[8];
    size_t needed = 0;
    CHECK(mlxcel_transcription_segment_text(t, 0, small, sizeof small, &needed) == MLXCEL_ERR_BUFFER_TOO_SMALL);
    CHECK(needed == strlen(FOX) && strncmp(small, FOX, 7) == 0 && small[7] == 0);
    CHECK(mlxcel_transcription_segment(t, 1, &seg) == MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(mlxcel_last_error(), "`index`") != NULL);
    CHECK(mlxcel_transcription_get_info(t, NULL) == MLXCEL_ERR_NULL_POINTER);

    /* The same file from its bytes. */
    size_t n_bytes;
    unsigned char *bytes = read_file(fox, &n_bytes);
    mlxcel_transcription *from_bytes = NULL;
    CHECK(mlxcel_transcribe_bytes(tr, bytes, n_bytes, p, &from_bytes) == MLXCEL_OK);
    check_text(from_bytes, FOX);
    CHECK(mlxcel_transcription_free(from_bytes) == MLXCEL_OK);

    /* Samples. */
    size_t n_samples;
    float *samples = wav_samples(wav, &n_samples);
    CHECK(n_samples == 45728);
    mlxcel_transcription *from_samples = NULL;
    CHECK(mlxcel_transcribe_samples(tr, samples, n_samples, p, &from_samples) == MLXCEL_OK);
    check_text(from_samples, WAV);
    CHECK(mlxcel_transcription_get_info(from_samples, &info) == MLXCEL_OK && fabs(info.duration - 2.858) < 1e-9);
    CHECK(mlxcel_transcription_free(from_samples) == MLXCEL_OK);
    /* Text only, one temperature. */
    mlxcel_transcribe_params greedy = p;
    float zero = 0.0f;
    greedy.temperatures = &zero;
    greedy.n_temperatures = 1;
    greedy.without_timestamps = true;
    CHECK(mlxcel_transcribe_samples(tr, samples, n_samples, greedy, &from_samples) == MLXCEL_OK);
    CHECK(mlxcel_transcription_segment(from_samples, 0, &seg) == MLXCEL_OK && seg.start == 0.0);
    mlxcel_transcription_free(from_samples);

    /* Two threads at once on one transcriber: each gets the text it gets alone. */
    struct job jobs[2] = {{tr, fox, -100, NULL}, {tr, wav, -100, NULL}};
    pthread_t threads[2];
    for (int i = 0; i < 2; i++) CHECK(pthread_create(&threads[i], NULL, transcribe_job, &jobs[i]) == 0);
    for (int i = 0; i < 2; i++) pthread_join(threads[i], NULL);
    CHECK(jobs[0].status == MLXCEL_OK && strcmp(jobs[0].text, FOX) == 0);
    CHECK(jobs[1].status == MLXCEL_OK && strcmp(jobs[1].text, WAV) == 0);
    free(jobs[0].text);
    free(jobs[1].text);

    /* Errors: *out is NULL afterwards, the message names what is wrong. */
    mlxcel_transcription *none = (mlxcel_transcription *)0x1;
    CHECK(mlxcel_transcribe_file(NULL, fox, p, &none) == MLXCEL_ERR_NULL_POINTER && none == NULL);
    CHECK(mlxcel_transcribe_file(tr, NULL, p, &none) == MLXCEL_ERR_NULL_POINTER);
    CHECK(mlxcel_transcribe_file(tr, fox, p, NULL) == MLXCEL_ERR_NULL_POINTER);
    CHECK(mlxcel_transcribe_file((mlxcel_transcriber *)0x1234, fox, p, &none) == MLXCEL_ERR_INVALID_HANDLE);
    CHECK(mlxcel_transcribe_file((mlxcel_transcriber *)t, fox, p, &none) == MLXCEL_ERR_INVALID_HANDLE);
    CHECK(mlxcel_transcribe_file(tr, "/no/such/clip.flac", p, &none) == MLXCEL_ERR_INVALID_ARGUMENT && none == NULL);
    CHECK(strstr(mlxcel_last_error(), "`audio`") != NULL && strstr(mlxcel_last_error(), "/no/such/clip.flac") != NULL);
    const unsigned char junk[] = "this is not audio at all, just some text bytes";
    CHECK(mlxcel_transcribe_bytes(tr, junk, sizeof junk, p, &none) == MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(mlxcel_last_error(), "`audio`") != NULL);
    CHECK(mlxcel_transcribe_bytes(tr, NULL, 10, p, &none) == MLXCEL_ERR_NULL_POINTER);
    CHECK(mlxcel_transcribe_samples(tr, samples, 0, p, &none) == MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(mlxcel_last_error(), "no audio samples") != NULL);
    float nan_samples[3] = {0.0f, NAN, 0.0f};
    CHECK(mlxcel_transcribe_samples(tr, nan_samples, 3, p, &none) == MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(mlxcel_last_error(), "sample 1") != NULL);
    mlxcel_transcribe_params q = p;
    q.task = 7;
    CHECK(mlxcel_transcribe_samples(tr, samples, n_samples, q, &none) == MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(mlxcel_last_error(), "`task`") != NULL);
    q = p;
    q.task = MLXCEL_TASK_TRANSLATE;
    CHECK(mlxcel_transcribe_samples(tr, samples, n_samples, q, &none) == MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(mlxcel_last_error(), "English-only") != NULL);
    q = p;
    q.language = "de";
    CHECK(mlxcel_transcribe_samples(tr, samples, n_samples, q, &none) == MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(mlxcel_last_error(), "`language`") != NULL);
    q.language = "\xff\xfe";
    CHECK(mlxcel_transcribe_samples(tr, samples, n_samples, q, &none) == MLXCEL_ERR_INVALID_UTF8);
    CHECK(strstr(mlxcel_last_error(), "`language`") != NULL);
    q = p;
    float hot = 3.0f;
    q.temperatures = &hot;
    q.n_temperatures = 1;
    CHECK(mlxcel_transcribe_samples(tr, samples, n_samples, q, &none) == MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(mlxcel_last_error(), "`temperatures`") != NULL);
    q = p;
    q.best_of = 0;
    CHECK(mlxcel_transcribe_samples(tr, samples, n_samples, q, &none) == MLXCEL_ERR_INVALID_ARGUMENT);
    CHECK(strstr(mlxcel_last_error(), "`best_of`") != NULL);
    q = p;
    q.temperatures = NULL;
    q.n_temperatures = 2;
    CHECK(mlxcel_transcribe_samples(tr, samples, n_samples, q, &none) == MLXCEL_ERR_NULL_POINTER);
    CHECK(none == NULL);

    /* Handles: double free and use after free are errors, NULL frees are no-ops. */
    CHECK(mlxcel_transcription_free(t) == MLXCEL_OK);
    CHECK(mlxcel_transcription_free(t) == MLXCEL_ERR_INVALID_HANDLE);
    CHECK(mlxcel_transcription_text(t, NULL, 0, NULL) == MLXCEL_ERR_INVALID_HANDLE);
    CHECK(mlxcel_transcription_free(NULL) == MLXCEL_OK);
    CHECK(mlxcel_transcriber_free((mlxcel_transcriber *)t) == MLXCEL_ERR_INVALID_HANDLE);
    CHECK(mlxcel_transcriber_free(tr) == MLXCEL_OK);
    CHECK(mlxcel_transcribe_samples(tr, samples, n_samples, p, &none) == MLXCEL_ERR_INVALID_HANDLE);
    CHECK(mlxcel_transcriber_free(tr) == MLXCEL_ERR_INVALID_HANDLE);
    CHECK(mlxcel_transcriber_free(NULL) == MLXCEL_OK);
    free(samples);
    free(bytes);
    printf("transcribe: ok\n");
    return 0;
}
