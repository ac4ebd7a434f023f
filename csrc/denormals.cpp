// Flush-to-zero and denormals-are-zero for every thread of torch's intra-op pool.
//
// Decaying SSM states and small activations reach denormal floats, which make every CPU
// kernel an order of magnitude slower. `torch.set_flush_denormal` only sets the calling
// thread's MXCSR (FPCR on aarch64; threads created later inherit it); the pool's threads may already exist,
// so this runs one task per pool thread and sets the flags there.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace {

void set_flags(bool on) {
#if defined(__SSE__)
  const unsigned int mask = 0x8040;  // FTZ (bit 15) and DAZ (bit 6)
  const unsigned int csr = _mm_getcsr();
  _mm_setcsr(on ? (csr | mask) : (csr & ~mask));
#elif defined(__aarch64__)
  uint64_t fpcr;
  asm volatile("mrs %0, fpcr" : "=r"(fpcr));
  const uint64_t fz = uint64_t{1} << 24;  // FZ: flush denormal inputs and outputs to zero
  fpcr = on ? (fpcr | fz) : (fpcr & ~fz);
  asm volatile("msr fpcr, %0" : : "r"(fpcr));
#else
  (void)on;
#endif
}

// Sets the flags on the calling thread and on each thread of the intra-op pool.
void set_flush_denormal_all_threads(bool on) {
  set_flags(on);
  const int64_t threads = at::get_num_threads();
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { set_flags(on); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mamba, m) {
  m.def("set_flush_denormal_all_threads(bool on) -> ()", &set_flush_denormal_all_threads);
}
