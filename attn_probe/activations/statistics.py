"""Attention health from the activations: measured max logit and entropy per layer and head.

The weight metrics bound what the attention logits *could* be; this module measures what they
*are*, on the steps a caller arms, from the q and k that the model's attention function
receives (transformers' ``ALL_ATTENTION_FUNCTIONS`` interface: after rotary embeddings, keys
before grouped-query repetition, with the model's own ``scaling``), or, for modules that call
``torch.nn.functional.scaled_dot_product_attention`` themselves, that call receives
(:mod:`attn_probe.activations.sdpa`; masks: :mod:`attn_probe.activations.masks`).

For query head ``h`` (key head ``g(h) = h // (H / H_kv)``), batch row ``b``, query ``i`` and
key ``j`` the logit is

.. math::  \\ell_{bhij} = s \\, q_{bhi} \\cdot k_{b\\,g(h)\\,j}

with ``s`` the ``scaling`` passed to the function (``head_dim ** -0.5`` when it is ``None``).
Over the *counted* entries (key ``j`` not masked for ``(b, i)``, query token ``(b, i)`` not
padding, at least one key visible) the two metrics are as follows. Padding queries are read
from the 2D ``attention_mask`` the model was called with (``decoder_attention_mask`` for
decoder and cross-attention layers), captured by a forward pre-hook on the model while armed;
without a 2D mask every query token counts.

- ``max_logit[h] = max |l_bhij|``; the layer value is the max over heads;
- ``signed_max[h] = max l_bhij`` (signed, the same entries and logits: MuonClip's ``S_max``,
  from which :mod:`attn_probe.live.stages.qk_clip` derives the QK-clip dry run);
- ``entropy[h]``: the mean over counted query tokens of ``-sum_j p_bhij log p_bhij`` (nats),
  ``p = softmax_j(z)`` over the visible keys; the layer value is the mean over heads.

``max_logit`` is the content logit ``s q.k``: attention softcapping is *not* applied to it
(it reports what the cap is holding back), and additive position biases (T5's
``position_bias``, finite non-zero entries of an additive float mask such as ALiBi) are *not*
added. ``entropy`` is the entropy of the distribution the model actually uses:
``z = cap * tanh(l / cap)`` under softcapping, plus the additive biases, and attention sinks
(``s_aux``, gpt-oss) count as one more outcome of the softmax (the row's probabilities over
real keys then sum to less than 1). Sliding windows, chunked attention and packed sequences
are whatever the mask passed to the function says (eager/sdpa; sdpa's ``None`` mask is causal,
upper-left, when the call is causal and ``q_len > 1``); under flash attention the mask is rebuilt
from causality (bottom-right), ``sliding_window``, ``cu_seq_lens_q``/packed ``position_ids`` and
the 2D padding mask (other patterns, e.g. chunked attention, are not rebuilt there).
Direct ``flex_attention`` calls (a ``BlockMask``) are measured from flex's operator
(:mod:`attn_probe.activations.flex`: content logits for the maxima, ``score_mod`` in the entropy;
eager calls always, calls inside a compiled graph with ``flex_compiled``); transformers' ``flex_attention``
implementation, paged attention and user-registered implementation names are not measured
(:func:`unavailable_reason` says so).

**Memory and cost.** Logits are formed ``C`` query positions at a time, ``C = max(1,
chunk_elements // (B * H * L_k))``: a due forward holds at most about six ``(B, H, C, L_k)``
float32 buffers (float64 for float64 models) and two boolean masks of that shape, i.e. about
``26 * max(chunk_elements, B H L_k)`` bytes (104 MiB at the default ``chunk_elements = 2**22``),
on the attention's device, freed per chunk; plus a float32 copy of q and k. A call with no mask
beyond causality (no padding, bias, softcap or sinks: the usual sdpa/flash call) takes the plain
path of :mod:`attn_probe.activations.logits`: two such buffers, no boolean mask but each chunk's
diagonal block, logits against the visible keys only, and above ``entropy_rows`` query rows the
entropy on a sample of rows (``max_logit`` exact); ``docs/performance.md`` has the measured cost.

**Steps.** Everything observed between :meth:`AttentionCapture.arm` and :meth:`disarm
<AttentionCapture.disarm>` is one step: with gradient accumulation, several forwards add up
(max over all of them, entropy averaged over all their counted tokens), so the step's values
equal one forward on the concatenated batch. Only calls inside a forward of the watched model
entered with gradients enabled count (``training_only``, the probe's rule): not ``no_grad``/
``inference_mode`` passes (evaluation, ``generate()``, preference trainers' reference passes),
nor a checkpointed block re-run inside backward (outside any forward of the model); blocks
that reentrant checkpointing runs under ``no_grad`` inside a training forward count once.
:func:`combine` reduces a step over ranks (max for the logits and input norms, sum for the
entropy sums and token counts), so combined values equal one process on the global batch.

**Near zero cost otherwise, harmless to other models.** ``AttentionInterface.get_interface`` is
wrapped while a capture exists: for a measured implementation name it returns the function
transformers resolved (for ``eager`` the module's own default) behind a check of one tuple
(the armed captures); an unwatched module gets exactly that function. The capture's hooks are
registered once, at construction, and removed at :meth:`AttentionCapture.close`; unarmed each
returns at its first check; nothing else is written into the model, its config or the registry. That glue lives in
:mod:`attn_probe.activations.registry` (which also says which models can be read,
:func:`unavailable_reason`); this module holds the statistics (pure tensor functions) and the
capture, which uses the glue through its small interface (acquire/release, arm/disarm, and
the capture's :meth:`AttentionCapture.observe`). The capture calls :func:`logit_stats` through
this module's attribute at call time, so a test may replace ``attention_stats.logit_stats``.

**The reading, checked once** (``layout_check=True``): :mod:`attn_probe.activations.layout`.

**torch.compile.** The decision is data the compiler guards on, not state it must trace: the
armed tuple, the capture's armed flag and the hooks (the same objects, with the same ids, at every
step) are guarded, the accumulators are preallocated tensors updated in place, so a compiled
forward has the graphs of a run without the probe when not armed and one more variant (compiled
at the first armed call, then reused, whatever the number of armed steps) when armed.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..extraction.architectures import unwrap
from ..extraction.base import AttentionLayer
from ..hooks import ProbeHook
from ..isolation import Failures, safe_warn
from . import registry as registry
from .flex import block_mask_reader, compiled_ops, take_failures
from .flex_capture import FlexCalls
from .layout import LayoutWatch
from .logits import DEFAULT_CHUNK_ELEMENTS, DEFAULT_ENTROPY_ROWS, autocast_off, logit_stats_impl
from .masks import RowMask, row_mask
from .registry import installed_wrappers
from .sdpa import SdpaMode, measured_by_sdpa, running_hooks, sdpa_call, unavailable_reason
from .steps import StepStats, combine, logit_bound_ratio  # noqa: F401  (their documented home before the split)

Tensor = torch.Tensor

#: the activation metrics this module measures, in table order
ATTENTION_METRICS: tuple[str, ...] = ("max_logit", "entropy")


# ---------------------------------------------------------------------------------------------
# The statistics (pure functions: tensors in, tensors out)
# ---------------------------------------------------------------------------------------------

def logit_stats(
    query: Tensor,
    key: Tensor,
    scaling: float,
    rows: RowMask | None = None,
    *,
    query_valid: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    entropy_rows: int | None = None,
    entropy_seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per query head ``(max |l|, sum of row entropies, counted tokens, max l)`` of one attention call.

    ``query (B, H, Lq, D)``, ``key (B, H_kv, Lk, D)`` (before ``repeat_kv``); ``rows(r0, r1)``
    gives the visible keys (and additive bias) of query rows ``r0:r1``; ``query_valid (B, Lq)``
    marks non-padding queries. Returns four ``(H,)`` tensors of the accumulation dtype
    (float64 for float64 inputs, float32 otherwise): ``-inf`` maxima where nothing is counted.
    ``entropy_rows``: above that many query rows, a call without padding, mask, bias, softcap or
    sinks averages the entropy over a systematic sample of about that many rows (``entropy_seed``
    picks its start; :mod:`attn_probe.activations.logits` states the error bound); ``None``: every
    row. The maxima always read every row.
    """
    # the caller's autocast (Trainer/TRL bf16=True) would run the matmuls below in bfloat16 and
    # round max |l| to 8 bits of mantissa: the statistics are float32 (float64 for float64 inputs)
    with autocast_off(query.device.type):
        return logit_stats_impl(query, key, scaling, rows, query_valid=query_valid, softcap=softcap, sinks=sinks,
                                chunk_elements=chunk_elements, entropy_rows=entropy_rows, entropy_seed=entropy_seed)


class AttentionCapture(FlexCalls):
    """Measures ``max_logit`` and ``entropy`` of ``layers`` (from :func:`find_attention`) while armed.

    Construction wraps, for the implementation names the layers use, what transformers'
    ``AttentionInterface.get_interface`` returns (shared and reference-counted across captures,
    restored by the last :meth:`close`) and registers the hooks, once (a forward pre-hook and an
    always-called forward hook on the model, for the forward's grad mode and 2D padding masks, and
    a pre-hook on each attention module for its input norm; :class:`~attn_probe.hooks.ProbeHook` s,
    inert in a copy of the model; :meth:`_install`). :meth:`arm` starts a step (zeroes the
    accumulators, switches the hooks on), :meth:`disarm` ends it (the hooks stay, doing nothing),
    :meth:`collect` returns the step's :class:`StepStats`, :meth:`close` removes the hooks. Raises
    ``ValueError`` with :func:`unavailable_reason`'s line when the model cannot be measured.
    ``entropy_rows`` (default :data:`~attn_probe.activations.logits.DEFAULT_ENTROPY_ROWS`; ``None``:
    every row) is :func:`logit_stats`'s, the layer index seeding the sample.

    Which forwards count: with ``training_only`` (the probe's rule, ``docs/scores.md``) the
    calls inside a forward of ``model`` entered with gradients enabled (the forwards that
    produce the update, including blocks that reentrant gradient checkpointing runs under
    ``no_grad`` inside it); never calls outside a forward of ``model`` (a checkpointed block
    re-run in backward). Without it, also forwards under ``no_grad``/``inference_mode``.
    A failure while measuring costs that step's values of the layer: ``failures`` (a
    :class:`~attn_probe.isolation.Failures`) counted once per step it happens in, and one warning
    per capture (:func:`~attn_probe.isolation.safe_warn`) at the first failure; with
    ``warn_failures=False`` the capture only records them (:attr:`failed_calls`,
    :attr:`failed_layers`, :attr:`first_failure` of the step; :attr:`failed_calls_total`) and its
    owner warns, once, with the step's count (the probe's attention stage).
    """

    def __init__(self, model: nn.Module, layers: Sequence[AttentionLayer], *,
                 chunk_elements: int = DEFAULT_CHUNK_ELEMENTS, training_only: bool = True,
                 failures: Failures | None = None, entropy_rows: int | None = DEFAULT_ENTROPY_ROWS,
                 flex_compiled: bool = False, layout_check: bool = False,
                 warn_failures: bool = True) -> None:
        reason = unavailable_reason(layers)
        if reason is not None:
            raise ValueError(reason)
        if chunk_elements < 1:
            raise ValueError(f"chunk_elements must be a positive integer, got {chunk_elements!r}")
        if entropy_rows is not None and (isinstance(entropy_rows, bool) or not isinstance(entropy_rows, int)
                                         or entropy_rows < 1):
            raise ValueError(f"entropy_rows must be a positive integer or None, got {entropy_rows!r}")
        self.entropy_rows = entropy_rows
        #: trace the statistics of flex calls into compiled graphs (attn_probe.activations.flex)
        self.flex_compiled = bool(flex_compiled)
        if self.flex_compiled:
            try:  # checked (and the operators registered) before any compile may trace a flex call
                block_mask_reader()
                compiled_ops()
            except Exception as exc:  # noqa: BLE001 - an older torch: the opt-in cannot be honoured
                self.flex_compiled = False
                safe_warn(f"attn_probe: flex_attention calls inside compiled graphs will not be measured: {exc}.")
        #: this capture's key for failures inside the compiled graphs' operators (flex.take_failures)
        self._owner = id(self)
        # on the CPU whatever the device: read after a step without waiting for the device
        #: flex calls met inside compiled code (traced there: one add per call the graph runs)
        self.flex_in_graphs = torch.zeros((), dtype=torch.long)
        self._pending = torch.zeros((), dtype=torch.long)  # flex calls a graph measured, not yet run eagerly
        self.root = unwrap(model)
        self.layers = tuple(layers)
        self.chunk_elements = int(chunk_elements)
        self.training_only = bool(training_only)
        self.failure_log = failures
        self.names = tuple(layer.name for layer in self.layers)
        self.heads = tuple(layer.num_heads for layer in self.layers)
        self.index = {layer.module: i for i, layer in enumerate(self.layers)}
        self._offsets = [0]
        for h in self.heads:
            self._offsets.append(self._offsets[-1] + h)
        #: per layer: measured from its scaled_dot_product_attention calls (attn_probe.activations.sdpa)
        self.sdpa = tuple(measured_by_sdpa(layer) for layer in self.layers)
        self._implementations = self._interface_names()
        self._running: list[int] = []  # the sdpa layers whose forward is running, innermost last
        self._mode = SdpaMode(self.observe_sdpa, self.observe_flex)
        self._unmeasured: list[str] | None = None  # the last switched-to names found unmeasured
        try:
            params = inspect.signature(self.root.forward).parameters
            self._mask_positions = {name: list(params).index(name) for name in
                                    ("attention_mask", "decoder_attention_mask") if name in params}
        except (TypeError, ValueError):
            self._mask_positions = {}
        self._hooks: list = []
        self._armed = False
        self._closed = False
        #: one frame per forward of the model being run: (counted, its 2D masks, mode pushed)
        self._frames: list[tuple[bool, dict[str, Tensor | None], bool]] = []
        self._buffers: list[Tensor] | None = None
        self._failed_step = False
        self._warned = not warn_failures  # the owner warns instead
        self.failures: list[str] = []
        self.layout = LayoutWatch(self.layers, layout_check)  #: the readings checked once (layout.py)
        #: this step's failed calls, the layers they were in, the first one's message
        self.failed_calls = 0
        self.failed_layers: list[str] = []
        self.first_failure: str | None = None
        #: failed calls since construction
        self.failed_calls_total = 0
        if self._implementations:
            registry.acquire(self._implementations, self._interface_modules())
        self._install()

    def _interface_names(self) -> list[str]:
        """The implementation names of the layers measured through transformers' interface."""
        return sorted({str(registry.implementation(layer.module))
                       for layer, sdpa in zip(self.layers, self.sdpa, strict=True) if not sdpa})

    def _interface_modules(self) -> list[nn.Module]:
        """The attention modules of the layers measured through transformers' interface."""
        return [layer.module for layer, sdpa in zip(self.layers, self.sdpa, strict=True) if not sdpa]

    # -- step control -------------------------------------------------------------------------

    def _reset(self) -> None:
        """Preallocated float64 accumulators, reset in place (the same tensors every step, so a
        compiled forward that updates them is not re-specialised on new objects)."""
        if self._buffers is None:
            device, n, layers = self._device(), self._offsets[-1], len(self.layers)
            self._buffers = [torch.empty(n, dtype=torch.float64, device=device) for _ in range(3)] + \
                [torch.empty(layers, dtype=torch.float64, device=device) for _ in range(3)] + \
                [torch.empty(n, dtype=torch.float64, device=device)]
            self._layer = torch.zeros((), dtype=torch.long, device=device)  # the running flex layer, as data
        self._pending.zero_()
        self.flex_in_graphs.zero_()
        mx, ent, tok, norm, scaling, seen, signed = self._buffers
        signed.fill_(-math.inf)
        mx.fill_(-math.inf)
        ent.zero_()
        tok.zero_()
        norm.fill_(-math.inf)
        scaling.fill_(math.nan)
        seen.zero_()

    def _install(self) -> None:
        """The hooks, registered once for the capture's life (removed by :meth:`close`): a forward
        pre-hook and an always-called forward hook on the model (the forward's grad mode, its 2D
        padding masks, the sdpa mode), a pre-hook on each attention module (its input norm; for an
        sdpa layer, the running stack) and, for an sdpa layer, an always-called forward hook.

        Registered once, not per armed step: ``torch.compile`` guards on a traced module's hook ids
        (``hook_id in module._forward_hooks_always_called``), so hooks registered anew at every due
        step failed that guard and recompiled every due step, up to dynamo's recompile limit. Kept,
        they switch on :attr:`_armed` and :attr:`_frames`: a compiled frame has one variant
        unarmed, one armed. Each is a :class:`~attn_probe.hooks.ProbeHook` (a copy of the model gets
        a no-op in its place)."""
        root = self.root
        self._hooks.append(root.register_forward_pre_hook(ProbeHook(self._enter), with_kwargs=True))
        self._hooks.append(root.register_forward_hook(ProbeHook(self._exit), with_kwargs=True, always_call=True))
        for i, layer in enumerate(self.layers):
            enter, leave = running_hooks(self._running, i, self._layer_tensor) if self.sdpa[i] else (None, None)
            self._hooks.append(layer.module.register_forward_pre_hook(ProbeHook(self._layer_hook(i, enter)),
                                                                      with_kwargs=True))
            if leave is not None:
                self._hooks.append(layer.module.register_forward_hook(ProbeHook(leave), always_call=True))

    def arm(self) -> None:
        """Start a step: zero the accumulators, switch the hooks on, let the wrappers measure."""
        if self._closed:
            raise RuntimeError("AttentionCapture is closed")
        if self._armed:
            return
        self._resolve()
        self._reset()
        self._frames = []
        self._failed_step = False
        self.failed_calls, self.failed_layers, self.first_failure = 0, [], None
        registry.arm(self)
        self._armed = True

    def _resolve(self) -> None:
        """Follow an attention implementation switched after construction (``set_attn_implementation``):
        wrap the new names when they are measured; else nothing is measured and the stage says why."""
        now = self._interface_names()
        if now == self._implementations or now == self._unmeasured:
            return
        if unavailable_reason(self.layers) is not None:
            self._unmeasured = now  # checked once per switch, not at every forward
            return
        registry.acquire(now, self._interface_modules())
        registry.release(self._implementations)
        self._implementations = now

    def disarm(self) -> None:
        """End the step: the wrappers pass straight through again and the hooks do nothing."""
        registry.disarm(self)
        self.layout.inputs.clear()  # a layer whose attention call was not reached: checked at a later step
        self._armed = False
        # disarmed inside a forward of the model: nothing more counts, _exit still pops its mode
        self._frames = [(False, masks, pushed) for _, masks, pushed in self._frames]
        if not self._frames:
            self._running.clear()

    @property
    def armed(self) -> bool:
        return self._armed

    @property
    def failed_this_step(self) -> bool:
        """A measurement of this step failed (warned about by the capture, counted)."""
        return self._failed_step

    def missing(self) -> list[str]:
        """Names of watched layers whose attention was not measured this step."""
        if self._buffers is None:
            return list(self.names)
        seen = self._buffers[5].tolist()
        return [name for name, n in zip(self.names, seen, strict=True) if n == 0]

    def collect(self) -> StepStats:
        """The step's values so far (see :class:`StepStats`), on the first layer's device."""
        if self._buffers is None:
            self._reset()
        failed = take_failures(self._owner) if self.flex_compiled else []
        if failed:  # a flex call's statistics failed inside a compiled graph: none of the step's values kept
            self._fail(f"flex_attention inside a compiled graph ({failed[0]})")
            self._reset()
        mx, ent, tok, norm, scaling, _, signed = (b.clone() for b in self._buffers)
        scales = tuple(None if math.isnan(s) else s for s in scaling.tolist())
        return StepStats(self.names, self.heads, mx, ent, tok, norm, scales, signed)

    def close(self) -> None:
        """Disarm and release the wrappers (the last user restores ``get_interface``)."""
        if self._closed:
            return
        self.disarm()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._implementations:
            registry.release(self._implementations)
        self._closed = True

    def __enter__(self) -> AttentionCapture:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- hooks and the measurement ------------------------------------------------------------

    def _device(self) -> torch.device:
        for layer in self.layers:
            for p in layer.module.parameters():
                return p.device
        return torch.device("cpu")

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._armed:
            return
        if not torch.compiler.is_compiling():  # a switch between arming and the forward (plain loops)
            try:
                self._resolve()
            except Exception as exc:  # noqa: BLE001 - a hook on the user's forward never raises
                self._fail(f"following the attention implementation ({type(exc).__name__}: {exc})")
        masks: dict[str, Tensor | None] = {}
        for name, pos in self._mask_positions.items():
            mask = kwargs.get(name)
            if mask is None and pos < len(args):  # the bound forward's parameters exclude self
                mask = args[pos]
            masks[name] = mask if isinstance(mask, Tensor) and mask.dim() == 2 else None
        counted = torch.is_grad_enabled() or not self.training_only
        pushed = counted and any(self.sdpa)  # intercepts the sdpa layers' calls (attn_probe.activations.sdpa)
        if pushed:
            self._mode.__enter__()
        self._frames.append((counted, masks, pushed))

    def _exit(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        if self._frames and self._frames.pop()[2]:
            self._mode.__exit__(None, None, None)

    def _counted(self) -> bool:
        return bool(self._frames) and self._frames[-1][0]

    def _query_mask(self, i: int, batch: int, q_len: int) -> Tensor | None:
        group = self.layers[i].group
        name = "decoder_attention_mask" if group in ("decoder", "cross") else "attention_mask"
        mask = self._frames[-1][1].get(name) if self._frames else None
        if mask is None or mask.shape[0] != batch or mask.shape[1] < q_len:
            return None
        return mask[:, -q_len:].bool()

    def _layer_hook(self, i: int, enter: Callable | None) -> Callable:
        """Layer ``i``'s forward pre-hook: inside an armed forward of the model, push the layer on
        the running stack (``enter``, sdpa layers) and, in a counted forward, take its input norm."""

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self._frames:
                return  # not armed, or outside a forward of the model (a checkpointed block re-run in backward)
            if enter is not None:
                enter(module, args)
            if not self._counted():
                return
            x = args[0] if args else kwargs.get("hidden_states")
            if not isinstance(x, Tensor) or x.dim() < 2:
                return
            self.layout.keep(i, x)
            try:
                with torch.no_grad():
                    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
                    norms = torch.linalg.vector_norm(x.detach().to(dtype), dim=-1)
                    valid = self._query_mask(i, norms.shape[0], norms.shape[-1]) if norms.dim() == 2 else None
                    if valid is not None and valid.shape == norms.shape:
                        norms = norms.masked_fill(~valid.to(norms.device), -math.inf)
                    slot = self._buffers[3][i:i + 1]
                    slot.copy_(torch.maximum(slot, norms.amax().to(slot)))
            except Exception as exc:  # never take training down
                self._fail(f"input norm of {self.names[i]}: {exc!r}", i)

        return hook

    def observe(self, i: int, family: str, module: nn.Module, query: Tensor, key: Tensor,
                attention_mask: Tensor | None, args: tuple, kwargs: dict) -> None:
        """One call of watched layer ``i``'s attention function (made by the registry's wrapper
        while armed): adds its logit statistics to the step's accumulators; never raises."""
        if not self._counted():
            return  # not a forward that produces the update, or a checkpointed block re-run in backward
        try:
            if args:
                raise TypeError("positional arguments after the mask are not understood")
            if query.shape[1] != self.heads[i]:
                raise ValueError(f"the attention received {query.shape[1]} query heads, the layer has "
                                 f"{self.heads[i]} (heads sharded by tensor parallelism are not measured)")
            scaling = kwargs.get("scaling")
            if scaling is None:
                scaling = query.shape[-1] ** -0.5
            rows = row_mask(family, module, attention_mask, kwargs, query.shape[2], key.shape[2], query.device)
            sinks = kwargs.get("s_aux") if family != "sdpa" else None  # sdpa ignores sinks
            self._measure(i, query, key, float(scaling), rows, softcap=kwargs.get("softcap"), sinks=sinks)
        except Exception as exc:  # never take training down
            self._fail(f"{self.names[i]}: {exc!r}", i)
        self._check_layout(i, query, key)

    def observe_sdpa(self, args: tuple, kwargs: dict) -> None:
        """One ``scaled_dot_product_attention`` call inside a counted forward (from :class:`SdpaMode`):
        the innermost sdpa layer running, if any, adds its statistics; never raises."""
        if not self._running or not self._counted():
            return  # an unwatched module's call, or transformers' own sdpa function (measured by observe)
        i = self._running[-1]
        try:
            query, key, scaling, rows = sdpa_call(args, kwargs, self.heads[i])
            self._measure(i, query, key, scaling, rows)
        except Exception as exc:  # never take training down
            self._fail(f"{self.names[i]}: {exc!r}", i)
            return
        self._check_layout(i, query, key)

    def _check_layout(self, i: int, query: Tensor, key: Tensor) -> None:
        if not torch.compiler.is_compiling() and self._counted():  # no guard on the layout's sets
            self.layout.check(i, query, key, autocast_off)

    def _measure(self, i: int, query: Tensor, key: Tensor, scaling: float, rows: Callable, *,
                 softcap: float | None = None, sinks: Tensor | None = None) -> None:
        """Layer ``i``'s statistics of one call added to the step's accumulators (may raise)."""
        with torch.no_grad():
            stats = logit_stats(
                query, key, scaling, rows, query_valid=self._query_mask(i, query.shape[0], query.shape[2]),
                softcap=softcap, sinks=sinks, chunk_elements=self.chunk_elements,
                entropy_rows=self.entropy_rows, entropy_seed=i,
            )
        self._accumulate(i, stats, scaling)

    def _accumulate(self, i: int, stats: tuple[Tensor, Tensor, Tensor, Tensor], scaling: float) -> None:
        """One call's per-head ``(max |l|, entropy sum, tokens, max l)`` added to layer ``i``'s accumulators."""
        top, ent, tok, top_signed = stats
        with torch.no_grad():
            mx, ent_sum, tokens, _, scale, seen, signed = self._buffers
            o0, o1 = self._offsets[i], self._offsets[i + 1]
            mx[o0:o1].copy_(torch.maximum(mx[o0:o1], top.to(mx)))
            signed[o0:o1].copy_(torch.maximum(signed[o0:o1], top_signed.to(signed)))
            ent_sum[o0:o1].add_(ent.to(ent_sum))
            tokens[o0:o1].add_(tok.to(tokens))
            scale[i:i + 1].fill_(float(scaling))
            seen[i:i + 1].add_(1)

    def _fail(self, message: str, layer: int | None = None) -> None:
        """Count a failure (once per step in ``failure_log``), warn about the first one only
        (unless the owner warns: ``warn_failures=False``)."""
        try:
            if message not in self.failures:
                self.failures.append(message)
            self.failed_calls += 1
            self.failed_calls_total += 1
            if self.first_failure is None:
                self.first_failure = message
            if layer is not None and self.names[layer] not in self.failed_layers:
                self.failed_layers.append(self.names[layer])
            if not self._failed_step:
                self._failed_step = True
                if self.failure_log is not None:
                    self.failure_log.count += 1
            if not self._warned:
                self._warned = True
                safe_warn(f"attn_probe: attention statistics skipped for {message}; training is unaffected, "
                          "later failures of the attention statistics are counted, not reported.")
        except Exception:  # noqa: BLE001 - nothing here may reach the model's forward
            pass


__all__ = [
    "ATTENTION_METRICS",
    "AttentionCapture",
    "DEFAULT_CHUNK_ELEMENTS",
    "StepStats",
    "combine",
    "installed_wrappers",
    "logit_bound_ratio",
    "logit_stats",
    "row_mask",
    "unavailable_reason",
]
