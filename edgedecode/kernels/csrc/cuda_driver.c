/* CUDA driver glue: dlopen of libcuda.so.1, the cubin images Python hands over, one module per context, launches. */
#include "cuda_driver.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "exports.h"

const char *const ED_KERNEL_NAMES[ED_KERNEL_COUNT] = {
    "ed_gemv_r1_m1",       "ed_gemv_r2_m1",       "ed_gemv_r4_m1",       "ed_gemv_r1_m4",
    "ed_gemv_r2_m4",       "ed_gemv_r4_m4",       "ed_gemv_gated_r2_m1", "ed_gemv_gated_r4_m1",
    "ed_gemv_gated_r2_m4", "ed_gemv_gated_r4_m4", "ed_gather",
};

/* Driver enum values used (from the driver API's documented enums). */
enum {
    ATTR_MULTIPROCESSOR_COUNT = 16,
    ATTR_COMPUTE_CAPABILITY_MAJOR = 75,
    ATTR_COMPUTE_CAPABILITY_MINOR = 76,
    ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97,
    FUNC_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8,
};

static struct {
    CUresult (*Init)(unsigned flags);
    CUresult (*GetErrorString)(CUresult error, const char **text);
    CUresult (*DeviceGet)(CUdevice *device, int ordinal);
    CUresult (*DeviceGetAttribute)(int *value, int attribute, CUdevice device);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *context, CUdevice device);
    CUresult (*CtxGetCurrent)(CUcontext *context);
    CUresult (*CtxGetDevice)(CUdevice *device);
    CUresult (*CtxPushCurrent)(CUcontext context);
    CUresult (*CtxPopCurrent)(CUcontext *context);
    CUresult (*ModuleLoadData)(CUmodule *module, const void *image);
    CUresult (*ModuleGetFunction)(CUfunction *function, CUmodule module, const char *name);
    CUresult (*FuncSetAttribute)(CUfunction function, int attribute, int value);
    CUresult (*LaunchKernel)(CUfunction function, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                             unsigned block_x, unsigned block_y, unsigned block_z, unsigned shared_bytes,
                             CUstream stream, void **params, void **extra);
} cu;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int driver_state; /* 0 not tried, 1 loaded, -1 failed */
static char driver_error[256];

enum { MAX_IMAGES = 8, MAX_MODULES = 8 };
static struct {
    int arch;
    void *data;
    size_t size;
} images[MAX_IMAGES];
static EdCudaModule modules[MAX_MODULES];
static int module_count;
static EdTuning tuning;

static const char *error_text(CUresult code) {
    const char *text = NULL;
    if (cu.GetErrorString && cu.GetErrorString(code, &text) == 0 && text)
        return text;
    return "unknown CUDA error";
}

/* Resolve the driver once (under `lock`). */
static int load_driver(void) {
    if (driver_state)
        return driver_state > 0 ? 0 : -1;
    driver_state = -1;
    void *library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!library) {
        snprintf(driver_error, sizeof driver_error, "no CUDA driver: libcuda.so.1 could not be opened (%s)",
                 dlerror());
        return -1;
    }
    struct {
        void **slot;
        const char *name;
    } symbols[] = {
        {(void **)&cu.Init, "cuInit"},
        {(void **)&cu.GetErrorString, "cuGetErrorString"},
        {(void **)&cu.DeviceGet, "cuDeviceGet"},
        {(void **)&cu.DeviceGetAttribute, "cuDeviceGetAttribute"},
        {(void **)&cu.DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"},
        {(void **)&cu.CtxGetCurrent, "cuCtxGetCurrent"},
        {(void **)&cu.CtxGetDevice, "cuCtxGetDevice"},
        {(void **)&cu.CtxPushCurrent, "cuCtxPushCurrent_v2"},
        {(void **)&cu.CtxPopCurrent, "cuCtxPopCurrent_v2"},
        {(void **)&cu.ModuleLoadData, "cuModuleLoadData"},
        {(void **)&cu.ModuleGetFunction, "cuModuleGetFunction"},
        {(void **)&cu.FuncSetAttribute, "cuFuncSetAttribute"},
        {(void **)&cu.LaunchKernel, "cuLaunchKernel"},
    };
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++)
        if (!(*symbols[i].slot = dlsym(library, symbols[i].name))) {
            snprintf(driver_error, sizeof driver_error, "the CUDA driver lacks %s", symbols[i].name);
            return -1;
        }
    const CUresult status = cu.Init(0);
    if (status) {
        snprintf(driver_error, sizeof driver_error, "cuInit failed: %s (%d)", error_text(status), status);
        return -1;
    }
    driver_state = 1;
    return 0;
}

EXPORT const char *edgedecode_cuda_driver_status(void) {
    pthread_mutex_lock(&lock);
    load_driver();
    pthread_mutex_unlock(&lock);
    return driver_state > 0 ? "" : driver_error;
}

EXPORT int edgedecode_cuda_set_image(int arch, const void *data, size_t size) {
    if (!data || !size)
        return -1;
    void *copy = malloc(size);
    if (!copy)
        return -1;
    memcpy(copy, data, size);
    pthread_mutex_lock(&lock);
    int slot = -1;
    for (int i = 0; i < MAX_IMAGES; i++)
        if (images[i].arch == arch || (slot < 0 && !images[i].data))
            slot = i;
    if (slot >= 0) {
        free(images[slot].data); /* a module already loaded from the old image keeps running */
        images[slot].arch = arch, images[slot].data = copy, images[slot].size = size;
    }
    pthread_mutex_unlock(&lock);
    if (slot < 0)
        free(copy);
    return slot < 0 ? -1 : 0;
}

EXPORT int edgedecode_cuda_has_image(int arch) {
    pthread_mutex_lock(&lock);
    int found = 0;
    for (int i = 0; i < MAX_IMAGES; i++)
        found |= images[i].data && images[i].arch == arch;
    pthread_mutex_unlock(&lock);
    return found;
}

EXPORT void edgedecode_cuda_set_tuning(int lanes, int rows, int threads, int blocks_per_sm) {
    pthread_mutex_lock(&lock);
    tuning.lanes = lanes, tuning.rows = rows, tuning.threads = threads, tuning.blocks_per_sm = blocks_per_sm;
    pthread_mutex_unlock(&lock);
}

EdTuning ed_cuda_tuning(void) {
    pthread_mutex_lock(&lock);
    const EdTuning copy = tuning;
    pthread_mutex_unlock(&lock);
    return copy;
}

#define CHECK(call, what)                                                                                            \
    do {                                                                                                             \
        const CUresult code_ = (call);                                                                               \
        if (code_) {                                                                                                 \
            snprintf(why, size, "%s failed: %s (%d)", what, error_text(code_), code_);                               \
            return -1;                                                                                               \
        }                                                                                                            \
    } while (0)

/* Load the module into `context` (current on this thread), under `lock`. */
static int load_module(CUcontext context, EdCudaModule *m, char *why, size_t size) {
    CUdevice device;
    int major = 0, minor = 0;
    CHECK(cu.CtxGetDevice(&device), "cuCtxGetDevice");
    CHECK(cu.DeviceGetAttribute(&major, ATTR_COMPUTE_CAPABILITY_MAJOR, device), "cuDeviceGetAttribute");
    CHECK(cu.DeviceGetAttribute(&minor, ATTR_COMPUTE_CAPABILITY_MINOR, device), "cuDeviceGetAttribute");
    CHECK(cu.DeviceGetAttribute(&m->sm_count, ATTR_MULTIPROCESSOR_COUNT, device), "cuDeviceGetAttribute");
    CHECK(cu.DeviceGetAttribute(&m->max_shared, ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device),
          "cuDeviceGetAttribute");
    m->max_shared -= 2048; /* room for the kernels' static shared memory (under 1 KiB) */
    m->arch = major * 10 + minor;
    const void *image = NULL;
    for (int i = 0; i < MAX_IMAGES; i++)
        if (images[i].data && images[i].arch == m->arch)
            image = images[i].data;
    if (!image) {
        snprintf(why, size,
                 "no CUDA kernels compiled for sm_%d: call edgedecode.kernels.nvrtc.prepare() before creating the "
                 "session",
                 m->arch);
        return -1;
    }
    CHECK(cu.ModuleLoadData(&m->module, image), "cuModuleLoadData");
    for (int i = 0; i < ED_KERNEL_COUNT; i++) {
        CHECK(cu.ModuleGetFunction(&m->functions[i], m->module, ED_KERNEL_NAMES[i]), ED_KERNEL_NAMES[i]);
        if (strncmp(ED_KERNEL_NAMES[i], "ed_gemv", 7) == 0)
            CHECK(cu.FuncSetAttribute(m->functions[i], FUNC_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES, m->max_shared),
                  "cuFuncSetAttribute");
    }
    m->context = context;
    return 0;
}

int ed_cuda_module(const EdCudaModule **out, char *why, size_t size) {
    pthread_mutex_lock(&lock);
    int result = -1;
    if (load_driver()) {
        snprintf(why, size, "%s", driver_error);
        goto done;
    }
    CUcontext context = NULL, popped;
    int pushed = 0;
    CUresult code = cu.CtxGetCurrent(&context);
    if (!code && !context) {
        CUdevice device;
        if (!(code = cu.DeviceGet(&device, 0)) && !(code = cu.DevicePrimaryCtxRetain(&context, device)) &&
            !(code = cu.CtxPushCurrent(context)))
            pushed = 1;
    }
    if (code) {
        snprintf(why, size, "no CUDA context: %s (%d)", error_text(code), code);
        goto done;
    }
    for (int i = 0; i < module_count; i++)
        if (modules[i].context == context) {
            *out = &modules[i];
            result = 0;
        }
    if (result && module_count == MAX_MODULES)
        snprintf(why, size, "more than %d CUDA contexts", MAX_MODULES);
    else if (result && !load_module(context, &modules[module_count], why, size)) {
        *out = &modules[module_count++];
        result = 0;
    }
    if (pushed)
        cu.CtxPopCurrent(&popped);
done:
    pthread_mutex_unlock(&lock);
    return result;
}

int ed_cuda_launch(const EdCudaModule *m, const EdLaunch *launch, void *args, CUstream stream, char *why,
                   size_t size) {
    CUfunction function = NULL;
    for (int i = 0; i < ED_KERNEL_COUNT && !function; i++)
        if (strcmp(ED_KERNEL_NAMES[i], launch->kernel) == 0)
            function = m->functions[i];
    if (!function) {
        snprintf(why, size, "no kernel %s", launch->kernel);
        return -1;
    }
    /* onnxruntime runs CUDA kernels with the device's primary context current; a thread without it pushes it. */
    CUcontext current = NULL, popped;
    const int push = cu.CtxGetCurrent(&current) == 0 && current != m->context;
    if (push)
        CHECK(cu.CtxPushCurrent(m->context), "cuCtxPushCurrent");
    void *params[] = {args};
    const CUresult code = cu.LaunchKernel(function, launch->grid_x, launch->grid_y, 1, launch->threads, 1, 1,
                                          launch->shared_bytes, stream, params, NULL);
    if (push)
        cu.CtxPopCurrent(&popped);
    if (code) {
        snprintf(why, size, "launching %s failed: %s (%d)", launch->kernel, error_text(code), code);
        return -1;
    }
    return 0;
}
