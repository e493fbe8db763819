/*
 * test_daemon_cuda_ipc.c - kdad's CUDA IPC regions on the GPU: the client
 * (this process) holds q/k/v/g/beta and the output in cudaMalloc'd memory,
 * registers it with its IPC handle, and the kernel reads and writes it in
 * place.  The result must equal the inline path bit for bit.  Exits 77 (a
 * skip) without a usable GPU.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "daemon_harness.h"

#define CUDA_OK(call)                                                              \
    do {                                                                           \
        cudaError_t e_ = (call);                                                   \
        if (e_ != cudaSuccess)                                                     \
            fail_msg("%s: %s", #call, cudaGetErrorString(e_));                     \
    } while (0)

static const char yaml[] = "heads: 4\nslots: 16\nlog:\n  level: debug\n";

/* hello, keeping the GPU's UUID for region.register_cuda. */
static void hello(dh_client *c, char *uuid, size_t size)
{
    kp_hello_params p = {{KP_PROTOCOL_VERSION}, 1, "cuda_ipc test"};
    uint32_t id = dh_id(c);
    assert_int_equal(kp_hello_params_encode(&c->w, id, &p, NULL), KP_OK);
    dh_send(c);
    dh_expect_result(c, id);
    kp_hello_result r;
    assert_int_equal(kp_hello_result_decode(&c->msg, &r, NULL), KP_OK);
    assert_int_equal(r.backend, KP_BACKEND_CUDA);
    assert_true(r.has_gpu);
    assert_true(r.transports & KP_TRANSPORT_CUDA_IPC);
    snprintf(uuid, size, "%s", r.gpu.uuid);
    kp_session_from_hello(&c->session, &r);
}

static void test_ipc_matches_inline(void **unused)
{
    dh_daemon d;
    dh_client c;
    dh_layer l;
    dh_seq s;
    test_rng r;
    char uuid[KP_TEXT_MAX];
    if (dh_start(&d, yaml) == 77)
        skip();
    rng_seed(&r, 31);
    dh_layer_make(&l, &r);
    dh_seq_make(&s, &r, 200);
    dh_connect(&c, &d);
    hello(&c, uuid, sizeof(uuid));
    dh_register_layer(&c, "L", &l);
    uint64_t a = dh_alloc(&c), b = dh_alloc(&c);

    /* q k v g beta out, then room for a state, 256-byte aligned in one allocation */
    const uint32_t len = 200;
    uint64_t off[KP_PREFILL_TENSORS + 1], at = 0;
    for (int t = 0; t <= KP_PREFILL_TENSORS; t++) {
        off[t] = at;
        uint64_t n = t == KP_PREFILL_TENSORS ? DH_STATE_ELEMS * 4
                     : t == KP_TENSOR_BETA   ? DH_BETA_BYTES(len)
                                             : DH_TOKEN_BYTES(len);
        at = (at + n + 255) / 256 * 256;
    }
    uint8_t *dev = NULL;
    CUDA_OK(cudaMalloc((void **)&dev, at));
    const uint16_t *src[5] = {s.q, s.k, s.v, s.g, s.beta};
    for (int t = 0; t < 5; t++)
        CUDA_OK(cudaMemcpy(dev + off[t], src[t],
                           t == KP_TENSOR_BETA ? DH_BETA_BYTES(len) : DH_TOKEN_BYTES(len),
                           cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(dev + off[KP_TENSOR_OUT], 0xff, DH_TOKEN_BYTES(len)));
    CUDA_OK(cudaDeviceSynchronize()); /* rule 1: inputs are complete before the request */
    cudaIpcMemHandle_t h;
    CUDA_OK(cudaIpcGetMemHandle(&h, dev));

    kp_region_register_cuda_params rp = {at, uuid, KP_CUDA_HANDLE_IPC, &h};
    uint32_t id = dh_id(&c);
    assert_int_equal(kp_region_register_cuda_params_encode(&c.w, id, &rp, NULL), KP_OK);
    dh_send(&c);
    dh_expect_result(&c, id);
    kp_region_register_result rr;
    assert_int_equal(kp_region_register_result_decode(&c.msg, &rr, NULL), KP_OK);

    kp_prefill_seq q;
    memset(&q, 0, sizeof(q));
    q.slot = a;
    q.len = len;
    for (int t = 0; t < KP_PREFILL_TENSORS; t++)
        q.tensors[t] = kp_ref_region(rr.region, off[t], t == KP_TENSOR_BETA ? DH_BETA_BYTES(len)
                                                                            : DH_TOKEN_BYTES(len));
    kp_prefill_params p = {"L", &q, 1};
    id = dh_id(&c);
    assert_int_equal(kp_prefill_params_encode(&c.w, id, &p, NULL), KP_OK);
    dh_send(&c);
    dh_expect_result(&c, id);

    uint16_t *via_ipc = malloc(DH_TOKEN_BYTES(len)), *via_inline = malloc(DH_TOKEN_BYTES(len));
    CUDA_OK(cudaMemcpy(via_ipc, dev + off[KP_TENSOR_OUT], DH_TOKEN_BYTES(len),
                       cudaMemcpyDeviceToHost));
    id = dh_send_prefill(&c, "L", b, &s, 0);
    dh_recv_prefill(&c, id, &s, via_inline);
    assert_memory_equal(via_ipc, via_inline, DH_TOKEN_BYTES(len));

    /* a snapshot straight into GPU memory (pool dtype: a device copy) */
    kp_slot_read_params sp;
    memset(&sp, 0, sizeof(sp));
    sp.slot = a;
    sp.out = kp_ref_region(rr.region, off[KP_PREFILL_TENSORS], DH_STATE_ELEMS * 4);
    id = dh_id(&c);
    assert_int_equal(kp_slot_read_params_encode(&c.w, id, &sp, NULL), KP_OK);
    dh_send(&c);
    dh_expect_result(&c, id);
    float *st = malloc(DH_STATE_ELEMS * 4), *st2 = malloc(DH_STATE_ELEMS * 4);
    CUDA_OK(cudaMemcpy(st, dev + off[KP_PREFILL_TENSORS], DH_STATE_ELEMS * 4,
                       cudaMemcpyDeviceToHost));
    dh_read_state(&c, b, st2);
    assert_memory_equal(st, st2, DH_STATE_ELEMS * 4);
    /* converting into GPU memory is refused */
    sp.has_dtype = true;
    sp.dtype = KP_DTYPE_BF16;
    sp.out.nbytes = DH_STATE_ELEMS * 2;
    id = dh_id(&c);
    assert_int_equal(kp_slot_read_params_encode(&c.w, id, &sp, NULL), KP_OK);
    dh_send(&c);
    dh_expect_error(&c, id, KP_E_NOT_SUPPORTED, "in GPU memory");
    /* bounds */
    q.out.offset = at;
    id = dh_id(&c);
    assert_int_equal(kp_prefill_params_encode(&c.w, id, &p, NULL), KP_OK);
    dh_send(&c);
    dh_expect_error(&c, id, KP_E_REGION_BOUNDS, "seqs[0].out");

    kp_region_release_params rel = {rr.region};
    id = dh_id(&c);
    assert_int_equal(kp_region_release_params_encode(&c.w, id, &rel, NULL), KP_OK);
    dh_send(&c);
    dh_expect_result(&c, id);
    CUDA_OK(cudaFree(dev));
    free(via_ipc);
    free(via_inline);
    free(st);
    free(st2);
    dh_seq_free(&s);
    dh_close(&c);
    dh_stop(&d);
}

int main(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        fprintf(stderr, "skipped: no CUDA device\n");
        return 77;
    }
    dh_daemon d;
    if (dh_start(&d, yaml) == 77)
        return 77;
    dh_stop(&d);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_ipc_matches_inline, dh_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
