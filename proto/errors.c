/*
 * errors.c - the error table (KP_ERRORS in kdaproto.h) as lookups, and
 * kp_fail, the one way the codec reports a failure.  The same table feeds
 * the C enum, the wire names, the default messages, the retryable flags and
 * PROTOCOL.md (checked by tests/test_proto_errors.c).
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "kdaproto.h"

typedef struct error_entry {
    int code;
    const char *name;
    const char *message;
    bool retryable;
    bool closes;
} error_entry;

static const error_entry error_table[] = {
#define KP_TABLE_ENTRY(name, code, retryable, closes, message) \
    {code, #name, message, retryable, closes},
    KP_ERRORS(KP_TABLE_ENTRY)
#undef KP_TABLE_ENTRY
};

static const error_entry *error_find(int code)
{
    for (size_t i = 0; i < sizeof(error_table) / sizeof(error_table[0]); i++) {
        if (error_table[i].code == code)
            return &error_table[i];
    }
    return NULL;
}

const char *kp_code_name(int code)
{
    if (code == KP_OK)
        return "OK";
    const error_entry *e = error_find(code);
    return e ? e->name : "UNKNOWN_CODE";
}

const char *kp_code_message(int code)
{
    if (code == KP_OK)
        return "success";
    const error_entry *e = error_find(code);
    return e ? e->message : "unknown error code";
}

bool kp_code_retryable(int code)
{
    const error_entry *e = error_find(code);
    return e && e->retryable;
}

bool kp_code_closes(int code)
{
    const error_entry *e = error_find(code);
    return e && e->closes;
}

bool kp_code_known(int code)
{
    return error_find(code) != NULL;
}

int kp_fail(kp_error *err, int code, const char *fmt, ...)
{
    if (!err)
        return code;
    err->code = code;
    err->retryable = kp_code_retryable(code);
    if (!fmt) {
        snprintf(err->message, sizeof(err->message), "%s", kp_code_message(code));
        return code;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof(err->message), fmt, ap);
    va_end(ap);
    return code;
}
