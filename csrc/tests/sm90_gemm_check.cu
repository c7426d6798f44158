// Standalone GPU check and microbenchmark of the sm_90a NVFP4 grouped GEMM
// (moe_fp4_sm90_prepare_weights + moe_fp4_sm90_grouped_gemm). Not part of the library build:
// csrc/tests/run_sm90_check.sh compiles it against libmoe_fp4_cuda.so. Exits non-zero on any
// mismatch.
//
//   sm90_gemm_check [--quick] [--no-bench] [--bench-only] [--sweep] [--sweep-splits]
//                   [--shapes qwen,deepseek,llama|all] [--ms 1,4,16] [--fp16] [--iters N]
//                   [--tiles 64,80,... (the widths of --sweep and --sweep-splits)]
//                   [--rounds N (--sweep: best of N)]
//
// 1. exhaustive: every (e2m1 code, e4m3 scale byte) pair, finite scales incl. subnormals,
//    zero and negative ones, through prepare + GEMM with identity activations: every output
//    must equal the exact NVFP4 value (no rounding is involved anywhere), bf16 and fp16.
// 2. random: bf16/fp16, S = 1 and 2, E in {1, 7, 128}, skewed rows per expert with empty
//    experts, M in {1, 4, 16, 64, 256, 1024, 4096} (a_rows = M * min(E, 8)), W4A16 (raw 16-bit
//    activations) and W4A4 (exactly dequantized NVFP4 activations), k with and without a
//    partial 64-chunk, every tile width, every K split (slices per CTA x CTAs per cluster,
//    including ranks with no chunk); every output element against a float64 reference,
//    rows past expert_offsets[E] must stay untouched; the device prepare must equal the host
//    prepare (device = MOE_FP4_HOST) byte for byte.
// 3. bench: the two GEMMs of Qwen3-30B-A3B (E=128, top-8, H=2048, I=768; the default), and with
//    --shapes the DeepSeek-V3-like (E=256, top-8, H=7168, I=2048) and Llama-4-Scout (E=16,
//    top-1, H=5120, I=8192) layers, M in {1, ..., 4096}: cudaEvents over a CUDA graph of repeated
//    launches, with the L2 flushed before each launch (the flush's own time, measured the
//    same way, is subtracted) and warm; µs per GEMM, touched-weight TB/s, TFLOP/s; a sample
//    of output rows is checked against the reference.
//
// Tolerance (random cases). The weight and activation operands are exact 16-bit values, so
// every product is exact in fp32 and the only errors are (i) fp32 accumulation over K terms in
// the tensor core and (ii) the final alpha multiply and rounding to bf16/fp16. For (i) the
// classical bound for recursive summation is |err| <= gamma_K * sum|a_k w_k| with gamma_K ~
// K * 2^-24; the tensor core adds products in a different order and may align partial sums
// with truncation, so we allow twice that: K * 2^-23 * sum|a w| (times |alpha|). For (ii): one
// fp32 rounding (2^-24 relative) plus half an ulp of the output format (2^-8 relative for bf16,
// 2^-11 for fp16 normals, 2^-25 absolute for fp16 subnormals). An element passes when
// |out - exact| <= 2^-8 (bf16) / 2^-11 (fp16) * |exact| * (1 + 2^-10) + |alpha| * (K + 2) *
// 2^-23 * sum|a w| + 2^-25 (an fp16 result beyond 65504 by less than that may be inf). A wrong element (layout, scale or sign error) is off by at least
// one |a w| term, orders of magnitude above this bound for these data.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "moe_fp4/moe_fp4.h"

namespace {

#define CUDA_CHECK(x)                                                                             \
  do {                                                                                            \
    cudaError_t err_ = (x);                                                                       \
    if (err_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(err_), __FILE__, __LINE__, \
                   cudaGetErrorString(err_));                                                     \
      std::exit(2);                                                                               \
    }                                                                                             \
  } while (0)

#define LIB_CHECK(x)                                                                        \
  do {                                                                                      \
    int st_ = (x);                                                                          \
    if (st_ != MOE_FP4_OK) {                                                                \
      std::fprintf(stderr, "moe_fp4 error %d at %s:%d: %s\n", st_, __FILE__, __LINE__,      \
                   moe_fp4_last_error());                                                   \
      std::exit(2);                                                                         \
    }                                                                                       \
  } while (0)

// The GS workspace every call gets (zeroed once in main; 256 MiB).
void* g_ws = nullptr;
size_t g_ws_bytes = 0;

// ---------------------------------------------------------------- numerics on the host

const double kE2m1[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};

double e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  if ((b & 0x7F) == 0x7F) return NAN;
  const double v = e == 0 ? m * std::ldexp(1.0, -9) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
  return (b & 0x80) ? -v : v;
}

double bits_to_double(uint16_t v, int dtype) {
  if (dtype == MOE_FP4_BF16) {
    uint32_t u = uint32_t(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  __half h;
  std::memcpy(&h, &v, 2);
  return double(__half2float(h));
}

// Exactly representable values only (checked by the round trip).
uint16_t double_to_bits(double x, int dtype) {
  uint16_t r;
  if (dtype == MOE_FP4_BF16) {
    __nv_bfloat16 b = __float2bfloat16_rn(float(x));
    std::memcpy(&r, &b, 2);
  } else {
    __half h = __float2half_rn(float(x));
    std::memcpy(&r, &h, 2);
  }
  return r;
}

struct Rng {  // xorshift64*
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
    return s * 0x2545F4914F6CDD1Dull;
  }
  double uniform() { return double(next() >> 11) * (1.0 / 9007199254740992.0); }
  uint32_t below(uint32_t n) { return uint32_t(next() % n); }
  double normal() {
    const double u = std::max(uniform(), 1e-300), v = uniform();
    return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v);
  }
};

// A random e4m3 block scale: mostly moderate, some subnormal, zero, negative and large.
uint8_t random_scale(Rng& rng, bool tiny) {
  const uint32_t kind = rng.below(100);
  uint8_t b;
  if (tiny) b = uint8_t(rng.below(8) | (rng.below(3) << 3));                 // 2^-9 .. 2^-5
  else if (kind < 80) b = uint8_t(((4 + rng.below(7)) << 3) | rng.below(8));  // 2^-3 .. 2^3
  else if (kind < 86) b = uint8_t(1 + rng.below(7));                          // subnormal
  else if (kind < 90) b = 0;                                                  // zero
  else if (kind < 96) b = uint8_t(((11 + rng.below(4)) << 3) | rng.below(8)); // up to 240
  else b = uint8_t(0x80 | (((4 + rng.below(7)) << 3) | rng.below(8)));        // negative
  return b;
}

void parallel_for(int64_t count, const std::function<void(int64_t)>& body) {
  const int threads = std::max(1u, std::min(64u, std::thread::hardware_concurrency()));
  std::atomic<int64_t> next{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&] {
      for (int64_t i; (i = next.fetch_add(1)) < count;) body(i);
    });
  for (auto& th : pool) th.join();
}

// ---------------------------------------------------------------- problems

struct Weights {
  int E;
  int64_t n, k;
  std::vector<uint8_t> w, sc;  // [E, n, k/2], [E, n, k/16]
  double value(int e, int64_t r, int64_t col) const {
    const uint8_t byte = w[(int64_t(e) * n + r) * (k / 2) + col / 2];
    const int code = (col & 1) ? byte >> 4 : byte & 15;
    return kE2m1[code] * e4m3_value(sc[(int64_t(e) * n + r) * (k / 16) + col / 16]);
  }
};

Weights random_weights(int E, int64_t n, int64_t k, Rng& rng, bool tiny) {
  Weights W{E, n, k, std::vector<uint8_t>(size_t(E) * n * k / 2), std::vector<uint8_t>(size_t(E) * n * k / 16)};
  for (size_t i = 0; i < W.w.size(); i += 8) {  // 8 code bytes per draw (the bench's layers are GBs)
    const uint64_t v = rng.next();
    std::memcpy(W.w.data() + i, &v, std::min<size_t>(8, W.w.size() - i));
  }
  for (auto& b : W.sc) b = random_scale(rng, tiny);
  return W;
}

// Skewed row counts summing to `rows` with some experts empty.
std::vector<int32_t> skewed_offsets(int E, int64_t rows, Rng& rng) {
  std::vector<double> weight(E);
  for (int e = 0; e < E; ++e) weight[e] = (E > 1 && rng.below(5) == 0) ? 0.0 : std::exp(1.5 * rng.normal());
  if (E > 2) weight[E - 1] = 0.0;  // the last expert empty
  double total = 0;
  for (double x : weight) total += x;
  if (total == 0) weight[0] = total = 1;
  std::vector<int64_t> count(E, 0);
  int64_t assigned = 0;
  for (int e = 0; e < E; ++e) {
    count[e] = int64_t(std::floor(rows * weight[e] / total));
    assigned += count[e];
  }
  for (int64_t r = assigned; r < rows; ++r) {  // the rest to non-empty experts
    int e;
    do e = int(rng.below(E)); while (weight[e] == 0);
    ++count[e];
  }
  std::vector<int32_t> off(E + 1, 0);
  for (int e = 0; e < E; ++e) off[e + 1] = off[e] + int32_t(count[e]);
  return off;
}

// Top-k routing of M tokens over E experts (distinct experts per token), as row counts.
std::vector<int32_t> routed_offsets(int E, int64_t M, int topk, Rng& rng) {
  std::vector<int64_t> count(E, 0);
  std::vector<int> pick;
  for (int64_t t = 0; t < M; ++t) {
    pick.clear();
    while (int(pick.size()) < topk) {
      const int e = int(rng.below(E));
      if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
    }
    for (int e : pick) ++count[e];
  }
  std::vector<int32_t> off(E + 1, 0);
  for (int e = 0; e < E; ++e) off[e + 1] = off[e] + int32_t(count[e]);
  return off;
}

std::vector<uint16_t> random_activations(int64_t rows, int64_t k, int dtype, bool w4a4, Rng& rng) {
  std::vector<uint16_t> a(size_t(rows) * k);
  for (int64_t r = 0; r < rows; ++r) {
    const double row_scale = std::ldexp(1.0, int(rng.below(7)) - 3);
    for (int64_t c = 0; c < k; c += 16) {
      const uint8_t s = uint8_t(((4 + rng.below(7)) << 3) | rng.below(8));
      for (int j = 0; j < 16; ++j) {
        double v;
        if (w4a4) v = kE2m1[rng.below(16)] * e4m3_value(s);  // exact in both dtypes
        else v = rng.normal() * row_scale;
        a[size_t(r) * k + c + j] = double_to_bits(v, dtype);
      }
    }
  }
  return a;
}

// ---------------------------------------------------------------- device runs

struct DevWeights {
  uint8_t *w = nullptr, *sc = nullptr;
  size_t wb = 0, sb = 0;
};

// Prepares on the device (S = 2: gate and up rows interleaved, as the GEMM with S = 2 reads them),
// checks against the host prepare byte for byte.
bool prepare(const Weights& W, int S, DevWeights& d, bool check_host, cudaStream_t stream) {
  size_t wb, sb;
  LIB_CHECK(moe_fp4_sm90_prepared_sizes(W.E, W.n, W.k, &wb, &sb));
  if (wb != W.w.size() || sb != W.sc.size()) {
    std::printf("FAIL prepared sizes %zu %zu != %zu %zu\n", wb, sb, W.w.size(), W.sc.size());
    return false;
  }
  uint8_t *w_raw, *s_raw;
  CUDA_CHECK(cudaMalloc(&w_raw, wb));
  CUDA_CHECK(cudaMalloc(&s_raw, sb));
  CUDA_CHECK(cudaMalloc(&d.w, wb));
  CUDA_CHECK(cudaMalloc(&d.sc, sb));
  d.wb = wb, d.sb = sb;
  CUDA_CHECK(cudaMemcpy(w_raw, W.w.data(), wb, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(s_raw, W.sc.data(), sb, cudaMemcpyHostToDevice));
  LIB_CHECK(moe_fp4_sm90_prepare_weights(w_raw, s_raw, W.E, W.n, W.k, S, d.w, d.sc, 0, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  CUDA_CHECK(cudaFree(w_raw));
  CUDA_CHECK(cudaFree(s_raw));
  if (!check_host) return true;
  std::vector<uint8_t> hw(wb), hs(sb), dw(wb), ds(sb);
  LIB_CHECK(moe_fp4_sm90_prepare_weights(W.w.data(), W.sc.data(), W.E, W.n, W.k, S, hw.data(), hs.data(), MOE_FP4_HOST,
                                         nullptr));
  CUDA_CHECK(cudaMemcpy(dw.data(), d.w, wb, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(ds.data(), d.sc, sb, cudaMemcpyDeviceToHost));
  if (hw != dw || hs != ds) {
    std::printf("FAIL device prepare differs from host prepare (E=%d n=%lld k=%lld)\n", W.E, (long long)W.n,
                (long long)W.k);
    return false;
  }
  return true;
}

void free_weights(DevWeights& d) {
  CUDA_CHECK(cudaFree(d.w));
  CUDA_CHECK(cudaFree(d.sc));
  d = DevWeights{};
}

constexpr uint16_t kSentinel = 0x7F7F;

struct CheckResult {
  double max_ratio = 0, max_abs = 0, max_rel = 0, max_acc = 0;  // max_acc: see check_output
  int64_t bad = 0, checked = 0, untouched_bad = 0;
};

// Checks rows `rows` (all routed rows when empty) of out against the float64 reference, expert
// by expert (each expert's weights decoded once).
CheckResult check_output(const Weights& W, int S, const std::vector<int32_t>& off, const std::vector<float>& alpha,
                         const std::vector<uint16_t>& a, int64_t a_rows, int dtype, const std::vector<uint16_t>& out,
                         std::vector<int64_t> rows) {
  CheckResult res;
  const int E = W.E;
  const int64_t n = W.n, k = W.k, routed = off[E];
  if (rows.empty())
    for (int64_t r = 0; r < routed; ++r) rows.push_back(r);
  std::sort(rows.begin(), rows.end());
  // Half an ulp relative to |x|: at most 2^-8 for bf16 (8 significant bits), 2^-11 for fp16 (11).
  const double half_ulp = dtype == MOE_FP4_BF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  const double max_finite = dtype == MOE_FP4_BF16 ? 3.3895313892515355e38 : 65504.0;
  std::vector<double> ratio(rows.size(), 0), absd(rows.size(), 0), reld(rows.size(), 0), accd(rows.size(), 0);
  std::vector<int64_t> bad(rows.size(), 0);
  std::vector<double> we;
  size_t i0 = 0;
  for (int e = 0; e < E && i0 < rows.size(); ++e) {
    size_t i1 = i0;
    while (i1 < rows.size() && rows[i1] < off[e + 1]) ++i1;
    if (i1 == i0) continue;
    we.assign(size_t(n) * k, 0.0);
    parallel_for(n, [&](int64_t col) {
      for (int64_t c = 0; c < k; ++c) we[size_t(col) * k + c] = W.value(e, col, c);
    });
    parallel_for(int64_t(i1 - i0), [&](int64_t ii) {
      const size_t i = i0 + size_t(ii);
      const int64_t r = rows[i];
      std::vector<double> av(k);
      for (int64_t c = 0; c < k; ++c) av[c] = bits_to_double(a[size_t(r) * k + c], dtype);
      for (int64_t col = 0; col < n; ++col) {
        const double* wr = &we[size_t(col) * k];
        double sum = 0, sabs = 0;
        for (int64_t c = 0; c < k; ++c) {
          const double p = av[c] * wr[c];
          sum += p;
          sabs += std::fabs(p);
        }
        const double al = alpha[size_t(e) * S + col / (n / S)];
        const double exact = al * sum;
        const double got = bits_to_double(out[size_t(r) * n + col], dtype);
        const double tol = half_ulp * std::fabs(exact) * (1 + std::ldexp(1.0, -10)) +
                           std::fabs(al) * double(k + 2) * std::ldexp(1.0, -23) * sabs + std::ldexp(1.0, -25);
        double err = std::fabs(got - exact);
        // Overflow: a result beyond the largest finite value (within the tolerance) may round to inf.
        if (std::isinf(got) && (got > 0) == (exact > 0) && std::fabs(exact) + tol >= max_finite) err = 0;
        const double q = std::isnan(got) ? INFINITY : err / tol;
        if (!(q <= 1.0)) ++bad[i];
        ratio[i] = std::max(ratio[i], q);
        absd[i] = std::max(absd[i], err);
        if (exact != 0) reld[i] = std::max(reld[i], err / std::fabs(exact));
        // The error beyond the output rounding, in units of |alpha| * sum|a w| * 2^-24 (the
        // accumulation error; the bound allows 2 * (K + 2) of them).
        if (sabs > 0 && std::isfinite(got))
          accd[i] = std::max(accd[i], std::max(0.0, err - half_ulp * std::fabs(exact)) /
                                          (std::fabs(al) * sabs * std::ldexp(1.0, -24)));
      }
    });
    i0 = i1;
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    res.max_ratio = std::max(res.max_ratio, ratio[i]);
    res.max_abs = std::max(res.max_abs, absd[i]);
    res.max_rel = std::max(res.max_rel, reld[i]);
    res.max_acc = std::max(res.max_acc, accd[i]);
    res.bad += bad[i];
  }
  res.checked = int64_t(rows.size()) * n;
  for (int64_t r = std::max<int64_t>(routed, 0); r < a_rows; ++r)
    for (int64_t col = 0; col < n; ++col) res.untouched_bad += out[size_t(r) * n + col] != kSentinel;
  return res;
}

// One GEMM on the device: returns out (a_rows x n, sentinel-initialized).
std::vector<uint16_t> run_gemm(const DevWeights& dw, const Weights& W, int S, const std::vector<int32_t>& off,
                               const std::vector<float>& alpha, const std::vector<uint16_t>& a, int64_t a_rows,
                               int dtype, int tile, cudaStream_t stream, int slices = 0, int splits = 0, int gs = 0) {
  void *da = nullptr, *dout = nullptr;
  float* dalpha;
  int32_t* doff;
  const size_t a_bytes = std::max<size_t>(a.size() * 2, 16), o_bytes = std::max<size_t>(size_t(a_rows) * W.n * 2, 16);
  CUDA_CHECK(cudaMalloc(&da, a_bytes));
  CUDA_CHECK(cudaMalloc(&dout, o_bytes));
  CUDA_CHECK(cudaMalloc(&dalpha, alpha.size() * 4));
  CUDA_CHECK(cudaMalloc(&doff, off.size() * 4));
  if (!a.empty()) CUDA_CHECK(cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dalpha, alpha.data(), alpha.size() * 4, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(doff, off.data(), off.size() * 4, cudaMemcpyHostToDevice));
  std::vector<uint16_t> out(size_t(a_rows) * W.n, kSentinel);
  if (!out.empty()) CUDA_CHECK(cudaMemcpy(dout, out.data(), out.size() * 2, cudaMemcpyHostToDevice));
  const int st = moe_fp4_sm90_grouped_gemm_config(da, dtype, a_rows, W.k, dw.w, dw.sc, dalpha, W.E, S, W.n, doff, dout,
                                                  tile, slices, splits, gs, g_ws, g_ws_bytes, 0, stream);
  if (st != MOE_FP4_OK) {  // reported as a failed case (the sentinel output fails the check)
    std::printf("FAIL moe_fp4_sm90_grouped_gemm returned %d: %s\n", st, moe_fp4_last_error());
    out.assign(out.size(), 0xFFFF);
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  CUDA_CHECK(cudaGetLastError());
  if (!out.empty()) CUDA_CHECK(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaFree(da));
  CUDA_CHECK(cudaFree(dout));
  CUDA_CHECK(cudaFree(dalpha));
  CUDA_CHECK(cudaFree(doff));
  return out;
}

const char* dname(int dtype) { return dtype == MOE_FP4_BF16 ? "bf16" : "fp16"; }

// ---------------------------------------------------------------- 1. exhaustive

bool exhaustive(cudaStream_t stream) {
  // k = 16 * 256 blocks; block kb of every row has scale byte kb (NaN bytes replaced by 1.0,
  // since one NaN weight would poison every row of the identity product); row c, element j of
  // a block has code (j + c) % 16. Activations = identity (a_rows = k), so out[r][c] = W[c][r].
  const int64_t n = 16, k = 16 * 256;
  Weights W{1, n, k, std::vector<uint8_t>(n * k / 2), std::vector<uint8_t>(n * k / 16)};
  for (int64_t c = 0; c < n; ++c)
    for (int64_t kb = 0; kb < 256; ++kb) {
      W.sc[c * 256 + kb] = ((kb & 0x7F) == 0x7F) ? 0x38 : uint8_t(kb);
      for (int j = 0; j < 16; j += 2) {
        const int lo = int((j + c) % 16), hi = int((j + 1 + c) % 16);
        W.w[c * (k / 2) + kb * 8 + j / 2] = uint8_t(lo | (hi << 4));
      }
    }
  DevWeights dw;
  if (!prepare(W, 1, dw, true, stream)) return false;
  bool ok = true;
  for (int dtype : {MOE_FP4_BF16, MOE_FP4_FP16}) {
    std::vector<uint16_t> a(size_t(k) * k, 0);
    const uint16_t one = double_to_bits(1.0, dtype);
    for (int64_t r = 0; r < k; ++r) a[size_t(r) * k + r] = one;
    const std::vector<int32_t> off = {0, int32_t(k)};
    const std::vector<float> alpha = {1.0f};
    for (int tile : {8, 128}) {
      auto out = run_gemm(dw, W, 1, off, alpha, a, k, dtype, tile, stream);
      int64_t bad = 0;
      for (int64_t r = 0; r < k; ++r)
        for (int64_t c = 0; c < n; ++c) {
          const double want = W.value(0, c, r), got = bits_to_double(out[size_t(r) * n + c], dtype);
          if (!(got == want)) {
            if (bad < 5)
              std::printf("  exhaustive %s tile %d: W[%lld][%lld] code %d scale 0x%02x: got %.9g want %.9g\n",
                          dname(dtype), tile, (long long)c, (long long)r,
                          int((W.w[c * (k / 2) + r / 2] >> (4 * (r & 1))) & 15), W.sc[c * 256 + r / 16], got, want);
            ++bad;
          }
        }
      std::printf("%s exhaustive %s tile %3d: %lld of %lld values differ (all 16 codes x 254 finite scale bytes)\n",
                  bad ? "FAIL" : "ok  ", dname(dtype), tile, (long long)bad, (long long)(n * k));
      ok &= bad == 0;
    }
  }
  free_weights(dw);
  return ok;
}

// ---------------------------------------------------------------- 2. random cases

bool random_case(int E, int S, int64_t n, int64_t k, int64_t M, int dtype, bool w4a4, bool tiny, int tile,
                 uint64_t seed, cudaStream_t stream, bool verbose, int slices = 0, int splits = 0, int gs = 0) {
  Rng rng(seed);
  const int topk = std::min(E, 8);
  const int64_t routed = M * topk;
  const int64_t a_rows = routed + (E > 1 ? 3 : 0);  // a few unrouted rows at the end
  Weights W = random_weights(E, n, k, rng, tiny);
  std::vector<int32_t> off = E == 1 ? std::vector<int32_t>{0, int32_t(routed)} : skewed_offsets(E, routed, rng);
  std::vector<float> alpha(size_t(E) * S);
  for (auto& x : alpha) x = float(std::ldexp(0.5 + rng.uniform(), -int(rng.below(6))));
  auto a = random_activations(a_rows, k, dtype, w4a4, rng);
  DevWeights dw;
  if (!prepare(W, S, dw, true, stream)) return false;
  auto out = run_gemm(dw, W, S, off, alpha, a, a_rows, dtype, tile, stream, slices, splits, gs);
  free_weights(dw);
  // Full check up to ~1.5e9 multiply-adds, else every expert's first/last rows plus a sample.
  std::vector<int64_t> rows;
  if (double(routed) * n * k > 1.5e9) {
    for (int e = 0; e < E; ++e)
      if (off[e + 1] > off[e]) rows.push_back(off[e]), rows.push_back(off[e + 1] - 1);
    for (int i = 0; i < 256; ++i) rows.push_back(int64_t(rng.below(uint32_t(routed))));
    std::sort(rows.begin(), rows.end());
    rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  }
  const CheckResult r = check_output(W, S, off, alpha, a, a_rows, dtype, out, rows);
  int empty = 0;
  for (int e = 0; e < E; ++e) empty += off[e + 1] == off[e];
  const bool ok = r.bad == 0 && r.untouched_bad == 0;
  if (verbose || !ok)
    std::printf("%s %s %s E=%3d S=%d n=%4lld k=%4lld M=%4lld rows=%5lld empty=%3d tile=%3d slices=%d splits=%d%s: "
                "max err/tol %.3g, max abs %.3g, max rel %.3g, acc err %.3g u*sum|aw|, bad %lld/%lld, untouched-row "
                "writes %lld\n",
                ok ? "ok  " : "FAIL", dname(dtype), w4a4 ? "W4A4 " : "W4A16", E, S, (long long)n, (long long)k,
                (long long)M, (long long)a_rows, empty, tile, slices, splits, tiny ? " tiny-scales" : "", r.max_ratio,
                r.max_abs,
                r.max_rel, r.max_acc, (long long)r.bad, (long long)r.checked, (long long)r.untouched_bad);
  return ok;
}

// ---------------------------------------------------------------- 3. benchmark

struct BenchShape {
  const char* name;
  int E, topk;
  int64_t n, k;
  int S;
};

// The layers' two GEMMs: Qwen3-30B-A3B (E=128, top-8, H=2048, I=768), DeepSeek-V3-like (E=256,
// top-8, H=7168, I=2048), Llama-4-Scout (E=16, top-1, H=5120, I=8192).
std::vector<BenchShape> bench_shapes(const std::string& which) {
  std::vector<BenchShape> v;
  auto want = [&](const char* m) { return which == "all" || which.find(m) != std::string::npos; };
  if (want("qwen")) v.push_back({"qwen-w13", 128, 8, 1536, 2048, 2}), v.push_back({"qwen-w2", 128, 8, 2048, 768, 1});
  if (want("deepseek"))
    v.push_back({"ds-w13", 256, 8, 4096, 7168, 2}), v.push_back({"ds-w2", 256, 8, 7168, 2048, 1});
  if (want("llama"))
    v.push_back({"llama-w13", 16, 1, 16384, 5120, 2}), v.push_back({"llama-w2", 16, 1, 5120, 8192, 1});
  return v;
}

// The integers of a comma-separated list ("1,4,16").
std::vector<int64_t> parse_list(const std::string& text) {
  std::vector<int64_t> v;
  for (size_t pos = 0; pos < text.size();) {
    const size_t comma = text.find(',', pos);
    v.push_back(std::atoll(text.substr(pos, comma - pos).c_str()));
    pos = comma == std::string::npos ? text.size() : comma + 1;
  }
  return v;
}

// Every token-tile width of the GEMM (the library's kSm90TileTokens, csrc/include/moe_fp4/gemm.hpp,
// which this tool, built on the C ABI alone, does not include): the correctness loops and --sweep.
const std::vector<int> kTileWidths{8, 16, 32, 48, 64, 80, 96, 112, 128};
// --sweep's tile widths and rounds. A tile timed later in a sweep runs on a GPU that has run
// longer at full load: on the H200 the first timing of a shape (the heuristic's) came out up to
// 10% faster than the same tile forced later (session 17), so compare sweep entries with each
// other, not with the plan's column.
std::vector<int> sweep_tiles = kTileWidths;
std::vector<int> gs_splits = {2, 3, 4, 6, 8};  // --sweep-splits: K splits through the workspace (--gs 2,3,...)
int sweep_rounds = 1;

// sweep 1: every tile width with the heuristic's slices and splits; sweep 2 (splits): for the
// heuristic's tile (and the 8- and 16-token tiles when it is one of them), or for the --tiles
// widths, every slices x cta_splits that the library runs (two slices for 8 and 16 tokens, K
// split across a cluster up to 32), cold.
bool bench(int iters, const std::vector<int64_t>& Ms, bool sweep, bool sweep_splits, const std::string& which,
           int bench_dtype, cudaStream_t stream) {
  bool ok = true;
  // L2 flush buffer (the H200 has 60 MB of L2).
  const size_t flush_bytes = size_t(256) << 20;
  void* flush;
  CUDA_CHECK(cudaMalloc(&flush, flush_bytes));
  cudaEvent_t t0, t1;
  CUDA_CHECK(cudaEventCreate(&t0));
  CUDA_CHECK(cudaEventCreate(&t1));
  int sms = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::printf("\nbench: %s activations, CUDA graph of %d launches; cold = L2 flushed before each launch (flush time "
              "subtracted); plan = tile/slices/cta_splits the heuristic picks\n",
              dname(bench_dtype), iters);
  std::printf("%-10s %6s %7s %9s %9s %9s %9s %9s %9s\n", "gemm", "M", "rows", "plan", "cold_us", "warm_us",
              "TB/s_cold", "TFLOP/s", "max_e/t");
  for (const BenchShape& sh : bench_shapes(which)) {
    const int E = sh.E, topk = sh.topk;
    Rng rng(1234 + sh.n);
    Weights W = random_weights(E, sh.n, sh.k, rng, false);
    DevWeights dw;
    if (!prepare(W, sh.S, dw, false, stream)) return false;
    std::vector<float> alpha(size_t(E) * sh.S);
    for (auto& x : alpha) x = float(0.5 + rng.uniform());
    float* dalpha;
    CUDA_CHECK(cudaMalloc(&dalpha, alpha.size() * 4));
    CUDA_CHECK(cudaMemcpy(dalpha, alpha.data(), alpha.size() * 4, cudaMemcpyHostToDevice));
    for (int64_t M : Ms) {
      const int64_t a_rows = M * topk;
      auto off = routed_offsets(E, M, topk, rng);
      auto a = random_activations(a_rows, sh.k, bench_dtype, true, rng);
      void *da, *dout;
      int32_t* doff;
      CUDA_CHECK(cudaMalloc(&da, a.size() * 2));
      CUDA_CHECK(cudaMalloc(&dout, size_t(a_rows) * sh.n * 2));
      CUDA_CHECK(cudaMalloc(&doff, off.size() * 4));
      CUDA_CHECK(cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemcpy(doff, off.data(), off.size() * 4, cudaMemcpyHostToDevice));
      int32_t tile = 0, slices = 0, splits = 0;
      int32_t gsp = 1;
      LIB_CHECK(moe_fp4_sm90_gemm_plan(a_rows, E, sh.n, sh.k, sms, 1, &tile, &slices, &splits, &gsp));
      int32_t force_tile = 0, force_slices = 0, force_splits = 0, force_gs = 0;
      auto gemm = [&] {
        LIB_CHECK(moe_fp4_sm90_grouped_gemm_config(da, bench_dtype, a_rows, sh.k, dw.w, dw.sc, dalpha, E, sh.S, sh.n,
                                                   doff, dout, force_tile, force_slices, force_splits, force_gs, g_ws,
                                                   g_ws_bytes, 0, stream));
      };
      auto time_graph = [&](bool with_flush, bool with_gemm) {
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
        for (int i = 0; i < iters; ++i) {
          if (with_flush) CUDA_CHECK(cudaMemsetAsync(flush, i & 0xFF, flush_bytes, stream));
          if (with_gemm) gemm();
        }
        CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
        CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        CUDA_CHECK(cudaGraphLaunch(exec, stream));  // warm-up
        CUDA_CHECK(cudaStreamSynchronize(stream));
        float best = 1e30f;
        for (int rep = 0; rep < 3; ++rep) {
          CUDA_CHECK(cudaEventRecord(t0, stream));
          CUDA_CHECK(cudaGraphLaunch(exec, stream));
          CUDA_CHECK(cudaEventRecord(t1, stream));
          CUDA_CHECK(cudaEventSynchronize(t1));
          float ms;
          CUDA_CHECK(cudaEventElapsedTime(&ms, t0, t1));
          best = std::min(best, ms);
        }
        CUDA_CHECK(cudaGraphExecDestroy(exec));
        CUDA_CHECK(cudaGraphDestroy(graph));
        return double(best) * 1000.0 / iters;  // µs per launch
      };
      gemm();  // first call outside the capture (sets the kernel's shared-memory attribute)
      CUDA_CHECK(cudaStreamSynchronize(stream));
      const double both = time_graph(true, true), flush_only = time_graph(true, false), warm = time_graph(false, true);
      const double cold = std::max(both - flush_only, 1e-3);
      auto cold_with = [&](int t, int sl, int sp, int g = 0) {
        force_tile = t, force_slices = sl, force_splits = sp, force_gs = g;
        gemm();
        CUDA_CHECK(cudaStreamSynchronize(stream));
        return std::max(time_graph(true, true) - flush_only, 1e-3);
      };
      std::string sweep_text;
      if (sweep) {  // every tile width (or --tiles), cold; the best of --rounds interleaved rounds
        sweep_text += "  tiles:";
        std::vector<double> best(sweep_tiles.size(), 1e30);
        for (int round = 0; round < sweep_rounds; ++round)
          for (size_t i = 0; i < sweep_tiles.size(); ++i) best[i] = std::min(best[i], cold_with(sweep_tiles[i], 0, 0));
        for (size_t i = 0; i < sweep_tiles.size(); ++i) {
          char buf[64];
          std::snprintf(buf, sizeof(buf), " %d:%.1f", sweep_tiles[i], best[i]);
          sweep_text += buf;
        }
      }
      if (sweep_splits) {  // tile x slices x cta_splits, cold
        sweep_text += "  t/s/c:";
        std::vector<int> tiles{tile};
        if (tile <= 16) tiles = {8, 16};
        if (sweep_tiles != kTileWidths) tiles = sweep_tiles;
        for (int t : tiles)
          for (int sl : {1, 2}) {
            if (sl == 2 && t > 16) continue;
            for (int sp = 1; sp <= 8; ++sp) {
              if (sl == 2 && sp > 1) continue;  // a K split across CTAs has one slice per CTA
              if (t > 32 && sp > 1) continue;   // no cluster split past 32 tokens (sm90_plan)
              char buf[64];
              std::snprintf(buf, sizeof(buf), " %d/%d/%d:%.1f", t, sl, sp, cold_with(t, sl, sp));
              sweep_text += buf;
            }
          }
        for (int t : tiles) {  // K split through the workspace (t/g<splits>), where the workspace holds it
          if (t > 16) continue;
          for (int g : gs_splits) {
            // The layout of gemm_sm90.cu's gs_layout: 16384 counters, then g partial tiles of
            // 128 x t fp32 per tile (token tiles bounded as the library bounds them).
            const int64_t tiles_bound = std::min<int64_t>((a_rows + t - 1) / t + std::min<int64_t>(E, a_rows), a_rows);
            const double tiles = double(tiles_bound) * double((sh.n + 127) / 128);
            if (tiles > 16384 || 16384.0 * 4 + tiles * g * 128 * t * 4 > double(g_ws_bytes)) continue;
            char buf[64];
            std::snprintf(buf, sizeof(buf), " %d/g%d:%.1f", t, g, cold_with(t, 1, 1, g));
            sweep_text += buf;
          }
        }
      }
      if (sweep || sweep_splits) {
        force_tile = force_slices = force_splits = force_gs = 0;
        gemm();  // the checked output below is the heuristic's
        CUDA_CHECK(cudaStreamSynchronize(stream));
      }
      int active = 0;
      for (int e = 0; e < E; ++e) active += off[e + 1] > off[e];
      const double bytes = double(active) * sh.n * sh.k * (0.5 + 1.0 / 16);
      const double flops = 2.0 * a_rows * sh.n * sh.k;
      // Check a sample of rows of the (last) output.
      std::vector<uint16_t> out(size_t(a_rows) * sh.n);
      CUDA_CHECK(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost));
      std::vector<int64_t> rows;
      for (int i = 0; i < 48; ++i) rows.push_back(int64_t(rng.below(uint32_t(a_rows))));
      rows.push_back(0), rows.push_back(a_rows - 1);
      std::sort(rows.begin(), rows.end());
      rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
      const CheckResult r = check_output(W, sh.S, off, alpha, a, a_rows, bench_dtype, out, rows);
      ok &= r.bad == 0;
      char plan[32];
      if (gsp > 1)
        std::snprintf(plan, sizeof(plan), "%d/g%d", tile, gsp);
      else
        std::snprintf(plan, sizeof(plan), "%d/%d/%d", tile, slices, splits);
      std::printf("%-10s %6lld %7lld %9s %9.2f %9.2f %9.3f %9.1f %9.3g%s%s\n", sh.name, (long long)M,
                  (long long)a_rows, plan, cold, warm, bytes / (cold * 1e-6) / 1e12, flops / (cold * 1e-6) / 1e12,
                  r.max_ratio, r.bad ? "  FAIL" : "", sweep_text.c_str());
      std::fflush(stdout);
      CUDA_CHECK(cudaFree(da));
      CUDA_CHECK(cudaFree(dout));
      CUDA_CHECK(cudaFree(doff));
    }
    CUDA_CHECK(cudaFree(dalpha));
    free_weights(dw);
  }
  CUDA_CHECK(cudaFree(flush));
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, do_bench = true, only_bench = false, small = false, sweep = false, profile = false;
  bool sweep_splits = false;
  int bench_dtype = MOE_FP4_BF16;
  std::string shapes = "qwen", ms_arg;
  int iters = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "--quick") quick = true;
    else if (s == "--no-bench") do_bench = false;
    else if (s == "--bench-only") only_bench = true;
    else if (s == "--small") small = true, do_bench = false;
    else if (s == "--sweep") sweep = true;
    else if (s == "--sweep-splits") sweep_splits = true;
    else if (s == "--fp16") bench_dtype = MOE_FP4_FP16;
    else if (s == "--shapes" && i + 1 < argc) shapes = argv[++i];
    else if (s == "--ms" && i + 1 < argc) ms_arg = argv[++i];
    else if (s == "--profile") profile = true;
    else if (s == "--iters" && i + 1 < argc) iters = std::atoi(argv[++i]);
    else if (s == "--rounds" && i + 1 < argc) sweep_rounds = std::max(1, std::atoi(argv[++i]));
    else if (s == "--gs" && i + 1 < argc) {
      gs_splits.clear();
      for (int64_t g : parse_list(argv[++i])) gs_splits.push_back(int(g));
    } else if (s == "--tiles" && i + 1 < argc) {
      sweep_tiles.clear();
      for (int64_t t : parse_list(argv[++i])) sweep_tiles.push_back(int(t));
    }
    else {
      std::fprintf(stderr,
                   "usage: %s [--quick] [--small] [--no-bench] [--bench-only] [--sweep] [--sweep-splits] [--shapes "
                   "qwen,deepseek,llama|all] [--ms 1,4,16] [--fp16] [--profile] [--iters N] [--tiles 64,80,...] "
                   "[--rounds N]\n",
                   argv[0]);
      return 2;
    }
  }
  int major = 0, minor = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0));
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d, %d SMs); library ABI %d, GEMM targets '%s'; serves(GEMM, 9.0) = %d\n", prop.name,
              major, minor, prop.multiProcessorCount, moe_fp4_abi_version(), moe_fp4_compiled_archs(MOE_FP4_GEMM),
              moe_fp4_serves(MOE_FP4_GEMM, 9, 0));
  if (moe_fp4_serves(MOE_FP4_GEMM, 9, 0) != MOE_FP4_OK) {
    std::printf("FAIL: the library does not serve the GEMM on sm_90: %s\n", moe_fp4_last_error());
    return 1;
  }
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  g_ws_bytes = size_t(256) << 20;
  CUDA_CHECK(cudaMalloc(&g_ws, g_ws_bytes));
  CUDA_CHECK(cudaMemsetAsync(g_ws, 0, g_ws_bytes, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  bool ok = true;
  int cases = 0, failed = 0;
  const auto t_start = std::chrono::steady_clock::now();
  if (profile) {  // three eager launches for ncu: GEMM1 M=16 (tile 8), GEMM1 M=4096 (tile 128), GEMM2 M=64
    struct P {
      int64_t n, k, M;
      int S;
    };
    for (const P& pc : {P{1536, 2048, 16, 2}, P{1536, 2048, 4096, 2}, P{2048, 768, 64, 1}}) {
      Rng rng(99 + pc.M);
      Weights W = random_weights(128, pc.n, pc.k, rng, false);
      DevWeights dw;
      prepare(W, pc.S, dw, false, stream);
      const int64_t a_rows = pc.M * 8;
      auto off = routed_offsets(128, pc.M, 8, rng);
      std::vector<float> alpha(size_t(128) * pc.S, 1.0f);
      auto a = random_activations(a_rows, pc.k, MOE_FP4_BF16, true, rng);
      auto out = run_gemm(dw, W, pc.S, off, alpha, a, a_rows, MOE_FP4_BF16, 0, stream);
      free_weights(dw);
      std::printf("profiled n=%lld k=%lld M=%lld\n", (long long)pc.n, (long long)pc.k, (long long)pc.M);
    }
    return 0;
  }
  if (small) {  // a few small cases (for compute-sanitizer)
    uint64_t seed = 77;
    for (int dtype : {MOE_FP4_BF16, MOE_FP4_FP16}) {
      bool c_ok = random_case(7, 2, 160, 272, 16, dtype, true, false, 0, seed++, stream, true);
      c_ok &= random_case(128, 1, 64, 128, 4, dtype, false, false, 0, seed++, stream, true);
      c_ok &= random_case(7, 1, 96, 96, 64, dtype, false, false, 128, seed++, stream, true);
      c_ok &= random_case(5, 2, 32, 48, 8, dtype, true, false, 16, seed++, stream, true);
      // K split across clusters of 4 and 2 CTAs (the distributed shared-memory sums).
      c_ok &= random_case(7, 2, 160, 272, 16, dtype, true, false, 8, seed++, stream, true, 1, 4);
      c_ok &= random_case(3, 1, 64, 1040, 4, dtype, false, false, 16, seed++, stream, true, 2, 2);
      // ... and of 6 (the largest the decode rule takes: 17 chunks as 3, 3, 3, 3, 3 and 2).
      c_ok &= random_case(3, 1, 64, 1040, 4, dtype, false, false, 8, seed++, stream, true, 1, 6);
      // The same K on one CTA per tile: 17 chunks, the 8-stage ring wraps twice.
      c_ok &= random_case(3, 1, 64, 1040, 4, dtype, false, false, 16, seed++, stream, true, 1, 1);
      // Persistent 128-token CTAs with more tiles than CTAs: some take a second tile, whose ring
      // starts at chunk 17 (mid-turn).
      c_ok &= random_case(16, 1, 512, 1040, 512, dtype, false, false, 128, seed++, stream, true);
      // Persistent 8-token CTAs (3 per SM) with more tiles than CTAs: 17 chunks per tile, taken
      // as 24 ring stages (whole turns of the unrolled loop), 7 of them without data.
      c_ok &= random_case(16, 1, 256, 1040, 512, dtype, false, false, 8, seed++, stream, true, 1, 1);
      // Persistent 192-row CTAs (a producer warpgroup, setmaxnreg) with more tiles than CTAs (16
      // experts x ~7 token tiles x 2 weight tiles, the second partial: n = 320 = 192 + 128 rows),
      // 5 chunks per tile, so that tiles start anywhere in the 8- and the 4-stage ring.
      c_ok &= random_case(16, 2, 320, 272, 1024, dtype, true, false, 80, seed++, stream, true);
      c_ok &= random_case(16, 1, 320, 272, 1024, dtype, false, false, 112, seed++, stream, true);
      // Persistent 48-token CTAs (two of 128 rows per SM, a 4-stage ring) with more tiles than CTAs.
      c_ok &= random_case(16, 2, 256, 272, 1024, dtype, true, false, 48, seed++, stream, true);
      // K split through the workspace: 17 chunks as 6, 6 and 5 (8-token tile); 2 splits with more
      // units than persistent CTAs (16-token tile, 128 experts).
      c_ok &= random_case(3, 1, 64, 1040, 4, dtype, false, false, 8, seed++, stream, true, 1, 1, 3);
      c_ok &= random_case(128, 2, 256, 1040, 64, dtype, false, false, 16, seed++, stream, true, 1, 1, 2);
      cases += 15, failed += !c_ok, ok &= c_ok;
    }
    std::printf("small cases: %d, failed: %d\n", cases, failed);
  } else if (!only_bench) {
    ok &= exhaustive(stream);
    const std::vector<int64_t> Ms = quick ? std::vector<int64_t>{1, 16, 256} : std::vector<int64_t>{1, 4, 16, 64, 256, 1024, 4096};
    struct Shape {
      int E;
      int64_t n, k;
    };
    // n: multiples of 16 incl. a partial 128-row CTA tile; k: with (272, 96) and without a partial chunk.
    const Shape shapes[] = {{1, 240, 512}, {7, 160, 272}, {128, 64, 128}, {7, 96, 96}};
    uint64_t seed = 1;
    for (const Shape& sh : shapes)
      for (int64_t M : Ms)
        for (int dtype : {MOE_FP4_BF16, MOE_FP4_FP16})
          for (int S : {1, 2}) {
            if (sh.E == 7 && sh.k == 96 && M > 256) continue;
            const bool w4a4 = (seed & 1) != 0;
            const bool c_ok = random_case(sh.E, S, sh.n, sh.k, M, dtype, w4a4, false, 0, seed++, stream, true);
            ++cases, failed += !c_ok, ok &= c_ok;
          }
    // Every tile width on a few shapes, and tiny (subnormal-product) scales.
    for (int tile : kTileWidths)
      for (int dtype : {MOE_FP4_BF16, MOE_FP4_FP16}) {
        bool c_ok = random_case(7, 2, 160, 272, 64, dtype, true, false, tile, seed++, stream, true);
        c_ok &= random_case(128, 1, 64, 192, 16, dtype, false, false, tile, seed++, stream, true);
        c_ok &= random_case(1, 2, 128, 64, 200, dtype, false, true, tile, seed++, stream, true);
        cases += 3, failed += !c_ok, ok &= c_ok;
      }
    // More tiles than persistent CTAs: the ring continues across a CTA's tiles, 17 chunks each
    // (the last partial), so a wide tile starts at any stage and turn; a persistent small tile
    // (8 or 16 tokens) starts a turn of the ring, its 17 chunks taking 24 stages (and 5 chunks of
    // k = 272 taking 8); the 32-token tile runs one-tile CTAs.
    for (int tile : kTileWidths)
      for (int dtype : {MOE_FP4_BF16, MOE_FP4_FP16}) {
        // (one K-slice and no cluster: the heuristic would split K of a grid this short)
        bool c_ok = random_case(16, 2, 256, 1040, 1024, dtype, true, false, tile, seed++, stream, true, 1, 1);
        if (tile <= 32) {
          c_ok &= random_case(16, 2, 256, 272, 1024, dtype, false, false, tile, seed++, stream, true, 1, 1);
          ++cases;
        }
        ++cases, failed += !c_ok, ok &= c_ok;
      }
    // Every K split across a cluster with every CTA shape: k = 272 (5 chunks, the last partial:
    // with 8 CTAs per tile three ranks have no chunk), 512 (8 full chunks), 16 (one partial
    // chunk: ranks 1.. have none); the 64-row two-slice CTAs and the one-slice ones.
    struct Cfg {
      int tile, slices;
    };
    for (int splits : {2, 3, 4, 5, 6, 7, 8})
      for (const Cfg cfg : {Cfg{8, 1}, Cfg{8, 2}, Cfg{16, 1}, Cfg{16, 2}, Cfg{32, 1}, Cfg{64, 1}, Cfg{128, 1}})
        for (int dtype : {MOE_FP4_BF16, MOE_FP4_FP16}) {
          bool c_ok = random_case(7, 2, 160, 272, 16, dtype, true, false, cfg.tile, seed++, stream, true, cfg.slices,
                                  splits);
          c_ok &= random_case(1, 1, 240, 512, 4, dtype, false, false, cfg.tile, seed++, stream, true, cfg.slices,
                              splits);
          c_ok &= random_case(3, 1, 48, 16, 40, dtype, false, false, cfg.tile, seed++, stream, true, cfg.slices,
                              splits);
          // Long K (64 full chunks and a partial one): whole unrolled turns of the ring per rank.
          c_ok &= random_case(2, 2, 128, 4112, 2, dtype, true, false, cfg.tile, seed++, stream, true, cfg.slices,
                              splits);
          cases += 4, failed += !c_ok, ok &= c_ok;
        }
    // K split through the workspace (GS), 8- and 16-token tiles, 2 to 16 splits: empty splits
    // (k = 272: 5 chunks; k = 16: one), long K, more units than persistent CTAs (E = 128, M = 64 x
    // 8 rows: CTAs take several units, of different K ranges), both dtypes. The workspace is
    // shared by every call (its counters must come back zero from each).
    for (int g : {2, 3, 5, 8, 16})
      for (int tile : {8, 16})
        for (int dtype : {MOE_FP4_BF16, MOE_FP4_FP16}) {
          bool c_ok = random_case(7, 2, 160, 272, 16, dtype, true, false, tile, seed++, stream, true, 1, 1, g);
          c_ok &= random_case(1, 1, 240, 512, 4, dtype, false, false, tile, seed++, stream, true, 1, 1, g);
          c_ok &= random_case(3, 1, 48, 16, 40, dtype, false, false, tile, seed++, stream, true, 1, 1, g);
          c_ok &= random_case(2, 2, 128, 4112, 2, dtype, true, false, tile, seed++, stream, true, 1, 1, g);
          c_ok &= random_case(128, 2, 256, 1040, 64, dtype, false, false, tile, seed++, stream, true, 1, 1, g);
          cases += 5, failed += !c_ok, ok &= c_ok;
        }
    // E = 1500 (more experts than threads per CTA), M = 300 tokens x 8.
    for (int dtype : {MOE_FP4_BF16, MOE_FP4_FP16}) {
      const bool c_ok = random_case(1500, 2, 32, 64, 300, dtype, true, false, 0, seed++, stream, true);
      ++cases, failed += !c_ok, ok &= c_ok;
    }
    // More experts than a persistent CTA's 288 threads, within its table: threads scan 4 experts
    // each (the offsets of a span's later experts are read again for the table).
    for (int tile : {48, 64, 128})
      for (int dtype : {MOE_FP4_BF16, MOE_FP4_FP16}) {
        const bool c_ok = random_case(1000, 2, 128, 64, 300, dtype, true, false, tile, seed++, stream, true);
        ++cases, failed += !c_ok, ok &= c_ok;
      }
    // More experts than a persistent CTA's table (prefix sums and clamped offsets, 8 (E + 1)
    // bytes) holds in shared memory (128 tokens: ~3400, 64: ~20000, 48: ~21900): the one-tile CTAs.
    for (int dtype : {MOE_FP4_BF16, MOE_FP4_FP16}) {
      bool c_ok = random_case(7200, 1, 32, 64, 300, dtype, true, false, 128, seed++, stream, true);
      c_ok &= random_case(41000, 1, 32, 64, 300, dtype, false, false, 64, seed++, stream, true);
      c_ok &= random_case(41000, 1, 32, 64, 300, dtype, true, false, 48, seed++, stream, true);
      cases += 3, failed += !c_ok, ok &= c_ok;
    }
    // k < 64: one partial chunk only (TMA box wider than the tensor).
    for (int dtype : {MOE_FP4_BF16, MOE_FP4_FP16}) {
      bool c_ok = random_case(5, 2, 32, 48, 8, dtype, true, false, 0, seed++, stream, true);
      c_ok &= random_case(3, 1, 48, 16, 40, dtype, false, false, 0, seed++, stream, true);
      cases += 2, failed += !c_ok, ok &= c_ok;
    }
    // a_rows = 0 must be a no-op.
    {
      const int st = moe_fp4_sm90_grouped_gemm(nullptr, MOE_FP4_BF16, 0, 64, reinterpret_cast<const uint8_t*>(16),
                                               reinterpret_cast<const uint8_t*>(16), reinterpret_cast<const float*>(16),
                                               4, 1, 32, reinterpret_cast<const int32_t*>(16), nullptr, 0, 0, stream);
      std::printf("%s a_rows = 0: status %d\n", st == MOE_FP4_OK ? "ok  " : "FAIL", st);
      ok &= st == MOE_FP4_OK;
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    std::printf("random cases: %d, failed: %d (%.1f s)\n", cases, failed, secs);
  }
  if (do_bench) {
    std::vector<int64_t> Ms = quick ? std::vector<int64_t>{1, 64, 4096} : std::vector<int64_t>{1, 4, 16, 64, 256, 1024, 4096};
    if (!ms_arg.empty()) Ms = parse_list(ms_arg);
    ok &= bench(iters, Ms, sweep, sweep_splits, shapes, bench_dtype, stream);
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
  std::printf("%s\n", ok ? "ALL CHECKS PASSED" : "SOME CHECKS FAILED");
  return ok ? 0 : 1;
}
