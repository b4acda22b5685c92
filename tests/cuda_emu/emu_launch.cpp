// The emulator's scheduler and the launch entry points the tests call through ctypes: the kernels of
// kernels.cu planned by the library's own cuda_plan.c, run block by block on the host.
#include <ucontext.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels.cu"

extern "C" {
#include "cuda_plan.h"
}

namespace emu {
namespace {
enum State { READY, AT_BARRIER, AT_SHUFFLE, DONE };
struct Fiber {
    ucontext_t context;
    std::vector<char> stack;
    State state;
    int generation;  // shuffles done, to pick the slot bank
};
constexpr size_t kStack = 256 * 1024;
ucontext_t scheduler;
std::vector<Fiber> fibers;
std::vector<float> slots[2];
std::vector<float> shared;
int current, bx, by, gx, gy, threads;
void (*body)();
void run_fiber() {
    body();
    fibers[current].state = DONE;
    swapcontext(&fibers[current].context, &scheduler);
}
void yield(State why) {
    fibers[current].state = why;
    swapcontext(&fibers[current].context, &scheduler);
}
}  // namespace

int thread_id() { return current; }
int block_x() { return bx; }
int block_y() { return by; }
int block_dim() { return threads; }
int grid_x() { return gx; }
int grid_y() { return gy; }
float *dynamic_shared() { return shared.data(); }
void barrier() { yield(AT_BARRIER); }
float shuffle_xor(float v, int offset) {
    Fiber &f = fibers[current];
    const int bank = f.generation++ & 1;
    slots[bank][current] = v;
    yield(AT_SHUFFLE);
    const int partner = current ^ offset;
    if (partner >= threads) {
        std::fprintf(stderr, "emu: shuffle partner %d outside the block\n", partner);
        std::abort();
    }
    return slots[bank][partner];
}

// Run `kernel` over the grid; returns 0, or -1 if the threads of a block deadlock.
int launch(void (*kernel)(), unsigned grid_x_, unsigned grid_y_, unsigned threads_, unsigned shared_bytes) {
    gx = (int)grid_x_, gy = (int)grid_y_, threads = (int)threads_;
    body = kernel;
    fibers.assign(threads, Fiber());
    for (auto &f : fibers) f.stack.resize(kStack);
    slots[0].assign(threads, 0.0f), slots[1].assign(threads, 0.0f);
    shared.assign(shared_bytes / 4 + 4, std::nanf(""));  // unstaged reads show up as NaN
    for (by = 0; by < gy; ++by)
        for (bx = 0; bx < gx; ++bx) {
            for (int t = 0; t < threads; ++t) {
                Fiber &f = fibers[t];
                getcontext(&f.context);
                f.context.uc_stack.ss_sp = f.stack.data();
                f.context.uc_stack.ss_size = kStack;
                f.context.uc_link = nullptr;
                makecontext(&f.context, run_fiber, 0);
                f.state = READY, f.generation = 0;
            }
            for (;;) {
                bool ran = false;
                for (int t = 0; t < threads; ++t)
                    if (fibers[t].state == READY) {
                        current = t, ran = true;
                        swapcontext(&scheduler, &fibers[t].context);
                    }
                if (ran) continue;
                int live = 0, waiting = 0;
                for (auto &f : fibers) live += f.state != DONE, waiting += f.state == AT_BARRIER;
                if (!live) break;
                if (waiting == live) {
                    for (auto &f : fibers)
                        if (f.state == AT_BARRIER) f.state = READY;
                    continue;
                }
                bool released = false;
                for (int w = 0; w < threads; w += 32) {
                    int lanes = 0, at = 0;
                    for (int t = w; t < w + 32 && t < threads; ++t)
                        lanes += fibers[t].state != DONE, at += fibers[t].state == AT_SHUFFLE;
                    if (lanes && at == lanes) {
                        for (int t = w; t < w + 32 && t < threads; ++t)
                            if (fibers[t].state == AT_SHUFFLE) fibers[t].state = READY;
                        released = true;
                    }
                }
                if (!released) return -1;
            }
        }
    return 0;
}
}  // namespace emu

namespace {
EdGemvArgs gemv_args;
EdGatherArgs gather_args;
const char *gemv_name;

#define ED_ENTRY(NAME) \
    if (!std::strcmp(gemv_name, #NAME)) return NAME(gemv_args);
void gemv_body() {
    ED_ENTRY(ed_gemv_r1_m1)
    ED_ENTRY(ed_gemv_r2_m1)
    ED_ENTRY(ed_gemv_r4_m1)
    ED_ENTRY(ed_gemv_r1_m4)
    ED_ENTRY(ed_gemv_r2_m4)
    ED_ENTRY(ed_gemv_r4_m4)
    ED_ENTRY(ed_gemv_gated_r2_m1)
    ED_ENTRY(ed_gemv_gated_r4_m1)
    ED_ENTRY(ed_gemv_gated_r2_m4)
    ED_ENTRY(ed_gemv_gated_r4_m4)
    std::fprintf(stderr, "emu: no kernel %s\n", gemv_name);
    std::abort();
}
void gather_body() { ed_gather(gather_args); }
}  // namespace

// Plan (with the library's planner) and run one GEMV. Returns 0, -1 (planner refused), -2 (deadlock).
extern "C" int emu_gemv(EdGemvArgs *args, int segments, int gated, int lanes, int rows, int threads_,
                        int blocks_per_sm, int sm_count, char *kernel_out) {
    EdTuning tuning = {lanes, rows, threads_, blocks_per_sm};
    EdLaunch launch;
    if (ed_plan_gemv(args, segments, gated, &tuning, sm_count, 200 * 1024, &launch)) return -1;
    std::strcpy(kernel_out, launch.kernel);
    gemv_args = *args, gemv_name = launch.kernel;
    return emu::launch(gemv_body, launch.grid_x, launch.grid_y, launch.threads, launch.shared_bytes) ? -2 : 0;
}

// Run a launch the library's own glue planned (emu_driver.c: cuda_ops.c on the CPU provider). 0, or -2 (deadlock).
extern "C" int emu_run(const EdLaunch *launch, void *args) {
    if (!std::strcmp(launch->kernel, "ed_gather")) {
        gather_args = *static_cast<EdGatherArgs *>(args);
        return emu::launch(gather_body, launch->grid_x, launch->grid_y, launch->threads, 0) ? -2 : 0;
    }
    gemv_args = *static_cast<EdGemvArgs *>(args), gemv_name = launch->kernel;
    return emu::launch(gemv_body, launch->grid_x, launch->grid_y, launch->threads, launch->shared_bytes) ? -2 : 0;
}

extern "C" int emu_gather(EdGatherArgs *args) {
    EdLaunch launch;
    ed_plan_gather(args, 2, &launch);
    gather_args = *args;
    return emu::launch(gather_body, launch.grid_x, launch.grid_y, launch.threads, 0) ? -2 : 0;
}
