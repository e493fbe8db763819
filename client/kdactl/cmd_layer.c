/*
 * cmd_layer.c - kdactl layer list | register | drop.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "prefill_io.h"

static const char layer_help[] =
    "Usage: kdactl layer list\n"
    "       kdactl layer register NAME --weights FILE [--lower-bound X] [--scale X]\n"
    "       kdactl layer drop NAME\n"
    "\n"
    "Layers hold a KDA layer's A_log [H] and dt_bias [H, 128] (f32) with its gate floor\n"
    "(lower_bound, in [-5, 0)) and output scale; prefill requests name them.  A layer\n"
    "belongs to your uid (other uids have their own names; the daemon's configured\n"
    "layers are everyone's) and stays until dropped.  register reads A_log and dt_bias\n"
    "from a safetensors FILE (a golden-vector file works); lower_bound and scale default\n"
    "to the file's metadata, else -5 and 1/sqrt(128).  The daemon counts registrations:\n"
    "registering an identical layer again takes one more, each drop gives one back, and\n"
    "the name goes with the last; a different layer under a taken name is refused.\n"
    "\n"
    "Options:\n"
    "  -w, --weights FILE    safetensors file with A_log and dt_bias (register)\n"
    "      --lower-bound X   the gate floor, in [-5, 0) (register)\n"
    "      --scale X         the output scale (register)\n"
    "\n"
    "Examples:\n"
    "  kdactl layer register model.layers.3.kda --weights layer3.safetensors\n"
    "  kdactl --json layer list\n";

static int layer_list(ctl *g, kdac_client *c)
{
    kdac_layer_info layers[256];
    uint32_t n;
    kdac_error err;
    if (kdac_layer_list(c, layers, 256, &n, &err))
        return ctl_fail(g, "layer list", &err);
    uint32_t shown = n < 256 ? n : 256;
    if (g->json) {
        json_object *arr = json_object_new_array();
        for (uint32_t i = 0; i < shown; i++) {
            json_object *l = json_object_new_object();
            json_object_object_add(l, "name", json_object_new_string(layers[i].name));
            json_object_object_add(l, "lower_bound", json_object_new_double(layers[i].lower_bound));
            json_object_object_add(l, "scale", json_object_new_double(layers[i].scale));
            json_object_object_add(l, "source", json_object_new_string(
                                                    layers[i].from_config ? "config" : "client"));
            json_object_array_add(arr, l);
        }
        json_object *o = json_object_new_object();
        json_object_object_add(o, "layers", arr);
        ctl_print_json(o);
        return EXIT_OK;
    }
    if (n == 0)
        printf("no layers\n");
    for (uint32_t i = 0; i < shown; i++)
        printf("%-40s lower_bound %-8g scale %-10g %s\n", layers[i].name,
               (double)layers[i].lower_bound, (double)layers[i].scale,
               layers[i].from_config ? "config" : "client");
    if (n > shown)
        printf("... and %u more\n", n - shown);
    return EXIT_OK;
}

static int layer_register(ctl *g, kdac_client *c, const char *name, const char *path,
                          const double *lower_bound, const double *scale)
{
    st_file *f;
    char why[512];
    layer_weights w;
    if (st_open(path, &f, why, sizeof(why)) != 0)
        return ctl_error(g, EXIT_INPUT, "%s: %s", path, why);
    if (layer_weights_read(f, &w, why, sizeof(why)) != 0) {
        st_close(f);
        return ctl_error(g, EXIT_INPUT, "%s: %s", path, why);
    }
    st_close(f);
    int rc = EXIT_OK;
    if ((uint32_t)w.heads != kdac_client_info(c)->heads) {
        rc = ctl_error(g, EXIT_INPUT, "%s: weights for %d heads; the daemon serves %u", path,
                       w.heads, kdac_client_info(c)->heads);
        goto done;
    }
    if (lower_bound)
        w.lower_bound = (float)*lower_bound;
    if (scale)
        w.scale = (float)*scale;
    kdac_layer layer = {name, w.A_log, w.dt_bias, w.lower_bound, w.scale};
    bool created;
    kdac_error err;
    if (CTL_RETRYING(g, "layer register", err, kdac_layer_register(c, &layer, &created, &err))) {
        rc = ctl_fail(g, "layer register", &err);
        goto done;
    }
    if (g->json) {
        json_object *o = json_object_new_object();
        json_object_object_add(o, "name", json_object_new_string(name));
        json_object_object_add(o, "created", json_object_new_boolean(created));
        json_object_object_add(o, "heads", json_u64((uint64_t)w.heads));
        json_object_object_add(o, "lower_bound", json_object_new_double(w.lower_bound));
        json_object_object_add(o, "scale", json_object_new_double(w.scale));
        ctl_print_json(o);
    } else {
        printf("layer %s %s (%d heads, lower_bound %g, scale %g)\n", name,
               created ? "registered" : "already registered, identical", w.heads,
               (double)w.lower_bound, (double)w.scale);
    }
done:
    layer_weights_free(&w);
    return rc;
}

enum { OPT_LOWER_BOUND = 256, OPT_SCALE }; /* long only: -l and -c mean other things elsewhere */

int cmd_layer(ctl *g, int argc, char **argv)
{
    static const struct option opts[] = {
        {"help", no_argument, NULL, 'h'},
        {"weights", required_argument, NULL, 'w'},
        {"lower-bound", required_argument, NULL, OPT_LOWER_BOUND},
        {"scale", required_argument, NULL, OPT_SCALE},
        {NULL, 0, NULL, 0}};
    const char *weights = NULL;
    double lb, scale;
    bool has_lb = false, has_scale = false;
    int o;
    while ((o = getopt_long(argc, argv, "hw:", opts, NULL)) != -1) {
        switch (o) {
        case 'h':
            fputs(layer_help, stdout);
            return EXIT_OK;
        case 'w':
            weights = optarg;
            break;
        case OPT_LOWER_BOUND:
            if (!parse_double(optarg, &lb) || !(lb >= -5 && lb < 0))
                return ctl_usage("layer", "--lower-bound: '%s' is not in [-5, 0)", optarg);
            has_lb = true;
            break;
        case OPT_SCALE:
            if (!parse_double(optarg, &scale))
                return ctl_usage("layer", "--scale: '%s' is not a finite number", optarg);
            has_scale = true;
            break;
        default:
            return ctl_usage("layer", "unknown option");
        }
    }
    if (optind >= argc)
        return ctl_usage("layer", "which action: list, register or drop?");
    const char *action = argv[optind];
    int nargs = argc - optind - 1;
    char **args = argv + optind + 1;
    bool is_list = strcmp(action, "list") == 0, is_reg = strcmp(action, "register") == 0,
         is_drop = strcmp(action, "drop") == 0;
    if (!is_list && !is_reg && !is_drop) {
        static const char *const actions[] = {"list", "register", "drop"};
        const char *near = ctl_suggest(action, actions, 3);
        return near ? ctl_usage("layer", "unknown action '%s'; did you mean '%s'?", action, near)
                    : ctl_usage("layer", "unknown action '%s' (list, register or drop)", action);
    }
    if (nargs != (is_list ? 0 : 1))
        return ctl_usage("layer", is_list ? "list takes no argument" : "%s takes one NAME",
                         action);
    if (is_reg && !weights)
        return ctl_usage("layer", "register needs --weights FILE");
    if (!is_reg && (weights || has_lb || has_scale))
        return ctl_usage("layer", "--weights, --lower-bound and --scale go with register");

    kdac_client *c;
    int rc = ctl_connect(g, &c);
    if (rc)
        return rc;
    if (is_list) {
        rc = layer_list(g, c);
    } else if (is_reg) {
        rc = layer_register(g, c, args[0], weights, has_lb ? &lb : NULL,
                            has_scale ? &scale : NULL);
    } else {
        kdac_error err;
        if (kdac_layer_drop(c, args[0], &err)) {
            rc = ctl_fail(g, "layer drop", &err);
        } else if (g->json) {
            json_object *j = json_object_new_object();
            json_object_object_add(j, "dropped", json_object_new_string(args[0]));
            ctl_print_json(j);
        } else {
            printf("layer %s dropped\n", args[0]);
        }
    }
    kdac_client_close(c);
    return rc;
}
