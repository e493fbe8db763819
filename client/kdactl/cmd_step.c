/*
 * cmd_step.c - decode steps (PROTOCOL.md §step):
 *
 *   kdactl step            one step (or --repeat K in a row) from a golden-format
 *                          file (its sequences, each 1..16 tokens, are the step's)
 *                          or random inputs; prints each slot's position and the
 *                          timing of every step
 *   kdactl bench --decode  N sequences x T tokens per step, many steps one after
 *                          the other (as a layer's decode loop sends them): per-step
 *                          latency p50/p99 end to end, and the daemon's kernel and
 *                          device times beside it
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_buffers.h"
#include "common.h"
#include "prefill_io.h"

static const char step_help[] =
    "Usage: kdactl step --input FILE [--repeat K]\n"
    "       kdactl step --random [--seqs N] [--tokens T] [--seed S] [--repeat K]\n"
    "\n"
    "Runs a decode step: every sequence continues the state of its own slot by a\n"
    "few tokens, all in one request.  From a golden-format file, the step holds its\n"
    "sequences (cu_seqlens; each 1..16 tokens) and starts from its initial_state if it\n"
    "has one; --random draws N sequences of T tokens (N(0,1) bf16 inputs, U(0,1)\n"
    "weights) for the daemon's heads.  Prints each slot's position after the step and\n"
    "the step's times: round trip (client), queue, run, device and kernel (daemon).\n"
    "\n"
    "  -i, --input FILE      a golden-format file (q, k, v, g, beta, A_log, dt_bias,\n"
    "                        cu_seqlens, optional initial_state)\n"
    "  -R, --random          synthetic inputs\n"
    "  -N, --seqs N          sequences (random; default 4)\n"
    "  -T, --tokens T        tokens per sequence, 1..16 (random; default 1)\n"
    "  -S, --seed S          seed of the random inputs (default 1)\n"
    "  -k, --repeat K        run K steps in a row with the same inputs (default 1)\n";

static const char decode_help[] =
    "Usage: kdactl bench --decode [--seqs N] [--tokens T] [--steps K] [--warmup W]\n"
    "                    [--transport inline|shm|cuda-ipc|cuda-vmm] [--seed X] [--spin US]\n"
    "                    [--ring]\n"
    "\n"
    "Decode load: one connection sends K steps of N sequences x T tokens, one after\n"
    "the other (the next when the last is answered, as a model's decode loop does).\n"
    "Reports the per-step latency (send to answer) p50/p99/mean, the daemon's kernel\n"
    "and device time per step (p50), and what the daemon and the client add around\n"
    "the kernel.\n"
    "\n"
    "  -N, --seqs N          sequences per step (default 256)\n"
    "  -T, --tokens T        tokens per sequence, 1..16 (default 1)\n"
    "  -k, --steps K         timed steps (default 1000)\n"
    "  -W, --warmup W        untimed steps first (default 20)\n"
    "  -x, --transport MODE  inline (default), shm, cuda-ipc or cuda-vmm (as kdactl bench)\n"
    "  -S, --seed X          seed of the inputs (default 1)\n"
    "  -P, --spin US         poll the socket without sleeping for up to US microseconds\n"
    "                        after each answer (default 0)\n"
    "  -r, --ring            frames through a shared memory ring instead of the socket\n"
    "                        (kdac_ring_attach); with --spin the answers come without a\n"
    "                        system call\n";

/* Registers random (or given) weights under their content name; 0 or an exit code. */
static int register_layer(const ctl *g, kdac_client *c, const layer_weights *w, char *name,
                          size_t size)
{
    kdac_error err;
    layer_weights_name(w, name, size);
    kdac_layer layer = {name, w->A_log, w->dt_bias, w->lower_bound, w->scale};
    if (kdac_layer_register(c, &layer, NULL, &err))
        return ctl_fail(g, "step: register the layer", &err);
    return EXIT_OK;
}

static int need_step(const ctl *g, kdac_client *c)
{
    const kdac_server_info *info = kdac_client_info(c);
    for (uint32_t i = 0; i < info->nfeatures; i++) {
        if (strcmp(info->features[i], "step") == 0)
            return EXIT_OK;
    }
    return ctl_error(g, EXIT_UNSUPPORTED, "the daemon (%s) does not serve the step method",
                     info->server);
}

/* ---------------------------------------------------------------------- */
/* kdactl step                                                            */
/* ---------------------------------------------------------------------- */

static void print_step(const ctl *g, json_object *steps, uint32_t k, const kdac_step_result *res,
                       const uint64_t *slots, double rtt_us)
{
    if (g->json) {
        json_object *o = json_object_new_object();
        json_object *pos = json_object_new_array();
        for (uint32_t i = 0; i < res->nseqs; i++)
            json_object_array_add(pos, json_u64(res->pos[i]));
        json_object_object_add(o, "pos", pos);
        json_object_object_add(o, "round_trip_us", json_object_new_double(rtt_us));
        json_object_object_add(o, "queue_us", json_u64(res->queue_us));
        json_object_object_add(o, "run_us", json_u64(res->run_us));
        json_object_object_add(o, "device_us", json_u64(res->device_us));
        json_object_object_add(o, "kernel_us", json_u64(res->kernel_us));
        json_object_array_add(steps, o);
        return;
    }
    printf("step %u: round trip %.0f us; queue %llu us, run %llu us, device %llu us, kernel %llu "
           "us\n", k + 1, rtt_us, (unsigned long long)res->queue_us,
           (unsigned long long)res->run_us, (unsigned long long)res->device_us,
           (unsigned long long)res->kernel_us);
    for (uint32_t i = 0; i < res->nseqs; i++)
        printf("  slot 0x%llx  pos %llu\n", (unsigned long long)slots[i],
               (unsigned long long)res->pos[i]);
}

static int run_step(const ctl *g, kdac_client *c, const prefill_input *in, uint64_t repeat)
{
    kdac_error err;
    int rc;
    const kdac_server_info *info = kdac_client_info(c);
    if ((uint32_t)in->heads != info->heads)
        return ctl_error(g, EXIT_INPUT, "the input has %d heads; the daemon serves %u", in->heads,
                         info->heads);
    const uint32_t n = in->nseqs;
    uint8_t *lens = calloc(n, 1);
    uint64_t *slots = calloc(n, sizeof(*slots));
    if (!lens || !slots) {
        free(lens);
        free(slots);
        return ctl_error(g, EXIT_INPUT, "out of memory");
    }
    for (uint32_t i = 0; i < n; i++) {
        uint32_t len = prefill_input_len(in, i);
        if (len < 1 || len > KDAC_STEP_MAX_TOKENS) {
            free(lens);
            free(slots);
            return ctl_error(g, EXIT_INPUT, "sequence %u has %u tokens; a step holds 1..%d per sequence", i,
                             len, KDAC_STEP_MAX_TOKENS);
        }
        lens[i] = (uint8_t)len;
    }
    char layer[KDAC_NAME_MAX + 1];
    bool allocated = false;
    if ((rc = register_layer(g, c, &in->weights, layer, sizeof(layer))))
        goto out;
    if (kdac_slot_alloc(c, n, in->initial_state ? KDAC_SLOT_ALLOC_EMPTY : 0, slots, &err)) {
        rc = ctl_fail(g, "step: allocate slots", &err);
        goto out;
    }
    allocated = true;
    const size_t state_bytes = (size_t)in->heads * KDAC_HEAD_DIM * KDAC_HEAD_DIM *
                               (in->initial_dtype == KDAC_DTYPE_F32 ? 4 : 2);
    for (uint32_t i = 0; in->initial_state && i < n; i++) {
        const uint8_t *st = (const uint8_t *)in->initial_state + i * state_bytes;
        if (kdac_slot_write(c, slots[i], 0, in->initial_dtype, kdac_tensor_inline(st), &err)) {
            rc = ctl_fail(g, "step: write the initial states", &err);
            goto out;
        }
    }
    kdac_step_request req = {.nseqs = n, .slots = slots, .lens = lens,
                             .q = kdac_tensor_inline(in->q), .k = kdac_tensor_inline(in->k),
                             .v = kdac_tensor_inline(in->v), .g = kdac_tensor_inline(in->g),
                             .beta = kdac_tensor_inline(in->beta)};
    json_object *steps = g->json ? json_object_new_array() : NULL;
    for (uint64_t k = 0; k < repeat; k++) {
        kdac_step_result res;
        double t0 = now_s();
        if (kdac_step(c, layer, &req, &res, &err)) {
            json_object_put(steps);
            rc = ctl_fail(g, "step", &err);
            goto out;
        }
        print_step(g, steps, (uint32_t)k, &res, slots, (now_s() - t0) * 1e6);
    }
    if (g->json) {
        json_object *o = json_object_new_object();
        json_object_object_add(o, "layer", json_object_new_string(layer));
        json_object_object_add(o, "seqs", json_u64(n));
        json_object_object_add(o, "tokens", json_u64(in->total_tokens));
        json_object_object_add(o, "steps", steps);
        ctl_print_json(o);
    }
    rc = EXIT_OK;
out:
    if (allocated)
        kdac_slot_free(c, slots, n, NULL);
    kdac_layer_drop(c, layer, NULL);
    free(lens);
    free(slots);
    return rc;
}

int cmd_step(ctl *g, int argc, char **argv)
{
    static const struct option opts[] = {
        {"input", required_argument, NULL, 'i'}, {"random", no_argument, NULL, 'R'},
        {"seqs", required_argument, NULL, 'N'},  {"tokens", required_argument, NULL, 'T'},
        {"seed", required_argument, NULL, 'S'},  {"repeat", required_argument, NULL, 'k'},
        {"help", no_argument, NULL, 'h'},        {NULL, 0, NULL, 0}};
    const char *input = NULL;
    bool random = false;
    uint64_t nseqs = 4, tokens = 1, seed = 1, repeat = 1;
    int ch;
    optind = 1;
    while ((ch = getopt_long(argc, argv, "+i:RN:T:S:k:h", opts, NULL)) != -1) {
        switch (ch) {
        case 'i': input = optarg; break;
        case 'R': random = true; break;
        case 'N':
            if (!parse_u64(optarg, 1, 1u << 20, &nseqs))
                return ctl_usage("step", "--seqs: '%s' is not a count of sequences", optarg);
            break;
        case 'T':
            if (!parse_u64(optarg, 1, KDAC_STEP_MAX_TOKENS, &tokens))
                return ctl_usage("step", "--tokens: '%s' is outside [1, %d]", optarg,
                                 KDAC_STEP_MAX_TOKENS);
            break;
        case 'S':
            if (!parse_u64(optarg, 0, UINT64_MAX, &seed))
                return ctl_usage("step", "--seed: '%s' is not a number", optarg);
            break;
        case 'k':
            if (!parse_u64(optarg, 1, 1u << 30, &repeat))
                return ctl_usage("step", "--repeat: '%s' is not a count", optarg);
            break;
        case 'h': fputs(step_help, stdout); return EXIT_OK;
        default: return ctl_usage("step", "unknown option");
        }
    }
    if (optind < argc)
        return ctl_usage("step", "unexpected argument '%s'", argv[optind]);
    if (!!input == random)
        return ctl_usage("step", "give either --input FILE or --random");
    kdac_client *c;
    int rc = ctl_connect(g, &c);
    if (rc)
        return rc;
    if ((rc = need_step(g, c))) {
        kdac_client_close(c);
        return rc;
    }
    prefill_input in;
    memset(&in, 0, sizeof(in));
    char why[256];
    int irc = input ? prefill_input_read(&in, input, why, sizeof(why))
                    : prefill_input_random(&in, (uint32_t)(nseqs * tokens),
                                           (int32_t)kdac_client_info(c)->heads, (uint32_t)nseqs,
                                           seed, why, sizeof(why));
    if (irc)
        rc = ctl_error(g, EXIT_INPUT, "step: %s", why);
    else
        rc = run_step(g, c, &in, repeat);
    prefill_input_free(&in);
    kdac_client_close(c);
    return rc;
}

/* ---------------------------------------------------------------------- */
/* kdactl bench --decode                                                  */
/* ---------------------------------------------------------------------- */

typedef struct decode_opts {
    uint64_t seqs, tokens, steps, warmup, seed, spin_us;
    bench_transport transport;
    bool ring; /* frames through a ring (kdac_ring_attach) */
} decode_opts;

static int parse_decode(int argc, char **argv, decode_opts *o)
{
    static const struct option opts[] = {
        {"decode", no_argument, NULL, 'E'},       {"seqs", required_argument, NULL, 'N'},
        {"tokens", required_argument, NULL, 'T'}, {"steps", required_argument, NULL, 'k'},
        {"warmup", required_argument, NULL, 'W'}, {"transport", required_argument, NULL, 'x'},
        {"seed", required_argument, NULL, 'S'},   {"spin", required_argument, NULL, 'P'},
        {"ring", no_argument, NULL, 'r'},         {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0}};
    static const char *const transports[] = {"inline", "shm", "cuda-ipc", "cuda-vmm"};
    *o = (decode_opts){256, 1, 1000, 20, 1, 0, BENCH_INLINE, false};
    int ch;
    optind = 1;
    while ((ch = getopt_long(argc, argv, "+EN:T:k:W:x:S:P:rh", opts, NULL)) != -1) {
        switch (ch) {
        case 'E': break;
        case 'N':
            if (!parse_u64(optarg, 1, 1u << 20, &o->seqs))
                return ctl_usage("bench", "--seqs: '%s' is not a count of sequences", optarg);
            break;
        case 'T':
            if (!parse_u64(optarg, 1, KDAC_STEP_MAX_TOKENS, &o->tokens))
                return ctl_usage("bench", "--tokens: '%s' is outside [1, %d] for --decode",
                                 optarg, KDAC_STEP_MAX_TOKENS);
            break;
        case 'k':
            if (!parse_u64(optarg, 1, 1u << 30, &o->steps))
                return ctl_usage("bench", "--steps: '%s' is not a count", optarg);
            break;
        case 'W':
            if (!parse_u64(optarg, 0, 1u << 30, &o->warmup))
                return ctl_usage("bench", "--warmup: '%s' is not a count", optarg);
            break;
        case 'S':
            if (!parse_u64(optarg, 0, UINT64_MAX, &o->seed))
                return ctl_usage("bench", "--seed: '%s' is not a number", optarg);
            break;
        case 'P':
            if (!parse_u64(optarg, 0, 10000000, &o->spin_us))
                return ctl_usage("bench", "--spin: '%s' is not a number of microseconds", optarg);
            break;
        case 'x': {
            int k = -1;
            for (int i = 0; i < 4; i++)
                k = strcmp(optarg, transports[i]) == 0 ? i : k;
            if (k < 0)
                return ctl_usage("bench", "--transport: '%s' is not inline, shm, cuda-ipc or "
                                 "cuda-vmm", optarg);
            o->transport = (bench_transport)k;
            break;
        }
        case 'r': o->ring = true; break;
        case 'h': fputs(decode_help, stdout); return EXIT_OK;
        default: return ctl_usage("bench", "unknown option for --decode");
        }
    }
    if (optind < argc)
        return ctl_usage("bench", "unexpected argument '%s'", argv[optind]);
    return -1;
}

static double mean_of(const double *v, uint64_t n)
{
    double s = 0;
    for (uint64_t i = 0; i < n; i++)
        s += v[i];
    return n ? s / (double)n : 0;
}

static void report_decode(const ctl *g, const decode_opts *o, const kdac_server_info *info,
                          double *rtt, double *kernel, double *device, double *host)
{
    const uint64_t n = o->steps;
    const double rtt_mean = mean_of(rtt, n);
    sort_doubles(rtt, n);
    sort_doubles(kernel, n);
    sort_doubles(device, n);
    sort_doubles(host, n);
    static const char *const transports[] = {"inline", "shm", "cuda-ipc", "cuda-vmm"};
    if (g->json) {
        json_object *o2 = json_object_new_object();
        json_object_object_add(o2, "backend", json_object_new_string(info->backend));
        json_object_object_add(o2, "heads", json_u64(info->heads));
        json_object_object_add(o2, "seqs", json_u64(o->seqs));
        json_object_object_add(o2, "tokens", json_u64(o->tokens));
        json_object_object_add(o2, "steps", json_u64(n));
        json_object_object_add(o2, "transport", json_object_new_string(transports[o->transport]));
        json_object_object_add(o2, "ring", json_object_new_boolean(o->ring));
        json_object_object_add(o2, "spin_us", json_u64(o->spin_us));
        json_object_object_add(o2, "step_p50_us", json_object_new_double(quantile(rtt, n, 0.5)));
        json_object_object_add(o2, "step_p99_us", json_object_new_double(quantile(rtt, n, 0.99)));
        json_object_object_add(o2, "step_mean_us", json_object_new_double(rtt_mean));
        json_object_object_add(o2, "kernel_p50_us", json_object_new_double(quantile(kernel, n, 0.5)));
        json_object_object_add(o2, "device_p50_us", json_object_new_double(quantile(device, n, 0.5)));
        json_object_object_add(o2, "around_kernel_p50_us",
                               json_object_new_double(quantile(host, n, 0.5)));
        ctl_print_json(o2);
        return;
    }
    printf("bench --decode: %s (backend %s, %u heads), %llu sequences x %llu tokens per step, "
           "%llu steps, transport %s%s\n", info->server, info->backend, info->heads,
           (unsigned long long)o->seqs, (unsigned long long)o->tokens, (unsigned long long)n,
           transports[o->transport], o->ring ? ", frame ring" : "");
    printf("  step (end to end)   p50 %.1f us  p99 %.1f us  mean %.1f us\n",
           quantile(rtt, n, 0.5), quantile(rtt, n, 0.99), rtt_mean);
    printf("  kernel (daemon)     p50 %.1f us\n", quantile(kernel, n, 0.5));
    printf("  device (daemon)     p50 %.1f us\n", quantile(device, n, 0.5));
    printf("  around the kernel   p50 %.1f us  (end to end - kernel, per step)\n",
           quantile(host, n, 0.5));
}

int cmd_bench_decode(ctl *g, int argc, char **argv)
{
    decode_opts o;
    int rc = parse_decode(argc, argv, &o);
    if (rc >= 0)
        return rc;
    kdac_client *c;
    if ((rc = ctl_connect(g, &c)))
        return rc;
    if ((rc = need_step(g, c))) {
        kdac_client_close(c);
        return rc;
    }
    kdac_error err;
    const kdac_server_info *info = kdac_client_info(c);
    static const uint32_t need[] = {KDAC_TRANSPORT_INLINE, KDAC_TRANSPORT_SHM,
                                    KDAC_TRANSPORT_CUDA_IPC, KDAC_TRANSPORT_CUDA_IPC};
    if (!(info->transports & need[o.transport])) {
        rc = ctl_error(g, EXIT_UNSUPPORTED, "the daemon (backend %s) does not offer this "
                       "transport", info->backend);
        kdac_client_close(c);
        return rc;
    }
    if (kdac_client_set_spin(c, (int)o.spin_us, &err)) {
        kdac_client_close(c);
        return ctl_fail(g, "bench: --spin", &err);
    }
    if (o.ring && kdac_ring_attach(c, 0, &err)) {
        kdac_client_close(c);
        return ctl_fail(g, "bench: attach a frame ring", &err);
    }
    const uint32_t n = (uint32_t)o.seqs, T = (uint32_t)(o.seqs * o.tokens);
    bench_data data;
    memset(&data, 0, sizeof(data));
    data.shm.fd = -1;
    bench_region reg;
    memset(&reg, 0, sizeof(reg));
    uint64_t *slots = calloc(n, sizeof(*slots));
    uint8_t *lens = malloc(n);
    double *rtt = calloc(o.steps, sizeof(double)), *kernel = calloc(o.steps, sizeof(double));
    double *device = calloc(o.steps, sizeof(double)), *host = calloc(o.steps, sizeof(double));
    char layer[KDAC_NAME_MAX + 1] = "";
    bool allocated = false;
    char why[256];
    if (!slots || !lens || !rtt || !kernel || !device || !host) {
        rc = ctl_error(g, EXIT_INPUT, "out of memory");
        goto out;
    }
    memset(lens, (int)o.tokens, n);
    /* one request's tensors, the step's sequences packed back to back */
    if ((rc = bench_data_init(&data, o.transport, info->heads, 1, T, T, BENCH_PACKED, 1, o.seed,
                              why, sizeof(why)))) {
        rc = ctl_error(g, rc, "bench: %s", why);
        goto out;
    }
    layer_weights w;
    if (layer_weights_random(&w, (int32_t)info->heads, o.seed)) {
        rc = ctl_error(g, EXIT_INPUT, "out of memory");
        goto out;
    }
    rc = register_layer(g, c, &w, layer, sizeof(layer));
    layer_weights_free(&w);
    if (rc)
        goto out;
    if ((rc = bench_region_init(&reg, &data, c, 0, 1, &err))) {
        rc = ctl_fail(g, "bench: register buffers", &err);
        goto out;
    }
    if (kdac_slot_alloc(c, n, 0, slots, &err)) {
        rc = ctl_fail(g, "bench: allocate slots", &err);
        goto out;
    }
    allocated = true;
    kdac_seq s;
    bench_seq_tensors(&data, &reg, 0, 0, 0, &s);
    kdac_step_request req = {.nseqs = n, .slots = slots, .lens = lens, .q = s.q, .k = s.k,
                             .v = s.v, .g = s.g, .beta = s.beta, .out = s.out};
    for (uint64_t k = 0; k < o.warmup + o.steps; k++) {
        kdac_step_result res;
        double t0 = now_s();
        if (kdac_step(c, layer, &req, &res, &err)) {
            rc = ctl_fail(g, "bench: step", &err);
            goto out;
        }
        if (k < o.warmup)
            continue;
        uint64_t i = k - o.warmup;
        rtt[i] = (now_s() - t0) * 1e6;
        kernel[i] = (double)res.kernel_us;
        device[i] = (double)res.device_us;
        host[i] = rtt[i] - kernel[i];
    }
    report_decode(g, &o, info, rtt, kernel, device, host);
    rc = EXIT_OK;
out:
    if (allocated)
        kdac_slot_free(c, slots, n, NULL);
    bench_region_free(&reg, c);
    if (layer[0])
        kdac_layer_drop(c, layer, NULL);
    kdac_client_close(c);
    bench_data_free(&data);
    free(slots);
    free(lens);
    free(rtt);
    free(kernel);
    free(device);
    free(host);
    return rc;
}
