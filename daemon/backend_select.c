/*
 * backend_select.c - kd_backend_create: the configured backend, or for
 * `auto` cuda when it works and cpu otherwise.  Apart from backend.c so
 * that the backends, which use backend.c's shared parts, are called from
 * above only.
 */
#include "backend.h"

#include <stdio.h>

#include "log.h"

int kd_backend_create(uv_loop_t *loop, const kd_backend_config *cfg, kd_backend_done_cb done,
                      kd_backend_idle_cb idle, void *ctx, kd_backend **out, char *err,
                      size_t errlen)
{
    int rc = KP_E_NOT_SUPPORTED;
    *out = NULL;
    if (cfg->kind != KD_BACKEND_CPU) {
#ifdef KDAD_HAVE_CUDA
        rc = kd_backend_cuda_create(loop, cfg, out, err, errlen);
#else
        snprintf(err, errlen, "this kdad was built without the CUDA backend");
#endif
        if (rc != KP_OK && cfg->kind == KD_BACKEND_CUDA)
            return rc;
        if (rc != KP_OK)
            KD_INFO("backend auto: CPU backend chosen (%s)", err);
    }
    if (rc != KP_OK && (rc = kd_backend_cpu_create(loop, cfg, out, err, errlen)) != KP_OK)
        return rc;
    (*out)->loop = loop;
    (*out)->done = done;
    (*out)->idle = idle;
    (*out)->done_ctx = ctx;
    return KP_OK;
}
