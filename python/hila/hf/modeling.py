# SPDX-License-Identifier: Apache-2.0
"""HilaConfig, HilaCache and HilaForCausalLM: :class:`hila.torch.HilaLM` as a transformers model."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache as _HFCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .._errors import HilaError
from ..torch.cache import Cache as _HilaCacheList
from ..torch.cache import LayerState
from ..torch.checkpoint import lm_config_from_dict, lm_config_to_dict
from ..torch.fla_layers import unpad
from ..torch.models import HilaLM, HilaLMConfig, check_input_ids

__all__ = ["HilaConfig", "HilaCache", "HilaForCausalLM", "HilaPreTrainedModel"]

# transformers renamed the cache argument and output field from past_key_values to cache (5.x)
_CACHE_FIELD = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) \
    else "past_key_values"


class HilaConfig(PretrainedConfig):
    """The configuration of :class:`HilaForCausalLM`: the fields of
    :class:`hila.torch.HilaLMConfig` (``num_layers`` under Hugging Face's name
    ``num_hidden_layers``) and PretrainedConfig's (``bos_token_id``, ``eos_token_id``, ...).

    ``mixer`` is 'hla', 'loglinear_mamba2' or 'loglinear_gdn'; ``mixer_kwargs`` go to the layer
    (e.g. ``dict(num_heads=8, head_dim=64, op='hla2')``); ``max_len`` bounds the sequence length of
    the log-linear layers (prompt + generated tokens).
    """

    model_type = "hila"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    def __init__(self, vocab_size: int = 32000, hidden_size: int = 512, num_hidden_layers: int = 4,
                 mixer: str = "hla", mixer_kwargs: Optional[dict] = None, max_len: int = 2048,
                 mlp_ratio: float = 4.0, norm_eps: float = 1e-5, init_std: float = 0.006,
                 use_cache: bool = True, tie_word_embeddings: bool = False, **kwargs):
        if tie_word_embeddings:
            raise HilaError("hila: argument 'tie_word_embeddings': HilaLM has untied embeddings; "
                            "expected False", "tie_word_embeddings")
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.mixer = mixer
        if mixer_kwargs is not None and not isinstance(mixer_kwargs, dict):
            raise HilaError(f"hila: argument 'mixer_kwargs': expected a dict of the mixer's arguments, got "
                            f"{type(mixer_kwargs).__name__}", "mixer_kwargs")
        self.mixer_kwargs = dict(mixer_kwargs) if mixer_kwargs is not None else {"num_heads": 8}
        self.max_len, self.mlp_ratio, self.norm_eps, self.init_std = max_len, mlp_ratio, norm_eps, init_std
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=False, **kwargs)

    def to_lm_config(self) -> HilaLMConfig:
        return lm_config_from_dict({f: getattr(self, f) for f in lm_config_to_dict(HilaLMConfig())})

    @classmethod
    def from_lm_config(cls, cfg: HilaLMConfig, **kwargs) -> "HilaConfig":
        return cls(**lm_config_to_dict(cfg), **kwargs)


class HilaCacheLayer:
    """One layer's entry of :class:`HilaCache`: its :class:`~hila.torch.LayerState` and the number
    of (padded) columns consumed. Implements what transformers asks of a cache layer."""

    is_compileable = False
    is_sliding = False
    is_croppable = False
    supports_early_init = False

    def __init__(self):
        self.state: Optional[LayerState] = None
        self.seen = 0

    def get_seq_length(self, *args) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, *args) -> tuple:
        return 0, 0

    def lazy_initialization(self, *args, **kwargs) -> None:
        pass

    def reset(self) -> None:
        self.state, self.seen = None, 0

    def _select(self, index: Tensor) -> None:
        if self.state is not None:
            self.state = self.state.select(index.to(self.state.recurrent.H.device))

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self._select(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        self._select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            n = self.state.recurrent.H.shape[0]
            self._select(torch.arange(n).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        raise HilaError("hila: argument 'cache': a recurrent state cannot drop tokens (no crop: "
                        "assisted decoding and DoLa-style rollbacks are not supported)", "cache")

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass


class HilaCache(_HFCache):
    """The transformers cache of :class:`HilaForCausalLM`: per layer the operator state and the
    short-convolution caches (a :class:`~hila.torch.LayerState`), constant-size for the HLA
    operators and O(log T) Fenwick slots for the log-linear ones. The model decodes it in place.

    ``get_seq_length()`` is the number of (padded) columns consumed; beam search reorders rows
    (``reorder_cache``); ``crop`` raises (a recurrent state cannot drop tokens).
    """

    is_compileable = False

    def __init__(self, num_layers: int = 0):
        layers = [HilaCacheLayer() for _ in range(num_layers)]
        try:
            super().__init__(layers=layers)
        except TypeError:  # transformers < 4.56: Cache() takes no layers
            super().__init__()
        self.layers = layers

    def __len__(self) -> int:
        return len(self.layers)

    def get_layer_state(self, layer_idx: int) -> Optional[LayerState]:
        return self.layers[layer_idx].state if layer_idx < len(self.layers) else None

    def set_layer_state(self, layer_idx: int, state: Optional[LayerState], num_tokens: int = 0) -> None:
        while len(self.layers) <= layer_idx:
            self.layers.append(HilaCacheLayer())
        self.layers[layer_idx].state = state
        self.layers[layer_idx].seen += num_tokens

    @property
    def has_state(self) -> bool:
        return bool(self.layers) and all(layer.state is not None for layer in self.layers)

    def get_seq_length(self, layer_idx: int = 0, *args) -> int:
        return self.layers[layer_idx].seen if layer_idx < len(self.layers) else 0

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def reorder_cache(self, beam_idx: Tensor) -> None:
        for layer in self.layers:
            layer.reorder_cache(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        for layer in self.layers:
            layer.batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        for layer in self.layers:
            layer.batch_repeat_interleave(repeats)

    def crop(self, tokens_to_remove: int) -> None:
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def to_hila(self) -> _HilaCacheList:
        """The layers' states as a :class:`hila.torch.Cache` (the same LayerState objects)."""
        return _HilaCacheList([layer.state for layer in self.layers])


class HilaPreTrainedModel(PreTrainedModel):
    config_class = HilaConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["Block"]
    _supports_cache_class = True
    _is_stateful = True

    def _init_weights(self, module: nn.Module) -> None:
        """HilaLM's initialisation: normal(init_std) linear and embedding weights, zero biases, unit
        norm weights; the layers' own parameters (gates, levels, convolutions) keep theirs."""
        std = self.config.init_std
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif "RMSNorm" in type(module).__name__ and getattr(module, "weight", None) is not None:
            nn.init.ones_(module.weight)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own HilaCache


class HilaForCausalLM(HilaPreTrainedModel, GenerationMixin):
    """:class:`hila.torch.HilaLM` as a transformers causal LM: ``AutoModelForCausalLM`` builds it
    from a :class:`HilaConfig`; ``save_pretrained`` / ``from_pretrained``; ``generate`` with the
    standard arguments (``input_ids``, ``attention_mask`` with left padding, ``max_new_tokens``,
    ``do_sample``, ``temperature``, ``top_k``, ``top_p``, beam search, ...).

    A padded batch runs packed: the padding is removed (``cu_seqlens``) so every sequence starts
    at position 0 with a zero state, as if it were alone; the logits are 0 at padded positions.
    Decoding steps the :class:`HilaCache` in place with the fused step kernel (the fast path of
    ``HilaLM.generate``). ``self.model`` is the HilaLM.
    """

    def __init__(self, config: HilaConfig):
        super().__init__(config)
        self.model = HilaLM(config.to_lm_config())
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed = value

    def get_output_embeddings(self) -> nn.Module:
        return self.model.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.model.lm_head = value

    def forward(self, input_ids: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
                cache: Optional[HilaCache] = None, past_key_values: Optional[HilaCache] = None,
                inputs_embeds: Optional[Tensor] = None, labels: Optional[Tensor] = None,
                use_cache: Optional[bool] = None, logits_to_keep: int = 0,
                return_dict: Optional[bool] = None, **kwargs) -> CausalLMOutputWithPast:
        """input_ids [B, T]; attention_mask [B, T_total] (1: token, 0: padding; its last T columns
        cover this call); cache (alias past_key_values) a :class:`HilaCache` to continue; labels
        [B, T] (-100 ignored; padded positions never count). ``logits_to_keep``: logits of the
        last k columns only. Returns loss, logits [B, T or k, vocab] and the cache."""
        if inputs_embeds is not None or input_ids is None:
            raise HilaError("hila: argument 'inputs_embeds': HilaForCausalLM takes input_ids (token "
                            "ids); inputs_embeds are not supported", "inputs_embeds")
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, HilaCache):
            if cache.get_seq_length() != 0:
                raise HilaError(f"hila: argument 'cache': expected a HilaCache, got "
                                f"{type(cache).__name__} holding tokens", "cache")
            cache = None  # an empty cache of another kind: start a HilaCache
        if use_cache is None:
            use_cache = bool(getattr(self.config, "use_cache", True)) and not self.training
        check_input_ids(input_ids, self.config.vocab_size)
        B, T = input_ids.shape
        continuing = cache is not None and cache.has_state
        ids, cu, max_seqlen, indices = input_ids, None, None, None
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
                raise HilaError(f"hila: argument 'attention_mask': expected a [B, >= T] 0/1 padding "
                                f"mask for input_ids {list(input_ids.shape)}, got "
                                f"{list(attention_mask.shape)}", "attention_mask")
            mask = attention_mask[:, attention_mask.shape[1] - T:]
            if not bool((mask != 0).all()):  # one host read: the padded batch runs packed
                if continuing and T == 1:
                    raise HilaError("hila: argument 'attention_mask': a decode step needs a token in "
                                    "every row (pad prompts on the left)", "attention_mask")
                packed, indices, cu, max_seqlen = unpad(input_ids.unsqueeze(-1), mask)
                ids = packed[..., 0]
        keep = None
        if logits_to_keep and labels is None and T > logits_to_keep:
            keep = torch.arange(T - logits_to_keep, T, device=input_ids.device)
        logits_index = keep
        if indices is not None and keep is not None:  # the packed positions of the kept columns
            flat = (torch.arange(B, device=ids.device)[:, None] * T + keep).reshape(-1)
            logits_index = torch.searchsorted(indices, flat).clamp(max=max(indices.numel() - 1, 0))
        out = self.model(ids, cache=cache.to_hila() if continuing else None,
                         use_cache=bool(use_cache), cu_seqlens=cu, max_seqlen=max_seqlen,
                         logits_index=logits_index)
        logits = out.logits
        if indices is not None:
            if keep is None:
                logits = logits.new_zeros(B * T, logits.shape[-1]).index_copy(
                    0, indices, logits[0]).view(B, T, -1)
            else:  # [1, B * k, V] -> [B, k, V], 0 where the column is padding
                real = indices.index_select(0, logits_index) == flat
                logits = torch.where(real[:, None], logits[0], 0).view(B, len(keep), -1)
        loss = None
        if labels is not None:
            target = labels[:, 1:]
            if attention_mask is not None:  # neither a padded target nor a prediction from padding
                m = attention_mask[:, attention_mask.shape[1] - T:] != 0
                target = target.masked_fill(~(m[:, 1:] & m[:, :-1]), -100)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), target.flatten(),
                                   ignore_index=-100)
        new_cache = None
        if use_cache:
            new_cache = cache if cache is not None else HilaCache(len(self.model.blocks))
            for i, st in enumerate(out.cache.layers):
                if not continuing and not torch.is_grad_enabled():
                    st.in_place = True  # the model owns this cache: decode steps advance it in place
                new_cache.set_layer_state(i, st, T)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: new_cache})
        return out if return_dict is not False else out.to_tuple()

    def prepare_inputs_for_generation(self, input_ids: Tensor, cache: Optional[HilaCache] = None,
                                      past_key_values: Optional[HilaCache] = None,
                                      attention_mask: Optional[Tensor] = None,
                                      inputs_embeds: Optional[Tensor] = None,
                                      next_sequence_length: Optional[int] = None, **kwargs) -> dict:
        """The tokens the cache has not consumed yet, with the mask and the cache."""
        cache = cache if cache is not None else past_key_values
        if next_sequence_length is not None:
            input_ids = input_ids[:, input_ids.shape[1] - next_sequence_length:]
        elif isinstance(cache, HilaCache) and cache.get_seq_length() > 0:
            input_ids = input_ids[:, cache.get_seq_length():]
        kwargs.pop("cache_position", None)
        kwargs.pop("position_ids", None)
        return {"input_ids": input_ids.contiguous(), "attention_mask": attention_mask,
                "cache": cache, **kwargs}
