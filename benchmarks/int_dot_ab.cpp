// Two builds of `csrc/int_dot.h` timed against each other in one process: the rows kernels
// (`rows_i8`, `rows_q4`, `rows_q4k`) of an old and a new tree alternating call by call on the
// same random weights, each call on a copy the other did not just read (no cache left to the
// second), the order alternating; prints the medians in GMAC/s, their ratio and whether the
// outputs are the same bytes. The host's phases move both alike, which separate runs do not.
//
//   git worktree add /tmp/old <rev>
//   g++ -O3 -std=c++17 -fopenmp -march=x86-64-v4 -DOLD_HEADER='"/tmp/old/csrc/int_dot.h"' \
//       -DNEW_HEADER='"csrc/int_dot.h"' -I. benchmarks/int_dot_ab.cpp -o /tmp/int_dot_ab
//   T=2 COPIES=4 /tmp/int_dot_ab q4 5 1024 65536 60     # fmt (i8|q4|qk) rows K N calls
//
// T threads split the N rows as the ops do (2 by default); COPIES weights of N x K bytes each
// (4 x 64 MiB above: far past the caches; COPIES=1 and a small N: in cache).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>

// The system headers first: the two trees' headers then add only their own code, each in a
// namespace of its own (their `#pragma once` files are different files).
namespace oldv {
#include OLD_HEADER
}
namespace newv {
#include NEW_HEADER
}

// The two trees' kernels under one name each.
#define INT_DOT_TREE(Name, ns)                                                  \
  struct Name {                                                                \
    using QActs = ns::vllm_mamba::int_dot::QActs;                              \
    template <typename... A>                                                   \
    static void rows_i8(const ns::vllm_mamba::int_dot::I8Rows& w, A&&... a) {  \
      ns::vllm_mamba::int_dot::rows_i8(w, a...);                               \
    }                                                                          \
    template <typename... A>                                                   \
    static void rows_q4(const ns::vllm_mamba::int_dot::Q4Rows& w, A&&... a) {  \
      ns::vllm_mamba::int_dot::rows_q4(w, a...);                               \
    }                                                                          \
    template <typename... A>                                                   \
    static void rows_q4k(const ns::vllm_mamba::int_dot::Q4KRows& w, A&&... a) { \
      ns::vllm_mamba::int_dot::rows_q4k(w, a...);                              \
    }                                                                          \
  };
INT_DOT_TREE(Old, oldv)
INT_DOT_TREE(New, newv)
#undef INT_DOT_TREE

// Rows [0, n) of one weight in fmt ("i8", "q4": Q4_0-style, "qk": Q4_K-style) times the
// quantised rows q, split over t threads on whole strips; seconds.
template <typename NS>
double run(const char* fmt, const typename NS::QActs& q, const std::vector<uint8_t>& w,
           const std::vector<uint16_t>& hs, const std::vector<uint8_t>& ks,
           const std::vector<float>& sc, int64_t k, int64_t n, std::vector<float>& out, int t) {
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel for num_threads(t)
  for (int i = 0; i < t; ++i) {
    const int64_t lo = n / t * i / 16 * 16, hi = i == t - 1 ? n : n / t * (i + 1) / 16 * 16;
    float* o = out.data() + lo;
    if (fmt[0] == 'i') {
      NS::rows_i8({reinterpret_cast<const int8_t*>(w.data()), sc.data(), k, n}, q, lo, hi, o, n);
    } else if (fmt[1] == 'k') {
      NS::rows_q4k({w.data(), ks.data(), k, n}, q, lo, hi, o, n);
    } else {
      NS::rows_q4({w.data(), hs.data(), k, n}, q, lo, hi, o, n);
    }
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s i8|q4|qk ROWS K N CALLS\n", argv[0]);
    return 2;
  }
  const char* fmt = argv[1];
  const int rows = std::atoi(argv[2]), calls = std::atoi(argv[5]);
  const int64_t k = std::atoll(argv[3]), n = std::atoll(argv[4]);
  const int t = std::getenv("T") ? std::atoi(std::getenv("T")) : 2;
  const int copies = std::getenv("COPIES") ? std::atoi(std::getenv("COPIES")) : 1;
  if (k % 256 != 0 || n % 16 != 0 || rows < 1 || calls < 3 || copies < 1) {
    std::fprintf(stderr, "K a multiple of 256, N of 16, ROWS >= 1, CALLS >= 3, COPIES >= 1\n");
    return 2;
  }
  std::mt19937 g(1);
  std::vector<float> x(rows * k);
  for (auto& v : x) v = std::normal_distribution<float>()(g);
  oldv::vllm_mamba::int_dot::QActs qo;
  oldv::vllm_mamba::int_dot::quantize(x.data(), k, rows, k, qo);
  newv::vllm_mamba::int_dot::QActs qn;
  newv::vllm_mamba::int_dot::quantize(x.data(), k, rows, k, qn);
  std::vector<std::vector<uint8_t>> ws(copies);  // random codes: every layout reads them
  for (auto& w : ws) {
    w.resize(n * k);
    for (auto& v : w) v = g() & 0xff;
  }
  std::vector<uint16_t> hs(n * k / 32, 0x2c00);        // Q4_0 scales: float16 0.0625
  std::vector<uint8_t> ks(n * ((k + 255) / 256) * 16);  // Q4_K scales and mins: 6-bit codes
  for (auto& v : ks) v = g() & 0x3f;
  std::vector<float> sc(n, 0.01f), oo(rows * n), on(rows * n);
  std::vector<double> to, tn;
  for (int r = 0; r < calls; ++r) {
    const auto& w1 = ws[(2 * r) % copies];
    const auto& w2 = ws[(2 * r + 1) % copies];
    double a, b;
    if (r % 2) {
      a = run<Old>(fmt, qo, w1, hs, ks, sc, k, n, oo, t);
      b = run<New>(fmt, qn, w2, hs, ks, sc, k, n, on, t);
    } else {
      b = run<New>(fmt, qn, w1, hs, ks, sc, k, n, on, t);
      a = run<Old>(fmt, qo, w2, hs, ks, sc, k, n, oo, t);
    }
    if (r >= 2) {  // the first two warm up
      to.push_back(a);
      tn.push_back(b);
    }
  }
  run<Old>(fmt, qo, ws[0], hs, ks, sc, k, n, oo, t);
  run<New>(fmt, qn, ws[0], hs, ks, sc, k, n, on, t);
  const bool same = std::memcmp(oo.data(), on.data(), oo.size() * sizeof(float)) == 0;
  std::sort(to.begin(), to.end());
  std::sort(tn.begin(), tn.end());
  const double mo = to[to.size() / 2], mn = tn[tn.size() / 2], macs = double(rows) * k * n;
  std::printf("%s rows=%d K=%ld N=%ld threads=%d: old %.1f, new %.1f GMAC/s (new/old %.2f), "
              "same bytes: %s\n", fmt, rows, static_cast<long>(k), static_cast<long>(n), t,
              macs / mo / 1e9, macs / mn / 1e9, mo / mn, same ? "yes" : "no");
  return same ? 0 : 1;
}
