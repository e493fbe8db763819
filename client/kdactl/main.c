/*
 * main.c - kdactl, the shell tool of kdad: global options, the command
 * table, help, and exit codes.  Each command group lives in its own file
 * (see common.h).
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"

typedef struct command {
    const char *name;
    ctl_command run;
    const char *summary;
} command;

static const command commands[] = {
    {"hello", cmd_hello, "handshake: show the daemon, its backend, geometry and limits"},
    {"ping", cmd_ping, "round-trip a health request and show the time it took"},
    {"health", cmd_health, "liveness and load (ok or draining, queue, batches running)"},
    {"stats", cmd_stats, "the daemon's counters: requests, tokens, latency, errors"},
    {"layer", cmd_layer, "list, register or drop layers (A_log, dt_bias, lower_bound, scale)"},
    {"slot", cmd_slot, "alloc, free, reset, fork, save, load, info of state slots"},
    {"prefill", cmd_prefill, "run a prefill from a golden-format file or random inputs"},
    {"bench", cmd_bench, "load generator: concurrent clients, latency and throughput"},
    {"step", cmd_step, "run a decode step (many sequences, a few tokens each)"},
};
#define NCOMMANDS (sizeof(commands) / sizeof(commands[0]))

static void usage(FILE *f)
{
    fprintf(f,
            "Usage: kdactl [--socket PATH] [--json] [--timeout SEC] COMMAND [ARGS...]\n"
            "\n"
            "Drives kdad, the Kimi Delta Attention prefill daemon.\n"
            "\n"
            "Commands:\n");
    for (size_t i = 0; i < NCOMMANDS; i++)
        fprintf(f, "  %-9s %s\n", commands[i].name, commands[i].summary);
    fprintf(f,
            "\n"
            "Options:\n"
            "  -s, --socket PATH  the daemon's socket (default: $KDAD_SOCKET, else\n"
            "                     $XDG_RUNTIME_DIR/kdad.sock if it exists, else %s)\n"
            "  -j, --json         print one JSON document instead of text\n"
            "  -t, --timeout SEC  give up on a daemon that does not answer (default: wait)\n"
            "  -h, --help         this help; 'kdactl COMMAND --help' for a command's\n"
            "  -V, --version      kdactl's version and protocol\n"
            "\n"
            "Exit codes:\n"
            "  0  success\n"
            "  1  the daemon refused the request (its error name and message are printed)\n"
            "  2  usage: unknown command or bad option\n"
            "  3  the daemon is not running, or its socket cannot be reached\n"
            "  4  the daemon speaks another protocol version, or is not kdad\n"
            "  5  a file cannot be read or written, is malformed, or does not fit the daemon\n"
            "  6  not supported by the daemon or by this kdactl (e.g. cuda-ipc without CUDA)\n"
            "  7  the connection was lost or timed out mid-command\n",
            KDAC_SYSTEM_SOCKET);
}

int main(int argc, char **argv)
{
    static const struct option opts[] = {
        {"socket", required_argument, NULL, 's'}, {"json", no_argument, NULL, 'j'},
        {"timeout", required_argument, NULL, 't'}, {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},      {NULL, 0, NULL, 0},
    };
    ctl g = {NULL, false, 0, false};
    int o;
    double timeout;
    /* '+': stop at the command, whose own options follow it. */
    while ((o = getopt_long(argc, argv, "+s:jt:hV", opts, NULL)) != -1) {
        switch (o) {
        case 's':
            g.socket = optarg;
            break;
        case 'j':
            g.json = true;
            break;
        case 't':
            if (!parse_double(optarg, &timeout) || timeout <= 0 || timeout > 86400)
                return ctl_usage("", "--timeout: '%s' is not a number of seconds in (0, 86400]",
                                 optarg);
            g.timeout_ms = (int)(timeout * 1000);
            break;
        case 'h':
            usage(stdout);
            return EXIT_OK;
        case 'V':
            printf("kdactl %s (libkdaclient %s, protocol %d)\n", kdac_version_string(),
                   kdac_version_string(), KDAC_PROTOCOL_VERSION);
            return EXIT_OK;
        default:
            usage(stderr);
            return EXIT_USAGE;
        }
    }
    if (optind >= argc) {
        usage(stderr);
        return EXIT_USAGE;
    }
    g.progress = !g.json && isatty(STDERR_FILENO);
    const char *name = argv[optind];
    if (strcmp(name, "help") == 0) {
        if (optind + 1 >= argc) {
            usage(stdout);
            return EXIT_OK;
        }
        name = argv[optind + 1];
        char *help_argv[] = {(char *)name, "--help", NULL};
        for (size_t i = 0; i < NCOMMANDS; i++) {
            if (strcmp(commands[i].name, name) == 0) {
                optind = 0;
                return commands[i].run(&g, 2, help_argv);
            }
        }
        return ctl_usage("help", "no command '%s'", name);
    }
    for (size_t i = 0; i < NCOMMANDS; i++) {
        if (strcmp(commands[i].name, name) == 0) {
            int cargc = argc - optind;
            char **cargv = argv + optind;
            optind = 0; /* restart getopt for the command's own options */
            return commands[i].run(&g, cargc, cargv);
        }
    }
    fprintf(stderr, "kdactl: unknown command '%s'\n", name);
    usage(stderr);
    return EXIT_USAGE;
}
