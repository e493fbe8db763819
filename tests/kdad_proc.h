/*
 * kdad_proc.h - processes for end-to-end tests: a real kdad (from this
 * build) on a socket in a temporary folder, and commands (kdactl, the
 * examples) run against it with their output captured.
 */
#ifndef KDAD_PROC_H
#define KDAD_PROC_H

#include <stdarg.h>
#include <stdbool.h>
#include <sys/types.h>

typedef struct kdad_proc {
    pid_t pid;
    char dir[64];   /* temporary folder: socket, config, log */
    char sock[108]; /* dir/kdad.sock */
    char log[96];   /* dir/kdad.log: the daemon's stdout and stderr */
} kdad_proc;

/* Starts build/daemon/kdad --backend cpu --heads H --slots 64 on a fresh
 * socket, with config_yaml (may be NULL) as its --config file, and waits
 * until it answers hello.  False (and the log printed) when it does not. */
bool kdad_start(kdad_proc *d, int heads, const char *config_yaml);
/* The same with --backend `backend` ("cpu", "cuda"). */
bool kdad_start_on(kdad_proc *d, const char *backend, int heads, const char *config_yaml);
/* SIGTERM, and waits for the drain; returns the exit status (-1: it had to
 * be killed or did not exit normally).  Removes the folder. */
int kdad_stop(kdad_proc *d);

typedef struct cmd_result {
    int status;  /* exit code; -1 when killed by a signal or timed out */
    char *out;   /* stdout, NUL-terminated (malloc'd) */
    char *err;   /* stderr */
} cmd_result;

/* Runs argv (argv[0] a path, NULL-terminated) with a 300 s limit. */
cmd_result cmd_run(char *const argv[]);
/* Runs build/client/kdactl --socket SOCK ARGS... (NULL-terminated). */
cmd_result kdactl(const char *sock, ...);
/* The same with first (NULL: none) before the ARGS of ap. */
cmd_result kdactl_v(const char *sock, const char *first, va_list ap);
void cmd_free(cmd_result *r);

/* A path inside the build folder (KDAD_BUILD_DIR/rel), in a static buffer
 * per call slot (four rotate). */
const char *build_path(const char *rel);

#endif /* KDAD_PROC_H */
