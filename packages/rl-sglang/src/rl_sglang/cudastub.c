/* A stub CUDA driver library (libcuda.so.1) for running SGLang on a CPU-only machine.
 *
 * The sglang-kernel wheels on PyPI are CUDA builds; importing them needs libcuda.so.1 even when
 * SGLang runs with --device cpu. Every driver entry point they link against is defined here and
 * returns CUDA_ERROR_NO_DEVICE (100), so torch.cuda.is_available() stays False and nothing runs on
 * a GPU. Built by scripts/setup_sglang_env.sh:  gcc -shared -fPIC -O2 -o libcuda.so.1 cudastub.c
 * Used only when the configured device is "cpu" (see rl_sglang/_cpu_support.py).
 */
#define NO_DEVICE 100
#define STUB(name) int name(void) { return NO_DEVICE; }

STUB(cuInit)
STUB(cuDeviceGetCount)
STUB(cuDriverGetVersion)
STUB(cuPointerGetAttribute)
STUB(cuCtxFromGreenCtx)
STUB(cuCtxPopCurrent_v2)
STUB(cuCtxPushCurrent_v2)
STUB(cuDevResourceGenerateDesc)
STUB(cuDevSmResourceSplitByCount)
STUB(cuDeviceGetDevResource)
STUB(cuGetProcAddress)
STUB(cuGetProcAddress_v2)
STUB(cuGreenCtxCreate)
STUB(cuGreenCtxDestroy)
STUB(cuGreenCtxGetDevResource)
STUB(cuStreamCreate)

int cuGetErrorString(int error, const char **message) {
    static const char *text = "CUDA stub: no device (rl-sglang CPU support)";
    (void)error;
    if (message) *message = text;
    return 0;
}
