# SPDX-License-Identifier: Apache-2.0
"""Hugging Face transformers integration (needs ``pip install 'hila[hf]'``, i.e. transformers).

Importing this module registers the model type ``hila`` with ``AutoConfig`` and
``AutoModelForCausalLM``::

    import hila.hf
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(hila.hf.HilaConfig(vocab_size=32000, hidden_size=512,
        num_hidden_layers=4, mixer="hla", mixer_kwargs=dict(num_heads=8, op="hla2")))
    model.save_pretrained("ckpt"); model = AutoModelForCausalLM.from_pretrained("ckpt")
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=32, do_sample=True, top_p=0.9)

* :class:`HilaConfig` (``PretrainedConfig``), :class:`HilaForCausalLM` (``PreTrainedModel`` +
  ``GenerationMixin``, wrapping :class:`hila.torch.HilaLM` as ``.model``), :class:`HilaCache`
  (a transformers ``Cache`` of the layers' recurrent and convolution states).
* Checkpoints are interchangeable with ``HilaLM.save_pretrained`` / ``HilaLM.from_pretrained``.
"""
try:
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("hila.hf needs transformers: pip install 'hila[hf]' (or pip install "
                      "transformers)") from exc

from transformers import AutoConfig, AutoModelForCausalLM

from .modeling import HilaCache, HilaConfig, HilaForCausalLM, HilaPreTrainedModel

AutoConfig.register(HilaConfig.model_type, HilaConfig, exist_ok=True)
AutoModelForCausalLM.register(HilaConfig, HilaForCausalLM, exist_ok=True)

__all__ = ["HilaCache", "HilaConfig", "HilaForCausalLM", "HilaPreTrainedModel"]
