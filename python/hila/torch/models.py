# SPDX-License-Identifier: Apache-2.0
"""A small decoder-only language model built from hila's layers, with cached generation.

Block (as in the log-linear paper's models): ``x + mixer(RMSNorm(x))``, then
``x + GatedMLP(RMSNorm(x))`` (SwiGLU, hidden ratio 4); untied input and output embeddings;
normal init with std 0.006 (zero-free biases, norms at one).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._errors import HilaError
from .cache import Cache
from .checkpoint import load_pretrained, save_pretrained
from .generation import new_token_count, prompt_rows, sample
from .layers import HLAAttention, LogLinearGatedDeltaNet, LogLinearMamba2, _check_sizes
from .ops import _graph_capturable

__all__ = ["HilaLMConfig", "HilaLM", "GatedMLP", "LMOutput"]

MIXERS = {"hla": HLAAttention, "loglinear_mamba2": LogLinearMamba2,
          "loglinear_gdn": LogLinearGatedDeltaNet}


@dataclass
class HilaLMConfig:
    """Configuration of :class:`HilaLM`.

    ``mixer`` is 'hla' (:class:`HLAAttention`), 'loglinear_mamba2' or 'loglinear_gdn';
    ``mixer_kwargs`` go to its constructor (``max_len`` is added for the log-linear mixers and
    for the log-linear HLA operators).
    """

    vocab_size: int = 32000
    hidden_size: int = 512
    num_layers: int = 4
    mixer: str = "hla"
    mixer_kwargs: dict = field(default_factory=lambda: {"num_heads": 8})
    max_len: int = 2048
    mlp_ratio: float = 4.0
    norm_eps: float = 1e-5
    init_std: float = 0.006


def check_input_ids(input_ids, vocab_size: int) -> None:
    """HilaError('input_ids') unless input_ids is an integer tensor [B, T] with (on the CPU, where
    the look is a host read) every id in [0, vocab_size)."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point() or \
            input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise HilaError(f"hila: argument 'input_ids': expected an integer tensor [B, T] of token ids, got "
                        f"{type(input_ids).__name__}{list(input_ids.shape) if isinstance(input_ids, Tensor) else ''}"
                        f"{' of ' + str(input_ids.dtype) if isinstance(input_ids, Tensor) else ''}", "input_ids")
    if input_ids.is_cpu and input_ids.numel() and not torch.compiler.is_compiling():
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab_size:
            raise HilaError(f"hila: argument 'input_ids': expected token ids in [0, {vocab_size}) (vocab_size), "
                            f"got ids in [{lo}, {hi}]", "input_ids")


class LMOutput(NamedTuple):
    logits: Tensor               # [B, T, vocab]
    loss: Optional[Tensor]       # mean next-token cross entropy when labels are given
    cache: Optional[Cache]       # with use_cache=True


class GatedMLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, ratio: float = 4.0):
        super().__init__()
        inner = int(hidden_size * ratio * 2 / 3 + 255) // 256 * 256  # fla's rounding of 8/3 D
        self.gate_up = nn.Linear(hidden_size, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: HilaLMConfig, layer_idx: int):
        super().__init__()
        cls = MIXERS.get(cfg.mixer) if isinstance(cfg.mixer, str) else None
        if cls is None:
            raise HilaError(f"hila: argument 'mixer': expected one of {', '.join(MIXERS)}, got "
                            f"{cfg.mixer!r}", "mixer")
        if not isinstance(cfg.mixer_kwargs, dict):
            raise HilaError(f"hila: argument 'mixer_kwargs': expected a dict of {cls.__name__}'s arguments, "
                            f"got {type(cfg.mixer_kwargs).__name__}", "mixer_kwargs")
        kwargs = dict(cfg.mixer_kwargs)
        known = inspect.signature(cls.__init__).parameters
        unknown = [n for n in kwargs if n not in known or n in ("self", "hidden_size", "layer_idx")]
        if unknown:
            raise HilaError(f"hila: argument 'mixer_kwargs': {cls.__name__} does not take "
                            f"{', '.join(map(repr, unknown))}", "mixer_kwargs")
        if cls is not HLAAttention or str(kwargs.get("op", "")).startswith("loglinear"):
            kwargs.setdefault("max_len", cfg.max_len)
        self.mixer_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mixer = cls(cfg.hidden_size, layer_idx=layer_idx, **kwargs)
        self.mlp_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.mlp_ratio)

    def forward(self, x, state, cu_seqlens, max_seqlen, use_cache, cu_seqlens_cpu=None):
        y, state = self.mixer(self.mixer_norm(x), state, cu_seqlens, max_seqlen, use_cache,
                              cu_seqlens_cpu=cu_seqlens_cpu)
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), state


class HilaLM(nn.Module):
    """Decoder-only language model: embedding, ``num_layers`` blocks, RMSNorm, LM head."""

    def __init__(self, config: HilaLMConfig):
        super().__init__()
        _check_sizes(vocab_size=config.vocab_size, hidden_size=config.hidden_size, max_len=config.max_len)
        if isinstance(config.num_layers, bool) or not isinstance(config.num_layers, int) or config.num_layers < 0:
            raise HilaError(f"hila: argument 'num_layers': expected an int >= 0, got {config.num_layers!r}",
                            "num_layers")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)

    def _init_weights(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=self.config.init_std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, input_ids: Tensor, labels: Optional[Tensor] = None,
                cache: Optional[Cache] = None, use_cache: bool = False,
                cu_seqlens: Optional[Tensor] = None, max_seqlen: Optional[int] = None,
                logits_index: Optional[Tensor] = None,
                cu_seqlens_cpu: Optional[Tensor] = None) -> LMOutput:
        """input_ids [B, T] (B == 1 with packed cu_seqlens [N + 1]; ``cu_seqlens_cpu``, a host copy
        of it, spares the layers' reads of it); labels [B, T] (-100: ignored;
        next-token targets are taken as labels shifted by one, never across packed sequences).
        A ``cache`` continues its N sequences (decode: input_ids [N, 1]). ``logits_index`` (int64
        [K], without labels): the logits of those tokens only, [B, K, vocab]."""
        check_input_ids(input_ids, self.config.vocab_size)
        x = self.embed(input_ids)
        new = Cache.empty(len(self.blocks)) if use_cache else None
        for i, block in enumerate(self.blocks):
            x, st = block(x, cache[i] if cache is not None else None, cu_seqlens, max_seqlen, use_cache,
                          cu_seqlens_cpu)
            if use_cache:
                new[i] = st
        if logits_index is not None:
            x = x.index_select(1, logits_index)
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            target = labels[:, 1:]
            if cu_seqlens is not None:  # the last token of a sequence predicts nothing
                last = torch.zeros(labels.shape[1], dtype=torch.bool, device=labels.device)
                last[(cu_seqlens[1:] - 1).clamp(min=0).long()] = True
                target = target.masked_fill(last[:-1].unsqueeze(0), -100)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), target.flatten(), ignore_index=-100)
        return LMOutput(logits, loss, new)

    @property
    def decode_graph_capturable(self) -> bool:
        """Whether a decode step of this model can be captured in a CUDA graph (every mixer's
        operator's step is capturable: all of them, the log-linear ones through the layers'
        ``max_position``)."""
        return all(_graph_capturable(b.mixer.op) for b in self.blocks)

    @torch.no_grad()
    def generate(self, prompts: Union[None, Tensor, Sequence[Tensor]] = None,
                 max_new_tokens: Optional[int] = None, *, input_ids: Optional[Tensor] = None,
                 attention_mask: Optional[Tensor] = None, max_length: Optional[int] = None,
                 do_sample: Optional[bool] = None, temperature: float = 0.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 eos_token_id: Optional[int] = None,
                 generator: Optional[torch.Generator] = None,
                 cuda_graph: bool = True) -> List[Tensor]:
        """Samples continuations with the decode cache.

        ``prompts``: a [B, T] tensor or a list of 1-D token tensors of any lengths (>= 1); or, as
        Hugging Face passes them, ``input_ids`` [B, T] with ``attention_mask`` (0: padding, either
        side). They are prefilled together as packed sequences (cu_seqlens) and decoded in one
        batch, each at its own position. ``max_length`` (the prompt's padded length included)
        stands for ``max_new_tokens``. Greedy unless ``do_sample`` (or ``temperature > 0``);
        ``top_k`` / ``top_p`` restrict sampling (:func:`hila.torch.generation.sample`). Returns
        the new tokens of each prompt (stopping after ``eos_token_id``). The cache of the prefill
        is generate's own: it is decoded in place (``Cache.in_place``, the fused step kernel, no
        state copy per token). For Hugging Face's ``generate`` use :class:`hila.hf.HilaForCausalLM`.

        The prefill runs with the mixers' ``check_values``; decode steps never scan their inputs.
        ``cuda_graph`` (on CUDA, when :attr:`decode_graph_capturable`): the first decode step runs
        eagerly (it warms up what a capture must not initialise), the second is captured in a CUDA
        graph (one model step: static token buffer in, static logits out, the cache advanced in
        place) and every later step replays it, so a token costs one graph launch of host time.
        ``cuda_graph=False`` and the CPU decode eagerly; both give the same tokens.
        """
        rows = prompt_rows(prompts, input_ids, attention_mask)
        if any(r.numel() == 0 for r in rows):
            raise HilaError("hila: argument 'prompts': expected non-empty prompts", "prompts")
        lens = [r.numel() for r in rows]
        max_new_tokens = new_token_count(
            max_new_tokens, max_length, input_ids.shape[1] if input_ids is not None else max(lens))
        if max(lens) + max_new_tokens > self.config.max_len:
            raise HilaError(f"hila: argument 'max_new_tokens': prompt ({max(lens)}) + new tokens "
                            f"({max_new_tokens}) exceed max_len = {self.config.max_len}", "max_new_tokens")
        device = self.embed.weight.device
        cu_cpu = torch.tensor([0] + lens).cumsum(0)
        cu = cu_cpu.to(device)
        out = self(torch.cat(rows).to(device).unsqueeze(0), cache=None, use_cache=True,
                   cu_seqlens=cu, max_seqlen=max(lens), cu_seqlens_cpu=cu_cpu)
        logits, cache = out.logits[0, cu[1:] - 1], out.cache                          # [N, vocab]
        cache.in_place = True  # generate owns this cache: decode steps advance it in place
        decode = _Decoder(self, cache, graph=bool(cuda_graph) and device.type == "cuda" and
                          self.decode_graph_capturable)
        tokens, done = [], torch.zeros(len(rows), dtype=torch.bool, device=device)
        for i in range(max_new_tokens):
            nxt = sample(logits, do_sample=do_sample, temperature=temperature, top_k=top_k,
                         top_p=top_p, generator=generator)
            tokens.append(nxt)
            if eos_token_id is not None:
                done |= nxt == eos_token_id
                if bool(done.all()):
                    break
            if i + 1 < max_new_tokens:
                logits = decode(nxt)
        new = torch.stack(tokens, 1)                                                   # [N, steps]
        if eos_token_id is None:
            return list(new)
        result = []
        for row in new:
            stop = (row == eos_token_id).nonzero()
            result.append(row[: int(stop[0]) + 1] if len(stop) else row)
        return result

    def save_pretrained(self, path: str) -> None:
        """Writes the model to directory ``path`` in Hugging Face's layout (config.json,
        model.safetensors), loadable by :meth:`from_pretrained` and, after ``import hila.hf``, by
        ``AutoModelForCausalLM.from_pretrained`` (:mod:`hila.torch.checkpoint`)."""
        save_pretrained(self, path)

    @classmethod
    def from_pretrained(cls, path: str, device=None) -> "HilaLM":
        """A model from a directory of :meth:`save_pretrained` or ``HilaForCausalLM.save_pretrained``."""
        return load_pretrained(cls, path, device)


class _Decoder:
    """The decode steps of :meth:`HilaLM.generate` on its in-place cache: ``decoder(ids [N])`` ->
    logits [N, vocab] of the next token. Eager, or (``graph``) the first step eager and the rest
    replays of a CUDA graph of one step captured at the second: the graph reads ``self.ids`` and
    writes ``self.logits`` (static buffers) and advances the cache's tensors in place. The logits
    it returns are overwritten by the next step."""

    def __init__(self, model: HilaLM, cache: Cache, graph: bool):
        self.model, self.cache, self.use_graph = model, cache, graph
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.warm = False
        self.ids: Optional[Tensor] = None
        self.logits: Optional[Tensor] = None

    def step(self, ids: Tensor) -> Tensor:
        return self.model(ids.view(-1, 1), cache=self.cache, use_cache=True).logits[:, -1]

    def __call__(self, ids: Tensor) -> Tensor:
        if not self.use_graph:
            return self.step(ids)
        if self.graph is not None:
            self.ids.copy_(ids.view(-1, 1))
            self.graph.replay()
            return self.logits
        if not self.warm:  # a real step, run on a side stream as torch's graph warm-up asks
            self.warm = True
            dev = ids.device
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                logits = self.step(ids)
            torch.cuda.current_stream(dev).wait_stream(side)
            return logits
        self.ids = ids.view(-1, 1).clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.logits = self.step(self.ids)
        self.graph = graph  # capturing ran nothing: this token is the first replay
        graph.replay()
        return self.logits
