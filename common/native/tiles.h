// Register-tiled fp32 building blocks shared by the native kernels (GCC/Clang vector
// extensions: AVX2+FMA with -march=native or x86-64-v3, plain SSE otherwise).
#pragma once

#include <cstdint>

namespace tiles {

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned access
typedef int32_t v8i __attribute__((vector_size(32)));

constexpr int64_t kLanes = 8;

inline v8 load(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void store(float* p, v8 x) { *reinterpret_cast<v8u*>(p) = x; }
inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

// Sums of four vectors: {sum a, sum b, sum c, sum d}, with in-lane shuffles (vshufps).
inline void reduce4(v8 a, v8 b, v8 c, v8 d, float* out) {
  const v8i even = {0, 2, 8, 10, 4, 6, 12, 14};
  const v8i odd = {1, 3, 9, 11, 5, 7, 13, 15};
  v8 ab = __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
  v8 cd = __builtin_shuffle(c, d, even) + __builtin_shuffle(c, d, odd);
  v8 s = __builtin_shuffle(ab, cd, even) + __builtin_shuffle(ab, cd, odd);
  // s = [a0123 b0123 c0123 d0123 | a4567 b4567 c4567 d4567]
  for (int j = 0; j < 4; ++j) out[j] = s[j] + s[j + 4];
}

// C[i * ldc + j] = sum_k A_i[k] B_j[k] for MR rows A_i and NR rows B_j (both contiguous in
// k). MR x NR accumulators + MR A registers + one B register fit the 16 vector registers
// for 2 x 6: 8 loads feed 12 FMAs, so the loop is FMA-bound, not load-bound.
template <int MR, int NR>
inline void dot_tile(int64_t K, const float* const* a, const float* const* b, float* c,
                     int64_t ldc) {
  v8 acc[MR][NR] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    v8 av[MR];
    for (int i = 0; i < MR; ++i) av[i] = load(a[i] + k);
    for (int j = 0; j < NR; ++j) {
      const v8 bv = load(b[j] + k);
      for (int i = 0; i < MR; ++i) acc[i][j] += av[i] * bv;
    }
  }
  for (int i = 0; i < MR; ++i) {
    float sums[8];
    for (int j = 0; j < NR; j += 4) {
      const v8 zero = {};
      reduce4(acc[i][j], j + 1 < NR ? acc[i][j + 1] : zero, j + 2 < NR ? acc[i][j + 2] : zero,
              j + 3 < NR ? acc[i][j + 3] : zero, sums + j);
    }
    for (int j = 0; j < NR; ++j) {
      float s = sums[j];
      for (int64_t t = k; t < K; ++t) s += a[i][t] * b[j][t];
      c[i * ldc + j] = s;
    }
  }
}

template <int MR, int NR>
void dot_column(int64_t K, const float* const* a, int64_t M, const float* const* b, float* c,
                int64_t ldc) {
  int64_t i = 0;
  for (; i + MR <= M; i += MR) dot_tile<MR, NR>(K, a + i, b, c + i * ldc, ldc);
  for (; i < M; ++i) dot_tile<1, NR>(K, a + i, b, c + i * ldc, ldc);
}

template <int MR, int R>
void dot_rest(int64_t rest, int64_t K, const float* const* a, int64_t M, const float* const* b,
              float* c, int64_t ldc) {
  if constexpr (R >= 1) {
    if (rest == R)
      dot_column<MR, R>(K, a, M, b, c, ldc);
    else
      dot_rest<MR, R - 1>(rest, K, a, M, b, c, ldc);
  }
}

// C[i * ldc + j] = A_i . B_j for M rows A_i and N rows B_j, in MR x NR register tiles. B is
// the outer loop: a tile's NR B rows stay in L1 while all A rows pass.
template <int MR, int NR>
void dot_rows(int64_t K, const float* const* a, int64_t M, const float* const* b, int64_t N,
              float* c, int64_t ldc) {
  int64_t j = 0;
  for (; j + NR <= N; j += NR) dot_column<MR, NR>(K, a, M, b + j, c + j, ldc);
  dot_rest<MR, NR - 1>(N - j, K, a, M, b + j, c + j, ldc);
}

}  // namespace tiles
