"""What a snapshot costs against reading the weights once (issue: "snapshot at memory speed").

For each shape it builds the model from a config on the meta device, materialises it with
``to_empty``, fills every parameter with ``normal_(0, 0.02)`` (uninitialised memory can hold
denormals and NaNs that skew timings) and copies every buffer (rotary ``inv_freq``, ...) from a
one-layer model of the same config built for real, then times, median of ``--repeats``:

* ``snapshot``: ``probe.snapshot()`` of a probe made by ``attn_probe.watch(model, log_dir=tmp)``
  with the default metrics and sinks (what a training step pays when a snapshot is due), wall
  time and the calling thread's CPU time (``time.thread_time``: steadier than the wall time
  on a loaded machine, where other processes take the cores);
* ``read_once``: ``torch._foreach_norm`` over every W_q/W_k tensor (reading them once);
* their ratio;
* ``ops``: the non-view ATen ops one synchronous ``probe.snapshot()`` dispatches on the calling
  thread (:mod:`attn_probe.core.op_count`), and on CPU ``ops (GPU alg.)``, the same with the GPU
  algorithm run on CPU tensors (:func:`attn_probe.core.gpu_algorithm_on_cpu`); with
  ``--kernels`` on CUDA, ``torch.profiler``'s count of CUDA kernel launches (kernels, memcpy and
  memset) of the same snapshot, to calibrate the op count against the launches it stands for;
* with ``async_scoring=True``, what ``snapshot()`` costs the training thread (the walk and the
  copies; the worker's scoring is waited for outside the timing);

and, for the Trainer shape, the wall-time ratio of ``Trainer.train()`` with the probe at
``--every`` against without, synchronous and with ``async_scoring=True`` (the BERT-mini shape of ``bench_overhead.py`` on CPU; the
Llama-3.2-1B shape on CUDA, float32 weights trained with bf16 autocast).

    python benchmarks/bench_snapshot.py                    # CPU: 32 layers d=256, 1 thread
    python benchmarks/bench_snapshot.py --shapes llama-1b llama-70b-attn --json out.json   # on a GPU

Not a test: record the output with the command and the hardware in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch


def llama_config(layers: int, d: int, heads: int, kv_heads: int, inter: int, vocab: int = 256) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, intermediate_size=inter, max_position_embeddings=2048)


#: name -> (config builder, attention-only?) ; attention-only keeps the MLPs tiny (a q/k benchmark)
SHAPES: dict[str, Any] = {
    "cpu-32x256": lambda: llama_config(32, 256, 4, 4, 512),
    # the op-count shape of issue 21 and tests/core/test_gpu_algorithm.py: 8 query / 2 KV heads of 32
    "cpu-gqa-32x256": lambda: llama_config(32, 256, 8, 2, 512),
    "llama-1b": lambda: llama_config(16, 2048, 32, 8, 8192, vocab=128256),
    "llama-70b-attn": lambda: llama_config(80, 8192, 64, 8, 16),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(name: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    import copy
    import re

    from transformers import AutoModelForCausalLM

    cfg = SHAPES[name]()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    # to_empty leaves buffers (rotary inv_freq) uninitialised: copy them from a real one-layer model
    small_cfg = copy.deepcopy(cfg)
    small_cfg.num_hidden_layers, small_cfg.vocab_size, small_cfg.intermediate_size = 1, 8, 8
    small = dict(AutoModelForCausalLM.from_config(small_cfg, dtype=dtype).named_buffers())
    with torch.no_grad():
        for buf_name, buf in model.named_buffers():
            source = small.get(re.sub(r"\.layers\.\d+\.", ".layers.0.", buf_name))
            if source is None or source.shape != buf.shape:
                raise RuntimeError(f"no initial value for buffer {buf_name} of {name}")
            buf.copy_(source)
    return model


def median_time(fn, device: torch.device, repeats: int, cpu_times: list[float] | None = None) -> float:
    """Median wall time of ``fn()`` after a warm-up; ``cpu_times`` gets each call's thread CPU time."""
    fn()  # warm-up
    sync(device)
    times = []
    for _ in range(repeats):
        sync(device)
        start, cpu = time.perf_counter(), time.thread_time()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
        if cpu_times is not None:
            cpu_times.append(time.thread_time() - cpu)
    return statistics.median(times)


def qk_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    import attn_probe

    out = []
    for layer in attn_probe.find_attention(model):
        out += [layer.params[n] for n in layer.param_names]
    return out


def cuda_kernel_count(fn) -> int:
    """CUDA launches (kernels, memcpy, memset) of one ``fn()``, by ``torch.profiler``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


def time_shape(name: str, device: torch.device, dtype: torch.dtype, repeats: int, per_head: bool,
               kernels: bool = False) -> dict[str, Any]:
    import attn_probe
    from attn_probe.core import gpu_algorithm_on_cpu
    from attn_probe.core.op_count import snapshot_op_count

    model = build(name, device, dtype)
    tensors = qk_tensors(model)
    read_once = median_time(lambda: torch._foreach_norm(tensors), device, repeats)
    counts: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        probe = attn_probe.watch(model, log_dir=d, every=None, per_head=per_head)
        step = [1]

        def snap() -> None:
            probe.snapshot(step[0])
            step[0] += 1

        cpu_times: list[float] = []
        snapshot = median_time(snap, device, repeats, cpu_times)
        counts["ops"] = snapshot_op_count(probe, snapshot=lambda _: snap()).total
        if device.type == "cpu":
            with gpu_algorithm_on_cpu():
                snap()  # warm-up on this algorithm
                counts["ops_gpu_algorithm"] = snapshot_op_count(probe, snapshot=lambda _: snap()).total
        elif kernels and device.type == "cuda":
            counts["cuda_kernels"] = cuda_kernel_count(snap)
        probe.close(final_snapshot=False)
    with tempfile.TemporaryDirectory() as d:  # async_scoring: what the training thread pays
        probe = attn_probe.watch(model, log_dir=d, every=None, per_head=per_head, async_scoring=True,
                                 async_max_bytes=1 << 40)
        probe.flush()
        times = []
        for i in range(repeats + 1):
            sync(device)
            start = time.perf_counter()
            probe.snapshot(i + 1)
            times.append(time.perf_counter() - start)  # no sync: the worker runs on
            probe.flush()
        probe.close(final_snapshot=False)
        async_thread = statistics.median(times[1:])
    qk_bytes = sum(t.numel() * t.element_size() for t in tensors)
    del model
    return {"shape": name, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
            "per_head": per_head, "snapshot_ms": snapshot * 1e3,
            "snapshot_cpu_ms": statistics.median(cpu_times) * 1e3, "read_once_ms": read_once * 1e3,
            "async_training_thread_ms": async_thread * 1e3,
            "ratio": snapshot / read_once, "qk_mb": qk_bytes / 2**20, **counts}


def trainer_ratio(device: torch.device, every: int, steps: int, repeats: int) -> dict[str, Any]:
    """Median ``Trainer.train()`` wall time with the probe at ``every`` over without."""
    from transformers import Trainer, TrainingArguments

    import attn_probe

    cuda = device.type == "cuda"
    if cuda:
        name, batch, seq = "llama-1b", 8, 1024
    else:
        name, batch, seq = "bert-mini", 8, 32

    def model_factory() -> torch.nn.Module:
        if cuda:
            return build(name, device, torch.float32)
        from transformers import BertConfig, BertForMaskedLM

        torch.manual_seed(0)
        return BertForMaskedLM(BertConfig(vocab_size=2000, hidden_size=256, num_hidden_layers=4,
                                          num_attention_heads=4, intermediate_size=1024,
                                          max_position_embeddings=seq))

    vocab = 2000 if not cuda else 128256

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return steps * batch

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(5, vocab, (seq,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.clone()}

    def run(with_probe: bool, workdir: str, async_scoring: bool = False) -> float:
        args = TrainingArguments(output_dir=workdir, max_steps=steps, per_device_train_batch_size=batch,
                                 learning_rate=5e-5, report_to="none", save_strategy="no", logging_steps=10**6,
                                 use_cpu=not cuda, bf16=cuda, disable_tqdm=True, seed=0)
        trainer = Trainer(model=model_factory(), args=args, train_dataset=Tokens())
        if with_probe:
            attn_probe.attach(trainer, every=every, log_dir=os.path.join(workdir, "tb"), async_scoring=async_scoring)
        start = time.perf_counter()
        trainer.train()
        sync(device)
        return time.perf_counter() - start

    base, probed, asynchronous = [], [], []
    with tempfile.TemporaryDirectory() as root:
        run(False, os.path.join(root, "warm"))
        for rep in range(repeats):  # alternate so that drifting load hits all three
            base.append(run(False, os.path.join(root, f"b{rep}")))
            probed.append(run(True, os.path.join(root, f"p{rep}")))
            asynchronous.append(run(True, os.path.join(root, f"a{rep}"), async_scoring=True))
    return {"trainer_shape": name, "every": every, "steps": steps, "base_s": statistics.median(base),
            "probed_s": statistics.median(probed), "async_s": statistics.median(asynchronous),
            "wall_ratio": statistics.median(probed) / statistics.median(base),
            "async_wall_ratio": statistics.median(asynchronous) / statistics.median(base)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=None,
                   help="default: cpu-32x256 and cpu-gqa-32x256 on CPU; llama-1b and llama-70b-attn on CUDA")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--per-head", action="store_true", help="also time per-head snapshots")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU (0: torch default)")
    p.add_argument("--trainer-steps", type=int, default=200, help="0 skips the Trainer ratio")
    p.add_argument("--trainer-repeats", type=int, default=3)
    p.add_argument("--every", type=int, default=None, help="Trainer snapshot interval (default 20 CPU, 10 GPU)")
    p.add_argument("--kernels", action="store_true", help="on CUDA, also count one snapshot's kernels (profiler)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    shapes = args.shapes or (["llama-1b", "llama-70b-attn"] if device.type == "cuda" else ["cpu-32x256", "cpu-gqa-32x256"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {os.cpu_count()} cores"
    print(f"{hardware}; torch {torch.__version__}; {torch.get_num_threads()} threads; "
          f"load average {os.getloadavg()[0]:.1f}")
    results: dict[str, Any] = {"hardware": hardware, "torch": torch.__version__, "shapes": []}
    count_col = "ops (GPU alg.)" if device.type == "cpu" else "CUDA kernels"
    print("| shape | device | dtype | per head | snapshot ms | snapshot CPU ms | read-once ms | ratio "
          f"| async: training thread ms | W_q+W_k MB | ops | {count_col} |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in shapes:
        for per_head in ([False, True] if args.per_head else [False]):
            r = time_shape(name, device, dtype, args.repeats, per_head, kernels=args.kernels)
            results["shapes"].append(r)
            other = r.get("ops_gpu_algorithm", r.get("cuda_kernels", "-"))
            print(f"| {r['shape']} | {r['device']} | {r['dtype']} | {per_head} | {r['snapshot_ms']:.2f} | "
                  f"{r['snapshot_cpu_ms']:.2f} | "
                  f"{r['read_once_ms']:.3f} | {r['ratio']:.1f}x | {r['async_training_thread_ms']:.2f} | "
                  f"{r['qk_mb']:.1f} | {r['ops']} | {other} |", flush=True)
    if args.trainer_steps > 0:
        every = args.every or (10 if device.type == "cuda" else 20)
        t = trainer_ratio(device, every, args.trainer_steps, args.trainer_repeats)
        results["trainer"] = t
        print(f"\nTrainer ({t['trainer_shape']}, {t['steps']} steps, every={every}): "
              f"{t['base_s']:.2f} s without, {t['probed_s']:.2f} s with the probe: wall ratio {t['wall_ratio']:.3f}; "
              f"async_scoring: {t['async_s']:.2f} s, wall ratio {t['async_wall_ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
