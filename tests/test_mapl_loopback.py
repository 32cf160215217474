"""benchmarks/mapl_loopback.py puts MAPL's boundary inside one process; it must train like the real PP=2 run
(two gloo ranks, megatron-core's pipeline schedule, MaplSync across the pair): same model, data and steps,
the same losses up to float rounding, with gradient clipping active on every step (U, the anchors once and the
other parameters in one norm on both sides)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.loss_compare import MODELS
from benchmarks.mapl_loopback import (
    _parse,
    main,
    subspace_distance,
    train_config,
    train_loopback,
)
from megatron_taco.codec import TacoCodec
from megatron_taco.codec.narrow_int import NarrowIntCodec
from megatron_taco.mapl.stiefel import random_stiefel
from megatron_taco.mapl.stage import warmup_alpha
from megatron_taco.mapl.wire import WireRoundTrip, fp8_wire_codec
from megatron_taco.testing.distributed import run_distributed

SHAPE = MODELS["gpt-tiny"]  # 4 layers, hidden 64, learned positions (position anchors on)
STEPS, DATA_SEED, EVAL_ITERS = 6, 3, 2


def _config():
    # gradient norms 2.1-4.3 in these steps: always clipped
    return train_config(
        SHAPE, seed=0, steps=STEPS, lr=3e-3, warmup=2, micro_batch_size=2, micro_batches=2, clip_grad=0.05
    )


@pytest.mark.parametrize(
    "variant",
    ["8x", "8x+fp8", "8x+int5", "8x+topk", "8x+vq2", "8x+leak3", "8x+int5+wleak3", "8x+topk+leak3", "8x+vq2+leak3"],
)
def test_loopback_trains_like_pp2(variant):
    """``8x+fp8`` / ``8x+int5`` / ``8x+topk``: PP=2 with ``--mapl-wire fp8`` / ``int5`` / ``topk``
    (CodecWireCommunicator encodes z and dL/dz on send, decodes them on arrival; with topk the receiving stage keeps
    dL/dz on what arrived) against the loopback's round trip of both through the same codec. ``+leak3``: PP=2 with
    ``--mapl-warmup-steps 3`` (the sender sends h_rec + alpha (h - h_rec) d wide for 3 of the 6 steps, then z on the
    wire) against the loopback's warm-up; ``+int5+wleak3``: the same on the INT5 wire, whose codec carries the
    warm-up's d-wide messages too. After a warm-up, a quantized wire's rounding turns the float-order
    differences of the two set-ups (<= 5e-8) into up to 1.2e-6 (INT5, observed): there the losses of the warm-up's
    steps are held to fp32 rounding, the later ones to 5e-6 (without the warm-up's wire round trip on the sender the
    warm-up's losses move by 6e-6 to 3e-5)."""
    pipeline = run_distributed(train_loopback, 2, _config(), variant, STEPS, DATA_SEED, EVAL_ITERS, "", 2, timeout=600)
    pipeline = pipeline[0]
    loopback = run_distributed(train_loopback, 1, _config(), variant, STEPS, DATA_SEED, EVAL_ITERS, timeout=600)[0]
    uncompressed = run_distributed(train_loopback, 1, _config(), "none", STEPS, DATA_SEED, EVAL_ITERS, timeout=600)[0]
    assert min(pipeline["grad_norms"]) > 0.05, pipeline["grad_norms"]  # clipping was active on every step
    parsed = _parse(variant)
    exact = parsed.leak_steps if parsed.leak_steps and parsed.wire != "bf16" else STEPS + 1
    for step, (a, b) in enumerate(
        zip(pipeline["train"] + [pipeline["valid"]], loopback["train"] + [loopback["valid"]])
    ):
        tolerance = 2e-7 if step < exact else 5e-6  # fp32: <= 4.9e-8 observed
        assert abs(a - b) <= tolerance * abs(a), (step, pipeline, loopback)
    # and the boundary is there: the uncompressed model trains differently
    assert abs(uncompressed["valid"] - loopback["valid"]) > 1e-3, (uncompressed, loopback)
    assert pipeline["parameters"] == loopback["parameters"]  # both count the anchors once


def test_the_leak_warm_up_starts_as_the_stock_model_and_fades_into_the_bottleneck():
    """``+leakN``: h_rec + alpha (h - h_rec) with alpha 1 at the first step, so that step is the stock model's
    (the anchors and U idle); alpha falls linearly and is 0 from step N on, where the run is MAPL's. ``+wleakN``:
    the same message on the INT5 wire, so its first step is the stock model's up to that rounding."""
    assert [warmup_alpha(s, 4) for s in (0, 1, 2, 4, 9)] == [1.0, 0.75, 0.5, 0.0, 0.0]
    assert warmup_alpha(3, 0) == 0.0  # no warm-up
    runs = {
        v: run_distributed(train_loopback, 1, _config(), v, STEPS, DATA_SEED, EVAL_ITERS, timeout=600)[0]
        for v in ("none", "8x", "8x+leak3", "8x+int5+wleak3")
    }
    assert runs["8x+leak3"]["train"][0] == runs["none"]["train"][0] != runs["8x"]["train"][0]
    assert runs["8x+leak3"]["train"][1] not in (runs["none"]["train"][1], runs["8x"]["train"][1])
    assert runs["8x+leak3"]["parameters"] == runs["8x"]["parameters"]
    stock, rounded = runs["none"]["train"][0], runs["8x+int5+wleak3"]["train"][0]
    assert rounded != stock and abs(rounded - stock) < 1e-3 * stock, (rounded, stock)
    # the bytes over a run of 1500 steps, d = 512: h whole (1x) or in 5 bits (1024 / 337 bytes per token) for 750
    # steps, then the 5-bit wire at rank 192 (8.06x)
    ratios = [_parse(v).run_average_ratio(512, 1500) for v in ("8x+int5", "8x+int5+leak750", "8x+int5+wleak750")]
    assert [round(r, 2) for r in ratios] == [8.06, 1.78, 4.41]


def test_the_tables_baseline_has_mapls_parameters_and_starts_as_the_stock_model():
    """``tables``: the uncompressed model plus MAPL's anchor tables (the equal-parameter baseline). Its tables
    start at zero, so its first step is the stock model's; then the tables learn."""
    runs = {
        v: run_distributed(train_loopback, 1, _config(), v, STEPS, DATA_SEED, EVAL_ITERS, timeout=600)[0]
        for v in ("none", "tables", "8x")
    }
    assert runs["tables"]["parameters"] == runs["8x"]["parameters"] > runs["none"]["parameters"]
    assert runs["tables"]["train"][0] == runs["none"]["train"][0]  # a(t, p) = 0 at the start: the same forward
    assert abs(runs["tables"]["valid"] - runs["none"]["valid"]) > 1e-4, runs


def test_variants_name_their_rank_and_real_ratio_and_bad_names_fail():
    assert (_parse("8x").rank(512), _parse("8x").wire_ratio(512)) == (64, 8.0)
    fp8 = _parse("8x+fp8")
    assert (fp8.rank(512), round(fp8.wire_ratio(512), 2)) == (128, 7.94)  # 128 codes + 1 scale byte per token
    int4 = _parse("16x+int4+anchors32")
    assert (int4.rank(512), int4.anchor_rank, round(int4.wire_ratio(512), 2)) == (128, 32, 15.75)
    tables = _parse("tables+anchors256")
    assert (tables.mode, tables.anchor_rank, _parse("tables").anchor_rank) == ("tables", 256, None)
    for bad in ("tables+fp8", "tables+subspace"):
        with pytest.raises(ValueError, match="tables takes only"):
            _parse(bad)
    fast_u = _parse("8x+fp8+ulr0.03")
    assert (fast_u.mapl_config(512).lr, fp8.mapl_config(512).lr) == (0.03, 0.01)  # 0.01: --mapl-lr's default
    adam_u = _parse("8x+fp8+uadam0.001")
    assert (adam_u.u_adam_lr, adam_u.u_lr, fp8.u_adam_lr) == (0.001, None, None)
    assert (_parse("8x+int5+fp32").fp32_products, _parse("8x+int5").fp32_products) == (True, False)
    for bad in ("tables+ulr0.03",):
        with pytest.raises(ValueError, match="tables takes only"):
            _parse(bad)
    for bad in (
        "8x+fp16",
        "8x+fp8+fp8",
        "8x+fp8+int4",
        "8",
        "8x+anchors",
        "tables+anchors",
        "8x+ulr0",
        "8x+ulrx",
        "8x+uadam0",
        "8x+ulr0.1+uadam0.001",
        "8x+fp32+fp32",
        "8x+vq0",
        "8x+vq",
        "8x+vq2+vq2",
        "8x+leak0",
        "8x+leak",
        "8x+wleak0",
        "8x+leak3+wleak3",
    ):
        with pytest.raises(ValueError, match=r"expected none, tables \(option \+anchorsK\), or Rx"):
            _parse(bad)
    vq = _parse("8x+vq2")  # --mapl-vq-levels 2: r = d / R at the bf16 rule, 2 one-byte indices forward
    assert (vq.rank(512), vq.vq_levels, vq.wire_ratio(512), vq.mapl_config(512).vq_levels) == (64, 2, 512.0, 2)
    assert _parse("8x").mapl_config(512).vq_levels == 0
    for bad in ("8x+wleak3", "8x+topk+wleak3"):
        with pytest.raises(ValueError, match=r"\+wleakN sends the warm-up on the wire: it needs \+fp8 or \+int5"):
            _parse(bad)
    with pytest.raises(ValueError, match=r"\+vqL sends indices, not z: it takes no wire \(\+int5\)"):
        _parse("8x+int5+vq2")


def test_the_wire_round_trip_quantizes_z_forward_and_its_gradient_backward():
    """``+fp8``: what the r-wide messages deliver, both ways: decode(encode(z)) and decode(encode(dL/dz))."""
    gen = torch.Generator().manual_seed(0)
    z = (torch.randn(8, 2, 128, generator=gen) * torch.logspace(-3, 1, 128)).to(torch.bfloat16)  # heavy columns
    grad = torch.randn(8, 2, 128, generator=gen).to(torch.bfloat16) * 1e-4
    codec = _parse("8x+fp8").wire_codec(512)
    leaf = z.clone().requires_grad_(True)
    out = WireRoundTrip.apply(leaf, codec, _parse("8x+fp8").grad_codec(512))
    out.backward(grad)
    assert torch.equal(out, codec.decompress(codec.compress(z), z.shape, z.dtype))
    assert torch.equal(leaf.grad, codec.decompress(codec.compress(grad), grad.shape, grad.dtype))
    assert not torch.equal(out, z) and not torch.equal(leaf.grad, grad)  # FP8: rounded both ways
    error = (out.double() - z.double()).norm() / z.double().norm()
    assert 1e-3 < error < 0.05, error  # E4M3 with a Hadamard and power-of-two scales


def test_the_int4_variants_round_z_to_nearest_and_the_gradient_to_nearest_stochastically_or_in_fp8():
    """``+int4`` / ``+int4sr`` / ``+int4fwd``: rank 4d / R, z in INT4 (nearest) forward; dL/dz backward in INT4 to
    nearest, in INT4 stochastically rounded (unbiased: the mean over draws nears dL/dz, where nearest rounding
    keeps its error), or in FP8 (``--mapl-wire fp8``'s codec at the same rank)."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(8, 2, 256, generator=gen) * torch.logspace(-2, 1, 256)  # heavy columns
    grad = torch.randn(8, 2, 256, generator=gen) * torch.logspace(-3, 0, 256) * 1e-4
    outs, grads = {}, {}
    for wire in ("int4", "int4sr", "int4fwd"):
        variant = _parse(f"8x+{wire}")
        assert (variant.rank(512), round(variant.wire_ratio(512), 2)) == (256, 7.88)
        leaf = z.clone().requires_grad_(True)
        outs[wire] = variant.wire_round_trip(512)(leaf)
        outs[wire].backward(grad)
        grads[wire] = leaf.grad
    codec = _parse("8x+int4").wire_codec(512)
    nearest = codec.decompress(codec.compress(grad), grad.shape)
    assert torch.equal(outs["int4"], codec.decompress(codec.compress(z), z.shape))
    assert torch.equal(outs["int4sr"], outs["int4"]) and torch.equal(outs["int4fwd"], outs["int4"])
    assert torch.equal(grads["int4"], nearest)
    fp8 = fp8_wire_codec(256)
    assert torch.equal(grads["int4fwd"], fp8.decompress(fp8.compress(grad), grad.shape))
    sr = _parse("8x+int4sr").grad_codec(512)  # a fresh codec draws what the wire's first backward drew
    assert torch.equal(grads["int4sr"], sr.decompress(sr.compress(grad), grad.shape))
    draws = torch.stack([sr.decompress(sr.compress(grad), grad.shape) for _ in range(200)]).double()
    assert not torch.equal(draws[0], draws[1])  # a new draw each call
    bias = lambda g: ((g - grad.double()).norm() / grad.double().norm()).item()  # noqa: E731
    assert bias(draws.mean(0)) < 0.3 * bias(nearest.double()), (bias(draws.mean(0)), bias(nearest.double()))


@pytest.mark.parametrize("wire, bits, rank, ratio", [("int6", 6, 160, 8.13), ("int5", 5, 192, 8.06)])
def test_the_narrow_integer_variants_send_z_and_its_gradient_through_the_codec(wire, bits, rank, ratio):
    """``+int6`` / ``+int5``: at no more bytes per token than 2d / R (128 at 8x, d = 512), rank 160 / 192; z and
    dL/dz through ``codec.narrow_int`` both ways. ``+int5`` is ``--mapl-wire int5`` (MAPL's own config and codec),
    ``+int6`` only the loopback's."""
    variant = _parse(f"8x+{wire}")
    assert (variant.rank(512), round(variant.wire_ratio(512), 2)) == (rank, ratio)
    assert variant.mapl_config(512).wire == ("int5" if wire == "int5" else "bf16")
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(8, 2, rank, generator=gen) * torch.logspace(-2, 1, rank)
    grad = torch.randn(8, 2, rank, generator=gen) * 1e-4
    leaf = z.clone().requires_grad_(True)
    out = variant.wire_round_trip(512)(leaf)
    out.backward(grad)
    codec = NarrowIntCodec(rank, bits)
    assert torch.equal(out, codec.decompress(codec.compress(z), z.shape))
    assert torch.equal(leaf.grad, codec.decompress(codec.compress(grad), grad.shape))
    assert not torch.equal(out, z) and not torch.equal(leaf.grad, grad)


def test_the_int4_e4m3_variant_is_tacos_int4_with_e4m3_scales_per_32_both_ways_at_the_fp8_wires_bytes():
    variant = _parse("8x+int4e4m3")
    assert (variant.rank(512), round(variant.wire_ratio(512), 2), _parse("16x+int4e4m3").rank(512)) == (224, 8.61, 96)
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(8, 2, 224, generator=gen) * torch.logspace(-2, 1, 224)
    grad = torch.randn(8, 2, 224, generator=gen) * 1e-4
    leaf = z.clone().requires_grad_(True)
    out = variant.wire_round_trip(512)(leaf)
    out.backward(grad)
    codec = TacoCodec(32, "int4", "ash", "e4m3")
    assert torch.equal(out, codec.decompress(codec.compress(z), z.shape))
    assert torch.equal(leaf.grad, codec.decompress(codec.compress(grad), grad.shape))
    assert 0.05 < ((out - z).norm() / z.norm()).item() < 0.15


def test_the_topk_variant_is_the_topk_wire_with_the_gradient_kept_on_what_arrived():
    """``+topk``: U square, k from the ratio (``--mapl-wire topk``); forward decode(encode(z)), backward
    decode(encode(g on the k coordinates that arrived)): the gradient of the sparse map, in FP8."""
    variant = _parse("8x+topk")
    assert (variant.rank(512), variant.mapl_config(512).topk_values(512), variant.wire_ratio(512)) == (512, 63, 8.0)
    assert round(variant.wire_ratio(128), 2) == 8.26  # 16 values, 7-bit indices: 31 bytes per token
    codec = variant.wire_codec(128)
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(6, 2, 128, generator=gen) * torch.logspace(-2, 1, 128)
    grad = torch.randn(6, 2, 128, generator=gen)
    leaf = z.clone().requires_grad_(True)
    out = variant.wire_round_trip(128)(leaf)
    out.backward(grad)
    kept = codec.decompress(codec.compress(z), z.shape) != 0
    assert torch.equal(out.detach(), codec.decompress(codec.compress(z), z.shape))
    assert torch.equal(leaf.grad, codec.decompress(codec.compress(grad * kept), z.shape))
    assert kept.sum(-1).eq(16).all() and not leaf.grad[~kept].any()
    assert not torch.equal(leaf.grad[kept], grad[kept])  # FP8 both ways


def test_a_compressed_wire_trains_near_the_bf16_wire_of_the_same_rank():
    """``8x+fp8`` has the rank of ``4x`` (16 of 64 on this model) and sends it in FP8: the same run up to the
    rounding of z and dL/dz."""
    runs = {
        v: run_distributed(train_loopback, 1, _config(), v, STEPS, DATA_SEED, EVAL_ITERS, timeout=600)[0]
        for v in ("4x", "8x+fp8")
    }
    first = [runs[v]["train"][0] for v in ("4x", "8x+fp8")]
    assert first[0] != first[1] and abs(first[0] - first[1]) < 1e-2 * first[0], first
    assert abs(runs["4x"]["valid"] - runs["8x+fp8"]["valid"]) < 2e-2 * runs["4x"]["valid"], runs


def test_u_learning_rate_of_a_variant_reaches_the_manifold_step():
    """``+ulrF`` sets U's learning rate: a faster U trains to other losses (the first step's forward is before
    any U update, so it is the same)."""
    runs = {
        v: run_distributed(train_loopback, 1, _config(), v, STEPS, DATA_SEED, EVAL_ITERS, timeout=600)[0]
        for v in ("8x", "8x+ulr0.01", "8x+ulr5")
    }
    for run in runs.values():
        assert run.pop("seconds") > 0
    assert runs["8x+ulr0.01"] == runs["8x"]  # --mapl-lr's default, bit for bit
    assert runs["8x"]["train"][0] == runs["8x+ulr5"]["train"][0]
    # the steps are clipped hard here (clip 0.05): 7.3e-5 observed
    assert abs(runs["8x"]["valid"] - runs["8x+ulr5"]["valid"]) > 1e-5, runs
    assert 0 < runs["8x"]["u_moved"] < runs["8x+ulr5"]["u_moved"] < 1, runs  # and U moved further


def test_riemannian_adam_of_a_variant_trains_u():
    """``+uadamF``: U is stepped by Riemannian Adam, whose steps do not shrink with the gradient: U moves further
    than with momentum SGD at --mapl-lr's default, and the run trains to another loss."""
    runs = {
        v: run_distributed(train_loopback, 1, _config(), v, STEPS, DATA_SEED, EVAL_ITERS, timeout=600)[0]
        for v in ("8x", "8x+uadam0.01")
    }
    assert runs["8x"]["train"][0] == runs["8x+uadam0.01"]["train"][0]
    assert abs(runs["8x"]["valid"] - runs["8x+uadam0.01"]["valid"]) > 1e-5, runs
    assert 0 < runs["8x"]["u_moved"] < runs["8x+uadam0.01"]["u_moved"] < 1, runs


@pytest.mark.parametrize("variant", ["8x+uadam0.001", "tables", "8x+int4", "8x+leak100"])
def test_loopback_only_variants_are_refused_at_pp2_in_one_line(variant, tmp_path, capsys):
    """PP=2 runs step U with MaplSync's momentum SGD and send bf16 or FP8: the loopback's other variants stop at
    parse time, naming the variant."""
    with pytest.raises(SystemExit):
        main(["--variants", variant, "--pipeline-parallel", "2", "--json", str(tmp_path / "r.json")])
    assert f"--variants: {variant!r} is a loopback variant" in capsys.readouterr().err


def test_subspace_distance_is_the_rms_sine_of_the_principal_angles():
    generator = torch.Generator().manual_seed(0)
    u = random_stiefel(16, 4, generator)
    rotated = u @ torch.linalg.qr(torch.randn(4, 4, generator=generator))[0]  # another basis of the same span
    assert subspace_distance(u, rotated) < 1e-3
    basis = torch.eye(16)
    half = torch.cat([basis[:, :2], basis[:, 4:6]], dim=1)  # shares 2 of 4 directions with basis[:, :4]
    assert abs(subspace_distance(basis[:, :4], half) - 0.5**0.5) < 1e-6
    assert abs(subspace_distance(basis[:, :4], basis[:, 4:8]) - 1) < 1e-6


def test_the_confirmation_model_is_gpt_125m_layers_and_never_mixes_with_the_first(tmp_path):
    """``--model gpt-125m``: configs/gpt-125m.yaml's 12 layers of 768 on the study's text and tokens per step; its
    set-up names the model, so a json of the first model's runs refuses it before anything trains. (Trained on CPU
    once, 1 step, none and 8x: 85,645,824 and 85,744,128 parameters, rank 96; about 4 minutes, too slow for here.)"""
    import json

    from benchmarks.mapl_loopback import MODELS, main

    shape = MODELS["gpt-125m"]
    assert (shape.num_layers, shape.hidden_size, shape.num_attention_heads, shape.ffn_hidden_size) == (
        12,
        768,
        12,
        3072,
    )
    assert shape.seq_length == MODELS["gpt-25m"].seq_length == 512 and shape.tie_embeddings
    assert (_parse("8x").rank(768), _parse("8x+fp8").rank(768)) == (96, 192)
    path = tmp_path / "first.json"
    path.write_text(json.dumps({"setup": {"steps": 2, "lr": 1e-3, "warmup": 1, "eval_iters": 20}, "runs": {}}))
    flags = ["--variants", "none", "--seeds", "1", "--steps", "2", "--warmup", "1", "--json", str(path)]
    with pytest.raises(SystemExit, match="holds runs of another set-up"):
        main(flags + ["--model", "gpt-125m"])


def test_a_report_of_runs_from_several_invocations_names_each_ones_commit_date_and_hardware():
    """A resumed json holds runs of other days, commits and GPUs, while its header keeps the last invocation's: the
    report names each run's (runs saved before runs recorded their hardware say so); one invocation, no
    such lines."""
    import types

    from benchmarks.mapl_loopback import report

    def run(valid, **where):
        return dict(valid=valid, parameters=100, **where)

    old = dict(commit="1982a8a", date="2026-12-03")
    new = dict(commit="9910965", date="2026-12-07", hardware="NVIDIA H100 80GB HBM3")
    results = {
        "commit": "9910965", "date": "2026-12-07", "hardware": "NVIDIA H100 80GB HBM3",
        "runs": {"tables | seed 0": run(3.0, **old), "8x+int5 | seed 0": run(3.1, **new)},
    }  # fmt: skip
    args = types.SimpleNamespace(
        variants="tables;8x+int5", model="gpt-125m", pipeline_parallel=1, argv=[], steps=10, lr=1e-3, warmup=1,
        eval_iters=1, vocab_size=8192,
    )  # fmt: skip
    lines = report(args, results)
    assert lines[lines.index("- Runs of more than one invocation:") + 1 :][:2] == [
        "  - commit 1982a8a, 2026-12-03, hardware not recorded: tables | seed 0",
        "  - commit 9910965, 2026-12-07, NVIDIA H100 80GB HBM3: 8x+int5 | seed 0",
    ]
    results["runs"]["tables | seed 0"] = run(3.0, **new)
    assert not any(line.startswith("- Runs of more than one") for line in report(args, results))


def test_report_only_rewrites_the_report_and_plots_loss_over_the_run_average_ratio(tmp_path):
    """``--report-only --plot``: nothing trains, the json stays as it is, the report names a warm-up's run-average
    ratio 1 / (f + (1 - f) / R) beside the wire's R, and the PNG is drawn; without the json, one line."""
    import json

    from benchmarks.mapl_loopback import main

    wire = _parse("8x+int5").wire_ratio(128)
    assert _parse("8x+int5").run_average_ratio(128, 1000) == wire
    assert _parse("8x+int5+leak300").run_average_ratio(128, 1000) == pytest.approx(1 / (0.3 + 0.7 / wire), rel=1e-12)
    assert _parse("8x+int5+leak2000").run_average_ratio(128, 1000) == 1.0 == _parse("tables").run_average_ratio(128, 9)
    where = dict(commit="f7c7ca4", date="2026-12-07", hardware="CPU (2 cores)", parameters=100)
    runs = {
        f"{variant} | seed {seed}": dict(valid=valid + 0.01 * seed, **where)
        for variant, valid in (("tables", 1.80), ("8x+int5", 1.84), ("8x+int5+leak300", 1.81))
        for seed in range(3)
    }
    setup = {"steps": 1000, "lr": 1e-3, "warmup": 100, "eval_iters": 20, "model": "gpt-cpu"}
    path = tmp_path / "study.json"
    path.write_text(json.dumps({"setup": setup, "runs": runs, **where}))
    before = path.read_text()
    flags = ["--model", "gpt-cpu", "--steps", "1000", "--seeds", "3", "--json", str(path), "--report-only"]
    main([*flags, "--variants", "tables;8x+int5;8x+int5+leak300", "--plot", str(tmp_path / "bytes.png")])
    assert path.read_text() == before
    report = (tmp_path / "study.md").read_text()
    assert f"| 8x+int5+leak300 (r 32, {wire:.2f}x; {1 / (0.3 + 0.7 / wire):.2f}x over the run) |" in report
    assert f"| 8x+int5 (r 32, {wire:.2f}x) |" in report
    assert (tmp_path / "bytes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        main([*flags[:-2], "--json", str(tmp_path / "none.json"), "--report-only", "--variants", "tables"])
