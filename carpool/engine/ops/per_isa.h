// Compiles the kernels header named by CARPOOL_KERNELS three times, once per instruction set,
// each copy in its own namespace (carpool::avx512, carpool::avx2, carpool::scalar); the caller
// picks one at run time (best_isa() in simd.h).  Include guard deliberately absent: each .cpp
// includes it once with its own CARPOOL_KERNELS.  No -march: the target pragmas give each copy
// its instructions, so one build runs on any x86-64 and never executes an instruction the CPU lacks.
#ifndef CARPOOL_KERNELS
#error "define CARPOOL_KERNELS as the kernels header to instantiate before including per_isa.h"
#endif

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")
namespace carpool::avx512 {
#include CARPOOL_KERNELS
}  // namespace carpool::avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace carpool::avx2 {
#include CARPOOL_KERNELS
}  // namespace carpool::avx2
#pragma GCC pop_options

namespace carpool::scalar {
#include CARPOOL_KERNELS
}  // namespace carpool::scalar

#undef CARPOOL_KERNELS
