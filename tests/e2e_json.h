/*
 * e2e_json.h - checks on kdactl runs shared by the end-to-end tests: the
 * exit code (printing the output when it is not the expected one), the
 * JSON document on stdout, and fields by dotted path.  Include after
 * cmocka.h.
 */
#ifndef E2E_JSON_H
#define E2E_JSON_H

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <json-c/json.h>

#include "kdad_proc.h"

static inline void expect_exit(const cmd_result *r, int code)
{
    if (r->status != code)
        fail_msg("exit %d, expected %d\nstdout:\n%s\nstderr:\n%s", r->status, code, r->out,
                 r->err);
}

static inline void expect_text(const char *text, const char *part)
{
    if (!strstr(text, part))
        fail_msg("\"%s\" lacks \"%s\"", text, part);
}

/* stdout as JSON (the caller puts it). */
static inline json_object *json_out(const cmd_result *r)
{
    json_object *o = json_tokener_parse(r->out);
    if (!o)
        fail_msg("stdout is not JSON:\n%s\nstderr:\n%s", r->out, r->err);
    return o;
}

/* kdactl --socket sock --json ARGS... (NULL-terminated), which must exit 0:
 * its stdout as JSON (the caller puts it). */
static inline json_object *kdactl_json(const char *sock, ...)
{
    va_list ap;
    va_start(ap, sock);
    cmd_result r = kdactl_v(sock, "--json", ap);
    va_end(ap);
    expect_exit(&r, 0);
    json_object *o = json_out(&r);
    cmd_free(&r);
    return o;
}

/* The field at a dotted path ("limits.max_batch_tokens"); fails when absent. */
static inline json_object *jget(json_object *o, const char *path)
{
    char key[128];
    const char *p = path;
    while (*p) {
        size_t n = strcspn(p, ".");
        snprintf(key, sizeof(key), "%.*s", (int)n, p);
        if (!json_object_object_get_ex(o, key, &o))
            fail_msg("no field %s in %s", path, json_object_to_json_string(o));
        p += n + (p[n] == '.');
    }
    return o;
}

static inline int64_t jint(json_object *o, const char *path)
{
    return json_object_get_int64(jget(o, path));
}

static inline uint64_t juint(json_object *o, const char *path)
{
    return json_object_get_uint64(jget(o, path));
}

static inline double jdouble(json_object *o, const char *path)
{
    return json_object_get_double(jget(o, path));
}

static inline bool jbool(json_object *o, const char *path)
{
    json_object *v = jget(o, path);
    if (!json_object_is_type(v, json_type_boolean))
        fail_msg("%s is not a boolean", path);
    return json_object_get_boolean(v);
}

static inline const char *jstr(json_object *o, const char *path)
{
    return json_object_get_string(jget(o, path));
}

#endif /* E2E_JSON_H */
