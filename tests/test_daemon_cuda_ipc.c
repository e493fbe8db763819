/*
 * test_daemon_cuda_ipc.c - kdad's CUDA regions on the GPU: the client (this
 * process) holds q/k/v/g/beta and the output in device memory, registers it
 * (a cudaMalloc allocation by its IPC handle, or a VMM allocation by the
 * POSIX fd it exports), and the kernel reads and writes it in place.  The
 * result must equal the inline path bit for bit.  Also the daemon's GPU as
 * hello names it (UUID, PCI bus id), memory on another GPU refused, and
 * `device:` given as a UUID prefix.  Exits 77 (a skip) without a usable GPU.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <unistd.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "daemon_harness.h"

#define CUDA_OK(call)                                                              \
    do {                                                                           \
        cudaError_t e_ = (call);                                                   \
        if (e_ != cudaSuccess)                                                     \
            fail_msg("%s: %s", #call, cudaGetErrorString(e_));                     \
    } while (0)

static const char yaml[] = "heads: 4\nslots: 16\nlog:\n  level: debug\n";

/* A driver call through the runtime (the test does not link libcuda). */
static void *driver_call(const char *name)
{
    enum cudaDriverEntryPointQueryResult found;
    void *fn = NULL;
    CUDA_OK(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found));
    assert_int_equal(found, cudaDriverEntryPointSuccess);
    return fn;
}

#define DRV_OK(call)                                                               \
    do {                                                                           \
        CUresult r_ = (call);                                                      \
        if (r_ != CUDA_SUCCESS)                                                    \
            fail_msg("%s: driver error %d", #call, (int)r_);                       \
    } while (0)

/* Device memory of at least `bytes`: cudaMalloc, or a VMM allocation exported as a POSIX fd. */
typedef struct dev_mem {
    uint8_t *ptr;
    bool vmm;
    size_t size;                        /* VMM: the mapped (granularity-rounded) size */
    CUmemGenericAllocationHandle alloc; /* VMM */
    int fd;                             /* VMM: the export, for region.register_cuda */
} dev_mem;

static void dev_alloc(dev_mem *m, size_t bytes, bool vmm)
{
    memset(m, 0, sizeof(*m));
    m->fd = -1;
    m->vmm = vmm;
    if (!vmm) {
        CUDA_OK(cudaMalloc((void **)&m->ptr, bytes));
        m->size = bytes;
        return;
    }
    int device = 0;
    CUDA_OK(cudaGetDevice(&device));
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof(prop));
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CUresult (*granularity)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags) =
        driver_call("cuMemGetAllocationGranularity");
    CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                       unsigned long long) = driver_call("cuMemCreate");
    CUresult (*reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long) =
        driver_call("cuMemAddressReserve");
    CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long) =
        driver_call("cuMemMap");
    CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t) =
        driver_call("cuMemSetAccess");
    CUresult (*export)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                       unsigned long long) = driver_call("cuMemExportToShareableHandle");
    size_t gran = 0;
    DRV_OK(granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    m->size = (bytes + gran - 1) / gran * gran;
    DRV_OK(create(&m->alloc, m->size, &prop, 0));
    CUdeviceptr p = 0;
    DRV_OK(reserve(&p, m->size, gran, 0, 0));
    DRV_OK(map(p, m->size, 0, m->alloc, 0));
    const CUmemAccessDesc access = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device},
                                    .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    DRV_OK(set_access(p, m->size, &access, 1));
    DRV_OK(export(&m->fd, m->alloc, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    m->ptr = (uint8_t *)(uintptr_t)p;
}

static void dev_free(dev_mem *m)
{
    if (!m->vmm) {
        CUDA_OK(cudaFree(m->ptr));
        return;
    }
    CUresult (*unmap)(CUdeviceptr, size_t) = driver_call("cuMemUnmap");
    CUresult (*free_va)(CUdeviceptr, size_t) = driver_call("cuMemAddressFree");
    CUresult (*release)(CUmemGenericAllocationHandle) = driver_call("cuMemRelease");
    CUdeviceptr p = (CUdeviceptr)(uintptr_t)m->ptr;
    DRV_OK(unmap(p, m->size));
    DRV_OK(free_va(p, m->size));
    DRV_OK(release(m->alloc));
    if (m->fd >= 0)
        close(m->fd);
}

/* region.register_cuda for m's first `size` bytes: the region id, or 0 after the error
 * `code` (mentioning `what`) when code is not KP_OK. */
static uint32_t register_mem(dh_client *c, const char *uuid, const dev_mem *m, uint64_t size,
                             int code, const char *what)
{
    cudaIpcMemHandle_t h;
    kp_region_register_cuda_params rp = {size, uuid, KP_CUDA_HANDLE_POSIX_FD, NULL};
    if (!m->vmm) {
        CUDA_OK(cudaIpcGetMemHandle(&h, m->ptr));
        rp.handle_type = KP_CUDA_HANDLE_IPC;
        rp.handle = &h;
    }
    uint32_t id = dh_id(c);
    assert_int_equal(kp_region_register_cuda_params_encode(&c->w, id, &rp, NULL), KP_OK);
    if (m->vmm)
        dh_send_fd(c, m->fd);
    else
        dh_send(c);
    if (code != KP_OK) {
        dh_expect_error(c, id, code, what);
        return 0;
    }
    dh_expect_result(c, id);
    kp_region_register_result rr;
    assert_int_equal(kp_region_register_result_decode(&c->msg, &rr, NULL), KP_OK);
    return rr.region;
}

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

/* A prefill whose tensors live in the client's device memory equals the inline one bit for
 * bit; a snapshot goes straight into it; conversions into it and references past it are
 * refused. */
static void region_prefill_matches_inline(bool vmm)
{
    dh_daemon d;
    dh_client c;
    dh_layer l;
    dh_seq s;
    test_rng r;
    char uuid[KP_TEXT_MAX];
    dh_start_or_skip(&d, yaml);
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
    dev_mem mem;
    dev_alloc(&mem, at, vmm);
    uint8_t *dev = mem.ptr;
    const uint16_t *src[5] = {s.q, s.k, s.v, s.g, s.beta};
    for (int t = 0; t < 5; t++)
        CUDA_OK(cudaMemcpy(dev + off[t], src[t],
                           t == KP_TENSOR_BETA ? DH_BETA_BYTES(len) : DH_TOKEN_BYTES(len),
                           cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(dev + off[KP_TENSOR_OUT], 0xff, DH_TOKEN_BYTES(len)));
    CUDA_OK(cudaDeviceSynchronize()); /* rule 1: inputs are complete before the request */
    /* more than the allocation holds is refused, and the allocation stays usable */
    register_mem(&c, uuid, &mem, mem.size + (64u << 20), KP_E_REGION_INVALID, "exceed the allocation");
    const uint32_t region = register_mem(&c, uuid, &mem, at, KP_OK, NULL);
    /* a cudaMalloc allocation whose size is not a multiple of 64 KiB is read slower through
       IPC (bench/bench_ipc.cu): the daemon says so, and only for such a one */
    char *log = dh_log(&d);
    const bool warned = strstr(log, "not a multiple of 64 KiB") != NULL;
    free(log);
    assert_true(warned == (!vmm && mem.size % (64u << 10) != 0));

    kp_prefill_seq q;
    memset(&q, 0, sizeof(q));
    q.slot = a;
    q.len = len;
    for (int t = 0; t < KP_PREFILL_TENSORS; t++)
        q.tensors[t] = kp_ref_region(region, off[t], t == KP_TENSOR_BETA ? DH_BETA_BYTES(len)
                                                                            : DH_TOKEN_BYTES(len));
    kp_prefill_params p = {.layer = "L", .seqs = &q, .nseqs = 1};
    uint32_t id = dh_id(&c);
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
    sp.out = kp_ref_region(region, off[KP_PREFILL_TENSORS], DH_STATE_ELEMS * 4);
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

    kp_region_release_params rel = {region};
    id = dh_id(&c);
    assert_int_equal(kp_region_release_params_encode(&c.w, id, &rel, NULL), KP_OK);
    dh_send(&c);
    dh_expect_result(&c, id);
    dev_free(&mem);
    free(via_ipc);
    free(via_inline);
    free(st);
    free(st2);
    dh_seq_free(&s);
    dh_close(&c);
    dh_stop(&d);
}

/* The daemon's GPU as the CUDA runtime of this process sees device `index`. */
static void gpu_ids(int index, char *uuid, size_t usize, char *pci, size_t psize)
{
    struct cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, index));
    const unsigned char *b = (const unsigned char *)prop.uuid.bytes;
    snprintf(uuid, usize, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12],
             b[13], b[14], b[15]);
    CUDA_OK(cudaDeviceGetPCIBusId(pci, (int)psize, index));
    for (char *p = pci; *p; p++)
        *p = (char)tolower((unsigned char)*p);
}

/* hello names the GPU by UUID and PCI bus id; memory on another GPU is refused, both by a
 * UUID that is not the daemon's and (with two GPUs) by a real allocation on the other one. */
static void test_other_gpu_refused(void **unused)
{
    dh_daemon d;
    dh_client c;
    char uuid[KP_TEXT_MAX], want_uuid[64], pci[32];
    dh_start_or_skip(&d, yaml);
    dh_connect(&c, &d);
    kp_hello_params hp = {{KP_PROTOCOL_VERSION}, 1, "cuda_ipc test"};
    uint32_t id = dh_id(&c);
    assert_int_equal(kp_hello_params_encode(&c.w, id, &hp, NULL), KP_OK);
    dh_send(&c);
    dh_expect_result(&c, id);
    kp_hello_result r;
    assert_int_equal(kp_hello_result_decode(&c.msg, &r, NULL), KP_OK);
    assert_true(r.has_gpu);
    gpu_ids(0, want_uuid, sizeof(want_uuid), pci, sizeof(pci));
    assert_string_equal(r.gpu.uuid, want_uuid);
    assert_int_equal(r.gpu.index, 0);
    assert_non_null(r.gpu.pci_bus_id);
    assert_string_equal(r.gpu.pci_bus_id, pci);
    int mps = 0; /* the daemon runs beside this process: under MPS both are */
    assert_int_equal(cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, 0), cudaSuccess);
    assert_int_equal(r.gpu.mps, mps != 0);
    snprintf(uuid, sizeof(uuid), "%s", r.gpu.uuid);
    kp_session_from_hello(&c.session, &r);

    dev_mem mem;
    dev_alloc(&mem, 2u << 20, false);
    /* a UUID of no GPU of this daemon; the region stays unregistered */
    register_mem(&c, "GPU-00000000-0000-0000-0000-000000000000", &mem, 2u << 20,
                 KP_E_REGION_INVALID, "is not this daemon's GPU");
    register_mem(&c, uuid, &mem, 2u << 20, KP_OK, NULL);
    dev_free(&mem);
    int n = 0;
    CUDA_OK(cudaGetDeviceCount(&n));
    if (n >= 2) {
        char other[64], other_pci[32];
        gpu_ids(1, other, sizeof(other), other_pci, sizeof(other_pci));
        CUDA_OK(cudaSetDevice(1));
        dev_alloc(&mem, 2u << 20, false);
        register_mem(&c, other, &mem, 2u << 20, KP_E_REGION_INVALID, "is not this daemon's GPU");
        dev_free(&mem);
        CUDA_OK(cudaSetDevice(0));
    } else {
        fprintf(stderr, "note: one GPU: a real allocation on another GPU is not tried\n");
    }
    dh_close(&c);
    dh_stop(&d);
}

/* device: a UUID prefix picks that GPU; one that matches no GPU stops kdad (69), naming it. */
static void test_device_by_uuid(void **unused)
{
    char want_uuid[64], pci[32], conf[256];
    gpu_ids(0, want_uuid, sizeof(want_uuid), pci, sizeof(pci));
    snprintf(conf, sizeof(conf), "%sdevice: %.12s\n", yaml, want_uuid);
    dh_daemon d;
    dh_client c;
    dh_start_or_skip(&d, conf);
    dh_connect(&c, &d);
    kp_hello_params hp = {{KP_PROTOCOL_VERSION}, 1, "cuda_ipc test"};
    uint32_t id = dh_id(&c);
    assert_int_equal(kp_hello_params_encode(&c.w, id, &hp, NULL), KP_OK);
    dh_send(&c);
    dh_expect_result(&c, id);
    kp_hello_result r;
    assert_int_equal(kp_hello_result_decode(&c.msg, &r, NULL), KP_OK);
    assert_string_equal(r.gpu.uuid, want_uuid);
    assert_int_equal(r.gpu.index, 0);
    dh_close(&c);
    dh_stop(&d);

    snprintf(conf, sizeof(conf), "%sdevice: GPU-0123456789abcdef0123456789abcdef\n", yaml);
    if (strncmp(want_uuid, "GPU-0123456789ab", 16) == 0)
        return; /* (that would be this GPU) */
    dh_spawn(&d, conf);
    char *log = NULL;
    for (int i = 0; i < 6000; i++) { /* the message comes before the exit */
        free(log);
        log = dh_log(&d);
        if (strstr(log, "no GPU has this UUID"))
            break;
        usleep(10000);
    }
    if (!strstr(log, "no GPU has this UUID") || !strstr(log, want_uuid))
        fail_msg("kdad's log does not name the missing GPU and those present:\n%s", log);
    free(log);
    dh_expect_exit(&d, 69);
}

static void test_ipc_matches_inline(void **unused)
{
    region_prefill_matches_inline(false);
}

static void test_vmm_matches_inline(void **unused)
{
    region_prefill_matches_inline(true);
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
        cmocka_unit_test_teardown(test_vmm_matches_inline, dh_teardown),
        cmocka_unit_test_teardown(test_other_gpu_refused, dh_teardown),
        cmocka_unit_test_teardown(test_device_by_uuid, dh_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
