/*
 * golden.c - golden-vector case loader and the relative RMS error metric.
 */
#include "golden.h"

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

const char *golden_dir(void)
{
    const char *env = getenv("KDAD_GOLDEN_DIR");
    return env && *env ? env : KDAD_GOLDEN_DIR;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int golden_list(const char *dir, char ***paths, char *err, size_t errlen)
{
    DIR *d = opendir(dir);
    if (!d) {
        snprintf(err, errlen, "golden folder %s is missing (build the kda_golden_cases target, or set KDAD_GOLDEN_DIR)", dir);
        return -1;
    }
    char **list = NULL;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        size_t len = strlen(e->d_name);
        const char *ext = ".safetensors";
        if (len <= strlen(ext) || strcmp(e->d_name + len - strlen(ext), ext) != 0)
            continue;
        char **grown = realloc(list, sizeof *list * (size_t)(n + 1));
        if (!grown)
            break;
        list = grown;
        size_t plen = strlen(dir) + len + 2;
        list[n] = malloc(plen);
        snprintf(list[n], plen, "%s/%s", dir, e->d_name);
        n++;
    }
    closedir(d);
    qsort(list, (size_t)n, sizeof *list, cmp_str);
    *paths = list;
    if (n == 0)
        snprintf(err, errlen, "golden folder %s holds no .safetensors case", dir);
    return n;
}

void golden_list_free(char **paths, int n)
{
    for (int i = 0; i < n; i++)
        free(paths[i]);
    free(paths);
}

static double meta_double(const st_file *f, const char *key, double fallback)
{
    const char *s = st_meta(f, key);
    return s ? strtod(s, NULL) : fallback;
}

/* A tensor the case must have, with its dtype and shape; its data must be aligned. */
static const void *need(const golden_case *c, const char *name, st_dtype dt, int ndim,
                        const int64_t *shape, char *err, size_t errlen)
{
    const st_tensor *t = st_expect(c->file, name, dt, ndim, shape, err, errlen);
    if (!t)
        return NULL;
    if ((uintptr_t)t->data % st_dtype_size(dt) != 0) {
        snprintf(err, errlen, "%s: tensor %s is not aligned", c->name, name);
        return NULL;
    }
    return t->data;
}

int golden_load(const char *path, golden_case *c, char *err, size_t errlen)
{
    memset(c, 0, sizeof *c);
    snprintf(c->path, sizeof c->path, "%s", path);
    if (st_open(path, &c->file, err, errlen) != 0)
        return -1;
    const char *name = st_meta(c->file, "case");
    snprintf(c->name, sizeof c->name, "%s", name ? name : path);

    const st_tensor *q = st_get(c->file, "q");
    const st_tensor *cu = st_get(c->file, "cu_seqlens");
    if (!q || q->ndim != 3 || q->shape[2] != KDA_HEAD_DIM || !cu || cu->ndim != 1 || cu->shape[0] < 2) {
        snprintf(err, errlen, "%s: q [T,H,128] or cu_seqlens [N+1] missing or malformed", c->name);
        goto fail;
    }
    c->total_tokens = q->shape[0];
    c->heads = (int32_t)q->shape[1];
    c->nseqs = cu->shape[0] - 1;
    const int64_t T = c->total_tokens, H = c->heads, N = c->nseqs, D = KDA_HEAD_DIM;
    const int64_t tok3[] = {T, H, D}, tok2[] = {T, H}, head1[] = {H}, head2[] = {H, D};
    const int64_t cus[] = {N + 1}, st4[] = {N, H, D, D};

    if (!(c->cu_seqlens = need(c, "cu_seqlens", ST_I64, 1, cus, err, errlen)) ||
        !(c->q = need(c, "q", ST_BF16, 3, tok3, err, errlen)) ||
        !(c->k = need(c, "k", ST_BF16, 3, tok3, err, errlen)) ||
        !(c->v = need(c, "v", ST_BF16, 3, tok3, err, errlen)) ||
        !(c->g = need(c, "g", ST_BF16, 3, tok3, err, errlen)) ||
        !(c->beta = need(c, "beta", ST_BF16, 2, tok2, err, errlen)) ||
        !(c->expected_out = need(c, "expected_out", ST_F32, 3, tok3, err, errlen)) ||
        !(c->expected_state = need(c, "expected_final_state", ST_F32, 4, st4, err, errlen)))
        goto fail;
    const float *alog = need(c, "A_log", ST_F32, 1, head1, err, errlen);
    const float *dtb = need(c, "dt_bias", ST_F32, 2, head2, err, errlen);
    if (!alog || !dtb)
        goto fail;
    c->A_log = malloc(sizeof(float) * (size_t)H);
    c->dt_bias = malloc(sizeof(float) * (size_t)(H * D));
    memcpy(c->A_log, alog, sizeof(float) * (size_t)H);
    memcpy(c->dt_bias, dtb, sizeof(float) * (size_t)(H * D));

    const st_tensor *init = st_get(c->file, "initial_state");
    if (init) {
        size_t n = (size_t)(N * H * D * D);
        c->initial_is_bf16 = init->dtype == ST_BF16;
        const void *src = need(c, "initial_state", c->initial_is_bf16 ? ST_BF16 : ST_F32, 4, st4,
                               err, errlen);
        if (!src)
            goto fail;
        c->initial_state = malloc(sizeof(float) * n);
        for (size_t i = 0; i < n; i++)
            c->initial_state[i] = c->initial_is_bf16 ? kda_bf16_to_f32(((const uint16_t *)src)[i])
                                                     : ((const float *)src)[i];
    }
    c->lower_bound = meta_double(c->file, "lower_bound", -5.0);
    c->scale = meta_double(c->file, "scale", 1.0 / sqrt(128.0));
    c->fla_out_err = meta_double(c->file, "fla_out_err", NAN);
    c->fla_state_err = meta_double(c->file, "fla_state_err", NAN);
    c->flashkda_out_err = meta_double(c->file, "flashkda_out_err", NAN);
    c->flashkda_state_err = meta_double(c->file, "flashkda_state_err", NAN);
    if (isnan(c->fla_out_err) || isnan(c->fla_state_err)) {
        snprintf(err, errlen, "%s: metadata lacks fla_out_err / fla_state_err", c->name);
        goto fail;
    }
    return 0;
fail:
    golden_free(c);
    return -1;
}

void golden_free(golden_case *c)
{
    free(c->A_log);
    free(c->dt_bias);
    free(c->initial_state);
    if (c->file)
        st_close(c->file);
    memset(c, 0, sizeof *c);
}

#define REL_RMS_BODY(X)                                     \
    double num = 0.0, den = 0.0;                            \
    for (size_t i = 0; i < n; i++) {                        \
        double r = ref[i], d = (X) - r;                     \
        num += d * d;                                       \
        den += r * r;                                       \
    }                                                       \
    return den > 0.0 ? sqrt(num / den) : sqrt(num);

double rel_rms_f64(const double *x, const float *ref, size_t n) { REL_RMS_BODY(x[i]) }
double rel_rms_f32(const float *x, const float *ref, size_t n) { REL_RMS_BODY((double)x[i]) }
double rel_rms_bf16(const uint16_t *x, const float *ref, size_t n) { REL_RMS_BODY((double)kda_bf16_to_f32(x[i])) }
double rel_rms_f64_f64(const double *x, const double *ref, size_t n) { REL_RMS_BODY(x[i]) }
