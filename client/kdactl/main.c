/*
 * main.c - kdactl, the shell tool of kdad: global options, the command
 * table, help, and exit codes.  Each command group lives in its own file
 * (see common.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"

typedef struct command {
    const char *name;
    ctl_command run;
    int timeout_ms; /* when --timeout is not given; 0: wait as long as the command takes */
    const char *summary;
} command;

#define QUICK_TIMEOUT_MS 5000 /* commands that must answer at once give up after this */

static const command commands[] = {
    {"hello", cmd_hello, QUICK_TIMEOUT_MS,
     "handshake: show the daemon, its backend, geometry, limits and bounds"},
    {"ping", cmd_ping, QUICK_TIMEOUT_MS, "round-trip a health request and show the time it took"},
    {"health", cmd_health, QUICK_TIMEOUT_MS,
     "liveness and load (ok or draining, queue, batches running)"},
    {"stats", cmd_stats, QUICK_TIMEOUT_MS,
     "the daemon's counters: requests, tokens, latency, errors, held bytes"},
    {"layer", cmd_layer, 0, "list, register or drop layers (A_log, dt_bias, lower_bound, scale)"},
    {"slot", cmd_slot, 0, "alloc, free, reset, fork, save, load, info of state slots"},
    {"prefill", cmd_prefill, 0, "run a prefill from a golden-format file or random inputs"},
    {"bench", cmd_bench, 0, "load generator: concurrent clients, latency and throughput"},
    {"step", cmd_step, 0, "run a decode step (many sequences, a few tokens each)"},
};
#define NCOMMANDS (sizeof(commands) / sizeof(commands[0]))

static void usage(FILE *f)
{
    fprintf(f,
            "Usage: kdactl [OPTIONS] COMMAND [ARGS...]   (the options may also follow COMMAND)\n"
            "\n"
            "Drives kdad, the Kimi Delta Attention prefill daemon.\n"
            "\n"
            "Commands:\n");
    for (size_t i = 0; i < NCOMMANDS; i++)
        fprintf(f, "  %-9s %s\n", commands[i].name, commands[i].summary);
    fprintf(f,
            "\n"
            "Options:\n"
            "  -s, --socket PATH    the daemon's socket (default: $KDAD_SOCKET, else\n"
            "                       $XDG_RUNTIME_DIR/kdad.sock if it exists, else %s)\n"
            "  -g, --gpu N          the kdad serving GPU N (an ordinal or a UUID: kdad@N.service):\n"
            "                       kdad-N.sock in $XDG_RUNTIME_DIR if it exists, else in /run/kdad\n"
            "  -j, --json           print one JSON document instead of text\n"
            "  -t, --timeout SEC    give up on a daemon that does not answer (default: %d s for\n"
            "                       hello, ping, health and stats; the others wait)\n"
            "      --retries N      after a retryable error (POOL_FULL, BUSY, ...) try again up\n"
            "                       to N times, backing off (default %d)\n"
            "      --retry-delay MS the first back-off, doubled each time up to %d ms (default %d)\n"
            "      --no-retry       report a retryable error at once (--retries 0)\n"
            "  -h, --help           this help; 'kdactl COMMAND --help' for a command's\n"
            "  -V, --version        kdactl's version and protocol\n"
            "\n"
            "Exit codes:\n"
            "  0  success\n"
            "  1  the daemon refused the request (its error name and message are printed);\n"
            "     prefill --check: errors above the accuracy contract\n"
            "  2  usage: unknown command or bad option\n"
            "  3  the daemon is not running, or its socket cannot be reached\n"
            "  4  the daemon speaks another protocol version, or is not kdad\n"
            "  5  a file cannot be read or written, is malformed, or does not fit the daemon\n"
            "  6  not supported by the daemon or by this kdactl (e.g. cuda-ipc without CUDA)\n"
            "  7  the connection was lost or timed out mid-command\n"
            "  130  bench interrupted by Ctrl-C (the results so far are printed)\n",
            KDAC_SYSTEM_SOCKET, QUICK_TIMEOUT_MS / 1000, CTL_DEFAULT_RETRIES, CTL_MAX_RETRY_MS,
            CTL_DEFAULT_RETRY_MS);
}

static void version(void)
{
    printf("kdactl %s (libkdaclient %s, protocol %d)\n", KDAD_VERSION, kdac_version_string(),
           KDAC_PROTOCOL_VERSION);
}

/* The global options with a value, and those without. */
static const char *const value_options[] = {"--socket", "--gpu", "--timeout", "--retries", "--retry-delay"};
static const char *const flag_options[] = {"--json", "--no-retry", "--help", "--version"};

/* Applies one global option (its long name) with its value; returns -1 or an exit code. */
static int apply_global(ctl *g, const char *name, const char *value, bool *timeout_given)
{
    double sec;
    uint64_t n;
    if (strcmp(name, "--socket") == 0) {
        g->socket = value;
    } else if (strcmp(name, "--gpu") == 0) {
        g->gpu = value;
    } else if (strcmp(name, "--json") == 0) {
        g->json = true;
    } else if (strcmp(name, "--timeout") == 0) {
        if (!parse_double(value, &sec) || sec <= 0 || sec > 86400)
            return ctl_usage("", "--timeout: '%s' is not a number of seconds in (0, 86400]",
                             value);
        g->timeout_ms = (int)(sec * 1000);
        *timeout_given = true;
    } else if (strcmp(name, "--retries") == 0) {
        if (!parse_u64(value, 0, 100, &n))
            return ctl_usage("", "--retries: '%s' is not a count in [0, 100]", value);
        g->retries = (int)n;
    } else if (strcmp(name, "--retry-delay") == 0) {
        if (!parse_u64(value, 1, CTL_MAX_RETRY_MS, &n))
            return ctl_usage("", "--retry-delay: '%s' is not in [1, %d] ms", value,
                             CTL_MAX_RETRY_MS);
        g->retry_ms = (int)n;
    } else if (strcmp(name, "--no-retry") == 0) {
        g->retries = 0;
    } else if (strcmp(name, "--help") == 0) {
        usage(stdout);
        return EXIT_OK;
    } else if (strcmp(name, "--version") == 0) {
        version();
        return EXIT_OK;
    }
    return -1;
}

/* The long name of a global option spelled `arg` ("-j", "--json", "--socket=PATH", "-sPATH"),
 * with *value pointing at an attached value; NULL when arg is none. */
static const char *global_name(const char *arg, const char **value, bool with_help)
{
    static const struct {
        char short_name;
        const char *name;
    } shorts[] = {{'s', "--socket"}, {'g', "--gpu"}, {'t', "--timeout"}, {'j', "--json"},
                  {'h', "--help"},   {'V', "--version"}};
    *value = NULL;
    if (arg[0] != '-')
        return NULL;
    if (arg[1] != '-') {
        for (size_t i = 0; i < sizeof(shorts) / sizeof(shorts[0]); i++) {
            if (arg[1] != shorts[i].short_name || (!with_help && strchr("hV", arg[1])))
                continue;
            bool takes = arg[1] == 's' || arg[1] == 'g' || arg[1] == 't';
            if (arg[2] && !takes)
                return NULL; /* "-jx": a bundle of a command's flags, not ours */
            *value = arg[2] ? arg + 2 : NULL;
            return shorts[i].name;
        }
        return NULL;
    }
    size_t len = strcspn(arg, "=");
    for (size_t i = 0; i < sizeof(value_options) / sizeof(value_options[0]); i++) {
        if (strlen(value_options[i]) == len && strncmp(arg, value_options[i], len) == 0) {
            *value = arg[len] ? arg + len + 1 : NULL;
            return value_options[i];
        }
    }
    for (size_t i = 0; i < sizeof(flag_options) / sizeof(flag_options[0]); i++) {
        if (!with_help && i >= 2)
            break;
        if (strcmp(arg, flag_options[i]) == 0)
            return flag_options[i];
    }
    return NULL;
}

static bool takes_value(const char *name)
{
    for (size_t i = 0; i < sizeof(value_options) / sizeof(value_options[0]); i++) {
        if (strcmp(name, value_options[i]) == 0)
            return true;
    }
    return false;
}

/*
 * Takes the global options out of argv[from..argc) into g (before the command: everything up
 * to it; after it: the command's own --help and -h stay its).  Returns -1 to go on, or an exit
 * code.  *argc shrinks by what was taken.
 */
static int take_globals(ctl *g, int from, int *argc, char **argv, bool before_command,
                        bool *timeout_given)
{
    int out = from;
    for (int i = from; i < *argc; i++) {
        const char *arg = argv[i], *value;
        if (strcmp(arg, "--") == 0) {
            while (i < *argc)
                argv[out++] = argv[i++];
            break;
        }
        if (before_command && arg[0] != '-') {
            while (i < *argc)
                argv[out++] = argv[i++];
            break;
        }
        const char *name = global_name(arg, &value, before_command);
        if (!name) {
            if (before_command) {
                const char *near = ctl_suggest(arg, (const char *const[]){"--socket", "--gpu",
                                               "--json", "--timeout", "--retries",
                                               "--retry-delay", "--no-retry", "--help",
                                               "--version"}, 9);
                return near ? ctl_usage("", "unknown option '%s'; did you mean '%s'?", arg, near)
                            : ctl_usage("", "unknown option '%s'", arg);
            }
            argv[out++] = argv[i];
            continue;
        }
        if (takes_value(name) && !value) {
            if (i + 1 >= *argc)
                return ctl_usage("", "%s needs a value", name);
            value = argv[++i];
        } else if (!takes_value(name) && value) {
            return ctl_usage("", "%s takes no value", name);
        }
        int rc = apply_global(g, name, value, timeout_given);
        if (rc >= 0)
            return rc;
    }
    *argc = out;
    argv[out] = NULL;
    return -1;
}

static const command *find_command(const char *name)
{
    for (size_t i = 0; i < NCOMMANDS; i++) {
        if (strcmp(commands[i].name, name) == 0)
            return &commands[i];
    }
    return NULL;
}

static int unknown_command(const char *name)
{
    const char *names[NCOMMANDS];
    for (size_t i = 0; i < NCOMMANDS; i++)
        names[i] = commands[i].name;
    const char *near = ctl_suggest(name, names, NCOMMANDS);
    fprintf(stderr, "kdactl: unknown command '%s'", name);
    if (near)
        fprintf(stderr, "; did you mean '%s'?", near);
    fprintf(stderr, "\nTry 'kdactl --help' for the list of commands.\n");
    return EXIT_USAGE;
}

int main(int argc, char **argv)
{
    ctl g = {.retries = CTL_DEFAULT_RETRIES, .retry_ms = CTL_DEFAULT_RETRY_MS};
    bool timeout_given = false;
    int rc = take_globals(&g, 1, &argc, argv, true, &timeout_given);
    if (rc >= 0)
        return rc;
    if (argc < 2) {
        usage(stderr);
        return EXIT_USAGE;
    }
    const char *name = argv[1];
    if (strcmp(name, "help") == 0) {
        if (argc < 3) {
            usage(stdout);
            return EXIT_OK;
        }
        const command *cmd = find_command(argv[2]);
        if (!cmd)
            return unknown_command(argv[2]);
        char *help_argv[] = {(char *)cmd->name, "--help", NULL};
        optind = 0;
        return cmd->run(&g, 2, help_argv);
    }
    const command *cmd = find_command(name);
    if (!cmd)
        return unknown_command(name);
    if ((rc = take_globals(&g, 2, &argc, argv, false, &timeout_given)) >= 0)
        return rc;
    if (!timeout_given)
        g.timeout_ms = cmd->timeout_ms;
    g.progress = !g.json && isatty(STDERR_FILENO);
    optind = 0; /* restart getopt for the command's own options */
    return cmd->run(&g, argc - 1, argv + 1);
}
