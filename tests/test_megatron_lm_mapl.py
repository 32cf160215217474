"""MAPL inside Megatron-LM's own training functions (CPU, gloo, PP=2), through the launcher's hooks.

Each rank does what Megatron-LM's pretrain_gpt.py and ``megatron.training.training`` do, with the functions
those modules hold after the hooks: Megatron-LM's parser, ``GPTModelBuilder``, megatron-core's DDP,
``training.get_megatron_optimizer``, ``core.utils.get_batch_on_this_tp_rank``, ``training.finalize_model_grads``
and ``training.get_forward_backward_func`` (the 1F1B schedule), then ``optimizer.step()``.
"""

import pytest
import torch

import megatron_taco.launch  # noqa: F401  (its Python 3.11 shim lets megatron.training import)
from megatron_taco.testing.distributed import DistributedTestError, run_distributed

try:
    import megatron.training.models.gpt  # noqa: F401
except ImportError:
    pytest.skip(
        "needs Megatron-LM's training package with its model builder (the megatron-core 0.19 wheel)",
        allow_module_level=True,
    )

SEQ, MICRO_BATCH, MICRO_BATCHES, VOCAB = 16, 2, 2, 128
# the bf16 distributed-optimizer run's largest relative loss difference to the fp32 DDP run over 3 steps: 0.00055
# observed on CPU on 2026-12-05 (megatron-core 0.19.2), bound at about 3x
BF16_LOSS_DRIFT = 0.0015
FLAGS = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    str(SEQ),
    "--max-position-embeddings",
    str(SEQ),
    "--transformer-impl",
    "local",
    "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm",
    "--no-masked-softmax-fusion",
    "--no-rope-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--pipeline-model-parallel-size",
    "2",
    "--micro-batch-size",
    str(MICRO_BATCH),
    "--global-batch-size",
    str(MICRO_BATCH * MICRO_BATCHES),
    "--lr",
    "1e-2",
    "--seed",
    "1234",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--vocab-size",
    str(VOCAB),
]


def _megatron_lm_steps(
    mapl_flags,
    steps,
    rerun_steps=(),
    config_overrides=None,
    distributed_optimizer=False,
    overlap=False,
    tensor_parallel=1,
    reload_after=None,
    bf16=False,
):
    """``rerun_steps``: the steps whose forward-backward runs twice on the same micro-batches, each run after zeroing
    the gradients, as ``train_step``'s loop does when Megatron-LM's rerun state machine re-runs a step.
    ``config_overrides``: TransformerConfig fields a custom model provider would set. ``distributed_optimizer``:
    megatron-core's DistributedOptimizer (gradients reduce-scattered over data-parallel ranks, each updating its
    shard). ``overlap``: with it, --overlap-grad-reduce and --overlap-param-gather in buckets of 4096 elements, and
    each read of the anchors checks that no all-gather of their parameters is in flight. Data-parallel ranks draw
    their own micro-batches; the stages of a pipeline the same. ``tensor_parallel`` > 1: with --sequence-parallel.
    ``reload_after``: after that step the optimizer loads its own state dict (as a checkpoint load calls it).
    ``bf16``: --bf16, the model in Megatron-LM's Float16Module, bf16 gradient buffers."""
    import sys

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_taco.launch import install_hooks
    from megatron_taco.megatron.cpu_runtime import cpu_config_overrides, enable_cpu_runtime
    from megatron_taco.megatron.specs import LOCAL_SPEC_CONFIG
    from megatron_taco.testing.p2p import recording_p2p

    install_hooks()  # what the launcher and the patch do before the training script imports anything
    import megatron.core.utils as core_utils
    from megatron.training import arguments, global_vars, training
    from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig

    tp = ["--tensor-model-parallel-size", str(tensor_parallel), "--sequence-parallel"] if tensor_parallel > 1 else []
    sys.argv = ["pretrain_gpt.py", *FLAGS, *tp, *mapl_flags, *(["--bf16"] if bf16 else [])]
    args = arguments.parse_args()
    args.params_dtype = torch.bfloat16 if bf16 else torch.float32  # what Megatron-LM's validate_args sets, and
    args.overlap_p2p_comm = False  # for the non-interleaved schedule
    global_vars.set_args(args)
    enable_cpu_runtime()
    parallel_state.initialize_model_parallel(tensor_parallel, 2)
    model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    config = arguments.core_transformer_config_from_args(args)
    for key, value in {**LOCAL_SPEC_CONFIG, **cpu_config_overrides(), **(config_overrides or {})}.items():
        setattr(config, key, value)
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    model = GPTModelBuilder(GPTModelConfig(transformer=config, vocab_size=VOCAB, seq_length=SEQ)).build_model(
        ProcessGroupCollection.use_mpu_process_groups(), pre_process=first, post_process=last
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not bf16,  # bf16: Megatron-LM's default (no --accumulate-allreduce-grads-in-fp32)
        use_distributed_optimizer=distributed_optimizer,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
        bucket_size=4096 if overlap else None,
    )
    if bf16:  # as Megatron-LM's get_model wraps it
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    chunks = [DistributedDataParallel(config, ddp_config, model)]
    optimizer = training.get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            clip_grad=args.clip_grad,
            use_distributed_optimizer=distributed_optimizer,
            overlap_param_gather=overlap,
        ),
        chunks,
    )
    reads = {"anchor_reads": 0, "anchor_reads_in_flight": 0}

    def count_anchor_reads(codec, inputs):  # runs after DDP's pre-hook, registered before it
        buckets = {chunks[0].param_to_bucket_group[p] for p in codec.parameters(recurse=False) if p.requires_grad}
        reads["anchor_reads"] += 1
        reads["anchor_reads_in_flight"] += sum(bucket.param_gather_handle is not None for bucket in buckets)

    if overlap:
        for codec in (m for name, m in model.named_children() if name.startswith("mapl_")):
            codec.register_forward_pre_hook(count_anchor_reads)
    config.finalize_model_grads_func = training.finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = chunks[0].no_sync
    schedule = training.get_forward_backward_func()
    codecs = [m for name, m in model.named_children() if name.startswith("mapl_")]

    # every stage draws its data-parallel rank's micro-batches, like Megatron-LM's loaders;
    gen = torch.Generator().manual_seed(7 + parallel_state.get_data_parallel_rank())
    # the same ones every step, so the loss must fall
    batches = [torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=gen) for _ in range(MICRO_BATCHES)]
    tokens_seen = []

    def forward_step(data_iterator, model):
        sample = next(data_iterator)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        batch = (
            {  # read on TP rank 0 only, contiguous as a loader's; the others receive it (pretrain_gpt.py's get_batch)
                "tokens": sample[:, :-1].contiguous(),
                "labels": sample[:, 1:].contiguous(),
                "loss_mask": torch.ones(MICRO_BATCH, SEQ),
                "position_ids": torch.arange(SEQ).repeat(MICRO_BATCH, 1),
                "attention_mask": None,
            }
            if tp_rank == 0
            else {}
        )
        batch = core_utils.get_batch_on_this_tp_rank(  # as pretrain_gpt.py calls it
            batch,
            has_cu_seqlens=False,
            is_hybrid_cp=False,
            create_attention_mask_in_dataloader=False,
            broadcast_src_rank=parallel_state.get_tensor_model_parallel_src_rank(),
            broadcast_group=parallel_state.get_tensor_model_parallel_group(),
            cp_size=1,
            tp_rank=tp_rank,
            micro_batch_size=MICRO_BATCH,
            seq_length=SEQ,
            mtp_on_this_rank=False,
            pipeline_model_parallel_size=2,
            is_pipeline_first_stage=first,
            is_pipeline_last_stage=last,
        )
        tokens_seen.append(batch["tokens"] is not None)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss(output_tensor):  # as pretrain_gpt.py's loss_func: the masked sum and its token count
            total = (output_tensor.float() * batch["loss_mask"]).sum()
            tokens = batch["loss_mask"].sum().to(torch.int)
            return total, tokens, {"lm loss": (total / tokens).detach()}

        return output, loss

    losses, shapes = [], []
    u_start = [c.projection.detach().clone() for c in codecs]
    for step in range(steps):
        args.curr_iteration = step  # as Megatron-LM's train loop sets it before each step
        # train_step's loop: `while rerun_state_machine.should_run_forward_backward(data_iterator)`
        for _ in range(2 if step in rerun_steps else 1):
            for chunk in chunks:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            with recording_p2p() as sent:
                reports = schedule(
                    forward_step_func=forward_step,
                    data_iterator=iter(batches),
                    model=chunks,
                    num_microbatches=MICRO_BATCHES,
                    seq_length=SEQ,
                    micro_batch_size=MICRO_BATCH,
                    forward_only=False,
                )
        shapes += sorted({shape for _, _, shape in sent})
        updated, _, _ = optimizer.step()
        assert updated
        if step == reload_after:
            optimizer.load_state_dict(optimizer.state_dict())
        if last:
            losses.append(float(torch.stack([r["lm loss"] for r in reports]).mean()))
    if overlap:  # the last step's all-gather waits for the next forward: Megatron-LM forces it before a save
        for chunk in chunks:
            chunk.start_param_sync(force_sync=True)
    return {
        "losses": losses,
        "p2p_shapes": shapes,
        "tokens_on_every_micro_batch": all(tokens_seen),
        "codecs": sorted(name for name, _ in model.named_children() if name.startswith("mapl_")),
        "u_moved": [float((c.projection - u0).abs().max()) for c, u0 in zip(codecs, u_start)],
        "u": [c.projection.detach().clone() for c in codecs],
        "anchors": [c.anchor_basis.detach().float().clone() for c in codecs],
        "codebooks": [c.vq.codebooks.detach().clone() for c in codecs if c.vq is not None],
        **reads,
        # what Megatron-LM's checkpoints save of the model: MAPL's state included
        "saved": {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("mapl_")},
    }


def test_mapl_in_megatron_lm_sends_r_wide_and_keeps_replicas_identical():
    """8x: the schedule's P2P carries [s, b, d / 8] both ways; both replicas of U move, and move alike; the
    last stage got the token ids from Megatron-LM's batch function; the codecs are the model's submodules."""
    sender, receiver = run_distributed(_megatron_lm_steps, 2, ["--mapl-ratio", "8"], 2, timeout=240)
    assert sender["p2p_shapes"] == receiver["p2p_shapes"] == [(SEQ, MICRO_BATCH, 4)] * 2
    assert sender["codecs"] == ["mapl_send_0"] and receiver["codecs"] == ["mapl_recv_0"]
    assert receiver["tokens_on_every_micro_batch"] and sender["tokens_on_every_micro_batch"]
    assert min(sender["u_moved"]) > 1e-4, sender["u_moved"]
    assert torch.equal(sender["u"][0], receiver["u"][0])
    assert torch.equal(sender["anchors"][0], receiver["anchors"][0])  # Adam on both stages, summed gradients
    saved = {key.split(".", 1)[1] for key in sender["saved"]}
    assert {"projection", "projection_momentum", "anchor_embedding", "anchor_basis"} <= saved, saved
    assert sender["saved"]["mapl_send_0.projection_momentum"].abs().max() > 0
    assert all(torch.isfinite(torch.tensor(receiver["losses"])))


def test_the_fp8_wire_in_megatron_lm_sends_codec_messages_both_ways():
    """--mapl-wire fp8 at 4x in bytes: r = 2d / 4 = 16 values of one byte per token plus one scale byte per 16,
    after a 16-byte header, sent as one message of fp32 elements each way; it trains and the replicas agree."""
    flags = ["--mapl-ratio", "4", "--mapl-wire", "fp8"]
    sender, receiver = run_distributed(_megatron_lm_steps, 2, flags, 3, timeout=240)
    message = 16 + SEQ * MICRO_BATCH * (16 + 1)
    assert sender["p2p_shapes"] == receiver["p2p_shapes"] == [(1, 1, message // 4)] * 3
    assert torch.equal(sender["u"][0], receiver["u"][0]) and min(sender["u_moved"]) > 1e-4
    assert receiver["losses"][-1] < receiver["losses"][0], receiver["losses"]


def test_the_default_wire_in_bf16_megatron_lm_sends_fp8_codec_messages():
    """--mapl-ratio 4 with --bf16 and no --mapl-wire (auto): the FP8 wire, r = 2d / 4 = 16 values of one byte per
    token plus one scale byte per 16, after a 16-byte header, sent as one message of bf16 elements each way."""
    sender, receiver = run_distributed(_megatron_lm_steps, 2, ["--mapl-ratio", "4"], 2, bf16=True, timeout=240)
    message = 16 + SEQ * MICRO_BATCH * (16 + 1)
    assert sender["p2p_shapes"] == receiver["p2p_shapes"] == [(1, 1, message // 2)] * 2
    u = sender["saved"]["mapl_send_0.projection"]  # Float16Module wraps the model: its state dict holds the codecs
    assert u.shape == (32, 16) and torch.equal(u, receiver["saved"]["mapl_recv_0.projection"])


def test_the_topk_wire_in_megatron_lm_sends_k_values_and_their_positions_both_ways():
    """--mapl-wire topk at 4x in bytes: U is d x d (32), each token sends its 11 largest values of z in FP8, a
    32-bit mask and a scale byte (16 bytes, no header), as one message of fp32 elements each way; it trains,
    U moves and the replicas agree."""
    flags = ["--mapl-ratio", "4", "--mapl-wire", "topk"]
    sender, receiver = run_distributed(_megatron_lm_steps, 2, flags, 3, timeout=240)
    assert sender["p2p_shapes"] == receiver["p2p_shapes"] == [(1, 1, SEQ * MICRO_BATCH * 16 // 4)] * 3
    assert sender["u"][0].shape == (32, 32) and torch.equal(sender["u"][0], receiver["u"][0])
    assert min(sender["u_moved"]) > 1e-5  # 8.9e-5 observed (3 steps; gradients only through the k sent)
    assert receiver["losses"][-1] < receiver["losses"][0], receiver["losses"]


def test_the_int5_wire_in_megatron_lm_sends_5_bit_codes_both_ways():
    """--mapl-wire int5 at 4x in bytes: 16 bytes per token hold r = 16 values (10 bytes of codes, a scale byte, an
    exponent byte; no header), as one message of fp32 elements each way; it trains, U moves, the replicas agree."""
    flags = ["--mapl-ratio", "4", "--mapl-wire", "int5"]
    sender, receiver = run_distributed(_megatron_lm_steps, 2, flags, 3, timeout=240)
    assert sender["p2p_shapes"] == receiver["p2p_shapes"] == [(1, 1, SEQ * MICRO_BATCH * 12 // 4)] * 3
    assert sender["u"][0].shape == (32, 16) and torch.equal(sender["u"][0], receiver["u"][0])
    assert min(sender["u_moved"]) > 1e-4
    assert receiver["losses"][-1] < receiver["losses"][0], receiver["losses"]


def test_the_warm_up_on_the_int5_wire_sends_d_wide_5_bit_messages_then_z():
    """--mapl-warmup-steps 2 with --mapl-wire int5: Megatron-LM's iterations 0 and 1 send the warm-up's d = 32 values
    per token on the 5-bit wire (20 bytes of codes, a scale byte, an exponent byte: 22 bytes instead of fp32's 128),
    2 and 3 z (r = 16: 12 bytes), each as one message of fp32 elements both ways. The first step is the stock
    model's up to the 5-bit rounding of h; U moves and the replicas agree."""
    flags = ["--mapl-ratio", "4", "--mapl-wire", "int5", "--mapl-warmup-steps", "2"]
    plain = run_distributed(_megatron_lm_steps, 2, [], 1, timeout=240)[1]
    sender, receiver = run_distributed(_megatron_lm_steps, 2, flags, 4, timeout=240)
    warm, after = (1, 1, SEQ * MICRO_BATCH * 22 // 4), (1, 1, SEQ * MICRO_BATCH * 12 // 4)
    assert sender["p2p_shapes"] == receiver["p2p_shapes"] == [warm] * 2 + [after] * 2, sender["p2p_shapes"]
    first, stock = receiver["losses"][0], plain["losses"][0]
    assert first != stock and abs(first - stock) < 1e-3 * stock, (first, stock)
    assert torch.equal(sender["u"][0], receiver["u"][0]) and min(sender["u_moved"]) > 1e-4


def test_per_token_loss_scales_u_like_every_other_gradient():
    """--calculate-per-token-loss: the loss is a sum and megatron-core divides the gradients by the batch's tokens
    afterwards. With equal micro-batches that is the same training as the mean loss, U included (its gradient was
    left 64x too large here, so --clip-grad shrank every update)."""
    mean = run_distributed(_megatron_lm_steps, 2, ["--mapl-ratio", "8"], 2, timeout=240)
    per_token = run_distributed(
        _megatron_lm_steps, 2, ["--mapl-ratio", "8", "--calculate-per-token-loss"], 2, timeout=240
    )
    for a, b in zip(mean, per_token):
        assert (a["u"][0] - b["u"][0]).abs().max() < 1e-6, (a["u"][0] - b["u"][0]).abs().max()
        assert (a["anchors"][0] - b["anchors"][0]).abs().max() < 1e-6
    assert mean[1]["losses"] == pytest.approx(per_token[1]["losses"], rel=1e-6)


@pytest.mark.parametrize("vq", [False, True], ids=["mapl", "mapl-vq"])
def test_a_step_megatron_lm_runs_twice_trains_as_once(vq):
    """Megatron-LM's rerun state machine (``--rerun-mode validate_results``, its default) re-runs a step's
    forward-backward after zeroing the model's gradients: U's gradient and the codebook statistics, kept outside
    the model's gradient buffers, were counted twice."""
    flags = ["--mapl-ratio", "8"] + (["--mapl-vq-levels", "2", "--mapl-vq-codes", "16"] if vq else [])
    once = run_distributed(_megatron_lm_steps, 2, flags, 3, timeout=240)
    twice = run_distributed(_megatron_lm_steps, 2, flags, 3, (1,), timeout=240)  # the second step re-run
    for a, b in zip(once, twice):
        assert (a["u"][0] - b["u"][0]).abs().max() < 1e-6, (a["u"][0] - b["u"][0]).abs().max()
        for book_a, book_b in zip(a["codebooks"], b["codebooks"]):
            assert (book_a - book_b).abs().max() < 1e-6, (book_a - book_b).abs().max()
    assert once[1]["losses"] == pytest.approx(twice[1]["losses"], rel=1e-6)
    assert len(once[0]["codebooks"]) == int(vq) and all(book.abs().max() > 0 for book in once[0]["codebooks"])


def test_a_model_config_with_variable_seq_lengths_keeps_megatron_cores_shape_messages():
    """A custom model provider's ``variable_seq_lengths``: the schedule must still send each tensor's shape first
    (MAPL's view of the config turned it off, so sequences of another length would have hung); the FP8 wire, whose
    messages have one size, is refused in one line naming the flag."""
    flags, variable = ["--mapl-ratio", "8"], {"variable_seq_lengths": True}
    plain = run_distributed(_megatron_lm_steps, 2, flags, 1, timeout=240)[0]["p2p_shapes"]
    sender, receiver = run_distributed(_megatron_lm_steps, 2, flags, 2, config_overrides=variable, timeout=240)
    assert (3,) not in plain and (3,) in sender["p2p_shapes"], (plain, sender["p2p_shapes"])  # [s, b, r] as int64
    assert (SEQ, MICRO_BATCH, 4) in sender["p2p_shapes"] and torch.equal(sender["u"][0], receiver["u"][0])
    with pytest.raises(DistributedTestError, match="--mapl-wire fp8 with a model whose config sets variable_seq_len"):
        fp8 = ["--mapl-ratio", "4", "--mapl-wire", "fp8"]
        run_distributed(_megatron_lm_steps, 2, fp8, 1, config_overrides=variable, timeout=240)


@pytest.mark.parametrize(
    "tp, overlap", [(1, False), (1, True), (2, False)], ids=["sync", "overlap-grad-reduce-and-param-gather", "tp2-sp"]
)
def test_the_distributed_optimizer_trains_mapl_like_ddp_and_keeps_the_pairs_anchor_tables_equal(tp, overlap):
    """PP=2 x DP=2 (x TP=2 with SP), megatron-core's DistributedOptimizer against plain DDP + Adam: the same losses,
    U and anchor tables, and every replica of every table equal. Anchor rank 256 makes the tables larger than a
    data-parallel shard, so the two stages split them at different elements; before the fix the pair's tables
    drifted apart (by 0.05 after 3 steps). With --overlap-param-gather every read of the anchors waits for their
    all-gather."""
    flags = ["--mapl-ratio", "8", "--mapl-anchor-rank", "256", "--mapl-anchor-init", "random"]
    world = 4 * tp  # stage 0: the first half of the ranks, stage 1 the second
    ddp = run_distributed(_megatron_lm_steps, world, flags, 3, tensor_parallel=tp, timeout=240)
    sharded = run_distributed(
        _megatron_lm_steps, world, flags, 3, distributed_optimizer=True, overlap=overlap, tensor_parallel=tp,
        timeout=240,
    )  # fmt: skip
    names = ("anchor_embedding", "anchor_basis", "anchor_position", "projection")
    for rank in range(world):
        assert sharded[rank]["losses"] == pytest.approx(ddp[rank]["losses"], rel=1e-6)
        for key, value in sharded[rank]["saved"].items():
            if key.split(".", 1)[1] in names:
                assert (value - ddp[rank]["saved"][key]).abs().max() < 1e-6, (rank, key)
    tables = [{k.split(".", 1)[1]: v for k, v in result["saved"].items()} for result in sharded]
    for name in names:
        assert all(torch.equal(tables[0][name], table[name]) for table in tables), name
    if overlap:  # the receiver reads its anchors first thing in the step, long before its bucket's other params
        assert all(result["anchor_reads_in_flight"] == 0 for result in sharded)
        assert sharded[world // 2]["anchor_reads"] > 0


def test_the_warm_up_sends_d_wide_then_z_and_trains_like_ddp_under_the_overlapped_distributed_optimizer():
    """--mapl-warmup-steps 2 at PP=2 x DP=2: Megatron-LM's iterations 0 and 1 send h_rec + alpha (h - h_rec) d wide
    (32) both ways, 2 and 3 z (r = 4); the first step's loss is the stock model's (alpha 1: the receiver gets h);
    under the DistributedOptimizer with --overlap-grad-reduce and --overlap-param-gather (the receiver's anchors,
    idle in the warm-up, still join their buckets) it trains like plain DDP and every anchor replica stays equal."""
    flags = ["--mapl-ratio", "8", "--mapl-warmup-steps", "2", "--mapl-wire", "bf16"]
    plain = run_distributed(_megatron_lm_steps, 4, [], 1, timeout=240)
    ddp = run_distributed(_megatron_lm_steps, 4, flags, 4, timeout=240)
    sharded = run_distributed(_megatron_lm_steps, 4, flags, 4, distributed_optimizer=True, overlap=True, timeout=240)
    for rank in range(4):
        assert sharded[rank]["p2p_shapes"] == [(SEQ, MICRO_BATCH, 32)] * 2 + [(SEQ, MICRO_BATCH, 4)] * 2
        assert sharded[rank]["losses"] == pytest.approx(ddp[rank]["losses"], rel=1e-6)
    assert sharded[2]["losses"][0] == pytest.approx(plain[2]["losses"][0], rel=1e-6)
    tables = [{k.split(".", 1)[1]: v for k, v in result["saved"].items()} for result in sharded]
    for name in ("anchor_embedding", "anchor_basis", "anchor_position", "projection"):
        assert all(torch.equal(tables[0][name], table[name]) for table in tables), name
    assert min(sharded[0]["u_moved"]) > 1e-4
    assert all(result["anchor_reads_in_flight"] == 0 for result in sharded)


def test_the_warm_up_counts_megatron_lms_iterations_done_in_training_validation_and_skip_train():
    """Megatron-LM (core_r0.19.0 ``training.py``) sets ``args.curr_iteration`` before each training step to the
    iterations done, and validates after the step's ``iteration += 1`` with it unchanged; ``--skip-train`` sets none
    and validates the checkpoint at ``args.iteration``: the warm-up's alpha must follow the iterations done."""
    from argparse import Namespace

    from megatron_taco.mapl.megatron_lm import iterations_done

    assert iterations_done(Namespace(curr_iteration=3, iteration=0), forward_only=False) == 3
    assert iterations_done(Namespace(curr_iteration=3, iteration=0), forward_only=True) == 4
    assert iterations_done(Namespace(iteration=7), forward_only=True) == 7


def test_the_distributed_optimizer_in_bf16_keeps_every_anchor_replica_equal():
    """bf16 as Megatron-LM runs it (Float16Module, bf16 gradient buffers): every replica of U and of the anchor tables
    bit-equal after 3 steps (without the owners' gather the pair's tables drifted by 0.049), and the losses within
    bf16's rounding of the fp32 DDP run's."""
    flags = ["--mapl-ratio", "8", "--mapl-anchor-rank", "256", "--mapl-anchor-init", "random"]
    fp32 = run_distributed(_megatron_lm_steps, 4, flags, 3, timeout=240)
    bf16 = run_distributed(_megatron_lm_steps, 4, flags, 3, distributed_optimizer=True, bf16=True, timeout=240)
    tables = [{k.split(".", 1)[1]: v for k, v in result["saved"].items()} for result in bf16]
    for name in ("anchor_embedding", "anchor_basis", "anchor_position", "projection"):
        assert all(torch.equal(tables[0][name], table[name]) for table in tables), name
    drift = max(abs(a - b) / b for rank in (2, 3) for a, b in zip(bf16[rank]["losses"], fp32[rank]["losses"]))
    assert drift < BF16_LOSS_DRIFT, drift


def test_the_pairs_anchor_tables_stay_equal_after_the_distributed_optimizer_loads_its_state():
    """megatron-core's DistributedOptimizer.load_state_dict without Apex / TE (torch's Adam) gives every parameter
    one shared ``step`` tensor, which each later step then advances once per parameter a rank holds: the two stages'
    owners of an anchor element counted other steps, bias-corrected differently and their tables drifted apart
    (found by review, 2026-12-05). MAPL gives each parameter its own step again."""
    flags = ["--mapl-ratio", "8", "--mapl-anchor-rank", "256", "--mapl-anchor-init", "random"]
    results = run_distributed(_megatron_lm_steps, 4, flags, 3, distributed_optimizer=True, reload_after=0, timeout=240)
    tables = [{k.split(".", 1)[1]: v for k, v in result["saved"].items()} for result in results]
    for name in ("anchor_embedding", "anchor_basis", "anchor_position", "projection"):
        assert all(torch.equal(tables[0][name], table[name]) for table in tables), name


def test_mapl_at_full_width_trains_like_megatron_lm_without_it():
    """r = d loses nothing: the same losses as without MAPL (only the anchors' and U's rounding differs). Without
    clipping: U's gradient counts in the clipped norm, so with --clip-grad the coefficients differ."""
    plain = run_distributed(_megatron_lm_steps, 2, ["--clip-grad", "0"], 3, timeout=240)[1]["losses"]
    flags = ["--clip-grad", "0", "--mapl-ratio", "1"]
    full = run_distributed(_megatron_lm_steps, 2, flags, 3, timeout=240)[1]["losses"]
    assert len(plain) == len(full) == 3
    assert max(abs(a - b) / a for a, b in zip(plain, full)) < 1e-5, (plain, full)
    assert plain[-1] < plain[0]  # it trains


def test_mapl_widths_are_checked_against_megatron_lms_interleaved_chunks_at_parse_time():
    """Megatron-LM sets the chunks per stage after parsing (validate_args): the check counts them itself."""
    import argparse

    from megatron_taco.config.errors import MaplConfigError
    from megatron_taco.config.mapl import add_mapl_args
    from megatron_taco.mapl import megatron_lm

    def configure(*flags, overlap=False, **given):
        args = add_mapl_args(argparse.ArgumentParser()).parse_args(list(flags))
        megatron = dict(hidden_size=64, num_layers=8, pipeline_model_parallel_size=2, position_embedding_type="rope")
        megatron.update(tensor_model_parallel_size=1, world_size=2)
        megatron.update({"num_layers_per_virtual_pipeline_stage": 1, "overlap_p2p_comm": overlap, **given})
        return megatron_lm.configure(argparse.Namespace(**vars(args), **megatron))

    try:
        assert configure("--mapl-ranks", "8,8,8,8,8,8,8").ranks == (8,) * 7  # 2 stages x 4 chunks: 7 boundaries
        with pytest.raises(MaplConfigError, match="--mapl-ranks: 1 values given for 7 pipeline boundaries"):
            configure("--mapl-ranks", "8")
        # the interleaved schedule overlaps its P2P (Megatron-LM's default there): the FP8 wire says so up front
        assert configure("--mapl-ratio", "8", "--mapl-wire", "fp8").wire_rank(64) == 16
        with pytest.raises(MaplConfigError, match="add --no-overlap-p2p-communication"):
            configure("--mapl-ratio", "8", "--mapl-wire", "fp8", overlap=True)
        # the embedding and the loss counted as layers: (8 + 2) / 2 stages / 1 layer = 5 chunks, 9 boundaries
        split = dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
        assert configure("--mapl-ranks", ",".join(["8"] * 9), **split).ranks == (8,) * 9
        # a layout of 6 stages on 2 ranks: 3 chunks each, 5 boundaries (the FP8 wire's overlap check applies)
        layout = dict(num_layers_per_virtual_pipeline_stage=None, pipeline_model_parallel_layout="Et|tt|tt|tt|tt|tL")
        assert configure("--mapl-ranks", "8,8,8,8,8", **layout).ranks == (8,) * 5
        with pytest.raises(MaplConfigError, match="add --no-overlap-p2p-communication"):
            configure("--mapl-ratio", "8", "--mapl-wire", "fp8", overlap=True, **layout)
        with pytest.raises(MaplConfigError, match="--mapl-\\* with --use-tp-pp-dp-mapping"):
            configure("--mapl-ratio", "8", use_tp_pp_dp_mapping=True)
        # the distributed optimizer at DP=2 trains (test_the_distributed_optimizer_...); FSDP shards the anchors
        dense = dict(num_layers_per_virtual_pipeline_stage=None)
        assert configure("--mapl-ratio", "8", use_distributed_optimizer=True, world_size=4, **dense)
        with pytest.raises(MaplConfigError, match="with --use-megatron-fsdp at data-parallel size 2: FSDP shards"):
            configure("--mapl-ratio", "8", use_megatron_fsdp=True, world_size=4, **dense)
        instances = dict(use_distributed_optimizer=True, num_distributed_optimizer_instances=2, world_size=8)
        with pytest.raises(MaplConfigError, match="with --num-distributed-optimizer-instances 2: MAPL gathers"):
            configure("--mapl-ratio", "8", **instances, **dense)
        # --use-checkpoint-args without --hidden-size: the widths are checked when the model is built
        assert configure("--mapl-ratio", "8", hidden_size=None, **dense).ratio == 8
    finally:
        megatron_lm._STATE["cfg"] = None


def test_the_default_wire_is_the_one_of_most_rank_and_says_why():
    """--mapl-wire auto (the default): a --mapl-ratio run with a 2-byte pipeline dtype gets the wire that keeps the
    most rank within the ratio's bytes (the loss follows the rank, mapl_loopback.md): INT5 at hidden 512 and 8x
    (192 against FP8's 128), FP8 where INT5 keeps no more (hidden 64: 16 each); every other run keeps bf16 and the
    reason is in the start-up line; a wire given on the command line is taken as given."""
    import argparse

    from megatron_taco.config.mapl import add_mapl_args
    from megatron_taco.mapl import megatron_lm

    def configure(*flags, **given):
        args = add_mapl_args(argparse.ArgumentParser()).parse_args(list(flags))
        megatron = dict(hidden_size=64, num_layers=8, pipeline_model_parallel_size=2, position_embedding_type="rope")
        megatron.update(tensor_model_parallel_size=1, world_size=2)
        megatron.update({"bf16": True, **given})
        cfg = megatron_lm.configure(argparse.Namespace(**vars(args), **megatron))
        return cfg.wire, cfg.wire_rank(megatron["hidden_size"] or 64), cfg.wire_choice

    try:
        assert configure("--mapl-ratio", "8") == (
            "fp8",
            16,
            "--mapl-wire auto: fp8, the most rank within the ratio's bytes per token: 16 (BF16 8, INT5 16)",
        )
        assert configure("--mapl-ratio", "8", hidden_size=512) == (
            "int5",
            192,
            "--mapl-wire auto: int5, the most rank within the ratio's bytes per token: 192 (BF16 64, FP8 128)",
        )
        assert configure("--mapl-ratio", "8", bf16=False, fp16=True)[0] == "fp8"
        kept = {
            "2-byte pipeline dtype, not 4-byte": configure("--mapl-ratio", "8", bf16=False),
            "--mapl-rank / --mapl-ranks set the width": configure("--mapl-rank", "8"),
            "--mapl-vq-levels sends code indices": configure("--mapl-ratio", "8", "--mapl-vq-levels", "1"),
            "the most rank within the ratio's bytes per token: 64 (INT5 64)": configure("--mapl-ratio", "1"),
            "the most rank within the ratio's bytes per token: 4": configure("--mapl-ratio", "16"),
            "virtual pipeline stages overlap their P2P": configure(
                "--mapl-ratio", "8", num_layers_per_virtual_pipeline_stage=1, overlap_p2p_comm=True
            ),
        }
        for reason, (wire, rank, why) in kept.items():
            assert wire == "bf16" and why.startswith("--mapl-wire auto: bf16, ") and reason in why, (reason, why)
        assert kept["--mapl-rank / --mapl-ranks set the width"][1] == 8
        assert configure("--mapl-ratio", "8", hidden_size=None)[2].endswith("not known before the model is built")
        assert configure("--mapl-ratio", "8", "--mapl-wire", "bf16") == ("bf16", 8, None)
        assert configure("--mapl-ratio", "8", "--mapl-wire", "fp8", bf16=False) == ("fp8", 16, None)
    finally:
        megatron_lm._STATE["cfg"] = None


def _read_checkpoint_args(saved_flags, run_flags, directory):
    """A torch_dist checkpoint's common state (the saved run's args, as Megatron-LM parsed them) in megatron-core's
    layout, read back as Megatron-LM's load_checkpoint first reads it, under this run's flags (launcher hooks
    installed): (exit code or None, stderr)."""
    import contextlib
    import io
    import os
    import sys

    import torch.distributed as dist
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.training import arguments, checkpointing

    from megatron_taco.launch import install_hooks

    install_hooks()

    def parse(mapl_flags):
        sys.argv = ["pretrain_gpt.py", *FLAGS, *mapl_flags, "--bf16"]
        return arguments.parse_args()

    saved = parse(saved_flags)
    path = os.path.join(directory, "iter_0000001")
    if dist.get_rank() == 0:  # the files rank 0 writes (no sharded tensors: the common state and the format)
        os.makedirs(path)
        torch.save({"args": saved, "iteration": 1}, os.path.join(path, "common.pt"))
        save_config(CheckpointingConfig("torch_dist"), path)
        with open(checkpointing.get_checkpoint_tracker_filename(directory), "w") as f:
            f.write("1")
    dist.barrier()
    dist.destroy_process_group()  # read as before initialisation: with a process group the reader takes CUDA
    args = parse(run_flags)  # no global args yet: as with --use-checkpoint-args, before Megatron-LM sets them
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            checkpointing._load_base_checkpoint(directory, args, rank0=True)
        except SystemExit as exc:
            return exc.code, err.getvalue()
    return None, err.getvalue()


def test_a_checkpoint_of_other_mapl_widths_stops_the_load_with_one_line(tmp_path):
    """A checkpoint saved with the bf16 wire (the default before auto) read by a run at the default (auto: FP8, twice
    the rank): one line on rank 0 naming the flags, exit 2, before any tensor is loaded; the same flags load on."""
    bf16 = ["--mapl-ratio", "4", "--mapl-wire", "bf16"]
    old, new = (
        run_distributed(_read_checkpoint_args, 2, bf16, flags, str(tmp_path / name), timeout=240)
        for name, flags in (("old", ["--mapl-ratio", "4"]), ("same", bf16))
    )
    assert [code for code, _ in old] == [2, 2]
    assert old[0][1] == (
        f"error: --load {tmp_path / 'old'}: its MAPL boundaries were saved with --mapl-ratio 4 --mapl-wire bf16, this "
        "run has --mapl-ratio 4 --mapl-wire fp8 (--mapl-wire auto: fp8, the most rank within the ratio's bytes per "
        "token: 16 (BF16 8, INT5 16)); resume with the flags it was saved with\n"
    )
    assert old[1][1] == ""  # one line, on rank 0
    assert [code for code, _ in new] == [None, None]
