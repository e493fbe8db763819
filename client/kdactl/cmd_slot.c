/*
 * cmd_slot.c - kdactl slot alloc | free | reset | fork | save | load | info.
 *
 * Slot handles print as 0x hex (generation << 32 | index) and are accepted
 * in hex or decimal.  A daemon whose slots do not persist frees a
 * connection's slots when it closes, so with it `slot alloc` (and fork or
 * load into a new slot) only shows what would happen; kdactl says so.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "prefill_io.h"

static const char slot_help[] =
    "Usage: kdactl slot alloc [--count N] [--empty]\n"
    "       kdactl slot free HANDLE...\n"
    "       kdactl slot reset HANDLE...\n"
    "       kdactl slot fork SRC [--dst HANDLE]\n"
    "       kdactl slot save HANDLE --output FILE [--dtype bf16|f32]\n"
    "       kdactl slot load [HANDLE] --input FILE\n"
    "       kdactl slot info [HANDLE...]\n"
    "\n"
    "Slots hold recurrent states [H, 128, 128] in the daemon's pool, named by handles\n"
    "(0x hex or decimal).  alloc makes zeroed slots (--empty: no state yet); reset\n"
    "zeroes them; fork copies one (into --dst, else a new slot); save writes a slot's\n"
    "state and position to a safetensors FILE (tensor 'state', metadata 'pos'); load\n"
    "restores such a file into HANDLE, or into a new slot; info shows position,\n"
    "status and queue (of every slot you own when no handle is given).\n"
    "When the daemon does not persist slots (see 'kdactl hello'), slots live only as\n"
    "long as kdactl's connection.  --json prints handles as strings (\"0x...\").\n"
    "\n"
    "Options:\n"
    "  -n, --count N     slots to allocate (alloc; default 1)\n"
    "  -e, --empty       allocate slots without a state (alloc)\n"
    "      --dst HANDLE  fork into this slot instead of a new one (fork)\n"
    "  -o, --output FILE where save writes the state\n"
    "  -i, --input FILE  the state file load reads\n"
    "      --dtype T     the dtype save writes: f32 (fp32, float32; default) or bf16\n"
    "                    (bfloat16)\n"
    "\n"
    "Examples:\n"
    "  kdactl slot alloc --count 4\n"
    "  kdactl slot save 0x5f3a000000000001 --output s.safetensors --dtype bf16\n";

/* The handles args[0..n), parsed. */
static int parse_handles(char **args, int n, uint64_t *out)
{
    for (int i = 0; i < n; i++) {
        if (!parse_handle(args[i], &out[i]))
            return ctl_usage("slot", "'%s' is not a slot handle", args[i]);
    }
    return EXIT_OK;
}

static void print_handles(const ctl *g, const char *key, const uint64_t *h, uint32_t n,
                          const char *verb)
{
    if (g->json) {
        json_object *arr = json_object_new_array();
        for (uint32_t i = 0; i < n; i++)
            json_object_array_add(arr, json_id(h[i]));
        json_object *o = json_object_new_object();
        json_object_object_add(o, key, arr);
        ctl_print_json(o);
        return;
    }
    for (uint32_t i = 0; i < n; i++)
        printf("0x%016llx %s\n", (unsigned long long)h[i], verb);
}

/* Slots created by this process vanish with it unless they persist. */
static void note_transient(const ctl *g, const kdac_client *c)
{
    if (!kdac_client_info(c)->slots_persist && !g->json)
        fprintf(stderr, "note: the daemon does not persist slots: these are freed as kdactl "
                        "exits\n");
}

static int slot_save(ctl *g, kdac_client *c, uint64_t slot, const char *path, kdac_dtype dtype)
{
    uint32_t heads = kdac_client_info(c)->heads;
    size_t nbytes = (size_t)kdac_state_bytes(heads, dtype);
    void *state = malloc(nbytes);
    if (!state)
        return ctl_error(g, EXIT_INPUT, "cannot allocate %zu bytes", nbytes);
    uint64_t pos;
    kdac_error err;
    int rc = EXIT_OK;
    if (CTL_RETRYING(g, "slot save", err,
                     kdac_slot_read(c, slot, dtype, kdac_output_inline(state), &pos, &err))) {
        rc = ctl_fail(g, "slot save", &err);
        goto done;
    }
    st_writer *w = st_writer_new();
    char posbuf[32], why[512] = "out of memory";
    snprintf(posbuf, sizeof(posbuf), "%llu", (unsigned long long)pos);
    const int64_t shape[] = {heads, KDAC_HEAD_DIM, KDAC_HEAD_DIM};
    if (!w || st_writer_add(w, "state", dtype == KDAC_DTYPE_F32 ? ST_F32 : ST_BF16, 3, shape,
                            state) ||
        st_writer_meta(w, "pos", posbuf) || st_writer_meta(w, "state_layout", "[H, V, K]") ||
        st_writer_write(w, path, why, sizeof(why))) {
        rc = ctl_error(g, EXIT_INPUT, "%s: %s", path, why);
    } else if (g->json) {
        json_object *o = json_object_new_object();
        json_object_object_add(o, "slot", json_id(slot));
        json_object_object_add(o, "pos", json_u64(pos));
        json_object_object_add(o, "dtype", json_object_new_string(dtype_name(dtype)));
        json_object_object_add(o, "output", json_object_new_string(path));
        ctl_print_json(o);
    } else {
        printf("slot 0x%016llx at position %llu saved to %s (%s [%u, 128, 128])\n",
               (unsigned long long)slot, (unsigned long long)pos, path, dtype_name(dtype), heads);
    }
    st_writer_free(w);
done:
    free(state);
    return rc;
}

static int slot_load(ctl *g, kdac_client *c, uint64_t slot, const char *path)
{
    st_file *f;
    char why[512];
    if (st_open(path, &f, why, sizeof(why)) != 0)
        return ctl_error(g, EXIT_INPUT, "%s: %s", path, why);
    int rc = EXIT_OK;
    uint32_t heads = kdac_client_info(c)->heads;
    const int64_t shape[] = {heads, KDAC_HEAD_DIM, KDAC_HEAD_DIM};
    const st_tensor *t = st_get(f, "state");
    const char *pos_text = st_meta(f, "pos");
    uint64_t pos = 0;
    if (!t || !st_expect(f, "state", t->dtype == ST_BF16 ? ST_BF16 : ST_F32, 3, shape, why,
                         sizeof(why))) {
        rc = ctl_error(g, EXIT_INPUT, "%s: %s", path,
                       t ? why : "no tensor 'state' (write one with 'kdactl slot save')");
        goto done;
    }
    if (pos_text && !parse_u64(pos_text, 0, UINT64_MAX, &pos)) {
        rc = ctl_error(g, EXIT_INPUT, "%s: metadata pos '%s' is not a position", path, pos_text);
        goto done;
    }
    kdac_error err;
    bool fresh_slot = slot == 0;
    if (fresh_slot && CTL_RETRYING(g, "slot load", err,
                                   kdac_slot_alloc(c, 1, KDAC_SLOT_ALLOC_EMPTY, &slot, &err))) {
        rc = ctl_fail(g, "slot load", &err);
        goto done;
    }
    kdac_dtype dtype = t->dtype == ST_BF16 ? KDAC_DTYPE_BF16 : KDAC_DTYPE_F32;
    if (CTL_RETRYING(g, "slot load", err,
                     kdac_slot_write(c, slot, pos, dtype, kdac_tensor_inline(t->data), &err))) {
        rc = ctl_fail(g, "slot load", &err);
        goto done;
    }
    if (g->json) {
        json_object *o = json_object_new_object();
        json_object_object_add(o, "slot", json_id(slot));
        json_object_object_add(o, "pos", json_u64(pos));
        json_object_object_add(o, "input", json_object_new_string(path));
        ctl_print_json(o);
    } else {
        printf("slot 0x%016llx loaded from %s at position %llu\n", (unsigned long long)slot,
               path, (unsigned long long)pos);
    }
    if (fresh_slot)
        note_transient(g, c);
done:
    st_close(f);
    return rc;
}

static int slot_info(ctl *g, kdac_client *c, const uint64_t *slots, uint32_t n)
{
    kdac_slot_info_result r;
    kdac_error err;
    if (kdac_slot_info(c, slots, n, &r, &err))
        return ctl_fail(g, "slot info", &err);
    static const char *const status[] = {"ready", "empty", "lost"};
    if (g->json) {
        json_object *arr = json_object_new_array();
        for (uint32_t i = 0; i < r.nslots; i++) {
            json_object *s = json_object_new_object();
            json_object_object_add(s, "slot", json_id(r.slots[i].slot));
            json_object_object_add(s, "pos", json_u64(r.slots[i].pos));
            json_object_object_add(s, "status", json_object_new_string(status[r.slots[i].status]));
            json_object_object_add(s, "queued", json_u64(r.slots[i].queued));
            json_object_array_add(arr, s);
        }
        json_object *o = json_object_new_object();
        json_object_object_add(o, "slots", arr);
        json_object_object_add(o, "pool_free", json_u64(r.pool_free));
        json_object_object_add(o, "quota_left", json_u64(r.quota_left));
        ctl_print_json(o);
        return EXIT_OK;
    }
    for (uint32_t i = 0; i < r.nslots; i++)
        printf("0x%016llx  pos %-10llu %-6s queued %u\n", (unsigned long long)r.slots[i].slot,
               (unsigned long long)r.slots[i].pos, status[r.slots[i].status], r.slots[i].queued);
    printf("%u slots listed; pool: %u free; your quota: %u more\n", r.nslots, r.pool_free,
           r.quota_left);
    return EXIT_OK;
}

/* Runs one action on an open client. */
static int slot_action(ctl *g, kdac_client *c, const char *action, char **args, int nargs,
                       uint64_t count, unsigned alloc_flags, uint64_t dst, const char *path,
                       kdac_dtype dtype)
{
    kdac_error err;
    uint64_t *h = calloc((size_t)(nargs > (int)count ? nargs : (int)count) + 1, sizeof(*h));
    int rc = h ? parse_handles(args, nargs, h) : ctl_error(g, EXIT_INPUT, "out of memory");
    if (rc)
        goto done;
    if (strcmp(action, "alloc") == 0) {
        if (CTL_RETRYING(g, "slot alloc", err,
                         kdac_slot_alloc(c, (uint32_t)count, alloc_flags, h, &err))) {
            rc = ctl_fail(g, "slot alloc", &err);
        } else {
            print_handles(g, "slots", h, (uint32_t)count, "allocated");
            note_transient(g, c);
        }
    } else if (strcmp(action, "free") == 0 || strcmp(action, "reset") == 0) {
        bool is_free = action[0] == 'f';
        rc = is_free ? kdac_slot_free(c, h, (uint32_t)nargs, &err)
                     : kdac_slot_reset(c, h, (uint32_t)nargs, &err);
        if (rc)
            rc = ctl_fail(g, is_free ? "slot free" : "slot reset", &err);
        else
            print_handles(g, is_free ? "freed" : "reset", h, (uint32_t)nargs,
                          is_free ? "freed" : "reset to zero at position 0");
    } else if (strcmp(action, "fork") == 0) {
        uint64_t slot, pos;
        if (CTL_RETRYING(g, "slot fork", err, kdac_slot_fork(c, h[0], dst, &slot, &pos, &err))) {
            rc = ctl_fail(g, "slot fork", &err);
        } else if (g->json) {
            json_object *o = json_object_new_object();
            json_object_object_add(o, "src", json_id(h[0]));
            json_object_object_add(o, "slot", json_id(slot));
            json_object_object_add(o, "pos", json_u64(pos));
            ctl_print_json(o);
        } else {
            printf("0x%016llx forked into 0x%016llx at position %llu\n",
                   (unsigned long long)h[0], (unsigned long long)slot, (unsigned long long)pos);
            if (dst == 0)
                note_transient(g, c);
        }
    } else if (strcmp(action, "save") == 0) {
        rc = slot_save(g, c, h[0], path, dtype);
    } else if (strcmp(action, "load") == 0) {
        rc = slot_load(g, c, nargs ? h[0] : 0, path);
    } else {
        rc = slot_info(g, c, h, (uint32_t)nargs);
    }
done:
    free(h);
    return rc;
}

enum { OPT_DST = 256, OPT_DTYPE }; /* long only: -d and -t mean other things elsewhere */

int cmd_slot(ctl *g, int argc, char **argv)
{
    static const struct option opts[] = {
        {"help", no_argument, NULL, 'h'},          {"count", required_argument, NULL, 'n'},
        {"empty", no_argument, NULL, 'e'},         {"dst", required_argument, NULL, OPT_DST},
        {"output", required_argument, NULL, 'o'},  {"input", required_argument, NULL, 'i'},
        {"dtype", required_argument, NULL, OPT_DTYPE}, {NULL, 0, NULL, 0}};
    uint64_t count = 1, dst = 0;
    unsigned alloc_flags = 0;
    const char *output = NULL, *input = NULL;
    kdac_dtype dtype = KDAC_DTYPE_F32;
    int o;
    while ((o = getopt_long(argc, argv, "hn:eo:i:", opts, NULL)) != -1) {
        switch (o) {
        case 'h':
            fputs(slot_help, stdout);
            return EXIT_OK;
        case 'n':
            if (!parse_u64(optarg, 1, 16384, &count))
                return ctl_usage("slot", "--count: '%s' is not in [1, 16384]", optarg);
            break;
        case 'e':
            alloc_flags |= KDAC_SLOT_ALLOC_EMPTY;
            break;
        case OPT_DST:
            if (!parse_handle(optarg, &dst))
                return ctl_usage("slot", "--dst: '%s' is not a slot handle", optarg);
            break;
        case 'o':
            output = optarg;
            break;
        case 'i':
            input = optarg;
            break;
        case OPT_DTYPE:
            if (!parse_dtype(optarg, &dtype))
                return ctl_usage("slot", "--dtype: '%s' is neither bf16 (bfloat16) nor f32 "
                                 "(fp32, float32)", optarg);
            break;
        default:
            return ctl_usage("slot", "unknown option");
        }
    }
    if (optind >= argc)
        return ctl_usage("slot", "which action: alloc, free, reset, fork, save, load or info?");
    const char *action = argv[optind];
    char **args = argv + optind + 1;
    int nargs = argc - optind - 1;
    /* Arguments each action takes: [min, max] handles, and its file option. */
    static const struct {
        const char *name;
        int min, max;
    } actions[] = {{"alloc", 0, 0}, {"free", 1, 16384}, {"reset", 1, 16384}, {"fork", 1, 1},
                   {"save", 1, 1},  {"load", 0, 1},     {"info", 0, 16384}};
    int a = -1;
    for (int i = 0; i < 7; i++) {
        if (strcmp(actions[i].name, action) == 0)
            a = i;
    }
    if (a < 0) {
        const char *names[7];
        for (int i = 0; i < 7; i++)
            names[i] = actions[i].name;
        const char *near = ctl_suggest(action, names, 7);
        return near ? ctl_usage("slot", "unknown action '%s'; did you mean '%s'?", action, near)
                    : ctl_usage("slot", "unknown action '%s'", action);
    }
    if (nargs < actions[a].min || nargs > actions[a].max)
        return ctl_usage("slot", "%s takes %d to %d handles, not %d", action, actions[a].min,
                         actions[a].max, nargs);
    if (strcmp(action, "save") == 0 && !output)
        return ctl_usage("slot", "save needs --output FILE");
    if (strcmp(action, "load") == 0 && !input)
        return ctl_usage("slot", "load needs --input FILE");
    kdac_client *c;
    int rc = ctl_connect(g, &c);
    if (rc)
        return rc;
    rc = slot_action(g, c, action, args, nargs, count, alloc_flags, dst,
                     output ? output : input, dtype);
    kdac_client_close(c);
    return rc;
}
