"""Train a GPT/Qwen-style model on megatron-core alone (no Megatron-LM checkout needed).

    torchrun --nproc-per-node 2 examples/pretrain_gpt.py --config configs/gpt-tiny.yaml

Runs on GPUs with NCCL, or on CPU with gloo when no GPU is present.
"""

import warnings

# megatron-core announces on import, once per rank, the optional packages it falls back from (Transformer
# Engine, Apex, absl): this trainer uses none of them.
warnings.filterwarnings("ignore", message=".* not installed", category=UserWarning, module=r"megatron\.core")

from megatron_taco.training.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
