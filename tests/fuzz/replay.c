/*
 * replay.c - runs a fuzz target's LLVMFuzzerTestOneInput over files, for
 * builds without libFuzzer (ctest runs the seeds and the corpus this way).
 *
 *   fuzz_wire_replay FILE|DIR...      (fuzz_config_replay likewise)
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* As libFuzzer: a target may define LLVMFuzzerInitialize, and need not. */
__attribute__((weak)) int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len);

static int run_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *data = malloc(n > 0 ? (size_t)n : 1);
    size_t got = data ? fread(data, 1, (size_t)n, f) : 0;
    fclose(f);
    if (!data || got != (size_t)n) {
        fprintf(stderr, "%s: cannot read\n", path);
        free(data);
        return 1;
    }
    LLVMFuzzerTestOneInput(data, got);
    free(data);
    return 0;
}

int main(int argc, char **argv)
{
    if (LLVMFuzzerInitialize)
        LLVMFuzzerInitialize(&argc, &argv);
    int failed = 0, inputs = 0;
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) != 0) {
            perror(argv[i]);
            return 1;
        }
        if (!S_ISDIR(st.st_mode)) {
            failed |= run_file(argv[i]);
            inputs++;
            continue;
        }
        DIR *d = opendir(argv[i]);
        struct dirent *e;
        while (d && (e = readdir(d))) {
            if (e->d_name[0] == '.')
                continue;
            char path[4096];
            snprintf(path, sizeof(path), "%s/%s", argv[i], e->d_name);
            failed |= run_file(path);
            inputs++;
        }
        if (d)
            closedir(d);
    }
    printf("%s: %d inputs\n", argv[0], inputs);
    return failed || inputs == 0;
}
