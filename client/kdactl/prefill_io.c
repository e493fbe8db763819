/*
 * prefill_io.c - kdactl's tensor files (see prefill_io.h).
 */
#include "prefill_io.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bf16.h"

#define D KDAC_HEAD_DIM

/* ---------------------------------------------------------------------- */
/* Layer weights                                                          */
/* ---------------------------------------------------------------------- */

/* A finite float from the metadata, or fallback when absent. */
static int meta_float(const st_file *f, const char *key, float fallback, float *out, char *err,
                      size_t errlen)
{
    const char *s = st_meta(f, key);
    *out = fallback;
    if (!s)
        return 0;
    char *end;
    double v = strtod(s, &end);
    if (*end || !isfinite(v)) {
        snprintf(err, errlen, "metadata %s: '%s' is not a finite number", key, s);
        return -1;
    }
    *out = (float)v;
    return 0;
}

/* A copy of a tensor's bytes (the file's data may be unaligned). */
static void *copy_out(const st_tensor *t)
{
    void *p = malloc(t->nbytes ? t->nbytes : 1);
    if (p)
        memcpy(p, t->data, t->nbytes);
    return p;
}

int layer_weights_read(const st_file *f, layer_weights *w, char *err, size_t errlen)
{
    memset(w, 0, sizeof(*w));
    const st_tensor *a = st_expect(f, "A_log", ST_F32, 1, (const int64_t[]){-1}, err, errlen);
    if (!a)
        return -1;
    int64_t heads = a->shape[0];
    if (heads < 1 || heads > 128) {
        snprintf(err, errlen, "A_log: %lld heads, expected 1..128", (long long)heads);
        return -1;
    }
    const st_tensor *dt = st_expect(f, "dt_bias", ST_F32, 2, (const int64_t[]){heads, D}, err,
                                    errlen);
    if (!dt)
        return -1;
    if (meta_float(f, "lower_bound", KDACTL_DEFAULT_LOWER_BOUND, &w->lower_bound, err, errlen) ||
        meta_float(f, "scale", KDAC_DEFAULT_SCALE, &w->scale, err, errlen))
        return -1;
    w->heads = (int32_t)heads;
    w->A_log = copy_out(a);
    w->dt_bias = copy_out(dt);
    if (!w->A_log || !w->dt_bias) {
        layer_weights_free(w);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    return 0;
}

void layer_weights_free(layer_weights *w)
{
    free(w->A_log);
    free(w->dt_bias);
    w->A_log = w->dt_bias = NULL;
}

static uint64_t fnv1a(uint64_t h, const void *data, size_t n)
{
    const uint8_t *p = data;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

void layer_weights_name(const layer_weights *w, char *buf, size_t size)
{
    uint64_t h = 0xcbf29ce484222325ull;
    h = fnv1a(h, &w->heads, sizeof(w->heads));
    h = fnv1a(h, w->A_log, sizeof(float) * (size_t)w->heads);
    h = fnv1a(h, w->dt_bias, sizeof(float) * (size_t)w->heads * D);
    h = fnv1a(h, &w->lower_bound, sizeof(w->lower_bound));
    h = fnv1a(h, &w->scale, sizeof(w->scale));
    snprintf(buf, size, "kdactl.%016llx", (unsigned long long)h);
}

/* ---------------------------------------------------------------------- */
/* Inputs                                                                 */
/* ---------------------------------------------------------------------- */

/* cu_seqlens must run from 0 to T without going down. */
static int check_cu(const int64_t *cu, uint32_t n, uint64_t total, char *err, size_t errlen)
{
    if (cu[0] != 0 || (uint64_t)cu[n] != total) {
        snprintf(err, errlen, "cu_seqlens: must start at 0 and end at T = %llu (got %lld, %lld)",
                 (unsigned long long)total, (long long)cu[0], (long long)cu[n]);
        return -1;
    }
    for (uint32_t i = 0; i < n; i++) {
        if (cu[i + 1] < cu[i]) {
            snprintf(err, errlen, "cu_seqlens[%u] = %lld is below cu_seqlens[%u] = %lld", i + 1,
                     (long long)cu[i + 1], i, (long long)cu[i]);
            return -1;
        }
    }
    return 0;
}

int prefill_input_read(prefill_input *in, const char *path, char *err, size_t errlen)
{
    memset(in, 0, sizeof(*in));
    char why[ST_ERRMSG_MAX];
    if (st_open(path, &in->file, why, sizeof(why)) != 0) {
        /* st_open names the path; a readable file it cannot parse is simply not ours */
        size_t plen = strlen(path);
        struct stat sb;
        bool parsed = stat(path, &sb) == 0 && S_ISREG(sb.st_mode) && sb.st_size > 0 &&
                      access(path, R_OK) == 0;
        const char *detail = strncmp(why, path, plen) == 0 && strncmp(why + plen, ": ", 2) == 0
                                 ? why + plen + 2
                                 : why;
        if (parsed)
            snprintf(err, errlen, "%s: not a safetensors file (%s)", path, detail);
        else
            snprintf(err, errlen, "%s", why);
        return -1;
    }
    const st_file *f = in->file;
    if (layer_weights_read(f, &in->weights, why, sizeof(why)) != 0)
        goto fail;
    int64_t H = in->weights.heads;
    const st_tensor *q = st_expect(f, "q", ST_BF16, 3, (const int64_t[]){-1, H, D}, why,
                                   sizeof(why));
    if (!q)
        goto fail;
    int64_t T = q->shape[0];
    if (T > UINT32_MAX) {
        snprintf(why, sizeof(why), "q: %lld tokens is too many", (long long)T);
        goto fail;
    }
    const st_tensor *cu = st_expect(f, "cu_seqlens", ST_I64, 1, (const int64_t[]){-1}, why,
                                    sizeof(why));
    if (!cu)
        goto fail;
    if (cu->shape[0] < 2 || cu->shape[0] - 1 > UINT32_MAX) {
        snprintf(why, sizeof(why), "cu_seqlens: %lld entries, expected N + 1 with N >= 1",
                 (long long)cu->shape[0]);
        goto fail;
    }
    const int64_t tok3[] = {T, H, D}, tok2[] = {T, H};
    const st_tensor *k, *v, *g, *beta;
    if (!(k = st_expect(f, "k", ST_BF16, 3, tok3, why, sizeof(why))) ||
        !(v = st_expect(f, "v", ST_BF16, 3, tok3, why, sizeof(why))) ||
        !(g = st_expect(f, "g", ST_BF16, 3, tok3, why, sizeof(why))) ||
        !(beta = st_expect(f, "beta", ST_BF16, 2, tok2, why, sizeof(why))))
        goto fail;
    in->heads = (int32_t)H;
    in->total_tokens = (uint32_t)T;
    in->nseqs = (uint32_t)(cu->shape[0] - 1);
    in->cu_seqlens = copy_out(cu);
    if (!in->cu_seqlens) {
        snprintf(why, sizeof(why), "out of memory");
        goto fail;
    }
    if (check_cu(in->cu_seqlens, in->nseqs, (uint64_t)T, why, sizeof(why)))
        goto fail;
    in->q = q->data;
    in->k = k->data;
    in->v = v->data;
    in->g = g->data;
    in->beta = beta->data;
    const st_tensor *init = st_get(f, "initial_state");
    if (init) {
        const int64_t st4[] = {in->nseqs, H, D, D};
        st_dtype dt = init->dtype == ST_BF16 ? ST_BF16 : ST_F32;
        if (!st_expect(f, "initial_state", dt, 4, st4, why, sizeof(why)))
            goto fail;
        in->initial_state = init->data;
        in->initial_dtype = dt == ST_BF16 ? KDAC_DTYPE_BF16 : KDAC_DTYPE_F32;
    }
    return 0;
fail:
    snprintf(err, errlen, "%s: %s", path, why);
    prefill_input_free(in);
    return -1;
}

/* splitmix64: small, fast, and the same everywhere. */
uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double rng_uniform(uint64_t *s)
{
    return (double)(rng_next(s) >> 11) * 0x1.0p-53;
}

void random_bf16(uint16_t *x, size_t n, uint64_t seed)
{
    uint64_t s = seed;
    for (size_t i = 0; i < n; i += 2) {
        /* Box-Muller: two normals from two uniforms. */
        double u1 = rng_uniform(&s), u2 = rng_uniform(&s);
        double r = sqrt(-2.0 * log(1.0 - u1)), a = 2.0 * M_PI * u2;
        x[i] = kda_f32_to_bf16((float)(r * cos(a)));
        if (i + 1 < n)
            x[i + 1] = kda_f32_to_bf16((float)(r * sin(a)));
    }
}

int layer_weights_random(layer_weights *w, int32_t heads, uint64_t seed)
{
    memset(w, 0, sizeof(*w));
    w->A_log = malloc(sizeof(float) * (size_t)heads);
    w->dt_bias = malloc(sizeof(float) * (size_t)heads * D);
    if (!w->A_log || !w->dt_bias) {
        layer_weights_free(w);
        return -1;
    }
    uint64_t s = seed;
    for (int32_t h = 0; h < heads; h++)
        w->A_log[h] = (float)rng_uniform(&s);
    for (int32_t i = 0; i < heads * D; i++)
        w->dt_bias[i] = (float)rng_uniform(&s);
    w->heads = heads;
    w->lower_bound = KDACTL_DEFAULT_LOWER_BOUND;
    w->scale = KDAC_DEFAULT_SCALE;
    return 0;
}

int prefill_input_random(prefill_input *in, uint32_t tokens, int32_t heads, uint32_t nseqs,
                         uint64_t seed, char *err, size_t errlen)
{
    memset(in, 0, sizeof(*in));
    if (heads < 1 || heads > 128 || nseqs == 0 || nseqs > tokens) {
        snprintf(err, errlen, "random inputs need 1..128 heads and 1..tokens sequences");
        return -1;
    }
    size_t tok = (size_t)tokens * heads * D, bt = (size_t)tokens * heads;
    uint16_t *buf = malloc(sizeof(uint16_t) * (4 * tok + bt));
    in->cu_seqlens = malloc(sizeof(int64_t) * (nseqs + 1));
    in->owned = buf;
    if (!buf || !in->cu_seqlens || layer_weights_random(&in->weights, heads, seed * 8 + 5)) {
        prefill_input_free(in);
        snprintf(err, errlen, "cannot allocate inputs for %u tokens x %d heads", tokens, heads);
        return -1;
    }
    /* Independent streams per tensor. */
    for (int t = 0; t < 5; t++)
        random_bf16(buf + t * tok, t < 4 ? tok : bt, seed * 8 + (uint64_t)t);
    in->heads = heads;
    in->total_tokens = tokens;
    in->nseqs = nseqs;
    for (uint32_t i = 0; i <= nseqs; i++)
        in->cu_seqlens[i] = (int64_t)((uint64_t)tokens * i / nseqs);
    in->q = buf;
    in->k = buf + tok;
    in->v = buf + 2 * tok;
    in->g = buf + 3 * tok;
    in->beta = buf + 4 * tok;
    return 0;
}

void prefill_input_free(prefill_input *in)
{
    layer_weights_free(&in->weights);
    free(in->cu_seqlens);
    free(in->owned);
    if (in->file)
        st_close(in->file);
    memset(in, 0, sizeof(*in));
}

/* ---------------------------------------------------------------------- */
/* Output                                                                 */
/* ---------------------------------------------------------------------- */

int prefill_output_write(const char *path, const prefill_input *in, const uint16_t *out,
                         const float *final_state, const char *const *meta, size_t nmeta,
                         char *err, size_t errlen)
{
    const int64_t T = in->total_tokens, H = in->heads, N = in->nseqs;
    const int64_t out_shape[] = {T, H, D}, state_shape[] = {N, H, D, D}, cu_shape[] = {N + 1};
    st_writer *w = st_writer_new();
    if (!w) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    int rc = st_writer_add(w, "out", ST_BF16, 3, out_shape, out) ||
             st_writer_add(w, "final_state", ST_F32, 4, state_shape, final_state) ||
             st_writer_add(w, "cu_seqlens", ST_I64, 1, cu_shape, in->cu_seqlens);
    for (size_t i = 0; i < nmeta && rc == 0; i++)
        rc = st_writer_meta(w, meta[2 * i], meta[2 * i + 1]);
    char why[ST_ERRMSG_MAX] = "cannot describe the tensors";
    if (rc == 0)
        rc = st_writer_write(w, path, why, sizeof(why));
    st_writer_free(w);
    if (rc) {
        snprintf(err, errlen, "%s: %s", path, why);
        return -1;
    }
    return 0;
}

/* rms(x - ref) / rms(ref) in float64; ref read bytewise (the file's data may be unaligned). */
static double rel_rms(const uint16_t *bf16, const float *f32, const void *ref, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        float r;
        memcpy(&r, (const char *)ref + 4 * i, 4);
        double x = bf16 ? kda_bf16_to_f32(bf16[i]) : f32[i], d = x - r;
        num += d * d;
        den += (double)r * r;
    }
    return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

static double contract_bound(const st_file *f, const char *key)
{
    const char *s = st_meta(f, key);
    double fla = s ? strtod(s, NULL) : 0.0;
    return fla > 0.005 ? fla : 0.005;
}

int prefill_input_check(const prefill_input *in, const uint16_t *out, const float *final_state,
                        prefill_check *res, char *err, size_t errlen)
{
    if (!in->file) {
        snprintf(err, errlen, "--check needs an --input file with expected tensors");
        return -1;
    }
    const int64_t tok[] = {in->total_tokens, in->heads, D}, st[] = {in->nseqs, in->heads, D, D};
    char why[256];
    const st_tensor *eo = st_expect(in->file, "expected_out", ST_F32, 3, tok, why, sizeof(why));
    const st_tensor *es = eo ? st_expect(in->file, "expected_final_state", ST_F32, 4, st, why,
                                         sizeof(why))
                             : NULL;
    if (!eo || !es) {
        snprintf(err, errlen, "--check: the input has no expected tensors to compare with (%s)",
                 why);
        return -1;
    }
    res->out_err = rel_rms(out, NULL, eo->data, (size_t)(in->total_tokens * in->heads * D));
    res->state_err = rel_rms(NULL, final_state, es->data, (size_t)(in->nseqs * in->heads * D * D));
    res->out_bound = contract_bound(in->file, "fla_out_err");
    res->state_bound = contract_bound(in->file, "fla_state_err");
    res->ok = res->out_err <= res->out_bound && res->state_err <= res->state_bound;
    return 0;
}
