"""CPU runtime, SP-capable norm, and TP/SP/PP training equivalence on real megatron-core + gloo."""

import pytest
import torch

from megatron_taco.testing.distributed import run_distributed
from megatron_taco.testing.models import TINY_GPT, TINY_QWEN
from megatron_taco.training.data import synthetic_batches
from megatron_taco.training.loop import TrainConfig, train


class _Cfg:
    def __init__(self, normalization, sequence_parallel=True):
        self.normalization = normalization
        self.sequence_parallel = sequence_parallel
        self.params_dtype = torch.float32


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_sequence_parallel_norm_matches_float64_reference(normalization):
    from megatron_taco.megatron.norms import SequenceParallelNorm

    norm = SequenceParallelNorm(_Cfg(normalization), 96, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
        if norm.bias is not None:
            norm.bias.normal_()
    x = torch.randn(7, 3, 96) * 5 + 2
    x[..., 5] *= 100  # an outlier channel
    x64 = x.double()
    if normalization == "LayerNorm":
        ref = (x64 - x64.mean(-1, keepdim=True)) / torch.sqrt(x64.var(-1, unbiased=False, keepdim=True) + 1e-5)
        ref = ref * norm.weight.double() + norm.bias.double()
    else:
        ref = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    out = norm(x).double()
    assert torch.linalg.norm(out - ref) / torch.linalg.norm(ref) < 1e-6
    assert all(p.sequence_parallel for p in norm.parameters())


def test_norm_rejects_unsupported_normalization():
    from megatron_taco.megatron.norms import SequenceParallelNorm

    with pytest.raises(ValueError, match="L2Norm"):
        SequenceParallelNorm(_Cfg("L2Norm"), 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: checks the CPU runtime refuses a GPU machine")
def test_cpu_runtime_refuses_on_gpu():
    from megatron_taco.megatron.cpu_runtime import enable_cpu_runtime

    with pytest.raises(RuntimeError, match="without CUDA"):
        enable_cpu_runtime()


def _train_losses(shape, tp, pp, sp, steps, lr=1e-3, vpp=None):
    cfg = TrainConfig(
        shape, tensor_parallel=tp, pipeline_parallel=pp, sequence_parallel=sp, lr=lr, virtual_pipeline=vpp
    )
    streams = [
        synthetic_batches(shape.vocab_size, shape.seq_length, cfg.micro_batch_size, seed=7) for _ in range(vpp or 1)
    ]
    return train(cfg, steps, streams if vpp else streams[0])


_LAYOUTS = {  # name: (tp, pp, sp, world, virtual pipeline chunks)
    "tp2_sp": (2, 1, True, 2, None),
    "tp2_nosp": (2, 1, False, 2, None),
    "pp2": (1, 2, False, 2, None),
    "pp2_interleaved": (1, 2, False, 2, 2),
    "tp2_pp2_sp": (2, 2, True, 4, None),
}


@pytest.fixture(scope="module")
def reference_losses():
    return {
        name: run_distributed(_train_losses, 1, shape, 1, 1, False, 3, timeout=120)[0]
        for name, shape in (("gpt", TINY_GPT), ("qwen", TINY_QWEN))
    }


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_parallel_layouts_match_single_rank_loss(layout, reference_losses):
    tp, pp, sp, world, vpp = _LAYOUTS[layout]
    losses = run_distributed(_train_losses, world, TINY_GPT, tp, pp, sp, 3, 1e-3, vpp, timeout=180)
    for rank_losses in losses:  # every rank reports the same loss sequence
        assert rank_losses == losses[0]
    ref = reference_losses["gpt"]
    assert len(losses[0]) == 3
    assert max(abs(a - b) for a, b in zip(losses[0], ref)) <= 1e-6, (losses[0], ref)


def test_qwen_style_tp2_sp_matches_single_rank_loss(reference_losses):
    losses = run_distributed(_train_losses, 2, TINY_QWEN, 2, 1, True, 3, timeout=180)
    ref = reference_losses["qwen"]
    assert max(abs(a - b) for a, b in zip(losses[0], ref)) <= 1e-6, (losses[0], ref)


def test_loss_decreases_with_tp2_sp():
    losses = run_distributed(_train_losses, 2, TINY_GPT, 2, 1, True, 30, 3e-3, timeout=240)[0]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses


def test_invalid_layouts_are_rejected():
    with pytest.raises(ValueError, match="sequence-parallel"):
        TrainConfig(TINY_GPT, tensor_parallel=1, sequence_parallel=True)
    with pytest.raises(ValueError, match="dtype"):
        TrainConfig(TINY_GPT, dtype="fp64")
    with pytest.raises(ValueError, match="virtual pipeline"):
        TrainConfig(TINY_GPT, virtual_pipeline=2)
    with pytest.raises(ValueError, match="do not split"):
        TrainConfig(TINY_GPT, pipeline_parallel=2, virtual_pipeline=3)
    with pytest.raises(ValueError, match="divisible"):
        TrainConfig(TINY_GPT, pipeline_parallel=2, virtual_pipeline=2, num_microbatches=3)


def test_text_goes_through_a_megatron_core_indexed_dataset(tmp_path):
    import pathlib

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_taco.training.data import build_token_dataset, indexed_dataset_batches

    files = []
    for i, text in enumerate(["def f():\n    return 1\n", "", "class A:\n    pass\n" * 20]):
        path = pathlib.Path(tmp_path) / f"f{i}.py"
        path.write_text(text)
        files.append(path)
    prefix = build_token_dataset(files, str(tmp_path / "ds"))
    dataset = IndexedDataset(prefix)
    assert len(dataset) == 2  # the empty file adds no document
    assert bytes(dataset[0].tolist()) == b"def f():\n    return 1\n"
    batch = next(indexed_dataset_batches(prefix, 16, 3, seed=1))
    assert batch["tokens"].shape == (3, 16) and torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    text = b"".join(p.read_bytes() for p in files)
    for row in batch["tokens"]:
        assert bytes(row.tolist()) in text


def test_a_bpe_vocabulary_trained_on_the_training_files_round_trips_their_text(tmp_path, monkeypatch):
    import pathlib

    Tokenizer = pytest.importorskip("tokenizers", reason="the dev extra installs tokenizers").Tokenizer

    from megatron_taco.training.data import bpe_text_batches, stdlib_text_files, train_bpe_vocabulary

    monkeypatch.setenv("MEGATRON_TACO_CACHE", str(tmp_path / "cache"))
    train_files = stdlib_text_files()[0][:40]
    vocabulary = train_bpe_vocabulary(train_files, 600)
    assert train_bpe_vocabulary(train_files, 600) == vocabulary  # cached: the same file, not retrained
    tokenizer = Tokenizer.from_file(vocabulary)
    assert tokenizer.get_vocab_size() == 600
    held_out = pathlib.Path(tmp_path) / "held_out.py"
    held_out.write_text("def held_out(x):\n    return [x ** 2 for _ in range(3)]  # \u00e9t\u00e9\n" * 30)
    batch = next(bpe_text_batches([held_out], vocabulary, 24, 2, seed=1))
    assert batch["tokens"].shape == (2, 24) and int(batch["tokens"].max()) < 600
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    text = held_out.read_text()
    for row in batch["tokens"]:
        # windows of the file's token stream decode to its text (a window may cut a 2-byte character)
        assert tokenizer.decode(row.tolist()).strip("\ufffd") in text
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text
    assert len(ids) < 0.65 * len(text.encode())  # 344 merges learnt from Python code compress it (0.59 seen)
    with pytest.raises(ValueError, match="257-65536"):
        train_bpe_vocabulary(train_files, 256)
