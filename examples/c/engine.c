/* A tiny C "engine" that links libringscope and dumps a few layers' activations to Parquet.
 *
 *   cargo build --release -p ringscope-ffi
 *   cc -std=c11 -Wall -Wextra -Werror -I ffi/include examples/c/engine.c -L target/release -lringscope -o c_engine
 *   LD_LIBRARY_PATH=target/release ./c_engine ringscope-out c-engine
 *
 * Each step, 3 requests decode one token each (a 3-row batch); 4 layers of 64 bf16 values per row are captured
 * from host memory. Row r of layer l at step s holds bf16(l * 1000 + s * 10 + r) (truncated) in every element, so a
 * reader can check the dump. Each step it asks whether a sink has failed (rs_sink_status); at the end it prints the
 * session's statistics (rs_session_stats). Exits non-zero, printing ringscope's message, on any failure.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ringscope.h"

#define LAYERS 4
#define HIDDEN 64
#define ROWS 3
#define STEPS 10

static int check(rs_status st, const char *what) {
    if (st != RS_OK) {
        fprintf(stderr, "%s failed (status %d): %s\n", what, (int)st, rs_last_error());
        exit(1);
    }
    return 0;
}

/* bf16 of a small integer: the top 16 bits of the float. */
static uint16_t bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)(bits >> 16);
}

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : "ringscope-out";
    const char *run = argc > 2 ? argv[2] : "c-engine";
    char config[512];
    snprintf(config, sizeof config,
             "[ring]\ncapacity = \"4 MiB\"\n[policy]\nmode = \"full\"\n"
             "[export]\nparquet = true\ndir = \"%s\"\nrun_id = \"%s\"\n",
             dir, run);
    uint64_t session = 0;
    check(rs_session_open(config, &session), "rs_session_open");

    uint32_t ids[LAYERS];
    for (int l = 0; l < LAYERS; l++) {
        char name[32];
        snprintf(name, sizeof name, "layers.%d.resid", l);
        check(rs_register_hookpoint(session, name, "residual", l, "bf16", HIDDEN, &ids[l]), "rs_register_hookpoint");
    }

    uint16_t hidden[ROWS * HIDDEN];
    for (uint64_t step = 0; step < STEPS; step++) {
        uint64_t requests[ROWS] = {100, 101, 102};
        uint32_t positions[ROWS];
        for (int r = 0; r < ROWS; r++) positions[r] = (uint32_t)(5 + step);
        check(rs_begin_step(session, step, requests, positions, ROWS), "rs_begin_step");
        for (int l = 0; l < LAYERS; l++) {
            for (int r = 0; r < ROWS; r++)
                for (int i = 0; i < HIDDEN; i++) hidden[r * HIDDEN + i] = bf16((float)(l * 1000 + step * 10 + r));
            int outcome = -1;
            check(rs_capture_host(session, ids[l], hidden, sizeof hidden, &outcome), "rs_capture_host");
            if (outcome != RS_CAPTURE_PUBLISHED) {
                fprintf(stderr, "layer %d step %llu: outcome %d\n", l, (unsigned long long)step, outcome);
                return 1;
            }
        }
        check(rs_end_step(session), "rs_end_step");

        /* A sink that failed (a full disk, say) is known at once: one cheap call per step says so. */
        rs_sink_health health;
        check(rs_sink_status(session, &health), "rs_sink_status");
        if (health.failed_sinks > 0) {
            rs_sink_failure_info info;
            char buf[1024];
            check(rs_sink_failure(session, 0, &info, buf, sizeof buf), "rs_sink_failure");
            fprintf(stderr, "sink %s failed: %s\n", buf, buf + info.sink_len + 1);
            rs_session_close(session, NULL); /* the totals and the manifest count what was lost */
            return 1;
        }
    }

    /* A bad call gets a status and a message, not a crash. */
    rs_status bad = rs_end_step(session);
    printf("rs_end_step outside a step -> status %d: %s\n", (int)bad, rs_last_error());
    if (bad != RS_ERR_STEP) return 1;

    rs_counts layer0;
    check(rs_stats(session, ids[0], &layer0), "rs_stats");
    printf("layer 0 so far: %llu rows produced\n", (unsigned long long)layer0.produced_rows);

    /* The session's numbers (C ABI 2+): set struct_size to the struct this program was compiled with. */
    rs_session_snapshot stats = {.struct_size = sizeof stats};
    check(rs_session_stats(session, &stats), "rs_session_stats");
    printf("session: %llu steps, ring %llu of %llu bytes used, %llu bytes drained, %llu full-mode waits\n",
           (unsigned long long)stats.steps, (unsigned long long)stats.ring_used_bytes,
           (unsigned long long)stats.ring_capacity_bytes, (unsigned long long)stats.drain_bytes,
           (unsigned long long)stats.stalls);

    /* Close: drain, finish the Parquet files, check the accounting, and get the totals. */
    rs_counts totals;
    check(rs_session_close(session, &totals), "rs_session_close");
    check(rs_session_close(session, NULL), "rs_session_close (again: harmless)");
    printf("c_engine: %llu rows produced, %llu exported, %llu dropped, into %s/%s\n",
           (unsigned long long)totals.produced_rows, (unsigned long long)totals.exported_rows,
           (unsigned long long)totals.dropped_rows, dir, run);
    return totals.exported_rows == (uint64_t)LAYERS * ROWS * STEPS ? 0 : 1;
}
