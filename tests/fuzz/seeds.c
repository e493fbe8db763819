/*
 * seeds.c - writes fuzz_wire's seed inputs into a folder: valid frames of
 * the requests a client sends and of the answers it reads, as a socket
 * stream (all of them back to back, and each alone) and through a ring
 * (read by either side), so that the fuzzer starts from the shapes of real
 * traffic.
 *
 * With --safetensors: fuzz_safetensors' seeds instead, kdactl prefill inputs.
 *
 *   fuzz_seeds [--safetensors] DIR
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kdaproto.h"
#include "safetensors.h"

#define HEADS 1 /* fuzz_wire's session */
#define MAX_STREAM (1u << 20)

static uint8_t stream[MAX_STREAM];
static size_t stream_len;
static int nseeds;

/* Writes a seed file: head (hlen bytes: fuzz_wire's mode byte, or none), then body. */
static void write_seed(const char *dir, const void *head, size_t hlen, const void *body,
                       size_t blen)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/seed-%03d", dir, nseeds++);
    FILE *f = fopen(path, "wb");
    if (!f || (hlen && fwrite(head, 1, hlen, f) != hlen) ||
        (blen && fwrite(body, 1, blen, f) != blen) || fclose(f) != 0) {
        fprintf(stderr, "fuzz_seeds: cannot write %s\n", path);
        exit(1);
    }
}

/* Takes the writer's frame: a seed of its own, and appended to the stream. */
static void take(const char *dir, kp_writer *w, int rc, const kp_error *e)
{
    uint8_t *frame;
    size_t len;
    kp_error ferr;
    if (rc != KP_OK || kp_writer_flatten(w, &frame, &len, &ferr) != KP_OK) {
        fprintf(stderr, "fuzz_seeds: encoding seed %d: %s\n", nseeds, rc ? e->message : ferr.message);
        exit(1);
    }
    static const uint8_t stream_mode = 0;
    write_seed(dir, &stream_mode, 1, frame, len);
    if (stream_len + len <= MAX_STREAM) {
        memcpy(stream + stream_len, frame, len);
        stream_len += len;
    }
    free(frame);
}

/* fuzz_safetensors' seeds: kdactl prefill inputs of 1 head, 3 tokens in 2 sequences, without
 * and with metadata and an initial state. */
static int safetensors_seeds(const char *dir)
{
    static uint16_t tok[3 * 128], beta[3], init[2 * 128 * 128];
    static float a_log[1], dt_bias[128];
    static const int64_t cu[3] = {0, 1, 3};
    const int64_t s_a[1] = {1}, s_dt[2] = {1, 128}, s_tok[3] = {3, 1, 128}, s_beta[2] = {3, 1},
                  s_cu[1] = {3}, s_init[4] = {2, 1, 128, 128};
    for (int with_state = 0; with_state < 2; with_state++) {
        st_writer *sw = st_writer_new();
        char err[ST_ERRMSG_MAX];
        void *buf;
        size_t len;
        int rc = !sw || st_writer_add(sw, "A_log", ST_F32, 1, s_a, a_log) ||
                 st_writer_add(sw, "dt_bias", ST_F32, 2, s_dt, dt_bias) ||
                 st_writer_add(sw, "cu_seqlens", ST_I64, 1, s_cu, cu) ||
                 st_writer_add(sw, "beta", ST_BF16, 2, s_beta, beta);
        const char *names[4] = {"q", "k", "v", "g"};
        for (int t = 0; t < 4 && !rc; t++)
            rc = st_writer_add(sw, names[t], ST_BF16, 3, s_tok, tok);
        if (!rc && with_state)
            rc = st_writer_add(sw, "initial_state", ST_BF16, 4, s_init, init) ||
                 st_writer_meta(sw, "lower_bound", "-3.5") || st_writer_meta(sw, "scale", "0.125");
        if (rc || st_writer_serialize(sw, &buf, &len, err, sizeof(err))) {
            fprintf(stderr, "fuzz_seeds: a safetensors seed did not serialise\n");
            return 1;
        }
        write_seed(dir, NULL, 0, buf, len);
        free(buf);
        st_writer_free(sw);
    }
    printf("fuzz_seeds: %d seeds in %s\n", nseeds, dir);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "--safetensors") == 0)
        return safetensors_seeds(argv[2]);
    if (argc != 2) {
        fprintf(stderr, "usage: fuzz_seeds [--safetensors] DIR\n");
        return 2;
    }
    const char *dir = argv[1];
    kp_writer w;
    kp_error e;
    if (kp_writer_init(&w, KP_DEFAULT_MAX_FRAME_BYTES) != KP_OK)
        return 1;
    static uint16_t tok[2 * HEADS * 128], beta[2 * HEADS];
    static float a_log[HEADS], dt_bias[HEADS * 128];
    uint32_t id = 1;

    /* requests */
    kp_hello_params hello = {{1}, 1, "fuzz_seeds"};
    take(dir, &w, kp_hello_params_encode(&w, id++, &hello, &e), &e);
    take(dir, &w, kp_health_params_encode(&w, id++, &e), &e);
    take(dir, &w, kp_stats_params_encode2(&w, id++, 1, &e), &e);
    kp_layer_register_params layer = {"L", kp_ref_inline(a_log, sizeof(a_log)),
                                      kp_ref_inline(dt_bias, sizeof(dt_bias)), -5.0f, 1.0f};
    take(dir, &w, kp_layer_register_params_encode(&w, id++, &layer, &e), &e);
    take(dir, &w, kp_layer_list_params_encode(&w, id++, &e), &e);
    kp_layer_drop_params drop = {"L"};
    take(dir, &w, kp_layer_drop_params_encode(&w, id++, &drop, &e), &e);
    kp_slot_alloc_params alloc = {2, true};
    take(dir, &w, kp_slot_alloc_params_encode(&w, id++, &alloc, &e), &e);
    const uint64_t slots[2] = {1, 2};
    kp_slot_list list = {slots, 2};
    take(dir, &w, kp_slot_free_params_encode(&w, id++, &list, &e), &e);
    take(dir, &w, kp_slot_reset_params_encode(&w, id++, &list, &e), &e);
    kp_slot_fork_params fork = {1, true, 2};
    take(dir, &w, kp_slot_fork_params_encode(&w, id++, &fork, &e), &e);
    kp_slot_read_params read = {1, true, KP_DTYPE_F32, kp_ref_region(1, 0, HEADS * 128 * 128 * 4)};
    take(dir, &w, kp_slot_read_params_encode(&w, id++, &read, &e), &e);
    kp_slot_write_params write = {2, 7, KP_DTYPE_F32, kp_ref_region(1, 0, HEADS * 128 * 128 * 4)};
    take(dir, &w, kp_slot_write_params_encode(&w, id++, &write, &e), &e);
    kp_slot_info_params info = {true, list};
    take(dir, &w, kp_slot_info_params_encode(&w, id++, &info, &e), &e);
    kp_region_register_shm_params shm = {1 << 20};
    take(dir, &w, kp_region_register_shm_params_encode(&w, id++, &shm, &e), &e);
    kp_region_release_params release = {1};
    take(dir, &w, kp_region_release_params_encode(&w, id++, &release, &e), &e);
    static const uint8_t ipc_handle[KP_CUDA_IPC_HANDLE_BYTES];
    kp_region_register_cuda_params cuda = {1 << 20, "GPU-00000000-0000-0000-0000-000000000000",
                                           KP_CUDA_HANDLE_IPC, ipc_handle};
    take(dir, &w, kp_region_register_cuda_params_encode(&w, id++, &cuda, &e), &e);
    kp_ring_attach_params ring = {1, 4096};
    take(dir, &w, kp_ring_attach_params_encode(&w, id++, &ring, &e), &e);
    kp_prefill_seq seqs[3];
    memset(seqs, 0, sizeof(seqs));
    for (int i = 0; i < 3; i++) {
        seqs[i].slot = (uint64_t)i + 1;
        seqs[i].len = 2;
        for (int t = 0; t < KP_PREFILL_TENSORS; t++) {
            uint64_t n = t == KP_TENSOR_BETA ? sizeof(beta) : sizeof(tok);
            seqs[i].tensors[t] = i == 0 && t != KP_TENSOR_OUT
                                     ? kp_ref_inline(t == KP_TENSOR_BETA ? (void *)beta : tok, n)
                                     : kp_ref_region(1, 4096u * (uint64_t)(i * 8 + t), n);
        }
    }
    seqs[0].out = (kp_ref){0}; /* output inline */
    seqs[1].has_expect_pos = true;
    seqs[1].expect_pos = 4;
    seqs[2].fresh = true;
    kp_prefill_params prefill = {.layer = "L", .seqs = seqs, .nseqs = 3};
    take(dir, &w, kp_prefill_params_encode(&w, id++, &prefill, &e), &e);
    /* inputs at the edges of fuzz_wire's regions: ending at the last byte of region 3 (4096
     * bytes; offsets are multiples of 16), 16 bytes past it, and past the end of the address
     * space in region 4 (UINT64_MAX bytes) */
    kp_prefill_seq edge = seqs[1];
    for (int t = 0; t < KP_PREFILL_TENSORS; t++) {
        uint64_t n = edge.tensors[t].nbytes;
        edge.tensors[t] = kp_ref_region(3, (4096 - n) / 16 * 16, n);
    }
    edge.out.region = 1; /* the output may overlap no input */
    edge.out.offset = 0;
    kp_prefill_params at_edge = {.layer = "L", .seqs = &edge, .nseqs = 1};
    take(dir, &w, kp_prefill_params_encode(&w, id++, &at_edge, &e), &e);
    edge.q.offset += 16;
    take(dir, &w, kp_prefill_params_encode(&w, id++, &at_edge, &e), &e);
    edge.q = kp_ref_region(4, UINT64_MAX - 255, edge.q.nbytes); /* aligned; the end wraps */
    take(dir, &w, kp_prefill_params_encode(&w, id++, &at_edge, &e), &e);
    /* a step: two sequences of one token, q and k inline, the rest in region 1, the states
     * kept at the end of region 1 */
    const uint64_t step_slots[2] = {1, 2}, step_pos[2] = {4, 9};
    const uint8_t step_lens[2] = {1, 1};
    kp_step_params step = {.layer = "L", .nseqs = 2, .slots = step_slots, .lens = step_lens,
                           .expect_pos = step_pos};
    for (int t = 0; t < KP_STEP_TENSORS; t++)
        step.tensors[t] = t == KP_STEP_BETA ? kp_ref_region(1, 65536, sizeof(beta))
                          : t == KP_STEP_STATES ? kp_ref_region(1, 131072, 2 * HEADS * 128 * 128 * 4)
                          : t <= KP_STEP_K ? kp_ref_inline(tok, sizeof(tok))
                                           : kp_ref_region(1, 4096u * (uint64_t)t, sizeof(tok));
    take(dir, &w, kp_step_params_encode(&w, id++, &step, &e), &e);

    /* answers */
    take(dir, &w, kp_empty_result_encode(&w, 1, &e), &e);
    kp_layer_drop_result dr = {.known = true, .removed = true, .in_use = 1};
    take(dir, &w, kp_layer_drop_result_encode(&w, 1, &dr, &e), &e);
    static const char *const features[] = {KP_FEATURE_STATS_PROMETHEUS};
    kp_hello_result hr = {.version = 1, .server = "kdad 0.1.0", .instance = 7,
                          .backend = KP_BACKEND_CUDA, .has_gpu = true,
                          .gpu = {"NVIDIA H200", "GPU-00000000-0000-0000-0000-000000000000", 0},
                          .geometry = {HEADS, 128, 64, KP_DTYPE_F32},
                          .transports = KP_TRANSPORT_INLINE | KP_TRANSPORT_SHM | KP_TRANSPORT_CUDA_IPC,
                          .features = features, .nfeatures = 1};
    kp_limits_default(&hr.limits);
    hr.limits.has_clients = true;
    hr.limits.clients = (kp_client_bounds){.max_connections = 1024,
                                           .max_inflight_bytes_per_uid = 1ull << 32,
                                           .frame_stall_seconds = 30};
    take(dir, &w, kp_hello_result_encode(&w, 1, &hr, &e), &e);
    kp_health_result health;
    memset(&health, 0, sizeof(health));
    take(dir, &w, kp_health_result_encode(&w, 2, &health, &e), &e);
    kp_stats_result stats;
    memset(&stats, 0, sizeof(stats));
    static const uint64_t bounds[2] = {100, 1000}, counts[3] = {5, 2, 1};
    static const kp_counter errors[1] = {{"BUSY", 3}}, disconnects[1] = {{"closed", 2}};
    static const kp_phase phases[1] = {{"device", 10, 20, 30, 400}};
    stats.latency_bounds_us = bounds;
    stats.latency_counts = counts;
    stats.latency_nbounds = 2;
    stats.errors = errors;
    stats.nerrors = 1;
    stats.disconnects = disconnects;
    stats.ndisconnects = 1;
    stats.prometheus = "kdad_requests_total 1\n";
    stats.has_batch_phases = true;
    stats.batch_count = 4;
    stats.batch_window = 4;
    stats.phases = phases;
    stats.nphases = 1;
    stats.has_uid = stats.has_uid_held = stats.has_clients = true;
    stats.uid_held = (kp_held){10, 4, 0, 4096};
    stats.held = (kp_held){20, 8, 1, 8192};
    stats.stalled = 1;
    stats.bounds = hr.limits.clients;
    take(dir, &w, kp_stats_result_encode(&w, 3, &stats, &e), &e);
    kp_layer_register_result created = {true};
    take(dir, &w, kp_layer_register_result_encode(&w, 4, &created, &e), &e);
    kp_layer_info layer_info = {"L", -5.0f, 1.0f, KP_LAYER_SOURCE_CLIENT};
    kp_layer_list_result layers = {&layer_info, 1};
    take(dir, &w, kp_layer_list_result_encode(&w, 5, &layers, &e), &e);
    take(dir, &w, kp_slot_alloc_result_encode(&w, 7, &list, &e), &e);
    kp_slot_fork_result forked = {2, 7};
    take(dir, &w, kp_slot_fork_result_encode(&w, 10, &forked, &e), &e);
    kp_slot_info slot_infos[2] = {{1, 7, KP_SLOT_READY, 0}, {2, 0, KP_SLOT_EMPTY, 1}};
    kp_slot_info_result infos = {slot_infos, 2, 60, 8};
    take(dir, &w, kp_slot_info_result_encode(&w, 13, &infos, &e), &e);
    kp_slot_read_result state = {7, KP_DTYPE_F32, {0}};
    take(dir, &w, kp_slot_read_result_encode(&w, 11, &state, &e), &e);
    kp_region_register_result region = {1};
    take(dir, &w, kp_region_register_result_encode(&w, 14, &region, &e), &e);
    kp_prefill_seq_result outs[3] = {{2, {0}}, {6, {0}}, {2, {0}}};
    kp_prefill_result result = {outs, 3, 10, 20, true, 15, 12};
    take(dir, &w, kp_prefill_result_encode(&w, 17, &result, &e), &e);
    const uint64_t stepped[2] = {5, 10};
    kp_step_result step_result = {.nseqs = 2, .pos = stepped, .out = kp_ref_inline(tok, sizeof(tok)),
                                  .queue_us = 1, .run_us = 9};
    take(dir, &w, kp_step_result_encode(&w, 19, &step_result, &e), &e);
    kp_error busy;
    kp_fail(&busy, KP_E_BUSY, "the queue is full");
    take(dir, &w, kp_error_response_encode(&w, 18, &busy, &e), &e);
    kp_error bye;
    kp_fail(&bye, KP_E_SHUTTING_DOWN, "the daemon is shutting down");
    take(dir, &w, kp_goodbye_encode(&w, &bye, &e), &e);

    /* the whole stream, and its start through a ring (head: the bytes there, tail: 0),
     * read by the daemon (mode 1) and by the client (mode 3) */
    static const uint8_t modes[3] = {0, 1, 3};
    write_seed(dir, &modes[0], 1, stream, stream_len);
    static uint8_t ring_bytes[16 + KP_RING_MIN_SIZE];
    size_t in_ring = stream_len < KP_RING_MIN_SIZE ? stream_len : KP_RING_MIN_SIZE;
    for (int i = 0; i < 8; i++)
        ring_bytes[i] = (uint8_t)((uint64_t)in_ring >> (8 * i));
    memcpy(ring_bytes + 16, stream, in_ring);
    write_seed(dir, &modes[1], 1, ring_bytes, 16 + in_ring);
    write_seed(dir, &modes[2], 1, ring_bytes, 16 + in_ring);
    kp_writer_close(&w);
    printf("fuzz_seeds: %d seeds in %s\n", nseeds, dir);
    return 0;
}
