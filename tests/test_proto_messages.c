/*
 * test_proto_messages.c - every method of the wire protocol through the codec
 * (proto/messages.c, slots.c, prefill.c): each method's request and result
 * make the round trip encode -> frame -> decode unchanged; invalid params of
 * every kind (type, missing, unknown, duplicate, range, shape, dtype, region
 * form, limits) give the right code and a message naming the field; results
 * tolerate fields a newer daemon adds and refuse what breaks their contract.
 * prefill's own validation is in test_proto_prefill.c; the fixtures are in
 * test_proto_harness.c.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "test_proto_harness.h"

/* ---------------------------------------------------------------------- */
/* Round trips                                                            */
/* ---------------------------------------------------------------------- */

static void test_hello_round_trip(void **state)
{
    wire x;
    kp_hello_params p = {.versions = {2, 1}, .nversions = 2, .client = "kdactl/0.1"};
    ENC(kp_hello_params_encode(&test_writer, 1, &p, &enc_err_));
    open_request(&x, KP_METHOD_HELLO, 1);
    kp_hello_params got;
    DEC(kp_hello_params_decode(&x.msg, &test_session, &got, &dec_err_));
    assert_int_equal(got.nversions, 2);
    assert_int_equal(got.versions[0], 2);
    assert_int_equal(got.versions[1], 1);
    assert_string_equal(got.client, "kdactl/0.1");
    uint32_t version = 0;
    kp_error err;
    assert_int_equal(kp_hello_choose_version(&got, &version, &err), KP_OK);
    assert_int_equal(version, 1);
    wire_close(&x);

    p = (kp_hello_params){.versions = {2, 3}, .nversions = 2};
    ENC(kp_hello_params_encode(&test_writer, 2, &p, &enc_err_));
    open_request(&x, KP_METHOD_HELLO, 2);
    DEC(kp_hello_params_decode(&x.msg, &test_session, &got, &dec_err_));
    assert_null(got.client);
    expect_error(kp_hello_choose_version(&got, &version, &err), &err, KP_E_UNSUPPORTED_VERSION,
                 "versions: the client speaks [2, 3]; this daemon speaks [1]");
    assert_true(kp_code_closes(err.code));
    wire_close(&x);
}

static void assert_bounds_equal(const kp_client_bounds *a, const kp_client_bounds *b)
{
    assert_int_equal(a->max_connections, b->max_connections);
    assert_int_equal(a->max_connections_per_uid, b->max_connections_per_uid);
    assert_int_equal(a->max_inflight_bytes_per_uid, b->max_inflight_bytes_per_uid);
    assert_int_equal(a->max_inflight_bytes_total, b->max_inflight_bytes_total);
    assert_int_equal(a->output_hard_limit, b->output_hard_limit);
    assert_int_equal(a->output_soft_limit, b->output_soft_limit);
    assert_int_equal(a->output_soft_seconds, b->output_soft_seconds);
    assert_int_equal(a->max_output_bytes_per_uid, b->max_output_bytes_per_uid);
    assert_int_equal(a->max_output_bytes_total, b->max_output_bytes_total);
    assert_int_equal(a->max_region_bytes_per_connection, b->max_region_bytes_per_connection);
    assert_int_equal(a->max_region_bytes_per_uid, b->max_region_bytes_per_uid);
    assert_int_equal(a->frame_stall_seconds, b->frame_stall_seconds);
    assert_int_equal(a->output_stall_seconds, b->output_stall_seconds);
}

static void assert_limits_equal(const kp_limits *a, const kp_limits *b)
{
    assert_int_equal(a->max_frame_bytes, b->max_frame_bytes);
    assert_int_equal(a->max_inline_bytes, b->max_inline_bytes);
    assert_int_equal(a->max_batch_tokens, b->max_batch_tokens);
    assert_int_equal(a->max_batch_seqs, b->max_batch_seqs);
    assert_int_equal(a->max_seqs_per_request, b->max_seqs_per_request);
    assert_int_equal(a->max_slots_per_client, b->max_slots_per_client);
    assert_int_equal(a->max_regions_per_client, b->max_regions_per_client);
    assert_int_equal(a->max_inflight_requests, b->max_inflight_requests);
    assert_int_equal(a->max_inflight_bytes, b->max_inflight_bytes);
    assert_int_equal(a->max_layers, b->max_layers);
    assert_int_equal(a->max_layers_per_uid, b->max_layers_per_uid);
    assert_int_equal(a->max_slots_per_uid, b->max_slots_per_uid);
    assert_int_equal(a->has_clients, b->has_clients);
    assert_bounds_equal(&a->clients, &b->clients);
}

/* Distinct values, so that a field decoded into its neighbour shows. */
static kp_client_bounds test_client_bounds(void)
{
    return (kp_client_bounds){
        .max_connections = 1001, .max_connections_per_uid = 1002,
        .max_inflight_bytes_per_uid = 1ull << 33, .max_inflight_bytes_total = (1ull << 34) + 1,
        .output_hard_limit = 1003, .output_soft_limit = 1004, .output_soft_seconds = 1005,
        .max_output_bytes_per_uid = 1006, .max_output_bytes_total = 1007,
        .max_region_bytes_per_connection = 1008, .max_region_bytes_per_uid = 1009,
        .frame_stall_seconds = 1010, .output_stall_seconds = 1011,
    };
}

static void test_hello_result_round_trip(void **state)
{
    static const char *const features[] = {"x.test"};
    kp_hello_result r = {
        .version = 1,
        .server = "kdad 0.1.0",
        .instance = 0x0123456789abcdefull,
        .backend = KP_BACKEND_CUDA,
        .has_gpu = true,
        .gpu = {.name = "NVIDIA H200", .uuid = "GPU-5a1c0e1e-0000-1111-2222-333344445555",
                .index = 3, .pci_bus_id = "0000:19:00.0", .mps = true},
        .geometry = test_session.geometry,
        .transports = KP_TRANSPORT_INLINE | KP_TRANSPORT_SHM | KP_TRANSPORT_CUDA_IPC,
        .slots_persist = true,
        .features = features,
        .nfeatures = 1,
        .limits = test_session.limits,
        .has_memory = true,
        .memory = {.pool = 1ull << 33, .staging = 2, .scratch = 256ull << 20, .kernel = 4,
                   .lanes = 5, .layers = 6, .total = 7},
    };
    r.limits.max_batch_tokens = 12345;
    r.limits.has_clients = true;
    r.limits.clients = test_client_bounds();
    wire x;
    ENC(kp_hello_result_encode(&test_writer, 1, &r, &enc_err_));
    open_result(&x, 1);
    kp_hello_result got;
    DEC(kp_hello_result_decode(&x.msg, &got, &dec_err_));
    assert_int_equal(got.version, 1);
    assert_string_equal(got.server, "kdad 0.1.0");
    assert_int_equal(got.instance, r.instance);
    assert_int_equal(got.backend, KP_BACKEND_CUDA);
    assert_true(got.has_gpu);
    assert_string_equal(got.gpu.name, "NVIDIA H200");
    assert_string_equal(got.gpu.uuid, r.gpu.uuid);
    assert_int_equal(got.gpu.index, 3);
    assert_string_equal(got.gpu.pci_bus_id, "0000:19:00.0");
    assert_true(got.gpu.mps);
    assert_int_equal(got.geometry.heads, H);
    assert_int_equal(got.geometry.head_dim, 128);
    assert_int_equal(got.geometry.slots, 64);
    assert_int_equal(got.geometry.state_dtype, KP_DTYPE_F32);
    assert_int_equal(got.transports, r.transports);
    assert_true(got.slots_persist);
    assert_int_equal(got.nfeatures, 1);
    assert_string_equal(got.features[0], "x.test");
    assert_limits_equal(&got.limits, &r.limits);
    assert_true(got.has_memory);
    assert_memory_equal(&got.memory, &r.memory, sizeof(r.memory));
    kp_session s;
    kp_session_from_hello(&s, &got);
    assert_int_equal(s.geometry.heads, H);
    assert_int_equal(s.limits.max_batch_tokens, 12345);
    wire_close(&x);

    /* A daemon from before limits.clients: decoded, the bounds unknown. */
    ENC(kp_hello_result_encode(&test_writer, 4, &r, &enc_err_));
    edit e;
    edit_begin(&e);
    edit_del(edit_get(e.map, "limits"), "clients");
    edit_del(e.map, "memory");
    edit_repack(&e);
    DEC(kp_hello_result_decode(&e.msg, &got, &dec_err_));
    assert_false(got.has_memory); /* nor the memory */
    assert_int_equal(got.memory.pool, 0);
    assert_false(got.limits.has_clients);
    assert_int_equal(got.limits.clients.max_inflight_bytes_per_uid, 0);
    assert_int_equal(got.limits.max_batch_tokens, 12345);
    edit_end(&e);
    /* One that drops a bound (or has not got one yet): that one 0, the rest decoded. */
    ENC(kp_hello_result_encode(&test_writer, 4, &r, &enc_err_));
    edit_begin(&e);
    edit_del(edit_get(edit_get(e.map, "limits"), "clients"), "output_soft_seconds");
    edit_repack(&e);
    DEC(kp_hello_result_decode(&e.msg, &got, &dec_err_));
    assert_true(got.limits.has_clients);
    assert_int_equal(got.limits.clients.output_soft_seconds, 0);
    assert_int_equal(got.limits.clients.output_stall_seconds, 1011);
    edit_end(&e);

    /* A daemon that does not know its GPU's bus id leaves the field out: still a GPU. */
    r.gpu.pci_bus_id = NULL;
    r.gpu.mps = false;
    ENC(kp_hello_result_encode(&test_writer, 3, &r, &enc_err_));
    open_result(&x, 3);
    DEC(kp_hello_result_decode(&x.msg, &got, &dec_err_));
    assert_true(got.has_gpu);
    assert_int_equal(got.gpu.index, 3);
    assert_null(got.gpu.pci_bus_id);
    assert_false(got.gpu.mps);
    wire_close(&x);

    /* CPU daemon: gpu nil, only inline and shm. */
    r.backend = KP_BACKEND_CPU;
    r.has_gpu = false;
    r.transports = KP_TRANSPORT_INLINE | KP_TRANSPORT_SHM;
    r.nfeatures = 0;
    ENC(kp_hello_result_encode(&test_writer, 2, &r, &enc_err_));
    open_result(&x, 2);
    DEC(kp_hello_result_decode(&x.msg, &got, &dec_err_));
    assert_int_equal(got.backend, KP_BACKEND_CPU);
    assert_false(got.has_gpu);
    assert_int_equal(got.transports, KP_TRANSPORT_INLINE | KP_TRANSPORT_SHM);
    assert_int_equal(got.nfeatures, 0);
    wire_close(&x);
}

static void test_health_stats_round_trip(void **state)
{
    wire x;
    kp_error err;
    ENC(kp_health_params_encode(&test_writer, 5, &enc_err_));
    open_request(&x, KP_METHOD_HEALTH, 5);
    assert_int_equal(kp_health_params_decode(&x.msg, &test_session, &err), KP_OK);
    wire_close(&x);

    kp_health_result h = {.status = KP_HEALTH_DRAINING, .uptime_us = 123456789, .queued = 4,
                          .running = 2};
    ENC(kp_health_result_encode(&test_writer, 5, &h, &enc_err_));
    open_result(&x, 5);
    kp_health_result hg;
    DEC(kp_health_result_decode(&x.msg, &hg, &dec_err_));
    assert_int_equal(hg.status, KP_HEALTH_DRAINING);
    assert_int_equal(hg.uptime_us, 123456789);
    assert_int_equal(hg.queued, 4);
    assert_int_equal(hg.running, 2);
    wire_close(&x);

    ENC(kp_stats_params_encode(&test_writer, 6, &enc_err_));
    open_request(&x, KP_METHOD_STATS, 6);
    assert_int_equal(kp_stats_params_decode(&x.msg, &test_session, &err), KP_OK);
    wire_close(&x);
    /* {"format": "prometheus"} (feature stats.prometheus) */
    uint32_t flags = 99;
    ENC(kp_stats_params_encode2(&test_writer, 6, 0, &enc_err_));
    open_request(&x, KP_METHOD_STATS, 6);
    assert_int_equal(kp_stats_params_decode2(&x.msg, &test_session, &flags, &err), KP_OK);
    assert_int_equal(flags, 0);
    wire_close(&x);
    ENC(kp_stats_params_encode2(&test_writer, 6, KP_STATS_PROMETHEUS, &enc_err_));
    open_request(&x, KP_METHOD_STATS, 6);
    assert_int_equal(kp_stats_params_decode2(&x.msg, &test_session, &flags, &err), KP_OK);
    assert_int_equal(flags, KP_STATS_PROMETHEUS);
    wire_close(&x);
    assert_int_equal(kp_stats_params_encode2(&test_writer, 6, 0x8, &err), KP_E_INVALID_PARAMS);

    static const uint64_t bounds[] = {50, 100, 1000, 10000};
    static const uint64_t counts[] = {1, 2, 3, 4, 5};
    static const kp_counter errors[] = {{"INVALID_PARAMS", 3}, {"POOL_FULL", 1}};
    static const kp_counter disconnects[] = {{"peer_closed", 10}};
    kp_stats_result s = {
        .uptime_us = 1, .connections = 2, .connections_total = 3, .requests = 4,
        .batches = 5, .batches_held = 2, .batches_gathered = 1, .seqs = 6, .tokens = 7,
        .latency_count = 15, .latency_p50_us = 80,
        .latency_p90_us = 900, .latency_p99_us = 9000, .latency_max_us = 20000,
        .latency_bounds_us = bounds, .latency_counts = counts, .latency_nbounds = 4,
        .slots_total = 64, .slots_used = 10, .slots_lost = 1, .layers = 2,
        .has_uid = true, .uid = 1000, .uid_layers = 1, .uid_slots = 7, .regions = 3,
        .rings = 4, .ring_doorbells = 99, .errors = errors, .nerrors = 2, .disconnects = disconnects, .ndisconnects = 1,
        .bytes_in = {100, 200, 300}, .bytes_out = {400, 500, 600},
        .has_uid_held = true, .uid_connections = 3, .uid_held = {11, 12, 13, 14},
        .has_clients = true, .held = {21, 22, 23, 24}, .held_peak = {31, 32, 33, 34},
        .stalled = 5, .refused = 6, .bounds = test_client_bounds(),
        .has_memory = true, .memory = {41, 42, 43, 44, 45, 46, 261},
    };
    ENC(kp_stats_result_encode(&test_writer, 6, &s, &enc_err_));
    open_result(&x, 6);
    kp_stats_result g;
    DEC(kp_stats_result_decode(&x.msg, &g, &dec_err_));
    assert_int_equal(g.uptime_us, 1);
    assert_int_equal(g.connections, 2);
    assert_int_equal(g.connections_total, 3);
    assert_int_equal(g.requests, 4);
    assert_int_equal(g.batches, 5);
    assert_int_equal(g.batches_held, 2);
    assert_int_equal(g.batches_gathered, 1);
    assert_int_equal(g.seqs, 6);
    assert_int_equal(g.tokens, 7);
    assert_int_equal(g.latency_count, 15);
    assert_int_equal(g.latency_p50_us, 80);
    assert_int_equal(g.latency_p90_us, 900);
    assert_int_equal(g.latency_p99_us, 9000);
    assert_int_equal(g.latency_max_us, 20000);
    assert_int_equal(g.latency_nbounds, 4);
    assert_memory_equal(g.latency_bounds_us, bounds, sizeof(bounds));
    assert_memory_equal(g.latency_counts, counts, sizeof(counts));
    assert_int_equal(g.slots_total, 64);
    assert_int_equal(g.slots_used, 10);
    assert_int_equal(g.slots_lost, 1);
    assert_int_equal(g.layers, 2);
    assert_true(g.has_uid);
    assert_int_equal(g.uid, 1000);
    assert_int_equal(g.uid_layers, 1);
    assert_int_equal(g.uid_slots, 7);
    assert_int_equal(g.regions, 3);
    assert_int_equal(g.rings, 4);
    assert_int_equal(g.ring_doorbells, 99);
    assert_true(g.has_uid_held);
    assert_int_equal(g.uid_connections, 3);
    assert_memory_equal(&g.uid_held, &s.uid_held, sizeof(s.uid_held));
    assert_true(g.has_clients);
    assert_memory_equal(&g.held, &s.held, sizeof(s.held));
    assert_memory_equal(&g.held_peak, &s.held_peak, sizeof(s.held_peak));
    assert_int_equal(g.stalled, 5);
    assert_int_equal(g.refused, 6);
    assert_bounds_equal(&g.bounds, &s.bounds);
    assert_int_equal(g.nerrors, 2);
    assert_string_equal(g.errors[1].name, "POOL_FULL");
    assert_int_equal(g.errors[1].value, 1);
    assert_int_equal(g.ndisconnects, 1);
    assert_string_equal(g.disconnects[0].name, "peer_closed");
    assert_int_equal(g.disconnects[0].value, 10);
    assert_memory_equal(g.bytes_in, s.bytes_in, sizeof(s.bytes_in));
    assert_memory_equal(g.bytes_out, s.bytes_out, sizeof(s.bytes_out));
    assert_null(g.prometheus);
    assert_false(g.has_batch_phases); /* not sent: an older daemon */
    assert_int_equal(g.nphases, 0);
    assert_true(g.has_memory);
    assert_memory_equal(&g.memory, &s.memory, sizeof(s.memory));
    wire_close(&x);

    /* A daemon from before the held / gathered counters and the rings */
    ENC(kp_stats_result_encode(&test_writer, 6, &s, &enc_err_));
    edit e;
    edit_begin(&e);
    edit_del(e.map, "batches_held");
    edit_del(e.map, "batches_gathered");
    edit_del(e.map, "rings");
    edit_del(e.map, "ring_doorbells");
    edit_del(e.map, "clients");
    edit_del(e.map, "memory");
    edit_del(edit_get(e.map, "uid"), "connections");
    edit_del(edit_get(e.map, "uid"), "held");
    edit_repack(&e);
    DEC(kp_stats_result_decode(&e.msg, &g, &dec_err_));
    assert_false(g.has_memory);
    assert_false(g.has_clients);
    assert_int_equal(g.held.inflight_bytes, 0);
    assert_true(g.has_uid);
    assert_int_equal(g.uid_slots, 7);
    assert_false(g.has_uid_held);
    assert_int_equal(g.uid_connections, 0);
    assert_int_equal(g.batches, 5);
    assert_int_equal(g.batches_held, 0);
    assert_int_equal(g.batches_gathered, 0);
    assert_int_equal(g.rings, 0);
    assert_int_equal(g.ring_doorbells, 0);
    edit_end(&e);

    /* The per-batch phase breakdown. */
    static const kp_phase phases[] = {{"form", 3, 5, 9, 30}, {"device", 1800, 2000, 2500, 18000}};
    s.has_batch_phases = true;
    s.batch_count = 10;
    s.batch_window = 10;
    s.phases = phases;
    s.nphases = 2;
    ENC(kp_stats_result_encode(&test_writer, 8, &s, &enc_err_));
    open_result(&x, 8);
    DEC(kp_stats_result_decode(&x.msg, &g, &dec_err_));
    assert_true(g.has_batch_phases);
    assert_int_equal(g.batch_count, 10);
    assert_int_equal(g.batch_window, 10);
    assert_int_equal(g.nphases, 2);
    assert_string_equal(g.phases[0].name, "form");
    assert_int_equal(g.phases[0].p50_us, 3);
    assert_int_equal(g.phases[0].p90_us, 5);
    assert_int_equal(g.phases[0].p99_us, 9);
    assert_int_equal(g.phases[0].sum_us, 30);
    assert_string_equal(g.phases[1].name, "device");
    assert_int_equal(g.phases[1].p50_us, 1800);
    assert_int_equal(g.phases[1].sum_us, 18000);
    assert_int_equal(g.requests, 4);
    wire_close(&x);
    /* More phases than a client keeps is an encoder error. */
    s.nphases = KP_STATS_MAX_PHASES + 1;
    kp_error perr;
    assert_int_equal(kp_stats_result_encode(&test_writer, 9, &s, &perr), KP_E_INVALID_PARAMS);
    s.has_batch_phases = false;
    s.nphases = 0;

    s.prometheus = "# TYPE kdad_requests_total counter\nkdad_requests_total 4\n";
    ENC(kp_stats_result_encode(&test_writer, 7, &s, &enc_err_));
    open_result(&x, 7);
    DEC(kp_stats_result_decode(&x.msg, &g, &dec_err_));
    assert_string_equal(g.prometheus, s.prometheus);
    assert_int_equal(g.requests, 4);
    wire_close(&x);
}

static void test_layer_round_trip(void **state)
{
    float a_log[H], dt_bias[H * 128];
    for (int i = 0; i < H; i++)
        a_log[i] = -0.5f * (float)i;
    for (int i = 0; i < H * 128; i++)
        dt_bias[i] = 0.001f * (float)i;
    kp_layer_register_params p = {.name = "model.layers.3.kda",
                                  .A_log = kp_ref_inline(a_log, sizeof(a_log)),
                                  .dt_bias = kp_ref_inline(dt_bias, sizeof(dt_bias)),
                                  .lower_bound = -5.0f, .scale = 0.25f};
    wire x;
    ENC(kp_layer_register_params_encode(&test_writer, 21, &p, &enc_err_));
    open_request(&x, KP_METHOD_LAYER_REGISTER, 21);
    kp_layer_register_params got;
    DEC(kp_layer_register_params_decode(&x.msg, &test_session, &got, &dec_err_));
    assert_string_equal(got.name, p.name);
    assert_int_equal(got.A_log.kind, KP_REF_INLINE);
    assert_int_equal(got.A_log.nbytes, sizeof(a_log));
    assert_memory_equal(got.A_log.data, a_log, sizeof(a_log));
    assert_memory_equal(got.dt_bias.data, dt_bias, sizeof(dt_bias));
    assert_true(got.lower_bound == -5.0f);
    assert_true(got.scale == 0.25f);
    wire_close(&x);

    kp_layer_register_result rr = {.created = true};
    ENC(kp_layer_register_result_encode(&test_writer, 21, &rr, &enc_err_));
    open_result(&x, 21);
    kp_layer_register_result rg = {.created = false};
    DEC(kp_layer_register_result_decode(&x.msg, &rg, &dec_err_));
    assert_true(rg.created);
    wire_close(&x);

    kp_error err;
    ENC(kp_layer_list_params_encode(&test_writer, 22, &enc_err_));
    open_request(&x, KP_METHOD_LAYER_LIST, 22);
    assert_int_equal(kp_layer_list_params_decode(&x.msg, &test_session, &err), KP_OK);
    wire_close(&x);

    kp_layer_info layers[] = {{"a", -5.0f, 0.125f, KP_LAYER_SOURCE_CONFIG},
                              {"b.c", -1.5f, 1.0f, KP_LAYER_SOURCE_CLIENT}};
    kp_layer_list_result lr = {.layers = layers, .nlayers = 2};
    ENC(kp_layer_list_result_encode(&test_writer, 22, &lr, &enc_err_));
    open_result(&x, 22);
    kp_layer_list_result lg;
    DEC(kp_layer_list_result_decode(&x.msg, &lg, &dec_err_));
    assert_int_equal(lg.nlayers, 2);
    assert_string_equal(lg.layers[1].name, "b.c");
    assert_true(lg.layers[1].lower_bound == -1.5f);
    assert_true(lg.layers[0].scale == 0.125f);
    assert_int_equal(lg.layers[0].source, KP_LAYER_SOURCE_CONFIG);
    assert_int_equal(lg.layers[1].source, KP_LAYER_SOURCE_CLIENT);
    wire_close(&x);

    kp_layer_drop_params d = {.name = "b.c"};
    ENC(kp_layer_drop_params_encode(&test_writer, 23, &d, &enc_err_));
    open_request(&x, KP_METHOD_LAYER_DROP, 23);
    kp_layer_drop_params dg;
    DEC(kp_layer_drop_params_decode(&x.msg, &test_session, &dg, &dec_err_));
    assert_string_equal(dg.name, "b.c");
    wire_close(&x);

    kp_layer_drop_result dr = {.known = true, .removed = false, .registrations = 2,
                               .in_use = 3};
    ENC(kp_layer_drop_result_encode(&test_writer, 23, &dr, &enc_err_));
    open_result(&x, 23);
    kp_layer_drop_result drg;
    DEC(kp_layer_drop_result_decode(&x.msg, &drg, &dec_err_));
    assert_true(drg.known);
    assert_false(drg.removed);
    assert_int_equal(drg.registrations, 2);
    assert_int_equal(drg.in_use, 3);
    assert_int_equal(kp_empty_result_decode(&x.msg, &err), KP_OK); /* older clients: lenient */
    wire_close(&x);

    /* a daemon from before the fields answers {} */
    ENC(kp_empty_result_encode(&test_writer, 23, &enc_err_));
    open_result(&x, 23);
    DEC(kp_layer_drop_result_decode(&x.msg, &drg, &dec_err_));
    assert_false(drg.known);
    wire_close(&x);
}

static void test_slot_alloc_free_reset_round_trip(void **state)
{
    wire x;
    kp_slot_alloc_params p = {.count = 3, .zero = false};
    ENC(kp_slot_alloc_params_encode(&test_writer, 31, &p, &enc_err_));
    open_request(&x, KP_METHOD_SLOT_ALLOC, 31);
    kp_slot_alloc_params g;
    DEC(kp_slot_alloc_params_decode(&x.msg, &test_session, &g, &dec_err_));
    assert_int_equal(g.count, 3);
    assert_false(g.zero);
    wire_close(&x);

    uint64_t handles[] = {SLOT(1), SLOT(2), kp_slot_handle(0xffffffffu, 63)};
    kp_slot_list list = {.slots = handles, .nslots = 3};
    ENC(kp_slot_alloc_result_encode(&test_writer, 31, &list, &enc_err_));
    open_result(&x, 31);
    kp_slot_list lg;
    DEC(kp_slot_alloc_result_decode(&x.msg, &lg, &dec_err_));
    assert_int_equal(lg.nslots, 3);
    assert_memory_equal(lg.slots, handles, sizeof(handles));
    assert_int_equal(kp_slot_generation(lg.slots[2]), 0xffffffffu);
    assert_int_equal(kp_slot_index(lg.slots[2]), 63);
    wire_close(&x);

    ENC(kp_slot_free_params_encode(&test_writer, 32, &list, &enc_err_));
    open_request(&x, KP_METHOD_SLOT_FREE, 32);
    DEC(kp_slot_free_params_decode(&x.msg, &test_session, &lg, &dec_err_));
    assert_int_equal(lg.nslots, 3);
    assert_memory_equal(lg.slots, handles, sizeof(handles));
    wire_close(&x);

    ENC(kp_slot_reset_params_encode(&test_writer, 33, &list, &enc_err_));
    open_request(&x, KP_METHOD_SLOT_RESET, 33);
    DEC(kp_slot_reset_params_decode(&x.msg, &test_session, &lg, &dec_err_));
    assert_memory_equal(lg.slots, handles, sizeof(handles));
    wire_close(&x);
}

static void test_slot_alloc_defaults(void **state)
{
    kp_slot_alloc_params p = {.count = 2, .zero = false};
    ENC(kp_slot_alloc_params_encode(&test_writer, 34, &p, &enc_err_));
    edit e;
    edit_begin(&e);
    edit_del(e.map, "count");
    edit_del(e.map, "zero");
    edit_repack(&e);
    kp_slot_alloc_params g;
    DEC(kp_slot_alloc_params_decode(&e.msg, &test_session, &g, &dec_err_));
    assert_int_equal(g.count, 1);
    assert_true(g.zero);
    edit_end(&e);
}

static void test_slot_fork_round_trip(void **state)
{
    wire x;
    kp_slot_fork_params p = {.src = SLOT(1), .has_dst = true, .dst = SLOT(9)};
    ENC(kp_slot_fork_params_encode(&test_writer, 41, &p, &enc_err_));
    open_request(&x, KP_METHOD_SLOT_FORK, 41);
    kp_slot_fork_params g;
    DEC(kp_slot_fork_params_decode(&x.msg, &test_session, &g, &dec_err_));
    assert_int_equal(g.src, SLOT(1));
    assert_true(g.has_dst);
    assert_int_equal(g.dst, SLOT(9));
    wire_close(&x);

    p.has_dst = false;
    ENC(kp_slot_fork_params_encode(&test_writer, 42, &p, &enc_err_));
    open_request(&x, KP_METHOD_SLOT_FORK, 42);
    DEC(kp_slot_fork_params_decode(&x.msg, &test_session, &g, &dec_err_));
    assert_false(g.has_dst);
    wire_close(&x);

    kp_slot_fork_result r = {.slot = SLOT(10), .pos = 8192};
    ENC(kp_slot_fork_result_encode(&test_writer, 42, &r, &enc_err_));
    open_result(&x, 42);
    kp_slot_fork_result rg;
    DEC(kp_slot_fork_result_decode(&x.msg, &rg, &dec_err_));
    assert_int_equal(rg.slot, SLOT(10));
    assert_int_equal(rg.pos, 8192);
    wire_close(&x);
}

static void test_slot_read_write_round_trip(void **state)
{
    wire x;
    /* read to a region, bf16 */
    kp_slot_read_params p = {.slot = SLOT(5), .has_dtype = true, .dtype = KP_DTYPE_BF16,
                             .out = kp_ref_region(3, 1u << 20, 0)};
    ENC(kp_slot_read_params_encode(&test_writer, 51, &p, &enc_err_));
    open_request(&x, KP_METHOD_SLOT_READ, 51);
    kp_slot_read_params g;
    DEC(kp_slot_read_params_decode(&x.msg, &test_session, &g, &dec_err_));
    assert_int_equal(g.slot, SLOT(5));
    assert_true(g.has_dtype);
    assert_int_equal(g.dtype, KP_DTYPE_BF16);
    assert_int_equal(g.out.kind, KP_REF_REGION);
    assert_int_equal(g.out.region, 3);
    assert_int_equal(g.out.offset, 1u << 20);
    assert_int_equal(g.out.nbytes, STATE_BF16_BYTES); /* set from the geometry */
    wire_close(&x);

    /* read inline in the pool's dtype (the default) */
    p = (kp_slot_read_params){.slot = SLOT(5)};
    ENC(kp_slot_read_params_encode(&test_writer, 52, &p, &enc_err_));
    open_request(&x, KP_METHOD_SLOT_READ, 52);
    DEC(kp_slot_read_params_decode(&x.msg, &test_session, &g, &dec_err_));
    assert_false(g.has_dtype);
    assert_int_equal(g.dtype, KP_DTYPE_F32);
    assert_int_equal(g.out.kind, KP_REF_ABSENT);
    wire_close(&x);

    void *state_bytes = filled(STATE_F32_BYTES, 5);
    kp_slot_read_result r = {.pos = 777, .dtype = KP_DTYPE_F32,
                             .state = kp_ref_inline(state_bytes, STATE_F32_BYTES)};
    ENC(kp_slot_read_result_encode(&test_writer, 52, &r, &enc_err_));
    open_result(&x, 52);
    kp_slot_read_result rg;
    DEC(kp_slot_read_result_decode(&x.msg, &test_session, &rg, &dec_err_));
    assert_int_equal(rg.pos, 777);
    assert_int_equal(rg.dtype, KP_DTYPE_F32);
    assert_int_equal(rg.state.kind, KP_REF_INLINE);
    assert_memory_equal(rg.state.data, state_bytes, STATE_F32_BYTES);
    wire_close(&x);

    /* result for a read into a region: no state */
    r.state = (kp_ref){0};
    ENC(kp_slot_read_result_encode(&test_writer, 51, &r, &enc_err_));
    open_result(&x, 51);
    DEC(kp_slot_read_result_decode(&x.msg, &test_session, &rg, &dec_err_));
    assert_int_equal(rg.state.kind, KP_REF_ABSENT);
    wire_close(&x);

    /* write inline bf16, then by region */
    kp_slot_write_params w = {.slot = SLOT(6), .pos = 4096, .dtype = KP_DTYPE_BF16,
                              .state = kp_ref_inline(state_bytes, STATE_BF16_BYTES)};
    ENC(kp_slot_write_params_encode(&test_writer, 53, &w, &enc_err_));
    open_request(&x, KP_METHOD_SLOT_WRITE, 53);
    kp_slot_write_params wg;
    DEC(kp_slot_write_params_decode(&x.msg, &test_session, &wg, &dec_err_));
    assert_int_equal(wg.slot, SLOT(6));
    assert_int_equal(wg.pos, 4096);
    assert_int_equal(wg.dtype, KP_DTYPE_BF16);
    assert_int_equal(wg.state.kind, KP_REF_INLINE);
    assert_memory_equal(wg.state.data, state_bytes, STATE_BF16_BYTES);
    wire_close(&x);

    w.dtype = KP_DTYPE_F32;
    w.state = kp_ref_region(4, 64, 0);
    ENC(kp_slot_write_params_encode(&test_writer, 54, &w, &enc_err_));
    open_request(&x, KP_METHOD_SLOT_WRITE, 54);
    DEC(kp_slot_write_params_decode(&x.msg, &test_session, &wg, &dec_err_));
    assert_int_equal(wg.state.kind, KP_REF_REGION);
    assert_int_equal(wg.state.region, 4);
    assert_int_equal(wg.state.offset, 64);
    assert_int_equal(wg.state.nbytes, STATE_F32_BYTES);
    wire_close(&x);
    free(state_bytes);
}

static void test_slot_info_round_trip(void **state)
{
    wire x;
    uint64_t handles[] = {SLOT(1), SLOT(2)};
    kp_slot_info_params p = {.has_slots = true, .list = {handles, 2}};
    ENC(kp_slot_info_params_encode(&test_writer, 61, &p, &enc_err_));
    open_request(&x, KP_METHOD_SLOT_INFO, 61);
    kp_slot_info_params g;
    DEC(kp_slot_info_params_decode(&x.msg, &test_session, &g, &dec_err_));
    assert_true(g.has_slots);
    assert_int_equal(g.list.nslots, 2);
    assert_memory_equal(g.list.slots, handles, sizeof(handles));
    wire_close(&x);

    p.has_slots = false;
    ENC(kp_slot_info_params_encode(&test_writer, 62, &p, &enc_err_));
    open_request(&x, KP_METHOD_SLOT_INFO, 62);
    DEC(kp_slot_info_params_decode(&x.msg, &test_session, &g, &dec_err_));
    assert_false(g.has_slots);
    wire_close(&x);

    kp_slot_info infos[] = {{SLOT(1), 100, KP_SLOT_READY, 0},
                            {SLOT(2), 0, KP_SLOT_EMPTY, 2},
                            {SLOT(3), 7, KP_SLOT_LOST, 1}};
    kp_slot_info_result r = {.slots = infos, .nslots = 3, .pool_free = 50, .quota_left = 1000};
    ENC(kp_slot_info_result_encode(&test_writer, 62, &r, &enc_err_));
    open_result(&x, 62);
    kp_slot_info_result rg;
    DEC(kp_slot_info_result_decode(&x.msg, &rg, &dec_err_));
    assert_int_equal(rg.nslots, 3);
    assert_memory_equal(rg.slots, infos, sizeof(infos));
    assert_int_equal(rg.pool_free, 50);
    assert_int_equal(rg.quota_left, 1000);
    wire_close(&x);
}

static void test_region_round_trip(void **state)
{
    wire x;
    kp_region_register_shm_params shm = {.size = 1ull << 33};
    ENC(kp_region_register_shm_params_encode(&test_writer, 71, &shm, &enc_err_));
    open_request(&x, KP_METHOD_REGION_REGISTER_SHM, 71);
    kp_region_register_shm_params sg;
    DEC(kp_region_register_shm_params_decode(&x.msg, &test_session, &sg, &dec_err_));
    assert_int_equal(sg.size, 1ull << 33);
    wire_close(&x);

    uint8_t handle[KP_CUDA_IPC_HANDLE_BYTES];
    for (int i = 0; i < KP_CUDA_IPC_HANDLE_BYTES; i++)
        handle[i] = (uint8_t)(255 - i);
    kp_region_register_cuda_params cuda = {.size = 1u << 30, .device = "GPU-1234",
                                           .handle_type = KP_CUDA_HANDLE_IPC, .handle = handle};
    ENC(kp_region_register_cuda_params_encode(&test_writer, 72, &cuda, &enc_err_));
    open_request(&x, KP_METHOD_REGION_REGISTER_CUDA, 72);
    kp_region_register_cuda_params cg;
    DEC(kp_region_register_cuda_params_decode(&x.msg, &test_session, &cg, &dec_err_));
    assert_int_equal(cg.size, 1u << 30);
    assert_string_equal(cg.device, "GPU-1234");
    assert_int_equal(cg.handle_type, KP_CUDA_HANDLE_IPC);
    assert_memory_equal(cg.handle, handle, sizeof(handle));
    wire_close(&x);

    cuda.handle_type = KP_CUDA_HANDLE_POSIX_FD;
    cuda.handle = NULL;
    ENC(kp_region_register_cuda_params_encode(&test_writer, 73, &cuda, &enc_err_));
    open_request(&x, KP_METHOD_REGION_REGISTER_CUDA, 73);
    DEC(kp_region_register_cuda_params_decode(&x.msg, &test_session, &cg, &dec_err_));
    assert_int_equal(cg.handle_type, KP_CUDA_HANDLE_POSIX_FD);
    assert_null(cg.handle);
    wire_close(&x);

    kp_region_register_result r = {.region = 17};
    ENC(kp_region_register_result_encode(&test_writer, 73, &r, &enc_err_));
    open_result(&x, 73);
    kp_region_register_result rg;
    DEC(kp_region_register_result_decode(&x.msg, &rg, &dec_err_));
    assert_int_equal(rg.region, 17);
    wire_close(&x);

    kp_region_release_params rel = {.region = 17};
    ENC(kp_region_release_params_encode(&test_writer, 74, &rel, &enc_err_));
    open_request(&x, KP_METHOD_REGION_RELEASE, 74);
    kp_region_release_params relg;
    DEC(kp_region_release_params_decode(&x.msg, &test_session, &relg, &dec_err_));
    assert_int_equal(relg.region, 17);
    wire_close(&x);
}

/* Which requests claim a received fd: decided from the envelope, valid
 * params or not. */
static void test_which_requests_take_an_fd(void **state)
{
    wire x;
    edit e;
    uint8_t handle[KP_CUDA_IPC_HANDLE_BYTES] = {0};
    kp_region_register_shm_params shm = {.size = 4096};
    ENC(kp_region_register_shm_params_encode(&test_writer, 1, &shm, &enc_err_));
    open_request(&x, KP_METHOD_REGION_REGISTER_SHM, 1);
    assert_true(kp_msg_takes_fd(&x.msg));
    wire_close(&x);

    kp_region_register_cuda_params c = {.size = 4096, .device = "GPU-1",
                                        .handle_type = KP_CUDA_HANDLE_IPC, .handle = handle};
    ENC(kp_region_register_cuda_params_encode(&test_writer, 2, &c, &enc_err_));
    open_request(&x, KP_METHOD_REGION_REGISTER_CUDA, 2);
    assert_false(kp_msg_takes_fd(&x.msg));
    wire_close(&x);

    c.handle_type = KP_CUDA_HANDLE_POSIX_FD;
    c.handle = NULL;
    ENC(kp_region_register_cuda_params_encode(&test_writer, 3, &c, &enc_err_));
    edit_begin(&e);
    edit_set(&e, e.map, "size", v_str("not a size")); /* invalid, still takes its fd */
    edit_repack(&e);
    assert_true(kp_msg_takes_fd(&e.msg));
    edit_end(&e);

    ENC(kp_health_params_encode(&test_writer, 4, &enc_err_));
    open_request(&x, KP_METHOD_HEALTH, 4);
    assert_false(kp_msg_takes_fd(&x.msg));
    wire_close(&x);
}

static void test_prefill_round_trip(void **state)
{
    kp_prefill_seq seqs[4];
    valid_prefill_seqs(seqs);
    wire x;
    encode_valid_prefill();
    open_request(&x, KP_METHOD_PREFILL, 11);
    kp_prefill_params g;
    DEC(kp_prefill_params_decode(&x.msg, &test_session, &g, &dec_err_));
    assert_string_equal(g.layer, "model.layers.3.kda");
    assert_int_equal(g.nseqs, 4);
    for (int i = 0; i < 4; i++) {
        const kp_prefill_seq *a = &seqs[i], *b = &g.seqs[i];
        assert_int_equal(b->slot, a->slot);
        assert_int_equal(b->has_expect_pos, a->has_expect_pos);
        assert_int_equal(b->expect_pos, a->expect_pos);
        assert_int_equal(b->len, a->len);
        assert_int_equal(b->fresh, a->fresh);
        for (int t = 0; t < KP_PREFILL_TENSORS; t++) {
            const kp_ref *ra = &a->tensors[t], *rb = &b->tensors[t];
            assert_int_equal(rb->kind, ra->kind);
            assert_int_equal(rb->nbytes, ra->nbytes);
            if (ra->kind == KP_REF_INLINE)
                assert_memory_equal(rb->data, ra->data, ra->nbytes);
            if (ra->kind == KP_REF_REGION) {
                assert_int_equal(rb->region, ra->region);
                assert_int_equal(rb->offset, ra->offset);
            }
        }
    }

    /* Result: inline out for seqs 0 and 2 (no out ref, len > 0) only. */
    void *out0 = filled(TOK_BYTES(12), 1), *out2 = filled(TOK_BYTES(12), 2);
    kp_prefill_seq_result rs[4] = {
        {312, kp_ref_inline(out0, TOK_BYTES(12))}, {5, {0}},
        {12, kp_ref_inline(out2, TOK_BYTES(12))}, {0, {0}}};
    kp_prefill_result r = {.seqs = rs, .nseqs = 4, .queue_us = 17, .run_us = 450};
    wire y;
    ENC(kp_prefill_result_encode(&test_writer, 11, &r, &enc_err_));
    open_result(&y, 11);
    kp_prefill_result rg;
    DEC(kp_prefill_result_decode(&y.msg, &test_session, &g, &rg, &dec_err_));
    assert_int_equal(rg.nseqs, 4);
    assert_int_equal(rg.queue_us, 17);
    assert_int_equal(rg.run_us, 450);
    assert_int_equal(rg.seqs[0].pos, 312);
    assert_int_equal(rg.seqs[1].pos, 5);
    assert_int_equal(rg.seqs[2].pos, 12);
    assert_int_equal(rg.seqs[3].pos, 0);
    assert_memory_equal(rg.seqs[0].out.data, out0, TOK_BYTES(12));
    assert_memory_equal(rg.seqs[2].out.data, out2, TOK_BYTES(12));
    assert_int_equal(rg.seqs[1].out.kind, KP_REF_ABSENT);
    assert_int_equal(rg.seqs[3].out.kind, KP_REF_ABSENT);
    assert_false(rg.timed); /* no device_us / kernel_us: an older daemon's result */
    assert_int_equal(rg.device_us, 0);
    wire_close(&y);

    /* With the batch's device and kernel times (optional fields). */
    r.timed = true;
    r.device_us = 2100;
    r.kernel_us = 1750;
    ENC(kp_prefill_result_encode(&test_writer, 12, &r, &enc_err_));
    open_result(&y, 12);
    DEC(kp_prefill_result_decode(&y.msg, &test_session, &g, &rg, &dec_err_));
    assert_true(rg.timed);
    assert_int_equal(rg.device_us, 2100);
    assert_int_equal(rg.kernel_us, 1750);
    assert_int_equal(rg.run_us, 450);
    wire_close(&y);
    wire_close(&x);
    free(out0);
    free(out2);
}

static void test_error_and_goodbye_round_trip(void **state)
{
    wire x;
    kp_error e, remote, err;
    kp_fail(&e, KP_E_POSITION_MISMATCH, "seqs[1]: slot 0x700000002 is at position 300, "
            "expect_pos 200");
    ENC(kp_error_response_encode(&test_writer, 99, &e, &enc_err_));
    wire_open(&x);
    assert_int_equal(x.msg.kind, KP_MSG_RESPONSE);
    assert_int_equal(x.msg.id, 99);
    assert_non_null(x.msg.error);
    assert_null(x.msg.result);
    assert_int_equal(kp_response_error_decode(&x.msg, &remote, &err), KP_OK);
    assert_int_equal(remote.code, KP_E_POSITION_MISMATCH);
    assert_false(remote.retryable);
    assert_string_equal(remote.message, e.message);
    wire_close(&x);

    /* An empty message falls back to the table's default. */
    e = (kp_error){.code = KP_E_BUSY};
    ENC(kp_goodbye_encode(&test_writer, &e, &enc_err_));
    wire_open(&x);
    assert_int_equal(x.msg.kind, KP_MSG_NOTIFICATION);
    assert_int_equal(kp_goodbye_decode(&x.msg, &remote, &err), KP_OK);
    assert_int_equal(remote.code, KP_E_BUSY);
    assert_true(remote.retryable);
    assert_string_equal(remote.message, kp_code_message(KP_E_BUSY));
    wire_close(&x);

    /* Success is not an error. */
    e.code = KP_OK;
    expect_error(kp_error_response_encode(&test_writer, 1, &e, &err), &err, KP_E_INTERNAL,
                 "non-error code 0");
}

/* ---------------------------------------------------------------------- */
/* Invalid params: the other methods                                      */
/* ---------------------------------------------------------------------- */

static void test_hello_invalid(void **state)
{
    edit e;
    kp_hello_params p = {.versions = {1}, .nversions = 1, .client = "t"};
    msgpack_object many[17];
    for (int i = 0; i < 17; i++)
        many[i] = v_u64(1);
    char long_name[301];
    memset(long_name, 'c', 300);
    long_name[300] = '\0';

    ENC(kp_hello_params_encode(&test_writer, 1, &p, &enc_err_));
    edit_begin(&e);
    edit_set(&e, e.map, "versions", v_array(&e, 0, NULL));
    expect_refused(&e, KP_E_INVALID_PARAMS, "versions: 0 entries, expected 1..16");
    edit_set(&e, e.map, "versions", v_array(&e, 17, many));
    expect_refused(&e, KP_E_INVALID_PARAMS, "versions: 17 entries, expected 1..16");
    msgpack_object zero = v_u64(0);
    edit_set(&e, e.map, "versions", v_array(&e, 1, &zero));
    expect_refused(&e, KP_E_INVALID_PARAMS, "versions[0]: expected a version number");
    edit_set(&e, e.map, "versions", v_array(&e, 1, many));
    edit_set(&e, e.map, "client", v_str(long_name));
    expect_refused(&e, KP_E_INVALID_PARAMS, "client: 300 bytes, at most 256 allowed");
    edit_set(&e, e.map, "client", v_nil()); /* an optional field may be nil */
    expect_accepted(&e);
    edit_end(&e);
}

static void test_no_params_methods_reject_fields(void **state)
{
    kp_method methods[] = {KP_METHOD_HEALTH, KP_METHOD_STATS, KP_METHOD_LAYER_LIST};
    for (int i = 0; i < 3; i++) {
        edit e;
        if (methods[i] == KP_METHOD_HEALTH)
            ENC(kp_health_params_encode(&test_writer, 1, &enc_err_));
        else if (methods[i] == KP_METHOD_STATS)
            ENC(kp_stats_params_encode(&test_writer, 1, &enc_err_));
        else
            ENC(kp_layer_list_params_encode(&test_writer, 1, &enc_err_));
        edit_begin(&e);
        expect_accepted(&e);
        edit_set(&e, e.map, "verbose", v_bool(true));
        expect_refused(&e, KP_E_INVALID_PARAMS, "params: unknown field \"verbose\"");
        edit_end(&e);
    }
}

static void test_layer_register_invalid(void **state)
{
    float a_log[H] = {0}, dt_bias[H * 128] = {0};
    kp_layer_register_params p = {.name = "L0", .A_log = kp_ref_inline(a_log, sizeof(a_log)),
                                  .dt_bias = kp_ref_inline(dt_bias, sizeof(dt_bias)),
                                  .lower_bound = -5.0f, .scale = 0.1f};
    char long_name[66];
    memset(long_name, 'n', 65);
    long_name[65] = '\0';
    float nan_bias[H * 128] = {0};
    nan_bias[5] = NAN;
    edit e;

    ENC(kp_layer_register_params_encode(&test_writer, 1, &p, &enc_err_));
    edit_begin(&e);
    edit_set(&e, e.map, "name", v_str("has space"));
    expect_refused(&e, KP_E_INVALID_PARAMS, "name: byte 0x20 is not allowed");
    edit_set(&e, e.map, "name", v_str(long_name));
    expect_refused(&e, KP_E_INVALID_PARAMS, "name: 65 bytes, at most 64 allowed");
    edit_set(&e, e.map, "name", v_str(""));
    expect_refused(&e, KP_E_INVALID_PARAMS, "name: 0 bytes, at least 1 needed");
    edit_set(&e, e.map, "name", v_str("L0"));
    edit_set(&e, e.map, "A_log", v_bin(a_log, sizeof(a_log) - 4));
    expect_refused(&e, KP_E_INVALID_PARAMS,
                   "A_log: expected 384 bytes (96 heads x 4 bytes f32), got 380");
    edit_set(&e, e.map, "A_log", v_region(&e, 1, 0));
    expect_refused(&e, KP_E_INVALID_PARAMS, "A_log: must be an inline bin");
    edit_set(&e, e.map, "A_log", v_bin(a_log, sizeof(a_log)));
    edit_set(&e, e.map, "dt_bias", v_bin(nan_bias, sizeof(nan_bias)));
    expect_refused(&e, KP_E_INVALID_PARAMS, "dt_bias[5]: nan is not finite");
    edit_set(&e, e.map, "dt_bias", v_bin(dt_bias, sizeof(dt_bias)));
    edit_set(&e, e.map, "lower_bound", v_f64(0.0));
    expect_refused(&e, KP_E_INVALID_PARAMS, "lower_bound: 0 is outside [-5, 0)");
    edit_set(&e, e.map, "lower_bound", v_f64(-5.5));
    expect_refused(&e, KP_E_INVALID_PARAMS, "lower_bound: -5.5 is outside [-5, 0)");
    edit_set(&e, e.map, "lower_bound", v_str("-1"));
    expect_refused(&e, KP_E_INVALID_PARAMS, "lower_bound: expected a number, got str");
    edit_set(&e, e.map, "lower_bound", v_f64(-1e39));
    expect_refused(&e, KP_E_INVALID_PARAMS, "lower_bound: -1e+39 is not a finite float");
    edit_set(&e, e.map, "lower_bound", v_neg(-3)); /* integers are numbers too */
    edit_del(e.map, "scale");
    edit_repack(&e);
    kp_layer_register_params g;
    DEC(kp_layer_register_params_decode(&e.msg, &test_session, &g, &dec_err_));
    assert_true(g.lower_bound == -3.0f);
    assert_true(g.scale == KP_DEFAULT_SCALE);
    edit_end(&e);

    kp_layer_drop_params d = {.name = "L0"};
    ENC(kp_layer_drop_params_encode(&test_writer, 2, &d, &enc_err_));
    edit_begin(&e);
    edit_set(&e, e.map, "name", v_str("a\"b"));
    expect_refused(&e, KP_E_INVALID_PARAMS, "name: byte 0x22 is not allowed");
    edit_end(&e);
}

static void test_slot_methods_invalid(void **state)
{
    edit e;
    uint64_t handles[] = {SLOT(1), SLOT(2), SLOT(3)};
    kp_slot_list list = {handles, 3};

    kp_slot_alloc_params a = {.count = 2, .zero = true};
    ENC(kp_slot_alloc_params_encode(&test_writer, 1, &a, &enc_err_));
    edit_begin(&e);
    edit_set(&e, e.map, "count", v_u64(0));
    expect_refused(&e, KP_E_INVALID_PARAMS, "count: 0 is outside [1, 1024]");
    edit_set(&e, e.map, "count", v_u64(1025));
    expect_refused(&e, KP_E_INVALID_PARAMS, "count: 1025 is outside [1, 1024]");
    edit_set(&e, e.map, "count", v_u64(1));
    edit_set(&e, e.map, "zero", v_u64(0));
    expect_refused(&e, KP_E_INVALID_PARAMS, "zero: expected a bool, got unsigned integer");
    edit_del(e.map, "zero");
    edit_set(&e, e.map, "zeros", v_bool(true));
    expect_refused(&e, KP_E_INVALID_PARAMS, "params: unknown field \"zeros\"");
    edit_end(&e);

    ENC(kp_slot_free_params_encode(&test_writer, 2, &list, &enc_err_));
    edit_begin(&e);
    msgpack_object dup[] = {v_u64(SLOT(1)), v_u64(SLOT(2)), v_u64(SLOT(1))};
    edit_set(&e, e.map, "slots", v_array(&e, 3, dup));
    expect_refused(&e, KP_E_INVALID_PARAMS, "slots[2]: slot 0x700000001 is already named by "
                   "slots[0]");
    msgpack_object mixed[] = {v_u64(SLOT(1)), v_str("2")};
    edit_set(&e, e.map, "slots", v_array(&e, 2, mixed));
    expect_refused(&e, KP_E_INVALID_PARAMS, "slots[1]: expected an unsigned integer (slot "
                   "handle), got str");
    edit_set(&e, e.map, "slots", v_array(&e, 0, NULL));
    expect_refused(&e, KP_E_INVALID_PARAMS, "slots: 0 entries, expected 1..1024");
    edit_set(&e, e.map, "slots", v_u64(SLOT(1)));
    expect_refused(&e, KP_E_INVALID_PARAMS, "slots: expected an array, got unsigned integer");
    edit_end(&e);

    kp_slot_fork_params f = {.src = SLOT(1), .has_dst = true, .dst = SLOT(2)};
    ENC(kp_slot_fork_params_encode(&test_writer, 3, &f, &enc_err_));
    edit_begin(&e);
    edit_set(&e, e.map, "dst", v_u64(SLOT(1)));
    expect_refused(&e, KP_E_INVALID_PARAMS, "dst: same slot as src (0x700000001)");
    edit_del(e.map, "src");
    expect_refused(&e, KP_E_INVALID_PARAMS, "src: required field is missing");
    edit_end(&e);

    kp_slot_read_params r = {.slot = SLOT(1)};
    ENC(kp_slot_read_params_encode(&test_writer, 4, &r, &enc_err_));
    edit_begin(&e);
    edit_set(&e, e.map, "dtype", v_str("fp16"));
    expect_refused(&e, KP_E_INVALID_PARAMS, "dtype: \"fp16\" is not one of \"bf16\", \"f32\"");
    edit_set(&e, e.map, "dtype", v_str("bf16"));
    edit_set(&e, e.map, "out", v_bin("x", 1));
    expect_refused(&e, KP_E_INVALID_PARAMS, "out: must be a region reference");
    edit_del(e.map, "out");
    kp_session small = test_session;
    small.limits.max_inline_bytes = 1u << 20;
    expect_refused_with(&e, &small, KP_E_LIMIT_EXCEEDED,
                        "state: 3145728 bytes inline exceed max_inline_bytes 1048576");
    edit_end(&e);

    void *bf16_state = filled(STATE_BF16_BYTES, 3);
    kp_slot_write_params w = {.slot = SLOT(1), .pos = 5, .dtype = KP_DTYPE_BF16,
                              .state = kp_ref_inline(bf16_state, STATE_BF16_BYTES)};
    ENC(kp_slot_write_params_encode(&test_writer, 5, &w, &enc_err_));
    edit_begin(&e);
    expect_accepted(&e);
    edit_set(&e, e.map, "dtype", v_str("f32")); /* the bytes are bf16-sized */
    expect_refused(&e, KP_E_INVALID_PARAMS, "state: expected 6291456 bytes (96 heads x 128 x 128 "
                   "x 4 bytes f32), got 3145728");
    edit_set(&e, e.map, "dtype", v_str("bf16"));
    edit_del(e.map, "pos");
    expect_refused(&e, KP_E_INVALID_PARAMS, "pos: required field is missing");
    edit_end(&e);
    free(bf16_state);

    kp_slot_info_params i = {.has_slots = true, .list = list};
    ENC(kp_slot_info_params_encode(&test_writer, 6, &i, &enc_err_));
    edit_begin(&e);
    edit_set(&e, e.map, "slots", v_nil()); /* nil: every slot of the caller */
    edit_repack(&e);
    kp_slot_info_params ig;
    DEC(kp_slot_info_params_decode(&e.msg, &test_session, &ig, &dec_err_));
    assert_false(ig.has_slots);
    edit_end(&e);
}

static void test_region_methods_invalid(void **state)
{
    edit e;
    uint8_t handle[KP_CUDA_IPC_HANDLE_BYTES] = {0};

    kp_region_register_shm_params shm = {.size = 4096};
    ENC(kp_region_register_shm_params_encode(&test_writer, 1, &shm, &enc_err_));
    edit_begin(&e);
    edit_set(&e, e.map, "size", v_u64(0));
    expect_refused(&e, KP_E_INVALID_PARAMS, "size: 0 is outside [1, 18446744073709551615]");
    edit_end(&e);

    kp_region_register_cuda_params c = {.size = 4096, .device = "GPU-1",
                                        .handle_type = KP_CUDA_HANDLE_IPC, .handle = handle};
    ENC(kp_region_register_cuda_params_encode(&test_writer, 2, &c, &enc_err_));
    edit_begin(&e);
    edit_set(&e, e.map, "handle", v_bin(handle, 63));
    expect_refused(&e, KP_E_INVALID_PARAMS,
                   "handle: expected 64 bytes (sizeof(cudaIpcMemHandle_t)), got 63");
    edit_set(&e, e.map, "handle", v_str("abc"));
    expect_refused(&e, KP_E_INVALID_PARAMS, "handle: expected a bin, got str");
    edit_del(e.map, "handle");
    expect_refused(&e, KP_E_INVALID_PARAMS, "handle: required with handle_type \"ipc\"");
    edit_del(e.map, "handle_type"); /* "ipc" is the default */
    expect_refused(&e, KP_E_INVALID_PARAMS, "handle: required with handle_type \"ipc\"");
    edit_set(&e, e.map, "handle_type", v_str("posix_fd"));
    edit_set(&e, e.map, "handle", v_bin(handle, 64));
    expect_refused(&e, KP_E_INVALID_PARAMS, "handle: not used with handle_type \"posix_fd\"");
    edit_set(&e, e.map, "handle_type", v_str("dmabuf"));
    expect_refused(&e, KP_E_INVALID_PARAMS,
                   "handle_type: \"dmabuf\" is not one of \"ipc\", \"posix_fd\"");
    edit_set(&e, e.map, "handle_type", v_str("ipc"));
    edit_del(e.map, "device");
    expect_refused(&e, KP_E_INVALID_PARAMS, "device: required field is missing");
    edit_end(&e);

    kp_region_release_params rel = {.region = 3};
    ENC(kp_region_release_params_encode(&test_writer, 3, &rel, &enc_err_));
    edit_begin(&e);
    edit_set(&e, e.map, "region", v_u64(0));
    expect_refused(&e, KP_E_INVALID_PARAMS, "region: 0 is outside [1, 4294967295]");
    edit_set(&e, e.map, "region", v_u64(1ull << 32));
    expect_refused(&e, KP_E_INVALID_PARAMS, "region: 4294967296 is outside [1, 4294967295]");
    edit_end(&e);
}

/* ---------------------------------------------------------------------- */
/* Results: lenient about additions, strict about what they carry         */
/* ---------------------------------------------------------------------- */

static void encode_hello_result(void)
{
    kp_hello_result r = {.version = 1, .server = "kdad", .backend = KP_BACKEND_CPU,
                         .geometry = test_session.geometry, .transports = KP_TRANSPORT_INLINE,
                         .limits = test_session.limits};
    ENC(kp_hello_result_encode(&test_writer, 1, &r, &enc_err_));
}

static void test_results_ignore_unknown_fields(void **state)
{
    edit e;
    kp_hello_result g;
    kp_error err;
    encode_hello_result();
    edit_begin(&e);
    edit_set(&e, e.map, "future_field", v_str("ignored"));
    edit_set(&e, edit_get(e.map, "limits"), "max_future", v_u64(1));
    msgpack_object transports[] = {v_str("inline"), v_str("rdma")};
    edit_set(&e, e.map, "transports", v_array(&e, 2, transports));
    edit_repack(&e);
    assert_int_equal(kp_hello_result_decode(&e.msg, &g, &err), KP_OK);
    assert_int_equal(g.transports, KP_TRANSPORT_INLINE); /* "rdma" is not known: skipped */
    edit_end(&e);
}

static void test_results_checked(void **state)
{
    edit e;
    kp_hello_result g;
    kp_error err;

    encode_hello_result();
    edit_begin(&e);
    edit_set(&e, e.map, "head_dim", v_u64(64));
    edit_repack(&e);
    expect_error(kp_hello_result_decode(&e.msg, &g, &err), &err, KP_E_PROTOCOL,
                 "head_dim: 64 is outside [128, 128]");
    edit_set(&e, e.map, "head_dim", v_u64(128));
    edit_set(&e, edit_get(e.map, "limits"), "max_inline_bytes", v_u64(1ull << 40));
    edit_repack(&e);
    expect_error(kp_hello_result_decode(&e.msg, &g, &err), &err, KP_E_PROTOCOL,
                 "limits.max_inline_bytes: 1099511627776 must be in [1, max_frame_bytes");
    edit_end(&e);

    /* An error object with a positive code is not one. */
    kp_error e1;
    kp_fail(&e1, KP_E_BUSY, NULL);
    ENC(kp_error_response_encode(&test_writer, 1, &e1, &enc_err_));
    wire x;
    wire_open(&x);
    msgpack_object_kv *code = edit_find((msgpack_object *)x.msg.error, "code");
    code->val = v_u64(32);
    kp_error remote;
    expect_error(kp_response_error_decode(&x.msg, &remote, &err), &err, KP_E_PROTOCOL,
                 "error.code: expected a negative 32-bit integer");
    wire_close(&x);
}

/* ---------------------------------------------------------------------- */
/* Helpers the daemon and client call around the codec                    */
/* ---------------------------------------------------------------------- */

static void test_limits_check(void **state)
{
    kp_limits l;
    kp_error err;
    kp_limits_default(&l);
    assert_int_equal(kp_limits_check(&l, &err), KP_OK);

    l.max_seqs_per_request = l.max_batch_seqs + 1;
    expect_error(kp_limits_check(&l, &err), &err, KP_E_INVALID_PARAMS,
                 "max_seqs_per_request: 257 must be in [1, min(max_batch_seqs 256, 4096)]");
    kp_limits_default(&l);
    l.max_frame_bytes = 1000;
    expect_error(kp_limits_check(&l, &err), &err, KP_E_INVALID_PARAMS,
                 "max_frame_bytes: 1000 is outside [65536, 4294967295]");
    kp_limits_default(&l);
    l.max_slots_per_client = KP_MAX_SLOTS_PER_CLIENT_CEILING + 1;
    expect_error(kp_limits_check(&l, &err), &err, KP_E_INVALID_PARAMS,
                 "max_slots_per_client: 16385 is outside [1, 16384]");
    kp_limits_default(&l);
    l.max_inflight_bytes = l.max_frame_bytes - 1;
    expect_error(kp_limits_check(&l, &err), &err, KP_E_INVALID_PARAMS,
                 "max_inflight_bytes: 268435455 is below max_frame_bytes 268435456");

    /* Sizes saturate instead of wrapping. */
    assert_int_equal(kp_token_tensor_bytes(UINT32_MAX, UINT32_MAX), UINT64_MAX);
    assert_int_equal(kp_token_tensor_bytes(12, H), TOK_BYTES(12));
    assert_int_equal(kp_beta_bytes(12, H), BETA_BYTES(12));
    assert_int_equal(kp_state_bytes(H, KP_DTYPE_F32), STATE_F32_BYTES);
}

/* Encoders refuse structs that cannot become a valid message. */
static void test_encoders_check_inputs(void **state)
{
    kp_error err;
    kp_hello_params h = {.nversions = 0};
    expect_error(kp_hello_params_encode(&test_writer, 1, &h, &err), &err, KP_E_INVALID_PARAMS,
                 "versions: 0 entries");
    kp_prefill_seq seq = {.slot = 1, .len = 4};
    kp_prefill_params p = {.layer = "L", .seqs = &seq, .nseqs = 1};
    expect_error(kp_prefill_params_encode(&test_writer, 1, &p, &err), &err, KP_E_INVALID_PARAMS,
                 "seqs[0].q: required");
    p.layer = NULL;
    expect_error(kp_prefill_params_encode(&test_writer, 1, &p, &err), &err, KP_E_INVALID_PARAMS,
                 "layer: required string is NULL");
    kp_slot_list empty = {NULL, 0};
    expect_error(kp_slot_free_params_encode(&test_writer, 1, &empty, &err), &err, KP_E_INVALID_PARAMS,
                 "slots: at least one handle");
    kp_region_register_cuda_params c = {.size = 1, .device = "GPU-1",
                                        .handle_type = KP_CUDA_HANDLE_IPC};
    expect_error(kp_region_register_cuda_params_encode(&test_writer, 1, &c, &err), &err,
                 KP_E_INVALID_PARAMS, "handle: required with handle_type \"ipc\"");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hello_round_trip),
        cmocka_unit_test(test_hello_result_round_trip),
        cmocka_unit_test(test_health_stats_round_trip),
        cmocka_unit_test(test_layer_round_trip),
        cmocka_unit_test(test_slot_alloc_free_reset_round_trip),
        cmocka_unit_test(test_slot_alloc_defaults),
        cmocka_unit_test(test_slot_fork_round_trip),
        cmocka_unit_test(test_slot_read_write_round_trip),
        cmocka_unit_test(test_slot_info_round_trip),
        cmocka_unit_test(test_region_round_trip),
        cmocka_unit_test(test_which_requests_take_an_fd),
        cmocka_unit_test_setup_teardown(test_prefill_round_trip, prefill_setup, prefill_teardown),
        cmocka_unit_test(test_error_and_goodbye_round_trip),
        cmocka_unit_test(test_hello_invalid),
        cmocka_unit_test(test_no_params_methods_reject_fields),
        cmocka_unit_test(test_layer_register_invalid),
        cmocka_unit_test(test_slot_methods_invalid),
        cmocka_unit_test(test_region_methods_invalid),
        cmocka_unit_test(test_results_ignore_unknown_fields),
        cmocka_unit_test(test_results_checked),
        cmocka_unit_test(test_limits_check),
        cmocka_unit_test(test_encoders_check_inputs),
    };
    return cmocka_run_group_tests(tests, harness_setup, harness_teardown);
}
