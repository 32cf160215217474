"""MAPL: Stiefel optimisation, r-wide pipeline traffic, replica consistency, flags (real gloo ranks)."""

import argparse
import dataclasses
import math
import pytest
import torch

from megatron_taco.config.mapl import MaplConfig, MaplConfigError, add_mapl_args, auto_wire, mapl_config_from_args
from megatron_taco.codec.narrow_int import NarrowIntCodec
from megatron_taco.mapl.wire import describe_compression, fp8_wire_codec, warm_up_wire_codec
from megatron_taco.mapl.boundary import BoundaryCodec
from megatron_taco.mapl.stiefel import (
    StiefelAdam,
    StiefelMomentumSGD,
    orthogonality_error,
    random_stiefel,
    retract_qr,
    tangent_project,
)
from megatron_taco.mapl.telemetry import MAPL_TELEMETRY
from megatron_taco.mapl.vq import ResidualVQ
from megatron_taco.testing.distributed import run_distributed
from megatron_taco.testing.models import TINY_GPT
from megatron_taco.testing.p2p import recording_p2p
from megatron_taco.training.data import synthetic_batches
from megatron_taco.training.loop import TrainConfig, Trainer


OPTIMIZERS = {
    "momentum": lambda u, lr: StiefelMomentumSGD([u], lr=lr, momentum=0.9),
    "adam": lambda u, lr: StiefelAdam([u], lr=lr),
}


def _householder_reference(y: torch.Tensor) -> torch.Tensor:
    """Q of y = QR with diag(R) > 0 by torch's Householder QR (float64)."""
    q, r = torch.linalg.qr(y)
    return q * torch.sign(torch.diagonal(r))


@pytest.mark.parametrize("case", ["manifold step", "gaussian", "ill-conditioned", "rank deficient"])
def test_retraction_is_the_positive_diagonal_q_factor(case):
    """retract_qr (Cholesky QR) gives Householder QR's Q with diag(R) > 0, float64: for a step's y = U - lr m and a
    Gaussian y (observed max differences 9e-16 and 7e-16, orthogonality errors 1.6e-15 and 2.3e-15) and, through
    the fallback, an ill-conditioned y (two columns 1e-6 apart: Cholesky QR alone is 1e-4 off there) and a y with
    a zero column (y^T y singular)."""
    gen = torch.Generator().manual_seed(3)
    if case == "manifold step":
        u = random_stiefel(256, 96, gen).double()
        y = u - 0.01 * tangent_project(u, torch.randn(256, 96, generator=gen, dtype=torch.float64))
    else:
        y = torch.randn(256, 96, generator=gen, dtype=torch.float64)
        if case == "ill-conditioned":  # two columns 1e-6 apart: cond(y) ~ 1e6
            y[:, 1] = y[:, 0] + 1e-6 * torch.randn(256, generator=gen, dtype=torch.float64)
        elif case == "rank deficient":
            y[:, 1] = 0.0
    q = retract_qr(y)
    assert q.dtype == torch.float64
    if case == "rank deficient":  # R's zero diagonal entry leaves that column's sign to the convention
        kept = [i for i in range(96) if i != 1]
        assert torch.equal(q[:, kept], _householder_reference(y)[:, kept]) and orthogonality_error(q) <= 1e-14
    else:
        assert float((q - _householder_reference(y)).abs().max()) <= 1e-14
        assert orthogonality_error(q) <= 1e-14


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_orthogonality_holds_after_1000_manifold_steps(optimizer):
    gen = torch.Generator().manual_seed(0)
    u = random_stiefel(64, 16, gen)
    opt = OPTIMIZERS[optimizer](u, 0.05)
    for _ in range(1000):
        opt.step([torch.randn(64, 16, generator=gen) * 10])
        assert orthogonality_error(u) <= 1e-5
    assert orthogonality_error(u) <= 1e-5


@pytest.mark.parametrize("optimizer, lr", [("momentum", 0.01), ("adam", 0.01)])
def test_manifold_descent_finds_the_top_eigenspace(optimizer, lr):
    """Maximise trace(U^T A U): the optimum is the span of A's top-r eigenvectors."""
    gen = torch.Generator().manual_seed(1)
    q, _ = torch.linalg.qr(torch.randn(32, 32, generator=gen, dtype=torch.float64))
    eigenvalues = torch.linspace(10, 0.1, 32, dtype=torch.float64)
    a = (q * eigenvalues) @ q.T
    u = random_stiefel(32, 4, gen)
    opt = StiefelMomentumSGD([u], lr=lr, momentum=0.5) if optimizer == "momentum" else StiefelAdam([u], lr=lr)
    for _ in range(500):
        opt.step([-(2 * a @ u.double()).float()])  # gradient of -trace(U^T A U)
    achieved = float(torch.trace(u.double().T @ a @ u.double()))
    assert achieved >= 0.999 * float(eigenvalues[:4].sum()), achieved
    riemannian = tangent_project(u.double(), -(2 * a @ u.double()))
    assert float(riemannian.norm()) < 1e-2


def test_riemannian_adam_steps_do_not_depend_on_the_gradients_scale():
    """Adam's step is the gradient over its RMS: gradients 1e-4 and 1e4 times larger take the same path (within
    fp32 rounding), where momentum SGD's step would scale with them; the first step's RMS per entry is lr."""
    gen = torch.Generator().manual_seed(2)
    start = random_stiefel(48, 8, gen)
    grads = [torch.randn(48, 8, generator=gen) for _ in range(20)]
    paths = []
    for scale in (1e-4, 1.0, 1e4):
        u = start.clone()
        opt = StiefelAdam([u], lr=1e-3)
        opt.step([grads[0] * scale])
        first_step = float((u - start).pow(2).mean().sqrt())
        assert 0.9e-3 <= first_step <= 1.1e-3, (scale, first_step)
        for g in grads[1:]:
            opt.step([g * scale])
        paths.append(u)
    assert float((paths[0] - start).abs().max()) > 1e-3  # it moved
    for u in paths[1:]:
        torch.testing.assert_close(u, paths[0], atol=1e-5, rtol=0)


def _train(mapl, steps, tp=1, pp=2, sp=False, count_p2p=False):
    cfg = TrainConfig(TINY_GPT, tensor_parallel=tp, pipeline_parallel=pp, sequence_parallel=sp, lr=3e-3, mapl=mapl)
    trainer = Trainer(cfg)
    data = synthetic_batches(TINY_GPT.vocab_size, TINY_GPT.seq_length, cfg.micro_batch_size, seed=1)
    with recording_p2p() as recorded:
        losses = [trainer.train_step(data)["loss"] for _ in range(steps)]
    shapes = [(kind, shape) for kind, _, shape in recorded] if count_p2p else []
    projections = {b.boundary: b.projection.detach().clone() for b in trainer.mapl_boundaries}
    anchors = {b.boundary: b.anchor_basis.detach().clone() for b in trainer.mapl_boundaries if b.anchor_rank}
    position_anchors = {b.boundary: b.anchor_position.detach().clone() for b in trainer.mapl_boundaries if b.positions}
    context_anchors = {b.boundary: b.anchor_context.detach().clone() for b in trainer.mapl_boundaries if b.context}
    in_optimizer = any(
        p is b.projection for b in trainer.mapl_boundaries for g in trainer.optimizer.param_groups for p in g["params"]
    )
    trainer.close()
    return dict(
        losses=losses,
        projections=projections,
        anchors=anchors,
        position_anchors=position_anchors,
        context_anchors=context_anchors,
        shapes=shapes,
        in_optimizer=in_optimizer,
    )


def test_auto_wire_takes_the_wire_of_most_rank_within_the_ratio_and_the_finer_one_on_a_tie():
    """--mapl-wire auto for bf16 training: the loss follows the rank (mapl_loopback.md), so the wire that keeps the
    most rank within --mapl-ratio's bytes per token; on a tie the one of more bits per value (INT5 at 32x of hidden
    512 keeps 32, as FP8 does; at 1x INT5 would keep all 512 values as bf16 does)."""
    chosen = {ratio: auto_wire(ratio, 0, 512, 2, True) for ratio in (1, 2, 4, 8, 16, 32)}
    assert {ratio: wire for ratio, (wire, _) in chosen.items()} == {
        1: "bf16",
        2: "fp8",
        4: "int5",
        8: "int5",
        16: "int5",
        32: "fp8",
    }
    assert chosen[8][1] == "the most rank within the ratio's bytes per token: 192 (BF16 64, FP8 128)"
    assert chosen[32][1] == "the most rank within the ratio's bytes per token: 32 (BF16 16, INT5 32)"
    for ratio, (wire, _) in chosen.items():  # each choice is a valid setting of that rank
        assert (
            MaplConfig(ratio=ratio, wire=wire).wire_rank(512) == {1: 512, 2: 512, 4: 384, 8: 192, 16: 96, 32: 32}[ratio]
        )
    assert auto_wire(3, 0, 100, 2, True) == ("int5", "the most rank within the ratio's bytes per token: 96")
    assert auto_wire(128, 0, 64, 2, True) == (
        "bf16",
        "no wire keeps a whole rank of hidden size 64 at --mapl-ratio 128",
    )
    assert auto_wire(8, 0, 512, 4, True)[0] == auto_wire(8, 1, 512, 2, True)[0] == "bf16"


def test_wire_carries_r_wide_tensors_forward_and_backward():
    base = run_distributed(_train, 2, None, 1, count_p2p=True, timeout=120)
    mapl = run_distributed(_train, 2, MaplConfig(ratio=4), 1, count_p2p=True, timeout=120)
    d, r = TINY_GPT.hidden_size, TINY_GPT.hidden_size // 4
    for rank in (0, 1):
        plain = base[rank]["shapes"]
        packed = mapl[rank]["shapes"]
        assert plain and len(plain) == len(packed)
        assert all(shape[-1] == d for _, shape in plain)
        assert all(shape[-1] == r for _, shape in packed)
        plain_bytes = sum(torch.Size(s).numel() for _, s in plain)
        packed_bytes = sum(torch.Size(s).numel() for _, s in packed)
        assert packed_bytes * d == plain_bytes * r
        # the first stage sends activations and receives gradients; the last the reverse
        kinds = {kind for kind, _ in packed}
        assert kinds == {"isend", "irecv"}


def test_replicas_stay_bit_identical_and_u_stays_on_the_manifold_over_200_steps():
    results = run_distributed(_train, 2, MaplConfig(ratio=4), 200, timeout=600)
    u0, u1 = results[0]["projections"][0], results[1]["projections"][0]
    assert torch.equal(u0, u1)
    assert torch.equal(results[0]["anchors"][0], results[1]["anchors"][0])
    assert orthogonality_error(u0) <= 1e-5
    assert not results[0]["in_optimizer"], "U must not be trained by Adam (no weight decay)"
    initial = random_stiefel(
        TINY_GPT.hidden_size, TINY_GPT.hidden_size // 4, torch.Generator().manual_seed(1234 * 7919)
    )
    assert not torch.equal(u0, initial), "U must have been updated"
    losses = results[0]["losses"]
    assert sum(losses[-10:]) / 10 < 0.7 * sum(losses[:10]) / 10


def _norm_after_clipping(clip: float) -> dict:
    """One PP=2 step with --clip-grad ``clip``: the norm of everything the step applied, each trained quantity
    counted once (the receiving stage's anchors are replicas of the sender's, U counts on its sending stage)."""
    import torch.distributed as dist

    trainer = Trainer(TrainConfig(TINY_GPT, pipeline_parallel=2, lr=3e-3, clip_grad=clip, mapl=MaplConfig(ratio=4)))
    sync = trainer.mapl_sync
    applied = []
    manifold_step = sync.optimizer.step

    def recording(grads, lr_scale=1.0):
        applied.extend(g.detach().double().clone() for g in grads)
        return manifold_step(grads, lr_scale=lr_scale)

    sync.optimizer.step = recording
    result = trainer.train_step(synthetic_batches(TINY_GPT.vocab_size, TINY_GPT.seq_length, 2, seed=1))
    squares = torch.zeros((), dtype=torch.float64)
    for model in trainer.models:  # the parameters' clipped gradients (fp32 training: main_grad, clipped in place)
        for name, param in model.named_parameters():
            if "mapl_recv_" not in name:
                squares += param.main_grad.double().square().sum()
    sending = [stage.send.boundary for stage in trainer._mapl_stages if stage.send is not None]
    for boundary, grad in zip(sync.trainable, applied):
        if boundary.boundary in sending:
            squares += grad.square().sum()
    dist.all_reduce(squares)
    trainer.close()
    return dict(norm=float(squares.sqrt()), grad_norm=result["grad_norm"], u_steps=len(applied))


@pytest.mark.parametrize("clip", [1e-3, 3e-2])
def test_clip_grad_clips_u_and_the_anchors_once_with_every_other_gradient(clip):
    """After clipping, the gradient of everything trained (parameters, anchors once, U) has norm clip_grad:
    U's gradient is in the clipped norm and takes the same coefficient, the anchors' replicas count once."""
    for rank in run_distributed(_norm_after_clipping, 2, clip, timeout=120):
        assert rank["u_steps"] == 1 and rank["grad_norm"] > 3 * clip  # clipping was active
        assert rank["norm"] == pytest.approx(clip * rank["grad_norm"] / (rank["grad_norm"] + 1e-6), rel=1e-5)


def _anchors_at_the_start(tp: int, pp: int, mapl: MaplConfig) -> dict:
    """Every boundary's anchor projection (E + P) B on this rank, and on the first stage the whole embedding."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    trainer = Trainer(
        TrainConfig(TINY_GPT, tensor_parallel=tp, pipeline_parallel=pp, sequence_parallel=tp > 1, mapl=mapl)
    )
    tables = None
    if parallel_state.is_pipeline_first_stage():
        embedding = trainer._mapl_stages[0].module.embedding
        shard = embedding.word_embeddings.weight.detach().float()
        shards = [torch.empty_like(shard) for _ in range(tp)]
        dist.all_gather(shards, shard, group=parallel_state.get_tensor_model_parallel_group())
        tables = (torch.cat(shards).double(), embedding.position_embeddings.weight.detach().double())
    anchors = [
        (
            b.anchor_embedding.detach().double() @ b.anchor_basis.detach().double(),
            b.anchor_position.detach().double() @ b.anchor_basis.detach().double() if b.positions else None,
        )
        for b in trainer.mapl_boundaries
    ]
    trainer.close()
    return dict(tables=tables, anchors=anchors)


@pytest.mark.parametrize("anchor_rank", [TINY_GPT.hidden_size, 16], ids=["k=d", "k<d"])
def test_anchors_start_as_the_best_rank_k_approximation_of_the_embedding(anchor_rank):
    results = run_distributed(_anchors_at_the_start, 2, 1, 2, MaplConfig(ratio=4, anchor_rank=anchor_rank), timeout=120)
    word, position = results[0]["tables"]
    # float64 reference: project both tables on the top-k right singular vectors of the stacked tables
    right = torch.linalg.svd(torch.cat([word, position]), full_matrices=False)[2][:anchor_rank]
    projector = right.T @ right
    for rank, result in enumerate(results):
        ((tokens, positions),) = result["anchors"]
        scale = float(word.abs().max())
        assert float((tokens - word @ projector).abs().max()) <= 1e-5 * scale, rank
        assert float((positions - position @ projector).abs().max()) <= 1e-5 * scale, rank
    if anchor_rank == TINY_GPT.hidden_size:  # full rank: the anchors are the embedding itself
        assert torch.allclose(tokens, word, atol=1e-5 * scale) and torch.allclose(
            positions, position, atol=1e-5 * scale
        )


def test_anchors_start_identically_on_every_rank_of_a_tp2_pp2_layout():
    results = run_distributed(
        _anchors_at_the_start, 4, 2, 2, MaplConfig(ratio=4, anchor_rank=TINY_GPT.hidden_size), timeout=180
    )
    word, position = next(r["tables"] for r in results if r["tables"] is not None)
    first = results[0]["anchors"][0]
    for result in results:
        ((tokens, positions),) = result["anchors"]
        assert torch.equal(tokens, first[0]) and torch.equal(positions, first[1])
    # the vocabulary-parallel table was gathered: every row of the whole vocabulary is anchored
    assert torch.allclose(first[0], word, atol=1e-5 * float(word.abs().max()))


def test_random_anchor_start_keeps_the_seeded_noise():
    results = run_distributed(_anchors_at_the_start, 2, 1, 2, MaplConfig(ratio=4, anchor_init="random"), timeout=120)
    word, _ = results[0]["tables"]
    ((tokens, _),) = results[0]["anchors"]
    assert float((tokens - word).norm()) > 0.5 * float(word.norm())


def test_full_rank_mapl_trains_like_the_uncompressed_pipeline():
    """At r = d the projection is a rotation and the anchors cancel: losses match the uncompressed pipeline to
    fp32 rounding (a wrong anchor sign, a missing position term or a gradient path that leaks would not)."""
    base = run_distributed(_train, 2, None, 10, timeout=120)[0]["losses"]
    full = run_distributed(_train, 2, MaplConfig(ratio=1), 10, timeout=120)[0]["losses"]
    assert base[-1] < 0.9 * base[0]
    for step, (expected, got) in enumerate(zip(base, full)):
        assert abs(got - expected) <= 1e-4 * expected, (step, expected, got)


def _codec_operators_of_a_profiled_step() -> dict:
    from torch.profiler import ProfilerActivity, profile

    from megatron_taco.mapl.stage import CODEC_RANGE
    from megatron_taco.testing.profiling import codec_operators

    trainer = Trainer(
        TrainConfig(TINY_GPT, pipeline_parallel=2, micro_batch_size=2, num_microbatches=2, mapl=MaplConfig(ratio=4))
    )
    data = synthetic_batches(TINY_GPT.vocab_size, TINY_GPT.seq_length, 2, seed=1)
    trainer.train_step(data)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.train_step(data)
    trainer.close()
    events = prof.events()
    return dict(codec={op.name for op in codec_operators(events, CODEC_RANGE)}, all={e.name for e in events})


def test_a_profile_attributes_the_codec_forward_and_backward_and_none_of_the_model():
    backward = "autograd::engine::evaluate_function: "
    for rank, names in enumerate(run_distributed(_codec_operators_of_a_profiled_step, 2, timeout=120)):
        # the projection's GEMM and the anchor gather, forward and backward (the model's linears and
        # embeddings have other autograd nodes)
        assert {"aten::mm", "aten::index", backward + "MmBackward0", backward + "IndexBackward0"} <= names["codec"]
        model = {name for name in names["all"] if any(k in name for k in ("layer_norm", "LayerNorm", "oftmax"))}
        assert backward + "NativeLayerNormBackward0" in model, f"rank {rank}: the model's ops are in the profile"
        assert not names["codec"] & model, f"rank {rank}: model operators counted as codec"


@pytest.mark.parametrize("tp,pp,sp", [(1, 4, False), (2, 2, True)], ids=["pp4", "tp2-pp2-sp"])
def test_four_rank_layouts_train_with_identical_replicas(tp, pp, sp):
    results = run_distributed(_train, 4, MaplConfig(ratio=4), 15, tp, pp, sp, timeout=300)
    losses = results[0]["losses"]
    assert losses[-1] < losses[0]
    stage_of = lambda rank: rank // tp  # noqa: E731  (ranks: TP fastest, then PP)
    for boundary in range(pp - 1):
        holders = [r for r in range(4) if boundary in results[r]["projections"]]
        assert {stage_of(r) for r in holders} == {boundary, boundary + 1}
        for r in holders[1:]:
            assert torch.equal(results[r]["projections"][boundary], results[holders[0]]["projections"][boundary])


def _residual_like(gen: torch.Generator, shape, outliers: int = 4) -> torch.Tensor:
    """Heavy-tailed values (Student-t, 3 degrees of freedom: a normal over the root of a chi-square / 3) with a few
    channels 30x larger, as a residual stream."""
    chi_square = torch.randn(3, *shape, generator=gen).pow(2).sum(0)
    values = torch.randn(shape, generator=gen) / (chi_square / 3).sqrt()
    values[..., torch.randperm(shape[-1], generator=gen)[:outliers]] *= 30.0
    return values


@pytest.mark.parametrize("fp32_products", [False, True])
def test_products_in_bf16_round_far_below_the_int5_wire(fp32_products):
    """A bf16 model's projections multiply in bf16 (``fp32_products=False``, the default): z, the rebuilt h and U's
    gradient against float64 references of the same U and anchors. Observed relative errors 2.6e-3 (z), 2.9e-3
    (h), 3.1e-3 (U's gradient), signed bias <= 5e-5 of the mean magnitude; with fp32 products 1.7e-3, 1.7e-3,
    2.3e-3 (z and h leave in bf16, dL/dz arrives in bf16: that rounding stays), so bf16 products' total error is
    1.3-1.7x; the INT5 wire's own error on the same z is 4.7e-2 (15x the largest)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    d, r, vocab = 512, 192, 100  # d = 512 at 8x: the INT5 wire's rank
    codec = BoundaryCodec(
        hidden_size=d, rank=r, vocab_size=vocab, anchor_rank=16, seed=0, boundary=0, fp32_products=fp32_products
    ).bfloat16()  # as Float16Module casts it: anchors bf16, U fp32
    with torch.no_grad():
        codec.anchor_basis.normal_(0, 1.0)  # anchors of the hidden states' size, so their rounding shows
    tokens = torch.randint(0, vocab, (128, 2), generator=gen)
    hidden = _residual_like(gen, (128, 2, d)).bfloat16()
    u64 = codec.projection.detach().double().requires_grad_()
    anchors64 = codec.anchor_embedding[tokens].double() @ codec.anchor_basis.double()
    z64 = (hidden.double() - anchors64.detach()) @ u64
    weights = _residual_like(gen, (128, 2, r))  # a downstream gradient dL/dz
    (z64 * weights.double()).sum().backward()

    z = codec.project(hidden, tokens)
    (z.float() * weights).sum().backward()
    rebuilt = codec.reconstruct(z64.detach().bfloat16(), tokens, torch.bfloat16)
    rebuilt64 = z64.detach().bfloat16().double() @ u64.detach().T + anchors64.detach()

    def relative(x: torch.Tensor, reference: torch.Tensor) -> float:
        return float((x.double() - reference).norm() / reference.norm())

    def bias(x: torch.Tensor, reference: torch.Tensor) -> float:
        return float((x.double() - reference).mean() / reference.abs().mean())

    wire = NarrowIntCodec(r, 5)
    wire_error = relative(wire.decompress(wire.compress(z64.detach().float()), z.shape, torch.float32), z64.detach())
    errors = {
        "z": relative(z, z64.detach()),
        "h": relative(rebuilt, rebuilt64),
        "U's gradient": relative(codec.projection.grad, u64.grad),
    }
    biases = [bias(z, z64.detach()), bias(rebuilt, rebuilt64), bias(codec.projection.grad, u64.grad)]
    bound = 2.6e-3 if fp32_products else 3.5e-3
    assert max(errors.values()) <= bound, errors
    assert max(errors.values()) <= wire_error / 10, (errors, wire_error)
    assert max(map(abs, biases)) <= 1e-4, biases
    # fp16 keeps fp32 products: U's gradient, a sum over every token, could overflow fp16 under loss scaling
    assert codec._compute_dtype(torch.float16) == torch.float32


def test_position_anchors_are_exact_and_depend_on_the_position():
    """h = a(t, p) + z U^T goes through project / reconstruct unchanged; the same token at two positions
    gets two anchors (fp32, bound 1e-5 relative to |h|)."""
    codec = BoundaryCodec(hidden_size=64, rank=8, vocab_size=50, anchor_rank=16, seed=3, boundary=0, positions=32)
    with torch.no_grad():
        codec.anchor_position.normal_(0, 1.0)  # far from the small initial values, so positions matter
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 50, (32, 2), generator=gen)
    positions = torch.arange(32).unsqueeze(1).expand(32, 2)
    z = torch.randn(32, 2, 8, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        anchors = (
            codec.anchor_embedding[tokens].double() + codec.anchor_position[positions].double()
        ) @ codec.anchor_basis.double()
        hidden = anchors + z @ codec.projection.double().T
        rebuilt = codec.reconstruct(codec.project(hidden.float(), tokens, positions), tokens, torch.float32, positions)
        assert float((rebuilt.double() - hidden).norm() / hidden.norm()) <= 1e-5
        same_token = torch.full((32, 2), 7)
        moved = codec.reconstruct(torch.zeros(32, 2, 8), same_token, torch.float32, positions)
        assert not torch.allclose(moved[0], moved[1])
    without = BoundaryCodec(hidden_size=64, rank=8, vocab_size=50, anchor_rank=0, seed=3, boundary=0, positions=32)
    assert without.positions == 0, "position anchors share the token anchors' basis: none without anchors"


def test_context_anchors_are_exact_and_see_the_previous_tokens():
    """a = (E[t_i] + C_1[t_(i-1)] + C_2[t_(i-2)]) B, with row V standing for "before the start": h = a + z U^T
    goes through project / reconstruct unchanged (fp32, bound 1e-5 relative to |h|, float64 reference)."""
    vocab, seq = 50, 16
    codec = BoundaryCodec(hidden_size=64, rank=8, vocab_size=vocab, anchor_rank=16, seed=3, boundary=0, context=2)
    assert codec.anchor_context.shape == (2, vocab + 1, 16) and not codec.anchor_context.any(), "zero start"
    with torch.no_grad():
        codec.anchor_context.normal_(0, 1.0)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (2, seq), generator=gen)  # [b, s], as the data iterator gives them
    tokens = ids.T
    before = lambda j: torch.cat([torch.full((2, j), vocab), ids[:, : seq - j]], dim=1).T  # noqa: E731
    previous = torch.stack([before(1), before(2)])
    z = torch.randn(seq, 2, 8, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        coefficients = codec.anchor_embedding[tokens].double() + sum(
            codec.anchor_context[j].double()[previous[j]] for j in range(2)
        )
        hidden = coefficients @ codec.anchor_basis.double() + z @ codec.projection.double().T
        rebuilt = codec.reconstruct(
            codec.project(hidden.float(), tokens, None, previous), tokens, torch.float32, None, previous
        )
        assert float((rebuilt.double() - hidden).norm() / hidden.norm()) <= 1e-5
        shifted = codec.reconstruct(torch.zeros(seq, 2, 8), tokens, torch.float32, None, previous.roll(1, dims=1))
        assert not torch.allclose(
            shifted, codec.reconstruct(torch.zeros(seq, 2, 8), tokens, torch.float32, None, previous)
        )


def _previous_tokens_under_sequence_parallelism(ids):
    from types import SimpleNamespace

    from megatron.core import parallel_state

    from megatron_taco.mapl.stage import MaplStage
    from megatron_taco.megatron.cpu_runtime import enable_cpu_runtime

    enable_cpu_runtime()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model = torch.nn.Identity()
    model.config = SimpleNamespace(sequence_parallel=True)
    model.set_input_tensor = lambda tensor: None  # the GPTModel method MaplStage takes over
    codec = BoundaryCodec(hidden_size=8, rank=4, vocab_size=50, anchor_rank=4, seed=0, boundary=0, context=3)
    previous = MaplStage(model, codec, None)._previous(ids)
    parallel_state.destroy_model_parallel()
    return previous


def test_context_tokens_cross_the_sequence_parallel_split():
    """Each TP rank gets the previous tokens of its own sequence shard, its first rows included (their
    predecessors sit in the other rank's shard)."""
    ids = torch.arange(16).reshape(2, 8) + 10  # [b, s]
    shards = run_distributed(_previous_tokens_under_sequence_parallelism, 2, ids, timeout=60)
    for rank, previous in enumerate(shards):
        assert previous.shape == (3, 4, 2)  # [n, s / tp, b]
        for j in range(1, 4):
            for i in range(4):
                position = rank * 4 + i
                expected = ids[:, position - j] if position >= j else torch.full((2,), 50)
                assert torch.equal(previous[j - 1, i], expected), (rank, j, i)


def test_position_anchors_train_identically_on_both_sides_under_sequence_parallelism():
    mapl = MaplConfig(ratio=4, position_anchors=True, context_anchors=2)  # context tables: the same path
    results = run_distributed(_train, 4, mapl, 15, 2, 2, True, timeout=300)
    assert results[0]["losses"][-1] < results[0]["losses"][0]
    holders = [r for r in range(4) if 0 in results[r]["position_anchors"]]
    assert len(holders) == 4  # both TP ranks of both stages hold boundary 0's position anchors
    first = results[holders[0]]["position_anchors"][0]
    assert first.shape == (TINY_GPT.seq_length, 64)
    assert all(torch.equal(results[r]["position_anchors"][0], first) for r in holders[1:])
    context = results[holders[0]]["context_anchors"][0]
    assert context.shape == (2, TINY_GPT.padded_vocab_size(2) + 1, 64) and context.abs().sum() > 0, "trained"
    assert all(torch.equal(results[r]["context_anchors"][0], context) for r in holders[1:])


def _train_interleaved(steps, warmup_steps=0):
    mapl = MaplConfig(ratio=4, warmup_steps=warmup_steps)
    cfg = TrainConfig(TINY_GPT, pipeline_parallel=2, virtual_pipeline=2, lr=3e-3, mapl=mapl)
    trainer = Trainer(cfg)
    streams = [synthetic_batches(TINY_GPT.vocab_size, TINY_GPT.seq_length, 2, seed=1) for _ in range(2)]
    losses, shapes = [], []
    for _ in range(steps):
        with recording_p2p() as recorded:
            losses.append(trainer.train_step(streams)["loss"])
        shapes.append([shape for _, _, shape in recorded])
    projections = {b.boundary: b.projection.detach().clone() for b in trainer.mapl_boundaries}
    trainer.close()
    return losses, projections, shapes


def test_interleaved_schedule_carries_r_wide_tensors_at_every_boundary():
    results = run_distributed(_train_interleaved, 2, 20, timeout=300)
    (losses, u0, shapes0), (_, u1, shapes1) = results
    # 2 stages x 2 chunks: boundaries 0, 1, 2 (positions 0-1, 1-2, 2-3), each held by both ranks
    assert sorted(u0) == sorted(u1) == [0, 1, 2]
    assert all(torch.equal(u0[b], u1[b]) for b in u0)
    sent = [shape for step in shapes0 + shapes1 for shape in step]
    assert sent and all(s[-1] == TINY_GPT.hidden_size // 4 for s in sent)
    assert losses[-1] < losses[0]


def test_the_warm_up_sends_d_wide_at_every_interleaved_boundary_then_r_wide():
    """--mapl-warmup-steps 3 with 2 stages x 2 chunks: all three boundaries send h_rec + alpha (h - h_rec) d wide in
    steps 0-2 and z r wide from step 3 on (each step the same messages), every replica of U stays equal, it trains."""
    results = run_distributed(_train_interleaved, 2, 8, 3, timeout=300)
    (losses, u0, shapes0), (_, u1, shapes1) = results
    d, r = TINY_GPT.hidden_size, TINY_GPT.hidden_size // 4
    for shapes in (shapes0, shapes1):
        assert all(step and {s[-1] for s in step} == {d} for step in shapes[:3]), shapes
        assert all(len(step) == len(shapes[0]) and {s[-1] for s in step} == {r} for step in shapes[3:]), shapes
    assert sorted(u0) == sorted(u1) == [0, 1, 2] and all(torch.equal(u0[b], u1[b]) for b in u0)
    assert losses[-1] < losses[0]


def _train_pp4_per_boundary_ranks(steps, warmup_steps):
    mapl = MaplConfig(ranks=(32, 16, 8), anchor_rank=16, warmup_steps=warmup_steps)
    trainer = Trainer(TrainConfig(TINY_GPT, pipeline_parallel=4, lr=3e-3, mapl=mapl))
    data = synthetic_batches(TINY_GPT.vocab_size, TINY_GPT.seq_length, 2, seed=1)
    losses, widths, shape_messages, counted = [], [], [], []
    for _ in range(steps):
        MAPL_TELEMETRY.reset()
        with recording_p2p() as recorded:
            losses.append(trainer.train_step(data)["loss"])
        widths.append({shape[-1] for _, _, shape in recorded if len(shape) == 3})
        shape_messages.append(sum(dtype == torch.int64 and shape == (3,) for _, dtype, shape in recorded))
        sent = sum(math.prod(shape) * dtype.itemsize for op, dtype, shape in recorded if op == "isend")
        counted.append((sum(r.wire for r in MAPL_TELEMETRY.records.values()), sent))
    projections = {b.boundary: b.projection.detach().clone() for b in trainer.mapl_boundaries}
    trainer.close()
    return losses, projections, widths, shape_messages, counted


def test_each_boundary_can_have_its_own_rank_after_a_warm_up_that_sends_d_wide_without_shapes():
    """--mapl-ranks 32,16,8 with --mapl-warmup-steps 2 of 10 on PP=4: steps 0-1 send d wide, all one shape, so
    megatron-core sends no shape messages; from step 2 each boundary its own width, each message after its shape.
    MAPL's telemetry counts each step's bytes as the P2P sends them, shape messages included."""
    results = run_distributed(_train_pp4_per_boundary_ranks, 4, 10, 2, timeout=300)
    expected = {0: 32, 1: 16, 2: 8}
    for stage, (losses, projections, widths, shape_messages, counted) in enumerate(results):
        assert {b: u.shape[1] for b, u in projections.items()} == {
            b: r for b, r in expected.items() if b in (stage - 1, stage)
        }
        assert widths[:2] == [{TINY_GPT.hidden_size}] * 2 and shape_messages[:2] == [0, 0], (stage, widths)
        assert all(w == {expected[b] for b in projections} for w in widths[2:]), (stage, widths)
        assert all(n > 0 for n in shape_messages[2:]), (stage, shape_messages)
        assert all(telemetry == sent > 0 for telemetry, sent in counted), (stage, counted)  # shapes counted or not
    for b in expected:
        assert torch.equal(results[b][1][b], results[b + 1][1][b])
    assert results[0][0][-1] < results[0][0][0]


def test_projection_stays_an_fp32_leaf_through_moves_and_half_casts():
    codec = BoundaryCodec(
        hidden_size=16,
        rank=4,
        vocab_size=10,
        anchor_rank=2,
        seed=0,
        boundary=0,
        vq=ResidualVQ(4, 2, 8, 0.9, 0, 1e-3, seed=0),
    )
    initial = codec.projection.detach().clone()
    codec.bfloat16()  # what Float16Module does to the whole model
    assert torch.equal(codec.projection, initial), "U must not be rounded to bf16"
    assert codec.vq.codebooks.dtype == torch.float32 and codec.anchor_basis.dtype == torch.bfloat16
    z = codec.project(torch.randn(3, 1, 16, dtype=torch.bfloat16), torch.zeros(3, 1, dtype=torch.long))
    z.float().sum().backward()
    assert codec.projection.grad is not None and codec.projection.grad.dtype == torch.float32
    codec.to(torch.device("meta"))  # a device move (as to CUDA) must leave a leaf that collects gradients
    assert codec.projection.is_leaf and codec.projection.requires_grad and codec.projection.device.type == "meta"
    assert codec.vq.codebooks.device.type == "meta"


def test_fixed_projection_baseline_keeps_u():
    results = run_distributed(_train, 2, MaplConfig(ratio=4, fixed_projection=True, anchor_rank=0), 5, timeout=120)
    initial = random_stiefel(
        TINY_GPT.hidden_size, TINY_GPT.hidden_size // 4, torch.Generator().manual_seed(1234 * 7919)
    )
    assert torch.equal(results[0]["projections"][0], initial)


def _parse(argv):
    return mapl_config_from_args(add_mapl_args(argparse.ArgumentParser()).parse_args(argv))


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--mapl-ratio", "0.5"], "--mapl-ratio"),
        (["--mapl-rank", "0"], "--mapl-rank"),
        (["--mapl-ratio", "4", "--mapl-rank", "8"], "--mapl-ratio and --mapl-rank"),
        (["--mapl-ranks", "32,x"], "--mapl-ranks"),
        (["--mapl-ranks", "32,0"], "--mapl-ranks"),
        (["--mapl-ratio", "4", "--mapl-anchor-rank", "-1"], "--mapl-anchor-rank"),
        (["--mapl-ratio", "4", "--mapl-lr", "0"], "--mapl-lr"),
        (["--mapl-ratio", "4", "--mapl-momentum", "1"], "--mapl-momentum"),
        (["--mapl-ratio", "4", "--mapl-vq-levels", "-1"], "--mapl-vq-levels"),
        (["--mapl-ratio", "4", "--mapl-vq-levels", "2", "--mapl-vq-codes", "1"], "--mapl-vq-codes"),
        (["--mapl-ratio", "4", "--mapl-vq-levels", "2", "--mapl-vq-codes", "65536"], "--mapl-vq-codes"),
        (["--mapl-ratio", "4", "--mapl-vq-levels", "2", "--mapl-vq-decay", "1"], "--mapl-vq-decay"),
        (["--mapl-ratio", "4", "--mapl-vq-levels", "2", "--mapl-vq-sync-rows", "-3"], "--mapl-vq-sync-rows"),
        (["--mapl-ratio", "4", "--mapl-vq-levels", "2", "--mapl-vq-sync-tolerance", "-1"], "--mapl-vq-sync-tolerance"),
        (["--mapl-ratio", "4", "--mapl-position-anchors", "on", "--mapl-anchor-rank", "0"], "--mapl-position-anchors"),
        (["--mapl-ratio", "4", "--mapl-context-anchors", "-1"], "--mapl-context-anchors: invalid value -1"),
        (["--mapl-ratio", "4", "--mapl-warmup-steps", "-5"], "--mapl-warmup-steps: invalid value -5"),
        (
            ["--mapl-ratio", "4", "--mapl-context-anchors", "2", "--mapl-anchor-rank", "0"],
            "--mapl-context-anchors needs token anchors",
        ),
        (
            ["--mapl-ratio", "4", "--mapl-context-anchors", "2", "--mapl-fixed-projection"],
            "--mapl-context-anchors needs token anchors",
        ),
        (["--mapl-ratio", "8", "--mapl-wire", "fp8", "--mapl-vq-levels", "2"], "--mapl-wire fp8 and --mapl-vq-levels"),
        (["--mapl-ranks", "32,16", "--mapl-wire", "fp8"], "--mapl-wire fp8 needs one wire width"),
    ],
)
def test_invalid_mapl_flags_name_the_flag(argv, flag):
    with pytest.raises(MaplConfigError, match=flag):
        _parse(argv)


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--mapl-vq-levels", "2"], "--mapl-vq-levels"),
        (["--mapl-anchor-rank", "4", "--mapl-fixed-projection"], "--mapl-anchor-rank, --mapl-fixed-projection"),
        (["--mapl-position-anchors", "off"], "--mapl-position-anchors"),
        (["--mapl-anchor-init", "random"], "--mapl-anchor-init"),
        (["--mapl-context-anchors", "1"], "--mapl-context-anchors"),
        (["--mapl-wire", "fp8"], "--mapl-wire"),
        (["--mapl-warmup-steps", "100"], "--mapl-warmup-steps"),
    ],
)
def test_mapl_flags_without_a_rank_are_rejected(argv, named):
    with pytest.raises(MaplConfigError, match=f"{named} given without --mapl-ratio"):
        _parse(argv)


def test_an_unknown_anchor_start_is_rejected_naming_the_flag():
    with pytest.raises(SystemExit):  # argparse's choices: "argument --mapl-anchor-init: invalid choice"
        _parse(["--mapl-ratio", "4", "--mapl-anchor-init", "zeros"])
    with pytest.raises(MaplConfigError, match="--mapl-anchor-init"):
        MaplConfig(ratio=4, anchor_init="zeros")
    assert _parse(["--mapl-ratio", "4", "--mapl-anchor-init", "random"]).anchor_init == "random"


def test_invalid_mapl_combinations_with_the_model_are_rejected():
    assert _parse([]) is None
    with pytest.raises(MaplConfigError, match="--pipeline-model-parallel-size > 1"):
        TrainConfig(TINY_GPT, mapl=MaplConfig(ratio=4))
    with pytest.raises(MaplConfigError, match="--mapl-ratio: invalid value 7"):
        TrainConfig(TINY_GPT, pipeline_parallel=2, mapl=MaplConfig(ratio=7))
    with pytest.raises(MaplConfigError, match="--mapl-rank: invalid value 65"):
        TrainConfig(TINY_GPT, pipeline_parallel=2, mapl=MaplConfig(rank=65))
    with pytest.raises(MaplConfigError, match="--mapl-ranks: 2 values given for 3 pipeline boundaries"):
        TrainConfig(TINY_GPT, pipeline_parallel=4, mapl=MaplConfig(ranks=(8, 8)))
    with pytest.raises(MaplConfigError, match="--mapl-ranks: invalid value 99 for boundary 1"):
        TrainConfig(TINY_GPT, pipeline_parallel=4, mapl=MaplConfig(ranks=(8, 99, 8)))
    assert _parse(["--mapl-ranks", "32,16,8"]).ranks == (32, 16, 8)
    # the FP8 wire keeps a ratio's bytes per token: twice the rank (hidden 64: 8x -> 16 values of one byte)
    assert _parse(["--mapl-ratio", "8", "--mapl-wire", "fp8"]).wire_rank(64) == 16
    with pytest.raises(MaplConfigError, match=r"--mapl-ratio: invalid value 1; hidden size 64 x 2 \(--mapl-wire fp8\)"):
        MaplConfig(ratio=1, wire="fp8").wire_rank(64)
    with pytest.raises(MaplConfigError, match="--mapl-wire fp8: the wire rank 24 must be a multiple of 16"):
        fp8_wire_codec(24)
    with pytest.raises(MaplConfigError, match="--mapl-wire fp8 with --mapl-ratio: the wire rank 24 .* multiple of 16"):
        TrainConfig(
            dataclasses.replace(TINY_GPT, hidden_size=96), pipeline_parallel=2, mapl=MaplConfig(ratio=8, wire="fp8")
        )
    with pytest.raises(MaplConfigError, match="--mapl-wire: invalid value 'fp4'"):
        MaplConfig(ratio=8, wire="fp4")
    # the INT5 wire: the largest multiple of 16 values within 2d / R bytes (hidden 64 at 8x: 16 bytes; 16 values
    # take 12: 10 of codes, a scale byte, an exponent byte; 32 would take 22)
    assert _parse(["--mapl-ratio", "8", "--mapl-wire", "int5"]).wire_rank(64) == 16
    assert describe_compression(512, 192, NarrowIntCodec(192, 5), 2) == "8.06x in bytes: z as INT5 messages both ways"
    assert (MaplConfig(ratio=8, wire="int5").wire_rank(512), MaplConfig(ratio=1, wire="int5").wire_rank(64)) == (
        192,
        64,
    )
    with pytest.raises(
        MaplConfigError, match=r"--mapl-ratio 16 with --mapl-wire int5: 8 bytes per token .* not even 16"
    ):
        TrainConfig(TINY_GPT, pipeline_parallel=2, mapl=MaplConfig(ratio=16, wire="int5"))
    with pytest.raises(MaplConfigError, match="--mapl-wire int5 with --mapl-rank: the wire rank 24 .* multiple of 16"):
        TrainConfig(TINY_GPT, pipeline_parallel=2, mapl=MaplConfig(rank=24, wire="int5"))
    # the top-k wire: U square, the ratio sets k (hidden 64 at 8x: 16 bytes = 8 values, 8 6-bit indices, a scale)
    topk = _parse(["--mapl-ratio", "8", "--mapl-wire", "topk"])
    assert (topk.wire_rank(64), topk.topk_values(64)) == (64, 8)
    with pytest.raises(MaplConfigError, match="--mapl-wire topk with --mapl-rank: .* give --mapl-ratio"):
        _parse(["--mapl-rank", "16", "--mapl-wire", "topk"])
    with pytest.raises(MaplConfigError, match="--mapl-wire topk with --mapl-rank"):  # both: U would be d x r
        MaplConfig(rank=16, ratio=8, wire="topk")
    with pytest.raises(MaplConfigError, match=r"--mapl-ratio 64 with --mapl-wire topk: 2 bytes per token .* hold not"):
        TrainConfig(TINY_GPT, pipeline_parallel=2, mapl=MaplConfig(ratio=64, wire="topk"))
    rope = dataclasses.replace(TINY_GPT, position_embedding="rope")
    with pytest.raises(MaplConfigError, match="--mapl-position-anchors on: the model's position embedding is 'rope'"):
        TrainConfig(rope, pipeline_parallel=2, mapl=MaplConfig(ratio=4, position_anchors=True))
    assert not TrainConfig(rope, pipeline_parallel=2, mapl=MaplConfig(ratio=4)).mapl_position_anchors  # auto
    assert TrainConfig(TINY_GPT, pipeline_parallel=2, mapl=MaplConfig(ratio=4)).mapl_position_anchors  # auto
    assert not TrainConfig(TINY_GPT, pipeline_parallel=2, mapl=MaplConfig(ratio=4, anchor_rank=0)).mapl_position_anchors
    assert _parse(["--mapl-ratio", "4", "--mapl-position-anchors", "on"]).position_anchors is True
    assert _parse(["--mapl-ratio", "4", "--mapl-position-anchors", "off"]).position_anchors is False


def test_a_run_that_ends_inside_the_warm_up_says_so_at_start_up():
    """--train-iters <= --mapl-warmup-steps never compresses: the start-up line says so (not an error: a run that a
    later one resumes with more iterations may stop inside the warm-up on purpose)."""
    cfg = _parse(["--mapl-ratio", "4", "--mapl-warmup-steps", "20"])
    assert cfg.describe_warmup(20, 64).endswith("; --train-iters 20 ends inside the warm-up: this run never compresses")
    assert "ends inside" not in cfg.describe_warmup(21, 64) and "ends inside" not in cfg.describe_warmup(None, 64)
    assert _parse(["--mapl-ratio", "4"]).describe_warmup(5, 64) == ""


def test_the_warm_up_goes_on_the_codec_wire_where_d_fits_its_groups():
    """The FP8 / INT5 wire carries the warm-up's d-wide messages in its codec at rank d; a hidden size not in groups
    of 16 (--mapl-wire auto may pick INT5 there) and the other wires send them in the pipeline dtype, as the start-up
    line says."""
    int5 = _parse(["--mapl-ratio", "8", "--mapl-wire", "int5", "--mapl-warmup-steps", "4"])
    assert isinstance(warm_up_wire_codec(int5, 512), NarrowIntCodec)
    assert "d wide on the INT5 wire," in int5.describe_warmup(8, 512)
    assert warm_up_wire_codec(int5, 100) is None
    assert "in the pipeline dtype (hidden size 100: not in groups of 16" in int5.describe_warmup(8, 100)
    bf16 = _parse(["--mapl-ratio", "8", "--mapl-wire", "bf16", "--mapl-warmup-steps", "4"])
    assert warm_up_wire_codec(bf16, 512) is None and "d wide in the pipeline dtype," in bf16.describe_warmup(8, 512)
    no_warm_up = _parse(["--mapl-ratio", "8", "--mapl-wire", "int5"])
    assert warm_up_wire_codec(no_warm_up, 512) is None and not no_warm_up.warm_up_on_wire(512)
