/*
 * errors.c - the client's error table (KDAC_ERRORS in kdaclient.h) as
 * lookups.  Wire codes (the daemon's) are the codec's: their names, messages
 * and retryable flags come from its table (kp_code_*), and the assertions
 * below fail the build if kdaclient.h's numbers drift from it.  The rows
 * here are the client's own codes (-100 and below).
 */
#include <stdarg.h>
#include <stdio.h>

#include "client_int.h"

#define KDAC_SAME_CODE(name, code, retryable, closes, message)                          \
    _Static_assert((int)KDAC_E_##name == (int)KP_E_##name, "KDAC_E_" #name " differs"); \
    _Static_assert(retryable == 0 || retryable == 1, #name);
KP_ERRORS(KDAC_SAME_CODE)
#undef KDAC_SAME_CODE
_Static_assert(KDAC_PROTOCOL_VERSION == KP_PROTOCOL_VERSION, "protocol version");
_Static_assert(KDAC_HEAD_DIM == KP_HEAD_DIM, "head dim");
_Static_assert(KDAC_NAME_MAX == KP_NAME_MAX, "name max");
_Static_assert(KDAC_TEXT_MAX == KP_TEXT_MAX, "text max");
_Static_assert(KDAC_ERRMSG_MAX == KP_ERRMSG_MAX, "message size");
_Static_assert(KDAC_CUDA_IPC_HANDLE_BYTES == KP_CUDA_IPC_HANDLE_BYTES, "ipc handle");
_Static_assert(KDAC_TENSOR_ALIGN == KP_TENSOR_ALIGN, "tensor alignment");
_Static_assert(KDAC_HIST_MAX_BUCKETS == KP_HIST_MAX_BUCKETS, "histogram");
_Static_assert((int)KDAC_DTYPE_BF16 == (int)KP_DTYPE_BF16 && (int)KDAC_DTYPE_F32 == (int)KP_DTYPE_F32,
               "dtypes");
_Static_assert(KDAC_TRANSPORT_INLINE == KP_TRANSPORT_INLINE && KDAC_TRANSPORT_SHM == KP_TRANSPORT_SHM &&
                   KDAC_TRANSPORT_CUDA_IPC == KP_TRANSPORT_CUDA_IPC,
               "transport bits");
_Static_assert(KDAC_TRANSPORT_ID_INLINE == KP_TRANSPORT_ID_INLINE &&
                   KDAC_TRANSPORT_ID_SHM == KP_TRANSPORT_ID_SHM &&
                   KDAC_TRANSPORT_ID_CUDA_IPC == KP_TRANSPORT_ID_CUDA_IPC &&
                   KP_TRANSPORT_ID_COUNT == 3,
               "transport ids");
_Static_assert((int)KDAC_SLOT_READY == (int)KP_SLOT_READY && (int)KDAC_SLOT_EMPTY == (int)KP_SLOT_EMPTY &&
                   (int)KDAC_SLOT_LOST == (int)KP_SLOT_LOST,
               "slot status");

typedef struct error_entry {
    int code;
    const char *name;
    const char *message;
    bool retryable;
} error_entry;

/* Every row of kdaclient.h's table; only the client's own (-100 and below)
 * are looked up here, the wire's come from the codec. */
static const error_entry error_table[] = {
#define KDAC_TABLE_ENTRY(name, code, retryable, message) {code, #name, message, retryable},
    KDAC_ERRORS(KDAC_TABLE_ENTRY)
#undef KDAC_TABLE_ENTRY
};

static const error_entry *client_find(int code)
{
    if (code > -100)
        return NULL; /* the wire's range */
    for (size_t i = 0; i < sizeof(error_table) / sizeof(error_table[0]); i++) {
        if (error_table[i].code == code)
            return &error_table[i];
    }
    return NULL;
}

const char *kdac_err_name(int code)
{
    if (code == KDAC_OK)
        return "OK";
    if (kp_code_known(code))
        return kp_code_name(code);
    const error_entry *e = client_find(code);
    return e ? e->name : "UNKNOWN_CODE";
}

const char *kdac_strerror(int code)
{
    if (code == KDAC_OK)
        return "success";
    if (kp_code_known(code))
        return kp_code_message(code);
    const error_entry *e = client_find(code);
    return e ? e->message : "unknown error code";
}

bool kdac_err_retryable(int code)
{
    if (kp_code_known(code))
        return kp_code_retryable(code);
    const error_entry *e = client_find(code);
    return e && e->retryable;
}

int kdac_fail(kdac_error *err, int code, const char *fmt, ...)
{
    if (!err)
        return code;
    err->code = code;
    err->retryable = kdac_err_retryable(code);
    if (!fmt) {
        snprintf(err->message, sizeof(err->message), "%s", kdac_strerror(code));
        return code;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof(err->message), fmt, ap);
    va_end(ap);
    return code;
}

int kdac_from_kp(kdac_error *err, const kp_error *e)
{
    if (err) {
        err->code = e->code;
        err->retryable = e->retryable;
        snprintf(err->message, sizeof(err->message), "%s", e->message);
    }
    return e->code;
}
