// SPDX-License-Identifier: Apache-2.0
// The tree's weighted chunk sums (loglinear/tree.cuh), formed by loglinear_wkv_kernel (sm80 tier,
// tree_sm80.cu) and wkv_sm90_kernel (sm90 tier, wkv_sm90.cu): per item (a node or a part) and head,
//   out[slot] = sum over the chunks N of a range of Xt_N^T diag(w_N) Y_N     fp32 [dk][dv]
//   kZ (one chunk per item):  X = K, Y = V, w = e^{B-b}, slot = node_1 of the chunk.
//   kRead (backward, the read cotangent R of node (m, j) at the levels below split, one node slot
//     per item):  X = Q, Y = dO over the chunks that read the node (j even: [(j+1) 2^{m-1},
//     (j+2) 2^{m-1}); j odd: none, R = 0 and the slot is left unwritten),
//     w = scale lam^{p+m} e^{b + gap}, gap the sum of the totals of the range's earlier chunks.
//   kPart (levels m >= split, a0 = 0): the same over block b of kSplit chunks of a reading range,
//     into slot chunk0 + (m - split) nb + b (nb = ceil(nc / kSplit) blocks per level), gap from
//     the block start; the push-down sums a node's parts.
#pragma once
#include "cuda/gla/gla.cuh"
#include "cuda/loglinear/tree.cuh"

namespace hila::cuda {

// Long reading ranges are summed in parts: levels m >= kSplitLevel (ranges of 2^{m-1} > kSplit
// chunks) take one part per aligned block of kSplit chunks, combined in the push-down.
constexpr int kSplit = 16, kSplitLevel = 6, kSplitBetaLevel = 5;  // node level kSplitBetaLevel spans kSplit chunks
static_assert((1 << (kSplitBetaLevel - 1)) == kSplit && kSplitLevel == kSplitBetaLevel + 1, "split levels");
enum WkvMode { kZ, kRead, kPart };

__device__ __forceinline__ int64_t chunks_of(const int64_t* len, int seq) {
  return (len[seq] + kChunk - 1) / kChunk;
}

// What item `item` of a wkv launch forms: the chunks [c_begin, c_end) of sequence seq (relative to
// the call's first chunk of it) at level m, into `slot`. skip: nothing to write (a spare slot, a
// level summed in parts, an odd node, a part no chunk reads); an empty range writes zeros.
struct WkvItem {
  int seq = 0, m = 1;
  int64_t c_begin = 0, c_end = 0, slot = 0;
  bool skip = false;
};

template <WkvMode kMode, class T>
__device__ __forceinline__ WkvItem wkv_item(const GlaArgs<T>& a, const TreeArgs& ta, int64_t item, int split) {
  WkvItem it;
  it.slot = item;
  if constexpr (kMode == kRead) {
    it.seq = ta.slot_seq ? ta.slot_seq[item] : a.chunk_seq[item >> 1];
    const SeqNodes sn = seq_nodes(ta, a.chunk0, it.seq, chunks_of(a.len, it.seq));
    int64_t u = item - sn.base;
    for (;; ++it.m) {  // node (m, lo_m + u) of the sequence
      const int64_t cnt = sn.count(it.m);
      if (cnt == 0 || it.m >= split) {  // a spare slot, or a level summed in parts
        it.skip = true;
        return it;
      }
      if (u < cnt) break;
      u -= cnt;
    }
    const int64_t j = sn.lo(it.m) + u;
    if (j & 1) {  // read by the chunks N with N >> (m-1) = j + 1 and bit m-1 set: none (R = 0)
      it.skip = true;
      return it;
    }
    // the reading chunks of the call (relative): [(j+1) 2^{m-1}, (j+2) 2^{m-1}) from a0 on
    it.c_begin = max(int64_t((j + 1) << (it.m - 1)), sn.a0) - sn.a0;
    it.c_end = min(int64_t((j + 2) << (it.m - 1)), sn.a0 + sn.nc) - sn.a0;
  } else if constexpr (kMode == kPart) {
    it.seq = a.chunk_seq[item];
    const int64_t nc = chunks_of(a.len, it.seq), nb = (nc + kSplit - 1) / kSplit, u = item - a.chunk0[it.seq];
    it.m = split + int(u / nb);
    it.c_begin = (u % nb) * kSplit;
    it.skip = it.m > bitlen64u(uint64_t(nc)) || !((it.c_begin >> (it.m - 1)) & 1);  // no such level / not read
    it.c_end = min(it.c_begin + kSplit, nc);
  } else {
    it.seq = a.chunk_seq[item];
    it.c_begin = item - a.chunk0[it.seq], it.c_end = it.c_begin + 1;
    const SeqNodes sn = seq_nodes(ta, a.chunk0, it.seq, chunks_of(a.len, it.seq));
    it.slot = sn.slot(1, sn.a0 + it.c_begin);
  }
  return it;
}

// The sm90 tier of the backward's sums (kRead, kPart) for dk and dv multiples of 64: false (nothing
// launched) where this device does not run the build's sm_90a code or TMA cannot describe q and dO;
// the caller then runs loglinear_wkv_kernel. items: node slots (kRead) or nchunks (kPart).
template <class T>
bool loglinear_wkv_sm90(const GlaArgs<T>& a, const TreeArgs& ta, WkvMode mode, float* out, int split, int64_t items,
                        cudaStream_t stream);

}  // namespace hila::cuda
