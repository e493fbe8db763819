/*
 * test_proto_errors.c - the error and method tables (proto/errors.c,
 * proto/session.c) and their agreement with the spec: PROTOCOL.md's error
 * table must list exactly the rows of KP_ERRORS, in order, with the same
 * code, name, flags and message; every method has its section; the
 * annotated hello frame in the example session is what the encoder sends.
 * A change to one without the other fails here.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kdaproto.h"

#ifndef KDAD_PROTOCOL_MD
#error "KDAD_PROTOCOL_MD must name proto/PROTOCOL.md"
#endif

typedef struct table_row {
    int code;
    const char *name;
    bool retryable;
    bool closes;
    const char *message;
} table_row;

static const table_row rows[] = {
#define ROW(name, code, retryable, closes, message) {code, #name, retryable, closes, message},
    KP_ERRORS(ROW)
#undef ROW
};
#define NROWS (sizeof(rows) / sizeof(rows[0]))

static char *spec;

static int read_spec(void **state)
{
    FILE *f = fopen(KDAD_PROTOCOL_MD, "rb");
    if (!f) {
        fprintf(stderr, "cannot open %s\n", KDAD_PROTOCOL_MD);
        return -1;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    spec = malloc((size_t)n + 1);
    if (!spec || fread(spec, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        return -1;
    }
    spec[n] = '\0';
    fclose(f);
    return 0;
}

static int free_spec(void **state)
{
    free(spec);
    return 0;
}

/* The text between the line holding `begin` and the line holding `end`. */
static char *section(const char *begin, const char *end)
{
    const char *b = strstr(spec, begin);
    assert_non_null(b);
    b = strchr(b, '\n');
    assert_non_null(b);
    b++;
    const char *e = strstr(b, end);
    assert_non_null(e);
    size_t n = (size_t)(e - b);
    char *s = malloc(n + 1);
    assert_non_null(s);
    memcpy(s, b, n);
    s[n] = '\0';
    return s;
}

/* Splits a markdown table row "| a | b |" into trimmed cells, in place. */
static int split_row(char *line, char **cells, int max)
{
    int n = 0;
    char *p = strchr(line, '|');
    while (p && n < max) {
        char *next = strchr(p + 1, '|');
        if (!next)
            break;
        *next = '\0';
        char *c = p + 1;
        while (*c == ' ')
            c++;
        char *e = c + strlen(c);
        while (e > c && e[-1] == ' ')
            *--e = '\0';
        cells[n++] = c;
        p = next;
    }
    return n;
}

/* ---------------------------------------------------------------------- */
/* The table as an API                                                    */
/* ---------------------------------------------------------------------- */

static void test_table_is_well_formed(void **state)
{
    for (size_t i = 0; i < NROWS; i++) {
        assert_true(rows[i].code < 0);
        for (size_t j = 0; j < i; j++) {
            assert_int_not_equal(rows[i].code, rows[j].code);
            assert_string_not_equal(rows[i].name, rows[j].name);
        }
        assert_true(kp_code_known(rows[i].code));
        assert_string_equal(kp_code_name(rows[i].code), rows[i].name);
        assert_string_equal(kp_code_message(rows[i].code), rows[i].message);
        assert_int_equal(kp_code_retryable(rows[i].code), rows[i].retryable);
        assert_int_equal(kp_code_closes(rows[i].code), rows[i].closes);
    }
    /* The enum values are the wire codes. */
    assert_int_equal(KP_E_PROTOCOL, -1);
    assert_int_equal(KP_E_INVALID_PARAMS, -11);
    assert_int_equal(KP_E_INTERNAL, -42);
}

static void test_unknown_codes(void **state)
{
    assert_false(kp_code_known(-999));
    assert_string_equal(kp_code_name(-999), "UNKNOWN_CODE");
    assert_false(kp_code_retryable(-999));
    assert_false(kp_code_closes(-999));
    assert_string_equal(kp_code_name(KP_OK), "OK");
}

static void test_fail_formats(void **state)
{
    kp_error err;
    assert_int_equal(kp_fail(&err, KP_E_POOL_FULL, "%d of %d slots used", 64, 64),
                     KP_E_POOL_FULL);
    assert_int_equal(err.code, KP_E_POOL_FULL);
    assert_true(err.retryable);
    assert_string_equal(err.message, "64 of 64 slots used");
    assert_int_equal(kp_fail(&err, KP_E_STATE_LOST, NULL), KP_E_STATE_LOST);
    assert_false(err.retryable);
    assert_string_equal(err.message, "slot has no valid state");
    assert_int_equal(kp_fail(NULL, KP_E_BUSY, "ignored"), KP_E_BUSY);
    /* Long messages are cut, not overrun. */
    char big[2 * KP_ERRMSG_MAX];
    memset(big, 'x', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    kp_fail(&err, KP_E_INTERNAL, "%s", big);
    assert_int_equal(strlen(err.message), KP_ERRMSG_MAX - 1);
}

static void test_method_table(void **state)
{
    assert_null(kp_method_name(KP_METHOD_UNKNOWN));
    assert_null(kp_method_name(KP_METHOD_COUNT));
    for (int m = KP_METHOD_UNKNOWN + 1; m < KP_METHOD_COUNT; m++) {
        const char *name = kp_method_name((kp_method)m);
        assert_non_null(name);
        assert_int_equal(kp_method_lookup(name, strlen(name)), m);
    }
    assert_int_equal(kp_method_lookup("prefil", 6), KP_METHOD_UNKNOWN);
    assert_int_equal(kp_method_lookup("prefill\0", 8), KP_METHOD_UNKNOWN);
    assert_int_equal(kp_method_lookup("slot.read", 9), KP_METHOD_SLOT_READ);
}

/* ---------------------------------------------------------------------- */
/* The spec against the tables                                            */
/* ---------------------------------------------------------------------- */

static void test_spec_error_table_matches(void **state)
{
    char *table = section("<!-- BEGIN ERROR TABLE", "<!-- END ERROR TABLE");
    size_t row = 0;
    int line_no = 0;
    for (char *line = strtok(table, "\n"); line; line = strtok(NULL, "\n")) {
        line_no++;
        if (line_no <= 2)
            continue; /* header and alignment rows */
        char *cells[8];
        int n = split_row(line, cells, 8);
        if (n != 6)
            fail_msg("error table line \"%s\": %d cells, expected 6", line, n);
        if (row >= NROWS)
            fail_msg("PROTOCOL.md lists %s, which KP_ERRORS does not have", cells[1]);
        const table_row *r = &rows[row];
        if (atoi(cells[0]) != r->code || strcmp(cells[1], r->name) != 0)
            fail_msg("row %zu: PROTOCOL.md has %s %s, KP_ERRORS has %d %s", row, cells[0],
                     cells[1], r->code, r->name);
        if (strcmp(cells[2], r->retryable ? "yes" : "no") != 0)
            fail_msg("%s: retryable is \"%s\" in PROTOCOL.md", r->name, cells[2]);
        if (strcmp(cells[3], r->closes ? "yes" : "no") != 0)
            fail_msg("%s: closes is \"%s\" in PROTOCOL.md", r->name, cells[3]);
        if (strcmp(cells[4], r->message) != 0)
            fail_msg("%s: message \"%s\" in PROTOCOL.md, \"%s\" in KP_ERRORS", r->name,
                     cells[4], r->message);
        assert_true(strlen(cells[5]) > 0); /* every code says when it happens */
        row++;
    }
    if (row != NROWS)
        fail_msg("PROTOCOL.md lists %zu errors, KP_ERRORS has %zu", row, NROWS);
    free(table);
}

static void test_spec_has_every_method(void **state)
{
    char *methods = section("## Methods", "## Errors");
    for (int m = KP_METHOD_UNKNOWN + 1; m < KP_METHOD_COUNT; m++) {
        char heading[64];
        snprintf(heading, sizeof(heading), "\n### `%s`\n", kp_method_name((kp_method)m));
        char *at = strstr(methods, heading);
        if (!at)
            fail_msg("PROTOCOL.md has no section \"### `%s`\"", kp_method_name((kp_method)m));
        assert_null(strstr(at + 1, heading)); /* exactly one */
    }
    /* and no section for a method the codec lacks */
    for (char *h = strstr(methods, "\n### `"); h; h = strstr(h + 1, "\n### `")) {
        char *name = h + 6;
        char *end = strchr(name, '`');
        assert_non_null(end);
        if (kp_method_lookup(name, (size_t)(end - name)) == KP_METHOD_UNKNOWN)
            fail_msg("PROTOCOL.md documents \"%.*s\", which KP_METHODS lacks",
                     (int)(end - name), name);
    }
    free(methods);
}

/* The bytes before each '#' of the example block, as a byte array. */
static size_t parse_hex_block(const char *block, uint8_t *out, size_t max)
{
    size_t n = 0;
    const char *p = block;
    while (*p) {
        const char *eol = strchr(p, '\n');
        if (!eol)
            eol = p + strlen(p);
        const char *hash = memchr(p, '#', (size_t)(eol - p));
        const char *stop = hash ? hash : eol;
        for (const char *c = p; c < stop;) {
            unsigned v;
            int used;
            if (*c == ' ' || *c == '`') {
                c++;
                continue;
            }
            assert_int_equal(sscanf(c, "%2x%n", &v, &used), 1);
            assert_int_equal(used, 2);
            assert_true(n < max);
            out[n++] = (uint8_t)v;
            c += used;
        }
        p = *eol ? eol + 1 : eol;
    }
    return n;
}

static void test_spec_hello_example_is_exact(void **state)
{
    char *block = section("<!-- BEGIN HELLO EXAMPLE -->", "<!-- END HELLO EXAMPLE -->");
    uint8_t doc[256];
    size_t n = parse_hex_block(block, doc, sizeof(doc));
    free(block);

    kp_writer w;
    kp_error err;
    assert_int_equal(kp_writer_init(&w, KP_HELLO_MAX_FRAME_BYTES), KP_OK);
    kp_hello_params p = {.versions = {1}, .nversions = 1, .client = "kdactl/0.1"};
    assert_int_equal(kp_hello_params_encode(&w, 1, &p, &err), KP_OK);
    uint8_t *frame;
    size_t len;
    assert_int_equal(kp_writer_flatten(&w, &frame, &len, &err), KP_OK);
    assert_int_equal(n, len);
    assert_memory_equal(doc, frame, len);
    free(frame);
    kp_writer_close(&w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_table_is_well_formed),
        cmocka_unit_test(test_unknown_codes),
        cmocka_unit_test(test_fail_formats),
        cmocka_unit_test(test_method_table),
        cmocka_unit_test(test_spec_error_table_matches),
        cmocka_unit_test(test_spec_has_every_method),
        cmocka_unit_test(test_spec_hello_example_is_exact),
    };
    return cmocka_run_group_tests(tests, read_spec, free_spec);
}
