"""MAPL residual VQ: index packing, quantizer numerics against float64, EMA learning, the index wire,
codebook synchronisation between the two sides of a boundary (real gloo ranks)."""

import pytest
import torch
import torch.distributed as dist

from megatron_taco.config.mapl import MaplConfig, MaplConfigError
from megatron_taco.mapl.vq import ResidualVQ, index_bytes, pack_indices, packed_width, unpack_indices
from megatron_taco.testing.distributed import DistributedTestError, run_distributed
from megatron_taco.testing.models import TINY_GPT
from megatron_taco.testing.p2p import recording_p2p
from megatron_taco.testing.tensors import DISTRIBUTIONS
from megatron_taco.training.data import synthetic_batches
from megatron_taco.training.loop import TrainConfig, Trainer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("levels,codes", [(1, 2), (3, 255), (2, 256), (3, 65535)])
def test_indices_survive_packing_into_the_pipeline_dtype(dtype, levels, codes):
    gen = torch.Generator().manual_seed(levels * codes)
    indices = torch.randint(0, codes + 1, (5, 3, levels), generator=gen)  # codes itself: the non-finite sentinel
    indices[0, 0] = codes
    packed = pack_indices(indices, codes, dtype)
    assert packed.dtype == dtype and packed.shape == (5, 3, packed_width(levels, codes, dtype))
    assert packed.numel() * packed.element_size() >= indices.numel() * index_bytes(codes)
    assert packed.numel() * packed.element_size() < indices.numel() * index_bytes(codes) + 5 * 3 * packed.element_size()
    assert torch.equal(unpack_indices(packed.clone(), levels, codes), indices)


def _quantizer(dim=16, levels=2, codes=32, decay=0.5, sync_rows=0, tolerance=0.0):
    return ResidualVQ(dim, levels, codes, decay, sync_rows, tolerance, seed=3)


def _fit(vq, data, steps):
    """EMA k-means on one process: what the sender and receiver do, minus the wire."""
    for _ in range(steps):
        vq.encode(data, record=True)
        target = vq.update_targets(())
        rows = vq.changed_rows(target)
        vq.codebooks.view(-1, vq.dim)[rows] = target.reshape(-1, vq.dim)[rows]


@pytest.mark.parametrize("kind", sorted(DISTRIBUTIONS))
def test_encode_picks_the_float64_nearest_code_and_decode_inverts_it(kind):
    gen = torch.Generator().manual_seed(11)
    z = DISTRIBUTIONS[kind]((256, 16), gen)
    vq = _quantizer()
    _fit(vq, z, 20)
    indices, quantized = vq.encode(z, record=False)
    assert torch.equal(vq.decode(indices), quantized), "receiver's decode must equal the sender's z_q bit for bit"
    # each level's choice is the float64 nearest code, up to fp32 rounding of the distances
    residual = z.double()
    for level, book in enumerate(vq.codebooks.double()):
        chosen = (residual - book[indices[:, level]]).square().sum(1)
        nearest = torch.cdist(residual, book).square().min(1).values
        scale = residual.square().sum(1) + book.square().sum(1).max()
        assert torch.all(chosen - nearest <= 1e-5 * scale), (kind, level)
        residual = residual - book[indices[:, level]]
    assert torch.allclose(quantized.double(), z.double() - residual, rtol=0, atol=1e-5 * float(z.abs().max()))


def test_ema_learning_lowers_the_error_and_more_levels_lower_it_further():
    gen = torch.Generator().manual_seed(5)
    centres = torch.randn(8, 16, generator=gen) * 3
    z = centres[torch.randint(0, 8, (2048,), generator=gen)] + 0.3 * torch.randn(2048, 16, generator=gen)
    errors = {}
    for levels in (1, 2):
        vq = _quantizer(levels=levels, codes=16)
        _fit(vq, z, 30)
        _, quantized = vq.encode(z, record=False)
        errors[levels] = float((quantized - z).norm() / z.norm())
    # 8 clusters of spread 0.3 around centres of norm ~12: one 16-code level must find the clusters
    assert errors[1] < 0.15, errors
    # level 2 quantizes the 16-dim Gaussian within-cluster noise with 16 codes: a modest but real gain
    assert errors[2] < 0.9 * errors[1], errors


def test_non_finite_tokens_decode_to_nan_and_stay_out_of_the_statistics():
    vq = _quantizer()
    _fit(vq, torch.randn(64, 16), 3)
    z = torch.randn(6, 16)
    z[1, 3] = float("nan")
    z[4, 0] = float("inf")
    counts_before = vq.step_count.sum()
    indices, quantized = vq.encode(z, record=True)
    assert torch.equal(indices[1], torch.full((2,), 32)) and torch.equal(indices[4], torch.full((2,), 32))
    decoded = vq.decode(indices)
    assert torch.isnan(decoded[[1, 4]]).all() and torch.isfinite(decoded[[0, 2, 3, 5]]).all()
    assert torch.equal(torch.isnan(decoded), torch.isnan(quantized))
    assert torch.equal(decoded[[0, 2, 3, 5]], quantized[[0, 2, 3, 5]])
    assert float(vq.step_count.sum() - counts_before) == 4 * 2  # four finite tokens, two levels
    assert torch.isfinite(vq.step_sum).all()


def test_the_warm_ups_z_q_is_what_the_receiver_decodes_and_passes_zs_gradient():
    """--mapl-warmup-steps with VQ: the sender rebuilds h_rec itself from z_q, so z_q must be the receiver's
    (``dequantize``: fp32 codebook sums) bit for bit, not z_q rounded to a bf16 pipeline's dtype; the gradient goes
    to z unchanged (straight-through). On the index wire z_q stays in the pipeline dtype with its indices."""
    from megatron_taco.mapl.boundary import BoundaryCodec

    codec = BoundaryCodec(hidden_size=64, rank=16, vocab_size=50, anchor_rank=0, seed=3, boundary=0, vq=_quantizer())
    z = (torch.randn(4, 2, 16) * 3).to(torch.bfloat16).requires_grad_()
    _fit(codec.vq, torch.randn(256, 16) * 3, 3)  # codebooks that are not all zero
    indices, decoded = codec.vq.encode(z, record=False)
    warm = codec.quantize(z, None)
    assert warm.dtype == torch.float32 and torch.equal(warm, decoded) and not hasattr(warm, "mapl_indices")
    assert not torch.equal(decoded.to(torch.bfloat16).float(), decoded)  # the rounding the warm-up must not add
    gradient = torch.randn(4, 2, 16)
    warm.backward(gradient)
    assert torch.equal(z.grad, gradient.to(torch.bfloat16))
    wired = codec.quantize(z, torch.bfloat16)
    assert wired.dtype == torch.bfloat16 and torch.equal(unpack_indices(wired.mapl_indices, 2, 32), indices)


def _train_vq(steps, mapl, tp=1, pp=2, sp=False):
    cfg = TrainConfig(TINY_GPT, tensor_parallel=tp, pipeline_parallel=pp, sequence_parallel=sp, lr=3e-3, mapl=mapl)
    trainer = Trainer(cfg)
    data = synthetic_batches(TINY_GPT.vocab_size, TINY_GPT.seq_length, cfg.micro_batch_size, seed=1)
    losses, rows, books = [], [], []
    with recording_p2p() as recorded:
        for _ in range(steps):
            stats = trainer.train_step(data)
            losses.append(stats["loss"])
            rows.append(stats["codebook_rows"])
            books.append({b.boundary: b.vq.codebooks.clone() for b in trainer.mapl_boundaries})
    trainer.close()
    return dict(losses=losses, rows=rows, books=books, wire=recorded)


def test_indices_forward_r_wide_gradients_back_and_identical_codebooks_every_step():
    mapl = MaplConfig(ratio=4, vq_levels=2, vq_codes=32)
    first, last = run_distributed(_train_vq, 2, 30, mapl, timeout=300)
    d, r, s, b = TINY_GPT.hidden_size, TINY_GPT.hidden_size // 4, TINY_GPT.seq_length, 2
    width = packed_width(2, 32, torch.float32)  # 2 one-byte indices in one fp32 element
    # stage 0 sends indices and receives r-wide gradients; stage 1 the reverse
    assert {(k, shape) for k, _, shape in first["wire"]} == {("isend", (s, b, width)), ("irecv", (s, b, r))}
    assert {(k, shape) for k, _, shape in last["wire"]} == {("irecv", (s, b, width)), ("isend", (s, b, r))}
    assert width * 4 == 4 and r * 4 * 2 < d * 4  # 4 bytes/token forward (was 256), 64 bytes/token back
    for step, (mine, theirs) in enumerate(zip(first["books"], last["books"])):
        assert torch.equal(mine[0], theirs[0]), f"codebooks differ after step {step + 1}"
    assert first["rows"] == last["rows"] and first["rows"][0] == 2 * 32  # every code word starts from the data
    assert sum(first["rows"][-5:]) < 5 * 2 * 32, "settled code words must stop being re-sent"
    losses = first["losses"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5


def test_sync_budget_streams_at_most_that_many_code_words_per_step():
    mapl = MaplConfig(ratio=4, vq_levels=2, vq_codes=32, vq_sync_rows=5)
    first, last = run_distributed(_train_vq, 2, 8, mapl, timeout=300)
    assert first["rows"] == [5] * 8
    for mine, theirs in zip(first["books"], last["books"]):
        assert torch.equal(mine[0], theirs[0])


def test_tp2_pp2_sequence_parallel_keeps_every_pair_identical():
    results = run_distributed(_train_vq, 4, 6, MaplConfig(ratio=4, vq_levels=1, vq_codes=16), 2, 2, True, timeout=300)
    # ranks: TP fastest, then PP; pairs (0, 2) and (1, 3); SP statistics are summed over TP
    final = [r["books"][-1][0] for r in results]
    assert all(torch.equal(final[0], book) for book in final[1:])
    assert results[0]["losses"][-1] < results[0]["losses"][0]


def _train_vq_interleaved(steps):
    cfg = TrainConfig(
        TINY_GPT, pipeline_parallel=2, virtual_pipeline=2, lr=3e-3, mapl=MaplConfig(ratio=4, vq_levels=2, vq_codes=32)
    )
    trainer = Trainer(cfg)
    streams = [synthetic_batches(TINY_GPT.vocab_size, TINY_GPT.seq_length, 2, seed=1) for _ in range(2)]
    with recording_p2p() as recorded:
        losses = [trainer.train_step(streams)["loss"] for _ in range(steps)]
    books = {b.boundary: b.vq.codebooks.clone() for b in trainer.mapl_boundaries}
    trainer.close()
    return losses, books, {shape[-1] for _, _, shape in recorded}


def test_interleaved_schedule_sends_indices_at_every_chunk_boundary():
    (losses, books0, widths0), (_, books1, widths1) = run_distributed(_train_vq_interleaved, 2, 8, timeout=300)
    assert sorted(books0) == sorted(books1) == [0, 1, 2]  # 2 stages x 2 chunks: 3 boundaries, both ranks hold each
    assert all(torch.equal(books0[b], books1[b]) for b in books0)
    # forward: 2 one-byte indices in one fp32 element; backward: r = 16 wide
    assert widths0 == widths1 == {packed_width(2, 32, torch.float32), TINY_GPT.hidden_size // 4}
    assert all(torch.isfinite(torch.tensor(losses)))


def _vq_mismatch():
    codes = 32 if dist.get_rank() == 0 else 64
    Trainer(TrainConfig(TINY_GPT, pipeline_parallel=2, mapl=MaplConfig(ratio=4, vq_levels=2, vq_codes=codes)))
    return "no error"


def test_vq_settings_that_disagree_fail_on_both_sides():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_vq_mismatch, 2, timeout=60)
    assert "VQ 2 levels x 32 codes" in str(info.value) and "VQ 2 levels x 64 codes" in str(info.value)


def test_vq_needs_one_width_for_every_boundary():
    with pytest.raises(MaplConfigError, match="--mapl-vq-levels 2 needs one wire width"):
        TrainConfig(TINY_GPT, pipeline_parallel=4, mapl=MaplConfig(ranks=(32, 16, 8), vq_levels=2))


def test_statistics_summed_in_token_chunks_match_a_float64_reference(monkeypatch):
    """The per-code sums behind the EMA, with the one-hot matmul split into many token chunks (as for a large
    codebook), against float64 index_add_ sums; bound 1e-5 relative to each sum's scale."""
    import megatron_taco.mapl.vq as vq_module

    monkeypatch.setattr(vq_module, "_ONE_HOT_ELEMENTS", 32 * 7)  # 7 tokens per chunk at 32 codes
    vq = _quantizer(dim=8, levels=1, codes=32)
    index = torch.randint(0, 32, (100,), generator=torch.Generator().manual_seed(4))
    values = DISTRIBUTIONS["student_t3"]((100, 10), torch.Generator().manual_seed(5))
    reference = torch.zeros(32, 10, dtype=torch.float64).index_add_(0, index, values.double())
    scale = torch.zeros(32, 10, dtype=torch.float64).index_add_(0, index, values.double().abs())
    assert torch.all((vq._per_code_sums(index, values).double() - reference).abs() <= 1e-5 * (scale + 1e-12))


def _vq_with_a_skipped_step():
    cfg = TrainConfig(TINY_GPT, tensor_parallel=1, pipeline_parallel=2, lr=3e-3, mapl=MaplConfig(ratio=4, vq_levels=2))
    trainer = Trainer(cfg)
    data = synthetic_batches(TINY_GPT.vocab_size, TINY_GPT.seq_length, cfg.micro_batch_size, seed=1)
    trainer.train_step(data)
    before = [b.vq.codebooks.clone() for b in trainer.mapl_boundaries]
    for optimizer in trainer.optimizer.chained_optimizers:  # the step an fp16 overflow makes megatron-core skip
        optimizer.prepare_grads = lambda: True
    rows = trainer.train_step(data)["codebook_rows"]
    after = [b.vq.codebooks.clone() for b in trainer.mapl_boundaries]
    left = [float(b.vq.step_count.sum()) for b in trainer.mapl_boundaries]
    trainer.close()
    return before, after, rows, left


def test_a_skipped_optimizer_step_skips_the_codebook_step_too():
    """The codebooks learn from the steps the model learns from: a skipped step's statistics are dropped."""
    for before, after, rows, left in run_distributed(_vq_with_a_skipped_step, 2, timeout=300):
        assert all(torch.equal(a, b) for a, b in zip(before, after)) and rows == 0 and left == [0.0]
