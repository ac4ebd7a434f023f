// Torch-free test driver for the kernel headers `vec.h`, `math.h` and `gemv.h`, at whatever
// ISA level it is compiled for (the level follows the compiler flags, as in the extension):
//
//   g++ -O2 -std=c++17 csrc/tests/kernel_test.cpp -o kt && ./kt                  # generic
//   g++ -O2 -std=c++17 -march=x86-64-v3 csrc/tests/kernel_test.cpp -o kt && ./kt # avx2
//   g++ -O2 -std=c++17 -march=x86-64-v4 csrc/tests/kernel_test.cpp -o kt && ./kt # avx512
//   aarch64-linux-gnu-g++ -O2 -std=c++17 -march=armv8-a ... && qemu-aarch64 ...    # neon
//
// Every result is checked against an independent scalar reference written here (double
// precision sums, integer round-to-nearest-even, a bit-level float16 decoder), never against
// the header's own scalar helpers. Prints the level and the number of checks; exits 1 on any
// failure (the first failures of each test are printed). `scripts/arm_kernel_test.sh` and
// `tests/ops/test_kernel_driver.py` build and run it.

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "../gemv.h"
#include "../math.h"
#include "../vec.h"

namespace vm = vllm_mamba;
namespace vec = vllm_mamba::vec;
namespace gemv = vllm_mamba::gemv;
using vec::bf16_t;
using vec::kLanes;
using vec::Vf;

// ---------------------------------------------------------------------------------------------
// Bookkeeping

static long g_checks = 0;
static long g_failures = 0;
static std::string g_test;
static long g_test_failures = 0;

static void begin(const char* name) {
  g_test = name;
  g_test_failures = 0;
}

static void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static void fail(const char* fmt, ...) {
  ++g_failures;
  if (++g_test_failures <= 10) {
    std::printf("FAIL [%s] ", g_test.c_str());
    va_list ap;
    va_start(ap, fmt);
    std::vprintf(fmt, ap);
    va_end(ap);
    std::printf("\n");
  } else if (g_test_failures == 11) {
    std::printf("FAIL [%s] ... (further failures of this test not shown)\n", g_test.c_str());
  }
}

#define CHECK(cond, ...)          \
  do {                            \
    ++g_checks;                   \
    if (!(cond)) fail(__VA_ARGS__); \
  } while (0)

// Deterministic generator (splitmix64), identical on every platform.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint32_t u32() { return static_cast<uint32_t>(next() >> 32); }
  double uniform(double lo, double hi) {
    return lo + (hi - lo) * (static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0));
  }
};

static uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
static float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// All lanes of a vector, in order.
static std::vector<float> lanes(Vf v) {
  std::vector<float> out(kLanes);
  vec::store(out.data(), v);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Independent references

// bfloat16 bits -> exact value (double); exponent field 255 with mantissa 0 is +-inf.
static double ref_bf16_value(uint16_t b) {
  const int sign = (b >> 15) & 1;
  const int e = (b >> 7) & 0xFF;
  const int m = b & 0x7F;
  double v;
  if (e == 0xFF) {
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::nan("");
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(m), -126 - 7);
  } else {
    v = std::ldexp(1.0 + m / 128.0, e - 127);
  }
  return sign ? -v : v;
}

// float -> bfloat16, round to nearest even, NaN -> 0x7FC0; by comparing the distances to the
// two neighbouring bfloat16 values in double (not by the add-and-shift trick of the header).
static uint16_t ref_f32_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  const uint32_t u = bits_of(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const uint32_t mag = u & 0x7FFFFFFFu;
  if (mag == 0x7F800000u) return static_cast<uint16_t>(sign | 0x7F80);
  const uint16_t lo = static_cast<uint16_t>(mag >> 16);  // truncation, toward zero
  const uint16_t hi = static_cast<uint16_t>(lo + 1);     // next away from zero (may be inf)
  const double x = std::fabs(static_cast<double>(f));
  const double vlo = ref_bf16_value(lo);
  // The value past the largest finite bfloat16 is 2^128 for rounding purposes.
  const double vhi = hi == 0x7F80 ? std::ldexp(1.0, 128) : ref_bf16_value(hi);
  const double dlo = x - vlo, dhi = vhi - x;
  uint16_t r;
  if (dlo < dhi) {
    r = lo;
  } else if (dhi < dlo) {
    r = hi;
  } else {
    r = (lo & 1) ? hi : lo;
  }
  return static_cast<uint16_t>(sign | r);
}

// IEEE binary16 bits -> value (double), from the definition.
static double ref_f16_value(uint16_t h) {
  const int sign = (h >> 15) & 1;
  const int e = (h >> 10) & 0x1F;
  const int m = h & 0x3FF;
  double v;
  if (e == 0x1F) {
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::nan("");
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(m), -24);
  } else {
    v = std::ldexp(1024.0 + m, e - 25);
  }
  return sign ? -v : v;
}

// Compares a float16 conversion with the reference: bit-exact value (incl. the sign of
// zero) for non-NaN, a NaN of the same sign for NaN.
static bool f16_matches(uint16_t h, float got) {
  const double want = ref_f16_value(h);
  if (std::isnan(want)) return std::isnan(got) && (std::signbit(got) == static_cast<bool>(h >> 15));
  return static_cast<double>(got) == want && std::signbit(got) == std::signbit(want);
}

// Finite half values spanning normals and some subnormals, for q4 scales.
static uint16_t random_f16_scale(Rng& rng) {
  const uint32_t r = rng.u32();
  if (r % 50 == 0) return static_cast<uint16_t>((r >> 8) & 0x83FF);  // subnormal / zero
  const uint16_t e = static_cast<uint16_t>(5 + (r >> 8) % 12);        // 2^-10 .. 2^1
  return static_cast<uint16_t>((r & 0x8000) | (e << 10) | ((r >> 12) & 0x3FF));
}

// ---------------------------------------------------------------------------------------------
// vec.h

static void test_level() {
  begin("level");
  const std::string level = vec::kLevel;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const char* want = "avx512";
  const int want_lanes = 16;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  const char* want = "avx2";
  const int want_lanes = 8;
#elif defined(__ARM_NEON) && defined(__aarch64__)
  const char* want = "neon";
  const int want_lanes = 4;
#else
  const char* want = "generic";
  const int want_lanes = 8;
#endif
  CHECK(level == want, "kLevel is %s, the compiler flags say %s", level.c_str(), want);
  CHECK(kLanes == want_lanes, "kLanes is %d, want %d", kLanes, want_lanes);
  CHECK(sizeof(bf16_t) == 2, "sizeof(bf16_t) = %zu", sizeof(bf16_t));
  CHECK(32 % kLanes == 0, "kLanes %d does not divide a q4 group", kLanes);
}

static void test_basic_arith() {
  begin("zero/set1/load/store/fma/add/mul/sum");
  Rng rng(1);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> a(kLanes), b(kLanes), c(kLanes);
    for (int i = 0; i < kLanes; ++i) {
      a[i] = static_cast<float>(rng.uniform(-4, 4));
      b[i] = static_cast<float>(rng.uniform(-4, 4));
      c[i] = static_cast<float>(rng.uniform(-4, 4));
    }
    const Vf va = vec::load(a.data()), vb = vec::load(b.data()), vc = vec::load(c.data());
    const auto la = lanes(va), lz = lanes(vec::zero());
    const float s = static_cast<float>(rng.uniform(-3, 3));
    const auto l1 = lanes(vec::set1(s));
    const auto lf = lanes(vec::fma(va, vb, vc)), ladd = lanes(vec::add(va, vb)),
               lmul = lanes(vec::mul(va, vb));
    for (int i = 0; i < kLanes; ++i) {
      CHECK(la[i] == a[i], "load/store lane %d: %g != %g", i, la[i], a[i]);
      CHECK(lz[i] == 0.0f && !std::signbit(lz[i]), "zero lane %d: %g", i, lz[i]);
      CHECK(l1[i] == s, "set1 lane %d: %g != %g", i, l1[i], s);
      // fma: fused (one rounding) or not (two); either is within 2 float ulps of the exact.
      const double want_f = static_cast<double>(a[i]) * b[i] + c[i];
      const double tol_f = 2.5e-7 * (std::fabs(static_cast<double>(a[i]) * b[i]) + std::fabs(c[i]));
      CHECK(std::fabs(lf[i] - want_f) <= tol_f, "fma lane %d: %.9g vs %.9g", i, lf[i], want_f);
      CHECK(ladd[i] == a[i] + b[i], "add lane %d: %.9g vs %.9g", i, ladd[i], a[i] + b[i]);
      CHECK(lmul[i] == a[i] * b[i], "mul lane %d: %.9g vs %.9g", i, lmul[i], a[i] * b[i]);
    }
    double want_sum = 0, abs_sum = 0;
    for (int i = 0; i < kLanes; ++i) want_sum += a[i], abs_sum += std::fabs(a[i]);
    const float got_sum = vec::sum(va);
    CHECK(std::fabs(got_sum - want_sum) <= 4.0 * 6e-8 * abs_sum, "sum: %.9g vs %.9g", got_sum,
          want_sum);
  }
  // Exact sums (small integers) and a sum per lane position.
  for (int j = 0; j < kLanes; ++j) {
    std::vector<float> a(kLanes, 0.0f);
    a[j] = 3.0f;
    CHECK(vec::sum(vec::load(a.data())) == 3.0f, "sum with only lane %d set", j);
  }
  std::vector<float> ramp(kLanes);
  for (int i = 0; i < kLanes; ++i) ramp[i] = static_cast<float>(i + 1);
  CHECK(vec::sum(vec::load(ramp.data())) == kLanes * (kLanes + 1) / 2.0f, "sum of 1..%d", kLanes);
  // fma with infinities and NaN propagates like scalar IEEE arithmetic.
  const auto li = lanes(vec::fma(vec::set1(INFINITY), vec::set1(2.0f), vec::set1(1.0f)));
  const auto ln = lanes(vec::add(vec::set1(NAN), vec::set1(1.0f)));
  for (int i = 0; i < kLanes; ++i) {
    CHECK(std::isinf(li[i]) && li[i] > 0, "fma(inf, 2, 1) lane %d = %g", i, li[i]);
    CHECK(std::isnan(ln[i]), "NaN + 1 lane %d = %g", i, ln[i]);
  }
}

static void test_typed_loads() {
  begin("load bf16/int8/f16");
  Rng rng(2);
  // bfloat16: random bit patterns (NaNs included; compared bitwise).
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<bf16_t> w(kLanes);
    for (auto& x : w) x.bits = static_cast<uint16_t>(rng.u32());
    const auto l = lanes(vec::load(w.data()));
    for (int i = 0; i < kLanes; ++i) {
      const uint32_t want = static_cast<uint32_t>(w[i].bits) << 16;
      CHECK(bits_of(l[i]) == want, "load(bf16) lane %d: bits 0x%08x, want 0x%08x", i,
            bits_of(l[i]), want);
    }
  }
  // int8: every value in every lane position.
  std::vector<int8_t> all(256 + kLanes);
  for (int i = 0; i < 256 + kLanes; ++i) all[i] = static_cast<int8_t>(i - 128);
  for (int off = 0; off < 256; ++off) {
    const auto l = lanes(vec::load(all.data() + off));
    for (int i = 0; i < kLanes; ++i) {
      CHECK(l[i] == static_cast<float>(all[off + i]), "load(int8) off %d lane %d: %g vs %d", off,
            i, l[i], all[off + i]);
    }
  }
  // float16: all 65536 patterns through load_f16, half() and the scalar f16_to_f32.
  std::vector<uint16_t> h(65536 + kLanes);
  for (int i = 0; i < 65536 + kLanes; ++i) h[i] = static_cast<uint16_t>(i);
  for (int base = 0; base < 65536; base += kLanes) {
    const auto l = lanes(vec::load_f16(h.data() + base));
    for (int i = 0; i < kLanes; ++i) {
      const uint16_t b = h[base + i];
      CHECK(f16_matches(b, l[i]), "load_f16(0x%04x) = %.9g (bits 0x%08x), want %.9g", b, l[i],
            bits_of(l[i]), ref_f16_value(b));
    }
  }
  for (int i = 0; i < 65536; ++i) {
    const uint16_t b = static_cast<uint16_t>(i);
    const float got = vec::half(b);
    CHECK(f16_matches(b, got), "half(0x%04x) = %.9g, want %.9g", b, got, ref_f16_value(b));
    const float got_s = vec::f16_to_f32(b);
    CHECK(f16_matches(b, got_s), "f16_to_f32(0x%04x) = %.9g, want %.9g", b, got_s,
          ref_f16_value(b));
  }
  // Unaligned float / bf16 loads.
  std::vector<float> f(3 * kLanes);
  for (int i = 0; i < 3 * kLanes; ++i) f[i] = static_cast<float>(i) * 0.5f - 3.0f;
  for (int off = 0; off < kLanes; ++off) {
    const auto l = lanes(vec::load(f.data() + off));
    for (int i = 0; i < kLanes; ++i)
      CHECK(l[i] == f[off + i], "unaligned load off %d lane %d", off, i);
  }
}

// A buffer whose end is followed by an inaccessible page, so that a partial load or store
// that touches memory past its n elements faults (Linux; elsewhere a plain buffer).
struct GuardedBuffer {
  uint8_t* base = nullptr;
  size_t page = 4096;
  size_t map_len = 0;
  std::vector<uint8_t> fallback;
  GuardedBuffer() {
#if defined(__linux__)
    page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    map_len = 2 * page;
    void* p = mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) {
      base = static_cast<uint8_t*>(p);
      if (mprotect(base + page, page, PROT_NONE) != 0) {
        munmap(base, map_len);
        base = nullptr;
      }
    }
#endif
    if (base == nullptr) {
      fallback.assign(2 * page, 0);
      base = fallback.data();
      map_len = 0;
    }
  }
  ~GuardedBuffer() {
#if defined(__linux__)
    if (map_len) munmap(base, map_len);
#endif
  }
  // Start of `bytes` bytes ending exactly at the guard page.
  template <typename T>
  T* tail(size_t count) {
    return reinterpret_cast<T*>(base + page - count * sizeof(T));
  }
};

static void test_partial() {
  begin("load_n/store_n tails");
  GuardedBuffer g;
  Rng rng(3);
  for (int n = 1; n < kLanes; ++n) {
    for (int trial = 0; trial < 20; ++trial) {
      float* fp = g.tail<float>(n);
      bf16_t* bp = g.tail<bf16_t>(n);
      int8_t* ip = g.tail<int8_t>(n);
      std::vector<float> fv(n);
      for (int i = 0; i < n; ++i) fp[i] = fv[i] = static_cast<float>(rng.uniform(-5, 5));
      const auto lf = lanes(vec::load_n(fp, n));
      std::vector<uint16_t> bv(n);
      for (int i = 0; i < n; ++i) bp[i].bits = bv[i] = static_cast<uint16_t>(rng.u32());
      const auto lb = lanes(vec::load_n(bp, n));
      std::vector<int8_t> iv(n);
      for (int i = 0; i < n; ++i) ip[i] = iv[i] = static_cast<int8_t>(rng.u32());
      const auto li = lanes(vec::load_n(ip, n));
      for (int i = 0; i < kLanes; ++i) {
        const bool in = i < n;
        CHECK(in ? lf[i] == fv[i] : (lf[i] == 0.0f && !std::signbit(lf[i])),
              "load_n(float, n=%d) lane %d = %g", n, i, lf[i]);
        CHECK(in ? bits_of(lb[i]) == (static_cast<uint32_t>(bv[i]) << 16) : bits_of(lb[i]) == 0,
              "load_n(bf16, n=%d) lane %d bits 0x%08x", n, i, bits_of(lb[i]));
        CHECK(in ? li[i] == iv[i] : bits_of(li[i]) == 0, "load_n(int8, n=%d) lane %d = %g", n, i,
              li[i]);
      }
      // store_n writes n floats and nothing around them.
      std::vector<float> src(kLanes);
      for (int i = 0; i < kLanes; ++i) src[i] = static_cast<float>(rng.uniform(-5, 5));
      const Vf v = vec::load(src.data());
      for (int i = 0; i < n; ++i) fp[i] = -1234.5f;
      vec::store_n(fp, v, n);
      for (int i = 0; i < n; ++i) CHECK(fp[i] == src[i], "store_n(n=%d) element %d", n, i);
      std::vector<float> sentinel(kLanes + 2, 777.0f);
      vec::store_n(sentinel.data() + 1, v, n);
      CHECK(sentinel[0] == 777.0f, "store_n(n=%d) wrote before the start", n);
      for (int i = n + 1; i < kLanes + 2; ++i)
        CHECK(sentinel[i] == 777.0f, "store_n(n=%d) wrote element %d past n", n, i - 1);
    }
  }
  // n = kLanes behaves as the full load/store.
  std::vector<float> full(kLanes);
  for (int i = 0; i < kLanes; ++i) full[i] = static_cast<float>(i) - 2.5f;
  const auto l = lanes(vec::load_n(full.data(), kLanes));
  for (int i = 0; i < kLanes; ++i) CHECK(l[i] == full[i], "load_n(n=kLanes) lane %d", i);
}

static void check_bf16_store(const std::vector<float>& src, const char* what) {
  // src.size() is a multiple of kLanes.
  std::vector<bf16_t> out(src.size() + 1);
  out.back().bits = 0xABCD;
  for (size_t i = 0; i + kLanes <= src.size(); i += kLanes) vec::store(out.data() + i, vec::load(src.data() + i));
  for (size_t i = 0; i < src.size(); ++i) {
    const uint16_t want = ref_f32_to_bf16(src[i]);
    CHECK(out[i].bits == want, "%s: store(bf16) of %.9g (0x%08x) = 0x%04x, want 0x%04x", what,
          src[i], bits_of(src[i]), out[i].bits, want);
    const uint16_t got_s = vec::f32_to_bf16(src[i]);
    CHECK(got_s == want, "%s: f32_to_bf16(%.9g (0x%08x)) = 0x%04x, want 0x%04x", what, src[i],
          bits_of(src[i]), got_s, want);
    const float back = vec::bf16_to_f32(want);
    CHECK(std::isnan(back) ? want == 0x7FC0 : static_cast<double>(back) == ref_bf16_value(want),
          "%s: bf16_to_f32(0x%04x)", what, want);
  }
  CHECK(out.back().bits == 0xABCD, "%s: store(bf16) wrote past kLanes", what);
}

static void test_bf16_store() {
  begin("bf16 store round-to-nearest-even");
  std::vector<uint32_t> special = {
      0x00000000u, 0x80000000u,                            // +-0
      0x3F800000u, 0xBF800000u,                            // +-1
      0x3F808000u,  // tie, even lower (0x3F80): stays
      0x3F818000u,  // tie, odd lower (0x3F81): rounds up to 0x3F82
      0xBF808000u, 0xBF818000u,                            // negative ties
      0x3F807FFFu, 0x3F808001u,                            // just below / above a tie
      0x3F80FFFFu, 0x3FFFFFFFu,                            // carry into the exponent
      0x7F7FFFFFu, 0xFF7FFFFFu,                            // max float: rounds to +-inf
      0x7F7F7FFFu, 0x7F7F8000u,                            // below / at the tie before inf
      0x7F7EFFFFu, 0x7F7F0000u,                            // largest finite bf16 neighbours
      0x7F800000u, 0xFF800000u,                            // +-inf
      0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u,  // quiet / signalling NaN, both signs
      0x7FFFFFFFu, 0xFFFFFFFFu, 0x7FA00000u, 0x7FC0FFFFu,  // NaNs with payloads
      0x00000001u, 0x80000001u, 0x00008000u, 0x00018000u,  // subnormals, subnormal ties
      0x007FFFFFu, 0x00800000u, 0x00FF8000u,               // around the smallest normal
  };
  std::vector<float> src;
  for (uint32_t u : special) src.push_back(float_of(u));
  while (src.size() % kLanes) src.push_back(1.0f);
  check_bf16_store(src, "special values");
  // Every tie and near-tie low half for a spread of high halves, and random bit patterns.
  Rng rng(4);
  src.clear();
  for (int hi = 0; hi < 0x10000; hi += 97) {
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu})
      src.push_back(float_of((static_cast<uint32_t>(hi) << 16) | lo));
  }
  for (int i = 0; i < 200000; ++i) src.push_back(float_of(rng.u32()));
  while (src.size() % kLanes) src.push_back(0.0f);
  check_bf16_store(src, "ties and random bits");
  // Every lane position of a NaN among finite values.
  for (int j = 0; j < kLanes; ++j) {
    std::vector<float> v(kLanes, 1.00390625f);  // 0x3F808000: a tie
    v[j] = -NAN;
    check_bf16_store(v, "NaN lane");
  }
}

static void test_q4_group() {
  begin("load_q4_group");
  Rng rng(5);
  std::vector<uint8_t> buf(16 + 64);
  for (int trial = 0; trial < 4096 + 256; ++trial) {
    const int off = trial % 7;  // unaligned too
    uint8_t* p = buf.data() + off;
    if (trial < 256) {
      for (int j = 0; j < 16; ++j) p[j] = static_cast<uint8_t>(trial + 37 * j);  // every byte
    } else {
      for (int j = 0; j < 16; ++j) p[j] = static_cast<uint8_t>(rng.u32());
    }
    Vf out[32 / kLanes];
    vec::load_q4_group(p, out);
    float got[32];
    for (int v = 0; v < 32 / kLanes; ++v) vec::store(got + v * kLanes, out[v]);
    for (int j = 0; j < 16; ++j) {
      const int want_lo = static_cast<int>(p[j] % 16) - 8;
      const int want_hi = static_cast<int>(p[j] / 16) - 8;
      CHECK(got[j] == want_lo, "byte %d = 0x%02x: weight %d = %g, want %d", j, p[j], j, got[j],
            want_lo);
      CHECK(got[j + 16] == want_hi, "byte %d = 0x%02x: weight %d = %g, want %d", j, p[j], j + 16,
            got[j + 16], want_hi);
    }
  }
}

static void test_prefetch() {
  begin("prefetch_l2");
  // A hint: must not fault on any address, mapped or not.
  std::vector<float> a(64);
  vec::prefetch_l2(a.data());
  vec::prefetch_l2(a.data() + 1000000);
  vec::prefetch_l2(nullptr);
  vec::prefetch_l2(reinterpret_cast<const void*>(static_cast<uintptr_t>(0xDEAD0000ull)));
  CHECK(true, "unreachable");
}

// ---------------------------------------------------------------------------------------------
// math.h

static double ulp_of(double x) {
  // The spacing of floats at |x| (at least the smallest subnormal's).
  const float f = static_cast<float>(std::fabs(x));
  if (f == 0.0f) return std::ldexp(1.0, -149);
  int e;
  std::frexp(f, &e);
  return std::ldexp(1.0, std::max(e - 24, -149));
}

static void test_math() {
  Rng rng(6);
  std::vector<float> xs;
  for (int i = -87330; i <= 88370; i += 7) xs.push_back(i / 1000.0f);
  for (int i = 0; i < 20000; ++i) xs.push_back(static_cast<float>(rng.uniform(-87.33, 88.37)));
  for (int i = 0; i < 20000; ++i) xs.push_back(static_cast<float>(rng.uniform(-1e-3, 1e-3)));
  for (float x : {0.0f, -0.0f, 1e-30f, -1e-30f, 1e-8f, -1e-8f, 0.5f, -0.5f, 0.34657359f,
                  -0.34657359f, 0.69314718f, 1.0f, -1.0f, 20.0f, -20.0f, 87.0f, -87.0f, 88.0f,
                  -87.33f, 88.37f})
    xs.push_back(x);

  // exp_f32: "within a few float ulps of std::exp" on its range [-87.33, 88.37]; held to 2
  // (measured: 1.1).
  begin("exp_f32");
  double worst = 0;
  for (float x : xs) {
    const double want = std::exp(static_cast<double>(x));
    const float got = vm::exp_f32(x);
    const double err = std::fabs(got - want) / ulp_of(want);
    worst = std::max(worst, err);
    CHECK(err <= 2.0, "exp_f32(%.9g) = %.9g, want %.12g (%.2f ulp)", x, got, want, err);
  }
  std::printf("  exp_f32: worst %.2f ulp over %zu inputs\n", worst, xs.size());
  // Outside the range it clamps: finite, positive, monotone at the ends; no overflow to inf.
  for (float x : {-88.0f, -100.0f, -1e4f, -INFINITY}) {
    const float got = vm::exp_f32(x);
    CHECK(got >= 0.0f && got <= vm::exp_f32(-87.33f), "exp_f32(%g) = %g (clamped below)", x, got);
  }
  for (float x : {88.5f, 100.0f, 1e4f, INFINITY}) {
    const float got = vm::exp_f32(x);
    CHECK(std::isfinite(got) && got >= vm::exp_f32(88.37f), "exp_f32(%g) = %g (clamped above)",
          x, got);
  }

  // silu_f32 = x / (1 + exp(-x)): relative error of a few ulps while exp(-x) is in range.
  begin("silu_f32");
  worst = 0;
  for (float x : xs) {
    const double xd = x;
    const double want = xd / (1.0 + std::exp(-xd));
    const float got = vm::silu_f32(x);
    if (x >= -87.33f) {
      const double err = std::fabs(got - want) / ulp_of(want);
      worst = std::max(worst, err);
      CHECK(err <= 4.0, "silu_f32(%.9g) = %.9g, want %.12g (%.2f ulp)", x, got, want, err);
    } else {  // exp(-x) clamped at exp(88.37): the result is tiny instead of tinier
      CHECK(std::fabs(got - want) <= 1e-35 * std::fabs(xd), "silu_f32(%.9g) = %g, want %g", x,
            got, want);
    }
  }
  std::printf("  silu_f32: worst %.2f ulp\n", worst);
  for (float x : {-100.0f, -1000.0f}) {
    const float got = vm::silu_f32(x);
    CHECK(got <= 0.0f && got > -1e-30f, "silu_f32(%g) = %g", x, got);
  }
  for (float x : {100.0f, 1000.0f}) CHECK(vm::silu_f32(x) == x, "silu_f32(%g) = %g", x, vm::silu_f32(x));

  // log1p_unit_f32 on [0, 1].
  begin("log1p_unit_f32");
  worst = 0;
  for (int i = 0; i <= 100000; ++i) {
    const float y = i == 0 ? 0.0f : (i <= 50000 ? i / 50000.0f : std::ldexp(1.0f, -(i - 50000) % 126));
    const double want = std::log1p(static_cast<double>(y));
    const float got = vm::log1p_unit_f32(y);
    const double err = std::fabs(got - want) / ulp_of(want);
    worst = std::max(worst, err);
    CHECK(err <= 3.5, "log1p_unit_f32(%.9g) = %.9g, want %.12g (%.2f ulp)", y, got, want, err);
  }
  std::printf("  log1p_unit_f32: worst %.2f ulp\n", worst);

  // softplus_f32 (torch: beta 1, threshold 20, x itself above 20).
  begin("softplus_f32");
  worst = 0;
  for (float x : xs) {
    const double xd = x;
    const double want = x > 20.0f ? xd : std::max(xd, 0.0) + std::log1p(std::exp(-std::fabs(xd)));
    const float got = vm::softplus_f32(x);
    if (x >= -87.33f) {
      const double err = std::fabs(got - want) / ulp_of(want);
      worst = std::max(worst, err);
      CHECK(err <= 4.0, "softplus_f32(%.9g) = %.9g, want %.12g (%.2f ulp)", x, got, want, err);
    } else {
      CHECK(std::fabs(got - want) <= 2e-38, "softplus_f32(%.9g) = %g, want %g", x, got, want);
    }
  }
  std::printf("  softplus_f32: worst %.2f ulp\n", worst);
  for (float x : {20.5f, 50.0f, 1e6f}) CHECK(vm::softplus_f32(x) == x, "softplus_f32(%g) = %.9g", x, vm::softplus_f32(x));
}

// ---------------------------------------------------------------------------------------------
// gemv.h

template <typename W>
struct Weights {
  std::vector<W> w;
  std::vector<double> v;  // exact values of the weights
};

static Weights<float> make_weights(Rng& rng, int64_t n, float*) {
  Weights<float> r;
  for (int64_t i = 0; i < n; ++i) {
    const float f = static_cast<float>(rng.uniform(-1, 1));
    r.w.push_back(f);
    r.v.push_back(f);
  }
  return r;
}
static Weights<bf16_t> make_weights(Rng& rng, int64_t n, bf16_t*) {
  Weights<bf16_t> r;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t b = ref_f32_to_bf16(static_cast<float>(rng.uniform(-1, 1)));
    r.w.push_back(bf16_t{b});
    r.v.push_back(ref_bf16_value(b));
  }
  return r;
}
static Weights<int8_t> make_weights(Rng& rng, int64_t n, int8_t*) {
  Weights<int8_t> r;
  for (int64_t i = 0; i < n; ++i) {
    const int8_t q = static_cast<int8_t>(rng.u32());  // the full range, -128 included
    r.w.push_back(q);
    r.v.push_back(q);
  }
  return r;
}

// |got - want| <= 1e-6 * sum |w||x| (plus the smallest normal for all-zero products).
static bool close_dot(float got, double want, double abs_sum) {
  return std::fabs(got - want) <= 1e-6 * abs_sum + 1e-37;
}

template <typename W>
static void test_gemv_type(const char* tname) {
  std::string name = std::string("gemv ") + tname;
  begin(name.c_str());
  Rng rng(7 + sizeof(W));
  const int64_t M = 21;  // weight rows
  double worst = 0;
  for (int64_t k : {1, 7, 16, 33, 100, 768}) {
    auto wt = make_weights(rng, M * k, static_cast<W*>(nullptr));
    const int64_t max_batch = 9;
    const int64_t ldx = k + 3;  // padding holds NaN: read past k, and a result is NaN
    std::vector<float> x(max_batch * ldx, NAN);
    for (int64_t b = 0; b < max_batch; ++b)
      for (int64_t i = 0; i < k; ++i) x[b * ldx + i] = static_cast<float>(rng.uniform(-2, 2));
    std::vector<double> want(max_batch * M), abs_sum(max_batch * M);
    for (int64_t b = 0; b < max_batch; ++b) {
      for (int64_t r = 0; r < M; ++r) {
        double s = 0, a = 0;
        for (int64_t i = 0; i < k; ++i) {
          s += wt.v[r * k + i] * x[b * ldx + i];
          a += std::fabs(wt.v[r * k + i] * x[b * ldx + i]);
        }
        want[b * M + r] = s;
        abs_sum[b * M + r] = a;
      }
    }
    auto err_ratio = [&](float got, int64_t b, int64_t r) {
      return std::fabs(got - want[b * M + r]) / (abs_sum[b * M + r] + 1e-37);
    };
    // dot_row on every row.
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t r = 0; r < M; ++r) {
        const float got = gemv::dot_row(wt.w.data() + r * k, k, x.data() + b * ldx);
        worst = std::max(worst, err_ratio(got, b, r));
        CHECK(close_dot(got, want[b * M + r], abs_sum[b * M + r]),
              "dot_row k=%" PRId64 " row %" PRId64 ": %.9g, want %.12g", k, r, got,
              want[b * M + r]);
      }
    }
    // dot_tile<R, B> for R in {1, 4} and B in {1 .. kTileX} (rows r0 .. r0 + R, r0 = 2 so the
    // prefetch runs ahead of a tile that does not start the weight): every product bit for bit
    // dot_row's, whatever the tile.
    auto run_tile = [&](auto r_const, auto b_const) {
      constexpr int R = decltype(r_const)::value, B = decltype(b_const)::value;
      if constexpr (B > gemv::kTileX) return;
      const int64_t r0 = 2, ldo = R + 1;
      float out[B * (R + 1)];
      const char* ahead = reinterpret_cast<const char*>(wt.w.data() + (r0 + R) * k);
      gemv::dot_tile<R, B>(wt.w.data() + r0 * k, k, x.data(), ldx, out, ldo, ahead);
      for (int b = 0; b < B; ++b) {
        for (int r = 0; r < R; ++r) {
          const float alone = gemv::dot_row(wt.w.data() + (r0 + r) * k, k, x.data() + b * ldx);
          CHECK(std::memcmp(&out[b * ldo + r], &alone, sizeof(float)) == 0,
                "dot_tile<%d, %d> k=%" PRId64 " row %" PRId64 " x row %d: %.9g, alone %.9g", R,
                B, k, r0 + r, b, out[b * ldo + r], alone);
        }
      }
    };
    auto run_tiles = [&](auto r_const) {
      run_tile(r_const, std::integral_constant<int, 1>{});
      run_tile(r_const, std::integral_constant<int, 2>{});
      run_tile(r_const, std::integral_constant<int, 3>{});
      run_tile(r_const, std::integral_constant<int, 4>{});
      run_tile(r_const, std::integral_constant<int, 5>{});
    };
    run_tiles(std::integral_constant<int, 1>{});
    run_tiles(std::integral_constant<int, 4>{});
    // gemv_rows over row ranges, batch 1..9, output row stride > hi - lo with sentinels.
    const int64_t ranges[][2] = {{0, M}, {3, M}, {5, 18}, {8, 16}, {1, 2}, {0, 7}, {9, 9}};
    for (auto& rg : ranges) {
      const int64_t lo = rg[0], hi = rg[1];
      for (int64_t batch = 1; batch <= max_batch; ++batch) {
        const int64_t ldo = (hi - lo) + 2;
        std::vector<float> out(batch * ldo, -777.0f);
        gemv::gemv_rows(wt.w.data(), k, x.data(), ldx, batch, lo, hi, out.data(), ldo);
        for (int64_t b = 0; b < batch; ++b) {
          for (int64_t j = 0; j < ldo; ++j) {
            const float got = out[b * ldo + j];
            if (j >= hi - lo) {
              CHECK(got == -777.0f, "gemv_rows k=%" PRId64 " [%" PRId64 ",%" PRId64
                    ") batch %" PRId64 ": wrote out[%" PRId64 "][%" PRId64 "] outside the range",
                    k, lo, hi, batch, b, j);
              continue;
            }
            const int64_t r = lo + j;
            worst = std::max(worst, err_ratio(got, b, r));
            CHECK(close_dot(got, want[b * M + r], abs_sum[b * M + r]),
                  "gemv_rows k=%" PRId64 " [%" PRId64 ",%" PRId64 ") batch %" PRId64
                  " b %" PRId64 " row %" PRId64 ": %.9g, want %.12g",
                  k, lo, hi, batch, b, r, got, want[b * M + r]);
          }
        }
      }
    }
  }
  std::printf("  gemv %s: worst |err| / sum|w||x| = %.3g\n", tname, worst);
}

static void test_gemv_q4() {
  begin("gemv q4");
  Rng rng(11);
  const int64_t M = 19;
  double worst = 0;
  for (int64_t k : {32, 64, 768}) {
    const int64_t groups = k / gemv::kQ4Group;
    std::vector<uint8_t> q(M * k / 2);
    std::vector<uint16_t> scales(M * groups);
    for (auto& b : q) b = static_cast<uint8_t>(rng.u32());
    for (auto& s : scales) s = random_f16_scale(rng);
    // Exact weight values from the layout's definition (not from load_q4_group).
    std::vector<double> wv(M * k);
    for (int64_t r = 0; r < M; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const double s = ref_f16_value(scales[r * groups + g]);
        const uint8_t* bytes = q.data() + r * (k / 2) + g * 16;
        for (int j = 0; j < 16; ++j) {
          wv[r * k + g * 32 + j] = ((bytes[j] & 0x0F) - 8) * s;
          wv[r * k + g * 32 + j + 16] = ((bytes[j] >> 4) - 8) * s;
        }
      }
    }
    const gemv::Q4Rows w{q.data(), scales.data(), k};
    const int64_t max_batch = 9, ldx = k + 5;
    std::vector<float> x(max_batch * ldx, NAN);
    for (int64_t b = 0; b < max_batch; ++b)
      for (int64_t i = 0; i < k; ++i) x[b * ldx + i] = static_cast<float>(rng.uniform(-2, 2));
    std::vector<double> want(max_batch * M), abs_sum(max_batch * M);
    for (int64_t b = 0; b < max_batch; ++b) {
      for (int64_t r = 0; r < M; ++r) {
        double s = 0, a = 0;
        for (int64_t i = 0; i < k; ++i) {
          s += wv[r * k + i] * x[b * ldx + i];
          a += std::fabs(wv[r * k + i] * x[b * ldx + i]);
        }
        want[b * M + r] = s;
        abs_sum[b * M + r] = a;
      }
    }
    const int64_t ranges[][2] = {{0, M}, {3, M}, {5, 18}, {8, 16}, {1, 2}, {2, 5}, {7, 7}};
    for (auto& rg : ranges) {
      const int64_t lo = rg[0], hi = rg[1];
      for (int64_t batch = 1; batch <= max_batch; ++batch) {
        const int64_t ldo = (hi - lo) + 3;
        std::vector<float> out(batch * ldo, -777.0f);
        gemv::gemv_rows_q4(w, x.data(), ldx, batch, lo, hi, out.data(), ldo);
        for (int64_t b = 0; b < batch; ++b) {
          for (int64_t j = 0; j < ldo; ++j) {
            const float got = out[b * ldo + j];
            if (j >= hi - lo) {
              CHECK(got == -777.0f, "gemv_rows_q4 k=%" PRId64 " [%" PRId64 ",%" PRId64
                    ") batch %" PRId64 ": wrote out[%" PRId64 "][%" PRId64 "] outside the range",
                    k, lo, hi, batch, b, j);
              continue;
            }
            const int64_t r = lo + j;
            const double ratio = std::fabs(got - want[b * M + r]) / (abs_sum[b * M + r] + 1e-37);
            worst = std::max(worst, ratio);
            CHECK(close_dot(got, want[b * M + r], abs_sum[b * M + r]),
                  "gemv_rows_q4 k=%" PRId64 " [%" PRId64 ",%" PRId64 ") batch %" PRId64
                  " b %" PRId64 " row %" PRId64 ": %.9g, want %.12g",
                  k, lo, hi, batch, b, r, got, want[b * M + r]);
          }
        }
      }
    }
  }
  std::printf("  gemv q4: worst |err| / sum|w||x| = %.3g\n", worst);
}

static void test_state() {
  begin("load_state/store_state");
  Rng rng(12);
  for (int64_t n : {1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100, 1000}) {
    // float32 state: in place.
    std::vector<float> fs(n, 1.5f), buf(n, 0.0f);
    CHECK(gemv::load_state(fs.data(), buf.data(), n) == fs.data(), "float load_state n=%" PRId64
          " is not in place", n);
    gemv::store_state(fs.data(), fs.data(), n);
    // bfloat16 state: widened exactly, then written back bit for bit.
    std::vector<bf16_t> st(n + 1);
    std::vector<uint16_t> orig(n);
    for (int64_t i = 0; i < n; ++i) {
      uint16_t b;
      do b = static_cast<uint16_t>(rng.u32()); while ((b & 0x7F80) == 0x7F80 && (b & 0x7F));
      st[i].bits = orig[i] = b;  // any non-NaN pattern (infinities and subnormals included)
    }
    st[n].bits = 0x1234;
    std::vector<float> wide(n + 1, -9.0f);
    float* view = gemv::load_state(st.data(), wide.data(), n);
    CHECK(view == wide.data(), "bf16 load_state n=%" PRId64 " does not return buf", n);
    for (int64_t i = 0; i < n; ++i)
      CHECK(static_cast<double>(view[i]) == ref_bf16_value(orig[i]),
            "load_state n=%" PRId64 " [%" PRId64 "]: %g, want %g", n, i, view[i],
            ref_bf16_value(orig[i]));
    CHECK(wide[n] == -9.0f, "load_state n=%" PRId64 " wrote past n", n);
    gemv::store_state(view, st.data(), n);
    for (int64_t i = 0; i < n; ++i)
      CHECK(st[i].bits == orig[i], "bf16 round trip n=%" PRId64 " [%" PRId64 "]: 0x%04x, was 0x%04x",
            n, i, st[i].bits, orig[i]);
    // Updated values are rounded to nearest even (vector body and scalar tail alike), NaN ->
    // 0x7FC0, and nothing past n is written.
    std::vector<float> upd(n);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t r = rng.u32();
      upd[i] = r % 13 == 0 ? float_of((r & 0xFFFF0000u) | 0x8000u)  // a tie
                           : static_cast<float>(rng.uniform(-10, 10));
    }
    if (n > 2) upd[n - 1] = NAN, upd[0] = -NAN;
    gemv::store_state(upd.data(), st.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t want = ref_f32_to_bf16(upd[i]);
      CHECK(st[i].bits == want, "store_state n=%" PRId64 " [%" PRId64 "] of %.9g: 0x%04x, want 0x%04x",
            n, i, upd[i], st[i].bits, want);
    }
    CHECK(st[n].bits == 0x1234, "store_state n=%" PRId64 " wrote past n", n);
  }
}

int main() {
  std::printf("vec level: %s (%d lanes)\n", vec::kLevel, kLanes);
  test_level();
  test_basic_arith();
  test_typed_loads();
  test_partial();
  test_bf16_store();
  test_q4_group();
  test_prefetch();
  test_math();
  test_gemv_type<float>("float");
  test_gemv_type<bf16_t>("bf16");
  test_gemv_type<int8_t>("int8");
  test_gemv_q4();
  test_state();
  std::printf("%s: %ld checks, %ld failures (level %s)\n", g_failures ? "FAILED" : "OK", g_checks,
              g_failures, vec::kLevel);
  return g_failures ? 1 : 0;
}
