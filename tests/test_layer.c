/*
 * test_layer.c - daemon/layer.c: names per uid and the configuration's,
 * registrations and references, and a registry of thousands of layers
 * under churn checked against a plain model of it.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "layer.h"
#include "log.h"
#include "safetensors.h"

#define HEADS 4
#define UID_A 1000
#define UID_B 1001

typedef struct weights {
    float A_log[HEADS];
    float dt_bias[HEADS * KDA_HEAD_DIM];
} weights;

static void weights_make(weights *w, float v)
{
    for (int i = 0; i < HEADS; i++)
        w->A_log[i] = v + (float)i;
    for (int i = 0; i < HEADS * KDA_HEAD_DIM; i++)
        w->dt_bias[i] = v - (float)i;
}

static kd_backend *backend;
static const kd_layer_quota no_quota = {1u << 20, 1u << 20};

static int setup(void **unused)
{
    (void)unused;
    kd_log_set_level(KD_LOG_ERROR); /* the replaced-layer warnings are expected */
    kd_backend_config bc = {.kind = KD_BACKEND_CPU, .cpu_threads = 1, .heads = HEADS, .slots = 1,
                            .dtype = KDA_DTYPE_F32};
    char err[256];
    if (kd_backend_create(uv_default_loop(), &bc, NULL, NULL, NULL, &backend, err,
                          sizeof(err)) != KP_OK)
        fail_msg("%s", err);
    return 0;
}

static int teardown(void **unused)
{
    (void)unused;
    kd_backend_destroy(backend);
    return 0;
}

/* Each test's registry, and two sets of weights to register: w1 from 1, w2 from 2. */
typedef struct fixture {
    kd_layers ls;
    weights w1, w2;
} fixture;

static int fixture_setup(void **state)
{
    fixture *f = calloc(1, sizeof(*f));
    assert_non_null(f);
    kd_layers_init(&f->ls, backend, HEADS, UINT64_C(0x5eed5eed5eed5eed));
    weights_make(&f->w1, 1.0f);
    weights_make(&f->w2, 2.0f);
    *state = f;
    return 0;
}

static int fixture_teardown(void **state)
{
    fixture *f = *state;
    kd_layers_destroy(&f->ls);
    free(f);
    return 0;
}

static int reg(kd_layers *ls, const char *name, const weights *w, uint32_t uid, bool *created,
               kp_error *e)
{
    return kd_layers_register(ls, name, w->A_log, w->dt_bias, -5.0f, 1.0f, uid, &no_quota,
                              created, e);
}

static void expect_code(int rc, const kp_error *e, int code, const char *substr)
{
    assert_int_equal(rc, code);
    if (substr && !strstr(e->message, substr))
        fail_msg("\"%s\" not in \"%s\"", substr, e->message);
}

/* Each uid has its own names; uid 0's client layers are its own too. */
static void test_names_per_uid(void **state)
{
    fixture *f = *state;
    kd_layers *ls = &f->ls;
    const weights *w1 = &f->w1, *w2 = &f->w2;
    bool created;
    kp_error e;
    assert_int_equal(reg(ls, "x", w1, UID_A, &created, &e), KP_OK);
    assert_true(created);
    assert_int_equal(reg(ls, "x", w2, UID_B, &created, &e), KP_OK);
    assert_true(created);
    assert_int_equal(reg(ls, "r", w1, 0, &created, &e), KP_OK);
    kd_layer *a = kd_layers_find(ls, "x", UID_A), *b = kd_layers_find(ls, "x", UID_B);
    assert_non_null(a);
    assert_non_null(b);
    assert_ptr_not_equal(a, b);
    assert_int_equal(a->uid, UID_A);
    assert_true(a->A_log[0] == 1.0f && b->A_log[0] == 2.0f);
    assert_null(kd_layers_find(ls, "x", 1002));
    assert_null(kd_layers_find(ls, "x", 0));
    assert_null(kd_layers_find(ls, "r", UID_A));
    assert_non_null(kd_layers_find(ls, "r", 0));
    assert_null(kd_layers_find(ls, "xx", UID_A));
    assert_null(kd_layers_find(ls, "", UID_A));
    assert_int_equal(kd_layers_of_uid(ls, UID_A), 1);
    assert_int_equal(kd_layers_of_uid(ls, 0), 1);

    /* the same weights again: another registration; others: refused */
    assert_int_equal(reg(ls, "x", w1, UID_A, &created, &e), KP_OK);
    assert_false(created);
    assert_int_equal(a->regs, 2);
    expect_code(reg(ls, "x", w2, UID_A, &created, &e), &e, KP_E_LAYER_EXISTS,
                "uid 1000 has a layer \"x\" with other weights (registrations: 2)");

    /* a request's reference outlives the name */
    kd_layer *held;
    assert_int_equal(kd_layers_acquire(ls, "x", UID_A, &held, &e), KP_OK);
    assert_ptr_equal(held, a);
    expect_code(kd_layers_acquire(ls, "x", 1002, &held, &e), &e, KP_E_UNKNOWN_LAYER,
                "no layer \"x\" in the configuration or registered by uid 1002");
    kp_layer_drop_result dr;
    assert_int_equal(kd_layers_drop(ls, "x", UID_A, &dr, &e), KP_OK);
    assert_false(dr.removed);
    assert_int_equal(dr.registrations, 1);
    assert_int_equal(kd_layers_drop(ls, "x", UID_A, &dr, &e), KP_OK);
    assert_true(dr.removed);
    assert_int_equal(dr.in_use, 1);
    assert_null(kd_layers_find(ls, "x", UID_A));
    assert_ptr_equal(kd_layers_find(ls, "x", UID_B), b);
    expect_code(kd_layers_drop(ls, "x", UID_A, &dr, &e), &e, KP_E_UNKNOWN_LAYER,
                "uid 1000 has no layer \"x\"");
    assert_true(a->A_log[0] == 1.0f); /* still readable: the reference */
    kd_layer_unref(ls, a);
    /* the name is free again, for other weights */
    assert_int_equal(reg(ls, "x", w2, UID_A, &created, &e), KP_OK);
    assert_true(created);
    assert_true(kd_layers_find(ls, "x", UID_A)->A_log[0] == 2.0f);
    assert_int_equal(ls->n, 3);
}

static void write_layer_file(const char *path, const weights *w)
{
    st_writer *sw = st_writer_new();
    const int64_t a_shape[1] = {HEADS}, dt_shape[2] = {HEADS, KDA_HEAD_DIM};
    char err[256];
    assert_int_equal(st_writer_add(sw, "A_log", ST_F32, 1, a_shape, w->A_log), 0);
    assert_int_equal(st_writer_add(sw, "dt_bias", ST_F32, 2, dt_shape, w->dt_bias), 0);
    if (st_writer_write(sw, path, err, sizeof(err)) != 0)
        fail_msg("writing %s: %s", path, err);
    st_writer_free(sw);
}

/* The configuration's names are every uid's, and replace client layers of that name. */
static void test_config_names(void **state)
{
    fixture *f = *state;
    kd_layers *ls = &f->ls;
    const weights *w1 = &f->w1, *w2 = &f->w2;
    char path[] = "/tmp/kdad-layer-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    write_layer_file(path, w1);
    bool created;
    kp_error e;
    assert_int_equal(reg(ls, "x", w2, UID_A, &created, &e), KP_OK);
    assert_int_equal(reg(ls, "y", w2, 0, &created, &e), KP_OK);

    kd_layer_conf lc = {.name = "x", .file = path, .a_log_tensor = "A_log",
                        .dt_bias_tensor = "dt_bias", .lower_bound = -5.0f, .scale = 1.0f};
    kd_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.limits.max_layers = 16;
    cfg.layers = &lc;
    cfg.nlayers = 1;
    char err[512];
    assert_int_equal(kd_layers_sync_config(ls, &cfg, err, sizeof(err)), 0);
    kd_layer *x = kd_layers_find(ls, "x", UID_A);
    assert_non_null(x);
    assert_int_equal(x->source, KP_LAYER_SOURCE_CONFIG);
    assert_true(x->A_log[0] == 1.0f);
    assert_ptr_equal(kd_layers_find(ls, "x", UID_B), x);
    assert_ptr_equal(kd_layers_find(ls, "x", 0), x);
    assert_int_equal(kd_layers_of_uid(ls, UID_A), 0);
    assert_null(kd_layers_find(ls, "y", UID_A)); /* uid 0's own */
    assert_non_null(kd_layers_find(ls, "y", 0));

    assert_int_equal(reg(ls, "x", w1, UID_B, &created, &e), KP_OK);
    assert_false(created);
    assert_int_equal(x->regs, 1); /* the configuration's take no registrations */
    expect_code(reg(ls, "x", w2, UID_B, &created, &e), &e, KP_E_LAYER_EXISTS,
                "is a layer of the daemon's configuration");
    kp_layer_drop_result dr;
    expect_code(kd_layers_drop(ls, "x", UID_A, &dr, &e), &e, KP_E_PERMISSION_DENIED,
                "comes from the daemon's configuration");

    /* the same file again changes nothing; a file without it removes it */
    assert_int_equal(kd_layers_sync_config(ls, &cfg, err, sizeof(err)), 0);
    assert_ptr_equal(kd_layers_find(ls, "x", UID_A), x);
    cfg.nlayers = 0;
    assert_int_equal(kd_layers_sync_config(ls, &cfg, err, sizeof(err)), 0);
    assert_null(kd_layers_find(ls, "x", UID_A));
    assert_null(kd_layers_find(ls, "x", 0));
    assert_int_equal(reg(ls, "x", w2, UID_A, &created, &e), KP_OK);
    assert_true(created);
    assert_int_equal(ls->n, 2);
    unlink(path);
}

/* Thousands of layers registered and dropped at random, against a model of which live. */
static void test_many_layers(void **state)
{
    fixture *f = *state;
    kd_layers *ls = &f->ls;
    enum { UIDS = 8, NAMES = 600, ROUNDS = 20000 };
    static bool live[UIDS][NAMES];
    memset(live, 0, sizeof(live));
    uint32_t nlive = 0, seed = 7;
    char name[32];
    for (int round = 0; round < ROUNDS; round++) {
        seed = seed * 1664525u + 1013904223u;
        uint32_t u = (seed >> 8) % UIDS, k = (seed >> 16) % NAMES;
        snprintf(name, sizeof(name), "model.layers.%u.attn", k);
        kp_error e;
        if (!live[u][k] || (seed & 0x80)) { /* register (again) */
            bool created;
            assert_int_equal(reg(ls, name, &f->w1, 1000 + u, &created, &e), KP_OK);
            assert_int_equal(created, !live[u][k]);
            nlive += !live[u][k];
            live[u][k] = true;
        } else {
            kp_layer_drop_result dr;
            assert_int_equal(kd_layers_drop(ls, name, 1000 + u, &dr, &e), KP_OK);
            if (dr.removed) {
                live[u][k] = false;
                nlive--;
            }
        }
    }
    assert_int_equal(ls->n, nlive);
    assert_true(nlive > 1000);
    for (uint32_t u = 0; u < UIDS; u++) {
        uint32_t mine = 0;
        for (uint32_t k = 0; k < NAMES; k++) {
            snprintf(name, sizeof(name), "model.layers.%u.attn", k);
            kd_layer *l = kd_layers_find(ls, name, 1000 + u);
            if (!live[u][k]) {
                assert_null(l);
                continue;
            }
            mine++;
            assert_non_null(l);
            assert_int_equal(l->uid, 1000 + u);
            assert_string_equal(l->name, name);
        }
        assert_int_equal(kd_layers_of_uid(ls, 1000 + u), mine);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_names_per_uid, fixture_setup, fixture_teardown),
        cmocka_unit_test_setup_teardown(test_config_names, fixture_setup, fixture_teardown),
        cmocka_unit_test_setup_teardown(test_many_layers, fixture_setup, fixture_teardown),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
