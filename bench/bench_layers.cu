/*
 * bench_layers.cu - a serving stack's forward pass against KDA served three
 * ways: L layers on one CUDA stream, each a producer (a copy kernel moving
 * q, k, v, g, beta's bytes into the layer's input buffers), the KDA layer,
 * and a consumer (a copy kernel reading the output).
 *
 *   bench_layers --kdad PATH [--layers 20] [--passes 10] [--json FILE]
 *
 * For H = 32 and H = 96 it starts its own kdad (PATH --backend cuda --heads
 * H, on a socket in a temporary folder), then for 8192 tokens in one
 * sequence and in a mix of eight runs each variant:
 *   inproc  the kernel library (kernels/) called in this process, same stream;
 *   sync    through kdad, synchronised on the host as PROTOCOL.md's rules 1-3
 *           ask: the stream is finished before each request is sent, and the
 *           response awaited before the consumer is enqueued;
 *   stream  through kdad, stream-ordered (kdac_prefill_on_stream): the host
 *           enqueues every layer at once, the stream writes each ready word
 *           and waits for each done word; kdad launches a request once its
 *           loop has seen the word (batching.ready_on_device: false);
 *   stream-device  the same through a second kdad with ready_on_device: true,
 *           which queues each request on the GPU behind a device-side wait
 *           for its word.
 *   floor   no kdad: a second process of this program plays its part with
 *           nothing but the device-side wait, the kernel library and the
 *           done word on its own stream (enqueued for every pass at once), the
 *           first writes and waits as in stream: what any server in another
 *           process costs per layer at least (the GPU switching between two
 *           processes' contexts), whatever it does on its host.
 * Each of stream, stream-device and floor runs with its semaphore words in
 * three places (the `words` column):
 *   host    both in a shared memory region mapped for both GPUs' streams (the
 *           GPU-side waits poll host memory over PCIe);
 *   done on device  the ready word there, the done word in device memory (the
 *           client's wait polls device memory; kdad's host reads ready with a load);
 *   device  both in device memory: a block of the IPC region that holds the
 *           tensors, at an offset no tensor uses (kdad's host reads a ready word
 *           there by a small synchronous copy per check).
 * The kdad variants alternate, two rounds of `passes` each, and so do the
 * floor's placements (one server process runs them all, in the same order), so
 * that all see the same GPU; their medians are over both rounds.
 * Inputs and outputs live in device memory registered with kdad as a CUDA
 * IPC region.  Every sequence starts FRESH each pass, so all variants
 * compute the same outputs (checked bit for bit, last layer; the output
 * block is set to NaNs before each variant runs).
 *
 * Reported per (H, workload, variant, words): the median time per forward
 * pass (CUDA events around the pass on the client's stream), its ratio to
 * inproc, the median and the mean per layer of the "KDA slot" on the client's
 * stream (from the producer's end to the consumer's start; a mean above the
 * median says some layers waited much longer), the GPU idle per layer (the
 * median slot less inproc's), and for stream and floor the median host time
 * to enqueue a pass and in how many passes the host had enqueued all L layers
 * before the first layer's KDA finished.
 */
#include <algorithm>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <string>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <vector>

#include <cuda.h>

#include "kda_cuda.h"
#include "kdaclient.h"

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static void die(const char *what, const char *msg)
{
    fprintf(stderr, "bench_layers: %s: %s\n", what, msg);
    exit(1);
}

/* The producer and the consumer: 16-byte copies, grid-stride. */
__global__ void copy16(uint4 *dst, const uint4 *src, size_t n)
{
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
        dst[i] = src[i];
}

static void copy_async(void *dst, const void *src, size_t bytes, cudaStream_t st)
{
    copy16<<<1056, 256, 0, st>>>((uint4 *)dst, (const uint4 *)src, bytes / 16);
}

struct Workload {
    std::string name;
    std::vector<int64_t> lens;
};

struct Timing {
    double pass_ms;       /* median per forward pass */
    double slot_ms;       /* median per layer: producer end -> consumer start */
    double slot_mean_ms;  /* their mean (the pass less L of these: the copies, and the host when late) */
    double enqueue_ms;    /* stream, floor: median host time to enqueue a pass (else 0) */
    bool ran_ahead;       /* stream: every pass enqueued all layers before layer 0's KDA ended */
    int ahead, passes;    /* stream: how many of the passes did */
};

/* Where a variant's ready and done words live (see the top). */
enum Place { WORDS_HOST, DONE_DEVICE, WORDS_DEVICE };
static const Place places[] = {WORDS_HOST, DONE_DEVICE, WORDS_DEVICE};
static const char *const place_name[] = {"host", "done on device", "device"};

struct Row {
    int heads;
    std::string workload, variant, words;
    Timing t;
    double ratio, idle_ms;
    bool equal;
};

static double median(std::vector<double> v)
{
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
}

static double mean(const std::vector<double> &v)
{
    double sum = 0;
    for (double x : v)
        sum += x;
    return v.empty() ? 0.0 : sum / double(v.size());
}

static double now_ms()
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return double(ts.tv_sec) * 1e3 + double(ts.tv_nsec) / 1e6;
}

/* A kdad of its own on a socket in a temporary folder. */
struct Daemon {
    pid_t pid = -1;
    char dir[64] = "";
    char sock[128] = "";
};

/* ready_on_device false: a configuration file in its folder turns the device-side wait off. */
static void start_kdad(Daemon &d, const char *path, int heads, int slots, bool ready_on_device)
{
    snprintf(d.dir, sizeof d.dir, "/tmp/kdad-layers-XXXXXX");
    if (!mkdtemp(d.dir))
        die("mkdtemp", strerror(errno));
    snprintf(d.sock, sizeof d.sock, "%s/kdad.sock", d.dir);
    char h[16], s[16], conf[96];
    snprintf(h, sizeof h, "%d", heads);
    snprintf(s, sizeof s, "%d", slots);
    snprintf(conf, sizeof conf, "%s/kdad.yaml", d.dir);
    FILE *f = fopen(conf, "w");
    if (!f)
        die(conf, strerror(errno));
    fprintf(f, "batching:\n  ready_on_device: %s\n", ready_on_device ? "true" : "false");
    fclose(f);
    d.pid = fork();
    if (d.pid == 0) {
        execl(path, path, "--config", conf, "--backend", "cuda", "--heads", h, "--slots", s,
              "--socket", d.sock, "--log-level", "warning", (char *)NULL);
        _exit(127);
    }
}

static kdac_client *connect_kdad(const Daemon &d)
{
    kdac_options o;
    kdac_options_init(&o);
    o.socket_path = d.sock;
    o.timeout_ms = 120000;
    kdac_error err;
    for (int i = 0; i < 1200; i++) {
        kdac_client *c = nullptr;
        if (kdac_client_open(&c, &o, &err) == KDAC_OK)
            return c;
        int st;
        if (waitpid(d.pid, &st, WNOHANG) == d.pid)
            die("kdad exited", err.message);
        usleep(50000);
    }
    die("connecting to kdad", err.message);
    return nullptr;
}

static void stop_kdad(Daemon &d)
{
    kill(d.pid, SIGTERM);
    waitpid(d.pid, nullptr, 0);
    char cmd[96];
    snprintf(cmd, sizeof cmd, "rm -rf %s", d.dir);
    if (system(cmd) != 0)
        fprintf(stderr, "bench_layers: could not remove %s\n", d.dir);
}

/* Responses of the stream variant, counted as they come. */
struct Answers {
    int done = 0, failed = 0;
    char first_error[KDAC_ERRMSG_MAX] = "";
};

static void on_answer(kdac_client *, void *data, const kdac_result *res, int status)
{
    Answers *a = (Answers *)data;
    a->done++;
    if (status != KDAC_OK && a->failed++ == 0)
        snprintf(a->first_error, sizeof a->first_error, "%s", res->error.message);
}

/* Everything one (H, workload) needs. */
struct Setup {
    int H, L, nseq;
    int64_t T;
    std::vector<int64_t> lens, cu;
    size_t tok_bytes, beta_bytes, region_bytes;
    uint8_t *buf;          /* the IPC region: q k v g beta, out, then the device words */
    uint8_t *src;          /* the producer's source: q k v g beta bytes */
    uint8_t *resid;        /* the consumer's destination */
    size_t in_bytes;       /* q k v g beta */
    uint64_t off_q, off_k, off_v, off_g, off_out, off_beta;
    uint64_t off_words;    /* WORDS_BYTES of semaphore words: ready at 16 l, done at 16 l + 8 */
};

#define WORDS_BYTES 4096u

/* Sizes and offsets only (the floor's second process maps the buffer it is given). */
static void plan_setup(Setup &s, int H, int L, const std::vector<int64_t> &lens)
{
    s.H = H;
    s.L = L;
    s.lens = lens;
    s.nseq = int(lens.size());
    s.cu.assign(s.nseq + 1, 0);
    for (int i = 0; i < s.nseq; i++)
        s.cu[i + 1] = s.cu[i] + lens[i];
    s.T = s.cu[s.nseq];
    s.tok_bytes = size_t(s.T) * H * KDA_HEAD_DIM * 2;
    s.beta_bytes = size_t(s.T) * H * 2;
    s.off_q = 0;
    s.off_k = s.tok_bytes;
    s.off_v = 2 * s.tok_bytes;
    s.off_g = 3 * s.tok_bytes;
    s.off_beta = 4 * s.tok_bytes;              /* inputs contiguous: one producer copy */
    s.off_out = 4 * s.tok_bytes + (s.beta_bytes + 4095) / 4096 * 4096;
    s.in_bytes = 4 * s.tok_bytes + s.beta_bytes;
    s.off_words = (s.off_out + s.tok_bytes + 4095) / 4096 * 4096;
    s.region_bytes = (s.off_words + WORDS_BYTES + (2u << 20) - 1) / (2u << 20) * (2u << 20);
}

static void make_setup(Setup &s, int H, int L, const std::vector<int64_t> &lens)
{
    plan_setup(s, H, L, lens);
    CK(cudaMalloc(&s.buf, s.region_bytes));
    CK(cudaMalloc(&s.src, (s.in_bytes + 15) / 16 * 16));
    CK(cudaMalloc(&s.resid, s.tok_bytes));
    /* N(0,1)-ish bf16 inputs from the host, once: never zeros */
    std::vector<uint16_t> host(s.in_bytes / 2);
    uint64_t x = 88172645463325252ull;
    for (size_t i = 0; i < host.size(); i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        float f = float(int64_t(x % 2001) - 1000) / 1000.0f;
        uint32_t u;
        memcpy(&u, &f, 4);
        host[i] = uint16_t(u >> 16);
    }
    CK(cudaMemcpy(s.src, host.data(), s.in_bytes, cudaMemcpyHostToDevice));
    CK(cudaMemset(s.buf, 0, s.region_bytes));
}

static void free_setup(Setup &s)
{
    cudaFree(s.buf);
    cudaFree(s.src);
    cudaFree(s.resid);
}

/* Events of one pass: start, per layer after the producer and before the consumer, stop. */
struct PassEvents {
    cudaEvent_t start, stop;
    std::vector<cudaEvent_t> prod, cons;
    void init(int L)
    {
        CK(cudaEventCreate(&start));
        CK(cudaEventCreate(&stop));
        prod.resize(L);
        cons.resize(L);
        for (int i = 0; i < L; i++) {
            CK(cudaEventCreate(&prod[i]));
            CK(cudaEventCreate(&cons[i]));
        }
    }
    void destroy()
    {
        cudaEventDestroy(start);
        cudaEventDestroy(stop);
        for (size_t i = 0; i < prod.size(); i++) {
            cudaEventDestroy(prod[i]);
            cudaEventDestroy(cons[i]);
        }
    }
    /* pass ms, and each layer's slot into slots */
    double read(std::vector<double> &slots)
    {
        float ms;
        CK(cudaEventElapsedTime(&ms, start, stop));
        for (size_t i = 0; i < prod.size(); i++) {
            float sl;
            CK(cudaEventElapsedTime(&sl, prod[i], cons[i]));
            slots.push_back(sl);
        }
        return ms;
    }
};

/* The kernel library's view of the L layers over a buffer laid out as Setup says: the kernel,
 * a layer's weights, a pool of L x nseq slots, one descriptor table per layer (its own slots,
 * FRESH sequences). */
struct Layers {
    kda_cuda *cu;
    float *a_log, *dt_bias;
    kda_layer *dlayer;
    kda_pool pool;
    std::vector<kda_seq *> tables;
    int32_t *dn;
};

static void layers_init(Layers &k, const Setup &s, uint8_t *b)
{
    kda_error err;
    if (kda_cuda_create(0, &k.cu, &err) != KDA_OK)
        die("kda_cuda_create", err.msg);
    const int H = s.H, L = s.L, N = s.nseq;
    CK(cudaMalloc(&k.a_log, sizeof(float) * H));
    CK(cudaMalloc(&k.dt_bias, sizeof(float) * H * KDA_HEAD_DIM));
    std::vector<float> ha(H, 0.5f), hd(size_t(H) * KDA_HEAD_DIM, 0.25f);
    CK(cudaMemcpy(k.a_log, ha.data(), ha.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(k.dt_bias, hd.data(), hd.size() * 4, cudaMemcpyHostToDevice));
    kda_layer layer = {k.a_log, k.dt_bias, -5.0f, 0.08838834764831845f};
    CK(cudaMalloc(&k.dlayer, sizeof layer));
    CK(cudaMemcpy(k.dlayer, &layer, sizeof layer, cudaMemcpyHostToDevice));
    k.pool = {nullptr, KDA_DTYPE_F32, H, int64_t(L) * N};
    CK(cudaMalloc(&k.pool.state, size_t(L) * N * kda_slot_elems(H) * 4));
    k.tables.assign(L, nullptr);
    CK(cudaMalloc(&k.dn, sizeof(int32_t)));
    CK(cudaMemcpy(k.dn, &N, sizeof N, cudaMemcpyHostToDevice));
    for (int l = 0; l < L; l++) {
        std::vector<int64_t> slots(N);
        for (int j = 0; j < N; j++)
            slots[j] = int64_t(l) * N + j;
        std::vector<kda_seq> seqs(N);
        if (kda_seqs_from_packed(seqs.data(), N, H, s.cu.data(), s.T, slots.data(), (uint16_t *)(b + s.off_q),
                                 (uint16_t *)(b + s.off_k), (uint16_t *)(b + s.off_v), (uint16_t *)(b + s.off_g),
                                 (uint16_t *)(b + s.off_beta), (uint16_t *)(b + s.off_out), k.dlayer,
                                 &err) != KDA_OK ||
            kda_cuda_batch_check(&k.pool, seqs.data(), N, &err) != KDA_OK)
            die("descriptors", err.msg);
        for (kda_seq &q : seqs)
            q.flags = KDA_SEQ_ZERO_STATE;
        CK(cudaMalloc(&k.tables[l], sizeof(kda_seq) * N));
        CK(cudaMemcpy(k.tables[l], seqs.data(), sizeof(kda_seq) * N, cudaMemcpyHostToDevice));
    }
}

static void layers_run(Layers &k, const Setup &s, int l, cudaStream_t st)
{
    kda_error err;
    if (kda_cuda_prefill(k.cu, &k.pool, k.tables[l], k.dn, s.nseq, st, &err) != KDA_OK)
        die("kda_cuda_prefill", err.msg);
}

static void layers_free(Layers &k)
{
    for (kda_seq *t : k.tables)
        cudaFree(t);
    cudaFree(k.dn);
    cudaFree(k.pool.state);
    cudaFree(k.dlayer);
    cudaFree(k.a_log);
    cudaFree(k.dt_bias);
    kda_cuda_destroy(k.cu);
}

static Timing inproc(Setup &s, int passes, cudaStream_t st, std::vector<uint16_t> &last_out)
{
    const int L = s.L;
    uint8_t *b = s.buf;
    Layers k;
    layers_init(k, s, b);
    PassEvents ev;
    ev.init(L);
    std::vector<double> pass_ms, slots;
    for (int p = -1; p < passes; p++) { /* pass -1 warms up */
        CK(cudaEventRecord(ev.start, st));
        for (int l = 0; l < L; l++) {
            copy_async(b, s.src, s.in_bytes, st);
            CK(cudaEventRecord(ev.prod[l], st));
            layers_run(k, s, l, st);
            CK(cudaEventRecord(ev.cons[l], st));
            copy_async(s.resid, b + s.off_out, s.tok_bytes, st);
        }
        CK(cudaEventRecord(ev.stop, st));
        CK(cudaEventSynchronize(ev.stop));
        std::vector<double> sl;
        double ms = ev.read(sl);
        if (p >= 0) {
            pass_ms.push_back(ms);
            slots.insert(slots.end(), sl.begin(), sl.end());
        }
    }
    last_out.resize(s.tok_bytes / 2);
    CK(cudaMemcpy(last_out.data(), b + s.off_out, s.tok_bytes, cudaMemcpyDeviceToHost));
    ev.destroy();
    layers_free(k);
    return {median(pass_ms), median(slots), mean(slots), 0.0, false, 0, passes};
}

/* What both kdad variants share: the layer, the slots, the regions. */
struct Kdad {
    kdac_client *c;
    uint32_t region, sem_region;
    kdac_shm sems;
    uint64_t sem_dev;
    std::vector<uint64_t> slots; /* L x nseq */
};

static void kdad_setup(Kdad &k, kdac_client *c, Setup &s)
{
    kdac_error err;
    k.c = c;
    std::vector<float> ha(s.H, 0.5f), hd(size_t(s.H) * KDA_HEAD_DIM, 0.25f);
    kdac_layer layer = {"bench.kda", ha.data(), hd.data(), -5.0f, KDAC_DEFAULT_SCALE};
    if (kdac_layer_register(c, &layer, nullptr, &err) != KDAC_OK)
        die("layer.register", err.message);
    k.slots.resize(size_t(s.L) * s.nseq);
    if (kdac_slot_alloc(c, uint32_t(k.slots.size()), KDAC_SLOT_ALLOC_EMPTY, k.slots.data(), &err) != KDAC_OK)
        die("slot.alloc", err.message);
    cudaIpcMemHandle_t h;
    CK(cudaIpcGetMemHandle(&h, s.buf));
    if (kdac_region_register_cuda(c, &h, s.region_bytes, nullptr, &k.region, &err) != KDAC_OK)
        die("region.register_cuda", err.message);
    if (kdac_shm_create(&k.sems, 4096, "layers", &err) != KDAC_OK ||
        kdac_region_register_shm(c, k.sems.fd, k.sems.size, &k.sem_region, &err) != KDAC_OK ||
        kdac_shm_map_device(&k.sems, &k.sem_dev, &err) != KDAC_OK)
        die("semaphore region", err.message);
}

static void kdad_teardown(Kdad &k)
{
    kdac_error err;
    kdac_slot_free(k.c, k.slots.data(), uint32_t(k.slots.size()), &err);
    kdac_region_release(k.c, k.region, &err);
    kdac_shm_unmap_device(&k.sems);
    kdac_region_release(k.c, k.sem_region, &err);
    kdac_shm_close(&k.sems);
    kdac_layer_drop(k.c, "bench.kda", &err);
}

static std::vector<kdac_seq> layer_seqs(const Kdad &k, const Setup &s, int l)
{
    std::vector<kdac_seq> v(s.nseq);
    for (int j = 0; j < s.nseq; j++) {
        kdac_seq &q = v[j];
        memset(&q, 0, sizeof q);
        q.slot = k.slots[size_t(l) * s.nseq + j];
        q.len = uint32_t(s.lens[j]);
        q.flags = KDAC_SEQ_FRESH;
        uint64_t t = uint64_t(s.cu[j]) * s.H * KDA_HEAD_DIM * 2, bt = uint64_t(s.cu[j]) * s.H * 2;
        q.q = kdac_tensor_region(k.region, s.off_q + t);
        q.k = kdac_tensor_region(k.region, s.off_k + t);
        q.v = kdac_tensor_region(k.region, s.off_v + t);
        q.g = kdac_tensor_region(k.region, s.off_g + t);
        q.beta = kdac_tensor_region(k.region, s.off_beta + bt);
        q.out = kdac_output_region(k.region, s.off_out + t);
    }
    return v;
}

/* NaNs over the output block, so that a variant whose server left it unwritten cannot pass the
 * comparison with what the variant before it wrote there. */
static void clear_output(Setup &s, cudaStream_t st)
{
    CK(cudaMemsetAsync(s.buf + s.off_out, 0xff, s.tok_bytes, st));
    CK(cudaStreamSynchronize(st));
}

static Timing kdad_sync(Kdad &k, Setup &s, int passes, cudaStream_t st, std::vector<uint16_t> &last_out)
{
    const int L = s.L;
    clear_output(s, st);
    std::vector<std::vector<kdac_seq>> seqs(L);
    for (int l = 0; l < L; l++)
        seqs[l] = layer_seqs(k, s, l);
    PassEvents ev;
    ev.init(L);
    std::vector<double> pass_ms, slots;
    kdac_error err;
    for (int p = -1; p < passes; p++) {
        CK(cudaEventRecord(ev.start, st));
        for (int l = 0; l < L; l++) {
            copy_async(s.buf, s.src, s.in_bytes, st);
            CK(cudaEventRecord(ev.prod[l], st));
            CK(cudaStreamSynchronize(st)); /* rule 1: the inputs are written */
            if (kdac_prefill(k.c, "bench.kda", seqs[l].data(), uint32_t(s.nseq), nullptr, &err) != KDAC_OK)
                die("prefill", err.message);
            CK(cudaEventRecord(ev.cons[l], st)); /* rule 3: the response is in */
            copy_async(s.resid, s.buf + s.off_out, s.tok_bytes, st);
        }
        CK(cudaEventRecord(ev.stop, st));
        CK(cudaEventSynchronize(ev.stop));
        std::vector<double> sl;
        double ms = ev.read(sl);
        if (p >= 0) {
            pass_ms.push_back(ms);
            slots.insert(slots.end(), sl.begin(), sl.end());
        }
    }
    last_out.resize(s.tok_bytes / 2);
    CK(cudaMemcpy(last_out.data(), s.buf + s.off_out, s.tok_bytes, cudaMemcpyDeviceToHost));
    ev.destroy();
    return {median(pass_ms), median(slots), mean(slots), 0.0, false, 0, passes};
}

/* Drives the client until ev completes (a failed request releases its wait, so it does). */
static void drive_until(kdac_client *c, cudaEvent_t ev)
{
    while (cudaEventQuery(ev) == cudaErrorNotReady) {
        struct pollfd p = {kdac_client_fd(c), POLLIN, 0};
        if (kdac_client_events(c) & KDAC_WRITABLE)
            p.events |= POLLOUT;
        poll(&p, 1, 0);
        kdac_client_progress(c);
    }
    CK(cudaEventSynchronize(ev));
}

/* Accumulates its passes and slots into acc (two rounds make one Timing). */
struct StreamAcc {
    std::vector<double> pass_ms, slots, enqueue_ms;
    int ahead = 0;
    Timing timing() const
    {
        int n = int(pass_ms.size());
        return {median(pass_ms), median(slots), mean(slots), median(enqueue_ms), ahead == n, ahead, n};
    }
};

/* Layer l's ready (which 0) or done (1) word in place c: k's shared memory, or the device block of its
 * IPC region (no host address). */
static kdac_sem layer_word(const Kdad &k, const Setup &s, Place c, int l, int which, uint64_t value)
{
    uint64_t off = 16u * uint64_t(l) + 8u * which;
    if (c == WORDS_DEVICE || (c == DONE_DEVICE && which == 1))
        return {k.region, s.off_words + off, value, nullptr, (uint64_t)(uintptr_t)(s.buf + s.off_words + off)};
    return {k.sem_region, off, value, (uint8_t *)k.sems.base + off, k.sem_dev + off};
}

/* Both blocks of words back to 0 (nothing waits on them between variants). */
static void reset_words(Kdad &k, Setup &s, cudaStream_t st)
{
    memset(k.sems.base, 0, k.sems.size);
    CK(cudaMemsetAsync(s.buf + s.off_words, 0, WORDS_BYTES, st));
    CK(cudaStreamSynchronize(st));
}

static void kdad_stream(Kdad &k, Setup &s, Place c, int passes, cudaStream_t st, std::vector<uint16_t> &last_out,
                        StreamAcc &acc)
{
    const int L = s.L;
    clear_output(s, st);
    std::vector<std::vector<kdac_seq>> seqs(L);
    for (int l = 0; l < L; l++)
        seqs[l] = layer_seqs(k, s, l);
    reset_words(k, s, st);
    PassEvents ev;
    ev.init(L);
    kdac_error err;
    Answers ans;
    int sent = 0;
    for (int p = -1; p < passes; p++) {
        uint64_t value = uint64_t(p + 2); /* rises every pass: each layer's words are fresh */
        double t0 = now_ms();
        CK(cudaEventRecord(ev.start, st));
        for (int l = 0; l < L; l++) {
            copy_async(s.buf, s.src, s.in_bytes, st);
            CK(cudaEventRecord(ev.prod[l], st));
            kdac_sem ready = layer_word(k, s, c, l, 0, value), done = layer_word(k, s, c, l, 1, value);
            if (kdac_prefill_on_stream(k.c, st, "bench.kda", seqs[l].data(), uint32_t(s.nseq), &ready, &done,
                                       on_answer, &ans, &err) != KDAC_OK)
                die("prefill on stream", err.message);
            sent++;
            CK(cudaEventRecord(ev.cons[l], st));
            copy_async(s.resid, s.buf + s.off_out, s.tok_bytes, st);
        }
        CK(cudaEventRecord(ev.stop, st));
        double enq = now_ms() - t0;
        bool ahead = cudaEventQuery(ev.cons[0]) == cudaErrorNotReady;
        drive_until(k.c, ev.stop);
        std::vector<double> sl;
        double ms = ev.read(sl);
        if (p >= 0) {
            acc.pass_ms.push_back(ms);
            acc.slots.insert(acc.slots.end(), sl.begin(), sl.end());
            acc.enqueue_ms.push_back(enq);
            acc.ahead += ahead;
        }
    }
    while (ans.done < sent) {
        struct pollfd pf = {kdac_client_fd(k.c), POLLIN, 0};
        poll(&pf, 1, 100);
        if (kdac_client_progress(k.c) != KDAC_OK)
            break;
    }
    if (ans.failed)
        die("a stream-ordered prefill failed", ans.first_error);
    last_out.resize(s.tok_bytes / 2);
    CK(cudaMemcpy(last_out.data(), s.buf + s.off_out, s.tok_bytes, cudaMemcpyDeviceToHost));
    ev.destroy();
}

/* Stream memory operations through the driver (the runtime has none). */
typedef CUresult (*value64_fn)(CUstream s, CUdeviceptr addr, cuuint64_t value, unsigned flags);

static value64_fn driver_value64(const char *name)
{
    void *fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    CK(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found));
    if (!fn)
        die(name, "not in this driver");
    return (value64_fn)fn;
}

/* A floor run's word of layer l (which 0: ready, 1: done) in place c, as a device address: the shared
 * memory's mapping (host) or the IPC region's word block (device). */
static uint64_t floor_word(uint64_t host_dev, const Setup &s, Place c, int l, int which)
{
    uint64_t off = 16u * uint64_t(l) + 8u * which;
    if (c == WORDS_DEVICE || (c == DONE_DEVICE && which == 1))
        return (uint64_t)(uintptr_t)(s.buf + s.off_words + off);
    return host_dev + off;
}

/* The value of pass p of the floor's run r: rising over every run, so that no word needs a reset. */
static uint64_t floor_value(int r, int passes, int p)
{
    return uint64_t(r) * uint64_t(passes + 1) + uint64_t(p + 2);
}

/* The floor's server: H L passes lens ipc-handle(hex) words-fd words-bytes runs (one place digit a
 * run).  Waits for each layer's ready word, runs it, writes its done word (values and places as
 * floor_pair's), for every pass of every run. */
static int floor_server(char **a)
{
    const int H = atoi(a[0]), L = atoi(a[1]), passes = atoi(a[2]);
    std::vector<int64_t> lens;
    for (char *p = a[3]; *p;) {
        lens.push_back(strtoll(p, &p, 10));
        if (*p == ',')
            p++;
    }
    cudaIpcMemHandle_t h;
    for (size_t i = 0; i < sizeof h; i++)
        sscanf(a[4] + 2 * i, "%2hhx", (unsigned char *)&h + i);
    const int fd = atoi(a[5]);
    const size_t bytes = strtoull(a[6], nullptr, 10);
    const std::string runs = a[7];
    Setup s;
    plan_setup(s, H, L, lens);
    CK(cudaIpcOpenMemHandle((void **)&s.buf, h, cudaIpcMemLazyEnablePeerAccess));
    void *words = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (words == MAP_FAILED)
        die("mmap", strerror(errno));
    CK(cudaHostRegister(words, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable));
    uint64_t dev;
    CK(cudaHostGetDevicePointer((void **)&dev, words, 0));
    value64_fn wait64 = driver_value64("cuStreamWaitValue64"), write64 = driver_value64("cuStreamWriteValue64");
    Layers k;
    layers_init(k, s, s.buf);
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    for (size_t r = 0; r < runs.size(); r++) {
        Place c = Place(runs[r] - '0');
        for (int p = -1; p < passes; p++) {
            for (int l = 0; l < L; l++) {
                uint64_t value = floor_value(int(r), passes, p);
                if (wait64((CUstream)st, floor_word(dev, s, c, l, 0), value, CU_STREAM_WAIT_VALUE_GEQ) !=
                    CUDA_SUCCESS)
                    die("floor", "cuStreamWaitValue64");
                layers_run(k, s, l, st);
                if (write64((CUstream)st, floor_word(dev, s, c, l, 1), value, 0) != CUDA_SUCCESS)
                    die("floor", "cuStreamWriteValue64");
            }
        }
    }
    CK(cudaStreamSynchronize(st));
    layers_free(k);
    return 0;
}

/* The floor's client: kdad_stream's loop against floor_server, `rounds` rounds of every place in
 * `places` order, one server for all; words in k's semaphore region or the IPC region's word block.
 * acc and equal: one per place. */
static void floor_pair(Kdad &k, Setup &s, int passes, int rounds, cudaStream_t st,
                       const std::vector<uint16_t> &ref, std::vector<StreamAcc> &acc, std::vector<bool> &equal)
{
    const int L = s.L;
    const int nplaces = int(sizeof places / sizeof places[0]);
    reset_words(k, s, st);
    cudaIpcMemHandle_t h;
    CK(cudaIpcGetMemHandle(&h, s.buf));
    char hex[2 * sizeof h + 1], args[4][32];
    for (size_t i = 0; i < sizeof h; i++)
        snprintf(hex + 2 * i, 3, "%02x", ((unsigned char *)&h)[i]);
    std::string lens, runs;
    for (int64_t n : s.lens)
        lens += (lens.empty() ? "" : ",") + std::to_string(n);
    for (int r = 0; r < rounds; r++)
        for (Place c : places)
            runs += char('0' + c);
    int fd = dup(k.sems.fd); /* without close-on-exec */
    snprintf(args[0], sizeof args[0], "%d", s.H);
    snprintf(args[1], sizeof args[1], "%d", L);
    snprintf(args[2], sizeof args[2], "%d", passes);
    snprintf(args[3], sizeof args[3], "%d", fd);
    char bytes[32];
    snprintf(bytes, sizeof bytes, "%llu", (unsigned long long)k.sems.size);
    pid_t pid = fork();
    if (pid == 0) {
        execl("/proc/self/exe", "bench_layers", "--floor-server", args[0], args[1], args[2], lens.c_str(), hex,
              args[3], bytes, runs.c_str(), (char *)nullptr);
        _exit(127);
    }
    close(fd);
    value64_fn wait64 = driver_value64("cuStreamWaitValue64"), write64 = driver_value64("cuStreamWriteValue64");
    PassEvents ev;
    ev.init(L);
    acc.assign(nplaces, StreamAcc());
    equal.assign(nplaces, true);
    for (size_t r = 0; r < runs.size(); r++) {
        Place c = Place(runs[r] - '0');
        clear_output(s, st);
        for (int p = -1; p < passes; p++) {
            uint64_t value = floor_value(int(r), passes, p);
            double t0 = now_ms();
            CK(cudaEventRecord(ev.start, st));
            for (int l = 0; l < L; l++) {
                copy_async(s.buf, s.src, s.in_bytes, st);
                CK(cudaEventRecord(ev.prod[l], st));
                if (write64((CUstream)st, floor_word(k.sem_dev, s, c, l, 0), value, 0) != CUDA_SUCCESS ||
                    wait64((CUstream)st, floor_word(k.sem_dev, s, c, l, 1), value, CU_STREAM_WAIT_VALUE_GEQ) !=
                        CUDA_SUCCESS)
                    die("floor", "stream memory operations");
                CK(cudaEventRecord(ev.cons[l], st));
                copy_async(s.resid, s.buf + s.off_out, s.tok_bytes, st);
            }
            CK(cudaEventRecord(ev.stop, st));
            double enq = now_ms() - t0;
            bool ahead = cudaEventQuery(ev.cons[0]) == cudaErrorNotReady;
            while (cudaEventQuery(ev.stop) == cudaErrorNotReady) {
                int status;
                if (waitpid(pid, &status, WNOHANG) == pid)
                    die("floor", "its server exited early");
            }
            std::vector<double> sl;
            double ms = ev.read(sl);
            if (p >= 0) {
                acc[c].pass_ms.push_back(ms);
                acc[c].slots.insert(acc[c].slots.end(), sl.begin(), sl.end());
                acc[c].enqueue_ms.push_back(enq);
                acc[c].ahead += ahead;
            }
        }
        /* the server finished this run's kernels before their done words: the output is the last layer's */
        std::vector<uint16_t> out(s.tok_bytes / 2);
        CK(cudaMemcpy(out.data(), s.buf + s.off_out, s.tok_bytes, cudaMemcpyDeviceToHost));
        equal[c] = equal[c] && out == ref;
    }
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        die("floor", "its server failed");
    ev.destroy();
}

int main(int argc, char **argv)
{
    if (argc == 10 && !strcmp(argv[1], "--floor-server"))
        return floor_server(argv + 2);
    const char *kdad = nullptr, *json = nullptr;
    int L = 20, passes = 10;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--kdad") && i + 1 < argc)
            kdad = argv[++i];
        else if (!strcmp(argv[i], "--layers") && i + 1 < argc)
            L = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--passes") && i + 1 < argc)
            passes = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--json") && i + 1 < argc)
            json = argv[++i];
        else {
            fprintf(stderr, "usage: %s --kdad PATH [--layers N] [--passes N] [--json FILE]\n", argv[0]);
            return 2;
        }
    }
    if (!kdad || L < 1 || L > 200 || passes < 1)
        die("arguments", "--kdad PATH is required; 1 <= layers <= 200; passes >= 1");
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        fprintf(stderr, "bench_layers: no GPU\n");
        return 77;
    }
    const std::vector<Workload> workloads = {
        {"8192 x 1", {8192}},
        {"mix of 8", {2048, 1536, 1280, 1024, 768, 640, 512, 384}},
    };
    std::vector<Row> rows;
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    for (int H : {32, 96}) {
        Daemon d, dh; /* ready_on_device on and off */
        start_kdad(d, kdad, H, 256, true);
        start_kdad(dh, kdad, H, 256, false);
        kdac_client *c = connect_kdad(d), *ch = connect_kdad(dh);
        for (const Workload &w : workloads) {
            Setup s;
            make_setup(s, H, L, w.lens);
            std::vector<uint16_t> o_in, o_sync;
            Timing ti = inproc(s, passes, st, o_in);
            Kdad k, kh;
            kdad_setup(k, c, s);
            kdad_setup(kh, ch, s);
            Timing ts = kdad_sync(k, s, passes, st, o_sync);
            /* per place: the host path (kh), the device-side wait (k), the floor */
            const int np = int(sizeof places / sizeof places[0]);
            std::vector<StreamAcc> ahost(np), adev(np), afloor;
            std::vector<bool> equal_host(np, true), equal_dev(np, true), equal_floor;
            std::vector<uint16_t> o;
            for (int round = 0; round < 2; round++) {
                for (Place c : places) {
                    kdad_stream(kh, s, c, passes, st, o, ahost[c]);
                    equal_host[c] = equal_host[c] && o == o_in;
                }
                for (Place c : places) {
                    kdad_stream(k, s, c, passes, st, o, adev[c]);
                    equal_dev[c] = equal_dev[c] && o == o_in;
                }
            }
            floor_pair(k, s, passes, 2, st, o_in, afloor, equal_floor);
            kdad_teardown(k);
            kdad_teardown(kh);
            free_setup(s);
            rows.push_back({H, w.name, "inproc", "-", ti, 1.0, 0.0, true});
            rows.push_back({H, w.name, "sync", "-", ts, ts.pass_ms / ti.pass_ms, ts.slot_ms - ti.slot_ms,
                            o_sync == o_in});
            const struct {
                const char *name;
                std::vector<StreamAcc> &acc;
                std::vector<bool> &equal;
            } kinds[] = {{"stream", ahost, equal_host}, {"stream-device", adev, equal_dev},
                         {"floor", afloor, equal_floor}};
            fprintf(stderr, "H%d %s: inproc %.3f ms, sync %.3f ms", H, w.name.c_str(), ti.pass_ms, ts.pass_ms);
            for (const auto &kd : kinds) {
                for (Place c : places) {
                    Timing t = kd.acc[c].timing();
                    rows.push_back({H, w.name, kd.name, place_name[c], t, t.pass_ms / ti.pass_ms,
                                    t.slot_ms - ti.slot_ms, kd.equal[c]});
                    fprintf(stderr, ", %s (words %s) %.3f ms", kd.name, place_name[c], t.pass_ms);
                }
            }
            fprintf(stderr, " per pass\n");
        }
        kdac_client_close(c);
        kdac_client_close(ch);
        stop_kdad(d);
        stop_kdad(dh);
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("\nlayer loop on %s: %d layers (producer copy, KDA, consumer copy) per forward pass, median of %d "
           "passes (two rounds each for stream and floor); slot = producer end -> consumer start per layer "
           "(median; mean), idle = slot - inproc slot, enq = host ms to enqueue a pass, ahead = passes whose "
           "host enqueued all layers before the first layer's KDA ended\n",
           prop.name, L, passes);
    printf("%-4s %-9s %-13s %-14s %9s %8s %8s %8s %8s %7s %7s %7s\n", "H", "workload", "variant", "words", "pass ms",
           "ratio", "slot ms", "mean", "idle ms", "enq ms", "out ==", "ahead");
    for (const Row &r : rows) {
        char ahead[16] = "-";
        if (r.variant != "inproc" && r.variant != "sync")
            snprintf(ahead, sizeof ahead, "%d/%d", r.t.ahead, r.t.passes);
        printf("%-4d %-9s %-13s %-14s %9.3f %7.3fx %8.3f %8.3f %8.3f %7.3f %7s %7s\n", r.heads,
               r.workload.c_str(), r.variant.c_str(), r.words.c_str(), r.t.pass_ms, r.ratio, r.t.slot_ms,
               r.t.slot_mean_ms, r.idle_ms, r.t.enqueue_ms, r.equal ? "yes" : "NO", ahead);
    }
    if (json) {
        FILE *f = fopen(json, "w");
        if (!f)
            die(json, strerror(errno));
        fprintf(f, "[\n");
        for (size_t i = 0; i < rows.size(); i++) {
            const Row &r = rows[i];
            fprintf(f,
                    "  {\"bench\": \"layers\", \"heads\": %d, \"workload\": \"%s\", \"variant\": \"%s\", "
                    "\"words\": \"%s\", \"layers\": %d, \"pass_ms\": %.4f, \"ratio_to_inproc\": %.4f, "
                    "\"slot_ms\": %.4f, \"slot_mean_ms\": %.4f, \"idle_ms_per_layer\": %.4f, \"enqueue_ms\": %.4f, "
                    "\"out_equal\": %s, \"ran_ahead\": %s, \"ahead_passes\": %d, \"passes\": %d}%s\n",
                    r.heads, r.workload.c_str(), r.variant.c_str(), r.words.c_str(), L, r.t.pass_ms, r.ratio,
                    r.t.slot_ms, r.t.slot_mean_ms, r.idle_ms, r.t.enqueue_ms, r.equal ? "true" : "false",
                    r.t.ran_ahead ? "true" : "false", r.t.ahead, r.t.passes, i + 1 < rows.size() ? "," : "");
        }
        fprintf(f, "]\n");
        fclose(f);
    }
    cudaStreamDestroy(st);
    return 0;
}
