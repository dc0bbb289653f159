// SPDX-License-Identifier: Apache-2.0
// The decode step's kernel: one block per (sequence, column tile, head) runs the stages of
// block.cuh in order (step.cu has the math and the grid).
#include "cuda/dispatch/heuristics.h"
#include "cuda/dispatch/static_switch.h"
#include "cuda/step/inner_p.cuh"
#include "cuda/step/inner_s.cuh"
#include "cuda/step/inputs.cuh"
#include "cuda/step/outer.cuh"
#include "cuda/step/output.cuh"

namespace hila::cuda::decode {

namespace {

template <class T, int kRows, bool kFenwick>
__global__ void __launch_bounds__(kThreads, (kMinBlocks<T, kRows, kFenwick>)) step_kernel(const StepArgs<T> a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  StepBlock<T, kRows, kFenwick> b(a, smem_raw);
  if (b.skip) {  // uniform over the block: no barrier is reached
    b.skipped();
    return;
  }
  b.start_ring();
  b.inputs();
  b.inner_S();
  b.inner_P();
  b.outer();
  b.output();
}

// pos += 1 at the row of every sequence that stepped (StepBlock's skip rule)
__global__ void advance_positions(int64_t* pos, int64_t stride, int N, const int* idx, int64_t idxs, int64_t rows,
                                  int64_t max_pos) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= N) return;
  const int64_t row = idx ? int64_t(idx[i * idxs]) : i;
  if (row < 0 || row >= rows) return;
  const int64_t t = pos[row * stride];
  if (max_pos >= 0 && (t < 0 || t > max_pos)) return;
  pos[row * stride] = t + 1;
}

}  // namespace

template <class T>
void launch_step(const StepArgs<T>& a, dim3 grid, size_t smem, cudaStream_t s) {
  HILA_BOOL_SWITCH(a.fenwick, kFenwick, [&] {
    HILA_STEP_ROWS_SWITCH(heuristics::step_rows(a.dk, kWarps), kRows, [&] {
      auto kernel = step_kernel<T, kRows, kFenwick>;
      if (smem > 48 * 1024) set_smem(kernel, smem);
      kernel<<<grid, kThreads, smem, s>>>(a);
      HILA_CUDA_CHECK_LAUNCH();
    });
  });
}

template <class T>
void launch_advance_positions(const StepArgs<T>& a, cudaStream_t s) {
  advance_positions<<<unsigned((a.N + 255) / 256), 256, 0, s>>>(a.pos, a.poss, a.N, a.idx, a.idxs, a.rows, a.max_pos);
  HILA_CUDA_CHECK_LAUNCH();
}

#define HILA_INSTANTIATE(T)                                                       \
  template void launch_step<T>(const StepArgs<T>&, dim3, size_t, cudaStream_t); \
  template void launch_advance_positions<T>(const StepArgs<T>&, cudaStream_t);
HILA_FOR_EACH_DTYPE(HILA_INSTANTIATE)
#undef HILA_INSTANTIATE

}  // namespace hila::cuda::decode
