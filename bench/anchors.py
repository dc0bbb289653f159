# SPDX-License-Identifier: Apache-2.0
"""Anchors timed in the same run as hila: ceilings (bf16 GEMM, device-to-device copy), torch SDPA
(flash and cuDNN backends, causal) and fla's chunk_simple_gla, chunk_log_linear_attn and
chunk_gated_delta_rule (sections fla, fla_loglinear, fla_gdn). CSV rows on stdout:
impl,op,dtype,B,T,H,d,direction,ms,dk,G   (ceilings: impl=ceiling, op=gemm_tflops|copy_tbps, ms=value;
d is the value head dim dv, dk the key head dim, G the q/k groups).
fla's gated backward is refused on Hopper with Triton < 3.7.1 (wrong gradients); when the installed
Triton is older, the guard is lifted so that its *speed* can be measured, and the rows say so
(impl=fla_guard_lifted)."""
import argparse
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench


def ms_of(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def row(impl, op, B, T, H, d, direction, ms, dk=None, G=None):
    print(f"{impl},{op},bf16,{B},{T},{H},{d},{direction},{ms:.4f},{d if dk is None else dk},{H if G is None else G}",
          flush=True)


def ceilings():
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = ms_of(lambda: a @ b)
    row("ceiling", "gemm_tflops", n, n, n, 0, "-", 2 * n**3 / ms / 1e9)
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = ms_of(lambda: y.copy_(x))
    row("ceiling", "copy_tbps", 0, 0, 0, 0, "-", 2 * x.numel() / ms / 1e9)


def sdpa(shapes, H, d):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for name, be in [("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)]:
        for B, T in shapes:
            q, k, v = [torch.randn(B, H, T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
            do = torch.randn_like(q)
            with sdpa_kernel(be):
                row(name, "softmax", B, T, H, d, "fwd", ms_of(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)))

                def fb():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
                row(name, "softmax", B, T, H, d, "fwdbwd", ms_of(fb))
            del q, k, v, do
            torch.cuda.empty_cache()


_FLA_IMPL = []


def fla_impl():
    """'fla', or 'fla_guard_lifted' after lifting fla's Hopper guard on Triton < 3.7.1 (speed only).
    Decided once per process: every fla row of a run carries the same label."""
    if not _FLA_IMPL:
        import fla.ops.common.chunk_o as chunk_o
        if getattr(chunk_o, "TRITON_ABOVE_3_7_1", True):
            _FLA_IMPL.append("fla")
        else:
            chunk_o.TRITON_ABOVE_3_7_1 = True  # see the module docstring
            _FLA_IMPL.append("fla_guard_lifted")
    return _FLA_IMPL[0]


def fla_gla(shapes, H, d):
    from fla.ops.simple_gla import chunk_simple_gla
    impl = fla_impl()
    for B, T in shapes:
        q = torch.randn(B, T, H, d, device="cuda", dtype=torch.bfloat16) * d**-0.5
        k = torch.randn(B, T, H, d, device="cuda", dtype=torch.bfloat16) * d**-0.5
        v = torch.randn(B, T, H, d, device="cuda", dtype=torch.bfloat16)
        g = torch.empty(B, T, H, device="cuda").uniform_(-0.105, 0.0)
        for t in (q, k, v, g):
            t.requires_grad_()
        do = torch.randn_like(v)
        with torch.no_grad():
            row(impl, "gla", B, T, H, d, "fwd", ms_of(lambda: chunk_simple_gla(q, k, v, g, scale=d**-0.5)))

        def fb():
            chunk_simple_gla(q, k, v, g, scale=d**-0.5)[0].backward(do)
        row(impl, "gla", B, T, H, d, "fwdbwd", ms_of(fb))


def _fla_fb(impl, op, B, T, H, dk, dv, G, fwd, leaves, out_like):
    """Time fwd (no grad) and fwd+bwd of fla call `fwd` (returns (o, ...))."""
    do = torch.randn_like(out_like)
    with torch.no_grad():
        row(impl, op, B, T, H, dv, "fwd", ms_of(fwd), dk, G)

    def fb():
        fwd()[0].backward(do)
    for t in leaves:
        t.requires_grad_()
    row(impl, op, B, T, H, dv, "fwdbwd", ms_of(fb), dk, G)


def fla_loglinear(shapes, H, dk, dv):
    """fla chunk_log_linear_attn (one q/k group, as fla's kernels require), level_scales with the
    levels the length needs; scale 1 as in fla."""
    from fla.ops.log_linear_attn import chunk_log_linear_attn
    for B, T in shapes:
        L = max(1, (T - 1).bit_length() + 1)
        q = torch.randn(B, T, 1, dk, device="cuda", dtype=torch.bfloat16) * dk**-0.5
        k = torch.randn(B, T, 1, dk, device="cuda", dtype=torch.bfloat16) * dk**-0.5
        v = torch.randn(B, T, H, dv, device="cuda", dtype=torch.bfloat16)
        g = torch.empty(B, T, H, device="cuda").uniform_(-0.105, 0.0)
        lam = torch.rand(B, T, H, L, device="cuda", dtype=torch.bfloat16)
        _fla_fb(fla_impl(), "loglinear", B, T, H, dk, dv, 1, lambda: chunk_log_linear_attn(q, k, v, g, lam),
                (q, k, v, g, lam), v)
        del q, k, v, g, lam
        torch.cuda.empty_cache()


def fla_gdn(shapes, H, dk, dv):
    """fla chunk_gated_delta_rule (l2-normalised q, k in the kernel, beta in (0, 1))."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    for B, T in shapes:
        q = torch.randn(B, T, H, dk, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, T, H, dk, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, T, H, dv, device="cuda", dtype=torch.bfloat16)
        g = torch.empty(B, T, H, device="cuda").uniform_(-0.105, 0.0)
        beta = torch.rand(B, T, H, device="cuda", dtype=torch.bfloat16)
        _fla_fb(fla_impl(), "gdn", B, T, H, dk, dv, H,
                lambda: chunk_gated_delta_rule(q, k, v, g, beta, scale=dk**-0.5, use_qk_l2norm_in_kernel=True),
                (q, k, v, g, beta), v)
        del q, k, v, g, beta
        torch.cuda.empty_cache()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="32:1024,8:4096,2:16384,1:65536")
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--dk", type=int, default=0, help="key head dim of the fla_loglinear / fla_gdn rows (default d)")
    ap.add_argument("--dv", type=int, default=0, help="value head dim of the fla_loglinear / fla_gdn rows (default d)")
    ap.add_argument("sections", nargs="*", default=["ceil", "sdpa", "fla"])
    a = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split(":")) for s in a.shapes.split(",")]
    print("impl,op,dtype,B,T,H,d,direction,ms,dk,G", flush=True)
    dk, dv = a.dk or a.d, a.dv or a.d
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", file=sys.stderr)
    for s in a.sections:
        try:
            {"ceil": ceilings, "sdpa": lambda: sdpa(shapes, a.H, a.d), "fla": lambda: fla_gla(shapes, a.H, a.d),
             "fla_loglinear": lambda: fla_loglinear(shapes, a.H, dk, dv), "fla_gdn": lambda: fla_gdn(shapes, a.H, dk, dv)}[s]()
        except Exception as e:  # a missing anchor is reported, not fatal
            print(f"# section {s} failed: {e!r}"[:300], file=sys.stderr)
