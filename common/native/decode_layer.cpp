// A decode layer's pieces between its input and its attention kernel, in one native call
// (fp32, CPU): the input RMSNorm, the query projection(s), the latent and rope projections,
// both rotary embeddings, the latent RMSNorm and the write of the new token into the cache.
//
// Why native: at decode batch sizes this is a few small GEMVs, but as PyTorch it is ~45
// dispatched ops per layer (two 9-op RMSNorms, three linears, two 10-op rotary embeddings,
// the cache write's mask and index ops), and each op's fixed cost exceeds its work: the demo
// model's step at batch 1 spent ~1 ms of ~3.8 ms in such ops (torch.profiler, 100 steps).
// Also here: a plain RMSNorm over rows (the post-attention and final norms), one op for nine.
//
// The reference is the PyTorch path it replaces: `RankAttention.queries` / `new_latent`
// (services/decode/rank/layers.py), `PagedLatentCache.write` and `RMSNorm.forward`;
// tests/unit/common/native/test_decode_layer.py checks them against it.

#include <cmath>
#include <cstdint>
#include <vector>

#include "tiles.h"

namespace {

using namespace tiles;

float sum_squares(const float* x, int64_t D) {
  v8 acc = {};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    const v8 v = load(x + d);
    acc += v * v;
  }
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += acc[i];
  for (; d < D; ++d) s += x[d] * x[d];
  return s;
}

// y = w * (x * rsqrt(mean(x^2) + eps)) for M rows of D, as RMSNorm.forward in fp32 (the
// weight multiplies after the normalization there too).
void rms_norm(const float* x, const float* w, float* y, int64_t M, int64_t D, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * D;
    float* yr = y + m * D;
    const float r = 1.0f / std::sqrt(sum_squares(xr, D) / static_cast<float>(D) + eps);
    for (int64_t d = 0; d < D; ++d) yr[d] = w[d] * (xr[d] * r);
  }
}

// One rotary embedding of d_r values (common/model/rope.py): [x1 cos - x2 sin | x2 cos +
// x1 sin], x1 / x2 the even / odd elements (interleaved checkpoints) or the two halves.
void rope(const float* x, const float* cos, const float* sin, float* out, int64_t dr,
          bool interleaved) {
  const int64_t half = dr / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = interleaved ? x[2 * i] : x[i];
    const float x2 = interleaved ? x[2 * i + 1] : x[half + i];
    out[i] = x1 * cos[i] - x2 * sin[i];
    out[half + i] = x2 * cos[i] + x1 * sin[i];
  }
}

struct Scratch {
  std::vector<const float*> rows;
  std::vector<float> x, qa, q, lat, pe;
};

thread_local Scratch tls_scratch;

}  // namespace

extern "C" {

// y [M, D] = RMSNorm(x [M, D]) with weight w [D]. Returns 0.
int tpla_rms_norm(const float* x, const float* w, float* y, int64_t M, int64_t D, float eps) {
  rms_norm(x, w, y, M, D, eps);
  return 0;
}

// One layer's attention inputs for B new tokens; the arguments travel as three arrays (a
// ctypes call converts each argument, and this runs per layer per step).
//   tensors: h [B, D], norm [D], q_a [R, D] (null: no query low-rank), q_a_norm [R],
//            q_b [H * (d_n + d_r), R or D], kv_latent [C, D], kv_rope [d_r, D],
//            kv_norm [width] (the gamma of the cached columns), cos [B, d_r / 2],
//            sin [B, d_r / 2], cache [slots, width + d_r] (one layer), write_slots [B] int64,
//            q_nope [B, H, d_n] (out), q_pe [B, H, d_r] (out)
//   dims:    B, D, R, H, d_n, d_r, C, latent_offset, width, slots, interleaved
//   scalars: eps (input norm), q_a_eps, kv_eps, rms_correction
// The latent is normalized over its C computed columns and columns [latent_offset,
// latent_offset + width) are cached: exact TPLA computes all d_c (offset = the slice's start,
// correction 1), sliced TPLA only its slice (offset 0, rms divided by the correction).
// A write slot of -1 writes nothing (SP: another rank owns the token).
// Errors: 0 ok; 1 a write slot outside [-1, slots), checked before any work.
int tpla_attention_inputs(void* const* tensors, const int64_t* dims, const float* scalars) {
  const int64_t B = dims[0], D = dims[1], R = dims[2], H = dims[3], dn = dims[4], dr = dims[5];
  const int64_t C = dims[6], offset = dims[7], width = dims[8], slots = dims[9];
  const bool interleaved = dims[10] != 0;
  const float eps = scalars[0], q_a_eps = scalars[1], kv_eps = scalars[2];
  const float correction = scalars[3];
  const auto* write_slots = static_cast<const int64_t*>(tensors[11]);
  for (int64_t b = 0; b < B; ++b)
    if (write_slots[b] < -1 || write_slots[b] >= slots) return 1;
  const auto* h = static_cast<const float*>(tensors[0]);
  const auto* norm = static_cast<const float*>(tensors[1]);
  const auto* q_a = static_cast<const float*>(tensors[2]);
  const auto* q_a_norm = static_cast<const float*>(tensors[3]);
  const auto* q_b = static_cast<const float*>(tensors[4]);
  const auto* kv_latent = static_cast<const float*>(tensors[5]);
  const auto* kv_rope = static_cast<const float*>(tensors[6]);
  const auto* kv_norm = static_cast<const float*>(tensors[7]);
  const auto* cos = static_cast<const float*>(tensors[8]);
  const auto* sin = static_cast<const float*>(tensors[9]);
  auto* cache = static_cast<float*>(tensors[10]);
  auto* q_nope = static_cast<float*>(tensors[12]);
  auto* q_pe = static_cast<float*>(tensors[13]);

  Scratch& s = tls_scratch;
  const int64_t qk = dn + dr, half = dr / 2;
  s.x.resize(B * D);
  s.q.resize(B * H * qk);
  s.lat.resize(B * C);
  s.pe.resize(B * dr);
  rms_norm(h, norm, s.x.data(), B, D, eps);
  const float* q_in = s.x.data();
  int64_t q_in_width = D;
  if (q_a != nullptr) {
    s.qa.resize(B * R);
    linear(s.x.data(), q_a, s.qa.data(), B, R, D, s.rows);
    rms_norm(s.qa.data(), q_a_norm, s.qa.data(), B, R, q_a_eps);
    q_in = s.qa.data();
    q_in_width = R;
  }
  linear(q_in, q_b, s.q.data(), B, H * qk, q_in_width, s.rows);
  linear(s.x.data(), kv_latent, s.lat.data(), B, C, D, s.rows);
  linear(s.x.data(), kv_rope, s.pe.data(), B, dr, D, s.rows);

  for (int64_t b = 0; b < B; ++b) {
    const float* cb = cos + b * half;
    const float* sb = sin + b * half;
    for (int64_t hd = 0; hd < H; ++hd) {
      const float* q = s.q.data() + (b * H + hd) * qk;
      std::copy(q, q + dn, q_nope + (b * H + hd) * dn);
      rope(q + dn, cb, sb, q_pe + (b * H + hd) * dr, dr, interleaved);
    }
    if (write_slots[b] < 0) continue;
    const float* lat = s.lat.data() + b * C;
    const float r =
        1.0f / (std::sqrt(sum_squares(lat, C) / static_cast<float>(C) + kv_eps) * correction);
    float* row = cache + write_slots[b] * (width + dr);
    for (int64_t c = 0; c < width; ++c) row[c] = kv_norm[c] * (lat[offset + c] * r);
    rope(s.pe.data() + b * dr, cb, sb, row + width, dr, interleaved);
  }
  return 0;
}

}  // extern "C"
