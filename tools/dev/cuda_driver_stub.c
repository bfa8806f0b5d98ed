/* Link-time stand-in for the CUDA driver library (libcuda.so.1). Every function returns
   CUDA_ERROR_STUB_LIBRARY; the real libcuda.so.1 on the GPU machine replaces it at run time.
   Not shipped with the binaries (tools/dev/build_llamacpp_sm90.sh). */
#include <cuda.h>
#define STUB CUDA_ERROR_STUB_LIBRARY
CUresult cuDeviceGet(CUdevice *d, int o) { (void)d; (void)o; return STUB; }
CUresult cuDeviceGetAttribute(int *p, CUdevice_attribute a, CUdevice d) { (void)p; (void)a; (void)d; return STUB; }
CUresult cuGetErrorString(CUresult e, const char **s) { (void)e; if (s) *s = "libcuda stub"; return STUB; }
CUresult cuMemAddressFree(CUdeviceptr p, size_t n) { (void)p; (void)n; return STUB; }
CUresult cuMemAddressReserve(CUdeviceptr *p, size_t n, size_t al, CUdeviceptr a, unsigned long long f) { (void)p; (void)n; (void)al; (void)a; (void)f; return STUB; }
CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *pr, unsigned long long f) { (void)h; (void)n; (void)pr; (void)f; return STUB; }
CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *pr, CUmemAllocationGranularity_flags o) { (void)g; (void)pr; (void)o; return STUB; }
CUresult cuMemMap(CUdeviceptr p, size_t n, size_t off, CUmemGenericAllocationHandle h, unsigned long long f) { (void)p; (void)n; (void)off; (void)h; (void)f; return STUB; }
CUresult cuMemRelease(CUmemGenericAllocationHandle h) { (void)h; return STUB; }
CUresult cuMemSetAccess(CUdeviceptr p, size_t n, const CUmemAccessDesc *d, size_t c) { (void)p; (void)n; (void)d; (void)c; return STUB; }
CUresult cuMemUnmap(CUdeviceptr p, size_t n) { (void)p; (void)n; return STUB; }
