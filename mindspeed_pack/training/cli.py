"""What the training scripts share around their ``main``: logging and bad-input exits."""
from __future__ import annotations

import logging
import sys

from mindspeed_pack.checkpoint.errors import CheckpointError
from mindspeed_pack.config.errors import ArgumentError
from mindspeed_pack.datasets.packed_documents import DataError
from mindspeed_pack.runtime.disk import DiskFullError
from mindspeed_pack.runtime.peers import PeerFailure
from mindspeed_pack.runtime.process_groups import LaunchError
from mindspeed_pack.runtime.rendezvous import RendezvousTimeout
from mindspeed_pack.training.trainer import NonFiniteLossError


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # keep the console for our step lines


def run_cli(script: str, main) -> None:
    """Run ``main()``; bad input (data, checkpoint) ends with one ``error:`` line and exit 2,
    a diverged run (``--nan-policy stop``) with one line naming the iteration and exit 1, a dead or
    hung peer with one line naming what this rank waited for and exit 1 (torchrun then restarts)."""
    try:
        main()
    # the message says what and where (or how to start); ArgumentError: a check after the parser's (a stage's flags)
    except (CheckpointError, DataError, LaunchError, ArgumentError) as e:
        print(f"{script}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except (NonFiniteLossError, PeerFailure, RendezvousTimeout, DiskFullError) as e:
        print(f"{script}: error: {e}", file=sys.stderr)
        sys.exit(1)
