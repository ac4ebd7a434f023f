// The float32 vector type of the CPU kernels, one implementation per ISA level, so that each
// kernel is written once.
//
// The extension is compiled once per level (`setup.py`: generic, avx2, avx512 on x86-64;
// neon on aarch64) and `vllm_mamba/ops/cpu_isa.py` loads the build the CPU runs. Inside one
// build the level is fixed by the compiler flags, and this header picks the matching code:
//
// | level   | flags                   | Vf                      | lanes |
// |---------|-------------------------|-------------------------|-------|
// | avx512  | -march=x86-64-v4        | __m512                  | 16    |
// | avx2    | -march=x86-64-v3        | __m256 (AVX2, FMA, F16C)| 8     |
// | neon    | -march=armv8-a          | float32x4_t             | 4     |
// | generic | baseline x86-64 / other | 8 floats, plain loops   | 8     |
//
// Every level has the same functions: loads of float32, bfloat16 (raw uint16 bits), int8 and
// float16 widened to float32, partial loads and stores for the tail of a row, fma, add, mul,
// horizontal sum, a float16 scalar widened (`half`), bfloat16 stores rounding to nearest even, an L2 prefetch, and the unpacking
// of a group of 32 4-bit weights. The header includes no torch header, so the Arm kernel tests
// (`csrc/tests/`) build it without torch.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VLLM_MAMBA_VEC_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VLLM_MAMBA_VEC_AVX2 1
#include <immintrin.h>
#elif defined(__ARM_NEON) && defined(__aarch64__)
#define VLLM_MAMBA_VEC_NEON 1
#include <arm_neon.h>
#else
#define VLLM_MAMBA_VEC_GENERIC 1
#endif

namespace vllm_mamba {
namespace vec {

// A bfloat16 value as its raw bits; layout-compatible with c10::BFloat16.
struct bf16_t {
  uint16_t bits;
};

// ---------------------------------------------------------------------------------------------
// Scalar conversions, shared by every level (and by tails).

inline float bf16_to_f32(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round to nearest even, NaN kept a (quiet) NaN: what c10::BFloat16's constructor does.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if (f != f) return 0x7FC0u;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// IEEE half to float, exact (normals, subnormals, infinities, NaN).
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  uint32_t u;
  if (exp == 0x1Fu) {
    u = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: man * 2^-24
    float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    std::memcpy(&u, &f, sizeof(u));
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Level name of this build, for the startup banner and the tests.
#if defined(VLLM_MAMBA_VEC_AVX512)
constexpr const char* kLevel = "avx512";
#elif defined(VLLM_MAMBA_VEC_AVX2)
constexpr const char* kLevel = "avx2";
#elif defined(VLLM_MAMBA_VEC_NEON)
constexpr const char* kLevel = "neon";
#else
constexpr const char* kLevel = "generic";
#endif

// ---------------------------------------------------------------------------------------------
#if defined(VLLM_MAMBA_VEC_AVX512)

constexpr int kLanes = 16;
using Vf = __m512;

inline __mmask16 tail_mask(int n) { return static_cast<__mmask16>((1u << n) - 1u); }

inline Vf zero() { return _mm512_setzero_ps(); }
inline Vf set1(float v) { return _mm512_set1_ps(v); }
inline Vf load(const float* p) { return _mm512_loadu_ps(p); }
inline Vf load(const bf16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline Vf load(const int8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}
inline Vf load_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline Vf load_n(const float* p, int n) { return _mm512_maskz_loadu_ps(tail_mask(n), p); }
inline Vf load_n(const bf16_t* p, int n) {
  const __m256i v = _mm256_maskz_loadu_epi16(tail_mask(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline Vf load_n(const int8_t* p, int n) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(tail_mask(n), p)));
}
inline void store(float* p, Vf v) { _mm512_storeu_ps(p, v); }
inline void store_n(float* p, Vf v, int n) { _mm512_mask_storeu_ps(p, tail_mask(n), v); }
inline void store(bf16_t* p, Vf v) {
  // Integer rounding rather than AVX512-BF16's vcvtneps2bf16, which flushes subnormals and
  // keeps a NaN's sign where c10::BFloat16 does neither.
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
inline Vf fma(Vf a, Vf b, Vf c) { return _mm512_fmadd_ps(a, b, c); }
inline Vf add(Vf a, Vf b) { return _mm512_add_ps(a, b); }
inline Vf mul(Vf a, Vf b) { return _mm512_mul_ps(a, b); }
inline float sum(Vf v) { return _mm512_reduce_add_ps(v); }
inline float half(uint16_t h) { return _cvtsh_ss(h); }

// The 32 weights of one 4-bit group (16 bytes: byte j holds weight j in its low nibble and
// weight j + 16 in its high nibble, each stored as q + 8 for q in [-8, 7]) as float32 q values.
inline void load_q4_group(const uint8_t* p, Vf out[32 / kLanes]) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
  const __m128i lo = _mm_sub_epi8(_mm_and_si128(b, m), eight);
  const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), m), eight);
  out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
  out[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
}

// ---------------------------------------------------------------------------------------------
#elif defined(VLLM_MAMBA_VEC_AVX2)

constexpr int kLanes = 8;
using Vf = __m256;

inline __m256i tail_mask_i(int n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx);
}

inline Vf zero() { return _mm256_setzero_ps(); }
inline Vf set1(float v) { return _mm256_set1_ps(v); }
inline Vf load(const float* p) { return _mm256_loadu_ps(p); }
inline Vf load(const bf16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline Vf load(const int8_t* p) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}
inline Vf load_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Vf load_n(const float* p, int n) { return _mm256_maskload_ps(p, tail_mask_i(n)); }
inline Vf load_n(const bf16_t* p, int n) {
  bf16_t buf[8] = {};
  std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(bf16_t));
  return load(buf);
}
inline Vf load_n(const int8_t* p, int n) {
  int8_t buf[8] = {};
  std::memcpy(buf, p, static_cast<size_t>(n));
  return load(buf);
}
inline void store(float* p, Vf v) { _mm256_storeu_ps(p, v); }
inline void store_n(float* p, Vf v, int n) { _mm256_maskstore_ps(p, tail_mask_i(n), v); }
inline void store(bf16_t* p, Vf v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // Pack the 8 low halves: packus works per 128-bit lane, then the lanes are put in order.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline Vf fma(Vf a, Vf b, Vf c) { return _mm256_fmadd_ps(a, b, c); }
inline Vf add(Vf a, Vf b) { return _mm256_add_ps(a, b); }
inline Vf mul(Vf a, Vf b) { return _mm256_mul_ps(a, b); }
inline float sum(Vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float half(uint16_t h) { return _cvtsh_ss(h); }

inline void load_q4_group(const uint8_t* p, Vf out[32 / kLanes]) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
  const __m128i lo = _mm_sub_epi8(_mm_and_si128(b, m), eight);
  const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), m), eight);
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
  out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

// ---------------------------------------------------------------------------------------------
#elif defined(VLLM_MAMBA_VEC_NEON)

constexpr int kLanes = 4;
using Vf = float32x4_t;

inline Vf zero() { return vdupq_n_f32(0.0f); }
inline Vf set1(float v) { return vdupq_n_f32(v); }
inline Vf load(const float* p) { return vld1q_f32(p); }
inline Vf load(const bf16_t* p) {
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
}
inline Vf load(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  const int8x8_t b = vreinterpret_s8_s32(vdup_n_s32(word));
  return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(b))));
}
inline Vf load_f16(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
inline Vf load_n(const float* p, int n) {
  float buf[4] = {};
  std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(float));
  return vld1q_f32(buf);
}
inline Vf load_n(const bf16_t* p, int n) {
  bf16_t buf[4] = {};
  std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(bf16_t));
  return load(buf);
}
inline Vf load_n(const int8_t* p, int n) {
  int8_t buf[4] = {};
  std::memcpy(buf, p, static_cast<size_t>(n));
  return load(buf);
}
inline void store(float* p, Vf v) { vst1q_f32(p, v); }
inline void store_n(float* p, Vf v, int n) {
  float buf[4];
  vst1q_f32(buf, v);
  std::memcpy(p, buf, static_cast<size_t>(n) * sizeof(float));
}
inline void store(bf16_t* p, Vf v) {
  const uint32x4_t u = vreinterpretq_u32_f32(v);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  uint32x4_t r = vshrq_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7FFF)), lsb), 16);
  const uint32x4_t ordered = vceqq_f32(v, v);  // all ones where v is not NaN
  r = vbslq_u32(ordered, r, vdupq_n_u32(0x7FC0));
  vst1_u16(reinterpret_cast<uint16_t*>(p), vmovn_u32(r));
}
inline Vf fma(Vf a, Vf b, Vf c) { return vfmaq_f32(c, a, b); }
inline Vf add(Vf a, Vf b) { return vaddq_f32(a, b); }
inline Vf mul(Vf a, Vf b) { return vmulq_f32(a, b); }
inline float sum(Vf v) { return vaddvq_f32(v); }
inline float half(uint16_t h) {
  return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
}

inline void load_q4_group(const uint8_t* p, Vf out[32 / kLanes]) {
  const uint8x16_t b = vld1q_u8(p);
  const int8x16_t eight = vdupq_n_s8(8);
  const int8x16_t lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(0x0F))), eight);
  const int8x16_t hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(b, 4)), eight);
  const int8x16_t halves[2] = {lo, hi};
  for (int h = 0; h < 2; ++h) {
    const int16x8_t w0 = vmovl_s8(vget_low_s8(halves[h]));
    const int16x8_t w1 = vmovl_s8(vget_high_s8(halves[h]));
    out[4 * h + 0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(w0)));
    out[4 * h + 1] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(w0)));
    out[4 * h + 2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(w1)));
    out[4 * h + 3] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(w1)));
  }
}

// ---------------------------------------------------------------------------------------------
#else  // generic: eight floats in plain loops, which compilers vectorise for the baseline ISA

constexpr int kLanes = 8;
struct Vf {
  float v[8];
};

inline Vf zero() { return Vf{}; }
inline Vf set1(float x) {
  Vf r;
  for (int i = 0; i < 8; ++i) r.v[i] = x;
  return r;
}
inline Vf load(const float* p) {
  Vf r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline Vf load(const bf16_t* p) {
  Vf r;
  for (int i = 0; i < 8; ++i) r.v[i] = bf16_to_f32(p[i].bits);
  return r;
}
inline Vf load(const int8_t* p) {
  Vf r;
  for (int i = 0; i < 8; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
}
inline Vf load_f16(const uint16_t* p) {
  Vf r;
  for (int i = 0; i < 8; ++i) r.v[i] = f16_to_f32(p[i]);
  return r;
}
inline Vf load_n(const float* p, int n) {
  Vf r{};
  std::memcpy(r.v, p, static_cast<size_t>(n) * sizeof(float));
  return r;
}
inline Vf load_n(const bf16_t* p, int n) {
  Vf r{};
  for (int i = 0; i < n; ++i) r.v[i] = bf16_to_f32(p[i].bits);
  return r;
}
inline Vf load_n(const int8_t* p, int n) {
  Vf r{};
  for (int i = 0; i < n; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
}
inline void store(float* p, Vf v) { std::memcpy(p, v.v, sizeof(v.v)); }
inline void store_n(float* p, Vf v, int n) {
  std::memcpy(p, v.v, static_cast<size_t>(n) * sizeof(float));
}
inline void store(bf16_t* p, Vf v) {
  for (int i = 0; i < 8; ++i) p[i].bits = f32_to_bf16(v.v[i]);
}
inline Vf fma(Vf a, Vf b, Vf c) {
  for (int i = 0; i < 8; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline Vf add(Vf a, Vf b) {
  for (int i = 0; i < 8; ++i) a.v[i] += b.v[i];
  return a;
}
inline Vf mul(Vf a, Vf b) {
  for (int i = 0; i < 8; ++i) a.v[i] *= b.v[i];
  return a;
}
inline float sum(Vf v) {
  // Pairwise, as the vector levels reduce.
  float s4[4], s2[2];
  for (int i = 0; i < 4; ++i) s4[i] = v.v[i] + v.v[i + 4];
  for (int i = 0; i < 2; ++i) s2[i] = s4[i] + s4[i + 2];
  return s2[0] + s2[1];
}
inline float half(uint16_t h) { return f16_to_f32(h); }

inline void load_q4_group(const uint8_t* p, Vf out[32 / kLanes]) {
  for (int j = 0; j < 16; ++j) {
    out[j / 8].v[j % 8] = static_cast<float>((p[j] & 0x0F) - 8);
    out[2 + j / 8].v[j % 8] = static_cast<float>((p[j] >> 4) - 8);
  }
}

#endif

// Whether the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), so that a bfloat16 GEMM
// is fast. Only the avx512 build asks; lower builds, forced or not, widen bfloat16 to float32.
inline bool native_bf16() {
#if defined(VLLM_MAMBA_VEC_AVX512)
  static const bool has =
      __builtin_cpu_supports("avx512bf16") || __builtin_cpu_supports("amx-bf16");
  return has;
#else
  return false;
#endif
}

// Prefetches the cache line at `p` into L2 (a hint; no fault on any address).
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

}  // namespace vec
}  // namespace vllm_mamba
