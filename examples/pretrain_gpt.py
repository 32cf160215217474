"""Train a GPT/Qwen-style model on megatron-core alone (no Megatron-LM checkout needed).

    torchrun --nproc-per-node 2 examples/pretrain_gpt.py --config configs/gpt-tiny.yaml

Runs on GPUs with NCCL, or on CPU with gloo when no GPU is present.
"""

from megatron_taco.training.cli import main

if __name__ == "__main__":
    main()
