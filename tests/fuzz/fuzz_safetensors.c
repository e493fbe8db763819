/*
 * fuzz_safetensors.c - the safetensors reader (kdactl's prefill and layer
 * files, kdad's layer files) fed hostile bytes: every input is parsed or
 * refused with a message; a parsed file's tensors lie inside its bytes with
 * the size their dtype and shape give; and kdactl's prefill input check
 * (prefill_input_read: shapes, cu_seqlens) takes the same bytes as a file.
 *
 * A libFuzzer target (scripts/fuzz.sh safetensors); replay.c runs the same
 * function over files: ctest's fuzz_safetensors_seeds replays the seeds
 * `fuzz_seeds --safetensors` writes.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "prefill_io.h"
#include "safetensors.h"

/* Every tensor of a parsed file: inside the buffer, its size from dtype and shape. */
static void check_tensors(const st_file *f, const uint8_t *buf, size_t len)
{
    for (size_t i = 0; i < st_count(f); i++) {
        const st_tensor *t = st_at(f, i);
        uint64_t n = st_dtype_size(t->dtype);
        for (int d = 0; d < t->ndim; d++) {
            if (t->shape[d] < 0 || __builtin_mul_overflow(n, (uint64_t)t->shape[d], &n))
                abort();
        }
        const uint8_t *p = t->data;
        if (n != t->nbytes ||
            (n && (p < buf || (size_t)(p - buf) > len || n > len - (size_t)(p - buf))))
            abort(); /* a tensor the reader handed out is not where or what it says */
    }
    for (size_t i = 0; i < st_meta_count(f); i++) {
        const char *key, *value;
        if (st_meta_at(f, i, &key, &value) != 0 || !key || !value)
            abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len)
{
    char err[ST_ERRMSG_MAX] = "";
    st_file *f;
    if (st_parse(data, len, &f, err, sizeof(err)) == 0) {
        check_tensors(f, data, len);
        st_close(f);
    } else if (!err[0]) {
        abort(); /* a refusal always says why */
    }

    /* `kdactl prefill --in FILE` */
    int fd = memfd_create("fuzz.safetensors", MFD_CLOEXEC);
    if (fd < 0 || write(fd, data, len) != (ssize_t)len)
        abort();
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    prefill_input in;
    char why[512] = "";
    if (prefill_input_read(&in, path, why, sizeof(why)) == 0)
        prefill_input_free(&in);
    else if (!why[0])
        abort();
    close(fd);
    return 0;
}
