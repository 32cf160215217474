"""Numerics study of the TACO codec, its scale-storage variants and the baselines.

    python -m benchmarks.codec_study --out benchmarks/results/codec_error.md          # CPU, a small model
    python -m benchmarks.codec_study --model gpt-150m --train-steps 1000 \
        --out benchmarks/results/codec_error_gpu.md                                    # one GPU, 152M

Inputs: (a) Gaussian, (b) Student-t (df 3), (c) near-zero mass with outlier
channels, (d) real TP traffic of a model trained on real text (Python standard
library, byte-level). With the default ``--model study``: a 4-layer GPT trained
with TP=2 + SP on 2 gloo ranks, its forward messages (the inputs of the
sequence-parallel all-gather and reduce-scatter). With a ``loss_compare`` shape:
the model trained with TP=1 on this process (GPU when there is one), and the
forward and backward messages of a TP=2 + SP run with its weights rebuilt from it
(``tp2_messages_hooks``; ``tests/test_codec_study.py`` checks them against a real
TP=2 run). On a GPU, the FP8 rows also run through the Triton kernels and, where
Transformer Engine is installed, its cast (``--taco-backend te``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from typing import Dict, List, Tuple

import torch

from megatron_taco.codec import TacoCodec
from megatron_taco.codec.baselines import PerTensorFP8
from megatron_taco.testing.distributed import run_distributed
from megatron_taco.testing.tensors import DISTRIBUTIONS
from megatron_taco.training.model import ModelShape

from .provenance import project_commit

GROUPS = (16, 32, 64, 128, 256)
STUDY_MODEL = ModelShape(
    num_layers=4, hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024, vocab_size=256, seq_length=128
)


def _variants(group: int) -> Dict[str, object]:
    return {
        "TACO dual fp32 scales (paper)": TacoCodec(group, scales="dual", backend="torch"),
        "TACO folded fp32 scale": TacoCodec(group, scales="fp32", backend="torch"),
        "TACO E8M0 scale": TacoCodec(group, scales="e8m0", backend="torch"),
        "TACO folded, E5M2": TacoCodec(group, fmt="e5m2", scales="fp32", backend="torch"),
        "group FP8, no Hadamard": TacoCodec(group, transform="none", scales="fp32", backend="torch"),
        "INT8 + Hadamard": TacoCodec(group, fmt="int8", scales="fp32", backend="torch"),
        "INT8, no Hadamard": TacoCodec(group, fmt="int8", transform="none", scales="fp32", backend="torch"),
        # 4-bit: two values per byte
        "FP4 E2M1 + Hadamard": TacoCodec(group, fmt="e2m1", scales="fp32", backend="torch"),
        "FP4 E2M1 + Hadamard, E8M0": TacoCodec(group, fmt="e2m1", scales="e8m0", backend="torch"),
        "FP4 E2M1, no Hadamard": TacoCodec(group, fmt="e2m1", transform="none", scales="fp32", backend="torch"),
        "FP4 E2M1 + Hadamard, E4M3 x message scale (NVFP4 at G=16)": TacoCodec(
            group, fmt="e2m1", scales="e4m3", backend="torch"
        ),
        "INT4 + Hadamard": TacoCodec(group, fmt="int4", scales="fp32", backend="torch"),
        "INT4 + Hadamard, E8M0": TacoCodec(group, fmt="int4", scales="e8m0", backend="torch"),
        "INT4, no Hadamard": TacoCodec(group, fmt="int4", transform="none", scales="fp32", backend="torch"),
    }


FOUR_BIT = (
    "FP4 E2M1 + Hadamard",
    "FP4 E2M1 + Hadamard, E8M0",
    "FP4 E2M1, no Hadamard",
    "INT4 + Hadamard",
    "INT4 + Hadamard, E8M0",
    "INT4, no Hadamard",
    "FP4 E2M1 + Hadamard, E4M3 x message scale (NVFP4 at G=16)",
)


def _errors(codec, x: torch.Tensor) -> Tuple[float, float, float, float, float, float]:
    """Round-trip metrics: (rel. L2, rel. L2 of the small half, zero-collapse fraction, max err, ratio,
    signed bias = mean(x' - x) / mean |x|).

    The small half is the elements with |x| at or below the median |x|: the near-zero
    mass that uniform grids crush. Zero collapse is the fraction of non-zero inputs
    that decode to exactly zero.
    """
    x = x.float()
    x_hat = codec.decompress(codec.compress(x), x.shape, torch.float32).double()
    x64 = x.double()
    diff = x_hat - x64
    rel = float(diff.norm() / x64.norm())
    small = x64.abs() <= x64.abs().median()
    rel_small = float(diff[small].norm() / x64[small].norm())
    nonzero = x64 != 0
    collapse = float(((x_hat == 0) & nonzero).sum() / nonzero.sum())
    max_err = float(diff.abs().max() / x64.abs().max())
    ratio = 2 * x.numel() / codec.compressed_nbytes(x.numel())
    bias = float(diff.mean() / x64.abs().mean())
    return rel, rel_small, collapse, max_err, ratio, bias


def _capture_tp_traffic(steps: int, seed: int):
    """Rank 0's SP all-gather inputs and reduce-scatter inputs at the last of ``steps`` steps."""
    from megatron.core.tensor_parallel import layers

    from megatron_taco.training.data import byte_text_batches, stdlib_text_files
    from megatron_taco.training.loop import TrainConfig, Trainer

    captured: Dict[str, torch.Tensor] = {}
    current = {"name": None}
    original_reduce_scatter = layers.reduce_scatter_to_sequence_parallel_region

    def recording_reduce_scatter(tensor, *args, **kwargs):
        if current["name"]:
            captured[f"fwd reduce-scatter, {current['name']}"] = tensor.detach().clone()
        return original_reduce_scatter(tensor, *args, **kwargs)

    layers.reduce_scatter_to_sequence_parallel_region = recording_reduce_scatter
    cfg = TrainConfig(
        STUDY_MODEL,
        tensor_parallel=2,
        sequence_parallel=True,
        micro_batch_size=4,
        num_microbatches=1,
        lr=3e-3,
        seed=seed,
    )
    trainer = Trainer(cfg)
    train_files, _ = stdlib_text_files()
    data = byte_text_batches(train_files[:400], STUDY_MODEL.seq_length, 4, seed=seed)
    record = {"on": False}
    for layer in trainer.model.module.decoder.layers:
        for name in LINEARS:
            module = layer_linear(layer, name)
            label = f"layer {layer.layer_number} {name}"

            def pre_hook(mod, inputs, label=label, name=name):
                current["name"] = label if record["on"] else None
                if record["on"] and name in ("linear_qkv", "linear_fc1"):
                    captured[f"fwd all-gather, {label}"] = inputs[0].detach().clone()

            module.register_forward_pre_hook(pre_hook)
    losses = []
    for step in range(steps):
        record["on"] = step == steps - 1
        losses.append(trainer.train_step(data)["loss"])
    trainer.close()
    layers.reduce_scatter_to_sequence_parallel_region = original_reduce_scatter
    return captured, losses


LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # column, row, column, row
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")


def layer_linear(layer: torch.nn.Module, name: str) -> torch.nn.Module:
    """One of a TransformerLayer's ``LINEARS``: the attention's (qkv, proj) or the MLP's (fc1, fc2)."""
    return getattr(layer.self_attention if name in ("linear_qkv", "linear_proj") else layer.mlp, name)


def tp2_messages_hooks(trainer, captured: Dict[str, list], record: dict, ranks=(0,)) -> None:
    """Hooks on a TP=1 model that store, while ``record["on"]``, what each of ``ranks`` of a TP=2 + SP run with
    the same weights puts on the wire (the collectives' inputs), forward and backward:

    - column-parallel linears (qkv, fc1): forward all-gather of the rank's half of the sequence; backward
      reduce-scatter of the rank's partial input gradient, dY[:, rows_r] @ W[rows_r, :];
    - row-parallel linears (proj, fc2): forward reduce-scatter of the rank's partial output,
      X[:, cols_r] @ W[:, cols_r]^T (the bias is added after it); backward all-gather of the rank's half of the
      output gradient.

    rows_r / cols_r are the rank's TP shard as the model builds it (``tp_shard``: for a gated fc1 the halves
    of gate and of up), so the messages are the ones TP=2 computes from the same weights.
    """
    from megatron_taco.training.model import tp_shard, tp_stride

    config = trainer.config
    gpt = trainer.model
    while not hasattr(gpt, "decoder"):  # under DDP, and Float16Module in bf16
        gpt = gpt.module
    for layer in gpt.decoder.layers:
        for name in LINEARS:
            module = layer_linear(layer, name)
            label = f"layer {layer.layer_number} {name}"
            stride = tp_stride(config, f".{name}.", module.weight)

            def forward_hook(mod, inputs, output, label=label, column=name in COLUMN_PARALLEL, stride=stride):
                if not record["on"]:
                    return
                x, w = inputs[0].detach(), mod.weight.detach()
                halves = lambda t: [t.chunk(2, dim=0)[r].clone() for r in ranks]  # noqa: E731
                if column:
                    captured[f"fwd all-gather, {label}"] = halves(x)

                    def backward_reduce_scatter(dy):
                        captured[f"bwd reduce-scatter, {label}"] = [
                            tp_shard(dy, -1, stride, 2, r) @ tp_shard(w, 0, stride, 2, r) for r in ranks
                        ]

                    output[0].register_hook(backward_reduce_scatter)
                else:
                    captured[f"fwd reduce-scatter, {label}"] = [
                        tp_shard(x, -1, 1, 2, r) @ tp_shard(w, 1, 1, 2, r).t() for r in ranks
                    ]
                    output[0].register_hook(
                        lambda dy, label=label: captured.__setitem__(f"bwd all-gather, {label}", halves(dy))
                    )

            module.register_forward_hook(forward_hook)


def capture_tp1_as_tp2(shape: ModelShape, steps: int, seed: int, micro_batch_size: int, dtype: str, ranks=(0,)):
    """Train ``shape`` with TP=1 on this process for ``steps`` steps; at the last,
    the TP=2 + SP messages of ``ranks`` (``tp2_messages_hooks``). Needs a process group of one."""
    from megatron_taco.training.data import byte_text_batches, stdlib_text_files
    from megatron_taco.training.loop import TrainConfig, Trainer

    cfg = TrainConfig(
        shape,
        micro_batch_size=micro_batch_size,
        num_microbatches=1,
        dtype=dtype,
        lr=6e-4,
        lr_warmup_iters=min(100, steps // 10),
        lr_decay_style="cosine",
        lr_decay_iters=steps,
        min_lr=6e-5,
        seed=seed,
    )
    trainer = Trainer(cfg)
    parameters = sum(p.numel() for p in trainer.model.parameters())
    captured: Dict[str, list] = {}
    record = {"on": False}
    tp2_messages_hooks(trainer, captured, record, ranks)
    data = byte_text_batches(stdlib_text_files()[0], shape.seq_length, micro_batch_size, seed=seed)
    losses = []
    for step in range(steps):
        record["on"] = step == steps - 1
        losses.append(trainer.train_step(data)["loss"])
        if step % 100 == 0 or step == steps - 1:
            print(f"  step {step + 1}/{steps}: loss {losses[-1]:.3f}", flush=True)
    trainer.close()
    return captured, losses, parameters


def _backend_variants(group: int) -> Dict[str, object]:
    """On a GPU, the FP8 rows again through the compiled Triton kernels and Transformer Engine's cast (G=128)."""
    if group != 128 or not torch.cuda.is_available():
        return {}
    variants = {}
    for transform, name in (("ash", "TACO folded fp32 scale"), ("none", "group FP8, no Hadamard")):
        variants[f"{name}, Triton kernels"] = TacoCodec(group, transform=transform, scales="fp32", backend="triton")
        try:
            variants[f"{name}, TE cast"] = TacoCodec(group, transform=transform, scales="fp32", backend="te")
        except Exception as exc:  # say it, do not hide it
            print(f"no TE rows: {type(exc).__name__}: {exc}", flush=True)
    return variants


def _peak_to_rms(x: torch.Tensor) -> float:
    x = x.double()
    return float(x.abs().max() / x.pow(2).mean().sqrt().clamp_min(1e-300))


def _traffic_models() -> Dict[str, ModelShape]:
    """The shapes ``--model`` takes: loss_compare's, and one of >= 125M parameters on the byte vocabulary
    (gpt-125m's shape has 86M there: its 125M count includes a 50257-token embedding)."""
    from .loss_compare import MODELS

    wide = ModelShape(
        num_layers=12, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096, vocab_size=256, seq_length=1024
    )
    return {**MODELS, "gpt-150m": wide}


def main() -> None:
    models = _traffic_models()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/codec_error.md")
    parser.add_argument(
        "--model",
        default="study",
        choices=["study", *sorted(models)],
        help="study: the 4-layer model on 2 gloo ranks (TP=2 + SP, forward traffic); a loss_compare shape: TP=1 "
        "on this process (GPU when there is one), TP=2's forward and backward messages rebuilt from it",
    )
    parser.add_argument("--train-steps", type=int, default=60)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--from-json", help="write --out from a results .json of an earlier run (no training)")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            _write_report(json.load(f), args.out, rendered_at=project_commit())
        print(f"wrote {args.out}")
        return
    device = "cuda" if args.model != "study" and torch.cuda.is_available() else "cpu"

    gen = torch.Generator().manual_seed(args.seed)
    synthetic = {name: make((256, 4096), gen).to(device) for name, make in DISTRIBUTIONS.items()}
    if args.model == "study":
        print(f"training the study model for {args.train_steps} steps (TP=2 + SP, 2 gloo ranks) ...", flush=True)
        captured, losses = run_distributed(_capture_tp_traffic, 2, args.train_steps, args.seed, timeout=3600)[0]
        parameters = None
    else:
        import torch.distributed as dist

        from megatron_taco.testing.distributed import free_port

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
        print(f"training {args.model} for {args.train_steps} steps (TP=1, {device}) ...", flush=True)
        dtype = "bf16" if device == "cuda" else "fp32"
        captured, losses, parameters = capture_tp1_as_tp2(
            models[args.model], args.train_steps, args.seed, args.micro_batch_size, dtype
        )
        captured = {k: v[0] for k, v in captured.items()}  # rank 0's
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; captured {len(captured)} tensors", flush=True)
    real = {k: captured[k] for k in sorted(captured, key=lambda k: (int(k.split("layer ")[1].split()[0]), k))}

    inputs: Dict[str, torch.Tensor] = {**synthetic, **{f"real: {k}": v for k, v in real.items()}}
    rows: List[Tuple[str, str, int, float, float, float, float, float, float]] = []
    for input_name, x in inputs.items():
        for group in GROUPS:
            for variant, codec in {**_variants(group), **_backend_variants(group)}.items():
                rows.append((input_name, variant, group, *_errors(codec, x)))
        rows.append((input_name, "per-tensor FP8 (TE current scaling)", 0, *_errors(PerTensorFP8(), x)))
        print(f"  {input_name}: done", flush=True)

    import megatron.core
    import triton

    machine = (
        f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
        if device == "cuda"
        else f"{platform.machine()} CPU ({os.cpu_count()} cores)"
    )
    results = dict(
        args={k: getattr(args, k) for k in ("model", "train_steps", "micro_batch_size", "seed")},
        commit=project_commit(),
        date=datetime.date.today().isoformat(),
        machine=f"{machine}, Python {platform.python_version()}, torch {torch.__version__}, megatron-core "
        f"{megatron.core.__version__}, triton {triton.__version__}",
        on_gpu=device == "cuda",
        losses=losses,
        parameters=parameters,
        shapes={name: list(x.shape) for name, x in inputs.items()},
        peak_to_rms={name: _peak_to_rms(x) for name, x in inputs.items()},
        rows=rows,
    )
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(results, f)
    _write_report(results, args.out)
    print(f"wrote {args.out}")


def _summary(rows) -> List[str]:
    """Mean relative error per (variant, G) over the real traffic tensors and over all inputs."""
    lines = [
        "| variant | G | ratio vs bf16 | rel. L2, real TP traffic | rel. L2, synthetic | small-half rel. L2, real | "
        "small-half rel. L2, synthetic | zero collapse, real | worst rel. L2 | signed bias, real (mean) | "
        "worst abs. bias |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r[1], r[2]) for r in rows}, key=lambda k: (k[0], k[1]))
    for variant, group in keys:
        sel = [r for r in rows if r[1] == variant and r[2] == group]
        real = [r for r in sel if r[0].startswith("real")]
        synth = [r for r in sel if not r[0].startswith("real")]
        mean = lambda rs, i: sum(r[i] for r in rs) / len(rs)  # noqa: E731
        lines.append(
            f"| {variant} | {group or '-'} | {sel[0][7]:.3f} | {mean(real, 3):.4f} | {mean(synth, 3):.4f} | "
            f"{mean(real, 4):.4f} | {mean(synth, 4):.4f} | {100 * mean(real, 5):.2f}% | {max(r[3] for r in sel):.4f} | "
            f"{mean(real, 8):+.1e} | {max(abs(r[8]) for r in sel):.1e} |"
        )
    return lines


def _mean(rows, variant: str, group: int, column: int, real: bool) -> float:
    sel = [r[column] for r in rows if r[1] == variant and r[2] == group and r[0].startswith("real") == real]
    return sum(sel) / len(sel)


def _conclusions(rows) -> List[str]:
    """The default (G, scale storage) and the transform finding, with the numbers behind them."""
    dual, folded, e8m0 = "TACO dual fp32 scales (paper)", "TACO folded fp32 scale", "TACO E8M0 scale"
    plain = "group FP8, no Hadamard"
    int8, int8_plain = "INT8 + Hadamard", "INT8, no Hadamard"
    real = lambda v, g, c=3: _mean(rows, v, g, c, True)  # noqa: E731
    synth = lambda v, g, c=4: _mean(rows, v, g, c, False)  # noqa: E731
    ratio = {r[1]: r[7] for r in rows if r[2] == 128}
    ratio64 = next(r[7] for r in rows if r[1] == folded and r[2] == 64)
    return [
        f"- **G = 128, E4M3, folded fp32 scale** (`TacoCodec()` default): {ratio[folded]:.3f}x vs bf16. Folding s_a into "
        f"s_q does not change the error (real traffic rel. L2 {real(folded, 128):.4f} folded vs {real(dual, 128):.4f} "
        f"dual): s_a cancels because the Hadamard runs in fp32. The paper's dual form costs 4 more bytes per group "
        f"({ratio[dual]:.3f}x).",
        f"- E8M0 (power-of-two byte) reaches {ratio[e8m0]:.3f}x for {100 * (real(e8m0, 128) / real(folded, 128) - 1):+.1f}% "
        f"relative error on real traffic ({real(e8m0, 128):.4f}); available as `--taco-scales e8m0`.",
        f"- G: smaller groups lower the error (real traffic {real(folded, 32):.4f} at G=32 to {real(folded, 256):.4f} at "
        f"G=256) and cost ratio (G=64: {ratio64:.3f}x); G=128 is the smallest G with ratio >= 1.9x.",
        f"- E5M2 doubles the error ({real('TACO folded, E5M2', 128):.4f}): E4M3 stays the default.",
        f"- **Finding on the Hadamard**: on this traffic it {_lowers(real(folded, 128), real(plain, 128))} the "
        f"error of FP8. Real traffic rel. L2 at G=128: "
        f"ASH {real(folded, 128):.4f}, plain group FP8 {real(plain, 128):.4f}. On the near-zero half of the values it "
        f"is {'better' if real(folded, 128, 4) < real(plain, 128, 4) else 'worse'}: {real(folded, 128, 4):.4f} vs {real(plain, 128, 4):.4f} on real traffic, {synth(folded, 128):.3f} vs "
        f"{synth(plain, 128):.4f} on the synthetic inputs (driven by the outlier-channel input: the Hadamard spreads an "
        f"outlier's rounding error over every value of its group, while FP8's log grid already keeps small values). "
        f"INT8 without it shows the zero collapse the paper describes ({100 * real(int8_plain, 128, 5):.2f}% of "
        f"non-zero real values decode to 0; FP8 variants {100 * real(folded, 128, 5):.2f}%). Both transforms are "
        f"selectable (`--taco-mode fp8-ash` / `fp8`); the end-to-end loss study decides between them.",
        f"- **INT8** (`--taco-mode int8-ash` / `int8`, the same bytes as FP8): real traffic rel. L2 at G=128 "
        f"{real(int8, 128):.4f} with the Hadamard, {real(int8_plain, 128):.4f} without, against FP8's "
        f"{real(folded, 128):.4f} / {real(plain, 128):.4f}; the near-zero half {real(int8, 128, 4):.4f} / "
        f"{real(int8_plain, 128, 4):.4f} (FP8 {real(folded, 128, 4):.4f} / {real(plain, 128, 4):.4f}), zero collapse "
        f"{100 * real(int8, 128, 5):.2f}% / {100 * real(int8_plain, 128, 5):.2f}%.",
        *_four_bit_conclusions(rows),
    ]


def _lowers(with_it: float, without: float) -> str:
    """How an error with a transform compares with the error without it (1% either way counts as the same)."""
    if with_it < 0.99 * without:
        return "lowers"
    return "does not change" if with_it <= 1.01 * without else "does not lower"


def _four_bit_conclusions(rows) -> List[str]:
    """What the 4-bit rows say: the Hadamard's effect there, and the settings that reach 3.5x on the wire."""
    real = lambda v, g, c=3: _mean(rows, v, g, c, True)  # noqa: E731
    worst = lambda v, g: max(r[3] for r in rows if r[1] == v and r[2] == g)  # noqa: E731
    ratio = {(r[1], r[2]): r[7] for r in rows}
    wide = sorted((real(v, g), v, g) for v in FOUR_BIT for g in GROUPS if ratio[(v, g)] >= 3.5)
    best = ", ".join(f"{v} G={g} {e:.4f} ({ratio[(v, g)]:.2f}x)" for e, v, g in wide[:3])
    fp4, fp4_plain, int4, int4_plain = (
        "FP4 E2M1 + Hadamard",
        "FP4 E2M1, no Hadamard",
        "INT4 + Hadamard",
        "INT4, no Hadamard",
    )
    return [
        f"- **4-bit** (`--taco-mode fp4-ash` / `fp4` / `int4-ash` / `int4`), G=128, real traffic: the Hadamard "
        f"{_lowers(real(fp4, 128), real(fp4_plain, 128))} the mean error of FP4 E2M1 ({real(fp4, 128):.4f} with it, "
        f"{real(fp4_plain, 128):.4f} without) and {_lowers(real(int4, 128), real(int4_plain, 128))} INT4's "
        f"({real(int4, 128):.4f} / {real(int4_plain, 128):.4f}); without it {100 * real(fp4_plain, 128, 5):.1f}% "
        f"(FP4) and {100 * real(int4_plain, 128, 5):.1f}% (INT4) of the non-zero values decode to 0 "
        f"(with it {100 * real(fp4, 128, 5):.1f}% and {100 * real(int4, 128, 5):.1f}%), and the worst input's error "
        f"(the outlier and heavy-tail ones) is {worst(fp4_plain, 128):.4f} / {worst(int4_plain, 128):.4f} without it "
        f"against {worst(fp4, 128):.4f} / {worst(int4, 128):.4f} with it. Lowest mean error with >= 3.5x on the wire: "
        f"{best}. Which of these trains as well as FP8 is the loss study's question, not this table's.",
    ]


def _by_message_kind(rows, peaks) -> List[str]:
    """G=128 (and the per-tensor baseline): mean rel. L2 and signed bias per message kind, and on the
    outlier-heavy quarter (highest peak / RMS) apart from the rest."""
    real = sorted({r[0] for r in rows if r[0].startswith("real")})
    kinds = sorted({name.split(": ")[1].split(",")[0] for name in real})
    ranked = sorted(real, key=lambda n: peaks[n], reverse=True)
    heavy = set(ranked[: max(1, len(ranked) // 4)])
    columns = [(kind, [n for n in real if n.split(": ")[1].startswith(kind)]) for kind in kinds]
    columns += [
        (f"outlier-heavy quarter (peak/RMS >= {min(peaks[n] for n in heavy):.0f})", sorted(heavy)),
        ("the rest", [n for n in real if n not in heavy]),
    ]
    lines = [
        "| variant (G=128) | " + " | ".join(f"{name} ({len(sel)})" for name, sel in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    variants = sorted({r[1] for r in rows if r[2] in (128, 0)})
    for variant in variants:
        cells = []
        for _, sel in columns:
            got = [r for r in rows if r[1] == variant and r[2] in (128, 0) and r[0] in sel]
            rel = sum(r[3] for r in got) / len(got)
            bias = sum(r[8] for r in got) / len(got)
            cells.append(f"{rel:.4f} ({bias:+.1e})")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Outlier-heavy messages: "
        + "; ".join(f"{n.split(': ')[1]} ({peaks[n]:.0f})" for n in ranked[: max(1, len(ranked) // 4)])
        + ".",
    ]
    return lines


def _write_report(results: dict, out: str, rendered_at: str = "") -> None:
    """The markdown report of ``results`` (what ``main`` measured, as saved in the .json beside it)."""
    args = argparse.Namespace(out=out, **results["args"])
    rows, losses, peaks, parameters = results["rows"], results["losses"], results["peak_to_rms"], results["parameters"]
    on_gpu = results["on_gpu"]
    if args.model == "study":
        command = f"--out {args.out} --train-steps {args.train_steps} --seed {args.seed}"
        traffic = [
            f"- Real TP traffic: GPT {STUDY_MODEL.num_layers} layers, hidden {STUDY_MODEL.hidden_size}, "
            f"FFN {STUDY_MODEL.ffn_hidden_size}, seq {STUDY_MODEL.seq_length}, TP=2 + SP, trained {args.train_steps} "
            f"steps on byte-level Python stdlib text (loss {losses[0]:.3f} -> {losses[-1]:.3f}); forward messages "
            "of TP rank 0 at the last step (all-gather: inputs of linear_qkv / linear_fc1; reduce-scatter: partial "
            "outputs of linear_proj / linear_fc2).",
            "- Real traffic here is a small CPU-trained model's; `codec_error_gpu.md` has a GPU-trained 152M-parameter model's, "
            "forward and backward.",
        ]
    else:
        shape = _traffic_models()[args.model]
        command = (
            f"--model {args.model} --out {args.out} --train-steps {args.train_steps} "
            f"--micro-batch-size {args.micro_batch_size} --seed {args.seed}"
        )
        traffic = [
            f"- Real TP traffic: `{args.model}` ({parameters:,} parameters: {shape.num_layers} layers, hidden "
            f"{shape.hidden_size}, FFN {shape.ffn_hidden_size}, {shape.num_attention_heads} heads, seq "
            f"{shape.seq_length}, byte-level vocabulary), trained {args.train_steps} steps in "
            f"{'bf16 on the GPU' if on_gpu else 'fp32 on CPU'}, micro-batch {args.micro_batch_size}, on byte-level "
            f"Python stdlib text (loss {losses[0]:.3f} -> {losses[-1]:.3f}, cosine lr 6e-4).",
            "- The messages are TP rank 0's of a TP=2 + SP run with these weights at the last step, forward and "
            "backward, every layer: fwd all-gather = its half of the sequence entering linear_qkv / linear_fc1; fwd "
            "reduce-scatter = its partial output of linear_proj / linear_fc2 (X[:, cols_0] W[:, cols_0]^T); bwd "
            "all-gather = its half of the output gradient of linear_proj / linear_fc2; bwd reduce-scatter = its "
            "partial input gradient of linear_qkv / linear_fc1 (dY[:, rows_0] W[rows_0, :]). They are rebuilt from "
            "a TP=1 run (one GPU was lent: two ranks cannot share it through NCCL, and gloo does not carry CUDA "
            "tensors) with the model's own TP shards; `tests/test_codec_study.py` checks that the rebuilt messages "
            "equal the ones a real TP=2 run sends (CPU, gloo).",
        ]
    lines = [
        "# TACO codec numerics study"
        + (f" on a {'GPU' if on_gpu else 'CPU'}-trained {args.model}" if args.model != "study" else ""),
        "",
        f"- Command: `python -m benchmarks.codec_study {command}`",
        f"- Commit: {results['commit']}"
        + (f" (this report written from its .json at {rendered_at})" if rendered_at else ""),
        f"- Date: {results['date']}; machine: {results['machine']}",
        "- Codec path: the torch reference (the Triton kernels write the same bytes, see tests/test_kernels.py and "
        "tests/test_codec_4bit.py)"
        + ("; rows named 'Triton kernels' / 'TE cast' ran those backends." if on_gpu else "."),
        *traffic,
        f"- Synthetic inputs: 256 x 4096 fp32 each ({', '.join(n for n in peaks if not n.startswith('real'))}).",
        "- Metrics: relative L2 error ||x' - x|| / ||x||; small-half rel. L2 = the same over the elements with "
        "|x| <= median |x| (the near-zero mass); zero collapse = share of non-zero inputs decoded to exactly 0; "
        "max error = max|x' - x| / max|x|; ratio = bf16 bytes / message bytes (header and scales included); "
        "signed bias = mean(x' - x) / mean |x| (a rounding rule that prefers a sign shows here); peak/RMS = "
        "max |x| / RMS of a message (outlier weight).",
        "",
        "## Default chosen, and the 4-bit formats",
        "",
        *_conclusions(rows),
        "",
        "## By message kind, G=128: mean rel. L2 (mean signed bias)",
        "",
        *_by_message_kind(rows, peaks),
        "",
        "## Summary (mean over inputs)",
        "",
        *_summary(rows),
        "",
        "## Every input" + ("" if args.model == "study" else ", G=128 (every G: the .json beside this file)"),
        "",
        "| input | shape | peak/RMS | variant | G | rel. L2 | small-half rel. L2 | zero collapse | max err | ratio | "
        "signed bias |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for input_name, variant, group, rel, rel_small, collapse, max_err, ratio, bias in rows:
        if args.model != "study" and group not in (0, 128):
            continue
        shape = "x".join(str(s) for s in results["shapes"][input_name])
        lines.append(
            f"| {input_name} | {shape} | {peaks[input_name]:.1f} | {variant} | {group or '-'} | {rel:.4f} | "
            f"{rel_small:.4f} | {100 * collapse:.2f}% | {max_err:.4f} | {ratio:.3f} | {bias:+.1e} |"
        )
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
