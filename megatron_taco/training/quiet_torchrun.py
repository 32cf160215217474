"""torchrun without its own failure report, for ``scripts/run.sh``.

    python -m megatron_taco.training.quiet_torchrun [torchrun flags] examples/pretrain_gpt.py [trainer flags]

A trainer rank that stops on a bad input or on Ctrl-C says why in one line (rank 0); torchrun would then
add a traceback of its own, a table of the failed ranks and its log lines. This runs torchrun with the
same flags and exits with the ranks' exit code instead: silently, or with one line when a rank was killed
by a signal (which leaves the rank no chance to say anything).
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import List, Optional

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    """Run torchrun's launcher; the exit code of the first rank that failed (128 + N after signal N)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    for name in list(logging.root.manager.loggerDict):  # its warnings repeat what the ranks say
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode < 0:
            print(f"error: rank {rank} was killed by {signal.Signals(-failure.exitcode).name}", file=sys.stderr)
            return 128 - failure.exitcode
        return failure.exitcode
    except SignalException as exc:  # Ctrl-C or kill: torchrun passed the signal on to the ranks, which said so
        return 128 + exc.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main())
