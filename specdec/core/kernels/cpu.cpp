// specdec's CPU kernels (ops torch.ops.specdec_cpu.*), float32 activations:
//
// row_linear — the models' linear layer (runtime.cpu_linear=specdec), on weights from
// row_linear_pack;
// rms_norm — RMSNorm over the last dim, one pass a row (torch's eager rms_norm is a chain of
// half a dozen ops on CPU: ~25 us a call against ~2 here, 21 calls a forward);
// paged_attention — one layer's attention over the paged KV cache: each query row reads its
// request's keys and values by slot, straight from the cache (no gathered copy);
// decoder_forward — a whole Llama forward on those three, in one call (LlamaDecoder.forward's
// eager bits), and decoder_steps — one request's greedy draft chain of such forwards;
// eagle_tree / decoder_tree — a dynamic (EAGLE-2) token tree's expansion, every frontier's
// forward and top-k, in one call (the Python loop's bits);
// huge_empty — memory on transparent huge pages, for a model's packed weights.
//
// row_linear:
//
//   y[m, n] = b[n] + x[m, 0] * w[n, 0] + x[m, 1] * w[n, 1] + ... + x[m, K-1] * w[n, K-1]
//
// summed in exactly that order, one fused multiply-add per term, for every output: no
// split of K, no tree of partial sums, no kernel picked by the number of rows. So a row's
// result does not depend on the rows beside it (a token verified among gamma + 1 gets the
// bits it gets decoded alone), nor on the thread count: threads split the outputs, never K.
//
// Weight layout (pack): [N/P, K, P] — panels of P output columns, each panel's K rows of P
// contiguous values, zero-padded past N. The panels hold float32, or bfloat16 for a weight
// whose every value is a bfloat16 (a bf16 checkpoint loaded as float32): the kernel widens
// each one to the float32 it stands for (exact: the bf16 bits are a float32's top half), so
// the sums are the same bits, and a decode step reads half the bytes.
// The micro-kernel holds an R x P block of outputs in
// registers and, for each k, multiplies one broadcast x[m, k] into P weights per row.
// At one row it streams the weights once (the decode step is a read of every weight);
// at many rows each panel stays in cache while the rows pass over it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

// One vector register of floats, as wide as the CPU's: a zmm (16 lanes) with AVX-512, else a
// ymm (8). Vectors wider than the registers would be lowered through the stack — on an AVX2
// CPU tuned for 128-bit ops (AMD Zen 1) that ran the whole kernel at ~4 GFLOP/s, 4-14x below
// MKL's sgemm. The lane count changes no result: every lane is its own chain of sums.
#ifdef __AVX512F__
constexpr int L = 16;
constexpr int C = 4, RB = 6;  // 6 x 4 accumulators + 4 weights + 1 broadcast: 29 of 32 zmm
#else
constexpr int L = 8;
// 3 x 4 accumulators + 4 weights + 1 broadcast: 17 ymm, so one accumulator lives in L1. RB = 2
// (13 ymm) was no faster on Zen 1: ~52-59 GFLOP/s at 100 rows either way, of ~64 peak on 2 cores.
constexpr int C = 4, RB = 3;
#endif
constexpr int P = L * C;  // panel width: output columns per panel (32 with AVX2, 64 with AVX-512)
static_assert(C % 2 == 0, "bfloat16 panels pair vectors: C must be even");

typedef float vf __attribute__((vector_size(4 * L)));
typedef uint32_t vu __attribute__((vector_size(4 * L)));  // L x 32 bits: two bfloat16 each

inline vf loadv(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf bits(vu u) { vf v; std::memcpy(&v, &u, sizeof v); return v; }

// The P weights of one k, as C vectors of L floats (columns L*c .. L*c + L-1).
inline void weights(const float* wk, vf (&wv)[C]) {
  for (int c = 0; c < C; ++c) wv[c] = loadv(wk + L * c);
}
// bfloat16 panels pair their columns: 32-bit word j of each block of 2L columns holds column j
// in its low half and column L + j in its high half (pack's order). A bfloat16 is a float32's
// top half, so a shift and a mask give the two vectors of floats exactly, with no shuffles.
inline void weights(const at::BFloat16* wk, vf (&wv)[C]) {
  for (int c = 0; c < C; c += 2) {
    vu u;
    std::memcpy(&u, wk + L * c, sizeof u);
    wv[c] = bits(u << 16);
    wv[c + 1] = bits(u & 0xFFFF0000u);
  }
}

// How far ahead of the FMAs the weights are fetched, in bytes. At one row a product is a
// stream of weights from memory, one cache line per k (bf16, AVX2), and Zen 1's hardware
// prefetcher alone kept too few lines in flight. The built-in target's 41 one-row products in
// a row, weights from DRAM, 2 threads, called from Python (~7 us a call of that), by turns in
// one process: 1.90 ms before, 1.52 with this and the grain below (5 rows: 2.68 -> 2.27). 2 KiB
// and 8 KiB ahead were no better. Results do not change: only when the bytes arrive.
constexpr int AHEAD = 4096;

// The fetch keeps the lines in every cache level (hint 3). A non-temporal fetch (hint 0) was
// as fast for a weight read once, but on Zen 1 its lines did not stay in L3: a drafter's
// 5.5 MB, read 4 times a step, then took 0.31 ms a pass instead of 0.21.

// y[r, 0:P] = b[0:P] + sum_k x[r, k] * wp[k, 0:P] for r < R, k in order.
template <int R, typename W>
inline void block(const float* x, int64_t K, const W* wp, const float* b, float* y, int64_t ldy) {
  vf acc[R][C];
  for (int c = 0; c < C; ++c) {
    const vf bv = b ? loadv(b + L * c) : vf{};
    for (int r = 0; r < R; ++r) acc[r][c] = bv;
  }
  for (int64_t k = 0; k < K; ++k) {
    const char* ahead = reinterpret_cast<const char*>(wp + k * P) + AHEAD;  // (past the end: harmless)
    for (int i = 0; i < static_cast<int>(P * sizeof(W)); i += 64) __builtin_prefetch(ahead + i, 0, 3);
    vf wv[C];
    weights(wp + k * P, wv);
    for (int r = 0; r < R; ++r) {
      const float xs = x[r * K + k];
      for (int c = 0; c < C; ++c) acc[r][c] += xs * wv[c];  // one FMA (-ffp-contract=fast)
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) storev(y + r * ldy + L * c, acc[r][c]);
}

at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16) && w.device().is_cpu(),
              "specdec::row_linear_pack: want a float32 or bfloat16 CPU weight [out, in], got ", w.sizes(), " ",
              w.scalar_type());
  const int64_t N = w.size(0), K = w.size(1), np = (N + P - 1) / P;
  at::Tensor padded = at::zeros({np * P, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  at::Tensor panels = padded.view({np, P, K}).transpose(1, 2);  // [np, K, P]
  if (w.scalar_type() == at::kBFloat16)  // pair column j with column L + j in each block of 2L
    panels = panels.reshape({np, K, P / (2 * L), 2, L}).transpose(3, 4).reshape({np, K, P});
  return panels.contiguous();
}

// An uninitialised uint8 CPU tensor of ``nbytes`` on 2 MiB-aligned memory the kernel is asked to
// back with transparent huge pages (madvise; a hint: where THP is off it is plain memory). The
// packed weights of a model live in one (pack_layers): a decode step streams them from DRAM,
// and on 4 KiB pages every 4 KiB is a TLB miss and a stop for the hardware prefetcher.
at::Tensor huge_empty(int64_t nbytes) {
  constexpr size_t H = size_t{1} << 21;
  const size_t n = (static_cast<size_t>(std::max<int64_t>(nbytes, 1)) + H - 1) / H * H;
  void* p = std::aligned_alloc(H, n);
  TORCH_CHECK(p != nullptr, "specdec::huge_empty: could not allocate ", n, " bytes");
#ifdef MADV_HUGEPAGE
  madvise(p, n, MADV_HUGEPAGE);
#endif
  return at::from_blob(p, {nbytes}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(at::kByte));
}

// block<R> for R = rows < RB, known only at run time (none for 0).
template <typename W>
inline void few(int64_t rows, const float* x, int64_t K, const W* wp, const float* b, float* y, int64_t ldy) {
  static_assert(RB <= 6, "few() serves up to 5 rows");
  switch (rows) {
    case 1: block<1>(x, K, wp, b, y, ldy); break;
    case 2: block<2>(x, K, wp, b, y, ldy); break;
    case 3: block<3>(x, K, wp, b, y, ldy); break;
    case 4: block<4>(x, K, wp, b, y, ldy); break;
    case 5: block<5>(x, K, wp, b, y, ldy); break;
    default: break;
  }
}

// y[0:M, 0:np*P] from panels wp (ldy = np * P), threads over panels.
template <typename W>
void run_panels(const float* xp, const W* wp, const float* bp, float* yp, int64_t M, int64_t K, int64_t np) {
  const int64_t Np = np * P;
  // Threads take whole panels, at least 2^15 multiply-adds each: a one-row 256 x 256 layer
  // (8 panels) runs on 2 threads, a 256 x 32 one on one. (At 2^17 the 256 x 256 one ran on one
  // thread: as fast when its weights sit in cache, but a decode step reads them from memory,
  // and two threads keep twice the lines in flight: the 41 products above, 1.52 -> 1.44 ms, one run.)
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, M * K * P));
  at::parallel_for(0, np, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) {
      const W* wq = wp + p * K * P;
      const float* bq = bp ? bp + p * P : nullptr;
      float* yq = yp + p * P;
      int64_t m = 0;
      for (; m + RB <= M; m += RB) block<RB>(xp + m * K, K, wq, bq, yq + m * Np, Np);
      few(M - m, xp + m * K, K, wq, bq, yq + m * Np, Np);  // the last rows: same sums, fewer at once
    }
  });
}

at::Tensor row_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "specdec::row_linear: want float32 CPU x [rows, in], got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16) &&
                  packed.size(2) == P && packed.size(1) == x.size(1) && packed.is_contiguous() &&
                  out_features <= packed.size(0) * P,
              "specdec::row_linear: packed weight ", packed.sizes(), " does not serve x ", x.sizes());
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), np = packed.size(0), Np = np * P, N = out_features;
  at::Tensor y = at::empty({M, Np}, xc.options());
  at::Tensor bpad;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "specdec::row_linear: bias has ", bias->numel(), " values for ", N, " outputs");
    bpad = at::zeros({Np}, xc.options());
    bpad.narrow(0, 0, N).copy_(*bias);
    bp = bpad.const_data_ptr<float>();
  }
  const float* xp = xc.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  if (packed.scalar_type() == at::kBFloat16)
    run_panels(xp, packed.const_data_ptr<at::BFloat16>(), bp, yp, M, K, np);
  else
    run_panels(xp, packed.const_data_ptr<float>(), bp, yp, M, K, np);
  return Np == N ? y : y.narrow(1, 0, N).contiguous();
}

// 16 running sums (as two 8-float vectors with AVX2, one 16-float with AVX-512) and their
// total in a fixed tree: lane j + lane j + 8, then j + 4, j + 2, j + 1 — in registers.
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

struct Sum16 {
  vf a[16 / L] = {};
  void add(const float* p, const float* q) {  // a[lane] += p[lane] * q[lane] for 16 lanes
    for (int h = 0; h < 16 / L; ++h) a[h] += loadv(p + L * h) * loadv(q + L * h);
  }
  void add(const float* p) {  // a[lane] += p[lane]
    for (int h = 0; h < 16 / L; ++h) a[h] += loadv(p + L * h);
  }
  void add_at(int lane, float v) { a[lane / L][lane % L] += v; }
  float total() const {
#ifdef __AVX512F__
    const v8 t = __builtin_shufflevector(a[0], a[0], 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(a[0], a[0], 8, 9, 10, 11, 12, 13, 14, 15);
#else
    const v8 t = a[0] + a[1];
#endif
    const v4 u = __builtin_shufflevector(t, t, 0, 1, 2, 3) + __builtin_shufflevector(t, t, 4, 5, 6, 7);
    return (u[0] + u[2]) + (u[1] + u[3]);
  }
};

// y[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)), each row alone: 16 running sums of squares
// over the row in order, added up in a fixed tree.
// rms_norm's rows on raw pointers: y[r] for r < rows, x and y [rows, d] contiguous.
void rms_rows(const float* xp, int64_t rows, int64_t d, const float* wp, double eps, float* yp) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, d));
  at::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* xr = xp + r * d;
      float* yr = yp + r * d;
      Sum16 acc;  // sum j (mod 16) in lane j: the same 16 sums at any vector width
      int64_t i = 0;
      for (; i + 16 <= d; i += 16) acc.add(xr + i, xr + i);
      for (; i < d; ++i) acc.add_at(static_cast<int>(i % 16), xr[i] * xr[i]);
      const float inv = 1.0f / std::sqrt(acc.total() / static_cast<float>(d) + static_cast<float>(eps));
      for (int64_t j = 0; j < d; ++j) yr[j] = wp[j] * (xr[j] * inv);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.device().is_cpu() &&
                  w.dim() == 1 && x.dim() >= 1 && x.size(-1) == w.size(0),
              "specdec::rms_norm: want float32 CPU x [..., d] and weight [d], got ", x.sizes(), " and ", w.sizes());
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t d = xc.size(-1), rows = d ? xc.numel() / d : 0;
  at::Tensor y = at::empty(xc.sizes(), xc.options());
  rms_rows(xc.const_data_ptr<float>(), rows, d, wc.const_data_ptr<float>(), eps, y.mutable_data_ptr<float>());
  return y;
}


// paged_attention: for each request b, query row i and head h (kv head h / (H / Hkv)):
//
//   s_j = scale * (q . k_j)      over the keys j row i sees, in key order
//   out = sum_j exp(s_j - m) v_j / sum_j exp(s_j - m),   m = max_j s_j
//
// Keys a row does not see (mask false, or j > i under causal) are skipped, not added as
// exp(-inf) = 0: a row's result is a function of the keys it sees alone, computed the same
// way whatever else is in the batch — a token verified among gamma + 1 rows gets the bits it
// gets decoded alone, at any thread count. Each dot product is 16 running sums (dim d in sum
// d mod 16) added up in a fixed tree, exp is one polynomial (Cephes' expf), the denominator is
// 16 running sums the same way: the same bits with 8- or 16-float vectors. A row that sees no
// key gets zeros (as torch's SDPA gives a fully masked row).

typedef int32_t vi __attribute__((vector_size(4 * L)));

inline vf splat(float x) { return vf{} + x; }

// exp(x) lane by lane, ~1 ulp (Cephes' expf); NaN stays NaN, x below -87.3 gives ~1e-38.
inline vf vexp(vf x) {
  const vf lo = splat(-87.3365478515625f), hi = splat(88.3762626647949f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (x * splat(1.44269504088896341f) + magic) - magic;
  vf r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  vf y = splat(1.9875691500e-4f);
  y = y * r + splat(1.3981999507e-3f);
  y = y * r + splat(8.3334519073e-3f);
  y = y * r + splat(4.1665795894e-2f);
  y = y * r + splat(1.6666665459e-1f);
  y = y * r + splat(5.0000001201e-1f);
  y = y * (r * r) + r + splat(1.0f);
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;  // 2^n
  vf scale2;
  std::memcpy(&scale2, &e, sizeof scale2);
  return y * scale2;
}

// One query row of one head: q [D] against the n keys at offsets off[] of kc/vc; y [D].
template <int DT>
void attend_row(const float* q, const float* kc, const float* vc, const int64_t* off, int64_t n,
                int64_t Drt, float scale, float* sc, float* y) {
  const int64_t D = DT ? DT : Drt;
  if (n == 0) {
    std::memset(y, 0, sizeof(float) * D);
    return;
  }
  // The keys and values sit wherever their slots put them, usually out of cache (a decode
  // step's weights pass through it between layers): fetch a few keys ahead of the dot products.
  constexpr int64_t KA = 8;
  const int64_t lines = static_cast<int64_t>(sizeof(float)) * D / 64;
  for (int64_t t = 0; t < std::min(n, KA); ++t)
    for (int64_t c = 0; c < lines; ++c) __builtin_prefetch(kc + off[t] + 16 * c, 0, 3);
  float m = -INFINITY;
  for (int64_t t = 0; t < n; ++t) {
    if (t + KA < n)
      for (int64_t c = 0; c < lines; ++c) __builtin_prefetch(kc + off[t + KA] + 16 * c, 0, 3);
    else if (t + KA - n < n)  // the first values, while the last keys are summed
      for (int64_t c = 0; c < lines; ++c) __builtin_prefetch(vc + off[t + KA - n] + 16 * c, 0, 3);
    Sum16 acc;
    const float* k = kc + off[t];
    for (int64_t d = 0; d < D; d += 16) acc.add(q + d, k + d);
    sc[t] = acc.total() * scale;
    if (sc[t] > m) m = sc[t];
  }
  const int64_t nv = (n + 15) / 16 * 16;  // sc has room for it
  for (int64_t t = 0; t < nv; t += L) storev(sc + t, vexp(loadv(sc + t) - splat(m)));
  for (int64_t t = n; t < nv; ++t) sc[t] = 0.0f;  // (adds nothing to the sums below)
  Sum16 den;  // exp(s_j - m) in sum j mod 16
  for (int64_t t = 0; t < nv; t += 16) den.add(sc + t);
  const float l = den.total();
  constexpr int NV = DT ? DT / L : 1;
  vf acc[NV] = {};
  if constexpr (DT != 0) {
    for (int64_t t = 0; t < n; ++t) {
      if (t + KA < n)
        for (int64_t c = 0; c < lines; ++c) __builtin_prefetch(vc + off[t + KA] + 16 * c, 0, 3);
      const float* v = vc + off[t];
      const vf p = splat(sc[t]);
      for (int c = 0; c < NV; ++c) acc[c] += p * loadv(v + L * c);
    }
    const vf inv = splat(1.0f / l);
    for (int c = 0; c < NV; ++c) storev(y + L * c, acc[c] * inv);
  } else {
    std::memset(y, 0, sizeof(float) * D);
    for (int64_t t = 0; t < n; ++t) {
      const float* v = vc + off[t];
      const vf p = splat(sc[t]);
      for (int64_t d = 0; d < D; d += L) storev(y + d, loadv(y + d) + p * loadv(v + d));
    }
    const vf inv = splat(1.0f / l);
    for (int64_t d = 0; d < D; d += L) storev(y + d, loadv(y + d) * inv);
  }
}

// paged_attention's work on raw pointers. Query row r = b * Q + i (of B requests' Q rows each)
// is at qp + (qrow ? qrow[r] : r) * q_ld, its H heads of D in a row; slots sp [B, S] (checked by
// the caller), mask mp [B, Q, S] or null; out yp [B, Q, H, D].
void attend_rows(const float* qp, const int64_t* qrow, int64_t q_ld, const float* kp, const float* vp,
                 const int64_t* sp, int64_t S, const bool* mp, bool causal, int64_t B, int64_t Q, int64_t H,
                 int64_t Hkv, int64_t D, float sc, float* yp) {
  const int64_t G = H / Hkv;
  // Threads take (row, head) pairs: a one-token decode step (one row) splits its heads too,
  // and its gathers from the cache, latency-bound, overlap on two threads (the built-in
  // target's one-token forward: ~0.1 ms of 2.5 on a 2-core Zen 1). Each pair is computed alone.
  const int64_t rows = B * Q, grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, S * D));
  at::parallel_for(0, rows * H, grain, [&](int64_t lo, int64_t hi) {
    std::vector<int64_t> off(S);
    std::vector<float> buf((S + 15) / 16 * 16);
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t u = w / H;
      // Rows in the order 0, R-1, 1, R-2, ...: each thread's share of a causal prompt (later
      // rows see more keys) holds early and late rows alike.
      const int64_t r = u % 2 ? rows - 1 - u / 2 : u / 2;
      const int64_t b = r / Q, i = r % Q, last = causal ? std::min(S, i + 1) : S;
      const bool* mrow = mp ? mp + r * S : nullptr;
      const int64_t h = w % H;
      int64_t n = 0;
      const int64_t head = (h / G) * D;
      for (int64_t j = 0; j < last; ++j)
        if (!mrow || mrow[j]) off[n++] = sp[b * S + j] * Hkv * D + head;
      const float* qr = qp + (qrow ? qrow[r] : r) * q_ld + h * D;
      float* yr = yp + (r * H + h) * D;
      if (D == 64)
        attend_row<64>(qr, kp, vp, off.data(), n, D, sc, buf.data(), yr);
      else if (D == 128)
        attend_row<128>(qr, kp, vp, off.data(), n, D, sc, buf.data(), yr);
      else
        attend_row<0>(qr, kp, vp, off.data(), n, D, sc, buf.data(), yr);
    }
  });
}

// q [B, Q, H, D], k_cache / v_cache [slots, Hkv, D], slots [B, S] (the cache slot of each
// request's key j), mask [B, 1, Q, S] bool (true: seen) or none -> [B, Q, H, D].
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& slots, const std::optional<at::Tensor>& mask, bool causal,
                           double scale) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() &&
                  q.size(3) == k_cache.size(2) && q.size(3) % 16 == 0 && k_cache.size(1) > 0 &&
                  q.size(2) % k_cache.size(1) == 0,
              "specdec::paged_attention: want float32 q [B, Q, H, D] and caches [slots, Hkv, D] (D a multiple "
              "of 16, Hkv dividing H), got q ", q.sizes(), " ", q.scalar_type(), ", caches ", k_cache.sizes(),
              " and ", v_cache.sizes());
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == q.size(0) && slots.scalar_type() == at::kLong,
              "specdec::paged_attention: slots must be int64 [B, S] for q ", q.sizes(), ", got ", slots.sizes());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "specdec::paged_attention: caches must be contiguous");
  const int64_t B = q.size(0), Q = q.size(1), H = q.size(2), D = q.size(3), S = slots.size(1);
  const int64_t Hkv = k_cache.size(1), nslots = k_cache.size(0);
  const at::Tensor qc = q.contiguous(), sl = slots.contiguous();
  const int64_t* sp = sl.const_data_ptr<int64_t>();
  for (int64_t j = 0; j < B * S; ++j)
    TORCH_CHECK(sp[j] >= 0 && sp[j] < nslots, "specdec::paged_attention: slot ", sp[j], " outside the cache's ",
                nslots);
  at::Tensor mc;
  const bool* mp = nullptr;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->numel() == B * Q * S,
                "specdec::paged_attention: mask must be bool [B, 1, Q, S] = [", B, ", 1, ", Q, ", ", S, "], got ",
                mask->sizes());
    mc = mask->contiguous();
    mp = mc.const_data_ptr<bool>();
  }
  at::Tensor y = at::empty({B, Q, H, D}, qc.options());
  attend_rows(qc.const_data_ptr<float>(), nullptr, H * D, k_cache.const_data_ptr<float>(),
              v_cache.const_data_ptr<float>(), sp, S, mp, causal, B, Q, H, Hkv, D, static_cast<float>(scale),
              y.mutable_data_ptr<float>());
  return y;
}


// decoder_forward: a Llama decoder's forward in one call: the token embedding (a table's rows, or
// those of the packed head a tied model keeps it in: embedding_rows), the rope rows
// of each position, every layer, the final norm, the rows whose logits are wanted and the
// head. It computes what LlamaDecoder.forward computes eagerly on these kernels
// (row_linear, rms_norm, paged_attention; ATen's own silu), in the same order and with the
// same roundings, so its results are the same bits: only the ~15 calls a layer from Python
// are gone (and the Python that ran cold after the weights had streamed through the caches).
// Each layer, for rows x [T, d]:
//
//   h = rms_norm(x); qkv = h W_qkv^T (+ b); rope on q and k: qk * cos + rotate_half(qk) * sin
//   (two products and a sum, each rounded: no fused multiply-add); write k, v to the layer's
//   cache slots; attention per group of rows; x = x + o_proj(attn)
//   h = rms_norm(x); [gate, up] = h W_gu^T (+ b); x = x + down(silu(gate) * up)
//
// then h = rms_norm(x), hl = h[logit_index], logits = hl W_head^T. ``capture`` lists layers
// whose input x (at ``rows`` when given) is returned as well (layer L: the last layer's output).

// a * b + c * d with both products rounded to float before the sum, as separate eager
// multiplications and an addition give (-ffp-contract=fast would fuse one product into an FMA).
__attribute__((optimize("fp-contract=off"))) void rope_rows(const float* qk, int64_t ld, const float* cos,
                                                            const float* sin, int64_t T, int64_t heads, int64_t D,
                                                            float* out) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos + t * D;
    const float* s = sin + t * D;
    for (int64_t j = 0; j < heads; ++j) {
      const float* x = qk + t * ld + j * D;
      float* y = out + (t * heads + j) * D;
      for (int64_t e = 0; e < half; ++e) {
        const float a = x[e] * c[e], b = -x[e + half] * s[e];
        y[e] = a + b;
      }
      for (int64_t e = half; e < D; ++e) {
        const float a = x[e] * c[e], b = x[e - half] * s[e];
        y[e] = a + b;
      }
    }
  }
}

// y [M, N] = x [M, K] W^T (+ b) into yp (row stride N), W packed by pack(): run_panels straight
// into yp where N fills the panels and there is no bias, else row_linear and a copy (same sums).
void linear_to(const float* xp, int64_t M, int64_t K, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
               int64_t N, float* yp) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == P && packed.is_contiguous() &&
                  N <= packed.size(0) * P,
              "specdec::decoder_forward: packed weight ", packed.sizes(), " does not serve ", K, " -> ", N);
  const int64_t np = packed.size(0);
  if (np * P == N && !(bias.has_value() && bias->defined())) {
    if (packed.scalar_type() == at::kBFloat16)
      run_panels(xp, packed.const_data_ptr<at::BFloat16>(), static_cast<const float*>(nullptr), yp, M, K, np);
    else
      run_panels(xp, packed.const_data_ptr<float>(), static_cast<const float*>(nullptr), yp, M, K, np);
    return;
  }
  const at::Tensor x = at::from_blob(const_cast<float*>(xp), {M, K}, at::TensorOptions().dtype(at::kFloat));
  const at::Tensor y = row_linear(x, packed, bias, N);
  std::memcpy(yp, y.const_data_ptr<float>(), sizeof(float) * M * N);
}

// rows ``index`` of ``table`` [n, w] (float32), each checked to lie in [0, n): ``what`` names it.
at::Tensor take_rows(const at::Tensor& table, const at::Tensor& index, const char* what,
                     const char* op = "decoder_forward") {
  TORCH_CHECK(table.dim() == 2 && table.is_contiguous() && table.scalar_type() == at::kFloat &&
                  index.scalar_type() == at::kLong && index.dim() == 1,
              "specdec::", op, ": want a contiguous float32 table and int64 ", what, ", got ",
              table.sizes(), " and ", index.sizes());
  const at::Tensor ic = index.contiguous();
  const int64_t n = ic.numel(), w = table.size(1), rows = table.size(0);
  at::Tensor out = at::empty({n, w}, table.options());
  const int64_t* ip = ic.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "specdec::", op, ": ", what, " ", ip[i], " outside [0, ", rows, ")");
    std::memcpy(out.mutable_data_ptr<float>() + i * w, table.const_data_ptr<float>() + ip[i] * w, sizeof(float) * w);
  }
  return out;
}

// The embedding rows of token ids ``index`` (each checked to lie in [0, rows)) from ``table``: a
// float32 table [rows, d], or the packed head the embedding is tied to (pack's layout [N/P, d, P],
// float32 or bfloat16, N = rows: row i is panel i / P's column i % P, a bfloat16 one widened to the
// float32 it stands for), so a tied model holds its embedding once. The same bits either way.
at::Tensor embedding_rows(const at::Tensor& table, int64_t rows, const at::Tensor& index, const char* op) {
  if (table.dim() == 2) {
    TORCH_CHECK(table.size(0) == rows, "specdec::", op, ": embedding ", table.sizes(), " has not ", rows, " rows");
    return take_rows(table, index, "token id", op);
  }
  const bool bf16 = table.scalar_type() == at::kBFloat16;
  TORCH_CHECK(table.dim() == 3 && table.size(2) == P && table.is_contiguous() &&
                  (bf16 || table.scalar_type() == at::kFloat) && index.scalar_type() == at::kLong &&
                  index.dim() == 1 && rows > (table.size(0) - 1) * P && rows <= table.size(0) * P,
              "specdec::", op, ": want a float32 embedding [", rows, ", d] or a packed head [", (rows + P - 1) / P,
              ", d, ", P, "] of float32 or bfloat16, and int64 token ids; got ", table.sizes(), " ",
              table.scalar_type(), " and ", index.sizes());
  const at::Tensor ic = index.contiguous();
  const int64_t n = ic.numel(), K = table.size(1);
  at::Tensor out = at::empty({n, K}, table.options().dtype(at::kFloat));
  const int64_t* ip = ic.const_data_ptr<int64_t>();
  float* op_ = out.mutable_data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = ip[i];
    TORCH_CHECK(id >= 0 && id < rows, "specdec::", op, ": token id ", id, " outside [0, ", rows, ")");
    const int64_t c = id % P, panel = id / P;
    // (a bfloat16 panel pairs column j with column L + j in each block of 2L: see weights())
    const int64_t col = bf16 ? c / (2 * L) * (2 * L) + 2 * (c % L) + c % (2 * L) / L : c;
    if (bf16) {
      const at::BFloat16* src = table.const_data_ptr<at::BFloat16>() + panel * K * P + col;
      for (int64_t k = 0; k < K; ++k) op_[i * K + k] = static_cast<float>(src[k * P]);
    } else {
      const float* src = table.const_data_ptr<float>() + panel * K * P + col;
      for (int64_t k = 0; k < K; ++k) op_[i * K + k] = src[k * P];
    }
  }
  return out;
}

// One attention group's index operands (decoder_forward's slot_mapping .. group_rows), contiguous
// and checked once: the layers read them raw.
struct Group {
  at::Tensor map, slots, mask, qidx, oidx;
  int64_t B, Q, S, n, start;
  bool causal, single;
};

std::vector<Group> parse_groups(const char* op, int64_t T, int64_t nslots, at::TensorList slot_mapping,
                                at::TensorList slots, const c10::List<std::optional<at::Tensor>>& masks,
                                at::IntArrayRef flags, at::TensorList q_index, at::TensorList out_index,
                                at::IntArrayRef group_rows, int64_t& att_rows) {
  const int64_t G = static_cast<int64_t>(group_rows.size());
  TORCH_CHECK(static_cast<int64_t>(slot_mapping.size()) == G && static_cast<int64_t>(slots.size()) == G &&
                  static_cast<int64_t>(masks.size()) == G && static_cast<int64_t>(flags.size()) == 2 * G &&
                  static_cast<int64_t>(q_index.size()) == G && static_cast<int64_t>(out_index.size()) == G,
              "specdec::", op, ": every attention group needs slot_mapping, slots, mask, flags and indices");
  std::vector<Group> gs(G);
  att_rows = 0;
  int64_t start = 0;
  for (int64_t g = 0; g < G; ++g) {
    Group& e = gs[g];
    e.n = group_rows[g], e.start = start, e.causal = flags[2 * g] != 0, e.single = flags[2 * g + 1] != 0;
    e.map = slot_mapping[g].contiguous();
    TORCH_CHECK(e.map.scalar_type() == at::kLong && e.map.numel() == e.n,
                "specdec::", op, ": group ", g, "'s slot_mapping must be int64 [", e.n, "]");
    for (int64_t k = 0; k < e.n; ++k) {
      const int64_t sm = e.map.const_data_ptr<int64_t>()[k];
      TORCH_CHECK(sm >= 0 && sm < nslots, "specdec::", op, ": slot ", sm, " outside the cache's ", nslots);
    }
    e.slots = slots[g].contiguous();
    TORCH_CHECK(e.slots.dim() == 2 && e.slots.scalar_type() == at::kLong,
                "specdec::", op, ": group ", g, "'s slots must be int64 [B, S], got ", e.slots.sizes());
    e.B = e.slots.size(0), e.S = e.slots.size(1);
    e.Q = e.single ? e.n : q_index[g].size(-1);
    TORCH_CHECK(!e.single || e.B == 1, "specdec::", op, ": group ", g, " is one request but has slots ",
                e.slots.sizes());
    const int64_t* sp = e.slots.const_data_ptr<int64_t>();
    for (int64_t k = 0; k < e.B * e.S; ++k)
      TORCH_CHECK(sp[k] >= 0 && sp[k] < nslots, "specdec::", op, ": slot ", sp[k], " outside the cache's ", nslots);
    if (!e.single) {
      e.qidx = q_index[g].contiguous(), e.oidx = out_index[g].contiguous();
      TORCH_CHECK(e.qidx.scalar_type() == at::kLong && e.qidx.numel() == e.B * e.Q &&
                      e.oidx.scalar_type() == at::kLong && e.oidx.numel() == e.n,
                  "specdec::", op, ": group ", g, "'s q_index must be int64 [B, Q] and out_index [rows]");
      const int64_t* qi = e.qidx.const_data_ptr<int64_t>();
      const int64_t* oi = e.oidx.const_data_ptr<int64_t>();
      for (int64_t k = 0; k < e.B * e.Q; ++k)
        TORCH_CHECK(qi[k] >= 0 && qi[k] < e.n, "specdec::", op, ": q_index ", qi[k], " outside group ", g);
      for (int64_t k = 0; k < e.n; ++k)
        TORCH_CHECK(oi[k] >= 0 && oi[k] < e.B * e.Q, "specdec::", op, ": out_index ", oi[k], " outside group ", g);
    }
    const std::optional<at::Tensor> m = masks.get(g);
    if (m.has_value() && m->defined()) {
      TORCH_CHECK(m->scalar_type() == at::kBool && m->numel() == e.B * e.Q * e.S,
                  "specdec::", op, ": group ", g, "'s mask must be bool [B, 1, Q, S], got ", m->sizes());
      e.mask = m->contiguous();
    }
    att_rows = std::max(att_rows, e.B * e.Q);
    start += e.n;
  }
  TORCH_CHECK(start == T, "specdec::", op, ": the groups hold ", start, " rows, the step ", T);
  return gs;
}

// The shapes of one layer and its workspace, made once a forward (no allocation in the layers).
struct LayerWork {
  int64_t T, d, H, Hkv, D, F, qk_heads, qkv_out, kv_row;
  at::Tensor qkv, qk, yatt, attn, o, gu, act;
  LayerWork(int64_t T_, int64_t d_, int64_t H_, int64_t Hkv_, int64_t D_, int64_t F_, int64_t att_rows,
            const at::TensorOptions& opt)
      : T(T_), d(d_), H(H_), Hkv(Hkv_), D(D_), F(F_), qk_heads(H_ + Hkv_), qkv_out((H_ + 2 * Hkv_) * D_),
        kv_row(Hkv_ * D_) {
    qkv = at::empty({T, qkv_out}, opt), qk = at::empty({T, qk_heads, D}, opt);
    yatt = at::empty({att_rows, H * D}, opt), attn = at::empty({T, H * D}, opt), o = at::empty({T, d}, opt);
    gu = at::empty({T, 2 * F}, opt), act = at::empty({T, F}, opt);
  }
};

// One decoder layer l on the residual stream xp [T, d], updated in place, with q/k/v projected
// from qin [T, Kin] (a Llama layer: input_layernorm(x); EAGLE-1: x itself; EAGLE-3: its 2d input):
//   qkv = qin W_qkv^T (+ b); rope on q and k; k, v to the layer's cache slots; attention per
//   group; x += o_proj(attn); x += down(silu(gate) * up) of post_attention_layernorm(x).
// w: [qkv, o, post norm, gate_up, down]; biases: [qkv, o, gate_up, down].
void layer_forward(float* xp, const float* qin, int64_t Kin, const at::Tensor* w,
                   const std::optional<at::Tensor>* bias, int64_t l, at::Tensor& k_cache, at::Tensor& v_cache,
                   const std::vector<Group>& gs, const float* cp, const float* snp, double eps, float sc,
                   float* hp, LayerWork& s) {
  const int64_t T = s.T, d = s.d, H = s.H, Hkv = s.Hkv, D = s.D, F = s.F, qk_heads = s.qk_heads;
  const int64_t qkv_out = s.qkv_out, kv_row = s.kv_row, nslots = k_cache.size(1);
  float *qkvp = s.qkv.mutable_data_ptr<float>(), *qkp = s.qk.mutable_data_ptr<float>();
  float *yp = s.yatt.mutable_data_ptr<float>(), *ap = s.attn.mutable_data_ptr<float>();
  float *op = s.o.mutable_data_ptr<float>(), *gup = s.gu.mutable_data_ptr<float>(), *actp = s.act.mutable_data_ptr<float>();
  linear_to(qin, T, Kin, w[0], bias[0], qkv_out, qkvp);  // [T, (H + 2 Hkv) D]
  rope_rows(qkvp, qkv_out, cp, snp, T, qk_heads, D, qkp);
  // This layer's keys and values into the cache, by slot (k: rows H.. of qk; v: after q, k in qkv).
  float* kc = k_cache.mutable_data_ptr<float>() + l * nslots * kv_row;
  float* vc = v_cache.mutable_data_ptr<float>() + l * nslots * kv_row;
  for (const Group& e : gs) {
    const int64_t* sp = e.map.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < e.n; ++i) {
      const int64_t t = e.start + i;
      std::memcpy(kc + sp[i] * kv_row, qkp + (t * qk_heads + H) * D, sizeof(float) * kv_row);
      std::memcpy(vc + sp[i] * kv_row, qkvp + t * qkv_out + qk_heads * D, sizeof(float) * kv_row);
    }
  }
  for (const Group& e : gs) {  // each group's queries read straight from qk (q: its first H heads)
    attend_rows(qkp + e.start * qk_heads * D, e.single ? nullptr : e.qidx.const_data_ptr<int64_t>(), qk_heads * D,
                kc, vc, e.slots.const_data_ptr<int64_t>(), e.S, e.mask.defined() ? e.mask.const_data_ptr<bool>() : nullptr,
                e.causal, e.B, e.Q, H, Hkv, D, sc, yp);
    if (e.single) {
      std::memcpy(ap + e.start * H * D, yp, sizeof(float) * e.n * H * D);
    } else {
      const int64_t* oi = e.oidx.const_data_ptr<int64_t>();
      for (int64_t t = 0; t < e.n; ++t) std::memcpy(ap + (e.start + t) * H * D, yp + oi[t] * H * D, sizeof(float) * H * D);
    }
  }
  linear_to(ap, T, H * D, w[1], bias[1], d, op);
  for (int64_t k = 0; k < T * d; ++k) xp[k] += op[k];  // (one rounding a sum: the eager add's bits)
  rms_rows(xp, T, d, w[2].const_data_ptr<float>(), eps, hp);
  linear_to(hp, T, d, w[3], bias[2], 2 * F, gup);  // [T, 2F]: gate, then up
  at::silu_out(s.act, s.gu.narrow(1, 0, F));  // ATen's silu on F.silu's view: its bits
  for (int64_t t = 0; t < T; ++t)  // act *= up (a product is one rounding however it is computed)
    for (int64_t j = 0; j < F; ++j) actp[t * F + j] *= gup[t * 2 * F + F + j];
  linear_to(actp, T, F, w[4], bias[3], d, op);
  for (int64_t k = 0; k < T * d; ++k) xp[k] += op[k];
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::vector<at::Tensor>> decoder_forward(
    const at::Tensor& tokens, const at::Tensor& positions, at::Tensor k_cache, at::Tensor v_cache,
    const at::Tensor& logit_index, at::TensorList slot_mapping, at::TensorList slots,
    const c10::List<std::optional<at::Tensor>>& masks, at::IntArrayRef flags, at::TensorList q_index,
    at::TensorList out_index, at::IntArrayRef group_rows, at::IntArrayRef capture,
    const std::optional<at::Tensor>& rows, const at::Tensor& cos_table, const at::Tensor& sin_table,
    const at::Tensor& embed, int64_t embed_rows, at::TensorList weights,
    const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef dims, double eps,
    const at::Tensor& final_norm, const at::Tensor& head, const std::optional<at::Tensor>& head_bias, int64_t vocab,
    double scale) {
  const at::Tensor x_in = embedding_rows(embed, embed_rows, tokens, "decoder_forward");
  const at::Tensor cos = take_rows(cos_table, positions, "position"), sin = take_rows(sin_table, positions, "position");
  TORCH_CHECK(dims.size() == 5, "specdec::decoder_forward: dims = [H, Hkv, D, intermediate, layers]");
  const int64_t H = dims[0], Hkv = dims[1], D = dims[2], F = dims[3], L = dims[4];
  const int64_t T = x_in.size(0), d = x_in.size(1);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 6 * L && static_cast<int64_t>(biases.size()) == 4 * L,
              "specdec::decoder_forward: want 6 weights and 4 biases a layer for ", L, " layers, got ",
              weights.size(), " and ", biases.size());
  TORCH_CHECK(cos.size(1) == D && sin.size(1) == D, "specdec::decoder_forward: rope tables ", cos_table.sizes(),
              " and ", sin_table.sizes(), " are not [positions, ", D, "]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(0) == L && k_cache.size(2) == Hkv && k_cache.size(3) == D &&
                  k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous(),
              "specdec::decoder_forward: caches must be contiguous [", L, ", slots, ", Hkv, ", ", D, "], got ",
              k_cache.sizes());
  int64_t att_rows = 0;
  const std::vector<Group> gs = parse_groups("decoder_forward", T, k_cache.size(1), slot_mapping, slots, masks, flags,
                                             q_index, out_index, group_rows, att_rows);
  const float* cp = cos.const_data_ptr<float>();
  const float* snp = sin.const_data_ptr<float>();
  std::vector<at::Tensor> seen(capture.size());
  auto keep = [&](int64_t layer, const at::Tensor& x) {  // (copies: x is updated in place below)
    for (size_t c = 0; c < capture.size(); ++c)
      if (capture[c] == layer) seen[c] = rows.has_value() && rows->defined() ? x.index_select(0, *rows) : x.clone();
  };
  const auto opt = x_in.options();
  at::Tensor x = x_in;  // the residual stream, updated in place
  at::Tensor h = at::empty({T, d}, opt);
  LayerWork work(T, d, H, Hkv, D, F, att_rows, opt);
  float *xp = x.mutable_data_ptr<float>(), *hp = h.mutable_data_ptr<float>();
  const float sc = static_cast<float>(scale);
  for (int64_t l = 0; l < L; ++l) {
    keep(l, x);
    const at::Tensor* w = &weights[6 * l];
    const std::optional<at::Tensor> bias[4] = {biases.get(4 * l), biases.get(4 * l + 1), biases.get(4 * l + 2),
                                               biases.get(4 * l + 3)};
    rms_rows(xp, T, d, w[0].const_data_ptr<float>(), eps, hp);
    layer_forward(xp, hp, d, w + 1, bias, l, k_cache, v_cache, gs, cp, snp, eps, sc, hp, work);
  }
  keep(L, x);
  const at::Tensor hf = rms_norm(x, final_norm, eps);
  const at::Tensor hl = hf.index_select(0, logit_index);  // [N, d]
  return {hf, hl, row_linear(hl, head, head_bias, vocab), seen};
}

// eagle_forward: an EAGLE head's forward (specdec/models/eagle.py, EagleHead.forward) in one call,
// on the same kernels in the eager order, so the same bits. Rows: tokens [T] and feature [T, d]:
//
//   EAGLE-1 (fc given):  x = fc([embed(tokens); feature]) (+ b); the layer's q/k/v from x itself
//   EAGLE-3 (no fc):     x = feature; q/k/v from [input_norm(embed(tokens)); hidden_norm(feature)] (2d)
//
// then its one layer (layer_forward, cache layer 0); hl = x[logit_index]; logits = (final_norm
// given: rms_norm(hl) first) hl W_head^T, and where ``vocab_ids`` is given (a draft vocabulary
// smaller than the target's) spread over ``full_vocab`` target ids, -inf elsewhere
// (EagleHead.target_logits) -> (x [T, d], hl [N, d], logits [N, V]).
// weights: [qkv, o, post norm, gate_up, down]; biases: [qkv, o, gate_up, down]; dims [H, Hkv, D, F].
std::tuple<at::Tensor, at::Tensor, at::Tensor> eagle_forward(
    const at::Tensor& tokens, const at::Tensor& feature, const at::Tensor& positions, at::Tensor k_cache,
    at::Tensor v_cache, const at::Tensor& logit_index, at::TensorList slot_mapping, at::TensorList slots,
    const c10::List<std::optional<at::Tensor>>& masks, at::IntArrayRef flags, at::TensorList q_index,
    at::TensorList out_index, at::IntArrayRef group_rows, const at::Tensor& cos_table, const at::Tensor& sin_table,
    const at::Tensor& embed, int64_t embed_rows, const std::optional<at::Tensor>& fc,
    const std::optional<at::Tensor>& fc_bias, const std::optional<at::Tensor>& input_norm,
    const std::optional<at::Tensor>& hidden_norm,
    at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef dims, double eps,
    const std::optional<at::Tensor>& final_norm, const at::Tensor& head, const std::optional<at::Tensor>& head_bias,
    int64_t vocab, const std::optional<at::Tensor>& vocab_ids, int64_t full_vocab, double scale) {
  const at::Tensor e = embedding_rows(embed, embed_rows, tokens, "eagle_forward");
  const at::Tensor cos = take_rows(cos_table, positions, "position", "eagle_forward");
  const at::Tensor sin = take_rows(sin_table, positions, "position", "eagle_forward");
  TORCH_CHECK(dims.size() == 4 && weights.size() == 5 && biases.size() == 4,
              "specdec::eagle_forward: want dims [H, Hkv, D, intermediate], 5 weights and 4 biases");
  const int64_t H = dims[0], Hkv = dims[1], D = dims[2], F = dims[3], T = e.size(0), d = e.size(1);
  const bool eagle1 = fc.has_value() && fc->defined();
  TORCH_CHECK(feature.dim() == 2 && feature.size(0) == T && feature.scalar_type() == at::kFloat &&
                  (eagle1 || (feature.size(1) == d && input_norm.has_value() && hidden_norm.has_value())),
              "specdec::eagle_forward: feature must be float32 [", T, ", ", d, "] (EAGLE-3: with both norms), got ",
              feature.sizes());
  TORCH_CHECK(cos.size(1) == D && sin.size(1) == D, "specdec::eagle_forward: rope tables are not [positions, ", D, "]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(0) == 1 && k_cache.size(2) == Hkv && k_cache.size(3) == D &&
                  k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous(),
              "specdec::eagle_forward: caches must be contiguous [1, slots, ", Hkv, ", ", D, "], got ",
              k_cache.sizes());
  int64_t att_rows = 0;
  const std::vector<Group> gs = parse_groups("eagle_forward", T, k_cache.size(1), slot_mapping, slots, masks, flags,
                                             q_index, out_index, group_rows, att_rows);
  const auto opt = e.options();
  at::Tensor x = at::empty({T, d}, opt), h = at::empty({T, d}, opt), qin;
  float* xp = x.mutable_data_ptr<float>();
  const float* qp = xp;
  int64_t kin = d;
  if (eagle1) {  // fc over [embedding; feature]
    const at::Tensor f = feature.contiguous();
    const int64_t fw = f.size(1);
    at::Tensor cat = at::empty({T, d + fw}, opt);
    float* c = cat.mutable_data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(c + t * (d + fw), e.const_data_ptr<float>() + t * d, sizeof(float) * d);
      std::memcpy(c + t * (d + fw) + d, f.const_data_ptr<float>() + t * fw, sizeof(float) * fw);
    }
    linear_to(c, T, d + fw, *fc, fc_bias, d, xp);
  } else {  // [input_norm(emb); hidden_norm(feature)], the residual stream the feature
    x.copy_(feature);
    at::Tensor a = rms_norm(e, *input_norm, eps), b = rms_norm(x, *hidden_norm, eps);
    qin = at::empty({T, 2 * d}, opt);
    float* c = qin.mutable_data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(c + t * 2 * d, a.const_data_ptr<float>() + t * d, sizeof(float) * d);
      std::memcpy(c + t * 2 * d + d, b.const_data_ptr<float>() + t * d, sizeof(float) * d);
    }
    qp = c, kin = 2 * d;
  }
  LayerWork work(T, d, H, Hkv, D, F, att_rows, opt);
  const std::optional<at::Tensor> bias[4] = {biases.get(0), biases.get(1), biases.get(2), biases.get(3)};
  layer_forward(xp, qp, kin, weights.data(), bias, 0, k_cache, v_cache, gs, cos.const_data_ptr<float>(),
                sin.const_data_ptr<float>(), eps, static_cast<float>(scale), h.mutable_data_ptr<float>(), work);
  const at::Tensor hl = x.index_select(0, logit_index);  // [N, d]
  const bool normed = final_norm.has_value() && final_norm->defined();
  at::Tensor logits = row_linear(normed ? rms_norm(hl, *final_norm, eps) : hl, head, head_bias, vocab);
  if (vocab_ids.has_value() && vocab_ids->defined())
    logits = at::full({logits.size(0), full_vocab}, -INFINITY, opt).index_copy(-1, *vocab_ids, logits);
  return {x, hl, logits};
}

// eagle_steps: an EAGLE head's γ - 1 one-token greedy draft steps of one request after its
// catch-up (EagleDrafter._chain_steps): draft 0 is the argmax of the catch-up's ``logits`` [1, V];
// step j feeds (state h, draft j) at position pos0 + 1 + j (writing its head slot gather[pos]),
// its keys the first S - steps + j + 1 slots of ``gather`` [1, S], masked past its position;
// its output is the next state and draft j + 1 the argmax of its logits -> drafts [1, steps + 1].
at::Tensor eagle_steps(const at::Tensor& logits, const at::Tensor& h0, const at::Tensor& pos0, int64_t steps,
                       const at::Tensor& gather, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& cos_table,
                       const at::Tensor& sin_table, const at::Tensor& embed, int64_t embed_rows,
                       const std::optional<at::Tensor>& fc, const std::optional<at::Tensor>& fc_bias,
                       const std::optional<at::Tensor>& input_norm, const std::optional<at::Tensor>& hidden_norm,
                       at::TensorList weights,
                       const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef dims, double eps,
                       const std::optional<at::Tensor>& final_norm, const at::Tensor& head,
                       const std::optional<at::Tensor>& head_bias, int64_t vocab,
                       const std::optional<at::Tensor>& vocab_ids, int64_t full_vocab, double scale) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == 1 && h0.dim() == 2 && h0.size(0) == 1 && pos0.numel() == 1 &&
                  gather.dim() == 2 && gather.size(0) == 1 && steps >= 0 && gather.size(1) >= steps,
              "specdec::eagle_steps: want one request: logits [1, V], h [1, d], pos0 [1], gather [1, S], got ",
              logits.sizes(), ", ", h0.sizes(), ", ", pos0.sizes(), ", ", gather.sizes());
  const int64_t keys = gather.size(1) - steps, p0 = pos0.reshape({1}).to(at::kLong).item<int64_t>();
  const at::Tensor g = gather.contiguous();
  const auto lopt = at::TensorOptions().dtype(at::kLong);
  at::Tensor drafts = at::empty({1, steps + 1}, lopt);
  const at::Tensor first = at::zeros({1}, lopt), q_index = at::zeros({1, 1}, lopt);
  const std::vector<int64_t> flags = {0, 1}, rows = {1};
  at::Tensor lg = logits, h = h0;
  for (int64_t j = 0;; ++j) {
    const at::Tensor t = std::get<1>(lg.max(-1));  // [1], the first maximum (greedy_tokens)
    drafts.select(1, j).copy_(t);
    if (j == steps) break;
    const int64_t pos = p0 + 1 + j, n = keys + j + 1;
    TORCH_CHECK(pos >= 0 && pos < g.size(1), "specdec::eagle_steps: position ", pos, " outside gather ", g.sizes());
    c10::List<std::optional<at::Tensor>> mask;
    mask.push_back(at::arange(n, lopt).le(pos).view({1, 1, 1, n}));  // (PagedAttend's explicit mask)
    const std::vector<at::Tensor> map = {g.narrow(1, pos, 1).reshape({1})}, slots = {g.narrow(1, 0, n).contiguous()};
    const std::vector<at::Tensor> qi = {q_index}, oi = {first};
    auto out = eagle_forward(t, h, at::full({1}, pos, lopt), k_cache, v_cache, first, map, slots, mask, flags, qi, oi,
                             rows, cos_table, sin_table, embed, embed_rows, fc, fc_bias, input_norm, hidden_norm,
                             weights, biases, dims, eps, final_norm, head, head_bias, vocab, vocab_ids, full_vocab,
                             scale);
    h = std::get<1>(out), lg = std::get<2>(out);
  }
  return drafts;
}

// medusa_forward: Medusa heads (specdec/models/medusa.py, MedusaHeads.forward) in one call: for
// each of the first k heads, y = x, then ``layers`` times y = y + silu(y W_i^T + b_i) (one shared
// block a head), and its logits y U_i^T (own heads), or all heads' through one shared head
// (``heads`` of one) -> [B, k, V]: the eager forward's kernels and order, so its bits.
at::Tensor medusa_forward(const at::Tensor& x, at::TensorList blocks,
                          const c10::List<std::optional<at::Tensor>>& biases, int64_t layers, at::TensorList heads,
                          int64_t vocab) {
  const int64_t k = static_cast<int64_t>(blocks.size());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && static_cast<int64_t>(biases.size()) == k &&
                  (heads.size() == 1 || static_cast<int64_t>(heads.size()) == k),
              "specdec::medusa_forward: want float32 x [B, H], a block and bias a head, one head or one a head; got x ",
              x.sizes(), ", ", k, " blocks, ", heads.size(), " heads");
  const at::Tensor xc = x.contiguous();
  const int64_t B = xc.size(0), d = xc.size(1);
  at::Tensor ys = at::empty({B, k, d}, xc.options());
  at::Tensor out = at::empty({B, k, vocab}, xc.options());
  for (int64_t i = 0; i < k; ++i) {
    at::Tensor y = xc;
    for (int64_t r = 0; r < layers; ++r) y = y + at::silu(row_linear(y, blocks[i], biases.get(i), d));
    if (heads.size() == 1)
      ys.select(1, i).copy_(y);
    else
      out.select(1, i).copy_(row_linear(y, heads[i], std::nullopt, vocab));
  }
  if (heads.size() == 1) out = row_linear(ys.view({B * k, d}), heads[0], std::nullopt, vocab).view({B, k, vocab});
  return out;
}

// decoder_steps: a chain's γ - 1 one-token draft steps of one request, greedy, after its
// catch-up: draft 0 is the argmax of the catch-up's ``logits`` [1, V]; step j feeds draft j at
// ``step_positions[j]`` (writing ``step_slots[j]``), its keys the first S - steps + j + 1 slots
// of ``gather`` [1, S], and draft j + 1 is the argmax of its logits -> drafts [1, steps + 1].
// Each step is decoder_forward of one row (no mask: one request sees all its keys) and the
// argmax is ATen's max(-1), as DraftModelDrafter._chain_steps computes them in Python.
at::Tensor decoder_steps(const at::Tensor& logits, const at::Tensor& step_positions, const at::Tensor& step_slots,
                         const at::Tensor& gather, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& cos_table,
                         const at::Tensor& sin_table, const at::Tensor& embed, int64_t embed_rows,
                         at::TensorList weights,
                         const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef dims, double eps,
                         const at::Tensor& final_norm, const at::Tensor& head,
                         const std::optional<at::Tensor>& head_bias, int64_t vocab, double scale) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == 1 && gather.dim() == 2 && gather.size(0) == 1 &&
                  step_positions.dim() == 2 && step_positions.size(1) == 1 && step_slots.sizes() == step_positions.sizes() &&
                  gather.size(1) >= step_positions.size(0),
              "specdec::decoder_steps: want one request: logits [1, V], step_positions / step_slots [steps, 1], "
              "gather [1, S], got ", logits.sizes(), ", ", step_positions.sizes(), ", ", gather.sizes());
  const int64_t steps = step_positions.size(0), keys = gather.size(1) - steps;
  const auto lopt = at::TensorOptions().dtype(at::kLong);
  at::Tensor drafts = at::empty({1, steps + 1}, lopt);
  const at::Tensor first = at::zeros({1}, lopt), q_index = at::zeros({1, 1}, lopt);
  c10::List<std::optional<at::Tensor>> no_mask;
  no_mask.push_back(std::nullopt);
  const std::vector<int64_t> flags = {0, 1}, rows = {1}, capture = {};
  at::Tensor lg = logits;
  for (int64_t j = 0;; ++j) {
    const at::Tensor t = std::get<1>(lg.max(-1));  // [1], the first maximum (greedy_tokens)
    drafts.select(1, j).copy_(t);
    if (j == steps) break;
    const std::vector<at::Tensor> map = {step_slots[j]}, slots = {gather.narrow(1, 0, keys + j + 1).contiguous()};
    const std::vector<at::Tensor> qi = {q_index}, oi = {first};
    lg = std::get<2>(decoder_forward(t, step_positions[j], k_cache, v_cache, first, map, slots, no_mask, flags, qi, oi,
                                     rows, capture, std::nullopt, cos_table, sin_table, embed, embed_rows, weights,
                                     biases, dims, eps, final_norm, head, head_bias, vocab, scale));
  }
  return drafts;
}

// tree_expand: EAGLE-2's expansion of a dynamic token tree (specdec/spec/tree.py, expand_topk
// with draft_dynamic_tree's frontier callback) in one call, each frontier's forward ``fwd`` native:
// the same ops on the same operands as the Python loop (so its bits), without its host work.
// Level 1 is the top k of log_softmax(root_logits [B, V]); then depth - 1 times the frontier
// (k nodes a request) runs as B*k one-token requests (node_rows): node (b, m) at position
// lens[b] + c (c: the call), its keys its request's context gather[b, :lens[b]], its c ancestors'
// slots, then its own slot tree_slots[b, c*k + m]; it sees keys through its position (and inside
// ``window`` when > 0) by an explicit mask, except one request of one node whose context is exactly
// max_ctx keys (exact_context) that needs none (MaskKind.NONE). fwd(tokens [R], feature [R, d] or
// undefined, positions [R], slot_mapping [R], slots [R, S], masks, single) -> (state [R, d] or
// undefined, logits [R, V]). -> candidates (tokens, parents, scores) [B, k + (depth-1) k^2].
template <class Fwd>
std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_expand(const at::Tensor& root_logits,
                                                           const std::optional<at::Tensor>& root_state,
                                                           const at::Tensor& tree_slots, const at::Tensor& gather,
                                                           const at::Tensor& lens, int64_t max_ctx, int64_t depth,
                                                           int64_t k, bool exact_context, int64_t window, Fwd fwd) {
  const int64_t B = root_logits.size(0);
  TORCH_CHECK(root_logits.dim() == 2 && tree_slots.dim() == 2 && tree_slots.size(0) == B &&
                  tree_slots.size(1) >= (depth - 1) * k && gather.dim() == 2 && gather.size(0) == B &&
                  lens.numel() == B && depth >= 1 && k >= 1,
              "specdec::tree_expand: want root_logits [B, V], tree_slots [B, >= (depth - 1) k], gather [B, S], "
              "lens [B]; got ", root_logits.sizes(), ", ", tree_slots.sizes(), ", ", gather.sizes(), ", ",
              lens.sizes());
  const auto lopt = at::TensorOptions().dtype(at::kLong);
  const at::Tensor ts = tree_slots.to(at::kLong).contiguous(), g = gather.to(at::kLong).contiguous();
  const at::Tensor ln = lens.reshape({B}).to(at::kLong).contiguous();
  const int64_t G = g.size(1), R = B * k, TS = ts.size(1);
  const int64_t *tsp = ts.const_data_ptr<int64_t>(), *gp = g.const_data_ptr<int64_t>();
  const int64_t* lp_ = ln.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lp_[b] >= 1 && lp_[b] <= max_ctx && lp_[b] <= G, "specdec::tree_expand: request ", b,
                "'s context of ", lp_[b], " keys is outside [1, min(max_ctx ", max_ctx, ", gather ", G, ")]");
  auto [score, tok] = at::log_softmax(root_logits.to(at::kFloat), -1).topk(k, -1);  // [B, K]
  std::vector<at::Tensor> toks = {tok}, pars = {at::full({B, k}, -1, lopt)}, scores = {score};
  at::Tensor front_id = at::arange(k, lopt).expand({B, k}), front_parent = at::full({B, k}, -1, lopt);
  int64_t offset = k;
  std::vector<int64_t> anc, prev_anc;  // [R, c] each frontier node's ancestors' slots, root side first
  at::Tensor state;  // [B, K, d] the last frontier's states (what its nodes pass to their children)
  const at::Tensor first = at::arange(R, lopt), q_index = first.view({R, 1});
  const std::vector<int64_t> flags = {0, R == 1}, rows = {R};
  const bool use_mask = window > 0 || !(R == 1 && exact_context);
  for (int64_t c = 0; c + 1 < depth; ++c) {
    const int64_t* fp = front_parent.const_data_ptr<int64_t>();
    prev_anc.swap(anc);
    anc.assign(R * c, 0);
    for (int64_t r = 0; r < R; ++r) {  // the parent's ancestors, then the parent (frontier c - 1's own slot)
      if (c == 0) break;
      const int64_t b = r / k, pr = b * k + fp[r];
      for (int64_t a = 0; a + 1 < c; ++a) anc[r * c + a] = prev_anc[pr * (c - 1) + a];
      anc[r * c + c - 1] = tsp[b * TS + (c - 1) * k + fp[r]];
    }
    at::Tensor feat;
    if (root_state.has_value() && root_state->defined()) {
      const int64_t d = root_state->size(-1);
      feat = c == 0 ? root_state->unsqueeze(1).expand({B, k, d})
                    : state.gather(1, front_parent.unsqueeze(2).expand({-1, -1, d}));
      feat = feat.reshape({R, d});
    }
    const int64_t S = max_ctx + c + 1;
    at::Tensor pos = at::empty({R}, lopt), map = at::empty({R}, lopt), slots = at::empty({R, S}, lopt);
    at::Tensor mask = use_mask ? at::empty({R, 1, 1, S}, at::TensorOptions().dtype(at::kBool)) : at::Tensor();
    int64_t *pp = pos.mutable_data_ptr<int64_t>(), *mp = map.mutable_data_ptr<int64_t>();
    int64_t* sp = slots.mutable_data_ptr<int64_t>();
    bool* mk = use_mask ? mask.mutable_data_ptr<bool>() : nullptr;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t b = r / k, m = r % k, p = lp_[b] + c, own = tsp[b * TS + c * k + m];
      pp[r] = p, mp[r] = own;
      for (int64_t j = 0; j < S; ++j) {
        const int64_t rel = j - lp_[b];
        int64_t slot = rel < 0 ? gp[b * G + std::min(j, G - 1)] : rel < c ? anc[r * c + rel] : own;
        if (use_mask) {  // (PagedAttend: past its position a row reads its first key, masked)
          mk[r * S + j] = j <= p && (window <= 0 || j > p - window);
          if (j > p) slot = gp[b * G];
        }
        sp[r * S + j] = slot;
      }
    }
    c10::List<std::optional<at::Tensor>> masks;
    masks.push_back(use_mask ? std::optional<at::Tensor>(mask) : std::nullopt);
    auto [st, lg] = fwd(tok.reshape({R}), feat, pos, std::vector<at::Tensor>{map}, std::vector<at::Tensor>{slots},
                        masks, flags, std::vector<at::Tensor>{q_index}, std::vector<at::Tensor>{first}, rows);
    if (st.defined()) state = st.view({B, k, -1});
    auto [cs, ct] = at::log_softmax(lg.view({B, k, -1}).to(at::kFloat), -1).topk(k, -1);  // [B, K, K]
    cs = (score.unsqueeze(-1) + cs).reshape({B, k * k});
    ct = ct.reshape({B, k * k});
    toks.push_back(ct), scores.push_back(cs);
    pars.push_back(front_id.unsqueeze(-1).expand({B, k, k}).reshape({B, k * k}));
    const at::Tensor best = std::get<1>(cs.topk(k, -1));  // [B, K] into the K^2 children
    tok = ct.gather(1, best), score = cs.gather(1, best);
    front_parent = best.floor_divide(k).contiguous();
    front_id = best + offset;
    offset += k * k;
  }
  return {at::cat(toks, 1), at::cat(pars, 1), at::cat(scores, 1)};
}

// eagle_tree: an EAGLE head's dynamic tree expansion (tree_expand) from its catch-up's logits
// [B, V] and state h0 [B, d], each frontier one eagle_forward (the head's state passed down).
std::tuple<at::Tensor, at::Tensor, at::Tensor> eagle_tree(
    const at::Tensor& logits, const at::Tensor& h0, const at::Tensor& tree_slots, const at::Tensor& gather,
    const at::Tensor& lens, int64_t max_ctx, int64_t depth, int64_t k, at::Tensor k_cache, at::Tensor v_cache,
    const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& embed, int64_t embed_rows,
    const std::optional<at::Tensor>& fc, const std::optional<at::Tensor>& fc_bias,
    const std::optional<at::Tensor>& input_norm, const std::optional<at::Tensor>& hidden_norm, at::TensorList weights,
    const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef dims, double eps,
    const std::optional<at::Tensor>& final_norm, const at::Tensor& head, const std::optional<at::Tensor>& head_bias,
    int64_t vocab, const std::optional<at::Tensor>& vocab_ids, int64_t full_vocab, double scale) {
  auto fwd = [&](const at::Tensor& t, const at::Tensor& feat, const at::Tensor& pos, const std::vector<at::Tensor>& map,
                 const std::vector<at::Tensor>& slots, const c10::List<std::optional<at::Tensor>>& masks,
                 const std::vector<int64_t>& flags, const std::vector<at::Tensor>& qi,
                 const std::vector<at::Tensor>& oi, const std::vector<int64_t>& rows) {
    auto out = eagle_forward(t, feat, pos, k_cache, v_cache, oi[0], map, slots, masks, flags, qi, oi, rows, cos_table,
                             sin_table, embed, embed_rows, fc, fc_bias, input_norm, hidden_norm, weights, biases, dims,
                             eps, final_norm, head, head_bias, vocab, vocab_ids, full_vocab, scale);
    return std::make_pair(std::get<1>(out), std::get<2>(out));
  };
  return tree_expand(logits, h0, tree_slots, gather, lens, max_ctx, depth, k, false, 0, fwd);
}

// decoder_tree: a draft decoder's dynamic tree expansion (tree_expand) from its catch-up's logits
// [B, V], each frontier one decoder_forward (contexts of exactly max_ctx keys when ``exact_context``).
std::tuple<at::Tensor, at::Tensor, at::Tensor> decoder_tree(
    const at::Tensor& logits, const at::Tensor& tree_slots, const at::Tensor& gather, const at::Tensor& lens,
    int64_t max_ctx, int64_t depth, int64_t k, bool exact_context, int64_t window, at::Tensor k_cache,
    at::Tensor v_cache, const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& embed,
    int64_t embed_rows, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
    at::IntArrayRef dims, double eps, const at::Tensor& final_norm, const at::Tensor& head,
    const std::optional<at::Tensor>& head_bias, int64_t vocab, double scale) {
  const std::vector<int64_t> capture = {};
  auto fwd = [&](const at::Tensor& t, const at::Tensor&, const at::Tensor& pos, const std::vector<at::Tensor>& map,
                 const std::vector<at::Tensor>& slots, const c10::List<std::optional<at::Tensor>>& masks,
                 const std::vector<int64_t>& flags, const std::vector<at::Tensor>& qi,
                 const std::vector<at::Tensor>& oi, const std::vector<int64_t>& rows) {
    auto out = decoder_forward(t, pos, k_cache, v_cache, oi[0], map, slots, masks, flags, qi, oi, rows, capture,
                               oi[0], cos_table, sin_table, embed, embed_rows, weights, biases, dims, eps, final_norm,
                               head, head_bias, vocab, scale);
    return std::make_pair(at::Tensor(), std::get<2>(out));
  };
  return tree_expand(logits, std::nullopt, tree_slots, gather, lens, max_ctx, depth, k, exact_context, window, fwd);
}

// row_linear_timed: the products y_i = x_i W_i^T for i in order (linear_to, as decoder_forward
// runs them), ``passes`` times; the seconds of each, [passes, products] float64. For a kernel
// benchmark (experiments/bench/kernel.py): a forward's projections back to back, no Python
// between them, each timed alone (on a shared machine a short interval's median skips the
// time slices another process took).
at::Tensor row_linear_timed(at::TensorList x, at::TensorList packed, at::IntArrayRef out_features, int64_t passes) {
  TORCH_CHECK(x.size() == packed.size() && x.size() == out_features.size(),
              "specdec::row_linear_timed: want as many x as packed weights and out_features, got ", x.size(), ", ",
              packed.size(), ", ", out_features.size());
  std::vector<at::Tensor> xs, ys;
  for (size_t i = 0; i < x.size(); ++i) {
    TORCH_CHECK(x[i].dim() == 2 && x[i].scalar_type() == at::kFloat && x[i].device().is_cpu(),
                "specdec::row_linear_timed: x[", i, "]: want float32 CPU [rows, in], got ", x[i].sizes());
    xs.push_back(x[i].contiguous());
    ys.push_back(at::empty({x[i].size(0), out_features[i]}, xs.back().options()));
  }
  const int64_t n = static_cast<int64_t>(xs.size());
  at::Tensor secs = at::empty({passes, n}, at::TensorOptions().dtype(at::kDouble));
  double* sp = secs.mutable_data_ptr<double>();
  for (int64_t p = 0; p < passes; ++p) {
    auto t = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < n; ++i) {
      linear_to(xs[i].const_data_ptr<float>(), xs[i].size(0), xs[i].size(1), packed[i], std::nullopt, out_features[i],
                ys[i].mutable_data_ptr<float>());
      const auto u = std::chrono::steady_clock::now();
      sp[p * n + i] = std::chrono::duration<double>(u - t).count();
      t = u;
    }
  }
  return secs;
}

// fma_peak: the CPU's float32 multiply-add peak, GFLOP/s, on torch's threads: each thread runs
// ``iters`` rounds of 12 independent vector FMA chains (enough to cover the FMA latency on
// 2 pipes) — the FLOP roof a projection kernel is measured against (keep a run short, ~0.1 ms,
// and take the best of many on a shared machine).
double fma_peak(int64_t iters) {
  const int threads = at::get_num_threads();
  std::vector<float> sink(threads);
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      vf a[12], m = vf{} + 1.0000001f, c = vf{} + 1e-7f;
      for (int j = 0; j < 12; ++j) a[j] = vf{} + static_cast<float>(j);
      for (int64_t i = 0; i < iters; ++i)
        for (int j = 0; j < 12; ++j) {
          a[j] = a[j] * m + c;
          __asm__("" : "+x"(a[j]));  // keep every FMA
        }
      float s = 0;
      for (int j = 0; j < 12; ++j) s += a[j][0];
      sink[t] = s;
    }
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return 2.0 * L * 12 * static_cast<double>(iters) * threads / secs / 1e9 + 0 * sink[0];
}

}  // namespace

TORCH_LIBRARY(specdec_cpu, m) {
  m.def("row_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("row_linear_pack(Tensor weight) -> Tensor");
  m.def("huge_empty(int nbytes) -> Tensor");
  m.def("fma_peak(int iters) -> float");
  m.def("row_linear_timed(Tensor[] x, Tensor[] packed, int[] out_features, int passes) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor? mask, bool causal, float scale) -> Tensor");
  // (The step's operands first, then the module's: weights, dims, eps, head, vocab, scale.)
  m.def("decoder_forward(Tensor tokens, Tensor positions, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor logit_index, Tensor[] slot_mapping, Tensor[] slots, Tensor?[] masks, int[] flags, "
        "Tensor[] q_index, Tensor[] out_index, int[] group_rows, int[] capture, Tensor? rows, "
        "Tensor cos_table, Tensor sin_table, Tensor embed, int embed_rows, Tensor[] weights, Tensor?[] biases, "
        "int[] dims, float eps, Tensor final_norm, Tensor head, Tensor? head_bias, int vocab, float scale) "
        "-> (Tensor, Tensor, Tensor, Tensor[])");
  m.def("decoder_steps(Tensor logits, Tensor step_positions, Tensor step_slots, Tensor gather, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor cos_table, Tensor sin_table, Tensor embed, int embed_rows, Tensor[] weights, "
        "Tensor?[] biases, int[] dims, float eps, Tensor final_norm, Tensor head, Tensor? head_bias, int vocab, "
        "float scale) -> Tensor");
  m.def("eagle_forward(Tensor tokens, Tensor feature, Tensor positions, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor logit_index, Tensor[] slot_mapping, Tensor[] slots, Tensor?[] masks, int[] flags, Tensor[] q_index, "
        "Tensor[] out_index, int[] group_rows, Tensor cos_table, Tensor sin_table, Tensor embed, int embed_rows, "
        "Tensor? fc, Tensor? fc_bias, Tensor? input_norm, Tensor? hidden_norm, Tensor[] weights, Tensor?[] biases, "
        "int[] dims, float eps, Tensor? final_norm, Tensor head, Tensor? head_bias, int vocab, Tensor? vocab_ids, "
        "int full_vocab, float scale) -> (Tensor, Tensor, Tensor)");
  m.def("eagle_steps(Tensor logits, Tensor h, Tensor pos0, int steps, Tensor gather, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor cos_table, Tensor sin_table, Tensor embed, int embed_rows, Tensor? fc, "
        "Tensor? fc_bias, Tensor? input_norm, Tensor? hidden_norm, Tensor[] weights, Tensor?[] biases, int[] dims, "
        "float eps, Tensor? final_norm, Tensor head, Tensor? head_bias, int vocab, Tensor? vocab_ids, int full_vocab, "
        "float scale) -> Tensor");
  m.def("eagle_tree(Tensor logits, Tensor h, Tensor tree_slots, Tensor gather, Tensor lens, int max_ctx, int depth, "
        "int k, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cos_table, Tensor sin_table, Tensor embed, "
        "int embed_rows, Tensor? fc, Tensor? fc_bias, Tensor? input_norm, Tensor? hidden_norm, Tensor[] weights, "
        "Tensor?[] biases, int[] dims, float eps, Tensor? final_norm, Tensor head, Tensor? head_bias, int vocab, "
        "Tensor? vocab_ids, int full_vocab, float scale) -> (Tensor, Tensor, Tensor)");
  m.def("decoder_tree(Tensor logits, Tensor tree_slots, Tensor gather, Tensor lens, int max_ctx, int depth, int k, "
        "bool exact_context, int window, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cos_table, Tensor sin_table, "
        "Tensor embed, int embed_rows, Tensor[] weights, Tensor?[] biases, int[] dims, float eps, Tensor final_norm, "
        "Tensor head, Tensor? head_bias, int vocab, float scale) -> (Tensor, Tensor, Tensor)");
  m.def("medusa_forward(Tensor x, Tensor[] blocks, Tensor?[] biases, int layers, Tensor[] heads, int vocab) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec_cpu, CompositeExplicitAutograd, m) {
  m.impl("huge_empty", huge_empty);
  m.impl("fma_peak", fma_peak);
}

TORCH_LIBRARY_IMPL(specdec_cpu, CPU, m) {
  m.impl("row_linear", row_linear);
  m.impl("row_linear_pack", pack);
  m.impl("row_linear_timed", row_linear_timed);
  m.impl("rms_norm", rms_norm);
  m.impl("paged_attention", paged_attention);
  m.impl("decoder_forward", decoder_forward);
  m.impl("decoder_steps", decoder_steps);
  m.impl("eagle_forward", eagle_forward);
  m.impl("eagle_steps", eagle_steps);
  m.impl("eagle_tree", eagle_tree);
  m.impl("decoder_tree", decoder_tree);
  m.impl("medusa_forward", medusa_forward);
}
