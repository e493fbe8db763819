/*
 * kda_golden.c - the golden-vector cases, regenerated from their seeds.
 *
 *   kda_golden write DIR         writes every case of cases.h to DIR/NAME.safetensors
 *   kda_golden compare DIR       compares the regenerated cases with the files in DIR
 *   kda_golden fingerprint DIR   prints the numbers cases.h keeps for the files in DIR
 *
 * Inputs: numpy's legacy RandomState (MT19937, polar Gaussian) reimplemented, drawn in the
 * cases' order and rounded float64 -> float32 -> bf16, so they equal the original files bit
 * for bit (checked against a hash kept in cases.h).  Expected output and final state: the
 * float64 oracle (kda_ref.c) rounded to fp32, accepted only if it matches the fingerprint of
 * the independent float64 oracle's tensors (docs/kda.md, "Golden vectors").
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "bf16.h"
#include "kda.h"
#include "kda_ref.h"
#include "safetensors.h"

#define GOLDEN_PRINTS 6     /* random-sign projections per tensor in a fingerprint */
#define GOLDEN_MAX_SEQS 16

typedef enum { INIT_NONE, INIT_F32, INIT_BF16 } init_kind;

typedef struct golden_spec {
    const char *name, *description;
    uint32_t seed;
    int32_t heads;
    int nseqs;
    int64_t lengths[GOLDEN_MAX_SEQS];
    init_kind init;
    double lower_bound, scale;
    double g_shift;          /* added to g's draws (slow or fast decay) */
    int beta_alternate;      /* beta logits +10 on even tokens, -10 on odd ones */
    double fla_out_err, fla_state_err, flashkda_out_err, flashkda_state_err;
    uint64_t input_hash;     /* FNV-1a 64 of every input tensor's bytes, in draw order */
    double out_print[GOLDEN_PRINTS + 1], state_print[GOLDEN_PRINTS + 1];   /* rms, projections */
} golden_spec;

#include "cases.h"

#define NCASES (sizeof golden_specs / sizeof golden_specs[0])
#define FINGERPRINT_TOL 1e-6   /* relative; fp32 rounding moves these by ~1e-9 */

/* ---- numpy.random.RandomState(seed), legacy stream ---- */

typedef struct mt19937 {
    uint32_t key[624];
    int pos;
    int has_gauss;
    double gauss;
} mt19937;

static void mt_seed(mt19937 *m, uint32_t seed)
{
    m->key[0] = seed;
    for (int i = 1; i < 624; i++)
        m->key[i] = 1812433253u * (m->key[i - 1] ^ (m->key[i - 1] >> 30)) + (uint32_t)i;
    m->pos = 624;
    m->has_gauss = 0;
}

static uint32_t mt_next(mt19937 *m)
{
    if (m->pos == 624) {
        for (int i = 0; i < 624; i++) {
            uint32_t y = (m->key[i] & 0x80000000u) | (m->key[(i + 1) % 624] & 0x7fffffffu);
            m->key[i] = m->key[(i + 397) % 624] ^ (y >> 1) ^ ((y & 1u) ? 0x9908b0dfu : 0u);
        }
        m->pos = 0;
    }
    uint32_t y = m->key[m->pos++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    return y ^ (y >> 18);
}

static double mt_double(mt19937 *m)      /* numpy's random_sample: 53 bits in [0, 1) */
{
    uint32_t a = mt_next(m) >> 5, b = mt_next(m) >> 6;
    return (a * 67108864.0 + b) / 9007199254740992.0;
}

static double mt_gauss(mt19937 *m)       /* numpy's legacy polar method, pairs cached */
{
    if (m->has_gauss) {
        m->has_gauss = 0;
        return m->gauss;
    }
    double x1, x2, r2;
    do {
        x1 = 2.0 * mt_double(m) - 1.0;
        x2 = 2.0 * mt_double(m) - 1.0;
        r2 = x1 * x1 + x2 * x2;
    } while (r2 >= 1.0 || r2 == 0.0);
    double f = sqrt(-2.0 * log(r2) / r2);
    m->gauss = f * x1;
    m->has_gauss = 1;
    return f * x2;
}

static uint16_t to_bf16(double x) { return kda_f32_to_bf16((float)x); }

/* ---- one case ---- */

typedef struct golden_data {
    int64_t T, N, H;
    int64_t *cu;
    uint16_t *q, *k, *v, *g, *beta;
    float *A_log, *dt_bias;
    float *init_f32;         /* INIT_F32, or INIT_BF16 widened (what the oracle starts from) */
    uint16_t *init_bf16;     /* INIT_BF16 as stored */
    float *out, *state;      /* expected, fp32 */
} golden_data;

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "kda_golden: out of memory\n");
        exit(1);
    }
    return p;
}

static uint64_t fnv1a(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static void draw_inputs(const golden_spec *s, golden_data *d)
{
    memset(d, 0, sizeof *d);
    d->H = s->heads;
    d->N = s->nseqs;
    d->cu = xmalloc(sizeof(int64_t) * (size_t)(d->N + 1));
    d->cu[0] = 0;
    for (int64_t n = 0; n < d->N; n++)
        d->cu[n + 1] = d->cu[n] + s->lengths[n];
    d->T = d->cu[d->N];
    const size_t tok = (size_t)(d->T * d->H * KDA_HEAD_DIM);
    const size_t st = (size_t)(d->N * d->H * KDA_HEAD_DIM * KDA_HEAD_DIM);
    mt19937 m;
    mt_seed(&m, s->seed);
    uint16_t **tensors[] = {&d->q, &d->k, &d->v, &d->g};
    for (int t = 0; t < 4; t++) {
        uint16_t *x = *tensors[t] = xmalloc(2 * tok);
        double shift = t == 3 ? s->g_shift : 0.0;
        for (size_t i = 0; i < tok; i++)
            x[i] = to_bf16(mt_gauss(&m) + shift);
    }
    d->beta = xmalloc(2 * (size_t)(d->T * d->H));
    for (int64_t i = 0; i < d->T * d->H; i++) {
        double x = mt_gauss(&m);
        if (s->beta_alternate)
            x = (i / d->H) % 2 == 0 ? 10.0 : -10.0;
        d->beta[i] = to_bf16(x);
    }
    d->A_log = xmalloc(sizeof(float) * (size_t)d->H);
    for (int64_t i = 0; i < d->H; i++)
        d->A_log[i] = (float)mt_double(&m);
    d->dt_bias = xmalloc(sizeof(float) * (size_t)(d->H * KDA_HEAD_DIM));
    for (int64_t i = 0; i < d->H * KDA_HEAD_DIM; i++)
        d->dt_bias[i] = (float)mt_double(&m);
    if (s->init != INIT_NONE) {
        d->init_f32 = xmalloc(sizeof(float) * st);
        if (s->init == INIT_BF16)
            d->init_bf16 = xmalloc(2 * st);
        for (size_t i = 0; i < st; i++) {
            double x = 0.25 * mt_gauss(&m);
            if (s->init == INIT_BF16) {
                d->init_bf16[i] = to_bf16(x);
                d->init_f32[i] = kda_bf16_to_f32(d->init_bf16[i]);
            } else {
                d->init_f32[i] = (float)x;
            }
        }
    }
}

static uint64_t input_hash(const golden_spec *s, const golden_data *d)
{
    const size_t tok = (size_t)(d->T * d->H * KDA_HEAD_DIM);
    const size_t st = (size_t)(d->N * d->H * KDA_HEAD_DIM * KDA_HEAD_DIM);
    uint64_t h = 0xcbf29ce484222325ull;
    h = fnv1a(h, d->q, 2 * tok);
    h = fnv1a(h, d->k, 2 * tok);
    h = fnv1a(h, d->v, 2 * tok);
    h = fnv1a(h, d->g, 2 * tok);
    h = fnv1a(h, d->beta, 2 * (size_t)(d->T * d->H));
    h = fnv1a(h, d->A_log, sizeof(float) * (size_t)d->H);
    h = fnv1a(h, d->dt_bias, sizeof(float) * (size_t)(d->H * KDA_HEAD_DIM));
    if (s->init == INIT_F32)
        h = fnv1a(h, d->init_f32, sizeof(float) * st);
    else if (s->init == INIT_BF16)
        h = fnv1a(h, d->init_bf16, 2 * st);
    return h;
}

static void run_oracle(const golden_spec *s, golden_data *d)
{
    const int64_t row = d->H * KDA_HEAD_DIM, slot = d->H * KDA_HEAD_DIM * KDA_HEAD_DIM;
    kda_layer layer = {d->A_log, d->dt_bias, (float)s->lower_bound, (float)s->scale};
    double *out = xmalloc(sizeof(double) * (size_t)(d->T * row));
    double *state = xmalloc(sizeof(double) * (size_t)slot);
    d->out = xmalloc(sizeof(float) * (size_t)(d->T * row));
    d->state = xmalloc(sizeof(float) * (size_t)(d->N * slot));
    for (int64_t n = 0; n < d->N; n++) {
        int64_t t0 = d->cu[n], len = d->cu[n + 1] - t0;
        for (int64_t e = 0; e < slot; e++)
            state[e] = d->init_f32 ? d->init_f32[n * slot + e] : 0.0;
        kda_ref_sequence((int32_t)d->H, &layer, d->q + t0 * row, d->k + t0 * row,
                         d->v + t0 * row, d->g + t0 * row, d->beta + t0 * d->H, len, state,
                         out + t0 * row);
        for (int64_t e = 0; e < slot; e++)
            d->state[n * slot + e] = (float)state[e];
    }
    for (int64_t i = 0; i < d->T * row; i++)
        d->out[i] = (float)out[i];
    free(out);
    free(state);
}

static void free_data(golden_data *d)
{
    free(d->cu);
    free(d->q);
    free(d->k);
    free(d->v);
    free(d->g);
    free(d->beta);
    free(d->A_log);
    free(d->dt_bias);
    free(d->init_f32);
    free(d->init_bf16);
    free(d->out);
    free(d->state);
    memset(d, 0, sizeof *d);
}

/* ---- fingerprints: rms and projections on fixed random signs, normalised by rms*sqrt(n) ---- */

static uint64_t splitmix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void fingerprint(const float *x, size_t n, double print[GOLDEN_PRINTS + 1])
{
    double ss = 0.0, proj[GOLDEN_PRINTS] = {0};
    for (size_t i = 0; i < n; i++) {
        double v = x[i];
        ss += v * v;
        uint64_t bits = splitmix(i);
        for (int j = 0; j < GOLDEN_PRINTS; j++)
            proj[j] += (bits >> j) & 1u ? v : -v;
    }
    double rms = sqrt(ss / (double)n);
    print[0] = rms;
    for (int j = 0; j < GOLDEN_PRINTS; j++)
        print[j + 1] = rms > 0.0 ? proj[j] / (rms * sqrt((double)n)) : 0.0;
}

/* Largest relative distance between two fingerprints (rms relative, projections absolute). */
static double print_distance(const double a[GOLDEN_PRINTS + 1], const double b[GOLDEN_PRINTS + 1])
{
    double worst = b[0] > 0.0 ? fabs(a[0] - b[0]) / b[0] : fabs(a[0]);
    for (int j = 1; j <= GOLDEN_PRINTS; j++)
        worst = fmax(worst, fabs(a[j] - b[j]));
    return worst;
}

/* ---- commands ---- */

static int build_case(const golden_spec *s, golden_data *d)
{
    draw_inputs(s, d);
    uint64_t h = input_hash(s, d);
    if (h != s->input_hash) {
        fprintf(stderr, "kda_golden: %s: inputs hash to %016llx, not %016llx: this machine's "
                        "random stream differs from the one the case was drawn with\n",
                s->name, (unsigned long long)h, (unsigned long long)s->input_hash);
        return -1;
    }
    run_oracle(s, d);
    double po[GOLDEN_PRINTS + 1], ps[GOLDEN_PRINTS + 1];
    fingerprint(d->out, (size_t)(d->T * d->H * KDA_HEAD_DIM), po);
    fingerprint(d->state, (size_t)(d->N * d->H * KDA_HEAD_DIM * KDA_HEAD_DIM), ps);
    double eo = print_distance(po, s->out_print), es = print_distance(ps, s->state_print);
    if (eo > FINGERPRINT_TOL || es > FINGERPRINT_TOL) {
        fprintf(stderr, "kda_golden: %s: the float64 oracle does not match the independent "
                        "reference (fingerprint distance: output %.2e, state %.2e, allowed %.0e)\n",
                s->name, eo, es, FINGERPRINT_TOL);
        return -1;
    }
    return 0;
}

static int write_case(const golden_spec *s, const golden_data *d, const char *dir)
{
    const int64_t D = KDA_HEAD_DIM, cus[] = {d->N + 1}, tok3[] = {d->T, d->H, D},
                  tok2[] = {d->T, d->H}, head1[] = {d->H}, head2[] = {d->H, D},
                  st4[] = {d->N, d->H, D, D};
    st_writer *w = st_writer_new();
    if (!w)
        return -1;
    st_writer_add(w, "cu_seqlens", ST_I64, 1, cus, d->cu);
    st_writer_add(w, "q", ST_BF16, 3, tok3, d->q);
    st_writer_add(w, "k", ST_BF16, 3, tok3, d->k);
    st_writer_add(w, "v", ST_BF16, 3, tok3, d->v);
    st_writer_add(w, "g", ST_BF16, 3, tok3, d->g);
    st_writer_add(w, "beta", ST_BF16, 2, tok2, d->beta);
    st_writer_add(w, "A_log", ST_F32, 1, head1, d->A_log);
    st_writer_add(w, "dt_bias", ST_F32, 2, head2, d->dt_bias);
    if (s->init == INIT_F32)
        st_writer_add(w, "initial_state", ST_F32, 4, st4, d->init_f32);
    else if (s->init == INIT_BF16)
        st_writer_add(w, "initial_state", ST_BF16, 4, st4, d->init_bf16);
    st_writer_add(w, "expected_out", ST_F32, 3, tok3, d->out);
    st_writer_add(w, "expected_final_state", ST_F32, 4, st4, d->state);

    char buf[64], lengths[512];
    int off = snprintf(lengths, sizeof lengths, "[");
    for (int n = 0; n < s->nseqs; n++)
        off += snprintf(lengths + off, sizeof lengths - (size_t)off, "%s%lld", n ? ", " : "",
                        (long long)s->lengths[n]);
    snprintf(lengths + off, sizeof lengths - (size_t)off, "]");
    st_writer_meta(w, "case", s->name);
    st_writer_meta(w, "description", s->description);
    st_writer_meta(w, "oracle", "float64 token loop (kda_ref.c), matched to the independent "
                                "oracle's fingerprint");
#define META_NUM(key, fmt, val) (snprintf(buf, sizeof buf, fmt, val), st_writer_meta(w, key, buf))
    META_NUM("lower_bound", "%.17g", s->lower_bound);
    META_NUM("scale", "%.17g", s->scale);
    META_NUM("seed", "%u", s->seed);
    META_NUM("fla_out_err", "%.17g", s->fla_out_err);
    META_NUM("fla_state_err", "%.17g", s->fla_state_err);
    META_NUM("flashkda_out_err", "%.17g", s->flashkda_out_err);
    META_NUM("flashkda_state_err", "%.17g", s->flashkda_state_err);
    META_NUM("H", "%d", s->heads);
    META_NUM("N", "%d", s->nseqs);
    META_NUM("T_total", "%lld", (long long)d->T);
#undef META_NUM
    st_writer_meta(w, "lengths", lengths);
    st_writer_meta(w, "initial_state", s->init == INIT_F32    ? "F32"
                                       : s->init == INIT_BF16 ? "BF16"
                                                              : "none (zeros)");
    char path[4096], err[ST_ERRMSG_MAX];
    snprintf(path, sizeof path, "%s/%s.safetensors", dir, s->name);
    int rc = st_writer_write(w, path, err, sizeof err);
    if (rc != 0)
        fprintf(stderr, "kda_golden: %s\n", err);
    st_writer_free(w);
    return rc;
}

static int cmd_write(const char *dir)
{
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "kda_golden: %s: %s\n", dir, strerror(errno));
        return 1;
    }
    for (size_t i = 0; i < NCASES; i++) {
        golden_data d;
        int rc = build_case(&golden_specs[i], &d);
        if (rc == 0)
            rc = write_case(&golden_specs[i], &d, dir);
        free_data(&d);
        if (rc != 0)
            return 1;
    }
    printf("kda_golden: %zu cases in %s\n", NCASES, dir);
    return 0;
}

static const st_tensor *tensor(st_file *f, const char *name, const char *path)
{
    const st_tensor *t = st_get(f, name);
    if (!t)
        fprintf(stderr, "kda_golden: %s: no tensor %s\n", path, name);
    return t;
}

/* The floats of an F32 tensor (the file's bytes may be unaligned). */
static float *floats(const st_tensor *t)
{
    float *x = xmalloc(t->nbytes);
    memcpy(x, t->data, t->nbytes);
    return x;
}

static int open_case(const char *dir, const char *name, st_file **f, char *path, size_t pathlen)
{
    char err[ST_ERRMSG_MAX];
    snprintf(path, pathlen, "%s/%s.safetensors", dir, name);
    if (st_open(path, f, err, sizeof err) != 0) {
        fprintf(stderr, "kda_golden: %s\n", err);
        return -1;
    }
    return 0;
}

/* Same inputs bit for bit, expected tensors within the contract's margin of the file's. */
static int cmd_compare(const char *dir)
{
    int bad = 0;
    for (size_t i = 0; i < NCASES; i++) {
        const golden_spec *s = &golden_specs[i];
        char path[4096];
        st_file *f;
        if (open_case(dir, s->name, &f, path, sizeof path) != 0) {
            bad++;
            continue;
        }
        golden_data d;
        draw_inputs(s, &d);
        run_oracle(s, &d);
        const size_t tok = (size_t)(d.T * d.H * KDA_HEAD_DIM);
        const size_t st = (size_t)(d.N * d.H * KDA_HEAD_DIM * KDA_HEAD_DIM);
        struct { const char *name; const void *data; size_t bytes; } in[] = {
            {"cu_seqlens", d.cu, sizeof(int64_t) * (size_t)(d.N + 1)},
            {"q", d.q, 2 * tok}, {"k", d.k, 2 * tok}, {"v", d.v, 2 * tok}, {"g", d.g, 2 * tok},
            {"beta", d.beta, 2 * (size_t)(d.T * d.H)},
            {"A_log", d.A_log, sizeof(float) * (size_t)d.H},
            {"dt_bias", d.dt_bias, sizeof(float) * (size_t)(d.H * KDA_HEAD_DIM)},
            {"initial_state", s->init == INIT_BF16 ? (const void *)d.init_bf16 : d.init_f32,
             s->init == INIT_BF16 ? 2 * st : sizeof(float) * st},
        };
        int same = 1;
        for (size_t j = 0; j < sizeof in / sizeof in[0]; j++) {
            if (s->init == INIT_NONE && strcmp(in[j].name, "initial_state") == 0) {
                if (st_get(f, "initial_state")) {
                    fprintf(stderr, "kda_golden: %s: has an initial state, the case has none\n", path);
                    same = 0;
                }
                continue;
            }
            const st_tensor *t = tensor(f, in[j].name, path);
            if (!t || t->nbytes != in[j].bytes || memcmp(t->data, in[j].data, in[j].bytes) != 0) {
                fprintf(stderr, "kda_golden: %s: %s differs from the regenerated one\n", path,
                        in[j].name);
                same = 0;
            }
        }
        const st_tensor *eo = tensor(f, "expected_out", path);
        const st_tensor *es = tensor(f, "expected_final_state", path);
        double dout = INFINITY, dst = INFINITY;
        if (eo && es && eo->nbytes == 4 * tok && es->nbytes == 4 * st) {
            float *ro = floats(eo), *rs = floats(es);
            double num = 0, den = 0;
            for (size_t e = 0; e < tok; e++)
                num += (d.out[e] - (double)ro[e]) * (d.out[e] - (double)ro[e]), den += (double)ro[e] * ro[e];
            dout = sqrt(num / den);
            num = den = 0;
            for (size_t e = 0; e < st; e++)
                num += (d.state[e] - (double)rs[e]) * (d.state[e] - (double)rs[e]), den += (double)rs[e] * rs[e];
            dst = sqrt(num / den);
            free(ro);
            free(rs);
        }
        int ok = same && dout <= 1e-6 && dst <= 1e-6 && input_hash(s, &d) == s->input_hash;
        printf("%-22s inputs %s, oracle vs file: output %.1e state %.1e  %s\n", s->name,
               same ? "bit-identical" : "DIFFER", dout, dst, ok ? "ok" : "FAILED");
        bad += !ok;
        free_data(&d);
        st_close(f);
    }
    return bad ? 1 : 0;
}

/* Prints, per case, the numbers cases.h keeps: the input hash and the expected fingerprints. */
static int cmd_fingerprint(const char *dir)
{
    for (size_t i = 0; i < NCASES; i++) {
        const golden_spec *s = &golden_specs[i];
        char path[4096];
        st_file *f;
        if (open_case(dir, s->name, &f, path, sizeof path) != 0)
            return 1;
        golden_data d;
        draw_inputs(s, &d);
        const st_tensor *eo = tensor(f, "expected_out", path);
        const st_tensor *es = tensor(f, "expected_final_state", path);
        if (!eo || !es)
            return 1;
        double po[GOLDEN_PRINTS + 1], ps[GOLDEN_PRINTS + 1];
        float *ro = floats(eo), *rs = floats(es);
        fingerprint(ro, eo->nbytes / 4, po);
        fingerprint(rs, es->nbytes / 4, ps);
        printf("%s:\n    .input_hash = 0x%016llxull,\n    .out_print = {", s->name,
               (unsigned long long)input_hash(s, &d));
        for (int j = 0; j <= GOLDEN_PRINTS; j++)
            printf("%s%.17g", j ? ", " : "", po[j]);
        printf("},\n    .state_print = {");
        for (int j = 0; j <= GOLDEN_PRINTS; j++)
            printf("%s%.17g", j ? ", " : "", ps[j]);
        printf("},\n");
        free(ro);
        free(rs);
        free_data(&d);
        st_close(f);
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "write") == 0)
        return cmd_write(argv[2]);
    if (argc == 3 && strcmp(argv[1], "compare") == 0)
        return cmd_compare(argv[2]);
    if (argc == 3 && strcmp(argv[1], "fingerprint") == 0)
        return cmd_fingerprint(argv[2]);
    fprintf(stderr, "usage: kda_golden write|compare|fingerprint DIR\n");
    return 2;
}
